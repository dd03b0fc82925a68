import json
import random

import torch

from tunelab.checkpoint.state import gather_rng_states, restore_rng_states, to_json


def test_rng_round_trip_through_json_restores_the_same_draws():
    random.seed(1)
    torch.manual_seed(1)
    states = json.loads(to_json({"rng": gather_rng_states()}))["rng"]
    expected = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    assert restore_rng_states(states)
    assert random.random() == expected[0]
    assert torch.equal(torch.rand(3), expected[1])


def test_rng_states_of_another_world_size_are_not_applied():
    states = gather_rng_states() * 2  # as if saved by two ranks
    torch.manual_seed(5)
    before = torch.get_rng_state()
    assert not restore_rng_states(states)
    assert torch.equal(torch.get_rng_state(), before)


def test_to_json_turns_tuples_and_tensors_into_lists():
    data = json.loads(to_json({"betas": (0.9, 0.95), "t": torch.tensor([1, 2])}))
    assert data == {"betas": [0.9, 0.95], "t": [1, 2]}
