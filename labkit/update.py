"""The loss and the update of a step: num_iterations passes x minibatches optimizer steps.

    rows, advantages --minibatches--> micro-batches --policy_terms (+ value loss)--> backward
                     --> clip the gradient norm --> AdamW step (policy, and the critic's)

`policy_terms` is the policy's loss on some rows: the loss mode `config.loss` (the clipped
surrogate by default) + beta KL to the reference - the entropy bonus. A critic, when the
learner has one, adds its value loss. Micro-batches are weighted by their share of the
minibatch (`losses.accumulation_weight`), so grad_accum changes nothing but memory.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from labkit.formulas import losses
from labkit.formulas.metrics import masked_mean
from labkit.formulas.policy_losses import high_entropy_mask, policy_loss_mode
from labkit.model import parallel
from labkit.model.learner import Learner
from labkit.model.rollout import RolloutBatch
from labkit.model.scoring import token_scores, token_values
from labkit.settings.config import TrainConfig


@dataclass
class StepOutput:
    """What a step hands back for metrics and live plots."""

    batch: RolloutBatch
    """The rollout as sampled (its old log-probs the sampler's)."""
    rewards: Tensor
    """(N,) the rewards the advantages were computed from (with the overlong penalty)."""
    advantages: Tensor
    """What each completion's log-likelihood was weighted by in the update: the advantage,
    (N,) for GRPO, (N, T) for PPO; for DPO the pair sign (+1 chosen, -1 rejected, 0 in no
    pair), for RFT the kept weight (1 kept, 0 not)."""
    stats: dict
    """Loss terms, clip fractions, grad norm... averaged over the step's optimizer steps."""
    values: Tensor | None = None
    """PPO: the critic's values (N, T) before the update."""
    returns: Tensor | None = None
    """PPO: GAE returns (N, T), the critic's target."""


CLIP_KEYS = ("clip/low", "clip/high", "clip/total")
"""The clip fractions also logged over the passes after the first, as `reuse/clip_*`: on the
first pass the ratio is 1 and nothing clips, so the average over all passes dilutes them."""


def update(config: TrainConfig, learner: Learner, batch: RolloutBatch, rows: Tensor,
           advantages: Tensor, step_seed: int, *, ref_logp: Tensor | None = None,
           old_values: Tensor | None = None, returns: Tensor | None = None,
           token_weight: Tensor | None = None) -> dict:
    """num_iterations x minibatches optimizer steps over `rows`; the mean of their stats, and
    (num_iterations > 1) the mean of the clip fractions over passes >= 2 as `reuse/clip_*`.
    ref_logp: the reference's side of the KL in the loss (None: no KL in the loss);
    old_values, returns (N, T): the critic's values before the update and its target;
    token_weight (N, T): importance weights on the policy loss (the mismatch's)."""
    sums, reuse, steps, reuse_steps = defaultdict(float), defaultdict(float), 0, 0
    for pass_index, micro_batches in micro_batch_plan(config, rows, step_seed,
                                                      learner.processes):
        minibatch = torch.cat(micro_batches)

        def backward(micro: Tensor, stats: dict) -> None:
            micro_terms(config, learner, batch, micro, minibatch, advantages, ref_logp,
                        old_values, returns, token_weight, stats)

        if learner.processes > 1:
            stats = parallel.backward_shares(backward, micro_batches,
                                             (learner.policy, learner.critic),
                                             learner.accelerator)
        else:
            stats = {}
            for micro in micro_batches:
                backward(micro, stats)
        stats["perf/grad_norm"] = optimizer_step(learner, learner.optimizer,
                                                 learner.scheduler, config.max_grad_norm)
        learner.passes.moved(batch)  # the policy has moved: what the rollout kept is stale
        if learner.critic is not None:
            optimizer_step(learner, learner.critic_optimizer, learner.critic_scheduler,
                           config.max_grad_norm)
        for key, value in stats.items():
            sums[key] += value
        steps += 1
        if pass_index > 0 and "clip/total" in stats:
            for key in CLIP_KEYS:
                reuse[key.replace("clip/", "reuse/clip_")] += stats[key]
            reuse_steps += 1
    out = {key: value / max(steps, 1) for key, value in sums.items()}
    return out | {key: value / reuse_steps for key, value in reuse.items()}


def micro_batch_plan(config: TrainConfig, rows: Tensor, step_seed: int, processes: int = 1):
    """For each optimizer step, its pass over the batch (0 for the first) and its
    micro-batches of row indices (a shuffled split into grad_accum x processes)."""
    generator = torch.Generator().manual_seed(step_seed)
    for pass_index in range(config.num_iterations):
        order = rows[torch.randperm(len(rows), generator=generator).to(rows.device)]
        for minibatch in order.chunk(config.minibatches):
            parts = minibatch.chunk(config.grad_accum * processes)
            yield pass_index, [m for m in parts if len(m)]


def plain_update(config: TrainConfig, learner: Learner, batch: RolloutBatch, units: Tensor,
                 step_seed: int, terms) -> dict:
    """The optimizer steps of `micro_batch_plan` over `units` for a loss with no ratio and no
    critic (DPO's over pairs, RFT's over kept rows), every process running the whole plan:
    `terms(micro, minibatch)` gives the micro-batch's loss and stats, each already weighted
    by its share of the minibatch. The mean over the steps of their stats and grad norms."""
    sums, steps = defaultdict(float), 0
    for _, micro_batches in micro_batch_plan(config, units, step_seed):
        minibatch, stats = torch.cat(micro_batches), defaultdict(float)
        for micro in micro_batches:
            loss, micro_stats = terms(micro, minibatch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss ({loss.item()}) in the update")
            learner.accelerator.backward(loss)
            for key, value in micro_stats.items():
                stats[key] += value
        stats["perf/grad_norm"] = optimizer_step(learner, learner.optimizer, learner.scheduler,
                                                 config.max_grad_norm)
        learner.passes.moved(batch)  # the policy has moved: what the rollout kept is stale
        for key, value in stats.items():
            sums[key] += value
        steps += 1
    return {key: value / steps for key, value in sums.items()}


def micro_terms(config: TrainConfig, learner: Learner, batch: RolloutBatch, micro: Tensor,
                minibatch: Tensor, advantages: Tensor, ref_logp: Tensor | None,
                old_values: Tensor | None, returns: Tensor | None,
                token_weight: Tensor | None, sums: dict) -> None:
    """Backward of one micro-batch's loss (the policy's, + the critic's value loss), weighted
    by its share of the minibatch; its stats, so weighted, added to `sums`."""
    acc, mask = learner.accelerator, batch.completion_mask
    share = losses.accumulation_weight(config.agg, mask, micro, minibatch)
    with acc.autocast():
        loss, stats = policy_terms(config, learner, batch, micro, advantages, ref_logp,
                                   token_weight)
        if learner.critic is not None:
            values = token_values(learner.critic, batch, micro,
                                  share_prompt=config.share_prompt)
            v_loss, v_stats = losses.value_loss(
                values, old_values[micro], returns[micro], mask[micro],
                clip=config.value_clip, agg=config.agg, max_len=config.max_new_tokens)
            stats |= {**v_stats, "loss/value": v_loss.item()}
            loss = loss + v_loss  # separate networks: each gets its own gradient
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite loss ({loss.item()}) in the update")
    stats["loss/total"] = loss.item()
    acc.backward(loss * share)
    for key, value in stats.items():
        sums[key] = sums.get(key, 0.0) + value * share


def policy_terms(config: TrainConfig, learner: Learner, batch: RolloutBatch, micro: Tensor,
                 advantages: Tensor, ref_logp: Tensor | None,
                 token_weight: Tensor | None = None) -> tuple[Tensor, dict]:
    """The policy's loss on rows `micro`: the loss mode `config.loss` (the clipped surrogate
    by default; REINFORCE with `reinforce`) + beta KL - entropy. ref_logp: (N, T), or the
    reference's log-distributions (N, T, V) for kl_kind full; None: no KL term."""
    want_entropy_grad = config.entropy_coef > 0
    kl_in_loss = ref_logp is not None
    full_kl = kl_in_loss and config.kl_estimator == "full"
    scores = token_scores(learner.policy, batch, micro, temperature=config.temperature,
                          with_entropy=True, entropy_grad=want_entropy_grad,
                          distribution=full_kl, share_prompt=config.share_prompt,
                          forward=learner.passes.lm)
    logp, ent = scores.logp, scores.entropy
    mask = batch.completion_mask[micro]
    agg = dict(agg=config.agg, max_len=config.max_new_tokens)
    A = advantages[micro]
    learns = None  # top_entropy < 1: only the highest-entropy tokens carry the policy loss
    if config.top_entropy < 1:
        learns = high_entropy_mask(ent, mask, config.top_entropy).to(logp.dtype)
    if token_weight is not None:  # the mismatch's importance weights
        w = token_weight[micro].to(logp.dtype)
        learns = w if learns is None else learns * w
    if config.reinforce:  # on-policy: the ratio is 1, so its gradient is A * grad logp
        A_t = A if A.dim() == 2 else A[:, None].expand_as(logp)
        per_token = -A_t * logp if learns is None else -A_t * logp * learns
        pg, stats = losses.aggregate(per_token, mask, **agg), {}
    else:
        pg, stats = policy_loss_mode(config.loss, logp, batch.old_logprobs[micro], A, mask,
                                     eps_low=config.eps_low, eps_high=config.eps_high,
                                     dual_clip=config.dual_clip, level=config.ratio_level,
                                     token_weight=learns, **agg)
        if "clip/low" in stats and "clip/high" in stats:  # disjoint: A < 0, A > 0
            stats["clip/total"] = stats["clip/low"] + stats["clip/high"]
    total = pg
    stats = {**stats, "loss/policy": pg.item(), "policy/entropy": masked_mean(ent, mask)}
    if kl_in_loss:
        kl_t = losses.kl(scores.log_dist if full_kl else logp, ref_logp[micro],
                         config.kl_estimator)
        kl_loss = losses.aggregate(kl_t, mask, **agg)
        total = total + learner.beta * kl_loss
        stats |= {"loss/kl": learner.beta * kl_loss.item(),
                  "policy/kl": masked_mean(kl_t.detach(), mask)}
    if want_entropy_grad:
        ent_loss = losses.aggregate(ent, mask, **agg)
        total = total - config.entropy_coef * ent_loss
        stats["loss/entropy"] = -config.entropy_coef * ent_loss.item()
    return total, stats


def optimizer_step(learner: Learner, optimizer, scheduler, max_norm: float) -> float:
    """Clip the gradients of the optimizer's parameters to `max_norm` (when > 0), step, and
    clear them; the norm before clipping. The optimizer's own list, not a walk over the
    model's modules: a frozen parameter has no gradient to count."""
    norm = torch.tensor(0.0)
    if max_norm > 0:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        norm = learner.accelerator.clip_grad_norm_(parameters, max_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
