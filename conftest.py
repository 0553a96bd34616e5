"""Under `pytest --nbval-lax notebooks/`, the notebooks write their runs (run_dir left
empty) into one temporary folder instead of the project's experiments/runs/.
tests/test_notebooks.py, named after notebooks/ on the same command line (as CI does),
then checks those runs' summaries instead of executing every notebook a second time.

It lives at the project's root, not in notebooks/, so that a user opening JupyterLab there
sees notebooks only; it does nothing unless nbval is asked for."""

import os
import tempfile
from pathlib import Path


def pytest_configure(config):
    if not (getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False)):
        return
    from labkit.lab.experiments import RUNS_ENV

    runs = Path(tempfile.mkdtemp(prefix="labkit-nbval-"))
    os.environ[RUNS_ENV] = str(runs)  # inherited by the kernels nbval starts
    config.labkit_notebook_runs = runs
