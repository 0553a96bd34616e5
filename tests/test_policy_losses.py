"""labkit.formulas.policy_losses: every policy-loss mode against its formula written as plain loops
(float64, 1e-10), the stop-gradients against their analytic gradients, the option syntax,
and one training step with each mode."""

from __future__ import annotations

import math

import pytest
import torch

from labkit.formulas import policy_losses as LM
from labkit.formulas.losses import AGG_MODES

F64 = dict(rtol=1e-10, atol=1e-10)


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    n, t_len = 8, 5
    lengths = torch.randint(1, t_len + 1, (n,), generator=gen)
    mask = (torch.arange(t_len)[None] < lengths[:, None])
    logp = -torch.rand(n, t_len, generator=gen, dtype=torch.float64) * 2 - 0.05
    shift = torch.rand(n, t_len, generator=gen, dtype=torch.float64) * 1.6 - 0.8
    old = (logp - shift).clamp(max=-0.01)  # a log-probability: <= 0
    adv = torch.randn(n, t_len, generator=gen, dtype=torch.float64)
    return logp, old, adv, mask


def _rows(mask):
    return [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]


def ref_per_token(name, lp, old, a, mask, eps_low=0.2, eps_high=0.28, **opt):
    """Each mode's per-token loss by loops over floats (the value, not the gradient)."""
    lp, old, a = lp.tolist(), old.tolist(), a.tolist()
    out = [[0.0] * len(lp[0]) for _ in lp]
    for i, ts in enumerate(_rows(mask)):
        if name == "geo_mean":
            kept = []
            for t in ts:
                lr = lp[i][t] - old[i][t]
                s = (a[i][t] > 0) - (a[i][t] < 0)
                bounded = min(max(lr, -eps_low), eps_high)
                kept.append(s * min(s * lr, s * bounded))
            value = -(sum(a[i][t] for t in ts) / len(ts)) * math.exp(sum(kept) / len(kept))
            for t in ts:
                out[i][t] = value
            continue
        if name == "vespo":  # one weight per sequence from the product of its ratios
            log_w = sum(min(max(lp[i][t] - old[i][t], -20.0), 20.0) for t in ts)
            log_w = min(max(log_w, math.log(1e-8)), 20.0)
            for t in ts:
                k, lam = (opt["k_pos"], opt["lambda_pos"]) if a[i][t] >= 0 else \
                    (opt["k_neg"], opt["lambda_neg"])
                phi = math.exp(lam) * math.exp(log_w) ** k * math.exp(-lam * math.exp(log_w))
                out[i][t] = -phi * a[i][t] * lp[i][t]
            continue
        for t in ts:
            r = math.exp(lp[i][t] - old[i][t])
            A, logp = a[i][t], lp[i][t]
            if name == "dual_clip":
                v = max(-r * A, -min(max(r, 1 - eps_low), 1 + eps_high) * A)
                out[i][t] = min(v, -opt["c"] * A) if A < 0 else v
            elif name == "cispo":
                out[i][t] = -min(max(r, 1 - eps_low), 1 + eps_high) * A * logp
            elif name == "sapo":
                tau = opt["tau_pos"] if A > 0 else opt["tau_neg"]
                out[i][t] = -4 / tau / (1 + math.exp(-tau * (r - 1))) * A
            elif name == "gpg":
                out[i][t] = -A * logp
            elif name == "dro":
                out[i][t] = -(A * logp - 0.5 * opt["beta"] * (logp - old[i][t]) ** 2)
            elif name in ("dppo_tv", "dppo_kl"):
                p, q = math.exp(logp), math.exp(old[i][t])
                if name == "dppo_tv":
                    ok = p - q <= eps_high if A > 0 else p - q >= -eps_low
                else:
                    kl = q * (old[i][t] - logp) + (1 - q) * math.log((1 - q + 1e-8) /
                                                                     (1 - p + 1e-8))
                    ok = (kl <= eps_high or p <= q) if A > 0 else (kl <= eps_low or p >= q)
                out[i][t] = -A * min(r, opt["clip_c"]) * logp if ok else 0.0
            else:
                raise AssertionError(name)
    return out


def ref_aggregate(per_token, mask, agg):
    rows = _rows(mask)
    n = len(rows)
    total = sum(len(ts) for ts in rows)
    if agg == "token-mean":
        return sum(per_token[i][t] for i, ts in enumerate(rows) for t in ts) / total
    if agg == "token-sum":
        return sum(per_token[i][t] for i, ts in enumerate(rows) for t in ts)
    if agg == "seq-mean-token-mean":
        return sum(sum(per_token[i][t] for t in ts) / len(ts) for i, ts in enumerate(rows)) / n
    if agg == "seq-mean-token-sum":
        return sum(per_token[i][t] for i, ts in enumerate(rows) for t in ts) / n
    return sum(per_token[i][t] for i, ts in enumerate(rows) for t in ts) / (n * mask.shape[1])


SPECS = {"dual_clip": {"c": 1.5}, "cispo": {}, "sapo": {"tau_pos": 0.7, "tau_neg": 1.3},
         "gpg": {}, "dro": {"beta": 0.4}, "dppo_tv": {"clip_c": 1.5},
         "dppo_kl": {"clip_c": 1.5}, "geo_mean": {},
         "vespo": {"k_pos": 1.5, "lambda_pos": 2.5, "k_neg": 2.0, "lambda_neg": 1.5}}


def _spec(name, opts):
    return f"{name}({', '.join(f'{k}={v}' for k, v in opts.items())})" if opts else name


@pytest.mark.parametrize("agg", list(AGG_MODES))
@pytest.mark.parametrize("name", list(SPECS))
def test_modes_match_loops(name, agg):
    """Loss of each mode (with non-default options) and each aggregation, against loops."""
    lp, old, a, mask = _inputs(1)
    loss, _ = LM.policy_loss_mode(_spec(name, SPECS[name]), lp, old, a, mask, eps_low=0.2,
                                  eps_high=0.28, agg=agg)
    want = ref_aggregate(ref_per_token(name, lp, old, a, mask, **SPECS[name]), mask, agg)
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64), **F64)


@pytest.mark.parametrize("name, grad", [
    ("cispo", lambda lp, old, a: -(lp - old).exp().clamp(0.8, 1.28) * a),
    ("gpg", lambda lp, old, a: -a),
    ("dro", lambda lp, old, a: -a + 0.4 * (lp - old)),
])
def test_stop_gradient_modes_have_their_analytic_gradient(name, grad):
    """cispo's weight, gpg and dro carry no gradient through the ratio: d loss / d logp_t is
    -w_t A_t (times the token-sum aggregation's weight 1)."""
    lp, old, a, mask = _inputs(2)
    lp = lp.clone().requires_grad_()
    spec = "dro(beta=0.4)" if name == "dro" else name
    loss, _ = LM.policy_loss_mode(spec, lp, old, a, mask, eps_low=0.2, eps_high=0.28,
                                  agg="token-sum")
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.where(mask, grad(lp.detach(), old, a),
                                                    torch.zeros(())), **F64)


def test_vanilla_is_the_clipped_surrogate_and_gspo_its_sequence_form():
    from labkit.formulas.losses import policy_loss

    lp, old, a, mask = _inputs(3)
    for spec, kwargs in (("vanilla", {}), ("gspo", {"level": "sequence"}),
                         ("dual_clip(c=2)", {"dual_clip": 2.0})):
        got, stats = LM.policy_loss_mode(spec, lp, old, a, mask, agg="seq-mean-token-mean")
        want, want_stats = policy_loss(lp, old, a, mask, agg="seq-mean-token-mean", **kwargs)
        assert torch.equal(got, want) and stats == want_stats, spec


def test_clip_cov_drops_the_budget_of_tokens_and_kl_cov_penalises_the_top_covariances():
    lp, old, a, mask = _inputs(4)
    n = int(mask.sum())
    _, stats = LM.policy_loss_mode("clip_cov(ratio=0.1, lb=-100, ub=100)", lp, old, a, mask,
                                   generator=torch.Generator().manual_seed(0))
    clipped = stats["clip/low"] + stats["clip/high"]
    assert stats["clip/cov"] == pytest.approx(min(int(0.1 * n), n - round(clipped * n)) / n)
    _, stats = LM.policy_loss_mode("kl_cov(ratio=0.1)", lp, old, a, mask)
    assert stats["clip/cov"] == pytest.approx(int(0.1 * n) / n)
    base, _ = LM.policy_loss_mode("kl_cov(ratio=0.1, coef=0)", lp, old, a, mask, agg="token-sum")
    cov = ((a - a[mask].mean()) * (lp - lp[mask].mean()))[mask]
    top = cov.topk(int(0.1 * n)).indices
    penalty = (lp - old)[mask].abs()[top].sum()
    more, _ = LM.policy_loss_mode("kl_cov(ratio=0.1, coef=0.5)", lp, old, a, mask,
                                  agg="token-sum")
    torch.testing.assert_close(more - base, 0.5 * penalty, **F64)
    on_policy, _ = LM.policy_loss_mode("kl_cov(ratio=0.1)", lp, lp, a, mask, agg="token-sum")
    torch.testing.assert_close(on_policy, -a[mask].sum(), **F64)  # rho = 1, no penalty


def test_the_registry_lists_every_mode_with_its_paper_and_options():
    assert list(LM.POLICY_LOSSES) == ["vanilla", "dual_clip", "gspo", "cispo", "sapo", "gpg",
                                      "clip_cov", "kl_cov", "geo_mean", "dppo_tv", "dppo_kl",
                                      "dro", "vespo"]
    text = LM.LOSS_SPECS.describe("\n")
    assert "sapo(tau_pos=1, tau_neg=1.05): SAPO" in text and "dro(beta=0.1)" in text
    assert all("(" in line and any(ch.isdigit() for ch in line) for line in text.splitlines()
               if not line.startswith("or "))


@pytest.mark.parametrize("spec, words", [
    ("sapo(tau=2)", ["loss='sapo(tau=2)'", "['tau_neg', 'tau_pos']"]),
    ("sapo(tau_pos=x)", ["option tau_pos must be a number"]),
    ("sapo(tau_pos=0)", ["tau_pos must be > 0"]),
    ("dro(beta=-1)", ["beta must be > 0"]),
    ("vespo(lambda_neg=0)", ["vespo: lambda_neg must be > 0"]),
    ("vespo(k_pos=-1)", ["vespo: k_pos must be >= 0"]),
    ("nope", ["loss must be one of ['vanilla'"]),
    ("sapo(", ["loss='sapo('", "NAME(OPTION=NUMBER, ...)", "column 6"]),
])
def test_bad_specs_name_the_option_and_the_rule(spec, words):
    lp, old, a, mask = _inputs()
    with pytest.raises(ValueError) as e:
        LM.policy_loss_mode(spec, lp, old, a, mask)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_config_checks_the_loss_and_its_combinations():
    from labkit.settings.config import TrainConfig

    assert TrainConfig(loss="sapo(tau_pos=2)").loss == "sapo(tau_pos=2)"
    for bad, words in ((dict(loss="sapo(tau=2)"), "sapo takes"),
                       (dict(loss="cispo", dual_clip=2.0), "apply to loss='vanilla'"),
                       (dict(loss="gspo", ratio_level="sequence"), "apply to loss='vanilla'"),
                       (dict(loss="gpg", reinforce=True), "apply to loss='vanilla'")):
        with pytest.raises(ValueError, match=words):
            TrainConfig(**bad)


@pytest.mark.parametrize("loss", ["dual_clip", "gspo", "cispo", "sapo", "gpg", "clip_cov",
                                  "kl_cov", "geo_mean", "dppo_tv", "dppo_kl", "dro(beta=0.5)",
                                  "vespo"])
def test_every_loss_mode_trains_a_step(loss):
    """Two passes over one batch (so the ratio leaves 1) with each mode, on a step whose groups
    have mixed rewards: finite losses, a gradient, and the policy moved."""
    from labkit.settings.config import TrainConfig
    from labkit.trainer import Trainer

    config = TrainConfig(loss=loss, steps=2, batch_prompts=8, group_size=4, max_new_tokens=16,
                         eval_n=4, eval_samples=0, cgc_prompts=0, progress=False,
                         num_iterations=2, lr=5e-3, warmup_steps=0)
    trainer = Trainer(config)
    before = [p.detach().clone() for p in trainer.learner.policy.parameters()]
    result = trainer.step(1)
    assert math.isfinite(result.metrics["loss/total"])
    assert 0 < result.rewards.mean() < 1 and result.metrics["perf/grad_norm"] > 0
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.learner.policy.parameters()))


def test_docs_variants_lists_every_registered_estimator_and_loss_mode():
    from pathlib import Path

    from labkit.formulas.estimators import ESTIMATORS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "variants.md").read_text()
    ours = [n for n, fn in ESTIMATORS.items() if fn.__module__ == "labkit.formulas.estimators"]
    assert len(ours) >= 13 and all(f"| `{name}` |" in doc for name in ours), ours
    assert all(f"| `{name}" in doc for name in LM.POLICY_LOSSES), list(LM.POLICY_LOSSES)


def test_high_entropy_mask_keeps_the_top_fraction_of_real_tokens():
    ent = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.8, 0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # 7.0 is padding: never kept
    kept = LM.high_entropy_mask(ent, mask, 0.5)
    real = sorted(ent[mask.bool()].tolist())  # 7 values; the (1 - 0.5) quantile is the median
    assert kept.sum() == sum(1 for v in real if v >= real[3]) and not kept[0, 3]
    assert torch.equal(LM.high_entropy_mask(ent, mask, 1.0), mask.bool())
    with pytest.raises(ValueError, match="keep must be in"):
        LM.high_entropy_mask(ent, mask, 0.0)


def test_overlong_penalty_is_dapos_linear_ramp():
    from labkit.problems.rewards import overlong_penalty

    got = overlong_penalty([3, 12, 13, 14, 16], max_len=16, buffer=4, factor=0.5)
    assert got == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5])
    assert overlong_penalty([16], max_len=16, buffer=0) == [0.0]
    with pytest.raises(ValueError, match="buffer must be an int in"):
        overlong_penalty([1], max_len=4, buffer=5)


def test_kept_rows_drop_truncated_completions_when_asked():
    from labkit.settings.config import TrainConfig
    from labkit.stages import kept_rows

    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    cut = torch.tensor([False, True, False, False, False, False, True, False])
    assert kept_rows(TrainConfig(group_size=4), r, cut).tolist() == list(range(8))
    assert kept_rows(TrainConfig(group_size=4, mask_truncated=True), r, cut).tolist() == \
        [0, 2, 3, 4, 5, 7]
    both = TrainConfig(group_size=4, mask_truncated=True, dynamic_sampling=True)
    r[:4] = 1.0  # the first group is all equal: dynamic sampling drops it too
    assert kept_rows(both, r, cut).tolist() == [4, 5, 7]


@pytest.mark.parametrize("fields", [dict(top_entropy=0.2), dict(mask_truncated=True),
                                    dict(overlong_buffer=4, overlong_penalty=0.5)], ids=str)
def test_rollout_tail_options_train_a_step(fields):
    from labkit.settings.config import TrainConfig
    from labkit.trainer import Trainer

    config = TrainConfig(steps=2, batch_prompts=8, group_size=4, max_new_tokens=16, eval_n=4,
                         eval_samples=0, cgc_prompts=0, progress=False, warmup_steps=0,
                         **fields)
    result = Trainer(config).step(1)
    assert math.isfinite(result.metrics.get("loss/total", 0.0))
    if "overlong_buffer" in fields:
        lengths = result.batch.completion_mask.sum(1)
        zone = (lengths - 12).clamp(min=0) / 4 * 0.5
        assert result.metrics["rollout/overlong_penalty"] == pytest.approx(-zone.mean().item())
    if fields.get("mask_truncated"):
        kept = 1 - result.batch.truncated.float().mean().item()
        assert result.metrics["rollout/kept_frac"] == pytest.approx(kept)


def test_token_weight_multiplies_each_tokens_loss_and_its_gradient():
    lp, old, a, mask = _inputs(5)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for spec in ("vanilla", "cispo", "geo_mean"):
        one = lp.clone().requires_grad_()
        base, _ = LM.policy_loss_mode(spec, one, old, a, mask, agg="token-sum")
        per_token_base = torch.autograd.grad(base, one)[0]
        two = lp.clone().requires_grad_()
        weighted, _ = LM.policy_loss_mode(spec, two, old, a, mask, agg="token-sum",
                                          token_weight=w)
        if spec != "geo_mean":  # per-token modes: the weight scales each token's gradient
            torch.testing.assert_close(torch.autograd.grad(weighted, two)[0],
                                       per_token_base * w * mask, **F64)
        else:  # a sequence-level value: the loss is the weighted sum of its tokens' copies
            from labkit.formulas.losses import surrogate_inputs

            per_token, _ = LM.geo_mean(LM.PolicyInputs(*surrogate_inputs(lp, old, a, mask)))
            torch.testing.assert_close(weighted, (per_token * w * mask).sum(), **F64)
