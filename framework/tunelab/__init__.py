"""tunelab: PyTorch-native fine-tuning for decoder LLMs.

The public API is each package's ``__all__`` (``tunelab.config``, ``tunelab.training``, ...;
see docs/api.md). This root module exports the error family and nothing that needs torch, so
``import tunelab.config`` stays fast.
"""

from tunelab._library_noise import silence_known_library_noise
from tunelab._process_exit import freeze_heap_at_exit
from tunelab.errors import CheckpointError, ConfigError, DataError, TrainingError, TunelabError

# First thing, before any library is imported: torchao reads its switch at import time.
silence_known_library_noise()
# A process that imported torch exits about 0.5 CPU-seconds sooner (tunelab._process_exit).
freeze_heap_at_exit()

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "TrainingError",
    "TunelabError",
    "__version__",
]
