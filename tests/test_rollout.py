import math

import pytest
import torch

from labkit.model.rollout import encode_prompts, filter_logits, rollout

PROMPTS = ["1+2=", "37+85=", "9+90=", "12+34+56="]  # different lengths: left padding matters


def _unpadded_prompt(batch, b):
    return batch.prompt_ids[b][batch.prompt_mask[b].bool()]


@pytest.mark.parametrize("which", ["tiny", "random_qwen"])
def test_greedy_matches_model_generate(which, request):
    model, tokenizer = request.getfixturevalue(which)
    batch = rollout(model, tokenizer, PROMPTS, group_size=2, greedy=True, max_new_tokens=12)
    for n in range(len(PROMPTS) * 2):
        prompt = _unpadded_prompt(batch, n // 2)[None]
        reference = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   max_new_tokens=12, do_sample=False,
                                   eos_token_id=tokenizer.eos_token_id,
                                   pad_token_id=tokenizer.pad_token_id)[0, prompt.shape[1]:]
        ours = batch.completion_ids[n][batch.completion_mask[n].bool()]
        assert ours.tolist() == reference[:len(ours)].tolist()
        if batch.finished[n]:  # generate stops at the same EOS
            assert len(reference) == len(ours) or reference[len(ours)] == tokenizer.pad_token_id
        else:
            assert len(ours) == 12


@pytest.mark.parametrize("which, kwargs", [
    ("tiny", dict(temperature=1.0)),
    ("tiny", dict(temperature=0.7, top_k=5)),
    ("random_qwen", dict(temperature=1.3, top_p=0.9)),
])
def test_old_logprobs_equal_a_teacher_forced_forward(which, kwargs, request):
    model, tokenizer = request.getfixturevalue(which)
    batch = rollout(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=10, seed=1, **kwargs)
    for n in range(batch.completion_ids.shape[0]):
        prompt = _unpadded_prompt(batch, int(batch.group_index[n]))
        real = batch.completion_mask[n].bool()
        completion = batch.completion_ids[n][real]
        with torch.no_grad():
            logits = model(torch.cat([prompt, completion])[None]).logits[0].float()
        logits = logits[len(prompt) - 1:-1] / kwargs["temperature"]
        expected = logits.log_softmax(-1).gather(-1, completion[:, None]).squeeze(-1)
        torch.testing.assert_close(batch.old_logprobs[n][real], expected, rtol=0, atol=1e-5)
        assert torch.all(batch.old_logprobs[n][~real] == 0)


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z=3.09 is the 0.999 normal quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    total = counts.sum()
    expected = probs * total
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return stat, int(keep.sum()) - 1


def test_first_token_frequencies_match_the_softmax(random_qwen):
    model, tokenizer = random_qwen
    # 16000 draws: with 4000 the rejection of the wrong distribution below failed for half
    # of the seeds (the random model's softmax is broad, so halving its logits moves little)
    G, temperature = 16000, 1.0
    batch = rollout(model, tokenizer, ["7+8="], group_size=G, max_new_tokens=1, seed=0,
                    temperature=temperature)
    counts = torch.bincount(batch.completion_ids[:, 0], minlength=len(tokenizer)).double()
    with torch.no_grad():
        logits = model(batch.prompt_ids).logits[0, -1].double()
    stat, df = _chi2(counts, (logits / temperature).softmax(-1))
    assert stat < _chi2_critical(df), (stat, df)
    # the same test rejects a wrong distribution: it has power
    wrong_stat, wrong_df = _chi2(counts, (logits / (2 * temperature)).softmax(-1))
    assert wrong_stat > _chi2_critical(wrong_df), (wrong_stat, wrong_df)


def test_same_seed_same_batch(tiny):
    model, tokenizer = tiny
    a = rollout(model, tokenizer, PROMPTS, group_size=4, seed=7)
    b = rollout(model, tokenizer, PROMPTS, group_size=4, seed=7)
    c = rollout(model, tokenizer, PROMPTS, group_size=4, seed=8)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert torch.equal(a.old_logprobs, b.old_logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_masks_eos_texts_and_groups(random_qwen):
    model, tokenizer = random_qwen
    batch = rollout(model, tokenizer, PROMPTS, group_size=8, max_new_tokens=6, seed=3,
                    temperature=2.0)
    N, T = batch.completion_ids.shape
    assert N == 32 and T <= 6 and batch.num_prompts == 4
    assert batch.group_index.tolist() == [b for b in range(4) for _ in range(8)]
    eos = tokenizer.eos_token_id
    for n in range(N):
        ids, mask = batch.completion_ids[n].tolist(), batch.completion_mask[n].tolist()
        length = sum(mask)
        assert mask == [1] * length + [0] * (T - length)  # a prefix of ones
        if batch.finished[n]:
            assert ids[length - 1] == eos and eos not in ids[:length - 1]
        else:
            assert length == 6 and eos not in ids
        assert all(i == tokenizer.pad_token_id for i in ids[length:])
        assert batch.old_logprobs[n, length:].eq(0).all()  # decoded on, masked out
        assert batch.old_logprobs[n, :length].lt(0).all()
        assert batch.texts[n] == tokenizer.decode(ids[:length], skip_special_tokens=True)
    assert torch.equal(batch.truncated, ~batch.finished)
    assert batch.lengths.tolist() == batch.completion_mask.sum(-1).tolist()


def test_outputs_are_ordinary_tensors_that_autograd_may_keep(tiny):
    """The model decodes in inference mode; a rollout's tensors must still serve an update,
    whose backward keeps some of them (inference tensors cannot be kept)."""
    model, tokenizer = tiny
    batch = rollout(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=4, seed=0)
    for t in (batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
              batch.completion_mask, batch.old_logprobs, batch.finished, batch.group_index):
        assert not t.is_inference()
    weight = torch.ones_like(batch.old_logprobs, requires_grad=True)
    (weight * batch.old_logprobs).sum().backward()  # the product keeps old_logprobs
    assert torch.equal(weight.grad, batch.old_logprobs)


def test_completion_that_is_eos_at_once(tiny):
    model, tokenizer = tiny
    # bias the model so EOS is the argmax at every position
    head = model.lm_head
    original = head.forward
    head.forward = lambda h: original(h) + 100 * torch.nn.functional.one_hot(
        torch.tensor(tokenizer.eos_token_id), head.out_features).to(h.dtype)
    try:
        batch = rollout(model, tokenizer, PROMPTS[:2], group_size=2, greedy=True)
    finally:
        del head.forward  # back to the class's forward (no instance attribute left behind)
    assert batch.completion_ids.shape[1] == 1
    assert batch.completion_mask.tolist() == [[1]] * 4 and batch.finished.all()
    assert batch.texts == [""] * 4


def test_prompt_is_prefilled_once_per_prompt(tiny):
    model, tokenizer = tiny
    shapes = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: shapes.append(tuple(args[0].shape)))
    try:
        batch = rollout(model, tokenizer, PROMPTS, group_size=8, max_new_tokens=5, seed=0)
    finally:
        hook.remove()
    P = batch.prompt_ids.shape[1]
    assert shapes[0] == (4, P)  # B rows, not B*G
    assert all(s == (32, 1) for s in shapes[1:])  # then one token per row per step
    assert len(shapes) == batch.completion_ids.shape[1]


def test_top_k_one_and_tiny_top_p_are_greedy(tiny):
    model, tokenizer = tiny
    greedy = rollout(model, tokenizer, PROMPTS, group_size=2, greedy=True)
    for kwargs in (dict(top_k=1), dict(top_p=1e-6)):
        sampled = rollout(model, tokenizer, PROMPTS, group_size=2, seed=5, **kwargs)
        assert torch.equal(sampled.completion_ids, greedy.completion_ids)


def test_filter_logits_against_a_plain_reference():
    torch.manual_seed(0)
    logits = torch.randn(5, 11)
    for k in (1, 3, 11):
        out = filter_logits(logits, top_k=k)
        for row, ref in zip(out, logits):
            kept = sorted(range(11), key=lambda i: -ref[i].item())[:k]
            assert [i for i in range(11) if out_finite(row, i)] == sorted(kept)
    for p in (0.3, 0.75, 0.999):
        out = filter_logits(logits, top_p=p)
        for row, ref in zip(out, logits):
            probs = ref.softmax(-1).tolist()
            order = sorted(range(11), key=lambda i: -probs[i])
            kept, mass = [], 0.0
            for i in order:  # smallest set whose mass reaches p
                kept.append(i)
                mass += probs[i]
                if mass >= p:
                    break
            assert [i for i in range(11) if out_finite(row, i)] == sorted(kept)


def out_finite(row, i):
    return bool(torch.isfinite(row[i]))


def test_bf16_model_gives_fp32_logprobs(tiny):
    model, tokenizer = tiny
    half = type(model)(model.config)
    half.load_state_dict(model.state_dict())
    half = half.to(torch.bfloat16).eval()
    batch = rollout(half, tokenizer, PROMPTS, group_size=2, seed=0)
    assert batch.old_logprobs.dtype == torch.float32
    assert torch.isfinite(batch.old_logprobs).all()


@pytest.mark.parametrize("kwargs, name", [
    (dict(group_size=0), "group_size"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=0.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k"),
])
def test_bad_sampling_arguments_are_named(tiny, kwargs, name):
    model, tokenizer = tiny
    args = dict(group_size=2) | kwargs
    with pytest.raises(ValueError, match=name):
        rollout(model, tokenizer, PROMPTS, **args)
    with pytest.raises(ValueError, match="prompts"):
        rollout(model, tokenizer, [], group_size=2)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_reserved_cache_gives_the_same_rollout_as_the_growing_cache(tiny, attention,
                                                                      monkeypatch):
    """The decode loop writes into buffers reserved up front (keys by column for eager
    attention); the plain cache concatenates. Same tokens and log-probs either way."""
    import copy

    import labkit.model.rollout as module

    model, tokenizer = tiny
    model = copy.deepcopy(model)
    model.set_attn_implementation(attention)
    reserved = []

    def spy(cache, extra, keys_by_column=False):
        module_reserve(cache, extra, keys_by_column)
        reserved.append((type(cache.layers[0]).__name__, keys_by_column))

    module_reserve = module.reserve_cache
    monkeypatch.setattr(module, "reserve_cache", spy)
    args = dict(group_size=3, max_new_tokens=10, seed=5, decoder=module.model_decoder)
    fast = rollout(model, tokenizer, PROMPTS, **args)
    assert reserved == [("ReservedLayer", attention == "eager")]
    monkeypatch.setattr(module, "reserve_cache", lambda *args, **kwargs: None)
    plain = rollout(model, tokenizer, PROMPTS, **args)
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    # keys by column change the order of the products' sums (AVX-512 kernels differ from
    # AVX2 ones there): the log-probs agree to fp32 rounding of a few sums, not bit for bit
    torch.testing.assert_close(fast.old_logprobs, plain.old_logprobs, atol=1e-5, rtol=1e-5)


def test_encode_prompts_pads_to_a_given_width_and_refuses_a_narrower_one(tiny):
    _, tokenizer = tiny
    prompts = ["Is 9 odd?", "What is 17 - 4 times 2?"]
    ids, mask = encode_prompts(tokenizer, prompts)
    wide_ids, wide_mask = encode_prompts(tokenizer, prompts, width=ids.shape[1] + 3)
    assert wide_ids.shape == (2, ids.shape[1] + 3)
    assert torch.equal(wide_ids[:, 3:], ids) and torch.equal(wide_mask[:, 3:], mask)
    assert not wide_mask[:, :3].any()  # the extra width is padding on the left
    with pytest.raises(ValueError, match="width=.*longest prompt"):
        encode_prompts(tokenizer, prompts, width=ids.shape[1] - 1)


def test_a_rollout_pads_its_prompts_to_prompt_width_and_checks_it(tiny):
    model, tokenizer = tiny
    prompts = ["Is 9 odd?", "What is 17 - 4 times 2?"]
    settings = dict(group_size=2, max_new_tokens=4, seed=0)
    plain = rollout(model, tokenizer, prompts, **settings)
    width = plain.prompt_ids.shape[1] + 2
    wide = rollout(model, tokenizer, prompts, prompt_width=width, **settings)
    assert wide.prompt_ids.shape[1] == width and not wide.prompt_mask[:, :2].any()
    assert wide.texts == plain.texts  # padding is invisible to the completions
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="prompt_width"):
            rollout(model, tokenizer, prompts, prompt_width=bad, **settings)
    with pytest.raises(ValueError, match="width=.*longest prompt"):
        rollout(model, tokenizer, prompts, prompt_width=plain.prompt_ids.shape[1] - 1,
                **settings)
