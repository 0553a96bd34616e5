"""Whether this machine has what a config names: a saved model at a local model path, the
GSM8K or code file, a place for run_dir, the device, a tracker's package, peft for LoRA.
The trainer asks before it makes a run folder or loads anything."""

from __future__ import annotations

import sys
from pathlib import Path

from labkit.problems.dataset_task import check_columns, read_rows
from labkit.run import trackers
from labkit.settings.config import TrainConfig
from labkit.settings.embedded import EMBEDDED


def preflight(config: TrainConfig) -> None:
    """Does this machine have what `config` names: a saved model at a local model path, the
    GSM8K file, a place for run_dir, the device? ValueError names the field. The trainer
    asks before it makes a run folder or loads anything; a config read back on resume is
    not probed again."""
    if config.model is not None and config.model not in EMBEDDED:
        path = Path(config.model).expanduser()
        looks_local = path.exists() or config.model.startswith((".", "/", "~")) \
            or config.model.count("/") > 1 or "\\" in config.model
        if looks_local and not (path / "config.json").is_file():
            raise ValueError(f"model={config.model!r}: no saved model there (no config.json)")
        if looks_local:
            _check_causal_lm(config.model, path / "config.json")
    if config.task == "gsm8k":
        if not Path(config.gsm8k_path).expanduser().is_file():
            raise ValueError(f"gsm8k_path={config.gsm8k_path!r} is not a file")
        # GSM8K's own columns: the question, and the answer that ends '#### <number>'
        rows = read_rows(config.gsm8k_path)
        missing = [c for c in ("question", "answer") if not rows or c not in rows[0]]
        if missing:
            raise ValueError(f"gsm8k_path={config.gsm8k_path!r}: a GSM8K file has question and "
                             f"answer columns; this one lacks {' and '.join(missing)} (its "
                             f"columns: {', '.join(rows[0]) if rows else 'none, no rows'})")
    if config.task == "dataset":
        # the file read and its columns checked before the model loads
        if not Path(config.dataset_path).expanduser().is_file():
            raise ValueError(f"dataset_path={config.dataset_path!r} is not a file")
        check_columns(config.dataset_path, read_rows(config.dataset_path),
                      config.prompt_column, config.answer_column)
    if config.task == "code":
        if not Path(config.code_path).expanduser().is_file():
            raise ValueError(f"code_path={config.code_path!r} is not a file")
        from labkit.sandbox import launch  # the sandbox wing, loaded only for a code task

        launch.require_boundary(sys.executable, None)  # before the model loads
    if config.run_dir is not None:
        path = Path(config.run_dir).expanduser()
        if path.exists() and not path.is_dir():
            raise ValueError(f"run_dir={config.run_dir!r} is a file, not a folder")
        parent = next((p for p in path.parents if p.exists()), None)
        if not path.exists() and parent is not None and not parent.is_dir():
            raise ValueError(f"run_dir={config.run_dir!r} cannot be made: {str(parent)!r} "
                             "is a file")
    if config.device is not None:
        _check_device(config.device)
    trackers.require(config.report_to)
    if config.lora_rank:
        try:
            require_peft()
        except ImportError as e:
            raise ValueError(str(e)) from None


def _check_causal_lm(model: str, config_file: Path) -> None:
    """That a model folder's config.json names an architecture transformers loads as a causal
    LM (AutoModelForCausalLM's model types); ValueError naming `model` otherwise."""
    import json

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        kind = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as e:
        raise ValueError(f"model={model!r}: its config.json cannot be read ({e})") from None
    if kind is not None and kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # none: the loader
        raise ValueError(f"model={model!r}: its config.json names model_type {kind!r}, not a "
                         "causal LM (transformers' AutoModelForCausalLM takes llama, qwen2, "
                         "mistral, gpt2, ...)")


def _check_device(device: str) -> None:
    """That this machine has the device (its spelling is the config's check): a run asked
    for cuda:1 should not find out after its run directory exists that there is no second
    GPU."""
    import torch

    kind, _, index = device.partition(":")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={device!r} asks for CUDA, but torch sees no CUDA device")
        if index and int(index) >= count:
            raise ValueError(f"device={device!r}: torch sees {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r} asks for Apple MPS, which this machine lacks")


def require_peft():
    """The `peft` module, or ImportError naming the extra to install."""
    try:
        import peft
    except ImportError:
        raise ImportError("lora_rank > 0 needs peft: pip install 'labkit[lora]'") from None
    return peft
