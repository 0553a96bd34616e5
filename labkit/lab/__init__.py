"""What the notebooks call: run directories, experiment runs, summaries and their outputs.

A notebook stays thin: it sets its parameters, calls one function here per experiment
(`compare`, `group_size_runs`, `live_training`), shows `labkit.lab.plots` figures of the runs'
histories and ends with `write_outputs`, which leaves `summary.json` (a flat dict of numbers
and short strings) and `metrics.jsonl` (every step record of every run, tagged with `run`)
in the notebook's run directory. Each training run writes its own folder inside it.

The wing's modules: `experiments` (run directories and training runs, in parallel worker
processes), `blocks` (notebook 00's single-group helpers), `summaries` (rows, sentences,
outputs), `verdicts` (intervals over seeds and verdicts), `questions` (notebook 05's
collapse, monitor and diagnostics questions), `widgets` (notebook 03's
controls), `plots` (figures), `live` (notebook 03's live figure), `think` (notebook 06's),
`model_params` (lab.on_model: the parameters that point a notebook at your model, task and device), `runner` and `sweeps`
(papermill runs of notebooks).
"""

from labkit.lab.blocks import (figure_records, group_summary, ppo_row_advantages, problem,
                                registered_advantages)
from labkit.lab.experiments import (BUDGETS, DEFAULT_ARMS, NOTEBOOK_DEFAULTS, batch_prompts_for,
                                    compare, compare_arms, first_and_last_rollouts, fresh_dir,
                                    group_size_runs, histories, informative_prediction,
                                    live_training, parse_arms, parse_fields, parse_list,
                                    project_root, resolve_run_dir, run_all, run_config, seed_list,
                                    setup)
from labkit.lab.model_params import PROFILES
from labkit.lab.model_params import fields as on_model
from labkit.lab.questions import (MONITORS, QUESTIONS, answer, diagnostic_findings, factor_findings,
                                  informative_findings, monitor_findings, parse_monitors)
from labkit.lab.summaries import (arms_table, describe, describe_diagnostics, describe_sweep,
                                  final_diagnostics, flat_summary, live_outputs, state_mb,
                                  summary_rows, sweep_rows, write_outputs)
from labkit.lab.verdicts import (Finding, algo_findings, arm_findings, arm_rows, describe_findings,
                                 findings_summary, group_size_findings, grpo_vs_ppo)
from labkit.lab.tuning import apply_tuned, read_tuned
from labkit.lab.widgets import live_controls

__all__ = ["on_model", "PROFILES", "parse_monitors", "read_tuned", "apply_tuned", "BUDGETS", "DEFAULT_ARMS", "MONITORS", "NOTEBOOK_DEFAULTS", "QUESTIONS", "Finding",
           "answer", "arms_table", "arm_findings", "arm_rows", "diagnostic_findings", "factor_findings",
           "monitor_findings", "parse_fields", "informative_findings", "informative_prediction",
           "batch_prompts_for", "compare", "first_and_last_rollouts", "compare_arms", "describe", "describe_diagnostics", "describe_findings",
           "describe_sweep", "figure_records", "final_diagnostics", "findings_summary",
           "flat_summary", "fresh_dir", "group_size_findings", "group_size_runs",
           "group_summary", "grpo_vs_ppo", "algo_findings", "histories", "live_controls", "live_outputs",
           "live_training", "parse_arms", "parse_list", "ppo_row_advantages", "problem",
           "project_root", "registered_advantages",
           "resolve_run_dir", "run_all", "run_config", "seed_list", "setup", "state_mb",
           "summary_rows", "sweep_rows", "write_outputs"]
