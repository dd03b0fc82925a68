"""QLoRA (NF4 base) and DoRA under FSDP2 on 2 gloo processes, against one process.

One model, built the recipe's way (meta, LoRA with DoRA on some layers, NF4 base, shard,
materialise, load rows): each rank's NF4 shard equals the rows of torchao's quantization of
the whole weight bit for bit; forward and gradients equal a one-process model's; the
shard-local merge equals a merge of gathered tensors, and neither merging nor saving the
adapter touches a live weight.
"""

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

from tunelab.peft import adapter_state_dict, apply_lora, init_lora_parameters, merged_state_dict
from tunelab.peft.merge import merge_weight
from tunelab.peft.nf4 import copy_rows_nf4_, dequantize, is_nf4, quantize_base_nf4

pytest.importorskip("torchao")
WORLD_SIZE = 2
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


def _build(full_state, mesh=None, dora=("q_proj", "down_proj")):
    """The recipe's order; ``dora`` layers get DoRA, ``up_proj`` plain LoRA."""
    with torch.device("meta"):
        model = TinyLM()
        apply_lora(model, targets=list(dora), rank=RANK, alpha=ALPHA, use_dora=True)
        for layer in model.layers:
            layer.up_proj = apply_lora_one(layer.up_proj)
    plan = quantize_base_nf4(model, device=torch.device("cpu"), world_size=WORLD_SIZE)
    if mesh is not None:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for key, param in model.state_dict(keep_vars=True).items():
            if key in full_state:
                rows = full_state[key]
                if isinstance(param, DTensor):
                    rank = dist.get_rank()
                    rows = rows.chunk(WORLD_SIZE)[rank]
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
                _set_full(value, full)
    return model, plan


def apply_lora_one(linear):
    from tunelab.peft import LoRALinear

    return LoRALinear.from_linear(linear, rank=RANK, alpha=ALPHA)


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _set_full(value, full):
    if isinstance(value, DTensor):
        value.to_local().copy_(full.chunk(WORLD_SIZE)[dist.get_rank()])
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


def _check(rank):
    from torchao.quantization import to_nf4

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    torch.manual_seed(0)
    full_state = {k: v.detach().clone() for k, v in TinyLM().state_dict().items()}
    model, plan = _build(full_state, mesh)
    reference, _ = _build(full_state)
    assert sorted(plan.kept) == ["layers.0.gate", "layers.1.gate"]
    assert "lm_head" not in plan.quantized and "layers.0.k_proj" in plan.quantized

    # Each rank's NF4 rows: torchao's quantization of the whole weight, split by rows.
    for name in plan.quantized:
        whole = to_nf4(full_state[f"{name}.weight"], 64, 256)
        local = model.get_submodule(name).weight.to_local()
        assert is_nf4(local) and local.shape[0] == whole.shape[0] // WORLD_SIZE, name
        for attr in ("quantized_data", "quantized_scalers", "quantization_factor"):
            expected = getattr(whole, attr).chunk(WORLD_SIZE)[rank]
            assert torch.equal(getattr(local, attr), expected), (name, attr)
        assert torch.equal(local.scaler_mean, whole.scaler_mean), name
        unsharded = reference.get_submodule(name).weight
        assert torch.equal(unsharded.get_original_weight(), whole.get_original_weight()), name

    # Forward and gradients equal the one-process model's (fp32).
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    logits = model(tokens)
    expected_logits = reference(tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    logits.square().mean().backward()
    expected_logits.square().mean().backward()
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
    # HSDP (a 2-D mesh: replicate x shard): the block maxima gather over the shard dimension.
    hsdp_mesh = init_device_mesh("cpu", (1, WORLD_SIZE), mesh_dim_names=("replicate", "shard"))
    hsdp, _ = _build(full_state, hsdp_mesh)
    q_proj = hsdp.layers[0].q_proj.weight
    assert q_proj.device_mesh.ndim == 2 and is_nf4(q_proj.to_local())
    with torch.no_grad():
        torch.testing.assert_close(hsdp(tokens), expected_logits, rtol=1e-5, atol=1e-5)
    # And a model holding the merged weights computes what the adapted model computes.
    plain = TinyLM()
    plain.load_state_dict({k: v.full_tensor() for k, v in merged.items()})
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), expected_logits, rtol=1e-4, atol=1e-5)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _worker(rank, init_file):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        _check(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_qlora_and_dora_under_fsdp2_two_processes(tmp_path):
    with tempfile.NamedTemporaryFile(dir=tmp_path, delete=False) as init_file:
        pass
    mp.spawn(_worker, args=(init_file.name,), nprocs=WORLD_SIZE, join=True)
