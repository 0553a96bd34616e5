"""Input checks shared by the pure tensor modules (advantages, losses, metrics) and by the
rewards (`per_completion`: a keyword column with one entry per completion).

Each returns the checked input in the form the math wants (detached fp32, a bool mask) or
raises ValueError naming the argument and the rule. `NonFiniteError` is the one error for a
NaN or inf where a finite number is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class NonFiniteError(ValueError):
    """NaN or inf where a finite number is needed: in the rewards or values given, or in a
    result too large for the dtype. A training run stops on it with a checkpoint."""


def as_float(x) -> Tensor:
    """Detached, at least fp32: float64 stays float64, everything else becomes fp32."""
    x = torch.as_tensor(x).detach()
    return x if x.dtype == torch.float64 else x.float()


def bool_mask(mask, n: int, device) -> Tensor:
    """The mask as bool `(N, T)`, after checking it is 2-D with `n` rows."""
    mask = torch.as_tensor(mask)
    if mask.dim() != 2 or mask.shape[0] != n:
        raise ValueError(f"mask must be (N, T) with N={n} rows, got shape {tuple(mask.shape)}")
    return mask.to(device) != 0


def check_mask(x: Tensor, mask, name: str) -> Tensor:
    """The mask as bool `(N, T)`, after checking that `x` has its shape."""
    m = bool_mask(mask, x.shape[0] if x.dim() else -1, x.device)
    if tuple(x.shape) != tuple(m.shape):
        raise ValueError(f"{name} shape {tuple(x.shape)} must equal mask shape {tuple(m.shape)}")
    return m


def float_tensor(x, name: str, ndims: tuple[int, ...]) -> Tensor:
    """x as an fp32 tensor on its own device, non-empty, with one of the allowed numbers of
    dims (1: `(N,)`, 2: `(N, T)`); TypeError when x is not array-like."""
    if not isinstance(x, Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}") from err
    if x.ndim not in ndims or x.numel() == 0:
        want = " or ".join({1: "(N,)", 2: "(N, T)"}[d] for d in ndims)
        raise ValueError(f"{name} must be a non-empty {want} tensor, got shape {tuple(x.shape)}")
    return x.float()


def zero_one(x, name: str, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """A 0/1 (or bool) tensor of exactly `shape`, as bool on `device`."""
    t = float_tensor(x, name, (len(shape),))
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not ((t == 0) | (t == 1)).all():
        raise ValueError(f"{name} must hold only 0 and 1 (or bool)")
    return t.to(device) != 0


def float_like(x, name: str, ref: Tensor, ref_name: str) -> Tensor:
    """An fp32 tensor of the same shape as `ref`, on its device."""
    t = float_tensor(x, name, (ref.ndim,))
    if t.shape != ref.shape:
        raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, "
                         f"got {tuple(t.shape)}")
    return t.to(ref.device)


__all__ = ["NonFiniteError", "as_float", "bool_mask", "check_mask", "float_tensor", "zero_one",
           "float_like"]


def per_completion(values, name: str, completions: Sequence, missing: str) -> None:
    """Check a keyword column a reward reads (TRL passes dataset columns as keywords): given
    (else ValueError(`missing`)), a list rather than one string, one entry per completion."""
    if values is None:
        raise ValueError(missing)
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ValueError(f"{name} must be a list with one entry per completion, "
                         f"got {type(values).__name__}")
    if len(values) != len(completions):
        raise ValueError(f"{name} has {len(values)} entries but completions has "
                         f"{len(completions)}: one entry per completion")
