"""labkit.fast.allocator: glibc set to keep freed memory, the user's own setting respected."""

import json
import os
import platform
import subprocess
import sys

import pytest

from labkit.fast import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


class FakeLibc:
    def __init__(self, answer: int = 1):
        self.calls, self.answer = [], answer

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return self.answer


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not set the thresholds yet, with no user setting in its env."""
    monkeypatch.setattr(allocator, "_kept", False)
    for name in allocator.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    libc = FakeLibc()
    monkeypatch.setattr(allocator, "_libc", lambda: libc)
    return libc


def test_the_thresholds_are_set_once_per_process(fresh):
    assert allocator.keep_freed_memory()
    assert fresh.calls == [(-3, 32 * 2**20), (-1, 2**30)]
    assert allocator.keep_freed_memory()
    assert len(fresh.calls) == 2


@pytest.mark.parametrize("name, value", [("MALLOC_MMAP_THRESHOLD_", "65536"),
                                         ("MALLOC_TRIM_THRESHOLD_", "0"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")])
def test_a_users_own_setting_wins(fresh, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert not allocator.keep_freed_memory()
    assert fresh.calls == []


def test_other_tunables_are_not_a_malloc_setting(fresh, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX2")
    assert allocator.keep_freed_memory()


def test_a_refused_setting_is_reported(fresh, monkeypatch):
    libc = FakeLibc(answer=0)
    monkeypatch.setattr(allocator, "_libc", lambda: libc)
    assert not allocator.keep_freed_memory()


def test_nothing_changes_outside_glibc(fresh, monkeypatch):
    monkeypatch.setattr(allocator, "_libc", lambda: None)
    assert not allocator.keep_freed_memory()


def test_the_real_libc_is_found_where_it_is_glibc():
    assert (allocator._libc() is not None) == GLIBC


# twelve blocks of 5 MB taken from malloc, written and freed five times; the minor page
# faults of each time (the C library's malloc itself, as torch's CPU allocator calls it)
FAULTS = """
import ctypes, json, resource, sys
from labkit.fast import allocator
kept = allocator.keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [libc.malloc(5_000_000) for _ in range(12)]
    for block in held:
        ctypes.memset(block, 1, 5_000_000)
    for block in held:
        libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""


def _faults(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in allocator.USER_SETTINGS and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True,
                          env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_kept_memory_is_taken_again_without_page_faults():
    pages = 12 * 5_000_000 // os.sysconf("SC_PAGE_SIZE")
    default, kept = _faults("default"), _faults("keep")
    # by default glibc hands the freed 60 MB back, and every round faults it in again
    assert not default["kept"] and min(default["faults"][1:]) > pages // 2
    assert kept["kept"] and sum(kept["faults"][1:]) < pages // 20


@pytest.mark.parametrize("fast", [True, False])
def test_a_fast_trainer_on_the_cpu_keeps_freed_memory(monkeypatch, fast):
    import labkit.trainer
    from labkit.settings.config import TrainConfig

    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(1))
    labkit.trainer.Trainer(TrainConfig(steps=1, batch_prompts=2, group_size=2, fast=fast,
                                       max_new_tokens=4, eval_n=4, device="cpu"))
    assert calls == ([1] if fast else [])
