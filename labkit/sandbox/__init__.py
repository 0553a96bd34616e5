"""Run model-written Python against test cases in a sandboxed process, and score it.

`run_program(code, tests)` runs one program in a fresh interpreter and says whether every
test passed; `code_reward` is the same check as a reward function in TRL's form,
`fn(completions, tests=..., **kwargs) -> list[float]`, like those of `labkit.problems.rewards`.

Each program gets its own process, started from nothing the caller holds:

- a fresh `python -I -S -B` (isolated mode: no site-packages, no user paths, no PYTHON*
  variables, no bytecode written), in a new session and process group, killed as a group;
- an empty temporary working directory, made for the program and removed afterwards;
- an environment of four variables (PATH, LANG, HOME and TMPDIR), none of the caller's;
- a wall-clock timeout, and limits set with setrlimit before the program runs: CPU time,
  address space, file size, open files, no core dumps, and no new processes (RLIMIT_NPROC,
  which the kernel does not enforce for root);
- when the machine allows it, a network namespace of its own (`unshare --net`: no interface
  but a loopback that is down) and, for a root caller, the unprivileged user 65534;
- inside the interpreter, an audit hook (`sys.addaudithook`; it cannot be removed) that
  refuses process creation, signals to other processes, sockets, native code (ctypes,
  extension modules from outside the standard library), hand-made bytecode, tracing, raising
  the limits, writing outside the working directory and reading outside it and the standard
  library. Functions that raise no audit event (`os.mknod`, `os.mkfifo`, `os.chroot`,
  `os.pidfd_open`, `signal.pidfd_send_signal`, `_posixsubprocess.fork_exec`) are replaced.

The audit hook is a guard rail inside the process, not a security boundary: see
docs/sandbox.md for what each layer stops and what it does not.

How a run is judged: the parent sends the sandbox's own code (compiled once per
interpreter), then the program, the tests and a random token, on stdin. The child runs the
program, then each test in the program's namespace, and only then writes the token and the
outcome to a pipe of its own. A program that exits early (sys.exit, os._exit, a signal)
never writes the token, so it cannot pass by leaving before the tests.

The modules: `launch` starts the child and collects its output, `child` is the program
the sandboxed interpreter runs, `policy` holds the rules it enforces as tables, `verdict`
turns what happened into an ExecResult. This module is the public API.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from labkit.answers import completion_text
from labkit.checks import per_completion
from labkit.formulas import stats
from labkit.sandbox import launch
from labkit.sandbox.launch import (DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT, FILE_SIZE_MB, MIN_MEMORY_MB,
                                   OPEN_FILES, SANDBOX_UID, check_limits)
from labkit.sandbox.policy import BLOCKED_MODULES, BLOCKED_PREFIXES
from labkit.sandbox.verdict import OUTPUT_LIMIT, REPORT_LIMIT, STATUSES, ExecResult

__all__ = ["run_program", "code_reward", "make_code_reward", "extract_code", "isolation",
           "main", "ExecResult", "STATUSES", "DEFAULT_TIMEOUT", "DEFAULT_MEMORY_MB",
           "MIN_MEMORY_MB", "FILE_SIZE_MB", "OPEN_FILES", "OUTPUT_LIMIT", "REPORT_LIMIT",
           "SANDBOX_UID", "BLOCKED_MODULES", "BLOCKED_PREFIXES"]


# ----------------------------------------------------------------------------- arguments

def _test_sources(tests, name: str = "tests") -> tuple[str, ...]:
    """The test cases as a tuple of sources, each checked to compile: a string is one test
    (any number of statements), a list or tuple of strings is one test each. Tests come
    from the dataset, so a broken one raises instead of scoring every completion 0."""
    if isinstance(tests, str):
        tests = (tests,)
    if not isinstance(tests, (list, tuple)):
        raise ValueError(f"{name} must be a string or a list of strings (Python test code), "
                         f"got {type(tests).__name__}")
    if not tests:
        raise ValueError(f"{name} is empty: a program with no test cases would always pass")
    for i, test in enumerate(tests):
        if not isinstance(test, str) or not test.strip():
            raise ValueError(f"{name}[{i}] must be a non-empty string of Python, got {test!r}")
        try:
            compile(test, f"<{name}[{i}]>", "exec")
        except (SyntaxError, ValueError) as exc:
            raise ValueError(f"{name}[{i}] is not valid Python: {exc}") from None
    return tuple(tests)


def _workers(workers) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    return workers


# ------------------------------------------------------------------------- public API

def run_program(code: str, tests: str | Sequence[str], *, timeout: float = DEFAULT_TIMEOUT,
                memory_mb: int = DEFAULT_MEMORY_MB, cpu_s: float | None = None,
                python: str | None = None, sandbox: str | None = None) -> ExecResult:
    """Run `code`, then each test of `tests` in the program's namespace, in a sandboxed
    interpreter (see the module docstring); return what happened as an ExecResult.

    `tests` is a string (one test, e.g. several assert lines) or a list of strings (one
    test each). The program runs as a module named `__solution__`, so a
    `if __name__ == "__main__":` block does not run; stdin is empty. `timeout` is the
    wall-clock limit in seconds, `memory_mb` the address-space limit in MiB, `cpu_s` the CPU
    limit (default: the timeout). `python` is the interpreter to run (default: this one);
    only its standard library is used. Bad arguments raise ValueError naming the argument.

    `sandbox`: "boundary" (the default, or LABKIT_SANDBOX) runs programs behind the
    operating system's boundary and raises RuntimeError, saying what is missing, where this
    machine has none; "hook-only" accepts the audit hook alone there, with a warning.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a string of Python, got {type(code).__name__}")
    limits = check_limits(timeout, memory_mb, cpu_s)
    tests = _test_sources(tests)
    python = python or sys.executable
    launch.require_boundary(python, sandbox)
    return launch.run(code, tests, limits, python)


def extract_code(text: str) -> str:
    """The program in a completion: the last ```python (or ```py) fenced block, else the last
    untagged fenced block, else the whole text. A block left open at the end of the text
    (a completion cut at the token limit) counts, up to the end."""
    blocks = re.findall(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", text, flags=re.DOTALL)
    for wanted in (("python", "py", "python3"), ("",)):
        chosen = [body for tag, body in blocks if tag.lower() in wanted]
        if chosen:
            return chosen[-1]
    return text


def code_reward(completions: Sequence, tests: Sequence | None = None, *,
                timeout: float = DEFAULT_TIMEOUT, memory_mb: int = DEFAULT_MEMORY_MB,
                cpu_s: float | None = None, workers: int = 1, python: str | None = None,
                sandbox: str | None = None, **kwargs) -> list[float]:
    """Code reward: r_i = 1.0 if the program in completion_i passes every test of tests_i
    in the sandbox, else 0.0 (failed, error, timeout, memory or blocked).

    The program is the last ```python block of the completion (`extract_code`); a
    completion is a string or TRL's conversational form. `tests` has one entry per
    completion, a string or a list of strings (see `run_program`), e.g. a dataset column
    named "tests"; TRL's other keywords are ignored. `workers` programs run at a time (each
    in its own process); results come back in the order of `completions`.

    Bad completions never raise: None, empty or non-string completions score 0.0. Bad tests
    do raise ValueError before anything runs: `tests` missing, a length that differs from
    `completions`, or an entry that is empty or does not compile (the message names it).
    Where this machine has no operating-system boundary, RuntimeError before anything runs
    unless `sandbox="hook-only"` (see `run_program`).
    """
    per_completion(tests, "tests", completions,
                   missing="code_reward needs the test cases as the keyword `tests` (one entry "
                           "per completion: a string or a list of strings of Python), e.g. a "
                           "dataset column named 'tests'")
    cases = [_test_sources(t, f"tests[{i}]") for i, t in enumerate(tests)]
    limits = check_limits(timeout, memory_mb, cpu_s)
    python = python or sys.executable
    launch.require_boundary(python, sandbox)

    def score(i: int) -> float:
        text = completion_text(completions[i])
        if not text or not text.strip():
            return 0.0
        return 1.0 if launch.run(extract_code(text), cases[i], limits, python).passed else 0.0

    with ThreadPoolExecutor(max_workers=_workers(workers)) as pool:
        return list(pool.map(score, range(len(completions))))


def make_code_reward(*, timeout: float = DEFAULT_TIMEOUT, memory_mb: int = DEFAULT_MEMORY_MB,
                     cpu_s: float | None = None, workers: int = 1,
                     python: str | None = None,
                     sandbox: str | None = None) -> Callable[..., list[float]]:
    """`code_reward` with its settings fixed, for `GRPOTrainer(reward_funcs=...)`, which
    passes only the completions and the dataset's columns. Named `code_reward`, the name
    TRL logs it under. The settings are checked now."""
    check_limits(timeout, memory_mb, cpu_s)
    _workers(workers)
    launch.require_boundary(python or sys.executable, sandbox)

    def bound_code_reward(completions: Sequence, tests: Sequence | None = None, **kwargs):
        return code_reward(completions, tests, timeout=timeout, memory_mb=memory_mb,
                           cpu_s=cpu_s, workers=workers, python=python, sandbox=sandbox,
                           **kwargs)

    bound_code_reward.__name__ = bound_code_reward.__qualname__ = "code_reward"
    return bound_code_reward


def isolation(python: str | None = None) -> dict:
    """What stands around the programs on this machine, for `python` (default: this
    interpreter): whether they run behind the operating system's boundary (and if not,
    why), the layers in force, the uid they run as and whether they get their own network
    namespace. Found once per interpreter by trying the strongest setup first."""
    python = python or sys.executable
    way = launch.launcher(python)
    return {"python": python, "boundary": way.boundary, "layers": list(way.layers),
            "reason": launch.jail_reason(python), "uid": way.uid,
            "network_namespace": way.network_namespace}


# --------------------------------------------------------------------------- throughput

def main(argv: list[str] | None = None) -> int:
    """Throughput: run N small correct programs with 1 and 2 workers, print samples per
    second; with --compare, behind the boundary and behind the older layers alone, in
    alternating rounds, and the boundary's cost per program with its interval over rounds.
    The last line is a JSON object."""
    parser = argparse.ArgumentParser(prog="python -m labkit.sandbox", description=main.__doc__)
    parser.add_argument("--samples", type=int, default=200, help="programs per run (200)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="worker counts to measure (1 2)")
    parser.add_argument("--compare", action="store_true",
                        help="also measure without the boundary (the older layers and the "
                             "audit hook), round by round")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of every measurement (default 1; 3 or more with --compare)")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.rounds < 1 or any(w < 1 for w in args.workers):
        parser.error("--samples, --rounds and every --workers must be >= 1")
    completions = [f"```python\ndef add(a, b):\n    return a + b + {i} - {i}\n```"
                   for i in range(args.samples)]
    tests = [["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]] * args.samples
    summary = {"samples": args.samples, "rounds": args.rounds, **isolation()}
    ways = {"boundary": launch.launcher(sys.executable)}
    if args.compare:
        older = next(w for w in launch.candidates() if not w.boundary
                     and launch.works(w, sys.executable))
        ways["older layers"] = older
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, way in ways.items():
            launch.launcher.cache_clear()
            for workers in args.workers:
                chosen = way
                original = launch.launcher
                launch.launcher = lambda python, chosen=chosen: chosen
                try:
                    started = time.perf_counter()
                    rewards = code_reward(completions, tests=tests, workers=workers,
                                          sandbox="hook-only" if not way.boundary else None)
                    elapsed = time.perf_counter() - started
                finally:
                    launch.launcher = original
                if sum(rewards) != args.samples:
                    print(f"error: only {sum(rewards):g} of {args.samples} correct programs "
                          "passed", file=sys.stderr)
                    return 1
                rates.setdefault((name, workers), []).append(args.samples / elapsed)
                print(f"{name}, workers={workers}: {args.samples} programs in {elapsed:.2f} s, "
                      f"{args.samples / elapsed:.1f} samples/s")
    for (name, workers), values in rates.items():
        key = "" if name == "boundary" else "_older_layers"
        summary[f"samples_per_s_workers_{workers}{key}"] = [round(v, 1) for v in values]
    if args.compare and args.rounds >= 2:
        for workers in args.workers:  # ms a program costs more behind the boundary
            jail = [1000 / v for v in rates[("boundary", workers)]]
            plain = [1000 / v for v in rates[("older layers", workers)]]
            extra = stats.paired_interval(jail, plain, unit="rounds")
            summary[f"boundary_ms_per_program_workers_{workers}"] = extra.format(2)
            print(f"workers={workers}: the boundary adds {extra.format(2)} ms of wall time per "
                  f"program ({extra.method})")
    print(json.dumps(summary))
    return 0
