"""Reward models of every family against transformers' ``*ForSequenceClassification``.

For each dense family (tests/conftest.py's tiny random checkpoints) and each MoE family that
transformers has a sequence classifier for (Qwen3-MoE, Mixtral, gpt-oss): a hub-layout classifier
folder loads into tunelab with the scores transformers computes, tunelab's export of it loads
back in transformers with the same scores, and a causal-LM folder becomes a classifier with a
fresh head (its ``lm_head`` left out) whose export transformers loads too.
"""

import json

import pytest
import torch

from tests.conftest import TINY_FAMILIES, build_tiny_hf_model
from tests.interop.test_models_gpt_oss import build_tiny_gpt_oss
from tests.interop.test_models_moe import MOE_FAMILIES, build_tiny_moe
from tunelab.checkpoint.export import export_hf
from tunelab.config.sections import RewardModelSetupArgs
from tunelab.models.classifier import sequence_scores
from tunelab.training import build_model

transformers = pytest.importorskip("transformers")

FAMILIES = [*TINY_FAMILIES, *MOE_FAMILIES, "gpt_oss"]
PAD = 0
TOLERANCE = 1e-5


def _causal_model(family: str):
    if family == "gpt_oss":  # sinks, biases, alternating sliding window (dense expert weights)
        return build_tiny_gpt_oss()[0]
    return build_tiny_moe(family) if family in MOE_FAMILIES else build_tiny_hf_model(family)


def _tokens(vocab: int) -> torch.Tensor:
    """Three rows, two right-padded, no pad id inside a row."""
    tokens = torch.randint(1, vocab, (3, 13), generator=torch.Generator().manual_seed(1))
    tokens[0, 9:] = PAD
    tokens[2, 4:] = PAD
    return tokens


def _hf_scores(folder, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(tokens).logits[:, 0]


def _ours(folder):
    model = build_model(RewardModelSetupArgs(path=str(folder)), device=torch.device("cpu"), seed=3)
    model.pad_token_id = PAD
    return model.eval()


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    """``make(family) -> Path``: a hub-layout sequence classifier (random score head)."""
    built = {}

    def make(family: str):
        if family not in built:
            causal = _causal_model(family)
            config = causal.config
            mapping = (
                transformers.models.auto.modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
            )
            if type(config) not in mapping:  # gemma3's text model: transformers 5 added its class
                pytest.skip(
                    f"transformers {transformers.__version__} has no sequence classifier for "
                    f"{type(config).__name__}"
                )
            config.num_labels, config.pad_token_id = 1, PAD
            torch.manual_seed(0)
            model = transformers.AutoModelForSequenceClassification.from_config(
                config, dtype=torch.float32
            )
            # The body of the causal model (its non-trivial norms), a head of visible scale.
            model.model.load_state_dict(causal.model.state_dict())
            with torch.no_grad():
                model.score.weight.normal_(0.0, 0.5)
            path = tmp_path_factory.mktemp(f"cls_{family}")
            model.save_pretrained(path)
            built[family] = path
        return built[family]

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_classifier_folder_scores_and_export(classifier_dir, tmp_path, family):
    folder = classifier_dir(family)
    config = json.loads((folder / "config.json").read_text())
    tokens = _tokens(config["vocab_size"])
    theirs = _hf_scores(folder, tokens)
    model = _ours(folder)
    assert not hasattr(model, "lm_head")
    with torch.no_grad():
        ours = sequence_scores(model, tokens, PAD)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=TOLERANCE)
    export = export_hf(model, tmp_path / "export", base_checkpoint_dir=folder)
    exported = json.loads((export / "config.json").read_text())
    assert exported["architectures"] == config["architectures"]
    assert exported["num_labels"] == 1 and exported["pad_token_id"] == PAD
    torch.testing.assert_close(_hf_scores(export, tokens), theirs, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("family", ["llama3_1", "qwen2", "mixtral"])
def test_causal_folder_gets_a_fresh_head(tmp_path, family):
    """From a causal LM (tied or not): a seeded head, no lm_head, an export transformers reads."""
    base = tmp_path / "base"
    _causal_model(family).save_pretrained(base)
    model = _ours(base)
    again = _ours(base)
    torch.testing.assert_close(model.score.weight, again.score.weight, rtol=0, atol=0)
    assert 0.01 < model.score.weight.std().item() < 0.04  # score_init_std 0.02
    config = json.loads((base / "config.json").read_text())
    tokens = _tokens(config["vocab_size"])
    with torch.no_grad():
        ours = sequence_scores(model, tokens, PAD)
    export = export_hf(model, tmp_path / "export", base_checkpoint_dir=base)
    assert json.loads((export / "config.json").read_text())["architectures"] == [
        config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    ]
    torch.testing.assert_close(_hf_scores(export, tokens), ours, rtol=0, atol=TOLERANCE)
