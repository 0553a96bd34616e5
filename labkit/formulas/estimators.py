"""Every advantage estimator under one signature: the registry `ESTIMATORS`, the names a config
chooses from (`--estimator`).

`fn(inputs: AdvantageInputs) -> (N,) or (N, T)`, or an `Estimate` that adds the returns
(gae's); `estimate(name, inputs)` calls one and gives an `Estimate` either way. The inputs
object carries what any estimator may read (rewards, groups, mask and lengths, reward
components, discount, and the extras an estimator declares with
`@ESTIMATORS.register(name, needs=(...))`, such as remax's greedy-rollout reward, which the
trainer computes only for it). Adding one is one decorated function. The formulas behind
the classic ones are `labkit.formulas.advantages`'s, with plain arguments.

Shapes: B prompts, G completions per prompt, T completion tokens, N = B*G rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from labkit.checks import NonFiniteError, as_float, bool_mask
from labkit.formulas.advantages import (Scale, centered, dr_grpo, grouped, grpo, ppo_advantages,
                                        rloo, to_tokens, whiten)
from labkit.formulas.losses import ppo_token_rewards
from labkit.registry import Registry

ESTIMATORS = Registry("advantage estimator", ("inputs",))
"""Advantage estimators: `fn(inputs: AdvantageInputs) -> (N,)` one advantage per completion,
or `(N, T)` one per token. A function reading an optional input names it in `needs`
(`NEEDS` lists the ones the trainer can provide)."""

NEEDS = ("components", "greedy_rewards", "values", "mc_values")
"""Optional inputs a trainer computes when the estimator declares them: `components` (N, K)
the reward's terms and `component_weights` (K,) their weights; `greedy_rewards` (N,) the
reward of the greedy completion of each row's prompt (one greedy rollout per prompt);
`values` (N, T) a critic's values (PPO only); `mc_values` (N, T + 1) Monte Carlo values of
each completion's prefixes at its step boundaries (`vine_samples` continuations each,
`labkit.model.credit`), NaN between them."""


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
    return grouped(x.rewards, x.group_size, "none").reshape(-1).clone()


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
    grouped(x.rewards, x.group_size, "reinforce++")  # the usual checks of the rewards
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
    r = grouped(x.rewards, x.group_size, "remax").reshape(-1)
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
    r = grouped(x.rewards, x.group_size, "opo")  # (B, G)
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
    r = grouped(x.rewards, x.group_size, "gpg").reshape(-1)
    alpha = r.numel() / max(int(torch.count_nonzero(r)), 1)
    return alpha * dr_grpo(r, x.group_size)


@ESTIMATORS.register("grpo_passk")
def grpo_passk(x: AdvantageInputs) -> Tensor:
    """GRPO for pass@k, only the group's best learns (Chen et al., 2025; verl grpo_passk):
    only the best completion of a
    group learns, with A = r_max - r_second, divided by the group's std + eps unless
    `x.scale` is "none"; every other completion gets 0. (N,)"""
    r = grouped(x.rewards, x.group_size, "grpo_passk")  # (B, G)
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
    r = grouped(x.rewards, x.group_size, "max_rl")
    if (r < 0).any():
        raise ValueError("max_rl divides by the group's mean reward: rewards must be >= 0, got "
                         f"{float(r.min()):.3g}")
    mean = r.mean(1, keepdim=True)
    c = centered(r)
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


@ESTIMATORS.register("vineppo", needs=("mc_values",))
def vineppo(x: AdvantageInputs) -> Tensor:
    """VinePPO's credit (Kazemnejad et al., 2024) without a critic: the value of the prefix at
    each step boundary (the start, the end of each written step, the end) is estimated by
    Monte Carlo, `vine_samples` continuations from it under the current policy; every token
    of a step gets V(end of its step) - V(start of its step), the step's advantage.
    (N, T) from `mc_values` (N, T + 1), NaN off the boundaries, the reward at the end."""
    values = x.need("mc_values", "vineppo")
    return step_advantages(values, x.token_mask("vineppo"))


def step_advantages(values: Tensor, mask: Tensor) -> Tensor:
    """(N, T): for token t of row i, V[i, b'] - V[i, b] with b the last boundary at or before
    t and b' the first after it, boundaries being the finite entries of `values` (N, T + 1);
    0 on padding."""
    N, T = mask.shape
    known = torch.isfinite(values)
    index = torch.arange(T + 1, device=values.device).expand(N, T + 1)
    # last known index <= t: a running max of the known indices (-1 where none yet)
    before = torch.where(known, index, -1).cummax(1).values[:, :T]
    # first known index >= t + 1: a running min from the right
    later = torch.where(known, index, T + 1).flip(1).cummin(1).values.flip(1)[:, 1:]
    if (mask.bool() & ((before < 0) | (later > T))).any():
        raise ValueError("mc_values must be known at the start (t = 0) and at each "
                         "completion's end")
    start = values.gather(1, before.clamp(min=0))
    end = values.gather(1, later.clamp(max=T))
    return torch.where(mask.bool(), end - start, torch.zeros_like(start))


def estimate(name: str, inputs: AdvantageInputs) -> Estimate:
    """What the estimator `name` (a registered name or an import path) computes from
    `inputs`: its advantages, and the returns where it has them (an estimator may return a
    tensor, the advantages alone, or an `Estimate`)."""
    out = ESTIMATORS.resolve(name, "estimator")(inputs)
    return out if isinstance(out, Estimate) else Estimate(out)


__all__ = ["ESTIMATORS", "NEEDS", "AdvantageInputs", "Estimate", "estimate"]
