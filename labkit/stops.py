"""Stop rules: end a run early when a logged metric misbehaves for long enough.

An overnight run that has collapsed (every group's advantages alike, the policy far from
its reference) only burns compute; a rule such as `adv/gav<0.05 for 20` ends it with a
checkpoint and says why. The rules are one string, `TrainConfig.stop_rules`:

    rules  := rule (";" rule)*              blank: no rule
    rule   := METRIC OP NUMBER ["for" COUNT]
    OP     := ">" | ">=" | "<" | "<="
    METRIC := a key of labkit.metrics.METRICS (eval/pass@k as its actual key, eval/pass@4)
    COUNT  := the condition must hold on COUNT consecutive records that log METRIC (default 1)

e.g. `"adv/gav>0.45 for 5; policy/kl>0.5"`. A record without the metric (an evaluation
metric between evaluations) neither counts nor breaks a streak; a NaN value breaks it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from labkit.metrics import METRICS

FIELD = "stop_rules"
OPS = (">=", "<=", ">", "<")
_RULE = re.compile(r"^\s*(?P<metric>[^\s<>=]+)\s*(?P<op>>=|<=|>|<)\s*(?P<value>[^\s;]+)"
                   r"(?:\s+for\s+(?P<count>\S+))?\s*$")
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
    """`TrainConfig.stop_rules` as rules; ValueError names the field, the rule and what is
    wrong with it (unknown metric names list the valid ones)."""
    if not isinstance(text, str):
        raise ValueError(f"{FIELD} must be a string like 'adv/gav>0.45 for 5; policy/kl>0.5', "
                         f"got {text!r}")
    rules = []
    for part in text.split(";"):
        if not part.strip():
            continue
        rules.append(_parse_one(part.strip()))
    return rules


def _parse_one(part: str) -> StopRule:
    match = _RULE.match(part)
    if match is None:
        raise ValueError(f"{FIELD}: {part!r} is not 'METRIC OP NUMBER [for COUNT]' with OP one "
                         f"of {' '.join(OPS)}, e.g. 'adv/gav>0.45 for 5'")
    metric, op = match["metric"], match["op"]
    if not known_metric(metric):
        valid = ", ".join(k for k in METRICS if k != "eval/pass@k")
        raise ValueError(f"{FIELD}: unknown metric {metric!r} in {part!r}; valid metrics: "
                         f"{valid}, eval/pass@<k>")
    try:
        threshold = float(match["value"])
    except ValueError:
        threshold = math.nan
    if not math.isfinite(threshold):
        raise ValueError(f"{FIELD}: the threshold of {part!r} must be a finite number, got "
                         f"{match['value']!r}")
    count = 1
    if match["count"] is not None:
        if not match["count"].isdigit() or int(match["count"]) < 1:
            raise ValueError(f"{FIELD}: 'for COUNT' in {part!r} needs an integer COUNT >= 1, "
                             f"got {match['count']!r}")
        count = int(match["count"])
    return StopRule(metric, op, threshold, count)


def never_logged(rule: StopRule, config) -> str | None:
    """Why a run of `config` never logs the rule's metric (a rule that could never fire is a
    mistake, not a safety net), or None when it may."""
    c, m = config, rule.metric
    needs = [
        (m in ("policy/kl", "policy/kl_k1", "loss/kl"), c.beta > 0, "beta > 0"),
        (m == "loss/kl", c.algo == "grpo", "algo='grpo' (PPO puts the KL in the reward)"),
        (m.startswith("value/") or m == "loss/value", c.algo == "ppo", "algo='ppo'"),
        (m == "rollout/kept_frac", c.algo == "grpo", "algo='grpo'"),
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
