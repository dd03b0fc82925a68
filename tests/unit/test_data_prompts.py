"""The prompt dataset (GRPO) takes the source options of the other datasets and names bad rows alike.

Issue 38, finding 5: ``dataset.skip_malformed=true`` passed ``validate`` and then failed with
``JsonConfig.__init__() got an unexpected keyword argument 'skip_malformed'``; an empty prompt
was ``json: row 0: empty text`` (no file, no line, no skip hint), found only after the workers
had started.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tunelab._paths import assets_dir
from tunelab.cli._data_check import check_json_rows
from tunelab.config import GRPOArgs, load_config, parse_args
from tunelab.data import load_tokenizer, prompt_dataset
from tunelab.errors import ConfigError, DataError

ROWS = [
    {"prompt": "Reverse the words: red cat", "answer": "cat red"},
    {"prompt": "  ", "answer": "none"},
    {"prompt": "Next number after: 41", "answer": "42"},
]
SKIP_HINT = "(set skip_malformed: true to skip such rows)"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(assets_dir() / "tiny")


def _jsonl(path, rows, broken_line=None):
    lines = [json.dumps(row) for row in rows]
    if broken_line is not None:
        lines.insert(broken_line - 1, '{"prompt": "lost its brace"')
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _args(tmp_path, *overrides):
    cfg = load_config("tiny/grpo", [f"output_dir={tmp_path / 'out'}", *overrides], GRPOArgs)
    return parse_args(cfg, GRPOArgs)


@pytest.mark.parametrize("template", ["instruct", None])
def test_an_empty_prompt_is_named_by_file_line_row_and_column(tmp_path, tokenizer, template):
    path = _jsonl(tmp_path / "prompts.jsonl", ROWS)
    with pytest.raises(DataError) as error:
        prompt_dataset(tokenizer, source="json", data_files=path, template=template)
    assert str(error.value) == (
        f"{path}:2: row 1 (0-based), column 'prompt': empty text {SKIP_HINT}"
    )


def test_skip_malformed_skips_bad_rows_and_counts_them(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "prompts.jsonl", ROWS, broken_line=3)
    with pytest.raises(DataError, match=r"prompts\.jsonl:2: row 1 \(0-based\), column 'prompt'"):
        prompt_dataset(tokenizer, source=path, template="instruct")
    dataset = prompt_dataset(tokenizer, source=path, template="instruct", skip_malformed=True)
    assert dataset.num_skipped == 2 and len(dataset) == 2
    assert [row["answer"] for row in dataset.rows] == ["cat red", "42"]
    assert "Next number after: 41" in dataset.prompts[1]


def test_a_broken_json_line_is_a_malformed_row(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "prompts.jsonl", ROWS[:1], broken_line=2)
    with pytest.raises(DataError) as error:
        prompt_dataset(tokenizer, source=path, template="instruct")
    message = str(error.value)
    assert message.startswith(f"{path}:2: row 1 (0-based), column '(whole row)': not valid JSON")
    assert message.endswith(SKIP_HINT)


def test_a_column_missing_from_every_row_is_a_config_mistake_never_skipped(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "prompts.jsonl", [{"question": "a"}, {"question": "b"}])
    for skip_malformed in (False, True):
        with pytest.raises(DataError, match=r"no column 'prompt' \(columns: question\); name"):
            prompt_dataset(tokenizer, source=path, skip_malformed=skip_malformed)


def test_the_split_of_a_data_files_mapping_is_read(tmp_path, tokenizer):
    train = _jsonl(tmp_path / "train.jsonl", ROWS[:1])
    test = _jsonl(tmp_path / "test.jsonl", ROWS[2:])
    files = {"train": train, "test": test}
    dataset = prompt_dataset(
        tokenizer, source="json", data_files=files, split="test", template="instruct"
    )
    assert [row["answer"] for row in dataset.rows] == ["42"]


def test_the_launcher_names_an_empty_prompt_as_the_workers_do(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "prompts.jsonl", ROWS)
    with pytest.raises(DataError) as before:
        check_json_rows(_args(tmp_path, f"dataset.data_files={path}"))
    with pytest.raises(DataError) as workers:
        prompt_dataset(tokenizer, source="json", data_files=path, template="instruct")
    assert str(before.value) == str(workers.value)
    # A broken line first: the first malformed row, in the same words.
    broken = _jsonl(tmp_path / "broken.jsonl", ROWS, broken_line=1)
    with pytest.raises(DataError) as before:
        check_json_rows(_args(tmp_path, f"dataset.data_files={broken}"))
    with pytest.raises(DataError) as workers:
        prompt_dataset(tokenizer, source="json", data_files=broken, template="instruct")
    assert str(before.value) == str(workers.value) and ":1: row 0 (0-based)" in str(before.value)
    # Skipped rows are not an error, before launch either.
    check_json_rows(_args(tmp_path, f"dataset.data_files={path}", "dataset.skip_malformed=true"))
    missing = _jsonl(tmp_path / "missing.jsonl", [{"question": "a"}])
    with pytest.raises(DataError) as before:
        check_json_rows(_args(tmp_path, f"dataset.source={missing}", "~dataset.data_files"))
    with pytest.raises(DataError) as workers:
        prompt_dataset(tokenizer, source=missing)
    assert str(before.value) == str(workers.value)


def test_a_tokenizer_that_does_not_fit_the_prompts_stops_the_build(tmp_path):
    from tests.unit.test_data_tools import word_tokenizer

    folder = tmp_path / "words"
    folder.mkdir()
    tokenizer = word_tokenizer(folder, ["hello", "world"])  # every other word is <unk>
    path = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "the cat sat on the mat"}] * 4)
    with pytest.raises(DataError, match=r"prompts\.jsonl: 100% of the content tokens .*"
                       r"does not fit the data"):  # fmt: skip
        prompt_dataset(tokenizer, source=path, template=None)
    assert len(prompt_dataset(tokenizer, source=path, template=None, allow_unknown_tokens=True))


def _validate(*overrides):
    tunelab = Path(sys.executable).with_name("tunelab")
    return subprocess.run(
        [str(tunelab), "validate", "tiny/grpo", *overrides],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_validate_knows_the_prompt_datasets_options(tmp_path):
    path = _jsonl(tmp_path / "prompts.jsonl", ROWS)
    out = f"output_dir={tmp_path / 'out'}"
    result = _validate(out, f"dataset.data_files={path}", "dataset.skip_malformed=true")
    assert result.returncode == 0, result.stdout + result.stderr
    result = _validate(out, "dataset.skip_malformed=sometimes")
    assert result.returncode != 0 and "skip_malformed" in result.stderr, result.stderr
    result = _validate(out, f"dataset.data_files={path}")
    assert result.returncode != 0
    assert "prompts.jsonl:2: row 1 (0-based), column 'prompt': empty text" in result.stderr


def test_a_config_error_comes_before_reading_rows(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "prompts.jsonl", ROWS)
    with pytest.raises(ConfigError):
        prompt_dataset(tokenizer, source=path, template="no_such_format")
