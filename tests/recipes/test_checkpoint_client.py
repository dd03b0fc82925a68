"""CheckpointClient guarantees on 2 real processes (gloo): order, no mutation, an async save
that returns and lets training go on while its write is held (not committed until released),
sync after async, retention, corrupt-checkpoint fallback, and the export read back by
transformers/PEFT."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.recipes.conftest import torchrun

SCRIPT = Path(__file__).with_name("client_script.py")
pytestmark = pytest.mark.slow


def test_client_before_process_group_is_a_clear_error(tiny_hf_model_dir, tmp_path):
    result = torchrun(SCRIPT, "order", str(tiny_hf_model_dir("llama3_1")), str(tmp_path))
    assert (
        result.stdout.count("ORDER_ERROR CheckpointClient was built before the process group") == 2
    )


@pytest.fixture(scope="module")
def client_run(tiny_hf_model_dir, tmp_path_factory):
    base = tiny_hf_model_dir("llama3_1", sharded=True)
    out = tmp_path_factory.mktemp("client")
    result = torchrun(SCRIPT, "main", str(base), str(out))
    return base, out, result


def test_saves_exports_retention_and_fallback(client_run):
    _, out, result = client_run
    # The script asserts that save(3) returns while its writer is held on an event, that a
    # training step runs and step 3 stays uncommitted until the event is set, then commits;
    # bitwise-unchanged weights after each save and the export, both checkpoints committed
    # after sync-after-async, retention and the fallback to step 4.
    assert "CLIENT_OK" in result.stdout
    assert "skipping checkpoint" in result.stderr and "step_5" in result.stderr


def test_export_layout_and_interop(client_run):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base, out, _ = client_run
    export = out / "epoch_0"
    assert not (export / "adapter_config.json").exists()
    assert (export / "adapter" / "adapter_config.json").is_file()
    # Same file names as the multi-file base checkpoint.
    base_files = sorted(p.name for p in base.glob("model-*.safetensors"))
    assert sorted(p.name for p in export.glob("model-*.safetensors")) == base_files
    for path in export.glob("model-*.safetensors"):
        with safe_open(path, "pt") as file:
            assert file.metadata() == {"format": "pt"}
    reference = torch.load(out / "reference_logits.pt", weights_only=True)

    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        export, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        merged_logits = merged(reference["tokens"]).logits
    assert (merged_logits - reference["logits"]).abs().max() < 1e-4

    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base_model, export / "adapter")
    with torch.no_grad():
        adapter_logits = with_adapter(reference["tokens"]).logits
    assert (adapter_logits - reference["logits"]).abs().max() < 1e-4
