"""DPO on the policy's own groups (`algo="dpo"`): pairs, the loss, the step.

    prompts --rollout--> G completions each --reward--> r --pairs--> (chosen, rejected)
            --policy and reference log-probs--> DPO loss --> update

Direct Preference Optimization (Rafailov et al., 2023) needs no reward model and no
critic: on a pair of completions of one prompt, chosen y_w and rejected y_l, with
h = [log pi(y_w) - log pi_ref(y_w)] - [log pi(y_l) - log pi_ref(y_l)] (log-probs summed over
each completion's tokens), its loss is

    sigmoid  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
             (eps: label smoothing, the conservative DPO of Mitchell, 2023; 0 is DPO)
    ipo      (h' - 1 / (2 beta))^2, h' with each log-ratio divided by its completion's length
             (IPO, Azar et al., 2023, length-normalised as TRL's DPOTrainer computes it)
    robust   [-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)] / (1 - 2 eps)
             (Chowdhury et al., 2024, as TRL's)

and beta log pi(y)/pi_ref(y) is the completion's implied reward, logged as TRL logs it.

The pairs come from the same rollout and reward as GRPO's (`labkit.stages`): in each group
of G, the best completion is paired with the worst, the second best with the second worst,
while the better one's reward is strictly higher (with a 0/1 reward, min(right, wrong)
pairs); a group of equal rewards gives none and is counted, as GRPO counts its zero-std
groups. Online (`dpo_online`, the default) samples every step from the policy as it
stands; offline samples from the starting model, the frozen reference, so each step's pairs
are what one dataset drawn once from that model would hold, each sample counted once in
the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from labkit import stages
from labkit.formulas import losses
from labkit.formulas.metrics import masked_mean
from labkit.model.learner import Learner
from labkit.model.scoring import token_scores
from labkit.problems.tasks import Problem
from labkit.settings.config import TrainConfig
from labkit.update import StepOutput, plain_update

LOSS_TYPES = ("sigmoid", "ipo", "robust")


@dataclass
class Pairs:
    """Row indices of the chosen and rejected completions (P,) each, pair by pair, and how
    many groups gave no pair."""

    chosen: Tensor
    rejected: Tensor
    pairless_groups: int


def pairs(rewards: Tensor, group_size: int) -> Pairs:
    """The preference pairs of a step's rewards (N,), G per prompt next to each other: in
    each group the k-th best completion against the k-th worst, k < G // 2, while the better
    one's reward is strictly higher; ties keep the order of sampling."""
    groups = rewards.detach().float().cpu().view(-1, group_size)
    chosen, rejected, pairless = [], [], 0
    for g, row in enumerate(groups.tolist()):
        order = sorted(range(group_size), key=lambda i: (-row[i], i))
        found = 0
        for k in range(group_size // 2):
            best, worst = order[k], order[group_size - 1 - k]
            if row[best] <= row[worst]:
                break
            chosen.append(g * group_size + best)
            rejected.append(g * group_size + worst)
            found += 1
        pairless += found == 0
    device = rewards.device
    return Pairs(torch.tensor(chosen, dtype=torch.long, device=device),
                 torch.tensor(rejected, dtype=torch.long, device=device), pairless)


def dpo_loss(chosen_logp: Tensor, rejected_logp: Tensor, ref_chosen_logp: Tensor,
             ref_rejected_logp: Tensor, *, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, chosen_len: Tensor | None = None,
             rejected_len: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair losses (P,) of `loss_type` (module docstring) from the completions' summed
    log-probs (P,) under the policy and the reference, and the implied rewards beta x
    log-ratio of the chosen and of the rejected (P,) each, detached. ipo needs the
    completions' lengths in tokens (`chosen_len`, `rejected_len`)."""
    chosen_ratio = chosen_logp - ref_chosen_logp
    rejected_ratio = rejected_logp - ref_rejected_logp
    eps = label_smoothing
    if loss_type == "sigmoid":
        h = beta * (chosen_ratio - rejected_ratio)
        loss = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
    elif loss_type == "robust":
        h = beta * (chosen_ratio - rejected_ratio)
        loss = (-(1 - eps) * F.logsigmoid(h) + eps * F.logsigmoid(-h)) / (1 - 2 * eps)
    elif loss_type == "ipo":
        if chosen_len is None or rejected_len is None:
            raise ValueError("loss_type='ipo' divides each log-ratio by its completion's length: "
                             "pass chosen_len and rejected_len")
        h = chosen_ratio / chosen_len.clamp(min=1) - rejected_ratio / rejected_len.clamp(min=1)
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def pair_stats(loss: Tensor, chosen_reward: Tensor, rejected_reward: Tensor) -> dict:
    """What a DPO step logs of its pairs, TRL's rewards/... figures among them."""
    margin = chosen_reward - rejected_reward
    return {"loss/dpo": loss.mean().item(), "dpo/reward_chosen": chosen_reward.mean().item(),
            "dpo/reward_rejected": rejected_reward.mean().item(),
            "dpo/reward_margin": margin.mean().item(),
            "dpo/reward_accuracy": (margin > 0).float().mean().item()}


def signs(n: int, found: Pairs, device) -> Tensor:
    """(N,): +1 for a chosen completion, -1 for a rejected one, 0 for the rest: the sign of
    the weight each completion's log-likelihood gets in the update (`StepOutput.advantages`
    of a DPO step)."""
    out = torch.zeros(n, device=device)
    out[found.chosen] = 1.0
    out[found.rejected] = -1.0
    return out


def step(config: TrainConfig, learner: Learner, tokenizer, problems: list[Problem],
         step_seed: int, on_rollout=None):
    """One DPO step on `problems`: the rollout (from the policy, or offline from the frozen
    reference), the rewards, the pairs, then num_iterations passes of `minibatches`
    optimizer steps over the pairs."""

    sampler = None if config.dpo_online else learner.reference
    # 1. rollout and reward, as GRPO's
    batch = stages.sample(config, learner, tokenizer, problems, step_seed, model=sampler)
    rewards = stages.reward(config, problems, batch, step_seed)
    if on_rollout is not None:
        on_rollout(batch, rewards)
    # 2. pairs from each group: chosen above rejected
    found = pairs(rewards, config.group_size)
    stats = {"dpo/pairs": float(len(found.chosen)),
             "dpo/pairless_frac": found.pairless_groups / len(problems)}
    A = signs(len(rewards), found, rewards.device)
    if len(found.chosen) == 0:
        learner.passes.moved(batch)
        return StepOutput(batch, rewards, A, stats)
    # 3. the reference's log-probs of every completion, one no-grad pass
    ref_logp = stages.no_grad_scores(config, learner.reference, learner, batch,
                                     distribution=False)
    if config.dpo_online:
        stats |= stages.kl_k1(batch, ref_logp)
    if config.dpo_grpo_cosine:  # before the update: both gradients at the same weights
        stats["dpo/grpo_cosine"] = grpo_cosine(config, learner, batch, rewards, found, ref_logp)
    # 4. the DPO loss on the pairs, minibatch by minibatch
    stats |= dpo_update(config, learner, batch, found, ref_logp, step_seed)
    return StepOutput(batch, rewards, A, stats)


def grpo_cosine(config: TrainConfig, learner: Learner, batch, rewards: Tensor, found: Pairs,
                ref_logp: Tensor) -> float:
    """The cosine between two gradients of the policy's trained weights at its current
    weights: DPO's loss on the pairs `found`, and GRPO's (the estimator's advantages of
    `rewards`, -A log pi aggregated by `agg`: the clipped surrogate's gradient at ratio 1,
    without KL) on the whole rollout. With G=2, GRPO's advantage is +-c on the pair and 0
    elsewhere; the two then differ only in how they weigh pairs and tokens."""

    params = [p for group in learner.optimizer.param_groups for p in group["params"]]
    mask = batch.completion_mask
    kept, batch.recording = batch.recording, None  # the update may still replay it
    try:
        with learner.accelerator.autocast():
            logp = token_scores(learner.policy, batch, None, temperature=config.temperature,
                                share_prompt=config.share_prompt,
                                forward=learner.passes.lm).logp
    finally:
        batch.recording = kept
    A = stages.group_advantages(config, rewards, mask)
    A_t = A[:, None].expand_as(logp) if A.dim() == 1 else A
    grpo = losses.aggregate(-A_t * logp, mask, agg=config.agg, max_len=config.max_new_tokens)
    seq, seq_ref, lengths = (logp * mask).sum(1), (ref_logp * mask).sum(1), mask.sum(1).float()
    c, r = found.chosen, found.rejected
    dpo, _, _ = dpo_loss(seq[c], seq[r], seq_ref[c], seq_ref[r], beta=config.dpo_beta,
                         loss_type=config.dpo_loss, label_smoothing=config.label_smoothing,
                         chosen_len=lengths[c], rejected_len=lengths[r])
    ours = torch.autograd.grad(dpo.mean(), params, retain_graph=True, allow_unused=True)
    theirs = torch.autograd.grad(grpo, params, allow_unused=True)

    def flat(grads) -> Tensor:
        return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten().double()
                          for g, p in zip(grads, params)])

    a, b = flat(ours), flat(theirs)
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30))


def dpo_update(config: TrainConfig, learner: Learner, batch, found: Pairs, ref_logp: Tensor,
           step_seed: int) -> dict:
    """The DPO loss over the pairs, num_iterations passes of `minibatches` optimizer steps of
    grad_accum micro-batches (`labkit.update.plain_update`); the mean of their stats."""

    mask = batch.completion_mask
    seq_ref = (ref_logp * mask).sum(1)
    lengths = mask.sum(1).to(seq_ref.dtype)
    where = found.chosen.device

    def terms(micro: Tensor, minibatch: Tensor) -> tuple[Tensor, dict]:
        c, r = found.chosen[micro.to(where)], found.rejected[micro.to(where)]
        rows = torch.cat([c, r])
        with learner.accelerator.autocast():
            scores = token_scores(learner.policy, batch, rows, temperature=config.temperature,
                                  with_entropy=True, share_prompt=config.share_prompt,
                                  forward=learner.passes.lm)
        seq, k = (scores.logp * mask[rows]).sum(1), len(c)
        loss, chosen_reward, rejected_reward = dpo_loss(
            seq[:k], seq[k:], seq_ref[c], seq_ref[r], beta=config.dpo_beta,
            loss_type=config.dpo_loss, label_smoothing=config.label_smoothing,
            chosen_len=lengths[c], rejected_len=lengths[r])
        share = k / len(minibatch)
        stats = pair_stats(loss.detach(), chosen_reward, rejected_reward) | {
            "policy/entropy": masked_mean(scores.entropy, mask[rows])}
        return loss.mean() * share, {key: value * share for key, value in stats.items()}

    out = plain_update(config, learner, batch, torch.arange(len(found.chosen)), step_seed,
                       terms)
    return out | {"loss/total": out["loss/dpo"]}
