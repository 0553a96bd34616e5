"""Run model-written Python against test cases in a sandboxed process, and score it.

`run_program(code, tests)` runs one program in a fresh interpreter and says whether every
test passed; `code_reward` is the same check as a reward function in TRL's form,
`fn(completions, tests=..., **kwargs) -> list[float]`, like those of `labkit.rewards`.

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
"""

from __future__ import annotations

import argparse
import inspect
import json
import marshal
import math
import numbers
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from labkit.rewards import completion_text, per_completion

DEFAULT_TIMEOUT = 5.0  # seconds of wall-clock time per program, interpreter start-up included
DEFAULT_MEMORY_MB = 512  # address space of the child (RLIMIT_AS)
MIN_MEMORY_MB = 64  # the interpreter alone needs about 15 MiB of address space
FILE_SIZE_MB = 16  # the largest file a program may write (RLIMIT_FSIZE)
OPEN_FILES = 64  # file descriptors a program may hold (RLIMIT_NOFILE)
OUTPUT_LIMIT = 16 * 1024  # bytes kept of stdout and of stderr: the last ones
REPORT_LIMIT = 64 * 1024  # more than this on the report pipe is a program writing to it
SANDBOX_UID = 65534  # "nobody": the user a root caller's programs run as, when possible
STATUSES = ("passed", "failed", "error", "timeout", "memory", "blocked")

# extension modules whose functions reach the system without an audit event, or load
# native code; the short name is checked, so "x._ctypes" is refused too
BLOCKED_MODULES = ("ctypes", "_ctypes", "_posixsubprocess", "_posixshmem", "_multiprocessing",
                   "_sqlite3", "_tkinter", "readline", "spwd", "ossaudiodev", "nis", "syslog",
                   "_dbm", "_gdbm")
BLOCKED_PREFIXES = ("_test", "_xx", "xxlimited")  # CPython's test and experimental modules


@dataclass(frozen=True)
class ExecResult:
    """What happened to one program.

    status is one of STATUSES: "passed" (every test ran without an exception), "failed" (a
    test raised, usually an AssertionError), "error" (the program did not compile, raised,
    or exited before the tests finished), "timeout" (wall-clock or CPU limit), "memory"
    (MemoryError under the address-space limit) or "blocked" (the sandbox refused something
    the program tried, whatever happened next). detail says why in one line; stdout and
    stderr are the last OUTPUT_LIMIT bytes of each; seconds is the wall-clock time.
    """

    status: str
    detail: str
    stdout: str
    stderr: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass(frozen=True)
class _Limits:
    timeout: float
    memory_mb: int
    cpu_s: int


@dataclass(frozen=True)
class _Launch:
    """How to start the interpreter: a command that wraps it (unshare), the user Popen
    switches to (or None), the uid the program runs as, and whether it has its own network
    namespace."""

    prefix: tuple[str, ...]
    popen_user: int | None
    uid: int
    network_namespace: bool


# ----------------------------------------------------------------------------- arguments

def _limits(timeout, memory_mb, cpu_s) -> _Limits:
    """Validated limits; the CPU limit defaults to the timeout, rounded up to whole seconds
    (setrlimit counts whole seconds)."""
    if (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
            or not math.isfinite(timeout) or timeout <= 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < MIN_MEMORY_MB:
        raise ValueError(f"memory_mb must be an integer >= {MIN_MEMORY_MB} (MiB of address "
                         f"space), got {memory_mb!r}")
    if cpu_s is None:
        cpu_s = timeout
    if (isinstance(cpu_s, bool) or not isinstance(cpu_s, numbers.Real)
            or not math.isfinite(cpu_s) or cpu_s <= 0):
        raise ValueError(f"cpu_s must be a finite number of seconds > 0 or None, got {cpu_s!r}")
    return _Limits(float(timeout), memory_mb, math.ceil(cpu_s))


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
                python: str | None = None) -> ExecResult:
    """Run `code`, then each test of `tests` in the program's namespace, in a sandboxed
    interpreter (see the module docstring); return what happened as an ExecResult.

    `tests` is a string (one test, e.g. several assert lines) or a list of strings (one
    test each). The program runs as a module named `__solution__`, so a
    `if __name__ == "__main__":` block does not run; stdin is empty. `timeout` is the
    wall-clock limit in seconds, `memory_mb` the address-space limit in MiB, `cpu_s` the CPU
    limit (default: the timeout). `python` is the interpreter to run (default: this one);
    only its standard library is used. Bad arguments raise ValueError naming the argument.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a string of Python, got {type(code).__name__}")
    return _run(code, _test_sources(tests), _limits(timeout, memory_mb, cpu_s),
                python or sys.executable)


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
                **kwargs) -> list[float]:
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
    """
    per_completion(tests, "tests", completions,
                   missing="code_reward needs the test cases as the keyword `tests` (one entry "
                           "per completion: a string or a list of strings of Python), e.g. a "
                           "dataset column named 'tests'")
    cases = [_test_sources(t, f"tests[{i}]") for i, t in enumerate(tests)]
    limits = _limits(timeout, memory_mb, cpu_s)
    python = python or sys.executable

    def score(i: int) -> float:
        text = completion_text(completions[i])
        if not text or not text.strip():
            return 0.0
        return 1.0 if _run(extract_code(text), cases[i], limits, python).passed else 0.0

    with ThreadPoolExecutor(max_workers=_workers(workers)) as pool:
        return list(pool.map(score, range(len(completions))))


def make_code_reward(*, timeout: float = DEFAULT_TIMEOUT, memory_mb: int = DEFAULT_MEMORY_MB,
                     cpu_s: float | None = None, workers: int = 1,
                     python: str | None = None) -> Callable[..., list[float]]:
    """`code_reward` with its settings fixed, for `GRPOTrainer(reward_funcs=...)`, which
    passes only the completions and the dataset's columns. Named `code_reward`, the name
    TRL logs it under. The settings are checked now."""
    _limits(timeout, memory_mb, cpu_s)
    _workers(workers)

    def bound_code_reward(completions: Sequence, tests: Sequence | None = None, **kwargs):
        return code_reward(completions, tests, timeout=timeout, memory_mb=memory_mb,
                           cpu_s=cpu_s, workers=workers, python=python, **kwargs)

    bound_code_reward.__name__ = bound_code_reward.__qualname__ = "code_reward"
    return bound_code_reward


def isolation(python: str | None = None) -> dict:
    """What the kernel adds around the programs on this machine, for `python` (default: this
    interpreter): the uid they run as and whether they get their own network namespace.
    Found once per interpreter by trying the strongest setup first."""
    launch = _launcher(python or sys.executable)
    return {"python": python or sys.executable, "uid": launch.uid,
            "network_namespace": launch.network_namespace}


# ------------------------------------------------------------------- launching a child

def _child_env(workdir: str) -> dict[str, str]:
    """The whole environment of a child: nothing of the caller's, so no secrets."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


def _candidates() -> list[_Launch]:
    """Ways to start a child, strongest first. As root: a network namespace and uid 65534,
    then uid 65534 alone (Popen drops it), then a network namespace as root. Otherwise: a
    user and network namespace (`unshare --map-current-user`). Last, a plain process."""
    unshare = shutil.which("unshare", path="/usr/bin:/bin")
    me = os.geteuid()
    options = []
    if me == 0:
        if unshare:
            options.append(_Launch((unshare, "--net", f"--setgid={SANDBOX_UID}",
                                    f"--setuid={SANDBOX_UID}", "--"), None, SANDBOX_UID, True))
        options.append(_Launch((), SANDBOX_UID, SANDBOX_UID, False))
        if unshare:
            options.append(_Launch((unshare, "--net", "--"), None, 0, True))
    elif unshare:
        options.append(_Launch((unshare, "--net", "--map-current-user", "--"), None, me, True))
    options.append(_Launch((), None, me, False))
    return options


def _popen_user(launch: _Launch) -> dict:
    """Popen's keywords that switch the child to launch.popen_user, with no extra groups."""
    if launch.popen_user is None:
        return {}
    return {"user": launch.popen_user, "group": launch.popen_user, "extra_groups": []}


def _works(launch: _Launch, python: str) -> bool:
    """Whether `python` starts this way and runs as the expected uid (an unprivileged user
    cannot run an interpreter installed under a private home directory, for instance)."""
    try:
        done = subprocess.run([*launch.prefix, python, "-I", "-S", "-c",
                               "import os; print(os.geteuid())"],
                              capture_output=True, text=True, cwd="/", env=_child_env("/"),
                              timeout=30, **_popen_user(launch))
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.strip() == str(launch.uid)


@lru_cache(maxsize=None)
def _launcher(python: str) -> _Launch:
    """The strongest way to start `python` that works here, found once per interpreter."""
    for launch in _candidates():
        if _works(launch, python):
            return launch
    raise RuntimeError(f"cannot start the interpreter {python!r} for the sandbox")


# what `python -c` runs in the child: the compiled _child_* functions, then the job, on stdin
_CHILD_STUB = "import marshal, sys; exec(marshal.load(sys.stdin.buffer))"


def _child_source() -> str:
    """The program the sandboxed interpreter runs: the _child_* functions below."""
    functions = (_child_disable, _child_limit, _child_install_guard, _child_describe,
                 _child_run, _child_main)
    return "\n\n".join(inspect.getsource(f) for f in functions) + "\n\n_child_main()\n"


@lru_cache(maxsize=None)
def _child_code(python: str) -> bytes:
    """The child's program compiled by `python` itself (its own bytecode format), once per
    interpreter: compiling it in every child would add about 5 ms to each run."""
    compiler = ("import marshal, sys; sys.stdout.buffer.write(marshal.dumps("
                "compile(sys.stdin.read(), '<labkit sandbox>', 'exec')))")
    done = subprocess.run([python, "-I", "-S", "-B", "-c", compiler], cwd="/",
                          input=_child_source().encode(), capture_output=True,
                          env=_child_env("/"), timeout=60, check=True)
    return done.stdout


def _run(code: str, tests: tuple[str, ...], limits: _Limits, python: str) -> ExecResult:
    """Run one program in a temporary working directory that is removed afterwards."""
    launch = _launcher(python)
    workdir = tempfile.mkdtemp(prefix="labkit-sandbox-")
    try:
        if launch.uid != os.geteuid():
            os.chown(workdir, launch.uid, launch.uid)
        return _execute(code, tests, limits, python, launch, os.path.realpath(workdir))
    finally:
        _remove_tree(workdir)


def _execute(code: str, tests: tuple[str, ...], limits: _Limits, python: str,
             launch: _Launch, workdir: str) -> ExecResult:
    nonce = secrets.token_hex(16)
    report_read, report_write = os.pipe()
    job = marshal.dumps({
        "code": code, "tests": tests, "nonce": nonce, "report_fd": report_write,
        "workdir": workdir, "memory_mb": limits.memory_mb, "cpu_s": limits.cpu_s,
        "file_size_mb": FILE_SIZE_MB, "open_files": OPEN_FILES,
        "blocked_modules": BLOCKED_MODULES, "blocked_prefixes": BLOCKED_PREFIXES}, 4)
    argv = [*launch.prefix, python, "-I", "-S", "-B", "-c", _CHILD_STUB]
    started = time.monotonic()
    try:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=workdir, env=_child_env(workdir),
                                    start_new_session=True, pass_fds=(report_write,),
                                    **_popen_user(launch))
        finally:
            os.close(report_write)
        with proc:
            streams = _communicate(proc, _child_code(python) + job, report_read,
                                   started + limits.timeout)
            returncode = proc.wait()
    finally:
        os.close(report_read)
    stdout, stderr, report, timed_out = streams
    status, detail = _verdict(report, nonce, timed_out, returncode, stderr, limits)
    return ExecResult(status, detail, _text(stdout), _text(stderr), time.monotonic() - started)


def _communicate(proc: subprocess.Popen, job: bytes, report_fd: int,
                 deadline: float) -> tuple[bytes, bytes, bytes | None, bool]:
    """Write the job to the child's stdin and read its stdout, stderr and report pipe until
    it exits or the deadline passes; then kill its process group. Returns the tails of
    stdout and stderr, the report (None if the program flooded the pipe) and whether the
    deadline passed."""
    stdin_fd = proc.stdin.fileno()
    outputs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(),
               report_fd: bytearray()}
    flooded = False
    pending = memoryview(job)
    with selectors.DefaultSelector() as selector:
        os.set_blocking(stdin_fd, False)
        selector.register(stdin_fd, selectors.EVENT_WRITE)
        for fd in outputs:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(max(0.0, deadline - time.monotonic())):
                if key.fd == stdin_fd:
                    pending = _feed(stdin_fd, pending)
                    if not pending:
                        selector.unregister(stdin_fd)
                        proc.stdin.close()
                    continue
                chunk = _read_some(key.fd)
                if chunk is None:
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                elif key.fd == report_fd:
                    flooded = flooded or len(outputs[key.fd]) + len(chunk) > REPORT_LIMIT
                    if not flooded:
                        outputs[key.fd] += chunk
                else:
                    _keep_tail(outputs[key.fd], chunk)
        timed_out = bool(selector.get_map()) or not _exited(proc.pid, deadline)
    _kill_group(proc.pid)
    report = None if flooded else bytes(outputs[report_fd])
    return (bytes(outputs[proc.stdout.fileno()]), bytes(outputs[proc.stderr.fileno()]),
            report, timed_out)


def _feed(fd: int, pending: memoryview) -> memoryview:
    """Write what the pipe takes now; a child that is gone takes nothing more."""
    try:
        return pending[os.write(fd, pending[:65536]):]
    except BlockingIOError:
        return pending
    except OSError:  # BrokenPipeError: the child exited before reading its job
        return pending[:0]


def _read_some(fd: int) -> bytes | None:
    """What the pipe holds now: b"" at end of file, None when nothing is ready after all."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None


def _keep_tail(buffer: bytearray, chunk: bytes) -> None:
    """Append, keeping only the last OUTPUT_LIMIT bytes (a traceback ends a stream)."""
    buffer += chunk
    if len(buffer) > OUTPUT_LIMIT:
        del buffer[:-OUTPUT_LIMIT]


def _exited(pid: int, deadline: float) -> bool:
    """Wait until the child has exited or the deadline passes, without reaping it: while it
    is a zombie its pid, which is also its process group's id, cannot be reused, so the
    group can still be killed safely."""
    delay = 0.0005
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.01)


def _kill_group(pgid: int) -> None:
    """SIGKILL every process left in the child's process group."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_tree(path: str) -> None:
    """Remove a working directory, even one whose program took away its own permissions:
    each folder is made accessible before the walk enters it (links are left alone)."""
    os.chmod(path, 0o700)
    for folder, subfolders, _ in os.walk(path):
        for name in subfolders:
            full = os.path.join(folder, name)
            if not os.path.islink(full):
                os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _verdict(report: bytes | None, nonce: str, timed_out: bool, returncode: int,
             stderr: bytes, limits: _Limits) -> tuple[str, str]:
    """(status, detail) of a finished child: a refused action first, then the deadline,
    then the outcome the child reported with the right token, then how it ended."""
    if report is None:
        return "error", f"the program wrote more than {REPORT_LIMIT} bytes to the report pipe"
    lines = _text(report).splitlines()
    blocked = [line.split("\t", 1)[1] for line in lines if line.startswith("blocked\t")]
    if blocked:
        more = f" (and {len(blocked) - 1} more)" if len(blocked) > 1 else ""
        return "blocked", f"the sandbox refused {blocked[0]}{more}"
    if timed_out:
        return "timeout", f"no result within the {limits.timeout:g} s wall-clock limit"
    outcomes = [line[len(nonce) + 1:] for line in lines if line.startswith(nonce + "\t")]
    if outcomes:
        status, _, detail = outcomes[-1].partition("\t")
        if status in STATUSES:
            return status, detail
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout", f"the {limits.cpu_s} s CPU-time limit was reached"
    if b"MemoryError" in stderr:
        return "memory", "the program ran out of memory"
    if returncode < 0:
        return "error", f"the program was killed by signal {-returncode}"
    return "error", f"the program exited (code {returncode}) before the tests finished"


# ------------------------------------------------------- the child, inside the sandbox
#
# The functions below run in the sandboxed interpreter, shipped there by source: they may
# use the standard library only, and none of the names above. Once the audit hook is in,
# everything the sandbox relies on is held in local variables and closures taken before
# the program runs, since the program can rebind any module attribute or builtin.

def _child_disable(job: dict) -> None:
    """Replace the functions that reach the system without raising an audit event, after
    loading every built-in module and removing `_imp.create_builtin`, which would otherwise
    build fresh copies of `posix` and `_signal` with the originals."""
    import _imp
    import os
    import posix
    import sys
    blocked, prefixes = job["blocked_modules"], job["blocked_prefixes"]
    for name in sys.builtin_module_names:
        if name not in blocked and not name.startswith(prefixes):
            __import__(name)
    import _posixsubprocess
    import _signal
    del _imp.create_builtin
    audit, refuse = sys.audit, PermissionError

    def stub(name: str):
        def denied(*args, **kwargs):
            audit("labkit.sandbox.denied", name)
            raise refuse(f"sandbox: {name} is not allowed")
        return denied

    replaced = {os: ("mknod", "mkfifo", "chroot", "pidfd_open", "setns", "unshare"),
                posix: ("mknod", "mkfifo", "chroot", "pidfd_open", "setns", "unshare"),
                _signal: ("pidfd_send_signal",), _posixsubprocess: ("fork_exec",)}
    for module, names in replaced.items():
        for name in names:
            if hasattr(module, name):
                setattr(module, name, stub(f"{module.__name__}.{name}"))


def _child_limit(job: dict) -> None:
    """Resource limits, soft and hard alike, so the program cannot raise them again."""
    import resource
    mib = 1 << 20
    limits = {resource.RLIMIT_AS: job["memory_mb"] * mib,
              resource.RLIMIT_FSIZE: job["file_size_mb"] * mib,
              resource.RLIMIT_NOFILE: job["open_files"],
              resource.RLIMIT_NPROC: 0,  # no fork, no thread, except for root
              resource.RLIMIT_CORE: 0}
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))
    # SIGXCPU at the soft limit ends the process; SIGKILL a second later if it is caught
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_s"], job["cpu_s"] + 1))


def _child_install_guard(job: dict) -> None:
    """Add the audit hook that enforces the sandbox's rules. Every refusal writes a
    `blocked` line to the report pipe, then raises PermissionError in the program.

    The hook runs nothing the program can change: the functions and types it calls are
    bound here, paths are copied to exact str before use, and the file rules resolve
    symbolic links with lstat and readlink, not with os.path.
    """
    import posix
    import sys
    import types
    from _thread import get_ident

    lstat, readlink, getcwd, write = posix.lstat, posix.readlink, posix.getcwd, posix.write
    open_fd, read_fd, close_fd = posix.open, posix.read, posix.close
    o_rdonly, dir_type, link_type, af_unix = posix.O_RDONLY, 0o040000, 0o120000, 1
    write_flags = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
    is_instance, exact_type, bytes_, str_, int_, tuple_, memoryview_ = (
        isinstance, type, bytes, str, int, tuple, memoryview)
    refuse, os_error, value_error = PermissionError, OSError, ValueError
    get_frame, coroutine_code = sys._getframe, types.coroutine.__code__
    code_type, function_type = type(coroutine_code), types.FunctionType
    report_fd = job["report_fd"]
    blocked, prefixes = frozenset(job["blocked_modules"]), tuple(job["blocked_prefixes"])
    denied_events = frozenset({
        "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen",
        "pty.spawn", "os.kill", "os.killpg", "os.link", "os.symlink", "resource.setrlimit",
        "resource.prlimit", "sys.settrace", "sys.setprofile", "sys._current_frames",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents", "marshal.load",
        "cpython.PyInterpreterState_New", "webbrowser.open",
        "sys.monitoring.register_callback"})  # the last one exists from Python 3.12
    denied_prefixes = ("socket.", "ctypes.", "syslog.", "sqlite3.")
    # event -> (index of the path, index of its dir_fd or None), for each path it names
    write_events = {"os.mkdir": ((0, 2),), "os.rmdir": ((0, 1),), "os.remove": ((0, 1),),
                    "os.rename": ((0, 2), (1, 3)), "os.chmod": ((0, 2),),
                    "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),),
                    "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
                    "os.chdir": ((0, None),)}
    read_events = {"os.listdir": ((0, None),), "os.scandir": ((0, None),),
                   "os.getxattr": ((0, None),), "os.listxattr": ((0, None),)}

    def text(value):
        """An exact str copy of a str or bytes (no method of a subclass runs), else None."""
        if is_instance(value, str_):
            return str_.__str__(value)
        if is_instance(value, bytes_):
            return bytes_.decode(value, "utf-8", "surrogateescape")
        return None

    def canonical(path: str):
        """The absolute path without symbolic links, None if it cannot be known. Parts that
        do not exist yet are kept as they are."""
        pending, done, hops = path.split("/"), [], 0
        while pending:
            part = pending.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            candidate = "/" + "/".join(done + [part])
            try:
                mode = lstat(candidate).st_mode
            except os_error:
                done.append(part)
                continue
            if mode & 0o170000 != link_type:
                done.append(part)
                continue
            hops += 1
            if hops > 40:
                return None
            target = readlink(candidate)
            if target.startswith("/"):
                done = []
            pending = target.split("/") + pending
        return "/" + "/".join(done)

    def resolve(value, dir_fd=None):
        """Where a path argument points, or None when that cannot be told safely: not a str
        or bytes (a PathLike could answer differently twice), a NUL, or a `..` part (a
        directory renamed while the kernel walks the path could lead outside)."""
        path = "." if value is None else text(value)
        if path is None or "\0" in path or ".." in path.split("/"):
            return None
        if path.startswith("/"):
            return canonical(path)
        try:
            if dir_fd is None or (exact_type(dir_fd) is int_ and dir_fd < 0):
                base = getcwd()
            elif exact_type(dir_fd) is int_:
                base = readlink("/proc/self/fd/" + str_(dir_fd))
            else:
                return None
        except os_error:
            return None
        return canonical(base + "/" + path)

    def under(path: str, roots) -> bool:
        for root in roots:
            if path == root or path.startswith(root + "/"):
                return True
        return False

    def is_dir(path: str) -> bool:
        try:
            return lstat(path).st_mode & 0o170000 == dir_type
        except os_error:
            return False

    work = canonical(job["workdir"])
    code_roots = tuple_(r for r in (canonical(p) for p in sys.path if text(p)) if r != "/")
    extension_dirs = frozenset(code_roots)
    devices = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
    zoneinfo = ("/usr/share/zoneinfo", "/usr/lib/zoneinfo", "/usr/share/lib/zoneinfo",
                "/etc/zoneinfo")
    read_roots = (work,) + code_roots + devices + zoneinfo
    last_bytecode = {}  # thread -> the standard-library .pyc it opened last

    def deny(what: str):
        line = "blocked\t" + what.replace("\t", " ").replace("\n", " ")[:300] + "\n"
        try:
            write(report_fd, line.encode("utf-8", "replace"))
        except os_error:
            pass
        raise refuse("sandbox: " + what + " is not allowed")

    def require(event: str, value, dir_fd, roots, what: str):
        if is_instance(value, int_):  # an open file descriptor
            return
        path = resolve(value, dir_fd)
        if path is None or not under(path, roots):
            deny(f"{event} of {text(value)!r} ({what})")

    def check_open(args):
        value, flags = args[0], args[2]
        if is_instance(value, int_):
            return
        if exact_type(flags) is not int_:
            deny("open with unusual flags")
        path = resolve(value)
        if flags & write_flags:
            if path is None or not under(path, (work,)):
                deny(f"writing {text(value)!r} (outside the working directory)")
            return
        if path is None or not under(path, read_roots):
            deny(f"reading {text(value)!r} (outside the working directory and the "
                 f"standard library)")
        if is_dir(path) and not under(path, (work,)):
            deny(f"opening the directory {path!r} (a descriptor outside the working "
                 f"directory)")
        if path.endswith(".pyc") and under(path, code_roots):
            last_bytecode[get_ident()] = path

    def check_import(args):
        name = text(args[0]) or ""
        short = name.rpartition(".")[2]
        if short in blocked or short.startswith(prefixes):
            deny(f"import of {name}")
        if args[1] is None:
            return
        path = resolve(args[1])  # an extension module: native code
        if path is None:
            deny(f"loading the extension module {text(args[1])!r}")
        folder, _, file = path.rpartition("/")
        stem = file.partition(".")[0]
        if stem in blocked or stem.startswith(prefixes) or folder not in extension_dirs:
            deny(f"loading the extension module {path!r}")

    def check_bytecode(args):
        """marshal.loads only of the .pyc the import system just read from the standard
        library: bytecode made by hand can crash the interpreter and remove this hook."""
        data = args[0]
        if exact_type(data) is memoryview_:
            data = memoryview_.tobytes(data)
        path = last_bytecode.pop(get_ident(), None)
        if exact_type(data) is not bytes_ or path is None:
            deny("marshal.loads of bytecode that is not the standard library's")
        fd = open_fd(path, o_rdonly)
        try:
            chunks = []
            while True:
                chunk = read_fd(fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            close_fd(fd)
        if b"".join(chunks)[16:] != data:
            deny("marshal.loads of bytecode that is not the standard library's")

    def from_coroutine_decorator() -> bool:
        """Whether the event comes from types.coroutine (asyncio uses it), the one place in
        the standard library that rebuilds a code object: it adds a flag to the code of a
        real function. Its locals are checked too, since an object posing as a function
        could bring flags of its own."""
        try:
            frame = get_frame(3)  # 0 this function, 1 check, 2 guard
        except value_error:
            return False
        if frame.f_code is not coroutine_code:
            return False
        local = frame.f_locals
        return (exact_type(local.get("func")) is function_type
                and exact_type(local.get("co")) is code_type)

    def check(event: str, args):
        if event == "socket.__new__" and exact_type(args[1]) is int_ and args[1] == af_unix:
            return  # a Unix socket that cannot connect, bind or sendto (asyncio's self-pipe)
        if event in denied_events or event.startswith(denied_prefixes):
            deny(event)
        elif event == "open":
            check_open(args)
        elif event in write_events:
            for index, dir_index in write_events[event]:
                dir_fd = None if dir_index is None else args[dir_index]
                require(event, args[index], dir_fd, (work,), "outside the working directory")
        elif event in read_events:
            for index, dir_index in read_events[event]:
                require(event, args[index], None, read_roots,
                        "outside the working directory and the standard library")
        elif event == "import":
            check_import(args)
        elif event == "marshal.loads":
            check_bytecode(args)
        elif event == "code.__new__" and not from_coroutine_decorator():
            deny("making a code object")
        elif (event == "object.__setattr__" and text(args[1]) == "__code__"
              and not from_coroutine_decorator()):
            deny("replacing a function's __code__")
        elif event == "labkit.sandbox.denied":
            deny(text(args[0]) or "?")

    inside = set()  # threads running the hook: its own calls raise events too

    def guard(event, args):
        me = get_ident()
        if me in inside:
            return
        inside.add(me)
        try:
            check(str_.__str__(event), args)
        finally:
            inside.discard(me)

    sys.addaudithook(guard)


def _child_describe(exc: BaseException) -> str:
    """`Type: message` of an exception, on one line and short, whatever its __str__ does."""
    try:
        message = f"{type(exc).__name__}: {exc}"
    except BaseException:
        message = "an exception that cannot be printed"
    return message.replace("\t", " ").replace("\n", " ")[:500]


def _child_run(source: str, tests: tuple) -> tuple:
    """Run the program, then each compiled test in its namespace: (status, detail)."""
    run, build, describe, count = exec, compile, _child_describe, enumerate
    out_of_memory, any_error = MemoryError, BaseException
    namespace = {"__name__": "__solution__"}
    try:
        program = build(source, "<solution>", "exec")
    except out_of_memory:
        return "memory", "the program ran out of memory while compiling"
    except any_error as exc:
        return "error", "the program does not compile: " + describe(exc)
    try:
        run(program, namespace)
    except out_of_memory:
        return "memory", "the program ran out of memory"
    except any_error as exc:
        return "error", "the program raised " + describe(exc)
    for i, test in count(tests):
        try:
            run(test, namespace)
        except out_of_memory:
            return "memory", f"test {i} ran out of memory"
        except any_error as exc:
            return "failed", f"test {i}: " + describe(exc)
    return "passed", ""


def _child_main() -> None:
    """Read the job from stdin, lock the process down, run the program and its tests, and
    write the token and the outcome to the report pipe, then exit at once."""
    import marshal
    import os
    import sys
    job = marshal.load(sys.stdin.buffer)  # it follows the compiled program on stdin
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    tests = tuple(compile(t, f"<test {i}>", "exec") for i, t in enumerate(job["tests"]))
    _child_disable(job)
    _child_limit(job)
    _child_install_guard(job)
    write, exit_now, any_error = os.write, os._exit, BaseException
    flushes = (sys.stdout.flush, sys.stderr.flush)
    nonce, report_fd = job["nonce"], job["report_fd"]
    status, detail = _child_run(job["code"], tests)
    for flush in flushes:
        try:
            flush()
        except any_error:
            pass
    write(report_fd, (nonce + "\t" + status + "\t" + detail + "\n").encode("utf-8", "replace"))
    exit_now(0)


# --------------------------------------------------------------------------- throughput

def main(argv: list[str] | None = None) -> int:
    """Throughput: run N small correct programs with 1 and 2 workers, print samples per
    second; the last line is a JSON object."""
    parser = argparse.ArgumentParser(prog="python -m labkit.sandbox", description=main.__doc__)
    parser.add_argument("--samples", type=int, default=200, help="programs per run (200)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="worker counts to measure (1 2)")
    args = parser.parse_args(argv)
    completions = [f"```python\ndef add(a, b):\n    return a + b + {i} - {i}\n```"
                   for i in range(args.samples)]
    tests = [["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]] * args.samples
    summary = {"samples": args.samples, **isolation()}
    for workers in args.workers:
        started = time.perf_counter()
        rewards = code_reward(completions, tests=tests, workers=workers)
        elapsed = time.perf_counter() - started
        if sum(rewards) != args.samples:
            print(f"error: only {sum(rewards):g} of {args.samples} correct programs passed",
                  file=sys.stderr)
            return 1
        summary[f"samples_per_s_workers_{workers}"] = round(args.samples / elapsed, 1)
        print(f"workers={workers}: {args.samples} programs in {elapsed:.2f} s, "
              f"{args.samples / elapsed:.1f} samples/s")
    print(json.dumps(summary))
    return 0

