"""Loading an HF checkpoint into an FSDP2-sharded model: each rank reads only its rows."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tunelab.checkpoint import HFCheckpointReader
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.models import (
    ModelArgs,
    TransformerDecoder,
    from_hf_config,
    load_hf_into_model,
    load_pretrained,
)

WORLD_SIZE = 2
VOCAB = 301  # odd: rank 0 holds 151 embedding rows, rank 1 holds 150


def _worker(rank: int, init_file: str, checkpoint_dir: str, reference_file: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        with torch.device("meta"):
            model = from_hf_config(checkpoint_dir)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        assert model.lm_head.weight is model.model.embed_tokens.weight
        result = load_hf_into_model(model, checkpoint_dir)
        assert result.missing == []

        embedding = model.model.embed_tokens.weight
        assert embedding.to_local().shape[0] == (151, 150)[rank]
        reader = HFCheckpointReader(checkpoint_dir)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.full_tensor(), reader.get(name), rtol=0, atol=0)
        reference = torch.load(reference_file, weights_only=True)
        with torch.no_grad():
            logits = model(reference["tokens"])
        torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)
        dist.barrier()  # tear down only once both ranks are done
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_sharded_load_matches_single_process(tmp_path):
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=VOCAB, dim=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_dim=40,
        tie_embeddings=True, family="qwen2", qkv_bias=True,
    )  # fmt: skip
    model = TransformerDecoder(args)
    adapter = model.state_dict_adapter
    checkpoint = tmp_path / "ckpt"
    save_hf_sharded(adapter.to_hf(model.state_dict()), checkpoint, max_shard_size=5000)
    (checkpoint / "config.json").write_text(json.dumps(adapter.hf_config()))
    tokens = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        logits = load_pretrained(checkpoint)(tokens)
    torch.save({"tokens": tokens, "logits": logits}, tmp_path / "reference.pt")
    mp.spawn(
        _worker,
        args=(str(tmp_path / "init"), str(checkpoint), str(tmp_path / "reference.pt")),
        nprocs=WORLD_SIZE,
        join=True,
    )
