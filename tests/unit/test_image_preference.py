"""``image_preference_dataset`` and ``preference_collate``: DPO pairs whose prompt holds images.

Each side's ids and trained mask equal the chat-row path's for ``prompt + answer`` (the same
images, image tokens never trained, only the answer trained); both sides carry the prompt's
images; malformed rows are one line naming file and line; the collate lays out chosen rows then
rejected rows with every row's pixels in that order, and the images reach the log-probs.
"""

import json

import pytest
import torch

from tunelab._paths import assets_dir
from tunelab.config.lora import LoRAArgs
from tunelab.data import (
    IGNORE_INDEX,
    image_chat_dataset,
    image_preference_dataset,
    load_tokenizer,
    padded_collate_dpo,
    preference_collate,
    sft_collate,
)
from tunelab.data.image_preference import ImagePairCollate
from tunelab.errors import DataError
from tunelab.training import load_model, policy_forward

TINY_VL = assets_dir() / "tiny_vl"
# Both 56 x 56 (one grid): the test swaps them.
RED = str(TINY_VL / "images" / "red_circle_0.png")
BLUE = str(TINY_VL / "images" / "blue_square_0.png")
QUESTION = "What colour is the shape?"


def _rows():
    parts = [{"type": "image", "image": RED}, {"type": "text", "text": QUESTION}]
    return [
        {"prompt": [{"role": "user", "content": parts}], "chosen": "Red.", "rejected": "Blue."},
        {"prompt": f"<image>{QUESTION}", "images": [BLUE], "chosen": "Blue.", "rejected": "Red."},
    ]


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def tokenizer():
    return load_tokenizer(TINY_VL, max_seq_len=128)


def _pairs(tokenizer, tmp_path, rows=None, **kwargs):
    file = _write(tmp_path / "pairs.jsonl", rows or _rows())
    return image_preference_dataset(
        tokenizer, source="json", data_files=file, cache_dir=str(tmp_path / "cache"),
        num_proc=1, **kwargs,
    )  # fmt: skip


def test_each_side_equals_the_chat_row_of_prompt_and_answer(tokenizer, tmp_path):
    pairs = _pairs(tokenizer, tmp_path)
    chats = []
    for row in _rows():
        for side in ("chosen", "rejected"):
            prompt = row["prompt"]
            user = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            chats.append({"messages": [*user, {"role": "assistant", "content": row[side]}],
                          **({"images": row["images"]} if "images" in row else {})})  # fmt: skip
    chat = image_chat_dataset(
        tokenizer, source="json", data_files=_write(tmp_path / "chat.jsonl", chats),
        cache_dir=str(tmp_path / "cache"), num_proc=1,
    )  # fmt: skip
    image_token = tokenizer.token_to_id("<|image_pad|>")
    for index in range(2):
        pair = pairs[index]
        for number, side in enumerate(("chosen", "rejected")):
            expected = chat[2 * index + number]
            assert pair[f"{side}_tokens"] == expected["tokens"]
            assert pair[f"{side}_labels"] == expected["labels"]
            assert pair["images"] == expected["images"]
            assert pair["image_grids"] == expected["image_grids"]
            trained = [t for t, label in zip(pair[f"{side}_tokens"], pair[f"{side}_labels"])
                       if label != IGNORE_INDEX]  # fmt: skip
            assert image_token not in trained and image_token in pair[f"{side}_tokens"]
            answer = _rows()[index][side]
            assert tokenizer.decode(trained).startswith(answer), (tokenizer.decode(trained), answer)


@pytest.mark.parametrize(
    ("change", "column", "message"),
    [
        ({"chosen": [{"role": "assistant", "content": [{"type": "image", "image": RED}]}]},
         "chosen", "an answer may not hold images"),
        ({"prompt": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "?"}]},
         "prompt", "may not hold assistant turns"),
        ({"prompt": f"<image><image>{QUESTION}", "images": [BLUE]}, "images", "2 <image>"),
        ({"prompt": [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]}],
          "images": None}, "images", "image file not found"),
    ],
)  # fmt: skip
def test_a_malformed_pair_is_one_line_with_file_and_line(
    tokenizer, tmp_path, change, column, message
):
    rows = _rows()
    rows[1] = {**rows[1], **change}
    with pytest.raises(DataError) as caught:
        _pairs(tokenizer, tmp_path, rows)
    text = str(caught.value)
    assert "\n" not in text and "pairs.jsonl:2: row 1" in text, text
    assert column in text and message in text, text
    skipped = _pairs(tokenizer, tmp_path, rows, skip_malformed=True)
    assert (len(skipped), skipped.num_skipped) == (1, 1)


def test_the_collate_lays_out_both_sides_with_their_images(tokenizer, tmp_path):
    pairs = _pairs(tokenizer, tmp_path)
    items = [{**pairs[index], "pair_index": index} for index in range(2)]
    collate = preference_collate(tokenizer)
    assert isinstance(collate, ImagePairCollate)
    batch = collate(items, pad_id=tokenizer.pad_id)
    text = padded_collate_dpo(items, tokenizer.pad_id)
    assert torch.equal(batch["tokens"], text["tokens"])
    assert torch.equal(batch["labels"], text["labels"])
    assert torch.equal(batch["pair_index"], torch.tensor([0, 1]))
    # Rows chosen 0, chosen 1, rejected 0, rejected 1: the SFT collate of those rows.
    rows = [
        {"tokens": item[f"{side}_tokens"], "labels": item[f"{side}_labels"],
         "images": item["images"], "image_grids": item["image_grids"]}
        for side in ("chosen", "rejected") for item in items
    ]  # fmt: skip
    sft = sft_collate(tokenizer)(rows, pad_id=tokenizer.pad_id)
    assert torch.equal(batch["pixel_values"], sft["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], sft["image_grid_thw"])
    assert batch["image_grid_thw"].shape[0] == 4

    # The images reach the log-probs: the first pair's image swapped moves both its sides'.
    lora = LoRAArgs(rank=2, alpha=4.0, targets=["q_proj", "v_proj"])
    model = load_model(TINY_VL, device=torch.device("cpu"), dtype=torch.float32, lora=lora)
    with torch.no_grad():
        ours = policy_forward(model.eval(), batch)
        assert items[0]["image_grids"] == items[1]["image_grids"]
        swapped = [{**items[0], "images": items[1]["images"]}, items[1]]
        moved = policy_forward(model, collate(swapped, pad_id=tokenizer.pad_id))
    for side in ("chosen_logps", "rejected_logps"):
        assert float((getattr(moved, side)[0] - getattr(ours, side)[0]).abs()) > 1e-4, side
        assert torch.equal(getattr(moved, side)[1], getattr(ours, side)[1]), side
    assert torch.isfinite(ours.chosen_logps).all() and torch.isfinite(ours.rejected_logps).all()
