"""A run killed mid-way, from a test: the trainer's callback raises right after a step was
logged, as a crash would stop it, and leaves the run directory as that crash would."""

from __future__ import annotations

import pytest

from labkit.trainer import train


class Stop(Exception):
    """What the callback raises: no code under test raises it."""


def train_then_crash(config, after_step: int) -> None:
    """`train(config)`, stopped by an exception just after step `after_step` is logged (and
    before any checkpoint that step's end would write)."""
    def crash(report):
        if report.step == after_step:
            raise Stop

    with pytest.raises(Stop):
        train(config, callbacks=[crash])
