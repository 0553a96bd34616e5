"""What each token of a completion was worth, measured: Monte Carlo values of every prefix.

The value of a prefix s_t (the prompt and the completion's first t tokens) under the current
policy is the expected reward of finishing it: V(s_t) = E[R | s_t]. Here it is estimated by
Monte Carlo, `samples` continuations drawn from s_t by the policy and scored like the run's
own completions (a continuation that runs out of budget scores 0). With gamma = 1 and the
reward at the end, the advantage of token t is A_t = V(s_{t+1}) - V(s_t), and V(s_L) of a
finished completion is its reward. The estimator `vineppo` learns from these values
(`stages.estimator_extras`); the microscope (`labkit.probes.microscope`) sets them beside a
critic's, GAE's and GRPO's, position by position (`by_position`) and at the ends of the
written steps (`step_ends`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from labkit.model.rollout import RolloutBatch, _decode, eos_ids, model_decoder

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
