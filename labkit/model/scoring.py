"""Teacher-forced passes over a rollout: log-probs and entropy of the policy, values of a critic.

Shapes: B prompts, G per group, N = B*G rows, P prompt tokens (left-padded), T completion
tokens (right-padded), L = P + T, V vocabulary. Row n of a rollout is prompt n // G followed
by completion n; the output that predicts completion token t sits at position P - 1 + t, so
only the last T positions are ever turned into logits (`logits_to_keep`), never the prompt's.

Two paths give the same numbers. The plain one runs every row's prompt + completion (n, L):
the prompt of a group is run G times, as peers do. The shared one (`share_prompt=True`, and
by default wherever it saves enough work) runs each distinct prompt of the rows once, *with*
gradient, keeps its KV cache, repeats the cache over the rows of its group and runs only the
completions against it. The gradient that reaches the prompt's keys and values from the G
completions is summed by the indexing's backward, so the parameters get the same gradient
as on the plain path. `labkit.fast`'s cache repeats nothing where the rows are whole groups
in order: its attention reads each prompt's keys once for the group (`FastCache`), and the
products sum the gradient over the group.

How a model runs is a `Forward` (`run(ids, mask, positions, cache, keep)`): `model_forward`
is the model's own; `fast_forward` runs a supported model (Llama, Mistral, Qwen2, Qwen3)
through `labkit.fast`'s hand-written forward (its cache is then a `labkit.fast.FastCache`)
and any other through `model_forward`. `Passes` bundles the choice for a learner.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from labkit.formulas.losses import entropy as entropy_of
from labkit.model.rollout import (RolloutBatch, bf16_fast_decoder, cache_keyword, cache_of,
                                  fast_decoder, model_decoder)
from labkit.reproducible import select_cache_rows, select_rows


def sequences(batch: RolloutBatch, rows: Tensor | None = None):
    """`(input_ids, attention_mask, position_ids)`, each (n, L), for the given rows (all if None)."""
    rows = torch.arange(batch.completion_ids.shape[0], device=batch.completion_ids.device) \
        if rows is None else rows
    prompt = batch.group_index[rows]
    ids = torch.cat([batch.prompt_ids[prompt], batch.completion_ids[rows]], dim=1)  # (n, L)
    mask = torch.cat([batch.prompt_mask[prompt], batch.completion_mask[rows]], dim=1)  # (n, L)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def _all_rows(batch: RolloutBatch, rows: Tensor | None) -> Tensor:
    if rows is None:
        return torch.arange(batch.completion_ids.shape[0], device=batch.completion_ids.device)
    return rows


# run(ids, mask, positions, cache, keep) -> (outputs (n, keep, ...), cache): one forward of a
# causal model that returns its last `keep` positions' outputs and its KV cache
Forward = Callable[..., tuple[Tensor, object]]


SHARE_MIN_POSITIONS = 256
"""`share_prompt=None` runs each prompt once per group when that saves at least this many
token positions in a pass ((rows - distinct prompts) x prompt width): running the prompt
apart costs one more forward call, which a short prompt does not pay back."""


def completion_outputs(run: Forward, batch: RolloutBatch, rows: Tensor | None = None, *,
                       share_prompt: bool | None = None) -> Tensor:
    """The outputs (n, T, ...) at the T positions that predict the completion tokens of `rows`:
    the last prompt position and the first T - 1 completion positions."""
    rows = _all_rows(batch, rows)
    T = batch.completion_ids.shape[1]
    unique, inverse = torch.unique(batch.group_index[rows], return_inverse=True)
    if not _shares_prompt(batch, rows, share_prompt):
        ids, mask, positions = sequences(batch, rows)
        out, _ = run(ids, mask, positions, None, T + 1)
        return out[:, :-1]
    prompt_mask = batch.prompt_mask[unique]  # (u, P)
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    last, cache = run(batch.prompt_ids[unique], prompt_mask, positions, None, 1)  # (u, 1, ...)
    first = select_rows(last, inverse)  # (n, 1, ...): predicts completion token 0
    if T == 1:
        return first
    select_cache_rows(cache, inverse)  # (u, ...) -> (n, ...), differentiable
    mask = torch.cat([prompt_mask[inverse], batch.completion_mask[rows, :-1]], dim=1)
    start = prompt_mask.sum(-1)[inverse][:, None]  # (n, 1): the first completion position
    positions = start + torch.arange(T - 1, device=start.device)  # (n, T-1)
    rest, _ = run(batch.completion_ids[rows, :-1], mask, positions, cache, T - 1)
    return torch.cat([first, rest], dim=1)


def _shares_prompt(batch: RolloutBatch, rows: Tensor, share_prompt: bool | None) -> bool:
    """Whether a pass over `rows` runs each prompt once (`share_prompt`, None: when that
    saves at least SHARE_MIN_POSITIONS positions)."""
    if share_prompt is not None:
        return share_prompt
    saved = (len(rows) - len(torch.unique(batch.group_index[rows]))) * batch.prompt_ids.shape[1]
    return saved >= SHARE_MIN_POSITIONS


def model_forward(model) -> Forward:
    """The LM's own (Hugging Face) forward: logits of the last `keep` positions."""
    keyword = cache_keyword(getattr(model, "module", model))

    def run(ids, mask, positions, cache, keep):
        extra = {} if cache is None else {keyword: cache}
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                    use_cache=True, logits_to_keep=keep, **extra)
        return out.logits, cache_of(out)
    return run


def model_hidden(stack) -> Forward:
    """A bare decoder stack's own forward: final-norm hidden states of the last `keep`
    positions (all when None)."""
    keyword = cache_keyword(stack)

    def run(ids, mask, positions, cache, keep):
        extra = {} if cache is None else {keyword: cache}
        out = stack(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **extra)
        hidden = out.last_hidden_state if keep is None else out.last_hidden_state[:, -keep:]
        return hidden, cache_of(out)
    return run


@functools.cache
def _fast():
    # the fast wing is loaded on first use: a run on the plain path never imports it
    from labkit import fast

    return fast


def fast_forward(model) -> Forward:
    """`labkit.fast.lm_forward` where it covers the model, else `model_forward`."""
    return _fast().lm_forward_or(model_forward)(model)


def fast_hidden(stack) -> Forward:
    """`labkit.fast.backbone` where it covers the stack, else `model_hidden`."""
    return _fast().backbone_or(model_hidden)(stack)


@dataclass(frozen=True)
class Passes:
    """How the models run, chosen once when a learner is built."""

    lm: Callable[..., Forward]
    """lm(model): the forward that scores a policy or a reference."""
    hidden: Callable[..., Forward]
    """hidden(stack): the forward of a critic's backbone."""
    decoder: Callable
    """decoder(model, prompt_ids, group_size): what a rollout decodes with."""
    bf16_decoder: Callable
    """The same in bf16 whatever the model's size (`TrainConfig.sampler_precision`), under a
    bf16 autocast that the caller opens."""
    replays: bool = False
    """Whether a rollout may keep its per-layer outputs for the update's first forward to
    replay (`TrainConfig.replay`, labkit.fast.replay)."""

    def moved(self, batch: RolloutBatch) -> None:
        """The policy has moved: drop what the rollout kept for the update to replay."""
        batch.recording = None


MODEL_PASSES = Passes(model_forward, model_hidden, model_decoder, model_decoder)
"""Every model through its own forward."""

FAST_PASSES = Passes(fast_forward, fast_hidden, fast_decoder, bf16_fast_decoder, replays=True)
"""labkit.fast's passes for the models they cover, the models' own for the others."""


@dataclass
class TokenScores:
    """What a teacher-forced pass gives for the completion tokens of its rows."""

    logp: Tensor
    """(n, T) fp32 log-probs of the completion tokens."""
    entropy: Tensor | None = None
    """(n, T) entropy of each position's distribution (with_entropy)."""
    log_dist: Tensor | None = None
    """(n, T, V) fp32 log-softmax over the vocabulary (distribution), for the exact KL."""


def token_scores(model, batch: RolloutBatch, rows: Tensor | None = None, *,
                 temperature: float = 1.0, with_entropy: bool = False,
                 entropy_grad: bool = False, distribution: bool = False,
                 share_prompt: bool | None = None,
                 forward: Callable[..., Forward] = fast_forward) -> TokenScores:
    """Log-probs (n, T) of the completion tokens under `model`, their entropy (n, T) and the
    whole log-distribution (n, T, V) (`TokenScores`; the last two when asked).

    Logits are divided by `temperature`, as when the rollout sampled, so a policy equal to
    the sampling one gives ratio 1. Outputs are fp32 whatever the model's dtype. The
    entropy is detached unless `entropy_grad` (an entropy bonus needs its gradient); the
    log-distribution keeps its gradient. `share_prompt` runs each prompt once for its group
    (module docstring); `forward(model)` gives the pass to run (`fast_forward` or
    `model_forward`).
    """
    rows = _all_rows(batch, rows)
    recording = _recording_for(model, batch, rows, share_prompt, forward)
    if recording is None:
        logits = completion_outputs(forward(model), batch, rows, share_prompt=share_prompt)
    else:
        logits = _replayed_outputs(model, recording, batch, rows)
    logits = logits.float() / temperature  # (n, T, V)
    norm = logits.logsumexp(-1, keepdim=True)  # (n, T, 1)
    targets = batch.completion_ids[rows]
    logp = (logits.gather(-1, targets[..., None]) - norm).squeeze(-1)  # (n, T)
    ent = None
    if with_entropy:
        ent = entropy_of(logits if entropy_grad else logits.detach())
    return TokenScores(logp, ent, logits - norm if distribution else None)


def _recording_for(model, batch: RolloutBatch, rows: Tensor, share_prompt: bool | None,
                   forward: Callable[..., Forward]):
    """The rollout's kept outputs (`labkit.fast.replay.Recording`) where this pass may take
    them instead of computing its products: a pass with gradient through labkit.fast's
    forward, the prompt run once per group, and the recording still the model's (same
    weights, same dtype of products). None otherwise."""
    recording = getattr(batch, "recording", None)
    if recording is None or forward is not fast_forward or not torch.is_grad_enabled() or \
            torch.is_inference_mode_enabled() or not _shares_prompt(batch, rows, share_prompt):
        return None
    if batch.completion_ids.shape[1] - 1 > recording.steps or \
            not recording.serves(model, _fast().compute_dtype(model)):
        return None
    return recording


def _replayed_outputs(model, recording, batch: RolloutBatch, rows: Tensor) -> Tensor:
    """`completion_outputs` of the shared-prompt pass, its products' outputs taken from the
    recording. The rows run in ascending order, so that all rows of the rollout read its
    buffers without a copy; the logits come back in the order of `rows` (each row's
    numbers do not depend on the rows beside it)."""
    order = rows.argsort()
    ascending = rows[order]
    width = batch.completion_ids.shape[1] - 1

    def run(ids, mask, positions, cache, keep):
        if cache is None:  # the prompts' pass: its rows are the distinct prompts
            kept = recording.prompt_pass(torch.unique(batch.group_index[ascending]))
        else:
            kept = recording.completion_pass(ascending, width)
        return _fast().lm_forward(model, ids, mask, positions, cache, keep, replay=kept)

    logits = completion_outputs(run, batch, ascending, share_prompt=True)
    return select_rows(logits, order.argsort())


def token_logprobs(model, batch: RolloutBatch, rows: Tensor | None = None, *,
                   temperature: float = 1.0, with_entropy: bool = False,
                   entropy_grad: bool = False, share_prompt: bool | None = None,
                   forward: Callable[..., Forward] = fast_forward
                   ) -> tuple[Tensor, Tensor | None]:
    """`token_scores`'s log-probs (n, T) and entropy (n, T) (None unless `with_entropy`)."""
    scores = token_scores(model, batch, rows, temperature=temperature,
                          with_entropy=with_entropy, entropy_grad=entropy_grad,
                          share_prompt=share_prompt, forward=forward)
    return scores.logp, scores.entropy


class ValueModel(nn.Module):
    """PPO's critic: a copy of the policy's backbone and a linear head, one value per token.

    Initialised from the policy (same backbone weights) with a zero head, so every value
    starts at 0. It is a separate network with its own optimizer: the policy never shares
    its weights or its gradients. `hidden(backbone)` gives the backbone's pass (`fast_hidden`
    or `model_hidden`).
    """

    def __init__(self, policy, hidden: Callable[..., Forward] = fast_hidden):
        super().__init__()
        self.hidden = hidden
        self.backbone = copy.deepcopy(policy.base_model)
        self.head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.head.to(next(self.backbone.parameters()).device)

    def forward(self, input_ids, attention_mask, position_ids, cache=None,
                keep: int | None = None) -> tuple[Tensor, object]:
        """Values (n, keep) of the last `keep` positions (all when None), and the KV cache."""
        hidden, cache = self.hidden(self.backbone)(input_ids, attention_mask, position_ids,
                                                   cache, keep)
        return self.head(hidden).squeeze(-1).float(), cache  # (n, keep)


def token_values(critic: ValueModel, batch: RolloutBatch, rows: Tensor | None = None, *,
                 share_prompt: bool | None = None) -> Tensor:
    """Values (n, T): V at the state before each completion token (position P - 1 + t)."""
    return completion_outputs(critic, batch, rows, share_prompt=share_prompt)
