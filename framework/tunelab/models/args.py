"""The hyper-parameters of a decoder, and their parsing from a Hugging Face ``config.json``."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tunelab.config._model_dir import expert_counts
from tunelab.errors import ConfigError
from tunelab.modules.moe import EXPERT_LAYOUTS
from tunelab.modules.rotary import rope_type_of
from tunelab.modules.vision import VisionArgs


@dataclass
class ModelArgs:
    """Shape and numerics of a decoder transformer."""

    vocab_size: int
    """Rows of the token embedding and of ``lm_head``."""
    dim: int
    """Model (residual stream) dimension, HF ``hidden_size``."""
    num_layers: int
    """Transformer blocks, HF ``num_hidden_layers``."""
    num_heads: int
    """Query heads, HF ``num_attention_heads``."""
    num_kv_heads: int
    """Key/value heads (GQA); equals ``num_heads`` for plain multi-head attention."""
    intermediate_dim: int
    """Hidden size of the SwiGLU MLP, HF ``intermediate_size``."""
    head_dim: int = 0
    """Per-head size; 0 means ``dim // num_heads``."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon, HF ``rms_norm_eps``."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict[str, Any] | None = None
    """HF ``rope_scaling`` dict (``rope_type`` linear, llama3, longrope or yarn), or None."""
    max_seq_len: int = 4096
    """Longest sequence the model was trained for, HF ``max_position_embeddings``."""
    tie_embeddings: bool = False
    """``lm_head`` shares the token embedding's weight."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    output_bias: bool = False
    """Bias on ``o_proj``."""
    mlp_bias: bool = False
    """Bias on the MLP projections."""
    family: str = "llama"
    """Which family's ``StateDictAdapter`` and HF config layout apply (a ``FAMILIES`` key)."""
    hidden_act: str = "silu"
    """Gate activation of the MLP: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (GeGLU, Gemma)."""
    fused_projections: bool = False
    """Phi-3: one ``qkv_proj`` and one ``gate_up_proj`` module, split after the projection."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before rotary (Qwen3, Gemma 3)."""
    norm_unit_offset: bool = False
    """Gemma RMSNorm: scale by ``1 + weight``, computed in fp32 before the cast back."""
    norm_scale_in_fp32: bool = False
    """RMSNorm applies its weight in fp32 before the cast back (gpt-oss; transformers keeps those
    norms in fp32)."""
    sandwich_norms: bool = False
    """Gemma 2/3: norms after attention and around the MLP (``pre_/post_feedforward_layernorm``)."""
    embed_scale: bool = False
    """Multiply the embeddings by ``sqrt(dim)`` (Gemma), in the activations' dtype."""
    query_pre_attn_scalar: float | None = None
    """Attention scale is ``query_pre_attn_scalar ** -0.5`` (Gemma); None means ``head_dim``."""
    attn_logit_softcap: float | None = None
    """Attention scores become ``cap * tanh(scores / cap)`` before the mask (Gemma 2)."""
    final_logit_softcap: float | None = None
    """Logits become ``cap * tanh(logits / cap)`` (Gemma 2)."""
    sliding_window: int | None = None
    """Keys a sliding-window layer sees per query, itself included (HF ``sliding_window``)."""
    layer_types: list[str] | None = None
    """Per layer ``full_attention`` or ``sliding_attention``; None means all full."""
    rope_local_theta: float | None = None
    """RoPE base of the sliding-window layers when it differs from the global one (Gemma 3)."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head's features that rotary rotates (Phi-4-mini: 0.75)."""
    num_experts: int = 0
    """Experts of each mixture-of-experts layer (HF ``num_experts``/``num_local_experts``);
    0 means a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_dim: int = 0
    """Hidden size of each expert's SwiGLU (Qwen3-MoE ``moe_intermediate_size``)."""
    norm_topk_prob: bool = False
    """Renormalise each token's top-k router weights to sum to 1 (Mixtral: always)."""
    router_weights_in_fp32: bool = False
    """Apply the router weights to the expert outputs in fp32 (Mixtral) rather than in the
    activations' dtype (Qwen3-MoE)."""
    router_bias: bool = False
    """A bias on the router (gpt-oss)."""
    expert_bias: bool = False
    """A bias on each expert's projections (gpt-oss)."""
    expert_layout: str = "stacked"
    """How the stacked expert weights are laid out, one of ``EXPERT_LAYOUTS``:
    ``stacked`` (``gate_up_proj`` ``[E, 2I, D]``, gate rows first) or ``gpt_oss``
    (``[E, D, 2I]``, gate and up columns interleaved)."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped SwiGLU in the experts (``tunelab.modules.moe.clamped_swiglu``):
    the clamp, HF ``swiglu_limit``; None for the plain gate."""
    swiglu_alpha: float = 1.702
    """The sigmoid gain of that SwiGLU, HF ``swiglu_alpha``."""
    attention_sinks: bool = False
    """A learned sink logit per head in the attention softmax's denominator (gpt-oss)."""
    dense_layers: list[int] = field(default_factory=list)
    """Layers of an MoE model that keep the dense MLP (Qwen3-MoE ``mlp_only_layers`` and
    ``decoder_sparse_step``)."""
    router_aux_loss_coef: float = 0.0
    """Weight of the router's load-balancing loss in the training loss (HF
    ``router_aux_loss_coef``)."""
    output_router_logits: bool = False
    """HF ``output_router_logits``: whether transformers adds the load-balancing loss to the
    training loss. The recipes' ``router.aux_loss_coef: null`` follows it."""
    extra_hf_config: dict[str, Any] = field(default_factory=dict)
    """Token ids and other HF config keys carried through to exported ``config.json``."""
    mrope_section: list[int] | None = None
    """Multimodal rotary (Qwen2.5-VL M-RoPE): how many of the ``head_dim / 2`` rotary
    frequencies follow the temporal, height and width positions; None for 1D rotary."""
    mrope_interleaved: bool = False
    """Qwen3-VL: the M-RoPE frequencies take the three axes in turn (``i mod 3``) instead of
    in consecutive sections (``tunelab.models.vision_language.multimodal_rotary``)."""
    vision: VisionArgs | None = None
    """The vision tower of a vision-language model; None for a text-only model."""

    @property
    def default_router_aux_loss_coef(self) -> float:
        """The load-balancing weight transformers trains this model with.

        The one place that decides it: ``router_aux_loss_coef`` when ``output_router_logits``
        is set on a mixture-of-experts model, else 0 (what ``RouterLoss`` uses for
        ``router.aux_loss_coef: null``).
        """
        if self.num_experts > 0 and self.output_router_logits:
            return self.router_aux_loss_coef
        return 0.0

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.dim // self.num_heads
        for name in (
            "vocab_size",
            "dim",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_dim",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelArgs.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = rope_type_of(self.rope_scaling)
        scaling = self.rope_scaling
        if scaling and ("type" in scaling or scaling.get("rope_type") != rope_type):
            # One spelling downstream: the legacy "type" key and aliases ("su") become rope_type.
            self.rope_scaling = {k: v for k, v in scaling.items() if k != "type"}
            self.rope_scaling["rope_type"] = rope_type
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(
                f"hidden_act {self.hidden_act!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2 != 0:
            raise ConfigError(
                f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] and give "
                f"an even number of rotary features (head_dim {self.head_dim})"
            )
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(
                LAYER_TYPES
            ):
                raise ConfigError(
                    f"layer_types must list {self.num_layers} entries from {LAYER_TYPES}, "
                    f"got {self.layer_types}"
                )
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got "
                    f"{self.num_experts_per_tok}"
                )
            if self.expert_layout not in EXPERT_LAYOUTS:
                raise ConfigError(
                    f"expert_layout must be one of {EXPERT_LAYOUTS}, got {self.expert_layout!r}"
                )
            if self.moe_intermediate_dim <= 0:
                raise ConfigError(
                    f"moe_intermediate_dim must be positive, got {self.moe_intermediate_dim}"
                )
        self.dense_layers = sorted({int(index) for index in self.dense_layers})
        if self.mrope_section is not None:
            self.mrope_section = [int(size) for size in self.mrope_section]
            if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.rotary_dim // 2:
                raise ConfigError(
                    f"mrope_section {self.mrope_section} must be 3 sizes summing to "
                    f"head_dim / 2 = {self.rotary_dim // 2}"
                )
        if SLIDING in (self.layer_types or ()) and not (self.sliding_window or 0) > 0:
            raise ConfigError(
                f"sliding-window layers need a positive sliding_window, got {self.sliding_window}"
            )

    @property
    def rotary_dim(self) -> int:
        """Features per head that rotary rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` has a mixture-of-experts feed-forward."""
        return self.num_experts > 0 and index not in self.dense_layers

    def layer_type(self, index: int) -> str:
        """``full_attention`` or ``sliding_attention`` for layer ``index``."""
        return self.layer_types[index] if self.layer_types else FULL


FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


# Keys an HF config must have; the error names the first one missing.
_REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)
# Carried into exported config.json files so generation and tokenizers keep working.
_CARRIED_HF_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def rope_from_hf(
    config: Mapping[str, Any], parameters: Mapping[str, Any] | None = None
) -> tuple[float, dict[str, Any] | None]:
    """Read ``(rope_theta, rope_scaling)`` from transformers 4 or 5 style keys.

    Args:
        config: the parsed ``config.json``.
        parameters: the ``rope_parameters`` dict to read instead of ``config``'s (Gemma 3 keeps
            one per layer type).

    Returns:
        The base and the scaling dict (None for plain RoPE), its type under ``rope_type`` by
        its canonical name. For ``yarn`` and ``longrope`` the dict is made self-contained, as
        transformers 5 resolves it: ``original_max_position_embeddings`` from the top level if
        there (Phi-3 keeps it there), else from the dict, else ``max_position_embeddings``;
        a missing ``factor`` is ``max_position_embeddings / original``.
    """
    # transformers 5 writes one `rope_parameters` dict holding rope_theta; 4.x writes
    # `rope_theta` plus a `rope_scaling` dict (type under `rope_type` or the older `type`).
    if parameters is None:
        parameters = config.get("rope_parameters")
    parameters = dict(parameters or {})
    theta = float(parameters.pop("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = dict(config.get("rope_scaling") or parameters or {})
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return theta, None
    for key in ("rope_theta", "partial_rotary_factor", "type"):
        scaling.pop(key, None)
    scaling["rope_type"] = rope_type
    if rope_type in ("yarn", "longrope"):
        max_seq_len = int(config.get("max_position_embeddings", 4096))
        original = int(
            config.get("original_max_position_embeddings")
            or scaling.get("original_max_position_embeddings")
            or max_seq_len
        )
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None:
            scaling["factor"] = max_seq_len / original
    return theta, scaling


def layer_types_from_hf(
    config: Mapping[str, Any], window: int | None, default: list[str] | None
) -> list[str] | None:
    """Per-layer attention kinds: ``layer_types`` if the file has it, else ``default``.

    Args:
        config: the parsed ``config.json``.
        window: the sliding window in effect (None: every layer is global).
        default: the family's rule when the file predates ``layer_types``.

    Returns:
        The list, or None when no layer slides.
    """
    types = config.get("layer_types") or default
    if window is None or not types or SLIDING not in types:
        return None
    return list(types)


def args_from_hf_config(config: Mapping[str, Any], family: str, **overrides: Any) -> ModelArgs:
    """Build ``ModelArgs`` from the keys every family shares.

    Args:
        config: the parsed ``config.json``.
        family: the family name to record.
        **overrides: family-specific fields (e.g. ``qkv_bias=True``); a family that supports
            partial rotary passes ``partial_rotary_factor``.

    Returns:
        The arguments.

    Raises:
        ConfigError: a required key is missing or a feature is unsupported.
    """
    for key in _REQUIRED_HF_KEYS:
        if key not in config:
            raise ConfigError(f"config.json has no {key!r}; is this a {family} checkpoint?")
    if "partial_rotary_factor" not in overrides and partial_rotary_from_hf(config) != 1.0:
        raise ConfigError("partial_rotary_factor other than 1.0 is not supported")
    theta, scaling = rope_from_hf(config)
    num_heads = int(config["num_attention_heads"])
    fields: dict[str, Any] = dict(
        vocab_size=int(config["vocab_size"]),
        dim=int(config["hidden_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        intermediate_dim=int(config["intermediate_size"]),
        head_dim=int(config.get("head_dim") or 0),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        family=family,
        hidden_act=str(config.get("hidden_act", "silu")),
        extra_hf_config={k: config[k] for k in _CARRIED_HF_KEYS if k in config},
    )
    fields.update(overrides)
    return ModelArgs(**fields)


def experts_from_hf(config: Mapping[str, Any], family: str) -> tuple[int, int]:
    """``(num_experts, num_experts_per_tok)`` of a mixture-of-experts ``config.json``.

    The keys, their order and defaults are ``tunelab.config._model_dir.MOE_KEYS``'s, which
    ``tunelab validate`` reads too, so a run refuses exactly what validate does.

    Args:
        config: the parsed ``config.json``.
        family: ``mixtral``, ``qwen3_moe`` or ``gpt_oss``.

    Returns:
        The number of experts and of experts per token.

    Raises:
        ConfigError: a count is zero, negative or not an integer (``num_local_experts: 0`` is
            refused, never read as the default), or top-k exceeds the experts.
    """
    counts, problem = expert_counts(config, family)
    if counts is None:
        raise ConfigError(f"config.json: {problem}")
    return counts


def partial_rotary_from_hf(config: Mapping[str, Any]) -> float:
    """``partial_rotary_factor`` from ``rope_parameters`` (transformers 5) or the top level."""
    parameters = config.get("rope_parameters") or {}
    return float(parameters.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))


def common_hf_config(args: ModelArgs) -> dict[str, Any]:
    """The HF config keys Llama and Qwen2 share, written in the transformers 4 layout.

    transformers 5 reads ``rope_theta`` / ``rope_scaling`` and converts them itself, so this
    layout loads in both major versions.

    Args:
        args: the model's arguments.

    Returns:
        A config dict without ``model_type``/``architectures``/dtype (the family adds them).
    """
    config: dict[str, Any] = {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.intermediate_dim,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": args.hidden_act,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": dict(args.rope_scaling) if args.rope_scaling else None,
        "tie_word_embeddings": args.tie_embeddings,
        "use_cache": True,
    }
    config.update(args.extra_hf_config)
    return config
