"""tunelab: PyTorch-native fine-tuning for decoder LLMs."""

from tunelab.errors import TunelabError

__version__ = "0.1.0"

__all__ = ["TunelabError", "__version__"]
