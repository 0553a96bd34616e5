"""labkit.lab.verdicts: the notebooks' questions asked of rows over paired seeds."""

import math

import pytest

from labkit.formulas import stats
from labkit.lab import questions, verdicts


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


def test_memory_is_asked_of_the_tensors_peak_with_the_process_as_context():
    """Rows with `tensor_peak_mb` are decided by it (what the training holds); the process's
    peak, mostly the interpreter, is only the note. Rows without it keep the old question."""
    tensors = {("grpo", 0): 90.0, ("grpo", 1): 100.0, ("grpo", 2): 110.0,
               ("ppo", 0): 180.0, ("ppo", 1): 200.0, ("ppo", 2): 220.0}
    rows = [dict(r, tensor_peak_mb=tensors[r["arm"], r["seed"]],
                 mem_mb=r["mem_mb"] * (1.1 if r["arm"] == "ppo" else 1.0)) for r in ROWS]
    memory = verdicts.grpo_vs_ppo(rows)[2]
    assert memory.question == "ppo needs more memory than grpo"
    assert memory.measure == "peak tensor memory, ppo / grpo"
    assert memory.interval.mean == pytest.approx(2.0) and memory.verdict == stats.SUPPORTED
    assert "1.10x" in memory.note
    mixed = rows[:-1] + [ROWS[-1]]  # one ppo run without the tensors' peak
    assert verdicts.grpo_vs_ppo(mixed)[2].question == "ppo's process needs more memory than grpo's"


def test_algo_findings_ask_grpo_against_each_other_arm_in_order():
    dpo = [_row("dpo", 0, 0.30, 0.10, 500.0), _row("dpo", 1, 0.33, 0.11, 500.0),
           _row("dpo", 2, 0.25, 0.09, 500.0)]
    found = verdicts.algo_findings(ROWS + dpo)
    assert [f.question for f in found] == [
        "grpo gains more held-out accuracy than ppo", "a ppo step takes longer than a grpo step",
        "ppo's process needs more memory than grpo's",
        "grpo gains more held-out accuracy than dpo", "a dpo step takes longer than a grpo step",
        "dpo's process needs more memory than grpo's"]
    assert found[3].interval.mean == pytest.approx(100 * (0.50 - 0.30 + 0.55 - 0.33
                                                         + 0.40 - 0.25) / 3)
    assert found[3].verdict == stats.SUPPORTED  # grpo gained 20, 22, 15 points more
    assert found[4].verdict == stats.REFUTED  # a dpo step took half a grpo step's time
    assert found[5].interval.mean == pytest.approx(500 / 600)
    assert verdicts.algo_findings(dpo) == []  # no grpo arm: nothing to ask


def test_compare_leaves_grpos_fields_out_of_a_dpo_run(tmp_path):
    from labkit.lab import experiments

    results = experiments.compare(["dpo"], run_dir=tmp_path, steps=1, batch_prompts=2,
                                  group_size=2, eval_n=4, eval_every=1, beta=0.02,
                                  eps_high=0.28, lr=1e-3)
    config = results["dpo"].config
    assert config.algo == "dpo" and config.beta == 0 and config.eps_high == 0.2
    assert config.lr == 1e-3  # the shared settings stay


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


# --- collapse, factors, monitors, diagnostics ------------------------------------------------

def test_collapse_step_reads_truncation_accuracy_and_dead_spells():
    from labkit.lab.summaries import collapse_step

    calm = [{"step": 0, "eval/accuracy": 0.3}, {"step": 1, "rollout/truncated_frac": 0.2},
            {"step": 2, "eval/accuracy": 0.04}]  # 0.04 >= 0.1 * 0.3
    assert collapse_step(calm, 0.3) is None
    assert collapse_step(calm + [{"step": 3, "eval/accuracy": 0.02}], 0.3) == 3
    assert collapse_step(calm + [{"step": 3, "rollout/truncated_frac": 0.9}], 0.3) == 3
    dead = {"step": 30, "first": 11, "truncated": False, "reward_mean": 0.0}
    assert collapse_step(calm, 0.3, dead) == 11
    solved = dead | {"reward_mean": 1.0}  # every completion right: not a collapse
    assert collapse_step(calm, 0.3, solved) is None


FACTORIAL = {"base": {"beta": 0.0, "eps_low": 0.9, "eps_high": 9.0},
             "kl": {"beta": 0.1, "eps_low": 0.9, "eps_high": 9.0},
             "clip": {"beta": 0.0, "eps_low": 0.2, "eps_high": 0.2},
             "both": {"beta": 0.1, "eps_low": 0.2, "eps_high": 0.2}}


def _factorial_rows(collapsed, gains):
    return [_row(arm, seed, gains[arm][seed], 0.1, 1.0, collapsed=collapsed[arm][seed])
            for arm in FACTORIAL for seed in range(3)]


def test_factor_findings_count_collapses_per_level_and_pair_gains_by_seed():
    collapsed = {"base": [1, 1, 1], "kl": [0, 0, 1], "clip": [1, 1, 0], "both": [0, 0, 0]}
    gains = {"base": [0.0, 0.1, 0.2], "kl": [0.1, 0.2, 0.3], "clip": [0.0, 0.1, 0.2],
             "both": [0.1, 0.2, 0.3]}
    kl_rate, kl_gain, clip_rate, clip_gain = questions.factor_findings(
        _factorial_rows(collapsed, gains), FACTORIAL)
    # beta: 5 of 6 runs at beta=0 collapsed, 1 of 6 at beta=0.1
    assert kl_rate.question == "fewer runs collapse with beta=0.1 than with beta=0.0"
    ref = stats.proportion_difference(5, 6, 1, 6)
    assert (kl_rate.interval.mean, kl_rate.interval.low) == (pytest.approx(ref.mean),
                                                             pytest.approx(ref.low))
    # gains: beta=0.1 is 10 points above beta=0 on every one of the 6 pairs
    assert kl_gain.interval.mean == pytest.approx(10.0) and kl_gain.interval.n == 6
    # eps_low and eps_high always change together: one factor, named by both
    assert clip_rate.question == ("fewer runs collapse with eps_low=0.2, eps_high=0.2 than "
                                  "with eps_low=0.9, eps_high=9.0")
    assert clip_rate.interval.mean == pytest.approx(4 / 6 - 2 / 6)
    assert clip_gain.interval.mean == pytest.approx(0.0)


def test_monitor_findings_ask_whether_a_line_fires_before_the_collapse():
    def history(entropies, collapse=None):
        return [{"step": s, "policy/entropy": e} for s, e in enumerate(entropies, 1)]

    low_early = history([0.5] * 6 + [2.0] * 4)          # fires at step 5 (5 in a row)
    low_late = history([2.0] * 6 + [0.5] * 5)           # fires at step 11
    quiet = history([2.0] * 10)
    histories = {"a": low_early, "b": low_late, "c": quiet, "d": low_early}
    rows = [{"run": "a", "collapsed": 1, "collapse_step": 8},   # warned (5 < 8)
            {"run": "b", "collapsed": 1, "collapse_step": 8},   # fired after: no warning
            {"run": "c", "collapsed": 0}, {"run": "d", "collapsed": 0}]  # d: a false alarm
    joint, warned, false = questions.monitor_findings(rows, histories,
                                                      ["policy/entropy<1 for 5"])
    # one question, sensitivity and specificity together: 1/2 fired first, 1/2 false alarms
    assert joint.question.startswith("policy/entropy<1 for 5 warns of a collapse")
    assert joint.interval.mean == 0.0 and joint.direction == "above"
    assert joint.verdict == stats.INCONCLUSIVE and "Newcombe" in joint.interval.method
    assert "fired/not: 1/1 of collapsing runs, 1/1 of the others" in joint.note
    assert "Fisher's exact one-sided p = 0.833" in joint.note
    assert warned.question == "policy/entropy<1 for 5 fires before a collapse"
    assert warned.interval.mean == 0.5 and warned.interval.n == 2
    assert false.interval.mean == 0.5 and false.direction == "below"
    assert "Clopper-Pearson" in warned.interval.method


def test_a_scoped_monitor_line_reads_only_its_algorithms_runs():
    """'grpo: rule' judges the rule on GRPO's runs alone: PPO's runs, here a warned collapse
    and a false alarm, change nothing; a line that is not one stop rule is refused."""
    def history(entropies):
        return [{"step": s, "policy/entropy": e} for s, e in enumerate(entropies, 1)]

    low, quiet = history([0.5] * 6 + [2.0] * 4), history([2.0] * 10)
    histories = {"g1": low, "g2": quiet, "p1": low, "p2": low}
    rows = [{"run": "g1", "algo": "grpo", "collapsed": 1, "collapse_step": 8},
            {"run": "g2", "algo": "grpo", "collapsed": 0},
            {"run": "p1", "algo": "ppo", "collapsed": 1, "collapse_step": 8},
            {"run": "p2", "algo": "ppo", "collapsed": 0}]
    lines = questions.parse_monitors("grpo: policy/entropy<1 for 5; policy/entropy<1 for 5")
    grpo_joint, _, _, every_joint, _, _ = questions.monitor_findings(rows, histories, lines)
    assert grpo_joint.question.startswith("policy/entropy<1 for 5 on grpo runs warns")
    assert grpo_joint.interval.mean == 1.0  # GRPO: warned 1 of 1, false alarms 0 of 1
    assert every_joint.interval.mean == 0.5  # all four runs: 2 of 2 warned, 1 of 2 false
    assert questions.parse_monitors("") == questions.MONITORS
    with pytest.raises(ValueError, match="monitors: 'grpo: entropy<<1' is not one stop rule"):
        questions.parse_monitors("grpo: entropy<<1")


def test_diagnostic_findings_take_the_critic_over_the_group_per_run():
    keys = ("diag/grad_rel_var_raw/ppo_critic", "diag/grad_rel_var_raw/grpo",
            "diag/grad_rel_var/ppo_gae", "diag/grad_rel_var/grpo",
            "diag/baseline_mse/ppo_critic", "diag/baseline_mse/grpo",
            "diag/grad_rel_var_raw/rloo", "diag/grad_cos_raw/ppo_critic",
            "diag/grad_cos_raw/rloo")
    histories, rows = {}, []
    for seed, scale in enumerate((2.0, 3.0, 4.0)):
        first = {"step": 0, **dict(zip(keys, (8.0, 1.0, 8.0, 1.0, 0.5, 0.1, 1.0, 0.5, 0.5)))}
        last = {"step": 50, **dict(zip(keys, (scale, 1.0, scale, 1.0, 0.05, 0.1, 0.5, 0.6,
                                              0.8)))}
        histories[f"ppo/seed={seed}"] = [first, {"step": 1}, last]
        rows.append({"run": f"ppo/seed={seed}", "arm": "ppo", "seed": seed, "algo": "ppo"})
    start, end, trained, mse, rloo, cos = questions.diagnostic_findings(rows, histories)
    # the article's comparison: leave-one-out against the trained critic, 2-4x / 0.5
    assert rloo.interval.mean == pytest.approx(2 * 24 ** (1 / 3))
    assert rloo.threshold == pytest.approx(1 / 0.37) and "rloo" in rloo.question
    # best-scaled error 1 - cos^2: critic 1 - 0.36, rloo 1 - 0.64, the same on every run
    assert cos.interval.mean == pytest.approx(0.64 / 0.36)
    assert start.question.startswith("at step 0") and start.interval.mean == pytest.approx(8.0)
    assert end.question.startswith("at step 50")
    assert end.interval.mean == pytest.approx(24 ** (1 / 3))  # geometric mean of 2, 3, 4
    assert trained.threshold == pytest.approx(1 / 0.37)
    assert mse.interval.mean == pytest.approx(0.5) and mse.verdict == stats.REFUTED
    assert questions.diagnostic_findings(rows[:1], histories) == []  # one run: no interval
    # the same baseline by both measures, and the mechanism, once the runs measured them
    more = {"diag/grad_rel_var_raw/ppo_critic_v0": (1.0, 2.0, 4.0),
            "diag/baseline_mse/rloo": (0.1, 0.1, 0.1),
            "diag/scale/error/0": (0.4, 0.5, 0.6), "diag/scale/error/0.25": (0.2, 0.25, 0.3),
            "diag/scale/error/0.5": (0.4, 0.5, 0.6), "diag/scale/error/1": (0.8, 1.0, 1.2),
            "diag/optimal/error": (0.1, 0.125, 0.15), "diag/optimal/slope": (0.1, 0.2, 0.3)}
    for k, run in enumerate(rows):
        histories[run["run"]][-1].update({key: v[k] for key, v in more.items()})
    found = questions.diagnostic_findings(rows, histories)
    assert len(found) == 6 + 2 + 5
    v0, v0_mse, quarter, half, whole, best, slope = found[6:]
    assert "63%" in v0.question and v0.interval.mean == pytest.approx(4.0)  # 2 / rloo 0.5
    assert v0_mse.interval.mean == pytest.approx(0.5) and v0_mse.verdict == stats.REFUTED
    assert quarter.interval.mean == pytest.approx(0.5) and quarter.verdict == stats.SUPPORTED
    assert half.interval.mean == pytest.approx(1.0) and half.direction == "below"
    assert whole.interval.mean == pytest.approx(2.0) and whole.verdict == stats.REFUTED
    assert best.interval.mean == pytest.approx(0.25)
    assert slope.interval.mean == pytest.approx(0.2) and slope.verdict == stats.REFUTED


def test_answer_asks_the_chosen_questions_and_refuses_others():
    rows = [_row(arm, s, 0.1 * s, 0.1, 1.0, length_final=10.0 + s + (arm == "b"), collapsed=0)
            for arm in ("a", "b") for s in range(3)]
    found = questions.answer(["gain", "length"], rows, {}, {"a": {}, "b": {}})
    assert [f.question for f in found] == ["b gains more held-out accuracy than a",
                                           "b ends with longer completions than a"]
    assert found[1].interval.mean == pytest.approx(1.0)
    with pytest.raises(ValueError, match="questions"):
        questions.answer(["speed"], rows, {}, {})


def test_informative_findings_compare_the_first_steps_with_each_prediction():
    histories, rows = {}, []
    for g, seen in ((2, (0.20, 0.25, 0.30)), (8, (0.60, 0.55, 0.65))):
        for seed, share in enumerate(seen):
            name = f"samples/G={g}/seed={seed}"
            histories[name] = [{"step": 0}] + [{"step": s, "rollout/frac_zero_std": 1 - share}
                                               for s in (1, 2, 3)] + \
                [{"step": 4, "rollout/frac_zero_std": 0.0}]  # after the first steps: ignored
            rows.append({"run": name, "group_size": g, "seed": seed})
    prediction = {2: {"per_prompt": 0.25, "at_mean": 0.40}, 8: {"per_prompt": 0.6,
                                                                "at_mean": 0.9}}
    mean2, own2, mean8, own8 = questions.informative_findings(rows, histories, prediction)
    assert mean2.question == "at G=2, the formula at the mean p overstates the share of " \
                             "informative groups"
    assert mean2.interval.mean == pytest.approx(15.0) and mean2.verdict == stats.SUPPORTED
    assert own2.interval.mean == pytest.approx(0.0) and own2.verdict == stats.INCONCLUSIVE
    assert mean8.interval.mean == pytest.approx(30.0) and own8.interval.n == 3


def test_arm_rows_report_collapse_apart_from_learning_and_the_area_under_the_curve():
    from labkit.lab.summaries import accuracy_auc

    rows = [_row("kl0", s, g, 0.2, 1.0, collapsed=c, accuracy_auc=0.3 + g / 2)
            for s, (g, c) in enumerate([(0.2, 0), (-0.3, 1), (0.3, 0), (-0.25, 1)])]
    (row,) = verdicts.arm_rows(rows)
    assert row["collapsed"].startswith("2/4 [0.07, 0.93]")  # Clopper-Pearson of 2 of 4
    assert row["gain_kept"].startswith("0.250 [")  # the mean gain of the runs that held
    assert row["gain"].startswith("-0.012 [")  # all runs: the collapses pull it down
    assert row["accuracy_auc"].startswith("0.294 [")
    # trapezoids over the evaluations' steps, as a mean accuracy
    history = [{"step": 0, "eval/accuracy": 0.2}, {"step": 5}, {"step": 10,
               "eval/accuracy": 0.4}, {"step": 30, "eval/accuracy": 0.4}]
    assert accuracy_auc(history) == pytest.approx((10 * 0.3 + 20 * 0.4) / 30)
    assert accuracy_auc(history[:2]) is None


def test_the_monitor_threshold_sweep_reads_first_fires_from_the_per_seed_record():
    history = [{"step": s, "adv/gav": g} for s, g in enumerate(
        [0.1, 0.35, 0.35, 0.35, 0.35, 0.35, 0.45, 0.45, 0.45, 0.45, 0.45, 0.1])]
    fires = questions.first_fires(history, ["adv/gav>0.3 for 5", "adv/gav>0.4 for 5",
                                            "adv/gav>0.5 for 5"])
    assert fires == {"adv/gav>0.3 for 5": 5, "adv/gav>0.4 for 5": 10, "adv/gav>0.5 for 5": -1}
    rule = "adv/gav>0.3 for 5"
    # collapsing runs: fired at 5 before a collapse at 20 (warned), at 30 after it (not)
    records = [{"collapsed": 1, "collapse_step": 20, f"fires.{rule}": 5},
               {"collapsed": 1, "collapse_step": 20, f"fires.{rule}": 30},
               {"collapsed": 1, "collapse_step": 20, f"fires.{rule}": 19},
               {"collapsed": 0, f"fires.{rule}": -1}, {"collapsed": 0, f"fires.{rule}": 7},
               {"collapsed": 0, f"fires.{rule}": -1}, {"collapsed": 0, f"fires.{rule}": -1}]
    (found,) = questions.swept_monitor_findings(records)  # rules the record lacks: left out
    assert found.question.startswith(rule) and "warns of a collapse" not in found.question
    assert found.interval.mean == pytest.approx(2 / 3 - 1 / 4)
    assert "2/1 of collapsing runs, 1/3 of the others" in found.note
    assert set(questions.monitor_rules()) >= set(questions.MONITORS)  # the articles' lines
