"""The rewards a run can be given (`TrainConfig.reward`, labkit.problems.reward_expr), each against a
plain reference: strict against a regex on the last box, a weighted sum against the sum of
its parts, noisy's flip rate against the binomial, and an import-path reward against the
TRL keywords it must receive."""

import math
import re
import sys
import textwrap

import pytest

from labkit.problems import reward_expr
from labkit.problems.reward_expr import (build, noisy, parse, reward_columns, score, spec_text,
                                         systematic)
from labkit.problems.rewards import RewardError, correctness, format_reward, strict
from labkit.problems.tasks import ArithmeticTask, Problem

# (text, ground truth, correctness, strict) for the same texts
TEXTS = [
    ("The final answer is 83", "83", 1.0, 0.0),
    (r"\boxed{83}", "83", 1.0, 1.0),
    (r"The correct answer is \boxed{83}", "83", 1.0, 1.0),
    (r"We get \boxed{38}", "83", 0.0, 0.0),
    ("#### 83", "83", 1.0, 0.0),
    ("A: 83", "83", 1.0, 0.0),
    (r"first \boxed{2}, then \boxed{83}.", "83", 1.0, 1.0),
    (r"\boxed{83} so the answer is 84", "83", 1.0, 1.0),
    (r"\boxed{}", "83", 0.0, 0.0),
    (r"\boxed{1,000}", "1000", 1.0, 1.0),
    ("", "83", 0.0, 0.0),
]


def strict_reference(text: str, gold: str) -> float:
    """1 when the content of the last brace-balanced `\\boxed{...}` (no nested braces here) is
    the gold number, commas dropped."""
    boxes = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return float(bool(boxes) and boxes[-1].replace(",", "").strip() == gold)


def test_strict_counts_only_a_boxed_answer_and_correctness_any_answer():
    texts, golds = [t[0] for t in TEXTS], [t[1] for t in TEXTS]
    assert strict(texts, answer=golds) == [strict_reference(t, g) for t, g in zip(texts, golds)]
    assert strict(texts, answer=golds) == [t[3] for t in TEXTS]
    assert correctness(texts, answer=golds) == [t[2] for t in TEXTS]
    # where the last answer is a box the two agree; elsewhere strict gives 0
    for (text, gold, _, _), c, s in zip(TEXTS, correctness(texts, answer=golds),
                                        strict(texts, answer=golds)):
        assert s == (c if re.search(r"\\boxed\{[^{}]*\}", text) else 0.0), text
    assert build("strict") is strict and build("correctness") is correctness


def test_a_weighted_sum_is_the_sum_of_its_weighted_parts():
    texts = [t[0] for t in TEXTS]
    golds = [t[1] for t in TEXTS]
    parts = {"correctness": correctness(texts, answer=golds),
             "format": format_reward(texts), "strict": strict(texts, answer=golds)}
    expected = [c + 0.3 * f - 0.5 * s for c, f, s in
                zip(parts["correctness"], parts["format"], parts["strict"])]
    for spec in ("correctness+0.3*format-0.5*strict", " correctness + 3e-1*format - .5*strict",
                 [("correctness", 1), ("format", 0.3), ("strict", -0.5)]):
        assert build(spec)(completions=texts, answer=golds) == pytest.approx(expected), spec
    assert spec_text([("correctness", 1), ("format", 0.3), ("strict", -0.5)]) == \
        "correctness+0.3*format-0.5*strict"
    assert spec_text([("format", -1), ("noisy(p=0.1)", 2)]) == "-format+2.0*noisy(p=0.1)"
    assert [t.weight for t in parse("-format+2*strict-correctness")] == [-1.0, 2.0, -1.0]


def test_shaped_by_name_is_correctness_less_lam_times_the_missing_steps():
    texts = [r"13 then 20 so \boxed{26}", r"13 so \boxed{26}", r"\boxed{25}"]
    got = build("shaped(lam=0.4)")(completions=texts, answer=["26"] * 3,
                                   steps=[["13", "20"]] * 3)
    reference = [1 - 0.4 * 0, 1 - 0.4 * 0.5, 0 - 0.4 * 1]
    assert got == pytest.approx(reference)
    assert build("shaped")(completions=texts, answer=["26"] * 3,
                           steps=[["13", "20"]] * 3) == pytest.approx([1, 0.85, -0.3])


def _truth(completions, **kwargs):
    """A 0/1 verdict: 1 for the text 'right'."""
    return [float(c == "right") for c in completions]


def test_noisy_flips_each_verdict_with_probability_p():
    p, seeds, n = 0.2, range(500), 200
    completions = ["right", "wrong"] * (n // 2)
    fn = noisy(_truth, p)
    flips, per_step = {1.0: 0, 0.0: 0}, []
    for seed in seeds:
        out = fn(completions=completions, step_seed=seed)
        changed = [before != after for before, after in zip(_truth(completions), out)]
        for before, flipped in zip(_truth(completions), changed):
            flips[before] += flipped
        per_step.append(sum(changed))
    draws = len(seeds) * n // 2  # per verdict value
    sd = math.sqrt(p * (1 - p) / draws)
    for value, count in flips.items():  # both verdicts flip alike: accuracy 1 - p on each
        assert abs(count / draws - p) < 4.5 * sd, (value, count / draws)
    # independent flips: a step's count varies as Binomial(n, p), n p (1 - p); flips drawn
    # together (one coin per step) would vary n times more
    mean = sum(per_step) / len(per_step)
    variance = sum((c - mean) ** 2 for c in per_step) / (len(per_step) - 1)
    assert 0.75 < variance / (n * p * (1 - p)) < 1.3, variance  # +-4 sd of the ratio


def test_noisy_repeats_per_step_seed_and_nests_in_p():
    completions = ["right", "wrong"] * 50
    low, high = noisy(_truth, 0.1), noisy(_truth, 0.3)
    first = low(completions=completions, step_seed=7)
    assert low(completions=completions, step_seed=7) == first  # a resume flips alike
    assert noisy(_truth, 0.1)(completions=completions, step_seed=8) != first
    truth = _truth(completions)
    flipped_low = {i for i, (a, b) in enumerate(zip(truth, first)) if a != b}
    flipped_high = {i for i, (a, b) in enumerate(
        zip(truth, high(completions=completions, step_seed=7))) if a != b}
    assert flipped_low < flipped_high  # the same uniforms: a smaller p flips a subset
    assert noisy(_truth, 0.0)(completions=completions, step_seed=1) == truth
    assert noisy(_truth, 1.0)(completions=completions, step_seed=1) == [1 - t for t in truth]


def test_systematic_flips_every_verdict_of_a_fixed_share_of_the_prompts():
    """The errors follow the prompt, not the step: the same prompts are blind spots at every
    step, all of their verdicts flipped, about a share p of the prompts, nested in p."""
    prompts = [f"{a}+{b}=" for a in range(40) for b in range(25)]  # 1,000 prompts
    completions = ["right", "wrong"] * (len(prompts) // 2)
    truth = _truth(completions)

    def blind(fn, seed):
        out = fn(completions=completions, prompts=prompts, step_seed=seed)
        return {prompts[i] for i, (a, b) in enumerate(zip(truth, out)) if a != b}

    low, high = systematic(_truth, 0.1), systematic(_truth, 0.3)
    first = blind(high, 0)
    assert blind(high, 1) == first  # the step seed does not move them
    assert abs(len(first) / len(prompts) - 0.3) < 4.5 * math.sqrt(0.3 * 0.7 / len(prompts))
    assert blind(low, 5) < first  # a smaller p's blind spots are a subset
    # every completion of a blind prompt is judged wrongly, the others rightly
    twice = systematic(_truth, 0.3)(completions=["right", "wrong"] * 2,
                                    prompts=[prompts[0]] * 2 + [prompts[1]] * 2)
    assert twice[:2] in ([1.0, 0.0], [0.0, 1.0]) and twice[2:] in ([1.0, 0.0], [0.0, 1.0])
    assert systematic(_truth, 0.0)(completions=completions, prompts=prompts) == truth
    with pytest.raises(RewardError, match="each completion's prompt"):
        systematic(_truth, 0.2)(completions=["right"], prompts=[])
    with pytest.raises(RewardError, match="0/1"):
        systematic(lambda completions, **kw: [0.5] * len(completions), 0.1)(
            completions=["x"], prompts=["1+1="])
    assert build("systematic(strict, p=0.25)").__name__ == "systematic(strict,p=0.25)"


def test_noisy_refuses_a_verdict_that_is_not_zero_or_one():
    with pytest.raises(RewardError, match="0/1"):
        noisy(lambda completions, **kw: [0.5] * len(completions), 0.1)(
            completions=["x"], step_seed=0)
    with pytest.raises(ValueError, match="p must be"):
        noisy(_truth, 1.5)


IMPORTED = '''
SEEN = []

def seen(prompts, completions, answer, steps, target, step_seed, **kwargs):
    SEEN.append(dict(prompts=prompts, completions=completions, answer=answer, steps=steps,
                     target=target, step_seed=step_seed, rest=sorted(kwargs)))
    return [float(len(c)) for c in completions]

def two(completions, **kwargs):
    return [1.0, 1.0]

def positional_only(completions):
    return [0.0] * len(completions)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_for_test.py").write_text(textwrap.dedent(IMPORTED))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards_for_test"
    sys.modules.pop("user_rewards_for_test", None)
    reward_expr._built.cache_clear()


def test_an_import_path_reward_receives_the_trl_keywords(user_module):
    task = ArithmeticTask(digits=2, operands=3)
    problems = task.sample(2, "train", seed=0)
    rows = [p for p in problems for _ in range(2)]  # G = 2
    texts = ["a", "bb", "ccc", "dddd"]
    assert score(f"{user_module}:seen", rows, texts, step_seed=41) == [1.0, 2.0, 3.0, 4.0]
    got = sys.modules[user_module].SEEN[-1]
    assert got["prompts"] == [p.prompt for p in rows] and got["completions"] == texts
    assert got["answer"] == [p.answer for p in rows]
    assert got["steps"] == [list(p.steps) for p in rows] and len(got["steps"][0]) == 2
    assert got["target"] == [p.target for p in rows] and got["step_seed"] == 41
    assert got["rest"] == []
    # the same function inside a sum, and in a config
    assert score(f"0.5*{user_module}:seen+format", rows, texts, 0) == [0.5, 1.0, 1.5, 2.0]
    from labkit.settings.config import TrainConfig

    with pytest.raises(ValueError, match=r"reward=.*positional_only.*signature"):
        TrainConfig(reward=f"{user_module}:positional_only")


def test_reward_columns_follow_trl_names():
    rows = [Problem("1+1=", "2", ("2",), r"\boxed{2}")] * 2
    cols = reward_columns(rows, ["x", "y"], 5)
    assert set(cols) == {"prompts", "completions", "answer", "steps", "target", "step_seed"}
    assert cols["prompts"] == ["1+1="] * 2 and cols["steps"] == [["2"], ["2"]]


def test_score_checks_the_number_of_rewards(user_module):
    with pytest.raises(RewardError, match="returned 2 rewards for 1 completions"):
        score(f"{user_module}:two", [Problem("1+1=", "2")], ["x"], 0)


@pytest.mark.parametrize("spec, words", [
    ("correctnes", ["'correctnes' is no reward", "strict", "noisy", "package.module:function"]),
    ("correctness+abc*format", ["weight", "number written before '*'"]),
    ("correctness+0*format", ["weight", "non-zero"]),
    ("correctness+1e999*format", ["weight", "finite"]),
    ("correctness+", ["expected a reward"]),
    ("noisy", ["noisy needs", "noisy(p=0.2)"]),
    ("noisy(p=1.5)", ["p", "[0, 1]"]),
    ("noisy(q=0.1)", ["noisy takes ['p']"]),
    ("noisy(shaped, p=0.1)", ["0/1"]),
    ("noisy(0.5*strict, p=0.1)", ["0/1"]),
    ("shaped(lam=2)", ["lam", "[0, 1]"]),
    ("correctness(p=0.1)", ["takes no arguments"]),
    ("correctness $", ["unexpected '$'"]),
    ("", ["must be a reward such as"]),
    ("labkit.problems.rewards:completion_text", ["signature"]),
])
def test_a_bad_spec_is_one_line_naming_the_field_and_the_rule(spec, words):
    with pytest.raises(ValueError) as e:
        build(spec)
    message = str(e.value)
    assert message.startswith("reward") and "\n" not in message, message
    assert all(w in message for w in words), message


@pytest.mark.parametrize("spec, words", [
    ([("correctness", 1), ("format", "x")], ["reward[1]", "finite"]),
    ([("correctness+format", 1)], ["reward[0]", "one reward"]),
    ([("correctness", 1, 2)], ["reward[0]", "pair"]),
    ([], ["list of (reward, weight) pairs"]),
    (3, ["list of (reward, weight) pairs"]),
])
def test_a_bad_list_is_one_line_naming_the_item(spec, words):
    with pytest.raises(ValueError) as e:
        spec_text(spec)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_trainer_calls_the_configured_reward_with_the_trl_keywords(user_module):
    import torch

    from labkit.settings.config import TrainConfig
    from labkit.trainer import Trainer, step_seed

    small = dict(batch_prompts=2, group_size=2, max_new_tokens=8, eval_n=16, steps=1,
                 progress=False, device="cpu")
    config = TrainConfig(reward=f"{user_module}:seen", **small)
    trainer = Trainer(config)
    problems = trainer.problems.draw(step_seed(config, 3))
    result = trainer.step(3, problems)
    got = sys.modules[user_module].SEEN[-1]
    assert got["step_seed"] == step_seed(config, 3) == result.seed
    assert got["completions"] == result.batch.texts
    assert got["answer"] == [p.answer for p in problems for _ in range(2)]
    lengths = torch.tensor([float(len(t)) for t in result.batch.texts])
    assert torch.equal(result.rewards, lengths.masked_fill(result.batch.truncated, 0.0))
    # the default reward is correctness, called on the same texts and ground truths
    default = trainer.with_config(TrainConfig(**small))
    result = default.step(3, problems)
    want = torch.tensor(correctness(result.batch.texts, answer=got["answer"]))
    assert torch.equal(result.rewards, want.masked_fill(result.batch.truncated, 0.0))
