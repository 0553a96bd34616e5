"""labkit.formulas.mismatch against plain loops and against verl's rollout correction
(`verl.trainer.ppo.rollout_corr_helper`): TIS per token and per sequence, IcePop's band,
sequence rejection by the geometric-mean ratio."""

from __future__ import annotations

import math

import pytest
import torch
from peers import peer

from labkit.formulas import mismatch as MM

verl = peer("verl.trainer.ppo.rollout_corr_helper")


def _inputs(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    n, t_len = 12, 6
    lengths = torch.randint(1, t_len + 1, (n,), generator=gen)
    mask = (torch.arange(t_len)[None] < lengths[:, None]).to(dtype)
    log_ratio = (torch.randn(n, t_len, generator=gen, dtype=dtype) * 0.6) * mask
    return log_ratio, mask


def test_weights_match_loops():
    lr, mask = _inputs()
    rows = [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    token = MM.is_weights(lr, mask, cap=1.5)
    seq = MM.is_weights(lr, mask, level="sequence", cap=1.5)
    band = MM.is_weights(lr, mask, cap=1.5, low=0.7)
    for i, ts in enumerate(rows):
        s = math.exp(sum(lr[i, t].item() for t in ts))
        for t in range(mask.shape[1]):
            w = math.exp(lr[i, t].item())
            real = t in ts
            assert token[i, t].item() == pytest.approx(min(w, 1.5) if real else 0.0, abs=1e-12)
            assert seq[i, t].item() == pytest.approx(min(s, 1.5) if real else 0.0, abs=1e-12)
            assert band[i, t].item() == pytest.approx(w if real and 0.7 <= w <= 1.5 else 0.0,
                                                      abs=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "0.5_2.0"])
def test_weights_match_verl(level, threshold):
    """TIS (one bound) and IcePop ("low_high"), per token and per sequence, == verl's
    compute_rollout_correction_weights without batch normalisation (float64, 1e-12)."""
    lr, mask = _inputs(1)
    want, _ = verl.compute_rollout_correction_weights(lr, mask, rollout_is=level,
                                                      rollout_is_threshold=threshold)
    low = 0.5 if isinstance(threshold, str) else None
    got = MM.is_weights(lr, mask, level=level, cap=2.0, low=low)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("low, high", [(0.8, 1.25), (0.5, 1.1)])
def test_sequence_rejection_matches_verl_seq_mean_k1(low, high):
    """keep_sequences(low, high) on pi_learner / pi_sampler == verl's seq_mean_k1 rejection
    with the bounds 1/high, 1/low (its k1 is log pi_sampler - log pi_learner)."""
    lr, mask = _inputs(2)
    verl_mask, _ = verl.compute_rollout_rejection_mask(lr, mask, rollout_rs="seq_mean_k1",
                                                       rollout_rs_threshold=f"{1 / high}_{1 / low}")
    keep = MM.keep_sequences(lr, mask, low, high)
    assert 0 < keep.sum() < len(keep)  # the band keeps some rows and rejects others
    assert torch.equal((verl_mask * mask).sum(1) > 0, keep & (mask.sum(1) > 0))


def test_stats_and_errors():
    lr, mask = _inputs(3)
    sampler = -torch.rand(lr.shape, dtype=lr.dtype)
    stats = MM.mismatch_stats(sampler + lr, sampler, mask)
    m = mask.bool()
    assert stats["mismatch/ratio_mean"] == pytest.approx(lr[m].exp().mean().item())
    assert stats["mismatch/ratio_max"] == pytest.approx(lr[m].exp().max().item())
    per_row = (lr * mask).sum(1) / mask.sum(1)
    assert stats["mismatch/log_ppl_diff"] == pytest.approx(per_row.mean().item())
    with pytest.raises(ValueError, match="0 < low <= cap"):
        MM.is_weights(lr, mask, cap=1.0, low=2.0)
    with pytest.raises(ValueError, match="0 < low <= high"):
        MM.keep_sequences(lr, mask, 1.2, 1.1)


def _step(**fields):
    from labkit.settings.config import TrainConfig
    from labkit.trainer import Trainer

    config = TrainConfig(steps=2, batch_prompts=8, group_size=4, max_new_tokens=16, eval_n=4,
                         eval_samples=0, cgc_prompts=0, progress=False, warmup_steps=0,
                         **fields)
    return config, Trainer(config).step(1)


def test_a_sampler_at_another_temperature_is_a_mismatch_the_step_measures():
    """Sampling at 1.5 while learning at 1.0: the learner's log-probs differ from the
    sampler's, the step logs how much, and without the option nothing is measured."""
    _, plain = _step()
    assert not any(k.startswith("mismatch/") for k in plain.metrics)
    _, hot = _step(sampler_temperature=1.5)
    assert hot.metrics["mismatch/log_ppl_diff"] < 0  # the hot sampler found its tokens less likely
    assert hot.metrics["mismatch/ratio_max"] > 1.2


def test_a_bf16_sampler_is_a_mismatch_the_step_measures():
    """Sampling with bf16 products while the fp32 learner rescores: the same tokens get
    slightly different log-probs (bf16 keeps 8 bits of mantissa), far less apart than a
    sampler at another temperature."""
    _, cold = _step(sampler_precision="bf16")
    _, hot = _step(sampler_temperature=1.5)
    gap = abs(cold.metrics["mismatch/log_ppl_diff"])
    assert 0 < gap < abs(hot.metrics["mismatch/log_ppl_diff"])
    assert 1 < cold.metrics["mismatch/ratio_max"] < hot.metrics["mismatch/ratio_max"]


def test_the_bf16_decoder_computes_in_bf16_even_for_a_small_model(tiny):
    """The embedded model is small enough that the rollout keeps it in fp32 under autocast;
    the bf16 sampler's decoder does not, and its log-probs of the same greedy tokens move by
    bf16 rounding, not more."""
    from labkit.fast import decoder
    from labkit.model.rollout import bf16_fast_decoder, rollout

    model, tokenizer = tiny
    prompts = ["12+34=", "7+8=", "40+2=", "55+5="]
    dtypes = []
    real_init = decoder.Decoder.__init__

    def spy(self, model, dtype=torch.float32, **kwargs):
        dtypes.append(dtype)
        real_init(self, model, dtype, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoder.Decoder, "__init__", spy)
        exact = rollout(model, tokenizer, prompts, group_size=2, greedy=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rounded = rollout(model, tokenizer, prompts, group_size=2, greedy=True,
                              decoder=bf16_fast_decoder)
    assert dtypes == [torch.float32, torch.bfloat16]
    same = (exact.completion_ids == rounded.completion_ids).all(-1)
    assert same.sum() >= 4  # most greedy rows agree token for token
    diff = (exact.old_logprobs - rounded.old_logprobs)[same].abs()
    assert 1e-5 < diff.max() < 0.25


@pytest.mark.parametrize("fields", [
    dict(mismatch_is="token", mismatch_cap=1.5),
    dict(mismatch_is="sequence", mismatch_cap=2.0),
    dict(mismatch_is="token", mismatch_cap=2.0, mismatch_low=0.5),
    dict(reject_low=0.9, reject_high=1.1, algo="ppo"),
], ids=str)
def test_corrections_weigh_and_reject_in_a_training_step(fields):
    config, result = _step(sampler_temperature=1.5, **fields)
    assert math.isfinite(result.metrics["loss/total"])
    if config.mismatch_is != "off":
        assert 0 < result.metrics["mismatch/weight_mean"] <= config.mismatch_cap
    if config.reject_low is not None:
        rejected = result.metrics["mismatch/rejected_frac"]
        assert 0 < rejected < 1
        assert result.metrics["rollout/kept_frac"] == pytest.approx(1 - rejected)


def test_mismatch_options_are_checked_with_the_config():
    from labkit.settings.config import TrainConfig

    with pytest.raises(ValueError, match="reject_low and reject_high come together"):
        TrainConfig(reject_low=0.5)
    with pytest.raises(ValueError, match="mismatch_low=3.0 must be <= mismatch_cap=2.0"):
        TrainConfig(mismatch_is="token", mismatch_low=3.0)
    with pytest.raises(ValueError, match="sampler_precision='bf16' makes a mismatch with an fp32"):
        TrainConfig(sampler_precision="bf16", precision="bf16")
