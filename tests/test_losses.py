"""Losses against plain reference loops, gradient identities, clip statistics, edge cases."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from labkit.formulas import losses as L
from labkit.formulas.advantages import grpo

TOL = dict(rtol=1e-6, atol=1e-6)
TOL64 = dict(rtol=1e-12, atol=1e-12)
AGGS = tuple(L.AGG_MODES)  # the registry's names, in order


# ------------------------------------------------------------------ reference loops
# Scalars are Python floats or 0-d float64 tensors; with tensors the same loop is differentiable.

def _exp(x):
    return x.exp() if torch.is_tensor(x) else math.exp(x)


def _sg(x):
    return x.detach() if torch.is_tensor(x) else x


def ref_weights(mask, agg, max_len=None):
    """w[i][t]: the weight of token (i, t) in the aggregated loss."""
    n, t_len = len(mask), len(mask[0])
    total = sum(sum(1 for m in row if m) for row in mask)
    out = []
    for row in mask:
        ti = sum(1 for m in row if m)
        if agg == "token-mean":
            w = 1.0 / total if total else 0.0
        elif agg == "seq-mean-token-mean":
            w = 1.0 / (n * ti) if ti else 0.0
        elif agg == "seq-mean-token-sum":
            w = 1.0 / n
        elif agg == "token-sum":
            w = 1.0
        else:
            w = 1.0 / (n * (max_len or t_len))
        out.append([w if m else 0.0 for m in row])
    return out


def ref_aggregate(per_token, mask, agg, max_len=None):
    w = ref_weights(mask, agg, max_len)
    loss = 0.0
    for i, row in enumerate(mask):
        for j, m in enumerate(row):
            if m:
                loss = loss + w[i][j] * per_token[i][j]
    return loss


def ref_policy_per_token(logp, old, adv, mask, eps_low, eps_high, dual, level, gspo_token=True):
    per = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        idx = [j for j, m in enumerate(row) if m]
        if level == "sequence" and idx:
            s = _exp(sum(logp[i][j] - old[i][j] for j in idx) / len(idx))
        for j in idx:
            a = adv[i][j] if isinstance(adv[i], list) else adv[i]
            if level == "token":
                rho = _exp(logp[i][j] - old[i][j])
            elif gspo_token:
                rho = _sg(s) * _exp(logp[i][j] - _sg(logp[i][j]))
            else:
                rho = s
            clipped = min(max(rho, 1 - eps_low), 1 + eps_high)
            loss = -min(rho * a, clipped * a)
            if dual is not None and a < 0:
                loss = min(loss, -dual * a)
            per[i][j] = loss
    return per


def ref_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, dual=None, level="token",
                    agg="token-mean", max_len=None, gspo_token=True):
    per = ref_policy_per_token(logp, old, adv, mask, eps_low, eps_high, dual, level, gspo_token)
    return ref_aggregate(per, mask, agg, max_len)


def rows(x):
    """A (N, T) tensor as a list of lists of 0-d tensors (views, so gradient reaches x)."""
    return [[x[i, j] for j in range(x.shape[1])] for i in range(x.shape[0])]


def random_mask(n, t_len, gen):
    lengths = torch.randint(1, t_len + 1, (n,), generator=gen)
    mask = (torch.arange(t_len)[None] < lengths[:, None]).int()
    mask[0] = 0  # all-masked row
    mask[1] = 0
    mask[1, 0] = 1  # EOS at once
    return mask


def case(n=6, t_len=5, seed=0, dtype=torch.float64, spread=0.3, adv_2d=False):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t_len, generator=gen, dtype=torch.float64) * 3
    logp = old + spread * torch.randn(n, t_len, generator=gen, dtype=torch.float64)
    shape = (n, t_len) if adv_2d else (n,)
    a = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = random_mask(n, t_len, gen)
    return logp.to(dtype), old.to(dtype), a.to(dtype), mask


# ------------------------------------------------------------------ aggregate

@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_aggregate_matches_loop(agg, dtype):
    gen = torch.Generator().manual_seed(1)
    per = torch.randn(5, 6, generator=gen).to(dtype)
    mask = random_mask(5, 6, gen)
    per[mask == 0] = float("nan")  # padding never leaks
    got = L.aggregate(per, mask, agg)
    want = ref_aggregate(per.tolist(), mask.tolist(), agg)
    assert_close(got, torch.tensor(want, dtype=dtype), **(TOL if dtype == torch.float32 else TOL64))
    if agg == "seq-mean-token-sum-norm":
        got = L.aggregate(per, mask, agg, max_len=11)
        assert_close(got, torch.tensor(ref_aggregate(per.tolist(), mask.tolist(), agg, 11),
                                       dtype=dtype), **TOL)


@pytest.mark.parametrize("agg", AGGS)
def test_aggregate_all_masked_is_zero_and_differentiable(agg):
    per = torch.randn(3, 4, requires_grad=True)
    loss = L.aggregate(per, torch.zeros(3, 4), agg)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(per.grad, torch.zeros(3, 4))


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-sum-norm"):
        L.aggregate(torch.zeros(2, 2), torch.ones(2, 2), "sum")
    with pytest.raises(ValueError, match="max_len"):
        L.aggregate(torch.zeros(2, 2), torch.ones(2, 2), "seq-mean-token-sum-norm", max_len=0)


# ------------------------------------------------------------------ policy loss

PL_CASES = [
    dict(),
    dict(eps_low=0.2, eps_high=0.28),  # DAPO clip-higher
    dict(dual_clip=3.0),
    dict(eps_low=0.2, eps_high=0.28, dual_clip=2.0),
    dict(level="sequence"),
    dict(level="sequence", eps_low=0.1, eps_high=0.15, dual_clip=1.5),
]


def _ref_kwargs(kw):
    return dict(eps_low=kw.get("eps_low", 0.2), eps_high=kw.get("eps_high", 0.2),
                dual=kw.get("dual_clip"), level=kw.get("level", "token"))


@pytest.mark.parametrize("kw", PL_CASES)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("adv_2d", [False, True])
def test_policy_loss_matches_loop(kw, agg, adv_2d):
    logp, old, a, mask = case(spread=0.5, adv_2d=adv_2d)
    want = ref_policy_loss(logp.tolist(), old.tolist(), a.tolist(), mask.tolist(), agg=agg,
                           **_ref_kwargs(kw))
    got64, _ = L.policy_loss(logp, old, a, mask, agg=agg, **kw)
    assert_close(got64, torch.tensor(want, dtype=torch.float64), **TOL64)
    got32, _ = L.policy_loss(logp.float(), old.float(), a.float(), mask, agg=agg, **kw)
    assert got32.dtype == torch.float32
    assert_close(got32, torch.tensor(want, dtype=torch.float32), **TOL)


@pytest.mark.parametrize("kw", PL_CASES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("adv_2d", [False, True])
def test_policy_loss_gradient_matches_loop_autograd(kw, agg, adv_2d):
    logp, old, a, mask = case(spread=0.5, adv_2d=adv_2d, seed=3)
    x_ref = logp.clone().requires_grad_()
    ref = ref_policy_loss(rows(x_ref), old.tolist(), a.tolist(), mask.tolist(), agg=agg,
                          **_ref_kwargs(kw))
    (g_ref,) = torch.autograd.grad(ref, x_ref)
    x = logp.clone().requires_grad_()
    loss, _ = L.policy_loss(x, old, a, mask, agg=agg, **kw)
    loss.backward()
    assert_close(x.grad, g_ref, **TOL64)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("adv_2d", [False, True])
def test_on_policy_gradient_is_reinforce(agg, level, adv_2d):
    """ratio = 1: d loss / d logp_t = -A_t * w_t with w_t the aggregation weight."""
    logp, _, a, mask = case(adv_2d=adv_2d, seed=4)
    x = logp.clone().requires_grad_()
    loss, stats = L.policy_loss(x, logp, a, mask, agg=agg, level=level, dual_clip=3.0)
    loss.backward()
    w = torch.tensor(ref_weights(mask.tolist(), agg), dtype=torch.float64)
    a_tok = a if adv_2d else a[:, None].expand_as(logp)
    assert_close(x.grad, -a_tok * w, **TOL64)
    assert stats["ratio/mean"] == 1.0 and stats["clip/low"] == stats["clip/high"] == 0.0
    # and the on-policy loss is REINFORCE's value, -sum w A (seed 003's -(A * logp) form)
    assert_close(loss, -(a_tok * w).sum(), **TOL64)


@pytest.mark.parametrize("agg", AGGS)
def test_sequence_level_gradient_per_token(agg):
    """Unclipped GSPO: each token of row i gets -A_i * s_i * (1/T_i) * W_i, W_i the row's total
    aggregation weight, which is also what the non-detached sequence ratio gives."""
    logp, old, a, mask = case(spread=0.05, seed=5)
    x = logp.clone().requires_grad_()
    loss, stats = L.policy_loss(x, old, a, mask, agg=agg, level="sequence")
    assert stats["clip/low"] == stats["clip/high"] == 0.0
    loss.backward()
    m = mask.bool()
    t_i = mask.sum(1).clamp(min=1).double()
    s = torch.exp(torch.where(m, logp - old, 0.0).sum(1) / t_i)
    w_row = torch.tensor(ref_weights(mask.tolist(), agg), dtype=torch.float64).sum(1)
    want = torch.where(m, (-a * s / t_i * w_row)[:, None], 0.0)
    assert_close(x.grad, want, **TOL64)
    x_true = logp.clone().requires_grad_()
    ref = ref_policy_loss(rows(x_true), old.tolist(), a.tolist(), mask.tolist(), agg=agg,
                          level="sequence", gspo_token=False)
    ref.backward()
    assert_close(x.grad, x_true.grad, **TOL64)


def test_sequence_ratio_is_the_same_on_every_token():
    logp = torch.log(torch.tensor([[2.0, 0.5, 1.0, 7.0]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    _, stats = L.policy_loss(logp, torch.zeros(1, 4), torch.ones(1), mask, level="sequence",
                             eps_high=10.0)
    assert_close(stats["ratio/max"], 1.0, **TOL)  # geometric mean of 2, 0.5, 1
    assert_close(stats["ratio/mean"], 1.0, **TOL)


def test_clip_stats_hand_built():
    """Ratios 0.5, 1, 1.5, 4 (and a padding token with ratio 9) for A = +1 and A = -1."""
    ratios = torch.tensor([[0.5, 1.0, 1.5, 4.0, 9.0]] * 2)
    logp, old = ratios.log(), torch.zeros(2, 5)
    a = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1, 0]] * 2)
    loss, stats = L.policy_loss(logp, old, a, mask, dual_clip=3.0)
    assert stats == pytest.approx({"clip/low": 1 / 8, "clip/high": 2 / 8, "clip/dual": 1 / 8,
                                   "ratio/mean": 1.75, "ratio/max": 4.0})
    # per token: A=+1: -0.5, -1, -1.2, -1.2 ; A=-1: 0.8, 1, 1.5, min(4, 3)
    assert_close(loss, torch.tensor(2.4 / 8), **TOL)
    _, no_dual = L.policy_loss(logp, old, a, mask)
    assert no_dual["clip/dual"] == 0.0


def test_clip_higher_is_asymmetric():
    """DAPO 0.2 / 0.28: ratio 1.25 passes for A > 0, 1.3 is clipped; 0.75 is clipped for A < 0."""
    ratios = torch.tensor([[1.25, 1.3, 0.75, 0.85], [1.25, 1.3, 0.75, 0.85]])
    a = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 4)
    x = ratios.log().requires_grad_()
    loss, stats = L.policy_loss(x, torch.zeros(2, 4), a, mask, eps_low=0.2, eps_high=0.28)
    assert stats["clip/high"] == pytest.approx(1 / 8)
    assert stats["clip/low"] == pytest.approx(1 / 8)
    loss.backward()
    zero_grad = (x.grad == 0).tolist()
    assert zero_grad == [[False, True, False, False], [False, False, True, False]]


def test_empty_and_single_token_rows():
    logp, old, a, mask = case(dtype=torch.float32)
    logp[mask == 0] = -float("inf")  # padding may hold anything
    for level in ("token", "sequence"):
        for agg in AGGS:
            x = logp.clone().requires_grad_()
            loss, stats = L.policy_loss(x, old, a, mask, level=level, agg=agg, dual_clip=3.0)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
            assert (x.grad[0] == 0).all() and (x.grad[mask == 0] == 0).all()
            assert all(math.isfinite(v) for v in stats.values())
    x = logp.clone().requires_grad_()
    loss, stats = L.policy_loss(x, old, a, torch.zeros_like(mask))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x))
    assert stats == {"clip/low": 0.0, "clip/high": 0.0, "clip/dual": 0.0,
                     "ratio/mean": 0.0, "ratio/max": 0.0}


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bf16_logp_gives_fp32_loss(level):
    logp, old, a, mask = case(dtype=torch.float32, spread=0.1)
    x16 = logp.bfloat16().requires_grad_()
    loss16, _ = L.policy_loss(x16, old.bfloat16(), a, mask, level=level)
    loss16.backward()
    assert loss16.dtype == torch.float32 and x16.grad.dtype == torch.bfloat16
    exact, _ = L.policy_loss(x16.detach().float(), old.bfloat16().float(), a, mask, level=level)
    assert_close(loss16, exact, **TOL)  # the same math on the upcast values
    full, _ = L.policy_loss(logp, old, a, mask, level=level)
    assert_close(loss16, full, rtol=0, atol=2e-2)


def test_policy_loss_validation():
    logp, old, a, mask = case(dtype=torch.float32)
    for kw, word in [(dict(level="step"), "token.*sequence"), (dict(agg="mean"), "token-mean"),
                     (dict(eps_low=1.0), "eps_low"), (dict(eps_high=-0.1), "eps_high"),
                     (dict(dual_clip=1.0), "dual_clip")]:
        with pytest.raises(ValueError, match=word):
            L.policy_loss(logp, old, a, mask, **kw)
    with pytest.raises(ValueError, match="advantages"):
        L.policy_loss(logp, old, a[:3], mask)


# ------------------------------------------------------------------ kl, entropy, value, rewards

def ref_kl(logp, ref, kind):
    out = []
    for lrow, rrow in zip(logp, ref):
        line = []
        for lp, rp in zip(lrow, rrow):
            x = rp - lp
            base = kind.rstrip("+")  # a "+" form has its base kind's value
            line.append(-x if base == "k1" else x * x / 2 if base == "k2" else
                        abs(x) if base == "abs" else math.exp(x) - x - 1)
        out.append(line)
    return out


@pytest.mark.parametrize("kind", ["k1", "k3", "abs"])
def test_kl_plus_forms_have_the_k2_gradient(kind):
    """k1+, k3+, abs+: the base kind's value, and d/d logp = logp - ref_logp, k2's gradient."""
    gen = torch.Generator().manual_seed(7)
    logp = -torch.rand(3, 4, generator=gen, dtype=torch.float64) * 2
    ref = logp + 0.5 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    lp = logp.clone().requires_grad_()
    value = L.kl(lp, ref, kind + "+")
    assert torch.equal(value.detach(), L.kl(logp, ref, kind))
    value.sum().backward()
    assert_close(lp.grad, logp - ref, **TOL64)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_matches_loop(kind, dtype):
    gen = torch.Generator().manual_seed(6)
    logp = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 3
    ref = logp + 0.5 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    logp, ref = logp.to(dtype), ref.to(dtype)
    got = L.kl(logp, ref, kind)
    want = torch.tensor(ref_kl(logp.tolist(), ref.tolist(), kind), dtype=dtype)
    assert_close(got, want, **(TOL if dtype == torch.float32 else TOL64))
    if kind == "k3":
        assert (got >= 0).all()


def test_kl_k3_small_differences_and_gradient():
    logp = torch.full((1, 4), -2.0)
    ref = logp + torch.tensor([[1e-3, -1e-3, 1e-5, 0.0]])
    got = L.kl(logp, ref, "k3")
    x = (ref.double() - logp.double())
    assert_close(got.double(), torch.expm1(x) - x, rtol=1e-6, atol=0)
    naive = torch.exp(ref - logp) - (ref - logp) - 1  # what the textbook line gives in fp32
    assert not torch.allclose(naive.double(), torch.expm1(x) - x, rtol=1e-2, atol=0)
    lp = logp.clone().requires_grad_()
    L.kl(lp, ref, "k3").sum().backward()
    assert_close(lp.grad, -torch.expm1(ref - logp), **TOL)  # d/d logp of e^x - x - 1
    masked = L.kl(logp, ref, "k1", mask=torch.tensor([[1, 1, 0, 0]]))
    assert (masked[0, 2:] == 0).all()
    with pytest.raises(ValueError, match="k1.*k2.*k3.*abs.*k1\\+"):
        L.kl(logp, ref, "k4")


@pytest.mark.parametrize("chunk_size", [1, 7, 4096])
def test_entropy_matches_categorical(chunk_size):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, 11, generator=gen) * 3
    logits[0, 0, :5] = -float("inf")  # banned tokens
    got = L.entropy(logits, chunk_size=chunk_size)
    assert got.shape == (3, 5) and got.dtype == torch.float32
    assert_close(got, torch.distributions.Categorical(logits=logits).entropy(), **TOL)
    l64 = logits.double()
    assert_close(L.entropy(l64, chunk_size=chunk_size),
                 torch.distributions.Categorical(logits=l64).entropy(), **TOL64)


def test_entropy_chunks_agree_with_gradient_and_bf16():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 6, 13, generator=gen)
    results = []
    for chunk_size in (1, 7, 10_000):
        x = logits.clone().requires_grad_()
        h = L.entropy(x, chunk_size=chunk_size)
        (h * torch.arange(24.0).view(4, 6)).sum().backward()
        results.append((h.detach(), x.grad))
    for h, g in results[1:]:
        assert_close(h, results[0][0], **TOL)
        assert_close(g, results[0][1], **TOL)
    b16 = logits.bfloat16()
    h16 = L.entropy(b16, chunk_size=5)
    assert h16.dtype == torch.float32
    assert_close(h16, torch.distributions.Categorical(logits=b16.float()).entropy(), **TOL)
    with pytest.raises(ValueError, match="chunk_size"):
        L.entropy(logits, chunk_size=0)


def ref_value_loss(v, old, ret, mask, clip, agg):
    per = [[0.0] * len(row) for row in mask]
    clipped = 0
    for i, row in enumerate(mask):
        for j, m in enumerate(row):
            if not m:
                continue
            e = (v[i][j] - ret[i][j]) ** 2
            if clip is not None:
                vc = min(max(v[i][j], old[i][j] - clip), old[i][j] + clip)
                ec = (vc - ret[i][j]) ** 2
                clipped += ec > e
                e = max(e, ec)
            per[i][j] = 0.5 * e
    n = sum(sum(1 for m in row if m) for row in mask)
    return ref_aggregate(per, mask, agg), clipped / max(n, 1)


@pytest.mark.parametrize("clip", [None, 0.2, 0.05])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_value_loss_matches_loop(clip, agg, dtype):
    gen = torch.Generator().manual_seed(9)
    v, old, ret = (torch.randn(5, 6, generator=gen).to(dtype) for _ in range(3))
    mask = random_mask(5, 6, gen)
    want, frac = ref_value_loss(v.tolist(), old.tolist(), ret.tolist(), mask.tolist(), clip, agg)
    got, stats = L.value_loss(v, old, ret, mask, clip=clip, agg=agg)
    assert_close(got, torch.tensor(want, dtype=dtype), **(TOL if dtype == torch.float32 else TOL64))
    assert stats["value/clipfrac"] == pytest.approx(frac)
    if clip is not None:
        assert 0 < frac < 1
    x = v.clone().requires_grad_()
    L.value_loss(x, old, ret, torch.zeros_like(mask), clip=clip)[0].backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def ref_token_rewards(r, mask, logp, ref, beta, kind):
    kl = ref_kl(logp, ref, kind) if beta > 0 else None
    out = []
    for i, row in enumerate(mask):
        idx = [j for j, m in enumerate(row) if m]
        line = [0.0] * len(row)
        for j in idx:
            line[j] = (r[i] if j == idx[-1] else 0.0) - (beta * kl[i][j] if kl else 0.0)
        out.append(line)
    return out


@pytest.mark.parametrize("beta,kind", [(0.0, "k1"), (0.05, "k1"), (0.1, "k3"), (0.02, "k2")])
def test_ppo_token_rewards_matches_loop(beta, kind):
    gen = torch.Generator().manual_seed(10)
    r = torch.randn(5, generator=gen)
    mask = random_mask(5, 6, gen)
    mask[2] = torch.tensor([0, 1, 0, 1, 1, 0])  # a hole: the reward still goes on the last token
    logp = -torch.rand(5, 6, generator=gen)
    ref = logp + 0.3 * torch.randn(5, 6, generator=gen)
    got = L.ppo_token_rewards(r, mask, logp=logp, ref_logp=ref, beta=beta, kind=kind)
    want = ref_token_rewards(r.tolist(), mask.tolist(), logp.tolist(), ref.tolist(), beta, kind)
    assert_close(got, torch.tensor(want), **TOL)
    assert torch.equal(got[0], torch.zeros(6))
    with pytest.raises(ValueError, match="logp"):
        L.ppo_token_rewards(r, mask, beta=0.1)
    with pytest.raises(ValueError, match="finite"):
        L.ppo_token_rewards(torch.tensor([1.0, float("nan"), 0, 0, 0]), mask)


# ------------------------------------------------------------------ properties

@st.composite
def batches(draw):
    n, t_len = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    rows = []
    for _ in range(n):
        kind = draw(st.sampled_from(["empty", "single", "prefix", "random"]))
        k = draw(st.integers(0, t_len))
        if kind == "empty":
            rows.append([0] * t_len)
        elif kind == "single":
            rows.append([1] + [0] * (t_len - 1))
        elif kind == "prefix":
            rows.append([1] * k + [0] * (t_len - k))
        else:
            rows.append(draw(st.lists(st.integers(0, 1), min_size=t_len, max_size=t_len)))
    floats = st.lists(st.floats(-1, 1), min_size=n * t_len, max_size=n * t_len)
    logp = torch.tensor(draw(floats)).view(n, t_len) * 5 - 5
    old = torch.tensor(draw(floats)).view(n, t_len) * 5 - 5
    scale = draw(st.sampled_from([1e-3, 1.0, 1e6]))
    a = torch.tensor(draw(st.lists(st.floats(-1, 1), min_size=n, max_size=n))) * scale
    return logp, old, a, torch.tensor(rows)


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(AGGS), st.sampled_from(["token", "sequence"]),
       st.sampled_from([None, 3.0]), st.booleans())
def test_property_losses_finite(batch, agg, level, dual_clip, adv_2d):
    logp, old, a, mask = batch
    if adv_2d:
        a = a[:, None] * torch.linspace(-1, 1, logp.shape[1])
    x = logp.clone().requires_grad_()
    loss, stats = L.policy_loss(x, old, a, mask, agg=agg, level=level, dual_clip=dual_clip,
                                eps_low=0.2, eps_high=0.28)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert (x.grad[mask == 0] == 0).all()
    assert all(math.isfinite(v) and v >= 0 for v in stats.values())
    vl, vs = L.value_loss(logp, old, old + 1, mask, agg=agg)
    assert torch.isfinite(vl) and 0 <= vs["value/clipfrac"] <= 1
    assert torch.isfinite(L.aggregate(L.kl(logp, old, "k3"), mask, agg))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1, 1), min_size=4, max_size=12).filter(lambda v: len(v) % 2 == 0),
       st.sampled_from([1.0, 1e6, 1e30]))
def test_property_grpo_into_policy_loss(vals, scale):
    r = torch.tensor(vals) * scale
    a = grpo(r, 2)
    n = a.shape[0]
    logp = torch.zeros(n, 3, requires_grad=True)
    loss, _ = L.policy_loss(logp, torch.zeros(n, 3), a, torch.ones(n, 3))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


# ----------------------------------------------------------------- the aggregation registry

def test_the_aggregation_registry_lists_the_modes_with_their_papers():
    assert AGGS == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                    "seq-mean-token-sum-norm", "token-sum")
    text = L.AGG_MODES.describe()
    assert all(p in text for p in ("DAPO", "DeepSeekMath", "Dr. GRPO"))


def test_a_new_aggregation_mode_is_one_decorated_function_and_an_import_path_works():
    @L.AGG_MODES.register("token-max-for-test")
    def token_max(masked, mask, *, max_len=None):
        """Largest token loss (a test's own mode): max_{i,t} l."""
        return masked.max()

    per_token = torch.tensor([[1.0, 5.0, 9.0], [2.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert L.aggregate(per_token, mask, "token-max-for-test").item() == 5.0
    by_path = L.aggregate(per_token, mask, "labkit.formulas.losses:seq_mean_token_mean")
    assert torch.equal(by_path, L.aggregate(per_token, mask, "seq-mean-token-mean"))
    with pytest.raises(ValueError, match=r"agg must be one of \['token-mean'.*got 'mean'"):
        L.aggregate(per_token, mask, "mean")
    with pytest.raises(ValueError, match=r"agg='labkit.formulas.losses:kl' must accept .*\(masked, mask"):
        L.aggregate(per_token, mask, "labkit.formulas.losses:kl")
