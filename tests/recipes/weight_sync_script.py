"""2 processes: rank 0 sends weights to rank 1 (tunelab.rl.weight_sync); prints one JSON line each.

``argv[1]``: ``transfers`` (a verified transfer in several buckets, then one with wrong
checksums, then rank 1 stalling past the timeout) or ``dead`` (rank 1 exits before receiving).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from tunelab.rl import weight_sync
from tunelab.rl.weight_sync import WeightTransferError, receive_weights, send_weights

TIMEOUT_S = 3.0


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "lora_a": torch.randn(4, 16, generator=generator),
        "lora_b": torch.randn(16, 4, generator=generator).to(torch.bfloat16),
        "count": torch.arange(5),
    }


def attempt(action) -> str | None:
    try:
        action()
    except WeightTransferError as error:
        return str(error)
    return None


def main() -> None:
    dist.init_process_group("gloo")
    rank, mode, report = dist.get_rank(), sys.argv[1], {}
    if mode == "transfers":
        if rank == 0:
            stats = send_weights(weights(), [1], timeout_s=TIMEOUT_S, bucket_bytes=100)
            report["sent_bytes"] = stats.num_bytes
            real = weight_sync._digest
            weight_sync._digest = lambda data: "0" * 64  # a header whose checksums are wrong
            report["corrupt"] = attempt(lambda: send_weights(weights(), [1], timeout_s=TIMEOUT_S))
            weight_sync._digest = real
            start = time.perf_counter()
            report["stall"] = attempt(lambda: send_weights(weights(), [1], timeout_s=TIMEOUT_S))
            report["stall_seconds"] = time.perf_counter() - start
        else:
            received, stats = receive_weights(0, timeout_s=TIMEOUT_S)
            expected = weights()
            report["equal"] = received.keys() == expected.keys() and all(
                received[k].dtype == v.dtype and torch.equal(received[k], v)
                for k, v in expected.items()
            )
            report["received_bytes"] = stats.num_bytes
            report["corrupt"] = attempt(lambda: receive_weights(0, timeout_s=TIMEOUT_S))
            time.sleep(4 * TIMEOUT_S)  # stalled: the third transfer finds nobody receiving
    elif mode == "dead":
        if rank == 1:
            os._exit(0)
        start = time.perf_counter()
        report["dead"] = attempt(lambda: send_weights(weights(), [1], timeout_s=TIMEOUT_S))
        report["dead_seconds"] = time.perf_counter() - start
    print("SYNC " + json.dumps({"rank": rank, **report}), flush=True)
    os._exit(0)  # the broken pair would make a teardown wait


if __name__ == "__main__":
    main()
