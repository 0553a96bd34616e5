"""What the sandboxed interpreter refuses and allows, as tables.

The parent sends these tables to the child in its job (`tables()`); the child
(`labkit.sandbox.child`) enforces them with its audit hook and by replacing functions
before the program runs. Changing a rule is an edit here, not in the child's code.
"""

from __future__ import annotations

# extension modules whose functions reach the system without an audit event, or load
# native code; the short name is checked, so "x._ctypes" is refused too
BLOCKED_MODULES = ("ctypes", "_ctypes", "_posixsubprocess", "_posixshmem", "_multiprocessing",
                   "_sqlite3", "_tkinter", "readline", "spwd", "ossaudiodev", "nis", "syslog",
                   "_dbm", "_gdbm")
BLOCKED_PREFIXES = ("_test", "_xx", "xxlimited")  # CPython's test and experimental modules

# functions that reach the system without raising an audit event: replaced by one that
# raises the event "labkit.sandbox.denied" (the hook refuses it) and PermissionError
REPLACED_FUNCTIONS = {
    "os": ("mknod", "mkfifo", "chroot", "pidfd_open", "setns", "unshare"),
    "posix": ("mknod", "mkfifo", "chroot", "pidfd_open", "setns", "unshare"),
    "_signal": ("pidfd_send_signal",),
    "_posixsubprocess": ("fork_exec",),
}
# attributes deleted once every built-in module is loaded: `_imp.create_builtin` would
# build fresh copies of `posix` and `_signal` with the original functions
REMOVED_ATTRIBUTES = {"_imp": ("create_builtin",)}

# audit events refused whatever their arguments
DENIED_EVENTS = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "pty.spawn", "os.kill", "os.killpg", "os.link", "os.symlink", "resource.setrlimit",
    "resource.prlimit", "sys.settrace", "sys.setprofile", "sys._current_frames",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "marshal.load",
    "cpython.PyInterpreterState_New", "webbrowser.open",
    "sys.monitoring.register_callback"})  # the last one exists from Python 3.12
DENIED_EVENT_PREFIXES = ("socket.", "ctypes.", "syslog.", "sqlite3.")
# attributes whose reading ("object.__getattr__") is refused: a frame from a traceback (an
# exception raised in the hook carries the hook's own frames, whose state a program could
# change to switch the hook off). Generator and coroutine frames stay readable: asyncio
# reads them. Frames up the stack (sys._getframe, a generator's f_back) still reach the
# child's own state: docs/sandbox.md, "verdict integrity".
FRAME_ATTRIBUTES = frozenset({"tb_frame"})
# socket families "socket.__new__" may create: AF_UNIX (1), a socket that cannot connect,
# bind or sendto (asyncio's self-pipe)
ALLOWED_SOCKET_FAMILIES = frozenset({1})

# event -> (index of the path, index of its dir_fd or None), for each path it names
WRITE_EVENTS = {"os.mkdir": ((0, 2),), "os.rmdir": ((0, 1),), "os.remove": ((0, 1),),
                "os.rename": ((0, 2), (1, 3)), "os.chmod": ((0, 2),),
                "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),),
                "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
                "os.chdir": ((0, None),)}
READ_EVENTS = {"os.listdir": ((0, None),), "os.scandir": ((0, None),),
               "os.getxattr": ((0, None),), "os.listxattr": ((0, None),)}

# readable besides the working directory and the interpreter's sys.path
READABLE_FILES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
READABLE_DIRS = ("/usr/share/zoneinfo", "/usr/lib/zoneinfo", "/usr/share/lib/zoneinfo",
                 "/etc/zoneinfo")  # the time-zone database


def tables() -> dict:
    """The tables above under the keys the child reads from its job."""
    return {"blocked_modules": BLOCKED_MODULES, "blocked_prefixes": BLOCKED_PREFIXES,
            "replaced_functions": REPLACED_FUNCTIONS, "removed_attributes": REMOVED_ATTRIBUTES,
            "denied_events": DENIED_EVENTS, "denied_event_prefixes": DENIED_EVENT_PREFIXES,
            "allowed_socket_families": ALLOWED_SOCKET_FAMILIES,
            "frame_attributes": FRAME_ATTRIBUTES, "write_events": WRITE_EVENTS,
            "read_events": READ_EVENTS, "readable": READABLE_FILES + READABLE_DIRS}
