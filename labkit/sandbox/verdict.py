"""What happened to one program: the ExecResult, and how a finished child is judged."""

from __future__ import annotations

import signal
from dataclasses import dataclass

STATUSES = ("passed", "failed", "error", "timeout", "memory", "blocked")
OUTPUT_LIMIT = 16 * 1024  # bytes kept of stdout and of stderr: the last ones
REPORT_LIMIT = 64 * 1024  # more than this on the report pipe is a program writing to it


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


def text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def verdict(report: bytes | None, nonce: str, timed_out: bool, returncode: int,
            stderr: bytes, timeout: float, cpu_s: int) -> tuple[str, str]:
    """(status, detail) of a finished child: a refused action first, then the deadline,
    then the outcome the child reported with the right token, then how it ended. `report`
    is what the child wrote to its report pipe, None if it wrote more than REPORT_LIMIT."""
    if report is None:
        return "error", f"the program wrote more than {REPORT_LIMIT} bytes to the report pipe"
    lines = text(report).splitlines()
    blocked = [line.split("\t", 1)[1] for line in lines if line.startswith("blocked\t")]
    if blocked:
        more = f" (and {len(blocked) - 1} more)" if len(blocked) > 1 else ""
        return "blocked", f"the sandbox refused {blocked[0]}{more}"
    if timed_out:
        return "timeout", f"no result within the {timeout:g} s wall-clock limit"
    outcomes = [line[len(nonce) + 1:] for line in lines if line.startswith(nonce + "\t")]
    if outcomes:
        status, _, detail = outcomes[-1].partition("\t")
        if status in STATUSES:
            return status, detail
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout", f"the {cpu_s} s CPU-time limit was reached"
    if b"MemoryError" in stderr:
        return "memory", "the program ran out of memory"
    if returncode < 0:
        return "error", f"the program was killed by signal {-returncode}"
    return "error", f"the program exited (code {returncode}) before the tests finished"
