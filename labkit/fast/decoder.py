"""The rollout's prefill and decode steps: `Decoder`, and `decoder_or`, which picks it for the
models it covers.

The weights are packed once per rollout (q, k, v as one matrix with the attention scale
folded into q, gate and up as one, each RMSNorm's weight folded into the product after it,
cast to the dtype the caller picks, held in the form `weight_form` picks for the machine),
and keys and values go into fp32 buffers reserved for the whole completion, read by a KV
strategy (`labkit.fast.kv`) chosen when the decoder is built.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from labkit.fast import kernels as fused_kernels
from labkit.fast import replay
from labkit.fast.kv import FullCache, SharedPrefix
from labkit.fast.layer import attention_bias, compute_dtype, eps_of, head_dims, layer, rope_tables
from labkit.fast.support import decoder_stack, unsupported

SHARED_PREFIX_MIN_TOKENS = 64
"""Prompt length (padded) from which `decoder_or` reads each prompt's keys once per group
by default: below it, the extra operations cost more than the memory they save."""

CPU_LOW_PRECISION_MIN_PARAMS = 4_000_000
"""On a CPU, the decoder computes in fp32 under bf16 autocast when the model has fewer
parameters than this: its weights then sit in the caches and bf16 saves no memory traffic,
while bf16 products of this size run slower than fp32 ones (docs/performance.md)."""


def parameter_count(model) -> int:
    """The number of the model's parameters (a walk over its modules)."""
    return sum(p.numel() for p in model.parameters())


def rollout_dtype(model, params: int | None = None) -> torch.dtype:
    """The dtype of the rollout's matrix products: autocast's when it is on (except for a
    small model on a CPU, `CPU_LOW_PRECISION_MIN_PARAMS`), else the model's. `params`: the
    model's parameter count, when the caller has it."""
    first = next(model.parameters())
    if first.device.type == "cpu" and first.dtype == torch.float32:
        if (parameter_count(model) if params is None else params) < \
                CPU_LOW_PRECISION_MIN_PARAMS:
            return torch.float32
    return compute_dtype(model)


def decoder_or(plain: Callable, shared_prefix: bool | None = None,
               dtype: torch.dtype | None = None) -> Callable:
    """start(model, prompt_ids, group_size): a `Decoder` where `unsupported(model)` is None,
    else `plain(model, prompt_ids, group_size)`. `shared_prefix` None reads each prompt's
    keys once per group when the prompt is long enough for that to pay
    (`SHARED_PREFIX_MIN_TOKENS`). `dtype` None computes in `rollout_dtype(model)`; a dtype
    forces the products into it whatever the model's size."""

    def start(model, prompt_ids: Tensor, group_size: int):
        if unsupported(model) is not None:
            return plain(model, prompt_ids, group_size)
        shared = shared_prefix
        if shared is None:
            shared = group_size > 1 and prompt_ids.shape[1] >= SHARED_PREFIX_MIN_TOKENS
        params = parameter_count(model)  # counted once a rollout: a walk over the modules
        return Decoder(model, dtype or rollout_dtype(model, params), shared_prefix=shared,
                       checked=True, params=params)
    return start


class Packed(NamedTuple):
    """A packed product `x @ W^T + bias`: `matrix` is W in the `form` (see `weight_form`)."""

    matrix: Tensor
    bias: Tensor | None
    form: str


def _pack(linears, dtype, form: str, norm_weight: Tensor | None = None,
          q_scale: float | None = None) -> Packed:
    """The linears stacked along their outputs, cast to `dtype`, in `form` (see
    `weight_form`). `norm_weight` (in,) scales W's columns (the RMSNorm before it);
    `q_scale` scales the first linear's outputs (attention's 1/sqrt(D) on q). Weights held
    in `dtype` (and a norm weight too) are stacked, then scaled by the norm in one
    operation; others are scaled each in its own dtype and cast before the stacking, so
    the one full-size copy made is already in `dtype`. Either way every element is
    multiplied by the same factors in the same order."""
    first = linears[0]
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if q_scale is not None:
        weights[0] = first.weight * q_scale
        biases[0] = None if first.bias is None else first.bias * q_scale
    if all(w.dtype == dtype for w in weights) and \
            (norm_weight is None or norm_weight.dtype == dtype):
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        if norm_weight is not None:
            weight = weight * norm_weight
    else:
        if norm_weight is not None:
            weights = [w * norm_weight for w in weights]
        weights = [w.to(dtype) for w in weights]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    bias = None if biases[0] is None else torch.cat(biases).to(dtype)
    if form == "onednn":
        return Packed(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()), bias, form)
    if form == "in_out":
        return Packed(weight.t().contiguous(), bias, form)
    return Packed(weight.contiguous().t(), bias, form)


ONEDNN_MIN_PARAMS = CPU_LOW_PRECISION_MIN_PARAMS
"""A model's parameters from which a CPU rollout multiplies by oneDNN-packed weights
(`weight_form`): below it the weights sit in the caches, where MKL's product on a small
matrix costs less than oneDNN's call (some 15 us more a product, the embedded model's
rollout 1.5x as long)."""


def weight_form(dtype, device, params: int) -> str:
    """How a rollout holds its packed weights, by dtype, device and the model's parameters:

    - "onednn": on an x86 CPU whose oneDNN packs `dtype` (`onednn_packs`), for a model of
      `ONEDNN_MIN_PARAMS` or more, the weight in oneDNN's blocked layout, multiplied by
      `torch.ops.mkldnn._linear_pointwise`. At a decode step's few rows MKL streams weights
      that do not fit in the caches at about half the memory's speed; oneDNN's packed
      product ran the small model's rollout 0.86x as long (AVX2 kernels, fp32) and 0.87x
      (AVX-512 bf16), and a row's result does not change with the number of rows beside it
      (from 2 rows up), which MKL's does not promise (docs/performance.md).
    - "in_out": fp32 otherwise, W^T stored (in, out) for `mm(x, W^T)`: at 16 rows MKL runs
      the transposed view of (out, in) 1.4x (AVX2) to 5x (AVX-512) slower.
    - "out_in": W^T as a transposed view of the (out, in) matrix (other dtypes)."""
    if torch.device(device).type == "cpu" and params >= ONEDNN_MIN_PARAMS and \
            onednn_packs(dtype):
        return "onednn"
    return "in_out" if dtype == torch.float32 else "out_in"


@functools.cache
def onednn_packs(dtype) -> bool:
    """Whether torch's oneDNN packs a `dtype` weight on this CPU and multiplies with it as
    `mm` does: an x86 CPU with oneDNN, and for bf16 the instructions oneDNN's bf16 packing
    needs (it refuses without them). Probed once per dtype on a small matrix."""
    if platform.machine().lower() not in ("x86_64", "amd64") or \
            not torch.backends.mkldnn.is_available():
        return False
    with torch.no_grad(), torch.autocast("cpu", enabled=False):  # often asked under autocast
        weight = torch.linspace(-1, 1, 48 * 32).view(48, 32).to(dtype)
        x = torch.linspace(1, -1, 4 * 32).view(4, 32).to(dtype)
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        except (RuntimeError, AttributeError):
            return False
        want = torch.mm(x.float(), weight.float().t())
        return bool(torch.allclose(out.float(), want, atol=0.05, rtol=0.02))


def _matmul(x: Tensor, packed: Packed, dtype) -> Tensor:
    x = x if x.dtype == dtype else x.to(dtype)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # a decode step's are 2-D
    if packed.form == "onednn":
        out = torch.ops.mkldnn._linear_pointwise(rows, packed.matrix, packed.bias, "none", [],
                                                 "")
    elif packed.bias is None:
        out = torch.mm(rows, packed.matrix)
    else:
        out = torch.addmm(packed.bias, rows, packed.matrix)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def _residual(x: Tensor, inp: Tensor, packed: Packed, dtype) -> Tensor:
    """x + inp @ W^T (+ bias): one fused product on a decode step's fp32 rows."""
    if x.dim() == 2 and packed.matrix.dtype == x.dtype == inp.dtype:
        if packed.form == "onednn":
            return torch.ops.mkldnn._linear_pointwise.binary(inp, x, packed.matrix,
                                                             packed.bias, "add")
        if packed.bias is None:
            return torch.addmm(x, inp, packed.matrix)
    return x + _matmul(inp, packed, dtype)


class _PackedLayer:
    """`LayerOps` on packed weights: a norm is only x * rsqrt(mean(x^2) + eps), its weight
    being folded into the product after it; q, k and v come out of one product. `sink`,
    when set, is handed each product's output (`labkit.fast.replay.Recording.sink`)."""

    sink = None

    @torch.no_grad()
    def __init__(self, block, dtype, dims: tuple[int, int, int], form: str):
        attn, mlp = block.self_attn, block.mlp
        ln1, ln2 = block.input_layernorm, block.post_attention_layernorm
        self.dtype, (self.H, self.Hkv, self.D) = dtype, dims
        scale = self.D ** -0.5
        has_qk_norm = hasattr(attn, "q_norm")
        self.eps1, self.eps2 = eps_of(ln1), eps_of(ln2)
        # the attention scale is folded into q's rows unless a q norm follows them
        self.w_qkv = _pack([attn.q_proj, attn.k_proj, attn.v_proj], dtype, form, ln1.weight,
                           q_scale=None if has_qk_norm else scale)
        self.w_o = _pack([attn.o_proj], dtype, form)
        self.w_down = _pack([mlp.down_proj], dtype, form)
        self.w_gu = _pack([mlp.gate_proj, mlp.up_proj], dtype, form, ln2.weight)
        self.q_norm = self.k_norm = None
        if has_qk_norm:
            self.q_norm = (attn.q_norm.weight.float() * scale, eps_of(attn.q_norm))
            self.k_norm = (attn.k_norm.weight.float(), eps_of(attn.k_norm))

    def norm1(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, self.eps1)

    def norm2(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, self.eps2)

    def qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        H, Hkv, D = self.H, self.Hkv, self.D
        qkv = _matmul(h, self.w_qkv, self.dtype)
        if self.sink is not None:
            self.sink(0, qkv)
        q, k, v = qkv.unflatten(-1, (H + 2 * Hkv, D)).split([H, Hkv, Hkv], dim=-2)
        if q.dtype != torch.float32:  # q and k go on in fp32 (their norms and RoPE)
            q, k = q.float(), k.float()
        return q, k, v

    def qk_norm(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if self.q_norm is None:
            return q, k
        return F.rms_norm(q, (self.D,), *self.q_norm), F.rms_norm(k, (self.D,), *self.k_norm)

    def residual_o(self, x: Tensor, o: Tensor) -> Tensor:
        return self._kept(1, _residual(x, o, self.w_o, self.dtype))

    def gate_up(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self._kept(2, _matmul(h, self.w_gu, self.dtype)).chunk(2, dim=-1)

    def residual_down(self, x: Tensor, act: Tensor) -> Tensor:
        return self._kept(3, _residual(x, act, self.w_down, self.dtype))

    def fused_step(self, x: Tensor, kernels: fused_kernels.Kernels, cos: Tensor, sin: Tensor,
                   *cache) -> Tensor:
        """`layer` at a decode step, fp32 rows x (N, hidden), with the work between the
        products done by `labkit.fast.kernels`: the norms, RoPE and attention over this
        layer's cache (`cache`: a KV strategy's `kernel_inputs`), SwiGLU."""
        qkv = self._kept(0, _matmul(kernels.rms_rows(x, self.eps1), self.w_qkv, self.dtype))
        x = self.residual_o(x, kernels.rope_attend(qkv, cos, sin, *cache))
        gate_up = self._kept(2, _matmul(kernels.rms_rows(x, self.eps2), self.w_gu, self.dtype))
        return self.residual_down(x, kernels.swiglu(gate_up))

    def _kept(self, kind: int, output: Tensor) -> Tensor:
        if self.sink is not None:
            self.sink(kind, output)
        return output


class Decoder:
    """Prefill and decode for a rollout: B prompts, G rows per prompt, N = B*G rows.

    `dtype` is the dtype of the matrix products with weights (bf16 under autocast); the
    weights are packed and cast once, here. The residual stream, norms, rotary embeddings
    and attention stay fp32: on a CPU, bf16 gains nothing on a decode step's many small
    attention products and loses precision. Call `prefill` once, then `step` with each
    row's next token; both return fp32 logits (N, V) for the next position.
    `shared_prefix` picks the KV strategy: `SharedPrefix` (each prompt's keys and values
    read once per group) or `FullCache` (once per row). `params`: the model's parameter
    count where the caller has it (`decoder_or` counts once a rollout), else counted here.
    `fused`: decode steps through `labkit.fast.kernels` (True: for an fp32 model on a CPU,
    wherever they are built; None: also only under `kernels.FUSED_MAX_PARAMS`; False:
    never). `self.kernels` is what a decode step uses, or None.
    """

    @torch.no_grad()
    def __init__(self, model, dtype=torch.float32, shared_prefix: bool = False,
                 checked: bool = False, params: int | None = None, fused: bool | None = None):
        reason = None if checked else unsupported(model)
        if reason is not None:
            raise ValueError(f"the fast decoder cannot run this model: {reason}")
        base = decoder_stack(model)
        self.base, self.dtype = base, dtype
        self.params = parameter_count(model) if params is None else params
        self.H, self.Hkv, self.D = head_dims(base.config)
        self.embed = base.embed_tokens.weight
        form = weight_form(dtype, self.embed.device, self.params)
        self.head = _pack([model.lm_head], dtype, form, base.norm.weight)
        self.final_eps = eps_of(base.norm)
        self.layers = [_PackedLayer(block, dtype, (self.H, self.Hkv, self.D), form)
                       for block in base.layers]
        self.kernels = None
        if fused is not False and self._fusable(fused is None):
            self.kernels = fused_kernels.load()
        by_row = True if self.kernels is not None else None
        self.kv = SharedPrefix(by_row) if shared_prefix else FullCache(by_row)
        self.model, self.recording = model, None

    def _fusable(self, by_size: bool) -> bool:
        """Whether `labkit.fast.kernels` can run this decoder's steps (an fp32 model on a
        CPU, no q/k norms), and with `by_size` whether the model is small enough to gain."""
        if fused_kernels.held_off() or self.dtype != torch.float32 \
                or self.embed.dtype != torch.float32 \
                or self.embed.device.type != "cpu" or self.layers[0].q_norm is not None:
            return False
        return not by_size or self.params < fused_kernels.FUSED_MAX_PARAMS

    def record(self, prompts: int, prompt_width: int, group_size: int, max_new_tokens: int
               ) -> replay.Recording | None:
        """Keep this rollout's per-layer outputs for the update to replay
        (`labkit.fast.replay`): call before `prefill`. None (nothing kept) for a model under
        `replay.REPLAY_MIN_PARAMS` parameters or a recording over `replay.REPLAY_MAX_BYTES`."""
        if self.params < replay.REPLAY_MIN_PARAMS:
            return None
        block = self.base.layers[0]
        hidden, inner = self.embed.shape[1], block.mlp.gate_proj.out_features
        widths = ((self.H + 2 * self.Hkv) * self.D, hidden, 2 * inner, hidden)
        rows, steps = prompts * group_size, max_new_tokens - 1
        vocab = self.model.lm_head.out_features
        size = replay.Recording.size_bytes(len(self.layers), prompts, prompt_width, rows, steps,
                                           widths, vocab, self.dtype)
        if size > replay.REPLAY_MAX_BYTES:
            return None
        self.recording = replay.Recording(self.model, self.dtype, prompts, prompt_width, rows,
                                          steps, widths, vocab, self.embed.device)
        for i, ops in enumerate(self.layers):
            self.recording.add_layer()
            ops.sink = self.recording.sink(i)
        return self.recording

    def close(self) -> None:
        """Release the packed weights and the KV buffers."""
        self.layers, self.recording = [], None
        self.kv.close()

    def _logits(self, x: Tensor, fused: bool = False) -> Tensor:
        if fused:
            normed = self.kernels.rms_rows(x, self.final_eps)
        else:
            normed = F.rms_norm(x, (x.shape[-1],), None, self.final_eps)
        logits = _matmul(normed, self.head, self.dtype)
        if self.recording is not None:
            self.recording.keep_logits(logits)
        return logits.float()

    @torch.no_grad()
    def prefill(self, ids: Tensor, mask: Tensor, group_size: int, max_new_tokens: int) -> Tensor:
        """Run the (B, P) left-padded prompts once; logits (N, V) for each row's first token."""
        with torch.autocast(ids.device.type, enabled=False):
            return self._prefill(ids, mask, group_size, max_new_tokens)

    def _prefill(self, ids: Tensor, mask: Tensor, G: int, T: int) -> Tensor:
        P = ids.shape[1]
        self.t = 0
        f32 = torch.float32
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cos_all, sin_all = rope_tables(self.base, torch.arange(P + T + 1, device=ids.device)[None],
                                       f32)
        cos_all, sin_all = cos_all[0], sin_all[0]  # (S + 1, D) by position
        cos, sin = cos_all[positions][:, :, None], sin_all[positions][:, :, None]  # (B, P, 1, D)
        bias = attention_bias(mask, P, f32)  # (B, 1, P, P)
        x = F.embedding(ids, self.embed).float()  # (B, P, hidden)
        self.kv.start(mask, G, T)
        if self.recording is not None:
            self.recording.at = None
        for ops in self.layers:
            x = layer(x, ops, self._prompt_attention(bias), cos, sin)
        # each row's rotary tables for its T decode positions, gathered once: (N, T, 1, D)
        steps = mask.sum(-1).repeat_interleave(G)[:, None] + torch.arange(T, device=ids.device)
        self.step_cos, self.step_sin = cos_all[steps][:, :, None], sin_all[steps][:, :, None]
        return self._logits(x[:, -1]).repeat_interleave(G, dim=0)

    def _prompt_attention(self, bias: Tensor):
        """Causal fp32 attention over the prompt (B, P); its keys and values go to the KV
        strategy."""

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            B, P, H, D = q.shape
            Hkv = k.shape[2]
            rep = H // Hkv
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.float().transpose(1, 2)
            scores = torch.matmul(q.reshape(B, Hkv, rep * P, D), k.transpose(2, 3))
            probs = (scores.view(B, H, P, P) + bias).softmax(-1)
            o = torch.matmul(probs.view(B, Hkv, rep * P, P), v).view(B, H, P, D)
            self.kv.store_prompt(k, v)
            return o.transpose(1, 2).reshape(B, P, H * D)
        return attend

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """Feed each row's token (N,); logits (N, V) for the position after it."""
        with torch.autocast(tokens.device.type, enabled=False):
            cos, sin = self.step_cos[:, self.t], self.step_sin[:, self.t]  # (N, 1, D)
            x = F.embedding(tokens, self.embed).float()  # (N, hidden)
            if self.recording is not None:
                self.recording.at = self.t
            if self.kernels is not None:
                for i, ops in enumerate(self.layers):
                    x = ops.fused_step(x, self.kernels, cos[:, 0], sin[:, 0],
                                       *self.kv.kernel_inputs(i, self.t))
            else:
                for i, ops in enumerate(self.layers):
                    x = layer(x, ops, self.kv.attend(i, self.t), cos, sin)
            self.t += 1
            return self._logits(x, fused=self.kernels is not None)
