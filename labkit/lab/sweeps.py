"""Sweeps: one notebook over a parameter grid and seeds, defined by experiments/NAME.yaml.

The YAML (its schema is repeated at the top of each file in experiments/):

    notebook: ../notebooks/01_grpo_vs_ppo.ipynb   # relative to the YAML file
    name: grpo_vs_ppo            # runs go to experiments/runs/<name>[-smoke]/<run id>
    parameters: {steps: 300}     # fixed values, one per notebook parameter
    grid: {group_size: [4, 8]}   # name -> values; the sweep runs their cartesian product
    seeds: [0, 1]                # every grid point runs once per seed (default [0])
    resources: {cpus: 1, gpus: 0}  # what one run needs (default 1 CPU, no GPU): the Ray
                                 #   backend's task resources (`--cpus-per-run` wins)
    smoke:                       # --smoke: a fast variant; each name given here wins,
      parameters: {steps: 4}     #   a fixed value replacing a grid entry and vice versa,
      grid: {group_size: [4]}    #   and seeds replacing seeds
      seeds: [0]
    claim:                       # experiments/claims/ only: the claim the runs test
      id: 1                      #   (labkit.lab.findings reads it; the sweep ignores it)
      statement: GRPO's step costs less time and memory than PPO's
      source: the article's title
      preregistered: {...}       #   the claim's test, fixed before it runs
                                 #   (labkit.lab.preregistration: article, measure, compare,
                                 #   finding, direction, threshold, margin, seeds, and
                                 #   control: the positive control a length or monitor
                                 #   measure needs, or the file is refused)
      findings: [2, 3]           #   which of the notebook's findings answer it (default: all):
                                 #   numbers, or words that a finding's question contains
      note: how to read it       #   optional, printed under the page's table
      restated: 05_x.yaml        #   optional: the file that restates this claim; its old
                                 #   statement is still read from these runs, labelled
    claims: [{id: 4, ...}, ...]  # instead of claim: several claims answered by the same runs
    replication: [100]           # claims only: first seeds of the claim's replication, the
                                 #   same runs at seeds `seeds:` never reaches (not in smoke)
    confirmatory:                # claims only: the confirmatory run, read as its own verdict
      seeds: [1000, 1005]        #   its looks' first seeds, all from 1000 (labkit.lab.confirm)
      parameters: {tuned: F}     #   optional: settings it changes (a tuned comparator);
                                 #   its runs go to <name>-confirmatory (a list: seeds alone)
    alone: true                  # the sweep times steps: it runs with no other sweep on the
                                 #   machine, and none starts beside it (labkit.lab.alone;
                                 #   --beside overrides); a claim measuring a time implies it

Every value is checked against the notebook's parameters cell before any run starts.
The run id is the grid values and the seed, `group_size=4,seed=1`, so it is the same on every
invocation: a run whose folder holds summary.json is skipped (an interrupted sweep resumes),
a folder without one is moved to `.incomplete/` and run again, and a complete run made with
other fixed values is an error rather than a silent mix of two experiments.

Backends: `local` runs the notebooks in this process, or `workers` at a time in a pool of
worker processes (the standard library's, nothing to install); `ray` makes each run a Ray
task (`labkit.lab.on_ray`: a local cluster or one at an address, resources per run, a run
whose worker dies retried). Both write the same run folders, sweep.csv and comparison.html.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from labkit.lab import alone, confirm, preregistration
from labkit.lab.runner import (PARAMETERS_FILE, RUNNER_OWNED, RunFailed, check_config_rules,
                               execute, is_number, notebook_parameters, read_parameter,
                               read_summary, unknown_names)
from labkit.lab.sweep_figure import write_comparison
from labkit.run.rundir import RunLock

KEYS = ("notebook", "name", "parameters", "grid", "seeds", "resources", "smoke", "claim",
        "claims", "replication", "confirmatory", "alone")
RESOURCE_KEYS = ("cpus", "gpus")
BACKENDS = ("local", "ray")
SMOKE_KEYS = ("parameters", "grid", "seeds")
CLAIM_KEYS = ("id", "statement", "source", "preregistered", "findings", "note", "restated")
CSV_NAME = "sweep.csv"
PLOT_NAME = "comparison.html"
INCOMPLETE = ".incomplete"


@dataclass
class Sweep:
    """A checked sweep: every value has the type its notebook declares."""

    notebook: Path
    name: str
    parameters: dict
    grid: dict[str, list]
    seeds: list[int]
    claims: list[dict] = field(default_factory=list)
    """experiments/claims/: the claims the sweep tests (labkit.lab.findings); [] otherwise."""
    resources: dict = field(default_factory=lambda: {"cpus": 1, "gpus": 0})
    """What one run needs, {"cpus": c, "gpus": g}: the Ray backend's task resources."""
    replication: list[int] = field(default_factory=list)
    """A claim's `replication:` first seeds: the same sweep again at seeds its `seeds:` never
    reach, read as the claim's replication (labkit.lab.findings); [] for none and in smoke."""
    confirmatory: "Sweep | None" = None
    """A claim's `confirmatory:` stage: the same claims at reserved seeds (from
    labkit.lab.confirm.CONFIRM_FROM) with the settings it changes, run and read apart from
    the exploratory runs (labkit.lab.findings); None where the file has none. In smoke, its
    first look only."""
    alone: bool = False
    """`alone: true`: the sweep times steps, so it runs with no other sweep on the machine
    (labkit.lab.alone; a claim whose measure is a time does so without saying)."""


@dataclass
class Run:
    """One grid point and seed of a sweep."""

    id: str
    values: dict
    """The grid values and the seed (the fixed parameters live in the Sweep)."""
    path: Path
    status: str = "todo"
    """todo, done (complete before this invocation), ok, failed."""
    message: str = ""
    summary: dict = field(default_factory=dict)


def load_sweep(path: str | Path, smoke: bool = False, to_run: bool = True) -> Sweep:
    """Read experiments/NAME.yaml (its `smoke:` variant with smoke=True) and check every
    name and value against the notebook's parameters cell. `to_run`: the sweep is about to
    run, so every claim whose measure needs a positive control must name one
    (labkit.lab.preregistration.NEEDS_CONTROL), except a claim `restated:` in another file
    (its old statement is read from the same runs, labelled exploratory); False to read
    finished runs."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no sweep file at {path}")
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    where = path.name
    _mapping(spec, where, KEYS)
    for key in ("notebook", "name"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise ValueError(f"{where}: `{key}:` is required, a string")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", spec["name"]):
        raise ValueError(f"{where}: name {spec['name']!r} must be a folder name "
                         "(letters, digits, '.', '_', '-')")
    parameters = dict(_mapping(spec.get("parameters") or {}, f"{where}: parameters"))
    grid = dict(_mapping(spec.get("grid") or {}, f"{where}: grid"))
    seeds = spec.get("seeds", [0])
    clash = sorted(set(parameters) & set(grid))
    if clash:
        raise ValueError(f"{where}: {', '.join(clash)} both fixed in `parameters:` and varied "
                         "in `grid:`")
    name = spec["name"]
    if smoke:
        if "smoke" not in spec:
            raise ValueError(f"{where} has no `smoke:` section")
        over = _mapping(spec["smoke"] or {}, f"{where}: smoke", SMOKE_KEYS)
        for key, value in _mapping(over.get("parameters") or {}, f"{where}: smoke.parameters"
                                   ).items():
            parameters[key] = value
            grid.pop(key, None)
        for key, values in _mapping(over.get("grid") or {}, f"{where}: smoke.grid").items():
            grid[key] = values
            parameters.pop(key, None)
        seeds = over.get("seeds", seeds)
        name += "-smoke"
    notebook = (path.parent / spec["notebook"]).resolve()
    if not notebook.is_file():
        raise FileNotFoundError(f"{where}: notebook {spec['notebook']} (relative to the YAML "
                                f"file) not found at {notebook}")
    if spec.get("claim") and spec.get("claims"):
        raise ValueError(f"{where}: give `claim:` or `claims:`, not both")
    blocks = spec.get("claims") or ([spec["claim"]] if spec.get("claim") else [])
    if not isinstance(blocks, list):
        raise ValueError(f"{where}: claims must be a list of claim blocks")
    claims = [dict(_mapping(b, f"{where}: claim", CLAIM_KEYS)) for b in blocks]
    checked = _checked(Sweep(notebook, name, parameters, grid, seeds), where)
    if claims:  # what each claim must show, fixed before any of its runs

        defaults = {k: p.default for k, p in notebook_parameters(notebook).items()}
        arms = preregistration.sweep_arms(defaults | checked.parameters)
        for claim in claims:
            if claim.get("restated") is not None and not (
                    isinstance(claim["restated"], str) and claim["restated"].strip()):
                raise ValueError(f"{where}: claim {claim.get('id', '?')}: restated must name "
                                 f"the claim file that restates it, got {claim['restated']!r}")
            preregistration.check(claim, where, arms, check_arms=not smoke,
                                  require_control=to_run and not claim.get("restated"))
    checked.claims = claims
    checked.resources = _resources(spec.get("resources") or {}, where)
    if not isinstance(spec.get("alone", False), bool):
        raise ValueError(f"{where}: alone must be true or false, got {spec['alone']!r}")
    checked.alone = bool(spec.get("alone", False))
    again = spec.get("replication") or []
    if again and not smoke:
        if not claims:
            raise ValueError(f"{where}: replication: re-runs a claim; this sweep has none")
        both = _checked(Sweep(notebook, name, parameters, grid, [*seeds, *again]),
                        f"{where}: seeds + replication")
        checked.replication = both.seeds[len(checked.seeds):]
    if spec.get("confirmatory") is not None:
        if not claims:
            raise ValueError(f"{where}: confirmatory: runs a claim; this sweep has none")
        checked.confirmatory = _confirmatory(spec["confirmatory"], checked, where, smoke)
    return checked


def _confirmatory(stage, base: Sweep, where: str, smoke: bool) -> Sweep:
    """A claim file's `confirmatory:` block (a mapping of seeds and parameters, or a list of
    seeds) as a checked sweep named <name>-confirmatory: `base` with the parameters it
    changes, at its first seeds, each from confirm.CONFIRM_FROM."""
    stage = {"seeds": stage} if isinstance(stage, list) else stage
    stage = _mapping(stage, f"{where}: confirmatory", ("seeds", "parameters"))
    seeds = stage.get("seeds")
    if (not isinstance(seeds, list) or not seeds or any(
            isinstance(s, bool) or not isinstance(s, int) or s < confirm.CONFIRM_FROM for s in seeds)):
        raise ValueError(f"{where}: confirmatory.seeds must be a list of first seeds, each "
                         f"from {confirm.CONFIRM_FROM} (the confirmatory range, "
                         f"labkit.lab.confirm.CONFIRM_FROM), got {seeds!r}")
    over = dict(_mapping(stage.get("parameters") or {}, f"{where}: confirmatory.parameters"))
    parameters = {**base.parameters, **over}
    grid = {k: v for k, v in base.grid.items() if k not in over}
    out = _checked(Sweep(base.notebook, f"{base.name}-confirmatory", parameters, grid,
                         seeds[:1] if smoke else seeds), f"{where}: confirmatory")
    out.claims, out.resources, out.alone = base.claims, base.resources, base.alone
    return out


def _resources(spec, where: str) -> dict:
    """`resources:` checked: cpus > 0 and gpus >= 0, numbers (fractions allowed, as in Ray)."""
    spec = _mapping(spec, f"{where}: resources", RESOURCE_KEYS)
    out = {"cpus": spec.get("cpus", 1), "gpus": spec.get("gpus", 0)}
    for key, value in out.items():
        low = 0 if key == "gpus" else None
        if isinstance(value, bool) or not is_number(value) or value < 0 or (
                low is None and value == 0):
            rule = ">= 0" if key == "gpus" else "> 0"
            raise ValueError(f"{where}: resources.{key} must be a number {rule}, got {value!r}")
    return out


def _mapping(value, where: str, allowed: tuple = ()) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping, got {type(value).__name__}")
    extra = [str(k) for k in value if allowed and k not in allowed]
    if extra:
        raise ValueError(f"{where}: unknown key(s) {', '.join(extra)}; valid keys: "
                         f"{', '.join(allowed)}")
    return value


def checked_sweep(notebook: Path, name: str, parameters: dict, seeds: list[int],
                  where: str) -> Sweep:
    """A sweep built in code (a tuning file's grid), checked as a YAML file's is."""
    return _checked(Sweep(Path(notebook).resolve(), name, dict(parameters), {}, list(seeds)),
                    where)


def _checked(sweep: Sweep, where: str) -> Sweep:
    params = notebook_parameters(sweep.notebook)
    book = sweep.notebook.name
    for owned, hint in ((RUNNER_OWNED, "the sweep makes each run's folder"),
                        ("seed", "list seeds under `seeds:`")):
        if owned in sweep.parameters or owned in sweep.grid:
            raise ValueError(f"{where}: {owned} cannot be set here: {hint}")
    if "seed" not in params:
        raise ValueError(f"{book} has no `seed` parameter, which a sweep sets")
    unknown_names(sweep.notebook, [*sweep.parameters, *sweep.grid], params)
    kind = {k: p.type for k, p in params.items()}
    fixed = {k: read_parameter(k, v, kind[k], book) for k, v in sweep.parameters.items()}
    grid = {}
    for key, values in sweep.grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}: grid {key} must be a non-empty list, got {values!r}")
        grid[key] = [read_parameter(key, v, kind[key], book) for v in values]
        if len(set(map(repr, grid[key]))) != len(values):
            raise ValueError(f"{where}: grid {key} repeats a value: {values}")
    seeds = sweep.seeds
    if not isinstance(seeds, list) or not seeds or len(set(map(repr, seeds))) != len(seeds):
        raise ValueError(f"{where}: seeds must be a non-empty list of distinct ints, got {seeds!r}")
    seeds = [read_parameter("seed", s, kind["seed"], book) for s in seeds]
    if "seeds" in params and len(seeds) > 1:
        # each run trains seed, seed+1, ..., seed+N-1: batches of seeds that must not overlap
        per_run = fixed.get("seeds", params["seeds"].default)
        ordered = sorted(seeds)
        if "seeds" in grid or any(b - a < per_run for a, b in zip(ordered, ordered[1:])):
            raise ValueError(f"{where}: {book} runs its own paired seeds (its `seeds` "
                             f"parameter, {per_run}: seed, seed+1, ...): first seeds under "
                             f"`seeds:` must lie at least {per_run} apart, or the runs' seeds "
                             "overlap")
    for point in itertools.product(*grid.values()):
        for seed in seeds:
            check_config_rules(sweep.notebook, params,
                               {**fixed, **dict(zip(grid, point)), "seed": seed})
    return Sweep(sweep.notebook, sweep.name, fixed, grid, seeds)


def _slug(value) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", str(value))


def plan(sweep: Sweep, root: str | Path) -> list[Run]:
    """Every run of the sweep, in grid order then seed order, with what is already done.
    A complete run made with other fixed values raises ValueError."""
    folder = Path(root) / sweep.name
    runs = []
    for point in itertools.product(*sweep.grid.values()):
        for seed in sweep.seeds:
            values = {**dict(zip(sweep.grid, point)), "seed": seed}
            run_id = ",".join(f"{k}={_slug(v)}" for k, v in values.items())
            runs.append(Run(run_id, values, folder / run_id))
    if len({r.id for r in runs}) != len(runs):
        raise ValueError(f"two grid points of {sweep.name} give the same run folder name; "
                         "make the grid values differ in letters or digits")
    for run in runs:
        summary = read_summary(run.path)
        if summary is None:
            continue
        run.status, run.summary = "done", summary
        stored = run.path / PARAMETERS_FILE
        if stored.is_file():
            before = json.loads(stored.read_text())
            before.pop(RUNNER_OWNED, None)
            now = {**sweep.parameters, **run.values}
            changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
            if changed:
                key = changed[0]
                raise ValueError(f"{run.path} was run with {key}={before.get(key)!r}, the sweep "
                                 f"now says {key}={now.get(key)!r}: move that folder away or "
                                 "rename the sweep")
    return runs


def _prepare(run_dir: Path) -> None:
    """A fresh folder for a run that is not complete; an old partial one (an interrupted
    sweep's, or a retried run's) is kept aside in `.incomplete/`."""
    if run_dir.exists():
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        aside = run_dir.parent / INCOMPLETE / f"{run_dir.name}-{stamp}"
        aside.parent.mkdir(exist_ok=True)
        shutil.move(str(run_dir), str(aside))
    run_dir.mkdir(parents=True)


def _execute_one(notebook: Path, run_dir: Path, values: dict) -> str:
    """Runs in a worker process (or a Ray task): prepares the run's folder, runs the
    notebook; '' on success, else a one-line reason."""
    try:
        _prepare(run_dir)
        execute(notebook, run_dir, values, progress=False)
    except RunFailed as e:
        return str(e)
    except Exception as e:  # one bad run must not end the sweep
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    if read_summary(run_dir) is None:
        return f"{notebook.name} finished without writing {run_dir / 'summary.json'}"
    return ""


def run_sweep(sweep: Sweep, root: str | Path, workers: int = 1, progress: bool = True, *,
              backend: str = "local", address: str | None = None,
              beside: bool = False) -> list[Run]:
    """Run what is not done yet, then write sweep.csv and comparison.html into the sweep
    folder. Returns every run with its status.

    backend "local": `workers` notebooks at once (1: in this process). backend "ray": each
    run a Ray task with the sweep's `resources`, on the cluster at `address`, or on a local
    cluster of `workers` x resources["cpus"] CPUs started for the sweep (workers 0: every
    CPU). The sweep folder's lock is held throughout: a second invocation of the same sweep,
    while this one runs, is refused rather than setting aside or rerunning the runs in
    progress. A sweep that times steps runs alone on the machine, and no sweep starts beside
    one, unless `beside` (labkit.lab.alone)."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if workers < (0 if backend == "ray" else 1):
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if address and backend != "ray":
        raise ValueError("--address is the Ray cluster's: it needs --backend ray")
    if backend == "ray":
        from labkit.lab.on_ray import require_ray

        require_ray()  # a missing extra is said before anything runs
    folder = Path(root) / sweep.name
    folder.mkdir(parents=True, exist_ok=True)
    with alone.on_machine(sweep.name, alone.times_steps(sweep), beside), RunLock(folder):
        return _run_sweep(sweep, root, workers, progress, backend, address)


def _run_sweep(sweep: Sweep, root: str | Path, workers: int, progress: bool, backend: str,
               address: str | None) -> list[Run]:
    from tqdm.auto import tqdm

    runs = plan(sweep, root)
    todo = [r for r in runs if r.status == "todo"]
    bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc=sweep.name, unit="run",
               disable=not progress)

    def finish(run: Run, message: str) -> None:
        run.status, run.message = ("failed", message) if message else ("ok", "")
        run.summary = read_summary(run.path) or {}
        if message:
            bar.write(f"failed {run.id}: {message}", file=sys.stderr)
        bar.update(1)

    try:
        if backend == "ray" and todo:
            from labkit.lab.on_ray import run_tasks

            cpus = sweep.resources["cpus"]
            jobs = [(run, (sweep.notebook, run.path.resolve(),
                           {**sweep.parameters, **run.values})) for run in todo]
            run_tasks(_execute_one, jobs, finish, address=address, cpus=cpus,
                      gpus=sweep.resources["gpus"],
                      local_cpus=max(1, round(workers * cpus)) if workers else None)
        elif workers == 1:
            for run in todo:
                bar.set_postfix_str(run.id)
                finish(run, _execute_one(sweep.notebook, run.path, {**sweep.parameters,
                                                                     **run.values}))
        elif todo:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor, as_completed

            context = multiprocessing.get_context("spawn")  # no forked kernel clients or locks
            with ProcessPoolExecutor(min(workers, len(todo)), mp_context=context) as pool:
                futures = {pool.submit(_execute_one, sweep.notebook, run.path,
                                       {**sweep.parameters, **run.values}): run for run in todo}
                for future in as_completed(futures):
                    finish(futures[future], future.result())
    finally:
        bar.close()
    folder = Path(root) / sweep.name
    write_table(sweep, runs, folder / CSV_NAME)
    write_comparison(sweep, runs, folder / PLOT_NAME)
    return runs


def write_table(sweep: Sweep, runs: list[Run], path: Path) -> Path:
    """sweep.csv: one row per run, its status (ok or failed) and error (a failed run's
    reason, one line), its parameters, then every key of its summary.json (a key named like
    a parameter is `summary:<key>`, and left out where it equals the parameter)."""
    names = [*sweep.grid, "seed", *sweep.parameters]
    keys: dict[str, None] = {}
    for run in runs:
        values = {**sweep.parameters, **run.values}
        # a summary key that repeats a parameter's value adds nothing to the parameter's column
        keys.update(dict.fromkeys(k for k, v in run.summary.items()
                                  if k not in values or v != values[k]))
    own = ("run", "status", "error")
    column = {k: (f"summary:{k}" if k in names or k in own else k) for k in keys}
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([*own, *names, *column.values()])
        for run in runs:
            values = {**sweep.parameters, **run.values}
            failed = run.status == "failed"
            writer.writerow([run.id, "failed" if failed else "ok", run.message if failed else "",
                             *(values[n] for n in names), *(run.summary.get(k, "") for k in keys)])
    return path
