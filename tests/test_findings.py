"""docs/findings.md is generated from finished runs: the page from a fixture of summaries,
its verdicts recomputed from the stored intervals."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from labkit.__main__ import main
from labkit.formulas import stats
from labkit.lab import findings, questions, verdicts
from labkit.lab.sweeps import load_sweep

REPO = Path(__file__).resolve().parents[1]

CLAIM = """notebook: {notebook}
name: claim_fixture
parameters: {{algos: "grpo,ppo", seeds: 3, steps: 3}}
seeds: [0]
claim:
  id: 7
  statement: "the fixture's claim"
  source: "an article"
  preregistered:
    article: "the article's own words, with its number"
    measure: gain
    finding: "clear"
    direction: above
    threshold: 0
    seeds: 5
  findings: [1, 2, 3]
"""


PREREGISTERED = ("{article: words, measure: gain, finding: clear, direction: above, "
                 "threshold: 0, seeds: 5}")


def _finding(question, low, high, stored_verdict, threshold=0.0, n=3):
    interval = stats.Interval((low + high) / 2, low, high, n, f"paired t over {n} seeds")
    f = verdicts.Finding(question, "points", interval, threshold, "above", stored_verdict)
    return f


@pytest.fixture
def finished(tmp_path):
    claims, root = tmp_path / "claims", tmp_path / "runs"
    claims.mkdir()
    notebook = REPO / "notebooks" / "01_grpo_vs_ppo.ipynb"
    (claims / "07_fixture.yaml").write_text(CLAIM.format(notebook=notebook))
    shutil.copy(REPO / "experiments" / "claims" / "01_cost.yaml", claims / "01_cost.yaml")
    (claims / "01_cost.yaml").write_text((claims / "01_cost.yaml").read_text().replace(
        "../../notebooks/", str(REPO / "notebooks") + "/"))
    run = root / "claim_fixture" / "seed=0"
    (run / "grpo-seed0").mkdir(parents=True)
    found = [_finding("wide", -1.0, 3.0, stats.INCONCLUSIVE),
             _finding("clear", 0.5, 2.0, stats.SUPPORTED),
             # stored as supported, but its interval lies below the threshold: recomputed
             _finding("wrong label", -2.0, -0.5, stats.SUPPORTED)]
    summary = {"description": "fixture", **verdicts.findings_summary(found),
               "grpo/seed=0/wall_s": 1800.0, "ppo/seed=0/wall_s": 1800.0}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "notebook.ipynb").write_text(json.dumps({"metadata": {"papermill": {"duration": 5400}}}))
    (run / "grpo-seed0" / "config.json").write_text(json.dumps(
        {"config": {}, "machine": {"cpu_capability": "AVX2", "threads": 1}}))
    return claims, root, tmp_path / "findings.md"


def test_page_from_finished_runs(finished):
    claims, root, out = finished
    findings.write_findings(out, claims, root)
    text = out.read_text()
    glance = text.split("## Every finding")[0]
    every = (out.with_suffix("") / "07_fixture.md").read_text()
    assert "[07_fixture](findings/07_fixture.md)" in text and "[01_cost](findings/01_cost.md)" in text
    assert every.startswith("# Every finding: 07_fixture (claim 7)")
    assert "| 7 |" not in (out.with_suffix("") / "01_cost.md").read_text()  # a page per file
    rows = [line for line in every.splitlines() if line.startswith("| 7 |")]
    assert len(rows) == 3
    wide, clear, wrong = rows
    assert "**inconclusive at this budget**" in wide and "1.00 [-1.00, 3.00]" in wide
    assert "**supported**" in clear and "paired t over 3 seeds" in clear
    assert "**refuted**" in wrong  # the verdict comes from the interval, not the stored label
    compute = (out.with_suffix("") / "compute.md").read_text()  # linked from the page
    assert "[compute](findings/compute.md)" in text
    assert "0 h of runs, 90 min" in compute and compute.count("AVX2, 1 thread") == 1  # once
    # a claim with no finished run is listed, not left out: 01_cost's claim 1 is restated,
    # so it is listed on the earlier statements' page, naming the file that restates it,
    # and the page links that list below the table
    earlier = ("- 1 (01_cost.yaml): memory_ratio (ppo vs grpo) above 1.25: not measured yet; "
               "0 of 10 seeds, ")
    listed = (out.with_suffix("") / "earlier.md").read_text()
    assert earlier + "**inconclusive at this budget**; restated in 01_tensor_memory.yaml" in listed
    assert earlier not in text
    assert "not run yet (0 of 2 runs)" in (out.with_suffix("") / "01_cost.md").read_text()
    link = "Earlier statements of claims 1, each restated in another file and decided there: " \
           "[earlier statements](findings/earlier.md)."
    assert text.index("| 7. ") < text.index(link) < text.index("## Every finding")
    # one claim-level verdict per claim, from its preregistered primary measure
    (seven,) = [line for line in glance.splitlines() if line.startswith("| 7.")]
    assert "the article's own words, with its number" in seven
    assert "gain above 0" in seven and "clear: 1.25 [0.50, 2.00]" in seven
    assert "| **supported**: clear: 1.25 [0.50, 2.00]; 3 of 5 seeds |" in seven
    assert seven.endswith("| not run yet | - |")  # the file has no confirmatory stage
    assert "- 7: `07_fixture`; 1 of 1 batches, 1.00 h of runs, 90 min" in compute
    assert "`python -m labkit findings --all [--confirmatory] --only FILE` runs it" in compute
    assert "The whole suite took 1.50 h of wall time (1 sweep," in compute  # 01_cost not run
    assert "The whole suite took 1.50 h of wall time;" in text


def test_the_claims_of_one_file_share_one_command_line(finished):
    claims, root, out = finished
    text = (REPO / "experiments" / "claims" / "17_dpo.yaml").read_text()
    (claims / "17_dpo.yaml").write_text(text.replace("../../notebooks/",
                                                     str(REPO / "notebooks") + "/"))
    findings.write_findings(out, claims, root)
    page = (out.with_suffix("") / "compute.md").read_text()
    lines = [line for line in page.splitlines() if "`17_dpo`" in line]
    assert len(lines) == 1 and lines[0].startswith("- 17, 19, 20, 22: ")
    every = (out.with_suffix("") / "17_dpo.md").read_text()  # one row for what they share
    (row,) = [line for line in every.splitlines() if "not run yet" in line]
    assert row.startswith("| 17, 19, 20, 22 | not run yet (0 of 1 runs) |")
    assert "## How to read them" not in out.read_text()  # on the claim file's own page
    every = (out.with_suffix("") / "17_dpo.md").read_text()
    notes = every.split("## How to read them")[1]
    assert notes.count("- claim 17: ") == 1 and notes.count("- claim 20: ") == 1


def test_findings_command(finished, capsys):
    claims, root, out = finished
    assert main(["findings", "--claims", str(claims), "--root", str(root),
                 "--out", str(out)]) == 0
    assert out.is_file() and str(out) in capsys.readouterr().out


def test_claim_files_name_a_claim_and_check_against_their_notebooks():
    files = sorted((REPO / "experiments" / "claims").glob("*.yaml"))
    assert files
    for file in files:
        for smoke in (False, True):
            sweep = load_sweep(file, smoke=smoke)
            assert sweep.claims, file.name
            for claim in sweep.claims:
                assert {"id", "statement", "source"} <= set(claim), file.name
            assert file.name.startswith(f"{sweep.claims[0]['id']:02d}_")


def test_a_sweep_without_a_claim_is_refused(tmp_path):
    claims = tmp_path / "claims"
    claims.mkdir()
    shutil.copy(REPO / "experiments" / "grpo_vs_ppo.yaml", claims / "x.yaml")
    text = (claims / "x.yaml").read_text().replace("../notebooks/", str(REPO / "notebooks") + "/")
    (claims / "x.yaml").write_text(text)
    with pytest.raises(ValueError, match="no `claim:` block"):
        findings.collect(claims, tmp_path / "runs")


def test_a_notebook_with_its_own_seeds_takes_one_sweep_seed(tmp_path):
    path = tmp_path / "overlap.yaml"
    path.write_text(f"notebook: {REPO / 'notebooks' / '01_grpo_vs_ppo.ipynb'}\nname: overlap\n"
                    "parameters: {seeds: 3}\nseeds: [0, 1]\n")
    with pytest.raises(ValueError, match="own paired seeds.*overlap"):
        load_sweep(path)


def test_one_sweep_can_answer_several_claims_by_words_or_numbers(finished):
    claims, root, out = finished
    text = (claims / "07_fixture.yaml").read_text()
    text = text[:text.index("claim:\n")] + ("""claims:
  - {id: 7, statement: "first", source: "an article", findings: ["wide", "wrong"],
     preregistered: %s}
  - {id: 8, statement: "second", source: "another", findings: [2], note: "read  it so",
     preregistered: %s}
""" % (PREREGISTERED, PREREGISTERED))  # the fixture's one claim block, last, replaced
    (claims / "07_fixture.yaml").write_text(text)
    results = {r.claim["id"]: r for r in findings.collect(claims, root)}
    assert [row["question"] for row in results[7].rows] == ["wide", "wrong label"]
    assert [row["question"] for row in results[8].rows] == ["clear"]
    assert results[8].runs_done == 1
    findings.write_findings(out, claims, root)
    assert "- claim 8: read it so" in (out.with_suffix("") / "07_fixture.md").read_text()
    both = text.replace("claims:", "claim: {id: 9}\nclaims:")
    (claims / "07_fixture.yaml").write_text(both)
    with pytest.raises(ValueError, match="not both"):
        findings.collect(claims, root)


def test_figures_are_written_beside_the_page_or_said_missing(finished, monkeypatch, capsys):
    claims, root, out = finished
    if importlib.util.find_spec("kaleido") and Path("/usr/bin/chromium").exists():
        findings.write_findings(out, claims, root, figures=True)
        svg = out.parent / "findings" / "07_fixture-claim-7.svg"
        text = svg.read_text()
        assert text.startswith("<svg") and "wrong label: refuted" in text
        every = (out.parent / "findings" / "07_fixture.md").read_text()
        assert "![claim 7 (07_fixture.yaml)](07_fixture-claim-7.svg)" in every
        assert ".svg" not in out.read_text()  # the figures are on the claim file's page
        assert not (out.parent / "findings" / "01_cost-claim-1.svg").exists()  # no runs
    monkeypatch.setitem(sys.modules, "kaleido", None)  # as if it were not installed
    findings.write_findings(out, claims, root, figures=True)
    assert "## Figures" not in (out.parent / "findings" / "07_fixture.md").read_text()
    assert "pip install 'labkit[figures]'" in capsys.readouterr().err


@pytest.mark.notebook
def test_a_factorial_claims_smoke_sweep_feeds_two_claims(tmp_path):
    """CI's smoke variant of a claim sweep: claims 4 and 8 share one sweep of notebook 05
    (questions collapse and monitors); it runs, and the page gives each claim its own
    findings, with the machine they ran on."""
    import torch

    from labkit.lab.sweeps import run_sweep

    claims = tmp_path / "claims"
    claims.mkdir()
    text = (REPO / "experiments" / "claims" / "04_stability.yaml").read_text()
    (claims / "04_stability.yaml").write_text(text.replace("../../notebooks/",
                                                           str(REPO / "notebooks") + "/"))
    root = tmp_path / "runs"
    runs = run_sweep(load_sweep(claims / "04_stability.yaml", smoke=True), root, progress=False)
    assert [r.status for r in runs] == ["ok"]
    results = {r.claim["id"]: r for r in findings.collect(claims, root, smoke=True)
               if not r.confirmatory}  # its confirmatory stage, not run here, read apart
    four = [row["question"] for row in results[4].rows]
    eight = [row["question"] for row in results[8].rows]
    assert four and all("fewer runs collapse" in q or "gains more" in q for q in four)
    words = ("warns of a collapse", "fires before", "stays quiet", "(threshold sweep)")
    assert eight and all(any(w in q for w in words) for q in eight)
    assert any(q.startswith("eval/cgc>=0.15") for q in eight)
    # the threshold sweep comes from the per-seed record, which the CSV keeps
    swept = [q for q in eight if q.endswith("(threshold sweep)")]
    if any(r["collapsed"] for r in results[8].records) and \
            not all(r["collapsed"] for r in results[8].records):
        assert len(swept) == len(questions.monitor_rules())
    assert all(f"fires.{rule}" in results[8].records[0] for rule in questions.monitor_rules())
    page = findings.write_findings(tmp_path / "findings.md", claims, root, smoke=True)
    glance = page.read_text().split("## Every finding")[0]
    every = (page.with_suffix("") / "04_stability.md").read_text()
    per_arm = len({r["seed"] for r in results[4].records})
    (four_line,) = [line for line in glance.splitlines() if line.startswith("| 4.")]
    assert f"; {per_arm} of 10 seeds |" in four_line  # seeds per arm, not runs
    # claim 8's first statement is restated (08_monitors.yaml): listed on its own page
    listed = (page.with_suffix("") / "earlier.md").read_text()
    (eight_line,) = [line for line in listed.splitlines() if line.startswith("- 8 ")]
    assert eight_line.startswith("- 8 (04_stability.yaml): monitor_youden above 0; control: ")
    assert eight_line.endswith("restated in 08_monitors.yaml")
    rows = [line for line in every.splitlines() if line.startswith(("| 4 |", "| 8 |"))]
    assert len(rows) == len(four) + len(eight)
    assert all(any(f"**{v}**" in row for v in stats.VERDICTS) or "**comparator collapsed on "
               in row for row in rows)
    assert f"{torch.backends.cpu.get_cpu_capability()}, 1 thread" in \
        (page.with_suffix("") / "compute.md").read_text()


def test_the_page_decides_a_claim_from_its_per_seed_csv_once_its_runs_are_gone(finished):
    claims, root, out = finished
    fixture = claims / "07_fixture.yaml"
    fixture.write_text(fixture.read_text().replace('    finding: "clear"\n',
                                                   "    compare: [grpo, ppo]\n"))
    run = root / "claim_fixture" / "seed=0"
    summary = json.loads((run / "summary.json").read_text())
    for s, (a, b) in enumerate([(0.40, 0.30), (0.42, 0.31), (0.39, 0.30), (0.41, 0.30),
                                (0.38, 0.31)]):
        summary |= {f"grpo/seed={s}/seed": s, f"grpo/seed={s}/gain": a,
                    f"ppo/seed={s}/seed": s, f"ppo/seed={s}/gain": b}
    (run / "summary.json").write_text(json.dumps(summary))
    findings.write_findings(out, claims, root)
    record = out.with_suffix("") / "07_fixture.csv"
    header, first = record.read_text().splitlines()[:2]
    assert header.startswith("sweep_run,arm,seed,commit,cpu,torch,sweep_s,gain")
    # the run's CPU from its config.json, its notebook's wall time from papermill
    assert first.startswith("seed=0,grpo,0,,AVX2,,5400.0,0.4")

    def glance_line(text):
        return next(line for line in text.split("## Every finding")[0].splitlines()
                    if line.startswith("| 7."))

    before = glance_line(out.read_text())
    assert "| **supported**: grpo vs ppo: 9.60 [" in before and "; 5 of 5 seeds |" in before
    shutil.rmtree(root / "claim_fixture")  # the runs are gone; the CSV stays
    findings.write_findings(out, claims, root)
    assert glance_line(out.read_text()).split(" | ")[4:] == before.split(" | ")[4:]
    compute = (out.with_suffix("") / "compute.md").read_text()
    assert "1 of 1 batches" in compute and "Every run on AVX2" in compute


def test_a_claim_decided_by_a_finding_keeps_it_once_its_runs_are_gone(finished):
    """The fixture's claim 7 is decided by its finding 'clear', which only the notebook's
    summary holds: the page stores every finding of the file (07_fixture-findings.csv) and a
    page written after the runs are gone reads the same verdict, figure and table."""
    claims, root, out = finished
    findings.write_findings(out, claims, root)
    stored = out.with_suffix("") / "07_fixture-findings.csv"
    assert stored.is_file() and "clear" in stored.read_text()
    page = out.read_text()

    def glance(text):
        return next(line for line in text.split("## Every finding")[0].splitlines()
                    if line.startswith("| 7."))

    every = (out.with_suffix("") / "07_fixture.md").read_text()
    shutil.rmtree(root / "claim_fixture")
    findings.write_findings(out, claims, root)
    assert glance(out.read_text()) == glance(page)
    assert "clear: 1.25 [0.50, 2.00]" in glance(page)
    again = (out.with_suffix("") / "07_fixture.md").read_text()
    rows = [line for line in every.splitlines() if line.startswith("| 7 |")]
    assert rows and rows == [line for line in again.splitlines() if line.startswith("| 7 |")]
    stored.unlink()  # without the stored findings the claim is unmeasured, not invented
    findings.write_findings(out, claims, root)
    assert "not measured yet" in glance(out.read_text())


def test_a_replication_is_read_once_at_its_fresh_seeds_beside_the_original(finished):
    claims, root, out = finished
    fixture = claims / "07_fixture.yaml"
    fixture.write_text(fixture.read_text().replace('    finding: "clear"\n',
                                                   "    compare: [grpo, ppo]\n")
                       .replace("seeds: [0]\n", "seeds: [0]\nreplication: [100]\n"))
    assert load_sweep(fixture).replication == [100]
    for first, gains in ((0, [(0.40, 0.30)] * 5), (100, [(0.30, 0.31), (0.32, 0.30),
                                                         (0.29, 0.30), (0.31, 0.31),
                                                         (0.30, 0.29)])):
        run = root / "claim_fixture" / f"seed={first}"
        run.mkdir(parents=True, exist_ok=True)
        summary = {"description": "fixture"}
        for s, (a, b) in enumerate(gains, first):
            summary |= {f"grpo/seed={s}/seed": s, f"grpo/seed={s}/gain": a + 0.001 * (s % 7),
                        f"ppo/seed={s}/seed": s, f"ppo/seed={s}/gain": b}
        (run / "summary.json").write_text(json.dumps(summary))
        (run / "notebook.ipynb").write_text(json.dumps(
            {"metadata": {"papermill": {"duration": 60}}}))
    findings.write_findings(out, claims, root)
    glance = out.read_text().split("## Every finding")[0]
    (original,) = [line for line in glance.splitlines() if line.startswith("| 7")]
    assert original.startswith("| 7. the fixture's claim") and "| **supported**: " in original
    (again,) = [line for line in glance.splitlines()
                if line.startswith("- 7, replicated at fresh seeds (first seed 100)")]
    assert "; 5 of 5 seeds; **inconclusive at this budget**, which differs from the " \
           "original (supported)." in again
    rows = (out.with_suffix("") / "07_fixture-replication.csv").read_text().splitlines()
    assert len(rows) == 11 and all(r.split(",")[2] in {str(s) for s in range(100, 105)}
                                   for r in rows[1:])
    assert "- 7 (replication): `07_fixture`" in (out.with_suffix("") / "compute.md").read_text()
    # a replication's seeds must lie apart from the original's, and it needs a claim
    fixture.write_text(fixture.read_text().replace("replication: [100]", "replication: [2]"))
    with pytest.raises(ValueError, match="seeds \\+ replication"):
        load_sweep(fixture)


def test_the_committed_page_regenerates_from_its_csvs_alone(tmp_path):
    """With no run present, the shipped per-seed and findings CSVs give the committed page
    again, and each claim file's page (but for the commit it was made at, and the figures,
    drawn only with the `figures` extra)."""
    shipped = REPO / "docs" / "findings"
    folder = tmp_path / "findings"
    folder.mkdir()
    for path in [*shipped.glob("*.csv"), *shipped.glob("*.json")]:
        shutil.copy(path, folder / path.name)
    page = findings.write_findings(tmp_path / "findings.md", REPO / "experiments" / "claims",
                                   tmp_path / "no-runs", figures=False)

    def text(path: Path) -> list[str]:
        body = path.read_text().split("\n## Figures")[0]  # the figures are drawn apart
        return [line for line in body.splitlines()
                if "generated at commit" not in line and "(at commit `" not in line]

    assert text(page) == text(REPO / "docs" / "findings.md")
    pages = sorted(p.name for p in shipped.glob("*.md"))
    assert pages == sorted(p.name for p in folder.glob("*.md"))
    for name in pages:
        assert text(folder / name) == text(shipped / name), name


def test_a_claim_files_page_lists_findings_that_share_a_measure_under_it_once():
    """A measure shared by several findings (a claim's exploratory and confirmatory runs)
    heads one table whose rows name the question and run alone; a measure of one finding
    stays in its row."""
    from labkit.lab.claims import ClaimResult
    from labkit.lab.findings_page import render_every

    def row(question, measure, run, effect, verdict="supported"):
        return {"question": question, "measure": measure, "run": run, "effect": effect,
                "seeds": 5, "method": "paired t over 5 seeds", "verdict": verdict}

    claim = {"id": 9, "statement": "s", "source": "a"}
    file = Path("09_fixture.yaml")
    explored = ClaimResult(file, claim, rows=[
        row("b beats a", "gain(b) - gain(a), points", "seed=0", "1.00 [0.50, 1.50]"),
        row("c beats a", "gain(c) - gain(a), points", "seed=0", "0.20 [-1.00, 1.40]",
            "inconclusive at this budget")])
    confirmed = ClaimResult(file, claim, confirmatory=True, rows=[
        row("b beats a", "gain(b) - gain(a), points", "seed=1900", "0.80 [0.10, 1.50]")])
    (page,) = render_every([explored, confirmed], "abc").values()
    lines = page.splitlines()
    assert page.count("gain(b) - gain(a), points") == 1  # said once, as the heading
    head = lines.index("### Measured as: gain(b) - gain(a), points")
    assert lines[head + 2] == "| claim | finding | effect [95% CI] | seeds | method | verdict |"
    assert lines[head + 4:head + 6] == [
        "| 9 | b beats a | 1.00 [0.50, 1.50] | 5 | paired t over 5 seeds | **supported** |",
        "| 9 (confirmatory) | b beats a (seed=1900) | 0.80 [0.10, 1.50] | 5 | paired t over 5 "
        "seeds | **supported** |"]
    # the measure of a single finding stays in its row, in the table above the headings
    alone = "| 9 | c beats a: gain(c) - gain(a), points | 0.20 [-1.00, 1.40] |"
    assert any(line.startswith(alone) for line in lines[:head])
    assert lines.index("| claim | measured | effect [95% CI] | seeds | method | verdict |") < head
