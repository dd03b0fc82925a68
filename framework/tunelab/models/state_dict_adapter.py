"""Mapping between native parameter names and Hugging Face checkpoint keys.

Native names already mirror ``LlamaForCausalLM``, so the base mapping is the identity; what
it does own is the tied ``lm_head`` and the one place a family adds renames (override
``to_hf_key`` / ``from_hf_key``). Checkpoint code calls these methods and never switches on
the family.

Mixture-of-experts families hold each layer's experts stacked (``mlp.experts.gate_up_proj``
``[E, 2I, D]``, transformers 5's in-memory names) where hub checkpoints keep one tensor per
expert and projection (``mlp.experts.3.gate_proj.weight``). ``expert_hf_keys`` names those;
``to_hf`` splits a stacked tensor into them (for a sharded one, only this rank's experts), and
``from_hf`` and the loader stack them back. A file written in the stacked layout itself
(transformers 5's ``save_pretrained(save_original_format=False)``) holds the native names:
``stacked_layout_adapter`` reads it.
"""

import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from tunelab._torch_compat import local_shape_and_global_offset
from tunelab.errors import CheckpointError
from tunelab.formats.hf import hf_dtype_name
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

    @property
    def classifier_architecture(self) -> str:
        """The sequence-classification class of this family in transformers (a reward model's)."""
        return self.architecture.replace("ForCausalLM", "ForSequenceClassification")

    def to_hf_key(self, native_key: str) -> str:
        """HF key of a native parameter name (identity here; override to rename)."""
        return native_key

    def from_hf_key(self, hf_key: str) -> str:
        """Native parameter name of an HF key (identity here; override to rename)."""
        return hf_key

    def expert_hf_keys(self, native_key: str) -> list[tuple[str, ...]] | None:
        """The per-expert HF keys of a native tensor stacked over experts, else None.

        Args:
            native_key: a native parameter name.

        Returns:
            For each expert ``e``, the HF keys whose tensors, concatenated along dimension 0,
            are ``native[e]`` (e.g. its ``gate_proj`` then ``up_proj`` weight); None for a
            tensor stored under one key (dense families: always).
        """
        return None

    def mxfp4_hf_keys(self, hf_key: str) -> tuple[str, str] | None:
        """The keys of an MXFP4 form of an HF tensor a file may hold instead of it, else None.

        gpt-oss's hub checkpoints keep each expert weight ``[E, in, out]`` as
        ``(key_blocks, key_scales)`` (``tunelab.formats.mxfp4``), quantized along ``in``:
        dequantized they give ``[E, out, in]``, the tensor transposed over its last two
        dimensions. The loader dequantizes them (each rank only its experts).

        Args:
            hf_key: an HF key of this model.

        Returns:
            ``(blocks_key, scales_key)``, or None where no quantized form exists (here: always).
        """
        return None

    def for_file_keys(self, keys: Iterable[str]) -> "StateDictAdapter":
        """The adapter of a file holding ``keys``, when a family's files come in two layouts.

        This one; Gemma 3's multimodal family also reads transformers 5's tower keys.
        """
        return self

    def stacked_layout_adapter(self) -> "StateDictAdapter":
        """The adapter of a file that holds the stacked experts under their native names."""
        return StateDictAdapter(self.args)

    def tied_hf_keys(self) -> dict[str, str]:
        """HF keys that may appear in a file but alias another key, mapped to that key.

        A tied checkpoint normally omits ``lm_head.weight``; some tools write it anyway, equal
        to the embedding. Readers accept it only if it equals its partner.
        """
        return {TIED_HEAD_KEY: self.to_hf_key(EMBEDDING_KEY)} if self.args.tie_embeddings else {}

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Rename a native state dict to HF keys, dropping the tied ``lm_head``.

        Args:
            state_dict: native names to tensors (values pass through untouched).

        Returns:
            HF keys to the same values.
        """
        tied = self.tied_hf_keys()
        hf = {}
        for key, value in state_dict.items():
            experts = self.expert_hf_keys(key)
            if experts is None:
                hf[self.to_hf_key(key)] = value
            else:
                hf.update(split_experts(key, value, experts))
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


def split_experts(
    native_key: str, value: Any, experts: list[tuple[str, ...]]
) -> dict[str, torch.Tensor]:
    """Split a tensor stacked over experts into its per-expert HF tensors (views).

    A ``DTensor`` sharded on the experts dimension (FSDP2's ``Shard(0)``, possibly replicated
    on other mesh dimensions) gives only the experts this rank holds, whole, as plain tensors:
    the export writer writes each from its rank (replicas are written once).

    Args:
        native_key: the stacked tensor's name (for errors).
        value: ``[E, rows, ...]`` tensor or ``DTensor``.
        experts: ``expert_hf_keys(native_key)``.

    Returns:
        HF key to tensor, for the experts held here.

    Raises:
        CheckpointError: a ``DTensor`` sharded on another dimension than the experts.
    """
    first = 0
    if isinstance(value, DTensor):
        local_shape, offset = local_shape_and_global_offset(value)
        if tuple(local_shape[1:]) != tuple(value.shape[1:]):
            raise CheckpointError(
                f"{native_key}: expert weights sharded on another dimension than the experts "
                f"(placements {value.placements}) cannot be split into per-expert tensors"
            )
        first, value = offset[0], value.to_local()
    out = {}
    for index in range(value.shape[0]):
        parts = experts[first + index]
        for key, part in zip(parts, value[index].chunk(len(parts), dim=0), strict=True):
            out[key] = part
    return out


_STACKED_EXPERT_KEY = re.compile(
    r"^(?P<layer>.*)\.mlp\.experts\.(?P<weight>gate_up_proj|down_proj)$"
)


class MoEStateDictAdapter(StateDictAdapter):
    """Mixture-of-experts keys: stacked natively, one tensor per expert in the hub's files.

    A native ``model.layers.L.mlp.experts.gate_up_proj`` ``[E, 2I, D]`` is, for each expert
    ``e``, the rows of ``{layer}.{hf_moe_module}.experts.{e}.<gate>.weight`` then of
    ``...<up>.weight``; ``down_proj`` ``[E, D, I]`` is ``...<down>.weight``. Subclasses name the
    module (``hf_moe_module``) and the projections (``hf_expert_projections``).
    """

    hf_moe_module: ClassVar[str] = "mlp"
    """The HF name of the MoE feed-forward module (Mixtral: ``block_sparse_moe``)."""
    hf_expert_projections: ClassVar[dict[str, tuple[str, ...]]] = {
        "gate_up_proj": ("gate_proj", "up_proj"),
        "down_proj": ("down_proj",),
    }
    """Native stacked weight to the HF per-expert modules it concatenates."""

    def _hf_module_path(self, native_prefix: str) -> str:
        return native_prefix.replace(".mlp.", f".{self.hf_moe_module}.")

    def to_hf_key(self, native_key: str) -> str:
        """Rename the MoE module (``mlp`` to ``hf_moe_module``) in an MoE layer's keys."""
        if self.hf_moe_module == "mlp" or ".mlp.gate." not in native_key:
            return native_key
        return self._hf_module_path(native_key)

    def from_hf_key(self, hf_key: str) -> str:
        """Inverse of ``to_hf_key``."""
        return hf_key.replace(f".{self.hf_moe_module}.gate.", ".mlp.gate.")

    def expert_hf_keys(self, native_key: str) -> list[tuple[str, ...]] | None:
        """Per-expert HF keys of a stacked expert weight (see ``StateDictAdapter``)."""
        match = _STACKED_EXPERT_KEY.match(native_key)
        if match is None:
            return None
        prefix = f"{match['layer']}.{self.hf_moe_module}.experts"
        projections = self.hf_expert_projections[match["weight"]]
        return [
            tuple(f"{prefix}.{expert}.{name}.weight" for name in projections)
            for expert in range(self.args.num_experts)
        ]

    def from_hf(self, hf_state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Rename and stack an HF state dict (see ``StateDictAdapter.from_hf``)."""
        expert_keys = re.compile(rf"\.{self.hf_moe_module}\.experts\.(\d+)\.")
        dense = {k: v for k, v in hf_state_dict.items() if not expert_keys.search(k)}
        out = super().from_hf(dense)
        natives = {
            f"{expert_keys.split(key)[0]}.mlp.experts.{weight}"
            for key in hf_state_dict
            if expert_keys.search(key)
            for weight in self.hf_expert_projections
        }
        for native in sorted(natives):
            experts = self.expert_hf_keys(native)
            assert experts is not None
            try:
                out[native] = torch.stack(
                    [torch.cat([hf_state_dict[key] for key in parts]) for parts in experts]
                )
            except KeyError as missing:
                raise CheckpointError(f"missing expert key {missing.args[0]!r}") from None
        return out
