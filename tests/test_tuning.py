"""Fair comparators (labkit.lab.tuning): a tuning file's checks, its arms, the rule's choice,
and notebook 01's per-algorithm settings."""

from pathlib import Path

import pytest
import yaml

from labkit.lab import experiments, tuning

REPO = Path(__file__).resolve().parents[1]
MAIN = REPO / "experiments" / "tuning" / "main_job.yaml"


def _changed(tmp_path, change) -> Path:
    spec = yaml.safe_load(MAIN.read_text())
    change(spec)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_the_main_jobs_tuning_file_is_a_fair_grid():
    found = tuning.load(MAIN)
    arms = found.arms()
    assert len(arms) == 16 and arms["dpo-lr0.0005-it1"] == {
        "algo": "dpo", "lr": 0.0005, "num_iterations": 1, "entry": "dpo"}
    assert arms["grpo-lr0.001"] == {"algo": "grpo", "lr": 0.001, "num_iterations": 2,
                                    "beta": 0.02, "entry": "grpo"}
    assert found.seed == 500 and found.seeds == 3 and len(found.fingerprint()) == 16


@pytest.mark.parametrize("change, words", [
    (lambda s: s["grid"]["grpo"].update(lr=[5e-4, 1e-3, 2e-3]), "grid.grpo.lr must hold >= 4"),
    (lambda s: s["grid"]["grpo"].update(lr=[5e-4, 7e-4, 1e-3, 2e-3]), "spanning >= 8x"),
    (lambda s: s["grid"]["ppo"].update(lr=[1e-4, 2e-4, 4e-4, 8e-4]), "and the default 0.0005"),
    (lambda s: s.update(seed=3), "seed: tuning runs use seeds 500-999, got 3..5"),
    (lambda s: s.update(seed=998), "got 998..1000"),
    (lambda s: s.update(seeds=2), "seeds must be an integer >= 3"),
    (lambda s: s.update(rule="best last reward"), "rule must be one of"),
    (lambda s: s["grid"]["grpo"].update(num_iterations=[1, 2]), "several only for dpo, rft"),
    (lambda s: s["grid"]["dpo"].update(beta=[0.1]), "grid.dpo.beta: one value, fixed"),
])
def test_a_bad_tuning_file_is_refused_naming_the_field(tmp_path, change, words):
    with pytest.raises(ValueError, match=r"^t\.yaml: ") as caught:
        tuning.load(_changed(tmp_path, change))
    assert words in str(caught.value)


def test_the_rule_picks_each_algorithms_best_mean_gain_and_the_choice_is_read_back(tmp_path):
    found = tuning.load(MAIN)
    gains = {"grpo-lr0.001": 0.10, "grpo-lr0.002": 0.14, "ppo-lr0.0005": 0.09,
             "dpo-lr0.0005-it1": 0.05, "dpo-lr0.001-it2": -0.3}
    records = [{"arm": arm, "seed": 500 + s, "gain": gains.get(arm, 0.0) + 0.01 * s,
                "collapsed": int(arm == "dpo-lr0.001-it2")}
               for arm in found.arms() for s in range(3)]
    chosen = tuning.choose(found, records)
    assert (chosen["grpo"]["lr"], chosen["ppo"]["lr"]) == (0.002, 0.0005)
    assert chosen["dpo"]["lr"] == 0.0005 and chosen["dpo"]["num_iterations"] == 1
    assert chosen["grpo"]["mean_gain"] == pytest.approx(0.15)
    assert chosen["dpo"]["grid"]["dpo-lr0.001-it2"]["collapsed"] == 3
    path = tuning.write_tuned(found, chosen, tmp_path, "abc1234")
    assert path.name == "tuned-main_job.json" and found.fingerprint() in path.read_text()
    settings = tuning.read_tuned(path)
    assert settings["dpo"] == {"lr": 0.0005, "num_iterations": 1}
    assert settings["grpo"] == {"lr": 0.002, "num_iterations": 2, "beta": 0.02}
    with pytest.raises(ValueError, match="has 2 finished runs of 3"):
        tuning.choose(found, [r for r in records if r["seed"] != 502])
    with pytest.raises(ValueError, match="tuned: no tuned settings at"):
        tuning.read_tuned(tmp_path / "missing.json")


def test_each_algorithm_runs_at_its_own_settings(monkeypatch, tmp_path):
    """notebook 01's compare with `per_algo`: the configs it trains carry each algorithm's
    own lr and passes (read from the configs handed to run_all)."""
    seen = {}
    monkeypatch.setattr(experiments, "run_all",
                        lambda configs, **kw: seen.update(configs) or {})
    experiments.compare(["grpo", "dpo"], run_dir=tmp_path, seeds=1, lr=1e-3, num_iterations=2,
                        beta=0.02, steps=2, per_algo={"dpo": {"lr": 5e-4, "num_iterations": 1}})
    assert (seen["grpo"].lr, seen["grpo"].num_iterations, seen["grpo"].beta) == (1e-3, 2, 0.02)
    assert (seen["dpo"].lr, seen["dpo"].num_iterations) == (5e-4, 1)


def test_notebook_05s_arms_take_their_algorithms_tuned_settings_under_their_own(tmp_path):
    """A claim's arms with `tuned`: each arm's algorithm's settings, the arm's own fields
    winning; an algorithm the file does not cover is refused naming the arm; and the plan's
    fingerprint reads the tuned file's content, so a re-tuned file changes the plan."""
    from labkit.lab import confirm

    tuned = {"grpo": {"lr": 5e-4, "num_iterations": 2, "beta": 0.02},
             "dpo": {"lr": 2.5e-4, "num_iterations": 2}}
    arms = {"grpo": {"algo": "grpo"}, "dpo": {"algo": "dpo"},
            "grpo_fast": {"algo": "grpo", "lr": 2e-3}, "plain": {}}
    out = tuning.apply_tuned(arms, {"algo": "grpo", "lr": 1e-3}, tuned)
    assert out["dpo"] == {"lr": 2.5e-4, "num_iterations": 2, "algo": "dpo"}
    assert out["grpo_fast"]["lr"] == 2e-3 and out["grpo_fast"]["beta"] == 0.02
    assert out["plain"]["lr"] == 5e-4  # the shared algo's, over the shared lr
    assert tuning.apply_tuned(arms, {}, {}) == arms
    with pytest.raises(ValueError, match="no tuned settings for algo ppo \\(arm critic\\)"):
        tuning.apply_tuned({"critic": {"algo": "ppo"}}, {}, tuned)
    path = tmp_path / "tuned.json"
    path.write_text('{"settings": {"grpo": {"lr": 0.0005}}}')
    claim = {"preregistered": {"measure": "gain"}}
    before = confirm.plan_fingerprint(claim, {"tuned": str(path)})
    path.write_text('{"settings": {"grpo": {"lr": 0.001}}}')
    assert confirm.plan_fingerprint(claim, {"tuned": str(path)}) != before


def test_an_arm_that_brings_its_own_fields_is_tuned_as_itself(tmp_path):
    """A claim's arm (rloo: GRPO with the leave-one-out estimator) gets its own entry: its
    grid points carry its fields, the rule picks its lr apart from GRPO's, and a claim's arm
    of that name takes its own choice before its algorithm's."""
    path = _changed(tmp_path, lambda s: s["grid"].update(
        rloo={"fields": {"algo": "grpo", "estimator": "rloo"},
              "lr": [0.00025, 0.0005, 0.001, 0.002]}))
    found = tuning.load(path)
    assert found.arms()["rloo-lr0.002"] == {"algo": "grpo", "estimator": "rloo", "lr": 0.002,
                                            "entry": "rloo"}
    gains = {"rloo-lr0.002": 0.2, "grpo-lr0.0005": 0.1}
    records = [{"arm": arm, "seed": 500 + k, "gain": gains.get(arm, 0.0)}
               for arm in found.arms() for k in range(3)]
    chosen = tuning.choose(found, records)
    assert chosen["rloo"]["lr"] == 0.002 and chosen["grpo"]["lr"] == 0.0005
    settings = {name: {k: v for k, v in c.items() if k in tuning.GRID_KEYS}
                for name, c in chosen.items()}
    out = tuning.apply_tuned({"rloo": {"estimator": "rloo"}, "grpo": {}}, {"algo": "grpo"},
                             settings)
    assert out["rloo"]["lr"] == 0.002 and out["grpo"]["lr"] == 0.0005
    bad = _changed(tmp_path, lambda s: s["grid"].update(rloo={"lr": [0.001] * 4}))
    with pytest.raises(ValueError, match="grid.rloo: not an algorithm"):
        tuning.load(bad)
