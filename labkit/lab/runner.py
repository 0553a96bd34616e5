"""Run a parameterized notebook into a fresh run directory: check, execute, report.

The `parameters` cell is read with `ast`, so every name and type given to a run is checked
before a kernel starts (papermill itself only warns about an unknown name and never checks a
type). Execution is papermill's, which saves the executed notebook after every cell: a failed
cell leaves the partial `notebook.ipynb` behind, and `report.html` is made from whatever ran.

A run directory (docs/architecture.md) holds, besides what the notebook writes (`summary.json`,
`metrics.jsonl`, ...): `parameters.json` (every value the notebook ran with, written before
the kernel starts), `notebook.ipynb` (papermill's output), `kernel.log` (what the kernel
process itself printed, outside any cell) and `report.html` (nbconvert, with plotly.js
embedded so it reads offline).

The runner owns `run_dir`: it creates the folder and injects its absolute path. A user may
still give `run_dir` on the command line; that folder must be new or empty (`claim_run_dir`).
The kernel's working directory is the notebook's folder, as in Jupyter, so a notebook behaves
the same run by hand and run here; notebooks should write only under `run_dir`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from labkit.lab.cells import (PARAM_TYPES, RUNNER_OWNED, Param, notebook_parameters,  # noqa: F401
                               papermill_view, parameters_source, read_notebook,
                               read_parameter, unknown_names)
from labkit.lab import model_params
from labkit.lab.progress import NotebookProgress
from labkit.lab.report import write_reports
from labkit.run.rundir import RUNS_ROOT, claim_run_dir, new_run_dir
from labkit.settings.config import TrainConfig, field_types
from labkit.settings.preflight import preflight

KERNEL = "python3"
OUTPUT_NOTEBOOK = "notebook.ipynb"
PARAMETERS_FILE = "parameters.json"
SUMMARY = "summary.json"
KERNEL_LOG = "kernel.log"
KERNEL_STARTS = 3
"""How many kernels a run starts before it counts a kernel that died before it answered
(`KERNEL_DIED_AT_START`) as the run's failure. Such a kernel ran no cell; the usual cause
is a port taken between the kernel manager choosing it and the kernel binding it
("Address already in use" in kernel.log), which another start, on other ports, avoids."""
KERNEL_DIED_AT_START = "Kernel died before replying to kernel_info"


class RunFailed(RuntimeError):
    """A notebook run that did not finish; the message is one line naming the cell."""

    def __init__(self, message: str, run_dir: Path):
        super().__init__(message)
        self.run_dir = run_dir


def check_parameters(path: str | Path, given: dict[str, str]) -> dict:
    """Command-line strings -> values of the declared types; ValueError names the culprit.
    Values of parameters that are training-config fields must also obey the field's rule."""
    params = notebook_parameters(path)
    unknown_names(path, given, params)
    values = {key: read_parameter(key, text, params[key].type, path)
              for key, text in given.items()}
    check_config_rules(path, params, values)
    return values


ON_MODEL = ("model", "task", "gsm8k_path", "dataset_path", "code_path", "device")
"""Parameters named like TrainConfig fields that a notebook reads through
labkit.lab.model_params ('' for the field's default), not as the fields themselves."""


def config_values(params: dict[str, Param], values: dict) -> dict:
    """The notebook's values (its defaults overlaid with `values`) of the parameters named
    and typed like a `TrainConfig` field, but `run_dir`: those its TrainConfig receives."""
    types = field_types()
    merged = {key: param.default for key, param in params.items()} | values
    # model, task and the other parameters labkit.lab.model_params reads: '' leaves the field
    return {key: value for key, value in merged.items()
            if key != RUNNER_OWNED and key in types and key in params
            and types[key] is params[key].type and key not in ON_MODEL}


def check_config_rules(notebook: str | Path, params: dict[str, Param], values: dict) -> None:
    """A notebook parameter named and typed like a `TrainConfig` field (group_size: int,
    lr: float, estimator: str) reaches a TrainConfig in the notebook, so it obeys that field's
    rules, checked here with the notebook's other such values (its defaults overlaid with
    `values`) before any kernel starts or model loads. ValueError names the parameter."""
    shared = config_values(params, values)
    merged = {key: param.default for key, param in params.items()} | values
    where = {k: merged[k] for k in model_params.WHERE if isinstance(merged.get(k), str)}
    if not shared or not set(values) & (set(shared) | set(where)):
        return
    try:
        # as the notebook will read them: a profile, the model and task, dtype and extra
        preflight(TrainConfig(**model_params.fields(Path(notebook).stem, shared, check=False,
                                                say=False, **where)))
    except ValueError as e:
        given = ", ".join(f"{k}={values[k]!r}" for k in values if k in shared or k in where)
        error = ValueError(f"{Path(notebook).name} with {given}: {e}")
        error.rule = str(e)  # the rule alone, for a caller that names the values itself
        raise error from None


# --- execution -------------------------------------------------------------------------------

def _kernel_manager_class(log):
    """A kernel manager that runs `python3` with this interpreter (the venv's), whichever
    `python3` kernelspec the Jupyter paths would find first, and sends the kernel process's
    own stdout and stderr (its start-up warnings, a crash) to the open file `log`."""
    from ipykernel.kernelspec import get_kernel_dict
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec

    class ThisPythonKernelManager(AsyncKernelManager):
        @property
        def kernel_spec(self):
            if self._kernel_spec is None:
                self._kernel_spec = KernelSpec(resource_dir="", **get_kernel_dict())
            return self._kernel_spec

        async def _async_launch_kernel(self, kernel_cmd, **kw):
            kw.setdefault("stdout", log)
            kw.setdefault("stderr", log)
            return await super()._async_launch_kernel(kernel_cmd, **kw)

    return ThisPythonKernelManager


def _failure(notebook: Path, error, out: Path) -> str:
    from papermill.exceptions import PapermillExecutionError

    if isinstance(error, PapermillExecutionError):
        lines = [s for s in error.source.splitlines() if s.strip()]
        first = lines[0].strip()[:60] if lines else ""
        reason = " ".join(str(error.evalue).split())[:200]
        what = f"cell In [{error.exec_count}] `{first}` raised {error.ename}: {reason}"
    else:  # the kernel died, timed out or never started: its own words are in kernel.log
        what = (f"{type(error).__name__}: {' '.join(str(error).split())[:200]} (see "
                f"{out.with_name(KERNEL_LOG)})")
    return f"{notebook.name}: {what} (partial notebook: {out})"


def execute(notebook: str | Path, run_dir: str | Path, parameters: dict,
            progress: bool = True) -> Path:
    """Execute `notebook` with `parameters` (already checked) into the existing `run_dir`;
    returns run_dir. Raises RunFailed, after writing the partial notebook and its report."""
    import papermill as pm
    from jupyter_client.kernelspec import NoSuchKernel
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    notebook, run_dir = Path(notebook).resolve(), Path(run_dir).resolve()
    values = {**parameters, RUNNER_OWNED: str(run_dir)}
    (run_dir / PARAMETERS_FILE).write_text(json.dumps(values, indent=2) + "\n")
    out = run_dir / OUTPUT_NOTEBOOK
    # the bar: the training steps the notebook's runs have logged, the cell, an ETA
    watch = NotebookProgress(run_dir, out, notebook.stem) if progress else None
    try:
        with open(run_dir / KERNEL_LOG, "ab") as log:
            for start in range(1, KERNEL_STARTS + 1):
                try:
                    pm.execute_notebook(str(notebook), str(out), parameters=values,
                                        kernel_name=KERNEL, language="python",
                                        progress_bar=False, cwd=str(notebook.parent),
                                        kernel_manager_class=_kernel_manager_class(log))
                    break
                except RuntimeError as e:
                    if str(e) != KERNEL_DIED_AT_START or start == KERNEL_STARTS:
                        raise
                    log.write(f"[labkit] the kernel died before it answered (start {start} of "
                              f"{KERNEL_STARTS}): starting another\n".encode())
                    log.flush()
    except (PapermillExecutionError, DeadKernelError, CellTimeoutError, NoSuchKernel,
            RuntimeError) as e:
        if out.is_file():
            try:
                write_reports(out, run_dir)
            except Exception:  # the failure is the message; a report of it is a bonus
                pass
        raise RunFailed(_failure(notebook, e, out), run_dir) from e
    finally:
        if watch is not None:
            watch.close()
    write_reports(out, run_dir)
    return run_dir


def run_notebook(notebook: str | Path, given: dict[str, str], name: str | None = None,
                 root: str | Path | None = None, progress: bool = True) -> Path:
    """`python -m labkit run`: check the command-line values, make the run directory
    (`root/<name or notebook stem>/<time>-<pid>`, or the given `run_dir`), execute."""
    notebook = Path(notebook)
    values = check_parameters(notebook, given)  # before any folder or kernel exists
    chosen = values.pop(RUNNER_OWNED, "")
    if chosen and name:
        raise ValueError("give --name or -p run_dir, not both")
    if name is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ValueError(f"--name {name!r} must be a folder name (letters, digits, '.', '_', '-')")
    if chosen:  # held while the notebook runs: no second run can take the same folder
        with claim_run_dir(chosen) as lock:
            return execute(notebook, lock.run_dir, values, progress=progress)
    run_dir = new_run_dir(name or notebook.stem, RUNS_ROOT if root is None else root)
    return execute(notebook, run_dir, values, progress=progress)


def read_summary(run_dir: str | Path) -> dict | None:
    """The run's summary.json; None when it is missing or torn (the run is not complete)."""
    path = Path(run_dir) / SUMMARY
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_or_none(value):
    return value if is_number(value) and math.isfinite(value) else None

