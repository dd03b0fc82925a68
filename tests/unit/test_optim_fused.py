"""``adamw``: fused by default where the kernel exists; the same steps and checkpoints as foreach."""

import copy

import pytest
import torch

from tunelab.training import adamw


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(8, 32), (32, 8), (5,)]
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _steps(optimizer: torch.optim.Optimizer, params, first: int, count: int) -> None:
    for step in range(first, first + count):
        generator = torch.Generator().manual_seed(100 + step)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


def _is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer.param_groups[0].get("fused"))


def test_default_is_fused_on_cpu_and_steps_equal_foreach():
    fused_params, foreach_params = _params(), _params()
    fused = adamw(fused_params, lr=1e-2, weight_decay=0.1)
    foreach = adamw(foreach_params, lr=1e-2, weight_decay=0.1, fused=False)
    assert _is_fused(fused) and not _is_fused(foreach)
    _steps(fused, fused_params, 0, 5)
    _steps(foreach, foreach_params, 0, 5)
    for got, want, start in zip(fused_params, foreach_params, _params(), strict=True):
        assert not torch.allclose(got, start)  # the steps moved the weights
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("save_fused", [False, True])
def test_a_checkpoint_of_one_kernel_resumes_with_the_other(save_fused):
    params = _params()
    optimizer = adamw(params, lr=1e-2, fused=save_fused)
    _steps(optimizer, params, 0, 2)
    state = copy.deepcopy(optimizer.state_dict())  # live state would move on
    saved = [param.detach().clone() for param in params]
    _steps(optimizer, params, 2, 3)  # the uninterrupted run

    resumed_params = [torch.nn.Parameter(value) for value in saved]
    resumed = adamw(resumed_params, lr=1e-2, fused=not save_fused)
    resumed.load_state_dict(state)
    assert _is_fused(resumed) is not save_fused  # the kernel chosen here, not the saved one
    _steps(resumed, resumed_params, 2, 3)
    for got, want in zip(resumed_params, params, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
