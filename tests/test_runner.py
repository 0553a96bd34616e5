"""The notebook runner and sweeps: parameter checks (no kernel), `labkit run` and
`labkit sweep` end to end on the tiny fixture notebooks in tests/fixtures/."""

import csv
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml
from cli import in_process

from labkit.lab import report, runner, sweeps
from labkit.lab.runner import Param, RunFailed, check_parameters, notebook_parameters

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
TINY = FIXTURES / "tiny.ipynb"
FAILS = FIXTURES / "fails.ipynb"
SWEEP = FIXTURES / "tiny_sweep.yaml"
REPO = HERE.parent
TINY_NAMES = ["run_dir", "seed", "steps", "scale", "label", "noisy", "plot", "kill_worker"]
# a script loaded from plotly's CDN (the bundle itself names cdn.plot.ly as a map-data default)
PLOTLY_CDN = re.compile(r"""(src=|import\s*)["']https?://cdn\.plot\.ly""")


def labkit(*args, cwd):
    return subprocess.run([sys.executable, "-m", "labkit", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def one_error_line(done) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.fixture
def no_kernel(monkeypatch):
    """Fail the test if anything tries to execute a notebook."""
    import papermill

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was started")

    monkeypatch.setattr(papermill, "execute_notebook", refuse)


def notebook_with(tmp_path, source, tags=("parameters",), name="nb.ipynb"):
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = list(tags)
    path = tmp_path / name
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
    return path


# --- parameters, without a kernel -----------------------------------------------------------

def test_parameters_cell_is_read_with_types_defaults_and_comments(no_kernel):
    params = notebook_parameters(TINY)
    assert list(params) == TINY_NAMES
    assert params["steps"] == Param(int, 3, "metrics lines to write")
    assert params["scale"] == Param(float, 1.0, "multiplies every value")
    assert params["noisy"] == Param(bool, False, "add the seed to the score")
    assert params["run_dir"].type is str and params["run_dir"].default == ""


def test_command_line_strings_become_the_declared_types(no_kernel):
    values = check_parameters(TINY, {"steps": "7", "scale": "2", "noisy": "True",
                                     "label": "3.5 # not a number", "seed": "-1"})
    assert values == {"steps": 7, "scale": 2.0, "noisy": True, "label": "3.5 # not a number",
                      "seed": -1}
    assert isinstance(values["scale"], float)
    assert check_parameters(TINY, {"noisy": "false", "scale": "1e-3"}) == \
        {"noisy": False, "scale": 0.001}
    # a boolean's spellings are the same at every entry point (labkit.settings.fields.TRUE / FALSE)
    for text, value in (("yes", True), ("ON", True), ("1", True), ("no", False),
                        ("Off", False), ("0", False)):
        assert check_parameters(TINY, {"noisy": text}) == {"noisy": value}


@pytest.mark.parametrize("name, text, expected", [
    ("steps", "2.5", "int"), ("steps", "ten", "int"), ("steps", "true", "int"),
    ("scale", "fast", "float"), ("noisy", "maybe", "bool"), ("noisy", "2", "bool"),
])
def test_a_bad_type_names_the_parameter_type_and_value(no_kernel, name, text, expected):
    with pytest.raises(ValueError) as e:
        check_parameters(TINY, {name: text})
    message = str(e.value)
    assert name in message and expected in message and repr(text) in message


def test_an_unknown_name_lists_the_valid_ones(no_kernel):
    with pytest.raises(ValueError) as e:
        check_parameters(TINY, {"stepz": "3"})
    message = str(e.value)
    assert "stepz" in message and "tiny.ipynb" in message
    assert all(name in message for name in TINY_NAMES)


@pytest.mark.parametrize("source, words", [
    ("steps = 3  # untyped", "line 1"),
    ("steps: list = [3]  # not a parameter type", "list"),
    ("steps: int = len('abc')  # computed", "not a literal"),
    ("steps: int = 'three'  # wrong literal", "steps"),
    ("import os", "line 1"),
    ("steps: int = 3  # once\nsteps: int = 4  # twice", "twice"),
    ("steps: int = (", "not valid Python"),
])
def test_a_parameters_cell_must_be_typed_literals(no_kernel, tmp_path, source, words):
    with pytest.raises(ValueError) as e:
        notebook_parameters(notebook_with(tmp_path, source))
    assert "nb.ipynb" in str(e.value) and words in str(e.value)


def test_a_notebook_needs_one_parameters_cell(no_kernel, tmp_path):
    with pytest.raises(ValueError, match="exactly one code cell tagged 'parameters'"):
        notebook_parameters(notebook_with(tmp_path, "x: int = 1  # x", tags=()))
    with pytest.raises(FileNotFoundError):
        notebook_parameters(tmp_path / "missing.ipynb")


def test_run_checks_before_any_folder_is_made(no_kernel, tmp_path):
    for given in ({"stepz": "1"}, {"steps": "1.5"}):
        with pytest.raises(ValueError):
            runner.run_notebook(TINY, given, root=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_a_second_equals_sign_hides_a_parameter_from_papermill(no_kernel, tmp_path):
    path = notebook_with(tmp_path, 'a: int = 1  # fine\nb: str = "x="  # value\n'
                                   'c: float = 0.2  # ratio >= 1 - c')
    assert list(notebook_parameters(path)) == ["a", "b", "c"]  # runnable all the same
    with pytest.raises(ValueError, match=r"does not list b \(str\), c \(float\)"):
        runner.papermill_view(path)
    runner.papermill_view(TINY)


def test_a_given_run_dir_must_be_new_or_empty(no_kernel, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(runner, "execute", lambda nb, run_dir, values, progress: ran.append(
        (run_dir, values)) or run_dir)
    mine = tmp_path / "mine"
    assert runner.run_notebook(TINY, {"run_dir": str(mine), "seed": "3"}) == mine
    assert ran == [(mine, {"seed": 3})] and mine.is_dir()
    (mine / "summary.json").write_text("{}")
    with pytest.raises(FileExistsError, match="already holds files"):
        runner.run_notebook(TINY, {"run_dir": str(mine)})
    assert len(ran) == 1


def test_papermill_help_notebook_lists_names_and_types():
    papermill = Path(sys.executable).with_name("papermill")
    done = subprocess.run([str(papermill), "--help-notebook", str(TINY)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name, param in notebook_parameters(TINY).items():
        assert f"{name}: {param.type.__name__}" in done.stdout
        assert param.comment in done.stdout


# --- sweep definitions, without a kernel ----------------------------------------------------

def test_sweep_yaml_and_its_smoke_variant(no_kernel):
    full = sweeps.load_sweep(SWEEP)
    assert full.notebook == TINY and full.name == "tiny_sweep"
    assert full.parameters == {"scale": 2.0, "noisy": True, "plot": False}
    assert full.grid == {"steps": [1, 2]}
    assert full.seeds == [0, 1]
    smoke = sweeps.load_sweep(SWEEP, smoke=True)
    assert smoke.name == "tiny_sweep-smoke" and smoke.parameters["scale"] == 0.5
    assert smoke.grid == {"steps": [1]} and smoke.seeds == [0]


def write_sweep(tmp_path, **changes):
    spec = yaml.safe_load(SWEEP.read_text())
    spec.update(notebook=str(TINY), **changes)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("changes, words", [
    ({"grid": {"steps": [1, "two"]}}, "steps"),
    ({"grid": {"steps": [1, 1.5]}}, "steps"),
    ({"grid": {"stepz": [1]}}, "stepz"),
    ({"parameters": {"noisy": "maybe"}}, "noisy"),
    ({"parameters": {"run_dir": "x"}}, "run_dir"),
    ({"grid": {"seed": [1, 2]}}, "seeds"),
    ({"seeds": [0, 0]}, "seeds"),
    ({"grid": {"steps": []}}, "non-empty"),
    ({"parameters": {"steps": 1}}, "both"),
    ({"colour": "red"}, "colour"),
])
def test_a_bad_sweep_is_rejected_before_any_run(no_kernel, tmp_path, changes, words):
    with pytest.raises(ValueError) as e:
        sweeps.load_sweep(write_sweep(tmp_path, **changes))
    assert words in str(e.value)


def test_plan_ids_skips_and_changed_parameters(no_kernel, tmp_path):
    sweep = sweeps.load_sweep(SWEEP)
    runs = sweeps.plan(sweep, tmp_path)
    assert [r.id for r in runs] == ["steps=1,seed=0", "steps=1,seed=1", "steps=2,seed=0",
                                    "steps=2,seed=1"]
    done = runs[1].path
    done.mkdir(parents=True)
    (done / "summary.json").write_text('{"score": 1}')
    (done / "parameters.json").write_text(json.dumps(
        {"scale": 2.0, "noisy": True, "plot": False, "steps": 1, "seed": 1,
         "run_dir": str(done)}))
    assert [r.status for r in sweeps.plan(sweep, tmp_path)] == ["todo", "done", "todo", "todo"]
    (done / "parameters.json").write_text(json.dumps({"scale": 3.0, "noisy": True,
                                                      "plot": False, "steps": 1, "seed": 1}))
    with pytest.raises(ValueError, match="scale=3.0"):
        sweeps.plan(sweep, tmp_path)


def test_a_failed_run_is_reported_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    """`execute` replaced by a fake: seed 1 fails, the rest write a summary."""
    from labkit.__main__ import main

    calls = []

    def fake_execute(notebook, run_dir, values, progress=True):
        calls.append(values)
        if values["seed"] == 1:
            raise RunFailed("tiny.ipynb: cell In [3] `x` raised ZeroDivisionError: boom", run_dir)
        summary = {"score": values["steps"], "grpo/acc": 0.5, "ppo/acc": 0.25,
                   "steps": values["steps"] * 10, "scale": 2.0, "note": "text"}
        (Path(run_dir) / "summary.json").write_text(json.dumps(summary))
        return run_dir

    monkeypatch.setattr(sweeps, "execute", fake_execute)
    (tmp_path / "runs" / "tiny_sweep" / "steps=2,seed=1").mkdir(parents=True)  # interrupted
    code = main(["sweep", str(SWEEP), "--root", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 1 and len(calls) == 4
    assert "failed steps=1,seed=1" in err and "2 of 4 runs failed" in err
    assert len(list((tmp_path / "runs" / "tiny_sweep" / ".incomplete").iterdir())) == 1
    with open(tmp_path / "runs" / "tiny_sweep" / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["ok", "failed", "ok", "failed"]
    assert [r["score"] for r in rows] == ["1", "", "2", ""]
    assert [r["summary:steps"] for r in rows] == ["10", "", "20", ""]  # differs: kept
    assert "summary:scale" not in rows[0]  # repeats the parameter: left out
    html = (tmp_path / "runs" / "tiny_sweep" / "comparison.html").read_text()
    # a figure per numeric field: score, and acc with a line each for grpo and ppo; the
    # echoed parameter `steps` and the text `note` have none
    assert html.count("Plotly.newPlot") == 2 and report.PLOTLY_MARKER in html
    assert '"name":"grpo"' in html and '"name":"ppo"' in html


def test_comparison_with_only_seeds_varying(tmp_path):
    sweep = sweeps.Sweep(TINY, "s", {"steps": 2}, {}, [0, 1])
    runs = [sweeps.Run(f"seed={s}", {"seed": s}, tmp_path / f"seed={s}", "ok",
                       summary={"grpo/acc": 0.5 + s, "ppo/acc": 0.25}) for s in (0, 1)]
    html = sweeps.write_comparison(sweep, runs, tmp_path / "c.html").read_text()
    assert html.count("Plotly.newPlot") == 1
    assert '"x":["grpo","ppo"]' in html and '"y":[1.0,0.25]' in html  # means over seeds
    assert '"arrayminus":[0.5,0.0]' in html


# --- executing notebooks ---------------------------------------------------------------------

def run_dir_of(stdout: str) -> Path:
    line = next(s for s in stdout.splitlines() if s.startswith("run_dir "))
    return Path(line.split(None, 1)[1])


def test_labkit_run_end_to_end(tmp_path):
    done = labkit("run", TINY, "-p", "steps", "2", "-p", "label", "hello", "-p", "noisy", "true",
                  "--root", tmp_path / "runs", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run_dir = run_dir_of(done.stdout)
    assert run_dir.parent == tmp_path / "runs" / "tiny"
    for name in ("notebook.ipynb", "summary.json", "metrics.jsonl", "report.html",
                 "notebook.html", "parameters.json"):
        assert (run_dir / name).is_file(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["score"] == 2.0 and summary["label"] == "hello"
    assert summary["python"] == sys.executable  # the kernel runs this interpreter
    assert Path(summary["cwd"]) == FIXTURES  # the kernel starts in the notebook's folder
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    executed = nbformat.read(run_dir / "notebook.ipynb", as_version=4)
    injected = next(c for c in executed.cells
                    if "injected-parameters" in c.metadata.get("tags", []))
    for text in ("steps = 2", 'label = "hello"', "noisy = True", f'run_dir = "{run_dir}"'):
        assert text in injected.source
    html = (run_dir / "report.html").read_text()
    assert report.PLOTLY_MARKER in html and "Plotly.newPlot" in html
    assert not PLOTLY_CDN.search(html)


def test_labkit_run_rejects_a_bad_name_at_once(tmp_path):
    done = in_process("run", TINY, "-p", "stepz", "2", "--root", tmp_path / "runs", cwd=tmp_path)
    assert done.returncode == 2
    line = one_error_line(done)
    assert all(w in line for w in ["stepz", *TINY_NAMES]), line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, words", [
    (["-p", "steps", "2.5"], ["steps", "int", "'2.5'"]),
    (["-p", "noisy", "maybe"], ["noisy", "bool", "'maybe'"]),
    (["-p", "steps", "2", "-p", "steps", "3"], ["steps", "twice"]),
    (["-p", "run_dir", "x", "--name", "y"], ["--name", "run_dir"]),
    (["--name", "../up"], ["--name"]),
])
def test_labkit_run_rejects_bad_input_at_once(no_kernel, tmp_path, monkeypatch, capsys, args,
                                              words):
    from labkit.__main__ import main

    monkeypatch.chdir(tmp_path)
    assert main(["run", str(TINY), *args, "--root", str(tmp_path / "runs")]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "x").exists()


def test_a_failing_cell_keeps_the_partial_notebook(tmp_path):
    done = labkit("run", FAILS, "--root", tmp_path / "runs", cwd=tmp_path)
    assert done.returncode == 1
    line = one_error_line(done)
    assert "ZeroDivisionError" in line and "In [" in line and "seed / 0" in line
    (run_dir,) = (tmp_path / "runs" / "fails").iterdir()
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (run_dir / "summary.json").exists()
    executed = nbformat.read(run_dir / "notebook.ipynb", as_version=4)
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "error"]
    assert errors and errors[0].ename == "ZeroDivisionError"
    assert (run_dir / "report.html").is_file()
    # the cell's error is the notebook's, not the kernel process's own output (which may hold
    # unrelated start-up noise: a heartbeat port taken by a kernel starting beside this one)
    kernel_log = (run_dir / "kernel.log").read_text()
    assert "ZeroDivisionError" not in kernel_log and "seed / 0" not in kernel_log


def test_sweep_runs_the_grid_then_skips_what_is_done(tmp_path):
    root = tmp_path / "runs"
    done = labkit("sweep", SWEEP, "--workers", "2", "--root", root, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    folder = root / "tiny_sweep"
    assert str(folder / "sweep.csv") in done.stdout
    runs = sorted(p for p in folder.iterdir() if p.is_dir())
    assert [p.name for p in runs] == ["steps=1,seed=0", "steps=1,seed=1", "steps=2,seed=0",
                                      "steps=2,seed=1"]
    stamps = {p: (p / "notebook.ipynb").stat().st_mtime_ns for p in runs}
    with open(folder / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    assert list(rows[0])[:7] == ["run", "status", "error", "steps", "seed", "scale", "noisy"]
    assert all(r["status"] == "ok" and r["error"] == "" for r in rows)
    assert {"score", "label", "python", "cwd"} <= set(rows[0])
    assert [float(r["score"]) for r in rows] == [2.0, 3.0, 4.0, 5.0]  # 2 * steps + seed
    html = (folder / "comparison.html").read_text()
    assert report.PLOTLY_MARKER in html and not PLOTLY_CDN.search(html)

    again = labkit("sweep", SWEEP, "--root", root, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert {p: (p / "notebook.ipynb").stat().st_mtime_ns for p in runs} == stamps
    assert [r.status for r in sweeps.plan(sweeps.load_sweep(SWEEP), root)] == ["done"] * 4


def test_labkit_sweep_rejects_a_bad_grid_at_once(no_kernel, tmp_path, capsys):
    from labkit.__main__ import main

    path = write_sweep(tmp_path, grid={"steps": [1, "two"]})
    assert main(["sweep", str(path), "--root", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "steps" in err
    assert not (tmp_path / "runs").exists()


# --- the project's own notebooks and experiments ---------------------------------------------

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
EXPERIMENTS = sorted((REPO / "experiments").glob("*.yaml"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_each_notebook_has_a_runnable_parameters_cell(no_kernel, path):
    params = notebook_parameters(path)
    assert params["run_dir"] == Param(str, "", params["run_dir"].comment)
    assert params["seed"].type is int
    assert all(p.comment for p in params.values()), "every parameter needs a comment"
    runner.papermill_view(path)  # `papermill --help-notebook` lists every one with its type


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
@pytest.mark.parametrize("smoke", [False, True], ids=["full", "smoke"])
def test_each_experiment_matches_its_notebook(no_kernel, path, smoke):
    notebook = yaml.safe_load(path.read_text())["notebook"]
    if not (path.parent / notebook).is_file():
        pytest.skip(f"{notebook} is not written yet")
    sweep = sweeps.load_sweep(path, smoke=smoke)
    assert sweep.name.endswith("-smoke") == smoke


def test_the_fixture_copy_is_independent(tmp_path):
    """A sweep YAML elsewhere finds its notebook relative to itself."""
    shutil.copy(TINY, tmp_path / "tiny.ipynb")
    shutil.copy(SWEEP, tmp_path / "s.yaml")
    assert sweeps.load_sweep(tmp_path / "s.yaml").notebook == tmp_path / "tiny.ipynb"


def _kernel_that_dies_at_start(monkeypatch, times: int, message: str):
    """papermill.execute_notebook whose first `times` calls raise `message` as nbclient does
    for a kernel that died before it answered; later calls run the notebook. The calls."""
    import papermill

    real, calls = papermill.execute_notebook, []

    def execute_notebook(*args, **kwargs):
        calls.append(args)
        if len(calls) <= times:
            raise RuntimeError(message)
        return real(*args, **kwargs)

    monkeypatch.setattr(papermill, "execute_notebook", execute_notebook)
    return calls


def test_a_kernel_that_died_before_it_answered_is_started_again(tmp_path, monkeypatch):
    """As when its port was taken before it bound it: no cell ran, so the run starts another
    kernel, says so in kernel.log and finishes."""
    calls = _kernel_that_dies_at_start(monkeypatch, 1, runner.KERNEL_DIED_AT_START)
    values = check_parameters(TINY, {"steps": "2", "plot": "False"})
    run_dir = runner.execute(TINY, tmp_path, values, progress=False)
    assert len(calls) == 2
    assert json.loads((run_dir / "summary.json").read_text())["score"] == 2.0
    assert "the kernel died before it answered (start 1 of 3)" in \
        (run_dir / runner.KERNEL_LOG).read_text()


@pytest.mark.parametrize("message, starts", [
    (runner.KERNEL_DIED_AT_START, runner.KERNEL_STARTS),  # every start: the run fails
    ("Kernel didn't respond in 60 seconds", 1),  # not a death at start: no second kernel
])
def test_a_kernel_start_failure_is_reported_after_its_last_start(tmp_path, monkeypatch,
                                                                  message, starts):
    calls = _kernel_that_dies_at_start(monkeypatch, 99, message)
    with pytest.raises(RunFailed, match=re.escape(f"RuntimeError: {message}")):
        runner.execute(TINY, tmp_path, {}, progress=False)
    assert len(calls) == starts


def test_run_ends_with_the_table_and_prints_json_only_when_asked(tmp_path, monkeypatch, capsys):
    """A reader's terminal ends with the summary table (its verdicts); `--json` adds
    summary.json as a last line for scripts."""
    import argparse

    from labkit.lab import commands

    summary = {"finding1/verdict": "supported", "finding1/question": "does GRPO gain",
               "finding1/mean": 3.0, "finding1/low": 1.0, "finding1/high": 5.0}
    monkeypatch.setattr(commands, "run_notebook", lambda *a, **k: tmp_path)
    monkeypatch.setattr(commands, "read_summary", lambda run_dir: summary)
    for asked in (False, True):
        args = argparse.Namespace(notebook="x.ipynb", parameters=[], name=None, root=None,
                                  json=asked)
        assert commands.run_notebook_command(args) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last.startswith("{") == asked
        if asked:
            assert json.loads(last) == summary
        else:
            assert last.startswith("supported") and last.endswith("3 [1, 5]")


def test_the_readers_report_has_no_build_lines_and_no_absolute_paths(tmp_path):
    run_dir = tmp_path / "runs" / "x"
    run_dir.mkdir(parents=True)
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(1)")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stderr",
                               text="labkit.fast.kernels: built the C decode kernels into "
                                    "/root/.cache/labkit/kernels/k.so\n"),
        nbformat.v4.new_output("stream", name="stdout",
                               text=f"wrote {run_dir}/figure.html and {run_dir}\n")]
    nb.cells = [cell]
    executed = run_dir / "notebook.ipynb"
    nbformat.write(nb, executed)
    readers = report.write_report(executed, run_dir / report.REPORT).read_text()
    full = report.write_report(executed, run_dir / report.NOTEBOOK_HTML, code=True).read_text()
    assert "built the C decode kernels" in full and str(run_dir) in full
    assert "built the C decode kernels" not in readers and "/root/" not in readers
    assert str(tmp_path) not in readers
    assert "wrote figure.html and ." in readers
