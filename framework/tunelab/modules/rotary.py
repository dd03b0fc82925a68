"""Rotary position embeddings, with the frequency-scaling rules of Hugging Face configs.

RoPE (Su et al., 2021, https://arxiv.org/abs/2104.09864) rotates each pair of query/key
features by an angle ``position * inv_freq[i]`` with ``inv_freq[i] = theta ** (-2i / head_dim)``.
The pairs follow Hugging Face's "rotate half" layout (feature ``i`` pairs with
``i + head_dim / 2``), so HF q/k weights load with no permutation.

Scaling types (``rope_scaling``): ``linear``, ``llama3``, ``longrope`` (alias ``su``, the name
older Phi-3 configs use) and ``yarn``. ``dynamic`` (dynamic NTK) is refused: see
``rope_type_of``.
"""

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tunelab.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
# Older names transformers still reads, mapped to the type they mean.
_ROPE_TYPE_ALIASES = {"su": "longrope"}
_DYNAMIC_REFUSAL = (
    "rope_scaling type 'dynamic' (dynamic NTK) is not supported: it is an inference-time "
    "extrapolation trick whose frequencies transformers recomputes from the longest sequence "
    "the model has seen so far, so a training step would rotate the same tokens differently "
    "depending on earlier batches and on padding. Fine-tune without rope_scaling, or use "
    "'yarn' or 'linear' for a fixed context extension"
)


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    """Return the rope type named by an HF ``rope_scaling`` dict (``rope_type`` or ``type``).

    Aliases resolve to their canonical name (``su`` is ``longrope``).

    Args:
        scaling: the dict, or None for plain RoPE.

    Returns:
        One of ``SUPPORTED_ROPE_TYPES``.

    Raises:
        ConfigError: the type is not supported. ``dynamic`` is refused on purpose: its
            frequencies depend on the longest sequence seen so far (state carried between
            forwards in transformers), which has no fixed meaning for training.
    """
    if not scaling:
        return "default"
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type == "dynamic":
        raise ConfigError(_DYNAMIC_REFUSAL)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope_scaling type {rope_type!r} is not supported; supported: "
            f"{SUPPORTED_ROPE_TYPES} (and 'su', an alias of 'longrope')"
        )
    return rope_type


def _require(scaling: Mapping[str, Any], key: str) -> Any:
    if scaling.get(key) is None:
        raise ConfigError(f"rope_scaling of type {rope_type_of(scaling)!r} needs the key {key!r}")
    return scaling[key]


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor_of(scaling: Mapping[str, Any] | None) -> float:
    """The factor ``cos`` and ``sin`` are multiplied by (1.0 for most types).

    ``attention_factor`` if given, else:

    * ``longrope``: ``sqrt(1 + ln(factor) / ln(L))`` with ``L = original_max_position_embeddings``
      (1 when ``factor <= 1``);
    * ``yarn`` (Peng et al., 2023, https://arxiv.org/abs/2309.00071): ``m(factor, mscale) /
      m(factor, mscale_all_dim)`` when both ``mscale`` and ``mscale_all_dim`` are set (DeepSeek),
      else ``m(factor, 1)``, with ``m(s, k) = 0.1 * k * ln(s) + 1`` (1 when ``s <= 1``).

    Args:
        scaling: an HF ``rope_scaling`` dict with ``factor`` and
            ``original_max_position_embeddings`` resolved, or None.

    Returns:
        The factor.
    """
    rope_type = rope_type_of(scaling)
    if rope_type not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(_require(scaling, "factor"))
    if rope_type == "yarn":
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)
    if factor <= 1.0:
        return 1.0
    original = float(_require(scaling, "original_max_position_embeddings"))
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_inverse_frequencies(
    exponents: torch.Tensor, head_dim: int, theta: float, scaling: Mapping[str, Any]
) -> torch.Tensor:
    """YaRN's blend of the original (extrapolated) and ``factor``-interpolated frequencies.

    Pair ``i`` completes ``L / (2 pi) * inv_freq[i]`` turns over ``L`` original positions;
    solving for ``i`` gives the pair index where that count equals ``beta``:
    ``d(beta) = head_dim * ln(L / (2 pi beta)) / (2 ln theta)``. Pairs below
    ``d(beta_fast)`` (many turns) keep their frequency, pairs above ``d(beta_slow)`` are
    divided by ``factor``, and a linear ramp blends those between (``truncate``, the default,
    widens the bounds to whole pairs).
    """
    factor = float(_require(scaling, "factor"))
    original = float(_require(scaling, "original_max_position_embeddings"))
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def pair_for_turns(turns: float) -> float:
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_for_turns(beta_fast), pair_for_turns(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step, not a division by zero
    pairs = torch.arange(head_dim // 2, dtype=torch.float32)
    ramp = ((pairs - low) / (high - low)).clamp(0, 1).to(exponents.device)
    # `1 - keep` rather than `ramp`, and 1 / (factor * w) rather than (1 / w) / factor: the
    # roundings transformers does, so the tables match its bit for bit.
    keep = 1 - ramp  # weight of the original frequency
    wavelength_scale = theta**exponents
    return 1.0 / (factor * wavelength_scale) * (1 - keep) + 1.0 / wavelength_scale * keep


def inverse_frequencies(
    head_dim: int,
    theta: float,
    scaling: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
    *,
    long: bool = False,
) -> torch.Tensor:
    """Compute the ``head_dim / 2`` rotary inverse frequencies, fp32.

    With ``rope_type == "llama3"`` (Llama 3.1 report, https://arxiv.org/abs/2407.21783) and
    ``wavelen = 2 pi / inv_freq``, ``L = original_max_position_embeddings``:

    * ``wavelen < L / high_freq_factor``: unchanged;
    * ``wavelen > L / low_freq_factor``: divided by ``factor``;
    * otherwise, with ``s = (L / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)``:
      ``(1 - s) * inv_freq / factor + s * inv_freq``.

    ``"linear"`` divides every frequency by ``factor``. ``"longrope"`` (LongRoPE, Ding et al.,
    2024, https://arxiv.org/abs/2402.13753; Phi-3) divides frequency ``i`` by ``short_factor[i]``,
    or by ``long_factor[i]`` when ``long`` is set. ``"yarn"``: see ``_yarn_inverse_frequencies``
    (keys ``factor``, ``original_max_position_embeddings``, optional ``beta_fast`` (32),
    ``beta_slow`` (1), ``truncate`` (True)).

    Args:
        head_dim: rotated features per head (even).
        theta: the RoPE base (``rope_theta``).
        scaling: an HF ``rope_scaling`` dict, or None.
        device: where to build the tensor.
        long: LongRoPE only: use ``long_factor`` (sequences past the original length).

    Returns:
        Tensor of shape ``[head_dim // 2]``.

    Raises:
        ConfigError: unsupported scaling type or missing scaling keys.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    rope_type = rope_type_of(scaling)
    if rope_type == "longrope":
        factors = _require(scaling, "long_factor" if long else "short_factor")
        if len(factors) != head_dim // 2:
            raise ConfigError(
                f"rope_scaling long_factor/short_factor must have {head_dim // 2} entries "
                f"(rotated features / 2), got {len(factors)}"
            )
        ext = torch.tensor(factors, dtype=torch.float32, device=device)
        return 1.0 / (ext * theta**exponents)
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(exponents, head_dim, theta, scaling)
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        return inv_freq / float(_require(scaling, "factor"))
    if rope_type == "llama3":
        factor = float(_require(scaling, "factor"))
        low_freq_factor = float(_require(scaling, "low_freq_factor"))
        high_freq_factor = float(_require(scaling, "high_freq_factor"))
        old_context_len = float(_require(scaling, "original_max_position_embeddings"))
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Produces the ``cos`` / ``sin`` tables for given positions.

    It holds no buffers on purpose: a model built on the meta device and materialised with
    ``to_empty`` would otherwise carry uninitialised frequencies. The frequencies are computed
    once per device and kept in a plain dict.

    LongRoPE picks its short or long factors per forward, as transformers does: the long ones
    when the largest position in ``positions`` is at or past ``original_max_position_embeddings``,
    LongRoPE and YaRN scale ``cos``/``sin`` by ``attention_factor_of``.

    Args:
        head_dim: rotated features per head (all of them unless partial rotary).
        theta: the RoPE base.
        scaling: an HF ``rope_scaling`` dict, or None.
    """

    def __init__(
        self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__()
        rope_type_of(scaling)  # fail at build time, not at the first forward
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = dict(scaling) if scaling else None
        self.longrope = rope_type_of(scaling) == "longrope"
        self.attention_factor = attention_factor_of(scaling)
        self._inv_freq: dict[tuple[torch.device, bool], torch.Tensor] = {}

    def _frequencies(self, device: torch.device, long: bool = False) -> torch.Tensor:
        if (device, long) not in self._inv_freq:
            self._inv_freq[device, long] = inverse_frequencies(
                self.head_dim, self.theta, self.scaling, device, long=long
            )
        return self._inv_freq[device, long]

    def forward(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        max_position: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute ``cos`` and ``sin`` for the given positions.

        Args:
            positions: integer positions ``[batch, seq]``.
            dtype: dtype of the returned tables (the activations' dtype).
            max_position: the largest position of the whole batch when ``positions`` is a
                part of it (context parallelism): LongRoPE picks its factors from it, so every
                part picks as the whole would. None: ``positions.max()``.

        Returns:
            ``(cos, sin)``, each ``[batch, seq, head_dim]``.
        """
        inv_freq = self._frequencies(positions.device)
        if self.longrope:
            # A select, not a Python branch: no device sync (transformers' rule, same outcome).
            largest = positions.max() if max_position is None else max_position
            is_long = largest + 1 > self.scaling["original_max_position_embeddings"]
            inv_freq = torch.where(is_long, self._frequencies(positions.device, True), inv_freq)
        freqs = positions.float()[..., None] * inv_freq  # [b, s, head_dim / 2], fp32
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_axis: int = 1
) -> torch.Tensor:
    """Rotate ``x`` by the angles whose cosines and sines are given.

    With partial rotary the tables are narrower than the head: only the first
    ``cos.shape[-1]`` features rotate, the others pass through (Phi-3's layout). Each output
    element is computed from the same inputs by the same operations whatever the layout, so
    ``head_axis=2`` on ``x.transpose(1, 2)`` gives the transposed result bit for bit.

    Args:
        x: ``[batch, heads, seq, head_dim]`` (``head_axis=1``) or ``[batch, seq, heads,
            head_dim]`` (``head_axis=2``).
        cos: ``[batch, seq, rotary_dim]``, ``rotary_dim <= head_dim``.
        sin: ``[batch, seq, rotary_dim]``.
        head_axis: Where ``x`` has its heads.

    Returns:
        ``x * cos + rotate_half(x) * sin`` on the rotated features, same shape as ``x``.
    """
    cos, sin = cos.unsqueeze(head_axis), sin.unsqueeze(head_axis)
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rotated * cos + _rotate_half(rotated) * sin, passed), dim=-1)
