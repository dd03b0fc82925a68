"""``LoRAArgs``: the one description of a LoRA adapter, and its PEFT ``adapter_config.json``.

The YAML ``lora:`` section, ``apply_lora``, the checkpoint fingerprint and the PEFT export all
read this record; it converts to and from PEFT's ``adapter_config.json`` right here
(:meth:`LoRAArgs.peft_config`, :meth:`LoRAArgs.from_peft_config`), so the rank is ``rank``
everywhere in tunelab and becomes PEFT's ``"r"`` in one place.

This module must not import torch: ``tunelab validate`` checks configs with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from tunelab._model_files import read_model_text
from tunelab.config.constraints import Finite, NonEmpty, Range
from tunelab.errors import CheckpointError, ConfigError

ALL_LINEAR = "all-linear"
"""``targets: [all-linear]``: every linear layer except ``lm_head``."""
ADAPTER_CONFIG_NAME = "adapter_config.json"
"""PEFT's adapter settings file."""
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
"""The stacked MoE expert weights as ``lora.targets`` names them: PEFT's ``target_parameters``."""

# PEFT options that change what the adapter computes and that tunelab does not implement.
_UNSUPPORTED_OPTIONS = ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")
# The fields an adapter's adapter_config.json decides (quantize_base and dropout are the run's).
_ADAPTER_FIELDS = ("rank", "alpha", "targets", "use_rslora", "use_dora")


@dataclass(kw_only=True)
class LoRAArgs:
    """LoRA adapter settings."""

    rank: Annotated[int, Range(ge=1)] = 8
    """Rank r of the low-rank update B @ A."""
    alpha: Annotated[float, Finite(), Range(gt=0)] = 16.0
    """Scale numerator: the update is scaled by alpha / r (alpha / sqrt(r) with rsLoRA)."""
    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    """Dropout on the adapter's input."""
    targets: Annotated[list[Annotated[str, NonEmpty()]], NonEmpty()] = field(
        default_factory=lambda: ["q_proj", "v_proj"]
    )
    """Linear layers to adapt by name (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj lm_head; Phi-3: qkv_proj gate_up_proj), or ["all-linear"]; MoE expert weights as experts.gate_up_proj experts.down_proj (no dropout, no DoRA)."""
    use_rslora: bool = False
    """Scale by alpha / sqrt(r) (rank-stabilised LoRA) instead of alpha / r."""
    use_dora: bool = False
    """DoRA: learn a magnitude per output feature on top of the low-rank update (weight-decomposed LoRA, as PEFT's use_dora)."""
    quantize_base: Literal["nf4"] | None = None
    """QLoRA: nf4 stores the frozen linear weights (not lm_head, not MoE routers) and stacked MoE expert weights in 4-bit NormalFloat (torchao), quantized shard by shard as they load (None: the training dtype)."""

    # -- PEFT's adapter_config.json ------------------------------------------------------

    def peft_config(
        self, target_names: Sequence[str], base_model_name_or_path: str | None
    ) -> dict[str, Any]:
        """The ``adapter_config.json`` PEFT needs to build this adapter.

        Args:
            target_names: The adapted modules (short names, or the FQNs ``apply_lora``
                returned): ``targets`` resolved against a model.
            base_model_name_or_path: The base model's hub id or folder (may be None).

        Returns:
            A JSON-serialisable dict that ``peft.PeftModel.from_pretrained`` loads as the
            same adapter.
        """
        names = short_target_names(target_names)
        parameters = [name for name in names if name in EXPERT_TARGETS]
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": [name for name in names if name not in parameters],
            "bias": "none",
            "use_rslora": self.use_rslora,
            "use_dora": self.use_dora,
            "fan_in_fan_out": False,
            "inference_mode": True,
            "modules_to_save": None,
            "init_lora_weights": True,
            "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": None,
        }
        if parameters:
            config["target_parameters"] = parameters  # only then: peft < 0.17 has no such key
        return config

    @classmethod
    def from_peft_config(cls, config: Mapping[str, Any], **run_settings: Any) -> LoRAArgs:
        """The record a PEFT ``adapter_config.json`` describes (the inverse of ``peft_config``).

        Args:
            config: The parsed file (``read_adapter_config``).
            **run_settings: Fields the file does not decide (``quantize_base``).

        Raises:
            CheckpointError: The config uses PEFT features tunelab does not implement.
        """
        targets = config["target_modules"]
        if isinstance(targets, str) and targets != ALL_LINEAR:
            raise CheckpointError(
                f"adapter target_modules {targets!r} is a regex; tunelab supports a list of "
                "names or 'all-linear'"
            )
        parameters = config.get("target_parameters") or []
        unknown = [name for name in parameters if not _is_expert_target(name)]
        if unknown:
            raise CheckpointError(
                f"adapter target_parameters {unknown} are not stacked expert weights; tunelab "
                f"adapts {', '.join(EXPERT_TARGETS)}"
            )
        if isinstance(targets, str):
            targets = [targets]
        targets = [*(targets or []), *parameters]
        unsupported = {key: config[key] for key in _UNSUPPORTED_OPTIONS if config.get(key)}
        if config.get("bias", "none") != "none":
            unsupported["bias"] = config["bias"]
        if unsupported:
            raise CheckpointError(
                f"adapter config sets {unsupported}, which tunelab does not support"
            )
        return cls(
            rank=config["r"],
            alpha=config["lora_alpha"],
            dropout=config.get("lora_dropout", 0.0),
            targets=targets,
            use_rslora=bool(config.get("use_rslora", False)),
            use_dora=bool(config.get("use_dora", False)),
            **run_settings,
        )

    def expert_target_problems(self) -> list[str]:
        """What the expert targets (``EXPERT_TARGETS``) cannot have: dropout, DoRA.

        PEFT's ``target_parameters`` implements neither, so such an adapter could not be
        loaded there, and tunelab's expert update has no dropout either.

        Returns:
            One message per conflicting key; empty when no target names an expert weight.
        """
        if not any(_is_expert_target(target) for target in self.targets):
            return []
        experts = " / ".join(EXPERT_TARGETS)
        problems = []
        if self.dropout:
            problems.append(
                f"key 'lora.dropout': {self.dropout!r}, but lora.targets names expert weights "
                f"({experts}), whose adapters have no dropout (as PEFT's target_parameters): "
                "set lora.dropout to 0 or drop the expert targets"
            )
        if self.use_dora:
            problems.append(
                f"key 'lora.use_dora': true, but lora.targets names expert weights ({experts}), "
                "which DoRA does not cover (nor PEFT's target_parameters): set lora.use_dora "
                "to false or drop the expert targets"
            )
        return problems

    # -- what a checkpoint records -------------------------------------------------------

    def fingerprint(self, target_names: Sequence[str]) -> dict[str, Any]:
        """What must match for a step checkpoint of this adapter to resume.

        Dropout may change between runs without invalidating the adapter. DoRA and a
        quantized base change what the adapter computes; recorded only when set, so plain
        LoRA records stay as they were.
        """
        record: dict[str, Any] = {
            "rank": self.rank,
            "alpha": self.alpha,
            "targets": sorted(target_names),
            "use_rslora": self.use_rslora,
        }
        if self.use_dora:
            record["use_dora"] = True
        if self.quantize_base is not None:
            record["quantize_base"] = self.quantize_base
        return record

    # -- starting from an adapter ----------------------------------------------------------

    def reconcile_with_adapter(self, adapter_dir: str | Path) -> list[str]:
        """Take the adapter's settings for fields left at their default; name any conflict.

        Called while settings are validated, before any model is loaded, so a run that
        starts from ``adapter_dir`` has one source of truth for its LoRA layers.

        Args:
            adapter_dir: A PEFT adapter folder.

        Returns:
            Problems (``lora.rank=16 but the adapter ... has r=8``); empty when consistent.
        """
        try:
            adapter = LoRAArgs.from_peft_config(read_adapter_config(adapter_dir))
        except CheckpointError as error:
            return [f"key 'adapter_dir': {error}"]
        defaults = LoRAArgs()
        problems = []
        for name in _ADAPTER_FIELDS:
            mine, theirs = getattr(self, name), getattr(adapter, name)
            if _same(name, mine, theirs):
                continue
            if _same(name, mine, getattr(defaults, name)):
                setattr(self, name, theirs)  # Not set by the user: the adapter decides.
                continue
            peft_name = {"rank": "r", "alpha": "lora_alpha", "targets": "target_modules"}
            problems.append(
                f"key 'lora.{name}': {mine!r}, but the adapter in {adapter_dir} has "
                f"{peft_name.get(name, name)}={theirs!r}: drop lora.{name} or make it equal"
            )
        return problems


def _same(name: str, first: Any, second: Any) -> bool:
    if name == "targets":
        return short_target_names(first) == short_target_names(second)
    return first == second


def short_target_names(targets: Sequence[str]) -> list[str]:
    """Short target names (last FQN components), sorted and unique.

    A stacked expert weight keeps its module's name (``experts.down_proj``, from
    ``model.layers.0.mlp.experts.down_proj``), as ``EXPERT_TARGETS`` spell them.

    Args:
        targets: Short names or FQNs (``["all-linear"]`` stays as it is).

    Raises:
        ConfigError: If ``targets`` is a string or empty.
    """
    if isinstance(targets, str):
        raise ConfigError(
            f"LoRA target names must be the resolved module names (the list apply_lora "
            f"returns), got the string {targets!r}"
        )
    names = sorted({_short_name(target) for target in targets})
    if not names:
        raise ConfigError("LoRA targets is empty")
    return names


def _is_expert_target(name: str) -> bool:
    return any(name == target or name.endswith("." + target) for target in EXPERT_TARGETS)


def _short_name(target: str) -> str:
    # An expert weight keeps its module's name: a bare down_proj is a dense MLP linear.
    if _is_expert_target(target):
        return "experts." + target.rpartition(".")[2]
    return target.rpartition(".")[2]


def read_adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    """Read and check a PEFT LoRA ``adapter_config.json``.

    Raises:
        CheckpointError: If the file is missing or unreadable, or is not a LoRA config.
    """
    path = Path(adapter_dir) / ADAPTER_CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"no {ADAPTER_CONFIG_NAME} in adapter folder {adapter_dir}")
    try:
        config = json.loads(read_model_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from error
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else config
        raise CheckpointError(f"{path}: peft_type must be 'LORA', got {found!r}")
    missing = [key for key in ("r", "lora_alpha", "target_modules") if key not in config]
    if missing:
        raise CheckpointError(f"{path}: missing {', '.join(missing)}")
    return config
