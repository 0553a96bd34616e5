"""Iterative GRPO's moving reference (`ref_sync_every`, `ref_mix`): the mix against TRL's
SyncRefModelCallback on the same weights, the KL it makes drop, its checkpoints, and the
configs it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from crashes import train_then_crash

from labkit.model.learner import make_accelerator
from labkit.settings.config import TrainConfig
from labkit.stages import mix_into
from labkit.trainer import Trainer, train

SMOKE = dict(steps=4, batch_prompts=4, group_size=4, max_new_tokens=12, eval_every=4,
             eval_n=16, eval_samples=2, cgc_prompts=4, progress=False, lr=5e-3, beta=0.04)
PERF = ("perf/",)


def _moved_pair(tiny, seed: int):
    """The embedded model as a reference and a copy of it moved by noise as the policy."""
    model, _ = tiny
    reference, policy = copy.deepcopy(model), copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.01)
    return reference, policy


@pytest.mark.parametrize("alpha", [0.6, 1.0, 0.05])
def test_mix_equals_trls_sync_target_model(tiny, alpha):
    trl_callbacks = pytest.importorskip("trl.trainer.callbacks")
    make_accelerator(TrainConfig(device="cpu"))  # TRL reads accelerate's state (DeepSpeed?)
    reference, policy = _moved_pair(tiny, seed=1)
    theirs = copy.deepcopy(reference)
    trl_callbacks.SyncRefModelCallback.sync_target_model(policy, theirs, alpha)
    mix_into(reference, policy, alpha)
    moved = 0
    for ours, trl_weight, start in zip(reference.parameters(), theirs.parameters(),
                                       tiny[0].parameters()):
        assert torch.equal(ours, trl_weight)
        moved += not torch.equal(ours, start)
    assert moved == len(list(reference.parameters()))  # every weight moved, not only some


def test_mix_by_the_formula_and_one_copies(tiny):
    reference, policy = _moved_pair(tiny, seed=2)
    before = [p.clone() for p in reference.parameters()]
    mix_into(reference, policy, 0.25)
    for mixed, old, new in zip(reference.parameters(), before, policy.parameters()):
        torch.testing.assert_close(mixed, 0.25 * new + 0.75 * old, rtol=0, atol=1e-7)
    mix_into(reference, policy, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), policy.parameters()))


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_copying_sync_makes_the_next_steps_kl_vanish(tmp_path, algo):
    """With ref_mix=1 after step 2 the reference is the policy that samples step 3: k1 of the
    sampling log-probs against the reference is 0 up to rounding, where the run without the
    sync has drifted from its start (GRPO's KL in the loss, PPO's in the reward alike)."""
    synced = train(TrainConfig(run_dir=str(tmp_path / "s"), ref_sync_every=2, ref_mix=1.0,
                               algo=algo, **SMOKE)).history
    frozen = train(TrainConfig(run_dir=str(tmp_path / "f"), algo=algo, **SMOKE)).history
    assert [r["ref/synced"] for r in synced[1:]] == [0.0, 1.0, 0.0, 1.0]
    assert "ref/synced" not in frozen[1]
    assert all("policy/kl_k1" in r for r in synced[1:])  # logged on every step, none skipped
    assert synced[1]["policy/kl_k1"] == frozen[1]["policy/kl_k1"]  # same until the first sync
    assert abs(frozen[3]["policy/kl_k1"]) > 1e-3
    assert abs(synced[3]["policy/kl_k1"]) < 1e-5
    assert abs(synced[4]["policy/kl_k1"]) > 1e-5  # step 3 moved the policy on


def test_trainer_mixes_the_reference_after_its_sync_steps():
    config = TrainConfig(ref_sync_every=2, ref_mix=0.5, **SMOKE)
    trainer = Trainer(config)
    start = [p.clone() for p in trainer.learner.reference.parameters()]
    trainer.step(1)
    assert all(torch.equal(a, b) for a, b in zip(trainer.learner.reference.parameters(), start))
    trainer.step(2)
    for ref, old, new in zip(trainer.learner.reference.parameters(), start,
                             trainer.policy.parameters()):
        torch.testing.assert_close(ref, 0.5 * new + 0.5 * old, rtol=0, atol=1e-7)


def test_resume_restores_the_moved_reference(tmp_path):
    """A run that syncs, cut after step 3 and resumed from its step-2 checkpoint, logs what an
    uninterrupted one logs: the checkpoint holds the moved reference."""
    settings = dict(SMOKE, checkpoint_every=2, ref_sync_every=1, ref_mix=0.5, seed=1)
    whole = train(TrainConfig(run_dir=str(tmp_path / "whole"), **settings))

    train_then_crash(TrainConfig(run_dir=str(tmp_path / "cut"), **settings), after_step=3)
    resumed = train(resume=tmp_path / "cut")

    def comparable(records):
        return [{k: v for k, v in r.items() if not k.startswith(PERF)} for r in records]

    assert comparable(resumed.history) == comparable(whole.history)
    state = torch.load(tmp_path / "whole" / "checkpoints" / "step_000004.pt", weights_only=False)
    assert "reference" in state


@pytest.mark.parametrize("settings, words", [
    (dict(ref_sync_every=2), "needs a reference, beta > 0"),
    (dict(ref_sync_every=2, beta=0.04, lora_rank=4), "adapters off"),
    (dict(ref_sync_every=-1, beta=0.04), "ref_sync_every"),
    (dict(ref_sync_every=2, beta=0.04, ref_mix=0.0), "ref_mix"),
    (dict(ref_sync_every=2, beta=0.04, ref_mix=1.5), "ref_mix"),
])
def test_bad_sync_settings_are_refused(settings, words):
    with pytest.raises(ValueError, match=words):
        TrainConfig(**settings)
