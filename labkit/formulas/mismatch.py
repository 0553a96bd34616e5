"""The sampler-learner mismatch: importance weights and rejection between the policy that
sampled a rollout and the same policy as the learner computes it.

The sampler (a fast decoder, another precision, another temperature, or vLLM elsewhere)
and the learner (teacher-forced scoring) give the same tokens slightly different
log-probabilities. log_ratio = log pi_learner - log pi_sampler `(N, T)`, per sampled token.
PPO's ratio then compares the current policy with the learner's old one, and these weights
carry the rest (verl's rollout correction, TRL's importance-sampling correction):

- `is_weights`: truncated importance sampling (TIS: min(w, cap)), per token or per sequence
  (w = exp(sum_t log_ratio)), or with a lower bound the IcePop / masked form: weights outside
  [low, cap] become 0. Constants: they carry no gradient.
- `keep_sequences`: rejection of whole sequences whose geometric-mean ratio exp(mean_t
  log_ratio) leaves [low, high].
- `mismatch_stats`: how far apart the two are (ratio statistics, the log-perplexity gap).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SAFETY = 20.0
"""log-ratios are clamped to [-20, 20] before exp (as verl), so a weight stays finite."""


def _bool(mask: Tensor) -> Tensor:
    return mask.bool()


def is_weights(log_ratio: Tensor, mask: Tensor, *, level: str = "token", cap: float = 2.0,
               low: float | None = None) -> Tensor:
    """Importance weights `(N, T)` from log_ratio `(N, T)`: exp(log_ratio) per token, or
    exp(sum_t log_ratio) on every token of a row for level="sequence"; then truncated at
    `cap` (TIS), or with `low` set, 0 outside [low, cap] (IcePop / masked IS). 0 on padding;
    detached."""
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if not cap > 0 or (low is not None and not 0 < low <= cap):
        raise ValueError(f"the weights' band needs cap > 0 and 0 < low <= cap, got cap={cap!r},"
                         f" low={low!r}")
    m = _bool(mask)
    lr = torch.where(m, log_ratio.detach(), torch.zeros((), dtype=log_ratio.dtype))
    if level == "sequence":
        lr = lr.sum(1, keepdim=True).expand_as(lr)
    w = torch.exp(lr.clamp(-SAFETY, SAFETY))
    if low is None:
        w = w.clamp(max=cap)
    else:
        w = torch.where((w >= low) & (w <= cap), w, torch.zeros_like(w))
    return torch.where(m, w, torch.zeros_like(w))


def keep_sequences(log_ratio: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """(N,) bool: rows whose geometric-mean ratio exp(mean_t log_ratio) lies in [low, high]
    (verl's seq_mean_k1 rejection with its bounds 1/high, 1/low; a row without tokens is
    kept)."""
    if not 0 < low <= high:
        raise ValueError(f"the kept band needs 0 < low <= high, got [{low!r}, {high!r}]")
    m = _bool(mask)
    lr = torch.where(m, log_ratio.detach(), torch.zeros((), dtype=log_ratio.dtype))
    mean = lr.clamp(-SAFETY, SAFETY).sum(1) / m.sum(1).clamp(min=1)
    return (mean >= math.log(low)) & (mean <= math.log(high))


def mismatch_stats(learner_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict:
    """`mismatch/ratio_mean`, `mismatch/ratio_max` (token ratios learner / sampler over the
    real tokens) and `mismatch/log_ppl_diff`: the mean over rows of the difference of
    log-perplexities, mean_t(-log pi_sampler) - mean_t(-log pi_learner)."""
    m = _bool(mask)
    if not m.any():
        return {}
    lr = (learner_logp - sampler_logp).detach()
    ratio = torch.exp(lr[m].clamp(-SAFETY, SAFETY))
    per_row = torch.where(m, lr, torch.zeros_like(lr)).sum(1) / m.sum(1).clamp(min=1)
    rows = m.any(1)
    return {"mismatch/ratio_mean": float(ratio.mean()), "mismatch/ratio_max": float(ratio.max()),
            "mismatch/log_ppl_diff": float(per_row[rows].mean())}


__all__ = ["is_weights", "keep_sequences", "mismatch_stats", "SAFETY"]
