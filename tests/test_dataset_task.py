"""The dataset task: any local jsonl, json, parquet or csv file with a prompt and an answer
column (GSM8K's and MATH-500's published layouts among them), its other columns passed to the
reward functions by name, `train` and `eval` on it, and bad columns said before a model loads."""

import json
from pathlib import Path

import pytest
from cli import in_process

from labkit.problems.dataset_task import DatasetError, load_dataset_task, read_rows
from labkit.problems.reward_expr import reward_columns, score
from labkit.problems.tasks import load_gsm8k

FIXTURES = Path(__file__).parent / "fixtures"
GSM8K = FIXTURES / "gsm8k_layout.jsonl"
MATH500 = FIXTURES / "math500_layout.jsonl"


def _sums(n: int = 40) -> list[dict]:
    """Two-digit sums in the embedded model's own prompt form, with a column of their own."""
    return [{"question": f"{10 + i}+{20 + 2 * i}=", "solution": str(30 + 3 * i),
             "source": f"row {i}"} for i in range(n)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    from datasets import Dataset

    Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_gsm8k_in_its_published_layout_reads_as_the_gsm8k_task_does():
    found = load_dataset_task(GSM8K, prompt_column="question")
    expected = load_gsm8k(GSM8K)
    raw = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    assert len(found) == len(expected) == len(raw) == 12
    for got, want, row in zip(found, expected, raw):
        assert got.prompt == row["question"]  # the dataset task keeps the prompt as written
        assert (got.answer, got.steps, got.target) == (want.answer, want.steps, want.target)
    assert found[0].answer == "18" and found[0].steps == ("9", "18")  # Janet's ducks, by hand


def test_math500_in_its_published_layout_passes_its_other_columns_to_the_rewards():
    problems = load_dataset_task(MATH500, prompt_column="problem")
    assert problems[-1].answer == "\\frac{3}{4}"
    rows = [problems[0]] * 2 + [problems[-1]] * 2  # G = 2 completions per prompt
    columns = reward_columns(rows, ["\\boxed{12}", "\\boxed{35}", "\\boxed{0.75}",
                                    "\\boxed{3/4}"], step_seed=5)
    assert columns["level"] == [1, 1, 1, 1]
    assert columns["subject"] == ["Algebra", "Algebra", "Prealgebra", "Prealgebra"]
    assert columns["unique_id"][0] == "test/algebra/100.json"
    assert "\\boxed{12}" in columns["solution"][0] and "problem" not in columns
    # 3 x 5 - 3 = 12 is row 0's answer; 3/4 and 0.75 are the same number to math-verify
    assert problems[0].answer == "12" and problems[0].prompt.startswith("What is")
    assert score("correctness", rows, ["\\boxed{12}", "\\boxed{35}", "\\boxed{0.75}",
                                       "\\boxed{3/4}"], 0) == [1.0, 0.0, 1.0, 1.0]


def test_jsonl_parquet_and_csv_give_the_same_problems(tmp_path):
    rows = _sums(6)
    from datasets import Dataset

    Dataset.from_list(rows).to_csv(str(tmp_path / "s.csv"), index=False)
    files = [_jsonl(tmp_path / "s.jsonl", rows), _parquet(tmp_path / "s.parquet", rows),
             tmp_path / "s.csv"]
    read = [load_dataset_task(f, "question", "solution") for f in files]
    assert read[0] == read[1] == read[2]
    assert read[0][2].prompt == "12+24=" and read[0][2].answer == "36"
    assert dict(read[0][2].columns) == {"source": "row 2"}
    assert len(load_dataset_task(files[0], "question", "solution", n=3, seed=1)) == 3


@pytest.mark.parametrize("change, says", [
    (dict(prompt_column="prompt"), "prompt_column='prompt' is not a column of"),
    (dict(answer_column="answer"), "its columns: question, solution, source"),
    (dict(answer_column="question"), "must differ"),
])
def test_a_column_that_is_not_there_is_named_with_the_file_columns(tmp_path, change, says):
    path = _jsonl(tmp_path / "s.jsonl", _sums(4))
    kwargs = dict(prompt_column="question", answer_column="solution") | change
    with pytest.raises(DatasetError, match=says.replace("(", r"\(")):
        load_dataset_task(path, **kwargs)


def test_bad_files_and_rows_are_named(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        read_rows(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match=r"\.parquet"):
        read_rows(_jsonl(tmp_path / "rows.txt", _sums(2)))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "1+2=", "solution": "3"}\n{"question": \n')
    with pytest.raises(DatasetError, match="row 2: not valid JSON"):
        read_rows(broken)
    empty = _jsonl(tmp_path / "empty.jsonl", _sums(2) + [{"question": "5+5=", "solution": " ",
                                                          "source": "x"}])
    with pytest.raises(DatasetError, match="row 3: column 'solution' is empty"):
        load_dataset_task(empty, "question", "solution")
    clash = _jsonl(tmp_path / "clash.jsonl", [{"q": "1+1=", "a": "2", "steps": "1"}])
    with pytest.raises(DatasetError, match="'steps' takes a name the reward call uses"):
        load_dataset_task(clash, "q", "a")


@pytest.mark.parametrize("maker", [_jsonl, _parquet], ids=["jsonl", "parquet"])
def test_train_runs_two_steps_from_a_file(tmp_path, maker):
    path = maker(tmp_path / f"sums.{'jsonl' if maker is _jsonl else 'parquet'}", _sums())
    run_dir = tmp_path / "run"
    done = in_process("train", "--task", "dataset", "--dataset-path", path,
                      "--prompt-column", "question", "--answer-column", "solution",
                      "--steps", "2", "--batch-prompts", "4", "--group-size", "4",
                      "--eval-n", "4", "--run-dir", run_dir, "--progress", "false")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "rollout/reward_mean" in r] == [1, 2]
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert config["dataset_path"] == str(path) and config["answer_column"] == "solution"


def test_a_bad_column_is_one_error_line_before_any_model_loads(tmp_path, monkeypatch):
    from labkit.model import learner, models

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load", never)
    monkeypatch.setattr(learner, "build_learner", never)
    path = _parquet(tmp_path / "sums.parquet", _sums(8))
    for command in (["train", "--steps", "2", "--run-dir", tmp_path / "run"], ["eval"]):
        done = in_process(*command, "--task", "dataset", "--dataset-path", path,
                          "--prompt-column", "question", "--answer-column", "answer")
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode != 0 and len(lines) == 1, done.stderr
        assert lines[0].startswith("error: ") and "answer_column='answer'" in lines[0]
        assert "question, solution, source" in lines[0]
    assert not (tmp_path / "run").exists()


def test_eval_reads_the_dataset_task(tmp_path):
    path = _jsonl(tmp_path / "sums.jsonl", _sums(12))
    done = in_process("eval", "--task", "dataset", "--dataset-path", path, "--prompt-column",
                      "question", "--answer-column", "solution", "--n", "12", "--samples", "0",
                      "--max-new-tokens", "12", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["eval/n"] == 12 and 0 <= result["eval/accuracy"] <= 1
