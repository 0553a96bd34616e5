"""The early rates of a run's summary: the least-squares slope of a figure over the first
EARLY_STEPS steps, checked against numpy's fit."""

import numpy as np
import pytest

from labkit.lab.summaries import EARLY_STEPS, early_rate


def test_the_early_rate_is_the_least_squares_slope_over_the_first_steps():
    rng = np.random.default_rng(0)
    steps = np.arange(1, 41)
    values = 20 + 0.4 * np.minimum(steps, 15) + rng.normal(0, 0.3, steps.size)  # saturates
    history = [{"step": int(s), "rollout/length_mean": float(v)} for s, v in zip(steps, values)]
    history.insert(3, {"step": 4, "eval/accuracy": 0.5})  # a record without the figure
    next(r for r in history if r["step"] == 8)["rollout/length_mean"] = float("nan")
    keep = [(s, v) for s, v in zip(steps, values) if s <= EARLY_STEPS and s != 8]
    want = np.polyfit([s for s, _ in keep], [v for _, v in keep], 1)[0]
    assert early_rate(history, "rollout/length_mean") == pytest.approx(want, rel=1e-9)
    whole = np.polyfit(steps, values, 1)[0]
    assert abs(want - whole) > 0.1  # the window matters: the length saturates after step 15
    assert early_rate(history[:2], "rollout/length_mean") is None
    assert early_rate(history, "rollout/length_incorrect") is None


def test_written_steps_count_the_sums_before_the_box():
    from labkit.answers import written_steps
    from labkit.formulas.metrics import form_stats

    assert written_steps("3+4=7,7+5=12,12+1=13,\\boxed{13}") == 3
    assert written_steps("\\boxed{13}") == 0
    assert written_steps("3+4=7, so \\boxed{7} and 1+1=2") == 1  # after the box: not a step
    stats = form_stats(["3+4=7,7+5=12,\\boxed{12}", "\\boxed{12}"], [1.0, 1.0], [20, 5])
    assert stats["rollout/steps_mean"] == 1.0 and stats["rollout/worked_frac"] == 0.5
