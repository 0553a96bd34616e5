"""Starting the sandboxed interpreter and collecting what it did.

One run: the strongest way to start the interpreter that this machine allows (`launcher`):
behind the kernel's boundary (`jail.c`, built on first use: namespaces, a read-only view of
the interpreter, a tmpfs work folder, no capabilities, seccomp) where the machine lets it,
else with what the older layers give in a fresh temporary working directory; the child
(`labkit.sandbox.child`, compiled once per interpreter) and its job written to its stdin;
stdout, stderr and the report pipe read until it exits or the wall-clock deadline passes;
its process group killed; the verdict (`labkit.sandbox.verdict`); the working directory
removed.
"""

from __future__ import annotations

import hashlib
import marshal
import math
import numbers
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from labkit import cbuild
from labkit.sandbox import policy
from labkit.sandbox.pipes import communicate, group_gone, remove_tree
from labkit.sandbox.verdict import ExecResult, text, verdict

DEFAULT_TIMEOUT = 5.0  # seconds of wall-clock time per program, interpreter start-up included
DEFAULT_MEMORY_MB = 512  # address space of the child (RLIMIT_AS)
MIN_MEMORY_MB = 64  # the interpreter alone needs about 15 MiB of address space
FILE_SIZE_MB = 16  # the largest file a program may write (RLIMIT_FSIZE)
OPEN_FILES = 64  # file descriptors a program may hold (RLIMIT_NOFILE)
SANDBOX_UID = 65534  # "nobody": the user a root caller's programs run as, when possible
CHILD_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")
# what `python -c` runs in the child: the compiled child.py, then the job, on stdin
CHILD_STUB = "import marshal, sys; CHILD = marshal.load(sys.stdin.buffer); exec(CHILD)"
SUBINTERPRETER = os.environ.get("LABKIT_SUBINTERPRETER", "1").strip().lower() not in (
    "0", "false", "off", "no")
"""The program and its tests run in a subinterpreter of the child (where its Python has
one), so nothing the program can reach holds the report's token (docs/sandbox.md)."""
JAIL_SOURCE = Path(__file__).resolve().parent / "jail.c"
JAIL_WORKDIR = "/work"  # the program's tmpfs working folder inside the jail
WORK_MB = 64  # its size: everything a program writes, together
SYSTEM_READ_ONLY = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin")
"""What the jail shows a program besides the interpreter's own prefix, all read-only: the
system's programs and shared libraries (on merged-/usr systems /lib, /bin are links)."""
BOUNDARY_LAYERS = ("user namespace (uid 65534, no other ids)",
                   "mount namespace: read-only system and interpreter folders, nothing else",
                   "pid namespace", "network namespace (no interfaces)", "IPC namespace",
                   "UTS namespace", "cgroup namespace", f"tmpfs work folder ({WORK_MB} MiB)",
                   "no capabilities, no_new_privs", "seccomp filter", "rlimits", "audit hook")
"""The layers in force behind the jail (docs/sandbox.md)."""
SANDBOX_EXEC = "/usr/bin/sandbox-exec"
SEATBELT_PROFILE = """(version 1)
(deny default)
(import "bsd.sb")
(allow process-exec (subpath (param "PREFIX")))
(allow file-read* (subpath (param "PREFIX")) (subpath "/usr/lib") (subpath "/System/Library")
       (subpath "/Library/Apple/System") (subpath "/private/var/db/dyld")
       (literal "/dev/null") (literal "/dev/urandom") (literal "/dev/random")
       (subpath (param "WORKDIR")))
(allow file-write* (subpath (param "WORKDIR")) (literal "/dev/null"))
(allow sysctl-read)
(deny network*)
(deny process-fork)
"""
"""macOS's boundary (Seatbelt, `sandbox-exec`): deny by default; read the interpreter's
prefix, the system libraries and the work folder; write only the work folder; no network,
no new processes. Untested here (no Mac at hand): docs/sandbox.md."""
HOOK_ONLY = "hook-only"
"""The opt-in to run programs behind the audit hook (and rlimits) alone, where no
operating-system boundary can be set up: `sandbox="hook-only"` or LABKIT_SANDBOX=hook-only."""


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
    namespace; `jail`, the boundary's binary (`jail.c`), when it runs behind it."""

    prefix: tuple[str, ...]
    popen_user: int | None
    uid: int
    network_namespace: bool
    jail: str | None = None
    seatbelt: bool = False
    """macOS: the program runs under `sandbox-exec` with SEATBELT_PROFILE."""

    @property
    def boundary(self) -> bool:
        """Whether the program runs behind the operating system's boundary."""
        return self.jail is not None or self.seatbelt

    @property
    def layers(self) -> tuple[str, ...]:
        """What stands around a program started this way."""
        if self.jail:
            return BOUNDARY_LAYERS
        if self.seatbelt:
            return ("macOS sandbox-exec profile (deny by default; untested)",
                    "temporary working folder", "rlimits", "audit hook")
        found = ["new session and process group", "empty environment",
                 "temporary working folder", "rlimits", "audit hook"]
        if self.network_namespace:
            found.insert(0, "network namespace")
        if self.uid != os.geteuid():
            found.insert(0, f"uid {self.uid}")
        return tuple(found)


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
    """Ways to start a child, strongest first: behind the jail where it builds (a Linux
    machine with a C compiler). Then, as root: a network namespace and uid 65534,
    then uid 65534 alone (Popen drops it), then a network namespace as root. Otherwise: a
    user and network namespace (`unshare --map-current-user`). Last, a plain process."""
    unshare = shutil.which("unshare", path="/usr/bin:/bin")
    me = os.geteuid()
    options = []
    jail = jail_binary()
    if jail is not None:
        options.append(Launch((), None, SANDBOX_UID, True, jail))
    if sys.platform == "darwin" and os.path.exists(SANDBOX_EXEC):
        options.append(Launch((), None, me, True, seatbelt=True))
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
        done = subprocess.run([*command(launch, python, ()), "-c",
                               "import os; print(os.geteuid())"],
                              capture_output=True, text=True, cwd="/", env=child_env("/"),
                              timeout=30, **popen_user(launch))
    except (OSError, subprocess.SubprocessError):
        return False
    if launch.jail and done.returncode != 0:
        _jail_failures[python] = (done.stderr.strip().splitlines() or [""])[-1]
    return done.returncode == 0 and done.stdout.strip() == str(launch.uid)


_jail_failures: dict[str, str] = {}


def command(launch: Launch, python: str, keep_fds: tuple[int, ...],
            workdir: str = "/") -> list[str]:
    """The command line up to the interpreter's flags: the jail with what it shows the
    program (`--ro`) and the file descriptors it keeps, `sandbox-exec` with the profile and
    the folders it may read and write, or the launch's prefix."""
    if launch.seatbelt:
        executable, prefix = interpreter(python)
        return [SANDBOX_EXEC, "-D", f"PREFIX={prefix}", "-D", f"WORKDIR={workdir}",
                "-p", SEATBELT_PROFILE, executable, "-I", "-S", "-B"]
    if not launch.jail:
        return [*launch.prefix, python, "-I", "-S", "-B"]
    executable, prefix = interpreter(python)
    shown = [p for p in SYSTEM_READ_ONLY if os.path.lexists(p)]
    if not any(prefix == p or prefix.startswith(p + "/") for p in shown):
        shown.append(prefix)
    argv = [launch.jail, "--work-mb", str(WORK_MB)]
    for path in shown:
        argv += ["--ro", path]
    for fd in keep_fds:
        argv += ["--keep-fd", str(fd)]
    return [*argv, "--", executable, "-I", "-S", "-B"]


@lru_cache(maxsize=None)
def interpreter(python: str) -> tuple[str, str]:
    """`python`'s real executable and real base prefix (a virtual environment's
    interpreter is a link into its base installation, which holds the standard library)."""
    done = subprocess.run([python, "-I", "-S", "-c", "import os, sys; print(os.path.realpath("
                           "sys.executable)); print(os.path.realpath(sys.base_prefix))"],
                          capture_output=True, text=True, cwd="/", env=child_env("/"),
                          timeout=30, check=True)
    executable, prefix = done.stdout.splitlines()[:2]
    return executable, prefix


_jail_reason: str | None = None


@lru_cache(maxsize=None)
def jail_binary() -> str | None:
    """The jail (jail.c), compiled on first use into the labkit cache folder (like the
    kernels of labkit.fast); None off Linux, without a C compiler or where it fails to
    build (`jail_reason()` says which)."""
    global _jail_reason
    if os.environ.get("LABKIT_JAIL", "1").strip().lower() in ("0", "false", "off", "no"):
        _jail_reason = "turned off by LABKIT_JAIL"
        return None
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        _jail_reason = f"the jail is for Linux on x86-64 or aarch64, this is {sys.platform} " \
                       f"on {platform.machine()}"
        return None
    compiler = cbuild.compiler()
    if compiler is None:
        _jail_reason = "no C compiler (CC, cc, gcc or clang) to build the jail"
        return None
    source = JAIL_SOURCE.read_bytes()
    key = hashlib.sha256(source + compiler.encode()).hexdigest()[:16]
    target = cbuild.cache_root() / "sandbox" / f"labkit-jail-{key}"
    if target.exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        done = subprocess.run([compiler, "-O2", "-o", str(scratch), str(JAIL_SOURCE)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            _jail_reason = f"{compiler} failed to build jail.c: {last}"
            return None
        os.chmod(scratch, 0o755)
        os.replace(scratch, target)
        print(f"labkit.sandbox: built the jail that model-written programs run behind into "
              f"{target} with {compiler}; LABKIT_JAIL=0 turns it off", file=sys.stderr)
    except (OSError, subprocess.SubprocessError) as e:
        _jail_reason = f"could not build jail.c: {e}"
        return None
    finally:
        if scratch.exists():
            scratch.unlink()
    return str(target)


class SandboxUnavailable(RuntimeError):
    """No operating-system boundary for model-written programs on this machine, and no
    opt-in to run without one."""


SANDBOXES = ("boundary", HOOK_ONLY)
_warned_hook_only = False


def require_boundary(python: str, sandbox: str | None) -> None:
    """Stop, with one line saying what is missing, where programs of `python` would run
    without the operating system's boundary, unless the caller opted in to the audit hook
    alone (`sandbox="hook-only"`, or LABKIT_SANDBOX=hook-only), which warns once per
    process. `sandbox` None reads LABKIT_SANDBOX (default "boundary")."""
    global _warned_hook_only

    chosen = sandbox if sandbox is not None else \
        os.environ.get("LABKIT_SANDBOX", "").strip() or "boundary"
    if chosen not in SANDBOXES:
        where = "sandbox" if sandbox is not None else "LABKIT_SANDBOX"
        raise ValueError(f"{where} must be one of {', '.join(SANDBOXES)}, got {chosen!r}")
    if launcher(python).boundary:
        return
    if chosen == HOOK_ONLY:
        if not _warned_hook_only:
            _warned_hook_only = True
            warnings.warn("labkit.sandbox: model-written programs run behind the in-process "
                          f"audit hook alone, no operating-system boundary "
                          f"({jail_reason(python)}): a hostile program can get out",
                          RuntimeWarning, stacklevel=3)
        return
    raise SandboxUnavailable(
        f"labkit.sandbox: no operating-system boundary for model-written programs here: "
        f"{jail_reason(python)}. It needs Linux (x86-64 or aarch64) with unprivileged user "
        "namespaces and a C compiler (cc, gcc or clang; or CC) to build labkit's jail; "
        "sandbox='hook-only' or LABKIT_SANDBOX=hook-only runs programs behind the audit hook "
        f"alone (not a boundary; docs/sandbox.md). Python: {python}" + (
            "" if sys.platform.startswith("linux") else
            ". macOS and Windows are not supported yet"))


def jail_reason(python: str) -> str | None:
    """Why programs of `python` do not run behind the jail, or None where they do."""
    launch = launcher(python)
    if launch.jail:
        return None
    if jail_binary() is None:
        return _jail_reason
    return _jail_failures.get(python) or "the jail did not start the interpreter"


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
    """Run one program: behind the jail in its tmpfs work folder, else in a temporary
    working directory that is removed afterwards."""
    launch = launcher(python)
    if launch.jail:
        return execute(code, tests, limits, python, launch, JAIL_WORKDIR)
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
        "file_size_mb": FILE_SIZE_MB, "open_files": OPEN_FILES, "subinterpreter": SUBINTERPRETER,
        **policy.tables()}, 4)
    argv = [*command(launch, python, (report_write,), workdir), "-c", CHILD_STUB]
    started = time.monotonic()
    try:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE,
                                    cwd="/" if launch.jail else workdir, env=child_env(workdir),
                                    start_new_session=True, pass_fds=(report_write,),
                                    **popen_user(launch))
        finally:
            os.close(report_write)
        with proc:
            streams = communicate(proc, child_code(python) + job, report_read,
                                  started + limits.timeout)
            returncode = proc.wait()
        if launch.jail:
            group_gone(proc.pid)
    finally:
        os.close(report_read)
    stdout, stderr, report, timed_out = streams
    status, detail = verdict(report, nonce, timed_out, returncode, stderr, limits.timeout,
                             limits.cpu_s)
    return ExecResult(status, detail, text(stdout), text(stderr), time.monotonic() - started)
