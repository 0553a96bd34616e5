"""The bench's report: the measurements summed up as ratios against their targets (the JSON
summary), and the table printed above it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from labkit.formulas.stats import Interval, geometric_interval, verdict
from labkit.model import learner

TARGETS = {"trl_step_ratio_tiny": ("<=", 0.6), "trl_step_ratio_small": ("<=", 0.4),
           "floor_multiple_small": ("<=", 1.25), "rollout_speedup_small": (">=", 2.0),
           "grpo_ppo_memory_ratio": ("<=", 0.6)}
"""The figure each target reads and its bound: labkit's GRPO step at most 0.6x TRL's on the
embedded model and 0.4x on the small one, the small step within 1.25x of its own floor
(where the floor was measured), the rollout at least 2x `model.generate`'s tokens/s, GRPO's
peak memory at most 0.6x PPO's. `targets_met` reads each figure of one run against its
bound; `targets_verdict` reads the 95% interval over the run's rounds (the step ratios and
the floor multiple), and `pool` the interval over several runs."""


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def slope(xs, ys) -> float:
    """The least-squares slope of ys against xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def summarize(results: dict, *, params: int, device: str, precision: dict, args) -> dict:
    """The JSON summary of every measurement (`results`: the workers' outputs by name;
    `precision`: each config's, {"tiny": ..., "small": ...})."""
    import torch

    step = {k: median(v["step_s"]) for k, v in results.items()
            if k.startswith(("labkit_", "trl_"))}
    roll = results["rollout"]
    tok_s = {name: roll["tokens"] / median(s) for name, s in roll["seconds"].items()}
    # the tensors' peak where the worker measured it; the process's growth as context
    mem = {algo: _tensors(results[f"memory_{algo}"]) for algo in ("grpo", "ppo")}
    rss = {algo: results[f"memory_{algo}"]["peak_growth_mb"] for algo in ("grpo", "ppo")}
    summary = {
        "trl_step_ratio_tiny": step["labkit_tiny"] / step["trl_tiny"],
        "trl_step_ratio_small": step["labkit_small"] / step["trl_small"],
        "rollout_speedup_small": tok_s["labkit"] / tok_s["generate"],
        "grpo_ppo_memory_ratio": mem["grpo"] / mem["ppo"],
        "labkit_step_s_tiny": step["labkit_tiny"], "trl_step_s_tiny": step["trl_tiny"],
        "labkit_step_s_small": step["labkit_small"], "trl_step_s_small": step["trl_small"],
        "labkit_rollout_s_small": median(results["labkit_small"]["rollout_s"]),
        "labkit_update_s_small": median(results["labkit_small"]["update_s"]),
        "rollout_tokens_per_s_labkit": tok_s["labkit"],
        "rollout_tokens_per_s_generate": tok_s["generate"],
        "rollout_identical": roll["identical"],
        "grpo_peak_mb": mem["grpo"], "ppo_peak_mb": mem["ppo"],
        "grpo_process_growth_mb": rss["grpo"], "ppo_process_growth_mb": rss["ppo"],
        "memory_same_completions": results["memory_grpo"]["completions"] ==
        results["memory_ppo"]["completions"],
        "memory_tokens_per_step": results["memory_grpo"]["tokens"],
        "memory_lr": results["memory_grpo"]["lr"],
        **_lora_figures(results),
        "precision": precision["small"], "precision_tiny": precision["tiny"],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_native": learner.cpu_bf16_native(), "gradient_checkpointing": False,
        "device": device,
        "small_params": params, "steps_timed": args.steps, "warmup": args.warmup,
        "rounds": args.rounds, "mode": "quick" if getattr(args, "quick", False) else "full",
        "beta": args.beta, "torch_threads": _threads(), "decode_kernels": kernels_status(),
    }
    for label in ("tiny", "small"):
        summary |= _floor_figures(results[f"labkit_{label}"], label, step[f"labkit_{label}"],
                                  step[f"trl_{label}"])
    for label in ("tiny", "small"):
        summary |= _round_figures(results.get(f"rounds_{label}"), label)
    if results.get("scaling"):
        summary |= _scaling_figures(results["scaling"])
        summary["consistency"] = consistency(summary["labkit_step_s_small"],
                                             results["scaling"],
                                             **results.get("scaling_shape", {}))
    summary["targets_met"] = {key: meets(summary[key], key) for key in TARGETS if key in summary}
    # unequal work is no comparison: the memory target needs the same completions both sides
    summary["targets_met"]["grpo_ppo_memory_ratio"] &= summary["memory_same_completions"]
    summary["targets_verdict"] = {key: target_verdict(Interval(**summary[f"{key}_interval"]),
                                                      key)
                                  for key in TARGETS if f"{key}_interval" in summary}
    return summary


def meets(value: float, key: str) -> bool:
    """Whether one value of figure `key` lies on its target's side (`TARGETS`)."""
    op, bound = TARGETS[key]
    return value <= bound if op == "<=" else value >= bound


def target_verdict(interval: Interval, key: str) -> str:
    """`labkit.formulas.stats.verdict` of an interval of figure `key` against its target: supported
    when the whole interval meets it."""
    op, bound = TARGETS[key]
    return verdict(interval, below=bound) if op == "<=" else verdict(interval, above=bound)


def _tensors(measured: dict) -> float:
    """A memory worker's figure: its tensors' peak, or for a summary written before the
    workers measured it, the process's growth."""
    value = measured.get("tensor_peak_mb")
    return measured["peak_growth_mb"] if value is None else value


def _lora_figures(results: dict) -> dict:
    """The LoRA memory row, if measured: peak growth with LoRA / with full fine-tuning."""
    if "memory_lora" not in results:
        return {}
    lora, full = (_tensors(results[f"memory_{k}"]) for k in ("lora", "full"))
    return {"lora_full_memory_ratio": lora / full, "lora_peak_mb": lora, "full_peak_mb": full,
            "lora_same_completions": results["memory_lora"]["completions"] ==
            results["memory_full"]["completions"]}


AGREE = 0.25
"""The comparison's small step and the scaling table's point of the same shape must agree
within this share; more says the machine was busy during one of them."""


def consistency(step_s: float, points: list[dict], group_size: int = 8,
                max_new_tokens: int = 64) -> dict:
    """The comparison's labkit step on the small config against the scaling table's points
    of the same shape (its G on the group axis, its completion length on the length axis):
    {"comparison_step_s", "scaling_step_s", "disagreement" (largest |a/b - 1|), "agree"};
    None where the table has no such point."""
    same = [p["step_s"] for p in points
            if (p["axis"] == "group_size" and p["value"] == group_size)
            or (p["axis"] == "max_new_tokens" and p["value"] == max_new_tokens)]
    if not same:
        return {"comparison_step_s": step_s, "scaling_step_s": [], "disagreement": None,
                "agree": None}
    worst = max(abs(x / step_s - 1) for x in same)
    return {"comparison_step_s": step_s, "scaling_step_s": same, "disagreement": worst,
            "agree": worst <= AGREE}


STABLE = 0.05
"""A median over the first k rounds is stable when it and every later running median lie
within this share of the median over all rounds."""


def rounds_to_stable(ratios: list[float]) -> int:
    """The fewest leading rounds whose running median of `ratios` stays within STABLE of the
    median over all of them from there on (len(ratios) when only the last one does)."""
    final = median(ratios)
    close = [abs(median(ratios[:k]) / final - 1) <= STABLE for k in range(1, len(ratios) + 1)]
    k = len(ratios)
    while k > 1 and close[k - 2]:
        k -= 1
    return k


def _round_figures(rounds: list[dict] | None, label: str) -> dict:
    """Each round's labkit / TRL ratio of median steps, their spread, their geometric mean
    with its 95% interval over the rounds (`labkit.formulas.stats.geometric_interval`), and how many
    rounds the running median needed to settle (`rounds_to_stable`); where every round
    measured the floor, each round's labkit step over its floor likewise."""
    if not rounds:
        return {}
    ratios = [r["labkit"] / r["trl"] for r in rounds]
    out = {f"trl_step_ratio_{label}_rounds": ratios,
           f"trl_step_ratio_{label}_spread": {"min": min(ratios), "median": median(ratios),
                                              "max": max(ratios)},
           f"trl_step_ratio_{label}_interval":
               geometric_interval(ratios, unit="rounds").to_dict(),
           f"rounds_rerun_{label}": sum(r["rerun"] for r in rounds),
           f"rounds_to_stable_{label}": rounds_to_stable(ratios)}
    if all("floor" in r for r in rounds):
        multiples = [r["labkit"] / r["floor"] for r in rounds]
        out |= {f"floor_multiple_{label}_rounds": multiples,
                f"floor_multiple_{label}_interval":
                    geometric_interval(multiples, unit="rounds").to_dict()}
    return out


def _floor_figures(ours: dict, label: str, step_s: float, trl_step_s: float) -> dict:
    """The floor under labkit's step on config `label` (see `step_floor`), if measured: its
    parts, its share of TRL's step and labkit's step over it (`floor_multiple_<label>`)."""
    if "floor_s" not in ours:
        return {}
    out = {f"{key}_{label}": median(ours[key])
           for key in ("floor_s", "floor_products_s", "floor_others_s")}
    out |= {f"{key}_{label}": int(median(ours[key])) for key in ("floor_ops", "floor_products")}
    if "floor_replay_mb" in ours:
        out[f"floor_replay_mb_{label}"] = median(ours["floor_replay_mb"])
    out[f"floor_ratio_{label}"] = out[f"floor_s_{label}"] / trl_step_s
    out[f"floor_multiple_{label}"] = step_s / out[f"floor_s_{label}"]
    return out


def _scaling_figures(points: list[dict]) -> dict:
    """The scaling points with their fitted slopes, and the prompt-shared update's speedup."""
    by = {axis: [p for p in points if p["axis"] == axis]
          for axis in ("group_size", "max_new_tokens", "plain")}
    g, t = by["group_size"], by["max_new_tokens"]
    out = {"scaling": points}
    if len(g) > 1:  # --quick measures one point only: no slope
        out["slope_step_s_per_completion_of_group"] = slope(
            [p["value"] for p in g], [p["step_s"] for p in g])
        out["slope_prompt_s_per_completion_of_group"] = slope(
            [p["value"] for p in g], [p["prompt_s"] for p in g])
    if len(t) > 1:
        out["slope_step_s_per_completion_token"] = slope(
            [p["value"] for p in t], [p["step_s"] for p in t])
    shared = [p for p in g if by["plain"] and p["value"] == by["plain"][0]["value"]]
    if shared:
        out["prompt_shared_update_speedup"] = by["plain"][0]["update_s"] / shared[0]["update_s"]
    return out


def kernels_status() -> str:
    """The decode kernels (`labkit.fast.kernels`): "built", or why not. They serve the tiny
    model's rollout (the small model's 128-token prompts are read once per group, which
    the kernels do not do)."""
    from labkit.fast import kernels

    return "built" if kernels.load() is not None else str(kernels.reason())


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def table(summary: dict) -> str:
    """The human-readable report printed above the JSON line."""
    s = summary
    rows = [
        ("GRPO step, tiny (embedded, 2x8, 16 tok)", f"{s['labkit_step_s_tiny']:.3f} s",
         f"{s['trl_step_s_tiny']:.3f} s (TRL)", "trl_step_ratio_tiny"),
        ("GRPO step, small (Llama, 2x8, 128+64 tok)", f"{s['labkit_step_s_small']:.3f} s",
         f"{s['trl_step_s_small']:.3f} s (TRL)", "trl_step_ratio_small"),
        ("rollout, small (4x8, greedy, 64 tok)", f"{s['rollout_tokens_per_s_labkit']:.0f} tok/s",
         f"{s['rollout_tokens_per_s_generate']:.0f} tok/s (generate)", "rollout_speedup_small"),
        ("tensors' peak, small, GRPO vs PPO", f"{s['grpo_peak_mb']:.0f} MB",
         f"{s['ppo_peak_mb']:.0f} MB (PPO)", "grpo_ppo_memory_ratio"),
    ]
    lines = [f"{'comparison':<44}{'labkit':>14}{'peer':>26}{'ratio':>8}  target",
             "-" * 104]
    for label, ours, peer, key in rows:
        lines.append(f"{label:<44}{ours:>14}{peer:>26}{s[key]:>8.3f}  {_target(s, key)}")
    if "floor_multiple_small" in s:
        ours, floor = f"{s['labkit_step_s_small']:.3f} s", f"{s['floor_s_small']:.3f} s (floor)"
        lines.append(f"{'GRPO step, small, over its floor (below)':<44}{ours:>14}{floor:>26}"
                     f"{s['floor_multiple_small']:>8.3f}  {_target(s, 'floor_multiple_small')}")
    if "lora_full_memory_ratio" in s:
        lines.append(f"{'peak memory, small, GRPO LoRA vs full':<44}"
                     f"{s['lora_peak_mb']:>11.0f} MB{s['full_peak_mb']:>14.0f} MB (full FT)"
                     f"{s['lora_full_memory_ratio']:>8.3f}  (the model's own forward)")
    lines.append(f"CPU capability {s['cpu_capability']}, precision tiny {s['precision_tiny']}, "
                 f"small {s['precision']} (both sides), gradient checkpointing off (both), "
                 f"device {s['device']}, {s['torch_threads']} torch threads, beta {s['beta']}, "
                 f"decode kernels {s.get('decode_kernels', 'not recorded')}, "
                 f"median of {s['rounds']} x {s['steps_timed']} steps, each run after "
                 f"{s['warmup']} warm-up, labkit and TRL taking turns; "
                 f"small model {s['small_params'] / 1e6:.1f} M params; "
                 f"greedy tokens identical: {s['rollout_identical']}; memory: both at lr "
                 f"{s['memory_lr']:g}, same completions: {s['memory_same_completions']}")
    for label in ("tiny", "small"):
        spread = s.get(f"trl_step_ratio_{label}_spread")
        if spread:
            lines.append(f"TRL ratio over rounds, {label}: min {spread['min']:.3f}, median "
                         f"{spread['median']:.3f}, max {spread['max']:.3f} "
                         f"({s[f'rounds_rerun_{label}']} round(s) run again; the running "
                         f"median settled within {100 * STABLE:.0f}% after "
                         f"{s[f'rounds_to_stable_{label}']})")
    for key in TARGETS:
        if key in s.get("targets_verdict", {}):
            found = Interval(**s[f"{key}_interval"])
            op, bound = TARGETS[key]
            lines.append(f"{key} over rounds: {found.format()} ({found.method}); "
                         f"{op} {bound}: {s['targets_verdict'][key]}")
    check = s.get("consistency") or {}
    if check.get("agree") is False:
        same = ", ".join(f"{x:.3f}" for x in check["scaling_step_s"])
        lines.append(f"WARNING: the comparison's small step ({check['comparison_step_s']:.3f} s) "
                     f"and the scaling table's same shape ({same} s) "
                     f"disagree by {100 * check['disagreement']:.0f}% (> {100 * AGREE:.0f}%): "
                     "the machine was busy in one of them; run the bench again")
    if "floor_s_tiny" in s:
        lines += _floor_lines(s)
    if "scaling" in s:
        lines += _scaling_lines(s)
    return "\n".join(lines)


def _floor_lines(s: dict) -> list[str]:
    lines = ["", "floor under labkit's step (`labkit.bench.floor.step_floor`): its matrix products "
                 "replayed alone (each large input and each KV cache read from its own memory, "
                 "as in the step), plus its other dispatched operations at the cost of a bare "
                 "view"]
    for label in ("tiny", "small"):
        lines.append(
            f"  {label:<6}{s[f'floor_s_{label}']:.4f} s = {s[f'floor_ratio_{label}']:.3f} of "
            f"TRL's step ({s[f'floor_products_{label}']} products "
            f"{s[f'floor_products_s_{label}']:.4f} s + "
            f"{s[f'floor_ops_{label}'] - s[f'floor_products_{label}']:,} other operations "
            f"{s[f'floor_others_s_{label}']:.4f} s); labkit's step is "
            f"{s[f'floor_multiple_{label}']:.2f}x its floor")
    return lines


def _target(s: dict, key: str) -> str:
    op, bound = TARGETS[key]
    return f"{op} {bound} {'met' if s['targets_met'][key] else 'MISSED'}"


def _scaling_lines(s: dict) -> list[str]:
    lines = ["", f"{'scaling (small)':<28}{'step s':>9}{'rollout s':>11}{'update s':>10}"
                 f"{'prompt s':>10}", "-" * 68]
    for p in s["scaling"]:
        name = "plain update, G" if p["axis"] == "plain" else \
            {"group_size": "G", "max_new_tokens": "completion tokens"}[p["axis"]]
        prompt = "-" if p["axis"] == "plain" else f"{p['prompt_s']:.3f}"  # not P wide there
        lines.append(f"{name + ' = ' + str(p['value']):<28}{p['step_s']:>9.3f}"
                     f"{p['rollout_s']:>11.3f}{p['update_s']:>10.3f}{prompt:>10}")
    if "slope_step_s_per_completion_token" in s:
        lines.append(f"slopes: {s['slope_step_s_per_completion_of_group']:.4f} s per unit of "
                     f"G, {s['slope_step_s_per_completion_token']:.5f} s per completion token, "
                     f"prompt passes {s['slope_prompt_s_per_completion_of_group']:+.5f} s per "
                     f"unit of G")
    if "prompt_shared_update_speedup" in s:
        lines.append(f"prompt-shared update vs plain (prompt G times): "
                     f"{s['prompt_shared_update_speedup']:.2f}x faster")
    return lines


# --- several runs: `python -m labkit bench --pool FILE ...` -------------------------------------

SAME_MACHINE = ("cpu_capability", "precision", "precision_tiny", "device")
"""Fields that must agree between pooled runs: one kind of machine, one precision."""


def read_summary(path) -> dict:
    """A bench run's JSON summary from `path`: a file holding it (`--out`), or the bench's
    printed output, whose last line that parses as a JSON object is the summary."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--pool: no such file: {path}")
    text = path.read_text()
    candidates = [text] + [line for line in reversed(text.splitlines())
                           if line.lstrip().startswith("{")]
    for candidate in candidates:
        try:
            found = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(found, dict) and "trl_step_ratio_small" in found:
            return found
    raise ValueError(f"--pool: {path} holds no bench summary (the JSON line `python -m labkit "
                     "bench` prints last, or the file its --out writes)")


def _figure(summary: dict, key: str) -> float | None:
    """Figure `key` of one run; the floor multiple also from a summary that only has the
    floor (written before the key existed)."""
    if key in summary:
        return summary[key]
    if key.startswith("floor_multiple_"):
        label = key.removeprefix("floor_multiple_")
        if f"floor_s_{label}" in summary:
            return summary[f"labkit_step_s_{label}"] / summary[f"floor_s_{label}"]
    return None


def pool(summaries: list[dict], names: list[str]) -> dict:
    """The target figures over several bench runs on one kind of machine: for each figure
    its value in each run, their geometric mean with the 95% t interval of their logs over
    the runs, and the verdict against its target (`labkit.formulas.stats.verdict`)."""
    if len(summaries) < 2:
        raise ValueError(f"--pool needs at least 2 runs to give an interval, got {len(summaries)}")
    for field in SAME_MACHINE:
        seen = {str(s.get(field)) for s in summaries}
        if len(seen) > 1:
            which = ", ".join(f"{n}: {s.get(field)}" for n, s in zip(names, summaries))
            raise ValueError(f"--pool: runs with different {field} cannot be pooled ({which}); "
                             "pool the runs of one kind of machine and precision")
    figures = {}
    for key, (op, bound) in TARGETS.items():
        values = [v for v in (_figure(s, key) for s in summaries) if v is not None]
        if not values:
            continue
        found = geometric_interval(values, unit="runs")
        figures[key] = {"values": values, "target": f"{op} {bound}",
                        "verdict": target_verdict(found, key), **found.to_dict()}
    first = summaries[0]
    return {"runs": len(summaries), "files": list(names),
            **{field: first.get(field) for field in SAME_MACHINE},
            "modes": sorted({str(s.get("mode", "full")) for s in summaries}),
            "figures": figures}


def pool_table(pooled: dict) -> str:
    """The human-readable form of `pool`'s result."""
    lines = [f"{pooled['runs']} bench runs pooled: CPU capability {pooled['cpu_capability']}, "
             f"precision tiny {pooled['precision_tiny']}, small {pooled['precision']}, "
             f"device {pooled['device']}, mode {' + '.join(pooled['modes'])}",
             f"{'figure':<24}{'target':>9}{'runs':>6}  {'geometric mean [95% interval]':<32}"
             "verdict", "-" * 100]
    for key, f in pooled["figures"].items():
        found = Interval(**{k: f[k] for k in ("mean", "low", "high", "n", "method",
                                                "confidence")})
        lines.append(f"{key:<24}{f['target']:>9}{f['n']:>6}  {found.format():<32}{f['verdict']}")
        lines.append(f"{'':<24}values: " + ", ".join(f"{v:.3f}" for v in f["values"]))
    return "\n".join(lines)
