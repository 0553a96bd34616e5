"""The credit microscope: Monte Carlo prefix values against an exact enumeration of every
continuation on a six-token vocabulary, the advantages and position means they feed, and
the ends of written steps."""

import math

import pytest
import torch

from labkit.model.credit import at_steps, by_position, mc_advantages, prefix_values, step_ends
from labkit.model.rollout import RolloutBatch

BUDGET = 3


def _tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + ["a", "b"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m:.)"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                        special_tokens=[("<bos>", 1)])
    core.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", padding_side="left")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=6, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # spread the next-token distribution so every path matters
        model.lm_head.weight.mul_(8.0)
    return model


def reward_of(text: str) -> float:
    """0, 0.5 or 1: half a point for each 'a', at most two."""
    return min(text.count("a"), 2) / 2


def _score(rows, texts):
    return [reward_of(t) for t in texts]


def _batch(tokenizer, prompt: str, completions: list[list[int]]) -> RolloutBatch:
    enc = tokenizer([prompt] * len(completions), return_tensors="pt")
    width = max(map(len, completions))
    ids = torch.tensor([c + [0] * (width - len(c)) for c in completions])
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    return RolloutBatch(prompt_ids=enc.input_ids, prompt_mask=enc.attention_mask,
                        completion_ids=ids, completion_mask=mask,
                        old_logprobs=torch.zeros(ids.shape), texts=[""] * len(completions),
                        group_index=torch.zeros(len(completions), dtype=torch.long),
                        finished=torch.ones(len(completions), dtype=torch.bool), group_size=1)


def exact_value(model, tokenizer, prefix: list[int], written: list[int], budget: int) -> float:
    """E[reward] of finishing `written` (completion tokens so far) after `prefix` (the prompt's
    ids), every continuation of up to `budget` tokens enumerated with its probability."""
    if budget == 0:
        return 0.0  # out of budget without EOS: scores 0
    with torch.no_grad():
        logits = model(torch.tensor([prefix + written])).logits[0, -1]
    probs = logits.float().softmax(-1).tolist()
    total = 0.0
    for token, p in enumerate(probs):
        if token == tokenizer.eos_token_id:
            total += p * reward_of(tokenizer.decode(written, skip_special_tokens=True))
        else:
            total += p * exact_value(model, tokenizer, prefix, written + [token], budget - 1)
    return total


def test_prefix_values_match_an_exact_enumeration_of_every_continuation():
    tokenizer, model = _tokenizer(), _model()
    a, b, eos = 4, 5, 2
    completions = [[a, b, eos], [b, eos]]
    batch = _batch(tokenizer, "ab", completions)
    rewards = torch.tensor([reward_of("ab"), reward_of("b")])
    samples = 4000
    found = prefix_values(model, tokenizer, batch, rewards, _score, samples=samples,
                          max_new_tokens=BUDGET, seed=3)
    prompt = tokenizer("ab").input_ids
    assert found.continuations == samples * (3 + 2)
    for i, completion in enumerate(completions):
        for t in range(len(completion)):
            want = exact_value(model, tokenizer, prompt, completion[:t], BUDGET - t)
            se = 0.5 / math.sqrt(samples)  # rewards lie in [0, 1]
            assert abs(found.values[i, t].item() - want) < 5 * se, (i, t, want)
        assert found.values[i, len(completion)] == rewards[i]  # the end: its own reward
    assert math.isnan(found.values[1, 3])  # beyond row 1's end


def test_positions_pick_the_prefixes_and_are_checked():
    tokenizer, model = _tokenizer(), _model()
    batch = _batch(tokenizer, "ab", [[4, 5, 2], [5, 2]])
    found = prefix_values(model, tokenizer, batch, torch.tensor([0.5, 0.0]), _score,
                          samples=2, max_new_tokens=BUDGET, positions=[[1], []])
    assert found.continuations == 2
    known = torch.isfinite(found.values)
    assert known.tolist() == [[False, True, False, True], [False, False, True, False]]
    with pytest.raises(ValueError, match=r"positions\[1\] holds 2"):
        prefix_values(model, tokenizer, batch, torch.tensor([0.5, 0.0]), _score,
                      samples=2, max_new_tokens=BUDGET, positions=[[0], [2]])


def test_advantages_and_means_by_position_by_hand():
    values = torch.tensor([[0.2, 0.5, 1.0, 1.0], [0.4, 0.0, math.nan, math.nan]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = mc_advantages(values, mask)
    assert adv[0].tolist() == pytest.approx([0.3, 0.5, 0.0])
    assert adv[1, 0].item() == pytest.approx(-0.4) and adv[1, 1:].isnan().all()
    means = by_position(adv.abs(), mask)
    assert means.tolist()[:2] == pytest.approx([0.35, 0.5]) and means[2] == 0.0
    assert by_position(torch.full((2, 3), math.nan), mask).isnan().all()


def test_step_ends_mark_the_prefix_after_each_written_step():
    from labkit.zoo import build_tokenizer

    tokenizer = build_tokenizer()
    texts = ["3+4=7,7+5=12. \\boxed{12}", "\\boxed{9}", "1+2=3. \\boxed{3}"]
    rows = [tokenizer(t, add_special_tokens=False).input_ids + [2] for t in texts]
    batch = _batch(tokenizer, "3+4+5=", rows)
    ends = step_ends(tokenizer, batch)
    assert ends == [[6, 13], [], [6]]
    assert [texts[0][:t] for t in ends[0]] == ["3+4=7,", "3+4=7,7+5=12."]
    per = torch.arange(3 * 30, dtype=torch.float).view(3, 30)
    rows_2, at_2 = at_steps(per, ends, 2)
    assert rows_2 == [0] and at_2.tolist() == [13.0]
    rows_1, at_1 = at_steps(per, ends, 1)
    assert rows_1 == [0, 2] and at_1.tolist() == [6.0, 66.0]


def test_a_look_at_a_ppo_trainer_compares_critic_gae_and_grpo_with_monte_carlo():
    from labkit.probes.microscope import look
    from labkit.problems.tasks import ArithmeticTask
    from labkit.settings.config import TrainConfig
    from labkit.trainer import Trainer
    from labkit.zoo import build_tokenizer

    trainer = Trainer(TrainConfig(algo="ppo", task="think", group_size=2, batch_prompts=2,
                                  steps=1, eval_n=8, progress=False))
    problems = ArithmeticTask(digits=1, operands=5, min_operands=2).sample(2, seed=4)
    found = look(trainer, problems, samples=2, seed=1)
    mask = found.batch.completion_mask.bool()
    N, T = mask.shape
    assert found.critic.shape == found.gae.shape == found.mc_advantages.shape == (N, T)
    lengths = mask.sum(1)
    assert found.mc.continuations == 2 * int(lengths.sum())  # every prefix, 2 draws each
    # GRPO's advantage sums to 0 in each group
    assert found.grpo.view(-1, 2).sum(1).abs().max() < 1e-6
    errors = found.errors()
    assert set(errors) == {"grpo", "critic", "gae"} and errors["critic"].shape == (T,)
    manual = (found.critic[:, 0] - found.mc.values[:, 0]).abs().mean()
    assert errors["critic"][0].item() == pytest.approx(manual.item(), rel=1e-5)
    steps = found.critic_error_at_steps(build_tokenizer())
    assert all(k >= 1 and n >= 1 and e >= 0 for k, n, e in steps)


def test_a_run_with_credit_every_logs_its_looks_and_trains_as_without(tmp_path):
    from labkit.lab import summary_rows
    from labkit.probes.microscope import read_credit
    from labkit.settings.config import TrainConfig
    from labkit.trainer import train

    small = dict(algo="ppo", task="think", steps=3, batch_prompts=2, group_size=2, eval_n=8,
                 eval_every=3, eval_samples=0, cgc_prompts=0, progress=False)
    plain = train(TrainConfig(run_dir=str(tmp_path / "plain"), **small))
    looked = train(TrainConfig(run_dir=str(tmp_path / "looked"), credit_every=2,
                               credit_prompts=2, credit_samples=2, **small))
    steps = [r["step"] for r in looked.history if "credit/grpo_err" in r]
    assert steps == [2, 3]  # every 2 steps and the last, never step 0
    records = read_credit(tmp_path / "looked")
    assert [r["step"] for r in records] == steps
    assert set(records[0]["by_position"]) == {"grpo", "critic", "gae"}
    for a, b in zip(plain.history, looked.history):  # the looks leave training as it was
        assert a.get("rollout/reward_mean") == b.get("rollout/reward_mean")
        assert a.get("loss/policy") == b.get("loss/policy")
    row = summary_rows({"ppo/seed=0": looked})[0]
    assert row["credit_step"] == 3 and row["credit.continuations"] > 0
    assert row["credit.critic_err"] == looked.history[-1]["credit/critic_err"]
    with pytest.raises(ValueError, match="credit_prompts=9"):
        TrainConfig(credit_every=1, credit_prompts=9, eval_n=8)


def test_vineppo_extras_hold_monte_carlo_values_at_each_step_boundary():
    """The values the vineppo estimator reads: known at the start, after each written step
    and at the end (the reward), nowhere else; vine_samples continuations from each
    boundary before the end; and a run logs their cost."""
    from labkit import stages
    from labkit.model.credit import step_ends
    from labkit.problems.tasks import ArithmeticTask
    from labkit.settings.config import TrainConfig
    from labkit.trainer import Trainer

    config = TrainConfig(task="think", estimator="vineppo", vine_samples=3, batch_prompts=2,
                         group_size=4, steps=1, eval_n=8, progress=False)
    trainer = Trainer(config)
    problems = ArithmeticTask(digits=1, operands=5, min_operands=4).sample(2, seed=9)
    batch = stages.sample(config, trainer.learner, trainer.tokenizer, problems, 5)
    rewards = stages.reward(config, problems, batch, 5)
    extras = stages.estimator_extras(config, trainer.learner, trainer.tokenizer, problems,
                                     batch, 5, rewards)
    values = extras["mc_values"]
    lengths = batch.completion_mask.sum(1).tolist()
    ends = step_ends(trainer.tokenizer, batch)
    boundaries = 0
    for i, n in enumerate(lengths):
        want = {0, n} | {t for t in ends[i] if t < n}
        assert set(torch.isfinite(values[i]).nonzero().flatten().tolist()) == want
        assert values[i, n] == rewards[i]
        boundaries += len(want) - 1
    assert extras["mc_continuations"].item() == 3 * boundaries
    result = trainer.step(1)
    assert result.metrics["perf/mc_continuations"] > 0 and result.metrics["perf/mc_s"] > 0


def test_a_look_gives_gae_in_the_rewards_units_not_whitened():
    """GAE with lambda = gamma = 1 and no KL telescopes: on each row its advantage at token t
    is r - V(s_t), whatever the whitening PPO applies later."""
    from labkit.probes.microscope import look
    from labkit.problems.tasks import ArithmeticTask
    from labkit.settings.config import TrainConfig
    from labkit.trainer import Trainer

    trainer = Trainer(TrainConfig(algo="ppo", task="think", group_size=2, batch_prompts=2,
                                  lam=1.0, steps=1, eval_n=8, progress=False))
    problems = ArithmeticTask(digits=1, operands=3, min_operands=2).sample(2, seed=2)
    found = look(trainer, problems, samples=1, seed=0)
    mask = found.batch.completion_mask.bool()
    want = (found.rewards[:, None] - found.critic).masked_fill(~mask, float("nan"))
    torch.testing.assert_close(found.gae, want, equal_nan=True, atol=1e-5, rtol=1e-5)
