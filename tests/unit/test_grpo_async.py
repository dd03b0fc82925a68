"""Asynchronous GRPO's parts: recorded behaviour log-probs, the corrections, the fixed-depth schedule."""

import copy
from pathlib import Path

import pytest
import torch

from tests.unit.test_grpo_old_logps import model_and_rollouts  # noqa: F401 (a fixture)
from tunelab.data import load_tokenizer, prompt_dataset
from tunelab.errors import CheckpointError, ConfigError
from tunelab.modules import packed_linear
from tunelab.peft import get_adapter_params
from tunelab.rl import (
    GRPOLoss,
    MaskedIS,
    ModelRolloutEngine,
    Rollout,
    RolloutPipeline,
    SamplingSettings,
    ScoredGroups,
    TruncatedIS,
    behaviour_logps_batch,
    behaviour_step,
    behaviour_sums,
    check_correction,
    completion_logps,
    lag_histogram,
    off_policy_metrics,
    policy_gradient_pass,
    rollout_batch,
    split_ranks,
)
from tunelab.training import output_layer

TINY = Path(__file__).resolve().parents[2] / "framework" / "tunelab" / "assets" / "tiny"


@pytest.fixture(scope="module")
def tiny(model_and_rollouts):  # noqa: F811 (the fixture imported above)
    """test_grpo_old_logps's tiny LoRA model (B randomized), the tokenizer and four prompts."""
    tokenizer = load_tokenizer(str(TINY), max_seq_len=256)
    data = prompt_dataset(
        tokenizer, source="json", data_files=str(TINY / "grpo_prompts.jsonl"), template="instruct"
    )
    return model_and_rollouts[0], tokenizer, [data.tokens[i] for i in range(4)]


def test_corrections_by_hand():
    log_ratio = torch.log(torch.tensor([[0.25, 1.0, 1.5, 3.0]]))
    weights, cut = TruncatedIS(cap=2.0).weights(log_ratio)
    assert torch.allclose(weights, torch.tensor([[0.25, 1.0, 1.5, 2.0]]))
    assert cut.tolist() == [[False, False, False, True]]
    weights, cut = MaskedIS(low=0.5, high=2.0).weights(log_ratio)
    assert torch.allclose(weights, torch.tensor([[0.0, 1.0, 1.5, 0.0]]))
    assert cut.tolist() == [[True, False, False, True]]
    with pytest.raises(ValueError, match="cap"):
        TruncatedIS(cap=0.0)
    with pytest.raises(ValueError, match="low"):
        MaskedIS(low=1.5)
    with pytest.raises(ConfigError, match="rollout.off_policy"):
        check_correction(GRPOLoss())


def test_engine_records_the_log_probs_the_trainer_computes(tiny):
    """At lag 0 the recorded behaviour log-probs are the training forward's, up to rounding."""
    model, tokenizer, prompts = tiny
    engine = ModelRolloutEngine(model, SamplingSettings(max_new_tokens=8), pad_id=tokenizer.pad_id)
    rows = [p for p in prompts for _ in range(2)]
    completions = engine.generate(rows, seeds=list(range(len(rows))))
    assert [len(values) for values in engine.last_logps] == [len(c) for c in completions]
    batch = rollout_batch(rows, completions, tokenizer.pad_id, torch.device("cpu"))
    recorded = behaviour_logps_batch(rows, engine.last_logps, batch["tokens"].shape[1], "cpu")
    with torch.no_grad():
        logps, mask = completion_logps(model, batch, output_layer(model))
    assert mask.sum() == sum(len(c) for c in completions)
    assert (recorded[~mask] == 0).all()
    # Merged adapters and the KV cache round differently from the training forward (fp32).
    torch.testing.assert_close(recorded[mask], logps[mask], atol=2e-5, rtol=0)
    assert (logps[mask] < -1e-3).any()  # not a trivially certain model


@pytest.mark.parametrize("kind", ["single_turn", "agentic"])
def test_lagged_loss_and_gradients_equal_an_fp64_tis_reference(tiny, kind):
    """k = 1: the pass's loss and gradients equal the TIS formula in fp64 on recorded log-probs.

    ``L = -1/T sum_it min(rho A, clip(rho) A) * min(exp(logp_old - logp_mu), C)``, with
    ``rho = exp(logp - logp_old)`` (1 in the first pass, its gradient that of ``logp``).
    ``agentic``: episodes with tool calls (tests/unit/test_agentic_episodes.py), whose tool and
    template tokens carry garbage behaviour log-probs: masked, they weigh nothing.
    """
    model, tokenizer, prompts = tiny
    model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    if kind == "agentic":
        from tests.unit.test_agentic_episodes import multi_turn_episodes
        from tunelab.rl.agentic import episode_batch

        tools = load_tokenizer(
            str(TINY), max_seq_len=512, chat_template=str(TINY / "tools_chat_template.jinja")
        )
        episodes, _ = multi_turn_episodes(tools)
        batch = episode_batch(episodes, tools.pad_id, torch.device("cpu"))
        advantages = torch.tensor([1.0, -0.5, 0.25])
    else:
        completions = [
            torch.randint(3, 800, (4 + i,), generator=generator).tolist() for i in range(4)
        ]
        batch = rollout_batch(prompts, completions, tokenizer.pad_id, torch.device("cpu"))
        advantages = torch.tensor([1.0, -0.5, 0.25, -0.75])
    with torch.no_grad():
        logps, mask = completion_logps(model, batch)
    # Trained positions: the labelled ones only (an episode's tool tokens are not).
    assert mask.tolist() == (batch["labels"][:, 1:] != -100).tolist()
    # The behaviour policy: an older one, its log-probs off by up to +-1; garbage elsewhere.
    noise = (torch.rand(logps.shape, generator=generator) * 2 - 1).masked_fill(~mask, 0.0)
    behaviour = (logps + noise).masked_fill(~mask, -50.0)
    rows = len(advantages)
    rollout = Rollout(batch, advantages, torch.ones(rows, dtype=torch.bool), lag=1)
    rollout.behaviour_logps = behaviour
    cap = 1.5
    rollout.correction = TruncatedIS(cap=cap)
    num_tokens = int(mask.sum())

    def update_pass() -> tuple[dict, dict]:
        for p in model.parameters():
            p.grad = None
        loss = GRPOLoss(aggregation="token_mean")
        sums = policy_gradient_pass(model, [rollout], loss, None, scale=1 / num_tokens)
        return sums, {name: p.grad.clone() for name, p in get_adapter_params(model).items()}

    # The recipe's pass runs the frozen layers on oneDNN-packed weights, whose fp32 sums are
    # ordered otherwise than MKL's (measured here: the loss 1.3e-6 relative, the gradients
    # up to 3.2e-6 of their norm from the plain pass's, and 2-5x the plain pass's distance
    # to fp64). The formula is pinned on the plain pass at this test's tolerance (set on
    # it); the packed pass is held to the plain one at the fp64 loss tolerance, 1e-5.
    packed_sums, packed_grads = update_pass()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed_linear, "packable", lambda weight: False)
        sums, grads = update_pass()
    assert packed_sums["loss"] == pytest.approx(sums["loss"], rel=1e-5)  # as against fp64
    for name, grad in grads.items():
        assert (packed_grads[name] - grad).norm() <= 1e-5 * grad.norm(), name

    reference = copy.deepcopy(model).double()
    for p in reference.parameters():
        p.grad = None
    ref_logps, _ = completion_logps(reference, batch)
    old = ref_logps.detach()
    ratio = torch.exp(ref_logps - old)
    weight = torch.exp(old - behaviour.double()).clamp(max=cap)
    adv = advantages.double()[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    ref_loss = (-(surrogate * weight) * mask).sum()
    (ref_loss / num_tokens).backward()
    assert sums["loss"] == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-6)
    ref_grads = {name: p.grad for name, p in get_adapter_params(reference).items()}
    for name, grad in grads.items():
        torch.testing.assert_close(grad.double(), ref_grads[name], atol=1e-6, rtol=1e-4)
    # Some tokens were truncated (the test would not see the cap otherwise), and counted.
    clipped = int(((torch.exp(old - behaviour.double()) > cap) & mask).sum())
    assert clipped > 0 and sums["off_policy/clipped"] == clipped
    metrics = off_policy_metrics(sums)
    assert metrics["off_policy/clip_fraction"] == pytest.approx(clipped / num_tokens)
    # k3 of KL(mu || pi_old) over the behaviour's samples: rho - 1 - log rho, rho = pi_old / mu.
    delta = (old - behaviour.double())[mask]
    assert metrics["off_policy/kl"] == pytest.approx(
        float((torch.exp(delta) - delta - 1).mean()), rel=1e-6
    )


def test_the_logged_kl_estimates_kl_of_the_behaviour_over_its_own_samples():
    """``off_policy/kl`` is unbiased for ``KL(mu || pi_old)`` on tokens drawn from ``mu``.

    Two fixed categorical distributions; 400,000 tokens drawn from ``mu``. The mirrored k3
    (``exp(-d) + d - 1``, for samples of ``pi_old``) would give ``chi2(mu || pi_old) - KL``,
    about 4.7 times the KL here.
    """
    generator = torch.Generator().manual_seed(0)
    mu = torch.softmax(torch.randn(16, generator=generator, dtype=torch.float64), dim=0)
    pi = torch.softmax(torch.randn(16, generator=generator, dtype=torch.float64), dim=0)
    exact = float((mu * (mu / pi).log()).sum())
    tokens = torch.multinomial(mu, 400_000, replacement=True, generator=generator)[None]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    sums = behaviour_sums(pi.log()[tokens], mu.log()[tokens], mask)
    sums = {f"off_policy/{key}": float(value) for key, value in sums.items()}
    metrics = off_policy_metrics(sums | {"off_policy/tokens": 400_000.0, "off_policy/clipped": 0.0})
    assert metrics["off_policy/kl"] == pytest.approx(exact, rel=0.02)
    assert -metrics["off_policy/log_ratio_mean"] == pytest.approx(exact, rel=0.02)


def test_lag_zero_is_not_corrected(tiny):
    """A rollout of lag 0 gets no weight even with recorded log-probs far off (sync GRPO)."""
    model, tokenizer, prompts = tiny
    completions = [[5, 6, 7]] * 4
    batch = rollout_batch(prompts, completions, tokenizer.pad_id, torch.device("cpu"))
    losses = []
    for behaviour in (None, torch.full((4, batch["tokens"].shape[1] - 1), -9.0)):
        copied = copy.deepcopy(model)
        rollout = Rollout(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4, dtype=bool))
        rollout.behaviour_logps = behaviour
        rollout.correction = TruncatedIS()
        sums = policy_gradient_pass(copied, [rollout], GRPOLoss(), None, scale=0.25)
        losses.append((sums["loss"], [p.grad.clone() for p in get_adapter_params(copied).values()]))
    assert losses[0][0] == losses[1][0]
    assert all(torch.equal(a, b) for a, b in zip(losses[0][1], losses[1][1], strict=True))


def _scored(step: int) -> list[ScoredGroups]:
    batch = {"tokens": torch.full((2, 3), step), "labels": torch.full((2, 3), -100)}
    rollout = Rollout(batch, torch.tensor([0.5, -0.5]), torch.tensor([True, False]))
    rollout.behaviour_logps = torch.tensor([[-0.1 * step, -1.0], [-2.5, 0.0]])
    refill = ScoredGroups(copy.deepcopy(rollout), [], {"refill_prompts": 1.0})
    return [ScoredGroups(rollout, [{"index": step, "reward": -1.0}], {"reward": -1.0}), refill]


def test_the_schedule_is_a_fixed_depth_and_survives_a_checkpoint():
    pipeline = RolloutPipeline(2, torch.device("cpu"))
    sampled, lags = [], []
    for step in range(5):
        pipeline.fill(step, 5, lambda s, now=step: sampled.append((s, now)) or _scored(s))
        batch = pipeline.take(step)
        assert batch.behaviour_step == behaviour_step(step, 2, 0)
        lags.append(batch.parts[0].rollout.lag)
        if step == 2:  # a step checkpoint: batches 3 and 4 in flight
            assert sorted(pipeline.pending) == [3, 4]
            assert pipeline.num_micro_batches() == 2  # refills drew no loader batch
            text = pipeline.state_text()
            restored = RolloutPipeline(2, torch.device("cpu"))
            restored.load_text(text, where="step_3")
            for s in (3, 4):
                a, b = pipeline.pending[s], restored.pending[s]
                assert a.behaviour_step == b.behaviour_step
                for x, y in zip(a.parts, b.parts, strict=True):
                    assert x.records == y.records and x.sums == y.sums
                    assert torch.equal(x.rollout.behaviour_logps, y.rollout.behaviour_logps)
                    assert torch.equal(x.rollout.batch["tokens"], y.rollout.batch["tokens"])
                    assert torch.equal(x.rollout.keep, y.rollout.keep)
                    assert x.rollout.keep.dtype == torch.bool
    # Batch s sampled at step max(s - 2, 0); the epoch's end bounds the pipeline.
    assert sampled == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2)]
    assert lags == [0, 1, 2, 2, 2]
    # Another number of trainers (rollout ranks hold no batch: their count may change).
    with pytest.raises(CheckpointError) as refused:
        RolloutPipeline(2, torch.device("cpu")).load_text('["[]", "[]"]', where="step_3")
    assert str(refused.value) == (
        "step_3: the async rollouts in flight (rollout.max_lag > 0) were saved by 2 training "
        "processes and this run has 1; resume on 2 (--nproc_per_node minus rollout.ranks)"
    )
    with pytest.raises(CheckpointError, match="unreadable"):
        RolloutPipeline(2, torch.device("cpu")).load_text("[1", where="step_3")


def test_a_new_policy_is_sent_only_when_a_fill_samples_with_it():
    # k = 2, 5 steps per epoch, batches 0-2 sampled at step 0: after update s the fill at
    # s + 1 samples batch s + 3 while it is in the epoch; after the epoch's last update the
    # next epoch's first fill samples, if one follows.
    pipeline = RolloutPipeline(2, torch.device("cpu"))
    pipeline.fill(0, 5, _scored)
    sends = []
    for step in range(5):
        pipeline.take(step)
        sends.append(pipeline.samples_with(step + 1, 5, False))
        pipeline.fill(step + 1, 5, _scored)
    assert sends == [True, True, False, False, False]
    assert pipeline.samples_with(5, 5, True)
    assert not RolloutPipeline(2, torch.device("cpu")).samples_with(0, 0, False)


def test_validate_takes_async_agentic_episodes_as_single_turn_ones(tmp_path, monkeypatch, capsys):
    from tunelab.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNELAB_DEBUG", raising=False)

    def validate(config: str, *overrides: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as info:
            main(["validate", config, f"output_dir={tmp_path}/out", f"model.path={TINY}",
                  *overrides])  # fmt: skip
        return info.value.code, capsys.readouterr().err

    # Episodes colocated, on the sampling thread and on rollout ranks, as completions.
    for config in ("tiny/agentic_grpo", "tiny/grpo"):
        for extra in ((), ("rollout.overlap=true",), ("rollout.ranks=1",)):
            code, err = validate(config, "rollout.mode=async", *extra)
            assert code == 0, (config, extra, err)
    # What single-turn refuses, agentic refuses alike: refills on the sampling thread (their
    # rounds agree over a collective), the thread in sync mode.
    refill = ("rollout.dynamic_sampling=true", "rollout.dynamic_sampling_refill_rounds=1")
    for config in ("tiny/agentic_grpo", "tiny/grpo"):
        code, err = validate(config, "rollout.mode=async", "rollout.overlap=true", *refill)
        assert code == 1 and "key 'rollout.overlap': refill rounds agree" in err, err
        code, err = validate(config, "rollout.overlap=true")
        assert code == 1 and "key 'rollout.overlap'" in err and "Traceback" not in err, err
        code, err = validate(config, "rollout.mode=async", "rollout.ranks=1", *refill)
        assert code == 0, err
    code, err = validate("tiny/grpo", "rollout.max_lag=2")
    assert code == 1, err
    assert "key 'rollout.max_lag': 2 is read only with rollout.mode: async" in err, err


def test_the_lag_histogram_follows_the_schedule_across_epochs():
    # k = 2, 4 steps per epoch: lags 0, 1, 2, 2 in each epoch (the pipeline restarts).
    assert lag_histogram(6, 2, 4) == {
        "off_policy/lag_histogram/0": 2.0,
        "off_policy/lag_histogram/1": 2.0,
        "off_policy/lag_histogram/2": 2.0,
    }
    assert lag_histogram(3, 0, 4) == {"off_policy/lag_histogram/0": 3.0}


def test_rank_split_refusals(tmp_path, monkeypatch, capsys):
    from tunelab.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNELAB_DEBUG", raising=False)
    refused = {
        "rollout.ranks=1": "key 'rollout.ranks': 1 rollout ranks sample ahead of training: set "
        "rollout.mode: async",
        # The sampling thread: colocated async only, and no refill rounds (a collective).
        "rollout.overlap=true": "key 'rollout.overlap': samples on a worker thread beside "
        "training in the colocated asynchronous run; set rollout.mode: async and rollout.ranks: 0",
        "rollout.overlap=true rollout.mode=async rollout.ranks=1": "key 'rollout.overlap'",
        "rollout.overlap=true rollout.mode=async rollout.dynamic_sampling=true "
        "rollout.dynamic_sampling_refill_rounds=1": "key 'rollout.overlap': refill rounds agree "
        "over a collective",
    }
    for overrides, message in refused.items():
        with pytest.raises(SystemExit) as info:
            main(["validate", "tiny/grpo", f"output_dir={tmp_path}/out", *overrides.split()])
        err = capsys.readouterr().err
        assert info.value.code == 1 and message in err and "Traceback" not in err, err
    # Refill rounds run on the rollout ranks.
    refills = ("rollout.ranks=1 rollout.mode=async rollout.dynamic_sampling=true "
               "rollout.dynamic_sampling_refill_rounds=1")  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(["validate", "tiny/grpo", f"output_dir={tmp_path}/out", *refills.split()])
    assert info.value.code == 0, capsys.readouterr().err
    # At launch: fewer trainers than rollout ranks.
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="2 rollout ranks need at least as many trainer ranks"):
        split_ranks(2, timeout_s=10)
    assert split_ranks(0, timeout_s=10) is None
