"""What llama.cpp needs to know about a model: its GGUF architecture, hyperparameters and tensors.

Each supported Hugging Face ``model_type`` maps to the llama.cpp architecture that computes the
same function, with the hyperparameter keys and tensor names llama.cpp's own
``convert_hf_to_gguf.py`` writes for it (names come from the ``gguf`` package's tensor map, so
they follow llama.cpp's). Two differences from a plain rename, both as llama.cpp's converter does:

- ``llama`` and ``mistral`` (llama.cpp's ``llama`` architecture) rotate adjacent pairs of q/k
  features where Hugging Face rotates the two halves (``rotate_half``), so each head's q and k
  rows are permuted: row ``h*d + 2i + j`` takes HF row ``h*d + j*d/2 + i``.
- A ``llama3`` rope scaling is written as a ``rope_freqs`` tensor of per-frequency factors
  (Llama 3.1's rule: wavelengths above ``original / low_freq_factor`` are divided by ``factor``,
  below ``original / high_freq_factor`` kept, smoothly interpolated between).

- Gemma 2 and 3 (text) scale by ``1 + weight`` in their RMSNorms, so 1 is added to every norm
  weight. llama.cpp fixes what the config states for Gemma: the attention scale
  (``1/sqrt(head_dim)``, ``1/sqrt(hidden/heads)`` at its 27B layer counts), the pattern of
  sliding and global layers (every 2nd, resp. 6th layer global) and Gemma 3's local rope base
  (10000); a config that differs is refused.

- Mixture-of-experts layers (``mixtral`` as llama.cpp's ``llama`` with experts, ``qwen3_moe`` as
  ``qwen3moe``): the export's per-expert tensors (``experts.N.w1`` / ``experts.N.gate_proj``)
  are stacked into one ``[experts, rows, columns]`` tensor per projection
  (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``), the router is ``ffn_gate_inp``
  (float32, as llama.cpp's converter keeps it). llama.cpp's MoE layers renormalize the top-k
  routing weights and have no dense layers, so a ``qwen3_moe`` config that says otherwise is
  refused.

A family llama.cpp does not support, or a feature of a supported one it would compute
differently (a sliding window on every layer of qwen2/qwen3), is refused with one line.
This module imports no torch.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import gguf
import numpy as np

from tunelab.config._gguf import gguf_quantizer_problem
from tunelab.errors import CheckpointError

__all__ = [
    "QUANTIZATIONS",
    "GGUFFamily",
    "PlannedTensor",
    "expert_stacks",
    "family_of",
    "permute_rows",
    "plan_tensor",
    "quantization_problem",
    "rope_freqs",
    "write_hparams",
]

QUANTIZATIONS: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q4_k": (gguf.GGMLQuantizationType.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_S),
    "q6_k": (gguf.GGMLQuantizationType.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K),
}
"""The ``--quant`` names: each is quantized by the ``gguf`` package's own quantizer, where the
installed package has one (``quantization_problem``: 0.19 has none for ``q4_k`` and ``q6_k``)."""


def quantization_problem(quant: str) -> str | None:
    """Why ``quant`` cannot be written with the installed ``gguf`` package (None: it can).

    Every type but f32 and f16 (plain casts) needs the package's own quantizer for it
    (``tunelab.config._gguf``, which config validation asks too), never one written here.
    """
    if quant not in QUANTIZATIONS:
        return f"GGUF quantization {quant!r} is not one of {', '.join(QUANTIZATIONS)}"
    return gguf_quantizer_problem(quant)


# Tensors that llama.cpp keeps in float32 whatever the file type (as its converter does).
_F32_TENSORS = ("ffn_gate_inp.", "position_embd.")


ArrayT = TypeVar("ArrayT")


@dataclass(frozen=True)
class GGUFFamily:
    """How one Hugging Face ``model_type`` becomes a llama.cpp architecture."""

    arch: gguf.MODEL_ARCH
    """llama.cpp's architecture."""
    permute_qk: bool
    """Permute q/k rows from HF's rotate-half order to llama.cpp's adjacent pairs."""
    check: Callable[[Mapping[str, Any]], str | None]
    """A reason llama.cpp would compute another function for this config, or None."""
    norm_offset: float = 0.0
    """Added to every norm weight (Gemma's RMSNorm scales by ``1 + weight``; llama.cpp's by
    ``weight``)."""
    extra_hparams: Callable[[gguf.GGUFWriter, Mapping[str, Any]], None] | None = None
    """Writes the architecture's own keys (soft-capping, sliding window) after the common ones."""

    @property
    def name(self) -> str:
        """The architecture name written into the file (``general.architecture``)."""
        return gguf.MODEL_ARCH_NAMES[self.arch]


def _no_sliding_window(config: Mapping[str, Any]) -> str | None:
    if config.get("use_sliding_window"):
        return "use_sliding_window is true (llama.cpp attends over the whole context)"
    return None


def _window_covers_context(config: Mapping[str, Any]) -> str | None:
    window = config.get("sliding_window")
    if window is not None and window < config.get("max_position_embeddings", 0):
        return f"sliding_window {window} is shorter than the context (llama.cpp attends fully)"
    return None


# llama.cpp's Gemma attention scale is 1/sqrt(head_dim), except for the layer count of its
# "27B" type, where it is 1/sqrt(hidden / heads); it never reads query_pre_attn_scalar.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
# llama.cpp's sliding-window layers: all but every n-th (Gemma 2: 2, Gemma 3: 6).
_GEMMA_SWA_PERIOD = {"gemma2": 2, "gemma3_text": 6}


def _gemma_check(config: Mapping[str, Any]) -> str | None:
    model_type = config["model_type"]
    head_dim = _head_dim(config)
    if config["num_hidden_layers"] == _GEMMA_27B_LAYERS[model_type]:
        head_dim = config["hidden_size"] // config["num_attention_heads"]
    if config.get("query_pre_attn_scalar", head_dim) != head_dim:
        return (
            f"query_pre_attn_scalar {config['query_pre_attn_scalar']} is not {head_dim} "
            "(llama.cpp scales attention by 1/sqrt of that, whatever the config says)"
        )
    if model_type == "gemma2" and not (
        config.get("attn_logit_softcapping") and config.get("final_logit_softcapping")
    ):
        return "a soft-cap is null (llama.cpp's gemma2 always soft-caps: 50 and 30 by default)"
    period = _GEMMA_SWA_PERIOD[model_type]
    expected = [
        "sliding_attention" if (i + 1) % period else "full_attention"
        for i in range(config["num_hidden_layers"])
    ]
    if config.get("sliding_window") and config.get("layer_types", expected) != expected:
        return (
            f"layer_types {config['layer_types']} are not llama.cpp's fixed pattern "
            f"(one global layer in every {period}, the others sliding)"
        )
    if model_type == "gemma3_text":
        local = config.get("rope_local_base_freq") or (
            (config.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
        )
        if local not in (None, 10000.0):
            return f"rope_local_base_freq {local} is not 10000 (llama.cpp's fixed local base)"
    return None


def _gemma_hparams(writer: gguf.GGUFWriter, config: Mapping[str, Any]) -> None:
    if config["model_type"] == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])


def _phi3_check(config: Mapping[str, Any]) -> str | None:
    _, scaling = _rope(config)
    if scaling is not None and scaling["rope_type"] in ("longrope", "su"):
        return (
            "LongRoPE scaling (llama.cpp picks the long or short factors by its context size, "
            "transformers by each sequence's length)"
        )
    # llama.cpp's phi3 with a sliding_window key computed other logits (4.8 apart, measured).
    return _window_covers_context(config)


def _mixtral_check(config: Mapping[str, Any]) -> str | None:
    return _window_covers_context(config)


def _qwen3_moe_check(config: Mapping[str, Any]) -> str | None:
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        return (
            "some layers are dense (mlp_only_layers / decoder_sparse_step; llama.cpp's qwen3moe "
            "has experts in every layer)"
        )
    if not config.get("norm_topk_prob", True):
        return "norm_topk_prob is false (llama.cpp renormalizes the top-k routing weights)"
    return _no_sliding_window(config)


def _moe_hparams(writer: gguf.GGUFWriter, config: Mapping[str, Any]) -> None:
    writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


_FAMILIES = {
    "llama": GGUFFamily(gguf.MODEL_ARCH.LLAMA, True, lambda config: None),
    "mistral": GGUFFamily(gguf.MODEL_ARCH.LLAMA, True, _window_covers_context),
    "qwen2": GGUFFamily(gguf.MODEL_ARCH.QWEN2, False, _no_sliding_window),
    "qwen3": GGUFFamily(gguf.MODEL_ARCH.QWEN3, False, _no_sliding_window),
    "gemma2": GGUFFamily(gguf.MODEL_ARCH.GEMMA2, False, _gemma_check, 1.0, _gemma_hparams),
    "gemma3_text": GGUFFamily(gguf.MODEL_ARCH.GEMMA3, False, _gemma_check, 1.0, _gemma_hparams),
    "phi3": GGUFFamily(gguf.MODEL_ARCH.PHI3, False, _phi3_check),
    "mixtral": GGUFFamily(gguf.MODEL_ARCH.LLAMA, True, _mixtral_check, 0.0, _moe_hparams),
    "qwen3_moe": GGUFFamily(gguf.MODEL_ARCH.QWEN3MOE, False, _qwen3_moe_check, 0.0, _moe_hparams),
}


def family_of(config: Mapping[str, Any], source: str) -> GGUFFamily:
    """The GGUF family of a ``config.json``.

    Raises:
        CheckpointError: One line naming the family when it is not supported (yet).
    """
    model_type = config.get("model_type")
    family = _FAMILIES.get(str(model_type))
    if family is None:
        raise CheckpointError(
            f"{source}: GGUF export does not support model_type {model_type!r} "
            f"(supported: {', '.join(sorted(_FAMILIES))})"
        )
    problem = family.check(config)
    if problem is not None:
        raise CheckpointError(f"{source}: cannot export {model_type} to GGUF: {problem}")
    return family


def _head_dim(config: Mapping[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling or None)`` from transformers 4's or 5's config keys."""
    parameters = dict(config.get("rope_parameters") or {})
    # transformers 5 nests Gemma 3's per layer type; llama.cpp's keys are the global layers'.
    parameters = dict(parameters.get("full_attention", parameters))
    theta = float(config.get("rope_theta") or parameters.get("rope_theta") or 10000.0)
    scaling = config.get("rope_scaling") or parameters
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return theta, (None if kind == "default" else {**scaling, "rope_type": kind})


def write_hparams(
    writer: gguf.GGUFWriter,
    config: Mapping[str, Any],
    family: GGUFFamily,
    file_type: int,
    source: str,
) -> None:
    """Add the architecture's hyperparameters, as llama.cpp's converter writes them.

    Raises:
        CheckpointError: If the rope scaling is of a kind llama.cpp has no equivalent for.
    """
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    writer.add_rope_dimension_count(
        int(_head_dim(config) * config.get("partial_rotary_factor", 1.0))
    )
    writer.add_vocab_size(config["vocab_size"])
    theta, scaling = _rope(config)
    writer.add_rope_freq_base(theta)
    if scaling is not None:
        kind = scaling["rope_type"]
        if kind == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(scaling["factor"])
        elif kind == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(scaling["factor"])
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        elif not (kind == "llama3" and family.arch == gguf.MODEL_ARCH.LLAMA):
            raise CheckpointError(f"{source}: GGUF export does not support rope_type {kind!r} here")
    if family.extra_hparams is not None:
        family.extra_hparams(writer, config)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def rope_freqs(config: Mapping[str, Any]) -> np.ndarray | None:
    """The ``rope_freqs`` factors of a ``llama3`` rope scaling (None for any other).

    Llama 3.1's rule, per rotary frequency ``f`` with wavelength ``w = 2π / f``: factor 1 when
    ``w < original / high_freq_factor``, ``factor`` when ``w > original / low_freq_factor``,
    else ``1 / ((1 - s) / factor + s)`` with ``s = (original / w - low) / (high - low)``.
    llama.cpp divides each frequency by its factor.
    """
    theta, scaling = _rope(config)
    if scaling is None or scaling["rope_type"] != "llama3":
        return None
    dim = _head_dim(config)
    factor = float(scaling.get("factor", 8.0))
    low, high = (
        float(scaling.get("low_freq_factor", 1.0)),
        float(scaling.get("high_freq_factor", 4.0)),
    )
    original = float(scaling.get("original_max_position_embeddings", 8192))
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the GGUF file: where it comes from and how it is stored."""

    hf_name: str | None
    """The safetensors key it is read from (None: generated, ``rope_freqs``)."""
    name: str
    """Its GGUF name."""
    shape: tuple[int, ...]
    """Its shape in HF (row-major) order."""
    qtype: gguf.GGMLQuantizationType
    """How its data is stored."""
    permute_heads: int
    """Permute rows in this many heads (0: no permutation)."""
    offset: float = 0.0
    """Added to every value before it is stored (Gemma's norm weights: 1)."""
    sources: tuple[str, ...] = ()
    """The per-expert safetensors keys stacked into it, in expert order (empty: ``hf_name``)."""

    @property
    def nbytes(self) -> int:
        """Bytes of its data in the file (before alignment padding)."""
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * type_size


@functools.cache
def _tensor_map(arch: gguf.MODEL_ARCH, num_layers: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(arch, num_layers)  # about 20 ms to build: once per model


def plan_tensor(
    hf_name: str,
    shape: tuple[int, ...],
    config: Mapping[str, Any],
    family: GGUFFamily,
    qtype: gguf.GGMLQuantizationType,
) -> PlannedTensor | None:
    """The GGUF name, storage type and permutation of one HF tensor (None: not written).

    1-D tensors, norms and biases stay float32 (llama.cpp's converter does the same); a
    tensor whose rows do not split into whole quantization blocks falls back to f16.

    Raises:
        CheckpointError: If llama.cpp has no name for the tensor.
    """
    if hf_name.endswith(".rotary_emb.inv_freq"):
        return None
    tensor_map = _tensor_map(family.arch, config["num_hidden_layers"])
    name = tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise CheckpointError(
            f"GGUF export: llama.cpp's {family.name} has no tensor for {hf_name!r}"
        )
    keep_f32 = (
        len(shape) <= 1
        or name.endswith("_norm.weight")
        or not name.endswith(".weight")
        or any(part in name for part in _F32_TENSORS)
    )
    stored = gguf.GGMLQuantizationType.F32 if keep_f32 else qtype
    block, _ = gguf.GGML_QUANT_SIZES[stored]
    if shape[-1] % block:
        stored = gguf.GGMLQuantizationType.F16
    heads = 0
    if family.permute_qk and name.endswith(("attn_q.weight", "attn_q.bias")):
        heads = config["num_attention_heads"]
    elif family.permute_qk and name.endswith(("attn_k.weight", "attn_k.bias")):
        heads = config.get("num_key_value_heads", config["num_attention_heads"])
    offset = family.norm_offset if name.endswith("norm.weight") else 0.0
    return PlannedTensor(hf_name, name, tuple(shape), stored, heads, offset)


_EXPERT_KEY = re.compile(r"^(?P<moe>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def expert_stacks(keys: list[str], source: str) -> tuple[list[str], dict[str, tuple[str, ...]]]:
    """Split safetensors keys into plain ones and per-expert ones stacked by projection.

    Returns:
        ``(plain keys, {stacked name: per-expert keys in expert order})``, the stacked name
        being the per-expert one without the expert number (``...experts.w1.weight``).

    Raises:
        CheckpointError: If a projection's experts are not numbered 0 to N-1 without gaps.
    """
    plain, stacks = [], {}
    for key in keys:
        match = _EXPERT_KEY.match(key)
        if match is None:
            plain.append(key)
            continue
        stacked = f"{match['moe']}.{match['proj']}.weight"
        stacks.setdefault(stacked, {})[int(match["expert"])] = key
    for stacked, experts in stacks.items():
        if sorted(experts) != list(range(len(experts))):
            raise CheckpointError(
                f"{source}: the experts of {stacked} are numbered {sorted(experts)}, not 0 to "
                f"{len(experts) - 1}"
            )
    return plain, {name: tuple(e[i] for i in range(len(e))) for name, e in stacks.items()}


def permute_rows(data: ArrayT, heads: int) -> ArrayT:
    """Reorder each head's rows from HF's rotate-half layout to llama.cpp's adjacent pairs."""
    return (
        data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:])
        .swapaxes(1, 2)
        .reshape(data.shape)
    )
