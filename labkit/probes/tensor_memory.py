"""The peak bytes a run's tensors held: weights, gradients, optimizer states, the reference,
the critic, activations, logits, the KV cache; not the interpreter, the libraries or the
allocator's cache, which the process's resident memory (`perf/mem_mb`) counts too.

On CUDA it is the caching allocator's own peak (`torch.cuda.max_memory_allocated`, which
the trainer reads each step as `perf/mem_mb`: the window's peak is the largest). On the
CPU, torch keeps no such count, so `TensorPeak` reads the allocator's events: torch's
profiler, recording memory, logs every CPU allocation and free of a tensor's storage with
its size, and the running sum over them, in time order, is the bytes held; its maximum is
the peak. The window starts before the model is built, so every tensor the run makes is
counted from its allocation. Not counted: what is not a torch storage (the C decode
kernels' scratch buffers, `labkit.fast.kernels`, a few KiB per call; numpy and tokenizer
memory; tensors mapped from a file without a copy).

The profiler's event buffers cost resident memory: on the embedded model's default run
(32 x 8, a 1000-problem evaluation at step 0 inside the window) the process's peak ends
about 25 MB (4%) higher than with `tensor_peak_step=0`.
"""

from __future__ import annotations

import contextlib
import os

import torch

MIB = 2**20


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints a line to stderr as it starts and as it stops, whatever
    the log level: for that moment only, file descriptor 2 points to /dev/null."""
    try:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class TensorPeak:
    """A window over which the tensors' peak is measured: `start()`, then `stop()` -> the
    peak in MiB; None on the CPU when a profiler of the caller's was already running (a
    second would end the caller's session), so nothing was measured."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._profiler = None
        self._cuda_peaks: list[float] = []
        self.events = 0
        """CPU: the allocation and free events the last window held."""

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def observe(self, allocator_peak_mib: float) -> None:
        """CUDA: one step's allocator peak (the trainer resets it at each step's start)."""
        self._cuda_peaks.append(allocator_peak_mib)

    def start(self) -> TensorPeak:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_peaks = []
            return self
        if torch.autograd._profiler_enabled():  # the caller's own: a second would end it
            return self
        from torch._C._profiler import ProfilerActivity, _ExperimentalConfig
        from torch.autograd import (ProfilerConfig, ProfilerState, _enable_profiler,
                                    _prepare_profiler)

        # the autograd profiler's own switch, not torch.profiler.profile: that one turns
        # every recorded event into a Python object when it stops, several KiB each
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                                _ExperimentalConfig())  # shapes, memory, stack, flops, modules
        with _quiet_stderr():
            _prepare_profiler(config, {ProfilerActivity.CPU})
            _enable_profiler(config, {ProfilerActivity.CPU})
        self._profiler = True
        return self

    def stop(self) -> float | None:
        if self.device.type == "cuda":
            return max(self._cuda_peaks + [torch.cuda.max_memory_allocated(self.device) / MIB])
        if self._profiler is None:
            return None
        from torch.autograd import _disable_profiler

        self._profiler = None
        with _quiet_stderr():
            results = _disable_profiler()
        sizes = allocations(results)
        self.events = len(sizes)
        return peak_of(sizes) / MIB


def allocations(results) -> list[int]:
    """The CPU allocation (+bytes) and free (-bytes) events of a finished profiler window
    (its kineto results), in time order."""
    found = []

    def walk(nodes):
        for node in nodes:
            fields = node.extra_fields
            if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
                found.append((node.start_time_ns, fields.alloc_size))
            walk(node.children)

    walk(results.experimental_event_tree())
    found.sort(key=lambda event: event[0])
    return [size for _, size in found]


def peak_of(sizes: list[int]) -> int:
    """The largest running sum of allocation sizes (frees negative), from 0 at the start."""
    held = peak = 0
    for size in sizes:
        held += size
        peak = max(peak, held)
    return peak
