"""`labkit.probes.estimator_quality` on a labkit policy: rollouts, scoring and the rewards registry.

`diagnose(policy, tokenizer, problems, ...)` measures one policy snapshot (and its critic)
on fixed problems and returns the record; `diagnose_trainer(trainer, ...)` does so for a
`labkit.trainer.Trainer` on the first held-out problems (fixed across steps) and returns
the flat `diag/...` floats for metrics.jsonl with the record for a diagnostics.jsonl line.
`python -m labkit diagnose` runs it from the command line (docs/diagnostics.md).

Shapes: B prompts, G completions per prompt, N = B*G rows, T completion tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from labkit.formulas.estimators import ESTIMATORS, AdvantageInputs, estimate
from labkit.model.rollout import rollout
from labkit.model.scoring import FAST_PASSES, MODEL_PASSES, token_logprobs, token_values
from labkit.probes.estimator_quality import GROUP_ESTIMATORS, Draw, Sampler, flat_metrics, measure
from labkit.probes.periodic import Periodic
from labkit.problems.rewards import REWARDS, check_rewards
from labkit.run.rundir import read_log
from labkit.settings.config import TrainConfig


def _check_measurable(name: str) -> None:
    """ValueError unless estimator `name` gives (N,) from the rewards and G alone: the
    diagnostics draw rewards, not token masks or extras."""
    ESTIMATORS.resolve(name, "estimators")  # an unknown name: the registry's error
    why = f"needs {list(ESTIMATORS.needs(name))}" if ESTIMATORS.needs(name) else ""
    if not why:
        try:
            out = estimate(name, AdvantageInputs(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)).advantages
            why = "" if tuple(out.shape) == (4,) else "gives per-token advantages"
        except ValueError as e:
            why = str(e)
    if why:
        raise ValueError(f"estimators: {name!r} cannot be measured by the diagnostics, which "
                         f"give an estimator the rewards and G alone: {why}")


@dataclass(frozen=True)
class DiagSettings:
    """The size of one measurement."""

    prompts: int = 16
    """B: fixed prompts measured (a trainer's first held-out problems)."""
    group_size: int | None = None
    """G of each batch; None is the run's group_size."""
    batches: int = 16
    """K independent batches of the same prompts with fresh samples."""
    samples: int = 128
    """M completions per prompt for V* and the reference gradient."""
    seed: int = 0
    """Seeds the draws (the reference draw and the K batches)."""
    estimators: tuple[str, ...] = GROUP_ESTIMATORS
    """Group estimators measured: names of labkit.formulas.estimators.ESTIMATORS that give one
    advantage per completion from the rewards alone (grpo, dr_grpo, rloo, none, opo's needs a
    mask: not these)."""

    def __post_init__(self):
        for name, low, why in (("prompts", 1, "one prompt"), ("batches", 3, "the jackknife"),
                               ("samples", 2, "a leave-one-out reference")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low} ({why}), got {value!r}")
        if self.group_size is not None and (not isinstance(self.group_size, int)
                                            or self.group_size < 2):
            raise ValueError(f"group_size must be None or an int >= 2 (a group baseline "
                             f"compares completions), got {self.group_size!r}")
        for name in self.estimators:
            _check_measurable(name)


def lm_sampler(policy, tokenizer, problems: Sequence, config, *, critic=None,
               passes=None) -> Sampler:
    """sampler(G, seed): G completions of each problem's prompt from `policy` (sampling as
    `config` says), rewarded by `config.reward` (truncated ones 0 unless
    `config.score_truncated`), with the critic's values when a critic is given."""
    passes = passes or (FAST_PASSES if config.fast else MODEL_PASSES)
    prompts = [p.prompt for p in problems]
    reward_fn = REWARDS.resolve(config.reward, "reward")

    def draw(group_size: int, seed: int) -> Draw:
        batch = rollout(policy, tokenizer, prompts, group_size=group_size,
                        max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                        top_k=config.top_k or 0, top_p=config.top_p, seed=seed,
                        decoder=passes.decoder)
        answers = [p.answer for p in problems for _ in range(group_size)]
        rewards = torch.tensor(check_rewards(reward_fn(batch.texts, answer=answers),
                                             config.reward), device=batch.completion_ids.device)
        if not config.score_truncated:
            rewards = rewards.masked_fill(batch.truncated, 0.0)  # (N,)
        values = None
        if critic is not None:
            with torch.no_grad():
                values = token_values(critic, batch, share_prompt=config.share_prompt).float()

        def logp():
            return token_logprobs(policy, batch, temperature=config.temperature,
                                  share_prompt=config.share_prompt, forward=passes.lm)[0]
        return Draw(rewards, logp, batch.completion_mask, values)
    return draw


def diagnose(policy, tokenizer, problems: Sequence, *, config=None, critic=None,
             settings: DiagSettings | None = None, step: int | None = None,
             passes=None) -> dict:
    """One measurement of `policy` (and `critic`) on `problems[:settings.prompts]`: the
    record of `labkit.probes.estimator_quality.measure`, with the prompts, the sampling
    settings, the step and the wall time. `config` (a TrainConfig, default the defaults) gives the
    sampling, the reward, the aggregation and the advantages' settings."""
    config = config or TrainConfig()
    settings = settings or DiagSettings()
    problems = list(problems)[:settings.prompts]
    group_size = settings.group_size or config.group_size
    start = time.perf_counter()
    sampler = lm_sampler(policy, tokenizer, problems, config, critic=critic, passes=passes)
    params = [p for p in policy.parameters() if p.requires_grad]
    record = measure(sampler, params, config, group_size=group_size,
                     batches=settings.batches, samples=settings.samples, seed=settings.seed,
                     estimators=settings.estimators)
    record["settings"] |= {"reward": config.reward, "temperature": config.temperature,
                           "max_new_tokens": config.max_new_tokens, "scale": config.scale,
                           "std_unbiased": config.std_unbiased, "gamma": config.gamma,
                           "lam": config.lam, "whiten_advantages": config.whiten_advantages,
                           "wall_s": round(time.perf_counter() - start, 3)}
    return {"step": step, **record, "prompts": [p.prompt for p in problems]}


def diagnose_trainer(trainer, settings: DiagSettings | None = None,
                     step: int | None = None) -> tuple[dict[str, float], dict]:
    """Measure a Trainer's current policy (and PPO's critic) on its first held-out problems:
    (flat `diag/...` floats for metrics.jsonl, the record for a diagnostics.jsonl line)."""
    learner = trainer.learner
    critic = None
    if learner.critic is not None:
        critic = learner.accelerator.unwrap_model(learner.critic)
    record = diagnose(trainer.policy, trainer.tokenizer, trainer.problems.eval,
                      config=trainer.config, critic=critic, settings=settings, step=step,
                      passes=learner.passes)
    return flat_metrics(record), record


DIAG_FILE = "diagnostics.jsonl"
"""A run's diagnostics: one JSON line per measurement (the `diagnose` record)."""


def settings_of(config) -> DiagSettings:
    """The DiagSettings a run with TrainConfig `config` measures with (seeded by its seed)."""
    return DiagSettings(prompts=config.diag_prompts, batches=config.diag_batches,
                        samples=config.diag_samples, seed=config.seed)


class RunDiagnostics(Periodic):
    """A run's diagnostics every `config.diag_every` steps (and at step 0 and the last step):
    `measure(trainer, step)` returns the flat `diag/...` floats for that step's metrics.jsonl
    record ({} on other steps) and appends the record to diagnostics.jsonl."""

    file = DIAG_FILE

    def __init__(self, config, run_dir):
        super().__init__(config, run_dir)
        self.settings = settings_of(config) if config.diag_every else None

    def due(self, step: int) -> bool:
        every = self.config.diag_every
        return bool(every) and (step % every == 0 or step == self.config.steps)

    def take(self, trainer, step: int) -> tuple[dict[str, float], dict]:
        return diagnose_trainer(trainer, self.settings, step)


def read_diagnostics(run_dir) -> list[dict]:
    """The records of a run's diagnostics.jsonl, in order (none when it has none)."""
    return read_log(Path(run_dir) / DIAG_FILE)


def table(record: dict) -> str:
    """The record's per-estimator figures as a text table, each figure with its standard
    error (`mean+-se`); rel_var and cos as trained, and raw."""
    def cell(fig):
        if fig is None or fig["mean"] is None:
            return "-"
        se = "" if fig["se"] is None else f"+-{fig['se']:.3g}"
        return f"{fig['mean']:.4g}{se}"
    names = list(record["grad_rel_var"]["raw"])
    head = ["estimator", "baseline_mse", "baseline_bias", "rel_var", "rel_var_raw", "cos",
            "cos_raw"]
    rows = [head] + [[n, cell(record["baseline_mse"].get(n)), cell(record["baseline_bias"].get(n)),
                      cell(record["grad_rel_var"]["trained"][n]),
                      cell(record["grad_rel_var"]["raw"][n]),
                      cell(record["grad_cos"]["trained"][n]), cell(record["grad_cos"]["raw"][n])]
                     for n in names]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


__all__ = ["DiagSettings", "lm_sampler", "diagnose", "diagnose_trainer", "flat_metrics",
           "DIAG_FILE", "settings_of", "RunDiagnostics", "read_diagnostics", "table"]
