"""Mapping between native parameter names and Hugging Face checkpoint keys.

Native names already mirror ``LlamaForCausalLM``, so the base mapping is the identity; what
it does own is the tied ``lm_head`` and the one place a family adds renames (override
``to_hf_key`` / ``from_hf_key``). Checkpoint code calls these methods and never switches on
the family.
"""

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from tunelab.checkpoint.hf import hf_dtype_name
from tunelab.errors import CheckpointError
from tunelab.models.args import ModelArgs

TIED_HEAD_KEY = "lm_head.weight"
EMBEDDING_KEY = "model.embed_tokens.weight"


class StateDictAdapter:
    """Converts state dicts between native and HF names for one family.

    Args:
        args: the model's arguments (the adapter reads ``tie_embeddings``).
    """

    model_type: ClassVar[str] = ""
    architecture: ClassVar[str] = ""

    def __init__(self, args: ModelArgs) -> None:
        self.args = args

    def to_hf_key(self, native_key: str) -> str:
        """HF key of a native parameter name (identity here; override to rename)."""
        return native_key

    def from_hf_key(self, hf_key: str) -> str:
        """Native parameter name of an HF key (identity here; override to rename)."""
        return hf_key

    def tied_hf_keys(self) -> dict[str, str]:
        """HF keys that may appear in a file but alias another key, mapped to that key.

        A tied checkpoint normally omits ``lm_head.weight``; some tools write it anyway, equal
        to the embedding. Readers accept it only if it equals its partner.
        """
        return {TIED_HEAD_KEY: EMBEDDING_KEY} if self.args.tie_embeddings else {}

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Rename a native state dict to HF keys, dropping the tied ``lm_head``.

        Args:
            state_dict: native names to tensors (values pass through untouched).

        Returns:
            HF keys to the same values.
        """
        tied = self.tied_hf_keys()
        hf = {self.to_hf_key(key): value for key, value in state_dict.items()}
        for key in tied:
            hf.pop(key, None)
        return hf

    def from_hf(self, hf_state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Rename an HF state dict to native names.

        Args:
            hf_state_dict: HF keys to tensors.

        Returns:
            Native names to the same tensors; a tied ``lm_head.weight`` is dropped.

        Raises:
            CheckpointError: a tied key is present but differs from the tensor it aliases.
        """
        out = {}
        tied = self.tied_hf_keys()
        for key, value in hf_state_dict.items():
            partner = tied.get(key)
            if partner is not None:
                if partner in hf_state_dict and not torch.equal(value, hf_state_dict[partner]):
                    raise CheckpointError(
                        f"{key} differs from {partner}, but the config ties word embeddings"
                    )
                continue
            out[self.from_hf_key(key)] = value
        return out

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers`` loads as this model.

        Args:
            torch_dtype: dtype to record (``torch_dtype`` and transformers 5's ``dtype``).

        Returns:
            The config dict.
        """
        raise NotImplementedError

    def _with_identity(self, config: dict[str, Any], torch_dtype: torch.dtype | None) -> dict:
        config = {"architectures": [self.architecture], "model_type": self.model_type, **config}
        if torch_dtype is not None:
            config["torch_dtype"] = config["dtype"] = hf_dtype_name(torch_dtype)
        return config
