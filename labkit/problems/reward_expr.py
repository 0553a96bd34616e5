"""The config's `reward`: a small expression over labkit.problems.rewards, checked when the
config is made and built into one TRL-signature reward function for the trainer.

Grammar (labkit.grammar's tokens; spaces only separate them):

    spec   := ['-'] term (('+' | '-') term)*
    term   := [NUMBER '*'] reward
    reward := NAME | NAME '(' args ')' | package.module:function
    args   := spec | [spec ','] KEY '=' NUMBER (',' KEY '=' NUMBER)*

NAME is a reward of `labkit.problems.rewards.REWARDS` (correctness, strict, format) or a wrapper of
`WRAPPERS` (shaped, noisy), whose optional first argument is the reward it wraps (default
correctness). A weight is a finite non-zero number; a term without one has weight 1. So
`correctness+0.3*format`, `shaped(lam=0.3)`, `noisy(p=0.2)`, `noisy(strict, p=0.1)`,
`strict-0.5*mypkg.rewards:too_long`. In Python a list of (reward, weight) pairs is the same
sum: `[("correctness", 1.0), ("format", 0.3)]` is `correctness+0.3*format` (`spec_text`).

Every reward is called with TRL's keywords (`labkit.problems.rewards.TRL_KEYWORDS`): `prompts`,
`completions`, the task's columns `answer`, `steps`, `target`, and the step's `step_seed`.
"""

from __future__ import annotations

import itertools
import math
import numbers
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import lru_cache

from labkit.grammar import Cursor, GrammarError
from labkit.problems.rewards import (REWARDS, RewardError, RewardFn, check_rewards, combine,
                                     correctness, shaped)

FIELD = "reward"


def noisy(reward_fn: RewardFn, p: float) -> RewardFn:
    """Noisy verifier, a reward model of accuracy 1 - p: r_i' = 1 - r_i with probability p.

    The cheap stand-in for an imperfect reward model (how reward-model accuracy shapes RL
    training: Chen et al., 2024, "The Accuracy Paradox in RLHF"): r_i' = 1 - r_i if u_i < p,
    else r_i, with u_i uniform on [0, 1) drawn for completion i from the keyword `step_seed` (the
    trainer's step seed), so a run and its resume flip the same verdicts, and runs that
    differ only in p share their u (a smaller p flips a subset). Without `step_seed` (under
    TRL) the draws follow the order of the calls. A verdict other than 0 or 1 raises
    RewardError: there is nothing to flip.
    """
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be a number in [0, 1], got {p!r}")
    name = getattr(reward_fn, "__name__", type(reward_fn).__name__)
    calls = itertools.count()

    def noisy_reward(completions: Sequence, step_seed: int | None = None, **kwargs):
        verdicts = check_rewards(reward_fn(completions=completions, step_seed=step_seed,
                                           **kwargs), name)
        key = step_seed if step_seed is not None else f"call {next(calls)}"
        draws = random.Random(f"labkit.noisy/{name}/{key}")  # apart from every other stream
        out = []
        for i, verdict in enumerate(verdicts):
            if verdict not in (0.0, 1.0):
                raise RewardError(f"noisy flips 0/1 verdicts, but {name} returned {verdict!r} "
                                  f"at index {i}")
            out.append(1.0 - verdict if draws.random() < p else verdict)
        return out

    noisy_reward.__name__ = noisy_reward.__qualname__ = f"noisy({name},p={p:g})"
    return noisy_reward


def systematic(reward_fn: RewardFn, p: float) -> RewardFn:
    """A reward model of accuracy about 1 - p whose errors are systematic: on a fixed share p
    of the prompts it is confidently wrong, every 0/1 verdict flipped, at every step.

    `noisy` flips each verdict on its own, errors a policy cannot learn to exploit; a learned
    reward model errs on some kinds of problem and not others, the same way each time. Here
    a prompt is a blind spot when u < p, u uniform on [0, 1) drawn from the prompt's text
    alone (not the step's seed), so the same prompts are blind spots in every step, run and
    resume, and a smaller p's blind spots are a subset of a larger one's. A verdict other
    than 0 or 1 raises RewardError."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be a number in [0, 1], got {p!r}")
    name = getattr(reward_fn, "__name__", type(reward_fn).__name__)

    def systematic_reward(completions: Sequence, prompts: Sequence = (),
                          step_seed: int | None = None, **kwargs):
        verdicts = check_rewards(reward_fn(completions=completions, prompts=prompts,
                                           step_seed=step_seed, **kwargs), name)
        if len(prompts) != len(verdicts):
            raise RewardError(f"systematic needs each completion's prompt: got "
                              f"{len(prompts)} prompts for {len(verdicts)} completions")
        out = []
        for i, (prompt, verdict) in enumerate(zip(prompts, verdicts)):
            if verdict not in (0.0, 1.0):
                raise RewardError(f"systematic flips 0/1 verdicts, but {name} returned "
                                  f"{verdict!r} at index {i}")
            blind = random.Random(f"labkit.systematic/{prompt}").random() < p
            out.append(1.0 - verdict if blind else verdict)
        return out

    systematic_reward.__name__ = systematic_reward.__qualname__ = \
        f"systematic({name},p={p:g})"
    return systematic_reward


@dataclass(frozen=True)
class Wrapper:
    """A reward made from another one and numeric parameters: `build(base, **params)`."""

    build: Callable[..., RewardFn]
    params: dict[str, tuple[float | None, float, float, str]]
    """Each parameter's default (None: required), lowest and highest value, and meaning."""
    title: str
    binary_base: bool = False
    """The base must return 0/1 verdicts: one reward, no weight, no shaping."""


WRAPPERS = {
    "shaped": Wrapper(lambda fn, lam: shaped(fn, lam=lam),
                      {"lam": (0.3, 0.0, 1.0, "the penalty for skipping every step")},
                      "step-completeness shaping, r - lam * (1 - completeness)"),
    "noisy": Wrapper(noisy, {"p": (None, 0.0, 1.0, "the probability of flipping a verdict")},
                     "a verifier of accuracy 1 - p, each 0/1 verdict flipped with probability p",
                     binary_base=True),
    "systematic": Wrapper(systematic, {"p": (None, 0.0, 1.0,
                                             "the share of prompts whose verdicts it flips")},
                          "a reward model wrong on a fixed share p of the prompts, every "
                          "verdict there flipped", binary_base=True),
}
"""Rewards with parameters, by name: `shaped(lam=0.3)`, `noisy(p=0.2)`, `noisy(strict, p=0.1)`."""


@dataclass(frozen=True)
class Term:
    """One `weight * reward` of a spec; `base` is a wrapper's argument (None: correctness);
    `pos` where the reward's name starts in the spec's text."""

    weight: float
    name: str
    base: tuple[Term, ...] | None = None
    params: tuple[tuple[str, float], ...] = ()
    pos: int = dataclass_field(default=0, compare=False)


FORM = "a sum of [NUMBER*]REWARD, a wrapper REWARD(KEY=NUMBER, ...) among them"


class _Parser(Cursor):
    """Recursive descent over the grammar of the module docstring (labkit.grammar's
    tokens)."""

    def spec(self) -> tuple[Term, ...]:
        terms, sign = [], -1.0 if self.take("-") else 1.0
        if sign > 0:
            self.take("+")
        while True:
            terms.append(self.term(sign))
            if not self.peek().is_op("+", "-"):
                return tuple(terms)
            sign = -1.0 if self.next().text == "-" else 1.0

    def term(self, sign: float) -> Term:
        weight = 1.0
        if self.peek().kind == "number":
            tok = self.next()
            weight = float(tok.text)
            if not math.isfinite(weight) or weight == 0:
                raise self.error(f"a weight must be a finite, non-zero number, got {tok.text}",
                                 tok)
            self.expect("*", "'*' after the weight")
        name = self.path("a reward")
        if self.peek().is_op("*"):
            raise self.error(f"a weight is a number written before '*' (e.g. 0.3*format), "
                             f"got {name.text!r}", name)
        base, params = self.arguments() if self.peek().is_op("(") else (None, ())
        return Term(sign * weight, name.text, base, params, name.start)

    def arguments(self) -> tuple[tuple[Term, ...] | None, tuple[tuple[str, float], ...]]:
        self.expect("(", "'('")
        base, params = None, []
        while not self.peek().is_op(")"):
            if params or base is not None:
                self.expect(",", "',' or ')'")
            if self.peek().kind == "name" and self.peek(1).is_op("="):
                key = self.next().text
                self.next()
                params.append((key, self.number(key)))
            elif base is None and not params:
                base = self.spec()
            else:
                raise self.error("the reward a wrapper wraps comes first, then KEY=NUMBER")
        self.next()
        return base, tuple(params)


def parse(spec: str, field: str = FIELD) -> tuple[Term, ...]:
    """The terms of `spec`, every name, weight and parameter checked; GrammarError names
    `field`, the text, the column and the rule."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{field} must be a reward such as 'correctness' or "
                         f"'correctness+0.3*format', got {spec!r}")
    parser = _Parser(spec, field, FORM)
    terms = parser.spec()
    parser.expect("end", "'+', '-' or the end")
    for term in terms:
        _check_term(term, parser)
    return terms


def _check_term(term: Term, at: Cursor) -> None:
    """A term's name and arguments against the rewards and wrappers; the error at its name."""
    def fail(what: str) -> GrammarError:
        return GrammarError(at.field, at.text, term.pos, what)

    if ":" in term.name:
        if term.base is not None or term.params:
            raise fail(f"{term.name} takes no arguments")
        return
    if term.name in REWARDS:
        if term.base is not None or term.params:
            raise fail(f"{term.name} takes no arguments; only {list(WRAPPERS)} do")
        return
    if term.name not in WRAPPERS:
        raise fail(f"{term.name!r} is no reward; choose one of "
                   f"{[*REWARDS, *WRAPPERS]} or an import path 'package.module:function'")
    wrapper = WRAPPERS[term.name]
    given = dict(term.params)
    for key, value in term.params:
        if key not in wrapper.params:
            raise fail(f"{term.name} takes {list(wrapper.params)}, got {key}")
        _default, low, high, meaning = wrapper.params[key]
        if not low <= value <= high:
            raise fail(f"{term.name}'s {key} ({meaning}) must lie in [{low:g}, {high:g}], "
                       f"got {value:g}")
    missing = [k for k, (default, *_rest) in wrapper.params.items()
               if default is None and k not in given]
    if missing or len(given) != len(term.params):
        raise fail(f"{term.name} needs each of {list(wrapper.params)} once "
                   f"(e.g. {example(term.name)})")
    for inner in term.base or ():
        _check_term(inner, at)
    if wrapper.binary_base and term.base is not None and (
            len(term.base) != 1 or term.base[0].weight != 1 or term.base[0].name == "shaped"):
        raise fail(f"{term.name} flips 0/1 verdicts: its reward must be one 0/1 reward "
                   f"without weight or shaping (e.g. {example(term.name, 'strict')})")


def example(name: str, base: str = "") -> str:
    """A call of wrapper `name` with each parameter set, e.g. `noisy(p=0.2)`."""
    values = [f"{k}={0.2 if d is None else d:g}" for k, (d, *_r) in WRAPPERS[name].params.items()]
    return f"{name}({', '.join(([base] if base else []) + values)})"


def spec_text(spec, field: str = FIELD) -> str:
    """A spec as its text: a string as is; a list of (reward, weight) pairs as their sum,
    `[("correctness", 1), ("format", 0.3)]` -> 'correctness+0.3*format'. Each pair names one
    reward (no sum inside a pair). ValueError names `field`."""
    if isinstance(spec, str):
        return spec
    if not isinstance(spec, (list, tuple)) or not spec:
        raise ValueError(f"{field} must be a string such as 'correctness+0.3*format' or a "
                         f"non-empty list of (reward, weight) pairs, got {spec!r}")
    text = ""
    for i, item in enumerate(spec):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"{field}[{i}] must be a (reward, weight) pair, got {item!r}")
        name, weight = item
        if (isinstance(weight, bool) or not isinstance(weight, numbers.Real)
                or not math.isfinite(weight) or weight == 0):
            raise ValueError(f"{field}[{i}]: the weight of {name!r} must be a finite, non-zero "
                             f"number, got {weight!r}")
        terms = parse(name, f"{field}[{i}]")
        if len(terms) != 1 or terms[0].weight != 1:
            raise ValueError(f"{field}[{i}]: {name!r} must be one reward, its weight given "
                             "in the pair")
        w = float(weight)
        name = name.strip()
        term = name if w == 1 else "-" + name if w == -1 else f"{w!r}*{name}"
        text += term if not text or term.startswith("-") else "+" + term
    return text


def build(spec, field: str = FIELD) -> RewardFn:
    """The reward function of a spec (a string or a list of pairs), checked, imported and
    built once per text. A lone unweighted name is the registered function itself."""
    return _built(spec_text(spec, field), field)


@lru_cache(maxsize=64)
def _built(text: str, field: str) -> RewardFn:
    return _sum(parse(text, field), field)


def _sum(terms: Sequence[Term], field: str) -> RewardFn:
    parts = [(_one(t, field), t.weight) for t in terms]
    return parts[0][0] if len(parts) == 1 and parts[0][1] == 1 else combine(*parts)


def _one(term: Term, field: str) -> RewardFn:
    if term.name in WRAPPERS:
        wrapper = WRAPPERS[term.name]
        values = {k: d for k, (d, *_r) in wrapper.params.items()} | dict(term.params)
        return wrapper.build(correctness if term.base is None else _sum(term.base, field),
                             **values)
    return REWARDS.resolve(term.name, field)


def reward_columns(rows: Sequence, completions: Sequence[str], step_seed: int) -> dict:
    """The keywords of a reward call, as TRL's: `prompts`, `completions`, each column of the
    problems' records (`Problem.to_record`: `answer`, `steps`, `target`) but the prompt, and
    `step_seed`. `rows` holds the problem of each completion (N = B*G, G per prompt)."""
    records = [row.to_record() for row in rows]
    columns = {"prompts": [r["prompt"] for r in records], "completions": list(completions)}
    for key in (records[0] if records else {}):
        if key != "prompt":
            columns[key] = [r[key] for r in records]
    return {**columns, "step_seed": step_seed}


def score(spec, rows: Sequence, completions: Sequence[str], step_seed: int) -> list[float]:
    """The rewards of `completions` (N,) under `spec`, one finite float each, or RewardError."""
    values = check_rewards(build(spec)(**reward_columns(rows, completions, step_seed)),
                           spec_text(spec))
    if len(values) != len(completions):
        raise RewardError(f"reward {spec_text(spec)} returned {len(values)} rewards for "
                          f"{len(completions)} completions")
    return values


def score_terms(spec, rows: Sequence, completions: Sequence[str],
                step_seed: int) -> tuple[list[list[float]], list[float]]:
    """Each term of `spec` scored on its own: (scores (N, K) as rows of K floats, weights
    (K,)), so that sum_k w_k scores[i][k] is `score`'s reward i (up to float rounding). A
    spec of one term gives K = 1. For estimators that normalise each term (gdpo)."""
    text = spec_text(spec)
    columns = reward_columns(rows, completions, step_seed)
    columns_of_terms, weights = [], []
    for term in parse(text):
        fn = _one(term, FIELD)
        name = getattr(fn, "__name__", term.name)
        values = check_rewards(fn(**columns), name)
        if len(values) != len(completions):
            raise RewardError(f"reward {name} returned {len(values)} rewards for "
                              f"{len(completions)} completions")
        columns_of_terms.append(values)
        weights.append(term.weight)
    return [list(v) for v in zip(*columns_of_terms)], weights


class RewardSpecs:
    """What the config's `reward` may name, in the place of a registry (`fields.choice`):
    `resolve` builds a spec, `describe` lists the choices for --help."""

    def resolve(self, spec, field: str | None = None) -> RewardFn:
        return build(spec, field or FIELD)

    def __iter__(self):
        """The names a spec may be made of: the rewards, then the wrappers."""
        return iter([*REWARDS, *WRAPPERS])

    def describe(self, sep: str = "; ") -> str:
        wrapped = sep.join(f"{example(name)}: {w.title}" for name, w in WRAPPERS.items())
        return (f"{REWARDS.describe(sep)}{sep}{wrapped}{sep}and weighted sums of these, e.g. "
                "correctness+0.3*format")


REWARD_SPECS = RewardSpecs()

__all__ = ["noisy", "systematic", "WRAPPERS", "Wrapper", "Term", "parse", "spec_text", "build",
           "reward_columns", "score", "score_terms", "RewardSpecs", "REWARD_SPECS", "example"]
