"""From runs over paired seeds to answers: each arm's figures with 95% intervals, and a
verdict per question (`labkit.formulas.stats`).

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
from collections.abc import Sequence
from dataclasses import dataclass, replace

from labkit.formulas import stats

FIGURES = ("accuracy_before", "accuracy_after", "gain", "accuracy_auc", "final_reward",
           "step_s", "mem_mb", "state_mb", "wall_s")
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
    t-interval, 'mean [low, high]' (the mean alone for one seed); where the rows say which
    runs collapsed, collapse apart from learning: `collapsed`, k of n runs with the
    Clopper-Pearson interval of the rate, and `gain_kept`, the gain over the runs that did
    not collapse."""
    out = []
    for arm, seeds in by_arm(rows).items():
        row = {"arm": arm, "seeds": len(seeds)}
        for key in FIGURES:
            values = [r[key] for r in seeds.values()
                      if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if len(values) == len(seeds):
                row[key] = _shown(stats.mean_interval(values), digits)
        if all("collapsed" in r for r in seeds.values()):
            fell = sum(int(r["collapsed"]) for r in seeds.values())
            rate = stats.proportion_interval(fell, len(seeds))
            row["collapsed"] = f"{fell}/{len(seeds)} [{rate.low:.2f}, {rate.high:.2f}]"
            kept = [r["gain"] for r in seeds.values() if not r["collapsed"] and "gain" in r]
            if kept:
                row["gain_kept"] = _shown(stats.mean_interval(kept), digits)
        out.append(row)
    return out


def _shown(interval: stats.Interval, digits: int) -> str:
    return f"{interval.mean:.{digits}f}" if interval.n == 1 else interval.format(digits)


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


def collapsed_on(rows: Sequence[dict], arm: str,
                 seeds: Sequence[int] | None = None) -> tuple[int, int]:
    """(runs of `arm` that collapsed, runs of `arm` that say), from the rows' `collapsed`: the
    arm by its name or the one it ends ('G=4' is 'samples/G=4'), on `seeds` where given."""
    said = [r for r in rows if (r["arm"] == arm or str(r["arm"]).endswith("/" + arm))
            and "collapsed" in r and (seeds is None or r["seed"] in seeds)]
    return sum(r["collapsed"] > 0.5 for r in said), len(said)


def comparator_collapsed(rows: Sequence[dict], found: Finding, comparator: str) -> Finding:
    """`found` with its verdict replaced by 'comparator collapsed on k of n seeds' where the
    arm it is compared against collapsed on any seed: a collapsed comparator makes the
    comparison say nothing of the arm, better or worse."""
    k, n = collapsed_on(rows, comparator)
    if not k:
        return found
    return replace(found, verdict=collapse_verdict(k, n),
                   note=(found.note + "; " if found.note else "") + f"{comparator} collapsed "
                        f"on {k} of {n} seeds: no verdict")


def collapse_verdict(k: int, n: int) -> str:
    return f"comparator collapsed on {k} of {n} seeds"


def grpo_vs_ppo(rows: Sequence[dict], a: str = "grpo", b: str = "ppo") -> list[Finding]:
    """Notebook 01's questions over paired seeds: does arm `a` gain more held-out accuracy
    than `b` (paired t of the per-seed gain differences, in points), does a `b` step take
    longer than an `a` step, and does `b` need more memory (`memory_finding`: geometric mean
    of the per-seed ratios of the tensors' peaks)."""
    gains = paired(rows, a, b, "gain")
    diff = stats.paired_interval([100 * g for g in gains[0]], [100 * g for g in gains[1]])
    note = accuracy_noise(rows)
    if diff.n >= 2:
        sd = statistics.stdev(100 * (x - y) for x, y in zip(*gains))
        note += (f"; at this spread ({sd:.1f} points) {diff.n} seeds detect a difference of "
                 f"{stats.min_detectable(sd, diff.n):.1f} points with 80% power")
    found = [comparator_collapsed(rows, finding(
        f"{a} gains more held-out accuracy than {b}", f"gain({a}) - gain({b}), points", diff,
        above=0.0, note=note, digits=1), b)]
    step_b, step_a = paired(rows, b, a, "step_s")
    found.append(finding(f"a {b} step takes longer than a {a} step",
                         f"median step time, {b} / {a}", stats.ratio_interval(step_b, step_a),
                         above=1.0))
    found.append(memory_finding(rows, a, b))
    return found


def memory_finding(rows: Sequence[dict], a: str, b: str) -> Finding:
    """Does `b` need more memory than `a`: the ratio of the tensors' peaks
    (`tensor_peak_mb`, what the training holds) over paired seeds, with the processes'
    peak ratio as context; rows without the tensors' peak (runs with tensor_peak_step 0, or
    older runs) are asked about their processes' peak (`mem_mb`), which is mostly the
    interpreter and its libraries."""
    process = stats.ratio_interval(*paired(rows, b, a, "mem_mb"))
    if not all("tensor_peak_mb" in r for r in rows if r["arm"] in (a, b)):
        return finding(f"{b}'s process needs more memory than {a}'s",
                       f"peak memory, {b} / {a}", process, above=1.0)
    tensors = stats.ratio_interval(*paired(rows, b, a, "tensor_peak_mb"))
    return finding(f"{b} needs more memory than {a}", f"peak tensor memory, {b} / {a}",
                   tensors, above=1.0,
                   note=f"the processes' peaks, for context: {process.mean:.2f}x "
                        f"[{process.low:.2f}, {process.high:.2f}]")


def algo_findings(rows: Sequence[dict], base: str = "grpo") -> list[Finding]:
    """Notebook 01's questions (`grpo_vs_ppo`) of `base` against every other arm, in the
    order the arms first appear: grpo against ppo, then against dpo, ... ([] without `base`
    or another arm). Each comparison is its own question at 95%: with several arms, read
    them as separate answers, not as one family."""
    arms = list(by_arm(rows))
    if base not in arms:
        return []
    return [f for arm in arms if arm != base for f in grpo_vs_ppo(rows, base, arm)]


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
        found.append(comparator_collapsed(rows, finding(
            f"{arm} {words} {baseline}", measure.format(arm=arm, base=baseline), diff,
            above=0.0, digits=digits, note=accuracy_noise(rows) if key == "gain" else ""),
            baseline))
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
                f"{100 * f.interval.confidence:.3g}% {f.interval.method}; the claim needs "
                f"it {side} {f.threshold:g})")
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
