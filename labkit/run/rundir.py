"""Run directories: config.json, the JSONL logs flushed each step, atomic checkpoints.

A run directory is claimed exclusively: a run holds an advisory lock on its `.lock` file
for as long as it writes there (`RunLock`), so two runs, or a run and its own resume, never
write into one folder at once; the operating system drops the lock when the process dies,
even by SIGKILL, so a crashed run can always be resumed. Every log line is written
whole by one `write` and flushed to disk before the next step starts (`Log`, the one writer
of every log), and a checkpoint is written to a temporary file, synced and renamed into
place, so a run killed at any moment leaves valid logs (at worst a torn last line, which
`read_log` drops) and a loadable last checkpoint.
"""

from __future__ import annotations

import fcntl
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
LOCK = ".lock"
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


class RunDirBusy(FileExistsError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """An exclusive lock on `run_dir/.lock`, held while a run writes into `run_dir`.

    `flock` rather than a lock file's mere existence: the lock belongs to the open file, so
    it vanishes with the process however it ends (a stale file never blocks a resume), and
    two processes, or two threads, that race for it cannot both win. The file itself stays
    (unlinking it would let a late opener lock a different inode); it holds the owner's pid.
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        fd = os.open(self.run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusy(f"{str(self.run_dir)!r} is in use by another run (pid {owner}): "
                             "wait for it to end, or pick another folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim_run_dir(path: str | Path) -> RunLock:
    """Take `path` as a new run directory: it must not exist, or be an empty folder. Returns
    the held lock (release it when the run ends); the check and the lock are one step, so
    of two runs started at once with the same folder exactly one gets it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"run_dir={str(path)!r} is a file, not a folder")
    path.mkdir(parents=True, exist_ok=True)
    lock = RunLock(path)
    if any(p.name != LOCK for p in path.iterdir()):
        lock.release()
        raise FileExistsError(f"run_dir={str(path)!r} already holds files: pick a new folder, "
                              "or resume that run")
    return lock


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a synced temporary file and a rename, so a reader (or a
    resume after a crash) sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_dir(path.parent)


def write_json(path: str | Path, value) -> None:
    """A small JSON file (a run's outcome), written atomically."""
    _write_atomic(Path(path), json.dumps(value, indent=2) + "\n")


def _sync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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


def write_config(run_dir: Path, config: dict, machine: dict | None = None,
                 fork: dict | None = None) -> None:
    """config.json: every parameter, the package versions, the git commit, the command,
    `machine` (labkit.model.learner.machine: device, CPU capability, threads, precision),
    for a fork `fork` (its parent, step, changes and continuation seed: labkit.fork) and, for
    a code task, `sandbox` (labkit.sandbox.isolation: the layers around its programs)."""
    record = {"config": config, "versions": versions(), "git_commit": git_commit(),
              "machine": machine or {}, "argv": sys.argv,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if fork is not None:
        record["fork"] = fork
    if config.get("task") == "code":  # what stands around the model's programs
        from labkit.sandbox import isolation

        record["sandbox"] = isolation()
    _write_atomic(Path(run_dir) / "config.json", json.dumps(record, indent=2) + "\n")


def read_config(run_dir: str | Path) -> dict:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))["config"]
    except (ValueError, KeyError, TypeError):
        config = None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a labkit run config (no 'config' mapping in it)")
    return config


class Log:
    """One of a run's JSONL logs (metrics.jsonl, rollouts.jsonl, diagnostics.jsonl,
    credit.jsonl, and any later one): one JSON object per line, each with its `step`.

    Each record is one `os.write` of the whole encoded line on an O_APPEND file, then fsync,
    so no line is interleaved with buffered leftovers and a step's record is on disk before
    the next step starts. The file is opened on the first write (a log that is never written
    leaves no file). A kill in the middle of a write (possible for lines longer than a page),
    a full disk or a power cut can still tear the last line: `read_log` drops it, and a
    resume cuts every log of the run back to its checkpoint (`cut_logs`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd: int | None = None

    def open(self) -> Log:
        """Create the file now (a run's metrics.jsonl exists from its start: watchers of a
        sweep read its presence as "started"); `write` opens it otherwise."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self

    def write(self, *records: dict) -> None:
        self.open()
        data = "".join(json.dumps(r, allow_nan=True) + "\n" for r in records).encode("utf-8")
        written = os.write(self._fd, data)
        while written < len(data):  # a short write (disk full, signal): finish the lines
            written += os.write(self._fd, data[written:])
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_log(path: str | Path) -> list[dict]:
    """The records of a JSONL log; a torn last line (a crash mid-write) is left out, and so
    is everything after a torn line (a file appended to without `cut_logs`)."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    for line in path.read_bytes().decode("utf-8", errors="replace").split("\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(record, dict):
            break
        records.append(record)
    return records


def cut_log(path: str | Path, last_step: int) -> None:
    """Keep the whole records of steps <= `last_step` (a resumed run writes the steps after
    it again, and a torn last line goes), replacing the file atomically."""
    kept = [r for r in read_log(path) if r.get("step", 0) <= last_step]
    _write_atomic(Path(path), "".join(json.dumps(r, allow_nan=True) + "\n" for r in kept))


def cut_logs(run_dir: str | Path, last_step: int) -> list[Path]:
    """Cut every JSONL log of the run back to `last_step` (-1: to nothing, a run killed
    before its first checkpoint); the logs it cut."""
    found = sorted(Path(run_dir).glob("*.jsonl"))
    for path in found:
        cut_log(path, last_step)
    return found


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


def save_checkpoint(run_dir: Path, step: int, state: dict, keep: int = 2,
                    name: str = "step", keep_every: int = 0) -> Path:
    """Write `checkpoints/<name>_XXXXXX.pt` atomically (a synced temporary file renamed into
    place); keep the newest `keep` step checkpoints, and for good those at steps divisible
    by `keep_every` (0: none). Only `step_*` files are what a resume loads; another `name`
    marks a state that is not the end of a step."""
    folder = Path(run_dir) / CHECKPOINTS
    folder.mkdir(exist_ok=True)
    for stale in folder.glob(".*.pt.tmp"):  # left by a run killed while saving
        stale.unlink(missing_ok=True)
    path = folder / f"{name}_{step:06d}.pt"
    tmp = folder / f".{name}_{step:06d}.pt.tmp"
    with open(tmp, "wb") as f:
        torch.save({"step": step, "rng": rng_state(), **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_dir(folder)
    if name == "step":
        for old in sorted(folder.glob("step_*.pt"))[:-keep]:
            if not (keep_every and checkpoint_step(old) % keep_every == 0):
                old.unlink()
    return path


def checkpoint_step(path: Path) -> int:
    """The step of a `step_XXXXXX.pt` checkpoint, from its name."""
    return int(Path(path).stem.split("_")[-1])


def kept_steps(run_dir: str | Path) -> list[int]:
    """The steps of the run's kept `step_*` checkpoints, in order."""
    return sorted(checkpoint_step(p) for p in (Path(run_dir) / CHECKPOINTS).glob("step_*.pt"))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = sorted((Path(run_dir) / CHECKPOINTS).glob("step_*.pt"))
    return found[-1] if found else None


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    return torch.load(path, map_location=map_location, weights_only=False)
