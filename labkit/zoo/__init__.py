"""The embedded models and the recipe that builds them.

`python -m labkit.zoo build` makes the default model from nothing: a character-level
tokenizer over printable ASCII, a 2-layer, 128-wide Llama, and a supervised warm start on the
default task's train split that stops early, on purpose, once greedy accuracy on a dev slice
of the train split reaches `target`. The result leaves room for RL: it knows the answer
format and is right on a fraction of held-out problems. `--preset tiny-arith-scratchpad`
builds the second model with the same recipe on worked solutions of varying length (sums of
2 to 5 one-digit numbers, the running results written before the boxed answer).
"""

from __future__ import annotations

import json
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labkit.probes.evaluation import evaluate, measure_forms
from labkit.problems.tasks import ArithmeticTask, Problem

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHARS = ["\n", "\t"] + [chr(i) for i in range(32, 127)]


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast`: one token per printable ASCII character.

    Special tokens: <pad>=0, <bos>=1 (prepended to every encoded text), <eos>=2, <unk>=3 (any
    other character). Decoding joins characters with nothing between them.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, UNK]
    vocab = {token: i for i, token in enumerate(specials + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m:.)"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    core.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, unk_token=UNK, padding_side="left",
                                   model_max_length=512)


@dataclass
class Recipe:
    """Everything that decides the embedded model's weights."""

    seed: int = 0
    """Seeds the weights, the training stream and the sampled evaluation."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads (head size hidden_size / num_heads)."""
    intermediate_size: int = 384
    """Width of the SwiGLU MLP."""
    batch_size: int = 64
    """Problems per optimizer step."""
    lr: float = 3e-3
    """Peak AdamW learning rate, after a linear warmup."""
    warmup_steps: int = 50
    """Steps of linear warmup."""
    max_steps: int = 2000
    """Upper bound on steps if the target is never reached."""
    eval_every: int = 25
    """Steps between dev evaluations (the stop rule)."""
    target: float = 0.30
    """Stop at the first dev evaluation with greedy accuracy >= target (0 < target <= 1)."""
    dev_size: int = 256
    """Distinct train-split problems in the dev slice."""
    test_size: int = 800
    """Distinct held-out problems for the model card's figures."""
    test_samples: int = 4
    """Draws per held-out problem for sampled pass@1 at temperature 1."""
    digits: int = 2
    """Task: digits per operand."""
    operands: int = 2
    """Task: numbers per problem (the most, with min_operands)."""
    min_operands: int = 0
    """Task: fewest numbers per problem (0: always `operands`)."""
    scratchpad: bool = False
    """Task: the targets write the running results before the boxed answer."""
    worked: float = 0.0
    """Task: share of targets that write the running results, the others answer at once
    (each draw picks its form), so the model leaves the warm start able to do both."""

    def task(self) -> ArithmeticTask:
        """The task the model is warm-started on (addition)."""
        return ArithmeticTask(digits=self.digits, operands=self.operands,
                              min_operands=self.min_operands, scratchpad=self.scratchpad,
                              worked=self.worked)

    def max_new_tokens(self) -> int:
        """Completion budget of the card's evaluation: the longest target, EOS and a margin."""
        return max(16, len(self.task().longest_target()) + 5)

    def __post_init__(self):
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be in (0, 1], got {self.target}")
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "batch_size", "max_steps", "eval_every", "dev_size", "test_size",
                     "test_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_heads ({self.num_heads})")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        self.task()  # the task's own rules (digits, operands, min_operands)


FORM_SAMPLES = 8
"""Draws per held-out problem (temperature 1) for the card's answer forms: how often the
model works before it answers, and how right each form is."""

PRESETS = {
    "tiny-arith": {},
    "tiny-arith-scratchpad": dict(digits=1, operands=5, min_operands=2, scratchpad=True),
    "tiny-arith-think": dict(digits=1, operands=5, min_operands=2, worked=0.5, target=0.6),
}
"""The embedded models by name: each one's Recipe fields besides the defaults."""


def build_model(recipe: Recipe, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_heads,
        max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config)


def sft_batch(tokenizer, problems: list[Problem]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+target+EOS with labels only on the target tokens."""
    rows, labels = [], []
    for p in problems:
        prompt = tokenizer(p.prompt).input_ids
        target = tokenizer(p.target, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
    }


def train(recipe: Recipe, progress: bool = True):
    """Supervised warm start on `recipe.task()`; returns (model, tokenizer, log) with the dev
    curve in `log`."""
    task = recipe.task()
    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    tokenizer = build_tokenizer()
    model = build_model(recipe, len(tokenizer))
    stream = task.sample(recipe.max_steps * recipe.batch_size, "train", seed=recipe.seed)
    dev = task.sample(recipe.dev_size, "train", seed=recipe.seed + 10_000, distinct=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98),
                                  weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / recipe.warmup_steps))
    curve, step = [], 0
    bar = tqdm(range(recipe.max_steps), desc="sft", disable=not progress)
    model.train()
    for step in bar:
        batch = sft_batch(tokenizer, stream[step * recipe.batch_size:
                                            (step + 1) * recipe.batch_size])
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % recipe.eval_every == 0:
            dev_acc = evaluate(model, tokenizer, dev, samples=0,
                               max_new_tokens=recipe.max_new_tokens())["eval/accuracy"]
            curve.append({"step": step + 1, "loss": round(loss.item(), 4), "dev_accuracy": dev_acc})
            bar.set_postfix(loss=f"{loss.item():.3f}", dev=f"{dev_acc:.2f}")
            model.train()
            if dev_acc >= recipe.target:
                break
    bar.close()
    return model.eval(), tokenizer, {"steps": step + 1, "curve": curve}


def build(out: str | Path, recipe: Recipe | None = None, progress: bool = True,
          name: str = "tiny-arith") -> dict:
    """Train an embedded model, measure it on held-out problems, and save it with its card
    (`name` heads the card)."""
    recipe = recipe or Recipe()
    task = recipe.task()
    start = time.perf_counter()
    model, tokenizer, log = train(recipe, progress=progress)
    train_s = time.perf_counter() - start
    test = task.sample(recipe.test_size, "test", seed=recipe.seed, distinct=True)
    figures = evaluate(model, tokenizer, test, samples=recipe.test_samples, seed=recipe.seed,
                       max_new_tokens=recipe.max_new_tokens(), progress=progress)
    forms = (measure_forms(model, tokenizer, test, samples=FORM_SAMPLES, seed=recipe.seed,
                           max_new_tokens=recipe.max_new_tokens(), progress=progress)
             if recipe.worked else None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    card = {
        "name": name,
        "recipe": asdict(recipe),
        "task": asdict(task),
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_steps": log["steps"],
        "dev_curve": log["curve"],
        "held_out": figures,
        **({"forms": forms} if forms else {}),
        "train_seconds": round(train_s, 1),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread"
                   f"{'s' * (torch.get_num_threads() > 1)}",
    }
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    (out / "README.md").write_text(model_card(card))
    return card


def model_card(card: dict) -> str:
    """The human-readable model card (README.md beside the weights)."""
    r, f = card["recipe"], card["held_out"]
    name = card.get("name", "tiny-arith")
    roles = {"tiny-arith": "default model", "tiny-arith-scratchpad": "scratchpad model",
             "tiny-arith-think": "model that chooses how much to write"}
    role = roles.get(name, "model")
    preset = "" if name == "tiny-arith" else f" --preset {name}"
    count = (f"{r['operands']}" if not r.get("min_operands")
             else f"{r['min_operands']} to {r['operands']}")
    digits = f"{r['digits']} digit{'s' * (r['digits'] > 1)}"
    worked = "the running results, then `\\boxed{sum}<eos>`, e.g. `3+4=7,7+5=12. \\boxed{12}`"
    if r.get("scratchpad"):
        target = worked
    elif r.get("worked"):
        target = (f"for {r['worked']:.0%} of the draws {worked}, for the others "
                  "`\\boxed{sum}<eos>` at once (each draw picks its form)")
    else:
        target = "`\\boxed{a+b}<eos>`"
    task = f"addition of {count} numbers of up to {digits}, prompt `a+b=`, target {target}"
    return f"""# {name}: labkit's embedded {role}

A {card['parameters']:,}-parameter Llama ({r['num_layers']} layers, width {r['hidden_size']},
{r['num_heads']} heads, SwiGLU {r['intermediate_size']}, tied embeddings) with a
character-level tokenizer over printable ASCII (<pad>=0, <bos>=1, <eos>=2, <unk>=3).
Loads with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.

## Recipe (`python -m labkit.zoo build{preset} --seed {r['seed']}`)
Supervised warm start on the train split of its task ({task}; loss on the target only): AdamW, lr {r['lr']} after
{r['warmup_steps']} warmup steps, batch {r['batch_size']}, grad-norm clip 1.0. Training stops
early, on purpose, at the first dev evaluation (every {r['eval_every']} steps, greedy, on
{r['dev_size']} train-split problems) with accuracy >= {r['target']}: here after
{card['sft_steps']} steps, {card['train_seconds']} s ({card['machine']}, torch {card['torch']}).
The model knows the answer format and is right on part of the problems, which leaves room
for RL.

## Held-out figures ({f['eval/n']} distinct test-split problems)
| metric | value |
|---|---|
| greedy accuracy | {f['eval/accuracy']:.3f} |
| pass@1, sampled at temperature 1 ({r['test_samples']} draws per problem) | {f['eval/pass@1']:.3f} |
| pass@{r['test_samples']} | {f[f"eval/pass@{r['test_samples']}"]:.3f} |
| mean greedy completion length (characters) | {f['eval/length']:.1f} |

{forms_section(card)}`card.json` holds the same figures and the dev curve.
"""


def forms_section(card: dict) -> str:
    """The card's answer forms (models warm-started on both forms), else nothing."""
    forms = card.get("forms")
    if not forms:
        return ""
    w, hardest = forms["worked"], forms["hardest"]
    rows = "\n".join(
        f"| {level} | {row['draws']} | {row['worked_share']:.3f} | "
        + " | ".join("-" if row[k] is None else f"{row[k]:.3f}"
                     for k in ("accuracy_direct", "accuracy_worked")) + " |"
        for level, row in forms["by_difficulty"].items())
    gap = hardest["difference"]
    gap_text = ("no problem was answered both ways" if gap is None else
                f"{gap['mean']:.3f} [{gap['low']:.3f}, {gap['high']:.3f}] over "
                f"{hardest['problems']} problems answered both ways")
    return f"""## Answer forms at the start of RL ({forms['samples']} draws per problem, temperature 1)
Whether a completion works (writes a step like `3+4=7` before its box) or answers at once is
the model's choice: the prompt does not say. Share of worked completions:
{w['mean']:.3f} [{w['low']:.3f}, {w['high']:.3f}] (a t interval over the problems).

| operands | draws | worked share | accuracy, direct | accuracy, worked |
|---|---|---|---|---|
{rows}

On the hardest problems ({hardest['difficulty']} operands), accuracy of worked minus direct
completions, paired by problem: {gap_text}.

"""
