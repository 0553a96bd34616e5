"""`correctness` against the GSM8K authors' own labels of 5,276 real model completions.

The data sits in the shared folder beside the repository; a fresh clone has none, and then
these tests skip.
"""

import json
from pathlib import Path

import pytest

from labkit.answers import extract_answer, gsm8k_ground_truth
from labkit.problems.rewards import correctness

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
SOLUTIONS = DATA / "example_model_solutions.jsonl"
TEST = DATA / "test.jsonl"
MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")
MIN_AGREEMENT = 0.999


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        pytest.skip(f"GSM8K data not found at {path}")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def solutions() -> list[dict]:
    return _rows(SOLUTIONS)


def test_correctness_agrees_with_dataset_labels(solutions):
    completions, truths, labels, where = [], [], [], []
    for i, row in enumerate(solutions):
        truth = extract_answer(row["ground_truth"])
        assert truth is not None, f"row {i}: no final answer in ground_truth"
        for model in MODELS:
            completions.append(row[model]["solution"])
            truths.append(truth)
            labels.append(1.0 if row[model]["is_correct"] else 0.0)
            where.append((i, model))
    assert len(completions) == 5276

    scores = correctness(completions, answer=truths)
    disagree = [j for j, (s, y) in enumerate(zip(scores, labels)) if s != y]
    agreed = len(scores) - len(disagree)
    examples = "\n".join(
        f"  row {where[j][0]} {where[j][1]}: label={labels[j]} ours={scores[j]} "
        f"truth={truths[j]!r} extracted={extract_answer(completions[j])!r}"
        for j in disagree[:5])
    assert agreed >= MIN_AGREEMENT * len(scores), (
        f"correctness agrees with is_correct on {agreed}/{len(scores)}; first "
        f"disagreements:\n{examples}")


def test_ground_truth_matches_test_split(solutions):
    # the solutions file writes thousands commas ("A: 2,125"), gsm8k_ground_truth drops them
    by_question = {row["question"]: extract_answer(row["ground_truth"]).replace(",", "")
                   for row in solutions}
    test_rows = _rows(TEST)
    assert len(test_rows) == len(solutions)
    mismatches = [(row["question"][:60], gsm8k_ground_truth(row["answer"]),
                   by_question.get(row["question"]))
                  for row in test_rows
                  if gsm8k_ground_truth(row["answer"]) != by_question.get(row["question"])]
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:3]}"
