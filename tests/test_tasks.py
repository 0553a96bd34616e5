"""Tasks: procedural arithmetic against a plain reference, splits, GSM8K loading, prompts.

Expected values come from independent references: Python's `eval` of a fully
parenthesised expression (left-to-right arithmetic), brute-force enumeration of tiny
problem spaces, and hand-written GSM8K rows.
"""

import copy
import itertools
import json
import random
import re
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

from labkit.answers import is_worked
from labkit.problems.rewards import correctness, step_completeness
from labkit.problems.tasks import (DEFAULT_TASK, GSM8K_TEMPLATE, ArithmeticTask, Problem,
                                   format_prompt, load_gsm8k)

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"

CONFIGS = [
    dict(digits=d, operands=k, ops=ops, scratchpad=pad, template=tpl)
    for d, k, ops, pad, tpl in itertools.product(
        (1, 2, 3), (2, 3, 4), ("+", "+-", "+-*"), (False, True), ("compact", "instruct"))
]


# ---------------------------------------------------------------- plain references

def ref_expression(numbers, ops):
    return str(numbers[0]) + "".join(f"{o}{n}" for o, n in zip(ops, numbers[1:]))


def ref_value(numbers, ops):
    """Left-to-right value by Python's eval of ((a o b) o c) ..."""
    text = "(" * (len(numbers) - 1) + str(numbers[0])
    text += "".join(f"{o}{n})" for o, n in zip(ops, numbers[1:]))
    return eval(text)  # noqa: S307 - digits and + - * only


def ref_steps(numbers, ops):
    return [str(ref_value(numbers[:i + 1], ops[:i])) for i in range(1, len(numbers))]


def parse_prompt(prompt):
    """(numbers, ops) read back from a compact or instruct prompt (operands are >= 0)."""
    expr = prompt[:-1] if prompt.endswith("=") else re.search(r"What is ([\d +*-]+)\?",
                                                              prompt).group(1)
    tokens = re.findall(r"\d+|[+*-]", expr)
    return [int(t) for t in tokens[0::2]], tokens[1::2]


def all_expressions(digits, operands, ops):
    return {ref_expression(nums, o)
            for nums in itertools.product(range(10**digits), repeat=operands)
            for o in itertools.product(ops, repeat=operands - 1)}


@contextmanager
def time_limit(seconds):
    """Turn a hang into a failure (Unix main thread)."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------- arithmetic answers

@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_make_matches_left_to_right_reference(config):
    task = ArithmeticTask(**config)
    rng = random.Random(repr(config))
    for _ in range(25):
        numbers = [rng.randint(0, 10**task.digits - 1) for _ in range(task.operands)]
        ops = [rng.choice(task.ops) for _ in range(task.operands - 1)]
        problem = task.make(numbers, ops)
        value, steps = ref_value(numbers, ops), ref_steps(numbers, ops)
        assert problem.answer == str(value)
        assert list(problem.steps) == steps
        assert steps[-1] == str(value)
        assert problem.target.endswith(f"\\boxed{{{value}}}")
        assert parse_prompt(problem.prompt) == (numbers, ops)
        if task.template == "compact":
            assert problem.prompt == ref_expression(numbers, ops) + "="
        if task.scratchpad:
            running = [numbers[0]] + [int(s) for s in steps]
            for before, op, n, after in zip(running, ops, numbers[1:], running[1:]):
                assert f"{before}{op}{n}={after}" in problem.target
            assert step_completeness(problem.target, problem.steps) == 1.0
        else:
            assert problem.target == f"\\boxed{{{value}}}"


@pytest.mark.parametrize("config", CONFIGS[::5], ids=lambda c: "-".join(map(str, c.values())))
def test_sampled_problems_are_right_and_graded_by_correctness(config):
    task = ArithmeticTask(**config)
    for split in ("train", "test"):
        problems = task.sample(12, split=split, seed=7)
        assert len(problems) == 12
        for p in problems:
            numbers, ops = parse_prompt(p.prompt)
            assert p.answer == str(ref_value(numbers, ops))
            assert list(p.steps) == ref_steps(numbers, ops)
            assert task.split_of(ref_expression(numbers, ops)) == split
        answers = [p.answer for p in problems]
        assert correctness([p.target for p in problems], answer=answers) == [1.0] * 12
        wrong = [p.target.replace(f"\\boxed{{{p.answer}}}", f"\\boxed{{{int(p.answer) + 1}}}")
                 for p in problems[:4]]
        assert correctness(wrong, answer=answers[:4]) == [0.0] * 4


def test_templates():
    problem = ArithmeticTask(template="instruct").make([12, 34], ["+"])
    assert "12 + 34" in problem.prompt and "\\boxed" in problem.prompt
    mixed = ArithmeticTask(operands=3, ops="+-*", template="instruct").make([7, 3, 5], ["-", "*"])
    assert "7 - 3 * 5" in mixed.prompt and mixed.answer == "20"
    assert ArithmeticTask().make([12, 34], ["+"]).prompt == "12+34="
    assert DEFAULT_TASK.make([99, 99], ["+"]) == Problem("99+99=", "198", ("198",),
                                                         "\\boxed{198}")


# ---------------------------------------------------------------- splits

@pytest.mark.parametrize("digits,operands,ops", [(1, 2, "+"), (1, 2, "+-"), (1, 3, "+-*"),
                                                 (2, 2, "+")])
def test_num_problems_counts_the_space(digits, operands, ops):
    task = ArithmeticTask(digits=digits, operands=operands, ops=ops)
    assert task.num_problems == len(all_expressions(digits, operands, ops))


def test_tiny_space_splits_are_disjoint_exhaustively():
    task = ArithmeticTask(digits=1, operands=2, ops="+")
    problems = [task.make([a, b], ["+"]) for a in range(10) for b in range(10)]
    expressions = [p.prompt[:-1] for p in problems]
    assert len(set(expressions)) == 100
    test_set = {e for e in expressions if task.split_of(e) == "test"}
    train_set = {e for e in expressions if task.split_of(e) == "train"}
    assert test_set.isdisjoint(train_set) and len(test_set) + len(train_set) == 100
    assert 0 < len(test_set) < 30
    drawn = {split: {p.prompt[:-1] for seed in range(3)
                     for p in task.sample(400, split=split, seed=seed)}
             for split in ("train", "test")}
    assert drawn["train"].isdisjoint(drawn["test"])
    # enough draws to meet every problem of each split, and nothing else
    assert drawn["train"] == train_set
    assert drawn["test"] == test_set


def test_default_task_splits_are_disjoint_and_independent_of_seed():
    train = {p.prompt for seed in (0, 1, 2) for p in DEFAULT_TASK.sample(2000, "train", seed=seed)}
    test = {p.prompt for seed in (0, 3, 4) for p in DEFAULT_TASK.sample(500, "test", seed=seed)}
    assert train.isdisjoint(test)
    assert len(test) > 400  # the draws overlap across seeds, yet never cross the split


@pytest.mark.parametrize("test_percent", [10, 30])
def test_test_share_is_near_test_percent(test_percent):
    task = ArithmeticTask(digits=2, operands=2, ops="+", test_percent=test_percent)
    expressions = all_expressions(2, 2, "+")
    share = 100 * sum(task.split_of(e) == "test" for e in expressions) / len(expressions)
    assert abs(share - test_percent) < 1.5


def test_seed_repeatability():
    task = ArithmeticTask(digits=2, operands=3, ops="+-*", scratchpad=True)
    for split in ("train", "test"):
        a = task.sample(50, split, seed=11)
        assert a == task.sample(50, split, seed=11)
        assert a != task.sample(50, split, seed=12)
        assert task.sample(20, split, seed=11) == a[:20]


def test_distinct_gives_no_repeats():
    problems = DEFAULT_TASK.sample(800, "test", seed=0, distinct=True)
    assert len({p.prompt for p in problems}) == 800
    # a plain draw of as many does repeat (about 1000 test problems): distinct did something
    plain = DEFAULT_TASK.sample(800, "test", seed=0)
    assert len({p.prompt for p in plain}) < 800
    tiny = ArithmeticTask(digits=1, operands=2, ops="+")
    assert len({p.prompt for p in tiny.sample(9, "test", seed=1, distinct=True)}) == 9


def test_asking_more_distinct_problems_than_the_split_holds_raises():
    with pytest.raises(ValueError, match=r"\bn\b"):
        DEFAULT_TASK.sample(DEFAULT_TASK.split_size("test") + 1, "test", distinct=True)
    with pytest.raises(ValueError, match=r"\bn\b"):
        ArithmeticTask(digits=1, operands=2).sample(101, "train", distinct=True)


@pytest.mark.parametrize("task", [DEFAULT_TASK, ArithmeticTask(digits=1, operands=3, ops="+-")])
def test_a_whole_small_split_can_be_drawn(task):
    """eval_n may ask for every held-out problem: the split is listed, counted exactly, and
    drawn whole, in an order that depends on the seed."""
    expressions = all_expressions(task.digits, task.operands, task.ops)
    test_set = {e for e in expressions if task.split_of(e) == "test"}
    assert task.split_size("test") == len(test_set)
    assert task.split_size("train") == len(expressions) - len(test_set)
    with time_limit(20):
        whole = task.sample(len(test_set), "test", seed=0, distinct=True)
    assert {p.prompt[:-1] for p in whole} == test_set and len(whole) == len(test_set)
    assert all(p.answer == str(ref_value(*parse_prompt(p.prompt))) for p in whole[:50])
    again = task.sample(len(test_set), "test", seed=1, distinct=True)
    assert [p.prompt for p in again] != [p.prompt for p in whole]


def test_small_split_below_its_estimate_raises_instead_of_hanging():
    # digits=1, ops="+-*", test_percent=20: 300 problems, the estimate says 60 test ones
    task = ArithmeticTask(digits=1, operands=2, ops="+-*", test_percent=20)
    test_set = {e for e in all_expressions(1, 2, "+-*") if task.split_of(e) == "test"}
    with time_limit(20):
        got = task.sample(len(test_set), "test", seed=0, distinct=True)
        assert {p.prompt[:-1] for p in got} == test_set
        with pytest.raises(ValueError, match=r"\bn\b"):
            task.sample(len(test_set) + 1, "test", seed=0, distinct=True)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("name,value", [
    ("digits", 0), ("digits", 10), ("operands", 1), ("operands", 9), ("ops", ""),
    ("ops", "/"), ("ops", "+x"), ("template", "chat"), ("test_percent", 0),
    ("test_percent", 51),
])
def test_bad_constructor_argument_names_it(name, value):
    with pytest.raises(ValueError, match=name):
        ArithmeticTask(**{name: value})


@pytest.mark.parametrize("kwargs,name", [
    (dict(n=-1), "n"), (dict(n=3, split="valid"), "split"), (dict(n=3, split="Test"), "split"),
    (dict(n=10_000, distinct=True), "n"),
])
def test_bad_sample_argument_names_it(kwargs, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        DEFAULT_TASK.sample(**kwargs)


def test_valid_edges_are_accepted():
    assert DEFAULT_TASK.sample(0) == []
    ArithmeticTask(digits=9, operands=8, ops="*-+", test_percent=50)
    ArithmeticTask(digits=1, operands=2, test_percent=1)


# ---------------------------------------------------------------- GSM8K

ROWS = [
    {"question": "Tom packs 3 boxes of 4 apples and buys 1,200 more. How many apples?",
     "answer": "He packs 3*4=<<3*4=12>>12 apples.\n"
               "Then he has 12+1200=<<12+1200=1212>>1,212 apples.\n#### 1,212"},
    {"question": "What is 5 minus 7?", "answer": "5-7=<<5-7=-2>>-2\n#### -2"},
    {"question": "How many legs has a cat?", "answer": "A cat has four legs.\n#### 4"},
    {"question": "Half of 9?", "answer": "9/2=<<9/2=4.5>>4.5\n#### 4.5"},
    {"question": "Ann has 2 pens and gets 2. How many?", "answer": "2+2=<<2+2=4>>4\n#### 4"},
]


def write_jsonl(path, rows, blank_after=None):
    lines = [json.dumps(r) for r in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_gsm8k_rows(tmp_path):
    problems = load_gsm8k(write_jsonl(tmp_path / "g.jsonl", ROWS, blank_after=2))
    assert len(problems) == 5
    first, second, third = problems[:3]
    assert first.prompt == GSM8K_TEMPLATE.format(question=ROWS[0]["question"])
    assert ROWS[0]["question"] in first.prompt and "\\boxed{}" in first.prompt
    assert [p.answer for p in problems] == ["1212", "-2", "4", "4.5", "4"]
    assert first.steps == ("12", "1212") and second.steps == ("-2",) and third.steps == ()
    assert problems[3].steps == ("4.5",)
    assert first.target == ("He packs 3*4=12 apples.\nThen he has 12+1200=1,212 apples.\n"
                            "The answer is \\boxed{1212}.")
    for p in problems:
        assert "<<" not in p.target and ">>" not in p.target and "####" not in p.target
        assert correctness([p.target], answer=[p.answer]) == [1.0]
        assert step_completeness(p.target, p.steps) == 1.0


def test_load_gsm8k_custom_template(tmp_path):
    problems = load_gsm8k(write_jsonl(tmp_path / "g.jsonl", ROWS), template="Q: {question}\nA:")
    assert problems[1].prompt == "Q: What is 5 minus 7?\nA:"


def test_load_gsm8k_n_and_seed(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", ROWS)
    questions = [r["question"] for r in ROWS]

    def asked(problems):
        return [questions.index(q) for p in problems for q in questions
                if p.prompt == GSM8K_TEMPLATE.format(question=q)]

    assert asked(load_gsm8k(path, n=2)) == [0, 1]
    assert load_gsm8k(path, n=0) == []
    assert asked(load_gsm8k(path, n=50)) == [0, 1, 2, 3, 4]
    picked = asked(load_gsm8k(path, n=3, seed=1))
    assert len(picked) == 3 and len(set(picked)) == 3
    assert asked(load_gsm8k(path, n=3, seed=1)) == picked
    choices = {tuple(sorted(asked(load_gsm8k(path, n=2, seed=s)))) for s in range(12)}
    assert len(choices) > 1  # the seed picks, not just the first rows
    assert sorted(asked(load_gsm8k(path, n=9, seed=4))) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"\bn\b"):
        load_gsm8k(path, n=-1)


def test_load_gsm8k_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_gsm8k(tmp_path / "missing.jsonl")
    # physical line 4 (a blank line 2 counts) lacks 'answer'
    bad = ROWS[:2] + [{"question": "No answer here?"}]
    with pytest.raises(ValueError, match=r"(line |:)4\b"):
        load_gsm8k(write_jsonl(tmp_path / "bad.jsonl", bad, blank_after=1))
    with pytest.raises(ValueError, match="template"):
        load_gsm8k(write_jsonl(tmp_path / "g.jsonl", ROWS), template="Solve: {problem}")
    # a broken JSON line and an answer without '#### N' name their line too
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "#### 1"}\n{"question": \n')
    with pytest.raises(ValueError, match=r":2: not valid JSON"):
        load_gsm8k(broken)
    unmarked = write_jsonl(tmp_path / "unmarked.jsonl",
                           ROWS[:1] + [{"question": "q", "answer": "just 5"}])
    with pytest.raises(ValueError, match=r":2: .*####"):
        load_gsm8k(unmarked)


@pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").is_file(), reason="no local GSM8K copy")
def test_load_real_gsm8k_test_split():
    problems = load_gsm8k(GSM8K_DIR / "test.jsonl")
    assert len(problems) == 1319
    for p in problems:
        float(p.answer)  # every final answer is a plain number
        assert "<<" not in p.target
    # Janet's ducks, read off the file by hand
    assert "Janet" in problems[0].prompt
    assert problems[0].answer == "18" and problems[0].steps == ("9", "18")


# ---------------------------------------------------------------- prompts and records

def test_format_prompt_without_chat_template(tiny):
    _, tokenizer = tiny
    assert format_prompt("12+34=") == "12+34="
    assert not getattr(tokenizer, "chat_template", None)
    assert format_prompt("12+34=", tokenizer) == "12+34="


def test_format_prompt_applies_chat_template(tiny):
    tokenizer = copy.deepcopy(tiny[1])  # leave the shared tokenizer without a template
    tokenizer.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    assert format_prompt("12+34=", tokenizer) == "[user]12+34=\n[assistant]"
    assert not getattr(tiny[1], "chat_template", None)


def test_problem_to_record():
    problem = ArithmeticTask(operands=3, scratchpad=True).make([1, 2, 3], ["+", "+"])
    record = problem.to_record()
    assert record == {"prompt": "1+2+3=", "answer": "6", "steps": ["3", "6"],
                      "target": "1+2=3,3+3=6. \\boxed{6}"}
    assert isinstance(record["steps"], list)
    assert json.loads(json.dumps(record)) == record


# ---------------------------------------------------------------- operand counts that vary

def test_min_operands_draws_every_count_and_counts_the_space():
    task = ArithmeticTask(digits=1, operands=4, min_operands=2, scratchpad=True)
    assert task.counts == (2, 3, 4)
    assert task.num_problems == sum(len(all_expressions(1, k, "+")) for k in (2, 3, 4))
    problems = task.sample(600, "train", seed=5)
    counts = [len(parse_prompt(p.prompt)[0]) for p in problems]
    assert set(counts) == {2, 3, 4}
    assert all(abs(counts.count(k) / 600 - 1 / 3) < 0.08 for k in (2, 3, 4)), counts
    for p in problems[:40]:
        numbers, ops = parse_prompt(p.prompt)
        assert p.answer == str(ref_value(numbers, ops))
        assert list(p.steps) == ref_steps(numbers, ops)
        # the worked solution: one 'a+b=c' per step, then the boxed answer
        written = p.target.split(". ")[0].split(",")
        assert len(written) == len(numbers) - 1 and p.target.endswith(f"\\boxed{{{p.answer}}}")


def test_a_fixed_count_draws_the_same_stream_as_before_counts_could_vary():
    """min_operands=0 and min_operands=operands consume nothing extra from the generator: the
    prompts of every seed stay what they were (a plain re-implementation of the draw)."""
    rng, expected = random.Random("7:train"), []
    while len(expected) < 20:
        numbers = [rng.randint(0, 99) for _ in range(3)]
        ops = [rng.choice("+-") for _ in range(2)]
        expression = ref_expression(numbers, ops)
        if ArithmeticTask(digits=2, operands=3, ops="+-").split_of(expression) == "train":
            expected.append(expression + "=")
    for task in (ArithmeticTask(digits=2, operands=3, ops="+-"),
                 ArithmeticTask(digits=2, operands=3, ops="+-", min_operands=3)):
        assert [p.prompt for p in task.sample(20, "train", seed=7)] == expected


def test_a_small_space_of_several_counts_is_listed_whole():
    task = ArithmeticTask(digits=1, operands=3, min_operands=2)
    expressions = all_expressions(1, 2, "+") | all_expressions(1, 3, "+")
    test_set = {e for e in expressions if task.split_of(e) == "test"}
    assert task.split_size("test") == len(test_set)
    whole = task.sample(len(test_set), "test", seed=0, distinct=True)
    assert {p.prompt[:-1] for p in whole} == test_set


def test_longest_target_and_bad_min_operands():
    task = ArithmeticTask(digits=1, operands=5, min_operands=2, scratchpad=True)
    assert task.longest_target() == "9+9=18,18+9=27,27+9=36,36+9=45. \\boxed{45}"
    assert ArithmeticTask(digits=2, ops="+-").longest_target() == "\\boxed{198}"
    for bad in (1, 6):
        with pytest.raises(ValueError, match="min_operands"):
            ArithmeticTask(operands=5, min_operands=bad)


# ---------------------------------------------------------------- mixed answer forms

THINK = dict(digits=1, operands=5, min_operands=2)


def test_worked_mixes_forms_at_its_share_and_leaves_the_problems_unchanged():
    plain = ArithmeticTask(**THINK).sample(3000, "train", seed=5)
    mixed = ArithmeticTask(**THINK, worked=0.3).sample(3000, "train", seed=5)
    assert [p.prompt for p in mixed] == [p.prompt for p in plain]
    assert [p.answer for p in mixed] == [p.answer for p in plain]
    forms = []
    for p in mixed:
        direct = p.target == f"\\boxed{{{p.answer}}}"
        # a worked target writes each running result, in order, then the box
        steps = re.findall(r"=(-?\d+)", p.target)
        assert direct or (tuple(steps) == p.steps
                          and p.target.endswith(f". \\boxed{{{p.answer}}}")), p
        forms.append(not direct)
    share = sum(forms) / len(forms)
    assert abs(share - 0.3) < 4 * (0.3 * 0.7 / len(forms)) ** 0.5, share
    # every prompt of a small space can be seen both ways: the form is drawn per draw
    both = {p.prompt for p, f in zip(mixed, forms) if f} & \
           {p.prompt for p, f in zip(mixed, forms) if not f}
    assert both
    # the distinct, enumerated draw mixes too
    listed = ArithmeticTask(digits=1, operands=2, worked=0.5).sample(80, "train", seed=0,
                                                                     distinct=True)
    assert 0 < sum(is_worked(p.target) for p in listed) < 80


def test_worked_and_scratchpad_extremes_and_bad_values():
    assert all(is_worked(p.target) for p in
               ArithmeticTask(**THINK, worked=1.0).sample(50, seed=0))
    assert not any(is_worked(p.target) for p in ArithmeticTask(**THINK).sample(50, seed=0))
    assert (ArithmeticTask(**THINK, worked=0.5).longest_target()
            == ArithmeticTask(**THINK, scratchpad=True).longest_target())
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="worked"):
            ArithmeticTask(worked=bad)
    with pytest.raises(ValueError, match="scratchpad"):
        ArithmeticTask(worked=0.5, scratchpad=True)


@pytest.mark.parametrize("text, worked", [
    ("\\boxed{12}", False), (" \\boxed{7}", False), ("3+4=7,7+5=12. \\boxed{12}", True),
    ("12 + 5 = 17 \\boxed{17}", True), ("\\boxed{3+4=7}", False), ("7", False),
    ("3+4=7, no box", True), ("the sum is \\boxed{7}", False), ("9*2=18. \\boxed{18}", True),
])
def test_is_worked_reads_a_step_before_the_box(text, worked):
    assert is_worked(text) is worked
