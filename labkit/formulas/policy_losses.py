"""Policy-loss modes: the field's variants of the policy objective, by registry.

Each mode is `fn(x: PolicyInputs, *, options...) -> (per_token (N, T), stats)`: the
per-token loss before aggregation (0 on padding) and its own statistics. `policy_loss_mode`
prepares the inputs (one dtype, advantages `(N, T)`, padding selected away), calls the mode
and aggregates by any mode of `labkit.formulas.losses.AGG_MODES`, so every loss mode crosses with
every aggregation. A mode's options are its keyword arguments with their defaults; the
config names them as `sapo(tau_pos=1.0, tau_neg=1.05)` (`LOSS_SPECS`).

Shapes: N rows, T completion tokens. `logp` carries the gradient; `old_logp` (the policy
that sampled) and the advantages are constants. rho_t = exp(logp_t - old_logp_t).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from labkit.formulas.losses import (aggregate, check_clip, clipped_surrogate, masked_fraction,
                                     surrogate_inputs)
from labkit.formulas.metrics import masked_mean
from labkit.grammar import Cursor
from labkit.registry import Registry

POLICY_LOSSES = Registry("policy loss", ("inputs",))
"""Policy-loss modes: `fn(x: PolicyInputs, **options) -> (per_token (N, T), stats)`."""


@dataclass(frozen=True)
class PolicyInputs:
    """A mode's inputs, prepared: one float dtype, `a` and the mask `(N, T)`."""

    logp: Tensor
    """(N, T) log-probs of the sampled tokens under the policy being trained (with graph)."""
    old_logp: Tensor
    """(N, T) the same under the policy that sampled."""
    a: Tensor
    """(N, T) advantages, 0 on padding."""
    m: Tensor
    """(N, T) bool, True on real completion tokens."""
    eps_low: float = 0.2
    """Clip range below 1 (a mode without a ratio clip reads it as its own lower bound)."""
    eps_high: float = 0.2
    """Clip range above 1."""
    dual_clip: float | None = None
    """vanilla: the dual clip's cap c, or None."""
    level: str = "token"
    """vanilla: token ratios, or GSPO's sequence ratio."""
    generator: torch.Generator | None = None
    """clip_cov's random choice of tokens; None uses torch's global generator."""

    def log_ratio(self) -> Tensor:
        """(N, T) logp - old_logp, 0 on padding (which may hold -inf)."""
        zero = torch.zeros((), dtype=self.logp.dtype, device=self.logp.device)
        return torch.where(self.m, self.logp - self.old_logp, zero)


def _ratio_stats(ratio: Tensor, m: Tensor) -> dict[str, float]:
    r = ratio.detach()
    return {"ratio/mean": masked_mean(r, m), "ratio/max": float(r[m].max()) if m.any() else 0.0}


@POLICY_LOSSES.register("vanilla")
def vanilla(x: PolicyInputs) -> tuple[Tensor, dict]:
    """PPO's clipped surrogate (Schulman et al., 2017): -min(rho A, clip(rho, 1-eps_low,
    1+eps_high) A), with the config's dual clip and ratio level; see
    `labkit.formulas.losses.policy_loss`."""
    return clipped_surrogate(x.logp, x.old_logp, x.a, x.m, eps_low=x.eps_low,
                             eps_high=x.eps_high, dual_clip=x.dual_clip, level=x.level)


@POLICY_LOSSES.register("dual_clip")
def dual_clip(x: PolicyInputs, *, c: float = 3.0) -> tuple[Tensor, dict]:
    """Dual-clip PPO (Ye et al., 2020; verl's vanilla with clip_ratio_c): the clipped
    surrogate, and where A < 0 the loss capped at -c A, so one huge ratio cannot dominate.
    c > 1 (verl's default 3)."""
    check_clip("token", x.eps_low, x.eps_high, c)
    return clipped_surrogate(x.logp, x.old_logp, x.a, x.m, eps_low=x.eps_low,
                             eps_high=x.eps_high, dual_clip=c, level="token")


@POLICY_LOSSES.register("gspo")
def gspo(x: PolicyInputs) -> tuple[Tensor, dict]:
    """GSPO, one length-normalised ratio per sequence (Zheng et al., 2025): s_i =
    exp(mean_t log rho_t), clipped per sequence; GSPO-token's gradient. Pair with
    agg=seq-mean-token-mean as the paper does."""
    return clipped_surrogate(x.logp, x.old_logp, x.a, x.m, eps_low=x.eps_low,
                             eps_high=x.eps_high, level="sequence")


@POLICY_LOSSES.register("cispo")
def cispo(x: PolicyInputs) -> tuple[Tensor, dict]:
    """CISPO, a clipped importance weight without a gradient (MiniMax-M1, 2025): -sg(clip(rho,
    1-eps_low, 1+eps_high)) A logp; every token keeps a gradient, only its weight is bounded.

    verl's bounds; TRL's cispo clips above only, at the absolute epsilon_high: the same with
    eps_low -> 1 and eps_high = TRL's epsilon_high - 1. stats "clip/weight": the fraction of
    tokens whose weight was clipped (either side, any advantage sign)."""
    ratio = torch.exp(x.log_ratio())
    weight = ratio.clamp(1.0 - x.eps_low, 1.0 + x.eps_high).detach()
    per_token = -weight * x.a * x.logp
    r = ratio.detach()
    return _zero_padding(per_token, x.m), {
        "clip/weight": masked_fraction((r < 1.0 - x.eps_low) | (r > 1.0 + x.eps_high), x.m),
        **_ratio_stats(r, x.m)}


@POLICY_LOSSES.register("sapo")
def sapo(x: PolicyInputs, *, tau_pos: float = 1.0, tau_neg: float = 1.05) -> tuple[Tensor, dict]:
    """SAPO, a soft sigmoid gate instead of the hard clip (Gao et al., 2025): -f(rho) A with
    f(r) = 4/tau sigmoid(tau (r - 1)), tau = tau_pos where A > 0, else tau_neg. f'(1) = 1, so
    on-policy its gradient is the plain policy gradient; far from 1 it fades instead of
    stopping. verl aggregates it by seq-mean-token-mean whatever is asked; TRL too for
    loss_type="sapo"."""
    for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
        if not tau > 0:
            raise ValueError(f"sapo: {name} must be > 0, got {tau!r}")
    ratio = torch.exp(x.log_ratio())
    tau = torch.where(x.a > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return _zero_padding(-gate * x.a, x.m), _ratio_stats(ratio, x.m)


@POLICY_LOSSES.register("gpg")
def gpg(x: PolicyInputs) -> tuple[Tensor, dict]:
    """GPG, plain REINFORCE (Chu et al., 2025; Williams, 1992): -A logp, no ratio and no clip:
    on-policy (one update per batch) it is the policy gradient itself."""
    return _zero_padding(-x.a * x.logp, x.m), {}


def _covariance(x: PolicyInputs) -> Tensor:
    """(N, T) (A - mean A)(logp - mean logp) per token, means over real tokens (detached)."""
    a, lp = x.a.detach(), x.logp.detach()
    return (a - a[x.m].mean()) * (lp - lp[x.m].mean())


@POLICY_LOSSES.register("clip_cov")
def clip_cov(x: PolicyInputs, *, ratio: float = 2e-4, lb: float = 1.0,
             ub: float = 5.0) -> tuple[Tensor, dict]:
    """Clip-Cov, drop a few high-covariance tokens from the gradient (Cui et al., 2025): of the
    tokens the PPO clip left alone whose cov = (A - mean A)(logp - mean logp) lies in (lb, ub),
    a random max(1, ratio * tokens) lose their gradient; the rest is PPO's clipped surrogate
    (no dual clip). Slows the collapse of entropy. stats "clip/cov": the fraction dropped."""
    if not ratio > 0:
        raise ValueError(f"clip_cov: ratio must be > 0, got {ratio!r}")
    per_token, stats = clipped_surrogate(x.logp, x.old_logp, x.a, x.m, eps_low=x.eps_low,
                                         eps_high=x.eps_high)
    rho = torch.exp(x.log_ratio()).detach()
    clipped_by_ppo = (-x.a * rho.clamp(1 - x.eps_low, 1 + x.eps_high) > -x.a * rho) & x.m
    cov = _covariance(x)
    candidates = torch.nonzero((cov > lb) & (cov < ub) & x.m & ~clipped_by_ppo)  # (k, 2)
    keep = torch.ones_like(per_token)
    count = max(int(ratio * int(x.m.sum())), 1)
    if len(candidates):
        order = torch.randperm(len(candidates), generator=x.generator)
        chosen = candidates[order[:min(count, len(candidates))].to(candidates.device)]
        keep[chosen[:, 0], chosen[:, 1]] = 0
    stats["clip/cov"] = masked_fraction(keep == 0, x.m)
    return per_token * keep, stats


@POLICY_LOSSES.register("kl_cov")
def kl_cov(x: PolicyInputs, *, ratio: float = 2e-4, coef: float = 0.1) -> tuple[Tensor, dict]:
    """KL-Cov, a KL penalty on the highest-covariance tokens (Cui et al., 2025): -rho A on every
    token (no clip), plus coef |logp - old_logp| on the max(1, ratio * tokens) tokens of
    largest cov = (A - mean A)(logp - mean logp). stats "clip/cov": the fraction penalised.
    coef defaults to verl's ppo_kl_coef."""
    if not ratio > 0:
        raise ValueError(f"kl_cov: ratio must be > 0, got {ratio!r}")
    log_ratio = x.log_ratio()
    rho = torch.exp(log_ratio)
    per_token = -x.a * rho
    cov = _covariance(x)[x.m]  # (n,) the real tokens, row-major
    count = max(1, int(cov.numel() * ratio)) if cov.numel() else 0
    top = torch.zeros_like(x.m)
    if count:
        where = torch.nonzero(x.m)[cov.topk(count).indices]  # (count, 2)
        top[where[:, 0], where[:, 1]] = True
    per_token = torch.where(top, per_token + coef * log_ratio.abs(), per_token)
    return _zero_padding(per_token, x.m), {"clip/cov": masked_fraction(top, x.m),
                                           **_ratio_stats(rho, x.m)}


@POLICY_LOSSES.register("geo_mean")
def geo_mean(x: PolicyInputs) -> tuple[Tensor, dict]:
    """GMPO, the geometric mean of the token ratios (Zhao et al., 2025): per sequence
    -A_i exp(mean_t clip'(log rho_t)), the log-ratio clipped to [-eps_low, eps_high] on the
    side its advantage's sign pushes (A_i the row's mean advantage). Each real token of row i
    carries that value: with agg=seq-mean-token-mean (GMPO's) the loss is the mean over rows.
    stats "clip/low", "clip/high": tokens whose log-ratio was clipped with A < 0 / A > 0."""
    log_ratio = x.log_ratio()
    sign = torch.sign(x.a)
    bounded = log_ratio.clamp(-x.eps_low, x.eps_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * bounded)
    length = x.m.sum(1).clamp(min=1)
    seq_ratio = torch.exp(torch.where(x.m, kept, torch.zeros_like(kept)).sum(1) / length)
    seq_a = x.a.sum(1) / length  # a is 0 on padding
    per_token = torch.where(x.m, (-seq_a * seq_ratio)[:, None].expand_as(x.a),
                            torch.zeros_like(x.a))
    clipped = log_ratio != bounded
    return per_token, {"clip/low": masked_fraction(clipped & (x.a < 0), x.m),
                       "clip/high": masked_fraction(clipped & (x.a > 0), x.m),
                       **_ratio_stats(seq_ratio[:, None].expand_as(x.a), x.m)}


def _dppo(x: PolicyInputs, valid: Tensor, clip_c: float) -> tuple[Tensor, dict]:
    """DPPO's loss given its trust region: -A sg(min(rho, clip_c)) logp where `valid`."""
    if not clip_c > 0:
        raise ValueError(f"dppo: clip_c must be > 0, got {clip_c!r}")
    rho = torch.exp(x.log_ratio())
    weight = rho.clamp(max=clip_c).detach()
    per_token = torch.where(valid.detach(), -x.a * weight * x.logp, torch.zeros_like(rho))
    return _zero_padding(per_token, x.m), {
        "clip/trust": masked_fraction(~valid, x.m),
        "clip/truncated": masked_fraction((rho.detach() > clip_c) & valid, x.m),
        **_ratio_stats(rho, x.m)}


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv(x: PolicyInputs, *, clip_c: float = 20.0) -> tuple[Tensor, dict]:
    """DPPO-TV, a trust region on the sampled token's probability (arXiv 2602.04879): a token
    learns only while p - p_old <= eps_high (A > 0) or >= -eps_low (A <= 0), eps here a
    probability difference; its weight is sg(min(rho, clip_c)) on -A logp. stats
    "clip/trust" (outside the region), "clip/truncated" (rho > clip_c)."""
    p, p_old = x.logp.exp(), x.old_logp.exp()
    valid = torch.where(x.a > 0, p - p_old <= x.eps_high, p - p_old >= -x.eps_low) & x.m
    return _dppo(x, valid, clip_c)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl(x: PolicyInputs, *, clip_c: float = 20.0) -> tuple[Tensor, dict]:
    """DPPO-KL, a trust region on the binary KL of the sampled token (arXiv 2602.04879): KL of
    Bernoulli(p_old) to Bernoulli(p) <= eps_high for tokens A > 0 pushes up (eps_low for
    A <= 0 pushes down); moves the other way always learn. Weight as dppo_tv."""
    lp, old = x.logp, x.old_logp
    p, p_old = lp.exp(), old.exp()
    binary_kl = p_old * (old - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) /
                                                             (1.0 - p + 1e-8))
    valid = torch.where(x.a > 0, (binary_kl <= x.eps_high) | (p <= p_old),
                        (binary_kl <= x.eps_low) | (p >= p_old)) & x.m
    return _dppo(x, valid, clip_c)


@POLICY_LOSSES.register("dro")
def dro(x: PolicyInputs, *, beta: float = 0.1) -> tuple[Tensor, dict]:
    """DRO, direct reward optimisation with a quadratic trust penalty (Richemond et al., 2024;
    verl dro): -(A logp - beta/2 (logp - old_logp)^2); beta > 0 (verl has no default)."""
    if not beta > 0:
        raise ValueError(f"dro: beta must be > 0, got {beta!r}")
    log_ratio = x.log_ratio()
    per_token = -(x.a * x.logp - 0.5 * beta * log_ratio.square())
    return _zero_padding(per_token, x.m), _ratio_stats(torch.exp(log_ratio), x.m)


@POLICY_LOSSES.register("vespo")
def vespo(x: PolicyInputs, *, k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0,
          lambda_neg: float = 2.0) -> tuple[Tensor, dict]:
    """VESPO, a smooth gamma-shaped weight on the sequence's importance weight instead of a
    hard clip (VESPO, 2026; TRL loss_type="vespo"): -sg(phi(w)) A logp with w = prod_t rho_t
    (the product, not GSPO's geometric mean) and phi(w) = e^lambda w^k e^(-lambda w), so
    phi(1) = 1 and a sequence far from the sampler on either side fades out; k, lambda are
    k_pos, lambda_pos where A >= 0, else k_neg, lambda_neg. As TRL: each log rho_t clamped to
    [-20, 20] and log w to [log 1e-8, 20]. TRL's defaults; k >= 0, lambda > 0."""
    for name, value, low in (("k_pos", k_pos, 0.0), ("k_neg", k_neg, 0.0),
                             ("lambda_pos", lambda_pos, None), ("lambda_neg", lambda_neg, None)):
        if not (value >= low if low is not None else value > 0):
            raise ValueError(f"vespo: {name} must be {'>= 0' if low is not None else '> 0'}, "
                             f"got {value!r}")
    log_ratio = x.log_ratio().detach()
    log_w = log_ratio.clamp(-20.0, 20.0).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)
    nonneg = x.a >= 0
    k = torch.where(nonneg, torch.full_like(x.a, k_pos), torch.full_like(x.a, k_neg))
    lam = torch.where(nonneg, torch.full_like(x.a, lambda_pos), torch.full_like(x.a, lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0)
    per_token = -phi * x.a * x.logp
    return _zero_padding(per_token, x.m), _ratio_stats(torch.exp(log_ratio), x.m)


def _zero_padding(per_token: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, per_token, torch.zeros((), dtype=per_token.dtype,
                                                 device=per_token.device))


# --- a mode with its options, as the config names it: "sapo(tau_pos=1.0, tau_neg=1.05)" ---

FORM = "NAME or NAME(OPTION=NUMBER, ...)"
"""The form of the config's `loss`, for its errors."""


def options_of(fn) -> dict[str, float]:
    """A mode's options: its keyword-only arguments and their defaults."""
    return {p.name: p.default for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def parse_loss(spec: str, field: str = "loss") -> tuple[object, dict[str, float]]:
    """`name` or `name(k=v, ...)` (labkit.grammar's tokens) -> (the mode's function, its
    options with the defaults filled in). ValueError names `field`, the mode and the option."""
    if not isinstance(spec, str):
        raise ValueError(f"{field} must be a loss mode name or name(option=value, ...), "
                         f"got {spec!r}")
    at = Cursor(spec, field, FORM)
    name = at.path("a loss mode")
    fn = POLICY_LOSSES.resolve(name.text, field)
    known, given = options_of(fn), {}
    if at.take("("):
        while not at.peek().is_op(")"):
            if given:
                at.expect(",", "',' or ')'")
            key = at.expect("name", "an option")
            if key.text not in known or key.text in given:
                raise at.error(f"{name.text} takes {sorted(known)} as option=value, each "
                               f"once, got {key.text!r}", key)
            at.expect("=", f"'=' after {key.text}")
            given[key.text] = at.number(f"option {key.text}")
        at.next()
    at.expect("end", "the end")
    return fn, {**known, **given}


class LossSpecs:
    """What the config's `loss` may name, in the place of a registry (`fields.choice`)."""

    def resolve(self, spec, field: str | None = None):
        fn, options = parse_loss(spec, field or "loss")
        return fn

    def __iter__(self):
        """The registered modes' names."""
        return iter(POLICY_LOSSES)

    def describe(self, sep: str = "; ") -> str:
        def with_options(name: str) -> str:
            opts = options_of(POLICY_LOSSES[name])
            return f"{name}({', '.join(f'{k}={v:g}' for k, v in opts.items())})" if opts \
                else name
        titles = POLICY_LOSSES.titles()
        return sep.join([f"{with_options(n)}: {t}" for n, t in titles.items()] +
                        ["or package.module:function"])


LOSS_SPECS = LossSpecs()


def high_entropy_mask(entropy: Tensor, mask: Tensor, keep: float) -> Tensor:
    """(N, T) bool: the real tokens whose entropy is at least the (1 - keep) quantile of the
    real tokens' entropies (the top `keep` fraction; ties kept), as TRL's
    get_high_entropy_mask with threshold 1 - top_entropy_quantile. keep = 1 keeps all."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep!r}")
    m = mask.bool()
    if keep >= 1.0 or not m.any():
        return m
    threshold = torch.quantile(entropy.detach()[m].float(), 1.0 - keep)
    return (entropy.detach() >= threshold) & m


def policy_loss_mode(spec: str, logp: Tensor, old_logp: Tensor, advantages: Tensor,
                     mask: Tensor, *, eps_low: float = 0.2, eps_high: float = 0.2,
                     dual_clip: float | None = None, level: str = "token",
                     agg: str = "token-mean", max_len: int | None = None,
                     generator: torch.Generator | None = None,
                     token_weight: Tensor | None = None) -> tuple[Tensor, dict]:
    """The policy loss of mode `spec` (a name of `POLICY_LOSSES` with options, e.g.
    "sapo(tau_pos=2)") -> (scalar loss, stats): inputs prepared as `policy_loss` prepares
    them, the mode's per-token loss, aggregated by `agg`. logp, old_logp, mask `(N, T)`,
    advantages `(N,)` or `(N, T)`. token_weight `(N, T)` (bool or float, no gradient)
    multiplies the per-token loss: a mask (`high_entropy_mask`) or importance weights
    (`labkit.formulas.mismatch`); the aggregation still counts every real token (TRL's, verl's
    convention)."""
    fn, options = parse_loss(spec)
    check_clip(level, eps_low, eps_high, dual_clip)
    lp, old, a, m = surrogate_inputs(logp, old_logp, advantages, mask)
    x = PolicyInputs(lp, old, a, m, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
                     level=level, generator=generator)
    per_token, stats = fn(x, **options)
    if token_weight is not None:
        w = token_weight.detach().to(device=per_token.device, dtype=per_token.dtype)
        per_token = torch.where(m, per_token * w, torch.zeros_like(per_token))
    return aggregate(per_token, m, agg, max_len=max_len), stats


__all__ = ["POLICY_LOSSES", "PolicyInputs", "LOSS_SPECS", "LossSpecs", "parse_loss",
           "options_of", "policy_loss_mode", "high_entropy_mask", "vanilla", "dual_clip",
           "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dppo_tv",
           "dppo_kl", "dro", "vespo"]
