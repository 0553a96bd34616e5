"""The rules between a TrainConfig's fields that no annotation states, checked when a config is
made (`TrainConfig.__post_init__` calls `check_rules` after the annotations' checks): each
error names the field and the rule it breaks. Nothing here probes the machine: that is
`labkit.settings.preflight`. Each check takes the TrainConfig being made (unannotated: this
module stands below `labkit.settings.config`, which calls it)."""

from __future__ import annotations

import re
from pathlib import Path

from labkit import grammar
from labkit.formulas.estimators import ESTIMATORS, NEEDS
from labkit.formulas.losses import normaliser_of
from labkit.problems.dataset_task import builder
from labkit.problems.tasks import ENUMERABLE, ArithmeticTask
from labkit.run import stops
from labkit.settings.embedded import EMBEDDED


def check_rules(config) -> None:
    """Every rule below, in order: ranges, the task, the combinations, the stop rules."""
    check_ranges(config)
    check_task(config)
    check_combinations(config)
    check_stop_rules(config)


def check_ranges(config) -> None:
    """The ranges no annotation states: the seed's, and GRPO's group size."""
    if not -2**32 < config.seed < 2**32:
        raise ValueError(f"seed must be an integer with |seed| < 2**32 (each step's seed is "
                         f"seed * 1000003 + step, which a generator must accept), got "
                         f"{config.seed!r}")
    if config.algo == "grpo" and config.group_size < 2:
        raise ValueError(f"group_size must be >= 2: GRPO needs group_size >= 2 to compare "
                         f"completions, got {config.group_size}")


def check_combinations(config) -> None:
    """The device's spelling and the rules between fields."""
    if config.device is not None and not re.fullmatch(r"(cpu|cuda|mps)(:\d+)?", config.device):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps' (or None), got "
                         f"{config.device!r}")
    if config.reinforce and (config.num_iterations != 1 or config.minibatches != 1):
        raise ValueError("reinforce=True is one on-policy update per batch: it needs "
                         "num_iterations=1 and minibatches=1")
    if config.loss != "vanilla" and (config.reinforce or config.dual_clip is not None
                                   or config.ratio_level != "token"):
        raise ValueError(f"loss={config.loss!r} is its own objective: reinforce, dual_clip "
                         "and ratio_level='sequence' apply to loss='vanilla' (or take "
                         "loss='gpg', 'dual_clip' or 'gspo')")
    if (config.reject_low is None) != (config.reject_high is None) or (
            config.reject_low is not None and config.reject_low > config.reject_high):
        raise ValueError("reject_low and reject_high come together, with reject_low <= "
                         f"reject_high, got {config.reject_low!r}, {config.reject_high!r}")
    if config.sampler_precision == "bf16" and config.precision == "bf16":
        raise ValueError("sampler_precision='bf16' makes a mismatch with an fp32 learner; "
                         "precision='bf16' would sample and learn alike (use fp32 or auto)")
    if config.mismatch_low is not None and config.mismatch_low > config.mismatch_cap:
        raise ValueError(f"mismatch_low={config.mismatch_low} must be <= mismatch_cap="
                         f"{config.mismatch_cap}")
    if config.overlong_buffer > config.max_new_tokens:
        raise ValueError(f"overlong_buffer={config.overlong_buffer} must be <= "
                         f"max_new_tokens={config.max_new_tokens}: the penalty zone is the "
                         "end of the budget")
    if config.lora_rank and not grammar.items(config.lora_targets, "lora_targets"):
        raise ValueError("lora_targets must name at least one layer (comma-separated), "
                         f"got {config.lora_targets!r}")
    if config.kl_target is not None and config.beta == 0:
        raise ValueError("kl_target adapts beta: it needs beta > 0 (its starting value)")
    if config.ref_sync_every and not config.has_reference:
        raise ValueError("ref_sync_every moves the reference toward the policy: it needs a "
                         "reference, beta > 0 (or algo='dpo')")
    if config.ref_sync_every and config.lora_rank:
        raise ValueError("ref_sync_every cannot move a LoRA run's reference: it is the policy "
                         "with its adapters off, not weights of its own (use lora_rank=0)")
    check_algo_fields(config)
    if config.reinforce and config.algo != "grpo":
        raise ValueError("reinforce applies to algo='grpo' (group baselines), not ppo")
    check_estimator(config)
    if config.dynamic_sampling and config.algo != "grpo":
        raise ValueError("dynamic_sampling applies to algo='grpo' (it drops groups of equal "
                         "rewards), not ppo")
    if config.rows % config.minibatches:
        raise ValueError(f"minibatches={config.minibatches} must divide the batch_prompts * "
                         f"group_size = {config.rows} rows of a step")
    if config.credit_every and config.credit_prompts > config.eval_n:
        raise ValueError(f"credit_prompts={config.credit_prompts} held-out problems asked of "
                         f"eval_n={config.eval_n}: lower credit_prompts or raise eval_n")
    if config.diag_every and config.diag_prompts > config.eval_n:
        raise ValueError(f"diag_prompts={config.diag_prompts} must be <= eval_n="
                         f"{config.eval_n}: the diagnostics measure held-out problems")
    if (config.rows // config.minibatches) % config.grad_accum:
        raise ValueError(f"grad_accum={config.grad_accum} must divide the "
                         f"{config.rows // config.minibatches} rows of a minibatch")
    if config.grad_accum > 1:  # its micro-batches are weighed by what the mode divides by
        normaliser_of(config.agg)


POLICY_GRADIENT_ONLY = ("beta", "reinforce", "loss", "ratio_level", "dual_clip",
                        "dynamic_sampling", "mask_truncated", "overlong_buffer", "top_entropy",
                        "mismatch_is", "reject_low", "sampler_temperature", "sampler_precision",
                        "entropy_coef", "eps_low", "eps_high")
"""Fields only GRPO's and PPO's update reads (its ratio, clip, KL penalty, reward shaping and
row filters): a DPO or RFT config must leave them at their defaults."""

DPO_ONLY = ("dpo_beta", "dpo_loss", "label_smoothing", "dpo_online", "dpo_grpo_cosine")
"""Fields only DPO reads."""


def check_algo_fields(config) -> None:
    """A field another algorithm reads is refused, not silently ignored; and DPO's own
    rules (label smoothing, offline sampling)."""
    from dataclasses import fields

    defaults = {f.name: f.default for f in fields(config)}
    if config.algo in ("dpo", "rft"):
        changed = [n for n in POLICY_GRADIENT_ONLY if getattr(config, n) != defaults[n]]
        if changed:
            raise ValueError(f"algo={config.algo!r} does not read {', '.join(changed)}: those "
                             "set GRPO's and PPO's update (ratio, clip, KL penalty, shaping); "
                             "leave them at their defaults")
    if config.algo != "dpo":
        changed = [n for n in DPO_ONLY if getattr(config, n) != defaults[n]]
        if changed:
            raise ValueError(f"{', '.join(changed)} set DPO's loss: they need algo='dpo', "
                             f"not {config.algo!r}")
        return
    if config.group_size < 2:
        raise ValueError(f"group_size must be >= 2: DPO pairs completions of one prompt, got "
                         f"{config.group_size}")
    if config.label_smoothing and config.dpo_loss == "ipo":
        raise ValueError("label_smoothing applies to dpo_loss 'sigmoid' and 'robust', not "
                         "'ipo'")
    if not config.dpo_online and config.lora_rank:
        raise ValueError("dpo_online=False samples from the starting model, a frozen copy that "
                         "a LoRA run does not hold (its reference is the policy with adapters "
                         "off): use dpo_online=True or lora_rank=0")
    if not config.dpo_online and config.ref_sync_every:
        raise ValueError("dpo_online=False samples from the starting model: ref_sync_every "
                         "would move it (use one or the other)")


def check_estimator(config) -> None:
    """An estimator that reads a critic's values is PPO's; any other is GRPO's; and it
    needs only inputs a trainer can compute (`labkit.formulas.estimators.NEEDS`)."""
    needs = ESTIMATORS.needs(config.estimator)
    unknown = [n for n in needs if n not in NEEDS]
    if unknown:
        raise ValueError(f"estimator={config.estimator!r} needs {unknown}, which no trainer "
                         f"computes (known: {list(NEEDS)})")
    if "values" in needs and config.algo != "ppo":
        raise ValueError(f"estimator={config.estimator!r} reads a critic's values: it needs "
                         "algo='ppo'")
    if config.algo == "ppo" and "values" not in needs:
        raise ValueError(f"algo='ppo' trains a critic for its advantages (estimator 'gae'); "
                         f"estimator={config.estimator!r} needs no critic: use algo='grpo'")


def check_task(config) -> None:
    """The task's own rules (digits 1..9, operands 2..8, ops), checked now rather than
    when the problems are drawn, after the model has loaded."""
    if not config.ops or any(op not in "+-*" for op in config.ops):
        raise ValueError(f"ops must be a non-empty string of '+', '-', '*', got {config.ops!r}")
    if config.dataset_path is not None and config.task != "dataset":
        raise ValueError(f"dataset_path={config.dataset_path!r} is only read with "
                         f"task='dataset' (task is {config.task!r}): add task='dataset' or "
                         "drop dataset_path")
    if config.task == "dataset":
        if not config.dataset_path:
            raise ValueError("dataset_path is required with task='dataset': a local .jsonl, "
                             ".json, .parquet or .csv file")

        try:
            builder(Path(config.dataset_path))  # its suffix names a reader
        except ValueError as e:
            raise ValueError(f"dataset_path: {e}") from None
        for name in ("prompt_column", "answer_column"):
            if not getattr(config, name).strip():
                raise ValueError(f"{name} must name a column of the dataset, got ''")
        if config.gsm8k_path is not None or config.code_path is not None or config.scratchpad:
            raise ValueError("gsm8k_path, code_path and scratchpad are not read with "
                             "task='dataset'")
        return
    if config.task == "code":
        if not config.code_path:
            raise ValueError("code_path is required with task='code': a local HumanEval- "
                             "or MBPP-format .jsonl or .jsonl.gz")
        if "code" not in config.reward:
            raise ValueError(f"task='code' is scored by running its tests: reward must "
                             f"include 'code', got {config.reward!r}")
        if config.gsm8k_path is not None or config.scratchpad:
            raise ValueError("gsm8k_path and scratchpad are not read with task='code'")
        return
    if config.code_path is not None:
        raise ValueError(f"code_path={config.code_path!r} is only read with task='code' "
                         f"(task is {config.task!r}): add task='code' or drop code_path")
    if config.task == "gsm8k":
        if config.scratchpad:
            raise ValueError("scratchpad=True is for task='arithmetic' (GSM8K's worked "
                             "solutions are its own): drop scratchpad")
        if not config.gsm8k_path:
            raise ValueError("gsm8k_path is required with task='gsm8k': a local jsonl with "
                             "'question' and 'answer' fields")
        return
    if config.gsm8k_path is not None:
        raise ValueError(f"gsm8k_path={config.gsm8k_path!r} is only read with task='gsm8k' "
                         f"(task is {config.task!r}): add task='gsm8k' or drop gsm8k_path")
    if config.task == "think" and config.scratchpad:
        raise ValueError("task='think' leaves it to the policy whether to write its running "
                         "results: drop scratchpad (or use task='arithmetic')")
    task = ArithmeticTask(digits=config.digits, operands=config.operands, ops=config.ops,
                          min_operands=config.min_operands,
                          scratchpad=config.scratchpad or config.task == "think")
    if (config.scratchpad or config.task == "think") and config.model in EMBEDDED:
        # the embedded models read and write one character per token, EOS one more
        need = len(task.longest_target()) + 1
        if config.max_new_tokens < need:
            raise ValueError(f"max_new_tokens={config.max_new_tokens} cannot hold this task's "
                             f"longest worked solution ({need} tokens with EOS, "
                             f"{task.longest_target()!r}): raise max_new_tokens to >= {need}")
    if task.num_problems <= ENUMERABLE:
        held_out, about = task.split_size("test"), ""
    else:
        held_out, about = int(0.9 * task.split_size("test")), "about "
    if config.eval_n > held_out:
        raise ValueError(f"eval_n={config.eval_n} distinct held-out problems asked, but the "
                         f"held-out split of digits={config.digits}, operands={config.operands} "
                         f"holds {about}{held_out}: lower eval_n or raise digits")


def check_stop_rules(config) -> None:
    for rule in stops.parse(config.stop_rules):
        why = stops.never_logged(rule, config)
        if why:
            raise ValueError(f"stop_rules: '{rule}' could never fire: {why}")
