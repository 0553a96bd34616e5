"""Parity of labkit's estimators and losses with verl's own code (`verl.trainer.ppo.core_algos`).

Each labkit function and the verl function of the same name get the same random inputs:
right-padded completions of different lengths (one of a single token), several groups,
rewards of mixed signs. verl's estimators take token-level rewards and return per-token
advantages; a labkit estimator that returns one value per completion `(N,)` is spread over
the real tokens (`to_tokens`, uniform) before the comparison.

Precision, stated per test: float64 to 1e-10 where both sides compute the same expression;
float32 to 1e-6 relative (plus 1e-6 absolute near 0) where verl's batch whitening differs in
convention, `(x - mean) * rsqrt(var + 1e-8)` with `mean = sum / (count + 1e-8)`, against
labkit's `whiten`, `(x - mean) / (std + 1e-8)`: the two differ by about 1e-8 relative, below
float32's resolution and far above 1e-10.

Conventions that differ and are not compared (documented in docs/variants.md):
- a group of one completion: verl gives it mean 0 and std 1; labkit requires G >= 2.
- a group whose rewards are all equal: labkit returns exactly 0, verl the rounding noise of
  (r - mean) divided by eps; the random rewards here are never all equal within a group.
- whitening all-equal values: labkit returns 0, verl noise over sqrt(1e-8).

verl is installed by `.ci/run` (`pip install --no-deps verl==0.9.1` and the few modules
core_algos imports, torch held at its pinned version). Without it these tests skip, unless
LABKIT_REQUIRE_PEERS=1 (set by `.ci/run`), which turns the missing peer into a failure.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peers import peer

from labkit.formulas import advantages as adv
from labkit.formulas import estimators as est

verl = peer("verl.trainer.ppo.core_algos")
AlgoConfig = peer("verl.trainer.config").AlgoConfig

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

F64 = dict(rtol=1e-10, atol=1e-10)
F32 = dict(rtol=1e-6, atol=1e-6)
G, B, T = 4, 5, 7


def _inputs(seed: int, dtype=torch.float64, binary=False):
    """(rewards (N,), mask (N, T) right-padded, verl token rewards (N, T), group uids)."""
    gen = torch.Generator().manual_seed(seed)
    n = B * G
    lengths = torch.randint(1, T + 1, (n,), generator=gen)
    lengths[0] = 1  # a lone token (EOS)
    lengths[1] = T  # one fills the budget
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)
    if binary:
        r = torch.randint(0, 2, (n,), generator=gen).to(dtype)
        r.view(B, G)[:, 0], r.view(B, G)[:, 1] = 1.0, 0.0  # no group all equal
    else:
        r = torch.randn(n, generator=gen, dtype=dtype) * 2 + 0.3
    token = torch.zeros(n, T, dtype=dtype)
    token[torch.arange(n), lengths - 1] = r
    index = np.array([f"p{i // G}" for i in range(n)], dtype=object)
    return r, mask, token, index


def _labkit(name, r, mask, **fields):
    out = est.estimate(name, est.AdvantageInputs(r, G, mask=mask, **fields)).advantages
    return adv.to_tokens(out, mask) if out.dim() == 1 else out


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_matches_verl(norm, seed):
    """labkit grpo (scale group / none, eps 1e-6, unbiased std) == verl grpo, float64 to
    1e-10, and == verl grpo_vectorized to 1e-6 relative (it computes the group statistics in
    float32 whatever the input, verl.utils.groupwise.group_mean_std)."""
    r, mask, token, index = _inputs(seed)
    want, _ = verl.compute_grpo_outcome_advantage(token.clone(), mask, index, epsilon=1e-6,
                                                  norm_adv_by_std_in_grpo=norm)
    want_vec, _ = verl.compute_grpo_vectorized_outcome_advantage(
        token.clone(), mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm)
    got = _labkit("grpo", r, mask, eps=1e-6, scale="group" if norm else "none")
    torch.testing.assert_close(got, want, **F64)
    torch.testing.assert_close(got, want_vec.to(got.dtype), **F32)
    if not norm:
        torch.testing.assert_close(_labkit("dr_grpo", r, mask), want, **F64)


@pytest.mark.parametrize("seed", [0, 1])
def test_rloo_matches_verl(seed):
    """labkit rloo == verl rloo and rloo_vectorized, float64 to 1e-10."""
    r, mask, token, index = _inputs(seed)
    got = _labkit("rloo", r, mask)
    want, _ = verl.compute_rloo_outcome_advantage(token.clone(), mask, index)
    want_vec, _ = verl.compute_rloo_vectorized_outcome_advantage(token.clone(), mask, index)
    torch.testing.assert_close(got, want, **F64)
    torch.testing.assert_close(got, want_vec, **F64)


@pytest.mark.parametrize("seed", [0, 1])
def test_opo_matches_verl(seed):
    """labkit opo (length-weighted group baseline) == verl opo, float64 to 1e-10."""
    r, mask, token, index = _inputs(seed)
    want, _ = verl.compute_opo_outcome_advantage(token.clone(), mask, index)
    torch.testing.assert_close(_labkit("opo", r, mask), want, **F64)


@pytest.mark.parametrize("binary", [False, True])
def test_gpg_matches_verl(binary):
    """labkit gpg == verl gpg (alpha = N / nonzero rewards, f_norm 1), float64 to 1e-10; with
    0/1 rewards alpha is not 1."""
    r, mask, token, index = _inputs(3, binary=binary)
    want, _ = verl.compute_gpg_outcome_advantage(token.clone(), mask, index)
    torch.testing.assert_close(_labkit("gpg", r, mask), want, **F64)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_verl(norm):
    """labkit grpo_passk == verl grpo_passk (only the best of a group: r_max - r_second, over
    the group's std + eps when normalised), float64 to 1e-10."""
    r, mask, token, index = _inputs(4)
    config = AlgoConfig(norm_adv_by_std_in_grpo=norm)
    want, _ = verl.compute_grpo_passk_outcome_advantage(token.clone(), mask, index,
                                                        epsilon=1e-6, config=config)
    got = _labkit("grpo_passk", r, mask, eps=1e-6, scale="group" if norm else "none")
    torch.testing.assert_close(got, want, **F64)


def test_remax_matches_verl():
    """labkit remax (r - greedy reward) == verl remax, float64 to 1e-10."""
    r, mask, token, index = _inputs(5)
    greedy = torch.randn(r.shape[0], generator=torch.Generator().manual_seed(9),
                         dtype=r.dtype)
    want, _ = verl.compute_remax_outcome_advantage(token.clone(), greedy, mask)
    got = _labkit("remax", r, mask, extras={"greedy_rewards": greedy})
    torch.testing.assert_close(got, want, **F64)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_verl(gamma):
    """labkit reinforce++ (discounted token returns, whitened over the batch) == verl
    reinforce_plus_plus, float32 to 1e-6 (whitening conventions, module docstring)."""
    r, mask, token, index = _inputs(6, torch.float32)
    want, _ = verl.compute_reinforce_plus_plus_outcome_advantage(
        token.clone(), mask, config=AlgoConfig(gamma=gamma))
    got = _labkit("reinforce++", r, mask, gamma=gamma)
    torch.testing.assert_close(got, want, **F32)


def test_reinforce_pp_baseline_matches_verl():
    """labkit reinforce++-baseline == verl reinforce_plus_plus_baseline, float32 to 1e-6."""
    r, mask, token, index = _inputs(7, torch.float32)
    want, _ = verl.compute_reinforce_plus_plus_baseline_outcome_advantage(token.clone(), mask,
                                                                          index)
    torch.testing.assert_close(_labkit("reinforce++-baseline", r, mask), want, **F32)


@pytest.mark.parametrize("norm", [True, False])
def test_gdpo_matches_verl(norm):
    """labkit gdpo (each reward term z-scored in its group, weighted sum, whitened) == verl
    gdpo with two reward keys and weights, float32 to 1e-6."""
    r, mask, token, index = _inputs(8, torch.float32)
    gen = torch.Generator().manual_seed(11)
    parts = torch.stack([torch.randint(0, 2, r.shape, generator=gen).float(),
                         torch.rand(r.shape, generator=gen)], 1)  # (N, 2)
    parts.view(B, G, 2)[:, 0, 0], parts.view(B, G, 2)[:, 1, 0] = 1.0, 0.0
    weights = [1.0, 0.3]
    prompt_len = 3
    batch = {"prompts": torch.zeros(r.shape[0], prompt_len, dtype=torch.long),
             "attention_mask": torch.cat([torch.ones(r.shape[0], prompt_len), mask], 1).long()}
    config = AlgoConfig(norm_adv_by_std_in_grpo=norm)
    config = {"gdpo_reward_keys": ["acc", "fmt"], "gdpo_reward_weights": weights}
    want, _ = verl.compute_gdpo_outcome_advantage(
        token.clone(), mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm, config=config,
        non_tensor_batch={"acc": parts[:, 0].numpy(), "fmt": parts[:, 1].numpy()}, batch=batch)
    got = _labkit("gdpo", r, mask, eps=1e-6, scale="group" if norm else "none",
                  components=parts, component_weights=torch.tensor(weights))
    torch.testing.assert_close(got, want, **F32)


@pytest.mark.parametrize("lam", [1.0, 0.95])
def test_gae_matches_verl(lam):
    """labkit gae (PPO's arrow: GAE then whitened) == verl gae on real tokens, float32 to 1e-6;
    the returns (before whitening) too. (verl leaves padding at -mean/std after whitening,
    labkit at 0.)"""
    r, mask, token, index = _inputs(10, torch.float32)
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(12)) * mask
    want, want_returns = verl.compute_gae_advantage_return(token.clone(), values, mask,
                                                           gamma=0.99, lam=lam)
    got = est.estimate("gae", est.AdvantageInputs(r, G, mask=mask, gamma=0.99, lam=lam,
                                                  extras={"values": values}))
    torch.testing.assert_close(got.advantages, want * mask, **F32)
    torch.testing.assert_close(got.returns * mask, want_returns * mask, **F32)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"])
def test_kl_kinds_match_verl_kl_penalty(kind):
    """labkit.formulas.losses.kl == verl kl_penalty, value and gradient, float32 to 1e-6 (labkit's k3
    uses its Taylor series below |x| = 1e-2, exact to float32 rounding, not to 1e-10)."""
    from labkit.formulas import losses

    gen = torch.Generator().manual_seed(13)
    logp = -torch.rand(6, 5, generator=gen) * 3
    ref = logp + torch.randn(6, 5, generator=gen) * 0.7
    ref[0, :3] = logp[0, :3] + torch.tensor([1e-3, -5e-3, 0.0])  # near and at the reference
    lp_v, lp_l = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    want = verl.kl_penalty(lp_v, ref, kind)
    got = losses.kl(lp_l, ref, kind)
    torch.testing.assert_close(got, want, **F32)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(lp_l.grad, lp_v.grad, **F32)


@pytest.mark.parametrize("kl_value", [0.001, 0.05, 0.5])
def test_adaptive_beta_matches_verl_controller(kl_value):
    """labkit.formulas.losses.adaptive_beta == verl AdaptiveKLController.update over a few steps
    (float64 to 1e-12: the same expression in Python floats and numpy)."""
    from labkit.formulas.losses import adaptive_beta

    controller = verl.AdaptiveKLController(init_kl_coef=0.04, target_kl=0.05, horizon=1000)
    beta = 0.04
    for step in range(5):
        controller.update(kl_value * (1 + step / 10), n_steps=256)
        beta = adaptive_beta(beta, kl_value * (1 + step / 10), 0.05, 1000, 256)
        assert beta == pytest.approx(float(controller.value), rel=1e-12, abs=0)
    assert beta != 0.04 or kl_value == 0.05
