"""The lab wing's commands, dispatched by `python -m labkit` (labkit/__main__.py, which holds
their parsers): `run` (a notebook into a run directory, its summary as a terminal table),
`sweep` (an experiment YAML's grid and seeds) and `findings` (docs/findings.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from labkit.lab import retarget
from labkit.lab import tuning as tuning_lib
from labkit.lab.experiments import project_root
from labkit.lab.findings import FINDINGS_PAGE, records_of, run_claims, write_findings
from labkit.lab.report import REPORT
from labkit.lab.runner import RunFailed, read_summary, run_notebook
from labkit.lab.sweeps import CSV_NAME, PLOT_NAME, checked_sweep, load_sweep, plan, run_sweep
from labkit.run.rundir import RUNS_ROOT, git_commit


def run_findings_command(args) -> int:
    if getattr(args, "confirmatory", False) and not args.all:
        print("error: --confirmatory runs claims' confirmatory stages: give it with --all",
              file=sys.stderr)
        return 2
    try:
        sets = retarget.parse_sets(getattr(args, "set", None))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if sets and getattr(args, "confirmatory", False):
        print("error: --confirmatory runs the project's own confirmatory stages; claims "
              "re-pointed by --set run exploratory", file=sys.stderr)
        return 2
    if sets:  # their runs and page apart from the project's
        args.root = args.root or str(Path(RUNS_ROOT) / retarget.slug(sets))
        args.out = args.out or str(Path(args.root) / "findings.md")
    args.out = args.out or str(FINDINGS_PAGE)
    if args.all:
        only = None if args.only is None else [s.strip() for s in args.only.split(",")
                                                if s.strip()]
        try:
            failed = run_claims(args.claims, args.root, smoke=args.smoke, workers=args.workers,
                                only=only, beside=getattr(args, "beside", False),
                                confirmatory=getattr(args, "confirmatory", False),
                                sets=sets or None)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if failed:
            print(f"error: {len(failed)} claim runs failed: {'; '.join(failed)}; the page is "
                  "written from the others", file=sys.stderr)
    try:
        print(write_findings(args.out, args.claims, args.root, smoke=args.smoke,
                             figures=not args.no_figures, sets=sets or None))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run_tune_command(args) -> int:
    """`python -m labkit tune FILE`: run a tuning file's grid (notebook 05's arms at its tuning
    seeds), then write each algorithm's chosen settings (labkit.lab.tuning)."""
    tuning = tuning_lib.load(args.file)
    arms = tuning.arms()
    text = "; ".join(f"{name}: " + ", ".join(f"{k}={v}" for k, v in point.items()
                                             if k != "entry")
                     for name, point in arms.items())
    notebook = project_root() / "notebooks" / "05_arms.ipynb"
    sweep = checked_sweep(notebook, f"tune_{tuning.name}",
                          {**tuning.parameters, "arms": text, "seeds": tuning.seeds,
                           "questions": "gain"},
                          [tuning.seed], tuning.path.name)
    root = RUNS_ROOT if args.root is None else args.root
    if args.dry_run:
        print(f"{len(arms)} settings x {tuning.seeds} seeds from {tuning.seed}, rule "
              f"{tuning.rule!r}, plan {tuning.fingerprint()}")
        for run in plan(sweep, root):
            print(f"{'done' if run.status == 'done' else 'to run':<7} {run.path}")
        return 0
    runs = run_sweep(sweep, root, workers=args.workers, beside=args.beside)
    records = [r for run in runs if run.status in ("ok", "done")
               for r in records_of(read_summary(run.path) or {}, run.id)]
    chosen = tuning_lib.choose(tuning, records)
    out = tuning_lib.write_tuned(tuning, chosen, FINDINGS_PAGE.with_suffix(""), git_commit())
    for algo, s in chosen.items():
        picked = ", ".join(f"{k} {v:g}" for k, v in s.items() if k in tuning_lib.GRID_KEYS)
        print(f"{algo}: {picked} (mean gain {100 * s['mean_gain']:.1f} points over "
              f"{tuning.seeds} seeds)")
    print(out)
    return 0


def run_notebook_command(args) -> int:
    given = {}
    for name, value in args.parameters:
        if name in given:
            raise ValueError(f"parameter {name} is given twice")
        given[name] = value
    try:
        # a per-cell bar in a terminal; logs and pipes get the result lines only
        run_dir = run_notebook(args.notebook, given, name=args.name, root=args.root,
                               progress=sys.stderr.isatty())
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary = read_summary(run_dir)
    print(f"run_dir  {run_dir}")
    print(f"report   {run_dir / REPORT}")
    if summary is None:
        print(f"warning: the notebook wrote no summary.json into {run_dir}", file=sys.stderr)
    else:
        print(summary_table(summary))
        if args.json:  # for scripts; a reader's terminal ends with the verdicts
            print(json.dumps(summary))
    return 0


WIDTH = 100
"""The columns `run`'s terminal summary fits in."""


def summary_table(summary: dict, width: int = WIDTH) -> str:
    """A summary.json for the terminal, in `width` columns: the verdicts first (one line per
    finding: verdict, question, effect [interval]), then the description, then a table with
    one row per run ('grpo/x' keys) and as many of its fields as fit."""
    import textwrap

    def clip(text: str) -> str:
        return text if len(text) <= width else text[:width - 3] + "..."

    lines = []
    numbers = sorted({int(k[len("finding"):].split("/")[0]) for k in summary
                      if k.startswith("finding") and k.endswith("/verdict")})
    for k in numbers:
        get = summary.get
        low, high = get(f"finding{k}/low"), get(f"finding{k}/high")
        interval = f" [{low:.3g}, {high:.3g}]" if low is not None and high is not None else ""
        verdict = str(get(f"finding{k}/verdict")).replace(" at this budget", "")
        lines.append(clip(f"{verdict:<12} {get(f'finding{k}/question', '')}: "
                          f"{get(f'finding{k}/mean', float('nan')):.3g}{interval}"))
    if "description" in summary:
        lines += textwrap.wrap(str(summary["description"]), width)
    runs: dict[str, dict] = {}
    for key, value in summary.items():
        if "/" in key and not key.startswith("finding"):
            run, name = key.rsplit("/", 1)
            runs.setdefault(run, {})[name] = value
    if runs:
        def cell(value):
            return f"{value:.3f}" if isinstance(value, float) else str(value)
        names = list(dict.fromkeys(n for values in runs.values() for n in values))
        columns = [max(len("run"), *map(len, runs))]
        chosen = []
        for name in names:
            need = max(len(name), *(len(cell(v.get(name, ""))) for v in runs.values()))
            if sum(columns) + 2 * len(columns) + need > width:
                break
            chosen.append(name)
            columns.append(need)
        rows = [["run", *chosen]] + [[run, *(cell(values.get(n, "")) for n in chosen)]
                                     for run, values in runs.items()]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, columns)).rstrip() for r in rows]
        if len(chosen) < len(names):
            lines.append(clip(f"(and {len(names) - len(chosen)} more fields in summary.json)"))
    return "\n".join(lines)


def run_sweep_command(args) -> int:
    ray = args.backend == "ray"
    workers = args.workers if args.workers is not None else (0 if ray else 1)
    if workers < (0 if ray else 1):
        raise ValueError(f"--workers must be >= {0 if ray else 1}, got {workers}")
    if args.address and not ray:
        raise ValueError("--address is the Ray cluster's: it needs --backend ray")
    for flag, value, low in (("--cpus-per-run", args.cpus_per_run, "> 0"),
                             ("--gpus-per-run", args.gpus_per_run, ">= 0")):
        if value is not None and (value < 0 or (low == "> 0" and value == 0)):
            raise ValueError(f"{flag} must be {low}, got {value:g}")
    if ray:
        from labkit.lab.on_ray import require_ray

        try:
            require_ray()
        except ImportError as e:  # said in one line, before anything runs
            raise ValueError(str(e)) from None
    sweep = load_sweep(args.experiment, smoke=args.smoke)
    if args.cpus_per_run is not None:
        sweep.resources["cpus"] = args.cpus_per_run
    if args.gpus_per_run is not None:
        sweep.resources["gpus"] = args.gpus_per_run
    root = RUNS_ROOT if args.root is None else args.root
    if args.dry_run:
        for run in plan(sweep, root):
            print(f"{'done' if run.status == 'done' else 'to run':<7} {run.path}")
        return 0
    runs = run_sweep(sweep, root, workers=workers, backend=args.backend, address=args.address,
                     beside=getattr(args, "beside", False))
    folder = runs[0].path.parent
    print(folder / PLOT_NAME)
    print(folder / CSV_NAME)
    failed = [r.id for r in runs if r.status == "failed"]
    if failed:
        print(f"error: {len(failed)} of {len(runs)} runs failed: {'; '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0
