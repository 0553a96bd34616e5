"""The operating-system boundary alone (labkit/sandbox/jail.c), with no audit hook: hostile
programs run as raw Python behind the jail must leave no trace outside it, as root and as an
ordinary user. Each attack has a negative control, the same program run by a plain
interpreter, which does leave its trace (so a test would notice an escape).

Where this machine cannot set the jail up, the tests say why and check that `code_reward`
then refuses to run (unless the caller opts in to the audit hook alone)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from labkit import sandbox
from labkit.sandbox import launch

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[1]
DEBIAN_PYTHON = "/usr/bin/python3"


def _jail_or_reason():
    way = launch.launcher(PYTHON)
    return way if way.jail else None


JAIL = _jail_or_reason()
needs_jail = pytest.mark.skipif(JAIL is None, reason=f"no jail here: "
                                                     f"{launch.jail_reason(PYTHON)}")


@pytest.fixture(scope="module")
def bait():
    """A folder outside the jail, readable and writable by everyone, with a secret in it:
    what a program must neither read nor change. World-accessible, so a failure to reach it
    is the jail's doing, not the file's permissions."""
    folder = Path(tempfile.mkdtemp(prefix="labkit-bait-", dir="/tmp"))
    folder.chmod(0o777)
    secret = folder / "secret"
    secret.write_text("TOPSECRET-7f3a")
    secret.chmod(0o666)
    (folder / "bashrc").write_text("# unchanged\n")
    (folder / "bashrc").chmod(0o666)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _as_user(uid: int | None) -> list[str]:
    """The command prefix that runs as `uid` (None: as this process)."""
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


@pytest.fixture(params=["caller", "ordinary user"], scope="module")
def runner(request, tmp_path_factory):
    """Runs raw Python behind the jail as this process, then (as root) as uid 1000 with
    Debian's interpreter and a copy of the jail that user can execute."""
    if JAIL is None:
        pytest.skip(f"no jail here: {launch.jail_reason(PYTHON)}")
    if request.param == "caller":
        python, jail, prefix = PYTHON, JAIL.jail, []
    else:
        if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(DEBIAN_PYTHON):
            pytest.skip("the ordinary-user run needs root, setpriv and /usr/bin/python3")
        folder = Path(tempfile.mkdtemp(prefix="labkit-jail-", dir="/tmp"))
        folder.chmod(0o755)
        jail = str(folder / "labkit-jail")
        shutil.copy(JAIL.jail, jail)
        os.chmod(jail, 0o755)
        python, prefix = DEBIAN_PYTHON, _as_user(1000)
    way = launch.Launch((), None, launch.SANDBOX_UID, True, jail)

    def run(code: str, timeout: float = 20) -> subprocess.CompletedProcess:
        argv = [*prefix, *launch.command(way, python, ()), "-c", code]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd="/",
                              env={**launch.child_env("/work"), "LABKIT_TEST_TOKEN": "leak-9c1"})
    run.python = python
    run.user = request.param
    return run


def _plain(code: str) -> subprocess.CompletedProcess:
    """The negative control: the same program, a plain interpreter, no jail, in a fresh
    folder."""
    with tempfile.TemporaryDirectory(prefix="labkit-plain-") as folder:
        return subprocess.run([PYTHON, "-c", code], capture_output=True, text=True,
                              timeout=30, cwd=folder)


def _token() -> str:
    return f"labkit-escape-{os.getpid()}-{time.monotonic_ns()}"


# ---------------------------------------------------------------- writes that must not land

WRITES = {
    "open": "open({target!r}, 'w').write('escaped')",
    "os.system": "import os\nos.system('touch {target}')",
    "subprocess": "import subprocess\nsubprocess.run(['touch', {target!r}])",
    "fork": "import os\nif os.fork() == 0:\n    open({target!r}, 'w').write('escaped')\n"
            "    os._exit(0)\nos.wait()",
    "ctypes system": "import ctypes\nctypes.CDLL(None).system(b'touch {target}')",
    "symlink": "import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('escaped')",
    "hard link": "import os\nopen('made', 'w').write('escaped')\nos.link('made', {target!r})",
    "rename": "import os\nopen('made', 'w').write('escaped')\nos.rename('made', {target!r})",
    "exec shell": "import os\nos.execv('/bin/sh', ['sh', '-c', 'echo escaped > {target}'])",
}


@needs_jail
@pytest.mark.parametrize("how", list(WRITES))
@pytest.mark.parametrize("where", ["bait folder", "/tmp", "/dev/shm"])
def test_no_write_lands_outside(runner, bait, how, where):
    folder = {"bait folder": str(bait), "/tmp": "/tmp", "/dev/shm": "/dev/shm"}[where]
    if not os.path.isdir(folder):
        pytest.skip(f"{folder} is not on this machine")
    target = os.path.join(folder, _token())
    done = runner(WRITES[how].format(target=target))
    assert not os.path.exists(target), (how, done.returncode, done.stderr[-300:])


@pytest.mark.parametrize("how", ["open", "os.system", "fork", "symlink", "rename"])
def test_negative_control_plain_python_writes(how, bait):
    target = os.path.join(str(bait), _token())
    _plain(WRITES[how].format(target=target))
    assert os.path.exists(target)
    os.unlink(target)


@needs_jail
def test_home_repository_and_bashrc_are_out_of_reach(runner, bait):
    readme = REPO / "README.md"
    before = readme.read_bytes()
    code = ("import os\n"
            "for path in [os.path.expanduser('~/.bashrc'), '/root/.bashrc', {bashrc!r},\n"
            "             {readme!r}]:\n"
            "    try:\n"
            "        os.makedirs(os.path.dirname(path), exist_ok=True)\n"
            "        open(path, 'a').write('echo pwned\\n')\n"
            "    except OSError as e:\n"
            "        print('refused', path, type(e).__name__)\n")
    done = runner(code.format(bashrc=str(bait / "bashrc"), readme=str(readme)))
    assert (bait / "bashrc").read_text() == "# unchanged\n", done.stdout
    assert readme.read_bytes() == before
    assert "pwned" not in Path("/root/.bashrc").read_text(errors="replace") \
        if os.access("/root/.bashrc", os.R_OK) else True


# ------------------------------------------------------------------- reads that must fail

READS = {
    "secret file": "print(open({secret!r}).read())",
    "ssh folder": "import os\nfor home in ('/root', os.path.expanduser('~')):\n"
                  "    p = os.path.join(home, '.ssh')\n"
                  "    print(os.listdir(p) if os.path.isdir(p) else 'none')\n"
                  "print(open({secret!r}).read())",
    "init environment": "print(open('/proc/1/environ').read())\nprint(open({secret!r}).read())",
    "parent environment": "import os\nprint(open(f'/proc/{{os.getppid()}}/environ').read())\n"
                          "print(open({secret!r}).read())",
    "symlink to secret": "import os\nos.symlink({secret!r}, 'l')\nprint(open('l').read())",
    "hard link to secret": "import os\nos.link({secret!r}, 'h')\nprint(open('h').read())",
    "walk the root": "import os\nfor top, dirs, files in os.walk('/'):\n"
                     "    for f in files:\n"
                     "        if f == 'secret':\n"
                     "            print(open(os.path.join(top, f)).read())",
}


@needs_jail
@pytest.mark.parametrize("how", list(READS))
def test_no_secret_is_read(runner, bait, how):
    done = runner(READS[how].format(secret=str(bait / "secret")), timeout=60)
    assert "TOPSECRET" not in done.stdout + done.stderr


def test_negative_control_plain_python_reads(bait):
    assert "TOPSECRET" in _plain(READS["secret file"].format(secret=str(bait / "secret"))).stdout


@needs_jail
def test_the_environment_holds_only_what_the_jail_gives(runner, monkeypatch):
    monkeypatch.setenv("LABKIT_HOST_SECRET", "host-secret-51")
    done = runner("import os\nprint(sorted(os.environ.items()))")
    assert "host-secret-51" not in done.stdout and "HOME" in done.stdout


# --------------------------------------------------------------------------- the network

@pytest.fixture(scope="module")
def listener():
    """A loopback TCP server and a Unix socket (world-writable) on the host: a program that
    connects to either leaves a connection behind."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.settimeout(0.2)
    folder = tempfile.mkdtemp(prefix="labkit-sock-", dir="/tmp")
    os.chmod(folder, 0o777)
    path = os.path.join(folder, "docker.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(path)
    os.chmod(path, 0o777)
    unix.listen(8)
    unix.settimeout(0.2)
    yield tcp, unix, path
    tcp.close()
    unix.close()
    shutil.rmtree(folder, ignore_errors=True)


def _accepted(server) -> bool:
    try:
        conn, _ = server.accept()
    except (TimeoutError, socket.timeout, BlockingIOError, OSError):
        return False
    conn.close()
    return True


NETWORK = {
    "loopback": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
    "outside": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)",
    "unix socket": "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})",
}


@needs_jail
@pytest.mark.parametrize("how", list(NETWORK))
def test_no_connection_leaves_the_jail(runner, listener, how):
    tcp, unix, path = listener
    done = runner(NETWORK[how].format(port=tcp.getsockname()[1], path=path))
    assert done.returncode != 0
    assert not _accepted(tcp) and not _accepted(unix)


def test_negative_control_plain_python_connects(listener):
    tcp, unix, path = listener
    _plain(NETWORK["loopback"].format(port=tcp.getsockname()[1], path=path))
    _plain(NETWORK["unix socket"].format(port=0, path=path))
    assert _accepted(tcp) and _accepted(unix)


# ------------------------------------------------------------- processes, signals, kernel

@pytest.fixture
def victim():
    """A process outside the jail that a program would like to kill."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


SIGNALS = {
    "by pid": "import os, signal\nos.kill({pid}, signal.SIGKILL)",
    "every process": "import os, signal\nos.kill(-1, signal.SIGKILL)",
    "the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                  "os.kill({pid}, signal.SIGKILL)",
    "ptrace": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "assert libc.ptrace(16, {pid}, 0, 0) == 0, ctypes.get_errno()\n"
              "import os, signal\nos.kill({pid}, signal.SIGKILL)",
}


@needs_jail
@pytest.mark.parametrize("how", list(SIGNALS))
def test_no_signal_reaches_a_process_outside(runner, victim, how):
    runner(SIGNALS[how].format(pid=victim.pid))
    time.sleep(0.05)
    assert victim.poll() is None


def test_negative_control_plain_python_kills(victim):
    _plain(SIGNALS["by pid"].format(pid=victim.pid))
    victim.wait(timeout=5)
    assert victim.returncode == -signal.SIGKILL


KERNEL = {  # each must fail; the program exits 0 only if the call succeeded
    "mount": "ctypes.CDLL(None, use_errno=True).mount(b'none', b'/work', b'tmpfs', 0, None)",
    "unshare a user namespace": "ctypes.CDLL(None, use_errno=True).unshare(0x10000000)",
    "setns": "ctypes.CDLL(None, use_errno=True).setns(0, 0)",
    "bpf": "ctypes.CDLL(None, use_errno=True).syscall(321 if X86 else 280, 0, 0, 0)",
    "keyctl": "ctypes.CDLL(None, use_errno=True).syscall(250 if X86 else 219, 0, 0, 0)",
    "perf_event_open": "ctypes.CDLL(None, use_errno=True).syscall(298 if X86 else 241, 0, 0, "
                       "-1, -1, 0)",
    "io_uring_setup": "ctypes.CDLL(None, use_errno=True).syscall(425, 1, 0)",
    "userfaultfd": "ctypes.CDLL(None, use_errno=True).syscall(323 if X86 else 282, 0)",
    "process_vm_writev": "ctypes.CDLL(None, use_errno=True).syscall(311 if X86 else 271, 1, "
                         "0, 0, 0, 0, 0)",
    "setuid root": "ctypes.CDLL(None, use_errno=True).setuid(0)",
    "chroot": "ctypes.CDLL(None, use_errno=True).chroot(b'/work')",
    "mknod": "ctypes.CDLL(None, use_errno=True).mknod(b'dev', 0o20666, 0x0103)",
}


@needs_jail
@pytest.mark.parametrize("how", list(KERNEL))
def test_kernel_calls_that_widen_an_attack_are_refused(runner, how):
    code = ("import ctypes, os, platform\nX86 = platform.machine() == 'x86_64'\n"
            f"r = {KERNEL[how]}\nprint('result', r, ctypes.get_errno())\n"
            "raise SystemExit(0 if r == 0 else 3)")
    done = runner(code)
    assert done.returncode == 3, (how, done.stdout, done.stderr[-300:])


@needs_jail
def test_proc_self_mem_cannot_be_written(runner):
    done = runner("f = open('/proc/self/mem', 'wb')")
    assert done.returncode != 0 and "FileNotFoundError" in done.stderr


# --------------------------------------------------------------------------- exhaustion

@needs_jail
def test_filling_the_disk_stops_at_the_work_folder(runner):
    done = runner("chunk = b'x' * (1 << 20)\nwith open('big', 'wb') as f:\n"
                  f"    for _ in range({2 * launch.WORK_MB}):\n        f.write(chunk)\n",
                  timeout=60)
    assert done.returncode != 0 and "No space left" in done.stderr


@needs_jail
def test_a_fork_bomb_forks_nothing(runner):
    token = _token()
    done = runner(f"import os\nTOKEN = {token!r}\nwhile True:\n    os.fork()")
    assert done.returncode != 0 and "PermissionError" in done.stderr
    assert token not in subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True,
                                       text=True).stdout


@needs_jail
def test_a_thread_bomb_starts_no_thread(runner):
    done = runner("import threading, time\nstarted = 0\ntry:\n    for _ in range(10000):\n"
                  "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
                  "        started += 1\nfinally:\n    print('started', started)")
    assert "started 0" in done.stdout, done.stdout + done.stderr[-300:]


@needs_jail
def test_a_program_past_its_deadline_leaves_no_process(runner):
    token = _token()
    with pytest.raises(subprocess.TimeoutExpired):
        runner(f"import time\nTOKEN = {token!r}\ntime.sleep(60)", timeout=1)
    time.sleep(0.2)  # the kill above reached the jail; its pid 1 takes the rest down
    assert token not in subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True,
                                       text=True).stdout


@needs_jail
def test_a_signal_death_reaches_the_caller_as_that_signal(runner):
    """The jail ends as its program ended, so a CPU limit reads as SIGXCPU."""
    done = runner("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert done.returncode == -signal.SIGTERM
    assert runner("raise SystemExit(7)").returncode == 7


# --------------------------------------------------------------------- end to end, hook on

@needs_jail
def test_the_traceback_walk_gets_nothing_behind_the_jail(bait):
    """The attack that switched the audit hook off: catch its first refusal, walk the
    traceback to the hook's frame and mark the thread as inside the hook, then run a shell
    command and write outside. Behind the jail neither lands, and the program scores 0."""
    marker, written = os.path.join(str(bait), _token()), os.path.join(str(bait), _token())
    code = ("import threading\n"
            "try:\n    open('/etc/x', 'w')\n"
            "except PermissionError as e:\n    tb = e.__traceback__\n"
            "    while tb is not None:\n"
            "        for v in list(tb.tb_frame.f_locals.values()):\n"
            "            if isinstance(getattr(v, 'inside', None), set):\n"
            "                v.inside.add(threading.get_ident())\n"
            "        tb = tb.tb_next\n"
            f"import os\nos.system('touch {marker}')\nopen({written!r}, 'w').write('x')\n")
    assert sandbox.code_reward([f"```python\n{code}\n```"], tests=[["pass"]]) == [0.0]
    assert not os.path.exists(marker) and not os.path.exists(written)


def test_without_a_boundary_code_reward_refuses_unless_opted_in(monkeypatch):
    plain = launch.Launch((), None, os.geteuid(), False)
    monkeypatch.setattr(launch, "launcher", lambda python: plain)
    monkeypatch.delenv("LABKIT_SANDBOX", raising=False)
    with pytest.raises(RuntimeError, match="no operating-system boundary.*hook-only"):
        sandbox.code_reward(["x = 1"], tests=[["pass"]])
    with pytest.raises(RuntimeError, match="no operating-system boundary"):
        sandbox.make_code_reward()
    monkeypatch.setattr(launch, "_warned_hook_only", False)
    with pytest.warns(RuntimeWarning, match="audit hook alone"):
        assert sandbox.code_reward(["x = 1"], tests=[["pass"]], sandbox="hook-only") == [1.0]
    monkeypatch.setenv("LABKIT_SANDBOX", "hook-only")
    assert sandbox.run_program("x = 1", "pass").passed
    with pytest.raises(ValueError, match="sandbox must be one of boundary, hook-only"):
        sandbox.run_program("x = 1", "pass", sandbox="off")
    assert sandbox.isolation()["boundary"] is False


@needs_jail
def test_isolation_names_the_layers_of_the_boundary():
    info = sandbox.isolation()
    assert info["boundary"] is True and info["reason"] is None
    assert "seccomp filter" in info["layers"] and "pid namespace" in info["layers"]
    assert info["uid"] == launch.SANDBOX_UID


def test_macos_runs_programs_under_a_deny_by_default_seatbelt_profile(monkeypatch):
    """Untested on a Mac here: the profile's shape and the command line it is used with."""
    profile = launch.SEATBELT_PROFILE
    assert profile.startswith("(version 1)\n(deny default)") and "(deny network*)" in profile
    depth = 0
    for ch in profile:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        assert depth >= 0
    assert depth == 0
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(launch, "jail_binary", lambda: None)
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p == launch.SANDBOX_EXEC or real_exists(p))
    way = launch.candidates()[0]
    assert way.seatbelt and way.boundary and "untested" in way.layers[0]
    argv = launch.command(way, PYTHON, (), "/private/tmp/work")
    executable, prefix = launch.interpreter(PYTHON)
    assert argv[:6] == [launch.SANDBOX_EXEC, "-D", f"PREFIX={prefix}", "-D",
                        "WORKDIR=/private/tmp/work", "-p"]
    assert argv[7:] == [executable, "-I", "-S", "-B"]


@needs_jail
def test_the_throughput_command_compares_the_boundary_with_the_older_layers(capsys):
    assert sandbox.main(["--samples", "6", "--workers", "1", "--compare", "--rounds", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    import json

    summary = json.loads(out[-1])
    assert summary["boundary"] is True and len(summary["samples_per_s_workers_1"]) == 2
    assert len(summary["samples_per_s_workers_1_older_layers"]) == 2
    assert "paired t over 2 rounds" in next(line for line in out if "adds" in line)
    assert launch.launcher(PYTHON).boundary  # the measurement left the launcher as it was
