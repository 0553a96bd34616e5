"""labkit's trainer against its plain reference, `labkit.from_scratch`: one step of GRPO and one
of PPO on the same rollout, from the same weights, give the same numbers.

The trainer runs `Trainer.step(0)`; the reference then runs on copies of the models taken
before it, with the step's rollout, rewards and seed. Compared: the advantages, every
gradient of every optimizer step, the step's loss terms, gradient norm and clip fraction (means
over the optimizer steps), and every weight afterwards. KL is on and not negligible (the
reference is moved away from the policy first), clipping binds (a second pass over the
rollout), PPO's value clip binds too, and each pass has two minibatches.
"""

import copy

import pytest
import torch

from labkit import from_scratch
from labkit.settings.config import TrainConfig
from labkit.trainer import Trainer

SETTINGS = dict(seed=6, beta=0.1, num_iterations=2, minibatches=2, lr=2e-4, warmup_steps=0,
                steps=2, batch_prompts=4, group_size=4, max_new_tokens=12, fast=False,
                eval_n=4, eval_samples=0, cgc_prompts=0, progress=False)
"""Small, with everything the comparison needs switched on; fast=False: the models' own
forward, as the reference runs them. The rate decays (cosine) over the step's optimizer
steps; without warmup it is high enough from the first for the second pass to clip, and
low enough that k3 (exponential in the log-ratio) does not blow the rounding up. Seed 6's
rollout has completions of two lengths (a token mean is no mean of sequence means) and
clips on both sides, below (A < 0) and above (A > 0)."""
VALUE_CLIP = 0.002
"""PPO's value clip here: small enough that the critic's second pass moves values past it, so
the clipped branch of the value loss binds and is compared too."""
TOL = dict(atol=1e-5, rtol=1e-4)
WEIGHT_RTOL = 5e-3
FIGURES = {"grpo": ("loss/policy", "loss/kl", "perf/grad_norm", "clip/total"),
           "ppo": ("loss/policy", "loss/value", "perf/grad_norm", "clip/total")}


def _move_away(model: torch.nn.Module, scale: float = 0.05) -> None:
    """Add fixed noise to a model's weights, so that the policy starts away from it."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))


def _record_gradients(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """Each trained weight's gradient of every backward from now on, by name."""
    seen = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            seen[name] = []
            p.register_hook(lambda grad, out=seen[name]: out.append(grad.detach().clone()))
    return seen


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_same_weights(theirs: dict, mine: dict, before: dict | None = None) -> None:
    """Equal weights; with `before`, equal updates: each tensor's difference at most
    WEIGHT_RTOL of how far it moved (Adam moves a weight whose gradient is rounding noise
    by up to the learning rate, in the noise's direction, so elementwise checks of the
    weights would test the rounding)."""
    assert theirs.keys() == mine.keys()
    for name, w in theirs.items():
        if before is None:
            torch.testing.assert_close(mine[name], w, **TOL, msg=lambda m: f"{name}: {m}")
            continue
        moved, off = (w - before[name]).norm(), (mine[name] - w).norm()
        assert moved > 0 and off <= WEIGHT_RTOL * moved, (name, float(off), float(moved))


def _assert_same_gradients(theirs: dict, mine: dict, optimizer_steps: int) -> None:
    assert theirs.keys() == mine.keys()
    for name in theirs:
        assert len(theirs[name]) == len(mine[name]) == optimizer_steps, name
        for k, (a, b) in enumerate(zip(theirs[name], mine[name])):
            torch.testing.assert_close(b, a, **TOL, msg=lambda m: f"{name}, step {k}: {m}")


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_trainer_step_equals_the_plain_reference(algo):
    config = TrainConfig(algo=algo, **SETTINGS,
                         **(dict(value_clip=VALUE_CLIP) if algo == "ppo" else {}))
    trainer = Trainer(config)
    learner = trainer.learner
    _move_away(learner.reference)
    policy, reference = copy.deepcopy(trainer.policy), copy.deepcopy(learner.reference)
    critic = copy.deepcopy(learner.critic) if algo == "ppo" else None
    if algo == "ppo":  # the trainer's critic starts as Critic: the policy's stack, head 0
        _assert_same_weights(_weights(critic), _weights(from_scratch.Critic(policy)))
    theirs = {"policy": _record_gradients(trainer.policy)}
    mine = {"policy": _record_gradients(policy)}
    if algo == "ppo":
        theirs["critic"], mine["critic"] = _record_gradients(learner.critic), \
            _record_gradients(critic)
    before = {"policy": _weights(policy), "critic": _weights(critic) if critic else None}

    result = trainer.step(0)
    batch = result.batch
    n_steps = config.num_iterations * config.minibatches
    lrs = {name: [from_scratch.warmup_cosine(k, lr, config.optimizer_steps,
                                             config.warmup_steps, config.min_lr_ratio)
                  for k in range(n_steps + 1)]
           for name, lr in (("lr", config.lr), ("critic_lr", config.critic_lr))}
    rollout = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
               batch.completion_mask, batch.old_logprobs, result.rewards)
    common = dict(seed=result.seed, beta=config.beta, temperature=config.temperature,
                  num_iterations=config.num_iterations, minibatches=config.minibatches,
                  lr=lrs["lr"][:n_steps])
    if algo == "grpo":
        out = from_scratch.grpo_step(policy, reference, *rollout, **common)
    else:
        out = from_scratch.ppo_step(policy, reference, critic, *rollout, **common,
                                    critic_lr=lrs["critic_lr"][:n_steps], value_clip=VALUE_CLIP)

    metrics = result.metrics
    assert 0 < result.rewards.mean() < 1  # mixed groups: the policy loss has a gradient
    assert len(batch.completion_mask.sum(1).unique()) > 1  # lengths differ
    assert metrics["reuse/clip_low"] > 0 and metrics["reuse/clip_high"] > 0  # clip binds
    assert out.metrics["clip/total"] > 0
    if algo == "ppo":
        assert metrics["value/clipfrac"] > 0  # the value clip binds
    kl_key = "loss/kl" if algo == "grpo" else "policy/kl"
    assert abs(metrics[kl_key]) > 1e-3  # the KL term is not negligible
    assert metrics["opt/lr"] == pytest.approx(lrs["lr"][n_steps], rel=1e-6)
    torch.testing.assert_close(out.advantages, result.advantages, **TOL)
    for key in FIGURES[algo]:
        assert out.metrics[key] == pytest.approx(metrics[key], rel=TOL["rtol"],
                                                 abs=TOL["atol"]), key
    for name in theirs:
        _assert_same_gradients(theirs[name], mine[name], n_steps)
    _assert_same_weights(_weights(trainer.policy), _weights(policy), before["policy"])
    if algo == "ppo":
        _assert_same_weights(_weights(learner.critic), _weights(critic), before["critic"])
