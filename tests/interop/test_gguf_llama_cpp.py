"""llama.cpp loads tunelab's GGUF export of each supported family and computes what tunelab does.

Each family's tiny random model (the embedded tiny tokenizer, its vocabulary size) is exported
to f16 with ``tunelab export --to gguf`` and loaded by llama.cpp through llama-cpp-python.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from tests.conftest import build_tiny_hf_model
from tests.gguf_checks import (
    PROMPTS,
    TEXTS,
    llama,
    llama_greedy,
    llama_logits,
    prompt_ids,
    tunelab_greedy,
    tunelab_logits,
    with_float16_gelu,
)
from tunelab._paths import assets_dir
from tunelab.checkpoint.gguf_export import export_gguf
from tunelab.models import load_pretrained

TINY = assets_dir() / "tiny"

pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
VOCAB = 810  # the tiny tokenizer's
# Family -> (conftest family, config overrides). llama3_2 brings llama3 rope scaling (the
# rope_freqs tensor) and tied embeddings; qwen2 biases; qwen3 q/k norms and a head_dim unlike
# hidden / heads; mistral the llama architecture from MistralConfig (no sliding window).
FAMILIES = {
    "llama": ("llama3_2", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"use_sliding_window": False, "sliding_window": None}),
    "mistral": ("mistral", {"sliding_window": None}),
    # Gemma: norm weights +1, soft-capping, sliding windows (5, shorter than the prompts),
    # tied embeddings. llama.cpp fixes the attention scale to 1/sqrt(head_dim) and the
    # sliding/global pattern (gemma2: every 2nd layer global, gemma3: every 6th), so the
    # configs follow those; gemma3's global layers use linear rope scaling.
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 24}),
    "gemma3_text": (
        "gemma3",
        {
            "query_pre_attn_scalar": 24,
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        },
    ),
    # phi3: fused qkv and gate_up, partial rotary (0.75); LongRoPE and a sliding window shorter
    # than the context are refused (tests/unit/test_gguf_export.py).
    "phi3": ("phi3", {"rope_scaling": None, "sliding_window": None}),
}
GELU_FAMILIES = ("gemma2", "gemma3_text")
# The tiny Gemmas (embeddings scaled by 8, soft-cap 5, 0.1 init) are sharp: llama.cpp's float16
# weights, KV cache and GELU table move their f16 logits up to 7.4e-2 (measured), where the
# other families stay under 1e-2. The f32 file is checked to 2e-3 below.
GEMMA_F16_TOLERANCE = 1e-1


def _tiny_family(root, family):
    name, overrides = FAMILIES[family]
    model = build_tiny_hf_model(name, vocab_size=VOCAB, **overrides).eval()
    folder = root / family / "epoch_0"  # as a run lays it out (general.name "epoch_0")
    model.save_pretrained(folder)
    for file in TOKENIZER_FILES:
        shutil.copy(TINY / file, folder / file)
    return folder


def _export(folder, quant):
    # In process (the CLI is tested in tests/unit/test_gguf_export.py and the recipe test).
    return export_gguf(folder, quant=quant)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Family -> (model folder, its f16 GGUF, its f32 GGUF or None), made once."""
    root = tmp_path_factory.mktemp("gguf_families")
    result = {}
    for family in FAMILIES:
        folder, f32 = _tiny_family(root, family), None
        if family in GELU_FAMILIES:
            f32 = shutil.copy(_export(folder, "f32"), root / f"{family}-f32.gguf")
        result[family] = (folder, _export(folder, "f16"), f32)
    return result


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TINY)


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_logits_and_greedy_equal_tunelab(exported, hf_tokenizer, family):
    folder, path, _ = exported[family]
    ours, theirs = load_pretrained(folder, dtype=torch.float32), llama(path)
    tolerance = GEMMA_F16_TOLERANCE if family in GELU_FAMILIES else 1e-2
    for prompt in PROMPTS:
        ids = prompt_ids(hf_tokenizer, prompt)
        difference = np.abs(llama_logits(theirs, ids) - tunelab_logits(ours, ids)).max()
        assert difference < tolerance, (family, prompt, difference)
        assert llama_greedy(theirs, ids) == tunelab_greedy(ours, ids), (family, prompt)


@pytest.mark.parametrize("family", GELU_FAMILIES)
def test_gemma_f32_file_computes_tunelab_with_ggml_gelu(exported, hf_tokenizer, family):
    """The conversion itself is exact: the f32 file equals tunelab's model once tunelab's GELU
    rounds as ggml's CPU kernel does (a float16 table; 5e-3 apart without that), with a float32
    KV cache (its default float16 cache alone moves these logits by 2.4e-2)."""
    folder, _, f32 = exported[family]
    ours = with_float16_gelu(load_pretrained(folder, dtype=torch.float32))
    theirs = llama(f32, type_k=0, type_v=0, flash_attn=False)  # float32 KV cache (GGML_TYPE_F32)
    for prompt in PROMPTS:
        ids = prompt_ids(hf_tokenizer, prompt)
        difference = np.abs(llama_logits(theirs, ids) - tunelab_logits(ours, ids)).max()
        assert difference < 2e-3, (family, prompt, difference)


def test_tokenizer_ids_equal_transformers(exported, hf_tokenizer):
    model = llama(exported["llama"][1])
    for text in TEXTS:
        ours = model.tokenize(text.encode(), add_bos=True, special=True)
        assert ours == hf_tokenizer(text)["input_ids"], text


def test_chat_template_renders_as_transformers(exported, hf_tokenizer):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    model = llama(exported["llama"][1])
    template = model.metadata["tokenizer.chat_template"]
    assert template == json.loads((TINY / "tokenizer_config.json").read_text())["chat_template"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    formatter = Jinja2ChatFormatter(
        template, eos_token="<|end_of_text|>", bos_token="<|begin_of_text|>",
        add_generation_prompt=True,
    )  # fmt: skip
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert formatter(messages=messages).prompt == expected
