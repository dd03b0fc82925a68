"""Driven by test_tensor_parallel.py under torchrun (2 processes): exports of two layouts.

Builds tiny/lora's model twice, under plain FSDP=2 and under TP=2 (``parallelize_decoder``;
colwise weights then ``(_StridedShard, Shard(0))``, rowwise ones ``(Shard(0), Shard(1))``),
gives every adapter weight the same non-zero values (a fresh B is zero, which would make the
merge trivial), and exports each (``export_hf``: the PEFT adapter, then the merged model
written shard-locally by both ranks) to ``{out}/fsdp`` and ``{out}/tp``.

Usage: tp_export_script.py OUT
"""

import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

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


def main() -> None:
    """Export the two layouts."""
    out = Path(sys.argv[1])
    info = init_distributed("cpu")
    for name, size in (("fsdp", 1), ("tp", 2)):
        meshes = build_device_meshes(info.device, SFTParallelismArgs(tensor_parallel_size=size))
        model = build_model(
            LoRAModelSetupArgs(path=str(TINY), frozen_base="shard"),
            device=info.device,
            meshes=meshes,
            lora=LORA,
        )
        set_adapters(model)
        export_hf(model, out / name, base_checkpoint_dir=TINY, lora=LORA)
    destroy_distributed()


if __name__ == "__main__":
    main()
