"""The rollout inspector's view: kept groups shown token by token, each token coloured by its
advantage, the sampling policy's entropy or the ratio after the update (`plots.rollouts`
builds it from rollouts.jsonl lines)."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

COLORINGS = ("advantage", "entropy", "ratio")
"""What a token's background shows in `rollouts`: its advantage (green > 0, red < 0), the
sampling policy's entropy at it (blue), or the ratio pi_new / pi_old after the step's update
(green above 1, red below, on a log scale)."""

_GREEN, _RED, _BLUE = "46,160,67", "218,54,51", "31,111,235"


def _shade(value, scale: float, signed: bool = True) -> str:
    if value is None or not scale:
        return "transparent"
    alpha = min(abs(value) / scale, 1.0) * 0.75
    rgb = _BLUE if not signed else _GREEN if value > 0 else _RED
    return f"rgba({rgb},{alpha:.3f})"


def _token_text(token: str) -> str:
    shown = token.replace("\n", "\u21b5").replace("\t", "\u21e5")
    return html.escape(shown if shown.strip() else shown.replace(" ", "\u00b7") or "\u2205")


class RolloutView:
    """Kept groups shown token by token (`rollouts`); HTML with a CSS-only switch between
    the colorings, so it works in JupyterLab and in a report opened offline."""

    count = 0

    def __init__(self, columns: Mapping[str, Sequence[dict]], color: str):
        if color not in COLORINGS:
            raise ValueError(f"color must be one of {', '.join(COLORINGS)}, got {color!r}")
        self.columns, self.color = {k: list(v) for k, v in columns.items()}, color
        RolloutView.count += 1
        self.id = f"lk-rollouts-{RolloutView.count}"

    def _scales(self) -> dict:
        values = {"a": [], "e": [], "r": []}
        for lines in self.columns.values():
            for line in lines:
                for c in line["completions"]:
                    values["a"] += [abs(v) for v in c["token_advantage"] if v is not None]
                    values["e"] += [v for v in c["entropy"] if v is not None]
                    values["r"] += [abs(math.log(v)) for v in c["ratio"] if v]
        return {k: max(v, default=0.0) for k, v in values.items()}

    def _completion(self, c: dict, scale: dict) -> str:
        spans = []
        for i, token in enumerate(c["tokens"]):
            a, e, r = c["token_advantage"][i], c["entropy"][i], c["ratio"][i]
            log_r = math.log(r) if r else None
            style = (f"--a:{_shade(a, scale['a'])};--e:{_shade(e, scale['e'], signed=False)};"
                     f"--r:{_shade(log_r, scale['r'])}")
            title = f"advantage {a:+.3f}, entropy {e:.3f}, ratio {r:.3f}" \
                if None not in (a, e, r) else ""
            spans.append(f'<span class="lk-tok" style="{style}" title="{title}">'
                         f"{_token_text(token)}</span>")
        meta = f"r={c['reward']:.2f} A={c['advantage']:+.2f}"
        return f'<div class="lk-row"><span class="lk-meta">{meta}</span>{"".join(spans)}</div>'

    def _repr_html_(self) -> str:
        scale, i = self._scales(), self.id
        radios = "".join(
            f'<input type="radio" name="{i}" id="{i}-{name}" value="{name}"'
            f'{" checked" if name == self.color else ""}>'
            f'<label for="{i}-{name}">{name}</label> ' for name in COLORINGS)
        css = "".join(f"#{i} input[value={name}]:checked ~ .lk-cols .lk-tok "
                      f"{{background:var(--{name[0]})}}" for name in COLORINGS)
        columns = []
        for title, lines in self.columns.items():
            groups = "".join(
                f'<div class="lk-group"><div class="lk-prompt">group {line["group"]}: '
                f'{html.escape(line["prompt"])} &rarr; {html.escape(str(line["answer"]))}'
                "</div>" + "".join(self._completion(c, scale) for c in line["completions"])
                + "</div>" for line in lines)
            columns.append(f'<div class="lk-col"><div class="lk-title">{html.escape(title)}'
                           f"</div>{groups}</div>")
        return (f'<div class="lk-rollouts" id="{i}"><style>{css}'
                f"#{i} .lk-cols{{display:flex;gap:24px;flex-wrap:wrap}}"
                f"#{i} .lk-col{{flex:1;min-width:280px}}"
                f"#{i} .lk-title{{font-weight:bold;margin:6px 0}}"
                f"#{i} .lk-prompt{{color:#555;margin-top:8px}}"
                f"#{i} .lk-row{{font-family:monospace;white-space:pre-wrap;margin:2px 0}}"
                f"#{i} .lk-meta{{color:#777;margin-right:8px}}"
                f"#{i} .lk-tok{{padding:0 1px;border-radius:2px}}</style>"
                f'<span>color by: </span>{radios}<div class="lk-cols">{"".join(columns)}'
                "</div></div>")
