"""The bench's cost mode (labkit.bench.cost): the parameter count it reasons from, its fit,
and one measurement per algorithm against the state bytes the model counts."""

import tempfile
from pathlib import Path

import pytest
import torch

from labkit.bench import cost
from labkit.bench.inputs import TEST_SMALL, Work, build_small_model, long_prompts


@pytest.mark.parametrize("shape", [
    cost.SHAPES["small"], cost.SHAPES["smollm2-135m"] | {"num_hidden_layers": 2},
    cost.SHAPES["qwen0.5b"] | {"num_hidden_layers": 2, "vocab_size": 1000},
    cost.PREDICT["qwen7b"] | {"num_hidden_layers": 1, "hidden_size": 256,
                              "intermediate_size": 512, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "vocab_size": 1000},
], ids=["small", "smollm2", "qwen2-tied", "qwen2-untied"])
def test_the_parameter_count_is_the_built_models(shape):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = dict(shape)
    kind = {"llama": LlamaConfig, "qwen2": Qwen2Config}[shape.pop("model_type", "llama")]
    config = kind(**({"vocab_size": 101, "tie_word_embeddings": True} | shape))  # as bench builds
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    want = sum(p.numel() for p in model.parameters())
    assert cost.params({"vocab_size": 101} | dict(shape, model_type=kind.model_type)) == want


def _rows(coef: dict, shapes: list[str], tokens: int = 1024) -> list[dict]:
    return [{"shape": s, "algo": a, "tokens": tokens, "precision": "fp32", "step_s": 1.0,
             "flops": 1e12, "peak_mb": cost.predict_mb(c, cost.SHAPES[s], a, tokens)}
            for s in shapes for a, c in coef.items()]


def test_the_fit_recovers_the_activation_and_logit_terms_and_predicts_a_held_out_shape():
    coef = {"grpo": (9.0, 3.0), "ppo": (15.0, 3.5), "dpo": (7.0, 6.0)}
    rows = _rows(coef, list(cost.SHAPES))
    fitted = cost.fit(rows)
    for algo, (a, v) in coef.items():
        assert fitted[algo] == pytest.approx((a, v), rel=1e-9)
    held = [h for h in cost.held_out(rows) if "this CPU" in h["what"]]
    assert {h["what"].split()[0] for h in held} == {"qwen0.5b"}
    assert all(abs(h["error"]) < 1e-9 for h in held)
    # a measurement off by 10% reads as a 10% error, in the right direction
    rows[-1]["peak_mb"] *= 1.1
    off = [h for h in cost.held_out(rows) if h["what"].startswith("qwen0.5b dpo")][0]
    assert off["error"] == pytest.approx(1 / 1.1 - 1, rel=1e-6)
    with pytest.raises(ValueError, match="measured at both"):
        cost.fit([r for r in rows if r["shape"] != "small"])


def test_ppo_holds_a_critic_and_bf16_a_half_size_reference():
    """The critic copies the backbone: every parameter of a tied model (and a value head),
    all but the output head of an untied one; built and counted by transformers."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from labkit.model.scoring import ValueModel

    for tied in (True, False):
        shape = dict(model_type="qwen2", hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=300, tie_word_embeddings=tied)
        config = Qwen2Config(**{k: v for k, v in shape.items() if k != "model_type"})
        policy = AutoModelForCausalLM.from_config(config)
        critic = ValueModel(policy)
        assert cost.critic_params(shape) == sum(p.numel() for p in critic.parameters())
        extra = cost.state_of(shape, "ppo") - cost.state_of(shape, "grpo")
        assert extra == 16 * cost.critic_params(shape)
    assert cost.state_bytes("grpo") - cost.state_bytes("grpo", "bf16") == 2


@pytest.mark.parametrize("algo", ["grpo", "ppo", "dpo"])
def test_a_cost_measurement_holds_at_least_the_state_the_model_counts(algo):
    """One cost worker in this process on a toy Llama: its tensors' peak holds the weights,
    gradients, AdamW moments, reference and (PPO) critic the cost model counts, plus some
    activations, and not several times more; the tokens are the update's padded batch."""
    from labkit.bench.workers import worker_cost

    shape = dict(TEST_SMALL, hidden_size=256, intermediate_size=512)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m"
        build_small_model(path, shape)
        prompts = long_prompts(8, 16)
        work = Work(str(path), tuple(prompts), tuple("0" for _ in prompts), batch_prompts=2,
                    group_size=4, max_new_tokens=8, beta=0.0 if algo == "dpo" else 0.04,
                    steps=3, warmup=0)
        found = worker_cost(work, algo)
    state = cost.state_of({"vocab_size": 101} | shape, algo) / 2**20
    assert found["tokens"] == 8 * (16 + found["completion"]) and found["completion"] <= 8
    assert state < found["peak_mb"] < 3 * state, (state, found)
    assert found["step_s"] > 0


def test_a_term_the_two_shapes_would_make_negative_is_held_at_zero():
    """Two measurements whose exact solution gives the logits a negative share of memory (as
    PPO's did here: the smaller excess at the larger shape): the fit holds that term at 0 and
    fits the activations alone, in least squares over both rows."""
    rows = _rows({"ppo": (22.0, 0.0)}, ["small", "smollm2-135m"])
    rows[1]["peak_mb"] -= 300  # less excess at the larger shape than activations alone give
    a, v = cost.fit(rows)["ppo"]
    assert v == 0.0 and a > 0
    acts = [cost._terms(cost.SHAPES[r["shape"]], r["tokens"], "fp32")[0] for r in rows]
    rest = [r["peak_mb"] * 2**20 - cost.state_of(cost.SHAPES[r["shape"]], "ppo") for r in rows]
    want = sum(x * y for x, y in zip(acts, rest)) / sum(x * x for x in acts)
    assert a == pytest.approx(want, rel=1e-6)
