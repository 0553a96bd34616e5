"""Advantages against plain reference loops over Python floats, plus edge cases and properties."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from labkit.formulas import advantages as adv
from labkit.formulas import estimators as est

TOL = dict(rtol=1e-6, atol=1e-6)
TOL64 = dict(rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ reference loops (floats)

def ref_mean(xs):
    return sum(xs) / len(xs)


def ref_std(xs, unbiased):
    mu = ref_mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - (1 if unbiased else 0)))


def ref_grpo(rewards, g, scale, eps, unbiased):
    out = []
    for b in range(len(rewards) // g):
        group = rewards[b * g:(b + 1) * g]
        mu = ref_mean(group)
        if scale == "none":
            out += [r - mu for r in group]
            continue
        sd = ref_std(group, unbiased) if scale == "group" else ref_std(rewards, unbiased)
        out += [(r - mu) / (sd + eps) for r in group]
    return out


def ref_rloo(rewards, g):
    out = []
    for b in range(len(rewards) // g):
        group = rewards[b * g:(b + 1) * g]
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i]
            out.append(r - sum(others) / (g - 1))
    return out


def ref_to_tokens(a, mask, mode, gamma):
    out = []
    for ai, row in zip(a, mask):
        idx = [t for t, m in enumerate(row) if m]
        line = [0.0] * len(row)
        n = len(idx)
        weights = [1.0] * n if mode == "uniform" else [gamma ** (n - 1 - k) for k in range(n)]
        total = 1.0 if mode == "uniform" else sum(weights)
        for k, t in enumerate(idx):
            line[t] = ai * weights[k] / total
        out.append(line)
    return out


def ref_whiten(x, mask, eps, shift_mean, unbiased):
    vals = [v for row, mrow in zip(x, mask) for v, m in zip(row, mrow) if m]
    mu = ref_mean(vals)
    sd = ref_std(vals, unbiased) if len(vals) > 1 or not unbiased else 0.0
    return [[((v - mu) / (sd + eps) + (0.0 if shift_mean else mu)) if m else 0.0
             for v, m in zip(row, mrow)] for row, mrow in zip(x, mask)]


def ref_gae(rewards, values, mask, gamma, lam):
    """The sum form A_t = sum_k (gamma lam)^k delta_{t+k} over each row's real tokens."""
    advs, rets = [], []
    for r, v, mrow in zip(rewards, values, mask):
        idx = [t for t, m in enumerate(mrow) if m]
        vals = [v[t] for t in idx] + [0.0]  # V after the last real token is 0
        deltas = [r[t] + gamma * vals[k + 1] - vals[k] for k, t in enumerate(idx)]
        a_row, r_row = [0.0] * len(mrow), [0.0] * len(mrow)
        for k, t in enumerate(idx):
            a = sum((gamma * lam) ** j * deltas[k + j] for j in range(len(idx) - k))
            a_row[t], r_row[t] = a, a + v[t]
        advs.append(a_row)
        rets.append(r_row)
    return advs, rets


def t(x, like):
    return torch.tensor(x, dtype=like.dtype)


def random_mask(n, t_len, gen):
    """Right-padded rows of random length, plus an all-zero row, a single-token row, a hole."""
    lengths = torch.randint(0, t_len + 1, (n,), generator=gen)
    mask = (torch.arange(t_len)[None] < lengths[:, None]).int()
    mask[0] = 0
    mask[1] = 0
    mask[1, 0] = 1
    mask[2] = 1
    mask[2, t_len // 2] = 0
    return mask


# ------------------------------------------------------------------ formulas against the loops

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("unbiased", [True, False])
def test_grpo_matches_loop(scale, unbiased, dtype):
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(24, generator=gen).to(dtype)
    r[8:12] = 0.5  # one zero-std group
    got = adv.grpo(r, 4, scale=scale, eps=1e-4, unbiased=unbiased)
    want = ref_grpo(r.tolist(), 4, scale, 1e-4, unbiased)
    assert got.dtype == dtype
    assert_close(got, t(want, got), **(TOL if dtype == torch.float32 else TOL64))
    assert torch.equal(got[8:12], torch.zeros(4, dtype=dtype))


def test_grpo_default_is_group_scale_unbiased_like_torch_std():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    g = r.view(2, 4)  # (B, G)
    want = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).reshape(-1)
    assert_close(adv.grpo(r, 4), want, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dr_grpo_and_rloo_match_loops(dtype):
    gen = torch.Generator().manual_seed(1)
    r = torch.rand(15, generator=gen).to(dtype)
    tol = TOL if dtype == torch.float32 else TOL64
    assert_close(adv.dr_grpo(r, 5), t(ref_grpo(r.tolist(), 5, "none", 0.0, True), r), **tol)
    assert_close(adv.rloo(r, 5), t(ref_rloo(r.tolist(), 5), r), **tol)


@pytest.mark.parametrize("mode,gamma", [("uniform", 1.0), ("discounted", 1.0),
                                        ("discounted", 0.9), ("discounted", 0.5),
                                        ("discounted", 0.0)])
def test_to_tokens_matches_loop(mode, gamma):
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(8, generator=gen)
    mask = random_mask(8, 9, gen)
    got = adv.to_tokens(a, mask, mode=mode, gamma=gamma)
    assert got.shape == (8, 9)
    assert_close(got, t(ref_to_tokens(a.tolist(), mask.tolist(), mode, gamma), got), **TOL)
    assert torch.equal(got[0], torch.zeros(9))  # all-masked row
    assert got[1, 0] == a[1]  # EOS at once: the whole advantage on its one token
    if mode == "discounted":  # rows with tokens sum to their advantage
        assert_close(got[1:].sum(1), a[1:] * (mask[1:].sum(1) > 0), **TOL)


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("unbiased", [True, False])
def test_whiten_matches_loop(shift_mean, unbiased):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 7, generator=gen, dtype=torch.float64) * 3 + 1
    mask = random_mask(6, 7, gen)
    x[mask == 0] = float("nan")  # padding never leaks into the statistics
    got = adv.whiten(x, mask, eps=1e-8, shift_mean=shift_mean, unbiased=unbiased)
    want = ref_whiten(x.tolist(), mask.tolist(), 1e-8, shift_mean, unbiased)
    assert_close(got, t(want, got), **TOL64)
    if shift_mean:
        m = mask.bool()
        assert abs(got[m].mean().item()) < 1e-12
        assert_close(got[m].std(correction=int(unbiased)).item(), 1.0, rtol=1e-6, atol=0)


def test_whiten_fp32_and_edges():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 5, generator=gen)
    mask = random_mask(4, 5, gen)
    assert_close(adv.whiten(x, mask), t(ref_whiten(x.tolist(), mask.tolist(), 1e-8, True, True), x),
                 **TOL)
    assert torch.equal(adv.whiten(x, torch.zeros(4, 5)), torch.zeros(4, 5))
    const = torch.full((3, 4), 0.1)
    assert torch.equal(adv.whiten(const, torch.ones(3, 4)), torch.zeros(3, 4))
    assert_close(adv.whiten(const, torch.ones(3, 4), shift_mean=False), const)
    one = torch.zeros(3, 4, dtype=torch.int64)
    one[1, 2] = 1
    assert torch.isfinite(adv.whiten(x[:3, :4], one)).all()


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (1.0, 1.0), (0.99, 0.95), (0.9, 0.0),
                                       (0.5, 0.7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gae_matches_sum_form(gamma, lam, dtype):
    gen = torch.Generator().manual_seed(5)
    r = torch.randn(7, 10, generator=gen).to(dtype)
    v = torch.randn(7, 10, generator=gen).to(dtype)
    mask = random_mask(7, 10, gen)
    a, ret = adv.gae(r, v, mask, gamma=gamma, lam=lam)
    want_a, want_r = ref_gae(r.tolist(), v.tolist(), mask.tolist(), gamma, lam)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else TOL64
    assert_close(a, t(want_a, a), **tol)
    assert_close(ret, t(want_r, ret), **tol)
    assert torch.equal(a[0], torch.zeros(10, dtype=dtype))


def test_gae_single_token_and_lambda_one_is_monte_carlo():
    r = torch.tensor([[0.0, 0.0, 1.0, 9.0], [2.0, 9.0, 9.0, 9.0]])
    v = torch.tensor([[0.3, 0.2, 0.1, 9.0], [0.5, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    a, ret = adv.gae(r, v, mask, gamma=1.0, lam=1.0)
    assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]]))
    assert_close(a[1, 0], torch.tensor(1.5))  # EOS at once: r - V


# ------------------------------------------------------------------ edge cases

def test_equal_rewards_give_exact_zero_without_nan():
    r = torch.full((12,), 0.1)
    for eps in (1e-4, 1e-30, 0.0):
        for unbiased in (True, False):
            for scale in ("group", "batch"):
                assert torch.equal(adv.grpo(r, 4, scale=scale, eps=eps, unbiased=unbiased),
                                   torch.zeros(12))
    assert torch.equal(adv.rloo(r, 3), torch.zeros(12))
    assert torch.equal(adv.dr_grpo(r, 6), torch.zeros(12))


@pytest.mark.parametrize("fn", [adv.grpo, adv.dr_grpo, adv.rloo])
def test_group_errors(fn):
    with pytest.raises(ValueError, match="group_size"):
        fn(torch.ones(4), 1)
    with pytest.raises(ValueError, match="group_size"):
        fn(torch.ones(4), 0)
    with pytest.raises(ValueError, match="divisible"):
        fn(torch.ones(5), 2)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="finite"):
            fn(torch.tensor([0.0, 1.0, bad, 1.0]), 2)


def test_unknown_variants_list_the_valid_ones():
    with pytest.raises(ValueError, match="group.*batch.*none"):
        adv.grpo(torch.ones(4), 2, scale="prompt")
    with pytest.raises(ValueError, match="uniform.*discounted"):
        adv.to_tokens(torch.ones(2), torch.ones(2, 3), mode="linear")
    with pytest.raises(ValueError, match="gamma"):
        adv.to_tokens(torch.ones(2), torch.ones(2, 3), mode="discounted", gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        adv.gae(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3), lam=2.0)
    with pytest.raises(ValueError, match="mask"):
        adv.to_tokens(torch.ones(3), torch.ones(2, 3))


def test_large_rewards_stay_finite():
    r = torch.tensor([1e6, 0.0, 1e6, 0.0, 1e30, -1e30, 3e30, 0.0])
    for scale in ("group", "batch", "none"):
        assert torch.isfinite(adv.grpo(r, 4, scale=scale)).all()
    assert_close(adv.grpo(r[:4], 4), torch.tensor([1.0, -1.0, 1.0, -1.0]) * math.sqrt(3) / 2,
                 **TOL)
    assert torch.isfinite(adv.rloo(r, 2)).all()


def test_inputs_are_detached_and_int_rewards_work():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], requires_grad=True)
    assert not adv.grpo(r, 2).requires_grad
    assert adv.grpo(torch.tensor([1, 0, 1, 1]), 2).dtype == torch.float32


# ------------------------------------------------------------------ properties

magnitudes = st.sampled_from([1e-6, 1.0, 1e3, 1e6, 1e15, 1e30])


@st.composite
def reward_batches(draw):
    g = draw(st.integers(2, 6))
    b = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["random", "constant", "binary"]))
    scale = draw(magnitudes)
    if kind == "constant":
        vals = [draw(st.floats(-1, 1))] * (b * g)
    elif kind == "binary":
        vals = [float(draw(st.booleans())) for _ in range(b * g)]
    else:
        vals = draw(st.lists(st.floats(-1, 1), min_size=b * g, max_size=b * g))
    return torch.tensor(vals) * scale, g


@settings(max_examples=150, deadline=None)
@given(reward_batches(), st.sampled_from(["group", "batch", "none"]), st.booleans(),
       st.sampled_from([1e-4, 1e-12, 0.0]))
def test_property_group_advantages(batch, scale, unbiased, eps):
    r, g = batch
    a = adv.grpo(r, g, scale=scale, eps=eps, unbiased=unbiased)
    assert torch.isfinite(a).all()
    groups = a.view(-1, g)  # (B, G)
    tol = 1e-5 * groups.abs().sum(1) + 1e-6
    assert (groups.sum(1).abs() <= tol).all()
    constant = r.view(-1, g).amax(1) == r.view(-1, g).amin(1)
    assert (groups[constant] == 0).all()
    if scale == "group" and eps == 0.0:  # a mixed group is standardised: its std is 1
        # where fp32 can square the spread (a spread of 1e-43 squares to 0: no std to divide by)
        spread = r.view(-1, g).amax(1) - r.view(-1, g).amin(1)
        mixed = groups[~constant & (spread > 1e-15)]
        if len(mixed):
            assert_close(mixed.std(1, correction=int(unbiased)), torch.ones(len(mixed)),
                         rtol=1e-4, atol=0)
    d = adv.dr_grpo(r, g)
    rl = adv.rloo(r, g)
    assert torch.isfinite(rl).all()
    assert_close(rl, d * (g / (g - 1)), rtol=1e-6, atol=1e-6 * r.abs().max().item())


@st.composite
def masks(draw, n, t_len):
    rows = []
    for _ in range(n):
        kind = draw(st.sampled_from(["empty", "single", "prefix", "random"]))
        if kind == "empty":
            rows.append([0] * t_len)
        elif kind == "single":
            rows.append([1] + [0] * (t_len - 1))
        elif kind == "prefix":
            k = draw(st.integers(0, t_len))
            rows.append([1] * k + [0] * (t_len - k))
        else:
            rows.append(draw(st.lists(st.integers(0, 1), min_size=t_len, max_size=t_len)))
    return torch.tensor(rows)


@settings(max_examples=80, deadline=None)
@given(st.data(), st.integers(1, 6), st.integers(1, 8), magnitudes,
       st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_property_token_level_finite(data, n, t_len, scale, gamma, lam):
    mask = data.draw(masks(n, t_len))
    vals = torch.tensor(data.draw(st.lists(st.floats(-1, 1), min_size=n * t_len,
                                           max_size=n * t_len))).view(n, t_len) * scale
    a = vals[:, 0]
    for mode in ("uniform", "discounted"):
        out = adv.to_tokens(a, mask, mode=mode, gamma=gamma)
        assert torch.isfinite(out).all() and (out[mask == 0] == 0).all()
    w = adv.whiten(vals, mask)
    assert torch.isfinite(w).all() and (w[mask == 0] == 0).all()
    ga, ret = adv.gae(vals / scale, vals.flip(1) / scale, mask, gamma=gamma, lam=lam)
    assert torch.isfinite(ga).all() and torch.isfinite(ret).all()
    assert (ga[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


# ------------------------------------------------------------------ the estimator registry

def test_the_estimator_registry_lists_each_estimator_with_its_paper():
    names = ["grpo", "dr_grpo", "rloo", "none", "reinforce++", "reinforce++-baseline", "remax",
             "opo", "gpg", "grpo_passk", "gdpo", "max_rl", "gae", "vineppo"]
    assert list(est.ESTIMATORS) == names
    assert est.ESTIMATORS["rloo"] is est.rloo_estimator
    titles = est.ESTIMATORS.titles()
    assert all(re.search(r"\(.*\d{4}", titles[n]) for n in names), titles  # a paper and year
    assert est.ESTIMATORS.needs("remax") == ("greedy_rewards",)
    assert est.ESTIMATORS.needs("gae") == ("values",) and est.ESTIMATORS.needs("grpo") == ()
    assert est.ESTIMATORS.needs("vineppo") == ("mc_values",)
    assert "package.module" in est.ESTIMATORS.describe()


# ------------------------------------------------------------------ the registered estimators

def _groups(rewards, g):
    return [rewards[b * g:(b + 1) * g] for b in range(len(rewards) // g)]


def ref_returns(rewards_last, mask, gamma):
    """Per-token discounted returns of a reward on each row's last real token (loops)."""
    out = []
    for r, row in zip(rewards_last, mask):
        idx = [t for t, m in enumerate(row) if m]
        line = [0.0] * len(row)
        for k, t in enumerate(idx):
            line[t] = r * gamma ** (len(idx) - 1 - k)
        out.append(line)
    return out


def ref_registered(name, r, g, mask, eps=1e-4, gamma=1.0, greedy=None, parts=None,
                   weights=None):
    """Plain-Python advantages of each registered estimator, per token (N x T lists)."""
    def spread(a):
        return [[ai if m else 0.0 for m in row] for ai, row in zip(a, mask)]

    def whitened(x):
        return ref_whiten(x, mask, 1e-8, True, True)

    lengths = [sum(1 for m in row if m) for row in mask]
    if name == "none":
        return spread(r)
    if name == "reinforce++":
        return whitened(ref_returns(r, mask, gamma))
    if name == "reinforce++-baseline":
        return whitened(spread(ref_grpo(r, g, "none", 0.0, True)))
    if name == "remax":
        return spread([ri - bi for ri, bi in zip(r, greedy)])
    if name == "opo":
        out = []
        for b, group in enumerate(_groups(r, g)):
            ls = lengths[b * g:(b + 1) * g]
            base = sum(li * ri for li, ri in zip(ls, group)) / sum(ls)
            out += [ri - base for ri in group]
        return spread(out)
    if name == "gpg":
        alpha = len(r) / max(sum(1 for x in r if x != 0), 1)
        return spread([alpha * a for a in ref_grpo(r, g, "none", 0.0, True)])
    if name == "grpo_passk":
        out = []
        for group in _groups(r, g):
            top = sorted(group, reverse=True)
            best = group.index(top[0])
            gap = (top[0] - top[1]) / (ref_std(group, True) + eps)
            out += [gap if i == best else 0.0 for i in range(g)]
        return spread(out)
    if name == "gdpo":
        total = [0.0] * len(r)
        for k, w in enumerate(weights):
            a = ref_grpo([p[k] for p in parts], g, "group", eps, True)
            total = [x + w * y for x, y in zip(total, a)]
        return whitened(spread(total))
    if name == "max_rl":
        out = []
        for group in _groups(r, g):
            mu = ref_mean(group)
            out += [(ri - mu) / mu if mu > 0 else 0.0 for ri in group]
        return spread(out)
    raise AssertionError(name)


REGISTERED = ["none", "reinforce++", "reinforce++-baseline", "remax", "opo", "gpg",
              "grpo_passk", "gdpo", "max_rl"]


@pytest.mark.parametrize("gamma", [1.0, 0.8])
@pytest.mark.parametrize("name", REGISTERED)
def test_registered_estimators_match_loops(name, gamma):
    """Each registered estimator, through `ESTIMATORS[name](AdvantageInputs)`, against its
    formula written as plain loops, in float64 on right-padded rows of random lengths."""
    gen = torch.Generator().manual_seed(5)
    g, n, t_len = 4, 16, 6
    lengths = torch.randint(1, t_len + 1, (n,), generator=gen)
    mask = (torch.arange(t_len)[None] < lengths[:, None]).int()
    r = torch.rand(n, generator=gen, dtype=torch.float64) * 3  # >= 0 for max_rl
    greedy = torch.rand(n, generator=gen, dtype=torch.float64)
    parts = torch.stack([(r > 1.5).double(), torch.rand(n, generator=gen, dtype=torch.float64)],
                        1)
    weights = [1.0, 0.3]
    x = est.AdvantageInputs(r, g, mask=mask, gamma=gamma, eps=1e-4,
                            components=parts,
                            component_weights=torch.tensor(weights, dtype=torch.float64),
                            extras={"greedy_rewards": greedy})
    got = est.ESTIMATORS[name](x)
    if got.dim() == 1:
        got = adv.to_tokens(got, mask)
    want = ref_registered(name, r.tolist(), g, mask.tolist(), eps=1e-4, gamma=gamma,
                          greedy=greedy.tolist(), parts=parts.tolist(), weights=weights)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-10,
                               atol=1e-10)


def test_per_token_estimators_are_per_token_only_when_gamma_discounts():
    """reinforce++ with gamma < 1 weighs earlier tokens less; with gamma = 1 every token of a
    row has the same advantage (the shape a reader may not expect of a per-token estimator)."""
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    mask = torch.ones(4, 3)
    flat = est.ESTIMATORS["reinforce++"](est.AdvantageInputs(r, 2, mask=mask))
    assert torch.equal(flat, flat[:, :1].expand_as(flat))
    discounted = est.ESTIMATORS["reinforce++"](est.AdvantageInputs(r, 2, mask=mask, gamma=0.5))
    assert discounted[0, 0] < discounted[0, 1] < discounted[0, 2]


@pytest.mark.parametrize("name, fields, words", [
    ("remax", {}, ["'remax' needs inputs.extras['greedy_rewards']"]),
    ("remax", {"extras": {"greedy_rewards": torch.zeros(3)}}, ["greedy_rewards must be (N,)"]),
    ("opo", {"mask": None}, ["'lengths' works per token", "inputs.mask"]),
    ("reinforce++", {"mask": None}, ["'reinforce++' works per token"]),
    ("reinforce++", {"gamma": 1.5}, ["gamma must be in [0, 1]"]),
    ("max_rl", {"rewards": torch.tensor([1.0, -1.0, 0.0, 0.0])}, ["rewards must be >= 0"]),
    ("gdpo", {"components": torch.zeros(4, 2), "component_weights": torch.ones(3)},
     ["component_weights must be (K,) = (2,)"]),
    ("gae", {}, ["'gae' needs inputs.extras['values']"]),
])
def test_registered_estimators_name_what_is_missing(name, fields, words):
    base = dict(rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2,
                mask=torch.ones(4, 3))
    with pytest.raises(ValueError) as e:
        est.ESTIMATORS[name](est.AdvantageInputs(**(base | fields)))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_equal_groups_give_zero_for_every_group_estimator():
    """A group whose rewards are all equal carries no signal: every group-baseline estimator
    gives it exactly 0 (reinforce++ and none have no group baseline and are left out)."""
    r = torch.tensor([0.7] * 4 + [1.0, 0.0, 0.0, 1.0])
    x = est.AdvantageInputs(r, 4, mask=torch.ones(8, 2), components=r[:, None],
                            extras={"greedy_rewards": r.clone()})
    for name in ["grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk", "max_rl", "remax"]:
        out = est.ESTIMATORS[name](x)
        assert torch.equal(out[:4], torch.zeros(4)), name


@pytest.mark.parametrize("fields", [dict(estimator="grpo", scale="batch", std_unbiased=False),
                                    dict(estimator="grpo"), dict(estimator="dr_grpo"),
                                    dict(estimator="rloo", scale="batch")], ids=str)
def test_group_advantages_are_the_estimator_called_directly(fields):
    from labkit.settings.config import TrainConfig
    from labkit.stages import group_advantages

    config = TrainConfig(group_size=4, **fields)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    direct = {"grpo": lambda: adv.grpo(r, 4, scale=config.scale, unbiased=config.std_unbiased),
              "dr_grpo": lambda: adv.dr_grpo(r, 4), "rloo": lambda: adv.rloo(r, 4)}
    assert torch.equal(group_advantages(config, r), direct[config.estimator]())


def test_a_new_estimator_is_one_decorated_function():
    from labkit.settings.config import TrainConfig
    from labkit.stages import group_advantages

    @est.ESTIMATORS.register("half_rloo_for_test")
    def half_rloo(inputs):
        """Half of RLOO (a test's own estimator): A_i = rloo_i / 2."""
        return adv.rloo(inputs.rewards, inputs.group_size) / 2

    assert "half_rloo_for_test: Half of RLOO" in est.ESTIMATORS.describe()
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    config = TrainConfig(estimator="half_rloo_for_test", group_size=4)
    assert torch.equal(group_advantages(config, r), adv.rloo(r, 4) / 2)
    with pytest.raises(ValueError, match="'half_rloo_for_test' is already registered"):
        est.ESTIMATORS.register("half_rloo_for_test")(half_rloo)
    with pytest.raises(ValueError, match=r"signature \(inputs\)"):
        est.ESTIMATORS.register("no_options_for_test")(lambda rewards, group_size: rewards)
    assert "no_options_for_test" not in est.ESTIMATORS


def test_an_estimator_by_import_path_and_a_bad_name():
    assert est.ESTIMATORS.resolve("labkit.formulas.estimators:rloo_estimator") is est.rloo_estimator
    with pytest.raises(ValueError, match=r"^estimator must be one of \['grpo', 'dr_grpo', "
                                         r"'rloo'.*'package.module:function', got 'ppo'$"):
        est.ESTIMATORS.resolve("ppo", "estimator")
    with pytest.raises(ValueError, match="estimator='labkit.formulas.advantages:nope': cannot import"):
        est.ESTIMATORS.resolve("labkit.formulas.advantages:nope", "estimator")


# ------------------------------------------------------------------ PPO's arrow

@pytest.mark.parametrize("whiten", [True, False])
def test_ppo_advantages_are_gae_then_whitening(whiten):
    g = torch.Generator().manual_seed(3)
    token_rewards, values = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    a, ret = adv.ppo_advantages(token_rewards, values, mask, gamma=0.9, lam=0.8,
                                whiten_advantages=whiten)
    gae_a, gae_ret = adv.gae(token_rewards, values, mask, gamma=0.9, lam=0.8)
    assert torch.equal(a, adv.whiten(gae_a, mask) if whiten else gae_a)
    assert torch.equal(ret, gae_ret)
    assert not torch.equal(adv.whiten(gae_a, mask), gae_a)  # so the two cases differ


def test_vineppo_gives_each_step_its_monte_carlo_value_change():
    """Row 0: boundaries at 0, 2 and its end 4, values 0.5, 0.8 and reward 1: tokens 0-1 get
    0.3, tokens 2-3 get 0.2. Row 1: no step inside, its end at 3: r - V(s_0) on every token."""
    import math

    from labkit.formulas.estimators import AdvantageInputs, estimate

    nan = math.nan
    values = torch.tensor([[0.5, nan, 0.8, nan, 1.0, nan], [0.25, nan, nan, 0.0, nan, nan]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    x = AdvantageInputs(torch.tensor([1.0, 0.0]), 2, mask=mask, extras={"mc_values": values})
    got = estimate("vineppo", x).advantages
    want = torch.tensor([[0.3, 0.3, 0.2, 0.2, 0.0], [-0.25, -0.25, -0.25, 0.0, 0.0]])
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="needs inputs.extras\\['mc_values'\\]"):
        estimate("vineppo", AdvantageInputs(torch.tensor([1.0, 0.0]), 2, mask=mask))
    values[1, 0] = nan  # no value at the start
    with pytest.raises(ValueError, match="known at the start"):
        estimate("vineppo", x)
