"""gpt-oss against transformers' ``GptOssForCausalLM``: logits, packing, generation, MXFP4
checkpoints, exports and LoRA.

The tiny random model has every feature switched on: attention biases and sinks (random, so
they matter), a sliding layer (window 5) and a full one under 17-token sequences, YaRN, routers with
biases and large weights (decisive routing), expert biases, and expert weights large enough,
under a ``swiglu_limit`` of 1, that the clamps bite.

YaRN is gpt-oss's own (factor 32 over 4096 original positions, ``truncate: false``); with
``head_dim`` 12 its ramp bounds fall between pairs, so ``truncate`` changes the tables.
"""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.interop.adapter_checks import assert_adapter_and_merge_give_our_logits
from tests.mxfp4_codes import mxfp4_codes
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.config.lora import EXPERT_TARGETS, LoRAArgs
from tunelab.errors import CheckpointError
from tunelab.formats.mxfp4 import dequantize_mxfp4
from tunelab.generation import generate
from tunelab.models import load_pretrained
from tunelab.modules import RouterStats
from tunelab.peft import (
    apply_lora,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
if not hasattr(transformers, "GptOssConfig"):
    pytest.skip("this transformers has no gpt-oss", allow_module_level=True)
if int(transformers.__version__.split(".")[0]) < 5:
    # transformers 4.x's GptOssExperts hard-code alpha 1.702 and limit 7.0 (config.swiglu_limit
    # is ignored, so the tiny model's limit of 1 cannot be the reference's) and its router hands
    # the aux loss top-k scores instead of logits: it is not the reference these tests compare
    # with. The hub's gpt-oss checkpoints use limit 7.0, the value both read.
    pytest.skip("transformers 4.x's gpt-oss ignores swiglu_limit", allow_module_level=True)

TOLERANCE = 1e-4
SEQ_LEN = 17
VOCAB = 97
WINDOW = 5
YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    intermediate_size=32,  # MXFP4 blocks are 32 inputs wide
    num_local_experts=8,
    num_experts_per_tok=3,
    sliding_window=WINDOW,
    max_position_embeddings=131072,
    swiglu_limit=1.0,
    router_aux_loss_coef=0.02,
    tie_word_embeddings=False,
)
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _hf_config():
    if int(transformers.__version__.split(".")[0]) >= 5:
        rope = {"rope_parameters": {**YARN, "rope_theta": 150000.0}}
    else:
        rope = {"rope_scaling": dict(YARN), "rope_theta": 150000.0}
    return transformers.GptOssConfig(**CONFIG, **rope)


def build_tiny_gpt_oss():
    """The seeded random fp32 model; its expert weights are exactly representable in MXFP4.

    Returns:
        ``(model, packed)``: ``packed`` maps each expert weight's key to its MXFP4
        ``(blocks, scales)``.
    """
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(), dtype=torch.float32)
    generator = torch.Generator().manual_seed(2)
    packed = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif ".router." in name or name.endswith("sinks"):
                param.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith(EXPERT_WEIGHTS):
                # [E, in, out] in memory; MXFP4 quantizes [E, out, in] along `in`.
                experts, inputs, outputs = param.shape
                blocks, scales, weight = mxfp4_codes((experts, outputs, inputs), generator)
                param.copy_(weight.transpose(1, 2))
                packed[name] = (blocks, scales)
    return model.eval(), packed


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``(plain, quantized)``: the model as ``save_pretrained`` writes it, and the same with
    its expert weights as MXFP4 blocks and scales and an mxfp4 ``quantization_config``, as
    the hub's gpt-oss checkpoints are."""
    model, packed = build_tiny_gpt_oss()
    plain = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(plain)
    quantized = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tensors = load_file(plain / "model.safetensors")
    for key, (blocks, scales) in packed.items():
        assert torch.equal(tensors.pop(key), model.state_dict()[key])
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (quantized / "config.json").write_text(json.dumps(config))
    return plain, quantized


def _hf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _tokens(seq_len: int = SEQ_LEN, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(1))


def _max_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max())


def test_args_and_rotary_tables_match_transformers(checkpoints):
    hf_model, model = _hf(checkpoints[0]), load_pretrained(checkpoints[0])
    args = model.args
    assert args.family == "gpt_oss" and args.attention_sinks and args.expert_layout == "gpt_oss"
    assert args.layer_types == ["sliding_attention", "full_attention"]
    assert args.rope_scaling["rope_type"] == "yarn" and args.rope_scaling["truncate"] is False
    positions = torch.arange(40)[None]
    hf_cos, hf_sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = model.model.rotary_emb(positions, torch.float32)
    half = args.head_dim // 2  # transformers' gpt-oss tables hold each pair once
    assert hf_model.model.rotary_emb.attention_scaling != 1.0
    assert _max_error(cos[..., :half], hf_cos) <= 1e-6
    assert _max_error(sin[..., :half], hf_sin) <= 1e-6


def test_bf16_norms_equal_transformers_bit_for_bit(checkpoints):
    """gpt-oss's RMSNorm applies its weight in fp32 before the cast back, as transformers'
    (which keeps these norms in fp32); the Llama order (cast, then weight) differs in bf16."""
    from tunelab.modules import RMSNorm

    model = load_pretrained(checkpoints[0], dtype=torch.bfloat16)
    ours = model.layers[0].input_layernorm
    assert ours.scale_in_fp32 and ours.weight.dtype == torch.bfloat16
    theirs = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm(32, eps=ours.eps)
    llama_order = RMSNorm(32, eps=ours.eps).to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight.float())
        llama_order.weight.copy_(ours.weight)
    x = torch.randn(4, 17, 32, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
        assert not torch.equal(llama_order(x), theirs(x))


@pytest.mark.parametrize("backend", ["sdpa", "dense", "flex"])
def test_logits_match_transformers(checkpoints, backend):
    """Every attention kernel (flex: forward only, CPU has no flex backward), both expert
    paths; the window, the sinks and the clamp each change the logits."""
    hf_model, model = _hf(checkpoints[0]), load_pretrained(checkpoints[0])
    model.attention_backend = backend
    tokens = _tokens()
    with torch.no_grad():
        theirs = hf_model(tokens).logits
        assert _max_error(model(tokens), theirs) <= TOLERANCE
        for layer in model.layers:
            layer.mlp.experts.grouped = False  # the padded-bmm fallback
        assert _max_error(model(tokens), theirs) <= TOLERANCE
        model.args.layer_types = None
        assert _max_error(model(tokens), theirs) > 1e-2, "the window bites"
        model.args.layer_types = ["sliding_attention", "full_attention"]
        sinks = [layer.self_attn.sinks.clone() for layer in model.layers]
        for layer in model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        assert _max_error(model(tokens), theirs) > 1e-2, "the sinks matter"
        for layer, saved in zip(model.layers, sinks, strict=True):
            layer.self_attn.sinks.copy_(saved)
        for layer in model.layers:
            layer.mlp.experts.swiglu_limit = 1e4
        assert _max_error(model(tokens), theirs) > 1e-2, "the clamp bites"


def test_sinks_gradient_equals_transformers(checkpoints):
    """The ``sdpa`` sink column and the explicit path give transformers' gradients."""
    hf_model, model = _hf(checkpoints[0]), load_pretrained(checkpoints[0])
    tokens = _tokens()
    hf_model(tokens).logits.square().mean().backward()
    theirs = hf_model.model.layers[0].self_attn.sinks.grad
    assert float(theirs.abs().max()) > 0
    for backend in ("sdpa", "dense"):
        model.zero_grad()
        model.attention_backend = backend
        model(tokens).square().mean().backward()
        assert _max_error(model.layers[0].self_attn.sinks.grad, theirs) <= 1e-5, backend


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_packed_rows_equal_separate_documents(checkpoints, backend):
    hf_model, model = _hf(checkpoints[0]), load_pretrained(checkpoints[0])
    model.attention_backend = backend
    lengths = (9, 8)
    tokens = _tokens(sum(lengths), batch=1)
    document_ids = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = model(tokens, document_ids=document_ids)
        start = 0
        for length in lengths:
            alone = hf_model(tokens[:, start : start + length]).logits
            assert _max_error(packed[:, start : start + length], alone) <= TOLERANCE
            start += length


def test_kv_cache_generation_equals_transformers_generate(checkpoints):
    """Greedy decoding with the KV cache, past the window, gives transformers' ``generate``
    tokens (and its full forwards' argmax)."""
    hf_model, model = _hf(checkpoints[0]), load_pretrained(checkpoints[0])
    prompt = _tokens(6, batch=1)
    with torch.no_grad():
        theirs = hf_model.generate(prompt, max_new_tokens=12, do_sample=False)[0, 6:].tolist()
        tokens = prompt
        for _ in range(12):
            next_token = hf_model(tokens).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
    assert tokens[0, 6:].tolist() == theirs
    assert generate(model, prompt[0].tolist(), max_new_tokens=12) == theirs
    # The cached forwards' logits (the dense path, sinks included) equal full forwards'.
    with torch.no_grad():
        full = hf_model(tokens).logits
        model.setup_caches(1, tokens.shape[1])
        steps = [(0, 6), *((position, position + 1) for position in range(6, tokens.shape[1]))]
        for start, stop in steps:
            positions = torch.arange(start, stop)[None]
            logits = model(tokens[:, start:stop], input_pos=positions)
            assert _max_error(logits, full[:, start:stop]) <= TOLERANCE, start


def test_router_aux_loss_matches_transformers(checkpoints):
    """The router bias enters the probabilities of the load-balancing loss, as transformers'."""
    hf_model, model = _hf(checkpoints[0]), load_pretrained(checkpoints[0])
    tokens = _tokens()
    valid = torch.ones_like(tokens)
    valid[1, 11:] = 0
    theirs = hf_model(tokens, attention_mask=valid, output_router_logits=True).aux_loss
    stats = RouterStats(valid)
    model(tokens, router_stats=stats)
    assert stats.num_layers == 2
    assert abs(stats.loss().item() - theirs.item()) <= 1e-6


def test_mxfp4_dequantization_equals_transformers_and_the_codes():
    """Random bytes dequantize as transformers' ``convert_moe_packed_tensors`` does (before
    its transpose), and codes built from known weights give those weights exactly."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    generator = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(110, 135, (3, 8, 2), generator=generator, dtype=torch.uint8)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 8, 64)
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), ours)
    blocks, scales, weight = mxfp4_codes((2, 4, 64), generator)
    assert torch.equal(dequantize_mxfp4(blocks, scales), weight)
    assert weight.abs().max() > 0 and (weight == 0).float().mean() < 0.2
    with pytest.raises(CheckpointError, match="do not fit"):
        dequantize_mxfp4(blocks[..., :8], scales)


def test_mxfp4_checkpoint_loads_with_the_dequantized_models_logits(checkpoints, tmp_path):
    plain, quantized = checkpoints
    with safe_open(quantized / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in set(f.keys())
        assert "model.layers.0.mlp.experts.gate_up_proj" not in set(f.keys())
    model, reference = load_pretrained(quantized), load_pretrained(plain)
    for key, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key
    tokens = _tokens()
    with torch.no_grad():
        assert _max_error(model(tokens), _hf(plain)(tokens).logits) <= TOLERANCE
    # A blocks tensor that does not fit the config is one error naming the file and key.
    broken = tmp_path / "broken"
    shutil.copytree(quantized, broken)
    tensors = load_file(broken / "model.safetensors")
    key = "model.layers.1.mlp.experts.down_proj_blocks"
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"model.safetensors: '{key}' has shape"):
        load_pretrained(broken)


@pytest.mark.parametrize("source", ["plain", "quantized"])
def test_export_is_the_hub_layout_and_loads_in_transformers(checkpoints, tmp_path, source):
    """From either base, the export holds the dequantized hub keys (``gate_up_proj`` ...,
    ``mlp.router``, ``self_attn.sinks``), no ``quantization_config``, and loads in
    transformers with our logits; its own ``config.json`` does too."""
    from tunelab.checkpoint.export import export_hf

    plain, quantized = checkpoints
    base = plain if source == "plain" else quantized
    model = load_pretrained(base)
    tokens = _tokens()
    with torch.no_grad():
        expected = model(tokens)
    export_hf(model, tmp_path / "export", base_checkpoint_dir=base)
    written = tmp_path / "written"
    save_hf_sharded(model.state_dict_adapter.to_hf(model.state_dict()), written)
    (written / "config.json").write_text(
        json.dumps(model.state_dict_adapter.hf_config(torch.float32))
    )
    with safe_open(plain / "model.safetensors", "pt") as f:
        hub_keys = set(f.keys())
    for folder in (tmp_path / "export", written):
        with safe_open(folder / "model.safetensors", "pt") as f:
            assert set(f.keys()) == hub_keys, folder
        assert "quantization_config" not in json.loads((folder / "config.json").read_text())
        with torch.no_grad():
            assert _max_error(_hf(folder)(tokens).logits, expected) <= TOLERANCE, folder
    native = model.state_dict_adapter.from_hf(load_file(tmp_path / "export" / "model.safetensors"))
    state = model.state_dict()
    assert set(native) == set(state)
    assert all(torch.equal(native[key], state[key]) for key in state)


@pytest.mark.parametrize("experts", [(), EXPERT_TARGETS], ids=["attention", "and_experts"])
def test_lora_adapter_loads_in_peft_and_merge_loads_in_transformers(checkpoints, tmp_path, experts):
    """LoRA on the attention projections, and on the stacked expert weights (PEFT's
    ``target_parameters`` on the ``[E, in, out]`` layout): PEFT applies our adapter with our
    logits, and the merged export loads in transformers with them."""
    path = checkpoints[0]
    model = load_pretrained(path)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", *experts]
    swapped = apply_lora(model, LoRAArgs(targets=targets))
    assert len(swapped) == 8 + 2 * len(experts)
    assert_adapter_and_merge_give_our_logits(model, swapped, path, tmp_path, _tokens(), TOLERANCE)
