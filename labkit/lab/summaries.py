"""What a notebook reports: one row per run, the sentence that reads the rows, and the
`summary.json` + `metrics.jsonl` pair it leaves in its run directory."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

from labkit.formulas import stats
from labkit.lab import confirm
from labkit.lab.experiments import histories
from labkit.lab.verdicts import by_arm
from labkit.model.models import load
from labkit.run import rundir
from labkit.settings.config import TrainConfig
from labkit.trainer import RunResult


def _values(history: Sequence[dict], key: str, first: int = 1) -> list[float]:
    """The finite values of `key` in the records from step `first` on."""
    return [r[key] for r in history if r.get("step", 0) >= first
            and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@lru_cache(maxsize=8)
def _parameter_counts(model: str | None) -> tuple[int, int, int]:
    """(policy parameters, backbone parameters, hidden size) of a model."""
    policy, _ = load(model, device="cpu", dtype="fp32")
    backbone = sum(p.numel() for p in policy.base_model.parameters())
    return sum(p.numel() for p in policy.parameters()), backbone, policy.config.hidden_size


def state_mb(config: TrainConfig) -> float:
    """Training state in MiB at fp32: the policy with its gradients and two AdamW moments
    (4 copies), the frozen reference when beta > 0 or for DPO (1 copy; none under LoRA,
    whose reference is the policy with adapters off), and PPO's critic, a backbone
    copy with a value head (4 copies). Activations are not counted; on a GPU
    `perf/mem_mb` measures everything."""
    policy, backbone, hidden = _parameter_counts(config.model)
    floats = 4 * policy + (policy if config.has_reference else 0)
    if config.algo == "ppo":
        floats += 4 * (backbone + hidden + 1)
    return floats * 4 / 2**20


COLLAPSE_TRUNCATED = 0.9
"""A run has collapsed at the first step where this share of its completions hit
max_new_tokens without EOS (it lost the EOS token)..."""
COLLAPSE_ACCURACY = 0.1
"""... or at the first evaluation whose held-out accuracy is below this fraction of the
accuracy before training (accuracy -> 0), or where it was found dead."""


def collapse_step(history: Sequence[dict], accuracy_before: float,
                  dead: dict | None = None) -> int | None:
    """The step at which a run collapsed (COLLAPSE_TRUNCATED, COLLAPSE_ACCURACY), or None.
    A dead run (`dead`, labkit.run.stops.Dead.to_dict()) whose completions were truncated or all
    scored 0 collapsed where its dead spell began, if nothing above came first (a run dead
    because every completion scored alike and well has solved its task)."""
    found = []
    for record in history:
        step = record.get("step", 0)
        truncated = record.get("rollout/truncated_frac")
        accuracy = record.get("eval/accuracy")
        if isinstance(truncated, (int, float)) and truncated >= COLLAPSE_TRUNCATED:
            found.append(step)
        if step > 0 and isinstance(accuracy, (int, float)) \
                and accuracy < COLLAPSE_ACCURACY * accuracy_before:
            found.append(step)
    if dead is not None and (dead.get("truncated") or dead.get("reward_mean") == 0):
        found.append(dead["first"])
    return min(found) if found else None


def accuracy_auc(history: Sequence[dict]) -> float | None:
    """The area under the held-out accuracy curve over the run, as a mean accuracy: the
    trapezoids between evaluations (`eval/accuracy` at their steps) over the steps they
    span. Beside the final gain it tells a run that learned early from one that learned at
    the end; None with fewer than two evaluations."""
    points = [(r["step"], r["eval/accuracy"]) for r in history
              if isinstance(r.get("eval/accuracy"), (int, float)) and "step" in r]
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return None
    area = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in zip(points, points[1:]))
    return area / (points[-1][0] - points[0][0])


EARLY_STEPS = 20
"""The window of the early rates (`early_rate`): a policy's length moves in its first steps and
then saturates (on task=think every arm ends fully worked within 100 steps), so a rate read
here can differ where final lengths cannot."""


def early_rate(history: list[dict], key: str, steps: int = EARLY_STEPS) -> float | None:
    """The least-squares slope of `key` against the step over the run's first `steps` steps
    (per step); None with fewer than 3 steps that log it."""
    points = [(r["step"], r[key]) for r in history
              if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
              and "step" in r and r["step"] <= steps]
    if len(points) < 3:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


def summary_rows(results: Mapping[str, RunResult]) -> list[dict]:
    """One row per run (its `arm`, the name without "/seed=s", its `seed` and its config's
    `fingerprint`, labkit.lab.confirm): accuracy
    before/after and their difference (`gain`), final reward, cost, the mean over steps of
    KL, entropy, clip fractions, GAV, DPO's cosine to GRPO's gradient (`grpo_cosine`, with
    dpo_grpo_cosine) and completion length (`length`; `length_final` over
    the last fifth of the steps, `length_start` the first step's; missing keys left out),
    on an arithmetic task the share of worked completions (`worked_start`, the first
    step's; `worked_final`, over the last fifth) and the length of the right and of the wrong
    completions over the last fifth (`length_correct_final`, `length_incorrect_final`), the area under the held-out
    accuracy curve (`accuracy_auc`), whether the run was found dead
    (`dead_run` 1 or 0; the early slopes of the mean length, of all completions and of the
    wrong ones, and of the mean number of written steps, over the first EARLY_STEPS steps
    (`length_rate_early`, `length_incorrect_rate_early`, tokens per step;
    `steps_rate_early`), with the written steps' first and last-fifth means (`steps_start`,
    `steps_final`); `dead_step`, the step it was found) and whether it collapsed
    (`collapsed` 1 or 0; `collapse_step`, see `collapse_step`); for a run that measured
    diagnostics, its last measurement (`diag_step`, and each `diag/a/b` as `diag.a.b`); for a
    run that looked through the credit microscope, its last look (`credit_step`, and each
    `credit/x` as `credit.x`)."""
    rows = []
    for name, result in results.items():
        h, c = result.history, result.config
        rewards = _values(h, "rollout/reward_mean")
        tail = rewards[-max(1, len(rewards) // 5):]
        row = {"run": name, "arm": name.split("/seed=")[0], "seed": c.seed, "algo": c.algo,
               "group_size": c.group_size, "batch_prompts": c.batch_prompts,
               "steps": result.steps, "eval_n": c.eval_n,
               "accuracy_before": result.accuracy_before, "accuracy_after": result.accuracy_after,
               "gain": result.accuracy_after - result.accuracy_before,
               "final_reward": _mean(tail), "step_s": statistics.median(_values(h, "perf/step_s")),
               "mem_mb": max(_values(h, "perf/mem_mb")), "state_mb": state_mb(c),
               "wall_s": result.wall_s, "fingerprint": confirm.fingerprint(c)}
        peaks = _values(h, "perf/tensor_peak_mb")  # none when tensor_peak_step = 0
        if peaks:
            row["tensor_peak_mb"] = max(peaks)
        means = {"kl": "policy/kl", "kl_k1": "policy/kl_k1", "entropy": "policy/entropy",
                 "clip_low": "clip/low", "clip_high": "clip/high", "clip_total": "clip/total",
                 "reuse_clip_total": "reuse/clip_total", "gav": "adv/gav",
                 "frac_zero_std": "rollout/frac_zero_std", "length": "rollout/length_mean",
                 "grpo_cosine": "dpo/grpo_cosine"}
        row |= {k: _mean(_values(h, key)) for k, key in means.items()}
        lengths = _values(h, "rollout/length_mean")
        row["length_final"] = _mean(lengths[-max(1, len(lengths) // 5):])
        if lengths:
            row["length_start"] = lengths[0]
        for name, key in (("length_rate_early", "rollout/length_mean"),
                          ("length_incorrect_rate_early", "rollout/length_incorrect"),
                          ("steps_rate_early", "rollout/steps_mean")):
            rate = early_rate(h, key)
            if rate is not None:
                row[name] = rate
        for name, key in (("length_correct_final", "rollout/length_correct"),
                          ("length_incorrect_final", "rollout/length_incorrect")):
            values = _values(h, key)
            if values:
                row[name] = _mean(values[-max(1, len(values) // 5):])
        steps = _values(h, "rollout/steps_mean")
        if steps:
            row["steps_start"] = steps[0]
            row["steps_final"] = _mean(steps[-max(1, len(steps) // 5):])
        worked = _values(h, "rollout/worked_frac")
        if worked:
            row["worked_start"] = worked[0]
            row["worked_final"] = _mean(worked[-max(1, len(worked) // 5):])
        row["accuracy_auc"] = accuracy_auc(h)
        row["dead_run"] = int(result.dead is not None)
        if result.dead is not None:
            row["dead_step"] = result.dead["step"]
        collapsed = collapse_step(h, result.accuracy_before, result.dead)
        row["collapsed"] = int(collapsed is not None)
        if collapsed is not None:
            row["collapse_step"] = collapsed
        looked = [r for r in h if "credit/grpo_err" in r]
        if looked:  # the last look through the credit microscope, as credit.<figure>
            row["credit_step"] = looked[-1]["step"]
            row |= {"credit." + k.removeprefix("credit/"): v for k, v in looked[-1].items()
                    if k.startswith("credit/")}
        measured = [r for r in h if "diag/v_star_mean" in r]
        if measured:  # the last diagnostics, as diag.<figure>.<row> (no '/': a summary key)
            row["diag_step"] = measured[-1]["step"]
            row |= {"diag." + k.removeprefix("diag/").replace("/", "."): v
                    for k, v in measured[-1].items() if k.startswith("diag/")}
        rows.append({k: v for k, v in row.items() if v is not None})
    return rows


def sweep_rows(results: Mapping[str, RunResult]) -> list[dict]:
    """`summary_rows` of a group-size sweep, with each run's budget (its name's prefix) and
    `adv_var`, the mean over steps of the advantages' variance: comparable across the G of
    one estimator, not across estimators that normalise differently (PPO whitens to 1)."""
    return [{"budget": name.split("/")[0], **row,
             "adv_var": _mean([s * s for s in _values(results[name].history, "adv/std")])}
            for name, row in zip(results, summary_rows(results))]


def flat_summary(rows: Sequence[dict], **extra) -> dict:
    """summary.json's dict: `extra` first, then "<run>/<field>" for every number of every row,
    and each run's configuration `fingerprint` (text)."""
    out = dict(extra)
    for row in rows:
        for key, value in row.items():
            if key == "fingerprint" and isinstance(value, str):
                out[f"{row['run']}/{key}"] = value
            elif key != "run" and isinstance(value, (int, float)) and math.isfinite(value):
                out[f"{row['run']}/{key}"] = round(value, 6) if isinstance(value, float) else value
    return out


def _se(p: float, n: int) -> float:
    """Binomial standard error of an accuracy p measured on n problems."""
    return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


def _arm_means(rows: Sequence[dict]) -> list[dict]:
    """One row per arm (a row's `arm`, else its `run`): the mean over its seeds of accuracy
    before and after, step time, state memory, the tensors' peak and zero-std fraction, and
    `seeds`, how many."""
    out = []
    arms = by_arm([{"arm": row["run"], "seed": 0} | row for row in rows])
    for arm, seeds in arms.items():
        members = list(seeds.values())
        mean = {k: statistics.fmean(r[k] for r in members)
                for k in ("accuracy_before", "accuracy_after", "step_s", "state_mb",
                          "tensor_peak_mb", "frac_zero_std") if all(k in r for r in members)}
        out.append({**members[0], **mean, "run": arm, "seeds": len(members)})
    return out


def describe(rows: Sequence[dict], eval_n: int) -> str:
    """A sentence from the numbers: each arm's held-out accuracy before and after (the mean
    over its seeds), and what its step and training state cost. With one seed per arm it
    also says whether the gap is beyond two binomial standard errors of `eval_n` problems,
    which says nothing of the spread over seeds: the verdicts over seeds are
    `labkit.lab.verdicts`'."""
    if not rows:
        return "No run finished."
    ranked = sorted(_arm_means(rows), key=lambda r: r["accuracy_after"], reverse=True)
    a = ranked[0]
    seeds = f" (means over {a['seeds']} seeds)" if a["seeds"] > 1 else ""
    text = (f"{a['run']} went from held-out accuracy {a['accuracy_before']:.2f} to "
            f"{a['accuracy_after']:.2f}{seeds} in {a['steps']} steps of {a['batch_prompts']}x"
            f"{a['group_size']} samples at {a['step_s']:.3f} s a step")
    if len(ranked) == 1:
        return text + "."
    b = ranked[-1]
    text += (f"; {b['run']} went from {b['accuracy_before']:.2f} to "
             f"{b['accuracy_after']:.2f} at {b['step_s']:.3f} s a step.")
    if max(r["seeds"] for r in ranked) == 1:
        diff = a["accuracy_after"] - b["accuracy_after"]
        se = math.hypot(_se(a["accuracy_after"], eval_n), _se(b["accuracy_after"], eval_n))
        where = "beyond" if diff > 2 * se else "within"
        text += (f" With one seed each, the gap of {diff:.2f} is {where} two standard errors "
                 f"({2 * se:.2f}) of {eval_n} held-out problems, and says nothing of how it "
                 "varies over seeds.")
    return f"{text} {_cost(a, b)}"


def _cost(a: dict, b: dict) -> str:
    """How much longer the slower run's step took, and how much more memory the larger run's
    tensors held at their peak (its training state alone, without the peak: older runs)."""
    slow, fast = (a, b) if a["step_s"] >= b["step_s"] else (b, a)
    text = (f"A {slow['run']} step took {slow['step_s'] / fast['step_s']:.2f}x as long as a "
            f"{fast['run']} step ({slow['step_s']:.3f} vs {fast['step_s']:.3f} s), and ")
    if "tensor_peak_mb" in a and "tensor_peak_mb" in b:
        big, small = (a, b) if a["tensor_peak_mb"] >= b["tensor_peak_mb"] else (b, a)
        return text + (
            f"the {big['run']} run's tensors peaked at "
            f"{big['tensor_peak_mb'] / small['tensor_peak_mb']:.2f}x the {small['run']} run's "
            f"({big['tensor_peak_mb']:.1f} vs {small['tensor_peak_mb']:.1f} MiB, of which "
            f"training state {big['state_mb']:.1f} vs {small['state_mb']:.1f}).")
    big, small = (a, b) if a["state_mb"] >= b["state_mb"] else (b, a)
    return text + (f"the {big['run']} training state {big['state_mb'] / small['state_mb']:.2f}x "
                   f"the memory of the {small['run']} one ({big['state_mb']:.1f} vs "
                   f"{small['state_mb']:.1f} MiB).")


def describe_sweep(rows: Sequence[dict], eval_n: int) -> str:
    """A sentence per budget of a group-size sweep: the best G, how the zero-std fraction
    and the step time move from the smallest to the largest G (means over seeds; the
    verdicts over seeds are `labkit.lab.verdicts.group_size_findings`')."""
    sentences, rows = [], _arm_means(rows)
    per = f"means over {rows[0]['seeds']} seeds; " if rows and rows[0]["seeds"] > 1 else ""
    for budget in dict.fromkeys(r["run"].split("/")[0] for r in rows):
        members = sorted((r for r in rows if r["run"].startswith(budget + "/")),
                         key=lambda r: r["group_size"])
        best = max(members, key=lambda r: r["accuracy_after"])
        lo, hi = members[0], members[-1]
        accuracies = [r["accuracy_after"] for r in members]
        spread = max(accuracies) - min(accuracies)
        sentences.append(
            f"At an equal {'sample budget' if budget == 'samples' else 'prompt count'}, "
            f"G={best['group_size']} ended highest ({per}{best['accuracy_after']:.2f}; the spread "
            f"over G is {spread:.2f} against a standard error of about "
            f"{_se(best['accuracy_after'], eval_n):.2f} per run); from G={lo['group_size']} to "
            f"G={hi['group_size']} the zero-std fraction went from {lo['frac_zero_std']:.2f} "
            f"to {hi['frac_zero_std']:.2f} and a step from {lo['step_s']:.3f} s to "
            f"{hi['step_s']:.3f} s.")
    return " ".join(sentences)


def _finite(value):
    """JSON-safe: non-finite floats become None (strict JSON has no NaN)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_outputs(run_dir: str | Path, summary: Mapping,
                  records: Mapping[str, Sequence[dict]] | Sequence[dict]) -> tuple[Path, Path]:
    """Write `metrics.jsonl` (runs' records one after the other), then `summary.json`, into
    `run_dir`; returns their paths. A re-run in the same notebook overwrites both.

    summary.json is what marks a sweep's run complete, so it comes last and atomically: a
    notebook killed while writing leaves no summary, and the sweep runs it again."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [r for rs in records.values() for r in rs] if isinstance(records, Mapping) \
        else list(records)
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    metrics_path.write_text("".join(json.dumps({k: _finite(v) for k, v in r.items()}) + "\n"
                                    for r in lines), encoding="utf-8")
    rundir.write_json(summary_path, {k: _finite(v) for k, v in summary.items()})
    return summary_path, metrics_path


def final_diagnostics(results: Mapping[str, RunResult]) -> dict:
    """The last measurement of each run's diagnostics as stable keys: `baseline_mse/<e>` and
    `grad_rel_var/<e>` (as trained) for the group estimators and `none` from the GRPO-family
    run, for `ppo_critic` (and `ppo_gae`, gradient only) from the PPO run, with `diag_step`,
    the step of that measurement. Runs without diagnostics add nothing."""
    out = {}
    for result in results.values():
        critic = result.config.algo == "ppo"
        measured = [r for r in result.history if "diag/v_star_mean" in r]
        if not measured:
            continue
        last = measured[-1]
        out["diag_step"] = last["step"]
        for key, value in last.items():
            figure, _, name = key.removeprefix("diag/").partition("/")
            if figure in ("baseline_mse", "grad_rel_var") and name.startswith("ppo_") == critic:
                out[f"{figure}/{name}"] = value
    return out


def describe_diagnostics(figures: Mapping[str, float]) -> str:
    """A sentence from `final_diagnostics`: the estimators with the lowest and highest
    gradient relative variance, and the closest baseline, at the last measurement."""
    noise = {k.split("/", 1)[1]: v for k, v in figures.items() if k.startswith("grad_rel_var/")}
    error = {k.split("/", 1)[1]: v for k, v in figures.items() if k.startswith("baseline_mse/")}
    if not noise or not error:
        return ""
    clean, noisy = min(noise, key=noise.get), max(noise, key=noise.get)
    close = min(error, key=error.get)
    return (f"At step {figures['diag_step']} the cleanest gradient came from {clean} (relative "
            f"variance {noise[clean]:.3g}), the noisiest from {noisy} ({noise[noisy]:.3g}); the "
            f"closest baseline was {close} (MSE {error[close]:.3g} against V*).")


def live_outputs(run_dir: str | Path, results: Mapping[str, RunResult], **params) -> dict:
    """summary.json (params, every run's summary row, the final diagnostics of
    `final_diagnostics`, the sentence) and metrics.jsonl of a live session; returns the
    summary."""
    rows, figures = summary_rows(results), final_diagnostics(results)
    text = f"{describe(rows, params.get('eval_n', 0))} {describe_diagnostics(figures)}".strip()
    summary = flat_summary(rows, **params, **figures, description=text)
    write_outputs(run_dir, summary, histories(results))
    return summary


def arms_table(summary: Mapping) -> str:
    """A markdown table of notebook 05's summary.json (`summary`): per arm, the held-out
    accuracy after training and its gain, each the mean over the arm's seeds with its 95%
    t interval, the seeds whose run collapsed (of how many), and the finding against the
    baseline (paired difference of gains, verdict)."""
    runs: dict[str, dict[str, dict]] = {}
    for key, value in summary.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[1].startswith("seed="):
            runs.setdefault(parts[0], {}).setdefault(parts[1], {})[parts[2]] = value
    findings = {}
    for k in range(1, len(summary)):
        question = summary.get(f"finding{k}/question")
        if question is None:
            break
        arm = question.split(" gains more")[0]
        low, high = summary[f"finding{k}/low"], summary[f"finding{k}/high"]
        findings[arm] = (f"{summary[f'finding{k}/mean']:+.1f} [{low:+.1f}, {high:+.1f}]",
                         summary[f"finding{k}/verdict"])
    lines = ["| arm | accuracy after | gain (points) | collapsed | gain - baseline's (points) "
             "| verdict |", "|---|---|---|---|---|---|"]
    for arm, seeds in runs.items():
        after = stats.mean_interval([s["accuracy_after"] for s in seeds.values()])
        gain = stats.mean_interval([100 * s["gain"] for s in seeds.values()])
        collapsed = sum(int(bool(s.get("collapsed", 0))) for s in seeds.values())
        diff, verdict = findings.get(arm, ("(baseline)", ""))
        lines.append(f"| {arm} | {after.format(3)} | {gain.format(1)} | {collapsed}/{len(seeds)} "
                     f"| {diff} | {verdict} |")
    return "\n".join(lines)
