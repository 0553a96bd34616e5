"""How a claim is decided as its article states it, on the intervals of `labkit.formulas.stats`.

`decide` reads an interval in one of `DIRECTIONS` (above, below, two-sided, or equivalent
within a margin: two one-sided tests on the `tost_interval`). Many arms that share seeds
against one baseline are compared each from its own paired differences (`paired_vs_one`:
Bonferroni's simultaneous intervals, Holm's step-down p-values; `many_vs_one`, the arm x seed
ANOVA with one pooled residual, assumes equal spreads and is kept for reference), a 0/1
outcome on paired seeds (a collapse) decided by McNemar's exact test (`paired_binary`,
`decide_binary`). Seeds come in batches
until a claim is decided (`SequentialPlan`, `sequential_decide`), and `seeds_needed` says
how many an undecided one would take. Each procedure is checked against a reference and by
simulation in tests/test_stats_design.py.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from labkit.formulas.stats import (INCONCLUSIVE, REFUTED, SUPPORTED, Interval, check_confidence,
                                    finite_values, mean_interval, min_detectable,
                                    paired_interval, verdict)

# --- claims as stated: two-sided, equivalence, many arms against one, paired binary ---------

DIRECTIONS = ("above", "below", "two-sided", "equivalent")
"""How a claim reads its interval: the effect lies above the threshold, below it, differs
from it (either side), or lies within +-margin of it (equivalence, TOST)."""


def decide(interval: Interval, direction: str, threshold: float = 0.0,
           margin: float | None = None) -> str:
    """The verdict of a claim stated as `direction` (DIRECTIONS) about `threshold`.

    above / below: `verdict`. two-sided (the effect differs from the threshold): refuted
    when the interval lies within +-margin of it (a difference too small to matter, where a
    margin is given, even one the interval tells from the threshold); else supported when the
    interval excludes it; else inconclusive.
    equivalent (the effect lies within +-margin of the threshold): supported when the
    interval lies inside; refuted when the whole of it lies outside; else inconclusive. Two
    one-sided tests at level a read the (1 - 2a) interval (`tost_interval`)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {list(DIRECTIONS)}, got {direction!r}")
    if direction in ("above", "below"):
        return verdict(interval, **{direction: threshold})
    if direction == "equivalent" and (margin is None or not margin > 0):
        raise ValueError(f"an equivalence claim needs a margin > 0, got {margin!r}")
    if not (math.isfinite(interval.low) and math.isfinite(interval.high)):
        return INCONCLUSIVE
    inside = margin is not None and threshold - margin < interval.low \
        and interval.high < threshold + margin
    if direction == "two-sided":
        if inside:
            return REFUTED
        excludes = interval.low > threshold or interval.high < threshold
        return SUPPORTED if excludes else INCONCLUSIVE
    if inside:
        return SUPPORTED
    outside = interval.low >= threshold + margin or interval.high <= threshold - margin
    return REFUTED if outside else INCONCLUSIVE


def tost_interval(interval_of, *args, alpha: float = 0.05, **kwargs) -> Interval:
    """The (1 - 2 alpha) interval that two one-sided tests at level alpha read:
    `interval_of(*args, confidence=1 - 2 alpha, **kwargs)`, e.g.
    `tost_interval(paired_interval, a, b)`."""
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    found = interval_of(*args, confidence=1 - 2 * alpha, **kwargs)
    return Interval(found.mean, found.low, found.high, found.n,
                    f"{found.method} (TOST at {alpha:g}: the {1 - 2 * alpha:.0%} interval)",
                    found.confidence)


@dataclass(frozen=True)
class Comparison:
    """One arm against the baseline: the difference of means with its simultaneous interval,
    the unadjusted and adjusted two-sided p-values."""

    arm: str
    interval: Interval
    p: float
    p_adjusted: float


def many_vs_one(table: dict[str, dict], baseline: str, confidence: float = 0.95,
                adjust: str = "dunnett", unit: str = "seeds") -> list[Comparison]:
    """Every arm against `baseline`, arms that share seeds analysed together.

    `table` is arm -> seed -> value, every arm on the same seeds. The model is additive,
    value = arm + seed + noise (seed s gives every arm the same prompts), fitted by two-way
    ANOVA: the difference of an arm's mean from the baseline's, with the residual variance
    pooled over every arm and seed ((arms - 1)(seeds - 1) degrees of freedom). With k arms
    against one, adjust="dunnett" gives simultaneous intervals and p-values from the
    maximum of k t statistics that share the baseline (correlation 1/2, `dunnett_quantile`);
    "holm" gives Holm's step-down p-values and Bonferroni intervals (confidence 1 - a/k);
    "none" leaves each comparison at `confidence`."""
    from scipy import stats

    check_confidence(confidence)
    if adjust not in ("dunnett", "holm", "none"):
        raise ValueError(f"adjust must be 'dunnett', 'holm' or 'none', got {adjust!r}")
    if baseline not in table:
        raise ValueError(f"baseline {baseline!r} is not an arm (arms: {list(table)})")
    arms = [baseline] + [a for a in table if a != baseline]
    seeds = list(table[baseline])
    for arm in arms:
        if sorted(map(str, table[arm])) != sorted(map(str, seeds)):
            raise ValueError(f"every arm must run the same seeds: {arm!r} has "
                             f"{sorted(table[arm])}, {baseline!r} {sorted(seeds)}")
    if len(arms) < 2 or len(seeds) < 2:
        raise ValueError(f"many_vs_one needs >= 2 arms and >= 2 seeds, got {len(arms)} arms "
                         f"and {len(seeds)} seeds")
    y = [[float(table[a][s]) for s in seeds] for a in arms]
    for row in y:
        finite_values(row, "values")
    A, S = len(arms), len(seeds)
    arm_mean = [sum(row) / S for row in y]
    seed_mean = [sum(y[a][s] for a in range(A)) / A for s in range(S)]
    grand = sum(arm_mean) / A
    ss = sum((y[a][s] - arm_mean[a] - seed_mean[s] + grand) ** 2
             for a in range(A) for s in range(S))
    df = (A - 1) * (S - 1)
    se = math.sqrt(ss / df * 2 / S)
    k = A - 1
    diffs = [arm_mean[i] - arm_mean[0] for i in range(1, A)]
    if se == 0:
        ps = [0.0 if d != 0 else 1.0 for d in diffs]
    else:
        ps = [float(2 * stats.t.sf(abs(d) / se, df)) for d in diffs]
    if adjust == "dunnett":
        crit = dunnett_quantile(k, df, confidence)
        adjusted = ([min(1.0, max(0.0, 1 - q)) for q in
                     _dunnett_within_all([abs(d) / se for d in diffs], k, df)]
                    if se > 0 else list(ps))
        how = f"Dunnett, {k} arms vs {baseline}"
    elif adjust == "holm":
        crit = float(stats.t.ppf(1 - (1 - confidence) / (2 * k), df))
        adjusted = holm(ps)
        how = f"Holm p, Bonferroni interval, {k} arms vs {baseline}"
    else:
        crit = float(stats.t.ppf(1 - (1 - confidence) / 2, df))
        adjusted = list(ps)
        how = f"unadjusted, vs {baseline}"
    method = f"arm x seed ANOVA over {S} {unit}, pooled residual ({df} df), {how}"
    return [Comparison(arm, Interval(d, d - crit * se, d + crit * se, S, method, confidence),
                       p, q) for arm, d, p, q in zip(arms[1:], diffs, ps, adjusted)]


def paired_vs_one(table: dict[str, dict], baseline: str, confidence: float = 0.95,
                  unit: str = "seeds") -> list[Comparison]:
    """Every arm against `baseline`, each from its own paired differences: the paired t
    interval at Bonferroni's level 1 - (1 - confidence) / k for k arms (simultaneous, with no
    assumption that the arms' spreads are equal, where `many_vs_one`'s pooled residual lets
    one volatile arm borrow the others' spread), Holm's step-down p-values over the k paired
    t tests. `table`: arm -> seed -> value, every arm on the baseline's seeds."""
    from scipy import stats

    check_confidence(confidence)
    if baseline not in table:
        raise ValueError(f"baseline {baseline!r} is not an arm (arms: {list(table)})")
    arms = [a for a in table if a != baseline]
    seeds = list(table[baseline])
    if not arms or len(seeds) < 2:
        raise ValueError(f"paired_vs_one needs >= 1 arm beside the baseline and >= 2 seeds, got "
                         f"{len(arms)} and {len(seeds)}")
    k = len(arms)
    level = 1 - (1 - confidence) / k
    found, ps = [], []
    for arm in arms:
        if sorted(map(str, table[arm])) != sorted(map(str, seeds)):
            raise ValueError(f"every arm must run the same seeds: {arm!r} has "
                             f"{sorted(table[arm])}, {baseline!r} {sorted(seeds)}")
        d = [float(table[arm][s]) - float(table[baseline][s]) for s in seeds]
        interval = paired_interval([table[arm][s] for s in seeds],
                                   [table[baseline][s] for s in seeds], level, unit)
        sd = statistics.stdev(d)
        mean = sum(d) / len(d)
        p = (1.0 if mean == 0 else 0.0) if sd == 0 else float(
            2 * stats.t.sf(abs(mean) / (sd / math.sqrt(len(d))), len(d) - 1))
        ps.append(p)
        method = (f"paired t over {len(d)} {unit}, Bonferroni over {k} arms vs {baseline} "
                  f"(each arm its own spread)")
        found.append((arm, Interval(interval.mean, interval.low, interval.high, interval.n,
                                    method, confidence)))
    return [Comparison(arm, interval, p, q)
            for (arm, interval), p, q in zip(found, ps, holm(ps))]


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest p times
    (m - i + 1), made monotone, capped at 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def _dunnett_within(c: float, k: int, df: float) -> float:
    """P(max_i |T_i| <= c) for k t statistics of `df` degrees of freedom whose normal parts
    have correlation 1/2 (each arm's difference from one shared baseline): with U_0, ..., U_k
    standard normal and S^2 ~ chi2_df / df, T_i = (U_i - U_0) / (sqrt(2) S), so given U_0 = u
    and S = s the k events are independent, each of probability Phi(u + c s sqrt 2) -
    Phi(u - c s sqrt 2). Integrated by Gauss-Hermite quadrature over u and Gauss-Legendre
    over the quantiles of S."""
    return float(_dunnett_within_all([c], k, df)[0])


def _dunnett_within_all(cs: Sequence[float], k: int, df: float):
    """`_dunnett_within` at each of `cs` at once (an array)."""
    import numpy as np
    from scipy import special

    u, wu, s, ws = _dunnett_nodes(float(df))
    w = np.asarray(cs, dtype=float)[:, None, None] * math.sqrt(2) * s[None, :, None]
    inner = (special.ndtr(u + w) - special.ndtr(u - w)) ** k @ wu
    return inner @ ws


@functools.lru_cache(maxsize=64)
def _dunnett_nodes(df: float):
    """Quadrature nodes and weights: u for the standard normal, s for S = sqrt(chi2_df / df)
    (one node at 1 for an unbounded df)."""
    import numpy as np
    from scipy import stats

    u, wu = np.polynomial.hermite_e.hermegauss(64)
    wu = wu / math.sqrt(2 * math.pi)
    if math.isinf(df) or df > 1e6:
        return u, wu, np.ones(1), np.ones(1)
    x, ws = np.polynomial.legendre.leggauss(80)
    return u, wu, stats.chi.ppf((x + 1) / 2, df) / math.sqrt(df), ws / 2


def dunnett_quantile(k: int, df: float, confidence: float = 0.95) -> float:
    """The two-sided critical value c of Dunnett's many-to-one comparison: P(max_i |T_i| <= c)
    = confidence for k comparisons with one shared baseline and `df` degrees of freedom."""
    check_confidence(confidence)
    return _dunnett_cached(int(k), float(df), float(confidence))


@functools.lru_cache(maxsize=256)
def _dunnett_cached(k: int, df: float, confidence: float) -> float:
    from scipy import optimize

    if k < 1 or not df > 0:
        raise ValueError(f"dunnett_quantile needs k >= 1 and df > 0, got {k}, {df}")
    return float(optimize.brentq(lambda c: _dunnett_within(c, k, df) - confidence, 0.5, 50,
                                 xtol=1e-6))


def exact_sides(only_a: int, only_b: int) -> tuple[float, float]:
    """McNemar's exact one-sided p-values from the discordant pairs: (P(X >= only_a),
    P(X <= only_a)) for X ~ Binomial(only_a + only_b, 1/2); (1, 1) with none discordant."""
    from scipy import stats

    n = only_a + only_b
    if n == 0:
        return 1.0, 1.0
    return float(stats.binom.sf(only_a - 1, n, 0.5)), float(stats.binom.cdf(only_a, n, 0.5))


def decide_binary(found: PairedBinary, direction: str, threshold: float = 0.0,
                  margin: float | None = None) -> str:
    """The verdict on paired 0/1 outcomes: the interval's (`decide`), which the exact test
    must confirm where the claim is against no difference (threshold 0): a side is decided
    only when McNemar's exact one-sided p on that side is at most the interval's one-sided
    level, (1 - confidence) / 2. So 5 of 5 seeds discordant (p = 1/32) decides nothing at a
    look that spends 0.0155 a side, whatever the interval says. A two-sided claim refuted by
    its margin (a difference too small to matter) reads no side and needs no exact test."""
    verdict = decide(found.interval, direction, threshold, margin)
    if threshold != 0 or direction == "equivalent" or verdict == INCONCLUSIVE:
        return verdict
    if direction == "two-sided" and verdict == REFUTED:
        return verdict
    alpha = (1 - found.interval.confidence) / 2
    up, down = exact_sides(found.only_a, found.only_b)
    if direction == "two-sided":
        shown = min(up, down) <= alpha
    elif direction == "above":
        shown = (up if verdict == SUPPORTED else down) <= alpha
    else:
        shown = (down if verdict == SUPPORTED else up) <= alpha
    return verdict if shown else INCONCLUSIVE


@dataclass(frozen=True)
class PairedBinary:
    """A 0/1 outcome (a run collapsed) of two arms on the same seeds: the difference of the
    two rates with an interval, and McNemar's exact two-sided p-value from the discordant
    pairs (seeds where only one arm has the outcome)."""

    interval: Interval
    p: float
    only_a: int
    only_b: int


def paired_binary(a: Sequence[bool], b: Sequence[bool], confidence: float = 0.95,
                  unit: str = "seeds") -> PairedBinary:
    """Rate of a minus rate of b over paired seeds. The p-value is McNemar's exact test: among
    the n_d discordant seeds, the count where only a has the outcome is Binomial(n_d, 1/2)
    when the rates are equal. The interval is Newcombe's score interval for paired data: the
    continuity-corrected Wilson intervals of each rate, combined with the correlation phi of
    the 2x2 table (0 where a margin is empty); without the correction it covers 92% at 12
    seeds (tests/test_stats_design.py), with it at least 95%."""
    from scipy import stats

    check_confidence(confidence)
    if len(a) != len(b) or len(a) == 0:
        raise ValueError(f"a and b must pair up one outcome per seed, got {len(a)} and {len(b)}")
    xs, ys = [bool(v) for v in a], [bool(v) for v in b]
    both = sum(x and y for x, y in zip(xs, ys))
    only_a = sum(x and not y for x, y in zip(xs, ys))
    only_b = sum(y and not x for x, y in zip(xs, ys))
    n = len(xs)
    neither = n - both - only_a - only_b
    discordant = only_a + only_b
    p = 1.0 if discordant == 0 else float(stats.binomtest(only_a, discordant, 0.5).pvalue)
    p1, p2 = (both + only_a) / n, (both + only_b) / n
    w1 = stats.binomtest(both + only_a, n).proportion_ci(confidence, method="wilsoncc")
    w2 = stats.binomtest(both + only_b, n).proportion_ci(confidence, method="wilsoncc")
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    phi = 0.0 if margins == 0 else (both * neither - only_a * only_b) / math.sqrt(margins)
    d = p1 - p2
    dl1, du1, dl2, du2 = p1 - w1.low, w1.high - p1, p2 - w2.low, w2.high - p2
    low = d - math.sqrt(max(dl1 ** 2 - 2 * phi * dl1 * du2 + du2 ** 2, 0.0))
    high = d + math.sqrt(max(du1 ** 2 - 2 * phi * du1 * dl2 + dl2 ** 2, 0.0))
    interval = Interval(d, max(low, -1.0), min(high, 1.0), n,
                        f"Newcombe paired score interval (Wilson cc), McNemar exact p, "
                        f"{only_a} vs {only_b} discordant of {n} {unit}", confidence)
    return PairedBinary(interval, p, only_a, only_b)


# --- seeds until decided ------------------------------------------------------------------------

@dataclass(frozen=True)
class SequentialPlan:
    """Seeds added in batches until a claim is decided: looks after `looks[k]` seeds, the
    error rate `alpha` spent over them by a Lan-DeMets spending function of t, the share of
    the last look's seeds: "pocock", alpha ln(1 + (e - 1) t), spends evenly and stops early
    on a moderate effect; "obrien-fleming", 2 - 2 Phi(z_{1-alpha/2} / sqrt(t)), keeps nearly
    all of it for the last look. Look k reads its interval at confidence 1 - (alpha(t_k) -
    alpha(t_{k-1})). The looks' errors add up to at most alpha whatever their dependence
    (Bonferroni over the looks), so stopping at the first decided look keeps the error
    rate."""

    looks: tuple[int, ...] = (5, 10, 20)
    alpha: float = 0.05
    spending: str = "pocock"

    def __post_init__(self):
        if not self.looks or any(b <= a for a, b in zip(self.looks, self.looks[1:])) \
                or self.looks[0] < 2:
            raise ValueError(f"looks must be increasing seed counts >= 2, got {self.looks}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.spending not in ("pocock", "obrien-fleming"):
            raise ValueError(f"spending must be 'pocock' or 'obrien-fleming', got "
                             f"{self.spending!r}")

    def spent(self) -> list[float]:
        """The error rate each look spends (summing to alpha)."""
        from scipy import stats

        shares = [n / self.looks[-1] for n in self.looks]
        if self.spending == "pocock":
            cumulative = [self.alpha * math.log(1 + (math.e - 1) * t) for t in shares]
        else:
            z = stats.norm.ppf(1 - self.alpha / 2)
            cumulative = [float(2 - 2 * stats.norm.cdf(z / math.sqrt(t))) for t in shares]
        return [c - p for c, p in zip(cumulative, [0.0] + cumulative[:-1])]

    def confidence(self, k: int, direction: str = "above") -> float:
        """The confidence of look k's interval; for an equivalence claim, two one-sided tests
        each at the look's error, read on the (1 - 2 x error) interval."""
        error = self.spent()[k]
        return 1 - 2 * error if direction == "equivalent" else 1 - error

    def run(self, available: int, read: Callable[[int, int], tuple[str, object]]
            ) -> tuple[int, str, object]:
        """Read the looks that `available` seeds reach, `read(seeds, look) -> (verdict, what)`
        (its interval at `confidence(look, ...)` over the first `seeds`), stopping at the
        first decided one (the last reached otherwise): (look, verdict, what)."""
        reached = [k for k, n in enumerate(self.looks) if n <= available]
        if not reached:
            raise ValueError(f"the first look needs {self.looks[0]} seeds, got {available}")
        for k in reached:
            verdict, what = read(self.looks[k], k)
            if verdict != INCONCLUSIVE or k == reached[-1]:
                return k, verdict, what
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class SequentialResult:
    """Where a sequential test stopped: its verdict, the interval of that look, the seeds it
    took, and the look."""

    verdict: str
    interval: Interval
    seeds: int
    look: int


def sequential_decide(differences: Sequence[float], plan: SequentialPlan, direction: str,
                      threshold: float = 0.0, margin: float | None = None,
                      **interval_kwargs) -> SequentialResult:
    """Read per-seed differences (in seed order) at each look of `plan` that they reach,
    stopping at the first decided one (`decide`; equivalence reads the look's interval as
    two one-sided tests at half its error); the last look reached otherwise."""
    xs = finite_values(differences, "differences")

    def read(n: int, k: int) -> tuple[str, Interval]:
        found = mean_interval(xs[:n], plan.confidence(k, direction), **interval_kwargs)
        return decide(found, direction, threshold, margin), found

    k, decided, found = plan.run(len(xs), read)
    return SequentialResult(decided, found, plan.looks[k], k)


def implied_sd(interval: Interval) -> float | None:
    """The per-seed spread a t interval of a mean over interval.n seeds implies (its
    half-width is t sd / sqrt(n)); None without an interval."""
    from scipy import stats

    if interval.n < 2 or not (math.isfinite(interval.low) and math.isfinite(interval.high)):
        return None
    t = stats.t.ppf(1 - (1 - interval.confidence) / 2, interval.n - 1)
    return (interval.high - interval.low) / 2 * math.sqrt(interval.n) / t


def seeds_needed(interval: Interval, threshold: float = 0.0, power: float = 0.8) -> int | None:
    """How many paired seeds the observed effect would need to clear `threshold` with
    probability `power`, at the spread the interval implies (a t interval of a mean over
    interval.n seeds); None where the effect sits on the threshold or there is no spread."""
    sd = implied_sd(interval)
    gap = abs(interval.mean - threshold)
    if sd is None or gap == 0 or sd == 0:
        return None
    for n in range(2, 10_001):
        if min_detectable(sd, n, interval.confidence, power) <= gap:
            return n
    return None
