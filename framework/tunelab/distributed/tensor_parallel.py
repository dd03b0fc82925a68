"""Tensor parallelism of the dense decoder: split matmuls, sequence-parallel norms.

With ``parallelism.tensor_parallel_size: N`` the N ranks of the mesh's ``"tp"`` dimension
(``build_device_meshes``) see the same samples and split each block's matmuls, through torch's
DTensor parallel styles (Megatron-LM, Shoeybi et al., 2019, https://arxiv.org/abs/1909.08053;
sequence parallelism, Korthikanti et al., 2022, https://arxiv.org/abs/2205.05198):

- attention: ``q_proj``, ``k_proj``, ``v_proj`` column-wise (each rank computes
  ``num_heads / N`` query and ``num_kv_heads / N`` key/value heads, attention runs on them
  locally), ``o_proj`` row-wise; the MLP: ``gate_proj`` and ``up_proj`` column-wise,
  ``down_proj`` row-wise. A row-wise output is reduce-scattered over the sequence. A fused
  projection (Phi-3's ``qkv_proj``, ``gate_up_proj``) is split as any column-wise weight,
  and its output regrouped by one all-to-all so that each rank holds its slice of q, k and v
  (of gate and up): ``tunelab.distributed._fused_parallel``.
- between the blocks the residual stream is split over the sequence (``Shard(1)``): the norms
  run on each rank's tokens (sequence parallelism), and each attention or MLP input is
  all-gathered over the sequence first. Norm weights are replicated; their gradients are
  summed over the ranks by DTensor.
- the embedding is split over the vocabulary (``Shard(0)``) and so is ``lm_head``: the chunked
  loss (``tunelab.losses``, ``OutputLayer.vocab_group``) computes each rank's logits for its
  part of the vocabulary and combines the softmax statistics with small all-reduces; the
  ``[tokens, vocab]`` logits are never gathered. Without the chunked loss (generation,
  ``chunked_output: false``) ``lm_head`` gathers the logits. A sequence classifier's small
  head (a reward model's ``score``) is replicated and reads the gathered sequence.
- a mixture-of-experts layer (``qwen3_moe``, ``mixtral``) needs its experts split by expert
  parallelism (``tunelab.distributed.expert_parallel``, with ``expert_parallel_size`` a
  multiple of N): its input is not gathered, each rank routes its own ``seq / N`` tokens with
  the router whole on every rank (its weight's gradient summed over the ranks by DTensor),
  and the tokens travel to their experts' owners by all-to-all and back, staying split over
  the sequence. The router loss's statistics are summed over the tp ranks
  (``sequence_parallel_tokens``), so they are those of the whole rows. LoRA on the experts
  keeps its small factors whole on every rank, each rank using its own experts' slices, their
  partial gradients added over the ranks (``tunelab.peft.ExpertLoRA.delta``); an adapter on
  the router is refused. Dense layers of an MoE model (Qwen3-MoE's ``mlp_only_layers``) are
  split as above.
- LoRA adapters follow their base: under a column-wise base ``A`` is replicated (the base's
  input is) and ``B`` is split like the base's output rows; under a row-wise base ``A`` is
  split like the base's input columns and ``B`` replicated, its input being a partial sum.
  QLoRA's NF4 base is split the same way before it is quantized, each rank quantizing its own
  piece (``tunelab.peft.nf4``).
  DoRA's magnitude (one value per output row) is split like the rows under a column-wise
  base and replicated under a row-wise one, whose row norms ``||W + scale B A||`` are then
  summed over the ranks' columns (DTensor's norm of a ``Shard(1)`` tensor; at initialisation
  ``LoRALinear.reset_lora_parameters``). Adapter dropout draws the whole input's mask on
  every rank and keeps its part (``LoRALinear._dropout``): the same mask on every rank.

Every parameter is then a ``DTensor`` on the ``"tp"`` mesh (but the experts, on their own
mesh), and FSDP2 shards them further over the data-parallel dimensions: checkpoints (DCP) and
exports read the same full tensors whatever the layout.

Sequences are padded at their end to a multiple of N (causal attention: no earlier token
sees the padding) and the outputs cut back.

With context parallelism too (``parallelism.context_parallel_size``, the mesh's ``"cp"``
dimension next to ``"tp"``) each rank's input is its cp slice of the rows, padded by
``ContextParallel.shard`` to a multiple of ``2 x cp x N`` so that the slice divides by N
with no padding here: the sequence-parallel regions split the cp slice over the tp group,
attention all-gathers it over tp, computes this rank's heads and gathers their keys and
values over the cp group (``ContextParallel.gather_key_values``), and the loss combines the
vocabulary's statistics over tp while the token counts sum over every process.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import distribute_module

from tunelab.distributed._fused_parallel import FusedColwise
from tunelab.errors import ConfigError

__all__ = [
    "check_tensor_parallel",
    "parallelize_decoder",
    "sequence_parallel_tokens",
    "tensor_parallel_output",
]


def check_tensor_parallel(model: nn.Module, size: int) -> None:
    """Refuse a model or setting tensor parallelism does not cover, with one line.

    Args:
        model: The decoder, built (on the meta device) with any LoRA adapters; a mixture of
            experts with its experts split already (``shard_experts``).
        size: ``parallelism.tensor_parallel_size``.

    Raises:
        ConfigError: A size that does not divide the heads (query and key/value), the dense
            MLP's intermediate size or the vocabulary; a family or adapter not covered yet; a
            mixture of experts whose experts are not split.
    """
    args = model.args
    setting = f"parallelism.tensor_parallel_size: {size}"
    family = f"model family {args.family!r}"
    moe_blocks = [block.mlp for block in model.layers if _is_moe(block.mlp)]
    if any(block.experts.expert_parallel is None for block in moe_blocks):
        raise ConfigError(f"{setting}: {family} is a mixture of experts; tensor parallelism splits its attention only, and needs its experts split by parallelism.expert_parallel_size (a multiple of {size})")  # fmt: skip
    if any(_is_lora(block.gate) for block in moe_blocks):
        raise ConfigError(f"{setting} with parallelism.expert_parallel_size: an adapter on the router (gate) is not built yet: drop gate from lora.targets")  # fmt: skip
    if args.attention_sinks:
        raise ConfigError(f"{setting}: {family} has attention sinks, not split by tensor parallelism yet")  # fmt: skip
    if args.vision is not None:
        raise ConfigError(f"{setting}: {family} has a vision tower, not covered by tensor parallelism yet")  # fmt: skip
    counts = [("num_attention_heads", args.num_heads), ("num_key_value_heads", args.num_kv_heads)]
    if len(moe_blocks) < len(model.layers):  # dense MLPs to split
        counts.append(("intermediate_size", args.intermediate_dim))
    for name, count in (*counts, ("vocab_size", args.vocab_size)):
        if count % size:
            raise ConfigError(
                f"{setting} does not divide the model's {name} {count}: pick a size that "
                f"divides it ({count} % {size} = {count % size})"
            )
    for name, module in model.named_modules():
        if not _is_lora(module):
            continue
        if name == "lm_head":
            raise ConfigError(f"{setting} with an adapter on lm_head is not built yet: drop lm_head from lora.targets")  # fmt: skip
        if type(module.weight).__name__ == "NF4Tensor" or isinstance(module.weight, DTensor):
            raise ConfigError(f"{setting}: {name}.weight is already quantized or split; split the model before lora.quantize_base: nf4 quantizes it")  # fmt: skip


def parallelize_decoder(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split a dense decoder's matmuls over ``mesh`` (the ``"tp"`` ranks), in place.

    Call it on the model built on the meta device (with its adapters), before FSDP2; on a
    mixture of experts after ``shard_experts``.

    Args:
        model: A ``TransformerDecoder``; ``check_tensor_parallel`` must accept it.
        mesh: The tensor-parallel mesh (``DeviceMeshes.tensor``).
    """
    check_tensor_parallel(model, mesh.size())
    args = model.args
    # SequenceParallel makes trainable parameters of the norms it places: keep frozen ones so.
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    for block in model.layers:
        attention = block.self_attn
        plan: dict[str, Any] = {"self_attn": _gather_sequence(5)}
        if attention.fused_qkv:
            plan["self_attn.qkv_proj"] = _fused_colwise(attention.qkv_proj, attention.split_sizes)
        else:
            for name in ("q_proj", "k_proj", "v_proj"):
                plan[f"self_attn.{name}"] = _colwise(getattr(attention, name))
        plan["self_attn.o_proj"] = _rowwise(attention.o_proj)
        if _is_moe(block.mlp):
            # This rank's tokens stay its own: routed here, sent to their experts and back.
            plan["mlp.gate"] = _TokenwiseReplicated()
            # LoRA on the experts: the small factors whole on every rank, each rank applying
            # its own experts' slices (tunelab.peft.ExpertLoRA.delta sums their gradients).
            plan |= {f"mlp.experts.lora.{name}": _Replicated() for name in block.mlp.experts.lora}
        else:
            plan |= {"mlp": _gather_sequence(1), "mlp.down_proj": _rowwise(block.mlp.down_proj)}
            if block.mlp.fused:
                plan["mlp.gate_up_proj"] = _fused_colwise(
                    block.mlp.gate_up_proj, [args.intermediate_dim] * 2
                )
            else:
                plan["mlp.gate_proj"] = _colwise(block.mlp.gate_proj)
                plan["mlp.up_proj"] = _colwise(block.mlp.up_proj)
        norms = ["input_layernorm", "post_attention_layernorm"]
        if args.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        plan |= {name: SequenceParallel(use_local_output=True) for name in norms}
        if args.qk_norm:
            # Per-head norms see this rank's heads ([batch, seq, heads / N, head_dim]).
            plan |= {
                f"self_attn.{name}": SequenceParallel(sequence_dim=2, use_local_output=True)
                for name in ("q_norm", "k_norm")
            }
        parallelize_module(block, mesh, plan)
    top: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(use_local_output=True),
    }
    if hasattr(model, "lm_head"):
        # Only forwards that want the logits call it (the chunked loss does not).
        top["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    else:
        # A sequence classifier's head (a reward model's score, one output) in place of it.
        top |= {name: _ReplicatedHead() for name in model.modules_to_save}
    parallelize_module(model, mesh, top)
    model.tie_weights()  # both are Shard(0) over the vocabulary: they can stay one tensor
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    model.register_forward_pre_hook(partial(_pad_sequence, mesh.size()), with_kwargs=True)
    model.register_forward_hook(partial(_gather_output, mesh), with_kwargs=True)
    model.tensor_parallel_mesh = mesh


def tensor_parallel_size(model: nn.Module) -> int:
    """The ranks splitting the model's matmuls (1: not tensor-parallel).

    They all train on the same tokens, so a token count summed over every process (as
    ``tunelab.training.global_token_count`` sums it) holds each token this many times.
    """
    mesh = getattr(model, "tensor_parallel_mesh", None)
    return 1 if mesh is None else mesh.size()


def tensor_parallel_output(model: nn.Module) -> tuple[Any, Any] | None:
    """The vocabulary-sharded output layer of a tensor-parallel decoder, or None.

    Returns:
        ``(forward, group)``: ``forward`` maps hidden states ``[..., dim]`` to this rank's
        logits ``[..., vocab / N]`` (its rows of ``lm_head``, then any final soft-cap), the
        vocabulary split in N equal consecutive parts, rank ``r`` holding part ``r``; and the
        tensor-parallel process group. None when the model is not tensor-parallel.
    """
    mesh = getattr(model, "tensor_parallel_mesh", None)
    if mesh is None:
        return None
    lm_head, cap = model.lm_head, model.args.final_logit_softcap

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, lm_head.weight.to_local())
        return logits if cap is None else torch.tanh(logits / cap) * cap

    return forward, mesh.get_group()


def sequence_parallel_tokens(
    model: nn.Module, mask: torch.Tensor | None, tokens: torch.Tensor
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None:
    """What a statistic over the tokens between the blocks needs under tensor parallelism.

    There each tp rank holds its own part of the sequence (the rows padded at their end to a
    multiple of the tp size, then cut in equal consecutive parts): a mixture-of-experts
    layer routes only those tokens (``tunelab.modules.moe.RouterStats``).

    Args:
        model: The decoder.
        mask: bool or 0/1 ``[batch, seq]``, the tokens that count (None: every token).
        tokens: ``[batch, seq]``, the model's input (for its shape and device).

    Returns:
        None when the model is not tensor-parallel; else ``(part, sum_over_ranks)``: ``part``
        the mask of this rank's tokens (fp32, 0 on the padding) and ``sum_over_ranks`` a
        sum over the tp group (collective; a copy, autograd-free).
    """
    mesh = getattr(model, "tensor_parallel_mesh", None)
    if mesh is None:
        return None
    size = mesh.size()
    part = torch.ones(tokens.shape, device=tokens.device) if mask is None else mask.float()
    part = F.pad(part, (0, -part.shape[1] % size)).chunk(size, dim=1)[mesh.get_local_rank()]
    group = mesh.get_group()

    def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
        value = value.detach().clone()
        dist.all_reduce(value, group=group)
        return value

    return part, sum_over_ranks


class _Replicated(ParallelStyle):
    """A module's parameters whole on every rank (``Replicate()``), its inputs untouched."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


class _TokenwiseReplicated(ParallelStyle):
    """A small layer whole on every rank, applied to this rank's own tokens (a MoE router).

    Its input rows are this rank's tokens, taken as the rank's ``Shard(0)`` part of all the
    group's rows (each row computes on its own), so its weight's gradient, a partial sum
    over the ranks, is summed by DTensor; its output is this rank's rows again.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # No partition_fn: distribute_module replicates the parameters.
        return distribute_module(
            module, device_mesh, input_fn=_own_rows_input, output_fn=_local_head_output
        )


def _own_rows_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    rows = DTensor.from_local(inputs[0], mesh, [Shard(0)], run_check=False)
    return (rows, *inputs[1:])


class _ReplicatedHead(ParallelStyle):
    """A small output head whole on every rank, reading the whole (gathered) sequence.

    Its input, split over the sequence, is all-gathered; every rank then computes the same
    outputs (and its weight the same gradient, with no reduction). The gradient of the
    gathered input is whole on every rank, so each keeps its own tokens' part.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # No partition_fn: distribute_module replicates the parameters.
        return distribute_module(
            module, device_mesh, input_fn=_gather_head_input, output_fn=_local_head_output
        )


def _gather_head_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    split = DTensor.from_local(inputs[0], mesh, [Shard(1)], run_check=False)
    return (split.redistribute(placements=[Replicate()]), *inputs[1:])


def _local_head_output(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    return output.to_local()


def _gather_sequence(num_inputs: int) -> PrepareModuleInput:
    # The first input arrives split over the sequence (this rank's tokens): all-gather it.
    # The others (rotary tables, masks, positions) are whole already.
    rest = (None,) * (num_inputs - 1)
    return PrepareModuleInput(
        input_layouts=(Shard(1), *rest),
        desired_input_layouts=(Replicate(), *rest),
        use_local_output=True,
    )


def _colwise(module: nn.Module) -> ColwiseParallel:
    return _LoRAColwise() if _is_lora(module) else ColwiseParallel()


def _fused_colwise(module: nn.Module, part_sizes: list[int]) -> FusedColwise:
    # Split as any column-wise weight; its output then regrouped per part.
    return FusedColwise(part_sizes, _colwise(module))


def _rowwise(module: nn.Module) -> RowwiseParallel:
    return _LoRARowwise(output_layouts=Shard(1)) if _is_lora(module) else RowwiseParallel(output_layouts=Shard(1))  # fmt: skip


def _is_moe(module: nn.Module) -> bool:
    # A mixture-of-experts feed-forward (tunelab.modules.moe.MoEBlock) by its parts: its
    # experts carry an expert_parallel slot. Not imported: modules and distributed are one
    # layer and import neither.
    experts = getattr(module, "experts", None)
    return experts is not None and hasattr(experts, "expert_parallel")


def _is_lora(module: nn.Module) -> bool:
    # A LoRA linear by its adapter's parts (PEFT's names, which tunelab.peft's LoRALinear
    # keeps): not imported from tunelab.peft, which itself builds on this package.
    return isinstance(getattr(module, "lora_A", None), nn.Linear) and isinstance(
        getattr(module, "lora_B", None), nn.Linear
    )


def _place_lora(placements: dict[str, Any], name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    # distribute_module calls this for the LoRALinear ("") and each submodule: place each
    # one's own parameters (the base weight and bias; lora_A's and lora_B's weight).
    for param_name, param in list(module.named_parameters(recurse=False)):
        key = param_name if name == "" else name
        placed = distribute_tensor(param, mesh, [placements[key]])
        module.register_parameter(param_name, nn.Parameter(placed, param.requires_grad))


class _LoRAColwise(ColwiseParallel):
    """``ColwiseParallel`` for a ``LoRALinear``: ``A`` replicated, ``B`` split like the base."""

    _placements = {
        "weight": Shard(0),
        "bias": Shard(0),
        "lora_magnitude_vector": Shard(0),
        "lora_A": Replicate(),
        "lora_B": Shard(0),
    }

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partial(_place_lora, self._placements),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class _LoRARowwise(RowwiseParallel):
    """``RowwiseParallel`` for a ``LoRALinear``: ``A`` split like the base, ``B`` replicated.

    ``A``'s output is then a partial sum over the ranks, and so is ``B``'s (a linear map of
    it), added to the base's partial output before the one reduction of the layer.
    """

    _placements = {
        "weight": Shard(1),
        "bias": Replicate(),
        "lora_magnitude_vector": Replicate(),
        "lora_A": Shard(1),
        "lora_B": Replicate(),
    }

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            partial(_place_lora, self._placements),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def _pad_sequence(
    size: int, module: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]]:
    # Pad tokens (and document ids and positions) at the end to a multiple of the tp size, so
    # each rank holds as many tokens; _gather_output cuts the outputs back.
    if kwargs.get("rows") is not None:
        # The last layer's row-wise o_proj reduce-scatters the split sequence: every row.
        raise ValueError("tensor parallelism computes every position: no rows")
    tokens = args[0] if args else kwargs["tokens"]
    seq_len = tokens.shape[1]
    extra = -seq_len % size
    module._tensor_parallel_seq_len = seq_len
    if extra == 0:
        return args, kwargs
    if kwargs.get("mask") is not None or kwargs.get("context_parallel") is not None:
        raise ValueError("tensor parallelism pads sequences: no explicit mask, no context parallelism")  # fmt: skip
    tokens = F.pad(tokens, (0, extra))
    for key in ("document_ids", "input_pos"):
        value = kwargs.get(key)
        if value is not None:
            # Repeat the last document id; positions go on counting (the padding is never read).
            last = value[:, -1:]
            step = torch.arange(1, extra + 1, device=value.device) if key == "input_pos" else 0
            kwargs[key] = torch.cat([value, last + step], dim=1)
    return (tokens, *args[1:]), kwargs


def _gather_output(
    mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: torch.Tensor
) -> torch.Tensor:
    seq_len = module._tensor_parallel_seq_len
    if kwargs.get("return_hidden"):
        # Final hidden states, split over the sequence: gathered whole (dim wide), each rank
        # then computes its part of the vocabulary's logits from all of them. Their gradient
        # is each rank's part (a partial sum), reduce-scattered back to the sequence split.
        hidden = DTensor.from_local(output, mesh, [Shard(1)], run_check=False)
        output = hidden.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    return output[:, :seq_len]
