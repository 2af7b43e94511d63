"""What a family's model outputs per sample, and how two such outputs are compared, without labels.

Label-free selection (its ``output`` and ``entropy`` criteria, the ``auto`` routing of samples to experts) and the
compatibility report's ``output_gap`` read a model only through an :class:`OutputRule`, which its adapter gives
(:meth:`hf_mloss.adapters.base.ModelAdapter.output_rule`):

* :class:`PooledFeatures` (encoders: the image towers, BERT-family encoders, the CLIP text tower): one pooled
  feature vector f(x) per sample. Discrepancy of a candidate c with a reference r: ‖f_c − f_r‖² / ‖f_r‖²; routing
  move ‖f_p − f_0‖; ensemble gap ‖f_S − Σ α_p f_p‖ over ‖Σ α_p f_p‖.
* :class:`NextTokenDistribution` (causal LMs: a ``*ForCausalLM`` checkpoint): the next-token distribution at every
  non-padding position t (it reads tokens ≤ t only). Discrepancy KL(P_r ‖ P_c) summed over the sample's real
  positions and counted per position; routing move: the mean over real positions of KL(P_p ‖ P_0); ensemble gap
  KL(Σ α_p P_p ‖ P_S) per position; entropy of P_c per position (the LM head is its own head).

Every method works on one batch (a dict of model inputs) and returns per-sample tensors, so padding never counts
and batches of any length combine: a criterion is Σ numerators / Σ denominators over the samples compared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

Batch = Mapping[str, torch.Tensor]


class OutputRule:
    """One family's per-sample outputs and their comparisons (see the module docstring)."""

    kind: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def outputs(self, model: Any, batch: Batch) -> torch.Tensor:
        """The model's outputs on one batch, float32, first dimension the samples."""
        raise NotImplementedError

    def discrepancy(self, reference: torch.Tensor, candidate: torch.Tensor, batch: Batch
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample ``(numerator, denominator)`` of the candidate's discrepancy with the reference."""
        raise NotImplementedError

    def move(self, base: torch.Tensor, other: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Per sample: how far ``other``'s output moves from the base's (routes a sample to an expert)."""
        raise NotImplementedError

    def ensemble_gap(self, members: Sequence[torch.Tensor], weights: Sequence[float], merged: torch.Tensor,
                     batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample ``(numerator, denominator)`` of the gap between the merge and the members' ensemble."""
        raise NotImplementedError

    def entropy(self, candidate: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample ``(Σ entropy, count)`` of the candidate's own distribution (rules that have one)."""
        raise NotImplementedError

    def disagreement(self, reference: torch.Tensor, candidate: torch.Tensor, batch: Batch
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample ``(Σ top-1 disagreements, count)`` of the candidate with the reference (distributions)."""
        raise NotImplementedError

    @property
    def has_distribution(self) -> bool:
        """Whether the outputs are distributions (``entropy`` without heads; heads do not apply)."""
        return False


class PooledFeatures(OutputRule):
    """One pooled feature vector per sample (``pool(model, batch) -> [batch, features]``)."""

    kind = "features"

    def __init__(self, pool: Callable[[Any, Batch], torch.Tensor], description: str) -> None:
        self.pool, self.description = pool, description

    @torch.inference_mode()
    def outputs(self, model: Any, batch: Batch) -> torch.Tensor:
        return self.pool(model, batch).float()

    def discrepancy(self, reference, candidate, batch):
        value = (candidate - reference).square().sum(-1) / reference.square().sum(-1).clamp_min(1e-12)
        return value, torch.ones_like(value)

    def move(self, base, other, batch):
        return (other - base).norm(dim=-1)

    def ensemble_gap(self, members, weights, merged, batch):
        ensemble = sum(w * f for w, f in zip(weights, members))
        return (merged - ensemble).norm(dim=-1), ensemble.norm(dim=-1)

    def entropy(self, candidate, batch):
        raise ValueError("pooled features are no distribution: the entropy needs classification heads")

    def disagreement(self, reference, candidate, batch):
        raise ValueError("pooled features have no top class: the disagreement needs classification heads")


def first_token_pool(model: Any, batch: Batch) -> torch.Tensor:
    """The model's ``pooler_output``, else its first token's last hidden state (the image towers, CLIP text)."""
    result = model(**batch)
    pooled = getattr(result, "pooler_output", None)
    return pooled if pooled is not None else result.last_hidden_state[:, 0]


def real_positions(batch: Batch, like: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` bool: the non-padding positions (all of them without an attention mask)."""
    mask = batch.get("attention_mask")
    if mask is None:
        return torch.ones(like.shape[:2], dtype=torch.bool, device=like.device)
    return mask.to(like.device).bool()


class NextTokenDistribution(OutputRule):
    """Log-probabilities of the next token at every position (``logits(model, batch) -> [batch, seq, vocab]``)."""

    kind = "next_token"

    def __init__(self, logits: Callable[[Any, Batch], torch.Tensor], description: str) -> None:
        self.logits, self.description = logits, description

    @property
    def has_distribution(self) -> bool:
        return True

    @torch.inference_mode()
    def outputs(self, model: Any, batch: Batch) -> torch.Tensor:
        return torch.log_softmax(self.logits(model, batch).float(), dim=-1)

    @staticmethod
    def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        """KL(P ‖ Q) per position, 0·log 0 = 0."""
        p = log_p.exp()
        return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)

    @staticmethod
    def _per_sample(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.where(mask, values, torch.zeros_like(values)).sum(-1), mask.sum(-1).to(values.dtype)

    def discrepancy(self, reference, candidate, batch):
        return self._per_sample(self._kl(reference, candidate), real_positions(batch, reference))

    def move(self, base, other, batch):
        total, count = self._per_sample(self._kl(other, base), real_positions(batch, base))
        return total / count.clamp_min(1)

    def ensemble_gap(self, members, weights, merged, batch):
        logw = torch.log(torch.tensor(list(weights), dtype=merged.dtype, device=merged.device))
        mixture = torch.logsumexp(torch.stack(list(members)) + logw[:, None, None, None], dim=0)
        return self._per_sample(self._kl(mixture, merged), real_positions(batch, merged))

    def entropy(self, candidate, batch):
        p = candidate.exp()
        value = -torch.where(p > 0, p * candidate, torch.zeros_like(p)).sum(-1)
        return self._per_sample(value, real_positions(batch, candidate))

    def disagreement(self, reference, candidate, batch):
        value = (reference.argmax(-1) != candidate.argmax(-1)).to(candidate.dtype)
        return self._per_sample(value, real_positions(batch, reference))
