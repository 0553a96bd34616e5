"""Forks from the lab's side: where to fork a run that went wrong (`where_to_fork`: the last
kept checkpoint before its first warning), and `python -m labkit fork`, which trains the
forks (labkit.fork) and says how the change did against the unchanged continuation."""

from __future__ import annotations

import json
import math
from pathlib import Path

from labkit import fork as forking
from labkit.formulas import stats
from labkit.lab.summaries import COLLAPSE_ACCURACY, COLLAPSE_TRUNCATED, collapse_step
from labkit.run import rundir, stops
from labkit.records import METRICS, STOPPED


def first_warning(run_dir: str | Path) -> tuple[int, str] | None:
    """The run's first warning, (step, why): a collapse (labkit.lab.summaries.collapse_step:
    completions truncated, accuracy below a tenth of its start, a dead spell) or a stop
    rule that ended it; None for a run with neither."""
    run_dir = Path(run_dir)
    history = rundir.read_log(run_dir / METRICS)
    start = next((r["eval/accuracy"] for r in history if "eval/accuracy" in r), math.nan)
    dead_file = run_dir / stops.DEAD_FILE
    dead = json.loads(dead_file.read_text()) if dead_file.is_file() else None
    found = []
    step = collapse_step(history, start, dead)
    if step is not None:
        record = next((r for r in history if r.get("step") == step), {})
        if record.get("rollout/truncated_frac", 0) >= COLLAPSE_TRUNCATED:
            why = (f"{record['rollout/truncated_frac']:.0%} of its completions hit the token "
                   "limit")
        elif record.get("eval/accuracy") is not None and \
                record["eval/accuracy"] < COLLAPSE_ACCURACY * start:
            why = (f"held-out accuracy {record['eval/accuracy']:.3f}, below a tenth of its "
                   f"start {start:.3f}")
        else:
            why = f"a dead spell began ({dead.get('reason', 'no signal') if dead else ''})"
        found.append((step, f"collapse: {why}"))
    if (run_dir / STOPPED).is_file():
        stopped = json.loads((run_dir / STOPPED).read_text())
        found.append((int(stopped["step"]), f"stopped: {stopped.get('message', '')}"))
    return min(found) if found else None


def where_to_fork(run_dir: str | Path) -> tuple[int, str]:
    """The step to fork a run from and why: its last kept checkpoint before its first
    warning. ValueError where it has no warning, or keeps no checkpoint before it."""
    warning = first_warning(run_dir)
    if warning is None:
        raise ValueError(f"--at auto: {run_dir} neither collapsed nor stopped; give --at STEP")
    step, why = warning
    kept = [s for s in rundir.kept_steps(run_dir) if s < step]
    if not kept:
        raise ValueError(f"--at auto: {run_dir}'s first warning is at step {step} ({why}) and "
                         "it keeps no checkpoint before it (train with checkpoint_every and "
                         "keep_every)")
    return kept[-1], f"the last kept checkpoint before its first warning, at step {step}: {why}"


def final_accuracy(result) -> float:
    """A run's last held-out accuracy."""
    return result.accuracy_after


def run_fork_command(args) -> int:
    """`python -m labkit fork RUN --at STEP|auto --set FIELD=VALUE ... [--seeds N]`."""
    changes = forking.parse_changes(args.set)
    at = args.at
    if at == "auto":
        at, why = where_to_fork(args.run)
        print(f"fork at step {at}: {why}")
    else:
        try:
            at = int(at)
        except ValueError:
            raise ValueError(f"--at {args.at!r} must be a step or auto") from None
    if args.seeds is None:
        result = forking.fork(args.run, at, changes, out=args.out, steps=args.steps)
        print(result.run_dir)
        print(f"accuracy after the fork: {final_accuracy(result):.3f}")
        return 0
    found = forking.continuations(args.run, at, changes, args.seeds, out=args.out,
                                  steps=args.steps)
    print("continuation  changed  unchanged")
    for c, changed, same in found:
        print(f"{c:>12}  {final_accuracy(changed):7.3f}  {final_accuracy(same):9.3f}")
    if len(found) > 1:
        diff = stats.paired_interval([final_accuracy(a) for _, a, _ in found],
                                     [final_accuracy(b) for _, _, b in found])
        print(f"changed - unchanged, final accuracy: {diff.format()} ({diff.method}; "
              "exploratory)")
    return 0
