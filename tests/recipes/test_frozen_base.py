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

from tests.recipes.conftest import losses_by_step, tunelab_run

pytestmark = pytest.mark.slow
STEPS = 3
COMMON = [
    "epochs=1",
    f"max_steps_per_epoch={STEPS}",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=null",
]


def _export(output_dir) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "epoch_0" / "model.safetensors")


def test_replicated_frozen_base_equals_sharded(tmp_path):
    sharded, auto = tmp_path / "shard", tmp_path / "auto"
    tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={sharded}", "frozen_base=shard",
        *COMMON,
    )  # fmt: skip
    result = tunelab_run("lora_finetune_distributed", "tiny/lora", f"output_dir={auto}", *COMMON)
    assert "frozen_base: auto picked replicate" in result.stdout + result.stderr
    assert losses_by_step(auto) == losses_by_step(sharded)  # bit for bit
    assert sorted(losses_by_step(auto)) == list(range(1, STEPS + 1))
    merged, reference = _export(auto), _export(sharded)
    assert merged.keys() == reference.keys()
    for key, tensor in merged.items():
        assert torch.equal(tensor, reference[key]), key


def test_chunked_output_equals_whole_logits_in_full_finetuning(tmp_path):
    losses = {}
    for chunked in ("true", "false"):
        out = tmp_path / chunked
        tunelab_run(
            "full_finetune_distributed", "tiny/full", f"output_dir={out}",
            f"chunked_output={chunked}", "checkpoint.export_every_n_epochs=2", *COMMON,
        )  # fmt: skip
        losses[chunked] = losses_by_step(out)
    assert sorted(losses["true"]) == list(range(1, STEPS + 1))
    assert losses["true"][STEPS] != losses["true"][1]  # lm_head and the rest did train
    for step, loss in losses["false"].items():
        assert losses["true"][step] == pytest.approx(loss, abs=2e-6), step
