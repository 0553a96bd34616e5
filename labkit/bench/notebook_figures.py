"""`python -m labkit.bench.notebook_figures RUN_DIR`: each algorithm's step time, tokens per
second and memory peak from a notebook run's metrics.jsonl (scripts/gpu_check.sh prints them
for notebook 01 on a GPU): medians over the steps after the first (which compiles and warms
the allocator), the peak over every step."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def figures(run_dir: str | Path) -> list[dict]:
    """One row per run of the notebook: run, steps, median perf/step_s and
    perf/tokens_per_s after step 1, and the largest perf/mem_mb (CUDA: the allocator's peak
    during a step)."""
    rows: dict[str, list[dict]] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "perf/step_s" in record:
            rows.setdefault(record["run"], []).append(record)
    out = []
    for run, records in rows.items():
        later = [r for r in records if r.get("step", 0) > 1] or records
        out.append({"run": run, "steps": len(records),
                    "step_s": statistics.median(r["perf/step_s"] for r in later),
                    "tokens_per_s": statistics.median(r.get("perf/tokens_per_s", 0.0)
                                                      for r in later),
                    "peak_mb": max(r.get("perf/mem_mb", 0.0) for r in records)})
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not (Path(args[0]) / "metrics.jsonl").is_file():
        print("error: give a notebook run's folder (one holding metrics.jsonl)", file=sys.stderr)
        return 2
    print(f"{'run':<12}{'steps':>6}{'step s':>10}{'tokens/s':>12}{'peak MiB':>10}")
    for row in figures(args[0]):
        print(f"{row['run']:<12}{row['steps']:>6}{row['step_s']:>10.3f}"
              f"{row['tokens_per_s']:>12.0f}{row['peak_mb']:>10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
