"""Notebook 06's live figure: one point per step per line, none for a metric the step
lacks, and the step-0 evaluation read from the run's own record."""

import plotly.graph_objects as go

from labkit.lab.think import LINES, LivePlot


def _y(live, panel, name):
    index = [(p, n) for p, n, _ in LINES].index((panel, name))
    return list(live.widget.data[index].y or ())


def test_each_line_takes_its_metric_and_skips_a_step_without_it():
    live = LivePlot()
    live.add(0, {"eval/accuracy": 0.7})
    live.add(1, {"rollout/length_mean": 24.0, "rollout/worked_frac": 0.6,
                 "rollout/acc_worked": 0.7, "rollout/acc_direct": 0.2,
                 "rollout/length_correct": 26.0, "rollout/length_incorrect": 20.0})
    live.add(2, {"rollout/length_mean": 28.0, "rollout/worked_frac": 1.0,
                 "rollout/acc_worked": 0.8, "eval/accuracy": 0.8})  # no direct answer left
    assert _y(live, 1, "all") == [24.0, 28.0] and _y(live, 1, "correct") == [26.0]
    assert _y(live, 2, "worked") == [0.6, 1.0] and _y(live, 3, "direct") == [0.2]
    assert _y(live, 4, "held out") == [0.7, 0.8]
    assert list(live.widget.data[-1].x) == [0, 2]
    assert isinstance(live.static(), go.Figure)


def test_the_first_report_draws_the_step_zero_evaluation_first(tmp_path):
    import json
    from types import SimpleNamespace

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.5}) + "\n")
    live = LivePlot()
    config = SimpleNamespace(run_dir=str(tmp_path), algo="grpo", steps=3)
    live(SimpleNamespace(step=1, metrics={"eval/accuracy": 0.6}, config=config))
    live(SimpleNamespace(step=2, metrics={"eval/accuracy": 0.7}, config=config))
    assert _y(live, 4, "held out") == [0.5, 0.6, 0.7]
    assert "step 2 of 3" in live.widget.layout.title.text


def test_the_signature_table_pairs_start_and_end_within_each_run(tmp_path):
    from labkit.formulas import stats
    from labkit.lab.findings import write_records
    from labkit.lab.think import signature

    records = [{"sweep_run": "seed=0", "arm": arm, "seed": s, "worked_start": 0.6,
                "worked_final": 0.6 + d, "length_start": 24.0, "length_final": 24.0 + 10 * d,
                "accuracy_before": 0.7, "accuracy_after": 0.7 + d / 2}
               for arm, ds in (("grpo", (0.3, 0.35, 0.4)), ("ppo", (0.0, 0.1, -0.1)))
               for s, d in enumerate(ds)]
    text = signature(write_records(records, tmp_path / "think.csv"))
    want = stats.paired_interval([0.9, 0.95, 1.0], [0.6] * 3).format(3)
    assert f"| grpo | 3 | share of worked completions | 0.600 | 0.950 | {want} |" in text
    length = stats.paired_interval([27.0, 27.5, 28.0], [24.0] * 3).format(1)
    assert f"| grpo | 3 | mean completion length, tokens | 24.0 | 27.5 | {length} |" in text
    assert "| ppo | 3 | held-out greedy accuracy, % | 70.0 | 70.0 |" in text


def test_a_line_name_keeps_its_colour_across_panels():
    live = LivePlot()
    colours = {}
    for trace in live.widget.data:
        colours.setdefault(trace.name, set()).add(trace.line.color)
    assert all(len(c) == 1 for c in colours.values()), colours
    assert len({next(iter(c)) for c in colours.values()}) == len(colours)


def test_the_credit_figure_averages_the_last_look_of_each_run(tmp_path):
    import json

    import pytest

    from labkit.lab.think import credit_figure

    for i, (a, b) in enumerate(((0.2, 0.4), (0.4, None))):
        run = tmp_path / f"ppo-seed{i}"
        run.mkdir()
        old = {"step": 50, "by_position": {"critic": [9.0, 9.0]}, "critic_at_steps": []}
        last = {"step": 100, "by_position": {"critic": [a, b], "grpo": [0.1, 0.1]},
                "critic_at_steps": [[1, 5, a], [2, 3, 0.5]]}
        (run / "credit.jsonl").write_text(json.dumps(old) + "\n" + json.dumps(last) + "\n")
    fig = credit_figure(tmp_path)
    critic = next(t for t in fig.data if t.name == "critic")
    assert list(critic.y) == pytest.approx([0.3, 0.4])  # position 1: the one run that has it
    assert len([t for t in fig.data if t.name and t.name.startswith("run ")]) == 2
    with pytest.raises(FileNotFoundError, match="credit_every"):
        credit_figure(tmp_path / "ppo-seed0" / "none")
