"""The resumable training state that is not model or optimizer tensors.

Training progress, the LR scheduler, the optimizer's hyper-parameters and every rank's RNG
states go into one small JSON file beside the DCP shards, so resuming never unpickles them.
"""

import base64
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tunelab._rng import rng_state, set_rng_state
from tunelab.errors import CheckpointError
from tunelab.formats.integrity import open_regular

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


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad_number(value: Any, where: str) -> str | None:
    """The first number under ``value`` that no progress record holds: negative or not finite."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    if isinstance(value, int):
        return None if value >= 0 else f"{where} is {value}"
    if isinstance(value, float):
        return None if math.isfinite(value) and value >= 0 else f"{where} is {value}"
    if isinstance(value, Mapping):
        for key, item in value.items():
            problem = _bad_number(item, f"{where}.{key}")
            if problem:
                return problem
        return None
    if isinstance(value, list):
        for index, item in enumerate(value):
            problem = _bad_number(item, f"{where}[{index}]")
            if problem:
                return problem
        return None
    return f"{where} is not JSON data"


def trainer_state_problem(path: Path, step: int) -> str | None:
    """What is wrong with a checkpoint's ``trainer_state.json``, or None when it can be used.

    Its checksum says the file is what was written; this says what was written is a trainer
    state tunelab could have written, before a field is used (a ``step`` of -7 would have the
    metrics log purged of every record): ``step`` equal to the folder's step, ``epoch`` a
    non-negative integer, ``progress`` an object whose numbers are finite and non-negative,
    ``optimizer_param_groups`` a list of objects, ``lr_scheduler`` an object or null, ``rng``
    a list of objects.

    Args:
        path: The file.
        step: The step of the folder it is in (``step_N``).

    Returns:
        One phrase starting with the path, or None.
    """
    try:
        with open_regular(path) as file:
            state = json.loads(file.read())
    except FileNotFoundError:
        return f"{path} is missing"
    except (CheckpointError, OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        return f"{path}: unreadable ({error})"
    if not isinstance(state, dict):
        return f"{path}: not a JSON object"
    if state.get("step") != step or not _count(state.get("step")):
        return f"{path}: step {state.get('step')!r} is not the folder's step {step}"
    if not _count(state.get("epoch")):
        return f"{path}: epoch {state.get('epoch')!r} is not a non-negative integer"
    progress = state.get("progress")
    if not isinstance(progress, dict):
        return f"{path}: progress is not an object"
    problem = _bad_number(progress, "progress")
    if problem:
        return f"{path}: {problem}, not a position a run reaches"
    groups = state.get("optimizer_param_groups")
    if not (isinstance(groups, list) and all(isinstance(group, dict) for group in groups)):
        return f"{path}: optimizer_param_groups is not a list of objects"
    if not (state.get("lr_scheduler") is None or isinstance(state.get("lr_scheduler"), dict)):
        return f"{path}: lr_scheduler is neither an object nor null"
    rng = state.get("rng")
    if not (isinstance(rng, list) and all(isinstance(item, dict) for item in rng)):
        return f"{path}: rng is not a list of objects"
    return None


def to_json(state: dict[str, Any]) -> bytes:
    """Serialise trainer state, turning tuples into lists."""
    return json.dumps(state, indent=1, default=_json_default).encode()


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple | set):
        return list(value)
    raise TypeError(f"cannot store {type(value).__name__} in {TRAINER_STATE_NAME}")
