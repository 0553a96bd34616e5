"""The credit microscope: Monte Carlo values of every prefix (`labkit.model.credit`) set beside
what a critic, GAE and GRPO say each token was worth, position by position and at the ends of
the written steps (article 000: a critic's error at the third step of a five-step derivation
is 4.7 times its error at the first). `look` takes one look; `RunCredit` takes them during a
run (`credit_every`) into credit.jsonl.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from labkit import stages
from labkit.model.credit import (PrefixValues, at_steps, by_position, mc_advantages, prefix_values,
                                 step_ends)
from labkit.model.rollout import RolloutBatch
from labkit.probes.periodic import Periodic
from labkit.problems.reward_expr import score as score_with
from labkit.run.rundir import read_log


@dataclass
class Microscope:
    """One batch under the microscope (`look`): Monte Carlo values against the learner's."""

    batch: RolloutBatch
    rewards: Tensor
    """(N,) the completions' rewards."""
    mc: PrefixValues
    mc_advantages: Tensor
    """(N, T) A_t = V(s_{t+1}) - V(s_t) from the Monte Carlo values."""
    grpo: Tensor
    """(N,) r_i minus its group's mean: GRPO's advantage before the std (Dr. GRPO's), in the
    reward's units like A_t, one number for every token of a completion."""
    critic: Tensor | None = None
    """(N, T) the critic's V(s_t) (PPO), None without a critic."""
    gae: Tensor | None = None
    """(N, T) GAE's advantages from those values before PPO whitens them (its returns minus
    the values), in the reward's units like A_t."""

    def errors(self) -> dict[str, Tensor]:
        """Mean absolute error by token position (T,) of each estimate against the Monte Carlo
        one: `grpo` and `gae` against A_t, `critic` against V(s_t)."""
        mask = self.batch.completion_mask
        out = {"grpo": by_position((self.grpo[:, None] - self.mc_advantages).abs(), mask)}
        if self.critic is not None:
            out["critic"] = by_position((self.critic - self.mc.values[:, :-1]).abs(), mask)
            out["gae"] = by_position((self.gae - self.mc_advantages).abs(), mask)
        return out

    def figures(self, tokenizer, steps: int | None = None) -> dict[str, float]:
        """The flat `credit/...` figures of this look: each estimate's error averaged over
        every real token, the critic's error after each of the first `steps` written steps
        (None: all), and the continuations drawn."""
        errors, mask = self.errors(), self.batch.completion_mask.bool()
        flat = {f"credit/{name}_err": _token_mean(by_pos, mask)
                for name, by_pos in errors.items()}
        for k, _, error in self.critic_error_at_steps(tokenizer)[:steps]:
            flat[f"credit/critic_err_s{k}"] = error
        return flat | {"credit/continuations": float(self.mc.continuations)}

    def critic_error_at_steps(self, tokenizer) -> list[tuple[int, int, float]]:
        """(k, completions, mean |V_critic - V_MC|) after the k-th written step, for each k
        some completion reaches; empty without a critic."""
        if self.critic is None:
            return []
        ends = step_ends(tokenizer, self.batch)
        gap = (self.critic - self.mc.values[:, :-1]).abs()
        gap = torch.cat([gap, torch.full((gap.shape[0], 1), math.nan)], 1)  # t = T: none
        out = []
        for k in range(1, max(map(len, ends), default=0) + 1):
            rows, at = at_steps(gap, ends, k)
            at = at[torch.isfinite(at)]
            if len(at):
                out.append((k, len(at), at.mean().item()))
        return out


def look(trainer, problems, *, samples: int = 8, seed: int = 0) -> Microscope:
    """Sample a batch of `problems` from the trainer's policy (G completions each), score it
    with the run's reward, and set the Monte Carlo value of every prefix (`samples`
    continuations each) beside the critic's values and GAE's advantages (a PPO trainer) and
    GRPO's group-relative advantage."""
    config, learner, tokenizer = trainer.config, trainer.learner, trainer.tokenizer
    problems = list(problems)
    batch = stages.sample(config, learner, tokenizer, problems, seed)
    rewards = stages.reward(config, problems, batch, seed)
    G = config.group_size

    def score(rows: list[int], texts: list[str]) -> list[float]:
        return score_with(config.reward, [problems[r // G] for r in rows], texts, seed)

    mc = prefix_values(trainer.policy, tokenizer, batch, rewards.cpu(), score, samples=samples,
                       max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                       seed=seed)
    mask = batch.completion_mask.cpu()
    grouped = rewards.cpu().float().view(-1, G)
    grpo = (grouped - grouped.mean(1, keepdim=True)).flatten()
    found = Microscope(batch, rewards.cpu(), mc, mc_advantages(mc.values, mask), grpo)
    if learner.critic is not None:
        estimate, values = stages.advantages(config, learner, batch, rewards)
        found.critic = values.cpu().float().masked_fill(~mask.bool(), math.nan)
        raw = estimate.returns - values  # GAE before whitening: the reward's units
        found.gae = raw.cpu().float().masked_fill(~mask.bool(), math.nan)
    return found


CREDIT_FILE = "credit.jsonl"
STEPS_LOGGED = 4
"""Steps after which a run logs the critic's error (`credit/critic_err_s1` .. `_s4`)."""


class RunCredit(Periodic):
    """A run's looks through the microscope every `config.credit_every` steps (and at the
    last step; never at step 0, before the critic has learned anything): `measure(trainer,
    step)` returns the flat `credit/...` floats for that step's metrics.jsonl record ({} on
    other steps) and appends the errors by position to credit.jsonl."""

    file = CREDIT_FILE

    def due(self, step: int) -> bool:
        every = self.config.credit_every
        return bool(every) and step > 0 and (step % every == 0 or step == self.config.steps)

    def take(self, trainer, step: int) -> tuple[dict[str, float], dict]:
        config = self.config
        found = look(trainer, trainer.problems.eval[:config.credit_prompts],
                     samples=config.credit_samples, seed=config.seed * 7919 + step)
        flat = found.figures(trainer.tokenizer, STEPS_LOGGED) | {
            "credit/seconds": found.mc.seconds}
        errors, steps = found.errors(), found.critic_error_at_steps(trainer.tokenizer)
        record = {"step": step, "by_position": {k: [None if math.isnan(x) else round(x, 6)
                                                    for x in v.tolist()]
                                                for k, v in errors.items()},
                  "critic_at_steps": steps, **flat}
        return flat, record


def _token_mean(by_pos: Tensor, mask: Tensor) -> float:
    """The mean over every real token of a per-position mean (weighted by its count)."""
    counts = mask.sum(0).float()
    keep = torch.isfinite(by_pos) & (counts > 0)
    if not keep.any():
        return math.nan
    return float((by_pos[keep] * counts[keep]).sum() / counts[keep].sum())


def read_credit(run_dir) -> list[dict]:
    """The records of a run's credit.jsonl, in order (none when it has none)."""
    return read_log(Path(run_dir) / CREDIT_FILE)
