"""Packing chat rows with videos (``image_chat_dataset(packed=True)``) on the tiny Qwen2.5-VL
and Qwen3-VL models: a pack holds whole samples with their videos (frames, grids and seconds
per frame pair in document order), and a batch of packs trains as its rows do unpacked (the
same loss and gradients, the tower's included, within fp32 rounding: M-RoPE restarts per
document, Qwen2.5-VL's temporal spacing and Qwen3-VL's per-pair runs included). Read as one
document each, the same packs do not.
"""

import pytest
import torch

from tests.recipes.test_vl_video_recipe import CONFIGS, model_with_video_template, video_rows
from tests.unit.test_image_packing import _loss_and_gradients, assert_same_gradients
from tunelab.data import image_chat_dataset, load_tokenizer, sft_collate
from tunelab.models import load_pretrained

PACK = 256


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    folder = model_with_video_template(root / "model", CONFIGS[request.param][1])
    tokenizer = load_tokenizer(folder, max_seq_len=PACK)
    build = dict(source="json", data_files=str(video_rows(root)), max_seq_len=PACK, num_proc=1)
    build["cache_dir"] = str(root / "cache")
    rows = image_chat_dataset(tokenizer, **build)
    packs = image_chat_dataset(tokenizer, packed=True, **build)
    return folder, tokenizer, rows, packs


def test_a_batch_of_packs_trains_as_its_rows(family):
    folder, tokenizer, rows, packs = family
    assert len(packs) < len(rows)
    pad_id = tokenizer.pad_id
    pack_items = [packs[0], packs[1]]
    row_items = []
    for pack in pack_items:  # the pack's documents are rows in order
        wanted = pack["videos"]
        while wanted:
            row = rows[len(row_items)]
            row_items.append(row)
            assert wanted[: len(row["videos"])] == row["videos"]
            wanted = wanted[len(row["videos"]) :]
    for name in ("videos", "video_grids", "video_seconds", "images"):
        assert [v for p in pack_items for v in p[name]] == [v for r in row_items for v in r[name]]
    collate = sft_collate(tokenizer)
    packs_batch = collate(pack_items, pad_id=pad_id)
    rows_batch = collate(row_items, pad_id=pad_id)
    for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "pixel_values"):
        assert torch.equal(packs_batch[key], rows_batch[key]), key

    torch.manual_seed(0)
    model = load_pretrained(folder)
    packed_loss, packed_grads = _loss_and_gradients(model, packs_batch)
    rows_loss, rows_grads = _loss_and_gradients(model, rows_batch)
    assert abs(packed_loss - rows_loss) <= 1e-6 * abs(rows_loss), (packed_loss, rows_loss)
    assert_same_gradients(packed_grads, rows_grads)

    one_document = {k: v for k, v in packs_batch.items() if k not in ("document_ids", "input_pos")}
    assert abs(_loss_and_gradients(model, one_document)[0] - rows_loss) > 1e-3
