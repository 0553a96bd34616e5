"""labkit.formulas.stats: intervals against textbook values, verdicts on known intervals."""

import math

import pytest

from labkit.formulas import stats

# two-sided 95% Student t quantiles from printed tables (df = 2, 4)
T975 = {2: 4.302653, 4: 2.776445}


def plain_t_interval(xs, t):
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean - t * sd / math.sqrt(n), mean + t * sd / math.sqrt(n)


@pytest.mark.parametrize("xs", [[0.49, 0.515, 0.508], [31.0, 52.0, 49.5, 50.1, 19.0]])
def test_mean_interval_is_students_t(xs):
    found = stats.mean_interval(xs)
    low, high = plain_t_interval(xs, T975[len(xs) - 1])
    assert found.mean == pytest.approx(sum(xs) / len(xs))
    assert (found.low, found.high) == (pytest.approx(low, rel=1e-5), pytest.approx(high, rel=1e-5))
    assert found.n == len(xs) and "t-interval" in found.method and str(len(xs)) in found.method


def test_paired_interval_uses_differences_not_two_samples():
    a, b = [0.80, 0.70, 0.60], [0.75, 0.66, 0.55]  # large spread, constant difference ~0.047
    paired = stats.paired_interval(a, b)
    low, high = plain_t_interval([x - y for x, y in zip(a, b)], T975[2])
    assert (paired.low, paired.high) == (pytest.approx(low), pytest.approx(high))
    assert paired.low > 0 and "paired" in paired.method
    assert stats.verdict(paired, above=0) == stats.SUPPORTED


def test_ratio_interval_is_a_geometric_mean():
    found = stats.ratio_interval([2.0, 8.0], [1.0, 1.0])
    assert found.mean == pytest.approx(4.0)
    assert found.low < 4.0 < found.high


def test_geometric_interval_is_the_t_interval_of_logs_exponentiated():
    ratios = [0.52, 0.61, 0.58, 0.70]
    found = stats.geometric_interval(ratios, unit="runs")
    logs = [math.log(r) for r in ratios]
    low, high = plain_t_interval(logs, 3.182446)  # df = 3, from a printed table
    assert found.mean == pytest.approx(math.exp(sum(logs) / len(logs)))
    assert (found.low, found.high) == (pytest.approx(math.exp(low), rel=1e-5),
                                       pytest.approx(math.exp(high), rel=1e-5))
    assert found.n == 4 and "runs" in found.method
    assert stats.ratio_interval([1.04, 1.22], [2.0, 2.0]).mean == pytest.approx(
        stats.geometric_interval([0.52, 0.61]).mean)
    with pytest.raises(ValueError, match="positive"):
        stats.geometric_interval([0.5, 0.0])


def test_one_seed_has_no_interval_and_no_verdict():
    found = stats.mean_interval([0.5])
    assert math.isnan(found.low) and "no interval" in found.method
    assert stats.verdict(found, above=0.0) == stats.INCONCLUSIVE


@pytest.mark.parametrize("low, high, above, expected", [
    (0.02, 0.10, 0.0, stats.SUPPORTED),
    (-0.10, -0.02, 0.0, stats.REFUTED),
    (-0.03, 0.05, 0.0, stats.INCONCLUSIVE),
    (-0.05, 0.0, 0.0, stats.REFUTED),       # touching the line is not above it
    (31.0, 45.0, 30.0, stats.SUPPORTED),
    (27.0, 60.0, 30.0, stats.INCONCLUSIVE),
])
def test_verdict_above(low, high, above, expected):
    interval = stats.Interval((low + high) / 2, low, high, 3, "given")
    assert stats.verdict(interval, above=above) == expected


@pytest.mark.parametrize("low, high, expected", [
    (0.5, 0.9, stats.SUPPORTED), (1.1, 1.4, stats.REFUTED), (0.8, 1.2, stats.INCONCLUSIVE)])
def test_verdict_below(low, high, expected):
    interval = stats.Interval((low + high) / 2, low, high, 5, "given")
    assert stats.verdict(interval, below=1.0) == expected


def test_verdict_needs_one_threshold():
    interval = stats.Interval(0.0, -1.0, 1.0, 3, "given")
    with pytest.raises(ValueError, match="exactly one"):
        stats.verdict(interval)
    with pytest.raises(ValueError, match="exactly one"):
        stats.verdict(interval, above=0, below=1)


def test_binomial_se_and_bad_input():
    assert stats.binomial_se(0.5, 1000) == pytest.approx(math.sqrt(0.25 / 1000))
    with pytest.raises(ValueError, match="n must be"):
        stats.binomial_se(0.5, 0)
    with pytest.raises(ValueError, match="finite"):
        stats.mean_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="pair up"):
        stats.paired_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="confidence"):
        stats.mean_interval([1.0, 2.0], confidence=1.5)


def test_min_detectable_shrinks_with_seeds():
    # df = 4: t_0.975 = 2.776445, t_0.8 = 0.940965 (tables)
    assert stats.min_detectable(1.0, 5) == pytest.approx((2.776445 + 0.940965) / math.sqrt(5),
                                                         rel=1e-5)
    assert stats.min_detectable(1.0, 10) < stats.min_detectable(1.0, 5) < stats.min_detectable(1.0, 3)


def test_clopper_pearson_is_the_beta_quantile_interval():
    """The exact interval is [Beta(a/2; k, n-k+1), Beta(1-a/2; k+1, n-k)] (the textbook form),
    0 and 1 at the ends."""
    from scipy.stats import beta

    for k, n in [(3, 12), (0, 5), (5, 5), (40, 100)]:
        found = stats.proportion_interval(k, n)
        low = beta.ppf(0.025, k, n - k + 1) if k > 0 else 0.0
        high = beta.ppf(0.975, k + 1, n - k) if k < n else 1.0
        assert found.mean == pytest.approx(k / n)
        assert (found.low, found.high) == (pytest.approx(low), pytest.approx(high))
        assert found.n == n and f"{k} of {n}" in found.method


def test_newcombe_difference_matches_the_published_examples():
    """Newcombe (1998), Statistics in Medicine 17:873, Table II, method 10: 56/70 - 48/80
    is 0.0524 to 0.3339, and 9/10 - 3/10 is 0.1705 to 0.8090."""
    found = stats.proportion_difference(56, 70, 48, 80)
    assert found.mean == pytest.approx(0.2)
    assert (round(found.low, 4), round(found.high, 4)) == (0.0524, 0.3339)
    found = stats.proportion_difference(9, 10, 3, 10)
    assert (round(found.low, 4), round(found.high, 4)) == (0.1705, 0.8090)
    assert stats.verdict(found, above=0) == stats.SUPPORTED
    # no collapse on either side: the interval straddles 0
    same = stats.proportion_difference(0, 12, 0, 12)
    assert same.low < 0 < same.high and stats.verdict(same, above=0) == stats.INCONCLUSIVE


@pytest.mark.parametrize("call, words", [
    (lambda: stats.proportion_interval(3, 0), "n must be an int >= 1"),
    (lambda: stats.proportion_interval(4, 3), r"k must be an int in \[0, n=3\]"),
    (lambda: stats.proportion_interval(1.5, 3), "k must be an int"),
    (lambda: stats.proportion_difference(1, 2, 3, 2), "second"),
])
def test_proportions_name_the_bad_count(call, words):
    with pytest.raises(ValueError, match=words):
        call()
