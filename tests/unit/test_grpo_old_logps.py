"""num_iterations > 1: the sampling policy's log-probs come from the first pass, not a pass of their own."""

import copy
from pathlib import Path

import pytest
import torch

from tests.interop.adapter_checks import randomize_lora_b
from tunelab.config.lora import LoRAArgs
from tunelab.data import load_tokenizer, prompt_dataset
from tunelab.peft import get_adapter_params
from tunelab.rl import GRPOLoss, Rollout, policy_gradient_pass, rollout_batch, store_logps
from tunelab.training import adamw, load_model, output_layer

TINY = Path(__file__).resolve().parents[2] / "framework" / "tunelab" / "assets" / "tiny"


@pytest.fixture(scope="module")
def model_and_rollouts():
    tokenizer = load_tokenizer(str(TINY), max_seq_len=256)
    data = prompt_dataset(
        tokenizer, source="json", data_files=str(TINY / "grpo_prompts.jsonl"), template="instruct"
    )
    torch.manual_seed(0)
    model = load_model(
        str(TINY), device=torch.device("cpu"), dtype=torch.float32, lora=LoRAArgs(rank=4, alpha=8)
    )
    randomize_lora_b(model)
    generator = torch.Generator().manual_seed(0)
    rollouts = []
    for first in (0, 4):  # two micro-batches, as with gradient accumulation
        prompts = [data.tokens[first + i] for i in range(4)]
        completions = [
            torch.randint(3, 800, (5 + i,), generator=generator).tolist() for i in range(4)
        ]
        rollouts.append(
            Rollout(
                rollout_batch(prompts, completions, tokenizer.pad_id, torch.device("cpu")),
                advantages=torch.tensor([1.0, -0.5, 0.25, -0.75]),
                keep=torch.ones(4, dtype=torch.bool),
            )
        )
    return model, rollouts


def two_iterations(model, rollouts, *, separate_pass: bool):
    """Two optimizer steps over the rollouts, the old log-probs stored one way or the other:
    each pass's sums, and the stored log-probs."""
    model = copy.deepcopy(model)
    rollouts = copy.deepcopy(rollouts)
    trainable = list(get_adapter_params(model).values())
    optimizer = adamw(trainable, lr=1e-2, weight_decay=0.0)
    output = output_layer(model)
    loss_fn = GRPOLoss(clip_eps_low=0.2, clip_eps_high=0.2, aggregation="token_mean")
    if separate_pass:
        store_logps(rollouts, model, output, old=True)
        stored = [r.old_logps.clone() for r in rollouts]
    sums = []
    for iteration in range(2):
        sums.append(
            policy_gradient_pass(
                model,
                rollouts,
                loss_fn,
                output,
                scale=0.1,
                keep_old=iteration == 0 and not separate_pass,
            )
        )
        if iteration == 0 and not separate_pass:
            stored = [r.old_logps.clone() for r in rollouts]
        optimizer.step()
        optimizer.zero_grad()
    # The stored log-probs are those of the sampling policy, unchanged by the updates.
    assert all(torch.equal(a, r.old_logps) for a, r in zip(stored, rollouts, strict=True))
    return sums, stored


def test_first_pass_keeps_the_sampling_policys_logps_for_the_next(model_and_rollouts):
    model, rollouts = model_and_rollouts
    separate, separate_logps = two_iterations(model, rollouts, separate_pass=True)
    kept, kept_logps = two_iterations(model, rollouts, separate_pass=False)
    # The first pass's log-probs are the ones the no-grad pass computes, bit for bit.
    for a, b in zip(kept_logps, separate_logps, strict=True):
        assert not a.requires_grad
        assert torch.equal(a, b)
    # So both give the same two passes: ratio 1 in the first, off 1 (clipped) in the second.
    assert kept == separate
    assert kept[0]["clipped"] == 0 and kept[1]["clipped"] > 0


def test_one_iteration_stores_nothing(model_and_rollouts):
    model, rollouts = model_and_rollouts
    rollouts = copy.deepcopy(rollouts)
    output = output_layer(model)
    loss_fn = GRPOLoss(aggregation="token_mean")
    policy_gradient_pass(model, rollouts, loss_fn, output, scale=0.1)
    assert all(r.old_logps is None for r in rollouts)
    model.zero_grad()
