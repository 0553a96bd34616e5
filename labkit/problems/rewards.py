"""Reward functions for RL on math problems, in TRL's reward-function form.

Every reward here has the signature `fn(completions, **kwargs) -> list[float]`, so it can be
handed to TRL's `GRPOTrainer(reward_funcs=...)` unchanged: the trainer passes everything by
keyword, the dataset's columns (the ground truth as `answer`, the expected intermediate
results as `steps`) plus its own extras (`prompts`, `completion_ids`, `trainer_state`, ...),
which are ignored; labkit's trainer does the same (`TRL_KEYWORDS`). A completion is a
string or TRL's conversational form, a list of message dicts.

Verifiable reward (RLVR): 1.0 when the final answer is mathematically equivalent to the
ground truth, by math-verify rather than string comparison. Shaping, combination and
reward-model score normalisation are small wrappers around that.

`REWARDS` is the registry of the rewards a training run can be given by name; adding one is
one function decorated with `@REWARDS.register(name)`. The config's `reward` is a small
expression over these names (weights, `shaped(...)`, `noisy(...)`): `labkit.problems.reward_expr`.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
import threading
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import Callable, Literal, Sequence

from labkit.answers import (completion_text, extract_answer, gsm8k_ground_truth, last_box_span,
                             last_boxed)
from labkit.checks import per_completion
from labkit.problems.code_tasks import code_reward
from labkit.registry import Registry

RewardFn = Callable[..., list]

TRL_KEYWORDS = ("prompts", "completions", "answer", "steps", "target", "step_seed", "tests",
                "entry_point")
"""The keywords labkit's trainer calls a reward with, as TRL's GRPOTrainer does: the prompts,
the completions, the task's columns (`labkit.problems.tasks.Problem.to_record`: the ground truth
`answer`, the intermediate results `steps`, a reference solution `target`; a code
problem's `tests` and `entry_point`), and the step's seed (`step_seed`, which `noisy` draws
its flips from)."""

REWARDS = Registry("reward", (), TRL_KEYWORDS)
"""Rewards by name, TRL's form: `fn(completions, *, answer, **kwargs) -> list[float]`, one
float per completion, called with the keywords `TRL_KEYWORDS`."""

# seconds; used only in the main thread, where math-verify can time out with signal.alarm
PARSE_TIMEOUT = 5
VERIFY_TIMEOUT = 5


class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns on every call made with the timeout off; off is our choice in threads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


# ---------------------------------------------------------------------------- correctness

_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# a number, a space, then only words: "18 dollars", "5 cm", "60 km/h" -> the number. Words
# of two letters or more, so "5x" and "5 x - 3" stay expressions
_NUMBER_THEN_WORDS = re.compile(
    r"^([-+]?(?:\d+(?:\.\d*)?|\.\d+)%?)\s+[A-Za-z]{2,}[A-Za-z .']*(?:/[A-Za-z]+)*$")
_TEXT = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")


def _clean(answer: str) -> str:
    """Light, safe normalisation before math-verify: drop `$` and `\\$`, thousands commas
    (`1,000` -> `1000`, never `10,5`), a final period and trailing unit words; the word
    "percent" becomes `%`."""
    s = answer.strip()
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "%").replace("\\!", "")
    s = _THOUSANDS.sub("", s).strip().rstrip(".").strip()
    s = re.sub(r"(?<=\d)\s*(?:percent|per\s+cent)\b", "%", s, flags=re.IGNORECASE)
    s = _TEXT.sub(r"\1", s).strip()  # `\text{18 dollars}` -> `18 dollars` -> `18`
    m = _NUMBER_THEN_WORDS.match(s)
    return m.group(1) if m else s


def _decimal(s: str) -> Decimal | None:
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _parse(answer: str, timeout: int | None) -> list:
    """math-verify's parse of an extracted answer, read as inline LaTeX first (so
    `\\sqrt{2}/2` parses), else as plain text. math-verify (and sympy under it) is imported
    here, on the first answer that needs it: integer answers never do."""
    from math_verify import parse

    return parse(f"${answer}$", parsing_timeout=timeout) or parse(answer, parsing_timeout=timeout)


@lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None) -> list:
    """`_parse` of a cleaned ground truth, cached: the G completions of a group share it."""
    return _parse(gold, timeout)


def _ground_truth(value, index: int) -> str:
    if value is None:
        raise ValueError(f"answer[{index}] is None: every completion needs a ground truth")
    text = str(value).strip()
    if not text:
        raise ValueError(f"answer[{index}] is empty: every completion needs a ground truth")
    return gsm8k_ground_truth(text) if "####" in text else text


def _grade(completion, gold: str, main_thread: bool, extract: Callable) -> float:
    text = completion_text(completion)
    if not text:
        return 0.0
    predicted = extract(text)
    if predicted is None:
        return 0.0
    pred, want = _clean(predicted), _clean(gold)
    if pred and pred == want:
        return 1.0
    a, b = _decimal(pred), _decimal(want)
    if a is not None and b is not None:
        if a == b:  # 0.50 == 0.5 without sympy
            return 1.0
        if a == a.to_integral_value() and b == b.to_integral_value():
            return 0.0  # two different integers: no need to ask sympy (the common case in RL)
    timeout = PARSE_TIMEOUT if main_thread else None
    try:
        gold_parsed = _parse_gold(want, timeout)
        pred_parsed = _parse(pred, timeout)
        if not gold_parsed or not pred_parsed:
            return 0.0
        from math_verify import verify

        ok = verify(gold_parsed, pred_parsed,
                    timeout_seconds=VERIFY_TIMEOUT if main_thread else None)
    except Exception:  # a reward must never stop a training loop
        return 0.0
    return 1.0 if ok else 0.0


@REWARDS.register("correctness")
def correctness(completions: Sequence, answer: Sequence | None = None, **kwargs) -> list[float]:
    r"""Verifiable reward (RLVR, Lambert et al., 2024): r_i = 1 if extract(completion_i) == answer_i mathematically, else 0.

    The final answer is the last `\boxed{...}`, else `#### N`, else "the answer is N", else a
    final `A: N` line (`labkit.answers.extract_answer`); no answer scores 0. Equivalence is
    math-verify's (`parse` + `verify`), after dropping `$`, thousands commas, a final
    period and trailing unit words, so `$1,000.` == `1000`, `18 dollars` == `18`,
    `\frac{1}{2}` == `0.5` == `1/2`, `50\%` == `0.5`. An exact match after that cleaning, or
    equal decimals (`0.50` == `0.5`), score 1 without calling math-verify.

    `answer[i]` is a bare value ("18", r"\frac{1}{2}", 18) or a whole GSM8K answer field,
    whose number after `####` is used. Parsing of the ground truth is cached. Outside the
    main thread math-verify's signal-based timeouts are switched off (signal.alarm only
    works in the main thread), so the function also runs in worker threads.

    Bad completions never raise: None, empty, non-string, or anything math-verify fails on
    scores 0.0. Bad ground truth does raise ValueError: `answer` missing, a length that
    differs from `completions`, or a None or empty entry (the message names its index).
    """
    return _verify(completions, answer, "correctness", extract_answer)


@REWARDS.register("code")
def code(completions: Sequence, tests: Sequence | None = None, **kwargs) -> list[float]:
    """Code reward: r_i = 1 if the program in completion_i passes every test of tests_i, run behind the operating system's boundary (`labkit.problems.code_tasks.code_reward`, `labkit.sandbox`), else 0.

    For a code task (`task='code'`, `code_path`): its problems give `tests` and
    `entry_point`. Without a boundary on this machine it raises, unless LABKIT_SANDBOX=hook-only.
    """
    return code_reward(completions, tests=tests, **kwargs)


@REWARDS.register("strict")
def strict(completions: Sequence, answer: Sequence | None = None, **kwargs) -> list[float]:
    r"""Strict verifiable reward, boxed answers only (RLVR, Lambert et al., 2024): r_i = 1 if the last `\boxed{...}` of completion_i equals answer_i, else 0.

    `correctness` with the answer format required, as in RLVR's reward for math: "The final
    answer is 83" scores 0 here (1 with `correctness`), "so \boxed{83}" scores 1. The box's
    content is graded exactly as `correctness` grades an answer; the same errors are raised.
    """
    return _verify(completions, answer, "strict", last_boxed)


def _verify(completions: Sequence, answer, name: str, extract: Callable) -> list[float]:
    """The 0/1 verdicts of `completions` against `answer`, the final answer of each found by
    `extract(text) -> str | None`."""
    per_completion(answer, "answer", completions,
                   missing=f"{name} needs the ground truth as the keyword `answer` (a list with "
                           "one entry per completion), e.g. a dataset column named 'answer'")
    golds = [_ground_truth(a, i) for i, a in enumerate(answer)]
    main_thread = threading.current_thread() is threading.main_thread()
    return [_grade(c, g, main_thread, extract) for c, g in zip(completions, golds)]


@REWARDS.register("format")
def format_reward(completions: Sequence, **kwargs) -> list[float]:
    r"""Format reward: r_i = 1 if completion_i ends with a non-empty, balanced `\boxed{...}`.

    After the box only whitespace, closing math delimiters (`$`, `\]`, `\)`) and a period
    may follow; anything else (more text, a second unclosed box) scores 0. The box's
    content is not judged: that is `correctness`'s job.
    """
    out = []
    for completion in completions:
        text = completion_text(completion)
        span = last_box_span(text) if text else None
        ok = (span is not None and bool(span[0].strip())
              and re.fullmatch(r"(?:\s|\$|\\\]|\\\)|\.)*", text[span[1]:]) is not None)
        out.append(1.0 if ok else 0.0)
    return out


# ---------------------------------------------------------------------- shaping

_NUMBER_TOKEN = re.compile(r"(?<![\d.])(-?)(\d[\d,]*(?:\.\d+)?|\.\d+)")


def _numbers_in(text: str) -> set[Decimal]:
    """Every number written in `text`, read both ways where a comma is ambiguous: `1,000`
    gives 1000 (and 1, 0), `46,46` (a list) gives 46. A leading minus adds the negative too,
    since `16-3` may be a subtraction."""
    values = set()
    for sign, token in _NUMBER_TOKEN.findall(text):
        token = token.rstrip(",")
        pieces = [p for p in token.split(",") if p]
        if re.fullmatch(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?", token):
            pieces.append(token.replace(",", ""))
        for piece in pieces:
            value = _decimal(piece)
            if value is not None:
                values.add(value)
                if sign:
                    values.add(-value)
    return values


def step_completeness(completion, steps: Sequence[str]) -> float:
    """completeness = (# of `steps` that appear in the completion) / len(steps); 1 if none.

    A step appears when the completion writes that number as a whole number, compared by
    value: "46" is found in "= 46." and "46.0", not in "146" or "4.6"; "1000" is found in
    "1,000". A step that is not a plain decimal (e.g. "3/4") is looked up as text, again not
    inside a longer number. Seed 000 scores completeness with a rule engine over step
    words ("first", "therefore"); checking intermediate results is the verifiable version.
    """
    steps = list(steps)
    if not steps:
        return 1.0
    text = completion_text(completion) or ""
    found_values = _numbers_in(text)
    hits = 0
    for step in steps:
        s = _THOUSANDS.sub("", str(step).strip().lstrip("$"))
        value = _decimal(s)
        if value is not None:
            hits += value in found_values
        else:
            hits += re.search(r"(?<![\d.])" + re.escape(s) + r"(?![\d])", text) is not None
    return hits / len(steps)


def shaped(reward_fn: RewardFn, lam: float = 0.3) -> RewardFn:
    """Step-completeness shaping (a process-style reward): r = r_raw - lam * (1 - completeness).

    The returned reward function reads the expected intermediate results of each completion
    from the keyword `steps` (a list of lists of strings, e.g. a dataset column) and passes
    every keyword on to `reward_fn`. A complete solution keeps r_raw; one that skips all
    steps loses lam. `lam` must lie in [0, 1] (the seed uses 0.3).
    """
    if isinstance(lam, bool) or not isinstance(lam, numbers.Real) or not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be a number in [0, 1], got {lam!r}")
    name = getattr(reward_fn, "__name__", type(reward_fn).__name__)

    def shaped_reward(completions: Sequence, steps: Sequence | None = None, **kwargs):
        per_completion(steps, "steps", completions,
                       missing=f"shaped reward needs the keyword `steps` (one list of expected "
                               f"intermediate results per completion) for {name}")
        raw = reward_fn(completions=completions, steps=steps, **kwargs)
        return [float(r) - lam * (1.0 - step_completeness(c, s))
                for r, c, s in zip(raw, completions, steps)]

    shaped_reward.__name__ = f"shaped({name},lam={lam:g})"
    shaped_reward.__qualname__ = shaped_reward.__name__
    return shaped_reward


class RewardError(ValueError):
    """A reward function returned something that is not a finite number per completion."""


def check_rewards(values, source: str) -> list[float]:
    """`values` (a list or 1-D tensor) as finite floats, or RewardError naming `source`, the
    reward function, and the first bad index: one NaN reward would turn every advantage of
    its group, then the loss, then the weights into NaN."""
    items = values.tolist() if hasattr(values, "tolist") else values
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise RewardError(f"reward function {source} must return one number per completion, "
                          f"got {type(values).__name__}")
    out = []
    for i, value in enumerate(items):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(f"reward function {source} returned a non-number at index {i}: "
                              f"{value!r}")
        if not math.isfinite(value):
            raise RewardError(f"reward function {source} returned a non-finite reward at index "
                              f"{i}: {value!r}; rewards must be finite numbers")
        out.append(float(value))
    return out


def combine(*weighted: tuple[RewardFn, float]) -> RewardFn:
    """Weighted sum of reward functions: r_i = sum_k w_k * fn_k(completions, ...)_i.

    Each argument is a pair `(fn, weight)` with a finite numeric weight. The result is named
    after its parts, e.g. `0.9*correctness+0.1*format_reward`, because TRL logs each reward
    function under its `__name__`.
    """
    if not weighted:
        raise ValueError("combine needs at least one (reward_fn, weight) pair")
    parts = []
    for i, item in enumerate(weighted):
        if not (isinstance(item, tuple) and len(item) == 2 and callable(item[0])):
            raise ValueError(f"combine argument {i} must be a (reward_fn, weight) pair, "
                             f"got {item!r}")
        fn, weight = item
        if (isinstance(weight, bool) or not isinstance(weight, numbers.Real)
                or not math.isfinite(weight)):
            raise ValueError(f"weight of combine argument {i} must be a finite number, "
                             f"got {weight!r}")
        parts.append((fn, float(weight)))

    def combined(completions: Sequence, **kwargs) -> list[float]:
        total = [0.0] * len(completions)
        for fn, weight in parts:
            name = getattr(fn, "__name__", type(fn).__name__)
            scores = check_rewards(fn(completions=completions, **kwargs), name)
            if len(scores) != len(completions):
                raise RewardError(f"{name} returned {len(scores)} rewards for "
                                  f"{len(completions)} completions")
            total = [t + weight * s for t, s in zip(total, scores)]
        # finite parts can still overflow to inf when summed with large weights
        return check_rewards(total, combined.__name__)

    terms = [f"{w:g}*{getattr(fn, '__name__', type(fn).__name__)}" for fn, w in parts]
    combined.__name__ = "+".join(terms).replace("+-", "-")
    combined.__qualname__ = combined.__name__
    return combined


def overlong_penalty(lengths, max_len: int, buffer: int, factor: float = 1.0) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al., 2025; verl's overlong buffer): per
    completion of L tokens, -factor * max(0, L - (max_len - buffer)) / buffer, so 0 up to
    max_len - buffer tokens and -factor at the budget. buffer 0 gives all 0."""
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 0 <= buffer <= max_len:
        raise ValueError(f"buffer must be an int in [0, max_len={max_len}], got {buffer!r}")
    if buffer == 0:
        return [0.0 for _ in lengths]
    start = max_len - buffer
    return [-factor * max(0, int(n) - start) / buffer for n in lengths]


# ----------------------------------------------------- reward-model scores

NORMALIZATIONS = ("sigmoid", "group_minmax")


def normalize_scores(scores, method: Literal["sigmoid", "group_minmax"] = "sigmoid",
                     group_size: int | None = None) -> list[float]:
    """Map raw reward-model scores (logits) into [0, 1] before computing advantages.

    - "sigmoid": s -> 1 / (1 + exp(-s)), per score, into (0, 1).
    - "group_minmax": each consecutive group of `group_size` scores (the G completions of
      one prompt, shape (B*G,) read as (B, G)) -> (s - min_g) / (max_g - min_g). Departure
      from the common (s - min) / (max - min + 1e-8): a constant group maps to 0.5 (no
      preference) instead of 0, so its rewards stay in the middle of the range.
    `scores` is a list or a 1-D tensor of finite floats; returns a list of floats.
    """
    if method not in NORMALIZATIONS:
        raise ValueError(f"method must be one of {NORMALIZATIONS}, got {method!r}")
    if hasattr(scores, "dim") and scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (B*G,), got shape {tuple(scores.shape)}")
    values = [float(s) for s in (scores.tolist() if hasattr(scores, "tolist") else scores)]
    if not all(math.isfinite(v) for v in values):
        raise ValueError("scores must be finite numbers (got nan or inf)")
    if method == "sigmoid":
        # the two branches never overflow exp
        return [1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))
                for v in values]
    if (group_size is None or isinstance(group_size, bool) or not isinstance(group_size, int)
            or group_size < 1 or len(values) % group_size != 0):
        raise ValueError(f"group_minmax needs a positive integer group_size that divides "
                         f"len(scores)={len(values)}, got group_size={group_size!r}")
    out = []
    for start in range(0, len(values), group_size):
        group = values[start:start + group_size]  # (G,)
        low, high = min(group), max(group)
        out.extend([0.5] * group_size if high == low
                   else [(v - low) / (high - low) for v in group])
    return out
