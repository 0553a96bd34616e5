"""Tests of the sandboxed code reward: scoring, and containment of programs that try to escape.

Every escape test checks three things: the program scores 0, the sandbox says it blocked
it, and the machine is as before (no marker file, no live process, no connection, the
victim still alive). Each has a negative control: the same attempt run without the sandbox
(a plain `python -c` in a temporary directory) does leave its trace, which proves the test
would notice an escape. The escape tests run twice: with every layer this machine offers
(the jail, where it starts: tests/test_jail.py tests it alone, without the hook), and with
the in-process audit hook alone (no unshare, no change of user), which a caller gets only
by opting in (`LABKIT_SANDBOX=hook-only`).
"""

import glob
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from labkit import sandbox
from labkit.sandbox import (OUTPUT_LIMIT, code_reward, extract_code, isolation, launch,
                            make_code_reward, run_program)

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
FAST = {"timeout": 3}  # the default (5 s) would make the slow cases slower, never the others


def _workdirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "labkit-sandbox-*")))


@pytest.fixture(autouse=True)
def no_leftover_workdirs():
    """Every test leaves no working directory behind."""
    before = _workdirs()
    yield
    assert _workdirs() - before == set()


@pytest.fixture(autouse=True)
def opt_in_where_no_boundary(monkeypatch):
    """Where this machine cannot set the jail up (tests/test_jail.py says why and checks
    that the reward then refuses), these tests of scoring and of the layers below the jail
    run behind those layers, opted in."""
    if not launch.launcher(sys.executable).boundary:
        monkeypatch.setenv("LABKIT_SANDBOX", "hook-only")


@pytest.fixture(params=["all layers", "audit hook only"])
def layers(request, monkeypatch):
    """Run a test with the isolation this machine gives, then with the audit hook alone."""
    if request.param == "audit hook only":
        plain = launch.Launch((), None, os.geteuid(), False)
        monkeypatch.setattr(launch, "launcher", lambda python: plain)
        monkeypatch.setenv("LABKIT_SANDBOX", "hook-only")  # the opt-in it needs
    return request.param


def _unsandboxed(code: str, cwd) -> subprocess.CompletedProcess:
    """The negative control: the same program run by a plain interpreter."""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, timeout=30,
                          capture_output=True, text=True)


def _processes_with_home(home: str) -> list[int]:
    """Live processes whose environment has HOME=home: the sandbox gives each program its
    working directory as HOME, so this finds a program's processes wherever they moved
    (another process group, another session)."""
    needle = f"HOME={home}".encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ + b"\0" and state != "Z":
            found.append(int(entry))
    return found


def _blocked(code: str, layers: str) -> sandbox.ExecResult:
    """Run a program that must be refused; its tests would pass if it got that far. With
    the audit hook alone the hook must refuse it (status "blocked"); with all layers the
    kernel may refuse first (a PermissionError, or behind the jail a path that is not there
    or is read-only), which also contains it."""
    result = run_program(code, "pass", **FAST)
    # behind the jail, the kernel refuses (EPERM), or the path is not there or read-only
    kernel_said_no = result.status == "error" and any(
        word in result.detail for word in ("PermissionError", "FileNotFoundError",
                                           "Read-only file system"))
    # a subinterpreter cannot fork at all: CPython refuses before any audit event
    interpreter_said_no = result.status == "error" and \
        "not supported for isolated subinterpreters" in result.detail
    assert result.status == "blocked" or interpreter_said_no or \
        (layers == "all layers" and kernel_said_no), \
        (result.status, result.detail, result.stderr[-500:])
    assert code_reward([f"```python\n{code}\n```"], tests=[["pass"]], **FAST) == [0.0]
    return result


# ------------------------------------------------------------------------------ scoring

def test_correct_solution_scores_one():
    result = run_program(ADD, ADD_TESTS)
    assert result.passed and result.status == "passed" and result.detail == ""
    assert code_reward([ADD], tests=[ADD_TESTS]) == [1.0]


def test_wrong_solution_scores_zero():
    wrong = "def add(a, b):\n    return a - b\n"
    result = run_program(wrong, ADD_TESTS)
    assert result.status == "failed" and "test 0" in result.detail
    assert code_reward([wrong], tests=[ADD_TESTS]) == [0.0]


def test_one_failing_test_of_several_scores_zero():
    almost = "def add(a, b):\n    return 3\n"
    assert run_program(almost, ADD_TESTS).status == "failed"
    assert code_reward([almost], tests=[ADD_TESTS]) == [0.0]


def test_syntax_error_scores_zero():
    result = run_program("def add(a, b) return a + b", ADD_TESTS)
    assert result.status == "error" and "does not compile" in result.detail
    assert code_reward(["def add(a, b) return a + b"], tests=[ADD_TESTS]) == [0.0]


def test_program_that_raises_scores_zero():
    result = run_program("raise ValueError('boom')", ADD_TESTS)
    assert result.status == "error" and "ValueError: boom" in result.detail


def test_tests_share_the_program_namespace_and_one_string_is_one_test():
    tests = "x = add(2, 3)\nassert x == 5\nassert add(x, 1) == 6"
    assert run_program(ADD, tests).passed


def test_main_block_does_not_run_and_stdin_is_empty():
    code = ADD + "if __name__ == '__main__':\n    add(input(), 1)\n"
    assert run_program(code, ADD_TESTS).passed
    assert run_program("x = input()", "pass").status == "error"  # EOFError


def test_fenced_block_is_extracted():
    completion = ("Here is my solution.\n```python\n" + ADD + "```\nIt adds the numbers.")
    assert code_reward([completion], tests=[ADD_TESTS]) == [1.0]
    assert code_reward(["I think the answer is add."], tests=[ADD_TESTS]) == [0.0]


@pytest.mark.parametrize("text, code", [
    ("```python\nA\n```", "A\n"),
    ("intro\n```py\nA\n```\nthen\n```python\nB\n```\nbye", "B\n"),
    ("```\nA\n```\n```python\nB\n```\n```\nC\n```", "B\n"),  # a python block wins
    ("```\nA\n```", "A\n"),  # else the last untagged block
    ("```python\nA\n", "A\n"),  # cut at the token limit
    ("x = 1\nassert x", "x = 1\nassert x"),  # no fence: the whole text
    ("```bash\nls\n```", "```bash\nls\n```"),  # another language is not Python
])
def test_extract_code(text, code):
    assert extract_code(text) == code


def test_conversational_completions():
    conversation = [{"role": "user", "content": "Write add."},
                    {"role": "assistant", "content": f"```python\n{ADD}```"}]
    wrong = [{"role": "assistant", "content": "```python\ndef add(a, b): return 0\n```"}]
    assert code_reward([conversation, wrong], tests=[ADD_TESTS, ADD_TESTS]) == [1.0, 0.0]


def test_bad_completions_score_zero_without_raising():
    assert code_reward([None, "", "   ", 5, []], tests=[ADD_TESTS] * 5) == [0.0] * 5


def test_results_come_back_in_order_with_workers():
    good, bad = ADD, "def add(a, b):\n    return 0\n"
    completions = [good, bad, bad, good, good, bad, good, bad]
    expected = [1.0 if c == good else 0.0 for c in completions]
    assert code_reward(completions, tests=[ADD_TESTS] * 8, workers=2) == expected
    assert code_reward(completions, tests=[ADD_TESTS] * 8, workers=5) == expected


def test_make_code_reward_binds_settings_and_is_named_for_trl():
    reward = make_code_reward(timeout=2, memory_mb=128, workers=2)
    assert reward.__name__ == "code_reward"
    assert reward([ADD, "x"], tests=[ADD_TESTS, ADD_TESTS], prompts=["p", "p"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="workers"):
        make_code_reward(workers=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"timeout": 0}, r"timeout must be a finite number of seconds > 0, got 0"),
    ({"timeout": -1.5}, r"timeout must be .* > 0"),
    ({"timeout": float("nan")}, r"timeout must be a finite number"),
    ({"timeout": "5"}, r"timeout must be"),
    ({"memory_mb": 10}, r"memory_mb must be an integer >= 64"),
    ({"memory_mb": 256.0}, r"memory_mb must be an integer"),
    ({"cpu_s": 0}, r"cpu_s must be a finite number of seconds > 0 or None"),
])
def test_bad_limits_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_program(ADD, ADD_TESTS, **kwargs)
    with pytest.raises(ValueError, match=message):
        code_reward([ADD], tests=[ADD_TESTS], **kwargs)


@pytest.mark.parametrize("tests, message", [
    (None, r"code_reward needs the test cases as the keyword `tests`"),
    ("assert True", r"tests must be a list with one entry per completion"),
    ([ADD_TESTS, ADD_TESTS], r"tests has 2 entries but completions has 1"),
    ([[]], r"tests\[0\] is empty"),
    ([[""]], r"tests\[0\]\[0\] must be a non-empty string"),
    ([["assert add(1,"]], r"tests\[0\]\[0\] is not valid Python"),
    ([42], r"tests\[0\] must be a string or a list of strings"),
])
def test_bad_tests_raise(tests, message):
    with pytest.raises(ValueError, match=message):
        code_reward([ADD], tests=tests)


def test_bad_run_program_arguments_raise():
    with pytest.raises(ValueError, match="code must be a string"):
        run_program(None, ADD_TESTS)
    with pytest.raises(ValueError, match="tests is empty"):
        run_program(ADD, [])
    with pytest.raises(ValueError, match=r"workers must be an integer >= 1, got 0"):
        code_reward([ADD], tests=[ADD_TESTS], workers=0)


def test_output_is_captured_and_capped():
    result = run_program("for i in range(200000):\n    print(i)", "pass")
    assert result.passed
    assert len(result.stdout.encode()) <= OUTPUT_LIMIT
    assert result.stdout.endswith("199999\n")
    assert "ZeroDivisionError" in run_program("1 / 0", "pass").stderr + \
        run_program("import sys\nsys.stderr.write('ZeroDivisionError')\n1/0", "pass").stderr


def test_program_may_use_its_working_directory_and_common_modules():
    code = ("import os, pathlib, tempfile, shutil, collections, re, typing, json, asyncio\n"
            "os.mkdir('d')\n"
            "pathlib.Path('d/a.txt').write_text('hello')\n"
            "os.rename('d/a.txt', 'd/b.txt')\n"
            "scratch = tempfile.mkdtemp()\n"
            "shutil.rmtree(scratch)\n"
            "os.chmod('d', 0)\n"  # the cleanup must cope with this
            "async def three():\n    return 3\n"
            "RESULT = asyncio.run(three())\n")
    result = run_program(code, ["assert RESULT == 3", "assert os.listdir('.') == ['d']"])
    assert result.passed, (result.detail, result.stderr[-500:])


def test_isolation_reports_the_layers():
    info = isolation()
    assert info["python"] == sys.executable
    assert isinstance(info["uid"], int) and isinstance(info["network_namespace"], bool)


def test_root_runs_programs_as_nobody_when_the_interpreter_allows_it():
    """A root caller's programs run as uid 65534 with no groups, in a network namespace
    with only a loopback interface, when the interpreter is readable by that user (the
    Debian one is; one under /root is not)."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.path.exists(python):
        pytest.skip("needs root and /usr/bin/python3")
    info = isolation(python)
    if info["uid"] != sandbox.SANDBOX_UID:
        pytest.skip(f"uid {sandbox.SANDBOX_UID} cannot run {python} here")
    code = "import os, socket\nIDS = (os.getuid(), os.geteuid(), os.getgroups())\n" \
           "try:\n    NAMES = [name for _, name in socket.if_nameindex()]\n" \
           "except PermissionError:\n    NAMES = 'no sockets'\n"
    tests = ["assert IDS == (65534, 65534, []), IDS"]
    if info["boundary"]:  # behind the jail a program cannot even open a socket
        tests.append("assert NAMES == 'no sockets', NAMES")
    elif info["network_namespace"]:
        tests.append("assert NAMES == ['lo'], NAMES")
    result = run_program(code, tests, python=python)
    assert result.passed, (result.detail, result.stderr[-500:])


# ------------------------------------------------------------------- verdict integrity

@pytest.mark.parametrize("code", [
    "import sys\nsys.exit(0)",
    "raise SystemExit",
    "import os\nos._exit(0)",
    "import os\nfor fd in range(3, 64):\n    try:\n"
    "        os.write(fd, b'0' * 32 + b'\\tpassed\\t\\n')\n"
    "    except OSError:\n        pass\nos._exit(0)",
])
def test_leaving_early_or_forging_a_report_does_not_pass(code):
    """The tests would fail; a program that exits with status 0 before them, or writes a
    made-up report, must not pass (a harness reading exit codes would say it did)."""
    result = run_program(code, "assert False")
    assert result.status == "error", (result.status, result.detail)
    assert code_reward([code], tests=[["assert False"]]) == [0.0]


def test_negative_control_exit_code_says_success(tmp_path):
    assert _unsandboxed("import sys\nsys.exit(0)\nassert False", tmp_path).returncode == 0


@pytest.mark.parametrize("code", [
    "import sys\nsys.settrace(lambda *a: None)",
    "import marshal\nmarshal.loads(marshal.dumps(compile('x = 1', 'x', 'exec')))",
    "f = lambda: 0\nf.__code__ = f.__code__.replace(co_consts=(1,))",
    "g = lambda: 1\nf = lambda: 0\nf.__code__ = g.__code__",
    "import gc\ngc.get_objects()",
    "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
    "import ctypes",
    "import importlib\nimportlib.import_module('_ctypes')",
    "import _imp, importlib.util\n"
    "_imp.create_dynamic(importlib.util.find_spec('_posixsubprocess'))",
])
def test_tampering_with_the_interpreter_is_blocked(layers, code):
    _blocked(code, layers)


REBIND = ("import __main__, builtins, posix\n"
          "def nothing(*args, **kwargs):\n    return None\n"
          "for name, value in list(vars(__main__).items()):\n"
          "    if callable(value) and value is not nothing:\n"
          "        setattr(__main__, name, nothing)\n"
          "builtins.isinstance = builtins.issubclass = lambda *args: True\n"
          "posix.lstat = nothing\n")


def test_rebinding_the_sandbox_names_does_not_switch_the_hook_off(layers, tmp_path):
    """The child's functions live in `__main__` and use builtins, both of which the program
    can rebind; the hook runs private copies (a no-op `check` in `__main__`, or an
    `issubclass` that says every path is a file descriptor, would let this write through)."""
    marker = tmp_path / "marker"
    result = _blocked(REBIND + f"open({str(marker)!r}, 'w').write('escaped')", layers)
    assert "writing" in result.detail
    _blocked(REBIND + "import os\nos.mknod('fifo')", layers)
    assert not marker.exists()


def test_no_code_of_the_program_runs_inside_the_hook(layers, tmp_path):
    """An object whose `__class__` is a property, passed in an audit event: a hook that
    asked isinstance() about it would run the property, inside the hook, where the hook's
    own events are not checked."""
    marker = tmp_path / "marker"
    _blocked("import os, sys\n"
             "class Sneaky:\n"
             "    @property\n"
             "    def __class__(self):\n"
             f"        os.system('touch {marker}')\n"
             "        return Sneaky\n"
             "sys.audit('open', Sneaky(), None, 0)", layers)
    time.sleep(0.05)
    assert not marker.exists()


def test_the_hook_looks_up_no_module_attribute():
    """The rule `seal` relies on, checked: every global name the hook's functions load is
    one of them, a built-in, or a value taken at start-up, never a module (whose
    attributes the program can rebind) nor another Python function (which would look its
    own names up in `__main__`)."""
    import builtins
    import dis
    import types

    from labkit.sandbox import child
    hook = {function.__name__ for function in child.HOOK_FUNCTIONS}

    def global_names(code):
        for instruction in dis.get_instructions(code):
            if instruction.opname == "LOAD_GLOBAL":
                yield instruction.argval
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                yield from global_names(const)

    for function in child.HOOK_FUNCTIONS:
        for name in global_names(function.__code__):
            assert name in vars(child) or name in vars(builtins), (function.__name__, name)
            value = vars(child).get(name, vars(builtins).get(name))
            assert not isinstance(value, types.ModuleType), (function.__name__, name)
            assert name in hook or not isinstance(value, types.FunctionType), \
                (function.__name__, name)
    sealed = child.seal(child.HOOK_FUNCTIONS)
    for name in hook:
        assert sealed[name].__globals__ is sealed and sealed[name] is not vars(child)[name]
    assert sealed["__builtins__"] is not vars(builtins) and sealed["check"].__builtins__ is \
        sealed["__builtins__"]


def test_fresh_posix_module_cannot_be_built():
    result = run_program("import _imp, importlib.machinery as m\n"
                         "_imp.create_builtin(m.BuiltinImporter.find_spec('posix'))", "pass")
    assert result.status == "error" and "create_builtin" in result.detail


# -------------------------------------------------------------------------- containment

@pytest.mark.parametrize("loop", ["while True:\n    pass", "import time\ntime.sleep(60)"])
def test_infinite_loop_is_killed_promptly(loop):
    code = f"import os\nprint(os.getcwd(), flush=True)\n{loop}"
    started = time.monotonic()
    result = run_program(code, "pass", timeout=1)
    assert result.status == "timeout", (result.status, result.detail)
    assert time.monotonic() - started < 3
    assert _processes_with_home(result.stdout.strip()) == []
    assert not result.passed  # so code_reward scores it 0.0


def test_cpu_limit_stops_a_busy_program():
    started = time.monotonic()
    result = run_program("while True:\n    pass", "pass", timeout=10, cpu_s=1)
    assert result.status == "timeout" and "CPU" in result.detail
    assert time.monotonic() - started < 6


FORK_BOMB = ("import os, time\nprint(os.getcwd(), flush=True)\n"
             "while True:\n"
             "    if os.fork() == 0:\n"
             "        os.setsid()\n"  # leave the process group, out of reach of killpg
             "        time.sleep(30)\n"
             "        os._exit(0)\n")


def test_fork_bomb_does_not_fork(layers):
    """The bomb forks in a loop and each child moves to a session of its own. (It grows
    linearly, not exponentially, so a broken sandbox would not take the machine down.)"""
    result = _blocked(FORK_BOMB, layers)
    assert "fork" in result.detail
    assert _processes_with_home(result.stdout.strip()) == []


def test_negative_control_fork_leaves_a_process(tmp_path):
    once = FORK_BOMB.replace("while True:", "for _ in range(1):")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    # not _unsandboxed: the sleeping child would hold the captured stdout open
    subprocess.run([sys.executable, "-c", once], cwd=tmp_path, env=env, timeout=30,
                   stdout=subprocess.DEVNULL, check=True)
    deadline = time.monotonic() + 5
    while not (left := _processes_with_home(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert len(left) == 1


def test_memory_hog_fails_and_the_parent_is_unaffected():
    limit_before = resource.getrlimit(resource.RLIMIT_AS)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    hog = "x = bytearray(4 * 1024 ** 3)\nx[::4096] = b'x' * (len(x) // 4096)"
    result = run_program(hog, "pass", memory_mb=256)
    assert result.status == "memory", (result.status, result.detail)
    assert code_reward([hog], tests=[["pass"]], memory_mb=256) == [0.0]
    # control: what the same limit does allow
    assert run_program("x = bytearray(64 * 1024 ** 2)", "pass", memory_mb=256).passed
    assert resource.getrlimit(resource.RLIMIT_AS) == limit_before
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown_kib < 200 * 1024


WRITES = {
    "open": "open({marker!r}, 'w').write('escaped')",
    "os.open": "import os\nos.open({marker!r}, os.O_CREAT | os.O_WRONLY)",
    "shutil.copy": "import shutil\nopen('f', 'w').close()\nshutil.copy('f', {marker!r})",
    "os.rename": "import os\nopen('f', 'w').close()\nos.rename('f', {marker!r})",
    "pathlib": "import pathlib\npathlib.Path({marker!r}).write_text('escaped')",
    "dotdot": "import os\nopen('../' * 40 + {marker!r}.lstrip('/'), 'w')",
    "symlink": "import os\nos.symlink({marker!r}, 'link')\nopen('link', 'w')",
    "dir_fd": "import os\nd = os.open({folder!r}, os.O_RDONLY)\n"
              "os.open('marker', os.O_CREAT | os.O_WRONLY, dir_fd=d)",
    "chdir": "import os\nos.chdir({folder!r})\nopen('marker', 'w')",
}


@pytest.mark.parametrize("how", sorted(WRITES))
def test_cannot_write_outside_the_working_directory(layers, tmp_path, how):
    marker = tmp_path / "marker"
    _blocked(WRITES[how].format(marker=str(marker), folder=str(tmp_path)), layers)
    assert not marker.exists()
    assert os.listdir(tmp_path) == []


def test_negative_control_plain_python_writes_the_marker(tmp_path):
    marker = tmp_path / "marker"
    assert _unsandboxed(WRITES["open"].format(marker=str(marker)), tmp_path).returncode == 0
    assert marker.read_text() == "escaped"


def test_cannot_delete_or_change_files_outside(layers, tmp_path):
    keep = tmp_path / "keep"
    keep.write_text("data")
    keep.chmod(0o644)
    for code in (f"import os\nos.remove({str(keep)!r})",
                 f"import os\nos.chmod({str(keep)!r}, 0)",
                 f"import os\nos.truncate({str(keep)!r}, 0)",
                 f"import shutil\nshutil.rmtree({str(tmp_path)!r})"):
        _blocked(code, layers)
    assert keep.read_text() == "data" and keep.stat().st_mode & 0o777 == 0o644


def test_cannot_read_outside_the_working_directory(layers, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    _blocked(f"print(open({str(secret)!r}).read())", layers)
    _blocked("print(open('/etc/passwd').read())", layers)
    _blocked("import os\nprint(os.listdir('/'))", layers)
    _blocked("import os\nos.open(os.path.dirname(os.__file__), os.O_RDONLY)",  # a dir_fd
             layers)
    assert "s3cr3t" in _unsandboxed(f"print(open({str(secret)!r}).read())", tmp_path).stdout


SECRET_NAME = "LABKIT_SANDBOX_TEST_SECRET"


def test_parent_environment_is_not_visible(layers, monkeypatch, tmp_path):
    secret = "s3cr3t-" + os.urandom(4).hex()
    monkeypatch.setenv(SECRET_NAME, secret)
    code = f"import os\nSEEN = os.environ.get({SECRET_NAME!r})\nKEYS = sorted(os.environ)"
    result = run_program(code, [f"assert SEEN == {secret!r}"])
    assert result.status == "failed"  # the program ran, and did not see it
    assert code_reward([code], tests=[[f"assert SEEN == {secret!r}"]]) == [0.0]
    assert run_program(code, ["assert KEYS == ['HOME', 'LANG', 'PATH', 'TMPDIR'], KEYS"]).passed
    result = _blocked("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
                      layers)
    assert secret not in result.stdout
    # control: a plain child inherits it
    assert secret in _unsandboxed(f"import os\nprint(os.environ[{SECRET_NAME!r}])",
                                  tmp_path).stdout


@pytest.fixture
def listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.3)
        yield server


def _accepted(server: socket.socket) -> bool:
    try:
        connection, _ = server.accept()
    except socket.timeout:
        return False
    connection.close()
    return True


def test_no_network(layers, listener):
    port = listener.getsockname()[1]
    _blocked(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
             layers)
    _blocked(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))", layers)
    _blocked("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
             f"s.sendto(b'x', ('127.0.0.1', {port}))", layers)
    _blocked("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)",
             layers)
    assert not _accepted(listener)


def test_negative_control_plain_python_connects(listener, tmp_path):
    port = listener.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5).close()"
    assert _unsandboxed(code, tmp_path).returncode == 0
    assert _accepted(listener)


ESCAPES = {
    "os.system": "import os\nos.system('touch {marker}')",
    "subprocess.run": "import subprocess\nsubprocess.run(['touch', '{marker}'])",
    "os.popen": "import os\nos.popen('touch {marker}').read()",
    "os.execv": "import os\nos.execv('/usr/bin/touch', ['touch', '{marker}'])",
    "os.posix_spawn": "import os\nos.posix_spawn('/usr/bin/touch', ['touch', '{marker}'], {{}})",
    "os.spawnv": "import os\nos.spawnv(os.P_WAIT, '/usr/bin/touch', ['touch', '{marker}'])",
    "pty.spawn": "import pty\npty.spawn(['touch', '{marker}'])",
    "fork_exec": "import _posixsubprocess as p\n"
                 "p.fork_exec(['touch', '{marker}'], [b'/usr/bin/touch'], True, (), None, None,"
                 " -1, -1, -1, -1, -1, -1, -1, -1, False, False, None, None, None, -1, None,"
                 " False)",
    "asyncio": "import asyncio\nasync def run():\n"
               "    await (await asyncio.create_subprocess_exec('touch', '{marker}')).wait()\n"
               "asyncio.run(run())",
    # RLIMIT_NPROC stops threads too for an unprivileged user: then the main thread tries
    "thread": "import os, threading\n"
              "t = threading.Thread(target=os.system, args=('touch {marker}',))\n"
              "try:\n    t.start()\nexcept RuntimeError:\n    os.system('touch {marker}')\n"
              "else:\n    t.join()",
}


@pytest.mark.parametrize("how", sorted(ESCAPES))
def test_cannot_run_other_programs(layers, tmp_path, how):
    marker = tmp_path / "marker"
    _blocked(ESCAPES[how].format(marker=marker), layers)
    time.sleep(0.05)  # a command that did start would have had time to run
    assert not marker.exists()


def test_negative_control_plain_python_runs_touch(tmp_path):
    marker = tmp_path / "marker"
    assert _unsandboxed(ESCAPES["os.system"].format(marker=marker), tmp_path).returncode == 0
    assert marker.exists()


@pytest.fixture
def victim():
    process = subprocess.Popen(["sleep", "30"])
    yield process
    process.kill()
    process.wait()


def test_cannot_signal_other_processes(layers, victim):
    _blocked(f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)", layers)
    _blocked(f"import os, signal\nos.killpg({victim.pid}, signal.SIGKILL)", layers)
    _blocked(f"import os, signal\nsignal.pidfd_send_signal(os.pidfd_open({victim.pid}), 9)",
             layers)
    time.sleep(0.05)
    assert victim.poll() is None


def test_negative_control_plain_python_kills(victim, tmp_path):
    code = f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)"
    assert _unsandboxed(code, tmp_path).returncode == 0
    assert victim.wait(timeout=5) == -signal.SIGKILL


FAKE_PASS = ("import os\n"
             "def find():\n"
             "    try:\n        raise ValueError\n"
             "    except ValueError as e:\n        frame = e.__traceback__.tb_frame\n"
             "    while frame is not None:\n"
             "        for value in list(frame.f_locals.values()):\n"
             "            if isinstance(value, dict) and 'nonce' in value:\n"
             "                return value\n"
             "        frame = frame.f_back\n"
             "job = find()\n"
             "os.write(job['report_fd'], (job['nonce'] + '\\tpassed\\t\\n').encode())\n"
             "os._exit(0)\n")


@pytest.mark.parametrize("reach", ["e.__traceback__.tb_frame", "sys.exc_info()[2].tb_frame"])
def test_a_frame_from_a_traceback_is_refused(layers, reach):
    """A traceback's frames lead to the sandbox's own state: the hook's (to switch it off)
    or the job's (to forge a passing report for tests that fail)."""
    code = "import sys\n" + FAKE_PASS.replace("e.__traceback__.tb_frame", reach)
    result = run_program(code, "assert False", **FAST)
    assert result.status == "blocked" and "reading" in result.detail, \
        (result.status, result.detail)


GETFRAME_PASS = FAKE_PASS.replace(
    "    try:\n        raise ValueError\n"
    "    except ValueError as e:\n        frame = e.__traceback__.tb_frame\n",
    "    import sys\n    frame = sys._getframe()\n")


def _has_subinterpreters() -> bool:
    import importlib.util

    return importlib.util.find_spec("_xxsubinterpreters") is not None


@pytest.mark.skipif(not _has_subinterpreters(),
                    reason="this Python has no _xxsubinterpreters: the child runs the program "
                           "in its own interpreter (docs/sandbox.md, verdict integrity)")
@pytest.mark.parametrize("code", [FAKE_PASS, GETFRAME_PASS], ids=["tb_frame", "_getframe"])
def test_no_frame_walk_forges_a_pass_from_the_subinterpreter(monkeypatch, code):
    """The program runs in a subinterpreter whose objects hold no token: even with the
    tb_frame refusal lifted, walking every frame up finds nothing to forge a pass with."""
    from labkit.sandbox import policy

    monkeypatch.setattr(policy, "FRAME_ATTRIBUTES", frozenset())
    result = run_program(code, "assert False", **FAST)
    assert result.status in ("error", "failed") and not result.passed, result.detail


@pytest.mark.parametrize("code", [FAKE_PASS, GETFRAME_PASS], ids=["tb_frame", "_getframe"])
def test_negative_control_in_one_interpreter_a_frame_walk_forges_a_pass(monkeypatch, code):
    from labkit.sandbox import policy

    monkeypatch.setattr(policy, "FRAME_ATTRIBUTES", frozenset())
    monkeypatch.setattr(launch, "SUBINTERPRETER", False)
    result = run_program(code, "assert False", **FAST)
    assert result.status == "passed"


def test_infinite_recursion_ends_in_an_error_and_the_next_program_runs():
    result = run_program("import sys\nsys.setrecursionlimit(10 ** 6)\n"
                         "def f(n):\n    return f(n + 1) + 1\nf(0)", "pass", **FAST)
    assert result.status in ("error", "memory", "timeout") and not result.passed, result.detail
    assert run_program(ADD, ADD_TESTS).passed
