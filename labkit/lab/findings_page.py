"""The findings pages: docs/findings.md (a row per claim at a glance, then a row per finding)
and docs/findings/<claim file>.md (every finding of a file), from the claims' results (`labkit.lab.claims`), with a
static figure per claim."""

from __future__ import annotations

from pathlib import Path

from labkit.lab import confirm, plots
from labkit.lab.claims import ClaimResult, claim_verdict


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
                        "measured": f"{row['question']}"
                                    f"{': ' + row['measure'] if row['measure'] else ''}{where}",
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
        decided = claim_verdict(r)
        per_arm: dict[str, set] = {}
        for record in r.records:
            per_arm.setdefault(record["arm"], set()).add(record["seed"])
        # seeds per arm: from the per-seed record where there is one (a finding over all
        # runs, such as a monitor's, counts runs, not seeds)
        seeds = max([len(v) for v in per_arm.values()] if per_arm
                    else [row["seeds"] for row in r.rows], default=0)
        planned = r.looks[-1] if r.looks else r.claim["preregistered"]["seeds"]
        # confirmatory only where every run used the reserved seeds (labkit.lab.confirm)
        ranges = {confirm.seed_range(int(rec["seed"])) for rec in r.records}
        kind = "confirmatory" if ranges == {"confirmatory"} and not r.changed else (
            r.changed or "exploratory")
        out.append({"claim": claim_title(r),
                    "the article says": "(as above)" if r.replication
                    else "(as restated)" if r.claim.get("restated")
                    else r.claim["preregistered"]["article"],
                    "preregistered test": decided.test,
                    "seeds (planned)": f"{seeds} ({planned}), {kind}",
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
    restated = result.claim.get("restated")
    label = f" (exploratory; restated in {restated})" if restated else ""
    return f"{number}. {result.claim.get('statement', '')}{label}"


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
           figures_dir: str = "findings") -> str:
    """The findings page as markdown (each claim file's notes and figures are on its own
    page, `render_every`)."""
    flag = " --smoke" if smoke else ""
    lines = ["# Findings", "",
             "Claims of the source articles and of the field's variants, each run as an "
             "experiment over paired seeds, with a 95% interval and a verdict: `supported` "
             "(the whole interval on the claim's side), "
             "`refuted` (the whole of it on the other side) or `inconclusive at this budget`; "
             "`not testable here` where the measure can stay put (a length, a monitor) and "
             "neither the runs nor the claim's positive control moved it; `comparator "
             "collapsed on k of n seeds` where the arm compared against collapsed. "
             "*Confirmatory* only at seeds from 1000 (labkit.lab.confirm), else "
             "*exploratory*. Each claim is its own family (its looks and arms share its 5%); "
             "none across claims. Generated by `python -m labkit findings` from the finished runs; do not edit by "
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
    earlier = []
    for r, row in zip(results, glance):
        if r.claim.get("restated") and not r.replication:  # listed below the table
            earlier.append(f"- {r.claim.get('id', '?')} ({r.file.name}): {row['preregistered test']}: "
                           f"{row['decisive figure [CI]'].split('; ')[0]}, "
                           f"**{row['verdict']}**; restated in "
                           f"{str(r.claim['restated']).split(' (')[0]}")
            continue
        cells = [_cell(row[c]) for c in GLANCE]
        cells[-1] = f"**{cells[-1]}**"
        lines.append("| " + " | ".join(cells) + " |")
    lines += replication_lines(results, glance)
    if earlier:
        lines += ["", "Earlier statements, exploratory, each restated in the file it names "
                      "(their findings are on their files' pages):", "", *earlier]
    pages = list(dict.fromkeys(every_page(r) for r in results))
    lines += ["", "## Every finding", "",
              "Each claim's findings, the decisive one and the context, with their intervals, "
              "methods and verdicts, a page per claim file: "
              + ", ".join(f"[{p.removesuffix('.md')}]({figures_dir}/{p})" for p in pages)
              + ".", ""]
    lines += ["Each claim file's page also says how to read its findings (the claims' notes) "
              "and draws each finding's effect with its interval.", ""]
    lines += ["", "## Commands and compute", ""]
    sweeps = {r.record_name: r.elapsed_s for r in results}  # a file answering two claims ran once
    lines += [f"The whole suite took {sum(sweeps.values()) / 3600:.2f} h of wall time "
              f"({len(sweeps)} sweeps, one after another, each running its training runs in "
              "parallel worker processes, on the machines named in the table).", ""]
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
        runs.setdefault((r.file.stem, r.replication), []).append(r)
    for (stem, replication), group in runs.items():
        r = group[0]
        ids = ", ".join(dict.fromkeys(str(g.claim.get("id", "?")) for g in group))
        hours = r.compute_s / 3600
        made = (f", made at commit{'s' * (len(r.commits) > 1)} {', '.join(sorted(r.commits))}"
                if r.commits else "")
        again = " (replication)" if replication else ""
        where = places[id(r)]
        lines.append(f"- claim{'s' * (len(group) > 1)} {ids}{again}: `python -m labkit "
                     f"findings --all --only {stem}{flag}`; {r.runs_done} of "
                     f"{r.runs_total} batches run{made}, {hours:.2f} h of training runs' "
                     f"wall time, {r.elapsed_s / 60:.0f} min elapsed"
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
             "that measured it where the claim has several.", "",
             "| " + " | ".join(PAGE_COLUMNS) + " |", "|" + "---|" * len(PAGE_COLUMNS)]
    merged: dict[tuple, list[str]] = {}  # a finding two claims of the file share: one row
    for row in table_rows(results):
        key = tuple(str(row[c]) for c in PAGE_COLUMNS if c != "claim")
        merged.setdefault(key, []).append(str(row["number"]))
    for key, numbers in merged.items():
        cells = [_cell(", ".join(dict.fromkeys(numbers)))] + [_cell(v) for v in key]
        cells[-1] = f"**{cells[-1]}**" if cells[-1] else ""
        lines.append("| " + " | ".join(cells) + " |")
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
