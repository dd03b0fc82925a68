"""Qwen3, Mistral, Gemma 2, Gemma 3 (text) and Phi-3 against transformers.

Each family is a tiny random transformers model with every feature it has switched on (see
``NEW_FAMILIES`` in tests/conftest.py): GQA, a sliding window of 5 under 17-token sequences,
soft-capping, q/k norms, partial rotary and LongRoPE. transformers runs its eager attention,
the reference implementation (4.56's SDPA path drops Gemma 2's attention soft-cap).
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import NEW_FAMILIES
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.config.lora import LoRAArgs
from tunelab.generation import generate
from tunelab.models import from_hf_config, load_pretrained
from tunelab.modules import document_causal_mask, positions_from_document_ids
from tunelab.peft import (
    adapter_state_dict,
    apply_lora,
    get_adapter_params,
    merged_state_dict,
    save_peft_adapter,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

FAMILIES = list(NEW_FAMILIES)
TOLERANCE = 1e-4
# 17 tokens: past the window (5) and, for Phi-3, past LongRoPE's original length (12).
SEQ_LEN = 17
MODEL_TYPES = {"gemma3": "gemma3_text"}


def _hf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _tokens(seq_len: int = SEQ_LEN, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 301, (batch, seq_len), generator=torch.Generator().manual_seed(1))


def _max_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_past_the_window(tiny_hf_model_dir, family):
    path = tiny_hf_model_dir(family)
    hf_model, model = _hf(path), load_pretrained(path)
    assert model.args.family == MODEL_TYPES.get(family, family)
    assert model.args.layer_types is not None and model.args.sliding_window == 5
    for seq_len in (10, SEQ_LEN):  # Phi-3: short, then long LongRoPE factors
        tokens = _tokens(seq_len)
        with torch.no_grad():
            ours, theirs = model(tokens), hf_model(tokens).logits
        assert _max_error(ours, theirs) <= TOLERANCE, (family, seq_len)
    # The window bites: the same model without it gives other logits.
    model.args.layer_types = None
    with torch.no_grad():
        assert _max_error(model(tokens), theirs) > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_are_bit_identical_to_transformers(tiny_hf_model_dir, family):
    """Every cast where transformers casts (Gemma's fp32 norm scale, its rounded embedding
    scale): bf16 logits equal, bit for bit, those of transformers running the same attention
    kernel (SDPA, or for soft-capped Gemma 2 the explicit path both use)."""
    path = tiny_hf_model_dir(family)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.bfloat16,
        attn_implementation="eager" if family == "gemma2" else "sdpa",
    ).eval()
    model = load_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(_tokens()), hf_model(_tokens()).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_equal_separate_documents(tiny_hf_model_dir, family):
    """The training path: a document mask plus restarting positions, with window and caps."""
    path = tiny_hf_model_dir(family)
    hf_model, model = _hf(path), load_pretrained(path)
    lengths = (9, 8)
    tokens = _tokens(sum(lengths), batch=1)
    document_ids = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = model(
            tokens,
            mask=document_causal_mask(document_ids),
            input_pos=positions_from_document_ids(document_ids),
        )
        start = 0
        for length in lengths:
            alone = hf_model(tokens[:, start : start + length]).logits
            assert _max_error(packed[:, start : start + length], alone) <= TOLERANCE
            start += length


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_back_in_transformers(tiny_hf_model_dir, tmp_path, family):
    source = tiny_hf_model_dir(family)
    model = load_pretrained(source)
    adapter = model.state_dict_adapter
    tokens = _tokens()
    with torch.no_grad():
        expected = model(tokens)
    # As the recipes export (config copied from the source), and with the family's own config.
    save_hf_sharded(adapter.to_hf(model.state_dict()), tmp_path / "copied", source_dir=source)
    save_hf_sharded(adapter.to_hf(model.state_dict()), tmp_path / "written")
    config = adapter.hf_config(torch.float32)
    (tmp_path / "written" / "config.json").write_text(json.dumps(config))
    assert from_hf_config(tmp_path / "written").args == model.args
    for folder in ("copied", "written"):
        hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / folder,
            dtype=torch.float32,
            attn_implementation="eager",
            output_loading_info=True,
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], folder
        with torch.no_grad():
            assert _max_error(hf_model.eval()(tokens).logits, expected) <= TOLERANCE, folder


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_generation_equals_full_forward_and_transformers(tiny_hf_model_dir, family):
    path = tiny_hf_model_dir(family)
    model = load_pretrained(path)
    prompt = _tokens(4, batch=1)
    # 4 + 14 tokens: past the window and past Phi-3's original length, where LongRoPE
    # switches factors (generation re-encodes there, as transformers does).
    new_tokens = 14
    tokens = prompt
    with torch.no_grad():  # no cache: the whole sequence again for every token
        for _ in range(new_tokens):
            next_token = model(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
    cached = generate(model, prompt[0].tolist(), max_new_tokens=new_tokens)
    assert cached == tokens[0, 4:].tolist()
    expected = _hf(path).generate(
        prompt,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        attention_mask=torch.ones_like(prompt),
    )
    expected = expected[0, 4:].tolist()
    if family == "phi3" and int(transformers.__version__.split(".")[0]) < 5:
        # transformers 4.56 drops its cache where LongRoPE switches but then encodes only the
        # last token, so its tokens after that point are wrong; compare up to it.
        switch = model.rope_recompute_position() - prompt.shape[1]
        cached, expected = cached[: switch + 1], expected[: switch + 1]
    assert cached == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapter_loads_in_peft_and_merge_loads_in_transformers(
    tiny_hf_model_dir, tmp_path, family
):
    """One process: every linear adapted (Phi-3's fused ones too), PEFT's names and numbers."""
    path = tiny_hf_model_dir(family)
    model = load_pretrained(path)
    swapped = apply_lora(model, LoRAArgs(targets="all-linear", rank=4, alpha=8.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in get_adapter_params(model).items():
            if "lora_B" in name:
                param.normal_(std=0.2)
    tokens = _tokens()
    with torch.no_grad():
        expected = model(tokens)
    config = LoRAArgs(rank=4, alpha=8.0, dropout=0.0, use_rslora=False).peft_config(swapped, str(path))  # fmt: skip
    save_peft_adapter(adapter_state_dict(model), config, tmp_path / "adapter")
    adapted = peft.PeftModel.from_pretrained(_hf(path), tmp_path / "adapter").eval()
    theirs = peft.get_peft_model_state_dict(adapted, save_embedding_layers=False)
    assert set(theirs) == set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(theirs) == 2 * len(swapped)
    merged = model.state_dict_adapter.to_hf(merged_state_dict(model))
    save_hf_sharded(merged, tmp_path / "merged", source_dir=path)
    with torch.no_grad():
        assert _max_error(adapted(tokens).logits, expected) <= TOLERANCE
        assert _max_error(_hf(tmp_path / "merged")(tokens).logits, expected) <= TOLERANCE
        assert _max_error(_hf(path)(tokens).logits, expected) > 1e-2


_LONG_FACTORS = {"short_factor": [1.0] * 48, "long_factor": [1.5] * 48}
# The shapes of released checkpoints (their config.json keys that set parameter shapes).
PUBLISHED = {
    "Qwen/Qwen3-0.6B": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    "Qwen/Qwen3-8B": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)),
    "mistralai/Mistral-Nemo-Instruct-2407": ("MistralConfig", dict(
        vocab_size=131072, hidden_size=5120, intermediate_size=14336, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=None)),
    "google/gemma-2-2b-it": ("Gemma2Config", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256)),
    "google/gemma-3-1b-it": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512)),
    "microsoft/Phi-4-mini-instruct": ("Phi3Config", dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75,
        tie_word_embeddings=True, max_position_embeddings=131072,
        original_max_position_embeddings=4096, pad_token_id=199999,
        rope_scaling={"type": "longrope", **_LONG_FACTORS})),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shapes_give_transformers_parameter_names_and_shapes(name):
    config_class, kwargs = PUBLISHED[name]
    config = getattr(transformers, config_class)(**kwargs)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(config)
        ours = from_hf_config(config.to_dict())
    expected = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    if ours.args.tie_embeddings:
        expected.pop("lm_head.weight", None)
    hf_state = ours.state_dict_adapter.to_hf(ours.state_dict())
    assert {k: tuple(v.shape) for k, v in hf_state.items()} == expected
