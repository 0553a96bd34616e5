"""One reader of a field's value for every entry point (`labkit.settings.fields.parse`): each choice of
every choice field, `none` included, reaches config.json unchanged from the command line,
`diagnose --set`, `run -p`, a sweep's YAML and an arm; every optional field takes `none`; and
`train --estimator none` trains on the raw rewards."""

import json
from dataclasses import fields
from pathlib import Path
from typing import Literal, Union, get_args, get_origin, get_type_hints
from unittest import mock

import pytest
import yaml
from cli import in_process

from labkit import lab
from labkit.formulas.estimators import ESTIMATORS
from labkit.lab.runner import check_parameters, config_values, notebook_parameters
from labkit.lab.sweeps import load_sweep, plan
from labkit.problems.reward_expr import WRAPPERS, example
from labkit.settings.config import TrainConfig
from labkit.settings.defaults import TASK_SHAPES
from labkit.trainer import train

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "03_advantage_variance_live.ipynb"  # estimator, reward
HINTS = get_type_hints(TrainConfig)


def _choices() -> list[tuple[str, str]]:
    """(field, text) for every name of every registry field and Literal field, read from the
    registries and the annotations themselves; a wrapper reward with its parameters."""
    out = []
    for f in fields(TrainConfig):
        hint = HINTS[f.name]
        args = get_args(hint) if get_origin(hint) is Union or type(None) in get_args(hint) \
            else (hint,)
        kind = next(a for a in args if a is not type(None))
        if "registry" in f.metadata:
            names = list(f.metadata["registry"])
        elif get_origin(kind) is Literal:
            names = list(get_args(kind))
        else:
            continue
        out += [(f.name, example(n) if f.name == "reward" and n in WRAPPERS else n)
                for n in names]
    return out


CHOICES = _choices()
OPTIONAL = [f.name for f in fields(TrainConfig) if type(None) in get_args(HINTS[f.name])
            and f.name != "run_dir"]  # run_dir=None writes under experiments/runs


def _companions(name: str, text: str, tmp_path: Path) -> dict[str, str]:
    """The other fields a choice needs to make a valid config (a critic's estimator: PPO)."""
    if name == "estimator" and "values" in ESTIMATORS.needs(text):
        return {"algo": "ppo"}
    if name == "dpo_loss":  # DPO's own field: another algorithm refuses it
        return {"algo": "dpo"}
    if name == "task" and text == "gsm8k":
        data = tmp_path / "gsm8k.jsonl"
        data.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
        return {"gsm8k_path": str(data)}
    if name == "task" and text == "code":
        data = tmp_path / "code.jsonl"
        data.write_text(json.dumps({"prompt": "def f():\n", "test": "def check(c):\n    pass",
                                    "entry_point": "f"}) + "\n")
        return {"code_path": str(data), "reward": "code"}
    if name == "task" and text == "dataset":
        data = tmp_path / "rows.jsonl"
        data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
        return {"dataset_path": str(data)}
    return {}


class _Written(Exception):
    """Raised where the trainer would start: config.json is written by then."""


@pytest.fixture
def until_config():
    """`labkit.trainer.train` as it is up to config.json, then stopped (no model loads)."""
    def stop(*_a, **_k):
        raise _Written

    with mock.patch("labkit.trainer.Trainer", stop):
        yield


def _written(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "config.json").read_text())["config"]


def test_the_choices_cover_every_choice_field_and_none():
    named = {name for name, _ in CHOICES}
    assert {"estimator", "reward", "loss", "agg", "algo", "scale", "kl_kind"} <= named
    assert ("estimator", "none") in CHOICES and ("scale", "none") in CHOICES


@pytest.mark.parametrize("name, text", CHOICES, ids=[f"{n}={t}" for n, t in CHOICES])
def test_each_choice_reaches_config_json_from_the_command_line(until_config, tmp_path, name,
                                                               text):
    given = {name: text, **_companions(name, text, tmp_path)}
    argv = ["train", "--run-dir", tmp_path / "run", "--progress", "false"]
    for key, value in given.items():
        argv += [f"--{key.replace('_', '-')}", value]
    with pytest.raises(_Written):
        in_process(*argv)
    assert _written(tmp_path / "run")[name] == text


@pytest.mark.parametrize("name, text", CHOICES, ids=[f"{n}={t}" for n, t in CHOICES])
def test_each_choice_reaches_config_json_from_an_arm(until_config, tmp_path, name, text):
    given = {name: text, **_companions(name, text, tmp_path)}
    quoted = {k: f"'{v}'" if "/" in v else v for k, v in given.items()}  # a path: quoted
    arms = lab.parse_arms("arm: " + ", ".join(f"{k}={v}" for k, v in quoted.items()))
    assert arms == {"arm": given}
    with pytest.raises(_Written):
        lab.compare_arms(arms, run_dir=tmp_path, steps=1)
    assert _written(tmp_path / "arm")[name] == text


NOTEBOOK_CHOICES = [(n, t) for n, t in CHOICES if n in ("estimator", "reward")
                    and not _companions(n, t, Path("."))]


@pytest.mark.parametrize("name, text", NOTEBOOK_CHOICES,
                         ids=[f"{n}={t}" for n, t in NOTEBOOK_CHOICES])
def test_each_choice_reaches_config_json_from_run_p(until_config, tmp_path, name, text):
    """`run -p NAME TEXT`: read as the notebook's parameter (and its config field), and the
    notebook's config values build the TrainConfig the notebook makes."""
    values = check_parameters(NOTEBOOK, {name: text})
    assert values == {name: text}
    shared = config_values(notebook_parameters(NOTEBOOK), values)
    with pytest.raises(_Written):
        train(TrainConfig(**{**shared, "run_dir": str(tmp_path / "run")}))
    assert _written(tmp_path / "run")[name] == text


@pytest.mark.parametrize("name", ["estimator", "reward"])
def test_each_choice_reaches_config_json_from_a_sweep_yaml(until_config, tmp_path, name):
    texts = [t for n, t in NOTEBOOK_CHOICES if n == name]
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "choices", "notebook": str(NOTEBOOK),
                                    "grid": {name: texts}, "seeds": [0]}))
    sweep = load_sweep(path)
    runs = plan(sweep, tmp_path / "runs")
    assert [run.values[name] for run in runs] == texts
    params = notebook_parameters(NOTEBOOK)
    for i, run in enumerate(runs):
        shared = config_values(params, {**sweep.parameters, **run.values})
        with pytest.raises(_Written):
            train(TrainConfig(**{**shared, "run_dir": str(tmp_path / f"run{i}")}))
        assert _written(tmp_path / f"run{i}")[name] == run.values[name]


def test_diagnose_set_reads_values_as_train_does():
    from labkit.__main__ import config_fields

    got = config_fields([("estimator", "none"), ("scale", "none"), ("top_k", "none"),
                         ("share_prompt", "ON"), ("lr", "none"), ("run_dir", "none")],
                        lambda n: f"--set {n}")
    assert got == {"estimator": "none", "scale": "none", "top_k": None,
                   "share_prompt": True, "lr": None, "run_dir": None}
    with pytest.raises(ValueError, match="--set colour: not a TrainConfig field"):
        config_fields([("colour", "red")], lambda n: f"--set {n}")


@pytest.mark.parametrize("name", OPTIONAL)
def test_every_optional_field_takes_none_from_the_command_line(until_config, tmp_path, name):
    """`--FIELD none` is None (the field's own meaning of None) unless `none` is one of the
    field's choices (estimator), and the config.json says so."""
    with pytest.raises(_Written):
        in_process("train", "--run-dir", tmp_path / "run", f"--{name.replace('_', '-')}",
                   "none")
    written = _written(tmp_path / "run")[name]
    assert written == ("none" if name == "estimator" else
                       TrainConfig(**{name: None}).to_dict()[name])


def test_a_bad_value_names_the_option_the_type_and_the_text():
    for argv, words in ((["--top-k", "few"], "--top-k must be int or none, got 'few'"),
                        (["--lr", "fast"], "--lr must be float or none, got 'fast'"),
                        (["--dynamic-sampling", "maybe"], "--dynamic-sampling must be bool"),
                        (["--steps", "none"], "--steps must be int, got 'none'")):
        done = in_process("train", *argv)
        assert done.returncode == 2 and words in done.stderr, done.stderr


def test_train_estimator_none_trains_on_the_raw_rewards(tmp_path):
    """The acceptance run: `--estimator none` is the estimator none (not the algorithm's
    default), its advantages are the rewards themselves; `--report-to none` and every other
    optional field given `none` (`--top-k none`, `--value-clip none`, ...) run with it."""
    run = tmp_path / "run"
    nones = [arg for name in OPTIONAL if name != "estimator"
             for arg in (f"--{name.replace('_', '-')}", "none")]
    done = in_process("train", "--estimator", "none", "--report-to", "none", *nones,
                      "--steps", "2", "--batch-prompts", "4", "--group-size", "4",
                      "--eval-every", "2", "--eval-n", "16", "--eval-samples", "0",
                      "--cgc-prompts", "0", "--rollouts-every", "1", "--rollouts-groups", "4",
                      "--progress", "false", "--threads", "1", "--run-dir", run)
    assert done.returncode == 0, done.stderr
    config = _written(run)
    assert (config["estimator"], config["report_to"], config["top_k"]) == ("none", "none", None)
    assert {"top_k", "value_clip", "share_prompt", "model", "device"} <= set(OPTIONAL)
    # None takes the algorithm's (lr) or the task's value (digits, ... max_new_tokens)
    resolved = ("estimator", "lr", *TASK_SHAPES["other"])
    assert all(config[name] is None for name in OPTIONAL if name not in resolved)
    assert {name: config[name] for name in TASK_SHAPES["other"]} == TASK_SHAPES["other"]
    assert config["lr"] == TrainConfig().lr  # lr=None: the algorithm's own
    groups = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    completions = [c for g in groups for c in g["completions"]]
    assert len(completions) == 2 * 4 * 4
    rewards = [c["reward"] for c in completions]
    assert len(set(rewards)) > 1  # the check below could not tell a baseline from none
    assert [c["advantage"] for c in completions] == rewards
