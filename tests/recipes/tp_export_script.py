"""Driven by test_tensor_parallel.py under torchrun (2 or 4 processes): exports of two layouts.

Builds tiny/lora's model twice, under plain FSDP over every process and under TP=2
(``parallelize_decoder``, FSDP2 over the remaining processes; colwise weights then
``(_StridedShard, Shard(0))``, rowwise ones ``(Shard(0), Shard(1))``),
gives every adapter weight the same non-zero values (a fresh B is zero, which would make the
merge trivial), and exports each (``export_hf``: the PEFT adapter, then the merged model
written shard-locally by every rank) to ``{out}/fsdp`` and ``{out}/tp``. Rank 0 prints one
JSON line of what the TP export made whole on the way (``DTensor.full_tensor``, a
redistribution to replicated, the tensors ``export_hf`` gathers): their names and shapes.

Usage: tp_export_script.py OUT [MODEL_DIR TARGETS]  (TARGETS comma-separated; default tiny/lora's
model and every llama projection)
"""

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import tunelab.checkpoint.export as export_module
from tunelab.checkpoint.export import export_hf
from tunelab.config.lora import LoRAArgs
from tunelab.config.sections import LoRAModelSetupArgs, SFTParallelismArgs
from tunelab.distributed import build_device_meshes, destroy_distributed, init_distributed
from tunelab.peft import get_adapter_params
from tunelab.training import build_model

TINY = Path(__file__).resolve().parents[2] / "framework" / "tunelab" / "assets" / "tiny"
LORA = LoRAArgs(
    targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
)


@torch.no_grad()
def set_adapters(model: torch.nn.Module) -> None:
    """Every adapter weight to the same whole values on any layout (each rank its piece)."""
    for index, (_, param) in enumerate(sorted(get_adapter_params(model).items())):
        full = torch.sin(torch.arange(param.numel(), dtype=torch.float32) + index).view(param.shape)
        full = full * 0.05
        if isinstance(param, DTensor):
            piece = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(piece.to_local())
        else:
            param.copy_(full)


@contextmanager
def recorded_gathers(record: dict):
    """Record the shapes of the DTensors made whole meanwhile, and the names export_hf gathers."""
    full_tensor, redistribute = DTensor.full_tensor, DTensor.redistribute
    gather = export_module.gather_full_tensors

    def recording_full_tensor(self, *args, **kwargs):
        record["shapes"].append(list(self.shape))
        return full_tensor(self, *args, **kwargs)

    def recording_redistribute(self, device_mesh=None, placements=None, *args, **kwargs):
        if placements is not None and all(isinstance(p, Replicate) for p in placements):
            record["shapes"].append(list(self.shape))
        return redistribute(self, device_mesh, placements, *args, **kwargs)

    def recording_gather(tensors):
        record["names"].extend(tensors)
        record["shapes"].extend(list(tensor.shape) for tensor in tensors.values())
        return gather(tensors)

    DTensor.full_tensor, DTensor.redistribute = recording_full_tensor, recording_redistribute
    export_module.gather_full_tensors = recording_gather
    try:
        yield
    finally:
        DTensor.full_tensor, DTensor.redistribute = full_tensor, redistribute
        export_module.gather_full_tensors = gather


def main() -> None:
    """Export the two layouts."""
    out = Path(sys.argv[1])
    model_dir, lora = TINY, LORA
    if len(sys.argv) > 2:
        model_dir, lora = Path(sys.argv[2]), LoRAArgs(targets=sys.argv[3].split(","))
    info = init_distributed("cpu")
    for name, size in (("fsdp", 1), ("tp", 2)):
        meshes = build_device_meshes(info.device, SFTParallelismArgs(tensor_parallel_size=size))
        model = build_model(
            LoRAModelSetupArgs(path=str(model_dir), frozen_base="shard"),
            device=info.device,
            meshes=meshes,
            lora=lora,
        )
        set_adapters(model)
        record = {"names": [], "shapes": []}
        with recorded_gathers(record):
            export_hf(model, out / name, base_checkpoint_dir=model_dir, lora=lora)
        if name == "tp" and dist.get_rank() == 0:
            print(json.dumps({"gathered": record, "lora_rank": lora.rank}), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
