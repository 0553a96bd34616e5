"""Held-out evaluation: greedy accuracy, sampled pass@1 and pass@k, mean completion length.

Generation here goes through `model.generate` in batches; it is the plain path that every
faster rollout is checked against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from labkit.answers import is_worked
from labkit.formulas.metrics import cgc
from labkit.formulas.stats import binomial_se, mean_interval
from labkit.model.rollout import fast_decoder, model_decoder, rollout
from labkit.problems.code_tasks import code_reward
from labkit.problems.rewards import correctness
from labkit.problems.source import EVAL_SEED, ProblemSource
from labkit.problems.tasks import Problem, format_prompt

if TYPE_CHECKING:
    from labkit.settings.config import TrainConfig


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[str], *, do_sample: bool,
             temperature: float = 1.0, max_new_tokens: int = 16, batch_size: int = 256,
             num_return_sequences: int = 1, progress: bool = False) -> list[str]:
    """Completions for `prompts` (chat template applied when the tokenizer has one).

    Sampling draws from the full softmax at `temperature` (no top-k, no top-p), so sampled
    pass@1 measures the policy itself. Returns len(prompts) * num_return_sequences texts,
    the samples of one prompt next to each other. Seed torch beforehand for repeatable draws.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=do_sample,
        num_return_sequences=num_return_sequences,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        **({"temperature": temperature, "top_k": 0, "top_p": 1.0} if do_sample else {}))
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    texts = [format_prompt(p, tokenizer) for p in prompts]
    device = next(model.parameters()).device
    out: list[str] = []
    was_training = model.training
    model.eval()
    try:
        starts = range(0, len(texts), batch_size)
        for start in tqdm(starts, desc="generate", disable=not progress, leave=False):
            enc = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                            add_special_tokens=not getattr(tokenizer, "chat_template", None))
            enc = enc.to(device)
            ids = model.generate(**enc, generation_config=config)
            out += tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:],
                                          skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return out


def judge(problems: Sequence[Problem], texts: Sequence[str]) -> list[float]:
    """1.0 or 0.0 per completion: a code problem's tests run in the sandbox
    (`labkit.problems.code_tasks.code_reward`), else the answer's correctness."""
    if problems and problems[0].tests:
        return code_reward(texts, tests=[p.tests for p in problems],
                           entry_point=[p.entry_point for p in problems],
                           prompts=[p.prompt for p in problems])
    return correctness(texts, answer=[p.answer for p in problems])


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(model, tokenizer, problems: Sequence[Problem], *, samples: int = 4,
             k: int | None = None, temperature: float = 1.0, max_new_tokens: int = 16,
             batch_size: int = 256, seed: int = 0, progress: bool = False,
             decoder=fast_decoder) -> dict:
    """Greedy accuracy and sampled pass@1 (and pass@k) of the model on `problems`.

    Completions come from `rollout` (one prefill per prompt); `generate` above is the plain
    `model.generate` path it is tested against. pass@1 is the mean correctness of `samples`
    draws per problem at `temperature`, drawn from `seed`; pass@k
    uses the unbiased estimator over the same draws (k defaults to `samples`). `samples=0`
    measures greedy accuracy alone.
    Keys: `eval/accuracy` (greedy), `eval/pass@1`, `eval/pass@{k}`, `eval/length` (mean
    greedy completion length in characters), `eval/n` (number of problems).
    """
    if not problems:
        raise ValueError("problems is empty: nothing to evaluate")
    if samples < 0:
        raise ValueError(f"samples must be >= 0, got {samples}")
    k = samples if k is None else k
    if samples and not 1 <= k <= samples:
        raise ValueError(f"k must be between 1 and samples={samples}, got {k}")
    if samples and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    prompts = [p.prompt for p in problems]
    greedy = complete(model, tokenizer, prompts, greedy=True, max_new_tokens=max_new_tokens,
                      batch_size=batch_size, progress=progress, decoder=decoder)
    greedy_ok = judge(problems, greedy)
    figures = {"eval/accuracy": sum(greedy_ok) / len(problems),
               "eval/length": sum(map(len, greedy)) / len(problems), "eval/n": len(problems)}
    if samples == 0:
        return figures
    drawn = complete(model, tokenizer, prompts, group_size=samples, temperature=temperature,
                     max_new_tokens=max_new_tokens, batch_size=max(1, batch_size // samples),
                     seed=seed, progress=progress, decoder=decoder)
    drawn_ok = judge([p for p in problems for _ in range(samples)], drawn)
    correct = [int(sum(drawn_ok[i * samples:(i + 1) * samples])) for i in range(len(problems))]
    figures["eval/pass@1"] = sum(correct) / (samples * len(problems))
    figures[f"eval/pass@{k}"] = sum(pass_at_k(samples, c, k) for c in correct) / len(problems)
    return figures


def answer_forms(problems: Sequence[Problem], texts: Sequence[str], correct: Sequence[float],
                 samples: int) -> dict:
    """How often the model works before it answers, and how right each form is, by difficulty.

    `texts` holds `samples` completions per problem (next to each other) and `correct` their
    verdicts. Difficulty is a problem's number of written steps plus one (an arithmetic
    problem's operands). Returns `worked` (the share of worked completions: a t interval over
    problems of each one's share), `by_difficulty` ({difficulty: draws, worked share,
    accuracy of direct and of worked completions}) and `hardest`: on the problems of the
    highest difficulty that were answered both ways, the accuracy of worked minus direct
    completions, paired by problem (a t interval over those problems).
    """
    if samples < 1 or len(texts) != samples * len(problems) or len(correct) != len(texts):
        raise ValueError(f"texts and correct need samples={samples} entries per problem "
                         f"({samples * len(problems)}), got {len(texts)} and {len(correct)}")
    shares, table, gaps = [], {}, {}
    for i, problem in enumerate(problems):
        forms = [is_worked(t) for t in texts[i * samples:(i + 1) * samples]]
        right = correct[i * samples:(i + 1) * samples]
        shares.append(sum(forms) / samples)
        level = len(problem.steps) + 1
        row = table.setdefault(level, {"draws": 0, "worked": 0, "worked_right": 0,
                                       "direct_right": 0})
        row["draws"] += samples
        row["worked"] += sum(forms)
        row["worked_right"] += sum(r for f, r in zip(forms, right) if f)
        row["direct_right"] += sum(r for f, r in zip(forms, right) if not f)
        if 0 < sum(forms) < samples:
            worked = [r for f, r in zip(forms, right) if f]
            direct = [r for f, r in zip(forms, right) if not f]
            gaps.setdefault(level, []).append(sum(worked) / len(worked)
                                              - sum(direct) / len(direct))
    by_difficulty = {}
    for level, row in sorted(table.items()):
        direct = row["draws"] - row["worked"]
        by_difficulty[level] = {
            "draws": row["draws"], "worked_share": row["worked"] / row["draws"],
            "accuracy_worked": row["worked_right"] / row["worked"] if row["worked"] else None,
            "accuracy_direct": row["direct_right"] / direct if direct else None}
    top = max(table)
    floor = binomial_se(0.5, samples)  # the least spread one problem's draws can show
    worked = mean_interval(shares, unit="problems", sd_floor=floor, bounds=(0, 1))
    gap = (mean_interval(gaps[top], unit="problems", sd_floor=floor, bounds=(-1, 1))
           if len(gaps.get(top, [])) > 1 else None)
    return {"samples": samples, "worked": worked.to_dict(), "by_difficulty": by_difficulty,
            "hardest": {"difficulty": top, "problems": len(gaps.get(top, [])),
                        "difference": gap.to_dict() if gap else None}}


def measure_forms(model, tokenizer, problems: Sequence[Problem], *, samples: int = 8,
                  temperature: float = 1.0, max_new_tokens: int = 48, batch_size: int = 256,
                  seed: int = 0, progress: bool = False, decoder=fast_decoder) -> dict:
    """`answer_forms` of `samples` completions per problem drawn at `temperature` (the
    rollout's distribution), from `seed`."""
    texts = complete(model, tokenizer, [p.prompt for p in problems], group_size=samples,
                     temperature=temperature, max_new_tokens=max_new_tokens,
                     batch_size=max(1, batch_size // samples), seed=seed, progress=progress,
                     decoder=decoder)
    correct = judge([p for p in problems for _ in range(samples)], texts)
    return answer_forms(problems, texts, correct, samples)


def complete(model, tokenizer, prompts: Sequence[str], *, group_size: int = 1,
             greedy: bool = False, temperature: float = 1.0, max_new_tokens: int = 16,
             batch_size: int = 256, seed: int = 0, progress: bool = False,
             decoder=fast_decoder) -> list[str]:
    """Completion texts, `group_size` per prompt (next to each other), through `rollout`
    in chunks of `batch_size` prompts; chunk c draws with seed `seed + c`. `decoder`: what
    the rollout decodes with (`labkit.model.rollout.fast_decoder` or `model_decoder`)."""
    out: list[str] = []
    starts = range(0, len(prompts), batch_size)
    for c, start in enumerate(tqdm(starts, desc="evaluate", disable=not progress, leave=False)):
        out += rollout(model, tokenizer, prompts[start:start + batch_size], greedy=greedy,
                       group_size=group_size, temperature=temperature,
                       max_new_tokens=max_new_tokens, seed=seed + c, decoder=decoder).texts
    return out


def run_eval(config: TrainConfig, policy, tokenizer, source: ProblemSource) -> dict:
    """Held-out greedy accuracy, pass@1 / pass@k, mean length, and CGC on fixed prompts,
    decoded as the run decodes (`config.fast`)."""
    decoder = fast_decoder if config.fast else model_decoder
    figures = evaluate(policy, tokenizer, source.eval, samples=config.eval_samples,
                       temperature=config.temperature, max_new_tokens=config.max_new_tokens,
                       seed=EVAL_SEED, decoder=decoder)
    if source.cgc and config.group_size >= 2:
        texts = complete(policy, tokenizer, [p.prompt for p in source.cgc],
                         group_size=config.group_size, temperature=config.temperature,
                         max_new_tokens=config.max_new_tokens, seed=EVAL_SEED + 1,
                         decoder=decoder)
        rewards = judge([p for p in source.cgc for _ in range(config.group_size)], texts)
        figures["eval/cgc"] = cgc(torch.tensor(rewards), config.group_size)
    return figures
