"""The findings pages: docs/findings.md (a row per claim at a glance, then a row per finding)
and docs/findings/<claim file>.md (every finding of a file), from the claims' results (`labkit.lab.claims`), with a
static figure per claim."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from labkit.formulas import stats
from labkit.lab import confirm, plots
from labkit.lab.claims import NOT_TESTABLE, ClaimResult, ClaimVerdict, claim_verdict

NOT_RUN_HERE = "not run here"
"""The verdict of a claim a `--set` could not move to its model or task (labkit.lab.retarget):
the figure says why."""


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
        number = f"{r.claim.get('id', '?')}" + (" (replication)" if r.replication else
                                                 " (confirmatory)" if r.confirmatory else "")
        if not r.rows and r.confirmatory:  # not run yet: the page's table says so
            continue
        if not r.rows:
            said = r.not_run or f"not run yet ({r.runs_done} of {r.runs_total} runs)"
            out.append(dict.fromkeys(COLUMNS, "") | {
                "claim": head, "source": source, "number": number, "measured": said,
                "question": said, "where": "", "measure": "",
                "verdict": NOT_RUN_HERE if r.not_run else ""})
            continue
        for row in r.rows:
            where = "" if row["run"] == "seed=0" else f" ({row['run']})"
            out.append({"claim": head, "source": source, "number": number,
                        "measured": f"{row['question']}"
                                    f"{': ' + row['measure'] if row['measure'] else ''}{where}",
                        "question": row["question"], "where": where, "measure": row["measure"],
                        "effect [95% CI]": row["effect"], "seeds": row["seeds"],
                        "method": row["method"], "machine": machine, "verdict": row["verdict"]})
    return out


GLANCE = ("claim", "the article says", "preregistered test", "seeds (planned)",
          "decisive figure [CI]", "80% power: effect / seeds", "verdict")


def glance_rows(results: list[ClaimResult]) -> list[dict]:
    """One row per claim (GLANCE): what the article says, the preregistered test, the seeds
    run against those planned, the decisive figure and the claim-level verdict."""
    out = []
    for r in results:
        decided = claim_verdict(r) if r.not_run is None else ClaimVerdict(
            "-", r.not_run, NOT_RUN_HERE)
        per_arm: dict[str, set] = {}
        for record in r.records:
            per_arm.setdefault(record["arm"], set()).add(record["seed"])
        # seeds per arm: from the per-seed record where there is one (a finding over all
        # runs, such as a monitor's, counts runs, not seeds)
        seeds = max([len(v) for v in per_arm.values()] if per_arm
                    else [row["seeds"] for row in r.rows], default=0)
        planned = r.looks[-1] if r.looks else r.claim["preregistered"]["seeds"]
        seeds = min(seeds, int(planned))  # a file's later looks for another claim: not read
        # confirmatory only where every run used the reserved seeds (labkit.lab.confirm)
        ranges = {confirm.seed_range(int(rec["seed"])) for rec in r.records}
        kind = "confirmatory" if ranges == {"confirmatory"} and not r.changed else (
            r.changed or "exploratory")
        out.append({"claim": claim_title(r),
                    "the article says": "(as above)" if r.replication or r.confirmatory
                    else "(as restated)" if r.claim.get("restated")
                    else r.claim["preregistered"]["article"],
                    "preregistered test": decided.test,
                    "seeds (planned)": f"{seeds} ({planned}), {kind}",
                    "seeds run": seeds, "seeds planned": int(planned),
                    "decisive figure [CI]": decided.figure,
                    "80% power: effect / seeds": decided.mde or "-",
                    "verdict": decided.verdict})
    return out


def replication_lines(results: list[ClaimResult], glance: list[dict]) -> list[str]:
    """For each replicated claim, its decisive figure and a line saying whether the
    replication's verdict agrees with the original's (a verdict that flips is not a finding
    until explained)."""
    rows = {(r.file, r.claim.get("id"), r.order): g for r, g in zip(results, glance)}
    out = []
    for r in results:
        if not r.replication or not r.records:
            continue
        original = rows[(r.file, r.claim.get("id"), 0)]["verdict"]
        row = rows[(r.file, r.claim.get("id"), 1)]
        again = row["verdict"]
        same = "agrees with" if again == original else "differs from"
        out.append(f"- {claim_title(r)}, exploratory: {_short(row)}; **{again}**, which "
                   f"{same} the original ({original}).")
    return ["", "Replications:", "", *out] if out else []


def _without_methods(figure: str) -> str:
    """A decisive figure without its methods in brackets (each claim file's page has them):
    'a vs b: 1.2 [0.5, 1.9]; 5 seeds, look 1 of 2 at 96.90% (paired t over 5 seeds)' -> the
    same without ' (paired t over 5 seeds)'."""
    import re

    return re.sub(r" \((?:paired t|t-interval|Newcombe|Wilson|mean of|exact|sign)[^()]*"
                  r"(?:\([^()]*\)[^()]*)*\)", "", figure)


def _short(row: dict) -> str:
    """A glance row's decisive figure without its method, with its seeds: 'ppo vs grpo: 1.92
    [1.92, 1.93]; 5 of 10 seeds'."""
    figure = row["decisive figure [CI]"].split("; ")[0]
    seeds = row["seeds (planned)"].split(",")[0]  # '5 (10)'
    done, _, planned = seeds.partition(" (")
    return f"{figure}; {done} of {planned.rstrip(')')} seeds" if planned else figure


SIDE_BY_SIDE = ("claim", "the article says", "preregistered test", "exploratory",
                "confirmatory", "why they differ")
"""The page's first table: each claim's exploratory and confirmatory verdicts side by side."""

DECIDED = (stats.SUPPORTED, stats.REFUTED, stats.INCONCLUSIVE, NOT_TESTABLE)


def side_by_side(results: list[ClaimResult], glance: list[dict]) -> list[dict]:
    """One row per claim (SIDE_BY_SIDE), its exploratory result beside its confirmatory one
    (or 'not run yet'), and where the two verdicts differ, why (`flip_reason`); a claim
    `restated:` elsewhere is left out (listed apart as an earlier statement)."""
    by_key = {(r.file, r.claim.get("id"), r.order): (r, g) for r, g in zip(results, glance)}
    out = []
    for r, g in zip(results, glance):
        if r.order != 0 or r.claim.get("restated"):
            continue
        confirmed = by_key.get((r.file, r.claim.get("id"), 2))
        row = {"claim": claim_title(r), "the article says": g["the article says"],
               "preregistered test": g["preregistered test"],
               "exploratory": f"**{g['verdict']}**: "
                              f"{r.not_run if r.not_run is not None else _short(g)}",
               "exploratory verdict": g["verdict"], "confirmatory verdict": None}
        if confirmed is None or not confirmed[0].records:
            runs = (f" ({confirmed[0].runs_done} of {confirmed[0].runs_total} batches)"
                    if confirmed is not None else "")
            row |= {"confirmatory": f"not run yet{runs}", "why they differ": "-"}
        else:
            c, cg = confirmed
            power = f"; 80% power: {cg['80% power: effect / seeds']}" \
                if cg["80% power: effect / seeds"] != "-" else ""
            row |= {"confirmatory": f"**{cg['verdict']}**: "
                                    f"{_without_methods(cg['decisive figure [CI]'])}{power}",
                    "confirmatory verdict": cg["verdict"],
                    "why they differ": flip_reason(r, g, c, cg)}
        out.append(row)
    return out


def flip_reason(explored: ClaimResult, explored_row: dict, confirmed: ClaimResult,
                confirmed_row: dict) -> str:
    """Why a claim's confirmatory verdict differs from its exploratory one, in words: a plan
    changed after it froze, the settings the confirmatory run changed (a tuned comparator),
    a comparator that collapsed in one and not the other, a positive control that moved the
    measure in one only, more seeds where the exploratory verdict stood before its plan's
    last look, else a seed effect (the same plan and settings at fresh seeds);
    'agree' where the verdicts are the same."""
    if confirmed.changed:
        return confirmed.changed
    before, after = explored_row["verdict"], confirmed_row["verdict"]
    if verdict_kind(before) == verdict_kind(after):
        return "agree"
    reasons = []
    tuned = confirmed.changed_settings.get("tuned")
    if tuned:
        reasons.append(f"a tuned comparator: each arm at its tuned settings ({tuned})")
    other = {k: v for k, v in confirmed.changed_settings.items() if k != "tuned"}
    if other:
        reasons.append("changed settings: " + ", ".join(f"{k}={v}" for k, v in other.items()))
    for verdict, where in ((before, "exploratory"), (after, "confirmatory")):
        if verdict.startswith("comparator collapsed"):
            reasons.append(f"the comparator collapsed in the {where} runs")
        if verdict == NOT_TESTABLE:
            reasons.append(f"the positive control did not move the measure in the {where} "
                           "runs")
    overlap = _overlap(explored_row["decisive figure [CI]"], confirmed_row["decisive figure [CI]"])
    run, planned = explored_row["seeds run"], explored_row["seeds planned"]
    more = confirmed_row["seeds run"]
    if not reasons and run < planned and more > run:
        reasons.append(f"more seeds: the exploratory verdict stood at {run} of its {planned} "
                       f"planned seeds (its later looks not run), the confirmatory at {more}"
                       + overlap)
    if not reasons:
        reasons.append("a seed effect: the same plan and settings at fresh seeds" + overlap)
    return "; ".join(reasons)


def _overlap(explored: str, confirmed: str) -> str:
    """'; the confirmatory estimate 0.12 lies inside the exploratory interval [0.05, 0.30]'
    (or outside it), from the two decisive figures; '' where either has no interval."""
    import re

    found = [re.search(r"(-?[\d.]+) \[(-?[\d.]+), (-?[\d.]+)\]", f.split("; ")[0])
             for f in (explored, confirmed)]
    if not all(found):
        return ""
    low, high = float(found[0].group(2)), float(found[0].group(3))
    mean = float(found[1].group(1))
    where = "inside" if low <= mean <= high else "outside"
    return (f"; the confirmatory estimate {found[1].group(1)} lies {where} the exploratory "
            f"interval [{found[0].group(2)}, {found[0].group(3)}]")


def verdict_kind(verdict: str) -> str:
    """A verdict without its counts: 'comparator collapsed on 2 of 5 seeds' -> 'comparator
    collapsed' (two such verdicts agree whatever their counts)."""
    return "comparator collapsed" if verdict.startswith("comparator collapsed") else verdict


def _counted(verdicts: list[str]) -> str:
    """'3 supported, 2 inconclusive, 1 comparator collapsed': verdicts counted, most first."""
    counts: dict[str, int] = {}
    for verdict in verdicts:
        kind = "inconclusive" if verdict == stats.INCONCLUSIVE else verdict_kind(verdict)
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items(),
                                                          key=lambda kv: (-kv[1], kv[0])))


def summary_paragraph(pairs: list[dict], on: bool = False) -> str:
    """How many claims the confirmatory runs supported, refuted, left inconclusive, found
    not testable or found with a collapsed comparator, how many are not run yet, and which
    verdicts changed; `on` (claims re-pointed by --set, exploratory there): the exploratory
    verdicts counted, those not run here among them."""
    if on:
        return (f"Of {len(pairs)} claims on these settings: "
                f"{_counted([p['exploratory verdict'] for p in pairs])}.")
    run = [p for p in pairs if p["confirmatory verdict"] is not None]
    said = _counted([p["confirmatory verdict"] for p in run])
    flips = [f"{p['claim'].split('.')[0]} ({p['exploratory verdict']} -> "
             f"{p['confirmatory verdict']})" for p in run
             if verdict_kind(p["confirmatory verdict"]) != verdict_kind(p["exploratory verdict"])]
    waiting = len(pairs) - len(run)
    head = (f"Of {len(pairs)} claims, {len(run)} have" if waiting else
            f"All {len(pairs)} claims have")
    if waiting == 0:
        rest = ". "
    elif waiting == 1:
        rest = ("; 1 is not run at confirmatory seeds yet, its exploratory verdict standing "
                "as exploratory. ")
    else:
        rest = (f"; {waiting} are not run at confirmatory seeds yet, their exploratory verdicts "
                "standing as exploratory. ")
    text = f"{head} a confirmatory verdict" + (f": {said}" if said else "") + rest
    text += (f"Verdicts that changed at confirmatory seeds: {'; '.join(flips)}." if flips
             else "No verdict changed at confirmatory seeds." if run else "")
    return text.strip()


def claim_title(result: ClaimResult) -> str:
    """'2. <statement>', or for a replication '2, replicated at fresh seeds (first seeds
    100)'."""
    number = result.claim.get("id", "?")
    if result.replication:
        firsts = ", ".join(str(s) for s in result.replication)
        plural = "s" * (len(result.replication) > 1)
        return f"{number}, replicated at fresh seeds (first seed{plural} {firsts})"
    if result.confirmatory:
        return f"{number}, confirmatory"
    restated = result.claim.get("restated")
    label = f" (exploratory; restated in {restated})" if restated else ""
    return f"{number}. {result.claim.get('statement', '')}{label}"


def figure_name(result: ClaimResult) -> str:
    """The file name of a claim's figure: <claim file>-claim-<id>.svg (two files may answer
    parts of one claim, one file several claims)."""
    return f"{result.file.stem}{'-confirmatory' * result.confirmatory}-claim-" \
           f"{result.claim.get('id', 'x')}.svg"


def write_figures(results: list[ClaimResult], folder: str | Path) -> dict[str, str]:
    """One static SVG per claim that has findings (`labkit.lab.plots.finding_intervals`,
    exported by kaleido through a local Chrome or Chromium) into `folder`; returns
    {figure_name: the claim's title}. Raises RuntimeError, naming what is missing, when it
    cannot export."""
    import importlib.util

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


def _flag(smoke: bool, on: dict[str, str] | None) -> str:
    """The flags that regenerate a page: ' --smoke --set model=DIR ...'."""
    return (" --smoke" if smoke else "") + "".join(f" --set {k}={v}" for k, v in (on or {}).items())


def render(results: list[ClaimResult], commit: str | None, smoke: bool = False,
           figures_dir: str = "findings", on: dict[str, str] | None = None,
           glance: list[dict] | None = None) -> str:
    """The findings page as markdown (each claim file's notes and figures are on its own
    page, `render_every`); `on`: the fields a `--set` re-pointed the claims at, named in the
    title and the commands, with the claims that could not run there and why; `glance`:
    `glance_rows(results)` where the caller has them already."""
    flag = _flag(smoke, on)
    head = "# Findings" + (f" on {', '.join(f'{k} {v}' for k, v in on.items() if k in ('model', 'task')) or 'your settings'}" if on else "")
    lines = [head, "",
             "Claims of the source articles and of the field's variants, each run as an "
             "experiment over paired seeds, with a 95% interval and a verdict: `supported` "
             "(the whole interval on the claim's side), "
             "`refuted` (the whole of it on the other side) or `inconclusive at this budget`; "
             "`not testable here` where the measure can stay put (a length, a monitor) and "
             "neither the runs nor the claim's positive control moved it; `comparator "
             "collapsed on k of n seeds` where the arm compared against collapsed. "
             "Each claim is its own family (its looks and arms share its 5%); "
             "none across claims. Generated by `python -m labkit findings` from the finished runs; do not edit by "
             "hand.", "",
             *([f"Every claim re-pointed at {', '.join(f'{k}={v}' for k, v in on.items())} "
                "(labkit.lab.retarget): exploratory there, its runs and page apart from the "
                "project's; a claim that cannot run there says why.", ""] if on else []),
             f"- page generated at commit `{commit or 'unknown'}`; each claim's runs name "
             "their own below",
             f"- regenerate: `python -m labkit findings --all{flag}` runs every claim "
             "(skipping finished runs) and writes this page; `--only <file>` runs one claim "
             "file; `--confirmatory` runs the confirmatory stages; without `--all` the page is written from the finished runs and, for a "
             "claim whose runs are gone, from its per-seed CSV under findings/", ""]
    glance = glance_rows(results) if glance is None else glance
    pairs = side_by_side(results, glance)
    lines += ["## Claims at a glance", "", summary_paragraph(pairs, on=bool(on)), "",
              "Each claim decided by its preregistered primary measure (the claim's "
              "`preregistered:` block, `labkit.lab.preregistration`): *exploratory* on the "
              "seeds its pilot used, *confirmatory* at reserved seeds from "
              f"{confirm.CONFIRM_FROM}, under a plan frozen before their first run (the claim "
              "file's `confirmatory:` stage, `python -m labkit findings --all "
              "--confirmatory`). Where the two differ, the last column says why. The "
              "findings below are the context.", "",
              "| " + " | ".join(SIDE_BY_SIDE) + " |", "|" + "---|" * len(SIDE_BY_SIDE)]
    for row in pairs:
        lines.append("| " + " | ".join(_cell(row[c]) for c in SIDE_BY_SIDE) + " |")
    lines += replication_lines(results, glance)
    ids = ", ".join(dict.fromkeys(str(r.claim.get("id", "?")) for r in results
                                  if _first_statement(r)))
    if ids:
        lines += ["", f"Earlier statements of claims {ids}, each restated in another file "
                      f"and decided there: [earlier statements]({figures_dir}/{EARLIER_PAGE})."]
    pages = list(dict.fromkeys(every_page(r) for r in results))
    lines += ["", "## Every finding", "",
              "Each claim's findings, the decisive one and the context, with their intervals, "
              "methods and verdicts, a page per claim file: "
              + ", ".join(f"[{p.removesuffix('.md')}]({figures_dir}/{p})" for p in pages)
              + ".", ""]
    lines += ["Each claim file's page also says how to read its findings (the claims' notes) "
              "and draws each finding's effect with its interval.", ""]
    hours = sum(_sweeps(results).values()) / 3600
    lines += ["", "## Commands and compute", "",
              f"The whole suite took {hours:.2f} h of wall time; each claim file's command, "
              "batches, commits, machine and wall time are on their own page: "
              f"[compute]({figures_dir}/{COMPUTE_PAGE}).", ""]
    return "\n".join(lines) + "\n"


def earlier_lines(results: list[ClaimResult], glance: list[dict]) -> list[str]:
    """One line per earlier statement of a claim (its file restates it elsewhere): the
    statement's test, its exploratory and confirmatory verdicts, and the file restating it."""
    rows = {(r.file, r.claim.get("id"), r.order): (r, g) for r, g in zip(results, glance)}
    earlier = []
    for r, row in zip(results, glance):
        if _first_statement(r):
            c, cg = rows.get((r.file, r.claim.get("id"), 2), (None, None))
            again = (f"; confirmatory: {_short(cg)}, **{cg['verdict']}**"
                     if c is not None and c.records else "")
            earlier.append(f"- {r.claim.get('id', '?')} ({r.file.name}): "
                           f"{row['preregistered test']}: {_short(row)}, "
                           f"**{row['verdict']}**{again}; restated in "
                           f"{str(r.claim['restated']).split(' (')[0]}")
    return earlier


def _first_statement(result: ClaimResult) -> bool:
    """Whether a result is a claim's earlier statement (its file restates it elsewhere)."""
    return bool(result.claim.get("restated")) and result.order == 0


def render_earlier(results: list[ClaimResult], commit: str | None,
                   glance: list[dict] | None = None) -> str:
    """The page of the claims' earlier statements, linked from the findings page's table;
    `glance` as for `render`."""
    return "\n".join(["# Earlier statements", "",
                      "Generated with docs/findings.md by `python -m labkit findings` (at "
                      f"commit `{commit or 'unknown'}`). Each line: a claim as its file first "
                      "stated it, that statement's test and verdicts (exploratory, then "
                      "confirmatory where run), and the file that restates it; the restated "
                      "claim is the one the findings page decides. The findings are on the "
                      "files' own pages.", "",
                      *earlier_lines(results, glance_rows(results) if glance is None
                                     else glance)]) + "\n"


EARLIER_PAGE = "earlier.md"
"""The page of the claims' earlier statements, beside the compute page."""

COMPUTE_PAGE = "compute.md"
"""The page of every claim file's command, batches, commits, machine and wall time, in the
folder beside the findings page."""


def _sweeps(results: list[ClaimResult]) -> dict[str, float]:
    """Each sweep run's elapsed seconds, once (a file answering two claims ran once)."""
    return {r.record_name: r.elapsed_s for r in results if r.runs_done}


def render_compute(results: list[ClaimResult], commit: str | None, smoke: bool = False,
                   on: dict[str, str] | None = None) -> str:
    """The commands and compute of the findings page's claims: one line per claim file and
    stage, with its batches, commits, training runs' wall time and elapsed time, the machine
    said once where every run shared it."""
    flag = _flag(smoke, on)
    lines = ["# Commands and compute", "",
             "Generated with docs/findings.md by `python -m labkit findings` (at commit "
             f"`{commit or 'unknown'}`).", ""]
    sweeps = _sweeps(results)
    lines += [f"The whole suite took {sum(sweeps.values()) / 3600:.2f} h of wall time "
              f"({len(sweeps)} sweep{'s' * (len(sweeps) != 1)}, one after another, each "
              "running its training runs in parallel worker processes). Each line: the claims, "
              f"the claim file (`python -m labkit findings --all [--confirmatory] --only "
              f"FILE{flag}` runs it), its batches run, the commits its runs were made at, "
              "the training runs' wall time and the time elapsed.", ""]
    places = {}
    for r in results:
        where = "; ".join(sorted({f"{rec['cpu']}, torch {rec.get('torch', '?')}"
                                  for rec in r.records if rec.get("cpu")}))
        if r.machines:  # the CPU's capability and the threads each run had
            where = "; ".join(filter(None, [where, *sorted(r.machines)]))
        places[id(r)] = where
    shared = {w for w in places.values() if w}
    if len(shared) == 1:  # one machine for every run: said once
        lines += [f"Every run on {shared.pop()}.", ""]
        places = {k: "" for k in places}
    elif shared:  # the most common said once, the others on their lines
        common = max(shared, key=lambda w: (list(places.values()).count(w), w))
        lines += [f"Runs on {common} unless their line names another machine.", ""]
        places = {k: ("" if w == common else w) for k, w in places.items()}
    runs: dict[tuple, list] = {}  # the claims of one file share its runs: one line for them
    for r in results:
        runs.setdefault((r.file.stem, r.order), []).append(r)
    for (stem, order), group in runs.items():
        r = group[0]
        if order == 2 and not r.runs_done:  # a confirmatory stage not run: the table says so
            continue
        ids = ", ".join(dict.fromkeys(str(g.claim.get("id", "?")) for g in group))
        hours = r.compute_s / 3600
        made = f", {', '.join(sorted(r.commits))}" if r.commits else ""
        again = " (replication)" if order == 1 else " (confirmatory)" if order == 2 else ""
        stage = ""
        where = places[id(r)]
        lines.append(f"- {ids}{again}: `{stem}`{stage}; {r.runs_done} of {r.runs_total} "
                     f"batches{made}, {hours:.2f} h of runs, {r.elapsed_s / 60:.0f} min"
                     + (f", on {where}" if where else ""))
    return "\n".join(lines) + "\n"


def every_page(result: ClaimResult) -> str:
    """The page of every finding of a claim file (its replication's too), in the folder
    beside the findings page (docs/findings/<file>.md)."""
    return f"{result.file.stem}.md"


def render_every(results: list[ClaimResult], commit: str | None,
                 figures: dict[str, str] | None = None) -> dict[str, str]:
    """Every finding (PAGE_COLUMNS) of each claim file, one markdown table per file, with
    the claims' notes and their figures (`write_figures`' names, in the page's own
    folder): page name -> text."""
    files: dict[str, list[ClaimResult]] = {}
    for result in results:
        files.setdefault(every_page(result), []).append(result)
    return {name: _every_text(name, found, commit, figures or {})
            for name, found in files.items()}


def _every_text(name: str, results: list[ClaimResult], commit: str | None,
                figures: dict[str, str]) -> str:
    ids = ", ".join(dict.fromkeys(str(r.claim.get("id", "?")) for r in results))
    lines = [f"# Every finding: {name.removesuffix('.md')} (claim {ids})", "",
             "Generated with docs/findings.md by `python -m labkit findings` (at commit "
             f"`{commit or 'unknown'}`); each claim's statement, preregistered test and "
             "claim-level verdict are there. A row's run (in brackets) is the sweep run "
             "that measured it where the claim has several; findings that share a measure "
             "(a claim's exploratory and confirmatory runs, a rule's thresholds) are listed "
             "under it, once.", ""]
    merged: dict[tuple, list[str]] = {}  # a finding two claims of the file share: one row
    shape: dict[tuple, tuple[str, str]] = {}  # its measure, and the finding without it
    for row in table_rows(results):
        key = tuple(str(row[c]) for c in PAGE_COLUMNS if c != "claim")
        merged.setdefault(key, []).append(str(row["number"]))
        shape[key] = (str(row["measure"]), f"{row['question']}{row['where']}")
    shared = Counter(measure for measure, _ in shape.values() if measure)
    blocks: dict[str, list[str]] = {}  # measure ("" for the findings alone in theirs) -> rows
    for key, numbers in merged.items():
        measure, finding = shape[key]
        measure = measure if shared[measure] > 1 else ""
        cells = ([_cell(", ".join(dict.fromkeys(numbers)))]
                 + [_cell(finding if measure else key[0])] + [_cell(v) for v in key[1:]])
        cells[-1] = f"**{cells[-1]}**" if cells[-1] else ""
        blocks.setdefault(measure, []).append("| " + " | ".join(cells) + " |")
    if "" in blocks:  # first, with their measures in the row
        lines += ["| " + " | ".join(PAGE_COLUMNS) + " |", "|" + "---|" * len(PAGE_COLUMNS),
                  *blocks.pop("")]
    head = ("claim", "finding", *PAGE_COLUMNS[2:])
    for measure, rows in blocks.items():
        if lines[-1]:
            lines.append("")
        lines += [f"### Measured as: {measure}", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head), *rows]
    notes = dict.fromkeys((r.claim.get("id", "?"), " ".join(str(r.claim["note"]).split()))
                          for r in results if r.claim.get("note"))  # a replication's once
    if notes:
        lines += ["", "## How to read them", ""]
        lines += [f"- claim {claim}: {note}" for claim, note in notes]
    drawn = {figure_name(r): figures[figure_name(r)] for r in results
             if figure_name(r) in figures}
    if drawn:
        lines += ["", "## Figures", "",
                  "Each finding's effect with its 95% interval (green supported, red refuted, "
                  "grey inconclusive) and the threshold the claim needs it to clear (the dark "
                  "tick).", ""]
        for figure, title in drawn.items():
            lines += [f"### {title[0].upper()}{title[1:]}", "", f"![{title}]({figure})", ""]
    return "\n".join(lines) + "\n"
