"""What the notebooks call: run directories, experiment runs, summaries and their outputs.

A notebook stays thin: it sets its parameters, calls one function here per experiment
(`compare`, `group_size_runs`, `live_training`), shows `labkit.lab.plots` figures of the runs'
histories and ends with `write_outputs`, which leaves `summary.json` (a flat dict of numbers
and short strings) and `metrics.jsonl` (every step record of every run, tagged with `run`)
in the notebook's run directory. Each training run writes its own folder inside it.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path

import torch

from labkit import advantages as adv
from labkit import losses, rundir
from labkit.config import TrainConfig
from labkit.tasks import ArithmeticTask, Problem
from labkit.trainer import RunResult, StepReport, train

BUDGETS = ("samples", "prompts", "both")  # B*G fixed / B fixed / the two sweeps
NOTEBOOK_DEFAULTS = dict(progress=False)  # no progress bars in notebook outputs


# ------------------------------------------------------------------ run directories

def setup(threads: int = 1) -> None:
    """Torch on `threads` CPU threads (the embedded model's 128-wide matrices are too small
    to share; on a busy machine extra threads mostly wait, several times slower), and no
    transformers progress bars (widgets in every cell that loads or saves a model)."""
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()


def project_root(start: str | Path | None = None) -> Path:
    """The nearest folder at or above `start` (default: the cwd) holding a labkit checkout
    (pyproject.toml next to labkit/), else the cwd itself. Notebooks run from notebooks/
    therefore write to the checkout's experiments/runs/, never into notebooks/."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "labkit").is_dir():
            return folder
    return here


def resolve_run_dir(run_dir: str, stem: str) -> Path:
    """The notebook's output folder: `run_dir` when given (created if missing), else a new
    `experiments/runs/<stem>/<date-time>-<pid>` under the project root."""
    if run_dir:
        path = Path(run_dir).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        return path
    return rundir.new_run_dir(stem, root=project_root() / rundir.RUNS_ROOT)


def fresh_dir(path: str | Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... when it already holds files (a re-run)."""
    path = Path(path)
    candidate, k = path, 1
    while candidate.exists() and any(candidate.iterdir()):
        k += 1
        candidate = path.with_name(f"{path.name}-{k}")
    return candidate


def parse_list(text: str, kind: type = str) -> list:
    """"grpo,ppo" -> ["grpo", "ppo"]; "2,4,8" with kind=int -> [2, 4, 8]."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise ValueError(f"expected a comma-separated list, got {text!r}")
    try:
        return [kind(item) for item in items]
    except ValueError as e:
        raise ValueError(f"every item of {text!r} must be a {kind.__name__}") from e


# ------------------------------------------------------------------ 00: building blocks

def problem(expression: str) -> Problem:
    """The arithmetic problem of an expression like "37+85" or a prompt like "37+85="
    (evaluated left to right); its prompt is the task's, "37+85=" for the embedded model."""
    match = re.fullmatch(r"\s*(\d+(?:\s*[-+*]\s*\d+)+)\s*=?\s*", expression)
    if not match:
        raise ValueError(f"expression must look like '37+85' (numbers joined by + - *), "
                         f"got {expression!r}")
    tokens = re.findall(r"\d+|[-+*]", match.group(1))
    numbers, ops = [int(t) for t in tokens[::2]], tokens[1::2]
    task = ArithmeticTask(digits=max(len(str(n)) for n in numbers), operands=len(numbers),
                          ops="".join(sorted(set(ops))))
    return task.make(numbers, ops)


def ppo_row_advantages(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
                       lam: float = 0.95, whiten: bool = True) -> torch.Tensor:
    """PPO's advantage before its critic learns (V = 0, the zero head of `ValueModel`):
    GAE on the token rewards, whitened over the tokens, then each row's mean -> (N,)."""
    token_rewards = losses.ppo_token_rewards(rewards, mask)  # (N, T)
    a, _ = adv.ppo_advantages(token_rewards, torch.zeros_like(token_rewards), mask,
                              gamma=gamma, lam=lam, whiten_advantages=whiten)
    m = mask.bool()
    return torch.where(m, a, 0.0).sum(1) / m.sum(1).clamp(min=1)  # (N,)


def figure_records(fig, prefix: str) -> list[dict]:
    """One metrics.jsonl line per trace of a figure: its name and its x and y values."""
    out = []
    for trace in fig.data:
        if trace.name and trace.y is not None and len(trace.y):
            quantity = "/".join(str(p) for p in (prefix, trace.meta, trace.name) if p)
            out.append({"quantity": quantity, "x": list(trace.x),
                        "y": [float(v) for v in trace.y]})
    return out


def group_summary(problem: Problem, rewards: torch.Tensor,
                  table: Mapping[str, torch.Tensor]) -> dict:
    """summary.json of one group: the problem, its rewards, each estimator's advantage std."""
    r = rewards.float()
    out = {"prompt": problem.prompt, "answer": problem.answer, "group_size": len(r),
           "reward_mean": r.mean().item(), "correct": int(r.sum().item()),
           "mixed_group": int(r.min().item() != r.max().item())}
    stds = {f"adv_std/{name}": a.float().std(correction=0).item() for name, a in table.items()}
    return out | stds


# ------------------------------------------------------------------ training runs

def run_config(run_dir: str | Path, **values) -> TrainConfig:
    """A TrainConfig writing to a fresh `run_dir`, with the notebook defaults."""
    return TrainConfig(run_dir=str(fresh_dir(run_dir)), **{**NOTEBOOK_DEFAULTS, **values})


def compare(algos: Iterable[str], *, run_dir: str | Path, seed: int = 0,
            callbacks: Sequence[Callable[[StepReport], None]] = (),
            **overrides) -> dict[str, RunResult]:
    """Train each algorithm with the same config and seed, one after the other.

    The same seed draws the same B prompts at every step for every algorithm, and both
    sample B x G completions a step (PPO samples G per prompt too), so the runs see the same
    prompts with the same sample budget. Each run writes `run_dir/<algo>/`.
    """
    results = {}
    for algo in algos:
        config = run_config(Path(run_dir) / algo, algo=algo, seed=seed, **overrides)
        results[algo] = train(config, callbacks=callbacks)
    return results


def batch_prompts_for(budget: str, group_size: int, samples_per_step: int,
                      group_sizes: Sequence[int]) -> int:
    """B for one run of the sweep: samples_per_step / G ("samples"), or the same B for every G,
    samples_per_step / max(G), so the largest group samples samples_per_step ("prompts")."""
    if budget == "samples":
        if samples_per_step % group_size:
            raise ValueError(f"samples_per_step={samples_per_step} must be a multiple of every "
                             f"G for an equal sample budget; G={group_size} does not divide it")
        return samples_per_step // group_size
    if budget == "prompts":
        if samples_per_step < max(group_sizes):
            raise ValueError(f"samples_per_step={samples_per_step} must be >= the largest G "
                             f"({max(group_sizes)}) to give every run at least one prompt")
        return samples_per_step // max(group_sizes)
    raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")


def group_size_runs(group_sizes: Sequence[int], budget: str, samples_per_step: int, *,
                    run_dir: str | Path, seed: int = 0, **overrides) -> dict[str, RunResult]:
    """GRPO at each G, at an equal sample budget, an equal prompt count, or both.

    Run names are "<budget>/G=<G>" (e.g. "samples/G=4"); each writes `run_dir/<budget>-G<G>/`.
    """
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
    if any(g < 2 for g in group_sizes):
        raise ValueError("GRPO needs every group size >= 2 to compare completions, got "
                         f"{list(group_sizes)}")
    results = {}
    for b in (("samples", "prompts") if budget == "both" else (budget,)):
        for G in group_sizes:
            B = batch_prompts_for(b, G, samples_per_step, group_sizes)
            config = run_config(Path(run_dir) / f"{b}-G{G}", algo="grpo", seed=seed,
                                group_size=G, batch_prompts=B, **overrides)
            results[f"{b}/G={G}"] = train(config)
    return results


def live_training(live: Callable[[StepReport], None], *, run_dir: str | Path,
                  estimator: str = "grpo", seed: int = 0, **overrides) -> dict[str, RunResult]:
    """A GRPO run with `estimator`, then a PPO run of the same seed (same prompts each step),
    both reporting every step to `live` (a `plots.LivePlot`); evaluation only before the first
    and after the last step. Runs write `run_dir/<estimator>[-k]/` and `run_dir/ppo[-k]/`."""
    steps = overrides.get("steps", TrainConfig.steps)
    shared = dict(seed=seed, eval_every=steps, **overrides)
    grpo = run_config(Path(run_dir) / estimator, algo="grpo", estimator=estimator, **shared)
    ppo = run_config(Path(run_dir) / "ppo", algo="ppo", **shared)
    return {estimator: train(grpo, callbacks=[live]), "ppo": train(ppo, callbacks=[live])}


def histories(results: Mapping[str, RunResult]) -> dict[str, list[dict]]:
    """Each run's step records tagged with `run`, its B and G, and `samples`, the
    completions sampled up to and including that step (B*G per step)."""
    out = {}
    for name, result in results.items():
        c = result.config
        tags = {"run": name, "algo": c.algo, "group_size": c.group_size,
                "batch_prompts": c.batch_prompts}
        out[name] = [{**tags, "samples": r["step"] * c.rows, **r} for r in result.history]
    return out


# ------------------------------------------------------------------ summaries

def _values(history: Sequence[dict], key: str, first: int = 1) -> list[float]:
    """The finite values of `key` in the records from step `first` on."""
    return [r[key] for r in history if r.get("step", 0) >= first
            and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@lru_cache(maxsize=8)
def _parameter_counts(model: str | None) -> tuple[int, int, int]:
    """(policy parameters, backbone parameters, hidden size) of a model."""
    from labkit.models import load

    policy, _ = load(model, device="cpu", dtype="fp32")
    backbone = sum(p.numel() for p in policy.base_model.parameters())
    return sum(p.numel() for p in policy.parameters()), backbone, policy.config.hidden_size


def state_mb(config: TrainConfig) -> float:
    """Training state in MiB at fp32: the policy with its gradients and two AdamW moments
    (4 copies), the frozen reference when beta > 0 (1 copy), and PPO's critic, a backbone
    copy with a value head (4 copies). Activations are not counted; on a GPU
    `perf/mem_mb` measures everything."""
    policy, backbone, hidden = _parameter_counts(config.model)
    floats = 4 * policy + (policy if config.beta > 0 else 0)
    if config.algo == "ppo":
        floats += 4 * (backbone + hidden + 1)
    return floats * 4 / 2**20


def summary_rows(results: Mapping[str, RunResult]) -> list[dict]:
    """One row per run: accuracy before/after, final reward, cost, and the mean over steps
    of KL, entropy, clip fractions, GAV and the advantage variance (missing keys left out)."""
    rows = []
    for name, result in results.items():
        h, c = result.history, result.config
        rewards = _values(h, "rollout/reward_mean")
        tail = rewards[-max(1, len(rewards) // 5):]
        row = {"run": name, "algo": c.algo, "group_size": c.group_size,
               "batch_prompts": c.batch_prompts, "steps": result.steps,
               "accuracy_before": result.accuracy_before, "accuracy_after": result.accuracy_after,
               "final_reward": _mean(tail), "step_s": statistics.median(_values(h, "perf/step_s")),
               "mem_mb": max(_values(h, "perf/mem_mb")), "state_mb": state_mb(c),
               "wall_s": result.wall_s}
        means = {"kl": "policy/kl", "entropy": "policy/entropy", "clip_low": "clip/low",
                 "clip_high": "clip/high", "gav": "adv/gav",
                 "frac_zero_std": "rollout/frac_zero_std"}
        row |= {k: _mean(_values(h, key)) for k, key in means.items()}
        row["adv_var"] = _mean([s * s for s in _values(h, "adv/std")])
        rows.append({k: v for k, v in row.items() if v is not None})
    return rows


def sweep_rows(results: Mapping[str, RunResult]) -> list[dict]:
    """`summary_rows` of a group-size sweep, with each run's budget (its name's prefix)."""
    return [{"budget": row["run"].split("/")[0], **row} for row in summary_rows(results)]


def flat_summary(rows: Sequence[dict], **extra) -> dict:
    """summary.json's dict: `extra` first, then "<run>/<field>" for every number of every row."""
    out = dict(extra)
    for row in rows:
        for key, value in row.items():
            if key != "run" and isinstance(value, (int, float)) and math.isfinite(value):
                out[f"{row['run']}/{key}"] = round(value, 6) if isinstance(value, float) else value
    return out


def _se(p: float, n: int) -> float:
    """Binomial standard error of an accuracy p measured on n problems."""
    return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


def describe(rows: Sequence[dict], eval_n: int) -> str:
    """A sentence from the numbers: who ended with the higher held-out accuracy, by how much
    against the noise of `eval_n` problems, and at what cost per step and in state memory."""
    if not rows:
        return "No run finished."
    ranked = sorted(rows, key=lambda r: r["accuracy_after"], reverse=True)
    a = ranked[0]
    text = (f"{a['run']} went from held-out accuracy {a['accuracy_before']:.2f} to "
            f"{a['accuracy_after']:.2f} in {a['steps']} steps of {a['batch_prompts']}x"
            f"{a['group_size']} samples at {a['step_s']:.3f} s a step")
    if len(ranked) == 1:
        return text + "."
    b = ranked[-1]
    diff = a["accuracy_after"] - b["accuracy_after"]
    se = math.hypot(_se(a["accuracy_after"], eval_n), _se(b["accuracy_after"], eval_n))
    verdict = "beyond" if diff > 2 * se else "within"
    return (f"{text}; {b['run']} went from {b['accuracy_before']:.2f} to "
            f"{b['accuracy_after']:.2f} at {b['step_s']:.3f} s a step. The gap of {diff:.2f} is "
            f"{verdict} two standard errors ({2 * se:.2f}) of {eval_n} held-out problems. "
            f"{_cost(a, b)}")


def _cost(a: dict, b: dict) -> str:
    """How much longer the slower run's step took, and how much larger its training state."""
    slow, fast = (a, b) if a["step_s"] >= b["step_s"] else (b, a)
    big, small = (a, b) if a["state_mb"] >= b["state_mb"] else (b, a)
    return (f"A {slow['run']} step took {slow['step_s'] / fast['step_s']:.2f}x as long as a "
            f"{fast['run']} step ({slow['step_s']:.3f} vs {fast['step_s']:.3f} s), and the "
            f"{big['run']} training state {big['state_mb'] / small['state_mb']:.2f}x the memory "
            f"of the {small['run']} one ({big['state_mb']:.1f} vs {small['state_mb']:.1f} MiB).")


def describe_sweep(rows: Sequence[dict], eval_n: int) -> str:
    """A sentence per budget of a group-size sweep: the best G, how the zero-std fraction
    and the step time move from the smallest to the largest G."""
    sentences = []
    for budget in dict.fromkeys(r["run"].split("/")[0] for r in rows):
        members = sorted((r for r in rows if r["run"].startswith(budget + "/")),
                         key=lambda r: r["group_size"])
        best = max(members, key=lambda r: r["accuracy_after"])
        lo, hi = members[0], members[-1]
        accuracies = [r["accuracy_after"] for r in members]
        spread = max(accuracies) - min(accuracies)
        sentences.append(
            f"At an equal {'sample budget' if budget == 'samples' else 'prompt count'}, "
            f"G={best['group_size']} ended highest ({best['accuracy_after']:.2f}; the spread "
            f"over G is {spread:.2f} against a standard error of about "
            f"{_se(best['accuracy_after'], eval_n):.2f} per run); from G={lo['group_size']} to "
            f"G={hi['group_size']} the zero-std fraction went from {lo['frac_zero_std']:.2f} "
            f"to {hi['frac_zero_std']:.2f} and a step from {lo['step_s']:.3f} s to "
            f"{hi['step_s']:.3f} s.")
    return " ".join(sentences)


# ------------------------------------------------------------------ outputs

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


# ------------------------------------------------------------------ 03: controls

def live_outputs(run_dir: str | Path, results: Mapping[str, RunResult], **params) -> dict:
    """summary.json (params, every run's summary row, the sentence) and metrics.jsonl of a
    live session; returns the summary."""
    rows = summary_rows(results)
    summary = flat_summary(rows, **params, description=describe(rows, params.get("eval_n", 0)))
    write_outputs(run_dir, summary, histories(results))
    return summary


def live_controls(live, *, run_dir: str | Path, estimator: str, group_size: int, steps: int,
                  **overrides):
    """ipywidgets: estimator and G dropdowns, a steps slider and a Run button that clears
    `live`, re-runs `live_training` with the chosen values and rewrites the outputs."""
    import ipywidgets as w

    est = w.Dropdown(options=tuple(adv.ESTIMATORS), value=estimator, description="estimator")
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
