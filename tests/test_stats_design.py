"""Statistics that fit the claims' designs (labkit.formulas.stats): each procedure against a plain
reference, and by simulation: over 2,000 simulated experiments the rate of wrong verdicts
under the null stays <= 6.5% after adjustment, and interval coverage lies within 93.5-96.5%
(exact discrete procedures: at least 93.5%, they may cover more)."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from labkit.formulas import stats, stats_design

RUNS = 2000
LOW, HIGH, WRONG = 0.935, 0.965, 0.065


def _rng(k: int = 0) -> np.random.Generator:
    return np.random.default_rng(20261206 + k)


# --- references -------------------------------------------------------------------------------

@pytest.mark.parametrize("k, df, table", [(2, 10, 2.57), (4, 20, 2.65), (5, 1e9, 2.51),
                                          (3, 60, 2.41)])
def test_dunnett_quantile_matches_the_published_table(k, df, table):
    """Dunnett (1964), two-sided 5% critical values, to the table's two decimals."""
    assert stats_design.dunnett_quantile(k, df) == pytest.approx(table, abs=0.006)


@pytest.mark.parametrize("df", [2, 4, 10, 44])
def test_dunnett_with_one_arm_is_student_t(df):
    assert stats_design.dunnett_quantile(1, df) == pytest.approx(sps.t.ppf(0.975, df), abs=1e-3)


def test_dunnett_quantile_by_simulation():
    """P(max |T_i| <= c) = 0.95 for k t statistics sharing one baseline, drawn directly."""
    rng, k, df = _rng(1), 6, 12
    u = rng.standard_normal((200_000, k + 1))
    s = np.sqrt(rng.chisquare(df, 200_000) / df)
    t = (u[:, 1:] - u[:, :1]) / math.sqrt(2) / s[:, None]
    inside = (np.abs(t).max(axis=1) <= stats_design.dunnett_quantile(k, df)).mean()
    assert inside == pytest.approx(0.95, abs=0.003)


def test_holm_by_hand():
    assert stats_design.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats_design.holm([0.5, 0.9]) == [1.0, 1.0]


def test_two_arms_against_one_is_the_paired_t_interval():
    a, b = [0.31, 0.42, 0.38, 0.29, 0.40], [0.30, 0.35, 0.33, 0.30, 0.31]
    (only,) = stats_design.many_vs_one({"b": dict(enumerate(b)), "a": dict(enumerate(a))}, "b",
                                adjust="none")
    paired = stats.paired_interval(a, b)
    assert (only.interval.mean, only.interval.low, only.interval.high) == pytest.approx(
        (paired.mean, paired.low, paired.high))
    assert only.p == pytest.approx(sps.ttest_rel(a, b).pvalue)
    (dunnett,) = stats_design.many_vs_one({"b": dict(enumerate(b)), "a": dict(enumerate(a))}, "b")
    assert dunnett.interval.low == pytest.approx(paired.low, abs=1e-4)


def test_many_vs_one_pools_the_residual_over_arms_and_seeds():
    """Against a plain two-way ANOVA: residual = y - arm mean - seed mean + grand mean."""
    y = _rng(2).normal(size=(4, 6)) + np.arange(6)  # 4 arms, 6 seeds, a seed effect
    table = {f"a{i}": dict(enumerate(row)) for i, row in enumerate(y)}
    out = stats_design.many_vs_one(table, "a0", adjust="none")
    resid = y - y.mean(1, keepdims=True) - y.mean(0, keepdims=True) + y.mean()
    se = math.sqrt((resid ** 2).sum() / (3 * 5) * 2 / 6)
    for i, c in enumerate(out, start=1):
        d = y[i].mean() - y[0].mean()
        assert c.interval.mean == pytest.approx(d)
        assert c.interval.high - d == pytest.approx(sps.t.ppf(0.975, 15) * se)
        assert c.p == pytest.approx(2 * sps.t.sf(abs(d) / se, 15))


def test_many_vs_one_refuses_arms_on_other_seeds():
    with pytest.raises(ValueError, match="same seeds"):
        stats_design.many_vs_one({"a": {0: 1.0, 1: 2.0}, "b": {0: 1.0, 2: 2.0}}, "a")
    with pytest.raises(ValueError, match="baseline 'c'"):
        stats_design.many_vs_one({"a": {0: 1.0, 1: 2.0}}, "c")


def test_mcnemar_exact_by_hand():
    """8 seeds where only a collapsed, 2 where only b: 2 P(X <= 2), X ~ Bin(10, 1/2)."""
    a = [1] * 8 + [0] * 2 + [1] * 3 + [0] * 2
    b = [0] * 8 + [1] * 2 + [1] * 3 + [0] * 2
    found = stats_design.paired_binary(a, b)
    assert (found.only_a, found.only_b) == (8, 2)
    assert found.p == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert found.interval.mean == pytest.approx((11 - 5) / 15)
    assert found.interval.low < found.interval.mean < found.interval.high
    swapped = stats_design.paired_binary(b, a)
    assert (swapped.interval.low, swapped.interval.high) == pytest.approx(
        (-found.interval.high, -found.interval.low))


def test_no_zero_width_interval_and_bounded_accuracies():
    same = stats.mean_interval([0.5, 0.5, 0.5], sd_floor=stats.binomial_se(0.5, 1000))
    assert same.low < 0.5 < same.high and "floored" in same.method
    clipped = stats.mean_interval([0.02, 0.0, 0.01], bounds=(0.0, 1.0))
    assert clipped.low == 0.0 and "clipped to [0, 1]" in clipped.method
    with pytest.raises(ValueError, match="sd_floor"):
        stats.mean_interval([1.0, 2.0], sd_floor=-1)


@pytest.mark.parametrize("interval, direction, margin, expected", [
    ((0.1, 0.3), "two-sided", None, stats.SUPPORTED),
    ((-0.3, -0.1), "two-sided", None, stats.SUPPORTED),
    ((-0.1, 0.1), "two-sided", None, stats.INCONCLUSIVE),
    ((-0.1, 0.1), "two-sided", 0.2, stats.REFUTED),
    ((0.1, 0.3), "two-sided", 0.5, stats.REFUTED),  # tells from 0, yet too small to matter
    ((0.1, 0.6), "two-sided", 0.5, stats.SUPPORTED),  # tells from 0, may pass the margin
    ((-0.1, 0.1), "equivalent", 0.2, stats.SUPPORTED),
    ((-0.1, 0.3), "equivalent", 0.2, stats.INCONCLUSIVE),
    ((0.25, 0.4), "equivalent", 0.2, stats.REFUTED),
    ((0.1, 0.3), "above", None, stats.SUPPORTED),
    ((0.1, 0.3), "below", None, stats.REFUTED),
])
def test_decide_reads_each_direction(interval, direction, margin, expected):
    low, high = interval
    found = stats.Interval((low + high) / 2, low, high, 5, "t")
    assert stats_design.decide(found, direction, 0.0, margin) == expected


def test_decide_refuses_a_direction_it_does_not_know_and_equivalence_without_margin():
    found = stats.Interval(0.0, -1.0, 1.0, 5, "t")
    with pytest.raises(ValueError, match="direction must be one of"):
        stats_design.decide(found, "more")
    with pytest.raises(ValueError, match="margin"):
        stats_design.decide(found, "equivalent", 0.0)


# --- simulations: coverage, and wrong verdicts under the null --------------------------------

def test_t_intervals_cover_at_their_level():
    rng = _rng(3)
    seeds = rng.normal(0, 1.0, (RUNS, 5))  # a seed effect shared by both arms
    a = 0.3 + seeds + rng.normal(0, 0.5, (RUNS, 5))
    b = seeds + rng.normal(0, 0.5, (RUNS, 5))
    cover_mean = np.mean([(lambda i: i.low <= 0.3 <= i.high)(stats.mean_interval(x - seeds[j]))
                          for j, x in enumerate(a)])
    cover_paired = np.mean([(lambda i: i.low <= 0.3 <= i.high)(stats.paired_interval(x, y))
                            for x, y in zip(a, b)])
    ratio = np.exp(rng.normal(np.log(1.8), 0.1, (RUNS, 5)))
    cover_ratio = np.mean([(lambda i: i.low <= 1.8 <= i.high)(stats.geometric_interval(x))
                           for x in ratio])
    for cover in (cover_mean, cover_paired, cover_ratio):
        assert LOW <= cover <= HIGH, (cover_mean, cover_paired, cover_ratio)


def test_two_sided_and_tost_keep_their_error_rates():
    rng = _rng(4)
    null = rng.normal(0, 1, (RUNS, 5))
    wrong_two_sided = np.mean([stats_design.decide(stats.paired_interval(x, np.zeros(5)),
                                            "two-sided") == stats.SUPPORTED for x in null])
    # at the edge of the margin the effect is not equivalent: TOST calls it so <= alpha
    edge = rng.normal(0.5, 0.3, (RUNS, 8))
    wrong_tost = np.mean([stats_design.decide(stats_design.tost_interval(stats.mean_interval, x),
                                       "equivalent", 0.0, 0.5) == stats.SUPPORTED
                          for x in edge])
    assert wrong_two_sided <= WRONG and wrong_tost <= WRONG, (wrong_two_sided, wrong_tost)
    assert wrong_two_sided >= 0.035  # the level is used, not wasted


@pytest.mark.parametrize("adjust", ["dunnett", "holm"])
def test_many_vs_one_controls_the_family_wise_error(adjust):
    """Six arms against one, five seeds, no arm differs: some arm called different (adjusted
    p < 0.05) in at most 6.5% of experiments, and every interval covers 0 together in
    93.5-96.5% (Dunnett) or at least 93.5% (Bonferroni's intervals beside Holm)."""
    rng = _rng(5 if adjust == "dunnett" else 6)
    wrong = covered = 0
    for _ in range(RUNS):
        y = rng.normal(0, 1, (7, 5)) + rng.normal(0, 2, 5)
        table = {f"a{i}": dict(enumerate(row)) for i, row in enumerate(y)}
        found = stats_design.many_vs_one(table, "a0", adjust=adjust)
        wrong += any(c.p_adjusted < 0.05 for c in found)
        covered += all(c.interval.low <= 0 <= c.interval.high for c in found)
    assert wrong / RUNS <= WRONG
    assert LOW <= covered / RUNS <= (HIGH if adjust == "dunnett" else 1.0)
    unadjusted = sum(any(c.p < 0.05 for c in stats_design.many_vs_one(
        {f"a{i}": dict(enumerate(row)) for i, row in enumerate(rng.normal(0, 1, (7, 5)))},
        "a0", adjust="none")) for _ in range(300)) / 300
    assert unadjusted > 0.15  # six tests at 5% each: the adjustment is what holds the rate


def test_paired_binary_keeps_its_level_and_covers():
    """Twelve seeds, two arms with the same collapse rate, outcomes correlated through the
    seed: McNemar's exact test calls a difference in <= 6.5%; the paired interval covers the
    true difference in >= 93.5% at a null and at an effect."""
    rng = _rng(7)
    for pa, pb in ((0.4, 0.4), (0.6, 0.25)):
        wrong = covered = 0
        for _ in range(RUNS):
            shared = rng.random(12)
            a = shared < pa if rng.random() < 0.5 else rng.random(12) < pa
            b = shared < pb
            found = stats_design.paired_binary(a, b)
            wrong += pa == pb and found.p < 0.05
            covered += found.interval.low <= pa - pb <= found.interval.high
        assert wrong / RUNS <= WRONG and covered / RUNS >= LOW, (pa, pb, wrong, covered)


def test_clopper_pearson_covers():
    rng = _rng(8)
    for p in (0.1, 0.5, 0.8):
        ks = rng.binomial(12, p, RUNS)
        hits = {k: (lambda i: i.low <= p <= i.high)(stats.proportion_interval(k, 12))
                for k in range(13)}  # one interval per count
        covered = np.mean([hits[int(k)] for k in ks])
        assert covered >= LOW, (p, covered)


# --- seeds until decided -------------------------------------------------------------------------

def test_the_spending_adds_up_and_the_early_looks_spend_less_with_obrien_fleming():
    for spending in ("pocock", "obrien-fleming"):
        plan = stats_design.SequentialPlan((5, 10, 20), 0.05, spending)
        assert sum(plan.spent()) == pytest.approx(0.05) and min(plan.spent()) > 0
    late = stats_design.SequentialPlan(spending="obrien-fleming").spent()
    assert late[0] < late[1] < late[2]
    with pytest.raises(ValueError, match="looks must be increasing"):
        stats_design.SequentialPlan((10, 5))


@pytest.mark.parametrize("spending", ["pocock", "obrien-fleming"])
def test_stopping_at_the_first_decided_look_keeps_the_error_rate(spending):
    """No effect: a claim that the effect lies above 0 (or differs from it) is called
    supported in <= 6.5% of experiments though it may stop at any of three looks; naive
    looks at 95% each call it more often."""
    rng, plan = _rng(9), stats_design.SequentialPlan((5, 10, 20), 0.05, spending)
    null = rng.normal(0, 1, (RUNS, 20))
    wrong = sum(stats_design.sequential_decide(x, plan, "two-sided").verdict == stats.SUPPORTED
                for x in null) / RUNS
    naive = sum(any(stats_design.decide(stats.mean_interval(x[:n]), "two-sided") == stats.SUPPORTED
                    for n in (5, 10, 20)) for x in null) / RUNS
    assert wrong <= WRONG and naive > wrong, (wrong, naive)


def test_a_clear_effect_stops_early_and_says_at_how_many_seeds():
    rng, plan = _rng(10), stats_design.SequentialPlan()
    found = [stats_design.sequential_decide(x, plan, "above") for x in rng.normal(3.0, 1.0, (200, 20))]
    assert all(f.verdict == stats.SUPPORTED for f in found)
    assert np.mean([f.seeds == 5 for f in found]) > 0.8
    with pytest.raises(ValueError, match="first look needs 5 seeds"):
        stats_design.sequential_decide([1.0, 2.0], plan, "above")


def test_seeds_needed_is_where_the_detectable_effect_meets_the_observed_one():
    interval = stats.mean_interval([0.5, -0.3, 1.2, 0.1, 0.9])
    n = stats_design.seeds_needed(interval)
    sd = float(np.std([0.5, -0.3, 1.2, 0.1, 0.9], ddof=1))
    assert stats.min_detectable(sd, n) <= interval.mean < stats.min_detectable(sd, n - 1)
    # by simulation: at that many seeds the effect is found about 80% of the time
    rng = _rng(11)
    found = np.mean([stats.mean_interval(rng.normal(interval.mean, sd, n)).low > 0
                     for _ in range(RUNS)])
    assert 0.75 <= found <= 0.88, found


# --- each arm its own spread; the exact test decides paired 0/1 outcomes -------------------------

def _bound(nominal: float, runs: int = RUNS) -> float:
    """The most a false-verdict rate may read: nominal plus 3 Monte Carlo standard errors."""
    return nominal + 3 * math.sqrt(nominal * (1 - nominal) / runs)


def test_one_collapsed_seed_gets_no_decisive_interval_from_the_others_spread():
    """Claim 10's dppo_kl against grpo: differences -36.8, -2.9, 0.3, -4.7, -2.4 (one seed
    collapsed) among 22 arms of SD about 2. The pooled residual lends it the others' spread
    and an interval below 0; its own paired differences give none."""
    rng = _rng(20)
    base = rng.normal(0.5, 0.02, 5)
    table = {"grpo": dict(enumerate(base)),
             "dppo_kl": dict(enumerate(base + np.array([-36.8, -2.9, 0.3, -4.7, -2.4]) / 100))}
    for i in range(22):
        table[f"arm{i}"] = dict(enumerate(base + rng.normal(0, 0.02, 5)))
    pooled = {c.arm: c for c in stats_design.many_vs_one(table, "grpo")}["dppo_kl"]
    own = {c.arm: c for c in stats_design.paired_vs_one(table, "grpo")}["dppo_kl"]
    assert pooled.interval.high < 0  # decisive, from the other arms' spread
    assert own.interval.low < 0 < own.interval.high  # not decisive from its own
    assert "each arm its own spread" in own.interval.method


@pytest.mark.parametrize("spread", ["one arm 8x", "a collapse tail"])
def test_arms_against_one_keep_the_family_wise_level_with_unequal_spreads(spread):
    """Five arms against one, five seeds, no arm differs: 'some arm lies above' at a look that
    spends 1.55% a side (96.9%) is read in at most 1.55% + 3 MC SE of 2,000 experiments,
    with one arm 8 times the others' spread, or every arm's differences from a heavy tail
    (a seed collapses, -30 or +30, with probability 5% each side)."""
    rng = _rng(21 if spread == "one arm 8x" else 22)
    level, side = 0.969, 0.0155
    wrong = 0
    for _ in range(RUNS):
        seed_effect = rng.normal(0, 2, 5)
        table = {"base": dict(enumerate(seed_effect + rng.normal(0, 1, 5)))}
        for i in range(5):
            if spread == "one arm 8x":
                noise = rng.normal(0, 8 if i == 0 else 1, 5)
            else:
                noise = rng.normal(0, 1, 5) + 30 * rng.choice([-1, 0, 1], 5, p=[0.05, 0.9, 0.05])
            table[f"a{i}"] = dict(enumerate(seed_effect + noise))
        found = stats_design.paired_vs_one(table, "base", confidence=level)
        wrong += any(stats_design.decide(c.interval, "above") == stats.SUPPORTED for c in found)
    assert wrong / RUNS <= _bound(side), (spread, wrong / RUNS)


def test_the_exact_test_holds_a_paired_collapse_at_its_level_for_every_null_table():
    """Every paired 0/1 table at n = 5, under the null that each discordant seed is a coin
    (McNemar's): the chance of 'supported' at a look spending 1.55% a side is at most 1.55%,
    whatever the number of discordant seeds; the Newcombe interval alone says 'supported' at
    4 of 4 discordant (and one seed where both collapse): a null rate of 1/16."""
    from scipy import stats as sps

    side = 0.0155
    interval_only = 0.0
    for discordant in range(6):
        for both in range(6 - discordant):
            rate = by_interval = 0.0
            for only_a in range(discordant + 1):
                a = [1] * both + [1] * only_a + [0] * (discordant - only_a)
                b = [1] * both + [0] * only_a + [1] * (discordant - only_a)
                pad = 5 - len(a)
                found = stats_design.paired_binary(a + [0] * pad, b + [0] * pad, 0.969)
                pmf = sps.binom.pmf(only_a, discordant, 0.5)
                if stats_design.decide_binary(found, "above") == stats.SUPPORTED:
                    rate += pmf
                if stats_design.decide(found.interval, "above") == stats.SUPPORTED:
                    by_interval += pmf
            assert rate <= side, (discordant, both, rate)
            interval_only = max(interval_only, by_interval)
    assert interval_only == pytest.approx(1 / 16)


def test_a_two_sided_binary_claim_is_refuted_by_its_margin_without_an_exact_side():
    """60 paired seeds with the same outcome on each: no discordant seed, so McNemar's test
    decides no side, yet Newcombe's interval lies well inside +-0.3: the difference the claim
    asserts is too small to matter."""
    same = [1] * 30 + [0] * 30
    found = stats_design.paired_binary(same, same)
    assert -0.3 < found.interval.low and found.interval.high < 0.3
    assert stats_design.decide_binary(found, "two-sided", 0.0, 0.3) == stats.REFUTED
    assert stats_design.decide_binary(found, "two-sided") == stats.INCONCLUSIVE
