"""Rewards see a GRPO prompt's images: a real ``tunelab run`` of ``tiny/grpo_vl`` on 2 processes.

The reward (a user's function on ``PYTHONPATH``) opens each row's ``prompt_images`` with
pillow and reads the shape's colour from the pixels: for every completion it finds the images
of its own prompt (a file by content part, one by the ``images`` column, an inline image beside
a file) and the colour the row's ``answer`` names; a text prompt's row has none.
"""

import json
import os
import textwrap

import pytest

from tests.recipes.conftest import tunelab_run
from tests.unit.test_image_prompt_rewards import prompt_rows

pytestmark = pytest.mark.slow

REWARD = textwrap.dedent(
    """
    import json
    import os

    import numpy as np
    from PIL import Image, ImageOps

    COLOURS = ("red", "green", "blue")


    def shape_colour(prompts, completions, rows, log):
        scores = []
        with open(f"{log}.{os.environ.get('RANK', '0')}", "a") as out:
            for completion, row in zip(completions, rows, strict=True):
                files = row.get("prompt_images", [])
                colours = []
                for path in files:
                    image = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
                    pixels = np.asarray(image).reshape(-1, 3).astype(int)
                    shape = pixels[pixels.sum(axis=1) < 600].mean(axis=0)
                    colours.append(COLOURS[int(shape.argmax())])
                record = {"answer": row["answer"], "files": files, "colours": colours}
                out.write(json.dumps(record) + "\\n")
                scores.append(float(bool(colours) and colours[0] in completion.lower()))
        return scores
    """
)


def test_a_reward_reads_each_prompts_images(tmp_path):
    (tmp_path / "image_reward.py").write_text(REWARD)
    rows, files = prompt_rows(tmp_path)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    log = tmp_path / "seen"
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    tunelab_run(
        "grpo_distributed", "tiny/grpo_vl", f"output_dir={tmp_path / 'out'}",
        f"dataset.data_files={data}", "schedule.batch_size=2", "schedule.max_steps_per_epoch=1",
        f"rewards.functions=[{{_component_: image_reward.shape_colour, log: {log}}}]",
        "rewards.weights=null", env={"PYTHONPATH": pythonpath},
    )  # fmt: skip
    seen = [
        json.loads(line)
        for rank in (0, 1)
        for line in (tmp_path / f"seen.{rank}").read_text().splitlines()
    ]
    assert len(seen) == 4 * 4  # 4 prompts, 4 completions each, all scored
    expected = {
        (row["answer"], len(want or [])): want for row, want in zip(rows, files, strict=True)
    }
    got = {}
    for record in seen:
        key = (record["answer"], len(record["files"]))
        got.setdefault(key, []).append(record)
    assert sorted(got) == sorted(expected)
    for key, records in got.items():
        assert len(records) == 4 and all(r == records[0] for r in records)  # a group
        want, record = expected[key], records[0]
        for path, named in zip(record["files"], want or [], strict=True):
            assert named is None or path == named  # None: the inline image's cached copy
        if want:  # the pixels the reward read are the prompt's own images
            assert record["colours"][0] == record["answer"]
            assert record["colours"][1:] == ["red"] * (len(want) - 1)
        else:
            assert record["files"] == [] and record["colours"] == []
