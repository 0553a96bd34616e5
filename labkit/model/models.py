"""Load a causal LM and its tokenizer: the embedded tiny model, a local path, or a hub id.

Nothing here downloads unless the user names a hub id on a machine that reaches the hub;
offline, a hub id fails with a message that says to pass a local path instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from labkit.settings.embedded import EMBEDDED, EMBEDDED_NAME

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """`device` as a torch.device; None picks CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be like 'cpu', 'cuda' or 'cuda:1', got {device!r}") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for CUDA, but torch sees no CUDA device")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`dtype` as a torch.dtype; None and 'auto' mean bf16 on a GPU that has it, else fp32."""
    if dtype is None or dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be a torch.dtype, 'auto' or one of {sorted(DTYPES)}, "
                         f"got {dtype!r}")
    return DTYPES[dtype]


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def resolve_model_path(name_or_path: str | os.PathLike | None) -> str:
    """The path or hub id to hand to `from_pretrained`; None means the embedded model, a name
    of EMBEDDED another model shipped in the package."""
    name = EMBEDDED_NAME if name_or_path is None else str(name_or_path)
    if name in EMBEDDED:
        if not (EMBEDDED[name] / "config.json").is_file():
            raise FileNotFoundError(f"the embedded model {name} is missing from "
                                    f"{EMBEDDED[name]}; rebuild it with `python -m labkit.zoo "
                                    f"build --preset {name}`")
        return str(EMBEDDED[name])
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"name_or_path={str(name_or_path)!r} is a local path but "
                                    "holds no config.json: point it at a saved model folder")
        return str(path)
    if not _looks_like_hub_id(str(name_or_path)):
        raise FileNotFoundError(f"name_or_path={str(name_or_path)!r} is neither an existing "
                                "local folder nor a hub id of the form 'org/name'")
    return str(name_or_path)


def _offline() -> bool:
    """True when the user asked for no hub traffic (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    flags = (os.environ.get(k, "").strip().lower() for k in ("HF_HUB_OFFLINE",
                                                              "TRANSFORMERS_OFFLINE"))
    return any(f in ("1", "true", "yes", "on") for f in flags)


def _from_pretrained(source: str, dtype: torch.dtype, local_only: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_only)
    return model, tokenizer


def load(name_or_path: str | os.PathLike | None = None, device: str | torch.device | None = None,
         dtype: str | torch.dtype | None = None):
    """Load `(model, tokenizer)` for a causal LM.

    name_or_path: None (or "tiny-arith") for the embedded model, a local folder saved with
    `save_pretrained`, or a hub id (needs the hub, or the model in the local cache).
    device: None picks CUDA when available. dtype: None/"auto" picks bf16 on a GPU that has
    it, else fp32. The tokenizer pads on the left (generation appends on the right) and gets
    a pad token (its EOS) when it has none. The model is returned in eval mode.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    source = resolve_model_path(name_or_path)
    try:
        # a local folder, or a hub id already in the local cache: no network at all
        model, tokenizer = _from_pretrained(source, dtype, local_only=True)
    except OSError as miss:
        if Path(source).exists():
            raise
        try:
            if _offline():
                raise miss
            model, tokenizer = _from_pretrained(source, dtype, local_only=False)
        except OSError as e:
            raise OSError(f"could not load {source!r} from the Hugging Face hub (offline, no "
                          "network, or not in the local cache). Download it where the hub is "
                          "reachable and pass the local folder as name_or_path instead.") from e
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device).eval(), tokenizer
