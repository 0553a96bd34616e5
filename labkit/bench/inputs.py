"""The bench's inputs: the work of one GRPO step (`Work`), the same on labkit's side and its
peer's, the *small* model, and the prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from labkit.model import learner
from labkit.model.models import load
from labkit.model.rollout import encode_prompts
from labkit.problems.tasks import ArithmeticTask, Problem

SMALL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8)
"""The *small* model: a Llama of ~26 M parameters."""
QWEN_05B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=True)
"""`--scale qwen0.5b` (the GPU check, scripts/gpu_check.sh): Qwen2.5-0.5B's shapes with
random weights, nothing downloaded; its vocabulary is Qwen's, of which the embedded
tokenizer uses the first ids."""
TEST_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4)
"""`--scale test`: the same measurements on a toy model, to check the command quickly."""


def bench_precision(choice: str, device: str, params: int) -> str:
    """The precision a bench measurement runs in: `choice` when it is bf16 or fp32; for
    "auto", training's rule on a GPU (bf16 where the device computes it), and on a CPU bf16
    only where the CPU computes it natively and the model has at least
    `labkit.fast.decoder.CPU_LOW_PRECISION_MIN_PARAMS` parameters (below that the rollout
    keeps fp32 products, and bf16 saves no memory traffic), else fp32."""
    if choice in ("bf16", "fp32"):
        return choice
    import torch

    from labkit.fast.decoder import CPU_LOW_PRECISION_MIN_PARAMS

    if device.startswith("cuda"):
        return learner.resolve_precision("auto", torch.device(device))
    native = learner.cpu_bf16_native()
    return "bf16" if native and params >= CPU_LOW_PRECISION_MIN_PARAMS else "fp32"


@dataclass(frozen=True)
class Work:
    """One GRPO step's work, the same on both sides."""

    model: str
    prompts: tuple[str, ...]
    answers: tuple[str, ...]
    batch_prompts: int = 2
    group_size: int = 8
    max_new_tokens: int = 16
    beta: float = 0.04
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    device: str = "cpu"
    steps: int = 10
    warmup: int = 3
    seed: int = 0

    def step_prompts(self, step: int) -> list[int]:
        """Indices of the prompts of step `step` (cycling through `prompts`)."""
        B = self.batch_prompts
        return [(step * B + i) % len(self.prompts) for i in range(B)]

    def step_problems(self, step: int, batch_prompts: int | None = None) -> list:
        """The problems (prompt and answer) of step `step`, `batch_prompts` of them (default:
        the work's), as labkit's `Trainer.step` takes them."""
        work = self if batch_prompts is None else replace(self, batch_prompts=batch_prompts)
        return [Problem(self.prompts[i], self.answers[i]) for i in work.step_prompts(step)]


def small_config(shape: dict, tokenizer):
    """The transformers config of a bench model: `shape` (SMALL, TEST_SMALL: a Llama; a
    `model_type` key picks another family) over the embedded tokenizer's vocabulary and
    special tokens."""
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(shape)
    kind = {"llama": LlamaConfig, "qwen2": Qwen2Config}[shape.pop("model_type", "llama")]
    return kind(**{"vocab_size": len(tokenizer), "max_position_embeddings": 512,
                   "tie_word_embeddings": True, **shape},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def build_small_model(path: Path, shape: dict) -> int:
    """Save a randomly initialised model of `shape` (`small_config`) with the embedded
    tokenizer; its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    _, tokenizer = load(device="cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config(shape, tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def long_prompts(count: int, tokens: int, seed: int = 0) -> list[str]:
    """`count` arithmetic-looking prompts of exactly `tokens` tokens each (with BOS)."""
    _, tokenizer = load(device="cpu")
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = "+".join(str(rng.randint(10, 99)) for _ in range(tokens))
        ids, mask = encode_prompts(tokenizer, [text])
        extra = int(mask.sum()) - len(text)  # special tokens the tokenizer adds
        out.append(text[:tokens - extra - 1] + "=")
        ids, mask = encode_prompts(tokenizer, [out[-1]])
        if int(mask.sum()) != tokens:
            raise RuntimeError(f"could not build a {tokens}-token prompt")
    return out


def tiny_prompts(count: int) -> tuple[list[str], list[str]]:
    problems = ArithmeticTask().sample(count, "train", seed=7)
    return [p.prompt for p in problems], [p.answer for p in problems]
