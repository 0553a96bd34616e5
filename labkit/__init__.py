"""labkit: an interactive lab for reinforcement learning of language models.

The package is laid out in the order of the data flow: `problems` (tasks, rewards),
`formulas` (advantages, losses, metrics, statistics), `settings` (the config), `model`
(loading, rollout, scoring, the learner), `run` (the run directory and its logs, stop rules,
trackers), `probes` (evaluation, diagnostics, the credit microscope); the step (`algos`,
`stages`, `update`) and `trainer` at the front; the wings `lab` (what notebooks call),
`fast`, `sandbox` and `bench` around it.

The building blocks a notebook reaches for are named here too, loaded on first use:
`from labkit import advantages, models, rewards, rollout, tasks`.
"""

import importlib

__version__ = "0.1.0"

BLOCKS = {"advantages": "labkit.formulas.advantages", "estimators": "labkit.formulas.estimators",
          "losses": "labkit.formulas.losses", "metrics": "labkit.formulas.metrics",
          "stats": "labkit.formulas.stats", "tasks": "labkit.problems.tasks",
          "rewards": "labkit.problems.rewards", "models": "labkit.model.models",
          "rollout": "labkit.model.rollout", "evaluation": "labkit.probes.evaluation"}
"""name -> the module `from labkit import name` loads."""


def __getattr__(name: str):
    if name in BLOCKS:
        return importlib.import_module(BLOCKS[name])
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
