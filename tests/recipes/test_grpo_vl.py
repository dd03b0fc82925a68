"""grpo_distributed on image prompts: the real ``tunelab run`` of tiny/grpo_vl (Qwen2.5-VL), and
of the same config on the embedded tiny Qwen3-VL (deepstack, interleaved M-RoPE in the rollouts)
and Gemma 3 (SigLIP tower, bidirectional attention over the image tokens, sliding-window layers:
rollouts prefill each row on its own).

For each family one 2-process run (batch 2 per process) serves every check: 1 process with twice the
accumulation samples the same completions, gets the same rewards and losses and exports the same
adapter; a kill after step 2's checkpoint resumes to the same completions, losses and export.
A prompt naming a missing image stops the run with one line naming the file and the row, and
an agentic run (``tiny/agentic_grpo``) on a vision-language model with one line refusing it.
"""

import json
from pathlib import Path

import pytest

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    read_metrics,
    tunelab_run,
)
from tests.recipes.test_grpo import completions
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow
QUESTION = "What colour is the shape?"
STEPS = 4
# family -> the overrides its runs add to tiny/grpo_vl
FAMILIES = {
    "qwen2_5_vl": (),
    "qwen3_vl": (f"model.path={assets_dir() / 'tiny_qwen3_vl'}",),
    "gemma3_vl": (f"model.path={assets_dir() / 'tiny_gemma3_vl'}",),
}
SETTINGS = (
    f"schedule.max_steps_per_epoch={STEPS}",
    "checkpoint.save_every_n_steps=2",
    "checkpoint.keep_last_n_checkpoints=null",
)


def _run(
    out: Path,
    *extra: str,
    family: str = "qwen2_5_vl",
    nproc: int = 2,
    accumulation: int = 1,
    check: bool = True,
):
    return tunelab_run(
        "grpo_distributed", "tiny/grpo_vl", f"output_dir={out}", *SETTINGS, *FAMILIES[family],
        "schedule.batch_size=2", f"schedule.gradient_accumulation_steps={accumulation}",
        *extra, nproc=nproc, check=check,
    )  # fmt: skip


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def two_processes(request, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp(f"grpo_vl_{request.param}") / "two"
    _run(out, family=request.param)
    return out, request.param


def test_two_processes_equal_one_with_twice_the_accumulation(two_processes, tmp_path):
    two_processes, family = two_processes
    one = tmp_path / "one"
    _run(one, family=family, nproc=1, accumulation=2)
    ours, theirs = completions(two_processes), completions(one)
    assert ours == theirs  # the same prompts, images and seeds: the same tokens and rewards
    assert len(ours) == STEPS * 4 * 4
    rewards = {reward for _, reward in ours.values()}
    assert len(rewards) > 1  # groups with rewards to tell apart: the policy gradient is not 0
    two, single = read_metrics(two_processes), read_metrics(one)
    assert [m["step"] for m in two] == list(range(1, STEPS + 1))
    for a, b in zip(two, single, strict=True):
        assert a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    assert_same_exports(one, two_processes, atol=1e-4)


def test_kill_and_resume_is_exact(two_processes, tmp_path):
    two_processes, family = two_processes
    resumed = interrupted_copy(two_processes, tmp_path / "resumed", after_step=2, keep_logs=True)
    _run(resumed, "checkpoint.resume_from_checkpoint=true", family=family)
    assert completions(resumed) == completions(two_processes)  # token for token
    after = [m for m in read_metrics(resumed) if m["step"] > 2]
    before = [m for m in read_metrics(two_processes) if m["step"] > 2]
    assert [m["step"] for m in after] == [3, 4]
    for ours, theirs in zip(after, before, strict=True):
        assert (ours["loss"], ours["reward"]) == (theirs["loss"], theirs["reward"])
    assert_same_exports(resumed, two_processes)


def test_a_missing_image_is_one_line_naming_the_file_and_row(tmp_path):
    folder = assets_dir() / "tiny_vl"
    rows = [{"prompt": f"<image>{QUESTION}", "images": [str(folder / "images" / name)]}
            for name in ("red_circle_0.png", "blue_square_1.png", "green_circle_0.png")]  # fmt: skip
    rows[2]["images"] = ["images/no_such.png"]  # read from the data file's folder
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row | {"answer": "Red."}) + "\n" for row in rows))
    result = _run(tmp_path / "out", f"dataset.data_files={data}", nproc=1, check=False)
    printed = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in printed, printed[-3000:]
    missing = tmp_path / "images" / "no_such.png"
    line = f"{data}:3: row 2 (0-based), column 'images': {missing}: image file not found"
    errors = [text for text in printed.splitlines() if "error" in text.lower()]
    assert len(errors) == 1 and line in errors[0], printed[-3000:]


def test_agentic_episodes_on_a_vision_model_are_one_line(tmp_path):
    folder = assets_dir() / "tiny_vl"
    result = tunelab_run(
        "grpo_distributed", "tiny/agentic_grpo", f"output_dir={tmp_path / 'out'}",
        f"model.path={folder}", f"tokenizer.path={folder}", "~tokenizer.chat_template",
        "schedule.max_steps_per_epoch=1", nproc=1, check=False,
    )  # fmt: skip
    printed = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in printed, printed[-3000:]
    errors = [text for text in printed.splitlines() if "error" in text.lower()]
    line = "agentic: episodes on a vision-language model (qwen2_5_vl) are not supported yet"
    assert len(errors) == 1 and line in errors[0], printed[-3000:]
