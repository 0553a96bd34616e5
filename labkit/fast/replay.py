"""The update's forward from the rollout's: what the decoder's products gave, kept
(`Recording`), stands in for the products of the update's first teacher-forced pass.

Within a step the update runs the policy over the tokens its rollout has just decoded, with
the same weights, so every product of that forward was already computed: by the prefill
(the prompts) and the decode steps (the completions). A `Recording` keeps them per layer:
q, k and v, the residual stream after attention, gate and up, the residual stream after the
MLP, and the logits. `labkit.fast.training.backbone` given a `Replay` takes those in place
of its products, through `replayed`, an autograd function whose forward returns the kept
outputs and whose backward is the products' own (gradients of the input, the weights and
the biases); the norms, rotary embeddings, attention and activation are recomputed, since
the backward needs them. The log-probs are then the decoder's, which differ from a
teacher-forced pass's in the last bits (`tests/test_replay.py`).

A recording serves only while it holds (`Recording.serves`): the same model, no parameter
changed since (their version counters), products in the same dtype. After the update's
first optimizer step the weights have moved and the passes compute again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

REPLAY_MIN_PARAMS = 4_000_000
"""The smallest model whose rollout keeps its outputs: below it a product costs about what
the autograd function that replaces it does."""
REPLAY_MAX_BYTES = 1 << 30
"""The most memory a recording may take (all layers, prompts and completions); a rollout
that would need more keeps nothing and the update computes its products."""

KINDS = ("qkv", "mid", "gate_up", "out")
"""What a layer keeps, in this order: the q, k, v product (q scaled by 1/sqrt(D) where the
decoder folds the scale into it), the residual stream after attention, the gate, up product
and the residual stream after the MLP."""


class Replay(NamedTuple):
    """The kept outputs of one teacher-forced pass over (n, L) positions: per layer a tuple
    in the order of `KINDS`, each (n, L, width), and the logits (n, keep, V). The pass
    empties `layers` as it goes (`labkit.fast.training.backbone`)."""

    layers: list[tuple[Tensor, Tensor, Tensor, Tensor]]
    logits: Tensor


def weights_key(model) -> tuple:
    """What changes when a parameter does: each one's version counter and address."""
    return tuple((p._version, p.data_ptr()) for p in model.parameters())


class Recording:
    """A rollout's per-layer outputs: B prompts of P positions and N = B*G rows of up to
    T - 1 decode steps, in buffers reserved when the decoder starts (ordinary tensors, so
    that autograd can take them up after a rollout run in inference mode). The decode
    steps' buffers are held row by row, (N, steps, width), as the update's pass takes them:
    keeping a step's output is one copy of N runs of `width` values, and a pass over every
    row and step reads the buffers themselves (`completion_pass`). The buffers are not
    cleared: what a step that never ran would hold is never read (`ran`). The decoder hands
    each output to `sink(layer)` and the logits to `keep_logits`; `at` is None during the
    prefill, else the decode step."""

    def __init__(self, model, dtype, prompts: int, prompt_width: int, rows: int, steps: int,
                 widths: tuple[int, ...], vocab: int, device):
        self.model, self.dtype, self.key = model, dtype, weights_key(model)
        self.rows, self.steps, self.at = rows, steps, None
        self.ran = 0
        """Decode steps kept so far."""
        self.spent = False
        self._shape, self._widths, self._device = (prompts, prompt_width), widths, device
        self.prompt: list[list[Tensor]] = []
        self.completion: list[list[Tensor]] = []
        """Per layer and kind the decode steps' outputs, (N, steps, width)."""
        self.prompt_logits = torch.empty(prompts, vocab, dtype=dtype, device=device)
        self.step_logits = torch.empty(rows, steps, vocab, dtype=dtype, device=device)

    @staticmethod
    def size_bytes(layers: int, prompts: int, prompt_width: int, rows: int, steps: int,
                   widths: tuple[int, ...], vocab: int, dtype) -> int:
        """The bytes a recording of this shape holds: products in `dtype`, the residual
        stream in fp32, logits at each prompt's last position and at every decode step."""
        small = torch.empty((), dtype=dtype).element_size()
        per_position = sum(w * (4 if kind in ("mid", "out") else small)
                           for kind, w in zip(KINDS, widths))
        return layers * (prompts * prompt_width + rows * steps) * per_position + \
            (prompts + rows * steps) * vocab * small

    def add_layer(self) -> None:
        """Reserve the next layer's buffers."""
        dtypes = [torch.float32 if kind in ("mid", "out") else self.dtype for kind in KINDS]
        self.prompt.append([torch.empty(*self._shape, width, dtype=dtype, device=self._device)
                            for width, dtype in zip(self._widths, dtypes)])
        self.completion.append([torch.empty(self.rows, self.steps, width, dtype=dtype,
                                            device=self._device)
                                for width, dtype in zip(self._widths, dtypes)])

    def sink(self, layer: int):
        """keep(kind, output): layer `layer`'s output of KINDS[kind], (B, P, width) from the
        prefill, (N, width) from a decode step."""
        prompt, completion = self.prompt[layer], self.completion[layer]

        def keep(kind: int, output: Tensor) -> None:
            if self.at is None:
                prompt[kind].copy_(output)
            else:
                completion[kind][:, self.at].copy_(output)
        return keep

    def keep_logits(self, logits: Tensor) -> None:
        """The logits the head's product gave: (B, V) for each prompt's last position, or
        (N, V) at a decode step."""
        if self.at is None:
            self.prompt_logits.copy_(logits)
        else:
            self.step_logits[:, self.at].copy_(logits)
            self.ran = max(self.ran, self.at + 1)

    def serves(self, model, dtype) -> bool:
        """Whether the outputs are still `model`'s in `dtype`: the model that was recorded,
        no parameter changed since, products in the same dtype, and not `spent`."""
        return not self.spent and getattr(model, "module", model) is self.model and \
            dtype == self.dtype and weights_key(self.model) == self.key

    def prompt_pass(self, prompts: Tensor) -> Replay:
        """The outputs of the pass over the prompts `prompts` (u,) (keep = 1)."""
        layers = [tuple(_take(t, prompts) for t in kept) for kept in self.prompt]
        return Replay(layers, _take(self.prompt_logits, prompts)[:, None])

    def completion_pass(self, rows: Tensor, width: int) -> Replay:
        """The outputs of the pass over the first `width` completion tokens of `rows`. A
        pass over every row takes the buffers with it and leaves the recording `spent`: the
        update makes one such pass before its weights move (a later pass computes), and the
        pass lets each layer's buffers go once it has run the layer (`backbone`), so that
        what its graph does not keep (the raw q, k and v) is freed during the pass."""
        if width > self.ran:
            raise ValueError(f"{width} completion positions asked of a recording of "
                             f"{self.ran} decode steps (of {self.steps} reserved)")
        spend = rows.numel() == self.rows
        layers = []
        for i, kept in enumerate(self.completion):
            # every row and every step that ran: the buffers themselves (no copy)
            layers.append(tuple(_take(t[:, :width], rows).contiguous() for t in kept))
            if spend:  # the recording lets go of each layer's buffers as it hands them on
                self.completion[i] = None
        logits = _take(self.step_logits, rows)[:, :width]
        if spend:
            self.completion, self.step_logits, self.spent = [], None, True
        return Replay(layers, logits)


def _take(x: Tensor, index: Tensor) -> Tensor:
    """x's rows `index`: x itself when they are all of them in order (no copy)."""
    if index.numel() == x.shape[0] and bool((index == torch.arange(x.shape[0],
                                                                  device=index.device)).all()):
        return x
    return x.index_select(0, index)


class _Replayed(torch.autograd.Function):
    """Outputs y_i = inp @ W_i^T + b_i (+ residual) that were computed before: the forward
    hands them on, the backward is that of the products (and of the residual's sum)."""

    @staticmethod
    def forward(ctx, inp, residual, n, *tensors):
        weights, biases, outputs = tensors[:n], tensors[n:2 * n], tensors[2 * n:]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(inp, *weights)
        ctx.n, ctx.biases = n, tuple(b is not None for b in biases)
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in biases)
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        inp, *weights = ctx.saved_tensors
        n, needs = ctx.n, ctx.needs_input_grad
        rows = inp.reshape(-1, inp.shape[-1])
        grad_inp, grad_w, grad_b = None, [None] * n, [None] * n
        for i, (g, w) in enumerate(zip(grads, weights)):
            if g is None:
                continue
            g = g.reshape(-1, g.shape[-1]).to(inp.dtype)
            if needs[0]:
                w_in = w.to(inp.dtype)
                grad_inp = torch.mm(g, w_in) if grad_inp is None else grad_inp.addmm_(g, w_in)
            if needs[3 + i]:
                grad_w[i] = torch.mm(g.t(), rows).to(w.dtype)
            if ctx.biases[i] and needs[3 + n + i]:
                grad_b[i] = g.sum(0).to(ctx.bias_dtypes[i])
        if grad_inp is not None:
            grad_inp = grad_inp.view(inp.shape)
        grad_residual = grads[0] if needs[1] else None
        return (grad_inp, grad_residual, None, *grad_w, *grad_b, *([None] * n))


def replayed(inp: Tensor, residual: Tensor | None, weights: tuple, biases: tuple,
             outputs: tuple) -> tuple[Tensor, ...]:
    """`outputs`, each the value of inp @ W_i^T + b_i (plus `residual` for one output, the
    residual stream after the product), with the gradients the products would give: to
    `inp`, the weights, the biases and `residual`. Under autocast the backward's products
    run in `inp`'s dtype and each gradient comes back in its parameter's dtype, as for
    `F.linear` under autocast."""
    return _Replayed.apply(inp, residual, len(weights), *weights, *biases, *outputs)
