"""Monitoring metrics of one RL step: pure functions from plain tensors to Python floats.

Every key lives in one namespace table, `METRICS` (defined in `labkit.formulas.metric_table`), from
which docs/metrics.md is generated.
Shapes use the letters B prompts, G completions per prompt (the group), T
completion tokens, N = B*G rows; `mask` (N, T) is 1 on real completion tokens (EOS
included), 0 on padding. Inputs may be any float dtype on any device; the math runs in fp32
on that device. Values at masked positions are ignored, even NaN or inf; non-finite values
at unmasked positions propagate into the result.

Degenerate cases return defined numbers, never NaN: an empty selection (an all-zero mask)
gives 0.0; a std divides by the count (population std) unless a function says otherwise,
so one value has std 0; see `cgc` and `explained_variance` for their zero-denominator rules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from labkit.answers import is_worked, written_steps
from labkit.checks import float_like, float_tensor, zero_one
from labkit.formulas.metric_table import METRICS  # the table lives there; re-exported here

_KEY = re.compile(r"^[a-z][a-z0-9_]*/\S+$")


def metrics_table() -> str:
    """`METRICS` as a Markdown table, one row per key, in the table's order."""
    rows = ["| key | definition |", "|---|---|"]
    rows += [f"| `{k}` | {v.replace('|', chr(92) + '|')} |" for k, v in METRICS.items()]
    return "\n".join(rows)


# ---------------------------------------------------------------------------- validation

def _groups(x: Tensor, group_size: int, name: str) -> Tensor:
    """(N,) -> (B, G), checking that group_size divides N."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if x.shape[0] % group_size:
        raise ValueError(f"group_size={group_size} must divide the {x.shape[0]} rows of {name}")
    return x.reshape(-1, group_size)  # (B, G)


def _std(x: Tensor, dim: int | None = None, correction: int = 0) -> Tensor:
    # shifting by one member leaves the std unchanged and makes equal values give exactly 0
    shift = x.flatten()[:1] if dim is None else x.narrow(dim, 0, 1)
    d = x - shift
    return d.std(correction=correction) if dim is None else d.std(dim=dim, correction=correction)


def _row_scalars(adv: Tensor, mask, name: str) -> Tensor:
    """(N,) as is; (N, T) -> (N,) mean over each row's unmasked tokens (0 when it has none)."""
    if adv.ndim == 1:
        return adv
    if mask is None:
        raise ValueError(f"mask is required when {name} is (N, T)")
    m = zero_one(mask, "mask", tuple(adv.shape), adv.device)
    return torch.where(m, adv, 0.0).sum(1) / m.sum(1).clamp(min=1)


# ---------------------------------------------------------------------------- metrics

def masked_mean(x, mask) -> float:
    """Mean of x (N, T) over the positions where mask (N, T) is 1; 0.0 when none is."""
    x = float_tensor(x, "x", (1, 2))
    vals = x[zero_one(mask, "mask", tuple(x.shape), x.device)]
    return vals.mean().item() if vals.numel() else 0.0


def reward_stats(rewards, group_size: int) -> dict[str, float]:
    """Reward figures of one rollout batch. rewards (N,) with N = B*G, group-major.

    `rollout/reward_std` and `rollout/group_reward_std` divide by the count (N, G), so
    group_size=1 gives a group std of 0 and every group counts as zero-std. A group is
    zero-std when its rewards are exactly equal: its GRPO advantage is 0, it teaches nothing.
    """
    r = float_tensor(rewards, "rewards", (1,))
    g = _groups(r, group_size, "rewards")  # (B, G)
    return {"rollout/reward_mean": r.mean().item(),
            "rollout/reward_std": _std(r).item(),
            "rollout/frac_zero_std": (g.amax(1) == g.amin(1)).float().mean().item(),
            "rollout/group_reward_std": _std(g, dim=1).mean().item()}


def gav(advantages, group_size: int, *, mask=None, unbiased: bool = False) -> float:
    """Group advantage variance: mean over the B groups of std_g(A_i).

    Despite its name, GAV is defined as a standard deviation, not a variance, and so is it
    here. advantages (N,) one per completion, or
    (N, T) per token with mask (N, T): each row is first reduced to the mean over its
    unmasked tokens (0 for an all-masked row). That recovers A_i for the uniform token
    distribution and for PPO's GAE gives the row's mean token advantage; for the discounted
    distribution it gives A_i / T_i, so pass the (N,) advantages when you have them.
    unbiased=False divides by G (a group of one has std 0); True divides by G - 1 and needs
    group_size >= 2.
    """
    a = float_tensor(advantages, "advantages", (1, 2))
    g = _groups(_row_scalars(a, mask, "advantages"), group_size, "advantages")  # (B, G)
    if unbiased and group_size < 2:
        raise ValueError("the unbiased std divides by G - 1: it needs group_size >= 2")
    return _std(g, dim=1, correction=int(unbiased)).mean().item()


def tlcr(logp, old_logp, advantages, mask, *, eps_low: float, eps_high: float,
         dual_clip: float | None = None) -> dict[str, float]:
    """Token-level clip ratio (TLCR) of the clipped surrogate; ratio = exp(logp - old_logp).

    logp, old_logp, mask (N, T); advantages (N,) (one per row, broadcast) or (N, T).
    A clip is counted only where it is active, i.e. where it cuts the gradient:
    `clip/low` ratio < 1 - eps_low with A < 0, `clip/high` ratio > 1 + eps_high with A > 0,
    as fractions of the unmasked tokens; `clip/total` is their sum. With dual_clip = c (> 1),
    `clip/dual` counts tokens with A < 0 whose loss the dual clip caps at -c * A, i.e.
    max(ratio, clip(ratio)) > c. All-masked: every fraction 0.0. This counts token ratios;
    a sequence-level (GSPO) loss clips per sequence, so log that loss's own counts instead.
    """
    lp = float_tensor(logp, "logp", (2,))
    old = float_like(old_logp, "old_logp", lp, "logp")
    m = zero_one(mask, "mask", tuple(lp.shape), lp.device)
    a = float_tensor(advantages, "advantages", (1, 2)).to(lp.device)
    if a.shape != lp.shape and tuple(a.shape) != (lp.shape[0],):
        raise ValueError(f"advantages must be (N,) = ({lp.shape[0]},) or (N, T) = "
                         f"{tuple(lp.shape)}, got {tuple(a.shape)}")
    if not 0 <= eps_low < 1 or not eps_high >= 0:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be None or > 1, got {dual_clip}")
    a = a.unsqueeze(1).expand_as(lp) if a.ndim == 1 else a
    ratio = torch.exp(lp - old)
    n = m.sum().clamp(min=1)

    def frac(hit: Tensor) -> float:
        return ((hit & m).sum() / n).item()

    low, high = (ratio < 1 - eps_low) & (a < 0), (ratio > 1 + eps_high) & (a > 0)
    # total from the count, not low + high, so rounding cannot push it above 1
    out = {"clip/low": frac(low), "clip/high": frac(high), "clip/total": frac(low | high)}
    if dual_clip is not None:
        capped = torch.maximum(ratio, ratio.clamp(1 - eps_low, 1 + eps_high)) > dual_clip
        out["clip/dual"] = frac(capped & (a < 0))
    return out


def ratio_stats(logp, old_logp, mask) -> dict[str, float]:
    """`ratio/mean` and `ratio/max` of exp(logp - old_logp) over unmasked tokens; (N, T) each.

    All-masked: both 1.0, the on-policy value. A log-ratio above ~88 overflows fp32 to inf.
    """
    lp = float_tensor(logp, "logp", (2,))
    old = float_like(old_logp, "old_logp", lp, "logp")
    ratio = torch.exp(lp - old)[zero_one(mask, "mask", tuple(lp.shape), lp.device)]
    if not ratio.numel():
        return {"ratio/mean": 1.0, "ratio/max": 1.0}
    return {"ratio/mean": ratio.mean().item(), "ratio/max": ratio.max().item()}


def cgc(rewards, group_size: int, *, eps: float = 1e-8) -> float:
    """Cross-group consistency: mean over prompts of std_g(r) / |mean_g(r)|, on fixed eval prompts.

    rewards (N,) = G rewards for each of B prompts, group-major; the std divides by G. The
    coefficient of variation is undefined when a prompt's mean reward is 0, and tends to
    infinity as a 0/1 success rate tends to 0, so prompts with |mean| <= eps are skipped
    rather than counted as 0. When every prompt is skipped (e.g. the model fails them all)
    the result is 0.0: read it together with eval/accuracy. |mean| keeps the value >= 0 for
    rewards that can be negative.
    """
    r = float_tensor(rewards, "rewards", (1,))
    g = _groups(r, group_size, "rewards")  # (B, G)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    mean = g.mean(1).abs()
    keep = mean > eps
    if not keep.any():
        return 0.0
    return (_std(g, dim=1)[keep] / mean[keep]).mean().item()


def advantage_stats(advantages, mask=None) -> dict[str, float]:
    """`adv/mean`, `adv/std` (divides by the count), `adv/min`, `adv/max`.

    advantages (N,): over the N completions (mask, if given, is not used). (N, T): over the
    tokens where mask (N, T) is 1, all tokens when mask is None. Nothing selected: all 0.0.
    """
    a = float_tensor(advantages, "advantages", (1, 2))
    if a.ndim == 2 and mask is not None:
        a = a[zero_one(mask, "mask", tuple(a.shape), a.device)]
    a = a.flatten()
    if not a.numel():
        return {"adv/mean": 0.0, "adv/std": 0.0, "adv/min": 0.0, "adv/max": 0.0}
    return {"adv/mean": a.mean().item(), "adv/std": _std(a).item(),
            "adv/min": a.min().item(), "adv/max": a.max().item()}


def kl_stats(kl_per_token, mask) -> dict[str, float]:
    """`policy/kl`: mean of the per-token KL estimate (N, T) over unmasked tokens; 0.0 if none."""
    return {"policy/kl": masked_mean(kl_per_token, mask)}


def entropy_stats(entropy_per_token, mask) -> dict[str, float]:
    """`policy/entropy`: mean per-token entropy (N, T) over unmasked tokens; 0.0 if none."""
    return {"policy/entropy": masked_mean(entropy_per_token, mask)}


def _truncated_stats(truncated, n: int | None = None) -> dict[str, float]:
    t = float_tensor(truncated, "truncated", (1,))
    t = zero_one(t, "truncated", (n if n is not None else t.shape[0],), t.device)
    return {"rollout/truncated_frac": t.float().mean().item()}


def length_stats(mask, truncated=None) -> dict[str, float]:
    """Completion lengths from mask (N, T): `rollout/length_mean`, `rollout/length_max` in tokens;
    with truncated (N,) bool (hit max_new_tokens without EOS) also `rollout/truncated_frac`."""
    m = float_tensor(mask, "mask", (2,))
    m = zero_one(m, "mask", tuple(m.shape), m.device)
    lengths = m.sum(1).float()  # (N,)
    out = {"rollout/length_mean": lengths.mean().item(),
           "rollout/length_max": lengths.max().item()}
    if truncated is not None:
        out |= _truncated_stats(truncated, m.shape[0])
    return out


def form_stats(texts: Sequence[str], correct: Sequence[float], lengths) -> dict[str, float]:
    """How the step's completions answer: `rollout/worked_frac` (the share that works before
    it answers, `labkit.answers.is_worked`), `rollout/steps_mean` (the mean number of steps
    each writes before it answers, `labkit.answers.written_steps`), the correctness of each form (`rollout/acc_worked`,
    `rollout/acc_direct`) and the mean length in tokens of the correct and the wrong
    completions (`rollout/length_correct`, `rollout/length_incorrect`); a form or class with
    no completion leaves its key out. `lengths` (N,): tokens per completion."""
    n = len(texts)
    if len(correct) != n or len(lengths) != n or not n:
        raise ValueError(f"texts, correct and lengths need the same N >= 1 entries, got "
                         f"{n}, {len(correct)} and {len(lengths)}")
    worked = [is_worked(t) for t in texts]
    lengths = [float(x) for x in lengths]
    out = {"rollout/worked_frac": sum(worked) / n,
           "rollout/steps_mean": sum(written_steps(t) for t in texts) / n}
    for key, rows in (("rollout/acc_worked", [c for w, c in zip(worked, correct) if w]),
                      ("rollout/acc_direct", [c for w, c in zip(worked, correct) if not w])):
        if rows:
            out[key] = sum(rows) / len(rows)
    for key, right in (("rollout/length_correct", True), ("rollout/length_incorrect", False)):
        rows = [x for x, c in zip(lengths, correct) if (c > 0) == right]
        if rows:
            out[key] = sum(rows) / len(rows)
    return out


def explained_variance(values, returns, mask) -> float:
    """`value/explained_var` = 1 - Var(R - V) / Var(R) over the unmasked tokens.

    values, returns, mask (N, T) (or all three (N,)); Var divides by the count.

    Var(R) = 0 (all returns equal) follows scikit-learn's explained_variance_score with
    force_finite=True: 1.0 when R - V is constant too (a constant offset is not penalised,
    as in the formula), else 0.0. No unmasked token: 0.0. Can be < 0 (worse than a constant).
    """
    v = float_tensor(values, "values", (1, 2))
    r = float_like(returns, "returns", v, "values")
    m = zero_one(mask, "mask", tuple(v.shape), v.device)
    r, d = r[m], (r - v)[m]
    if not r.numel():
        return 0.0
    if r.max() == r.min():
        return 1.0 if d.max() == d.min() else 0.0
    return 1 - (_scaled_std(d) / _scaled_std(r)) ** 2


def _scaled_std(x: Tensor) -> float:
    """Population std of a 1-D x as a Python float; scaling x to [-1, 1] first keeps the
    squares of tiny spreads from underflowing fp32 to 0 (which made 0/0 above)."""
    d = x - x[0]
    scale = d.abs().max()
    return 0.0 if scale == 0 else scale.item() * (d / scale).std(correction=0).item()


# ---------------------------------------------------------------------------- assembler

def step_metrics(*, rewards, group_size: int, advantages=None, mask=None, logp=None,
                 old_logp=None, eps_low: float = 0.2, eps_high: float = 0.2,
                 dual_clip: float | None = None, kl=None, entropy=None, truncated=None,
                 values=None, returns=None, extra: Mapping[str, float] | None = None,
                 ) -> dict[str, float]:
    """One flat dict of every metric the inputs allow; sections whose inputs are None are skipped.

    rewards (N,) -> rollout/reward_*; mask (N, T) -> rollout/length_*; truncated (N,) ->
    rollout/truncated_frac; advantages (N,) or (N, T) -> adv/*; logp + old_logp (N, T) ->
    ratio/*, and with advantages clip/*; kl, entropy (N, T) -> policy/*; values + returns
    (N, T) -> value/explained_var. Token-level inputs need mask. `extra` (loss values,
    perf/step_s, ...) is merged as floats; its keys must look like "namespace/name" and must
    not repeat a computed key (e.g. the loss's own clip/* for a sequence-level ratio: then
    leave logp out).
    """
    out = reward_stats(rewards, group_size)
    rows = {"advantages": advantages, "mask": mask, "logp": logp, "old_logp": old_logp,
            "kl": kl, "entropy": entropy, "truncated": truncated, "values": values,
            "returns": returns}
    n = len(rewards)
    for name, x in rows.items():
        if x is not None and (getattr(x, "ndim", 1) == 0 or len(x) != n):
            raise ValueError(f"{name} must have N = {n} rows like rewards, "
                             f"got shape {tuple(getattr(x, 'shape', (len(x),)))}")
    token_inputs = {"logp": logp, "kl": kl, "entropy": entropy, "values": values}
    if mask is None and any(x is not None for x in token_inputs.values()):
        given = [k for k, x in token_inputs.items() if x is not None]
        raise ValueError(f"mask (N, T) is required with {given}")
    if mask is not None:
        out |= length_stats(mask, truncated)
    elif truncated is not None:
        out |= _truncated_stats(truncated)
    if advantages is not None:
        out |= advantage_stats(advantages, mask)
        out["adv/gav"] = gav(advantages, group_size, mask=mask)
    if (logp is None) != (old_logp is None):
        raise ValueError("logp and old_logp go together: pass both or neither")
    if logp is not None:
        out |= ratio_stats(logp, old_logp, mask)
        if advantages is not None:
            out |= tlcr(logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
                        dual_clip=dual_clip)
    if kl is not None:
        out |= kl_stats(kl, mask)
    if entropy is not None:
        out |= entropy_stats(entropy, mask)
    if (values is None) != (returns is None):
        raise ValueError("values and returns go together: pass both or neither")
    if values is not None:
        out["value/explained_var"] = explained_variance(values, returns, mask)
    return _merged(out, extra or {})


def _merged(out: dict[str, float], extra: Mapping[str, float]) -> dict[str, float]:
    """`out` with `extra`'s values as floats; a key must be namespaced and not computed."""
    for key, value in extra.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"extra key {key!r} must be namespaced like 'loss/policy'")
        if key in out:
            raise ValueError(f"extra key {key!r} is also computed from the inputs: "
                             "pass one or the other")
        try:
            out[key] = float(value)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"extra[{key!r}] must be a number, got {value!r}") from err
    return out
