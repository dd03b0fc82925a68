"""Driven by test_checkpoint_client.py under torchrun: the CheckpointClient's guarantees.

Usage: client_script.py MODE BASE_DIR OUTPUT_DIR
"""

import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import tunelab.peft as peft
from tunelab.checkpoint import CheckpointClient
from tunelab.checkpoint.dcp import ChecksummedWriter
from tunelab.checkpoint.dcp import load as load_step
from tunelab.config.recipe_args import LoRAArgs
from tunelab.distributed import init_distributed
from tunelab.errors import CheckpointError
from tunelab.formats.integrity import MANIFEST_NAME
from tunelab.lifecycle import RunFolder
from tunelab.losses import CrossEntropyLoss
from tunelab.training import OptimizerStep, forward, global_token_count, load_model

MODE, BASE, OUT = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
LORA = LoRAArgs(rank=4, alpha=8.0, targets=["q_proj", "v_proj", "down_proj"])
VOCAB = 301


HELD_STEP = "step_3"
WRITE_STARTED = threading.Event()
RELEASE_WRITE = threading.Event()
HOLD_TIMEOUT_S = 300


class HeldWriter(ChecksummedWriter):
    """Holds the data write of step_3 until the script releases it (no timing involved).

    A save that blocked its caller until written would never return to the code that releases
    it: the writer then gives up after ``HOLD_TIMEOUT_S`` and the save fails.
    """

    def write_data(self, plan, planner):
        if Path(self.path).name == HELD_STEP:
            WRITE_STARTED.set()
            if not RELEASE_WRITE.wait(HOLD_TIMEOUT_S):
                raise RuntimeError(f"{HELD_STEP}'s write was never released: save() blocked")
        return super().write_data(plan, planner)


def is_committed(step):
    """Whether step ``step`` is committed (its manifest, written last, exists)."""
    return (OUT / f"step_{step}" / MANIFEST_NAME).is_file()


def local_snapshot(model):
    return {
        name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.state_dict().items()
    }


def assert_unchanged(model, snapshot, what):
    for name, tensor in local_snapshot(model).items():
        assert torch.equal(tensor, snapshot[name]), f"{what} changed {name}"


def make_client(model, optimizer, **kwargs):
    return CheckpointClient(
        OUT,
        model=model,
        optimizer=optimizer,
        lr_scheduler=None,
        base_checkpoint_dir=BASE,
        lora=LORA,
        writer_factory=lambda path: HeldWriter(path, sync_files=True),
        **kwargs,
    )


def train(model, optimizer, params, steps, rank, world_size):
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(step))
        mine = tokens[rank::world_size]
        batch = {"tokens": mine, "labels": mine}
        # The recipes' step on one micro-batch: the mean token loss over all ranks.
        loss_sum, _ = CrossEntropyLoss()(forward(model, batch), batch["labels"])
        (loss_sum * world_size / global_token_count([batch])).backward()
        OptimizerStep(optimizer, params)()


def main():
    if MODE == "order":
        try:
            CheckpointClient(
                OUT, model=None, optimizer=None, lr_scheduler=None, base_checkpoint_dir=BASE
            )
        except CheckpointError as error:
            print("ORDER_ERROR", error, flush=True)
        return
    info = init_distributed("cpu")
    model = load_model(str(BASE), device=info.device, dtype=torch.float32, lora=LORA)
    params = list(peft.get_adapter_params(model).values())
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    train(model, optimizer, params, 3, info.rank, info.world_size)
    lora_b = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert all(float(p.full_tensor().abs().max()) > 0 for p in lora_b), "B is still zero"

    # The batched gather equals per-tensor full_tensor(), uneven rows included (vocab 301).
    from torch.distributed.tensor import Shard, distribute_tensor

    from tunelab.distributed import gather_full_tensors

    mesh = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh
    uneven = {"odd": distribute_tensor(torch.arange(15.0).view(5, 3), mesh, [Shard(0)])}
    uneven["one_row"] = distribute_tensor(torch.ones(1, 4), mesh, [Shard(0)])
    sharded = {**peft.adapter_state_dict(model), **uneven}
    gathered = gather_full_tensors(sharded)
    for name, tensor in sharded.items():
        assert torch.equal(gathered[name], tensor.full_tensor()), name

    client = make_client(model, optimizer, enable_async=True, keep_last_n=2)
    snapshot = local_snapshot(model)
    client.save(3, 0, {"note": "async"})
    # save() returned while step 3's write is held: the writer is running and nothing is
    # committed yet.
    assert WRITE_STARTED.wait(HOLD_TIMEOUT_S), "step 3's write never started"
    assert not is_committed(3), "step 3 committed while its write was held"
    assert_unchanged(model, snapshot, "async save")
    before_step = snapshot
    # Training goes on while the write is held: the optimizer step waits only for the staging
    # copy, so step 3 must hold the weights of before this extra step.
    train(model, optimizer, params, 1, info.rank, info.world_size)
    assert not is_committed(3), "step 3 committed while its write was held"
    snapshot = local_snapshot(model)
    assert any(not torch.equal(snapshot[k], before_step[k]) for k in snapshot), "no step ran"
    RELEASE_WRITE.set()
    client.wait()
    dist.barrier()  # rank 0 commits
    assert is_committed(3), "step 3 not committed once its write was released"
    # A sync save right after an async one: it must wait, not hang or overlap.
    client.save(4, 0, {"note": "sync"}, blocking=True)
    assert_unchanged(model, snapshot, "sync save")
    dist.barrier()
    committed = [c.step for c in RunFolder(OUT).committed_checkpoints()]
    assert committed == [3, 4], committed
    for step, expected in ((3, before_step), (4, snapshot)):
        probe = {
            "model": {k: v.detach().clone() for k, v in peft.adapter_state_dict(model).items()}
        }
        load_step(probe, OUT / f"step_{step}")
        for name, value in probe["model"].items():
            assert torch.equal(value.to_local(), expected[name]), (step, name)
    client.export(0)
    assert_unchanged(model, snapshot, "export")
    # The export merges each weight inside the writer, just before writing it; the files are
    # byte-identical to writing an up-front merged state dict.
    from tunelab.checkpoint.hf_sharded import save_hf_sharded
    from tunelab.formats.hf import HFCheckpointReader

    upfront = model.state_dict_adapter.to_hf(peft.merged_state_dict(model))
    save_hf_sharded(
        upfront, OUT / "upfront", fqn_to_file=HFCheckpointReader(BASE).fqn_to_file, source_dir=BASE
    )
    assert_unchanged(model, snapshot, "up-front merge")
    if info.rank == 0:
        for path in sorted((OUT / "upfront").glob("*.safetensors")):
            exported = OUT / "epoch_0" / path.name
            assert exported.read_bytes() == path.read_bytes(), path.name

    # The live model's logits, for the interop check in the test process.
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        logits = model(tokens)
    if info.rank == 0:
        torch.save({"tokens": tokens, "logits": logits}, OUT / "reference_logits.pt")

    # Retention: a third save prunes the oldest, never the newest.
    train(model, optimizer, params, 1, info.rank, info.world_size)
    client.save(5, 0, {"note": "third"})
    client.wait()
    dist.barrier()
    committed = [c.step for c in RunFolder(OUT).committed_checkpoints()]
    assert committed == [4, 5], committed
    client.close()

    # A corrupt newest checkpoint is reported and the previous committed one is used.
    dist.barrier()
    if info.rank == 0:
        shard = OUT / "step_5" / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-7])
    dist.barrier()
    fresh = load_model(str(BASE), device=info.device, dtype=torch.float32, lora=LORA)
    fresh_params = list(peft.get_adapter_params(fresh).values())
    fresh_optimizer = torch.optim.AdamW(fresh_params, lr=1e-2)
    reader = make_client(fresh, fresh_optimizer)
    resumed = reader.load_latest()
    assert resumed.step == 4 and resumed.progress == {"note": "sync"}, resumed
    reader.close()
    if info.rank == 0:
        print("CLIENT_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    main()
