"""The resumable training state that is not model or optimizer tensors.

Training progress, the LR scheduler, the optimizer's hyper-parameters and every rank's RNG
states go into one small JSON file beside the DCP shards, so resuming never unpickles them.
"""

import base64
import json
from typing import Any

import torch
import torch.distributed as dist

from tunelab._rng import rng_state, set_rng_state

TRAINER_STATE_NAME = "trainer_state.json"


def _encode_rng(state: dict[str, Any]) -> dict[str, Any]:
    encoded = {"python": list(state["python"][1]), "python_version": state["python"][0]}
    encoded["python_gauss"] = state["python"][2]
    encoded["torch"] = base64.b64encode(state["torch"].numpy().tobytes()).decode()
    if "cuda" in state:
        encoded["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in state["cuda"]]
    return encoded


def _decode_rng(encoded: dict[str, Any]) -> dict[str, Any]:
    def to_tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()

    state: dict[str, Any] = {
        "python": (encoded["python_version"], encoded["python"], encoded["python_gauss"]),
        "torch": to_tensor(encoded["torch"]),
    }
    if "cuda" in encoded:
        state["cuda"] = [to_tensor(text) for text in encoded["cuda"]]
    return state


def gather_rng_states() -> list[dict[str, Any]]:
    """Return every rank's encoded RNG states, in rank order (a collective)."""
    local = _encode_rng(rng_state())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [local]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def restore_rng_states(states: list[dict[str, Any]]) -> bool:
    """Restore this rank's RNG states when the world size is unchanged.

    Returns:
        Whether they were restored. At another world size ranks do not map one to one;
        data order does not depend on them (the sampler is seeded per epoch), only
        dropout draws do.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if len(states) != world_size:
        return False
    set_rng_state(_decode_rng(states[rank]))
    return True


def to_json(state: dict[str, Any]) -> bytes:
    """Serialise trainer state, turning tuples into lists."""
    return json.dumps(state, indent=1, default=_json_default).encode()


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple | set):
        return list(value)
    raise TypeError(f"cannot store {type(value).__name__} in {TRAINER_STATE_NAME}")
