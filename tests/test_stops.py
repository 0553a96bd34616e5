"""Stop rules: the grammar of `TrainConfig.stop_rules`, the streak tracker, and real short
runs that a rule ends (or, never firing, leaves alone)."""

import json
import math

import pytest

from labkit.records import STOPPED
from labkit.run.rundir import latest_checkpoint, load_checkpoint, read_log
from labkit.run.stops import DEAD_TRUNCATED, DeadRunWatch, StopRule, StopRules, parse
from labkit.settings.config import TrainConfig
from labkit.trainer import train

# the trainer's smoke settings, with evaluation cut to the minimum: these runs are about steps
FAST = dict(batch_prompts=4, group_size=4, max_new_tokens=12, eval_every=1000, eval_n=4,
            eval_samples=0, cgc_prompts=0, progress=False, lr=5e-4)
CLIPPING = dict(lr=1e-2, warmup_steps=0)  # steps large enough that a second pass clips


# --- grammar ---------------------------------------------------------------------------------

def test_rules_parse_into_metric_op_threshold_count():
    assert parse("adv/gav>0.45 for 5; policy/kl>0.5") == [
        StopRule("adv/gav", ">", 0.45, 5), StopRule("policy/kl", ">", 0.5, 1)]
    assert parse("  rollout/reward_mean >= 1e-3  for 12 ;; eval/accuracy<=0.1;loss/total < -2") == [
        StopRule("rollout/reward_mean", ">=", 1e-3, 12), StopRule("eval/accuracy", "<=", 0.1, 1),
        StopRule("loss/total", "<", -2.0, 1)]
    assert parse("") == [] and parse(" ; ") == []
    assert parse("eval/pass@16<0.2") == [StopRule("eval/pass@16", "<", 0.2, 1)]


def test_a_rule_prints_as_it_parses():
    for text in ("adv/gav>0.45 for 5", "policy/kl>=0.5", "eval/accuracy<0.125 for 2"):
        (rule,) = parse(text)
        assert str(rule) == text and parse(str(rule)) == [rule]


@pytest.mark.parametrize("text, words", [
    ("adv/gav 0.45", "METRIC OP NUMBER"),
    ("adv/gav=0.45", "METRIC OP NUMBER"),
    ("adv/gav>0.45 for", "METRIC OP NUMBER"),
    ("adv/gav>0.45 during 5", "METRIC OP NUMBER"),
    ("gav>0.45", "unknown metric 'gav'"),
    ("adv/gav>nan", "finite number"),
    ("adv/gav>inf", "finite number"),
    ("adv/gav>0.4 for 2.5", "COUNT >= 1"),
    ("eval/pass@0<0.1", "unknown metric"),
])
def test_bad_rules_name_the_field_and_the_rule(text, words):
    with pytest.raises(ValueError) as e:
        parse(text)
    assert str(e.value).startswith("stop_rules") and words in str(e.value), str(e.value)


# --- streaks ---------------------------------------------------------------------------------

def test_a_rule_fires_on_its_count_th_consecutive_record():
    tracker = StopRules(parse("adv/gav>0.4 for 3"))
    values = [0.5, 0.6, 0.3, 0.5, 0.5]  # the 0.3 breaks the first streak
    fired = [tracker.update({"step": i + 1, "adv/gav": v}) for i, v in enumerate(values)]
    assert fired == [None] * 5
    stop = tracker.update({"step": 6, "adv/gav": 0.41})
    assert stop is not None and (stop.step, stop.value) == (6, 0.41)
    assert "adv/gav>0.4 for 3" in stop.message() and "step 6" in stop.message()


def test_records_without_the_metric_neither_count_nor_break_a_streak():
    tracker = StopRules(parse("eval/accuracy<0.2 for 2"))
    assert tracker.update({"step": 0, "eval/accuracy": 0.1}) is None
    for step in range(1, 5):  # steps between evaluations
        assert tracker.update({"step": step, "adv/gav": 1.0}) is None
    assert tracker.update({"step": 5, "eval/accuracy": 0.15}).step == 5


def test_nan_breaks_a_streak_and_never_fires():
    tracker = StopRules(parse("loss/total<1 for 2; loss/total>1 for 2"))
    updates = [{"step": 1, "loss/total": 0.5}, {"step": 2, "loss/total": math.nan},
               {"step": 3, "loss/total": 0.5}]
    assert [tracker.update(r) for r in updates] == [None, None, None]
    assert tracker.update({"step": 4, "loss/total": 0.5}).rule == StopRule("loss/total", "<",
                                                                          1.0, 2)


# --- real runs -------------------------------------------------------------------------------

def test_a_rule_that_always_holds_stops_the_run_after_exactly_n_steps(tmp_path, capsys):
    """Through the command line: GAV is a std, never below 0, so `adv/gav>=0 for 2` holds on
    every step and must end a 6-step run at step 2; entropy is never negative, so the other
    rule never fires."""
    from labkit.__main__ import main

    run_dir = tmp_path / "run"
    args = ["train", "--run-dir", str(run_dir), "--steps", "6", "--checkpoint-every", "1",
            "--stop-rules", "policy/entropy<0; adv/gav>=0 for 2"]
    for key, value in FAST.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 2
    assert "adv/gav>=0 for 2" in summary["stopped"] and "step 2" in summary["stopped"]
    assert summary["stopped"] in err  # said where the user looks, not only in the summary
    records = read_log(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "eval/accuracy" in records[-1]  # a stopped run ends with an evaluation
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint.name == "step_000002.pt" and load_checkpoint(checkpoint)["step"] == 2
    stopped = json.loads((run_dir / STOPPED).read_text())
    assert stopped["step"] == 2 and stopped["rule"] == "adv/gav>=0 for 2"
    assert stopped["value"] == records[-1]["adv/gav"]
    assert (run_dir / "final" / "config.json").is_file()
    with pytest.raises(ValueError, match="stop rule.*finished"):
        train(resume=run_dir)  # refused before any model loads


def test_a_rule_that_never_holds_lets_the_run_finish(tmp_path):
    result = train(TrainConfig(run_dir=str(tmp_path / "run"), steps=3,
                               stop_rules="rollout/length_mean>1000; policy/entropy<0 for 1",
                               **FAST))
    assert result.stopped is None and result.summary()["stopped"] is None
    assert result.steps == 3 and [r["step"] for r in result.history] == [0, 1, 2, 3]
    assert not (tmp_path / "run" / STOPPED).exists()


class Crash(Exception):
    pass


def test_a_resumed_run_keeps_its_streaks(tmp_path):
    """Killed at step 2 of a 3-record streak (last checkpoint: step 1), the resumed run
    replays the records it keeps and stops at step 3, as an uninterrupted run would; starting
    the streak afresh would stop at step 4."""
    settings = dict(FAST, steps=6, checkpoint_every=1, stop_rules="adv/gav>=0 for 3")

    def crash_at_step_2(report):
        if report.step == 2:
            raise Crash

    with pytest.raises(Crash):
        train(TrainConfig(run_dir=str(tmp_path / "cut"), **settings), callbacks=[crash_at_step_2])
    assert latest_checkpoint(tmp_path / "cut").name == "step_000001.pt"
    resumed = train(resume=tmp_path / "cut")
    assert resumed.steps == 3 and "step 3" in resumed.stopped
    assert [r["step"] for r in read_log(tmp_path / "cut" / "metrics.jsonl")] == [0, 1, 2, 3]


# --- clip rules ------------------------------------------------------------------------------

def test_clip_rules_need_a_clipped_surrogate_and_reuse_rules_a_reused_batch():
    with pytest.raises(ValueError, match="num_iterations >= 2"):
        TrainConfig(stop_rules="reuse/clip_total>0.3")
    with pytest.raises(ValueError, match="reinforce=False"):
        TrainConfig(reinforce=True, stop_rules="clip/total>0.3")
    with pytest.raises(ValueError, match="beta > 0"):
        TrainConfig(stop_rules="policy/kl_k1>0.3")
    TrainConfig(num_iterations=2, beta=0.1, stop_rules="reuse/clip_total>0.3; policy/kl_k1>1")


def test_a_clip_total_rule_fires_when_batches_are_reused(tmp_path):
    """With two passes over each batch the second one clips; TLCR is logged, so a rule on it
    can end the run. The first pass is on-policy (ratio 1, nothing clips), so with one
    minibatch the mean over both passes is half the second pass's fraction."""
    result = train(TrainConfig(run_dir=str(tmp_path / "run"), steps=6, num_iterations=2,
                               stop_rules="clip/total>0.01", **{**FAST, **CLIPPING}))
    records = result.history[1:]
    assert result.steps < 6 and "clip/total>0.01" in result.stopped
    assert records[-1]["clip/total"] > 0.01 and all(r["clip/total"] <= 0.01 for r in records[:-1])
    for r in records:
        assert r["clip/total"] == pytest.approx(r["clip/low"] + r["clip/high"], abs=1e-12)
        assert r["clip/total"] == pytest.approx(r["reuse/clip_total"] / 2, abs=1e-9)
        assert r["reuse/clip_total"] == pytest.approx(r["reuse/clip_low"] + r["reuse/clip_high"])


def test_one_pass_logs_no_reuse_fractions_and_clips_nothing(tmp_path):
    result = train(TrainConfig(run_dir=str(tmp_path / "run"), steps=2, **{**FAST, **CLIPPING}))
    for r in result.history[1:]:
        assert r["clip/total"] == 0.0 and not any(k.startswith("reuse/") for k in r)


# --- dead runs -------------------------------------------------------------------------------

def _rollout(step, zero_std=1.0, truncated=0.0, reward=0.0, reward_std=0.0):
    return {"step": step, "rollout/reward_mean": reward, "rollout/frac_zero_std": zero_std,
            "rollout/truncated_frac": truncated, "rollout/reward_std": reward_std}


def test_a_dead_run_is_found_on_the_kth_consecutive_dead_step_once():
    watch = DeadRunWatch(3, group_size=4)
    records = [_rollout(1), _rollout(2), _rollout(3, zero_std=0.75),  # a spell of 2, broken
               _rollout(4), {"step": 5, "eval/accuracy": 0.0}, _rollout(5)]
    assert [watch.update(r) for r in records] == [None] * 6
    dead = watch.update(_rollout(6))
    assert (dead.first, dead.step, dead.truncated, dead.reward_mean) == (4, 6, False, 0.0)
    assert [watch.update(_rollout(s)) for s in (7, 8, 9)] == [None] * 3  # said once per spell
    assert watch.update(_rollout(10, zero_std=0.5)) is None
    assert [watch.update(_rollout(s)) for s in (11, 12)] == [None] * 2
    assert watch.update(_rollout(13)).first == 11  # a new spell is said again


def test_truncation_alone_makes_a_step_dead():
    watch = DeadRunWatch(2, group_size=4)
    assert watch.update(_rollout(1, zero_std=0.5, truncated=1.0)) is None
    dead = watch.update(_rollout(2, zero_std=0.5, truncated=DEAD_TRUNCATED))
    assert dead.truncated and dead.step == 2
    below = DeadRunWatch(2, group_size=4)
    for step in (1, 2, 3):
        assert below.update(_rollout(step, zero_std=0.5, truncated=0.9)) is None


def test_groups_of_one_are_dead_only_when_the_whole_batch_scores_alike():
    """With G = 1 every group has zero spread: the batch's reward std decides."""
    watch = DeadRunWatch(2, group_size=1)
    assert [watch.update(_rollout(s, reward_std=0.4)) for s in (1, 2, 3)] == [None] * 3
    assert watch.update(_rollout(4)) is None and watch.update(_rollout(5)).first == 4


def test_zero_steps_turns_the_watch_off():
    watch = DeadRunWatch(0, group_size=4)
    assert all(watch.update(_rollout(s, truncated=1.0)) is None for s in range(1, 50))


@pytest.mark.parametrize("record, cause", [
    (dict(truncated=1.0), "lost its EOS"),
    (dict(truncated=0.0), "collapsed"),
    (dict(truncated=0.0, reward=1.0), "solved the task"),
])
def test_a_dead_run_is_one_sentence_with_its_cause_and_the_levers(record, cause):
    watch = DeadRunWatch(1, group_size=4)
    text = watch.update(_rollout(7, **record)).message()
    assert "\n" not in text and ". " not in text, text  # one sentence
    assert text.startswith("dead run") and "step" in text and cause in text
    for lever in ("lower lr", "beta > 0", "larger max_new_tokens"):
        assert lever in text, (lever, text)
