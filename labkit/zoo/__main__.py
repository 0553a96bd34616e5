"""`python -m labkit.zoo build`: rebuild the embedded model from its recipe."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from labkit.models import EMBEDDED_PATH
from labkit.zoo import Recipe, build

LOW, HIGH = 0.15, 0.60


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.zoo",
                                     description="Build labkit's embedded tiny model.")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("build", help="train the model from scratch and write it with its card")
    cmd.add_argument("--out", default=str(EMBEDDED_PATH),
                     help="folder to write (default: the embedded model's folder in the package)")
    for field in dataclasses.fields(Recipe):
        cmd.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                         default=field.default, help=f"(default: {field.default})")
    cmd.add_argument("--no-check", action="store_true",
                     help=f"do not fail when held-out accuracy leaves [{LOW}, {HIGH}]")
    args = parser.parse_args(argv)
    try:
        recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)})
    except ValueError as e:
        parser.error(str(e))
    card = build(args.out, recipe)
    figures = card["held_out"]
    print(json.dumps({"out": args.out, "sft_steps": card["sft_steps"],
                      "train_seconds": card["train_seconds"], **figures}))
    in_band = all(LOW <= figures[key] <= HIGH for key in ("eval/accuracy", "eval/pass@1"))
    if not in_band and not args.no_check:
        print(f"error: held-out greedy accuracy and pass@1 must both lie in [{LOW}, {HIGH}] to "
              "leave room for RL; change --target or --seed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
