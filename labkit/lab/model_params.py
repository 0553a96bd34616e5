"""The lab on your model: the parameters every training notebook shares for what it trains
(`model`, `task` and its file, `device`, `dtype`, `extra` TrainConfig fields and a size
`profile`), read into TrainConfig fields and checked with this machine's files before any
run starts.

`fields(notebook, given, ...)` is what a notebook calls: `given` holds its own parameters
that are TrainConfig fields (steps, lr, ...). A `profile` fills the fields it names with
the budget a model of its size needs (`PROFILES`), except where the notebook's value
differs from the notebook's own default (the user set it) or `extra` names the field:
whatever the user sets wins over the profile. The profile's choices are printed.
"""

from __future__ import annotations

from labkit.lab.cells import notebook_parameters
from labkit.lab.experiments import parse_fields, project_root
from labkit.settings.config import TrainConfig
from labkit.settings.preflight import preflight

PROFILES: dict[str, dict] = {
    "": {},
    "llm": {
        # TRL's GRPOConfig: max_completion_length 256, num_generations 8, learning_rate 1e-6
        # (the seeds' recipes: 1e-6 with warmup, 5e-7 to 2e-6), num_iterations 1 (one pass:
        # the ratio stays 1, TRL's default); beta 0.04 with its reference, DeepSeekMath's
        # (TRL now defaults to 0; the articles' range is 0.01-0.1)
        "max_new_tokens": 256, "group_size": 8, "batch_prompts": 16, "lr": 1e-6,
        "num_iterations": 1, "beta": 0.04, "eval_n": 200, "eval_every": 25,
    },
}
"""Size profiles: name -> TrainConfig fields. '' (the default) leaves every notebook value as
it is: the embedded 0.44 M-parameter model's sizes. 'llm': a 0.5B-7B causal LM on a GPU,
from the peers' defaults (TRL's GRPOConfig) and the source articles' recipes."""

WHERE = ("model", "task", "gsm8k_path", "dataset_path", "code_path", "device", "dtype",
         "extra", "profile")
"""The notebook parameters `fields` reads besides the notebook's own fields."""

DTYPES = {"": "auto", "auto": "auto", "fp32": "fp32", "float32": "fp32", "bf16": "bf16",
          "bfloat16": "bf16"}
"""A notebook's `dtype` -> TrainConfig.precision."""


def fields(notebook: str, given: dict, *, model: str = "", task: str = "", gsm8k_path: str = "",
           dataset_path: str = "", code_path: str = "", device: str = "", dtype: str = "",
           extra: str = "", profile: str = "", owned: tuple[str, ...] = (),
           check: bool = True, say: bool = True) -> dict:
    """The TrainConfig fields a notebook's runs share: `given` (its own parameters that are
    fields), a `profile`'s sizes where the notebook's value is its default (`owned`: fields
    the notebook sets per run itself, which the profile leaves), what it trains and where
    (model, task and its file, device, dtype: empty leaves the field's default) and `extra`
    on top; `say`: print the profile's choices. With `check`, a config of these fields is made and `preflight` asked (the model
    folder is a causal LM, the task's file exists with its columns, the device is here):
    ValueError naming the parameter, before any run starts."""
    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r}: valid profiles are "
                         f"{', '.join(repr(p) for p in PROFILES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: valid values are "
                         f"{', '.join(repr(d) for d in DTYPES)}")
    mine = parse_fields(extra, "extra")
    defaults = notebook_defaults(notebook)
    chosen = {k: v for k, v in PROFILES[profile].items()
              if k not in owned and k not in mine
              and (k not in given or given[k] == defaults.get(k, given[k]))}
    out = {**given, **chosen}
    where = {"model": model, "task": task, "gsm8k_path": gsm8k_path,
             "dataset_path": dataset_path, "code_path": code_path, "device": device}
    out |= {k: v for k, v in where.items() if v}
    if dtype:
        out["precision"] = DTYPES[dtype]
    out |= mine
    if profile and say:
        said = ", ".join(f"{k}={v}" for k, v in chosen.items())
        kept = sorted(set(PROFILES[profile]) - set(chosen) - set(owned))
        print(f"profile {profile}: {said}" + (f" (yours kept: {', '.join(kept)})"
                                                if kept else ""))
    if check:
        check_fields(out)
    return out


def check_fields(values: dict) -> None:
    """A TrainConfig of `values` checked (its own rules, then `preflight`: the machine has the
    model folder, a causal LM, the task's file with its columns, the device); ValueError
    naming the parameter."""
    preflight(TrainConfig(**values))


def notebook_defaults(notebook: str) -> dict:
    """The defaults of notebooks/<notebook>.ipynb's parameters cell ({} where the file is not
    there)."""
    path = project_root() / "notebooks" / f"{notebook}.ipynb"
    if not path.is_file():
        return {}
    return {k: p.default for k, p in notebook_parameters(path).items()}
