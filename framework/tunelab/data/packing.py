"""Pack tokenized samples into fixed-length sequences with per-document positions.

Greedy, in order: samples are appended to the current pack until the next one does not fit,
then the pack is closed and its tail padded. A sample longer than ``max_seq_len`` was already
truncated by the builder. Each pack carries ``input_pos`` (rotary positions, restarting at 0 at
every document, so a document sees the positions it would see alone) and ``document_ids``
(0, 1, ... per document; the padded tail is one more document of its own) for the block-
diagonal causal mask.

Documents never leak into each other through the shifted loss either: every template starts a
document with a masked token (BOS or a role header), so the target that the last token of one
document would predict, the next document's first token, is always ``ignore_index``.

Samples with images (``image_chat_dataset``) keep them: a pack lists the ``images`` and
``image_grids`` of its documents in order, which is the order of their image tokens, so every
image's tokens and pixels stay in the document that holds them (a sample is never split: one
that ``max_seq_len`` would cut inside an image is refused when it is tokenised). The model
restarts its positions at each document (Qwen's M-RoPE per document, Gemma 3's image blocks
inside one).
"""

from typing import Any

IMAGE_COLUMNS = ("images", "image_grids", "videos", "video_grids", "video_seconds")
"""A sample's lists that a pack concatenates in document order (per image, per video)."""


def pack_samples(
    samples: list[dict[str, list[int]]],
    max_seq_len: int,
    pad_id: int,
    ignore_index: int = -100,
) -> list[dict[str, Any]]:
    """Pack ``samples`` into sequences of exactly ``max_seq_len`` tokens.

    Args:
        samples: Items with ``tokens`` and ``labels`` (each at most ``max_seq_len`` long), and
            ``images`` and ``image_grids`` when they hold images.
        max_seq_len: Length of every pack.
        pad_id: Token id for the padded tail.
        ignore_index: Label of padded positions.

    Returns:
        Packs with ``tokens``, ``labels``, ``input_pos`` and ``document_ids`` lists, each of
        length ``max_seq_len``, and the documents' ``images`` and ``image_grids`` when the
        samples have them.
    """
    images = [name for name in IMAGE_COLUMNS if samples and name in samples[0]]

    def empty() -> dict[str, list[Any]]:
        return {name: [] for name in ("tokens", "labels", "input_pos", "document_ids", *images)}

    packs: list[dict[str, Any]] = []
    current = empty()
    num_documents = 0

    def close() -> None:
        nonlocal current, num_documents
        num_pad = max_seq_len - len(current["tokens"])
        current["tokens"] += [pad_id] * num_pad
        current["labels"] += [ignore_index] * num_pad
        current["input_pos"] += list(range(num_pad))
        current["document_ids"] += [num_documents] * num_pad
        packs.append(current)
        current = empty()
        num_documents = 0

    for sample in samples:
        length = len(sample["tokens"])
        assert 0 < length <= max_seq_len, "samples are truncated before packing"
        if len(current["tokens"]) + length > max_seq_len:
            close()
        current["tokens"] += sample["tokens"]
        current["labels"] += sample["labels"]
        current["input_pos"] += list(range(length))
        current["document_ids"] += [num_documents] * length
        for name in images:
            current[name] += sample[name] or []
        num_documents += 1
    if current["tokens"]:
        close()
    return packs
