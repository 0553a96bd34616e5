"""Starting the sandboxed interpreter and collecting what it did.

One run: a fresh temporary working directory; the strongest way to start the interpreter
that this machine allows (`launcher`); the child (`labkit.sandbox.child`, compiled once per
interpreter) and its job written to its stdin; stdout, stderr and the report pipe read
until it exits or the wall-clock deadline passes; its process group killed; the verdict
(`labkit.sandbox.verdict`); the working directory removed.
"""

from __future__ import annotations

import marshal
import math
import numbers
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

from labkit.sandbox import policy
from labkit.sandbox.verdict import OUTPUT_LIMIT, REPORT_LIMIT, ExecResult, text, verdict

DEFAULT_TIMEOUT = 5.0  # seconds of wall-clock time per program, interpreter start-up included
DEFAULT_MEMORY_MB = 512  # address space of the child (RLIMIT_AS)
MIN_MEMORY_MB = 64  # the interpreter alone needs about 15 MiB of address space
FILE_SIZE_MB = 16  # the largest file a program may write (RLIMIT_FSIZE)
OPEN_FILES = 64  # file descriptors a program may hold (RLIMIT_NOFILE)
SANDBOX_UID = 65534  # "nobody": the user a root caller's programs run as, when possible
CHILD_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")
# what `python -c` runs in the child: the compiled child.py, then the job, on stdin
CHILD_STUB = "import marshal, sys; exec(marshal.load(sys.stdin.buffer))"


@dataclass(frozen=True)
class Limits:
    """The wall-clock limit in seconds, the address space in MiB, the CPU time in seconds."""

    timeout: float
    memory_mb: int
    cpu_s: int


@dataclass(frozen=True)
class Launch:
    """How to start the interpreter: a command that wraps it (unshare), the user Popen
    switches to (or None), the uid the program runs as, and whether it has its own network
    namespace."""

    prefix: tuple[str, ...]
    popen_user: int | None
    uid: int
    network_namespace: bool


def check_limits(timeout, memory_mb, cpu_s) -> Limits:
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
    return Limits(float(timeout), memory_mb, math.ceil(cpu_s))


# ------------------------------------------------------------- how to start the child

def child_env(workdir: str) -> dict[str, str]:
    """The whole environment of a child: nothing of the caller's, so no secrets."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


def candidates() -> list[Launch]:
    """Ways to start a child, strongest first. As root: a network namespace and uid 65534,
    then uid 65534 alone (Popen drops it), then a network namespace as root. Otherwise: a
    user and network namespace (`unshare --map-current-user`). Last, a plain process."""
    unshare = shutil.which("unshare", path="/usr/bin:/bin")
    me = os.geteuid()
    options = []
    if me == 0:
        if unshare:
            options.append(Launch((unshare, "--net", f"--setgid={SANDBOX_UID}",
                                   f"--setuid={SANDBOX_UID}", "--"), None, SANDBOX_UID, True))
        options.append(Launch((), SANDBOX_UID, SANDBOX_UID, False))
        if unshare:
            options.append(Launch((unshare, "--net", "--"), None, 0, True))
    elif unshare:
        options.append(Launch((unshare, "--net", "--map-current-user", "--"), None, me, True))
    options.append(Launch((), None, me, False))
    return options


def popen_user(launch: Launch) -> dict:
    """Popen's keywords that switch the child to launch.popen_user, with no extra groups."""
    if launch.popen_user is None:
        return {}
    return {"user": launch.popen_user, "group": launch.popen_user, "extra_groups": []}


def works(launch: Launch, python: str) -> bool:
    """Whether `python` starts this way and runs as the expected uid (an unprivileged user
    cannot run an interpreter installed under a private home directory, for instance)."""
    try:
        done = subprocess.run([*launch.prefix, python, "-I", "-S", "-c",
                               "import os; print(os.geteuid())"],
                              capture_output=True, text=True, cwd="/", env=child_env("/"),
                              timeout=30, **popen_user(launch))
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.strip() == str(launch.uid)


@lru_cache(maxsize=None)
def launcher(python: str) -> Launch:
    """The strongest way to start `python` that works here, found once per interpreter."""
    for launch in candidates():
        if works(launch, python):
            return launch
    raise RuntimeError(f"cannot start the interpreter {python!r} for the sandbox")


@lru_cache(maxsize=None)
def child_code(python: str) -> bytes:
    """child.py compiled by `python` itself (its own bytecode format), once per interpreter:
    compiling it in every child would add to each run's start. Sent on stdin, it needs
    no read access to this file for the user the child runs as."""
    with open(CHILD_PATH, "rb") as f:
        source = f.read()
    compiler = ("import marshal, sys; sys.stdout.buffer.write(marshal.dumps("
                "compile(sys.stdin.read(), '<labkit sandbox>', 'exec')))")
    done = subprocess.run([python, "-I", "-S", "-B", "-c", compiler], cwd="/",
                          input=source, capture_output=True, env=child_env("/"), timeout=60,
                          check=True)
    return done.stdout


# ------------------------------------------------------------------------- one run

def run(code: str, tests: tuple[str, ...], limits: Limits, python: str) -> ExecResult:
    """Run one program in a temporary working directory that is removed afterwards."""
    launch = launcher(python)
    workdir = tempfile.mkdtemp(prefix="labkit-sandbox-")
    try:
        if launch.uid != os.geteuid():
            os.chown(workdir, launch.uid, launch.uid)
        return execute(code, tests, limits, python, launch, os.path.realpath(workdir))
    finally:
        remove_tree(workdir)


def execute(code: str, tests: tuple[str, ...], limits: Limits, python: str,
            launch: Launch, workdir: str) -> ExecResult:
    nonce = secrets.token_hex(16)
    report_read, report_write = os.pipe()
    job = marshal.dumps({
        "code": code, "tests": tests, "nonce": nonce, "report_fd": report_write,
        "workdir": workdir, "memory_mb": limits.memory_mb, "cpu_s": limits.cpu_s,
        "file_size_mb": FILE_SIZE_MB, "open_files": OPEN_FILES, **policy.tables()}, 4)
    argv = [*launch.prefix, python, "-I", "-S", "-B", "-c", CHILD_STUB]
    started = time.monotonic()
    try:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=workdir, env=child_env(workdir),
                                    start_new_session=True, pass_fds=(report_write,),
                                    **popen_user(launch))
        finally:
            os.close(report_write)
        with proc:
            streams = communicate(proc, child_code(python) + job, report_read,
                                  started + limits.timeout)
            returncode = proc.wait()
    finally:
        os.close(report_read)
    stdout, stderr, report, timed_out = streams
    status, detail = verdict(report, nonce, timed_out, returncode, stderr, limits.timeout,
                             limits.cpu_s)
    return ExecResult(status, detail, text(stdout), text(stderr), time.monotonic() - started)


# ------------------------------------------------------------------ pipes and the group

def communicate(proc: subprocess.Popen, job: bytes, report_fd: int,
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
                    pending = feed(stdin_fd, pending)
                    if not pending:
                        selector.unregister(stdin_fd)
                        proc.stdin.close()
                    continue
                chunk = read_some(key.fd)
                if chunk is None:
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                elif key.fd == report_fd:
                    flooded = flooded or len(outputs[key.fd]) + len(chunk) > REPORT_LIMIT
                    if not flooded:
                        outputs[key.fd] += chunk
                else:
                    keep_tail(outputs[key.fd], chunk)
        timed_out = bool(selector.get_map()) or not exited(proc.pid, deadline)
    kill_group(proc.pid)
    report = None if flooded else bytes(outputs[report_fd])
    return (bytes(outputs[proc.stdout.fileno()]), bytes(outputs[proc.stderr.fileno()]),
            report, timed_out)


def feed(fd: int, pending: memoryview) -> memoryview:
    """Write what the pipe takes now; a child that is gone takes nothing more."""
    try:
        return pending[os.write(fd, pending[:65536]):]
    except BlockingIOError:
        return pending
    except OSError:  # BrokenPipeError: the child exited before reading its job
        return pending[:0]


def read_some(fd: int) -> bytes | None:
    """What the pipe holds now: b"" at end of file, None when nothing is ready after all."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None


def keep_tail(buffer: bytearray, chunk: bytes) -> None:
    """Append, keeping only the last OUTPUT_LIMIT bytes (a traceback ends a stream)."""
    buffer += chunk
    if len(buffer) > OUTPUT_LIMIT:
        del buffer[:-OUTPUT_LIMIT]


def exited(pid: int, deadline: float) -> bool:
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


def kill_group(pgid: int) -> None:
    """SIGKILL every process left in the child's process group."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def remove_tree(path: str) -> None:
    """Remove a working directory, even one whose program took away its own permissions:
    each folder is made accessible before the walk enters it (links are left alone)."""
    os.chmod(path, 0o700)
    for folder, subfolders, _ in os.walk(path):
        for name in subfolders:
            full = os.path.join(folder, name)
            if not os.path.islink(full):
                os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)
