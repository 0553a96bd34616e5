"""The decode step's work between its products as three C functions (`kernels.c`): RMSNorm,
SwiGLU, and RoPE with the step's attention over the KV cache.

On a small model a decode step is some seventy torch operations on a few thousand numbers
each, and each operation costs a few microseconds of dispatch whatever its size: with the
three functions the embedded model's decode step is 29 torch operations and seven calls
to C, against 69 (95 reading a shared prompt) without. They are compiled once per machine with
its C compiler (`CC`, else cc, gcc or clang), into `LABKIT_KERNELS_DIR` (default
~/.cache/labkit/kernels), and loaded with ctypes: no build step at install, no torch
headers. Where no compiler is found or the build fails, `load()` is None, `reason()` says
why and the decoder runs its torch operations. `LABKIT_KERNELS=0` turns them off. The
attention shares its (group, head) work among torch's own threads where torch runs on GNU
OpenMP (`openmp_runtime`; `torch.get_num_threads()` of them), each item computed as on one
thread, so the thread count moves no bit.

`labkit.fast.decoder` uses them on a CPU for fp32 models under `FUSED_MAX_PARAMS`, with
either KV strategy (its keys kept (position, D): `by_row`); `tests/test_kernels.py` holds
each function to the torch operations it replaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

from labkit import cbuild

SOURCE = Path(__file__).with_name("kernels.c")

FUSED_MAX_PARAMS = 32_000_000
"""The decoder uses the kernels for models with fewer parameters than this: measured faster
on the embedded model (0.44 M) and on the bench's small one (26 M), docs/performance.md.
Larger models are unmeasured; the norms and SwiGLU run on one thread, the attention on torch's
(`openmp_runtime`)."""
OPENMP_ENTRIES = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
"""What the attention takes of GNU OpenMP's runtime: the call a compiled parallel region
makes, and a team member's number and the team's size."""

_FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math")
_NATIVE = ("-march=native",)
_reason: str | None = None
_held_off = 0


def _compiler() -> str | None:
    return cbuild.compiler()


def _cpu_signature() -> str:
    """What a -march=native build depends on: the CPU's feature flags where Linux lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cache_dir() -> Path:
    named = os.environ.get("LABKIT_KERNELS_DIR")
    if named:
        return Path(named).expanduser()
    return cbuild.cache_root() / "kernels"


def _build(compiler: str, target: Path) -> str | None:
    """Compile SOURCE into target (atomically: a finished file or none); the error, or None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    error = None
    try:
        for extra in (_NATIVE, ()):  # -march=native where the compiler takes it
            cmd = [compiler, *_FLAGS, *extra, str(SOURCE), "-o", scratch, "-lm"]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"{compiler} could not run: {e}"
            if done.returncode == 0:
                os.replace(scratch, target)
                return None
            error = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return f"{compiler} failed to build {SOURCE.name}: {error[0]}"
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


class Kernels:
    """The loaded library; each method checks its tensors, then calls C."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.lk_rms_rows.argtypes = [p, p, i64, i64, f32]
        lib.lk_swiglu.argtypes = [p, p, i64, i64]
        lib.lk_rope_attend.argtypes = [p, p, p, i64, p, p, p, i64, i64, p, p, p, i64, i64, p,
                                       i64, i64, i64, i64, i64]
        lib.lk_use_openmp.argtypes = [p, p, p]
        for f in (lib.lk_rms_rows, lib.lk_swiglu, lib.lk_rope_attend, lib.lk_use_openmp):
            f.restype = None
        runtime = openmp_runtime()
        if runtime is not None:
            lib.lk_use_openmp(*(ctypes.cast(getattr(runtime, name), p)
                                for name in OPENMP_ENTRIES))
        self.lib, self.path = lib, path
        self.threaded = runtime is not None
        """Whether the attention runs on torch's OpenMP threads (`openmp_runtime`)."""

    def rms_rows(self, x: Tensor, eps: float) -> Tensor:
        """x / sqrt(mean(x^2, -1) + eps) for x (rows, n)."""
        _check(x, "x", 2)
        out = torch.empty_like(x)
        self.lib.lk_rms_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def swiglu(self, gate_up: Tensor) -> Tensor:
        """silu(gate) * up for gate_up (rows, 2 I) holding gate then up: (rows, I)."""
        _check(gate_up, "gate_up", 2)
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self.lib.lk_swiglu(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def rope_attend(self, qkv: Tensor, cos: Tensor, sin: Tensor, keys: Tensor,
                    values: Tensor, bias: Tensor | None, col: int,
                    shared: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
        """One decode step's attention: qkv (N, (H + 2 Hkv) D), the scale already in q;
        cos, sin (N, D), their rows possibly apart; keys, values (N, Hkv, S, D), which take
        this step's rotated k and its v at position col and are read up to it, with bias
        (N, S) or None. `shared`: each group of G rows' prompt, read before the rows' own
        keys: keys and values (N / G, Hkv, P, D) and bias (N / G, P). Returns (N, H D)."""
        _check(qkv, "qkv", 2)
        _check(keys, "keys", 4)
        _check(values, "values", 4)
        N, Hkv, S, D = keys.shape
        H = qkv.shape[1] // D - 2 * Hkv
        table = (N, D)
        if bias is not None:
            _check(bias, "bias", 2)
        if H < 1 or H % Hkv or qkv.shape[1] % D or D % 2 or qkv.shape[0] != N \
                or values.shape != keys.shape or not 0 <= col < S \
                or (bias is not None and bias.shape != (N, S)) \
                or cos.shape != table or sin.shape != table or cos.stride() != sin.stride() \
                or cos.stride(1) != 1 or cos.dtype != torch.float32 \
                or sin.dtype != torch.float32:
            raise ValueError(
                f"rope_attend: qkv {tuple(qkv.shape)}, keys and values {tuple(keys.shape)} "
                f"(N, Hkv, S, D), bias {None if bias is None else tuple(bias.shape)}, cos "
                f"{tuple(cos.shape)} and col {col} do not fit: qkv must be (N, (H + 2 Hkv) "
                "D) with H a multiple of Hkv, D even, bias (N, S), cos and sin fp32 (N, D) "
                "alike with unit column stride, 0 <= col < S")
        prompt = (None, None, None, 0, 1)
        if shared is not None:
            shared_keys, shared_values, shared_bias = shared
            _check(shared_keys, "shared keys", 4)
            _check(shared_values, "shared values", 4)
            _check(shared_bias, "shared bias", 2)
            B, P = shared_bias.shape
            if B < 1 or N % B or shared_keys.shape != (B, Hkv, P, D) \
                    or shared_values.shape != shared_keys.shape:
                raise ValueError(
                    f"rope_attend: shared keys and values {tuple(shared_keys.shape)} and bias "
                    f"{(B, P)} do not fit {N} rows: (B, Hkv, P, D) and (B, P), B dividing N")
            prompt = (shared_keys.data_ptr(), shared_values.data_ptr(),
                      shared_bias.data_ptr(), P, N // B)
        out = qkv.new_empty(N, H * D)
        self.lib.lk_rope_attend(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                                keys.data_ptr(), values.data_ptr(),
                                None if bias is None else bias.data_ptr(), S, col, *prompt,
                                out.data_ptr(), N, H, Hkv, D, torch.get_num_threads())
        return out


def openmp_runtime() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime (libgomp) this process has loaded, which torch's own threads
    run on, or None (another runtime, none, or not Linux). The attention kernel runs its
    work on that runtime's threads through the entry points GCC compiles a parallel region
    into, so it shares torch's threads (idle and waiting between torch's operations) rather
    than starting threads of its own that would compete with them for the cores."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if not Path(path).name.startswith("libgomp"):
            continue
        try:
            runtime = ctypes.CDLL(path)
        except OSError:
            continue
        if all(hasattr(runtime, name) for name in OPENMP_ENTRIES):
            return runtime
    return None


def _check(t: Tensor, name: str, dims: int) -> None:
    if t.dtype is not torch.float32 or not t.is_cpu or t.dim() != dims \
            or not t.is_contiguous():
        raise ValueError(f"labkit.fast.kernels: {name} must be a contiguous fp32 CPU tensor "
                         f"of {dims} dimensions, got {t.dtype} {tuple(t.shape)} on {t.device}")


@functools.cache
def load() -> Kernels | None:
    """The kernels, built on first use; None where they are off or cannot be built
    (`reason()` says why; a warning says it once, unless `LABKIT_KERNELS=0` asked)."""
    global _reason
    if os.environ.get("LABKIT_KERNELS", "1").strip().lower() in ("0", "false", "off", "no"):
        _reason = "turned off by LABKIT_KERNELS"
        return None
    compiler = _compiler()
    if compiler is None:
        _reason = "no C compiler (CC, cc, gcc or clang) was found"
    else:
        key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, " ".join(_FLAGS),
                                        _cpu_signature(), sys.platform]).encode()).hexdigest()
        target = cache_dir() / f"labkit_kernels_{key[:16]}.so"
        try:
            built = not target.exists()
            _reason = _build(compiler, target) if built else None
            if _reason is None:
                if built:  # once per machine: say what was built and how to turn it off
                    print(f"labkit.fast.kernels: built the C decode kernels into {target} "
                          f"with {compiler}; LABKIT_KERNELS=0 turns them off", file=sys.stderr)
                return Kernels(target)
        except OSError as e:
            _reason = f"could not build or load {target}: {e}"
    warnings.warn(f"labkit.fast.kernels: {_reason}; a small model's decode steps run on "
                  "torch operations instead (slower)", stacklevel=2)
    return None


@contextlib.contextmanager
def off():
    """Decoders built inside run torch operations, kernels or not (the bench's step floor
    records a step so, to count the decode's attention among its products)."""
    global _held_off
    _held_off += 1
    try:
        yield
    finally:
        _held_off -= 1


def held_off() -> bool:
    """Whether an `off()` block is open."""
    return _held_off > 0


def reason() -> str | None:
    """Why `load()` gave None (None when it gave the kernels or was not yet asked)."""
    return _reason
