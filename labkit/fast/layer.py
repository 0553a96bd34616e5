"""The Llama-family decoder layer, written once for training and for rollouts.

Shapes: n rows, L query positions, S key positions, H query heads, Hkv key/value heads, D head
size. `layer` runs norm -> q, k, v -> RoPE -> attention -> o -> residual -> norm -> gate, up ->
down -> residual; what differs between the two callers is passed in: `ops` holds the weights
(as the model keeps them for training, packed with the norm weights folded in for a rollout)
and does the products and norms, `attend` reads and extends the KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class LayerOps(Protocol):
    """One layer's weights and how its products and norms are computed."""

    def norm1(self, x: Tensor) -> Tensor: ...
    def qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]: ...
    def qk_norm(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]: ...
    def residual_o(self, x: Tensor, o: Tensor) -> Tensor: ...
    def norm2(self, x: Tensor) -> Tensor: ...
    def gate_up(self, h: Tensor) -> tuple[Tensor, Tensor]: ...
    def residual_down(self, x: Tensor, act: Tensor) -> Tensor: ...


# attend(q (.., H, D), k, v (.., Hkv, D)) -> attention output (.., H*D)
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


def layer(x: Tensor, ops: LayerOps, attend: Attend, cos: Tensor, sin: Tensor,
          q_tables: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The residual stream x (.., hidden) after one decoder layer (fp32 in and out).
    `q_tables` (cos, sin) rotate q where they differ from k's (`scaled_tables`)."""
    q, k, v = ops.qkv(ops.norm1(x))  # q (.., H, D), k and v (.., Hkv, D)
    q, k = ops.qk_norm(q, k)
    q, k = rope(q, *(q_tables or (cos, sin))), rope(k, cos, sin)
    x = ops.residual_o(x, attend(q, k, v))
    gate, up = ops.gate_up(ops.norm2(x))
    return ops.residual_down(x, F.silu(gate) * up)


def eps_of(norm) -> float:
    return float(norm.variance_epsilon)


def weight32(norm) -> Tensor:
    """A norm's weight as fp32 (the residual stream's dtype), whatever the model is held in."""
    return norm.weight if norm.weight.dtype == torch.float32 else norm.weight.float()


def rope_tables(base, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
    """cos and a sign-folded sin (..., D) for `positions`, from the model's rotary module.

    rotate_half(x) * sin == roll(x, D/2) * sin_signed, with sin's first half negated, so
    applying RoPE is x * cos + roll(x) * sin_signed: three operations instead of seven."""
    probe = torch.empty(0, device=positions.device, dtype=torch.float32)
    cos, sin = base.rotary_emb(probe, positions)
    half = sin.shape[-1] // 2
    sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return cos.to(dtype), sin.to(dtype)


def scaled_tables(cos: Tensor, sin: Tensor, D: int) -> tuple[Tensor, Tensor]:
    """RoPE tables that also apply attention's 1/sqrt(D) to q: rotation is linear, so q
    rotated by them is the rotated q scaled, and the scores need no pass of their own for
    the scale (a score tensor is (S / D) times q's size). For D a power of 4 (64, 256) the
    scale is a power of two and every bit is as with the scores scaled."""
    scale = D ** -0.5
    return cos * scale, sin * scale


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


def attention_bias(mask: Tensor, queries: int, dtype) -> Tensor:
    """Additive bias (n, 1, L, S): 0 where query i (the last L of S positions) may attend to
    key j (a real token, not after it), the dtype's minimum elsewhere."""
    n, S = mask.shape
    past = S - queries
    causal = torch.arange(S, device=mask.device)[None, :] <= \
        torch.arange(past, S, device=mask.device)[:, None]  # (L, S)
    allowed = causal[None] & mask[:, None, :].bool()  # (n, L, S)
    bias = torch.zeros(n, 1, queries, S, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


def compute_dtype(model) -> torch.dtype:
    """The dtype of products with the model's weights: autocast's when it is on for the
    model's device, else the one the model is held in."""
    device = next(model.parameters()).device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return next(model.parameters()).dtype


def head_dims(config) -> tuple[int, int, int]:
    """(H, Hkv, D) of a model config."""
    H = config.num_attention_heads
    return H, config.num_key_value_heads, getattr(config, "head_dim", None) or config.hidden_size // H
