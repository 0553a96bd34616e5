"""The defaults that depend on other fields: a field left None takes its value from the
algorithm or the task when the config is made (`TrainConfig.__post_init__`). What `algo=ppo`
changes beyond the estimator's critic is here: its estimator (gae) and learning rate; where
its KL goes and which estimator it uses are `TrainConfig.kl_place` and `kl_estimator`."""

from __future__ import annotations

from labkit.settings.embedded import SCRATCHPAD_NAME, THINK_NAME

ALGO_LR = {"grpo": 1e-3, "ppo": 5e-4, "dpo": 1e-3, "rft": 1e-3}
"""The policy learning rate a config gets when it names none (`lr=None`)."""

TASK_SHAPES = {
    "think": dict(digits=1, operands=5, min_operands=2, max_new_tokens=48),
    "other": dict(digits=2, operands=2, min_operands=0, max_new_tokens=16),
}
"""What digits, operands, min_operands and max_new_tokens left None become, by task
('other' for every task but think)."""


def fill_defaults(config) -> None:
    """Set what `config` (a TrainConfig) left None: lr by algo, the estimator (gae for PPO,
    grpo otherwise), the task's shapes, and the model a scratchpad or think task was
    warm-started for."""
    if config.lr is None and config.algo in ALGO_LR:
        config.lr = ALGO_LR[config.algo]
    if config.estimator is None:
        config.estimator = "gae" if config.algo == "ppo" else "grpo"
    for name, value in TASK_SHAPES.get(config.task, TASK_SHAPES["other"]).items():
        if getattr(config, name) is None:
            setattr(config, name, value)
    if config.scratchpad and config.model is None:
        config.model = SCRATCHPAD_NAME
    if config.task == "think" and config.model is None:
        config.model = THINK_NAME
