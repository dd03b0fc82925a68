"""Weight transfer to rollout ranks (tunelab.rl.weight_sync) on 2 real gloo processes."""

import json
from pathlib import Path

import pytest

from tests.recipes.conftest import torchrun

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "weight_sync_script.py"


def reports(mode: str) -> dict[int, dict]:
    result = torchrun(SCRIPT, mode)
    lines = [line for line in result.stdout.splitlines() if line.startswith("SYNC ")]
    found = {r["rank"]: r for r in (json.loads(line.removeprefix("SYNC ")) for line in lines)}
    assert found, result.stdout + result.stderr
    return found


def test_verified_transfer_checksum_mismatch_and_stalled_receiver():
    found = reports("transfers")
    sender, receiver = found[0], found[1]
    # fp32 4x16 + bf16 16x4 + int64 x5, in 100-byte buckets, equal on arrival, dtypes kept.
    assert receiver["equal"] is True
    assert sender["sent_bytes"] == receiver["received_bytes"] == 4 * 16 * 4 + 16 * 4 * 2 + 5 * 8
    # Wrong checksums: the receiver loads nothing and says so; the sender names the receiver.
    assert sender["corrupt"] == "rollout rank 1 received weights that do not match their SHA-256"
    assert receiver["corrupt"].startswith("weight transfer from trainer rank 0: the bytes")
    # A receiver that stops receiving: one line naming it, after the 3 s timeout, no hang.
    assert sender["stall"].startswith("weight transfer to rollout rank 1: dead or stalled past 3 s")
    assert "\n" not in sender["stall"]
    assert 2.5 < sender["stall_seconds"] < 30


def test_a_dead_receiver_is_named():
    sender = reports("dead")[0]
    assert sender["dead"].startswith("weight transfer to rollout rank 1: dead or stalled past 3 s")
    assert "\n" not in sender["dead"]
    assert sender["dead_seconds"] < 30


def test_the_policy_in_pieces_from_two_trainers_is_the_whole_policy():
    # policy_transfer_script.py: 2 trainers (sharded weights, uneven and empty shards, one
    # tensor kept whole) + 1 rollout rank, pieces sent in the background beside a request.
    result = torchrun(Path(__file__).parent / "policy_transfer_script.py", nproc=3)
    lines = [line for line in result.stdout.splitlines() if line.startswith("PIECES ")]
    found = {r["rank"]: r for r in (json.loads(line.removeprefix("PIECES ")) for line in lines)}
    assert sorted(found) == [0, 1, 2], result.stdout + result.stderr
    # Trainer 0: rows 0-2 of the 5, the 1-row tensor, the whole one; trainer 1: rows 3-4 only.
    assert found[0]["pieces"] == {
        "layers.0.lora_a": [0, 0], "layers.0.lora_b": [0, 0], "norm.weight": [0]
    }  # fmt: skip
    assert found[1]["pieces"] == {"layers.0.lora_a": [3, 0]}
    rollout = found[2]
    assert rollout["requests"] == [0, 1]  # the request stream, while the pieces were in flight
    assert rollout["step"] == 7 and rollout["equal"] is True
    assert rollout["second"] == (
        "rollout rank 2: the trainers' policy pieces do not fit together (policy steps [8], "
        "incomplete tensors ['layers.0.lora_a'])"
    )
    assert found[0]["second"] is None and found[1]["second"] is None
