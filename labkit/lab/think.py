"""Notebook 06: watch the model learn to think, and put its credit under the microscope.

On task=think the embedded tiny-arith-think either answers at once or works first, and working
is right more often on the harder sums (its model card). `LivePlot` is a training callback
around a 2x2 `go.FigureWidget` that grows each step: completion length (all, correct and
wrong completions), the share of completions that work, how often each form is right, and
the held-out accuracy at each evaluation. `train_live` runs one such training run;
`look_at_ppo` trains a short PPO run and looks at a batch through the credit microscope
(`labkit.probes.microscope.look`), which `microscope_figure` draws: each estimate's error
against the Monte Carlo one, token position by token position, and the critic's error after
each written step. `outputs` writes the notebook's summary.json and metrics.jsonl.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.formulas import stats
from labkit.lab.experiments import histories, run_config
from labkit.lab.findings import read_records
from labkit.lab.plots import TEMPLATE, color
from labkit.lab.summaries import flat_summary, summary_rows, write_outputs
from labkit.probes.microscope import CREDIT_FILE, Microscope, look, read_credit
from labkit.run import rundir
from labkit.trainer import RunResult, Trainer, train

PANELS = ("completion length, tokens", "share of completions that work first",
          "how often each form is right", "held-out accuracy (greedy)")
LINES = ((1, "all", "rollout/length_mean"), (1, "correct", "rollout/length_correct"),
         (1, "wrong", "rollout/length_incorrect"), (2, "worked", "rollout/worked_frac"),
         (3, "worked", "rollout/acc_worked"), (3, "direct", "rollout/acc_direct"),
         (4, "held out", "eval/accuracy"))
"""(panel, line, metric) of the live figure."""


class LivePlot:
    """A 2x2 `go.FigureWidget` that grows while a think run trains; pass it in `callbacks=`.
    A step without a metric (no direct answer left, no evaluation) adds no point to its
    line. `static()` returns a plain `go.Figure` copy for headless output."""

    def __init__(self, height: int = 620):
        fig = make_subplots(rows=2, cols=2, subplot_titles=PANELS, horizontal_spacing=0.1,
                            vertical_spacing=0.16)
        fig.update_layout(height=height, title="waiting for the first step", template=TEMPLATE)
        fig.update_xaxes(title_text="step")
        for row, col in ((1, 2), (2, 1), (2, 2)):
            fig.update_yaxes(range=[0, 1.02], row=row, col=col)
        self.widget = go.FigureWidget(fig)
        names = list(dict.fromkeys(name for _, name, _ in LINES))  # a name keeps its colour
        for panel, name, _ in LINES:
            self.widget.add_scatter(x=[], y=[], name=name, mode="lines+markers",
                                    line=dict(color=color(names.index(name)), width=1.5),
                                    marker=dict(size=3),
                                    legendgroup=name, showlegend=(panel, name) != (3, "worked"),
                                    row=(panel - 1) // 2 + 1, col=(panel - 1) % 2 + 1)

    def add(self, step: int, metrics: Mapping) -> None:
        """The points of one step's metrics."""
        with self.widget.batch_update():
            for trace, (_, _, key) in zip(self.widget.data, LINES):
                if isinstance(metrics.get(key), (int, float)):
                    trace.x = tuple(trace.x or ()) + (step,)
                    trace.y = tuple(trace.y or ()) + (metrics[key],)

    def __call__(self, report) -> None:
        if not any(trace.x for trace in self.widget.data) and report.config.run_dir:
            # the step-0 evaluation, which no StepReport carries, from the run's own record

            path = Path(report.config.run_dir) / "metrics.jsonl"
            first = [r for r in rundir.read_log(path) if r.get("step") == 0]
            if first:
                self.add(0, first[0])
        self.add(report.step, report.metrics)
        self.widget.layout.title.text = (f"{report.config.algo} on task=think: step "
                                         f"{report.step} of {report.config.steps}")

    def static(self) -> go.Figure:
        return go.Figure(self.widget.to_dict())


def train_live(live: LivePlot, *, run_dir: str | Path, algo: str = "grpo", seed: int = 0,
               **overrides) -> dict[str, RunResult]:
    """One run on task=think reporting every step to `live`. Writes `run_dir/<algo>/`."""
    config = run_config(Path(run_dir) / algo, algo=algo, seed=seed,
                        **{"task": "think", **overrides})
    return {algo: train(config, callbacks=[live])}


def look_at_ppo(*, run_dir: str | Path, seed: int = 0, prompts: int = 8, samples: int = 8,
                **overrides) -> tuple[RunResult, Microscope, object]:
    """A PPO run on task=think (its critic learns from `overrides["steps"]` steps), then one
    look through the credit microscope at its first `prompts` held-out problems, `samples`
    continuations per prefix; returns the run, the look and the tokenizer. Writes
    `run_dir/ppo-critic/`."""
    config = run_config(Path(run_dir) / "ppo-critic", algo="ppo", seed=seed,
                        **{"task": "think", **overrides})
    result = train(config)
    trainer, _ = Trainer.from_run(result.run_dir)
    found = look(trainer, trainer.problems.eval[:prompts], samples=samples, seed=seed)
    return result, found, trainer.tokenizer


def microscope_figure(found: Microscope, tokenizer) -> go.Figure:
    """Left: each estimate's mean absolute error against the Monte Carlo one by token
    position (the critic's V_t against V_MC; GAE's and GRPO's advantages against A_MC).
    Right: the critic's error just after each written step, with how many completions
    reached it."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        "error against Monte Carlo, by token position", "critic's error after each step"))
    for i, (name, errors) in enumerate(found.errors().items()):
        fig.add_scatter(x=list(range(len(errors))), y=errors.tolist(), name=name,
                        mode="lines+markers", line=dict(color=color(i)), row=1, col=1)
    steps = found.critic_error_at_steps(tokenizer)
    if steps:
        fig.add_bar(x=[f"step {k}" for k, _, _ in steps], y=[e for _, _, e in steps],
                    text=[f"{n} completions" for _, n, _ in steps], name="critic, at steps",
                    marker_color=color(1), row=1, col=2)
    fig.update_xaxes(title_text="token position t", row=1, col=1)
    fig.update_yaxes(title_text="mean |estimate - Monte Carlo|", row=1, col=1)
    fig.update_layout(template=TEMPLATE, height=420,
                      title=f"credit microscope: {found.mc.continuations} continuations, "
                            f"{found.mc.seconds:.1f} s")
    return fig


def outputs(run_dir: str | Path, results: Mapping[str, RunResult], found: Microscope,
            tokenizer, **params) -> dict:
    """summary.json (params, each run's summary row, the look's `credit/...` figures, as a
    run logs them) and metrics.jsonl; returns the summary."""
    summary = flat_summary(summary_rows(results), **params, **found.figures(tokenizer))
    write_outputs(run_dir, summary, histories(results))
    return summary


def credit_figure(root: str | Path, out: str | Path | None = None) -> go.Figure:
    """The last look through the credit microscope of every run under `root` that looked
    (credit.jsonl, `TrainConfig.credit_every`), averaged over the runs: each estimate's mean
    absolute error against the Monte Carlo one by token position (left) and the critic's
    error after each written step (right, a point per run); written as SVG to `out` when
    given (kaleido, the `figures` extra)."""
    import math

    records = [read_credit(path.parent)[-1] for path in sorted(Path(root).rglob(CREDIT_FILE))
             if read_credit(path.parent)]
    if not records:
        raise FileNotFoundError(f"no run under {root} wrote {CREDIT_FILE} (credit_every)")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        "error against Monte Carlo, by token position",
        "critic's error after each written step"))
    names = list(dict.fromkeys(k for r in records for k in r["by_position"]))
    for i, name in enumerate(names):
        rows = [r["by_position"][name] for r in records if name in r["by_position"]]
        width = max(map(len, rows))
        mean = []
        for t in range(width):
            got = [r[t] for r in rows if t < len(r) and r[t] is not None and math.isfinite(r[t])]
            mean.append(sum(got) / len(got) if got else None)
        fig.add_scatter(x=list(range(width)), y=mean, name=name, mode="lines+markers",
                        line=dict(color=color(i)), marker=dict(size=4), row=1, col=1)
    for j, record in enumerate(records):
        steps = record.get("critic_at_steps") or []
        fig.add_scatter(x=[f"step {k}" for k, _, _ in steps], y=[e for _, _, e in steps],
                        mode="markers+lines", name=f"run {j + 1}", showlegend=False,
                        line=dict(color=color(1), width=1), marker=dict(size=6), row=1, col=2)
    fig.update_xaxes(title_text="token position t", row=1, col=1)
    fig.update_yaxes(title_text="mean |estimate - Monte Carlo|", row=1, col=1)
    fig.update_layout(template=TEMPLATE, height=420, width=980,
                      title=f"credit microscope, {len(records)} runs at their last look")
    if out is not None:
        fig.write_image(str(out), format="svg")
    return fig


SIGNATURE = (("share of worked completions", "worked_start", "worked_final", 1.0, 3),
             ("mean completion length, tokens", "length_start", "length_final", 1.0, 1),
             ("held-out greedy accuracy, %", "accuracy_before", "accuracy_after", 100.0, 1))
"""(row, start figure, end figure, scale, digits) of the R1-Zero signature table."""


def signature(path: str | Path) -> str:
    """The R1-Zero signature of each arm of a claim sweep's per-seed record (a CSV under
    docs/findings/, `findings.write_records`): for the share of worked completions, the mean
    completion length and held-out accuracy, the mean at the start and at the end and the
    change within each run (end - start), a paired t interval over the seeds; as markdown."""
    records = read_records(path)
    lines = ["| arm | seeds | figure | start | end | change [95% CI] |", "|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in records):
        runs = [r for r in records if r["arm"] == arm]
        for name, first, last, scale, digits in SIGNATURE:
            pairs = [(scale * r[first], scale * r[last]) for r in runs
                     if first in r and last in r]
            if not pairs:
                continue
            starts, ends = [a for a, _ in pairs], [b for _, b in pairs]
            change = stats.paired_interval(ends, starts)
            lines.append(f"| {arm} | {len(pairs)} | {name} | "
                         f"{sum(starts) / len(starts):.{digits}f} | "
                         f"{sum(ends) / len(ends):.{digits}f} | {change.format(digits)} |")
    return "\n".join(lines) + "\n"


__all__ = ["LivePlot", "credit_figure", "look_at_ppo", "microscope_figure", "outputs",
           "signature", "train_live"]
