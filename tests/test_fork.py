"""Forking a run at step k (labkit.fork): a fork that changes nothing repeats its parent's
records after k exactly; a changed field takes effect (the logged lr, a non-zero KL); the
continuations of a seed set differ and the unchanged one is re-run at the same seeds;
fields that fix the checkpoint are refused, and a step with no checkpoint names the nearest."""

import json
from pathlib import Path

import pytest

from labkit import fork
from labkit.__main__ import main
from labkit.lab import forks
from labkit.run import rundir
from labkit.settings.config import TrainConfig
from labkit.trainer import train

TINY = dict(steps=4, batch_prompts=2, group_size=2, eval_every=2, eval_n=8, threads=1,
            progress=False, checkpoint_every=1, keep_every=2, rollouts_every=1)


@pytest.fixture(scope="module")
def parents(tmp_path_factory):
    """A GRPO, a PPO and a DPO run of four steps, each keeping its checkpoints at 2 and 4
    (keep_every) beside the newest two."""
    root = tmp_path_factory.mktemp("parents")
    return {algo: train(TrainConfig(algo=algo, run_dir=str(root / algo), **TINY)).run_dir
            for algo in ("grpo", "ppo", "dpo")}


def _steps(path: Path) -> list[dict]:
    return rundir.read_log(path / "metrics.jsonl")


def _same(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("perf/")}


def test_a_run_keeps_every_kth_checkpoint_beside_the_newest(parents):
    assert rundir.kept_steps(parents["grpo"]) == [2, 3, 4]  # 2 kept for good, 3 and 4 newest


@pytest.mark.parametrize("algo", ["grpo", "ppo", "dpo"])
def test_a_fork_that_changes_nothing_repeats_its_parent_after_the_fork_step(algo, parents,
                                                                            tmp_path):
    parent = parents[algo]
    result = fork.fork(parent, 2, out=tmp_path / "fork", progress=False)
    mine = _steps(result.run_dir)
    theirs = [r for r in _steps(parent) if r["step"] > 2]
    assert [r["step"] for r in mine] == [3, 4]  # its logs start after the fork step
    assert [_same(r) for r in mine] == [_same(r) for r in theirs]
    rollouts = rundir.read_log(result.run_dir / "rollouts.jsonl")
    assert rollouts and min(r["step"] for r in rollouts) == 3
    record = json.loads((result.run_dir / "config.json").read_text())
    assert record["fork"] == {"parent": str(parent), "step": 2, "changes": {},
                              "continuation_seed": None}
    assert record["config"]["fork_of"] == str(parent) and record["config"]["fork_step"] == 2


def test_a_changed_lr_is_the_schedule_the_fork_logs(parents, tmp_path):
    parent = parents["grpo"]
    result = fork.fork(parent, 2, {"lr": 5e-4}, out=tmp_path / "fork", progress=False)
    before = {r["step"]: r["opt/lr"] for r in _steps(parent) if "opt/lr" in r}
    after = {r["step"]: r["opt/lr"] for r in _steps(result.run_dir) if "opt/lr" in r}
    assert TrainConfig.from_dict(rundir.read_config(parent)).lr == 1e-3
    for step in (3, 4):  # the same warmup and decay, at half the rate
        assert after[step] == pytest.approx(before[step] / 2, rel=1e-9)


def test_beta_from_0_to_a_kl_penalty_loads_a_reference_and_pays_a_kl(parents, tmp_path, capsys):
    parent = parents["grpo"]
    assert TrainConfig.from_dict(rundir.read_config(parent)).beta == 0
    assert all(r.get("loss/kl", 0) == 0 for r in _steps(parent))
    result = fork.fork(parent, 2, {"beta": 0.1}, out=tmp_path / "fork", progress=False)
    assert "the reference is the base model" in capsys.readouterr().err
    kl = [r["loss/kl"] for r in _steps(result.run_dir)]
    assert kl and all(k > 0 for k in kl[1:])  # step 3's policy is the checkpoint's, not the base


def test_continuations_differ_and_the_unchanged_one_runs_at_the_same_seeds(parents, tmp_path):
    parent = parents["grpo"]
    found = fork.continuations(parent, 2, {"eps_low": 0.1}, 2, out=tmp_path / "forks",
                               progress=False)
    assert [c for c, _, _ in found] == [0, 1]
    rows = {(arm, c): _steps(run.run_dir) for c, changed, same in found
            for arm, run in (("changed", changed), ("unchanged", same))}
    assert [_same(r) for r in rows[("unchanged", 0)]] != [_same(r) for r in rows[("unchanged", 1)]]
    theirs = [_same(r) for r in _steps(parent) if r["step"] > 2]
    assert [_same(r) for r in rows[("unchanged", 0)]] != theirs  # a fresh stream, not the parent's
    for c, changed, same in found:
        for run, changes in ((changed, {"eps_low": "0.1"}), (same, {})):
            record = json.loads((run.run_dir / "config.json").read_text())
            assert record["fork"]["continuation_seed"] == c
            assert record["fork"]["changes"] == changes
        # paired: the same prompts at the fork's first step with and without the change
        first = [rundir.read_log(r.run_dir / "rollouts.jsonl")[0]["prompt"]
                 for r in (changed, same)]
        assert first[0] == first[1]


def test_immutable_fields_and_missing_checkpoints_are_one_error_line(parents, tmp_path, capsys):
    parent = parents["grpo"]
    for field, why in (("model", "weights"), ("algo", "algorithm"), ("lora_rank", "LoRA")):
        out = tmp_path / f"f-{field}"
        assert main(["fork", str(parent), "--at", "2", "--set", f"{field}=x", "--out",
                     str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --set {field}: a fork cannot change {field}: ")
        assert why in err and len(err.splitlines()) == 1 and not out.exists()
    assert main(["fork", str(parent), "--at", "1", "--out", str(tmp_path / "f1")]) == 2
    err = capsys.readouterr().err.strip()
    assert "keeps no checkpoint at step 1; the nearest kept: 2 (all kept: 2, 3, 4;" in err
    assert not (tmp_path / "f1").exists()


def test_the_lab_proposes_the_last_kept_checkpoint_before_a_collapse(tmp_path):
    run = tmp_path / "run"
    (run / rundir.CHECKPOINTS).mkdir(parents=True)
    for step in (10, 20, 30, 40):
        (run / rundir.CHECKPOINTS / f"step_{step:06d}.pt").write_bytes(b"")
    accuracy = {0: 0.4, 10: 0.5, 20: 0.5, 30: 0.45, 40: 0.03}  # below a tenth of 0.4 at 40
    history = [{"step": s, "rollout/truncated_frac": 0.0,
                **({"eval/accuracy": accuracy[s]} if s in accuracy else {})}
               for s in range(41)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    step, why = forks.where_to_fork(run)
    assert step == 30 and "first warning, at step 40" in why and "below a tenth" in why
    calm = tmp_path / "calm"
    calm.mkdir()
    (calm / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.4}) + "\n")
    with pytest.raises(ValueError, match="neither collapsed nor stopped"):
        forks.where_to_fork(calm)


def test_the_forensics_figure_draws_the_parent_to_the_fork_and_marks_it():
    history = [{"step": s, "rollout/reward_mean": s / 10, **({"eval/accuracy": 0.3}
                                                             if s % 2 == 0 else {})}
               for s in range(0, 9)]
    plot = forks.ForkPlot(history, 4)
    plot.add("kl", [{"step": s, "rollout/reward_mean": 0.5, "eval/accuracy": 0.4}
                    for s in range(5, 9)])
    plot.add("kl", [{"step": s, "rollout/reward_mean": 0.7, "eval/accuracy": 0.2}
                    for s in range(5, 9)])
    fig = plot.static()
    parent = [t for t in fig.data if t.name == "parent"]
    assert [max(t.x) for t in parent] == [4, 4]  # accuracy and reward, to the fork step
    assert [s.x0 for s in fig.layout.shapes] == [4, 4]  # the fork marked in each panel
    mean = [t for t in fig.data if t.name == "kl"]
    assert [list(t.y) for t in mean] == [pytest.approx([0.3] * 4), pytest.approx([0.6] * 4)]
