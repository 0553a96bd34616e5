"""Notebook 00's helpers: one problem, PPO's advantage before its critic learns, and the
records and summary of one group's figures."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from labkit.formulas import advantages as adv
from labkit.formulas import estimators as est
from labkit.formulas import losses
from labkit.problems.tasks import ArithmeticTask, Problem


def problem(expression: str) -> Problem:
    """The arithmetic problem of an expression like "37+85" or a prompt like "37+85="
    (evaluated left to right); its prompt is the task's, "37+85=" for the embedded model."""
    match = re.fullmatch(r"\s*(\d+(?:\s*[-+*]\s*\d+)+)\s*=?\s*", expression)
    if not match:
        raise ValueError(f"expression must look like '37+85' (numbers joined by + - *), "
                         f"got {expression!r}")
    tokens = re.findall(r"\d+|[-+*]", match.group(1))
    numbers, ops = [int(t) for t in tokens[::2]], tokens[1::2]
    task = ArithmeticTask(digits=max(len(str(n)) for n in numbers), operands=len(numbers),
                          ops="".join(sorted(set(ops))))
    return task.make(numbers, ops)


def ppo_row_advantages(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
                       lam: float = 0.95, whiten: bool = True) -> torch.Tensor:
    """PPO's advantage before its critic learns (V = 0, the zero head of `ValueModel`):
    GAE on the token rewards, whitened over the tokens, then each row's mean -> (N,)."""
    token_rewards = losses.ppo_token_rewards(rewards, mask)  # (N, T)
    a, _ = adv.ppo_advantages(token_rewards, torch.zeros_like(token_rewards), mask,
                              gamma=gamma, lam=lam, whiten_advantages=whiten)
    m = mask.bool()
    return torch.where(m, a, 0.0).sum(1) / m.sum(1).clamp(min=1)  # (N,)


def registered_advantages(rewards: torch.Tensor, mask: torch.Tensor, *,
                          greedy_reward: float) -> dict[str, torch.Tensor]:
    """Every critic-free estimator of `ESTIMATORS` on one group (G = len(rewards)): name ->
    (G,), a per-token estimator's row shown as its mean over the row's real tokens. remax's
    baseline is `greedy_reward`, the reward of the prompt's greedy completion; gdpo sees the
    reward as its one term; vineppo, given no step inside the completions, values the prompt
    by the group's mean reward (itself a Monte Carlo estimate of it) and each end by its
    reward."""
    r = rewards.float()
    values = torch.full((len(r), mask.shape[1] + 1), float("nan"))
    values[:, 0] = r.mean()
    values[torch.arange(len(r)), mask.bool().sum(1)] = r
    x = est.AdvantageInputs(r, len(r), mask=mask, components=r[:, None],
                            extras={"greedy_rewards": torch.full_like(r, greedy_reward),
                                    "mc_values": values})
    m = mask.bool()
    out = {}
    for name in est.ESTIMATORS:
        if "values" in est.ESTIMATORS.needs(name):
            continue
        a = est.estimate(name, x).advantages
        out[name] = a if a.dim() == 1 else torch.where(m, a, 0.0).sum(1) / m.sum(1).clamp(min=1)
    return out


def figure_records(fig, prefix: str) -> list[dict]:
    """One metrics.jsonl line per trace of a figure: its name and its x and y values."""
    out = []
    for trace in fig.data:
        if trace.name and trace.y is not None and len(trace.y):
            quantity = "/".join(str(p) for p in (prefix, trace.meta, trace.name) if p)
            out.append({"quantity": quantity, "x": list(trace.x),
                        "y": [float(v) for v in trace.y]})
    return out


def group_summary(problem: Problem, rewards: torch.Tensor,
                  table: Mapping[str, torch.Tensor]) -> dict:
    """summary.json of one group: the problem, its rewards, each estimator's advantage std."""
    r = rewards.float()
    out = {"prompt": problem.prompt, "answer": problem.answer, "group_size": len(r),
           "reward_mean": r.mean().item(), "correct": int(r.sum().item()),
           "mixed_group": int(r.min().item() != r.max().item())}
    stds = {f"adv_std/{name}": a.float().std(correction=0).item() for name, a in table.items()}
    return out | stds
