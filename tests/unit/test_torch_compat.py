"""The private torch APIs in tunelab._torch_compat, run on the installed torch."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from tunelab._torch_compat import (
    TORCH_SUPPORTED,
    check_torch_version,
    checkpoint_activations,
    local_shape_and_global_offset,
)


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.14.1+cu128", "2.20.0a0+git1234"])
def test_supported_versions_pass(version):
    check_torch_version(version)


@pytest.mark.parametrize("version", ["2.12.1", "2.6.0+cu124", "3.0.0"])
def test_other_versions_are_refused_with_the_range(version):
    low, high = TORCH_SUPPORTED
    expected = rf"torch>={low[0]}\.{low[1]},<{high[0]}.*{re.escape(version)}"
    with pytest.raises(ImportError, match=expected):
        check_torch_version(version)


def test_range_matches_pyproject():
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    low, high = TORCH_SUPPORTED
    assert f'"torch>={low[0]}.{low[1]},<{high[0]}"' in pyproject


def test_local_shape_and_global_offset(world_of_one):
    tensor = distribute_tensor(torch.arange(12.0).reshape(4, 3), world_of_one, [Shard(0)])
    assert local_shape_and_global_offset(tensor) == ((4, 3), (0, 0))


def test_checkpoint_activations_keeps_names_and_gradients():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    checkpointed = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    checkpointed.load_state_dict(reference.state_dict())
    assert checkpoint_activations(checkpointed) is checkpointed
    assert list(checkpointed.state_dict()) == list(reference.state_dict())
    inputs = torch.randn(3, 4)
    reference(inputs).square().sum().backward()
    checkpointed(inputs).square().sum().backward()
    for expected, actual in zip(reference.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(actual.grad, expected.grad)
