"""Same config, same machine, same thread count: the same metrics, bit for bit."""

import json

import pytest
import torch

from labkit.reproducible import select_rows
from labkit.run.rundir import read_log
from labkit.settings.config import TrainConfig
from labkit.trainer import train


def _grads(fn, x, index, upstream):
    x = x.detach().clone().requires_grad_(True)
    (fn(x, index) * upstream).sum().backward()
    return x.grad


def test_select_rows_matches_indexing_and_repeats_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, 7, 32, generator=g)
    index = torch.arange(32).repeat_interleave(8)[torch.randperm(256, generator=g)]
    upstream = torch.randn(256, 4, 7, 32, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(select_rows(x, index), x[index])
        ours = _grads(select_rows, x, index, upstream)
        theirs = _grads(lambda t, i: t[i], x, index, upstream)
        torch.testing.assert_close(ours, theirs)  # the same sums, up to their order
        for _ in range(20):  # index_put's atomic adds differ here from call to call
            assert torch.equal(_grads(select_rows, x, index, upstream), ours)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("G", [1, 2, 5, 8, 33])
def test_select_rows_gradient_of_whole_groups_adds_in_index_order(G):
    """Rows repeated G times in a run (a rollout's groups): the gradient is a serial add in
    index order onto zeros, bit for bit (a sum of negative zeros included), at any thread
    count."""
    g = torch.Generator().manual_seed(G)
    x = torch.randn(3, 5, 7, generator=g)
    index = torch.arange(3).repeat_interleave(G)
    upstream = torch.randn(3 * G, 5, 7, generator=g)
    upstream[:, 0, 0] = -0.0  # a sum of negative zeros onto zeros is +0.0, as index_add_'s
    expected = torch.zeros(3, 5, 7)
    for j, row in enumerate(index.tolist()):  # one add at a time, in index order
        expected[row] = expected[row] + upstream[j]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            got = _grads(select_rows, x, index, upstream)
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # the bits
    finally:
        torch.set_num_threads(threads)


def test_select_rows_gradient_of_a_strided_upstream_adds_in_index_order():
    """A KV cache's rows joined to new keys (`torch.cat` along positions), as the update's
    shared prompt is: the gradient that reaches `select_rows` is a strided slice, and it is
    still the serial add in index order, bit for bit."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 6, 4, generator=g)
    index = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0])
    new = torch.randn(8, 3, 5, 4, generator=g)
    upstream = torch.randn(8, 3, 11, 4, generator=g)
    leaf = x.clone().requires_grad_(True)
    joined = torch.cat([select_rows(leaf, index), new], dim=2)
    joined.backward(upstream)
    expected = torch.zeros(2, 3, 6, 4)
    for j, row in enumerate(index.tolist()):
        expected[row] = expected[row] + upstream[j, :, :6]
    assert not upstream[:, :, :6].is_contiguous()
    assert torch.equal(leaf.grad.view(torch.int32), expected.view(torch.int32))


def _metrics(run_dir):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")}
            for r in read_log(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_two_threaded_runs_log_the_same_metrics(tmp_path, algo):
    """Two runs at 2 threads: before the shared-prompt gather's backward added in index order,
    they parted at step 2 (the KV cache's gradient came from atomic adds)."""
    threads = torch.get_num_threads()
    try:
        runs = []
        for k in range(2):
            config = TrainConfig(algo=algo, steps=4, batch_prompts=32, group_size=8,
                                 num_iterations=2, eval_every=4, eval_n=32, eval_samples=0,
                                 cgc_prompts=0, threads=2, progress=False,
                                 run_dir=str(tmp_path / f"run{k}"))
            runs.append(train(config).run_dir)
    finally:
        torch.set_num_threads(threads)
    first, second = _metrics(runs[0]), _metrics(runs[1])
    assert len(first) == 5 and first == second
    machine = json.loads((runs[0] / "config.json").read_text())["machine"]
    assert machine["threads"] == 2
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert machine["precision"] == "fp32" and machine["device"] == "cpu"
