"""Bad input never gets far: every TrainConfig field is checked when the config is made,
what it names on this machine (files, devices) by `preflight` before a run makes or loads
anything, and the command line (`train`, `eval`, `run`, `sweep`) turns a user error into one
`error:` line and exit code 2, before any run folder is made or any model loads."""

import json
import math
from pathlib import Path

import pytest
import yaml
from cli import fresh_process, in_process

from labkit.run.rundir import RunLock
from labkit.settings.config import TrainConfig
from labkit.settings.preflight import preflight

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TINY = HERE / "fixtures" / "tiny.ipynb"
NOTEBOOKS = REPO / "notebooks"
NAN, INF = float("nan"), float("inf")


# --- TrainConfig, in process -----------------------------------------------------------------

BAD_CONFIGS = [
    # (fields, the field the message must name, words of the rule it must state)
    (dict(group_size=1), "group_size", ">= 2"),
    (dict(lr=0.0), "lr", "> 0"),
    (dict(lr=NAN), "lr", "finite"),
    (dict(critic_lr=INF), "critic_lr", "finite"),
    (dict(temperature=0.0), "temperature", "> 0"),
    (dict(max_new_tokens=0), "max_new_tokens", ">= 1"),
    (dict(steps=2.5), "steps", "integer"),
    (dict(batch_prompts=True), "batch_prompts", "integer"),
    (dict(top_k=0), "top_k", ">= 1"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p="0.9"), "top_p", "finite number"),
    (dict(eps_low=1.0), "eps_low", "< 1"),
    (dict(eps_low=-0.1), "eps_low", "0 <= eps_low"),
    (dict(eps_high=INF), "eps_high", "finite"),
    (dict(eps_high=-0.2), "eps_high", ">= 0"),
    (dict(dual_clip=1.0), "dual_clip", "> 1"),
    (dict(dual_clip=NAN), "dual_clip", "finite"),
    (dict(value_clip=NAN), "value_clip", "finite"),
    (dict(value_clip=0.0), "value_clip", "> 0"),
    (dict(beta=-0.01), "beta", ">= 0"),
    (dict(entropy_coef=INF), "entropy_coef", "finite"),
    (dict(gamma=1.5), "gamma", "[0, 1]"),
    (dict(lam=NAN), "lam", "finite"),
    (dict(min_lr_ratio=-0.1), "min_lr_ratio", "[0, 1]"),
    (dict(algo="a2c"), "algo", "'grpo', 'ppo', 'dpo', 'rft'"),
    (dict(agg="mean"), "agg", "token-mean"),
    (dict(estimator="ppo"), "estimator", "rloo"),
    (dict(kl_kind="k4"), "kl_kind", "k3"),
    (dict(precision="fp16"), "precision", "bf16"),
    (dict(schedule="linear"), "schedule", "cosine"),
    (dict(scale="prompt"), "scale", "batch"),
    (dict(ratio_level="seq"), "ratio_level", "sequence"),
    (dict(dynamic_sampling="false"), "dynamic_sampling", "True or False"),
    (dict(progress=1), "progress", "True or False"),
    (dict(device="gpu"), "device", "'cuda:N'"),
    (dict(model=5), "model", "string"),
    (dict(task="gsm8k"), "gsm8k_path", "required"),
    (dict(gsm8k_path="/no/such/gsm8k.jsonl"), "gsm8k_path", "task='gsm8k'"),
    (dict(digits=10), "digits", "between 1 and 9"),
    (dict(operands=1), "operands", "between 2 and 8"),
    (dict(ops="/"), "ops", "'+', '-', '*'"),
    (dict(operands=3, min_operands=4), "min_operands", "between 2 and operands=3"),
    (dict(scratchpad=True, digits=1, operands=5, min_operands=2), "max_new_tokens", ">= 43"),
    (dict(scratchpad=True, task="gsm8k", gsm8k_path="x.jsonl"), "scratchpad", "arithmetic"),
    (dict(task="think", max_new_tokens=40), "max_new_tokens", ">= 43"),
    (dict(task="think", scratchpad=True), "scratchpad", "policy"),
    (dict(task="think", digits=0), "digits", ">= 1"),
    (dict(digits=1), "eval_n", "held-out"),
    (dict(seed=2**40), "seed", "2**32"),
    (dict(seed="0"), "seed", "integer"),
    (dict(minibatches=3), "minibatches", "divide"),
    (dict(grad_accum=3), "grad_accum", "divide"),
    (dict(reinforce=True, num_iterations=2), "reinforce", "num_iterations=1"),
    (dict(algo="ppo", dynamic_sampling=True), "dynamic_sampling", "grpo"),
    (dict(stop_rules="adv/gvv>0.45 for 5"), "stop_rules", "adv/gav"),
    (dict(stop_rules="adv/gav >> 0.45"), "stop_rules", "METRIC OP NUMBER"),
    (dict(stop_rules="adv/gav>high"), "stop_rules", "finite number"),
    (dict(stop_rules="adv/gav>0.45 for 0"), "stop_rules", "COUNT >= 1"),
    (dict(stop_rules="policy/kl>0.5"), "stop_rules", "beta > 0"),
    (dict(stop_rules="value/clipfrac>0.5"), "stop_rules", "algo='ppo'"),
    (dict(stop_rules=["adv/gav>0.45"]), "stop_rules", "string"),
    (dict(estimator="no_such_module:fn"), "estimator", "cannot import"),
    (dict(agg="labkit.formulas.losses:kl"), "agg", "signature"),
    (dict(reward="labkit.problems.rewards:PARSE_TIMEOUT"), "reward", "not a function"),
    (dict(reward="accuracy"), "reward", "correctness"),
    (dict(reward="correctness+abc*format"), "reward", "weight is a number"),
    (dict(reward="correctness+0*format"), "reward", "non-zero"),
    (dict(reward="noisy(p=1.5)"), "reward", "[0, 1]"),
    (dict(reward="noisy"), "reward", "noisy(p=0.2)"),
    (dict(reward="shaped(lam=-1)"), "reward", "lam"),
    (dict(reward=[("correctness", 1.0), ("format", math.inf)]), "reward", "finite"),
    (dict(reward="labkit.problems.rewards:completion_text"), "reward", "signature"),
    (dict(share_prompt="auto"), "share_prompt", "True, False or None"),
]

# what a config names that this machine may lack: `preflight` asks, the config does not
BAD_ON_THIS_MACHINE = [
    (dict(device="cuda:99"), "device", "cuda"),
    (dict(model="./no/such/model"), "model", "config.json"),
    (dict(task="gsm8k", gsm8k_path="/no/such/gsm8k.jsonl"), "gsm8k_path", "not a file"),
]


@pytest.mark.parametrize("fields, name, rule", BAD_CONFIGS,
                         ids=[f"{n}={f[n] if n in f else next(iter(f.values()))!r}"
                              for f, n, _ in BAD_CONFIGS])
def test_a_bad_field_is_named_with_its_rule(fields, name, rule):
    with pytest.raises(ValueError) as e:
        TrainConfig(**fields)
    assert name in str(e.value) and rule in str(e.value), str(e.value)


@pytest.mark.parametrize("fields, name, rule", BAD_ON_THIS_MACHINE,
                         ids=[f"{n}={f[n]!r}" for f, n, _ in BAD_ON_THIS_MACHINE])
def test_preflight_names_what_this_machine_lacks(fields, name, rule):
    config = TrainConfig(**fields)  # a config read back on resume is not probed
    with pytest.raises(ValueError) as e:
        preflight(config)
    assert name in str(e.value) and rule in str(e.value), str(e.value)


def test_preflight_passes_what_is_there(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for fields in (dict(), dict(device="cpu"), dict(run_dir=str(tmp_path / "new" / "run")),
                   dict(task="gsm8k", gsm8k_path=str(data)), dict(model=str(model)),
                   dict(model="org/name")):
        preflight(TrainConfig(**fields))


def test_run_dir_that_is_a_file_or_inside_one_is_refused(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("not a folder")
    for run_dir, words in ((afile, "is a file"), (afile / "run", "cannot be made")):
        config = TrainConfig(run_dir=str(run_dir))
        with pytest.raises(ValueError, match="run_dir") as e:
            preflight(config)
        assert words in str(e.value)


def test_a_fresh_training_run_is_preflighted_before_it_makes_anything(tmp_path, monkeypatch):
    import labkit.trainer

    def refuse(*args, **kwargs):
        raise AssertionError("a run folder was claimed")

    monkeypatch.setattr(labkit.trainer.rundir, "claim_run_dir", refuse)
    config = TrainConfig(model=str(tmp_path / "missing"), run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="model=.*no saved model"):
        labkit.trainer.train(config)


def test_unknown_fields_of_a_saved_config_list_the_valid_ones():
    with pytest.raises(ValueError, match="unknown config field.*'group_sise'.*group_size"):
        TrainConfig.from_dict({"group_sise": 4})


def test_a_saved_config_from_before_the_fast_field_was_named_reads_lean_as_fast():
    assert TrainConfig.from_dict({"lean": False, "seed": 3}) == TrainConfig(fast=False, seed=3)
    assert TrainConfig.from_dict({"lean": True}).fast is True
    with pytest.raises(ValueError, match="fast must be"):
        TrainConfig.from_dict({"lean": "no"})


@pytest.mark.parametrize("fields", [
    dict(seed=-7), dict(model="org/name"), dict(device="cpu"), dict(algo="ppo", group_size=1),
    dict(stop_rules="adv/gav>0.45 for 5; rollout/reward_mean >= 0.99"),
    dict(stop_rules=" ; eval/pass@1<0.01 for 2 ;"), dict(stop_rules="eval/pass@4<0.1"),
    dict(beta=0.04, stop_rules="policy/kl>0.5"), dict(dual_clip=3.0, value_clip=None),
    dict(digits=1, eval_n=8), dict(estimator="labkit.formulas.estimators:rloo_estimator"),
    dict(agg="labkit.formulas.losses:token_mean"), dict(reward="labkit.problems.rewards:format_reward"),
    dict(reward="strict"), dict(reward="correctness+0.3*format"), dict(reward="shaped(lam=0.5)"),
    dict(reward="noisy(strict, p=0.1)"),
], ids=str)
def test_good_fields_still_pass(fields):
    config = TrainConfig(**fields)
    assert all(getattr(config, k) == v for k, v in fields.items())


def test_scratchpad_loads_the_embedded_scratchpad_model_unless_a_model_is_named():
    from labkit.settings.embedded import SCRATCHPAD_NAME

    fields = dict(scratchpad=True, digits=1, operands=5, min_operands=2, max_new_tokens=48)
    assert TrainConfig(**fields).model == SCRATCHPAD_NAME
    assert TrainConfig(**fields, model="tiny-arith").model == "tiny-arith"
    assert TrainConfig().model is None and not TrainConfig().scratchpad


def test_the_think_task_brings_its_model_and_shape_unless_given():
    from labkit.settings.defaults import TASK_SHAPES
    from labkit.settings.embedded import THINK_NAME

    config = TrainConfig(task="think")
    assert config.model == THINK_NAME
    assert (config.digits, config.operands, config.min_operands, config.max_new_tokens) == \
        (1, 5, 2, 48)
    given = TrainConfig(task="think", operands=4, max_new_tokens=64, model="tiny-arith")
    assert (given.operands, given.max_new_tokens, given.model, given.digits) == \
        (4, 64, "tiny-arith", 1)
    plain = TrainConfig()
    assert {k: getattr(plain, k) for k in TASK_SHAPES["other"]} == TASK_SHAPES["other"]
    assert plain.model is None


def test_a_list_of_reward_pairs_is_stored_as_its_sum():
    config = TrainConfig(reward=[("correctness", 1), ("format", 0.3)])
    assert config.reward == "correctness+0.3*format"
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("stem", ["01_grpo_vs_ppo", "02_group_size_sweep",
                                  "03_advantage_variance_live"])
def test_a_notebooks_reward_is_checked_before_a_kernel_starts(stem):
    from labkit.lab.runner import check_parameters

    notebook = NOTEBOOKS / f"{stem}.ipynb"
    assert check_parameters(notebook, {"reward": "noisy(p=0.2)"}) == {"reward": "noisy(p=0.2)"}
    with pytest.raises(ValueError) as e:
        check_parameters(notebook, {"reward": "noisy(p=2)"})
    assert all(w in str(e.value) for w in (f"{stem}.ipynb", "reward", "[0, 1]")), str(e.value)


def test_a_pass_at_k_rule_needs_that_k_to_be_logged():
    with pytest.raises(ValueError, match="stop_rules.*eval_samples"):
        TrainConfig(stop_rules="eval/pass@8<0.1", eval_samples=4)


# --- the command line, in real processes ------------------------------------------------------

def labkit(*args, cwd):
    return fresh_process(*args, cwd=cwd)


def one_error_line(done) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def write_sweep(tmp_path, notebook: Path, **spec) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"notebook": str(notebook), "name": "s", **spec}))
    return path


def a_file(tmp_path) -> Path:
    path = tmp_path / "afile"
    path.write_text("x")
    return path


def broken_run(tmp_path) -> Path:
    path = tmp_path / "broken-run"
    path.mkdir()
    (path / "config.json").write_text("{not json")
    return path


def bad_yaml(tmp_path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text("notebook: [unclosed\n")
    return path


# (id, the arguments given tmp_path, words the error line must hold); each is distinct from
# the bad command lines tests/test_cli.py, test_trainer.py and test_runner.py already run
CLI_CASES = [
    ("train-stop-rules", lambda t: ["train", "--stop-rules", "adv/gvv>0.45 for 5"],
     ["stop_rules", "adv/gvv", "adv/gav"]),
    ("train-temperature-nan", lambda t: ["train", "--temperature", "nan"],
     ["temperature", "finite"]),
    ("train-run-dir-file", lambda t: ["train", "--run-dir", a_file(t)], ["run_dir", "is a file"]),
    ("train-unknown-option", lambda t: ["train", "--colour", "red"],
     ["unrecognized arguments", "--colour"]),
    ("train-resume-broken", lambda t: ["train", "--resume", broken_run(t)],
     ["config.json", "not a labkit run config"]),
    ("eval-batch-size", lambda t: ["eval", "--batch-size", "0"], ["--batch-size", ">= 1"]),
    ("eval-digits-text", lambda t: ["eval", "--digits", "two"],
     ["--digits", "invalid int value"]),
    ("run-group-size", lambda t: ["run", NOTEBOOKS / "01_grpo_vs_ppo.ipynb", "-p", "group_size",
                                  "1", "--root", t / "runs"],
     ["group_size", ">= 2", "01_grpo_vs_ppo.ipynb"]),
    ("run-estimator", lambda t: ["run", NOTEBOOKS / "03_advantage_variance_live.ipynb", "-p",
                                 "estimator", "ppo", "--root", t / "runs"],
     ["estimator", "rloo"]),
    ("run-reward", lambda t: ["run", NOTEBOOKS / "01_grpo_vs_ppo.ipynb", "-p", "reward",
                              "correctness+x*format", "--root", t / "runs"],
     ["01_grpo_vs_ppo.ipynb", "reward", "weight"]),
    ("run-missing-value", lambda t: ["run", TINY, "-p", "label"], ["-p", "expected 2 arguments"]),
    ("sweep-bad-yaml", lambda t: ["sweep", bad_yaml(t), "--root", t / "runs"],
     ["bad.yaml", "not valid YAML"]),
    ("sweep-bad-grid", lambda t: ["sweep", write_sweep(t, NOTEBOOKS / "01_grpo_vs_ppo.ipynb",
                                                       grid={"lr": [0.001, -0.001]}),
                                  "--root", t / "runs"], ["lr", "> 0"]),
]


FRESH = {"train-unknown-option", "eval-batch-size", "run-group-size", "sweep-bad-grid"}


@pytest.mark.parametrize("make_args, words", [c[1:] for c in CLI_CASES],
                         ids=[c[0] for c in CLI_CASES])
def test_command_line_errors_are_one_line_before_any_run(request, tmp_path, make_args, words):
    """A bad command line: one `error:` line naming the culprit, exit 2, and no run folder
    anywhere (so no model loaded: a run claims its folder first). One case of each command
    runs in a fresh process, the rest in this one."""
    fresh = request.node.callspec.id in FRESH
    done = (labkit if fresh else in_process)(*make_args(tmp_path), cwd=tmp_path)
    line = one_error_line(done)
    assert all(str(w) in line for w in words), line
    assert not (tmp_path / "experiments").exists() and not (tmp_path / "runs").exists()


def test_resuming_a_run_that_is_still_running_is_refused(tmp_path):
    run_dir = tmp_path / "busy"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"config": {}}))
    with RunLock(run_dir):  # as a live run holds it
        done = labkit("train", "--resume", run_dir, cwd=tmp_path)
    line = one_error_line(done)
    assert "in use by another run" in line and str(run_dir) in line


def test_eval_checks_before_loading_a_model(monkeypatch, capsys):
    """In process, with model loading forbidden: the checks come first."""
    import labkit.model.models
    from labkit.__main__ import main

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(labkit.model.models, "load", refuse)
    for args, word in ((["--batch-size", "0"], "--batch-size"), (["--n", "-3"], "--n"),
                       (["--device", "tpu"], "device"), (["--operands", "9"], "operands")):
        assert main(["eval", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and word in err, err


def test_sweep_checks_every_grid_point_against_the_config_rules(tmp_path):
    from labkit.lab import sweeps

    path = write_sweep(tmp_path, NOTEBOOKS / "01_grpo_vs_ppo.ipynb",
                       grid={"batch_prompts": [8, 6], "group_size": [4, 1]})
    with pytest.raises(ValueError, match=r"01_grpo_vs_ppo.ipynb with .*group_size=1.*"
                                         r"group_size must be >= 2"):
        sweeps.load_sweep(path)
    # names that only look like config fields (another type) are the notebook's business
    assert sweeps.load_sweep(write_sweep(tmp_path, TINY, parameters={"scale": 0.5},
                                         grid={"steps": [1, 2]})).grid == {"steps": [1, 2]}


def test_non_finite_values_parse_but_do_not_pass():
    """`--lr inf` reads as a float; the config is what refuses it."""
    from labkit.settings.fields import parse_field

    assert math.isinf(parse_field(TrainConfig, "lr", "inf"))
    with pytest.raises(ValueError, match="lr must be a finite number"):
        TrainConfig(lr=parse_field(TrainConfig, "lr", "inf"))


def test_every_field_has_a_docstring_for_the_help():
    from dataclasses import fields

    from labkit.settings.config import field_docs

    docs = field_docs()
    assert [f.name for f in fields(TrainConfig) if not docs.get(f.name)] == []
    assert "METRIC OP NUMBER [for COUNT]" in docs["stop_rules"]
