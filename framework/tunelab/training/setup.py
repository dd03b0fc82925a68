"""Model and data set-up shared by the recipes.

A model is built on the meta device, adapted (LoRA), wrapped (activation checkpointing,
compile, FSDP2), materialised shard by shard and filled from the Hugging Face checkpoint:
no rank ever holds the full model unless the world size is 1.
"""

import logging
from collections.abc import Callable
from dataclasses import fields
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset

import tunelab.peft as peft
from tunelab.config.lora import LoRAArgs
from tunelab.config.sections import LoRAModelSetupArgs, ModelSetupArgs, RewardModelSetupArgs
from tunelab.data import StatefulDistributedSampler
from tunelab.data.stream_loader import StreamLoader, StreamPosition
from tunelab.data.streaming import StreamingDataset
from tunelab.distributed import apply_activation_checkpointing, resolve_dtype, shard_model
from tunelab.distributed.expert_parallel import expert_parameters, shard_experts
from tunelab.distributed.frozen_base import choose_frozen_base
from tunelab.distributed.mesh import DeviceMeshes
from tunelab.distributed.tensor_parallel import parallelize_decoder
from tunelab.errors import ConfigError
from tunelab.models import TransformerDecoder, from_hf_config, load_hf_into_model
from tunelab.models.classifier import SCORE_HEAD, SequenceClassifier, init_score_head
from tunelab.modules.attention import resolve_attention_backend
from tunelab.peft.nf4 import copy_rows_nf4_, quantize_base_nf4

logger = logging.getLogger(__name__)

# The parameter dtypes a model section names (``model.dtype``), for ``load_model``.
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
_VISION_PARTS = ("vision_tower", "projector")
"""The model-section keys that say how a vision-language model's parts train."""


def _vision_training(model: ModelSetupArgs, decoder: nn.Module) -> dict[str, str]:
    """How each part of a vision-language model trains: ``{"vision_tower": "frozen", ...}``.

    Empty for a text-only model, which refuses a ``model.vision_tower`` or
    ``model.projector`` other than its section's default in one line.
    """
    defaults = {f.name: f.default for f in fields(model) if f.name in _VISION_PARTS}
    settings = {key: getattr(model, key) for key in defaults}
    if hasattr(decoder, "vision_parts"):
        return settings
    for key, value in settings.items():
        if value != defaults[key]:
            raise ConfigError(
                f"model.{key}: {value!r} needs a vision-language model, and {model.path} "
                "has no vision tower"
            )
    return {}


def build_model(
    model: ModelSetupArgs,
    *,
    device: torch.device,
    meshes: DeviceMeshes | None = None,
    lora: LoRAArgs | None = None,
    adapter_dir: str | None = None,
    seed: int = 0,
) -> nn.Module:
    """Build, shard and load the model a recipe's ``model`` section describes.

    Args:
        model: The ``model`` settings, taken whole: the folder (``path``), ``dtype``,
            ``mixed_precision``, ``attention_backend``, ``compile``, activation checkpointing,
            ``reshard_after_forward`` and, in the LoRA recipes, ``frozen_base``.
        device: Where the parameters live.
        meshes: The run's meshes (``build_device_meshes``): ``data_parallel`` (2-D for
            HSDP, None to shard over every rank); ``tensor``, the tensor-parallel ranks, each
            block's matmuls split over them (``tunelab.distributed.tensor_parallel``);
            ``expert``, the processes each holding only its share of every MoE layer's
            experts, tokens travelling to them (``tunelab.distributed.expert_parallel``).
            None: plain FSDP over every rank. ``DeviceMeshes(None, None, whole=True)``: a
            whole, unsharded copy on every process.
        lora: Adapter settings; only adapter parameters train when given.
        adapter_dir: A PEFT adapter to start from instead of a fresh adapter.
        seed: Seed of the fresh adapter's initialisation.

    Returns:
        The ready model, sharded with FSDP2 when the world size is above 1.
    """
    meshes = meshes if meshes is not None else DeviceMeshes(None, None)
    mesh, tensor_mesh, expert_mesh = meshes.data_parallel, meshes.tensor, meshes.expert
    dtype = resolve_dtype(model.dtype)
    backend = _attention_backend(model.attention_backend, device)
    # The reward-model section builds a sequence classifier: a score head for lm_head.
    classifier = isinstance(model, RewardModelSetupArgs)
    with torch.device("meta"):
        decoder = from_hf_config(
            model.path, SequenceClassifier if classifier else TransformerDecoder
        )
        decoder.attention_backend = backend
        decoder.to(dtype)
        vision = _vision_training(model, decoder)
        if lora is not None:
            if decoder.args.tie_embeddings and "lm_head" in lora.targets:
                # The merged lm_head would differ from the embedding it is tied to, and an
                # export of the tied model has no lm_head.weight to carry the update.
                raise ConfigError(
                    f"lora.targets: lm_head cannot be adapted in {model.path}, whose "
                    "config ties it to the input embeddings (tie_word_embeddings: true)"
                )
            adapted = [
                prefix
                for part, how in vision.items()
                if how == "lora"
                for prefix in decoder.vision_parts[part]
            ]
            for part, how in vision.items():
                linears = [
                    name
                    for name, module in decoder.named_modules()
                    if isinstance(module, nn.Linear) and name.startswith(decoder.vision_parts[part])
                ]
                if how == "lora" and not linears:
                    # Gemma 3's projector is a norm and a bare projection matrix.
                    raise ConfigError(
                        f"model.{part}: lora adapts linear layers, and the {part} of "
                        f"{model.path} has none: use frozen or full"
                    )
            peft.apply_lora(decoder, lora, adapt_under=adapted)
            if classifier:
                # The head is new: it trains whole beside the adapters (PEFT's modules_to_save).
                decoder.score.requires_grad_(True)
        for part, how in vision.items():
            if how in ("frozen", "full"):
                # Full: trained whole, beside the adapters in a LoRA run (their optimizer takes
                # every trainable parameter, and exports carry them as PEFT's modules_to_save).
                for name, param in decoder.named_parameters():
                    if name.startswith(decoder.vision_parts[part]):
                        param.requires_grad_(how == "full")
    quantized = lora is not None and lora.quantize_base == "nf4"
    experts = set()
    if expert_mesh is not None:
        # The tensor-parallel ranks read the same samples: the data-parallel ones are fewer.
        tensor_size = 1 if tensor_mesh is None else tensor_mesh.size()
        experts = shard_experts(
            decoder, expert_mesh, data_parallel_size=expert_mesh.size() // tensor_size
        )
        if mesh is None:
            # FSDP2 shards the rest over every process: the experts' own mesh when they are
            # split over all of them, else its default mesh (the experts' is (replicate, ep)).
            # HSDP keeps its (replicate, shard) mesh.
            mesh = expert_mesh if expert_mesh.ndim == 1 else None
    if tensor_mesh is not None:
        # After the experts are split (attention only, in an MoE model); before QLoRA's
        # quantization: each rank then quantizes its own piece of each weight.
        parallelize_decoder(decoder, tensor_mesh)
    if quantized:
        # Each rank quantizes its own pieces: of split matmuls, of its experts (both under
        # tensor and expert parallelism together).
        _quantize_base_nf4(decoder, device, mesh)
        if expert_mesh is not None:
            experts = expert_parameters(decoder)  # the NF4 ones now
    if isinstance(decoder, TransformerDecoder):
        decoder.trim_last_layer = model.trim_last_layer
    if model.activation_checkpointing:
        apply_activation_checkpointing(
            decoder,
            every=model.activation_checkpointing_every,
            scope=model.activation_checkpointing_scope,
        )
    if model.compile:
        for block in decoder.layers:
            block.compile()
    # Only the LoRA recipes' section has frozen_base; without adapters nothing is frozen.
    frozen_base = model.frozen_base if isinstance(model, LoRAModelSetupArgs) else "shard"
    if not meshes.whole:
        shard_model(
            decoder,
            reshard_after_forward=model.reshard_after_forward,
            mixed_precision=model.mixed_precision,
            mesh=mesh,
            frozen_base=choose_frozen_base(
                frozen_base, decoder, device, mixed_precision=model.mixed_precision
            ),
            ignored_params=experts,
        )
    decoder.to_empty(device=device)
    decoder.tie_weights()
    # QLoRA: each rank quantizes its rows as they load (one small all-gather per weight).
    loaded = load_hf_into_model(
        decoder, model.path, copy_rows=copy_rows_nf4_ if quantized else None
    )
    if classifier and f"{SCORE_HEAD}.weight" in loaded.missing:
        init_score_head(decoder, model.score_init_std, seed)
    if lora is not None:
        torch.manual_seed(seed)
        peft.init_lora_parameters(decoder)
        if adapter_dir is not None:
            peft.load_peft_adapter(decoder, adapter_dir)
    return decoder


def load_model(
    checkpoint_dir: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    lora: LoRAArgs | None = None,
    adapter_dir: str | None = None,
    activation_checkpointing: bool = False,
    activation_checkpointing_every: int = 1,
    activation_checkpointing_scope: Literal["block", "attention"] = "block",
    compile_blocks: bool = False,
    reshard_after_forward: bool = True,
    mixed_precision: bool = False,
    seed: int = 0,
    mesh: DeviceMesh | None = None,
    frozen_base: Literal["auto", "replicate", "shard"] = "shard",
    attention_backend: str = "auto",
) -> nn.Module:
    """Build, shard and load a model from a Hugging Face folder, every option spelled out.

    For scripts, tests and benchmarks that build a model without a config: the options become
    a ``model`` section for :func:`build_model`.

    Args:
        checkpoint_dir: The base model's Hugging Face folder.
        device: Where the parameters live.
        dtype: Parameter dtype.
        lora: Adapter settings; only adapter parameters train when given.
        adapter_dir: A PEFT adapter to start from instead of a fresh adapter.
        activation_checkpointing: Recompute block activations in backward.
        activation_checkpointing_every: With it, checkpoint one block in this many.
        activation_checkpointing_scope: With it, recompute the whole ``block`` or only its
            ``attention`` (``tunelab.distributed.apply_activation_checkpointing``).
        compile_blocks: ``torch.compile`` each transformer block.
        reshard_after_forward: FSDP2's ``reshard_after_forward``.
        mixed_precision: bf16 compute with fp32 reduction under FSDP2.
        seed: Seed of the fresh adapter's initialisation (the same on every rank, so the
            values do not depend on the world size).
        mesh: The data-parallel mesh (``data_parallel_mesh``): 2-D for HSDP, None to shard
            over every rank.
        frozen_base: Keep the frozen base gathered after the first step (``replicate``),
            gather it every forward and backward (``shard``), or pick by memory (``auto``,
            logged); see ``tunelab.distributed.frozen_base``.
        attention_backend: The attention kernel (``auto``, ``sdpa``, ``flex``, ``dense``; see
            ``tunelab.modules.attention``); the resolved choice is printed once.

    Returns:
        The ready model, sharded with FSDP2 when the world size is above 1.
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} is not one the model section allows: {list(_DTYPE_NAMES)}")
    settings = LoRAModelSetupArgs(
        path=str(checkpoint_dir),
        dtype=_DTYPE_NAMES[dtype],
        mixed_precision=mixed_precision,
        attention_backend=attention_backend,
        compile=compile_blocks,
        activation_checkpointing=activation_checkpointing,
        activation_checkpointing_every=activation_checkpointing_every,
        activation_checkpointing_scope=activation_checkpointing_scope,
        reshard_after_forward=reshard_after_forward,
        frozen_base=frozen_base,
    )
    return build_model(
        settings,
        device=device,
        meshes=DeviceMeshes(mesh, None),
        lora=lora,
        adapter_dir=adapter_dir,
        seed=seed,
    )


def _attention_backend(backend: str, device: torch.device) -> str:
    """Resolve ``attention_backend`` for training on ``device``, and say what it picked."""
    resolved = resolve_attention_backend(backend, device)
    if resolved == "flex" and device.type == "cpu":
        raise ConfigError(
            f"attention_backend: flex cannot train on {device} (torch has no FlexAttention "
            "backward on CPU); use sdpa or auto"
        )
    # An INFO record: rank 0 shows it on stderr; stdout stays the recipe's one result line.
    logger.info("attention_backend %s: %s on %s", backend, resolved, device.type)
    return resolved


def _quantize_base_nf4(model: nn.Module, device: torch.device, mesh: DeviceMesh | None) -> None:
    """QLoRA: the frozen linear weights of the meta model become NF4, before sharding."""
    if mesh is not None:
        num_shards = mesh.size(mesh.ndim - 1)
    else:
        num_shards = dist.get_world_size() if dist.is_initialized() else 1
    plan = quantize_base_nf4(model, device=device, world_size=num_shards)
    if plan.kept and (not dist.is_initialized() or dist.get_rank() == 0):
        # Said once per layer name (q_proj, ...), with the first weight's reason.
        reasons = {}
        for name, why in plan.kept.items():
            reasons.setdefault(name.rpartition(".")[2], f"{name}: {why}")
        logger.warning(
            "quantize_base nf4: %d weights in NF4, %d kept in the training dtype (%s)",
            len(plan.quantized),
            len(plan.kept),
            "; ".join(reasons.values()),
        )


def build_dataloader(
    dataset: Dataset,
    *,
    batch_size: int,
    collate_fn: Callable[..., dict[str, torch.Tensor]],
    seed: int,
    shuffle: bool = True,
    ranks_per_sample: int = 1,
    num_workers: int = 0,
    **collate_kwargs: Any,
) -> tuple[DataLoader, StatefulDistributedSampler]:
    """A loader over this rank's share of ``dataset`` and its resumable sampler.

    With context or tensor parallelism the ranks of a group (``ranks_per_sample`` consecutive
    ranks) share the same samples: the sampler's replicas are the data-parallel ranks.

    Args:
        dataset: A map-style dataset.
        batch_size: Samples per micro-batch on this rank.
        collate_fn: Turns a list of samples into a batch of tensors.
        seed: Seed of the per-epoch shuffle.
        shuffle: Shuffle each epoch.
        ranks_per_sample: Consecutive ranks that share each sample (context- and
            tensor-parallel ranks).
        num_workers: Worker processes that collate batches (``collate_fn`` reads a batch's
            images there); 0: in this process. The sampler stays in this process and the
            loader returns batches in its order, so the batches do not depend on it, and the
            position the checkpoint saves is the sampler's (moved by ``advance``), not what
            the workers fetched ahead.
        **collate_kwargs: Passed to ``collate_fn`` (e.g. ``pad_id``).

    Returns:
        The loader and its sampler (whose position the checkpoint saves).
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    sampler = StatefulDistributedSampler(
        len(dataset),
        num_replicas=world_size // ranks_per_sample,
        rank=rank // ranks_per_sample,
        shuffle=shuffle,
        seed=seed,
    )
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=partial(collate_fn, **collate_kwargs),
        drop_last=True,
        # Its own generator: creating an iterator draws a seed from it, and from the global
        # RNG without one, which would shift dropout after a resume restored the RNG state.
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers,
        # Workers are forked per epoch; one per epoch keeps the main process's pages shared.
        persistent_workers=False,
    )
    return loader, sampler


def build_stream_loader(
    dataset: StreamingDataset,
    *,
    batch_size: int,
    collate_fn: Callable[..., dict[str, torch.Tensor]],
    seed: int,
    ranks_per_sample: int = 1,
    **collate_kwargs: Any,
) -> tuple[StreamLoader, StreamPosition]:
    """This rank's share of a stream's global batches and their resumable position.

    As in :func:`build_dataloader`, the ranks of a cp or tp group share their items: the stream's
    replicas are the data-parallel ranks.

    Args:
        dataset: A ``StreamingDataset``.
        batch_size: Items per micro-batch on this rank.
        collate_fn: Turns a list of items into a batch of tensors.
        seed: Seed of the shuffle windows.
        ranks_per_sample: Consecutive ranks that share each sample (context- and
            tensor-parallel ranks).
        **collate_kwargs: Passed to ``collate_fn`` (e.g. ``pad_id``).

    Returns:
        The loader and its position (which the checkpoint saves).
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    replicas, rank = world_size // ranks_per_sample, rank // ranks_per_sample
    position = StreamPosition(num_sources=len(dataset.sources), num_replicas=replicas, seed=seed)
    loader = StreamLoader(
        dataset,
        position,
        batch_size=batch_size,
        collate_fn=partial(collate_fn, **collate_kwargs),
        rank=rank,
    )
    return loader, position


def config_fingerprint(args: Any) -> str:
    """A short hash of a recipe's resolved settings, recorded in checkpoint manifests."""
    import dataclasses
    import hashlib
    import json

    from omegaconf import DictConfig, OmegaConf

    def plain(value: Any) -> Any:
        if isinstance(value, DictConfig):
            return OmegaConf.to_container(value, resolve=True)
        if isinstance(value, list):
            return [plain(item) for item in value]
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return value

    text = json.dumps(plain(args), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
