"""The LoRA settings a checkpoint was trained with, shared by the client and the exporter."""

from dataclasses import dataclass
from typing import Any

from tunelab.peft.state import adapter_config


@dataclass(frozen=True)
class LoRASpec:
    """The LoRA settings a checkpoint was trained with (part of its fingerprint)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False
    dropout: float = 0.0
    use_dora: bool = False
    quantize_base: str | None = None

    def peft_config(self, base_model_name_or_path: str) -> dict[str, Any]:
        """The ``adapter_config.json`` PEFT needs to load an adapter with these settings."""
        return adapter_config(
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
            targets=list(self.targets),
            use_rslora=self.use_rslora,
            use_dora=self.use_dora,
            base_model_name_or_path=base_model_name_or_path,
        )
