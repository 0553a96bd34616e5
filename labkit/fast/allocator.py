"""glibc's allocator set to keep freed memory (`keep_freed_memory`), for training on a CPU.

A training step allocates and frees the same tensors of a few MiB over and over (a layer's
activations, their gradients, attention's scores). By default glibc hands a block of the
heap's top back to the system once more than its trim threshold lies free there (twice the
mmap threshold, which glibc raises as blocks are freed, up to 32 MiB), so the next step
takes the same memory again page by page: 60-120 k minor page faults a step on the bench's
small model (docs/performance.md). With the thresholds fixed high, the heap keeps what it
has held and a step after the first faults almost never.

The setting is the process's: it holds for every later allocation, and the resident memory
no longer shrinks when tensors are freed (the peak is what it was). A user's own choice
wins: with any of `USER_SETTINGS` or a `glibc.malloc` tunable in `GLIBC_TUNABLES` set,
nothing changes (the bench's memory workers set one to measure
peaks). Other C libraries (macOS, musl) are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""mallopt's parameter numbers (malloc.h)."""
MMAP_THRESHOLD = 32 << 20
"""Allocations from this size up get their own mapping: glibc's ceiling on 64-bit systems
(the largest value mallopt accepts), where its own threshold ends up after a few frees."""
TRIM_THRESHOLD = 1 << 30
"""Free memory at the heap's top that glibc keeps before handing it back (mallopt takes an
int: at most 2 GiB)."""
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
"""The environment variables through which a user sets glibc's thresholds."""


def user_chose() -> bool:
    """Whether the environment sets glibc's malloc thresholds itself."""
    return any(os.environ.get(name) for name in USER_SETTINGS) or \
        "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def _libc():
    """The process's C library when it is glibc with mallopt, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") else None


_kept = False


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds high (`MMAP_THRESHOLD`, `TRIM_THRESHOLD`), once
    per process; whether they are set so now. False, with nothing changed, where the C
    library is not glibc or the user chose the thresholds (`user_chose`)."""
    global _kept
    if _kept:
        return True
    if user_chose():
        return False
    libc = _libc()
    if libc is None:
        return False
    _kept = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept
