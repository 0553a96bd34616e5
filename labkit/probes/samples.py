"""A sample of a run's rollouts, kept to be read token by token: `rollouts.jsonl`.

With `TrainConfig.rollouts_every` = k > 0, the first step, every k-th step and the last
step keep their first `rollouts_groups` groups: one line per group with its prompt, answer
and each completion's text, tokens, reward and advantage, and per token the advantage,
the sampling policy's entropy and the ratio pi_new / pi_old after the step's update. The
file is bounded: at most (steps // k + 2) x rollouts_groups lines, each of at most G
completions of at most max_new_tokens tokens. `labkit.lab.plots.rollouts` draws them.

The entropy and the ratio come from two no-grad passes over the kept rows only (before and
after the update), on the steps that keep a sample.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from labkit.model.scoring import token_scores
from labkit.run.rundir import read_log

FILE = "rollouts.jsonl"


def keeps(config, step: int) -> bool:
    """Whether step `step` keeps a sample (the first, every rollouts_every-th, the last)."""
    every = config.rollouts_every
    return every > 0 and (step == 1 or step % every == 0 or step == config.steps)


def logged_rows(config) -> Tensor:
    """The row indices of the kept groups: the first rollouts_groups groups."""
    groups = min(config.rollouts_groups, config.batch_prompts)
    return torch.arange(groups * config.group_size)


def token_view(config, learner, batch, rows: Tensor) -> dict:
    """Per token of `rows`, before the update: the sampling policy's entropy (n, T) and
    log-probs (n, T) under the learner (the ratio's other side comes after it)."""
    policy = learner.accelerator.unwrap_model(learner.policy)
    with torch.inference_mode(), learner.accelerator.autocast():
        scores = token_scores(policy, batch, rows.to(batch.completion_ids.device),
                              temperature=config.temperature, with_entropy=True,
                              forward=learner.passes.lm)
    return {"rows": rows, "entropy": scores.entropy.float().cpu()}


def add_ratio(config, learner, batch, view: dict) -> dict:
    """`view` with the ratio pi_new / pi_old (n, T) of each kept token after the update."""
    policy = learner.accelerator.unwrap_model(learner.policy)
    rows = view["rows"].to(batch.completion_ids.device)
    with torch.inference_mode(), learner.accelerator.autocast():
        new = token_scores(policy, batch, rows, temperature=config.temperature,
                           forward=learner.passes.lm).logp.float()
    old = batch.old_logprobs[rows].float()
    mask = batch.completion_mask[rows].bool()
    ratio = torch.where(mask, (new - old).exp(), torch.ones_like(new))
    return {**view, "ratio": ratio.cpu()}


def _round(values, digits: int = 4) -> list:
    return [round(float(v), digits) if math.isfinite(float(v)) else None for v in values]


def records(step: int, problems, batch, rewards: Tensor, advantages: Tensor, view: dict,
            tokenizer) -> list[dict]:
    """One rollouts.jsonl line per kept group (`view` from token_view and add_ratio)."""
    G = batch.group_size
    rows = view["rows"].tolist()
    out = []
    for first in range(0, len(rows), G):
        group = rows[first] // G
        completions = []
        for k, row in enumerate(rows[first:first + G]):
            n = int(batch.completion_mask[row].sum())
            ids = batch.completion_ids[row, :n].tolist()
            adv = advantages[row].float().cpu()  # a number (GRPO), or per token (T,)
            per_token = adv.expand(n) if adv.dim() == 0 else adv[:n]
            completions.append({
                "text": batch.texts[row], "tokens": [tokenizer.decode([i]) for i in ids],
                "reward": round(float(rewards[row]), 4),
                # the sequence's advantage; for a per-token one, its mean over the tokens
                "advantage": round(float(adv) if adv.dim() == 0 else
                                   float(per_token.mean()) if n else 0.0, 4),
                "token_advantage": _round(per_token),
                "entropy": _round(view["entropy"][first + k, :n]),
                "ratio": _round(view["ratio"][first + k, :n])})
        problem = problems[group]
        out.append({"step": step, "group": group, "prompt": problem.prompt,
                    "answer": problem.answer, "completions": completions})
    return out


def read(run_dir: str | Path) -> list[dict]:
    """The kept groups of a run (whole lines; a torn last line is skipped). The trainer writes
    them through `rundir.Log`, and a resume cuts them back with the run's other logs."""
    return read_log(Path(run_dir) / FILE)


def first_and_last(run_dir: str | Path) -> list[dict]:
    """The kept groups of a run's first and last kept steps."""
    lines = read(run_dir)
    if not lines:
        return []
    steps = sorted({r["step"] for r in lines})
    return [r for r in lines if r["step"] in (steps[0], steps[-1])]
