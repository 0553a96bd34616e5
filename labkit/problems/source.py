"""Where a run's problems come from: each step's training prompts, and the fixed held-out
problems every run of a task shares."""

from __future__ import annotations

import random

from labkit.problems.code_tasks import load_code_tasks
from labkit.problems.dataset_task import load_dataset_task
from labkit.problems.tasks import ArithmeticTask, Problem, load_gsm8k, split_bucket

ARITHMETIC = ("arithmetic", "think")
"""The tasks whose problems `ArithmeticTask` draws."""

EVAL_SEED = 1234
"""Seed of the held-out problems: the same eval set for every run seed, so runs compare."""


class ProblemSource:
    """Training prompts for each step, and the fixed held-out problems, for a TrainConfig
    (`config`: its task and the task's fields, batch_prompts, eval_n, cgc_prompts)."""

    def __init__(self, config):
        self.config = config
        if config.task in ARITHMETIC:
            self.task = ArithmeticTask(digits=config.digits, operands=config.operands,
                                       ops=config.ops, min_operands=config.min_operands,
                                       scratchpad=config.scratchpad)
            self.eval = self.task.sample(config.eval_n, "test", seed=EVAL_SEED, distinct=True)
        else:
            if config.task == "code":
                everything = load_code_tasks(config.code_path)
            elif config.task == "dataset":
                everything = load_dataset_task(config.dataset_path, config.prompt_column,
                                               config.answer_column)
            else:
                everything = load_gsm8k(config.gsm8k_path)
            self.train = [p for p in everything if split_bucket(p.prompt) >= 20]
            held_out = [p for p in everything if split_bucket(p.prompt) < 20]
            if not self.train or not held_out:
                raise ValueError(f"{config.code_path or config.gsm8k_path or config.dataset_path}"
                                 " is too small to "
                                 "split into train and held-out problems")
            self.eval = held_out[:config.eval_n]
        self.cgc = self.eval[:config.cgc_prompts]

    def draw(self, step_seed: int) -> list[Problem]:
        B = self.config.batch_prompts
        if self.config.task in ARITHMETIC:
            return self.task.sample(B, "train", seed=step_seed)
        return random.Random(step_seed).choices(self.train, k=B)
