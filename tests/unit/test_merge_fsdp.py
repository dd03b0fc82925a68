"""LoRA under FSDP2 on 2 gloo processes: init, adapter load, disable_adapter, shard-local merge.

Row counts are uneven on purpose: q_proj has 5 rows (3 + 2), v_proj 1 row (rank 1 holds none),
A has rank 3 rows (2 + 1).
"""

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tunelab.config.lora import LoRAArgs
from tunelab.peft import (
    adapter_state_dict,
    apply_lora,
    disable_adapter,
    init_lora_parameters,
    load_peft_adapter,
    merged_state_dict,
    save_peft_adapter,
)

WORLD_SIZE = 2
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"]
RANK, ALPHA = 3, 5.0


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(4, 5, bias=False)
        self.v_proj = nn.Linear(4, 1, bias=False)
        self.o_proj = nn.Linear(6, 4, bias=True)

    def forward(self, x):
        return self.o_proj(torch.cat([self.q_proj(x), self.v_proj(x)], dim=-1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(4, 3, bias=False)
        self.down_proj = nn.Linear(3, 4, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.self_attn(x)
        return x + self.mlp(x)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(7, 4)
        self.layers = nn.ModuleList([Block(), Block()])


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(4, 7, bias=False)

    def forward(self, tokens):
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(h)


@torch.no_grad()
def _load_full(model, full_state):
    for key, value in model.state_dict().items():
        if key in full_state:
            shard = distribute_tensor(
                full_state[key], value.device_mesh, value.placements, src_data_rank=None
            )
            value.to_local().copy_(shard.to_local())


def _reference_merge(weight, lora_a, lora_b, scale):
    return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)


def _worker(rank, init_file, adapter_dir):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        _check(rank, adapter_dir)
        # Tear down only once both ranks are done: a rank destroying gloo while its peer is
        # still finishing can abort the peer at exit.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check(rank, adapter_dir):
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    torch.manual_seed(0)
    base = TinyLM()
    reference = copy.deepcopy(base)
    apply_lora(reference, LoRAArgs(targets=TARGETS, rank=RANK, alpha=ALPHA))
    torch.manual_seed(1)
    init_lora_parameters(reference)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "lora_B" in name:
                param.normal_()
    if rank == 0:
        config = LoRAArgs(rank=RANK, alpha=ALPHA, dropout=0.0, use_rslora=False).peft_config(
            TARGETS, None
        )
        save_peft_adapter(adapter_state_dict(reference), config, adapter_dir)
    dist.barrier()

    # The recipe's path: meta build, swap, shard per block and root, materialise, load, init.
    with torch.device("meta"):
        model = TinyLM()
        apply_lora(model, LoRAArgs(targets=TARGETS, rank=RANK, alpha=ALPHA))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    _load_full(model, {k: v for k, v in base.state_dict().items()})
    torch.manual_seed(1)
    init_lora_parameters(model)

    q_proj = model.model.layers[0].self_attn.q_proj
    v_proj = model.model.layers[0].self_attn.v_proj
    assert isinstance(q_proj.weight, DTensor) and q_proj.weight.placements == (Shard(0),)
    assert q_proj.weight.to_local().shape[0] == (3, 2)[rank]
    assert v_proj.weight.to_local().shape[0] == (1, 0)[rank]
    assert q_proj.lora_A.weight.to_local().shape[0] == (2, 1)[rank]
    # Sharded init equals the one-process init with the same seed.
    for key, value in adapter_state_dict(model).items():
        expected = reference.state_dict()[key] if "lora_A" in key else torch.zeros(value.shape)
        assert torch.equal(value.full_tensor(), expected), key

    load_peft_adapter(model, adapter_dir)
    for key, value in adapter_state_dict(model).items():
        assert torch.equal(value.full_tensor(), reference.state_dict()[key]), key

    tokens = torch.tensor([[0, 3, 6, 1, 2]])
    with torch.no_grad():
        logits = model(tokens)
        torch.testing.assert_close(logits, reference(tokens), rtol=1e-6, atol=1e-6)
        with disable_adapter(model):
            torch.testing.assert_close(model(tokens), base(tokens), rtol=1e-6, atol=1e-6)
        assert not torch.allclose(logits, base(tokens), atol=1e-3)
        torch.testing.assert_close(model(tokens), logits, rtol=0, atol=0)  # flags restored

    live_before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    merged = merged_state_dict(model)

    sharded_state = model.state_dict()
    for key, value in sharded_state.items():
        assert torch.equal(value.to_local(), live_before[key]), f"live parameter {key} changed"
    assert not any(".lora_" in key for key in merged)
    assert set(merged) == {k for k in sharded_state if ".lora_" not in k}
    single_process = merged_state_dict(reference)
    for key, value in merged.items():
        base_value = sharded_state[key]
        assert isinstance(value, DTensor), key
        assert (value.device_mesh, value.placements, value.shape, value.stride()) == (
            base_value.device_mesh,
            base_value.placements,
            base_value.shape,
            base_value.stride(),
        ), key
        owner = key.rpartition(".")[0]
        if f"{owner}.lora_A.weight" in full and key.endswith(".weight"):
            expected = _reference_merge(
                full[key],
                full[f"{owner}.lora_A.weight"],
                full[f"{owner}.lora_B.weight"],
                ALPHA / RANK,
            )
            if base_value.to_local().numel():  # empty shards all have data_ptr 0
                assert value.to_local().data_ptr() != base_value.to_local().data_ptr(), key
        else:
            expected = full[key]
        assert torch.equal(value.full_tensor(), expected), key
        assert torch.equal(value.full_tensor(), single_process[key]), key
    # Rank 1 holds no row of v_proj: its merged shard is empty, and the global shape is intact.
    v_merged = merged["model.layers.0.self_attn.v_proj.weight"]
    assert v_merged.to_local().shape == ((1, 4), (0, 4))[rank] and v_merged.shape == (1, 4)


@pytest.mark.slow
def test_lora_under_fsdp2_two_processes(tmp_path):
    with tempfile.NamedTemporaryFile(dir=tmp_path, delete=False) as init_file:
        pass
    mp.spawn(
        _worker, args=(init_file.name, str(tmp_path / "adapter")), nprocs=WORLD_SIZE, join=True
    )
