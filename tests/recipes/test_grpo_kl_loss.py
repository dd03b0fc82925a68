"""GRPO with a KL term (``beta`` > 0) through the real recipe against an fp64 loss computed here.

A 2-process ``tunelab run`` of tiny/grpo (LoRA, ``beta`` 0.1) takes one step per epoch for two
epochs, so the ``epoch_0`` export holds the policy that sampled and scored step 2, when the
policy has moved away from the reference (the base) and the KL term is not zero. Step 2's loss
is then computed here without tunelab's model or loss: the completions' token ids and rewards
from ``logs/completions.jsonl``, the prompts' token ids from the config's dataset, per-token
log-probs of the merged export (the policy) and of the base (the reference) from
``transformers`` in fp64, group advantages and the clipped objective plus ``beta`` times the k3
KL from the plain loops of ``tests/unit/test_grpo_loss.py`` (written from the papers).
With one iteration per step the ratio is 1, so the loss is ``-A`` per token plus
``beta * k3``, averaged over the step's tokens (``token_mean``): a recipe that dropped the KL
term from its loss (kept the reference and the ``kl`` metric) logs a loss ``beta * kl`` lower.
"""

import json
import math

import pytest
import torch

from tests.recipes.conftest import read_metrics, tunelab_run
from tests.unit.test_grpo_loss import reference_advantages, reference_loss
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow

RECIPE = "grpo_distributed"
BETA = 0.1
OVERRIDES = (
    "schedule.batch_size=2",
    f"loss.beta={BETA}",
    "rollout.num_iterations=1",
    "loss.aggregation=token_mean",
    "rollout.dynamic_sampling=false",
    "rewards.scale=true",
    "schedule.epochs=2",
    "schedule.max_steps_per_epoch=1",
    "checkpoint.save_every_n_steps=null",
)
NUM_GENERATIONS = 4  # tiny/grpo's
# fp32 forwards (tunelab's, sharded) against fp64 ones (transformers'): log-probs agree to
# about 1e-6, and the loss is a mean of such terms.
TOLERANCE = 1e-5


def _completion_logps(model, prompt: list[int], completion: list[int]) -> list[float]:
    """``log p(completion[t] | prompt, completion[:t])`` for each t, fp64."""
    tokens = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(tokens).logits[0].double()
    logps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logps.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def _hf_model(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation="eager"
    ).eval()


def test_loss_with_a_kl_term_equals_the_fp64_reference(tmp_path):
    out = tmp_path / "run"
    tunelab_run(RECIPE, "tiny/grpo", f"output_dir={out}", *OVERRIDES)
    metrics = {row["step"]: row for row in read_metrics(out) if "loss" in row}
    assert metrics[1]["kl"] == 0.0 and metrics[2]["kl"] > 1e-3  # the policy moved at step 1

    lines = (out / "logs" / "completions.jsonl").read_text().splitlines()
    records = sorted(
        (r for r in map(json.loads, lines) if r["step"] == 2),
        key=lambda r: (r["index"], r["sample"]),
    )
    assert len(records) == 4 * NUM_GENERATIONS  # 2 processes x 2 prompts x G
    from tunelab.config import instantiate, load_config

    cfg = load_config("tiny/grpo", list(OVERRIDES))
    prompts = instantiate(cfg.dataset, instantiate(cfg.tokenizer)).tokens
    policy, reference = _hf_model(out / "epoch_0"), _hf_model(assets_dir() / "tiny")
    logps, ref_logps, lengths = [], [], []
    for record in records:
        prompt, completion = list(prompts[record["index"]]), record["completion_ids"]
        logps.append(_completion_logps(policy, prompt, completion))
        ref_logps.append(_completion_logps(reference, prompt, completion))
        lengths.append(len(completion))
    assert sum(lengths) / len(lengths) == pytest.approx(metrics[2]["completion_length"])
    advantages = reference_advantages([r["reward"] for r in records], NUM_GENERATIONS, True)
    expected = reference_loss(
        logps, logps, ref_logps, advantages, lengths,
        cfg.loss.clip_eps_low, cfg.loss.clip_eps_high, BETA, "token_mean", cfg.rollout.max_new_tokens,
    )  # fmt: skip
    # The k3 estimate of KL(policy || reference), per token: e^d - d - 1 with d = ref - policy.
    kl = sum(
        math.expm1(r - p) - (r - p)
        for sequence, ref_sequence in zip(logps, ref_logps, strict=True)
        for p, r in zip(sequence, ref_sequence, strict=True)
    ) / sum(lengths)
    print(f"step 2: loss {metrics[2]['loss']!r} expected {expected!r}; kl {metrics[2]['kl']!r} "
          f"expected {kl!r}")  # fmt: skip
    # The KL term is large against the tolerance: a loss without it cannot pass.
    assert BETA * kl > 100 * TOLERANCE
    assert metrics[2]["kl"] == pytest.approx(kl, abs=TOLERANCE)
    assert metrics[2]["loss"] == pytest.approx(expected, abs=TOLERANCE)
