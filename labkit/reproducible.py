"""What makes a run repeat itself bit for bit on one machine.

Two runs of the same config on the same machine log the same `metrics.jsonl` when every
operation they run gives the same bits each time. One of torch's CPU kernels does not: the
backward of advanced indexing, `x[index]`, is `index_put_(..., accumulate=True)`, which adds
the rows of the gradient with atomic adds from several threads, so its sums come in a
different order from call to call (the shared-prompt pass gathers each prompt's KV cache for
its G completions that way). `select_rows` gathers with a backward that adds in index order
(`index_add_`, serial over the index), the same on every call at any thread count.

`set_threads` applies `TrainConfig.threads`. A different thread count changes how the
matrix products split their sums, so runs repeat only at the same count (and on the same
kind of CPU: AVX2 and AVX-512 kernels round differently).
"""

from __future__ import annotations

import torch
from torch import Tensor


class _SelectRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        # a strided gradient (a KV cache's, sliced out of the keys it was joined to) takes
        # index_add_'s element-by-element path on a CPU; a contiguous copy first adds the
        # same values in the same order, row slice by row slice, in a fraction of the time
        return out.index_add_(0, index, grad.contiguous()), None


def select_rows(x: Tensor, index: Tensor) -> Tensor:
    """`x[index]` along dim 0 (index a 1-D integer tensor), whose gradient adds repeated rows
    in the order of `index`: the same bits on every call, unlike the atomic adds of
    `x[index]`'s own backward."""
    if not x.requires_grad:
        return x.index_select(0, index)
    return _SelectRows.apply(x, index)


def select_cache_rows(cache, index: Tensor) -> None:
    """Keep the rows `index` of a KV cache (`index` may repeat rows), in place, through
    `select_rows`: a transformers cache whose layers hold `keys` and `values`; any other
    cache (labkit.fast's among them) uses its own `batch_select_indices`."""
    layers = getattr(cache, "layers", None)
    if layers and all(isinstance(getattr(layer, "keys", None), Tensor)
                      and isinstance(getattr(layer, "values", None), Tensor) for layer in layers):
        for layer in layers:
            layer.keys, layer.values = select_rows(layer.keys, index), select_rows(layer.values, index)
        return
    cache.batch_select_indices(index)


def set_threads(threads: int) -> None:
    """torch's CPU threads for this process: `threads`, or torch's own default when 0."""
    if threads:
        torch.set_num_threads(threads)
