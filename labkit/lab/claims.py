"""A claim's result and its verdict: what its finished runs found, decided once by the
primary measure its `preregistered:` block names.

`ClaimResult` holds a claim sweep's findings and per-seed record; `claim_verdict` decides
it: from the per-seed record where the measure is one of PER_SEED_MEASURES (paired by
seed; every arm against a baseline, each from its own paired differences, Bonferroni), else from the findings its
`finding:` words pick (`labkit.lab.findings` collects them, `labkit.lab.findings_page`
writes the page).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from labkit.formulas import stats, stats_design
from labkit.lab import preregistration
from labkit.lab.verdicts import collapse_verdict, collapsed_on


@dataclass
class ClaimResult:
    """What the finished runs of one claim sweep found."""

    file: Path
    claim: dict
    rows: list[dict] = field(default_factory=list)
    machines: set[str] = field(default_factory=set)
    commits: set[str] = field(default_factory=set)
    runs_done: int = 0
    runs_total: int = 0
    compute_s: float = 0.0
    elapsed_s: float = 0.0
    """Wall time of the sweep's notebook runs (papermill's duration), the time a user waits."""
    records: list[dict] = field(default_factory=list)
    """The per-seed record: one row per training run (sweep run, arm, seed and every figure
    its notebook summarised), from the finished runs or, without them, the claim file's CSV
    (`write_records`)."""
    replication: tuple[int, ...] = ()
    """For the replication of a claim (its file's `replication:` seeds, never run for the
    original): those first seeds; () for the original."""
    confirmatory: bool = False
    """The claim's confirmatory run (its file's `confirmatory:` stage, at reserved seeds and
    its own plan's looks), read apart from the exploratory runs."""
    not_run: str | None = None
    """Why the claim was not run on the model, task or device a `--set` named
    (labkit.lab.retarget); None where it was, or nothing was set."""
    changed_settings: dict = field(default_factory=dict)
    """A confirmatory run's settings that differ from its exploratory runs' (a `tuned` file,
    say): name -> value; {} where none differs."""
    stored: bool = False
    """Its record and findings were read back from the CSVs (its runs are gone): the page
    leaves those files as they are rather than writing them again."""
    changed: str | None = None
    """Why a claim whose plan was frozen at its first confirmatory run reads as exploratory
    (labkit.lab.confirm.changed_since_frozen); None where it does not."""
    looks: tuple[int, ...] | None = None
    """The looks the claim is read at where not its plan's (`plan_of`): a replication is
    read once, at all its seeds."""

    @property
    def record_name(self) -> str:
        """The per-seed CSV's file name: <claim file>.csv, <claim file>-replication.csv,
        <claim file>-confirmatory.csv."""
        return f"{self.file.stem}{self.stage_suffix}.csv"

    @property
    def stage_suffix(self) -> str:
        """'', '-replication' or '-confirmatory': which run of its claim file this is."""
        return ("-confirmatory" if self.confirmatory
                else "-replication" if self.replication else "")

    @property
    def order(self) -> int:
        """0 exploratory, 1 its replication, 2 confirmatory: where it sorts beside its claim."""
        return 2 if self.confirmatory else 1 if self.replication else 0


NOT_MEASURED = "not measured yet"
NOT_TESTABLE = "not testable here"
"""The verdict of a claim whose measure could not move here: its positive control
(`preregistered.control`) did not move it, or none was run; never `refuted`."""
PER_SEED = "needs the per-seed record"


@dataclass(frozen=True)
class ClaimVerdict:
    """A claim decided by its preregistered primary measure (labkit.lab.preregistration)."""

    test: str
    """The preregistered test in words."""
    figure: str
    """The decisive figure with its interval, or why there is none."""
    verdict: str
    mde: str = ""
    """For a finding's interval: the smallest effect its seeds detect with 80% power; for an
    undecided claim read from its per-seed record: the seeds its observed effect needs."""


def claim_verdict(result: ClaimResult) -> ClaimVerdict:
    """The claim-level verdict (`_verdict`), where its measure needs a positive control
    (preregistration.NEEDS_CONTROL) read beside the control: a claim the runs support keeps
    its verdict (the measure moved); otherwise, unless the control moved its measure past
    its margin, the claim is `NOT_TESTABLE` with the reason, never refuted. The control's
    interval is shown with the figure."""
    prereg = preregistration.check(result.claim, result.file.name, check_arms=False)
    decided = _verdict(result, prereg)
    if prereg.measure not in preregistration.NEEDS_CONTROL and prereg.control is None:
        return decided
    control = prereg.control
    if control is None:
        if decided.verdict == stats.SUPPORTED:
            return decided
        return ClaimVerdict(decided.test, f"{decided.figure}; no positive control was run",
                            NOT_TESTABLE)
    test = f"{decided.test}; control: {control.describe()}"
    found = (_from_records(control.as_preregistration(prereg.seeds), result.records,
                           result.looks) if result.records else None)
    if found is None:
        return ClaimVerdict(test, f"{decided.figure}; control not run yet",
                            stats.INCONCLUSIVE if decided.verdict != stats.SUPPORTED
                            else decided.verdict)
    figure, verdict, _ = found
    shown = f"{decided.figure}; control {figure.split('; ')[0]}"  # its interval; its look as the claim's
    if verdict == stats.SUPPORTED or decided.verdict == stats.SUPPORTED:
        return ClaimVerdict(test, shown, decided.verdict, decided.mde)
    return ClaimVerdict(test, f"{shown}, not past its margin {control.margin:g}: this "
                        "setting cannot move the measure", NOT_TESTABLE)


def _verdict(result: ClaimResult, prereg: preregistration.Preregistration) -> ClaimVerdict:
    """The claim-level verdict: the preregistered primary measure read by
    `labkit.formulas.stats_design.decide` from the findings whose question holds the preregistered `finding`
    words and the compared arms. Several such findings (one per G, say) must each support
    the claim for it to be supported, and refute it if any refutes it. Every arm against a
    baseline (`compare: [all, ...]`) is decided from the per-seed values arm by arm (Bonferroni),
    which the stored intervals cannot give."""
    test = prereg.describe()
    within = PER_SEED_MEASURES.get(prereg.measure, ("", 0, ""))[2] in ("within", "change",
                                                                         "level")
    if prereg.measure in PER_SEED_MEASURES and (prereg.compare or within) and result.records:
        decided = _from_records(prereg, result.records, result.looks)
        if decided is not None:
            figure, verdict, more = decided
            return ClaimVerdict(test, figure, verdict, more)
    if prereg.compare[:1] == ("all",):
        return ClaimVerdict(test, f"{PER_SEED} (every arm against {prereg.compare[1]}, "
                                  "Bonferroni)", stats.INCONCLUSIVE)
    words = [prereg.finding] if prereg.finding else []
    rows = [row for row in _within_plan(result.rows, result.records,
                                        plan_of(prereg, result.looks).looks[-1])
            if all(w in row["question"] for w in words + list(prereg.compare))]
    if not words and not prereg.compare or not rows:
        return ClaimVerdict(test, NOT_MEASURED, stats.INCONCLUSIVE)
    verdicts, figures, mdes = [], [], []
    for row in rows:
        interval = stats.Interval(row["mean"], _nan(row["low"]), _nan(row["high"]),
                                  row["seeds"], row["method"])
        verdicts.append(prereg.decide(interval))
        figures.append(f"{row['question']}: {row['effect']}")
        mde = _mde(interval)
        if mde is not None:
            mdes.append(f"{mde:.3g}")
    if all(v == stats.SUPPORTED for v in verdicts):
        verdict = stats.SUPPORTED
    elif stats.REFUTED in verdicts:
        verdict = stats.REFUTED
    else:
        verdict = stats.INCONCLUSIVE
    shown = figures if len(figures) <= SHOWN else figures[:SHOWN] + [
        f"and {len(figures) - SHOWN} more on the claim file's page"]
    return ClaimVerdict(test, "; ".join(shown), verdict, ", ".join(mdes))


SHOWN = 2
"""A claim decided by several findings shows this many of their figures at a glance; every
one is on its file's page."""


PER_SEED_MEASURES = {"gain": ("gain", 100.0, "difference"),
                     "final_length": ("length_final", 1.0, "difference"),
                     "final_length_correct": ("length_correct_final", 1.0, "difference"),
                     "final_length_incorrect": ("length_incorrect_final", 1.0, "difference"),
                     "memory_ratio": ("mem_mb", 1.0, "ratio"),
                     "tensor_memory_ratio": ("tensor_peak_mb", 1.0, "ratio"),
                     "step_time_ratio": ("step_s", 1.0, "ratio"),
                     "collapse_difference": ("collapsed", 1.0, "binary"),
                     "grad_rel_var_ratio": (("diag.grad_rel_var_raw.ppo_critic",
                                             "diag.grad_rel_var_raw.rloo"), 1.0, "within"),
                     "critic_error_growth": (("credit.critic_err_s3", "credit.critic_err_s1"),
                                             1.0, "within"),
                     "length_change": (("length_final", "length_start"), 1.0, "change"),
                     "early_length_rate": ("length_rate_early", 1.0, "difference"),
                     "early_length_rate_incorrect": ("length_incorrect_rate_early", 1.0,
                                                     "difference"),
                     "early_steps_rate": ("steps_rate_early", 1.0, "difference"),
                     "final_steps": ("steps_final", 1.0, "difference"),
                     "worked_change": (("worked_final", "worked_start"), 1.0, "change"),
                     "update_cosine": (("grpo_cosine", None), 1.0, "level")}
"""The primary measures a claim's per-seed record decides: measure -> (the record's
figure, its scale (gain in points), how two arms compare); a "within" measure is the ratio
of two figures of one run (numerator, denominator), a "change" measure their difference
(end minus start), a "level" measure the first figure itself, over the seeds of the
compared arm (or of the record's one arm)."""


def _table(records: list[dict], key: str, scale: float) -> dict[str, dict[int, float]]:
    """arm -> seed -> scale * the figure `key`, for the records that have it."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]):
            out.setdefault(r["arm"], {})[r["seed"]] = scale * r[key]
    return out


def _arm(table: dict, name: str) -> str | None:
    """The record's arm that a preregistered name means ('G=4' is 'samples/G=4')."""
    return next((a for a in table if a == name or a.endswith("/" + name)), None)


def _within_plan(rows: list[dict], records: list[dict], planned: int) -> list[dict]:
    """The finding rows of the sweep runs whose seeds lie within the claim's planned ones
    (the first `planned` seeds of its record): a file that ran more looks for another of its
    claims does not lend them to this one. A row of no one run ('seed=N' names a run by its
    first seed) is kept."""
    seeds = sorted({int(r["seed"]) for r in records})
    if len(seeds) <= planned:
        return rows
    kept = set(seeds[:planned])

    def inside(row: dict) -> bool:
        run = str(row.get("run") or "")
        first = run.removeprefix("seed=")
        return not (run.startswith("seed=") and first.isdigit()) or int(first) in kept

    return [row for row in rows if inside(row)]


def plan_of(prereg, looks: tuple[int, ...] | None = None) -> stats_design.SequentialPlan:
    """The looks a claim is read at: every 5 seeds up to the seeds it plans (5, 10 for 10),
    the error rate spent over them (`stats_design.SequentialPlan`); `looks` where given instead."""
    if looks is None:
        looks = tuple(range(5, prereg.seeds, 5)) + (prereg.seeds,)
    return stats_design.SequentialPlan(looks)


def _from_records(prereg, records: list[dict], looks: tuple[int, ...] | None = None
                  ) -> tuple[str, str, str] | None:
    """(figure, verdict, what more seeds would do) of the primary measure from the per-seed
    record, read at each look of the claim's plan that its seeds reach and stopped at the
    first decided one; None where the record lacks the compared arms."""
    key, scale, kind = PER_SEED_MEASURES[prereg.measure]
    if kind in ("within", "change", "level"):
        return _within(prereg, records, *key, looks=looks, change=kind == "change")
    table = _table(records, key, scale)
    if all(c.endswith("*") for c in prereg.compare):
        return _over_grid(prereg, table, kind)
    base = _arm(table, prereg.compare[1])
    every = prereg.compare[0] == "all"
    arm = None if every else _arm(table, prereg.compare[0])
    if base is None or (not every and arm is None):
        return None
    arms = list(table) if every else [base, arm]
    seeds = sorted(set.intersection(*(set(table[a]) for a in arms)))
    plan = plan_of(prereg, looks)
    if len(seeds) < plan.looks[0]:
        return (f"{len(seeds)} shared seeds, short of the first look's {plan.looks[0]}",
                stats.INCONCLUSIVE, "")

    def read(n: int, k: int) -> tuple[str, tuple[str, stats.Interval]]:
        first, level = seeds[:n], plan.confidence(k, prereg.direction)
        if every:
            figure, verdict, interval = _every_arm(prereg, table, base, first, level)
            return verdict, (figure, interval)
        verdict, interval, exact = _decide_pair(
            prereg, kind, [table[arm][s] for s in first], [table[base][s] for s in first],
            level, _gain_floor(records, prereg.measure))
        return verdict, (f"{arm} vs {base}: {interval.format(2)}{exact}", interval)

    k, verdict, (figure, interval) = plan.run(len(seeds), read)
    planned = seeds[:plan.looks[-1]]
    fell = collapsed_on(records, base, planned)[0] if kind == "difference" else 0
    if fell:  # a collapsed comparator decides nothing, better or worse, at any look
        verdict = collapse_verdict(fell, len(planned))
    look = (f"{plan.looks[k]} seeds, look {k + 1} of {len(plan.looks)} at "
            f"{100 * interval.confidence:.2f}% ({interval.method})")
    more = ""
    if verdict == stats.INCONCLUSIVE and kind == "difference" and not every:
        needed = stats_design.seeds_needed(interval, prereg.threshold)
        more = f"about {needed} seeds" if needed else ""
    return f"{figure}; {look}", verdict, more


def _over_grid(prereg, table: dict, kind: str) -> tuple[str, str, str] | None:
    """`compare: [grpo-*, dpo-*]`: every arm named by the first prefix against the arm of the
    second prefix with the same rest of its name (grpo-lr1e-3 against dpo-lr1e-3), paired by
    setting and seed, one interval over all the pairs at 95% (for a binary measure the exact
    paired test); None where no setting has both."""
    mine, theirs = (c[:-1] for c in prereg.compare)
    a, b, settings = [], [], []
    for arm in sorted(table):
        if not arm.startswith(mine) or (theirs + arm[len(mine):]) not in table:
            continue
        other = table[theirs + arm[len(mine):]]
        seeds = sorted(set(table[arm]) & set(other))
        a += [table[arm][s] for s in seeds]
        b += [other[s] for s in seeds]
        settings.append(arm[len(mine):])
    if not a:
        return None
    if len(a) < 2:
        return (f"{len(a)} paired run, too few", stats.INCONCLUSIVE, "")
    verdict, interval, exact = _decide_pair(prereg, kind, a, b, 0.95, 0.0, "pairs")
    figure = (f"{prereg.compare[0]} vs {prereg.compare[1]} over {len(settings)} settings "
              f"({', '.join(settings)}), {len(a)} pairs: {interval.format(2)} "
              f"({interval.method}){exact}")
    return figure, verdict, ""


def _within(prereg, records: list[dict], top: str, bottom: str,
            looks: tuple[int, ...] | None = None, change: bool = False
            ) -> tuple[str, str, str] | None:
    """A ratio of two figures of each run (`top` / `bottom`), over seeds: the log-ratio t
    interval; with `change`, their difference (`top` - `bottom`): the paired t interval;
    with `bottom` None, `top` itself: the t interval of its mean; read at the looks of the
    claim's plan. The arm is the compared one, or the record's only arm; None where the
    record lacks the figures."""
    def has(r: dict) -> bool:
        return top in r and (bottom is None or bottom in r)

    arms = sorted({r["arm"] for r in records if has(r)})
    arm = prereg.compare[0] if prereg.compare else (arms[0] if len(arms) == 1 else None)
    pairs = {r["seed"]: (r[top], r[bottom] if bottom is not None else None) for r in records
             if r["arm"] == arm and has(r)}
    if arm is None or not pairs:
        return None
    seeds = sorted(pairs)
    plan = plan_of(prereg, looks)
    if len(seeds) < plan.looks[0]:
        return (f"{len(seeds)} seeds, short of the first look's {plan.looks[0]}",
                stats.INCONCLUSIVE, "")

    def read(n: int, k: int) -> tuple[str, tuple[str, stats.Interval]]:
        first, level = seeds[:n], plan.confidence(k, prereg.direction)
        if bottom is None:
            interval = stats.mean_interval([pairs[s][0] for s in first], level)
            return prereg.decide(interval), (f"{arm}: {top.split('.')[-1]} "
                                             f"{interval.format(2)}", interval)
        compare = stats.paired_interval if change else stats.ratio_interval
        interval = compare([pairs[s][0] for s in first], [pairs[s][1] for s in first], level)
        sign = "-" if change else "/"
        return prereg.decide(interval), (f"{arm}: {top.split('.')[-1]} {sign} "
                                         f"{bottom.split('.')[-1]} {interval.format(2)}",
                                         interval)

    k, verdict, (figure, interval) = plan.run(len(seeds), read)
    return (f"{figure}; {plan.looks[k]} seeds, look {k + 1} of {len(plan.looks)} at "
            f"{100 * interval.confidence:.2f}% ({interval.method})", verdict, "")


def _decide_pair(prereg, kind: str, a: list[float], b: list[float], level: float,
                 floor: float, unit: str = "seeds") -> tuple[str, stats.Interval, str]:
    """(verdict, interval, the exact test's words) of one paired comparison: a binary one is
    decided with McNemar's exact test confirming the interval (`stats_design.decide_binary`)."""
    if kind != "binary":
        interval = (stats.ratio_interval(a, b, level) if kind == "ratio"
                    else stats.paired_interval(a, b, level, sd_floor=floor))
        return prereg.decide(interval), interval, ""
    found = stats_design.paired_binary([x > 0.5 for x in a], [y > 0.5 for y in b], level,
                                       unit)
    up, down = stats_design.exact_sides(found.only_a, found.only_b)
    side = down if prereg.direction == "below" else up
    words = (f"; exact one-sided p {side:.3g} (a side may spend "
             f"{(1 - found.interval.confidence) / 2:.3g})")
    verdict = stats_design.decide_binary(found, prereg.direction, prereg.threshold,
                                         prereg.margin)
    return verdict, found.interval, words


def _gain_floor(records: list[dict], measure: str) -> float:
    """The least spread of a per-seed gain difference, in points: the held-out evaluation's
    own binomial noise on both arms, sqrt(2) * sqrt(p (1 - p) / eval_n)."""
    if measure != "gain":
        return 0.0
    found = [(r["accuracy_after"], r["eval_n"]) for r in records
             if isinstance(r.get("accuracy_after"), (int, float)) and r.get("eval_n")]
    if not found:
        return 0.0
    p = sum(a for a, _ in found) / len(found)
    return 100 * math.sqrt(2) * stats.binomial_se(p, int(min(n for _, n in found)))


def _every_arm(prereg, table: dict, base: str, seeds: list[int],
               level: float) -> tuple[str, str, stats.Interval]:
    """Every arm against `base` on `seeds`, each from its own paired differences
    (`stats_design.paired_vs_one`: Bonferroni's simultaneous intervals at `level`, no spread
    pooled across arms): the claim that some arm differs (two-sided) or lies above or below
    holds when one arm's simultaneous interval does; it is refuted when every arm's refutes
    it."""
    shared = {arm: {s: values[s] for s in seeds} for arm, values in table.items()}
    found = stats_design.paired_vs_one(shared, base, confidence=level)
    verdicts = {c.arm: prereg.decide(c.interval) for c in found}
    if stats.SUPPORTED in verdicts.values():
        verdict = stats.SUPPORTED
    elif all(v == stats.REFUTED for v in verdicts.values()):
        verdict = stats.REFUTED
    else:
        verdict = stats.INCONCLUSIVE
    # shown: a supporting arm, else the arm nearest to supporting a one-sided claim (the
    # highest low end above, the lowest high end below), else the largest effect
    if prereg.direction == "above":
        top = max(found, key=lambda c: c.interval.low)
    elif prereg.direction == "below":
        top = min(found, key=lambda c: c.interval.high)
    else:
        top = max(found, key=lambda c: abs(c.interval.mean - prereg.threshold))
    shown = next((c for c in found if verdicts[c.arm] == stats.SUPPORTED), top)
    return (f"{len(found)} arms vs {base}, Bonferroni; {shown.arm}: {shown.interval.format(2)}",
            verdict, shown.interval)


def _nan(value) -> float:
    return math.nan if value is None else float(value)


def _mde(interval: stats.Interval) -> float | None:
    """The smallest difference `stats.min_detectable` finds at the interval's seeds, from the
    spread its t interval implies (half-width = t sd / sqrt(n)); None for another kind."""
    method = interval.method
    linear_t = ("paired t" in method or method.startswith("t-interval")) and "log" not in method
    sd = stats_design.implied_sd(interval) if linear_t else None
    return None if sd is None else stats.min_detectable(sd, interval.n, interval.confidence)
