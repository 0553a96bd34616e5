"""On a CUDA device (`pytest -m cuda`, scripts/gpu_check.sh): the lean passes against the
model's own forward, the rollout against `model.generate`, and a short bf16 run. Without a
device these skip (tests/conftest.py); the script itself is checked here up to the point
that needs one."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["1+2=", "37+85=", "9+90=", "12+34+56="]


@pytest.fixture(scope="module")
def on_cuda(tiny):
    import copy

    model, tokenizer = tiny
    return copy.deepcopy(model).cuda().eval(), tokenizer


@pytest.mark.cuda
def test_lean_log_probs_and_gradients_match_the_model_forward_on_cuda(on_cuda):
    from labkit.model.rollout import rollout
    from labkit.model.scoring import fast_forward, model_forward, token_logprobs

    model, tokenizer = on_cuda
    batch = rollout(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=8, seed=3)
    mask = batch.completion_mask.bool()
    grads = []
    for forward in (fast_forward, model_forward):
        model.zero_grad(set_to_none=True)
        logp, _ = token_logprobs(model, batch, forward=forward)
        (logp * mask).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if forward is fast_forward:
            ours = logp.detach()
    theirs = logp.detach()
    assert (ours - theirs)[mask].abs().max() < 1e-4
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.cuda
def test_greedy_rollout_matches_generate_on_cuda(on_cuda):
    from labkit.model.rollout import encode_prompts, rollout

    model, tokenizer = on_cuda
    batch = rollout(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=12, greedy=True)
    ids, mask = encode_prompts(tokenizer, PROMPTS, model.device)
    with torch.no_grad():
        out = model.generate(input_ids=ids.repeat_interleave(2, 0),
                             attention_mask=mask.repeat_interleave(2, 0), do_sample=False,
                             max_new_tokens=12, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:]
    for row, want in zip(batch.completion_ids.masked_fill(batch.completion_mask == 0, -1),
                         out.tolist()):
        got = row[row >= 0].tolist()
        assert got == want[:len(got)]


@pytest.mark.cuda
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_short_bf16_run_trains_on_cuda(tmp_path, algo):
    from labkit.run.rundir import read_log
    from labkit.settings.config import TrainConfig
    from labkit.trainer import train

    result = train(TrainConfig(algo=algo, device="cuda", precision="bf16", beta=0.04, steps=3,
                               batch_prompts=4, group_size=4, max_new_tokens=12,
                               eval_every=1000, eval_n=16, eval_samples=0, cgc_prompts=0,
                               progress=False, run_dir=str(tmp_path / algo)))
    config = json.loads((result.run_dir / "config.json").read_text())
    assert config["machine"]["device"].startswith("cuda")
    assert config["machine"]["precision"] == "bf16"
    steps = [r for r in read_log(result.run_dir / "metrics.jsonl") if "loss/total" in r]
    assert len(steps) == 3 and all(math.isfinite(r["loss/total"]) for r in steps)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the script where CUDA is absent")
def test_the_gpu_check_says_in_one_line_that_there_is_no_device():
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "no CUDA device" in done.stderr
    assert done.stdout == ""


def test_the_qwen_scale_has_qwen2_5_0_5bs_shapes():
    """Qwen2.5-0.5B's model card: 0.49 B parameters (0.36 B without the embedding), 24
    layers, 14 query heads and 2 key-value heads; built on the meta device, nothing
    allocated or downloaded."""
    from transformers import AutoModelForCausalLM

    from labkit.bench.inputs import QWEN_05B, small_config
    from labkit.model.models import load

    _, tokenizer = load(device="cpu")
    config = small_config(QWEN_05B, tokenizer)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert config.model_type == "qwen2" and config.num_hidden_layers == 24
    assert (config.num_attention_heads, config.num_key_value_heads) == (14, 2)
    assert 0.485e9 < total < 0.495e9 and 0.355e9 < total - embedding < 0.365e9
    assert config.eos_token_id == tokenizer.eos_token_id
