"""A sandboxed child's pipes and process group: the job written to its stdin, its stdout,
stderr and report read (their tails kept) until it exits or the deadline passes, then its
whole process group killed and waited for, and its working folder removed."""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import time

from labkit.sandbox.verdict import OUTPUT_LIMIT, REPORT_LIMIT


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


def group_gone(pgid: int, patience: float = 2.0) -> None:
    """Wait (a little) until no process of the group is left: the jail's processes take a
    few milliseconds to tear their namespaces down after the kill."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.002)


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
