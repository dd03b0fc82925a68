"""Preference pairs compute their shared prompt once, and equal the per-row forward.

A preference micro-batch holds each pair's chosen and rejected rows, which begin with the same
prompt. ``policy_forward`` (DPO, ORPO, SimPO, the reference pass of KTO) and ``pair_rewards``
(the reward model) and ``kto_forward`` run each prompt once (``tunelab.training.shared_prompts``): their log-probs,
scores and LoRA gradients equal the per-row forward's within 1e-6 (fp32; gradients relative to
their norm), with prompts and answers of different lengths.
"""

import pytest
import torch

from tunelab.config.lora import LoRAArgs
from tunelab.data import padded_collate_dpo
from tunelab.losses import sequence_logps
from tunelab.models.args import ModelArgs
from tunelab.models.classifier import SequenceClassifier, sequence_scores
from tunelab.models.decoder import TransformerDecoder
from tunelab.peft import apply_lora
from tunelab.training import output_layer, policy_forward, reward_model
from tunelab.training.kto import completion_forward, kto_forward, mismatched_logps
from tunelab.training.loop import forward
from tunelab.training.reward_model import pair_rewards
from tunelab.training.shared_prompts import shared_prompt_forward

TOLERANCE = 1e-6
PAD = 0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]


def lora_model(cls: type = TransformerDecoder) -> torch.nn.Module:
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=97, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_dim=96, head_dim=16, max_seq_len=128,
    )  # fmt: skip
    model = cls(args)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.3)
    apply_lora(model, LoRAArgs(rank=4, alpha=8.0, targets=TARGETS))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)
    return model


def pair_batch(last_labelled: bool = True) -> dict[str, torch.Tensor]:
    """Four pairs: prompts of 5, 9, 2 and 6 tokens; answers of 2 to 7 tokens on each side."""
    generator = torch.Generator().manual_seed(1)
    items = []
    for index, length in enumerate((5, 9, 2, 6)):
        prompt = torch.randint(3, 97, (length,), generator=generator).tolist()
        item = {}
        for side, size in (("chosen", 2 + index), ("rejected", 7 - index)):
            answer = torch.randint(3, 97, (size,), generator=generator).tolist()
            labels = [-100] * length + answer
            if not last_labelled:
                labels[-1] = -100  # an unlabelled end-of-turn token after the answer
            item[f"{side}_tokens"] = prompt + answer
            item[f"{side}_labels"] = labels
        items.append(item)
    return padded_collate_dpo(items, pad_id=PAD)


def backward_grads(model, value: torch.Tensor) -> dict[str, torch.Tensor]:
    weights = torch.linspace(-1.0, 2.0, value.numel()).view_as(value)
    (value * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def assert_grads_close(shared: dict, alone: dict, count: int) -> None:
    assert shared.keys() == alone.keys() and len(alone) == count
    for name, grad in alone.items():
        # fp32 sums over the tokens in another order: 1e-6 of the gradient's norm.
        error = (shared[name] - grad).norm() / grad.norm()
        assert error < TOLERANCE, (name, error)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "logits"])
def test_policy_forward_of_pairs_equals_the_per_row_forward(chunked):
    model = lora_model()
    batch = pair_batch()
    output = output_layer(model) if chunked else None
    assert shared_prompt_forward(model, batch, return_hidden=chunked) is not None
    shared = policy_forward(model, batch, output=output)
    shared_grads = backward_grads(model, torch.cat([shared.chosen_logps, shared.rejected_logps]))
    logps, lengths, _ = sequence_logps(
        forward(model, batch, output), batch["labels"], output=output
    )
    alone_grads = backward_grads(model, logps)
    torch.testing.assert_close(
        torch.cat([shared.chosen_logps, shared.rejected_logps]).detach(),
        logps.detach(),
        rtol=0,
        atol=TOLERANCE * logps.abs().max().item(),
    )
    assert torch.equal(torch.cat([shared.chosen_lengths, shared.rejected_lengths]), lengths)
    assert_grads_close(shared_grads, alone_grads, count=20)


@pytest.mark.parametrize("last_labelled", [True, False], ids=["last-labelled", "end-of-turn"])
def test_reward_scores_of_pairs_equal_the_per_row_scores(last_labelled):
    model = lora_model(SequenceClassifier)
    model.score.weight.requires_grad_(True)  # the head trains whole, as in the recipe
    batch = pair_batch(last_labelled)
    outputs = []  # what the real shared forward returned (None: the per-row path ran)

    def recorded(*args, **kwargs):
        outputs.append(shared_prompt_forward(*args, **kwargs))
        return outputs[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reward_model, "shared_prompt_forward", recorded)
        chosen, rejected = pair_rewards(model, batch, PAD)
    assert outputs[0] is not None  # prompts shared, an unlabelled last token or not
    shared_grads = backward_grads(model, torch.cat([chosen, rejected]))
    scores = sequence_scores(model, batch["tokens"], PAD)
    alone_grads = backward_grads(model, scores)
    torch.testing.assert_close(
        torch.cat([chosen, rejected]).detach(), scores.detach(), rtol=0, atol=TOLERANCE
    )
    # The LoRA pairs of the five targets in both layers, and the head.
    assert_grads_close(shared_grads, alone_grads, count=20 + 1)


def test_kto_forward_equals_the_completion_and_mismatched_forwards():
    model = lora_model()
    batch = pair_batch()  # a KTO batch's layout: completions, then their mismatched pairs
    (logps, lengths, _), mismatched = kto_forward(model, batch)
    shared_grads = backward_grads(model, logps)
    alone_logps, alone_lengths, _ = completion_forward(model, batch)
    alone_grads = backward_grads(model, alone_logps)
    (alone_mismatched,) = mismatched_logps(model, [batch])
    rows = len(logps)
    per_row, _, _ = sequence_logps(model(batch["tokens"]), batch["labels"])
    scale = per_row.abs().max().item()
    torch.testing.assert_close(logps.detach(), alone_logps.detach(), rtol=0, atol=TOLERANCE * scale)
    torch.testing.assert_close(mismatched, per_row[rows:].detach(), rtol=0, atol=TOLERANCE * scale)
    assert torch.equal(mismatched, alone_mismatched)  # the same shared forward, bit for bit
    assert not mismatched.requires_grad and torch.equal(lengths, alone_lengths)
    assert_grads_close(shared_grads, alone_grads, count=20)
