"""``tunelab export step_N --to gguf --config ...``: a committed step checkpoint as a model.

On the session's shared 2-process ``tiny/lora`` and ``tiny/full`` runs (COMMON: 6 steps, saved
every 3, exported at the end): the last step's export is the run's own epoch export byte for
byte (adapter, merged model, GGUF tensors), so the step's state is the model the run ended
with; the middle step's GGUF computes, in llama.cpp, what tunelab computes with that step's
model. A step made for another model, a damaged step and a step without the run's config are
refused in one line.
"""

import shutil
import subprocess

import gguf
import numpy as np
import pytest
import torch

from tests.gguf_checks import (
    PROMPTS,
    llama,
    llama_greedy,
    llama_logits,
    tunelab_greedy,
    tunelab_logits,
)
from tests.recipes.conftest import COMMON, STEPS, TUNELAB, run_env
from tunelab.data import load_tokenizer
from tunelab.models import load_pretrained

pytestmark = pytest.mark.slow

CONFIGS = {"lora": "tiny/lora", "full": "tiny/full"}


def _export(out, step, config, *more):
    return subprocess.run(
        [TUNELAB, "export", str(out / f"step_{step}"), "--to", "gguf", "--config", config,
         f"output_dir={out}", "schedule.batch_size=8", *COMMON, *more],
        capture_output=True, text=True, env=run_env(),
    )  # fmt: skip


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def exported(request, tmp_path_factory):
    """(kind, a copy of the run with step_3, the last step and epoch_0 exported to GGUF)."""
    kind = request.param
    run = request.getfixturevalue({"lora": "lora_2p", "full": "full_2p"}[kind])
    out = tmp_path_factory.mktemp(f"step_export_{kind}") / "out"
    shutil.copytree(run, out, ignore=shutil.ignore_patterns(".tunelab.lock"))
    for step in (3, STEPS):
        result = _export(out, step, CONFIGS[kind])
        assert result.returncode == 0, result.stderr
        assert f"Wrote {out / f'step_{step}_export'} (Hugging Face)" in result.stdout
    # The run exported no GGUF (COMMON): the epoch's, for comparison, from its HF export.
    result = subprocess.run([TUNELAB, "export", str(out / "epoch_0"), "--to", "gguf"],
                            capture_output=True, text=True, env=run_env())  # fmt: skip
    assert result.returncode == 0, result.stderr
    return kind, out


def _tensors(path):
    return {t.name: (t.tensor_type, np.array(t.data)) for t in gguf.GGUFReader(path).tensors}


def test_the_last_steps_export_is_the_runs_epoch_export(exported):
    kind, out = exported
    ours, epoch = out / f"step_{STEPS}_export", out / "epoch_0"
    names = ["model.safetensors"] + (
        ["adapter/adapter_model.safetensors"] if kind == "lora" else []
    )
    for name in names:
        assert (ours / name).read_bytes() == (epoch / name).read_bytes(), name
    theirs = _tensors(epoch / "gguf" / "model-f16.gguf")
    mine = _tensors(ours / "gguf" / "model-f16.gguf")
    assert mine.keys() == theirs.keys()
    for name, (qtype, data) in mine.items():
        assert qtype == theirs[name][0] and np.array_equal(data, theirs[name][1]), name
    # Checksummed like every export; the committed steps are untouched (their manifests hold).
    verify = subprocess.run([TUNELAB, "verify", str(out)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    for name in ("step_3", "step_3_export", f"step_{STEPS}", f"step_{STEPS}_export"):
        assert f"ok     {out / name}\n" in verify.stdout, verify.stdout


def test_llama_cpp_computes_the_middle_steps_model(exported):
    _, out = exported
    export = out / "step_3_export"
    middle, last = (
        load_pretrained(out / f"step_{s}_export", dtype=torch.float32) for s in (3, STEPS)
    )
    theirs = llama(export / "gguf" / "model-f16.gguf")
    tokenizer = load_tokenizer(export)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        ours = tunelab_logits(middle, ids)
        # Step 3's model is not the run's last one: the export took step 3's parameters.
        assert np.abs(ours - tunelab_logits(last, ids)).max() > 1e-3, prompt
        difference = np.abs(llama_logits(theirs, ids) - ours).max()
        assert difference < 1e-2, (prompt, difference)
        assert llama_greedy(theirs, ids) == tunelab_greedy(middle, ids), prompt


def test_a_step_is_refused_for_another_model_damage_or_no_config(exported, tmp_path):
    kind, out = exported
    other = CONFIGS["full" if kind == "lora" else "lora"]
    result = _export(out, 3, other)
    assert result.returncode == 1, result.stderr
    assert f"{out / 'step_3'} was made with another" in result.stderr
    assert "export it with the config of the run that made it" in result.stderr
    damaged = tmp_path / "out"
    shutil.copytree(out / "step_3", damaged / "step_3")
    data = sorted((damaged / "step_3").glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    result = _export(damaged, 3, CONFIGS[kind])
    assert result.returncode == 1 and "checksum" in result.stderr, result.stderr
    assert not (damaged / "step_3_export").exists()
    result = subprocess.run([TUNELAB, "export", str(out / "step_3"), "--to", "gguf"],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 1
    assert "is a training checkpoint" in result.stderr and "--config" in result.stderr


def test_two_processes_write_the_bytes_one_process_writes(exported, tmp_path):
    """``--nproc 2``: the model sharded over 2 processes (FSDP2, as the run built it), each
    writing its rows of the Hugging Face export and its tensors of the GGUF file; every file
    equals the 1-process export's (the manifests list other written pieces, the same files).
    A failure in the processes is one line and exit 1."""
    kind, out = exported
    if kind != "lora":
        pytest.skip("checked on the LoRA run: adapter, sharded merge and GGUF")
    copy = tmp_path / "out"
    shutil.copytree(out / f"step_{STEPS}", copy / f"step_{STEPS}")
    result = _export(copy, STEPS, CONFIGS[kind], "--nproc", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Wrote ") == 1, result.stdout  # rank 0 speaks
    one, two = out / f"step_{STEPS}_export", copy / f"step_{STEPS}_export"
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file())
    assert "gguf/model-f16.gguf" in map(str, files)
    for name in files:
        if name.name != "tunelab_manifest.json":
            assert (two / name).read_bytes() == (one / name).read_bytes(), name
    verify = subprocess.run([TUNELAB, "verify", str(two)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # The export's own form, its GGUF written again by 2 processes: the same bytes.
    result = subprocess.run([TUNELAB, "export", str(two), "--to", "gguf", "--nproc", "2"],
                            capture_output=True, text=True, env=run_env())  # fmt: skip
    assert result.returncode == 0 and result.stdout.count("Wrote ") == 1, result.stderr
    for name in ("gguf/model-f16.gguf", "gguf/Modelfile"):
        assert (two / name).read_bytes() == (one / name).read_bytes(), name
    # A damaged export: rank 0's verification fails, both processes stop, one line is said.
    weights = two / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    result = subprocess.run([TUNELAB, "export", str(two), "--to", "gguf", "--nproc", "2"],
                            capture_output=True, text=True, env=run_env())  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("tunelab: error: ") and result.stderr.count("\n") == 1
    assert "fails verification" in result.stderr, result.stderr
