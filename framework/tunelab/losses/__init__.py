"""Losses: memory-lean cross-entropy for SFT, the DPO family, knowledge distillation.

The policy-gradient losses of RL (GRPO, GSPO) live in :mod:`tunelab.rl`.

See docs/losses.md for the normalisation, the formulas and the metric names.
"""

from tunelab.losses._token_logps import OutputLayer, scored_rows
from tunelab.losses.cross_entropy import CrossEntropyLoss, token_count
from tunelab.losses.distillation import (
    DistillationLoss,
    DistillationSums,
    ForwardKLLoss,
    GeneralizedJSDLoss,
    ReverseKLLoss,
    SupportLogProbs,
)
from tunelab.losses.kto import KTOLoss, UnpairedPreferenceLoss
from tunelab.losses.metrics import accumulate_metrics, preference_metrics, reduce_metrics
from tunelab.losses.orpo import ORPOLoss
from tunelab.losses.preference import DPOLoss, HingeLoss, IPOLoss, PreferenceLoss, SimPOLoss
from tunelab.losses.reward import BradleyTerryLoss, PairwiseRewardLoss
from tunelab.losses.sequence import sequence_logps, token_logps

__all__ = [
    "BradleyTerryLoss",
    "CrossEntropyLoss",
    "DPOLoss",
    "DistillationLoss",
    "DistillationSums",
    "ForwardKLLoss",
    "GeneralizedJSDLoss",
    "HingeLoss",
    "IPOLoss",
    "KTOLoss",
    "ORPOLoss",
    "OutputLayer",
    "PairwiseRewardLoss",
    "PreferenceLoss",
    "ReverseKLLoss",
    "SimPOLoss",
    "SupportLogProbs",
    "UnpairedPreferenceLoss",
    "accumulate_metrics",
    "preference_metrics",
    "reduce_metrics",
    "scored_rows",
    "sequence_logps",
    "token_count",
    "token_logps",
]
