"""labkit's command line run from a test: in this process (`in_process`, for the many
bad-input cases: no interpreter start, torch already imported) or in a fresh Python
(`fresh_process`, for what only a real process shows: its exit code, stdout and stderr as a
user sees them, state that starts empty)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Done:
    """What a command left: the fields of subprocess.CompletedProcess that the tests read."""

    returncode: int
    stdout: str
    stderr: str


def in_process(*args, cwd: str | Path | None = None) -> Done:
    """`python -m labkit ARGS` as `labkit.__main__.main(ARGS)` here; an exception other than
    SystemExit propagates (a traceback fails the test)."""
    from labkit.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    place = contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext()
    with place, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as stop:  # argparse's errors and --help
            code = stop.code if isinstance(stop.code, int) else 1
    return Done(code, out.getvalue(), err.getvalue())


def fresh_process(*args, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """`python -m labkit ARGS` in a new interpreter."""
    return subprocess.run([sys.executable, "-m", "labkit", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
