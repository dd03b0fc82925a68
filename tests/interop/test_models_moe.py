"""Qwen3-MoE and Mixtral against transformers: logits, router loss, packing, checkpoints.

Each family is a tiny random transformers model with every feature it has switched on:
Qwen3-MoE with a dense layer among its MoE layers (``mlp_only_layers``), renormalised top-k
weights, q/k norms and a sliding window; Mixtral with top-2 of 8 experts and a sliding window
of 5 under 17-token sequences. The routers get large weights so that routing is decisive (no
near-ties for the order of a sum to flip).
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.interop.adapter_checks import (
    assert_adapter_and_merge_give_our_logits,
    randomize_lora_b,
)
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.config.lora import EXPERT_TARGETS, LoRAArgs
from tunelab.generation import generate
from tunelab.models import load_pretrained
from tunelab.modules import RouterStats
from tunelab.peft import (
    adapter_state_dict,
    apply_lora,
    load_peft_adapter,
    merged_state_dict,
    read_adapter_config,
    save_peft_adapter,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOLERANCE = 1e-4
SEQ_LEN = 17
VOCAB = 97
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    sliding_window=5,
    router_aux_loss_coef=0.02,
)
MOE_FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            _COMMON,
            num_hidden_layers=4,
            intermediate_size=40,
            moe_intermediate_size=16,
            head_dim=12,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[2],
            use_sliding_window=True,
            rope_theta=1000000.0,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(_COMMON, num_hidden_layers=2, intermediate_size=24, num_local_experts=8),
    ),
}


def build_tiny_moe(family: str):
    """The seeded random fp32 transformers model of ``MOE_FAMILIES[family]``."""
    config_class, kwargs = MOE_FAMILIES[family]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
    return model.eval()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """``make(family) -> Path`` of the family's checkpoint, as ``save_pretrained`` writes it."""
    built = {}

    def make(family: str):
        if family not in built:
            path = tmp_path_factory.mktemp(f"hf_{family}")
            build_tiny_moe(family).save_pretrained(path)
            built[family] = path
        return built[family]

    return make


def _hf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _tokens(seq_len: int = SEQ_LEN, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(1))


def _max_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max())


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_logits_match_transformers(moe_dir, family):
    path = moe_dir(family)
    hf_model, model = _hf(path), load_pretrained(path)
    args = model.args
    assert args.family == family and args.sliding_window == 5 and args.num_experts == 8
    if family == "qwen3_moe":
        assert args.dense_layers == [2] and args.norm_topk_prob
        assert type(model.layers[2].mlp).__name__ == "FeedForward"
    tokens = _tokens()
    with torch.no_grad():
        theirs = hf_model(tokens).logits
        ours = model(tokens)
        assert _max_error(ours, theirs) <= TOLERANCE
        # The padded-bmm fallback computes the same.
        for layer in model.layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp.experts.grouped = False
        assert _max_error(model(tokens), theirs) <= TOLERANCE
        # The window bites.
        model.args.layer_types = None
        assert _max_error(model(tokens), theirs) > 1e-2


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_router_aux_loss_and_its_gradient_match_transformers(moe_dir, family):
    """``RouterStats`` with padding equals transformers' ``aux_loss`` with an attention mask,
    and so do the router gradients it gives."""
    path = moe_dir(family)
    hf_model, model = _hf(path), load_pretrained(path)
    tokens = _tokens()
    valid = torch.ones_like(tokens)
    valid[1, 11:] = 0  # right padding: the real tokens' states do not depend on it
    output = hf_model(tokens, attention_mask=valid, output_router_logits=True)
    stats = RouterStats(valid)
    model(tokens, router_stats=stats)
    ours = stats.loss()
    assert stats.num_layers == (3 if family == "qwen3_moe" else 2)
    assert abs(ours.item() - output.aux_loss.item()) <= 1e-6
    # Without a mask every token counts, as transformers does without one.
    unmasked = RouterStats()
    model(tokens, router_stats=unmasked)
    hf_unmasked = hf_model(tokens, output_router_logits=True).aux_loss
    assert abs(unmasked.loss().item() - hf_unmasked.item()) <= 1e-6
    assert abs(unmasked.loss().item() - ours.item()) > 1e-6  # the mask matters
    ours.backward()
    output.aux_loss.backward()
    # transformers 4 names Mixtral's router `block_sparse_moe.gate`, 5 `mlp.gate`.
    hf_router = next(
        param.grad
        for name, param in hf_model.named_parameters()
        if name.startswith("model.layers.0.") and name.endswith(".gate.weight")
    )
    our_router = model.layers[0].mlp.gate.weight.grad
    assert our_router is not None and float(our_router.abs().max()) > 0
    assert _max_error(our_router, hf_router) <= 1e-6


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_packed_rows_equal_separate_documents(moe_dir, family):
    path = moe_dir(family)
    hf_model, model = _hf(path), load_pretrained(path)
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


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_export_is_the_hub_layout_and_loads_in_transformers(moe_dir, tmp_path, family):
    source = moe_dir(family)
    model = load_pretrained(source)
    adapter = model.state_dict_adapter
    tokens = _tokens()
    with torch.no_grad():
        expected = model(tokens)
    save_hf_sharded(adapter.to_hf(model.state_dict()), tmp_path / "copied", source_dir=source)
    save_hf_sharded(adapter.to_hf(model.state_dict()), tmp_path / "written")
    config = adapter.hf_config(torch.float32)
    (tmp_path / "written" / "config.json").write_text(json.dumps(config))
    with safe_open(source / "model.safetensors", "pt") as f:
        hub_keys = set(f.keys())
    for folder in ("copied", "written"):
        with safe_open(tmp_path / folder / "model.safetensors", "pt") as f:
            assert set(f.keys()) == hub_keys, folder
        with torch.no_grad():
            theirs = _hf(tmp_path / folder)(tokens).logits
        assert _max_error(theirs, expected) <= TOLERANCE, folder
    # from_hf stacks the per-expert tensors back.
    with safe_open(source / "model.safetensors", "pt") as f:
        native = adapter.from_hf({key: f.get_tensor(key) for key in f.keys()})
    state = model.state_dict()
    assert set(native) == set(state)
    assert all(torch.equal(native[key], state[key]) for key in state)


@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5, reason="transformers 4 has no stacked layout"
)
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_stacked_layout_of_transformers_5_loads(moe_dir, tmp_path, family):
    """``save_pretrained(save_original_format=False)`` keeps the fused ``gate_up_proj``."""
    hf_model = _hf(moe_dir(family))
    hf_model.save_pretrained(tmp_path, save_original_format=False)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
    tokens = _tokens()
    with torch.no_grad():
        ours = load_pretrained(tmp_path)(tokens)
        assert _max_error(ours, hf_model(tokens).logits) <= TOLERANCE


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_kv_cache_generation_matches_transformers_greedy(moe_dir, family):
    """Cached decoding past the window equals transformers' greedy tokens, each recomputed on
    the whole sequence. (transformers 5.25's own ``generate`` of this Mixtral, window 5 under a
    6-token prompt, gives other tokens from the second on, while its full forwards agree with
    ours: its sliding-window cache, measured here; Qwen3-MoE's ``generate`` agrees.)"""
    path = moe_dir(family)
    hf_model, model = _hf(path), load_pretrained(path)
    prompt = _tokens(6, batch=1)
    tokens = prompt
    with torch.no_grad():
        for _ in range(12):  # 18 tokens: past the window
            next_token = hf_model(tokens).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
    assert generate(model, prompt[0].tolist(), max_new_tokens=12) == tokens[0, 6:].tolist()


def test_all_linear_leaves_routers_and_experts_out(moe_dir):
    """``all-linear``: attention and Qwen3-MoE's dense MLP, not the routers (frozen unless
    named, ``gate``) nor the experts (stacked weights, not linears)."""
    swapped = apply_lora(load_pretrained(moe_dir("qwen3_moe")), LoRAArgs(targets="all-linear"))
    assert not any(name.endswith(".gate") or ".experts" in name for name in swapped)
    assert "model.layers.2.mlp.up_proj" in swapped
    named = apply_lora(load_pretrained(moe_dir("mixtral")), LoRAArgs(targets=["gate"]))
    assert named == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_lora_adapter_loads_in_peft_and_merge_loads_in_transformers(moe_dir, tmp_path, family):
    """LoRA on attention: PEFT loads the adapter with our logits, and the merged export loads
    in transformers with them.

    Not on Qwen3-MoE's dense MLP: peft 0.21 on transformers 5 turns the targets ``gate_proj``,
    ``up_proj`` and ``down_proj`` (whatever their prefix) into fresh LoRA on every layer's
    experts and adapts no dense MLP, so such an adapter loses its MLP part in PEFT.
    """
    path = moe_dir(family)
    model = load_pretrained(path)
    swapped = apply_lora(model, LoRAArgs(targets=["q_proj", "k_proj", "v_proj", "o_proj"]))
    assert_adapter_and_merge_give_our_logits(model, swapped, path, tmp_path, _tokens(), TOLERANCE)


_PEFT_LOADS_EXPERTS = "target_parameters" in getattr(peft.LoraConfig, "__dataclass_fields__", {})
_STACKED_EXPERTS = int(transformers.__version__.split(".")[0]) >= 5


def _expert_lora_model(path, targets):
    """Our model with LoRA on ``targets``, random ``B`` (a fresh one is zero), and its logits."""
    model = load_pretrained(path)
    lora = LoRAArgs(rank=4, alpha=8.0, targets=targets)
    swapped = apply_lora(model, lora)
    randomize_lora_b(model)
    with torch.no_grad():
        expected = model(_tokens())
    return model, lora, swapped, expected


_EXPERT_CASES = {
    "both": ["q_proj", *EXPERT_TARGETS],
    "down_only": ["mlp.experts.down_proj"],  # one projection: PEFT names it without base_layer
}


@pytest.mark.parametrize("case", list(_EXPERT_CASES))
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_expert_lora_merged_export_loads_in_transformers(moe_dir, tmp_path, family, case):
    """LoRA on the stacked experts merges expert by expert into the hub's per-expert layout."""
    path = moe_dir(family)
    model, _, swapped, expected = _expert_lora_model(path, _EXPERT_CASES[case])
    assert "model.layers.0.mlp.experts.down_proj" in swapped
    merged = model.state_dict_adapter.to_hf(merged_state_dict(model))
    save_hf_sharded(merged, tmp_path / "merged", source_dir=path)
    with torch.no_grad():
        assert _max_error(_hf(tmp_path / "merged")(_tokens()).logits, expected) <= TOLERANCE
        assert _max_error(_hf(path)(_tokens()).logits, expected) > 1e-2


@pytest.mark.skipif(
    not (_PEFT_LOADS_EXPERTS and _STACKED_EXPERTS),
    reason="PEFT loads expert LoRA as target_parameters (peft >= 0.17) on stacked expert "
    "weights (transformers >= 5)",
)
@pytest.mark.parametrize("case", list(_EXPERT_CASES))
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_expert_lora_adapter_loads_in_peft_with_our_logits(moe_dir, tmp_path, family, case):
    """The adapter is PEFT's ``target_parameters`` format: PEFT builds the same keys, loads our
    factors, and gives our logits."""
    path = moe_dir(family)
    model, lora, swapped, expected = _expert_lora_model(path, _EXPERT_CASES[case])
    config = lora.peft_config(swapped, str(path))
    assert config["target_parameters"] == sorted(
        {"experts." + name.rpartition(".")[2] for name in swapped if ".experts." in name}
    )
    save_peft_adapter(adapter_state_dict(model), config, tmp_path / "adapter")
    adapted = peft.PeftModel.from_pretrained(_hf(path), tmp_path / "adapter").eval()
    ours = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(ours) == 2 * len(swapped)
    assert set(peft.get_peft_model_state_dict(adapted)) == ours
    with torch.no_grad():
        assert _max_error(adapted(_tokens()).logits, expected) <= TOLERANCE


@pytest.mark.skipif(
    not (_PEFT_LOADS_EXPERTS and _STACKED_EXPERTS),
    reason="PEFT writes expert LoRA as target_parameters (peft >= 0.17) on stacked expert "
    "weights (transformers >= 5)",
)
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_we_read_an_expert_adapter_peft_wrote(moe_dir, tmp_path, family):
    """PEFT's own ``target_parameters`` adapter (its spelling of the targets) loads into our
    model with PEFT's logits."""
    path = moe_dir(family)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = peft.get_peft_model(_hf(path), config)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    peft_model.eval().save_pretrained(tmp_path / "adapter")
    ours = load_pretrained(path)
    apply_lora(ours, LoRAArgs.from_peft_config(read_adapter_config(tmp_path / "adapter")))
    load_peft_adapter(ours, tmp_path / "adapter")
    with torch.no_grad():
        expected = peft_model(_tokens()).logits
        assert _max_error(ours(_tokens()), expected) <= TOLERANCE
        assert _max_error(_hf(path)(_tokens()).logits, expected) > 1e-2
