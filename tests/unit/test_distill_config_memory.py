"""The memory notes of the two large distillation configs match the models' real sizes.

Each config's header states the bf16 weights of its teacher and student (the "memory column"
of issue 43); here the four models are built on the meta device from their published
``config.json`` dimensions and their parameters counted.
"""

from pathlib import Path

import pytest
import torch

from tunelab.models import from_hf_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LLAMA = {"model_type": "llama", "vocab_size": 128256, "rope_theta": 500000.0}
QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "rope_theta": 1000000.0}
# The published config.json dimensions (meta-llama/Llama-3.1-*-Instruct, Qwen/Qwen3-*).
MODELS = {
    "Llama-3.1-70B": LLAMA | {"hidden_size": 8192, "intermediate_size": 28672,
                              "num_hidden_layers": 80, "num_attention_heads": 64,
                              "num_key_value_heads": 8, "tie_word_embeddings": False},
    "Llama-3.1-8B": LLAMA | {"hidden_size": 4096, "intermediate_size": 14336,
                             "num_hidden_layers": 32, "num_attention_heads": 32,
                             "num_key_value_heads": 8, "tie_word_embeddings": False},
    "Qwen3-8B": QWEN3 | {"hidden_size": 4096, "intermediate_size": 12288,
                         "num_hidden_layers": 36, "num_attention_heads": 32,
                         "num_key_value_heads": 8, "tie_word_embeddings": False},
    "Qwen3-1.7B": QWEN3 | {"hidden_size": 2048, "intermediate_size": 6144,
                           "num_hidden_layers": 28, "num_attention_heads": 16,
                           "num_key_value_heads": 8, "tie_word_embeddings": True},
}  # fmt: skip


def _bf16_gigabytes(name: str) -> float:
    config = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5} | MODELS[name]
    with torch.device("meta"):
        model = from_hf_config(config)
    return 2 * sum(param.numel() for param in model.parameters()) / 1e9


def _header(config: str) -> str:
    text = (CONFIGS / config).read_text()
    return " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))


@pytest.mark.parametrize(
    "config,teacher,student,stated",
    [
        ("llama3_1/70B_to_8B_distill.yaml", "Llama-3.1-70B", "Llama-3.1-8B",
         ("teacher 141 GB", "4 x 16 GB")),
        ("qwen3/8B_to_1.7B_distill_lora.yaml", "Qwen3-8B", "Qwen3-1.7B",
         ("teacher 16.4 GB", "student 3.4 GB")),
    ],
)  # fmt: skip
def test_the_stated_weight_sizes_are_the_models_bf16_parameters(config, teacher, student, stated):
    header = _header(config)
    for phrase in stated:
        assert phrase in header, (config, phrase)
    teacher_text, student_text = stated
    teacher_gb = float(teacher_text.split()[-2])
    student_gb = float(student_text.split()[-2])
    assert abs(_bf16_gigabytes(teacher) - teacher_gb) <= 0.01 * teacher_gb, teacher
    assert abs(_bf16_gigabytes(student) - student_gb) <= 0.02 * student_gb, student
