"""The checkpoint subsystem.

``CheckpointClient`` is the only object recipes use; ``hf`` and ``hf_write`` read and write Hugging
Face safetensors checkpoints; ``consolidate`` writes them from sharded state through DCP;
``integrity`` checksums and verifies what they write.

Names are imported on first use, so ``tunelab.formats.integrity`` and ``layout`` (which
need no torch) load without torch: ``tunelab verify`` starts fast.
"""

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointClient": "tunelab.checkpoint.client",
    "ResumeState": "tunelab.checkpoint.client",
    "SAFE_WEIGHTS_INDEX_NAME": "tunelab.formats.hf",
    "SAFE_WEIGHTS_NAME": "tunelab.formats.hf",
    "HFCheckpointReader": "tunelab.formats.hf",
    "read_safetensors_header": "tunelab.formats.hf",
    "copy_model_files": "tunelab.checkpoint.hf_write",
    "parse_size": "tunelab.checkpoint.hf_write",
    "verify_folder": "tunelab.formats.integrity",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tunelab.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
