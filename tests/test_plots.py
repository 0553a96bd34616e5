"""The figure builders against the formulas written out by hand, and the live figure."""

import math
from types import SimpleNamespace

import plotly.graph_objects as go
import plotly.io as pio
import pytest
import torch

from labkit.formulas import stats
from labkit.lab import live as live_figure
from labkit.lab import plots
from labkit.settings.config import TrainConfig
from labkit.trainer import StepReport


def objective(rho, a, eps_low, eps_high, c=None):
    """min(rho A, clip(rho) A), capped below at c A for A < 0 (the dual clip)."""
    value = min(rho * a, min(max(rho, 1 - eps_low), 1 + eps_high) * a)
    return max(value, c * a) if c is not None and a < 0 else value


def traces(fig, **match):
    return [t for t in fig.data if all(getattr(t, k) == v for k, v in match.items())]


def test_clipped_surrogate_curves_equal_min_of_clip():
    fig = plots.clipped_surrogate(eps_low=0.2, eps_high=0.28, dual_clip=3.0, ratio_max=5.0,
                                  points=101)
    assert len(fig.data) == 7  # A > 0: none, PPO, clip-higher; A < 0: the same and dual clip
    expected = {"no clip: rho*A": (0.2, math.inf, None), "PPO clip [0.8, 1.2]": (0.2, 0.2, None),
                "clip-higher [0.8, 1.28]": (0.2, 0.28, None), "dual clip c=3": (0.2, 0.28, 3.0)}
    for trace in fig.data:
        a = 1.0 if trace.meta == "A=+1" else -1.0
        eps_low, eps_high, c = expected[trace.name]
        if eps_high == math.inf:
            want = [rho * a for rho in trace.x]
        else:
            want = [objective(rho, a, eps_low, eps_high, c) for rho in trace.x]
        assert trace.y == pytest.approx(want, abs=1e-9), trace.name
    assert len(traces(fig, meta="A=+1")) == 3 and len(traces(fig, meta="A=-1")) == 4
    dual = traces(fig, name="dual clip c=3")[0]
    assert min(dual.y) == pytest.approx(-3.0)  # the cap -c*A for A = -1 ... objective >= c*A


def test_kl_estimator_curves_equal_their_formulas():
    fig = plots.kl_estimators(x_max=3.0, points=61)
    assert [t.name for t in fig.data] == ["k1", "k2", "k3", "abs"]
    xs = fig.data[0].x
    formulas = {"k1": lambda x: -x, "k2": lambda x: x * x / 2,
                "k3": lambda x: math.exp(x) - x - 1, "abs": abs}
    for trace in fig.data:
        assert trace.x == pytest.approx(xs)
        assert trace.y == pytest.approx([formulas[trace.name](x) for x in xs], abs=1e-12)
    assert min(traces(fig, name="k3")[0].y) >= 0


def test_advantage_estimators_one_bar_trace_per_estimator():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    table = {"a": torch.tensor([0.5, -0.5, -0.5, 0.5]), "b": torch.tensor([1.0, -1.0, -1.0, 1.0])}
    fig = plots.advantage_estimators(rewards, table)
    assert [t.name for t in fig.data] == ["a", "b"]
    assert all(t.type == "bar" for t in fig.data)
    assert list(fig.data[1].y) == [1.0, -1.0, -1.0, 1.0]
    assert fig.data[0].x[0] == "o1 (r=1)"


def _history(n, eval_every=2, offset=0.0):
    return [{"step": s, "samples": 8 * s, "rollout/reward_mean": 0.1 * s + offset,
             **({"eval/accuracy": 0.3 + 0.01 * s} if s % eval_every == 0 else {})}
            for s in range(n + 1)]


def test_metric_lines_one_subplot_per_key_one_line_per_run():
    histories = {"grpo": _history(6), "ppo": _history(6, offset=1.0)}
    fig = plots.metric_lines(histories, ["rollout/reward_mean", "eval/accuracy", "missing/key"])
    assert len(fig.data) == 3 * 2
    grpo_reward, ppo_reward, grpo_acc = fig.data[0], fig.data[1], fig.data[2]
    assert list(grpo_reward.x) == list(range(7))
    assert list(ppo_reward.y) == pytest.approx([0.1 * s + 1.0 for s in range(7)])
    assert list(grpo_acc.x) == [0, 2, 4, 6] and grpo_acc.mode == "lines+markers"
    assert sum(t.showlegend is not False for t in fig.data) == 2  # each run once in the legend
    by_samples = plots.metric_lines(histories, ["rollout/reward_mean"], x="samples")
    assert list(by_samples.data[0].x) == [8 * s for s in range(7)]


def test_sweep_figures():
    histories = {f"{b}/G={G}": [{**r, "group_size": G} for r in _history(4)]
                 for b in ("samples", "prompts") for G in (2, 4)}
    fig = plots.sweep_curves(histories, "eval/accuracy")
    assert len(fig.data) == 2 * 2 * 2  # x in (step, samples) x budgets x G
    rows = [{"run": n, "budget": n.split("/")[0], "group_size": int(n.split("=")[1]), "gav": 0.5}
            for n in histories]
    fig = plots.sweep_lines(rows, ["gav", "step_s"])
    assert len(fig.data) == 2 * 2  # keys x budgets
    assert list(fig.data[0].x) == [2, 4] and list(fig.data[0].y) == [0.5, 0.5]
    assert len(fig.data[2].x) == 0  # no row has step_s


def test_table_renders_html_and_markdown():
    t = plots.table([{"run": "grpo", "acc": 0.123456}, {"run": "<ppo>", "extra": 1}])
    assert t.columns == ["run", "acc", "extra"]
    assert "<td>0.123</td>" in t._repr_html_() and "&lt;ppo&gt;" in t._repr_html_()
    assert t.to_markdown().splitlines()[0] == "| run | acc | extra |"


def test_setup_renders_offline_html_without_cdn():
    before = pio.renderers.default
    try:
        plots.setup()
        assert pio.renderers.default == "notebook"
        bundle = pio.renderers["notebook"].to_mimebundle(go.Figure(go.Scatter(y=[1, 2])).to_dict())
        assert set(bundle) == {"text/html"}
        assert "cdn" not in bundle["text/html"].lower()
        assert "<script src" not in bundle["text/html"]
    finally:
        pio.renderers.default = before


def fake_report(step, algo, steps=10, diag=False):
    config = TrainConfig(algo=algo, steps=steps)
    metrics = {"adv/gav": 0.1 * step, "rollout/reward_mean": 0.5 + 0.01 * step}
    if diag:
        rows = ("grpo", "dr_grpo", "rloo", "none") + (("ppo_critic",) if algo == "ppo" else ())
        metrics |= {f"diag/baseline_mse/{e}": 0.01 * (k + 1) for k, e in enumerate(rows)}
        metrics |= {f"diag/grad_rel_var/{e}": 1.0 + k for k, e in enumerate(rows)}
        metrics |= {"diag/grad_rel_var/ppo_gae": 9.0} if algo == "ppo" else {}
        metrics |= {"diag/grad_cos/grpo": 0.5, "diag/v_star_mean": 0.3}  # not drawn
    return StepReport(step, metrics, torch.zeros(4), torch.zeros(4), SimpleNamespace(), config)


def _trace(live, axis, name):
    found = [t for t in live.widget.data if t.xaxis == axis and t.name == name]
    assert len(found) == 1, (axis, name, [(t.xaxis, t.name) for t in live.widget.data])
    return found[0]


def test_live_plot_grows_per_step_and_per_measurement():
    live = live_figure.LivePlot()
    assert isinstance(live.widget, go.FigureWidget) and not live.widget.data
    for step in (1, 2, 3, 4):
        live(fake_report(step, "grpo", diag=step % 2 == 0))
        assert list(_trace(live, "x3", "grpo run").x) == list(range(1, step + 1))
        assert list(_trace(live, "x4", "grpo run").y) == pytest.approx(
            [0.1 * s for s in range(1, step + 1)])
    mse = _trace(live, "x", "grpo run: rloo")
    assert list(mse.x) == [2, 4] and list(mse.y) == pytest.approx([0.03, 0.03])
    assert list(_trace(live, "x2", "grpo run: none").y) == [4.0, 4.0]
    assert not [t for t in live.widget.data if "ppo_" in t.name or "grad_cos" in t.name]
    live(fake_report(2, "ppo", diag=True))
    assert list(_trace(live, "x", "ppo run: ppo_critic").y) == pytest.approx([0.05])
    assert list(_trace(live, "x2", "ppo run: ppo_gae").y) == [9.0]
    assert not [t for t in live.widget.data if t.xaxis == "x" and t.name.endswith("ppo_gae")]
    assert live.widget.layout.title.text == "ppo run: step 2 of 10"
    static = live.static()
    assert type(static) is go.Figure and len(static.data) == len(live.widget.data)
    live.reset()
    assert not live.widget.data


def test_diag_points_reads_only_the_drawn_figures():
    record = {"diag/baseline_mse/grpo": 0.1, "diag/grad_rel_var/ppo_gae": 2.0,
              "diag/grad_cos/grpo": 0.9, "diag/baseline_bias/grpo": 0.0, "adv/gav": 1.0}
    assert live_figure.diag_points(record) == {("baseline_mse", "grpo"): 0.1,
                                               ("grad_rel_var", "ppo_gae"): 2.0}


def test_loss_mode_weights_are_each_modes_gradient_weight():
    """The weight on grad log pi against the ratio: vanilla rho*A inside its clip and 0 where
    the clip cuts; cispo the clipped ratio everywhere; gpg A whatever the ratio."""
    fig = plots.loss_mode_weights(eps_low=0.2, eps_high=0.28, points=60)
    from labkit.formulas.policy_losses import POLICY_LOSSES

    assert {t.name for t in fig.data} == set(POLICY_LOSSES)
    for a in (1.0, -1.0):
        def curve(name):
            return traces(fig, name=name, meta=f"A={a:+g}")[0]
        rhos = curve("vanilla").x
        for rho, w in zip(rhos, curve("vanilla").y):
            cut = (a > 0 and rho > 1.28) or (a < 0 and rho < 0.8)
            assert w == pytest.approx(0.0 if cut else rho * a, abs=1e-12)
        for rho, w in zip(rhos, curve("cispo").y):
            assert w == pytest.approx(min(max(rho, 0.8), 1.28) * a, abs=1e-12)
        assert curve("gpg").y == pytest.approx([a] * len(rhos), abs=1e-12)


def test_registered_advantages_give_every_critic_free_estimator_per_completion():
    from labkit.formulas import advantages as adv
    from labkit.formulas import estimators as est
    from labkit.lab import registered_advantages

    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    table = registered_advantages(r, mask, greedy_reward=1.0)
    assert set(table) == {n for n in est.ESTIMATORS if n != "gae"}
    assert all(a.shape == (4,) for a in table.values())
    assert torch.equal(table["remax"], r - 1.0)
    assert torch.equal(table["rloo"], adv.rloo(r, 4))


def test_metric_lines_draw_an_arm_over_seeds_as_its_mean_with_a_band():
    histories = {f"grpo/seed={s}": _history(6, offset=0.1 * s) for s in range(3)}
    histories["ppo"] = _history(6, offset=1.0)
    fig = plots.metric_lines(histories, ["rollout/reward_mean"])
    runs, band, mean, ppo = fig.data[:3], fig.data[3], fig.data[4], fig.data[5]
    assert all(t.line.width < 1 and t.showlegend is False for t in runs)
    assert band.fill == "toself" and len(band.x) == 2 * 7
    # the mean over the three seeds, offsets 0, 0.1, 0.2: 0.1 above the first seed
    assert list(mean.y) == pytest.approx([0.1 * s + 0.1 for s in range(7)])
    assert mean.name == "grpo (mean of 3)" and mean.showlegend
    half = stats.mean_interval([0.0, 0.1, 0.2])
    assert band.y[0] == pytest.approx(half.high) and band.y[-1] == pytest.approx(half.low)
    assert ppo.name == "ppo" and ppo.line.width is None  # one run: its own line


def test_finding_intervals_draw_ratios_on_a_log_axis():
    def row(method, mean, low, high, threshold):
        return {"question": "q", "run": "seed=0", "verdict": "supported", "measure": "m",
                "effect": "e", "method": method, "mean": mean, "low": low, "high": high,
                "threshold": threshold}

    fig = plots.finding_intervals([
        row("t-interval of log ratios over 5 seeds, exponentiated", 1.8, 1.6, 2.0, 1.0),
        row("paired t over 5 seeds", 1.2, 0.3, 2.1, 0.0)])
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis2.type != "log"
