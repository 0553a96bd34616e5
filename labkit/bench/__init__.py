"""`python -m labkit bench`: labkit's GRPO step, rollout and memory, side by side with peers.

Every figure is a ratio against a peer measured in the same command, because a shared
machine's absolute timings drift. Each measurement runs in a fresh Python process (one
model load, its own allocator), one after another, never two at once:

* GRPO step vs TRL's `GRPOTrainer`, identical work: same model folder, prompts, B prompts x
  G completions, completion budget, beta > 0 (both compute reference log-probs), one update
  per batch, the same precision and gradient checkpointing, both set explicitly. A step is
  rollout + reward + reference + update; TRL's is timed from `on_step_begin` to
  `on_step_end` (its logging falls outside), labkit's around `trainer._one_step` (its
  metrics inside). Two configs: *tiny* (the embedded model) and *small* (a random
  Llama of ~26 M parameters with the embedded tokenizer, 128-token prompts).
* Rollout vs `model.generate` on the prompts repeated G times: greedy, the same tokens
  required.
* Memory of a GRPO step vs a PPO step (PPO also trains a critic): peak resident memory
  growth of a fresh process on the CPU, `torch.cuda.max_memory_allocated` on CUDA. Both
  sides run the same completions (`MEMORY_LR`).
* Scaling of labkit's step with G and with the completion length, with fitted slopes, and
  the time spent running prompts, which stays flat in G.
* A floor under labkit's step on each config (`step_floor`): the step's own matrix
  products replayed alone plus its other operations at a bare view's cost, beside TRL's
  step, to show how much of a step's time any implementation of its operations must spend.

The last line printed is one JSON object (keys in `main`'s docstring).
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

SMALL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8)
"""The *small* model: a Llama of ~26 M parameters."""
TEST_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4)
"""`--scale test`: the same measurements on a toy model, to check the command quickly."""

MEMORY_LR = 1e-30
"""lr and critic_lr of the memory comparison. A step's memory depends on its shapes, not on
what it learns; at a learning rate this small no weight of either policy changes at all (an
AdamW step of about lr is far below a float32 weight's last bit: at 1e-9 some 10% of the
weights still moved by one bit, enough to flip a near-tied draw), so with the same seeds
GRPO and PPO sample the same completions at every step (the summary's
`memory_same_completions` compares them token for token, and the target counts as missed
when they differ). At a real learning rate the random *small* model's PPO policy drops to
1-token completions after its first update, and the comparison would set GRPO's steady
state against PPO's first step, before its optimizer states exist."""

TARGETS = {"trl_step_ratio_tiny": ("<=", 0.25), "trl_step_ratio_small": ("<=", 0.5),
           "rollout_speedup_small": (">=", 1.5), "grpo_ppo_memory_ratio": ("<=", 0.75)}


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
    precision: str = "bf16"
    gradient_checkpointing: bool = False
    device: str = "cpu"
    steps: int = 10
    warmup: int = 3
    seed: int = 0

    def step_prompts(self, step: int) -> list[int]:
        """Indices of the prompts of step `step` (cycling through `prompts`)."""
        B = self.batch_prompts
        return [(step * B + i) % len(self.prompts) for i in range(B)]


# --- measurements: each runs inside a fresh process (`--worker NAME SPEC`) ------------------

def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _train_config(work: Work, **overrides):
    from labkit.config import TrainConfig

    return TrainConfig(model=work.model, batch_prompts=work.batch_prompts,
                       group_size=work.group_size, max_new_tokens=work.max_new_tokens,
                       beta=work.beta, precision=work.precision, device=work.device,
                       seed=work.seed, steps=work.warmup + work.steps, progress=False,
                       **overrides)


class _FixedProblems:
    """A problem source for `trainer._one_step`: the bench's prompts, B per step."""

    def __init__(self, work: Work):
        from labkit.tasks import Problem

        self.work = work
        self.problems = [Problem(p, a) for p, a in zip(work.prompts, work.answers)]

    def draw(self, step_seed: int):
        step = step_seed - self.work.seed * 1_000_003
        return [self.problems[i] for i in self.work.step_prompts(step)]


class _PromptTimer:
    """Seconds spent in forward passes over whole prompts (P tokens wide): the rollout's
    prefill, the reference's and the update's prompt pass. labkit.fast's passes are timed by
    wrapping its functions (a hook on the model would send it to its own forward instead);
    with the fast passes off, by hooks on the models' decoder stacks."""

    def __init__(self, modules, width: int, fast: bool):
        self.seconds, self.width, self._start = 0.0, width, None
        self._undo = []
        if fast:
            from labkit.fast import decoder, training

            self._wrap(training, "backbone", lambda args, kwargs: args[1].shape[1] == width)
            self._wrap(decoder.Decoder, "prefill", lambda args, kwargs: True)
        else:
            for m in modules:
                self._undo += [m.register_forward_pre_hook(self._before, with_kwargs=True).remove,
                               m.register_forward_hook(self._after, with_kwargs=True).remove]

    def _wrap(self, owner, name: str, is_prompt) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not is_prompt(args, kwargs):
                return original(*args, **kwargs)
            start = time.perf_counter()
            out = original(*args, **kwargs)
            _sync()
            self.seconds += time.perf_counter() - start
            return out
        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def close(self) -> None:
        for undo in self._undo:
            undo()

    def _is_prompt(self, kwargs) -> bool:
        ids = kwargs.get("input_ids")
        return ids is not None and ids.shape[1] == self.width

    def _before(self, module, args, kwargs):
        if self._is_prompt(kwargs):
            _sync()
            self._start = time.perf_counter()

    def _after(self, module, args, kwargs, out):
        if self._start is not None and self._is_prompt(kwargs):
            _sync()
            self.seconds += time.perf_counter() - self._start
            self._start = None


def _sync() -> None:
    """Wait for queued CUDA work, so a timer reads the work done (a no-op without CUDA)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _labkit_learner(work: Work, algo: str = "grpo", **overrides):
    from labkit import trainer

    config = _train_config(work, algo=algo, **overrides)
    accelerator = trainer._accelerator(config)
    learner, tokenizer = trainer.build_learner(config, accelerator)
    return config, learner, tokenizer, accelerator.device


_TIMES = ("step_s", "rollout_s", "update_s", "prompt_s")
"""Per-step seconds `_labkit_step_times` records (besides token counts and fingerprints)."""


def _labkit_step_times(config, learner, tokenizer, device, work: Work, steps: int, warmup: int,
                       prompt_width: int | None = None) -> dict:
    """Run `warmup + steps` GRPO/PPO steps; per-step seconds after warm-up."""
    from labkit import trainer
    from labkit.algos import grpo_step, ppo_step
    from labkit.scoring import MODEL_PASSES

    source = _FixedProblems(replace(work, batch_prompts=config.batch_prompts))
    step_fn = grpo_step if config.algo == "grpo" else ppo_step
    policy = learner.accelerator.unwrap_model(learner.policy)
    timer = None
    if prompt_width:
        stacks = [m.model for m in (policy, learner.reference) if m is not None]
        timer = _PromptTimer(stacks, prompt_width, fast=learner.passes is not MODEL_PASSES)
    out = {key: [] for key in (*_TIMES, "tokens", "completions")}
    try:
        for step in range(1, warmup + steps + 1):
            if timer is not None:
                timer.seconds = 0.0
            _sync()
            start = time.perf_counter()
            record = trainer._one_step(config, learner, tokenizer, source, step_fn, step, device)
            _sync()
            elapsed = time.perf_counter() - start
            if step > warmup:
                out["step_s"].append(elapsed)
                out["rollout_s"].append(record["perf/rollout_s"])
                out["update_s"].append(record["perf/update_s"])
                out["prompt_s"].append(timer.seconds if timer is not None else 0.0)
                batch = record["_report"][2]
                out["tokens"].append(int(batch.completion_mask.sum()))
                out["completions"].append(_digest(batch.completion_ids))
    finally:
        if timer is not None:
            timer.close()
    return out


def _digest(ids) -> str:
    """A fingerprint of a step's completion ids: equal digests, the same completions."""
    import hashlib

    return hashlib.sha256(ids.cpu().numpy().tobytes()).hexdigest()[:16]


_PRODUCTS = ("mm", "bmm", "addmm", "baddbmm", "addbmm")
"""The aten matrix products (`F.linear` and `torch.matmul` reach torch's dispatcher as these)."""


def step_floor(run_step, device, replays: int = 5) -> dict:
    """A floor under one step as labkit runs it: the step's matrix products replayed alone,
    back to back, plus its other operations at the cost of the cheapest one torch dispatches
    (a bare view, made in C++ with no Python in between).

    `run_step()` runs once under a dispatch mode that counts every operation torch dispatches
    (forward, backward and optimizer, in inference mode or not) and records the inputs'
    layouts (shapes, strides, dtypes) of each matrix product. The products are replayed on
    random inputs of those layouts (one tensor per distinct layout), and as many views as the
    step had other operations are made by one `unbind`; each figure is the median of
    `replays` timings. Every operation of the step is counted at no more than its cost, and
    none of the step's Python runs, so the step takes longer than `floor_s` (on CUDA, where
    the host's dispatching overlaps the device's products: than the larger of the two)."""
    from typing import NamedTuple

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Layout(NamedTuple):  # what a product's replay needs of one tensor input
        shape: tuple
        stride: tuple
        dtype: torch.dtype
        device: torch.device

    products = {getattr(torch.ops.aten, name).default for name in _PRODUCTS}
    calls, dispatched = [], [0]

    def layout(arg):
        if isinstance(arg, torch.Tensor):
            return Layout(tuple(arg.shape), arg.stride(), arg.dtype, arg.device)
        return arg

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            dispatched[0] += 1
            if func in products:
                calls.append((func, [layout(a) for a in args], dict(kwargs or {})))
            return func(*args, **(kwargs or {}))

    with Recorder():
        run_step()

    made = {}

    def fresh(arg):
        if not isinstance(arg, Layout):
            return arg
        if arg not in made:  # strides may overlap (an expanded gradient)
            extent = 1 + sum((n - 1) * st for n, st in zip(arg.shape, arg.stride) if n > 0)
            base = torch.empty(extent, dtype=arg.dtype, device=arg.device).normal_()
            made[arg] = base.as_strided(arg.shape, arg.stride)
        return made[arg]

    replay = [(func, [fresh(a) for a in args], kwargs) for func, args, kwargs in calls]
    others = dispatched[0] - len(calls)
    probe = torch.zeros(others, device=device)

    def products_once():
        for func, args, kwargs in replay:
            func(*args, **kwargs)

    def others_once():
        probe.unbind()

    def median_seconds(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(replays):
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    products_s, others_s = median_seconds(products_once), median_seconds(others_once)
    on_cpu = torch.device(device).type == "cpu"
    return {"floor_s": products_s + others_s if on_cpu else max(products_s, others_s),
            "floor_products_s": products_s, "floor_others_s": others_s,
            "floor_ops": dispatched[0], "floor_products": len(calls)}


def worker_labkit(work: Work) -> dict:
    """labkit's GRPO step times, and the floor under one more step (`step_floor`)."""
    from labkit import trainer
    from labkit.algos import grpo_step

    config, learner, tokenizer, device = _labkit_learner(work)
    out = _labkit_step_times(config, learner, tokenizer, device, work, work.steps, work.warmup)
    source, step = _FixedProblems(work), work.warmup + work.steps + 1
    floor = step_floor(lambda: trainer._one_step(config, learner, tokenizer, source, grpo_step,
                                                 step, device), device)
    return out | {key: [value] for key, value in floor.items()}


def worker_trl(work: Work) -> dict:
    """The same steps with TRL's GRPOTrainer on the same model folder and prompts."""
    import datasets
    import trl
    from transformers import TrainerCallback

    from labkit.rewards import correctness

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self._start = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._start)

    total = work.warmup + work.steps
    order = [i for step in range(1, total + 1) for i in work.step_prompts(step)]
    data = datasets.Dataset.from_dict({"prompt": [work.prompts[i] for i in order],
                                       "answer": [work.answers[i] for i in order]})
    with tempfile.TemporaryDirectory() as out:
        args = trl.GRPOConfig(
            output_dir=out, per_device_train_batch_size=work.batch_prompts * work.group_size,
            num_generations=work.group_size, max_completion_length=work.max_new_tokens,
            max_steps=total, learning_rate=1e-3, beta=work.beta, temperature=1.0,
            bf16=work.precision == "bf16", gradient_checkpointing=work.gradient_checkpointing,
            use_cpu=work.device == "cpu", seed=work.seed, report_to="none",
            save_strategy="no", logging_steps=total, disable_tqdm=True,
            dataloader_num_workers=0, shuffle_dataset=False)
        timer = StepTimer()
        trainer = trl.GRPOTrainer(model=work.model, reward_funcs=correctness, args=args,
                                  train_dataset=data, callbacks=[timer])
        trainer.train()
    return {"step_s": timer.seconds[work.warmup:]}


def worker_rollout(work: Work) -> dict:
    """Greedy completion tokens per second: labkit's rollout vs model.generate, same batch."""
    import torch

    from labkit.models import load
    from labkit.rollout import encode_prompts, rollout

    model, tokenizer = load(work.model, device=work.device, dtype="fp32")
    model.eval()
    prompts = list(work.prompts[:work.batch_prompts])
    G, T = work.group_size, work.max_new_tokens
    ids, mask = encode_prompts(tokenizer, prompts, model.device)
    # greedy generate refuses num_return_sequences > 1: the rows are repeated G times, as
    # TRL's sampler repeats each prompt, so generate prefills every prompt G times
    ids, mask = ids.repeat_interleave(G, dim=0), mask.repeat_interleave(G, dim=0)

    def ours():
        batch = rollout(model, tokenizer, prompts, group_size=G, max_new_tokens=T, greedy=True)
        return batch.completion_ids.masked_fill(batch.completion_mask == 0, -1)

    def peer():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=T,
                                 eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        return out[:, ids.shape[1]:]

    seconds = {"labkit": [], "generate": []}
    results = {}
    for rep in range(work.warmup + work.steps):
        for name, fn in (("labkit", ours), ("generate", peer)):
            _sync()
            start = time.perf_counter()
            results[name] = fn()
            _sync()
            if rep >= work.warmup:
                seconds[name].append(time.perf_counter() - start)
    ours = [row[row >= 0].tolist() for row in results["labkit"]]  # each up to its EOS
    theirs = results["generate"].tolist()
    same = len(ours) == len(theirs) and all(a == b[:len(a)] for a, b in zip(ours, theirs))
    return {"seconds": seconds, "tokens": sum(map(len, ours)), "identical": same}


def worker_memory(work: Work, algo: str) -> dict:
    """Peak memory growth of building the learner and running `work.steps` steps at
    `MEMORY_LR`; each step's completion token count and fingerprint."""
    import torch

    cuda = work.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_mb()
    config, learner, tokenizer, device = _labkit_learner(work, algo, lr=MEMORY_LR,
                                                         critic_lr=MEMORY_LR)
    times = _labkit_step_times(config, learner, tokenizer, device, work, work.steps, 0)
    peak = torch.cuda.max_memory_allocated() / 2**20 - base / 2**20 if cuda \
        else _peak_rss_mb() - base
    return {"peak_growth_mb": peak, "algo": algo, "lr": config.lr, "tokens": times["tokens"],
            "completions": times["completions"]}


def worker_scaling(work: Work, groups: list[int], lengths: list[int], prompt_width: int) -> dict:
    """labkit's step time against G (at the work's length) and against the completion
    length (at the work's G), on one learner; plus the plain (prompt G times) update at the
    work's G and length."""
    config, learner, tokenizer, device = _labkit_learner(work)
    points = [("group_size", G, replace(config, group_size=G)) for G in groups]
    points += [("max_new_tokens", T, replace(config, max_new_tokens=T)) for T in lengths]
    points += [("plain", work.group_size, replace(config, share_prompt=False))]
    out = []
    for axis, value, cfg in points:
        times = _labkit_step_times(cfg, learner, tokenizer, device, work, work.steps,
                                   work.warmup, prompt_width)
        out.append({"axis": axis, "value": value,
                    **{k: statistics.median(times[k]) for k in _TIMES}})
    return {"points": out}


WORKERS = {"labkit": worker_labkit, "trl": worker_trl, "rollout": worker_rollout,
           "memory": worker_memory, "scaling": worker_scaling}


def _run_worker(name: str, work: Work, **kwargs) -> dict:
    """Run a measurement in a fresh Python process; its last stdout line is its JSON."""
    spec = json.dumps({"work": work.__dict__, "kwargs": kwargs})
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "labkit.bench", "--worker", name, spec],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"the {name} measurement failed:\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- inputs ---------------------------------------------------------------------------------

def build_small_model(path: Path, shape: dict) -> int:
    """Save a randomly initialised Llama with the embedded tokenizer; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from labkit.models import load

    _, tokenizer = load(device="cpu")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **shape)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def long_prompts(count: int, tokens: int, seed: int = 0) -> list[str]:
    """`count` arithmetic-looking prompts of exactly `tokens` tokens each (with BOS)."""
    from labkit.models import load
    from labkit.rollout import encode_prompts

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
    from labkit.tasks import ArithmeticTask

    problems = ArithmeticTask().sample(count, "train", seed=7)
    return [p.prompt for p in problems], [p.answer for p in problems]


# --- the command ----------------------------------------------------------------------------

def _median(values) -> float:
    return statistics.median(values) if values else float("nan")


def _slope(xs, ys) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def check_args(args) -> None:
    """Reject bad options before any model loads."""
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
    precision = args.precision
    shape = TEST_SMALL if args.scale == "test" else SMALL
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    common = dict(beta=args.beta, precision=precision, device=device,
                  gradient_checkpointing=False, steps=args.steps, warmup=args.warmup)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        small_path = Path(tmp) / "small-llama"
        params = build_small_model(small_path, shape)
        from labkit.models import EMBEDDED_PATH

        prompts, answers = tiny_prompts(64)
        tiny = Work(str(EMBEDDED_PATH), tuple(prompts), tuple(answers), max_new_tokens=16,
                    **common)
        long = long_prompts(16, 128)
        small = Work(str(small_path), tuple(long), tuple("0" for _ in long), max_new_tokens=64,
                     **common)
        for label, work in (("tiny", tiny), ("small", small)):
            # labkit and TRL take turns, `rounds` times, and each side's steps are pooled:
            # a slow spell of the shared machine then falls on both sides, not on one
            for side in ("labkit", "trl"):
                results[f"{side}_{label}"] = {}
            for turn in range(args.rounds):
                for side in ("labkit", "trl"):
                    say(f"[bench] GRPO step, {label}: {'TRL' if side == 'trl' else side} "
                        f"(round {turn + 1} of {args.rounds})")
                    for key, values in _run_worker(side, work).items():
                        results[f"{side}_{label}"].setdefault(key, []).extend(values)
        say("[bench] rollout vs model.generate")
        rollout_work = replace(small, batch_prompts=4, max_new_tokens=64,
                               steps=max(3, args.steps // 2), warmup=1)
        results["rollout"] = _run_worker("rollout", rollout_work)
        say("[bench] memory: GRPO step, PPO step")
        memory_work = replace(small, steps=2, warmup=0)
        for algo in ("grpo", "ppo"):
            results[f"memory_{algo}"] = _run_worker("memory", memory_work, algo=algo)
        if args.scaling:
            say("[bench] scaling with G and completion length")
            groups, lengths = ([2, 4, 8, 16], [16, 32, 64, 128]) if args.scale == "full" \
                else ([2, 4], [8, 16])
            scaling_work = replace(small, steps=max(2, args.steps // 3), warmup=1)
            results["scaling"] = _run_worker("scaling", scaling_work, groups=groups,
                                             lengths=lengths, prompt_width=128)["points"]
    return summarize(results, params=params, device=device, precision=precision, args=args)


def summarize(results: dict, *, params: int, device: str, precision: str, args) -> dict:
    step = {k: _median(v["step_s"]) for k, v in results.items()
            if k.startswith(("labkit_", "trl_"))}
    roll = results["rollout"]
    tok_s = {name: roll["tokens"] / _median(s) for name, s in roll["seconds"].items()}
    mem = {algo: results[f"memory_{algo}"]["peak_growth_mb"] for algo in ("grpo", "ppo")}
    summary = {
        "trl_step_ratio_tiny": step["labkit_tiny"] / step["trl_tiny"],
        "trl_step_ratio_small": step["labkit_small"] / step["trl_small"],
        "rollout_speedup_small": tok_s["labkit"] / tok_s["generate"],
        "grpo_ppo_memory_ratio": mem["grpo"] / mem["ppo"],
        "labkit_step_s_tiny": step["labkit_tiny"], "trl_step_s_tiny": step["trl_tiny"],
        "labkit_step_s_small": step["labkit_small"], "trl_step_s_small": step["trl_small"],
        "labkit_rollout_s_small": _median(results["labkit_small"]["rollout_s"]),
        "labkit_update_s_small": _median(results["labkit_small"]["update_s"]),
        "rollout_tokens_per_s_labkit": tok_s["labkit"],
        "rollout_tokens_per_s_generate": tok_s["generate"],
        "rollout_identical": roll["identical"],
        "grpo_peak_mb": mem["grpo"], "ppo_peak_mb": mem["ppo"],
        "memory_same_completions": results["memory_grpo"]["completions"] ==
        results["memory_ppo"]["completions"],
        "memory_tokens_per_step": results["memory_grpo"]["tokens"],
        "memory_lr": results["memory_grpo"]["lr"],
        "precision": precision, "gradient_checkpointing": False, "device": device,
        "small_params": params, "steps_timed": args.steps, "warmup": args.warmup,
        "rounds": args.rounds,
        "beta": args.beta, "torch_threads": _threads(),
    }
    for label in ("tiny", "small"):
        ours = results[f"labkit_{label}"]
        if "floor_s" in ours:  # see step_floor
            for key in ("floor_s", "floor_products_s", "floor_others_s"):
                summary[f"{key}_{label}"] = _median(ours[key])
            for key in ("floor_ops", "floor_products"):
                summary[f"{key}_{label}"] = int(_median(ours[key]))
            summary[f"floor_ratio_{label}"] = summary[f"floor_s_{label}"] / step[f"trl_{label}"]
    points = results.get("scaling")
    if points:
        by = {axis: [p for p in points if p["axis"] == axis]
              for axis in ("group_size", "max_new_tokens", "plain")}
        g = by["group_size"]
        summary["scaling"] = points
        summary["slope_step_s_per_completion_of_group"] = _slope(
            [p["value"] for p in g], [p["step_s"] for p in g])
        summary["slope_prompt_s_per_completion_of_group"] = _slope(
            [p["value"] for p in g], [p["prompt_s"] for p in g])
        t = by["max_new_tokens"]
        summary["slope_step_s_per_completion_token"] = _slope(
            [p["value"] for p in t], [p["step_s"] for p in t])
        shared = [p for p in g if p["value"] == by["plain"][0]["value"]]
        if shared:
            summary["prompt_shared_update_speedup"] = by["plain"][0]["update_s"] / \
                shared[0]["update_s"]
    summary["targets_met"] = {key: (summary[key] <= bound if op == "<=" else summary[key] >= bound)
                              for key, (op, bound) in TARGETS.items()}
    # unequal work is no comparison: the memory target needs the same completions both sides
    summary["targets_met"]["grpo_ppo_memory_ratio"] &= summary["memory_same_completions"]
    return summary


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def table(summary: dict) -> str:
    """The human-readable report printed above the JSON line."""
    s = summary
    rows = [
        ("GRPO step, tiny (embedded, 2x8, 16 tok)", f"{s['labkit_step_s_tiny']:.3f} s",
         f"{s['trl_step_s_tiny']:.3f} s (TRL)", "trl_step_ratio_tiny"),
        ("GRPO step, small (Llama, 2x8, 128+64 tok)", f"{s['labkit_step_s_small']:.3f} s",
         f"{s['trl_step_s_small']:.3f} s (TRL)", "trl_step_ratio_small"),
        ("rollout, small (4x8, greedy, 64 tok)", f"{s['rollout_tokens_per_s_labkit']:.0f} tok/s",
         f"{s['rollout_tokens_per_s_generate']:.0f} tok/s (generate)", "rollout_speedup_small"),
        ("peak memory, small, GRPO vs PPO", f"{s['grpo_peak_mb']:.0f} MB",
         f"{s['ppo_peak_mb']:.0f} MB (PPO)", "grpo_ppo_memory_ratio"),
    ]
    lines = [f"{'comparison':<44}{'labkit':>14}{'peer':>26}{'ratio':>8}  target",
             "-" * 104]
    for label, ours, peer, key in rows:
        op, bound = TARGETS[key]
        mark = "met" if s["targets_met"][key] else "MISSED"
        lines.append(f"{label:<44}{ours:>14}{peer:>26}{s[key]:>8.3f}  {op} {bound} {mark}")
    lines.append(f"precision {s['precision']} (both sides), gradient checkpointing off (both), "
                 f"device {s['device']}, {s['torch_threads']} torch threads, beta {s['beta']}, "
                 f"median of {s['rounds']} x {s['steps_timed']} steps, each run after "
                 f"{s['warmup']} warm-up, labkit and TRL taking turns; "
                 f"small model {s['small_params'] / 1e6:.1f} M params; "
                 f"greedy tokens identical: {s['rollout_identical']}; memory: both at lr "
                 f"{s['memory_lr']:g}, same completions: {s['memory_same_completions']}")
    if "floor_s_tiny" in s:
        lines += ["", "floor under labkit's step (`bench.step_floor`): its matrix products "
                      "replayed alone, plus its other dispatched operations at the cost of a "
                      "bare view"]
        for label in ("tiny", "small"):
            lines.append(
                f"  {label:<6}{s[f'floor_s_{label}']:.4f} s = {s[f'floor_ratio_{label}']:.3f} of "
                f"TRL's step ({s[f'floor_products_{label}']} products "
                f"{s[f'floor_products_s_{label}']:.4f} s + "
                f"{s[f'floor_ops_{label}'] - s[f'floor_products_{label}']:,} other operations "
                f"{s[f'floor_others_s_{label}']:.4f} s); labkit's step is "
                f"{s[f'labkit_step_s_{label}'] / s[f'floor_s_{label}']:.2f}x its floor")
    if "scaling" in s:
        lines += ["", f"{'scaling (small)':<28}{'step s':>9}{'rollout s':>11}{'update s':>10}"
                      f"{'prompt s':>10}", "-" * 68]
        for p in s["scaling"]:
            name = "plain update, G" if p["axis"] == "plain" else \
                {"group_size": "G", "max_new_tokens": "completion tokens"}[p["axis"]]
            prompt = "-" if p["axis"] == "plain" else f"{p['prompt_s']:.3f}"  # not P wide there
            lines.append(f"{name + ' = ' + str(p['value']):<28}{p['step_s']:>9.3f}"
                         f"{p['rollout_s']:>11.3f}{p['update_s']:>10.3f}{prompt:>10}")
        lines.append(f"slopes: {s['slope_step_s_per_completion_of_group']:.4f} s per unit of G, "
                     f"{s['slope_step_s_per_completion_token']:.5f} s per completion token, "
                     f"prompt passes {s['slope_prompt_s_per_completion_of_group']:+.5f} s per "
                     f"unit of G")
        if "prompt_shared_update_speedup" in s:
            lines.append(f"prompt-shared update vs plain (prompt G times): "
                         f"{s['prompt_shared_update_speedup']:.2f}x faster")
    return "\n".join(lines)


def add_parser(sub) -> None:
    cmd = sub.add_parser("bench", help="time labkit's GRPO step, rollout and memory against "
                                       "TRL, model.generate and PPO")
    cmd.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    cmd.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    cmd.add_argument("--rounds", type=int, default=2,
                     help="times labkit and TRL take turns at each step comparison (their "
                          "timed steps pooled)")
    cmd.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                     help="mixed precision of the update, the same on both sides")
    cmd.add_argument("--beta", type=float, default=0.04, help="KL coefficient (> 0 so both "
                                                               "sides run the reference)")
    cmd.add_argument("--device", default=None, help="cpu or cuda[:N]; default: CUDA if present")
    cmd.add_argument("--no-scaling", dest="scaling", action="store_false",
                     help="skip the scaling sweep over G and completion length")
    cmd.add_argument("--scale", choices=["full", "test"], default="full",
                     help="test: a toy 'small' model and a short sweep, to check the command")
    cmd.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def main_bench(args) -> int:
    summary = run(args)
    print(table(summary))
    print(json.dumps(summary))
    return 0


def _worker_main(name: str, spec: str) -> None:
    data = json.loads(spec)
    work = Work(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["work"].items()})
    if WORKERS.get(name) is None:
        raise SystemExit(f"unknown worker {name!r}")
    print(json.dumps(WORKERS[name](work, **data["kwargs"])))
