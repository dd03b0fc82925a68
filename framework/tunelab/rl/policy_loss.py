"""The base of the policy-gradient losses, chosen in a config with ``loss: _component_``.

A policy loss turns one micro-batch of rollouts into token losses ``l_it`` (0 off the
completion tokens) and says how they aggregate over an optimizer step of ``N`` completions
(lengths ``|o_i|``)::

    sequence_mean (GRPO, GSPO):      L = 1/N * sum_i 1/|o_i| * sum_t l_it
    token_mean (DAPO):               L = 1/sum_i |o_i| * sum_i sum_t l_it
    constant_length (Dr. GRPO):      L = 1/(N * max_new_tokens) * sum_i sum_t l_it

The denominators span the whole step (every micro-batch, every rank), so a micro-batch
returns only its numerator (:meth:`PolicyLoss.loss_sum`) and the recipe divides by
:meth:`PolicyLoss.normalizer` of the step's global counts: the loss is then the same at any
world size and accumulation.

A new loss is one subclass in one file (see :class:`~tunelab.rl.GSPOLoss`) plus a config line
``loss: {_component_: my_module.MyLoss, ...}``: it implements :meth:`PolicyLoss.token_losses`
and sets ``beta`` (the KL weight: above 0 the recipe computes the reference's log-probs) and
``aggregation``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch

from tunelab.errors import ConfigError

__all__ = ["AGGREGATIONS", "PolicyLoss", "check_policy_loss", "k3_kl", "loss_normalizer"]

Aggregation = Literal["sequence_mean", "token_mean", "constant_length"]
AGGREGATIONS = ("sequence_mean", "token_mean", "constant_length")


def loss_normalizer(
    aggregation: Aggregation, *, num_sequences: int, num_tokens: int, max_new_tokens: int
) -> int:
    """The denominator of an aggregation, from the step's global counts (see the module doc).

    Args:
        aggregation: ``sequence_mean``, ``token_mean`` or ``constant_length``.
        num_sequences: Completions in the optimizer step, over all ranks.
        num_tokens: Their completion tokens, over all ranks.
        max_new_tokens: The generation limit (Dr. GRPO's constant length).

    Returns:
        The divisor of the summed :meth:`PolicyLoss.loss_sum` (at least 1).
    """
    if aggregation == "sequence_mean":
        return max(num_sequences, 1)
    if aggregation == "token_mean":
        return max(num_tokens, 1)
    if aggregation == "constant_length":
        return max(num_sequences * max_new_tokens, 1)
    raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of ``KL(pi || pi_ref)`` per token (GRPO, arXiv:2402.03300, eq. 4).

    ``k3_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1``: unbiased, and never negative.
    """
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


class PolicyLoss(ABC):
    """Base of the policy-gradient losses of ``grpo_distributed`` (GRPO, DAPO, Dr. GRPO, GSPO).

    Attributes:
        beta: Weight of the KL to the reference; above 0 the recipe runs the reference forward
            and passes its log-probs as ``ref_logps``.
        aggregation: How token losses aggregate over a step (see the module doc).
    """

    beta: float = 0.0
    aggregation: Aggregation = "sequence_mean"

    @abstractmethod
    def token_losses(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logps: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``l_it`` of every completion token (0 elsewhere) and the micro-batch's metric sums.

        Args:
            logps: ``[batch, tokens]`` the policy's log-probs (differentiable).
            old_logps: ``[batch, tokens]`` those of the policy that sampled (detached).
            advantages: ``[batch]``.
            mask: ``[batch, tokens]`` bool, True at the completion tokens the loss counts.
            ref_logps: ``[batch, tokens]`` the reference's; given when ``beta > 0``.

        Returns:
            ``(losses, sums)``: ``[batch, tokens]`` token losses, and detached fp64 sums over
            the completion tokens: ``clipped`` (tokens that got no gradient from the clipped
            surrogate) and, with a reference, ``kl``.
        """

    def check_reference(self, ref_logps: torch.Tensor | None) -> None:
        """Raise if ``beta > 0`` and the reference's log-probs are missing (call it first)."""
        if self.beta > 0 and ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probs")

    def loss_sum(self, losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The micro-batch's share of the numerator: divide by :meth:`normalizer`.

        ``sequence_mean`` sums each completion's mean token loss; the other two sum every
        token loss.
        """
        if self.aggregation == "sequence_mean":
            lengths = mask.sum(dim=-1).clamp(min=1)
            return (losses.sum(dim=-1) / lengths).sum()
        return losses.sum()

    def normalizer(self, *, num_sequences: int, num_tokens: int, max_new_tokens: int) -> int:
        """The step's divisor of the summed :meth:`loss_sum` (:func:`loss_normalizer`)."""
        return loss_normalizer(
            self.aggregation,
            num_sequences=num_sequences,
            num_tokens=num_tokens,
            max_new_tokens=max_new_tokens,
        )


def check_policy_loss(loss_fn: object, recipe: str) -> PolicyLoss:
    """``loss_fn`` if it is a policy loss, else one clear error naming what it is.

    Raises:
        ConfigError: If the configured ``loss`` is not a :class:`PolicyLoss`.
    """
    if not isinstance(loss_fn, PolicyLoss):
        raise ConfigError(
            f"loss: {recipe} needs a policy loss (a subclass of tunelab.rl.PolicyLoss: "
            f"tunelab.rl.GRPOLoss, tunelab.rl.GSPOLoss), got {type(loss_fn).__name__}"
        )
    return loss_fn
