"""The update's teacher-forced passes: the prompt-shared path against the plain one and
against a row-by-row reference without padding."""

import pytest
import torch

from labkit.model.rollout import rollout
from labkit.model.scoring import ValueModel, token_logprobs, token_values

PROMPTS = ["1+2=", "37+85=", "9+90=", "12+34+56="]  # different lengths: left padding matters


def _batch(model, tokenizer, max_new_tokens=10, group_size=3):
    return rollout(model, tokenizer, PROMPTS, group_size=group_size,
                   max_new_tokens=max_new_tokens, seed=3)


def _row_by_row(model, batch, temperature):
    """Reference: each row alone, prompt without padding + its real completion tokens."""
    out = torch.zeros(batch.completion_ids.shape)
    for n in range(batch.completion_ids.shape[0]):
        b = int(batch.group_index[n])
        prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()]
        real = batch.completion_mask[n].bool()
        completion = batch.completion_ids[n][real]
        ids = torch.cat([prompt, completion])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float() / temperature
        logp = logits.log_softmax(-1)[len(prompt) - 1:-1]
        out[n, :len(completion)] = logp.gather(-1, completion[:, None]).squeeze(-1)
    return out


ROWS = {
    "all": None,
    "shuffled": torch.tensor([7, 0, 11, 3, 4, 9]),
    "one group": torch.tensor([5, 3, 4]),
    "one row": torch.tensor([10]),
}


@pytest.mark.parametrize("which", ["tiny", "random_qwen"])
@pytest.mark.parametrize("rows", list(ROWS))
def test_shared_and_plain_log_probs_equal_the_row_by_row_reference(which, rows, request):
    model, tokenizer = request.getfixturevalue(which)
    batch = _batch(model, tokenizer)
    index = ROWS[rows]
    want = _row_by_row(model, batch, 0.8)
    want = want if index is None else want[index]
    mask = batch.completion_mask if index is None else batch.completion_mask[index]
    for share in (True, False):
        with torch.no_grad():
            got, _ = token_logprobs(model, batch, index, temperature=0.8, share_prompt=share)
        torch.testing.assert_close(got * mask, want * mask, atol=1e-5, rtol=1e-5)


def test_a_one_token_budget_uses_the_prompt_pass_alone(tiny):
    model, tokenizer = tiny
    batch = _batch(model, tokenizer, max_new_tokens=1)
    assert batch.completion_ids.shape[1] == 1
    with torch.no_grad():
        shared, _ = token_logprobs(model, batch, share_prompt=True)
        plain, _ = token_logprobs(model, batch, share_prompt=False)
    torch.testing.assert_close(shared, plain, atol=1e-6, rtol=1e-6)


def _gradients(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("which", ["tiny", "random_qwen"])
def test_shared_prompt_gradients_equal_the_plain_path(which, request):
    model, tokenizer = request.getfixturevalue(which)
    batch = _batch(model, tokenizer, group_size=4)
    weights = torch.randn(batch.completion_ids.shape, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([0, 5, 6, 7, 12, 2, 15])
    grads = {}
    for share in (True, False):
        logp, ent = token_logprobs(model, batch, rows, with_entropy=True, entropy_grad=True,
                                   share_prompt=share)
        mask = batch.completion_mask[rows]
        loss = ((weights[rows] * logp + 0.1 * ent) * mask).sum() / mask.sum()
        grads[share] = _gradients(model, loss)
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 0
    for name, plain in grads[False].items():
        scale = plain.abs().max().clamp(min=1e-12)
        assert (grads[True][name] - plain).abs().max() / scale < 1e-5, name
    # the embeddings of prompt tokens receive gradient on both paths (through the cache)
    prompt_tokens = batch.prompt_ids[batch.prompt_mask.bool()].unique()
    embed = next(n for n in grads[True] if "embed_tokens" in n)
    assert grads[True][embed][prompt_tokens].abs().sum() > 0


def test_shared_critic_values_and_gradients_equal_the_plain_path(tiny):
    model, tokenizer = tiny
    batch = _batch(model, tokenizer)
    torch.manual_seed(0)
    critic = ValueModel(model)
    torch.nn.init.normal_(critic.head.weight, std=0.1)  # a zero head would hide differences
    rows = torch.tensor([1, 2, 9, 10, 11])
    out = {}
    for share in (True, False):
        values = token_values(critic, batch, rows, share_prompt=share)
        out[share] = values.detach(), _gradients(critic, (values ** 2).sum())
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=1e-5)
    assert out[True][1].keys() == out[False][1].keys()
    for name, plain in out[False][1].items():
        scale = plain.abs().max().clamp(min=1e-12)
        assert (out[True][1][name] - plain).abs().max() / scale < 1e-5, name


def test_shared_path_runs_each_prompt_once(tiny):
    model, tokenizer = tiny
    batch = _batch(model, tokenizer, group_size=4)  # 4 prompts x 4 = 16 rows
    seen = []
    hook = model.model.register_forward_hook(lambda m, args, kwargs, out: seen.append(
        tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        with torch.no_grad():
            token_logprobs(model, batch, share_prompt=True)
            shared = list(seen)
            seen.clear()
            token_logprobs(model, batch, share_prompt=False)
    finally:
        hook.remove()
    P, T = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    assert shared == [(4, P), (16, T - 1)]  # the prompt on B rows, completions on N
    assert seen == [(16, P + T)]  # the plain path runs every prompt G times


def test_bf16_autocast_stays_close_to_fp32(tiny):
    model, tokenizer = tiny
    batch = _batch(model, tokenizer)
    with torch.no_grad():
        fp32, _ = token_logprobs(model, batch, share_prompt=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16, _ = token_logprobs(model, batch, share_prompt=True)
    mask = batch.completion_mask.bool()
    assert bf16.dtype == torch.float32
    assert (bf16 - fp32)[mask].abs().mean() < 0.05
