"""GGUF export without llama.cpp: file layout, checksums, refusals, crash safety, the Modelfile."""

import base64
import errno
import fcntl
import functools
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.gguf_checks import precompiled_charsmap
from tunelab._paths import assets_dir
from tunelab.checkpoint import gguf_export
from tunelab.checkpoint.gguf_export import export_gguf
from tunelab.checkpoint.ollama import modelfile
from tunelab.data.chat_template import ChatTemplate
from tunelab.errors import CheckpointError
from tunelab.formats.gguf_model import (
    QUANTIZATIONS,
    family_of,
    permute_rows,
    plan_tensor,
    quantization_problem,
)
from tunelab.formats.integrity import verify_folder

TINY = assets_dir() / "tiny"


@pytest.fixture
def tiny(tmp_path):
    folder = tmp_path / "epoch_0"
    shutil.copytree(TINY, folder)
    return folder


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tunelab.cli", *map(str, args)], capture_output=True, text=True
    )


def test_tensors_read_back_as_written_and_q_k_rows_permuted(tiny):
    path = export_gguf(tiny, quant="f32")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(tiny / "model.safetensors")
    # llama.cpp's rope pairs adjacent features: head h's row 2i+j is HF's row j*d/2+i.
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert np.array_equal(tensors["blk.0.attn_q.weight"], permute_rows(q, 4))
    assert np.array_equal(tensors["blk.0.attn_q.weight"][1], q[16])  # head 0: d=32, i=0, j=1
    k = weights["model.layers.1.self_attn.k_proj.weight"]
    assert np.array_equal(tensors["blk.1.attn_k.weight"][32 + 3], k[32 + 16 + 1])  # head 1
    assert np.array_equal(
        tensors["blk.2.ffn_down.weight"], weights["model.layers.2.mlp.down_proj.weight"]
    )
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    fields = reader.fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
    assert fields["llama.attention.head_count_kv"].contents() == 2


def test_experts_are_stacked_per_projection_and_the_router_stays_f32(tmp_path):
    folder = tmp_path / "epoch_0"
    shutil.copytree(assets_dir() / "tiny_moe", folder)
    reader = gguf.GGUFReader(export_gguf(folder, quant="f16"))
    tensors = {t.name: t for t in reader.tensors}
    weights = load_file(folder / "model.safetensors")
    for gguf_name, hf_name in [("gate", "w1"), ("up", "w3"), ("down", "w2")]:
        stacked = [weights[f"model.layers.1.block_sparse_moe.experts.{e}.{hf_name}.weight"]
                   for e in range(4)]  # fmt: skip
        expected = np.stack(stacked).astype(np.float16)
        assert np.array_equal(
            np.array(tensors[f"blk.1.ffn_{gguf_name}_exps.weight"].data), expected
        )
    router = tensors["blk.1.ffn_gate_inp.weight"]
    assert router.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(
        np.array(router.data), weights["model.layers.1.block_sparse_moe.gate.weight"]
    )
    assert reader.fields["llama.expert_count"].contents() == 4
    assert reader.fields["llama.expert_used_count"].contents() == 2


def test_norms_stay_f32_and_matrices_take_the_quantization(tiny):
    reader = gguf.GGUFReader(export_gguf(tiny, quant="q8_0"))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0


def test_checksums_are_verified(tiny):
    path = export_gguf(tiny)
    assert verify_folder(path.parent) == []
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))
    result = _cli("verify", path.parent)
    assert result.returncode == 1 and "model-f16.gguf: content differs" in result.stdout


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt_oss"}, "model_type 'gpt_oss'"),
        (
            {"model_type": "qwen3_moe", "num_experts": 4, "mlp_only_layers": [1]},
            "some layers are dense",
        ),
        (
            {"model_type": "qwen3_moe", "num_experts": 4, "norm_topk_prob": False},
            "norm_topk_prob is false",
        ),
        (
            {"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
            "cannot export phi3 to GGUF: LongRoPE",
        ),
        (
            {"model_type": "phi3", "sliding_window": 5, "max_position_embeddings": 48},
            "sliding_window 5 is shorter than the context",
        ),
    ],
)
def test_unsupported_family_or_feature_is_refused_in_one_line(tiny, change, message):
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**config, **change}))
    result = _cli("export", tiny, "--to", "gguf")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert not (tiny / "gguf").exists()


_GEMMA2 = dict(
    model_type="gemma2", hidden_size=64, num_attention_heads=4, head_dim=24, num_hidden_layers=2,
    query_pre_attn_scalar=24, sliding_window=5, attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"],
)  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query_pre_attn_scalar": 20}, "query_pre_attn_scalar 20 is not 24"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "one global layer in every 2"),
        ({"attn_logit_softcapping": None}, "always soft-caps"),
        (
            {"model_type": "gemma3_text", "layer_types": ["sliding_attention"] * 2,
             "rope_parameters": {"sliding_attention": {"rope_theta": 5000.0}}},
            "rope_local_base_freq 5000.0",
        ),
        ({"model_type": "gemma3_text"}, "one global layer in every 6"),
    ],
)  # fmt: skip
def test_gemma_configs_llama_cpp_computes_differently_are_refused(change, message):
    assert family_of(_GEMMA2, "config.json").name == "gemma2"
    with pytest.raises(CheckpointError, match=message):
        family_of({**_GEMMA2, **change}, "config.json")


F16 = gguf.GGMLQuantizationType.F16


def test_gemma_norm_weights_are_stored_plus_one():
    config = {**_GEMMA2, "vocab_size": 8}
    family = family_of(config, "config.json")
    norm = plan_tensor(
        "model.layers.0.post_feedforward_layernorm.weight", (64,), config, family, F16
    )
    assert (norm.name, norm.offset) == ("blk.0.post_ffw_norm.weight", 1.0)
    proj = plan_tensor("model.layers.0.self_attn.q_proj.weight", (96, 64), config, family, F16)
    assert proj.offset == 0.0


def test_sliding_window_is_refused(tiny):
    config = json.loads((tiny / "config.json").read_text())
    config.update(model_type="qwen2", use_sliding_window=True, sliding_window=5)
    (tiny / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        export_gguf(tiny)


_SPACE = "\u2581"
# The tiny tokenizer's added tokens take ids 0-7.
_ADDED_IDS = [[f"<|added {i}|>", 0.0] for i in range(8)]
_UNIGRAM = {
    "type": "Unigram",
    "vocab": [*_ADDED_IDS, ["<unk>", 0.0], ["a", -2.0]],
    "unk_id": 8,
    "byte_fallback": False,
}
# SentencePiece's normalization map that maps nothing (tokenizers cannot read an empty one).
_IDENTITY_MAP = base64.b64encode(precompiled_charsmap({})).decode()
# T5's merging of extra spaces (as transformers converts its SentencePiece model).
_STRIP_AND_MERGE = [
    {"type": "Strip", "strip_left": False, "strip_right": True},
    {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": _SPACE},
]
_T5_SPACES = {
    "type": "Sequence",
    "normalizers": [
        {"type": "Precompiled", "precompiled_charsmap": _IDENTITY_MAP},
        *_STRIP_AND_MERGE,
    ],
}
_NO_PREFIX = {"type": "Metaspace", "replacement": _SPACE, "split": False, "prepend_scheme": "never"}
_WORDPIECE = {
    "type": "WordPiece",
    "unk_token": "<unk>",
    "continuing_subword_prefix": "##",
    "max_input_chars_per_word": 100,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model": {"type": "Unigram", "vocab": [["<unk>", 0.0]], "unk_id": 0}},
            "Unigram tokenizer falls back to byte tokens",
        ),
        ({"model": _WORDPIECE}, "this one is WordPiece"),
        (
            {"model": _UNIGRAM, "normalizer": _T5_SPACES, "pre_tokenizer": _NO_PREFIX},
            "merges spaces without putting",
        ),
        (
            {
                "model": _UNIGRAM,
                "normalizer": {"type": "Sequence", "normalizers": _STRIP_AND_MERGE},
            },
            "there is none",  # no map that makes tabs and newlines spaces before Strip
        ),
        (
            {"model": {**_UNIGRAM, "unk_id": None}, "normalizer": _T5_SPACES},
            "Unigram tokenizer has no unk_id",
        ),
        (
            {"model": {**_UNIGRAM, "vocab": [*_ADDED_IDS, ["<unk>", -30.0], ["a", -2.0]]}},
            "a special token of this Unigram tokenizer has the lowest score",
        ),
        (
            {
                "model": _UNIGRAM,
                "normalizer": {
                    "type": "Sequence",
                    "normalizers": [
                        {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE},
                        {"type": "Precompiled", "precompiled_charsmap": _IDENTITY_MAP},
                    ],
                },
            },
            "normalizer step Precompiled",  # SentencePiece's map comes first or not at all
        ),
        ({"normalizer": {"type": "NFKC"}}, "normalizer step NFKC"),
        ({"normalizer": None, "pre_tokenizer": {"type": "Whitespace"}}, "pre-tokenizer Whitespace"),
        ({"normalizer": None}, "keeps spaces as they are"),
        (
            {
                "normalizer": None,
                "pre_tokenizer": {
                    "type": "Metaspace",
                    "replacement": _SPACE,
                    "split": True,
                    "prepend_scheme": "always",
                },
            },
            "splits words",
        ),
    ],
)
def test_sentencepiece_tokenizers_llama_cpp_splits_otherwise_are_refused(tiny, change, message):
    data = json.loads((tiny / "tokenizer.json").read_text())
    vocab = {**data["model"]["vocab"], f"a{_SPACE}b": len(data["model"]["vocab"])}
    data["model"].update(byte_fallback=True, vocab=vocab)
    data.update(
        normalizer={"type": "Replace", "pattern": {"String": " "}, "content": _SPACE},
        pre_tokenizer=None,
    )
    data = {**data, **change, "model": {**data["model"], **change.get("model", {})}}
    (tiny / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**config, "vocab_size": len(vocab)}))
    with pytest.raises(CheckpointError, match=message):
        export_gguf(tiny)


@pytest.mark.parametrize("keep_name", [False, True])
def test_a_phi3_name_without_phi3_tokens_still_loads_in_llama_cpp(tmp_path, keep_name, monkeypatch):
    """llama.cpp looks up </s>, <unk>, <s> and <|endoftext|> for a model whose general.name
    contains phi3 or phi-3; the tiny vocabulary has none, so the name is written phi_3."""
    llama_cpp = pytest.importorskip("llama_cpp")
    if keep_name:  # the control: the folder's own name, as written before
        monkeypatch.setattr(gguf_export, "model_name", lambda name, added: name)
    folder = tmp_path / "Phi-3-mini-tuned"
    shutil.copytree(TINY, folder)
    path = export_gguf(folder, quant="f16")
    name = gguf.GGUFReader(path).fields["general.name"].contents()
    load = functools.partial(llama_cpp.Llama, str(path), vocab_only=True, verbose=False)
    if keep_name:
        with pytest.raises(ValueError):
            load()
    else:
        assert name == "Phi_3-mini-tuned"
        assert load().tokenize(b"hi")


def test_a_step_checkpoint_needs_its_runs_config_and_a_commit(tmp_path):
    # Exports of committed steps: tests/recipes/test_step_export.py.
    step = tmp_path / "step_3"
    step.mkdir()
    result = _cli("export", step, "--to", "gguf")
    assert result.returncode == 1
    assert f"{step} is a training checkpoint" in result.stderr and "--config" in result.stderr
    result = _cli("export", step, "--to", "gguf", "--config", "tiny/lora", f"output_dir={tmp_path}")
    assert result.returncode == 1, result.stderr
    assert f"{step} is not a committed checkpoint (no manifest)" in result.stderr
    assert not (tmp_path / "step_3_export").exists()


def test_nproc_below_one_is_refused_in_one_line(tiny):
    # --nproc 2 writing the bytes of 1 process: tests/recipes/test_step_export.py.
    result = _cli("export", tiny, "--to", "gguf", "--nproc", "0")
    assert result.returncode == 1
    assert result.stderr == "tunelab: error: --nproc 0: give 1 or more processes\n"
    assert not (tiny / "gguf").exists()


_CRASH = textwrap.dedent("""
    import os, sys
    from tunelab.checkpoint import gguf_export
    original, written = gguf_export.pwrite_all, []
    def crash(*args):
        written.append(1)
        if len(written) == 2:
            os._exit(9)  # killed mid-write (the tiny file takes 3 writes): no clean-up runs
        return original(*args)
    gguf_export.pwrite_all = crash
    gguf_export.export_gguf(sys.argv[1], quant=sys.argv[2])
""")


@pytest.mark.parametrize("previous", [None, "q8_0"])
def test_an_interrupted_export_leaves_the_previous_file_or_none(tiny, previous):
    before = None
    if previous is not None:
        before = export_gguf(tiny, quant=previous).read_bytes()
    result = subprocess.run([sys.executable, "-c", _CRASH, str(tiny), "f16"], check=False)
    assert result.returncode == 9
    files = sorted(p.name for p in (tiny / "gguf").glob("*")) if before else []
    if previous is None:
        assert not (tiny / "gguf").exists()
    else:
        assert files == ["Modelfile", "model-q8_0.gguf", "tunelab_manifest.json"]
        assert (tiny / "gguf" / "model-q8_0.gguf").read_bytes() == before
        assert verify_folder(tiny / "gguf") == []


def _cached_pages(path) -> tuple[int, int]:
    """``(pages of the file in the page cache, pages of the file)``, by ``mincore``."""
    import ctypes
    import mmap

    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
        start = ctypes.c_char.from_buffer(mapped)
        assert libc.mincore(ctypes.addressof(start), size, vector) == 0, ctypes.get_errno()
        del start
        mapped.close()
    return sum(page & 1 for page in vector), pages


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "cached"])
def test_the_written_gguf_is_dropped_from_the_page_cache(tiny, monkeypatch, direct):
    """With fsync, the pages wholly inside a tensor go to disk with O_DIRECT (none cached), or,
    where it is off, each tensor's bytes are waited for on disk and dropped from the page cache
    once more than _WRITE_BEHIND_BYTES follow them (0 here: at once); the whole file's clean
    pages after the fsync: an export recycles a little cache instead of a new page per byte.
    Without fsync (the control) its pages stay cached."""
    monkeypatch.setattr(gguf_export, "_DIRECT", direct)
    probe = tiny / "probe.bin"
    with open(probe, "wb") as handle:
        handle.write(bytes(1 << 20))
        handle.flush()
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if _cached_pages(probe)[0]:
        pytest.skip(f"{tiny}'s file system keeps pages posix_fadvise drops (tmpfs?)")
    probe.unlink()
    monkeypatch.setattr(gguf_export, "_WRITE_BEHIND_BYTES", 0)
    cached, pages = _cached_pages(export_gguf(tiny, quant="f32"))
    assert pages > 100 and cached == 0, (cached, pages)
    cached, pages = _cached_pages(export_gguf(tiny, quant="f32", sync_files=False))
    assert cached == pages, (cached, pages)


LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The system prompt goes into the first user turn: no per-role template can say that.
MERGED_SYSTEM = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{% set ns = 1 %}"
    "{% elif loop.index0 == 1 %}{{ '[INST] ' + messages[0]['content'] + ' ' + message['content'] "
    "+ ' [/INST]' }}{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
)


def test_modelfile_template_and_stops_from_a_llama3_template():
    template = ChatTemplate(LLAMA3, source="t", special_tokens={"bos_token": "<|begin_of_text|>"})
    text = modelfile("model-f16.gguf", template, ["<|end_of_text|>"])
    assert text.splitlines()[0] == "FROM ./model-f16.gguf"
    assert (
        '{{ else if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>\n\n'
        "{{ .Content }}<|eot_id|>"
    ) in text
    assert text.endswith(
        '<|start_header_id|>assistant<|end_header_id|>\n\n"""\n'
        'PARAMETER stop "<|end_of_text|>"\nPARAMETER stop "<|eot_id|>"\n'
    )
    assert "<|begin_of_text|>" not in text  # llama.cpp adds BOS itself


def test_modelfile_from_chatml_stops_at_im_end():
    text = modelfile("m.gguf", ChatTemplate(CHATML, source="t"), ["<|endoftext|>"])
    assert '{{ if eq .Role "system" }}<|im_start|>system\n{{ .Content }}<|im_end|>\n' in text
    assert 'PARAMETER stop "<|im_end|>"' in text


def test_modelfile_without_template_when_turns_are_not_separable():
    text = modelfile("m.gguf", ChatTemplate(MERGED_SYSTEM, source="t"), ["</s>"])
    assert "TEMPLATE" not in text and 'PARAMETER stop "</s>"' in text


# Largest error of a dequantized weight, relative to the weight's largest magnitude.
_QUANT_ERROR = {"f32": 0.0, "f16": 1e-3, "bf16": 1e-2, "q8_0": 1e-2, "q4_0": 0.2}


WRITTEN = [quant for quant in QUANTIZATIONS if quantization_problem(quant) is None]


def test_the_gguf_package_quantizes_q8_0_and_q4_0():
    # Not q4_k or q6_k: gguf 0.19's Q4_K and Q6_K only dequantize (quantize_blocks raises).
    assert {"f32", "f16", "bf16", "q8_0", "q4_0"} <= set(WRITTEN)


@pytest.mark.parametrize("quant", [q for q in QUANTIZATIONS if q not in WRITTEN])
def test_a_quantization_the_gguf_package_cannot_write_is_refused_in_one_line(tiny, quant):
    with pytest.raises(NotImplementedError):  # the premise: the package has no quantizer
        gguf.quants.quantize(np.zeros((1, 256), np.float32), QUANTIZATIONS[quant][0])
    result = _cli("export", tiny, "--to", "gguf", "--quant", quant)
    assert result.returncode == 1 and not (tiny / "gguf").exists()
    problem = (
        f"GGUF quantization {quant!r}: the installed gguf package "
        f"({importlib.metadata.version('gguf')}) has no quantizer for {quant.upper()}; write "
        "q8_0 or q4_0, or f16 and quantize it with llama.cpp's llama-quantize"
    )
    assert result.stderr.strip().splitlines() == [f"tunelab: error: {problem}"], result.stderr
    # A run that would export it is refused before it starts, not after training.
    result = _cli("validate", "tiny/full", f"output_dir={tiny.parent / 'out'}",
                  "checkpoint.export_formats=[hf,gguf]", f"checkpoint.gguf_quantization={quant}")  # fmt: skip
    assert result.returncode == 1
    assert f"key 'checkpoint.gguf_quantization': {problem}" in result.stderr, result.stderr


@pytest.mark.parametrize("quant", WRITTEN)
def test_every_quantization_is_written_by_the_gguf_package(tiny, quant):
    tensors = {t.name: t for t in gguf.GGUFReader(export_gguf(tiny, quant=quant)).tensors}
    stored = tensors["blk.0.ffn_down.weight"]
    values = gguf.quants.dequantize(stored.data, stored.tensor_type).reshape(128, 256)
    weight = load_file(tiny / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    error = np.abs(values - weight).max() / np.abs(weight).max()
    assert error <= _QUANT_ERROR[quant], error


def _direct_writes_counted(monkeypatch) -> list:
    calls = []
    original = gguf_export._RangeWriter._write_direct

    def counted(self, data, offset):
        calls.append((offset, len(data)))
        return original(self, data, offset)

    monkeypatch.setattr(gguf_export._RangeWriter, "_write_direct", counted)
    return calls


@pytest.mark.parametrize("quant", ["f16", "bf16", "q8_0"])
def test_direct_writes_through_small_buffers_give_the_cached_writes_bytes(tiny, monkeypatch, quant):
    """Pages wholly inside a tensor go to disk with O_DIRECT from the buffer the cast wrote,
    the pages shared with a neighbour through the page cache. With buffers of two pages and
    pieces of 3000 bytes (partial pages carried to the next buffer, a q/k head group larger
    than a buffer, tensors within one page) the file equals, byte for byte, the one written
    all through the page cache, and its checksums verify."""
    monkeypatch.setattr(gguf_export, "_DIRECT", False)
    cached = export_gguf(tiny, quant=quant).read_bytes()
    monkeypatch.setattr(gguf_export, "_DIRECT", True)
    monkeypatch.setattr(gguf_export, "_BUFFER_BYTES", 2 * gguf_export._PAGE)
    monkeypatch.setattr(gguf_export, "_PIECE_BYTES", 3000)
    calls = _direct_writes_counted(monkeypatch)
    path = export_gguf(tiny, quant=quant)
    if not calls:
        pytest.skip(f"{tiny}'s file system refuses O_DIRECT")
    assert path.read_bytes() == cached
    assert verify_folder(path.parent) == []
    assert all(
        offset % gguf_export._PAGE == 0 == size % gguf_export._PAGE for offset, size in calls
    )
    written = sum(size for _, size in calls)
    assert written > len(cached) // 2, (written, len(cached))  # most bytes skip the cache
    calls.clear()
    export_gguf(tiny, quant=quant, sync_files=False)
    assert calls == []  # without fsync nothing waits for the disk


def _refuse_direct_writes(monkeypatch, code: int) -> list:
    """Make every write through an O_DIRECT descriptor fail with ``code``; return their offsets."""
    original, refused = gguf_export.pwrite_all, []

    def refuse(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(code, os.strerror(code))
        return original(fd, data, offset)

    monkeypatch.setattr(gguf_export, "pwrite_all", refuse)
    return refused


def test_a_file_system_refusing_direct_writes_gets_the_same_bytes_through_the_cache(
    tiny, monkeypatch
):
    monkeypatch.setattr(gguf_export, "_DIRECT", False)
    cached = export_gguf(tiny).read_bytes()
    monkeypatch.setattr(gguf_export, "_DIRECT", True)
    refused = _refuse_direct_writes(monkeypatch, errno.EINVAL)
    path = export_gguf(tiny)
    if not refused:
        pytest.skip(f"{tiny}'s file system refuses O_DIRECT at open")
    assert path.read_bytes() == cached
    assert verify_folder(path.parent) == []


def test_a_failing_direct_write_fails_the_export_in_one_line(tiny, monkeypatch):
    before = export_gguf(tiny, quant="q8_0").read_bytes()
    refused = _refuse_direct_writes(monkeypatch, errno.EIO)
    try:
        export_gguf(tiny)
    except CheckpointError as error:
        assert "OSError" in str(error) and "\n" not in str(error), error
    else:
        assert not refused, "no direct write was tried"
        pytest.skip(f"{tiny}'s file system refuses O_DIRECT at open")
    assert sorted(p.name for p in (tiny / "gguf").iterdir()) == [
        "Modelfile", "model-q8_0.gguf", "tunelab_manifest.json",
    ]  # fmt: skip
    assert (tiny / "gguf" / "model-q8_0.gguf").read_bytes() == before
    assert not list(tiny.glob(".gguf*"))
