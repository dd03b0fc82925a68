"""StatefulDistributedSampler: per-step equivalence across world sizes and exact resume."""

import pytest
import torch
from torch.utils.data import DataLoader

from tunelab.data import StatefulDistributedSampler
from tunelab.errors import ConfigError

N = 23


def samplers(world_size, **kwargs):
    return [
        StatefulDistributedSampler(N, num_replicas=world_size, rank=r, seed=3, **kwargs)
        for r in range(world_size)
    ]


def global_steps(world_size, micro_batch, num_steps, state=None):
    """Run ``num_steps`` optimizer steps; return the sorted samples of each, and the states."""
    ranks = samplers(world_size)
    if state is not None:
        for sampler in ranks:
            sampler.load_state_dict(state)
    iterators = [iter(sampler) for sampler in ranks]
    steps = []
    for _ in range(num_steps):
        step = []
        for it in iterators:
            step += [next(it) for _ in range(micro_batch)]
        for sampler in ranks:
            assert sampler.samples_per_step(micro_batch) == micro_batch * world_size
            sampler.advance(micro_batch)
        steps.append(sorted(step))
    return steps, ranks[0].state_dict()


def test_permutation_is_seeded_by_seed_and_epoch():
    (sampler,) = samplers(1)
    expected = torch.randperm(N, generator=torch.Generator().manual_seed(3)).tolist()
    assert list(sampler) == expected and len(sampler) == N
    sampler.set_epoch(1)
    assert list(sampler) == torch.randperm(N, generator=torch.Generator().manual_seed(4)).tolist()
    (ordered,) = samplers(1, shuffle=False)
    assert list(ordered) == list(range(N))


def test_ranks_stride_the_global_order_and_drop_the_tail():
    perm = list(samplers(1)[0])
    ranks = samplers(4)
    # 23 samples over 4 ranks: 5 each, the last 3 dropped so every rank yields the same count.
    assert [list(s) for s in ranks] == [perm[r:20:4] for r in range(4)]
    assert all(len(s) == 5 for s in ranks)


@pytest.mark.parametrize("world_size", [2, 4])
def test_union_over_ranks_of_a_step_equals_the_single_process_step(world_size):
    global_batch = 4
    single, _ = global_steps(1, global_batch, 5)
    multi, _ = global_steps(world_size, global_batch // world_size, 5)
    assert multi == single
    assert len({i for step in single for i in step}) == 20  # no sample used twice


@pytest.mark.parametrize(("save_world", "resume_world"), [(2, 2), (2, 1), (1, 4), (4, 2)])
def test_resume_mid_epoch_at_any_world_size(save_world, resume_world):
    global_batch = 4
    uninterrupted, _ = global_steps(1, global_batch, 5)
    first, state = global_steps(save_world, global_batch // save_world, 2)
    assert state == {"epoch": 0, "consumed": 8, "seed": 3}
    rest, end_state = global_steps(resume_world, global_batch // resume_world, 3, state=state)
    assert first + rest == uninterrupted
    assert end_state["consumed"] == 20


def test_set_epoch_keeps_a_restored_position_and_resets_on_a_new_epoch():
    (sampler,) = samplers(1)
    sampler.load_state_dict({"epoch": 2, "consumed": 6, "seed": 3})
    sampler.set_epoch(2)  # the recipe's epoch loop restarts at the restored epoch
    assert sampler.consumed == 6 and len(sampler) == N - 6
    full = torch.randperm(N, generator=torch.Generator().manual_seed(5)).tolist()
    assert list(sampler) == full[6:]
    sampler.set_epoch(3)
    assert sampler.consumed == 0 and len(sampler) == N


def test_dataloader_resumes_mid_epoch():
    (sampler,) = samplers(1)
    loader = DataLoader(list(range(100, 100 + N)), batch_size=3, sampler=sampler)
    batches = [b.tolist() for b in loader]
    (fresh,) = samplers(1)
    fresh.load_state_dict({"epoch": 0, "consumed": 6, "seed": 3})
    resumed = [
        b.tolist() for b in DataLoader(list(range(100, 100 + N)), batch_size=3, sampler=fresh)
    ]
    assert resumed == batches[2:]
    # advance during iteration moves the saved position, not the running iterator
    it = iter(sampler)
    next(it)
    sampler.advance(3)
    assert len(list(it)) == N - 1 and sampler.state_dict()["consumed"] == 3


def test_load_state_dict_takes_the_saved_seed(caplog):
    (sampler,) = samplers(1)
    with caplog.at_level("WARNING"):
        sampler.load_state_dict({"epoch": 0, "consumed": 0, "seed": 9})
    assert sampler.seed == 9 and "data seed 9" in caplog.text


def test_bad_arguments():
    with pytest.raises(ConfigError, match="0 <= rank < num_replicas"):
        StatefulDistributedSampler(10, num_replicas=2, rank=2)
    (sampler,) = samplers(1)
    with pytest.raises(ConfigError, match="missing consumed"):
        sampler.load_state_dict({"epoch": 0, "seed": 3})
    with pytest.raises(ConfigError, match="consumed=30 but the dataset has 23 items"):
        sampler.load_state_dict({"epoch": 0, "consumed": 30, "seed": 3})
