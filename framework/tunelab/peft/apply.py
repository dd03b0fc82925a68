"""Apply LoRA to any model as one generic module swap, and switch adapters on and off.

Targets are the last component of a module's name (``q_proj``, ``down_proj``, ``lm_head``),
the names users know from Hugging Face, so one function serves every family and size. A
mixture-of-experts model's stacked expert weights are targets too (``experts.gate_up_proj``,
``experts.down_proj``): they get an ``ExpertLoRA`` instead of a module swap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn
from torch.distributed.tensor import DTensor

from tunelab.config.lora import ALL_LINEAR, LoRAArgs
from tunelab.distributed._fqn import clean_fqn
from tunelab.errors import ConfigError, TunelabError
from tunelab.modules.moe import MoEExperts, MoERouter
from tunelab.peft._names import MAGNITUDE
from tunelab.peft.expert_lora import EXPERT_PROJECTIONS, ExpertLoRA
from tunelab.peft.lora import LoRALinear, validate_lora_options

LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "lm_head",
)
"""The target names of the decoder families tunelab ships."""

# The output layers: a causal LM's lm_head, a sequence classifier's score head.
_OUTPUT_LAYERS = ("lm_head", "score")
_ADAPTER_CHILDREN = ("lora_A", "lora_B")


def _linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` by FQN, leaving out the adapters' own ``lora_A``/``lora_B``."""
    lora_prefixes = [f"{name}." for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not any(name.startswith(p) for p in lora_prefixes)
    }


def _expert_weights(model: nn.Module) -> dict[str, MoEExperts]:
    """Every stacked expert weight LoRA can target, ``<experts>.gate_up_proj``, by FQN."""
    return {
        f"{name}.{projection}": module
        for name, module in model.named_modules()
        if isinstance(module, MoEExperts)
        for projection in EXPERT_PROJECTIONS
    }


def _select_expert_targets(
    weights: dict[str, MoEExperts], targets: Sequence[str] | str
) -> tuple[list[str], list[str]]:
    """Split ``targets`` into the expert weights they name and the remaining targets.

    An expert weight is named with at least its module's name (``experts.down_proj``), so a
    bare ``down_proj`` keeps meaning dense MLP linears.
    """
    if isinstance(targets, str) or list(targets) == [ALL_LINEAR]:
        return [], [targets] if isinstance(targets, str) else list(targets)
    expert_targets = [t for t in targets if "." in t and any(_matches(w, t) for w in weights)]
    others = [t for t in targets if t not in expert_targets]
    selected = [w for w in weights if any(_matches(w, t) for t in expert_targets)]
    return selected, others


def _select_targets(
    linears: dict[str, nn.Linear],
    targets: Sequence[str] | str,
    has_experts: bool = False,
    paths: dict[str, str] | None = None,
) -> list[str]:
    # `paths`: a module's path in transformers' model, which a target may name instead.
    paths = paths or {}

    def matches(name: str, target: str) -> bool:
        return _matches(name, target) or (name in paths and _matches(paths[name], target))

    if not isinstance(targets, str) and list(targets) == [ALL_LINEAR]:
        targets = ALL_LINEAR  # the config form, `targets: [all-linear]`
    if isinstance(targets, str) and targets == ALL_LINEAR:
        # Not the output layer, nor an MoE router (it stays frozen unless named: `gate`).
        selected = [
            name
            for name, linear in linears.items()
            if name.rpartition(".")[2] not in _OUTPUT_LAYERS and not isinstance(linear, MoERouter)
        ]
        if not selected:
            raise TunelabError(f"lora targets {ALL_LINEAR!r}: the model has no nn.Linear to adapt")
        return selected
    wanted = [targets] if isinstance(targets, str) else list(targets)
    if not wanted:
        raise TunelabError("lora targets is empty: name at least one module, or 'all-linear'")
    short_names = sorted({name.rpartition(".")[2] for name in linears})
    for target in wanted:
        if not any(matches(name, target) for name in linears):
            raise TunelabError(
                f"lora target {target!r} matches no nn.Linear in the model; "
                f"available linear names: {', '.join(short_names) or '(none)'}"
                + (
                    f" (stacked expert weights: experts.{' / experts.'.join(EXPERT_PROJECTIONS)})"
                    if has_experts
                    else ""
                )
            )
    return [name for name in linears if any(matches(name, target) for target in wanted)]


def _matches(fqn: str, target: str) -> bool:
    # PEFT's rule for a list of names: the whole FQN, or a suffix at a name boundary.
    return fqn == target or fqn.endswith("." + target)


def apply_lora(model: nn.Module, lora: LoRAArgs, adapt_under: Sequence[str] = ()) -> list[str]:
    """Put LoRA on the targets: ``LoRALinear`` swaps and ``ExpertLoRA`` factors.

    Each targeted ``nn.Linear`` becomes a ``LoRALinear`` over the same parameters; each
    targeted stacked expert weight gets an ``ExpertLoRA`` in its experts' ``lora``. Call it
    before ``fully_shard`` (the swap needs plain parameters). The model may live on the meta
    device; then call ``init_lora_parameters`` after ``to_empty``. Afterwards only the adapter
    parameters require grad.

    Args:
        model: Any module with ``nn.Linear`` children.
        lora: The adapter settings. ``lora.targets`` names what to adapt: a module matches a
            target equal to its FQN or to a dot-separated suffix of it, as in PEFT (e.g.
            ``["q_proj", "v_proj"]`` or ``"self_attn.q_proj"``); or ``["all-linear"]`` for
            every linear layer except ``lm_head``. Stacked MoE expert weights are targeted as
            ``experts.gate_up_proj`` / ``experts.down_proj`` (any suffix of their FQN with at
            least two components; ``all-linear`` leaves them out). ``quantize_base`` is
            not applied here (``tunelab.training.build_model`` quantizes the base).
        adapt_under: Module prefixes (``visual.blocks.``) whose every ``nn.Linear`` is
            adapted as well, whatever ``lora.targets`` says: a vision-language model's tower
            or projector under ``model.vision_tower: lora`` / ``model.projector: lora``.

    Returns:
        The FQNs of the swapped modules and adapted expert weights, in module order.

    Raises:
        ConfigError: If ``rank``, ``alpha`` or ``dropout`` is out of range, or expert weights
            are targeted with dropout or DoRA.
        TunelabError: If a target matches no linear layer (the message lists the available
            names), if LoRA was already applied, or if the model is already sharded.
    """
    validate_lora_options(lora.rank, lora.alpha, lora.dropout)
    if any(isinstance(m, LoRALinear | ExpertLoRA) for m in model.modules()):
        raise TunelabError("apply_lora: the model already has LoRA layers; apply it once")
    expert_weights = _expert_weights(model)
    selected_experts, other_targets = _select_expert_targets(expert_weights, lora.targets)
    problems = lora.expert_target_problems()
    if selected_experts and problems:
        raise ConfigError(problems[0])
    all_linears = linears = _linear_modules(model)
    # A vision-language model's vision tower and projector (``visual.``) stay frozen unless a
    # target names them by their path there (``visual.merger.mlp.0``): bare names and
    # ``all-linear`` adapt the language model.
    tower = getattr(model, "vision_prefix", None)
    paths = {}
    if tower:
        # Targets may name transformers' paths (an exported adapter's Gemma 3 targets).
        paths = {name: model.peft_module_path(name) for name in linears}
        named = [t for t in other_targets if isinstance(t, str) and t.startswith(tower)]
        linears = {
            name: linear
            for name, linear in linears.items()
            if not name.startswith(tower)
            or any(_matches(name, t) or _matches(paths[name], t) for t in named)
        }
    selected = (
        _select_targets(linears, other_targets, bool(expert_weights), paths)
        if other_targets or not selected_experts
        else []
    )
    whole_parts = [
        name
        for name in all_linears
        if any(name.startswith(prefix) for prefix in adapt_under) and name not in selected
    ]
    selected += whole_parts
    for fqn in selected_experts:
        _add_expert_lora(fqn, expert_weights[fqn], lora)
    for fqn in selected:
        linear = all_linears[fqn]
        if isinstance(linear.weight, DTensor):
            raise TunelabError(
                f"apply_lora: {fqn}.weight is already sharded; apply LoRA before fully_shard"
            )
        parent_name, _, child_name = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        swapped = LoRALinear.from_linear(
            linear,
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=lora.dropout,
            use_rslora=lora.use_rslora,
            use_dora=lora.use_dora,
        )
        setattr(parent, child_name, swapped)
    set_trainable_params(model)
    # Module order: a linear's place is its weight's, an expert weight's its own.
    order = {name: i for i, (name, _) in enumerate(model.named_parameters(remove_duplicate=False))}
    return sorted(
        selected_experts + selected, key=lambda fqn: order.get(fqn, order.get(f"{fqn}.weight"))
    )


def _add_expert_lora(fqn: str, experts: MoEExperts, lora: LoRAArgs) -> None:
    projection = fqn.rpartition(".")[2]
    weight = getattr(experts, projection)
    if isinstance(weight, DTensor):
        raise TunelabError(f"apply_lora: {fqn} is already sharded; apply LoRA before fully_shard")
    num_experts, first, second = weight.shape
    in_dim, out_dim = (first, second) if experts.transposed else (second, first)
    experts.lora[projection] = ExpertLoRA(
        num_experts,
        in_dim,
        out_dim,
        rank=lora.rank,
        alpha=lora.alpha,
        use_rslora=lora.use_rslora,
        transposed=experts.transposed,
        device=weight.device,
        dtype=weight.dtype,
    )


def lora_modules(model: nn.Module) -> dict[str, LoRALinear | ExpertLoRA]:
    """Every ``LoRALinear`` and ``ExpertLoRA`` of ``model`` by FQN.

    Args:
        model: A model, with or without LoRA.

    Returns:
        The LoRA layers in module order (empty if there are none). An ``ExpertLoRA``'s FQN
        is ``<experts>.lora.<projection>``; ``expert_weight_fqn`` names the weight it adapts.
    """
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear | ExpertLoRA)}


def expert_weight_fqn(lora_fqn: str) -> str:
    """The stacked weight an ``ExpertLoRA`` adapts.

    ``<experts>.lora.down_proj`` -> ``<experts>.down_proj``.
    """
    experts, _, projection = lora_fqn.rpartition(".")
    return f"{experts.removesuffix('.lora')}.{projection}"


def lora_target_names(model: nn.Module) -> list[str]:
    """The short names of the adapted modules, as ``adapter_config.json`` lists them.

    Args:
        model: A LoRA-applied model.

    Returns:
        Sorted unique last name components, e.g. ``["q_proj", "v_proj"]``; an adapted
        stacked expert weight as ``experts.<projection>`` (``experts.down_proj``).

    Raises:
        TunelabError: If the model has no LoRA layers.
    """
    modules = _require_lora(model, "lora_target_names")
    return sorted(
        {
            f"experts.{name.rpartition('.')[2]}"
            if isinstance(module, ExpertLoRA)
            else name.rpartition(".")[2]
            for name, module in modules.items()
        }
    )


def peft_target_modules(model: nn.Module) -> list[str]:
    """``adapter_config.json``'s ``target_modules`` for a LoRA-applied model.

    ``lora_target_names``, except for a vision-language model (one with a ``vision_prefix``):
    PEFT adapts every module a short name matches, the vision tower's like-named linears too
    (``visual.blocks.0.mlp.gate_proj``), so there each adapted module is named by a path
    suffix that matches it both here and in transformers' model, where the language model
    sits under ``model.language_model``: ``layers.0.self_attn.q_proj``,
    ``visual.merger.mlp.0``, ``lm_head`` (the model's ``peft_target_name``; Gemma 3's
    ``language_model.layers.0.self_attn.q_proj``, since its SigLIP blocks end the same way).
    Reading them back, ``apply_lora`` matches a target against both paths.

    Args:
        model: A LoRA-applied model.

    Returns:
        The names, sorted.
    """
    tower = getattr(model, "vision_prefix", None)
    if not tower:
        return lora_target_names(model)
    modules = _require_lora(model, "peft_target_modules")
    return sorted(model.peft_target_name(clean_fqn(name)) for name in modules)


def _require_lora(model: nn.Module, caller: str) -> dict[str, LoRALinear | ExpertLoRA]:
    modules = lora_modules(model)
    if not modules:
        raise TunelabError(f"{caller}: the model has no LoRA layers; call apply_lora first")
    return modules


def get_adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter parameters (``lora_A``/``lora_B`` weights, DoRA magnitudes) by FQN.

    Args:
        model: A LoRA-applied model.

    Returns:
        ``{"<module>.lora_A.weight": param, "<module>.lora_B.weight": param, ...}``, plus
        ``"<module>.lora_magnitude_vector"`` for DoRA layers.

    Raises:
        TunelabError: If the model has no LoRA layers.
    """
    params = {}
    for fqn, module in _require_lora(model, "get_adapter_params").items():
        for child in _ADAPTER_CHILDREN:
            params[clean_fqn(f"{fqn}.{child}.weight")] = getattr(module, child).weight
        if module.lora_magnitude_vector is not None:
            params[clean_fqn(f"{fqn}.{MAGNITUDE}")] = module.lora_magnitude_vector
    return params


def set_trainable_params(model: nn.Module) -> None:
    """Make the adapter parameters the only trainable ones.

    Args:
        model: A LoRA-applied model.

    Raises:
        TunelabError: If the model has no LoRA layers.
    """
    adapter = get_adapter_params(model)
    adapter_ids = {id(p) for p in adapter.values()}
    for param in model.parameters():
        param.requires_grad_(id(param) in adapter_ids)


def init_lora_parameters(model: nn.Module) -> None:
    """Initialise every adapter (``A`` Kaiming-uniform, ``B`` zero).

    The recipe calls this after ``model.to_empty(...)`` on a meta-built model, sharded or
    not; with the same seed on every rank the values match a one-process run.

    Args:
        model: A LoRA-applied model with materialised parameters.

    Raises:
        TunelabError: If the model has no LoRA layers.
    """
    for module in _require_lora(model, "init_lora_parameters").values():
        module.reset_lora_parameters()


@contextlib.contextmanager
def disable_adapter(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` as its base model inside the ``with`` block.

    Sets a flag on each ``LoRALinear`` instead of touching parameters, so it works under
    FSDP2 (no parameter is swapped, resharded or copied). DPO uses it for the reference
    forward. The previous flags come back on exit, also when the block raises.

    Args:
        model: A LoRA-applied model.

    Yields:
        The same model.

    Raises:
        TunelabError: If the model has no LoRA layers.
    """
    modules = list(_require_lora(model, "disable_adapter").values())
    previous = [m.disabled for m in modules]
    for module in modules:
        module.disabled = True
    try:
        yield model
    finally:
        for module, was_disabled in zip(modules, previous, strict=True):
            module.disabled = was_disabled
