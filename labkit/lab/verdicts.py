"""From runs over paired seeds to answers: each arm's figures with 95% intervals, and a
verdict per question (`labkit.stats`).

`arm_rows` gives one row per arm (an algorithm, a group size): the mean over its seeds of
each figure with its t-interval. `grpo_vs_ppo` asks notebook 01's three questions of two
arms (does one gain more held-out accuracy, does the other's step take longer, does its
process need more memory) and `group_size_findings` notebook 02's (does the largest G end
higher than the smallest, does its step cost more). `describe_findings` writes the verdicts
as sentences, naming the interval's method and the held-out problems' own noise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from labkit import stats

FIGURES = ("accuracy_before", "accuracy_after", "gain", "final_reward", "step_s", "mem_mb",
           "wall_s")
"""The figures `arm_rows` gives an interval for, where the rows have them."""


@dataclass(frozen=True)
class Finding:
    """One question asked of the runs: the claim, what was measured, its interval, and the
    verdict against `threshold` (the claim is that the effect lies above it, or below it
    when `direction` is "below")."""

    question: str
    measure: str
    interval: stats.Interval
    threshold: float
    direction: str
    verdict: str
    note: str = ""
    digits: int = 2
    """Decimals shown: 1 for points of accuracy, 2 for ratios."""

    def row(self) -> dict:
        """A table row: the question, the effect with its 95% interval, the method, the
        verdict."""
        return {"question": self.question, "measure": self.measure,
                "effect [95% CI]": self.interval.format(self.digits), "seeds": self.interval.n,
                "method": self.interval.method, "verdict": self.verdict}

    def to_dict(self) -> dict:
        return {"question": self.question, "measure": self.measure,
                "interval": self.interval.to_dict(), "threshold": self.threshold,
                "direction": self.direction, "verdict": self.verdict, "note": self.note}


def finding(question: str, measure: str, interval: stats.Interval, *, above: float | None = None,
            below: float | None = None, note: str = "", digits: int = 2) -> Finding:
    """A Finding whose verdict is `stats.verdict(interval, above=..., below=...)`."""
    verdict = stats.verdict(interval, above=above, below=below)
    threshold, direction = (above, "above") if above is not None else (below, "below")
    return Finding(question, measure, interval, threshold, direction, verdict, note, digits)


def by_arm(rows: Sequence[dict]) -> dict[str, dict[int, dict]]:
    """arm -> seed -> row, in the order the arms first appear."""
    out: dict[str, dict[int, dict]] = {}
    for row in rows:
        out.setdefault(row["arm"], {})[row["seed"]] = row
    return out


def arm_rows(rows: Sequence[dict], digits: int = 3) -> list[dict]:
    """One row per arm: its seeds, and for each of FIGURES the mean over seeds with its 95%
    t-interval, 'mean [low, high]' (the mean alone for one seed)."""
    out = []
    for arm, seeds in by_arm(rows).items():
        row = {"arm": arm, "seeds": len(seeds)}
        for key in FIGURES:
            values = [r[key] for r in seeds.values()
                      if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if len(values) == len(seeds):
                interval = stats.mean_interval(values)
                row[key] = (f"{interval.mean:.{digits}f}" if interval.n == 1
                            else interval.format(digits))
        out.append(row)
    return out


def paired(rows: Sequence[dict], a: str, b: str, key: str) -> tuple[list[float], list[float]]:
    """`key` of arms a and b on the seeds both ran, in seed order."""
    arms = by_arm(rows)
    if a not in arms or b not in arms:
        raise ValueError(f"arms {a!r} and {b!r} must both have runs, found {list(arms)}")
    common = sorted(set(arms[a]) & set(arms[b]))
    if not common:
        raise ValueError(f"arms {a!r} and {b!r} share no seed: a paired comparison needs the "
                         "same seeds")
    return [arms[a][s][key] for s in common], [arms[b][s][key] for s in common]


def accuracy_noise(rows: Sequence[dict]) -> str:
    """The held-out problems' own noise: the binomial standard error of the final accuracy
    at the runs' eval_n (the mean accuracy), which every run's figure carries besides the
    seeds' spread."""
    accuracies = [r["accuracy_after"] for r in rows]
    eval_n = min(r["eval_n"] for r in rows)
    se = stats.binomial_se(statistics.fmean(accuracies), eval_n)
    return f"one run's accuracy on {eval_n} held-out problems has a binomial s.e. of {se:.3f}"


def grpo_vs_ppo(rows: Sequence[dict], a: str = "grpo", b: str = "ppo") -> list[Finding]:
    """Notebook 01's questions over paired seeds: does arm `a` gain more held-out accuracy
    than `b` (paired t of the per-seed gain differences, in points), does a `b` step take
    longer than an `a` step, and does `b`'s process need more memory (geometric mean of the
    per-seed ratios; memory is each run's process peak, one fresh process per run)."""
    gains = paired(rows, a, b, "gain")
    diff = stats.paired_interval([100 * g for g in gains[0]], [100 * g for g in gains[1]])
    note = accuracy_noise(rows)
    if diff.n >= 2:
        sd = statistics.stdev(100 * (x - y) for x, y in zip(*gains))
        note += (f"; at this spread ({sd:.1f} points) {diff.n} seeds detect a difference of "
                 f"{stats.min_detectable(sd, diff.n):.1f} points with 80% power")
    found = [finding(f"{a} gains more held-out accuracy than {b}",
                     f"gain({a}) - gain({b}), points", diff, above=0.0, note=note, digits=1)]
    step_b, step_a = paired(rows, b, a, "step_s")
    found.append(finding(f"a {b} step takes longer than a {a} step",
                         f"median step time, {b} / {a}", stats.ratio_interval(step_b, step_a),
                         above=1.0))
    mem_b, mem_a = paired(rows, b, a, "mem_mb")
    found.append(finding(f"{b}'s process needs more memory than {a}'s",
                         f"peak memory, {b} / {a}", stats.ratio_interval(mem_b, mem_a),
                         above=1.0))
    return found


def group_size_findings(rows: Sequence[dict]) -> list[Finding]:
    """Notebook 02's questions per budget, over paired seeds: does the largest G end with a
    higher held-out accuracy than the smallest (paired t, points), and does its step cost
    more (ratio of median step times)."""
    found = []
    for budget in dict.fromkeys(r["arm"].split("/")[0] for r in rows):
        members = [r for r in rows if r["arm"].startswith(budget + "/")]
        sizes = sorted({r["group_size"] for r in members})
        if len(sizes) < 2:
            continue
        small, large = f"{budget}/G={sizes[0]}", f"{budget}/G={sizes[-1]}"
        after = paired(members, large, small, "accuracy_after")
        found.append(finding(
            f"at an equal {_budget_words(budget)}, G={sizes[-1]} ends higher than G={sizes[0]}",
            f"accuracy(G={sizes[-1]}) - accuracy(G={sizes[0]}), points",
            stats.paired_interval([100 * x for x in after[0]], [100 * x for x in after[1]]),
            above=0.0, note=accuracy_noise(members), digits=1))
        steps = paired(members, large, small, "step_s")
        found.append(finding(
            f"at an equal {_budget_words(budget)}, a step at G={sizes[-1]} costs more than at "
            f"G={sizes[0]}", f"median step time, G={sizes[-1]} / G={sizes[0]}",
            stats.ratio_interval(*steps), above=1.0))
    return found


ARM_MEASURES = {
    "gain": ("gains more held-out accuracy than", "gain({arm}) - gain({base}), points", 100.0, 1),
    "length_final": ("ends with longer completions than",
                     "final completion length({arm}) - length({base}), tokens", 1.0, 1),
}
"""`arm_findings`' questions: row key -> (the claim's words, the measure, scale, digits)."""


def arm_findings(rows: Sequence[dict], baseline: str | None = None,
                 key: str = "gain") -> list[Finding]:
    """Notebook 05's question of each arm against `baseline` (default: the first arm), over
    paired seeds: is its `key` higher (ARM_MEASURES: `gain`, the held-out accuracy gained,
    in points; `length_final`, the mean completion length over the last fifth of the steps,
    in tokens), by the paired t interval of the per-seed differences."""
    if key not in ARM_MEASURES:
        raise ValueError(f"key must be one of {sorted(ARM_MEASURES)}, got {key!r}")
    words, measure, scale, digits = ARM_MEASURES[key]
    arms = list(by_arm(rows))
    baseline = baseline or arms[0]
    if baseline not in arms:
        raise ValueError(f"baseline {baseline!r} is not an arm; arms: {arms}")
    found = []
    for arm in arms:
        if arm == baseline:
            continue
        ours, theirs = paired(rows, arm, baseline, key)
        diff = stats.paired_interval([scale * x for x in ours], [scale * x for x in theirs])
        found.append(finding(f"{arm} {words} {baseline}", measure.format(arm=arm, base=baseline),
                             diff, above=0.0, digits=digits,
                             note=accuracy_noise(rows) if key == "gain" else ""))
    return found


def factor_findings(rows: Sequence[dict], arms: Mapping[str, Mapping]) -> list[Finding]:
    """The main effect of each factor of a factorial design of arms (`arms`: name -> its
    TrainConfig fields, as `labkit.lab.parse_arms` gives). A factor is a field that every arm
    sets to one of two values (fields that always change together, such as eps_low with
    eps_high, are one factor); its first level is the baseline's (the first arm's). For each
    factor: do fewer runs collapse at its other level (the collapse rate at the first level
    minus that at the other, over every run, Newcombe's interval), and does the other level
    gain more held-out accuracy (paired t over the pairs of runs on the same seed whose arms
    differ in this factor alone)."""
    names = list(arms)
    factors: dict[tuple, list[str]] = {}
    for field_name in (arms[names[0]] if names else {}):
        values = [arms[n].get(field_name, _MISSING) for n in names]
        if _MISSING in values or len(set(map(repr, values))) != 2:
            continue
        factors.setdefault(tuple(v == values[0] for v in values), []).append(field_name)
    found = []
    for levels, fields in factors.items():
        at_first = dict(zip(names, levels))
        first = ", ".join(f"{f}={arms[names[0]][f]}" for f in fields)
        other_arm = names[levels.index(False)]
        other = ", ".join(f"{f}={arms[other_arm][f]}" for f in fields)
        runs = {side: [r for r in rows if at_first.get(r["arm"]) is side] for side in (True, False)}
        k1, n1 = sum(r["collapsed"] for r in runs[True]), len(runs[True])
        k2, n2 = sum(r["collapsed"] for r in runs[False]), len(runs[False])
        if n1 and n2:
            found.append(finding(f"fewer runs collapse with {other} than with {first}",
                                 f"collapse rate({first}) - rate({other})",
                                 stats.proportion_difference(k1, n1, k2, n2), above=0.0))
        ours, theirs = _factor_pairs(rows, arms, fields, at_first)
        if ours:
            found.append(finding(
                f"{other} gains more held-out accuracy than {first}",
                f"gain({other}) - gain({first}), points, over pairs of runs differing in it alone",
                stats.paired_interval([100 * g for g in ours], [100 * g for g in theirs],
                                      unit="paired runs"), above=0.0, digits=1))
    return found


_MISSING = object()


def _factor_pairs(rows: Sequence[dict], arms: Mapping[str, Mapping], fields: Sequence[str],
                  at_first: Mapping[str, bool]) -> tuple[list[float], list[float]]:
    """The gains of (other level, first level) over the pairs of runs on one seed whose arms
    differ in `fields` alone."""
    grouped = by_arm(rows)

    def rest(name: str) -> dict:
        return {k: v for k, v in arms[name].items() if k not in fields}

    ours, theirs = [], []
    for a in arms:
        for b in arms:
            if at_first[a] or not at_first[b] or rest(a) != rest(b):
                continue
            for seed in sorted(set(grouped.get(a, {})) & set(grouped.get(b, {}))):
                ours.append(grouped[a][seed]["gain"])
                theirs.append(grouped[b][seed]["gain"])
    return ours, theirs


MONITORS = ("adv/gav>0.4 for 5", "clip/total>0.2 for 5", "policy/entropy<1 for 5",
            "eval/cgc>=0.15")
"""The source articles' danger lines for the monitoring metrics (docs/metrics.md), as stop
rules (`labkit.stops`): GAV above 0.4, a clip ratio above 20%, entropy below 1 nat (each on 5
consecutive steps, so one noisy step does not count), CGC at or above 0.15 at an
evaluation."""


def monitor_findings(rows: Sequence[dict], histories: Mapping[str, Sequence[dict]],
                     monitors: Sequence[str] = MONITORS) -> list[Finding]:
    """Do the monitoring lines warn of a collapse? For each rule of `monitors` over the runs
    of `rows` (each with `collapsed` and `collapse_step`, `histories` by run name): the share
    of collapsing runs where it fired before the collapse step (the claim: most, above 0.5),
    and the share of the other runs where it fired at all (false alarms: the claim needs
    few, below 0.5); Clopper-Pearson intervals. A share over no runs is left out."""
    from labkit import stops

    found = []
    for text in monitors:
        (rule,) = stops.parse(text)
        warned = [_fires(rule, histories[r["run"]], before=r.get("collapse_step"))
                  for r in rows if r["collapsed"]]
        false = [_fires(rule, histories[r["run"]]) for r in rows if not r["collapsed"]]
        if warned:
            found.append(finding(f"{rule} fires before a collapse",
                                 "share of collapsing runs where it fired first",
                                 stats.proportion_interval(sum(warned), len(warned)),
                                 above=0.5))
        if false:
            found.append(finding(f"{rule} stays quiet on runs that do not collapse",
                                 "share of the other runs where it fired (false alarms)",
                                 stats.proportion_interval(sum(false), len(false)),
                                 below=0.5))
    return found


def _fires(rule, history: Sequence[dict], before: int | None = None) -> bool:
    """Whether `rule` fires on `history` (at a step before `before`, when given)."""
    from labkit import stops

    watch = stops.StopRules([rule])
    for record in history:
        if before is not None and record.get("step", 0) >= before:
            return False
        if watch.update(record) is not None:
            return True
    return False


def diagnostic_findings(rows: Sequence[dict],
                        histories: Mapping[str, Sequence[dict]]) -> list[Finding]:
    """Which baseline gives the cleaner gradient, from the PPO runs that measured estimator
    diagnostics (`diag_every`; labkit.diagnostics: every estimator on the same samples of
    the run's policy): per run the ratio of the critic's figure to the group mean's, at the
    first and at the last measurement, over runs (geometric mean, t interval of log ratios).
    Raw gradients (no std scaling, no whitening) compare the baselines themselves; the
    trained ones the advantages each algorithm trains with (PPO: GAE, whitened; GRPO: the
    group's z-score), against the article's "63% lower variance" (a ratio of 1/0.37)."""
    keys = {"raw": ("diag/grad_rel_var_raw/ppo_critic", "diag/grad_rel_var_raw/grpo"),
            "trained": ("diag/grad_rel_var/ppo_gae", "diag/grad_rel_var/grpo"),
            "mse": ("diag/baseline_mse/ppo_critic", "diag/baseline_mse/grpo")}
    measured = {}
    for row in rows:
        records = [r for r in histories[row["run"]] if all(k in r for pair in keys.values()
                                                           for k in pair)]
        if row.get("algo") == "ppo" and len(records) >= 2:
            measured[row["run"]] = (records[0], records[-1])
    if len(measured) < 2:
        return []
    first = min(a["step"] for a, _ in measured.values())
    last = min(b["step"] for _, b in measured.values())

    def ratio(key: str, at: int) -> stats.Interval:
        a, b = keys[key]
        pairs = [(rec[a], rec[b]) for both in measured.values() for rec in both[at:at + 1]]
        return stats.ratio_interval([x for x, _ in pairs], [y for _, y in pairs], unit="runs")

    relvar = "gradient relative variance"
    return [
        finding(f"at step {first} the group mean is a cleaner baseline than the critic",
                f"{relvar}, raw, critic / group mean", ratio("raw", 0), above=1.0),
        finding(f"at step {last} the group mean is a cleaner baseline than the critic",
                f"{relvar}, raw, critic / group mean", ratio("raw", 1), above=1.0),
        finding(f"at step {last} GRPO's advantages give a gradient with 63% less variance "
                "than PPO's", f"{relvar}, as trained, PPO (GAE) / GRPO", ratio("trained", 1),
                above=1 / 0.37),
        finding(f"at step {last} the group mean is nearer the true value than the critic",
                "baseline MSE against V*, critic / group mean", ratio("mse", 1), above=1.0),
    ]


def informative_findings(rows: Sequence[dict], histories: Mapping[str, Sequence[dict]],
                         prediction: Mapping[int, Mapping], first_steps: int = 3) -> list[Finding]:
    """Notebook 02's check of the independence prediction (`prediction`, from
    `labkit.lab.informative_prediction` at the untrained policy): per G, the share of
    informative groups seen in each run's first `first_steps` steps (1 - frac_zero_std, the
    policy still close to its start) against the prediction from each prompt's own p and
    against the formula at the mean p, in points, t-interval over seeds. The articles'
    formula at the mean p is claimed here to overstate the share (above 0); the per-prompt
    prediction is the one that should hold (an interval around 0)."""
    observed: dict[int, list[float]] = {}
    for row in rows:
        seen = [1 - r["rollout/frac_zero_std"] for r in histories[row["run"]]
                if 1 <= r.get("step", 0) <= first_steps and "rollout/frac_zero_std" in r]
        if seen and row["group_size"] in prediction:
            observed.setdefault(row["group_size"], []).append(statistics.fmean(seen))
    found = []
    for g, shares in sorted(observed.items()):
        for key, words in (("at_mean", "the formula at the mean p"),
                           ("per_prompt", "the prediction from each prompt's own p")):
            predicted = prediction[g][key]
            found.append(finding(
                f"at G={g}, {words} overstates the share of informative groups",
                f"predicted - seen in steps 1-{first_steps}, points (predicted "
                f"{100 * predicted:.1f})",
                stats.mean_interval([100 * (predicted - x) for x in shares]), above=0.0,
                digits=1))
    return found


QUESTIONS = ("gain", "length", "collapse", "monitors", "diagnostics")
"""What notebook 05 asks of its runs (its `questions` parameter)."""


def answer(questions: Sequence[str], rows: Sequence[dict],
           histories: Mapping[str, Sequence[dict]], arms: Mapping[str, Mapping],
           baseline: str | None = None) -> list[Finding]:
    """Notebook 05's findings for `questions` (QUESTIONS), in that order: gain and length
    against the baseline (`arm_findings`), collapse (`factor_findings`), monitors
    (`monitor_findings`), diagnostics (`diagnostic_findings`)."""
    unknown = [q for q in questions if q not in QUESTIONS]
    if unknown:
        raise ValueError(f"questions: {unknown} unknown; choose from {QUESTIONS}")
    found = []
    for q in questions:
        if q in ("gain", "length"):
            found += arm_findings(rows, baseline, "gain" if q == "gain" else "length_final")
        elif q == "collapse":
            found += factor_findings(rows, arms)
        elif q == "monitors":
            found += monitor_findings(rows, histories)
        else:
            found += diagnostic_findings(rows, histories)
    return found


def _budget_words(budget: str) -> str:
    return "sample budget" if budget == "samples" else "prompt count"


def describe_findings(findings: Sequence[Finding]) -> str:
    """One sentence per finding: the claim, its verdict, the effect with its interval and
    method, and its note."""
    sentences = []
    for f in findings:
        side = "above" if f.direction == "above" else "below"
        text = (f"'{f.question}': {f.verdict} ({f.measure} = {f.interval.format(f.digits)}, "
                f"95% {f.interval.method}; the claim needs it {side} {f.threshold:g})")
        sentences.append(text + (f"; {f.note}." if f.note else "."))
    return " ".join(sentences)


def findings_summary(findings: Sequence[Finding]) -> dict:
    """summary.json's entries for the findings: finding<k>/{question, measure, verdict, mean,
    low, high, seeds, method, threshold, direction} (low and high only where there is an
    interval); `labkit.lab.findings` reads them back."""
    out = {}
    for k, f in enumerate(findings, 1):
        out |= {f"finding{k}/question": f.question, f"finding{k}/measure": f.measure,
                f"finding{k}/verdict": f.verdict, f"finding{k}/mean": f.interval.mean,
                f"finding{k}/seeds": f.interval.n, f"finding{k}/method": f.interval.method,
                f"finding{k}/threshold": f.threshold, f"finding{k}/direction": f.direction}
        if math.isfinite(f.interval.low):  # one seed has no interval
            out |= {f"finding{k}/low": f.interval.low, f"finding{k}/high": f.interval.high}
    return out
