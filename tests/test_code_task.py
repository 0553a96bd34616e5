"""The code task: HumanEval- and MBPP-format files, the `code` reward through the real
sandbox, `eval --task code` with a stub policy and two training steps."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.probes import evaluation
from labkit.problems import code_tasks
from labkit.problems.code_tasks import CodeTaskError, load_code_tasks
from labkit.sandbox import launch

needs_boundary = pytest.mark.skipif(
    not launch.launcher(sys.executable).boundary,
    reason=f"no sandbox boundary here: {launch.jail_reason(sys.executable)}")


def _humaneval(i: int) -> dict:
    return {"task_id": f"T/{i}", "prompt": f"def plus{i}(x):\n    \"\"\"x + {i}\"\"\"\n",
            "canonical_solution": f"    return x + {i}\n",
            "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n"
                    f"    assert candidate(-{i}) == 0\n", "entry_point": f"plus{i}"}


def _write(path: Path, rows, gz: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def humaneval(tmp_path):
    return _write(tmp_path / "HumanEval.jsonl.gz", [_humaneval(i) for i in range(24)], gz=True)


def test_humaneval_rows_become_problems_whose_tests_call_check(humaneval):
    problems = load_code_tasks(humaneval)
    assert len(problems) == 24
    first = problems[0]
    assert first.entry_point == "plus0" and first.prompt.startswith("def plus0(x):")
    assert first.tests == (_humaneval(0)["test"] + "\ncheck(plus0)",)
    assert first.target == first.prompt + "    return x + 0\n"
    assert first.to_record()["tests"] == list(first.tests)
    assert [p.entry_point for p in load_code_tasks(humaneval, n=3)] == ["plus0", "plus1",
                                                                      "plus2"]


def test_mbpp_rows_take_their_entry_point_from_the_reference_code(tmp_path):
    row = {"task_id": 2, "text": "Write a function that doubles x.",
           "code": "def double(x):\n    return 2 * x", "test_setup_code": "",
           "test_list": ["assert double(2) == 4", "assert double(0) == 0"]}
    sanitized = {"task_id": 3, "prompt": "Triple x.", "code": "def triple(x):\n    return 3 * x",
                 "test_list": ["assert triple(1) == 3"]}
    double, triple = load_code_tasks(_write(tmp_path / "mbpp.jsonl", [row, sanitized]))
    assert double.entry_point == "double" and double.tests == tuple(row["test_list"])
    assert "assert double(2) == 4" in double.prompt
    assert triple.entry_point == "triple" and triple.prompt.startswith("Triple x.")


@pytest.mark.parametrize("rows, message", [
    ([_humaneval(0), {**_humaneval(1), "test": ""}], "row 2: field 'test' is missing or empty"),
    ([{k: v for k, v in _humaneval(0).items() if k != "entry_point"}],
     "row 1: field 'entry_point' is missing"),
    ([{"task_id": 1, "test": "assert True", "entry_point": "f"}],
     "row 1: field 'prompt' is missing"),
    ([{"text": "x", "test_list": ["assert f() == 1"]}],
     "row 1: field 'entry_point' is missing and 'code' defines no function"),
    ([_humaneval(0), "{not json"], "row 2: not valid JSON"),
    ([{**_humaneval(0), "test": "def check(:"}], "row 1: field 'test' is not valid Python"),
])
def test_a_bad_file_is_refused_naming_the_file_the_row_and_the_field(tmp_path, rows, message):
    path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(CodeTaskError, match=str(path).replace(".", r"\.") + ": " + message):
        load_code_tasks(path)


def test_a_missing_file_is_one_error_line_from_the_command(tmp_path):
    missing = tmp_path / "nope.jsonl.gz"
    done = subprocess.run([sys.executable, "-m", "labkit", "eval", "--task", "code",
                           "--code-path", str(missing)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {missing}: no such file (a HumanEval- "
                                                "or MBPP-format .jsonl or .jsonl.gz)"]


def test_a_body_completion_gets_the_prompt_in_front():
    prompt = "def plus1(x):\n    \"\"\"x + 1\"\"\"\n"
    assert code_tasks.program("    return x + 1\n", prompt, "plus1") == prompt + \
        "    return x + 1\n"
    whole = "```python\ndef plus1(x):\n    return 1 + x\n```"
    assert code_tasks.program(whole, prompt, "plus1") == "def plus1(x):\n    return 1 + x\n"


@needs_boundary
def test_the_code_reward_runs_the_programs_in_the_sandbox(humaneval, tmp_path):
    problems = load_code_tasks(humaneval, n=3)
    marker = tmp_path / "escaped"
    completions = ["    return x + 0\n",  # a body, completed from the prompt
                   "```python\ndef plus1(x):\n    return x - 1\n```",  # wrong
                   f"import os\nos.system('touch {marker}')\ndef plus2(x):\n    return x + 2\n"]
    rewards = code_tasks.code_reward(completions, tests=[p.tests for p in problems],
                                     entry_point=[p.entry_point for p in problems],
                                     prompts=[p.prompt for p in problems])
    assert rewards == [1.0, 0.0, 0.0] and not marker.exists()


@needs_boundary
def test_eval_gives_pass_at_1_and_pass_at_k_with_a_stub_policy(humaneval, monkeypatch):
    """A stub policy writes the right body for even problems, a wrong one for odd ones on
    its first sample and the right one on its second: greedy 1/2, pass@1 3/4, pass@2 1."""
    problems = load_code_tasks(humaneval, n=4)

    def stub(model, tokenizer, prompts, *, group_size=1, greedy=False, **kwargs):
        out = []
        for prompt in prompts:
            i = int(prompt.split("(")[0].removeprefix("def plus"))
            for s in range(group_size):
                right = i % 2 == 0 or (not greedy and s == 1)
                out.append(f"    return x + {i if right else i + 1}\n")
        return out

    monkeypatch.setattr(evaluation, "complete", stub)
    figures = evaluation.evaluate(None, None, problems, samples=2, k=2)
    assert figures["eval/accuracy"] == 0.5
    assert figures["eval/pass@1"] == 0.75 and figures["eval/pass@2"] == 1.0


@needs_boundary
def test_train_runs_two_steps_of_the_code_task_through_the_sandbox(humaneval, tmp_path):
    from labkit.settings.config import TrainConfig
    from labkit.trainer import train

    run = tmp_path / "run"
    result = train(TrainConfig(task="code", code_path=str(humaneval), reward="code", steps=2,
                               batch_prompts=2, group_size=2, eval_n=2, eval_every=2,
                               max_new_tokens=24, run_dir=str(run), progress=False))
    assert result.steps == 2
    record = json.loads((run / "config.json").read_text())
    assert record["sandbox"]["boundary"] is True and "seccomp filter" in \
        record["sandbox"]["layers"]
    rewards = [r["rollout/reward_mean"] for r in result.history if "rollout/reward_mean" in r]
    assert len(rewards) == 2 and all(r == 0.0 for r in rewards)  # it cannot write Python


def test_the_code_task_is_checked_before_anything_loads(tmp_path, humaneval):
    from labkit.settings.config import TrainConfig

    with pytest.raises(ValueError, match="code_path is required with task='code'"):
        TrainConfig(task="code", reward="code")
    with pytest.raises(ValueError, match="reward must include 'code'"):
        TrainConfig(task="code", code_path=str(humaneval))
    with pytest.raises(ValueError, match="code_path=.* is only read with task='code'"):
        TrainConfig(code_path=str(humaneval))


@needs_boundary
def test_the_eval_command_prints_pass_at_1_and_pass_at_k(humaneval, monkeypatch, capsys):
    from labkit.__main__ import main

    def stub(model, tokenizer, prompts, *, group_size=1, greedy=False, **kwargs):
        bodies = []
        for prompt in prompts:
            i = int(prompt.split("(")[0].removeprefix("def plus"))
            bodies += [f"    return x + {i + (s == 0 and not greedy)}\n"
                       for s in range(group_size)]
        return bodies  # greedy right; the first of the samples wrong, the others right

    monkeypatch.setattr(evaluation, "complete", stub)
    assert main(["eval", "--task", "code", "--code-path", str(humaneval), "--n", "3",
                 "--samples", "4", "--k", "2"]) == 0
    printed = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines()
                   if line.startswith("eval/"))
    assert float(printed["eval/accuracy"]) == 1.0
    assert float(printed["eval/pass@1"]) == 0.75  # 3 of 4 samples right
    assert float(printed["eval/pass@2"]) == 1.0  # 1 - C(1,2)/C(4,2) = 1
    assert printed["eval/n"].strip() == "3"
