"""`python -m labkit bench`: its inputs, its arithmetic, and one end-to-end run at toy scale
(the figures themselves are the README's, measured on a quiet machine)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from cli import in_process

import labkit.bench as bench
from labkit.bench import inputs, report, timing, workers
from labkit.bench.floor import step_floor

KEYS = {"trl_step_ratio_tiny", "trl_step_ratio_small", "rollout_speedup_small",
        "grpo_ppo_memory_ratio", "labkit_step_s_tiny", "trl_step_s_tiny", "labkit_step_s_small",
        "trl_step_s_small", "rollout_tokens_per_s_labkit", "rollout_tokens_per_s_generate",
        "grpo_peak_mb", "ppo_peak_mb", "precision", "gradient_checkpointing"}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "labkit", "bench", *args], capture_output=True,
                          text=True, timeout=900)


def test_long_prompts_have_exactly_the_asked_token_count(tiny):
    _, tokenizer = tiny
    prompts = inputs.long_prompts(5, 128, seed=3)
    assert len(set(prompts)) == 5
    for prompt in prompts:
        assert len(tokenizer(prompt)["input_ids"]) == 128


def test_the_small_model_has_20_to_30_million_parameters(tiny):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = tiny
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True,
                                             **inputs.SMALL))
    assert 20e6 <= sum(p.numel() for p in model.parameters()) <= 30e6


def test_slope_is_the_least_squares_fit():
    xs, ys = [2, 4, 8, 16], [0.31, 0.52, 1.05, 1.98]
    assert report.slope(xs, ys) == pytest.approx(np.polyfit(xs, ys, 1)[0], rel=1e-12)


@pytest.mark.parametrize("args, name", [
    (["--steps", "0"], "--steps"), (["--warmup", "-1"], "--warmup"),
    (["--beta", "0"], "--beta"), (["--device", "tpu"], "--device"),
    (["--rounds", "0"], "--rounds"),
])
def test_bad_options_are_one_clear_line(args, name):
    done = in_process("bench", *args)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and name in lines[0], done.stderr


def test_the_command_runs_end_to_end_and_ends_with_its_json_line():
    # one round: pooling and re-running rounds are checked on compare_rounds below
    # the LoRA row's workers are the memory worker with two options: checked in process below
    done = _cli("--scale", "test", "--steps", "1", "--warmup", "0", "--rounds", "1", "--quiet",
                "--no-lora")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert KEYS <= set(summary)
    for key in ("trl_step_ratio_tiny", "trl_step_ratio_small", "rollout_speedup_small",
                "grpo_ppo_memory_ratio"):
        assert math.isfinite(summary[key]) and summary[key] > 0, key
    assert summary["trl_step_ratio_small"] == pytest.approx(
        summary["labkit_step_s_small"] / summary["trl_step_s_small"])
    assert summary["rollout_identical"] is True  # greedy: the same tokens as model.generate
    assert summary["memory_same_completions"] is True and summary["memory_lr"] == workers.MEMORY_LR
    assert "lora_full_memory_ratio" not in summary  # --no-lora
    # auto: the test model is far below 4 M parameters, so fp32 whatever the CPU
    assert summary["precision"] == summary["precision_tiny"] == "fp32"
    assert summary["gradient_checkpointing"] is False
    assert summary["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(summary["cpu_bf16_native"], bool)
    assert summary["rounds"] == 1
    for label in ("tiny", "small"):  # each round's ratio, and their spread
        ratios = summary[f"trl_step_ratio_{label}_rounds"]
        assert len(ratios) == 1 and summary[f"rounds_rerun_{label}"] == 0
        assert summary[f"trl_step_ratio_{label}_spread"]["min"] == min(ratios)
        assert summary[f"rounds_to_stable_{label}"] == report.rounds_to_stable(ratios)
    assert summary["mode"] == "full"
    assert {p["axis"] for p in summary["scaling"]} == {"group_size", "max_new_tokens", "plain"}
    # the prompt-wide passes (prefill, reference and update prompt passes) were timed
    assert all(p["prompt_s"] > 0 for p in summary["scaling"] if p["axis"] != "plain")
    # every target whose figure was measured: the floor's too (the full bench measures it)
    assert set(summary["targets_met"]) == set(report.TARGETS)
    # one round: an interval needs two, so no verdict can be supported or refuted
    assert set(summary["targets_verdict"]) == {"trl_step_ratio_tiny", "trl_step_ratio_small",
                                               "floor_multiple_small"}
    assert set(summary["targets_verdict"].values()) == {"inconclusive at this budget"}
    for label in ("tiny", "small"):  # the floor under one step, below the step itself
        assert 0 < summary[f"floor_s_{label}"] < summary[f"labkit_step_s_{label}"], label
        assert 0 < summary[f"floor_products_{label}"] < summary[f"floor_ops_{label}"], label
        assert summary[f"floor_ratio_{label}"] == pytest.approx(
            summary[f"floor_s_{label}"] / summary[f"trl_step_s_{label}"])
        assert summary[f"floor_multiple_{label}"] == pytest.approx(
            summary[f"labkit_step_s_{label}"] / summary[f"floor_s_{label}"])
    assert any(line.startswith("comparison") for line in lines)  # the table above the JSON


def test_the_prompt_timer_times_the_fast_passes_without_turning_them_off(tiny):
    """A forward hook would send the model to its own forward; the timer wraps labkit.fast's
    functions instead, and only calls over the whole prompt width count."""
    import torch

    from labkit import fast
    from labkit.fast import training
    from labkit.model.rollout import rollout
    from labkit.model.scoring import token_logprobs

    model, tokenizer = tiny
    original = training.backbone
    batch = rollout(model, tokenizer, ["1+2=", "37+85="], group_size=4, max_new_tokens=6, seed=0)
    P = batch.prompt_ids.shape[1]
    timer = timing.PromptTimer([model.model], P, fast=True)
    try:
        assert fast.unsupported(model) is None
        with torch.no_grad():
            token_logprobs(model, batch, share_prompt=False)  # (n, P + T) wide: not counted
            assert timer.seconds == 0.0
            token_logprobs(model, batch, share_prompt=True)  # its prompt pass is P wide
        assert timer.seconds > 0.0
    finally:
        timer.close()
    assert training.backbone is original and fast.backbone is original


def test_the_step_floor_counts_every_dispatched_operation_and_each_product():
    """Five operations by construction, three of them matrix products."""
    aten = torch.ops.aten
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    c, d = torch.randn(3, 8, 16), torch.randn(3, 16, 4)

    def step():
        y = aten.mm.default(a, b)
        aten.bmm.default(c, d)
        aten.addmm.default(y, a, b)
        aten.relu.default(y)
        aten.add.Tensor(y, y)

    floor = step_floor(step, "cpu", replays=3)
    assert floor["floor_ops"] == 5 and floor["floor_products"] == 3
    assert floor["floor_products_s"] > 0 and floor["floor_others_s"] > 0
    assert floor["floor_s"] == floor["floor_products_s"] + floor["floor_others_s"]
    assert floor["floor_replay_mb"] > 0


def test_the_step_floor_counts_in_place_products():
    """The replayed update's backward adds the second output's input gradient into the
    first's in place (`addmm_`): four products in all, each counted as one; so are the
    other in-place products."""
    from labkit.bench import floor
    from labkit.fast.replay import replayed

    aten = torch.ops.aten
    inp = torch.randn(8, 16, requires_grad=True)
    w1, w2 = torch.randn(4, 16, requires_grad=True), torch.randn(6, 16, requires_grad=True)
    kept = ((inp @ w1.t()).detach(), (inp @ w2.t()).detach())  # outside the step

    def update():
        first, second = replayed(inp, None, (w1, w2), (None, None), kept)
        (first.sum() + second.sum()).backward()

    calls, _ = floor.record_products(update)
    assert [str(func) for func, _, _ in calls].count("aten.addmm_.default") == 1
    assert step_floor(update, "cpu", replays=2)["floor_products"] == 4
    c, d, acc = torch.randn(3, 8, 16), torch.randn(3, 16, 4), torch.zeros(3, 8, 4)
    acc0, acc1, c0, d0 = acc[0], acc[1], c[0], d[0]  # views made outside the step

    def in_place():
        aten.baddbmm_.default(acc, c, d)
        aten.addbmm_.default(acc0, c, d)
        aten.addmm_.default(acc1, c0, d0)
        aten.relu_.default(acc)

    counted = step_floor(in_place, "cpu", replays=2)
    assert counted["floor_products"] == 3 and counted["floor_ops"] == 4


def test_the_step_floor_sees_the_backward_and_replays_expanded_inputs():
    """The backward's product counts too; its input is the loss's expanded (stride 0)
    gradient, which the replay rebuilds with the same overlapping strides."""
    x, w = torch.randn(8, 16), torch.randn(16, 4, requires_grad=True)
    floor = step_floor(lambda: (x @ w).sum().backward(), "cpu", replays=2)
    assert floor["floor_products"] == 2  # x @ w, and x.t() @ grad for w (x needs none)
    assert floor["floor_ops"] > 2


def test_the_step_floor_counts_products_made_in_inference_mode():
    """In inference mode F.linear and torch.matmul reach a dispatch mode undecomposed (as
    in the rollout and the reference's pass): they are products, replayed as such; so are
    the decoder's flash attention (its two products and the softmax between them are one
    kernel) and the product on a weight packed by oneDNN, replayed on that weight."""
    from labkit.bench import floor
    from labkit.fast import decoder as fast_decoder
    from labkit.fast import kv

    x, w, v = torch.randn(4, 64), torch.randn(32, 64), torch.randn(64, 8)
    q, keys = torch.randn(4, 2, 1, 16), torch.randn(4, 2, 10, 16)
    linear = torch.nn.Linear(64, 32, bias=False)
    form = "onednn" if fast_decoder.onednn_packs(torch.float32) else "in_out"
    packed = fast_decoder._pack([linear], torch.float32, form)

    def step():
        with torch.inference_mode():
            torch.nn.functional.linear(x, w)
            torch.matmul(x, v)
            kv._flash(q, keys, keys, torch.zeros(4, 1, 1, 10))
            fast_decoder._matmul(x, packed, torch.float32)
            x.relu()

    calls, dispatched = floor.record_products(step)
    names = [str(func) for func, _, _ in calls]
    assert names[:3] == ["aten.linear.default", "aten.matmul.default",
                         "aten._scaled_dot_product_flash_attention_for_cpu.default"]
    if packed.form == "onednn":
        assert names[3:] == ["mkldnn._linear_pointwise.default"]
        replayed = floor.replay_inputs(calls)[3][1]
        assert replayed[1] is packed.matrix
    result = step_floor(step, "cpu", replays=2)
    assert result["floor_products"] == len(calls) == 3 + (packed.form == "onednn")
    assert result["floor_ops"] > result["floor_products"]


def test_the_floor_replays_each_large_weight_on_its_own_tensor_and_small_ones_shared():
    """Four layers' 2 MiB weights of one layout replay on four tensors (as a step reads
    four weights from memory), four small ones on one; past the budget, large ones share."""
    from labkit.bench import floor

    x = torch.randn(4, 512)
    large = [torch.randn(512, 1024) for _ in range(4)]  # 2 MiB each
    small = [torch.randn(512, 8) for _ in range(4)]

    def step():
        for w in large + small:
            torch.mm(x, w)
        torch.mm(x, large[0])  # the same weight again: the same replay tensor

    calls, _ = floor.record_products(step)
    weights = [args[1] for _, args, _ in floor.replay_inputs(calls)]
    ptrs = [w.data_ptr() for w in weights]
    assert len(set(ptrs[:4])) == 4 and ptrs[8] == ptrs[0]
    assert len(set(ptrs[4:8])) == 1
    tight = [args[1].data_ptr() for _, args, _ in floor.replay_inputs(calls, budget=5 << 20)]
    assert len(set(tight[:4])) == 3  # two fit in 5 MiB, the other two share the layout's


def test_the_floor_replays_a_kv_cache_from_its_own_memory_whatever_its_size():
    """The decode's attention reads each layer's keys and values: two layers' small caches
    replay on two buffers, each read at a growing length as views of one buffer; a small
    input of another product still shares its layout's tensor."""
    from labkit.bench import floor
    from labkit.fast import kv

    q = torch.randn(2, 2, 1, 16)
    caches = [(torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)) for _ in range(2)]
    x, w = torch.randn(4, 16), [torch.randn(16, 8) for _ in range(2)]

    def step():
        with torch.inference_mode():
            for length in (3, 5):
                for keys, values in caches:
                    kv._flash(q, keys[:, :, :length], values[:, :, :length])
            for m in w:
                torch.mm(x, m)

    calls, _ = floor.record_products(step)
    replayed = floor.replay_inputs(calls)
    keys = [args[1] for _, args, _ in replayed[:4]]
    assert all(k.numel() * 4 < floor.DISTINCT_MIN_BYTES for k in keys)
    # (length 3, layer 0), (3, 1), (5, 0), (5, 1): a buffer per layer, shared across lengths
    assert keys[0].data_ptr() == keys[2].data_ptr() != keys[1].data_ptr() == keys[3].data_ptr()
    assert keys[2].shape == (2, 2, 5, 16) and keys[0].shape == (2, 2, 3, 16)
    assert replayed[0][1][2].data_ptr() not in {k.data_ptr() for k in keys}  # the values'
    assert replayed[4][1][1].data_ptr() == replayed[5][1][1].data_ptr()  # small, one layout


def _memory_work():
    from labkit.settings.embedded import EMBEDDED_PATH

    prompts, answers = inputs.tiny_prompts(8)
    return inputs.Work(str(EMBEDDED_PATH), tuple(prompts), tuple(answers), max_new_tokens=16,
                      steps=3, warmup=0)


def test_the_memory_comparison_runs_the_same_completions_on_both_sides():
    """Memory depends on shapes: both sides run at MEMORY_LR, where neither policy moves, so
    GRPO and PPO sample the same completions at every step (at a real lr they drift apart
    and PPO's shorten)."""
    work = _memory_work()
    grpo, ppo = (workers.worker_memory(work, algo) for algo in ("grpo", "ppo"))
    assert grpo["lr"] == ppo["lr"] == workers.MEMORY_LR == 1e-30
    assert len(grpo["tokens"]) == 3 and all(t > 0 for t in grpo["tokens"])
    assert grpo["completions"] == ppo["completions"]  # token for token
    assert grpo["tokens"] == ppo["tokens"]
    assert grpo["peak_growth_mb"] > 0 and ppo["peak_growth_mb"] > 0
    # the tensors' peak: PPO's critic with its gradients and AdamW states, on top of GRPO's
    assert 1.3 < ppo["tensor_peak_mb"] / grpo["tensor_peak_mb"] < 3


@pytest.fixture
def flush_denormal():
    """Subnormals flushed to zero, as the memory worker runs (its PPO critic's gradients
    are subnormal at MEMORY_LR, many times slower to multiply otherwise); set back after."""
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.parametrize("lr, moved", [(workers.MEMORY_LR, False), (1e-9, True)])
def test_at_the_memory_lr_no_policy_weight_changes(flush_denormal, algo, lr, moved):
    """The memory comparison's premise, bit for bit: at MEMORY_LR three steps leave every
    policy weight as it was (with subnormals flushed, as in the worker). The control: at
    1e-9 some weights move by their last bit, which is enough to flip a near-tied draw
    between the two sides."""
    work = _memory_work()
    trainer = timing.labkit_trainer(work, algo, lr=lr, critic_lr=lr)
    policy = trainer.learner.policy
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    timing.step_times(trainer, work, work.steps, 0)
    changed = sum(int((v != before[k]).sum()) for k, v in policy.state_dict().items())
    assert (changed > 0) is moved, changed


def test_at_a_real_learning_rate_the_two_sides_completions_part(monkeypatch):
    """The control: the fingerprints do tell completions apart once the policies move."""
    monkeypatch.setattr(workers, "MEMORY_LR", 1e-2)
    grpo, ppo = (workers.worker_memory(_memory_work(), algo) for algo in ("grpo", "ppo"))
    assert grpo["completions"][0] == ppo["completions"][0]  # the same start
    assert grpo["completions"][1:] != ppo["completions"][1:]


@pytest.mark.parametrize("ppo_completions, met", [(["a1", "b2"], True), (["a1", "c3"], False)])
def test_the_memory_target_needs_the_same_completions_on_both_sides(ppo_completions, met):
    from types import SimpleNamespace

    steps = {"step_s": [1.0], "rollout_s": [0.5], "update_s": [0.5]}
    results = {f"{side}_{label}": steps for side in ("labkit", "trl") for label in ("tiny", "small")}
    results["rollout"] = {"tokens": 100, "seconds": {"labkit": [1.0], "generate": [2.0]},
                          "identical": True}
    results["memory_grpo"] = {"peak_growth_mb": 500.0, "completions": ["a1", "b2"],
                              "tokens": [10, 12], "lr": workers.MEMORY_LR}
    results["memory_ppo"] = {"peak_growth_mb": 1000.0, "completions": ppo_completions,
                             "tokens": [10, 12], "lr": workers.MEMORY_LR}
    args = SimpleNamespace(steps=1, warmup=0, rounds=1, beta=0.04)
    summary = report.summarize(results, params=1, device="cpu",
                               precision={"tiny": "fp32", "small": "bf16"}, args=args)
    assert summary["grpo_ppo_memory_ratio"] == 0.5
    assert summary["memory_same_completions"] is met
    assert summary["targets_met"]["grpo_ppo_memory_ratio"] is met


def test_the_bench_uses_only_the_trainers_public_step_api():
    """No private name of another labkit module, and no seed rule of its own: the bench
    steps labkit through `Trainer.step` (the seed comes from `trainer.step_seed`)."""
    import ast
    from pathlib import Path

    import labkit.bench

    for path in Path(labkit.bench.__file__).parent.glob("*.py"):
        source = path.read_text()
        assert "1_000_003" not in source, path
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit") \
                    and not node.module.startswith("labkit.bench"):
                assert not any(a.name.startswith("_") for a in node.names), (path, node.lineno)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                assert not (node.value.id in {"trainer", "learner", "labkit"}
                            and node.attr.startswith("_")), (path, node.lineno)


def test_a_steps_problems_are_its_prompts_with_their_answers():
    work = _memory_work()
    problems = work.step_problems(3)
    assert [p.prompt for p in problems] == [work.prompts[i] for i in work.step_prompts(3)]
    assert [p.answer for p in problems] == [work.answers[i] for i in work.step_prompts(3)]
    assert len(work.step_problems(3, batch_prompts=5)) == 5


@pytest.mark.parametrize("native, params, expected", [
    (True, 26_000_000, "bf16"), (True, 439_552, "fp32"), (False, 26_000_000, "fp32")])
def test_auto_precision_takes_bf16_only_where_the_cpu_has_it_and_the_model_gains(
        monkeypatch, native, params, expected):
    from labkit.model import learner

    monkeypatch.setattr(learner, "cpu_bf16_native", lambda: native)
    assert inputs.bench_precision("auto", "cpu", params) == expected
    for forced in ("bf16", "fp32"):  # an explicit choice is kept
        assert inputs.bench_precision(forced, "cpu", params) == forced


def test_cpu_bf16_native_reads_the_cpu_flags(monkeypatch, tmp_path):
    from pathlib import Path

    from labkit.model import learner

    real = Path.is_file
    # (flags, torch's kernel level, ONEDNN_MAX_CPU_ISA): native bf16 needs the flag and
    # kernels allowed to use it
    for flags, capability, isa, expected in (
            ("fpu avx512f avx512bw", "AVX512", None, False),
            ("fpu avx512f avx512_bf16", "AVX512", None, True),
            ("fpu amx_tile amx_bf16", "AVX512", None, True),
            ("fpu amx_tile amx_bf16", "AVX512", "avx512_core_amx", True),
            ("fpu avx512f avx512_bf16", "AVX2", None, False),
            ("fpu avx512f avx512_bf16", "AVX512", "AVX2", False),
            ("fpu avx512f avx512_bf16", "AVX512", "avx512_core_vnni", False),
            ("fp asimd bf16", "DEFAULT", None, True), ("fp asimd", "DEFAULT", None, False)):
        fake = tmp_path / "cpuinfo"
        key = "Features" if "asimd" in flags else "flags"
        fake.write_text(f"processor\t: 0\n{key}\t\t: {flags}\n")
        monkeypatch.setattr(Path, "is_file",
                            lambda self, f=fake: True if str(self) == "/proc/cpuinfo" else real(self))
        monkeypatch.setattr(Path, "read_text", lambda self, *a, f=fake, **k: f.open().read())
        monkeypatch.setattr(learner.torch.backends.cpu, "get_cpu_capability",
                            lambda c=capability: c)
        if isa is None:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        assert learner.cpu_bf16_native() is expected, (flags, capability, isa)
        monkeypatch.undo()


def test_bf16_on_a_cpu_without_it_is_said_before_the_bench_starts(monkeypatch, capsys):
    import argparse

    from labkit import bench
    from labkit.model import learner

    monkeypatch.setattr(learner, "cpu_bf16_native", lambda: False)
    stop = RuntimeError("stopped before any model was built")

    def refuse(*a, **k):
        raise stop
    monkeypatch.setattr(bench, "build_small_model", refuse)
    args = argparse.Namespace(steps=1, warmup=0, rounds=1, beta=0.04, device="cpu",
                              precision="bf16", scale="test", quiet=True, scaling=False,
                              lora=False)
    with pytest.raises(RuntimeError, match="stopped"):
        bench.run(args)
    assert "torch emulates it, slower than fp32" in capsys.readouterr().err


def _steps(*medians):
    return [{"labkit": {"step_s": [m[0]]}, "trl": {"step_s": [m[1]]}} for m in medians]


def test_a_round_that_strays_is_found_on_either_side():
    from labkit import bench

    assert bench.strays(_steps((1.0, 2.0), (1.1, 2.1), (1.0, 2.0))) == []
    assert bench.strays(_steps((1.0, 2.0), (1.6, 2.0), (1.0, 2.0))) == [1]   # labkit 1.6x
    assert bench.strays(_steps((1.0, 2.0), (1.0, 2.0), (1.0, 1.2))) == [2]   # TRL 1/1.67
    assert bench.strays(_steps((1.0, 2.0), (3.0, 6.0))) == []  # two rounds: no majority


def test_compare_rounds_reruns_a_stray_round_once_and_reports_each_round():
    from labkit import bench

    calls, floors = [], []
    busy = {("labkit", 1)}  # the first time round 2 measures labkit, the machine is busy

    def measure(side, work, **options):
        turn = sum(1 for s, _ in calls if s == side)
        calls.append((side, turn))
        floors.append(options.get("floor"))
        slow = 3.0 if (side, turn) in busy else 1.0
        return {"step_s": [slow * (1.0 if side == "labkit" else 2.0)] * 3, "rollout_s": [0.1]}

    out = bench.compare_rounds("small", None, 3, lambda *a: None, measure=measure)
    assert len(calls) == 8  # 3 rounds of 2 sides, then round 2 again
    assert floors == [True, None] * 4  # labkit's side measures its floor in every round
    calls.clear(), floors.clear(), busy.clear()
    bench.compare_rounds("small", None, 3, lambda *a: None, measure=measure, floor_rounds=1)
    assert floors[::2] == [True, False, False]  # in the first round only
    calls.clear(), floors.clear()
    bench.compare_rounds("small", None, 3, lambda *a: None, measure=measure, floor_rounds=0)
    assert floors[::2] == [False, False, False]  # --quick, --no-floor: never
    calls.clear(), floors.clear()
    busy.add(("labkit", 1))
    out = bench.compare_rounds("small", None, 3, lambda *a: None, measure=measure)
    assert [r["rerun"] for r in out["rounds_small"]] == [False, True, False]
    assert [r["labkit"] / r["trl"] for r in out["rounds_small"]] == [0.5, 0.5, 0.5]
    assert out["labkit_small"]["step_s"] == [1.0] * 9  # the stray round's steps are gone


def test_each_round_keeps_the_floor_its_labkit_side_measured():
    from labkit import bench

    def measure(side, work, **options):
        out = {"step_s": [1.0 if side == "labkit" else 2.0]}
        if options.get("floor"):
            out["floor_s"] = [0.5 + 0.1 * measure.turn]
            measure.turn += 1
        return out
    measure.turn = 0
    out = bench.compare_rounds("small", None, 3, lambda *a: None, measure=measure)
    assert [r["floor"] for r in out["rounds_small"]] == pytest.approx([0.5, 0.6, 0.7])
    out = bench.compare_rounds("small", None, 3, lambda *a: None, measure=measure,
                               floor_rounds=0)
    assert all("floor" not in r for r in out["rounds_small"])


def test_the_comparison_and_the_scaling_table_must_agree_on_the_same_shape():
    points = [{"axis": "group_size", "value": 8, "step_s": 1.1},
              {"axis": "max_new_tokens", "value": 64, "step_s": 1.2},
              {"axis": "group_size", "value": 2, "step_s": 0.4}]
    check = report.consistency(1.0, points, group_size=8, max_new_tokens=64)
    assert check["scaling_step_s"] == [1.1, 1.2] and check["agree"] is True
    assert check["disagreement"] == pytest.approx(0.2)
    busy = report.consistency(0.5, points, group_size=8, max_new_tokens=64)  # 2.4x: flagged
    assert busy["agree"] is False and busy["disagreement"] == pytest.approx(1.4)
    assert report.consistency(1.0, points, group_size=16, max_new_tokens=32)["agree"] is None


def _bench_args(*argv):
    import argparse

    from labkit import bench

    sub = argparse.ArgumentParser().add_subparsers(dest="cmd")
    bench.add_parser(sub)
    args = sub.choices["bench"].parse_args(list(argv))
    bench.resolve_mode(args)
    return args


def test_quick_takes_fewer_steps_and_one_scaling_point_unless_told_otherwise():
    from labkit import bench

    work = inputs.Work("m", ("1+1=",), ("2",), group_size=8)
    full, quick = _bench_args(), _bench_args("--quick")
    assert (full.steps, full.warmup, full.rounds) == (8, 2, 3)
    assert (quick.steps, quick.warmup, quick.rounds) == (1, 1, 3)  # still 3 rounds
    assert _bench_args("--quick", "--steps", "5").steps == 5  # given steps win
    assert full.lora and not quick.lora  # the LoRA row: the full bench's
    assert _bench_args("--quick", "--lora").lora and not _bench_args("--no-lora").lora
    assert full.floor and not quick.floor  # the step floor: the full bench's
    assert _bench_args("--quick", "--floor").floor and not _bench_args("--no-floor").floor
    said = []
    assert bench.lora_row(quick, said.append) is False and "--lora adds it" in said[0]
    assert bench.scaling_points(full, work)["groups"] == [2, 4, 8, 16]
    assert bench.scaling_points(quick, work) == dict(groups=[8], lengths=[], plain=False)
    assert bench.scaling_points(_bench_args("--quick", "--no-scaling"), work) is None


def test_a_one_point_scaling_table_gives_the_consistency_check_and_no_slopes():
    point = {"axis": "group_size", "value": 8, "step_s": 2.0, "rollout_s": 1.0,
             "update_s": 1.0, "prompt_s": 0.1}
    figures = report._scaling_figures([point])
    assert figures == {"scaling": [point]}
    assert report.consistency(2.4, [point])["agree"] is True  # 17% apart
    check = report.consistency(3.0, [point])
    assert check["agree"] is False and check["disagreement"] == pytest.approx(1 / 3)
    assert "slopes" not in "\n".join(report._scaling_lines(figures))


@pytest.mark.parametrize("ratios, stable", [
    ([0.5, 0.5, 0.5], 1),
    ([0.8, 0.5, 0.5], 3),        # running medians 0.8, 0.65 (both off), then 0.5
    ([0.5, 0.8, 0.52, 0.51], 3),  # running medians 0.5, 0.65 (off), 0.52, 0.515
    ([0.5, 0.6, 0.7], 3),        # only the whole set gives its own median
])
def test_rounds_to_stable_counts_the_rounds_after_which_the_median_stays_put(ratios, stable):
    got = report.rounds_to_stable(ratios)
    # plain reference: the smallest k from which every running median is within 5%
    final = sorted(ratios)[len(ratios) // 2] if len(ratios) % 2 else \
        sum(sorted(ratios)[len(ratios) // 2 - 1:len(ratios) // 2 + 1]) / 2

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
    want = min(k for k in range(1, len(ratios) + 1)
               if all(abs(med(ratios[:j]) / final - 1) <= 0.05 for j in range(k, len(ratios) + 1)))
    assert got == want == stable


def test_the_memory_worker_leaves_subnormal_floats_as_it_found_them():
    """It flushes subnormals to zero while it runs (a CPU-wide flag); a caller in the same
    process must get IEEE arithmetic back."""
    from labkit.settings.embedded import EMBEDDED_PATH

    tiny_normal = torch.tensor([1e-38], dtype=torch.float32)
    assert (tiny_normal / 1e3).item() > 0  # a subnormal, not flushed
    work = inputs.Work(str(EMBEDDED_PATH), ("1+1=", "2+2="), ("2", "4"), max_new_tokens=4, steps=1, warmup=0,
                       batch_prompts=1, group_size=2, beta=0.04, device="cpu",
                       precision="fp32", gradient_checkpointing=False)
    workers.worker_memory(work, "grpo")
    assert (tiny_normal / 1e3).item() > 0


def test_the_memory_baseline_already_holds_the_code_a_trainer_step_imports():
    """After `import_trainer_code`, building a trainer and running a step import no more of
    transformers' model classes, accelerate, the answer checker or peft: that code sits in
    the baseline, the same for GRPO and PPO, and is no part of either peak. A fresh process,
    so that nothing another test imported hides a module."""
    program = """
import json, sys
from labkit.bench import inputs, workers
from labkit.bench.timing import labkit_trainer
from labkit.settings.embedded import EMBEDDED_PATH
work = inputs.Work(str(EMBEDDED_PATH), ("1+1=", "2+2="), ("2", "4"), max_new_tokens=4,
                   steps=1, warmup=0, batch_prompts=1, group_size=2)
workers.import_trainer_code(work, lora=True)
before = set(sys.modules)
trainer = labkit_trainer(work, lora_rank=4, lora_targets="q_proj,v_proj")
trainer.step(0, work.step_problems(0))
print(json.dumps({"model": type(trainer.policy).__module__,
                  "new": sorted(set(sys.modules) - before)}))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    packages = {m.split(".")[0] for m in seen["new"] if "." not in m}
    assert not packages & {"accelerate", "math_verify", "sympy", "peft"}, packages
    models = [m for m in seen["new"] if m.startswith("transformers.models.")]
    assert models == [], models
    assert seen["model"].startswith("transformers.models.")


def test_memory_workers_run_with_the_fixed_allocator_threshold_and_others_do_not(monkeypatch):
    seen = {}

    def fake_run(cmd, **kwargs):
        seen[cmd[4]] = kwargs["env"]
        return subprocess.CompletedProcess(cmd, 0, stdout='{"ok": 1}\n', stderr="")

    monkeypatch.setattr(workers.subprocess, "run", fake_run)
    work = workers.Work("model", ("p",), ("a",))
    for name in ("memory", "labkit"):
        assert workers.run_worker(name, work) == {"ok": 1}
    assert seen["memory"]["MALLOC_MMAP_THRESHOLD_"] == "65536"
    assert "MALLOC_MMAP_THRESHOLD_" not in seen["labkit"] or \
        seen["labkit"]["MALLOC_MMAP_THRESHOLD_"] == os.environ.get("MALLOC_MMAP_THRESHOLD_")


def test_the_lora_memory_row_measures_adapters_against_full_fine_tuning(tmp_path):
    """The memory worker with fast=False and lora_rank on the test-scale model, in process:
    LoRA holds no reference copy, no base gradients or optimizer states; the summary's row
    and its table line follow from the two workers' figures."""
    path = tmp_path / "small"
    inputs.build_small_model(path, inputs.TEST_SMALL)
    prompts = tuple(inputs.long_prompts(4, 16))
    work = inputs.Work(str(path), prompts, tuple("0" for _ in prompts), max_new_tokens=8,
                       batch_prompts=2, group_size=4, steps=1, warmup=0)
    lora = workers.worker_memory(work, "grpo", fast=False, lora_rank=8)
    full = workers.worker_memory(work, "grpo", fast=False, lora_rank=0)
    assert lora["completions"] == full["completions"]  # lr 1e-30: the same samples
    figures = report._lora_figures({"memory_lora": lora, "memory_full": full})
    # the row reads the tensors' peak: adapters hold less than full fine-tuning's gradients,
    # AdamW states and reference (the process's growth, context, is allocator noise here)
    assert figures["lora_full_memory_ratio"] == lora["tensor_peak_mb"] / full["tensor_peak_mb"]
    assert lora["tensor_peak_mb"] < full["tensor_peak_mb"]
    assert figures["lora_same_completions"] is True


def test_the_lora_row_is_left_out_without_peft_or_with_no_lora(monkeypatch):
    import argparse
    import importlib.util

    from labkit import bench

    said = []
    assert bench.lora_row(argparse.Namespace(lora=True), said.append) is True
    assert bench.lora_row(argparse.Namespace(lora=False), said.append) is False and not said
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "peft" else real(name, *a))
    assert bench.lora_row(argparse.Namespace(lora=True), said.append) is False
    assert said == ["[bench] no LoRA memory row: peft is not installed "
                    "(pip install 'labkit[lora]')"]


def test_the_bench_bar_counts_its_workers_and_names_the_stage(capsys):
    stages = bench.Stages(total=3)
    measure = stages.counted(lambda name, work, **options: {"name": name, **options})
    stages.say("[bench] GRPO step, tiny: labkit (round 1 of 1)")
    assert stages.bar.desc == "GRPO step, tiny: labkit"
    assert measure("labkit", None, floor=True) == {"name": "labkit", "floor": True}
    assert (stages.bar.n, stages.bar.total) == (1, 3)
    for _ in range(3):  # a rerun round: more workers than planned
        measure("trl", None)
    assert (stages.bar.n, stages.bar.total) == (4, 4)
    stages.close()
    err = capsys.readouterr().err
    assert "[bench] GRPO step, tiny: labkit (round 1 of 1)\n" in err and "4/4" in err
    quiet = bench.Stages(total=2, quiet=True)
    quiet.say("[bench] memory")
    quiet.counted(lambda *a: None)("memory", None)
    quiet.close()
    assert capsys.readouterr().err == ""


# --- intervals over rounds, verdicts, and pooling runs ---------------------------------------

T975_DF2 = 4.302653  # two-sided 95% Student t quantile, 2 degrees of freedom (printed tables)


def _round_results(rounds, floors=None):
    """Workers' results for `summarize`: `rounds` [(labkit s, TRL s), ...] on both configs,
    and `floors` (one per round) under labkit's steps where given."""
    results = {}
    for label in ("tiny", "small"):
        ours = {"step_s": [a for a, _ in rounds], "rollout_s": [0.1], "update_s": [0.1]}
        if floors is not None:
            ours |= {"floor_s": floors, "floor_products_s": floors, "floor_others_s": [0.0],
                     "floor_ops": [10], "floor_products": [4]}
        results[f"labkit_{label}"] = ours
        results[f"trl_{label}"] = {"step_s": [b for _, b in rounds]}
        results[f"rounds_{label}"] = [{"labkit": a, "trl": b, "rerun": False}
                                      | ({} if floors is None else {"floor": floors[i]})
                                      for i, (a, b) in enumerate(rounds)]
    results["rollout"] = {"tokens": 100, "seconds": {"labkit": [1.0], "generate": [2.5]},
                          "identical": True}
    for algo, mb in (("grpo", 500.0), ("ppo", 1000.0)):
        results[f"memory_{algo}"] = {"peak_growth_mb": mb, "completions": ["a"], "tokens": [9],
                                     "lr": workers.MEMORY_LR}
    return results


def _summarize(results):
    from types import SimpleNamespace

    args = SimpleNamespace(steps=1, warmup=0, rounds=3, beta=0.04)
    return report.summarize(results, params=1, device="cpu",
                            precision={"tiny": "fp32", "small": "fp32"}, args=args)


def test_each_step_ratio_has_a_t_interval_over_its_rounds_and_a_verdict():
    rounds = [(0.36, 1.0), (0.38, 1.0), (0.37, 1.0)]  # tight, all below 0.4: supported
    summary = _summarize(_round_results(rounds, floors=[0.2, 0.2, 0.2]))
    logs = [math.log(a / b) for a, b in rounds]
    mean = sum(logs) / 3
    half = T975_DF2 * np.std(logs, ddof=1) / math.sqrt(3)
    found = summary["trl_step_ratio_small_interval"]
    assert found["mean"] == pytest.approx(math.exp(mean))
    assert (found["low"], found["high"]) == (pytest.approx(math.exp(mean - half), rel=1e-5),
                                             pytest.approx(math.exp(mean + half), rel=1e-5))
    assert found["n"] == 3 and "rounds" in found["method"]
    assert summary["targets_verdict"]["trl_step_ratio_small"] == "supported"
    assert summary["targets_verdict"]["trl_step_ratio_tiny"] == "supported"  # <= 0.6 too
    # the step over its floor, round by round: 1.8-1.9x, all above 1.25: refuted
    assert summary["floor_multiple_small_rounds"] == pytest.approx([1.8, 1.9, 1.85])
    assert summary["targets_verdict"]["floor_multiple_small"] == "refuted"
    assert summary["targets_met"]["floor_multiple_small"] is False
    table = report.table(summary)
    assert "trl_step_ratio_small over rounds: 0.370 [" in table and "supported" in table


@pytest.mark.parametrize("rounds, verdict", [
    ([(0.30, 1.0), (0.55, 1.0), (0.45, 1.0)], "inconclusive at this budget"),  # straddles 0.4
    ([(0.50, 1.0), (0.52, 1.0), (0.51, 1.0)], "refuted"),
])
def test_a_ratio_whose_rounds_straddle_or_miss_the_target_is_not_supported(rounds, verdict):
    summary = _summarize(_round_results(rounds))
    assert summary["targets_verdict"]["trl_step_ratio_small"] == verdict
    assert "floor_multiple_small" not in summary["targets_met"]  # no floor measured


def _summary_for_pool(tiny, small, capability="AVX2", floor=None, **extra):
    out = {"trl_step_ratio_tiny": tiny, "trl_step_ratio_small": small,
           "rollout_speedup_small": 2.5, "grpo_ppo_memory_ratio": 0.589,
           "labkit_step_s_small": 4.0, "cpu_capability": capability, "precision": "fp32",
           "precision_tiny": "fp32", "device": "cpu", "mode": "quick"} | extra
    if floor is not None:
        out["floor_s_small"] = floor
    return out


def test_pooling_runs_gives_each_target_figure_its_interval_over_runs():
    tiny = [0.55, 0.62, 0.58, 0.60]
    runs = [_summary_for_pool(t, 0.36 + 0.005 * i) for i, t in enumerate(tiny)]
    pooled = report.pool(runs, [f"run{i}.json" for i in range(4)])
    f = pooled["figures"]["trl_step_ratio_tiny"]
    logs = [math.log(t) for t in tiny]
    half = 3.182446 * np.std(logs, ddof=1) / 2  # df = 3
    assert f["values"] == tiny and f["n"] == 4 and "runs" in f["method"]
    assert (f["low"], f["high"]) == (pytest.approx(math.exp(np.mean(logs) - half), rel=1e-5),
                                     pytest.approx(math.exp(np.mean(logs) + half), rel=1e-5))
    assert f["verdict"] == "inconclusive at this budget" and f["target"] == "<= 0.6"
    assert pooled["figures"]["trl_step_ratio_small"]["verdict"] == "supported"
    assert pooled["figures"]["rollout_speedup_small"]["verdict"] == "supported"  # >= 2, no spread
    assert "floor_multiple_small" not in pooled["figures"]  # no run measured the floor
    assert pooled["runs"] == 4 and pooled["cpu_capability"] == "AVX2"
    assert "trl_step_ratio_tiny" in report.pool_table(pooled)


def test_pooling_takes_the_floor_multiple_from_runs_that_measured_the_floor():
    runs = [_summary_for_pool(0.6, 0.38, floor=2.5), _summary_for_pool(0.6, 0.38),
            _summary_for_pool(0.6, 0.38, floor=3.0, floor_multiple_small=4.0 / 3.0)]
    f = report.pool(runs, ["a", "b", "c"])["figures"]["floor_multiple_small"]
    assert f["values"] == pytest.approx([1.6, 4.0 / 3.0]) and f["n"] == 2


@pytest.mark.parametrize("second, field", [
    (_summary_for_pool(0.6, 0.4, capability="AVX512"), "cpu_capability"),
    (_summary_for_pool(0.6, 0.4, precision="bf16"), "precision"),
])
def test_runs_of_other_machines_or_precisions_are_not_pooled(second, field):
    with pytest.raises(ValueError, match=f"different {field}.*b.json: "):
        report.pool([_summary_for_pool(0.6, 0.4), second], ["a.json", "b.json"])


def test_pooling_needs_two_runs():
    with pytest.raises(ValueError, match="at least 2 runs"):
        report.pool([_summary_for_pool(0.6, 0.4)], ["a.json"])


def test_pool_reads_out_files_and_saved_outputs_end_to_end(tmp_path):
    first, second = _summary_for_pool(0.55, 0.38), _summary_for_pool(0.65, 0.36)
    (tmp_path / "one.json").write_text(json.dumps(first, indent=1))
    # the bench's printed output: the table, then the JSON line
    (tmp_path / "two.log").write_text("comparison  labkit  peer\n{not json\n"
                                      + json.dumps(second) + "\n")
    done = in_process("bench", "--pool", tmp_path / "one.json", tmp_path / "two.log")
    assert done.returncode == 0, done.stderr
    pooled = json.loads(done.stdout.strip().splitlines()[-1])
    assert pooled["figures"]["trl_step_ratio_tiny"]["values"] == [0.55, 0.65]
    assert pooled["files"][1].endswith("two.log")


@pytest.mark.parametrize("content, message", [(None, "no such file"),
                                               ("progress only\n", "holds no bench summary")])
def test_pool_says_which_file_it_cannot_read(tmp_path, content, message):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_summary_for_pool(0.6, 0.4)))
    bad = tmp_path / "bad.log"
    if content is not None:
        bad.write_text(content)
    done = in_process("bench", "--pool", good, bad)
    assert done.returncode == 2 and message in done.stderr and "bad.log" in done.stderr


def test_out_to_a_folder_is_refused_before_anything_is_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run", lambda args: pytest.fail("measured despite a bad --out"))
    done = in_process("bench", "--out", tmp_path)
    assert done.returncode == 2 and "--out" in done.stderr and "folder" in done.stderr


def test_out_writes_the_summary_it_prints(tmp_path, monkeypatch):
    summary = _summarize(_round_results([(0.36, 1.0), (0.38, 1.0), (0.37, 1.0)]))
    monkeypatch.setattr(bench, "run", lambda args: summary)
    out = tmp_path / "runs" / "bench.json"
    done = in_process("bench", "--out", out)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == json.loads(done.stdout.strip().splitlines()[-1])
    assert report.read_summary(out)["trl_step_ratio_small"] == summary["trl_step_ratio_small"]
