"""How a rollout's decode step reads the KV cache: one object, chosen when the decoder is built.

Shapes: B prompts, G rows per prompt, N = B*G rows, P prompt positions (left-padded), T
completion positions, Hkv key/value heads of `rep` query heads each, D head size. Both
strategies keep fp32 buffers reserved for the whole completion and write each step's keys
and values in place. Either way a key buffer is indexed (.., position, D).

`FullCache` keeps the completion's keys by row (position, D) where MKL runs AVX-512 kernels
(`keys_by_row`): a step's key write is then one contiguous run per row and head, not a
strided scatter, and the scores read the keys transposed (the small model's rollout
0.91-0.96x as long, A/B in one process). Under MKL's AVX2 kernels the scores of keys read
that way changed with the number of rows, and a 2-process run parted from the 1-process
one (tests/test_parallel.py): there they stay by column, a transposed view of
(.., D, position) storage.

`SharedPrefix` keeps the completion's keys by row, and where MKL's kernels are not AVX-512
(`flash_decode`) attends through torch's flash-attention kernel for CPUs
(`_scaled_dot_product_flash_attention_for_cpu`): the shared prompt and the row's own
completion are two calls, merged by their log-sum-exps. Each row and head is its own block
there, so a row's result does not depend on the number of rows beside it. Under AVX2
kernels a layer's attention at a decode step took 0.63x as long as the batched products
over keys by column; with AVX-512 kernels the batched products over keys by row took
0.93x as long as the flash kernel (the small model's shapes, docs/performance.md).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from labkit.fast.layer import Attend


def keys_by_row() -> bool:
    """Whether the completion's keys are kept (position, D): where torch's kernels are
    AVX-512 and MKL is not held below it (`MKL_ENABLE_INSTRUCTIONS`)."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "AVX512").upper()
    return mkl.startswith(("AVX512", "AVX10"))


def _keys(k: Tensor, N: int, Hkv: int, S: int, D: int, by_row: bool | None = None) -> Tensor:
    """A key buffer indexed (N, Hkv, position, D), stored by row or by column (`by_row`, by
    default `keys_by_row()`)."""
    if keys_by_row() if by_row is None else by_row:
        return k.new_empty(N, Hkv, S, D)
    return k.new_empty(N, Hkv, D, S).transpose(2, 3)


def flash_decode(device) -> bool:
    """Whether `SharedPrefix` attends through the flash kernel for CPUs on `device`: on a
    CPU where MKL does not run AVX-512 kernels (`keys_by_row` is False)."""
    return torch.device(device).type == "cpu" and not keys_by_row()


def _flash(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor | None = None
           ) -> tuple[Tensor, Tensor]:
    """Attention of q (n, Hkv, L, D) over keys and values (n, Hkv, S, D), the scale already
    in q, with an additive bias broadcast to (n, Hkv, L, S): the output (n, Hkv, L, D) and
    the log-sum-exp of each query's scores (n, Hkv, L)."""
    if bias is not None:
        bias = bias.expand(*q.shape[:-1], keys.shape[2])
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values,
                                                                      attn_mask=bias, scale=1.0)


class FullCache:
    """Every row holds its prompt's keys and values: a decode step is one (rep x S) score
    block per row and head, over the prompt and the completion so far. `by_row` True keeps
    the keys (position, D) whatever the kernels (as `labkit.fast.kernels` reads them)."""

    def __init__(self, by_row: bool | None = None):
        self.by_row = by_row

    def start(self, prompt_mask: Tensor, group_size: int, max_new_tokens: int) -> None:
        """Before the prefill: the (B, P) prompt mask, G and T."""
        B, P = prompt_mask.shape
        self.G, self.P, self.T, self.layers = group_size, P, max_new_tokens, []
        # every completion position is attended to once written; prompt padding never is
        self.bias = torch.zeros(B * group_size, 1, 1, P + max_new_tokens, dtype=torch.float32,
                                device=prompt_mask.device)
        self.bias[..., :P] = _prompt_bias(prompt_mask).repeat_interleave(group_size, dim=0)

    def store_prompt(self, k: Tensor, v: Tensor) -> None:
        """The next layer's prompt keys and values (B, Hkv, P, D), fp32."""
        G, P, S = self.G, self.P, self.P + self.T
        N, Hkv, D = k.shape[0] * G, k.shape[1], k.shape[3]
        keys, values = _keys(k, N, Hkv, S, D, self.by_row), k.new_empty(N, Hkv, S, D)
        keys[:, :, :P] = k.repeat_interleave(G, dim=0)
        values[:, :, :P] = v.repeat_interleave(G, dim=0)
        self.layers.append((keys, values))

    def attend(self, i: int, t: int) -> Attend:
        """Layer i's attention at completion step t: q (N, H, D), k, v (N, Hkv, D)."""
        keys, values = self.layers[i]
        col = self.P + t

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            N, H, D = q.shape
            Hkv = k.shape[1]
            keys[:, :, col] = k
            values[:, :, col] = v
            own = torch.matmul(q.reshape(N, Hkv, H // Hkv, D),
                               keys[:, :, :col + 1].transpose(2, 3))
            probs = own.add_(self.bias[..., :col + 1]).softmax(-1)  # (N, Hkv, rep, col + 1)
            return torch.matmul(probs, values[:, :, :col + 1]).reshape(N, H * D)
        return attend

    def kernel_inputs(self, i: int, t: int) -> tuple:
        """What `labkit.fast.kernels.Kernels.rope_attend` reads for layer i at completion
        step t: keys, values, bias (N, S), the step's position, no shared prompt."""
        keys, values = self.layers[i]
        return keys, values, self.bias.view(keys.shape[0], -1), self.P + t, None

    def close(self) -> None:
        self.layers = []


class SharedPrefix:
    """A group's G rows read their prompt's keys and values once, as one (G*rep x P) score
    block per prompt and head, instead of G copies of them; each row keeps only its own
    completion's keys and values. `by_row` True keeps the prompt's keys (position, D)
    whatever the kernels (as `labkit.fast.kernels` reads them)."""

    def __init__(self, by_row: bool | None = None):
        self.by_row = by_row

    def start(self, prompt_mask: Tensor, group_size: int, max_new_tokens: int) -> None:
        """Before the prefill: the (B, P) prompt mask, G and T."""
        self.G, self.P, self.T, self.layers, self.prompt = \
            group_size, prompt_mask.shape[1], max_new_tokens, [], []
        self.flash = flash_decode(prompt_mask.device)
        self.prompt_bias = _prompt_bias(prompt_mask)  # (B, 1, 1, P)

    def store_prompt(self, k: Tensor, v: Tensor) -> None:
        """The next layer's prompt keys and values (B, Hkv, P, D), fp32."""
        # the prompt once per group; for the batched products its keys by column (D, P)
        by_row = self.flash or self.by_row
        self.prompt.append((k.contiguous() if by_row else k.transpose(2, 3).contiguous(),
                            v.contiguous()))
        N, Hkv, D = k.shape[0] * self.G, k.shape[1], k.shape[3]
        self.layers.append((k.new_empty(N, Hkv, self.T, D), k.new_empty(N, Hkv, self.T, D)))

    def attend(self, i: int, t: int) -> Attend:
        """Layer i's attention at completion step t: q (N, H, D), k, v (N, Hkv, D)."""
        (keys, values), (prompt_k, prompt_v) = self.layers[i], self.prompt[i]
        G, P = self.G, self.P

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            N, H, D = q.shape
            Hkv = k.shape[1]
            rep, B = H // Hkv, N // G
            keys[:, :, t] = k
            values[:, :, t] = v
            q = q.reshape(N, Hkv, rep, D)
            # the G rows' queries of a prompt against its keys: one (G*rep, P) block
            qg = q.view(B, G, Hkv, rep, D).transpose(1, 2).reshape(B, Hkv, G * rep, D)
            if self.flash:
                return self._flash(q, qg, keys[:, :, :t + 1], values[:, :, :t + 1], prompt_k,
                                   prompt_v).reshape(N, H * D)
            own = torch.matmul(q, keys[:, :, :t + 1].transpose(2, 3))  # (N, Hkv, rep, t + 1)
            shared = torch.matmul(qg, prompt_k).add_(self.prompt_bias)  # (B, Hkv, G*rep, P)
            shared = shared.view(B, Hkv, G, rep, P).transpose(1, 2).reshape(N, Hkv, rep, P)
            probs = torch.cat([shared, own], dim=-1).softmax(-1)
            pp = probs[..., :P].reshape(B, G, Hkv, rep, P).transpose(1, 2) \
                .reshape(B, Hkv, G * rep, P)
            o = torch.matmul(pp, prompt_v).view(B, Hkv, G, rep, D).transpose(1, 2) \
                .reshape(N, Hkv, rep, D)
            o = o.add_(torch.matmul(probs[..., P:], values[:, :, :t + 1]))
            return o.reshape(N, H * D)
        return attend

    def kernel_inputs(self, i: int, t: int) -> tuple:
        """What `labkit.fast.kernels.Kernels.rope_attend` reads for layer i at completion
        step t: the rows' own keys and values (no bias), t, and the shared prompt's."""
        (keys, values), (prompt_k, prompt_v) = self.layers[i], self.prompt[i]
        return keys, values, None, t, (prompt_k, prompt_v,
                                       self.prompt_bias.view(prompt_k.shape[0], -1))

    def _flash(self, q: Tensor, qg: Tensor, keys: Tensor, values: Tensor, prompt_k: Tensor,
               prompt_v: Tensor) -> Tensor:
        """The two parts through the flash kernel, the prompt's (qg by group) and the rows'
        own, each weighted by its share of the whole softmax: a softmax over the pair of
        their log-sum-exps. That softmax runs row by row, so a row's weights do not depend
        on how many rows there are (an elementwise exp over the batch would compute the
        last few elements apart from the vectorised rest)."""
        N, Hkv, rep, D = q.shape
        B = qg.shape[0]
        own, own_lse = _flash(q, keys, values)  # (N, Hkv, rep, D), (N, Hkv, rep)
        shared, shared_lse = _flash(qg, prompt_k, prompt_v, self.prompt_bias)
        shared = shared.view(B, Hkv, self.G, rep, D).transpose(1, 2).reshape(N, Hkv, rep, D)
        shared_lse = shared_lse.view(B, Hkv, self.G, rep).transpose(1, 2).reshape(N, Hkv, rep)
        weights = torch.stack([own_lse, shared_lse], dim=-1).softmax(-1)  # (N, Hkv, rep, 2)
        return own * weights[..., :1] + shared * weights[..., 1:]

    def close(self) -> None:
        self.layers, self.prompt = [], []


def _prompt_bias(mask: Tensor) -> Tensor:
    """(B, 1, 1, P): 0 on real prompt tokens, fp32's minimum on padding."""
    f32 = torch.float32
    return torch.zeros(mask.shape[0], 1, 1, mask.shape[1], dtype=f32, device=mask.device) \
        .masked_fill_(mask[:, None, None, :] == 0, torch.finfo(f32).min)
