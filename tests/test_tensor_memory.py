"""The tensors' peak (`perf/tensor_peak_mb`): the running sum of the allocator's events, and
on a run of a model of known size, the training state that model must hold."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from labkit.probes.tensor_memory import TensorPeak, peak_of
from labkit.settings.config import TrainConfig
from labkit.trainer import train

MIB = 2**20


def test_the_peak_is_the_largest_sum_of_the_bytes_held():
    assert peak_of([]) == 0
    assert peak_of([4, 2, -4, 1, -2]) == 6
    window = TensorPeak("cpu").start()
    a = torch.zeros(1024, 1024)  # 4 MiB
    b = torch.zeros(512, 1024)  # 2 MiB: 6 held
    del a  # 2 held
    c = torch.zeros(256, 1024)  # 1 MiB: 3 held
    assert window.stop() == pytest.approx(6.0)
    assert window.events == 4
    assert b.numel() + c.numel() > 0


def test_a_window_inside_the_callers_profiler_measures_nothing_and_leaves_it_running():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as outer:
        window = TensorPeak("cpu").start()
        torch.zeros(8).sum()
        assert not window.running
        assert window.stop() is None
    assert any(e.name == "aten::sum" for e in outer.events())


@pytest.fixture(scope="module")
def known_model(tiny, tmp_path_factory):
    """A Llama of 5.3 M parameters with the embedded tokenizer, saved as a model folder: big
    enough that its training state dwarfs the activations of a 2-completion step."""
    _, tokenizer = tiny
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("known")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    backbone = sum(p.numel() for p in model.model.parameters())
    return folder, sum(p.numel() for p in model.parameters()), backbone, config.hidden_size


@pytest.mark.parametrize("algo, beta", [("grpo", 0.0), ("grpo", 0.04), ("ppo", 0.0)])
def test_a_runs_tensor_peak_holds_the_training_state_of_its_model(known_model, tmp_path, algo,
                                                                   beta):
    """fp32 AdamW: the policy's weights, gradients and two moments (4 copies), the frozen
    reference when beta > 0 (1 copy), PPO's critic, the backbone with a value head (4
    copies); at one prompt of two 4-token completions the activations add under 2%."""
    folder, params, backbone, hidden = known_model
    config = TrainConfig(model=str(folder), algo=algo, beta=beta, steps=2, batch_prompts=1,
                         group_size=2, max_new_tokens=4, eval_n=2, eval_samples=0,
                         cgc_prompts=0, progress=False, fast=False, run_dir=str(tmp_path / "r"))
    history = train(config).history
    peaks = {r["step"]: r["perf/tensor_peak_mb"] for r in history if "perf/tensor_peak_mb" in r}
    assert list(peaks) == [2]  # logged once, on tensor_peak_step
    floats = 4 * params + (params if beta > 0 else 0)
    if algo == "ppo":
        floats += 4 * (backbone + hidden + 1)
    state_mib = 4 * floats / MIB
    assert state_mib <= peaks[2] <= 1.02 * state_mib
