"""Helpers for tests that load tunelab outputs with transformers."""

import pytest
import torch


@pytest.fixture
def load_hf_causal_lm():
    """``load(path) -> (model, loading_info)`` through ``AutoModelForCausalLM``, fp32, eval."""
    transformers = pytest.importorskip("transformers")

    def load(path):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True
        )
        return model.eval(), info

    return load
