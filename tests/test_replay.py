"""The update's forward from the rollout's (labkit.fast.replay): the autograd function against
the products it stands in for, the log-probs and gradients of a replayed pass against a pass
that computes (each family labkit.fast covers), and the rules that keep a stale or foreign
recording out."""

import pytest
import torch
import torch.nn.functional as F
from test_lean import PROMPTS, _random

from labkit import fast
from labkit.fast import replay as replay_module
from labkit.fast import training
from labkit.fast.replay import Recording, replayed
from labkit.model.rollout import model_decoder, rollout
from labkit.model.scoring import model_forward, token_scores


@pytest.fixture
def every_model(monkeypatch):
    """Recordings for models of any size (the default keeps them from models of 4 M
    parameters up)."""
    monkeypatch.setattr(replay_module, "REPLAY_MIN_PARAMS", 0)


@pytest.fixture
def replays(monkeypatch):
    """How many products the passes took from a recording."""
    calls = []

    def counted(*args):
        calls.append(len(args[2]))
        return replayed(*args)
    monkeypatch.setattr(training, "replayed", counted)
    return calls


def _model(kind, tokenizer):
    model = _random(kind, len(tokenizer))
    with torch.no_grad():  # weights of a useful size (HF's init is tiny and flat)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model.train()


@pytest.mark.parametrize("residual", [False, True])
def test_replayed_outputs_carry_the_gradients_of_their_products(residual):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    weights = (torch.randn(6, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True))
    biases = (torch.randn(6, requires_grad=True), None)
    if residual:
        weights, biases = weights[:1], biases[:1]
    skip = torch.randn(3, 5, 6, requires_grad=True)
    outputs = [F.linear(x, w, b) for w, b in zip(weights, biases)]
    if residual:
        outputs[0] = skip + outputs[0]
    upstream = [torch.randn_like(o) for o in outputs]
    leaves = [x, *weights, biases[0], *([skip] if residual else [])]
    want = torch.autograd.grad(sum((o * g).sum() for o, g in zip(outputs, upstream)), leaves)
    got_out = replayed(x, skip if residual else None, weights, biases,
                       tuple(o.detach() for o in outputs))
    for got, o in zip(got_out, outputs):
        assert torch.equal(got, o)
    got = torch.autograd.grad(sum((o * g).sum() for o, g in zip(got_out, upstream)), leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_replayed_products_under_autocast_match_linear_under_autocast():
    torch.manual_seed(1)
    x = torch.randn(4, 16, requires_grad=True)
    w, b = torch.randn(8, 16, requires_grad=True), torch.randn(8, requires_grad=True)
    upstream = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x.to(torch.bfloat16)
        y = F.linear(h, w, b)
        want = torch.autograd.grad((y.float() * upstream).sum(), [x, w, b])
        got_y, = replayed(h, None, (w,), (b,), (y.detach(),))
        got = torch.autograd.grad((got_y.float() * upstream).sum(), [x, w, b])
    assert got_y.dtype == torch.bfloat16
    for g, ref in zip(got, want):
        assert g.dtype == ref.dtype == torch.float32
        torch.testing.assert_close(g, ref, atol=1e-2, rtol=1e-2)


def _scores(model, batch, rows=None, weights=None):
    """Log-probs of `rows` and the gradient of a weighted sum of them, per parameter."""
    model.zero_grad(set_to_none=True)
    logp = token_scores(model, batch, rows, temperature=0.9, share_prompt=True).logp
    mask = batch.completion_mask if rows is None else batch.completion_mask[rows]
    weight = 1.0 if weights is None else weights
    (logp * mask * weight).sum().backward()
    return logp.detach(), {name: p.grad.clone() for name, p in model.named_parameters()
                           if p.grad is not None}


def _assert_close(a, b, mask, rtol=1e-4):
    (logp_a, grads_a), (logp_b, grads_b) = a, b
    torch.testing.assert_close(logp_a[mask.bool()], logp_b[mask.bool()], atol=2e-5, rtol=0)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        scale = grads_a[name].abs().max().clamp(min=1e-6)
        torch.testing.assert_close(grads_a[name] / scale, grads_b[name] / scale, atol=rtol,
                                   rtol=0, msg=name)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "qwen3"])
def test_a_replayed_pass_gives_the_log_probs_and_gradients_of_a_computed_one(
        kind, tiny, every_model, replays):
    model = _model(kind, tiny[1])
    batch = rollout(model, tiny[1], PROMPTS, group_size=3, max_new_tokens=8, seed=3,
                    temperature=0.9, keep_outputs=True)
    recording = batch.recording
    assert isinstance(recording, Recording)
    weights = torch.randn(batch.completion_ids.shape, generator=torch.Generator().manual_seed(0))
    every = torch.randperm(len(batch.completion_ids), generator=torch.Generator().manual_seed(1))
    for rows in (torch.tensor([7, 2, 3, 11, 0]), every):  # some rows, then all, out of order
        batch.recording = None
        computed = _scores(model, batch, rows, weights[rows])
        assert not replays
        batch.recording = recording
        replayed_pass = _scores(model, batch, rows, weights[rows])
        # 2 layers x (q, k, v; o; gate, up; down) + the head, in each of the two passes
        assert len(replays) == 2 * (2 * 4 + 1)
        replays.clear()
        _assert_close(computed, replayed_pass, batch.completion_mask[rows])
    # the replayed log-probs are the decoder's own: those the rollout drew with
    real = batch.completion_mask[every].bool()
    torch.testing.assert_close(replayed_pass[0][real], batch.old_logprobs[every][real],
                               atol=2e-6, rtol=0)
    # the pass over every row took the buffers: the next pass computes, bit for bit
    assert recording.spent and not recording.completion
    again = _scores(model, batch, every, weights[every])
    assert not replays
    assert torch.equal(again[0], computed[0])


def test_a_rollout_that_stops_at_its_first_token_replays_the_prompts_alone(
        tiny, every_model, replays, monkeypatch):
    import labkit.model.rollout

    model, tokenizer = _model("llama-gqa", tiny[1]), tiny[1]
    # every token ends a completion: each row stops at its first, the decode never steps
    monkeypatch.setattr(labkit.model.rollout, "eos_ids", lambda *_: list(range(len(tokenizer))))
    batch = rollout(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=6, seed=0,
                    keep_outputs=True)
    assert batch.completion_ids.shape[1] == 1 and batch.recording is not None
    recording, batch.recording = batch.recording, None
    computed = _scores(model, batch)
    batch.recording = recording
    replayed_pass = _scores(model, batch)
    assert len(replays) == 2 * 4 + 1  # the prompts' pass only
    _assert_close(computed, replayed_pass, batch.completion_mask)


def test_a_rollout_whose_rows_all_stop_early_replays_the_steps_that_ran(
        tiny, every_model, replays, monkeypatch):
    import labkit.model.rollout

    model, tokenizer = _model("qwen2", tiny[1]), tiny[1]
    # three tokens in four end a completion: every row stops within a few tokens
    stops = [i for i in range(len(tokenizer)) if i % 4]
    monkeypatch.setattr(labkit.model.rollout, "eos_ids", lambda *_: stops)
    batch = rollout(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=12, seed=4,
                    keep_outputs=True)
    ran = batch.completion_ids.shape[1] - 1  # decode steps, after the prefill's token
    assert 1 <= ran < 11 and batch.recording.steps == 11
    recording, batch.recording = batch.recording, None
    computed = _scores(model, batch)
    batch.recording = recording
    replayed_pass = _scores(model, batch)
    assert len(replays) == 2 * (2 * 4 + 1)
    _assert_close(computed, replayed_pass, batch.completion_mask)


def test_a_recording_holds_the_bytes_it_announces(tiny, every_model):
    model, tokenizer = _model("qwen2", tiny[1]), tiny[1]
    batch = rollout(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=5, seed=1,
                    keep_outputs=True)
    rec = batch.recording
    held = sum(t.nbytes for kept in rec.prompt + rec.completion for t in kept) + \
        rec.prompt_logits.nbytes + rec.step_logits.nbytes
    config = model.config
    head = config.hidden_size // config.num_attention_heads
    widths = ((config.num_attention_heads + 2 * config.num_key_value_heads) * head,
              config.hidden_size, 2 * config.intermediate_size, config.hidden_size)
    P = batch.prompt_ids.shape[1]
    assert held == Recording.size_bytes(config.num_hidden_layers, len(PROMPTS), P,
                                        len(PROMPTS) * 3, 4, widths, config.vocab_size,
                                        torch.float32)


def test_a_pass_over_every_row_reads_the_buffers_and_never_a_step_that_did_not_run(
        tiny, every_model):
    model, tokenizer = _model("llama-gqa", tiny[1]), tiny[1]
    batch = rollout(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=5, seed=2,
                    keep_outputs=True)
    rec = batch.recording
    ran = batch.completion_ids.shape[1] - 1
    assert rec.ran == ran
    with pytest.raises(ValueError, match=f"{ran + 1} completion positions.*{ran} decode steps"):
        rec.completion_pass(torch.arange(rec.rows), ran + 1)
    # a share of the rows is a copy; the recording keeps its buffers for a later pass
    share = rec.completion_pass(torch.tensor([1, 2]), ran)
    first = rec.completion[0][0]
    assert share.layers[0][0].data_ptr() != first.data_ptr() and not rec.spent
    assert torch.equal(share.layers[0][0], first[[1, 2], :ran])
    whole = rec.completion_pass(torch.arange(rec.rows), ran)
    assert whole.layers[0][0].data_ptr() == first.data_ptr()  # no copy
    assert rec.spent and rec.completion == []


def test_nothing_is_kept_where_it_cannot_serve(tiny, monkeypatch):
    model, tokenizer = tiny
    small = rollout(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=4, seed=0,
                    keep_outputs=True)
    assert small.recording is None  # the embedded model is under REPLAY_MIN_PARAMS
    monkeypatch.setattr(replay_module, "REPLAY_MIN_PARAMS", 0)
    kept = rollout(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=4, seed=0,
                   keep_outputs=True)
    assert kept.recording is not None
    for kwargs in (dict(keep_outputs=False), dict(keep_outputs=True, decoder=model_decoder),
                   dict(keep_outputs=True, shard=(0, 4))):
        batch = rollout(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=4, seed=0,
                        **kwargs)
        assert batch.recording is None, kwargs
    monkeypatch.setattr(replay_module, "REPLAY_MAX_BYTES", 1024)
    over = rollout(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=4, seed=0,
                   keep_outputs=True)
    assert over.recording is None


def test_a_stale_or_foreign_recording_is_not_replayed(tiny, every_model, replays):
    model, tokenizer = _model("llama-gqa", tiny[1]), tiny[1]
    batch = rollout(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=5, seed=2,
                    keep_outputs=True)
    recording = batch.recording
    # passes without gradient, through the model's own forward, or in another dtype compute
    with torch.no_grad():
        token_scores(model, batch, share_prompt=True)
    with torch.inference_mode():
        token_scores(model, batch, share_prompt=True)
    token_scores(model, batch, share_prompt=True, forward=model_forward)
    token_scores(model, batch, share_prompt=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        token_scores(model, batch, share_prompt=True)
    other = _model("llama-gqa", tiny[1])
    token_scores(other, batch, share_prompt=True)
    assert not replays
    # a parameter changed in place (an optimizer step): the pass computes, bit for bit
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(1.01)
    stale = _scores(model, batch)
    batch.recording = None
    computed = _scores(model, batch)
    assert not replays
    assert torch.equal(stale[0], computed[0])
    batch.recording = recording
    assert not recording.serves(model, fast.compute_dtype(model))


def test_the_trainer_replays_the_first_minibatch_and_drops_the_recording(
        tmp_path, every_model, replays):
    from labkit.bench.inputs import TEST_SMALL, build_small_model
    from labkit.settings.config import TrainConfig
    from labkit.trainer import Trainer

    build_small_model(tmp_path / "model", TEST_SMALL)
    base = dict(model=str(tmp_path / "model"), batch_prompts=2, group_size=4,
                max_new_tokens=6, steps=2, seed=0, beta=0.04, minibatches=2, lr=1e-3,
                progress=False, device="cpu", precision="fp32", share_prompt=True,
                reward="noisy(p=0.5)", score_truncated=True)  # rewards that differ: a gradient
    runs = {}
    for flag in (True, False):
        trainer = Trainer(TrainConfig(**base, replay=flag))
        runs[flag] = (trainer, [trainer.step(step) for step in (1, 2)], len(replays))
        replays.clear()
    # one replayed pass per step (the first of the two minibatches), of 2 x 4 + 1 products
    # each for its two passes
    assert runs[True][2] == 2 * 2 * (2 * 4 + 1) and runs[False][2] == 0
    for result in runs[True][1]:
        assert result.batch.recording is None
    for a, b in zip(runs[True][1], runs[False][1]):
        for key in ("loss/policy", "policy/kl", "perf/grad_norm"):
            assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-3, abs=1e-6), key


def test_a_bf16_rollout_is_replayed_by_a_bf16_update(tiny, every_model, replays):
    from labkit.model.rollout import bf16_fast_decoder

    model, tokenizer = _model("qwen2", tiny[1]), tiny[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 products at any model size
        batch = rollout(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=6, seed=4,
                        temperature=0.9, keep_outputs=True, decoder=bf16_fast_decoder)
        assert batch.recording.dtype == torch.bfloat16
        recording, batch.recording = batch.recording, None
        computed = _scores(model, batch)
        batch.recording = recording
        replayed_pass = _scores(model, batch)
    assert len(replays) == 2 * (2 * 4 + 1)
    real = batch.completion_mask.bool()
    # bf16 products: the two passes round apart, the replayed one is the decoder's
    torch.testing.assert_close(replayed_pass[0][real], computed[0][real], atol=0.1, rtol=0)
    torch.testing.assert_close(replayed_pass[0][real], batch.old_logprobs[real], atol=1e-5,
                               rtol=0)
    for name, grad in computed[1].items():
        cosine = F.cosine_similarity(grad.flatten(), replayed_pass[1][name].flatten(), dim=0)
        assert cosine > 0.99, name
