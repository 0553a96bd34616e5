import json
import math

import pytest
import torch
from cli import fresh_process, in_process
from crashes import train_then_crash

from labkit.model.learner import make_accelerator
from labkit.problems.rewards import correctness
from labkit.run.rundir import latest_checkpoint, read_log
from labkit.settings.config import TrainConfig
from labkit.trainer import train

SMOKE = dict(steps=3, batch_prompts=4, group_size=4, max_new_tokens=12, eval_every=2,
             eval_n=16, eval_samples=2, cgc_prompts=4, progress=False, lr=5e-4)
PERF = ("perf/",)


def _comparable(records):
    """Records without wall-clock figures, which no two runs share."""
    return [{k: v for k, v in r.items() if not k.startswith(PERF)} for r in records]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_smoke_run_writes_a_complete_run_directory(tmp_path, algo):
    config = TrainConfig(algo=algo, run_dir=str(tmp_path / "run"), **SMOKE)
    result = train(config)
    run = result.run_dir
    records = read_log(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        for key in ("rollout/reward_mean", "rollout/frac_zero_std", "adv/gav", "adv/std",
                    "loss/policy", "loss/total", "policy/entropy", "clip/low", "clip/high",
                    "perf/step_s", "perf/tokens_per_s", "perf/mem_mb", "opt/lr"):
            assert key in r, key
            assert math.isfinite(r[key]), (key, r[key])
    if algo == "ppo":
        assert all("loss/value" in r and "value/explained_var" in r for r in records[1:])
    for step in (0, 2, 3):  # before the first step, every eval_every, and at the end
        assert "eval/accuracy" in records[step] and "eval/pass@2" in records[step]
        assert "eval/cgc" in records[step]
        assert records[step]["perf/eval_s"] > 0
    assert "perf/eval_s" not in records[1]  # timed where an evaluation ran, and only there
    saved = json.loads((run / "config.json").read_text())
    assert saved["config"] == config.to_dict()
    assert saved["versions"]["torch"] == torch.__version__
    assert "git_commit" in saved
    assert latest_checkpoint(run).name == "step_000003.pt"
    assert (run / "final" / "config.json").is_file()
    assert result.accuracy_before == records[0]["eval/accuracy"]
    assert result.accuracy_after == records[-1]["eval/accuracy"]


def test_same_seed_same_metrics(tmp_path):
    a = train(TrainConfig(run_dir=str(tmp_path / "a"), seed=3, **SMOKE))
    b = train(TrainConfig(run_dir=str(tmp_path / "b"), seed=3, **SMOKE))
    c = train(TrainConfig(run_dir=str(tmp_path / "c"), seed=4, **SMOKE))
    assert _comparable(a.history) == _comparable(b.history)
    assert _comparable(a.history)[1:] != _comparable(c.history)[1:]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_resume_continues_like_an_uninterrupted_run(tmp_path, algo):
    settings = dict(SMOKE, steps=4, checkpoint_every=2, algo=algo, seed=1)
    whole = train(TrainConfig(run_dir=str(tmp_path / "whole"), **settings))

    train_then_crash(TrainConfig(run_dir=str(tmp_path / "cut"), **settings), after_step=3)
    # step 3 was written, but the last checkpoint is step 2: resume redoes step 3
    assert [r["step"] for r in read_log(tmp_path / "cut" / "metrics.jsonl")] == [0, 1, 2, 3]
    resumed = train(resume=tmp_path / "cut")
    assert _comparable(resumed.history) == _comparable(whole.history)
    assert _comparable(read_log(tmp_path / "cut" / "metrics.jsonl")) == \
        _comparable(whole.history)


SIGNAL = dict(lr=1e-2, seed=1, max_new_tokens=16)
"""A one-step run whose rewards differ within groups (seed 0's are all 0: no gradient) and
whose completions differ in length (so token and row weights differ)."""


def _grad_norm(result) -> float:
    """The gradient norm (before clipping) of a one-step run's update."""
    return next(r["perf/grad_norm"] for r in result.history if "perf/grad_norm" in r)


def _one_update(tmp_path, name, **kwargs):
    config = TrainConfig(run_dir=str(tmp_path / name), **dict(SMOKE, steps=1, eval_n=4,
                                                                 cgc_prompts=0, eval_samples=0,
                                                                 **kwargs))
    result = train(config)
    return result, torch.load(latest_checkpoint(result.run_dir), weights_only=False)["policy"]


@pytest.fixture
def own_token_mode():
    """A token-normalised aggregation mode registered by name for one test, then removed."""
    from labkit.formulas.losses import AGG_MODES

    @AGG_MODES.register("half-token-mean", normaliser="tokens")
    def half_token_mean(masked, mask, *, max_len=None):
        return 0.5 * masked.sum() / mask.sum().clamp(min=1)

    yield "half-token-mean"
    del AGG_MODES._fns["half-token-mean"]


def test_gradient_accumulation_equals_one_pass_for_every_kind_of_mode(tmp_path, own_token_mode):
    """Each mode's micro-batches are weighed by what it declares it divides by: a new
    token-normalised mode and one given by import path accumulate right too (weighed by
    rows, as they once were, they would not)."""
    modes = ("token-mean", "seq-mean-token-mean", "token-sum", own_token_mode,
             "agg_modes_for_tests:twice_token_mean")
    for agg in modes:
        one, whole = _one_update(tmp_path, f"one-{agg}", agg=agg, **SIGNAL)
        acc, accumulated = _one_update(tmp_path, f"acc-{agg}", agg=agg, grad_accum=4, **SIGNAL)
        # Adam's first step hardly sees a gradient's scale; the gradient's norm does
        assert _grad_norm(one) > 0, agg  # the step has something to learn
        assert _grad_norm(acc) == pytest.approx(_grad_norm(one), rel=1e-4), agg
        # Adam's first step is lr * g / (|g| + eps): a weight whose gradient is below eps = 1e-8
        # moves by lr * g / eps = 1e6 * g, so float noise of 1e-12 in g shows as 1e-6 here;
        # a wrong accumulation weight moves weights by a fraction of lr = 1e-2
        for key in whole:
            torch.testing.assert_close(whole[key], accumulated[key], rtol=1e-4, atol=1e-5)


def test_a_mode_that_does_not_say_what_it_divides_by_cannot_be_accumulated():
    TrainConfig(agg="agg_modes_for_tests:undeclared")  # one pass a minibatch: no weight needed
    with pytest.raises(ValueError, match=r"agg='agg_modes_for_tests:undeclared' does not say "
                                         r"what it divides by.*normaliser"):
        TrainConfig(agg="agg_modes_for_tests:undeclared", grad_accum=2)


def test_a_row_weight_for_a_token_mode_would_be_caught(monkeypatch, tmp_path):
    """The accumulation test can fail: weighing a token-normalised mode's micro-batches by
    rows (the old rule for any mode it did not name) moves the weights."""
    from labkit.formulas import losses

    monkeypatch.setattr(losses, "normaliser_of", lambda agg, field="agg": "rows")
    one, _ = _one_update(tmp_path, "one", agg="token-mean", **SIGNAL)
    acc, _ = _one_update(tmp_path, "acc", agg="token-mean", grad_accum=4, **SIGNAL)
    assert _grad_norm(acc) != pytest.approx(_grad_norm(one), rel=1e-4)


@pytest.mark.parametrize("variant", [
    dict(estimator="dr_grpo", agg="seq-mean-token-sum-norm"),
    dict(estimator="rloo", agg="seq-mean-token-sum"),
    dict(ratio_level="sequence", num_iterations=2, minibatches=2),
    dict(eps_high=0.28, dual_clip=3.0, num_iterations=2),
    dict(beta=0.04, kl_kind="k1"), dict(beta=0.04, kl_kind="k2"), dict(beta=0.04, kl_kind="k3"),
    dict(entropy_coef=0.01), dict(dynamic_sampling=True), dict(reinforce=True),
    dict(scale="batch", std_unbiased=False),
    dict(algo="ppo", beta=0.05, kl_kind="k1", value_clip=None, whiten_advantages=False),
])
def test_variants_run_with_finite_losses(tmp_path, variant):
    result, _ = _one_update(tmp_path, "v", **variant)
    record = result.history[1]
    if record.get("rollout/kept_frac") == 0:  # dynamic sampling dropped every group: no update
        assert "loss/total" not in record
    else:
        assert math.isfinite(record["loss/total"])
    if variant.get("beta") and variant.get("algo", "grpo") == "grpo":
        assert "loss/kl" in record and record["policy/kl"] >= -1e-6 or \
            variant["kl_kind"] == "k1"
    if variant.get("dynamic_sampling"):
        assert 0 <= record["rollout/kept_frac"] <= 1
        assert math.isclose(record["rollout/kept_frac"], 1 - record["rollout/frac_zero_std"])


def test_non_finite_loss_stops_with_a_checkpoint(tmp_path, monkeypatch):
    import labkit.update

    original = labkit.update.policy_loss_mode

    def poisoned(*args, **kwargs):
        loss, stats = original(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(labkit.update, "policy_loss_mode", poisoned)
    with pytest.raises(RuntimeError, match="non-finite loss.*checkpoint"):
        train(TrainConfig(run_dir=str(tmp_path / "nan"), **dict(SMOKE, eval_n=4)))
    assert latest_checkpoint(tmp_path / "nan") is not None


def test_run_dir_that_holds_files_is_refused(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "metrics.jsonl").write_text("")
    with pytest.raises(FileExistsError, match="run_dir"):
        train(TrainConfig(run_dir=str(tmp_path / "busy"), **SMOKE))


def test_train_command_prints_a_json_summary_last(tmp_path):
    done = fresh_process("train", "--algo", "grpo", "--steps", "2", "--batch-prompts", "2", "--group-size", "2",
                "--eval-n", "8", "--eval-samples", "1", "--cgc-prompts", "2", "--progress",
                "false", "--run-dir", str(tmp_path / "cli"))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(summary) >= {"algo", "steps", "accuracy_before", "accuracy_after", "wall_s",
                            "run_dir"}
    assert summary["algo"] == "grpo" and summary["steps"] == 2
    assert summary["run_dir"] == str(tmp_path / "cli")


@pytest.mark.parametrize("args, name", [
    (["--group-size", "1"], "group_size"), (["--lr", "0"], "lr"),
    (["--eps-low", "1.5"], "eps_low"), (["--agg", "mean"], "agg"),
    (["--steps", "ten"], "--steps"), (["--dynamic-sampling", "maybe"], "--dynamic-sampling"),
    (["--model", "/no/such/model"], "model"), (["--resume", "/no/such/run"], "config.json"),
])
def test_train_command_bad_input_is_one_clear_line(args, name):
    done = in_process("train", *args)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and name in lines[0], done.stderr


def test_truncated_completions_score_zero_unless_asked(tmp_path):
    seen = []
    settings = dict(SMOKE, steps=1, max_new_tokens=9, eval_n=4, cgc_prompts=0, eval_samples=0)
    # 9 tokens cut every completion short of "\boxed{NN}<eos>"; a truncated one scores 0
    train(TrainConfig(run_dir=str(tmp_path / "strict"), **settings),
          callbacks=[lambda r: seen.append((r.rewards.clone(), r.batch.truncated.clone()))])
    rewards, truncated = seen[-1]
    assert truncated.all() and (rewards == 0).all()
    # scored anyway, a truncated "\boxed{7}" (9 tokens incl. the box) can earn its reward
    lenient = dict(settings, max_new_tokens=12, score_truncated=True)
    train(TrainConfig(run_dir=str(tmp_path / "lenient"), **lenient),
          callbacks=[lambda r: seen.append((r.rewards.clone(), r.batch.texts))])
    rewards, texts = seen[-1]
    assert rewards.tolist() == correctness(texts, answer=_answers(lenient))


def _answers(settings):
    from labkit.problems.source import ProblemSource
    from labkit.trainer import step_seed

    config = TrainConfig(**{k: v for k, v in settings.items()})
    problems = ProblemSource(config).draw(step_seed(config, 1))
    return [p.answer for p in problems for _ in range(config.group_size)]


def test_runs_of_different_precision_follow_each_other_in_one_process(tmp_path):
    """A notebook runs an fp32 run, then a bf16 one, then fp32 again: each gets its own
    precision (accelerate keeps one process-wide state and would refuse the second)."""
    small = dict(SMOKE, steps=1, eval_n=4, eval_samples=1, cgc_prompts=0)
    for i, precision in enumerate(["fp32", "bf16", "fp32"]):
        result = train(TrainConfig(precision=precision, device="cpu",
                                   run_dir=str(tmp_path / f"run{i}"), **small))
        assert result.steps == 1
        assert make_accelerator(result.config).mixed_precision == \
            ("bf16" if precision == "bf16" else "no")


# --- the step API: Trainer.step -> StepResult -----------------------------------------------

STEP = dict(SMOKE, steps=2, eval_n=4, eval_samples=0, cgc_prompts=0)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_step_result_holds_the_rewards_and_advantages_its_metrics_come_from(algo):
    from labkit.formulas import metrics as M
    from labkit.trainer import Trainer, step_seed

    config = TrainConfig(algo=algo, **STEP)
    result = Trainer(config).step(1)
    assert result.step == 1 and result.seed == step_seed(config, 1)
    N = config.batch_prompts * config.group_size
    assert result.rewards.shape == (N,) and result.batch.completion_ids.shape[0] == N
    assert result.advantages.shape == ((N,) if algo == "grpo" else
                                       result.batch.completion_mask.shape)
    again = M.step_metrics(rewards=result.rewards, group_size=config.group_size,
                           advantages=result.advantages, mask=result.batch.completion_mask,
                           truncated=result.batch.truncated)
    assert {k: result.metrics[k] for k in again} == again
    assert not any(key.startswith("_") or "/" not in key for key in result.metrics)
    assert all(isinstance(value, float) for value in result.metrics.values())
    json.dumps(result.metrics)  # a metrics.jsonl record, nothing else in it


def _same_results(a, b) -> bool:
    return (torch.equal(a.rewards, b.rewards) and torch.equal(a.advantages, b.advantages)
            and torch.equal(a.batch.completion_ids, b.batch.completion_ids)
            and a.batch.texts == b.batch.texts and (a.step, a.seed) == (b.step, b.seed)
            and _comparable([a.metrics]) == _comparable([b.metrics]))


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_two_trainers_of_one_config_give_identical_step_results(algo):
    from labkit.trainer import Trainer

    config = TrainConfig(algo=algo, **STEP)
    first, second = Trainer(config), Trainer(config)
    a = [first.step(s) for s in (1, 2)]
    b = [second.step(s) for s in (1, 2)]
    assert all(_same_results(x, y) for x, y in zip(a, b))
    assert not _same_results(a[0], a[1])  # the comparison can tell two steps apart


def test_train_runs_the_steps_of_the_step_api(tmp_path):
    from labkit.trainer import Trainer

    config = TrainConfig(run_dir=str(tmp_path / "run"), **STEP)
    reports = []
    result = train(config, callbacks=[reports.append])
    trainer = Trainer(config)
    for report, record in zip(reports, result.history[1:]):
        step = trainer.step(report.step)
        assert torch.equal(step.rewards, report.rewards)
        assert torch.equal(step.advantages, report.advantages)
        assert step.batch.texts == report.batch.texts
        assert _comparable([{"step": report.step, **step.metrics}]) == \
            _comparable([{k: v for k, v in record.items() if not k.startswith("eval/")}])


def test_train_draws_each_step_with_step_seed(tmp_path, monkeypatch):
    """With the seed rule replaced by a constant, every step of train() draws the same
    prompts; with the real one they differ: train() seeds its steps through step_seed."""
    import labkit.trainer

    def prompts_of_each_step(name):
        seen = []
        train(TrainConfig(run_dir=str(tmp_path / name), **STEP),
              callbacks=[lambda r: seen.append(r.batch.prompt_ids.clone())])
        return seen

    first, second = prompts_of_each_step("real")
    assert not torch.equal(first, second)
    monkeypatch.setattr(labkit.trainer, "step_seed", lambda config, step: 7)
    first, second = prompts_of_each_step("constant")
    assert torch.equal(first, second)


# --- KL: which estimator by default, and one comparable key -------------------------------

def test_kl_kind_defaults_per_algorithm_and_an_explicit_choice_wins():
    from typing import get_args, get_type_hints

    from labkit.formulas.losses import KL_KINDS

    assert TrainConfig().kl_estimator == "k3" and TrainConfig(algo="ppo").kl_estimator == "k1"
    for kind in KL_KINDS:
        assert TrainConfig(kl_kind=kind).kl_estimator == kind
        assert TrainConfig(algo="ppo", kl_kind=kind).kl_estimator == kind
    assert set(get_args(get_type_hints(TrainConfig)["kl_kind"])) == {"auto", *KL_KINDS}


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_kl_k1_is_the_same_quantity_for_both_algorithms(algo):
    """policy/kl_k1 = mean over real tokens of logp_old - logp_ref, recomputed here from the
    step's batch and the reference, once the policy has moved away from it."""
    from labkit.model.scoring import token_logprobs
    from labkit.trainer import Trainer

    config = TrainConfig(algo=algo, beta=0.1, **dict(STEP, lr=2e-2, warmup_steps=0))
    trainer = Trainer(config)
    results = [trainer.step(s) for s in (1, 2, 3, 4)]  # steps without mixed groups move nothing
    result = results[-1]
    batch = result.batch
    with torch.no_grad():
        ref, _ = token_logprobs(trainer.learner.reference, batch, temperature=config.temperature)
    mask = batch.completion_mask.bool()
    want = (batch.old_logprobs - ref)[mask].double().mean().item()
    assert abs(want) > 1e-3  # the policy has moved: the test can tell k1 from 0
    assert result.metrics["policy/kl_k1"] == pytest.approx(want, abs=1e-5)
    if algo == "ppo":  # k1 in the reward by default, on the same tokens
        assert result.metrics["policy/kl"] == result.metrics["policy/kl_k1"]


def test_kl_k1_needs_a_reference():
    from labkit.trainer import Trainer

    result = Trainer(TrainConfig(**STEP)).step(1)
    assert "policy/kl_k1" not in result.metrics and "policy/kl" not in result.metrics


# --- dead runs: a run that cannot learn says so ---------------------------------------------

DEAD = dict(SMOKE, max_new_tokens=1, eval_n=4, eval_samples=0, cgc_prompts=0)
"""One token per completion: never EOS, so every completion is truncated and scores 0."""


def test_a_run_that_cannot_learn_says_so_records_it_and_stops(tmp_path, capsys):
    from labkit.lab import flat_summary, summary_rows
    from labkit.records import STOPPED
    from labkit.run.stops import DEAD_FILE

    run = tmp_path / "run"
    result = train(TrainConfig(run_dir=str(run), **dict(DEAD, steps=8, dead_steps=3)))
    assert result.steps == 3 and [r["step"] for r in result.history] == [0, 1, 2, 3]
    assert all(r["rollout/truncated_frac"] == 1.0 and r["rollout/reward_mean"] == 0
               for r in result.history[1:])
    dead = json.loads((run / DEAD_FILE).read_text())
    assert (dead["first"], dead["step"], dead["truncated"]) == (1, 3, True)
    assert result.summary()["dead_run"] == dead and result.stopped == dead["message"]
    assert json.loads((run / STOPPED).read_text())["message"] == dead["message"]
    err = capsys.readouterr().err
    assert err.count(dead["message"]) == 1  # said once, where the user looks
    rows = summary_rows({"grpo": result})
    assert rows[0]["dead_run"] == 1 and rows[0]["dead_step"] == 3
    assert flat_summary(rows)["grpo/dead_run"] == 1
    with pytest.raises(ValueError, match="dead run.*finished"):
        train(resume=run)  # stopped: a resume does not continue it


def test_a_dead_run_goes_on_when_asked_and_is_still_recorded(tmp_path, capsys):
    from labkit.lab import summary_rows
    from labkit.run.stops import DEAD_FILE

    result = train(TrainConfig(run_dir=str(tmp_path / "run"),
                               **dict(DEAD, steps=4, dead_steps=2, stop_when_dead=False)))
    assert result.steps == 4 and result.stopped is None
    assert result.summary()["dead_run"]["step"] == 2
    assert json.loads((tmp_path / "run" / DEAD_FILE).read_text())["first"] == 1
    assert "the run goes on" in capsys.readouterr().err
    assert summary_rows({"ppo": result})[0]["dead_run"] == 1


_REWARD_CALLS = []


def zero_twice_then_mixed(completions, **kwargs):
    """A reward (TRL signature) that is 0 for every completion on its first two calls, then
    0, 1, 0, 1, ... so that every group of G >= 2 is mixed."""
    _REWARD_CALLS.append(len(completions))
    if len(_REWARD_CALLS) <= 2:
        return [0.0] * len(completions)
    return [float(i % 2) for i in range(len(completions))]


def test_a_dead_spell_shorter_than_k_does_not_stop_the_run(tmp_path):
    settings = dict(SMOKE, eval_n=4, eval_samples=0, cgc_prompts=0, score_truncated=True,
                    reward=f"{__name__}:zero_twice_then_mixed", steps=5)
    _REWARD_CALLS.clear()
    result = train(TrainConfig(run_dir=str(tmp_path / "k3"), dead_steps=3, **settings))
    zero_std = [r["rollout/frac_zero_std"] for r in result.history[1:]]
    assert zero_std[:2] == [1.0, 1.0] and all(z < 1 for z in zero_std[2:])
    assert result.steps == 5 and result.stopped is None and result.summary()["dead_run"] is None
    _REWARD_CALLS.clear()  # the same spell is a dead run when K is 2
    assert train(TrainConfig(run_dir=str(tmp_path / "k2"), dead_steps=2, **settings)).steps == 2


@pytest.mark.parametrize("estimator", ["none", "reinforce++", "reinforce++-baseline", "remax",
                                       "opo", "gpg", "grpo_passk", "gdpo", "max_rl"])
def test_every_group_estimator_trains_a_step(estimator):
    """A Trainer step with each registered critic-free estimator: the advantages the step
    used are the estimator's on the step's rewards, mask and extras, and the update is finite."""
    from labkit.formulas.estimators import ESTIMATORS
    from labkit.stages import advantage_inputs, estimator_extras
    from labkit.trainer import Trainer

    config = TrainConfig(estimator=estimator, reward="correctness+0.5*format", **STEP)
    trainer, before = Trainer(config), Trainer(config)  # `before`: the policy the step saw
    problems = trainer.problems.draw(1234)
    result = trainer.step(1, problems)
    assert math.isfinite(result.metrics["loss/total"])
    extras = estimator_extras(config, before.learner, before.tokenizer, problems,
                              result.batch, result.seed)
    assert set(extras) == {"components": {"components", "component_weights"},
                           "greedy_rewards": {"greedy_rewards"}}.get(
                               next(iter(ESTIMATORS.needs(estimator)), None), set())
    if "components" in extras:  # the terms, weighted, are the reward
        total = extras["components"] @ extras["component_weights"]
        torch.testing.assert_close(total, result.rewards)
    if "greedy_rewards" in extras:  # one greedy completion per prompt, its reward G times
        assert torch.equal(extras["greedy_rewards"].view(-1, config.group_size).amin(1),
                           extras["greedy_rewards"].view(-1, config.group_size).amax(1))
    want = ESTIMATORS[estimator](advantage_inputs(config, result.rewards,
                                                  result.batch.completion_mask, extras=extras))
    assert torch.equal(result.advantages, want)


@pytest.mark.parametrize("algo, kl_in", [("grpo", "reward"), ("ppo", "loss"), ("grpo", "loss"),
                                         ("ppo", "reward")])
def test_kl_sits_where_kl_in_puts_it(algo, kl_in, monkeypatch):
    """kl_in=loss logs loss/kl (a term of the policy loss); kl_in=reward does not, and a GRPO
    estimator sees r_i - beta * sum_t KL_t. The reference log-probs are set to the sampling
    ones minus 0.1, so k1 = 0.1 on every token and the penalty of row i is beta * 0.1 * L_i."""
    import labkit.stages as stages
    from labkit.trainer import Trainer

    monkeypatch.setattr(stages, "reference_logprobs",
                        lambda config, learner, batch: batch.old_logprobs - 0.1)
    config = TrainConfig(algo=algo, beta=0.5, kl_in=kl_in, kl_kind="k1", estimator=None
                         if algo == "ppo" else "dr_grpo", **STEP)
    result = Trainer(config).step(1)
    assert ("loss/kl" in result.metrics) == (kl_in == "loss")
    assert result.metrics["policy/beta"] == 0.5
    assert result.metrics["policy/kl_k1"] == pytest.approx(0.1, rel=1e-5)
    if algo == "grpo":
        penalty = 0.5 * 0.1 * result.batch.completion_mask.sum(1)
        seen = result.rewards - (penalty if kl_in == "reward" else 0.0)
        want = seen.view(-1, config.group_size)
        want = (want - want.mean(1, keepdim=True)).reshape(-1)  # dr_grpo
        torch.testing.assert_close(result.advantages, want, rtol=1e-5, atol=1e-5)


def test_adaptive_kl_moves_beta_and_a_checkpoint_keeps_it(tmp_path):
    from labkit.run.rundir import latest_checkpoint

    """With a target far above any KL the error clips at -0.2: each step multiplies beta by
    1 - 0.2 * N / horizon, and the checkpoint holds the value after the last step's move."""
    config = TrainConfig(beta=0.1, kl_target=10.0, kl_horizon=100, run_dir=str(tmp_path / "r"),
                         **dict(STEP, steps=3))
    result = train(config)
    betas = [r["policy/beta"] for r in result.history if "policy/beta" in r]
    factor = 1 - 0.2 * 16 / 100
    assert betas == pytest.approx([0.1 * factor ** k for k in range(3)], rel=1e-12)
    state = torch.load(latest_checkpoint(result.run_dir), weights_only=False)
    assert state["beta"] == pytest.approx(0.1 * factor ** 3, rel=1e-12)
    with pytest.raises(ValueError, match="kl_target adapts beta"):
        TrainConfig(kl_target=0.01)


def test_summary_rows_read_length_and_worked_share_at_the_start_and_the_end(tmp_path):
    from labkit.lab import summary_rows
    from labkit.trainer import RunResult

    history = [{"step": 0, "eval/accuracy": 0.4}] + [
        {"step": s, "rollout/length_mean": 20.0 + s, "rollout/worked_frac": 0.5 + 0.05 * s,
         "rollout/length_correct": 30.0 + s, "rollout/length_incorrect": 10.0 + s,
         "rollout/reward_mean": 0.5, "perf/step_s": 1.0, "perf/mem_mb": 100.0}
        for s in range(1, 11)]
    result = RunResult(tmp_path, TrainConfig(task="think"), 10, 0.4, 0.6, 1.0, history)
    row = summary_rows({"grpo/seed=0": result})[0]
    # the first step's values, and the means of the last fifth (steps 9 and 10)
    assert row["length_start"] == 21.0 and row["length_final"] == 29.5
    assert row["worked_start"] == pytest.approx(0.55)
    assert row["worked_final"] == pytest.approx(0.975)
    assert (row["length_correct_final"], row["length_incorrect_final"]) == (39.5, 19.5)
    without = RunResult(tmp_path, TrainConfig(), 10, 0.4, 0.6, 1.0,
                        [{k: v for k, v in r.items() if k != "rollout/worked_frac"}
                         for r in history])
    assert "worked_start" not in summary_rows({"grpo/seed=0": without})[0]
