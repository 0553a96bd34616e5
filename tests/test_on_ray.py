"""Sweeps on Ray (`--backend ray`): the same run folders and sweep.csv as the local backend, a
run whose worker dies retried and then reported, an interrupted sweep resumed. One Ray
cluster of 2 CPUs, started apart (`ray start --head`), serves the module: every sweep joins
it at its address (`--address`), as on a cluster someone else runs."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from cli import in_process
from peers import peer

from labkit.lab import on_ray, sweeps

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """The address of a head node of 2 CPUs in its own processes, stopped at the end. Token
    authentication is off for this throwaway cluster on loopback (Ray 2.60 turns it on by
    default; a driver then needs the cluster's token)."""
    import os
    import socket
    import subprocess

    ray = peer("ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = Path(sys.executable).with_name("ray")
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    started = subprocess.run([str(command), "start", "--head", "--port", str(port),
                              "--num-cpus", "2", "--include-dashboard=false",
                              "--node-ip-address", "127.0.0.1"],
                             capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        yield f"127.0.0.1:{port}"
        assert not ray.is_initialized()  # each sweep left the cluster it joined
    finally:
        subprocess.run([str(command), "stop", "--force"], capture_output=True, timeout=120)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _sweep_file(tmp_path: Path, grid: dict, parameters: dict | None = None,
                name: str = "tiny_ray") -> Path:
    import yaml

    spec = {"notebook": str(FIXTURES / "tiny.ipynb"), "name": name,
            "parameters": {"scale": 2, "noisy": True, "plot": False, **(parameters or {})},
            "grid": grid, "seeds": [0]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _rows(root: Path, name: str) -> list[dict]:
    """sweep.csv's rows, the kernel's interpreter resolved (a cluster started by `ray start`
    runs it as python3, the same file as python)."""
    with open(root / name / sweeps.CSV_NAME) as f:
        return [{**r, "python": str(Path(r["python"]).resolve())} if r.get("python") else r
                for r in csv.DictReader(f)]


def test_a_ray_sweep_writes_what_the_local_backend_writes_and_resumes(ray_cluster, tmp_path):
    path = _sweep_file(tmp_path, {"steps": [1, 2]})
    sweep = sweeps.load_sweep(path)
    local = sweeps.run_sweep(sweep, tmp_path / "local", progress=False)
    on_ray_runs = sweeps.run_sweep(sweep, tmp_path / "ray", progress=False, backend="ray",
                                   address=ray_cluster)
    assert [r.status for r in local] == [r.status for r in on_ray_runs] == ["ok", "ok"]
    assert _rows(tmp_path / "ray", "tiny_ray") == _rows(tmp_path / "local", "tiny_ray")
    assert [float(r["score"]) for r in _rows(tmp_path / "ray", "tiny_ray")] == [2.0, 4.0]
    for run in on_ray_runs:  # each run's folder as the local backend leaves it
        assert {"summary.json", "notebook.ipynb", "report.html"} <= \
            {p.name for p in run.path.iterdir()}

    # interrupted: one run lost its summary; a second invocation reruns that one only
    first, second = on_ray_runs
    stamp = (second.path / "notebook.ipynb").stat().st_mtime_ns
    (first.path / "summary.json").unlink()
    done = in_process("sweep", path, "--root", tmp_path / "ray", "--backend", "ray",
                      "--address", ray_cluster)  # the command line's way in
    assert done.returncode == 0, done.stderr[-2000:]
    again = sweeps.run_sweep(sweep, tmp_path / "ray", progress=False, backend="ray",
                             address=ray_cluster)
    assert [r.status for r in again] == ["done", "done"]
    assert (second.path / "notebook.ipynb").stat().st_mtime_ns == stamp
    assert json.loads((first.path / "summary.json").read_text())["score"] == 2.0
    aside = list((first.path.parent / sweeps.INCOMPLETE).iterdir())
    assert len(aside) == 1 and aside[0].name.startswith(first.id)


def test_a_run_whose_worker_dies_is_retried_then_reported_while_the_others_finish(
        ray_cluster, tmp_path):
    """kill_worker kills the process that runs the notebook's kernel: always (every attempt
    dies: failed after MAX_RETRIES retries, with the error in sweep.csv), or once (the retry
    finishes, in a fresh folder); a third run never dies."""
    marker = tmp_path / "died-once"
    path = _sweep_file(tmp_path, {"kill_worker": ["always", str(marker), ""]},
                       {"steps": 1}, name="dies")
    runs = sweeps.run_sweep(sweeps.load_sweep(path), tmp_path / "runs", progress=False,
                            backend="ray", address=ray_cluster)
    assert [r.status for r in runs] == ["failed", "ok", "ok"]
    assert marker.exists()
    assert f"died {on_ray.MAX_RETRIES + 1} times" in runs[0].message
    rows = _rows(tmp_path / "runs", "dies")
    assert [r["status"] for r in rows] == ["failed", "ok", "ok"]
    assert rows[0]["error"] == runs[0].message and rows[1]["error"] == rows[2]["error"] == ""
    assert float(rows[1]["score"]) == float(rows[2]["score"]) == 2.0
    aside = [p.name for p in (tmp_path / "runs" / "dies" / sweeps.INCOMPLETE).iterdir()]
    # the always-dying run left a folder per retry, the once-dying run one
    assert sum(name.startswith(runs[0].id) for name in aside) == on_ray.MAX_RETRIES
    assert sum(name.startswith(runs[1].id + "-") for name in aside) == 1


def test_sweep_flags_are_checked_before_anything_runs(tmp_path, monkeypatch):
    sweep = str(_sweep_file(tmp_path, {"steps": [1]}))
    cases = [(["--address", "ray://x:10001"], "--address is the Ray cluster's"),
             (["--backend", "ray", "--cpus-per-run", "0"], "--cpus-per-run must be > 0"),
             (["--backend", "ray", "--gpus-per-run", "-1"], "--gpus-per-run must be >= 0"),
             (["--workers", "0"], "--workers must be >= 1")]
    for flags, message in cases:
        done = in_process("sweep", sweep, "--root", tmp_path / "runs", *flags)
        err = done.stderr
        assert done.returncode == 2 and err.startswith("error: ") and message in err, (flags, err)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    done = in_process("sweep", sweep, "--root", tmp_path / "runs", "--backend", "ray")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "pip install 'labkit[cluster]'" in done.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("resources, message", [
    ({"cpus": 0}, "resources.cpus must be a number > 0"),
    ({"gpus": -1}, "resources.gpus must be a number >= 0"),
    ({"memory": 1}, "unknown key(s) memory")])
def test_the_yamls_resources_are_checked(tmp_path, resources, message):
    import yaml

    path = _sweep_file(tmp_path, {"steps": [1]})
    spec = yaml.safe_load(path.read_text()) | {"resources": resources}
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sweeps.load_sweep(path)


def test_resources_default_to_one_cpu_and_are_read_from_the_yaml(tmp_path):
    import yaml

    path = _sweep_file(tmp_path, {"steps": [1]})
    assert sweeps.load_sweep(path).resources == {"cpus": 1, "gpus": 0}
    path.write_text(yaml.safe_dump(yaml.safe_load(path.read_text())
                                   | {"resources": {"cpus": 0.5, "gpus": 1}}))
    assert sweeps.load_sweep(path).resources == {"cpus": 0.5, "gpus": 1}
