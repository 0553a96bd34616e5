"""A floor under one step as labkit runs it (`step_floor`): the step's matrix products replayed
alone, plus its other operations at the cost of the cheapest one torch dispatches."""

from __future__ import annotations

import statistics
import time
from typing import Any, NamedTuple

from labkit.bench.timing import sync

PRODUCTS = ("mm", "bmm", "addmm", "baddbmm", "addbmm", "addmm_", "baddbmm_", "addbmm_",
            "linear", "matmul", "_scaled_dot_product_flash_attention_for_cpu")
"""The aten matrix products. With autograd `F.linear` and `torch.matmul` reach a dispatch
mode as mm, addmm or bmm; in inference mode (the rollout, the reference's pass) as
themselves. The in-place forms add a product into a tensor that holds a sum (the replayed
update's input gradient, `labkit.fast.replay`, adds each product's share with `addmm_`).
The flash-attention kernel for CPUs (the decoder's attention on some CPUs,
`labkit.fast.kv.flash_decode`) counts whole: its two products and the softmax between them
are one kernel, which the batched products it replaces counted as two products and a few
other operations."""
ONEDNN_PRODUCTS = ("default", "binary")
"""Overloads of `torch.ops.mkldnn._linear_pointwise`, the product on weights packed by
oneDNN (`labkit.fast.decoder.weight_form`)."""


class Layout(NamedTuple):
    """What a product's replay needs of one tensor input: its layout, and for a large input
    or a KV cache's the address it was read from (0 for another), so that products which
    read different memory (a decode step's 8 layers' weights and caches) replay on different
    tensors."""

    shape: tuple
    stride: tuple
    dtype: Any
    device: Any
    source: int = 0


DISTINCT_MIN_BYTES = 1 << 20
"""Inputs from this size up are replayed on one tensor per address the step read them
from: replaying every layer's product on one weight would keep it in the CPU's caches and
leave out the memory traffic of reading each layer's own weights, which any implementation
of the step pays. Smaller inputs mostly stay in the caches and share one tensor per layout,
save a KV cache's (`KV_INPUTS`)."""
KV_INPUTS = {"_scaled_dot_product_flash_attention_for_cpu": (1, 2)}
"""Products whose inputs at these positions are a KV cache's keys and values (the decode's
attention, `labkit.fast.kv`), replayed on one tensor per address whatever their size: a
decode step reads each layer's cache once, and between two reads of it streams every
layer's weights, so any implementation reads the cache from memory (docs/performance.md,
"A floor under labkit's step")."""
DISTINCT_BUDGET_BYTES = 4 << 30
"""At most this much memory for the replay's distinct large inputs; past it, large inputs
share one tensor per layout as small ones do (the floor then gets lower, never higher)."""


def step_floor(run_step, device, replays: int = 5) -> dict:
    """A floor under one step as labkit runs it: the step's matrix products replayed alone,
    back to back, plus its other operations at the cost of the cheapest one torch dispatches
    (a bare view, made in C++ with no Python in between).

    `run_step()` runs once under a dispatch mode that counts every operation torch dispatches
    (forward, backward and optimizer, in inference mode or not) and records the inputs'
    layouts (shapes, strides, dtypes) of each matrix product. The products are replayed on
    random inputs of those layouts (one tensor per distinct layout, and for inputs of
    `DISTINCT_MIN_BYTES` or more, and a KV cache's at any size (`KV_INPUTS`), one per
    address they were read from; a weight packed by oneDNN is replayed itself), and as many
    views as the step had other operations are made by one `unbind`; each figure is the
    median of `replays` timings. The step is recorded with `labkit.fast.kernels` off: the
    decode's norms, RoPE, attention and SwiGLU, which the kernels run outside torch, count
    as the torch operations they replace (the attention among the products). Every
    operation of the step is counted at no more than its cost, and none of the step's
    Python runs, so the step takes longer than `floor_s` unless the kernels beat the torch
    operations they replace by more than the step's Python costs (on CUDA, where the host's
    dispatching overlaps the device's products: than the larger of the two)."""
    import torch

    from labkit.fast import kernels

    with kernels.off():  # the decode's attention as torch operations, counted as products
        calls, dispatched = record_products(run_step)
    replay = replay_inputs(calls)
    probe = torch.zeros(dispatched - len(calls), device=device)

    def products_once():
        for func, args, kwargs in replay:
            func(*args, **kwargs)

    def others_once():
        probe.unbind()

    held = {a.data_ptr(): a.untyped_storage().nbytes() for _, args, _ in replay for a in args
            if isinstance(a, torch.Tensor) and not a.is_mkldnn}
    products_s = median_seconds(products_once, replays)
    others_s = median_seconds(others_once, replays)
    on_cpu = torch.device(device).type == "cpu"
    return {"floor_s": products_s + others_s if on_cpu else max(products_s, others_s),
            "floor_products_s": products_s, "floor_others_s": others_s,
            "floor_ops": dispatched, "floor_products": len(calls),
            "floor_replay_mb": sum(held.values()) / 2**20}


def record_products(run_step) -> tuple[list, int]:
    """Run `run_step()` once; its matrix products as (func, input layouts, kwargs), and the
    count of every operation it dispatched."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    products = {getattr(torch.ops.aten, name).default for name in PRODUCTS}
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        products |= {getattr(torch.ops.mkldnn._linear_pointwise, name)
                     for name in ONEDNN_PRODUCTS}
    kv_inputs = {getattr(torch.ops.aten, name).default: at for name, at in KV_INPUTS.items()}
    calls, dispatched = [], [0]

    def layout(arg, by_address: bool):
        if isinstance(arg, torch.Tensor) and arg.is_mkldnn:
            return arg  # a packed weight has no strides to copy: the replay reads it itself
        if isinstance(arg, torch.Tensor):
            large = by_address or arg.numel() * arg.element_size() >= DISTINCT_MIN_BYTES
            return Layout(tuple(arg.shape), arg.stride(), arg.dtype, arg.device,
                          arg.data_ptr() if large else 0)
        return arg

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            dispatched[0] += 1
            if func in products:
                kv = kv_inputs.get(func, ())
                calls.append((func, [layout(a, i in kv) for i, a in enumerate(args)],
                              dict(kwargs or {})))
            return func(*args, **(kwargs or {}))

    with Recorder():
        run_step()
    return calls, dispatched[0]


def replay_inputs(calls: list, budget: int = DISTINCT_BUDGET_BYTES) -> list:
    """The recorded products with random tensors of their inputs' layouts in place of the
    layouts: one tensor per distinct layout, and for an input read by address one tensor per
    address (as long as the most the step read from there, each layout a view of it; a KV
    cache read at a growing length is one buffer), those within `budget` bytes (beyond it,
    one per layout)."""
    import torch

    def extent(arg: Layout) -> int:  # elements spanned; strides may overlap (a gradient)
        return 1 + sum((n - 1) * st for n, st in zip(arg.shape, arg.stride) if n > 0)

    longest: dict = {}
    for _, args, _ in calls:
        for arg in args:
            if isinstance(arg, Layout) and arg.source:
                key = (arg.source, arg.dtype, arg.device)
                longest[key] = max(longest.get(key, 0), extent(arg))
    bases, made, spent = {}, {}, [0]

    def fresh(arg):
        if not isinstance(arg, Layout):
            return arg
        key = (arg.source, arg.dtype, arg.device)
        if arg.source and key not in bases:
            size = longest[key] * torch.empty((), dtype=arg.dtype).element_size()
            if spent[0] + size <= budget:
                bases[key] = torch.empty(longest[key], dtype=arg.dtype,
                                         device=arg.device).normal_()
                spent[0] += size
        if arg.source and key in bases:
            return bases[key].as_strided(arg.shape, arg.stride)
        shared = arg._replace(source=0)
        if shared not in made:
            base = torch.empty(extent(shared), dtype=arg.dtype, device=arg.device).normal_()
            made[shared] = base.as_strided(arg.shape, arg.stride)
        return made[shared]

    return [(func, [fresh(a) for a in args], kwargs) for func, args, kwargs in calls]


def median_seconds(fn, replays: int) -> float:
    """The median of `replays` timings of `fn()`, after one untimed call."""
    fn()  # warm-up
    times = []
    for _ in range(replays):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
