"""A floor under one step as labkit runs it (`step_floor`): the step's matrix products replayed
alone, plus its other operations at the cost of the cheapest one torch dispatches."""

from __future__ import annotations

import statistics
import time
from typing import Any, NamedTuple

from labkit.bench.timing import sync

PRODUCTS = ("mm", "bmm", "addmm", "baddbmm", "addbmm")
"""The aten matrix products (`F.linear` and `torch.matmul` reach torch's dispatcher as these)."""


class Layout(NamedTuple):
    """What a product's replay needs of one tensor input."""

    shape: tuple
    stride: tuple
    dtype: Any
    device: Any


def step_floor(run_step, device, replays: int = 5) -> dict:
    """A floor under one step as labkit runs it: the step's matrix products replayed alone,
    back to back, plus its other operations at the cost of the cheapest one torch dispatches
    (a bare view, made in C++ with no Python in between).

    `run_step()` runs once under a dispatch mode that counts every operation torch dispatches
    (forward, backward and optimizer, in inference mode or not) and records the inputs'
    layouts (shapes, strides, dtypes) of each matrix product. The products are replayed on
    random inputs of those layouts (one tensor per distinct layout), and as many views as the
    step had other operations are made by one `unbind`; each figure is the median of
    `replays` timings. Every operation of the step is counted at no more than its cost, and
    none of the step's Python runs, so the step takes longer than `floor_s` (on CUDA, where
    the host's dispatching overlaps the device's products: than the larger of the two)."""
    import torch

    calls, dispatched = record_products(run_step)
    replay = replay_inputs(calls)
    probe = torch.zeros(dispatched - len(calls), device=device)

    def products_once():
        for func, args, kwargs in replay:
            func(*args, **kwargs)

    def others_once():
        probe.unbind()

    products_s = median_seconds(products_once, replays)
    others_s = median_seconds(others_once, replays)
    on_cpu = torch.device(device).type == "cpu"
    return {"floor_s": products_s + others_s if on_cpu else max(products_s, others_s),
            "floor_products_s": products_s, "floor_others_s": others_s,
            "floor_ops": dispatched, "floor_products": len(calls)}


def record_products(run_step) -> tuple[list, int]:
    """Run `run_step()` once; its matrix products as (func, input layouts, kwargs), and the
    count of every operation it dispatched."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    products = {getattr(torch.ops.aten, name).default for name in PRODUCTS}
    calls, dispatched = [], [0]

    def layout(arg):
        if isinstance(arg, torch.Tensor):
            return Layout(tuple(arg.shape), arg.stride(), arg.dtype, arg.device)
        return arg

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            dispatched[0] += 1
            if func in products:
                calls.append((func, [layout(a) for a in args], dict(kwargs or {})))
            return func(*args, **(kwargs or {}))

    with Recorder():
        run_step()
    return calls, dispatched[0]


def replay_inputs(calls: list) -> list:
    """The recorded products with random tensors of their inputs' layouts in place of the
    layouts: one tensor per distinct layout."""
    import torch

    made = {}

    def fresh(arg):
        if not isinstance(arg, Layout):
            return arg
        if arg not in made:  # strides may overlap (an expanded gradient)
            extent = 1 + sum((n - 1) * st for n, st in zip(arg.shape, arg.stride) if n > 0)
            base = torch.empty(extent, dtype=arg.dtype, device=arg.device).normal_()
            made[arg] = base.as_strided(arg.shape, arg.stride)
        return made[arg]

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
