"""TensorBoard and W&B loggers, read back from the files they write."""

import json
import struct
import sys

import pytest

from tunelab.errors import ConfigError
from tunelab.training import TensorBoardLogger, WandBLogger


def _tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # purge_orphaned_data (the default) applies the start markers a resume writes.
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_tensorboard_scalars_read_back_with_their_steps(tmp_path):
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(str(tmp_path / "logs"))
    logger.log({"loss": 1.5, "lr": 0.25}, 1)
    logger.log({"loss": 1.25, "lr": 0.5}, 2)
    logger.log({"val_loss": 2.0}, 2)
    # Flushed as logged: readable before close, as after a crash.
    assert _tensorboard_scalars(tmp_path / "logs")["loss"] == [(1, 1.5), (2, 1.25)]
    logger.close()
    assert _tensorboard_scalars(tmp_path / "logs") == {
        "loss": [(1, 1.5), (2, 1.25)],
        "lr": [(1, 0.25), (2, 0.5)],
        "val_loss": [(2, 2.0)],
    }


def test_tensorboard_resume_replaces_the_steps_logged_again(tmp_path):
    pytest.importorskip("tensorboard")
    first = TensorBoardLogger(str(tmp_path))
    for step in range(1, 5):
        first.log({"loss": float(step)}, step)
    first.close()
    resumed = TensorBoardLogger(str(tmp_path))
    resumed.truncate_after(2)  # the checkpoint was taken after step 2
    for step in (3, 4):
        resumed.log({"loss": 10.0 * step}, step)
    resumed.close()
    assert _tensorboard_scalars(tmp_path)["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_tensorboard_logger_without_tensorboard_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        TensorBoardLogger(str(tmp_path))


# ---- Weights & Biases ------------------------------------------------------------------------
_BLOCK_SIZE = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_records(path) -> list[bytes]:
    """The records of a ``.wandb`` file (LevelDB's log format behind a 7-byte W&B header).

    wandb no longer ships a Python reader for these files (its core writes them), so this is
    the format spelled out: 32 KiB blocks of records, each with a 7-byte header (CRC, length,
    type); a record that does not fit a block continues in the next as FIRST, MIDDLE, LAST.
    """
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    records, pending, position = [], b"", 7
    while position + 7 <= len(data):
        left_in_block = _BLOCK_SIZE - position % _BLOCK_SIZE
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left_in_block < 7 or (length == 0 and kind == 0):  # block padding
            position += left_in_block
            continue
        payload = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == _FULL:
            records.append(payload)
        elif kind in (_FIRST, _MIDDLE):
            pending += payload
        elif kind == _LAST:
            records.append(pending + payload)
            pending = b""
    return records


def _wandb_history(run_file) -> dict[int, dict[str, float]]:
    from wandb.proto import wandb_internal_pb2

    history: dict[int, dict[str, float]] = {}
    for payload in _wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        # The writer names an item by key or by nested_key, depending on its version.
        items = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.history.item
        }
        row = history.setdefault(items["_step"], {})
        row.update({key: value for key, value in items.items() if not key.startswith("_")})
    return history


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        # Existing folders: wandb falls back to ./wandb for a WANDB_DIR it cannot write.
        (tmp_path / name.lower()).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


def test_wandb_offline_run_holds_the_logged_values(offline_wandb):
    log_dir = offline_wandb / "logs"
    logger = WandBLogger(project="tunelab-test", log_dir=str(log_dir), name="unit")
    logger.log({"loss": 1.5, "lr": 0.25}, 1)
    logger.log({"loss": 1.25, "lr": 0.5}, 2)
    logger.log({"val_loss": 2.0}, 2)  # the same step: the same row
    logger.close()
    [run_file] = list(log_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert _wandb_history(run_file) == {
        1: {"loss": 1.5, "lr": 0.25},
        2: {"loss": 1.25, "lr": 0.5, "val_loss": 2.0},
    }


def test_wandb_that_cannot_start_is_one_config_error(offline_wandb, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty).\nsecond line")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(
        ConfigError, match=r"cannot start a run: api_key not configured \(no-tty\)\. "
    ):
        WandBLogger(log_dir=str(offline_wandb / "logs"))


def test_wandb_logger_without_wandb_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="pip install wandb"):
        WandBLogger(log_dir=str(tmp_path))
