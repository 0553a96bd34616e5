"""Kill and resume: every log of a run (metrics, rollouts, diagnostics, credit) reads line by
line as an uninterrupted run's.

Each case runs a short run whole, and the same run stopped just after a step was logged (before
that step's checkpoint), then resumed: the resume restarts from the last checkpoint and
writes the steps after it again, so a log it did not cut back would hold those steps twice.
"""

from __future__ import annotations

import json

import pytest
from crashes import train_then_crash

from labkit.run import rundir
from labkit.settings.config import TrainConfig
from labkit.trainer import train

SMALL = dict(steps=5, batch_prompts=2, group_size=4, max_new_tokens=8, eval_every=5, eval_n=8,
             eval_samples=0, cgc_prompts=0, progress=False, seed=1, lr=5e-4,
             checkpoint_every=3, rollouts_every=2, rollouts_groups=1)
CASES = {
    "grpo": dict(algo="grpo"),
    "ppo": dict(algo="ppo"),
    "dpo": dict(algo="dpo"),
    "rft": dict(algo="rft"),
    "think, diagnostics and credit": dict(
        algo="ppo", task="think", max_new_tokens=None, diag_every=2, diag_prompts=2,
        diag_batches=3, diag_samples=2, credit_every=2, credit_prompts=1, credit_samples=2),
    "lora": dict(algo="grpo", lora_rank=4),
    "fast=False": dict(algo="ppo", fast=False),
}
CLOCK = ("perf/", "seconds", "_s")
"""Keys of wall-clock figures, which no two runs share."""


def _timeless(value):
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items()
                if not (k.startswith(CLOCK[0]) or CLOCK[1] in k or k.endswith(CLOCK[2]))}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def _logs(run_dir) -> dict[str, list[str]]:
    """Every .jsonl file of the run, line by line, each line without its clock figures."""
    return {path.name: [json.dumps(_timeless(json.loads(line)), sort_keys=True)
                        for line in path.read_text(encoding="utf-8").splitlines()]
            for path in sorted(run_dir.glob("*.jsonl"))}


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_and_resumed_run_logs_each_line_once(tmp_path, case):
    settings = dict(SMALL, **CASES[case])
    whole = train(TrainConfig(run_dir=str(tmp_path / "whole"), **settings)).run_dir
    cut = tmp_path / "cut"
    train_then_crash(TrainConfig(run_dir=str(cut), **settings), after_step=4)
    # step 4 is in every log, the last checkpoint is step 3's: the resume redoes step 4
    for name, lines in _logs(cut).items():
        assert json.loads(lines[-1])["step"] == 4, name
    train(resume=cut)
    expected, resumed = _logs(whole), _logs(cut)
    wanted = {"metrics.jsonl", "rollouts.jsonl"} | (
        {"diagnostics.jsonl", "credit.jsonl"} if "diag_every" in settings else set())
    assert wanted <= set(expected)
    assert set(resumed) == set(expected)
    for name in expected:
        assert resumed[name] == expected[name], name


def test_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path):
    settings = dict(SMALL, algo="ppo", diag_every=2, diag_prompts=2, diag_batches=3,
                    diag_samples=2, credit_every=2, credit_prompts=1, credit_samples=2,
                    checkpoint_every=5)
    whole = train(TrainConfig(run_dir=str(tmp_path / "whole"), **settings)).run_dir
    cut = tmp_path / "cut"
    train_then_crash(TrainConfig(run_dir=str(cut), **settings), after_step=4)
    assert rundir.latest_checkpoint(cut) is None
    assert [json.loads(line)["step"] for line in _logs(cut)["diagnostics.jsonl"]] == [0, 2, 4]
    train(resume=cut)
    assert _logs(cut) == _logs(whole)


def test_every_log_is_cut_back_and_a_torn_line_dropped(tmp_path):
    """`cut_logs` cuts each .jsonl of the run, whatever its name, and drops a torn last line."""
    for name in ("metrics.jsonl", "later.jsonl"):
        log = rundir.Log(tmp_path / name)
        log.write(*({"step": s} for s in range(5)))
        log.close()
    with open(tmp_path / "later.jsonl", "a") as f:
        f.write('{"step": 5, "x"')  # a torn last line
    assert [r["step"] for r in rundir.read_log(tmp_path / "later.jsonl")] == list(range(5))
    cut = rundir.cut_logs(tmp_path, 2)
    assert sorted(p.name for p in cut) == ["later.jsonl", "metrics.jsonl"]
    for name in ("metrics.jsonl", "later.jsonl"):
        assert (tmp_path / name).read_text().splitlines() == [
            json.dumps({"step": s}) for s in range(3)]
