"""Boolean attention masks: ``True`` means the query may attend to the key.

All masks are ``[batch, seq, seq]`` (query, key); the decoder also accepts
``[batch, 1, seq, seq]``. Every query row keeps at least one ``True`` (its own position), so
``scaled_dot_product_attention`` never normalises an empty row into NaN.

``AttentionMask`` describes the same document-causal (and sliding-window) masks without the
``[seq, seq]`` tensor; the decoder passes it to its attention layers, whose backend builds the
form its kernel takes (``tunelab.modules.attention``).
"""

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


def causal_mask(seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Lower-triangular mask: query ``i`` sees keys ``0..i``.

    Args:
        seq_len: sequence length.
        device: where to build the mask.

    Returns:
        Bool tensor ``[seq_len, seq_len]``; broadcast it or add a batch dim before use.
    """
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def padding_mask(valid: torch.Tensor) -> torch.Tensor:
    """Causal mask that also hides padding keys.

    Args:
        valid: bool ``[batch, seq]``, True on real tokens (left or right padding both work).

    Returns:
        Bool ``[batch, seq, seq]``: ``causal & valid[key]``, with the diagonal kept so padding
        queries (whose outputs are ignored) stay finite.
    """
    if valid.dtype != torch.bool or valid.dim() != 2:
        raise ValueError(
            f"valid must be a bool [batch, seq] tensor, got {valid.dtype} {valid.shape}"
        )
    seq_len = valid.shape[1]
    causal = causal_mask(seq_len, valid.device)
    eye = torch.eye(seq_len, dtype=torch.bool, device=valid.device)
    return (causal & valid[:, None, :]) | eye


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask for packed sequences.

    A query attends to earlier (or same) positions of its own document only, so packing
    documents into one row gives the same outputs as running them separately, provided the
    rotary positions restart at each document (pass them as ``input_pos``).

    Args:
        document_ids: integer ``[batch, seq]``, one id per token (padding can get its own id).

    Returns:
        Bool ``[batch, seq, seq]``.
    """
    if document_ids.dim() != 2:
        raise ValueError(
            f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}"
        )
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    return same_document & causal_mask(document_ids.shape[1], document_ids.device)


def positions_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Rotary positions that restart at 0 at every document boundary.

    Args:
        document_ids: integer ``[batch, seq]``; a document is a run of equal ids.

    Returns:
        Long ``[batch, seq]``, e.g. ids ``[0, 0, 0, 1, 1]`` give ``[0, 1, 2, 0, 1]``.
    """
    batch, seq_len = document_ids.shape
    index = torch.arange(seq_len, device=document_ids.device).expand(batch, seq_len)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # The start index of each token's run: a running max over the indices where runs begin.
    run_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - run_start


def image_block_ends(is_image: torch.Tensor) -> torch.Tensor:
    """The last key each query sees when a run of image tokens attends bidirectionally.

    Gemma 3: the tokens of one image (a maximal run of image tokens) see each other; every
    other token sees keys up to itself. Text after an image sees the whole image causally.

    Args:
        is_image: bool ``[batch, seq]``, True on image tokens.

    Returns:
        Long ``[batch, seq]``: for an image token the last position of its run, otherwise
        the token's own position (``AttentionMask``'s ``last_keys``).
    """
    batch, seq_len = is_image.shape
    index = torch.arange(seq_len, device=is_image.device).expand(batch, seq_len)
    # The first text position at or after each token, found with a cumulative min from the end.
    text_at = torch.where(is_image, torch.full_like(index, seq_len), index)
    next_text = text_at.flip(1).cummin(dim=1).values.flip(1)
    return torch.where(is_image, next_text - 1, index)


FLEX_BLOCK_SIZE = 128
"""Query and key block size of the flex_attention ``BlockMask`` (its kernels' default)."""


class AttentionMask:
    """Which keys each query sees, described without an ``[seq, seq]`` tensor.

    Causal attention within documents (``document_ids``; None: one document per row),
    optionally cut to a sliding window of ``sliding_window`` keys per query, itself included.
    With documents as runs of equal ids, query ``q`` sees exactly the keys
    ``max(start of its document, q - sliding_window + 1) .. q``: one interval per query, so
    the description is the ``[batch, seq]`` tensor of interval starts. ``last_keys`` moves an
    interval's end past the query (Gemma 3's image blocks, whose tokens see each other:
    ``image_block_ends``); the window still bounds only how far back a query reaches.
    Attention layers turn it into what their kernel takes (nothing for plain causal rows,
    ``is_causal``; a flex_attention ``BlockMask``; or the dense bool mask of the fallback
    path), and each form
    is built at most once and shared by every layer given this object (one per forward and
    attention kind).

    Args:
        batch: rows.
        seq_len: tokens per row.
        device: where the rows live.
        backend: the resolved attention backend (``tunelab.modules.attention``).
        document_ids: integer ``[batch, seq]``, a document is a run of equal ids; None for
            one document per row.
        sliding_window: keys per query, itself included; None for no window.
        query_positions: context parallelism: long ``[queries]``, the row positions of this
            rank's queries (its zig-zag slice); the keys are the whole row (``seq_len``,
            gathered by ``gather_key_values``). None: queries and keys are the whole row.
        gather_key_values: context parallelism: turns this rank's keys and values
            ``[batch, heads, queries, head_dim]`` into the whole row's (a collective with
            an exact backward, ``tunelab.distributed.ContextParallel.gather_key_values``).
        last_keys: long ``[batch, seq]``, the last key each query sees (at least itself);
            None: itself (causal). Not with ``query_positions``.
    """

    def __init__(
        self,
        batch: int,
        seq_len: int,
        device: torch.device,
        backend: str,
        document_ids: torch.Tensor | None = None,
        sliding_window: int | None = None,
        *,
        query_positions: torch.Tensor | None = None,
        gather_key_values: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
        | None = None,
        last_keys: torch.Tensor | None = None,
    ) -> None:
        if document_ids is not None and tuple(document_ids.shape) != (batch, seq_len):
            raise ValueError(
                f"document_ids must be [batch, seq] = {[batch, seq_len]}, "
                f"got shape {tuple(document_ids.shape)}"
            )
        self.batch = batch
        self.seq_len = seq_len
        self.device = torch.device(device)
        self.backend = backend
        self.document_ids = document_ids
        self.sliding_window = sliding_window
        self.query_positions = query_positions
        self.gather_key_values = gather_key_values
        if last_keys is not None and (
            query_positions is not None or tuple(last_keys.shape) != (batch, seq_len)
        ):
            raise ValueError(
                f"last_keys must be [batch, seq] = {[batch, seq_len]} without query_positions"
            )
        self.last_keys = last_keys
        self._forms: dict[str, object] = {}

    def with_window(self, sliding_window: int | None) -> "AttentionMask":
        """The same rows cut to a sliding window (a new description with its own forms)."""
        return AttentionMask(
            self.batch,
            self.seq_len,
            self.device,
            self.backend,
            self.document_ids,
            sliding_window,
            query_positions=self.query_positions,
            gather_key_values=self.gather_key_values,
            last_keys=self.last_keys,
        )

    def prepare(self, explicit_scores: bool = False) -> "AttentionMask":
        """Build now the form the backend's kernel will take, so layers only read it.

        Call it once per forward before the layers run (outside any compiled region). Plain
        causal rows need no form unless ``explicit_scores`` (soft-capped scores or attention
        sinks: a mask or flex).

        Args:
            explicit_scores: whether the layers soft-cap their scores or add sinks.

        Returns:
            This object.
        """
        if self.causal_only and not explicit_scores and self.backend != "dense":
            return self
        if self.backend == "flex":
            self.block_mask()
        else:
            self.dense()
        return self

    @property
    def causal_only(self) -> bool:
        """True when this is plain causal attention (no documents, window, cp slice or blocks)."""
        return (
            self.document_ids is None
            and self.sliding_window is None
            and self.query_positions is None
            and self.last_keys is None
        )

    def first_key(self) -> torch.Tensor:
        """Long ``[batch or 1, queries]``: the first key each query sees (its interval's start).

        Computed over the whole row, then taken at ``query_positions`` when set.
        """
        if "first_key" not in self._forms:
            index = torch.arange(self.seq_len, device=self.device)[None]
            first = torch.zeros_like(index)
            if self.document_ids is not None:
                document_ids = self.document_ids.to(self.device)
                first = index - positions_from_document_ids(document_ids)
            if self.sliding_window is not None:
                first = torch.maximum(first, index - self.sliding_window + 1)
            if self.query_positions is not None:
                first = first[:, self.query_positions.to(self.device)]
            self._forms["first_key"] = first
        return self._forms["first_key"]

    def last_key(self) -> torch.Tensor:
        """Long ``[batch or 1, queries]``: the last key each query sees (its interval's end)."""
        if self.last_keys is not None:
            return self.last_keys.to(self.device)
        if self.query_positions is not None:
            return self.query_positions.to(self.device)[None]
        return torch.arange(self.seq_len, device=self.device)[None]

    def dense(self) -> torch.Tensor:
        """Bool ``[batch or 1, 1, queries, seq]``, True = may attend (the fallback path's mask)."""
        if "dense" not in self._forms:
            keys = torch.arange(self.seq_len, device=self.device)
            first = self.first_key()[:, :, None]
            allowed = (keys >= first) & (keys <= self.last_key()[:, :, None])
            self._forms["dense"] = allowed[:, None]
        return self._forms["dense"]

    def block_mask(self) -> "BlockMask":
        """The flex_attention ``BlockMask``, built from the intervals in ``O(seq * blocks)``.

        A key block is skipped when no query of the query block sees any of its keys, fully
        attended when every query sees every key, and partial (``mask_mod`` per element)
        otherwise. No ``[seq, seq]`` tensor is built (``create_block_mask`` evaluates the
        mask at every element). With ``query_positions`` (context parallelism) the query
        blocks are this rank's queries and the key blocks the whole row's keys: the zig-zag
        slice is two runs of consecutive positions, so its blocks stay mostly full or empty.
        """
        if "block_mask" not in self._forms:
            self._forms["block_mask"] = self._build_block_mask()
        return self._forms["block_mask"]

    def _build_block_mask(self) -> "BlockMask":
        from torch.nn.attention.flex_attention import BlockMask

        size, key_len = FLEX_BLOCK_SIZE, self.seq_len
        positions = self.query_positions
        if positions is None:
            positions = torch.arange(key_len, device=self.device)
        positions = positions.to(self.device)
        query_len = positions.shape[0]
        num_query_blocks, num_key_blocks = -(-query_len // size), -(-key_len // size)
        padded = num_query_blocks * size
        # Padding queries (past the last one) sit past the last key: they touch no key block,
        # and flex drops their outputs.
        beyond = torch.full((padded - query_len,), key_len, device=self.device)
        first = self.first_key().expand(self.batch, query_len)
        first = torch.cat([first, beyond.expand(self.batch, -1)], dim=1)
        last = torch.cat(
            [self.last_key().expand(self.batch, query_len), beyond.expand(self.batch, -1)], dim=1
        )
        block_start = torch.arange(num_key_blocks, device=self.device) * size
        block_last = torch.clamp(block_start + size - 1, max=key_len - 1)
        lo, hi = first[:, :, None], last[:, :, None]
        # [batch, padded queries, key blocks], then reduced over each query block.
        touches = (lo <= block_last) & (hi >= block_start)
        covers = (lo <= block_start) & (hi >= block_last)
        valid = torch.arange(padded, device=self.device) < query_len
        covers = covers | ~valid[None, :, None]
        touches = touches & valid[None, :, None]
        any_ = touches.view(self.batch, num_query_blocks, size, num_key_blocks).any(dim=2)
        full = covers.view(self.batch, num_query_blocks, size, num_key_blocks).all(dim=2) & any_
        partial = any_ & ~full

        def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            counts = blocks.sum(dim=-1, dtype=torch.int32)[:, None]
            order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
            return counts, order.to(torch.int32)[:, None]

        first_key, last_key = first, last

        def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 (flex's signature)
            return (kv_idx >= first_key[b, q_idx]) & (kv_idx <= last_key[b, q_idx])

        counts, indices = ordered(partial)
        full_counts, full_indices = ordered(full)
        return BlockMask.from_kv_blocks(
            counts,
            indices,
            full_counts,
            full_indices,
            BLOCK_SIZE=size,
            mask_mod=mask_mod,
            seq_lengths=(query_len, key_len),
        )
