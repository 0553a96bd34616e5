"""Problems from any local dataset file: a prompt column, an answer column, and the rest.

The file is read with the `datasets` library, as TRL users read theirs: JSON lines or JSON
(`.jsonl`, `.json`, either gzipped), Parquet (`.parquet`) or CSV (`.csv`). The user names the
column that holds the prompt and the one that holds the ground truth; every other column
goes to the reward functions as a keyword of the same name, one value per completion, as
TRL passes a dataset's columns (`labkit.problems.reward_expr.reward_columns`).

An answer in GSM8K's layout (a worked solution ending in `#### N`) gives N as the ground
truth, the solution (without its `<<a*b=c>>` annotations) as the reference completion and its
intermediate results as the steps, so GSM8K's published files work as they are; so does
MATH-500's (`problem`, `solution`, `answer`, `subject`, `level`, `unique_id`).
"""

from __future__ import annotations

import json
from pathlib import Path

from labkit.problems.tasks import Problem, gsm8k_problem, take

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""The `datasets` builder for each file suffix (a `.gz` after a JSON suffix is read too)."""

RESERVED = ("prompt", "answer", "steps", "target", "tests", "entry_point", "prompts",
            "completions", "step_seed")
"""Keywords a reward call already uses: another column may not take their name."""


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file and what is wrong."""


def builder(path: Path) -> str:
    """The `datasets` builder that reads `path`, by its suffix."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes[-1:] == [".gz"]:
        suffixes = suffixes[:-1]
        if suffixes[-1:] and LOADERS.get(suffixes[-1]) != "json":
            raise DatasetError(f"{path}: only JSON lines may be gzipped (.jsonl.gz)")
    kind = LOADERS.get(suffixes[-1] if suffixes else "")
    if kind is None:
        raise DatasetError(f"{path}: a dataset file must end in one of "
                           f"{', '.join(LOADERS)} (JSON optionally .gz)")
    return kind


def read_rows(path: str | Path, error: type[ValueError] = DatasetError) -> list[dict]:
    """The rows of a local dataset file as dicts, read with `datasets.load_dataset`; `error`
    (naming the file, and the first bad row of a JSON-lines file) when it cannot be read."""
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    path = Path(path).expanduser()
    if not path.is_file():
        raise error(f"{path}: no such file")
    kind = builder(path)
    disable_progress_bar()
    try:
        table = load_dataset(kind, data_files=str(path), split="train", cache_dir=None,
                             keep_in_memory=True)
    except Exception as e:  # noqa: BLE001 - said in one line, at the bad row where found
        raise error(unreadable(path, e) if kind == "json" else
                    f"{path}: not readable as {kind} ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:200]})") from None
    return table.to_list()


def unreadable(path: Path, error: Exception) -> str:
    """Why a JSON-lines file failed to load, at its first row that is not a JSON object
    where there is one."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for row_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    return f"{path}: row {row_no}: not valid JSON ({e.msg})"
                if not isinstance(row, dict):
                    return f"{path}: row {row_no}: not a JSON object"
    except (OSError, UnicodeDecodeError, EOFError) as e:
        return f"{path}: not readable ({type(e).__name__}: {e})"
    return f"{path}: not readable as JSON lines ({type(error).__name__}: " \
           f"{' '.join(str(error).split())[:200]})"


def check_columns(path: str | Path, rows: list[dict], prompt_column: str,
                  answer_column: str) -> list[str]:
    """The file's columns; DatasetError naming the file, the column asked for and the
    columns it has, when the prompt or answer column is missing, or another column takes a
    name the reward call uses."""
    if not rows:
        raise DatasetError(f"{path}: no rows")
    columns = list(rows[0])
    for option, name in (("prompt_column", prompt_column), ("answer_column", answer_column)):
        if name not in columns:
            raise DatasetError(f"{option}={name!r} is not a column of {path}; its columns: "
                               f"{', '.join(columns)}")
    if prompt_column == answer_column:
        raise DatasetError(f"prompt_column and answer_column must differ, both {prompt_column!r}")
    clash = [c for c in columns if c in RESERVED and c not in (prompt_column, answer_column)]
    if clash:
        raise DatasetError(f"{path}: column {clash[0]!r} takes a name the reward call uses "
                           f"({', '.join(RESERVED)}): rename it in the file")
    return columns


def load_dataset_task(path: str | Path, prompt_column: str = "prompt",
                      answer_column: str = "answer", n: int | None = None,
                      seed: int | None = None) -> list[Problem]:
    """The problems of a local dataset file: each row's `prompt_column` as the prompt, its
    `answer_column` as the ground truth (GSM8K's `... #### N` read as N, with its worked
    solution), and every other column kept for the reward functions (`Problem.columns`).

    `n` takes the first n rows, or a random n when `seed` is given. DatasetError for a
    missing or unreadable file, a missing column (listing the file's columns) or an empty
    prompt or answer (naming the row)."""
    rows = read_rows(path)
    check_columns(path, rows, prompt_column, answer_column)
    problems = []
    for row_no, row in enumerate(rows, 1):
        prompt, answer = row[prompt_column], row[answer_column]
        for name, value in ((prompt_column, prompt), (answer_column, answer)):
            if value is None or not str(value).strip():
                raise DatasetError(f"{path}: row {row_no}: column {name!r} is empty")
        others = tuple((k, v) for k, v in row.items() if k not in (prompt_column, answer_column))
        answer = str(answer)
        if "####" in answer:
            problems.append(gsm8k_problem(str(prompt), answer, columns=others))
        else:
            problems.append(Problem(prompt=str(prompt), answer=answer.strip(), columns=others))
    return take(problems, n, seed)
