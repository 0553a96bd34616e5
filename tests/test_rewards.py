"""Unit tests of answer extraction and reward functions; expected values worked out by hand."""

import inspect
import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.answers import (completion_text, extract_answer, gsm8k_ground_truth, gsm8k_steps,
                             last_boxed)
from labkit.problems import rewards
from labkit.problems.rewards import (combine, correctness, format_reward, normalize_scores, shaped,
                                     step_completeness)

# ------------------------------------------------------------------------------ answers


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),
    (r"first \boxed{1}, then \boxed{2}", "2"),
    (r"\boxed{1} and finally \fbox{7}", "7"),
    (r"\boxed 5", "5"),
    (r"$\boxed {12}$", "12"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed{3} then \boxed{4", None),
    (r"\boxed{\frac{1}{2}", None),
    ("no box here", None),
    (r"\boxed", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("She makes $18.\n#### 18", "18"),
    ("#### 5\nwait\n#### 1,000", "1,000"),
    ("The answer is $1,000.", "$1,000"),
    ("so THE ANSWER IS 0.5. Then more text", "0.5"),
    ("the answer is 5, no, the answer is 7.", "7"),
    ("3 + 15 = 18\nA: 18", "18"),
    ("Answer: -3\n", "-3"),
    ("A: 1\nA: 2", "2"),
    (r"A: 3 but \boxed{4} and #### 5", "4"),
    ("#### 5\nThe answer is 6.", "5"),
    ("The answer is 6.\nA: 7", "6"),
    (r"\boxed{} so A: 9 is not a line", None),
    ("nothing to see", None),
    (None, None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_gsm8k_ground_truth():
    assert gsm8k_ground_truth("16 - 3 = <<16-3=13>>13\n#### 13") == "13"
    assert gsm8k_ground_truth("...\n#### 1,000") == "1000"
    assert gsm8k_ground_truth("#### -7") == "-7"
    with pytest.raises(ValueError, match="answer_field"):
        gsm8k_ground_truth("no final answer here")
    with pytest.raises(ValueError, match="answer_field"):
        gsm8k_ground_truth("####   ")


# -------------------------------------------------------------------------- correctness

@pytest.mark.parametrize("completion, truth", [
    (r"so \boxed{18}", "18"),
    ("The answer is $1,000.", "1000"),
    (r"\boxed{1,000}", "1000"),
    ("3 + 15 = 18\nA: 18", "18"),
    ("He pays\n#### 18", "18"),
    (r"\boxed{18 dollars}", "18"),
    (r"\boxed{5 cm}", "5"),
    (r"\boxed{\$18.00}", "18"),
    (r"\boxed{18 \text{ dollars}}", "18"),
    (r"\boxed{\text{18 dollars}}", "18"),
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{1/2}", "0.5"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    (r"\boxed{0.50}", "0.5"),
    (r"\boxed{-7}", "-7"),
    (r"\boxed{-2.25}", "-9/4"),
    (r"\boxed{\sqrt{2}/2}", r"\frac{1}{\sqrt{2}}"),
    (r"\boxed{2\pi}", r"\pi \cdot 2"),
    (r"\boxed{x = 5}", "5"),
    (r"\boxed{50\%}", "0.5"),
    ("the answer is 50 percent.", "0.5"),
    (r"\boxed{1234}", "Total: 1000 + 234 = <<1000+234=1234>>1234\n#### 1,234"),
    (r"\boxed{7}", 7),
])
def test_correct_answers_score_one(completion, truth):
    assert correctness([completion], answer=[truth]) == [1.0]


@pytest.mark.parametrize("completion, truth", [
    (r"\boxed{17}", "18"),
    (r"\boxed{7}", "-7"),
    (r"\boxed{0.05}", "0.5"),
    (r"\boxed{\frac{1}{3}}", "0.5"),
    (r"\boxed{100}", "1000"),
    ("18 but no final answer marker", "18"),
    (r"\boxed{18", "18"),
    (r"\boxed{1}", "He pays\n#### 18"),
    (r"\boxed{5x}", "5"),
    (r"\boxed{5 x - 3}", "5"),
])
def test_wrong_answers_score_zero(completion, truth):
    assert correctness([completion], answer=[truth]) == [0.0]


def test_bad_completions_score_zero():
    bad = [None, "", 5, [], [{"role": "assistant", "content": None}], {"x": 1}]
    assert correctness(bad, answer=["5"] * len(bad)) == [0.0] * len(bad)


def test_conversational_completions():
    good = [{"role": "assistant", "content": r"It is \boxed{3}."}]
    with_prompt = [{"role": "user", "content": r"\boxed{9}?"},
                   {"role": "assistant", "content": r"\boxed{4}"}]
    assert completion_text(with_prompt) == r"\boxed{4}"
    assert correctness([good, with_prompt], answer=["3", "9"]) == [1.0, 0.0]


def test_extra_trainer_kwargs_are_ignored():
    scores = correctness([r"\boxed{2}"], answer=["2"], prompts=["1+1="],
                         completion_ids=[[1, 2]], trainer_state=object(), log_extra=None)
    assert scores == [1.0]


def test_math_verify_errors_score_zero(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("sympy blew up")

    import math_verify

    monkeypatch.setattr(math_verify, "verify", broken)  # rewards imports it when needed
    # needs math-verify (not an exact or decimal match), so the failure is hit
    assert correctness([r"\boxed{\frac{1}{2}}", r"\boxed{2}"], answer=["0.5", "2"]) == [0.0, 1.0]


def test_missing_answer_names_the_keyword():
    with pytest.raises(ValueError, match=r"`answer`.*ground truth|ground truth.*`answer`"):
        correctness([r"\boxed{1}"])


def test_answer_must_be_a_list():
    with pytest.raises(ValueError, match="answer"):
        correctness([r"\boxed{1}"], answer="1")


def test_length_mismatch_names_both_lengths():
    with pytest.raises(ValueError, match=r"answer has 3 .*completions has 2"):
        correctness(["a", "b"], answer=["1", "2", "3"])


def test_none_ground_truth_names_the_index():
    with pytest.raises(ValueError, match=r"answer\[1\]"):
        correctness(["a", "b"], answer=["1", None])
    with pytest.raises(ValueError, match=r"answer\[0\]"):
        correctness(["a"], answer=["  "])


def test_ground_truth_parse_is_cached():
    rewards._parse_gold.cache_clear()
    completions = [r"\boxed{\frac{1}{4}}", r"\boxed{1/4}", r"\boxed{\frac{2}{8}}"]
    assert correctness(completions, answer=["0.25"] * 3) == [1.0, 1.0, 1.0]
    info = rewards._parse_gold.cache_info()
    assert info.misses == 1 and info.hits == 2


def test_correctness_in_a_worker_thread():
    results, errors = [], []

    def work():
        try:
            results.append(correctness([r"\boxed{\frac{1}{2}}", r"\boxed{\sqrt{4}}",
                                        r"\boxed{3}"], answer=["0.5", "2", "4"]))
        except Exception as e:  # surfaced below; an exception in a thread is otherwise lost
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not errors
    assert results == [[1.0, 1.0, 0.0]]


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=-10**7, max_value=10**7))
def test_any_integer_with_thousands_commas(n):
    completion = f"Adding it all up gives \\boxed{{{n:,}}}"
    assert correctness([completion], answer=[str(n)]) == [1.0]
    assert correctness([completion], answer=[str(n + 1)]) == [0.0]


# ------------------------------------------------------------------------- TRL interface

def test_signature_fits_trl():
    for fn in (correctness, format_reward, shaped(correctness),
               combine((correctness, 1.0))):
        params = inspect.signature(fn).parameters
        assert "completions" in params
        assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_agrees_with_trl_accuracy_reward():
    trl_rewards = pytest.importorskip("trl.rewards")
    accuracy_reward = getattr(trl_rewards, "accuracy_reward", None)
    if accuracy_reward is None:
        pytest.skip("this trl has no accuracy_reward")
    cases = [(r"My answer is \boxed{\frac{1}{3}}", r"$\frac{1}{3}$"),
             (r"My answer is \boxed{\frac{1}{2}}", r"$\frac{1}{3}$"),
             (r"So \boxed{0.5}", r"$\frac{1}{2}$"),
             (r"So \boxed{42}", "$42$"),
             (r"So \boxed{41}", "$42$"),
             (r"Thus \boxed{\sqrt{2}/2}", r"$\frac{1}{\sqrt{2}}$")]
    completions = [[{"role": "assistant", "content": c}] for c, _ in cases]
    truths = [t for _, t in cases]
    theirs = accuracy_reward(completions, solution=truths)
    ours = correctness(completions, answer=truths)
    assert ours == theirs == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


# ------------------------------------------------------------------------------ format

@pytest.mark.parametrize("completion, expected", [
    (r"so \boxed{5}", 1.0),
    (r"so $\boxed{5}$.  ", 1.0),
    (r"\[\boxed{\frac{1}{2}}\]", 1.0),
    (r"\boxed{5} because reasons", 0.0),
    (r"\boxed{}", 0.0),
    (r"\boxed{  }", 0.0),
    (r"\boxed{5", 0.0),
    (r"\boxed{4} then \boxed{5", 0.0),
    ("A: 5", 0.0),
    (None, 0.0),
    ([{"role": "assistant", "content": r"\boxed{2}"}], 1.0),
])
def test_format_reward(completion, expected):
    assert format_reward([completion]) == [expected]


# ----------------------------------------------------------------------------- shaping

@pytest.mark.parametrize("completion, steps, expected", [
    ("16 - 3 = 13 and 13 * 2 = 26", ["13", "26"], 1.0),
    ("16 - 3 = 13", ["13", "26"], 0.5),
    ("146 and 4.6 and 460", ["46"], 0.0),
    ("it is 46.", ["46"], 1.0),
    ("it is 46.0 now", ["46"], 1.0),
    ("a total of 1,000 and half is .5", ["1000", "0.5"], 1.0),
    ("123+456=579,579+1=580", ["579", "580"], 1.0),
    ("the loss is -5 overall", ["-5"], 1.0),
    ("anything", [], 1.0),
    (None, ["1"], 0.0),
])
def test_step_completeness(completion, steps, expected):
    assert step_completeness(completion, steps) == expected


def test_gsm8k_steps():
    field = ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
             "She makes 9 * 2 = $<<9*2=18>>18 and half <<1/2=.5>>.5\n#### 18")
    assert gsm8k_steps(field) == ["9", "18", ".5"]
    assert gsm8k_steps("#### 3") == []


def test_shaped_arithmetic():
    fn = shaped(correctness, lam=0.3)
    completions = [r"13 then 20 so \boxed{26}",  # right, complete:   1 - 0.3 * 0   = 1
                   r"13 so \boxed{26}",          # right, half:       1 - 0.3 * 0.5 = 0.85
                   r"\boxed{25}"]                # wrong, no steps:   0 - 0.3 * 1   = -0.3
    scores = fn(completions, answer=["26"] * 3, steps=[["13", "20"]] * 3, prompts=["q"] * 3)
    assert scores == pytest.approx([1.0, 0.85, -0.3])
    assert "correctness" in fn.__name__


def test_shaped_passes_steps_to_the_raw_reward():
    seen = {}

    def raw(completions, **kwargs):
        seen.update(kwargs)
        return [0.5] * len(completions)

    assert shaped(raw, lam=1.0)(["7"], steps=[["7"]], answer=["x"]) == [0.5]
    assert seen["steps"] == [["7"]] and seen["answer"] == ["x"]


@pytest.mark.parametrize("lam", [-0.1, 1.5, float("nan"), "0.3", True])
def test_shaped_rejects_bad_lambda(lam):
    with pytest.raises(ValueError, match="lam"):
        shaped(correctness, lam=lam)


def test_shaped_needs_steps():
    fn = shaped(correctness)
    with pytest.raises(ValueError, match="`steps`"):
        fn([r"\boxed{1}"], answer=["1"])
    with pytest.raises(ValueError, match="steps has 2 .*completions has 1"):
        fn([r"\boxed{1}"], answer=["1"], steps=[[], []])


# ----------------------------------------------------------------------------- combine

def test_combine_weights_and_name():
    fn = combine((correctness, 0.9), (format_reward, 0.1))
    assert fn.__name__ == "0.9*correctness+0.1*format_reward"
    scores = fn([r"\boxed{5}", "A: 5", r"\boxed{4}"], answer=["5", "5", "5"])
    # right+boxed: 0.9 + 0.1; right, not boxed: 0.9; wrong but boxed: 0.1
    assert scores == pytest.approx([1.0, 0.9, 0.1])


def test_combine_negative_weight_name():
    fn = combine((correctness, 1), (format_reward, -0.5))
    assert fn.__name__ == "1*correctness-0.5*format_reward"
    assert fn([r"\boxed{2}"], answer=["2"]) == pytest.approx([0.5])


@pytest.mark.parametrize("bad", [
    [(correctness, float("inf"))],
    [(correctness, float("nan"))],
    [(correctness, "1")],
    [(correctness, True)],
    [(correctness,)],
    [("not callable", 1.0)],
    [],
])
def test_combine_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        combine(*bad)


# ------------------------------------------------------------------------ normalization

def test_sigmoid():
    out = normalize_scores([0.0, 2.0, -2.0, 1000.0, -1000.0])
    s2 = 1 / (1 + math.exp(-2))
    assert out == pytest.approx([0.5, s2, 1 - s2, 1.0, 0.0])
    assert all(0.0 <= v <= 1.0 for v in out)


def test_sigmoid_of_a_tensor():
    out = normalize_scores(torch.tensor([0.0, math.log(3.0)]))
    assert isinstance(out, list) and out == pytest.approx([0.5, 0.75])


def test_group_minmax():
    scores = [1.0, 3.0, 2.0,     # -> 0, 1, 0.5
              -4.0, -4.0, -4.0,  # constant group -> 0.5 each
              10.0, 0.0, 5.0]    # -> 1, 0, 0.5
    out = normalize_scores(scores, method="group_minmax", group_size=3)
    assert out == pytest.approx([0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.0, 0.0, 0.5])
    tensor_out = normalize_scores(torch.tensor(scores), "group_minmax", group_size=3)
    assert tensor_out == pytest.approx(out)


@pytest.mark.parametrize("group_size", [4, 0, -3, None, 2.0])
def test_group_minmax_bad_group_size(group_size):
    with pytest.raises(ValueError, match="group_size"):
        normalize_scores([1.0] * 6, method="group_minmax", group_size=group_size)


def test_normalize_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError, match="sigmoid.*group_minmax"):
        normalize_scores([1.0], method="zscore")


def test_normalize_rejects_2d_and_nan():
    with pytest.raises(ValueError, match="1-D"):
        normalize_scores(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="finite"):
        normalize_scores([float("nan")])


def test_different_integers_are_graded_without_sympy(monkeypatch):
    import labkit.problems.rewards as R

    def no_sympy(*args, **kwargs):
        raise AssertionError("math-verify was asked about two plain integers")

    import math_verify

    monkeypatch.setattr(math_verify, "parse", no_sympy)
    monkeypatch.setattr(math_verify, "verify", no_sympy)
    assert R.correctness(["\\boxed{121}", "\\boxed{1,000}", "\\boxed{-7}"],
                         answer=["122", "1000", "7"]) == [0.0, 1.0, 0.0]


# ---------------------------------------------------------------------- the reward registry

def test_the_reward_registry_names_correctness_and_takes_new_rewards():
    assert rewards.REWARDS["correctness"] is correctness and "correctness" in list(rewards.REWARDS)
    assert "RLVR" in rewards.REWARDS.describe()

    @rewards.REWARDS.register("long_for_test")
    def long_reward(completions, **kwargs):
        """Length (a test's own reward): 1 for completions over 3 characters."""
        return [float(len(c) > 3) for c in completions]

    assert rewards.REWARDS.resolve("long_for_test")(["ab", "abcd"], answer=["", ""]) == [0, 1]
    assert rewards.REWARDS.resolve("labkit.problems.rewards:format_reward") is format_reward
    with pytest.raises(ValueError, match=r"reward must be one of \['correctness', "):
        rewards.REWARDS.resolve("accuracy", "reward")
    # called as TRL calls it, every argument by keyword (rewards.TRL_KEYWORDS)
    with pytest.raises(ValueError, match=r"signature \(\*, prompts, completions, answer, "):
        rewards.REWARDS.register("no_answer_for_test")(lambda completions: [])
