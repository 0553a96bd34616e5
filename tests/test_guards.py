"""Numerical guards: whatever rewards a model earns (constant, huge, tiny) and whatever shape
its completions take (single-token, empty, all padding), advantages, losses and gradients are
finite, or a clear error says why not; NaN and inf rewards are refused by name.

tests/test_advantages.py and tests/test_losses.py check each function against a loop, with
properties on moderate magnitudes; here the whole chains run (rewards -> advantages ->
tokens -> loss -> gradient, for GRPO and for PPO), up to the largest finite float32.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.formulas import advantages as adv
from labkit.formulas import losses as L
from labkit.formulas.advantages import NonFiniteError
from labkit.problems.rewards import RewardError, check_rewards, combine, correctness
from labkit.settings.config import TrainConfig

F32_MAX = torch.finfo(torch.float32).max
AGGS = tuple(L.AGG_MODES)  # the registry's names, in order


# --- strategies ------------------------------------------------------------------------------

@st.composite
def reward_groups(draw, max_magnitude: float = F32_MAX):
    """(rewards (B*G,), G): constant, binary, spread or one-outlier groups, at magnitudes from
    1e-30 up to `max_magnitude`."""
    g, b = draw(st.integers(2, 6)), draw(st.integers(1, 4))
    magnitude = draw(st.sampled_from([m for m in (1e-30, 1.0, 1e6, 1e15, 1e30, 1e37, F32_MAX)
                                      if m <= max_magnitude]))
    kind = draw(st.sampled_from(["constant", "binary", "spread", "outlier"]))
    unit = st.floats(-1, 1, width=32)
    if kind == "constant":
        values = [draw(unit)] * (b * g)
    elif kind == "binary":
        values = [float(draw(st.booleans())) for _ in range(b * g)]
    elif kind == "spread":
        values = draw(st.lists(unit, min_size=b * g, max_size=b * g))
    else:
        values = [0.0] * (b * g)
        values[draw(st.integers(0, b * g - 1))] = draw(st.sampled_from([-1.0, 1.0]))
    rewards = torch.tensor(values, dtype=torch.float64) * magnitude
    return rewards.clamp(-F32_MAX, F32_MAX).float(), g


@st.composite
def masks(draw, n: int):
    """(n, T) masks with empty rows, single-token rows, holes, and T = 0 now and then."""
    t_len = draw(st.integers(0, 7))
    rows = []
    for _ in range(n):
        kind = draw(st.sampled_from(["empty", "single", "prefix", "holes"]))
        if kind == "empty" or t_len == 0:
            rows.append([0] * t_len)
        elif kind == "single":
            rows.append([1] + [0] * (t_len - 1))
        elif kind == "prefix":
            k = draw(st.integers(1, t_len))
            rows.append([1] * k + [0] * (t_len - k))
        else:
            rows.append(draw(st.lists(st.integers(0, 1), min_size=t_len, max_size=t_len)))
    return torch.tensor(rows, dtype=torch.float32).reshape(n, t_len)


def log_probs(n: int, t_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return -5 * torch.rand(n, t_len, generator=g)


# --- group advantages ------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(reward_groups(), st.sampled_from(["group", "batch"]), st.booleans(),
       st.sampled_from([1e-4, 0.0]))
def test_z_scored_advantages_are_finite_and_bounded_up_to_float32_max(batch, scale, unbiased,
                                                                       eps):
    """A z-score of G values lies within sqrt(G) of 0, however large the rewards."""
    r, g = batch
    a = adv.grpo(r, g, scale=scale, unbiased=unbiased, eps=eps)
    assert torch.isfinite(a).all(), (r, a)
    groups = a.view(-1, g)
    if scale == "group":
        assert (groups.abs() <= math.sqrt(g) + 1e-4).all(), (r, a)
    constant = r.view(-1, g).amax(1) == r.view(-1, g).amin(1)
    assert (groups[constant] == 0).all()


@settings(max_examples=100, deadline=None)
@given(reward_groups(max_magnitude=1.0), st.integers(-120, 120), st.booleans())
def test_z_scores_do_not_depend_on_the_reward_unit(batch, power, unbiased):
    """Rewards times any power of two give the same z-scores (eps = 0): the rescaling inside
    is exact, so nothing overflows or underflows on the way."""
    r, g = batch
    big = r * 2.0 ** power
    if not torch.isfinite(big).all() or ((big == 0) & (r != 0)).any():
        return  # the scaled rewards themselves do not fit in float32
    if (big.abs() < torch.finfo(torch.float32).tiny).any() and power < 0:
        return  # subnormal rewards lose bits before any advantage is computed
    torch.testing.assert_close(adv.grpo(big, g, eps=0.0, unbiased=unbiased),
                               adv.grpo(r, g, eps=0.0, unbiased=unbiased), rtol=1e-6, atol=1e-6)


@settings(max_examples=150, deadline=None)
@given(reward_groups())
def test_unscaled_advantages_are_finite_or_refused_clearly(batch):
    """dr_grpo and rloo return reward differences; past float32's range they refuse."""
    r, g = batch
    spread = (r.double().view(-1, g).amax(1) - r.double().view(-1, g).amin(1)).max().item()
    for fn in (adv.dr_grpo, adv.rloo):
        try:
            a = fn(r, g)
        except NonFiniteError as e:
            assert "overflow" in str(e) and "scale the reward" in str(e)
            assert spread > F32_MAX / 4  # refused only when the differences are that large
            continue
        assert torch.isfinite(a).all(), (fn.__name__, r, a)


def test_rewards_of_1e30_keep_exact_differences():
    r = torch.tensor([1e30, -1e30, 3e30, 0.0])
    want = r.double() - r.double().mean()
    torch.testing.assert_close(adv.dr_grpo(r, 4).double(), want, rtol=1e-6, atol=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1, 1, width=32), min_size=1, max_size=12),
       st.sampled_from([1.0, 1e20, F32_MAX]), st.booleans(), st.booleans())
def test_whitening_is_finite_up_to_float32_max(values, magnitude, shift_mean, unbiased):
    x = (torch.tensor(values, dtype=torch.float64) * magnitude).clamp(-F32_MAX, F32_MAX).float()
    out = adv.whiten(x[None], torch.ones(1, len(values)), shift_mean=shift_mean,
                     unbiased=unbiased)
    assert torch.isfinite(out).all(), (x, out)
    if shift_mean and len(set(values)) > 1:
        assert abs(out.double().mean().item()) < 1e-5


# --- whole chains, with gradients --------------------------------------------------------------

@settings(max_examples=120, deadline=None)
@given(st.data(), reward_groups(max_magnitude=1e30),
       st.sampled_from(["grpo", "dr_grpo", "rloo"]), st.sampled_from(["uniform", "discounted"]),
       st.sampled_from(AGGS), st.sampled_from(["token", "sequence"]),
       st.sampled_from([None, 3.0]))
def test_grpo_chain_gives_finite_loss_and_gradients(data, batch, estimator, mode, agg, level,
                                                    dual_clip):
    """Rewards -> advantages -> per-token advantages -> clipped loss -> backward, on masks
    with empty rows, single tokens, holes, or no token at all."""
    r, g = batch
    a = {"grpo": adv.grpo, "dr_grpo": adv.dr_grpo, "rloo": adv.rloo}[estimator](r, g)
    mask = data.draw(masks(len(r)))
    a_t = adv.to_tokens(a, mask, mode=mode)
    assert torch.isfinite(a_t).all() and (a_t[mask == 0] == 0).all()
    old = log_probs(*mask.shape, seed=0)
    logp = (old + 0.3 * log_probs(*mask.shape, seed=1)).requires_grad_()
    for advantages in (a, a_t):
        loss, stats = L.policy_loss(logp, old, advantages, mask, agg=agg, level=level,
                                    dual_clip=dual_clip, eps_high=0.28)
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
        assert (grad[mask == 0] == 0).all()
        assert all(math.isfinite(v) for v in stats.values())
        if mask.sum() == 0:
            assert loss.item() == 0.0 and (grad == 0).all()
    kl = L.kl(logp, old, "k3", mask=mask)
    kl_loss = L.aggregate(kl, mask, agg)
    (kl_grad,) = torch.autograd.grad(kl_loss, logp)
    assert torch.isfinite(kl_loss) and kl_loss.item() >= 0 and torch.isfinite(kl_grad).all()


@settings(max_examples=100, deadline=None)
@given(st.data(), reward_groups(max_magnitude=1e15), st.sampled_from(AGGS),
       st.sampled_from([0.0, 0.1]), st.sampled_from([None, 0.2]), st.booleans())
def test_ppo_chain_gives_finite_loss_and_gradients(data, batch, agg, beta, clip, whiten):
    """Rewards -> token rewards (+ KL) -> GAE -> whitening -> policy and value losses ->
    backward. Beyond ~1e19 the squared value error itself leaves float32 (the run then stops
    on its non-finite loss); 1e15 is the largest magnitude drawn here."""
    r, _ = batch
    mask = data.draw(masks(len(r)))
    n, t_len = mask.shape
    old = log_probs(n, t_len, seed=2)
    ref = log_probs(n, t_len, seed=3)
    token_rewards = L.ppo_token_rewards(r, mask, logp=old, ref_logp=ref, beta=beta, kind="k1")
    old_values = r.abs().max() * torch.rand(n, t_len, generator=torch.Generator().manual_seed(4))
    advantages, returns = adv.gae(token_rewards, old_values, mask, gamma=1.0, lam=0.95)
    if whiten:
        advantages = adv.whiten(advantages, mask)
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    logp = old.clone().requires_grad_()
    values = old_values.clone().requires_grad_()
    p_loss, _ = L.policy_loss(logp, old, advantages, mask, agg=agg)
    v_loss, v_stats = L.value_loss(values, old_values, returns, mask, clip=clip, agg=agg)
    grads = torch.autograd.grad(p_loss + v_loss, [logp, values])
    assert torch.isfinite(p_loss) and torch.isfinite(v_loss)
    assert all(torch.isfinite(gr).all() and (gr[mask == 0] == 0).all() for gr in grads)
    assert 0.0 <= v_stats["value/clipfrac"] <= 1.0


def test_a_batch_of_empty_completions_is_a_zero_loss_for_every_aggregation():
    """T = 0: no completion token at all (every row empty)."""
    mask = torch.zeros(4, 0)
    logp = torch.zeros(4, 0, requires_grad=True)
    for agg in AGGS:
        loss, _ = L.policy_loss(logp, torch.zeros(4, 0), torch.ones(4), mask, agg=agg)
        assert loss.item() == 0.0, agg
    assert adv.gae(torch.zeros(4, 0), torch.zeros(4, 0), mask)[0].shape == (4, 0)


@pytest.mark.parametrize("where", ["token_rewards", "values"])
def test_gae_refuses_nan_on_real_tokens_and_ignores_it_on_padding(where):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rewards, values = torch.zeros(2, 3), torch.zeros(2, 3)
    inputs = {"token_rewards": rewards, "values": values}
    inputs[where][0, 2] = math.nan  # padding
    a, ret = adv.gae(rewards, values, mask)
    assert torch.isfinite(a).all() and torch.isfinite(ret).all()
    inputs[where][1, 0] = math.nan  # a real token
    with pytest.raises(NonFiniteError, match=f"gae: {where} must be finite"):
        adv.gae(rewards, values, mask)


# --- rewards that are not finite numbers -------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=10), st.data(),
       st.sampled_from([math.nan, math.inf, -math.inf]))
def test_a_non_finite_reward_is_refused_naming_its_function_and_index(values, data, bad):
    assert check_rewards(values, "my_reward") == values
    i = data.draw(st.integers(0, len(values) - 1))
    values[i] = bad
    with pytest.raises(RewardError) as e:
        check_rewards(values, "my_reward")
    assert "my_reward" in str(e.value) and f"index {i}" in str(e.value)
    with pytest.raises(RewardError, match="my_reward"):
        check_rewards(torch.tensor(values), "my_reward")


@pytest.mark.parametrize("bad", [None, "1.0", True, [1.0]])
def test_a_non_number_reward_is_refused(bad):
    with pytest.raises(RewardError, match="reward function f .*index 1"):
        check_rewards([0.0, bad], "f")


def test_combine_names_the_component_that_returned_nan():
    def flaky_judge(completions, **kwargs):
        return [0.5, math.nan][:len(completions)]

    fn = combine((correctness, 1.0), (flaky_judge, 0.5))
    with pytest.raises(RewardError, match="flaky_judge.*index 1"):
        fn(["A: 2", "A: 3"], answer=["2", "3"])


def test_combine_refuses_a_sum_that_overflows():
    def huge(completions, **kwargs):
        return [1e308] * len(completions)

    fn = combine((huge, 1.0), (huge, 1e3))
    with pytest.raises(RewardError, match=r"1\*huge\+1000\*huge.*non-finite"):
        fn(["x"])


# --- at run time -------------------------------------------------------------------------------

FAST = dict(steps=3, batch_prompts=4, group_size=4, max_new_tokens=12, eval_every=1000,
            eval_n=4, eval_samples=0, cgc_prompts=0, progress=False, lr=5e-4)


def test_a_nan_reward_stops_the_run_with_one_line_and_a_resumable_checkpoint(
        tmp_path, monkeypatch, capsys):
    """Step 2's rewards are NaN: the command says so in one line (exit 1), the checkpoint
    of step 1 is there, and a resume finishes the run."""
    import labkit.problems.reward_expr
    from labkit.__main__ import main
    from labkit.run.rundir import latest_checkpoint, load_checkpoint, read_log
    from labkit.trainer import train

    calls = []

    def nan_on_second_step(completions, **kwargs):
        calls.append(1)
        scores = correctness(completions, **kwargs)
        return [math.nan] * len(scores) if len(calls) == 2 else scores

    # the reward the trainer builds from config.reward, NaN-giving
    monkeypatch.setattr(labkit.problems.reward_expr, "build", lambda spec, field="": nan_on_second_step)
    run_dir = tmp_path / "run"
    args = ["train", "--run-dir", str(run_dir)]
    for key, value in FAST.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    assert main(args) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "Traceback" in line]
    assert errors == lines[-1:] and errors[0].startswith("error: step 2: "), lines
    assert "reward function correctness" in errors[0] and "nan" in errors[0]
    assert "step_000001.pt" in errors[0]
    assert load_checkpoint(latest_checkpoint(run_dir))["step"] == 1
    assert [r["step"] for r in read_log(run_dir / "metrics.jsonl")] == [0, 1]
    monkeypatch.undo()
    resumed = train(resume=run_dir)
    assert [r["step"] for r in resumed.history] == [0, 1, 2, 3]


def test_a_non_finite_loss_mid_step_is_kept_apart_from_the_resumable_checkpoints(
        tmp_path, monkeypatch):
    """With two minibatches the first has already moved the weights when the second's loss
    is NaN: that state is not the end of any step, so no resume may load it as one."""
    import labkit.update
    from labkit.records import RunAborted
    from labkit.run.rundir import CHECKPOINTS, latest_checkpoint
    from labkit.trainer import train

    original, calls = labkit.update.policy_loss_mode, []

    def nan_on_second_minibatch(*args, **kwargs):
        calls.append(1)
        loss, stats = original(*args, **kwargs)
        return (loss * math.nan if len(calls) == 2 else loss), stats

    monkeypatch.setattr(labkit.update, "policy_loss_mode", nan_on_second_minibatch)
    run_dir = tmp_path / "run"
    with pytest.raises(RunAborted, match="step 1: non-finite loss.*mid-step.*the beginning"):
        train(TrainConfig(run_dir=str(run_dir), minibatches=2, **FAST))
    assert latest_checkpoint(run_dir) is None
    assert [p.name for p in (run_dir / CHECKPOINTS).iterdir()] == ["diverged_000001.pt"]
