"""Driven by test_qlora_dora.py under torchrun: QLoRA's NF4 base under tensor parallelism.

Builds MODEL (a Llama whose linear weights hold whole NF4 blocks) with
``lora.quantize_base: nf4`` under ``parallelism.tensor_parallel_size: 2`` (on 4 processes
FSDP2 shards each piece over 2 more), then checks every linear weight but ``lm_head``:

- an ``NF4Tensor`` one is a piece of the rows (column-wise layers) or columns (row-wise ones)
  of the weight, this rank's only;
- each rank's dequantized piece is, bit for bit, the same rows and columns of torchao's
  ``to_nf4`` of the whole weight dequantized (what one process trains on);
- a model whose NF4 layers are not adapted (plain ``nn.Linear``s) computes the same logits
  as the adapted one (its adapters are fresh: ``B`` is zero).

Prints one ``checked N`` line per rank: the NF4 weights (a weight whose pieces hold no whole
NF4 blocks stays in fp32, as without tensor parallelism).

Usage: tp_nf4_script.py MODEL
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from torchao.quantization import to_nf4

from tunelab._torch_compat import local_shape_and_global_offset
from tunelab.config.lora import LoRAArgs
from tunelab.config.sections import LoRAModelSetupArgs, SFTParallelismArgs
from tunelab.distributed import build_device_meshes, destroy_distributed, init_distributed
from tunelab.peft.nf4 import dequantize, is_nf4
from tunelab.training import build_model

LORA = LoRAArgs(
    targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    quantize_base="nf4",
)


def main() -> None:
    """Build the split QLoRA model and compare each piece with one process's NF4 weight."""
    path = Path(sys.argv[1])
    info = init_distributed("cpu")
    meshes = build_device_meshes(info.device, SFTParallelismArgs(tensor_parallel_size=2))
    model = build_model(
        LoRAModelSetupArgs(path=str(path), frozen_base="shard"),
        device=info.device,
        meshes=meshes,
        lora=LORA,
    )
    whole = load_file(path / "model.safetensors")
    checked = 0
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        weight = module.weight
        assert isinstance(weight, DTensor), name
        if not is_nf4(weight.to_local()):
            continue  # too few values per process for whole NF4 blocks (the caller counts)
        split = "columns" if any(p.is_shard(1) for p in weight.placements) else "rows"
        assert split == ("columns" if name.endswith(("o_proj", "down_proj")) else "rows"), name
        expected = to_nf4(whole[f"{name}.weight"]).get_original_weight()
        (rows, cols), (row0, col0) = local_shape_and_global_offset(weight)
        piece = dequantize(weight.to_local())
        assert torch.equal(piece, expected[row0 : row0 + rows, col0 : col0 + cols]), name
        checked += 1
    # Unadapted NF4 layers (plain nn.Linear, tunelab.peft.nf4.linear in their forward) compute
    # what the adapted ones do with B = 0.
    tokens = torch.randint(0, 800, (2, 20), generator=torch.Generator().manual_seed(0))
    fewer = build_model(
        LoRAModelSetupArgs(path=str(path), frozen_base="shard"),
        device=info.device,
        meshes=meshes,
        lora=LoRAArgs(targets=["q_proj"], quantize_base="nf4"),
    )
    assert not hasattr(fewer.layers[0].mlp.down_proj, "lora_A")
    with torch.no_grad():
        difference = (fewer(tokens) - model(tokens)).abs().max().item()
    assert difference < 1e-5, difference
    # One write per rank: print writes the text and its newline separately, and 4 ranks on
    # one pipe interleaved them ("checked 10checked 10\n\n").
    sys.stdout.write(f"checked {checked}\n")
    sys.stdout.flush()
    destroy_distributed()


if __name__ == "__main__":
    main()
