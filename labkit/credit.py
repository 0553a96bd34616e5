"""The credit microscope: what each token of a completion was worth, measured, against what a
critic, GAE and GRPO say it was worth.

The value of a prefix s_t (the prompt and the completion's first t tokens) under the current
policy is the expected reward of finishing it: V(s_t) = E[R | s_t]. Here it is estimated by
Monte Carlo, `samples` continuations drawn from s_t by the policy and scored like the run's
own completions (a continuation that runs out of budget scores 0). With gamma = 1 and the
reward at the end, the advantage of token t is A_t = V(s_{t+1}) - V(s_t), and V(s_L) of a
finished completion is its reward. Against this the microscope sets a critic's V_t (PPO's,
the value of the same s_t), GAE's per-token advantages and GRPO's one advantage per
completion, position by position (`by_position`), and at the ends of the written steps
(`step_ends`), where article 000 says a critic's error at the third step of a five-step
derivation is 4.7 times its error at the first.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from labkit.rollout import RolloutBatch, _decode, eos_ids, model_decoder

Score = Callable[[list[int], list[str]], Sequence[float]]
"""score(rows, texts): the reward of each text, a whole completion of batch row rows[k]."""


@dataclass
class PrefixValues:
    """Monte Carlo values of the prefixes of a batch's completions."""

    values: Tensor
    """(N, T + 1): V(s_t) for the prefixes asked for, and each completion's own reward at
    t = its length; NaN elsewhere."""
    continuations: int
    """Continuations drawn, the cost: samples per prefix estimated."""
    seconds: float


@torch.no_grad()
def prefix_values(model, tokenizer, batch: RolloutBatch, rewards: Tensor, score: Score, *,
                  samples: int = 8, max_new_tokens: int, temperature: float = 1.0,
                  positions: Sequence[Sequence[int]] | None = None, seed: int = 0,
                  chunk: int = 1024) -> PrefixValues:
    """V(s_t) of the prefixes of each completion of `batch`, from `samples` continuations each
    under `model` at `temperature` (the model's own decoder, seeded by `seed`).

    `positions[i]`: the prefix lengths t of row i to estimate (each below the row's length);
    None: every t from 0 to the length - 1. A continuation from s_t may write up to
    max_new_tokens - t tokens, the budget the completion had; one that runs out scores 0.
    `rewards` (N,): the completions' own rewards, V at their ends. `chunk`: continuations
    decoded together."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    start = time.perf_counter()
    mask = batch.completion_mask.bool()
    N, T = mask.shape
    lengths = mask.sum(1).tolist()
    values = torch.full((N, T + 1), math.nan)
    for i, length in enumerate(lengths):
        values[i, length] = float(rewards[i])
    if positions is None:
        positions = [range(length) for length in lengths]
    if len(positions) != N:
        raise ValueError(f"positions needs one list per row ({N}), got {len(positions)}")
    wanted: dict[int, list[int]] = {}
    for i, ts in enumerate(positions):
        for t in ts:
            if not 0 <= t < lengths[i]:
                raise ValueError(f"positions[{i}] holds {t}: a prefix length of row {i} lies "
                                 f"in 0 .. {lengths[i] - 1}")
            wanted.setdefault(int(t), []).append(i)
    stop = torch.tensor(eos_ids(model, tokenizer))
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    drawn = 0

    def draw(logits: Tensor) -> tuple[Tensor, Tensor]:
        scaled = logits if temperature == 1.0 else logits / temperature
        uniform = torch.rand(scaled.shape, generator=generator).to(device)
        token = uniform.log_().div_(scaled.softmax(-1)).argmax(-1)
        return token, torch.zeros_like(token, dtype=torch.float32)[:, None]

    def is_stop(ids: Tensor) -> Tensor:
        return torch.isin(ids, stop.to(ids.device))

    per_call = max(1, chunk // samples)
    for t, rows in sorted(wanted.items()):
        budget = max_new_tokens - t
        for k in range(0, len(rows), per_call):
            part = rows[k:k + per_call]
            prompts = batch.group_index[part].tolist()  # each completion's prompt
            ids = torch.cat([batch.prompt_ids[prompts], batch.completion_ids[part, :t]], 1)
            pmask = torch.cat([batch.prompt_mask[prompts],
                               torch.ones(len(part), t, dtype=batch.prompt_mask.dtype,
                                          device=ids.device)], 1)
            engine = model_decoder(model, ids.to(device), samples)
            try:
                raw, _ = _decode(engine, ids.to(device), pmask.to(device), samples, budget,
                                 draw, is_stop)
            finally:
                engine.close()
            stops = is_stop(raw).cpu()
            real = (stops.cumsum(-1) - stops.long()) == 0
            finished = stops.any(-1)
            owners = [i for i in part for _ in range(samples)]
            texts = [tokenizer.decode(batch.completion_ids[i, :t].tolist()
                                      + raw[j][real[j]].tolist(), skip_special_tokens=True)
                     for j, i in enumerate(owners)]
            got = torch.tensor([float(x) for x in score(owners, texts)])
            got = got.masked_fill(~finished, 0.0)
            values[part, t] = got.view(len(part), samples).mean(1)
            drawn += len(owners)
    return PrefixValues(values, drawn, time.perf_counter() - start)


def mc_advantages(values: Tensor, mask: Tensor) -> Tensor:
    """A_t = V(s_{t+1}) - V(s_t) (N, T) from `values` (N, T + 1); NaN where either value is
    unknown or the token is not real."""
    out = values[:, 1:] - values[:, :-1]
    return out.masked_fill(~mask.bool(), math.nan)


def by_position(errors: Tensor, mask: Tensor) -> Tensor:
    """The mean over rows of `errors` (N, T) at each position t (T,), over the real tokens
    whose error is known; NaN at a position with none."""
    keep = mask.bool() & torch.isfinite(errors)
    total = torch.where(keep, errors, 0.0).sum(0)
    count = keep.sum(0)
    return torch.where(count > 0, total / count.clamp(min=1), math.nan)


def step_ends(tokenizer, batch: RolloutBatch, marks: str = ",.") -> list[list[int]]:
    """For each completion, the prefix lengths t at which a written step has just ended: the
    token before t is one of `marks` (the think task's 'a+b=c,' and its final 'c. ') or holds
    a line break (a worked solution written line by line). The answer's box after the last
    mark is not a step."""
    out, seen = [], {}
    for ids, real in zip(batch.completion_ids.tolist(), batch.completion_mask.bool().tolist()):
        ends = []
        for t, (token, keep) in enumerate(zip(ids, real)):
            if keep:
                if token not in seen:
                    text = tokenizer.decode([token])
                    seen[token] = text.strip() in tuple(marks) or "\n" in text
                if seen[token]:
                    ends.append(t + 1)
        out.append(ends)
    return out


def at_steps(per_token: Tensor, ends: list[list[int]], k: int) -> tuple[list[int], Tensor]:
    """(rows, values): for the rows with at least k step ends, `per_token` (N, T + 1) or (N, T)
    at the prefix after their k-th step (k = 1 the first)."""
    rows = [i for i, e in enumerate(ends) if len(e) >= k]
    index = torch.tensor([ends[i][k - 1] for i in rows], dtype=torch.long)
    return rows, per_token[rows, index] if rows else torch.empty(0)


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
    from labkit import stages
    from labkit.reward_expr import score as score_with

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


class RunCredit:
    """A run's looks through the microscope every `config.credit_every` steps (and at the
    last step; never at step 0, before the critic has learned anything): `measure(trainer,
    step)` returns the flat `credit/...` floats for that step's metrics.jsonl record ({} on
    other steps) and appends the errors by position to credit.jsonl. Its draws come from
    their own generators; python's and torch's global states are restored after it, so a run
    logs the same training metrics with or without it."""

    def __init__(self, config, run_dir):
        self.config = config
        self.path = Path(run_dir) / CREDIT_FILE

    def due(self, step: int) -> bool:
        every = self.config.credit_every
        return bool(every) and step > 0 and (step % every == 0 or step == self.config.steps)

    def measure(self, trainer, step: int) -> dict[str, float]:
        if not self.due(step):
            return {}
        import random

        config = self.config
        state = random.getstate()
        devices = [trainer.device] if trainer.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            found = look(trainer, trainer.problems.eval[:config.credit_prompts],
                         samples=config.credit_samples, seed=config.seed * 7919 + step)
        random.setstate(state)
        flat = found.figures(trainer.tokenizer, STEPS_LOGGED) | {
            "credit/seconds": found.mc.seconds}
        errors, steps = found.errors(), found.critic_error_at_steps(trainer.tokenizer)
        record = {"step": step, "by_position": {k: [None if math.isnan(x) else round(x, 6)
                                                    for x in v.tolist()]
                                                for k, v in errors.items()},
                  "critic_at_steps": steps, **flat}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        return flat


def _token_mean(by_pos: Tensor, mask: Tensor) -> float:
    """The mean over every real token of a per-position mean (weighted by its count)."""
    counts = mask.sum(0).float()
    keep = torch.isfinite(by_pos) & (counts > 0)
    if not keep.any():
        return math.nan
    return float((by_pos[keep] * counts[keep]).sum() / counts[keep].sum())


def read_credit(run_dir) -> list[dict]:
    """The records of a run's credit.jsonl, in order (none when it has none)."""
    path = Path(run_dir) / CREDIT_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]
