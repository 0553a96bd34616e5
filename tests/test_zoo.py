import json
import math

import pytest
import torch

from labkit.model.models import load
from labkit.probes.evaluation import evaluate
from labkit.problems.tasks import DEFAULT_TASK
from labkit.settings.embedded import EMBEDDED_PATH
from labkit.zoo import Recipe, build, build_tokenizer, sft_batch, train

SMALL = dict(max_steps=6, eval_every=3, target=1.0, dev_size=8, test_size=16, test_samples=2,
             warmup_steps=2, batch_size=16)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_recipe_is_deterministic_for_a_seed():
    a, _, log_a = train(Recipe(seed=3, **SMALL), progress=False)
    b, _, log_b = train(Recipe(seed=3, **SMALL), progress=False)
    c, _, _ = train(Recipe(seed=4, **SMALL), progress=False)
    sa, sb, sc = _state(a), _state(b), _state(c)
    assert log_a == log_b
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=0)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa), "another seed gave the same weights"


def test_training_lowers_the_loss():
    recipe = Recipe(seed=0, **{**SMALL, "max_steps": 30, "eval_every": 15})
    _, _, log = train(recipe, progress=False)
    first, last = log["curve"][0]["loss"], log["curve"][-1]["loss"]
    assert last < first


def test_sft_batch_labels_only_the_target():
    tokenizer = build_tokenizer()
    problems = DEFAULT_TASK.sample(3, "train", seed=0)
    batch = sft_batch(tokenizer, problems)
    for row, p in enumerate(problems):
        labels = batch["labels"][row]
        kept = labels[labels != -100].tolist()
        assert kept == tokenizer(p.target, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        n = batch["attention_mask"][row].sum().item()
        assert n == len(tokenizer(p.prompt).input_ids) + len(kept)


def test_build_writes_a_loadable_model_and_card(tmp_path):
    card = build(tmp_path, Recipe(seed=1, **SMALL), progress=False)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "card.json", "README.md"):
        assert (tmp_path / name).is_file(), name
    assert json.loads((tmp_path / "card.json").read_text())["held_out"] == card["held_out"]
    assert f"{card['held_out']['eval/accuracy']:.3f}" in (tmp_path / "README.md").read_text()
    model, tokenizer = load(tmp_path, device="cpu")
    assert model.config.num_hidden_layers == 2 and len(tokenizer) == model.config.vocab_size


@pytest.mark.parametrize("field, value", [
    ("target", 0.0), ("target", 1.5), ("lr", 0.0), ("batch_size", 0), ("num_heads", 3),
    ("max_steps", 0),
])
def test_recipe_rejects_bad_values_by_name(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        Recipe(**{field: value})


def test_build_command_rejects_bad_recipe(capsys):
    from labkit.zoo.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["build", "--out", "/tmp/never-written", "--target", "2"])
    assert exit_info.value.code == 2
    assert "target" in capsys.readouterr().err


def test_embedded_model_leaves_room_for_rl(tiny):
    """Greedy accuracy and sampled pass@1 (T=1) on 800 held-out problems lie in 15-60%."""
    model, tokenizer = tiny
    problems = DEFAULT_TASK.sample(800, "test", seed=123, distinct=True)
    figures = evaluate(model, tokenizer, problems, samples=2, seed=123)
    assert 0.15 <= figures["eval/accuracy"] <= 0.60, figures
    assert 0.15 <= figures["eval/pass@1"] <= 0.60, figures
    card = json.loads((EMBEDDED_PATH / "card.json").read_text())
    assert card["parameters"] == sum(p.numel() for p in model.parameters())


@pytest.mark.filterwarnings("ignore::FutureWarning")  # deprecations inside TRL/transformers
def test_trl_grpo_trainer_accepts_the_embedded_model_path(tmp_path):
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    from labkit.problems.rewards import correctness

    data = datasets.Dataset.from_list(
        [p.to_record() for p in DEFAULT_TASK.sample(8, "train", seed=0)])
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=12, max_steps=1, learning_rate=1e-3, report_to="none",
        use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, logging_steps=1)
    trainer = trl.GRPOTrainer(model=str(EMBEDDED_PATH), reward_funcs=correctness, args=args,
                              train_dataset=data)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert 0.0 <= logged["reward"] <= 1.0
    assert math.isfinite(logged["loss"])
    assert logged["completions/mean_length"] > 0


def test_the_scratchpad_preset_builds_on_worked_solutions(tmp_path, capsys):
    from labkit.zoo import PRESETS
    from labkit.zoo.__main__ import main

    recipe = Recipe(**PRESETS["tiny-arith-scratchpad"], **SMALL)
    task = recipe.task()
    assert task.scratchpad and task.counts == (2, 3, 4, 5)
    assert recipe.max_new_tokens() >= len(task.longest_target()) + 1
    card = build(tmp_path, recipe, progress=False, name="tiny-arith-scratchpad")
    assert card["task"]["min_operands"] == 2 and card["name"] == "tiny-arith-scratchpad"
    readme = (tmp_path / "README.md").read_text()
    assert "--preset tiny-arith-scratchpad" in readme and "2 to 5 numbers" in readme
    with pytest.raises(SystemExit):
        main(["build", "--preset", "tiny-arith-scratchpad", "--scratchpad", "maybe"])
    assert "true or false" in capsys.readouterr().err


def test_the_think_preset_mixes_forms_and_its_card_measures_them(tmp_path):
    from labkit.zoo import PRESETS

    recipe = Recipe(**{**PRESETS["tiny-arith-think"], **SMALL})
    assert recipe.task().worked == 0.5 and not recipe.task().scratchpad
    card = build(tmp_path, recipe, progress=False, name="tiny-arith-think")
    forms = card["forms"]
    assert sum(row["draws"] for row in forms["by_difficulty"].values()) == 16 * 8
    readme = (tmp_path / "README.md").read_text()
    assert "--preset tiny-arith-think" in readme and "Answer forms" in readme
    assert f"{forms['worked']['mean']:.3f}" in readme


def _card(share, gap_low, pass1=0.4, greedy=0.7):
    gap = None if gap_low is None else {"mean": gap_low + 0.1, "low": gap_low,
                                        "high": gap_low + 0.2}
    return {"held_out": {"eval/accuracy": greedy, "eval/pass@1": pass1},
            "forms": {"worked": {"mean": share}, "hardest": {"difference": gap}}}


@pytest.mark.parametrize("card, says", [
    (_card(0.6, 0.3), None),
    (_card(0.1, 0.3), "share of worked answers"),
    (_card(0.9, 0.3), "share of worked answers"),
    (_card(0.6, -0.01), "hardest"),
    (_card(0.6, None), "hardest"),
    (_card(0.6, 0.3, pass1=0.7), "eval/pass@1"),
    ({"held_out": {"eval/accuracy": 0.7, "eval/pass@1": 0.4}}, "eval/accuracy"),
])
def test_the_build_check_says_why_a_model_leaves_too_little_room(card, says):
    from labkit.zoo.__main__ import problems_with

    found = problems_with(card)
    assert (found == []) if says is None else any(says in line for line in found), found
