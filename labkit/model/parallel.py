"""Training on several processes: data parallel over a step's prompts.

Launched by `accelerate launch` (or `torch.distributed.run`), each process holds the whole
policy and runs the same step:

1. it samples the completions of its share of the B prompts (a contiguous block of B / P
   prompts, so a group never splits), drawing the very random numbers a one-process
   rollout would draw for those rows (`rollout(..., shard=...)`), its prompts padded to the
   whole batch's width (`rollout_share`);
2. the shares are gathered, so every process holds the whole batch, and scores every
   reward and advantage of it alike: batch statistics (whitening, the std of the batch,
   dynamic sampling) are those of the whole batch;
3. the no-grad passes (the reference, the critic's values, the learner's rescoring) run on
   each process's own rows and are gathered;
4. each minibatch is cut into `grad_accum` x P micro-batches, dealt round robin to the
   processes; each weighs its micro-batches' losses by their share of the minibatch as one
   process would, and the gradients are summed over processes before every optimizer step.

A P-process step therefore computes what one process computes with grad_accum x P
micro-batches, up to float rounding: the same samples, rewards, advantages, update and
logged metrics. Only the main process writes the run directory.

The models are not wrapped in DistributedDataParallel: gradients are summed explicitly,
once per optimizer step, and every process then takes the same optimizer step, so the
weights stay equal without being sent.
"""

from __future__ import annotations

import atexit
import time
from dataclasses import replace

import torch
from torch import Tensor

from labkit.model.rollout import RolloutBatch, encode_prompts


def size(accelerator) -> int:
    """Processes in the run (1 without a distributed launch)."""
    return accelerator.num_processes


def rank(accelerator) -> int:
    return accelerator.process_index


DATA_PARALLEL = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU",
                 "MULTI_SDAA", "MULTI_MUSA", "MULTI_HPU")
"""accelerate's distributed types where each process holds the whole model."""


def check_launch(config, accelerator) -> None:
    """A launch labkit can train on, before any model loads: data parallel (not FSDP or
    DeepSpeed, which shard the model that every process samples from whole), and a batch
    that splits into whole groups per process and whole micro-batches per minibatch."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind not in DATA_PARALLEL:
        raise ValueError(f"accelerate launched this run as {kind}: labkit trains data "
                         "parallel (each process holds the whole model and samples from it); "
                         "launch with --multi_gpu (docs/parallel.md), and for a model that "
                         "does not fit, train LoRA adapters (--lora-rank)")
    check_split(config, size(accelerator))


def check_split(config, processes: int) -> None:
    """The batch must split into whole groups per process and whole micro-batches per
    minibatch."""
    if processes == 1:
        return
    if config.batch_prompts % processes:
        raise ValueError(f"batch_prompts={config.batch_prompts} must be a multiple of the "
                         f"number of processes ({processes}): each process samples the groups "
                         "of an equal share of the prompts")
    per_minibatch = config.rows // config.minibatches
    if per_minibatch % (config.grad_accum * processes):
        raise ValueError(f"grad_accum={config.grad_accum} x {processes} processes must divide "
                         f"the {per_minibatch} rows of a minibatch: each process takes "
                         "grad_accum of its micro-batches")


def prompt_share(prompts: int, accelerator) -> tuple[int, int]:
    """(first, stop): the block of prompt indices this process samples."""
    per = prompts // size(accelerator)
    first = rank(accelerator) * per
    return first, first + per


def rollout_share(prompts: list[str], tokenizer, accelerator) -> tuple[list[str], dict]:
    """This process's prompts and the `rollout` keywords that make its rows the whole
    rollout's: on one process every prompt and {}; on several its share (`prompt_share`),
    `shard`, and `prompt_width`, the whole batch's width, so that a row sits at the
    positions it has in one process (kernels sum along a row from its left)."""
    if size(accelerator) == 1:
        return list(prompts), {}
    first, stop = prompt_share(len(prompts), accelerator)
    width = encode_prompts(tokenizer, prompts)[0].shape[1]
    return list(prompts[first:stop]), {"shard": (first, len(prompts)), "prompt_width": width}


def own_rows(rows: int, accelerator, device=None) -> Tensor:
    """The row indices of this process's contiguous share of `rows` rows."""
    per = rows // size(accelerator)
    first = rank(accelerator) * per
    return torch.arange(first, first + per, device=device)


def pass_rows(batch: RolloutBatch, accelerator) -> Tensor | None:
    """The rows a no-grad pass over `batch` scores on this process: its own share on
    several processes (the parts are then gathered, `gather_rows`), None (all) on one."""
    if size(accelerator) == 1:
        return None
    return own_rows(batch.completion_ids.shape[0], accelerator, batch.completion_ids.device)


def _all_gather(obj) -> list:
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast(obj, accelerator):
    """The main process's `obj`, on every process."""
    if size(accelerator) == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather_rows(part: Tensor, accelerator) -> Tensor:
    """Every process's `part` (equal shapes), concatenated along dim 0 in process order."""
    if size(accelerator) == 1:
        return part
    parts = [torch.empty_like(part) for _ in range(size(accelerator))]
    torch.distributed.all_gather(parts, part.contiguous())
    return torch.cat(parts)


def gather_batch(batch: RolloutBatch, accelerator, pad: int) -> RolloutBatch:
    """The whole step's rollout from every process's share: prompts left-padded to the
    widest, completions right-padded to the longest (`pad`, mask 0, log-prob 0), rows in
    prompt order, as one process would have sampled them."""
    if size(accelerator) == 1:
        return batch
    device = batch.completion_ids.device
    shares = _all_gather(_to(batch, "cpu"))
    width = max(s.prompt_ids.shape[1] for s in shares)
    length = max(s.completion_ids.shape[1] for s in shares)

    def left(x: Tensor, value) -> Tensor:
        return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

    def right(x: Tensor, value) -> Tensor:
        return torch.nn.functional.pad(x, (0, length - x.shape[1]), value=value)

    prompts = sum(s.num_prompts for s in shares)
    whole = RolloutBatch(
        prompt_ids=torch.cat([left(s.prompt_ids, pad) for s in shares]),
        prompt_mask=torch.cat([left(s.prompt_mask, 0) for s in shares]),
        completion_ids=torch.cat([right(s.completion_ids, pad) for s in shares]),
        completion_mask=torch.cat([right(s.completion_mask, 0) for s in shares]),
        old_logprobs=torch.cat([right(s.old_logprobs, 0.0) for s in shares]),
        texts=[text for s in shares for text in s.texts],
        group_index=torch.arange(prompts).repeat_interleave(batch.group_size),
        finished=torch.cat([s.finished for s in shares]), group_size=batch.group_size)
    return _to(whole, device)


def _to(batch: RolloutBatch, device) -> RolloutBatch:
    moved = {name: getattr(batch, name).to(device) for name in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
              "old_logprobs", "group_index", "finished")}
    return replace(batch, **moved)


def mine(index: int, accelerator) -> bool:
    """Whether micro-batch `index` of a minibatch is this process's (dealt round robin)."""
    return index % size(accelerator) == rank(accelerator)


def sum_grads(models, accelerator) -> None:
    """Sum every trainable weight's gradient over the processes, in place (a weight a
    process did not reach counts as zero there)."""
    if size(accelerator) == 1:
        return
    for model in models:
        weights = [p for p in model.parameters() if p.requires_grad]
        for p in weights:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in weights])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p in weights:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def sum_stats(stats: dict, accelerator) -> dict:
    """Each key's sum over the processes (a process without the key adds nothing)."""
    if size(accelerator) == 1:
        return stats
    total: dict = {}
    for part in _all_gather(dict(stats)):
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total


def raise_together(error: Exception | None, accelerator) -> None:
    """Raise on every process the first error any process met (a non-finite loss on one
    process's micro-batch stops them all, not just the one that saw it)."""
    if size(accelerator) == 1:
        if error is not None:
            raise error
        return
    errors = [e for e in _all_gather(error) if e is not None]
    if errors:
        raise errors[0]


def leave() -> None:
    """Destroy the default process group, where a distributed launch made one, and give
    gloo's worker threads a moment with the GIL free before the interpreter ends.

    A gloo worker drops a finished collective's tensors just after the caller's wait
    returns; a tensor made in Python (`broadcast_object_list` makes them) then needs the
    GIL to be freed. If the main thread has begun to finalize by then, that worker thread
    exits mid-unwind and the process aborts ('terminate called without an active
    exception', exit -6) after its run has finished and written everything: 1 launch in
    30 or so of tests/test_parallel.py's 2-process runs. Destroying the group does not
    stop its threads while another object still holds it (a model loaded by transformers
    under a distributed launch does), so the pause is what lets such a worker finish.
    `leave_at_exit` has it run at the exit of any process that builds an accelerator
    while a process group exists (`labkit train` on several processes, or a script that
    calls `labkit.trainer.train` there)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        time.sleep(LEAVE_PAUSE_S)  # the GIL is free while the main thread sleeps


_LEAVE_REGISTERED = False


def leave_at_exit() -> None:
    """Have `leave` run when the interpreter exits (once per process, from the first call
    on), where a process group exists: atexit handlers run before the interpreter begins
    to finalize, while gloo's workers can still take the GIL."""
    global _LEAVE_REGISTERED
    if _LEAVE_REGISTERED or not (torch.distributed.is_available()
                                 and torch.distributed.is_initialized()):
        return
    atexit.register(leave)
    _LEAVE_REGISTERED = True


LEAVE_PAUSE_S = 0.2
"""How long `leave` keeps the GIL free for gloo's workers (they need microseconds)."""


# --- what a step calls on several processes (one process never reaches these) ---------------

def sample_shares(sample, prompts: list[str], tokenizer, accelerator) -> RolloutBatch:
    """The step's whole rollout: `sample(prompts, **keywords)` of this process's share
    (`rollout_share`), gathered from every process (`gather_batch`)."""
    share, keywords = rollout_share(prompts, tokenizer, accelerator)
    return gather_batch(sample(share, **keywords), accelerator, tokenizer.pad_token_id)


def score_shares(score, batch: RolloutBatch, accelerator) -> Tensor:
    """A no-grad pass over the whole batch: `score(rows)` of this process's rows
    (`pass_rows`), gathered from every process."""
    return gather_rows(score(pass_rows(batch, accelerator)), accelerator)


def backward_shares(backward, micro_batches: list[Tensor], models, accelerator) -> dict:
    """A minibatch's backward: `backward(micro, sums)` of this process's micro-batches
    (`mine`), a non-finite loss on any process raised on all (`raise_together`), the stats
    and the gradients summed over the processes."""
    sums, error = {}, None
    try:
        for index, micro in enumerate(micro_batches):
            if mine(index, accelerator):
                backward(micro, sums)
    except FloatingPointError as e:
        error = e
    raise_together(error, accelerator)
    sums = sum_stats(sums, accelerator)
    sum_grads([m for m in models if m is not None], accelerator)
    return sums
