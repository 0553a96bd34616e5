"""Training runs for the notebooks: where they write, and the experiments they run.

`compare` trains several algorithms on the same prompts over paired seeds; `group_size_runs`
sweeps GRPO's group size at an equal sample budget or prompt count; `live_training` runs
GRPO and PPO side by side for a live figure. `run_all` runs a set of configs in parallel
worker processes. Each run writes its own folder inside the notebook's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from labkit import grammar
from labkit.lab import confirm
from labkit.lab.progress import write_plan
from labkit.model.models import load
from labkit.probes import samples
from labkit.probes.diagnose import lm_sampler
from labkit.probes.estimator_quality import informative_share
from labkit.problems.source import ProblemSource
from labkit.run import rundir
from labkit.settings.config import TrainConfig, field_types
from labkit.settings.config_checks import POLICY_GRADIENT_ONLY
from labkit.settings.fields import parse, parse_field
from labkit.trainer import RunResult, StepReport, train

BUDGETS = ("samples", "prompts", "both")  # B*G fixed / B fixed / the two sweeps
# no progress bars in notebook outputs; one torch thread a run, so runs in parallel worker
# processes give the same numbers as runs one after the other
NOTEBOOK_DEFAULTS = dict(progress=False, threads=1, rollouts_every=10)
"""Every notebook run: one torch thread, no bar, and a sample of its rollouts (two groups
at the first step, every tenth and the last: rollouts.jsonl, the inspector's)."""
# where notebooks run without a run_dir write, instead of the project's experiments/runs/
RUNS_ENV = "LABKIT_NOTEBOOK_RUNS"


def setup(threads: int = 1) -> None:
    """Torch on `threads` CPU threads (the embedded model's 128-wide matrices are too small
    to share; on a busy machine extra threads mostly wait), and no
    transformers progress bars (widgets in every cell that loads or saves a model)."""
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()


def project_root(start: str | Path | None = None) -> Path:
    """The nearest folder at or above `start` (default: the cwd) holding a labkit checkout
    (pyproject.toml next to labkit/), else the cwd itself. Notebooks run from notebooks/
    therefore write to the checkout's experiments/runs/, never into notebooks/."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "labkit").is_dir():
            return folder
    return here


def resolve_run_dir(run_dir: str, stem: str) -> Path:
    """The notebook's output folder: `run_dir` when given (created if missing), else a new
    `<root>/<stem>/<date-time>-<pid>`, where root is $LABKIT_NOTEBOOK_RUNS when set and the
    project's experiments/runs/ otherwise."""
    if run_dir:
        path = Path(run_dir).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        return path
    root = os.environ.get(RUNS_ENV) or project_root() / rundir.RUNS_ROOT
    return rundir.new_run_dir(stem, root=Path(root).expanduser())


def fresh_dir(path: str | Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... when it already holds files (a re-run)."""
    path = Path(path)
    candidate, k = path, 1
    while candidate.exists() and any(candidate.iterdir()):
        k += 1
        candidate = path.with_name(f"{path.name}-{k}")
    return candidate


def parse_list(text: str, kind: type = str, field: str = "list") -> list:
    """"grpo,ppo" -> ["grpo", "ppo"]; "2,4,8" with kind=int -> [2, 4, 8]: the items of a
    comma-separated list (labkit.grammar.items), each read by labkit.settings.fields.parse."""
    items = grammar.items(str(text), field)
    if not items:
        raise ValueError(f"{field} must be a comma-separated list, got {text!r}")
    return [parse(item, kind, f"every item of {field}={text!r}") for item in items]


def run_config(run_dir: str | Path, **values) -> TrainConfig:
    """A TrainConfig writing to a fresh `run_dir`, with the notebook defaults."""
    return TrainConfig(run_dir=str(fresh_dir(run_dir)), **{**NOTEBOOK_DEFAULTS, **values})


def seed_list(seed: int, seeds: int) -> list[int]:
    """The seeds of an experiment: `seed`, `seed + 1`, ..., `seeds` of them."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1 (how many seeds each arm runs), got {seeds}")
    return [seed + k for k in range(seeds)]


def run_name(arm: str, seed: int, seeds: Sequence[int]) -> str:
    """"grpo" for a single seed, "grpo/seed=1" when an arm runs several."""
    return arm if len(seeds) == 1 else f"{arm}/seed={seed}"


def _train_one(config: TrainConfig) -> RunResult:
    """A worker process's run (module level, so spawned workers can import it)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return train(config)


def _cost(config: TrainConfig) -> float:
    """A run's work, roughly: completions sampled times passes over them, twice for PPO (its
    critic's forward and backward)."""
    return config.steps * config.rows * config.num_iterations * (2 if config.algo == "ppo" else 1)


def run_all(configs: Mapping[str, TrainConfig], *, workers: int = 0,
            callbacks: Sequence[Callable[[StepReport], None]] = ()) -> dict[str, RunResult]:
    """Train every config and return the results in the order given.

    `workers` >= 1 runs each config in a fresh process (spawned: no state shared with the
    caller, and a process's peak memory is its own run's), that many at a time, the
    costliest first, each on `config.threads` torch threads (the notebooks give 1); 0 means
    one worker per CPU core, at most one per run. A run that fails does not stop the others: their results are kept and
    one RuntimeError names the failures at the end. Callbacks (live figures) need the runs in
    this process: with callbacks, or a single config, the runs go one after the other here.
    A confirmatory run (seed from labkit.lab.confirm.CONFIRM_FROM) whose configuration a
    per-seed record under docs/findings/ already holds is refused first (ValueError)."""
    if workers < 0:
        raise ValueError(f"workers must be >= 0 (0: one per CPU core), got {workers}")
    # a confirmatory run must be new data: refused where a per-seed record holds its config
    confirm.check_confirmatory(configs, project_root() / "docs" / "findings")
    # what the notebook runner's progress bar counts down (labkit.lab.progress)
    write_plan({c.run_dir: c.steps for c in configs.values() if c.run_dir})
    if callbacks or len(configs) <= 1:
        return {name: train(config, callbacks=callbacks) for name, config in configs.items()}
    import multiprocessing as mp
    import os

    workers = min(workers or os.cpu_count() or 1, len(configs))
    names, results, failed = list(configs), {}, {}
    context = mp.get_context("spawn")
    with context.Pool(workers, maxtasksperchild=1) as pool:
        # the costliest runs start first, so no worker is left with a long run at the end
        pending = {name: pool.apply_async(_train_one, (configs[name],))
                   for name in sorted(names, key=lambda n: -_cost(configs[n]))}
        for name in sorted(names, key=lambda n: -_cost(configs[n])):
            try:
                results[name] = pending[name].get()
            except Exception as e:  # noqa: BLE001 - reported with the others below
                failed[name] = f"{type(e).__name__}: {e}"
                continue
            r = results[name]
            print(f"[{len(results)}/{len(names)}] {name}: held-out accuracy "
                  f"{r.accuracy_before:.3f} -> {r.accuracy_after:.3f} in {r.wall_s:.0f} s",
                  flush=True)
    if failed:
        raise RuntimeError("runs failed (the others finished and wrote their folders): "
                           + "; ".join(f"{name}: {why}" for name, why in failed.items()))
    return {name: results[name] for name in names}


def compare(algos: Iterable[str], *, run_dir: str | Path, seed: int = 0, seeds: int = 1,
            workers: int = 0, callbacks: Sequence[Callable[[StepReport], None]] = (),
            per_algo: Mapping[str, Mapping] | None = None, **overrides) -> dict[str, RunResult]:
    """Train each algorithm on each seed with the same config (see `run_all` for `workers`).

    Seeds are paired: seed s draws the same B prompts at every step for every algorithm, and
    each samples B x G completions a step (PPO samples G per prompt too; DPO pairs them, RFT
    keeps the rewarded), so the arms of a seed see the same prompts with the same sample
    budget. DPO and RFT runs leave out the overrides only GRPO's and PPO's update reads
    (`beta`, the clip, ...: `labkit.settings.config_checks.POLICY_GRADIENT_ONLY`). Each run writes
    `run_dir/<algo>/` (one seed) or `run_dir/<algo>-seed<s>/`; see `run_name`. `per_algo`:
    each algorithm's own settings on top (its tuned lr and passes, labkit.lab.tuning).
    """
    chosen = seed_list(seed, seeds)
    configs = {}
    for s in chosen:
        for algo in algos:
            folder = algo if len(chosen) == 1 else f"{algo}-seed{s}"
            given = overrides if algo in ("grpo", "ppo") else \
                {k: v for k, v in overrides.items() if k not in POLICY_GRADIENT_ONLY}
            given = {**given, **(per_algo or {}).get(algo, {})}
            configs[run_name(algo, s, chosen)] = run_config(Path(run_dir) / folder, algo=algo,
                                                            seed=s, **given)
    return run_all(configs, workers=workers, callbacks=callbacks)


DEFAULT_ARMS = "grpo: estimator=grpo; dr_grpo: estimator=dr_grpo; rloo: estimator=rloo"
"""Notebook 05's arms when it is given none: the three group estimators."""


ARM_NAME = re.compile(r"[A-Za-z0-9._=+-]+")
"""An arm's name: letters, digits, '.', '_', '-', '+', '='."""


def parse_arms(text: str, field: str = "arms") -> dict[str, dict]:
    """"rloo: estimator=rloo; lam03: reward=shaped(lam=0.3), lr=5e-4" -> {arm: {field: value}}:
    arms separated by ';', each 'NAME: FIELD=VALUE, ...' with TrainConfig fields
    (labkit.grammar's tokens; a value holding ',' ';' or ':' is quoted), each value read by
    labkit.settings.fields.parse. Checked here, before any run starts."""
    text, arms = str(text), {}
    for part in grammar.split(grammar.tokens(text, field), ";", field, text):
        if not part:
            continue
        colon = next((i for i, tok in enumerate(part) if tok.is_op(":")), 0)
        name = grammar.source(text, part[:colon])
        if not colon or not ARM_NAME.fullmatch(name):
            raise grammar.GrammarError(field, text, part[0].start,
                                       f"{grammar.source(text, part)!r} must be 'NAME: "
                                       "FIELD=VALUE, ...' with NAME of letters, digits, '.', "
                                       "'_', '-', '+', '='")
        if name in arms:
            raise grammar.GrammarError(field, text, part[0].start, f"{name!r} is named twice")
        arms[name] = _fields(text, part[colon + 1:], field, f"{field}: {name}")
    if not arms:
        raise ValueError(f"{field} must name at least one arm, got {text!r}")
    return arms


def parse_fields(text: str, where: str = "fields") -> dict:
    """"scratchpad=true, max_new_tokens=48" -> {field: value} of TrainConfig fields, each
    value read by labkit.settings.fields.parse (a value holding ',' is quoted)."""
    text = str(text)
    return _fields(text, grammar.tokens(text, where), where, where)


def _fields(text: str, toks: list, field: str, where: str) -> dict:
    """FIELD=VALUE items of `toks`, separated by ',' outside parentheses."""
    types, out = field_types(), {}
    for item in grammar.split(toks, ",", field, text):
        if not item:
            continue
        key = item[0].text
        if len(item) < 2 or not item[1].is_op("=") or key not in types:
            raise grammar.GrammarError(field, text, item[0].start,
                                       f"{where}: {grammar.source(text, item)!r} must be "
                                       "FIELD=VALUE with FIELD a TrainConfig field (valid: "
                                       f"{sorted(types)})")
        if key in out:
            raise grammar.GrammarError(field, text, item[0].start, f"{where}: {key} is given "
                                                                   "twice")
        out[key] = parse_field(TrainConfig, key, grammar.source(text, item[2:]),
                               f"{where}: {key}")
    return out


def compare_arms(arms: Mapping[str, Mapping], *, run_dir: str | Path, seed: int = 0,
                 seeds: int = 1, workers: int = 0, **shared) -> dict[str, RunResult]:
    """Train each arm (a TrainConfig's overrides on top of `shared`) on each paired seed: seed
    s gives every arm the same prompts at every step. Every config is made (and checked)
    before the first run starts. Runs are named as in `run_name` and write
    `run_dir/<arm>[-seed<s>]/`."""
    chosen, configs = seed_list(seed, seeds), {}
    for s in chosen:
        for arm, overrides in arms.items():
            folder = arm if len(chosen) == 1 else f"{arm}-seed{s}"
            configs[run_name(arm, s, chosen)] = run_config(
                Path(run_dir) / folder, **{**shared, **overrides, "seed": s})
    return run_all(configs, workers=workers)


def batch_prompts_for(budget: str, group_size: int, samples_per_step: int,
                      group_sizes: Sequence[int]) -> int:
    """B for one run of the sweep: samples_per_step / G ("samples"), or the same B for every G,
    samples_per_step / max(G), so the largest group samples samples_per_step ("prompts")."""
    if budget == "samples":
        if samples_per_step % group_size:
            raise ValueError(f"samples_per_step={samples_per_step} must be a multiple of every "
                             f"G for an equal sample budget; G={group_size} does not divide it")
        return samples_per_step // group_size
    if budget == "prompts":
        if samples_per_step < max(group_sizes):
            raise ValueError(f"samples_per_step={samples_per_step} must be >= the largest G "
                             f"({max(group_sizes)}) to give every run at least one prompt")
        return samples_per_step // max(group_sizes)
    raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")


def group_size_runs(group_sizes: Sequence[int], budget: str, samples_per_step: int, *,
                    run_dir: str | Path, seed: int = 0, seeds: int = 1, workers: int = 0,
                    **overrides) -> dict[str, RunResult]:
    """GRPO at each G, at an equal sample budget, an equal prompt count, or both, on each seed
    (paired: the same prompt stream for every G of a seed; `workers` as in `run_all`).

    Run names are "<budget>/G=<G>" (e.g. "samples/G=4"), with "/seed=<s>" when there are
    several seeds; each writes `run_dir/<budget>-G<G>[-seed<s>]/`.
    """
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
    if any(g < 2 for g in group_sizes):
        raise ValueError("GRPO needs every group size >= 2 to compare completions, got "
                         f"{list(group_sizes)}")
    chosen, configs = seed_list(seed, seeds), {}
    for s in chosen:
        for b in (("samples", "prompts") if budget == "both" else (budget,)):
            for G in group_sizes:
                B = batch_prompts_for(b, G, samples_per_step, group_sizes)
                folder = f"{b}-G{G}" if len(chosen) == 1 else f"{b}-G{G}-seed{s}"
                configs[run_name(f"{b}/G={G}", s, chosen)] = run_config(
                    Path(run_dir) / folder, algo="grpo", seed=s, group_size=G,
                    batch_prompts=B, **overrides)
    return run_all(configs, workers=workers)


def informative_prediction(group_sizes: Sequence[int], *, prompts: int = 128,
                           samples: int = 64, seed: int = 0, **fields) -> dict[int, dict]:
    """What independence predicts for the share of informative groups (rewards not all
    equal) at each G, at the start of training: `samples` (M) completions of each of
    `prompts` training prompts from the untrained policy, scored as a run with `fields`
    (TrainConfig) scores them, then `labkit.probes.estimator_quality.informative_share` (each prompt's
    own reward distribution, and the pooled one). {G: {"per_prompt", "at_mean"}}."""
    if samples < max(group_sizes):
        raise ValueError(f"samples={samples} must be >= the largest G ({max(group_sizes)})")
    config = TrainConfig(batch_prompts=prompts, seed=seed, **{**NOTEBOOK_DEFAULTS, **fields})
    policy, tokenizer = load(config.model, device=config.device, dtype="fp32")
    problems = ProblemSource(config).draw(10_007 * seed + 99_991)  # not any run's step stream
    draw = lm_sampler(policy, tokenizer, problems, config)(samples, seed)
    return informative_share(draw.rewards.view(prompts, samples), group_sizes)


def live_training(live: Callable[[StepReport], None], *, run_dir: str | Path,
                  estimator: str = "grpo", seed: int = 0, **overrides) -> dict[str, RunResult]:
    """A GRPO run with `estimator`, then a PPO run of the same seed (same prompts each step),
    both reporting every step to `live` (a `labkit.lab.live.LivePlot`); evaluation only
    before the first and after the last step, and the estimator diagnostics every
    `diag_every` steps when the overrides ask for them. A dead spell is recorded, not
    stopped (`stop_when_dead=False`): the figure shows a collapse. Runs write
    `run_dir/<estimator>[-k]/` and `run_dir/ppo[-k]/`."""
    steps = overrides.get("steps", TrainConfig.steps)
    shared = {"stop_when_dead": False, **overrides, "seed": seed, "eval_every": steps}
    grpo = run_config(Path(run_dir) / estimator, algo="grpo", estimator=estimator, **shared)
    ppo = run_config(Path(run_dir) / "ppo", algo="ppo", **shared)
    return {estimator: train(grpo, callbacks=[live]), "ppo": train(ppo, callbacks=[live])}


def histories(results: Mapping[str, RunResult]) -> dict[str, list[dict]]:
    """Each run's step records tagged with `run`, its B and G, and `samples`, the
    completions sampled up to and including that step (B*G per step)."""
    out = {}
    for name, result in results.items():
        c = result.config
        tags = {"run": name, "algo": c.algo, "group_size": c.group_size,
                "batch_prompts": c.batch_prompts}
        out[name] = [{**tags, "samples": r["step"] * c.rows, **r} for r in result.history]
    return out


def first_and_last_rollouts(results: Mapping[str, RunResult]) -> dict[str, list[dict]]:
    """The groups kept in rollouts.jsonl (`TrainConfig.rollouts_every`) at the first and the
    last sampled step of the first run of each arm ("grpo-seed1" is arm grpo's second),
    keyed "<run>, step <s>": the columns of `labkit.lab.plots.rollouts`."""
    columns, arms = {}, set()
    for name, result in results.items():
        arm = name.split("-seed")[0]
        if arm in arms:
            continue
        arms.add(arm)
        for line in samples.first_and_last(result.run_dir):
            columns.setdefault(f"{name}, step {line['step']}", []).append(line)
    return columns
