"""HSDP: ``data_parallel_replicate_size`` x ``data_parallel_shard_size`` builds a 2-D mesh, and
FSDP2 shards within each replica group and replicates across them.

The slow test runs 4 processes as 2 x 2 (global batch 16, like the 2-process reference run
with batch 8): the same losses (fp32, 1e-6), each shard of the step checkpoint saved once
(not once per replica), and an exact resume on another mesh shape (plain FSDP on 2 processes)
whose export equals the HSDP run's.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import COMMON, STEPS, interrupted_copy, losses_by_step, tunelab_run
from tunelab.config.sections import ParallelismArgs
from tunelab.distributed import data_parallel_mesh
from tunelab.errors import ConfigError

TOLERANCE = 1e-6


@pytest.mark.parametrize(
    ("replicate", "shard", "message"),
    [(2, None, "does not divide the 1 processes"), (1, 2, "1 x 2 = 2, but this run has 1")],
)
def test_mesh_sizes_must_multiply_to_the_world_size(replicate, shard, message):
    with pytest.raises(ConfigError, match=message):
        data_parallel_mesh(
            torch.device("cpu"),
            ParallelismArgs(data_parallel_replicate_size=replicate, data_parallel_shard_size=shard),
        )


def test_one_replica_is_plain_fsdp():
    assert (
        data_parallel_mesh(
            torch.device("cpu"),
            ParallelismArgs(data_parallel_replicate_size=1, data_parallel_shard_size=1),
        )
        is None
    )


def _assert_losses(output_dir, reference_dir, steps):
    losses, reference = losses_by_step(output_dir), losses_by_step(reference_dir)
    assert sorted(losses) == list(steps), losses
    for step in steps:
        assert abs(losses[step] - reference[step]) <= TOLERANCE, (step, losses[step], reference)


@pytest.mark.slow
def test_hsdp_2x2_matches_and_resumes_on_another_mesh(tmp_path, lora_2p):
    out = tmp_path / "hsdp"
    tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", "schedule.batch_size=4", *COMMON,
        "parallelism.data_parallel_replicate_size=2", "parallelism.data_parallel_shard_size=2",
        "model.frozen_base=shard",  # as the 70B configs (auto keeps the tiny base gathered)
        nproc=4,
    )  # fmt: skip
    _assert_losses(out, lora_2p, range(1, STEPS + 1))

    # Each shard once: every tensor in 2 chunks (the shard size, not 4 ranks), each written by
    # one rank only, although two replicas hold it.
    metadata = json.loads((out / "step_3" / ".metadata.json").read_text())
    for name, tensor in metadata["tensors"].items():
        if tensor["size"] and tensor["size"][0] >= 2:
            assert len(tensor["chunks"]) == 2, (name, tensor["chunks"])
    written = [(fqn, tuple(offsets)) for fqn, offsets, *_ in metadata["items"]]
    assert len(written) == len(set(written))

    # Resume on another mesh shape: 1 x 2 (plain FSDP, 2 processes of 8).
    other = interrupted_copy(out, tmp_path / "fsdp_1x2", after_step=3)
    tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={other}", "schedule.batch_size=8", *COMMON,
        "checkpoint.resume_from_checkpoint=true",
    )  # fmt: skip
    _assert_losses(other, lora_2p, range(4, STEPS + 1))
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        hsdp, fsdp = load_file(out / "epoch_0" / name), load_file(other / "epoch_0" / name)
        assert hsdp.keys() == fsdp.keys()
        for key in hsdp:
            assert torch.allclose(hsdp[key], fsdp[key], rtol=0, atol=TOLERANCE), (name, key)
