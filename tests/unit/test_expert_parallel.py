"""Expert parallelism on 2 processes: each rank holds its experts, tokens travel by all-to-all.

A MoE block's 4 experts split 2 + 2 (``shard_experts``): each rank's expert weights are its
own slices only (shape and values), its tokens' outputs and the experts' gradients equal one
process's over all tokens, and the rows and bytes sent to the other rank are exactly the
routed (token, expert) pairs whose expert lives there: nothing padded, nothing extra. The
stacked layout and gpt-oss's (transposed, with biases) both run, and so does LoRA on the
experts, whose factors stay whole on every rank (FSDP2's in a run): their gradients, averaged
over the ranks as FSDP2 does, equal one process's. Sizes that do not divide are refused with
one line naming the numbers.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tunelab.distributed.expert_parallel import (
    expert_parallel_mesh,
    expert_traffic,
    shard_experts,
)
from tunelab.errors import ConfigError
from tunelab.modules.moe import MoEBlock
from tunelab.peft import ExpertLoRA

WORLD_SIZE = 2
NUM_EXPERTS, DIM, TOKENS = 4, 16, 11
LAYOUTS = {
    "stacked": {},
    "gpt_oss": {"layout": "gpt_oss", "bias": True, "swiglu_limit": 7.0, "router_bias": True},
    "stacked_lora": {},
}


def _block(layout: str) -> MoEBlock:
    torch.manual_seed(0)
    block = MoEBlock(DIM, 8, NUM_EXPERTS, 2, normalize_top_k=True, **LAYOUTS[layout])
    if layout.endswith("_lora"):
        for name, (in_dim, out_dim) in {"gate_up_proj": (DIM, 16), "down_proj": (8, DIM)}.items():
            block.experts.lora[name] = ExpertLoRA(NUM_EXPERTS, in_dim, out_dim, rank=4, alpha=8)
    with torch.no_grad():  # biases away from zero, so a wrong expert's bias shows
        for param in block.parameters():
            param.normal_(0.0, 0.5)
    return block


def _reference(layout: str) -> dict:
    block = _block(layout)
    x = torch.randn(WORLD_SIZE, TOKENS, DIM, generator=torch.Generator().manual_seed(1))
    x.requires_grad_(True)
    out = block(x)
    out.square().sum().backward()
    _, _, top_indices = block.route(x.detach().reshape(-1, DIM))
    return {
        "x": x.detach(),
        "x_grad": x.grad,
        "out": out.detach(),
        "top_indices": top_indices.view(WORLD_SIZE, TOKENS, -1),
        "params": {k: v.detach() for k, v in block.experts.named_parameters()},
        "grads": {k: v.grad for k, v in block.experts.named_parameters()},
    }


def _worker(rank: int, init_file: str, references: dict) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for layout, reference in references.items():
            _check_layout(rank, mesh, layout, reference)
        # Sizes that do not fit: one line naming the numbers.
        with pytest.raises(
            ConfigError, match="expert_parallel_size: 2 does not divide the model's 3 experts"
        ):
            shard_experts(MoEBlock(DIM, 8, 3, 2, normalize_top_k=True), mesh)
        with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
            shard_experts(nn.Sequential(nn.Linear(2, 2)), mesh)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check_layout(rank: int, mesh, layout: str, reference: dict) -> None:
    block = _block(layout)
    owned = shard_experts(block, mesh)
    assert owned == set(block.experts.parameters(recurse=False))
    local = NUM_EXPERTS // WORLD_SIZE
    mine = slice(rank * local, (rank + 1) * local)
    for name, param in block.experts.named_parameters(recurse=False):
        # Only this rank's experts: their shape and their values.
        assert param.to_local().shape == (local, *param.shape[1:]), name
        assert torch.equal(param.to_local(), reference["params"][name][mine]), name
    x = reference["x"][rank : rank + 1].clone().requires_grad_(True)
    out = block(x)
    torch.testing.assert_close(out, reference["out"][rank : rank + 1], rtol=0, atol=1e-6)
    # Each rank's objective scaled by the world size, as the recipes do (FSDP2 averages).
    (out.square().sum() * WORLD_SIZE).backward()
    # The input's gradient comes back through the exchanges (the router's part is local).
    torch.testing.assert_close(
        x.grad, reference["x_grad"][rank : rank + 1] * WORLD_SIZE, rtol=1e-5, atol=1e-5
    )
    for name, param in block.experts.named_parameters():
        if param in owned:
            grad = param.grad.full_tensor()
        else:  # the LoRA factors: whole on each rank, averaged as FSDP2 would
            grad = param.grad.clone()
            dist.all_reduce(grad)
            grad /= WORLD_SIZE
        torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-5, atol=1e-6)
    # The traffic: a routed pair goes out once and its output comes back once, forward,
    # and both gradients travel once in backward; rows for local experts stay here.
    owner = reference["top_indices"] // local
    mine_remote = int((owner[rank] != rank).sum())
    to_me = int((owner[1 - rank] == rank).sum())
    traffic = expert_traffic(block)
    assert traffic.rows_sent == 2 * (mine_remote + to_me) > 0
    assert traffic.bytes_sent == traffic.rows_sent * DIM * 4


@pytest.mark.slow
def test_each_rank_holds_its_experts_and_sends_exactly_the_routed_rows(tmp_path):
    references = {layout: _reference(layout) for layout in LAYOUTS}
    for reference in references.values():
        owner = reference["top_indices"] // (NUM_EXPERTS // WORLD_SIZE)
        assert (owner[0] == 1).any() and (owner[1] == 0).any()  # both ranks send something
    mp.spawn(_worker, args=(str(tmp_path / "init"), references), nprocs=WORLD_SIZE)


def test_sizes_that_do_not_divide_the_processes_are_refused_with_one_line():
    assert expert_parallel_mesh(1, torch.device("cpu"), None) is None
    with pytest.raises(ConfigError) as error:
        expert_parallel_mesh(2, torch.device("cpu"), None)
    assert str(error.value) == (
        "parallelism.expert_parallel_size: 2 does not divide the 1 processes of this run"
    )
