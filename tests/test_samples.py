"""The rollout inspector: rollouts.jsonl (labkit.probes.samples), bounded and resumable, its
per-token figures against the models' own passes, and its view (labkit.lab.plots)."""

import json
import math
import re

import pytest
import torch
from crashes import train_then_crash

from labkit.lab import plots
from labkit.probes import samples
from labkit.run.rundir import Log
from labkit.settings.config import TrainConfig
from labkit.trainer import Trainer, step_seed, train

SMOKE = dict(batch_prompts=4, group_size=4, max_new_tokens=12, eval_every=100, eval_n=8,
             eval_samples=0, cgc_prompts=0, progress=False, lr=5e-3, seed=2)


@pytest.mark.parametrize("steps, every, groups", [(7, 3, 2), (5, 1, 3), (4, 10, 1)])
def test_the_kept_steps_and_the_file_are_bounded(steps, every, groups):
    config = TrainConfig(steps=steps, rollouts_every=every, rollouts_groups=groups, **SMOKE)
    kept = [s for s in range(1, steps + 1) if samples.keeps(config, s)]
    assert kept[0] == 1 and kept[-1] == steps
    assert all(s % every == 0 for s in kept[1:-1])
    assert len(kept) <= steps // every + 2
    assert samples.logged_rows(config).tolist() == list(range(groups * 4))
    assert not any(samples.keeps(TrainConfig(steps=steps, **SMOKE), s)
                   for s in range(1, steps + 1))  # 0: nothing kept


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_run_keeps_its_groups_token_by_token(tmp_path, algo):
    run = tmp_path / "run"
    config = TrainConfig(run_dir=str(run), algo=algo, steps=5, rollouts_every=2,
                         rollouts_groups=2, **SMOKE)
    result = train(config)
    lines = samples.read(run)
    # steps 1, 2, 4 and the last (5), two groups each: the bound
    assert [(r["step"], r["group"]) for r in lines] == \
        [(s, g) for s in (1, 2, 4, 5) for g in (0, 1)]
    size = (run / samples.FILE).stat().st_size
    assert len(lines) <= (5 // 2 + 2) * 2
    trainer = Trainer(config)
    for line in lines:
        problem = trainer.problems.draw(step_seed(config, line["step"]))[line["group"]]
        assert (line["prompt"], line["answer"]) == (problem.prompt, problem.answer)
        assert len(line["completions"]) == 4
        record = next(r for r in result.history if r["step"] == line["step"])
        for c in line["completions"]:
            n = len(c["tokens"])
            assert 1 <= n <= 12 and "".join(c["tokens"]).startswith(c["text"][:1])
            assert len(c["token_advantage"]) == len(c["entropy"]) == len(c["ratio"]) == n
            assert all(v >= 0 for v in c["entropy"]) and all(v > 0 for v in c["ratio"])
            if algo == "grpo":  # one advantage per completion, on each of its tokens
                assert all(v == pytest.approx(c["advantage"], abs=1e-4)
                           for v in c["token_advantage"])
        rewards = [c["reward"] for c in line["completions"]]
        assert all(r in (0.0, 1.0) for r in rewards)
        assert record["rollout/reward_mean"] >= 0
    assert size < 64 * 1024


def test_the_view_is_what_the_models_compute(tmp_path):
    """The step's entropy and ratio of a kept row against a plain recomputation: the
    entropy of softmax(logits / T) of the policy before the update, the ratio of the
    updated policy's probability of each sampled token to the sampling one's."""
    config = TrainConfig(run_dir=str(tmp_path / "r"), steps=1, rollouts_every=1,
                         rollouts_groups=1, **SMOKE)
    trainer = Trainer(config)
    policy = trainer.policy
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    result = trainer.step(1, inspect=True)
    batch, view = result.batch, result.view
    row = 0
    n = int(batch.completion_mask[row].sum())
    ids = torch.cat([batch.prompt_ids[0][batch.prompt_mask[0].bool()],
                     batch.completion_ids[row, :n]])[None]

    def token_logits(state):
        policy.load_state_dict(state)
        with torch.no_grad():
            logits = policy(ids).logits[0].float() / config.temperature
        P = ids.shape[1] - n
        return logits[P - 1:P - 1 + n]  # the logits that predicted each completion token

    after = {k: v.clone() for k, v in policy.state_dict().items()}
    old = token_logits(before).log_softmax(-1)
    entropy = -(old.exp() * old).sum(-1)
    torch.testing.assert_close(view["entropy"][row, :n], entropy, atol=1e-4, rtol=1e-4)
    new = token_logits(after).log_softmax(-1)
    tokens = batch.completion_ids[row, :n]
    ratio = (new.gather(-1, tokens[:, None]) - old.gather(-1, tokens[:, None])).exp()[:, 0]
    torch.testing.assert_close(view["ratio"][row, :n], ratio, atol=1e-4, rtol=1e-4)
    assert (view["ratio"][row, :n] - 1).abs().max() > 1e-4  # the update moved it
    policy.load_state_dict(after)


def test_a_resumed_run_keeps_each_step_once(tmp_path):
    run = tmp_path / "run"
    config = TrainConfig(run_dir=str(run), steps=4, rollouts_every=1, rollouts_groups=1,
                         checkpoint_every=2, **SMOKE)

    train_then_crash(config, after_step=3)
    assert [r["step"] for r in samples.read(run)] == [1, 2, 3]
    train(resume=run)
    assert [r["step"] for r in samples.read(run)] == [1, 2, 3, 4]


def _line(step, group, advantages, entropy, ratio, tokens=("4", "2", "<eos>")):
    return {"step": step, "group": group, "prompt": "40+2=", "answer": "42",
            "completions": [{"text": "42", "tokens": list(tokens), "reward": 1.0,
                             "advantage": advantages[0], "token_advantage": list(advantages),
                             "entropy": list(entropy), "ratio": list(ratio)}]}


def test_the_view_colours_each_token_and_switches_without_a_script():
    lines = [_line(1, 0, [0.5, 0.5, 0.5], [0.1, 2.0, 0.0], [1.0, 1.5, 0.5]),
             _line(9, 0, [-1.0, -1.0, -1.0], [0.2, 0.4, 0.0], [1.0, 1.0, 2.0])]
    view = plots.rollouts(lines, color="entropy")
    page = view._repr_html_()
    assert "<script" not in page
    assert page.count('type="radio"') == 3 and 'value="entropy" checked' in page
    assert "step 1" in page and "step 9" in page  # a column per step
    assert page.count('class="lk-tok"') == 6 and "&lt;eos&gt;" in page
    # the largest |A| is full strength; positive green, negative red; entropy blue by its max
    assert "--a:rgba(218,54,51,0.750)" in page and "--a:rgba(46,160,67,0.375)" in page
    assert "--e:rgba(31,111,235,0.750)" in page
    # the ratio on a log scale: 2 and 0.5 equally strong, opposite colours; 1 is clear
    assert "--r:rgba(46,160,67,0.750)" in page and "--r:rgba(218,54,51,0.750)" in page
    assert re.search(r"--r:rgba\(\d+,\d+,\d+,0\.000\)", page)
    assert math.isclose(view._scales()["r"], math.log(2))
    with pytest.raises(ValueError, match="color must be one of advantage, entropy, ratio"):
        plots.rollouts(lines, color="reward")
    columns = plots.rollouts({"grpo, step 1": lines[:1], "ppo, step 1": lines[1:]})
    assert "grpo, step 1" in columns._repr_html_() and "ppo, step 1" in columns._repr_html_()


def test_the_rollouts_file_is_read_whole_lines_only(tmp_path):
    log = Log(tmp_path / samples.FILE)
    log.write(_line(1, 0, [0.0], [0.0], [1.0], tokens=("x",)))
    log.close()
    with open(tmp_path / samples.FILE, "a") as f:
        f.write(json.dumps(_line(2, 0, [0.0], [0.0], [1.0]))[:40])  # a torn last line
    assert [r["step"] for r in samples.read(tmp_path)] == [1]
    assert samples.first_and_last(tmp_path)[0]["step"] == 1
