"""Every claim is preregistered (labkit.lab.preregistration): its file names the article's
statement, the primary measure, the direction, the threshold and the seeds planned, checked
before any run starts; the page decides each claim by that measure alone."""

import re
from pathlib import Path

import pytest
import yaml
from cli import in_process

from labkit import stats
from labkit.lab import findings, preregistration
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
        assert re.search(r"\d", found.article) or claim["id"] in (5, 9, 10)  # its numbers


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


def _result(prereg: dict, rows: list[dict]) -> findings.ClaimResult:
    claim = {"id": 6, "statement": "s", "preregistered": {"article": "a", "seeds": 5, **prereg}}
    return findings.ClaimResult(Path("06.yaml"), claim, rows=rows)


def _row(question: str, low: float, high: float, n: int = 5) -> dict:
    return {"question": question, "mean": (low + high) / 2, "low": low, "high": high,
            "seeds": n, "method": f"paired t over {n} seeds", "effect": f"[{low}, {high}]"}


def test_the_claim_is_decided_by_its_primary_measure_alone():
    prereg = {"measure": "gain", "compare": ["acc75", "verifier"], "finding": "gains more",
              "direction": "above", "threshold": 0}
    rows = [_row("acc90 gains more held-out accuracy than verifier", 1.0, 3.0),
            _row("acc75 gains more held-out accuracy than verifier", -2.0, -0.5)]
    decided = findings.claim_verdict(_result(prereg, rows))
    assert decided.verdict == stats.REFUTED  # acc90's support is context, not the claim
    assert decided.figure.startswith("acc75 gains more") and "acc90" not in decided.figure
    assert decided.test == "gain (acc75 vs verifier) above 0"
    sd = 1.5 / 2 * 5 ** 0.5 / 2.776445  # the spread the interval implies
    assert float(decided.mde) == pytest.approx(stats.min_detectable(sd, 5), abs=0.01)


def test_several_primary_rows_must_each_hold_and_all_arms_need_the_per_seed_record():
    prereg = {"measure": "informative_share_error", "finding": "overstates",
              "direction": "equivalent", "threshold": 0, "margin": 5.0}
    inside = [_row(f"at G={g}, the formula overstates", -2.0, 2.0) for g in (2, 4)]
    assert findings.claim_verdict(_result(prereg, inside)).verdict == stats.SUPPORTED
    wide = inside + [_row("at G=8, the formula overstates", -1.0, 7.0)]
    assert findings.claim_verdict(_result(prereg, wide)).verdict == stats.INCONCLUSIVE
    out = wide + [_row("at G=16, the formula overstates", 6.0, 9.0)]
    assert findings.claim_verdict(_result(prereg, out)).verdict == stats.REFUTED
    assert findings.claim_verdict(_result(prereg, [])).figure == findings.NOT_MEASURED
    every = {"measure": "gain", "compare": ["all", "grpo"], "direction": "above", "threshold": 0}
    decided = findings.claim_verdict(_result(every, inside))
    assert findings.PER_SEED in decided.figure and decided.verdict == stats.INCONCLUSIVE
