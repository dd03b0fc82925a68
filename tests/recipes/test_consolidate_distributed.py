"""HFSafetensorsWriter on 2 real processes (gloo) over FSDP2-style sharded DTensors.

The pytest side launches this same file under ``torch.distributed.run`` with 2 processes; the
workers write three exports, and the pytest side checks every file against the full tensors
and loads the tiny Llama export in ``transformers``. The tiny Llama's weights reach the workers
as a file (LLAMA_WEIGHTS, written by the pytest side): the workers need no ``transformers``.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

TENSOR_MAPPING = {
    "a.weight": "model-00001-of-00003.safetensors",
    "b.weight": "model-00003-of-00003.safetensors",
    "c.weight": "model-00002-of-00003.safetensors",
    "d.bias": "model-00001-of-00003.safetensors",
    "e.replicated": "model-00003-of-00003.safetensors",
    "f.counts": "model-00002-of-00003.safetensors",
    "g.scale": "model-00001-of-00003.safetensors",
}


def full_tensors():
    """The same full tensors on every process (fixed seed)."""
    generator = torch.Generator().manual_seed(1234)
    return {
        "a.weight": torch.randn(5, 3, generator=generator),  # uneven: 3 + 2 rows
        "b.weight": torch.randn(1, 4, generator=generator),  # rank 1 holds no rows
        "c.weight": torch.randn(4, 6, generator=generator).bfloat16(),  # Shard(1): 6 runs
        "d.bias": torch.randn(7, generator=generator),  # plain tensor, written once
        "e.replicated": torch.arange(3, dtype=torch.int64),  # Replicate() DTensor
        "f.counts": torch.arange(15, dtype=torch.int32).reshape(3, 5),  # Shard(1), uneven cols
        "g.scale": torch.tensor(0.5),  # plain scalar
    }


LLAMA_WEIGHTS = "tiny_llama.safetensors"
"""The file in the run's folder that holds :func:`tiny_llama`'s weights for the workers."""


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from tunelab.checkpoint.hf_sharded import save_hf_sharded

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    placements = {"c.weight": [Shard(1)], "f.counts": [Shard(1)], "e.replicated": [Replicate()]}
    state = {}
    for key, tensor in full_tensors().items():
        if key in ("d.bias", "g.scale"):
            state[key] = tensor
        else:
            state[key] = distribute_tensor(tensor, mesh, placements.get(key, [Shard(0)]))
    assert state["b.weight"].to_local().shape[0] == (1 if dist.get_rank() == 0 else 0)
    save_hf_sharded(state, out / "greedy", max_shard_size=64)
    save_hf_sharded(state, out / "mapped", fqn_to_file=TENSOR_MAPPING, thread_count=2)

    sharded = {
        key: distribute_tensor(value, mesh, [Shard(0)])
        for key, value in load_file(out / LLAMA_WEIGHTS).items()
    }
    mapping = {
        key: "model-00002-of-00002.safetensors"
        if key.startswith(("model.layers.1", "lm_head"))
        else "model-00001-of-00002.safetensors"
        for key in sharded
    }
    save_hf_sharded(sharded, out / "llama", fqn_to_file=mapping)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_export(folder: Path, expected: dict, expected_map: dict | None = None) -> dict:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in expected.values()
    )
    assert set(index["weight_map"]) == set(expected)
    if expected_map is not None:
        assert index["weight_map"] == expected_map
    names = sorted(set(index["weight_map"].values()))
    assert sorted(p.name for p in folder.glob("*.safetensors")) == names
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]
    for name in names:
        tensors = load_file(folder / name)
        assert set(tensors) == {k for k, v in index["weight_map"].items() if v == name}
        with safe_open(folder / name, framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
        for key, tensor in tensors.items():
            assert tensor.dtype == expected[key].dtype, key
            assert torch.equal(tensor, expected[key]), key
    return index


@pytest.mark.slow
def test_two_process_exports_equal_full_tensors_and_load_in_transformers(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    reference = tiny_llama()
    save_file(reference.state_dict(), tmp_path / LLAMA_WEIGHTS)
    env = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master-port", str(_free_port()), __file__, str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    expected = full_tensors()
    greedy = _check_export(tmp_path / "greedy", expected)
    assert len(set(greedy["weight_map"].values())) > 1
    _check_export(tmp_path / "mapped", expected, TENSOR_MAPPING)

    _check_export(tmp_path / "llama", reference.state_dict())
    # copy_model_files(source_dir, ...) is not under test here: write the config directly.
    reference.config.save_pretrained(tmp_path / "llama")
    loaded, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "llama", output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    tokens = torch.tensor([[1, 5, 9, 33, 2, 60]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(tokens).logits, reference(tokens).logits)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
