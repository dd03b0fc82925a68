"""The log-prob pass with each distinct prompt computed once equals the per-row pass.

A GRPO micro-batch repeats each prompt ``num_generations`` times; the shared forward runs it
once and its rows attend to its keys and values. Log-probs and LoRA gradients match the per-row
forward's within 1e-6 (fp32; gradients relative to their norm), with prompts and completions of different lengths.
"""

import pytest
import torch

from tunelab.config.lora import LoRAArgs
from tunelab.losses import token_logps
from tunelab.models.args import ModelArgs
from tunelab.models.decoder import TransformerDecoder
from tunelab.peft import apply_lora
from tunelab.rl import rollout_batch
from tunelab.rl.step import completion_logps
from tunelab.training import output_layer
from tunelab.training.loop import forward
from tunelab.training.shared_prompts import shared_prompt_forward

TOLERANCE = 1e-6


def lora_model(num_kv_heads: int, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=97, dim=64, num_layers=2, num_heads=4, num_kv_heads=num_kv_heads,
        intermediate_dim=96, head_dim=16, max_seq_len=128, **options,
    )  # fmt: skip
    model = TransformerDecoder(args)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.3)
    apply_lora(
        model,
        LoRAArgs(rank=4, alpha=8.0, targets=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]),
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)
    return model


def group_batch(num_generations: int = 4) -> dict[str, torch.Tensor]:
    """Three prompts of lengths 5, 9, 2, each with completions of lengths 1..7 (shuffled rows)."""
    generator = torch.Generator().manual_seed(1)
    prompts, completions = [], []
    for length in (5, 9, 2):
        prompt = torch.randint(3, 97, (length,), generator=generator).tolist()
        for sample in range(num_generations):
            size = 1 + (length + 2 * sample) % 7
            prompts.append(prompt)
            completions.append(torch.randint(3, 97, (size,), generator=generator).tolist())
    order = torch.randperm(len(prompts), generator=generator).tolist()
    return rollout_batch(
        [prompts[i] for i in order], [completions[i] for i in order], 0, torch.device("cpu")
    )


def logps_and_grads(model, batch, output, shared: bool):
    model.zero_grad()
    if shared:
        logps, mask = completion_logps(model, batch, output)
    else:
        logps, mask = token_logps(forward(model, batch, output), batch["labels"], output=output)
    weights = torch.linspace(-1.0, 2.0, logps.numel()).view_as(logps)
    (logps * weights * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), mask, grads


@pytest.mark.parametrize("num_kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "logits"])
def test_shared_prompt_logps_and_gradients_equal_the_per_row_ones(num_kv_heads, chunked):
    model = lora_model(num_kv_heads)
    batch = group_batch()
    output = output_layer(model) if chunked else None
    assert shared_prompt_forward(model, batch, return_hidden=chunked) is not None
    shared, mask, shared_grads = logps_and_grads(model, batch, output, shared=True)
    alone, alone_mask, alone_grads = logps_and_grads(model, batch, output, shared=False)
    assert torch.equal(mask, alone_mask)
    assert mask.sum() == batch["labels"].ne(-100).sum()
    torch.testing.assert_close(shared, alone, rtol=0, atol=TOLERANCE)
    assert shared_grads.keys() == alone_grads.keys() and len(shared_grads) == 20
    for name, grad in alone_grads.items():
        # fp32 sums of hundreds of tokens' terms in another order: 1e-6 of the gradient's norm.
        error = (shared_grads[name] - grad).norm() / grad.norm()
        assert error < TOLERANCE, (name, error)


def test_rows_without_a_shared_prompt_and_sliding_window_models_take_the_per_row_forward():
    model = lora_model(2)
    batch = group_batch(num_generations=1)
    assert shared_prompt_forward(model, batch, return_hidden=True) is None
    sliding = lora_model(2, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    assert shared_prompt_forward(sliding, group_batch(), return_hidden=True) is None
