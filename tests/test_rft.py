"""Rejection-sampling fine-tuning (`algo="rft"`, `labkit.rft`): what a round keeps, its loss
against a plain forward pass, and what its updates do."""

from __future__ import annotations

import math

import pytest
import torch

from labkit import rft
from labkit.settings.config import TrainConfig
from labkit.trainer import Trainer, train

SMOKE = dict(steps=3, batch_prompts=8, group_size=4, max_new_tokens=12, eval_every=3,
             eval_n=16, eval_samples=2, cgc_prompts=4, progress=False, algo="rft")


def test_a_round_keeps_the_rewarded_completions():
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.5, -0.3, 1.0])
    assert rft.kept(rewards).tolist() == [1, 3, 5]


def _plain_nll(model, batch, rows):
    """-mean log-prob of the real completion tokens of `rows`, from one plain forward of
    each prompt + completion through the model's own forward, one row at a time."""
    total, count = 0.0, 0
    for n in rows.tolist():
        g = n // batch.group_size
        prompt = batch.prompt_ids[g][batch.prompt_mask[g].bool()]
        length = int(batch.completion_mask[n].sum())
        completion = batch.completion_ids[n][:length]
        ids = torch.cat([prompt, completion])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, completion[:, None])
        total -= float(logp.sum())
        count += length
    return total / count


def test_the_loss_is_the_kept_completions_token_mean_nll():
    from labkit.model.models import load

    trainer = Trainer(TrainConfig(**SMOKE))
    result = trainer.step(1)
    rows = torch.nonzero(result.rewards > 0).squeeze(-1)
    assert 0 < len(rows) < len(result.rewards)  # some kept, some not
    start, _ = load(device="cpu")
    assert result.metrics["loss/sft"] == pytest.approx(_plain_nll(start, result.batch, rows),
                                                       rel=1e-5)
    assert result.metrics["rollout/kept_frac"] == len(rows) / len(result.rewards)
    assert result.advantages.tolist() == (result.rewards > 0).float().tolist()


def test_updates_raise_the_kept_completions_likelihood_and_only_theirs_count():
    from labkit import stages

    config = TrainConfig(**SMOKE)
    trainer = Trainer(config)
    learner, problems = trainer.learner, trainer.problems.draw(0)
    batch = stages.sample(config, learner, trainer.tokenizer, problems, 0)
    rewards = stages.reward(config, problems, batch, 0)
    rows = rft.kept(rewards)
    before = _plain_nll(trainer.policy, batch, rows)
    for s in range(3):
        trainer.step(s + 1, problems=problems)
    assert _plain_nll(trainer.policy, batch, rows) < before - 0.01


def test_rft_runs_and_logs_its_keys(tmp_path):
    result = train(TrainConfig(run_dir=str(tmp_path / "r"), seed=2, **SMOKE))
    for r in result.history[1:]:
        assert 0 <= r["rollout/kept_frac"] <= 1
        if r["rollout/kept_frac"] > 0:
            assert math.isfinite(r["loss/sft"]) and r["loss/sft"] > 0


@pytest.mark.parametrize("settings, words", [
    (dict(algo="rft", beta=0.04), "does not read beta"),
    (dict(algo="rft", dynamic_sampling=True), "dynamic_sampling"),
    (dict(algo="rft", dpo_online=False), "need algo='dpo'"),
])
def test_bad_rft_settings_are_refused(settings, words):
    with pytest.raises(ValueError, match=words):
        TrainConfig(**settings)
