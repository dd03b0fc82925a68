"""Batches collated in DataLoader worker processes (``schedule.dataloader_workers``).

Image rows (``tiny/vl_lora``'s generated images on the tiny Qwen2.5-VL) are read and cut into
patches by the collate; with workers that runs in the worker processes, not the training
process. The batches are the same with 0 and 2 workers, epoch after epoch, packed or not, and
a loader with 2 workers resumed from a sampler position saved mid-epoch by one with 0 gives the
rest of that epoch exactly.
"""

import os
from dataclasses import dataclass

import pytest
import torch

from tunelab._paths import assets_dir
from tunelab.data import image_chat_dataset, load_tokenizer, sft_collate
from tunelab.training.setup import build_dataloader

TINY_VL = assets_dir() / "tiny_vl"
BATCH = 2


@dataclass(frozen=True)
class WhereCollated:
    """The image collate, and the id of the process that ran it (picklable for workers)."""

    collate: object

    def __call__(self, batch, **kwargs):
        out = self.collate(batch, **kwargs)
        out["pid"] = torch.tensor(os.getpid())
        return out


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_VL, max_seq_len=128)


@pytest.fixture(scope="module", params=[False, True], ids=["rows", "packed"])
def dataset(request, tokenizer, tmp_path_factory):
    return image_chat_dataset(
        tokenizer,
        source="json",
        data_files=str(TINY_VL / "chat.jsonl"),
        max_seq_len=128 if not request.param else 256,
        packed=request.param,
        num_proc=1,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
    )


def _loader(dataset, tokenizer, workers, batch_size=BATCH):
    return build_dataloader(
        dataset,
        batch_size=batch_size,
        collate_fn=WhereCollated(sft_collate(tokenizer)),
        seed=3,
        num_workers=workers,
        pad_id=tokenizer.pad_id,
    )


def _batches(loader):
    return [dict(batch) for batch in loader]


def _assert_same(ours, theirs):
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs, strict=True):
        assert set(a) == set(b)
        for key in a:
            if key != "pid":
                assert torch.equal(a[key], b[key]), key


def test_two_workers_give_the_batches_of_none_epoch_after_epoch(dataset, tokenizer):
    inline, inline_sampler = _loader(dataset, tokenizer, 0)
    workers, workers_sampler = _loader(dataset, tokenizer, 2)
    assert "pixel_values" in next(iter(inline))
    for epoch in range(2):
        inline_sampler.set_epoch(epoch)
        workers_sampler.set_epoch(epoch)
        ours, theirs = _batches(workers), _batches(inline)
        _assert_same(ours, theirs)
        # The images were read in the workers; without them in this process.
        assert {int(b["pid"]) for b in theirs} == {os.getpid()}
        assert os.getpid() not in {int(b["pid"]) for b in ours}
    assert len(ours) == len(dataset) // BATCH


def test_two_workers_resume_a_position_saved_without_workers(dataset, tokenizer):
    reference, reference_sampler = _loader(dataset, tokenizer, 0)
    reference_sampler.set_epoch(1)
    whole = _batches(reference)
    # A run that took 3 batches of epoch 1 (its checkpoint records the sampler's position) ...
    stopped, stopped_sampler = _loader(dataset, tokenizer, 0)
    stopped_sampler.set_epoch(1)
    iterator = iter(stopped)
    for _ in range(3):
        next(iterator)
        stopped_sampler.advance(BATCH)
    saved = stopped_sampler.state_dict()
    del iterator
    # ... resumed with 2 workers: the rest of the epoch, batch for batch.
    resumed, resumed_sampler = _loader(dataset, tokenizer, 2)
    resumed_sampler.load_state_dict(saved)
    resumed_sampler.set_epoch(saved["epoch"])
    _assert_same(_batches(resumed), whole[3:])
