"""Sweeps that time steps run alone on the machine.

A claim whose measure is a time (`TIME_MEASURES`), or a sweep file that says `alone: true`
(one that times steps among its findings), is timed on a machine with nothing else of
labkit's running: two sweeps side by side share the cores, and each one's step times then
measure the other as much as themselves. Every sweep registers itself in `REGISTRY` (one
small file per process, named by its pid) while it runs; a timing sweep is refused while any
other sweep is registered, and any sweep while a timing one is, each with one line naming
the other, unless `beside` (the commands' `--beside`) says to go on.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REGISTRY = Path(tempfile.gettempdir()) / "labkit-sweeps"
"""Where running sweeps say so: <pid>.json, {"name", "pid", "alone"} (machine-wide)."""

TIME_MEASURES = ("step_time_ratio",)


def times_steps(sweep) -> bool:
    """Whether `sweep` (labkit.lab.sweeps.Sweep) times steps: its file says `alone: true`, or
    one of its claims' preregistered measure is a time."""
    return bool(getattr(sweep, "alone", False)) or any(
        (c.get("preregistered") or {}).get("measure") in TIME_MEASURES for c in sweep.claims)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def running(registry: Path = REGISTRY) -> list[dict]:
    """The other sweeps registered and still alive (a stale file, its process gone, is
    removed)."""
    out = []
    for path in sorted(registry.glob("*.json")) if registry.is_dir() else []:
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if entry.get("pid") == os.getpid():
            continue
        if not _alive(int(entry.get("pid", -1))):
            path.unlink(missing_ok=True)
            continue
        out.append(entry)
    return out


@contextmanager
def on_machine(name: str, alone: bool, beside: bool = False,
               registry: Path = REGISTRY) -> Iterator[None]:
    """Hold sweep `name`'s place on the machine while it runs (see the module docstring).
    ValueError, one line naming the other sweep, where a timing sweep would share it."""
    if not beside:
        for other in running(registry):
            if alone:
                raise ValueError(
                    f"{name} times its steps and runs alone, but sweep {other['name']} (pid "
                    f"{other['pid']}) is running on this machine: wait for it to end, or "
                    "pass --beside to time beside it")
            if other.get("alone"):
                raise ValueError(
                    f"sweep {other['name']} (pid {other['pid']}) times its steps and runs "
                    f"alone on this machine: wait for it to end before {name}, or pass "
                    "--beside")
    registry.mkdir(parents=True, exist_ok=True)
    mine = registry / f"{os.getpid()}.json"
    mine.write_text(json.dumps({"name": name, "pid": os.getpid(), "alone": alone}))
    try:
        yield
    finally:
        mine.unlink(missing_ok=True)
