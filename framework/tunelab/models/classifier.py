"""Sequence classification (reward models): the decoder with a scalar head on its last token.

The layout is transformers' ``*ForSequenceClassification``: the decoder body under ``model.``,
no ``lm_head``, and a bias-free ``score`` linear from the hidden size to ``num_labels``
(here 1, a reward). The score of a sequence is the head's output at its last token that is not
padding; as transformers finds it, that is the rightmost position whose token is not
``pad_token_id``, so the scores equal transformers' on the same rows.
"""

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tunelab.models.args import ModelArgs
from tunelab.models.decoder import TransformerDecoder

SCORE_HEAD = "score"
"""The head's module name, as transformers and PEFT's ``modules_to_save`` call it."""


class SequenceClassifier(TransformerDecoder):
    """A decoder whose output layer is the ``score`` head: ``[batch, seq, num_labels]``.

    Args:
        args: The decoder's arguments.
        num_labels: Outputs of the head (1: a scalar reward).
    """

    peft_task_type = "SEQ_CLS"
    modules_to_save = (SCORE_HEAD,)

    def __init__(self, args: ModelArgs, num_labels: int = 1) -> None:
        super().__init__(args)
        del self.lm_head
        self.score = nn.Linear(args.dim, num_labels, bias=False)
        self.num_labels = num_labels
        self.pad_token_id: int | None = None

    def tie_weights(self) -> None:
        """Nothing to tie: the head is not the embedding."""

    def output(self, h: torch.Tensor) -> torch.Tensor:
        """The head's scores of final-normed hidden states (no soft-cap, as transformers)."""
        return self.score(h)

    def hf_config_updates(self) -> dict[str, Any]:
        """What a ``config.json`` of the causal model changes to describe this one.

        Raises:
            ValueError: If ``pad_token_id`` is unset (transformers needs it to find the last
                token of padded rows).
        """
        if self.pad_token_id is None:
            raise ValueError("SequenceClassifier.pad_token_id is unset; set the tokenizer's pad id")
        labels = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
        return {
            "architectures": [self.state_dict_adapter.classifier_architecture],
            "num_labels": self.num_labels,
            "id2label": labels,
            "label2id": {name: int(i) for i, name in labels.items()},
            "pad_token_id": self.pad_token_id,
        }


def last_token_index(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Each row's rightmost position whose token is not ``pad_id`` (0 for an all-pad row).

    The rule of transformers' sequence classifiers, so that scores agree with theirs.

    Args:
        tokens: ``[batch, seq]`` token ids.
        pad_id: The padding id.

    Returns:
        ``[batch]`` long positions.
    """
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return ((tokens != pad_id) * positions).argmax(dim=-1)


def sequence_scores(model: nn.Module, tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """One forward of a :class:`SequenceClassifier` and each row's score at its last token.

    Args:
        model: The classifier (sharded or not).
        tokens: ``[batch, seq]`` right-padded rows.
        pad_id: The padding id.

    Returns:
        ``[batch]`` scores (the first label's), in the model's dtype, with grad if enabled.
    """
    scores = model(tokens)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    return scores[rows, last_token_index(tokens, pad_id), 0]


@torch.no_grad()
def init_score_head(model: SequenceClassifier, std: float, seed: int) -> None:
    """Fill a fresh ``score`` head from ``N(0, std)``, the same values at any world size.

    The whole (small) weight is drawn from its own generator on every rank, and each rank
    keeps its rows of it, so nothing is communicated and the global RNG is left as it was.
    """
    weight = model.score.weight
    generator = torch.Generator().manual_seed(seed)
    full = torch.empty(weight.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    full = full.to(device=weight.device, dtype=weight.dtype)
    if isinstance(weight, DTensor):
        local = distribute_tensor(full, weight.device_mesh, weight.placements, src_data_rank=None)
        weight.to_local().copy_(local.to_local())
    else:
        weight.copy_(full)
