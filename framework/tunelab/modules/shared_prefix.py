"""Rows that share their prompt: each prompt computed once, its keys and values reused by its rows.

A GRPO micro-batch holds ``G`` completions of each prompt. Its forward can run each distinct
prompt once and let every completion attend to its prompt's keys and values, copied over the
rows with ``index_select`` (whose backward sums the rows' gradients into the one prompt: the
gradients are those of the per-row forward, up to summation order).

Its layout is a grid of ``num_prompts * prompt_len + rows * completion_len`` slots: the prompts
``[num_prompts, prompt_len]`` (each padded after its end), then the completions
``[rows, completion_len]`` (padded after). The forward takes one packed row of the grid's
occupied slots only (``slots``, their indices in the grid, in order; None: every slot, padding
included). Norms, projections and the MLP act on each token alone, so they run once over the
packed row and never on padding; only attention needs the grid, so it scatters the queries,
keys and values into it (zeros on the padding, which no real token attends to), attends, and
gathers the occupied slots back:

- a prompt token attends causally within its prompt;
- completion token ``j`` of row ``i`` attends to the slots ``< prompt_lengths[i]`` of its
  prompt ``of_row[i]`` and to its own completion tokens ``<= j``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SharedPrefix"]


@dataclass
class SharedPrefix:
    """The layout of a packed prompts-then-completions row (see the module docstring).

    Attributes:
        num_prompts: Distinct prompts.
        prompt_len: Slots per prompt (the longest prompt).
        of_row: long ``[rows]``: each row's prompt.
        prompt_lengths: long ``[rows]``: each row's prompt length.
        completion_len: Slots per completion (the longest completion).
        slots: long ``[T]``: the grid slot of each token of the packed row, increasing (None:
            the packed row is the whole grid).
    """

    num_prompts: int
    prompt_len: int
    of_row: torch.Tensor
    prompt_lengths: torch.Tensor
    completion_len: int
    slots: torch.Tensor | None = None
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def rows(self) -> int:
        """Completions."""
        return self.of_row.shape[0]

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cut ``[1, heads, T, d]`` into prompts and completions.

        Returns:
            ``[num_prompts, heads, prompt_len, d]`` and ``[rows, heads, completion_len, d]``.
        """
        _, heads, _, dim = x.shape
        if self.slots is not None:
            grid = self.num_prompts * self.prompt_len + self.rows * self.completion_len
            x = x.new_zeros(1, heads, grid, dim).index_copy(2, self.slots, x)
        cut = self.num_prompts * self.prompt_len
        prompts = x[0, :, :cut].view(heads, self.num_prompts, self.prompt_len, dim)
        completions = x[0, :, cut:].view(heads, self.rows, self.completion_len, dim)
        return prompts.transpose(0, 1), completions.transpose(0, 1)

    def join(self, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`split`: ``[1, heads, T, d]``."""
        heads, dim = prompts.shape[1], prompts.shape[3]
        parts = [t.transpose(0, 1).reshape(heads, -1, dim) for t in (prompts, completions)]
        grid = torch.cat(parts, dim=1)[None]
        return grid if self.slots is None else grid.index_select(2, self.slots)

    def completion_keys(self, prompt_kv: torch.Tensor, completion_kv: torch.Tensor) -> torch.Tensor:
        """Each row's keys (or values): its prompt's, then its own.

        Returns:
            ``[rows, kv_heads, prompt_len + completion_len, d]``.
        """
        return torch.cat([prompt_kv.index_select(0, self.of_row), completion_kv], dim=2)

    def completion_mask(self) -> torch.Tensor:
        """The completions' mask, ``[rows, 1, completion_len, prompt_len + completion_len]``.

        True = may attend: the row's prompt slots before its length, its own slots causally.
        """
        if self._mask is None:
            device = self.of_row.device
            slots = torch.arange(self.prompt_len, device=device)
            prompt = (slots[None, :] < self.prompt_lengths[:, None])[:, None, None, :]
            own = torch.ones(
                self.completion_len, self.completion_len, dtype=torch.bool, device=device
            ).tril()
            shape = (self.rows, 1, self.completion_len, self.prompt_len)
            self._mask = torch.cat([prompt.expand(shape), own.expand(self.rows, 1, -1, -1)], dim=-1)
        return self._mask
