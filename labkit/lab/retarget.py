"""The claims on your model: every claim sweep re-pointed by `--set FIELD=VALUE` (`python -m
labkit findings --all --set model=DIR --set task=gsm8k --set gsm8k_path=F`), its runs under
a runs root of their own and its page apart from the project's; a claim that cannot run
there is listed with the reason instead.

A field the notebook takes as a parameter (model, task and its file, device, dtype, profile,
lr, ...) is set there; any other TrainConfig field goes into the notebook's `extra`. A claim
whose runs set that field themselves to something else (the think-task claims' task=think,
an arm's own lr) is a claim about that setting: it is not run, and the page says why.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from labkit.lab.cells import notebook_parameters, read_parameter
from labkit.lab.experiments import parse_arms, parse_fields
from labkit.lab.runner import check_config_rules
from labkit.settings.config import field_types

NOTEBOOK_ONLY = ("dtype", "profile")
"""Settings that are notebook parameters (labkit.lab.model_params), not TrainConfig fields."""


def parse_sets(items: list[str] | None) -> dict[str, str]:
    """['model=DIR', 'task=gsm8k'] -> {'model': 'DIR', 'task': 'gsm8k'}; ValueError naming the
    item that is not FIELD=VALUE with FIELD a TrainConfig field or dtype or profile."""
    out: dict[str, str] = {}
    fields = field_types()
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or (key not in fields and key not in NOTEBOOK_ONLY):
            raise ValueError(f"--set {item!r} must be FIELD=VALUE with FIELD a TrainConfig "
                             f"field, dtype or profile")
        if key in out:
            raise ValueError(f"--set {key} is given twice")
        out[key] = value.strip()
    return out


def slug(sets: dict[str, str]) -> str:
    """A folder name for the runs and page of `sets`: 'on-<model folder>-<task>'."""
    model = Path(sets.get("model", "embedded").rstrip("/")).name or "embedded"
    parts = [model, sets.get("task", "")]
    return "on-" + "-".join(re.sub(r"[^A-Za-z0-9._-]+", "_", p) for p in parts if p)


def own_settings(sweep) -> dict[str, object]:
    """The TrainConfig fields a claim sweep sets itself: its parameters, its grid's, its
    arms' and its `extra`'s (an arm or extra naming a field wins over a parameter)."""
    out: dict[str, object] = {k: v for k, v in sweep.parameters.items()
                              if k not in ("arms", "extra") and v != ""}
    out |= {k: v for k, v in sweep.grid.items()}
    if sweep.parameters.get("extra"):
        out |= parse_fields(sweep.parameters["extra"], "extra")
    if sweep.parameters.get("arms"):
        for fields in parse_arms(sweep.parameters["arms"]).values():
            out |= fields
    return out


def retarget(sweep, sets: dict[str, str]) -> tuple[object, str | None]:
    """The claim sweep with `sets` applied (its confirmatory and replication stages dropped:
    a claim on another model is exploratory there), or (sweep, why it cannot run there: its
    runs set the field themselves, or its own settings do not hold with it, such as the
    arithmetic's scratchpad on GSM8K). `sets` are checked as a notebook run would check
    them (the model folder, the task's file): ValueError naming the field."""
    params = notebook_parameters(sweep.notebook)
    mine = own_settings(sweep)
    for key, value in sets.items():
        if key in mine and str(mine[key]) != value:
            return sweep, (f"its runs set {key}={mine[key]} themselves: a claim about that "
                           f"{key}, not one to move to {key}={value}")
    values = dict(sweep.parameters)
    extra = []
    for key, value in sets.items():
        if key in params:
            values[key] = value
        elif "extra" in params and key not in NOTEBOOK_ONLY:
            extra.append(f"{key}={value}")
        else:
            return sweep, f"its notebook {sweep.notebook.name} takes no {key}"
    if extra:
        values["extra"] = ", ".join(filter(None, [str(values.get("extra", "")), *extra]))
    typed = {k: read_parameter(k, v, params[k].type, sweep.notebook) if k in params else v
             for k, v in values.items()}
    # the settings themselves (the model folder, the task's file): an error, before any run
    check_config_rules(sweep.notebook, params, {k: typed[k] for k in sets if k in params})
    try:  # with the claim's own settings: one that cannot hold there is a reason
        check_config_rules(sweep.notebook, params,
                           {k: v for k, v in typed.items() if k in params})
    except ValueError as e:
        return sweep, f"its own settings do not hold there: {getattr(e, 'rule', e)}"
    return dataclasses.replace(sweep, parameters=typed, confirmatory=None, replication=[]), None
