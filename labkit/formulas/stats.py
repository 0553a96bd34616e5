"""What a comparison over seeds supports: intervals from scipy.stats, and a verdict.

A figure is the mean over seeds with a 95% interval. With a handful of seeds the interval is
Student's t over the per-seed values (`mean_interval`); a difference between two arms run on
the same seeds (seed s gives every arm the same prompt stream) is the paired t interval of the
per-seed differences (`paired_interval`), and a cost ratio the t interval of the per-seed log
ratios, exponentiated (`ratio_interval`, or `geometric_interval` of ratios already taken: a
geometric mean). A held-out accuracy has its own binomial noise beside the seeds'
(`binomial_se`). Every interval names its method.

`verdict` reads an interval against a claim's threshold: `supported` when the whole interval
lies on the claim's side, `refuted` when the whole of it lies on the other side, otherwise
`inconclusive at this budget`. `min_detectable` says how large a difference a number of seeds
can tell from nothing.

`mean_interval` takes a floor on the spread (no zero-width interval when seeds agree exactly)
and bounds (an accuracy's interval stays in [0, 1]). How a claim as its article states it is
decided (directions, many arms against one, paired 0/1 outcomes, seeds added until decided)
is `labkit.formulas.stats_design`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

SUPPORTED = "supported"
REFUTED = "refuted"
INCONCLUSIVE = "inconclusive at this budget"
VERDICTS = (SUPPORTED, REFUTED, INCONCLUSIVE)


@dataclass(frozen=True)
class Interval:
    """A mean over `n` units with its `confidence` interval [low, high], and how it was made.
    With one unit there is no interval: low and high are NaN."""

    mean: float
    low: float
    high: float
    n: int
    method: str
    confidence: float = 0.95

    def format(self, digits: int = 3, scale: float = 1.0, unit: str = "") -> str:
        """'0.512 [0.47, 0.55]': the mean and its interval, times `scale`, with `unit`."""
        if not math.isfinite(self.low):
            return f"{self.mean * scale:.{digits}f}{unit} (one value, no interval)"
        return (f"{self.mean * scale:.{digits}f}{unit} [{self.low * scale:.{digits}f}, "
                f"{self.high * scale:.{digits}f}]")

    def to_dict(self) -> dict:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n,
                "method": self.method, "confidence": self.confidence}


def finite_values(values: Sequence[float], name: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"{name} is empty: an interval needs at least one value")
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"{name} must be finite numbers, got {out}")
    return out


def check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def mean_interval(values: Sequence[float], confidence: float = 0.95,
                  unit: str = "seeds", *, sd_floor: float = 0.0,
                  bounds: tuple[float, float] | None = None) -> Interval:
    """The mean of `values` (one per seed) with Student's t interval (n - 1 degrees of
    freedom), from scipy.stats.

    sd_floor: the least per-seed spread to assume, so that seeds that agree exactly do not
    give a zero-width interval (for accuracies on n problems, the evaluation's own noise:
    `binomial_se`; for a difference of two, sqrt(2) times it). bounds: where the quantity
    must lie ((0, 1) for an accuracy, (-1, 1) for a difference of two); the interval is
    clipped to them, which keeps every true value it covered."""
    from scipy import stats

    check_confidence(confidence)
    xs = finite_values(values, "values")
    if sd_floor < 0 or not math.isfinite(sd_floor):
        raise ValueError(f"sd_floor must be a finite number >= 0, got {sd_floor}")
    n, mean = len(xs), sum(xs) / len(xs)
    method = f"t-interval over {n} {unit}"
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1, f"one of {unit}: no interval", confidence)
    sd = statistics.stdev(xs)
    if sd < sd_floor:
        sd, method = sd_floor, f"{method}, spread floored at {sd_floor:.3g}"
    if sd == 0:
        return Interval(mean, mean, mean, n, method, confidence)
    low, high = stats.t.interval(confidence, n - 1, loc=mean, scale=sd / math.sqrt(n))
    return _bounded(Interval(mean, float(low), float(high), n, method, confidence), bounds)


def _bounded(interval: Interval, bounds: tuple[float, float] | None) -> Interval:
    if bounds is None:
        return interval
    lo, hi = bounds
    low, high = max(interval.low, lo), min(interval.high, hi)
    if (low, high) == (interval.low, interval.high):
        return interval
    return Interval(interval.mean, low, high, interval.n,
                    f"{interval.method}, clipped to [{lo:g}, {hi:g}]", interval.confidence)


def paired_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95,
                    unit: str = "seeds", *, sd_floor: float = 0.0,
                    bounds: tuple[float, float] | None = None) -> Interval:
    """The mean of a_i - b_i over pairs that share a seed, with the paired t interval
    (`sd_floor` and `bounds` as in `mean_interval`, for the differences)."""
    xs, ys = finite_values(a, "a"), finite_values(b, "b")
    if len(xs) != len(ys):
        raise ValueError(f"a and b must pair up one value per seed, got {len(xs)} and {len(ys)}")
    found = mean_interval([x - y for x, y in zip(xs, ys)], confidence, unit,
                          sd_floor=sd_floor, bounds=bounds)
    method = (found.method.replace("t-interval", "paired t", 1) if found.n > 1
              else found.method)
    return Interval(found.mean, found.low, found.high, found.n, method, confidence)


def ratio_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95,
                   unit: str = "seeds") -> Interval:
    """The geometric mean of a_i / b_i over paired seeds, with the t interval of the log
    ratios exponentiated (a ratio of costs: step time, memory). Values must be > 0."""
    xs, ys = finite_values(a, "a"), finite_values(b, "b")
    if len(xs) != len(ys):
        raise ValueError(f"a and b must pair up one value per seed, got {len(xs)} and {len(ys)}")
    if min(xs + ys) <= 0:
        raise ValueError("a ratio interval needs positive values")
    return geometric_interval([x / y for x, y in zip(xs, ys)], confidence, unit)


def geometric_interval(values: Sequence[float], confidence: float = 0.95,
                       unit: str = "seeds") -> Interval:
    """The geometric mean of positive values (ratios measured once per seed, run or round)
    with the t interval of their logs, exponentiated."""
    xs = finite_values(values, "values")
    if min(xs) <= 0:
        raise ValueError(f"a geometric interval needs positive values, got {xs}")
    logs = mean_interval([math.log(x) for x in xs], confidence, unit)
    method = (f"t-interval of log ratios over {logs.n} {unit}, exponentiated"
              if logs.n > 1 else logs.method)
    low, high = (math.exp(logs.low), math.exp(logs.high)) if logs.n > 1 else (math.nan, math.nan)
    return Interval(math.exp(logs.mean), low, high, logs.n, method, confidence)


def _counts(k: int, n: int, name: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name}: n must be an int >= 1, got {n!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n:
        raise ValueError(f"{name}: k must be an int in [0, n={n}], got {k!r}")


def proportion_interval(k: int, n: int, confidence: float = 0.95,
                        unit: str = "runs") -> Interval:
    """k of n units (runs that collapsed, say) as a proportion with the Clopper-Pearson exact
    binomial interval, from scipy.stats.binomtest."""
    from scipy import stats

    check_confidence(confidence)
    _counts(k, n, "proportion_interval")
    ci = stats.binomtest(k, n).proportion_ci(confidence, method="exact")
    return Interval(k / n, float(ci.low), float(ci.high), n,
                    f"Clopper-Pearson exact, {k} of {n} {unit}", confidence)


def proportion_difference(k1: int, n1: int, k2: int, n2: int, confidence: float = 0.95,
                          unit: str = "runs") -> Interval:
    """p1 - p2 of two independent proportions k1/n1 and k2/n2 with Newcombe's hybrid score
    interval (his method 10): from the Wilson intervals [l, u] of each (scipy.stats),
    p1 - p2 - sqrt((p1 - l1)^2 + (u2 - p2)^2) to p1 - p2 + sqrt((u1 - p1)^2 + (p2 - l2)^2).
    Its n is n1 + n2."""
    from scipy import stats

    check_confidence(confidence)
    _counts(k1, n1, "proportion_difference (first)")
    _counts(k2, n2, "proportion_difference (second)")
    p1, p2 = k1 / n1, k2 / n2
    w1 = stats.binomtest(k1, n1).proportion_ci(confidence, method="wilson")
    w2 = stats.binomtest(k2, n2).proportion_ci(confidence, method="wilson")
    d = p1 - p2
    low = d - math.sqrt((p1 - w1.low) ** 2 + (w2.high - p2) ** 2)
    high = d + math.sqrt((w1.high - p1) ** 2 + (p2 - w2.low) ** 2)
    return Interval(d, low, high, n1 + n2,
                    f"Newcombe score interval, {k1}/{n1} vs {k2}/{n2} {unit}", confidence)


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy p measured on n problems: sqrt(p (1 - p) / n)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return math.sqrt(max(p * (1 - p), 0.0) / n)


def verdict(interval: Interval, *, above: float | None = None,
            below: float | None = None) -> str:
    """Whether `interval` supports a claim that the effect lies above `above` (or below
    `below`; give exactly one): `supported` when the whole interval is on the claim's side,
    `refuted` when the whole of it is on the other side (touching the threshold counts as
    the other side), `inconclusive at this budget` when it straddles the threshold or has no
    width (one seed)."""
    if (above is None) == (below is None):
        raise ValueError("give exactly one of above= or below=")
    if not (math.isfinite(interval.low) and math.isfinite(interval.high)):
        return INCONCLUSIVE
    if above is not None:
        if interval.low > above:
            return SUPPORTED
        return REFUTED if interval.high <= above else INCONCLUSIVE
    if interval.high < below:
        return SUPPORTED
    return REFUTED if interval.low >= below else INCONCLUSIVE


def min_detectable(sd: float, n: int, confidence: float = 0.95, power: float = 0.8) -> float:
    """The smallest true mean difference that `n` paired seeds with per-seed spread `sd` find
    (interval clear of 0) with probability `power`: (t_{1-a/2} + t_{power}) sd / sqrt(n), the
    t approximation, n - 1 degrees of freedom."""
    from scipy import stats

    check_confidence(confidence)
    if n < 2:
        raise ValueError(f"n must be >= 2 to estimate a spread, got {n}")
    t = stats.t.ppf(1 - (1 - confidence) / 2, n - 1) + stats.t.ppf(power, n - 1)
    return float(t * sd / math.sqrt(n))
