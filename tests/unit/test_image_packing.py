"""Packing chat rows with images (``image_chat_dataset(packed=True)``) on the tiny Qwen2.5-VL
and Gemma 3 models and ``tiny/vl_lora``'s generated images.

A pack holds whole samples, each with its images (tokens, files and grids in document order);
a batch of packs trains as its rows do unpacked: the same loss and the same gradients, the
vision tower's included, within fp32 rounding (Qwen's M-RoPE positions restart per document,
Gemma 3's image blocks stay inside theirs). Without its documents the same pack does not. A
sample that ``max_seq_len`` would cut inside or before an image is refused (one line) or
skipped; one cut after its images is kept, truncated.
"""

import json

import pytest
import torch

from tunelab._paths import assets_dir
from tunelab.data import image_chat_dataset, load_tokenizer, sft_collate
from tunelab.data.rows import IGNORE_INDEX
from tunelab.errors import DataError
from tunelab.losses import CrossEntropyLoss
from tunelab.models import load_pretrained
from tunelab.training.loop import batch_loss

TINY_VL = assets_dir() / "tiny_vl"
CHAT = TINY_VL / "chat.jsonl"
PACK = 256
# family -> (model folder, its image token)
FAMILIES = {
    "qwen2_5_vl": (assets_dir() / "tiny_vl", "<|image_pad|>"),
    "gemma3": (assets_dir() / "tiny_gemma3_vl", "<image_soft_token>"),
}


def _image_tokens(family, grids):
    """Language tokens of images of these grids: Qwen's patches / 4, Gemma 3's 16 a piece."""
    if family["name"] == "gemma3":
        return 16 * sum(grid[0] for grid in grids)
    return sum(frames * rows * columns for frames, rows, columns in grids) // 4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    folder, image_token = FAMILIES[request.param]
    tokenizer = load_tokenizer(folder, max_seq_len=PACK)
    build = dict(
        source="json",
        data_files=str(CHAT),
        max_seq_len=PACK,
        num_proc=1,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
    )
    rows = image_chat_dataset(tokenizer, **build)
    packs = image_chat_dataset(tokenizer, packed=True, **build)
    return {
        "name": request.param,
        "folder": folder,
        "tokenizer": tokenizer,
        "image_token": tokenizer.token_to_id(image_token),
        "rows": rows,
        "packs": packs,
    }


def _documents(pack):
    """A pack's documents as ``(tokens, labels)``, its padded tail left out."""
    documents: dict[int, tuple[list, list]] = {}
    for token, label, document in zip(pack["tokens"], pack["labels"], pack["document_ids"]):
        tokens, labels = documents.setdefault(document, ([], []))
        tokens.append(token)
        labels.append(label)
    return list(documents.values())


def _packed_rows(family):
    """Each pack with the indices of the samples it holds, found by walking both in order."""
    rows, packs, pad = family["rows"], family["packs"], family["tokenizer"].pad_id
    out, next_row = [], 0
    for index in range(len(packs)):
        pack, held = packs[index], []
        for tokens, labels in _documents(pack):
            if next_row < len(rows) and tokens == rows[next_row]["tokens"]:
                assert labels == rows[next_row]["labels"]
                held.append(next_row)
                next_row += 1
            else:  # the padded tail
                assert set(tokens) == {pad} and set(labels) == {IGNORE_INDEX}
        out.append((pack, held))
    assert next_row == len(rows)
    return out


def test_a_pack_holds_whole_samples_with_their_images(family):
    rows = family["rows"]
    packed = _packed_rows(family)
    assert len(packed) < len(rows) / 2  # three samples a pack
    assert all(len(held) >= 2 for _, held in packed[:-1])
    for pack, held in packed:
        assert len(pack["tokens"]) == PACK
        assert pack["images"] == [image for row in held for image in rows[row]["images"]]
        assert pack["image_grids"] == [grid for row in held for grid in rows[row]["image_grids"]]
        image_tokens = sum(token == family["image_token"] for token in pack["tokens"])
        assert image_tokens == _image_tokens(family, pack["image_grids"])
        assert not any(
            label != IGNORE_INDEX and token == family["image_token"]
            for token, label in zip(pack["tokens"], pack["labels"])
        )


def _loss_and_gradients(model, batch):
    model.zero_grad(set_to_none=True)
    loss_sum, num_tokens = batch_loss(CrossEntropyLoss(), model, batch)
    loss = loss_sum / num_tokens
    loss.backward()
    return float(loss.detach()), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def assert_same_gradients(packed_grads, rows_grads):
    """Each gradient within 1e-5 of its own size, or of the model's largest for one that is
    rounding noise by itself (a key bias: softmax ignores it, its true gradient is 0)."""
    assert packed_grads.keys() == rows_grads.keys()
    largest = max(float(grad.abs().max()) for grad in rows_grads.values())
    for name, grad in rows_grads.items():
        scale = max(float(grad.abs().max()), 1e-3 * largest)
        assert float((packed_grads[name] - grad).abs().max()) <= 1e-5 * scale, name


def test_a_batch_of_packs_trains_as_its_rows(family):
    packed = _packed_rows(family)[:2]
    rows = family["rows"]
    collate = sft_collate(family["tokenizer"])
    pad_id = family["tokenizer"].pad_id
    packs_batch = collate([pack for pack, _ in packed], pad_id=pad_id)
    rows_batch = collate([rows[row] for _, held in packed for row in held], pad_id=pad_id)
    assert torch.equal(packs_batch["pixel_values"], rows_batch["pixel_values"])
    assert torch.equal(packs_batch["image_grid_thw"], rows_batch["image_grid_thw"])
    assert packs_batch["document_ids"].shape == packs_batch["tokens"].shape

    torch.manual_seed(0)
    model = load_pretrained(family["folder"])
    packed_loss, packed_grads = _loss_and_gradients(model, packs_batch)
    rows_loss, rows_grads = _loss_and_gradients(model, rows_batch)
    assert abs(packed_loss - rows_loss) <= 1e-6 * abs(rows_loss), (packed_loss, rows_loss)
    assert any(name.startswith(("visual.", "vision_tower.")) for name in packed_grads)
    assert_same_gradients(packed_grads, rows_grads)

    # The documents are what keeps it so: the same packs read as one document each differ.
    one_document = {k: v for k, v in packs_batch.items() if k not in ("document_ids", "input_pos")}
    assert abs(_loss_and_gradients(model, one_document)[0] - rows_loss) > 1e-3


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_sample_longer_than_the_pack_keeps_its_images_whole_or_is_refused(tmp_path):
    tokenizer = load_tokenizer(TINY_VL, max_seq_len=PACK)
    image = str(TINY_VL / "images" / "red_circle_0.png")
    words = "the shape is round and red " * 12
    rows = [
        # The image first, a long answer: cut after the image, kept.
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": image}]},
                {"role": "assistant", "content": words},
            ]
        },
        # A long question before the image: the cut would drop it.
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": words}, {"type": "image", "image": image}],
                },  # fmt: skip
                {"role": "assistant", "content": "Red."},
            ]
        },
        # A chat row of tiny/vl_lora (its image at tokens 36-39): cut after the image, kept.
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": image},
                        {"type": "text", "text": "What colour is the shape?"},
                    ],
                },  # fmt: skip
                {"role": "assistant", "content": "Red."},
            ]
        },
    ]
    file = _write(tmp_path / "long.jsonl", rows)
    build = dict(source="json", data_files=file, max_seq_len=64, packed=True, num_proc=1)
    build["cache_dir"] = str(tmp_path / "cache")
    with pytest.raises(DataError) as caught:
        image_chat_dataset(tokenizer, **build)
    message = str(caught.value)
    assert message.startswith(f"{file}:2: row 1 (0-based)") and "would cut an image" in message
    assert "\n" not in message
    packs = image_chat_dataset(tokenizer, skip_malformed=True, **build)
    assert (packs.num_skipped, packs.num_truncated) == (1, 2)  # both kept rows are cut
    image_token = tokenizer.token_to_id("<|image_pad|>")
    for index in range(len(packs)):
        pack = packs[index]
        assert len(pack["tokens"]) == 64
        count = sum(token == image_token for token in pack["tokens"])
        assert count == 4 * len(pack["images"])
    assert [len(packs[index]["images"]) for index in range(len(packs))] == [1, 1]
