"""Training on several processes (labkit.model.parallel): a share's rollout is the whole rollout's
rows, and a 2-process run (gloo, on the CPU) updates and logs what one process does."""

import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from labkit.model import parallel
from labkit.model.rollout import rollout
from labkit.run.rundir import latest_checkpoint, read_log
from labkit.settings.config import TrainConfig
from labkit.trainer import train
from labkit.update import micro_batch_plan

REPO = Path(__file__).resolve().parents[1]
RUN = ["--steps", "2", "--batch-prompts", "4", "--group-size", "4", "--max-new-tokens", "12",
       "--eval-every", "2", "--eval-n", "8", "--eval-samples", "0", "--cgc-prompts", "0",
       "--progress", "false", "--lr", "1e-3", "--seed", "1", "--checkpoint-every", "1",
       "--entropy-coef", "0.01"]
"""Small steps; the entropy bonus gives every row a gradient (a group of equal rewards has
none from the policy loss), so every process's micro-batches move the weights."""
PROMPTS = ["What is 2 + 3?", "What is 7 - 4?", "What is 3 * 3?", "What is 8 - 1?",
           "What is 1 + 1?", "What is 9 - 5?"]


def _one_process(**settings) -> dict:
    """RUN's flags as a TrainConfig (one process, in this one)."""
    given = dict(zip(RUN[::2], RUN[1::2]))
    values = {k[2:].replace("-", "_"): v for k, v in given.items()}
    types = {"progress": lambda v: v == "true", "lr": float, "entropy_coef": float}
    return {k: types.get(k, int)(v) for k, v in values.items()} | settings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(*args, launcher: str = "torchrun") -> subprocess.CompletedProcess:
    """`labkit train ARGS` on 2 processes, by torch.distributed.run or accelerate launch
    with the repository's MULTI_CPU config (one thread each: the machine's two cores)."""
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_port", str(_free_port())]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(REPO / "scripts" / "accelerate" / "two_processes.yaml"),
                   "--main_process_port", str(_free_port())]
    done = subprocess.run([*command, "-m", "labkit", "train", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**_env(), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _env() -> dict:
    import os

    return dict(os.environ)


def _state(run_dir) -> dict:
    return torch.load(latest_checkpoint(run_dir), weights_only=False)


def _assert_same_run(one: Path, two: Path, atol: float, rtol: float = 0.0) -> None:
    """Equal weights (policy, critic) and equal logged metrics, to `atol` and `rtol`."""
    a, b = _state(one), _state(two)
    for part in ("policy", "critic"):
        assert (part in a) == (part in b)
        for key in a.get(part, {}):
            torch.testing.assert_close(a[part][key], b[part][key], atol=atol, rtol=rtol,
                                       msg=f"{part}.{key}")
    ra, rb = read_log(one / "metrics.jsonl"), read_log(two / "metrics.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for key in x:
            if not key.startswith("perf/"):
                assert x[key] == pytest.approx(y[key], abs=max(atol, 1e-6), rel=rtol,
                                               nan_ok=True), key


def test_a_shares_rollout_is_the_whole_rollouts_rows(tiny):
    model, tokenizer = tiny
    settings = dict(group_size=3, max_new_tokens=10, seed=7)
    whole = rollout(model, tokenizer, PROMPTS, **settings)
    G, T = 3, whole.completion_ids.shape[1]
    for first, stop in ((0, 2), (2, 4), (4, 6), (1, 6)):
        part = rollout(model, tokenizer, PROMPTS[first:stop], shard=(first, len(PROMPTS)),
                       **settings)
        rows = slice(first * G, stop * G)
        t = part.completion_ids.shape[1]
        assert t <= T
        mask = whole.completion_mask[rows]
        assert torch.equal(part.completion_mask, mask[:, :t]) and not mask[:, t:].any()
        assert torch.equal(part.completion_ids * part.completion_mask,
                           whole.completion_ids[rows, :t] * mask[:, :t])
        torch.testing.assert_close(part.old_logprobs, whole.old_logprobs[rows, :t])
        assert part.texts == whole.texts[rows]
    # unsharded, the same prompts draw other numbers: the shard is what makes them agree
    alone = rollout(model, tokenizer, PROMPTS[2:4], **settings)
    assert alone.texts != whole.texts[2 * G:4 * G]


@pytest.mark.parametrize("flash", [None, True])
def test_a_share_padded_to_the_whole_width_decodes_its_rows_bit_for_bit(tiny, flash,
                                                                        monkeypatch):
    """With products whose rows do not depend on the rows beside them (oneDNN's), a share
    of prompts of other lengths, padded to the whole batch's width, gives its rows the very
    bits of the whole rollout through the shared-prefix decoder: the attention of the
    machine's choice (None) and the flash kernel."""
    from labkit import fast
    from labkit.fast import decoder as fast_decoder
    from labkit.fast import kv
    from labkit.model.rollout import encode_prompts, model_decoder

    if not fast_decoder.onednn_packs(torch.float32):
        pytest.skip("needs oneDNN's fp32 packing (an x86 CPU)")
    monkeypatch.setattr(fast_decoder, "ONEDNN_MIN_PARAMS", 0)
    if flash is not None:
        monkeypatch.setattr(kv, "flash_decode", lambda device: flash)
    model, tokenizer = tiny
    prompts = ["Is 9 odd?", "What is 17 - 4 times 2, then plus 30?", "What is 3 * 3?",
               "What is 2 + 3 + 4 + 5 + 6?"]
    G = 3
    settings = dict(group_size=G, max_new_tokens=8, seed=3,
                    decoder=fast.decoder_or(model_decoder, shared_prefix=True))
    whole = rollout(model, tokenizer, prompts, **settings)
    width = whole.prompt_ids.shape[1]
    for first, stop in ((0, 1), (2, 4), (0, 3)):
        share = prompts[first:stop]
        assert encode_prompts(tokenizer, share)[0].shape[1] < width or stop - first == 3
        part = rollout(model, tokenizer, share, shard=(first, len(prompts)),
                       prompt_width=width, **settings)
        rows, t = slice(first * G, stop * G), part.completion_ids.shape[1]
        assert torch.equal(part.prompt_ids, whole.prompt_ids[first:stop])
        assert torch.equal(part.completion_ids, whole.completion_ids[rows, :t])
        assert torch.equal(part.old_logprobs, whole.old_logprobs[rows, :t])


def test_a_shard_needs_a_seed_and_must_hold_its_prompts(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="shard"):
        rollout(model, tokenizer, PROMPTS[:2], group_size=2, shard=(0, 4))
    with pytest.raises(ValueError, match="shard"):
        rollout(model, tokenizer, PROMPTS[:3], group_size=2, seed=0, shard=(2, 4))


class _Processes(SimpleNamespace):
    """The two attributes of an accelerator that labkit.model.parallel reads."""


def test_a_rollout_share_is_the_process_block_padded_to_the_whole_width(tiny):
    _, tokenizer = tiny
    prompts = ["Is 9 odd?", "What is 17 - 4 times 2, then plus 30?", "What is 3 * 3?",
               "What is 2 + 3?"]
    assert parallel.rollout_share(prompts, tokenizer, _Processes(num_processes=1,
                                                                 process_index=0)) \
        == (prompts, {})
    from labkit.model.rollout import encode_prompts

    width = encode_prompts(tokenizer, prompts)[0].shape[1]
    share, keywords = parallel.rollout_share(prompts, tokenizer,
                                             _Processes(num_processes=2, process_index=1))
    assert share == prompts[2:] and keywords == {"shard": (2, 4), "prompt_width": width}
    assert encode_prompts(tokenizer, share)[0].shape[1] < width  # its own would be narrower


def test_prompt_shares_cover_the_batch_in_order():
    shares = [parallel.prompt_share(8, _Processes(num_processes=4, process_index=r))
              for r in range(4)]
    assert shares == [(0, 2), (2, 4), (4, 6), (6, 8)]
    rows = [parallel.own_rows(12, _Processes(num_processes=3, process_index=r)).tolist()
            for r in range(3)]
    assert sum(rows, []) == list(range(12))
    dealt = [[i for i in range(6) if parallel.mine(i, _Processes(num_processes=2,
                                                                  process_index=r))]
             for r in range(2)]
    assert dealt == [[0, 2, 4], [1, 3, 5]]


def test_the_split_must_be_whole_groups_and_micro_batches():
    parallel.check_split(TrainConfig(batch_prompts=5), 1)
    parallel.check_split(TrainConfig(batch_prompts=4, group_size=4), 2)
    with pytest.raises(ValueError, match=r"batch_prompts=5 must be a multiple of .* \(2\)"):
        parallel.check_split(TrainConfig(batch_prompts=5), 2)
    with pytest.raises(ValueError, match=r"grad_accum=3 x 2 processes must divide"):
        parallel.check_split(TrainConfig(batch_prompts=4, group_size=3, minibatches=4,
                                         grad_accum=3), 2)


def test_only_data_parallel_launches_train():
    config = TrainConfig(batch_prompts=4)
    parallel.check_launch(config, _Processes(num_processes=2, process_index=0,
                                             distributed_type="MULTI_GPU"))
    for kind in ("FSDP", "DEEPSPEED"):
        with pytest.raises(ValueError, match=f"launched this run as {kind}.*--multi_gpu"):
            parallel.check_launch(config, _Processes(num_processes=2, process_index=0,
                                                     distributed_type=kind))
    with pytest.raises(ValueError, match="batch_prompts=4 must be a multiple"):
        parallel.check_launch(config, _Processes(num_processes=3, process_index=0,
                                                 distributed_type="MULTI_CPU"))


def test_processes_take_grad_accum_micro_batches_each():
    config = TrainConfig(batch_prompts=4, group_size=4, minibatches=2, grad_accum=2)
    rows = torch.arange(16)
    one = list(micro_batch_plan(config, rows, step_seed=5, processes=1))
    two = list(micro_batch_plan(config, rows, step_seed=5, processes=2))
    assert [len(m) for _, m in one] == [2, 2] and [len(m) for _, m in two] == [4, 4]
    for (_, a), (_, b) in zip(one, two):  # the same minibatches, cut finer
        assert torch.equal(torch.cat(a), torch.cat(b))


def _under_a_process_group(body: str, timeout: int) -> subprocess.CompletedProcess:
    """Run the Python `body` in a fresh interpreter after it joined a 1-process gloo group
    (`atexit` and `dist` imported); it must exit 0."""
    script = ("import atexit, torch.distributed as dist\n"
              "dist.init_process_group('gloo', rank=0, world_size=1)\n" + body)
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_the_command_leaves_the_process_group_on_its_way_out(tmp_path):
    """A process group alive at exit leaves gloo's threads to the interpreter's teardown,
    which now and then aborted a finished 2-process run (exit -6): after `labkit train`
    the exit handlers destroy it, before the interpreter begins to finalize."""
    argv = [*RUN, "--steps", "1", "--run-dir", str(tmp_path / "run")]
    done = _under_a_process_group("from labkit.__main__ import main\n"
                                  f"code = main({['train', *argv]!r})\n"
                                  "atexit._run_exitfuncs()\n"
                                  "print('code', code, 'alive', dist.is_initialized())\n",
                                  timeout=300)
    assert "code 0 alive False" in done.stdout, (done.stdout, done.stderr[-2000:])


def test_a_script_leaves_the_process_group_at_exit():
    """A script that builds an accelerator under a process group (as `train` does) has
    `parallel.leave` registered to run at exit, once, while the interpreter is whole."""
    done = _under_a_process_group(
        "from labkit.model import parallel\n"
        "from labkit.settings.config import TrainConfig\n"
        "from labkit.model.learner import make_accelerator\n"
        "calls = []\n"
        "parallel.leave = lambda real=parallel.leave: (calls.append(1), real())\n"
        "make_accelerator(TrainConfig()); make_accelerator(TrainConfig())\n"
        "print('alive before exit', dist.is_initialized())\n"
        "atexit._run_exitfuncs()\n"
        "print('alive after exit', dist.is_initialized(), 'calls', len(calls))\n",
        timeout=120)
    assert "alive before exit True" in done.stdout, done.stdout
    assert "alive after exit False calls 1" in done.stdout, (done.stdout, done.stderr[-2000:])


def test_two_processes_train_as_one_grpo(tmp_path):
    """accelerate launch, 2 processes (grad_accum 1: 2 micro-batches a minibatch) against
    one process with grad_accum 2 (the same micro-batches) and with grad_accum 1 (one
    micro-batch: equal up to the float rounding of a token-mean over a split)."""
    _two_processes(*RUN, "--run-dir", tmp_path / "two", launcher="accelerate")
    train(TrainConfig(run_dir=str(tmp_path / "one"), **_one_process(grad_accum=2, threads=1)))
    _assert_same_run(tmp_path / "one", tmp_path / "two", atol=1e-6)
    train(TrainConfig(run_dir=str(tmp_path / "whole"), **_one_process(threads=1)))
    # Adam moves a weight whose gradient is below its eps by lr * g / eps: float noise in
    # a tiny gradient shows at 1e-5 there, where a wrong weighting moves weights by ~lr
    _assert_same_run(tmp_path / "whole", tmp_path / "two", atol=1e-5, rtol=1e-4)
    start = _state(tmp_path / "two")["policy"]
    moved = max((start[k] - v).abs().max() for k, v in
                torch.load(tmp_path / "two" / "checkpoints" / "step_000001.pt",
                           weights_only=False)["policy"].items())
    assert moved > 1e-4  # it learned: the comparison is not of two untouched models


def test_two_processes_train_as_one_ppo_and_resume(tmp_path):
    """PPO with a reference (KL in the reward) and two minibatches a pass, over 3 steps;
    the same 2-process run cut after step 3's record (checkpoint at step 2) resumes to the
    same weights and records; only the main process wrote the run directory."""
    ppo = ["--algo", "ppo", "--beta", "0.05", "--minibatches", "2", "--steps", "3"]
    done = _two_processes(*RUN, *ppo, "--run-dir", tmp_path / "two")
    assert done.stdout.count('"algo": "ppo"') == 1  # one summary, the main process's
    one = _one_process(algo="ppo", beta=0.05, minibatches=2, steps=3, grad_accum=2,
                       threads=1)
    train(TrainConfig(run_dir=str(tmp_path / "one"), **one))
    _assert_same_run(tmp_path / "one", tmp_path / "two", atol=1e-6)
    names = sorted(p.name for p in (tmp_path / "two").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "one").iterdir())
    # a run killed after writing step 3's record, before its checkpoint
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "two", cut)
    (cut / "checkpoints" / "step_000003.pt").unlink()
    shutil.rmtree(cut / "final")
    assert [r["step"] for r in read_log(cut / "metrics.jsonl")] == [0, 1, 2, 3]
    _two_processes("--resume", cut)
    _assert_same_run(tmp_path / "two", cut, atol=0)
    assert (cut / "final" / "config.json").is_file()


@pytest.mark.parametrize("algo", ["dpo", "rft"])
def test_two_processes_train_dpo_and_rft_as_one(tmp_path, algo):
    """DPO and RFT on 2 processes: the rollout and the reference pass are shared out and
    gathered, and every process runs the whole update on the gathered batch, so the run
    ends where one process's does (the weights, and every logged figure but timings)."""
    args = [a for a in RUN[:-2]] + ["--algo", algo, "--batch-prompts", "8"]
    _two_processes(*args, "--run-dir", tmp_path / "two", launcher="accelerate")
    given = dict(zip(args[::2], args[1::2]))
    values = {k[2:].replace("-", "_"): v for k, v in given.items()}
    types = {"progress": lambda v: v == "true", "lr": float, "algo": str}
    config = {k: types.get(k, int)(v) for k, v in values.items()}
    train(TrainConfig(run_dir=str(tmp_path / "one"), threads=1, **config))
    _assert_same_run(tmp_path / "one", tmp_path / "two", atol=1e-5, rtol=1e-4)
    start = _state(tmp_path / "two")["policy"]
    moved = max((start[k] - v).abs().max() for k, v in
                torch.load(tmp_path / "two" / "checkpoints" / "step_000001.pt",
                           weights_only=False)["policy"].items())
    assert moved > 1e-4
