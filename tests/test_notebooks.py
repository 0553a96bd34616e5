"""Notebook tier: each notebook runs end to end at its small defaults (papermill, marked
`notebook`), and its summary.json holds the expected keys in their ranges. The notebooks'
form (one typed `parameters` cell, no committed outputs) and the `labkit.lab` helpers they
call are checked without running a notebook.

`pytest --nbval-lax notebooks/` is the other half: it runs the notebooks in place. Named
after it on one command line, this file checks the runs nbval made rather than running each
notebook again.
"""

import ast
import json
import math
from pathlib import Path

import nbformat
import pytest

from labkit import lab
from labkit.formulas import stats

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
STEMS = ["00_building_blocks", "01_grpo_vs_ppo", "02_group_size_sweep",
         "03_advantage_variance_live", "04_claims", "05_arms", "06_learns_to_think",
         "07_collapse_forensics"]
REQUIRED = {
    "00_building_blocks": {"run_dir", "seed"},
    "01_grpo_vs_ppo": {"run_dir", "seed", "seeds", "workers", "steps", "batch_prompts",
                       "group_size", "max_new_tokens", "lr", "eval_every", "eval_n", "algos"},
    "02_group_size_sweep": {"run_dir", "seed", "seeds", "workers", "steps", "group_sizes",
                            "budget", "samples_per_step", "eval_every", "eval_n"},
    "03_advantage_variance_live": {"run_dir", "seed", "estimator", "group_size", "steps",
                                   "reward", "diag_every", "diag_prompts", "diag_batches",
                                   "diag_samples"},
    "04_claims": {"run_dir", "seed", "claims_dir", "runs_root", "smoke"},
    "05_arms": {"run_dir", "seed", "seeds", "workers", "arms", "baseline", "steps",
                "batch_prompts", "group_size", "eval_n"},
    "06_learns_to_think": {"run_dir", "seed", "algo", "steps", "batch_prompts", "group_size",
                           "critic_steps", "look_prompts", "look_samples"},
    "07_collapse_forensics": {"run_dir", "seed", "algo", "steps", "keep_every", "at", "seeds",
                              "stabilisers"},
}
ON_MODEL = {"model", "task", "gsm8k_path", "dataset_path", "code_path", "device", "dtype",
            "profile", "extra"}
"""What points a training notebook at your model, task and device (labkit.lab.model_params)."""
for _stem in ("01_grpo_vs_ppo", "02_group_size_sweep", "03_advantage_variance_live", "05_arms",
              "06_learns_to_think"):
    REQUIRED[_stem] = REQUIRED[_stem] | ON_MODEL
REQUIRED["00_building_blocks"] = REQUIRED["00_building_blocks"] | {"model"}
TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def parameters(stem: str) -> dict:
    """name -> (type name, value) of the notebook's `parameters` cell, checking its form."""
    book = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
    cells = [c for c in book.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{stem}: exactly one cell tagged parameters"
    out = {}
    for line in cells[0].source.splitlines():
        code, _, comment = line.partition("  # ")
        assert comment.strip(), f"{stem}: every parameter has a comment: {line!r}"
        node = ast.parse(code).body[0]
        assert isinstance(node, ast.AnnAssign), f"{stem}: 'name: type = literal': {line!r}"
        kind, value = node.annotation.id, ast.literal_eval(node.value)
        assert type(value) is TYPES[kind], f"{stem}: {line!r} is not a {kind} literal"
        out[node.target.id] = (kind, value)
    return out


@pytest.mark.parametrize("stem", STEMS)
def test_notebook_form(stem):
    params = parameters(stem)
    assert REQUIRED[stem] <= set(params)
    papermill = pytest.importorskip("papermill")
    seen = papermill.inspect_notebook(str(NOTEBOOKS / f"{stem}.ipynb"))
    assert set(seen) == set(params), "papermill parses every parameter (no '=' in comments)"
    assert all(seen[k]["inferred_type_name"] == kind for k, (kind, _) in params.items())
    assert params["run_dir"] == ("str", "") and params["seed"] == ("int", 0)
    book = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
    nbformat.validate(book)
    assert book.metadata.kernelspec.name == "python3"
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "commit without outputs"
    assert "resolve_run_dir" in "".join(c.source for c in book.cells)
    # a cell's last expression is shown in the reader's report.html: never a bare path
    # (PosixPath('...')) from the run folder or the files write_outputs wrote
    for cell in book.cells:
        body = ast.parse(cell.source).body if cell.cell_type == "code" else []
        if body and isinstance(body[-1], ast.Expr):
            shown = ast.unparse(body[-1].value)
            assert shown != "run_dir" and not shown.startswith("lab.write_outputs("), shown


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_run(summary: dict, run: str, steps: int):
    for key in ("accuracy_before", "accuracy_after", "final_reward", "frac_zero_std"):
        assert 0 <= summary[f"{run}/{key}"] <= 1, (run, key)
    assert summary[f"{run}/gav"] >= 0
    assert summary[f"{run}/step_s"] > 0 and summary[f"{run}/state_mb"] > 0
    assert summary[f"{run}/steps"] == steps


def check_00(summary, records, params):
    G = params["group_size"][1]
    assert summary["prompt"] == params["expression"][1] + "=" and summary["group_size"] == G
    assert 0 <= summary["reward_mean"] <= 1 and 0 <= summary["correct"] <= G
    for name in ("grpo (std / G-1)", "grpo (std / G)", "dr_grpo", "rloo"):
        assert summary[f"adv_std/{name}"] >= 0
    quantities = {r["quantity"] for r in records}
    assert {"reward", "advantage/rloo", "kl/k3", "surrogate/A=-1/dual clip c=3"} <= quantities
    from labkit.formulas.estimators import ESTIMATORS
    from labkit.formulas.policy_losses import POLICY_LOSSES

    ours = [n for n, fn in ESTIMATORS.items() if fn.__module__ == "labkit.formulas.estimators"]
    assert {f"registered/{n}" for n in ours if n != "gae"} <= quantities
    assert {f"loss_mode/A=+1/{n}" for n in POLICY_LOSSES} <= quantities


def _seeded(arm: str, params: dict) -> list[str]:
    """The run names of an arm: the arm itself for one seed, "<arm>/seed=<s>" for several."""
    first, n = params["seed"][1], params["seeds"][1]
    return [arm] if n == 1 else [f"{arm}/seed={s}" for s in range(first, first + n)]


def _check_findings(summary: dict, count: int, seeds: int):
    for k in range(1, count + 1):
        verdict = summary[f"finding{k}/verdict"]  # or no verdict, its comparator collapsed
        assert verdict in stats.VERDICTS or verdict.startswith("comparator collapsed on ")
        assert summary[f"finding{k}/seeds"] == seeds
        assert summary[f"finding{k}/low"] <= summary[f"finding{k}/mean"] <= summary[f"finding{k}/high"]
        assert summary[f"finding{k}/question"] in summary["description"]
    assert f"finding{count + 1}/verdict" not in summary


def check_01(summary, records, params):
    algos = params["algos"][1].split(",")
    assert summary["algos"] == params["algos"][1]
    runs = [run for algo in algos for run in _seeded(algo, params)]
    for run in runs:
        _check_run(summary, run, params["steps"][1])
        assert summary[f"{run}/entropy"] > 0
        assert f"{run}/adv_var" not in summary  # whitened vs z-scored: not a comparison
        if run.split("/")[0] in ("grpo", "ppo"):  # the ratio, its clip and the KL penalty
            assert summary[f"{run}/kl"] >= -1e-6
            assert 0 <= summary[f"{run}/clip_low"] <= 1 and 0 <= summary[f"{run}/clip_high"] <= 1
        else:  # DPO and RFT have no clip and no KL penalty
            assert f"{run}/clip_low" not in summary and f"{run}/kl" not in summary
    for grpo, ppo in zip(_seeded("grpo", params), _seeded("ppo", params)):
        assert summary[f"{ppo}/state_mb"] > summary[f"{grpo}/state_mb"]  # the critic
        assert summary[f"{ppo}/accuracy_before"] == summary[f"{grpo}/accuracy_before"]
    if "dpo" in algos and params["beta"][1] > 0:  # both hold the policy and a reference
        for grpo, dpo in zip(_seeded("grpo", params), _seeded("dpo", params)):
            assert summary[f"{dpo}/state_mb"] == summary[f"{grpo}/state_mb"]
            assert summary[f"{dpo}/accuracy_before"] == summary[f"{grpo}/accuracy_before"]
    assert isinstance(summary["description"], str) and summary["description"]
    _check_findings(summary, 3 * (len(algos) - 1), params["seeds"][1])
    assert {r["run"] for r in records} == set(runs)
    last = _seeded("ppo", params)[-1]
    assert {r["step"] for r in records if r["run"] == last} == set(range(params["steps"][1] + 1))


def check_02(summary, records, params):
    sizes = [int(g) for g in params["group_sizes"][1].split(",")]
    assert summary["group_sizes"] == params["group_sizes"][1]
    budgets = ["samples", "prompts"] if params["budget"][1] == "both" else [params["budget"][1]]
    S = params["samples_per_step"][1]
    runs = []
    for b in budgets:
        for G in sizes:
            for run in _seeded(f"{b}/G={G}", params):
                _check_run(summary, run, params["steps"][1])
                assert summary[f"{run}/group_size"] == G and summary[f"{run}/adv_var"] >= 0
                B = summary[f"{run}/batch_prompts"]
                assert B * G == S if b == "samples" else B == S // max(sizes)
                runs.append(run)
    _check_findings(summary, 2 * len(budgets), params["seeds"][1])
    assert {r["run"] for r in records} == set(runs)


DIAG_ROWS = ("grpo", "dr_grpo", "rloo", "none", "ppo_critic")


def check_03(summary, records, params):
    estimator, steps, every = params["estimator"][1], params["steps"][1], params["diag_every"][1]
    for run in (estimator, "ppo"):
        _check_run(summary, run, steps)
    assert summary["estimator"] == estimator and summary["group_size"] == params["group_size"][1]
    assert {r["run"] for r in records} == {estimator, "ppo"}
    assert summary["diag_step"] == steps  # the last step is always measured
    for name in DIAG_ROWS:
        assert 0 <= summary[f"baseline_mse/{name}"] <= 1, name  # rewards in [0, 1]
        assert summary[f"grad_rel_var/{name}"] > 0, name
    assert summary["grad_rel_var/ppo_gae"] > 0
    measured = {(r["run"], r["step"]) for r in records if "diag/v_star_mean" in r}
    wanted = {0, steps} | set(range(0, steps + 1, every))
    assert measured == {(run, s) for run in (estimator, "ppo") for s in wanted}
    last_ppo = [r for r in records if r["run"] == "ppo" and r["step"] == steps][0]
    assert summary["baseline_mse/ppo_critic"] == last_ppo["diag/baseline_mse/ppo_critic"]
    # the default runs learn: both end above where they started
    for run in (estimator, "ppo"):
        assert summary[f"{run}/accuracy_after"] > summary[f"{run}/accuracy_before"], run


def check_04(summary, records, params):
    from labkit.lab.sweeps import load_sweep

    files = sorted((REPO / "experiments" / "claims").glob("*.yaml"))
    claims = sum(len(load_sweep(f).claims) for f in files)  # a file may answer several
    assert summary["claims"] == claims and 0 <= summary["claims_run"] <= claims
    verdicts = sum(n for v, n in summary.items()
                   if v in stats.VERDICTS or v.startswith("comparator collapsed on "))
    assert verdicts == summary["findings"] and records == []


def check_07(summary, records, params):
    """The parent, then every arm's forks and the unchanged continuation at each seed, each
    from the fork step on; two findings per stabiliser, Bonferroni over them."""
    seeds, steps = params["seeds"][1], params["steps"][1]
    at = summary["at"]
    arms = summary["arms"].split(", ")
    assert arms == ["kl", "one_pass", "half_lr"]  # DPO's: no clip to turn on
    runs = {r["run"] for r in records}
    assert runs == {"parent"} | {f"{a}/seed={c}" for a in ["unchanged", *arms]
                                 for c in range(seeds)}
    for run in runs - {"parent"}:
        steps_run = sorted({r["step"] for r in records if r["run"] == run})
        assert steps_run == list(range(at + 1, steps + 1)), run
    found = [k for k in summary if k.endswith("/question")]
    assert len(found) == 2 * len(arms)
    assert all("98.3% " in summary["description"] for _ in [0])  # 1 - 0.05 / 3
    assert all(summary[k.replace("question", "verdict")] for k in found)


def check_05(summary, records, params):
    arms = lab.parse_arms(params["arms"][1] or lab.DEFAULT_ARMS)
    runs = [run for arm in arms for run in _seeded(arm, params)]
    for run in runs:
        _check_run(summary, run, params["steps"][1])
    _check_findings(summary, len(arms) - 1, params["seeds"][1])
    assert summary["baseline"] == next(iter(arms))
    assert {r["run"] for r in records} == set(runs)


def check_06(summary, records, params):
    algo, steps = params["algo"][1], params["steps"][1]
    _check_run(summary, algo, steps)
    _check_run(summary, "ppo-critic", params["critic_steps"][1])
    for key in ("worked_start", "worked_final"):
        assert 0 <= summary[f"{algo}/{key}"] <= 1, key
    assert 0 < summary[f"{algo}/length_start"] <= 48 and 0 < summary[f"{algo}/length_final"] <= 48
    for name in ("grpo", "critic", "gae"):
        assert summary[f"credit/{name}_err"] >= 0
    assert summary["credit/critic_err_s1"] >= 0
    # every prefix of the looked-at completions drew look_samples continuations
    assert summary["credit/continuations"] % params["look_samples"][1] == 0
    assert {r["run"] for r in records} == {algo, "ppo-critic"}
    assert all("rollout/worked_frac" in r for r in records if r["step"] > 0)


def _nbval_run(config, stem: str) -> Path | None:
    """The folder the notebook wrote when nbval ran it earlier in this pytest session
    (the root conftest.py points the notebooks' runs at one temporary folder), else None."""
    runs = getattr(config, "labkit_notebook_runs", None)
    if runs is None or not (runs / stem).is_dir():
        return None
    made = sorted((runs / stem).iterdir())
    assert len(made) == 1, f"{stem}: one run under nbval, found {made}"
    assert (made[0] / "summary.json").is_file(), f"{stem} failed under nbval: no summary.json"
    return made[0]


@pytest.mark.notebook
@pytest.mark.parametrize("stem", STEMS)
def test_notebook_runs_and_writes_its_summary(stem, tmp_path, request):
    """Checks the run that nbval made of the notebook in this session (CI: `pytest --nbval-lax
    notebooks/ tests/test_notebooks.py`, so each notebook executes once), else executes the
    notebook here with papermill at its defaults."""
    run_dir = _nbval_run(request.config, stem)
    if run_dir is None:
        papermill = pytest.importorskip("papermill")
        before = sorted(NOTEBOOKS.iterdir())
        run_dir = tmp_path / "run"
        papermill.execute_notebook(str(NOTEBOOKS / f"{stem}.ipynb"), str(tmp_path / "out.ipynb"),
                                   parameters={"run_dir": str(run_dir)}, kernel_name="python3",
                                   cwd=str(tmp_path), progress_bar=False)
        assert sorted(NOTEBOOKS.iterdir()) == before, "nothing is written into notebooks/"
    summary = json.loads((run_dir / "summary.json").read_text())
    records = _records(run_dir / "metrics.jsonl")
    assert records or stem == "04_claims", "metrics.jsonl is empty"  # 04 trains nothing
    assert all(isinstance(v, (int, float, str)) and not (isinstance(v, float) and math.isnan(v))
               for v in summary.values()), "summary.json is a flat dict of numbers and strings"
    globals()[f"check_{stem[:2]}"](summary, records, parameters(stem))


# ------------------------------------------------------------------ the helpers they call

def test_run_dirs_land_in_the_project_not_in_notebooks(tmp_path, monkeypatch):
    monkeypatch.delenv(lab.experiments.RUNS_ENV, raising=False)  # the root conftest.py sets it
    assert lab.project_root(NOTEBOOKS) == REPO
    assert lab.project_root(tmp_path) == tmp_path.resolve()
    given = lab.resolve_run_dir(str(tmp_path / "a" / "b"), "x")
    assert given == tmp_path / "a" / "b" and given.is_dir()
    monkeypatch.chdir(tmp_path)
    made = lab.resolve_run_dir("", "01_grpo_vs_ppo")
    assert made.parent == tmp_path.resolve() / "experiments" / "runs" / "01_grpo_vs_ppo"
    (made / "f").write_text("x")
    assert lab.fresh_dir(made) == made.with_name(made.name + "-2")
    monkeypatch.setenv(lab.experiments.RUNS_ENV, str(tmp_path / "elsewhere"))
    moved = lab.resolve_run_dir("", "01_grpo_vs_ppo")
    assert moved.parent == tmp_path / "elsewhere" / "01_grpo_vs_ppo" and moved.is_dir()
    assert lab.resolve_run_dir(str(tmp_path / "c"), "x") == tmp_path / "c"  # run_dir wins


def test_parse_list_and_problem():
    assert lab.parse_list("grpo, ppo") == ["grpo", "ppo"]
    assert lab.parse_list("2,4,8", int) == [2, 4, 8]
    with pytest.raises(ValueError, match="int"):
        lab.parse_list("2,x", int)
    p = lab.problem("37+85")
    assert (p.prompt, p.answer) == ("37+85=", "122") and p.target == "\\boxed{122}"
    assert lab.problem("12*3-4=").answer == "32"  # left to right
    with pytest.raises(ValueError, match="37\\+85"):
        lab.problem("two plus two")


def test_batch_prompts_per_budget():
    sizes = [2, 4, 8, 16]
    assert [lab.batch_prompts_for("samples", g, 32, sizes) for g in sizes] == [16, 8, 4, 2]
    assert [lab.batch_prompts_for("prompts", g, 32, sizes) for g in sizes] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="multiple"):
        lab.batch_prompts_for("samples", 3, 32, [3])
    with pytest.raises(ValueError, match="budget"):
        lab.batch_prompts_for("tokens", 2, 32, sizes)


def _row(run, before, after, step_s, state_mb):
    return {"run": run, "accuracy_before": before, "accuracy_after": after, "steps": 100,
            "batch_prompts": 32, "group_size": 8, "step_s": step_s, "state_mb": state_mb}


def test_describe_follows_the_numbers():
    text = lab.describe([_row("ppo", 0.3, 0.5, 0.2, 15.0), _row("grpo", 0.3, 0.8, 0.1, 8.0)], 400)
    assert text.startswith("grpo went from held-out accuracy 0.30 to 0.80")
    assert "gap of 0.30 is beyond two standard errors" in text
    assert "A ppo step took 2.00x as long as a grpo step" in text
    assert "ppo training state 1.88x the memory" in text
    close = lab.describe([_row("grpo", 0.3, 0.52, 0.1, 8.0), _row("ppo", 0.3, 0.5, 0.2, 15.0)], 64)
    assert "is within two standard errors" in close
    peaks = lab.describe([_row("ppo", 0.3, 0.5, 0.2, 15.0) | {"tensor_peak_mb": 170.0},
                          _row("grpo", 0.3, 0.8, 0.1, 8.0) | {"tensor_peak_mb": 85.0}], 400)
    assert "the ppo run's tensors peaked at 2.00x the grpo run's" in peaks
    assert "(170.0 vs 85.0 MiB, of which training state 15.0 vs 8.0)" in peaks


def test_write_outputs_is_strict_json(tmp_path):
    summary, metrics = lab.write_outputs(tmp_path, {"a": float("nan"), "b": 1.5},
                                         {"grpo": [{"run": "grpo", "step": 1}],
                                          "ppo": [{"run": "ppo", "step": 1}]})
    assert json.loads(summary.read_text()) == {"a": None, "b": 1.5}
    assert [r["run"] for r in _records(metrics)] == ["grpo", "ppo"]


@pytest.fixture
def one_thread():
    """One torch thread, as the notebooks run (many threads crawl on a busy 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_live_controls_rerun_into_fresh_folders(tmp_path, one_thread):
    from labkit.lab import live as live_figure
    from labkit.probes.diagnose import read_diagnostics

    live = live_figure.LivePlot()
    panel = lab.live_controls(live, run_dir=tmp_path, estimator="rloo", group_size=2, steps=2,
                              seed=0, batch_prompts=2, eval_n=4, max_new_tokens=12,
                              diag_every=2, diag_prompts=2, diag_batches=3, diag_samples=4)
    estimator, G, steps, button = panel.children[0].children
    assert (estimator.value, G.value, steps.value) == ("rloo", 2, 2)
    button.click()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rloo/steps"] == 2 and summary["ppo/group_size"] == 2
    reward = [t for t in live.widget.data if t.xaxis == "x3" and t.name == "rloo run"][0]
    assert list(reward.x) == [1, 2]
    mse = [t for t in live.widget.data if t.xaxis == "x" and t.name == "rloo run: none"][0]
    assert list(mse.x) == [0, 2]  # step 0 (read from diagnostics.jsonl) and the last step
    assert summary["baseline_mse/ppo_critic"] >= 0 and summary["grad_rel_var/ppo_gae"] > 0
    lines = read_diagnostics(tmp_path / "ppo")
    assert [line["step"] for line in lines] == [0, 2] and len(lines[0]["v_star"]) == 2
    estimator.value, steps.value = "dr_grpo", 1
    button.click()
    assert (tmp_path / "ppo-2").is_dir() and (tmp_path / "dr_grpo").is_dir()
    assert json.loads((tmp_path / "summary.json").read_text())["dr_grpo/steps"] == 1
    assert [t.name for t in live.widget.data if t.xaxis == "x3"] == ["dr_grpo run", "ppo run"]
    assert panel.children[1].value.startswith(("dr_grpo went", "ppo went"))


def test_final_diagnostics_take_each_row_from_its_run():
    from types import SimpleNamespace

    def run(algo, history):
        return SimpleNamespace(config=SimpleNamespace(algo=algo), history=history)

    grpo = run("grpo", [{"step": 0, "diag/v_star_mean": 0.2, "diag/baseline_mse/grpo": 0.5},
                        {"step": 5, "diag/v_star_mean": 0.3, "diag/baseline_mse/grpo": 0.1,
                         "diag/grad_rel_var/none": 4.0, "diag/grad_cos/none": 0.2},
                        {"step": 6, "adv/gav": 0.4}])
    ppo = run("ppo", [{"step": 5, "diag/v_star_mean": 0.3, "diag/baseline_mse/grpo": 0.9,
                       "diag/baseline_mse/ppo_critic": 0.05, "diag/grad_rel_var/ppo_gae": 0.7}])
    figures = lab.final_diagnostics({"grpo": grpo, "ppo": ppo})
    assert figures == {"diag_step": 5, "baseline_mse/grpo": 0.1, "grad_rel_var/none": 4.0,
                       "baseline_mse/ppo_critic": 0.05, "grad_rel_var/ppo_gae": 0.7}
    text = lab.describe_diagnostics(figures)
    assert text.startswith("At step 5 the cleanest gradient came from ppo_gae (relative "
                           "variance 0.7), the noisiest from none (4)")
    assert text.endswith("closest baseline was ppo_critic (MSE 0.05 against V*).")
    assert lab.final_diagnostics({"grpo": run("grpo", [{"step": 1}])}) == {}
