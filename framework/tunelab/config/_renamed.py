"""The old flat keys, mapped to their sections for one release.

A config written before the settings had sections (``batch_size: 8``, ``checkpoint_dir: ...``)
still loads: each old key moves to its new place (``schedule.batch_size``, ``model.path``)
where the config is loaded, YAML keys and ``key=value`` / ``~key`` overrides alike, before
validation. ``tunelab validate`` and ``tunelab run`` say so once per key, in one line
(:func:`rename_notice`). A config giving both an old key and its new one is an error naming
both. Only a key the recipe's settings no longer have at the top level moves, into a section
the recipe has: the eval recipe keeps its own ``batch_size``.

Remove this module (and its two calls in ``_load``) in the release after the one that
introduced the sections.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tunelab.config._args import component_spec
from tunelab.errors import ConfigError

RENAMED: dict[str, str] = {
    "checkpoint_dir": "model.path",
    "dtype": "model.dtype",
    "mixed_precision": "model.mixed_precision",
    "attention_backend": "model.attention_backend",
    "compile": "model.compile",
    "enable_activation_checkpointing": "model.activation_checkpointing",
    "activation_checkpointing_every": "model.activation_checkpointing_every",
    "activation_checkpointing_scope": "model.activation_checkpointing_scope",
    "reshard_after_forward": "model.reshard_after_forward",
    "chunked_output": "model.chunked_output",
    "frozen_base": "model.frozen_base",
    "offload_activations": "model.offload_activations",
    "data_parallel_replicate_size": "parallelism.data_parallel_replicate_size",
    "data_parallel_shard_size": "parallelism.data_parallel_shard_size",
    "context_parallel_size": "parallelism.context_parallel_size",
    "collective_timeout_s": "parallelism.collective_timeout_s",
    "epochs": "schedule.epochs",
    "batch_size": "schedule.batch_size",
    "gradient_accumulation_steps": "schedule.gradient_accumulation_steps",
    "allow_global_batch_change": "schedule.allow_global_batch_change",
    "max_steps_per_epoch": "schedule.max_steps_per_epoch",
    "clip_grad_norm": "schedule.clip_grad_norm",
    "skip_nonfinite_steps": "schedule.skip_nonfinite_steps",
    "log_every_n_steps": "schedule.log_every_n_steps",
    "run_val_every_n_steps": "schedule.run_val_every_n_steps",
    "profile": "profile.enabled",  # only the old bool; a mapping is the new section
    "profile_skip_first": "profile.skip_first",
    "profile_record_steps": "profile.record_steps",
    "router_aux_loss_coef": "router.aux_loss_coef",
    "router_z_loss_coef": "router.z_loss_coef",
    # GRPO
    "num_generations": "rollout.num_generations",
    "max_new_tokens": "rollout.max_new_tokens",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "stop_strings": "rollout.stop_strings",
    "num_iterations": "rollout.num_iterations",
    "dynamic_sampling": "rollout.dynamic_sampling",
    "dynamic_sampling_refill_rounds": "rollout.dynamic_sampling_refill_rounds",
    "rollout_gather_once": "rollout.gather_once",
    "rollout_merge_adapters": "rollout.merge_adapters",
    "rewards": "rewards.functions",  # only the old list; a mapping is the new section
    "reward_weights": "rewards.weights",
    "reward_timeout_s": "rewards.timeout_s",
    "scale_rewards": "rewards.scale",
    # GRPO's loss settings are the arguments of its loss component (tunelab.rl.GRPOLoss).
    "clip_eps_low": "loss.clip_eps_low",
    "clip_eps_high": "loss.clip_eps_high",
    "beta": "loss.beta",
    "loss_aggregation": "loss.aggregation",
}
"""Old flat key -> its new dotted key."""

MOVED_COMPONENTS: dict[str, str] = {
    f"tunelab.training.{name}": f"tunelab.rl.{name}"
    for name in (
        "regex_reward",
        "exact_answer_reward",
        "math_verify_reward",
        "completion_length_reward",
    )
}
"""Old ``_component_`` path -> its new path (the rewards moved to ``tunelab.rl``)."""

_NOTICE = "tunelab: {old} -> {new} (old flat key; it works until the next release)"
_MOVED_NOTICE = "tunelab: {old} -> {new} (moved; the old path works until the next release)"
_INTERPOLATION_RE = re.compile(r"\$\{([A-Za-z_][\w\-]*)((?:\.[\w\-]+)*)\}")


def rename_notice(old: str, new: str) -> str:
    """The one line that says an old flat key (or a moved component) was mapped to its new one."""
    notice = _MOVED_NOTICE if old in MOVED_COMPONENTS else _NOTICE
    return notice.format(old=old, new=new)


def _field_type(cls: type, name: str) -> type | None:
    """The dataclass type of ``cls``'s field ``name`` (None if no such dataclass field)."""
    if not dataclasses.is_dataclass(cls):
        return None
    if name not in {field.name for field in dataclasses.fields(cls)}:
        return None
    hint = typing.get_type_hints(cls).get(name)
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _component_default(cls: type, name: str) -> dict | None:
    """The default node of a component field with a default component (GRPO's ``loss``)."""
    for field in dataclasses.fields(cls):
        if field.name == name and component_spec(field) is not None:
            if field.default_factory is not dataclasses.MISSING:
                return OmegaConf.to_container(field.default_factory())
    return None


def _has_key(cls: type, dotted: str) -> bool:
    """Whether ``cls`` has the dotted key (``schedule.batch_size``) as nested settings."""
    section, _, leaf = dotted.partition(".")
    if _component_default(cls, section) is not None:
        return True  # an argument of a component: its own check names a wrong one
    nested = _field_type(cls, section)
    return nested is not None and leaf in {field.name for field in dataclasses.fields(nested)}


def _top_level(cls: type) -> set[str]:
    return {field.name for field in dataclasses.fields(cls)}


def applies(old: str, args_cls: type | None, value: Any = None, whole: bool = True) -> str | None:
    """The new key an old flat key maps to for this recipe, or None when it stays as it is.

    Args:
        old: The top-level key as written.
        args_cls: The recipe's settings (None: nothing is mapped).
        value: The key's value (``profile`` and ``rewards`` move only as the old bool/list).
        whole: Whether ``value`` is the key's whole value (not an override of a part of it).
    """
    new = RENAMED.get(old)
    if new is None or args_cls is None or not dataclasses.is_dataclass(args_cls):
        return None
    section = new.partition(".")[0]
    if old == section:
        # `profile`/`rewards` name the new section too: only the old bool or list moves.
        old_shape = isinstance(value, bool) if old == "profile" else isinstance(value, list)
        if whole and not old_shape:
            return None
    elif old in _top_level(args_cls):
        return None
    return new if _has_key(args_cls, new) else None


def _rewrite_interpolations(text: str, args_cls: type) -> str:
    """``${checkpoint_dir}`` -> ``${model.path}`` in a string value."""

    def replace(match: re.Match) -> str:
        new = applies(match.group(1), args_cls, whole=False)
        if new is None or match.group(1) in ("profile", "rewards"):
            return match.group(0)
        return "${" + new + match.group(2) + "}"

    return _INTERPOLATION_RE.sub(replace, text)


def _rewrite_values(value: Any, args_cls: type) -> Any:
    """Every string in a plain config tree with its old interpolations renamed."""
    if isinstance(value, str):
        return _rewrite_interpolations(value, args_cls)
    if isinstance(value, list):
        return [_rewrite_values(item, args_cls) for item in value]
    if isinstance(value, dict):
        return {key: _rewrite_values(item, args_cls) for key, item in value.items()}
    return value


def rename_old_keys(
    cfg: DictConfig, args_cls: type | None, source: str
) -> tuple[DictConfig, list[tuple[str, str]]]:
    """Move every old flat key of a loaded YAML config to its section.

    Args:
        cfg: The config as read from its file.
        args_cls: The recipe's settings (None: nothing moves).
        source: The file, for the error message.

    Returns:
        The config (a new one when a key moved) and the ``(old, new)`` pairs that moved, in
        the file's order.

    Raises:
        ConfigError: The config gives an old key and its new key both.
    """
    if args_cls is None or not dataclasses.is_dataclass(args_cls):
        return cfg, []
    tree = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    moved = []
    for old in list(tree):
        new = applies(str(old), args_cls, tree[old])
        if new is None:
            continue
        section, _, leaf = new.partition(".")
        existing = tree.get(section) if section != old else None
        if isinstance(existing, dict) and leaf in existing:
            raise ConfigError(
                f"config {source} gives both '{old}' (the old flat key) and '{new}': keep '{new}'"
            )
        value = tree.pop(old)
        if not isinstance(tree.get(section), dict):
            tree[section] = _component_default(args_cls, section) or {}
        tree[section][leaf] = value
        moved.append((str(old), new))
    moved += _move_components(tree)
    if not moved:
        return cfg, []
    return OmegaConf.create(_rewrite_values(tree, args_cls)), moved


def _move_components(tree: Any) -> list[tuple[str, str]]:
    """Rename every moved ``_component_`` path in a plain config tree, in place."""
    moved = []
    if isinstance(tree, dict):
        path = tree.get("_component_")
        if isinstance(path, str) and path in MOVED_COMPONENTS:
            tree["_component_"] = MOVED_COMPONENTS[path]
            moved.append((path, MOVED_COMPONENTS[path]))
        for value in tree.values():
            moved += _move_components(value)
    elif isinstance(tree, list):
        for value in tree:
            moved += _move_components(value)
    return moved


def rename_override(override: str, args_cls: type | None) -> tuple[str, tuple[str, str] | None]:
    """Map an override of an old flat key (``batch_size=4``, ``~profile``) to its new key.

    Returns:
        The override to apply and the ``(old, new)`` pair when it was mapped (else None).
    """
    if args_cls is None:
        return override, None
    for old_path, new_path in MOVED_COMPONENTS.items():
        if override.endswith(f"=_component_={old_path}") or override.endswith(f"={old_path}"):
            return override.replace(old_path, new_path), (old_path, new_path)
    deleting = override.startswith("~")
    key, sep, text = (override[1:], "", "") if deleting else override.partition("=")
    if not deleting and not sep:
        return override, None  # malformed: apply_overrides names it as written
    head, dot, rest = key.partition(".")
    if head in ("profile", "rewards"):
        # The old bool / list, or a part of the old list (`rewards.0.pattern`).
        if head == "profile" and (dot or deleting or text.strip().lower() not in _BOOL_WORDS):
            return override, None
        if head == "rewards" and not (
            rest[:1].isdigit() or (not dot and not deleting and text.lstrip().startswith("["))
        ):
            return override, None
    new = applies(head, args_cls, whole=False)
    if new is None:
        return override, None
    new_key = new + (dot + rest if dot else "")
    text = _rewrite_interpolations(text, args_cls)
    mapped = f"~{new_key}" if deleting else f"{new_key}{sep}{text}"
    return mapped, (head, new)


_BOOL_WORDS = ("true", "false", "yes", "no", "on", "off")
