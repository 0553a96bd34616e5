"""LoRA (Hu et al., 2021) for models that do not fit, through peft: `TrainConfig.lora_rank`.

The policy's projections named in `lora_targets` get rank-r adapters, W x + (alpha / r) B A x
with B = 0 at the start, and only A and B train (peft's `inject_adapter_in_model`, in place:
the model keeps its class, config and forward). The reference is the same model with its
adapters switched off (`AdaptersOff`), so no second copy is loaded; PPO's critic gets
adapters of its own on its own backbone copy, and a value head that trains in full.
Checkpoints hold the weights that train (`labkit.model.learner.learner_state`); a run's `final/`
is the merged model (a plain model folder) with the adapters beside it in peft's format
(`final/adapter/`).

labkit's lean passes (`labkit.fast`) read the weights directly and do not take adapters:
`labkit.fast.unsupported` sees the adapter layers and the models run their own forward.
peft is the optional `lora` extra: `pip install 'labkit[lora]'`.
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

from labkit import grammar
from labkit.settings.embedded import EMBEDDED, EMBEDDED_PATH
from labkit.settings.preflight import require_peft


def lora_config(config):
    """peft's LoraConfig for a TrainConfig: rank, alpha, target modules, no dropout."""
    peft = require_peft()
    targets = grammar.items(config.lora_targets, "lora_targets")
    base = EMBEDDED_PATH if config.model is None else EMBEDDED.get(config.model, config.model)
    return peft.LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                           target_modules=targets, lora_dropout=0.0, bias="none",
                           base_model_name_or_path=str(base))


def add_adapters(model: nn.Module, config) -> nn.Module:
    """Inject the config's adapters into `model` in place; every other weight is frozen.
    Raises ValueError when no module of the model matches `lora_targets`."""
    peft = require_peft()
    try:
        return peft.inject_adapter_in_model(lora_config(config), model)
    except ValueError as e:
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if isinstance(m, nn.Linear)})
        raise ValueError(f"lora_targets={config.lora_targets!r} matches no module of the "
                         f"model ({' '.join(str(e).split())[:120]}); its linear layers are "
                         f"named {', '.join(names)}") from None


def _adapter_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


class AdaptersOff(nn.Module):
    """The model with its adapters switched off, as a module of its own: the reference of a
    LoRA run. It holds no weights; a call runs the wrapped model's forward with every adapter
    disabled and switches them back on after. `module` (as a distributed wrapper names its
    model) sends labkit's passes to the model's own forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.__dict__["module"] = model  # not a submodule: its weights are the policy's

    def forward(self, *args, **kwargs):
        layers = _adapter_layers(self.module)
        for layer in layers:
            layer.enable_adapters(False)
        try:
            return self.module(*args, **kwargs)
        finally:
            for layer in layers:
                layer.enable_adapters(True)


def adapter_state(model: nn.Module) -> dict:
    """The adapters' weights of `model`'s state dict (the keys naming lora_A / lora_B)."""
    return {k: v for k, v in model.state_dict().items() if ".lora_" in k}


def merged(model: nn.Module) -> nn.Module:
    """A copy of `model` with each adapter merged into its base weight and removed: a plain
    model of the base architecture."""
    out = copy.deepcopy(model)
    layers = {id(m) for m in _adapter_layers(out)}
    for name, module in list(out.named_modules()):
        if id(module) in layers:
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent_name) if parent_name else out, child,
                    module.get_base_layer())
    return out


def save_final(model: nn.Module, tokenizer, folder: Path, config) -> None:
    """`folder`: the merged model and tokenizer (any labkit command or transformers loads
    it), and `folder/adapter/`: the adapters in peft's format (adapter_config.json,
    adapter_model.safetensors), for `peft.PeftModel.from_pretrained(base, folder/adapter)`."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = Path(folder)
    merged(model).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    adapter = folder / "adapter"
    lora_config(config).save_pretrained(str(adapter))
    # save_embedding_layers=False: peft's "auto" would look the base model up on the Hub
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    # named as a PeftModel wrapping the model names them, which PeftModel.from_pretrained reads
    weights = {f"base_model.model.{k}": v.detach().contiguous() for k, v in state.items()}
    save_file(weights, str(adapter / "adapter_model.safetensors"))
