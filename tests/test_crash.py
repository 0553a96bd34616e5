"""Crash safety: a run killed with SIGKILL keeps a metrics.jsonl of whole lines and a loadable
last checkpoint, and `--resume` finishes it; two runs never write into one folder; an
interrupted sweep reruns only what did not finish. Real processes, real kills."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from labkit.run import rundir
from labkit.run.rundir import (Log, RunDirBusy, RunLock, claim_run_dir, cut_log, latest_checkpoint,
                               load_checkpoint, read_log, save_checkpoint)
from labkit.settings.config import TrainConfig

HERE = Path(__file__).resolve().parent
TINY = HERE / "fixtures" / "tiny.ipynb"
STEPS = 10
TRAIN = ["--steps", str(STEPS), "--batch-prompts", "4", "--group-size", "4",
         "--max-new-tokens", "12", "--eval-every", "1000", "--eval-n", "4", "--eval-samples", "0",
         "--cgc-prompts", "0", "--checkpoint-every", "1", "--progress", "false", "--lr", "5e-4"]


# --- killing a real training run ---------------------------------------------------------------

def start(args, cwd: Path, log: str) -> subprocess.Popen:
    out = open(cwd / f"{log}.out", "w")
    err = open(cwd / f"{log}.err", "w")
    return subprocess.Popen([sys.executable, "-m", "labkit", *map(str, args)], cwd=cwd,
                            stdout=out, stderr=err)


def step_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_bytes().count(b"\n") - 1 if path.is_file() else -1  # step 0 is an eval


def kill_after(proc: subprocess.Popen, run_dir: Path, lines: int, delay: float) -> None:
    """SIGKILL `proc` `delay` seconds after metrics.jsonl holds `lines` step records (so
    mid-way through a later step, or right inside the checkpoint that follows a record)."""
    deadline = time.monotonic() + 240
    while step_lines(run_dir) < lines:
        assert proc.poll() is None, f"the run ended before the kill: {proc.returncode}"
        assert time.monotonic() < deadline, "the run did not reach the kill point"
        time.sleep(0.005)
    time.sleep(delay)
    assert proc.poll() is None, "the run finished before the kill: raise STEPS"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def assert_intact(run_dir: Path) -> int:
    """Every line of metrics.jsonl is a whole JSON record, steps 0, 1, ... with no gap or
    repeat, and the last checkpoint loads at the last step or the one before. Returns the
    checkpoint's step."""
    text = (run_dir / "metrics.jsonl").read_text(encoding="utf-8")
    assert text.endswith("\n"), "a torn last line"
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert steps == list(range(len(steps))), steps
    checkpoint = latest_checkpoint(run_dir)
    state = load_checkpoint(checkpoint)
    assert state["step"] in (steps[-1], steps[-1] - 1), (state["step"], steps)
    assert set(state) >= {"policy", "optimizer", "scheduler", "rng"}
    return state["step"]


def test_sigkill_mid_run_then_resume_finishes_every_step(tmp_path):
    run_dir = tmp_path / "run"
    first = start(["train", "--run-dir", run_dir, *TRAIN], tmp_path, "first")
    kill_after(first, run_dir, lines=2, delay=0.15)  # inside step 3's rollout or update
    kept = assert_intact(run_dir)
    before = (run_dir / "metrics.jsonl").read_text().splitlines()[:kept + 1]

    second = start(["train", "--resume", run_dir], tmp_path, "second")
    kill_after(second, run_dir, lines=kept + 3, delay=0.0)  # as the record lands, mid-checkpoint
    again = assert_intact(run_dir)
    assert again > kept
    # the resume continued from the checkpoint: the records up to it are untouched
    assert (run_dir / "metrics.jsonl").read_text().splitlines()[:kept + 1] == before

    third = start(["train", "--resume", run_dir], tmp_path, "third")
    assert third.wait(timeout=600) == 0, (tmp_path / "third.err").read_text()
    summary = json.loads((tmp_path / "third.out").read_text().strip().splitlines()[-1])
    assert summary["steps"] == STEPS and summary["stopped"] is None
    records = read_log(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    assert load_checkpoint(latest_checkpoint(run_dir))["step"] == STEPS
    assert (run_dir / "final" / "config.json").is_file()


# --- the pieces that make it so ----------------------------------------------------------------

def test_a_torn_last_line_is_dropped_and_cut_off_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = "".join(json.dumps({"step": s, "x": s / 3}) + "\n" for s in range(3))
    path.write_text(whole + '{"step": 3, "x": 0.33')  # a power cut inside the fourth line
    assert [r["step"] for r in read_log(path)] == [0, 1, 2]
    cut_log(path, 10)
    assert path.read_text() == whole  # the whole lines, the torn one gone
    writer = Log(path)
    writer.write({"step": 3, "x": 1.0})
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]


def test_each_record_is_one_write_of_a_whole_line_then_synced(tmp_path, monkeypatch):
    real_write, real_fsync = os.write, os.fsync
    chunks, synced = [], []
    writer = Log(tmp_path / "metrics.jsonl")
    monkeypatch.setattr(rundir.os, "write", lambda fd, data: (
        chunks.append(bytes(data)) if fd == writer._fd else None, real_write(fd, data))[1])
    monkeypatch.setattr(rundir.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    records = [{"step": 1, "loss/total": float("nan"), "text": "x" * 9000}, {"step": 2}]
    for record in records:
        writer.write(record)
    writer.close()
    assert len(chunks) == 2 and all(c.endswith(b"\n") and c.count(b"\n") == 1 for c in chunks)
    assert [json.loads(c)["step"] for c in chunks] == [1, 2]
    assert len(synced) == 2


def test_a_checkpoint_killed_while_saving_leaves_the_previous_one(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"policy": {"w": torch.ones(3)}})

    def dies_halfway(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(rundir.torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, {"policy": {"w": torch.zeros(3)}})
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path).name == "step_000001.pt"
    assert torch.equal(load_checkpoint(latest_checkpoint(tmp_path))["policy"]["w"], torch.ones(3))
    folder = tmp_path / rundir.CHECKPOINTS
    assert [p.name for p in folder.glob(".*.tmp")] == [".step_000002.pt.tmp"]
    save_checkpoint(tmp_path, 2, {"policy": {"w": torch.zeros(3)}})  # clears the leftover
    assert sorted(p.name for p in folder.iterdir()) == ["step_000001.pt", "step_000002.pt"]


# --- one run per folder ------------------------------------------------------------------------

def test_threads_racing_for_one_run_dir_give_it_to_exactly_one(tmp_path):
    target, barrier, results = tmp_path / "shared", threading.Barrier(8), []

    def claim():
        barrier.wait()
        try:
            results.append(claim_run_dir(target))
        except FileExistsError as e:
            results.append(e)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if isinstance(r, RunLock)]
    assert len(won) == 1 and all(isinstance(r, RunDirBusy) for r in results if r is not won[0])
    won[0].release()
    (target / "config.json").write_text("{}")  # the winner's run wrote there
    with pytest.raises(FileExistsError, match="already holds files"):
        claim_run_dir(target)


RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from labkit.run.rundir import claim_run_dir
    go = Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.001)
    try:
        lock = claim_run_dir(sys.argv[1])
    except FileExistsError as e:
        print("lost", e)
    else:
        (Path(sys.argv[1]) / "config.json").write_text("{}")
        print("won")
        time.sleep(1)
""")


def test_processes_racing_for_one_run_dir_give_it_to_exactly_one(tmp_path):
    target, go = tmp_path / "shared", tmp_path / "go"
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(target), str(go)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(3)]
    time.sleep(4)  # let each import labkit and wait at the line
    go.write_text("")
    outcomes = [p.communicate(timeout=120)[0].split(" ", 1)[0].strip() for p in racers]
    assert sorted(outcomes) == ["lost", "lost", "won"], outcomes


def test_a_run_whose_folder_is_held_does_not_start(tmp_path):
    target = tmp_path / "run"
    target.mkdir()
    from labkit.trainer import train

    with RunLock(target):
        with pytest.raises(RunDirBusy, match="in use by another run"):
            train(TrainConfig(run_dir=str(target), steps=1))
    assert sorted(p.name for p in target.iterdir()) == [".lock"]  # nothing was written


def test_a_crashed_runs_lock_does_not_block_its_resume(tmp_path):
    """The lock dies with its process: a SIGKILLed holder leaves the file, not the lock."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from labkit.run.rundir import RunLock
        RunLock({str(tmp_path)!r})
        print("held", flush=True)
        time.sleep(300)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunDirBusy, match=f"pid {holder.pid}"):
        RunLock(tmp_path)
    holder.kill()
    holder.wait(timeout=60)
    RunLock(tmp_path).release()


# --- sweeps ------------------------------------------------------------------------------------

def test_a_killed_sweep_reruns_only_what_did_not_finish(tmp_path):
    """SIGKILL a sweep (and its kernels: its process group) once its first run is complete;
    the next invocation leaves that run alone, sets the partial one aside and runs the rest."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"notebook": str(TINY), "name": "s",
                                    "parameters": {"plot": False}, "grid": {"steps": [1]},
                                    "seeds": [0, 1, 2]}))
    root = tmp_path / "runs"
    sweep = subprocess.Popen([sys.executable, "-m", "labkit", "sweep", str(path), "--root",
                              str(root)], cwd=tmp_path, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = root / "s" / "steps=1,seed=0"
    deadline = time.monotonic() + 240
    while not (first / "summary.json").is_file():
        assert sweep.poll() is None and time.monotonic() < deadline, "no run finished"
        time.sleep(0.01)
    os.killpg(sweep.pid, signal.SIGKILL)
    sweep.wait(timeout=60)
    stamp = (first / "notebook.ipynb").stat().st_mtime_ns
    assert not (root / "s" / "steps=1,seed=2" / "summary.json").exists()

    done = subprocess.run([sys.executable, "-m", "labkit", "sweep", str(path), "--root",
                           str(root)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert (first / "notebook.ipynb").stat().st_mtime_ns == stamp  # not run again
    for seed in (0, 1, 2):
        summary = json.loads((root / "s" / f"steps=1,seed={seed}" / "summary.json").read_text())
        assert summary["score"] == 1.0


def test_a_sweep_already_running_is_not_run_twice(tmp_path, monkeypatch):
    from labkit.lab import sweeps

    def refuse(*args, **kwargs):
        raise AssertionError("a notebook was executed")

    monkeypatch.setattr(sweeps, "execute", refuse)
    sweep = sweeps.load_sweep(HERE / "fixtures" / "tiny_sweep.yaml", smoke=True)
    (tmp_path / sweep.name).mkdir()
    with RunLock(tmp_path / sweep.name):  # the other invocation
        with pytest.raises(RunDirBusy, match="in use by another run"):
            sweeps.run_sweep(sweep, tmp_path)
    assert sorted(p.name for p in (tmp_path / sweep.name).iterdir()) == [".lock"]
