"""A run's records as it writes them, and what a stop, a crash or a resume does to them.

`RunLog` holds the run's logs, each written through `rundir.Log`: metrics.jsonl,
rollouts.jsonl and the periodic probes' diagnostics.jsonl and credit.jsonl. A resume
restores the latest checkpoint and cuts every log back to it (`resume_point`); a run that
ends writes its last checkpoint, stopped.json when a rule stopped it, and the final model
(`finish`); a run that cannot go on keeps what a resume can use (`abort`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

from labkit.model import parallel
from labkit.model.learner import Learner, learner_state, restore_learner
from labkit.model.lora import save_final
from labkit.probes import samples
from labkit.probes.diagnose import RunDiagnostics
from labkit.probes.microscope import RunCredit
from labkit.run import rundir, stops
from labkit.run.trackers import Trackers
from labkit.settings.config import TrainConfig

STOPPED = "stopped.json"
"""Written into the run directory when a stop rule ends the run: the rule, step and value."""
METRICS = "metrics.jsonl"


class RunAborted(RuntimeError):
    """A run that cannot go on (a non-finite loss or reward); the message names the step, the
    cause and the checkpoint to resume from."""
def stop_message(run_dir: Path) -> str:
    try:
        return json.loads((run_dir / STOPPED).read_text(encoding="utf-8"))["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return "see stopped.json"
def parent_records(config: TrainConfig) -> list[dict]:
    """A fork's parent's metrics records up to the fork step (labkit.fork); [] for a run
    trained from step 0."""
    if not config.fork_of:
        return []
    return [r for r in rundir.read_log(Path(config.fork_of) / METRICS)
            if r.get("step", 0) <= config.fork_step]


class RunLog:
    """A run's logs as it writes them, each through `rundir.Log`: metrics.jsonl (every record
    so far, those of the run it resumes too, with the stop rules' and the dead-run watch's
    verdicts on them and the held-out accuracies among them), rollouts.jsonl (`samples`),
    diagnostics.jsonl and credit.jsonl (the periodic probes)."""

    def __init__(self, config: TrainConfig, run_dir: Path):
        path = run_dir / METRICS
        self.records = rundir.read_log(path)
        before = parent_records(config)  # a fork follows its parent's streaks up to its start
        self.accuracy = [r["eval/accuracy"] for r in before + self.records
                         if "eval/accuracy" in r]
        self.watch = stops.RunWatch(config)
        self.stopped: stops.Stop | stops.Dead | None = None
        for record in before + self.records:  # a resumed run follows an uninterrupted run's
            self.judge(record)                # streaks
        self.metrics = rundir.Log(path).open()
        self.rollouts = rundir.Log(run_dir / samples.FILE)  # rollouts_every
        self.diag = RunDiagnostics(config, run_dir)  # diag_every: diagnostics.jsonl
        self.credit = RunCredit(config, run_dir)  # credit_every: credit.jsonl
        # report_to: views of the same records (a resumed run's from its checkpoint on)
        self.trackers = Trackers(config.report_to, run_dir, config.to_dict(), self.records)

    def judge(self, record: dict) -> stops.Stop | stops.Dead | None:
        self.stopped = self.watch.update(record)
        return self.stopped

    def write(self, record: dict) -> None:
        self.metrics.write(record)
        self.trackers.log(record)
        self.records.append(record)
        if "eval/accuracy" in record:
            self.accuracy.append(record["eval/accuracy"])

    def close(self) -> None:
        for log in (self.metrics, self.rollouts, self.diag, self.credit, self.trackers):
            log.close()
def say_dead(run_dir: Path, bar, dead: stops.Dead, stopping: bool) -> None:
    """Record a dead spell in the run directory and show it on the progress bar; a run that
    goes on says it on stderr now (a stopping one does in `finish`, once)."""
    rundir.write_json(run_dir / stops.DEAD_FILE, dead.to_dict())
    bar.set_description(f"dead since step {dead.first}")
    if not stopping:
        tqdm.write(f"{run_dir}: {dead.message()} (stop_when_dead=False: the run goes on)",
                   file=sys.stderr)
def resume_point(learner: Learner, run_dir: Path, main: bool = True) -> int:
    """Restore the latest checkpoint and cut every log of the run back to it
    (`rundir.cut_logs`); the first step to run. The records after the checkpoint (and a torn
    last line) go: those steps run again. On several processes every one restores the
    checkpoint the main one found, and only the main one cuts the logs."""
    found = rundir.latest_checkpoint(run_dir) if main else None
    checkpoint = parallel.broadcast(found, learner.accelerator)
    if checkpoint is None:  # killed before its first checkpoint: start over
        if main:
            rundir.cut_logs(run_dir, -1)
        return 1
    state = rundir.load_checkpoint(checkpoint)
    restore_learner(learner, state)
    if main:
        rundir.cut_logs(run_dir, state["step"])
    return state["step"] + 1


def finish(run_dir: Path, learner: Learner, policy, tokenizer, last: int,
            stopped: stops.Stop | stops.Dead | None, config: TrainConfig) -> None:
    """The last checkpoint, then (a stop rule fired) stopped.json and a line on stderr, then
    the final model (with LoRA: merged, the adapters in final/adapter/). The checkpoint comes
    before stopped.json: a run killed in between is resumed, replays its records, and stops
    again at the same step."""
    rundir.save_checkpoint(run_dir, last, learner_state(learner),
                           keep_every=config.keep_every)
    if stopped is not None:
        rundir.write_json(run_dir / STOPPED, stopped.to_dict())
        tqdm.write(f"{run_dir}: {stopped.message()}", file=sys.stderr)
    if config.lora_rank:  # LoRA: the merged model, and the adapters in final/adapter/
        save_final(policy, tokenizer, run_dir / "final", config)
        return
    policy.save_pretrained(run_dir / "final")
    tokenizer.save_pretrained(run_dir / "final")


def abort(run_dir: Path, learner: Learner, step: int, error: Exception,
           clean: bool, keep_every: int = 0) -> RunAborted:
    """Checkpoint what can be resumed and say so. `clean`: no optimizer step of `step` ran,
    so the weights are those at the end of step - 1, a checkpoint a resume can use; else
    step's earlier minibatches already moved them and the state is kept apart, as
    `diverged_<step>.pt`, for inspection only."""
    if clean:
        path = rundir.save_checkpoint(run_dir, step - 1, learner_state(learner),
                                      keep_every=keep_every)
        where = f"its last checkpoint is {path}"
    else:
        kept = rundir.save_checkpoint(run_dir, step, learner_state(learner), name="diverged")
        latest = rundir.latest_checkpoint(run_dir)
        where = (f"the state mid-step is in {kept}; resume restarts from "
                 f"{latest if latest is not None else 'the beginning'}")
    return RunAborted(f"step {step}: {error}; the run stopped, {where}")
