"""A sweep's comparison figure, comparison.html: each summary field against the grid's first
varying parameter, one line per value of the others, the mean over seeds with the spread of
its seeds (`labkit.lab.sweeps` writes it beside sweep.csv). `sweep` is a `sweeps.Sweep`,
`runs` its `sweeps.Run`s (unannotated: this module stands below `sweeps`, which calls it)."""

from __future__ import annotations

import statistics
from html import escape
from pathlib import Path

from labkit.lab.runner import finite_or_none, is_number, notebook_parameters


def _x_axis(sweep) -> tuple[str | None, list[str]]:
    """The parameter on the x axis (the grid's first varying one; None when only seeds vary)
    and the other varying grid parameters, which make one line each."""
    varying = [k for k, v in sweep.grid.items() if len(v) > 1]
    return (varying[0], varying[1:]) if varying else (None, [])


def _spread(values: list) -> tuple:
    """Mean, and the distances down to the min and up to the max, of the finite values."""
    values = [v for v in values if finite_or_none(v) is not None]
    if not values:
        return None, None, None
    mean = statistics.fmean(values)
    return mean, mean - min(values), max(values) - mean


def _summary_fields(sweep, finished) -> dict[str, list[str]]:
    """The numeric summary keys grouped by field ("grpo/accuracy_after" -> "accuracy_after"),
    without the fields named like a notebook parameter (they echo inputs)."""
    echoed = set(notebook_parameters(sweep.notebook))
    keys = [k for k in dict.fromkeys(k for r in finished for k in r.summary)
            if k.rsplit("/", 1)[-1] not in echoed
            and all(is_number(r.summary[k]) for r in finished if k in r.summary)]
    fields: dict[str, list[str]] = {}
    for key in keys:
        fields.setdefault(key.rsplit("/", 1)[-1], []).append(key)
    return fields


def _error_bars(stats: list[tuple]) -> dict:
    return dict(type="data", symmetric=False, arrayminus=[lo for _, lo, _ in stats],
                array=[hi for _, _, hi in stats])


def _prefix_points(fig, name: str, members: list[str], finished) -> None:
    """Only seeds vary: one marker per key prefix, the mean over seeds with min/max bars."""
    import plotly.graph_objects as go

    xs = [k.rsplit("/", 1)[0] if "/" in k else k for k in members]
    stats = [_spread([r.summary[k] for r in finished if k in r.summary]) for k in members]
    fig.add_trace(go.Scatter(x=xs, y=[m for m, _, _ in stats], mode="markers", name=name,
                             error_y=_error_bars(stats)))
    fig.update_xaxes(type="category")


def _grid_lines(fig, name: str, members: list[str], finished, x_name: str,
                others: list[str]) -> None:
    """A varying grid parameter on the x axis: a line per key prefix and setting of the other
    varying parameters, the mean over seeds with min/max bars at each x."""
    import plotly.graph_objects as go

    for key in members:
        prefix = [key.rsplit("/", 1)[0]] if "/" in key else []
        lines: dict[str, dict] = {}
        for run in finished:
            if key in run.summary:
                label = ", ".join(prefix + [f"{k}={run.values[k]}" for k in others])
                lines.setdefault(label or name, {}).setdefault(
                    run.values[x_name], []).append(run.summary[key])
        for label, points in lines.items():
            stats = [_spread(v) for v in points.values()]
            fig.add_trace(go.Scatter(x=list(points), y=[m for m, _, _ in stats], name=label,
                                     mode="lines+markers", error_y=_error_bars(stats)))


def write_comparison(sweep, runs, path: Path) -> Path:
    """comparison.html: a figure per numeric summary field, the mean over seeds with min/max
    error bars. Keys "<prefix>/<field>" (e.g. "grpo/accuracy_after") share the field's figure.
    With a varying grid parameter it is the x axis and each prefix and setting of the other
    varying parameters is a line; with only seeds varying the prefixes are the x axis.
    Fields named like a notebook parameter (steps, grpo/group_size) echo inputs: left out."""
    import plotly.graph_objects as go
    import plotly.io as pio

    x_name, others = _x_axis(sweep)
    finished = [r for r in runs if r.summary]
    figures = []
    for name, members in _summary_fields(sweep, finished).items():
        fig = go.Figure()
        if x_name is None:
            _prefix_points(fig, name, members, finished)
        else:
            _grid_lines(fig, name, members, finished, x_name, others)
            if any(isinstance(v, str) for v in sweep.grid[x_name]):
                fig.update_xaxes(type="category")
        fig.update_layout(title=name, xaxis_title=x_name or "run", yaxis_title=name, height=380,
                          showlegend=len(fig.data) > 1, margin=dict(t=50, b=40))
        figures.append(fig)
    seeds = f"mean over seeds {sweep.seeds}, bars from min to max" if len(sweep.seeds) > 1 \
        else f"seed {sweep.seeds[0]}"
    body = "".join(pio.to_html(fig, full_html=False, include_plotlyjs=i == 0,
                               include_mathjax=False) for i, fig in enumerate(figures))
    if not figures:
        body = "<p>No run has written a numeric summary yet.</p>"
    fixed = escape(", ".join(f"{k}={v}" for k, v in sweep.parameters.items()))
    path.write_text(f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{sweep.name}"
                    f"</title></head><body><h1>{sweep.name}</h1><p>{sweep.notebook.name}; "
                    f"{fixed}; {seeds}</p>{body}</body></html>\n", encoding="utf-8")
    return path
