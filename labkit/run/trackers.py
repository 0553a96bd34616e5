"""Experiment trackers (`TrainConfig.report_to`): views of a run in the tool people already
watch runs in. metrics.jsonl stays the record; a tracker receives each of its records.

Each tracker is its own client library, an optional extra (`pip install 'labkit[NAME]'`):

- `tensorboard`: event files in `<run_dir>/tensorboard/` through torch's SummaryWriter
  (`tensorboard --logdir experiments/runs`); the config as hyperparameters and as text.
- `mlflow`: a run in the MLflow store at `MLFLOW_TRACKING_URI`, by default the SQLite file
  `experiments/runs/mlflow.db` (`mlflow ui --backend-store-uri sqlite:///experiments/runs/
  mlflow.db`), experiment `labkit`; the config as params, the run directory as a tag.
- `trackio`: trackio's local store, project `labkit`.
- `wandb`: Weights & Biases in offline mode, files in `<run_dir>/wandb/` (`wandb sync` them).

Every metric keeps its docs/metrics.md name (`rollout/reward_mean`, ...) at its step; a
value that is not a finite number is left out. A resumed run re-runs the steps after its
checkpoint: TensorBoard drops its events from there (`purge_step`); the others cannot drop
points, so they start a new run that replays the records kept (MLflow deletes the run it
replaces). A tracker that fails (its folder removed, its store gone) says so once on stderr
and is dropped; the run goes on.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

from labkit import grammar

TRACKERS = ("tensorboard", "mlflow", "trackio", "wandb")
"""The names `report_to` takes (comma-separated; `none` for no tracker)."""

MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "trackio": "trackio",
           "wandb": "wandb"}
"""The module each tracker imports (its extra has the same name)."""

MLFLOW_DEFAULT_DB = Path("experiments") / "runs" / "mlflow.db"
EXPERIMENT = "labkit"


def parse(report_to: str) -> list[str]:
    """The tracker names of `report_to`, a comma-separated list (labkit.grammar's tokens;
    "none" or "" for none); GrammarError at a name not in TRACKERS."""
    field = "report_to"
    pieces = [p for p in grammar.split(grammar.tokens(report_to, field), ",", field, report_to)
              if p]
    names = [grammar.source(report_to, piece) for piece in pieces]
    if names in ([], ["none"]):
        return []
    for name, piece in zip(names, pieces):
        if name not in TRACKERS:
            raise grammar.GrammarError(field, report_to, piece[0].start,
                                       f"unknown tracker {name!r}; choose from "
                                       f"{', '.join(TRACKERS)} (comma-separated), or none")
    return list(dict.fromkeys(names))


def require(report_to: str) -> None:
    """ValueError, naming the extra to install, for a tracker whose library is missing (the
    trainer asks before any model loads)."""
    for name in parse(report_to):
        if importlib.util.find_spec(MODULES[name]) is None:
            raise ValueError(f"report_to={name}: the {name} package is not installed; "
                             f"pip install 'labkit[{name}]'")


def _scalars(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if k != "step" and
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _params(config: dict) -> dict[str, str]:
    """The config as flat string hyperparameters (None as 'None')."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}


class Tracker:
    """One tracker: `log(step, scalars)` per metrics.jsonl record, `close()` at the end.
    Made with the run directory, the config and the first step it will be sent; `replays`
    trackers are sent the records before that step too (a resumed run's)."""

    name = ""
    replays = True

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Raise if the tracker can no longer write (its folder is gone)."""

    def close(self) -> None:
        pass


class TensorBoard(Tracker):
    name = "tensorboard"
    replays = False

    def __init__(self, run_dir: Path, config: dict, first_step: int):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.folder = run_dir / "tensorboard"
        # a resumed run logs its steps from first_step again: TensorBoard drops the old ones
        self.writer = SummaryWriter(str(self.folder),
                                    purge_step=first_step if first_step > 0 else None)
        if first_step == 0:
            params = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
                      for k, v in config.items()}
            for summary in hparams(params, {}):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```")
            self.writer.add_text("run_dir", str(run_dir))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def check(self) -> None:
        if not self.folder.is_dir():
            raise OSError(f"its folder {self.folder} is gone")

    def close(self) -> None:
        self.writer.close()


class MLflow(Tracker):
    name = "mlflow"

    def __init__(self, run_dir: Path, config: dict, first_step: int):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{MLFLOW_DEFAULT_DB.resolve()}"
        if uri.startswith("sqlite:///"):
            Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(EXPERIMENT)
        experiment = found.experiment_id if found is not None else \
            self.client.create_experiment(EXPERIMENT)
        run = self.client.create_run(experiment, run_name=run_dir.name,
                                     tags={"labkit.run_dir": str(run_dir.resolve())})
        self.run_id = run.info.run_id
        params = [Param(k, v[:6000]) for k, v in _params(config).items()]
        self.client.log_batch(self.run_id, params=params)
        ids = run_dir / "trackers.json"
        known = json.loads(ids.read_text()) if ids.is_file() else {}
        if known.get("mlflow_run_id") and first_step > 0:  # resumed: this run replaces it
            self.client.delete_run(known["mlflow_run_id"])
        ids.write_text(json.dumps({**known, "mlflow_run_id": self.run_id}))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step)
                                                    for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackio(Tracker):
    name = "trackio"

    def __init__(self, run_dir: Path, config: dict, first_step: int):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=EXPERIMENT, name=f"{run_dir.name}-from-{first_step}"
                                if first_step else run_dir.name,
                                config={**config, "run_dir": str(run_dir.resolve())})

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.trackio.log(scalars, step=step)

    def close(self) -> None:
        self.trackio.finish()


class Wandb(Tracker):
    name = "wandb"

    def __init__(self, run_dir: Path, config: dict, first_step: int):
        import wandb

        self.folder = run_dir / "wandb"
        self.run = wandb.init(mode="offline", project=EXPERIMENT, name=run_dir.name,
                              dir=str(run_dir), config={**config,
                                                        "run_dir": str(run_dir.resolve())},
                              reinit="create_new")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def check(self) -> None:
        if not self.folder.is_dir():
            raise OSError(f"its folder {self.folder} is gone")

    def close(self) -> None:
        self.run.finish()


KINDS = {"tensorboard": TensorBoard, "mlflow": MLflow, "trackio": Trackio, "wandb": Wandb}


class Trackers:
    """The run's trackers: each record goes to every one still working."""

    def __init__(self, report_to: str, run_dir: Path, config: dict,
                 history: list[dict] = ()):
        self.live: list[Tracker] = []
        first = history[-1]["step"] + 1 if history else 0
        for name in parse(report_to):
            try:
                tracker = KINDS[name](Path(run_dir), config, first)
            except Exception as e:  # noqa: BLE001 - a tracker never stops a run
                _warn(name, e)
                continue
            self.live.append(tracker)
            if tracker.replays:
                for record in history:
                    self._send(tracker, record)

    def log(self, record: dict) -> None:
        for tracker in list(self.live):
            self._send(tracker, record)

    def _send(self, tracker: Tracker, record: dict) -> None:
        try:
            tracker.check()
            tracker.log(int(record["step"]), _scalars(record))
        except Exception as e:  # noqa: BLE001 - a tracker never stops a run
            _warn(tracker.name, e)
            self.live.remove(tracker)
            try:
                tracker.close()
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        for tracker in self.live:
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                _warn(tracker.name, e)
        self.live = []


def _warn(name: str, error: Exception) -> None:
    print(f"warning: report_to {name} failed ({type(error).__name__}: {error}); the run goes "
          "on without it (metrics.jsonl keeps every record)", file=sys.stderr, flush=True)
