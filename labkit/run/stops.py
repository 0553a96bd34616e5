"""Stop rules: end a run early when a logged metric misbehaves for long enough.

An overnight run that has collapsed (every group's advantages alike, the policy far from
its reference) only burns compute; a rule such as `adv/gav<0.05 for 20` ends it with a
checkpoint and says why. The rules are one string, `TrainConfig.stop_rules`:

    rules  := rule (";" rule)*              blank: no rule (labkit.grammar's tokens)
    rule   := METRIC OP NUMBER ["for" COUNT]
    OP     := ">" | ">=" | "<" | "<="
    METRIC := a key of labkit.formulas.metrics.METRICS (eval/pass@k as its actual key, eval/pass@4)
    COUNT  := the condition must hold on COUNT consecutive records that log METRIC (default 1)

e.g. `"rollout/truncated_frac>0.9 for 20; policy/kl>0.5"`. A record without the metric (an
evaluation metric between evaluations) neither counts nor breaks a streak; a NaN value breaks
it.

A dead run needs no rule: `DeadRunWatch` (on by default, `TrainConfig.dead_steps`) finds K
consecutive steps without any learning signal and says why in one sentence (`Dead`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from labkit import grammar
from labkit.formulas.metrics import METRICS

FIELD = "stop_rules"
OPS = (">=", "<=", ">", "<")
_PASS_AT_K = re.compile(r"^eval/pass@([1-9][0-9]*)$")


@dataclass(frozen=True)
class StopRule:
    """One condition on one metric, which must hold on `count` consecutive records."""

    metric: str
    op: str
    threshold: float
    count: int = 1

    def holds(self, value: float) -> bool:
        """NaN never holds: a broken metric must not end a run as if it were a bad one."""
        if math.isnan(value):
            return False
        return {">": value > self.threshold, ">=": value >= self.threshold,
                "<": value < self.threshold, "<=": value <= self.threshold}[self.op]

    def __str__(self) -> str:
        times = f" for {self.count}" if self.count > 1 else ""
        return f"{self.metric}{self.op}{self.threshold:g}{times}"


@dataclass(frozen=True)
class Stop:
    """A rule that fired: which, at which step, on which value."""

    rule: StopRule
    step: int
    value: float

    def message(self) -> str:
        streak = f" on {self.rule.count} consecutive records" if self.rule.count > 1 else ""
        return (f"stop rule '{self.rule}' fired at step {self.step}: {self.rule.metric} = "
                f"{self.value:.6g}{streak}")

    def to_dict(self) -> dict:
        return {"step": self.step, "rule": str(self.rule), "metric": self.rule.metric,
                "value": self.value, "message": self.message()}


def known_metric(name: str) -> bool:
    return name in METRICS or _PASS_AT_K.match(name) is not None


def parse(text: str) -> list[StopRule]:
    """`TrainConfig.stop_rules` as rules (labkit.grammar's tokens); GrammarError names the
    field, the text, the column and what is wrong (unknown metric names list the valid
    ones)."""
    if not isinstance(text, str):
        raise ValueError(f"{FIELD} must be a string like 'rollout/truncated_frac>0.9 for 20; "
                         f"policy/kl>0.5', got {text!r}")
    toks = grammar.tokens(text, FIELD)
    return [_parse_one(part, text) for part in grammar.split(toks, ";", FIELD, text) if part]


def _parse_one(part: list[grammar.Token], text: str) -> StopRule:
    def fail(what: str, tok: grammar.Token) -> grammar.GrammarError:
        return grammar.GrammarError(FIELD, text, tok.start, what)

    rule = grammar.source(text, part)
    shape = fail(f"{rule!r} is not 'METRIC OP NUMBER [for COUNT]' with OP one of "
                 f"{' '.join(OPS)}, e.g. 'rollout/truncated_frac>0.9 for 20'", part[0])
    at = next((i for i, tok in enumerate(part) if tok.kind == "op" and tok.text in OPS), 0)
    value = part[at + 1:at + 2]
    if value and value[0].is_op("-", "+"):
        value = part[at + 1:at + 3]
    rest = part[at + 1 + len(value):]
    if at == 0 or len(value) not in (1, 2) or value[-1].kind not in ("number", "name") \
            or (rest and (len(rest) < 2 or rest[0].text != "for")):
        raise shape
    metric = grammar.source(text, part[:at])
    if not known_metric(metric):
        valid = ", ".join(k for k in METRICS if k != "eval/pass@k")
        raise fail(f"unknown metric {metric!r} in {rule!r}; valid metrics: {valid}, "
                   "eval/pass@<k>", part[0])
    try:
        threshold = float(grammar.source(text, value))
    except ValueError:
        threshold = math.nan
    if not math.isfinite(threshold):
        raise fail(f"the threshold of {rule!r} must be a finite number, got "
                   f"{grammar.source(text, value)!r}", value[0])
    count = 1
    if rest:
        given = grammar.source(text, rest[1:])
        if not given.isdigit() or int(given) < 1:
            raise fail(f"'for COUNT' in {rule!r} needs an integer COUNT >= 1, got {given!r}",
                       rest[1])
        count = int(given)
    return StopRule(metric, part[at].text, threshold, count)


def never_logged(rule: StopRule, config) -> str | None:
    """Why a run of `config` never logs the rule's metric (a rule that could never fire is a
    mistake, not a safety net), or None when it may."""
    c, m = config, rule.metric
    needs = [
        (m in ("policy/kl", "loss/kl"), c.beta > 0, "beta > 0"),
        (m == "policy/kl_k1", c.beta > 0 or (c.algo == "dpo" and c.dpo_online),
         "beta > 0 or online DPO"),
        (m == "loss/kl", c.algo == "grpo", "algo='grpo' (PPO puts the KL in the reward)"),
        (m.startswith("value/") or m == "loss/value", c.algo == "ppo", "algo='ppo'"),
        (m == "rollout/kept_frac", c.algo in ("grpo", "rft"), "algo='grpo' or 'rft'"),
        (m.startswith("dpo/") or m == "loss/dpo", c.algo == "dpo", "algo='dpo'"),
        (m == "dpo/grpo_cosine", c.dpo_grpo_cosine, "dpo_grpo_cosine"),
        (m == "loss/sft", c.algo == "rft", "algo='rft'"),
        (m == "ref/synced", c.ref_sync_every > 0, "ref_sync_every > 0"),
        (m.startswith(("clip/", "ratio/")) or m == "loss/policy", c.algo in ("grpo", "ppo"),
         "algo='grpo' or 'ppo'"),
        (m == "clip/dual", c.dual_clip is not None, "dual_clip"),
        (m == "loss/entropy", c.entropy_coef > 0, "entropy_coef > 0"),
        (m.startswith(("clip/", "ratio/")), not c.reinforce, "reinforce=False"),
        (m.startswith("reuse/"), c.num_iterations >= 2, "num_iterations >= 2"),
        (m == "eval/cgc", c.cgc_prompts > 0 and c.group_size >= 2,
         "cgc_prompts > 0 and group_size >= 2"),
    ]
    pass_at = _PASS_AT_K.match(m)
    if pass_at:
        k = int(pass_at[1])
        needs.append((True, c.eval_samples >= 1 and k in (1, c.eval_samples),
                      f"eval_samples = {k} (pass@1 and pass@<eval_samples> are logged)"))
    for applies, ok, requirement in needs:
        if applies and not ok:
            return f"{m} is only logged with {requirement}"
    return None


class StopRules:
    """Follows each rule's streak over the records of a run, one `update` per record."""

    def __init__(self, rules: list[StopRule]):
        self.rules = list(rules)
        self.streaks = [0] * len(self.rules)

    def update(self, record: dict) -> Stop | None:
        """Feed one metrics record; the first rule whose streak reaches its count, or None."""
        fired = None
        for i, rule in enumerate(self.rules):
            value = record.get(rule.metric)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            self.streaks[i] = self.streaks[i] + 1 if rule.holds(float(value)) else 0
            if fired is None and self.streaks[i] >= rule.count:
                fired = Stop(rule, int(record.get("step", -1)), float(value))
        return fired


# --- dead runs ------------------------------------------------------------------------------

DEAD_TRUNCATED = 0.95
"""rollout/truncated_frac at or above which a step counts as dead: nearly every completion
ran to max_new_tokens without EOS (and, unscored, earned 0)."""
DEAD_FILE = "dead_run.json"
"""Written into the run directory when a run is found dead: the spell, its cause, the sentence."""


@dataclass(frozen=True)
class Dead:
    """A dead spell of `steps` consecutive steps, `first`..`step`, found at `step`."""

    step: int
    first: int
    truncated: bool
    """True: nearly every completion was truncated; False: no group had reward variance."""
    reward_mean: float

    def message(self) -> str:
        """One plain sentence: what was seen, the likely cause, the levers."""
        when = f"step {self.step}" if self.first == self.step else \
            f"steps {self.first}-{self.step}"
        levers = "try a lower lr, beta > 0 (a KL to the reference), or a larger max_new_tokens"
        if self.truncated:
            return (f"dead run: in {when} nearly every completion hit max_new_tokens without "
                    f"EOS; the policy has likely lost its EOS token after too large an update, "
                    f"or max_new_tokens is too small for its answers; {levers}")
        if self.reward_mean == 0:
            return (f"dead run: in {when} every completion scored 0, so "
                    f"no group had reward variance and every group-relative advantage was 0; "
                    f"the policy has likely collapsed, or the task is out of its reach; "
                    f"{levers}")
        return (f"dead run: in {when} the completions of every prompt scored alike (reward "
                f"mean {self.reward_mean:.2f}), so every group-relative advantage was 0; the "
                f"policy has likely collapsed to one answer per prompt, or solved the task; "
                f"{levers} (a harder task, if it is solved)")

    def to_dict(self) -> dict:
        return {"step": self.step, "first": self.first, "truncated": self.truncated,
                "reward_mean": self.reward_mean, "message": self.message()}


class DeadRunWatch:
    """Counts consecutive dead steps over a run's records, one `update` per record.

    A step is dead when no group has reward variance (`rollout/frac_zero_std` = 1; with
    group_size 1, all N rewards equal) or `rollout/truncated_frac` >= DEAD_TRUNCATED. Records
    without rollout figures (the evaluation before step 1) neither count nor break a spell.
    """

    def __init__(self, steps: int, group_size: int):
        self.steps, self.group_size = steps, group_size
        self.length, self.first, self.truncated = 0, -1, 0

    def update(self, record: dict) -> Dead | None:
        """A Dead when this record makes a spell exactly `steps` long, else None (0: never)."""
        if not self.steps or "rollout/reward_mean" not in record:
            return None
        if not self._dead(record):
            self.length, self.truncated = 0, 0
            return None
        if self.length == 0:
            self.first = int(record.get("step", -1))
        self.length += 1
        self.truncated += record.get("rollout/truncated_frac", 0.0) >= DEAD_TRUNCATED
        if self.length != self.steps:
            return None
        return Dead(int(record.get("step", -1)), self.first, 2 * self.truncated > self.length,
                    float(record["rollout/reward_mean"]))

    def _dead(self, record: dict) -> bool:
        if record.get("rollout/truncated_frac", 0.0) >= DEAD_TRUNCATED:
            return True
        if self.group_size >= 2:
            return record.get("rollout/frac_zero_std", 0.0) >= 1.0
        return record.get("rollout/reward_std", 1.0) == 0.0


class RunWatch:
    """A run's stop rules and dead-run watch, fed its records one `update` at a time."""

    def __init__(self, config):
        self.rules = StopRules(parse(config.stop_rules))
        self.watch = DeadRunWatch(config.dead_steps, config.group_size)
        self.stop_when_dead = config.stop_when_dead
        self.dead: Dead | None = None
        """The last dead spell found."""
        self.found: Dead | None = None
        """The dead spell the last record completed, if it completed one."""

    def update(self, record: dict) -> Stop | Dead | None:
        """What ends the run at this record: a rule that fired, else (stop_when_dead) a dead
        spell that this record completed, else None."""
        stop = self.rules.update(record)
        self.found = self.watch.update(record)
        if self.found is not None:
            self.dead = self.found
            if stop is None and self.stop_when_dead:
                return self.found
        return stop
