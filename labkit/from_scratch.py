"""GRPO and PPO from scratch: one update of each, in plain PyTorch, in the order of the papers.

This is the plain reference beside labkit's trainer (`labkit.trainer.Trainer.step`): the
same math for the trainer's default variant, with no registry, no config object and nothing
imported from labkit, so that a newcomer can read it top to bottom, and so that a test can
check that the trainer computes exactly this (tests/test_from_scratch.py). The keyword
arguments default to `labkit.settings.config.TrainConfig`'s defaults.

Shapes: B prompts, G completions per prompt, N = B*G rows (the G completions of a prompt next
to each other), P prompt tokens (left-padded), T completion tokens (right-padded: real
tokens up to and including EOS, then padding), L = P + T.

Both steps take a rollout that is already sampled: the prompts (B, P) and their masks, the
completions (N, T), their masks, the log-probs (N, T) the sampling policy gave each sampled
token, and one scalar reward per completion (N,). Departures from labkit: one variant each
(GRPO's group z-score, token-mean aggregation rather than DeepSeekMath's mean of per-completion
means (`token_mean` says how they differ), the vanilla clipped loss; PPO's GAE), one
process, no mixed precision, no gradient accumulation, no exotic masks (right padding only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor, nn

LearningRate = float | Sequence[float]
"""One rate for every optimizer step, or one per optimizer step (a schedule's values)."""


@dataclass
class UpdateResult:
    """What one update computed: its advantages and its figures, each a mean over the
    update's num_iterations x minibatches optimizer steps."""

    advantages: Tensor
    """(N,) for GRPO, (N, T) for PPO."""
    metrics: dict = field(default_factory=dict)
    """loss/policy, loss/kl (GRPO), loss/value (PPO), perf/grad_norm (the policy's, before
    clipping), clip/total (the fraction of real tokens whose ratio was clipped)."""
    returns: Tensor | None = None
    """PPO: (N, T) the critic's target."""


# --- 1. Scoring: log-probs of the sampled tokens under a model --------------------------------

def sequences(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
              completion_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids, attention_mask, position_ids), each (N, L): row n is prompt n // G, then
    completion n. Positions count real tokens only, so left padding does not shift them."""
    G = completion_ids.shape[0] // prompt_ids.shape[0]
    ids = torch.cat([prompt_ids.repeat_interleave(G, 0), completion_ids], dim=1)  # (N, L)
    mask = torch.cat([prompt_mask.repeat_interleave(G, 0), completion_mask], dim=1)  # (N, L)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (N, L)
    return ids, mask, positions


def token_logprobs(model, ids: Tensor, mask: Tensor, positions: Tensor, completion_ids: Tensor,
                   temperature: float = 1.0) -> Tensor:
    """log pi(o_t | q, o_<t) (n, T) of the completion tokens: the logits at position P - 1 + t
    predict completion token t. The logits are divided by the sampling temperature, so the
    policy that sampled scores its own tokens with ratio 1."""
    T = completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits = logits[:, -T - 1:-1].float() / temperature  # (n, T, V)
    logp = logits.log_softmax(-1)
    return logp.gather(-1, completion_ids[..., None]).squeeze(-1)  # (n, T)


def token_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    """sum over real tokens / number of real tokens: every token of the minibatch weighs the
    same (labkit's default `agg`, token-mean, as DAPO and TRL's default). DeepSeekMath's
    objective is not this: it averages each completion first, 1/G sum_i 1/|o_i| sum_t, so a
    token of a short completion weighs more than one of a long one (labkit's
    `agg="seq-mean-token-mean"`)."""
    return torch.where(mask, per_token, 0.0).sum() / mask.sum().clamp(min=1)


# --- 2. GRPO's advantage: the group z-score (DeepSeekMath, Shao et al., 2024) ------------------

def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-4) -> Tensor:
    """A_i = (r_i - mean_group r) / (std_group r + eps) (N,), the std unbiased (divides by
    G - 1). A group of equal rewards gets 0: nothing to learn from it."""
    r = rewards.float().view(-1, group_size)  # (B, G)
    a = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)  # (B, G)
    return a.reshape(-1)  # (N,)


# --- 3. The clipped surrogate (PPO, Schulman et al., 2017; the same in GRPO) --------------------

def clipped_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                      eps_low: float = 0.2, eps_high: float = 0.2) -> tuple[Tensor, Tensor]:
    """Per-token loss -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) (n, T), rho =
    pi / pi_old; and where the clip binds (n, T) bool. advantages (n,) or (n, T)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)  # (n, T): the same on every token
    a = torch.where(mask, advantages, 0.0)
    ratio = torch.exp(torch.where(mask, logp - old_logp, 0.0))  # (n, T)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(-ratio * a, -clipped * a)
    r = ratio.detach()
    binds = mask & (((r < 1 - eps_low) & (a < 0)) | ((r > 1 + eps_high) & (a > 0)))
    return loss, binds


# --- 4. KL to the reference, from the sampled tokens (Schulman's estimators) --------------------

def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(x) - x - 1, x = log pi_ref - log pi (n, T): unbiased and >= 0 (DeepSeekMath's).
    expm1 keeps its digits when the policy is close to the reference."""
    x = ref_logp - logp
    return torch.expm1(x) - x


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log pi - log pi_ref (n, T): unbiased, may be negative (InstructGPT's reward)."""
    return logp - ref_logp


# --- 5. The optimisation loop, shared -----------------------------------------------------------

def minibatch_order(n_rows: int, num_iterations: int, minibatches: int, seed: int):
    """The rows (index tensors) of each optimizer step: num_iterations passes, each a fresh
    shuffle of the N rows, split into `minibatches` parts; drawn from a generator seeded with
    the step's seed."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(num_iterations):
        yield from torch.randperm(n_rows, generator=generator).chunk(minibatches)


def adamw(model: nn.Module, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the weights that train; the rate is set before every step."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0,
                             weight_decay=weight_decay)


def rate(lr: LearningRate, k: int) -> float:
    """The learning rate of optimizer step k."""
    return float(lr) if isinstance(lr, (int, float)) else float(lr[k])


def optimizer_step(optimizer: torch.optim.Optimizer, lr: float, max_grad_norm: float) -> float:
    """Clip the gradient's global norm to max_grad_norm (0: no clip), take one step at `lr`,
    clear the gradients; the norm before clipping."""
    norm = 0.0
    if max_grad_norm > 0:
        weights = [p for group in optimizer.param_groups for p in group["params"]]
        norm = float(torch.nn.utils.clip_grad_norm_(weights, max_grad_norm))
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def warmup_cosine(k: int, lr: float, total: int, warmup: int = 10,
                  min_ratio: float = 0.1) -> float:
    """labkit's schedule, per optimizer step k of the run's `total`: linear warmup from
    lr / warmup (not 0), then cosine decay to min_ratio * lr."""
    if k < warmup:
        return lr * (k + 1) / warmup
    progress = min(1.0, (k - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# --- 6. One GRPO update -------------------------------------------------------------------------

def grpo_step(policy, reference, prompt_ids: Tensor, prompt_mask: Tensor,
              completion_ids: Tensor, completion_mask: Tensor, old_logprobs: Tensor,
              rewards: Tensor, *, seed: int = 0, beta: float = 0.0, eps_low: float = 0.2,
              eps_high: float = 0.2, adv_eps: float = 1e-4, temperature: float = 1.0,
              num_iterations: int = 1, minibatches: int = 1, lr: LearningRate = 1e-3,
              weight_decay: float = 0.0, max_grad_norm: float = 1.0,
              optimizer: torch.optim.Optimizer | None = None) -> UpdateResult:
    """One GRPO update of `policy` (a Hugging Face causal LM) on a sampled rollout: the
    clipped surrogate with group advantages, + beta * k3 KL to the frozen `reference` (None
    when beta is 0), each a token mean over the minibatch. `optimizer`: None makes a fresh
    AdamW, as at a run's first step."""
    G = completion_ids.shape[0] // prompt_ids.shape[0]
    ids, mask, positions = sequences(prompt_ids, prompt_mask, completion_ids, completion_mask)
    real = completion_mask.bool()  # (N, T)
    advantages = group_advantages(rewards, G, adv_eps)  # (N,)
    ref_logp = None
    if beta > 0:
        with torch.no_grad():
            ref_logp = token_logprobs(reference, ids, mask, positions, completion_ids,
                                      temperature)
    optimizer = optimizer or adamw(policy, weight_decay)
    sums, steps = {}, 0
    for rows in minibatch_order(len(rewards), num_iterations, minibatches, seed):
        logp = token_logprobs(policy, ids[rows], mask[rows], positions[rows],
                              completion_ids[rows], temperature)
        per_token, binds = clipped_surrogate(logp, old_logprobs[rows], advantages[rows],
                                             real[rows], eps_low, eps_high)
        policy_loss = token_mean(per_token, real[rows])
        loss, figures = policy_loss, {"loss/policy": policy_loss.item()}
        if beta > 0:
            kl = token_mean(kl_k3(logp, ref_logp[rows]), real[rows])
            loss = loss + beta * kl
            figures["loss/kl"] = beta * kl.item()
        loss.backward()
        figures["perf/grad_norm"] = optimizer_step(optimizer, rate(lr, steps), max_grad_norm)
        figures["clip/total"] = (binds.sum() / real[rows].sum().clamp(min=1)).item()
        for key, value in figures.items():
            sums[key] = sums.get(key, 0.0) + value
        steps += 1
    return UpdateResult(advantages, {key: value / steps for key, value in sums.items()})


# --- 7. PPO's critic and its advantage (InstructGPT; GAE, Schulman et al., 2016) ----------------

class Critic(nn.Module):
    """A value per token: a copy of the policy's decoder stack (`backbone`) and a linear
    `head` that starts at zero, so every value starts at 0. Its own weights and optimizer."""

    def __init__(self, policy):
        super().__init__()
        self.backbone = type(policy.base_model)(policy.config)  # the same stack, then its weights
        self.backbone.load_state_dict(policy.base_model.state_dict())
        self.head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.to(policy.device)


def token_values(critic, ids: Tensor, mask: Tensor, positions: Tensor, T: int) -> Tensor:
    """V(s_t) (n, T): the critic's value at the state before completion token t. `critic`
    has a `backbone` and a `head`, as `Critic` (or labkit's `ValueModel`)."""
    hidden = critic.backbone(input_ids=ids, attention_mask=mask,
                             position_ids=positions).last_hidden_state
    return critic.head(hidden[:, -T - 1:-1]).squeeze(-1).float()  # (n, T)


def token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor, beta: float) -> Tensor:
    """r_t (N, T): the completion's reward on its last real token, minus beta * KL_t on every
    real token."""
    out = torch.where(mask, -beta * kl, 0.0)
    lengths = mask.sum(1)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    out[rows, lengths[rows] - 1] += rewards[rows].float()
    return out


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, backwards in
    time, V and A after the last real token 0 -> (advantages, returns = A + V), each (N, T),
    0 on padding."""
    m = mask.float()
    advantages = torch.zeros_like(rewards)
    next_value = next_adv = rewards.new_zeros(rewards.shape[0])  # (N,)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_adv) * m[:, t]
        next_value, next_adv = values[:, t] * m[:, t], advantages[:, t]
    return advantages, (advantages + values) * m


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / (std + eps) over the real tokens of the batch (std unbiased), 0 on
    padding."""
    mean, std = x[mask].mean(), x[mask].std()
    return torch.where(mask, (x - mean) / (std + eps), 0.0)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor,
               clip: float | None = 0.2) -> Tensor:
    """Per-token 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2) (n, T); the
    clip is absolute, in reward units. clip None: 0.5 * (V - R)^2."""
    err = (values - returns) ** 2
    if clip is None:
        return 0.5 * err
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(err, (clipped - returns) ** 2)


# --- 8. One PPO update --------------------------------------------------------------------------

def ppo_step(policy, reference, critic, prompt_ids: Tensor, prompt_mask: Tensor,
             completion_ids: Tensor, completion_mask: Tensor, old_logprobs: Tensor,
             rewards: Tensor, *, seed: int = 0, beta: float = 0.0, gamma: float = 1.0,
             lam: float = 0.95, whiten_advantages: bool = True,
             value_clip: float | None = 0.2, eps_low: float = 0.2, eps_high: float = 0.2,
             temperature: float = 1.0, num_iterations: int = 1, minibatches: int = 1,
             lr: LearningRate = 5e-4, critic_lr: LearningRate = 1e-3,
             weight_decay: float = 0.0, max_grad_norm: float = 1.0,
             optimizer: torch.optim.Optimizer | None = None,
             critic_optimizer: torch.optim.Optimizer | None = None) -> UpdateResult:
    """One PPO update of `policy` and `critic` on a sampled rollout. The KL to the frozen
    `reference` (None when beta is 0) is a penalty in the token rewards, k1 of the sampling
    log-probs; GAE over those rewards and the critic's values before the update gives the
    advantages (whitened over the batch's real tokens) and the returns, the critic's target.
    The two networks share nothing: each has its own loss, optimizer and gradient clip."""
    T = completion_ids.shape[1]
    ids, mask, positions = sequences(prompt_ids, prompt_mask, completion_ids, completion_mask)
    real = completion_mask.bool()  # (N, T)
    with torch.no_grad():
        old_values = token_values(critic, ids, mask, positions, T)  # (N, T)
        kl = torch.zeros_like(old_logprobs)
        if beta > 0:
            ref_logp = token_logprobs(reference, ids, mask, positions, completion_ids,
                                      temperature)
            kl = kl_k1(old_logprobs, ref_logp)
    r = token_rewards(rewards, real, kl, beta)
    advantages, returns = gae(r, old_values, real, gamma, lam)
    if whiten_advantages:
        advantages = whiten(advantages, real)
    optimizer = optimizer or adamw(policy, weight_decay)
    critic_optimizer = critic_optimizer or adamw(critic, weight_decay)
    sums, steps = {}, 0
    for rows in minibatch_order(len(rewards), num_iterations, minibatches, seed):
        logp = token_logprobs(policy, ids[rows], mask[rows], positions[rows],
                              completion_ids[rows], temperature)
        per_token, binds = clipped_surrogate(logp, old_logprobs[rows], advantages[rows],
                                             real[rows], eps_low, eps_high)
        policy_loss = token_mean(per_token, real[rows])
        values = token_values(critic, ids[rows], mask[rows], positions[rows], T)
        critic_loss = token_mean(value_loss(values, old_values[rows], returns[rows],
                                            value_clip), real[rows])
        (policy_loss + critic_loss).backward()  # separate networks: separate gradients
        figures = {"loss/policy": policy_loss.item(), "loss/value": critic_loss.item(),
                   "perf/grad_norm": optimizer_step(optimizer, rate(lr, steps),
                                                    max_grad_norm),
                   "clip/total": (binds.sum() / real[rows].sum().clamp(min=1)).item()}
        optimizer_step(critic_optimizer, rate(critic_lr, steps), max_grad_norm)
        for key, value in figures.items():
            sums[key] = sums.get(key, 0.0) + value
        steps += 1
    return UpdateResult(advantages, {key: value / steps for key, value in sums.items()},
                      returns)
