"""The command line: `python -m labkit COMMAND`.

eval   evaluate a model (the embedded one by default) on held-out problems of a task
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _eval_parser(sub) -> None:
    cmd = sub.add_parser("eval", help="greedy accuracy and sampled pass@1 on held-out problems")
    cmd.add_argument("--model", default=None,
                     help="local model folder or hub id (default: the embedded tiny model)")
    cmd.add_argument("--task", default="arithmetic", choices=["arithmetic", "gsm8k"],
                     help="problem source (default: arithmetic, the embedded model's task)")
    cmd.add_argument("--gsm8k-path", default=None, help="GSM8K jsonl, for --task gsm8k")
    cmd.add_argument("--digits", type=int, default=2, help="arithmetic: digits per operand")
    cmd.add_argument("--operands", type=int, default=2, help="arithmetic: operands per problem")
    cmd.add_argument("--n", type=int, default=800, help="held-out problems to evaluate")
    cmd.add_argument("--samples", type=int, default=4,
                     help="sampled completions per problem for pass@1 at temperature 1")
    cmd.add_argument("--max-new-tokens", type=int, default=None,
                     help="completion budget (default: 16 for arithmetic, 256 for gsm8k)")
    cmd.add_argument("--batch-size", type=int, default=256, help="prompts per generate call")
    cmd.add_argument("--seed", type=int, default=0, help="seeds the problems and the samples")
    cmd.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if any)")


def _problems(args):
    from labkit.tasks import ArithmeticTask, load_gsm8k

    if args.task == "gsm8k":
        if not args.gsm8k_path:
            raise ValueError("--task gsm8k needs --gsm8k-path, a local jsonl with "
                             "'question' and 'answer' fields")
        return load_gsm8k(args.gsm8k_path, n=args.n, seed=args.seed), 256
    task = ArithmeticTask(digits=args.digits, operands=args.operands)
    return task.sample(args.n, "test", seed=args.seed, distinct=True), 16


def run_eval(args) -> dict:
    from labkit.evaluation import evaluate
    from labkit.models import load, resolve_device, resolve_model_path

    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    if args.samples < 0:
        raise ValueError(f"--samples must be >= 0, got {args.samples}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    resolve_device(args.device)
    source = resolve_model_path(args.model)  # fail on a bad path before any heavy work
    problems, budget = _problems(args)
    start = time.perf_counter()
    model, tokenizer = load(source, device=args.device)
    figures = evaluate(model, tokenizer, problems, samples=args.samples, seed=args.seed,
                       max_new_tokens=args.max_new_tokens or budget,
                       batch_size=args.batch_size, progress=True)
    figures["wall_s"] = round(time.perf_counter() - start, 2)
    figures["model"] = args.model or "tiny-arith (embedded)"
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _eval_parser(sub)
    args = parser.parse_args(argv)
    try:
        result = run_eval(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    width = max(map(len, result))
    for key, value in result.items():
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
