"""labkit.probes.estimator_quality against exact expectations: a tabular policy small enough to enumerate,
binomial rewards with a known MSE, and the embedded model end to end."""

import itertools
import json
import math

import pytest
import torch

from labkit.probes import estimator_quality
from labkit.probes.estimator_quality import (BASELINE_SCALES, Draw, advantage_rows, baseline_error,
                                             flat_metrics, gradient_noise, group_baselines, measure,
                                             optimal_baseline, surrogate_gradients, v_star)
from labkit.settings.config import TrainConfig

# ----------------------------------------------------------------- a tabular softmax policy
# B prompts, C possible completions per prompt; pi_b = softmax(theta_b); reward r[b, c] in
# {0, 1}. The per-prompt "critic" is a fixed V(prompt), deliberately not the true value.
LOGITS = torch.tensor([[0.3, -0.2, 0.1], [0.0, 0.8, -0.5], [-0.4, 0.2, 0.6]],
                      dtype=torch.float64)
REWARDS = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
CRITIC = torch.tensor([0.3, 0.9, 0.6], dtype=torch.float64)
G = 4
CONFIG = TrainConfig()  # scale="group", std_unbiased=True, agg="token-mean", lam=0.95


class Tabular:
    def __init__(self, critic: bool = False):
        self.theta = torch.nn.Parameter(LOGITS.clone())
        self.critic = critic

    def sample(self, group_size: int, seed: int) -> Draw:
        B = LOGITS.shape[0]
        gen = torch.Generator().manual_seed(seed)
        probs = torch.softmax(self.theta.detach(), -1)
        choice = torch.multinomial(probs, group_size, replacement=True, generator=gen)  # (B, G)
        rows = torch.arange(B).repeat_interleave(group_size)  # (N,)
        flat = choice.reshape(-1)
        values = CRITIC[rows][:, None].float() if self.critic else None  # (N, 1)

        def logp():
            return torch.log_softmax(self.theta, -1)[rows, flat]  # (N,)
        return Draw(REWARDS[rows, flat].float(), logp, None, values)


def exact_gradient() -> torch.Tensor:
    """Gradient of the surrogate's loss in expectation for any unbiased baseline: -grad J,
    J = (1/B) sum_b sum_c pi_bc r_bc, so dJ/dtheta_bc = pi_bc (r_bc - sum_c' pi_bc' r_bc') / B."""
    pi = torch.softmax(LOGITS, -1)
    value = (pi * REWARDS).sum(-1, keepdim=True)
    return (-(pi * (REWARDS - value)) / LOGITS.shape[0]).reshape(-1)


def std_scaled_expectation(group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """E[g] of GRPO's std-scaled advantages, by summing over every G-tuple y of completions:

    E[g] = -(1/B) sum_b sum_{y in C^G} prod_j pi_b(y_j) (1/G) sum_i A_i(y) (e_{y_i} - pi_b),
    A_i(y) = (r_b(y_i) - mean_j r_b(y_j)) / (std_j r_b(y_j) + eps), std dividing by G-1,
    A = 0 when the G rewards are equal; e_c - pi_b is grad_theta_b log pi_b(c)."""
    pi = torch.softmax(LOGITS, -1)
    B, C = LOGITS.shape
    out = torch.zeros(B, C, dtype=torch.float64)
    for b in range(B):
        for y in itertools.product(range(C), repeat=group_size):
            p = math.prod(float(pi[b, c]) for c in y)
            r = [float(REWARDS[b, c]) for c in y]
            mean = sum(r) / group_size
            if max(r) == min(r):
                continue
            std = math.sqrt(sum((x - mean) ** 2 for x in r) / (group_size - 1))
            for i, c in enumerate(y):
                a = (r[i] - mean) / (std + eps)
                onehot = torch.zeros(C, dtype=torch.float64)
                onehot[c] = 1.0
                out[b] -= p * a * (onehot - pi[b]) / (group_size * B)
    return out.reshape(-1)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one thread spends no time handing work between threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tabular_gradients(one_thread):
    """K per-batch gradients (K, P) of every row on the tabular policy with a critic."""
    policy = Tabular(critic=True)
    K, grads = 1000, {}
    for k in range(K):
        draw = policy.sample(G, seed=k)
        rows = advantage_rows(draw, G, CONFIG)
        for key, g in surrogate_gradients(draw.logp(), draw.mask, rows, [policy.theta],
                                          agg=CONFIG.agg).items():
            grads.setdefault(key, []).append(g.double())
    return {key: torch.stack(g) for key, g in grads.items()}


def z_scores(samples: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """(mean - expected) / standard error, per coordinate."""
    se = samples.std(0, correction=1) / math.sqrt(samples.shape[0])
    return (samples.mean(0) - expected) / se.clamp(min=1e-12)


def test_unbiased_baselines_match_the_exact_gradient(tabular_gradients):
    exact = exact_gradient()
    for key in [("none", "raw"), ("rloo", "raw"), ("ppo_critic", "raw"), ("ppo_gae", "raw")]:
        z = z_scores(tabular_gradients[key], exact)
        assert z.abs().max() < 4.5, (key, z)


def test_group_mean_including_the_sample_gives_g_minus_1_over_g(tabular_gradients):
    exact = exact_gradient()
    for name in ("grpo", "dr_grpo"):
        samples = tabular_gradients[(name, "raw")]
        assert z_scores(samples, exact * (G - 1) / G).abs().max() < 4.5
        # and the test can tell it from the exact gradient
        assert z_scores(samples, exact).abs().max() > 6


def test_std_scaling_matches_its_enumerated_expectation(tabular_gradients):
    expected = std_scaled_expectation(G)
    samples = tabular_gradients[("grpo", "trained")]
    assert z_scores(samples, expected).abs().max() < 4.5
    assert z_scores(samples, exact_gradient()).abs().max() > 6


def test_no_baseline_is_the_noisiest(one_thread):
    policy = Tabular(critic=True)
    record = measure(policy.sample, [policy.theta], CONFIG, group_size=G, batches=200,
                     samples=256, seed=1)
    raw = record["grad_rel_var"]["raw"]
    none = raw["none"]
    for name, fig in raw.items():
        if name != "none":
            assert none["mean"] - fig["mean"] > 3 * math.hypot(none["se"], fig["se"]), name
    # every unbiased row points where the reference gradient does
    assert record["grad_mean_cos"]["raw"]["rloo"] > 0.95


def test_surrogate_gradients_against_one_backward_per_row():
    from labkit.formulas.losses import aggregate

    gen = torch.Generator().manual_seed(0)
    theta = torch.nn.Parameter(torch.randn(5, 7, generator=gen, dtype=torch.float64))
    tokens = torch.randint(0, 7, (6, 5), generator=gen)  # (N, T): row n, position t
    mask = torch.ones(6, 5, dtype=torch.long)
    mask[0, 3:] = 0
    mask[4, 1:] = 0
    logp = torch.log_softmax(theta, -1)[torch.arange(5), tokens]  # (N, T)
    a = torch.randn(6, generator=gen)
    rows = {("a", "raw"): a, ("b", "raw"): torch.randn(6, 5, generator=gen),
            ("a", "trained"): a.clone()}  # equal to ("a", "raw"): shares its gradient
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        got = surrogate_gradients(logp, mask, rows, [theta], agg=agg, max_len=8)
        for key, a in rows.items():
            a_t = a if a.dim() == 2 else a[:, None].expand(6, 5)
            loss = aggregate(-a_t.double() * logp, mask, agg, max_len=8)
            want, = torch.autograd.grad(loss, theta, retain_graph=True)
            torch.testing.assert_close(got[key], want.reshape(-1).float())


# ------------------------------------------------------------------------- binomial MSE
def binomial_errors(p: torch.Tensor, group_size: int, samples: int, batches: int, seed: int):
    """Baseline errors of every group estimator for Bernoulli(p_b) rewards: (measured vs an
    M-sample V*, measured vs the true p)."""
    gen = torch.Generator().manual_seed(seed)
    B = p.shape[0]
    ref = torch.bernoulli(p[:, None].expand(B, samples), generator=gen).reshape(-1)
    v, v_se = v_star(ref, samples)
    base = {}
    for k in range(batches):
        r = torch.bernoulli(p[:, None].expand(B, group_size), generator=gen).reshape(-1)
        for name, b in group_baselines(r, group_size).items():
            base.setdefault(name, []).append(b.view(B, group_size))
    against_v = {n: baseline_error(torch.stack(b), v, v_se) for n, b in base.items()}
    against_p = {n: baseline_error(torch.stack(b), p.double(), torch.zeros(B))
                 for n, b in base.items()}
    return against_v, against_p


def test_group_mean_mse_is_binomial():
    """Group mean of G binary rewards: E (mean - p)^2 = p(1-p)/G; against an independent
    M-sample V*, E (mean - V*)^2 = p(1-p)(1/G + 1/M). Leave-one-out: p(1-p)/(G-1) + p(1-p)/M.
    Measured within 4 of its own standard errors; the two expectations differ by more."""
    Gs, M = 8, 16
    p = torch.linspace(0.05, 0.95, 400, dtype=torch.float64)
    q = float((p * (1 - p)).mean())
    against_v, against_p = binomial_errors(p, Gs, M, batches=8, seed=0)
    for name in ("grpo", "dr_grpo"):
        fig = against_v[name]
        assert abs(fig["mse"] - q * (1 / Gs + 1 / M)) < 4 * fig["mse_se"], fig["mse"]
        assert abs(fig["mse"] - q / Gs) > 4 * fig["mse_se"]
        assert abs(fig["bias"]) < 4 * fig["bias_se"]
        assert abs(against_p[name]["mse"] - q / Gs) < 4 * against_p[name]["mse_se"]
    loo = against_v["rloo"]
    assert abs(loo["mse"] - q * (1 / (Gs - 1) + 1 / M)) < 4 * loo["mse_se"]
    none = against_p["none"]  # baseline 0: error -p, MSE mean p^2, exactly
    assert none["mse"] == pytest.approx(float((p ** 2).mean()))
    assert none["bias"] == pytest.approx(-float(p.mean()))


def test_gradient_noise_against_a_plain_loop():
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(6, 5, generator=gen, dtype=torch.float64) + torch.tensor([1.0, 0, 0, 2, 0])
    ref = torch.randn(5, generator=gen, dtype=torch.float64)
    out = gradient_noise(g, ref)

    def rel(x):
        mean = x.mean(0)
        return float(((x - mean) ** 2).sum(1).sum() / (len(x) - 1) / (mean @ mean))
    jack = torch.tensor([rel(torch.cat([g[:k], g[k + 1:]])) for k in range(6)])
    cos = torch.nn.functional.cosine_similarity(g, ref[None], dim=1)
    assert out["rel_var"] == pytest.approx(rel(g))
    assert out["rel_var_se"] == pytest.approx(float((5 / 6 * ((jack - jack.mean()) ** 2).sum())
                                                    .sqrt()))
    assert out["cos"] == pytest.approx(float(cos.mean()))
    assert out["cos_se"] == pytest.approx(float(cos.std() / math.sqrt(6)))
    zero = gradient_noise(torch.zeros(4, 5), ref)
    assert zero["rel_var"] is None and zero["cos"] == 0.0


def test_the_critics_prompt_value_row_is_one_baseline_for_the_whole_completion():
    gen = torch.Generator().manual_seed(4)
    N, T = 8, 5
    mask = torch.ones(N, T, dtype=torch.long)
    mask[2, 3:] = 0
    values = torch.randn(N, T, generator=gen)
    draw = Draw(torch.randint(0, 2, (N,), generator=gen).float(), lambda: None, mask, values)
    rows = advantage_rows(draw, 4, TrainConfig(whiten_advantages=False))
    want = (draw.rewards - values[:, 0])[:, None].expand(N, T) * mask  # r - V_0 on every token
    torch.testing.assert_close(rows[("ppo_critic_v0", "raw")], want)
    # the baseline MSE row of the critic is that same V_0
    assert torch.equal(group_baselines(draw.rewards, 4, values=values)["ppo_critic"],
                       values[:, 0].double())


def test_the_scale_sweep_and_the_optimal_baseline_against_their_own_gradients(one_thread):
    policy = Tabular()
    record = measure(policy.sample, [policy.theta], CONFIG, group_size=G, batches=40,
                     samples=64, seed=2)
    sweep = record["baseline_scale"]
    assert set(sweep) == {f"{c:g}" for c in BASELINE_SCALES}
    raw = record["grad_rel_var"]["raw"]
    assert sweep["0"]["rel_var"] == pytest.approx(raw["none"]["mean"])
    assert sweep["1"]["rel_var"] == pytest.approx(raw["grpo"]["mean"])
    assert sweep["1"]["error"] == pytest.approx(record["grad_error"]["raw"]["grpo"]["mean"])
    assert sweep["0"]["mse"] == pytest.approx(record["baseline_mse"]["none"]["mean"])
    # c = 0.5 by its own backward passes, advantages r - 0.5 x group mean, on the same draws
    ref = policy.sample(64, estimator_quality._seed(2, 0))
    g_ref = surrogate_gradients(ref.logp(), None, {"r": estimator_quality.raw_advantages(
        "rloo", ref.rewards, 64)}, [policy.theta], agg=CONFIG.agg)["r"]
    half = []
    for k in range(40):
        d = policy.sample(G, estimator_quality._seed(2, k + 1))
        mean = d.rewards.view(-1, G).mean(1).repeat_interleave(G)
        half.append(surrogate_gradients(d.logp(), None, {"h": d.rewards - 0.5 * mean},
                                        [policy.theta], agg=CONFIG.agg)["h"])
    plain = gradient_noise(torch.stack(half), g_ref)
    for fig in ("rel_var", "cos", "error"):
        assert sweep["0.5"][fig] == pytest.approx(plain[fig], rel=1e-4), fig
    best = record["optimal_baseline"]
    assert len(best["baseline"]) == LOGITS.shape[0] and best["error"] > 0


def test_the_optimal_baseline_recovers_a_planted_one_and_judges_on_held_out_batches():
    gen = torch.Generator().manual_seed(5)
    K, B, P = 12, 4, 30
    H = torch.randn(K, B, P, generator=gen, dtype=torch.float64)
    ref = torch.randn(P, generator=gen, dtype=torch.float64)
    v = torch.tensor([0.1, 0.4, 0.6, 0.9], dtype=torch.float64)
    planted = 0.2 + 0.5 * v  # slope 0.5, intercept 0.2
    g_none = ref + torch.einsum("kbp,b->kp", H, planted)
    noisy = g_none + 1e-3 * torch.randn(K, P, generator=gen, dtype=torch.float64)
    fit = optimal_baseline(noisy, H, ref, v)
    torch.testing.assert_close(fit["baseline"], planted, atol=1e-3, rtol=0)
    assert fit["slope"] == pytest.approx(0.5, abs=1e-3)
    assert fit["intercept"] == pytest.approx(0.2, abs=1e-3)
    # held-out: each batch judged with the baseline fitted on the other half only
    from_odd = torch.linalg.lstsq(H[1::2].permute(0, 2, 1).reshape(-1, B),
                              (noisy[1::2] - ref).reshape(-1)).solution  # fitted on odd k
    torch.testing.assert_close(fit["gradients"][0], noisy[0] - H[0].T @ from_odd)
    assert optimal_baseline(noisy, H, ref, torch.full((B,), 0.3))["slope"] is None


# ---------------------------------------------------------------- the embedded model
SMALL = dict(prompts=3, group_size=4, batches=3, samples=8, seed=0)


def check_record(record: dict, critic: bool) -> None:
    json.dumps(record, allow_nan=False)
    B = SMALL["prompts"]
    assert len(record["v_star"]) == len(record["v_star_se"]) == len(record["prompts"]) == B
    names = {"grpo", "dr_grpo", "rloo", "none"} | ({"ppo_critic"} if critic else set())
    assert set(record["baseline_mse"]) == set(record["baseline_bias"]) == names
    rows = names | ({"ppo_gae", "ppo_critic_v0"} if critic else set())
    for field in ("grad_rel_var", "grad_cos", "grad_error"):
        assert set(record[field]) == {"raw", "trained"}
        for mode in ("raw", "trained"):
            assert set(record[field][mode]) == rows
    for fig in record["baseline_mse"].values():
        assert math.isfinite(fig["mean"]) and fig["mean"] >= 0 and math.isfinite(fig["se"])
    assert record["grad_rel_var"]["raw"]["none"]["mean"] is not None
    flat = flat_metrics(record)
    assert all(math.isfinite(v) for v in flat.values())
    assert {f"diag/baseline_mse/{n}" for n in names} <= set(flat)
    assert "diag/grad_rel_var/none" in flat and "diag/grad_rel_var_raw/none" in flat
    assert {f"diag/scale/error/{c:g}" for c in BASELINE_SCALES} <= set(flat)
    assert {"diag/optimal/error", "diag/optimal/mse"} <= set(flat)


def test_lm_path_without_a_critic(tiny):
    from labkit.probes.diagnose import DiagSettings, diagnose
    from labkit.problems.tasks import ArithmeticTask

    model, tokenizer = tiny
    problems = ArithmeticTask().sample(SMALL["prompts"], "test", seed=5, distinct=True)
    config = TrainConfig(max_new_tokens=16)
    before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    record = diagnose(model, tokenizer, problems, config=config, settings=DiagSettings(**SMALL),
                      step=7)
    check_record(record, critic=False)
    assert torch.equal(torch.get_rng_state(), rng)  # a run's own draws are not disturbed
    assert record["step"] == 7 and record["settings"]["samples"] == SMALL["samples"]
    for p, b in zip(model.parameters(), before):  # the model's .grad is untouched
        assert (p.grad is None and b is None) or torch.equal(p.grad, b)


def test_lm_path_with_a_critic_through_a_trainer():
    from labkit.probes.diagnose import DiagSettings, diagnose_trainer
    from labkit.trainer import Trainer

    trainer = Trainer(TrainConfig(algo="ppo", steps=1, batch_prompts=2, group_size=2,
                                  eval_n=8, progress=False))
    flat, record = diagnose_trainer(trainer, DiagSettings(**SMALL), step=0)
    check_record(record, critic=True)
    # a fresh critic's head is zero: V = 0 everywhere, so its baseline is `none`'s
    assert record["baseline_mse"]["ppo_critic"] == record["baseline_mse"]["none"]
    assert record["grad_rel_var"]["raw"]["ppo_critic"]["mean"] == pytest.approx(
        record["grad_rel_var"]["raw"]["none"]["mean"], rel=1e-4)
    assert flat["diag/baseline_mse/ppo_critic"] == record["baseline_mse"]["ppo_critic"]["mean"]


def test_settings_are_checked():
    from labkit.probes.diagnose import DiagSettings

    with pytest.raises(ValueError, match="batches must be an int >= 3"):
        DiagSettings(batches=2)
    with pytest.raises(ValueError, match="samples"):
        DiagSettings(samples=1)
    with pytest.raises(ValueError, match="estimators"):
        DiagSettings(estimators=("nope",))


def test_command_prints_a_table_and_a_json_record(capsys, tmp_path):
    from labkit.__main__ import main

    out = tmp_path / "diag.jsonl"
    threads = torch.get_num_threads()
    code = main(["diagnose", "--prompts", "2", "--group-size", "2", "--batches", "3",
                 "--samples", "4", "--threads", "1", "--out", str(out)])
    torch.set_num_threads(threads)
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and lines[0].split()[:3] == ["estimator", "baseline_mse", "baseline_bias"]
    record = json.loads(lines[-1])
    assert record["settings"]["batches"] == 3 and "ppo_critic" not in record["baseline_mse"]
    assert json.loads(out.read_text()) == record


def test_command_rejects_an_unknown_field(capsys):
    from labkit.__main__ import main

    assert main(["diagnose", "--set", "nope", "1"]) == 2
    assert "--set nope: not a TrainConfig field" in capsys.readouterr().err


# ------------------------------------------------------------------- wired into the trainer
RUN = dict(steps=3, batch_prompts=4, group_size=4, max_new_tokens=12, eval_every=2, eval_n=8,
           eval_samples=2, cgc_prompts=4, progress=False, lr=5e-4, dead_steps=0)
DIAG = dict(diag_every=2, diag_prompts=3, diag_batches=3, diag_samples=4)


def _training_figures(records):
    """Records less the diagnostics and the wall-clock figures."""
    return [{k: v for k, v in r.items() if not k.startswith(("diag/", "perf/"))}
            for r in records]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_run_logs_diagnostics_every_diag_every_steps_without_changing_training(tmp_path,
                                                                                  algo):
    from labkit.formulas.metrics import METRICS
    from labkit.probes.diagnose import DIAG_FILE, read_diagnostics
    from labkit.trainer import train

    plain = train(TrainConfig(algo=algo, run_dir=str(tmp_path / "plain"), **RUN))
    diag = train(TrainConfig(algo=algo, run_dir=str(tmp_path / "diag"), **RUN, **DIAG))
    assert not (tmp_path / "plain" / DIAG_FILE).exists()
    assert not any(k.startswith("diag/") for r in plain.history for k in r)
    measured = {r["step"] for r in diag.history if "diag/v_star_mean" in r}
    assert measured == {0, 2, 3}  # step 0, every 2 steps, the last step
    rows = ["grpo", "dr_grpo", "rloo", "none"] + (["ppo_critic"] if algo == "ppo" else [])
    for record in diag.history:
        if record["step"] in measured:
            keys = {k for k in record if k.startswith("diag/")}
            assert keys <= set(METRICS)
            assert {f"diag/baseline_mse/{e}" for e in rows} <= keys
            assert ("diag/grad_rel_var/ppo_gae" in keys) == (algo == "ppo")
    lines = read_diagnostics(tmp_path / "diag")
    assert [line["step"] for line in lines] == [0, 2, 3]
    assert all(len(line["v_star"]) == 3 and line["settings"]["batches"] == 3 for line in lines)
    assert _training_figures(diag.history) == _training_figures(plain.history)


def test_diag_fields_are_checked_before_any_model_loads():
    with pytest.raises(ValueError, match="diag_batches"):
        TrainConfig(diag_batches=2)
    with pytest.raises(ValueError, match="diag_prompts"):
        TrainConfig(diag_every=1, diag_prompts=9, eval_n=8)
    assert TrainConfig().diag_every == 0  # default runs measure nothing
    TrainConfig(stop_rules="diag/grad_rel_var/grpo>5 for 2")  # a stop rule may read them


def test_informative_share_counts_the_subsets_whose_rewards_all_agree():
    """per_prompt is the share of G-subsets of each prompt's M samples whose rewards are
    not all equal (the U-statistic of 1 - sum_v p_v^G), averaged over prompts; at_mean the
    formula 1 - p^G - (1-p)^G at the mean p (0/1 rewards)."""
    import itertools

    from labkit.probes.estimator_quality import informative_share

    gen = torch.Generator().manual_seed(0)
    rewards = (torch.rand(5, 7, generator=gen) < torch.tensor([[0.1], [0.5], [0.9], [0.0],
                                                               [0.6]])).float()
    found = informative_share(rewards, [2, 3, 7])
    for g in (2, 3, 7):
        shares = []
        for row in rewards.tolist():
            subsets = list(itertools.combinations(row, g))
            shares.append(sum(len(set(s)) > 1 for s in subsets) / len(subsets))
        assert found[g]["per_prompt"] == pytest.approx(sum(shares) / 5)
        p = rewards.mean().item()
        assert found[g]["at_mean"] == pytest.approx(1 - p ** g - (1 - p) ** g)
    three = informative_share(torch.tensor([[0.0, 0.5, 1.0, 1.0]]), [2])  # 3 reward values
    assert three[2]["per_prompt"] == pytest.approx(1 - 1 / 6)
    with pytest.raises(ValueError, match="M=7"):
        informative_share(rewards, [8])


def test_the_metric_tables_diag_rows_copy_the_diagnostics_estimators():
    from labkit.formulas.metric_table import BASELINE_SCALES_LOGGED, DIAG_BASELINES, DIAG_GRADIENTS
    from labkit.probes.estimator_quality import BASELINE_SCALES, CRITIC_ROWS, GROUP_ESTIMATORS

    assert DIAG_BASELINES == GROUP_ESTIMATORS + ("ppo_critic",)
    assert DIAG_GRADIENTS == GROUP_ESTIMATORS + CRITIC_ROWS
    assert BASELINE_SCALES_LOGGED == BASELINE_SCALES
