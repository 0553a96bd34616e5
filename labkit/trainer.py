"""The training loop: repeat a GRPO or PPO step, evaluate, log, checkpoint, resume.

`Trainer` is the step API: built from a TrainConfig, it owns the accelerator, the learner,
the tokenizer and the problems, and `Trainer.step(s)` runs step s and returns a
`StepResult`. `train` owns a run: it repeats those steps and adds the run directory, the
lock, resume, stop rules, checkpoints and callbacks.

Every random draw of step s is seeded from `step_seed(config, s)`: the prompts, the samples,
the minibatch order. With the model, optimizer and scheduler restored from a checkpoint, a
resumed run therefore logs the same metrics as an uninterrupted one (on the CPU).
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labkit import algos, records, stages
from labkit.formulas import metrics as M
from labkit.formulas.advantages import NonFiniteError
from labkit.model import parallel
from labkit.model.learner import (build_learner, learner_state, machine, make_accelerator,
                                  peak_rss_mb, restore_learner, update_count)
from labkit.model.rollout import RolloutBatch
from labkit.probes import samples
from labkit.probes.evaluation import run_eval
from labkit.probes.tensor_memory import TensorPeak
from labkit.problems.rewards import RewardError, correctness
from labkit.problems.source import ARITHMETIC, ProblemSource
from labkit.problems.tasks import Problem
from labkit.records import STOPPED, RunAborted, RunLog
from labkit.reproducible import set_threads
from labkit.run import rundir
from labkit.settings.config import TrainConfig
from labkit.settings.preflight import preflight


CONTINUATION_STRIDE = 10**13
"""How far apart continuation streams' step seeds lie (labkit.fork): beyond any run's
seed * 1_000_003 + step for seeds below 10**6."""


def step_seed(config: TrainConfig, step: int) -> int:
    """The seed of every random draw of step `step` (prompts, samples, minibatch order); a
    fork's steps after `fork_step` with a `continuation_seed` c draw from stream c."""
    base = config.seed * 1_000_003 + step
    if config.continuation_seed is None or step <= config.fork_step:
        return base
    return base + (config.continuation_seed + 1) * CONTINUATION_STRIDE


@dataclass
class StepResult:
    """One step's outcome: what it drew, how it scored, and the metrics computed from those."""

    step: int
    seed: int
    """`step_seed(config, step)`."""
    rewards: torch.Tensor
    """(N,) rewards of the step's completions, G per prompt next to each other."""
    advantages: torch.Tensor
    """(N,) for GRPO, (N, T) for PPO."""
    batch: RolloutBatch
    metrics: dict
    """The flat metrics of the step (`labkit.formulas.metrics`): its metrics.jsonl record, less
    `step` and the evaluation figures."""
    view: dict | None = None
    """With `inspect`: the kept groups' rows and, per token, the entropy before the update
    and the ratio pi_new / pi_old after it (`labkit.probes.samples`)."""


class Trainer:
    """A run's live state without its directory: the accelerator, the learner (policy,
    reference, critic, optimizers, schedules), the tokenizer and the problems.

    Built from a config, it seeds python's and torch's generators with `config.seed` first;
    two Trainers of one config step alike (on the CPU)."""

    def __init__(self, config: TrainConfig, accelerator=None):
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        self.config = config
        self.accelerator = accelerator or make_accelerator(config)
        parallel.check_launch(config, self.accelerator)
        self.learner, self.tokenizer = build_learner(config, self.accelerator)
        self.problems = ProblemSource(config)

    @classmethod
    def from_run(cls, run_dir: str | Path, overrides: dict | None = None) -> tuple[Trainer, int]:
        """A Trainer holding the latest checkpoint of `run_dir` (its policy and, for PPO, its
        critic) and its config (with `overrides`), and the checkpoint's step."""
        config = TrainConfig.from_dict({**rundir.read_config(run_dir), **(overrides or {})})
        checkpoint = rundir.latest_checkpoint(run_dir)
        if checkpoint is None:
            raise FileNotFoundError(f"{run_dir} holds no checkpoint (checkpoints/step_*.pt)")
        trainer = cls(config)
        state = rundir.load_checkpoint(checkpoint, map_location=trainer.device)
        restore_learner(trainer.learner, state)
        return trainer, int(state["step"])

    @property
    def policy(self) -> torch.nn.Module:
        """The policy model itself (unwrapped from the accelerator)."""
        return self.accelerator.unwrap_model(self.learner.policy)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def with_config(self, config: TrainConfig) -> Trainer:
        """This trainer's models, optimizers and problems (shared, not copied), stepped with
        another config's step settings (group size, completion length, ...)."""
        other = copy.copy(self)
        other.config = config
        return other

    def step(self, step: int, problems: Sequence[Problem] | None = None,
             inspect: bool = False) -> StepResult:
        """Rollout, reward, update and metrics of step `step`, on `problems` (default: B
        drawn from the problem source with the step's seed); `inspect` adds the per-token
        view of the first rollouts_groups groups (`StepResult.view`)."""
        seed = step_seed(self.config, step)
        if problems is None:
            problems = self.problems.draw(seed)
        return _one_step(self.config, self.learner, self.tokenizer, list(problems), step, seed,
                         inspect)

    def evaluate(self) -> dict:
        """`run_eval` of the current policy: the held-out figures (`eval/...`) and the
        seconds they took (`perf/eval_s`)."""
        start = time.perf_counter()
        figures = run_eval(self.config, self.policy, self.tokenizer, self.problems)
        return figures | {"perf/eval_s": time.perf_counter() - start}


def _close_window(peak: tuple[TensorPeak, int], step: int, metrics: dict) -> dict:
    """`perf/tensor_peak_mb` on the window's last step ({} on the others)."""
    measure, last = peak
    if measure.device.type == "cuda" and step <= last:
        measure.observe(metrics["perf/mem_mb"])
    if step != last or not (measure.running or measure.device.type == "cuda"):
        return {}
    mib = measure.stop()
    return {} if mib is None else {"perf/tensor_peak_mb": mib}


def _memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mb()


def _one_step(config, learner, tokenizer, problems, step: int, step_seed: int,
              inspect: bool = False) -> StepResult:
    """`algos.step` on `problems`, timed, with its metrics (and, with `inspect`, the view of
    the kept rows before and after the update)."""
    device, view, marks = learner.accelerator.device, None, {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def on_rollout(batch, rewards) -> None:
        nonlocal view
        if inspect:
            view = samples.token_view(config, learner, batch, samples.logged_rows(config))
        marks["rollout"] = time.perf_counter()

    t0 = time.perf_counter()
    out = algos.step(config, learner, tokenizer, problems, step_seed, on_rollout)
    out.stats |= stages.sync_reference(config, learner, step)  # variant: iterative GRPO
    t2 = time.perf_counter()
    t1 = marks.get("rollout", t2)
    batch = out.batch
    if view is not None:
        view = samples.add_ratio(config, learner, batch, view)
    tokens = int(batch.completion_mask.sum())
    extra = {**out.stats, "perf/rollout_s": t1 - t0, "perf/update_s": t2 - t1,
             "perf/step_s": t2 - t0, "perf/tokens_per_s": tokens / max(t2 - t0, 1e-9),
             "perf/mem_mb": _memory_mb(device), "opt/lr": learner.scheduler.get_last_lr()[0]}
    if config.task in ARITHMETIC and len(batch.texts) == len(problems) * config.group_size:
        right = correctness(batch.texts,
                            answer=[p.answer for p in problems for _ in range(config.group_size)])
        extra |= M.form_stats(batch.texts, right, batch.completion_mask.sum(1).tolist())
    record = M.step_metrics(rewards=out.rewards, group_size=config.group_size,
                            advantages=out.advantages, mask=batch.completion_mask,
                            truncated=batch.truncated, values=out.values, returns=out.returns,
                            extra=extra)
    return StepResult(step, step_seed, out.rewards, out.advantages, batch, record, view)


# --- a run: the steps, written into a run directory ------------------------------------------

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
    view: dict | None = None
    """On the steps that keep a sample of rollouts: `StepResult.view`."""


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
    """Why a stop rule or a dead run ended the run before `config.steps` (None: it ran every
    step)."""
    dead: dict | None = None
    """The last dead spell found (`stops.Dead.to_dict()`, also in dead_run.json), or None."""

    def summary(self) -> dict:
        return {"algo": self.config.algo, "steps": self.steps, "accuracy_before": self.accuracy_before,
                "accuracy_after": self.accuracy_after, "wall_s": round(self.wall_s, 2),
                "run_dir": str(self.run_dir), "stopped": self.stopped, "dead_run": self.dead}


def train(config: TrainConfig | None = None, *, resume: str | Path | None = None,
          callbacks: Sequence[Callable[[StepReport], None]] = ()) -> RunResult:
    """Run (or resume) a training run and return where it wrote and how it went.

    The run holds its directory's lock (`rundir.RunLock`) until it returns, so a second run or
    a resume of this one cannot write there meanwhile. A stop rule (`config.stop_rules`) or a
    dead run (`config.dead_steps`, `stop_when_dead`) ends it early with a checkpoint,
    `stopped.json` and `RunResult.stopped`; a non-finite
    loss, reward or advantage raises RunAborted after checkpointing the last whole step.
    """
    start_time = time.perf_counter()
    run_dir = None
    if resume is not None:
        run_dir = Path(resume)
        config = TrainConfig.from_dict(rundir.read_config(run_dir))
        if (run_dir / STOPPED).is_file():
            raise ValueError(f"{run_dir} was stopped ({records.stop_message(run_dir)}): "
                             "it is finished; start a new run to train further")
    else:
        config = config or TrainConfig()
        preflight(config)  # what the config names is on this machine, before anything is made
    accelerator = make_accelerator(config)  # a distributed launch: joins the other processes
    parallel.check_launch(config, accelerator)
    main, lock = accelerator.is_main_process, None
    if main:  # several processes: the main one takes the directory, and alone writes there
        if resume is not None:
            lock = rundir.RunLock(run_dir)
        elif config.run_dir:
            lock = rundir.claim_run_dir(config.run_dir)
            run_dir = lock.run_dir
        else:
            run_dir = rundir.new_run_dir(config.algo)
            lock = rundir.RunLock(run_dir)
    run_dir = parallel.broadcast(run_dir, accelerator)
    set_threads(config.threads)
    peak = TensorPeak(accelerator.device)
    window = _tensor_window(config, run_dir if resume is not None else None) if main else 0
    try:
        if main and resume is None:
            rundir.write_config(run_dir, config.to_dict(), machine(config))
        if window:  # from before the model is built: every tensor the run makes is counted
            peak.start()
        trainer = Trainer(config, accelerator)
        if not main:
            return _follow(trainer, run_dir, resume is not None)
        return _train(trainer, run_dir, resume is not None, callbacks, start_time,
                      (peak, window))
    finally:
        if peak.running:
            peak.stop()
        if lock is not None:
            lock.release()


def _tensor_window(config: TrainConfig, resumed: Path | None) -> int:
    """The step whose end closes the tensors' peak window (`tensor_peak_step`, at most the
    last step); 0 when it is off, or when the run resumes past it."""
    window = min(config.tensor_peak_step, config.steps)
    latest = rundir.latest_checkpoint(resumed) if resumed is not None else None
    if latest is not None and rundir.checkpoint_step(latest) >= window:
        return 0
    return window


def _train(trainer: Trainer, run_dir: Path, resuming: bool,
           callbacks: Sequence[Callable[[StepReport], None]], start_time: float,
           peak: tuple[TensorPeak, int]) -> RunResult:
    config = trainer.config
    first = records.resume_point(trainer.learner, run_dir) if resuming else 1
    log = RunLog(config, run_dir)
    try:
        if first == 1:
            record = {"step": 0, **trainer.evaluate(), **log.diag.measure(trainer, 0)}
            log.write(record)
            log.judge(record)
        _run_steps(trainer, log, first, run_dir, callbacks, peak)
    finally:
        log.close()
    stopped, accuracy = log.stopped, log.accuracy
    last = stopped.step if stopped is not None else config.steps
    records.finish(run_dir, trainer.learner, trainer.policy, trainer.tokenizer, last, stopped,
            trainer.config)
    result = RunResult(run_dir, config, last, accuracy[0] if accuracy else float("nan"),
                       accuracy[-1] if accuracy else float("nan"),
                       time.perf_counter() - start_time, log.records,
                       stopped=stopped.message() if stopped is not None else None,
                       dead=log.watch.dead.to_dict() if log.watch.dead is not None else None)
    return parallel.broadcast(result, trainer.accelerator)


def _follow(trainer: Trainer, run_dir: Path, resuming: bool) -> RunResult:
    """A process other than the main one: from the same checkpoint, the same steps (its
    share of each), stopping where the main process stops; it writes nothing and returns
    the main process's RunResult."""
    acc = trainer.accelerator
    if resuming:
        records.resume_point(trainer.learner, run_dir, main=False)
    for step in parallel.broadcast(None, acc):  # the steps the main process runs
        try:
            trainer.step(step)
        except (FloatingPointError, RewardError, NonFiniteError) as e:
            raise RunAborted(f"step {step}: {e}; the run stopped (the main process keeps "
                             "its checkpoint)") from e
        if parallel.broadcast(None, acc):  # the main process stops here
            break
    return parallel.broadcast(None, acc)


def _run_steps(trainer: Trainer, log: RunLog, first: int, run_dir: Path,
               callbacks: Sequence[Callable[[StepReport], None]],
               peak: tuple[TensorPeak, int]) -> None:
    """Steps `first`..config.steps, each logged, evaluated every `eval_every` and at a stop,
    and checkpointed every `checkpoint_every`, until a stop rule fires; the tensors' peak
    window (`peak`: the measure and its last step) closes at its step."""
    config, learner = trainer.config, trainer.learner
    todo = range(first, config.steps + 1) if log.stopped is None else range(0)
    parallel.broadcast(todo, learner.accelerator)  # on several processes: the steps to run
    bar = tqdm(todo, desc=config.algo, disable=not config.progress, initial=first - 1,
               total=config.steps)
    step, updates_before = first - 1, update_count(learner)
    try:
        for step in bar:
            updates_before = update_count(learner)
            result = trainer.step(step, inspect=samples.keeps(config, step))
            record = {"step": step, **result.metrics, **log.diag.measure(trainer, step),
                      **log.credit.measure(trainer, step)}
            record |= _close_window(peak, step, result.metrics)
            evaluated = step % config.eval_every == 0 or step == config.steps
            if evaluated:
                record |= trainer.evaluate()
            if log.judge(record) is not None and not evaluated:  # a stopped run ends evaluated too
                record |= trainer.evaluate()
            log.write(record)
            if result.view is not None:  # rollouts_every: the kept groups, token by token
                log.rollouts.write(*samples.records(
                    step, trainer.problems.draw(result.seed), result.batch, result.rewards,
                    result.advantages, result.view, trainer.tokenizer))
            if log.watch.found is not None:
                records.say_dead(run_dir, bar, log.watch.found,
                                 stopping=log.stopped is log.watch.found)
            for callback in callbacks:
                callback(StepReport(step, record, result.rewards, result.advantages,
                                    result.batch, config, result.view))
            bar.set_postfix(reward=f"{record['rollout/reward_mean']:.2f}",
                            acc=f"{log.accuracy[-1]:.2f}" if log.accuracy else "-")
            if parallel.broadcast(log.stopped is not None, learner.accelerator):
                break
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                rundir.save_checkpoint(run_dir, step, learner_state(learner),
                                       keep_every=config.keep_every)
    except (FloatingPointError, RewardError, NonFiniteError) as e:
        raise records.abort(run_dir, learner, step, e,
                            clean=update_count(learner) == updates_before,
                            keep_every=config.keep_every) from e
    finally:
        bar.close()


