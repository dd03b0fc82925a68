"""Preference metrics as sums, and their global reduction over ranks."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tunelab.errors import TunelabError
from tunelab.losses import accumulate_metrics, preference_metrics, reduce_metrics
from tunelab.losses.metrics import COUNT_KEY

NAMES = {
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
}


def _metrics(rank: int) -> dict:
    """Rank 0 holds two pairs, rank 1 one pair: the global mean is not the mean of means."""
    if rank == 0:
        return preference_metrics(
            torch.tensor([0.5, -0.25]),
            torch.tensor([0.25, 0.0]),
            torch.tensor([-10.0, -20.0]),
            torch.tensor([-12.0, -18.0]),
            torch.tensor([1.5, 2.5]),
            torch.tensor([0.5, 1.0]),
        )
    return preference_metrics(
        torch.tensor([1.0]),
        torch.tensor([2.0]),
        torch.tensor([-30.0]),
        torch.tensor([-6.0]),
        torch.tensor([5.0]),
        torch.tensor([-2.0]),
    )


# Global means over the three pairs, by hand.
EXPECTED = {
    "rewards/chosen": (0.5 - 0.25 + 1.0) / 3,
    "rewards/rejected": (0.25 + 0.0 + 2.0) / 3,
    "rewards/accuracies": (1 + 0 + 0) / 3,
    "rewards/margins": (0.25 - 0.25 - 1.0) / 3,
    "logps/chosen": (-10 - 20 - 30) / 3,
    "logps/rejected": (-12 - 18 - 6) / 3,
    "logits/chosen": (1.5 + 2.5 + 5.0) / 3,
    "logits/rejected": (0.5 + 1.0 - 2.0) / 3,
}


def test_preference_metrics_are_detached_sums_with_a_count():
    chosen = torch.tensor([0.5, -0.25], requires_grad=True)
    sums = preference_metrics(
        chosen,
        torch.tensor([0.25, 0.0]),
        torch.tensor([-10.0, -20.0]),
        torch.tensor([-12.0, -18.0]),
        torch.tensor([1.5, 2.5]),
        torch.tensor([0.5, 1.0]),
    )
    assert set(sums) == NAMES | {COUNT_KEY}
    assert sums[COUNT_KEY].item() == 2
    assert sums["rewards/accuracies"].item() == 1  # 0.5 > 0.25, -0.25 is not > 0
    assert sums["rewards/margins"].item() == pytest.approx(0.0)
    assert sums["logps/chosen"].item() == -30.0
    assert not any(value.requires_grad for value in sums.values())


def test_accumulate_then_reduce_without_process_group_gives_global_mean():
    total = accumulate_metrics(None, _metrics(0))
    total = accumulate_metrics(total, _metrics(1))
    means = reduce_metrics(total, total[COUNT_KEY])
    assert set(means) == NAMES
    for name, value in EXPECTED.items():
        assert means[name] == pytest.approx(value, abs=1e-12), name


def test_reduce_metrics_plain_numbers_and_zero_count():
    assert reduce_metrics({"loss": 6.0}, 4) == {"loss": 1.5}
    with pytest.raises(TunelabError, match="count of 0"):
        reduce_metrics({"loss": torch.tensor(0.0)}, torch.tensor(0))


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        sums = _metrics(rank)
        means = reduce_metrics(sums, sums[COUNT_KEY])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(means, handle)
        dist.barrier()  # tear down only once both ranks are done
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_reduce_metrics_two_process_gloo(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert results[0] == results[1]
    for name, value in EXPECTED.items():
        assert results[0][name] == pytest.approx(value, abs=1e-12), name
    # A mean of per-rank means would give (0.125 + 1.0) / 2 for rewards/chosen instead.
    assert results[0]["rewards/chosen"] != pytest.approx((0.125 + 1.0) / 2)
