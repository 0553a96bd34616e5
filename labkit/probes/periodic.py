"""A measurement a run takes now and then, written to a log of its own.

The diagnostics (`diagnose.RunDiagnostics`: diagnostics.jsonl) and the credit microscope
(`microscope.RunCredit`: credit.jsonl) are both one: due on some steps, each look draws from
its own generators and python's and torch's global states are restored after it (so a run
logs the same training metrics with or without it), its record goes to its log through
`rundir.Log`, and the flat figures it returns join that step's metrics.jsonl record. A resume
cuts its log back to the checkpoint with every other log of the run (`rundir.cut_logs`).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from labkit.run.rundir import Log


class Periodic:
    """Subclasses name their `file` and define `due(step)` and `take(trainer, step)`, which
    returns (the flat figures for metrics.jsonl, the record for the log)."""

    file: str

    def __init__(self, config, run_dir: str | Path):
        self.config = config
        self.path = Path(run_dir) / self.file
        self.log = Log(self.path)

    def due(self, step: int) -> bool:
        raise NotImplementedError

    def take(self, trainer, step: int) -> tuple[dict[str, float], dict]:
        raise NotImplementedError

    def measure(self, trainer, step: int) -> dict[str, float]:
        """The flat figures of step `step` ({} when the step is not due), its record logged."""
        if not self.due(step):
            return {}
        state = random.getstate()
        devices = [trainer.device] if trainer.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            flat, record = self.take(trainer, step)
        random.setstate(state)
        self.log.write(record)
        return flat

    def close(self) -> None:
        self.log.close()
