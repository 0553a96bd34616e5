"""experiments/claims/10_variants.yaml: every registered estimator and loss mode is an arm of the sweep,
and its smoke variant runs (CI), each arm compared with the default."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from labkit import lab
from labkit.formulas.estimators import ESTIMATORS
from labkit.formulas.policy_losses import POLICY_LOSSES
from labkit.lab.sweeps import load_sweep, run_sweep

REPO = Path(__file__).resolve().parents[1]
VARIANTS = REPO / "experiments" / "claims" / "10_variants.yaml"


def _labkits(registry) -> set[str]:
    """The names labkit registers (other tests register their own in the same process)."""
    return {name for name, fn in registry.items() if fn.__module__.startswith("labkit.")}


def test_the_sweep_has_an_arm_for_every_estimator_and_loss_mode():
    arms = lab.parse_arms(yaml.safe_load(VARIANTS.read_text())["parameters"]["arms"])
    estimators = {fields.get("estimator") for fields in arms.values()}
    losses = {fields.get("loss") for fields in arms.values()}
    # claim 10 tests the peers' registries (verl, TRL); vineppo, VinePPO's Monte Carlo
    # credit (labkit.model.credit), is not one of them and costs K continuations per step boundary
    critic_free = {n for n in _labkits(ESTIMATORS) if "values" not in ESTIMATORS.needs(n)
                   and "mc_values" not in ESTIMATORS.needs(n)}
    assert critic_free <= estimators, critic_free - estimators
    assert _labkits(POLICY_LOSSES) - {"vanilla"} <= losses, _labkits(POLICY_LOSSES) - losses
    assert all(len(fields) == 1 for fields in arms.values())  # one change per arm


@pytest.mark.notebook
def test_the_smoke_sweep_runs_and_compares_each_arm_with_the_default(tmp_path):
    text = VARIANTS.read_text().replace("../../notebooks/", str(REPO / "notebooks") + "/")
    (tmp_path / "variants.yaml").write_text(text)
    sweep = load_sweep(tmp_path / "variants.yaml", smoke=True)
    runs = run_sweep(sweep, tmp_path / "runs", progress=False)
    assert [r.status for r in runs] == ["ok"]
    row = next(csv.DictReader((tmp_path / "runs" / sweep.name / "sweep.csv").open()))
    arms = lab.parse_arms(sweep.parameters["arms"])
    questions = [v for k, v in row.items() if k.endswith("/question")]
    assert questions == [f"{arm} gains more held-out accuracy than grpo" for arm in arms
                         if arm != "grpo"]
    verdicts = [v for k, v in row.items() if k.endswith("/verdict")]
    assert all(v in ("supported", "refuted", "inconclusive at this budget") for v in verdicts)


def test_arms_table_gives_each_arm_its_seeds_interval_and_finding():
    from labkit.formulas import stats

    summary = {"a/seed=0/accuracy_after": 0.5, "a/seed=0/gain": 0.10, "a/seed=0/collapsed": 1,
               "a/seed=1/accuracy_after": 0.6, "a/seed=1/gain": 0.20,
               "b/seed=0/accuracy_after": 0.7, "b/seed=0/gain": 0.30,
               "b/seed=1/accuracy_after": 0.4, "b/seed=1/gain": 0.00,
               "finding1/question": "b gains more held-out accuracy than a",
               "finding1/mean": -0.0, "finding1/low": -1.0, "finding1/high": 1.0,
               "finding1/verdict": "inconclusive at this budget"}
    rows = lab.arms_table(summary).splitlines()
    assert rows[0].startswith("| arm | accuracy after") and len(rows) == 4
    assert rows[2].startswith(f"| a | {stats.mean_interval([0.5, 0.6]).format(3)} | "
                              f"{stats.mean_interval([10.0, 20.0]).format(1)} | 1/2 | (baseline)")
    assert rows[3].endswith("| 0/2 | -0.0 [-1.0, +1.0] | inconclusive at this budget |")
