"""GRPO prompts with images: ``prompt_dataset`` rows, their pixels, the engine and the batch.

A prompt with images renders as the chat row of the same user turn does up to the assistant's
answer (the same ids, image tokens expanded; Gemma 3's soft tokens in the text), its pixels are
the SFT collate's, and a bad image, a text-only model or a named template is one line naming
file and row. The rollout engine prefills a group's image prompt once, reads each distinct
prompt's images, never samples the image or video token, and leaves a text row's tokens as they are
without image rows beside it; the rollout batch carries every row's images for the update pass.
The agentic turn sampler refuses a vision-language policy in one line (not supported yet).
"""

import json
import re

import pytest
import torch

from tunelab._paths import assets_dir
from tunelab.data import image_chat_dataset, load_tokenizer, prompt_dataset, sft_collate
from tunelab.errors import DataError
from tunelab.models import load_pretrained
from tunelab.rl.lengths import cut_prompts
from tunelab.rl.rollout import ModelRolloutEngine, SamplingSettings
from tunelab.rl.step import prompt_images, rollout_batch

TINY_VL = assets_dir() / "tiny_vl"
TINY_GEMMA3_VL = assets_dir() / "tiny_gemma3_vl"
RED = str(TINY_VL / "images" / "red_circle_0.png")
BLUE = str(TINY_VL / "images" / "blue_square_1.png")
QUESTION = "What colour is the shape?"


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _rows():
    parts = [{"type": "image", "image": RED}, {"type": "text", "text": QUESTION}]
    return [
        {"prompt": [{"role": "user", "content": parts}], "answer": "Red."},
        {"prompt": f"<image>{QUESTION}", "images": [BLUE], "answer": "Blue."},
        {"prompt": QUESTION, "answer": "None."},  # a text prompt beside them
    ]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_VL, max_seq_len=128)


def _prompts(tokenizer, tmp_path, rows=None, **kwargs):
    file = _write(tmp_path / "prompts.jsonl", rows or _rows())
    return prompt_dataset(tokenizer, source="json", data_files=file, **kwargs), file


def test_prompts_render_as_the_chat_rows_up_to_the_answer(tokenizer, tmp_path):
    prompts, _ = _prompts(tokenizer, tmp_path)
    chats = []
    for row in _rows():
        user = (
            row["prompt"]
            if isinstance(row["prompt"], list)
            else [{"role": "user", "content": row["prompt"]}]
        )
        chat = {"messages": [*user, {"role": "assistant", "content": row["answer"]}]}
        chats.append(chat | ({"images": row["images"]} if "images" in row else {}))
    samples = image_chat_dataset(
        tokenizer, source="json", data_files=_write(tmp_path / "chat.jsonl", chats),
        cache_dir=str(tmp_path / "cache"), num_proc=1,
    )  # fmt: skip
    image_token = tokenizer.token_to_id("<|image_pad|>")
    for index in range(3):
        sample = samples[index]
        answer_start = next(i for i, label in enumerate(sample["labels"]) if label != -100)
        assert prompts.tokens[index] == sample["tokens"][:answer_start]
        assert prompts.tokens[index].count(image_token) == (4, 8, 0)[index]  # 56x56, 112x56
        assert [ref.path for ref in prompts.images[index]] == sample["images"]
    # The pixels the rollout reads are the SFT collate's.
    batch = sft_collate(tokenizer)([samples[0], samples[1]], pad_id=0)
    read = [prompts.prompt_images(index) for index in range(3)]
    assert read[2] is None
    assert torch.equal(torch.cat([read[0]["pixel_values"], read[1]["pixel_values"]]), batch["pixel_values"])  # fmt: skip
    assert torch.equal(torch.cat([read[0]["image_grid_thw"], read[1]["image_grid_thw"]]), batch["image_grid_thw"])  # fmt: skip


def test_gemma3_prompts_hold_the_images_text(tmp_path):
    tokenizer = load_tokenizer(TINY_GEMMA3_VL, max_seq_len=256)
    prompts, _ = _prompts(tokenizer, tmp_path, rows=_rows()[:2])
    soft = tokenizer.token_to_id("<image_soft_token>")
    for index in range(2):
        assert prompts.tokens[index].count(soft) == 16
        assert prompts.prompt_images(index)["pixel_values"].shape == (1, 3, 64, 64)


def _bad(tmp_path, file: str) -> list[dict]:
    rows = _rows()
    rows[1] = {"prompt": f"<image>{QUESTION}", "images": [file], "answer": "Blue."}
    return rows


def test_a_bad_image_is_one_line_naming_the_file_and_row(tokenizer, tmp_path):
    (tmp_path / "not_an_image.png").write_text("hello")
    for name, why in (
        ("missing.png", "image file not found"),
        ("not_an_image.png", "not an image"),
    ):
        with pytest.raises(DataError) as error:
            _prompts(tokenizer, tmp_path, rows=_bad(tmp_path, name))
        message = str(error.value)
        assert "\n" not in message
        assert message.startswith(f"{tmp_path / 'prompts.jsonl'}:2: row 1 (0-based), column 'images': ")  # fmt: skip
        assert f"{tmp_path / name}: {why}" in message
    prompts, _ = _prompts(tokenizer, tmp_path, rows=_bad(tmp_path, "missing.png"), skip_malformed=True)  # fmt: skip
    assert (len(prompts), prompts.num_skipped) == (2, 1)


def test_images_need_a_vision_model_and_the_chat_template(tokenizer, tmp_path):
    # The same tokenizer and chat template without the image preprocessing: a text-only model.
    folder = tmp_path / "text_only"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((TINY_VL / name).read_bytes())
    text_only = load_tokenizer(folder, max_seq_len=128)
    with pytest.raises(DataError, match=r":1: row 0 \(0-based\), column 'images': .*text-only"):
        _prompts(text_only, tmp_path, rows=_rows()[:1], template="auto")
    with pytest.raises(DataError, match="needs template: auto"):
        _prompts(tokenizer, tmp_path, rows=_rows()[:1], template="chatml")
    with pytest.raises(DataError, match="max_prompt_tokens 8 would cut them"):
        _prompts(tokenizer, tmp_path, rows=_rows()[:1], max_prompt_tokens=8)
    prompts, _ = _prompts(tokenizer, tmp_path)
    with pytest.raises(DataError, match="prompt 0 is .* cutting it would cut its images"):
        cut_prompts(prompts, 10, tokenizer)


def test_text_prompts_have_no_images(tokenizer, tmp_path):
    prompts, _ = _prompts(tokenizer, tmp_path, rows=_rows()[2:])
    assert prompts.images is None and prompt_images(prompts, [0, 0]) is None


@pytest.fixture(scope="module")
def model():
    return load_pretrained(TINY_VL).eval()


def _engine(model, temperature=1.0):
    settings = SamplingSettings(max_new_tokens=6, temperature=temperature)
    return ModelRolloutEngine(model, settings, pad_id=0)


def test_the_engine_reads_each_prompt_once_and_samples_no_pixel_token(model, tokenizer, tmp_path):
    prompts, _ = _prompts(tokenizer, tmp_path)
    rows = [0, 0, 0, 1, 1, 1, 2, 2]
    images = prompt_images(prompts, rows)
    assert images[0] is images[2] and images[3] is images[5] and images[6] is None
    calls = []
    handle = model.visual.register_forward_hook(lambda m, args, out: calls.append(args[1].tolist()))
    # The image and video tokens' logits raised far above the rest: a sampler that could draw
    # either would (the training forward would then look for pixels that are not there).
    image_token, video_token = model.args.vision.image_token_id, model.args.vision.video_token_id
    assert model.pixel_token_ids == (image_token, video_token)
    bias = torch.zeros(model.args.vocab_size)
    bias[[image_token, video_token]] = 1e4
    hook = model.lm_head.register_forward_hook(lambda m, args, out: out + bias)
    try:
        engine = _engine(model)
        out = engine.generate([prompts.tokens[i] for i in rows], list(range(len(rows))), images)
    finally:
        handle.remove()
        hook.remove()
    assert calls == [[[1, 4, 4], [1, 4, 8]]]  # one prefill, each distinct prompt's image once
    assert not any({image_token, video_token} & set(completion) for completion in out)
    assert all(len(completion) == 6 for completion in out)
    batch = rollout_batch([prompts.tokens[i] for i in rows], out, 0, torch.device("cpu"), images)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 3 + [[1, 4, 8]] * 3
    assert batch["pixel_values"].shape[0] == 3 * 16 + 3 * 32


def test_agentic_turns_refuse_a_vision_model_in_one_line(model):
    # Its forward takes no KV-cache mask, and turns would have to ban its pixel tokens as the
    # engine does: refused before any episode runs, not a traceback at the first turn.
    from tunelab.errors import ConfigError
    from tunelab.rl.agentic.turn_sampler import CachedTurnSampler

    line = "agentic: episodes on a vision-language model (qwen2_5_vl) are not supported yet"
    with pytest.raises(ConfigError, match=re.escape(line)):
        CachedTurnSampler(model, SamplingSettings(max_new_tokens=6), pad_id=0)


def test_a_text_row_beside_image_rows_decodes_as_alone(model, tokenizer, tmp_path):
    prompts, _ = _prompts(tokenizer, tmp_path)
    rows = [0, 1, 2]
    together = _engine(model).generate(
        [prompts.tokens[i] for i in rows], [7, 8, 9], prompt_images(prompts, rows)
    )
    alone = _engine(model).generate([prompts.tokens[2]], [9])
    assert together[2] == alone[0]
    # And an image row's tokens do not depend on the rows beside it.
    pair = _engine(model).generate([prompts.tokens[1]], [8], prompt_images(prompts, [1]))
    assert together[1] == pair[0]


@pytest.mark.parametrize("name", ["tiny_vl", "tiny_qwen3_vl", "tiny_gemma3_vl"])
def test_the_update_forward_sees_what_the_engine_sampled_from(name):
    """The log-probs the engine records while sampling (KV cache, decode positions after the
    prompt's, Gemma 3's image blocks) equal the update pass's forward over the rollout batch
    (the per-row training forward with each row's images): within 1e-5 per completion."""
    from tunelab.rl.step import completion_logps

    folder = assets_dir() / name
    tokenizer = load_tokenizer(folder, max_seq_len=256)
    prompts = prompt_dataset(
        tokenizer, source="json", data_files=str(TINY_VL / "grpo_prompts.jsonl")
    )
    model = load_pretrained(folder).eval()
    rows = [0, 0, 1, 1, 2]  # groups of content-part and images-column prompts
    images = prompt_images(prompts, rows)
    engine = _engine(model)
    out = engine.generate([prompts.tokens[i] for i in rows], [1, 2, 3, 4, 5], images)
    batch = rollout_batch([prompts.tokens[i] for i in rows], out, 0, torch.device("cpu"), images)
    with torch.no_grad():
        logps, mask = completion_logps(model, batch)
    trained = (logps * mask).sum(dim=1)
    recorded = torch.tensor([sum(values) for values in engine.last_logps], dtype=trained.dtype)
    assert torch.allclose(trained, recorded, atol=1e-5), (trained, recorded)


def test_data_preview_shows_a_prompts_images():
    import io

    from tunelab.cli._data import preview

    out = io.StringIO()
    preview("tiny/grpo_vl", [], rows=1, as_json=False, out=out)
    text = out.getvalue()
    assert text.startswith("tiny/grpo_vl: 32 items")
    image = TINY_VL / "images" / "green_square_0.png"
    assert f"image 0: {image} 56x56, resized 56x56, grid 1x4x4: 4 tokens at positions" in text
    assert "<|vision_start|><|image_pad|>x4<|vision_end|>" in text
