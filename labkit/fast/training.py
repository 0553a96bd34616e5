"""The teacher-forced pass with autograd (scoring and the update): `backbone`, `lm_forward`.

It has the contract of the HF forward that `labkit.model.scoring` uses (ids, mask, positions, an
optional KV cache of earlier positions, the last `keep` outputs), and gradients reach the HF
parameters directly. A frozen model (the reference) runs q, k, v and gate, up as one product
each, its weights stacked and cast once and kept between calls. Under autocast the products
with weights and the attention run in its dtype and the residual stream and norms in fp32,
as in the HF modules under autocast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from labkit.fast.layer import (Attend, attention_bias, compute_dtype, eps_of, head_dims, layer,
                                rope_tables, scaled_tables, weight32)
from labkit.fast.replay import Replay, replayed
from labkit.fast.support import decoder_stack, unsupported
from labkit.reproducible import select_rows


class FastCache:
    """Keys and values of earlier positions, per layer: (n, Hkv, S, D) each. Quacks like the
    HF cache where `labkit.model.scoring` uses one (`batch_select_indices`).

    `groups` > 1: the cache holds one row per prompt for `groups` consecutive rows each (a
    group's completions over their shared prompt), and a pass over n = rows x `groups` rows
    attends to it in two blocks (`_attention`) instead of to a copy repeated per row. A
    layer may be given as a function that makes its (keys, values) when first read: the
    cache a grouped pass returns joins each row's prompt block to its own keys only if asked.
    """

    def __init__(self, layers: list, groups: int = 1):
        self._layers, self.groups = layers, groups

    @property
    def layers(self) -> list[tuple[Tensor, Tensor]]:
        """Every layer's (keys, values), the deferred ones made now."""
        return [self.layer(i) for i in range(len(self._layers))]

    @layers.setter
    def layers(self, layers: list[tuple[Tensor, Tensor]]) -> None:
        self._layers = layers

    def layer(self, i: int):
        """Layer i's (keys, values), made now if it was deferred."""
        if callable(self._layers[i]):
            self._layers[i] = self._layers[i]()
        return self._layers[i]

    def batch_select_indices(self, index: Tensor) -> None:
        """Keep the rows `index` (which may repeat rows). Where they are each row repeated
        the same number of times in order (a group per prompt), the cache stays as it is and
        its `groups` counts the repeats: nothing is copied."""
        rows = self.layer(0)[0].shape[0] if self._layers else 0
        if self.groups == 1 and rows and index.numel() > rows and index.numel() % rows == 0:
            repeats = index.numel() // rows
            if bool((index == _in_groups(rows, repeats, index.device)).all()):
                self.groups = repeats
                return
        if self.groups > 1:  # a selection of a grouped cache's rows: repeat them first
            index = _in_groups(rows, self.groups, index.device)[index]
            self.groups = 1
        self.layers = [(select_rows(k, index), select_rows(v, index)) for k, v in self.layers]


def _in_groups(rows: int, G: int, device) -> Tensor:
    """Each of `rows` rows' index repeated G times, in order: (rows * G,)."""
    return torch.arange(rows, device=device).repeat_interleave(G)


def _layer_weights(model, dtype) -> list[tuple]:
    """Per layer (W_qkv, b_qkv, W_gu, b_gu, W_o, b_o, W_down, b_down) for `backbone`.

    A frozen model (the reference) not held in `dtype` gets q, k, v and gate, up stacked
    along their outputs, so each is one product, and cast to `dtype`; they are kept between
    calls until a parameter changes in place (its version counter moves). A trainable model
    gets its parameters as they are (as does a model held in `dtype`), W_qkv and W_gu as
    (q, k, v) and (gate, up) tuples: stacking them would copy the weights on every call and
    keep the copies (and their casts) alive until the backward, where autocast casts each
    parameter once per region and reuses the cast."""
    params = list(model.parameters())
    frozen = not any(p.requires_grad for p in params)
    if frozen and all(p.dtype == dtype for p in params):
        frozen = False  # already in the compute dtype: no cast to keep, no copy to make
    if frozen:
        key = (dtype, tuple(p._version for p in params), tuple(p.data_ptr() for p in params))
        cached = model.__dict__.get("_fast_weights")
        if cached is not None and cached[0] == key:
            return cached[1]
    layers = []
    for block in decoder_stack(model).layers:
        attn, mlp = block.self_attn, block.mlp
        qkv, gu = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
        if frozen:
            layers.append((*_stacked(qkv, dtype), *_stacked(gu, dtype),
                           *_stacked([attn.o_proj], dtype), *_stacked([mlp.down_proj], dtype)))
        else:
            layers.append((tuple(m.weight for m in qkv), tuple(m.bias for m in qkv),
                           tuple(m.weight for m in gu), tuple(m.bias for m in gu),
                           attn.o_proj.weight, attn.o_proj.bias, mlp.down_proj.weight,
                           mlp.down_proj.bias))
    if frozen:
        model.__dict__["_fast_weights"] = (key, layers)
    return layers


def _stacked(linears, dtype) -> tuple[Tensor, Tensor | None]:
    """(weight, bias) of linears joined along their outputs, cast to `dtype`."""
    weight = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
    if linears[0].bias is None:
        return weight.to(dtype), None
    bias = torch.cat([m.bias for m in linears]) if len(linears) > 1 else linears[0].bias
    return weight.to(dtype), bias.to(dtype)


def _linears(x: Tensor, weight, bias, sizes: list[int]) -> tuple[Tensor, ...]:
    """x @ W.T + b for each of the linears whose output widths are `sizes`: one product
    sliced when `weight` is their stacked matrix, else one product per matrix in the tuple
    `weight`. Separate outputs are never joined: joining copies them, and slicing a joined
    output that autograd tracks costs a zero-filled full-width gradient per slice."""
    if isinstance(weight, tuple):
        return tuple(F.linear(x, w, b) for w, b in zip(weight, bias))
    return F.linear(x, weight, bias).split(sizes, dim=-1)


class _TrainedLayer:
    """`LayerOps` on the model's own parameters (or the frozen model's stacked casts): norms
    with their weights, products in `dtype`, q and k in fp32 for their norms and RoPE."""

    def __init__(self, block, weights: tuple, dims: tuple[int, int, int], dtype):
        self.ln1, self.ln2, self.attn = block.input_layernorm, block.post_attention_layernorm, \
            block.self_attn
        (self.w_qkv, self.b_qkv, self.w_gu, self.b_gu, self.w_o, self.b_o, self.w_down,
         self.b_down) = weights
        self.H, self.Hkv, self.D = dims
        self.dtype = dtype

    def _norm(self, x: Tensor, norm) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight32(norm), eps_of(norm)).to(self.dtype)

    def norm1(self, x: Tensor) -> Tensor:
        return self._norm(x, self.ln1)

    def norm2(self, x: Tensor) -> Tensor:
        return self._norm(x, self.ln2)

    def qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        H, Hkv, D = self.H, self.Hkv, self.D
        q, k, v = _linears(h, self.w_qkv, self.b_qkv, [H * D, Hkv * D, Hkv * D])
        lead = h.shape[:-1]
        return q.view(*lead, H, D).float(), k.view(*lead, Hkv, D).float(), v.view(*lead, Hkv, D)

    def qk_norm(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if not hasattr(self.attn, "q_norm"):
            return q, k
        qn, kn = self.attn.q_norm, self.attn.k_norm
        return (F.rms_norm(q, (self.D,), weight32(qn), eps_of(qn)),
                F.rms_norm(k, (self.D,), weight32(kn), eps_of(kn)))

    def residual_o(self, x: Tensor, o: Tensor) -> Tensor:
        return x + F.linear(o, self.w_o, self.b_o)

    def gate_up(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return _linears(h, self.w_gu, self.b_gu, [self.w_down.shape[1]] * 2)

    def residual_down(self, x: Tensor, act: Tensor) -> Tensor:
        return x + F.linear(act, self.w_down, self.b_down)


class _ReplayedLayer(_TrainedLayer):
    """`_TrainedLayer` whose products' outputs are given (`labkit.fast.replay`): `kept` holds
    the layer's q, k, v, residual after attention, gate, up and residual after the MLP over
    the pass's positions."""

    def __init__(self, block, weights: tuple, dims: tuple[int, int, int], dtype,
                 kept: tuple[Tensor, Tensor, Tensor, Tensor]):
        super().__init__(block, weights, dims, dtype)
        self.kept = kept
        # the decoder folds 1/sqrt(D) into q's product unless a q norm follows it
        self.q_unscale = None if hasattr(self.attn, "q_norm") else self.D ** 0.5

    def qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        H, Hkv, D = self.H, self.Hkv, self.D
        q, k, v = self.kept[0].split([H * D, Hkv * D, Hkv * D], dim=-1)
        if self.q_unscale is not None:
            q = q * self.q_unscale
        q, k, v = replayed(h, None, self.w_qkv, self.b_qkv, (q, k, v))
        lead = h.shape[:-1]
        return q.view(*lead, H, D).float(), k.view(*lead, Hkv, D).float(), v.view(*lead, Hkv, D)

    def residual_o(self, x: Tensor, o: Tensor) -> Tensor:
        return replayed(o, x, (self.w_o,), (self.b_o,), (self.kept[1],))[0]

    def gate_up(self, h: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = self.kept[2].chunk(2, dim=-1)
        return replayed(h, None, self.w_gu, self.b_gu, (gate, up))

    def residual_down(self, x: Tensor, act: Tensor) -> Tensor:
        return replayed(act, x, (self.w_down,), (self.b_down,), (self.kept[3],))[0]


def _attention(past: tuple[Tensor, Tensor] | None, bias: Tensor, dtype, kept: list,
               groups: int = 1) -> Attend:
    """Attention of q (n, L, H, D), already scaled by 1/sqrt(D) (`scaled_tables`), over the
    cached keys `past` and the L new ones, in `dtype` (scores and softmax in fp32 with the
    additive `bias` (n, 1, L, S)); the layer's keys and values (n, Hkv, S, D) are appended
    to `kept`. `groups` > 1: `past` has a row per `groups` rows of q (`FastCache`)."""

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if groups > 1:
            return _grouped_attention(q, k, v, past, bias, dtype, kept, groups)
        n, L, H, D = q.shape
        Hkv = k.shape[2]
        rep = H // Hkv
        v = v.transpose(1, 2)
        q, k = q.transpose(1, 2).to(dtype), k.transpose(1, 2).to(dtype)  # (n, H|Hkv, L, D)
        if past is not None:
            k = torch.cat([past[0].to(dtype), k], dim=2)
            v = torch.cat([past[1].to(dtype), v], dim=2)
        kept.append((k, v))
        S = k.shape[2]
        scores = torch.matmul(q.reshape(n, Hkv, rep * L, D), k.transpose(2, 3))
        scores = scores.view(n, H, L, S) + bias
        probs = scores.softmax(-1).to(dtype)
        o = torch.matmul(probs.view(n, Hkv, rep * L, S), v)  # (n, Hkv, rep*L, D)
        return o.view(n, H, L, D).transpose(1, 2).reshape(n, L, H * D)
    return attend


def _grouped_attention(q: Tensor, k: Tensor, v: Tensor, past: tuple[Tensor, Tensor],
                       bias: Tensor, dtype, kept: list, G: int) -> Tensor:
    """`_attention` where the P cached positions are one row per group of G rows of q: the
    scores against them are one product per prompt and head over the group's G x L queries,
    the scores among the L new positions one per row, both joined for the softmax; its
    weights then take the prompt's values and the row's own. The prompt's keys and values
    are never repeated per row, and their gradients come out of the products summed over
    the group. The same sums as the one-block attention, split in two (last bits differ)."""
    n, L, H, D = q.shape
    Hkv = k.shape[2]
    rep, u = H // Hkv, n // G
    past_k, past_v = past[0].to(dtype), past[1].to(dtype)  # (u, Hkv, P, D)
    P = past_k.shape[2]
    # queries ordered (prompt, kv head | group row, query head in its kv group, position)
    q = q.to(dtype).view(u, G, L, Hkv, rep, D).permute(0, 3, 1, 4, 2, 5)
    q = q.reshape(u, Hkv, G * rep * L, D)
    k_new = k.to(dtype).view(u, G, L, Hkv, D).permute(0, 3, 1, 2, 4)  # (u, Hkv, G, L, D)
    v_new = v.to(dtype).view(u, G, L, Hkv, D).permute(0, 3, 1, 2, 4)
    on_prompt = torch.matmul(q, past_k.transpose(2, 3))  # (u, Hkv, G*rep*L, P)
    on_new = torch.matmul(q.view(u, Hkv, G, rep * L, D), k_new.transpose(3, 4))
    scores = torch.cat([on_prompt, on_new.view(u, Hkv, G * rep * L, L)], dim=-1)
    scores = scores.view(u, Hkv, G, rep, L, P + L) + bias.view(u, 1, G, 1, L, P + L)
    probs = scores.softmax(-1).to(dtype).view(u, Hkv, G * rep * L, P + L)
    o = torch.matmul(probs[..., :P], past_v).view(u, Hkv, G, rep * L, D) + \
        torch.matmul(probs[..., P:].reshape(u, Hkv, G, rep * L, L), v_new)
    kept.append(lambda: _joined(past_k, past_v, k_new, v_new, G))
    return o.view(u, Hkv, G, rep, L, D).permute(0, 2, 4, 1, 3, 5).reshape(n, L, H * D)


def _joined(past_k: Tensor, past_v: Tensor, k_new: Tensor, v_new: Tensor, G: int):
    """A grouped pass's cache as the one-block pass keeps it: (n, Hkv, P + L, D) per row."""
    u, Hkv, _, L, D = k_new.shape
    index = _in_groups(u, G, past_k.device)
    new = (t.transpose(1, 2).reshape(u * G, Hkv, L, D) for t in (k_new, v_new))
    return tuple(torch.cat([select_rows(p, index), t], dim=2) for p, t in
                 zip((past_k, past_v), new))


def backbone(model, ids: Tensor, mask: Tensor, positions: Tensor,
             cache: FastCache | None = None, keep: int | None = None,
             replay: Replay | None = None) -> tuple[Tensor, FastCache]:
    """Final-norm hidden states (n, keep, hidden) of the last `keep` positions (all when None),
    and the cache of every position. `mask` (n, S) covers the cached positions and `ids`'.
    `replay`: the products' outputs over these positions, kept by the rollout
    (`labkit.fast.replay`), taken instead of computing the products (a trainable model's);
    each layer's entry of `replay.layers` is emptied once the layer has run."""
    base = decoder_stack(model)
    dims = head_dims(base.config)
    dtype = compute_dtype(model)
    weights = _layer_weights(model, dtype)
    if replay is not None:
        _check_replay(replay, ids.shape, len(base.layers), weights)
    x = F.embedding(ids, base.embed_tokens.weight, base.embed_tokens.padding_idx).float()
    cos, sin = rope_tables(base, positions, torch.float32)
    cos, sin = cos[:, :, None], sin[:, :, None]  # (n, L, 1, D)
    q_tables = scaled_tables(cos, sin, dims[2])
    bias = attention_bias(mask, ids.shape[1], torch.float32)
    kept: list[tuple[Tensor, Tensor]] = []
    for i, block in enumerate(base.layers):
        past = None if cache is None else cache.layer(i)
        attend = _attention(past, bias, dtype, kept, 1 if cache is None else cache.groups)
        if replay is None:
            ops = _TrainedLayer(block, weights[i], dims, dtype)
        else:  # the layer's outputs go with it: what the graph does not keep is freed
            ops = _ReplayedLayer(block, weights[i], dims, dtype, replay.layers[i])
            replay.layers[i] = None
        x = layer(x, ops, attend, cos, sin, q_tables)
        del ops
    if keep is not None:
        x = x[:, -keep:]
    return F.rms_norm(x, (x.shape[-1],), weight32(base.norm), eps_of(base.norm)), FastCache(kept)


def _check_replay(replay: Replay, shape: torch.Size, layers: int, weights: list) -> None:
    if len(replay.layers) != layers or any(t.shape[:2] != shape for kept in replay.layers
                                           for t in kept):
        raise ValueError(f"replay: {len(replay.layers)} layers of outputs for {layers} layers, "
                         f"over {[tuple(t.shape[:2]) for t in replay.layers[0]]} positions "
                         f"where the pass has {tuple(shape)}")
    if any(t.is_inference() for kept in replay.layers for t in kept):
        raise ValueError("replay: outputs made in inference mode cannot join autograd's graph")
    if not isinstance(weights[0][0], tuple):
        raise ValueError("replay: the model's products must run on its own parameters (a "
                         "trainable model's), not on stacked casts of a frozen one")


def lm_forward(model, ids: Tensor, mask: Tensor, positions: Tensor,
               cache: FastCache | None = None, keep: int | None = None,
               replay: Replay | None = None) -> tuple[Tensor, FastCache]:
    """Logits (n, keep, V) of the last `keep` positions and the KV cache (see `backbone`;
    with `replay` the head's product too is taken from it)."""
    hidden, cache = backbone(model, ids, mask, positions, cache, keep, replay)
    head = model.lm_head
    hidden = hidden.to(compute_dtype(model))
    if replay is not None:
        return replayed(hidden, None, (head.weight,), (head.bias,), (replay.logits,))[0], cache
    return F.linear(hidden, head.weight, head.bias), cache


# run(ids, mask, positions, cache, keep) -> (outputs (n, keep, ...), cache)
Forward = Callable[..., tuple[Tensor, object]]


def lm_forward_or(plain: Callable[..., Forward]) -> Callable[..., Forward]:
    """forward_of(model): `lm_forward` on `model` where `unsupported(model)` is None, else
    `plain(model)` (its own forward)."""

    def forward_of(model) -> Forward:
        if unsupported(model) is not None:
            return plain(model)
        return lambda ids, mask, positions, cache, keep: lm_forward(model, ids, mask, positions,
                                                                   cache, keep)
    return forward_of


def backbone_or(plain: Callable[..., Forward]) -> Callable[..., Forward]:
    """forward_of(stack): `backbone` (final-norm hidden states) on a bare decoder stack where
    it is supported, else `plain(stack)`."""

    def forward_of(stack) -> Forward:
        if unsupported(stack, need_head=False) is not None:
            return plain(stack)
        return lambda ids, mask, positions, cache, keep: backbone(stack, ids, mask, positions,
                                                                 cache, keep)
    return forward_of
