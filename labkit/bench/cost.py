"""`python -m labkit bench --cost`: what a GRPO, PPO and DPO step costs at real models' shapes,
and a cost model that predicts it from the config.

Each (shape, algorithm) runs in a fresh process (`workers.worker_cost`): a model of the shape
with random weights (nothing downloaded), `COST_WORK`'s batch (4 sequences of at most 128
tokens), two of labkit's steps; it records the tensors' peak over both steps
(`perf/tensor_peak_mb`: weights, gradients, AdamW states, reference, critic, activations,
logits) and the second step's time.

The cost model (`predict_mb`) counts what the config fixes and fits what it does not:

    peak = P * (state bytes of the algorithm)                       # known from the config
         + T * L * H * a_algo * s + T * V * 4 * v_algo              # fitted, per algorithm

P parameters, T the update's tokens (sequences x padded length), L layers, H hidden size,
V vocabulary, s the activations' bytes (4 in fp32, 2 under bf16 autocast), logits in fp32.
The state bytes: the policy 16 a parameter (fp32 weights, gradients, two AdamW moments); a
reference 4 in fp32 or 2 under bf16 autocast (it is held in bf16); PPO's critic 16 a
parameter of the backbone it copies (`critic_params`). a_algo and
v_algo are fitted on two shapes (`FIT`) and judged on the others: the third shape measured
here and an H200 figure measured before (`H200`, GRPO and PPO at Qwen2.5-0.5B's shape in
bf16). The step time is fitted the same way as seconds per FLOP of the step
(`step_flops`), a rate of this CPU; only its ratios carry to another machine.
"""

from __future__ import annotations

import math

from labkit.bench.inputs import QWEN_05B, SMALL

SHAPES = {
    "small": dict(SMALL),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True),
    "qwen0.5b": dict(QWEN_05B),
}
"""The shapes `--cost` builds and measures (random weights): the bench's small Llama (its
vocabulary the embedded tokenizer's 101 ids), SmolLM2-135M's and Qwen2.5-0.5B's."""

PREDICT = {
    "qwen1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                     num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                     vocab_size=151936, tie_word_embeddings=True),
    "qwen7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                   num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                   vocab_size=152064, tie_word_embeddings=False),
}
"""Shapes the cost model predicts and nothing here builds: Qwen2.5-1.5B and Qwen2.5-7B."""

FIT = ("small", "smollm2-135m")
"""The shapes a_algo and v_algo are fitted on; every other measurement is held out."""

ALGOS = ("grpo", "ppo", "dpo")

COST_WORK = dict(batch_prompts=1, group_size=4, prompt_tokens=64, max_new_tokens=64, beta=0.04)
"""The batch of every cost measurement: 1 prompt of 64 tokens x 4 completions of up to 64
tokens, 4 sequences of at most 128 tokens. PPO at Qwen2.5-0.5B's shape holds 17.8 GB of
state in fp32 (policy and critic with their gradients and AdamW moments, the reference), and
8 such sequences add about 4 GB of activations and logits, past what a 24 GiB machine has
free; 4 add about 2. GRPO and PPO hold a reference (beta 0.04, DeepSeekMath's), as DPO
always does."""

H200 = dict(shape="qwen0.5b", precision="bf16", sequences=16, tokens=192,
            measured={"grpo": 12635.0, "ppo": 20201.0})
"""The bench's memory rows on an NVIDIA H200 (docs/performance.md): Qwen2.5-0.5B's shape,
bf16, 2 prompts of 128 tokens x 8 completions of 64 tokens, beta 0.04; MiB allocated above
the imported baseline (weights included)."""

MIB = 2.0 ** 20


def params(shape: dict) -> int:
    """The parameter count of a decoder of `shape` (Llama / Qwen2: q, k, v, o projections with
    grouped keys and values, a gated MLP, two RMS norms a layer, embeddings, tied or not; Qwen2
    adds q, k, v biases), as transformers builds it."""
    H, I, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    V = shape.get("vocab_size", 101)
    kv = H // shape["num_attention_heads"] * shape["num_key_value_heads"]
    bias = (H + 2 * kv) if shape.get("model_type") == "qwen2" else 0
    layer = H * H + 2 * H * kv + H * H + bias + 3 * H * I + 2 * H
    head = 0 if shape.get("tie_word_embeddings", True) else V * H
    return L * layer + V * H + head + H


def state_bytes(algo: str, precision: str = "fp32") -> float:
    """Bytes per parameter of the policy's weights, gradients and AdamW moments and the
    reference (the module docstring); PPO's critic is `state_of`'s."""
    reference = 2.0 if precision == "bf16" else 4.0
    return 16.0 + reference


def critic_params(shape: dict) -> int:
    """PPO's critic: a copy of the policy's backbone (its embeddings included, the output
    head left out where it is not tied to them) and a value head of H + 1."""
    H, V = shape["hidden_size"], shape.get("vocab_size", 101)
    head = 0 if shape.get("tie_word_embeddings", True) else V * H
    return params(shape) - head + H + 1


def state_of(shape: dict, algo: str, precision: str = "fp32") -> float:
    """Bytes the config fixes: the policy, its gradients and AdamW moments, the reference,
    and for PPO the critic with its gradients and AdamW moments (16 bytes a parameter)."""
    critic = 16.0 * critic_params(shape) if algo == "ppo" else 0.0
    return params(shape) * state_bytes(algo, precision) + critic


def _terms(shape: dict, tokens: int, precision: str) -> tuple[float, float]:
    """The activation and logit units the fitted a and v multiply, in bytes."""
    s = 2.0 if precision == "bf16" else 4.0
    V = shape.get("vocab_size", 101)
    return tokens * shape["num_hidden_layers"] * shape["hidden_size"] * s, tokens * V * 4.0


def fit(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """algo -> (a, v) >= 0 solving the cost model on the FIT shapes' rows (two equations, two
    unknowns per algorithm; `_nonnegative`). Rows: {shape, algo, tokens, precision,
    peak_mb}."""
    out = {}
    for algo in {r["algo"] for r in rows}:
        pts = [r for r in rows if r["algo"] == algo and r["shape"] in FIT]
        if len(pts) != 2:
            raise ValueError(f"the cost model needs {algo} measured at both {FIT}")
        eqs = []
        for r in pts:
            shape = SHAPES[r["shape"]]
            act, logit = _terms(shape, r["tokens"], r["precision"])
            rest = r["peak_mb"] * MIB - state_of(shape, algo, r["precision"])
            eqs.append((act, logit, rest))
        out[algo] = _nonnegative(eqs)
    return out


def _nonnegative(eqs: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, v) >= 0 solving a * act + v * logit = rest on the rows `eqs` in least squares
    (exactly where two rows allow it). Memory held cannot be negative: where the exact
    solution gives one term a negative coefficient, the noise of two measurements has been
    fitted, and that term is set to 0 and the other fitted alone."""
    from scipy.optimize import nnls

    scale = [max(abs(e[0]) for e in eqs), max(abs(e[1]) for e in eqs)]
    matrix = [[e[0] / scale[0], e[1] / scale[1]] for e in eqs]
    solved, _ = nnls(matrix, [e[2] for e in eqs])
    return float(solved[0] / scale[0]), float(solved[1] / scale[1])


def predict_mb(coef: tuple[float, float], shape: dict, algo: str, tokens: int,
               precision: str = "fp32") -> float:
    """The cost model's tensor peak, MiB, for `algo` at `shape`, `tokens` update tokens."""
    act, logit = _terms(shape, tokens, precision)
    return (state_of(shape, algo, precision) + coef[0] * act + coef[1] * logit) / MIB


def step_flops(shape: dict, algo: str, sequences: int, prompt: int, completion: int) -> float:
    """Matrix-product FLOPs of one step: the rollout's forward (2 P per token, prompt once per
    group), the reference's forward over the batch, the update's forward and backward (6 P
    per token), PPO's critic another forward and backward; DPO scores its pairs once more
    under the reference. An estimate that ignores attention's T^2 term (short sequences)."""
    P = params(shape)
    T = sequences * (prompt + completion)
    rollout = 2 * P * sequences * completion + 2 * P * prompt * sequences
    passes = {"grpo": 2 * T + 6 * T, "ppo": 2 * T + 6 * T + 6 * T, "dpo": 2 * T + 6 * T}
    return rollout + P * passes[algo]


def fit_time(rows: list[dict]) -> dict[str, float]:
    """algo -> seconds per FLOP over the FIT shapes' rows (least squares through 0)."""
    out = {}
    for algo in {r["algo"] for r in rows}:
        pts = [(r["flops"], r["step_s"]) for r in rows if r["algo"] == algo and r["shape"] in FIT]
        out[algo] = sum(f * t for f, t in pts) / sum(f * f for f, _ in pts)
    return out


def held_out(rows: list[dict]) -> list[dict]:
    """Every measurement the fit did not use, and the H200 figures, with the prediction and its
    relative error."""
    coef, rate = fit(rows), fit_time(rows)
    out = []
    for r in rows:
        if r["shape"] in FIT:
            continue
        shape = SHAPES[r["shape"]]
        mb = predict_mb(coef[r["algo"]], shape, r["algo"], r["tokens"], r["precision"])
        s = rate[r["algo"]] * r["flops"]
        out.append({"what": f"{r['shape']} {r['algo']} (this CPU, {r['precision']})",
                    "measured_mb": r["peak_mb"], "predicted_mb": mb,
                    "error": mb / r["peak_mb"] - 1, "measured_s": r["step_s"],
                    "predicted_s": s, "time_error": s / r["step_s"] - 1})
    shape = SHAPES[H200["shape"]]
    tokens = H200["sequences"] * H200["tokens"]
    for algo, measured in H200["measured"].items():
        if algo in coef:
            mb = predict_mb(coef[algo], shape, algo, tokens, H200["precision"])
            out.append({"what": f"{H200['shape']} {algo} (H200, bf16, 16 x 192 tokens)",
                        "measured_mb": measured, "predicted_mb": mb,
                        "error": mb / measured - 1})
    return out


def predictions(rows: list[dict]) -> list[dict]:
    """The cost model at Qwen2.5-1.5B's and 7B's shapes, 8 sequences of 128 tokens,
    in fp32 and under bf16 autocast, each algorithm: the tensors' peak in GiB."""
    coef = fit(rows)
    tokens = 8 * 128
    out = []
    for name, shape in PREDICT.items():
        for precision in ("fp32", "bf16"):
            out.append({"shape": name, "params": params(shape), "precision": precision,
                        **{algo: predict_mb(coef[algo], shape, algo, tokens, precision) / 1024
                           for algo in sorted(coef)}})
    return out


def table(rows: list[dict]) -> str:
    """The measurements, the held-out errors and the predictions, as text."""
    lines = ["shape          algo  params      tokens  tensor peak MiB  step s",
             *(f"{r['shape']:<14} {r['algo']:<5} {params(SHAPES[r['shape']]) / 1e6:7.1f} M  "
               f"{r['tokens']:6d}  {r['peak_mb']:15.0f}  {r['step_s']:6.2f}" for r in rows),
             "", f"cost model fitted on {', '.join(FIT)}; held out:"]
    for h in held_out(rows):
        time = (f"; step {h['predicted_s']:.1f} s vs {h['measured_s']:.1f} s "
                f"({100 * h['time_error']:+.0f}%)" if "time_error" in h else "")
        lines.append(f"  {h['what']}: predicted {h['predicted_mb']:,.0f} MiB, measured "
                     f"{h['measured_mb']:,.0f} MiB ({100 * h['error']:+.1f}%){time}")
    lines += ["", "predicted tensor peak, GiB, at 8 sequences x 128 tokens:"]
    for p in predictions(rows):
        algos = ", ".join(f"{a} {p[a]:.1f}" for a in ALGOS if a in p)
        lines.append(f"  {p['shape']} ({p['params'] / 1e9:.2f} B, {p['precision']}): {algos}")
    return "\n".join(lines)


def finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
