"""labkit.fast's hand-written forward and decoder against the models' own forward (the plain
path): same logits, log-probs, gradients and tokens, for each architecture family it covers,
and a clear fallback for what it does not cover."""

import copy

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from labkit import fast
from labkit.model.rollout import encode_prompts, model_decoder, rollout, sample_tokens
from labkit.model.scoring import (ValueModel, fast_forward, fast_hidden, model_forward,
                                  model_hidden, token_logprobs, token_values)

PROMPTS = ["1+2=", "37+85=", "9+90=", "12+34+56="]  # different lengths: left padding matters
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _random(kind: str, vocab: int):
    torch.manual_seed(0)
    if kind == "llama-gqa":  # grouped-query attention, untied head, Llama 3 RoPE scaling
        config = LlamaConfig(vocab_size=vocab, num_key_value_heads=2, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                              "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64},
                             **SHAPE)
        return LlamaForCausalLM(config).eval()
    if kind == "qwen2":  # q, k, v biases
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, num_key_value_heads=2,
                                            tie_word_embeddings=True, **SHAPE)).eval()
    if kind == "qwen3":  # per-head q and k norms
        return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, num_key_value_heads=4, head_dim=16,
                                            tie_word_embeddings=True, **SHAPE)).eval()
    raise ValueError(kind)


@pytest.fixture(scope="module", params=["embedded", "llama-gqa", "qwen2", "qwen3"])
def model_and_tokenizer(request, tiny):
    model, tokenizer = tiny
    if request.param == "embedded":
        return copy.deepcopy(model).eval(), tokenizer
    model = _random(request.param, len(tokenizer))
    with torch.no_grad():  # random weights of a useful size (HF's init is tiny and flat)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model, tokenizer


def _hf_logits(model, ids, mask):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


def test_the_families_are_supported(model_and_tokenizer):
    model, _ = model_and_tokenizer
    assert fast.unsupported(model) is None


def test_forward_with_and_without_a_cache_matches_the_model(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    ids, mask = encode_prompts(tokenizer, PROMPTS)  # (4, P), left-padded
    more = torch.randint(3, len(tokenizer), (4, 5))
    full_ids = torch.cat([ids, more], 1)
    full_mask = torch.cat([mask, torch.ones_like(more)], 1)
    want = _hf_logits(model, full_ids, full_mask)
    real = full_mask.bool()
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got, _ = fast.lm_forward(model, full_ids, full_mask, positions)
        torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-5)
        # the prompt first, then the rest against its cache: the last 5 positions agree
        _, cache = fast.lm_forward(model, ids, mask, positions[:, :ids.shape[1]])
        rest, _ = fast.lm_forward(model, more, full_mask, positions[:, ids.shape[1]:], cache,
                                  keep=5)
    torch.testing.assert_close(rest, want[:, -5:], atol=2e-5, rtol=1e-5)


def test_a_prompt_cache_shared_by_groups_is_attended_in_place(model_and_tokenizer):
    """Rows that repeat each prompt G times in order keep the prompts' cache as it is (one row
    per prompt, `groups` = G) and attend to it in two blocks: the logits, the cache the pass
    returns and the gradients reaching the prompt pass are those of the cache repeated per
    row; a later selection of the grouped cache's rows repeats them as asked."""
    model, tokenizer = model_and_tokenizer
    G, u = 3, len(PROMPTS)
    ids, mask = encode_prompts(tokenizer, PROMPTS)  # (u, P), left-padded
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    index = torch.arange(u).repeat_interleave(G)
    more = torch.randint(3, len(tokenizer), (u * G, 5), generator=torch.Generator().manual_seed(1))
    full_mask = torch.cat([mask[index], torch.ones_like(more)], 1)
    more_positions = mask.sum(-1)[index][:, None] + torch.arange(5)
    weights = torch.randn(u * G, 5, len(tokenizer), generator=torch.Generator().manual_seed(2))
    outs, caches, grads = {}, {}, {}
    for grouped in (True, False):
        model.zero_grad(set_to_none=True)
        _, cache = fast.lm_forward(model, ids, mask, positions)
        if grouped:
            cache.batch_select_indices(index)
            assert cache.groups == G and cache.layers[0][0].shape[0] == u  # nothing copied
        else:  # the cache repeated per row, then attended in one block
            cache.layers = [(k[index], v[index]) for k, v in cache.layers]
        logits, after = fast.lm_forward(model, more, full_mask, more_positions, cache, keep=5)
        (logits * weights).sum().backward()
        outs[grouped], caches[grouped] = logits.detach(), after.layers
        grads[grouped] = {n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None}
    torch.testing.assert_close(outs[True], outs[False], atol=2e-5, rtol=1e-5)
    for (k1, v1), (k2, v2) in zip(caches[True], caches[False]):
        assert k1.shape == k2.shape == (u * G, k2.shape[1], ids.shape[1] + 5, k2.shape[3])
        torch.testing.assert_close(k1, k2, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v2, atol=2e-5, rtol=1e-5)
    assert grads[True].keys() == grads[False].keys()
    for name, want in grads[False].items():
        scale = want.abs().max().clamp(min=1e-12)
        assert (grads[True][name] - want).abs().max() / scale < 1e-4, name
    with torch.no_grad():  # some rows of a grouped cache: the repeated cache's same rows
        _, cache = fast.lm_forward(model, ids, mask, positions)
        plain = [(k[index], v[index]) for k, v in cache.layers]
        cache.batch_select_indices(index)
        rows = torch.tensor([7, 0, 11, 4])
        cache.batch_select_indices(rows)
        assert cache.groups == 1
        for (k, v), (pk, pv) in zip(cache.layers, plain):
            assert torch.equal(k, pk[rows]) and torch.equal(v, pv[rows])


def _batch(model, tokenizer, **kwargs):
    args = dict(group_size=3, max_new_tokens=8, seed=3) | kwargs
    return rollout(model, tokenizer, PROMPTS, **args)


@pytest.mark.parametrize("share", [True, False])
def test_log_prob_gradients_match_the_model_forward(model_and_tokenizer, share):
    model, tokenizer = model_and_tokenizer
    batch = _batch(model, tokenizer)
    weights = torch.randn(batch.completion_ids.shape, generator=torch.Generator().manual_seed(0))
    grads, values = {}, {}
    for use_fast, forward in ((True, fast_forward), (False, model_forward)):
        model.zero_grad()
        logp, _ = token_logprobs(model, batch, temperature=0.9, share_prompt=share,
                                 forward=forward)
        (logp * weights * batch.completion_mask).sum().backward()
        values[use_fast] = logp.detach()
        grads[use_fast] = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(values[True][mask], values[False][mask], atol=2e-5, rtol=1e-5)
    for name, want in grads[False].items():
        scale = want.abs().max().clamp(min=1e-12)
        assert (grads[True][name] - want).abs().max() / scale < 1e-4, name


def test_critic_values_and_gradients_match_the_backbone_forward(tiny):
    model, tokenizer = tiny
    batch = _batch(model, tokenizer)
    critic = ValueModel(model)
    with torch.no_grad():
        critic.head.weight.normal_()
    out = {}
    for use_fast, hidden in ((True, fast_hidden), (False, model_hidden)):
        critic.hidden = hidden
        critic.zero_grad()
        values = token_values(critic, batch, share_prompt=True)
        (values * batch.completion_mask).sum().backward()
        out[use_fast] = (values.detach(), {n: p.grad.clone() for n, p in critic.named_parameters()})
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(out[True][0][mask], out[False][0][mask], atol=2e-5, rtol=1e-5)
    for name, want in out[False][1].items():
        scale = want.abs().max().clamp(min=1e-12)
        assert (out[True][1][name] - want).abs().max() / scale < 1e-4, name


def test_bf16_autocast_log_probs_stay_close_to_the_model_under_autocast(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    batch = _batch(model, tokenizer)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = token_logprobs(model, batch, forward=fast_forward)
        theirs, _ = token_logprobs(model, batch, forward=model_forward)
    with torch.no_grad():
        exact, _ = token_logprobs(model, batch, forward=model_forward)
    mask = batch.completion_mask.bool()
    assert ours.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: both sit as far from the fp32 values as each other
    ours_err = (ours - exact)[mask].abs().mean()
    theirs_err = (theirs - exact)[mask].abs().mean()
    assert ours_err < 0.05 and ours_err < 3 * theirs_err + 1e-3


@pytest.mark.parametrize("attention", ["by_column", "by_row", "flash"])
@pytest.mark.parametrize("form", ["onednn", "in_out", "out_in"])
@pytest.mark.parametrize("shared_prefix", [False, True])
def test_decoder_logits_match_the_model_at_every_step(model_and_tokenizer, shared_prefix,
                                                      form, attention, monkeypatch):
    """Every weight form, KV strategy, key layout and decode attention (`weight_form`,
    `keys_by_row` and `flash_decode` pick them by the CPU), in torch operations (the decode
    kernels' path: tests/test_kernels.py)."""
    from labkit.fast import decoder as fast_decoder
    from labkit.fast import kv

    if form == "onednn" and not fast_decoder.onednn_packs(torch.float32):
        pytest.skip("this CPU's oneDNN does not pack fp32 weights")
    monkeypatch.setattr(fast_decoder, "weight_form", lambda dtype, device, params: form)
    monkeypatch.setattr(kv, "keys_by_row", lambda: attention == "by_row")
    monkeypatch.setattr(kv, "flash_decode", lambda device: attention == "flash")
    model, tokenizer = model_and_tokenizer
    decoder = fast.Decoder(model, torch.float32, shared_prefix=shared_prefix, fused=False)
    assert_decoder_matches_model(decoder, model, tokenizer)


def assert_decoder_matches_model(decoder, model, tokenizer, G=3, T=6):
    """The decoder's logits against the model's forward after the prompts and at each of
    T - 1 decode steps, the steps' tokens random."""
    ids, mask = encode_prompts(tokenizer, PROMPTS)
    logits = decoder.prefill(ids, mask, G, T)
    seq, seq_mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    generator = torch.Generator().manual_seed(0)
    for step in range(T):
        want = _hf_logits(model, seq, seq_mask)[:, -1].float()
        torch.testing.assert_close(logits, want, atol=5e-5, rtol=1e-5)
        token = torch.randint(3, len(tokenizer), (seq.shape[0],), generator=generator)
        seq = torch.cat([seq, token[:, None]], 1)
        seq_mask = torch.cat([seq_mask, torch.ones_like(token[:, None])], 1)
        if step < T - 1:
            logits = decoder.step(token)


def test_keys_by_row_and_flash_decode_by_cpu_kernels(monkeypatch):
    from labkit.fast import kv

    for capability, mkl, by_row in (("AVX512", None, True), ("AVX512", "AVX512_E1", True),
                                    ("AVX512", "AVX2", False), ("AVX2", None, False),
                                    ("DEFAULT", None, False)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        if mkl is None:
            monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
        else:
            monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", mkl)
        assert kv.keys_by_row() is by_row, (capability, mkl)
        assert kv.flash_decode("cpu") is not by_row, (capability, mkl)
        assert kv.flash_decode("cuda") is False  # a kernel for CPUs


def test_weight_form_by_dtype_device_and_cpu(monkeypatch):
    from labkit.fast import decoder as fast_decoder

    form, large = fast_decoder.weight_form, fast_decoder.ONEDNN_MIN_PARAMS
    packs = {torch.float32: True, torch.bfloat16: False}
    monkeypatch.setattr(fast_decoder, "onednn_packs", lambda dtype: packs.get(dtype, False))
    assert form(torch.float32, "cpu", large) == "onednn"
    assert form(torch.float32, "cpu", large - 1) == "in_out"  # a model that fits the caches
    assert form(torch.bfloat16, "cpu", large) == "out_in"
    assert form(torch.float32, "cuda", large) == "in_out"  # oneDNN's packing is for CPUs
    assert form(torch.bfloat16, "cuda", large) == "out_in"
    packs[torch.float32] = False
    assert form(torch.float32, torch.device("cpu"), large) == "in_out"


@pytest.mark.parametrize("held, dtype", [(torch.float32, torch.float32),
                                         (torch.float32, torch.bfloat16),
                                         (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("form", ["in_out", "out_in"])
def test_packed_weights_are_each_matrix_scaled_then_stacked(held, dtype, form):
    from labkit.fast.decoder import _pack

    torch.manual_seed(0)
    linears = [torch.nn.Linear(24, out, bias=True).to(held) for out in (16, 8, 8)]
    norm = (torch.rand(24) + 0.5).to(held)
    scale = 0.125 + 1e-3  # not a power of two: every product rounds
    packed = _pack(linears, dtype, form, norm, q_scale=scale)
    with torch.no_grad():  # the plain form: each matrix scaled in turn, cast, then stacked
        rows = [linears[0].weight * scale * norm] + [m.weight * norm for m in linears[1:]]
        want = torch.cat([w.to(dtype) for w in rows])
        bias = torch.cat([linears[0].bias * scale] + [m.bias for m in linears[1:]]).to(dtype)
    assert packed.matrix.dtype == dtype and packed.form == form
    assert torch.equal(packed.matrix.t(), want)
    assert packed.matrix.is_contiguous() == (form == "in_out")
    assert torch.equal(packed.bias, bias)


def test_onednn_packs_only_on_x86_with_onednn(monkeypatch):
    import platform

    from labkit.fast import decoder as fast_decoder

    probe = fast_decoder.onednn_packs.__wrapped__
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    assert not probe(torch.float32)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not probe(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_probe_answers_the_same_under_autocast(dtype):
    """The rollout asks inside its autocast region: the probe's own products must not be
    cast there."""
    from labkit.fast import decoder as fast_decoder

    probe = fast_decoder.onednn_packs.__wrapped__
    plain = probe(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert probe(dtype) == plain


def test_onednn_rows_do_not_depend_on_the_rows_beside_them():
    """The packed product of rows alone equals, bit for bit, the same rows' product in a
    larger batch (a process sampling its share of the rows must get what one process
    gets), at a decode step's few rows and a prefill's many, for weights of the small
    bench model's shapes."""
    from labkit.fast import decoder as fast_decoder

    if not fast_decoder.onednn_packs(torch.float32):
        pytest.skip("this CPU's oneDNN does not pack fp32 weights")
    generator = torch.Generator().manual_seed(0)
    for out, inp in ((1536, 512), (512, 1408), (2816, 512)):
        linear = torch.nn.Linear(inp, out, bias=False)
        torch.nn.init.normal_(linear.weight, std=0.02, generator=generator)
        packed = fast_decoder._pack([linear], torch.float32, "onednn")
        x = torch.randn(300, inp, generator=generator)
        whole = fast_decoder._matmul(x, packed, torch.float32)
        torch.testing.assert_close(whole, x @ linear.weight.t(), atol=1e-4, rtol=1e-4)
        for rows in (2, 3, 8, 16, 32, 128, 256):
            part = fast_decoder._matmul(x[:rows].clone(), packed, torch.float32)
            assert torch.equal(part, whole[:rows]), (out, inp, rows)


@pytest.mark.parametrize("form", ["out_in", "onednn"])
def test_bf16_decoder_stays_close_to_the_model(model_and_tokenizer, form, monkeypatch):
    """At the prefill and at a decode step, in both of bf16's weight forms."""
    from labkit.fast import decoder as fast_decoder

    if form == "onednn" and not fast_decoder.onednn_packs(torch.bfloat16):
        pytest.skip("this CPU's oneDNN does not pack bf16 weights")
    monkeypatch.setattr(fast_decoder, "weight_form", lambda dtype, device, params: form)
    model, tokenizer = model_and_tokenizer
    ids, mask = encode_prompts(tokenizer, PROMPTS)
    decoder = fast.Decoder(model, torch.bfloat16)
    got = decoder.prefill(ids, mask, 2, 4).log_softmax(-1)
    seq, seq_mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
    for step in range(2):
        want = _hf_logits(model, seq, seq_mask)[:, -1].float().log_softmax(-1)
        top = want.argmax(-1, keepdim=True)  # the likeliest token's log-prob, to bf16 accuracy
        torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), atol=0.05,
                                   rtol=0.05)
        seq = torch.cat([seq, top], 1)
        seq_mask = torch.cat([seq_mask, torch.ones_like(top)], 1)
        got = decoder.step(top[:, 0]).log_softmax(-1)


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_fast_rollout_gives_the_tokens_of_the_model_forward(model_and_tokenizer, shared_prefix):
    """Same seed, same draws: the fast decoder and the model's forward sample the same
    tokens (their logits agree to float rounding) and report the same log-probs."""
    model, tokenizer = model_and_tokenizer
    for kwargs in (dict(greedy=True), dict(temperature=0.9, top_p=0.95)):
        decoder = fast.decoder_or(model_decoder, shared_prefix=shared_prefix)
        ours = _batch(model, tokenizer, decoder=decoder, **kwargs)
        theirs = _batch(model, tokenizer, decoder=model_decoder, **kwargs)
        assert torch.equal(ours.completion_ids, theirs.completion_ids)
        assert torch.equal(ours.finished, theirs.finished)
        torch.testing.assert_close(ours.old_logprobs, theirs.old_logprobs, atol=2e-5, rtol=1e-5)


def test_reference_weights_are_restacked_when_they_change(tiny):
    """The frozen reference keeps its stacked weights between calls; a change in place (a
    checkpoint loaded into it) must show in the next forward."""
    model, tokenizer = tiny
    reference = copy.deepcopy(model).requires_grad_(False)
    batch = _batch(model, tokenizer)
    with torch.no_grad():
        before, _ = token_logprobs(reference, batch)
        with torch.no_grad():
            reference.model.layers[0].mlp.up_proj.weight.mul_(1.5)
        after, _ = token_logprobs(reference, batch)
        want, _ = token_logprobs(reference, batch, forward=model_forward)
    mask = batch.completion_mask.bool()
    assert (after - before)[mask].abs().max() > 1e-3
    torch.testing.assert_close(after[mask], want[mask], atol=2e-5, rtol=1e-5)


def _gpt2(tokenizer):
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2,
                        n_positions=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


def test_unsupported_models_are_named_and_fall_back(tiny):
    model, tokenizer = tiny
    assert "model_type 'gpt2'" in fast.unsupported(_gpt2(tokenizer))
    with pytest.raises(ValueError, match="fast decoder cannot run this model: model_type"):
        fast.Decoder(_gpt2(tokenizer))
    batch = _batch(_gpt2(tokenizer), tokenizer)  # the model's own forward takes over
    assert batch.completion_ids.shape[0] == 12

    probe = copy.deepcopy(model)
    hook = probe.model.register_forward_hook(lambda *args: None)
    assert "forward hooks" in fast.unsupported(probe)
    hook.remove()
    assert fast.unsupported(probe) is None
    probe.model.layers[0].mlp._hf_hook = object()  # accelerate's offloading sets one
    assert "forward hooks" in fast.unsupported(probe)
    del probe.model.layers[0].mlp._hf_hook
    assert fast.unsupported(probe) is None
    probe.lm_head.forward = lambda h: h
    assert "forward was replaced" in fast.unsupported(probe)

    checkpointed = copy.deepcopy(model)
    getattr(checkpointed, "activation_checkpointing_enable",
            getattr(checkpointed, "gradient_checkpointing_enable", None))()
    assert "checkpointing" in fast.unsupported(checkpointed)

    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), use_sliding_window=True,
                                           sliding_window=16, max_window_layers=0, **SHAPE))
    assert "sliding" in fast.unsupported(sliding)


def test_accelerates_mixed_precision_wrapper_keeps_the_fast_path(tiny):
    from labkit.model.learner import make_accelerator
    from labkit.settings.config import TrainConfig

    model, _ = tiny
    accelerator = make_accelerator(TrainConfig(precision="bf16", device="cpu"))
    wrapped = accelerator.prepare(copy.deepcopy(model))
    assert "forward" in wrapped.__dict__  # the autocast wrapper
    assert fast.unsupported(wrapped) is None


def test_sample_draws_tokens_with_their_softmax_probabilities():
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf")], [3.0, 0.0, 0.0, 0.0]])
    probs = logits.softmax(-1)
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_tokens(logits, generator) for _ in range(20000)])  # (20000, 2)
    for row in range(2):
        freq = torch.bincount(draws[:, row], minlength=4).float() / len(draws)
        # 4 standard errors of a frequency of 20000 draws is at most 0.0142
        assert (freq - probs[row]).abs().max() < 0.0142, (row, freq, probs[row])
    assert not (draws[:, 0] == 3).any()  # a -inf logit is never drawn


# --- the fast paths' automatic choices ------------------------------------------------------

def _prompt_passes(model, run):
    seen = []
    hook = model.model.register_forward_hook(lambda m, args, kwargs, out: seen.append(
        tuple(kwargs["input_ids"].shape)), with_kwargs=True)  # a hook: the model's forward
    try:
        with torch.no_grad():
            run()
    finally:
        hook.remove()
    return seen


def test_auto_sharing_runs_long_prompts_once_and_short_ones_with_their_rows(tiny, monkeypatch):
    import labkit.model.scoring as scoring

    model, tokenizer = tiny
    batch = _batch(model, tokenizer, group_size=4)  # 4 prompts x 4 rows, P of a few tokens
    P, T = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    saved = (16 - 4) * P
    assert saved < scoring.SHARE_MIN_POSITIONS
    short = _prompt_passes(model, lambda: token_logprobs(model, batch))
    assert short == [(16, P + T)]  # one pass: the prompt's extra call would not pay
    monkeypatch.setattr(scoring, "SHARE_MIN_POSITIONS", saved)
    long = _prompt_passes(model, lambda: token_logprobs(model, batch))
    assert long == [(4, P), (16, T - 1)]


def test_small_models_decode_in_fp32_under_cpu_autocast(tiny, monkeypatch):
    import labkit.fast.decoder as module

    model, _ = tiny
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert module.rollout_dtype(model) == torch.float32  # 0.4 M parameters
        monkeypatch.setattr(module, "CPU_LOW_PRECISION_MIN_PARAMS", 1000)
        assert module.rollout_dtype(model) == torch.bfloat16
    assert module.rollout_dtype(model) == torch.float32  # no autocast: the model's


def test_the_optimizer_is_fused_and_steps_like_plain_adamw():
    from labkit.model.learner import adamw

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    twin, start = copy.deepcopy(net), copy.deepcopy(net)
    fused = adamw(net.parameters(), 1e-2, 0.1)
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    assert fused.param_groups[0]["fused"]
    for _ in range(10):
        x = torch.randn(8, 16)
        for module, opt in ((net, fused), (twin, plain)):
            module(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(net.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    moved = max((a - b).abs().max().item() for a, b in zip(net.parameters(), start.parameters()))
    assert moved > 1e-2  # the comparison is between two optimizers that did step


def _learner(**fields):
    """(config, learner, tokenizer) as the trainer builds them, for these TrainConfig fields."""
    from labkit.model.learner import build_learner, make_accelerator
    from labkit.settings.config import TrainConfig

    config = TrainConfig(**fields)
    return (config, *build_learner(config, make_accelerator(config)))


def test_a_reference_held_in_bf16_matches_its_model_forward(tiny):
    """Under bf16 autocast the reference is held in bf16 (learner.build_learner); the fast
    pass then uses its weights as they are and its norm weights as fp32."""
    _, learner, tokenizer = _learner(precision="bf16", device="cpu", beta=0.04)
    reference = learner.reference
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in reference.parameters())
    batch = _batch(tiny[0], tokenizer)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = token_logprobs(reference, batch, forward=fast_forward)
        theirs, _ = token_logprobs(reference, batch, forward=model_forward)
    mask = batch.completion_mask.bool()
    assert (ours - theirs)[mask].abs().mean() < 0.02
    assert "_fast_weights" not in reference.__dict__  # nothing cast, nothing kept


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_frozen_passes_give_ordinary_tensors_the_loss_may_keep(tiny, algo):
    """The reference (and PPO's old values) run in inference mode; what they return must be
    usable by a loss whose backward keeps it."""
    from labkit import algos, stages

    config, learner, tokenizer = _learner(algo=algo, device="cpu", beta=0.04)
    batch = _batch(tiny[0], tokenizer)
    ref = stages.reference_logprobs(config, learner, batch)
    with torch.no_grad():
        expected, _ = token_logprobs(learner.reference, batch)
    assert not ref.is_inference() and torch.allclose(ref, expected, atol=1e-6)
    logp, _ = token_logprobs(learner.policy, batch)
    (logp * ref).sum().backward()  # the product keeps ref for its backward
    assert any(p.grad is not None for p in learner.policy.parameters())
    if algo == "ppo":
        out = algos.learn(config, learner, batch, torch.ones(batch.completion_ids.shape[0]),
                             step_seed=0)
        assert not out.values.is_inference() and torch.isfinite(out.values).all()


def test_the_kv_strategy_is_chosen_when_the_decoder_is_built(tiny, monkeypatch):
    import labkit.fast.decoder as module

    model, tokenizer = tiny
    assert isinstance(fast.Decoder(model, shared_prefix=True).kv, fast.SharedPrefix)
    assert isinstance(fast.Decoder(model).kv, fast.FullCache)
    ids, _ = encode_prompts(tokenizer, PROMPTS)  # a few tokens: below the threshold
    start = fast.decoder_or(model_decoder)
    assert isinstance(start(model, ids, 3).kv, fast.FullCache)
    monkeypatch.setattr(module, "SHARED_PREFIX_MIN_TOKENS", ids.shape[1])
    assert isinstance(start(model, ids, 3).kv, fast.SharedPrefix)
    assert isinstance(start(model, ids, 1).kv, fast.FullCache)  # one row per group: no sharing
    assert not isinstance(start(_gpt2(tokenizer), ids, 3), fast.Decoder)  # the model's own


@pytest.mark.parametrize("use_fast", [True, False])
def test_the_config_chooses_the_passes_once_for_the_learner(use_fast):
    from labkit.model.scoring import FAST_PASSES, MODEL_PASSES

    _, learner, _ = _learner(algo="ppo", device="cpu", fast=use_fast)
    want = FAST_PASSES if use_fast else MODEL_PASSES
    assert learner.passes is want
    assert learner.accelerator.unwrap_model(learner.critic).hidden is want.hidden


@pytest.mark.parametrize("D", [32, 64, 128])
def test_rope_with_scaled_tables_is_the_rotation_scaled(D):
    """q rotated by `scaled_tables` is HF's rotation (q cos + rotate_half(q) sin) times
    1/sqrt(D): bit for bit where the scale is a power of two (D = 64), to rounding else."""
    from labkit.fast.layer import rope, scaled_tables

    gen = torch.Generator().manual_seed(D)
    q = torch.randn(3, 5, 4, D, generator=gen)
    angle = torch.rand(3, 5, 1, D // 2, generator=gen) * 6.0
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    rotate_half = torch.cat([-q[..., D // 2:], q[..., :D // 2]], dim=-1)
    want = (q * cos + rotate_half * sin) * D ** -0.5
    signed = torch.cat([-sin[..., :D // 2], sin[..., D // 2:]], dim=-1)  # as rope_tables
    got = rope(q, *scaled_tables(cos, signed, D))
    if D == 64:
        assert torch.equal(got, rope(q, cos, signed) * D ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
