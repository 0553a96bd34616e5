"""labkit's GRPO against TRL's `GRPOTrainer` end to end: the same model, the same prompts at
every step, the same reward and matched settings, on several seeds; held-out greedy accuracy
along the way, measured by labkit's own evaluation on both sides (TRL's side from its saved
checkpoints), each point a mean over seeds with a 95% interval, and the paired difference
with a verdict on "the two stay within `margin` of each other".

    python -m labkit.bench.against_trl --seeds 3 --steps 100 --every 25 --out DIR

Settings that cannot match, and so differ on purpose (docs/variants.md says what each does):
- warmup: labkit's first step runs at lr / warmup_steps, Hugging Face's at 0;
- sampling: each side draws from its own random stream (same seed, other generators), so
  the runs of a seed see the same prompts but not the same completions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from labkit.formulas import stats
from labkit.model.models import load, resolve_model_path
from labkit.probes.evaluation import evaluate
from labkit.problems.rewards import correctness
from labkit.problems.source import ProblemSource
from labkit.settings.config import TrainConfig
from labkit.trainer import step_seed, train

MARGIN = 0.05
"""The claim each evaluation step is asked: labkit's accuracy is within this many (absolute)
of TRL's, by the paired interval over seeds."""


def run_config(seed: int, steps: int, every: int, eval_n: int, run_dir: str,
               **overrides) -> TrainConfig:
    """The default GRPO run, shortened to `steps`, evaluated every `every` steps (greedy
    accuracy only: TRL's checkpoints get the same measurement)."""
    return TrainConfig(seed=seed, steps=steps, eval_every=every, eval_n=eval_n,
                       eval_samples=0, cgc_prompts=0, progress=False, run_dir=run_dir,
                       **overrides)


def labkit_curve(config: TrainConfig) -> dict[int, float]:
    """Held-out accuracy by step of a labkit run of `config`."""
    result = train(config)
    return {r["step"]: r["eval/accuracy"] for r in result.history if "eval/accuracy" in r}


def trl_args(config: TrainConfig, out: str):
    """TRL's GRPOConfig for labkit's `config`: one generation batch of B x G completions per
    optimizer step, labkit's lr schedule (cosine to min_lr_ratio after warmup), clip range,
    KL coefficient, token-mean aggregation (TRL's dapo), per-group reward scaling, full
    softmax sampling at the same temperature, fp32, and a checkpoint every eval_every
    steps."""
    import trl

    if config.algo != "grpo" or config.estimator not in (None, "grpo"):
        raise ValueError("against_trl compares labkit's GRPO with the grpo estimator")
    if config.agg != "token-mean" or config.scale != "group":
        raise ValueError("against_trl matches agg='token-mean' (TRL's dapo) and "
                         "scale='group' only")
    return trl.GRPOConfig(
        output_dir=out, per_device_train_batch_size=config.rows,
        num_generations=config.group_size, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=config.num_iterations,
        max_completion_length=config.max_new_tokens, max_steps=config.steps,
        learning_rate=config.lr, warmup_steps=config.warmup_steps,
        lr_scheduler_type="cosine_with_min_lr" if config.schedule == "cosine" else
        "constant_with_warmup",
        lr_scheduler_kwargs={"min_lr_rate": config.min_lr_ratio}
        if config.schedule == "cosine" else {},
        weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm,
        beta=config.beta, epsilon=config.eps_low, epsilon_high=config.eps_high,
        loss_type="dapo", scale_rewards="group", temperature=config.temperature,
        top_k=config.top_k or 0, top_p=config.top_p, bf16=False, use_cpu=True,
        gradient_checkpointing=False, seed=config.seed, report_to="none",
        save_strategy="steps", save_steps=config.eval_every, save_only_model=True,
        logging_steps=config.eval_every, disable_tqdm=True, dataloader_num_workers=0,
        shuffle_dataset=False)


def trl_reward(eos_id: int, budget: int):
    """labkit's correctness reward for TRL, with labkit's rule for a completion cut at the
    budget (no EOS): it scores 0 (`TrainConfig.score_truncated` False)."""
    def reward(completions, completion_ids, answer, **_):
        scores = correctness(list(completions), answer=list(answer))
        return [0.0 if len(ids) >= budget and eos_id not in ids else float(s)
                for s, ids in zip(scores, completion_ids)]
    reward.__name__ = "correctness"
    return reward


def trl_curve(config: TrainConfig, out: str) -> dict[int, float]:
    """Held-out accuracy by step of TRL's GRPOTrainer on `config`'s prompts, steps and
    settings: the start model and each checkpoint evaluated by labkit."""
    import datasets
    import trl

    source = ProblemSource(config)
    # the prompts of labkit's step s, in order: TRL (no shuffle) takes B of them per step
    rows = [p for step in range(1, config.steps + 1) for p in source.draw(step_seed(config, step))]
    data = datasets.Dataset.from_dict({"prompt": [p.prompt for p in rows],
                                       "answer": [p.answer for p in rows]})
    model_path = resolve_model_path(config.model)
    _, tokenizer = load(model_path, device="cpu")
    trainer = trl.GRPOTrainer(model=model_path, args=trl_args(config, out),
                              reward_funcs=trl_reward(tokenizer.eos_token_id,
                                                      config.max_new_tokens),
                              train_dataset=data)
    trainer.train()

    def accuracy(path) -> float:
        model, tok = load(path, device="cpu")
        return evaluate(model, tok, source.eval, samples=0,
                        max_new_tokens=config.max_new_tokens)["eval/accuracy"]

    curve = {0: accuracy(model_path)}
    for step in range(config.eval_every, config.steps + 1, config.eval_every):
        curve[step] = accuracy(Path(out) / f"checkpoint-{step}")
    return curve


def compare(curves: dict[str, dict[int, dict[int, float]]], margin: float = MARGIN) -> list[dict]:
    """Per evaluation step: each side's mean accuracy over seeds with its 95% interval, the
    paired difference labkit - TRL, and the verdict on |difference| < margin. `curves`:
    {"labkit": {seed: {step: accuracy}}, "trl": {...}}."""
    seeds = sorted(curves["labkit"])
    steps = sorted(set.intersection(*(set(curves[side][s]) for side in curves for s in seeds)))
    rows = []
    for step in steps:
        ours = [curves["labkit"][s][step] for s in seeds]
        theirs = [curves["trl"][s][step] for s in seeds]
        diff = stats.paired_interval(ours, theirs)
        inside = stats.verdict(diff, above=-margin) == stats.SUPPORTED and \
            stats.verdict(diff, below=margin) == stats.SUPPORTED
        outside = diff.low >= margin or diff.high <= -margin
        rows.append({"step": step, "labkit": stats.mean_interval(ours).to_dict(),
                     "trl": stats.mean_interval(theirs).to_dict(), "difference": diff.to_dict(),
                     "question": f"labkit's accuracy within {margin:g} of TRL's",
                     "verdict": stats.SUPPORTED if inside else
                     stats.REFUTED if outside else stats.INCONCLUSIVE})
    return rows


def table(rows: list[dict]) -> str:
    """A markdown table of `compare`'s rows."""
    def fmt(d):
        return stats.Interval(**d).format(3)
    lines = ["| step | labkit | TRL | labkit - TRL | verdict |", "|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {fmt(r['labkit'])} | {fmt(r['trl'])} | {fmt(r['difference'])} "
              f"| {r['verdict']} |" for r in rows]
    return "\n".join(lines)


def figure(rows: list[dict], samples_per_step: int):
    """Both sides' held-out accuracy against the completions sampled so far: the mean over
    seeds with its 95% interval as error bars (a plotly Figure)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    xs = [r["step"] * samples_per_step for r in rows]
    for side, name in (("labkit", "labkit"), ("trl", "TRL GRPOTrainer")):
        mean = [r[side]["mean"] for r in rows]
        up = [r[side]["high"] - m if math.isfinite(r[side]["high"]) else 0.0
              for r, m in zip(rows, mean)]
        down = [m - r[side]["low"] if math.isfinite(r[side]["low"]) else 0.0
                for r, m in zip(rows, mean)]
        fig.add_trace(go.Scatter(x=xs, y=mean, name=name, mode="lines+markers",
                                 error_y=dict(type="data", symmetric=False, array=up,
                                              arrayminus=down)))
    n = rows[0]["labkit"]["n"] if rows else 0
    fig.update_layout(title=f"labkit against TRL, GRPO on the embedded task ({n} seeds, "
                            "95% intervals)", xaxis_title="completions sampled",
                      yaxis_title="held-out greedy accuracy", width=720, height=420)
    return fig


def write_figure(rows: list[dict], samples_per_step: int, path: str | Path) -> bool:
    """`figure` as a static SVG at `path` (kaleido through a local Chrome or Chromium);
    False, with a line on stderr, where it cannot export."""
    try:
        figure(rows, samples_per_step).write_image(str(path), format="svg")
    except Exception as e:  # noqa: BLE001 - no kaleido, or no browser for it
        print(f"note: no figure ({e}); install labkit[figures] for it", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.bench.against_trl",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--steps", type=int, default=100, help="steps of each run")
    parser.add_argument("--every", type=int, default=25, help="steps between evaluations")
    parser.add_argument("--eval-n", type=int, default=1000, help="held-out problems")
    parser.add_argument("--out", required=True, help="folder for the runs and summary.json")
    args = parser.parse_args(argv)
    if args.seeds < 2:
        parser.error("--seeds must be >= 2 (an interval needs two)")
    if args.steps < 1 or not 1 <= args.every <= args.steps or args.steps % args.every:
        parser.error("--every must divide --steps (both >= 1)")
    out = Path(args.out)
    curves: dict = {"labkit": {}, "trl": {}}
    for seed in range(args.seeds):
        config = run_config(seed, args.steps, args.every, args.eval_n,
                            str(out / f"labkit-seed{seed}"))
        curves["labkit"][seed] = labkit_curve(config)
        curves["trl"][seed] = trl_curve(replace(config, run_dir=None),
                                        str(out / f"trl-seed{seed}"))
        print(f"seed {seed}: labkit {curves['labkit'][seed]}, TRL {curves['trl'][seed]}",
              file=sys.stderr, flush=True)
    rows = compare(curves)
    (out / "summary.json").write_text(json.dumps({"curves": curves, "rows": rows}, indent=1))
    write_figure(rows, config.rows, out / "curves.svg")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
