"""The exact KL over the vocabulary (kl_kind="full"): its formula, the passes that feed it and
the steps that use it, in the loss and in the reward, for GRPO and PPO."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from labkit import algos, stages, update
from labkit.formulas import estimators as est
from labkit.formulas import losses as L
from labkit.model.learner import build_learner, check_full_kl_memory, make_accelerator
from labkit.model.rollout import rollout
from labkit.model.scoring import fast_forward, model_forward, token_scores
from labkit.settings.config import TrainConfig

PROMPTS = ["1+2=", "37+85=", "9+90=", "12+34+56="]


def _log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    norm = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - norm for x in row]


def _dists(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*shape, generator=g, dtype=dtype) * 2
    b = torch.randn(*shape, generator=g, dtype=dtype) * 2
    return a.log_softmax(-1), b.log_softmax(-1)


def test_full_kl_is_the_sum_over_the_vocabulary():
    lp, ref = _dists(3, 4, 7)
    got = L.kl(lp, ref, "full")
    assert got.shape == (3, 4)
    for n in range(3):
        for t in range(4):
            p = _log_softmax(lp[n, t].tolist())
            q = _log_softmax(ref[n, t].tolist())
            want = sum(math.exp(a) * (a - b) for a, b in zip(p, q))
            assert got[n, t].item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    assert (got >= 0).all()
    assert L.kl(lp, lp.clone(), "full").abs().max() < 1e-12


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_full_kl_is_what_the_unbiased_estimators_average_to(kind):
    """k1 and k3 of a token v drawn from pi are unbiased: sum_v pi(v) k(v) is the KL."""
    lp, ref = _dists(2, 5, 11, seed=1)
    per_token = L.kl(lp, ref, kind)  # (N, T, V): the estimate had token v been sampled
    expected = (lp.exp() * per_token).sum(-1)
    assert torch.allclose(L.kl(lp, ref, "full"), expected, rtol=1e-10, atol=1e-12)


def test_full_kl_gradient_is_the_closed_form():
    """d KL / d z_j = p_j (log p_j - log q_j - KL) for logits z of pi."""
    z = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    _, ref = _dists(2, 3, 6, seed=2)
    value = L.kl(z.log_softmax(-1), ref, "full")
    value.sum().backward()
    lp = z.detach().log_softmax(-1)
    closed = lp.exp() * (lp - ref - value.detach()[..., None])
    assert torch.allclose(z.grad, closed, rtol=1e-10, atol=1e-12)


def test_full_kl_handles_tokens_of_probability_zero_and_masks():
    lp = torch.tensor([[[0.0, -math.inf, -math.inf]], [[math.log(0.5)] * 2 + [-math.inf]]])
    ref = torch.tensor([[[math.log(0.5), math.log(0.5), -math.inf]],
                        [[math.log(0.25), math.log(0.75), -math.inf]]])
    got = L.kl(lp, ref, "full")
    assert got[0, 0].item() == pytest.approx(math.log(2), rel=1e-6)
    assert got[1, 0].item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel=1e-6)
    masked = L.kl(lp, ref, "full", mask=torch.tensor([[True], [False]]))
    assert masked[1, 0] == 0 and torch.isfinite(masked).all()


def test_full_kl_refuses_token_log_probs():
    with pytest.raises(ValueError, match=r"kind='full' needs logp and ref_logp as "
                                         r"log-distributions \(N, T, V\)"):
        L.kl(torch.zeros(2, 3), torch.zeros(2, 3), "full")


def _batch(model, tokenizer, temperature=1.0):
    return rollout(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=8, seed=3,
                   temperature=temperature)


def _hf_log_dists(model, batch, temperature=1.0) -> torch.Tensor:
    """Log-softmax (N, T, V) at the positions predicting the completion tokens, from the
    model's own forward over every row's whole prompt + completion."""
    prompt = batch.group_index
    ids = torch.cat([batch.prompt_ids[prompt], batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask[prompt], batch.completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    P, T = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    return (logits[:, P - 1:P - 1 + T].float() / temperature).log_softmax(-1)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("forward", [fast_forward, model_forward], ids=["fast", "plain"])
def test_both_passes_give_the_model_forwards_distributions(tiny, share, forward):
    model, tokenizer = tiny
    batch = _batch(model, tokenizer, temperature=0.7)
    with torch.no_grad():
        scores = token_scores(model, batch, distribution=True, share_prompt=share,
                              forward=forward, temperature=0.7)
        want = _hf_log_dists(model, batch, temperature=0.7)
    mask = batch.completion_mask.bool()
    dist = scores.log_dist
    assert dist.shape == (*batch.completion_ids.shape, len(tokenizer))
    assert torch.allclose(dist.exp().sum(-1), torch.ones(dist.shape[:2]), atol=1e-5)
    sampled = dist.gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    assert torch.equal(sampled[mask], scores.logp[mask])
    assert (dist - want)[mask].abs().max() < 1e-4


def _learner(**fields):
    config = TrainConfig(device="cpu", kl_kind="full", beta=0.1, batch_prompts=4, group_size=3,
                         max_new_tokens=8, **fields)
    learner, tokenizer = build_learner(config, make_accelerator(config))
    with torch.no_grad():  # move the policy away from the reference so the KL is not 0
        g = torch.Generator().manual_seed(0)
        for p in learner.policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return config, learner, tokenizer


def test_the_loss_term_is_beta_times_the_exact_kl_with_its_gradient():
    """With zero advantages the policy's loss is beta * token-mean of the exact KL: value and
    every weight's gradient equal a plain computation from the models' own forwards."""
    config, learner, tokenizer = _learner()
    batch = _batch(learner.policy, tokenizer)
    n = batch.completion_ids.shape[0]
    ref = stages.reference_logprobs(config, learner, batch)
    assert ref.shape == (*batch.completion_ids.shape, len(tokenizer))
    rows = torch.arange(n)
    total, stats = update.policy_terms(config, learner, batch, rows, torch.zeros(n), ref)
    total.backward()
    got = {k: p.grad.clone() for k, p in learner.policy.named_parameters()}

    plain = copy.deepcopy(learner.policy).double()
    plain.zero_grad(set_to_none=True)
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        ref_plain = _hf_log_dists(copy.deepcopy(learner.reference).double(), batch)
    lp = _hf_log_dists(plain, batch).double()
    kl_t = (lp.exp() * (lp - ref_plain.double())).sum(-1)
    loss = config.beta * kl_t[mask].sum() / mask.sum()
    loss.backward()
    assert total.item() == pytest.approx(loss.item(), rel=1e-4)
    assert stats["policy/kl"] == pytest.approx(kl_t[mask].mean().item(), rel=1e-4)
    for name, p in plain.named_parameters():
        assert torch.allclose(got[name].double(), p.grad, rtol=1e-3, atol=1e-7), name


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_in_the_reward_the_penalty_is_the_sampling_policys_exact_kl(algo):
    """kl_in="reward": the per-token penalty is beta * KL(pi_old(.|s_t) || pi_ref(.|s_t)),
    logged as policy/kl (PPO), and what the group estimator sees (GRPO)."""
    config, learner, tokenizer = _learner(algo=algo, kl_in="reward")
    batch = _batch(learner.policy, tokenizer)
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        kl_t = L.kl(_hf_log_dists(learner.policy, batch), _hf_log_dists(learner.reference, batch),
                    "full", mask=mask)
    rewards = torch.tensor([1.0, 0.0, 1.0] * 4)
    out = algos.learn(config, learner, batch, rewards, step_seed=0)
    if algo == "ppo":
        assert out.stats["policy/kl"] == pytest.approx(kl_t[mask].mean().item(), rel=1e-4)
    else:
        seen = rewards - config.beta * kl_t.sum(1)
        want = est.ESTIMATORS.resolve("grpo", "estimator")(
            stages.advantage_inputs(config, seen, batch.completion_mask))
        assert torch.allclose(out.advantages, want, atol=1e-4)


def test_the_adaptive_controller_reads_the_exact_kl():
    config, learner, tokenizer = _learner(kl_target=0.01, kl_horizon=10)
    batch = _batch(learner.policy, tokenizer)
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        kl_t = L.kl(_hf_log_dists(learner.policy, batch), _hf_log_dists(learner.reference, batch),
                    "full", mask=mask)
    ref = stages.reference_logprobs(config, learner, batch)
    stages.adapt_beta(config, learner, batch, ref)
    per_row = kl_t.sum(1) / mask.sum(1)
    want = L.adaptive_beta(0.1, per_row.mean().item(), 0.01, 10, mask.shape[0])
    assert learner.beta == pytest.approx(want, rel=1e-5) and learner.beta != 0.1


def test_a_step_that_would_not_fit_is_refused_before_any_model_runs():
    config = TrainConfig(kl_kind="full", beta=0.1, batch_prompts=64, group_size=16,
                         max_new_tokens=512)
    with pytest.raises(ValueError, match=r"kl_kind='full' would hold .* GiB .*vocabulary "
                                         r"151936"):
        check_full_kl_memory(config, 151936)
    check_full_kl_memory(config, 101)  # the embedded model's vocabulary fits


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_run_with_the_exact_kl_logs_it_and_moves_beta(tmp_path, algo):
    from labkit.run.rundir import read_log
    from labkit.trainer import train

    config = TrainConfig(algo=algo, kl_kind="full", beta=0.05, kl_target=0.001, kl_horizon=10,
                         steps=3, batch_prompts=4, group_size=4, max_new_tokens=12, lr=5e-3,
                         eval_every=1000, eval_n=4, eval_samples=0, cgc_prompts=0,
                         progress=False, run_dir=str(tmp_path / algo))
    records = [r for r in read_log(train(config).run_dir / "metrics.jsonl")
               if "policy/kl" in r]
    assert len(records) == 3
    assert all(math.isfinite(r["policy/kl"]) and r["policy/kl"] > -1e-6 for r in records)
    assert records[-1]["policy/kl"] > 0  # three updates at lr 5e-3 move the policy
    betas = [r["policy/beta"] for r in records]
    assert betas[0] == 0.05 and betas[1] < 0.05  # KL below target at the start: beta shrinks
