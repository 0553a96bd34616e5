import json

import pytest
from cli import fresh_process as run
from cli import in_process


def test_eval_prints_figures_and_a_json_last_line():
    done = run("eval", "--n", "60", "--samples", "2", "--seed", "1", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/n", "wall_s"):
        assert key in result
    assert result["eval/n"] == 60
    assert 0.0 <= result["eval/pass@1"] <= result["eval/pass@2"] <= 1.0


@pytest.mark.parametrize("args, names", [
    (["--n", "0"], "--n"),
    (["--samples", "-1"], "--samples"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--model", "/no/such/model/folder"], "name_or_path"),
    (["--device", "cuda:7x"], "device"),
    (["--task", "gsm8k"], "--gsm8k-path"),
    (["--digits", "0"], "digits"),
])
def test_eval_bad_input_is_one_clear_line(args, names):
    done = in_process("eval", *args)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and names in lines[0], done.stderr


def test_unknown_command_is_rejected():
    done = in_process("fly")
    assert done.returncode == 2 and "invalid choice" in done.stderr


def test_train_help_lists_each_registry_and_literal_choice(capsys):
    """--help reads the choices from the registries and the Literals, not from a copy."""
    from labkit.__main__ import main
    from labkit.formulas import estimators, losses
    from labkit.problems import rewards

    with pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for registry in (estimators.ESTIMATORS, losses.AGG_MODES, rewards.REWARDS):
        assert all(f"{name}:" in text for name in registry), registry
    assert "Choices: grpo, ppo, dpo, rft." in text
    assert "Choices: auto, k1, k2, k3, abs, k1+, k3+, abs+, full." in text
    assert text.count("package.module:function") >= 4  # estimator, loss, agg, reward


@pytest.mark.parametrize("args, words", [
    (["--estimator", "ppo"], ["estimator must be one of ['grpo', 'dr_grpo', 'rloo', 'none'"]),
    (["--estimator", "gae"], ["estimator='gae' reads a critic's values", "algo='ppo'"]),
    (["--algo", "ppo", "--estimator", "rloo"], ["estimator='rloo' needs no critic",
                                                "algo='grpo'"]),
])
def test_train_rejects_an_unknown_or_misplaced_estimator_before_any_run(tmp_path, args, words):
    done = in_process("train", *args, "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert all(w in done.stderr for w in words), done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("reward, words", [
    ("accuracy", ["reward='accuracy'", "no reward", "strict", "package.module:function"]),
    ("correctness+0.3*", ["reward=", "expected a reward"]),
    ("correctness+x*format", ["reward=", "weight is a number"]),
    ("noisy(p=1.5)", ["reward=", "p", "[0, 1]"]),
    ("shaped(beta=0.1)", ["reward=", "shaped takes ['lam']"]),
])
def test_train_rejects_a_bad_reward_in_one_line_before_any_run(tmp_path, reward, words):
    done = in_process("train", "--reward", reward, "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "run").exists()


def test_train_help_shows_the_reward_grammar(capsys):
    from labkit.__main__ import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("shaped(lam=0.3)", "noisy(p=0.2)", "correctness+0.3*format", "strict:",
                  "package.module:function, called with the keywords prompts, completions"):
        assert words in text, words


def test_train_says_a_dead_run_in_its_last_json_line(tmp_path):
    """One-token completions never reach EOS: every step is dead, and with --dead-steps 2 the
    run stops at step 2 and its last JSON line says why."""
    done = run("train", "--steps", "5", "--max-new-tokens", "1", "--dead-steps", "2",
               "--batch-prompts", "2", "--group-size", "2", "--eval-n", "4", "--eval-samples",
               "0", "--cgc-prompts", "0", "--progress", "false", "--run-dir", str(tmp_path / "r"))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    dead = summary["dead_run"]
    assert summary["steps"] == 2 and (dead["first"], dead["step"]) == (1, 2) and dead["truncated"]
    assert summary["stopped"] == dead["message"] and dead["message"] in done.stderr
    assert json.loads((tmp_path / "r" / "dead_run.json").read_text()) == dead


def test_version_prints_the_installed_version():
    from importlib.metadata import version

    done = in_process("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"labkit {version('labkit')}"


def test_usage_lines_name_the_program_the_user_typed():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "labkit"  # the console script pip installed
    done = subprocess.run([str(script), "train", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: labkit train ")
    module = subprocess.run([sys.executable, "-m", "labkit", "sweep", "--no-such-flag"],
                            capture_output=True, text=True, timeout=120)
    assert module.returncode == 2
    assert module.stderr.startswith("error: python -m labkit sweep: the following arguments "
                                    "are required: experiment (see python -m labkit sweep")


def test_runs_terminal_summary_fits_100_columns_with_the_verdicts_first():
    from labkit.lab.commands import WIDTH, summary_table

    summary = {"description": "Two arms over three seeds, each on the same prompts. " * 5,
               "finding1/question": "rloo gains more held-out accuracy than grpo",
               "finding1/verdict": "inconclusive at this budget", "finding1/mean": 1.25,
               "finding1/low": -0.5, "finding1/high": 3.0,
               "finding2/question": "x" * 150, "finding2/verdict": "supported",
               "finding2/mean": 2.0}
    fields = ["accuracy_before", "accuracy_after", "gain", "final_reward", "step_s", "mem_mb",
              "state_mb", "wall_s", "kl", "entropy"]
    for arm in ("grpo", "reinforce++-baseline"):
        for seed in range(3):
            summary |= {f"{arm}/seed={seed}/{f}": 0.5 + seed for f in fields}
    lines = summary_table(summary).splitlines()
    assert max(map(len, lines)) <= WIDTH
    assert lines[0] == "inconclusive rloo gains more held-out accuracy than grpo: 1.25 [-0.5, 3]"
    assert lines[1].startswith("supported    xxx") and lines[1].endswith("...")
    header = next(line for line in lines if line.startswith("run "))
    assert header.split()[:3] == ["run", "accuracy_before", "accuracy_after"]
    assert "reinforce++-baseline/seed=2" in "\n".join(lines)
    assert lines[-1].startswith("(and ") and "more fields in summary.json" in lines[-1]


def test_eval_of_the_think_task_reports_the_answer_forms():
    done = run("eval", "--task", "think", "--n", "40", "--samples", "2", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["model"] == "tiny-arith-think"
    forms = result["forms"]
    assert forms["samples"] == 2 and 0 <= forms["worked"]["mean"] <= 1
    assert set(forms["by_difficulty"]) <= {"2", "3", "4", "5"}
    assert sum(row["draws"] for row in forms["by_difficulty"].values()) == 80


@pytest.mark.parametrize("command", ["train", "eval", "run", "sweep", "findings", "bench",
                                     "diagnose"])
def test_every_help_renders_its_percent_signs(command):
    """argparse formats help= strings (95%% -> 95%) but not a description: neither may show
    a doubled sign."""
    done = in_process(command, "--help")
    assert done.returncode == 0
    assert "%%" not in done.stdout
