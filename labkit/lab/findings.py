"""docs/findings.md from finished claim sweeps: each claim's verdicts over seeds.

A claim is a sweep file in `experiments/claims/` with a `claim:` block (`labkit.lab.sweeps`):
its id, the statement in the project's own words, the source article's title, and which of
the notebook's findings answer it. `python -m labkit sweep experiments/claims/FILE.yaml`
runs it; each finished run's `summary.json` carries the notebook's findings
(`labkit.lab.verdicts.findings_summary`: question, measure, mean, interval, seeds, method,
threshold). `python -m labkit findings` reads them and writes the page: a row per finding
with its effect, 95% interval, seeds, method, the CPU kinds its runs were measured on and the
verdict, recomputed here from the stored interval by `labkit.formulas.stats.verdict`, and the
commands that regenerate it. A claim whose runs have not finished is listed as not run.

Each claim is decided once, by the primary measure its `preregistered:` block names
(`labkit.lab.claims.claim_verdict`); `labkit.lab.findings_page` writes the pages. The
per-seed record of each claim file is written beside the page
(docs/findings/<file>.csv, `write_records`): the durable data, from which the page decides a
claim whose runs are gone. `python -m labkit findings --all` runs every claim's sweep first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

from labkit.formulas import stats
from labkit.lab import confirm, questions, retarget, verdicts
from labkit.lab.claims import ClaimResult, claim_verdict
from labkit.lab.experiments import project_root
from labkit.lab.findings_page import (COMPUTE_PAGE, EARLIER_PAGE, glance_rows, render,
                                      render_compute, render_earlier, render_every,
                                      write_figures)
from labkit.lab.sweeps import load_sweep, plan, run_sweep
from labkit.run.rundir import RUNS_ROOT, git_commit, read_log

CLAIMS_DIR = Path("experiments") / "claims"
FINDINGS_PAGE = Path("docs") / "findings.md"


RECORD_KEYS = ("sweep_run", "arm", "seed", "commit", "cpu", "torch", "sweep_s")
"""The first columns of a per-seed record (the training code's commit, the CPU's model and
kernel capability, torch's version, the wall time of its sweep run's notebook); the figures
follow in name order."""


def _configs(run_path: Path) -> list[dict]:
    """The config.json records of the training runs under `run_path` (unreadable ones
    skipped)."""
    out = []
    for path in run_path.rglob("config.json"):
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return out


def _run_facts(run_path: Path) -> dict:
    """What the training runs of a sweep run ran on, from their config.json files: the
    commit, the CPU and torch's version, each joined by ' + ' when the runs differ."""
    found: dict[str, set] = {"commit": set(), "cpu": set(), "torch": set()}
    for record in _configs(run_path):
        machine = record.get("machine") or {}
        if record.get("git_commit"):
            found["commit"].add(str(record["git_commit"])[:7])
        cpu = " ".join(str(machine.get(k, "")) for k in ("cpu_model", "cpu_capability"))
        if cpu.strip():
            found["cpu"].add(cpu.strip())
        if (record.get("versions") or {}).get("torch"):
            found["torch"].add(str(record["versions"]["torch"]))
    return {k: " + ".join(sorted(v)) for k, v in found.items() if v}


def records_of(summary: dict, sweep_run: str) -> list[dict]:
    """The per-seed rows of a summary.json: its "<arm>/seed=<s>/<figure>" entries (or
    "<arm>/<figure>" for a run of one seed) as {sweep_run, arm, seed, figure: value, ...}."""
    runs: dict[str, dict] = {}
    for key, value in summary.items():
        run, _, name = key.rpartition("/")
        text = name == "fingerprint" and isinstance(value, str)
        if not run or run.startswith("finding") or isinstance(value, bool) \
                or not (text or isinstance(value, (int, float))):
            continue
        runs.setdefault(run, {})[name] = value
    out = []
    for run, values in runs.items():
        if "seed" not in values:
            continue
        arm = run.split("/seed=")[0]
        out.append({"sweep_run": sweep_run, "arm": arm, "seed": int(values.pop("seed")),
                    **dict(sorted(values.items()))})
    return out


def write_records(records: list[dict], path: str | Path) -> Path:
    """The per-seed record as CSV (RECORD_KEYS, then every figure any row has)."""
    import csv

    path = Path(path)
    names = sorted({k for r in records for k in r} - set(RECORD_KEYS))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, [*RECORD_KEYS, *names])
        writer.writeheader()
        writer.writerows(records)
    return path


def read_records(path: str | Path) -> list[dict]:
    """A CSV of `write_records`, numbers as numbers (empty cells left out)."""
    import csv

    out = []
    with Path(path).open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            record = {}
            for key, text in row.items():
                if text in ("", None):
                    continue
                if key in ("sweep_run", "arm", "commit", "cpu", "torch", "fingerprint"):
                    record[key] = text
                else:
                    number = float(text)
                    record[key] = int(number) if number.is_integer() and key == "seed" \
                        else number
            out.append(record)
    return out


def locate(path: str | Path) -> Path:
    """`path` as given when absolute; a relative one under the project root of the working
    directory when it exists there, else under the checkout this labkit was imported from
    (a notebook run from another folder still finds experiments/claims/)."""
    path = Path(path)
    if path.is_absolute():
        return path
    here = project_root() / path
    if here.exists():
        return here
    return project_root(Path(__file__).resolve().parent) / path


def _finding_numbers(summary: dict) -> list[int]:
    return sorted(int(k[len("finding"):].split("/")[0]) for k in summary
                  if k.startswith("finding") and k.endswith("/verdict"))


def finding_row(summary: dict, k: int, run_id: str) -> dict:
    """Finding k of a summary.json as a table row, its verdict recomputed from its interval
    and threshold."""
    get = summary.get
    mean, low, high = get(f"finding{k}/mean"), get(f"finding{k}/low"), get(f"finding{k}/high")
    seeds = int(get(f"finding{k}/seeds", 0))
    interval = stats.Interval(mean, math.nan if low is None else low,
                              math.nan if high is None else high, seeds,
                              get(f"finding{k}/method", ""))
    threshold, direction = get(f"finding{k}/threshold"), get(f"finding{k}/direction", "above")
    stored = get(f"finding{k}/verdict", "")
    if threshold is None or str(stored).startswith("comparator collapsed"):
        verdict = get(f"finding{k}/verdict", stats.INCONCLUSIVE)
    else:
        side = {"above": threshold} if direction == "above" else {"below": threshold}
        verdict = stats.verdict(interval, **side)
    return {"run": run_id, "question": get(f"finding{k}/question", ""),
            "measure": get(f"finding{k}/measure", ""), "effect": interval.format(2),
            "seeds": seeds, "method": interval.method, "verdict": verdict,
            "mean": interval.mean, "low": interval.low, "high": interval.high,
            "threshold": threshold, "direction": direction}


FINDING_KEYS = ("claim", "run", "question", "measure", "effect", "seeds", "method", "verdict",
                "mean", "low", "high", "threshold", "direction")
"""The columns of a claim file's stored findings (<record>-findings.csv beside its per-seed
record): what its finished runs' notebooks found, so that a page written after the runs are
gone still reads a claim decided by a finding (claim 3's prediction, a monitor's J)."""


def write_finding_rows(results: list[ClaimResult], path: str | Path) -> Path:
    """The findings of `results` (the claims of one record) as CSV, one row per claim and
    finding (FINDING_KEYS)."""
    import csv

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, FINDING_KEYS, extrasaction="ignore")
        writer.writeheader()
        for result in results:
            for row in result.rows:
                writer.writerow({**row, "claim": result.claim.get("id", "")})
    return path


def read_finding_rows(path: str | Path, claim_id) -> list[dict]:
    """The rows of `write_finding_rows` for one claim, numbers as numbers."""
    import csv

    out = []
    with Path(path).open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if str(row.pop("claim")) != str(claim_id):
                continue
            for key in ("mean", "low", "high", "threshold"):
                row[key] = float(row[key]) if row.get(key) not in ("", None) else None
            row["seeds"] = int(float(row["seeds"])) if row.get("seeds") else 0
            out.append(row)
    return out


def findings_name(result: ClaimResult) -> str:
    """<claim file>-findings.csv (a replication's: <claim file>-replication-findings.csv)."""
    return result.record_name.removesuffix(".csv") + "-findings.csv"


def _machines(run_path: Path) -> tuple[set[str], set[str]]:
    """The CPU kinds ('AVX512, 1 thread') and the short git commits of the training runs
    under `run_path`, from their config.json files."""
    kinds, commits = set(), set()
    for record in _configs(run_path):
        machine = record.get("machine") or {}
        if machine.get("cpu_capability"):
            threads = machine.get("threads")
            kinds.add(f"{machine['cpu_capability']}, {threads} thread{'s' * (threads != 1)}")
        if record.get("git_commit"):
            commits.add(str(record["git_commit"])[:7])
    return kinds, commits


def collect(claims_dir: str | Path = CLAIMS_DIR, root: str | Path | None = None,
            smoke: bool = False, records_dir: str | Path | None = None,
            sets: dict[str, str] | None = None) -> list[ClaimResult]:
    """Every claim of `claims_dir` with the findings and the per-seed record of its finished
    runs under `root`; a claim none of whose runs is there reads its record from
    `records_dir`/<claim file>.csv where that exists. `sets`: each claim sweep re-pointed at
    those fields (labkit.lab.retarget), a claim that cannot run there kept with the reason."""
    root = Path(RUNS_ROOT if root is None else root)
    files = sorted(Path(claims_dir).glob("*.yaml"))
    if not files:
        raise FileNotFoundError(f"no claim files (*.yaml) in {claims_dir}")
    results = []
    for file in files:
        sweep = load_sweep(file, smoke=smoke, to_run=False)
        if not sweep.claims:
            raise ValueError(f"{file.name} has no `claim:` block: it is a sweep, not a claim")
        if sets:
            sweep, why = retarget.retarget(sweep, sets)
            if why is not None:
                results += [ClaimResult(file, claim, not_run=why) for claim in sweep.claims]
                continue
        for result in _read_stage(file, sweep, root, records_dir):
            if records_dir is not None:
                result.changed = confirm.changed_since_frozen(records_dir, file.stem,
                                                              result.claim, sweep.parameters,
                                                              sweep.grid)
            results.append(result)
        if sweep.replication:
            results += _replications(file, sweep, root, records_dir)
        if sweep.confirmatory is not None:
            results += _confirmatory(file, sweep, root, records_dir)
    return sorted(results, key=lambda r: (r.claim.get("id", 0), r.order))


def _facts(done: list) -> list:
    """Per finished sweep run: its machines and commits, its notebook's wall time and the
    sum of its training runs' wall times."""
    return [(_machines(run.path), _duration(run.path),
             sum(v for key, v in run.summary.items()
                 if key.endswith("/wall_s") and isinstance(v, (int, float))))
            for run in done]


def _watches(sweep) -> bool:
    """Whether a claim of the sweep is about the monitors (its record then carries when each
    rule of the threshold sweep first fired)."""
    return any((c.get("preregistered") or {}).get("measure") == "monitor_youden"
               for c in sweep.claims)


def _records(done: list, facts: list, monitors: bool) -> list[dict]:
    """The per-seed record of finished sweep runs: each training run's figures, where it
    ran (`_run_facts`), its sweep run's wall time and, with `monitors`, the step each rule
    of `questions.MONITOR_SWEEP` first fired (`fires.<rule>`, -1: never)."""
    out = []
    for run, (_, elapsed, _) in zip(done, facts):
        fires = _fire_steps(run.path) if monitors else {}
        out += [{**r, **_run_facts(run.path), "sweep_s": round(elapsed, 1),
                 **fires.get((r["arm"], r["seed"]), {})}
                for r in records_of(run.summary, run.id)]
    return out


def _fire_steps(run_path: Path) -> dict[tuple[str, int], dict[str, int]]:
    """(arm, seed) -> {fires.<rule>: first step} from each training run's metrics.jsonl
    (a training run's folder is <arm>-seed<seed>)."""
    rules = questions.monitor_rules()
    out = {}
    for config in sorted(run_path.glob("*/config.json")):
        try:
            seed = int(json.loads(config.read_text(encoding="utf-8"))["config"]["seed"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        arm, _, tail = config.parent.name.rpartition("-seed")
        if not arm or tail != str(seed):
            continue
        history = read_log(config.parent / "metrics.jsonl")
        out[(arm, seed)] = {f"fires.{rule}": step
                            for rule, step in questions.first_fires(history, rules).items()}
    return out


def _finish(result: ClaimResult, done: list, facts: list, records_dir) -> None:
    """Fill a claim's findings, machines, commits and times from its finished runs, and its
    record from its CSV where no run is there."""
    stored = Path(records_dir) / result.record_name if records_dir else None
    if not done and stored is not None and stored.is_file():
        result.records = read_records(stored)
        result.stored = True
    found = Path(records_dir) / findings_name(result) if records_dir else None
    if not done and found is not None and found.is_file():
        result.rows += read_finding_rows(found, result.claim.get("id", ""))
        result.stored = True
    for run, ((kinds, commits), elapsed, compute) in zip(done, facts):
        result.rows += [finding_row(run.summary, k, run.id)
                        for k in selected(run.summary, result.claim.get("findings"))]
        result.machines |= kinds
        result.commits |= commits
        result.compute_s += compute
        result.elapsed_s += elapsed
    if not done and result.records:  # the CSV says where and how long its runs ran
        result.commits |= {c for r in result.records for c in str(r.get("commit", "")
                                                                    ).split(" + ") if c}
        result.elapsed_s = sum({r["sweep_run"]: r.get("sweep_s", 0.0)
                                for r in result.records}.values())
        result.compute_s = sum(r.get("wall_s", 0.0) for r in result.records)
        result.runs_done = len({r["sweep_run"] for r in result.records})
    if (result.claim.get("preregistered") or {}).get("measure") == "monitor_youden":
        swept = verdicts.findings_summary(questions.swept_monitor_findings(result.records))
        result.rows += [finding_row(swept, k, "per-seed record")
                        for k in _finding_numbers(swept)]


def _read_stage(file: Path, sweep, root: Path, records_dir, **fields) -> list[ClaimResult]:
    """A ClaimResult per claim of one stage of a claim file (`sweep`: its seeds and runs
    folder) with the findings and the per-seed record of its finished runs under `root`
    (`_finish`), each with `fields` set."""
    runs = plan(sweep, root)
    done = [run for run in runs if run.status == "done"]
    # what a run says of its machine and time, read once for every claim it answers
    facts = _facts(done)
    # the per-seed record of the file's runs, shared by every claim it answers
    records = _records(done, facts, _watches(sweep))
    out = []
    for claim in sweep.claims:
        result = ClaimResult(file, claim, runs_done=len(done), runs_total=len(runs),
                             records=list(records), **fields)
        _finish(result, done, facts, records_dir)
        out.append(result)
    return out


def _replications(file: Path, sweep, root: Path, records_dir) -> list[ClaimResult]:
    """The claims of a file run again at its `replication:` first seeds: each read once, at
    all the seeds those runs train."""
    again = dataclasses.replace(sweep, seeds=list(sweep.replication))
    out = _read_stage(file, again, root, records_dir, replication=tuple(sweep.replication))
    for result in out:
        seeds = {(r["arm"], r["seed"]) for r in result.records}
        per_arm = max([sum(1 for a, _ in seeds if a == arm) for arm, _ in seeds], default=0)
        per_run = sweep.parameters.get("seeds", 1)
        planned = len(sweep.replication) * (per_run if isinstance(per_run, int) else 1)
        result.looks = (max(per_arm or planned, 2),)
    return out


def _confirmatory(file: Path, sweep, root: Path, records_dir) -> list[ClaimResult]:
    """The claims of a file at its `confirmatory:` stage (reserved seeds, its own runs folder
    and settings), each read at its own plan's looks; a claim whose plan changed after it was
    frozen says so (`confirm.changed_since_frozen`)."""
    stage = sweep.confirmatory
    changes = {k: v for k, v in stage.parameters.items() if sweep.parameters.get(k) != v}
    out = _read_stage(file, stage, root, records_dir, confirmatory=True,
                      changed_settings=changes)
    for result in out:
        if records_dir is not None:
            result.changed = confirm.changed_since_frozen(records_dir, file.stem, result.claim,
                                                          stage.parameters, stage.grid)
    return out


def selected(summary: dict, wanted: list | None) -> list[int]:
    """The numbers of a summary's findings that a claim's `findings:` picks: a number picks
    that finding, a string every finding whose question contains it; none: all of them."""
    numbers = _finding_numbers(summary)
    if not wanted:
        return numbers
    out = []
    for item in wanted:
        if isinstance(item, int) and not isinstance(item, bool):
            out += [item] if item in numbers else []
        else:
            out += [k for k in numbers if str(item) in str(summary.get(f"finding{k}/question"))]
    return list(dict.fromkeys(out))


def _duration(run_path: Path) -> float:
    """Seconds papermill took to run the notebook of a sweep run (0 when unknown)."""
    try:
        record = json.loads((run_path / "notebook.ipynb").read_text(encoding="utf-8"))
        return float(record["metadata"]["papermill"]["duration"] or 0.0)
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def run_claims(claims_dir: str | Path = CLAIMS_DIR, root: str | Path | None = None,
               smoke: bool = False, workers: int = 1,
               only: list[str] | None = None, beside: bool = False,
               records_dir: str | Path | None = None,
               confirmatory: bool = False, sets: dict[str, str] | None = None) -> list[str]:
    """Run every claim's sweep, batch by batch: a claim file's first seeds under `seeds:`
    are its batches, run in order until every claim the file answers is decided by its
    preregistered plan (`claim_verdict`) or its batches are spent, then its `replication:`
    batches, all of them. With `confirmatory`, each file's `confirmatory:` stage instead,
    look by look in the same way, its claims' plans frozen before its first run
    (`confirm.freeze`); a file without one is said and left. `sets`: every claim sweep
    re-pointed at those fields (labkit.lab.retarget; one that cannot run there is said and
    left), its exploratory runs only. `only` names the claim
    files to run (their stems, such as "03_group_size"); the others are left as they are.
    Every claim file is checked before the first run; finished runs are skipped, so the
    suite resumes. Returns the ids of the runs that failed."""
    root = Path(RUNS_ROOT if root is None else root)
    records_dir = FINDINGS_PAGE.with_suffix("") if records_dir is None else Path(records_dir)
    files = sorted(Path(claims_dir).glob("*.yaml"))
    if only is not None:
        unknown = sorted(set(only) - {f.stem for f in files})
        if unknown:
            raise ValueError(f"--only: no claim file {', '.join(unknown)} in {claims_dir} "
                             f"(the files are {', '.join(f.stem for f in files)})")
        files = [f for f in files if f.stem in only]
    sweeps = [(f, load_sweep(f, smoke=smoke)) for f in files]  # every claim checked first
    if sets:  # every file re-pointed and checked (the model folder, the task's file) first
        moved = [(f, *retarget.retarget(s, sets)) for f, s in sweeps]
        for f, _, why in moved:
            if why is not None:
                print(f"{f.name}: not run here: {why}", file=sys.stderr)
        sweeps = [(f, s) for f, s, why in moved if why is None]
    failed = []
    for file, sweep in sweeps:
        if confirmatory:
            if sweep.confirmatory is None:
                print(f"{file.name}: no `confirmatory:` block; left as it is", file=sys.stderr)
                continue
            if not smoke:
                confirm.freeze(records_dir, file.stem, sweep.confirmatory, git_commit())
            failed += _by_looks(file, sweep.confirmatory, claims_dir, root, smoke, workers,
                                beside, confirmatory=True)
            continue
        if not smoke and sweep.seeds and min(sweep.seeds) >= confirm.CONFIRM_FROM:
            confirm.freeze(records_dir, file.stem, sweep, git_commit())  # before its first run
        failed += _by_looks(file, sweep, claims_dir, root, smoke, workers, beside, sets=sets)
        if sweep.replication:  # read once, at all its seeds: every batch runs
            runs = run_sweep(dataclasses.replace(sweep, seeds=sweep.replication), root,
                             workers=workers, beside=beside)
            failed += [r.id for r in runs if r.status == "failed"]
    return failed


def _by_looks(file: Path, sweep, claims_dir, root: Path, smoke: bool, workers: int,
              beside: bool, confirmatory: bool = False,
              sets: dict[str, str] | None = None) -> list[str]:
    """Run a claim file's sweep batch by batch (its first seeds) until every claim it answers
    is decided at that stage or its batches are spent; the ids of the runs that failed."""
    failed = []
    for k in range(1, len(sweep.seeds) + 1):
        runs = run_sweep(dataclasses.replace(sweep, seeds=sweep.seeds[:k]), root,
                         workers=workers, beside=beside)
        failed += [r.id for r in runs if r.status == "failed"]
        answered = [r for r in collect(claims_dir, root, smoke, sets=sets)
                    if r.file == file and not r.replication and r.confirmatory == confirmatory]
        if all(claim_verdict(r).verdict != stats.INCONCLUSIVE for r in answered):
            break
    return failed


def write_findings(out: str | Path = FINDINGS_PAGE, claims_dir: str | Path = CLAIMS_DIR,
                   root: str | Path | None = None, smoke: bool = False,
                   figures: bool = False, sets: dict[str, str] | None = None) -> Path:
    """Collect the claims' findings and write the page to `out`, and each claim file's
    per-seed record (`write_records`) into the folder named like the page (docs/findings/
    beside docs/findings.md), from which a later page decides a claim whose runs are gone;
    with `figures`, an SVG per claim into that folder too.
    Figures that cannot be exported are said in one line on stderr; the page is written
    without them."""
    out = Path(out)
    folder = out.with_suffix("")  # docs/findings/ beside docs/findings.md
    results = collect(claims_dir, root, smoke, records_dir=folder, sets=sets)
    # one per file, from its runs: a record read back from its CSV is left as it is
    for result in {r.record_name: r for r in results
                   if r.runs_done and not r.stored}.values():
        write_records(result.records, folder / result.record_name)
        if any(r.rows for r in results if r.record_name == result.record_name):
            write_finding_rows([r for r in results if r.record_name == result.record_name],
                               folder / findings_name(result))
    drawn = None
    if figures:
        try:
            drawn = write_figures(results, out.with_suffix(""))
        except RuntimeError as e:
            print(f"warning: no figures: {e}", file=sys.stderr)
    commit = git_commit()
    glance = glance_rows(results)  # the verdicts, read once for the page and the earlier one
    text = render(results, commit, smoke, out.with_suffix("").name, on=sets, glance=glance)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    folder.mkdir(parents=True, exist_ok=True)
    for name, page in render_every(results, commit, drawn).items():
        (folder / name).write_text(page, encoding="utf-8")
    (folder / COMPUTE_PAGE).write_text(render_compute(results, commit, smoke, sets),
                                       encoding="utf-8")
    (folder / EARLIER_PAGE).write_text(render_earlier(results, commit, glance), encoding="utf-8")
    return out
