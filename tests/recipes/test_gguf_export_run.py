"""A 2-process LoRA run with ``checkpoint.export_formats=[hf,gguf]``: the trained, merged model's GGUF.

The file the 2 ranks wrote together equals, byte for byte, the one ``tunelab export`` writes
in one process from the same export; llama.cpp computes the trained model's logits and greedy
continuation; ``tunelab verify`` checks the GGUF folder with the rest of the output_dir.
"""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.gguf_checks import (
    PROMPTS,
    llama,
    llama_greedy,
    llama_logits,
    perplexity,
    tunelab_greedy,
    tunelab_logits,
)
from tests.recipes.conftest import COMMON, TUNELAB, run_env, torchrun, tunelab_run
from tunelab._paths import assets_dir
from tunelab.data import load_tokenizer
from tunelab.models import load_pretrained

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf_run") / "out"
    tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", *COMMON,
        "checkpoint.export_formats=[hf,gguf]",
    )  # fmt: skip
    return out


def test_the_run_wrote_a_verified_gguf_folder(run):
    assert sorted(p.name for p in (run / "epoch_0" / "gguf").iterdir()) == [
        "Modelfile", "model-f16.gguf", "tunelab_manifest.json",
    ]  # fmt: skip
    result = subprocess.run([TUNELAB, "verify", str(run)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_two_processes_write_the_bytes_one_process_writes(run, tmp_path):
    copy = tmp_path / "epoch_0"
    shutil.copytree(run / "epoch_0", copy)
    shutil.rmtree(copy / "gguf")
    result = subprocess.run(
        [TUNELAB, "export", str(copy), "--to", "gguf"], capture_output=True, text=True,
        env=run_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    two, one = run / "epoch_0" / "gguf", copy / "gguf"
    for name in ("model-f16.gguf", "Modelfile", "tunelab_manifest.json"):
        assert (two / name).read_bytes() == (one / name).read_bytes(), name


def test_llama_cpp_computes_the_trained_models_logits(run):
    export = run / "epoch_0"
    ours, theirs = (
        load_pretrained(export, dtype=torch.float32),
        llama(export / "gguf" / "model-f16.gguf"),
    )
    tokenizer = load_tokenizer(export)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        difference = np.abs(llama_logits(theirs, ids) - tunelab_logits(ours, ids)).max()
        assert difference < 1e-2, (prompt, difference)
        assert llama_greedy(theirs, ids) == tunelab_greedy(ours, ids), prompt


# Perplexity on the embedded validation data, relative to f16's: the issue's 2% for q8_0 (its
# logits move by up to 0.14, beyond the 5e-2 alternative); 5% for q4_0, which the issue bounds
# nowhere (measured 2.8% on a 1-process tiny/lora run).
_PERPLEXITY_TOLERANCE = {"q8_0": 0.02, "q4_0": 0.05}


@pytest.mark.parametrize("quant", sorted(_PERPLEXITY_TOLERANCE))
def test_quantized_perplexity_near_f16(run, tmp_path, quant):
    copy = tmp_path / "epoch_0"
    shutil.copytree(run / "epoch_0", copy)
    result = subprocess.run(
        [TUNELAB, "export", str(copy), "--to", "gguf", "--quant", quant], capture_output=True,
        text=True, env=run_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    tokenizer = load_tokenizer(copy)
    rows = [json.loads(line) for line in (assets_dir() / "tiny" / "sft_val.jsonl").open()]
    sequences = [tokenizer.encode(" ".join(row.values())) for row in rows[:40]]
    f16 = perplexity(llama(run / "epoch_0" / "gguf" / "model-f16.gguf"), sequences)
    quantized = perplexity(llama(copy / "gguf" / f"model-{quant}.gguf"), sequences)
    assert abs(quantized / f16 - 1) < _PERPLEXITY_TOLERANCE[quant], (f16, quantized)


def test_sys_executable_has_llama_cpp():
    # The dev extra installs llama-cpp-python: a CI without it would skip the proof silently.
    result = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True)
    assert result.returncode == 0, result.stderr


_FAILING_RANK = """
import sys
import torch.distributed as dist
from tunelab.checkpoint import gguf_export
from tunelab.errors import CheckpointError

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    def broken(*args):
        raise ValueError("disk on fire")
    gguf_export._stored_pieces = broken
try:
    gguf_export.export_gguf(sys.argv[1])
except CheckpointError as error:
    print(f"rank {dist.get_rank()} refused: {error}", flush=True)
dist.destroy_process_group()
"""


def test_a_rank_that_fails_fails_the_export_on_every_rank(tmp_path):
    export = tmp_path / "epoch_0"
    shutil.copytree(assets_dir() / "tiny", export)
    script = tmp_path / "failing_rank.py"
    script.write_text(_FAILING_RANK)
    result = torchrun(script, str(export))
    for rank in (0, 1):
        assert f"rank {rank} refused: GGUF export to" in result.stdout, result.stdout
    assert "rank 1: ValueError: disk on fire" in result.stdout
    assert not (export / "gguf").exists() and not list(export.glob(".gguf*"))
