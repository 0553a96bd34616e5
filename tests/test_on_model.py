"""The lab on a user's model: every training notebook takes a model folder (a random Qwen2,
Llama or GPT-2 with its own BPE tokenizer, made offline), its runs record that folder and
write that folder's tokens; a size profile fills what the user leaves and yields to what
they set; bad input is one `error:` line naming the parameter before any run starts."""

import json
from pathlib import Path

import pytest

from labkit.__main__ import main
from labkit.lab import model_params
from labkit.lab.runner import run_notebook
from model_folders import save_random

REPO = Path(__file__).resolve().parents[1]
TINY = {"steps": "2", "batch_prompts": "2", "group_size": "2", "eval_every": "2",
        "eval_n": "4"}
"""Sizes every notebook run here shares (each notebook takes those it declares)."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: save_random(root / arch, arch) for arch in ("qwen2", "llama", "gpt2")}


def vocabulary(folder: Path) -> set[str]:
    """Each token of the folder's tokenizer as the rollout log writes it (decoded alone)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return {tokenizer.decode([i]) for i in range(len(tokenizer))}


def tokens_written(run_dir: Path) -> set[str]:
    out = set()
    for log in run_dir.rglob("rollouts.jsonl"):
        for line in log.read_text().splitlines():
            for completion in json.loads(line)["completions"]:
                out |= set(completion["tokens"])
    return out


NOTEBOOK_RUNS = [
    ("01_grpo_vs_ppo", "qwen2", {**TINY, "seeds": "1", "workers": "1", "algos": "grpo,ppo",
                                 "max_new_tokens": "4"}),
    ("01_grpo_vs_ppo", "llama", {**TINY, "seeds": "1", "workers": "1", "algos": "grpo",
                                 "max_new_tokens": "4"}),
    ("01_grpo_vs_ppo", "gpt2", {**TINY, "seeds": "1", "workers": "1", "algos": "grpo",
                                "max_new_tokens": "4"}),
    ("02_group_size_sweep", "qwen2", {"steps": "2", "eval_every": "2", "eval_n": "4",
                                      "seeds": "1", "workers": "1", "group_sizes": "2",
                                      "samples_per_step": "4",
                                      "extra": "max_new_tokens=4"}),
    ("03_advantage_variance_live", "qwen2", {"steps": "2", "batch_prompts": "2",
                                             "group_size": "2", "eval_n": "4",
                                             "diag_every": "2", "diag_prompts": "2",
                                             "diag_batches": "3", "diag_samples": "4",
                                             "extra": "max_new_tokens=4"}),
    ("05_arms", "qwen2", {**TINY, "seeds": "2", "workers": "1",
                          "arms": "a: estimator=grpo; b: estimator=rloo",
                          "extra": "max_new_tokens=4"}),
    ("06_learns_to_think", "qwen2", {**TINY, "critic_steps": "1", "look_prompts": "1",
                                     "look_samples": "2", "extra": "max_new_tokens=6"}),
]


@pytest.mark.parametrize("stem, arch, sizes", NOTEBOOK_RUNS,
                         ids=[f"{s}-{a}" for s, a, _ in NOTEBOOK_RUNS])
def test_a_notebook_runs_on_a_model_folder_and_writes_its_tokens(stem, arch, sizes, folders,
                                                                 tmp_path):
    folder = folders[arch]
    run_dir = run_notebook(REPO / "notebooks" / f"{stem}.ipynb",
                           {**sizes, "model": str(folder), "run_dir": str(tmp_path / "run")},
                           progress=False)
    records = [json.loads(p.read_text()) for p in run_dir.rglob("config.json")]
    configs = [r["config"] for r in records if "config" in r]  # not a checkpoint's HF config
    assert configs and all(c["model"] == str(folder) for c in configs)
    written, known = tokens_written(run_dir), vocabulary(folder)
    assert written and written <= known
    assert any(len(t.strip()) > 1 for t in written), "a BPE merge only this folder has"


def test_notebook_00_shows_the_blocks_on_the_folders_tokens(folders, tmp_path):
    folder = folders["qwen2"]
    run_dir = run_notebook(REPO / "notebooks" / "00_building_blocks.ipynb",
                           {"model": str(folder), "run_dir": str(tmp_path / "run"),
                            "max_new_tokens": "6"}, progress=False)
    book = json.loads((run_dir / "notebook.ipynb").read_text())
    shown = "".join(str(o.get("data", {}).get("text/html", "")) + "".join(o.get("text", []))
                    for c in book["cells"] for o in c.get("outputs", []))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    merged = [t for t in (tokenizer.decode([i]) for i in range(len(tokenizer)))
              if len(t.strip()) > 1 and t.strip() in shown]
    assert merged  # the completions table shows text made of this folder's merges


def test_a_profile_fills_what_you_leave_and_yields_to_what_you_set(capsys):
    defaults = model_params.notebook_defaults("01_grpo_vs_ppo")
    given = {k: defaults[k] for k in ("steps", "batch_prompts", "group_size", "max_new_tokens",
                                      "lr", "beta", "num_iterations", "eval_every", "eval_n")}
    plain = model_params.fields("01_grpo_vs_ppo", given, check=False)
    assert plain == given  # no profile: the notebook's own sizes
    llm = model_params.fields("01_grpo_vs_ppo", given, profile="llm", check=False)
    assert {k: llm[k] for k in ("max_new_tokens", "group_size", "lr", "num_iterations",
                                "beta", "eval_n")} == {
        "max_new_tokens": 256, "group_size": 8, "lr": 1e-6, "num_iterations": 1,
        "beta": 0.04, "eval_n": 200}
    assert llm["steps"] == defaults["steps"]  # a field the profile leaves
    said = capsys.readouterr().out
    assert said.startswith("profile llm: max_new_tokens=256, group_size=8, batch_prompts=16, "
                           "lr=1e-06")
    mine = model_params.fields("01_grpo_vs_ppo", {**given, "lr": 5e-6}, profile="llm",
                               extra="beta=0.1, max_new_tokens=64", check=False)
    assert (mine["lr"], mine["beta"], mine["max_new_tokens"]) == (5e-6, 0.1, 64)
    assert mine["group_size"] == 8
    assert "yours kept: beta, lr, max_new_tokens" in capsys.readouterr().out
    owned = model_params.fields("02_group_size_sweep", {"steps": 10}, profile="llm",
                                owned=("group_size", "batch_prompts"), check=False)
    assert "group_size" not in owned and owned["max_new_tokens"] == 256
    with pytest.raises(ValueError, match="profile='big': valid profiles"):
        model_params.fields("01_grpo_vs_ppo", given, profile="big", check=False)


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[dict, str]]:
    not_lm = tmp_path / "encoder"
    not_lm.mkdir()
    (not_lm / "config.json").write_text(json.dumps({"model_type": "t5"}))
    no_answer = tmp_path / "gsm8k.jsonl"
    no_answer.write_text(json.dumps({"question": "1+1?", "solution": "#### 2"}) + "\n")
    return {
        "unknown model": ({"model": str(tmp_path / "no-such-model")},
                          r"model='.*no-such-model': no saved model there"),
        "not a causal LM": ({"model": str(not_lm)},
                            r"model='.*encoder': its config.json names model_type 't5', "
                            "not a causal LM"),
        "gsm8k without its file": ({"task": "gsm8k"}, "gsm8k_path is required with "
                                                      "task='gsm8k'"),
        "no answer column": ({"task": "gsm8k", "gsm8k_path": str(no_answer)},
                             r"gsm8k_path='.*gsm8k.jsonl': a GSM8K file has question and "
                             "answer columns; this one lacks answer"),
    }


@pytest.mark.parametrize("case", ["unknown model", "not a causal LM", "gsm8k without its file",
                                  "no answer column"])
def test_bad_input_is_one_error_line_before_any_run_from_a_notebook_as_from_train(
        case, tmp_path, capsys):
    given, match = _bad_inputs(tmp_path)[case]
    import re

    run_dir = tmp_path / "run"
    with pytest.raises(ValueError) as e:
        run_notebook(REPO / "notebooks" / "01_grpo_vs_ppo.ipynb",
                     {**given, "run_dir": str(run_dir)}, progress=False)
    assert re.search(match, str(e.value)) and "\n" not in str(e.value)
    assert not run_dir.exists()  # before any folder or kernel
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in given.items()]
    assert main(["train", *argv, f"--run-dir={tmp_path / 'train'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and re.search(match, err)
    assert not (tmp_path / "train").exists()


def test_chat_template_false_feeds_the_raw_prompt(folders, tmp_path):
    """A folder whose tokenizer has a chat template: the trainer's prompts go through it by
    default (the tokens fed start with the template's marker) and not with
    chat_template=false."""
    import shutil

    from transformers import AutoTokenizer

    from labkit.model.rollout import encode_prompts
    from labkit.settings.config import TrainConfig
    from labkit.trainer import Trainer

    folder = tmp_path / "chat"
    shutil.copytree(folders["qwen2"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = "{% for m in messages %}USER: {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(folder)
    fed = {}
    for flag in (True, False):
        trainer = Trainer(TrainConfig(model=str(folder), chat_template=flag, steps=1,
                                      batch_prompts=2, group_size=2, eval_n=2,
                                      run_dir=str(tmp_path / f"run-{flag}")))
        ids, mask = encode_prompts(trainer.tokenizer, ["8+29="])
        fed[flag] = trainer.tokenizer.decode(ids[0][mask[0].bool()])
    assert fed[True].startswith("USER: 8+29=") and fed[False] == "8+29="


def test_a_model_off_the_fast_path_says_so_in_one_line(folders, capsys):
    from labkit.model.learner import say_slow_path
    from labkit.model.models import load

    for arch, slow in (("qwen2", False), ("gpt2", True)):
        model, _ = load(str(folders[arch]), device="cpu")
        capsys.readouterr()  # the loader's own progress
        say_slow_path(str(folders[arch]), model)
        err = capsys.readouterr().err
        assert bool(err) == slow
    assert "runs its own forward, not labkit.fast's: model_type 'gpt2'" in err
    assert len(err.strip().splitlines()) == 1


def test_the_claims_run_on_a_model_folder_on_a_page_of_their_own(folders, tmp_path):
    """findings --all --set model=DIR --set task=gsm8k ... (smoke sizes): the claims run on
    that folder into a runs root of their own and a page titled with the model and task; a
    claim about the think task, or one whose settings are the arithmetic's, is listed with
    its reason; the project's own page is untouched."""
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text("".join(json.dumps({"question": f"What is {a} plus {a + 3}?",
                                         "answer": f"{a}+{a + 3}={2 * a + 3}\n#### {2 * a + 3}"})
                             + "\n" for a in range(40)))
    page = REPO / "docs" / "findings.md"
    before = page.read_text()
    root = tmp_path / "runs"
    assert main(["findings", "--all", "--smoke", "--only", "06_reward_accuracy,11_think",
                 "--set", f"model={folders['qwen2']}", "--set", "task=gsm8k",
                 "--set", f"gsm8k_path={gsm8k}", "--root", str(root), "--no-figures"]) == 0
    assert page.read_text() == before
    text = (root / "findings.md").read_text()
    assert text.startswith(f"# Findings on model {folders['qwen2']}, task gsm8k\n")
    rows = {line.split(".")[0].lstrip("| "): line for line in
            text.split("## Every finding")[0].splitlines() if line.startswith("| ") and
            line[2].isdigit()}
    assert "not measured yet" not in rows["6"] and "**not run here**" not in rows["6"]
    for claim in ("11", "12", "13"):
        assert "**not run here**: its runs set task=think themselves" in rows[claim]
    assert "**not run here**: its own settings do not hold there: scratchpad=True is for " \
           "task='arithmetic'" in text  # claim 5's row: 05_length_rate's scratchpad
    configs = [json.loads(p.read_text())["config"] for p in root.rglob("config.json")
               if "config" in json.loads(p.read_text())]
    assert configs and {c["model"] for c in configs} == {str(folders["qwen2"])}
    assert {c["task"] for c in configs} == {"gsm8k"}
    assert main(["findings", "--set", "nonsense"]) == 2  # FIELD=VALUE of a field
    on = f"model={folders['qwen2']}, task=gsm8k, gsm8k_path={gsm8k}"  # notebook 04 reads them
    read = run_notebook(REPO / "notebooks" / "04_claims.ipynb",
                        {"on": on, "runs_root": str(root), "smoke": "true",
                         "run_dir": str(tmp_path / "04")}, progress=False)
    summary = json.loads((read / "summary.json").read_text())
    assert summary["claims_run"] == 1 and summary["not run here"] >= 3


def test_the_gpu_checks_figures_read_each_algorithms_steps(tmp_path, capsys):
    """scripts/gpu_check.sh's notebook figures: per run, medians of step time and tokens per
    second after the first step, and the largest memory peak."""
    from labkit.bench import notebook_figures

    lines = [{"run": run, "step": k, "perf/step_s": s, "perf/tokens_per_s": t,
              "perf/mem_mb": m}
             for run, steps in (("grpo", [(9.0, 10, 900), (1.0, 300, 500), (3.0, 100, 700),
                                           (2.0, 200, 600)]),
                                ("ppo", [(5.0, 50, 1000), (4.0, 60, 1200)]))
             for k, (s, t, m) in enumerate(steps, 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines
                                                    + [{"run": "grpo", "step": 4,
                                                        "eval/accuracy": 0.5}]))
    rows = {r["run"]: r for r in notebook_figures.figures(tmp_path)}
    assert rows["grpo"] == {"run": "grpo", "steps": 4, "step_s": 2.0, "tokens_per_s": 200,
                            "peak_mb": 900}
    assert rows["ppo"]["step_s"] == 4.0 and rows["ppo"]["peak_mb"] == 1200
    assert notebook_figures.main([str(tmp_path)]) == 0
    assert "grpo" in capsys.readouterr().out
    assert notebook_figures.main([str(tmp_path / "none")]) == 2
