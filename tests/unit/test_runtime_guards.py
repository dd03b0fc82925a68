"""Runtime guards: a run stops with a clear error instead of training on something wrong."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tunelab.errors import CheckpointError, DataError, TrainingError
from tunelab.models import load_pretrained
from tunelab.training.loop import NonFiniteGuard, OptimizerStep, global_token_count


def _edited_copy(source, target, key, edit):
    shutil.copytree(source, target)
    path = target / "model.safetensors"
    tensors = load_file(path)
    tensors[key] = edit(tensors[key])
    save_file(tensors, path, metadata={"format": "pt"})
    return target


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.index_fill(0, torch.tensor([3]), float("nan")), "holds 128 NaN or infinite"),
        (lambda t: t.index_fill(0, torch.tensor([0]), float("inf")), "NaN or infinite"),
        (lambda t: t.to(torch.int64), "is int64; tunelab loads floating-point weights"),
    ],
)
def test_weights_that_cannot_be_trained_on_are_refused_at_load(
    tiny_hf_model_dir, tmp_path, edit, message
):
    key = "model.layers.1.mlp.down_proj.weight"
    folder = _edited_copy(tiny_hf_model_dir("llama3_1"), tmp_path / "model", key, edit)
    with pytest.raises(CheckpointError, match=message) as caught:
        load_pretrained(folder)
    assert "model.safetensors" in str(caught.value) and key in str(caught.value)


def test_a_step_without_any_target_token_is_an_error():
    masked = {"labels": torch.full((2, 5), -100)}
    with pytest.raises(DataError, match="no target token in any batch on any rank"):
        global_token_count([masked, masked])
    some = {"labels": torch.tensor([[-100, 4, 5]])}
    assert global_token_count([masked, some]).item() == 2


def _one_param_step(grad, guard, loss):
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = grad.clone()
    optimizer = torch.optim.SGD([param], lr=0.1)
    metrics = OptimizerStep(optimizer, [param], guard=guard)(loss=loss, step=7)
    return param, metrics


def test_non_finite_step_stops_before_it_changes_the_weights():
    guard = NonFiniteGuard()
    param, metrics = _one_param_step(torch.ones(3), guard, loss=1.0)
    assert metrics["grad_norm"] == pytest.approx(3**0.5) and "skipped" not in metrics
    assert torch.allclose(param, torch.full((3,), 0.9))
    with pytest.raises(TrainingError, match=r"step 7: loss nan, gradient norm .* is not finite"):
        _one_param_step(torch.ones(3), guard, loss=float("nan"))
    with pytest.raises(TrainingError, match="set skip_nonfinite_steps"):
        _one_param_step(torch.tensor([1.0, float("inf"), 0.0]), guard, loss=1.0)


def test_skip_budget_skips_a_few_non_finite_steps_then_stops():
    guard = NonFiniteGuard(skip_budget=1)
    param, metrics = _one_param_step(torch.tensor([float("nan")] * 3), guard, loss=1.0)
    assert metrics["skipped"] == 1.0 and torch.equal(param, torch.ones(3)) and param.grad is None
    with pytest.raises(TrainingError, match=r"1 earlier step\(s\) skipped"):
        _one_param_step(torch.ones(3), guard, loss=float("inf"))
