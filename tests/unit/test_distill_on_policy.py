"""On-policy distillation's per-step draw and prompt cutting (tunelab.distill.OnPolicyBatches)."""

import torch

from tunelab.distill import OnPolicyBatches
from tunelab.distill.step import _prompt, _prompt_key


def _batches(lmbda: float, seed: int = 0) -> OnPolicyBatches:
    return OnPolicyBatches(engine=None, lmbda=lmbda, seed=seed, pad_id=2)


def test_the_draw_depends_on_the_seed_and_step_only_and_has_share_lmbda():
    draws = [_batches(0.3).chooses(step) for step in range(2000)]
    assert draws == [_batches(0.3).chooses(step) for step in range(2000)]  # a resume draws the same
    assert abs(sum(draws) / len(draws) - 0.3) < 0.04
    assert draws != [_batches(0.3, seed=1).chooses(step) for step in range(2000)]
    assert not any(_batches(0.0).chooses(step) for step in range(100))
    assert all(_batches(1.0).chooses(step) for step in range(100))


def test_a_prompt_is_the_tokens_before_the_first_target():
    tokens = torch.tensor([5, 6, 7, 8, 9, 2, 2])
    labels = torch.tensor([-100, -100, -100, 8, 9, -100, -100])
    assert _prompt(tokens, labels, length=5) == [5, 6, 7]
    # No prompt (train_on_input): the first token; no target: the whole row.
    assert _prompt(tokens, tokens, length=5) == [5]
    assert _prompt(tokens, torch.full_like(labels, -100), length=5) == [5, 6, 7, 8, 9]
    assert _prompt_key([5, 6, 7]) == _prompt_key([5, 6, 7]) != _prompt_key([5, 6, 8])
