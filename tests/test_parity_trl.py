"""Parity of labkit's building blocks (labkit.formulas.losses, labkit.formulas.advantages) with TRL's GRPOTrainer.

TRL's own code is driven on the embedded tiny model; nothing of TRL is re-implemented here:

* loss parity: a GRPOTrainer (CPU, fp32) gets a hand-built, prepared batch (left-padded prompts of
  different lengths, right-padded completions of different lengths, one of them a lone EOS, one
  truncated without EOS; fixed advantages of both signs; old log-probs that differ from the current
  ones so that the PPO clip is active on both sides; reference log-probs when beta > 0). Its
  `compute_loss` is compared with `labkit.formulas.losses.policy_loss` (+ beta * the aggregated k3 KL) on
  log-probs computed here with a plain forward pass, for every TRL loss_type, and so are the
  gradients and the clip fractions TRL logs;
* advantage parity: TRL's `_generate_and_score_completions` is run with a reward function that
  returns fixed rewards, for each `scale_rewards`, and the advantages it produces are compared with
  `labkit.formulas.advantages.grpo`.

Mapping TRL -> labkit (TRL 1.x, trl/trainer/grpo_trainer.py, `_compute_loss`):
    loss_type "grpo"    -> agg="seq-mean-token-mean"
    loss_type "bnpo"    -> agg="token-mean" (over the local batch)
    loss_type "dr_grpo" -> agg="seq-mean-token-sum-norm", max_len=max_completion_length
    loss_type "dapo"    -> agg="token-mean" (TRL divides by `num_items_in_batch`, the number of
                           completion tokens of the generation batch; here one batch, no accumulation)
    epsilon / epsilon_high    -> eps_low / eps_high
    delta (two-sided clip)    -> dual_clip (identical whenever delta > 1 + epsilon_high: for A < 0
                                 TRL caps the ratio at delta, labkit caps the loss at -delta*A)
    importance_sampling_level -> level ("token" | "sequence", GSPO)
    beta * k3 KL              -> beta * aggregate(kl(logp, ref_logp, "k3"), mask, agg, max_len=...)
                                 with use_bias_correction_kl=False. TRL's default is
                                 use_bias_correction_kl=True: the per-token k3 is multiplied by the
                                 (differentiable, unclipped) ratio exp(logp - old_logp) before
                                 aggregation; labkit has no such option, so that case is composed
                                 here from labkit's kl and the ratio and checked separately.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from labkit.problems.tasks import DEFAULT_TASK  # noqa: E402
from labkit.settings.embedded import EMBEDDED_PATH

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

TOL = 1e-6
MAX_COMPLETION_LENGTH = 16  # > the batch's completion width, so dr_grpo's constant is not mask.shape[1]

AGG = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
       "dapo": "token-mean"}

# left-padded prompts of 4 different lengths; completions of different lengths, right-padded:
# a lone EOS (length 1) and one truncated without EOS among them
PROMPTS = ["7+8=", "37+85=", "123+456=", "5+61=", "98+7=", "40+40="]
COMPLETIONS = [(r"\boxed{15}", True), (r"\boxed{122}", True), ("", True), (r"\boxed{6", False),
               (r"\boxed{105}", True), (r"\boxed{8}", True)]
ADVANTAGES = [1.2, -0.8, 0.5, -1.5, 0.0, 0.9]


def _labkit(name):
    """labkit.<name>, or a skip while that module does not exist yet (any other import error fails)."""
    try:
        return importlib.import_module(f"labkit.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"labkit.{name}":
            pytest.skip(f"labkit.{name} does not exist yet")
        raise


def _data():
    return datasets.Dataset.from_list([p.to_record() for p in DEFAULT_TASK.sample(4, "train", seed=0)])


def _trainer(tmp_path, reward_funcs=None, **config):
    from labkit.problems.rewards import correctness

    config = {"per_device_train_batch_size": 6, "num_generations": 2,
              "max_completion_length": MAX_COMPLETION_LENGTH, **config}
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), temperature=1.0, report_to="none", use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, save_strategy="no", disable_tqdm=True, seed=0, **config)
    trainer = trl.GRPOTrainer(model=str(EMBEDDED_PATH), reward_funcs=reward_funcs or correctness,
                              args=args, train_dataset=_data())
    trainer.model.eval()  # "eval" mode: no gradient-accumulation normaliser, metrics under "eval"
    return trainer


def _pad(rows, pad_id, side):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, sl] = torch.tensor(r, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


def _completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Log-probs of the completion tokens by a plain forward pass (temperature 1: logits as they are)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    p, c = prompt_ids.shape[1], completion_ids.shape[1]
    logits = logits[:, p - 1:p - 1 + c]  # position t predicts token t + 1
    return torch.log_softmax(logits, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def _batch(trainer, beta):
    """A prepared batch as `_generate_and_score_completions` would hand it to `compute_loss`."""
    tok = trainer.processing_class
    prompt_rows = tok(text=PROMPTS)["input_ids"]  # as TRL's _tokenize_prompts does (with BOS)
    completion_rows = [tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
                       for text, eos in COMPLETIONS]
    assert sorted({len(r) for r in prompt_rows}) == [5, 6, 7, 9]
    assert min(len(r) for r in completion_rows) == 1
    assert len({len(r) for r in completion_rows}) >= 4
    prompt_ids, prompt_mask = _pad(prompt_rows, tok.pad_token_id, "left")
    completion_ids, completion_mask = _pad(completion_rows, tok.pad_token_id, "right")
    with torch.no_grad():
        logp = _completion_logps(trainer.model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    m = completion_mask.float()
    gen = torch.Generator().manual_seed(1234)
    # old policy: log-ratio logp - old = U(-0.6, 0.6) per token plus a per-row shift along the sign of
    # the advantage, so ratios leave [0.72, 1.28] on both sides, per token and per sequence (GSPO)
    shift = torch.sign(torch.tensor(ADVANTAGES)).unsqueeze(1) * 0.2
    log_ratio = torch.rand(logp.shape, generator=gen) * 1.2 - 0.6 + shift
    old = (logp - log_ratio) * m  # TRL's log-probs are 0 on padding; so are these
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.tensor(ADVANTAGES),
        "old_per_token_logps": old,
        # as TRL: gather(loss_mask.sum()).sum(), the completion tokens of the generation batch
        "num_items_in_batch": completion_mask.sum(),
    }
    if beta:
        inputs["ref_per_token_logps"] = (logp + torch.rand(logp.shape, generator=gen) * 0.8 - 0.4) * m
    return inputs


def _grads(model):
    return torch.cat([p.grad.detach().flatten().clone() if p.grad is not None else torch.zeros(p.numel())
                      for p in model.parameters()])


CASES = [
    # (loss_type, beta, extra GRPOConfig)
    ("grpo", 0.0, {}),
    ("grpo", 0.04, {"use_bias_correction_kl": False}),
    ("bnpo", 0.0, {"epsilon_high": 0.28}),
    ("bnpo", 0.04, {"use_bias_correction_kl": False}),
    ("dr_grpo", 0.0, {}),
    ("dr_grpo", 0.04, {"epsilon_high": 0.28, "use_bias_correction_kl": False}),
    ("dapo", 0.0, {"epsilon_high": 0.28}),
    ("dapo", 0.04, {"epsilon_high": 0.28, "use_bias_correction_kl": False}),
    ("grpo", 0.0, {"epsilon_high": 0.28, "delta": 1.5}),  # two-sided clip (INTELLECT-2) = dual clip
    ("dapo", 0.04, {"epsilon": 0.1, "epsilon_high": 0.15, "delta": 1.3, "use_bias_correction_kl": False}),
    # GSPO; sequence ratios here 1.05, 0.84, 2.14, 0.81, 1.14, 1.17: some clip low, some high, some not
    ("grpo", 0.0, {"importance_sampling_level": "sequence", "epsilon": 0.18, "epsilon_high": 0.1}),
    ("grpo", 0.04, {"use_bias_correction_kl": True}),  # TRL's default KL (ratio-weighted)
    ("dapo", 0.04, {"epsilon_high": 0.28, "use_bias_correction_kl": True}),
]


def _case_id(case):
    loss_type, beta, extra = case
    return "-".join([loss_type, f"beta{beta}"] + [f"{k}={v}" for k, v in extra.items()])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_policy_loss_matches_trl_compute_loss(case, tmp_path):
    losses = _labkit("losses")
    loss_type, beta, extra = case
    trainer = _trainer(tmp_path, loss_type=loss_type, beta=beta, **extra)
    model = trainer.model
    inputs = _batch(trainer, beta)
    mask = inputs["completion_mask"]
    level = extra.get("importance_sampling_level", "token")
    eps_low = extra.get("epsilon", 0.2)
    eps_high = extra.get("epsilon_high", eps_low)
    bias_corrected_kl = extra.get("use_bias_correction_kl", True)

    # TRL, its own code path
    model.zero_grad(set_to_none=True)
    trl_loss = trainer.compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = _grads(model)
    metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}

    # labkit, on log-probs from a plain forward pass of the same model
    model.zero_grad(set_to_none=True)
    logp = _completion_logps(model, inputs["prompt_ids"], inputs["prompt_mask"],
                             inputs["completion_ids"], mask)
    agg = AGG[loss_type]
    max_len = MAX_COMPLETION_LENGTH if loss_type == "dr_grpo" else None
    loss, stats = losses.policy_loss(
        logp, inputs["old_per_token_logps"], inputs["advantages"], mask, eps_low=eps_low, eps_high=eps_high,
        dual_clip=extra.get("delta"), level=level, agg=agg, max_len=max_len)
    if beta:
        per_token_kl = losses.kl(logp, inputs["ref_per_token_logps"], "k3")
        if bias_corrected_kl:  # TRL's use_bias_correction_kl=True: k3 weighted by the IS ratio
            per_token_kl = per_token_kl * torch.exp(logp - inputs["old_per_token_logps"])
        loss = loss + beta * losses.aggregate(per_token_kl, mask, agg, max_len=max_len)
        # TRL logs the token-mean of the (possibly ratio-weighted) per-token KL
        kl_mean = losses.aggregate(per_token_kl, mask, "token-mean").item()
        assert abs(metrics["kl"] - kl_mean) < TOL, (metrics["kl"], kl_mean)
    loss.backward()
    ours_grads = _grads(model)

    diff = abs(trl_loss.item() - loss.item())
    assert diff < TOL, f"{_case_id(case)}: TRL {trl_loss.item():.8f} labkit {loss.item():.8f} (|diff| {diff:.2e})"
    grad_diff = (trl_grads - ours_grads).abs().max().item()
    grad_scale = trl_grads.abs().max().item()
    assert grad_scale > 0
    assert grad_diff < TOL * max(1.0, grad_scale), f"{_case_id(case)}: max |grad diff| {grad_diff:.2e}"

    # the batch really exercises both clip sides (TRL's own count)
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0, metrics
    if level == "token":
        # same definition: fraction of unmasked tokens with (ratio < 1-eps_low and A < 0), resp.
        # (ratio > 1+eps_high and A > 0). TRL tests the ratio after the `delta` cap, which changes
        # nothing since delta > 1 + eps_high.
        assert abs(metrics["clip_ratio/low_mean"] - stats["clip/low"]) < TOL, (metrics, stats)
        assert abs(metrics["clip_ratio/high_mean"] - stats["clip/high"]) < TOL, (metrics, stats)
    else:
        # GSPO: TRL's clip_ratio/*_mean is the fraction of *sequences* whose sequence ratio is
        # clipped (global_masked_mean on a (B, 1) tensor counts rows), while labkit's clip/* is
        # the fraction of unmasked *tokens* (every token of a row carries that row's ratio), i.e.
        # the same flags weighted by completion length. Different definitions: not compared.
        assert 0.0 <= stats["clip/low"] <= 1.0 and 0.0 <= stats["clip/high"] <= 1.0


def test_default_kl_differs_from_plain_k3_when_bias_corrected(tmp_path):
    """TRL's default use_bias_correction_kl=True is not the plain k3 term (documents the mapping)."""
    losses = _labkit("losses")
    trainer = _trainer(tmp_path, loss_type="bnpo", beta=0.04)
    assert trainer.args.use_bias_correction_kl is True
    inputs = _batch(trainer, 0.04)
    mask = inputs["completion_mask"]
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, inputs).item()
        logp = _completion_logps(trainer.model, inputs["prompt_ids"], inputs["prompt_mask"],
                                 inputs["completion_ids"], mask)
        plain, _ = losses.policy_loss(logp, inputs["old_per_token_logps"], inputs["advantages"], mask,
                                      agg="token-mean")
        plain = plain + 0.04 * losses.aggregate(losses.kl(logp, inputs["ref_per_token_logps"], "k3"), mask,
                                                "token-mean")
    assert abs(trl_loss - plain.item()) > 20 * TOL  # here ~6.5e-5, far outside the parity tolerance


# ------------------------------------------------------------------------------ advantages

G = 4
# three groups of G: all equal (zero std), a 0/1 mix, and arbitrary reals
REWARDS = [1.0, 1.0, 1.0, 1.0,
           1.0, 0.0, 0.0, 1.0,
           0.5, 2.0, -1.0, 0.25]


def fixed_rewards(completions, **kwargs):
    assert len(completions) == len(REWARDS)
    return list(REWARDS)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages_match_trl(scale, tmp_path):
    advantages = _labkit("advantages")
    trainer = _trainer(tmp_path, reward_funcs=fixed_rewards, scale_rewards=scale, num_generations=G,
                       per_device_train_batch_size=len(REWARDS), max_completion_length=4)
    records = [p.to_record() for p in DEFAULT_TASK.sample(len(REWARDS) // G, "train", seed=1)]
    inputs = [dict(r) for r in records for _ in range(G)]  # as TRL's RepeatSampler: each prompt G times in a row
    out = trainer._generate_and_score_completions(inputs)
    trl_adv = out["advantages"].float()

    rewards = torch.tensor(REWARDS)
    ours = advantages.grpo(rewards, G, scale=scale)
    explicit = advantages.grpo(rewards, G, scale=scale, eps=1e-4, unbiased=True)  # TRL: 1e-4, Bessel (nanstd)
    assert ours.shape == trl_adv.shape == (len(REWARDS),)
    diff = (ours - trl_adv).abs().max().item()
    assert diff < TOL, f"scale={scale}: max |diff| {diff:.2e}\nTRL    {trl_adv.tolist()}\nlabkit {ours.tolist()}"
    assert torch.equal(ours, explicit)
    assert torch.all(trl_adv[:G] == 0) and torch.all(ours[:G] == 0)  # zero-std group: exactly 0, no NaN
    assert all(math.isfinite(a) for a in ours.tolist())
    if scale == "none":
        assert (advantages.dr_grpo(rewards, G) - trl_adv).abs().max().item() < TOL


# TRL loss types that are labkit loss modes (labkit.formulas.policy_losses), with TRL's aggregation:
#   cispo -> loss "cispo": TRL clips the weight above only, at the absolute epsilon_high; labkit
#            clips to [1 - eps_low, 1 + eps_high], so eps_high = epsilon_high - 1 and eps_low =
#            0.999 (a bound of 0.001 that no ratio here reaches); aggregated as dapo (token-mean)
#   sapo  -> loss "sapo(tau_pos, tau_neg)" = sapo_temperature_pos / _neg, seq-mean-token-mean
#   luspo -> loss "gspo" (sequence ratio) with agg "seq-mean-token-sum"
#   vespo -> loss "vespo(k_pos, lambda_pos, k_neg, lambda_neg)" = vespo_*, token-mean (as dapo)
MODE_CASES = [
    ("cispo", {"epsilon_high": 1.3}, "cispo", {"eps_low": 0.999, "eps_high": 0.3}, "token-mean"),
    ("sapo", {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05},
     "sapo(tau_pos=1.0, tau_neg=1.05)", {}, "seq-mean-token-mean"),
    ("sapo", {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0},
     "sapo(tau_pos=0.5, tau_neg=2)", {}, "seq-mean-token-mean"),
    ("luspo", {"importance_sampling_level": "sequence", "epsilon_high": 0.28}, "gspo",
     {"eps_high": 0.28}, "seq-mean-token-sum"),
    ("vespo", {}, "vespo", {}, "token-mean"),
    ("vespo", {"vespo_k_pos": 1.0, "vespo_lambda_pos": 1.5, "vespo_k_neg": 2.0,
               "vespo_lambda_neg": 1.0},
     "vespo(k_pos=1, lambda_pos=1.5, k_neg=2, lambda_neg=1)", {}, "token-mean"),
]


def _trl_side(tmp_path, loss_type, **extra):
    """TRL's loss and weight gradients on the prepared batch (no KL), and the batch; the
    model's gradients are cleared again for labkit's side."""
    trainer = _trainer(tmp_path, loss_type=loss_type, beta=0.0, **extra)
    inputs = _batch(trainer, 0.0)
    trainer.model.zero_grad(set_to_none=True)
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_grads = _grads(trainer.model)
    trainer.model.zero_grad(set_to_none=True)
    return trainer.model, inputs, trl_loss, trl_grads


def _same_loss_and_grads(model, loss, trl_loss, trl_grads):
    loss.backward()
    assert abs(trl_loss.item() - loss.item()) < TOL, (trl_loss.item(), loss.item())
    scale = trl_grads.abs().max().item()
    assert scale > 0
    assert (trl_grads - _grads(model)).abs().max().item() < TOL * max(1.0, scale)


@pytest.mark.parametrize("case", MODE_CASES, ids=[f"{c[0]}-{c[2]}" for c in MODE_CASES])
def test_policy_losses_match_trl_compute_loss(case, tmp_path):
    """TRL's cispo, sapo, luspo and vespo loss types against labkit's loss modes on the same
    batch: the loss and the gradient of every weight, to 1e-6 (float32, as TRL computes)."""
    from labkit.formulas.policy_losses import policy_loss_mode

    loss_type, extra, spec, clip, agg = case
    model, inputs, trl_loss, trl_grads = _trl_side(tmp_path, loss_type, **extra)
    mask = inputs["completion_mask"]
    logp = _completion_logps(model, inputs["prompt_ids"], inputs["prompt_mask"],
                             inputs["completion_ids"], mask)
    loss, _ = policy_loss_mode(spec, logp, inputs["old_per_token_logps"], inputs["advantages"],
                               mask, agg=agg, **clip)
    _same_loss_and_grads(model, loss, trl_loss, trl_grads)


def test_top_entropy_masking_matches_trl_compute_loss(tmp_path):
    """TRL's top_entropy_quantile=0.5 (only the upper half of the tokens by entropy carry the
    loss) == labkit's high_entropy_mask(entropy, mask, 0.5) as the token_weight of the vanilla
    loss, at TRL's grpo aggregation: the loss and every weight's gradient to 1e-6."""
    from labkit.formulas.losses import entropy
    from labkit.formulas.policy_losses import high_entropy_mask, policy_loss_mode

    model, inputs, trl_loss, trl_grads = _trl_side(tmp_path, "grpo", top_entropy_quantile=0.5)
    mask = inputs["completion_mask"]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], mask], dim=1)
    p, c = inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=attention).logits.float()[:, p - 1:p - 1 + c]
    logp = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"][..., None])[..., 0]
    learns = high_entropy_mask(entropy(logits), mask, 0.5)
    assert 0 < learns.sum() < mask.sum()  # the mask keeps some tokens and drops others
    loss, _ = policy_loss_mode("vanilla", logp, inputs["old_per_token_logps"],
                               inputs["advantages"], mask, agg="seq-mean-token-mean",
                               token_weight=learns)
    _same_loss_and_grads(model, loss, trl_loss, trl_grads)
