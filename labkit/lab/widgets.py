"""Notebook 03's controls: ipywidgets that re-run the live comparison with new values."""

from __future__ import annotations

from pathlib import Path

from labkit.formulas.estimators import ESTIMATORS
from labkit.lab.experiments import live_training
from labkit.lab.summaries import live_outputs


def live_controls(live, *, run_dir: str | Path, estimator: str, group_size: int, steps: int,
                  **overrides):
    """ipywidgets: estimator and G dropdowns, a steps slider and a Run button that clears
    `live`, re-runs `live_training` with the chosen values and rewrites the outputs."""
    import ipywidgets as w

    critic_free = tuple(n for n in ESTIMATORS if "values" not in ESTIMATORS.needs(n))
    est = w.Dropdown(options=critic_free, value=estimator, description="estimator")
    sizes = sorted({2, 4, 8, 16, group_size})
    G = w.Dropdown(options=sizes, value=group_size, description="G")
    n = w.IntSlider(value=steps, min=1, max=max(200, steps), description="steps")
    button, status = w.Button(description="Run", button_style="primary"), w.Label()

    def run(_) -> None:
        button.disabled, status.value = True, "running"
        try:
            live.reset()
            params = dict(estimator=est.value, group_size=G.value, steps=n.value)
            results = live_training(live, run_dir=run_dir, **params, **overrides)
            summary = live_outputs(run_dir, results, **params, **overrides)
            status.value = summary["description"][:160]
        except Exception as e:  # shown next to the button, not lost in the kernel log
            status.value = f"failed: {type(e).__name__}: {e}"[:160]
            raise
        finally:
            button.disabled = False

    button.on_click(run)
    return w.VBox([w.HBox([est, G, n, button]), status])
