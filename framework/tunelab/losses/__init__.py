"""Losses: memory-lean cross-entropy for SFT and the DPO family for preference tuning.

See docs/losses.md for the normalisation, the formulas and the metric names.
"""

from tunelab.losses._token_logps import OutputLayer
from tunelab.losses.cross_entropy import CrossEntropyLoss, token_count
from tunelab.losses.metrics import accumulate_metrics, preference_metrics, reduce_metrics
from tunelab.losses.preference import DPOLoss, HingeLoss, IPOLoss, PreferenceLoss, SimPOLoss
from tunelab.losses.sequence import sequence_logps

__all__ = [
    "CrossEntropyLoss",
    "DPOLoss",
    "HingeLoss",
    "IPOLoss",
    "OutputLayer",
    "PreferenceLoss",
    "SimPOLoss",
    "accumulate_metrics",
    "preference_metrics",
    "reduce_metrics",
    "sequence_logps",
    "token_count",
]
