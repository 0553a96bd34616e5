"""The namespace table of every logged key, `METRICS`, from which docs/metrics.md is generated
(`labkit.formulas.metrics.metrics_table`); `labkit.formulas.metrics.METRICS` is this table.

The `diag/` rows are the flat figures of the estimator diagnostics
(`labkit.probes.estimator_quality`, docs/diagnostics.md) that a run logs every `diag_every`
steps: one row per figure and estimator, built from `DIAG_BASELINES` and `DIAG_GRADIENTS`,
which copy `estimator_quality.GROUP_ESTIMATORS` and `CRITIC_ROWS` (this table stands below
the probes; tests/test_diagnostics.py checks the copies agree).
"""

from __future__ import annotations

METRICS: dict[str, str] = {
    "rollout/reward_mean": "mean reward over the N = B*G completions of the step",
    "rollout/reward_std": "std of the N rewards over the batch (divides by N)",
    "rollout/group_reward_std":
        "std of the G rewards within each group (divides by G), averaged over the B groups",
    "rollout/frac_zero_std":
        "fraction of groups whose G rewards are all equal: zero GRPO advantage, no learning "
        "signal",
    "rollout/length_mean":
        "mean completion length in tokens (unmasked tokens per row, EOS included)",
    "rollout/length_max": "longest completion of the step, in tokens",
    "rollout/truncated_frac": "fraction of completions that hit max_new_tokens without EOS",
    "rollout/worked_frac":
        "arithmetic: share of completions that work ('3+4=' before the box), not answer at once",
    "rollout/steps_mean":
        "arithmetic: mean number of steps ('3+4=') a completion writes before its box",
    "rollout/acc_worked": "arithmetic: correctness of the worked completions (absent if none)",
    "rollout/acc_direct": "arithmetic: correctness of the direct answers (absent if none)",
    "rollout/length_correct": "arithmetic: mean tokens of the correct completions (absent if none)",
    "rollout/length_incorrect": "arithmetic: mean tokens of the wrong completions (absent if none)",
    "rollout/overlong_penalty":
        "overlong_buffer > 0: the mean soft overlong punishment added to the rewards (DAPO), "
        "between -overlong_penalty and 0",
    "rollout/kept_frac":
        "fraction of the N completions the update used (dynamic sampling drops the groups "
        "whose rewards are all equal, mask_truncated the completions cut at the budget; 1 "
        "without either)",
    "perf/mc_continuations": "estimator vineppo: continuations drawn this step for the Monte "
                             "Carlo values at the step boundaries",
    "perf/mc_s": "estimator vineppo: seconds those continuations took",
    "credit/critic_err":
        "credit_every: mean |V_critic(s_t) - V_MC(s_t)| over the looked-at completions' tokens, "
        "V_MC from credit_samples continuations of each prefix (labkit.model.credit)",
    "credit/gae_err": "credit_every: mean |GAE's advantage - A_MC| per token, "
                      "A_MC = V_MC(s_{t+1}) - V_MC(s_t)",
    "credit/grpo_err": "credit_every: mean |r - group mean - A_MC| per token (GRPO's advantage "
                       "before the std)",
    "credit/critic_err_s1": "credit_every: mean |V_critic - V_MC| just after the first written "
                            "step (_s2, _s3, _s4: after the later ones)",
    "credit/critic_err_s2": "as credit/critic_err_s1, after the second step",
    "credit/critic_err_s3": "as credit/critic_err_s1, after the third step",
    "credit/critic_err_s4": "as credit/critic_err_s1, after the fourth step",
    "credit/continuations": "credit_every: continuations drawn for the look, its cost",
    "credit/seconds": "credit_every: seconds the look took",
    "adv/mean":
        "mean advantage over the N completions, or over the unmasked tokens for (N, T) advantages",
    "adv/std": "std of the advantages (divides by the count), same selection as adv/mean",
    "adv/min": "smallest advantage, same selection as adv/mean",
    "adv/max": "largest advantage, same selection as adv/mean",
    "adv/gav":
        "group advantage variance (GAV), a std despite its name: std of the G per-completion "
        "advantages within a group (divides by G), averaged over groups",
    "clip/low":
        "fraction of unmasked tokens with ratio < 1 - eps_low and A < 0: the low clip is active, "
        "the gradient is cut (loss geo_mean: log-ratio < -eps_low)",
    "clip/high":
        "fraction of unmasked tokens with ratio > 1 + eps_high and A > 0: the high clip is "
        "active, the gradient is cut (loss geo_mean: log-ratio > eps_high)",
    "clip/total":
        "clip/low + clip/high: the token-level clip ratio (TLCR); in training each clip/* is the "
        "mean over the step's optimizer steps, all num_iterations passes",
    "reuse/clip_low": "clip/low over the passes after the first (num_iterations >= 2 only)",
    "reuse/clip_high": "clip/high over the passes after the first (num_iterations >= 2 only)",
    "reuse/clip_total":
        "clip/total over the passes after the first, where the ratio can differ from 1 (on the "
        "first pass it is 1 and nothing clips); num_iterations >= 2 only",
    "clip/dual": "fraction of unmasked tokens with A < 0 whose loss the dual clip caps at -c * A",
    "clip/weight":
        "loss cispo: fraction of unmasked tokens whose importance weight was clipped to "
        "[1 - eps_low, 1 + eps_high] (either side, any advantage)",
    "clip/cov":
        "loss clip_cov / kl_cov: fraction of unmasked tokens taken out of the gradient / given "
        "the KL penalty for their high covariance of advantage and log-prob",
    "clip/trust":
        "loss dppo_tv / dppo_kl: fraction of unmasked tokens outside the trust region (no "
        "gradient)",
    "clip/truncated":
        "loss dppo_tv / dppo_kl: fraction of unmasked tokens in the region whose weight "
        "min(ratio, clip_c) was truncated",
    "mismatch/ratio_mean":
        "with a sampler-learner mismatch measured (sampler_temperature, sampler_precision, "
        "mismatch_is, reject_*): mean over real tokens of pi_learner / pi_sampler for the "
        "sampled token",
    "mismatch/ratio_max": "largest token ratio pi_learner / pi_sampler",
    "mismatch/log_ppl_diff":
        "mean over completions of log-perplexity under the sampler minus under the learner",
    "mismatch/weight_mean":
        "mismatch_is: mean importance weight on the policy loss (after truncation or masking)",
    "mismatch/rejected_frac":
        "reject_low / reject_high: fraction of completions left out for their geometric-mean "
        "ratio",
    "ratio/mean": "mean importance ratio exp(logp - old_logp) over unmasked tokens",
    "ratio/max": "largest importance ratio exp(logp - old_logp) over unmasked tokens",
    "policy/beta":
        "the KL coefficient the step used (beta > 0): the config's, or as the adaptive "
        "controller (kl_target) has moved it",
    "policy/kl":
        "mean per-token KL estimate (kl_kind: k3 for GRPO, k1 for PPO by default) to the "
        "reference over unmasked tokens: GRPO's as in its loss, during the update; PPO's on the "
        "sampling log-probs, as in its reward",
    "policy/kl_k1":
        "mean over unmasked tokens of k1 = logp_old - logp_ref, the sampling log-probs against "
        "the reference before the update: the same quantity for GRPO and PPO (beta > 0), and "
        "online DPO",
    "ref/synced":
        "ref_sync_every > 0: 1.0 on a step after which the reference was mixed toward the "
        "policy (iterative GRPO), else 0.0; policy/kl_k1 drops on the step after",
    "dpo/pairs": "algo dpo: preference pairs of the step (chosen rewarded above rejected, "
                 "from the same group)",
    "dpo/pairless_frac": "algo dpo: fraction of groups that gave no pair (all rewards equal), "
                         "skipped as GRPO's zero-std groups",
    "dpo/reward_chosen": "algo dpo: mean implied reward beta log pi/pi_ref of the chosen "
                         "completions (TRL rewards/chosen)",
    "dpo/reward_rejected": "algo dpo: mean implied reward of the rejected completions (TRL "
                           "rewards/rejected)",
    "dpo/reward_margin": "algo dpo: mean implied reward of chosen minus rejected (TRL "
                         "rewards/margins)",
    "dpo/reward_accuracy": "algo dpo: fraction of pairs whose chosen completion has the higher "
                           "implied reward (TRL rewards/accuracies)",
    "dpo/grpo_cosine": "algo dpo with dpo_grpo_cosine: cosine between the DPO gradient on the "
                       "step's pairs and the GRPO gradient on the same rollout, before the "
                       "update",
    "loss/dpo": "algo dpo: the DPO loss of dpo_loss, mean over the pairs",
    "loss/sft": "algo rft: -log-prob of the kept completions' tokens, aggregated by agg",
    "policy/entropy": "mean per-token entropy of the policy over unmasked tokens, in nats",
    "value/explained_var":
        "1 - Var(R - V) / Var(R) over unmasked tokens: 1 is a perfect critic, 0 no better than a "
        "constant",
    "value/clipfrac":
        "fraction of unmasked tokens where the clipped branch of the value loss is the larger",
    "loss/policy": "clipped-surrogate policy loss, aggregated over tokens by the chosen mode",
    "loss/kl":
        "KL term as added to the loss: beta times the aggregated per-token KL (absent when the KL "
        "is in the reward)",
    "loss/entropy":
        "entropy term as added to the loss: minus the coefficient times the aggregated entropy",
    "loss/value": "value loss of the PPO critic, aggregated",
    "loss/total": "the scalar that is back-propagated",
    "perf/step_s": "wall-clock seconds of the step, rollout and update",
    "perf/tokens_per_s": "unmasked completion tokens of the step divided by perf/step_s",
    "perf/rollout_s": "wall-clock seconds of the rollout and the reward of the step",
    "perf/update_s": "wall-clock seconds of the update of the step (advantages, losses, optimizer)",
    "perf/mem_mb":
        "peak memory in MiB: CUDA memory allocated during the step on a GPU, the process's peak "
        "resident set so far on the CPU",
    "perf/tensor_peak_mb":
        "peak MiB the run's tensors held, from before the model is built to the end of step "
        "tensor_peak_step (logged there; labkit.probes.tensor_memory)",
    "perf/grad_norm": "global L2 norm of the policy gradient before clipping",
    "perf/eval_s":
        "wall-clock seconds of the held-out evaluation logged in the same record (greedy, "
        "sampled and CGC completions)",
    "opt/lr": "learning rate of the policy optimizer at this step",
    "eval/accuracy": "greedy accuracy on the held-out problems",
    "eval/pass@1": "mean correctness of the sampled completions of the held-out problems",
    "eval/pass@k":
        "unbiased pass@k (Chen et al. 2021) from the same samples, logged under the actual k, "
        "e.g. eval/pass@4",
    "eval/length": "mean greedy completion length on the held-out problems, in characters",
    "eval/n": "number of held-out problems evaluated",
    "eval/cgc":
        "cross-group consistency (CGC): std / |mean| (divides by G) of the G rewards of each "
        "fixed eval prompt, averaged over prompts with |mean| > eps",
}


DIAG_BASELINES = ("grpo", "dr_grpo", "rloo", "none", "ppo_critic")
"""Baseline-error rows: the group estimators, none, and (PPO runs only) the critic's value."""
DIAG_GRADIENTS = ("grpo", "dr_grpo", "rloo", "none", "ppo_critic", "ppo_gae", "ppo_critic_v0")
"""Gradient-noise rows; the ppo_ rows exist only on a run with a critic."""
BASELINE_SCALES_LOGGED = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The scale sweep's c values (`estimator_quality.BASELINE_SCALES`)."""
_CRITIC_ONLY = " (PPO runs only: it needs the critic)"


def _diag_rows() -> dict[str, str]:
    """The `diag/` rows, logged on the steps a run measures (diag_every; docs/diagnostics.md)."""
    rows = {"diag/v_star_mean":
            "diagnostics: mean over the fixed prompts of V*(q), the mean reward of M completions"}
    figures = (("baseline_mse", "mean over prompts of (b - V*)^2, b the baseline of", DIAG_BASELINES),
               ("baseline_bias", "mean over prompts of b - V*, b the baseline of", DIAG_BASELINES),
               ("grad_rel_var", "E||g - mean g||^2 / ||mean g||^2 over K batches (as trained) of",
                DIAG_GRADIENTS),
               ("grad_rel_var_raw", "grad_rel_var without std scaling or whitening, of",
                DIAG_GRADIENTS),
               ("grad_cos", "mean cosine of a batch's gradient (as trained) to the M-sample "
                "reference gradient, for", DIAG_GRADIENTS),
               ("grad_cos_raw", "grad_cos without std scaling or whitening, for", DIAG_GRADIENTS),
               ("grad_error", "mean over K batches of ||g - g*||^2 / ||g*||^2 (as trained), "
                "g* the M-sample reference gradient, for", DIAG_GRADIENTS),
               ("grad_error_raw", "grad_error without std scaling or whitening, for",
                DIAG_GRADIENTS))
    for figure, text, names in figures:  # the first row says it all, the others name theirs
        for i, name in enumerate(names):
            tail = _CRITIC_ONLY if name.startswith("ppo_") else ""
            said = f"diagnostics: {text}" if i == 0 else "the same, for"
            rows[f"diag/{figure}/{name}"] = f"{said} `{name}`{tail}"
    words = {"rel_var": "gradient relative variance", "cos": "mean cosine to g*",
             "error": "relative error ||g - g*||^2 / ||g*||^2", "mse": "baseline MSE against V*"}
    for figure, text in words.items():
        for i, c in enumerate(BASELINE_SCALES_LOGGED):
            rows[f"diag/scale/{figure}/{c:g}"] = (
                f"diagnostics, the scale sweep: {text} with the baseline c x group mean (raw "
                f"advantages), c = {c:g}" if i == 0 else f"the same, c = {c:g}")
        rows[f"diag/optimal/{figure}"] = (
            f"diagnostics: {text} of the per-prompt optimal baseline (docs/diagnostics.md)")
    rows["diag/optimal/slope"] = ("diagnostics: slope of the per-prompt optimal baseline on "
                                  "V* (1: the textbook b = V*; 0: a baseline of no use)")
    rows["diag/optimal/intercept"] = "diagnostics: intercept of that fit"
    return rows


METRICS.update(_diag_rows())
