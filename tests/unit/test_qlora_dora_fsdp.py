"""QLoRA (NF4 base) and DoRA under FSDP2 and HSDP on gloo processes, against one process.

Meshes: FSDP on 2 ranks, HSDP (2, 1) on 2 and 2 x 2 on 4 (where a rank's shard coordinate is
not its global rank). One model, built the recipe's way (meta, LoRA with DoRA on some layers,
NF4 base, shard, materialise, load the rows the loader picks): each rank's NF4 shard equals the
rows of its shard coordinate in torchao's quantization of the whole weight, bit for bit;
forward and gradients (over every rank's batch) equal a one-process model's; the
shard-local merge equals a merge of gathered tensors, and neither merging nor saving the
adapter touches a live weight.
"""

import math
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tunelab.models.loading import _local_slices
from tunelab.peft import (
    LoRALinear,
    adapter_state_dict,
    init_lora_parameters,
    merged_state_dict,
)
from tunelab.peft.merge import merge_weight
from tunelab.peft.nf4 import copy_rows_nf4_, dequantize, is_nf4, quantize_base_nf4

pytest.importorskip("torchao")
HIDDEN, KV, INTER, VOCAB = 256, 128, 512, 37
RANK, ALPHA = 4, 8.0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV, bias=True)  # a bias, and not adapted below
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)
        self.gate = nn.Linear(HIDDEN, 2, bias=False)  # too small for NF4: kept in fp32

    def forward(self, x):
        h = self.q_proj(x) + self.k_proj(x).repeat(1, 1, HIDDEN // KV)
        h = h + self.down_proj(F.silu(self.up_proj(h)))
        return h * torch.sigmoid(self.gate(h)).sum(-1, keepdim=True)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


def _build(full_state, mesh=None, dora=("q_proj", "down_proj"), num_shards=2):
    """The recipe's order; ``dora`` layers get DoRA, ``up_proj`` plain LoRA.

    Each rank loads the rows the loader picks for it (``tunelab.models.loading``), the code
    under test; the adapter values are set here from the shard coordinate.
    """
    with torch.device("meta"):
        model = TinyLM()
        model.requires_grad_(False)  # as apply_lora leaves it: only the adapters train
        for layer in model.layers:
            for name in dora:
                setattr(layer, name, apply_lora_one(getattr(layer, name), use_dora=True))
            layer.up_proj = apply_lora_one(layer.up_proj)
    plan = quantize_base_nf4(model, device=torch.device("cpu"), world_size=num_shards)
    if mesh is not None:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for key, param in model.state_dict(keep_vars=True).items():
            if key in full_state:
                _, spans = _local_slices(param)
                rows = full_state[key]
                for dim, (offset, size) in enumerate(spans):
                    rows = rows.narrow(dim, offset, size)
                copy_rows_nf4_(param, rows)
    torch.manual_seed(1)
    init_lora_parameters(model)
    # Non-zero B and a magnitude away from its init, the same on every rank.
    torch.manual_seed(2)
    with torch.no_grad():
        for key, value in adapter_state_dict(model).items():
            if "lora_B" in key or "magnitude" in key:
                full = torch.randn(value.shape) * 0.05
                if "magnitude" in key:
                    full = (_full(value) * (1 + full)).contiguous()
                _set_full(value, full, num_shards)
    return model, plan


def apply_lora_one(linear, use_dora=False):
    return LoRALinear.from_linear(linear, rank=RANK, alpha=ALPHA, use_dora=use_dora)


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _shard_coordinate(num_shards):
    """This rank's index along the shard dimension of a row-major ``(replicate, shard)`` mesh."""
    return dist.get_rank() % num_shards


def _set_full(value, full, num_shards):
    if isinstance(value, DTensor):
        value.to_local().copy_(full.chunk(num_shards)[_shard_coordinate(num_shards)])
    else:
        value.copy_(full)


def _nf4_state(model):
    """The packed bytes of every NF4 weight, cloned (to detect any write to a live weight)."""
    state = {}
    for key, value in model.state_dict().items():
        local = value.to_local() if isinstance(value, DTensor) else value
        if is_nf4(local):
            for name in ("quantized_data", "quantized_scalers", "quantization_factor"):
                state[f"{key}/{name}"] = getattr(local, name).clone()
            state[f"{key}/scaler_mean"] = local.scaler_mean.clone()
        else:
            state[key] = local.detach().clone()
    return state


def _check(rank, mesh_shape):
    from torchao.quantization import to_nf4

    num_shards = mesh_shape[-1]
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    shard = _shard_coordinate(num_shards)
    torch.manual_seed(0)
    full_state = {k: v.detach().clone() for k, v in TinyLM().state_dict().items()}
    model, plan = _build(full_state, mesh, num_shards=num_shards)
    reference, _ = _build(full_state, num_shards=num_shards)
    assert sorted(plan.kept) == ["layers.0.gate", "layers.1.gate"]
    assert "lm_head" not in plan.quantized and "layers.0.k_proj" in plan.quantized
    assert model.layers[0].q_proj.weight.device_mesh.ndim == len(mesh_shape)

    # Each rank's NF4 rows: torchao's quantization of the whole weight, split by rows, the
    # piece of this rank's shard coordinate (not of its global rank: on (2, 1) and 2 x 2 they
    # differ, and replicas hold the same rows).
    for name in plan.quantized:
        whole = to_nf4(full_state[f"{name}.weight"], 64, 256)
        local = model.get_submodule(name).weight.to_local()
        assert is_nf4(local) and local.shape[0] == whole.shape[0] // num_shards, name
        for attr in ("quantized_data", "quantized_scalers", "quantization_factor"):
            expected = getattr(whole, attr).chunk(num_shards)[shard]
            assert torch.equal(getattr(local, attr), expected), (name, attr)
        assert torch.equal(local.scaler_mean, whole.scaler_mean), name
        unsharded = reference.get_submodule(name).weight
        assert torch.equal(unsharded.get_original_weight(), whole.get_original_weight()), name

    # Forward and gradients equal the one-process model's (fp32). Every rank has its own
    # tokens: the gradient FSDP2 reduces (within the shard group, then across replicas) is
    # that of the mean loss over all ranks' batches.
    world_size = dist.get_world_size()
    all_tokens = torch.randint(
        0, VOCAB, (world_size, 2, 6), generator=torch.Generator().manual_seed(3)
    )
    tokens = all_tokens[rank]
    logits = model(tokens)
    expected_logits = reference(tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    logits.square().mean().backward()
    torch.stack([reference(t).square().mean() for t in all_tokens]).mean().backward()
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(
                param.grad.full_tensor(), reference_params[name].grad, rtol=1e-4, atol=1e-6
            )
    assert model.layers[0].q_proj.lora_magnitude_vector.grad is not None

    # The shard-local merge (out of place) equals a merge of the gathered tensors.
    live = _nf4_state(model)
    full_adapter = {k: v.full_tensor() for k, v in adapter_state_dict(model).items()}
    merged = merged_state_dict(model)
    assert _same(live, _nf4_state(model)), "merging changed a live weight"
    for key, value in merged.items():
        assert isinstance(value, DTensor) and type(value.to_local()) is torch.Tensor, key
        owner = key.rpartition(".")[0]
        base = dequantize(reference.state_dict()[key])
        if f"{owner}.lora_A.weight" in full_adapter:
            expected = merge_weight(
                base,
                full_adapter[f"{owner}.lora_A.weight"],
                full_adapter[f"{owner}.lora_B.weight"],
                ALPHA / RANK,
                full_adapter.get(f"{owner}.lora_magnitude_vector"),
            )
        else:
            expected = base
        torch.testing.assert_close(value.full_tensor(), expected, rtol=1e-6, atol=1e-7)
    # And a model holding the merged weights computes what the adapted model computes.
    plain = TinyLM()
    plain.load_state_dict({k: v.full_tensor() for k, v in merged.items()})
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), expected_logits, rtol=1e-4, atol=1e-5)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _worker(rank, init_file, mesh_shape):
    world_size = math.prod(mesh_shape)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        _check(rank, mesh_shape)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# FSDP over 2 ranks; HSDP (2, 1): 2 replicas of one shard, where FSDP2 copies instead of
# gathering; HSDP 2 x 2 on 4 processes. On the last two a rank's global index and its shard
# coordinate differ.
@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 1), (2, 2)], ids=["fsdp2", "hsdp2x1", "hsdp2x2"])
def test_qlora_and_dora_under_fsdp2(tmp_path, mesh_shape):
    with tempfile.NamedTemporaryFile(dir=tmp_path, delete=False) as init_file:
        pass
    mp.spawn(_worker, args=(init_file.name, mesh_shape), nprocs=math.prod(mesh_shape), join=True)
