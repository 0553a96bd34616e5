"""docs/findings.md from finished claim sweeps: each claim's verdicts over seeds.

A claim is a sweep file in `experiments/claims/` with a `claim:` block (`labkit.lab.sweeps`):
its id, the statement in the project's own words, the source article's title, and which of
the notebook's findings answer it. `python -m labkit sweep experiments/claims/FILE.yaml`
runs it; each finished run's `summary.json` carries the notebook's findings
(`labkit.lab.verdicts.findings_summary`: question, measure, mean, interval, seeds, method,
threshold). `python -m labkit findings` reads them and writes the page: a row per finding
with its effect, 95% interval, seeds, method, the CPU kinds its runs were measured on and the
verdict, recomputed here from the stored interval by `labkit.stats.verdict`, and the
commands that regenerate it. A claim whose runs have not finished is listed as not run.

Each claim is decided once, by the primary measure its `preregistered:` block names
(`claim_verdict`): from the per-seed record where the measure is one of PER_SEED_MEASURES
(paired by seed; every arm against a baseline together, Dunnett), else from the findings
its `finding:` words pick. The per-seed record of each claim file is written beside the page
(docs/findings/<file>.csv, `write_records`): the durable data, from which the page decides a
claim whose runs are gone. `python -m labkit findings --all` runs every claim's sweep first.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from labkit import stats, stats_design

CLAIMS_DIR = Path("experiments") / "claims"
FINDINGS_PAGE = Path("docs") / "findings.md"


@dataclass
class ClaimResult:
    """What the finished runs of one claim sweep found."""

    file: Path
    claim: dict
    rows: list[dict] = field(default_factory=list)
    machines: set[str] = field(default_factory=set)
    commits: set[str] = field(default_factory=set)
    runs_done: int = 0
    runs_total: int = 0
    compute_s: float = 0.0
    elapsed_s: float = 0.0
    """Wall time of the sweep's notebook runs (papermill's duration), the time a user waits."""
    records: list[dict] = field(default_factory=list)
    """The per-seed record: one row per training run (sweep run, arm, seed and every figure
    its notebook summarised), from the finished runs or, without them, the claim file's CSV
    (`write_records`)."""
    replication: tuple[int, ...] = ()
    """For the replication of a claim (its file's `replication:` seeds, never run for the
    original): those first seeds; () for the original."""
    looks: tuple[int, ...] | None = None
    """The looks the claim is read at where not its plan's (`plan_of`): a replication is
    read once, at all its seeds."""

    @property
    def record_name(self) -> str:
        """The per-seed CSV's file name: <claim file>.csv, <claim file>-replication.csv."""
        return f"{self.file.stem}{'-replication' * bool(self.replication)}.csv"


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
        if not run or run.startswith("finding") or isinstance(value, bool) \
                or not isinstance(value, (int, float)):
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
                if key in ("sweep_run", "arm", "commit", "cpu", "torch"):
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
    from labkit.lab.experiments import project_root

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
    if threshold is None:
        verdict = get(f"finding{k}/verdict", stats.INCONCLUSIVE)
    else:
        side = {"above": threshold} if direction == "above" else {"below": threshold}
        verdict = stats.verdict(interval, **side)
    return {"run": run_id, "question": get(f"finding{k}/question", ""),
            "measure": get(f"finding{k}/measure", ""), "effect": interval.format(2),
            "seeds": seeds, "method": interval.method, "verdict": verdict,
            "mean": interval.mean, "low": interval.low, "high": interval.high,
            "threshold": threshold, "direction": direction}


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
            smoke: bool = False, records_dir: str | Path | None = None) -> list[ClaimResult]:
    """Every claim of `claims_dir` with the findings and the per-seed record of its finished
    runs under `root`; a claim none of whose runs is there reads its record from
    `records_dir`/<claim file>.csv where that exists."""
    from labkit.lab.sweeps import load_sweep, plan
    from labkit.rundir import RUNS_ROOT

    root = Path(RUNS_ROOT if root is None else root)
    files = sorted(Path(claims_dir).glob("*.yaml"))
    if not files:
        raise FileNotFoundError(f"no claim files (*.yaml) in {claims_dir}")
    results = []
    for file in files:
        sweep = load_sweep(file, smoke=smoke)
        if not sweep.claims:
            raise ValueError(f"{file.name} has no `claim:` block: it is a sweep, not a claim")
        runs = plan(sweep, root)
        done = [run for run in runs if run.status == "done"]
        # what a run says of its machine and time, read once for every claim it answers
        facts = _facts(done)
        # the per-seed record of the file's runs, shared by every claim it answers
        records = _records(done, facts, _watches(sweep))
        for claim in sweep.claims:
            result = ClaimResult(file, claim, runs_done=len(done), runs_total=len(runs),
                                 records=list(records))
            _finish(result, done, facts, records_dir)
            results.append(result)
        if sweep.replication:
            results += _replications(file, sweep, root, records_dir)
    return sorted(results, key=lambda r: (r.claim.get("id", 0), bool(r.replication)))


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
    from labkit.lab import questions
    from labkit.rundir import read_metrics

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
        history = read_metrics(config.parent / "metrics.jsonl")
        out[(arm, seed)] = {f"fires.{rule}": step
                            for rule, step in questions.first_fires(history, rules).items()}
    return out


def _finish(result: ClaimResult, done: list, facts: list, records_dir) -> None:
    """Fill a claim's findings, machines, commits and times from its finished runs, and its
    record from its CSV where no run is there."""
    stored = Path(records_dir) / result.record_name if records_dir else None
    if not done and stored is not None and stored.is_file():
        result.records = read_records(stored)
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
        from labkit.lab import questions, verdicts

        swept = verdicts.findings_summary(questions.swept_monitor_findings(result.records))
        result.rows += [finding_row(swept, k, "per-seed record")
                        for k in _finding_numbers(swept)]


def _replications(file: Path, sweep, root: Path, records_dir) -> list[ClaimResult]:
    """The claims of a file run again at its `replication:` first seeds: each read once, at
    all the seeds those runs train."""
    import dataclasses

    from labkit.lab.sweeps import plan

    again = dataclasses.replace(sweep, seeds=list(sweep.replication))
    runs = plan(again, root)
    done = [run for run in runs if run.status == "done"]
    facts = _facts(done)
    records = _records(done, facts, _watches(sweep))
    out = []
    for claim in sweep.claims:
        result = ClaimResult(file, claim, runs_done=len(done), runs_total=len(runs),
                             records=list(records), replication=tuple(sweep.replication))
        _finish(result, done, facts, records_dir)
        seeds = {(r["arm"], r["seed"]) for r in result.records}
        per_arm = max([sum(1 for a, _ in seeds if a == arm) for arm, _ in seeds], default=0)
        per_run = sweep.parameters.get("seeds", 1)
        planned = len(sweep.replication) * (per_run if isinstance(per_run, int) else 1)
        result.looks = (max(per_arm or planned, 2),)
        out.append(result)
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


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


COLUMNS = ("claim", "source", "measured", "effect [95% CI]", "seeds", "method", "machine",
           "verdict")
PAGE_COLUMNS = ("claim", "measured", "effect [95% CI]", "seeds", "method", "verdict")
"""The page's table of every finding: the claim by its number (its statement, source and
machines are said once, in the table at a glance and the compute lines)."""


def table_rows(results: list[ClaimResult]) -> list[dict]:
    """One row per finding of every claim (COLUMNS); a claim without finished runs gets one
    row that says so."""
    out = []
    for r in results:
        head = claim_title(r)
        source, machine = r.claim.get("source", ""), "; ".join(sorted(r.machines)) or "-"
        number = f"{r.claim.get('id', '?')}" + (" (replication)" if r.replication else "")
        if not r.rows:
            out.append(dict.fromkeys(COLUMNS, "") | {
                "claim": head, "source": source, "number": number,
                "measured": f"not run yet ({r.runs_done} of {r.runs_total} runs)"})
            continue
        for row in r.rows:
            where = "" if row["run"] == "seed=0" else f" ({row['run']})"
            out.append({"claim": head, "source": source, "number": number,
                        "measured": f"{row['question']}: {row['measure']}{where}",
                        "effect [95% CI]": row["effect"], "seeds": row["seeds"],
                        "method": row["method"], "machine": machine, "verdict": row["verdict"]})
    return out


NOT_MEASURED = "not measured yet"
PER_SEED = "needs the per-seed record"


@dataclass(frozen=True)
class ClaimVerdict:
    """A claim decided by its preregistered primary measure (labkit.lab.preregistration)."""

    test: str
    """The preregistered test in words."""
    figure: str
    """The decisive figure with its interval, or why there is none."""
    verdict: str
    mde: str = ""
    """For a finding's interval: the smallest effect its seeds detect with 80% power; for an
    undecided claim read from its per-seed record: the seeds its observed effect needs."""


def claim_verdict(result: ClaimResult) -> ClaimVerdict:
    """The claim-level verdict: the preregistered primary measure read by
    `labkit.stats_design.decide` from the findings whose question holds the preregistered `finding`
    words and the compared arms. Several such findings (one per G, say) must each support
    the claim for it to be supported, and refute it if any refutes it. Every arm against a
    baseline (`compare: [all, ...]`) is decided from the per-seed values together (Dunnett),
    which the stored intervals cannot give."""
    from labkit.lab import preregistration

    prereg = preregistration.check(result.claim, result.file.name, check_arms=False)
    test = prereg.describe()
    within = PER_SEED_MEASURES.get(prereg.measure, ("", 0, ""))[2] == "within"
    if prereg.measure in PER_SEED_MEASURES and (prereg.compare or within) and result.records:
        decided = _from_records(prereg, result.records, result.looks)
        if decided is not None:
            figure, verdict, more = decided
            return ClaimVerdict(test, figure, verdict, more)
    if prereg.compare[:1] == ("all",):
        return ClaimVerdict(test, f"{PER_SEED} (every arm against {prereg.compare[1]}, "
                                  "Dunnett)", stats.INCONCLUSIVE)
    words = [prereg.finding] if prereg.finding else []
    rows = [row for row in result.rows
            if all(w in row["question"] for w in words + list(prereg.compare))]
    if not words and not prereg.compare or not rows:
        return ClaimVerdict(test, NOT_MEASURED, stats.INCONCLUSIVE)
    verdicts, figures, mdes = [], [], []
    for row in rows:
        interval = stats.Interval(row["mean"], _nan(row["low"]), _nan(row["high"]),
                                  row["seeds"], row["method"])
        verdicts.append(prereg.decide(interval))
        figures.append(f"{row['question']}: {row['effect']}")
        mde = _mde(interval)
        if mde is not None:
            mdes.append(f"{mde:.3g}")
    if all(v == stats.SUPPORTED for v in verdicts):
        verdict = stats.SUPPORTED
    elif stats.REFUTED in verdicts:
        verdict = stats.REFUTED
    else:
        verdict = stats.INCONCLUSIVE
    return ClaimVerdict(test, "; ".join(figures), verdict, ", ".join(mdes))


PER_SEED_MEASURES = {"gain": ("gain", 100.0, "difference"),
                     "final_length": ("length_final", 1.0, "difference"),
                     "memory_ratio": ("mem_mb", 1.0, "ratio"),
                     "step_time_ratio": ("step_s", 1.0, "ratio"),
                     "collapse_difference": ("collapsed", 1.0, "binary"),
                     "grad_rel_var_ratio": (("diag.grad_rel_var_raw.ppo_critic",
                                             "diag.grad_rel_var_raw.rloo"), 1.0, "within")}
"""The primary measures a claim's per-seed record decides: measure -> (the record's
figure, its scale (gain in points), how two arms compare); a "within" measure is the ratio
of two figures of one run (numerator, denominator), over the seeds of the compared arm (or
of the record's one arm)."""


def _table(records: list[dict], key: str, scale: float) -> dict[str, dict[int, float]]:
    """arm -> seed -> scale * the figure `key`, for the records that have it."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]):
            out.setdefault(r["arm"], {})[r["seed"]] = scale * r[key]
    return out


def _arm(table: dict, name: str) -> str | None:
    """The record's arm that a preregistered name means ('G=4' is 'samples/G=4')."""
    return next((a for a in table if a == name or a.endswith("/" + name)), None)


def plan_of(prereg, looks: tuple[int, ...] | None = None) -> stats_design.SequentialPlan:
    """The looks a claim is read at: every 5 seeds up to the seeds it plans (5, 10 for 10),
    the error rate spent over them (`stats_design.SequentialPlan`); `looks` where given instead."""
    if looks is None:
        looks = tuple(range(5, prereg.seeds, 5)) + (prereg.seeds,)
    return stats_design.SequentialPlan(looks)


def _from_records(prereg, records: list[dict], looks: tuple[int, ...] | None = None
                  ) -> tuple[str, str, str] | None:
    """(figure, verdict, what more seeds would do) of the primary measure from the per-seed
    record, read at each look of the claim's plan that its seeds reach and stopped at the
    first decided one; None where the record lacks the compared arms."""
    key, scale, kind = PER_SEED_MEASURES[prereg.measure]
    if kind == "within":
        return _within(prereg, records, *key, looks=looks)
    table = _table(records, key, scale)
    base = _arm(table, prereg.compare[1])
    every = prereg.compare[0] == "all"
    arm = None if every else _arm(table, prereg.compare[0])
    if base is None or (not every and arm is None):
        return None
    arms = list(table) if every else [base, arm]
    seeds = sorted(set.intersection(*(set(table[a]) for a in arms)))
    plan = plan_of(prereg, looks)
    if len(seeds) < plan.looks[0]:
        return (f"{len(seeds)} shared seeds, short of the first look's {plan.looks[0]}",
                stats.INCONCLUSIVE, "")

    def read(n: int, k: int) -> tuple[str, tuple[str, stats.Interval]]:
        first, level = seeds[:n], plan.confidence(k, prereg.direction)
        if every:
            figure, verdict, interval = _every_arm(prereg, table, base, first, level)
            return verdict, (figure, interval)
        interval = _pair(kind, [table[arm][s] for s in first], [table[base][s] for s in first],
                         level, _gain_floor(records, prereg.measure))
        return prereg.decide(interval), (f"{arm} vs {base}: {interval.format(2)}", interval)

    k, verdict, (figure, interval) = plan.run(len(seeds), read)
    look = (f"{plan.looks[k]} seeds, look {k + 1} of {len(plan.looks)} at "
            f"{100 * interval.confidence:.2f}% ({interval.method})")
    more = ""
    if verdict == stats.INCONCLUSIVE and kind == "difference" and not every:
        needed = stats_design.seeds_needed(interval, prereg.threshold)
        more = f"about {needed} seeds" if needed else ""
    return f"{figure}; {look}", verdict, more


def _within(prereg, records: list[dict], top: str, bottom: str,
            looks: tuple[int, ...] | None = None) -> tuple[str, str, str] | None:
    """A ratio of two figures of each run (`top` / `bottom`), over seeds: the log-ratio t
    interval, read at the looks of the claim's plan. The arm is the compared one, or the
    record's only arm; None where the record lacks the figures."""
    arms = sorted({r["arm"] for r in records if top in r and bottom in r})
    arm = prereg.compare[0] if prereg.compare else (arms[0] if len(arms) == 1 else None)
    pairs = {r["seed"]: (r[top], r[bottom]) for r in records
             if r["arm"] == arm and top in r and bottom in r}
    if arm is None or not pairs:
        return None
    seeds = sorted(pairs)
    plan = plan_of(prereg, looks)
    if len(seeds) < plan.looks[0]:
        return (f"{len(seeds)} seeds, short of the first look's {plan.looks[0]}",
                stats.INCONCLUSIVE, "")

    def read(n: int, k: int) -> tuple[str, tuple[str, stats.Interval]]:
        first = seeds[:n]
        interval = stats.ratio_interval([pairs[s][0] for s in first],
                                        [pairs[s][1] for s in first],
                                        plan.confidence(k, prereg.direction))
        return prereg.decide(interval), (f"{arm}: {top.split('.')[-1]} / "
                                         f"{bottom.split('.')[-1]} {interval.format(2)}",
                                         interval)

    k, verdict, (figure, interval) = plan.run(len(seeds), read)
    return (f"{figure}; {plan.looks[k]} seeds, look {k + 1} of {len(plan.looks)} at "
            f"{100 * interval.confidence:.2f}% ({interval.method})", verdict, "")


def _pair(kind: str, a: list[float], b: list[float], level: float,
          floor: float) -> stats.Interval:
    if kind == "ratio":
        return stats.ratio_interval(a, b, level)
    if kind == "binary":
        return stats_design.paired_binary([x > 0.5 for x in a], [y > 0.5 for y in b], level).interval
    return stats.paired_interval(a, b, level, sd_floor=floor)


def _gain_floor(records: list[dict], measure: str) -> float:
    """The least spread of a per-seed gain difference, in points: the held-out evaluation's
    own binomial noise on both arms, sqrt(2) * sqrt(p (1 - p) / eval_n)."""
    if measure != "gain":
        return 0.0
    found = [(r["accuracy_after"], r["eval_n"]) for r in records
             if isinstance(r.get("accuracy_after"), (int, float)) and r.get("eval_n")]
    if not found:
        return 0.0
    p = sum(a for a, _ in found) / len(found)
    return 100 * math.sqrt(2) * stats.binomial_se(p, int(min(n for _, n in found)))


def _every_arm(prereg, table: dict, base: str, seeds: list[int],
               level: float) -> tuple[str, str, stats.Interval]:
    """Every arm against `base` on `seeds`, together (`stats_design.many_vs_one`, Dunnett, at
    `level`): the claim that some arm differs (two-sided) or lies above or below holds when
    one arm's simultaneous interval does; it is refuted when every arm's refutes it."""
    shared = {arm: {s: values[s] for s in seeds} for arm, values in table.items()}
    found = stats_design.many_vs_one(shared, base, confidence=level)
    verdicts = {c.arm: prereg.decide(c.interval) for c in found}
    if stats.SUPPORTED in verdicts.values():
        verdict = stats.SUPPORTED
    elif all(v == stats.REFUTED for v in verdicts.values()):
        verdict = stats.REFUTED
    else:
        verdict = stats.INCONCLUSIVE
    top = max(found, key=lambda c: abs(c.interval.mean - prereg.threshold))
    shown = next((c for c in found if verdicts[c.arm] == stats.SUPPORTED), top)
    return (f"{len(found)} arms vs {base}, Dunnett; {shown.arm}: {shown.interval.format(2)}",
            verdict, shown.interval)


def _nan(value) -> float:
    return math.nan if value is None else float(value)


def _mde(interval: stats.Interval) -> float | None:
    """The smallest difference `stats.min_detectable` finds at the interval's seeds, from the
    spread its t interval implies (half-width = t sd / sqrt(n)); None for another kind."""
    method = interval.method
    linear_t = ("paired t" in method or method.startswith("t-interval")) and "log" not in method
    sd = stats_design.implied_sd(interval) if linear_t else None
    return None if sd is None else stats.min_detectable(sd, interval.n, interval.confidence)


GLANCE = ("claim", "the article says", "preregistered test", "seeds (planned)",
          "decisive figure [CI]", "80% power: effect / seeds", "verdict")


def glance_rows(results: list[ClaimResult]) -> list[dict]:
    """One row per claim (GLANCE): what the article says, the preregistered test, the seeds
    run against those planned, the decisive figure and the claim-level verdict."""
    out = []
    for r in results:
        decided = claim_verdict(r)
        per_arm: dict[str, set] = {}
        for record in r.records:
            per_arm.setdefault(record["arm"], set()).add(record["seed"])
        # seeds per arm: from the per-seed record where there is one (a finding over all
        # runs, such as a monitor's, counts runs, not seeds)
        seeds = max([len(v) for v in per_arm.values()] if per_arm
                    else [row["seeds"] for row in r.rows], default=0)
        planned = r.looks[-1] if r.looks else r.claim["preregistered"]["seeds"]
        out.append({"claim": claim_title(r),
                    "the article says": "(as above)" if r.replication
                    else r.claim["preregistered"]["article"],
                    "preregistered test": decided.test,
                    "seeds (planned)": f"{seeds} ({planned})",
                    "decisive figure [CI]": decided.figure,
                    "80% power: effect / seeds": decided.mde or "-",
                    "verdict": decided.verdict})
    return out


def replication_lines(results: list[ClaimResult], glance: list[dict]) -> list[str]:
    """For each replicated claim, a line saying whether the replication's verdict agrees
    with the original's (a verdict that flips is not a finding until explained)."""
    verdicts = {(r.file, r.claim.get("id"), bool(r.replication)): g["verdict"]
                for r, g in zip(results, glance)}
    out = []
    for r in results:
        if not r.replication or not r.records:
            continue
        original = verdicts.get((r.file, r.claim.get("id"), False))
        again = verdicts[(r.file, r.claim.get("id"), True)]
        same = "agrees with" if again == original else "differs from"
        out.append(f"- claim {r.claim.get('id')}: the replication at fresh seeds ({again}) "
                   f"{same} the original ({original}).")
    return ["", "Replications:", "", *out] if out else []


def claim_title(result: ClaimResult) -> str:
    """'2. <statement>', or for a replication '2, replicated at fresh seeds (first seeds
    100)'."""
    number = result.claim.get("id", "?")
    if result.replication:
        firsts = ", ".join(str(s) for s in result.replication)
        plural = "s" * (len(result.replication) > 1)
        return f"{number}, replicated at fresh seeds (first seed{plural} {firsts})"
    return f"{number}. {result.claim.get('statement', '')}"


def figure_name(result: ClaimResult) -> str:
    """The file name of a claim's figure: <claim file>-claim-<id>.svg (two files may answer
    parts of one claim, one file several claims)."""
    return f"{result.file.stem}-claim-{result.claim.get('id', 'x')}.svg"


def write_figures(results: list[ClaimResult], folder: str | Path) -> dict[str, str]:
    """One static SVG per claim that has findings (`labkit.lab.plots.finding_intervals`,
    exported by kaleido through a local Chrome or Chromium) into `folder`; returns
    {figure_name: the claim's title}. Raises RuntimeError, naming what is missing, when it
    cannot export."""
    import importlib.util

    from labkit.lab import plots

    try:
        found = importlib.util.find_spec("kaleido") is not None
    except ValueError:  # a module set to None in sys.modules: as if not installed
        found = False
    if not found:
        raise RuntimeError("static figures need kaleido: pip install 'labkit[figures]'")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for r in results:
        if not r.rows or r.replication:
            continue
        name = figure_name(r)
        fig = plots.finding_intervals(r.rows, title=f"claim {r.claim.get('id', '?')} "
                                                    f"({r.file.name})")
        try:
            fig.write_image(folder / name, format="svg")
        except Exception as e:  # noqa: BLE001 - kaleido's errors name the missing browser
            raise RuntimeError(f"kaleido could not export {name}: {e}") from e
        written[name] = f"claim {r.claim.get('id', '?')} ({r.file.name})"
    return written


def render(results: list[ClaimResult], commit: str | None, smoke: bool = False,
           figures: dict[str, str] | None = None, figures_dir: str = "findings") -> str:
    """The findings page as markdown; `figures` ({file name: title} of `write_figures`,
    under `figures_dir`, relative to the page) adds a figure per claim."""
    flag = " --smoke" if smoke else ""
    lines = ["# Findings", "",
             "Claims of the source articles and of the field's variants, each run as an "
             "experiment over paired seeds, with a 95% interval and a verdict: `supported` "
             "(the whole interval on the claim's side), "
             "`refuted` (the whole of it on the other side) or `inconclusive at this budget`. "
             "Generated by `python -m labkit findings` from the finished runs; do not edit by "
             "hand.", "",
             f"- page generated at commit `{commit or 'unknown'}`; each claim's runs name "
             "their own below",
             f"- regenerate: `python -m labkit findings --all{flag}` runs every claim "
             "(skipping finished runs) and writes this page; `--only <file>` runs one claim "
             "file; without `--all` the page is written from the finished runs and, for a "
             "claim whose runs are gone, from its per-seed CSV under findings/", ""]
    lines += ["## Claims at a glance", "",
              "Each claim decided by its preregistered primary measure (the claim's "
              "`preregistered:` block, `labkit.lab.preregistration`); the findings below are "
              "the context.", "",
              "| " + " | ".join(GLANCE) + " |", "|" + "---|" * len(GLANCE)]
    glance = glance_rows(results)
    for row in glance:
        cells = [_cell(row[c]) for c in GLANCE]
        cells[-1] = f"**{cells[-1]}**"
        lines.append("| " + " | ".join(cells) + " |")
    lines += replication_lines(results, glance)
    lines += ["", "## Every finding", "",
              "Each claim's findings, the decisive one and the context, with their intervals, "
              f"methods and verdicts: [{figures_dir}/{EVERY_PAGE}]({figures_dir}/{EVERY_PAGE}).",
              ""]
    notes = [r for r in results if r.claim.get("note")]
    if notes:
        lines += ["", "## How to read them", ""]
        lines += [f"- claim {r.claim.get('id', '?')}: {' '.join(str(r.claim['note']).split())}"
                  for r in notes]
    if figures:
        lines += ["", "## Figures", "",
                  "Each finding's effect with its 95% interval (green supported, red refuted, "
                  "grey inconclusive) and the threshold the claim needs it to clear (the dark "
                  "tick).", ""]
        for name, title in figures.items():
            lines += [f"### {title[0].upper()}{title[1:]}", "",
                      f"![{title}]({figures_dir}/{name})", ""]
    lines += ["", "## Commands and compute", ""]
    sweeps = {r.record_name: r.elapsed_s for r in results}  # a file answering two claims ran once
    lines += [f"The whole suite took {sum(sweeps.values()) / 3600:.2f} h of wall time "
              f"({len(sweeps)} sweeps, one after another, each running its training runs in "
              "parallel worker processes, on the machines named in the table).", ""]
    for r in results:
        hours = r.compute_s / 3600
        made = (f", made at commit{'s' * (len(r.commits) > 1)} {', '.join(sorted(r.commits))}"
                if r.commits else "")
        again = " (replication)" if r.replication else ""
        where = "; ".join(sorted({f"{rec['cpu']}, torch {rec.get('torch', '?')}"
                                  for rec in r.records if rec.get("cpu")}))
        if r.machines:  # the CPU's capability and the threads each run had
            where = "; ".join(filter(None, [where, *sorted(r.machines)]))
        lines.append(f"- claim {r.claim.get('id', '?')}{again}: `python -m labkit findings "
                     f"--all --only {r.file.stem}{flag}`; {r.runs_done} of "
                     f"{r.runs_total} batches run{made}, {hours:.2f} h of training runs' "
                     f"wall time, {r.elapsed_s / 60:.0f} min elapsed"
                     + (f", on {where}" if where else ""))
    return "\n".join(lines) + "\n"


EVERY_PAGE = "every-finding.md"
"""The page of every finding, in the folder beside the findings page (docs/findings/)."""


def render_every(results: list[ClaimResult], commit: str | None) -> str:
    """Every finding of every claim (PAGE_COLUMNS), one table, as markdown."""
    lines = ["# Every finding", "",
             "Generated with docs/findings.md by `python -m labkit findings` (at commit "
             f"`{commit or 'unknown'}`); each claim's statement, preregistered test and "
             "claim-level verdict are there. A row's run (in brackets) is the sweep run "
             "that measured it where the claim has several.", "",
             "| " + " | ".join(PAGE_COLUMNS) + " |", "|" + "---|" * len(PAGE_COLUMNS)]
    for row in table_rows(results):
        cells = [_cell(row["number"] if c == "claim" else row[c]) for c in PAGE_COLUMNS]
        cells[-1] = f"**{cells[-1]}**" if cells[-1] else ""
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_claims(claims_dir: str | Path = CLAIMS_DIR, root: str | Path | None = None,
               smoke: bool = False, workers: int = 1,
               only: list[str] | None = None) -> list[str]:
    """Run every claim's sweep, batch by batch: a claim file's first seeds under `seeds:`
    are its batches, run in order until every claim the file answers is decided by its
    preregistered plan (`claim_verdict`) or its batches are spent, then its `replication:`
    batches, all of them. `only` names the claim
    files to run (their stems, such as "03_group_size"); the others are left as they are.
    Every claim file is checked before the first run; finished runs are skipped, so the
    suite resumes. Returns the ids of the runs that failed."""
    import dataclasses

    from labkit.lab.sweeps import load_sweep, run_sweep
    from labkit.rundir import RUNS_ROOT

    root = Path(RUNS_ROOT if root is None else root)
    files = sorted(Path(claims_dir).glob("*.yaml"))
    if only is not None:
        unknown = sorted(set(only) - {f.stem for f in files})
        if unknown:
            raise ValueError(f"--only: no claim file {', '.join(unknown)} in {claims_dir} "
                             f"(the files are {', '.join(f.stem for f in files)})")
        files = [f for f in files if f.stem in only]
    sweeps = [(f, load_sweep(f, smoke=smoke)) for f in files]  # every claim checked first
    failed = []
    for file, sweep in sweeps:
        for k in range(1, len(sweep.seeds) + 1):
            runs = run_sweep(dataclasses.replace(sweep, seeds=sweep.seeds[:k]), root,
                             workers=workers)
            failed += [r.id for r in runs if r.status == "failed"]
            answered = [r for r in collect(claims_dir, root, smoke)
                        if r.file == file and not r.replication]
            if all(claim_verdict(r).verdict != stats.INCONCLUSIVE for r in answered):
                break
        if sweep.replication:  # read once, at all its seeds: every batch runs
            runs = run_sweep(dataclasses.replace(sweep, seeds=sweep.replication), root,
                             workers=workers)
            failed += [r.id for r in runs if r.status == "failed"]
    return failed


def write_findings(out: str | Path = FINDINGS_PAGE, claims_dir: str | Path = CLAIMS_DIR,
                   root: str | Path | None = None, smoke: bool = False,
                   figures: bool = False) -> Path:
    """Collect the claims' findings and write the page to `out`, and each claim file's
    per-seed record (`write_records`) into the folder named like the page (docs/findings/
    beside docs/findings.md), from which a later page decides a claim whose runs are gone;
    with `figures`, an SVG per claim into that folder too.
    Figures that cannot be exported are said in one line on stderr; the page is written
    without them."""
    import sys

    from labkit.rundir import git_commit

    out = Path(out)
    folder = out.with_suffix("")  # docs/findings/ beside docs/findings.md
    results = collect(claims_dir, root, smoke, records_dir=folder)
    for result in {r.record_name: r for r in results if r.runs_done}.values():  # one per file
        write_records(result.records, folder / result.record_name)
    drawn = None
    if figures:
        try:
            drawn = write_figures(results, out.with_suffix(""))
        except RuntimeError as e:
            print(f"warning: no figures: {e}", file=sys.stderr)
    commit = git_commit()
    text = render(results, commit, smoke, drawn, out.with_suffix("").name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EVERY_PAGE).write_text(render_every(results, commit), encoding="utf-8")
    return out
