"""labkit.bench.against_trl: the settings handed to TRL's GRPOTrainer match labkit's run, the
reward keeps labkit's rule for truncated completions, and the comparison's verdicts."""

from __future__ import annotations

import math

import pytest
import torch

from labkit.bench import against_trl as AT
from labkit.formulas import stats


def _config(**overrides):
    return AT.run_config(seed=3, steps=40, every=10, eval_n=16, run_dir=None, **overrides)


def test_trl_gets_labkits_batch_clip_kl_sampling_and_checkpoints(tmp_path):
    config = _config(beta=0.04, eps_high=0.28, lr=5e-4, num_iterations=2)
    args = AT.trl_args(config, str(tmp_path))
    assert args.per_device_train_batch_size == config.batch_prompts * config.group_size
    assert args.num_generations == config.group_size
    assert (args.gradient_accumulation_steps, args.steps_per_generation) == (1, 1)
    assert args.num_iterations == 2 and args.max_steps == 40
    assert args.max_completion_length == config.max_new_tokens
    assert args.learning_rate == 5e-4 and args.beta == 0.04
    assert (args.epsilon, args.epsilon_high) == (config.eps_low, 0.28)
    assert args.loss_type == "dapo" and args.scale_rewards == "group"  # token-mean, group std
    assert (args.temperature, args.top_k, args.top_p) == (1.0, 0, 1.0)  # the full softmax
    assert args.max_grad_norm == config.max_grad_norm
    assert args.weight_decay == config.weight_decay
    assert args.seed == 3 and args.save_steps == 10 and not args.bf16
    assert args.shuffle_dataset is False  # B prompts a step, in labkit's order


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_trls_learning_rate_follows_labkits_schedule_after_warmup(tmp_path, schedule):
    """TRL's scheduler, built by transformers from the args, against labkit's factor: equal
    at every step after the warmup; during it labkit runs one step ahead ((s + 1) / w
    against s / w, the difference the module's docstring states)."""
    from transformers import get_scheduler

    from labkit.model.learner import lr_schedule

    config = _config(schedule=schedule, warmup_steps=5)
    args = AT.trl_args(config, str(tmp_path))
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=args.max_steps,
                              scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
    ours = lr_schedule(config)
    for step in range(config.steps):
        theirs = scheduler.get_last_lr()[0] / config.lr
        if step >= config.warmup_steps:
            assert theirs == pytest.approx(ours(step), rel=1e-9, abs=1e-12), step
        else:
            assert theirs == pytest.approx(step / 5) and ours(step) == pytest.approx((step + 1) / 5)
        optimizer.step()
        scheduler.step()


def test_the_reward_scores_a_completion_cut_at_the_budget_zero():
    reward = AT.trl_reward(eos_id=2, budget=4)
    scores = reward(["\\boxed{7}", "\\boxed{7}", "\\boxed{8}"],
                    completion_ids=[[5, 6, 7, 2], [5, 6, 7, 8], [5, 6, 2]],
                    answer=["7", "7", "7"])
    assert scores == [1.0, 0.0, 0.0]  # ended with EOS; cut at 4 tokens; wrong


def test_only_the_matched_settings_are_accepted(tmp_path):
    with pytest.raises(ValueError, match="grpo estimator"):
        AT.trl_args(_config(algo="ppo", lr=5e-4), str(tmp_path))
    with pytest.raises(ValueError, match="token-mean"):
        AT.trl_args(_config(agg="seq-mean-token-mean"), str(tmp_path))


def test_compare_asks_whether_the_two_stay_within_the_margin():
    same = {0: {0: 0.3, 50: 0.4}, 1: {0: 0.3, 50: 0.5}, 2: {0: 0.3, 50: 0.45}}
    near = {s: {0: 0.3, 50: v[50] + d} for (s, v), d in zip(same.items(), (0.01, -0.01, 0.0))}
    far = {s: {0: 0.3, 50: v[50] - 0.2 + d} for (s, v), d in zip(same.items(), (0.01, -0.01, 0.0))}
    noisy = {s: {0: 0.3, 50: v[50] + d} for (s, v), d in zip(same.items(), (0.2, -0.2, 0.0))}
    rows = AT.compare({"labkit": same, "trl": near})
    assert [r["step"] for r in rows] == [0, 50]
    assert rows[0]["difference"]["mean"] == 0.0
    diffs = [same[s][50] - near[s][50] for s in same]
    assert rows[1]["difference"]["mean"] == pytest.approx(sum(diffs) / 3)
    want = stats.paired_interval([same[s][50] for s in same], [near[s][50] for s in same])
    assert rows[1]["difference"]["low"] == pytest.approx(want.low)
    assert rows[1]["verdict"] == stats.SUPPORTED and rows[1]["trl"]["n"] == 3
    assert AT.compare({"labkit": same, "trl": far})[1]["verdict"] == stats.REFUTED
    assert AT.compare({"labkit": same, "trl": noisy})[1]["verdict"] == stats.INCONCLUSIVE
    table = AT.table(rows).splitlines()
    assert table[0].startswith("| step | labkit | TRL") and len(table) == 4
    assert all(math.isfinite(r["labkit"]["mean"]) for r in rows)


def test_bad_options_are_one_clear_line(capsys):
    for argv, words in ((["--seeds", "1", "--out", "x"], "--seeds must be >= 2"),
                        (["--steps", "10", "--every", "3", "--out", "x"], "--every must divide")):
        with pytest.raises(SystemExit) as stop:
            AT.main(argv)
        assert stop.value.code == 2 and words in capsys.readouterr().err


def test_the_figure_draws_each_side_against_samples_with_its_interval():
    rows = AT.compare({"labkit": {0: {0: 0.3, 5: 0.4}, 1: {0: 0.3, 5: 0.5}},
                       "trl": {0: {0: 0.3, 5: 0.45}, 1: {0: 0.3, 5: 0.35}}})
    fig = AT.figure(rows, samples_per_step=256)
    assert [t.name for t in fig.data] == ["labkit", "TRL GRPOTrainer"]
    labkit = fig.data[0]
    assert list(labkit.x) == [0, 5 * 256] and list(labkit.y) == pytest.approx([0.3, 0.45])
    mean = stats.mean_interval([0.4, 0.5])
    assert labkit.error_y.array[1] == pytest.approx(mean.high - mean.mean)
    assert labkit.error_y.arrayminus[1] == pytest.approx(mean.mean - mean.low)
