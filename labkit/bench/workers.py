"""The measurements, each run in a fresh Python process (`python -m labkit.bench --worker NAME
SPEC`, one model load, its own allocator), one after another, never two at once."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from labkit.bench.floor import step_floor
from labkit.bench.inputs import Work
from labkit.bench.timing import TIMES, labkit_trainer, step_times, sync
from labkit.model.learner import peak_rss_mb
from labkit.probes.tensor_memory import TensorPeak

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


MEMORY_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""The memory workers' glibc setting: every allocation from 64 KiB up is its own mapping,
returned to the system when freed. By default glibc raises that threshold as blocks are
freed (up to 32 MiB), after which mid-sized tensors come from a heap that keeps freed
space; the peak resident memory then follows the heap's fragmentation more than the
tensors alive (one fp32 forward and backward of the small model with LoRA adapters: 2.2 GB
by default, 0.97 GB with the threshold fixed; without adapters 1.1 GB both ways). Both
sides of a comparison run with it; other C libraries ignore it."""


def _rss_mb() -> float:
    """Resident memory now, MiB: /proc on Linux, psutil elsewhere (it must be installed)."""
    if os.path.exists("/proc/self/statm"):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def worker_labkit(work: Work, floor: bool = True) -> dict:
    """labkit's GRPO step times, and with `floor` the floor under one more step
    (`step_floor`)."""
    trainer = labkit_trainer(work)
    out = step_times(trainer, work, work.steps, work.warmup)
    if not floor:
        return out
    step = work.warmup + work.steps + 1
    problems = work.step_problems(step)
    floor = step_floor(lambda: trainer.step(step, problems), trainer.device)
    return out | {key: [value] for key, value in floor.items()}


def worker_trl(work: Work) -> dict:
    """The same steps with TRL's GRPOTrainer on the same model folder and prompts."""
    import datasets
    import trl
    from transformers import TrainerCallback

    from labkit.problems.rewards import correctness

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

    from labkit.model.models import load
    from labkit.model.rollout import encode_prompts, rollout

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
            sync()
            start = time.perf_counter()
            results[name] = fn()
            sync()
            if rep >= work.warmup:
                seconds[name].append(time.perf_counter() - start)
    ours = [row[row >= 0].tolist() for row in results["labkit"]]  # each up to its EOS
    theirs = results["generate"].tolist()
    same = len(ours) == len(theirs) and all(a == b[:len(a)] for a, b in zip(ours, theirs))
    return {"seconds": seconds, "tokens": sum(map(len, ours)), "identical": same}


def import_trainer_code(work: Work, lora: bool = False) -> None:
    """Import the code that building and stepping a trainer on `work`'s model loads (the
    trainer, the model's transformers class, the answer checker, peft with `lora`) and probe
    for CUDA, so that a memory baseline taken next already holds it. Importing the model's
    class alone grows a process by over 100 MB of libraries' code and data, by a different
    amount with each install (torch's CUDA build, transformers' version), and by the same
    amount for GRPO and PPO: counted in both peaks it pulls their ratio towards 1."""
    import math_verify  # noqa: F401  (labkit.problems.rewards imports it on first use)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import labkit.trainer  # noqa: F401

    config = AutoConfig.from_pretrained(work.model)
    classes = AutoModelForCausalLM._model_mapping
    if type(config) in classes:  # (a model with its own code imports it while building)
        classes[type(config)]  # imports the modeling module
    torch.cuda.is_available()
    if lora:
        import peft  # noqa: F401


def worker_memory(work: Work, algo: str, **overrides) -> dict:
    """The tensors' peak (`tensor_peak_mb`, labkit.probes.tensor_memory on the CPU, the
    allocator's growth on CUDA) and the process's peak memory growth (`peak_growth_mb`,
    context on the CPU) of building the trainer (`overrides` on its TrainConfig) and
    running `work.steps` steps at `MEMORY_LR`, from a baseline taken once the code they run
    is imported (`import_trainer_code`); each step's completion token count and
    fingerprint."""
    import torch

    import_trainer_code(work, lora=overrides.get("lora_rank", 0) > 0)

    # At MEMORY_LR the critic's zero-initialised value head moves to about 1e-30 in the first
    # step, and from the second on the critic's gradients are subnormal floats, which an x86
    # CPU multiplies many times slower (a small-model PPO step took 16x as long). Flushing
    # them to zero changes no tensor's shape, so no memory figure. The flag is the CPU's,
    # global to the process: set back on the way out (a caller in the same process, such as
    # a test, keeps IEEE subnormals).
    torch.set_flush_denormal(True)
    try:
        cuda = work.device.startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = _rss_mb()
        tensors = None if cuda else TensorPeak("cpu").start()
        trainer = labkit_trainer(work, algo, lr=MEMORY_LR, critic_lr=MEMORY_LR, **overrides)
        times = step_times(trainer, work, work.steps, 0)
        peak = torch.cuda.max_memory_allocated() / 2**20 - base / 2**20 if cuda \
            else peak_rss_mb() - base
        # the tensors' peak: on CUDA the allocator's growth is that already; on the CPU the
        # allocator's own events (the process's growth stays as context)
        tensor_peak = peak if cuda else tensors.stop()
    finally:
        torch.set_flush_denormal(False)
    return {"peak_growth_mb": peak, "tensor_peak_mb": tensor_peak, "algo": algo,
            "lr": trainer.config.lr, "tokens": times["tokens"],
            "completions": times["completions"]}


def worker_scaling(work: Work, groups: list[int], lengths: list[int], prompt_width: int,
                   plain: bool = True) -> dict:
    """labkit's step time against G (at the work's length) and against the completion
    length (at the work's G), on one trainer; with `plain`, also the plain (prompt G times)
    update at the work's G and length."""
    trainer = labkit_trainer(work)
    config = trainer.config
    points = [("group_size", G, replace(config, group_size=G)) for G in groups]
    points += [("max_new_tokens", T, replace(config, max_new_tokens=T)) for T in lengths]
    if plain:
        points += [("plain", work.group_size, replace(config, share_prompt=False))]
    out = []
    for axis, value, cfg in points:
        times = step_times(trainer.with_config(cfg), work, work.steps, work.warmup, prompt_width)
        out.append({"axis": axis, "value": value,
                    **{k: statistics.median(times[k]) for k in TIMES}})
    return {"points": out}


def worker_cost(work: Work, algo: str) -> dict:
    """`bench --cost`: the tensors' peak from before the trainer is built to the end of its
    second step (`labkit.probes.tensor_memory.TensorPeak`, the same window as a run's
    perf/tensor_peak_mb), at MEMORY_LR with a coin-flip reward, and a third step timed outside that window; the update's
    padded tokens (sequences x (prompt + longest completion)) of the second step."""
    import torch

    torch.set_flush_denormal(True)  # (worker_memory says why)
    try:
        peak = TensorPeak(work.device).start()
        # a random model's answers are all wrong and cut at the budget: a coin for a verifier,
        # scored on cut completions too, gives every group both rewards, so DPO has pairs to
        # train on and every advantage is live
        trainer = labkit_trainer(work, algo, lr=MEMORY_LR, critic_lr=MEMORY_LR,
                                 reward="noisy(p=0.5)", score_truncated=True)
        for step in (1, 2):
            result = trainer.step(step, work.step_problems(step))
            if peak.device.type == "cuda":
                peak.observe(torch.cuda.max_memory_allocated() / 2**20)
        peak_mb = peak.stop()
        batch = result.batch
        sequences = int(batch.completion_ids.shape[0])  # (prompt_ids: one row per prompt)
        tokens = sequences * int(batch.prompt_ids.shape[1] + batch.completion_ids.shape[1])
        sync()
        start = time.perf_counter()
        trainer.step(3, work.step_problems(3))
        sync()
        seconds = time.perf_counter() - start
    finally:
        torch.set_flush_denormal(False)
    return {"peak_mb": peak_mb, "tokens": tokens, "step_s": seconds,
            "sequences": sequences, "prompt": int(batch.prompt_ids.shape[1]),
            "completion": int(batch.completion_ids.shape[1])}


WORKERS = {"labkit": worker_labkit, "trl": worker_trl, "rollout": worker_rollout,
           "memory": worker_memory, "scaling": worker_scaling, "cost": worker_cost}


def run_worker(name: str, work: Work, **kwargs) -> dict:
    """Run a measurement in a fresh Python process; its last stdout line is its JSON."""
    spec = json.dumps({"work": work.__dict__, "kwargs": kwargs})
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1")
    if name == "memory":
        env |= MEMORY_ALLOCATOR
    done = subprocess.run([sys.executable, "-m", "labkit.bench", "--worker", name, spec],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        if done.returncode < 0:  # a signal: SIGKILL is most often the kernel out of memory
            tail += (f"\n(killed by signal {-done.returncode}"
                     f"{', most likely out of memory' if done.returncode == -9 else ''})")
        raise RuntimeError(f"the {name} measurement failed:\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker_main(name: str, spec: str) -> None:
    """Run worker `name` on the JSON `spec` that `run_worker` passes; print its JSON line."""
    data = json.loads(spec)
    work = Work(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["work"].items()})
    if WORKERS.get(name) is None:
        raise SystemExit(f"unknown worker {name!r}")
    print(json.dumps(WORKERS[name](work, **data["kwargs"])))
