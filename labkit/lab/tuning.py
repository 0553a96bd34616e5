"""Fair comparators: each algorithm at its own settings, chosen by a tuning sweep fixed first.

A comparison of algorithms at one learning rate chosen for one of them (GRPO's 1e-3 and two
passes a batch, which DPO does not survive) says more about the setting than the algorithms.
A tuning file (experiments/tuning/<name>.yaml) fixes, before it runs, a grid per algorithm, the
tuning seeds and the rule that picks:

    name: main_job
    parameters: {steps: 100, batch_prompts: 32, group_size: 8, eval_every: 50, eval_n: 500}
    grid:                          # per algorithm: lr (and num_iterations for DPO and RFT;
      grpo: {lr: [2.5e-4, 5e-4, 1e-3, 2e-3], beta: [0.02]}   # one value: fixed, not tuned)
      dpo: {lr: [2.5e-4, 5e-4, 1e-3, 2e-3], num_iterations: [1, 2]}
      rloo: {fields: {algo: grpo, estimator: rloo}, lr: [...]}  # an arm that brings its own
    seed: 500                      # tuning seeds: labkit.lab.confirm's range, 500-999
    seeds: 3
    rule: best mean gain           # RULES

Each algorithm's learning rates are at least `MIN_VALUES`, span at least `MIN_SPAN` and hold
its default (`labkit.settings.defaults.ALGO_LR`); at least `MIN_SEEDS` seeds. `python -m labkit
tune FILE` runs the grid as notebook 05's arms, applies the rule and writes the choice with
the file's fingerprint and the commit (`tuned_path`: docs/findings/tuned-<name>.json), which
notebook 01 reads (`tuned`) so that each algorithm runs at its own settings.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from labkit.lab import confirm
from labkit.lab.experiments import project_root
from labkit.settings.defaults import ALGO_LR

KEYS = ("name", "parameters", "grid", "seed", "seeds", "rule")
GRID_KEYS = ("lr", "num_iterations", "beta")
ENTRY_KEYS = (*GRID_KEYS, "fields")
"""A grid entry: an algorithm (its name), or an arm of a claim by its name with `fields`, the
TrainConfig fields it brings (`algo=grpo, estimator=rloo`), tuned the same way."""
PASSES_FOR = ("dpo", "rft")
"""The algorithms whose passes per batch are tuned beside the learning rate."""
MIN_VALUES, MIN_SPAN, MIN_SEEDS = 4, 8.0, 3
RULES = {"best mean gain": "the setting with the highest mean held-out gain over the tuning "
                           "seeds, a collapsed run counting with its gain"}


@dataclass
class Tuning:
    """A checked tuning file (the module docstring)."""

    name: str
    parameters: dict
    grid: dict[str, dict[str, list]]
    seed: int
    seeds: int
    rule: str
    path: Path = field(default_factory=Path)

    def fingerprint(self) -> str:
        """16 hex digits fixing the plan: parameters, grid, seeds and rule."""
        text = json.dumps({k: getattr(self, k) for k in KEYS}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def arms(self) -> dict[str, dict]:
        """Every grid point as a notebook-05 arm: 'dpo-lr0.0005-it1' -> {algo, lr, ...}; an
        arm's entry with its own fields ('rloo-lr0.001' -> {algo, estimator, lr})."""
        out = {}
        for entry, axes in self.grid.items():
            fields = dict(axes.get("fields") or {})
            fields.setdefault("algo", entry)
            names = [n for n in axes if n != "fields"]
            for values in itertools.product(*(axes[n] for n in names)):
                point = dict(zip(names, values))
                label = "-".join([entry, f"lr{point['lr']:g}"] +
                                 ([f"it{point['num_iterations']}"]
                                  if len(axes.get("num_iterations", [])) > 1 else []))
                out[label] = {**fields, **point, "entry": entry}
        return out


def load(path: str | Path) -> Tuning:
    """Read and check a tuning file; ValueError naming the file and the field."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no tuning file at {path}")
    spec = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    where = path.name
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; keys: {', '.join(KEYS)}")
    missing = [k for k in KEYS if k not in spec]
    if missing:
        raise ValueError(f"{where}: {missing[0]} is missing (keys: {', '.join(KEYS)})")
    if spec["rule"] not in RULES:
        raise ValueError(f"{where}: rule must be one of {list(RULES)}, got {spec['rule']!r}")
    seed, seeds = spec["seed"], spec["seeds"]
    if not (isinstance(seeds, int) and seeds >= MIN_SEEDS):
        raise ValueError(f"{where}: seeds must be an integer >= {MIN_SEEDS}, got {seeds!r}")
    if not (isinstance(seed, int) and confirm.seed_range(seed) == "tuning"
            and confirm.seed_range(seed + seeds - 1) == "tuning"):
        raise ValueError(f"{where}: seed: tuning runs use seeds {confirm.TUNE_FROM}-"
                         f"{confirm.CONFIRM_FROM - 1}, got {seed}..{seed + seeds - 1}")
    grid = spec["grid"]
    if not isinstance(grid, dict) or not grid:
        raise ValueError(f"{where}: grid must map each algorithm to its values")
    for name, axes in grid.items():
        who = f"{where}: grid.{name}"
        if not isinstance(axes, dict) or sorted(set(axes) - set(ENTRY_KEYS)):
            raise ValueError(f"{who} must map {', '.join(GRID_KEYS)} to lists of values (and "
                             "an arm its fields)")
        fields = axes.get("fields") or {}
        if not isinstance(fields, dict):
            raise ValueError(f"{who}.fields must map TrainConfig fields to values")
        algo = fields.get("algo", name)
        if algo not in ALGO_LR:
            raise ValueError(f"{who}: not an algorithm ({', '.join(ALGO_LR)}), and its fields "
                             "name none (fields: {algo: ...})")
        lrs = axes.get("lr")
        if not (isinstance(lrs, list) and all(isinstance(x, (int, float)) and x > 0
                                              for x in lrs)):
            raise ValueError(f"{who}.lr must be a list of learning rates > 0")
        if len(set(lrs)) < MIN_VALUES or max(lrs) / min(lrs) < MIN_SPAN - 1e-9 \
                or not any(math.isclose(x, ALGO_LR[algo]) for x in lrs):
            raise ValueError(f"{who}.lr must hold >= {MIN_VALUES} values spanning >= "
                             f"{MIN_SPAN:g}x and the default {ALGO_LR[algo]:g}, got {lrs}")
        passes = axes.get("num_iterations", [1])
        if not (isinstance(passes, list) and passes and all(
                isinstance(n, int) and n >= 1 for n in passes)) or (
                len(passes) > 1 and algo not in PASSES_FOR):
            raise ValueError(f"{who}.num_iterations: integers >= 1, several only for "
                             f"{', '.join(PASSES_FOR)} (passes per batch tuned)")
        if "beta" in axes and (algo not in ("grpo", "ppo") or len(axes["beta"]) != 1):
            raise ValueError(f"{who}.beta: one value, fixed, for grpo and ppo only")
    return Tuning(str(spec["name"]), dict(spec["parameters"] or {}), grid, seed, seeds,
                  spec["rule"], path)


def choose(tuning: Tuning, records: list[dict]) -> dict[str, dict]:
    """algo -> its chosen settings (lr, num_iterations where tuned), the mean gain they gave
    and every grid point's mean gain and collapses, by the file's rule, from the per-seed
    records of its sweep ({arm, seed, gain, collapsed})."""
    arms = tuning.arms()
    out = {}
    for algo in tuning.grid:  # an algorithm, or an arm's entry
        table = {}
        for arm, point in arms.items():
            if point["entry"] != algo:
                continue
            rows = [r for r in records if r["arm"] == arm and "gain" in r]
            if len(rows) < tuning.seeds:
                raise ValueError(f"{tuning.path.name}: {arm} has {len(rows)} finished runs of "
                                 f"{tuning.seeds}: run the tuning sweep to the end first")
            table[arm] = {"mean_gain": statistics.fmean(r["gain"] for r in rows),
                          "collapsed": sum(int(r.get("collapsed", 0)) for r in rows),
                          "runs": len(rows)}
        best = max(table, key=lambda a: (table[a]["mean_gain"], a))
        chosen = {k: v for k, v in arms[best].items() if k in GRID_KEYS}
        out[algo] = {**chosen, "mean_gain": table[best]["mean_gain"], "grid": table}
    return out


def tuned_path(tuning: Tuning, records_dir: str | Path) -> Path:
    return Path(records_dir) / f"tuned-{tuning.name}.json"


def write_tuned(tuning: Tuning, chosen: dict, records_dir: str | Path,
                commit: str | None) -> Path:
    """The choice, with the tuning file's fingerprint, rule and seeds and the commit."""
    path = tuned_path(tuning, records_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"tuning": tuning.name, "fingerprint": tuning.fingerprint(),
                                "rule": tuning.rule, "seeds": [tuning.seed, tuning.seeds],
                                "commit": commit or "unknown", "settings": chosen},
                               indent=1, sort_keys=True) + "\n")
    return path


def read_tuned(path: str | Path) -> dict[str, dict]:
    """algo -> the settings a tuned file chose (lr, num_iterations where tuned), for notebook
    01's `tuned` parameter (a relative path from the checkout's root); {} for an empty path."""
    if not path:
        return {}
    path = Path(path)
    if not path.is_absolute() and not path.is_file():  # a notebook runs in its run folder
        path = project_root() / path
    if not path.is_file():
        raise ValueError(f"tuned: no tuned settings at {path} (python -m labkit tune writes "
                         "them)")
    settings = json.loads(path.read_text())["settings"]
    return {algo: {k: v for k, v in s.items() if k in GRID_KEYS} for algo, s in settings.items()}


def apply_tuned(arms: dict[str, dict], shared: dict, tuned: dict[str, dict]) -> dict[str, dict]:
    """Notebook 05's arms, each given its own tuned settings where the file has an entry of its
    name, else its algorithm's (`read_tuned`), under the fields it sets itself; {} of `tuned` leaves them as they are. ValueError naming the arm
    whose algorithm the tuned file does not cover."""
    if not tuned:
        return arms
    out = {}
    for name, fields in arms.items():
        algo = fields.get("algo", shared.get("algo", "grpo"))
        found = tuned.get(name, tuned.get(algo))  # the arm's own entry, else its algorithm's
        if found is None:
            raise ValueError(f"tuned: no tuned settings for algo {algo} (arm {name}); the file "
                             f"covers {', '.join(sorted(tuned))}")
        out[name] = {**found, **fields}
    return out
