"""Lean forward passes for Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3).

Hugging Face's modules serve every architecture and option, and each forward pays for that:
module dispatch, keyword plumbing, mask building, and under bf16 autocast a cast per matmul.
On a small model that overhead *is* the step (a 2-layer model spends far longer in it than
in arithmetic). This module runs the same arithmetic from the model's own parameters, in
plain torch operations:

* `backbone(...)` / `lm_forward(...)`: a teacher-forced pass with autograd, with the contract
  of the HF forward that `labkit.scoring` uses (ids, mask, positions, an optional KV cache of
  earlier positions, the last `keep` outputs). Gradients reach the HF parameters directly.
  A frozen model (the reference) runs q, k, v and gate, up as one product each, its weights
  stacked and cast once and kept between calls.
* `Decoder`: the rollout's prefill and decode steps. The weights are packed once per rollout
  (q, k, v as one matrix with the attention scale folded into q, gate and up as one, each
  RMSNorm's weight folded into the product after it, cast to the dtype the caller picks),
  and keys and values go into fp32 buffers reserved for the whole completion. With
  `shared_prefix`, a group's G rows read their prompt's keys and values once, as one matrix
  product over the group's queries, instead of G copies of them.

Rotary embeddings come from the model's own `rotary_emb` module, so every RoPE variant it
implements (Llama 3 scaling, YaRN, ...) is followed. `unsupported(model)` names what rules a
model out (None when these paths apply); callers then use the HF forward, which is also the
reference the equivalence tests compare against (`tests/test_lean.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _base(model):
    """The decoder stack (`LlamaModel`...) of an LM or of a bare backbone."""
    return model.model if hasattr(model, "lm_head") and hasattr(model, "model") else model


def unsupported(model, need_head: bool = True) -> str | None:
    """Why the lean paths cannot run `model` exactly as its HF forward would, or None."""
    if hasattr(model, "module"):  # DistributedDataParallel and the like
        return "the model is wrapped for distributed training (its forward must run)"
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"model_type {kind!r} is not one of {', '.join(FAMILIES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if getattr(config, "attention_dropout", 0.0):
        return "attention_dropout is not 0"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp is not 1"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "sliding-window attention layers"
    if kind == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "sliding-window attention"
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    if getattr(model, flag, False):
        return "gradient checkpointing is on (the HF forward implements it)"
    base = _base(model)
    if need_head and type(getattr(model, "lm_head", None)) is not nn.Linear:
        return "the lm_head is not a plain nn.Linear"
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            return f"the decoder stack has no {name}"
    if type(base.embed_tokens) is not nn.Embedding:
        return "the embedding is not a plain nn.Embedding"
    for module in model.modules():
        if getattr(module, "_hf_hook", None) is not None or module._forward_hooks \
                or module._forward_pre_hooks:
            return "a module has forward hooks (offloading, adapters or probes)"
        # accelerate's mixed-precision wrapper (it keeps `_original_forward`) only adds the
        # autocast the caller's region already provides
        if "forward" in module.__dict__ and not hasattr(module, "_original_forward"):
            return "a module's forward was replaced"
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not nn.Linear for m in linears):
            return "a projection is not a plain nn.Linear (adapters or quantization)"
        norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
        if any(not hasattr(n, "variance_epsilon") for n in norms):
            return "a layer norm is not an RMSNorm"
    return None


def _eps(norm) -> float:
    return float(norm.variance_epsilon)


def _w32(norm) -> Tensor:
    """A norm's weight as fp32 (the residual stream's dtype), whatever the model is held in."""
    return norm.weight if norm.weight.dtype == torch.float32 else norm.weight.float()


def _rope_tables(base, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
    """cos and a sign-folded sin (..., D) for `positions`, from the model's rotary module.

    rotate_half(x) * sin == roll(x, D/2) * sin_signed, with sin's first half negated, so
    applying RoPE is x * cos + roll(x) * sin_signed: three operations instead of seven."""
    probe = torch.empty(0, device=positions.device, dtype=torch.float32)
    cos, sin = base.rotary_emb(probe, positions)
    half = sin.shape[-1] // 2
    sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return cos.to(dtype), sin.to(dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


class LeanCache:
    """Keys and values of earlier positions, per layer: (n, Hkv, S, D) each. Quacks like the
    HF cache where `labkit.scoring` uses one (`batch_select_indices`)."""

    def __init__(self, layers: list[tuple[Tensor, Tensor]]):
        self.layers = layers

    def batch_select_indices(self, index: Tensor) -> None:
        self.layers = [(k[index], v[index]) for k, v in self.layers]


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


def _layer_weights(model, dtype) -> list[tuple]:
    """Per layer (W_qkv, b_qkv, W_gu, b_gu, W_o, b_o, W_down, b_down) for `backbone`.

    A frozen model (the reference) not held in `dtype` gets q, k, v and gate, up stacked
    along their outputs, so each is one product, and cast to `dtype`; they are kept between calls until a parameter
    changes in place (its version counter moves). A trainable model gets its parameters as
    they are (as does a model held in `dtype`), W_qkv and W_gu as (q, k, v) and (gate, up)
    tuples: stacking them would copy the
    weights on every call and keep the copies (and their casts) alive until the backward,
    where autocast casts each parameter once per region and reuses the cast."""
    base = _base(model)
    params = list(model.parameters())
    frozen = not any(p.requires_grad for p in params)
    if frozen and all(p.dtype == dtype for p in params):
        frozen = False  # already in the compute dtype: no cast to keep, no copy to make
    if frozen:
        key = (dtype, tuple(p._version for p in params), tuple(p.data_ptr() for p in params))
        cached = model.__dict__.get("_lean_weights")
        if cached is not None and cached[0] == key:
            return cached[1]
    layers = []
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
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
        model.__dict__["_lean_weights"] = (key, layers)
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


def backbone(model, ids: Tensor, mask: Tensor, positions: Tensor,
             cache: LeanCache | None = None, keep: int | None = None
             ) -> tuple[Tensor, LeanCache]:
    """Final-norm hidden states (n, keep, hidden) of the last `keep` positions (all when None),
    and the cache of every position. `mask` (n, S) covers the cached positions and `ids`'.

    Under autocast the products with weights and the attention run in its dtype and the
    residual stream and norms in fp32, as in the HF modules under autocast."""
    base = _base(model)
    config = base.config
    n, L = ids.shape
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    rep = H // Hkv
    dtype = compute_dtype(model)
    weights = _layer_weights(model, dtype)
    x = F.embedding(ids, base.embed_tokens.weight, base.embed_tokens.padding_idx).float()
    cos, sin = _rope_tables(base, positions, torch.float32)
    cos, sin = cos[:, :, None], sin[:, :, None]  # (n, L, 1, D)
    bias = attention_bias(mask, L, torch.float32)
    scale = D ** -0.5
    out_cache = []
    for i, layer in enumerate(base.layers):
        w_qkv, b_qkv, w_gu, b_gu, w_o, b_o, w_down, b_down = weights[i]
        attn = layer.self_attn
        ln = layer.input_layernorm
        h = F.rms_norm(x, (x.shape[-1],), _w32(ln), _eps(ln)).to(dtype)
        q, k, v = _linears(h, w_qkv, b_qkv, [H * D, Hkv * D, Hkv * D])  # (n, L, H|Hkv * D)
        q, k = q.view(n, L, H, D).float(), k.view(n, L, Hkv, D).float()
        v = v.view(n, L, Hkv, D).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q = F.rms_norm(q, (D,), _w32(attn.q_norm), _eps(attn.q_norm))
            k = F.rms_norm(k, (D,), _w32(attn.k_norm), _eps(attn.k_norm))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        q, k = q.transpose(1, 2).to(dtype), k.transpose(1, 2).to(dtype)  # (n, H|Hkv, L, D)
        if cache is not None:
            past_k, past_v = cache.layers[i]
            k = torch.cat([past_k.to(dtype), k], dim=2)
            v = torch.cat([past_v.to(dtype), v], dim=2)
        out_cache.append((k, v))
        S = k.shape[2]
        scores = torch.matmul(q.reshape(n, Hkv, rep * L, D), k.transpose(2, 3))
        scores = scores.view(n, H, L, S) * scale + bias
        probs = scores.softmax(-1).to(dtype)
        o = torch.matmul(probs.view(n, Hkv, rep * L, S), v)  # (n, Hkv, rep*L, D)
        o = o.view(n, H, L, D).transpose(1, 2).reshape(n, L, H * D)
        x = x + F.linear(o, w_o, b_o)
        ln = layer.post_attention_layernorm
        h = F.rms_norm(x, (x.shape[-1],), _w32(ln), _eps(ln)).to(dtype)
        gate, up = _linears(h, w_gu, b_gu, [w_down.shape[1]] * 2)
        x = x + F.linear(F.silu(gate) * up, w_down, b_down)
    if keep is not None:
        x = x[:, -keep:]
    return F.rms_norm(x, (x.shape[-1],), _w32(base.norm), _eps(base.norm)), LeanCache(out_cache)


def lm_forward(model, ids: Tensor, mask: Tensor, positions: Tensor,
               cache: LeanCache | None = None, keep: int | None = None
               ) -> tuple[Tensor, LeanCache]:
    """Logits (n, keep, V) of the last `keep` positions and the KV cache (see `backbone`)."""
    hidden, cache = backbone(model, ids, mask, positions, cache, keep)
    head = model.lm_head
    return F.linear(hidden.to(compute_dtype(model)), head.weight, head.bias), cache


class Decoder:
    """Prefill and decode for a rollout: B prompts, G rows per prompt, N = B*G rows.

    `dtype` is the dtype of the matrix products with weights (bf16 under autocast); the
    weights are packed and cast once, here. The residual stream, norms, rotary embeddings
    and attention stay fp32: on a CPU, bf16 gains nothing on a decode step's many small
    attention products and loses precision. Call `prefill` once, then `step` with each
    row's next token; both return fp32 logits (N, V) for the next position.
    `shared_prefix`: attend over each prompt's keys and values once per group (one
    (G x P) score block per prompt and head) instead of once per row.
    """

    @torch.no_grad()
    def __init__(self, model, dtype=torch.float32, shared_prefix: bool = False,
                 checked: bool = False):
        reason = None if checked else unsupported(model)
        if reason is not None:
            raise ValueError(f"the lean decoder cannot run this model: {reason}")
        base = _base(model)
        config = base.config
        self.base, self.dtype, self.shared_prefix = base, dtype, shared_prefix
        self.H, self.Hkv = config.num_attention_heads, config.num_key_value_heads
        self.D = getattr(config, "head_dim", None) or config.hidden_size // self.H
        self.embed = base.embed_tokens.weight
        scale = self.D ** -0.5
        # (weight, bias) with the preceding RMSNorm's weight folded into the weight's
        # columns, so a norm is only x * rsqrt(mean(x^2) + eps)
        self.head = _pack([model.lm_head], dtype, base.norm.weight)
        self.final_eps = _eps(base.norm)
        self.layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            qk_norm = hasattr(attn, "q_norm")
            # the attention scale is folded into q's rows unless a q norm follows them
            self.layers.append(dict(
                eps1=_eps(ln1), eps2=_eps(ln2),
                qkv=_pack([attn.q_proj, attn.k_proj, attn.v_proj], dtype, ln1.weight,
                          q_scale=None if qk_norm else scale),
                o=_pack([attn.o_proj], dtype), gu=_pack([mlp.gate_proj, mlp.up_proj], dtype,
                                                        ln2.weight),
                down=_pack([mlp.down_proj], dtype),
                q_norm=(attn.q_norm.weight.float() * scale, _eps(attn.q_norm)) if qk_norm
                else None,
                k_norm=(attn.k_norm.weight.float(), _eps(attn.k_norm)) if qk_norm else None))

    def close(self) -> None:
        """Release the packed weights and the KV buffers."""
        self.layers, self.kv, self.prompt_kv = [], [], []

    def _matmul(self, x: Tensor, packed) -> Tensor:
        weight, bias = packed
        x = x.to(self.dtype)
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # a decode step's are 2-D
        out = torch.mm(rows, weight.t()) if bias is None else torch.addmm(bias, rows, weight.t())
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])

    def _residual(self, x: Tensor, inp: Tensor, packed) -> Tensor:
        """x + inp @ W.t() (+ bias): one fused product on a decode step's fp32 rows."""
        weight, bias = packed
        if x.dim() == 2 and bias is None and weight.dtype == x.dtype == inp.dtype:
            return torch.addmm(x, inp, weight.t())
        return x + self._matmul(inp, packed)

    @staticmethod
    def _normed(x: Tensor, eps: float) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, eps)

    def _qkv(self, layer, x: Tensor, cos: Tensor, sin: Tensor):
        """fp32 q (.., H, D) and k, v (.., Hkv, D) of hidden states x (.., hidden), RoPE'd."""
        H, Hkv, D = self.H, self.Hkv, self.D
        qkv = self._matmul(self._normed(x, layer["eps1"]), layer["qkv"])
        lead = qkv.shape[:-1]
        v = qkv[..., (H + Hkv) * D:].view(*lead, Hkv, D)
        if layer["q_norm"] is None:
            qk = _rope(qkv[..., :(H + Hkv) * D].float().view(*lead, H + Hkv, D), cos, sin)
            return qk[..., :H, :], qk[..., H:, :], v
        q = F.rms_norm(qkv[..., :H * D].float().view(*lead, H, D), (D,), *layer["q_norm"])
        k = F.rms_norm(qkv[..., H * D:(H + Hkv) * D].float().view(*lead, Hkv, D), (D,),
                       *layer["k_norm"])
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _mlp(self, layer, x: Tensor, o: Tensor) -> Tensor:
        """Residual after attention output `o` (.., H*D), then the MLP's residual."""
        x = self._residual(x, o, layer["o"])
        gu = self._matmul(self._normed(x, layer["eps2"]), layer["gu"])
        inter = gu.shape[-1] // 2
        act = F.silu(gu[..., :inter]).mul_(gu[..., inter:])
        return self._residual(x, act, layer["down"])

    def _logits(self, x: Tensor) -> Tensor:
        return self._matmul(self._normed(x, self.final_eps), self.head).float()

    @torch.no_grad()
    def prefill(self, ids: Tensor, mask: Tensor, group_size: int, max_new_tokens: int) -> Tensor:
        """Run the (B, P) left-padded prompts once; logits (N, V) for each row's first token."""
        with torch.autocast(ids.device.type, enabled=False):
            return self._prefill(ids, mask, group_size, max_new_tokens)

    def _prefill(self, ids, mask, G, T):
        B, P = ids.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        rep, N, S = H // Hkv, B * G, P + T
        self.G, self.P, self.t = G, P, 0
        f32 = torch.float32
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cos_all, sin_all = _rope_tables(self.base, torch.arange(S + 1, device=ids.device)[None], f32)
        cos_all, sin_all = cos_all[0], sin_all[0]  # (S + 1, D) by position
        cos, sin = cos_all[positions][:, :, None], sin_all[positions][:, :, None]  # (B, P, 1, D)
        bias = attention_bias(mask, P, f32)  # (B, 1, P, P)
        x = F.embedding(ids, self.embed).float()  # (B, P, hidden)
        self.prompt_kv, self.kv = [], []
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, cos, sin)  # (B, P, H|Hkv, D)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.float().transpose(1, 2)
            scores = torch.matmul(q.reshape(B, Hkv, rep * P, D), k.transpose(2, 3))
            probs = (scores.view(B, H, P, P) + bias).softmax(-1)
            o = torch.matmul(probs.view(B, Hkv, rep * P, P), v).view(B, H, P, D)
            x = self._mlp(layer, x, o.transpose(1, 2).reshape(B, P, H * D))
            if self.shared_prefix:
                # the prompt once per group: keys by column (D, P) for q @ K, values (P, D)
                self.prompt_kv.append((k.transpose(2, 3).contiguous(), v.contiguous()))
                keys, values = x.new_empty(N, Hkv, D, T), x.new_empty(N, Hkv, T, D)
            else:
                keys, values = x.new_empty(N, Hkv, D, S), x.new_empty(N, Hkv, S, D)
                keys[..., :P] = k.transpose(2, 3).repeat_interleave(G, dim=0)
                values[:, :, :P] = v.repeat_interleave(G, dim=0)
            self.kv.append((keys, values))
        # every completion position is attended to once written; prompt padding never is
        self.prompt_bias = torch.zeros(B, 1, 1, P, dtype=f32, device=ids.device).masked_fill_(
            mask[:, None, None, :] == 0, torch.finfo(f32).min)
        if not self.shared_prefix:
            self.bias = torch.zeros(N, 1, 1, S, dtype=f32, device=ids.device)
            self.bias[..., :P] = self.prompt_bias.repeat_interleave(G, dim=0)
        # each row's rotary tables for its T decode positions, gathered once: (N, T, 1, D)
        steps = mask.sum(-1).repeat_interleave(G)[:, None] + torch.arange(T, device=ids.device)
        self.step_cos, self.step_sin = cos_all[steps][:, :, None], sin_all[steps][:, :, None]
        return self._logits(x[:, -1]).repeat_interleave(G, dim=0)

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """Feed each row's token (N,); logits (N, V) for the position after it."""
        with torch.autocast(tokens.device.type, enabled=False):
            return self._step(tokens)

    def _step(self, tokens: Tensor) -> Tensor:
        N, t = tokens.shape[0], self.t
        H, Hkv, D, P, G = self.H, self.Hkv, self.D, self.P, self.G
        rep, B = H // Hkv, N // G
        cos, sin = self.step_cos[:, t], self.step_sin[:, t]  # (N, 1, D)
        x = F.embedding(tokens, self.embed).float()  # (N, hidden)
        col = t if self.shared_prefix else P + t
        for i, (layer, (keys, values)) in enumerate(zip(self.layers, self.kv)):
            q, k, v = self._qkv(layer, x, cos, sin)  # (N, H|Hkv, D)
            keys[..., col] = k
            values[:, :, col] = v
            q = q.reshape(N, Hkv, rep, D)
            own = torch.matmul(q, keys[..., :col + 1])  # (N, Hkv, rep, col + 1)
            if not self.shared_prefix:
                probs = own.add_(self.bias[..., :col + 1]).softmax(-1)
                o = torch.matmul(probs, values[:, :, :col + 1])  # (N, Hkv, rep, D)
            else:
                prompt_k, prompt_v = self.prompt_kv[i]
                # the G rows' queries of a prompt against its keys: one (G*rep, P) block
                qg = q.view(B, G, Hkv, rep, D).transpose(1, 2).reshape(B, Hkv, G * rep, D)
                shared = torch.matmul(qg, prompt_k).add_(self.prompt_bias)  # (B, Hkv, G*rep, P)
                shared = shared.view(B, Hkv, G, rep, P).transpose(1, 2).reshape(N, Hkv, rep, P)
                probs = torch.cat([shared, own], dim=-1).softmax(-1)
                pp = probs[..., :P].reshape(B, G, Hkv, rep, P).transpose(1, 2) \
                    .reshape(B, Hkv, G * rep, P)
                o = torch.matmul(pp, prompt_v).view(B, Hkv, G, rep, D).transpose(1, 2) \
                    .reshape(N, Hkv, rep, D)
                o = o.add_(torch.matmul(probs[..., P:], values[:, :, :col + 1]))
            x = self._mlp(layer, x, o.reshape(N, H * D))
        self.t = t + 1
        return self._logits(x)


def _pack(linears, dtype, norm_weight: Tensor | None = None, q_scale: float | None = None):
    """(W, bias) of linears stacked along their outputs, cast to `dtype`, for
    `mm(x, W.t())`. `norm_weight` (in,) scales W's columns (the RMSNorm before it);
    `q_scale` scales the first linear's outputs (attention's 1/sqrt(D) on q). Each matrix is
    scaled in its own dtype and cast before the stacking, so the one full-size copy made
    is already in `dtype`."""
    weights, biases = [], []
    for i, m in enumerate(linears):
        w, b = m.weight, m.bias
        if i == 0 and q_scale is not None:
            w, b = w * q_scale, None if b is None else b * q_scale
        if norm_weight is not None:
            w = w * norm_weight
        weights.append(w.to(dtype))
        biases.append(b)
    bias = None if biases[0] is None else torch.cat(biases).to(dtype)
    return (weights[0] if len(weights) == 1 else torch.cat(weights)).contiguous(), bias
