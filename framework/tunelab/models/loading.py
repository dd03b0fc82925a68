"""Models from Hugging Face checkpoints: built from the config, filled from the weights.

A rank fills its sharded parameters with only its own rows, read straight from the files.
"""

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tunelab._torch_compat import local_shape_and_global_offset
from tunelab.distributed._fqn import clean_fqn
from tunelab.errors import CheckpointError
from tunelab.formats.hf import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, HFCheckpointReader
from tunelab.formats.mxfp4 import dequantize_mxfp4
from tunelab.models.args import ModelArgs
from tunelab.models.decoder import TransformerDecoder
from tunelab.models.families import args_from_hf, read_hf_config
from tunelab.models.vision_language import VisionLanguageDecoder
from tunelab.models.vision_language_gemma3 import Gemma3VisionLanguageDecoder

# The config.json keys that set tensor dimensions, for naming the one that disagrees.
_DIMENSION_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def from_hf_config(
    checkpoint_dir_or_config: str | os.PathLike | Mapping[str, Any],
    model_class: type[TransformerDecoder] = TransformerDecoder,
) -> TransformerDecoder:
    """Build the model a Hugging Face ``config.json`` describes (weights not loaded).

    Parameters are created on the current default device; build under
    ``torch.device("meta")`` to allocate nothing.

    Args:
        checkpoint_dir_or_config: a checkpoint directory, its ``config.json``, or the dict.
        model_class: The model to build from the parsed arguments (a causal LM, or
            ``tunelab.models.classifier.SequenceClassifier`` for a reward model).

    Returns:
        The model, randomly initialised (or on meta).

    Raises:
        CheckpointError: no readable ``config.json``, or its dimensions do not match the shapes
            of the weights beside it (checked before any parameter is allocated).
        ConfigError: an unsupported family or feature.
    """
    config = read_hf_config(checkpoint_dir_or_config)
    folder = None
    if not isinstance(checkpoint_dir_or_config, Mapping):
        folder = Path(checkpoint_dir_or_config)
        folder = folder if folder.is_dir() else folder.parent
    for name in (*_DIMENSION_KEYS, "num_hidden_layers"):
        value = config.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            source = "config" if folder is None else folder / "config.json"
            raise CheckpointError(f"{source}: {name} {value!r} is not a positive integer")
    args = args_from_hf(config)
    if folder is not None:
        check_dimensions(args, folder)
    if args.vision is not None and model_class is TransformerDecoder:
        gemma = args.vision.layout == "gemma3"
        model_class = Gemma3VisionLanguageDecoder if gemma else VisionLanguageDecoder
    return model_class(args)


def check_dimensions(args: ModelArgs, checkpoint_dir: Path) -> None:
    """Check the tensor shapes ``config.json`` implies against the weights' headers.

    A ``config.json`` is data: an ``intermediate_size`` of 1e10 would have the model allocate
    hundreds of gigabytes before a weight is read. The model is built on the meta device
    (nothing allocated) and each of its tensors compared with the safetensors header of the
    same name, so a config that disagrees with its weights is one error naming the key.

    Args:
        args: The model's settings, from ``config.json``.
        checkpoint_dir: The folder of ``config.json``; nothing is checked when it holds no
            weights (a config-only folder).

    Raises:
        CheckpointError: A tensor's shape, or the number of layers, differs from the weights.
    """
    if not any(
        (checkpoint_dir / name).is_file() for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)
    ):
        return
    config_file = checkpoint_dir / "config.json"
    with HFCheckpointReader(checkpoint_dir) as reader:
        layers = [int(m.group(1)) for key in reader.keys() if (m := _LAYER_INDEX.search(key))]
        if layers and args.num_layers > max(layers) + 1:
            raise CheckpointError(
                f"{config_file}: num_hidden_layers {args.num_layers} does not match the weights, "
                f"which hold {max(layers) + 1} layers"
            )
        with torch.device("meta"):
            model = TransformerDecoder(args)
        expected = model.state_dict_adapter.to_hf(model.state_dict())
        for key, tensor in expected.items():
            if key not in reader or tuple(reader.shape(key)) == tuple(tensor.shape):
                continue
            actual, wanted = tuple(reader.shape(key)), tuple(tensor.shape)
            config = read_hf_config(checkpoint_dir)
            culprits = [
                f"{name} {config[name]!r}"
                for name in _DIMENSION_KEYS
                if isinstance(config.get(name), int | float)
                and config[name] in wanted
                and config[name] not in actual
            ]
            which = " and ".join(culprits) if culprits else "its dimensions"
            verb = "does" if len(culprits) == 1 else "do"
            raise CheckpointError(
                f"{reader.file_of(key)}: {key!r} has shape {actual} but the config gives "
                f"{wanted}: {which} in {config_file} {verb} not match the weights"
            )


@dataclass
class LoadResult:
    """What ``load_hf_into_model`` did not fill."""

    missing: list[str] = field(default_factory=list)
    """Model parameters absent from the checkpoint (only LoRA parameters are allowed)."""


def _local_slices(param: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The local tensor to fill and its ``(offset, length)`` in each global dimension."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        local_shape, offset = local_shape_and_global_offset(param)
        return param.to_local(), list(zip(offset, local_shape))
    return param, [(0, size) for size in param.shape]


def _expert_slices(
    param: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, list[tuple[int, int]], tuple[int, ...]]:
    """``_local_slices`` of a stacked expert weight in its ``[E, rows, cols]`` terms.

    QLoRA packs one 2-D, ``[E * rows, cols]`` (``tunelab.peft.nf4``), sharded in whole
    experts; a plain one is 3-D already. Also returns the ``[E, rows, cols]`` shape.
    """
    local, spans = _local_slices(param)
    if param.dim() == 3:
        return local, spans, tuple(param.shape)
    rows = param.shape[0] // num_experts
    (start, length), columns = spans
    assert start % rows == 0 and length % rows == 0, "a packed shard holds whole experts"
    spans = [(start // rows, length // rows), (0, rows), columns]
    return local, spans, (num_experts, rows, param.shape[1])


def _fill(
    param: torch.Tensor,
    local: torch.Tensor,
    rows: torch.Tensor,
    copy_rows: Callable[[torch.Tensor, torch.Tensor], None] | None,
) -> None:
    """Copy this rank's ``rows`` into ``param`` (``copy_rows`` when given)."""
    if copy_rows is None:
        local.copy_(rows.reshape(local.shape))
    else:
        copy_rows(param, rows)


def _read_local(reader: HFCheckpointReader, key: str, spans: list[tuple[int, int]]) -> torch.Tensor:
    if not spans:  # a scalar
        return reader.get(key)
    start, length = spans[0]
    # Only dimension 0 is read partially from disk (FSDP's Shard(0) is a contiguous byte range);
    # other sharded dimensions are cut after reading those rows.
    tensor = reader.get_rows(key, start, start + length)
    for dim, (offset, size) in enumerate(spans[1:], start=1):
        tensor = tensor.narrow(dim, offset, size)
    return tensor


_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _checked(reader: HFCheckpointReader, key: str, values: torch.Tensor) -> torch.Tensor:
    """``values`` (this rank's rows of ``key``), refused if they cannot be trained on.

    A base model whose weights hold NaN or infinity would train and export NaNs silently,
    and integer weights (a quantised or corrupt file) would be cast silently.
    """
    if values.dtype not in _WEIGHT_DTYPES:
        raise CheckpointError(
            f"{reader.file_of(key)}: {key!r} is {str(values.dtype).removeprefix('torch.')}; "
            "tunelab loads floating-point weights (float32, bfloat16, float16)"
        )
    if not torch.isfinite(values).all():
        bad = int((~torch.isfinite(values)).sum())
        raise CheckpointError(
            f"{reader.file_of(key)}: {key!r} holds {bad} NaN or infinite values; the base "
            "model is corrupt"
        )
    return values


@torch.no_grad()
def load_hf_into_model(
    model: TransformerDecoder,
    checkpoint_dir: str | os.PathLike,
    *,
    strict: bool = True,
    copy_rows: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> LoadResult:
    """Copy HF checkpoint tensors into a materialised model, in place.

    Works on plain parameters (the full tensor is copied) and on FSDP2-sharded ``DTensor``
    parameters (each rank reads only its own rows from disk). Keys go through
    ``model.state_dict_adapter``; a tied ``lm_head.weight`` in the file is accepted only if it
    equals the embedding.

    Args:
        model: a model whose parameters are allocated (not meta), e.g. after ``to_empty``.
        checkpoint_dir: the HF checkpoint directory.
        strict: raise on checkpoint keys the model does not have.
        copy_rows: ``copy_rows(param, rows)`` fills a parameter with this rank's rows
            instead of a plain copy (QLoRA quantizes them: ``tunelab.peft.nf4.copy_rows_nf4_``);
            called on every rank for the same parameters in the same order.

    Returns:
        A ``LoadResult``; ``missing`` lists LoRA parameters (names containing ``lora_``),
        which a base checkpoint does not have, and a classifier head (``score.weight``, see
        ``tunelab.models.classifier``) the file lacks: those are for the caller to initialise.

    Raises:
        CheckpointError: a missing or unexpected key, a shape that differs from the model, a
            weight that is not floating point, or one holding NaN or infinity.
    """
    reader = HFCheckpointReader(checkpoint_dir)
    adapter = model.state_dict_adapter.for_file_keys(reader.keys())
    tied = adapter.tied_hf_keys()
    result = LoadResult()
    params: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        native = clean_fqn(name)
        if "lora_" in native:
            result.missing.append(name)
        else:
            params[native] = tensor
    if any(adapter.expert_hf_keys(native) and native in reader for native in params):
        # Stacked experts under their native names: transformers 5's in-memory layout.
        adapter = adapter.stacked_layout_adapter()
    expected: dict[str, torch.Tensor] = {}
    stacked: dict[str, tuple[torch.Tensor, list[tuple[str, ...]]]] = {}
    for native, tensor in params.items():
        experts = adapter.expert_hf_keys(native)
        if experts is not None:
            stacked[native] = (tensor, experts)
            continue
        hf_key = adapter.to_hf_key(native)
        if hf_key not in tied:
            expected[hf_key] = tensor
    expert_keys = [key for _, experts in stacked.values() for parts in experts for key in parts]
    # gpt-oss hub files hold expert weights as MXFP4 blocks and scales instead.
    packed = {
        key: forms
        for key in expected
        if key not in reader
        and (forms := adapter.mxfp4_hf_keys(key)) is not None
        and all(form in reader for form in forms)
    }
    packed_keys = [form for forms in packed.values() for form in forms]
    # A head the model adds to its base (a reward model's score, from a causal LM) starts
    # fresh: the file may lack it, and may hold the causal LM's lm_head it replaces.
    for key in getattr(model, "modules_to_save", ()):
        if f"{key}.weight" not in reader:
            result.missing.append(f"{key}.weight")
            expected.pop(f"{key}.weight", None)
    replaced = {"lm_head.weight"} if getattr(model, "modules_to_save", ()) else set()
    missing = [key for key in [*expected, *expert_keys] if key not in reader and key not in packed]
    if missing:
        raise CheckpointError(
            f"{checkpoint_dir}: missing key {missing[0]!r} (the config expects it)"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    known = {*expected, *expert_keys, *packed_keys, *tied, *replaced}
    unexpected = [key for key in reader.keys() if key not in known]
    if strict and unexpected:
        raise CheckpointError(
            f"{reader.file_of(unexpected[0])}: unexpected key {unexpected[0]!r} (not in the model)"
        )
    for key, param in expected.items():
        if key in packed:
            _load_mxfp4(reader, key, param, *packed[key], copy_rows)
            continue
        file_shape = tuple(reader.shape(key))
        if param.dim() == 2 and len(file_shape) == 3:  # packed experts (QLoRA), stacked file
            local, spans, shape = _expert_slices(param, file_shape[0])
        else:
            (local, spans), shape = _local_slices(param), tuple(param.shape)
        if shape != file_shape:
            raise CheckpointError(
                f"{reader.file_of(key)}: {key!r} has shape {file_shape} but the config "
                f"gives {shape}"
            )
        if local.numel():
            _fill(param, local, _checked(reader, key, _read_local(reader, key, spans)), copy_rows)
    for native, (param, experts) in stacked.items():
        _load_stacked_experts(reader, native, param, experts, copy_rows)
    for key, partner in tied.items():
        if key in reader:
            local, spans = _local_slices(expected[partner])
            if not torch.equal(_read_local(reader, key, spans).to(local.dtype), local):
                raise CheckpointError(
                    f"{reader.file_of(key)}: {key!r} differs from {partner!r}, but the config "
                    "ties word embeddings"
                )
    reader.close()
    return result


def _load_stacked_experts(
    reader: HFCheckpointReader,
    native: str,
    param: torch.Tensor,
    experts: list[tuple[str, ...]],
    copy_rows: Callable[[torch.Tensor, torch.Tensor], None] | None,
) -> None:
    """Fill a stacked expert weight ``[E, ...]`` from one tensor per expert and projection.

    Each rank reads only the experts of its rows (FSDP2 shards the experts dimension).
    """
    local, spans, shape = _expert_slices(param, len(experts))
    for parts in experts:
        for key in parts:
            wanted = (shape[1] // len(parts), *shape[2:])
            if tuple(reader.shape(key)) != wanted:
                raise CheckpointError(
                    f"{reader.file_of(key)}: {key!r} has shape {reader.shape(key)} but the "
                    f"config gives {wanted} (one expert's part of {native})"
                )
    if not local.numel():
        return
    start, length = spans[0]
    rows = torch.stack(
        [
            torch.cat([_checked(reader, key, reader.get(key)) for key in experts[index]])
            for index in range(start, start + length)
        ]
    )
    for dim, (offset, size) in enumerate(spans[1:], start=1):
        rows = rows.narrow(dim, offset, size)
    _fill(param, local, rows, copy_rows)


def _load_mxfp4(
    reader: HFCheckpointReader,
    key: str,
    param: torch.Tensor,
    blocks_key: str,
    scales_key: str,
    copy_rows: Callable[[torch.Tensor, torch.Tensor], None] | None,
) -> None:
    """Fill ``param`` ``[E, in, out]`` from its MXFP4 blocks and scales (``[E, out, ...]``).

    Each rank reads and dequantizes only the experts of its rows (dimension 0).
    """
    local, spans, (experts, inputs, outputs) = _expert_slices(param, reader.shape(blocks_key)[0])
    wanted = {
        blocks_key: (experts, outputs, inputs // 32, 16),
        scales_key: (experts, outputs, inputs // 32),
    }
    for name, shape in wanted.items():
        if inputs % 32 or tuple(reader.shape(name)) != shape:
            raise CheckpointError(
                f"{reader.file_of(name)}: {name!r} has shape {tuple(reader.shape(name))} but the "
                f"config gives {key} {(experts, inputs, outputs)}, whose MXFP4 form is {shape}"
            )
    if not local.numel():
        return
    start, length = spans[0]
    rows = dequantize_mxfp4(
        reader.get_rows(blocks_key, start, start + length),
        reader.get_rows(scales_key, start, start + length),
        dtype=local.dtype,
    ).transpose(1, 2)
    rows = _checked(reader, blocks_key, rows)
    for dim, (offset, size) in enumerate(spans[1:], start=1):
        rows = rows.narrow(dim, offset, size)
    _fill(param, local, rows.contiguous(), copy_rows)


def load_pretrained(
    checkpoint_dir: str | os.PathLike,
    dtype: torch.dtype | str | None = torch.float32,
    device: torch.device | str = "cpu",
) -> TransformerDecoder:
    """Build the model of an HF checkpoint and load its weights, ready for ``eval``.

    The model is built on the meta device, allocated once on ``device`` in ``dtype`` and filled
    tensor by tensor, so peak memory is about one model.

    Args:
        checkpoint_dir: a directory with ``config.json`` and safetensors weights.
        dtype: parameter dtype; None uses the config's ``torch_dtype`` (or ``dtype``).
        device: where the parameters live.

    Returns:
        The model in eval mode; ``model(tokens)`` gives logits ``[batch, seq, vocab]``.

    Raises:
        CheckpointError: missing/corrupt files, missing/unexpected keys, shape mismatches.
        ConfigError: an unsupported family or feature.
    """
    if dtype is None:
        config = read_hf_config(checkpoint_dir)
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    with torch.device("meta"):
        model = from_hf_config(checkpoint_dir)
    model.to(dtype=dtype)  # free on meta
    model.to_empty(device=device)
    model.tie_weights()
    load_hf_into_model(model, checkpoint_dir)
    return model.eval()
