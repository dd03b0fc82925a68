"""grpo_distributed's prompt dataset through the real ``tunelab run``: bad rows, skipped rows.

Issue 38, findings 5 and 6: ``dataset.skip_malformed=true`` passed ``validate`` and then failed
in the workers (``JsonConfig.__init__() got an unexpected keyword argument``); an empty prompt
was ``json: row 0: empty text``, found after the workers started; and no run said how many rows
it skipped.
"""

import json

import pytest

from tests.recipes.conftest import tunelab_run
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow


def _prompts(tmp_path):
    rows = [json.loads(line) for line in (assets_dir() / "tiny" / "grpo_prompts.jsonl").open()]
    rows.insert(2, {"prompt": " ", "answer": "nothing"})  # line 3: an empty prompt
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path, len(rows)


def test_an_empty_prompt_stops_the_launch_and_skip_malformed_trains_without_it(tmp_path):
    path, num_rows = _prompts(tmp_path)
    common = [
        f"dataset.data_files={path}",
        "schedule.max_steps_per_epoch=1",
        "checkpoint.save_every_n_steps=null",
    ]
    refused = tunelab_run(
        "grpo_distributed", "tiny/grpo", f"output_dir={tmp_path / 'refused'}", *common, check=False
    )
    assert refused.returncode == 1
    errors = [line for line in refused.stderr.splitlines() if line.startswith("tunelab: error: ")]
    assert len(errors) == 1, refused.stderr[-3000:]
    assert errors[0].endswith(
        "prompts.jsonl:3: row 2 (0-based), column 'prompt': empty text "
        "(set skip_malformed: true to skip such rows)"
    ), errors
    assert not (tmp_path / "refused").exists()  # refused before any worker made the run folder
    skipped = tunelab_run(
        "grpo_distributed", "tiny/grpo", f"output_dir={tmp_path / 'skipped'}", *common,
        "dataset.skip_malformed=true",
    )  # fmt: skip
    start = f"tunelab: dataset: {num_rows - 1} items (malformed rows skipped: 1, truncated: 0)"
    assert start in skipped.stderr.splitlines(), skipped.stderr[-3000:]
    records = [
        json.loads(line)
        for line in (tmp_path / "skipped" / "logs" / "completions.jsonl").read_text().splitlines()
    ]
    # The dataset holds the other rows only: every index is one of theirs.
    assert records and all(0 <= record["index"] < num_rows - 1 for record in records)
