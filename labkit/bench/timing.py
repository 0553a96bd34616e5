"""Timing labkit's steps: a trainer built from the bench's work, its steps timed one by one
(through the trainer's public step API), and the seconds spent in prompt-wide passes."""

from __future__ import annotations

import time

from labkit.bench.inputs import Work
from labkit.model.scoring import MODEL_PASSES
from labkit.settings.config import TrainConfig
from labkit.trainer import Trainer


def sync() -> None:
    """Wait for queued CUDA work, so a timer reads the work done (a no-op without CUDA)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def train_config(work: Work, **overrides):
    """labkit's TrainConfig for `work` (its model, shapes, precision, device and seed)."""
    return TrainConfig(model=work.model, batch_prompts=work.batch_prompts,
                       group_size=work.group_size, max_new_tokens=work.max_new_tokens,
                       beta=work.beta, precision=work.precision, device=work.device,
                       seed=work.seed, steps=work.warmup + work.steps, progress=False,
                       **overrides)


def labkit_trainer(work: Work, algo: str = "grpo", **overrides):
    """A `labkit.trainer.Trainer` for `work`, `overrides` on top of its TrainConfig."""
    return Trainer(train_config(work, algo=algo, **overrides))


class PromptTimer:
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
            sync()
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
            sync()
            self._start = time.perf_counter()

    def _after(self, module, args, kwargs, out):
        if self._start is not None and self._is_prompt(kwargs):
            sync()
            self.seconds += time.perf_counter() - self._start
            self._start = None


TIMES = ("step_s", "rollout_s", "update_s", "prompt_s")
"""Per-step seconds `step_times` records (besides token counts and fingerprints)."""


def step_times(trainer, work: Work, steps: int, warmup: int,
               prompt_width: int | None = None) -> dict:
    """Run `warmup + steps` of the trainer's steps on the work's prompts (as many per step as
    the trainer's config asks); per-step seconds after warm-up, with each step's completion
    token count and fingerprint."""
    config = trainer.config
    timer = None
    if prompt_width:
        stacks = [m.model for m in (trainer.policy, trainer.learner.reference) if m is not None]
        timer = PromptTimer(stacks, prompt_width,
                            fast=trainer.learner.passes is not MODEL_PASSES)
    out = {key: [] for key in (*TIMES, "tokens", "completions")}
    try:
        for step in range(1, warmup + steps + 1):
            problems = work.step_problems(step, config.batch_prompts)
            if timer is not None:
                timer.seconds = 0.0
            sync()
            start = time.perf_counter()
            result = trainer.step(step, problems)
            sync()
            elapsed = time.perf_counter() - start
            if step > warmup:
                out["step_s"].append(elapsed)
                out["rollout_s"].append(result.metrics["perf/rollout_s"])
                out["update_s"].append(result.metrics["perf/update_s"])
                out["prompt_s"].append(timer.seconds if timer is not None else 0.0)
                out["tokens"].append(int(result.batch.completion_mask.sum()))
                out["completions"].append(digest(result.batch.completion_ids))
    finally:
        if timer is not None:
            timer.close()
    return out


def digest(ids) -> str:
    """A fingerprint of a step's completion ids: equal digests, the same completions."""
    import hashlib

    return hashlib.sha256(ids.cpu().numpy().tobytes()).hexdigest()[:16]
