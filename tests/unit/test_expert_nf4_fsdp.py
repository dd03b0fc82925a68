"""QLoRA on MoE experts under FSDP2 on 2 processes, against one process.

The model is built the recipe's way (``tunelab.training.load_model`` with ``quantize_base:
nf4`` and LoRA on attention and both stacked expert weights) from a base with 4 experts, so
each rank holds 2 whole experts of every stacked weight, packed NF4. Each rank's NF4 shard is
its rows of torchao's quantization of the whole (packed) weight, bit for bit; the logits and
the adapter gradients equal one process's; each rank's shard-local merge (its experts
dequantized plus their LoRA updates) equals the one-process merge, and so does the exported
file. Both expert layouts: Qwen3-MoE's ``[E, out, in]`` and gpt-oss's ``[E, in, out]`` with
biases, the latter loaded from MXFP4 experts as the hub has them (each rank dequantizes its
experts' blocks, then quantizes them to NF4).
"""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.tensor import distribute_tensor

from tests.mxfp4_codes import mxfp4_codes
from tunelab.checkpoint.export import export_hf
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.config.lora import LoRAArgs
from tunelab.models import ModelArgs, TransformerDecoder
from tunelab.peft import get_adapter_params, merged_state_dict

pytest.importorskip("torchao")
from torchao.quantization import to_nf4  # noqa: E402

from tunelab.peft.nf4 import is_nf4  # noqa: E402

WORLD_SIZE = 2
_LORA = LoRAArgs(
    rank=2,
    alpha=4.0,
    targets=["q_proj", "experts.gate_up_proj", "experts.down_proj"],
    quantize_base="nf4",
)
_EXPERT_KEYS = [
    f"model.layers.{layer}.mlp.experts.{name}"
    for layer in (0, 1)
    for name in ("gate_up_proj", "down_proj")
]
_ARGS = {
    "stacked": dict(
        family="qwen3_moe", qk_norm=True, norm_topk_prob=True, intermediate_dim=24,
    ),
    "gpt_oss": dict(
        family="gpt_oss", qkv_bias=True, output_bias=True, attention_sinks=True,
        sliding_window=3, layer_types=["sliding_attention", "full_attention"],
        intermediate_dim=32, norm_topk_prob=True, router_bias=True, expert_bias=True,
        expert_layout="gpt_oss", swiglu_limit=7.0,
    ),
}  # fmt: skip


def _build(checkpoint_dir: str):
    from tunelab.training import load_model

    return load_model(
        checkpoint_dir, device=torch.device("cpu"), dtype=torch.float32, lora=_LORA
    ).train()


def _loss(model, tokens):
    logits = model(tokens)
    return logits, logits.square().mean()


def _worker(rank: int, init_file: str, checkpoint_dir: str, reference_file: str, out: str):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        model = _build(checkpoint_dir)
        reference = torch.load(reference_file, weights_only=True)
        params = dict(model.named_parameters())
        for key in _EXPERT_KEYS:
            local = params[key].to_local()
            assert is_nf4(local) and local.shape[0] == params[key].shape[0] // WORLD_SIZE
            for inner, whole in reference["codes"][key].items():
                expected = whole if inner == "scaler_mean" else whole.chunk(WORLD_SIZE)[rank]
                assert torch.equal(getattr(local, inner), expected), (key, inner)
        with torch.no_grad():
            for name, param in get_adapter_params(model).items():
                full = reference["adapter"][name]
                param.to_local().copy_(
                    distribute_tensor(full, param.device_mesh, param.placements).to_local()
                )
        logits, loss = _loss(model, reference["tokens"])
        torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)
        loss.backward()
        for name, param in get_adapter_params(model).items():
            grad = param.grad.full_tensor()
            torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-4, atol=1e-6)
        merged = merged_state_dict(model)
        for key in _EXPERT_KEYS:
            value = merged[key]
            # Shard-local: this rank's experts only, then gathered here to compare.
            assert value.to_local().shape[0] == value.shape[0] // WORLD_SIZE
            torch.testing.assert_close(
                value.full_tensor(), reference["merged"][key], rtol=0, atol=1e-6
            )
        export_hf(model, out, base_checkpoint_dir=checkpoint_dir, lora=_LORA)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["stacked", "gpt_oss"])
def test_fsdp2_nf4_experts_match_one_process(tmp_path, layout):
    args = ModelArgs(
        vocab_size=64, dim=64, num_layers=2, num_heads=2, num_kv_heads=1, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_dim=128, **_ARGS[layout],
    )  # fmt: skip
    torch.manual_seed(0)
    source = TransformerDecoder(args)
    generator = torch.Generator().manual_seed(2)
    packed = {}
    with torch.no_grad():
        for name, param in source.named_parameters():
            if name.endswith(("mlp.gate.weight", "bias", "sinks")):
                param.normal_(0.0, 1.0)
            elif layout == "gpt_oss" and name.endswith(("gate_up_proj", "down_proj")):
                # As the hub has gpt-oss: MXFP4 experts, read per rank, then quantized to NF4.
                experts, inputs, outputs = param.shape
                blocks, scales, weight = mxfp4_codes((experts, outputs, inputs), generator)
                param.copy_(weight.transpose(1, 2))
                packed[name] = (blocks, scales)
    adapter = source.state_dict_adapter
    checkpoint = tmp_path / "base"
    hf_state = adapter.to_hf(source.state_dict())
    config = adapter.hf_config(torch.float32)
    for key, (blocks, scales) in packed.items():
        del hf_state[key]
        hf_state[f"{key}_blocks"], hf_state[f"{key}_scales"] = blocks, scales
        config["quantization_config"] = {"quant_method": "mxfp4"}
    save_hf_sharded(hf_state, checkpoint)
    (checkpoint / "config.json").write_text(json.dumps(config))

    model = _build(str(checkpoint))
    codes = {}
    for key in _EXPERT_KEYS:
        weight = source.get_parameter(key).detach()
        whole = to_nf4(weight.reshape(-1, weight.shape[-1]), 64, 256)
        names = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
        codes[key] = {name: getattr(whole, name) for name in names}
        assert is_nf4(model.get_parameter(key))
    torch.manual_seed(1)
    with torch.no_grad():
        for param in get_adapter_params(model).values():
            param.normal_(std=0.3)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    logits, loss = _loss(model, tokens)
    loss.backward()
    adapter_params = get_adapter_params(model)
    merged = merged_state_dict(model)
    reference = {
        "tokens": tokens,
        "codes": codes,
        "logits": logits.detach(),
        "adapter": {k: v.detach() for k, v in adapter_params.items()},
        "grads": {k: v.grad for k, v in adapter_params.items()},
        "merged": {k: merged[k].detach() for k in _EXPERT_KEYS},
    }
    assert all(float(g.abs().max()) > 0 for g in reference["grads"].values())
    torch.save(reference, tmp_path / "reference.pt")
    out = tmp_path / "export"
    mp.spawn(
        _worker,
        args=(str(tmp_path / "init"), str(checkpoint), str(tmp_path / "reference.pt"), str(out)),
        nprocs=WORLD_SIZE,
    )
    exported = load_file(out / "model.safetensors")
    expected, source_state = adapter.to_hf(merged), adapter.to_hf(source.state_dict())
    assert set(exported) == set(expected) == set(source_state)
    for key in exported:
        torch.testing.assert_close(exported[key], expected[key], rtol=0, atol=1e-6)
    # The merge is there, on the NF4-rounded experts.
    key = next(k for k in exported if "experts" in k and "bias" not in k)
    assert float((exported[key] - source_state[key]).abs().max()) > 1e-2
