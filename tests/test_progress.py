"""The notebook runner's progress bar (labkit.lab.progress): steps logged over steps
planned, the cell running, the latest reward."""

import json
from pathlib import Path

from labkit.lab import progress
from labkit.lab.runner import run_notebook

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _run(folder: Path, steps: int, logged: int, reward: float | None = 0.5) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"config": {"steps": steps}}))
    with (folder / "metrics.jsonl").open("w") as f:
        for step in range(logged + 1):
            record = {"step": step}
            if step and reward is not None:
                record["rollout/reward_mean"] = reward + step / 100
            f.write(json.dumps(record) + "\n")


def _notebook(path: Path, running: int | None) -> None:
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# title"}]
    for i in range(4):
        status = "running" if i == running else "completed" if running and i < running \
            else "pending"
        cells.append({"cell_type": "code", "metadata": {"papermill": {"status": status}},
                      "source": ""})
    path.write_text(json.dumps({"cells": cells}))


def test_the_bar_counts_logged_steps_over_the_planned_runs(tmp_path):
    runs = {str(tmp_path / name): 10 for name in ("grpo-seed0", "ppo-seed0", "grpo-seed1")}
    progress.write_plan(runs)
    assert json.loads((tmp_path / progress.PLAN).read_text())["runs"] == \
        {str(Path(p).resolve()): 10 for p in runs}
    _run(tmp_path / "grpo-seed0", 10, logged=10)
    _run(tmp_path / "ppo-seed0", 10, logged=4, reward=0.25)  # the latest written
    # the notebook's own metrics.jsonl, beside no config.json, is not a run's
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 99}) + "\n")
    _notebook(tmp_path / "notebook.ipynb", running=2)
    bar = progress.NotebookProgress(tmp_path, tmp_path / "notebook.ipynb", "01", every=3600)
    try:
        bar.poll()
        assert bar.bar.total == 30  # the third run has not started: its steps are planned
        assert bar.bar.n == 14
        assert bar.bar.desc.startswith("01 cell 3/4")
        assert bar.bar.postfix == "reward=0.29, run=ppo-seed0, step=4"
    finally:
        bar.close()


def test_without_a_plan_the_runs_config_gives_the_total(tmp_path):
    _run(tmp_path / "run", 8, logged=3, reward=None)
    bar = progress.NotebookProgress(tmp_path, tmp_path / "missing.ipynb", "03", every=3600)
    try:
        bar.poll()
        assert (bar.bar.total, bar.bar.n) == (8, 3)
        assert bar.bar.desc == "03" and not bar.bar.postfix  # no cell known, no reward yet
    finally:
        bar.close()


def test_a_plan_is_merged_and_a_single_run_needs_none(tmp_path):
    progress.write_plan({str(tmp_path / "a"): 5})
    assert not (tmp_path / progress.PLAN).exists()
    progress.write_plan({str(tmp_path / "a"): 5, str(tmp_path / "b"): 6})
    progress.write_plan({str(tmp_path / "c"): 7, str(tmp_path / "b"): 9})
    runs = json.loads((tmp_path / progress.PLAN).read_text())["runs"]
    assert {Path(k).name: v for k, v in runs.items()} == {"a": 5, "b": 9, "c": 7}


def test_the_runner_draws_the_bar_and_closes_it(tmp_path, capfd):
    run_dir = run_notebook(FIXTURES / "tiny.ipynb", {"steps": "2", "plot": "false"},
                           root=tmp_path, progress=True)
    err = capfd.readouterr().err
    assert (run_dir / "summary.json").is_file()
    assert "tiny" in err and "step" in err and "Traceback" not in err
