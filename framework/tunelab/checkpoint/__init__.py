"""The checkpoint subsystem.

``CheckpointClient`` is the only object recipes use; ``hf`` and ``hf_write`` read and write Hugging
Face safetensors checkpoints; ``consolidate`` writes them from sharded state through DCP.
"""

from tunelab.checkpoint.client import CheckpointClient, LoRASpec, ResumeState
from tunelab.checkpoint.hf import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    HFCheckpointReader,
    read_safetensors_header,
)
from tunelab.checkpoint.hf_write import copy_model_files, parse_size, save_hf_checkpoint

__all__ = [
    "CheckpointClient",
    "LoRASpec",
    "ResumeState",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "HFCheckpointReader",
    "copy_model_files",
    "parse_size",
    "read_safetensors_header",
    "save_hf_checkpoint",
]
