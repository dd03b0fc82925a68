"""Issue 17 settings end to end on 2 processes (gloo, fp32): same results, less communication.

- ``frozen_base: replicate`` (what ``auto`` picks for the tiny model, and says so) gives the
  same losses and the same exported model as ``frozen_base: shard``.
- ``chunked_output: true`` in full fine-tuning, where ``lm_head`` trains and FSDP2 must keep
  the root's parameters gathered for the loss's per-chunk calls and reduce their gradient,
  gives the losses of ``chunked_output: false``.
"""

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import COMMON, STEPS, launch_output, losses_by_step, tunelab_run

pytestmark = pytest.mark.slow


def _export(output_dir) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "epoch_0" / "model.safetensors")


def test_replicated_frozen_base_equals_sharded(tmp_path, lora_2p):
    # lora_2p ran with frozen_base: auto, which picks replicate for the tiny model.
    assert "frozen_base: auto picked replicate" in launch_output(lora_2p).read_text()
    sharded = tmp_path / "shard"
    tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={sharded}", "model.frozen_base=shard",
        "schedule.batch_size=8", *COMMON,
    )  # fmt: skip
    assert losses_by_step(lora_2p) == losses_by_step(sharded)  # bit for bit
    assert sorted(losses_by_step(sharded)) == list(range(1, STEPS + 1))
    merged, reference = _export(lora_2p), _export(sharded)
    assert merged.keys() == reference.keys()
    for key, tensor in merged.items():
        assert torch.equal(tensor, reference[key]), key


def test_chunked_output_equals_whole_logits_in_full_finetuning(tmp_path, full_2p):
    # full_2p ran with chunked_output: true (the default).
    out = tmp_path / "whole"
    tunelab_run(
        "full_finetune_distributed", "tiny/full", f"output_dir={out}", "model.chunked_output=false",
        "checkpoint.export_every_n_epochs=2", "schedule.batch_size=8", *COMMON,
    )  # fmt: skip
    losses = {"true": losses_by_step(full_2p), "false": losses_by_step(out)}
    assert sorted(losses["true"]) == list(range(1, STEPS + 1))
    assert losses["true"][STEPS] != losses["true"][1]  # lm_head and the rest did train
    for step, loss in losses["false"].items():
        assert losses["true"][step] == pytest.approx(loss, abs=2e-6), step
