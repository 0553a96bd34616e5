"""Prompt sources with ground truth: procedural arithmetic and GSM8K from a local jsonl.

Every task yields `Problem`s: the prompt text, the ground-truth answer, and the intermediate
results a complete solution passes through (for step-completeness shaping). The answer format
is the one real math tasks use, the final answer in `\\boxed{...}`, so the reward path that
grades the embedded tiny model also grades a real model.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from labkit.answers import gsm8k_ground_truth, gsm8k_steps

Split = Literal["train", "test"]
SPLITS = ("train", "test")
OPS = "+-*"


@dataclass(frozen=True)
class Problem:
    """One prompt with its ground truth.

    `prompt` is what the model sees (before any chat template), `answer` the ground truth
    as a string, `steps` the intermediate results of a complete solution, `target` a
    reference completion (used for the supervised warm start; empty when unknown).
    """

    prompt: str
    answer: str
    steps: tuple[str, ...] = ()
    target: str = ""
    tests: tuple[str, ...] = ()
    """A code problem's test cases, Python run after the program (`labkit.problems.code_tasks`)."""
    entry_point: str = ""
    """A code problem's function under test."""
    columns: tuple[tuple[str, object], ...] = ()
    """A dataset row's other columns as (name, value) pairs, which the reward functions
    receive by name (`labkit.problems.dataset_task`)."""

    def to_record(self) -> dict:
        """A dict with TRL's dataset column names (`prompt`, `answer`, ...); a code
        problem's `tests` and `entry_point` only where it has them; a dataset row's other
        columns under their own names."""
        record = asdict(self)
        del record["columns"]
        record["steps"] = list(self.steps)
        if self.tests:
            record["tests"] = list(self.tests)
        else:
            del record["tests"], record["entry_point"]
        return record | dict(self.columns)


ENUMERABLE = 200_000
"""Problem spaces up to this size can be listed whole: `ArithmeticTask.split_size` counts
their splits, and a draw of more than 0.9 of a split's distinct problems lists it."""


def split_bucket(key: str) -> int:
    """A stable number in [0, 100) for a problem: the split never depends on the seed."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100


@functools.lru_cache(maxsize=8)
def _listed(digits: int, counts: tuple[int, ...], ops: str, test_percent: int,
            split: Split) -> tuple[tuple[tuple[int, ...], tuple[str, ...]], ...]:
    """Every problem of a split as (numbers, ops), for each operand count of `counts`, listed
    once per process."""
    found = []
    for operands in counts:
        for numbers in itertools.product(range(10**digits), repeat=operands):
            for chosen in itertools.product(ops, repeat=operands - 1):
                expression = str(numbers[0]) + "".join(f"{o}{n}"
                                                       for o, n in zip(chosen, numbers[1:]))
                in_test = split_bucket(expression) < test_percent
                if in_test == (split == "test"):
                    found.append((numbers, chosen))
    return tuple(found)


@dataclass(frozen=True)
class ArithmeticTask:
    """Procedural arithmetic: `operands` numbers of up to `digits` digits joined by `ops` (or
    between `min_operands` and `operands` numbers, so that solutions differ in length).

    Problems are evaluated left to right (no operator precedence), so the scratchpad is the
    list of running results. The split of a problem is a hash of its expression, so train
    and test never share a problem whatever seed draws them.
    """

    digits: int = 2
    """Largest number of digits of an operand (operands are drawn from 0 .. 10**digits - 1)."""
    operands: int = 2
    """How many numbers each problem combines (the most, with min_operands)."""
    min_operands: int = 0
    """Fewest numbers a problem combines: each draw picks its count uniformly from
    min_operands .. operands. 0 (or operands itself): every problem has `operands`."""
    ops: str = "+"
    """Operators to draw from, any of '+', '-', '*'."""
    scratchpad: bool = False
    """Write the running results before the boxed answer, e.g. '12+34=46,46+5=51'."""
    worked: float = 0.0
    """Share of reference completions (a warm start's targets) that write the running results;
    the others give the boxed answer at once. Each draw picks its form, so one prompt is seen
    both ways; 0 with scratchpad=False: every target direct; scratchpad=True: every one worked."""
    template: Literal["compact", "instruct"] = "compact"
    """'compact' for the tiny model ('12+34='); 'instruct' asks in words, for real models."""
    test_percent: int = 10
    """Share of all problems (by hash) held out as the test split."""

    def __post_init__(self):
        if not 1 <= self.digits <= 9:
            raise ValueError(f"digits must be between 1 and 9, got {self.digits}")
        if not 2 <= self.operands <= 8:
            raise ValueError(f"operands must be between 2 and 8, got {self.operands}")
        if self.min_operands and not 2 <= self.min_operands <= self.operands:
            raise ValueError(f"min_operands must be 0 or between 2 and operands="
                             f"{self.operands}, got {self.min_operands}")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"ops must be a non-empty string of {OPS!r}, got {self.ops!r}")
        if self.template not in ("compact", "instruct"):
            raise ValueError(f"template must be 'compact' or 'instruct', got {self.template!r}")
        if not 0 <= self.worked <= 1:
            raise ValueError(f"worked must be between 0 and 1, got {self.worked}")
        if self.worked and self.scratchpad:
            raise ValueError("worked mixes direct and worked targets; scratchpad=True makes "
                             "every target worked: set one of them")
        if not 1 <= self.test_percent <= 50:
            raise ValueError(f"test_percent must be between 1 and 50, got {self.test_percent}")

    @property
    def counts(self) -> tuple[int, ...]:
        """The operand counts problems are drawn with."""
        return tuple(range(self.min_operands or self.operands, self.operands + 1))

    @property
    def num_problems(self) -> int:
        """Size of the whole problem space (both splits)."""
        return sum((10**self.digits) ** k * len(set(self.ops)) ** (k - 1) for k in self.counts)

    def longest_target(self) -> str:
        """The longest reference completion of the task (every operand at its largest; the
        first of `ops` that makes the running results longest), to size max_new_tokens."""
        high = 10**self.digits - 1
        worked = self.scratchpad or self.worked > 0
        return max((self.make([high] * self.operands, [op] * (self.operands - 1), worked).target
                    for op in set(self.ops)), key=len)

    def split_of(self, expression: str) -> Split:
        return "test" if split_bucket(expression) < self.test_percent else "train"

    def make(self, numbers: list[int], ops: list[str], worked: bool | None = None) -> Problem:
        """The problem for given operands and operators (left-to-right evaluation); its
        target writes the running results when `worked` (None: when scratchpad)."""
        expression = str(numbers[0])
        value, steps, pad = numbers[0], [], []
        for op, n in zip(ops, numbers[1:]):
            before = value
            value = value + n if op == "+" else value - n if op == "-" else value * n
            expression += f"{op}{n}"
            steps.append(str(value))
            pad.append(f"{before}{op}{n}={value}")
        answer = str(value)
        worked = self.scratchpad if worked is None else worked
        work = ",".join(pad) + ". " if worked else ""
        if self.template == "compact":
            prompt = f"{expression}="
        else:
            spaced = expression
            for op in OPS:
                spaced = spaced.replace(op, f" {op} ")
            prompt = (f"What is {spaced}? Evaluate left to right and put the final answer "
                      "in \\boxed{}.")
        return Problem(prompt=prompt, answer=answer, steps=tuple(steps),
                       target=f"{work}\\boxed{{{answer}}}")

    def _draw(self, rng: random.Random) -> tuple[str, list[int], list[str]]:
        high = 10**self.digits - 1
        counts = self.counts
        # one count draws nothing: the stream of a fixed-count task stays as it always was
        operands = counts[0] if len(counts) == 1 else rng.randint(counts[0], counts[-1])
        numbers = [rng.randint(0, high) for _ in range(operands)]
        ops = [rng.choice(self.ops) for _ in range(operands - 1)]
        expression = str(numbers[0]) + "".join(f"{o}{n}" for o, n in zip(ops, numbers[1:]))
        return expression, numbers, ops

    def split_problems(self, split: Split) -> list[tuple[list[int], list[str]]]:
        """Every (numbers, ops) of `split`, in a fixed order; only for a space of at most
        ENUMERABLE problems."""
        if self.num_problems > ENUMERABLE:
            raise ValueError(f"the space of {self.num_problems} problems is too large to list "
                             f"(at most {ENUMERABLE})")
        listed = _listed(self.digits, self.counts, "".join(sorted(set(self.ops))),
                         self.test_percent, split)
        return [(list(numbers), list(ops)) for numbers, ops in listed]

    def split_size(self, split: Split) -> int:
        """How many problems `split` holds: counted where the space is small enough to list,
        else the expected share of the space."""
        if self.num_problems <= ENUMERABLE:
            return len(self.split_problems(split))
        share = self.test_percent if split == "test" else 100 - self.test_percent
        return int(self.num_problems * share / 100)

    def _enumerated(self, n: int, split: Split, seed: int) -> list[Problem]:
        """`n` distinct problems of a small split (up to all of it), in an order drawn from
        `seed`: drawing at random would take ever longer to find the last unseen ones."""
        everything = self.split_problems(split)
        if n > len(everything):
            raise ValueError(f"n={n} distinct problems asked of a {split} split that holds "
                             f"{len(everything)}: lower n or raise digits/operands")
        random.Random(f"{seed}:{split}:all").shuffle(everything)
        forms = self._forms(split, seed)
        return [self.make(numbers, ops, next(forms)) for numbers, ops in everything[:n]]

    def _forms(self, split: Split, seed: int):
        """The form of each drawn problem's target (True: worked), from a stream of its own,
        so mixing forms leaves the problems drawn unchanged."""
        if not self.worked:
            return itertools.repeat(None)
        rng = random.Random(f"{seed}:{split}:form")
        return (rng.random() < self.worked for _ in itertools.count())

    def sample(self, n: int, split: Split = "train", seed: int = 0,
               distinct: bool = False) -> list[Problem]:
        """`n` problems of `split`, drawn from `seed`; `distinct` forbids repeats."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        expected = self.num_problems * (self.test_percent if split == "test"
                                        else 100 - self.test_percent) / 100
        if distinct and n > 0.9 * expected and self.num_problems <= ENUMERABLE:
            return self._enumerated(n, split, seed)
        if distinct and n > 0.9 * expected:
            raise ValueError(f"n={n} distinct problems asked of a {split} split of about "
                             f"{int(expected)}: lower n or raise digits/operands")
        rng, seen, out, misses = random.Random(f"{seed}:{split}"), set(), [], 0
        forms = self._forms(split, seed)
        while len(out) < n:
            expression, numbers, ops = self._draw(rng)
            if self.split_of(expression) != split or (distinct and expression in seen):
                # a small space's split can hold fewer problems than `expected` (the hash
                # share is uneven): after 50 * num_problems misses in a row every problem of
                # the split has been seen, bar a chance of about e**-50, so stop, not spin
                misses += 1
                if misses > 50 * self.num_problems:
                    raise ValueError(f"n={n}{' distinct' if distinct else ''} problems asked "
                                     f"of a {split} split that holds only {len(seen)}: lower "
                                     "n or raise digits/operands")
                continue
            misses = 0
            seen.add(expression)
            out.append(self.make(numbers, ops, next(forms)))
        return out


DEFAULT_TASK = ArithmeticTask()
"""The task the embedded model was warm-started on: two-digit addition, boxed answer."""

GSM8K_TEMPLATE = ("{question}\nPlease reason step by step, and put your final answer "
                  "within \\boxed{{}}.")


def take(items: list, n: int | None, seed: int | None) -> list:
    """All `items` (n None), the first n, or a random n drawn from `seed` when given."""
    if n is None:
        return items
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if seed is None:
        return items[:n]
    return random.Random(seed).sample(items, min(n, len(items)))


def load_gsm8k(path: str | Path, n: int | None = None, seed: int | None = None,
               template: str = GSM8K_TEMPLATE) -> list[Problem]:
    """GSM8K problems from a local jsonl with `question` and `answer` (ending in `#### N`).

    `n` takes the first n rows, or a random n rows when `seed` is given. The worked
    solution in `answer` (calculator annotations stripped) becomes the problem's `target`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path} (expected a jsonl with "
                                "'question' and 'answer' fields)")
    if "{question}" not in template:
        raise ValueError("template must contain '{question}'")
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from e
            if not isinstance(row, dict) or "question" not in row or "answer" not in row:
                raise ValueError(f"{path}:{line_no}: each row needs 'question' and 'answer'")
            if "####" not in str(row["answer"]):
                raise ValueError(f"{path}:{line_no}: the answer field must end with '#### N'")
            rows.append(row)
    return [gsm8k_problem(template.format(question=row["question"]), row["answer"])
            for row in take(rows, n, seed)]


def gsm8k_problem(prompt: str, solution: str, columns: tuple = ()) -> Problem:
    """A problem whose ground truth is written GSM8K's way: a worked solution ending in
    '#### N'. N is the answer, the solution (without its calculator annotations <<a*b=c>>)
    the reference completion, its intermediate results the steps."""
    answer = gsm8k_ground_truth(solution)
    work = re.sub(r"<<[^<>]*>>", "", solution.rsplit("####", 1)[0])
    return Problem(prompt=prompt, answer=answer, steps=tuple(gsm8k_steps(solution)),
                   target=f"{work.strip()}\nThe answer is \\boxed{{{answer}}}.",
                   columns=columns)


def format_prompt(prompt: str, tokenizer=None) -> str:
    """The text to feed the model: the tokenizer's chat template when it has one."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True)
    return prompt
