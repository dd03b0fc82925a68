"""Driven by test_vocab_parallel_loss.py under torchrun (2 processes, gloo).

The chunked target log-probs (``hidden_target_logps``) through an output layer whose
vocabulary is split over the ranks (``OutputLayer.vocab_group``: each rank computes its half of
the logits) against the same layer whole on every rank: log-probs, logit sums, and the
gradients of a weighted sum of the log-probs with respect to the hidden states (each rank's
part, summed over the ranks as the model does) and to the layer's weight (each rank its rows).
Both backward paths: a trainable layer (logits recomputed in the backward) and a frozen one
(hidden-state gradients computed in the forward). Prints one JSON line per case on rank 0, each
difference relative to the reference's largest magnitude, with every collective the split
forward and backward ran and the most values any one of them carried (no rank gathers the
vocabulary: one value per scored position at most).

Usage: vocab_parallel_script.py
"""

import json
from contextlib import contextmanager

import torch
import torch.distributed as dist

from tunelab.losses._token_logps import OutputLayer, hidden_target_logps

VOCAB, DIM = 64, 16
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single")  # fmt: skip


@contextmanager
def recorded_collectives(calls: list):
    """Record ``(name, values)`` of every collective ``torch.distributed`` runs meanwhile."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def recording(name):
        def collective(tensor, *args, **kwargs):
            tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
            calls.append((name, max(t.numel() for t in tensors)))
            return originals[name](tensor, *args, **kwargs)

        return collective

    for name in COLLECTIVES:
        setattr(dist, name, recording(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def run(trainable: bool, group: dist.ProcessGroup | None, num_chunks: int) -> dict:
    """Log-probs, logit sums and gradients, the vocabulary split over ``group`` or whole."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, DIM, generator=generator, dtype=torch.float64).float()
    weight = torch.randn(VOCAB, DIM, generator=generator) * 2
    labels = torch.randint(0, VOCAB, (2, 9), generator=generator)
    labels[0, 3] = labels[1, 5] = -100
    weights = torch.rand(2, 8, generator=generator)
    if group is not None:
        part = VOCAB // dist.get_world_size(group)
        rank = dist.get_rank(group)
        weight = weight[rank * part : (rank + 1) * part]
    weight = weight.clone().requires_grad_(trainable)
    hidden.requires_grad_(True)
    output = OutputLayer(lambda h: h @ weight.T, trainable, VOCAB, vocab_group=group)
    calls = []
    with recorded_collectives(calls):
        logps, mask, sums = hidden_target_logps(hidden, output, labels, -100, num_chunks)
        (logps * weights).sum().backward()
    grad_hidden = hidden.grad.clone()
    if group is not None:
        dist.all_reduce(grad_hidden, group=group)  # the model sums the ranks' parts
    return {
        "logps": logps.detach(),
        "sums": sums,
        "grad_hidden": grad_hidden,
        "grad_weight": weight.grad if trainable else None,
        "mask": mask,
        "collectives": calls,
    }


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest difference, relative to the reference's largest magnitude."""
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def main() -> None:
    """Compare every case and print the largest differences."""
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    for trainable in (True, False):
        for num_chunks in (1, 3):
            whole = run(trainable, None, num_chunks)
            split = run(trainable, dist.group.WORLD, num_chunks)
            row = {
                "case": f"trainable={trainable} chunks={num_chunks}",
                "logps": relative(split["logps"], whole["logps"]),
                "sums": relative(split["sums"], whole["sums"]),
                "grad_hidden": relative(split["grad_hidden"], whole["grad_hidden"]),
                "grad_scale": whole["grad_hidden"].abs().max().item(),
                "masked_zero": bool((split["logps"][~split["mask"]] == 0).all()),
                "scored": int(split["mask"].sum()),
                "collectives": sorted({name for name, _ in split["collectives"]}),
                "largest_collective": max(values for _, values in split["collectives"]),
            }
            if trainable:
                part = VOCAB // size
                rows = whole["grad_weight"][rank * part : (rank + 1) * part]
                row["grad_weight"] = relative(split["grad_weight"], rows)
            if rank == 0:
                print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
