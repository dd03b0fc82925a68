"""Reward metrics summed as exact limbs: the same total in any grouping (tunelab.rl.step)."""

import math

import torch

from tunelab.rl import exact_parts, exact_total, global_sums


def _grouped(values: torch.Tensor, groups: list[list[int]]) -> dict[str, float]:
    # Each group's limbs, then the groups added in turn (micro-batches, then ranks).
    sums: dict[str, float] = {}
    for group in groups:
        for key, value in exact_parts("reward", values[group]).items():
            sums[key] = sums.get(key, 0.0) + value
    return sums


def test_limb_sums_are_the_same_in_every_grouping_where_float_sums_are_not():
    generator = torch.Generator().manual_seed(0)
    values = (torch.randn(64, generator=generator, dtype=torch.float64) * 10.0) ** 3 / 7.0
    values[::5] = torch.tensor([0.1, -0.3, 1e-9, 123456.789, -2.5e-20, 0.7, 1 / 3] * 2)[:13]
    orders = [
        [list(range(64))],  # one process, one micro-batch
        [list(range(0, 32)), list(range(32, 64))],  # one process, two micro-batches
        [list(range(0, 64, 2)), list(range(1, 64, 2))],  # two processes, strided
        [list(range(i, 64, 4)) for i in (3, 1, 2, 0)],  # four, in another order
    ]
    totals = [exact_total(_grouped(values, groups), "reward") for groups in orders]
    assert len(set(totals)) == 1
    # The correctly rounded sum of the values (what is dropped, below 2**-60 each, is below
    # this sum's rounding).
    assert totals[0] == math.fsum(values.tolist())
    plain = {sum(float(values[g].sum()) for g in groups) for groups in orders}
    assert len(plain) > 1  # plain float sums differ with the grouping: the reason for limbs


def test_global_sums_returns_limbs_as_their_total_and_other_keys_as_they_are():
    values = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    sums = {"count": 3.0} | exact_parts("reward", values) | exact_parts("rewards/x", -values)
    totals = global_sums(sums, torch.device("cpu"))
    assert totals == {
        "count": 3.0,
        "reward": math.fsum([0.1, 0.2, 0.3]),
        "rewards/x": -math.fsum([0.1, 0.2, 0.3]),
    }
