"""The notebook runner's progress bar: the training steps its runs have logged, the latest
reward, the cell running and an ETA, read from the run directory while papermill executes.

The kernel runs the notebook's training in its own processes, so the runner watches what
they write: each run's `metrics.jsonl` (its steps and rewards), the runs' `config.json` and
`plan.json` (`run_all`'s list of the runs it will train: the bar's total before they start),
and the executed notebook that papermill saves at each cell (the cell running).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from tqdm.auto import tqdm

PLAN = "plan.json"
"""Written by `labkit.lab.experiments.run_all` where its runs go: {"runs": {run_dir: steps}}."""


def write_plan(run_steps: dict[str, int]) -> None:
    """Record the runs about to train (run_dir -> steps) in their common folder's plan.json,
    for the runner's progress bar."""
    import os

    if len(run_steps) < 2:
        return
    folder = Path(os.path.commonpath([str(Path(p).resolve()) for p in run_steps]))
    path = folder / PLAN
    known = {}
    if path.is_file():
        try:
            known = json.loads(path.read_text(encoding="utf-8")).get("runs", {})
        except ValueError:
            known = {}
    runs = {**known, **{str(Path(p).resolve()): int(s) for p, s in run_steps.items()}}
    path.write_text(json.dumps({"runs": runs}, indent=1) + "\n", encoding="utf-8")


def _last_record(path: Path) -> dict | None:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 8192))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:  # a line being written
            continue
    return None


def _planned_steps(run_dir: Path) -> dict[str, int]:
    """Every run under run_dir and its steps: plan.json's, and each config.json's."""
    steps: dict[str, int] = {}
    for plan in run_dir.rglob(PLAN):
        try:
            steps |= {k: int(v) for k, v in
                      json.loads(plan.read_text(encoding="utf-8"))["runs"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    for config in run_dir.rglob("config.json"):
        if (config.parent / "metrics.jsonl").exists() or str(config.parent) in steps:
            try:
                steps[str(config.parent.resolve())] = int(
                    json.loads(config.read_text(encoding="utf-8"))["config"]["steps"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return steps


def _running_cell(notebook: Path) -> tuple[int, int] | None:
    """(index, count) of the code cell papermill is running, from the notebook it saves."""
    try:
        cells = [c for c in json.loads(notebook.read_text(encoding="utf-8"))["cells"]
                 if c.get("cell_type") == "code"]
    except (OSError, ValueError, KeyError):
        return None
    for i, cell in enumerate(cells):
        if cell.get("metadata", {}).get("papermill", {}).get("status") == "running":
            return i + 1, len(cells)
    return None


class NotebookProgress:
    """A tqdm bar over the training steps of the runs under `run_dir`, updated every
    `every` seconds from a thread until `close()`."""

    def __init__(self, run_dir: Path, notebook: Path, name: str, every: float = 1.0):
        self.run_dir, self.notebook, self.every = Path(run_dir), Path(notebook), every
        self.bar = tqdm(total=0, desc=name, unit="step", dynamic_ncols=True)
        self.name = name
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.wait(self.every):
            self.poll()

    def poll(self) -> None:
        """Read the run directory once and move the bar."""
        steps = _planned_steps(self.run_dir)
        done, latest, latest_time = 0, None, -1.0
        for path in self.run_dir.rglob("metrics.jsonl"):
            if not (path.parent / "config.json").is_file():  # not a training run's
                continue
            record = _last_record(path)
            if record is None:
                continue
            done += int(record.get("step", 0))
            steps.setdefault(str(path.parent.resolve()), int(record.get("step", 0)))
            mtime = path.stat().st_mtime
            if mtime > latest_time and "rollout/reward_mean" in record:
                latest, latest_time = (path.parent.name, record), mtime
        total = sum(steps.values())
        if total != self.bar.total:
            self.bar.total = total
        self.bar.n = min(done, total) if total else done
        cell = _running_cell(self.notebook)
        self.bar.set_description_str(f"{self.name} cell {cell[0]}/{cell[1]}" if cell else
                                     self.name, refresh=False)
        if latest is not None:
            run, record = latest
            self.bar.set_postfix(run=run, step=record["step"],
                                 reward=f"{record['rollout/reward_mean']:.2f}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.poll()
        self.bar.close()
