"""One config dataclass for a training run: every default lives here, every check too.

GRPO and PPO share the sampling, optimisation, evaluation and run fields; the GRPO block
chooses the variant (estimator, aggregation, clipping, KL, dynamic sampling, REINFORCE) and
the PPO block the critic. Derived values are properties, never fields filled in later.

The checks come from the annotations (`labkit.settings.fields`): a `Literal` lists a field's
choices, a registry (`choice`) the functions it may name, `bounded` its numeric bounds, the
type hint its type; the other rules are written by hand in `labkit.settings.config_checks`.
Whether this machine has what the config names (a model folder, a GSM8K file, CUDA) is
`labkit.settings.preflight`'s question, asked by the trainer before it makes or loads anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Literal

from labkit.formulas.advantages import Scale
from labkit.formulas.estimators import ESTIMATORS
from labkit.formulas.losses import AGG_MODES, Level
from labkit.formulas.policy_losses import LOSS_SPECS
from labkit.problems.reward_expr import REWARD_SPECS, spec_text
from labkit.run import trackers
from labkit.settings import config_checks
from labkit.settings.defaults import fill_defaults
from labkit.settings.fields import base_types, bounded, check, choice, choices, docs


@dataclass
class TrainConfig:
    """A training run of GRPO (or a variant) or PPO on one task."""

    # --- what to train -------------------------------------------------------------
    algo: Literal["grpo", "ppo", "dpo", "rft"] = "grpo"
    """grpo: group-relative advantages, no critic; ppo: a critic and GAE; dpo: the DPO loss on
    pairs from each group, chosen rewarded above rejected (labkit.preference); rft:
    rejection-sampling fine-tuning, a supervised step on the rewarded completions
    (labkit.rft). All four sample B x G completions a step."""
    model: str | None = None
    """Local model folder or hub id; None is the embedded tiny model."""
    chat_template: bool = True
    """Feed prompts through the tokenizer's chat template where it has one (an instruct
    model's); False feeds the raw prompt text, as to a base model."""
    task: Literal["arithmetic", "think", "dataset", "gsm8k", "code"] = "arithmetic"
    """Problem source: procedural arithmetic; think, the arithmetic on which how much to
    write is the policy's choice (sums of 2 to 5 one-digit numbers; with model=None the
    embedded tiny-arith-think, warm-started on worked solutions and direct answers alike);
    dataset, any local file at `dataset_path` with a prompt and an answer column; GSM8K
    from `gsm8k_path`; or code problems from `code_path` (HumanEval or MBPP format, scored
    by reward='code' in the sandbox). digits, operands, min_operands and
    max_new_tokens left None take the task's values (TASK_SHAPES)."""
    digits: int | None = bounded(None, ge=1)
    """Arithmetic: digits per operand (None: the task's, 2; think's 1)."""
    operands: int | None = bounded(None, ge=1)
    """Arithmetic: numbers per problem, the most with min_operands (None: 2; think's 5)."""
    min_operands: int | None = bounded(None, ge=0)
    """Arithmetic: fewest numbers per problem; each problem's count is drawn uniformly from
    min_operands .. operands, so solutions differ in length. 0: always `operands` (None: 0;
    think's 2)."""
    scratchpad: bool = False
    """Arithmetic: problems solved in writing, the running results before the boxed answer
    ('3+4+5=' -> '3+4=7,7+5=12. \\boxed{12}'); with model=None the run loads the embedded
    scratchpad model (tiny-arith-scratchpad, warm-started on digits=1, operands 2..5), and
    max_new_tokens must hold the longest worked solution."""
    ops: str = "+"
    """Arithmetic: operators to draw from ('+', '-', '*')."""
    gsm8k_path: str | None = None
    """GSM8K: a local jsonl with 'question' and 'answer' (train on it, evaluate on it)."""
    dataset_path: str | None = None
    """Dataset: a local .jsonl, .json (either .gz), .parquet or .csv file, read with the
    `datasets` library (labkit.problems.dataset_task); its other columns reach the reward functions
    by name, as TRL passes them."""
    prompt_column: str = "prompt"
    """Dataset: the column that holds the prompt."""
    answer_column: str = "answer"
    """Dataset: the column that holds the ground truth (GSM8K's '... #### N' reads as N)."""
    code_path: str | None = None
    """Code: a local HumanEval- or MBPP-format .jsonl or .jsonl.gz (labkit.problems.code_tasks)."""
    reward: str = choice("correctness", REWARD_SPECS)
    """How a completion is scored (labkit.problems.reward_expr): a reward of
    labkit.problems.rewards.REWARDS (correctness: the final answer verified; strict: only a boxed answer counts; format: ends
    in a box); shaped(lam=0.3): correctness - lam * (1 - the fraction of intermediate results
    written); noisy(p=P): correctness's 0/1 verdict flipped with probability P, drawn from the
    step's seed (a reward model of accuracy 1 - P); systematic(p=P): every verdict flipped on
    a fixed share P of the prompts (a reward model whose errors follow the problem); a
    wrapper's first argument may name another reward, noisy(strict, p=0.1); a TRL reward
    function package.module:function, called with
    the keywords prompts, completions, answer, steps, target, step_seed; or a weighted sum of
    these, correctness+0.3*format (weights finite, non-zero; '-' subtracts). In Python also a
    list of (reward, weight) pairs, stored as that sum."""
    seed: int = 0
    """Seeds the weights' noise, the prompts of each step and every sample."""

    # --- sampling ------------------------------------------------------------------
    steps: int = bounded(600, ge=1)
    """RL steps; each samples a fresh batch of B prompts x G completions."""
    batch_prompts: int = bounded(32, ge=1)
    """B: prompts per step."""
    group_size: int = bounded(8, ge=1)
    """G: completions per prompt (PPO samples G per prompt too, for an equal budget)."""
    max_new_tokens: int | None = bounded(None, ge=1)
    """Completion budget in tokens; a completion without EOS by then is truncated (None: the
    task's, 16; think's 48, its longest worked solution and a margin)."""
    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature; the log-probs of the update use the same one."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling: 1.0 turns it off."""
    top_k: int | None = bounded(None, ge=1)
    """Top-k sampling: keep the k most likely tokens; None turns it off."""
    score_truncated: bool = False
    """Grade completions that hit max_new_tokens without EOS; False scores them 0 (they never
    finished), which keeps the policy from learning to run on past its answer."""

    # --- GRPO variants ---------------------------------------------------------------
    estimator: str | None = choice(None, ESTIMATORS)
    """Advantage estimator, a name of labkit.formulas.estimators.ESTIMATORS; None takes the
    algorithm's own: grpo for GRPO, gae for PPO (the one that reads a critic's values)."""
    vine_samples: int = bounded(8, ge=1)
    """vineppo: continuations drawn from each step boundary of each completion for its Monte
    Carlo value (labkit.model.credit)."""
    scale: Scale = "group"
    """grpo: divide by the group's std, the batch's std, or nothing."""
    std_unbiased: bool = True
    """grpo: the std divides by G-1 (torch, TRL) rather than G."""
    loss: str = choice("vanilla", LOSS_SPECS)
    """Policy-loss mode, a name of labkit.formulas.policy_losses.POLICY_LOSSES with its options:
    sapo(tau_pos=1.0, tau_neg=1.05). eps_low and eps_high are each mode's bounds; dual_clip
    and ratio_level apply to vanilla."""
    agg: str = choice("token-mean", AGG_MODES)
    """How per-token losses become one number, a name of labkit.formulas.losses.AGG_MODES."""
    eps_low: float = bounded(0.2, ge=0, lt=1)
    """Clip range below 1: ratio >= 1 - eps_low."""
    eps_high: float = bounded(0.2, ge=0)
    """Clip range above 1: ratio <= 1 + eps_high (DAPO's clip-higher: 0.28)."""
    dual_clip: float | None = bounded(None, gt=1)
    """Dual clip c > 1: for A < 0 the per-token loss is capped at -c*A (verl clip_ratio_c)."""
    ratio_level: Level = "token"
    """token: PPO's per-token ratio; sequence: GSPO's length-normalised sequence ratio."""
    beta: float = bounded(0.0, ge=0)
    """KL coefficient (the first, with kl_target): where kl_in puts it. 0 loads no reference."""
    kl_in: Literal["auto", "loss", "reward"] = "auto"
    """Where the KL penalty sits: auto is GRPO's loss (DeepSeekMath) and PPO's reward
    (InstructGPT); loss adds beta * KL to the policy loss, reward subtracts beta * KL per
    token from the reward (a group estimator sees r - beta * sum_t KL_t), for either
    algorithm (verl's use_kl_loss / use_kl_in_reward)."""
    kl_target: float | None = bounded(None, gt=0)
    """Adaptive KL (Ziegler et al., 2019): after each step beta *= 1 + clip(KL / kl_target -
    1, -0.2, 0.2) * N / kl_horizon, KL the step's mean per-token estimate; None keeps beta."""
    kl_horizon: int = bounded(10000, ge=1)
    """Adaptive KL: the horizon, in completions, over which beta moves by up to 20%."""
    kl_kind: Literal["auto", "k1", "k2", "k3", "abs", "k1+", "k3+", "abs+", "full"] = "auto"
    """KL estimator of labkit.formulas.losses.kl; auto picks per algorithm, as the papers do: k3 in
    GRPO's loss (DeepSeekMath; unbiased and >= 0), k1 = logp - ref_logp in PPO's reward
    (InstructGPT, Ouyang et al. 2022). An explicit kind wins (`kl_estimator`): abs = |log
    ratio|; k1+, k3+, abs+ keep their base kind's value with k2's gradient (verl); full is
    the exact KL over the vocabulary at each state (keeps the reference's (N, T, V)
    log-distributions, so its memory grows with the vocabulary)."""
    ref_sync_every: int = bounded(0, ge=0)
    """Iterative GRPO (DeepSeekMath's iterative RL; TRL's sync_ref_model): after every
    ref_sync_every-th step the reference becomes ref_mix x policy + (1 - ref_mix) x
    reference, weight by weight (TRL's ref_model_sync_steps, counted in steps here). It needs
    a reference (beta > 0) and a whole one (lora_rank=0). 0: the reference stays the
    starting model."""
    ref_mix: float = bounded(0.6, gt=0, le=1)
    """The sync's mix alpha (TRL's ref_model_mixup_alpha, 0.6 by default there too); 1
    copies the policy into the reference."""
    entropy_coef: float = bounded(0.0, ge=0)
    """Entropy bonus: loss - entropy_coef * mean entropy."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal before the update."""
    sampler_temperature: float | None = bounded(None, gt=0)
    """Sample the rollout at this temperature while the learner scores at `temperature`: a
    sampler-learner mismatch made on purpose, for the corrections below to correct; None
    samples at `temperature`."""
    sampler_precision: Literal["auto", "bf16"] = "auto"
    """bf16: the rollout's matrix products and logits run in bf16 while the learner scores in
    fp32, the mismatch of a bf16 inference engine feeding an fp32 trainer, made on purpose
    (even for a model small enough that the rollout otherwise stays fp32 on a CPU); the
    learner's own precision must then be fp32 or auto. auto: the rollout computes as the
    learner does."""
    mismatch_is: Literal["off", "token", "sequence"] = "off"
    """Importance weights pi_learner / pi_sampler on the policy loss (labkit.formulas.mismatch): per
    token, or per sequence (the product); the PPO ratio then uses the learner's old
    log-probs, recomputed once per step. off: the sampler's log-probs are the old ones."""
    mismatch_cap: float = bounded(2.0, gt=0)
    """Truncated importance sampling: weights above this are cut to it."""
    mismatch_low: float | None = bounded(None, gt=0)
    """With it, weights outside [mismatch_low, mismatch_cap] become 0 instead (IcePop, masked
    importance sampling)."""
    reject_low: float | None = bounded(None, gt=0)
    """Rejection: leave out of the update the completions whose geometric-mean ratio
    pi_learner / pi_sampler is below this (set reject_high too)."""
    reject_high: float | None = bounded(None, gt=0)
    """Rejection: ... or above this."""
    top_entropy: float = bounded(1.0, gt=0, le=1)
    """Only this fraction of each micro-batch's real tokens, those of highest entropy, carry
    the policy loss ("80/20", Wang et al., 2025; TRL top_entropy_quantile); the aggregation
    still counts every token, as TRL. 1 keeps all."""
    mask_truncated: bool = False
    """Leave the completions cut at max_new_tokens out of the update (DAPO's overlong
    filtering; TRL mask_truncated_completions drops their tokens the same way)."""
    overlong_buffer: int = bounded(0, ge=0)
    """DAPO's soft overlong punishment: a completion of L tokens gets -overlong_penalty *
    max(0, L - (max_new_tokens - overlong_buffer)) / overlong_buffer added to its reward
    (verl's overlong_buffer); 0 turns it off."""
    overlong_penalty: float = bounded(1.0, ge=0)
    """The soft overlong punishment at the budget's end (verl's penalty_factor)."""
    reinforce: bool = False
    """Plain REINFORCE with the advantage as weight: one update, no ratio, no clip."""

    # --- DPO -------------------------------------------------------------------------
    dpo_beta: float = bounded(0.1, gt=0)
    """DPO: beta, the strength of the reference in the loss (TRL's DPOConfig.beta, 0.1 there
    too); the implied reward of a completion is beta log pi/pi_ref."""
    dpo_loss: Literal["sigmoid", "ipo", "robust"] = "sigmoid"
    """DPO: the loss of a pair (labkit.preference): sigmoid (DPO; with label_smoothing the
    conservative DPO), ipo (length-normalised, as TRL), robust (Chowdhury et al., 2024)."""
    label_smoothing: float = bounded(0.0, ge=0, lt=0.5)
    """DPO: the probability that a pair's preference is flipped (sigmoid and robust)."""
    dpo_grpo_cosine: bool = False
    """DPO: log each step the cosine between the DPO gradient on the step's pairs and the
    GRPO gradient (estimator, agg) on the same rollout, both at the weights before the
    update (dpo/grpo_cosine; one more backward pass a step). At G=2 the two see the same
    pair ("GRPO with G=2 is DPO", Wu et al., 2025)."""
    dpo_online: bool = True
    """DPO: sample each step's pairs from the policy as it stands (online DPO); False samples
    them from the starting model (offline: a dataset drawn once from it, each sample used
    once)."""

    # --- PPO -------------------------------------------------------------------------
    gamma: float = bounded(1.0, ge=0, le=1)
    """PPO: discount of GAE."""
    lam: float = bounded(0.95, ge=0, le=1)
    """PPO: lambda of GAE."""
    critic_lr: float = bounded(1e-3, gt=0)
    """PPO: the critic's learning rate."""
    value_clip: float | None = bounded(0.2, gt=0)
    """PPO: clip range of the value loss around the old values; None turns it off."""
    whiten_advantages: bool = True
    """PPO: normalise the GAE advantages over the batch's tokens."""

    # --- optimisation ------------------------------------------------------------------
    lr: float | None = bounded(None, gt=0)
    """Policy learning rate (AdamW) after warmup; None takes the algorithm's (ALGO_LR): 1e-3
    for GRPO, 5e-4 for PPO, whose per-token advantages at 1e-3 lost the EOS token for good
    on one default seed in four (docs/results.md)."""
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = bounded(10, ge=0)
    """Optimizer steps of linear warmup."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warmup: cosine decay to min_lr_ratio * lr, or constant."""
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)
    """Cosine floor as a fraction of lr."""
    max_grad_norm: float = bounded(1.0, ge=0)
    """Clip the gradient norm (0 turns it off)."""
    num_iterations: int = bounded(1, ge=1)
    """Passes over each rollout batch (mu in the GRPO paper); > 1 makes the ratio differ from 1."""
    minibatches: int = bounded(1, ge=1)
    """Optimizer steps per pass: the N rows are split into this many minibatches."""
    grad_accum: int = bounded(1, ge=1)
    """Micro-batches per minibatch, accumulated before the optimizer step (same result, less
    memory)."""

    # --- evaluation and runs -------------------------------------------------------------
    eval_every: int = bounded(100, ge=1)
    """Steps between held-out evaluations (and one before the first step)."""
    eval_n: int = bounded(1000, ge=1)
    """Held-out problems per evaluation, distinct, the same at every evaluation; at most the
    held-out split (1006 problems for two-digit addition). Its accuracy's binomial standard
    error is sqrt(p(1-p)/eval_n): 0.016 at p=0.5 for 1000."""
    eval_samples: int = bounded(4, ge=0)
    """Sampled completions per held-out problem, for pass@1 and pass@k."""
    cgc_prompts: int = bounded(32, ge=0)
    """Fixed held-out prompts whose G rewards give CGC at each evaluation."""
    diag_every: int = bounded(0, ge=0)
    """Steps between estimator diagnostics (labkit.probes.diagnose, docs/diagnostics.md) of the
    current policy (and PPO's critic), also at step 0 and at the last step: flat `diag/...`
    figures in metrics.jsonl, the full record as a line of diagnostics.jsonl. 0: never."""
    diag_prompts: int = bounded(16, ge=1)
    """Diagnostics: the first held-out problems measured (B), the same at every measurement;
    at most eval_n."""
    diag_batches: int = bounded(16, ge=3)
    """Diagnostics: K independent batches of G completions per prompt (the gradient noise)."""
    diag_samples: int = bounded(128, ge=2)
    """Diagnostics: M completions per prompt for V* and the reference gradient."""
    credit_every: int = bounded(0, ge=0)
    """Steps between looks through the credit microscope (labkit.probes.microscope) at the current
    policy (and PPO's critic), also at the last step: the Monte Carlo value of every prefix
    of the first credit_prompts held-out problems' completions against the critic, GAE and
    GRPO, as flat `credit/...` figures in metrics.jsonl and the errors by position as a
    line of credit.jsonl. 0: never."""
    credit_prompts: int = bounded(16, ge=1)
    """Credit microscope: the first held-out problems looked at (G completions each); at
    most eval_n."""
    credit_samples: int = bounded(8, ge=1)
    """Credit microscope: continuations drawn from each prefix for its Monte Carlo value."""
    run_dir: str | None = None
    """Where the run writes; None makes experiments/runs/<algo>/<time>-<pid>."""
    checkpoint_every: int = bounded(0, ge=0)
    """Steps between checkpoints (0: only at the end)."""
    keep_every: int = bounded(0, ge=0)
    """Checkpoints kept for good: those at steps divisible by keep_every (saved by
    checkpoint_every) stay beside the newest two, so the run can be forked there
    (labkit.fork); 0: only the newest two are kept."""
    fork_of: str | None = None
    """The run this one was forked from (`python -m labkit fork`, labkit.fork); None for a
    run trained from step 0."""
    fork_step: int = bounded(0, ge=0)
    """A fork's first step is fork_step + 1: the parent's checkpoint at fork_step is its
    start (labkit.fork)."""
    continuation_seed: int | None = bounded(None, ge=0)
    """A fork's continuation: None draws the steps after fork_step as the parent does (the
    parent's own continuation); c draws them from stream c instead (prompts, samples,
    minibatch order: labkit.trainer.step_seed)."""
    tensor_peak_step: int = bounded(2, ge=0)
    """The tensors' peak (perf/tensor_peak_mb, labkit.probes.tensor_memory) is measured from
    before the model is built to the end of this step (the last when the run is shorter; at
    2 AdamW's states exist) and logged on it. 0: not measured."""
    device: str | None = None
    """cpu, cuda, cuda:1; None picks CUDA when available."""
    threads: int = bounded(0, ge=0)
    """torch's CPU threads for the run; 0 keeps the process's setting (torch's default: one
    per core). A run repeats bit for bit on one machine at one thread count
    (labkit.reproducible); another count rounds differently."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Mixed precision of the update: auto is bf16 on a GPU that has it, else fp32."""
    share_prompt: bool | None = None
    """Update: run each prompt once per group and its G completions against its KV cache
    (same log-probs and gradients as running the prompt G times). None (auto) does so when
    it saves at least labkit.model.scoring.SHARE_MIN_POSITIONS token positions in a pass (long
    prompts: below that the extra forward call costs more than it saves); True always,
    False never."""
    fast: bool = True
    """Run Llama, Mistral, Qwen2 and Qwen3 models through labkit.fast's hand-written
    forward and decoder (the same numbers up to float rounding, with far less per-call
    overhead); False, or any other architecture, uses the model's own forward. Read once,
    by learner.build_learner (labkit.model.scoring.FAST_PASSES or MODEL_PASSES)."""
    replay: bool = True
    """Update: the first optimizer step's forward of the policy takes the outputs of the
    products from the rollout that just ran them with the same weights (labkit.fast.replay)
    instead of computing them again; the backward is unchanged and the log-probs are the
    decoder's (the same up to float rounding). It applies on labkit.fast's passes (fast),
    with the prompt run once per group (share_prompt), the rollout and the update in one
    precision, on one process, for models of labkit.fast.replay.REPLAY_MIN_PARAMS
    parameters or more within REPLAY_MAX_BYTES; elsewhere, or False, the update computes."""
    lora_rank: int = bounded(0, ge=0)
    """LoRA (Hu et al., 2021; labkit.model.lora, the `lora` extra): 0 trains every weight; r > 0
    trains rank-r adapters on lora_targets only, the reference being the same model with
    its adapters off (no second copy) and PPO's critic getting adapters of its own. The
    lean passes do not take adapters: the models run their own forward."""
    lora_alpha: float = bounded(16.0, gt=0)
    """LoRA's scale: an adapter adds (lora_alpha / lora_rank) B A x."""
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated names of the linear layers that get adapters (Llama-family names by
    default: every projection of attention and MLP)."""
    progress: bool = True
    """Show a progress bar."""
    rollouts_every: int = bounded(0, ge=0)
    """Keep a sample of rollouts in rollouts.jsonl (labkit.probes.samples) at the first step, every
    rollouts_every-th step and the last: rollouts_groups groups, each completion's tokens
    with its reward and advantage, and per token the advantage, entropy and ratio. 0: none."""
    rollouts_groups: int = bounded(2, ge=1)
    """Groups kept per sampled step: the step's first ones (all of them when the step has
    fewer)."""
    report_to: str = "none"
    """Trackers that also receive every metrics.jsonl record (labkit.run.trackers): any of
    tensorboard, mlflow, trackio, wandb (offline), comma-separated; none by default. Each is
    an optional extra (pip install 'labkit[tensorboard]')."""

    # --- stopping -------------------------------------------------------------------------
    stop_rules: str = ""
    """Stop early, with a checkpoint, when a logged metric misbehaves: rules separated by ';',
    each 'METRIC OP NUMBER [for COUNT]' with OP one of > >= < <= and METRIC a key of
    labkit.formulas.metrics.METRICS, e.g. 'rollout/truncated_frac>0.9 for 20; policy/kl>0.5'.
    COUNT (default 1) consecutive records that log the metric must meet the condition.
    Blank: no rule."""
    dead_steps: int = bounded(20, ge=0)
    """K: a run is dead after K consecutive steps in which no group has reward variance (all
    N rewards equal when group_size is 1) or nearly every completion hits max_new_tokens
    (rollout/truncated_frac >= labkit.run.stops.DEAD_TRUNCATED); it is said, recorded in
    dead_run.json, and stops the run unless stop_when_dead is False. K must outlast the dead
    spells that recover (a few steps). 0 turns the detection off."""
    stop_when_dead: bool = True
    """End a dead run (see dead_steps) with a checkpoint and stopped.json, so a resume does not
    continue it; False only says so and records it (experiments that count collapses)."""

    def __post_init__(self):
        """Every field is checked here, so a bad value fails before any model loads, with a
        message that names the field and the rule it breaks. Nothing here probes the
        machine (files, devices): that is `preflight`."""
        self.reward = spec_text(self.reward)  # a list of (reward, weight) pairs -> its sum
        fill_defaults(self)
        self.report_to = ",".join(trackers.parse(self.report_to)) or "none"
        check(self)
        config_checks.check_rules(self)

    @property
    def rows(self) -> int:
        """N = B * G completions per step."""
        return self.batch_prompts * self.group_size

    @property
    def rescores_old(self) -> bool:
        """Whether a step recomputes the old log-probs with the learner (a mismatch to
        measure or correct)."""
        return (self.sampler_temperature is not None or self.sampler_precision != "auto"
                or self.mismatch_is != "off" or self.reject_low is not None)

    @property
    def has_reference(self) -> bool:
        """Whether a run holds a reference model: for the KL penalty (beta > 0) or DPO's."""
        return self.beta > 0 or self.algo == "dpo"

    @property
    def kl_place(self) -> str:
        """Where the KL penalty sits: kl_in, or for auto the loss (GRPO) or the reward (PPO)."""
        if self.kl_in != "auto":
            return self.kl_in
        return "reward" if self.algo == "ppo" else "loss"

    @property
    def kl_estimator(self) -> str:
        """The KL estimator a run uses: kl_kind, or for auto k1 (PPO's reward) or k3 (GRPO's
        loss)."""
        if self.kl_kind != "auto":
            return self.kl_kind
        return "k1" if self.algo == "ppo" else "k3"

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps in the whole run."""
        return self.steps * self.num_iterations * self.minibatches

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """The config of a config.json; `lean`, the name `fast` had in older run
        directories, is read as `fast`, a PPO run's `estimator: grpo` (older runs, whose
        PPO ignored the field) as `gae`, and `top_k: 0` (older runs' "off") as None."""
        if "lean" in values and "fast" not in values:
            values = {("fast" if k == "lean" else k): v for k, v in values.items()}
        if values.get("algo") == "ppo" and values.get("estimator") == "grpo":
            values = {**values, "estimator": "gae"}  # older runs: PPO ignored the field
        if values.get("top_k") == 0:
            values = {**values, "top_k": None}  # older runs turned top-k off with 0
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**values)


def field_docs() -> dict[str, str]:
    """Each field's docstring, one line each, for the command line's --help."""
    return docs(TrainConfig)


def field_types() -> dict[str, type]:
    """The base type of each field (str for a choice, float for `float | None`), for the
    command line and the notebooks' parameter checks."""
    return base_types(TrainConfig)


def field_choices() -> dict[str, str]:
    """The choices of each field that has a list of them, one line each, for --help."""
    return choices(TrainConfig)
