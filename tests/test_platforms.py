"""labkit on the laptops people have: no unconditional `resource` import (Windows has none),
and peak memory in the right unit on each platform (ru_maxrss: KiB on Linux, bytes on macOS)."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from labkit.model import learner


@pytest.mark.parametrize("platform, maxrss, want_mb", [("linux", 3 * 1024, 3.0),
                                                        ("darwin", 3 * 2**20, 3.0)])
def test_peak_memory_reads_ru_maxrss_in_each_platforms_unit(monkeypatch, platform, maxrss,
                                                            want_mb):
    import resource

    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(resource, "getrusage",
                        lambda who: types.SimpleNamespace(ru_maxrss=maxrss))
    assert learner.peak_rss_mb() == want_mb


def _fake_psutil(peak_bytes: int) -> types.ModuleType:
    module = types.ModuleType("psutil")
    info = types.SimpleNamespace(peak_wset=peak_bytes, rss=peak_bytes // 2)
    module.Process = lambda: types.SimpleNamespace(memory_info=lambda: info)
    return module


def test_on_windows_peak_memory_comes_from_psutil(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setitem(sys.modules, "resource", None)  # `import resource` raises there
    monkeypatch.setitem(sys.modules, "psutil", _fake_psutil(5 * 2**20))
    assert learner.peak_rss_mb() == 5.0


WINDOWS_RUN = """
import builtins, json, sys, types
real_import = builtins.__import__
def no_resource_for_labkit(name, globals=None, *args, **kwargs):
    # as on Windows, for labkit's own code (Linux builds of its dependencies may need it)
    if name == "resource" and (globals or {}).get("__name__", "").startswith("labkit"):
        raise ImportError("No module named 'resource'")
    return real_import(name, globals, *args, **kwargs)
builtins.__import__ = no_resource_for_labkit
import labkit.bench.workers, labkit.trainer
from labkit.settings.config import TrainConfig
from labkit.model.models import load
load(device="cpu")  # transformers imports its model classes lazily: before the switch below
psutil = types.ModuleType("psutil")
info = types.SimpleNamespace(peak_wset=7 * 2**20)
psutil.Process = lambda: types.SimpleNamespace(memory_info=lambda: info)
sys.modules["psutil"] = psutil
sys.platform = "win32"
result = labkit.trainer.train(TrainConfig(steps=1, batch_prompts=2, group_size=2,
    max_new_tokens=4, eval_every=1000, eval_n=2, eval_samples=0, cgc_prompts=0,
    progress=False, run_dir=sys.argv[1]))
records = [json.loads(line) for line in open(result.run_dir / "metrics.jsonl")]
print(json.dumps([r.get("perf/mem_mb") for r in records]))
"""


def test_labkit_imports_and_trains_where_there_is_no_resource_module(tmp_path):
    done = subprocess.run([sys.executable, "-c", WINDOWS_RUN, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 7.0 in json.loads(done.stdout.strip().splitlines()[-1])
