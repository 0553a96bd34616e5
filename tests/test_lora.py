"""LoRA through peft (`TrainConfig.lora_rank`): only the adapters train, the reference is the
base model with no second copy, PPO's critic has adapters of its own, checkpoints hold the
adapters, and final/ is the merged model. On a random Qwen2 of scaled-down shapes."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from peers import peer

from labkit import algos
from labkit.model import lora
from labkit.model.learner import build_learner, learner_state, make_accelerator, restore_learner
from labkit.model.rollout import rollout
from labkit.model.scoring import model_forward, token_logprobs
from labkit.run.rundir import rng_state
from labkit.settings.config import TrainConfig
from labkit.settings.preflight import preflight

PROMPTS = ["1+2=", "37+85=", "9+90=", "12+34+56="]


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory, random_qwen):
    peer("peft")
    model, tokenizer = random_qwen
    path = tmp_path_factory.mktemp("qwen")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _learner(path, **fields):
    config = TrainConfig(model=str(path), device="cpu", lora_rank=4, lora_alpha=8,
                         batch_prompts=4, group_size=3, max_new_tokens=8, lr=1e-2, warmup_steps=0,
                         **fields)
    learner, tokenizer = build_learner(config, make_accelerator(config))
    return config, learner, tokenizer


def _batch(model, tokenizer):
    return rollout(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=8, seed=3)


def _base_weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if ".lora_" not in k}


def test_only_the_adapters_train_and_the_reference_is_the_base_model(qwen_path, random_qwen):
    config, learner, tokenizer = _learner(qwen_path, beta=0.1)
    policy = learner.policy
    assert isinstance(learner.reference, lora.AdaptersOff)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == \
        {n for n, _ in policy.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    assert sum(p.numel() for p in learner.reference.parameters()) == 0  # no second copy
    base_before = _base_weights(policy)
    adapters_before = {k: v.clone() for k, v in lora.adapter_state(policy).items()}
    batch = _batch(policy, tokenizer)
    rewards = torch.tensor([1.0, 0.0, 0.0] * 4)
    algos.learn(config, learner, batch, rewards, step_seed=0)
    assert all(torch.equal(v, base_before[k]) for k, v in _base_weights(policy).items())
    after = lora.adapter_state(policy)
    assert any(not torch.equal(after[k], adapters_before[k]) for k in after)

    base, _ = random_qwen  # the model as saved: the reference must score exactly as it does
    with torch.no_grad():
        ours, _ = token_logprobs(learner.reference, batch, forward=model_forward)
        want, _ = token_logprobs(base, batch, forward=model_forward)
        moved, _ = token_logprobs(policy, batch, forward=model_forward)
    mask = batch.completion_mask.bool()
    assert (ours - want)[mask].abs().max() < 1e-6
    assert (moved - want)[mask].abs().max() > 1e-4  # the adapters are back on after the pass


def test_ppos_critic_has_adapters_of_its_own_and_a_value_head_that_trains(qwen_path):
    config, learner, tokenizer = _learner(qwen_path, algo="ppo")
    critic, policy = learner.critic, learner.policy
    trains = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert {"head.weight", "head.bias"} <= trains
    assert trains - {"head.weight", "head.bias"} and all(".lora_" in n for n in trains
                                                         if not n.startswith("head."))
    own = {id(p) for p in critic.parameters()}
    assert not own & {id(p) for p in policy.parameters()}  # its own backbone copy
    base_before, critic_base = _base_weights(policy), _base_weights(critic.backbone)
    head = critic.head.weight.clone()
    critic_adapters = {k: v.clone() for k, v in lora.adapter_state(critic.backbone).items()}
    batch = _batch(policy, tokenizer)
    for seed in (0, 1):  # the value head starts at 0: the backbone's gradient from step 2 on
        algos.learn(config, learner, batch, torch.tensor([1.0, 0.0, 0.0] * 4), seed)
    assert all(torch.equal(v, base_before[k]) for k, v in _base_weights(policy).items())
    assert all(torch.equal(v, critic_base[k]) for k, v in _base_weights(critic.backbone).items())
    assert not torch.equal(critic.head.weight, head)
    moved = lora.adapter_state(critic.backbone)
    assert any(not torch.equal(moved[k], critic_adapters[k]) for k in moved)


def test_a_checkpoint_holds_the_adapters_and_restores_them(qwen_path):
    config, learner, tokenizer = _learner(qwen_path)
    batch = _batch(learner.policy, tokenizer)
    algos.learn(config, learner, batch, torch.tensor([1.0, 0.0, 0.0] * 4), step_seed=0)
    state = learner_state(learner)
    assert state["policy"] and all(".lora_" in k for k in state["policy"])
    _, fresh, _ = _learner(qwen_path)
    restore_learner(fresh, state | {"rng": rng_state()})
    got, want = lora.adapter_state(fresh.policy), lora.adapter_state(learner.policy)
    assert all(torch.equal(got[k], want[k]) for k in want)
    _, other, _ = _learner(qwen_path, lora_targets="q_proj,v_proj")  # fewer adapters
    with pytest.raises(ValueError, match="do not fit this model"):
        restore_learner(other, state | {"rng": rng_state()})


def test_a_run_saves_the_merged_model_and_the_adapters(qwen_path, tmp_path):
    """On the embedded model, whose rewards vary from the first step (the random model's are
    all 0, and its adapters would not move)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from labkit.settings.embedded import EMBEDDED_PATH
    from labkit.trainer import train

    config = TrainConfig(lora_rank=4, lora_alpha=8, steps=2, lr=1e-2, warmup_steps=0,
                         batch_prompts=4, group_size=4, max_new_tokens=12, eval_every=1000,
                         eval_n=4, eval_samples=0, cgc_prompts=0, progress=False,
                         run_dir=str(tmp_path / "run"))
    result = train(config)
    final = result.run_dir / "final"
    merged = AutoModelForCausalLM.from_pretrained(final)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(EMBEDDED_PATH),
                                        final / "adapter")
    base = AutoModelForCausalLM.from_pretrained(EMBEDDED_PATH)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = (m(input_ids=ids).logits for m in (merged, adapted, base))
    assert (a - b).abs().max() < 1e-5  # merged == base + adapters
    assert (a - c).abs().max() > 1e-4  # and the adapters learned something
    adapter_config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(EMBEDDED_PATH)


def test_bad_lora_settings_are_said_before_the_model_trains(qwen_path, monkeypatch):
    with pytest.raises(ValueError, match=r"lora_targets='w_q' matches no module.*q_proj"):
        _learner(qwen_path, lora_targets="w_q")
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    with pytest.raises(ValueError, match=r"pip install 'labkit\[lora\]'"):
        preflight(TrainConfig(lora_rank=4))
