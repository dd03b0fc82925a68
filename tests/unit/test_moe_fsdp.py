"""An MoE model under FSDP2 on 2 processes: each rank loads and exports only its experts.

Five experts split 3 + 2 over the ranks (``Shard(0)`` of the stacked weights). The sharded
model's logits, its load-balancing loss and its gradients equal one process's, and the export
writes the hub's per-expert tensors, equal to the source's.
"""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tunelab.checkpoint.export import export_hf
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.models import ModelArgs, TransformerDecoder, from_hf_config, load_hf_into_model
from tunelab.modules import RouterStats

WORLD_SIZE = 2


def _loss(model, tokens):
    stats = RouterStats()
    logits = model(tokens, router_stats=stats)
    return logits, logits.square().mean() + 0.1 * stats.loss()


def _worker(rank: int, init_file: str, checkpoint_dir: str, reference_file: str, out: str):
    from torch.distributed.fsdp import fully_shard

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
        experts = model.layers[0].mlp.experts.gate_up_proj
        assert experts.to_local().shape[0] == (3, 2)[rank]
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
def test_fsdp2_moe_load_train_step_and_export_match_one_process(tmp_path):
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
    logits, loss = _loss(model, tokens)
    loss.backward()
    reference = {
        "tokens": tokens,
        "logits": logits.detach(),
        "params": {k: v.detach() for k, v in model.named_parameters()},
        "grads": {k: v.grad for k, v in model.named_parameters()},
    }
    assert reference["grads"]["model.layers.0.mlp.gate.weight"].abs().sum() > 0
    torch.save(reference, tmp_path / "reference.pt")
    out = tmp_path / "export"
    mp.spawn(
        _worker,
        args=(str(tmp_path / "init"), str(checkpoint), str(tmp_path / "reference.pt"), str(out)),
        nprocs=WORLD_SIZE,
    )
    source, exported = (
        load_file(checkpoint / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert "model.layers.0.mlp.experts.4.up_proj.weight" in exported
    assert set(exported) == set(source)
    assert all(torch.equal(exported[key], source[key]) for key in source)
