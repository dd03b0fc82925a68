"""A static key/value cache for incremental decoding, written in place."""

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of past positions, one slot per position.

    Slot ``p`` holds the key/value of rotary position ``p``: a forward with ``input_pos``
    writes its keys there, and attention then reads the whole cache under a mask that hides
    slots after each query's position. Buffers are non-persistent, so they never enter a
    ``state_dict`` or a checkpoint.

    Args:
        batch_size: rows decoded together.
        num_kv_heads: key/value heads.
        max_seq_len: number of slots (prompt plus generated tokens).
        head_dim: per-head feature size.
        dtype: cache dtype (the activations' dtype).
        device: cache device.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer(
            "k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )
        self.max_seq_len = max_seq_len
        self.position_offsets: torch.Tensor | None = None
        """Long ``[batch]`` or None: what each row adds to a slot to get the rotary position of
        the tokens decoded after its prompt (a vision-language model's M-RoPE prompt, whose
        images take fewer positions than tokens, sets it at its prefill). Rows follow
        :meth:`select_rows`."""
        self.slot_rows = self._slot_rows()
        """Long ``[batch, heads, 1]``: where each row's head starts in the cache seen as rows of
        ``head_dim`` (:meth:`update`'s write index; follows :meth:`select_rows`)."""

    def reset(self) -> None:
        """Clear every slot."""
        self.k_cache.zero_()
        self.v_cache.zero_()

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` names, in its order (a row may repeat).

        Expands a prefill's cache over the rows that share its prompt, and drops finished rows
        from a decoding batch: one ``index_select`` per buffer, values copied bit for bit.

        Args:
            index: long ``[new_batch]`` rows of the current cache.
        """
        self.k_cache = self.k_cache.index_select(0, index)
        self.v_cache = self.v_cache.index_select(0, index)
        self.slot_rows = self._slot_rows()
        if self.position_offsets is not None:
            self.position_offsets = self.position_offsets.index_select(0, index)

    def _slot_rows(self) -> torch.Tensor:
        """Long ``[batch, heads, 1]``: the row of slot 0 of each row's head in the flat cache."""
        batch, heads, length, _ = self.k_cache.shape
        return (
            torch.arange(batch * heads, device=self.k_cache.device)
            .mul_(length)
            .view(batch, heads, 1)
        )

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values at their positions and return the full cache.

        Args:
            input_pos: long ``[batch, seq]`` slots to write.
            k: ``[batch, num_kv_heads, seq, head_dim]``.
            v: same shape as ``k``.

        Returns:
            ``(k_cache, v_cache)``, each ``[batch, num_kv_heads, max_seq_len, head_dim]``.
        """
        batch, heads, seq_len, head_dim = k.shape
        if (
            k.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and self.k_cache.is_contiguous()
            and self.v_cache.is_contiguous()
            and k.dtype == self.k_cache.dtype
            and v.dtype == self.v_cache.dtype
            and (batch, heads) == self.k_cache.shape[:2]
            and self.slot_rows.device == k.device
        ):
            # One ``index_copy_`` per buffer into the cache seen as rows of ``head_dim``:
            # slot ``p`` of head ``h`` of row ``b`` is row ``(b * heads + h) * length + p``.
            # The values are copied as they are (no cast), so the cache holds the same bits
            # as the indexed assignment below writes, at a fraction of its dispatch cost. A
            # slot past ``length`` would land in the next head: ``TransformerDecoder``
            # refuses such positions first (CPU, eager: this path only).
            index = (self.slot_rows + input_pos[:, None, :]).view(-1)
            self.k_cache.view(-1, head_dim).index_copy_(0, index, k.reshape(-1, head_dim))
            self.v_cache.view(-1, head_dim).index_copy_(0, index, v.reshape(-1, head_dim))
            return self.k_cache, self.v_cache
        rows = torch.arange(batch, device=k.device)[:, None]
        # Advanced indices on dims 0 and 2 put [batch, seq] first: values are [b, s, heads, dim].
        self.k_cache[rows, :, input_pos] = k.transpose(1, 2).to(self.k_cache.dtype)
        self.v_cache[rows, :, input_pos] = v.transpose(1, 2).to(self.v_cache.dtype)
        return self.k_cache, self.v_cache
