"""3 processes split as 2 trainers + 1 rollout rank: the policy sent in pieces (policy_transfer).

The trainers hold sharded weights (DTensor ``Shard(0)`` over their own mesh: uneven rows, and a
1-row tensor whose second shard is empty) and one tensor each keeps whole. Each sends its
pieces in the background while its main thread exchanges a message with the rollout rank on
the request stream; the rollout rank takes that message first, then the policy, and checks it
equals the whole tensors byte for byte. A second policy whose trainer 1 leaves out its piece
of one tensor is refused in one line. Prints one JSON line per rank.
"""

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tunelab.rl import policy_transfer, weight_sync
from tunelab.rl.rank_split import split_ranks

TIMEOUT_S = 20.0


def whole() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "layers.0.lora_a": torch.randn(5, 3, generator=generator),
        "layers.0.lora_b": torch.randn(1, 4, generator=generator).to(torch.bfloat16),
        "norm.weight": torch.randn(6, generator=generator),
    }


def attempt(action) -> str | None:
    try:
        action()
    except weight_sync.WeightTransferError as error:
        return str(error)
    return None


def main() -> None:
    split = split_ranks(1, timeout_s=TIMEOUT_S)
    report: dict = {"rank": split.rank}
    if not split.is_rollout:
        dist.init_process_group(
            "gloo", store=split.trainer_store, rank=split.rank, world_size=split.num_trainers
        )
        mesh = init_device_mesh("cpu", (split.num_trainers,))
        trainable = {
            name: value if name == "norm.weight" else distribute_tensor(value, mesh, [Shard(0)])
            for name, value in whole().items()
        }
        sender = policy_transfer.PolicySender(
            trainable, split.rank, [2], timeout_s=TIMEOUT_S, group=split.channel
        )
        report["pieces"] = {name: piece.offsets for name, piece in sender.pieces.items()}
        sender.send(7)
        # Meanwhile, on the request stream (tag 0): the rollout rank takes it first.
        weight_sync.send_weights(
            {"request": weight_sync.json_tensor({"from": split.rank})},
            [2],
            timeout_s=TIMEOUT_S,
            group=split.channel,
        )
        sender.wait()
        if split.rank == 1:
            del sender.pieces["layers.0.lora_a"]
        sender.send(8)
        report["second"] = attempt(sender.wait)
    else:
        parameters = {name: torch.zeros_like(value) for name, value in whole().items()}
        for value in parameters.values():
            value.requires_grad_(True)
        report["requests"] = [
            weight_sync.tensor_json(
                weight_sync.receive_weights(t, timeout_s=TIMEOUT_S, group=split.channel)[0][
                    "request"
                ]
            )["from"]
            for t in range(2)
        ]
        step, _ = policy_transfer.receive_policy(
            2, parameters, rank=split.rank, timeout_s=TIMEOUT_S, group=split.channel
        )
        report["step"] = step
        report["equal"] = all(
            parameters[name].dtype == value.dtype and torch.equal(parameters[name].detach(), value)
            for name, value in whole().items()
        )
        report["second"] = attempt(
            lambda: policy_transfer.receive_policy(
                2, parameters, rank=split.rank, timeout_s=TIMEOUT_S, group=split.channel
            )
        )
    print("PIECES " + json.dumps(report), flush=True)
    os._exit(0)  # no teardown: the trainers' default group and the channel simply end


if __name__ == "__main__":
    main()
