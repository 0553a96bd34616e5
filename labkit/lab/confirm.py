"""Exploratory and confirmatory runs kept apart: reserved seed ranges, each run's
configuration fingerprint, and each claim's plan frozen at its first confirmatory run.

Training here is deterministic per configuration and seed, so a run repeated under another
claim's name is the same data again, not new evidence. Seeds from `CONFIRM_FROM` up are
reserved for confirmatory runs (those from `TUNE_FROM` to below it for tuning sweeps), and a
confirmatory run whose `fingerprint` (every TrainConfig field but where and how it is shown,
`NOT_FINGERPRINTED`, seed included) matches a run already in a per-seed record
(docs/findings/*.csv, their `fingerprint` column) is refused before any run starts, with
one line naming both: another claim file's confirmatory run of the same arm at the same
seed too (the same data, not new evidence), so each file's `confirmatory:` seeds lie apart.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

CONFIRM_FROM = 1000
"""The first seed reserved for confirmatory runs."""
TUNE_FROM = 500
"""The first seed of the tuning range (up to CONFIRM_FROM - 1)."""

NOT_FINGERPRINTED = ("run_dir", "progress", "report_to")
"""Fields that say where a run writes and how it is shown, not what it computes."""


ADDED_LATER = {"chat_template": True, "keep_every": 0, "fork_of": None, "fork_step": 0,
               "continuation_seed": None}
"""Fields added after fingerprints were first recorded, with the value every earlier run had:
a config at that value leaves the field out, so its fingerprint is the one an earlier run of
the same settings recorded."""


def fingerprint(config) -> str:
    """16 hex digits of the SHA-256 of a TrainConfig's fields (`NOT_FINGERPRINTED` left out,
    and an `ADDED_LATER` field at its earlier value), in a canonical JSON."""
    values = {k: v for k, v in config.to_dict().items() if k not in NOT_FINGERPRINTED
              and not (k in ADDED_LATER and v == ADDED_LATER[k])}
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def recorded(records_dir: str | Path) -> dict[str, str]:
    """fingerprint -> where a per-seed record holds it ('01_cost.csv: ppo, seed 3'), from every
    CSV of `records_dir` that has the column."""
    out: dict[str, str] = {}
    folder = Path(records_dir)
    for path in sorted(folder.glob("*.csv")) if folder.is_dir() else []:
        with path.open(newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                found = row.get("fingerprint")
                if found:
                    out.setdefault(found, f"{path.name}: {row.get('arm', '?')}, seed "
                                          f"{row.get('seed', '?')}")
    return out


def check_confirmatory(configs: Mapping[str, object], records_dir: str | Path) -> None:
    """Refuse, before any run starts, a confirmatory run (seed >= CONFIRM_FROM) whose
    fingerprint a per-seed record under `records_dir` already holds, and two confirmatory runs
    of `configs` with one fingerprint. ValueError: one line naming both runs."""
    seen = recorded(records_dir)
    mine: dict[str, str] = {}
    for name, config in configs.items():
        if config.seed < CONFIRM_FROM:
            continue
        found = fingerprint(config)
        earlier = seen.get(found) or mine.get(found)
        if earlier is not None:
            raise ValueError(f"confirmatory run {name} (seed {config.seed}) has configuration "
                             f"fingerprint {found}, the same as {earlier}: it would repeat "
                             "that run bit for bit; give it seeds no run of this "
                             "configuration has used")
        mine[found] = f"run {name} of this sweep"


def seed_range(seed: int) -> str:
    """'confirmatory', 'tuning' or 'exploratory': the range `seed` lies in."""
    if seed >= CONFIRM_FROM:
        return "confirmatory"
    return "tuning" if seed >= TUNE_FROM else "exploratory"


def plan_fingerprint(claim: dict, parameters: dict, grid: dict | None = None) -> str:
    """16 hex digits fixing a claim's plan: its preregistered block (test, control, seeds)
    and the settings its arms run (the sweep's parameters and grid, and the content of the
    tuned file its `tuned` parameter names)."""
    tuned = parameters.get("tuned")  # the settings a tuned file chose are part of the plan
    if tuned:  # relative to the cwd, else to the checkout this package lies in
        path = Path(tuned) if Path(tuned).is_file() else Path(__file__).parents[2] / tuned
        tuned = path.read_text() if path.is_file() else f"missing: {tuned}"
    text = json.dumps({"preregistered": claim.get("preregistered"), "parameters": parameters,
                       "grid": grid or {}, "tuned": tuned}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_path(records_dir: str | Path, stem: str) -> Path:
    """<records_dir>/<claim file>-plan.json: the plans frozen for that file's claims."""
    return Path(records_dir) / f"{stem}-plan.json"


def freeze(records_dir: str | Path, stem: str, sweep, commit: str | None) -> dict:
    """At a claim file's first confirmatory batch: write each of its claims' plan fingerprint
    with the commit and the first seed, once (a plan already frozen is kept as it was)."""
    path = plan_path(records_dir, stem)
    plans = json.loads(path.read_text()) if path.is_file() else {}
    for claim in sweep.claims:
        key = str(claim.get("id", "?"))
        if key not in plans:
            plans[key] = {"fingerprint": plan_fingerprint(claim, sweep.parameters, sweep.grid),
                          "commit": commit or "unknown", "first_seed": min(sweep.seeds)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plans, indent=1, sort_keys=True) + "\n")
    return plans


def changed_since_frozen(records_dir: str | Path, stem: str, claim: dict, parameters: dict,
                         grid: dict | None = None) -> str | None:
    """Why a claim whose plan was frozen now reads as exploratory (its preregistered block or
    its arms' settings changed after its first confirmatory run), in one line; None where
    nothing was frozen or nothing changed."""
    path = plan_path(records_dir, stem)
    if not path.is_file():
        return None
    frozen = json.loads(path.read_text()).get(str(claim.get("id", "?")))
    if frozen is None:
        return None
    now = plan_fingerprint(claim, parameters, grid)
    if now == frozen["fingerprint"]:
        return None
    return (f"exploratory: its plan changed after its first confirmatory run (frozen "
            f"{frozen['fingerprint']} at commit {str(frozen['commit'])[:7]}, now {now}); a "
            f"changed plan needs new confirmatory seeds")
