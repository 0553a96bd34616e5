"""`python -m labkit.zoo build`: rebuild the embedded model from its recipe."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from labkit.fields import parse_field
from labkit.models import EMBEDDED
from labkit.zoo import PRESETS, Recipe, build

LOW, HIGH = 0.15, 0.60


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
                     help=f"do not fail when held-out accuracy leaves [{LOW}, {HIGH}]")
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
    in_band = all(LOW <= figures[key] <= HIGH for key in ("eval/accuracy", "eval/pass@1"))
    if not in_band and not args.no_check:
        print(f"error: held-out greedy accuracy and pass@1 must both lie in [{LOW}, {HIGH}] to "
              "leave room for RL; change --target or --seed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
