"""Sweeps that time steps run alone on the machine (labkit.lab.alone)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.lab import alone
from labkit.lab.sweeps import load_sweep

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def other():
    """Another live process to stand for a sweep running beside this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _register(registry: Path, pid: int, name: str, times: bool) -> None:
    registry.mkdir(parents=True, exist_ok=True)
    (registry / f"{pid}.json").write_text(json.dumps({"name": name, "pid": pid,
                                                      "alone": times}))


def test_a_timing_sweep_is_refused_beside_another_unless_told(tmp_path, other):
    registry = tmp_path / "sweeps"
    _register(registry, other, "claim05_length_rate", False)
    with pytest.raises(ValueError, match=r"^claim01_cost times its steps and runs alone, but "
                                         r"sweep claim05_length_rate \(pid \d+\) is running"):
        with alone.on_machine("claim01_cost", True, registry=registry):
            pass
    with alone.on_machine("claim01_cost", True, beside=True, registry=registry):
        mine = json.loads((registry / f"{__import__('os').getpid()}.json").read_text())
        assert mine == {"name": "claim01_cost", "pid": mine["pid"], "alone": True}
    assert len(list(registry.glob("*.json"))) == 1  # its own place given back on the way out
    with alone.on_machine("claim08_monitors", False, registry=registry):  # two plain sweeps
        pass


def test_no_sweep_starts_beside_a_timing_one_and_a_dead_ones_place_is_freed(tmp_path, other):
    registry = tmp_path / "sweeps"
    _register(registry, other, "claim01_cost", True)
    with pytest.raises(ValueError, match=r"^sweep claim01_cost \(pid \d+\) times its steps and "
                                         r"runs alone on this machine: wait for it to end "
                                         r"before claim08_monitors, or pass --beside"):
        with alone.on_machine("claim08_monitors", False, registry=registry):
            pass
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    (registry / f"{other}.json").unlink()
    _register(registry, int(done.stdout), "claim01_cost", True)  # its process has ended
    with alone.on_machine("claim08_monitors", False, registry=registry):
        pass
    assert not (registry / f"{int(done.stdout)}.json").exists()


def test_which_sweeps_time_steps():
    claims = REPO / "experiments" / "claims"
    assert alone.times_steps(load_sweep(claims / "01_cost.yaml"))  # `alone: true`
    assert not alone.times_steps(load_sweep(claims / "05_length_rate.yaml"))
    timed = load_sweep(claims / "05_length_rate.yaml")
    timed.claims = [{"preregistered": {"measure": "step_time_ratio"}}]
    assert alone.times_steps(timed)
