"""Advantages: how much better one completion (or one token) did than its baseline.

Shapes use the letters B prompts, G completions per prompt (the group),
T completion tokens, N = B*G rows. Rewards are one scalar per completion, `(N,)`, with the
G completions of a prompt next to each other (rows `b*G .. b*G+G-1`). `mask` `(N, T)` is
nonzero on real completion tokens (up to and including EOS), zero on padding.

Every estimator lives in the registry `ESTIMATORS` under one signature,
`fn(inputs: AdvantageInputs) -> (N,) or (N, T)`, or an `Estimate` that adds the returns
(gae's); `estimate(name, inputs)` calls one and gives an `Estimate` either way. The inputs
object carries what any estimator may read (rewards, groups, mask and lengths, reward
components, discount, and the extras an estimator declares with
`@ESTIMATORS.register(name, needs=(...))`, such as remax's greedy-rollout reward, which the
trainer computes only for it). Adding one is one decorated
function. The math of the classic three is also public with plain arguments (`grpo`,
`dr_grpo`, `rloo`); `to_tokens` spreads a one-per-completion value over the tokens.
Critic-based (PPO): `gae`, and `ppo_advantages`, PPO's whole arrow (GAE, then `whiten`,
which normalises over the unmasked tokens of a batch), registered as `gae`.

All functions are pure and detach their inputs (advantages are targets, never
differentiated). Math runs in fp32 whatever the input dtype; float64 inputs stay float64.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import Tensor

from labkit.checks import NonFiniteError, as_float, bool_mask, check_mask
from labkit.losses import ppo_token_rewards
from labkit.registry import Registry

# DeepSeekMath's group std / TRL scale_rewards="batch" / none (Dr. GRPO)
Scale = Literal["group", "batch", "none"]
SCALES = get_args(Scale)
TokenMode = Literal["uniform", "discounted"]
TOKEN_MODES = get_args(TokenMode)

ESTIMATORS = Registry("advantage estimator", ("inputs",))
"""Advantage estimators: `fn(inputs: AdvantageInputs) -> (N,)` one advantage per completion,
or `(N, T)` one per token. A function reading an optional input names it in `needs`
(`NEEDS` lists the ones the trainer can provide)."""

NEEDS = ("components", "greedy_rewards", "values")
"""Optional inputs a trainer computes when the estimator declares them: `components` (N, K)
the reward's terms and `component_weights` (K,) their weights; `greedy_rewards` (N,) the
reward of the greedy completion of each row's prompt (one greedy rollout per prompt);
`values` (N, T) a critic's values (PPO only)."""


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read. Shapes: N = B*G rows, G completions of a prompt next to
    each other, T completion tokens."""

    rewards: Tensor
    """(N,) one scalar reward per completion."""
    group_size: int
    """G: completions per prompt."""
    mask: Tensor | None = None
    """(N, T) nonzero on real completion tokens; required by per-token estimators."""
    scale: Scale = "group"
    """What a std-dividing estimator divides by: the group's std, the batch's, or nothing."""
    unbiased: bool = True
    """The std divides the variance by n-1 (torch, TRL, verl) rather than n."""
    eps: float = 1e-4
    """Added to a std before dividing (TRL's 1e-4; verl's is 1e-6)."""
    gamma: float = 1.0
    """Discount of the per-token returns (reinforce++, gae)."""
    lam: float = 0.95
    """GAE's lambda."""
    whiten: bool = True
    """gae: whiten the advantages over the batch's tokens (PPO's convention)."""
    token_rewards: Tensor | None = None
    """(N, T) per-token rewards (KL in the reward); None: the reward on the last real token."""
    components: Tensor | None = None
    """(N, K) the reward's terms before weighting (gdpo); None: the reward as one term."""
    component_weights: Tensor | None = None
    """(K,) the terms' weights; None: all 1."""
    extras: Mapping[str, Tensor] = field(default_factory=dict)
    """Declared extras by name: `greedy_rewards` (N,), `values` (N, T)."""

    def need(self, name: str, who: str) -> Tensor:
        """The extra `name`, or a ValueError saying estimator `who` needs it."""
        if self.extras.get(name) is None:
            raise ValueError(f"estimator {who!r} needs inputs.extras[{name!r}] (declare it in "
                             f"needs=(...) so the trainer computes it)")
        return self.extras[name]

    def token_mask(self, who: str) -> Tensor:
        """The mask as bool (N, T), or a ValueError saying estimator `who` needs it."""
        if self.mask is None:
            raise ValueError(f"estimator {who!r} works per token: it needs inputs.mask (N, T)")
        return bool_mask(self.mask, self.rewards.shape[0], self.rewards.device)

    @property
    def lengths(self) -> Tensor:
        """(N,) real tokens per completion (needs the mask)."""
        return self.token_mask("lengths").sum(1)

    @property
    def group_index(self) -> Tensor:
        """(N,) the prompt of each row, 0 .. B-1."""
        return torch.arange(self.rewards.shape[0], device=self.rewards.device) // self.group_size


@dataclass(frozen=True)
class Estimate:
    """What an estimator computes: the advantages, and the returns where it has them."""

    advantages: Tensor
    """(N,) one per completion, or (N, T) one per token."""
    returns: Tensor | None = None
    """(N, T) the critic's regression target (gae); None for the estimators without one."""


def _grouped(rewards, group_size: int, who: str) -> Tensor:
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


def _centered(r: Tensor) -> Tensor:
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
    r = _grouped(rewards, group_size, "GRPO")  # (B, G)
    unit = _unit_scale(r)  # () power of two
    u = r / unit  # (B, G) |u| < 2
    c = _centered(u)  # (B, G)
    if scale == "none":
        return _scaled_back(c, unit, r, "GRPO").reshape(-1)  # (N,)
    if scale == "group":
        std = _std_of_centered(c, 1, unbiased)  # (B, 1)
    else:
        flat = _centered(u.reshape(1, -1))  # (1, N)
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
    r = _grouped(rewards, group_size, "RLOO")  # (B, G)
    unit = _unit_scale(r)
    c = _centered(r / unit) * (group_size / (group_size - 1))  # (B, G)
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
    c = _centered(u[None])[0]  # (n,)
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


# --- the registry: every estimator on one inputs object --------------------------------


def _rows(a: Tensor, x: AdvantageInputs) -> Tensor:
    """One value per completion (N,) on its real tokens -> (N, T), 0 on padding."""
    return to_tokens(a, x.token_mask("per-token"))


def _token_rewards(x: AdvantageInputs) -> Tensor:
    """(N, T) the per-token rewards: `x.token_rewards`, else the reward on the last real
    token of each row (a row without one gets nothing)."""
    m = x.token_mask("per-token")
    if x.token_rewards is not None:
        return as_float(x.token_rewards)
    return ppo_token_rewards(x.rewards, m)  # PPO's placement of a scalar reward


@ESTIMATORS.register("grpo")
def grpo_estimator(x: AdvantageInputs) -> Tensor:
    """GRPO, the group z-score (DeepSeekMath, Shao et al., 2024): (r_i - mean_g r) / (std +
    eps), the std the group's, the batch's or none (`x.scale`); see `grpo`. (N,)"""
    return grpo(x.rewards, x.group_size, scale=x.scale, eps=x.eps, unbiased=x.unbiased)


@ESTIMATORS.register("dr_grpo")
def dr_grpo_estimator(x: AdvantageInputs) -> Tensor:
    """Dr. GRPO, the group mean as baseline, no std (Liu et al., 2025): r_i - mean_g r; see
    `dr_grpo`. (N,)"""
    return dr_grpo(x.rewards, x.group_size)


@ESTIMATORS.register("rloo")
def rloo_estimator(x: AdvantageInputs) -> Tensor:
    """RLOO, leave-one-out baseline (Ahmadian et al., 2024): r_i minus the mean of the other
    G-1; see `rloo`. (N,)"""
    return rloo(x.rewards, x.group_size)


@ESTIMATORS.register("none")
def no_baseline(x: AdvantageInputs) -> Tensor:
    """No baseline, plain REINFORCE (Williams, 1992): A_i = r_i. The reference point the baselines
    are measured against: unbiased, with the most variance. (N,)"""
    return _grouped(x.rewards, x.group_size, "none").reshape(-1).clone()


def _discounted_returns(token_rewards: Tensor, m: Tensor, gamma: float) -> Tensor:
    """(N, T) G_t = sum_k gamma^k r_{t+k} over the real tokens from t on; 0 on padding."""
    out = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype,
                          device=token_rewards.device)
    for t in reversed(range(token_rewards.shape[1])):
        new = token_rewards[:, t] + gamma * running
        out[:, t] = torch.where(m[:, t], new, torch.zeros_like(new))
        running = torch.where(m[:, t], new, running)
    return out


@ESTIMATORS.register("reinforce++")
def reinforce_pp(x: AdvantageInputs) -> Tensor:
    """REINFORCE++, batch-whitened discounted returns (Hu, 2025; verl reinforce_plus_plus):
    per-token discounted returns of the token rewards, whitened over the batch's real tokens
    (`whiten`): a global baseline and scale, no group. gamma = `x.gamma`. (N, T)

    The batch statistics weigh each token, so long completions weigh more than short ones."""
    if not 0.0 <= x.gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {x.gamma!r}")
    m = x.token_mask("reinforce++")
    _grouped(x.rewards, x.group_size, "reinforce++")  # the usual checks of the rewards
    return whiten(_discounted_returns(_token_rewards(x), m, x.gamma), m)


@ESTIMATORS.register("reinforce++-baseline")
def reinforce_pp_baseline(x: AdvantageInputs) -> Tensor:
    """REINFORCE++-baseline, group mean then batch whitening (Hu, 2025; verl
    reinforce_plus_plus_baseline): r_i - mean_g r on every real token, then whitened over the
    batch's real tokens. (N, T)"""
    m = x.token_mask("reinforce++-baseline")
    return whiten(_rows(dr_grpo(x.rewards, x.group_size), x), m)


@ESTIMATORS.register("remax", needs=("greedy_rewards",))
def remax(x: AdvantageInputs) -> Tensor:
    """ReMax, a greedy rollout as baseline (Li et al., 2023): A_i = r_i - r(greedy completion
    of i's prompt), one extra greedy rollout per prompt. Needs `greedy_rewards` (N,). (N,)"""
    r = _grouped(x.rewards, x.group_size, "remax").reshape(-1)
    b = as_float(x.need("greedy_rewards", "remax")).to(r.device).reshape(-1)
    if b.shape != r.shape:
        raise ValueError(f"greedy_rewards must be (N,) = {tuple(r.shape)}, got {tuple(b.shape)}")
    if not torch.isfinite(b).all():
        raise NonFiniteError("greedy_rewards must be finite; got NaN or inf")
    return r - b.to(r.dtype)


@ESTIMATORS.register("opo")
def opo(x: AdvantageInputs) -> Tensor:
    """OPO, a length-weighted group baseline (Hao et al., 2025): A_i = r_i - sum_g(L_j r_j) / sum_g
    L_j, the baseline the group's rewards weighted by completion length L (the optimal baseline
    when the gradient's norm grows with length). A group of empty completions falls back to the
    plain mean. (N,)"""
    r = _grouped(x.rewards, x.group_size, "opo")  # (B, G)
    length = x.lengths.to(r.dtype).view_as(r)  # (B, G)
    total = length.sum(1, keepdim=True)
    weighted = (length * r).sum(1, keepdim=True) / total.clamp(min=1)
    baseline = torch.where(total > 0, weighted, r.mean(1, keepdim=True))
    same = r.amax(1, keepdim=True) == r.amin(1, keepdim=True)
    return torch.where(same, torch.zeros_like(r), r - baseline).reshape(-1)


@ESTIMATORS.register("gpg")
def gpg(x: AdvantageInputs) -> Tensor:
    """GPG, the group mean, scaled by N over the rewarded rows (Chu et al., 2025): A_i = alpha (r_i
    - mean_g r), alpha = N / (rows with a nonzero reward), as verl computes it: the fewer
    completions carry signal, the larger each step on them. (N,)"""
    r = _grouped(x.rewards, x.group_size, "gpg").reshape(-1)
    alpha = r.numel() / max(int(torch.count_nonzero(r)), 1)
    return alpha * dr_grpo(r, x.group_size)


@ESTIMATORS.register("grpo_passk")
def grpo_passk(x: AdvantageInputs) -> Tensor:
    """GRPO for pass@k, only the group's best learns (Chen et al., 2025; verl grpo_passk):
    only the best completion of a
    group learns, with A = r_max - r_second, divided by the group's std + eps unless
    `x.scale` is "none"; every other completion gets 0. (N,)"""
    r = _grouped(x.rewards, x.group_size, "grpo_passk")  # (B, G)
    top = r.topk(2, dim=1).values  # (B, 2)
    gap = top[:, 0] - top[:, 1]  # (B,) 0 when the best is tied
    if x.scale != "none":
        std = r.std(1, correction=1 if x.unbiased else 0) if x.scale == "group" else \
            r.reshape(-1).std(correction=1 if x.unbiased else 0).expand(r.shape[0])
        gap = gap / (std + x.eps)
    out = torch.zeros_like(r)
    out[torch.arange(r.shape[0], device=r.device), r.argmax(1)] = gap
    return out.reshape(-1)


@ESTIMATORS.register("gdpo", needs=("components",))
def gdpo(x: AdvantageInputs) -> Tensor:
    """GDPO, each reward term normalised on its own (arXiv 2601.05242; verl gdpo): A = whiten(
    sum_k w_k z_k), z_k the GRPO z-score (with `x.scale`) of term k within its group, whitened
    over the batch's tokens; a frequent term no longer drowns a rare one. Needs `components`
    (N, K). (N, T)"""
    m = x.token_mask("gdpo")
    parts = as_float(x.components if x.components is not None else x.rewards[:, None])
    if parts.dim() != 2 or parts.shape[0] != m.shape[0]:
        raise ValueError(f"components must be (N, K) with N = {m.shape[0]}, got "
                         f"{tuple(parts.shape)}")
    weights = torch.ones(parts.shape[1], dtype=parts.dtype) if x.component_weights is None \
        else as_float(x.component_weights).to(parts.dtype)
    if weights.shape != (parts.shape[1],):
        raise ValueError(f"component_weights must be (K,) = ({parts.shape[1]},), got "
                         f"{tuple(weights.shape)}")
    total = sum(w * grpo(parts[:, k], x.group_size, scale=x.scale, eps=x.eps,
                         unbiased=x.unbiased) for k, w in enumerate(weights.tolist()))
    return whiten(_rows(total, x), m)


@ESTIMATORS.register("max_rl")
def max_rl(x: AdvantageInputs) -> Tensor:
    """MaxRL, the group mean as baseline and scale (Tajwar et al., 2026): A_i = (r_i - mean_g
    r) / mean_g r, which weighs a prompt by 1 / (its pass rate), as maximum likelihood does.
    Rewards must be >= 0; a group of zeros gives 0. (N,)"""
    r = _grouped(x.rewards, x.group_size, "max_rl")
    if (r < 0).any():
        raise ValueError("max_rl divides by the group's mean reward: rewards must be >= 0, got "
                         f"{float(r.min()):.3g}")
    mean = r.mean(1, keepdim=True)
    c = _centered(r)
    return torch.where(mean > 0, c / torch.where(mean > 0, mean, torch.ones_like(mean)),
                       torch.zeros_like(c)).reshape(-1)


@ESTIMATORS.register("gae", needs=("values",))
def gae_estimator(x: AdvantageInputs) -> Estimate:
    """GAE, a critic's values and TD errors, PPO's (Schulman et al., 2016): the critic's values
    `(N, T)` turn the token rewards into per-token advantages, whitened over the batch when
    `x.whiten`, and the returns, the critic's target; see `ppo_advantages`. Needs `values`, so
    only PPO (a critic) can use it. Estimate of (N, T) and (N, T)"""
    values = x.need("values", "gae")
    return Estimate(*ppo_advantages(_token_rewards(x), values, x.token_mask("gae"),
                                    gamma=x.gamma, lam=x.lam, whiten_advantages=x.whiten))


def estimate(name: str, inputs: AdvantageInputs) -> Estimate:
    """What the estimator `name` (a registered name or an import path) computes from
    `inputs`: its advantages, and the returns where it has them (an estimator may return a
    tensor, the advantages alone, or an `Estimate`)."""
    out = ESTIMATORS.resolve(name, "estimator")(inputs)
    return out if isinstance(out, Estimate) else Estimate(out)


__all__ = ["SCALES", "TOKEN_MODES", "ESTIMATORS", "NEEDS", "AdvantageInputs", "Estimate",
           "estimate", "NonFiniteError",
           "grpo", "dr_grpo", "rloo", "to_tokens", "whiten", "gae", "ppo_advantages"]
