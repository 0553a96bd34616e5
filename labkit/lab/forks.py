"""Forks from the lab's side: where to fork a run that went wrong (`where_to_fork`: the last
kept checkpoint before its first warning), and `python -m labkit fork`, which trains the
forks (labkit.fork) and says how the change did against the unchanged continuation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit import fork as forking
from labkit.formulas import stats, stats_design
from labkit.lab.experiments import parse_arms
from labkit.lab.plots import TEMPLATE, color
from labkit.lab.summaries import COLLAPSE_ACCURACY, COLLAPSE_TRUNCATED, collapse_step
from labkit.lab.verdicts import Finding, finding
from labkit.records import METRICS, STOPPED
from labkit.run import rundir, stops


def first_warning(run_dir: str | Path) -> tuple[int, str] | None:
    """The run's first warning, (step, why): a collapse (labkit.lab.summaries.collapse_step:
    completions truncated, accuracy below a tenth of its start, a dead spell) or a stop
    rule that ended it; None for a run with neither."""
    run_dir = Path(run_dir)
    history = rundir.read_log(run_dir / METRICS)
    start = next((r["eval/accuracy"] for r in history if "eval/accuracy" in r), math.nan)
    dead_file = run_dir / stops.DEAD_FILE
    dead = json.loads(dead_file.read_text()) if dead_file.is_file() else None
    found = []
    step = collapse_step(history, start, dead)
    if step is not None:
        record = next((r for r in history if r.get("step") == step), {})
        if record.get("rollout/truncated_frac", 0) >= COLLAPSE_TRUNCATED:
            why = (f"{record['rollout/truncated_frac']:.0%} of its completions hit the token "
                   "limit")
        elif record.get("eval/accuracy") is not None and \
                record["eval/accuracy"] < COLLAPSE_ACCURACY * start:
            why = (f"held-out accuracy {record['eval/accuracy']:.3f}, below a tenth of its "
                   f"start {start:.3f}")
        else:
            why = f"a dead spell began ({dead.get('reason', 'no signal') if dead else ''})"
        found.append((step, f"collapse: {why}"))
    if (run_dir / STOPPED).is_file():
        stopped = json.loads((run_dir / STOPPED).read_text())
        found.append((int(stopped["step"]), f"stopped: {stopped.get('message', '')}"))
    return min(found) if found else None


def where_to_fork(run_dir: str | Path) -> tuple[int, str]:
    """The step to fork a run from and why: its last kept checkpoint before its first
    warning. ValueError where it has no warning, or keeps no checkpoint before it."""
    warning = first_warning(run_dir)
    if warning is None:
        raise ValueError(f"--at auto: {run_dir} neither collapsed nor stopped; give --at STEP")
    step, why = warning
    kept = [s for s in rundir.kept_steps(run_dir) if s < step]
    if not kept:
        raise ValueError(f"--at auto: {run_dir}'s first warning is at step {step} ({why}) and "
                         "it keeps no checkpoint before it (train with checkpoint_every and "
                         "keep_every)")
    return kept[-1], f"the last kept checkpoint before its first warning, at step {step}: {why}"


def run_fork_command(args) -> int:
    """`python -m labkit fork RUN --at STEP|auto --set FIELD=VALUE ... [--seeds N]`."""
    changes = forking.parse_changes(args.set)
    at = args.at
    if at == "auto":
        at, why = where_to_fork(args.run)
        print(f"fork at step {at}: {why}")
    else:
        try:
            at = int(at)
        except ValueError:
            raise ValueError(f"--at {args.at!r} must be a step or auto") from None
    if args.seeds is None:
        result = forking.fork(args.run, at, changes, out=args.out, steps=args.steps)
        print(result.run_dir)
        print(f"accuracy after the fork: {result.accuracy_after:.3f}")
        return 0
    found = forking.continuations(args.run, at, changes, args.seeds, out=args.out,
                                  steps=args.steps)
    print("continuation  changed  unchanged")
    for c, changed, same in found:
        print(f"{c:>12}  {changed.accuracy_after:7.3f}  {same.accuracy_after:9.3f}")
    if len(found) > 1:
        diff = stats.paired_interval([a.accuracy_after for _, a, _ in found],
                                     [b.accuracy_after for _, _, b in found])
        print(f"changed - unchanged, final accuracy: {diff.format()} ({diff.method}; "
              "exploratory)")
    return 0


# --- notebook 07: collapse forensics -------------------------------------------------------

UNCHANGED = "unchanged"
"""The arm that continues with the parent's own settings, at the same continuation seeds."""


def stabilisers(config, text: str = "") -> dict[str, dict]:
    """The changes a fork of a run with `config` tries, name -> fields: `text` in notebook
    05's arm form ("kl: beta=0.1; one_pass: num_iterations=1"), or by default each stabiliser
    that applies to its algorithm: a KL penalty (GRPO, PPO: beta 0.1; DPO: its implicit KL
    stronger, dpo_beta 5x), the clip (GRPO, PPO: 0.2 / 0.28), one pass (where it takes
    more) and half the lr."""
    if text:
        return parse_arms(text, "stabilisers")
    out = {}
    if config.algo == "dpo":
        out["kl"] = {"dpo_beta": config.dpo_beta * 5}
    elif config.algo in ("grpo", "ppo"):
        out["kl"] = {"beta": 0.1}
        out["clip"] = {"eps_low": 0.2, "eps_high": 0.28}
    if config.num_iterations > 1:
        out["one_pass"] = {"num_iterations": 1}
    out["half_lr"] = {"lr": config.lr / 2}
    return out


def fork_step(run_dir: str | Path, at: str) -> tuple[int, str]:
    """The step to fork from: `at` as a number, or for 'auto' the last kept checkpoint before
    the run's first warning (`where_to_fork`), or, for a run with no warning, its middle kept
    checkpoint; with the reason in words."""
    if at != "auto":
        try:
            return int(at), "as asked"
        except ValueError:
            raise ValueError(f"at={at!r} must be a step or auto") from None
    if first_warning(run_dir) is not None:
        return where_to_fork(run_dir)
    kept = rundir.kept_steps(run_dir)[:-1] or rundir.kept_steps(run_dir)
    if not kept:
        raise ValueError(f"at=auto: {run_dir} keeps no checkpoint to fork from")
    return (kept[len(kept) // 2], "the run neither collapsed nor stopped: its middle kept "
            "checkpoint")


def forensics(parent: str | Path, at: int, arms: dict[str, dict], seeds: int, *,
              live=None) -> dict[str, list]:
    """Each arm's forks of `parent` from step `at` and the unchanged continuation, at
    continuation seeds 0..seeds-1 (paired: seed c draws the same stream in every arm), in
    <parent>-fork<at>/<arm>-c<c>; `live` (a ForkPlot) gets each finished run. Returns
    arm -> [RunResult per seed], the unchanged arm (UNCHANGED) first."""
    parent = Path(parent)
    out = parent.with_name(f"{parent.name}-fork{at}")
    every = {UNCHANGED: {}, **arms}
    for fields in every.values():  # every change checked before the first run
        forking.parse_changes([f"{k}={v}" for k, v in fields.items()])
    found: dict[str, list] = {arm: [] for arm in every}
    for c in range(seeds):
        for arm, fields in every.items():
            result = forking.fork(parent, at, fields, out=out / f"{arm}-c{c}",
                                  continuation_seed=c,
                                  callbacks=[live.following(arm)] if live is not None else ())
            found[arm].append(result)
            if live is not None:
                live.add(arm, result.history)
    return found


def _collapsed_after(before: list[dict], result, start: float, at: int) -> bool:
    """Whether a fork's run, its parent's records up to the fork then its own, collapsed
    after the fork step (labkit.lab.summaries.collapse_step)."""
    step = collapse_step(before + list(result.history), start, result.dead)
    return step is not None and step > at


def fork_findings(parent: str | Path, at: int, found: dict[str, list]) -> list:
    """For each stabiliser against the unchanged continuation, paired by continuation seed
    and Bonferroni over the stabilisers: does it rescue the run from step `at` (collapses
    on fewer seeds: the paired rate difference below 0, decided with McNemar's exact test,
    stats_design.decide_binary), and does it gain more held-out accuracy after the fork
    (paired t, points)? Exploratory: the parent's own seed chose the fork step."""
    history = rundir.read_log(Path(parent) / METRICS)
    before = [r for r in history if r.get("step", 0) <= at]
    start = next((r["eval/accuracy"] for r in history if "eval/accuracy" in r), math.nan)
    at_fork = [r["eval/accuracy"] for r in before if "eval/accuracy" in r][-1]
    arms = [a for a in found if a != UNCHANGED]
    confidence = 1 - 0.05 / max(len(arms), 1)
    base = found[UNCHANGED]
    out = []
    for arm in arms:
        runs = found[arm]
        pair = stats_design.paired_binary([_collapsed_after(before, r, start, at) for r in runs],
                                          [_collapsed_after(before, r, start, at) for r in base],
                                          confidence)
        verdict = stats_design.decide_binary(pair, "below")
        out.append(Finding(f"{arm} from step {at} rescues the run: it collapses on fewer "
                           "seeds than the unchanged continuation", "collapse rate, arm - "
                           "unchanged", pair.interval, 0.0, "below", verdict,
                           note=f"Bonferroni over {len(arms)} stabilisers; exploratory"))
        gain = stats.paired_interval([100 * (r.accuracy_after - at_fork) for r in runs],
                                     [100 * (r.accuracy_after - at_fork) for r in base],
                                     confidence)
        out.append(finding(f"{arm} gains more held-out accuracy after step {at} than the "
                           "unchanged continuation", "points", gain, above=0.0, digits=1,
                           note=f"Bonferroni over {len(arms)} stabilisers; exploratory"))
    return out


class ForkPlot:
    """Notebook 07's figure, a `go.FigureWidget` that grows as the forks finish: held-out
    accuracy and the step's mean reward against the step, the parent up to the fork step
    (grey, a dashed line at the fork), then each arm's continuations as their mean with a
    band from the lowest to the highest; the run now training is drawn step by step
    (`following`)."""

    PANELS = ("held-out accuracy", "mean reward of the step's samples")
    KEYS = ("eval/accuracy", "rollout/reward_mean")

    def __init__(self, parent_history: list[dict], at: int, height: int = 420):
        fig = make_subplots(rows=1, cols=2, subplot_titles=self.PANELS,
                            horizontal_spacing=0.1)
        fig.update_layout(height=height, template=TEMPLATE,
                          title=f"the parent to step {at}, then each arm's continuations")
        for col, key in enumerate(self.KEYS, 1):
            xs = [r["step"] for r in parent_history if key in r and r["step"] <= at]
            ys = [r[key] for r in parent_history if key in r and r["step"] <= at]
            fig.add_scatter(x=xs, y=ys, name="parent", line=dict(color="grey"),
                            showlegend=col == 1, row=1, col=col)
            fig.add_vline(x=at, line_dash="dash", line_color="grey", row=1, col=col)
        fig.update_xaxes(title_text="step")
        self.widget = go.FigureWidget(fig)
        self.runs: dict[str, list[list[dict]]] = {}

    def static(self) -> go.Figure:
        """A plain `go.Figure` copy (what report.html and a headless run keep)."""
        return go.Figure(self.widget)

    def following(self, arm: str):
        """A training callback drawing the run now training in `arm`, step by step, as a faint
        line in each panel (its arm's mean and band follow when it ends, `add`)."""
        index = list(self.runs).index(arm) if arm in self.runs else len(self.runs)
        first = len(self.widget.data)
        for col in (1, 2):
            self.widget.add_scatter(x=[], y=[], mode="lines", opacity=0.35, showlegend=False,
                                    line=dict(color=color(index), width=1),
                                    legendgroup=f"run|{arm}", row=1, col=col)
        traces = self.widget.data[first:first + 2]

        def draw(report) -> None:
            with self.widget.batch_update():
                for trace, key in zip(traces, self.KEYS):
                    if key in report.metrics:
                        trace.x = (*trace.x, report.step)
                        trace.y = (*trace.y, report.metrics[key])
        return draw

    def add(self, arm: str, history: list[dict]) -> None:
        """Draw `arm` again with one more finished continuation."""
        self.runs.setdefault(arm, []).append(list(history))
        index = list(self.runs).index(arm)
        with self.widget.batch_update():
            self.widget.data = [t for t in self.widget.data
                                if not (t.legendgroup or "").startswith(f"{arm}|")]
            for col, key in enumerate(self.KEYS, 1):
                steps = sorted({r["step"] for h in self.runs[arm] for r in h if key in r})
                at_step = [[r[key] for h in self.runs[arm] for r in h
                            if r["step"] == s and key in r] for s in steps]
                mean = [sum(v) / len(v) for v in at_step]
                group = f"{arm}|{key}"
                self.widget.add_scatter(x=steps + steps[::-1],
                                        y=[max(v) for v in at_step]
                                        + [min(v) for v in at_step][::-1],
                                        fill="toself", opacity=0.2, line=dict(width=0),
                                        fillcolor=color(index), legendgroup=group,
                                        showlegend=False, hoverinfo="skip", row=1, col=col)
                self.widget.add_scatter(x=steps, y=mean, name=arm, legendgroup=group,
                                        line=dict(color=color(index)),
                                        showlegend=col == 1, row=1, col=col)
