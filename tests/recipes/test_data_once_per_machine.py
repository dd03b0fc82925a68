"""Datasets are tokenized once per machine: local rank 0 (and its workers) only, then cached."""

import json
import random
from pathlib import Path

import pytest

from tests.recipes.conftest import torchrun
from tunelab.data.cache import MIN_ROWS_PER_WORKER

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("data_once_script.py")
WORDS = "red cat sun car bus cow star tree".split()


def _write_chat(path: Path, num_rows: int) -> Path:
    rng = random.Random(0)
    with path.open("w") as out:
        for _ in range(num_rows):
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
            messages = [
                {"role": "user", "content": "Reverse the words: " + " ".join(words)},
                {"role": "assistant", "content": " ".join(reversed(words))},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def _run(tmp_path: Path, name: str, data: Path, bad: Path, num_proc: int) -> tuple[list, list]:
    out = tmp_path / name
    torchrun(SCRIPT, str(data), str(bad), str(tmp_path / "cache"), str(out), str(num_proc))
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]
    markers = [json.loads(p.read_text()) for p in (out / "markers").glob("*.json")]
    return ranks, markers


def test_only_local_rank_0_tokenizes_and_the_cache_is_reused(tmp_path):
    # Enough rows for two tokenizing workers.
    data = _write_chat(tmp_path / "chat.jsonl", 2 * MIN_ROWS_PER_WORKER + 10)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": []}) + "\n")

    ranks, markers = _run(tmp_path, "first", data, bad, num_proc=2)
    leader = ranks[0]["pid"]
    # Tokenizing happened in rank 0's two worker processes, never in rank 1.
    assert len(markers) == 2, markers
    assert all(m["local_rank"] == "0" and m["ppid"] == leader for m in markers), markers
    assert ranks[1]["pid"] not in {m["pid"] for m in markers}
    # Rank 1 read the very same items from the shared cache.
    assert ranks[0]["items"] == ranks[1]["items"] == 2 * MIN_ROWS_PER_WORKER + 10
    assert ranks[0]["digest"] == ranks[1]["digest"]
    # A malformed row stops every rank with the same one-line error.
    assert ranks[0]["error"] == ranks[1]["error"]
    assert ranks[0]["error"].startswith("DataError: ")
    assert (
        "bad.jsonl:1: row 0 (0-based), column 'messages': empty conversation" in ranks[0]["error"]
    )

    # Same data, tokenizer and arguments (a different num_proc changes nothing): no process
    # tokenizes again.
    again, markers = _run(tmp_path, "second", data, bad, num_proc=1)
    assert markers == []
    assert again[0]["digest"] == again[1]["digest"] == ranks[0]["digest"]


def test_one_tokenizing_process_without_workers(tmp_path):
    data = _write_chat(tmp_path / "chat.jsonl", 300)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    ranks, markers = _run(tmp_path, "run", data, bad, num_proc=4)
    # Small data: local rank 0 tokenizes in its own process.
    assert [m["pid"] for m in markers] == [ranks[0]["pid"]]
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert "bad.jsonl:1: row 0 (0-based), column '(whole row)': not valid JSON" in ranks[1]["error"]
