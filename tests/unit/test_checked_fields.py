"""Every field read from a file is checked before it is used (issue 23, finding 10).

Manifest sizes, offsets and lengths (``1e400``, ``-1``) gave tracebacks; a manifest that is a
link to ``/dev/zero`` or a FIFO hung ``tunelab verify``; a forged ``trainer_state.json`` was
trusted; a ``config.json`` size of 1e10 was allocated before the weights were read; a 500 MB
data row was tokenized whole. Each is now one line, or a row cut before tokenization.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tunelab import _paths
from tunelab.checkpoint.state import trainer_state_problem
from tunelab.data import chat_dataset, load_tokenizer, text_dataset
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import CheckpointError
from tunelab.formats import integrity, layout
from tunelab.models import from_hf_config

TUNELAB = [sys.executable, "-m", "tunelab.cli"]
TINY = _paths.assets_dir() / "tiny"
VERIFY_TIMEOUT_S = 120  # generous: a hang (the old behaviour) is what this catches


def _step(tmp_path: Path, data: bytes = b"0123456789") -> Path:
    folder = tmp_path / "step_2"
    folder.mkdir()
    layout.write_manifest(folder, {"w.bin": integrity.write_bytes(folder / "w.bin", data)})
    return folder


def _forge_record(folder: Path, **values: str) -> None:
    """Rewrite w.bin's record with raw JSON ``values`` (``1e400`` stays a literal)."""
    path = folder / integrity.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    record = manifest["files"]["w.bin"]
    for key in values:
        if key in ("offset", "length"):
            record["ranges"][0][0 if key == "offset" else 1] = f"@{key}@"
        else:
            record[key] = f"@{key}@"
    text = json.dumps(manifest)
    for key, value in values.items():
        text = text.replace(f'"@{key}@"', value)
    path.write_text(text)


def _verify(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TUNELAB, "verify", *map(str, paths)],
        capture_output=True, text=True, timeout=VERIFY_TIMEOUT_S,
    )  # fmt: skip


@pytest.mark.parametrize(
    "forged",
    [{"size": "1e400"}, {"size": "-1"}, {"size": "10.0"}, {"size": "true"}, {"size": "NaN"},
     {"offset": "-1"}, {"length": "-10"}, {"length": "1e400"}, {"offset": "2.5"}],
    ids=lambda forged: ",".join(f"{k}={v}" for k, v in forged.items()),
)  # fmt: skip
def test_an_impossible_manifest_number_is_one_line_and_an_unreadable_checkpoint(tmp_path, forged):
    folder = _step(tmp_path)
    _forge_record(folder, **forged)
    with pytest.raises(CheckpointError, match="w.bin: its manifest record is malformed"):
        integrity.read_manifest_file(folder)
    problems = integrity.verify_folder(folder)
    assert len(problems) == 1 and "w.bin: its manifest record is malformed" in problems[0]
    record = json.loads((folder / integrity.MANIFEST_NAME).read_text().replace("1e400", "1e300"))
    assert integrity.check_file(folder / "w.bin", record["files"]["w.bin"]) is not None
    verify = _verify(folder)
    assert verify.returncode == 1 and "Traceback" not in verify.stderr, verify.stderr
    assert verify.stdout.count("FAILED") == 1, verify.stdout


@pytest.mark.parametrize("kind", ["link to /dev/zero", "FIFO", "link to a FIFO"])
def test_verify_reads_only_regular_files_and_never_hangs(tmp_path, kind):
    folder = _step(tmp_path)
    manifest = folder / integrity.MANIFEST_NAME
    manifest.unlink()
    if kind == "FIFO":
        os.mkfifo(manifest)
    elif kind == "link to a FIFO":
        os.mkfifo(tmp_path / "fifo")
        manifest.symlink_to(tmp_path / "fifo")
    else:
        manifest.symlink_to("/dev/zero")
    verify = _verify(folder)
    assert verify.returncode == 1 and "Traceback" not in verify.stderr, verify.stderr
    assert verify.stdout.splitlines() == [f"FAILED {manifest} is a link: tunelab writes no "
                                          "links in checkpoints and follows none"
                                          if "link" in kind else
                                          f"FAILED {manifest} is not a regular file (a FIFO)"]  # fmt: skip
    with pytest.raises(CheckpointError):
        integrity.read_manifest_file(folder)


@pytest.mark.parametrize("kind", ["FIFO", "link to /dev/zero"])
def test_a_listed_file_that_is_not_a_regular_file_is_named_not_read(tmp_path, kind):
    folder = _step(tmp_path)
    (folder / "w.bin").unlink()
    if kind == "FIFO":
        os.mkfifo(folder / "w.bin")
    else:
        (folder / "w.bin").symlink_to("/dev/zero")
    problems = integrity.verify_folder(folder)
    assert problems and "w.bin" in problems[0], problems
    assert _verify(folder).returncode == 1


def _trainer_state(**changes):
    state = {"step": 4, "epoch": 0, "progress": {"sampler": {"epoch": 0, "consumed": 32, "seed": 0},
             "epoch_done": False}, "optimizer_param_groups": [{"lr": 1e-3}],
             "lr_scheduler": None, "rng": [{}]}  # fmt: skip
    state.update(changes)
    return state


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({"step": -7}, "step -7 is not the folder's step 4"),
        ({"step": 5}, "step 5 is not the folder's step 4"),
        ({"step": 4.0}, "step 4.0 is not the folder's step 4"),
        ({"epoch": -1}, "epoch -1 is not a non-negative integer"),
        ({"progress": {"sampler": {"consumed": -32}}}, "progress.sampler.consumed is -32"),
        ({"progress": [1]}, "progress is not an object"),
        ({"optimizer_param_groups": "x"}, "optimizer_param_groups is not a list"),
        ({"rng": None}, "rng is not a list of objects"),
    ],
)
def test_a_forged_trainer_state_is_refused_before_use(tmp_path, changes, problem):
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps(_trainer_state()))
    assert trainer_state_problem(path, 4) is None
    path.write_text(json.dumps(_trainer_state(**changes)))
    found = trainer_state_problem(path, 4)
    assert found is not None and problem in found, found
    path.unlink()
    path.symlink_to("/dev/zero")
    assert "is a link" in trainer_state_problem(path, 4)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("intermediate_size", "10000000000", "but the config gives (10000000000, 128): intermediate_size 10000000000 in"),
        ("intermediate_size", "1e10", "intermediate_size 10000000000.0 is not a positive integer"),
        ("intermediate_size", "1e400", "intermediate_size inf is not a positive integer"),
        ("hidden_size", "-4", "hidden_size -4 is not a positive integer"),
        ("hidden_size", "4096", "but the config gives (810, 4096): hidden_size 4096 in"),
        ("num_hidden_layers", "100000", "num_hidden_layers 100000 does not match the weights"),
    ],
)  # fmt: skip
def test_config_dimensions_are_checked_against_the_weights_before_allocating(
    tmp_path, key, value, message
):
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    config = json.loads((model / "config.json").read_text())
    config[key] = "@value@"
    (model / "config.json").write_text(json.dumps(config).replace('"@value@"', value))
    # Not on the meta device: the old code allocated the parameters here.
    with pytest.raises(CheckpointError) as error:
        from_hf_config(model)
    assert str(error.value) == f"{model / 'config.json'}: {message}" or message in str(
        error.value
    ), error.value
    assert "\n" not in str(error.value)


def test_a_huge_row_is_cut_by_characters_before_it_is_tokenized(tmp_path, monkeypatch):
    tokenizer = load_tokenizer(TINY)
    encoded: list[int] = []
    encode = Tokenizer.encode

    def recording(self, text, *args, **kwargs):
        encoded.append(len(text))
        return encode(self, text, *args, **kwargs)

    huge = "the cat sat on the mat. " * 400_000  # ~10 MB of text in one row
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": huge}) + "\n" + json.dumps({"text": "short"}) + "\n")
    monkeypatch.setattr(Tokenizer, "encode", recording)
    cut = text_dataset(tokenizer, source=str(path), max_seq_len=64, cache_dir=str(tmp_path / "c"))
    bound = (64 + 256) * max(tokenizer.longest_token_chars, 16)
    assert encoded and max(encoded) <= bound < len(huge) // 100, (max(encoded), bound)
    # The sample is exactly the one the whole row gives, cut to max_seq_len tokens.
    monkeypatch.setattr(Tokenizer, "encode", encode)
    whole = tokenizer.encode(huge, add_bos=True, add_eos=True)[:64]
    assert cut[0]["tokens"] == whole and cut.num_truncated == 1
    assert tokenizer.decode(cut[1]["tokens"]).endswith("short")

    conversation = {"messages": [{"role": "user", "content": huge},
                                 {"role": "assistant", "content": huge}]}  # fmt: skip
    chat_path = tmp_path / "chat.jsonl"
    chat_path.write_text(json.dumps(conversation) + "\n")
    encoded.clear()
    encode_with_offsets = Tokenizer.encode_with_offsets

    def recording_with_offsets(self, text, *args, **kwargs):
        encoded.append(len(text))
        return encode_with_offsets(self, text, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", recording)
    monkeypatch.setattr(Tokenizer, "encode_with_offsets", recording_with_offsets)
    chat = chat_dataset(tokenizer, source=str(chat_path), template="chatml", max_seq_len=64,
                        cache_dir=str(tmp_path / "c2"))  # fmt: skip
    assert len(chat[0]["tokens"]) == 64 and max(encoded) <= 3 * bound, max(encoded)
