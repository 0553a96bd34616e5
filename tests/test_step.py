"""The step's plain path: what `algos.step` runs, and what it leaves alone unless asked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import labkit
from labkit import algos
from labkit.formulas import advantages as adv
from labkit.settings.config import TrainConfig
from labkit.trainer import Trainer

STEP = dict(batch_prompts=4, group_size=4, max_new_tokens=12, eval_n=4, eval_samples=0,
            cgc_prompts=0, progress=False, lr=5e-4, threads=1)
PACKAGE = Path(labkit.__file__).parent
WINGS = {"multi-process": [PACKAGE / "model" / "parallel.py"],
         "mismatch": [PACKAGE / "formulas" / "mismatch.py"],
         "replay": [PACKAGE / "fast" / "replay.py"], "fast": sorted((PACKAGE / "fast").glob("*.py"))}


def _files_called(fn) -> set[Path]:
    """The files of every Python function `fn()` calls, at any depth."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {Path(name).resolve() for name in seen}


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_the_plain_step_calls_no_multi_process_mismatch_replay_or_fast_code(algo):
    """fast=False, one process, no mismatch options: from the rollout to the update, no
    function of labkit.model.parallel, labkit.formulas.mismatch or labkit.fast runs."""
    trainer = Trainer(TrainConfig(algo=algo, fast=False, beta=0.04, minibatches=2, **STEP))
    called = _files_called(lambda: trainer.step(1))
    assert PACKAGE / "update.py" in called and PACKAGE / "stages.py" in called  # it did trace
    for wing, files in WINGS.items():
        assert not called & {f.resolve() for f in files}, f"the plain step ran {wing} code"


def test_the_wings_run_when_the_config_asks_for_them():
    """The negative control of the test above: with a sampler temperature (a mismatch to
    measure) and the fast path, the same trace sees labkit.formulas.mismatch and labkit.fast."""
    trainer = Trainer(TrainConfig(sampler_temperature=1.2, mismatch_is="token", **STEP))
    called = _files_called(lambda: trainer.step(1))
    assert (PACKAGE / "formulas" / "mismatch.py").resolve() in called
    assert called & {f.resolve() for f in WINGS["fast"]}


def test_gae_runs_once_a_ppo_step_and_its_returns_are_the_critics_target(monkeypatch):
    """The estimator returns what it computes: GAE runs once a PPO step; the step's
    advantages are that run's whitened, its returns (the critic's target) that run's."""
    calls = []
    original = adv.gae

    def counted(*args, **kwargs):
        calls.append(original(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(adv, "gae", counted)
    config = TrainConfig(algo="ppo", beta=0.04, **STEP)
    trainer = Trainer(config)
    out = algos.step(config, trainer.learner, trainer.tokenizer, trainer.problems.draw(5), 5)
    assert len(calls) == 1
    gae_advantages, gae_returns = calls[0]
    assert torch.equal(out.returns, gae_returns)
    assert torch.equal(out.advantages, adv.whiten(gae_advantages, out.batch.completion_mask))


FENCE = """
import sys, tempfile
from labkit.settings.config import TrainConfig
from labkit.trainer import train
train(TrainConfig(fast={fast}, steps=2, batch_prompts=2, group_size=2, max_new_tokens=6,
                  eval_every=1, eval_n=4, eval_samples=2, cgc_prompts=2, beta=0.04,
                  progress=False, run_dir=tempfile.mkdtemp() + "/run"))
print(sorted(name for name in sys.modules if name.startswith("labkit.fast")))
"""


@pytest.mark.parametrize("fast", [False, True])
def test_a_plain_run_never_imports_the_fast_wing(fast):
    """A whole run with fast=False (training, evaluation, checkpoints) loads no module of
    labkit.fast; with fast=True it does (the control)."""
    done = subprocess.run([sys.executable, "-c", FENCE.format(fast=fast)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = done.stdout.strip().splitlines()[-1]
    assert (loaded != "[]") == fast, loaded
