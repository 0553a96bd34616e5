"""Tests of the monitoring metrics against plain Python loops over lists of floats."""

import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.formulas import metrics as M

REPO = Path(__file__).resolve().parents[1]

FRACTIONS = ("rollout/frac_zero_std", "rollout/truncated_frac", "clip/low", "clip/high",
             "clip/total", "clip/dual")


# ------------------------------------------------------------------ plain reference loops

def mean(xs):
    return sum(xs) / len(xs)


def std(xs, ddof=0):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - ddof))


def groups(xs, g):
    return [xs[i:i + g] for i in range(0, len(xs), g)]


def selected(x, mask):
    """The values of nested lists x where mask is 1, in row order."""
    return [v for row, mrow in zip(x, mask) for v, m in zip(row, mrow) if m]


def row_means(adv, mask):
    out = []
    for row, mrow in zip(adv, mask):
        vals = [v for v, m in zip(row, mrow) if m]
        out.append(mean(vals) if vals else 0.0)
    return out


def ref_gav(per_row, g, ddof=0):
    return mean([std(grp, ddof) for grp in groups(per_row, g)])


def ref_clip(logp, old, adv, mask, eps_low, eps_high, c=None):
    low = high = dual = n = 0
    for i, (lrow, orow, mrow) in enumerate(zip(logp, old, mask)):
        for t, (lp, o, m) in enumerate(zip(lrow, orow, mrow)):
            if not m:
                continue
            a = adv[i][t] if isinstance(adv[i], list) else adv[i]
            ratio = math.exp(lp - o)
            n += 1
            low += ratio < 1 - eps_low and a < 0
            high += ratio > 1 + eps_high and a > 0
            if c is not None:
                clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
                dual += a < 0 and max(ratio, clipped) > c
    n = max(n, 1)
    return low / n, high / n, dual / n


def ref_cgc(rewards, g, eps=1e-8):
    cvs = [std(grp) / abs(mean(grp)) for grp in groups(rewards, g) if abs(mean(grp)) > eps]
    return mean(cvs) if cvs else 0.0


def ref_explained_variance(values, returns, mask):
    r = selected(returns, mask)
    d = [ri - vi for ri, vi in zip(r, selected(values, mask))]
    if not r:
        return 0.0
    if max(r) == min(r):
        return 1.0 if max(d) == min(d) else 0.0
    return 1 - std(d) ** 2 / std(r) ** 2


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def close(a, b):
    return a == pytest.approx(b, rel=1e-5, abs=1e-6)


# mixed lengths: a full row, a single-token completion, an all-masked row, a middle one
MASK = [[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0],
        [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]


def rand(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).tolist()


# ------------------------------------------------------------------ reward_stats

def test_reward_stats_hand_case():
    r = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]
    out = M.reward_stats(t(r), 4)
    assert close(out["rollout/reward_mean"], 5 / 12)
    assert close(out["rollout/reward_std"], std(r))
    assert out["rollout/frac_zero_std"] == pytest.approx(2 / 3)
    # only the first group varies: std of [1, 0, 1, 1] is sqrt(3)/4
    assert close(out["rollout/group_reward_std"], math.sqrt(3) / 4 / 3)


def test_reward_stats_random_against_loop():
    r = rand(12, 0)
    out = M.reward_stats(t(r), 3)
    assert close(out["rollout/reward_mean"], mean(r))
    assert close(out["rollout/reward_std"], std(r))
    assert close(out["rollout/group_reward_std"], mean([std(g) for g in groups(r, 3)]))
    assert out["rollout/frac_zero_std"] == 0.0


def test_reward_stats_group_of_one_and_unrepresentable_equal_values():
    out = M.reward_stats(t([0.3, 0.7]), 1)
    assert out["rollout/frac_zero_std"] == 1.0 and out["rollout/group_reward_std"] == 0.0
    # equal values whose fp32 mean is inexact still give a std of exactly 0
    out = M.reward_stats(t([0.1] * 7), 7)
    assert out["rollout/reward_std"] == 0.0 and out["rollout/group_reward_std"] == 0.0


# ------------------------------------------------------------------ gav

def test_gav_hand_case_both_stds():
    a = [1.0, -1.0, 0.0, 0.0]  # one informative group, one zero-std group
    assert close(M.gav(t(a), 2), 0.5)
    assert close(M.gav(t(a), 2, unbiased=True), math.sqrt(2) / 2)


@pytest.mark.parametrize("unbiased", [False, True])
def test_gav_rows_against_loop(unbiased):
    a = rand(12, 1)
    assert close(M.gav(t(a), 4, unbiased=unbiased), ref_gav(a, 4, ddof=int(unbiased)))


def test_gav_tokens_uses_row_means_over_unmasked_tokens():
    adv = rand((8, 4), 2)
    got = M.gav(t(adv), 4, mask=t(MASK))
    assert close(got, ref_gav(row_means(adv, MASK), 4))  # all-masked row counts as 0


def test_gav_uniform_tokens_equal_rows():
    a = rand(8, 3)
    mask = [row if any(row) else [1, 0, 0, 0] for row in MASK]  # every row has a token
    tokens = [[ai * m for m in mrow] for ai, mrow in zip(a, mask)]
    assert close(M.gav(t(tokens), 4, mask=t(mask)), M.gav(t(a), 4))
    assert close(M.gav(t(a), 4), ref_gav(a, 4))


def test_gav_degenerate():
    assert M.gav(t([0.3, 0.3, 0.3]), 3) == 0.0
    assert M.gav(t([0.3, -2.0]), 1) == 0.0
    with pytest.raises(ValueError, match="group_size >= 2"):
        M.gav(t([0.3, -2.0]), 1, unbiased=True)
    with pytest.raises(ValueError, match="mask is required"):
        M.gav(t(rand((4, 3), 0)), 2)


# ------------------------------------------------------------------ tlcr and ratios

def test_tlcr_hand_case():
    # ratios chosen away from the boundaries; old_logp = 0 so logp = log(ratio)
    ratios = [[0.5, 0.5, 1.5, 1.5], [4.0, 1.0, 0.1, 9.0]]
    adv = [[-1.0, 1.0, 1.0, -1.0], [-1.0, -1.0, 2.0, 1.0]]
    mask = [[1, 1, 1, 1], [1, 1, 1, 0]]  # the last token (ratio 9, A > 0) is padding
    logp = [[math.log(x) for x in row] for row in ratios]
    out = M.tlcr(t(logp), torch.zeros(2, 4), t(adv), t(mask), eps_low=0.2, eps_high=0.28,
                 dual_clip=3.0)
    assert out["clip/low"] == pytest.approx(1 / 7)   # 0.5 with A < 0
    assert out["clip/high"] == pytest.approx(1 / 7)  # 1.5 with A > 0
    assert out["clip/total"] == pytest.approx(2 / 7)
    assert out["clip/dual"] == pytest.approx(1 / 7)  # 4.0 with A < 0
    assert "clip/dual" not in M.tlcr(t(logp), torch.zeros(2, 4), t(adv), t(mask),
                                     eps_low=0.2, eps_high=0.28)


def test_tlcr_against_loop_rows_and_tokens():
    logp, old = rand((8, 4), 4, 0.3), rand((8, 4), 5, 0.3)
    a_rows = rand(8, 6)
    a_tok = rand((8, 4), 7)
    for adv in (a_rows, a_tok):
        out = M.tlcr(t(logp), t(old), t(adv), t(MASK), eps_low=0.2, eps_high=0.28,
                     dual_clip=1.3)
        low, high, dual = ref_clip(logp, old, adv, MASK, 0.2, 0.28, 1.3)
        assert close(out["clip/low"], low) and close(out["clip/high"], high)
        assert close(out["clip/dual"], dual) and close(out["clip/total"], low + high)
    assert low + high > 0  # the case is not trivially empty
    # a row advantage broadcasts like the same value on every token
    a_exp = [[a] * 4 for a in a_rows]
    assert (M.tlcr(t(logp), t(old), t(a_rows), t(MASK), eps_low=0.2, eps_high=0.2)
            == M.tlcr(t(logp), t(old), t(a_exp), t(MASK), eps_low=0.2, eps_high=0.2))


def test_tlcr_all_masked_and_on_policy():
    logp = t(rand((2, 3), 8))
    zero = torch.zeros(2, 3)
    out = M.tlcr(logp, logp + 5, t([1.0, -1.0]), zero, eps_low=0.2, eps_high=0.2, dual_clip=3)
    assert out == {"clip/low": 0.0, "clip/high": 0.0, "clip/total": 0.0, "clip/dual": 0.0}
    out = M.tlcr(logp, logp, t([1.0, -1.0]), torch.ones(2, 3), eps_low=0.2, eps_high=0.2)
    assert out["clip/total"] == 0.0  # rho = 1: one update per rollout never clips
    assert M.ratio_stats(logp, logp + 5, zero) == {"ratio/mean": 1.0, "ratio/max": 1.0}


def test_ratio_stats_against_loop():
    logp, old = rand((8, 4), 9, 0.5), rand((8, 4), 10, 0.5)
    ratios = [math.exp(a - b) for a, b in zip(selected(logp, MASK), selected(old, MASK))]
    out = M.ratio_stats(t(logp), t(old), t(MASK))
    assert close(out["ratio/mean"], mean(ratios)) and close(out["ratio/max"], max(ratios))


# ------------------------------------------------------------------ cgc

def test_cgc_hand_case():
    r = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # groups: cv 0; cv sqrt(3)/4 / 0.75; mean 0 -> skipped
    assert close(M.cgc(t(r), 4), (0 + math.sqrt(3) / 3) / 2)
    assert close(M.cgc(t(r), 4), ref_cgc(r, 4))


def test_cgc_degenerate_and_signed():
    assert M.cgc(t([0.0] * 6), 3) == 0.0              # every prompt skipped
    assert M.cgc(t([-1.0, 1.0, 2.0, 2.0]), 2) == 0.0  # mean 0 skipped, constant group cv 0
    assert close(M.cgc(t([-1.0, -3.0]), 2), 0.5)      # std 1 / |mean -2|
    assert M.cgc(t([0.5, 0.5]), 1) == 0.0
    r = rand(12, 11)
    assert close(M.cgc(t(r), 3), ref_cgc(r, 3))


# ------------------------------------------------------------------ advantage, kl, entropy

def test_advantage_stats_rows_and_tokens():
    a = rand(8, 12)
    out = M.advantage_stats(t(a))
    assert close(out["adv/mean"], mean(a)) and close(out["adv/std"], std(a))
    assert close(out["adv/min"], min(a)) and close(out["adv/max"], max(a))
    assert M.advantage_stats(t(a), t(MASK)) == out  # a (N,) advantage ignores the mask
    tok = rand((8, 4), 13)
    vals = selected(tok, MASK)
    out = M.advantage_stats(t(tok), t(MASK))
    assert close(out["adv/mean"], mean(vals)) and close(out["adv/std"], std(vals))
    assert close(out["adv/min"], min(vals)) and close(out["adv/max"], max(vals))
    every = [v for row in tok for v in row]
    assert close(M.advantage_stats(t(tok))["adv/mean"], mean(every))
    empty = M.advantage_stats(t(tok), torch.zeros(8, 4))
    assert set(empty.values()) == {0.0}


def test_masked_means_ignore_padding_even_nan():
    x = rand((8, 4), 14)
    want = mean(selected(x, MASK))
    padded = t(x).masked_fill(t(MASK) == 0, float("nan"))
    assert close(M.masked_mean(padded, t(MASK)), want)
    assert close(M.kl_stats(padded, t(MASK))["policy/kl"], want)
    assert close(M.entropy_stats(padded, t(MASK))["policy/entropy"], want)
    assert M.masked_mean(padded, torch.zeros(8, 4)) == 0.0
    assert M.masked_mean(t([[2.5]]), t([[1]])) == 2.5  # a single-token completion


# ------------------------------------------------------------------ lengths, explained variance

def test_length_stats_mixed_lengths():
    truncated = [True, False, False, False, False, False, True, False]
    out = M.length_stats(t(MASK), torch.tensor(truncated))
    lengths = [sum(row) for row in MASK]
    assert out == {"rollout/length_mean": mean(lengths), "rollout/length_max": 4.0,
                   "rollout/truncated_frac": 0.25}
    assert M.length_stats(t([[1, 0, 0]])) == {"rollout/length_mean": 1.0,
                                             "rollout/length_max": 1.0}


def test_explained_variance_against_loop_and_degenerate():
    v, r = rand((8, 4), 15), rand((8, 4), 16)
    assert close(M.explained_variance(t(v), t(r), t(MASK)), ref_explained_variance(v, r, MASK))
    m = t(MASK)
    assert close(M.explained_variance(t(r), t(r), m), 1.0)
    assert close(M.explained_variance(t(r) + 3.0, t(r), m), 1.0)  # an offset is not penalised
    const = torch.full((8, 4), 0.1)
    assert M.explained_variance(const, const, m) == 1.0
    assert M.explained_variance(const + t(v), const, m) == 0.0
    assert M.explained_variance(t(v), t(r), torch.zeros(8, 4)) == 0.0
    ret = [1.0, 2.0, 3.0]
    assert close(M.explained_variance(t([2.0] * 3), t(ret), t([1, 1, 1])), 0.0)  # V = mean R


# ------------------------------------------------------------------ dtypes and validation

def test_bf16_inputs_give_fp32_results_of_the_rounded_values():
    bf = torch.bfloat16
    r, a = t(rand(8, 17), bf), t(rand((8, 4), 18), bf)
    logp, old = t(rand((8, 4), 19, 0.3), bf), t(rand((8, 4), 20, 0.3), bf)
    rl, al, lpl, ol = (x.float().tolist() for x in (r, a, logp, old))
    assert close(M.reward_stats(r, 4)["rollout/reward_std"], std(rl))
    assert close(M.gav(a, 4, mask=t(MASK)), ref_gav(row_means(al, MASK), 4))
    out = M.tlcr(logp, old, a, t(MASK, bf), eps_low=0.2, eps_high=0.2)
    assert close(out["clip/total"], sum(ref_clip(lpl, ol, al, MASK, 0.2, 0.2)[:2]))
    assert close(M.masked_mean(a, t(MASK, bf)), mean(selected(al, MASK)))
    assert isinstance(M.cgc(r, 4), float)
    assert close(M.explained_variance(a, logp, t(MASK)), ref_explained_variance(al, lpl, MASK))


@pytest.mark.parametrize("call, match", [
    (lambda: M.reward_stats(t([1.0, 0.0, 1.0]), 2), "group_size=2 must divide"),
    (lambda: M.reward_stats(t([1.0, 0.0]), 0), "group_size"),
    (lambda: M.reward_stats(t([[1.0, 0.0]]), 1), "rewards"),
    (lambda: M.gav(t([[1.0]]), 1, mask=t([[1, 1]])), "mask"),
    (lambda: M.masked_mean(t([[1.0, 2.0]]), t([[1, 2]])), "mask must hold only 0 and 1"),
    (lambda: M.tlcr(torch.zeros(2, 3), torch.zeros(2, 2), t([1.0, 1.0]), torch.ones(2, 3),
                    eps_low=0.2, eps_high=0.2), "old_logp"),
    (lambda: M.tlcr(torch.zeros(2, 3), torch.zeros(2, 3), t([1.0]), torch.ones(2, 3),
                    eps_low=0.2, eps_high=0.2), "advantages"),
    (lambda: M.tlcr(torch.zeros(2, 3), torch.zeros(2, 3), t([1.0, 1.0]), torch.ones(2, 3),
                    eps_low=1.0, eps_high=0.2), "eps_low"),
    (lambda: M.length_stats(torch.ones(2, 3), t([1, 0, 0])), "truncated"),
    (lambda: M.explained_variance(torch.zeros(2, 3), torch.zeros(3, 2), torch.ones(2, 3)),
     "returns"),
    (lambda: M.cgc(t([1.0, 0.0]), 2, eps=-1.0), "eps"),
])
def test_validation_names_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------ step_metrics and the table

def full_inputs():
    return dict(rewards=t(rand(8, 21)), group_size=4, advantages=t(rand(8, 22)), mask=t(MASK),
                logp=t(rand((8, 4), 23, 0.3)), old_logp=t(rand((8, 4), 24, 0.3)),
                dual_clip=3.0, kl=t(rand((8, 4), 25)).abs(), entropy=t(rand((8, 4), 26)).abs(),
                truncated=torch.zeros(8, dtype=torch.bool), values=t(rand((8, 4), 27)),
                returns=t(rand((8, 4), 28)))


def test_step_metrics_assembles_the_functions():
    x = full_inputs()
    out = M.step_metrics(**x, extra={"loss/policy": torch.tensor(0.5), "perf/step_s": 2})
    m = x["mask"]
    want = (M.reward_stats(x["rewards"], 4) | M.length_stats(m, x["truncated"])
            | M.advantage_stats(x["advantages"]) | {"adv/gav": M.gav(x["advantages"], 4)}
            | M.ratio_stats(x["logp"], x["old_logp"], m)
            | M.tlcr(x["logp"], x["old_logp"], x["advantages"], m, eps_low=0.2, eps_high=0.2,
                     dual_clip=3.0)
            | M.kl_stats(x["kl"], m) | M.entropy_stats(x["entropy"], m)
            | {"value/explained_var": M.explained_variance(x["values"], x["returns"], m)}
            | {"loss/policy": 0.5, "perf/step_s": 2.0})
    assert out == want
    assert all(type(v) is float for v in out.values())


def test_step_metrics_skips_missing_sections():
    out = M.step_metrics(rewards=t([1.0, 0.0]), group_size=2)
    assert set(out) == {"rollout/reward_mean", "rollout/reward_std", "rollout/frac_zero_std",
                        "rollout/group_reward_std"}
    out = M.step_metrics(rewards=t([1.0, 0.0]), group_size=2, truncated=t([1, 0]))
    assert out["rollout/truncated_frac"] == 0.5
    x = full_inputs()
    del x["advantages"]
    assert "clip/low" not in M.step_metrics(**x) and "ratio/mean" in M.step_metrics(**x)


@pytest.mark.parametrize("change, match", [
    ({"mask": None}, "mask"),
    ({"old_logp": None}, "old_logp"),
    ({"returns": None}, "returns"),
    ({"kl": torch.zeros(6, 4)}, "kl must have N = 8"),
    ({"extra": {"lr": 1e-3}}, "namespaced"),
    ({"extra": {"clip/low": 0.1}}, "also computed"),
    ({"extra": {"loss/policy": "high"}}, "must be a number"),
])
def test_step_metrics_rejects(change, match):
    with pytest.raises(ValueError, match=match):
        M.step_metrics(**(full_inputs() | change))


def test_every_emitted_key_is_defined_and_documented():
    out = M.step_metrics(**full_inputs())
    assert set(out) <= set(M.METRICS)
    assert all(re.fullmatch(r"[a-z]+/\S+", k) for k in M.METRICS)
    doc = (REPO / "docs" / "metrics.md").read_text()
    assert all(f"`{key}`" in doc for key in M.METRICS)
    assert M.metrics_table() in doc, "regenerate the table in docs/metrics.md from metrics_table()"
    assert len(M.metrics_table().splitlines()) == len(M.METRICS) + 2


@pytest.mark.cuda
def test_step_metrics_on_cuda_match_cpu():
    x = full_inputs()
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    want, got = M.step_metrics(**x), M.step_metrics(**on_gpu)
    assert set(got) == set(want)
    assert all(close(got[k], want[k]) for k in want)


def test_cases_hypothesis_found():
    # 2/3 + 1/3 in fp32 sums to just above 1; the total is counted, not summed
    logp, old = t([[0.0], [-1.0], [-1.0]]), t([[-1.0], [0.0], [0.0]])
    out = M.tlcr(logp, old, t([0.5, -1.0, -1.0]), torch.ones(3, 1), eps_low=0.0, eps_high=0.0)
    assert out["clip/low"] == pytest.approx(2 / 3) and out["clip/high"] == pytest.approx(1 / 3)
    assert out["clip/total"] == 1.0
    # returns whose spread's square underflows fp32: still a finite explained variance
    ev = M.explained_variance(torch.zeros(3), t([0.0, 0.0, 1.1755e-38]), torch.ones(3))
    assert math.isfinite(ev)


# ------------------------------------------------------------------ properties

@st.composite
def batches(draw):
    b, g, n_t = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    n = b * g
    small = st.one_of(st.sampled_from([0.0, 0.5, 1.0, -1.0]),
                      st.floats(-1e3, 1e3, allow_nan=False, width=32))
    rows = lambda s: st.lists(s, min_size=n, max_size=n)  # noqa: E731
    grid = lambda s: rows(st.lists(s, min_size=n_t, max_size=n_t))  # noqa: E731
    logps = st.floats(-20, 0, width=32)
    return dict(rewards=t(draw(rows(small))), group_size=g,
                advantages=t(draw(st.one_of(rows(small), grid(small)))),
                mask=t(draw(grid(st.integers(0, 1)))), logp=t(draw(grid(logps))),
                old_logp=t(draw(grid(logps))), dual_clip=3.0, kl=t(draw(grid(small))),
                entropy=t(draw(grid(small))), truncated=t(draw(rows(st.booleans())), torch.bool),
                values=t(draw(grid(small))), returns=t(draw(grid(small))),
                eps_low=draw(st.floats(0, 0.9)), eps_high=draw(st.floats(0, 1)))


@settings(max_examples=100, deadline=None)
@given(batches())
def test_properties_for_any_finite_batch(x):
    out = M.step_metrics(**x)
    assert all(math.isfinite(v) for v in out.values()), out
    assert out["adv/gav"] >= 0 and out["rollout/group_reward_std"] >= 0
    assert all(0 <= out[k] <= 1 for k in FRACTIONS)
    assert out["value/explained_var"] <= 1 + 1e-5
    assert 0 <= M.cgc(x["rewards"], x["group_size"]) < math.inf
    if x["group_size"] >= 2:
        assert M.gav(x["advantages"], x["group_size"], mask=x["mask"], unbiased=True) >= 0


# ------------------------------------------- what adv/gav reduces to, per estimator

def _binary_rewards(b, g, seed, p=0.4):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(b * g, generator=gen) < p).float()  # (N,)


def _frac_zero_std(r, g):
    return mean([float(max(grp) == min(grp)) for grp in groups(r, g)])


@pytest.mark.parametrize("g", [2, 4, 8])
def test_gav_of_grpo_counts_the_mixed_groups(g):
    """grpo (unbiased std, the default): each mixed group contributes sqrt((G-1)/G) up to eps,
    every equal group 0; with the population std, 1."""
    from labkit.formulas.advantages import grpo

    r = _binary_rewards(64, g, seed=g)
    live = 1 - _frac_zero_std(r.tolist(), g)
    assert 0 < live < 1  # both kinds of group are present, so the test can tell them apart
    z = grpo(r, g, scale="group", unbiased=True)
    assert M.gav(z, g) == pytest.approx(live * math.sqrt((g - 1) / g), rel=1e-3)
    assert M.gav(grpo(r, g, scale="group", unbiased=False), g) == pytest.approx(live, rel=1e-3)


@pytest.mark.parametrize("binary", [True, False])
def test_gav_of_dr_grpo_and_rloo_is_the_group_reward_std(binary):
    from labkit.formulas.advantages import dr_grpo, rloo

    g = 6
    r = _binary_rewards(32, g, seed=1) if binary else \
        torch.randn(32 * g, generator=torch.Generator().manual_seed(2)) * 3
    spread = mean([std(grp) for grp in groups(r.tolist(), g)])  # rollout/group_reward_std
    assert spread > 0
    assert M.reward_stats(r, g)["rollout/group_reward_std"] == pytest.approx(spread, rel=1e-5)
    assert M.gav(dr_grpo(r, g), g) == pytest.approx(spread, rel=1e-5)
    assert M.gav(rloo(r, g), g) == pytest.approx(g / (g - 1) * spread, rel=1e-5)


def _plain_gae(rewards, values, mask, gamma, lam):
    """GAE by a loop over each row's real tokens, V = 0 after the last one."""
    out = []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        real = [t for t, m in enumerate(m_row) if m]
        a_row, next_v, next_a = [0.0] * len(m_row), 0.0, 0.0
        for t in reversed(real):
            next_a = r_row[t] + gamma * next_v - v_row[t] + gamma * lam * next_a
            a_row[t], next_v = next_a, v_row[t]
        out.append(a_row)
    return out


def test_gav_of_ppo_is_the_gav_of_row_means_of_whitened_gae():
    """PPO: whitened GAE over the batch's tokens, each row reduced to its tokens' mean."""
    from labkit.formulas.advantages import ppo_advantages
    from labkit.formulas.losses import ppo_token_rewards

    g, n, t_len = 4, 16, 7
    gen = torch.Generator().manual_seed(5)
    r = _binary_rewards(n // g, g, seed=3)
    values = torch.randn(n, t_len, generator=gen) * 0.3
    lengths = torch.randint(1, t_len + 1, (n,), generator=gen)
    mask = (torch.arange(t_len)[None] < lengths[:, None]).float()  # (N, T)
    token_rewards = ppo_token_rewards(r, mask)
    adv, _ = ppo_advantages(token_rewards, values, mask, gamma=1.0, lam=0.95)
    a = _plain_gae(token_rewards.tolist(), values.tolist(), mask.tolist(), 1.0, 0.95)
    flat = selected(a, mask.tolist())
    mu, sd = mean(flat), std(flat, ddof=1)
    whitened = [[(x - mu) / (sd + 1e-8) for x in row] for row in a]
    want = ref_gav(row_means(whitened, mask.tolist()), g)
    assert M.gav(adv, g, mask=mask) == pytest.approx(want, rel=1e-4)
    assert std(selected(whitened, mask.tolist())) == pytest.approx(1, abs=0.05)  # whitened


def test_form_stats_by_hand():
    texts = ["1+2=3. \\boxed{3}", "\\boxed{3}", "\\boxed{4}", "1+2=3,3+4=7. \\boxed{7}"]
    out = M.form_stats(texts, [1.0, 1.0, 0.0, 0.0], [10, 4, 4, 16])
    assert out == {"rollout/worked_frac": 0.5, "rollout/acc_worked": 0.5,
                   "rollout/acc_direct": 0.5, "rollout/length_correct": 7.0,
                   "rollout/length_incorrect": 10.0,
                   "rollout/steps_mean": 0.75}  # 1, 0, 0 and 2 steps written
    direct_only = M.form_stats(["\\boxed{3}"], [1.0], [4])
    assert direct_only == {"rollout/worked_frac": 0.0, "rollout/acc_direct": 1.0,
                           "rollout/length_correct": 4.0, "rollout/steps_mean": 0.0}
    assert set(out) <= set(M.METRICS)
    with pytest.raises(ValueError, match="same N"):
        M.form_stats(["\\boxed{3}"], [1.0, 0.0], [4])
