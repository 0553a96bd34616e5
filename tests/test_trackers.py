"""report_to: what each tracker wrote, read back through its own reader, against
metrics.jsonl; a missing or failing tracker."""

import importlib.util
import math
import shutil

import pytest
from cli import in_process
from crashes import train_then_crash

from labkit.run import trackers
from labkit.run.rundir import read_log
from labkit.settings.config import TrainConfig
from labkit.trainer import train

SMOKE = dict(steps=4, batch_prompts=4, group_size=4, max_new_tokens=12, eval_every=2,
             eval_n=8, eval_samples=0, cgc_prompts=0, progress=False, lr=5e-4, seed=1)
REQUIRED = ("tensorboard", "mlflow")
"""Installed by .ci/run; trackio and wandb are optional."""


def _installed(name: str) -> bool:
    return importlib.util.find_spec(trackers.MODULES[name]) is not None


def _curves(records: list[dict]) -> dict[str, dict[int, float]]:
    """metrics.jsonl as curves: each finite number's value at each step."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        for key, value in r.items():
            if key != "step" and isinstance(value, (int, float)) and \
                    not isinstance(value, bool) and math.isfinite(value):
                out.setdefault(key, {})[r["step"]] = float(value)
    return out


def _tensorboard_curves(folder) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    curves = {}
    for tag in events.Tags()["scalars"]:
        points = events.Scalars(tag)
        steps = [p.step for p in points]
        assert len(steps) == len(set(steps)), (tag, steps)  # the resume dropped the re-run
        curves[tag] = {p.step: p.value for p in points}
    return curves


def _mlflow_curves(uri: str, run_id: str, keys) -> dict[str, dict[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    curves = {}
    for key in keys:
        history = client.get_metric_history(run_id, key)
        steps = [m.step for m in history]
        assert len(steps) == len(set(steps)), (key, steps)
        curves[key] = {m.step: m.value for m in history}
    return curves


def _same(expected: dict, got: dict, rel: float) -> None:
    assert set(got) == set(expected)
    for key, curve in expected.items():
        assert set(got[key]) == set(curve), key
        for step, value in curve.items():
            assert got[key][step] == pytest.approx(value, rel=rel, abs=1e-7), (key, step)


def test_tensorboard_and_mlflow_show_the_curves_of_metrics_jsonl(tmp_path, monkeypatch):
    """A run cut after step 3 (checkpoint at 2) and resumed: each tracker holds every
    metric of metrics.jsonl at every step, once, read back through its own reader; the
    config is there as hyperparameters, and the run directory."""
    for name in REQUIRED:
        if not _installed(name):
            pytest.fail(f"{name} is not installed: .ci/run installs it for this test")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run = tmp_path / "run"
    config = TrainConfig(run_dir=str(run), report_to="tensorboard,mlflow", checkpoint_every=2,
                         **SMOKE)

    train_then_crash(config, after_step=3)
    train(resume=run)
    expected = _curves(read_log(run / "metrics.jsonl"))
    assert sorted(expected["rollout/reward_mean"]) == [1, 2, 3, 4]
    # TensorBoard stores float32
    _same(expected, _tensorboard_curves(run / "tensorboard"), rel=1e-6)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs([client.get_experiment_by_name("labkit").experiment_id])
    _same(expected, _mlflow_curves(uri, found.info.run_id, expected), rel=1e-12)
    assert found.data.params["group_size"] == "4" and found.data.params["report_to"] == \
        "tensorboard,mlflow"
    assert found.data.tags["labkit.run_dir"] == str(run.resolve())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["group_size"].number_value == 4 and hparams["algo"].string_value == "grpo"
    assert set(hparams) == set(config.to_dict())


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_run_goes_on(tmp_path, capsys):
    if not _installed("tensorboard"):
        pytest.fail("tensorboard is not installed: .ci/run installs it for this test")
    run = tmp_path / "run"

    def remove_its_folder(report):
        if report.step == 1:
            shutil.rmtree(run / "tensorboard")

    result = train(TrainConfig(run_dir=str(run), report_to="tensorboard", **SMOKE),
                   callbacks=[remove_its_folder])
    assert [r["step"] for r in result.history] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in read_log(run / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    warnings = [line for line in capsys.readouterr().err.splitlines()
                if line.startswith("warning: report_to tensorboard failed")]
    assert len(warnings) == 1 and "is gone" in warnings[0]  # said once, not every step
    assert not (run / "tensorboard").exists()


@pytest.mark.parametrize("name", ["trackio", "wandb"])
def test_optional_trackers_run_clean_and_write_their_files(tmp_path, monkeypatch, name):
    if not _installed(name):
        pytest.skip(f"{name} is optional (pip install 'labkit[{name}]')")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    train(TrainConfig(run_dir=str(run), report_to=name, **dict(SMOKE, steps=2)))
    place = run / "wandb" if name == "wandb" else tmp_path / "trackio"
    assert any(p.is_file() and p.stat().st_size > 0 for p in place.rglob("*")), place


def test_report_to_names_known_trackers():
    assert TrainConfig(report_to=" tensorboard , mlflow").report_to == "tensorboard,mlflow"
    assert TrainConfig(report_to="").report_to == "none"
    with pytest.raises(ValueError, match=r"report_to='tensorbord'.*unknown tracker"):
        TrainConfig(report_to="tensorbord")


def test_a_missing_tracker_is_one_line_naming_its_extra_before_the_model_loads(
        tmp_path, monkeypatch):
    monkeypatch.setitem(trackers.MODULES, "wandb", "labkit_no_such_module")
    done = in_process("train", "--report-to", "wandb", "--run-dir", tmp_path / "run")
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: report_to=wandb: the wandb package is not "
                                   "installed; pip install 'labkit[wandb]'")
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
