"""Synthetic Hugging Face checkpoints of Llama-style models, and the recipes' model build."""

import argparse
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def llama_config(
    *,
    dim: int,
    num_layers: int,
    vocab_size: int,
    intermediate_dim: int | None = None,
    head_dim: int = 64,
    tie_embeddings: bool = False,
) -> dict[str, Any]:
    """A Llama ``config.json`` (GQA with half as many KV heads, SwiGLU of about 2.75 ``dim``)."""
    num_heads = max(1, dim // head_dim)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": intermediate_dim or 256 * math.ceil(2.75 * dim / 256),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": max(1, num_heads // 2),
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": tie_embeddings,
        "torch_dtype": "float32",
    }


def hf_shapes(config: dict[str, Any]) -> dict[str, torch.Size]:
    """The HF key -> shape map of the model ``config`` describes (built on meta, no memory)."""
    from tunelab.models import from_hf_config

    with torch.device("meta"):
        model = from_hf_config(config)
    state = model.state_dict_adapter.to_hf(dict(model.state_dict()))
    return {key: tensor.shape for key, tensor in state.items()}


def config_for_size(
    size_mb: float, *, dim: int, vocab_size: int, tie_embeddings: bool = False
) -> dict[str, Any]:
    """A Llama config whose fp32 weights take about ``size_mb`` MB (at least one layer)."""
    one = hf_shapes(llama_config(dim=dim, num_layers=1, vocab_size=vocab_size))
    two = hf_shapes(llama_config(dim=dim, num_layers=2, vocab_size=vocab_size))
    per_layer = 4 * (_numel(two) - _numel(one))
    fixed = 4 * _numel(one) - per_layer
    num_layers = max(1, round((size_mb * 1e6 - fixed) / per_layer))
    return llama_config(
        dim=dim, num_layers=num_layers, vocab_size=vocab_size, tie_embeddings=tie_embeddings
    )


def _numel(shapes: dict[str, torch.Size]) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


def write_hf_checkpoint(
    path: str | os.PathLike, config: dict[str, Any], *, max_file_bytes: int = 2 * 10**9
) -> int:
    """Write ``config.json`` and random fp32 safetensors (sharded with an index) to ``path``.

    Weights are N(0, 0.02) and norms 1, like a freshly initialised model; the values do not
    matter to any benchmark, only the shapes and bytes.

    Returns:
        The number of weight bytes written.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shapes = hf_shapes(config)
    files: list[list[str]] = [[]]
    size = 0
    for key, shape in shapes.items():
        nbytes = 4 * math.prod(shape)
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(key)
        size += nbytes
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for index, keys in enumerate(files, start=1):
        name = f"model-{index:05d}-of-{len(files):05d}.safetensors"
        tensors = {}
        for key in keys:
            if "norm" in key:
                tensors[key] = torch.ones(shapes[key])
            else:
                tensors[key] = torch.randn(shapes[key], generator=generator).mul_(0.02)
        save_file(tensors, path / name, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def build_model(checkpoint_dir: str | os.PathLike, **kwargs: Any) -> torch.nn.Module:
    """The recipes' ``build_model`` (meta build, LoRA, FSDP2, sharded load) on CPU in fp32."""
    from tunelab.training import load_model as recipe_build_model

    kwargs.setdefault("device", torch.device("cpu"))
    kwargs.setdefault("dtype", torch.float32)
    return recipe_build_model(str(checkpoint_dir), **kwargs)


def build_plain_lora_model(checkpoint_dir: str | os.PathLike, lora: Any) -> torch.nn.Module:
    """The model with LoRA adapters on every rank, never sharded (for a DDP baseline).

    Built like the recipes' ``build_model`` on one process: meta build, adapters, then the
    whole base loaded on this rank, and the adapters initialised from seed 0.
    """
    import tunelab.peft as peft
    from tunelab.models import from_hf_config, load_hf_into_model

    with torch.device("meta"):
        model = from_hf_config(str(checkpoint_dir))
        peft.apply_lora(
            model, peft.LoRAArgs(targets=lora.targets, rank=lora.rank, alpha=lora.alpha)
        )
        peft.set_trainable_params(model)
    model.to_empty(device=torch.device("cpu"))
    model.tie_weights()
    load_hf_into_model(model, str(checkpoint_dir))
    torch.manual_seed(0)
    peft.init_lora_parameters(model)
    return model


def init_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's moments with one step on zero gradients (they are saved like real ones)."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def size_parser(
    description: str, *, repeats: int = 3, full: bool = True
) -> argparse.ArgumentParser:
    """The flags every checkpoint benchmark shares: model size, width, vocabulary, repeats."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size-mb", type=float, default=256, help="fp32 (base) weight MB")
    if full:
        parser.add_argument("--full", action="store_true", help="1.1 GB of weights (the claim)")
    parser.add_argument("--dim", type=int, default=1024, help="model width")
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    return parser


SMOKE_SIZE = ("--size-mb", "8", "--dim", "128", "--vocab-size", "1024", "--repeats", "1")
"""What ``--smoke`` stands for in the checkpoint benchmarks: an 8 MB model, timed once."""


def parse_size_args(
    parser: argparse.ArgumentParser, smoke: tuple[str, ...] = SMOKE_SIZE
) -> argparse.Namespace:
    """Parse the flags; ``--full`` raises the size to the issue's 1.1 GB, ``--smoke`` (``smoke``) lowers it."""
    from _common import parse_bench_args

    args = parse_bench_args(parser, smoke)
    if getattr(args, "full", False):
        args.size_mb = max(args.size_mb, 1100)
    return args


@dataclass
class Workspace:
    """A benchmark's scratch folders and its synthetic base model."""

    root: Path
    base: Path
    out: Path
    config: dict[str, Any]
    weight_bytes: int


def prepare_workspace(args: argparse.Namespace, name: str) -> Workspace:
    """Write the synthetic HF base model for ``args`` on rank 0 (a fresh folder), then barrier."""
    from _common import barrier, is_main

    root = Path(args.dir or tempfile.gettempdir()) / name
    config = config_for_size(args.size_mb, dim=args.dim, vocab_size=args.vocab_size)
    workspace = Workspace(root, root / "base", root / "out", config, 0)
    if is_main():
        shutil.rmtree(root, ignore_errors=True)
        workspace.weight_bytes = write_hf_checkpoint(workspace.base, config)
    barrier()
    return workspace
