"""Plotly figures for the notebooks.

Every curve of a textbook formula is computed by labkit's own function (`losses.policy_loss`,
`losses.kl`), so a figure shows what the trainer computes, not a re-derivation. Figures are
plain `go.Figure`s; notebook 03's live figure is `labkit.lab.live.LivePlot`.

`setup()` makes every figure render as HTML with plotly.js embedded once per notebook (no CDN,
no MathJax script), so an executed notebook converted with nbconvert reads offline.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import plotly.io as pio
import torch
from plotly.io._base_renderers import NotebookRenderer
from plotly.subplots import make_subplots

from labkit.formulas import losses, stats
from labkit.formulas.policy_losses import POLICY_LOSSES, policy_loss_mode
from labkit.lab.token_view import RolloutView

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
TEMPLATE = "plotly_white"


class OfflineNotebookRenderer(NotebookRenderer):
    """plotly's "notebook" renderer (plotly.js embedded at the first figure) without the
    MathJax CDN script it adds to every figure; labels here need no LaTeX."""

    def to_mimebundle(self, fig_dict):
        page = pio.to_html(fig_dict, config=self.config, include_plotlyjs=False,
                           include_mathjax=False, full_html=False, default_width="100%",
                           default_height=_height(fig_dict), validate=False)
        return {"text/html": page}


def _height(fig_dict) -> int:
    """The figure's own height, else plotly's notebook default."""
    return (fig_dict.get("layout") or {}).get("height") or 525


def setup() -> None:
    """Render figures as offline HTML (plotly.js embedded, no CDN); call once per notebook."""
    pio.renderers["notebook"] = OfflineNotebookRenderer()
    pio.renderers.default = "notebook"
    pio.templates.default = TEMPLATE


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


# ------------------------------------------------------------------ 00: building blocks

def advantage_estimators(rewards, table: Mapping[str, torch.Tensor]) -> go.Figure:
    """Grouped bars: one trace per estimator, one bar per completion of the group.

    rewards (G,) label the x axis; table maps an estimator's name to its (G,) advantages.
    """
    r = [float(v) for v in rewards]
    labels = [f"o{i + 1} (r={v:g})" for i, v in enumerate(r)]
    fig = go.Figure()
    for i, (name, values) in enumerate(table.items()):
        fig.add_bar(x=labels, y=[float(v) for v in values], name=name, marker_color=color(i))
    fig.update_layout(barmode="group", title="Advantages of the same group's rewards",
                      xaxis_title="completion (its reward)", yaxis_title="advantage A_i",
                      height=420)
    return fig


def surrogate_curve(ratios: Sequence[float], advantage: float, *, eps_low: float,
                    eps_high: float, dual_clip: float | None = None) -> list[float]:
    """The per-token objective -l(rho) = min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)
    (capped at c A for A < 0 by the dual clip), computed by `losses.policy_loss` at each ratio."""
    out = []
    for rho in ratios:
        logp = torch.tensor([[math.log(rho)]], dtype=torch.float64)
        loss, _ = losses.policy_loss(logp, torch.zeros_like(logp),
                                     torch.tensor([advantage], dtype=torch.float64),
                                     torch.ones_like(logp), eps_low=eps_low, eps_high=eps_high,
                                     dual_clip=dual_clip)
        out.append(-loss.item())
    return out


def clipped_surrogate(*, eps_low: float = 0.2, eps_high: float = 0.28, dual_clip: float = 3.0,
                      ratio_max: float = 4.0, points: int = 201) -> go.Figure:
    """The clipped objective against the ratio, for A = +1 (left) and A = -1 (right).

    Curves: no clip (rho A); PPO's symmetric clip [1-eps_low, 1+eps_low]; DAPO's clip-higher
    [1-eps_low, 1+eps_high]; for A < 0 also the dual clip at c (with clip-higher).
    """
    ratios = [ratio_max * (k + 1) / points for k in range(points)]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=False,
                        subplot_titles=("A = +1 (a good completion)", "A = -1 (a bad one)"))
    for col, a in ((1, 1.0), (2, -1.0)):
        curves = {"no clip: rho*A": [r * a for r in ratios],
                  f"PPO clip [{1 - eps_low:g}, {1 + eps_low:g}]":
                      surrogate_curve(ratios, a, eps_low=eps_low, eps_high=eps_low),
                  f"clip-higher [{1 - eps_low:g}, {1 + eps_high:g}]":
                      surrogate_curve(ratios, a, eps_low=eps_low, eps_high=eps_high)}
        if a < 0:
            curves[f"dual clip c={dual_clip:g}"] = surrogate_curve(
                ratios, a, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
        for i, (name, ys) in enumerate(curves.items()):
            fig.add_scatter(x=ratios, y=ys, name=name, meta=f"A={a:+g}", row=1, col=col,
                            mode="lines",
                            line=dict(color=color(i), dash="dot" if i == 0 else "solid"),
                            legendgroup=name, showlegend=col == 1 or i == 3)
        for bound in (1 - eps_low, 1 + eps_high):
            fig.add_vline(x=bound, line=dict(color="gray", width=1, dash="dash"), row=1, col=col)
    fig.update_xaxes(title_text="ratio rho = pi / pi_old")
    fig.update_yaxes(title_text="objective -l(rho)", col=1)
    fig.update_layout(title="Clipped surrogate: where the gradient is cut", height=420)
    return fig


def loss_mode_weights(*, eps_low: float = 0.2, eps_high: float = 0.28, p_old: float = 0.3,
                      ratio_max: float = 3.0, points: int = 121) -> go.Figure:
    """Every policy-loss mode of `labkit.formulas.policy_losses.POLICY_LOSSES` (default options) as the
    weight it puts on grad log pi of one token, -d loss / d logp, against the ratio rho, for
    A = +1 (left) and A = -1 (right). One token of old probability p_old (DPPO's regions
    depend on it); computed by autograd through `policy_loss_mode`, token-sum aggregation.
    Where a curve is 0 the token does not learn; vanilla's weight is rho A inside the clip."""
    ratios = [ratio_max * (k + 1) / points for k in range(points)]
    old = torch.full((1, 1), math.log(p_old), dtype=torch.float64)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("A = +1", "A = -1"))
    for col, a in ((1, 1.0), (2, -1.0)):
        for i, name in enumerate(POLICY_LOSSES):
            ys = []
            for rho in ratios:
                logp = (old + math.log(rho)).clamp(max=0.0).requires_grad_()
                loss, _ = policy_loss_mode(name, logp, old, torch.tensor([[a]]),
                                           torch.ones(1, 1, dtype=torch.bool), eps_low=eps_low,
                                           eps_high=eps_high, agg="token-sum")
                (grad,) = torch.autograd.grad(loss, logp)
                ys.append(-float(grad))
            fig.add_scatter(x=ratios, y=ys, name=name, meta=f"A={a:+g}", row=1, col=col,
                            mode="lines", line=dict(color=color(i)), legendgroup=name,
                            showlegend=col == 1)
    fig.update_xaxes(title_text="ratio rho = pi / pi_old")
    fig.update_yaxes(title_text="weight on grad log pi", col=1)
    fig.update_layout(title="Policy-loss modes: how much one token learns at each ratio",
                      height=460)
    return fig


def kl_estimators(*, x_max: float = 2.0, points: int = 201) -> go.Figure:
    """k1, k2, k3 and abs per-token KL estimates against x = log(pi_ref / pi), from
    `losses.kl` (the "+" forms share their base kind's values)."""
    xs = torch.linspace(-x_max, x_max, points, dtype=torch.float64)
    logp = torch.zeros(1, points, dtype=torch.float64)
    fig = go.Figure()
    for i, kind in enumerate(losses.KL_VALUES):
        ys = losses.kl(logp, xs[None], kind)[0]
        fig.add_scatter(x=xs.tolist(), y=ys.tolist(), name=kind, mode="lines",
                        line=dict(color=color(i)))
    fig.update_layout(title="KL estimators against the log-ratio", height=420,
                      xaxis_title="x = log pi_ref - log pi (per sampled token)",
                      yaxis_title="estimate")
    return fig


# ------------------------------------------------------------------ training curves

def _points(records: Sequence[dict], key: str, x: str) -> tuple[list, list]:
    xs, ys = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and x in r:
            xs.append(r[x])
            ys.append(value)
    return xs, ys


def metric_lines(histories: Mapping[str, Sequence[dict]], keys: Sequence[str], *,
                 x: str = "step", cols: int = 2, title: str | None = None) -> go.Figure:
    """One subplot per metric key (a run's records lacking the key are skipped, so an eval
    metric shows its evaluation steps; `x`: "step" or "samples"). Runs named
    "<arm>/seed=<s>" are drawn per arm: the mean over its seeds with its 95% t band where
    every seed has the point, each run a thin line; other runs one line each."""
    rows = math.ceil(len(keys) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=list(keys),
                        vertical_spacing=0.12 if rows > 1 else 0.2)
    arms: dict[str, dict[str, Sequence[dict]]] = {}
    for name, records in histories.items():
        arms.setdefault(name.split("/seed=")[0], {})[name] = records
    for k, key in enumerate(keys):
        row, col = k // cols + 1, k % cols + 1
        for i, (arm, runs) in enumerate(arms.items()):
            if len(runs) > 1:
                _arm_band(fig, arm, runs, key, x, color(i), k == 0, row, col)
                continue
            ((name, records),) = runs.items()
            xs, ys = _points(records, key, x)
            sparse = len(xs) < len(records) or len(xs) <= 20  # eval steps, or few points
            fig.add_scatter(x=xs, y=ys, name=name, legendgroup=name, showlegend=k == 0,
                            mode="lines+markers" if sparse else "lines",
                            line=dict(color=color(i)), row=row, col=col)
        fig.update_xaxes(title_text=x, row=row, col=col)
    fig.update_layout(height=300 * rows + 80, title=title)
    return fig


def _arm_band(fig: go.Figure, arm: str, runs: Mapping[str, Sequence[dict]], key: str, x: str,
              shade: str, legend: bool, row: int, col: int) -> None:
    """An arm's runs as thin lines, then the band of the 95% t interval of their mean at
    each x every run has, then the mean itself."""
    points = {name: dict(zip(*_points(records, key, x))) for name, records in runs.items()}
    for name, at in points.items():
        fig.add_scatter(x=list(at), y=list(at.values()), name=name, legendgroup=arm,
                        showlegend=False, mode="lines", opacity=0.35,
                        line=dict(color=shade, width=0.7), hoverinfo="skip", row=row, col=col)
    shared = sorted(set.intersection(*(set(at) for at in points.values())))
    found = [stats.mean_interval([at[v] for at in points.values()]) for v in shared]
    if not shared:
        return
    fig.add_scatter(x=shared + shared[::-1], y=[f.high for f in found] + [f.low for f in
                                                                         found[::-1]],
                    fill="toself", fillcolor=shade, opacity=0.2, line=dict(width=0),
                    name=f"{arm}: 95% interval", legendgroup=arm, showlegend=False,
                    hoverinfo="skip", row=row, col=col)
    fig.add_scatter(x=shared, y=[f.mean for f in found], name=f"{arm} (mean of {len(runs)})",
                    legendgroup=arm, showlegend=legend,
                    mode="lines+markers" if len(shared) <= 20 else "lines",
                    line=dict(color=shade, width=2.5), row=row, col=col)


def sweep_lines(rows: Sequence[dict], keys: Sequence[str], *, x: str = "group_size",
                by: str = "budget", cols: int = 2, title: str | None = None) -> go.Figure:
    """Summary figures against `x` (log2 axis for G), one subplot per key, a line per `by`;
    runs at the same `x` (seeds) are averaged."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(str(row.get(by, "")), []).append(row)
    n_rows = math.ceil(len(keys) / cols)
    fig = make_subplots(rows=n_rows, cols=cols, subplot_titles=list(keys))
    for k, key in enumerate(keys):
        r, c = k // cols + 1, k % cols + 1
        for i, (name, members) in enumerate(groups.items()):
            at: dict = {}  # x -> the values of its runs (one per seed)
            for m in members:
                if key in m:
                    at.setdefault(m[x], []).append(m[key])
            xs = sorted(at)
            fig.add_scatter(x=xs, y=[sum(at[v]) / len(at[v]) for v in xs],
                            name=f"{by}: {name}", legendgroup=name, showlegend=k == 0,
                            mode="lines+markers", line=dict(color=color(i)), row=r, col=c)
        fig.update_xaxes(title_text=x, type="log", dtick=math.log10(2), row=r, col=c)
    fig.update_layout(height=300 * n_rows + 80, title=title)
    return fig


def sweep_curves(histories: Mapping[str, Sequence[dict]], key: str, *,
                 xs: Sequence[str] = ("step", "samples"), title: str | None = None) -> go.Figure:
    """`key` of a group-size sweep: a row of panels per x ("step", "samples"), a column per
    budget (the part of a run name before "/"), one line per run, colored by G (the seeds of
    a G share its color)."""
    budgets = list(dict.fromkeys(name.split("/")[0] for name in histories))
    sizes = sorted({r["group_size"] for rs in histories.values() for r in rs[:1]})
    fig = make_subplots(rows=len(xs), cols=len(budgets), shared_yaxes=True,
                        subplot_titles=[f"{key} vs {x}, equal {b}" for x in xs for b in budgets])
    shown: set[str] = set()  # one legend entry per G, whatever its seeds
    for row, x in enumerate(xs, start=1):
        for col, budget in enumerate(budgets, start=1):
            for name, records in histories.items():
                if name.split("/")[0] != budget or not records:
                    continue
                G = records[0]["group_size"]
                px, py = _points(records, key, x)
                first = row == 1 and col == 1 and f"G={G}" not in shown
                shown.add(f"G={G}")
                fig.add_scatter(x=px, y=py, name=f"G={G}", legendgroup=f"G={G}",
                                showlegend=first, mode="lines+markers",
                                line=dict(color=color(sizes.index(G))), row=row, col=col)
            fig.update_xaxes(title_text=x, row=row, col=col)
    fig.update_layout(height=300 * len(xs) + 80, title=title)
    return fig


VERDICT_COLORS = {"supported": "#2ca02c", "refuted": "#d62728",
                  "inconclusive at this budget": "#7f7f7f", "not testable here": "#bcbd22"}


def finding_intervals(rows: Sequence[dict], *, title: str | None = None) -> go.Figure:
    """One claim's findings (rows of `labkit.lab.findings.finding_row`), one panel each with
    its own scale (a claim may mix points, ratios and shares): the effect as a point with its
    95% interval, colored by verdict, and a dark tick at the threshold the claim needs it to
    clear. A finding without an interval (one seed) is a point; a ratio (an interval of log
    ratios) is drawn on a log axis, where 0.5 and 2 lie as far from 1."""
    from plotly.subplots import make_subplots

    rows = list(rows)
    titles = [_wrap(f"{r['question']}" + (f" ({r['run']})" if r["run"] != "seed=0" else "")
                    + f": {r['verdict']}") for r in rows]
    fig = make_subplots(rows=max(len(rows), 1), cols=1, subplot_titles=titles,
                        vertical_spacing=min(0.12, 0.6 / max(len(rows), 1)))
    for k, row in enumerate(rows, 1):
        has_interval = math.isfinite(row["low"])
        error = dict(type="data", symmetric=False, array=[row["high"] - row["mean"]],
                     arrayminus=[row["mean"] - row["low"]]) if has_interval else None
        fig.add_scatter(x=[row["mean"]], y=[0], error_x=error, mode="markers",
                        marker=dict(size=10, color=VERDICT_COLORS.get(row["verdict"], "#000")),
                        showlegend=False, row=k, col=1,
                        hovertext=f"{row['measure']}: {row['effect']}, {row['verdict']}")
        if row["threshold"] is not None:
            fig.add_scatter(x=[row["threshold"]], y=[0], mode="markers", row=k, col=1,
                            marker=dict(symbol="line-ns", size=22, line=dict(width=2),
                                        color="#444"), showlegend=False, hoverinfo="skip")
        ratio = "log ratio" in row.get("method", "") and row["mean"] > 0
        fig.update_xaxes(title_text=_wrap(row["measure"], 110), title_font_size=10,
                         type="log" if ratio else None, row=k, col=1)
        fig.update_yaxes(visible=False, row=k, col=1)
    fig.update_annotations(font_size=11)
    fig.update_layout(title=title, height=110 + 140 * len(rows), width=900,
                      margin=dict(l=30, r=30, t=90, b=30))
    return fig


def _wrap(text: str, width: int = 100) -> str:
    """`text` broken into lines of at most about `width` characters, joined by <br>."""
    lines, line = [], ""
    for word in str(text).split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "<br>".join(lines + [line] if line else lines)


class Table:
    """A list of dicts shown as an HTML table in a notebook, as markdown in text."""

    def __init__(self, rows: Sequence[dict], columns: Sequence[str] | None = None,
                 digits: int = 3):
        self.rows = list(rows)
        self.columns = list(columns) if columns else list(dict.fromkeys(
            k for row in self.rows for k in row))
        self.digits = digits

    def cell(self, value) -> str:
        if isinstance(value, float):
            return "nan" if not math.isfinite(value) else f"{value:.{self.digits}g}"
        return "" if value is None else str(value)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(self.cell(row.get(c)))}</td>"
                                        for c in self.columns) + "</tr>" for row in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def to_markdown(self) -> str:
        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(self.cell(row.get(c)) for c in self.columns) + " |"
                  for row in self.rows]
        return "\n".join(lines)

    _repr_markdown_ = to_markdown
    __str__ = to_markdown


def table(rows: Sequence[dict], columns: Sequence[str] | None = None, digits: int = 3) -> Table:
    return Table(rows, columns, digits)


# --- the rollout inspector (the view itself: `labkit.lab.token_view`) -----------------------

def rollouts(lines: Sequence[dict] | Mapping[str, Sequence[dict]],
             color: str = "advantage") -> RolloutView:
    """The kept groups of `labkit.probes.samples` (rollouts.jsonl lines), each completion with its
    reward and advantage and its tokens coloured by `color` (one of `COLORINGS`; the view
    switches between them), one column per step, or per key of a mapping of such lists."""
    if isinstance(lines, Mapping):
        columns = dict(lines)
    else:
        columns = {}
        for line in lines:
            columns.setdefault(f"step {line['step']}", []).append(line)
    return RolloutView(columns, color)
