"""Fork a run: "what if I had changed this at step k?". A new run starts from the parent's
checkpoint at step k (weights, optimizer and scheduler, critic, random-number generators),
with the changed fields made to take effect, and trains to the parent's last step.

What a fork carries over: the checkpoint's state, and the parent's records up to step k for
the stop rules' and the dead-run watch's streaks (labkit.records.parent_records); its own
logs start after step k. What it changes: `lr` and `critic_lr` rescale the restored
schedules (a scheduler's `base_lrs` would otherwise bring the old rate back), `beta` is the
restored KL coefficient (0 -> > 0 loads the reference from the base model, and says so),
and every field read at each step (the clip, passes, loss and estimator fields, rewards,
stop rules) simply holds from step k + 1. Fields that fix what the checkpoint is (the model,
the task, the algorithm, LoRA) cannot change and are refused.

A continuation seed c (`continuation_seed`) draws the steps after k from stream c (prompts,
samples, minibatch order: labkit.trainer.step_seed); with none the fork draws as the parent
does, so a fork that changes nothing repeats the parent's records after k exactly.
`fork_seeds` draws N continuations with the change and the same N without it, paired by c.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from labkit.model.learner import machine
from labkit.run import rundir
from labkit.settings.config import TrainConfig
from labkit.settings.fields import parse_field
from labkit.trainer import train

IMMUTABLE = {
    "model": "the checkpoint's weights are that model's",
    "task": "the run's problems, and its held-out set, are that task's",
    "algo": "the optimizer, critic and reference in the checkpoint are that algorithm's",
    "lora_rank": "the checkpoint holds that LoRA's adapters",
    "lora_targets": "the checkpoint holds that LoRA's adapters",
    "lora_alpha": "the adapters' scale is part of the weights the checkpoint holds",
    "seed": "a fork draws a fresh continuation with --seeds (continuation_seed) instead",
    "gsm8k_path": "the run's problems, and its held-out set, come from that file",
    "dataset_path": "the run's problems, and its held-out set, come from that file",
    "code_path": "the run's problems, and its held-out set, come from that file",
    "digits": "the task's problems are drawn with it",
    "operands": "the task's problems are drawn with it",
    "min_operands": "the task's problems are drawn with it",
    "scratchpad": "the task's problems and model are chosen with it",
    "fork_of": "a fork names its parent itself",
    "fork_step": "a fork names its step with --at",
    "run_dir": "a fork writes its own folder (--out)",
    "warmup_steps": "the restored schedule was built with it",
    "schedule": "the restored schedule was built with it",
    "min_lr_ratio": "the restored schedule was built with it",
}
"""Fields a fork cannot change, and why."""


def parse_changes(items: list[str] | None) -> dict:
    """['lr=5e-4', 'beta=0.1'] -> {field: value} read by TrainConfig's own parser; ValueError
    naming an item that is not FIELD=VALUE, a field given twice, or a field a fork cannot
    change (IMMUTABLE, with why)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"--set {item!r} must be FIELD=VALUE")
        if key in IMMUTABLE:
            raise ValueError(f"--set {key}: a fork cannot change {key}: {IMMUTABLE[key]}")
        if key in out:
            raise ValueError(f"--set {key} is given twice")
        out[key] = parse_field(TrainConfig, key, value.strip(), f"--set {key}")
    return out


def checkpoint_at(parent: str | Path, step: int) -> Path:
    """The parent's kept checkpoint at `step`; ValueError naming the nearest kept ones."""
    path = Path(parent) / rundir.CHECKPOINTS / f"step_{step:06d}.pt"
    if path.is_file():
        return path
    kept = rundir.kept_steps(parent)
    if not kept:
        raise ValueError(f"--at {step}: {parent} keeps no checkpoint")
    below = [s for s in kept if s < step]
    above = [s for s in kept if s > step]
    near = ", ".join(str(s) for s in [*below[-1:], *above[:1]])
    raise ValueError(f"--at {step}: {parent} keeps no checkpoint at step {step}; the nearest "
                     f"kept: {near} (all kept: {', '.join(map(str, kept))}; train with "
                     "checkpoint_every and keep_every to keep more)")


def prepare(parent: str | Path, at: int, changes: dict | None = None, *,
            out: str | Path | None = None, steps: int | None = None,
            continuation_seed: int | None = None, progress: bool | None = None) -> Path:
    """Make a fork's folder, ready to train with `train(resume=...)`: its config.json (the
    parent's config with `changes`, to the parent's last step or `steps`, naming the parent,
    the step and the change) and the parent's checkpoint at `at` with the change made to
    take effect (`_apply`); out defaults to <parent>-fork<at>[-c<seed>] beside it. Refused
    before anything is written: an immutable field, a step with no kept checkpoint, a config
    the changed fields break."""
    parent = Path(parent)
    changes = dict(changes or {})
    for key in changes:
        if key in IMMUTABLE:
            raise ValueError(f"a fork cannot change {key}: {IMMUTABLE[key]}")
    before = TrainConfig.from_dict(rundir.read_config(parent))
    source = checkpoint_at(parent, at)
    last = before.steps if steps is None else steps
    if last <= at:
        raise ValueError(f"--steps {last}: a fork from step {at} trains to a later step")
    tail = f"-fork{at}" + ("" if continuation_seed is None else f"-c{continuation_seed}")
    out = Path(out) if out is not None else parent.with_name(parent.name + tail)
    config = dataclasses.replace(
        before, **changes, steps=last, run_dir=str(out), fork_of=str(parent), fork_step=at,
        continuation_seed=continuation_seed,
        **({} if progress is None else {"progress": progress}))
    if config.has_reference and not before.has_reference:
        print(f"fork: beta {before.beta:g} -> {config.beta:g}: the reference is the base model "
              f"({config.model or 'the embedded model'}), loaded fresh; the parent held none",
              file=sys.stderr)
    state = rundir.load_checkpoint(source)
    _apply(state, before, config)
    lock = rundir.claim_run_dir(out)  # a fresh folder: refused where another run writes
    try:
        rundir.write_config(out, config.to_dict(), machine(config),
                            fork={"parent": str(parent), "step": at,
                                  "changes": {k: str(v) for k, v in changes.items()},
                                  "continuation_seed": continuation_seed})
        # the parent's state as changed, its random-number generators' states with it
        rundir.save_checkpoint(out, at, {k: v for k, v in state.items() if k != "step"})
    finally:
        lock.release()
    return out


def fork(parent: str | Path, at: int, changes: dict | None = None, *,
         out: str | Path | None = None, steps: int | None = None,
         continuation_seed: int | None = None, progress: bool | None = None, callbacks=()):
    """Train a fork of `parent` from its checkpoint at step `at` with `changes` applied
    (`prepare`), to the parent's last step or `steps`; returns the fork's RunResult."""
    out = prepare(parent, at, changes, out=out, steps=steps,
                  continuation_seed=continuation_seed, progress=progress)
    return train(resume=out, callbacks=callbacks)


def _apply(state: dict, before: TrainConfig, after: TrainConfig) -> None:
    """Make the changed fields take effect in a checkpoint's state: the KL coefficient it
    restores, and its schedules' rates (base and current) scaled to the new lr and
    critic_lr."""
    state["beta"] = after.beta
    for rate, optimizer, scheduler in (("lr", "optimizer", "scheduler"),
                                       ("critic_lr", "critic_optimizer", "critic_scheduler")):
        old, new = getattr(before, rate), getattr(after, rate)
        if optimizer not in state or old == new:
            continue
        ratio = new / old
        for group in state[optimizer]["param_groups"]:
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
        sched = state[scheduler]
        sched["base_lrs"] = [b * ratio for b in sched["base_lrs"]]
        if "_last_lr" in sched:
            sched["_last_lr"] = [x * ratio for x in sched["_last_lr"]]


def continuations(parent: str | Path, at: int, changes: dict, seeds: int, *,
                  out: str | Path | None = None, steps: int | None = None,
                  progress: bool | None = None) -> list[tuple[int, object, object]]:
    """`seeds` continuations of `parent` from step `at`, paired: for each continuation seed
    c in 0..seeds-1 a fork with `changes` (<out>/changed-c<c>) and one without them
    (<out>/unchanged-c<c>), the parent's own settings drawing the same stream c; out
    defaults to <parent>-fork<at>. Returns (c, changed RunResult, unchanged RunResult)."""
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1 (continuations per arm), got {seeds}")
    if not changes:
        raise ValueError("--seeds pairs a change with the unchanged continuation: give the "
                         "change with --set FIELD=VALUE")
    parent = Path(parent)  # the first fork's `prepare` refuses a bad change or step first
    out = Path(out) if out is not None else parent.with_name(f"{parent.name}-fork{at}")
    found = []
    for c in range(seeds):
        changed = fork(parent, at, changes, out=out / f"changed-c{c}", steps=steps,
                       continuation_seed=c, progress=progress)
        same = fork(parent, at, {}, out=out / f"unchanged-c{c}", steps=steps,
                    continuation_seed=c, progress=progress)
        found.append((c, changed, same))
    return found
