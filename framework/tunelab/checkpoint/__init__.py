"""The checkpoint subsystem; ``hf`` reads and writes Hugging Face safetensors checkpoints."""

from tunelab.checkpoint.hf import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    HFCheckpointReader,
    copy_model_files,
    parse_size,
    read_safetensors_header,
    save_hf_checkpoint,
)

__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "HFCheckpointReader",
    "copy_model_files",
    "parse_size",
    "read_safetensors_header",
    "save_hf_checkpoint",
]
