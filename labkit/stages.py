"""The stages of a step, in the order `labkit.algos` calls them.

    sample -> reward -> [overlong] -> [correct_mismatch] -> reference_logprobs
           -> [kl_in_reward] -> advantages -> [kept_rows] -> (labkit.update) -> [adapt_beta]
    then, by the trainer, which counts the steps: [sync_reference]

A stage in brackets is a variant: it returns its input unchanged (or nothing) unless the
config asks for it, so a reader can skip it. Several processes (`accelerate launch`) change
how the rollout and the no-grad passes are shared out (`labkit.model.parallel`), never what they
compute; one process never reaches that code.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from labkit.formulas import estimators as est
from labkit.formulas import losses, mismatch
from labkit.formulas.metrics import masked_mean
from labkit.model import credit, parallel
from labkit.model.learner import Learner
from labkit.model.rollout import RolloutBatch, rollout
from labkit.model.scoring import token_scores, token_values
from labkit.problems import reward_expr
from labkit.problems.rewards import overlong_penalty
from labkit.problems.tasks import Problem
from labkit.settings.config import TrainConfig

# --- 1. rollout --------------------------------------------------------------------------------


def sample(config: TrainConfig, learner: Learner, tokenizer, problems: list[Problem],
           step_seed: int, model=None) -> RolloutBatch:
    """G completions of each problem's prompt from the policy (or from `model`: offline DPO
    samples from the frozen reference), with the sampling log-probs of their tokens (the
    ratio's old side). One autocast region holds the whole rollout, so its weight casts
    (bf16) are made once and reused by every decode step."""
    own = model is None
    policy = learner.accelerator.unwrap_model(learner.policy if own else model)
    bf16 = config.sampler_precision == "bf16"

    def draw(prompts: list[str], **keywords) -> RolloutBatch:
        region = torch.autocast(learner.accelerator.device.type, dtype=torch.bfloat16) \
            if bf16 else learner.accelerator.autocast()
        with region:
            return rollout(policy, tokenizer, prompts, group_size=config.group_size,
                           max_new_tokens=config.max_new_tokens,
                           temperature=config.sampler_temperature or config.temperature,
                           top_k=config.top_k or 0, top_p=config.top_p, seed=step_seed,
                           decoder=learner.passes.bf16_decoder if bf16
                           else learner.passes.decoder,
                           # a bf16 sampler feeds an fp32 learner: its products cannot stand in
                           keep_outputs=learner.passes.replays and config.replay
                           and not bf16 and own,
                           **keywords)

    prompts = [p.prompt for p in problems]
    if learner.processes > 1:  # each samples its share; every one gets the whole batch
        return parallel.sample_shares(draw, prompts, tokenizer, learner.accelerator)
    return draw(prompts)


# --- 2. reward ---------------------------------------------------------------------------------


def reward(config: TrainConfig, problems: list[Problem], batch: RolloutBatch,
           step_seed: int) -> Tensor:
    """One scalar reward per completion (N,), by `config.reward`; a completion cut at the
    length limit scores 0 unless `score_truncated`."""
    rows = [p for p in problems for _ in range(config.group_size)]  # (N,)
    rewards = torch.tensor(reward_expr.score(config.reward, rows, batch.texts, step_seed),
                           device=batch.completion_ids.device)
    if not config.score_truncated:
        rewards = rewards.masked_fill(batch.truncated, 0.0)
    return rewards


def overlong(config: TrainConfig, batch: RolloutBatch, rewards: Tensor) -> tuple[Tensor, dict]:
    """[variant] DAPO's soft overlong punishment added to the rewards (`overlong_buffer`)."""
    if not config.overlong_buffer:
        return rewards, {}
    lengths = batch.completion_mask.sum(1).tolist()
    penalty = torch.tensor(overlong_penalty(lengths, config.max_new_tokens,
                                            config.overlong_buffer, config.overlong_penalty),
                           device=rewards.device)
    return rewards + penalty, {"rollout/overlong_penalty": penalty.mean().item()}


def estimator_extras(config: TrainConfig, learner: Learner, tokenizer,
                     problems: list[Problem], batch: RolloutBatch, step_seed: int,
                     rewards: torch.Tensor | None = None) -> dict:
    """What `config.estimator` declares it needs beyond the rewards, computed only for it:
    `components` (N, K) and `component_weights` (K,), the reward's terms scored one by one;
    `greedy_rewards` (N,), the reward of one greedy completion per prompt (an extra rollout of
    B rows), repeated over the prompt's G rows; `mc_values` (N, T + 1), the Monte Carlo value
    of each completion's prefix at the start and after each written step (`labkit.model.credit`,
    `vine_samples` continuations each), its reward at its end, with what they cost
    (`mc_continuations`, `mc_seconds`). A critic's `values` come in `advantages`."""
    needs = est.ESTIMATORS.needs(config.estimator)
    device, G, out = learner.accelerator.device, config.group_size, {}
    if "components" in needs:
        rows = [p for p in problems for _ in range(G)]
        scores, weights = reward_expr.score_terms(config.reward, rows, batch.texts, step_seed)
        parts = torch.tensor(scores, device=device)  # (N, K)
        if not config.score_truncated:
            parts = parts.masked_fill(batch.truncated[:, None], 0.0)
        out |= {"components": parts, "component_weights": torch.tensor(weights)}
    if "greedy_rewards" in needs:
        policy = learner.accelerator.unwrap_model(learner.policy)
        with torch.inference_mode(), learner.accelerator.autocast():
            greedy = rollout(policy, tokenizer, [p.prompt for p in problems], group_size=1,
                             max_new_tokens=config.max_new_tokens, greedy=True,
                             decoder=learner.passes.decoder)
        scores = torch.tensor(reward_expr.score(config.reward, list(problems), greedy.texts,
                                                 step_seed), device=device)
        if not config.score_truncated:
            scores = scores.masked_fill(greedy.truncated, 0.0)
        out["greedy_rewards"] = scores.repeat_interleave(G)  # (N,)
    if "mc_values" in needs:
        policy = learner.accelerator.unwrap_model(learner.policy)
        lengths = batch.completion_mask.sum(1).tolist()
        starts = [[0] + [t for t in ends if t < n]
                  for ends, n in zip(credit.step_ends(tokenizer, batch), lengths)]

        def score(rows: list[int], texts: list[str]) -> list[float]:
            return reward_expr.score(config.reward, [problems[r // G] for r in rows], texts,
                                     step_seed)

        with learner.accelerator.autocast():
            found = credit.prefix_values(policy, tokenizer, batch, rewards.cpu(), score,
                                         samples=config.vine_samples, positions=starts,
                                         max_new_tokens=config.max_new_tokens,
                                         temperature=config.temperature, seed=step_seed)
        out |= {"mc_values": found.values.to(device),
                "mc_continuations": torch.tensor(float(found.continuations)),
                "mc_seconds": torch.tensor(found.seconds)}
    return out


# --- the no-grad passes before the update ----------------------------------------------------


def correct_mismatch(config: TrainConfig, learner: Learner, batch: RolloutBatch
                     ) -> tuple[RolloutBatch, Tensor | None, Tensor | None, dict]:
    """[variant] The sampler-learner mismatch (`config.rescores_old`): the learner's own
    log-probs of the sampled tokens, one no-grad pass, become the batch's old log-probs;
    returns (batch, importance weights (N, T) or None, rows kept by the rejection (N,) or
    None, stats). Without it: (batch, None, None, {})."""
    if not config.rescores_old:
        return batch, None, None, {}
    logp = no_grad_scores(config, learner.policy, learner, batch, distribution=False)
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


def reference_logprobs(config: TrainConfig, learner: Learner, batch: RolloutBatch):
    """The reference's log-probs of the sampled tokens (N, T), or for kl_kind full its
    log-distributions (N, T, V); None without a reference (beta = 0)."""
    if learner.reference is None:
        return None
    return no_grad_scores(config, learner.reference, learner, batch,
                          distribution=config.kl_estimator == "full")


def no_grad_scores(config: TrainConfig, model, learner: Learner, batch: RolloutBatch, *,
                   distribution: bool) -> Tensor:
    """`model`'s log-probs (N, T) of the sampled tokens, or its log-distributions (N, T, V),
    in inference mode (no autograd bookkeeping on a pass nothing differentiates); returned
    as an ordinary tensor, which a loss may keep for its backward."""
    def score(rows: Tensor | None) -> Tensor:
        with torch.inference_mode(), learner.accelerator.autocast():
            scores = token_scores(model, batch, rows, temperature=config.temperature,
                                  distribution=distribution, share_prompt=config.share_prompt,
                                  forward=learner.passes.lm)
        return (scores.log_dist if distribution else scores.logp).clone()

    if learner.processes > 1:  # each process scores its own rows; the parts are gathered
        return parallel.score_shares(score, batch, learner.accelerator)
    return score(None)


def sampling_side(config: TrainConfig, learner: Learner, batch: RolloutBatch) -> Tensor:
    """The sampling policy's side of its KL to the reference: its log-probs (N, T), or for
    kl_kind full its log-distributions (N, T, V), one no-grad pass of the policy before the
    update (the rollout keeps only the sampled tokens' log-probs)."""
    if config.kl_estimator != "full":
        return batch.old_logprobs
    return no_grad_scores(config, learner.policy, learner, batch, distribution=True)


def kl_in_reward(config: TrainConfig, learner: Learner, batch: RolloutBatch, rewards: Tensor,
                 ref_logp: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None, dict]:
    """[variant] KL to the reference in the reward (`kl_place` "reward", PPO's default): the
    token rewards (N, T), the reward on the last token minus beta KL_t on every token, and
    the rewards the estimator sees, r - beta sum_t KL_t (N,); returns (those rewards, token
    rewards, the sampling side of the KL, stats). Otherwise (rewards, None, None, {}): the
    KL, if any, goes in the loss. The logged reward stays the task's either way."""
    if ref_logp is None or config.kl_place != "reward":
        return rewards, None, None, {}
    mask, old = batch.completion_mask, sampling_side(config, learner, batch)
    token_rewards = losses.ppo_token_rewards(rewards, mask, logp=old, ref_logp=ref_logp,
                                             beta=learner.beta, kind=config.kl_estimator)
    kl = masked_mean(losses.kl(old, ref_logp, config.kl_estimator), mask)
    return token_rewards.sum(1), token_rewards, old, {"policy/kl": kl}


# --- 3. advantage ------------------------------------------------------------------------------


def advantage_inputs(config: TrainConfig, rewards: Tensor, mask: Tensor | None = None, *,
                     token_rewards: Tensor | None = None,
                     extras: dict | None = None) -> est.AdvantageInputs:
    """What the estimator reads: the rewards (N,), the mask (N, T), the config's options, and
    the extras computed for it (`components`, `greedy_rewards`, `values`)."""
    extras = dict(extras or {})
    return est.AdvantageInputs(
        rewards, config.group_size, mask=mask, scale=config.scale,
        unbiased=config.std_unbiased, gamma=config.gamma, lam=config.lam,
        whiten=config.whiten_advantages, token_rewards=token_rewards,
        components=extras.pop("components", None),
        component_weights=extras.pop("component_weights", None), extras=extras)


def advantages(config: TrainConfig, learner: Learner, batch: RolloutBatch, rewards: Tensor,
               token_rewards: Tensor | None = None, extras: dict | None = None
               ) -> tuple[est.Estimate, Tensor | None]:
    """The estimator `config.estimator`'s advantages, (N,) or (N, T), and its returns where it
    has them; and the critic's values (N, T) or None.

    Here PPO's advantage differs from GRPO's: GRPO's estimators compare the G completions of a
    prompt with each other; PPO's (gae) reads a critic's value of every token, one no-grad
    pass here, turns the token rewards into TD errors and GAE advantages, and gives the
    returns, the critic's regression target in the update."""
    extras, values = dict(extras or {}), None
    if learner.critic is not None:
        values = extras["values"] = critic_values(config, learner, batch)
    inputs = advantage_inputs(config, rewards, batch.completion_mask,
                              token_rewards=token_rewards, extras=extras)
    return est.estimate(config.estimator, inputs), values


def critic_values(config: TrainConfig, learner: Learner, batch: RolloutBatch) -> Tensor:
    """The critic's values (N, T) before the update, fp32, an ordinary tensor."""
    def score(rows: Tensor | None) -> Tensor:
        with torch.inference_mode(), learner.accelerator.autocast():
            values = token_values(learner.critic, batch, rows,
                                  share_prompt=config.share_prompt)
        return values.float().clone()

    if learner.processes > 1:
        return parallel.score_shares(score, batch, learner.accelerator)
    return score(None)


def group_advantages(config: TrainConfig, rewards: Tensor, mask: Tensor | None = None,
                     extras: dict | None = None) -> Tensor:
    """GRPO's arrow alone: the advantages of the estimator `config.estimator`, one per
    completion (N,) or per token (N, T), from the rewards (and the extras it needs)."""
    return est.estimate(config.estimator,
                        advantage_inputs(config, rewards, mask, extras=extras)).advantages


# --- 4. the rows the loss reads ----------------------------------------------------------------


def kept_rows(config: TrainConfig, rewards: Tensor, truncated: Tensor | None = None,
              keep: Tensor | None = None) -> Tensor:
    """[variants] Row indices the update uses: all; without those of groups of equal rewards
    (dynamic sampling); without the completions cut at the budget (mask_truncated,
    `truncated` (N,)); only those of `keep` (N,) (the mismatch's rejection)."""
    keep = torch.ones_like(rewards, dtype=torch.bool) if keep is None else keep.clone()
    if config.dynamic_sampling:
        groups = rewards.view(-1, config.group_size)  # (B, G)
        mixed = groups.amax(-1) != groups.amin(-1)  # (B,)
        keep &= mixed.repeat_interleave(config.group_size)
    if config.mask_truncated and truncated is not None:
        keep &= ~truncated.to(keep.device)
    return torch.nonzero(keep).squeeze(-1)


# --- after the update ----------------------------------------------------------------------


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


def adapt_beta(config: TrainConfig, learner: Learner, batch: RolloutBatch,
               ref_logp: Tensor | None, old: Tensor | None = None) -> dict:
    """[variant] `policy/beta`, the KL coefficient this step used, and with kl_target the
    controller's move of `learner.beta` for the next step (KL: the step's mean per-token
    estimate of the sampling policy, kind kl_estimator, over sequences then rows, as verl;
    `old` is `sampling_side`'s, computed here when not given). {} without a reference."""
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


def sync_reference(config: TrainConfig, learner: Learner, step: int) -> dict:
    """[variant] Iterative GRPO's moving reference (`ref_sync_every`): after every
    ref_sync_every-th step each reference weight becomes alpha x the policy's + (1 - alpha)
    x its own, alpha = ref_mix (TRL's SyncRefModelCallback; alpha 1 copies). Returns
    `ref/synced` (1.0 on a sync step, else 0.0) whenever the config syncs, {} otherwise."""
    if not config.ref_sync_every:
        return {}
    if step % config.ref_sync_every:
        return {"ref/synced": 0.0}
    mix_into(learner.reference, learner.accelerator.unwrap_model(learner.policy),
             config.ref_mix)
    return {"ref/synced": 1.0}


@torch.no_grad()
def mix_into(target: torch.nn.Module, source: torch.nn.Module, alpha: float) -> None:
    """target <- alpha x source + (1 - alpha) x target, parameter by parameter in order (the
    two models share an architecture); a target held in bf16 rounds the result to bf16."""
    pairs = list(zip(target.parameters(), source.parameters(), strict=True))
    for theirs, ours in pairs:
        if theirs.shape != ours.shape:
            raise ValueError(f"the reference and the policy differ in shape ({tuple(theirs.shape)}"
                             f" against {tuple(ours.shape)}): a sync needs the same model")
    for theirs, ours in pairs:
        theirs.mul_(1.0 - alpha).add_(ours.to(theirs.dtype), alpha=alpha)
