"""Notebook 03's live figure: which baseline gives the cleaner gradient, and how that changes
as training proceeds.

`LivePlot` is a training callback around a 2x2 `go.FigureWidget`. Runs made with
`TrainConfig.diag_every` log the estimator diagnostics (`labkit.probes.diagnose`,
docs/diagnostics.md) on the steps they measure; the figure draws them against the step: the
baseline's mean squared error against V* and the gradient's relative variance (as trained),
one line per estimator and run (solid: the GRPO run, dotted: the PPO run, whose policy and
critic they measure). Two per-step panels follow: the mean reward of the step's samples
(is the run learning?) and GAV, which for the `grpo` estimator is about
(1 - frac_zero_std) * sqrt((G-1)/G): it counts the groups with mixed rewards, it does not
measure estimator noise.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.formulas.metric_table import DIAG_BASELINES, DIAG_GRADIENTS
from labkit.lab.plots import TEMPLATE, color
from labkit.probes.diagnose import read_diagnostics
from labkit.probes.estimator_quality import flat_metrics

PANELS = ("baseline MSE against V* (lower: closer)",
          "gradient relative variance (lower: cleaner)",
          "mean reward of the step's samples", "GAV: counts mixed groups, not noise")
_FIGURES = (("baseline_mse", DIAG_BASELINES), ("grad_rel_var", DIAG_GRADIENTS))


def run_label(config) -> str:
    """"ppo", or the GRPO estimator's name ("grpo", "dr_grpo", "rloo")."""
    return "ppo" if config.algo == "ppo" else config.estimator


def diag_points(record: dict) -> dict[tuple[str, str], float]:
    """(figure, estimator) -> value of the `diag/...` keys a metrics record holds."""
    return {(figure, name): record[f"diag/{figure}/{name}"]
            for figure, names in _FIGURES for name in names
            if f"diag/{figure}/{name}" in record}


class LivePlot:
    """A 2x2 `go.FigureWidget` that grows while training runs; pass it in `callbacks=`.

    Each `trainer.StepReport` adds a point per run to the reward and GAV panels and, on the
    steps the run measured (`diag/...` in its metrics), a point per estimator to the two
    diagnostic panels; a run's step-0 measurement is read from its diagnostics.jsonl at its
    first report. `static()` returns a plain `go.Figure` copy for headless output."""

    def __init__(self, height: int = 680):
        fig = make_subplots(rows=2, cols=2, subplot_titles=PANELS, horizontal_spacing=0.1,
                            vertical_spacing=0.16)
        fig.update_layout(height=height, title="waiting for the first step", template=TEMPLATE)
        fig.update_annotations(font_size=12)
        fig.update_xaxes(title_text="step")
        fig.update_yaxes(type="log", row=1)
        self.widget = go.FigureWidget(fig)
        self.reset()

    def reset(self) -> None:
        """Remove every trace (before a new pair of runs)."""
        self.widget.data = ()
        self._index: dict[tuple[int, str], int] = {}
        self._runs: list[str] = []

    def _extend(self, panel: int, name: str, x, y, **style) -> None:
        """Add the point (x, y) to the line `name` of `panel` (1..4), made on first use."""
        if (panel, name) not in self._index:
            shown = not any(n == name for _, n in self._index)
            self.widget.add_scatter(x=[], y=[], name=name, legendgroup=name, showlegend=shown,
                                    mode="lines+markers", row=(panel - 1) // 2 + 1,
                                    col=(panel - 1) % 2 + 1, **style)
            self._index[(panel, name)] = len(self.widget.data) - 1
        trace = self.widget.data[self._index[(panel, name)]]
        trace.x = tuple(trace.x or ()) + (x,)
        trace.y = tuple(trace.y or ()) + (y,)

    def _diagnostics(self, run: str, step: int, record: dict) -> None:
        dash = "dot" if run == "ppo" else "solid"
        for (figure, name), value in diag_points(record).items():
            panel = 1 if figure == "baseline_mse" else 2
            style = dict(line=dict(color=color(DIAG_GRADIENTS.index(name)), dash=dash),
                         marker=dict(size=6))
            self._extend(panel, f"{run} run: {name}", step, value, **style)

    def __call__(self, report) -> None:
        config, step, m = report.config, report.step, report.metrics
        run = run_label(config)
        with self.widget.batch_update():
            if run not in self._runs:
                self._runs.append(run)
                self._first_measurement(run, config)
            style = dict(line=dict(color=color(6 + self._runs.index(run)), width=1),
                         marker=dict(size=3))
            self._extend(3, f"{run} run", step, m["rollout/reward_mean"], **style)
            self._extend(4, f"{run} run", step, m["adv/gav"], **style)
            self._diagnostics(run, step, m)
            self.widget.layout.title.text = f"{run} run: step {step} of {config.steps}"

    def _first_measurement(self, run: str, config) -> None:
        """The step-0 diagnostics of a run, which no StepReport carries."""
        if not (config.diag_every and config.run_dir):
            return

        for record in read_diagnostics(config.run_dir):
            if record["step"] == 0:
                self._diagnostics(run, 0, flat_metrics(record))

    def static(self) -> go.Figure:
        """A plain figure with the current data (stays in a headless notebook's output)."""
        return go.Figure(self.widget.to_dict())


__all__ = ["PANELS", "LivePlot", "diag_points", "run_label"]
