"""The command line: `python -m labkit COMMAND`.

train  run GRPO or PPO (`--algo`), every TrainConfig field an option
eval   evaluate a model (the embedded one by default) on held-out problems of a task
run    execute a notebook with papermill into a new run directory (`-p NAME VALUE` checked
       against its parameters cell first)
sweep  run a notebook over the parameter grid and seeds of experiments/NAME.yaml
diagnose  baseline error and gradient noise of each advantage estimator on one policy
findings  docs/findings.md from the finished runs of experiments/claims/
tune  choose each algorithm's learning rate by a tuning grid at tuning seeds
bench  time the GRPO step, rollout and memory against TRL, model.generate and PPO
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _eval_parser(sub) -> None:
    cmd = sub.add_parser("eval", help="greedy accuracy and sampled pass@1 on held-out problems")
    cmd.add_argument("--model", default=None,
                     help="local model folder or hub id (default: the embedded tiny model)")
    cmd.add_argument("--task", default="arithmetic",
                     choices=["arithmetic", "think", "dataset", "gsm8k", "code"],
                     help="problem source (default: arithmetic, the embedded model's task; "
                          "think: its sums of 2 to 5 one-digit numbers, on tiny-arith-think "
                          "by default, with the answer forms: how often the model works "
                          "before it answers, and how right each form is)")
    cmd.add_argument("--gsm8k-path", default=None, help="GSM8K jsonl, for --task gsm8k")
    cmd.add_argument("--dataset-path", default=None,
                     help="a local .jsonl, .json, .parquet or .csv file, for --task dataset")
    cmd.add_argument("--prompt-column", default="prompt",
                     help="--task dataset: the column of the prompt (default: prompt)")
    cmd.add_argument("--answer-column", default="answer",
                     help="--task dataset: the column of the ground truth (default: answer)")
    cmd.add_argument("--code-path", default=None,
                     help="HumanEval- or MBPP-format .jsonl(.gz), for --task code: each "
                          "completion's program runs its tests in the sandbox")
    cmd.add_argument("--k", type=int, default=None,
                     help="pass@k from the samples (default: --samples)")
    cmd.add_argument("--digits", type=int, default=None,
                     help="arithmetic: digits per operand (default: the task's, 2; think 1)")
    cmd.add_argument("--operands", type=int, default=None,
                     help="arithmetic: operands per problem, the most (default: 2; think 5)")
    cmd.add_argument("--n", type=int, default=800, help="held-out problems to evaluate")
    cmd.add_argument("--samples", type=int, default=4,
                     help="sampled completions per problem for pass@1 at temperature 1")
    cmd.add_argument("--max-new-tokens", type=int, default=None,
                     help="completion budget (default: 16 for arithmetic, 48 for think, "
                          "256 for gsm8k and code)")
    cmd.add_argument("--batch-size", type=int, default=256, help="prompts per generate call")
    cmd.add_argument("--seed", type=int, default=0, help="seeds the problems and the samples")
    cmd.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if any)")


def _problems(args):
    from labkit.problems.tasks import ArithmeticTask, load_gsm8k

    if args.task == "code":
        import sys

        from labkit.problems.code_tasks import load_code_tasks
        from labkit.sandbox import launch

        if not args.code_path:
            raise ValueError("--task code needs --code-path, a local HumanEval- or "
                             "MBPP-format .jsonl or .jsonl.gz")
        problems = load_code_tasks(args.code_path, n=args.n, seed=args.seed)
        launch.require_boundary(sys.executable, None)
        return problems, 256
    if args.task == "dataset":
        from labkit.problems.dataset_task import load_dataset_task

        if not args.dataset_path:
            raise ValueError("--task dataset needs --dataset-path, a local .jsonl, .json, "
                             ".parquet or .csv file")
        return load_dataset_task(args.dataset_path, args.prompt_column, args.answer_column,
                                 n=args.n, seed=args.seed), 256
    if args.task == "gsm8k":
        if not args.gsm8k_path:
            raise ValueError("--task gsm8k needs --gsm8k-path, a local jsonl with "
                             "'question' and 'answer' fields")
        return load_gsm8k(args.gsm8k_path, n=args.n, seed=args.seed), 256
    from labkit.settings.defaults import TASK_SHAPES

    shape = TASK_SHAPES.get(args.task, TASK_SHAPES["other"])
    given = {"digits": args.digits, "operands": args.operands}
    digits, operands = (shape[k] if v is None else v for k, v in given.items())
    task = ArithmeticTask(digits=digits, operands=operands,
                          min_operands=min(shape["min_operands"], operands))
    return task.sample(args.n, "test", seed=args.seed, distinct=True), shape["max_new_tokens"]


def run_eval(args) -> dict:
    from labkit.model.models import load, resolve_device, resolve_model_path
    from labkit.probes.evaluation import evaluate, measure_forms
    from labkit.settings.embedded import THINK_NAME

    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    if args.samples < 0:
        raise ValueError(f"--samples must be >= 0, got {args.samples}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    resolve_device(args.device)
    if args.task == "think" and args.model is None:
        args.model = THINK_NAME
    # fail on a bad path before any heavy work
    source = resolve_model_path(args.model)
    problems, budget = _problems(args)
    start = time.perf_counter()
    model, tokenizer = load(source, device=args.device)
    figures = evaluate(model, tokenizer, problems, samples=args.samples, seed=args.seed, k=args.k,
                       max_new_tokens=args.max_new_tokens or budget,
                       batch_size=args.batch_size, progress=True)
    if args.task == "think" and args.samples:
        figures["forms"] = measure_forms(model, tokenizer, problems, samples=args.samples,
                                         seed=args.seed, batch_size=args.batch_size,
                                         max_new_tokens=args.max_new_tokens or budget)
    figures["wall_s"] = round(time.perf_counter() - start, 2)
    figures["model"] = args.model or "tiny-arith (embedded)"
    return figures


def config_fields(pairs, who) -> dict:
    """(field, text) pairs -> TrainConfig values, each text read by `labkit.settings.fields.parse`
    (the reader of every entry point); `who(name)` is how an error names the option."""
    from labkit.settings.config import TrainConfig, field_types
    from labkit.settings.fields import parse_field

    known, given = field_types(), {}
    for name, text in pairs:
        if name not in known:
            raise ValueError(f"{who(name)}: not a TrainConfig field (valid: {sorted(known)})")
        given[name] = parse_field(TrainConfig, name, text, who(name))
    return given


def option(name: str) -> str:
    """A field's command-line option: `--group-size` for group_size."""
    return f"--{name.replace('_', '-')}"


class _LinesFormatter(argparse.HelpFormatter):
    """Wraps each line of a help text on its own, so a registry's choices read one per line."""

    def _split_lines(self, text, width):
        split = super()._split_lines
        return [part for line in text.split("\n") for part in (split(line, width) or [""])]


def _train_parser(sub) -> None:
    from dataclasses import MISSING, fields

    from labkit.settings.config import TrainConfig, field_choices, field_docs

    docs, choices = field_docs(), field_choices()
    cmd = sub.add_parser("train", help="run GRPO or PPO; every config field is an option",
                         formatter_class=_LinesFormatter, description="Train with GRPO or PPO. Options not given keep the "
                                     "defaults of labkit.settings.config.TrainConfig.")
    cmd.add_argument("--resume", default=None, metavar="RUN_DIR",
                     help="continue the run in RUN_DIR from its last checkpoint")
    for f in fields(TrainConfig):
        default = f.default if f.default is not MISSING else None
        among = f" Choices: {choices[f.name]}." if f.name in choices else ""
        cmd.add_argument(option(f.name), dest=f.name, default=None,
                         metavar="VALUE", help=f"{docs.get(f.name, '')}{among} (default: "
                                               f"{default!r})".replace("%", "%%").lstrip())


def run_train(args) -> dict:
    from labkit.settings.config import TrainConfig, field_types

    given = config_fields([(name, getattr(args, name)) for name in field_types()
                           if getattr(args, name) is not None], option)
    if args.resume is not None:
        if given:
            raise ValueError(f"--resume continues a run with its own config; drop {sorted(given)}")
        from labkit.run.rundir import read_config
        read_config(args.resume)  # a clear error before any model loads
        config = None
    else:
        config = TrainConfig(**given)  # every field checked before any model loads
    from labkit.trainer import train

    return train(config, resume=args.resume).summary()


def _diagnose_parser(sub) -> None:
    cmd = sub.add_parser("diagnose", help="baseline error and gradient noise of each "
                                          "advantage estimator on one policy",
                         description="On the first held-out problems: V* per prompt, each "
                                     "estimator's baseline MSE and bias, the policy gradient's "
                                     "relative variance and cosine to a reference "
                                     "(docs/diagnostics.md). Prints a table, then the record "
                                     "as a JSON last line.")
    cmd.add_argument("--run", default=None, metavar="RUN_DIR",
                     help="measure the latest checkpoint of this run (policy and, for PPO, "
                          "critic) under its config")
    cmd.add_argument("--set", nargs=2, action="append", default=[], dest="fields",
                     metavar=("FIELD", "VALUE"),
                     help="a TrainConfig field, e.g. --set algo ppo (a fresh critic); "
                          "repeatable")
    for name, default, what in (("prompts", 16, "B: prompts"),
                                ("batches", 16, "K: independent batches"),
                                ("samples", 128, "M: completions per prompt for V*"),
                                ("seed", 0, "seeds the draws")):
        cmd.add_argument(f"--{name}", type=int, default=default,
                         help=f"{what} (default: {default})")
    cmd.add_argument("--group-size", type=int, default=None,
                     help="G per batch (default: the config's group_size)")
    cmd.add_argument("--out", default=None, help="append the record to this jsonl file")
    cmd.add_argument("--threads", type=int, default=None,
                     help="torch CPU threads (default: torch's; 1 is faster for the embedded "
                          "model on a busy machine, docs/diagnostics.md)")


def run_diagnose(args) -> dict:
    from labkit.probes.diagnose import DiagSettings, diagnose_trainer, table
    from labkit.settings.config import TrainConfig
    from labkit.trainer import Trainer

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    settings = DiagSettings(prompts=args.prompts, group_size=args.group_size,
                            batches=args.batches, samples=args.samples, seed=args.seed)
    given = config_fields(args.fields, lambda name: f"--set {name}")
    given.setdefault("progress", False)
    if args.run is not None:
        trainer, step = Trainer.from_run(args.run, given)
    else:
        trainer, step = Trainer(TrainConfig(**given)), None
    _, record = diagnose_trainer(trainer, settings, step=step)
    print(table(record))
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
    return record


def _run_parser(sub) -> None:
    cmd = sub.add_parser("run", help="execute a notebook into a new run directory",
                         description="Execute NOTEBOOK with papermill into "
                                     "experiments/runs/<name>/<time>-<pid>: notebook.ipynb, "
                                     "parameters.json, report.html and what the notebook writes.")
    cmd.add_argument("notebook", help="a notebook with one cell tagged 'parameters'")
    cmd.add_argument("-p", "--parameter", nargs=2, action="append", default=[],
                     metavar=("NAME", "VALUE"), dest="parameters",
                     help="set a parameter (checked against the parameters cell); repeatable")
    cmd.add_argument("--name", default=None,
                     help="folder under the runs root (default: the notebook's name)")
    cmd.add_argument("--root", default=None, help="runs root (default: experiments/runs)")
    cmd.add_argument("--json", action="store_true",
                     help="end with summary.json as one JSON line (for scripts)")


def _sweep_parser(sub) -> None:
    cmd = sub.add_parser("sweep", help="run a notebook over a parameter grid and seeds",
                         description="Run every grid point and seed of an experiment YAML "
                                     "that is not complete yet, then write sweep.csv and "
                                     "comparison.html in its folder.")
    cmd.add_argument("experiment", help="experiments/NAME.yaml (schema at its top)")
    cmd.add_argument("--smoke", action="store_true", help="the YAML's fast `smoke:` variant")
    cmd.add_argument("--workers", type=int, default=None,
                     help="local: notebooks run at once (default: 1); ray without --address: "
                          "the local cluster's size in runs (default: every CPU)")
    cmd.add_argument("--backend", choices=["local", "ray"], default="local",
                     help="local: this machine's processes; ray: each run a Ray task (the "
                          "`cluster` extra), retried if its worker dies (default: local)")
    cmd.add_argument("--address", default=None,
                     help="with --backend ray: join the Ray cluster there (its nodes must see "
                          "the run folders at the same paths); default: start a local one")
    cmd.add_argument("--cpus-per-run", type=float, default=None,
                     help="CPUs a run needs (Ray's task resource; default: the YAML's "
                          "resources.cpus, else 1)")
    cmd.add_argument("--gpus-per-run", type=float, default=None,
                     help="GPUs a run needs (default: the YAML's resources.gpus, else 0)")
    cmd.add_argument("--root", default=None, help="runs root (default: experiments/runs)")
    cmd.add_argument("--dry-run", action="store_true",
                     help="check the YAML against the notebook and list the runs; run nothing")
    cmd.add_argument("--beside", action="store_true",
                     help="run even beside a sweep that times its steps, or, for one that "
                          "does, beside other sweeps (its step times then share the cores)")


def _tune_parser(sub) -> None:
    cmd = sub.add_parser("tune", help="choose each algorithm's settings by a tuning file's grid",
                         description="Run a tuning file's grid (experiments/tuning/*.yaml: a "
                                     "grid of learning rates per algorithm at tuning seeds, "
                                     "and the rule that picks), then write each algorithm's "
                                     "chosen settings to docs/findings/tuned-<name>.json, "
                                     "which notebook 01 reads (-p tuned FILE).")
    cmd.add_argument("file", help="experiments/tuning/NAME.yaml")
    cmd.add_argument("--workers", type=int, default=1, help="notebooks run at once (default 1; "
                                                            "each runs its arms in parallel)")
    cmd.add_argument("--root", default=None, help="runs root (default: experiments/runs)")
    cmd.add_argument("--dry-run", action="store_true", help="check the file and list the runs")
    cmd.add_argument("--beside", action="store_true", help="run beside a timing sweep")


def _findings_parser(sub) -> None:
    cmd = sub.add_parser("findings", help="write docs/findings.md from the finished claim runs",
                         description="Read every claim of experiments/claims/ and the "
                                     "summaries of its finished runs, and write the findings "
                                     "page: each claim's effect, 95% interval, seeds and "
                                     "verdict.")
    cmd.add_argument("--out", default=None, help="the page to write (default: "
                                                 "docs/findings.md; with --set, findings.md "
                                                 "in the runs root)")
    cmd.add_argument("--claims", default="experiments/claims",
                     help="folder of claim YAML files (default: experiments/claims)")
    cmd.add_argument("--root", default=None, help="runs root (default: experiments/runs)")
    cmd.add_argument("--smoke", action="store_true", help="read the claims' smoke runs")
    cmd.add_argument("--all", action="store_true",
                     help="first run every claim's sweep (skipping finished runs, so an "
                          "interrupted suite resumes), then write the page")
    cmd.add_argument("--workers", type=int, default=1,
                     help="with --all: notebooks run at once (default: 1)")
    cmd.add_argument("--only", default=None, metavar="FILES",
                     help="with --all: run only these claim files, by stem, comma-separated "
                          "(such as 01_cost,03_group_size); the page still reads every claim")
    cmd.add_argument("--beside", action="store_true",
                     help="with --all: run claim sweeps beside other sweeps even where they "
                          "time steps (by default a timing sweep runs alone)")
    cmd.add_argument("--set", action="append", default=None, metavar="FIELD=VALUE",
                     help="re-point every claim at this TrainConfig field (or dtype, profile), "
                          "such as model=DIR, task=gsm8k, gsm8k_path=F: runs under "
                          "experiments/runs/on-<model>-<task>/ and a page there, the project's "
                          "untouched; a claim that cannot run there is listed with the reason")
    cmd.add_argument("--confirmatory", action="store_true",
                     help="with --all: run each claim file's `confirmatory:` stage (reserved "
                          "seeds, its plan frozen first) instead of its exploratory runs")
    cmd.add_argument("--no-figures", action="store_true",
                     help="write the table only, no SVG figure per claim (the figures need "
                          "kaleido, the `figures` extra, and a Chrome or Chromium)")


def _fork_parser(sub) -> None:
    cmd = sub.add_parser("fork", help="train a run again from its checkpoint at a step, with "
                                      "a change (labkit.fork)")
    cmd.add_argument("run", help="the parent run's folder")
    cmd.add_argument("--at", required=True, metavar="STEP",
                     help="the parent's step whose kept checkpoint the fork starts from; auto: "
                          "the last kept checkpoint before the run's first warning (a "
                          "collapse, a stop rule)")
    cmd.add_argument("--set", action="append", default=None, metavar="FIELD=VALUE",
                     help="a changed TrainConfig field (lr, beta, eps_low, num_iterations, "
                          "loss, estimator, ...), repeated for several")
    cmd.add_argument("--seeds", type=int, default=None, metavar="N",
                     help="N continuations (continuation seeds 0..N-1) with the change and the "
                          "same N without it, paired")
    cmd.add_argument("--steps", type=int, default=None,
                     help="train to this step (default: the parent's last)")
    cmd.add_argument("--out", default=None,
                     help="the fork's folder (default: <run>-fork<STEP> beside the parent)")


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as the one `error:` line every other user error gets (no
    usage block); --help still shows the usage."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def program() -> str:
    """The program the user typed, for usage lines: `labkit` (the console script) or
    `python -m labkit`."""
    name = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
    return "labkit" if name == "labkit" else "python -m labkit"


def version() -> str:
    """The installed distribution's version (the package's own where not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("labkit")
    except PackageNotFoundError:
        from labkit import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog=program(), description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"labkit {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _eval_parser(sub)
    _run_parser(sub)
    _sweep_parser(sub)
    _diagnose_parser(sub)
    _findings_parser(sub)
    _tune_parser(sub)
    _fork_parser(sub)
    from labkit.bench import add_parser as _bench_parser

    _bench_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command in ("run", "sweep", "findings", "tune", "fork"):  # the lab wing's
            from labkit.lab import commands, forks

            return {"run": commands.run_notebook_command, "sweep": commands.run_sweep_command,
                    "findings": commands.run_findings_command,
                    "tune": commands.run_tune_command,
                    "fork": forks.run_fork_command}[args.command](args)
        if args.command == "bench":
            from labkit.bench import main_bench

            return main_bench(args)
        if args.command == "diagnose":
            print(json.dumps(run_diagnose(args), allow_nan=False))
            return 0
        result = run_train(args) if args.command == "train" else run_eval(args)
    except (ValueError, FileNotFoundError, FileExistsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a run that stopped on a non-finite loss: said, not a traceback
        from labkit.records import RunAborted
        from labkit.sandbox.launch import SandboxUnavailable

        if not isinstance(e, (RunAborted, SandboxUnavailable)):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.command == "train":
        from accelerate import PartialState

        if PartialState().is_main_process:  # several processes: the summary once
            print(json.dumps(result))
        return 0
    width = max(map(len, result))
    for key, value in result.items():
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
