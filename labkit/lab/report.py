"""A run's HTML reports, readable offline: `report.html` for readers (prose, figures, tables
and printed results, without the code cells) and `notebook.html` with the code.

Nothing in them is fetched: the equations are MathML, converted from the notebook's LaTeX
when the report is written (latex2mathml; browsers render MathML themselves, no MathJax),
plotly.js is embedded once when the figures do not carry it, and the scripts that would
come from a CDN are left out: the template's (require.js, MathJax, mermaid, the widget
manager) and the outputs' (plotly's MathJax, for LaTeX in figure labels, which labkit's
figures do not use).
"""

from __future__ import annotations

import re
from pathlib import Path

REPORT = "report.html"
"""The readers' report: no code cells."""
NOTEBOOK_HTML = "notebook.html"
"""The same report with the code."""
PLOTLY_MARKER = "plotly.js v"  # the banner at the top of the embedded plotly.js bundle

_CODE = re.compile(r"(```.*?```|`[^`\n]*`)", re.S)
_MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$\w])\$(?=\S)([^$\n]+?)(?<=\S)\$(?![\w$])", re.S)

_REMOTE_SCRIPT = re.compile(r"<script\b[^>]*\bsrc=[\"']?(?:https?:)?//[^>]*>\s*</script>", re.I)

# the lab template without the scripts it would fetch: MathJax (the math is MathML here),
# require.js and the widget manager (no widget state is saved), mermaid (no diagrams)
_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


def _mathml(match: re.Match) -> str:
    from latex2mathml.converter import convert

    block, inline = match.group(1), match.group(2)
    tex = block if block is not None else inline
    try:
        return convert(tex.strip(), display="block" if block is not None else "inline")
    except Exception:  # noqa: BLE001 - an equation it cannot convert stays as written
        return match.group(0)


def render_math(markdown: str) -> str:
    """`markdown` with every `$...$` and `$$...$$` outside code spans replaced by MathML."""
    parts = _CODE.split(markdown)
    for i in range(0, len(parts), 2):  # the even parts lie outside code
        parts[i] = _MATH.sub(_mathml, parts[i])
    return "".join(parts)


def _render_notebook_math(nb) -> None:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = render_math(cell.source)
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "text/markdown" in data:
                data["text/markdown"] = render_math(data["text/markdown"])
            if "text/latex" in data and "text/html" not in data:
                data["text/html"] = render_math(data.pop("text/latex"))


def for_readers(nb, run_dir: str | Path) -> None:
    """What a reader of the report does not need, taken out of `nb`'s outputs: the stderr
    streams (progress, build lines such as the decode kernels' cache, warnings: the operator's,
    kept in notebook.html), and absolute paths, written relative to the run directory (or to
    the folder the run was started from)."""
    run_dir = Path(run_dir).resolve()
    roots = [(f"{run_dir}/", ""), (str(run_dir), "."), (f"{Path.cwd().resolve()}/", "")]

    def relative(text):
        if isinstance(text, list):
            return [relative(t) for t in text]
        for absolute, short in roots:
            text = text.replace(absolute, short)
        return text

    for cell in nb.cells:
        outputs = [o for o in cell.get("outputs", [])
                   if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
        for output in outputs:
            if "text" in output:
                output["text"] = relative(output["text"])
            for kind, value in output.get("data", {}).items():
                if kind.startswith("text/") or kind == "application/json":
                    output["data"][kind] = relative(value) if isinstance(value, (str, list)) \
                        else value
        if "outputs" in cell:
            cell["outputs"] = outputs


def write_report(executed: str | Path, path: str | Path, code: bool = False) -> Path:
    """An HTML report of an executed notebook that opens offline (module docstring); with
    `code`, the code cells and their prompts too (notebook.html); without, a reader's report
    (`for_readers`)."""
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(executed, as_version=4)
    if not code:
        for_readers(nb, Path(path).parent)
    _render_notebook_math(nb)
    # embed_images would re-parse the markdown's HTML and empty the MathML elements; the
    # notebooks' markdown holds no images (their outputs' images are inline data already)
    exporter = HTMLExporter(template_file="labkit_offline.html.j2",
                            extra_loaders=[jinja2.DictLoader(
                                {"labkit_offline.html.j2": _TEMPLATE})],
                            exclude_input=not code, exclude_input_prompt=not code,
                            exclude_output_prompt=not code)
    html, _ = exporter.from_notebook_node(nb)
    # scripts an output would fetch: plotly's figures ask MathJax from a CDN for LaTeX in
    # their labels (labkit's figures have none)
    html = _REMOTE_SCRIPT.sub("", html)
    if "Plotly.newPlot" in html and PLOTLY_MARKER not in html:
        from plotly.offline import get_plotlyjs

        html = html.replace("</head>", f"<script>{get_plotlyjs()}</script>\n</head>", 1)
    path = Path(path)
    path.write_text(html, encoding="utf-8")
    return path


def write_reports(executed: str | Path, run_dir: str | Path) -> Path:
    """report.html (for readers) and notebook.html (with code) in `run_dir`; the first."""
    run_dir = Path(run_dir)
    write_report(executed, run_dir / NOTEBOOK_HTML, code=True)
    return write_report(executed, run_dir / REPORT)
