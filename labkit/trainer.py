"""The training loop: repeat a GRPO or PPO step, evaluate, log, checkpoint, resume.

Every random draw of step s is seeded from (seed, s): the prompts, the samples, the
minibatch order. With the model, optimizer and scheduler restored from a checkpoint, a
resumed run therefore logs the same metrics as an uninterrupted one (on the CPU).
"""

from __future__ import annotations

import json
import math
import random
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labkit import metrics as M
from labkit import rundir, stops
from labkit.advantages import NonFiniteError
from labkit.algos import Learner, StepOutput, grpo_step, ppo_step
from labkit.config import TrainConfig, preflight
from labkit.evaluation import complete, evaluate
from labkit.rewards import REWARDS, RewardError, check_rewards, correctness
from labkit.rollout import RolloutBatch, rollout
from labkit.tasks import ArithmeticTask, Problem, _bucket, load_gsm8k

EVAL_SEED = 1234
"""Seed of the held-out problems: the same eval set for every run seed, so runs compare."""
STOPPED = "stopped.json"
"""Written into the run directory when a stop rule ends the run: the rule, step and value."""


class RunAborted(RuntimeError):
    """A run that cannot go on (a non-finite loss or reward); the message names the step, the
    cause and the checkpoint to resume from."""


@dataclass
class StepReport:
    """What a callback receives after each step (live plots read it)."""

    step: int
    metrics: dict
    rewards: torch.Tensor
    """(N,) rewards of the step's completions, G per prompt next to each other."""
    advantages: torch.Tensor
    """(N,) for GRPO, (N, T) for PPO."""
    batch: RolloutBatch
    config: TrainConfig


@dataclass
class RunResult:
    """Where a run wrote and how it went; `history` holds every metrics.jsonl record."""

    run_dir: Path
    config: TrainConfig
    steps: int
    """The last step run: config.steps, or the step at which a stop rule ended the run."""
    accuracy_before: float
    accuracy_after: float
    wall_s: float
    history: list[dict] = field(default_factory=list)
    stopped: str | None = None
    """Why a stop rule ended the run before `config.steps` (None: it ran every step)."""

    def summary(self) -> dict:
        return {"algo": self.config.algo, "steps": self.steps, "accuracy_before": self.accuracy_before,
                "accuracy_after": self.accuracy_after, "wall_s": round(self.wall_s, 2),
                "run_dir": str(self.run_dir), "stopped": self.stopped}


class ProblemSource:
    """Training prompts for each step, and the fixed held-out problems."""

    def __init__(self, config: TrainConfig):
        self.config = config
        if config.task == "arithmetic":
            self.task = ArithmeticTask(digits=config.digits, operands=config.operands,
                                       ops=config.ops)
            self.eval = self.task.sample(config.eval_n, "test", seed=EVAL_SEED, distinct=True)
        else:
            everything = load_gsm8k(config.gsm8k_path)
            self.train = [p for p in everything if _bucket(p.prompt) >= 20]
            held_out = [p for p in everything if _bucket(p.prompt) < 20]
            if not self.train or not held_out:
                raise ValueError(f"{config.gsm8k_path} is too small to split into train and "
                                 "held-out problems")
            self.eval = held_out[:config.eval_n]
        self.cgc = self.eval[:config.cgc_prompts]

    def draw(self, step_seed: int) -> list[Problem]:
        B = self.config.batch_prompts
        if self.config.task == "arithmetic":
            return self.task.sample(B, "train", seed=step_seed)
        return random.Random(step_seed).choices(self.train, k=B)


def _schedule(config: TrainConfig) -> Callable[[int], float]:
    """Learning-rate multiplier per optimizer step: linear warmup, then cosine or constant."""
    total, warm = config.optimizer_steps, config.warmup_steps

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def _accelerator(config: TrainConfig):
    from accelerate import Accelerator

    from labkit.models import resolve_device

    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    precision = config.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    mixed = "bf16" if precision == "bf16" else "no"
    _forget_other_precision(mixed)
    return Accelerator(cpu=device.type == "cpu", mixed_precision=mixed)


def _forget_other_precision(mixed: str) -> None:
    """accelerate keeps one process-wide state and refuses a second Accelerator with another
    mixed precision (a notebook that runs an fp32 run, then a bf16 one). In a single process
    that state holds nothing a finished run needs, so it is cleared; a distributed launch
    keeps its state (and its launcher's precision)."""
    from accelerate.state import AcceleratorState, PartialState

    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision", mixed) != mixed \
            and PartialState().num_processes == 1:
        AcceleratorState._reset_state()


def _cpu_bf16_attention(model) -> None:
    """Eager attention for bf16 autocast on a CPU: torch's fused attention kernels run bf16
    several times slower there than plain matmul + softmax at a rollout's shapes (one query
    over a few hundred cached keys: 1.8 ms against 0.9 ms a call, 2 cores), and the step
    follows (`python -m labkit bench`). Same numbers up to bf16 rounding."""
    if model is None or not hasattr(model, "set_attn_implementation"):
        return
    try:
        model.set_attn_implementation("eager")
    except (ValueError, ImportError):  # an architecture without it keeps its own
        pass


def _adamw(parameters, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel (one call per step, not a dozen operations per
    parameter tensor) where this torch has it for the parameters' device; the same update."""
    parameters = list(parameters)
    try:
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)


def build_learner(config: TrainConfig, accelerator):
    """Policy (+ frozen reference when beta > 0, + critic for PPO), optimizers, schedules."""
    from labkit.models import load
    from labkit.scoring import FAST_PASSES, MODEL_PASSES, ValueModel

    policy, tokenizer = load(config.model, device=accelerator.device, dtype="fp32")
    reference = None
    if config.beta > 0:
        # frozen: under bf16 autocast its products run in bf16 anyway, so it is held in bf16
        # (half the memory); only its norm weights round differently from an fp32 copy
        held = "bf16" if accelerator.mixed_precision == "bf16" else "fp32"
        reference, _ = load(config.model, device=accelerator.device, dtype=held)
        reference.requires_grad_(False)
    if accelerator.device.type == "cpu" and accelerator.mixed_precision == "bf16":
        for model in (policy, reference):
            _cpu_bf16_attention(model)
    passes = FAST_PASSES if config.lean else MODEL_PASSES
    factor = _schedule(config)
    optimizer = _adamw(policy.parameters(), config.lr, config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    policy.train()
    if config.algo == "ppo":
        critic = ValueModel(policy, hidden=passes.hidden).train()
        critic_optimizer = _adamw(critic.parameters(), config.critic_lr, config.weight_decay)
        critic_scheduler = torch.optim.lr_scheduler.LambdaLR(critic_optimizer, factor)
        policy, optimizer, scheduler, critic, critic_optimizer, critic_scheduler = \
            accelerator.prepare(policy, optimizer, scheduler, critic, critic_optimizer,
                                critic_scheduler)
        learner = Learner(policy, optimizer, scheduler, accelerator, reference, critic,
                          critic_optimizer, critic_scheduler, passes)
    else:
        policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
        learner = Learner(policy, optimizer, scheduler, accelerator, reference, passes=passes)
    return learner, tokenizer


def _state(learner: Learner) -> dict:
    acc = learner.accelerator
    state = {"policy": acc.unwrap_model(learner.policy).state_dict(),
             "optimizer": learner.optimizer.state_dict(),
             "scheduler": learner.scheduler.state_dict()}
    if learner.critic is not None:
        state |= {"critic": acc.unwrap_model(learner.critic).state_dict(),
                  "critic_optimizer": learner.critic_optimizer.state_dict(),
                  "critic_scheduler": learner.critic_scheduler.state_dict()}
    return state


def _restore(learner: Learner, state: dict) -> None:
    acc = learner.accelerator
    acc.unwrap_model(learner.policy).load_state_dict(state["policy"])
    learner.optimizer.load_state_dict(state["optimizer"])
    learner.scheduler.load_state_dict(state["scheduler"])
    if learner.critic is not None:
        acc.unwrap_model(learner.critic).load_state_dict(state["critic"])
        learner.critic_optimizer.load_state_dict(state["critic_optimizer"])
        learner.critic_scheduler.load_state_dict(state["critic_scheduler"])
    rundir.set_rng_state(state["rng"])


def run_eval(config: TrainConfig, policy, tokenizer, source: ProblemSource) -> dict:
    """Held-out greedy accuracy, pass@1 / pass@k, mean length, and CGC on fixed prompts."""
    figures = evaluate(policy, tokenizer, source.eval, samples=config.eval_samples,
                       temperature=config.temperature, max_new_tokens=config.max_new_tokens,
                       seed=EVAL_SEED)
    if source.cgc and config.group_size >= 2:
        texts = complete(policy, tokenizer, [p.prompt for p in source.cgc],
                         group_size=config.group_size, temperature=config.temperature,
                         max_new_tokens=config.max_new_tokens, seed=EVAL_SEED + 1)
        rewards = correctness(texts, answer=[p.answer for p in source.cgc
                                             for _ in range(config.group_size)])
        figures["eval/cgc"] = M.cgc(torch.tensor(rewards), config.group_size)
    return figures


def _memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train(config: TrainConfig | None = None, *, resume: str | Path | None = None,
          callbacks: Sequence[Callable[[StepReport], None]] = ()) -> RunResult:
    """Run (or resume) a training run and return where it wrote and how it went.

    The run holds its directory's lock (`rundir.RunLock`) until it returns, so a second run or
    a resume of this one cannot write there meanwhile. A stop rule (`config.stop_rules`)
    ends it early with a checkpoint, `stopped.json` and `RunResult.stopped`; a non-finite
    loss, reward or advantage raises RunAborted after checkpointing the last whole step.
    """
    start_time = time.perf_counter()
    if resume is not None:
        run_dir = Path(resume)
        config = TrainConfig.from_dict(rundir.read_config(run_dir))
        lock = rundir.RunLock(run_dir)
    else:
        config = config or TrainConfig()
        preflight(config)  # what the config names is on this machine, before anything is made
        if config.run_dir:
            lock = rundir.claim_run_dir(config.run_dir)
            run_dir = lock.run_dir
        else:
            run_dir = rundir.new_run_dir(config.algo)
            lock = rundir.RunLock(run_dir)
    try:
        if resume is None:
            rundir.write_config(run_dir, config.to_dict())
        elif (run_dir / STOPPED).is_file():
            raise ValueError(f"{run_dir} was ended by a stop rule ({_stop_message(run_dir)}): "
                             "it is finished; start a new run to train further")
        return _train(config, run_dir, resume is not None, callbacks, start_time)
    finally:
        lock.release()


def _stop_message(run_dir: Path) -> str:
    try:
        return json.loads((run_dir / STOPPED).read_text(encoding="utf-8"))["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return "see stopped.json"


def _train(config: TrainConfig, run_dir: Path, resuming: bool,
           callbacks: Sequence[Callable[[StepReport], None]], start_time: float) -> RunResult:
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    accelerator = _accelerator(config)
    learner, tokenizer = build_learner(config, accelerator)
    source = ProblemSource(config)
    step_fn = grpo_step if config.algo == "grpo" else ppo_step
    metrics_path = run_dir / "metrics.jsonl"
    first = _resume_point(learner, run_dir, metrics_path) if resuming else 1
    history = rundir.read_metrics(metrics_path)
    tracker = stops.StopRules(stops.parse(config.stop_rules))
    stopped = None
    for record in history:  # a resumed run follows the same streaks as an uninterrupted one
        stopped = tracker.update(record)
    writer = rundir.MetricsWriter(metrics_path)
    policy = accelerator.unwrap_model(learner.policy)
    device = accelerator.device
    if first == 1:
        record = {"step": 0, **run_eval(config, policy, tokenizer, source)}
        writer.write(record)
        history.append(record)
        stopped = tracker.update(record)
    accuracy = [r["eval/accuracy"] for r in history if "eval/accuracy" in r]
    todo = range(first, config.steps + 1) if stopped is None else range(0)
    bar = tqdm(todo, desc=config.algo, disable=not config.progress, initial=first - 1,
               total=config.steps)
    step, updates_before = first - 1, _update_count(learner)
    try:
        for step in bar:
            updates_before = _update_count(learner)
            record = _one_step(config, learner, tokenizer, source, step_fn, step, device)
            report = record.pop("_report")
            record = {"step": step, **record}
            evaluated = step % config.eval_every == 0 or step == config.steps
            if evaluated:
                record |= run_eval(config, policy, tokenizer, source)
            stopped = tracker.update(record)
            if stopped is not None and not evaluated:  # a stopped run ends evaluated too
                record |= run_eval(config, policy, tokenizer, source)
            if "eval/accuracy" in record:
                accuracy.append(record["eval/accuracy"])
            writer.write(record)
            history.append(record)
            for callback in callbacks:
                callback(StepReport(step, record, report[0], report[1], report[2], config))
            bar.set_postfix(reward=f"{record['rollout/reward_mean']:.2f}",
                            acc=f"{accuracy[-1]:.2f}" if accuracy else "-")
            if stopped is not None:
                break
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                rundir.save_checkpoint(run_dir, step, _state(learner))
    except (FloatingPointError, RewardError, NonFiniteError) as e:
        raise _abort(run_dir, learner, step, e, clean=_update_count(learner) == updates_before
                     ) from e
    finally:
        writer.close()
        bar.close()
    last = stopped.step if stopped is not None else config.steps
    _finish(run_dir, learner, policy, tokenizer, last, stopped)
    return RunResult(run_dir, config, last, accuracy[0] if accuracy else float("nan"),
                     accuracy[-1] if accuracy else float("nan"), time.perf_counter() - start_time,
                     history, stopped=stopped.message() if stopped is not None else None)


def _resume_point(learner: Learner, run_dir: Path, metrics_path: Path) -> int:
    """Restore the latest checkpoint and cut metrics.jsonl back to it; the first step to run.
    The records after the checkpoint (and a torn last line) go: those steps run again."""
    checkpoint = rundir.latest_checkpoint(run_dir)
    if checkpoint is None:  # killed before its first checkpoint: start over
        rundir.truncate_metrics(metrics_path, -1)
        return 1
    state = rundir.load_checkpoint(checkpoint)
    _restore(learner, state)
    rundir.truncate_metrics(metrics_path, state["step"])
    return state["step"] + 1


def _finish(run_dir: Path, learner: Learner, policy, tokenizer, last: int,
            stopped: stops.Stop | None) -> None:
    """The last checkpoint, then (a stop rule fired) stopped.json and a line on stderr, then
    the final model. The checkpoint comes before stopped.json: a run killed in between is
    resumed, replays its records, and stops again at the same step."""
    rundir.save_checkpoint(run_dir, last, _state(learner))
    if stopped is not None:
        rundir.write_json(run_dir / STOPPED, stopped.to_dict())
        tqdm.write(f"{run_dir}: {stopped.message()}", file=sys.stderr)
    policy.save_pretrained(run_dir / "final")
    tokenizer.save_pretrained(run_dir / "final")


def _update_count(learner: Learner) -> int:
    """Optimizer steps taken so far, from the scheduler, which steps with the optimizer."""
    return int(learner.scheduler.state_dict()["last_epoch"])


def _abort(run_dir: Path, learner: Learner, step: int, error: Exception,
           clean: bool) -> RunAborted:
    """Checkpoint what can be resumed and say so. `clean`: no optimizer step of `step` ran,
    so the weights are those at the end of step - 1, a checkpoint a resume can use; else
    step's earlier minibatches already moved them and the state is kept apart, as
    `diverged_<step>.pt`, for inspection only."""
    if clean:
        path = rundir.save_checkpoint(run_dir, step - 1, _state(learner))
        where = f"its last checkpoint is {path}"
    else:
        kept = rundir.save_checkpoint(run_dir, step, _state(learner), name="diverged")
        latest = rundir.latest_checkpoint(run_dir)
        where = (f"the state mid-step is in {kept}; resume restarts from "
                 f"{latest if latest is not None else 'the beginning'}")
    return RunAborted(f"step {step}: {error}; the run stopped, {where}")


def _one_step(config, learner, tokenizer, source, step_fn, step: int, device) -> dict:
    """Rollout, reward, update and metrics of step `step`."""
    step_seed = config.seed * 1_000_003 + step
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    problems = source.draw(step_seed)
    policy = learner.accelerator.unwrap_model(learner.policy)
    # one autocast region for the whole rollout: its weight casts (bf16) are made once and
    # reused by every decode step, not redone by each forward
    with learner.accelerator.autocast():
        batch = rollout(policy, tokenizer, [p.prompt for p in problems],
                        group_size=config.group_size, max_new_tokens=config.max_new_tokens,
                        temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
                        seed=step_seed, decoder=learner.passes.decoder)
    answers = [p.answer for p in problems for _ in range(config.group_size)]
    rewards = torch.tensor(check_rewards(REWARDS.resolve(config.reward)(
        batch.texts, answer=answers), config.reward), device=device)
    if not config.score_truncated:
        rewards = rewards.masked_fill(batch.truncated, 0.0)
    t1 = time.perf_counter()
    out: StepOutput = step_fn(config, learner, batch, rewards, step_seed)
    t2 = time.perf_counter()
    tokens = int(batch.completion_mask.sum())
    extra = {**out.stats, "perf/rollout_s": t1 - t0, "perf/update_s": t2 - t1,
             "perf/step_s": t2 - t0, "perf/tokens_per_s": tokens / max(t2 - t0, 1e-9),
             "perf/mem_mb": _memory_mb(device), "opt/lr": learner.scheduler.get_last_lr()[0]}
    record = M.step_metrics(rewards=rewards, group_size=config.group_size,
                            advantages=out.advantages, mask=batch.completion_mask,
                            truncated=batch.truncated, values=out.values, returns=out.returns,
                            extra=extra)
    record["_report"] = (rewards, out.advantages, batch)
    return record
