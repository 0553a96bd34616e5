"""Estimator quality, measured exactly: baseline error and policy-gradient noise.

For one policy snapshot and a fixed set of B prompts, on identical samples for every
estimator (docs/diagnostics.md has the formulas and the command):

- V*(q), the true value of each prompt: the mean reward of M completions, with its
  standard error s / sqrt(M) (s the sample std, dividing by M-1).
- Baseline error: each estimator's baseline b of every completion of K batches of B x G
  (group mean for `grpo` and `dr_grpo`, leave-one-out mean for `rloo`, 0 for `none`, the
  critic's V(prompt) for `ppo_critic`), against V*: mean squared error and bias.
- Policy-gradient noise: each batch's flat gradient g of the on-policy surrogate (ratio 1,
  no clip, KL off), `agg(-A_t * logp_t)`, per estimator; the relative variance
  E||g - mean g||^2 / ||mean g||^2 over the K batches and the cosine of each g to the
  reference gradient (the M-sample batch with RLOO's leave-one-out baseline). Rows `raw`
  (no std scaling, no whitening) and `trained` (as the run computes its advantages).

This module is the math, on any differentiable per-completion (or per-token) log-prob: a
`Draw` is one batch's rewards, a function that returns its log-probs with their graph, the
mask and (optionally) a critic's values. `measure` runs it over K draws and the reference
draw that a `sampler(group_size, seed)` hands out; `labkit.probes.diagnose` builds that sampler
for a labkit policy (rollout, scoring, rewards registry), the tests one for a tabular policy.

Shapes: B prompts, G completions per prompt, N = B*G rows (row n is completion n % G of
prompt n // G), T completion tokens, K batches, M reference samples per prompt, P policy
parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from labkit.formulas import advantages as adv
from labkit.formulas import estimators as est
from labkit.formulas import losses

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "none")
"""The baselines every run reports: `none` is r itself (no baseline), the others are names
of `labkit.formulas.estimators.ESTIMATORS`."""
CRITIC_ROWS = ("ppo_critic", "ppo_gae", "ppo_critic_v0")
"""Gradient rows that exist only with a critic: its value as a baseline on every token
(GAE with lambda = 1), GAE with the run's gamma and lambda (as PPO trains), and its value at
the prompt V_0 as one baseline for the whole completion (the baseline whose error against
V* `baseline_mse/ppo_critic` measures, so that row's MSE and gradient are of one baseline)."""
BASELINE_SCALES = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The scale sweep: the baseline c x (group mean), from no baseline (c = 0) to GRPO's (c = 1).
The gradient is linear in the advantages, so each c's gradient is (1 - c) g_none + c g_grpo
of the same batch: the sweep costs no backward pass."""
MODES = ("raw", "trained")
"""raw: no std scaling, no whitening; trained: the advantages as the run computes them."""


@dataclass
class Draw:
    """One batch of completions of the fixed prompts, G per prompt."""

    rewards: Tensor
    """(N,) scalar reward of each completion."""
    logp: Callable[[], Tensor]
    """Returns the log-probs (N, T) (or (N,) for one-step completions) of the sampled tokens
    under the policy, with their graph to the parameters."""
    mask: Tensor | None = None
    """(N, T) 1 on real completion tokens; None: all real."""
    values: Tensor | None = None
    """(N, T) the critic's value before each completion token, or None without a critic."""


Sampler = Callable[[int, int], Draw]
"""sampler(group_size, seed) -> a Draw of the fixed prompts, group_size completions each."""


def group_baselines(rewards: Tensor, group_size: int, estimators: Sequence[str] = GROUP_ESTIMATORS,
                    *, values: Tensor | None = None) -> dict[str, Tensor]:
    """Each estimator's baseline b of every completion, (N,): r - A with A its raw advantage
    (no std scaling), so `grpo` and `dr_grpo` give the group mean including the completion,
    `rloo` the mean of the other G-1, `none` 0. With `values` (N, T), `ppo_critic` is the
    critic's value at the position that predicts the first completion token, values[:, 0]."""
    r = rewards.detach().double()
    out = {}
    for name in estimators:
        out[name] = r - raw_advantages(name, r, group_size)
    if values is not None:
        out["ppo_critic"] = values[:, 0].detach().double()
    return out


def raw_advantages(name: str, rewards: Tensor, group_size: int) -> Tensor:
    """Estimator `name`'s advantages (N,) without std scaling; `none` is the reward itself."""
    return est.estimate(name, est.AdvantageInputs(rewards, group_size, scale="none")).advantages


def advantage_rows(draw: Draw, group_size: int, config, *,
                   estimators: Sequence[str] = GROUP_ESTIMATORS) -> dict[tuple[str, str], Tensor]:
    """The advantages of every gradient row, keyed (estimator, mode): (N,) for the group
    estimators, (N, T) for the critic rows (present when the draw has values).

    trained: ESTIMATORS[name] with the config's `scale` and `std_unbiased`; `ppo_critic` and
    `ppo_gae` whitened over the batch's tokens when `config.whiten_advantages`. The token
    rewards of the critic rows carry no KL penalty (KL off): the reward on the last token.
    """
    r = draw.rewards.detach().float()
    rows = {}
    for name in estimators:
        rows[(name, "raw")] = raw_advantages(name, r, group_size)
        rows[(name, "trained")] = est.estimate(name, est.AdvantageInputs(
            r, group_size, scale=config.scale, unbiased=config.std_unbiased)).advantages
    if draw.values is not None:
        mask = _mask(draw, r.shape[0], draw.values.shape[1])
        token_rewards = losses.ppo_token_rewards(r, mask)  # (N, T) KL off
        for name, lam in (("ppo_critic", 1.0), ("ppo_gae", config.lam)):
            a, _ = adv.gae(token_rewards, draw.values, mask, gamma=config.gamma, lam=lam)
            rows[(name, "raw")] = a
            rows[(name, "trained")] = adv.whiten(a, mask) if config.whiten_advantages else a
        a0 = (r - draw.values[:, 0].detach().float())[:, None] * mask  # (N, T) r - V_0
        rows[("ppo_critic_v0", "raw")] = a0
        rows[("ppo_critic_v0", "trained")] = adv.whiten(a0, mask) \
            if config.whiten_advantages else a0
    return rows


def prompt_rows(prompts: int, group_size: int) -> dict[tuple[str, int], Tensor]:
    """One row per prompt q, advantage 1 on q's G completions and 0 elsewhere: its gradient
    h_q is what a baseline b_q of prompt q takes away, so a per-prompt baseline b gives
    g(r - b) = g(r) - sum_q b_q h_q (the surrogate is linear in the advantages)."""
    eye = torch.eye(prompts).repeat_interleave(group_size, dim=1)  # (B, N)
    return {("prompt", q): eye[q] for q in range(prompts)}


def optimal_baseline(g_none: Tensor, per_prompt: Tensor, reference: Tensor,
                     v: Tensor) -> dict:
    """The per-prompt baseline b (B,) that brings the batch gradients nearest the reference,
    min_b sum_k ||g_none,k - H_k^T b - g*||^2 (H_k (B, P) the batch's per-prompt gradients
    `prompt_rows`), fitted by least squares on one half of the K batches and judged on the
    other (two-fold cross-fitting, so its error is not fitted to the batches that judge it).
    g_none (K, P), per_prompt (K, B, P), reference (P,), v (B,) the prompts' V*.

    Returns the held-out gradients (K, P), the baseline (B,) (mean of the two fits), its
    slope on V* (least squares; None when V* is the same for every prompt) and its
    intercept: slope 1 and intercept 0 is the textbook b = V*, slope 0 a baseline of no use.
    """
    K, B = per_prompt.shape[:2]
    ref = reference.double()
    g = [g_none[k].double() for k in range(K)]
    H = lambda k: per_prompt[k].double()  # (B, P), one batch at a time in float64
    folds = ([k for k in range(K) if k % 2 == 0], [k for k in range(K) if k % 2 == 1])
    held, fits = torch.empty_like(g_none), []
    for fit, judge in (folds, folds[::-1]):
        gram = sum(H(k) @ H(k).T for k in fit)  # (B, B)
        target = sum(H(k) @ (g[k] - ref) for k in fit)  # (B,)
        ridge = 1e-9 * gram.diagonal().mean().clamp(min=1e-300) * torch.eye(
            B, dtype=gram.dtype, device=gram.device)
        b = torch.linalg.solve(gram + ridge, target)
        for k in judge:
            held[k] = (g[k] - H(k).T @ b).to(held.dtype)
        fits.append(b)
    b = (fits[0] + fits[1]) / 2
    x = v.double().cpu()
    vx = ((x - x.mean()) ** 2).sum()
    slope = float(((x - x.mean()) * (b.cpu() - b.mean().cpu())).sum() / vx) if vx > 0 else None
    intercept = None if slope is None else float(b.mean().cpu() - slope * x.mean())
    return {"gradients": held, "baseline": b.cpu(), "slope": slope,
            "intercept": intercept}


def _mask(draw: Draw, n: int, t: int) -> Tensor:
    return torch.ones(n, t, dtype=torch.long) if draw.mask is None else draw.mask


def surrogate_gradients(logp: Tensor, mask: Tensor | None, rows: dict, params: Sequence[Tensor],
                        *, agg: str = "token-mean", max_len: int | None = None
                        ) -> dict[tuple[str, str], Tensor]:
    """Flat gradient (P,) of the on-policy surrogate agg(-A_t * logp_t) for each row's
    advantages A, (N,) or (N, T): at ratio 1 the clipped loss has this gradient (REINFORCE
    with the aggregation's token weights). logp (N, T) or (N,) carries the graph.

    By the chain rule each gradient is J^T w, J = d logp / d params and w (N, T) the
    derivative of the loss with respect to logp; the distinct rows' w (rows with equal
    advantages share one gradient) go back through the model in one batched backward,
    or one backward each where the model's operations do not batch."""
    lp = logp if logp.dim() == 2 else logp[:, None]  # (N, T)
    m = torch.ones_like(lp, dtype=torch.long) if mask is None else mask
    keys, cotangents, same = [], [], {}
    x = lp.detach().requires_grad_(True)
    for key, a in rows.items():
        a_t = (a if a.dim() == 2 else a[:, None].expand_as(lp)).to(lp.device)  # (N, T)
        seen = next((k for k, (b, _) in zip(keys, cotangents) if torch.equal(b, a_t)), None)
        if seen is not None:
            same[key] = seen
            continue
        loss = losses.aggregate(-a_t.to(lp.dtype) * x, m, agg, max_len=max_len)
        keys.append(key)
        cotangents.append((a_t, torch.autograd.grad(loss, x)[0]))  # (N, T)
    w = torch.stack([c for _, c in cotangents])  # (R, N, T)
    flat = _batched_vjp(lp, params, w)  # (R, P)
    out = dict(zip(keys, flat))
    return {key: out[same.get(key, key)] for key in rows}


def _batched_vjp(lp: Tensor, params: Sequence[Tensor], w: Tensor) -> Tensor:
    """J^T w_r for each r, flat (R, P): one vmapped backward, else a loop."""
    def flat(grads, lead):
        return torch.cat([(g if g is not None else p.new_zeros(lead + p.shape)).reshape(
            *lead, -1) for g, p in zip(grads, params)], dim=-1).detach().float()
    try:
        grads = torch.autograd.grad(lp, params, grad_outputs=w, retain_graph=True,
                                    allow_unused=True, is_grads_batched=True)
        return flat(grads, (w.shape[0],))
    except RuntimeError:  # an operation without a batching rule
        return torch.stack([flat(torch.autograd.grad(lp, params, grad_outputs=w_r,
                                                     retain_graph=True, allow_unused=True), ())
                            for w_r in w])


def v_star(rewards: Tensor, samples: int) -> tuple[Tensor, Tensor]:
    """Per-prompt mean reward of M samples and its standard error s / sqrt(M): rewards
    (B*M,) -> ((B,), (B,)), float64."""
    r = rewards.detach().double().view(-1, samples)  # (B, M)
    return r.mean(1), r.std(1, correction=1) / math.sqrt(samples)


def baseline_error(baselines: Tensor, v: Tensor, v_se: Tensor) -> dict:
    """Mean squared error and bias of baselines (K, B, G) against V* (B,), with standard
    errors, and the per-prompt MSE (B,).

    Per prompt b, with e = baseline - V*_b: mse_b = mean over (k, g) of e^2, bias_b = mean e.
    The figure is the mean over prompts. Its standard error adds, per prompt, the spread
    over the K independent batches and that of V* itself (common to the K batches):
    se(bias_b)^2 = var_k(mean_g e) / K + se_b^2 and
    se(mse_b)^2 = var_k(mean_g e^2) / K + 4 bias_b^2 se_b^2 + 2 se_b^4 (delta method, V*
    normal with std se_b); se = sqrt(sum_b se_b^2) / B.
    """
    K, B = baselines.shape[:2]
    e = baselines.double() - v.double()[None, :, None]  # (K, B, G)
    sq, lin = (e * e).mean(2), e.mean(2)  # (K, B)
    mse_b, bias_b = sq.mean(0), lin.mean(0)  # (B,)
    spread = (lambda x: x.var(0, correction=1) / K) if K > 1 else (lambda x: torch.zeros(B))
    s2 = v_se.double() ** 2
    mse_var = spread(sq) + 4 * bias_b ** 2 * s2 + 2 * s2 ** 2
    bias_var = spread(lin) + s2
    return {"mse": float(mse_b.mean()), "mse_se": float(mse_var.sum().sqrt() / B),
            "bias": float(bias_b.mean()), "bias_se": float(bias_var.sum().sqrt() / B),
            "mse_per_prompt": mse_b.tolist()}


def _rel_var(gram: Tensor) -> float | None:
    """E||g - mean g||^2 / ||mean g||^2 from the Gram matrix (n, n) of n gradients: the
    spread divides by n-1; None when the mean gradient is 0."""
    n = gram.shape[0]
    total = gram.sum()
    mean_sq = total / n ** 2
    if not mean_sq > 0:
        return None
    return float((gram.diagonal().sum() - total / n) / (n - 1) / mean_sq)


def gradient_noise(grads: Tensor, reference: Tensor) -> dict:
    """Noise of K gradients (K, P) of one row against a reference gradient (P,).

    rel_var: E||g - mean g||^2 / ||mean g||^2 (the spread divides by K-1), its standard
    error by the jackknife over the K batches; cos: mean over k of cos(g_k, reference) (0
    for a zero g_k) and its standard error std / sqrt(K); mean_cos: cos(mean g, reference),
    the direction of the estimator's mean gradient. Needs K >= 3. None where undefined (a
    zero mean gradient).
    """
    g = grads.double()
    K = g.shape[0]
    gram = g @ g.T  # (K, K)
    rel = _rel_var(gram)
    rel_se = None
    if rel is not None:
        keep = ~torch.eye(K, dtype=torch.bool, device=gram.device)
        jack = [_rel_var(gram[keep[k]][:, keep[k]]) for k in range(K)]
        if all(j is not None for j in jack):
            j = torch.tensor(jack, dtype=torch.float64)
            rel_se = float(((K - 1) / K * ((j - j.mean()) ** 2).sum()).sqrt())
    ref = reference.double()
    ref_norm = ref.norm()
    norms = gram.diagonal().sqrt()
    dots = g @ ref  # (K,)
    cos = torch.where(norms > 0, dots / (norms * ref_norm).clamp(min=1e-300),
                      torch.zeros_like(dots)) if ref_norm > 0 else torch.zeros_like(dots)
    mean = g.mean(0)
    mean_cos = float(mean @ ref / (mean.norm() * ref_norm)) if mean.norm() > 0 and ref_norm > 0 \
        else None
    err = ((g - ref) ** 2).sum(1) / (ref_norm ** 2) if ref_norm > 0 else None  # (K,)
    return {"rel_var": rel, "rel_var_se": rel_se, "cos": float(cos.mean()),
            "cos_se": float(cos.std(correction=1) / math.sqrt(K)), "mean_cos": mean_cos,
            "error": None if err is None else float(err.mean()),
            "error_se": None if err is None else float(err.std(correction=1) / math.sqrt(K))}


def _seed(seed: int, k: int) -> int:
    """Seed of draw k (0: the reference draw, 1..K: the batches)."""
    return seed * 1_000_003 + 7919 * k + 1


def measure(sampler: Sampler, params: Sequence[Tensor], config, *, group_size: int,
            batches: int = 16, samples: int = 128, seed: int = 0,
            estimators: Sequence[str] = GROUP_ESTIMATORS) -> dict:
    """One measurement: V* and the reference gradient from one draw of `samples` (M)
    completions per prompt, then `batches` (K) draws of `group_size` (G), each scored by
    every estimator on the same completions. The surrogate aggregates by `config.agg`;
    `config` also gives scale, std_unbiased, gamma, lam and whiten_advantages (a
    TrainConfig). Returns the JSON-serialisable record (docs/diagnostics.md)."""
    if batches < 3 or samples < 2 or group_size < 2:
        raise ValueError(f"measure needs batches >= 3 (jackknife), samples >= 2 and "
                         f"group_size >= 2, got {batches}, {samples}, {group_size}")
    params = [p for p in params if p.requires_grad]
    agg = dict(agg=config.agg, max_len=config.max_new_tokens)
    ref = sampler(samples, _seed(seed, 0))
    v, v_se = v_star(ref.rewards, samples)  # (B,)
    key = ("rloo", "raw")
    ref_rows = {key: raw_advantages("rloo", ref.rewards.detach().float(), samples)}
    g_ref = surrogate_gradients(ref.logp(), ref.mask, ref_rows, params, **agg)[key]
    del ref
    grads, base, B = {}, {}, v.shape[0]
    per_prompt = None  # (K, B, P): each batch's per-prompt gradients, for the optimal baseline
    optimal = "none" in estimators and "grpo" in estimators
    for k in range(batches):
        d = sampler(group_size, _seed(seed, k + 1))
        rows = advantage_rows(d, group_size, config, estimators=estimators)
        if optimal:
            rows.update(prompt_rows(B, group_size))
        for row, g in surrogate_gradients(d.logp(), d.mask, rows, params, **agg).items():
            if row[0] == "prompt":
                if per_prompt is None:
                    per_prompt = g.new_empty(batches, B, g.numel())
                per_prompt[k, row[1]] = g
                continue
            if row not in grads:
                grads[row] = g.new_empty(batches, g.numel())  # (K, P)
            grads[row][k] = g
        for name, b in group_baselines(d.rewards, group_size, estimators,
                                       values=d.values).items():
            if name not in base:
                base[name] = torch.empty(batches, B, group_size, dtype=torch.float64)
            base[name][k] = b.view(B, group_size).cpu()  # (B, G)
    record = {"settings": {"prompts": B, "group_size": group_size, "batches": batches,
                           "samples": samples, "seed": seed, "agg": config.agg,
                           "estimators": list(estimators), "critic": "ppo_critic" in base,
                           "params": sum(p.numel() for p in params)},
              "v_star": v.tolist(), "v_star_se": v_se.tolist(),
              "reference_grad_norm": float(g_ref.norm())}
    errors = {name: baseline_error(b, v, v_se) for name, b in base.items()}
    record["baseline_mse"] = {n: {"mean": e["mse"], "se": e["mse_se"]} for n, e in errors.items()}
    record["baseline_bias"] = {n: {"mean": e["bias"], "se": e["bias_se"]}
                               for n, e in errors.items()}
    record["baseline_mse_per_prompt"] = {n: e["mse_per_prompt"] for n, e in errors.items()}
    noise = {row: gradient_noise(g, g_ref) for row, g in grads.items()}
    for field, stat in (("grad_rel_var", "rel_var"), ("grad_cos", "cos")):
        record[field] = {mode: {name: {"mean": noise[(name, m)][stat],
                                       "se": noise[(name, m)][stat + "_se"]}
                                for (name, m) in noise if m == mode} for mode in MODES}
    record["grad_mean_cos"] = {mode: {name: noise[(name, m)]["mean_cos"]
                                      for (name, m) in noise if m == mode} for mode in MODES}
    record["grad_error"] = {mode: {name: {"mean": noise[(name, m)]["error"],
                                          "se": noise[(name, m)]["error_se"]}
                                   for (name, m) in noise if m == mode} for mode in MODES}
    if optimal:
        record.update(_mechanism(grads[("none", "raw")], grads[("grpo", "raw")], per_prompt,
                                 g_ref, base["grpo"], v, v_se))
    return record


def _mechanism(g_none: Tensor, g_mean: Tensor, per_prompt: Tensor, g_ref: Tensor,
               mean_baselines: Tensor, v: Tensor, v_se: Tensor) -> dict:
    """Does a baseline make this task's gradient less noisy: the scale sweep (c x group mean,
    `BASELINE_SCALES`) and the cross-fitted per-prompt optimal baseline (`optimal_baseline`),
    each by gradient relative variance, cosine, plain error against the reference and (the
    sweep) baseline MSE against V*. Raw advantages (no std scaling)."""
    def figures(g: Tensor) -> dict:
        n = gradient_noise(g, g_ref)
        return {"rel_var": n["rel_var"], "cos": n["cos"], "error": n["error"],
                "error_se": n["error_se"]}
    sweep = {}
    for c in BASELINE_SCALES:
        e = baseline_error(c * mean_baselines, v, v_se)
        sweep[f"{c:g}"] = {**figures((1 - c) * g_none + c * g_mean), "mse": e["mse"]}
    fit = optimal_baseline(g_none, per_prompt, g_ref, v)
    K, G = mean_baselines.shape[0], mean_baselines.shape[2]
    e = baseline_error(fit["baseline"][None, :, None].expand(K, -1, G), v, v_se)
    return {"baseline_scale": sweep,
            "optimal_baseline": {**figures(fit["gradients"]), "mse": e["mse"],
                                 "slope": fit["slope"], "intercept": fit["intercept"],
                                 "baseline": fit["baseline"].tolist()}}


def informative_share(rewards: Tensor, group_sizes: Sequence[int]) -> dict[int, dict]:
    """The share of groups of G whose rewards are not all equal (groups that teach), as
    independence predicts it from M samples per prompt: rewards (B, M) -> {G: {"per_prompt",
    "at_mean"}}.

    per_prompt: the mean over prompts of 1 - P(G draws all equal), each prompt with its own
    reward distribution: P = sum over reward values v of p_v^G, estimated without bias by
    C(k_v, G) / C(M, G) (k_v of the M samples scored v). For 0/1 rewards this is
    1 - p^G - (1-p)^G averaged over the prompts' own p. at_mean: the same formula at the
    pooled distribution (for 0/1 rewards, at the mean p), which overstates the share when p
    varies across prompts (1 - p^G - (1-p)^G is concave in p). Needs G <= M."""
    r = rewards.detach().double().cpu()
    B, M = r.shape
    if any(g < 1 or g > M for g in group_sizes):
        raise ValueError(f"every G must be in [1, M={M}], got {list(group_sizes)}")
    values = torch.unique(r)
    counts = torch.stack([(r == v).sum(1) for v in values], 1)  # (B, V)
    pooled = counts.sum(0).double() / (B * M)  # (V,)
    out = {}
    for g in group_sizes:
        equal = sum(math.comb(int(k), g) for k in counts.flatten()) / (B * math.comb(M, g))
        out[int(g)] = {"per_prompt": 1.0 - equal,
                       "at_mean": float(1.0 - (pooled ** g).sum())}
    return out


def flat_metrics(record: dict) -> dict[str, float]:
    """The record's figures as flat floats for metrics.jsonl: `diag/baseline_mse/<e>`,
    `diag/baseline_bias/<e>`, `diag/grad_rel_var/<e>`, `diag/grad_cos/<e>` and
    `diag/grad_error/<e>` (as trained), the same three with `_raw` (raw), `diag/v_star_mean`;
    the scale sweep's `diag/scale/<figure>/<c>` and the optimal baseline's
    `diag/optimal/<figure>`. Undefined figures (None) are left out."""
    out = {"diag/v_star_mean": sum(record["v_star"]) / max(len(record["v_star"]), 1)}
    for field in ("baseline_mse", "baseline_bias"):
        for name, fig in record[field].items():
            out[f"diag/{field}/{name}"] = fig["mean"]
    for field in ("grad_rel_var", "grad_cos", "grad_error"):
        for mode, suffix in (("trained", ""), ("raw", "_raw")):
            for name, fig in record.get(field, {}).get(mode, {}).items():
                out[f"diag/{field}{suffix}/{name}"] = fig["mean"]
    for c, figs in record.get("baseline_scale", {}).items():
        for fig in MECHANISM_FIGURES:
            out[f"diag/scale/{fig}/{c}"] = figs[fig]
    for fig in (*MECHANISM_FIGURES, "slope", "intercept"):
        if "optimal_baseline" in record:
            out[f"diag/optimal/{fig}"] = record["optimal_baseline"][fig]
    return {k: float(v) for k, v in out.items() if v is not None}


MECHANISM_FIGURES = ("rel_var", "cos", "error", "mse")
"""The figures of each baseline of the scale sweep and of the optimal baseline."""


__all__ = ["GROUP_ESTIMATORS", "CRITIC_ROWS", "BASELINE_SCALES", "MECHANISM_FIGURES", "MODES",
           "Draw", "prompt_rows", "optimal_baseline", "Sampler", "group_baselines",
           "raw_advantages", "advantage_rows", "surrogate_gradients", "v_star",
           "baseline_error", "gradient_noise", "measure", "flat_metrics", "informative_share"]
