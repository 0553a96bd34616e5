"""Which models labkit.fast runs: `unsupported(model)` names what rules one out."""

from __future__ import annotations

from torch import nn

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def decoder_stack(model):
    """The decoder stack (`LlamaModel`...) of an LM or of a bare backbone."""
    return model.model if hasattr(model, "lm_head") and hasattr(model, "model") else model


def unsupported(model, need_head: bool = True) -> str | None:
    """Why the fast paths cannot run `model` exactly as its HF forward would, or None."""
    if hasattr(model, "module"):  # DistributedDataParallel and the like
        return "the model is wrapped for distributed training (its forward must run)"
    return _config_reason(model) or _module_reason(model, need_head)


def _config_reason(model) -> str | None:
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
    return None


def _modules(model):
    """`model` and every module under it, depth first (as `model.modules()`, less its
    bookkeeping of names)."""
    stack = [model]
    while stack:
        module = stack.pop()
        yield module
        stack.extend(m for m in reversed(module._modules.values()) if m is not None)


def _module_reason(model, need_head: bool) -> str | None:
    base = decoder_stack(model)
    if need_head and type(getattr(model, "lm_head", None)) is not nn.Linear:
        return "the lm_head is not a plain nn.Linear"
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            return f"the decoder stack has no {name}"
    if type(base.embed_tokens) is not nn.Embedding:
        return "the embedding is not a plain nn.Embedding"
    for module in _modules(model):
        # the instance's own attributes, where accelerate's hooks and wrappers and HF's
        # checkpointing switch are set: a name looked up on the module itself and missing
        # goes through Module.__getattr__, which raises and catches (this check runs on
        # every pass, several times a step)
        own = vars(module)
        if own.get("_hf_hook") is not None or module._forward_hooks \
                or module._forward_pre_hooks:
            return "a module has forward hooks (offloading, adapters or probes)"
        # accelerate's mixed-precision wrapper (it keeps `_original_forward`) only adds the
        # autocast the caller's region already provides
        if "forward" in own and "_original_forward" not in own:
            return "a module's forward was replaced"
        # what transformers' is_activation_checkpointing reads, module by module
        if own.get("gradient_checkpointing", getattr(type(module), "gradient_checkpointing",
                                                      False)):
            return "gradient checkpointing is on (the HF forward implements it)"
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
