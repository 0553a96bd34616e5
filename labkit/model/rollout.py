"""Group rollout: G sampled completions for each of B prompts, with their log-probs.

Shapes: B prompts, G completions per prompt (the group), N = B*G rows, P prompt tokens,
T completion tokens, V vocabulary.

The G completions of a group share one prompt, so the prompt is run through the model once
(one prefill of B rows, not N) and its KV cache is repeated G times before decoding. Peers
that call `model.generate` with `num_return_sequences=G` prefill every prompt G times.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from labkit.problems.tasks import format_prompt


@dataclass
class RolloutBatch:
    """The completions of one rollout and what the update needs from the sampling policy.

    Row n of every (N, ...) tensor is completion n % G of prompt n // G (`group_index`).
    """

    prompt_ids: torch.Tensor
    """(B, P) prompt token ids, left-padded."""
    prompt_mask: torch.Tensor
    """(B, P) 1 on real prompt tokens."""
    completion_ids: torch.Tensor
    """(N, T) sampled token ids, right-padded with the pad id."""
    completion_mask: torch.Tensor
    """(N, T) 1 on real completion tokens, up to and including EOS."""
    old_logprobs: torch.Tensor
    """(N, T) fp32 log-prob of each sampled token under the sampling policy (0 on padding)."""
    texts: list[str]
    """N decoded completions, special tokens removed."""
    group_index: torch.Tensor
    """(N,) index of the prompt each row belongs to."""
    finished: torch.Tensor
    """(N,) True where the completion ended with EOS, False where it was truncated."""
    group_size: int
    """G."""
    recording: object = field(default=None, repr=False, compare=False)
    """The decoder's per-layer outputs (`labkit.fast.replay.Recording`) when the rollout kept
    them (`keep_outputs`): the update's first pass takes them instead of computing its
    products. None otherwise; the trainer drops it once the update has run."""

    @property
    def num_prompts(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def truncated(self) -> torch.Tensor:
        """(N,) True where the completion hit max_new_tokens without EOS."""
        return ~self.finished

    @property
    def lengths(self) -> torch.Tensor:
        """(N,) number of real completion tokens of each row."""
        return self.completion_mask.sum(-1)


def eos_ids(model, tokenizer) -> list[int]:
    """Token ids that end a completion: the tokenizer's EOS and the model's generation EOS."""
    ids = set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, generation_eos):
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else value)
    if not ids:
        raise ValueError("the tokenizer and the model define no EOS token: set "
                         "tokenizer.eos_token so completions can end")
    return sorted(ids)


def encode_prompts(tokenizer, prompts: Sequence[str], device=None, width: int | None = None):
    """Left-padded `(ids, mask)`, each (B, P), after the chat template when there is one; P
    is the longest prompt's length, or `width` when given (at least the longest's)."""
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be strings")
    templated = bool(getattr(tokenizer, "chat_template", None))
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        enc = tokenizer([format_prompt(p, tokenizer) for p in prompts], return_tensors="pt",
                        padding=True, add_special_tokens=not templated)
    finally:
        tokenizer.padding_side = side
    ids, mask = enc["input_ids"], enc["attention_mask"]
    if width is not None:
        if width < ids.shape[1]:
            raise ValueError(f"width={width} is shorter than the longest prompt "
                             f"({ids.shape[1]} tokens): give at least that")
        extra = (width - ids.shape[1], 0)  # padding=True above needs a pad token
        ids = torch.nn.functional.pad(ids, extra, value=tokenizer.pad_token_id)
        mask = torch.nn.functional.pad(mask, extra, value=0)
    return ids.to(device), mask.to(device)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits (N, V) with tokens outside the top-k / nucleus set to -inf (the best one kept)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = probs.cumsum(-1) - probs >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def cache_keyword(model) -> str:
    """The forward keyword for the KV cache: `cache` in recent transformers, else the older
    `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(output):
    """The KV cache a forward pass returned, under either name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _reserved_layer_class():
    """A KV-cache layer of transformers' DynamicCache whose keys and values live in buffers
    reserved for the whole rollout: a decode step writes its position in place, where the
    plain layer concatenates (copies) the entire cache at every token, which on a CPU costs
    more than the model's matmuls once the cache holds a long prompt. None where transformers
    has no such layer class (an older version): the plain cache is used then."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None, None

    class ReservedLayer(DynamicLayer):
        def reserve(self, capacity: int, keys_by_column: bool) -> None:
            """Room for `capacity` positions. `keys_by_column` stores the keys as (D, position)
            so that eager attention's `query @ key^T` reads them in place (a plain matmul with
            a leading dimension) instead of copying the strided cache at every step."""
            N, H, L, D = self.keys.shape
            self._by_column = keys_by_column
            shape = (N, H, D, capacity) if keys_by_column else (N, H, capacity, D)
            self._key_buffer = self.keys.new_empty(shape)
            self._value_buffer = self.values.new_empty(N, H, capacity, self.values.shape[-1])
            self._write(self.keys, self.values, 0, L)

        def _write(self, keys, values, start: int, end: int) -> None:
            if self._by_column:
                self._key_buffer[..., start:end] = keys.transpose(2, 3)
                self.keys = self._key_buffer[..., :end].transpose(2, 3)
            else:
                self._key_buffer[:, :, start:end] = keys
                self.keys = self._key_buffer[:, :, :end]
            self._value_buffer[:, :, start:end] = values
            self.values = self._value_buffer[:, :, :end]

        def update(self, key_states, value_states, *args, **kwargs):
            start, end = self.keys.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
            if end > self._value_buffer.shape[-2]:  # past the reservation: grow as usual
                return super().update(key_states, value_states, *args, **kwargs)
            self._write(key_states, value_states, start, end)
            return self.keys, self.values

    return DynamicLayer, ReservedLayer


_PLAIN_LAYER, _RESERVED_LAYER = _reserved_layer_class()


def reserve_cache(cache, extra_tokens: int, keys_by_column: bool = False) -> None:
    """Give each plain layer of a filled DynamicCache room for `extra_tokens` more positions
    (other layer types, e.g. sliding windows, are left as they are)."""
    if _RESERVED_LAYER is None or not hasattr(cache, "layers"):
        return
    for layer in cache.layers:
        if type(layer) is _PLAIN_LAYER and layer.is_initialized and layer.keys.dim() == 4:
            layer.__class__ = _RESERVED_LAYER
            layer.reserve(layer.keys.shape[-2] + extra_tokens, keys_by_column)


def _check(group_size, max_new_tokens, temperature, top_k, top_p, greedy):
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not greedy and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature} "
                         "(use greedy=True for argmax decoding)")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 turns it off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def model_decoder(model, prompt_ids: Tensor, group_size: int) -> ModelDecoder:
    """Decode with the model's own forward (the plain path, for any architecture)."""
    return ModelDecoder(model)


@functools.cache
def _fast_decoders():
    # the fast wing is loaded on first use: a run on the plain path never imports it
    from labkit import fast

    return (fast.decoder_or(model_decoder), fast.decoder_or(model_decoder, dtype=torch.bfloat16))


def fast_decoder(model, prompt_ids: Tensor, group_size: int):
    """Decode with `labkit.fast.Decoder` where it covers the model (Llama, Mistral, Qwen2,
    Qwen3), else with `model_decoder`: the same tokens up to float rounding. Under autocast it
    computes in the autocast dtype (in fp32 for a small model on a CPU), and it attends over
    each prompt's keys once per group when the prompt is long enough for that to pay."""
    return _fast_decoders()[0](model, prompt_ids, group_size)


def bf16_fast_decoder(model, prompt_ids: Tensor, group_size: int):
    """`fast_decoder` with its matrix products in bf16 for any model (a bf16 sampler, for
    `TrainConfig.sampler_precision`); models it does not cover decode with their own forward,
    in bf16 under the autocast the caller opens."""
    return _fast_decoders()[1](model, prompt_ids, group_size)


@torch.no_grad()
def rollout(model, tokenizer, prompts: Sequence[str], *, group_size: int,
            max_new_tokens: int = 16, temperature: float = 1.0, top_k: int = 0,
            top_p: float = 1.0, greedy: bool = False, seed: int | None = None,
            decoder: Callable = fast_decoder, shard: tuple[int, int] | None = None,
            prompt_width: int | None = None, keep_outputs: bool = False) -> RolloutBatch:
    """Sample `group_size` completions for each prompt.

    Each prompt is prefilled once; its KV cache is repeated G times and the N rows decode
    together until every row has produced EOS or `max_new_tokens` tokens. Sampling draws from
    softmax(logits / temperature) restricted to top-k / top-p; `greedy` takes the argmax.
    `old_logprobs` are the log-probs under softmax(logits / temperature) without the top-k /
    top-p cut, the policy that the update's ratio compares against (as TRL and verl do).
    `seed` makes the draws repeatable; None uses torch's global generator.
    `decoder(model, prompt_ids, group_size)` starts the decoding: `fast_decoder` (default)
    or `model_decoder`, or e.g. `labkit.fast.decoder_or(model_decoder, shared_prefix=True)`.
    `shard` = (first, total): these prompts are prompts first.. of a batch of `total` (one
    process's share, `labkit.model.parallel`); each decode step draws the whole batch's uniforms
    and keeps these rows', so the share's samples are the whole rollout's rows for them.
    `prompt_width` left-pads the prompts to that many tokens (default: the longest's): a
    share padded to the whole batch's width gives each row the shapes and positions it has
    in the whole rollout, so no kernel sees a row otherwise than one process would.
    `keep_outputs` keeps the decoder's per-layer outputs in the batch (`recording`) for the
    update to replay (`labkit.fast.replay`), where the decoder can (labkit.fast's, on a model
    large enough, within a memory budget) and the rollout is the whole batch (no `shard`).
    """
    _check(group_size, max_new_tokens, temperature, top_k, top_p, greedy)
    if shard is not None and (seed is None or not 0 <= shard[0] <= shard[1] - len(prompts)):
        raise ValueError(f"shard={shard} needs a seed and must hold the {len(prompts)} "
                         "prompts: (first, total) with first + len(prompts) <= total")
    if prompt_width is not None and (isinstance(prompt_width, bool)
                                     or not isinstance(prompt_width, int) or prompt_width < 1):
        raise ValueError(f"prompt_width={prompt_width!r} must be a positive number of tokens "
                         "(or None: the longest prompt's)")
    rows = None if shard is None else (shard[0] * group_size, shard[1] * group_size)
    device = next(model.parameters()).device
    stop = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device, prompt_width)
    engine = decoder(model, prompt_ids, group_size)
    recording = None
    if keep_outputs and shard is None and hasattr(engine, "record"):
        recording = engine.record(len(prompts), prompt_ids.shape[1], group_size, max_new_tokens)
    stop_ids = torch.tensor(stop, device=device)

    def is_stop(ids: Tensor) -> Tensor:
        return (ids == stop_ids[0]) if len(stop) == 1 else torch.isin(ids, stop_ids)

    def draw(logits: Tensor) -> tuple[Tensor, Tensor]:
        scaled = logits if greedy or temperature == 1.0 else logits / temperature
        token = scaled.argmax(-1) if greedy else \
            sample_tokens(filter_logits(scaled, top_k, top_p), generator, rows)
        return token, scaled.log_softmax(-1).gather(-1, token[:, None])

    try:
        raw, logps = _decode(engine, prompt_ids, prompt_mask, group_size, max_new_tokens, draw,
                             is_stop)
    finally:
        engine.close()
    stops = is_stop(raw)
    # real tokens: up to and including each row's first stop token
    real = (stops.cumsum(-1) - stops.long()) == 0
    completion_ids = raw.masked_fill(~real, pad)
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=real.long(), old_logprobs=logps.masked_fill(~real, 0.0),
        texts=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
        group_index=torch.arange(len(prompts), device=device).repeat_interleave(group_size),
        # a row finished when its last real token is a stop token (else it ran out of budget)
        finished=stops.any(-1), group_size=group_size, recording=recording)


def _decode(engine, prompt_ids: Tensor, prompt_mask: Tensor, G: int, T: int, draw,
            is_stop) -> tuple[Tensor, Tensor]:
    """Raw tokens (N, T') and their fp32 log-probs (N, T'), T' <= T: prefill, then one step
    per token until every row has drawn a stop token or T tokens."""
    steps_logps, steps_tokens = [], []
    # the model runs in inference mode: no autograd bookkeeping on a decode step's
    # ~100 small operations; what leaves this function is made of ordinary tensors
    with torch.inference_mode():
        logits = engine.prefill(prompt_ids, prompt_mask, G, T)  # (N, V)
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    for step in range(T):
        token, logp = draw(logits)
        # a row that has ended keeps decoding (its tokens are masked later): rows are
        # independent, so this changes no other row and saves maskings per step
        steps_tokens.append(token)
        steps_logps.append(logp)
        done |= is_stop(token)
        if step == T - 1 or bool(done.all()):
            break
        with torch.inference_mode():
            logits = engine.step(token)
    return torch.stack(steps_tokens, dim=1), torch.cat(steps_logps, dim=1)  # (N, T')


def sample_tokens(logits: Tensor, generator: torch.Generator | None = None,
           rows: tuple[int, int] | None = None) -> Tensor:
    """One token id per row (N,) drawn from softmax(logits) (N, V): the row's argmax of
    log(U) / p with U ~ Uniform(0, 1) i.i.d., which picks token i with probability p_i.
    (-log U is an Exp(1) time E, so this is the argmax of p / E: the first of independent
    exponential clocks with rates p_i to ring.) One pass, where torch.multinomial also
    validates its input on every call; and on a CPU uniform draws plus a log cost less
    than torch's exponential draws (docs/performance.md). `rows` = (first, total): the
    uniforms are drawn for `total` rows and rows first.. kept (a share of a larger batch)."""
    probs = logits.softmax(-1)
    shape = probs.shape if rows is None else (rows[1], probs.shape[-1])
    uniform = torch.rand(shape, generator=generator, dtype=probs.dtype, device=probs.device)
    if rows is not None:
        uniform = uniform[rows[0]:rows[0] + probs.shape[0]]
    return uniform.log_().div_(probs).argmax(-1)


class ModelDecoder:
    """Prefill and decode through the model's own forward and transformers' KV cache (the
    path for architectures `labkit.fast` does not cover, and the reference it is tested
    against): the prompt's cache repeated over the group, reserved for the whole completion."""

    def __init__(self, model):
        self.model, self.keyword = model, cache_keyword(model)
        self.was_training = model.training
        model.eval()

    def close(self) -> None:
        self.model.train(self.was_training)

    def prefill(self, ids: Tensor, mask: Tensor, G: int, T: int) -> Tensor:
        # one prefill per prompt; positions count real tokens so left padding is invisible
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1)
        self.cache = cache_of(out)
        self.cache.batch_repeat_interleave(G)  # (B, ...) -> (B*G, ...)
        eager = getattr(self.model.config, "_attn_implementation", None) == "eager"
        reserve_cache(self.cache, T, keys_by_column=eager)
        P = mask.shape[1]
        self.full_mask = torch.ones(ids.shape[0] * G, P + T, dtype=mask.dtype, device=ids.device)
        self.full_mask[:, :P] = mask.repeat_interleave(G, dim=0)  # (N, P + T)
        self.next_pos = mask.sum(-1).repeat_interleave(G)  # (N,)
        self.width = P
        return out.logits[:, -1].float().repeat_interleave(G, dim=0)  # (N, V)

    def step(self, token: Tensor) -> Tensor:
        self.width += 1
        out = self.model(input_ids=token[:, None], attention_mask=self.full_mask[:, :self.width],
                         position_ids=self.next_pos[:, None], use_cache=True,
                         **{self.keyword: self.cache})
        self.cache, self.next_pos = cache_of(out), self.next_pos + 1
        return out.logits[:, -1].float()
