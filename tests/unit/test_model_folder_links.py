"""A model folder's links lead only inside it, or into its Hugging Face cache blob store.

Issue 23, finding 1: a model folder whose ``tokenizer.model`` linked to ``/proc/self/environ``
and ``merges.txt`` to a secret file trained to exit 0, and the export published both (mode
0644, in its manifest, verifying). Now every read of a model folder goes through
``tunelab._model_files``: such a link is one error naming it, the up-front check names it
before any process starts, and a real hub cache layout (``snapshots/<rev>/f ->
../../blobs/<hash>``) keeps working.
"""

import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest

from tunelab import _paths
from tunelab._model_files import model_file, read_model_bytes
from tunelab.checkpoint.hf_write import copy_model_files
from tunelab.config._model_dir import model_dir_problems
from tunelab.data import load_tokenizer
from tunelab.errors import CheckpointError, DataError
from tunelab.formats.hf import HFCheckpointReader
from tunelab.models.families import read_hf_config

TINY = _paths.assets_dir() / "tiny"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
SECRET = b"HF_TOKEN=hf_secret_do_not_publish\n"


def _model_folder(root: Path) -> Path:
    folder = root / "model"
    folder.mkdir()
    for name in MODEL_FILES:
        shutil.copy(TINY / name, folder / name)
    return folder


def _secret(root: Path) -> Path:
    secret = root / "elsewhere" / "shadow"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    return secret


def _hub_cache(root: Path, repo: str = "org/tiny") -> Path:
    """A Hugging Face hub cache holding the tiny model, laid out as huggingface_hub lays it out."""
    org, name = repo.split("/")
    repository = root / "hub" / f"models--{org}--{name}"
    revision = hashlib.sha1(repo.encode()).hexdigest()
    snapshot = repository / "snapshots" / revision
    (repository / "blobs").mkdir(parents=True)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(revision)
    snapshot.mkdir(parents=True)
    for file in MODEL_FILES:
        data = (TINY / file).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repository / "blobs" / blob).write_bytes(data)
        (snapshot / file).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


@pytest.mark.parametrize("victim", ["secret file", "/proc/self/environ"])
def test_an_export_never_copies_a_file_a_link_leads_out_of_the_model_folder(tmp_path, victim):
    folder = _model_folder(tmp_path)
    target = _secret(tmp_path) if victim == "secret file" else Path(victim)
    (folder / "merges.txt").symlink_to(target)
    out = tmp_path / "export"
    out.mkdir()
    with pytest.raises(CheckpointError) as error:
        copy_model_files(folder, out)
    message = str(error.value)
    assert str(folder / "merges.txt") in message and "outside the model folder" in message
    assert "\n" not in message
    assert not (out / "merges.txt").exists()
    # Named up front, before any process starts (`tunelab validate`, `tunelab run`).
    problems = model_dir_problems(str(folder))
    assert len(problems) == 1 and str(folder / "merges.txt") in problems[0], problems


def test_every_reader_of_a_model_folder_refuses_a_link_out_of_it(tmp_path):
    folder = _model_folder(tmp_path)
    secret = _secret(tmp_path)
    outside = tmp_path / "elsewhere"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        shutil.copy(folder / name, outside / name)
        (folder / name).unlink()
        (folder / name).symlink_to(outside / name)
    with pytest.raises(CheckpointError, match="config.json is a link to .* outside"):
        read_hf_config(folder)
    with pytest.raises(CheckpointError, match="model.safetensors is a link to .* outside"):
        HFCheckpointReader(folder)
    with pytest.raises(DataError, match="tokenizer.json is a link to .* outside"):
        load_tokenizer(folder)
    (folder / "tokenizer.json").unlink()
    shutil.copy(TINY / "tokenizer.json", folder / "tokenizer.json")
    with pytest.raises(DataError, match="tokenizer_config.json is a link to .* outside"):
        load_tokenizer(folder)
    # A link through a linked sub-folder is as much a way out.
    (folder / "sub").symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(CheckpointError, match="outside the model folder"):
        read_model_bytes(folder / "sub" / "shadow", folder)
    # And a weight file the index names outside the folder.
    with pytest.raises(CheckpointError, match="outside the model folder"):
        model_file(folder / ".." / "elsewhere" / "shadow", folder)


def test_links_inside_the_folder_and_a_linked_folder_are_followed(tmp_path):
    folder = _model_folder(tmp_path)
    (folder / "real").mkdir()
    shutil.move(folder / "tokenizer.json", folder / "real" / "tokenizer.json")
    (folder / "tokenizer.json").symlink_to(Path("real", "tokenizer.json"))
    linked = tmp_path / "models" / "tiny"
    linked.parent.mkdir()
    linked.symlink_to(folder, target_is_directory=True)  # the user's own choice of folder
    assert model_dir_problems(str(linked)) == []
    assert load_tokenizer(linked).eos_id is not None
    assert len(HFCheckpointReader(linked)) > 0


def test_special_files_are_refused_before_any_read(tmp_path):
    folder = _model_folder(tmp_path)
    os.mkfifo(folder / "vocab.json")
    (folder / "merges.txt").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="vocab.json is not a regular file .a FIFO"):
        read_model_bytes(folder / "vocab.json")  # no hang waiting for a writer
    with pytest.raises(CheckpointError, match="merges.txt is a link to /dev/zero"):
        read_model_bytes(folder / "merges.txt")
    out = tmp_path / "export"
    out.mkdir()
    with pytest.raises(CheckpointError, match="vocab.json is not a regular file .a FIFO"):
        copy_model_files(folder, out)
    (folder / "vocab.json").unlink()
    with pytest.raises(CheckpointError, match="merges.txt is a link to /dev/zero"):
        copy_model_files(folder, out)
    assert not (out / "merges.txt").exists() and not (out / "vocab.json").exists()


def test_a_hugging_face_cache_snapshot_reads_trains_and_exports(tmp_path):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    snapshot = _hub_cache(tmp_path)
    # huggingface_hub itself recognises the layout and resolves files to this snapshot.
    cached = huggingface_hub.try_to_load_from_cache(
        "org/tiny", "config.json", cache_dir=tmp_path / "hub"
    )
    assert Path(cached) == snapshot / "config.json"
    info = huggingface_hub.scan_cache_dir(tmp_path / "hub")
    assert [repo.repo_id for repo in info.repos] == ["org/tiny"] and not info.warnings

    assert model_dir_problems(str(snapshot)) == []
    assert read_hf_config(snapshot)["model_type"] == read_hf_config(TINY)["model_type"]
    reader = HFCheckpointReader(snapshot)
    key = reader.keys()[0]
    assert reader.get(key).equal(HFCheckpointReader(TINY).get(key))
    assert load_tokenizer(snapshot).encode("hello") == load_tokenizer(TINY).encode("hello")
    out = tmp_path / "export"
    out.mkdir()
    os.chmod(snapshot.parent.parent / "blobs" / os.readlink(snapshot / "tokenizer.json")[-64:],
             0o755)  # fmt: skip
    old_umask = os.umask(0o027)
    try:
        records = copy_model_files(snapshot, out)
    finally:
        os.umask(old_umask)
    assert "tokenizer.json" in records
    for name in records:
        copied = out / name
        assert not copied.is_symlink() and stat.S_IMODE(copied.stat().st_mode) == 0o640, name
    assert (out / "tokenizer.json").read_bytes() == (TINY / "tokenizer.json").read_bytes()


def test_a_snapshot_link_into_another_repository_is_refused(tmp_path):
    snapshot = _hub_cache(tmp_path)
    other = _hub_cache(tmp_path, "evil/other")
    blob = other.parent.parent / "blobs" / "stolen"
    blob.write_bytes(SECRET)
    (snapshot / "merges.txt").symlink_to(blob)
    with pytest.raises(CheckpointError, match="merges.txt is a link to .*stolen, outside"):
        read_model_bytes(snapshot / "merges.txt", snapshot)
    assert len(model_dir_problems(str(snapshot))) == 1
