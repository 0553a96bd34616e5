"""The README and docs/ name real things: every `python -m labkit ...` command in a bash block
parses and passes the checks it would meet before any work starts, every file path exists,
and every dotted `labkit.x.y` name resolves."""

import importlib
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest

import labkit.__main__ as cli
from labkit.lab.runner import check_parameters
from labkit.lab.sweeps import load_sweep
from labkit.settings.config import TrainConfig, field_types

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# placeholders the docs use for a value the reader picks
PLACEHOLDERS = {"<run>": "RUN", "--seed S": "--seed 0", "--lr LR": "--lr 1e-3"}
COMMAND = re.compile(r"python -m labkit (train|run|sweep|bench|eval)\b([^#\n]*)")
PATH = re.compile(r"(?<![\w./])((?:labkit|notebooks|experiments|tests)/[\w./-]*\w|\.ci/run)")
NAME = re.compile(r"`(labkit(?:\.\w+)+)")
READERS = {"~/models/Qwen2.5-0.5B-Instruct": "model", "~/data/gsm8k_test.jsonl": "gsm8k"}
"""Paths on the reader's machine the docs' commands name: a stand-in of each is made."""


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """A saved causal LM folder and a GSM8K file, for the paths of READERS."""
    import json

    from model_folders import save_random

    root = tmp_path_factory.mktemp("reader")
    gsm8k = root / "gsm8k_test.jsonl"
    gsm8k.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    return {"model": str(save_random(root / "model")), "gsm8k": str(gsm8k)}


def bash_lines(doc: Path) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines()]


def commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in DOCS:
        for line in bash_lines(doc):
            for old, new in PLACEHOLDERS.items():
                line = line.replace(old, new)
            for hit in COMMAND.finditer(line):
                found.append((doc.name, [hit.group(1), *shlex.split(hit.group(2))]))
    return found


def parsed(argv: list[str]):
    """The namespace `python -m labkit` builds for argv, with no command run."""
    seen = []

    def keep(args, *_, **__):
        seen.append(args)
        return {"train": {}, "eval": {"eval/n": 0}}.get(args.command, 0)

    with mock.patch.multiple(cli, run_train=keep, run_eval=keep), \
            mock.patch.multiple("labkit.lab.commands", run_notebook_command=keep,
                                run_sweep_command=keep), \
            mock.patch("labkit.bench.main_bench", keep):
        assert cli.main(argv) == 0
    return seen[0]


def test_the_docs_hold_the_commands_they_promise():
    names = {(doc, argv[0]) for doc, argv in commands()}
    assert {("README.md", c) for c in ("train", "run", "sweep", "bench")} <= names
    assert ("performance.md", "bench") in names and ("results.md", "train") in names
    assert "bash .ci/run" in bash_lines(ROOT / "README.md")


@pytest.mark.parametrize("doc, argv", commands(), ids=lambda x: " ".join(x)[:60]
                         if isinstance(x, list) else x)
def test_documented_command_parses(doc, argv, request):
    if "--help" in argv:
        with pytest.raises(SystemExit) as done:
            parsed(argv)
        assert done.value.code == 0
        return
    args = parsed(argv)
    if args.command == "train" and args.resume is None:
        TrainConfig(**cli.config_fields([(name, getattr(args, name)) for name in field_types()
                                         if getattr(args, name) is not None], cli.option))
    elif args.command == "run":
        given = dict(args.parameters)
        if set(given.values()) & set(READERS):
            made = request.getfixturevalue("stand_ins")
            given = {k: made[READERS[v]] if v in READERS else v for k, v in given.items()}
        import torch

        if given.get("device", "").startswith("cuda") and not torch.cuda.is_available():
            given.pop("device")  # a GPU command, read here without its device
        check_parameters(ROOT / args.notebook, given)
    elif args.command == "sweep":
        load_sweep(ROOT / args.experiment, smoke=args.smoke)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_named_paths_and_names_exist(doc):
    text = doc.read_text()
    paths = {p for p in PATH.findall(text) if not p.startswith("experiments/runs")}
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []
    for name in set(NAME.findall(text)):
        module, _, attr = name.rpartition(".")
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            assert hasattr(importlib.import_module(module), attr), name
