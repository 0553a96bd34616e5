"""Losses: the clipped policy objective, its aggregation over tokens, KL, entropy, the critic.

Shapes use the letters B prompts, G completions per prompt, T completion
tokens, N = B*G rows, V vocabulary. `logp` `(N, T)` are log-probs of the sampled tokens;
`mask` `(N, T)` is nonzero on real completion tokens, zero on padding. Padding may hold any
value, even inf or NaN: it is selected away (`torch.where`), never multiplied by 0.

Math runs in fp32 whatever the input dtype (bf16 log-probs give an fp32 loss); float64
inputs stay float64. Old log-probs, reference log-probs, advantages and returns are
detached: only `logp`, `values` and `logits` carry gradient.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from labkit.checks import NonFiniteError, as_float, bool_mask, check_mask
from labkit.registry import Registry

Level = Literal["token", "sequence"]
LEVELS = get_args(Level)  # PPO's per-token ratio / GSPO's per-sequence ratio
KlKind = Literal["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+", "full"]
KL_KINDS = get_args(KlKind)  # Schulman's estimators (k3 is DeepSeekMath's), |log ratio|, the
KL_VALUES = ("k1", "k2", "k3", "abs")  # "+" forms (a value of k1/k3/abs, k2's gradient) and
# the exact KL over the vocabulary (full), which reads whole distributions, not sampled tokens

AGG_MODES = Registry("loss aggregation mode", ("masked", "mask"), ("max_len",))
"""How per-token losses become one number: `fn(masked, mask, *, max_len) -> scalar`, with
masked `(N, T)` the per-token loss set to 0 on padding, mask `(N, T)` bool and max_len the
completion budget or None. Called through `aggregate`, which checks the inputs. Each mode
says what it divides by, its `normaliser` (NORMALISERS), so that gradient accumulation over
micro-batches weighs each one right (`accumulation_weight`)."""

NORMALISERS = ("tokens", "rows", "none")
"""What an aggregation mode divides the summed loss by, a number proportional to: the
batch's unmasked tokens, its rows, or nothing (a sum). Registered as
`@AGG_MODES.register(name, normaliser=...)`; a mode given by import path sets the attribute
`normaliser` on its function."""


@AGG_MODES.register("token-mean", normaliser="tokens")
def token_mean(masked: Tensor, mask: Tensor, *, max_len: int | None = None) -> Tensor:
    """Token mean (DAPO, Yu et al., 2025; TRL loss_type="dapo", verl's default):
    sum_{i,t} l / sum mask, every token of the batch weighs the same."""
    return masked.sum() / mask.sum().clamp(min=1)


@AGG_MODES.register("seq-mean-token-mean", normaliser="rows")
def seq_mean_token_mean(masked: Tensor, mask: Tensor, *, max_len: int | None = None) -> Tensor:
    """Sequence mean of token means (GRPO in DeepSeekMath; TRL loss_type="grpo"):
    mean_i (sum_t l / T_i), T_i clamped to >= 1; a long completion's tokens weigh less."""
    return (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / max(mask.shape[0], 1)


@AGG_MODES.register("seq-mean-token-sum", normaliser="rows")
def seq_mean_token_sum(masked: Tensor, mask: Tensor, *, max_len: int | None = None) -> Tensor:
    """Sequence mean of token sums (REINFORCE on the sequence's summed log-probs):
    mean_i sum_t l."""
    return masked.sum(1).sum() / max(mask.shape[0], 1)


@AGG_MODES.register("seq-mean-token-sum-norm", normaliser="rows")
def seq_mean_token_sum_norm(masked: Tensor, mask: Tensor, *,
                            max_len: int | None = None) -> Tensor:
    """Token sum over a constant (Dr. GRPO, Liu et al., 2025; TRL loss_type="dr_grpo"):
    sum_{i,t} l / (N * max_len), max_len defaulting to T = mask.shape[1] (TRL uses
    max_completion_length), so no length normalisation biases the gradient."""
    n_rows, t_len = mask.shape
    max_len = max(t_len, 1) if max_len is None else max_len  # T = 0: no token, loss 0
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    return masked.sum(1).sum() / max(n_rows * max_len, 1)


@AGG_MODES.register("token-sum", normaliser="none")
def token_sum(masked: Tensor, mask: Tensor, *, max_len: int | None = None) -> Tensor:
    """Token sum (verl loss_agg_mode="token-sum"): sum_{i,t} l, no normalisation, so the
    step grows with the batch's tokens; pair it with a smaller learning rate."""
    return masked.sum()


def normaliser_of(agg: str, field: str = "agg") -> str:
    """The `normaliser` an aggregation mode declares; ValueError naming `field` when it
    declares none (a mode given by import path must, to be accumulated over micro-batches)."""
    kind = getattr(AGG_MODES.resolve(agg, field), "normaliser", None)
    if kind not in NORMALISERS:
        raise ValueError(f"{field}={agg!r} does not say what it divides by: set the attribute "
                         f"`normaliser` on its function to one of {', '.join(NORMALISERS)} "
                         f"(got {kind!r}), so that grad_accum > 1 weighs its micro-batches "
                         "right")
    return kind


def accumulation_weight(agg: str, mask: Tensor, micro: Tensor, minibatch: Tensor) -> float:
    """The weight of a micro-batch's aggregated loss in its minibatch's, so that
    accumulating the micro-batches equals one pass over the minibatch: its share of the
    minibatch's unmasked tokens for a token-normalised mode, of its rows for a
    row-normalised one, 1 for a sum. `micro` and `minibatch` index the rows of `mask`."""
    kind = normaliser_of(agg)
    if kind == "tokens":
        return mask[micro].sum().item() / max(mask[minibatch].sum().item(), 1)
    if kind == "none":
        return 1.0
    return len(micro) / len(minibatch)


def _up(x: Tensor) -> Tensor:
    """At least fp32, keeping the graph (unlike `checks.as_float`, which detaches)."""
    return x if x.dtype == torch.float64 else x.float()


def aggregate(per_token: Tensor, mask: Tensor, agg: str = "token-mean", *,
              max_len: int | None = None) -> Tensor:
    """Reduce a per-token loss `(N, T)` to a scalar over the unmasked tokens, by the mode
    `agg` of `AGG_MODES` (a name, or an import path `package.module:function`).

    An all-zero mask gives 0, not NaN, and a zero gradient. Single process: the
    denominators are this batch's, not a count across devices.
    """
    mode = AGG_MODES.resolve(agg, "agg")
    l = _up(per_token)
    m = check_mask(l, mask, "per_token")
    masked = torch.where(m, l, torch.zeros((), dtype=l.dtype, device=l.device))  # (N, T)
    return mode(masked, m, max_len=max_len)


def masked_fraction(flags: Tensor, m: Tensor) -> float:
    """Fraction of unmasked tokens where `flags` holds; 0.0 with no unmasked token."""
    return (flags & m).sum().item() / max(int(m.sum().item()), 1)


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None,
                level: Level = "token", agg: str = "token-mean",
                max_len: int | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO/GRPO clipped surrogate -> (scalar loss, stats).

    logp, old_logp, mask: `(N, T)`; advantages `(N,)` (one per completion) or `(N, T)`.
    rho_t = exp(logp_t - old_logp_t), with old = the policy that sampled (not the reference
    model); l_t = -min(rho_t A_t, clip(rho_t, 1-eps_low, 1+eps_high) A_t); then `aggregate`.
    eps_high > eps_low is DAPO's clip-higher (0.2 / 0.28).
    dual_clip=c > 1 (verl `clip_ratio_c`): where A_t < 0, l_t = min(l_t, -c A_t), so one huge
    ratio on a bad token cannot dominate the batch.
    level="sequence" (GSPO): s_i = exp(mean over unmasked t of (logp - old_logp)), and every
    token of row i uses the ratio sg[s_i] * exp(logp_t - sg[logp_t]): the value s_i, clipped
    per sequence, with gradient s_i * d logp_t (GSPO-token; with per-row A and any `agg`
    here it equals GSPO's gradient). GSPO's paper pairs it with agg="seq-mean-token-mean".
    On-policy (logp == old_logp) rho = 1 and d loss / d logp_t = -A_t * w_t, REINFORCE with
    the aggregation weight w_t.

    stats (floats over unmasked tokens): "clip/low" (rho < 1-eps_low and A < 0),
    "clip/high" (rho > 1+eps_high and A > 0), "clip/dual" (the dual cap is active),
    "ratio/mean", "ratio/max" (0.0 when no token is unmasked).
    """
    check_clip(level, eps_low, eps_high, dual_clip)
    lp, old, a, m = surrogate_inputs(logp, old_logp, advantages, mask)
    per_token, stats = clipped_surrogate(lp, old, a, m, eps_low=eps_low, eps_high=eps_high,
                                         dual_clip=dual_clip, level=level)
    return aggregate(per_token, m, agg, max_len=max_len), stats


def clipped_surrogate(lp: Tensor, old: Tensor, a: Tensor, m: Tensor, *, eps_low: float,
                      eps_high: float, dual_clip: float | None = None,
                      level: Level = "token") -> tuple[Tensor, dict[str, float]]:
    """`policy_loss` before aggregation: the per-token loss `(N, T)` and the stats, from
    prepared inputs (`surrogate_inputs`: one dtype, advantages `(N, T)` and 0 on padding, a
    bool mask). The loss modes of `labkit.formulas.policy_losses` build on it."""
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    # padding may hold -inf log-probs; its log-ratio is set to 0 before exp
    log_ratio = torch.where(m, lp - old, zero)  # (N, T)
    if level == "sequence":
        seq = log_ratio.sum(1) / m.sum(1).clamp(min=1)  # (N,) log s_i
        log_ratio = torch.where(m, seq.detach()[:, None] + lp - lp.detach(), zero)  # (N, T)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(-ratio * a, -clipped * a)  # (N, T)
    dual = torch.zeros_like(m)
    if dual_clip is not None:
        cap = -dual_clip * a
        dual = (a < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
    return per_token, _clip_stats(ratio.detach(), a, m, dual, eps_low, eps_high)


def check_clip(level: str, eps_low: float, eps_high: float, dual_clip: float | None) -> None:
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if not 0.0 <= eps_low < 1.0:
        raise ValueError("eps_low must be in [0, 1) so the lower bound 1-eps_low stays > 0, "
                         f"got {eps_low!r}")
    if not eps_high >= 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high!r}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError("dual_clip must be None or > 1 (a cap of c * |A| above the clip), "
                         f"got {dual_clip!r}")


def surrogate_inputs(logp, old_logp, advantages, mask) -> tuple[Tensor, ...]:
    """logp (with its graph), old_logp and advantages `(N, T)` in one promoted dtype, the
    advantages 0 on padding, and the bool mask."""
    lp = _up(logp)
    m = check_mask(lp, mask, "logp")
    old = as_float(old_logp).to(lp.device)
    check_mask(old, mask, "old_logp")
    a = as_float(advantages).to(lp.device)
    if a.dim() == 1 and a.shape[0] == lp.shape[0]:
        a = a[:, None].expand_as(lp)  # (N, T)
    elif tuple(a.shape) != tuple(lp.shape):
        raise ValueError(f"advantages must be (N,) or (N, T) = {tuple(lp.shape)}, "
                         f"got {tuple(a.shape)}")
    dtype = torch.promote_types(lp.dtype, torch.promote_types(old.dtype, a.dtype))
    lp, old, a = lp.to(dtype), old.to(dtype), a.to(dtype)
    a = torch.where(m, a, torch.zeros((), dtype=dtype, device=lp.device))
    return lp, old, a, m


@torch.no_grad()
def _clip_stats(r: Tensor, a: Tensor, m: Tensor, dual: Tensor, eps_low: float,
                eps_high: float) -> dict[str, float]:
    """policy_loss's stats from the detached ratio r, the advantages a and the mask m."""
    return {
        "clip/low": masked_fraction((r < 1.0 - eps_low) & (a < 0), m),
        "clip/high": masked_fraction((r > 1.0 + eps_high) & (a > 0), m),
        "clip/dual": masked_fraction(dual, m),
        "ratio/mean": (r[m].sum().item() / max(int(m.sum().item()), 1)),
        "ratio/max": r[m].max().item() if m.any() else 0.0,
    }


def kl(logp: Tensor, ref_logp: Tensor, kind: KlKind = "k3", *,
       mask: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled tokens -> `(N, T)`.

    logp, ref_logp: `(N, T)`; x = ref_logp - logp. k1 = -x (unbiased, can be negative);
    k2 = x^2 / 2; k3 = exp(x) - x - 1 (unbiased, >= 0; DeepSeekMath); abs = |x| (verl).
    k3 is computed as expm1(x) - x, or its Taylor series for |x| < 1e-2, so it keeps its
    precision when the policy is still close to the reference. A "+" form (k1+, k3+, abs+;
    verl's straight-through) has the value of its base kind and the gradient of k2, whose
    expected gradient is the true KL's (the others' is not, Schulman's note). ref_logp is
    detached; gradient flows through logp. With `mask`, masked tokens are 0.

    kind="full" is no estimate: logp and ref_logp are then the log-softmax over the
    vocabulary `(N, T, V)` at each completion position, and the result is the exact
    KL(pi(.|s_t) || pi_ref(.|s_t)) = sum_v pi(v) (log pi(v) - log pi_ref(v)) of each state,
    >= 0, with the exact gradient of that KL through logp (its own distribution, not a
    sampled token's). Tokens of probability 0 (log-prob -inf) add 0.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    if kind == "full":
        return _full_kl(logp, ref_logp, mask)
    lp = _up(logp)
    ref = as_float(ref_logp).to(lp.device)
    if tuple(ref.shape) != tuple(lp.shape):
        raise ValueError(f"ref_logp shape {tuple(ref.shape)} must equal logp shape "
                         f"{tuple(lp.shape)}")
    x = ref - lp
    base = kind.rstrip("+")
    if base == "k1":
        out = -x
    elif base == "k2":
        out = 0.5 * x * x
    elif base == "abs":
        out = x.abs()
    else:
        # exp(x) - x - 1 loses every digit to cancellation for small x; below |x| = 1e-2
        # its Taylor series (next term x^5/120, relative 1e-8) is exact to fp32 rounding
        series = x * x * (0.5 + x * (1.0 / 6.0 + x / 24.0))
        out = torch.where(x.abs() < 1e-2, series, torch.expm1(x) - x)
    if kind.endswith("+"):
        k2 = 0.5 * x * x
        out = k2 - k2.detach() + out.detach()
    if mask is not None:
        m = check_mask(out, mask, "logp")
        out = torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


def _full_kl(log_dist: Tensor, ref_log_dist: Tensor, mask: Tensor | None) -> Tensor:
    lp = _up(log_dist)
    ref = as_float(ref_log_dist).to(lp.device)
    if lp.dim() != 3 or tuple(ref.shape) != tuple(lp.shape):
        raise ValueError("kind='full' needs logp and ref_logp as log-distributions (N, T, V) "
                         f"of one shape, got {tuple(lp.shape)} and {tuple(ref.shape)}")
    low = torch.finfo(lp.dtype).min  # -inf -> the lowest float: p = 0 then adds 0, not NaN
    lp, ref = lp.clamp(min=low), ref.clamp(min=low)
    out = (lp.exp() * (lp - ref)).sum(-1)  # (N, T)
    if mask is not None:
        m = check_mask(out, mask, "logp")
        out = torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


def adaptive_beta(beta: float, kl_value: float, target: float, horizon: int,
                  n_steps: int) -> float:
    """The adaptive KL controller (Ziegler et al., 2019; verl's AdaptiveKLController):
    beta * (1 + clip(kl_value / target - 1, -0.2, 0.2) * n_steps / horizon). beta grows
    while the KL is above target and shrinks below it, by at most 20% per horizon."""
    if not target > 0 or not horizon > 0:
        raise ValueError(f"target and horizon must be > 0, got {target!r}, {horizon!r}")
    error = min(max(kl_value / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / horizon)


def _chunk_entropy(logits: Tensor) -> Tensor:
    """Entropy of each row of a `(P, V)` chunk, upcast to fp32 here and only here."""
    logp = torch.log_softmax(_up(logits), dim=-1)
    # -inf logits (banned tokens) have p = 0; clamping keeps 0 * log 0 at 0, not NaN
    logp = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp.exp() * logp).sum(-1)


def entropy(logits: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Entropy H = -sum_v p_v log p_v at each position: logits `(..., V)` -> `(...)`, fp32.

    Positions are flattened and processed `chunk_size` at a time, each chunk upcast on its
    own, so no fp32 copy of the whole `(N, T, V)` exists for bf16 logits. Under autograd the
    chunks are checkpointed (recomputed in backward) so the saved fp32 softmax does not pile
    up either. Average with `aggregate(entropy(logits), mask)`.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be (..., V) with V >= 1, got shape {tuple(logits.shape)}")
    flat = logits.reshape(-1, logits.shape[-1])  # (P, V), P = prod of the leading dims
    grad = torch.is_grad_enabled() and flat.requires_grad
    parts = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start:start + chunk_size]
        parts.append(checkpoint(_chunk_entropy, chunk, use_reentrant=False) if grad
                     else _chunk_entropy(chunk))
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    h = torch.cat(parts) if parts else flat.new_zeros(0, dtype=out_dtype)
    return h.reshape(logits.shape[:-1])


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               clip: float | None = 0.2, agg: str = "token-mean",
               max_len: int | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO critic loss -> (scalar loss, stats); values, old_values, returns, mask `(N, T)`.

    0.5 * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2), then `aggregate`.
    clip=None: plain 0.5 * (V - R)^2. Note the clip is absolute, in reward units, so its
    scale depends on the reward's. stats "value/clipfrac": fraction of unmasked tokens
    where the clipped branch is the larger one.
    """
    if clip is not None and not clip >= 0:
        raise ValueError(f"clip must be None or >= 0, got {clip!r}")
    v = _up(values)
    m = check_mask(v, mask, "values")
    old = as_float(old_values).to(v.device)
    ret = as_float(returns).to(v.device)
    check_mask(old, mask, "old_values")
    check_mask(ret, mask, "returns")
    dtype = torch.promote_types(v.dtype, torch.promote_types(old.dtype, ret.dtype))
    v, old, ret = v.to(dtype), old.to(dtype), ret.to(dtype)
    err = (v - ret) ** 2  # (N, T)
    if clip is None:
        per_token, larger = 0.5 * err, torch.zeros_like(m)
    else:
        v_clip = old + (v - old).clamp(-clip, clip)
        err_clip = (v_clip - ret) ** 2
        per_token = 0.5 * torch.maximum(err, err_clip)
        larger = err_clip > err
    loss = aggregate(per_token, m, agg, max_len=max_len)
    return loss, {"value/clipfrac": masked_fraction(larger, m)}


def ppo_token_rewards(rewards: Tensor, mask: Tensor, *, logp: Tensor | None = None,
                      ref_logp: Tensor | None = None, beta: float = 0.0,
                      kind: KlKind = "k1") -> Tensor:
    """PPO's per-token reward `(N, T)`: the scalar reward r_i `(N,)` on the last real token of
    row i, plus -beta * kl(logp, ref_logp, kind) on every real token when beta > 0
    (logp and ref_logp `(N, T)` required then, or `(N, T, V)` log-distributions for "full"). Masked tokens and all-masked rows are 0.
    Everything is detached: the reward is a constant for the policy gradient.
    """
    r = as_float(rewards)
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(r.shape)}")
    if not torch.isfinite(r).all():
        raise NonFiniteError("rewards must be finite; got NaN or inf (check the reward function)")
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    m = bool_mask(mask, r.shape[0], r.device)  # (N, T)
    n_rows, t_len = m.shape
    pos = torch.arange(t_len, device=r.device).expand(n_rows, t_len)
    last = torch.where(m, pos, torch.full_like(pos, -1)).amax(1) if t_len else \
        torch.full((n_rows,), -1, device=r.device)  # (N,) -1 for an empty row
    out = torch.zeros(n_rows, t_len, dtype=r.dtype, device=r.device)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = r[rows]
    if beta > 0:
        if logp is None or ref_logp is None:
            raise ValueError("beta > 0 needs logp and ref_logp for the per-token KL penalty")
        penalty = kl(as_float(logp), ref_logp, kind, mask=m).to(out.dtype)
        out = out - beta * penalty
    return out


__all__ = ["AGG_MODES", "LEVELS", "KL_KINDS", "KL_VALUES", "aggregate", "policy_loss", "kl",
           "entropy", "value_loss", "ppo_token_rewards", "adaptive_beta", "clipped_surrogate"]
