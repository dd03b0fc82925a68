"""Run under torchrun: the context-parallel forward and backward against the unsplit one.

Every process builds the same tiny model (seeded) and runs its slice of the rows split over all
processes (zig-zag slices, keys and values gathered in attention); rank 0 also runs the rows
whole, as one process without context parallelism would (the other ranks would only repeat
it), and prints one JSON line per case with the largest differences: the logits gathered back into rows, the mean token loss (losses and target counts
summed over ranks), and every parameter's gradient of that mean loss summed over ranks (what
FSDP's reduction does); then, for ``flex``, the logits of a forward (torch 2.13 has no
FlexAttention backward on CPU).
"""

import json
import warnings

import torch
import torch.distributed as dist

from tunelab.distributed import build_context_parallel
from tunelab.losses import CrossEntropyLoss
from tunelab.models import ModelArgs, TransformerDecoder
from tunelab.modules.masks import positions_from_document_ids
from tunelab.training.loop import batch_loss, output_layer

# Rows of 301 tokens (not a multiple of 2 x processes: the split pads them), packed with
# documents that cross the zig-zag chunk boundaries; windows of 64 keys cross them too.
_LENGTHS = [[100, 150, 51], [40, 200, 61]]
_FAMILIES = {
    "gqa": {},
    "window_softcap": dict(
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcap=20.0,
    ),
    "window_sinks": dict(
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        attention_sinks=True,
    ),
    # Phi-3's LongRoPE picks its factors from the rows' largest position: unpacked rows reach
    # 300 > 250, yet on 2 ranks the one holding chunks 1 and 2 sees at most 227.
    "longrope": dict(
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.2, 1.3],
            "long_factor": [2.0, 3.0, 4.0, 5.0],
            "original_max_position_embeddings": 250,
            "factor": 2.0,
        },
        max_seq_len=500,
    ),
}


def _model(family: str, backend: str) -> TransformerDecoder:
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_dim=64,
        **_FAMILIES[family],
    )  # fmt: skip
    model = TransformerDecoder(args)
    with torch.no_grad():
        for layer in model.layers:
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    model.attention_backend = backend
    return model


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    seq_len = sum(_LENGTHS[0])
    tokens = torch.randint(3, 97, (2, seq_len), generator=generator)
    labels = tokens.clone()
    labels[:, :20] = -100  # a prompt: no targets there
    batch = {"tokens": tokens, "labels": labels, "token_mask": torch.ones_like(tokens, dtype=bool)}
    if packed:
        ids = torch.stack(
            [torch.repeat_interleave(torch.arange(3), torch.tensor(row)) for row in _LENGTHS]
        )
        batch["document_ids"] = ids
        batch["input_pos"] = positions_from_document_ids(ids)
    return batch


def _grads(model: TransformerDecoder) -> dict[str, torch.Tensor]:
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def main() -> None:
    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    dist.init_process_group("gloo")
    context = build_context_parallel(dist.get_world_size())
    loss_fn = CrossEntropyLoss()
    cases = [
        (family, backend, packed, chunked)
        for family in _FAMILIES
        for backend in ("sdpa", "dense")
        for packed in (True, False)
        for chunked in (True, False)
        if chunked or (backend == "sdpa" and packed)
    ]
    for family, backend, packed, chunked in cases:
        model = _model(family, backend)
        output = output_layer(model) if chunked else None
        batch = _batch(packed)

        # Whole rows, no context parallelism: rank 0's reference; every rank divides by its
        # target count (the mean token loss, as the recipes normalise it).
        count = torch.zeros((), dtype=torch.int64)
        if dist.get_rank() == 0:
            loss, whole_count = batch_loss(loss_fn, model, batch, output)
            (loss / whole_count).backward()
            expected_grads = _grads(model)
            with torch.no_grad():
                expected_logits = model(
                    batch["tokens"],
                    document_ids=batch.get("document_ids"),
                    input_pos=batch.get("input_pos"),
                )
            model.zero_grad()
            count.copy_(whole_count)
        dist.broadcast(count, 0)

        # This rank's slice.
        local = context.shard(batch)
        split_loss, split_count = batch_loss(loss_fn, model, local, output, context=context)
        (split_loss / count).backward()
        totals = torch.stack([split_loss.detach().double(), split_count.double()])
        dist.all_reduce(totals)
        grads = _grads(model)
        for grad in grads.values():
            dist.all_reduce(grad)
        with torch.no_grad():
            local_logits = model(
                local["tokens"],
                document_ids=local.get("document_ids"),
                input_pos=local["input_pos"],
                context_parallel=context,
            )
            logits = context.gather(local_logits, dim=1)[:, : batch["tokens"].shape[1]]
        if dist.get_rank() != 0:
            continue
        result = {
            "case": f"{family}-{backend}-{'packed' if packed else 'unpacked'}"
            + ("-chunked" if chunked else "-logits"),
            "logits": (logits - expected_logits).abs().max().item(),
            "loss": abs(totals[0].item() / count.item() - loss.item() / count.item()),
            "count": abs(totals[1].item() - count.item()),
            "grads": max((grads[n] - g).abs().max().item() for n, g in expected_grads.items()),
            "grad_scale": max(g.abs().max().item() for g in expected_grads.values()),
        }
        print(json.dumps(result), flush=True)
    # flex: the forward only (torch 2.13 has no FlexAttention backward on CPU), eager.
    for family in _FAMILIES:
        for packed in (True, False):
            batch = _batch(packed)
            with torch.no_grad():
                model = _model(family, "sdpa")
                if dist.get_rank() == 0:
                    expected_logits = model(
                        batch["tokens"],
                        document_ids=batch.get("document_ids"),
                        input_pos=batch.get("input_pos"),
                    )
                model.attention_backend = "flex"
                local = context.shard(batch)
                local_logits = model(
                    local["tokens"],
                    document_ids=local.get("document_ids"),
                    input_pos=local["input_pos"],
                    context_parallel=context,
                )
                logits = context.gather(local_logits, dim=1)[:, : batch["tokens"].shape[1]]
            if dist.get_rank() == 0:
                result = {
                    "case": f"{family}-flex-{'packed' if packed else 'unpacked'}-forward",
                    "logits": (logits - expected_logits).abs().max().item(),
                }
                print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
