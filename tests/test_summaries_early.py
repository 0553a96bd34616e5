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
