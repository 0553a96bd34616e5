"""labkit.lab.verdicts: the notebooks' questions asked of rows over paired seeds."""

import math

import pytest

from labkit import stats
from labkit.lab import verdicts


def _row(arm, seed, gain, step_s, mem_mb, before=0.3, **extra):
    return {"run": f"{arm}/seed={seed}", "arm": arm, "seed": seed, "accuracy_before": before,
            "accuracy_after": before + gain, "gain": gain, "step_s": step_s, "mem_mb": mem_mb,
            "eval_n": 1000, **extra}


ROWS = [_row("grpo", 0, 0.50, 0.20, 600.0), _row("ppo", 0, 0.45, 0.40, 600.0),
        _row("grpo", 1, 0.55, 0.21, 600.0), _row("ppo", 1, 0.49, 0.43, 600.0),
        _row("grpo", 2, 0.40, 0.19, 600.0), _row("ppo", 2, 0.36, 0.37, 600.0)]


def test_grpo_vs_ppo_pairs_by_seed():
    gain, step, memory = verdicts.grpo_vs_ppo(ROWS)
    # per-seed differences 5, 6, 4 points: a large spread of gains, a tight paired difference
    diffs = [5.0, 6.0, 4.0]
    low, high = stats.mean_interval(diffs).low, stats.mean_interval(diffs).high
    assert gain.interval.mean == pytest.approx(5.0)
    assert (gain.interval.low, gain.interval.high) == (pytest.approx(low), pytest.approx(high))
    assert gain.verdict == stats.SUPPORTED and "paired t over 3 seeds" in gain.interval.method
    assert "binomial s.e." in gain.note and "80% power" in gain.note
    ratios = [0.40 / 0.20, 0.43 / 0.21, 0.37 / 0.19]
    assert step.interval.mean == pytest.approx(math.exp(sum(map(math.log, ratios)) / 3))
    assert step.verdict == stats.SUPPORTED
    assert memory.interval.mean == pytest.approx(1.0) and memory.verdict == stats.REFUTED


def test_an_unpaired_or_missing_arm_is_an_error():
    with pytest.raises(ValueError, match="share no seed"):
        verdicts.grpo_vs_ppo([_row("grpo", 0, 0.5, 0.2, 1.0), _row("ppo", 1, 0.5, 0.2, 1.0)])
    with pytest.raises(ValueError, match="must both have runs"):
        verdicts.grpo_vs_ppo([_row("grpo", 0, 0.5, 0.2, 1.0)])


def test_one_seed_is_inconclusive_whatever_the_gap():
    rows = [_row("grpo", 0, 0.9, 0.1, 1.0), _row("ppo", 0, 0.0, 0.5, 2.0)]
    assert {f.verdict for f in verdicts.grpo_vs_ppo(rows)} == {stats.INCONCLUSIVE}
    assert "finding1/low" not in verdicts.findings_summary(verdicts.grpo_vs_ppo(rows))


def test_arm_rows_and_group_size_findings():
    rows = []
    for seed, (a2, a8) in enumerate([(0.40, 0.47), (0.42, 0.50), (0.41, 0.49)]):
        rows += [_row("samples/G=2", seed, a2 - 0.3, 0.10, 1.0, group_size=2),
                 _row("samples/G=8", seed, a8 - 0.3, 0.30, 1.0, group_size=8)]
    table = verdicts.arm_rows(rows)
    assert [r["arm"] for r in table] == ["samples/G=2", "samples/G=8"]
    assert table[0]["seeds"] == 3 and table[0]["accuracy_after"].startswith("0.410 [")
    accuracy, cost = verdicts.group_size_findings(rows)
    assert accuracy.interval.mean == pytest.approx(100 * (0.07 + 0.08 + 0.08) / 3)
    assert accuracy.verdict == stats.SUPPORTED and cost.verdict == stats.SUPPORTED
    text = verdicts.describe_findings([accuracy, cost])
    assert "G=8 ends higher than G=2': supported" in text and "needs it above 1" in text


def test_arm_findings_compare_each_arm_with_the_baseline():
    rows = []
    for seed in range(3):
        rows += [_row("grpo", seed, 0.40 + seed / 100, 0.2, 1.0),
                 _row("rloo", seed, 0.45 + seed / 100, 0.2, 1.0),   # +5 points every seed
                 _row("none", seed, 0.30 + seed / 50, 0.2, 1.0)]    # -10, -9, -8 points
    rloo, none = verdicts.arm_findings(rows)
    assert rloo.question == "rloo gains more held-out accuracy than grpo"
    assert rloo.interval.mean == pytest.approx(5.0) and rloo.verdict == stats.SUPPORTED
    assert none.interval.mean == pytest.approx(-9.0) and none.verdict == stats.REFUTED
    assert [f.question for f in verdicts.arm_findings(rows, "rloo")][0].endswith("than rloo")
    with pytest.raises(ValueError, match="baseline 'ppo' is not an arm"):
        verdicts.arm_findings(rows, "ppo")


def test_parse_arms_reads_fields_and_names_the_bad_part():
    from labkit.lab import parse_arms

    arms = parse_arms("a: estimator=none, dual_clip=none; b: reward=shaped(lam=0.3, x=1), lr=5e-4;"
                      " c: dynamic_sampling=true")
    assert arms == {"a": {"estimator": "none", "dual_clip": None},
                    "b": {"reward": "shaped(lam=0.3, x=1)", "lr": 5e-4},
                    "c": {"dynamic_sampling": True}}
    for text, words in [("a estimator=grpo", "NAME: FIELD=VALUE"), ("a: colour=red", "colour"),
                        ("a: lr=fast", "lr must be float"), ("a: lr=1; a: lr=2", "twice"),
                        (" ; ", "at least one arm")]:
        with pytest.raises(ValueError, match=words):
            parse_arms(text)
