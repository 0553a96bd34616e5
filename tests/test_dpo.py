"""DPO (`labkit.preference`): the pairs drawn from groups, the losses against their formulas
and against TRL's DPOTrainer._compute_loss (loss and gradient, on completions sampled from
the embedded model), and `algo="dpo"` in the loop, online and offline."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from labkit import preference as P
from labkit.settings.config import TrainConfig
from labkit.trainer import Trainer, train

SMOKE = dict(steps=3, batch_prompts=8, group_size=4, max_new_tokens=12, eval_every=3,
             eval_n=16, eval_samples=2, cgc_prompts=4, progress=False, algo="dpo")


# --- pairs --------------------------------------------------------------------------------------

def test_pairs_best_against_worst_while_strictly_better():
    rewards = torch.tensor([0., 1., 1., 0.,   # two right, two wrong: 1 with 3, 2 with 0
                            1., 1., 1., 1.,   # all right: no pair
                            0., 0., 0., 1.,   # one right: it against the last wrong
                            0.2, 0.9, 0.5, 0.5])  # graded: 13 with 12, then 14 = 15: stop
    found = P.pairs(rewards, 4)
    assert found.chosen.tolist() == [1, 2, 11, 13]
    assert found.rejected.tolist() == [3, 0, 10, 12]
    assert found.pairless_groups == 1
    assert (rewards[found.chosen] > rewards[found.rejected]).all()


def test_pairs_at_group_size_two_is_the_group_itself():
    found = P.pairs(torch.tensor([0., 1., 1., 1., 1., 0.]), 2)
    assert found.chosen.tolist() == [1, 4] and found.rejected.tolist() == [0, 5]
    assert found.pairless_groups == 1


# --- the losses against their formulas -------------------------------------------------------

def _plain(loss_type, c, r, rc, rr, beta, eps, lc, lr):
    """The loss of one pair, written from the papers with math's functions."""
    def log_sigmoid(x):
        return -math.log1p(math.exp(-x))

    h = (c - rc) - (r - rr)
    if loss_type == "sigmoid":
        return -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h)
    if loss_type == "robust":
        return (-(1 - eps) * log_sigmoid(beta * h) + eps * log_sigmoid(-beta * h)) / (1 - 2 * eps)
    return ((c - rc) / lc - (r - rr) / lr - 1 / (2 * beta)) ** 2


@pytest.mark.parametrize("loss_type, eps", [("sigmoid", 0.0), ("sigmoid", 0.2),
                                            ("robust", 0.1), ("ipo", 0.0)])
def test_losses_match_their_formulas(loss_type, eps):
    g = torch.Generator().manual_seed(3)
    c, r, rc, rr = (torch.randn(6, generator=g, dtype=torch.float64) * 3 for _ in range(4))
    lc, lr = torch.tensor([1., 3, 7, 2, 5, 9]), torch.tensor([4., 1, 2, 8, 3, 6])
    beta = 0.3
    loss, chosen_reward, rejected_reward = P.dpo_loss(
        c, r, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps,
        chosen_len=lc.double(), rejected_len=lr.double())
    want = [_plain(loss_type, *map(float, v), beta, eps, float(a), float(b))
            for v, a, b in zip(zip(c, r, rc, rr), lc, lr)]
    assert loss.tolist() == pytest.approx(want, rel=1e-12)
    assert chosen_reward.tolist() == pytest.approx((beta * (c - rc)).tolist())
    assert rejected_reward.tolist() == pytest.approx((beta * (r - rr)).tolist())


def test_sigmoid_gradient_raises_chosen_and_lowers_rejected():
    c = torch.tensor([-5.0], requires_grad=True)
    r = torch.tensor([-5.0], requires_grad=True)
    loss, _, _ = P.dpo_loss(c, r, torch.tensor([-5.0]), torch.tensor([-5.0]), beta=0.1)
    loss.sum().backward()
    # at h = 0: d/dc = -beta * sigmoid(0) = -0.05, d/dr = +0.05
    assert c.grad.item() == pytest.approx(-0.05) and r.grad.item() == pytest.approx(0.05)


def test_ipo_without_lengths_is_refused():
    with pytest.raises(ValueError, match="chosen_len"):
        P.dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=0.1,
                   loss_type="ipo")


# --- parity with TRL's DPOTrainer._compute_loss -----------------------------------------------

TRL_CASES = [("sigmoid", 0.1, 0.0), ("ipo", 0.1, 0.0), ("robust", 0.1, 0.2), ("sigmoid", 0.5, 0.0)]


@pytest.fixture(scope="module")
def think():
    """The embedded tiny-arith-think model, whose completions' lengths are its own choice."""
    from labkit.model.models import load
    from labkit.settings.embedded import THINK_NAME

    return load(THINK_NAME, device="cpu")


def _sampled_pairs(think):
    """Completions of tiny-arith-think (worked and direct, so of different lengths) as
    labkit's batch, and pairs of completions of one prompt between them."""
    from labkit.model.rollout import rollout

    model, tokenizer = think
    prompts = ["3+4+5+1=", "9+8=", "2+7+6+6+3=", "5+5+5="]
    batch = rollout(model, tokenizer, prompts, group_size=4, max_new_tokens=40, seed=5)
    chosen = torch.tensor([0, 2, 4, 6, 8, 10, 12, 14])
    rejected = chosen + 1
    # some pairs differ in length: the IPO's division by length shows
    assert (batch.lengths[chosen] != batch.lengths[rejected]).any()
    return batch, chosen, rejected


def _trl_examples(batch, chosen, rejected):
    examples = []
    for c, r in zip(chosen.tolist(), rejected.tolist()):
        g = c // batch.group_size
        prompt = batch.prompt_ids[g][batch.prompt_mask[g].bool()].tolist()
        examples.append({"prompt_ids": prompt,
                         "chosen_ids": batch.completion_ids[c][:int(batch.lengths[c])].tolist(),
                         "rejected_ids": batch.completion_ids[r][:int(batch.lengths[r])].tolist()})
    return examples


def _grads(model):
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
                      for p in model.parameters()])


@pytest.mark.parametrize("loss_type, beta, eps", TRL_CASES)
def test_loss_and_gradient_match_trls_dpo_trainer(think, tmp_path, loss_type, beta, eps):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from labkit.model.scoring import model_forward, token_scores

    batch, chosen, rejected = _sampled_pairs(think)
    reference = copy.deepcopy(think[0]).eval()
    policy = copy.deepcopy(think[0]).train()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # the policy has moved from the reference: log-ratios not 0
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    theirs_policy, theirs_reference = copy.deepcopy(policy), copy.deepcopy(reference)

    rows = torch.cat([chosen, rejected])
    logp = token_scores(policy, batch, rows, forward=model_forward).logp
    with torch.no_grad():
        ref = token_scores(reference, batch, rows, forward=model_forward).logp
    mask = batch.completion_mask[rows]
    seq, seq_ref, lengths = (logp * mask).sum(1), (ref * mask).sum(1), mask.sum(1).float()
    k = len(chosen)
    ours, _, _ = P.dpo_loss(seq[:k], seq[k:], seq_ref[:k], seq_ref[k:], beta=beta,
                            loss_type=loss_type, label_smoothing=eps,
                            chosen_len=lengths[:k], rejected_len=lengths[k:])
    ours.mean().backward()

    text = datasets.Dataset.from_list([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    args = trl.DPOConfig(output_dir=str(tmp_path), beta=beta, loss_type=[loss_type],
                         label_smoothing=eps, report_to="none", use_cpu=True, bf16=False,
                         save_strategy="no", disable_tqdm=True, max_length=None)
    trainer = trl.DPOTrainer(model=theirs_policy, ref_model=theirs_reference, args=args,
                             train_dataset=text, processing_class=think[1])
    trainer.model.train()
    inputs = trainer.data_collator(_trl_examples(batch, chosen, rejected))
    theirs = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    theirs.backward()

    assert ours.mean().item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)
    a, b = _grads(policy), _grads(trainer.model)
    assert a.norm() > 0
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# --- algo="dpo" in the loop --------------------------------------------------------------------

@pytest.mark.parametrize("online", [True, False])
def test_dpo_runs_online_and_offline(tmp_path, online):
    result = train(TrainConfig(run_dir=str(tmp_path / "r"), dpo_online=online, seed=1, **SMOKE))
    records = result.history[1:]
    for r in records:
        assert r["dpo/pairs"] + r["dpo/pairless_frac"] > 0
        assert 0 <= r["dpo/pairless_frac"] <= 1
    trained = [r for r in records if r["dpo/pairs"] > 0]
    assert trained and all(math.isfinite(r["loss/dpo"]) for r in trained)
    assert ("policy/kl_k1" in trained[0]) == online  # offline samples the reference itself


def test_offline_samples_the_starting_model_every_step():
    """Offline, a step's rollout comes from the frozen reference: the same completions
    whatever the policy has learned; online, they follow the policy."""
    config = TrainConfig(dpo_online=False, lr=5e-2, **{k: v for k, v in SMOKE.items()})
    trainer = Trainer(config)
    fresh = Trainer(config)
    trainer.step(1)
    trainer.step(2)
    assert trainer.step(3).batch.texts == fresh.step(3).batch.texts
    online = Trainer(TrainConfig(lr=5e-2, **SMOKE))
    online_fresh = Trainer(TrainConfig(lr=5e-2, **SMOKE))
    online.step(1)
    online.step(2)
    assert online.step(3).batch.texts != online_fresh.step(3).batch.texts


def test_updates_move_the_implied_rewards_of_their_pairs_apart():
    """Updates on one step's pairs raise the chosen completions' implied reward above the
    rejected ones' (TRL's rewards/margins and rewards/accuracies on the pairs trained on)."""
    from labkit import stages

    config = TrainConfig(batch_prompts=16, **{k: v for k, v in SMOKE.items()
                                             if k != "batch_prompts"})
    trainer = Trainer(config)
    learner = trainer.learner
    problems = trainer.problems.draw(0)
    batch = stages.sample(config, learner, trainer.tokenizer, problems, 0)
    found = P.pairs(stages.reward(config, problems, batch, 0), config.group_size)
    assert len(found.chosen) >= 4
    ref = stages.no_grad_scores(config, learner.reference, learner, batch, distribution=False)

    def margins():
        logp = stages.no_grad_scores(config, learner.policy, learner, batch, distribution=False)
        implied = config.dpo_beta * ((logp - ref) * batch.completion_mask).sum(1)
        return implied[found.chosen] - implied[found.rejected]

    assert margins().abs().max() < 1e-4  # the policy is the reference
    for s in range(4):
        P.dpo_update(config, learner, batch, found, ref, s)
    after = margins()
    assert after.mean() > 0.05 and (after > 0).float().mean() > 0.6


@pytest.mark.parametrize("settings, words", [
    (dict(algo="dpo", beta=0.04), "does not read beta"),
    (dict(algo="dpo", eps_high=0.28), "does not read eps_high"),
    (dict(algo="grpo", dpo_beta=0.2), "need algo='dpo'"),
    (dict(algo="dpo", group_size=1), "group_size must be >= 2"),
    (dict(algo="dpo", dpo_loss="ipo", label_smoothing=0.1), "not 'ipo'"),
    (dict(algo="dpo", dpo_online=False, lora_rank=4), "frozen copy"),
    (dict(algo="dpo", dpo_online=False, ref_sync_every=3), "ref_sync_every"),
    (dict(algo="dpo", label_smoothing=0.5), "label_smoothing"),
    (dict(algo="dpo", dpo_loss="hinge"), "dpo_loss"),
    (dict(algo="dpo", stop_rules="clip/total>0.5"), "only logged with algo='grpo' or 'ppo'"),
    (dict(algo="dpo", dpo_online=False, stop_rules="policy/kl_k1>1"), "online DPO"),
    (dict(algo="grpo", stop_rules="dpo/reward_margin<0"), "only logged with algo='dpo'"),
])
def test_bad_dpo_settings_are_refused(settings, words):
    with pytest.raises(ValueError, match=words):
        TrainConfig(**settings)


def test_under_lora_the_reference_is_the_policy_with_adapters_off(tmp_path):
    pytest.importorskip("peft")
    from labkit.model.lora import AdaptersOff

    config = TrainConfig(lora_rank=4, lr=1e-2, **SMOKE)
    trainer = Trainer(config)
    assert isinstance(trainer.learner.reference, AdaptersOff)
    results = [trainer.step(s).metrics for s in (1, 2, 3)]
    trained = [m for m in results if m["dpo/pairs"] > 0]
    assert trained and all(math.isfinite(m["loss/dpo"]) for m in trained)
    assert any(abs(m["dpo/reward_chosen"]) > 0 for m in trained[1:] or trained)


def test_three_steps_match_trls_dpo_trainer_train(think, tmp_path):
    """Three optimizer steps on the same pairs from the same starting model: labkit's DPO
    update (num_iterations=3, one minibatch) against TRL's DPOTrainer.train (max_steps=3,
    one batch of every pair), both AdamW at a constant lr with grad-norm clipping. The
    weights end where TRL's end, to a thousandth of the distance they moved."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from labkit import stages
    from labkit.model.models import load

    config = TrainConfig(task="think", batch_prompts=8, group_size=4, lr=1e-3,
                         warmup_steps=0, schedule="constant", num_iterations=3,
                         dpo_beta=0.1, eval_n=16, progress=False, algo="dpo")
    trainer = Trainer(config)
    learner = trainer.learner
    start = torch.cat([p.detach().flatten().clone() for p in trainer.policy.parameters()])
    problems = trainer.problems.draw(0)
    batch = stages.sample(config, learner, trainer.tokenizer, problems, 0)
    found = P.pairs(stages.reward(config, problems, batch, 0), config.group_size)
    assert len(found.chosen) >= 4
    ref = stages.no_grad_scores(config, learner.reference, learner, batch, distribution=False)
    P.dpo_update(config, learner, batch, found, ref, 0)
    ours = torch.cat([p.detach().flatten() for p in trainer.policy.parameters()])

    policy, tokenizer = load(config.model, device="cpu")
    reference, _ = load(config.model, device="cpu")
    examples = _trl_examples(batch, found.chosen, found.rejected)
    args = trl.DPOConfig(output_dir=str(tmp_path), beta=0.1, loss_type=["sigmoid"],
                         learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0,
                         weight_decay=0.0, max_grad_norm=1.0, max_steps=3,
                         per_device_train_batch_size=len(examples), report_to="none",
                         use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
                         max_length=None, seed=0, logging_steps=1)
    text = datasets.Dataset.from_list([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    peer = trl.DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=text,
                          processing_class=tokenizer)
    peer.train_dataset = datasets.Dataset.from_list(examples)  # labkit's token ids, as sampled
    peer.train()
    theirs = torch.cat([p.detach().flatten() for p in peer.model.parameters()])

    moved = (theirs - start).norm()
    assert moved > 1e-2
    assert (ours - theirs).norm() / moved < 1e-3


@pytest.mark.parametrize("agg, parallel", [("token-mean", True), ("seq-mean-token-sum", True),
                                           ("seq-mean-token-mean", False)])
def test_at_group_size_two_and_the_start_grpos_gradient_is_dpos(agg, parallel):
    """With G=2 and the policy still the reference (h = 0, every pair weighted sigmoid(0)),
    DPO's gradient is c x sum over pairs of grad log pi(y_w) - grad log pi(y_l), and so is
    GRPO's (advantages +-1/sqrt(2)) when its aggregation weighs every completion's token sum
    alike: cosine 1. Dividing each completion by its own length (seq-mean-token-mean)
    weighs the pair's two sides apart where their lengths differ: below 1."""
    config = TrainConfig(task="think", batch_prompts=16, group_size=2, algo="dpo",
                         dpo_grpo_cosine=True, agg=agg, eval_n=16, progress=False)
    metrics = Trainer(config).step(1).metrics
    assert metrics["dpo/pairs"] >= 3
    if parallel:
        assert metrics["dpo/grpo_cosine"] == pytest.approx(1.0, abs=1e-5)
    else:
        assert 0.5 < metrics["dpo/grpo_cosine"] < 0.999


def test_at_group_size_four_grpo_also_weighs_what_dpo_leaves_unpaired():
    config = TrainConfig(task="think", batch_prompts=16, group_size=4, algo="dpo",
                         dpo_grpo_cosine=True, eval_n=16, progress=False)
    cosine = Trainer(config).step(1).metrics["dpo/grpo_cosine"]
    assert 0.3 < cosine < 0.999
