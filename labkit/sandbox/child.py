"""The program the sandboxed interpreter runs: lock the process down, run the solution and
its tests, write the outcome to the report pipe.

The solution and its tests run in a subinterpreter (`in_subinterpreter`) that gets the job
without the report's token: nothing the program can reach holds it. The child's own
interpreter keeps the token and writes the report: "passed" only when the
subinterpreter's run ended without an exception. Where the Python has no subinterpreters
(or LABKIT_SUBINTERPRETER=0) the program runs in the child's interpreter as before.

A standalone script, standard library only (the child is a `python -I -S -B`). It reads a
marshal'd job from stdin: the program, its tests, the token, the report pipe, the limits and
the tables of `labkit.sandbox.policy`. `labkit.sandbox.launch` sends this file compiled by
the child's own interpreter ahead of the job, so the child's user needs no access to the
lab's files; `python -I -S -B child.py` with a job on stdin runs it the same way.

The program can rebind any name of this module (it is `__main__`, reachable through frames)
and of `builtins`. So `main` and `run_solution` bind what they use after the program starts
to locals first, and the audit hook runs copies of `HOOK_FUNCTIONS` made by `seal`, whose
global names resolve in a private snapshot; they call only the aliases taken below at
start-up and built-in types, never a module attribute.
"""

import _thread
import builtins
import marshal
import os
import posix
import sys
import types
from _functools import partial  # the built-in module: `functools` would import more

# taken at start-up, before the program runs: the audit hook calls these, not posix.*
lstat, readlink, getcwd, write = posix.lstat, posix.readlink, posix.getcwd, posix.write
open_fd, read_fd, close_fd, O_RDONLY = posix.open, posix.read, posix.close, posix.O_RDONLY
WRITE_FLAGS = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
audit, get_ident, get_frame = sys.audit, _thread.get_ident, sys._getframe
COROUTINE_CODE = types.coroutine.__code__
CODE_TYPE, FUNCTION_TYPE = type(COROUTINE_CODE), types.FunctionType
S_IFMT, S_IFDIR, S_IFLNK = 0o170000, 0o040000, 0o120000  # st_mode: type bits, folder, link
DENIED = "labkit.sandbox.denied"  # the audit event of a replaced function


# --------------------------------------------------------------------------- sealing

def seal(functions) -> dict:
    """A private namespace holding copies of `functions` whose global names resolve in it:
    a snapshot, taken now, of this module's names and of the builtins. Rebinding a name of
    this module or of `builtins` later changes nothing for the copies."""
    namespace = dict(globals())
    namespace["__builtins__"] = dict(vars(builtins))
    for function in functions:
        namespace[function.__name__] = types.FunctionType(
            function.__code__, namespace, function.__name__, function.__defaults__,
            function.__closure__)
    return namespace


def refuse(name: str, *args, **kwargs):
    """What a replaced function does instead (see `disable`)."""
    audit(DENIED, name)
    raise PermissionError(f"sandbox: {name} is not allowed")


# ---------------------------------------------------------------- before the program

def disable(job: dict) -> None:
    """Replace the functions that reach the system without raising an audit event, after
    loading every built-in module and removing `_imp.create_builtin`, which would otherwise
    build fresh copies of `posix` and `_signal` with the originals."""
    blocked, prefixes = job["blocked_modules"], job["blocked_prefixes"]
    for name in sys.builtin_module_names:
        if name not in blocked and not name.startswith(prefixes):
            __import__(name)
    replaced = {name: __import__(name) for name in job["replaced_functions"]}
    for module, names in job["removed_attributes"].items():
        for name in names:
            delattr(sys.modules[module], name)
    sealed_refuse = seal((refuse,))["refuse"]
    for module_name, names in job["replaced_functions"].items():
        module = replaced[module_name]
        for name in names:
            if hasattr(module, name):
                setattr(module, name, partial(sealed_refuse, f"{module_name}.{name}"))


def limit(job: dict) -> None:
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


def make_rules(job: dict) -> types.SimpleNamespace:
    """What the audit hook needs: the job's tables, the folders resolved, and its state."""
    work = canonical(job["workdir"])
    code_roots = tuple(r for r in (canonical(p) for p in sys.path if text(p)) if r != "/")
    return types.SimpleNamespace(
        report_fd=job["report_fd"], work=work, code_roots=code_roots,
        extension_dirs=frozenset(code_roots),
        read_roots=(work,) + code_roots + tuple(job["readable"]),
        blocked=frozenset(job["blocked_modules"]), prefixes=tuple(job["blocked_prefixes"]),
        denied_events=frozenset(job["denied_events"]),
        denied_prefixes=tuple(job["denied_event_prefixes"]),
        socket_families=frozenset(job["allowed_socket_families"]),
        frame_attributes=frozenset(job["frame_attributes"]),
        write_events=job["write_events"], read_events=job["read_events"],
        last_bytecode={},  # thread -> the standard-library .pyc it opened last
        inside=set())  # threads running the hook: its own calls raise events too


def install_guard(job: dict) -> None:
    """Add the audit hook that enforces the sandbox's rules. Every refusal writes a
    `blocked` line to the report pipe, then raises PermissionError in the program.

    The hook runs nothing the program can change: sealed copies of the functions below,
    paths copied to exact str before use, and symbolic links resolved with lstat and
    readlink, not with os.path. Its rules and namespace are held by the hook alone.
    """
    sys.addaudithook(partial(seal(HOOK_FUNCTIONS)["guard"], make_rules(job)))


# ------------------------------------------------------------ the audit hook's functions

def text(value):
    """An exact str copy of a str or bytes (no method of a subclass runs), else None.
    Types are tested with issubclass(type(value), ...) throughout the hook: isinstance
    would read a `__class__` attribute, which the program can make a property."""
    if issubclass(type(value), str):
        return str.__str__(value)
    if issubclass(type(value), bytes):
        return bytes.decode(value, "utf-8", "surrogateescape")
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
        except OSError:
            done.append(part)
            continue
        if mode & S_IFMT != S_IFLNK:
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
        if dir_fd is None or (type(dir_fd) is int and dir_fd < 0):
            base = getcwd()
        elif type(dir_fd) is int:
            base = readlink("/proc/self/fd/" + str(dir_fd))
        else:
            return None
    except OSError:
        return None
    return canonical(base + "/" + path)


def under(path: str, roots) -> bool:
    for root in roots:
        if path == root or path.startswith(root + "/"):
            return True
    return False


def is_dir(path: str) -> bool:
    try:
        return lstat(path).st_mode & S_IFMT == S_IFDIR
    except OSError:
        return False


def deny(rules, what: str):
    line = "blocked\t" + what.replace("\t", " ").replace("\n", " ")[:300] + "\n"
    try:
        write(rules.report_fd, line.encode("utf-8", "replace"))
    except OSError:
        pass
    raise PermissionError("sandbox: " + what + " is not allowed")


def require(rules, event: str, value, dir_fd, roots, what: str):
    if issubclass(type(value), int):  # an open file descriptor
        return
    path = resolve(value, dir_fd)
    if path is None or not under(path, roots):
        deny(rules, f"{event} of {text(value)!r} ({what})")


def check_open(rules, args):
    value, flags = args[0], args[2]
    if issubclass(type(value), int):
        return
    if type(flags) is not int:
        deny(rules, "open with unusual flags")
    path = resolve(value)
    if flags & WRITE_FLAGS:
        if path is None or not under(path, (rules.work,)):
            deny(rules, f"writing {text(value)!r} (outside the working directory)")
        return
    if path is None or not under(path, rules.read_roots):
        deny(rules, f"reading {text(value)!r} (outside the working directory and the "
                    f"standard library)")
    if is_dir(path) and not under(path, (rules.work,)):
        deny(rules, f"opening the directory {path!r} (a descriptor outside the working "
                    f"directory)")
    if path.endswith(".pyc") and under(path, rules.code_roots):
        rules.last_bytecode[get_ident()] = path


def check_import(rules, args):
    name = text(args[0]) or ""
    short = name.rpartition(".")[2]
    if short in rules.blocked or short.startswith(rules.prefixes):
        deny(rules, f"import of {name}")
    if args[1] is None:
        return
    path = resolve(args[1])  # an extension module: native code
    if path is None:
        deny(rules, f"loading the extension module {text(args[1])!r}")
    folder, _, file = path.rpartition("/")
    stem = file.partition(".")[0]
    if (stem in rules.blocked or stem.startswith(rules.prefixes)
            or folder not in rules.extension_dirs):
        deny(rules, f"loading the extension module {path!r}")


def check_bytecode(rules, args):
    """marshal.loads only of the .pyc the import system just read from the standard
    library: bytecode made by hand can crash the interpreter and remove this hook."""
    data = args[0]
    if type(data) is memoryview:
        data = memoryview.tobytes(data)
    path = rules.last_bytecode.pop(get_ident(), None)
    if type(data) is not bytes or path is None:
        deny(rules, "marshal.loads of bytecode that is not the standard library's")
    fd = open_fd(path, O_RDONLY)
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
        deny(rules, "marshal.loads of bytecode that is not the standard library's")


def from_coroutine_decorator() -> bool:
    """Whether the event comes from types.coroutine (asyncio uses it), the one place in
    the standard library that rebuilds a code object: it adds a flag to the code of a
    real function. Its locals are checked too, since an object posing as a function
    could bring flags of its own."""
    try:
        frame = get_frame(3)  # 0 this function, 1 check, 2 guard
    except ValueError:
        return False
    if frame.f_code is not COROUTINE_CODE:
        return False
    local = frame.f_locals
    return type(local.get("func")) is FUNCTION_TYPE and type(local.get("co")) is CODE_TYPE


def check(rules, event: str, args):
    if (event == "socket.__new__" and type(args[1]) is int
            and args[1] in rules.socket_families):
        return
    if event in rules.denied_events or event.startswith(rules.denied_prefixes):
        deny(rules, event)
    elif event == "open":
        check_open(rules, args)
    elif event in rules.write_events:
        for index, dir_index in rules.write_events[event]:
            dir_fd = None if dir_index is None else args[dir_index]
            require(rules, event, args[index], dir_fd, (rules.work,),
                    "outside the working directory")
    elif event in rules.read_events:
        for index, dir_index in rules.read_events[event]:
            require(rules, event, args[index], None, rules.read_roots,
                    "outside the working directory and the standard library")
    elif event == "import":
        check_import(rules, args)
    elif event == "marshal.loads":
        check_bytecode(rules, args)
    elif event == "code.__new__" and not from_coroutine_decorator():
        deny(rules, "making a code object")
    elif (event == "object.__setattr__" and text(args[1]) == "__code__"
          and not from_coroutine_decorator()):
        deny(rules, "replacing a function's __code__")
    elif event == "object.__getattr__" and text(args[1]) in rules.frame_attributes:
        deny(rules, f"reading {text(args[1])}")
    elif event == DENIED:
        deny(rules, text(args[0]) or "?")


def guard(rules, event, args):
    me = get_ident()
    if me in rules.inside:
        return
    rules.inside.add(me)
    try:
        check(rules, str.__str__(event), args)
    finally:
        rules.inside.discard(me)


HOOK_FUNCTIONS = (text, canonical, resolve, under, is_dir, deny, require, check_open,
                  check_import, check_bytecode, from_coroutine_decorator, check, guard)


# ------------------------------------------------------------------ the run itself

def describe(exc: BaseException) -> str:
    """`Type: message` of an exception, on one line and short, whatever its __str__ does."""
    try:
        message = f"{type(exc).__name__}: {exc}"
    except BaseException:
        message = "an exception that cannot be printed"
    return message.replace("\t", " ").replace("\n", " ")[:500]


def run_solution(source: str, tests: tuple) -> tuple:
    """Run the program, then each compiled test in its namespace: (status, detail)."""
    run, build, describe_, count = exec, compile, describe, enumerate
    out_of_memory, any_error = MemoryError, BaseException
    namespace = {"__name__": "__solution__"}
    try:
        program = build(source, "<solution>", "exec")
    except out_of_memory:
        return "memory", "the program ran out of memory while compiling"
    except any_error as exc:
        return "error", "the program does not compile: " + describe_(exc)
    try:
        run(program, namespace)
    except out_of_memory:
        return "memory", "the program ran out of memory"
    except any_error as exc:
        return "error", "the program raised " + describe_(exc)
    for i, test in count(tests):
        try:
            run(test, namespace)
        except out_of_memory:
            return "memory", f"test {i} ran out of memory"
        except any_error as exc:
            return "failed", f"test {i}: " + describe_(exc)
    return "passed", ""


def lock_down(job: dict) -> None:
    """Everything before the program runs. A function of its own so that the program,
    walking the frames above it, finds no reference to the hook's rules or namespace."""
    disable(job)
    limit(job)
    install_guard(job)


SUB_MAIN = "sub_main(JOB)"
OUTCOME = "labkit-outcome"


def sub_main(job_bytes: bytes) -> None:
    """In the subinterpreter: lock it down, run the program and its tests, flush its
    output; return only if every test passed, else raise with the outcome (main reads it
    from the failure). Names it uses after the program starts are locals bound first."""
    job = marshal.loads(job_bytes)
    tests = tuple(compile(t, f"<test {i}>", "exec") for i, t in enumerate(job["tests"]))
    lock_down(job)
    flushes, any_error, fail = (sys.stdout.flush, sys.stderr.flush), BaseException, RuntimeError
    status, detail = run_solution(job["code"], tests)
    for flush in flushes:
        try:
            flush()
        except any_error:
            pass
    if status != "passed":
        raise fail(OUTCOME + "\t" + status + "\t" + detail)


def in_subinterpreter(job: dict):
    """Run `sub_main` in a new subinterpreter: (status, detail), or None where this Python
    has none. The program lives in the subinterpreter's own objects and frames, so nothing
    it can reach holds the token; a pass is only the subinterpreter's run ending without an
    exception."""
    try:
        import _xxsubinterpreters as interpreters
    except ImportError:
        return None
    sandbox_code = marshal.dumps(globals()["CHILD"])  # this module's code, as loaded
    job = dict(job)
    del job["nonce"]
    interp = interpreters.create()
    script = ("import marshal\nns = {'__name__': '__sandbox__', 'CHILD': None}\n"
              "exec(marshal.loads(CODE), ns)\nns['sub_main'](JOB)\n")
    try:
        interpreters.run_string(interp, script, {"CODE": sandbox_code,
                                                 "JOB": marshal.dumps(job)})
    except interpreters.RunFailedError as exc:
        message = str(exc)
        found = message.find(OUTCOME + "\t")
        if found >= 0:
            status, _, detail = message[found + len(OUTCOME) + 1:].partition("\t")
            if status in ("failed", "error", "memory"):  # never "passed": see the docstring
                return status, detail
        return "error", "the sandbox's run ended in " + message.replace("\n", " ")[:300]
    return "passed", ""


def main() -> None:
    """Read the job from stdin, run the program and its tests in a subinterpreter behind
    the limits and the audit hook (in this interpreter where there is no subinterpreter),
    and write the token and the outcome to the report pipe, then exit at once."""
    job = marshal.load(sys.stdin.buffer)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    nonce, report_fd = job["nonce"], job["report_fd"]
    outcome = in_subinterpreter(job) if "CHILD" in globals() and job.get("subinterpreter") \
        else None
    if outcome is None:
        tests = tuple(compile(t, f"<test {i}>", "exec") for i, t in enumerate(job["tests"]))
        lock_down(job)
        write_report, exit_now, any_error = os.write, os._exit, BaseException
        flushes = (sys.stdout.flush, sys.stderr.flush)
        outcome = run_solution(job["code"], tests)
        for flush in flushes:
            try:
                flush()
            except any_error:
                pass
    else:
        write_report, exit_now = os.write, os._exit
    status, detail = outcome
    line = nonce + "\t" + status + "\t" + detail + "\n"
    write_report(report_fd, line.encode("utf-8", "replace"))
    exit_now(0)


if __name__ == "__main__":
    main()
