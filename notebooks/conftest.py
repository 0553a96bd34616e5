"""Under `pytest --nbval-lax notebooks/`, the notebooks write their runs (run_dir left
empty) into one temporary folder instead of the project's experiments/runs/.
tests/test_notebooks.py, named after notebooks/ on the same command line (as CI does),
then checks those runs' summaries instead of executing every notebook a second time."""

import os
import tempfile
from pathlib import Path

from labkit.lab.experiments import RUNS_ENV


def pytest_configure(config):
    runs = Path(tempfile.mkdtemp(prefix="labkit-nbval-"))
    os.environ[RUNS_ENV] = str(runs)  # inherited by the kernels nbval starts
    config.labkit_notebook_runs = runs
