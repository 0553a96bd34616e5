"""Advantages: how much better one completion (or one token) did than its baseline.

Shapes use the letters B prompts, G completions per prompt (the group),
T completion tokens, N = B*G rows. Rewards are one scalar per completion, `(N,)`, with the
G completions of a prompt next to each other (rows `b*G .. b*G+G-1`). `mask` `(N, T)` is
nonzero on real completion tokens (up to and including EOS), zero on padding.

The formulas, with plain arguments: the group baselines `grpo`, `dr_grpo`, `rloo`;
`to_tokens` spreads a one-per-completion value over the tokens; critic-based (PPO): `gae`,
and `ppo_advantages`, PPO's whole arrow (GAE, then `whiten`, which normalises over the
unmasked tokens of a batch). `labkit.formulas.estimators` registers these and the field's other
estimators under one signature, the names a config chooses from.

All functions are pure and detach their inputs (advantages are targets, never
differentiated). Math runs in fp32 whatever the input dtype; float64 inputs stay float64.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from labkit.checks import NonFiniteError, as_float, bool_mask, check_mask

# DeepSeekMath's group std / TRL scale_rewards="batch" / none (Dr. GRPO)
Scale = Literal["group", "batch", "none"]
SCALES = get_args(Scale)
TokenMode = Literal["uniform", "discounted"]
TOKEN_MODES = get_args(TokenMode)


def grouped(rewards, group_size: int, who: str) -> Tensor:
    """Validated rewards `(N,)` reshaped to `(B, G)`."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"{who} needs group_size >= 2 to compare completions, got "
                         f"group_size={group_size!r}")
    r = as_float(rewards)
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,) with N = B*G, got shape {tuple(r.shape)}")
    if r.numel() % group_size != 0:
        raise ValueError(f"len(rewards)={r.numel()} is not divisible by group_size={group_size}: "
                         "rewards must hold whole groups of G completions")
    if not torch.isfinite(r).all():
        raise NonFiniteError("rewards must be finite; got NaN or inf (check the reward function)")
    return r.view(-1, group_size)  # (B, G)


def _unit_scale(x: Tensor) -> Tensor:
    """A power of two S with max|x| / S in [1, 2) (S = 0.5 for all-zero x), as a 0-d tensor.

    Sums, means and squares of x / S cannot overflow, and dividing by a power of two is
    exact, so results computed on x / S and scaled back equal those computed on x wherever
    the latter do not overflow."""
    _, exponent = torch.frexp(x.abs().amax() if x.numel() else x.new_zeros(()))
    return torch.ldexp(torch.ones((), dtype=x.dtype, device=x.device), exponent - 1)


def _scaled_back(c: Tensor, scale: Tensor, rewards: Tensor, who: str) -> Tensor:
    """c * scale, or NonFiniteError when that overflows the dtype (reward differences beyond
    ~3e38 in fp32: an unscaled reward this large cannot give a usable advantage)."""
    out = c * scale
    if not torch.isfinite(out).all():
        raise NonFiniteError(f"{who}: reward differences overflow {str(c.dtype)[6:]} (largest "
                             f"|reward| {float(rewards.abs().max()):.3g}): scale the reward "
                             "down")
    return out


def centered(r: Tensor) -> Tensor:
    """r - mean over the last dim, exactly 0 in rows whose entries are all equal.

    The float mean of equal numbers can differ from them by an ulp; an exact-equality test
    keeps a zero-std group at exactly zero advantage instead of noise divided by eps.
    """
    constant = r.amax(-1, keepdim=True) == r.amin(-1, keepdim=True)
    return torch.where(constant, torch.zeros_like(r), r - r.mean(-1, keepdim=True))


def _std_of_centered(c: Tensor, dim: int, unbiased: bool) -> Tensor:
    """Std of already centered values along `dim` (keepdim), rescaled first so the squares of
    huge rewards do not overflow fp32."""
    s = c.abs().amax(dim, keepdim=True)
    s_safe = torch.where(s > 0, s, torch.ones_like(s))
    return s * (c / s_safe).std(dim, correction=1 if unbiased else 0, keepdim=True)


def grpo(rewards: Tensor, group_size: int, *, scale: Scale = "group", eps: float = 1e-4,
         unbiased: bool = True) -> Tensor:
    """GRPO's group z-score (DeepSeekMath, Shao et al., 2024):
    A_i = (r_i - mean_g r) / (std + eps).

    rewards: `(N,)`, groups of `group_size` = G consecutive completions. Returns `(N,)`.

    scale: "group" divides by the std of the G rewards of the group (DeepSeekMath, TRL default);
    "batch" by the std of all N rewards, the mean staying the group mean (TRL
    `scale_rewards="batch"`); "none" does not divide (Dr. GRPO, same as `dr_grpo`).
    unbiased: True divides the variance by G-1 (torch `std()`, TRL); False by G.

    Departures from the textbook formula: a group whose rewards are all equal gives exactly 0
    (never 0/0, whatever eps); the math runs on the rewards divided by a power of two
    (`_unit_scale`, exact), so rewards up to the dtype's largest finite value give finite
    advantages with a std; without one (scale="none") differences too large for the dtype
    raise NonFiniteError rather than return inf.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    r = grouped(rewards, group_size, "GRPO")  # (B, G)
    unit = _unit_scale(r)  # () power of two
    u = r / unit  # (B, G) |u| < 2
    c = centered(u)  # (B, G)
    if scale == "none":
        return _scaled_back(c, unit, r, "GRPO").reshape(-1)  # (N,)
    if scale == "group":
        std = _std_of_centered(c, 1, unbiased)  # (B, 1)
    else:
        flat = centered(u.reshape(1, -1))  # (1, N)
        std = _std_of_centered(flat, 1, unbiased)  # (1, 1)
    denom = std + eps / unit  # (std_r + eps) / unit
    # denom is 0 only when std is 0 and eps is 0: then c is 0 too, and 0 is the answer
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    return (c / denom).reshape(-1)  # (N,)


def dr_grpo(rewards: Tensor, group_size: int, **options) -> Tensor:
    """Dr. GRPO (Liu et al., 2025): A_i = r_i - mean_g r, no std division, which removes the
    bias toward too-easy and too-hard prompts. rewards `(N,)` -> `(N,)`.

    options: `scale` and `unbiased`, ignored (there is no std to divide by)."""
    return grpo(rewards, group_size, scale="none")


def rloo(rewards: Tensor, group_size: int, **options) -> Tensor:
    """RLOO, REINFORCE leave-one-out (Ahmadian et al., 2024):
    A_i = r_i - (sum_{j != i} r_j) / (G-1). rewards `(N,)` -> `(N,)`.

    Computed as the algebraically equal G/(G-1) * (r_i - mean_g r), which keeps a group of
    equal rewards at exactly 0. So RLOO is Dr. GRPO scaled by G/(G-1). options: `scale`
    and `unbiased`, ignored.
    """
    r = grouped(rewards, group_size, "RLOO")  # (B, G)
    unit = _unit_scale(r)
    c = centered(r / unit) * (group_size / (group_size - 1))  # (B, G)
    return _scaled_back(c, unit, r, "RLOO").reshape(-1)  # (N,)


def to_tokens(advantages: Tensor, mask: Tensor, *, mode: TokenMode = "uniform",
              gamma: float = 1.0) -> Tensor:
    """Spread one advantage per completion `(N,)` over its tokens -> `(N, T)`.

    mode "uniform": A_i on every unmasked token (GRPO).
    mode "discounted": A_i * gamma^(T_i-1-t) / sum_t gamma^(T_i-1-t), where t counts
    the unmasked tokens of row i and T_i is their number; the tokens near the end get more
    and the row sums to A_i (uniform rows sum to T_i * A_i). gamma = 1 gives A_i / T_i.
    Masked tokens get 0; an all-masked row is all 0. gamma in [0, 1].
    """
    if mode not in TOKEN_MODES:
        raise ValueError(f"mode must be one of {TOKEN_MODES}, got {mode!r}")
    a = as_float(advantages)
    if a.dim() != 1:
        raise ValueError(f"advantages must be 1-D (N,), got shape {tuple(a.shape)}")
    m = bool_mask(mask, a.shape[0], a.device)  # (N, T)
    if mode == "uniform":
        return torch.where(m, a[:, None], torch.zeros((), dtype=a.dtype, device=a.device))
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1] for mode='discounted', got {gamma!r}")
    mf = m.to(a.dtype)
    pos = mf.cumsum(1) - 1  # (N, T) rank of each token among the unmasked ones
    length = mf.sum(1, keepdim=True)  # (N, 1)
    power = (length - 1 - pos).clamp(min=0)  # padding after the end would go negative
    w = torch.where(m, torch.full_like(mf, gamma).pow(power), torch.zeros_like(mf))  # (N, T)
    total = w.sum(1, keepdim=True)  # (N, 1) >= 1 when the row has a token: the last has weight 1
    return a[:, None] * w / total.clamp(min=1.0)


def whiten(values: Tensor, mask: Tensor, *, eps: float = 1e-8, shift_mean: bool = True,
           unbiased: bool = True) -> Tensor:
    """Global whitening, as PPO implementations do (TRL's `masked_whiten`):
    (x - mean) / (std + eps) over the unmasked entries.

    values, mask: `(N, T)` -> `(N, T)`. Mean and std use unmasked entries only; masked entries
    come back 0. unbiased=True uses the G-1-style correction (n-1), as TRL's `masked_whiten`.
    shift_mean=False adds the mean back after scaling, (x - mean)/(std + eps) + mean, as TRL
    does for rewards, so their sign survives.
    Departures: all unmasked values equal (or a single one) gives 0 (plus the mean when
    shift_mean=False) instead of rounding noise over eps; no unmasked entry gives all zeros.
    """
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    x = as_float(values)
    m = check_mask(x, mask, "values")
    xs = x[m]  # (n,) the unmasked entries
    if xs.numel() == 0:
        return torch.zeros_like(x)
    if not torch.isfinite(xs).all():
        raise NonFiniteError("values must be finite on unmasked entries; got NaN or inf")
    unit = _unit_scale(xs)  # exact rescaling, so huge values cannot overflow the mean or std
    u = xs / unit  # (n,)
    c = centered(u[None])[0]  # (n,)
    if xs.numel() < 2 and unbiased:
        std = torch.zeros((), dtype=x.dtype, device=x.device)
    else:
        std = _std_of_centered(c, 0, unbiased)[0]
    denom = std + eps / unit
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.zeros_like(x)
    out[m] = c / denom if shift_mean else c / denom + u.mean() * unit
    return out


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation for PPO -> (advantages, returns), each `(N, T)`.

    token_rewards, values, mask: `(N, T)`. delta_t = r_t + gamma V_{t+1} - V_t,
    A_t = sum_k (gamma lam)^k delta_{t+k}, returns = A + V; computed backwards over time.
    Departures: masked positions are skipped, so "t+1" is the next unmasked token (holes in
    the mask and left padding work too); V after the last real token is 0, which treats a
    completion cut at the length limit as finished, as TRL and verl do. Rewards and values on
    masked positions are ignored and both outputs are 0 there.
    """
    for name, v in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {v!r}")
    r = as_float(token_rewards)
    v = as_float(values).to(r.device)
    dtype = torch.promote_types(r.dtype, v.dtype)
    r, v = r.to(dtype), v.to(dtype)
    m = check_mask(r, mask, "token_rewards")
    check_mask(v, mask, "values")
    for name, x in (("token_rewards", r), ("values", v)):
        if not torch.isfinite(x[m]).all():
            raise NonFiniteError(f"gae: {name} must be finite on unmasked tokens; got NaN or "
                                 "inf (a diverged critic gives NaN values)")
    n, t_len = r.shape
    adv = torch.zeros_like(r)
    zero = torch.zeros(n, dtype=r.dtype, device=r.device)
    next_v, next_a = zero, zero  # (N,) value and advantage of the next real token
    for t in reversed(range(t_len)):
        real = m[:, t]
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a  # (N,)
        adv[:, t] = torch.where(real, a, zero)
        next_v = torch.where(real, v[:, t], next_v)
        next_a = torch.where(real, a, next_a)
    returns = torch.where(m, adv + v, torch.zeros_like(adv))
    if not (torch.isfinite(adv).all() and torch.isfinite(returns).all()):
        raise NonFiniteError(f"gae: advantages overflow {str(r.dtype)[6:]}: scale the rewards "
                             "and values down")
    return adv, returns


def ppo_advantages(token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0,
                   lam: float = 0.95, whiten_advantages: bool = True) -> tuple[Tensor, Tensor]:
    """PPO's advantage arrow (InstructGPT; Schulman et al., 2017): token rewards -> `gae` ->
    `whiten` over the batch's unmasked tokens -> (advantages, returns), each `(N, T)`.

    token_rewards, values, mask: `(N, T)`. The returns, the critic's target, are GAE's,
    before whitening; whiten_advantages=False leaves the advantages as GAE gives them.
    """
    advantages, returns = gae(token_rewards, values, mask, gamma=gamma, lam=lam)
    if whiten_advantages:
        advantages = whiten(advantages, mask)
    return advantages, returns


__all__ = ["SCALES", "TOKEN_MODES", "NonFiniteError", "grpo", "dr_grpo", "rloo", "to_tokens",
           "whiten", "gae", "ppo_advantages", "grouped", "centered"]
