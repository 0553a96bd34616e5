"""Parity of labkit's policy-loss modes (labkit.formulas.policy_losses) with verl's own
`verl.trainer.ppo.core_algos` policy losses: the same log-probs, old log-probs, advantages and
mask into both; the scalar loss and its gradient with respect to the log-probs compared.

Inputs: 20 right-padded rows of 1..7 tokens, log-ratios up to +-0.6 so that clips act on both
sides, and 1.5 on the first token of every third row (ratio 4.5, past the dual clip's c=3 and
DPPO's truncation at 3), per-token advantages of both signs. Precision, stated per test:
float64 to 1e-10 where both sides compute the same expression; float32 to 1e-6 relative
(1e-6 absolute near 0) where verl adds 1e-8 to a denominator (seq-mean-token-mean's token
counts, geo_mean's lengths), which moves results by about 1e-8/length: below float32's
resolution, above 1e-10.

verl's vanilla always applies the dual clip (clip_ratio_c, default 3): it is compared with
labkit's `dual_clip` mode and with `vanilla` given dual_clip=3. verl's sapo aggregates by
seq-mean-token-mean whatever loss_agg_mode says: compared at that aggregation. clip_cov picks
its tokens with torch.randperm: verl on the global generator, labkit on a generator; both are
seeded alike. Installed by `.ci/run`; skipped without verl unless LABKIT_REQUIRE_PEERS=1.
"""

from __future__ import annotations

import pytest
import torch
from peers import peer

from labkit.formulas.policy_losses import policy_loss_mode

verl = peer("verl.trainer.ppo.core_algos")
ActorConfig = peer("verl.workers.config").ActorConfig
PolicyLossConfig = peer("verl.workers.config").PolicyLossConfig

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

F64 = dict(rtol=1e-10, atol=1e-10)
F32 = dict(rtol=1e-6, atol=1e-6)
N, T = 20, 7
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _inputs(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=gen)
    lengths[0] = 1
    mask = (torch.arange(T)[None] < lengths[:, None]).to(dtype)
    logp = -torch.rand(N, T, generator=gen, dtype=dtype) * 3 - 0.05  # log-probs < 0
    old = (logp - (torch.rand(N, T, generator=gen, dtype=dtype) * 1.2 - 0.6)).clamp(max=-0.01)
    old[::3, 0] = logp[::3, 0] - 1.5  # ratios of 4.5: the dual clip and the truncation act
    adv = torch.randn(N, T, generator=gen, dtype=dtype)
    return logp * mask, old * mask, adv * mask, mask


def _config(**policy_loss):
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1,
                       clip_ratio=EPS_LOW, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH,
                       tau_pos=1.0, tau_neg=1.05,
                       policy_loss=PolicyLossConfig(**policy_loss))


def _both(verl_name, spec, agg, dtype, *, policy_loss=None, seed=0, labkit_agg=None,
          **labkit_kwargs):
    """(verl's loss, labkit's loss, verl's d/dlogp, labkit's d/dlogp)."""
    logp, old, adv, mask = _inputs(seed, dtype)
    lp_v = logp.clone().requires_grad_()
    lp_l = logp.clone().requires_grad_()
    fn = verl.get_policy_loss_fn(verl_name)
    torch.manual_seed(123)
    loss_v, _ = fn(old, lp_v, adv, mask, loss_agg_mode=agg,
                   config=_config(**(policy_loss or {})))
    loss_l, _ = policy_loss_mode(spec, lp_l, old, adv, mask, eps_low=EPS_LOW,
                                 eps_high=EPS_HIGH, agg=labkit_agg or agg,
                                 generator=torch.Generator().manual_seed(123), **labkit_kwargs)
    loss_v.backward()
    loss_l.backward()
    return loss_v.detach(), loss_l.detach(), lp_v.grad * mask, lp_l.grad * mask


def _check(result, tol):
    loss_v, loss_l, grad_v, grad_l = result
    torch.testing.assert_close(loss_l, loss_v.to(loss_l.dtype), **tol)
    torch.testing.assert_close(grad_l, grad_v.to(grad_l.dtype), **tol)
    assert grad_l.abs().sum() > 0  # the comparison sees a gradient


AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
        "token-sum"]


def _tol(agg):
    return (torch.float32, F32) if agg == "seq-mean-token-mean" else (torch.float64, F64)


@pytest.mark.parametrize("agg", AGGS)
def test_vanilla_and_dual_clip_match_verl_vanilla(agg):
    """verl vanilla (clip 0.2/0.28, dual clip c=3) == labkit dual_clip(c=3) == labkit vanilla
    with dual_clip=3, each aggregation."""
    dtype, tol = _tol(agg)
    _check(_both("vanilla", "dual_clip", agg, dtype), tol)
    _check(_both("vanilla", "vanilla", agg, dtype, dual_clip=3.0), tol)


@pytest.mark.parametrize("name", ["gspo", "cispo", "gpg", "dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_modes_match_verl(name, agg):
    """gspo, cispo, gpg, dppo_tv, dppo_kl: loss and gradient equal to verl's. verl's DPPO
    truncates at the config's clip_ratio_c, 3 in ActorConfig (20 only without one); labkit's
    default is 20, so clip_c=3 here."""
    dtype, tol = _tol(agg)
    spec = f"{name}(clip_c=3)" if name.startswith("dppo") else name
    _check(_both(name, spec, agg, dtype), tol)


def test_sapo_matches_verl():
    """sapo (tau_pos 1, tau_neg 1.05), at seq-mean-token-mean, the aggregation verl forces."""
    _check(_both("sapo", "sapo(tau_pos=1.0, tau_neg=1.05)", "seq-mean-token-mean",
                 torch.float32), F32)


def test_dro_matches_verl():
    _check(_both("dro", "dro(beta=0.3)", "token-mean", torch.float64,
                 policy_loss={"dro_beta": 0.3}), F64)


def test_geo_mean_matches_verl():
    """GMPO: verl's mean over rows == labkit at seq-mean-token-mean (float32: verl divides by
    length + 1e-8)."""
    _check(_both("geo_mean", "geo_mean", "token-mean", torch.float32,
                 labkit_agg="seq-mean-token-mean"), F32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_matches_verl(seed):
    """clip_cov with 5% of the tokens as the budget among those with cov in (0, 5): the same
    tokens dropped (same seed for the random pick), the same loss and gradient."""
    opts = {"clip_cov_ratio": 0.05, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0}
    _check(_both("clip_cov", "clip_cov(ratio=0.05, lb=0, ub=5)", "token-mean", torch.float64,
                 policy_loss=opts, seed=seed), F64)


@pytest.mark.parametrize("seed", [0, 1])
def test_kl_cov_matches_verl(seed):
    """kl_cov with 5% of the tokens penalised, coefficient 0.1 (verl's ppo_kl_coef)."""
    opts = {"kl_cov_ratio": 0.05, "ppo_kl_coef": 0.1}
    _check(_both("kl_cov", "kl_cov(ratio=0.05, coef=0.1)", "token-mean", torch.float64,
                 policy_loss=opts, seed=seed), F64)
