"""Exploratory and confirmatory runs kept apart (labkit.lab.confirm)."""

import dataclasses

import pytest

from labkit.lab import confirm, findings
from labkit.lab.summaries import flat_summary
from labkit.settings.config import TrainConfig


def _config(**kw) -> TrainConfig:
    return TrainConfig(**({"steps": 3, "progress": False} | kw))


def test_the_fingerprint_reads_what_a_run_computes_and_not_where_it_writes():
    a = _config(seed=1000)
    assert confirm.fingerprint(a) == confirm.fingerprint(
        dataclasses.replace(a, run_dir="/elsewhere", progress=True, report_to="tensorboard"))
    assert confirm.fingerprint(a) != confirm.fingerprint(dataclasses.replace(a, seed=1001))
    assert confirm.fingerprint(a) != confirm.fingerprint(dataclasses.replace(a, lr=2e-3))
    assert len(confirm.fingerprint(a)) == 16
    assert [confirm.seed_range(s) for s in (3, 500, 999, 1000)] == [
        "exploratory", "tuning", "tuning", "confirmatory"]


def test_a_confirmatory_run_that_repeats_a_recorded_run_is_refused_naming_both(tmp_path):
    """The per-seed record holds each run's fingerprint (through summary.json, as text); a
    confirmatory run with the same one is refused in one line naming the new run and the
    record's; one at a fresh seed, and an exploratory rerun, go ahead."""
    earlier = _config(seed=1000, lr=5e-4)
    row = {"run": "grpo/seed=1000", "arm": "grpo", "seed": 1000, "gain": 0.1,
           "fingerprint": confirm.fingerprint(earlier)}
    records = findings.records_of(flat_summary([row]), "seed=1000")
    assert records[0]["fingerprint"] == confirm.fingerprint(earlier)
    findings.write_records(records, tmp_path / "09_x.csv")
    assert findings.read_records(tmp_path / "09_x.csv")[0]["fingerprint"] == row["fingerprint"]
    same = dataclasses.replace(earlier, run_dir="/tmp/elsewhere")
    with pytest.raises(ValueError) as caught:
        confirm.check_confirmatory({"ppo_tuned/seed=1000": same}, tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("confirmatory run ppo_tuned/seed=1000 (seed 1000) has "
                              f"configuration fingerprint {row['fingerprint']}, the same as "
                              "09_x.csv: grpo, seed 1000")
    confirm.check_confirmatory({"a": dataclasses.replace(same, seed=1001)}, tmp_path)
    confirm.check_confirmatory({"pilot": dataclasses.replace(same, seed=3)}, tmp_path)
    with pytest.raises(ValueError, match="the same as run first of this sweep"):
        confirm.check_confirmatory({"first": _config(seed=2000), "second": _config(seed=2000)},
                                   tmp_path)


def test_the_page_calls_a_claim_confirmatory_only_at_reserved_seeds():
    from pathlib import Path

    from labkit.lab.claims import ClaimResult
    from labkit.lab.findings_page import glance_rows

    claim = {"id": 6, "statement": "s", "preregistered": {
        "article": "a", "seeds": 5, "measure": "gain", "compare": ["b", "a"],
        "direction": "above", "threshold": 0}}

    def seeds_cell(first: int) -> str:
        records = [{"sweep_run": "x", "arm": arm, "seed": first + s, "gain": 0.1 * s + d,
                    "accuracy_after": 0.5, "eval_n": 100}
                   for arm, d in (("a", 0.0), ("b", 0.01)) for s in range(5)]
        return glance_rows([ClaimResult(Path("06.yaml"), claim, records=records)])[0][
            "seeds (planned)"]

    assert seeds_cell(0) == "5 (5), exploratory"
    assert seeds_cell(1000) == "5 (5), confirmatory"
    assert seeds_cell(998) == "5 (5), exploratory"  # 998-1002 straddles the line


def test_a_plan_edited_after_its_first_confirmatory_run_reads_exploratory(tmp_path, monkeypatch):
    """findings --all --confirmatory freezes each claim's plan (preregistered block and arms'
    settings) before its first confirmatory run; editing the block afterwards makes the page
    call the claim exploratory, in one line saying why."""
    from pathlib import Path

    import yaml

    import labkit.lab.findings as lab_findings
    from labkit.lab.findings_page import glance_rows

    repo = Path(__file__).resolve().parents[1]
    spec = yaml.safe_load((repo / "experiments" / "claims" / "06_reward_accuracy.yaml")
                          .read_text())
    spec["notebook"] = str(repo / "notebooks" / "05_arms.ipynb")
    spec["confirmatory"] = [1000]
    claims_dir, records = tmp_path / "claims", tmp_path / "records"
    claims_dir.mkdir()
    path = claims_dir / "06_reward_accuracy.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    ran = []
    monkeypatch.setattr(lab_findings, "run_sweep",
                        lambda sweep, root, **kw: ran.append(sweep.name) or [])
    lab_findings.run_claims(claims_dir, tmp_path / "runs", records_dir=records,
                            confirmatory=True)
    assert ran == ["claim06_reward_accuracy-confirmatory"]  # the stage alone, in its folder
    frozen = confirm.plan_path(records, "06_reward_accuracy")
    assert frozen.is_file() and "fingerprint" in frozen.read_text()
    result = lab_findings.collect(claims_dir, tmp_path / "runs", records_dir=records)[-1]
    assert result.confirmatory and result.changed is None
    spec["claim"]["preregistered"]["threshold"] = 5  # the test moved after the plan froze
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    lab_findings.run_claims(claims_dir, tmp_path / "runs", records_dir=records,
                            confirmatory=True)
    result = lab_findings.collect(claims_dir, tmp_path / "runs", records_dir=records)[-1]
    assert result.changed.startswith("exploratory: its plan changed after its first "
                                     "confirmatory run (frozen ")
    assert "\n" not in result.changed
    assert glance_rows([result])[0]["seeds (planned)"].endswith(result.changed)


def test_the_page_sets_each_claims_confirmatory_verdict_beside_its_exploratory_one():
    """One row per claim: the exploratory verdict, the confirmatory one with its figure, and
    where they differ the reason read from what changed (a tuned comparator's file, else a
    seed effect); the paragraph above counts the confirmatory verdicts and names the flips."""
    from pathlib import Path

    from labkit.lab.claims import ClaimResult
    from labkit.lab.findings_page import glance_rows, side_by_side, summary_paragraph

    claim = {"id": 6, "statement": "b learns more than a", "preregistered": {
        "article": "the article's words", "seeds": 5, "measure": "gain",
        "compare": ["b", "a"], "direction": "above", "threshold": 0}}

    def records(first: int, lift: float) -> list[dict]:
        return [{"sweep_run": "x", "arm": arm, "seed": first + s,
                 "gain": 0.1 * s + d + 0.003 * (s % 3) * (arm == "b"),
                 "accuracy_after": 0.5, "eval_n": 10**6}
                for arm, d in (("a", 0.0), ("b", lift)) for s in range(5)]

    explored = ClaimResult(Path("06.yaml"), claim, records=records(0, 0.05))
    same = ClaimResult(Path("06.yaml"), claim, records=records(1000, 0.05), confirmatory=True)
    flat = ClaimResult(Path("06.yaml"), claim, records=records(1000, 0.0), confirmatory=True)
    tuned = ClaimResult(Path("06.yaml"), claim, records=records(1000, 0.0), confirmatory=True,
                        changed_settings={"tuned": "t.json"})

    def row(*results):
        return side_by_side(list(results), glance_rows(list(results)))

    (agree,) = row(explored, same)
    assert agree["exploratory"].startswith("**supported**: b vs a: 5.")
    assert agree["confirmatory"].startswith("**supported**: b vs a: 5.")
    assert "look 1 of 1" in agree["confirmatory"] and agree["why they differ"] == "agree"
    (seed,) = row(explored, flat)
    assert seed["confirmatory verdict"] != "supported"
    assert seed["why they differ"].startswith("a seed effect: the same plan and settings")
    assert "; the confirmatory estimate 0." in seed["why they differ"]
    assert seed["why they differ"].endswith(" the exploratory interval " +
                                            agree["exploratory"].split(": ")[2].split(";")[0]
                                            .split(" ", 1)[1])
    ten = {**claim, "preregistered": {**claim["preregistered"], "seeds": 10}}
    early = ClaimResult(Path("06.yaml"), ten, records=[r for r in records(0, 0.0)])
    later = ClaimResult(Path("06.yaml"), ten, confirmatory=True, records=[
        {**r, "seed": r["seed"] + 5 * k} for k in (0, 1) for r in records(1000, 0.05)])
    (grown,) = row(early, later)
    assert grown["why they differ"].startswith(
        "more seeds: the exploratory verdict stood at 5 of its 10 planned seeds (its later "
        "looks not run), the confirmatory at 10; the confirmatory estimate 5.")
    (comparator,) = row(explored, tuned)
    assert comparator["why they differ"].startswith("a tuned comparator: each arm at its "
                                                    "tuned settings (t.json)")
    (waiting,) = row(explored)
    assert waiting["confirmatory"] == "not run yet" and waiting["why they differ"] == "-"
    text = summary_paragraph([agree, seed, waiting])
    assert text.startswith("Of 3 claims, 2 have a confirmatory verdict: 1 inconclusive, "
                           "1 supported; 1 is not run at confirmatory seeds yet, its "
                           "exploratory verdict standing")
    every = summary_paragraph([agree, seed])
    assert every.startswith("All 2 claims have a confirmatory verdict: 1 inconclusive, "
                            "1 supported. Verdicts that changed") and "not run" not in every
    assert "Verdicts that changed at confirmatory seeds: 6 (supported -> " in text


def test_every_shipped_confirmatory_record_is_fresh_data():
    """Each claim file with a `confirmatory:` stage ships its per-seed record, every seed in
    the reserved range, and no run in it repeats a configuration an exploratory or tuning
    record holds (by fingerprint); its plan was frozen, with the commit, before it ran."""
    import csv
    import json
    from pathlib import Path

    from labkit.lab.sweeps import load_sweep

    repo = Path(__file__).resolve().parents[1]
    shipped = repo / "docs" / "findings"
    staged = [f for f in sorted((repo / "experiments" / "claims").glob("*.yaml"))
              if load_sweep(f, to_run=False).confirmatory is not None]
    assert staged
    earlier = {}
    for path in shipped.glob("*.csv"):
        if "-confirmatory" in path.name or path.name.endswith("-findings.csv"):
            continue
        with path.open(newline="") as f:
            earlier |= {row["fingerprint"]: path.name for row in csv.DictReader(f)
                        if row.get("fingerprint")}
    assert earlier  # the exploratory records carry fingerprints to compare with
    for file in staged:
        record = shipped / f"{file.stem}-confirmatory.csv"
        assert record.is_file(), f"{file.name} has a confirmatory stage but no {record.name}"
        with record.open(newline="") as f:
            rows = list(csv.DictReader(f))
        assert rows, record.name
        assert all(int(r["seed"]) >= confirm.CONFIRM_FROM for r in rows), record.name
        prints = [r["fingerprint"] for r in rows]
        assert all(prints) and len(set(prints)) == len(prints), record.name
        repeats = [p for p in prints if p in earlier]
        assert not repeats, f"{record.name} repeats {earlier[repeats[0]]}" if repeats else ""
        plans = json.loads(confirm.plan_path(shipped, file.stem).read_text())
        ids = {str(c.get("id")) for c in load_sweep(file, to_run=False).claims}
        assert ids <= set(plans) and all(plans[i]["first_seed"] >= confirm.CONFIRM_FROM
                                         for i in ids), file.name
    stages = {f"{f.stem}-confirmatory.csv" for f in staged}
    assert {p.name for p in shipped.glob("*-confirmatory.csv")} == stages


def test_a_field_added_later_leaves_the_recorded_fingerprints_as_they_were():
    """chat_template and the fork's fields came after the per-seed records: at their earlier
    values a config's fingerprint is the one its run recorded without them; set otherwise,
    it differs."""
    import dataclasses
    import hashlib
    import json

    from labkit.settings.config import TrainConfig

    config = TrainConfig(seed=1003, algo="ppo", lr=5e-4)
    values = {k: v for k, v in config.to_dict().items()
              if k not in confirm.NOT_FINGERPRINTED and k not in confirm.ADDED_LATER}
    before = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()
                            ).hexdigest()[:16]
    assert confirm.fingerprint(config) == before
    assert confirm.fingerprint(dataclasses.replace(config, chat_template=False)) != before
    assert confirm.fingerprint(dataclasses.replace(config, continuation_seed=2)) != before


def test_a_claim_reads_only_its_planned_looks_where_its_file_ran_more():
    """A file whose other claim plans 10 seeds runs two looks; a claim of it that plans 5 is
    read from its first look's findings alone (the second's, which refute it, are not its
    data), and its row counts the 5 seeds it read."""
    from pathlib import Path

    from labkit.lab.claims import ClaimResult, claim_verdict
    from labkit.lab.findings_page import glance_rows

    claim = {"id": 3, "statement": "the formula predicts the share", "preregistered": {
        "article": "the article's words", "measure": "informative_share_error",
        "finding": "overstates", "direction": "equivalent", "threshold": 0, "margin": 5,
        "seeds": 5}}

    def row(first: int, mean: float) -> dict:
        return {"run": f"seed={first}", "question": "the formula overstates the share",
                "measure": "points", "effect": f"{mean:.2f}", "seeds": 5, "method": "t",
                "verdict": "", "mean": mean, "low": mean - 1, "high": mean + 1,
                "threshold": 0, "direction": "equivalent"}

    records = [{"sweep_run": "x", "arm": "g2", "seed": s} for s in range(10)]
    result = ClaimResult(Path("03.yaml"), claim, rows=[row(0, 1.0), row(5, 20.0)],
                         records=records)
    decided = claim_verdict(result)
    assert decided.verdict == "supported" and "20.00" not in decided.figure
    assert glance_rows([result])[0]["seeds (planned)"].startswith("5 (5), ")
    both = ClaimResult(Path("03.yaml"), {**claim, "preregistered": {
        **claim["preregistered"], "seeds": 10}}, rows=result.rows, records=records)
    assert claim_verdict(both).verdict == "refuted"  # at 10 planned seeds both looks count
