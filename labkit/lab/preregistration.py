"""A claim's preregistration: what its experiment must show, fixed before it runs.

Every claim block of experiments/claims/ carries a `preregistered:` block, checked when the
sweep is loaded, before any run starts:

    preregistered:
      article: "..."         # the article's statement, translated, with the article's numbers
      measure: gain          # the primary measure, a key of MEASURES
      compare: [rloo, grpo]  # for a measure between arms: the arm and the baseline (arms of
                             #   the sweep); `all` for every arm against the baseline;
                             #   [grpo-*, dpo-*] pairs every grpo-X with dpo-X over a grid
      finding: "gains more"  # optional: words of the decisive finding's question
      direction: above       # above, below, two-sided or equivalent (labkit.formulas.stats_design.DIRECTIONS)
      threshold: 0           # the article's magnitude where it gives one, else no effect
      margin: 1.0            # +- this counts as no difference: needed for equivalent
      seeds: 10              # seeds planned per arm (at least MIN_SEEDS)
      control:               # a positive control: required where the measure can stay
        compare: [short, grpo]  # put whatever the claim (NEEDS_CONTROL); the arm that
        direction: below     #   must move the measure (by default the claim's; `measure:`
        margin: 0.05         #   names another) past +-margin in `direction`
        why: "..."           #   why that arm must move it

Without a control that moved its measure a null reading says nothing of the claim: the
claim reads `not testable here` (labkit.lab.claims.NOT_TESTABLE) with the reason, never
refuted. A claim file whose measure needs a control and names none is refused when it is
loaded to run (`check(..., require_control=True)`), before any run starts.

The claim-level verdict is the primary measure's, read by `labkit.formulas.stats_design.decide`; the claim's
other findings are context. A claim is refused with one line naming the file, the claim and
the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.formulas import stats, stats_design
from labkit.lab.experiments import DEFAULT_ARMS, parse_arms, parse_list

MEASURES = {
    "gain": "held-out accuracy gained, arm minus baseline, points",
    "final_length": "mean completion length over the last fifth of the steps, arm minus "
                    "baseline, tokens",
    "final_length_correct": "mean length of the correct completions over the last fifth of "
                            "the steps, arm minus baseline, tokens",
    "final_length_incorrect": "mean length of the wrong completions over the last fifth of "
                              "the steps, arm minus baseline, tokens",
    "step_time_ratio": "time per step, arm / baseline, geometric mean over paired seeds",
    "memory_ratio": "peak process memory, arm / baseline, geometric mean over paired seeds",
    "tensor_memory_ratio": "peak bytes the run's tensors held (perf/tensor_peak_mb: weights, "
                           "gradients, optimizer states, reference, critic, activations), arm "
                           "/ baseline, geometric mean over paired seeds",
    "grad_rel_var_ratio": "policy-gradient relative variance (raw advantages) with the "
                          "trained critic / with the leave-one-out group baseline, per run at "
                          "its last diagnostics, geometric mean over seeds "
                          "(docs/diagnostics.md)",
    "informative_share_error": "observed share of informative groups minus the formula's "
                               "prediction 1 - p^G - (1-p)^G",
    "collapse_difference": "share of runs that collapsed, arm minus baseline, paired by seed",
    "critic_error_growth": "the critic's mean |V - V_MC| after the third written step / after "
                           "the first, per run at its last look through the credit microscope, "
                           "geometric mean over seeds",
    "length_change": "mean completion length over the last fifth of the steps minus the "
                     "first step's, within each run of the arm, tokens, over seeds",
    "worked_change": "share of completions that work before they answer, last fifth of the "
                     "steps minus the first step, within each run of the arm, over seeds",
    "update_cosine": "cosine between the DPO and the GRPO gradient on the same rollout, "
                     "mean over the steps of each run of the arm (dpo_grpo_cosine), over seeds",
    "monitor_youden": "a monitor's sensitivity + specificity - 1 over runs (fired before a "
                      "collapse; stayed quiet on a healthy run)",
    "early_length_rate": "how fast the mean completion length moves before it saturates: "
                         "the least-squares slope over the first EARLY_STEPS steps, arm "
                         "minus baseline, tokens per step",
    "early_length_rate_incorrect": "the same slope for the wrong completions' mean length, "
                                   "arm minus baseline, tokens per step",
    "early_steps_rate": "the same slope for the mean number of steps a completion writes "
                        "before it answers ('3+4='), arm minus baseline, steps per step",
    "final_steps": "mean number of written steps over the last fifth of the steps, arm minus "
                   "baseline",
}
"""The primary measures a claim may name, with what each is."""

ONE_ARM = ("grad_rel_var_ratio", "critic_error_growth", "length_change", "worked_change",
           "update_cosine")
"""Measures read within each run of one arm: their `compare` may name that arm alone."""

NEEDS_CONTROL = ("final_length", "final_length_correct", "final_length_incorrect",
                 "length_change", "worked_change", "monitor_youden", "early_length_rate",
                 "early_length_rate_incorrect", "early_steps_rate", "final_steps")
"""Measures that can stay put whatever the claim (a length the task fixes, a monitor on runs
that never collapse): a claim on one names a positive control."""

KEYS = ("article", "measure", "compare", "finding", "direction", "threshold", "margin", "seeds",
        "control")
CONTROL_KEYS = ("measure", "compare", "direction", "margin", "why")
REQUIRED = ("article", "measure", "direction", "threshold", "seeds")
MIN_SEEDS = 5
"""The fewest seeds per arm a claim may plan."""


@dataclass(frozen=True)
class Preregistration:
    """A claim's preregistered test (the module docstring's fields)."""

    article: str
    measure: str
    direction: str
    threshold: float
    seeds: int
    compare: tuple[str, ...] = ()
    finding: str = ""
    margin: float | None = None
    control: Control | None = None

    def describe(self) -> str:
        """'gain (rloo vs grpo) two-sided about 0, +-1 no difference': the test in words."""
        arms = f" ({' vs '.join(self.compare)})" if self.compare else ""
        side = {"above": "above", "below": "below", "two-sided": "differs from",
                "equivalent": "within the margin of"}[self.direction]
        margin = f", margin +-{self.margin:g}" if self.margin is not None else ""
        return f"{self.measure}{arms} {side} {self.threshold:g}{margin}"

    def decide(self, interval: stats.Interval) -> str:
        """The claim-level verdict from the primary measure's interval."""
        return stats_design.decide(interval, self.direction, self.threshold, self.margin)


@dataclass(frozen=True)
class Control:
    """A positive control: arm `compare[0]` must move `measure` past +-`margin` from
    `compare[1]` in `direction` (above or below), or the claim's null says nothing."""

    measure: str
    compare: tuple[str, str]
    direction: str
    margin: float
    why: str

    def as_preregistration(self, seeds: int) -> Preregistration:
        """The control as a test of its own: supported when it moved the measure."""
        threshold = self.margin if self.direction == "above" else -self.margin
        return Preregistration(self.why, self.measure, self.direction, threshold, seeds,
                               self.compare)

    def describe(self) -> str:
        side = "above +" if self.direction == "above" else "below -"
        return f"{self.measure} ({' vs '.join(self.compare)}) {side}{self.margin:g}"


def _control(block, who: str, measure: str, arms: list[str] | None,
             check_arms: bool) -> Control:
    """The `control:` block checked (CONTROL_KEYS): compare two arms, direction above or
    below, margin > 0, why in words; its measure by default the claim's."""
    who = f"{who}.control"
    if not isinstance(block, dict):
        raise ValueError(f"{who} must be a mapping of {', '.join(CONTROL_KEYS)}, got {block!r}")
    unknown = sorted(set(block) - set(CONTROL_KEYS))
    if unknown:
        raise ValueError(f"{who}: unknown field(s) {unknown}; fields: {', '.join(CONTROL_KEYS)}")
    measure = block.get("measure", measure)
    if measure not in MEASURES or measure in ONE_ARM or measure == "monitor_youden":
        raise ValueError(f"{who}.measure must be a measure between two arms, got {measure!r}")
    compare = block.get("compare")
    if not (isinstance(compare, list) and len(compare) == 2
            and all(isinstance(c, str) for c in compare)):
        raise ValueError(f"{who}.compare must be [ARM, BASELINE], got {compare!r}")
    if check_arms and arms is not None:
        bad = [c for c in compare if c not in arms]
        if bad:
            raise ValueError(f"{who}.compare: unknown arm {bad[0]!r}; the sweep's arms: "
                             f"{', '.join(arms)}")
    if block.get("direction") not in ("above", "below"):
        raise ValueError(f"{who}.direction must be above or below, got "
                         f"{block.get('direction')!r}")
    margin = block.get("margin")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) \
            or not math.isfinite(margin) or margin <= 0:
        raise ValueError(f"{who}.margin must be a number > 0 (how far the control must move "
                         f"the measure), got {margin!r}")
    why = block.get("why")
    if not (isinstance(why, str) and why.strip()):
        raise ValueError(f"{who}.why must say why the control arm must move the measure")
    return Control(measure, (compare[0], compare[1]), block["direction"], float(margin),
                   why.strip())


def check(claim: dict, where: str, arms: list[str] | None = None,
          check_arms: bool = True, require_control: bool = False) -> Preregistration:
    """The claim block's `preregistered:` block, checked: every field present and of its kind,
    the measure known, the compared arms arms of the sweep (`arms`; None: the sweep has no
    arms; check_arms=False for a smoke variant, whose arms are a few of the claim's).
    ValueError: one line naming `where`, the claim and the field."""
    who = f"{where}: claim {claim.get('id', '?')}: preregistered"
    block = claim.get("preregistered")
    if not isinstance(block, dict):
        raise ValueError(f"{who} is missing: give {', '.join(REQUIRED)} (and compare, "
                         "finding, margin where they apply) before the claim runs")
    unknown = sorted(set(block) - set(KEYS))
    if unknown:
        raise ValueError(f"{who}: unknown field(s) {unknown}; fields: {', '.join(KEYS)}")
    missing = [k for k in REQUIRED if block.get(k) in (None, "")]
    if missing:
        raise ValueError(f"{who}.{missing[0]} is missing (required: {', '.join(REQUIRED)})")
    for key in ("article", "finding"):
        if key in block and not (isinstance(block[key], str) and block[key].strip()):
            raise ValueError(f"{who}.{key} must be a non-empty string, got {block[key]!r}")
    if block["measure"] not in MEASURES:
        raise ValueError(f"{who}.measure: unknown measure {block['measure']!r}; measures: "
                         f"{', '.join(MEASURES)}")
    if block["direction"] not in stats_design.DIRECTIONS:
        raise ValueError(f"{who}.direction must be one of {list(stats_design.DIRECTIONS)}, got "
                         f"{block['direction']!r}")
    numbers = {}
    for key in ("threshold", "margin"):
        value = block.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or (key == "margin" and value <= 0):
            rule = "a number > 0" if key == "margin" else "a finite number"
            raise ValueError(f"{who}.{key} must be {rule}, got {value!r}")
        numbers[key] = float(value)
    if block["direction"] == "equivalent" and "margin" not in numbers:
        raise ValueError(f"{who}.margin is missing: an equivalence claim needs the margin "
                         "within which the effect counts as none")
    seeds = block["seeds"]
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < MIN_SEEDS:
        raise ValueError(f"{who}.seeds must be an integer >= {MIN_SEEDS} (seeds planned per "
                         f"arm), got {seeds!r}")
    compare = block.get("compare") or []
    sizes = (0, 1, 2) if block["measure"] in ONE_ARM else (0, 2)
    if not isinstance(compare, list) or len(compare) not in sizes \
            or not all(isinstance(c, str) for c in compare):
        one = " or [ARM], for a measure within one arm's runs" if 1 in sizes else ""
        raise ValueError(f"{who}.compare must be [ARM, BASELINE] (ARM may be 'all'){one}, "
                         f"got {compare!r}")
    if compare and check_arms:
        if arms is None:
            raise ValueError(f"{who}.compare names arms, but the sweep runs none")
        bad = [c for i, c in enumerate(compare) if c not in arms and not (i == 0 and c == "all")
               and not (c.endswith("*") and any(a.startswith(c[:-1]) for a in arms))]
        if bad:
            raise ValueError(f"{who}.compare: unknown arm {bad[0]!r}; the sweep's arms: "
                             f"{', '.join(arms)}")
    control = None
    if block.get("control") is not None:
        control = _control(block["control"], who, block["measure"], arms, check_arms)
    elif require_control and block["measure"] in NEEDS_CONTROL:
        raise ValueError(f"{who}.control is missing: {block['measure']} can stay put whatever "
                         "the claim, so name a positive control (an arm that must move it by "
                         "a stated margin) before the claim runs")
    return Preregistration(block["article"].strip(), block["measure"], block["direction"],
                           numbers["threshold"], seeds, tuple(compare),
                           str(block.get("finding", "")).strip(), numbers.get("margin"),
                           control)


def sweep_arms(parameters: dict) -> list[str] | None:
    """The arms a claim sweep's notebook runs, from its parameters: notebook 05's `arms`
    (its names), notebook 01's `algos`, notebook 02's `group_sizes` (as 'G=4'); None when
    it runs no arms."""
    if "arms" in parameters:
        return list(parse_arms(parameters["arms"] or DEFAULT_ARMS))
    if "algos" in parameters:
        return parse_list(parameters["algos"])
    if "group_sizes" in parameters:
        return [f"G={g}" for g in parse_list(parameters["group_sizes"], int)]
    return None


__all__ = ["MEASURES", "MIN_SEEDS", "NEEDS_CONTROL", "Control", "Preregistration", "check",
           "sweep_arms"]
