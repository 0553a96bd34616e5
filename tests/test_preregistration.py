"""Every claim is preregistered (labkit.lab.preregistration): its file names the article's
statement, the primary measure, the direction, the threshold and the seeds planned, checked
before any run starts; the page decides each claim by that measure alone."""

import re
from pathlib import Path

import pytest
import yaml
from cli import in_process

from labkit.formulas import stats
from labkit.lab import claims, findings, preregistration
from labkit.lab.sweeps import load_sweep

REPO = Path(__file__).resolve().parents[1]
CLAIMS = sorted((REPO / "experiments" / "claims").glob("*.yaml"))


@pytest.mark.parametrize("path", CLAIMS, ids=lambda p: p.name)
def test_every_claim_is_preregistered(path):
    sweep = load_sweep(path)
    assert sweep.claims
    for claim in sweep.claims:
        found = preregistration.check(claim, path.name,
                                      preregistration.sweep_arms(sweep.parameters))
        assert found.seeds >= preregistration.MIN_SEEDS
        if claim["id"] in (1, 2, 3, 4):
            assert found.seeds >= 10
        # its numbers, where it gives any (5, 9, 10, 19, 20: a direction only)
        assert re.search(r"\d", found.article) or claim["id"] in (5, 9, 10, 19, 20)


def _claim_file(tmp_path, change) -> Path:
    """experiments/claims/06_reward_accuracy.yaml with its preregistration changed."""
    spec = yaml.safe_load((REPO / "experiments" / "claims" / "06_reward_accuracy.yaml")
                          .read_text())
    spec["notebook"] = str(REPO / "notebooks" / "05_arms.ipynb")
    change(spec["claim"]["preregistered"])
    path = tmp_path / "06_changed.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    return path


@pytest.mark.parametrize("change, words", [
    (lambda p: p.pop("article"), "preregistered.article is missing"),
    (lambda p: p.pop("direction"), "preregistered.direction is missing"),
    (lambda p: p.update(measure="accuracy"), "preregistered.measure: unknown measure "
                                             "'accuracy'"),
    (lambda p: p.update(compare=["acc70", "verifier"]), "preregistered.compare: unknown arm "
                                                        "'acc70'"),
    (lambda p: p.update(direction="more"), "preregistered.direction must be one of"),
    (lambda p: p.update(seeds=3), "preregistered.seeds must be an integer >= 5"),
    (lambda p: p.update(threshold="high"), "preregistered.threshold must be a finite number"),
    (lambda p: p.update(direction="equivalent"), "preregistered.margin is missing"),
    (lambda p: p.update(colour="red"), "unknown field(s) ['colour']"),
])
def test_a_bad_preregistration_is_one_line_naming_the_file_and_field(tmp_path, change, words):
    path = _claim_file(tmp_path, change)
    done = in_process("sweep", path, "--dry-run")  # refused before any run is planned
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: 06_changed.yaml: claim 6: preregistered")
    assert words in lines[0], lines[0]
    assert "to run" not in done.stdout


def test_a_claim_without_a_preregistration_is_refused(tmp_path):
    spec = yaml.safe_load((REPO / "experiments" / "claims" / "06_reward_accuracy.yaml")
                          .read_text())
    spec["notebook"] = str(REPO / "notebooks" / "05_arms.ipynb")
    del spec["claim"]["preregistered"]
    path = tmp_path / "06.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    with pytest.raises(ValueError, match="06.yaml: claim 6: preregistered is missing"):
        load_sweep(path)


def _result(prereg: dict, rows: list[dict]) -> claims.ClaimResult:
    claim = {"id": 6, "statement": "s", "preregistered": {"article": "a", "seeds": 5, **prereg}}
    return claims.ClaimResult(Path("06.yaml"), claim, rows=rows)


def _row(question: str, low: float, high: float, n: int = 5) -> dict:
    return {"question": question, "mean": (low + high) / 2, "low": low, "high": high,
            "seeds": n, "method": f"paired t over {n} seeds", "effect": f"[{low}, {high}]"}


def test_the_claim_is_decided_by_its_primary_measure_alone():
    prereg = {"measure": "gain", "compare": ["acc75", "verifier"], "finding": "gains more",
              "direction": "above", "threshold": 0}
    rows = [_row("acc90 gains more held-out accuracy than verifier", 1.0, 3.0),
            _row("acc75 gains more held-out accuracy than verifier", -2.0, -0.5)]
    decided = claims.claim_verdict(_result(prereg, rows))
    assert decided.verdict == stats.REFUTED  # acc90's support is context, not the claim
    assert decided.figure.startswith("acc75 gains more") and "acc90" not in decided.figure
    assert decided.test == "gain (acc75 vs verifier) above 0"
    sd = 1.5 / 2 * 5 ** 0.5 / 2.776445  # the spread the interval implies
    assert float(decided.mde) == pytest.approx(stats.min_detectable(sd, 5), abs=0.01)


def test_several_primary_rows_must_each_hold_and_all_arms_need_the_per_seed_record():
    prereg = {"measure": "informative_share_error", "finding": "overstates",
              "direction": "equivalent", "threshold": 0, "margin": 5.0}
    inside = [_row(f"at G={g}, the formula overstates", -2.0, 2.0) for g in (2, 4)]
    assert claims.claim_verdict(_result(prereg, inside)).verdict == stats.SUPPORTED
    wide = inside + [_row("at G=8, the formula overstates", -1.0, 7.0)]
    assert claims.claim_verdict(_result(prereg, wide)).verdict == stats.INCONCLUSIVE
    out = wide + [_row("at G=16, the formula overstates", 6.0, 9.0)]
    assert claims.claim_verdict(_result(prereg, out)).verdict == stats.REFUTED
    assert claims.claim_verdict(_result(prereg, [])).figure == claims.NOT_MEASURED
    every = {"measure": "gain", "compare": ["all", "grpo"], "direction": "above", "threshold": 0}
    decided = claims.claim_verdict(_result(every, inside))
    assert claims.PER_SEED in decided.figure and decided.verdict == stats.INCONCLUSIVE


# --- the per-seed record: the durable data a claim is decided from -----------------------------

def _records(arms: dict[str, list[float]], key: str = "gain") -> list[dict]:
    return [{"sweep_run": "seed=0", "arm": arm, "seed": s, key: v, "accuracy_after": 0.5,
             "eval_n": 1000} for arm, values in arms.items() for s, v in enumerate(values)]


def test_records_of_a_summary_and_their_csv_round_trip(tmp_path):
    summary = {"description": "x", "finding1/mean": 1.0, "grpo/seed=0/seed": 0,
               "grpo/seed=0/gain": 0.1, "grpo/seed=1/seed": 1, "grpo/seed=1/gain": 0.2,
               "samples/G=4/seed=1/seed": 1, "samples/G=4/seed=1/collapsed": 1}
    records = findings.records_of(summary, "seed=0")
    assert records == [{"sweep_run": "seed=0", "arm": "grpo", "seed": 0, "gain": 0.1},
                       {"sweep_run": "seed=0", "arm": "grpo", "seed": 1, "gain": 0.2},
                       {"sweep_run": "seed=0", "arm": "samples/G=4", "seed": 1,
                        "collapsed": 1}]
    path = findings.write_records(records, tmp_path / "claim.csv")
    assert path.read_text().splitlines()[0] == \
        "sweep_run,arm,seed,commit,cpu,torch,sweep_s,collapsed,gain"
    assert findings.read_records(path) == records


def test_a_pair_is_decided_from_the_per_seed_record_with_the_evaluation_floor():
    prereg = {"measure": "gain", "compare": ["acc75", "verifier"], "direction": "above",
              "threshold": 0}
    same = _records({"acc75": [0.30] * 5, "verifier": [0.30] * 5})
    decided = claims.claim_verdict(claims.ClaimResult(
        Path("06.yaml"), _result(prereg, []).claim, records=same))
    # seeds that agree exactly: the floor of the evaluation's noise keeps an interval
    assert decided.verdict == stats.INCONCLUSIVE and "floored" in decided.figure
    better = _records({"acc75": [0.36, 0.35, 0.37, 0.36, 0.38], "verifier": [0.30] * 5})
    result = claims.ClaimResult(Path("06.yaml"), _result(prereg, []).claim, records=better)
    assert claims.claim_verdict(result).verdict == stats.SUPPORTED


def test_every_arm_against_one_is_decided_arm_by_arm_with_bonferroni():
    rng = __import__("numpy").random.default_rng(0)
    arms = {name: list(0.3 + 0.002 * rng.standard_normal(6)) for name in
            ("grpo", "rloo", "dr_grpo", "none")}
    two_sided = {"measure": "gain", "compare": ["all", "grpo"], "direction": "two-sided",
                 "threshold": 0, "margin": 2.0}
    claim = _result(two_sided, []).claim
    same = claims.claim_verdict(claims.ClaimResult(Path("09.yaml"), claim,
                                                       records=_records(arms)))
    assert same.verdict == stats.REFUTED and "3 arms vs grpo, Bonferroni" in same.figure
    assert "5 seeds, look 1 of 1" in same.figure  # the plan's 5 seeds, not the 6 run
    arms["rloo"] = [v + 0.05 for v in arms["rloo"]]
    moved = claims.claim_verdict(claims.ClaimResult(Path("09.yaml"), claim,
                                                        records=_records(arms)))
    assert moved.verdict == stats.SUPPORTED and "rloo" in moved.figure
    # one-sided, none supporting: the arm shown is the one nearest to supporting (highest
    # low end), not the largest effect of the wrong sign
    above = {"measure": "gain", "compare": ["all", "grpo"], "direction": "above",
             "threshold": 0}
    arms = {"grpo": [0.30, 0.31, 0.29, 0.30, 0.30],
            "rloo": [0.305, 0.30, 0.30, 0.31, 0.30],  # a little above, its interval across 0
            "dr_grpo": [0.10, 0.05, 0.12, 0.08, 0.11],  # far below
            "none": [0.29, 0.30, 0.28, 0.30, 0.29]}  # a little below
    near = claims.claim_verdict(claims.ClaimResult(
        Path("10.yaml"), _result(above, []).claim, records=_records(arms)))
    assert near.verdict == stats.INCONCLUSIVE and "; rloo: " in near.figure


def test_a_paired_collapse_is_decided_by_its_exact_test():
    """5 of 5 seeds discordant at look 1 of 2: McNemar's exact one-sided p is 1/32 = 0.031,
    above the 0.0155 the look spends a side, so not supported whatever the interval says;
    10 of 10 at look 2 (p = 1/1024) is."""
    prereg = {"measure": "collapse_difference", "compare": ["kl0", "kl01"],
              "direction": "above", "threshold": 0, "seeds": 10}
    claim = _result(prereg, []).claim
    claim["preregistered"]["seeds"] = 10
    five = _records({"kl0": [1] * 5, "kl01": [0] * 5}, key="collapsed")
    decided = claims.claim_verdict(claims.ClaimResult(Path("04.yaml"), claim, records=five))
    assert decided.verdict == stats.INCONCLUSIVE, decided
    assert "exact one-sided p 0.0312 (a side may spend 0.0155)" in decided.figure
    ten = _records({"kl0": [1] * 10, "kl01": [0] * 10}, key="collapsed")
    decided = claims.claim_verdict(claims.ClaimResult(Path("04.yaml"), claim, records=ten))
    assert decided.verdict == stats.SUPPORTED and "McNemar" in decided.figure
    assert "look 2 of 2" in decided.figure and "exact one-sided p 0.000977" in decided.figure


def test_findings_all_runs_each_claims_batches_until_it_is_decided(tmp_path, monkeypatch):
    import labkit.lab.commands
    import labkit.lab.findings

    ran = []
    monkeypatch.setattr(labkit.lab.findings, "run_sweep", lambda sweep, root, workers=1, **kw:
                        ran.append((sweep.name, tuple(sweep.seeds))) or [])
    monkeypatch.setattr(labkit.lab.commands, "write_findings", lambda out, *a, **k: Path(out))
    argv = ("findings", "--all", "--root", tmp_path / "runs", "--out", tmp_path / "f.md")
    done = in_process(*argv)  # nothing is decided without runs: every batch runs
    assert done.returncode == 0, done.stderr
    batches = [(load_sweep(p).name, tuple(load_sweep(p).seeds[:k]))
               for p in CLAIMS for k in range(1, len(load_sweep(p).seeds) + 1)]
    again = {load_sweep(p).name: (load_sweep(p).name, tuple(load_sweep(p).replication))
             for p in CLAIMS if load_sweep(p).replication}
    assert set(again) == {"claim02_baselines", "variants"}
    # each file's batches, then its replication right after its last batch
    order = [b for i, b in enumerate(batches)
             for b in [b] + ([again[b[0]]] if b[0] in again and (
                 i + 1 == len(batches) or batches[i + 1][0] != b[0]) else [])]
    assert ran == order and ("claim02_baselines", (0, 5)) in ran
    ran.clear()
    decided = claims.ClaimVerdict("t", "f", stats.SUPPORTED)
    monkeypatch.setattr(labkit.lab.findings, "claim_verdict", lambda result: decided)
    assert in_process(*argv).returncode == 0
    assert ran == [b for p in CLAIMS for b in [(load_sweep(p).name, (0,))] + (
        [again[load_sweep(p).name]] if load_sweep(p).name in again else [])]  # decided at once
    ran.clear()
    assert in_process(*argv, "--only", "03_group_size,01_cost").returncode == 0
    assert ran == [("claim01_cost", (0,)), ("claim03_group_size", (0,))]
    refused = in_process(*argv, "--only", "01_cost,3_group_size")
    assert refused.returncode == 2 and "--only: no claim file 3_group_size" in refused.stderr
    assert len(ran) == 2  # nothing ran


def test_a_claim_is_read_at_each_look_of_its_plan_and_says_what_more_seeds_would_need():
    claim = _result({"measure": "gain", "compare": ["a", "b"], "direction": "above",
                     "threshold": 0}, []).claim
    claim["preregistered"]["seeds"] = 10
    assert claims.plan_of(preregistration.check(claim, "x", ["a", "b"])).looks == (5, 10)
    clear = _records({"a": [0.40, 0.41, 0.42, 0.40, 0.43, 0.2, 0.2, 0.2, 0.2, 0.2],
                      "b": [0.30] * 10})
    decided = claims.claim_verdict(claims.ClaimResult(Path("x.yaml"), claim,
                                                          records=clear))
    assert decided.verdict == stats.SUPPORTED and "5 seeds, look 1 of 2" in decided.figure
    noisy = _records({"a": [0.36, 0.28, 0.35, 0.30, 0.33, 0.29, 0.34, 0.31, 0.36, 0.29],
                      "b": [0.30] * 10})
    undecided = claims.claim_verdict(claims.ClaimResult(Path("x.yaml"), claim,
                                                            records=noisy))
    assert undecided.verdict == stats.INCONCLUSIVE and "10 seeds, look 2 of 2" in \
        undecided.figure
    assert re.fullmatch(r"about \d+ seeds", undecided.mde) and int(undecided.mde.split()[1]) > 10


def test_batches_of_paired_seeds_may_not_overlap(tmp_path):
    spec = yaml.safe_load((REPO / "experiments" / "claims" / "06_reward_accuracy.yaml")
                          .read_text())
    spec["notebook"] = str(REPO / "notebooks" / "05_arms.ipynb")
    path = tmp_path / "06.yaml"
    for seeds, ok in (([0, 5, 10], True), ([0, 4], False)):
        path.write_text(yaml.safe_dump({**spec, "seeds": seeds}, allow_unicode=True))
        if ok:
            assert load_sweep(path).seeds == seeds
        else:
            with pytest.raises(ValueError, match="must lie at least 5 apart"):
                load_sweep(path)


def test_a_ratio_within_each_run_is_decided_from_the_per_seed_record():
    """Claim 2: the critic's gradient relative variance over rloo's, both measured in the
    same PPO run, one ratio per seed; log-ratio t over seeds at the plan's looks."""
    critic = [0.50, 0.55, 0.45, 0.52, 0.48, 0.51, 0.47, 0.53, 0.49, 0.50]
    rloo = [0.60, 0.62, 0.58, 0.61, 0.57, 0.59, 0.60, 0.63, 0.58, 0.61]
    records = [{"sweep_run": "seed=0", "arm": "ppo", "seed": s,
                "diag.grad_rel_var_raw.ppo_critic": c, "diag.grad_rel_var_raw.rloo": r}
               for s, (c, r) in enumerate(zip(critic, rloo))]
    result = _result({"measure": "grad_rel_var_ratio", "direction": "above",
                      "threshold": 2.7, "seeds": 10}, [])
    result.records = records
    decided = claims.claim_verdict(result)
    plan = claims.plan_of(preregistration.check(result.claim, "x"))
    want = stats.ratio_interval(critic[:5], rloo[:5], plan.confidence(0, "above"))
    assert decided.verdict == stats.REFUTED and "look 1 of 2" in decided.figure
    assert f"ppo: ppo_critic / rloo {want.format(2)}" in decided.figure
    result.records = records[:3]  # short of the first look
    assert claims.claim_verdict(result).verdict == stats.INCONCLUSIVE
    result.records = [{k: v for k, v in r.items() if "rloo" not in k} for r in records]
    assert claims.claim_verdict(result).figure == claims.NOT_MEASURED  # no such figure


def test_a_change_within_each_run_of_one_arm_is_decided_from_the_per_seed_record():
    """Claims 11 and 12: the last fifth's mean length minus the first step's, within each run
    of the named arm (the other arm's runs ignored), paired t over seeds."""
    start = [24.0, 23.5, 24.4, 23.9, 24.1]
    final = [30.5, 29.0, 31.2, 28.4, 30.0]
    records = [{"sweep_run": "seed=0", "arm": arm, "seed": s, "length_start": a,
                "length_final": b if arm == "grpo" else a - 1.0}
               for arm in ("grpo", "ppo") for s, (a, b) in enumerate(zip(start, final))]
    result = _result({"measure": "length_change", "compare": ["grpo"], "direction": "above",
                      "threshold": 0}, [])
    result.records = records
    decided = claims.claim_verdict(result)
    want = stats.paired_interval(final, start, 0.95)
    assert decided.verdict == stats.SUPPORTED
    assert f"grpo: length_final - length_start {want.format(2)}" in decided.figure
    result.claim["preregistered"]["compare"] = ["ppo"]  # every ppo run shrank by 1 token
    # a length can stay put whatever the claim: with no positive control its null says
    # nothing; a control arm that moved the length lets the refutation stand
    decided = claims.claim_verdict(result)
    assert decided.verdict == claims.NOT_TESTABLE and "no positive control" in decided.figure
    result.claim["preregistered"]["control"] = {
        "measure": "final_length", "compare": ["short", "grpo"], "direction": "below",
        "margin": 2.0, "why": "a length penalty shortens"}
    result.records = records + [{"sweep_run": "seed=0", "arm": "short", "seed": s,
                                 "length_final": b - 3.0 - 0.1 * s}
                                for s, b in enumerate(final)]
    decided = claims.claim_verdict(result)
    assert decided.verdict == stats.REFUTED and "control short vs grpo" in decided.figure
    with pytest.raises(ValueError, match=r"\[ARM\], for a measure within one arm"):
        preregistration.check({**result.claim, "preregistered": {
            **result.claim["preregistered"], "compare": ["a", "b", "c"]}}, "x")
    with pytest.raises(ValueError, match=r"must be \[ARM, BASELINE\]"):
        preregistration.check({**result.claim, "preregistered": {
            **result.claim["preregistered"], "measure": "gain", "compare": ["grpo"]}}, "x")


def test_a_level_of_one_arm_is_decided_from_its_mean_over_seeds():
    """Claim 21: the cosine between DPO's and GRPO's gradients, each run's mean over its
    steps, against the preregistered threshold: the t interval of the mean over seeds."""
    cosines = [0.97, 0.95, 0.96, 0.98, 0.94]
    records = [{"sweep_run": "seed=0", "arm": "dpo_g2", "seed": s, "grpo_cosine": c}
               for s, c in enumerate(cosines)]
    records.append({"sweep_run": "seed=0", "arm": "grpo_g2", "seed": 0})  # no such figure
    result = _result({"measure": "update_cosine", "compare": ["dpo_g2"], "direction": "above",
                      "threshold": 0.9}, [])
    result.records = records
    decided = claims.claim_verdict(result)
    want = stats.mean_interval(cosines, 0.95)
    assert decided.verdict == stats.SUPPORTED
    assert f"dpo_g2: grpo_cosine {want.format(2)}" in decided.figure
    result.claim["preregistered"]["threshold"] = 0.99  # the whole interval lies below
    assert claims.claim_verdict(result).verdict == stats.REFUTED


def test_the_tensors_peak_decides_a_memory_claim_from_the_per_seed_record():
    """tensor_memory_ratio: PPO's tensors' peak over GRPO's, paired by seed (log-ratio t),
    from the runs' `tensor_peak_mb`; runs that did not measure it leave it unmeasured."""
    grpo = [88.3, 98.6, 115.8, 92.0, 104.0]
    ppo = [170.5, 189.5, 222.3, 176.0, 201.0]
    records = [{"sweep_run": "seed=0", "arm": arm, "seed": s, "tensor_peak_mb": v,
                "mem_mb": 600.0}
               for arm, values in (("grpo", grpo), ("ppo", ppo)) for s, v in enumerate(values)]
    result = _result({"measure": "tensor_memory_ratio", "compare": ["ppo", "grpo"],
                      "direction": "above", "threshold": 1.25}, [])
    result.records = records
    decided = claims.claim_verdict(result)
    plan = claims.plan_of(preregistration.check(result.claim, "x", ["grpo", "ppo"]))
    want = stats.ratio_interval(ppo, grpo, plan.confidence(0, "above"))
    assert decided.verdict == stats.SUPPORTED and want.low > 1.25
    assert want.format(2) in decided.figure
    result.claim["preregistered"]["measure"] = "memory_ratio"  # the processes': 1.0
    assert claims.claim_verdict(result).verdict == stats.REFUTED
    result.claim["preregistered"]["measure"] = "tensor_memory_ratio"
    result.records = [{k: v for k, v in r.items() if k != "tensor_peak_mb"} for r in records]
    assert claims.claim_verdict(result).figure == claims.NOT_MEASURED


def _length_records(base: list[float], arm: list[float], control: list[float]) -> list[dict]:
    return [{"sweep_run": "seed=0", "arm": name, "seed": s, "length_rate_early": v}
            for name, values in (("mean", base), ("sum", arm), ("short", control))
            for s, v in enumerate(values)]


def test_a_length_claim_reads_not_testable_here_when_its_control_did_not_move():
    """Claims 5 and 14: the early length rate, sum vs mean, below 0, beside a control arm that
    must lower the rate by more than 0.05 tokens a step. A null with a control that moved is
    refuted; the same null beside a control that did not move is not testable here, with
    the control's interval and the reason; never refuted."""
    prereg = {"measure": "early_length_rate", "compare": ["sum", "mean"], "direction": "below",
              "threshold": 0,
              "control": {"compare": ["short", "mean"], "direction": "below", "margin": 0.05,
                          "why": "a length penalty must shorten"}}
    base = [0.30, 0.25, 0.35, 0.28, 0.32]
    null = [b + d for b, d in zip(base, (0.02, 0.01, 0.03, 0.015, 0.025))]  # above: refutes
    moved = [b - 0.4 + 0.01 * i for i, b in enumerate(base)]
    result = _result(prereg, [])
    result.records = _length_records(base, null, moved)
    decided = claims.claim_verdict(result)
    control = stats.paired_interval(moved, base, 0.95)
    assert control.high < -0.05
    assert decided.verdict == stats.REFUTED, decided
    assert f"control short vs mean: {control.format(2)}" in decided.figure
    assert decided.test.endswith("control: early_length_rate (short vs mean) below -0.05")
    stuck = [b - 0.01 for b in base]  # the control moved the rate by 0.01 only
    result.records = _length_records(base, null, stuck)
    decided = claims.claim_verdict(result)
    assert decided.verdict == claims.NOT_TESTABLE
    assert "not past its margin 0.05: this setting cannot move the measure" in decided.figure
    result.records = [r for r in result.records if r["arm"] != "short"]  # control not run
    decided = claims.claim_verdict(result)
    assert decided.verdict == stats.INCONCLUSIVE and "control not run yet" in decided.figure


def test_a_claim_file_whose_measure_needs_a_control_and_names_none_is_refused(tmp_path):
    """Refused with one line naming the file and the field, before any run is planned; the
    same file read for its finished runs (findings) still loads, and a claim restated in
    another file is read, not refused."""
    spec = yaml.safe_load((REPO / "experiments" / "claims" / "05_length_rate.yaml").read_text())
    spec["notebook"] = str(REPO / "notebooks" / "05_arms.ipynb")
    del spec["claims"][0]["preregistered"]["control"]
    path = tmp_path / "05_no_control.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    done = in_process("sweep", path, "--dry-run")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: 05_no_control.yaml: claim 5: preregistered.control "
                               "is missing"), lines[0]
    assert "to run" not in done.stdout
    assert load_sweep(path, to_run=False).claims  # reading finished runs is not running
    spec["claims"][0]["restated"] = "05_length_rate.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    assert load_sweep(path).claims


@pytest.mark.parametrize("change, words", [
    (lambda c: c.pop("why"), "control.why must say why"),
    (lambda c: c.update(margin=0), "control.margin must be a number > 0"),
    (lambda c: c.update(direction="two-sided"), "control.direction must be above or below"),
    (lambda c: c.update(compare=["longer", "seq-mean-token-mean"]),
     "control.compare: unknown arm 'longer'"),
    (lambda c: c.update(measure="length_change"), "control.measure must be a measure between"),
])
def test_a_bad_control_is_one_line_naming_the_field(tmp_path, change, words):
    spec = yaml.safe_load((REPO / "experiments" / "claims" / "05_length_rate.yaml").read_text())
    spec["notebook"] = str(REPO / "notebooks" / "05_arms.ipynb")
    change(spec["claims"][0]["preregistered"]["control"])
    path = tmp_path / "05_bad.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    with pytest.raises(ValueError, match=re.escape(words)) as caught:
        load_sweep(path)
    assert str(caught.value).startswith("05_bad.yaml: claim 5: preregistered.control")


def test_a_claim_over_a_grid_pairs_each_setting_of_one_prefix_with_the_others():
    """Claim 20: every grpo-X run against the dpo-X run of the same seed, one exact paired
    test over all the pairs; arms of neither prefix are left out."""
    collapsed = {"grpo-lr1": [0, 0, 0, 0, 0], "grpo-lr3": [1, 1, 0, 1, 1],
                 "grpo-lr9": [1, 1, 1, 1, 1], "dpo-lr1": [0, 0, 0, 0, 0],
                 "dpo-lr3": [0, 0, 0, 0, 0], "dpo-lr9": [0, 1, 0, 0, 0], "ppo-lr1": [1] * 5}
    records = [{"sweep_run": "seed=0", "arm": arm, "seed": s, "collapsed": v}
               for arm, values in collapsed.items() for s, v in enumerate(values)]
    result = _result({"measure": "collapse_difference", "compare": ["grpo-*", "dpo-*"],
                      "direction": "above", "threshold": 0}, [])
    result.records = records
    decided = claims.claim_verdict(result)
    grpo = [x for arm in ("grpo-lr1", "grpo-lr3", "grpo-lr9") for x in collapsed[arm]]
    dpo = [x for arm in ("dpo-lr1", "dpo-lr3", "dpo-lr9") for x in collapsed[arm]]
    from labkit.formulas import stats_design
    want = stats_design.paired_binary([x > 0.5 for x in grpo], [y > 0.5 for y in dpo],
                                      0.95).interval
    assert f"3 settings (lr1, lr3, lr9), 15 pairs: {want.format(2)}" in decided.figure
    assert decided.verdict == stats.SUPPORTED and want.low > 0
    result.claim["preregistered"]["compare"] = ["dpo-*", "grpo-*"]
    assert claims.claim_verdict(result).verdict == stats.REFUTED
    with pytest.raises(ValueError, match="unknown arm 'sft-\\*'"):
        preregistration.check({**result.claim, "preregistered": {
            **result.claim["preregistered"], "compare": ["sft-*", "dpo-*"]}}, "x",
            list(collapsed))


def test_a_collapsed_comparator_gives_no_verdict():
    """Claim 19's offline DPO lost its accuracy on 3 of 5 seeds: GRPO 'gaining more' than it
    says nothing of GRPO, so the claim reads 'comparator collapsed on 3 of 5 seeds', in the
    claim's verdict and in the notebooks' own findings."""
    from labkit.lab import verdicts

    gains = {"grpo": [0.3, 0.31, 0.29, 0.3, 0.32], "dpo_offline": [-0.3, -0.2, 0.0, -0.33, 0.01]}
    records = [{"sweep_run": "seed=0", "arm": arm, "seed": s, "gain": g,
                "collapsed": int(arm == "dpo_offline" and s in (0, 1, 3)),
                "accuracy_after": 0.5, "eval_n": 1000}
               for arm, values in gains.items() for s, g in enumerate(values)]
    result = _result({"measure": "gain", "compare": ["grpo", "dpo_offline"],
                      "direction": "above", "threshold": 0}, [])
    result.records = records
    decided = claims.claim_verdict(result)
    assert decided.verdict == "comparator collapsed on 3 of 5 seeds"
    rows = [dict(r, run=f"{r['arm']}/seed={r['seed']}") for r in records]
    (found,) = verdicts.arm_findings(rows, "dpo_offline")
    assert found.verdict == "comparator collapsed on 3 of 5 seeds"
    assert found.question == "grpo gains more held-out accuracy than dpo_offline"
    healthy = [dict(r, collapsed=0) for r in records]
    result.records = healthy
    assert claims.claim_verdict(result).verdict == stats.SUPPORTED
