"""One config dataclass for a training run: every default lives here, every check too.

GRPO and PPO share the sampling, optimisation, evaluation and run fields; the GRPO block
chooses the variant (estimator, aggregation, clipping, KL, dynamic sampling, REINFORCE) and
the PPO block the critic. Derived values are properties, never fields filled in later.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal, get_args, get_type_hints

from labkit import stops
from labkit.advantages import SCALES
from labkit.losses import AGG_MODES, KL_KINDS, LEVELS

ALGOS = ("grpo", "ppo")
ESTIMATORS = ("grpo", "dr_grpo", "rloo")  # DeepSeekMath / Dr. GRPO / leave-one-out
TASKS = ("arithmetic", "gsm8k")
PRECISIONS = ("auto", "fp32", "bf16")
SCHEDULES = ("cosine", "constant")


@dataclass
class TrainConfig:
    """A training run of GRPO (or a variant) or PPO on one task."""

    # --- what to train -------------------------------------------------------------
    algo: Literal["grpo", "ppo"] = "grpo"
    """grpo: group-relative advantages, no critic; ppo: a critic and GAE."""
    model: str | None = None
    """Local model folder or hub id; None is the embedded tiny model."""
    task: Literal["arithmetic", "gsm8k"] = "arithmetic"
    """Problem source: procedural arithmetic, or GSM8K from `gsm8k_path`."""
    digits: int = 2
    """Arithmetic: digits per operand."""
    operands: int = 2
    """Arithmetic: numbers per problem."""
    ops: str = "+"
    """Arithmetic: operators to draw from ('+', '-', '*')."""
    gsm8k_path: str | None = None
    """GSM8K: a local jsonl with 'question' and 'answer' (train on it, evaluate on it)."""
    seed: int = 0
    """Seeds the weights' noise, the prompts of each step and every sample."""

    # --- sampling ------------------------------------------------------------------
    steps: int = 600
    """RL steps; each samples a fresh batch of B prompts x G completions."""
    batch_prompts: int = 32
    """B: prompts per step."""
    group_size: int = 8
    """G: completions per prompt (PPO samples G per prompt too, for an equal budget)."""
    max_new_tokens: int = 16
    """Completion budget in tokens; a completion without EOS by then is truncated."""
    temperature: float = 1.0
    """Sampling temperature; the log-probs of the update use the same one."""
    top_p: float = 1.0
    """Nucleus sampling: 1.0 turns it off."""
    top_k: int = 0
    """Top-k sampling: 0 turns it off."""
    score_truncated: bool = False
    """Grade completions that hit max_new_tokens without EOS; False scores them 0 (they never
    finished), which keeps the policy from learning to run on past its answer."""

    # --- GRPO variants ---------------------------------------------------------------
    estimator: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """Advantage: grpo (z-score in the group), dr_grpo (no std), rloo (leave-one-out)."""
    scale: Literal["group", "batch", "none"] = "group"
    """grpo: divide by the group's std, the batch's std, or nothing."""
    std_unbiased: bool = True
    """grpo: the std divides by G-1 (torch, TRL) rather than G."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                 "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses become one number (REFERENCE.md, aggregation)."""
    eps_low: float = 0.2
    """Clip range below 1: ratio >= 1 - eps_low."""
    eps_high: float = 0.2
    """Clip range above 1: ratio <= 1 + eps_high (DAPO's clip-higher: 0.28)."""
    dual_clip: float | None = None
    """Dual clip c > 1: for A < 0 the per-token loss is capped at -c*A (verl clip_ratio_c)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """token: PPO's per-token ratio; sequence: GSPO's length-normalised sequence ratio."""
    beta: float = 0.0
    """KL coefficient: in the loss for GRPO, in the reward for PPO. 0 loads no reference."""
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (k3 is DeepSeekMath's, unbiased and >= 0)."""
    entropy_coef: float = 0.0
    """Entropy bonus: loss - entropy_coef * mean entropy."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal before the update."""
    reinforce: bool = False
    """Plain REINFORCE with the advantage as weight: one update, no ratio, no clip."""

    # --- PPO -------------------------------------------------------------------------
    gamma: float = 1.0
    """PPO: discount of GAE."""
    lam: float = 0.95
    """PPO: lambda of GAE."""
    critic_lr: float = 1e-3
    """PPO: the critic's learning rate."""
    value_clip: float | None = 0.2
    """PPO: clip range of the value loss around the old values; None turns it off."""
    whiten_advantages: bool = True
    """PPO: normalise the GAE advantages over the batch's tokens."""

    # --- optimisation ------------------------------------------------------------------
    lr: float = 1e-3
    """Policy learning rate (AdamW) after warmup."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 10
    """Optimizer steps of linear warmup."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warmup: cosine decay to min_lr_ratio * lr, or constant."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of lr."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm (0 turns it off)."""
    num_iterations: int = 1
    """Passes over each rollout batch (mu in the GRPO paper); > 1 makes the ratio differ from 1."""
    minibatches: int = 1
    """Optimizer steps per pass: the N rows are split into this many minibatches."""
    grad_accum: int = 1
    """Micro-batches per minibatch, accumulated before the optimizer step (same result, less memory)."""

    # --- evaluation and runs -------------------------------------------------------------
    eval_every: int = 100
    """Steps between held-out evaluations (and one before the first step)."""
    eval_n: int = 400
    """Held-out problems per evaluation."""
    eval_samples: int = 4
    """Sampled completions per held-out problem, for pass@1 and pass@k."""
    cgc_prompts: int = 32
    """Fixed held-out prompts whose G rewards give CGC at each evaluation."""
    run_dir: str | None = None
    """Where the run writes; None makes experiments/runs/<algo>/<time>-<pid>."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: only at the end)."""
    device: str | None = None
    """cpu, cuda, cuda:1; None picks CUDA when available."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Mixed precision of the update: auto is bf16 on a GPU that has it, else fp32."""
    share_prompt: bool | None = None
    """Update: run each prompt once per group and its G completions against its KV cache
    (same log-probs and gradients as running the prompt G times). None (auto) does so when
    it saves at least labkit.scoring.SHARE_MIN_POSITIONS token positions in a pass (long
    prompts: below that the extra forward call costs more than it saves); True always,
    False never."""
    lean: bool = True
    """Run Llama, Mistral, Qwen2 and Qwen3 models through labkit.fast's hand-written
    forward and decoder (the same numbers up to float rounding, with far less per-call
    overhead); False, or any other architecture, uses the model's own forward. Read once,
    by trainer.build_learner (labkit.scoring.FAST_PASSES or MODEL_PASSES)."""
    progress: bool = True
    """Show a progress bar."""

    # --- stopping -------------------------------------------------------------------------
    stop_rules: str = ""
    """Stop early, with a checkpoint, when a logged metric misbehaves: rules separated by ';',
    each 'METRIC OP NUMBER [for COUNT]' with OP one of > >= < <= and METRIC a key of
    labkit.metrics.METRICS, e.g. 'adv/gav>0.45 for 5; policy/kl>0.5'. COUNT (default 1)
    consecutive records that log the metric must meet the condition. Blank: no rule."""

    def __post_init__(self):
        """Every field is checked here, so a bad value fails before any model loads, with a
        message that names the field and the rule it breaks."""
        self._check_types()
        self._check_choices()
        self._check_counts()
        self._check_numbers()
        self._check_task()
        self._check_paths()
        self._check_combinations()
        self._check_stop_rules()

    def _check_types(self) -> None:
        """Fields whose type a typo can change: a bool given "false", a path given 5."""
        for name in ("score_truncated", "std_unbiased", "dynamic_sampling", "reinforce",
                     "whiten_advantages", "lean", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.share_prompt is not None and not isinstance(self.share_prompt, bool):
            raise ValueError(f"share_prompt must be True, False or None (auto), "
                             f"got {self.share_prompt!r}")
        for name in ("model", "gsm8k_path", "run_dir", "device"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        for name in ("ops", "stop_rules"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")

    def _check_choices(self) -> None:
        _choice(self, "algo", ALGOS)
        _choice(self, "task", TASKS)
        _choice(self, "estimator", ESTIMATORS)
        _choice(self, "scale", SCALES)
        _choice(self, "agg", AGG_MODES)
        _choice(self, "ratio_level", LEVELS)
        _choice(self, "kl_kind", KL_KINDS)
        _choice(self, "precision", PRECISIONS)
        _choice(self, "schedule", SCHEDULES)

    def _check_counts(self) -> None:
        for name in ("steps", "batch_prompts", "group_size", "max_new_tokens", "num_iterations",
                     "minibatches", "grad_accum", "eval_every", "eval_n", "digits", "operands"):
            _at_least(self, name, 1)
        for name in ("warmup_steps", "checkpoint_every", "eval_samples", "cgc_prompts", "top_k"):
            _at_least(self, name, 0)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) \
                or not -2**32 < self.seed < 2**32:
            raise ValueError(f"seed must be an integer with |seed| < 2**32 (each step's seed is "
                             f"seed * 1000003 + step, which a generator must accept), got "
                             f"{self.seed!r}")
        if self.algo == "grpo" and self.group_size < 2:
            raise ValueError(f"group_size must be >= 2: GRPO needs group_size >= 2 to compare "
                             f"completions, got {self.group_size}")

    def _check_numbers(self) -> None:
        for name in ("lr", "critic_lr", "temperature"):
            _positive(self, name)
        for name in ("top_p", "eps_low", "eps_high", "gamma", "lam", "min_lr_ratio"):
            _finite(self, name)
        for name in ("dual_clip", "value_clip"):
            if getattr(self, name) is not None:
                _finite(self, name)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low must satisfy 0 <= eps_low < 1, got {self.eps_low}")
        if not 0 <= self.eps_high:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"value_clip must be > 0 (or None), got {self.value_clip}")
        for name in ("beta", "entropy_coef", "weight_decay", "max_grad_norm"):
            _finite(self, name)
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("gamma", "lam", "min_lr_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def _check_task(self) -> None:
        """The task's own rules (digits 1..9, operands 2..8, ops), checked now rather than
        when the problems are drawn, after the model has loaded."""
        if not self.ops or any(op not in "+-*" for op in self.ops):
            raise ValueError(f"ops must be a non-empty string of '+', '-', '*', got {self.ops!r}")
        if self.task == "gsm8k":
            if not self.gsm8k_path:
                raise ValueError("gsm8k_path is required with task='gsm8k': a local jsonl with "
                                 "'question' and 'answer' fields")
            if not Path(self.gsm8k_path).expanduser().is_file():
                raise ValueError(f"gsm8k_path={self.gsm8k_path!r} is not a file")
            return
        if self.gsm8k_path is not None:
            raise ValueError(f"gsm8k_path={self.gsm8k_path!r} is only read with task='gsm8k' "
                             f"(task is {self.task!r}): add task='gsm8k' or drop gsm8k_path")
        from labkit.tasks import ArithmeticTask

        task = ArithmeticTask(digits=self.digits, operands=self.operands, ops=self.ops)
        held_out = task.num_problems * task.test_percent / 100
        if self.eval_n > 0.9 * held_out:
            raise ValueError(f"eval_n={self.eval_n} distinct held-out problems asked, but the "
                             f"held-out split of digits={self.digits}, operands={self.operands} "
                             f"holds about {int(held_out)}: lower eval_n or raise digits")

    def _check_paths(self) -> None:
        if self.model is not None and self.model != "tiny-arith":
            path = Path(self.model).expanduser()
            looks_local = path.exists() or self.model.startswith((".", "/", "~")) \
                or self.model.count("/") > 1 or "\\" in self.model
            if looks_local and not (path / "config.json").is_file():
                raise ValueError(f"model={self.model!r}: no saved model there (no config.json)")
        if self.run_dir is not None:
            path = Path(self.run_dir).expanduser()
            if path.exists() and not path.is_dir():
                raise ValueError(f"run_dir={self.run_dir!r} is a file, not a folder")
            parent = next((p for p in path.parents if p.exists()), None)
            if not path.exists() and parent is not None and not parent.is_dir():
                raise ValueError(f"run_dir={self.run_dir!r} cannot be made: {str(parent)!r} "
                                 "is a file")
        if self.device is not None:
            _check_device(self.device)

    def _check_combinations(self) -> None:
        if self.reinforce and (self.num_iterations != 1 or self.minibatches != 1):
            raise ValueError("reinforce=True is one on-policy update per batch: it needs "
                             "num_iterations=1 and minibatches=1")
        if self.reinforce and self.algo != "grpo":
            raise ValueError("reinforce applies to algo='grpo' (group baselines), not ppo")
        if self.dynamic_sampling and self.algo != "grpo":
            raise ValueError("dynamic_sampling applies to algo='grpo' (it drops groups of equal "
                             "rewards), not ppo")
        if self.rows % self.minibatches:
            raise ValueError(f"minibatches={self.minibatches} must divide the batch_prompts * "
                             f"group_size = {self.rows} rows of a step")
        if (self.rows // self.minibatches) % self.grad_accum:
            raise ValueError(f"grad_accum={self.grad_accum} must divide the "
                             f"{self.rows // self.minibatches} rows of a minibatch")

    def _check_stop_rules(self) -> None:
        for rule in stops.parse(self.stop_rules):
            why = stops.never_logged(rule, self)
            if why:
                raise ValueError(f"stop_rules: '{rule}' could never fire: {why}")

    @property
    def rows(self) -> int:
        """N = B * G completions per step."""
        return self.batch_prompts * self.group_size

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps in the whole run."""
        return self.steps * self.num_iterations * self.minibatches

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**values)


def _check_device(device: str) -> None:
    """The device's spelling, and that this machine has it: a run asked for cuda:1 should not
    find out after its run directory exists that there is no second GPU."""
    import torch

    match = re.fullmatch(r"(cpu|cuda|mps)(?::(\d+))?", device)
    if match is None:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps' (or None), got "
                         f"{device!r}")
    kind, index = match[1], match[2]
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={device!r} asks for CUDA, but torch sees no CUDA device")
        if index is not None and int(index) >= count:
            raise ValueError(f"device={device!r}: torch sees {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r} asks for Apple MPS, which this machine lacks")


def _choice(config, name: str, valid: tuple) -> None:
    value = getattr(config, name)
    if value not in valid:
        raise ValueError(f"{name} must be one of {list(valid)}, got {value!r}")


def _at_least(config, name: str, low: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _finite(config, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _positive(config, name: str) -> None:
    _finite(config, name)
    if not getattr(config, name) > 0:
        raise ValueError(f"{name} must be > 0, got {getattr(config, name)}")


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string under it in the class body), one line each, for the
    command line's --help; {} where the source cannot be read."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(TrainConfig))
    except (OSError, TypeError):
        return {}
    body, docs = tree.body[0].body, {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def field_types() -> dict[str, type]:
    """The base type of each field (str for a choice, float for `float | None`), for the
    command line and the notebooks' parameter checks."""
    out = {}
    for name, hint in get_type_hints(TrainConfig).items():
        args = [a for a in get_args(hint) if a is not type(None)]
        if args and all(isinstance(a, str) for a in args):
            out[name] = str
        elif args:
            out[name] = args[0]
        else:
            out[name] = hint
    return out
