"""llama.cpp runs tunelab's GGUF export of the mixture-of-experts families.

Mixtral (llama.cpp's ``llama`` with experts) is the embedded tiny MoE (``assets/tiny_moe``, the
tiny Llama upcycled, logits about 12 in size); Qwen3-MoE (``qwen3moe``) a tiny random one with
the tiny tokenizer. Each is exported to f32 and f16 once. llama.cpp runs with a float32 KV cache
(its default float16 cache alone moved the Mixtral's f16 logits by up to 1.2e-2, measured), so
the f32 file shows the conversion itself is exact to float32 rounding.
"""

import shutil

import numpy as np
import pytest
import torch

from tests.gguf_checks import (
    PROMPTS,
    llama,
    llama_greedy,
    llama_logits,
    prompt_ids,
    tunelab_greedy,
    tunelab_logits,
)
from tunelab._paths import assets_dir
from tunelab.checkpoint.gguf_export import export_gguf
from tunelab.models import load_pretrained

pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")

TINY = assets_dir() / "tiny"
TOLERANCES = {"f32": 1e-4, "f16": 1e-2}
QWEN3_MOE = dict(
    vocab_size=810, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
    num_hidden_layers=2, intermediate_size=80, moe_intermediate_size=32, num_experts=4,
    num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)  # fmt: skip


def _qwen3_moe(folder):
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**QWEN3_MOE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)  # routing far from uniform
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY / file, folder / file)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(family, quant) -> (model folder, GGUF file), made once."""
    root, result = tmp_path_factory.mktemp("gguf_moe"), {}
    for family in ("mixtral", "qwen3_moe"):
        folder = root / family / "epoch_0"
        if family == "mixtral":
            shutil.copytree(assets_dir() / "tiny_moe", folder)
        else:
            _qwen3_moe(folder)
        for quant in TOLERANCES:
            path = shutil.copy(export_gguf(folder, quant=quant), root / f"{family}-{quant}.gguf")
            result[family, quant] = (folder, path)
    return result


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TINY)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("quant", list(TOLERANCES))
def test_llama_cpp_logits_and_greedy_equal_tunelab(exported, hf_tokenizer, family, quant):
    folder, path = exported[family, quant]
    ours = load_pretrained(folder, dtype=torch.float32)
    theirs = llama(path, type_k=0, type_v=0, flash_attn=False)  # float32 KV cache
    assert theirs.metadata["general.architecture"] == (
        "llama" if family == "mixtral" else "qwen3moe"
    )
    for prompt in PROMPTS:
        ids = prompt_ids(hf_tokenizer, prompt)
        difference = np.abs(llama_logits(theirs, ids) - tunelab_logits(ours, ids)).max()
        assert difference < TOLERANCES[quant], (family, quant, prompt, difference)
        if quant == "f16":  # the file users run; the f32 file's logits already prove more
            assert llama_greedy(theirs, ids) == tunelab_greedy(ours, ids), (family, prompt)
