"""A tqdm progress bar on rank 0 showing loss, learning rate and tokens/s."""

from tqdm import tqdm


class ProgressBar:
    """Progress over optimizer steps; silent on ranks other than 0.

    Args:
        total: Steps in the run.
        initial: Steps already done (a resumed run starts part way).
        enabled: Whether to draw (rank 0 only).
    """

    def __init__(self, total: int, *, initial: int = 0, enabled: bool = True) -> None:
        self._bar = tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True)

    def update(self, *, loss: float, lr: float, tokens_per_second: float) -> None:
        """Advance one step and show its figures."""
        self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:.0f}")
        self._bar.update(1)

    def close(self) -> None:
        """Finish the bar."""
        self._bar.close()
