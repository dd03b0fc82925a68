"""A tqdm progress bar on rank 0 showing loss, learning rate, tokens/s (and RL's reward)."""

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

    def update(
        self, *, loss: float, lr: float, tokens_per_second: float, reward: float | None = None
    ) -> None:
        """Advance one step and show its figures (the mean reward too, for RL steps)."""
        figures = {"loss": f"{loss:.4f}", "lr": f"{lr:.2e}", "tok_s": f"{tokens_per_second:.0f}"}
        if reward is not None:
            figures["reward"] = f"{reward:.3f}"
        self._bar.set_postfix(figures)
        self._bar.update(1)

    def close(self) -> None:
        """Finish the bar."""
        self._bar.close()
