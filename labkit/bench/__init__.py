"""`python -m labkit bench`: labkit's GRPO step, rollout and memory, side by side with peers.

Every figure is a ratio against a peer measured in the same command, because a shared
machine's absolute timings drift. Each measurement runs in a fresh Python process (one
model load, its own allocator), one after another, never two at once:

* GRPO step vs TRL's `GRPOTrainer`, identical work: same model folder, prompts, B prompts x
  G completions, completion budget, beta > 0 (both compute reference log-probs), one update
  per batch, the same precision and gradient checkpointing, both set explicitly. A step is
  rollout + reward + reference + update; TRL's is timed from `on_step_begin` to
  `on_step_end` (its logging falls outside), labkit's around `Trainer.step` (its
  metrics inside). Two configs: *tiny* (the embedded model) and *small* (a random
  Llama of ~26 M parameters with the embedded tokenizer, 128-token prompts).
* Rollout vs `model.generate` on the prompts repeated G times: greedy, the same tokens
  required.
* Memory of a GRPO step vs a PPO step (PPO also trains a critic): peak resident memory
  growth of a fresh process on the CPU, `torch.cuda.max_memory_allocated` on CUDA. Both
  sides run the same completions (`MEMORY_LR`).
* Memory of a GRPO step with LoRA (rank `LORA_RANK`) vs full fine-tuning, both on the
  model's own forward (the lean path does not take adapters), so the row measures LoRA
  alone: no second copy for the reference, no gradients or optimizer states for the base.
* Scaling of labkit's step with G and with the completion length, with fitted slopes, and
  the time spent running prompts, which stays flat in G.
* A floor under labkit's step on each config (`step_floor`): the step's own matrix
  products replayed alone plus its other operations at a bare view's cost, beside TRL's
  step, to show how much of a step's time any implementation of its operations must spend
  (the full bench, every round; `--quick` leaves it out, `--floor` adds it).

The last line printed is one JSON object (`report.summarize`): each figure against its
target (`report.TARGETS`), and each step ratio's 95% interval over the rounds with its
verdict. `--out FILE` also writes it to FILE; `--pool FILE ...` measures nothing and pools
several runs' summaries into each target figure's interval over the runs (`report.pool`).

The modules: `inputs` (the work, the small model, the prompts), `timing` (labkit's steps
timed through `labkit.trainer.Trainer`), `floor` (`step_floor`), `workers` (each measurement
in its own process), `report` (the summary and the table); this one is the command.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from labkit.bench import cost as cost_model
from labkit.bench.cost import SHAPES as COST_SHAPES
from labkit.bench.inputs import (QWEN_05B, SMALL, TEST_SMALL, Work, bench_precision,
                                  build_small_model, long_prompts, tiny_prompts)
from labkit.bench.report import pool, pool_table, read_summary, summarize, table
from labkit.bench.workers import run_worker
from labkit.model import learner
from labkit.settings.embedded import EMBEDDED_PATH

SCALES = {"full": SMALL, "test": TEST_SMALL, "qwen0.5b": QWEN_05B}
"""--scale: the shapes of the *small* model (the tiny one is always the embedded model)."""

LORA_RANK = 8
"""The LoRA memory row: adapters of this rank on every projection (TrainConfig's default
targets)."""

MODES = {"full": dict(steps=8, warmup=2, lora=True, floor=True),
         "quick": dict(steps=1, warmup=1, lora=False, floor=False)}
"""Timed and warm-up steps per measurement, the LoRA memory row and the step floor, where
--steps, --warmup, --lora / --no-lora and --floor / --no-floor are not given: the full
bench, and --quick (every comparison still in 3 rounds, one timed step a round, the scaling
table cut to the one point the consistency check needs, no LoRA row, no floor: on the
small model the floor's recorded step and replays take about as long as the rest of a
round's labkit worker twice over)."""


def resolve_mode(args) -> None:
    """Fill --steps, --warmup, --lora and --floor left unset from the mode (--quick or
    full)."""
    mode = MODES["quick" if getattr(args, "quick", False) else "full"]
    for key, value in mode.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def scaling_points(args, work: Work) -> dict | None:
    """The scaling worker's sweep: G over 2..16 and the completion length over 16..128 with
    the plain update (full); the comparison's shape alone (--quick, for the consistency
    check); toy lengths at --scale test; None with --no-scaling."""
    if not args.scaling:
        return None
    if getattr(args, "quick", False):
        return dict(groups=[work.group_size], lengths=[], plain=False)
    if args.scale == "test":
        return dict(groups=[2, 4], lengths=[8, 16], plain=True)
    return dict(groups=[2, 4, 8, 16], lengths=[16, 32, 64, 128], plain=True)


def check_args(args) -> None:
    """Reject bad options before any model loads."""
    resolve_mode(args)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if not args.beta > 0:
        raise ValueError(f"--beta must be > 0 (both sides then compute reference log-probs), "
                         f"got {args.beta}")
    if args.device is not None and not (args.device == "cpu" or args.device.startswith("cuda")):
        raise ValueError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.device is not None and args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: CUDA is not available here")
    try:
        import trl  # noqa: F401
    except ImportError as e:
        raise ValueError("bench compares with TRL: install the test extra "
                         "(pip install -e '.[test]')") from e


def run(args) -> dict:
    """All comparisons; prints the table and returns the JSON summary."""
    check_args(args)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = SCALES[args.scale]
    with_lora = args.lora and importlib.util.find_spec("peft") is not None
    # one bar over the worker processes: 2 sides x 2 sizes x rounds, rollout, memory x 2,
    # LoRA memory x 2, scaling; its description is the stage, its lines the log
    stages = Stages(4 * args.rounds + 3 + 2 * with_lora + bool(args.scaling), quiet=args.quiet)
    say, measure = stages.say, stages.counted(run_worker)
    capability = torch.backends.cpu.get_cpu_capability()
    if args.precision == "bf16" and device == "cpu" and not learner.cpu_bf16_native():
        print(f"warning: --precision bf16 on a CPU without native bf16 (capability "
              f"{capability}, no AVX512_BF16 or AMX): torch emulates it, slower than fp32; "
              "--precision auto picks fp32 here", file=sys.stderr, flush=True)
    common = dict(beta=args.beta, device=device, gradient_checkpointing=False,
                  steps=args.steps, warmup=args.warmup)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        small_path = Path(tmp) / "small-llama"
        params = build_small_model(small_path, shape)

        prompts, answers = tiny_prompts(64)
        tiny = Work(str(EMBEDDED_PATH), tuple(prompts), tuple(answers), max_new_tokens=16,
                    precision=bench_precision(args.precision, device, _card_params()),
                    **common)
        long = long_prompts(16, 128)
        small = Work(str(small_path), tuple(long), tuple("0" for _ in long), max_new_tokens=64,
                     precision=bench_precision(args.precision, device, params), **common)
        precision = {"tiny": tiny.precision, "small": small.precision}
        say(f"[bench] CPU capability {capability}, native bf16 {learner.cpu_bf16_native()}; "
            f"precision tiny {tiny.precision}, small {small.precision}")
        if not args.floor:
            say("[bench] no step floor in this run (--floor adds it)")
        for label, work in (("tiny", tiny), ("small", small)):
            results |= compare_rounds(label, work, args.rounds, say, measure=measure,
                                      floor_rounds=None if args.floor else 0)
        say("[bench] rollout vs model.generate")
        rollout_work = replace(small, batch_prompts=4, max_new_tokens=64,
                               steps=max(1, args.steps // 2), warmup=1)
        results["rollout"] = measure("rollout", rollout_work)
        say("[bench] memory: GRPO step, PPO step")
        memory_work = replace(small, steps=2, warmup=0)
        for algo in ("grpo", "ppo"):
            results[f"memory_{algo}"] = measure("memory", memory_work, algo=algo)
        if lora_row(args, say):
            say(f"[bench] memory: GRPO step with LoRA (rank {LORA_RANK}), with full "
                "fine-tuning, both on the model's own forward")
            for name, lora_rank in (("lora", LORA_RANK), ("full", 0)):
                results[f"memory_{name}"] = measure("memory", memory_work, algo="grpo",
                                                       fast=False, lora_rank=lora_rank)
        points = scaling_points(args, small)
        if points is not None:
            say("[bench] scaling with G and completion length" if points["plain"] else
                "[bench] the comparison's small step again, for the consistency check")
            scaling_work = replace(small, steps=max(2, args.steps // 3), warmup=1)
            results["scaling"] = measure("scaling", scaling_work, prompt_width=128,
                                          **points)["points"]
            results["scaling_shape"] = {"group_size": small.group_size,
                                        "max_new_tokens": small.max_new_tokens}
    stages.close()
    return summarize(results, params=params, device=device, precision=precision, args=args)


def run_cost(args) -> dict:
    """`--cost`: every shape of `args.cost` x GRPO, PPO and DPO, each in a fresh worker process
    (`workers.worker_cost`) on `cost.COST_WORK`'s batch; prints the table (measurements,
    held-out errors, predictions) and returns the JSON summary."""
    import torch

    if args.device is not None and not (args.device == "cpu" or args.device.startswith("cuda")):
        raise ValueError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    shapes = [s.strip() for s in args.cost.split(",") if s.strip()]
    bad = [s for s in shapes if s not in COST_SHAPES]
    if bad or not shapes:
        raise ValueError(f"--cost: unknown shape {bad[0] if bad else args.cost!r}; shapes: "
                         f"{', '.join(COST_SHAPES)}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    precision = "fp32" if args.precision == "auto" and device == "cpu" else (
        bench_precision(args.precision, device, 10**9))
    work = cost_model.COST_WORK
    stages = Stages(len(shapes) * len(cost_model.ALGOS), quiet=args.quiet)
    measure = stages.counted(run_worker)
    rows: list[dict] = []
    failed: list[dict] = []
    out = Path(args.out) if getattr(args, "out", None) else None
    if out is not None:
        check_out(out)
    with tempfile.TemporaryDirectory() as tmp:
        prompts = long_prompts(4, work["prompt_tokens"])
        for name in shapes:
            path = Path(tmp) / name
            build_small_model(path, COST_SHAPES[name])
            spec = Work(str(path), tuple(prompts), tuple("0" for _ in prompts),
                        batch_prompts=work["batch_prompts"], group_size=work["group_size"],
                        max_new_tokens=work["max_new_tokens"], beta=work["beta"],
                        precision=precision, device=device, steps=3, warmup=0)
            for algo in cost_model.ALGOS:
                stages.say(f"[bench] cost: {name}, {algo}")
                # DPO's own beta is dpo_beta; it always holds a reference
                try:
                    found = measure("cost", replace(spec, beta=0.0) if algo == "dpo" else spec,
                                    algo=algo)
                except RuntimeError as e:  # the others still run; the row says why it is not
                    failed.append({"shape": name, "algo": algo, "error": str(e).splitlines()[-1]})
                    stages.say(f"[bench] cost: {name}, {algo} failed: {failed[-1]['error']}")
                    _save_cost(out, rows, failed)
                    continue
                shape = COST_SHAPES[name]
                rows.append({"shape": name, "algo": algo, "precision": precision,
                             "tokens": found["tokens"], "peak_mb": found["peak_mb"],
                             "step_s": found["step_s"],
                             "flops": cost_model.step_flops(shape, algo, found["sequences"],
                                                            found["prompt"],
                                                            found["completion"])})
                stages.say(f"[bench] cost: {name}, {algo}: tensors' peak "
                           f"{found['peak_mb']:,.0f} MiB, step {found['step_s']:.2f} s")
                _save_cost(out, rows, failed)  # a later failure loses nothing measured
            shutil.rmtree(path, ignore_errors=True)  # a 0.5 B model is 2 GB on disk
    stages.close()
    summary: dict = {"device": device, "precision": precision, "rows": rows, "failed": failed}
    if all(any(r["shape"] == f and r["algo"] == a for r in rows)
           for f in cost_model.FIT for a in {r["algo"] for r in rows}) and rows:
        print(cost_model.table(rows))
        summary["held_out"] = cost_model.held_out(rows)
        summary["predictions"] = cost_model.predictions(rows)
    else:
        print("\n".join(f"{r['shape']} {r['algo']}: {r['peak_mb']:.0f} MiB, {r['step_s']:.2f} s"
                        for r in rows))
        print(f"(the cost model needs {', '.join(cost_model.FIT)} measured)")
    for f in failed:
        print(f"{f['shape']} {f['algo']}: not measured ({f['error']})")
    if out is not None:
        out.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _save_cost(out: Path | None, rows: list[dict], failed: list[dict]) -> None:
    """--out after each cost measurement: the rows so far (replaced whole, never appended)."""
    if out is not None:
        out.write_text(json.dumps({"rows": rows, "failed": failed, "partial": True}, indent=1)
                       + "\n")


class Stages:
    """The bench's progress: a tqdm bar over its `total` worker processes (ETA), described by
    the stage running; each stage's line is also written above the bar. `quiet`: nothing."""

    def __init__(self, total: int, quiet: bool = False):
        from tqdm.auto import tqdm

        self.quiet = quiet
        self.bar = tqdm(total=total, unit="worker", desc="bench", disable=quiet,
                        file=sys.stderr, dynamic_ncols=True)

    def say(self, *parts) -> None:
        if self.quiet:
            return
        text = " ".join(map(str, parts))
        self.bar.write(text, file=sys.stderr)
        if text.startswith("[bench] ") and not text.startswith("[bench] CPU"):
            self.bar.set_description_str(text[len("[bench] "):].split(" (")[0][:60])

    def counted(self, measure):
        """`measure`, each call counted on the bar (a rerun round grows the total)."""
        def run(*args, **kwargs):
            out = measure(*args, **kwargs)
            self.bar.update(1)
            if self.bar.n > self.bar.total:
                self.bar.total = self.bar.n
            return out
        return run

    def close(self) -> None:
        self.bar.close()


def lora_row(args, say) -> bool:
    """Whether to measure the LoRA memory row: with --lora (the full bench's default), and
    where peft is installed (the `lora` extra; without it the row is left out and that is
    said)."""
    if not args.lora:
        if getattr(args, "quick", False):
            say("[bench] --quick: no LoRA memory row (--lora adds it)")
        return False
    if importlib.util.find_spec("peft") is None:
        say("[bench] no LoRA memory row: peft is not installed (pip install 'labkit[lora]')")
        return False
    return True


OUTLIER = 1.5
"""A round whose median step strays more than this factor from the median over the rounds
(on either side) is flagged and run again, once, rather than pooled."""


def compare_rounds(label: str, work: Work, rounds: int, say, measure=None,
                   floor_rounds: int | None = None) -> dict:
    """labkit and TRL take turns on `work`, `rounds` times, so a slow spell of a shared
    machine falls on both sides; a round that strays (OUTLIER) is run again once and
    replaces the stray. Returns {"labkit_<label>": pooled step figures, "trl_<label>": ...,
    "rounds_<label>": [{"labkit": median step, "trl": ..., "rerun": bool, "floor": the
    round's step floor where measured}, ...]}.
    `measure(side, work, **options)` runs one side (default: its own worker process); labkit's
    side measures its step floor in the first `floor_rounds` rounds (all when None), with
    options {"floor": bool}."""
    measure = measure or run_worker

    def one(turn: int) -> dict:
        out = {}
        for side in ("labkit", "trl"):
            say(f"[bench] GRPO step, {label}: {'TRL' if side == 'trl' else side} "
                f"(round {turn + 1} of {rounds})")
            options = {"floor": floor_rounds is None or turn < floor_rounds} \
                if side == "labkit" else {}
            out[side] = measure(side, work, **options)
        return out

    done = [one(turn) for turn in range(rounds)]
    reruns = set()
    for turn in strays(done):
        say(f"[bench] round {turn + 1} of {label} strays more than {OUTLIER}x from the "
            "others: running it again")
        done[turn] = one(turn)
        reruns.add(turn)
    out: dict = {f"{side}_{label}": {} for side in ("labkit", "trl")}
    for measured in done:
        for side in ("labkit", "trl"):
            for key, values in measured[side].items():
                out[f"{side}_{label}"].setdefault(key, []).extend(values)
    out[f"rounds_{label}"] = [{"labkit": statistics.median(m["labkit"]["step_s"]),
                               "trl": statistics.median(m["trl"]["step_s"]),
                               "rerun": turn in reruns}
                              | ({"floor": m["labkit"]["floor_s"][0]}
                                 if "floor_s" in m["labkit"] else {})
                              for turn, m in enumerate(done)]
    return out


def strays(done: list[dict]) -> list[int]:
    """The rounds (indices) whose median step, on either side, is more than OUTLIER times
    above or below the median over all rounds of that side (robust to one stray among
    three); none with fewer than 3 rounds (two rounds cannot say which one strays)."""
    if len(done) < 3:
        return []
    medians = {side: [statistics.median(d[side]["step_s"]) for d in done]
               for side in ("labkit", "trl")}
    middle = {side: statistics.median(values) for side, values in medians.items()}
    return [turn for turn in range(len(done))
            if any(max(medians[side][turn] / middle[side], middle[side] / medians[side][turn])
                   > OUTLIER for side in medians)]


def _card_params() -> int:
    """The embedded model's parameter count, from its model card."""
    return int(json.loads((EMBEDDED_PATH / "card.json").read_text())["parameters"])


def add_parser(sub) -> None:
    cmd = sub.add_parser("bench", help="time labkit's GRPO step, rollout and memory against "
                                       "TRL, model.generate and PPO")
    cmd.add_argument("--quick", action="store_true",
                     help="fewer steps (1 timed after 1 warm-up, still 3 rounds), only the "
                          "scaling point of the comparison's shape, no LoRA row and no step "
                          "floor: a first look in about 5 minutes on 2 cores, noisier than "
                          "the full bench")
    cmd.add_argument("--steps", type=int, default=None,
                     help="timed steps per measurement (default 8, --quick 1)")
    cmd.add_argument("--warmup", type=int, default=None,
                     help="untimed steps first (default 2, --quick 1)")
    cmd.add_argument("--rounds", type=int, default=3,
                     help="times labkit and TRL take turns at each step comparison (their "
                          "timed steps pooled; from 3 rounds, a round that strays more than "
                          "1.5x from the others is run again)")
    cmd.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                     help="mixed precision of the update, the same on both sides; auto: bf16 "
                          "on a GPU that has it, and on a CPU only where it computes bf16 "
                          "natively (AVX512_BF16, AMX) for a model of >= 4 M parameters; "
                          "fp32 elsewhere")
    cmd.add_argument("--beta", type=float, default=0.04, help="KL coefficient (> 0 so both "
                                                               "sides run the reference)")
    cmd.add_argument("--device", default=None, help="cpu or cuda[:N]; default: CUDA if present")
    cmd.add_argument("--lora", action=argparse.BooleanOptionalAction, default=None,
                     help="the LoRA memory row (it needs peft, the `lora` extra); default: "
                          "on, off with --quick")
    cmd.add_argument("--floor", action=argparse.BooleanOptionalAction, default=None,
                     help="the floor under labkit's step (its matrix products replayed "
                          "alone), measured in every round; default: on, off with --quick")
    cmd.add_argument("--no-scaling", dest="scaling", action="store_false",
                     help="skip the scaling sweep over G and completion length")
    cmd.add_argument("--scale", choices=list(SCALES), default="full",
                     help="the 'small' model: full, a 26 M-parameter Llama; test: a toy one "
                          "and a short sweep, to check the command; qwen0.5b: Qwen2.5-0.5B's "
                          "shapes, random weights (for a GPU: scripts/gpu_check.sh)")
    cmd.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    cmd.add_argument("--out", default=None, metavar="FILE",
                     help="also write the JSON summary to FILE (for --pool)")
    cmd.add_argument("--cost", nargs="?", const="small,smollm2-135m,qwen0.5b", default=None,
                     metavar="SHAPES",
                     help="measure nothing else: the tensors' peak and step time of GRPO, "
                          "PPO and DPO at real models' shapes (comma-separated of "
                          f"{', '.join(COST_SHAPES)}; default all, random weights), the cost "
                          "model fitted on small and smollm2-135m, its held-out errors and "
                          "its predictions at Qwen2.5-1.5B and 7B (labkit.bench.cost)")
    cmd.add_argument("--pool", nargs="+", default=None, metavar="FILE",
                     help="measure nothing: pool earlier runs of one kind of machine (files "
                          "written by --out, or the bench's saved output) into each target "
                          "figure's 95%% interval over the runs and its verdict")


def main_bench(args) -> int:
    if getattr(args, "cost", None):
        summary = run_cost(args)
        print(json.dumps(summary))
        return 0
    if getattr(args, "pool", None):
        names = list(args.pool)
        pooled = pool([read_summary(name) for name in names], names)
        print(pool_table(pooled))
        print(json.dumps(pooled))
        return 0
    out = Path(args.out) if getattr(args, "out", None) else None
    if out is not None:
        check_out(out)
    summary = run(args)
    print(table(summary))
    print(json.dumps(summary))
    if out is not None:
        out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def check_out(path: Path) -> None:
    """--out must name a file that can be written, checked before any measuring: its folder
    is made, and a folder at the path or a place this process cannot write is refused."""
    if path.is_dir():
        raise ValueError(f"--out {path} is a folder: give a file name (e.g. {path}/bench.json)")
    path.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise ValueError(f"--out {path}: this process may not write there")
