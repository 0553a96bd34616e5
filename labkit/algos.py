"""One step of GRPO or PPO, in the order of the papers: rollout, reward, advantage, loss, update.

    prompts --rollout--> RolloutBatch --reward--> r (N,) --advantage--> A --loss--> update

GRPO (DeepSeekMath, Shao et al., 2024) and PPO (Schulman et al., 2017, as InstructGPT runs
it on language) share the stages: GRPO compares the G completions of a prompt with each
other and needs no critic; PPO asks a learned critic for a value per token
(`stages.advantages`), runs GAE on token rewards that carry the KL (`stages.kl_in_reward`)
and adds the critic's value loss and optimizer step (`labkit.update`); the README lists each
place. Which estimator runs is `config.estimator`; a learner has a critic when that
estimator reads one.

Each stage is a function of `labkit.stages`; the ones marked "variant" (the sampler-learner
mismatch, KL in the reward, dynamic sampling, the overlong penalty, the adaptive KL
coefficient) do nothing unless the config asks for them. `labkit.trainer.train` repeats
`step` and owns the run.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from labkit import preference, rft, stages
from labkit.model.learner import Learner
from labkit.model.rollout import RolloutBatch
from labkit.problems.tasks import Problem
from labkit.settings.config import TrainConfig
from labkit.update import StepOutput, update

OTHER_STEPS = {"dpo": preference.step, "rft": rft.step}
"""The algorithms that are not a policy gradient on advantages, and their step."""


def step(config: TrainConfig, learner: Learner, tokenizer, problems: list[Problem],
         step_seed: int, on_rollout: Callable[[RolloutBatch, Tensor], None] | None = None
         ) -> StepOutput:
    """One GRPO or PPO step on `problems`; every random draw is seeded from `step_seed`.
    `on_rollout(batch, rewards)` is called between the reward and the update (the trainer
    times the rollout and keeps a sample of it there). DPO's and RFT's steps share the
    rollout and the reward and go their own way after (`labkit.preference`, `labkit.rft`)."""
    if config.algo in OTHER_STEPS:
        return OTHER_STEPS[config.algo](config, learner, tokenizer, problems, step_seed,
                                        on_rollout)
    # 1. rollout: G completions per prompt, with the sampling policy's log-probs
    batch = stages.sample(config, learner, tokenizer, problems, step_seed)
    # 2. reward: one scalar per completion
    rewards = stages.reward(config, problems, batch, step_seed)
    rewards, stats = stages.overlong(config, batch, rewards)  # variant
    extras = stages.estimator_extras(config, learner, tokenizer, problems, batch, step_seed,
                                     rewards)
    if on_rollout is not None:
        on_rollout(batch, rewards)
    # 3-5. advantage, loss, update
    out = learn(config, learner, batch, rewards, step_seed, extras)
    out.stats |= stats
    if "mc_values" in extras:  # what the Monte Carlo values cost (vineppo)
        out.stats |= {"perf/mc_continuations": extras["mc_continuations"].item(),
                      "perf/mc_s": extras["mc_seconds"].item()}
    return out


def learn(config: TrainConfig, learner: Learner, batch: RolloutBatch, rewards: Tensor,
          step_seed: int, extras: dict | None = None) -> StepOutput:
    """Advantage, loss and update from a rollout and its rewards (N,); `extras` holds what
    the estimator declared it needs (`stages.estimator_extras`)."""
    sampled = batch
    batch, is_weights, keep, stats = stages.correct_mismatch(config, learner, batch)  # variant
    ref_logp = stages.reference_logprobs(config, learner, batch)  # None when beta = 0
    seen, token_rewards, old, kl_stats = stages.kl_in_reward(config, learner, batch, rewards,
                                                             ref_logp)  # variant
    # 3. advantage: the group's (GRPO) or GAE on the critic's values (PPO)
    estimate, values = stages.advantages(config, learner, batch, seen, token_rewards, extras)
    A = estimate.advantages
    rows = stages.kept_rows(config, rewards, batch.truncated, keep)  # variants
    stats = {"rollout/kept_frac": len(rows) / rewards.shape[0], **stats}
    if len(rows) == 0:  # every group had equal rewards, or every row was cut: nothing to learn
        learner.passes.moved(batch)
        return StepOutput(sampled, rewards, A, stats, values, estimate.returns)
    # 4-5. loss and update: minibatches of the clipped surrogate (+ beta KL, + value loss)
    stats |= kl_stats | stages.kl_k1(batch, ref_logp)
    stats |= update(config, learner, batch, rows, A, step_seed,
                    ref_logp=ref_logp if config.kl_place == "loss" else None,
                    old_values=values, returns=estimate.returns, token_weight=is_weights)
    stats |= stages.adapt_beta(config, learner, batch, ref_logp, old)  # variant
    return StepOutput(sampled, rewards, A, stats, values, estimate.returns)
