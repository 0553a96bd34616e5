"""GRPO and PPO: one step each, built from the blocks in the order of docs/architecture.md.

    prompts --rollout--> RolloutBatch --reward--> r (N,) --advantage--> A --loss--> update

The two steps differ only in the advantage arrow and the critic: GRPO compares the G
completions of a prompt with each other (no critic); PPO asks a learned critic for a value
per token and runs GAE on token rewards. Everything else (rollout, reward, clipped loss,
optimizer) is shared. `labkit.trainer.train` repeats a step and owns the run.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from labkit import advantages as adv
from labkit import losses, mismatch, parallel
from labkit.config import TrainConfig
from labkit.loss_modes import high_entropy_mask, policy_loss_mode
from labkit.metrics import masked_mean
from labkit.rollout import RolloutBatch
from labkit.scoring import FAST_PASSES, Passes, token_scores, token_values


@dataclass
class StepOutput:
    """What a step hands back for metrics and live plots."""

    advantages: Tensor
    """(N,) for GRPO, (N, T) for PPO."""
    stats: dict
    """Loss terms, clip fractions, grad norm... averaged over the step's optimizer steps."""
    values: Tensor | None = None
    """PPO: the critic's values (N, T) before the update."""
    returns: Tensor | None = None
    """PPO: GAE returns (N, T), the critic's target."""


@dataclass
class Learner:
    """What one step updates: the policy (and PPO's critic), their optimizers and schedules."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    accelerator: object
    reference: torch.nn.Module | None = None
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: object = None
    passes: Passes = FAST_PASSES
    """How the policy, the reference and the critic run (`TrainConfig.fast`)."""
    beta: float = 0.0
    """The KL coefficient now: config.beta, moved by the adaptive controller (kl_target)."""


def advantage_inputs(config: TrainConfig, rewards: Tensor, mask: Tensor | None = None, *,
                     token_rewards: Tensor | None = None,
                     extras: dict | None = None) -> adv.AdvantageInputs:
    """What the estimator reads: the rewards (N,), the mask (N, T), the config's options, and
    the extras computed for it (`components`, `greedy_rewards`, `values`)."""
    extras = dict(extras or {})
    return adv.AdvantageInputs(
        rewards, config.group_size, mask=mask, scale=config.scale,
        unbiased=config.std_unbiased, gamma=config.gamma, lam=config.lam,
        whiten=config.whiten_advantages, token_rewards=token_rewards,
        components=extras.pop("components", None),
        component_weights=extras.pop("component_weights", None), extras=extras)


def group_advantages(config: TrainConfig, rewards: Tensor, mask: Tensor | None = None,
                     extras: dict | None = None) -> Tensor:
    """GRPO's arrow: the advantages by the estimator `config.estimator` of
    `labkit.advantages.ESTIMATORS`, one per completion (N,) or per token (N, T)."""
    estimator = adv.ESTIMATORS.resolve(config.estimator, "estimator")
    return estimator(advantage_inputs(config, rewards, mask, extras=extras))


def kept_rows(config: TrainConfig, rewards: Tensor, truncated: Tensor | None = None,
              keep: Tensor | None = None) -> Tensor:
    """Row indices the update uses: all; without those of groups of equal rewards (dynamic
    sampling); without the completions cut at the budget (mask_truncated, `truncated` (N,));
    only those of `keep` (N,) (the mismatch's rejection)."""
    keep = torch.ones_like(rewards, dtype=torch.bool) if keep is None else keep.clone()
    if config.dynamic_sampling:
        groups = rewards.view(-1, config.group_size)  # (B, G)
        mixed = groups.amax(-1) != groups.amin(-1)  # (B,)
        keep &= mixed.repeat_interleave(config.group_size)
    if config.mask_truncated and truncated is not None:
        keep &= ~truncated.to(keep.device)
    return torch.nonzero(keep).squeeze(-1)


def _micro_batches(config: TrainConfig, rows: Tensor, step_seed: int, processes: int = 1):
    """For each optimizer step, its pass over the batch (0 for the first) and its
    micro-batches of row indices (a shuffled split into grad_accum x processes)."""
    generator = torch.Generator().manual_seed(step_seed)
    for pass_index in range(config.num_iterations):
        order = rows[torch.randperm(len(rows), generator=generator).to(rows.device)]
        for minibatch in order.chunk(config.minibatches):
            parts = minibatch.chunk(config.grad_accum * processes)
            yield pass_index, [m for m in parts if len(m)]


def _optimizer_step(learner: Learner, optimizer, scheduler, max_norm: float):
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


def policy_terms(config: TrainConfig, learner: Learner, batch: RolloutBatch, micro: Tensor,
                 advantages: Tensor, ref_logp: Tensor | None,
                 token_weight: Tensor | None = None) -> tuple[Tensor, dict]:
    """The policy's loss on rows `micro`: the loss mode `config.loss` (the clipped surrogate
    by default; REINFORCE with `reinforce`) + beta KL - entropy. ref_logp: (N, T), or the
    reference's log-distributions (N, T, V) for kl_kind full."""
    want_entropy_grad = config.entropy_coef > 0
    kl_in_loss = ref_logp is not None and config.kl_place == "loss"
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


CLIP_KEYS = ("clip/low", "clip/high", "clip/total")
"""The clip fractions also logged over the passes after the first, as `reuse/clip_*`: on the
first pass the ratio is 1 and nothing clips, so the average over all passes dilutes them."""


def _minibatch_terms(config: TrainConfig, learner: Learner, batch: RolloutBatch,
                     micro_batches: list[Tensor], advantages: Tensor, ref_logp: Tensor | None,
                     old_values: Tensor | None, returns: Tensor | None,
                     token_weight: Tensor | None = None) -> dict:
    """Backward of one minibatch's loss, micro-batch by micro-batch (on several processes,
    this process's micro-batches); its stats, each micro-batch's weighted by its share of
    the minibatch (summed over the processes)."""
    acc, sums = learner.accelerator, defaultdict(float)
    minibatch = torch.cat(micro_batches)
    error = None
    try:
        for index, micro in enumerate(micro_batches):
            if parallel.mine(index, acc):
                _micro_terms(config, learner, batch, micro, minibatch, advantages, ref_logp,
                             old_values, returns, token_weight, sums)
    except FloatingPointError as e:
        error = e
    parallel.raise_together(error, acc)
    return parallel.sum_stats(sums, acc)


def _micro_terms(config: TrainConfig, learner: Learner, batch: RolloutBatch, micro: Tensor,
                 minibatch: Tensor, advantages: Tensor, ref_logp: Tensor | None,
                 old_values: Tensor | None, returns: Tensor | None,
                 token_weight: Tensor | None, sums: dict) -> None:
    """Backward of one micro-batch's loss, weighted by its share of the minibatch; its
    stats, so weighted, added to `sums`."""
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
        sums[key] += value * share


def update(config: TrainConfig, learner: Learner, batch: RolloutBatch, rows: Tensor,
           advantages: Tensor, step_seed: int, *, ref_logp: Tensor | None = None,
           old_values: Tensor | None = None, returns: Tensor | None = None,
           token_weight: Tensor | None = None) -> dict:
    """num_iterations x minibatches optimizer steps over `rows`; mean of their stats, and
    (num_iterations > 1) the mean of the clip fractions over passes >= 2 as `reuse/clip_*`.
    token_weight `(N, T)`: importance weights on the policy loss (the mismatch's)."""
    sums, reuse, steps, reuse_steps = defaultdict(float), defaultdict(float), 0, 0
    acc = learner.accelerator
    for pass_index, micro_batches in _micro_batches(config, rows, step_seed,
                                                    parallel.size(acc)):
        stats = _minibatch_terms(config, learner, batch, micro_batches, advantages, ref_logp,
                                 old_values, returns, token_weight)
        parallel.sum_grads([m for m in (learner.policy, learner.critic) if m is not None], acc)
        stats["perf/grad_norm"] = _optimizer_step(learner, learner.optimizer,
                                                  learner.scheduler, config.max_grad_norm)
        batch.recording = None  # the policy has moved: the rollout's outputs no longer hold
        if learner.critic is not None:
            _optimizer_step(learner, learner.critic_optimizer, learner.critic_scheduler,
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


def _reference_logprobs(config: TrainConfig, learner: Learner, batch: RolloutBatch):
    """The reference's log-probs of the sampled tokens (N, T), or for kl_kind full its
    log-distributions (N, T, V); None without a reference."""
    if learner.reference is None:
        return None
    return _no_grad_scores(config, learner.reference, learner, batch,
                           distribution=config.kl_estimator == "full")


def _no_grad_scores(config: TrainConfig, model, learner: Learner, batch: RolloutBatch, *,
                    distribution: bool) -> Tensor:
    # inference mode: no autograd bookkeeping on a pass nothing differentiates; on several
    # processes each scores its own rows and the parts are gathered
    acc = learner.accelerator
    rows = parallel.pass_rows(batch, acc)
    with torch.inference_mode(), acc.autocast():
        scores = token_scores(model, batch, rows, temperature=config.temperature,
                              distribution=distribution, share_prompt=config.share_prompt,
                              forward=learner.passes.lm)
    out = scores.log_dist if distribution else scores.logp
    # an ordinary tensor, which the loss may keep for its backward
    return parallel.gather_rows(out.clone(), acc)


def old_values(config: TrainConfig, learner: Learner, batch: RolloutBatch) -> Tensor:
    """The critic's values (N, T) before the update, fp32 (on several processes, each
    process's rows, gathered)."""
    acc = learner.accelerator
    rows = parallel.pass_rows(batch, acc)
    with torch.inference_mode(), acc.autocast():
        values = token_values(learner.critic, batch, rows, share_prompt=config.share_prompt)
    return parallel.gather_rows(values.float().clone(), acc)  # an ordinary tensor


def sampling_side(config: TrainConfig, learner: Learner, batch: RolloutBatch) -> Tensor:
    """The sampling policy's side of its KL to the reference: its log-probs (N, T), or for
    kl_kind full its log-distributions (N, T, V), one no-grad pass of the policy before the
    update (the rollout keeps only the sampled tokens' log-probs)."""
    if config.kl_estimator != "full":
        return batch.old_logprobs
    return _no_grad_scores(config, learner.policy, learner, batch, distribution=True)


def _sampled(batch: RolloutBatch, logp: Tensor) -> Tensor:
    """Log-probs (N, T) of the sampled tokens: `logp` itself, or gathered from (N, T, V)."""
    if logp.dim() == 2:
        return logp
    return logp.gather(-1, batch.completion_ids[..., None]).squeeze(-1)


def kl_k1(batch: RolloutBatch, ref_logp: Tensor | None) -> dict:
    """`policy/kl_k1`: mean over real tokens of k1 = logp_old - ref_logp (N, T), the sampling
    log-probs against the reference before the update (Schulman's k1, unbiased); the same
    quantity for GRPO and PPO whatever their kl_kind (ref_logp may be (N, T, V)). {}
    without a reference."""
    if ref_logp is None:
        return {}
    mask, ref = batch.completion_mask, _sampled(batch, ref_logp)
    return {"policy/kl_k1": masked_mean(losses.kl(batch.old_logprobs, ref, "k1"), mask)}


def rescore(config: TrainConfig, learner: Learner,
            batch: RolloutBatch) -> tuple[RolloutBatch, Tensor | None, Tensor | None, dict]:
    """The sampler-learner mismatch (`config.rescores_old`): the learner's own log-probs of
    the sampled tokens, one no-grad pass, become the batch's old log-probs; returns (batch,
    importance weights (N, T) or None, rows kept by the rejection (N,) or None, stats)."""
    if not config.rescores_old:
        return batch, None, None, {}
    logp = _no_grad_scores(config, learner.policy, learner, batch, distribution=False)
    mask, sampler = batch.completion_mask, batch.old_logprobs
    stats = mismatch.mismatch_stats(logp, sampler, mask)
    log_ratio = torch.where(mask.bool(), logp - sampler, torch.zeros_like(logp))
    weights = keep = None
    if config.mismatch_is != "off":
        weights = mismatch.is_weights(log_ratio, mask, level=config.mismatch_is,
                                      cap=config.mismatch_cap, low=config.mismatch_low)
        stats["mismatch/weight_mean"] = masked_mean(weights, mask)
    if config.reject_low is not None:
        keep = mismatch.keep_sequences(log_ratio, mask, config.reject_low, config.reject_high)
        stats["mismatch/rejected_frac"] = 1.0 - keep.float().mean().item()
    return replace(batch, old_logprobs=logp), weights, keep, stats


def grpo_step(config: TrainConfig, learner: Learner, batch: RolloutBatch, rewards: Tensor,
              step_seed: int, extras: dict | None = None) -> StepOutput:
    """One GRPO update from a rollout and its rewards (advantages (N,), or (N, T) for the
    per-token estimators); `extras` holds what the estimator declared it needs.

    Departures from PPO: no critic; the baseline is the group's mean reward (and, for grpo,
    the scale its std); KL to the reference sits in the loss, unless kl_in="reward": then
    the estimator sees r - beta * sum_t KL_t (and per-token ones the per-token penalty).
    """
    batch, weights, keep, mismatch_stats = rescore(config, learner, batch)
    mask = batch.completion_mask
    in_reward = config.kl_place == "reward" and learner.reference is not None
    ref_logp = _reference_logprobs(config, learner, batch) if in_reward else None
    token_rewards = old = None
    if in_reward:  # the reward seen by the estimator; the logged reward stays the task's
        old = sampling_side(config, learner, batch)
        token_rewards = losses.ppo_token_rewards(rewards, mask, logp=old,
                                                 ref_logp=ref_logp, beta=learner.beta,
                                                 kind=config.kl_estimator)
        estimator = adv.ESTIMATORS.resolve(config.estimator, "estimator")
        advantages = estimator(advantage_inputs(config, token_rewards.sum(1), mask,
                                                token_rewards=token_rewards, extras=extras))
    else:
        advantages = group_advantages(config, rewards, mask, extras)
    rows = kept_rows(config, rewards, batch.truncated, keep)
    stats = {"rollout/kept_frac": len(rows) / rewards.shape[0], **mismatch_stats}
    if len(rows) == 0:  # every group had equal rewards: nothing to learn this step
        return StepOutput(advantages, stats)
    if ref_logp is None:
        ref_logp = _reference_logprobs(config, learner, batch)
    stats |= kl_k1(batch, ref_logp)
    stats |= update(config, learner, batch, rows, advantages, step_seed, ref_logp=ref_logp,
                    token_weight=weights)
    stats |= adapt_beta(config, learner, batch, ref_logp, old)
    return StepOutput(advantages, stats)


def adapt_beta(config: TrainConfig, learner: Learner, batch: RolloutBatch,
               ref_logp: Tensor | None, old: Tensor | None = None) -> dict:
    """`policy/beta`, the KL coefficient this step used, and with kl_target the controller's
    move of `learner.beta` for the next step (KL: the step's mean per-token estimate of the
    sampling policy, kind kl_estimator, over sequences then rows, as verl; `old` is
    `sampling_side`'s, computed here when not given). {} without a reference."""
    if ref_logp is None:
        return {}
    stats = {"policy/beta": learner.beta}
    if config.kl_target is not None:
        mask = batch.completion_mask
        old = sampling_side(config, learner, batch) if old is None else old
        kl_t = losses.kl(old, ref_logp, config.kl_estimator, mask=mask)
        per_row = kl_t.sum(1) / mask.sum(1).clamp(min=1)
        learner.beta = losses.adaptive_beta(learner.beta, float(per_row.mean()),
                                            config.kl_target, config.kl_horizon,
                                            mask.shape[0])
    return stats


def ppo_step(config: TrainConfig, learner: Learner, batch: RolloutBatch, rewards: Tensor,
             step_seed: int, extras: dict | None = None) -> StepOutput:
    """One PPO update (token advantages (N, T)).

    The scalar reward sits on each completion's last token, minus beta * KL to the reference
    on every token (or, kl_in="loss", beta * KL in the policy loss instead); the critic's
    values turn these token rewards into GAE advantages (whitened over the batch) and
    returns, the critic's regression target.
    """
    batch, weights, keep, mismatch_stats = rescore(config, learner, batch)
    mask = batch.completion_mask
    ref_logp = _reference_logprobs(config, learner, batch)
    values = old_values(config, learner, batch)  # (N, T)
    in_reward = ref_logp is not None and config.kl_place == "reward"
    old = sampling_side(config, learner, batch) if in_reward else None
    token_rewards = losses.ppo_token_rewards(
        rewards, mask, logp=old,
        ref_logp=ref_logp if in_reward else None, beta=learner.beta if in_reward else 0.0,
        kind=config.kl_estimator)
    estimator = adv.ESTIMATORS.resolve(config.estimator, "estimator")  # gae by default
    advantages = estimator(advantage_inputs(config, rewards, mask, token_rewards=token_rewards,
                                            extras={**(extras or {}), "values": values}))
    _, returns = adv.gae(token_rewards, values, mask, gamma=config.gamma, lam=config.lam)
    rows = kept_rows(config, rewards, batch.truncated, keep)
    stats = {"rollout/kept_frac": len(rows) / rewards.shape[0], **mismatch_stats}
    if len(rows) == 0:  # every completion was cut or rejected: nothing to learn
        return StepOutput(advantages, stats, values=values, returns=returns)
    stats |= update(config, learner, batch, rows, advantages, step_seed, token_weight=weights,
                   ref_logp=None if in_reward else ref_logp, old_values=values,
                   returns=returns)
    if in_reward:
        stats["policy/kl"] = masked_mean(losses.kl(old, ref_logp, config.kl_estimator), mask)
    stats |= kl_k1(batch, ref_logp)
    stats |= adapt_beta(config, learner, batch, ref_logp, old)
    return StepOutput(advantages, stats, values=values, returns=returns)
