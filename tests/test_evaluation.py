"""Evaluation: pass@k against brute force, batched generation and greedy accuracy against a
plain one-prompt greedy loop, sampling seeds and argument checks.
"""

import itertools
from fractions import Fraction

import pytest
import torch

from labkit.probes.evaluation import evaluate, generate, pass_at_k
from labkit.problems.tasks import DEFAULT_TASK

# lengths 4 to 8 characters, so a batch of them is left-padded
PROMPTS = ["0+0=", "9+10=", "12+34=", "123+45=", "1+2+3+4=", "37+85=", "99+99=", "50+7="]


def plain_greedy(model, tokenizer, prompt, max_new_tokens):
    """Greedy decoding by hand: one prompt, no padding, no KV cache, a full forward per step."""
    ids = tokenizer(prompt).input_ids  # with BOS, as the tokenizer adds it
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids + new])).logits[0, -1].tolist()
            best = 0
            for i, value in enumerate(logits):
                if value > logits[best]:
                    best = i
            if best == tokenizer.eos_token_id:
                break
            new.append(best)
    return tokenizer.decode(new, skip_special_tokens=True)


@pytest.fixture(scope="module")
def held_out():
    return DEFAULT_TASK.sample(200, "test", seed=1, distinct=True)


@pytest.fixture(scope="module")
def greedy_texts(tiny, held_out):
    model, tokenizer = tiny
    return [plain_greedy(model, tokenizer, p.prompt, 16) for p in held_out]


# ---------------------------------------------------------------- pass@k

def brute_pass_at_k(n, c, k):
    """P(a uniformly chosen k-subset of n samples, c of them correct, holds a correct one)."""
    correct = [i < c for i in range(n)]
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(correct[i] for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_brute_force():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)),
                                                           abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n,c,k", [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4), (0, 0, 1),
                                   (5, 2, -1)])
def test_pass_at_k_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


# ---------------------------------------------------------------- generation

@pytest.mark.parametrize("batch_size,max_new_tokens", [(8, 16), (3, 16), (8, 6)])
def test_greedy_generate_equals_plain_loop(tiny, batch_size, max_new_tokens):
    model, tokenizer = tiny
    expected = [plain_greedy(model, tokenizer, p, max_new_tokens) for p in PROMPTS]
    if max_new_tokens == 6:  # the budget cuts every completion short of its EOS
        assert all(len(t) == 6 for t in expected)
    else:
        assert any(t.startswith("\\boxed{") for t in expected)
    side = tokenizer.padding_side
    tokenizer.padding_side = "right"  # generate must pad on the left whatever it finds
    try:
        got = generate(model, tokenizer, PROMPTS, do_sample=False, batch_size=batch_size,
                       max_new_tokens=max_new_tokens)
        assert tokenizer.padding_side == "right"
    finally:
        tokenizer.padding_side = side
    assert got == expected


def test_sampling_is_repeatable_for_a_seed_and_differs_across_seeds(tiny):
    model, tokenizer = tiny

    def draw(seed):
        torch.manual_seed(seed)
        return generate(model, tokenizer, PROMPTS, do_sample=True, num_return_sequences=3,
                        max_new_tokens=12)

    first = draw(0)
    assert len(first) == 3 * len(PROMPTS)
    assert draw(0) == first
    assert draw(1) != first


@pytest.mark.parametrize("kwargs,name", [
    (dict(do_sample=False, max_new_tokens=0), "max_new_tokens"),
    (dict(do_sample=False, batch_size=0), "batch_size"),
    (dict(do_sample=True, temperature=0.0), "temperature"),
])
def test_generate_bad_arguments(tiny, kwargs, name):
    with pytest.raises(ValueError, match=name):
        generate(*tiny, PROMPTS[:1], **kwargs)


# ---------------------------------------------------------------- evaluate

def test_greedy_accuracy_and_length_match_plain_loop(tiny, held_out, greedy_texts):
    # exact string equality with the canonical target is an independent grader here
    right = [t == p.target for t, p in zip(greedy_texts, held_out)]
    assert 0.1 < sum(right) / len(right) < 0.8  # both outcomes occur: the check can fail
    figures = evaluate(*tiny, held_out, samples=0, batch_size=64)
    assert set(figures) == {"eval/accuracy", "eval/length", "eval/n"}
    assert figures["eval/n"] == 200
    assert figures["eval/accuracy"] == pytest.approx(sum(right) / 200, abs=1e-12)
    assert figures["eval/length"] == pytest.approx(sum(map(len, greedy_texts)) / 200, abs=1e-12)


def test_near_zero_temperature_sampling_scores_like_greedy(tiny, held_out, greedy_texts):
    # at T = 1e-5 every draw is the greedy completion (the smallest top-2 logit gap of
    # this model on these prompts is about 1e-3), so pass@1 and pass@k equal the accuracy,
    # checking that each draw is graded against its own problem
    problems, texts = held_out[:60], greedy_texts[:60]
    accuracy = sum(t == p.target for t, p in zip(texts, problems)) / 60
    figures = evaluate(*tiny, problems, samples=3, k=2, temperature=1e-5, batch_size=32)
    assert set(figures) == {"eval/accuracy", "eval/length", "eval/n", "eval/pass@1",
                            "eval/pass@2"}
    for key in ("eval/accuracy", "eval/pass@1", "eval/pass@2"):
        assert figures[key] == pytest.approx(accuracy, abs=1e-12), key


def test_sampled_pass_at_1_is_repeatable_and_rng_is_left_alone(tiny, held_out):
    problems = held_out[:40]
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    first = evaluate(*tiny, problems, samples=4, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert set(first) == {"eval/accuracy", "eval/length", "eval/n", "eval/pass@1", "eval/pass@4"}
    assert 0.0 < first["eval/pass@1"] <= first["eval/pass@4"] <= 1.0
    torch.manual_seed(999)  # a different global state must not change a seeded evaluation
    assert evaluate(*tiny, problems, samples=4, seed=5) == first


@pytest.mark.parametrize("kwargs,name", [
    (dict(problems=[]), "problems"),
    (dict(samples=-1), "samples"),
    (dict(samples=2, k=3), r"\bk\b"),
    (dict(samples=2, k=0), r"\bk\b"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(samples=2, temperature=0.0), "temperature"),
    (dict(batch_size=0), "batch_size"),
])
def test_evaluate_bad_arguments(tiny, kwargs, name, monkeypatch):
    import labkit.probes.evaluation

    def no_work(*args, **kw):
        raise AssertionError("generation started before the arguments were checked")

    monkeypatch.setattr(labkit.probes.evaluation, "generate", no_work)
    monkeypatch.setattr(labkit.probes.evaluation, "rollout", no_work)
    kwargs = {"problems": DEFAULT_TASK.sample(1, "test"), **kwargs}
    with pytest.raises(ValueError, match=name):
        evaluate(*tiny, **kwargs)


# ---------------------------------------------------------------- answer forms

W, D = "3+4=7. \\boxed{7}", "\\boxed{7}"


def test_answer_forms_against_counts_by_hand():
    from math import sqrt

    from scipy.stats import t as student

    from labkit.probes.evaluation import answer_forms
    from labkit.problems.tasks import Problem

    problems = [Problem("a", "7", steps=("7",)), Problem("b", "12", steps=("7", "12")),
                Problem("c", "9", steps=("5", "9"))]
    texts = [W, D, D, D, W, W, D, D, W, D, D, D]
    correct = [1, 0, 1, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    found = answer_forms(problems, texts, correct, samples=4)
    two, three = found["by_difficulty"][2], found["by_difficulty"][3]
    assert two == {"draws": 4, "worked_share": 0.25, "accuracy_worked": 1.0,
                   "accuracy_direct": pytest.approx(1 / 3)}
    assert three["draws"] == 8 and three["worked_share"] == 3 / 8
    assert three["accuracy_worked"] == pytest.approx(2 / 3)
    assert three["accuracy_direct"] == pytest.approx(2 / 5)
    # per-problem shares 1/4, 1/2, 1/4: their sd 0.144 is below the floor of 4 draws (0.25)
    worked = found["worked"]
    half = student.ppf(0.975, 2) * 0.25 / sqrt(3)
    assert worked["mean"] == pytest.approx(1 / 3)
    assert worked["high"] == pytest.approx(1 / 3 + half)
    assert worked["low"] == 0.0  # 1/3 - half < 0, clipped at 0
    # the hardest level (3 operands): worked minus direct per problem, 1 - 0 and 0 - 2/3
    hardest = found["hardest"]
    assert hardest["difficulty"] == 3 and hardest["problems"] == 2
    assert hardest["difference"]["mean"] == pytest.approx((1 - 2 / 3) / 2)


def test_answer_forms_without_both_forms_on_the_hardest_gives_no_difference():
    from labkit.probes.evaluation import answer_forms
    from labkit.problems.tasks import Problem

    found = answer_forms([Problem("a", "7", steps=("7",)), Problem("b", "7", steps=("7",))],
                         [D, D, W, W], [0, 0, 1, 1], samples=2)
    assert found["hardest"]["difference"] is None
    assert found["by_difficulty"][2]["worked_share"] == 0.5
    with pytest.raises(ValueError, match="samples=2"):
        answer_forms([Problem("a", "7")], [D], [0], samples=2)


def test_the_think_model_card_leaves_room_for_rl():
    """The shipped tiny-arith-think card passes the build's own room checks, and the model
    answers both ways on fresh held-out problems, working more often right."""
    import json

    from labkit.model.models import load
    from labkit.probes.evaluation import measure_forms
    from labkit.problems.tasks import ArithmeticTask
    from labkit.settings.embedded import EMBEDDED, THINK_NAME
    from labkit.zoo.__main__ import problems_with

    card = json.loads((EMBEDDED[THINK_NAME] / "card.json").read_text())
    assert problems_with(card) == []
    assert 0.2 <= card["forms"]["worked"]["mean"] <= 0.8
    assert card["forms"]["hardest"]["difference"]["low"] > 0
    model, tokenizer = load(THINK_NAME, device="cpu")
    problems = ArithmeticTask(digits=1, operands=5, min_operands=2).sample(
        150, "test", seed=77, distinct=True)
    found = measure_forms(model, tokenizer, problems, samples=4, seed=77)
    assert 0.2 <= found["worked"]["mean"] <= 0.8
    rows = found["by_difficulty"]
    assert rows[5]["accuracy_worked"] > rows[5]["accuracy_direct"]
