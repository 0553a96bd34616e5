"""Run directories: config.json, metrics.jsonl flushed each step, atomic checkpoints.

A run directory is created exclusively (two runs never share one), every metrics line is
written whole and flushed before the next step starts, and a checkpoint is written to a
temporary file and renamed into place, so a run killed at any moment leaves a valid
metrics.jsonl and a loadable last checkpoint.
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

RUNS_ROOT = Path("experiments") / "runs"
CHECKPOINTS = "checkpoints"
PACKAGES = ("labkit", "torch", "transformers", "accelerate", "tokenizers", "math-verify", "trl")


def new_run_dir(name: str, root: str | Path = RUNS_ROOT) -> Path:
    """A fresh `root/name/<date-time>-<pid>[-k]` folder, created so no other run can take it."""
    base = Path(root) / name
    base.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for k in range(1000):
        path = base / (stem if k == 0 else f"{stem}-{k}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a fresh run directory under {base}")


def claim_run_dir(path: str | Path) -> Path:
    """Use `path` as a new run directory: it must not exist, or be an empty folder."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"run_dir={str(path)!r} already holds files: pick a new folder, "
                              "or resume that run")
    path.mkdir(parents=True, exist_ok=True)
    return path


def git_commit() -> str | None:
    """The commit of the labkit checkout, or None outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def versions() -> dict[str, str | None]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def write_config(run_dir: Path, config: dict) -> None:
    """config.json: every parameter, the package versions, the git commit, the command."""
    record = {"config": config, "versions": versions(), "git_commit": git_commit(),
              "argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (run_dir / "config.json").write_text(json.dumps(record, indent=2) + "\n")


def read_config(run_dir: str | Path) -> dict:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no config.json")
    return json.loads(path.read_text())["config"]


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl and flushes it at once."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a crash mid-write) is left out."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the records up to `last_step` (a resumed run rewrites the steps after it)."""
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, state: dict, keep: int = 2) -> Path:
    """Write `checkpoints/step_XXXXXX.pt` atomically; keep the newest `keep` of them."""
    folder = Path(run_dir) / CHECKPOINTS
    folder.mkdir(exist_ok=True)
    path = folder / f"step_{step:06d}.pt"
    tmp = folder / f".step_{step:06d}.pt.tmp"
    torch.save({"step": step, "rng": rng_state(), **state}, tmp)
    os.replace(tmp, path)
    for old in sorted(folder.glob("step_*.pt"))[:-keep]:
        old.unlink()
    return path


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = sorted((Path(run_dir) / CHECKPOINTS).glob("step_*.pt"))
    return found[-1] if found else None


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    return torch.load(path, map_location=map_location, weights_only=False)
