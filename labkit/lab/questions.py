"""Notebook 05's further questions of its runs, besides each arm's gain and length
(`labkit.lab.verdicts.arm_findings`): collapses per factor of a factorial design of arms,
whether the articles' monitoring lines warn of a collapse, which baseline gives the cleaner
gradient (from estimator diagnostics), and notebook 02's check of the independence
prediction. `answer` asks the ones a notebook's `questions` parameter names.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from labkit.formulas import stats
from labkit.lab.verdicts import Finding, arm_findings, by_arm, finding
from labkit.run import stops


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
rules (`labkit.run.stops`): GAV above 0.4, a clip ratio above 20%, entropy below 1 nat (each on 5
consecutive steps, so one noisy step does not count), CGC at or above 0.15 at an
evaluation."""


def monitor_findings(rows: Sequence[dict], histories: Mapping[str, Sequence[dict]],
                     monitors: Sequence[str] = MONITORS) -> list[Finding]:
    """Do the monitoring lines warn of a collapse? For each rule of `monitors` over the runs
    of `rows` (each with `collapsed` and `collapse_step`, `histories` by run name), one
    question judged by sensitivity and specificity together: Youden's J, the share of
    collapsing runs where it fired before the collapse step minus the share of the other
    runs where it fired at all (a warning better than chance: above 0), Newcombe's interval
    for the two groups of runs, with the 2x2 table and Fisher's exact p in its note. Then,
    as context, each share alone (Clopper-Pearson): fired first (the claim: most, above
    0.5) and false alarms (below 0.5). A share over no runs is left out."""
    from scipy.stats import fisher_exact

    found = []
    for text in monitors:
        scope, text = _scope(text)
        (rule,) = stops.parse(text)
        runs = [r for r in rows if scope is None or r.get("algo") == scope
                or str(r.get("arm", "")).startswith(scope)]
        where = f" on {scope} runs" if scope else ""
        warned = [_fires(rule, histories[r["run"]], before=r.get("collapse_step"))
                  for r in runs if r["collapsed"]]
        false = [_fires(rule, histories[r["run"]]) for r in runs if not r["collapsed"]]
        rule = f"{rule}{where}"
        if warned and false:
            hit, alarm = sum(warned), sum(false)
            table = [[hit, len(warned) - hit], [alarm, len(false) - alarm]]
            p = fisher_exact(table, alternative="greater").pvalue
            found.append(finding(
                f"{rule} warns of a collapse: it fires before one more often than on a "
                "healthy run", "Youden's J: share fired before a collapse - share fired on "
                "the other runs", stats.proportion_difference(hit, len(warned), alarm,
                                                              len(false)),
                above=0.0, note=f"fired/not: {hit}/{len(warned) - hit} of collapsing runs, "
                                f"{alarm}/{len(false) - alarm} of the others; Fisher's "
                                f"exact one-sided p = {p:.3g}"))
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


def _scope(text: str) -> tuple[str | None, str]:
    """'grpo: adv/gav>0.45 for 5' -> ('grpo', the rule): a line read on the runs of one
    algorithm (or of the arms whose names start so); a rule alone reads every run."""
    head, sep, rest = text.partition(":")
    if sep and head.strip() and "/" not in head and all(c.isalnum() or c in "-_" for c in
                                                          head.strip()):
        return head.strip(), rest.strip()
    return None, text.strip()


def parse_monitors(text: str) -> tuple[str, ...]:
    """Notebook 05's `monitors`: lines separated by ';', each a stop rule
    (`labkit.run.stops`) with an optional scope ('ppo: clip/total>0.2 for 5'); empty: the
    articles' lines, MONITORS. ValueError naming the line that does not parse."""
    lines = tuple(part.strip() for part in (text or "").split(";") if part.strip())
    for line in lines:
        _, rule = _scope(line)
        try:
            (_,) = stops.parse(rule)
        except ValueError as e:
            raise ValueError(f"monitors: {line!r} is not one stop rule ({e})") from None
    return lines or MONITORS


MONITOR_SWEEP = {"adv/gav>{} for 5": (0.2, 0.3, 0.4, 0.5, 0.6),
                 "clip/total>{} for 5": (0.05, 0.1, 0.2, 0.3),
                 "policy/entropy<{} for 5": (0.5, 1, 1.5, 2),
                 "eval/cgc>={}": (0.05, 0.1, 0.15, 0.2, 0.3)}
"""Each monitor of MONITORS at a range of thresholds around the articles' line: is the
line where the warning works best, or would another one do better? Context, not the claim."""


def monitor_rules() -> list[str]:
    """Every rule of MONITOR_SWEEP, as stop-rule text."""
    return [text.format(t) for text, values in MONITOR_SWEEP.items() for t in values]


def first_fires(history: Sequence[dict], rules: Sequence[str]) -> dict[str, int]:
    """The step at which each rule first fires on `history`, -1 where it never does."""
    out = {}
    for text in rules:
        watch = stops.StopRules(stops.parse(text))
        out[text] = next((int(r.get("step", 0)) for r in history
                          if watch.update(r) is not None), -1)
    return out


def swept_monitor_findings(records: Sequence[dict]) -> list[Finding]:
    """Youden's J of every rule of MONITOR_SWEEP from the per-seed record: per run its
    `collapsed`, `collapse_step` and `fires.<rule>` (`first_fires`); a collapsing run counts
    as warned when the rule fired at a step before its collapse, another run as a false
    alarm when it fired at all (as `monitor_findings` reads the histories)."""
    found = []
    for text in monitor_rules():
        key = f"fires.{text}"
        runs = [r for r in records if key in r and "collapsed" in r]
        sick = [r for r in runs if r["collapsed"]]
        well = [r for r in runs if not r["collapsed"]]
        if not sick or not well:
            continue
        hit = sum(1 for r in sick if 0 <= r[key] < r.get("collapse_step", math.inf))
        alarm = sum(1 for r in well if r[key] >= 0)
        found.append(finding(
            f"{text} separates the runs that collapse from the others (threshold sweep)",
            "Youden's J: share fired before a collapse - share fired on the other runs",
            stats.proportion_difference(hit, len(sick), alarm, len(well)), above=0.0,
            note=f"fired/not: {hit}/{len(sick) - hit} of collapsing runs, "
                 f"{alarm}/{len(well) - alarm} of the others"))
    return found


def _fires(rule, history: Sequence[dict], before: int | None = None) -> bool:
    """Whether `rule` fires on `history` (at a step before `before`, when given)."""
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
    diagnostics (`diag_every`; labkit.probes.estimator_quality: every estimator on the same samples of
    the run's policy): per run the ratio of the critic's figure to the group mean's, at the
    first and at the last measurement, over runs (geometric mean, t interval of log ratios).
    Raw gradients (no std scaling, no whitening) compare the baselines themselves; the
    trained ones the advantages each algorithm trains with (PPO: GAE, whitened; GRPO: the
    group's z-score), against the article's "63% lower variance" (a ratio of 1/0.37). The
    article's own comparison, the leave-one-out group baseline (rloo) against the trained
    critic, is asked twice: by relative variance, and by each batch gradient's best-scaled
    error against the many-sample reference gradient (1 - cos^2, which a baseline that only
    rescales the gradient does not change)."""
    keys = {"raw": ("diag/grad_rel_var_raw/ppo_critic", "diag/grad_rel_var_raw/grpo"),
            "trained": ("diag/grad_rel_var/ppo_gae", "diag/grad_rel_var/grpo"),
            "mse": ("diag/baseline_mse/ppo_critic", "diag/baseline_mse/grpo"),
            "rloo": ("diag/grad_rel_var_raw/ppo_critic", "diag/grad_rel_var_raw/rloo"),
            "cos": ("diag/grad_cos_raw/ppo_critic", "diag/grad_cos_raw/rloo")}
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
        records = [both[at] for both in measured.values()]
        return stats.ratio_interval([r[a] for r in records], [r[b] for r in records],
                                    unit="runs")

    def error(record: dict, key: str) -> float:
        """The best-scaled error of a batch gradient against the true one, relative:
        min_c ||c g - g*||^2 / ||g*||^2 = 1 - cos^2(g, g*)."""
        return max(1.0 - record[key] ** 2, 1e-12)

    finals = [both[1] for both in measured.values()]
    critic_err, rloo_err = ([error(r, k) for r in finals] for k in keys["cos"])

    relvar = "gradient relative variance"
    found = [
        finding(f"at step {first} the group mean is a cleaner baseline than the critic",
                f"{relvar}, raw, critic / group mean", ratio("raw", 0), above=1.0),
        finding(f"at step {last} the group mean is a cleaner baseline than the critic",
                f"{relvar}, raw, critic / group mean", ratio("raw", 1), above=1.0),
        finding(f"at step {last} GRPO's advantages give a gradient with 63% less variance "
                "than PPO's", f"{relvar}, as trained, PPO (GAE) / GRPO", ratio("trained", 1),
                above=1 / 0.37),
        finding(f"at step {last} the group mean is nearer the true value than the critic",
                "baseline MSE against V*, critic / group mean", ratio("mse", 1), above=1.0),
        finding(f"at step {last} the leave-one-out group baseline (rloo) gives a gradient "
                "with 63% less variance than the trained critic",
                f"{relvar}, raw, critic / rloo", ratio("rloo", 1), above=1 / 0.37),
        finding(f"at step {last} the leave-one-out group baseline's gradient is nearer the "
                "true gradient than the critic's",
                "best-scaled error 1 - cos^2 against the many-sample gradient, critic / rloo",
                stats.ratio_interval(critic_err, rloo_err, unit="runs"), above=1.0),
    ]
    return found + _same_baseline_findings(finals, last) + _mechanism_findings(finals, last)


def _same_baseline_findings(finals: Sequence[dict], last: int) -> list[Finding]:
    """The critic judged as one baseline by both measures: its value at the prompt, V_0,
    is what `baseline_mse/ppo_critic` compares with V*, and `ppo_critic_v0` is the gradient
    of that same baseline on every token of the completion; against rloo's, both ways."""
    keys = ("diag/grad_rel_var_raw/ppo_critic_v0", "diag/grad_rel_var_raw/rloo",
            "diag/baseline_mse/ppo_critic", "diag/baseline_mse/rloo")
    runs = [r for r in finals if all(k in r for k in keys)]
    if len(runs) < 2:
        return []
    same = "the critic's prompt value V_0 as the baseline of the whole completion"
    return [
        finding(f"at step {last}, with one baseline for both measures ({same}), rloo gives "
                "a gradient with 63% less variance than the critic",
                "gradient relative variance, raw, critic V_0 / rloo",
                stats.ratio_interval([r[keys[0]] for r in runs], [r[keys[1]] for r in runs],
                                     unit="runs"), above=1 / 0.37),
        finding(f"at step {last} rloo is nearer the true value than {same}",
                "baseline MSE against V*, critic V_0 / rloo",
                stats.ratio_interval([r[keys[2]] for r in runs], [r[keys[3]] for r in runs],
                                     unit="runs"), above=1.0),
    ]


def _mechanism_findings(finals: Sequence[dict], last: int) -> list[Finding]:
    """Why no baseline gave the least noisy gradient on this task: does subtracting c x the
    group mean (the scale sweep) bring a batch gradient nearer the many-sample one than no
    baseline, and does the per-prompt optimal baseline (least squares, cross-fitted) follow
    the prompt's true value V* (slope 1) or stay near 0 (a baseline of little use)?"""
    needed = ("diag/scale/error/0", "diag/optimal/error", "diag/optimal/slope")
    runs = [r for r in finals if all(k in r for k in needed)]
    if len(runs) < 2:
        return []
    none = [r["diag/scale/error/0"] for r in runs]
    found = [finding(f"at step {last} subtracting {c} x the group mean brings the gradient "
                     "nearer the true one than no baseline",
                     f"relative squared error against the many-sample gradient, {c} x mean / none",
                     stats.ratio_interval([r[f"diag/scale/error/{c}"] for r in runs], none,
                                          unit="runs"), below=1.0)
             for c in ("0.25", "0.5", "1") if all(f"diag/scale/error/{c}" in r for r in runs)]
    found.append(finding(
        f"at step {last} the per-prompt optimal baseline brings the gradient nearer the true "
        "one than no baseline",
        "relative squared error against the many-sample gradient, optimal (cross-fitted) / none",
        stats.ratio_interval([r["diag/optimal/error"] for r in runs], none, unit="runs"),
        below=1.0))
    found.append(finding(
        f"at step {last} the per-prompt optimal baseline follows the prompt's true value "
        "(the textbook b = V*: slope above 0.5)", "slope of the optimal baseline on V*",
        stats.mean_interval([r["diag/optimal/slope"] for r in runs]), above=0.5))
    return found


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
           baseline: str | None = None, monitors: Sequence[str] = MONITORS) -> list[Finding]:
    """Notebook 05's findings for `questions` (QUESTIONS), in that order: gain and length
    against the baseline (`arm_findings`), collapse (`factor_findings`), monitors
    (`monitor_findings`, on `monitors`), diagnostics (`diagnostic_findings`)."""
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
            found += monitor_findings(rows, histories, monitors)
        else:
            found += diagnostic_findings(rows, histories)
    return found
