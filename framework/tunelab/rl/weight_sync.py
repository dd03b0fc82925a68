"""Weights from a trainer rank to rollout ranks: checksummed raw bytes, never pickled, bounded waits.

The transfer asynchronous GRPO's rollout ranks need after each update (the LoRA adapter, or
every weight): the sender packs the tensors into buckets of at most ``bucket_bytes``, and sends
each receiver, point to point, a JSON header (names, dtypes, shapes, each bucket's SHA-256),
then the buckets as raw bytes. A receiver checks every bucket against the header before it
builds a tensor, and answers with one acknowledgement (1: verified), so the sender knows each
receiver holds the weights. Every wait is bounded by ``timeout_s``: a receiver (or sender) that
died or stalled ends the transfer with one :class:`WeightTransferError` naming its rank, never a
silent hang (the weight-sync hangs of huggingface/trl#2923, #6796, #7103).

Nothing is unpickled: the header is JSON, the tensors' dtypes come from a fixed list.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "TransferStats",
    "WeightTransferError",
    "json_tensor",
    "receive_weights",
    "send_weights",
    "tensor_json",
]

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "uint8": torch.uint8,
}


class WeightTransferError(RuntimeError):
    """A weight transfer failed: a peer died, stalled, or sent bytes that fail their checksum.

    The message is one line naming the rank.
    """


@dataclass(frozen=True)
class TransferStats:
    """One transfer's size and time on this rank.

    Attributes:
        num_bytes: Tensor bytes sent to one receiver (or received).
        seconds: Wall time of the transfer, acknowledgements included.
    """

    num_bytes: int
    seconds: float


def json_tensor(value: Any) -> torch.Tensor:
    """``value`` as JSON text in a uint8 tensor (a message's record beside its tensors)."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def tensor_json(tensor: torch.Tensor) -> Any:
    """The value :func:`json_tensor` wrote."""
    return json.loads(tensor.numpy().tobytes())


def _digest(data: torch.Tensor) -> str:
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def _wait(work: dist.Work, timeout_s: float, what: str) -> None:
    try:
        if not work.wait(timeout=timedelta(seconds=timeout_s)):
            raise WeightTransferError(f"{what}: no answer within {timeout_s:g} s")
    except WeightTransferError:
        raise
    except RuntimeError as error:  # gloo: a closed connection, a timeout
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise WeightTransferError(
            f"{what}: dead or stalled past {timeout_s:g} s ({reason[:200]})"
        ) from None


def _isend(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup | None, tag: int) -> dist.Work:
    # A group passed in is addressed by its own ranks: it may be one made outside the
    # default group's registry (a rollout channel over every process, ``tunelab.rl.RankSplit``).
    return dist.isend(tensor, peer, tag=tag) if group is None else group.send([tensor], peer, tag)


def _irecv(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup | None, tag: int) -> dist.Work:
    return dist.irecv(tensor, peer, tag=tag) if group is None else group.recv([tensor], peer, tag)


def _pack(tensors: dict[str, torch.Tensor], bucket_bytes: int):
    entries, buckets, current, size = [], [], [], 0
    for name, tensor in tensors.items():
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if current and size + raw.numel() > bucket_bytes:
            buckets.append(torch.cat(current))
            current, size = [], 0
        entries.append(
            {
                "name": name,
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "bucket": len(buckets),
                "offset": size,
                "bytes": raw.numel(),
            }
        )
        current.append(raw)
        size += raw.numel()
    if current:
        buckets.append(torch.cat(current))
    return entries, buckets


def send_weights(
    tensors: dict[str, torch.Tensor],
    receivers: list[int],
    *,
    timeout_s: float,
    bucket_bytes: int = 64 * 2**20,
    group: dist.ProcessGroup | None = None,
    receiver_role: str = "rollout rank",
    tag: int = 0,
) -> TransferStats:
    """Send ``tensors`` (whole, any device) to every rank of ``receivers``, acknowledged.

    Args:
        tensors: Name -> tensor (for LoRA the adapter; for full fine-tuning every weight,
            gathered whole).
        receivers: Ranks (of ``group``) that call :func:`receive_weights` with this rank as
            ``sender``.
        timeout_s: Longest wait for one receiver at each stage.
        bucket_bytes: The largest bucket (a tensor larger than it gets a bucket of its own).
        group: The process group, addressed by its own ranks (None: the default one).
        receiver_role: What the error messages call a receiver.
        tag: The message stream: transfers on different tags between the same two ranks may
            run at once (from different threads), each stream in order.

    Returns:
        The bytes sent to one receiver and the seconds the whole transfer took.

    Raises:
        WeightTransferError: A receiver died, stalled past ``timeout_s``, or reported a
            checksum mismatch; the message names its rank.
    """
    start = time.perf_counter()
    entries, buckets = _pack(tensors, bucket_bytes)
    header = json.dumps(
        {
            "tensors": entries,
            "buckets": [{"bytes": b.numel(), "sha256": _digest(b)} for b in buckets],
        }
    ).encode()
    header_tensor = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    length = torch.tensor([len(header)], dtype=torch.int64)
    for rank in receivers:
        what = f"weight transfer to {receiver_role} {rank}"
        _wait(_isend(length, rank, group, tag), timeout_s, what)
        _wait(_isend(header_tensor, rank, group, tag), timeout_s, what)
        for bucket in buckets:
            _wait(_isend(bucket, rank, group, tag), timeout_s, what)
    for rank in receivers:
        answer = torch.zeros(1, dtype=torch.int64)
        _wait(_irecv(answer, rank, group, tag), timeout_s, f"{receiver_role} {rank}")
        if int(answer) != 1:
            raise WeightTransferError(
                f"{receiver_role} {rank} received weights that do not match their SHA-256"
            )
    return TransferStats(sum(b.numel() for b in buckets), time.perf_counter() - start)


def receive_weights(
    sender: int,
    *,
    timeout_s: float,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    sender_role: str = "trainer rank",
    tag: int = 0,
) -> tuple[dict[str, torch.Tensor], TransferStats]:
    """Receive the tensors :func:`send_weights` sends from ``sender``, verified.

    Args:
        sender: The sending (trainer) rank.
        timeout_s: Longest wait at each stage.
        device: Where the tensors go.
        group: The process group, addressed by its own ranks (None: the default one).
        sender_role: What the error messages call the sender.
        tag: The message stream (the sender's ``tag``).

    Returns:
        Name -> tensor, and the bytes and seconds of the transfer.

    Raises:
        WeightTransferError: The sender died or stalled, or a bucket's bytes do not match the
            header's checksum (the sender is told so); the message names the rank.
    """
    start = time.perf_counter()
    what = f"weight transfer from {sender_role} {sender}"
    length = torch.zeros(1, dtype=torch.int64)
    _wait(_irecv(length, sender, group, tag), timeout_s, what)
    header_tensor = torch.empty(int(length), dtype=torch.uint8)
    _wait(_irecv(header_tensor, sender, group, tag), timeout_s, what)
    header = json.loads(header_tensor.numpy().tobytes())
    buckets, verified = [], True
    for spec in header["buckets"]:
        bucket = torch.empty(int(spec["bytes"]), dtype=torch.uint8)
        _wait(_irecv(bucket, sender, group, tag), timeout_s, what)
        verified = verified and _digest(bucket) == spec["sha256"]
        buckets.append(bucket)
    answer = torch.tensor([1 if verified else 0], dtype=torch.int64)
    _wait(_isend(answer, sender, group, tag), timeout_s, what)
    if not verified:
        raise WeightTransferError(
            f"{what}: the bytes received do not match their SHA-256; nothing was loaded"
        )
    tensors = {}
    for entry in header["tensors"]:
        raw = buckets[entry["bucket"]][entry["offset"] : entry["offset"] + entry["bytes"]]
        dtype = _DTYPES[entry["dtype"]]
        tensors[entry["name"]] = raw.clone().view(dtype).reshape(entry["shape"]).to(device)
    return tensors, TransferStats(sum(b.numel() for b in buckets), time.perf_counter() - start)
