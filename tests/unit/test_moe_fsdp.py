"""An MoE model under FSDP2 on 2 processes: each rank loads and exports only its experts.

Five experts split 3 + 2 over the ranks (``Shard(0)`` of the stacked weights). The sharded
model's logits, its load-balancing loss and its gradients equal one process's, and the export
writes the hub's per-expert tensors, equal to the source's. With LoRA on attention and the
stacked experts, the adapter gradients equal one process's, and the merged export (each rank
merges its own experts) equals one process's merge.
"""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.tensor import distribute_tensor

from tunelab.checkpoint.export import export_hf
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.models import ModelArgs, TransformerDecoder, from_hf_config, load_hf_into_model
from tunelab.modules import RouterStats
from tunelab.peft import LoRAArgs, apply_lora, get_adapter_params, merged_state_dict

WORLD_SIZE = 2


def _loss(model, tokens):
    stats = RouterStats()
    logits = model(tokens, router_stats=stats)
    return logits, logits.square().mean() + 0.1 * stats.loss()


_LORA = LoRAArgs(rank=2, alpha=4.0, targets=["q_proj", "experts.gate_up_proj", "experts.down_proj"])


def _worker(
    rank: int, init_file: str, checkpoint_dir: str, reference_file: str, out: str, lora: bool
):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        with torch.device("meta"):
            model = from_hf_config(checkpoint_dir)
        if lora:
            apply_lora(model, _LORA)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        load_hf_into_model(model, checkpoint_dir)
        experts = model.layers[0].mlp.experts.gate_up_proj
        assert experts.to_local().shape[0] == (3, 2)[rank]
        reference = torch.load(reference_file, weights_only=True)
        if lora:
            with torch.no_grad():
                for name, param in get_adapter_params(model).items():
                    local = distribute_tensor(
                        reference["params"][name], param.device_mesh, param.placements
                    ).to_local()
                    param.to_local().copy_(local)
        logits, loss = _loss(model, reference["tokens"])
        torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)
        loss.backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(
                param.full_tensor(), reference["params"][name], rtol=0, atol=0
            )
            if reference["grads"][name] is None:
                assert param.grad is None, name
                continue
            grad = param.grad.full_tensor()
            torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-4, atol=1e-6)
        export_hf(model, out, base_checkpoint_dir=checkpoint_dir, lora=_LORA if lora else None)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora_on_experts"])
def test_fsdp2_moe_load_train_step_and_export_match_one_process(tmp_path, lora):
    args = ModelArgs(
        vocab_size=64, dim=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_dim=24,
        family="qwen3_moe", qk_norm=True, num_experts=5, num_experts_per_tok=2,
        moe_intermediate_dim=8, norm_topk_prob=True, dense_layers=[1],
    )  # fmt: skip
    torch.manual_seed(0)
    model = TransformerDecoder(args)
    with torch.no_grad():
        model.layers[0].mlp.gate.weight.normal_(0.0, 1.0)
    adapter = model.state_dict_adapter
    checkpoint = tmp_path / "base"
    save_hf_sharded(adapter.to_hf(model.state_dict()), checkpoint)
    (checkpoint / "config.json").write_text(json.dumps(adapter.hf_config(torch.float32)))
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    if lora:
        apply_lora(model, _LORA)
        with torch.no_grad():
            for param in get_adapter_params(model).values():
                param.normal_(std=0.3)
    logits, loss = _loss(model, tokens)
    loss.backward()
    reference = {
        "tokens": tokens,
        "logits": logits.detach(),
        "params": {k: v.detach() for k, v in model.named_parameters()},
        "grads": {k: v.grad for k, v in model.named_parameters()},
    }
    trained = (
        "model.layers.0.mlp.experts.lora.down_proj.lora_A.weight"
        if lora
        else ("model.layers.0.mlp.gate.weight")
    )
    assert reference["grads"][trained].abs().sum() > 0
    torch.save(reference, tmp_path / "reference.pt")
    out = tmp_path / "export"
    mp.spawn(
        _worker,
        args=(
            str(tmp_path / "init"), str(checkpoint), str(tmp_path / "reference.pt"), str(out), lora
        ),
        nprocs=WORLD_SIZE,
    )  # fmt: skip
    source, exported = (
        load_file(checkpoint / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert "model.layers.0.mlp.experts.4.up_proj.weight" in exported
    assert set(exported) == set(source)
    if not lora:
        assert all(torch.equal(exported[key], source[key]) for key in source)
        return
    expected = adapter.to_hf(merged_state_dict(model))
    for key in source:
        torch.testing.assert_close(exported[key], expected[key], rtol=0, atol=1e-6)
    key = "model.layers.0.mlp.experts.4.up_proj.weight"
    assert float((exported[key] - source[key]).abs().max()) > 1e-2  # the merge is there


def _gpt_oss_worker(rank: int, init_file: str, checkpoint_dir: str, reference_file: str, out: str):
    """Load an MXFP4 base sharded, recording which rows of the blocks and scales are read."""
    from torch.distributed.fsdp import fully_shard

    from tunelab.formats.hf import HFCheckpointReader

    reads: list[tuple[str, int, int]] = []
    real_get_rows, real_get = HFCheckpointReader.get_rows, HFCheckpointReader.get

    def get_rows(self, key, start, stop, dtype=None):
        reads.append((key, start, stop))
        return real_get_rows(self, key, start, stop, dtype)

    def get(self, key, dtype=None):
        reads.append((key, 0, -1))
        return real_get(self, key, dtype)

    HFCheckpointReader.get_rows, HFCheckpointReader.get = get_rows, get
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        with torch.device("meta"):
            model = from_hf_config(checkpoint_dir)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        load_hf_into_model(model, checkpoint_dir)
        mine = ((0, 3), (3, 5))[rank]
        packed = [read for read in reads if read[0].endswith(("_blocks", "_scales"))]
        assert len(packed) == 2 * 2 * len(model.layers)
        assert all(read[1:] == mine for read in packed), packed
        reference = torch.load(reference_file, weights_only=True)
        logits, loss = _loss(model, reference["tokens"])
        torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)
        loss.backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(
                param.full_tensor(), reference["params"][name], rtol=0, atol=0
            )
            grad = param.grad.full_tensor()
            torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-4, atol=1e-6)
        export_hf(model, out, base_checkpoint_dir=checkpoint_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_gpt_oss_reads_only_its_mxfp4_experts_and_exports_them_dequantized(tmp_path):
    """gpt-oss with MXFP4 experts (5 experts, 3 + 2 per rank): each rank reads and dequantizes
    only its experts' blocks and scales; logits, loss and gradients equal one process's; the
    sharded export holds the dequantized weights under the hub's plain names."""
    from tests.mxfp4_codes import mxfp4_codes

    args = ModelArgs(
        vocab_size=64, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_dim=32,
        family="gpt_oss", qkv_bias=True, output_bias=True, attention_sinks=True,
        sliding_window=3, layer_types=["sliding_attention", "full_attention"], num_experts=5,
        num_experts_per_tok=2, moe_intermediate_dim=32, norm_topk_prob=True, router_bias=True,
        expert_bias=True, expert_layout="gpt_oss", swiglu_limit=1.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = TransformerDecoder(args)
    generator = torch.Generator().manual_seed(2)
    packed = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "mlp.gate.weight", "bias")):
                param.normal_(0.0, 1.0)
            elif name.endswith(("gate_up_proj", "down_proj")):
                experts, inputs, outputs = param.shape
                blocks, scales, weight = mxfp4_codes((experts, outputs, inputs), generator)
                param.copy_(weight.transpose(1, 2))
                packed[name] = (blocks, scales)
    adapter = model.state_dict_adapter
    hf_state = adapter.to_hf(model.state_dict())
    plain = tmp_path / "plain"
    save_hf_sharded(hf_state, plain)
    for key, (blocks, scales) in packed.items():
        del hf_state[key]
        hf_state[f"{key}_blocks"], hf_state[f"{key}_scales"] = blocks, scales
    checkpoint = tmp_path / "base"
    save_hf_sharded(hf_state, checkpoint)
    config = adapter.hf_config(torch.float32)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (checkpoint / "config.json").write_text(json.dumps(config))
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    logits, loss = _loss(model, tokens)
    loss.backward()
    reference = {
        "tokens": tokens,
        "logits": logits.detach(),
        "params": {k: v.detach() for k, v in model.named_parameters()},
        "grads": {k: v.grad for k, v in model.named_parameters()},
    }
    assert reference["grads"]["model.layers.0.self_attn.sinks"].abs().sum() > 0
    torch.save(reference, tmp_path / "reference.pt")
    out = tmp_path / "export"
    mp.spawn(
        _gpt_oss_worker,
        args=(str(tmp_path / "init"), str(checkpoint), str(tmp_path / "reference.pt"), str(out)),
        nprocs=WORLD_SIZE,
    )
    source, exported = load_file(plain / "model.safetensors"), load_file(out / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj" in exported
    assert set(exported) == set(source)
    assert all(torch.equal(exported[key], source[key]) for key in source)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
