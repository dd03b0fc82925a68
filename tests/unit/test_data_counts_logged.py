"""A run says at its start how many rows its dataset skipped, truncated and dropped.

Issue 38, finding 6: ``tunelab data preview`` counted the skipped malformed rows, but a training
run never said how many it skipped (docs/data.md said the recipes log it).
"""

import json
import logging

import pytest
from omegaconf import OmegaConf

from tunelab._paths import assets_dir
from tunelab.config.sections import ScheduleArgs
from tunelab.data import load_tokenizer, padded_collate_sft
from tunelab.data.prompts import padded_collate_prompts
from tunelab.training import session
from tunelab.training.session import Datasets, build_data

ROW = {"instruction": "Reverse the words.", "input": "red cat", "output": "cat red"}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def lines():
    # The session's own logger, whatever the ``tunelab`` logger's handlers (configure_logging
    # stops propagation in processes that ran a recipe).
    handler = _Lines()
    logger = logging.getLogger(session.__name__)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_start_line_counts_skipped_and_truncated_rows(tmp_path, lines):
    tokenizer = load_tokenizer(assets_dir() / "tiny")
    long = {**ROW, "output": "word " * 200}
    path = _write(tmp_path / "sft.jsonl", [ROW, {**ROW, "output": ""}, long, ROW, ROW])
    node = OmegaConf.create(
        {
            "_component_": "tunelab.data.instruct_dataset",
            "source": path,
            "skip_malformed": True,
            "max_seq_len": 64,
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    build_data(Datasets(node, tokenizer, padded_collate_sft, node), ScheduleArgs(batch_size=1))
    assert lines == [
        "dataset: 4 items (malformed rows skipped: 1, truncated: 1, dropped: 0)",
        "val_dataset: 4 items (malformed rows skipped: 1, truncated: 1, dropped: 0)",
    ]


def test_the_start_line_of_a_prompt_dataset(tmp_path, lines):
    tokenizer = load_tokenizer(assets_dir() / "tiny")
    rows = [{"prompt": "Count the words: a b"}, {"prompt": ""}, {"prompt": "word " * 50}]
    node = OmegaConf.create(
        {
            "_component_": "tunelab.data.prompt_dataset",
            "source": _write(tmp_path / "prompts.jsonl", rows),
            "template": "instruct",
            "skip_malformed": True,
            "max_prompt_tokens": 16,
        }
    )
    build_data(Datasets(node, tokenizer, padded_collate_prompts), ScheduleArgs(batch_size=1))
    assert lines == ["dataset: 2 items (malformed rows skipped: 1, truncated: 1)"]
