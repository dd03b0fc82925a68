"""Broken rows of local JSON data are found before any worker starts, as the workers name them."""

import json

import pytest

from tunelab._paths import assets_dir
from tunelab.cli import _data_check
from tunelab.cli._data_check import check_json_rows
from tunelab.config import LoRAFinetuneArgs, load_config, parse_args
from tunelab.data import instruct_dataset, load_tokenizer
from tunelab.errors import DataError

ROW = {"instruction": "Reverse the words.", "input": "red cat", "output": "cat red"}


def _args(tmp_path, *overrides):
    cfg = load_config("tiny/lora", [f"output_dir={tmp_path / 'out'}", *overrides], LoRAFinetuneArgs)
    return parse_args(cfg, LoRAFinetuneArgs)


def _broken(tmp_path, name="broken.jsonl"):
    path = tmp_path / name
    good = json.dumps(ROW)
    path.write_text(f"{good}\n\n{good}\n{good[:-1]}\n{good}\n")  # line 4 lost its brace
    return path


def test_a_broken_row_is_named_as_the_workers_name_it(tmp_path):
    path = _broken(tmp_path)
    with pytest.raises(DataError) as before:
        check_json_rows(_args(tmp_path, f"dataset.data_files={path}"))
    with pytest.raises(DataError) as workers:
        instruct_dataset(load_tokenizer(assets_dir() / "tiny"), source=str(path))
    message = str(before.value)
    assert message.startswith(f"{path}:4: not valid JSON (Expecting ',' delimiter at the end")
    assert message.endswith("(set skip_malformed: true to skip such rows)")
    problem = message.removeprefix(f"{path}:4: ")
    assert str(workers.value).startswith(f"{path}:4: ") and str(workers.value).endswith(problem)


def test_validation_data_and_a_file_source_are_read_too(tmp_path):
    path = _broken(tmp_path)
    with pytest.raises(DataError, match=r"broken\.jsonl:4: "):
        check_json_rows(_args(tmp_path, f"val_dataset.data_files={path}"))
    with pytest.raises(DataError, match=r"broken\.jsonl:4: "):
        check_json_rows(_args(tmp_path, f"dataset.source={path}", "~dataset.data_files"))


def test_what_the_workers_would_not_refuse_passes(tmp_path, monkeypatch):
    path = _broken(tmp_path)
    check_json_rows(_args(tmp_path))  # the shipped data
    # skip_malformed: the broken row is skipped, not an error.
    check_json_rows(
        _args(tmp_path, f"dataset.data_files={path}", "dataset.skip_malformed=true", "~val_dataset")
    )
    # A JSON document of rows is read whole.
    document = tmp_path / "rows.json"
    document.write_text(json.dumps([ROW, ROW], indent=2))
    check_json_rows(_args(tmp_path, f"dataset.data_files={document}"))
    # A file too big to read twice is left to the workers.
    monkeypatch.setattr(_data_check, "MAX_CHECKED_BYTES", 10)
    check_json_rows(_args(tmp_path, f"dataset.data_files={path}"))
