"""Rejection-sampling fine-tuning on the policy's own groups (`algo="rft"`).

    prompts --rollout--> G completions each --reward--> r --keep r > 0--> supervised step

RFT (Yuan et al., 2023; the baseline of DeepSeekMath's RL comparison): sample G completions
of each prompt from the policy, keep those the reward accepts (reward > 0: with correctness,
the right ones), and raise their likelihood, -log pi(y) over their tokens, aggregated as
`agg` says (token-mean by default). Nothing pushes the rejected ones down and nothing weighs
a kept one by how rare it was: the contrast with GRPO's advantage is the point. A step is
one round: a fresh rollout from the policy as it stands, then num_iterations passes of
`minibatches` optimizer steps over what it kept.
"""

from __future__ import annotations

import torch
from torch import Tensor

from labkit import stages
from labkit.formulas import losses
from labkit.formulas.metrics import masked_mean
from labkit.model.learner import Learner
from labkit.model.scoring import token_scores
from labkit.problems.tasks import Problem
from labkit.settings.config import TrainConfig
from labkit.update import StepOutput, plain_update


def kept(rewards: Tensor) -> Tensor:
    """Row indices (K,) of the completions a round keeps: reward > 0."""
    return torch.nonzero(rewards > 0).squeeze(-1)


def sft_loss(logp: Tensor, mask: Tensor, agg: str, max_len: int) -> Tensor:
    """The supervised loss of kept completions: -log-prob of each real token (N, T),
    aggregated by `agg` (labkit.formulas.losses.aggregate)."""
    return losses.aggregate(-logp, mask, agg=agg, max_len=max_len)


def step(config: TrainConfig, learner: Learner, tokenizer, problems: list[Problem],
         step_seed: int, on_rollout=None):
    """One RFT round on `problems`: rollout, reward, keep, supervised update."""

    # 1. rollout and reward, as GRPO's
    batch = stages.sample(config, learner, tokenizer, problems, step_seed)
    rewards = stages.reward(config, problems, batch, step_seed)
    if on_rollout is not None:
        on_rollout(batch, rewards)
    # 2. keep the rewarded completions
    rows = kept(rewards)
    weights = (rewards > 0).float()  # (N,): 1 for a kept completion, 0 for the others
    stats = {"rollout/kept_frac": len(rows) / len(rewards)}
    if len(rows) == 0:
        learner.passes.moved(batch)
        return StepOutput(batch, rewards, weights, stats)
    # 3. supervised steps on them
    mask = batch.completion_mask

    def terms(micro: Tensor, minibatch: Tensor) -> tuple[Tensor, dict]:
        share = losses.accumulation_weight(config.agg, mask, micro, minibatch)
        with learner.accelerator.autocast():
            scores = token_scores(learner.policy, batch, micro, temperature=config.temperature,
                                  with_entropy=True, share_prompt=config.share_prompt,
                                  forward=learner.passes.lm)
        loss = sft_loss(scores.logp, mask[micro], config.agg, config.max_new_tokens)
        return loss * share, {"loss/sft": loss.item() * share,
                              "policy/entropy": masked_mean(scores.entropy, mask[micro]) * share}

    out = plain_update(config, learner, batch, rows, step_seed, terms)
    return StepOutput(batch, rewards, weights, stats | out | {"loss/total": out["loss/sft"]})
