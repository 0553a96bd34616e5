"""`python -m labkit.zoo build`: rebuild the embedded model from its recipe."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from labkit.settings.embedded import EMBEDDED
from labkit.settings.fields import parse_field
from labkit.zoo import PRESETS, Recipe, build

LOW, HIGH = 0.15, 0.60
WORKED_LOW, WORKED_HIGH = 0.20, 0.80


def problems_with(card: dict) -> list[str]:
    """Why a built model leaves too little room for RL (empty: it leaves enough). Sampled
    pass@1 (and greedy accuracy, except for a model that picks its answer's form: greedy
    decoding picks one form per prompt) must lie in [LOW, HIGH]; a model warm-started on
    both forms must work on [WORKED_LOW, WORKED_HIGH] of its draws, and on its hardest
    problems working must be more accurate than answering at once (the interval above 0)."""
    figures, forms = card["held_out"], card.get("forms")
    keys = ("eval/pass@1",) if forms else ("eval/accuracy", "eval/pass@1")
    found = [f"{key} = {figures[key]:.3f} is outside [{LOW}, {HIGH}]"
             for key in keys if not LOW <= figures[key] <= HIGH]
    if forms:
        share = forms["worked"]["mean"]
        if not WORKED_LOW <= share <= WORKED_HIGH:
            found.append(f"the share of worked answers, {share:.3f}, is outside "
                         f"[{WORKED_LOW}, {WORKED_HIGH}]")
        gap = forms["hardest"]["difference"]
        if gap is None or not gap["low"] > 0:
            found.append("on the hardest problems worked answers are not shown more accurate "
                         "than direct ones (the difference's interval does not lie above 0)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.zoo",
                                     description="Build labkit's embedded tiny model.")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("build", help="train the model from scratch and write it with its card")
    cmd.add_argument("--preset", choices=sorted(PRESETS), default="tiny-arith",
                     help="which embedded model: its task fields and its folder "
                          "(default: tiny-arith)")
    cmd.add_argument("--out", default=None,
                     help="folder to write (default: the preset's folder in the package)")
    for field in dataclasses.fields(Recipe):
        cmd.add_argument(f"--{field.name.replace('_', '-')}", default=None,
                         help=f"(default: {field.default}, or the preset's)")
    cmd.add_argument("--no-check", action="store_true",
                     help=f"do not fail when held-out accuracy leaves [{LOW}, {HIGH}] (or, "
                          "for tiny-arith-think, when the answer forms leave no room: see "
                          "its card)")
    args = parser.parse_args(argv)
    try:
        given = {f.name: parse_field(Recipe, f.name, getattr(args, f.name),
                                     f"--{f.name.replace('_', '-')}")
                 for f in dataclasses.fields(Recipe) if getattr(args, f.name) is not None}
        recipe = Recipe(**{**PRESETS[args.preset], **given})
    except ValueError as e:
        parser.error(str(e))
    out = args.out or str(EMBEDDED[args.preset])
    card = build(out, recipe, name=args.preset)
    figures = card["held_out"]
    print(json.dumps({"out": out, "sft_steps": card["sft_steps"],
                      "train_seconds": card["train_seconds"], **figures}))
    found = problems_with(card)
    if found and not args.no_check:
        print(f"error: the model leaves too little room for RL: {'; '.join(found)}; change "
              "--target or --seed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
