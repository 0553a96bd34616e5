"""The figure builders against the formulas written out by hand, and the live figure."""

import math
from types import SimpleNamespace

import plotly.graph_objects as go
import plotly.io as pio
import pytest
import torch

from labkit.lab import plots
from labkit.config import TrainConfig
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
    assert [t.name for t in fig.data] == ["k1", "k2", "k3"]
    xs = fig.data[0].x
    formulas = {"k1": lambda x: -x, "k2": lambda x: x * x / 2,
                "k3": lambda x: math.exp(x) - x - 1}
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


def test_group_std_matches_a_loop():
    values = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    got = plots.group_std(values, 3)
    for b, v in enumerate(got):
        g = values[3 * b:3 * b + 3].tolist()
        mean = sum(g) / 3
        assert v == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in g) / 3))
    token = torch.tensor([[1.0, 3.0, 9.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert plots.group_std(token, 2, mask) == pytest.approx([0.0])  # row means 2 and 2


def fake_report(step, algo, B=3, G=4, T=5, steps=10):
    config = TrainConfig(algo=algo, batch_prompts=B, group_size=G, steps=steps)
    g = torch.Generator().manual_seed(step)
    rewards = (torch.rand(B * G, generator=g) > 0.5).float()
    mask = torch.ones(B * G, T, dtype=torch.long)
    mask[:, -1] = 0
    adv = torch.randn(B * G, T, generator=g) if algo == "ppo" else torch.randn(B * G, generator=g)
    metrics = {"adv/gav": 0.1 * step, "adv/std": 1.0 + step}
    return StepReport(step, metrics, rewards, adv, SimpleNamespace(completion_mask=mask), config)


def test_live_plot_grows_one_point_per_step():
    live = plots.LivePlot()
    assert isinstance(live.widget, go.FigureWidget)
    assert len(live.widget.data) == 1  # the diagonal
    for step in (1, 2, 3):
        live(fake_report(step, "grpo"))
        gav = [t for t in live.widget.data if t.name == "grpo" and t.xaxis == "x"][0]
        assert list(gav.x) == list(range(1, step + 1))
        assert list(gav.y) == pytest.approx([0.1 * s for s in range(1, step + 1)])
        spread = [t for t in live.widget.data if t.name == "grpo" and t.xaxis == "x3"][0]
        assert len(spread.x) == 3 * step  # B markers a step
    assert not [t for t in live.widget.data if t.xaxis == "x4" and t.name != "y = x"]
    for step in (1, 2):
        report = fake_report(step, "ppo")
        live(report)
        std = [t for t in live.widget.data if t.name == "ppo" and t.xaxis == "x2"][0]
        assert list(std.y) == [1.0 + s for s in range(1, step + 1)]
    pair = [t for t in live.widget.data if t.xaxis == "x4" and t.name == "grpo"][0]
    assert len(pair.x) == 2 * 3  # B prompts of steps 1 and 2, GRPO's spread on x
    assert list(pair.y[-3:]) == pytest.approx(plots.group_std(report.advantages, 4,
                                                              report.batch.completion_mask))
    assert live.widget.layout.title.text == "ppo: step 2 of 10"
    static = live.static()
    assert type(static) is go.Figure and len(static.data) == len(live.widget.data)
    assert list(static.data[1].x) == list(live.widget.data[1].x)
    live.reset()
    assert len(live.widget.data) == 1
