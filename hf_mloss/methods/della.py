"""DELLA: magnitude-ranked random drops (MagPrune), rescale, then a TIES sign consensus (``della``) or a sum.

MagPrune, per task-vector tensor, as mergekit's ``della_magprune``: entries are ranked by |τ| along axis 1 (within
each row of a linear weight; a 1-D tensor is one row), and the entry of rank r (0 = smallest) among n is kept with
probability ``p = (k − e) + 2e·r/(n − 1)``: from ``k − e`` for the smallest to ``k + e`` for the largest, mean k.
(A row of one entry is kept with probability k.) Survivors are rescaled by ``1/p`` (``inverse``, the DELLA paper:
each entry unbiased), to the tensor's L1 norm (``l1``, mergekit's ``rescale: true``) or not at all (``none``).

Masks come from the merge's private generators (one per tensor and source, derived from ``seed``), so a merge is
reproducible and independent of the order tensors are visited in. mergekit draws from the global torch generator in
its own processing order, so its masks cannot be reproduced draw for draw: the two agree in distribution (each
entry's keep probability), which the tests check on both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._validation import param
from ..errors import InvalidParameterError
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams
from .breadcrumbs import NORMALIZE_HELP, combine_task_vectors, rescale_l1

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DellaParams(MethodParams):
    k: float = param(0.5, "Mean keep probability of each entry (mergekit: density; 1 keeps the task vector whole).",
                     low=0.0, high=1.0, low_open=True, hint="k is the probability of KEEPING an entry, on average.")
    e: float = param(0.15, "Spread of the keep probabilities: from k − e (smallest |τ| of a row) to k + e (largest) "
                     "(mergekit: epsilon).", low=0.0)
    lam: float = param(1.0, "λ: θ = θ₀ + λ·τ_merged.")
    normalize: bool = param(True, NORMALIZE_HELP)
    rescale: str = param("inverse", "Survivors × 1/p (inverse: DELLA paper), L1-matched per tensor (l1: mergekit "
                         "rescale: true) or as they are (none).", choices=("inverse", "l1", "none"))

    def check(self) -> None:
        if self.k < 1 and not (self.k - self.e > 0 and self.k + self.e < 1):
            raise InvalidParameterError(
                f"k ± e must lie in (0, 1) so that every keep probability is one, got k={self.k}, e={self.e} "
                f"(probabilities {self.k - self.e:.4g} to {self.k + self.e:.4g}); lower e or move k.")


@dataclass(frozen=True)
class DellaLinearParams(DellaParams):
    normalize: bool = param(False, NORMALIZE_HELP)


def keep_probabilities(magnitude: torch.Tensor, keep: float, spread: float) -> torch.Tensor:
    """Per entry of a 2-D-or-more ``magnitude``, ``(k − e) + 2e·rank/(n − 1)`` with ranks along axis 1."""
    import torch

    n = magnitude.shape[1]
    if n == 1:
        return torch.full_like(magnitude, keep)
    order = torch.argsort(magnitude, dim=1, stable=True)  # ties ranked by position, on every kernel set
    positions = torch.arange(n, device=magnitude.device).reshape(1, n, *([1] * (magnitude.dim() - 2)))
    ranks = torch.empty_like(order).scatter_(1, order, positions.expand_as(order))
    return (keep - spread) + ranks.to(magnitude.dtype) / (n - 1) * (2 * spread)


def magprune(tau: torch.Tensor, keep: float, spread: float, generator: torch.Generator, *,
             rescale: str = "inverse") -> torch.Tensor:
    """DELLA's MagPrune of one task-vector tensor (a new tensor)."""
    import torch

    if keep >= 1:
        return tau
    rows = tau if tau.dim() >= 2 else tau.reshape(1, -1)  # a vector is one row; a 0-D tensor one entry
    probs = keep_probabilities(rows.abs(), keep, spread)
    kept_mask = torch.rand(probs.shape, generator=generator, device=tau.device) < probs
    kept = (rows * kept_mask).reshape(tau.shape)
    if rescale == "inverse":
        return kept / probs.reshape(tau.shape)
    if rescale == "l1":
        return rescale_l1(tau, kept)
    return kept


class Della(MergeMethod):
    """MagPrune then sign election + disjoint mean (``della``) or a weighted sum (``della_linear``)."""

    reference = ("Deep, Bhardwaj & Poria, DELLA-Merging: Reducing Interference in Model Merging through "
                 "Magnitude-Based Sampling, arXiv 2024")
    reference_url = "https://arxiv.org/abs/2406.11617"
    per_model_params = ("weight", "k", "e")
    zero_delta_is_base = True
    default_weight = "one"

    def __init__(self, name: str, consensus: bool) -> None:
        self.name = name
        self.consensus = consensus
        self.pretty_name = "DELLA" + (" (TIES combine)" if consensus else " (linear combine)")
        self.params_class = DellaParams if consensus else DellaLinearParams

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        params: DellaParams = ctx.params
        taus = [magprune(t - base, ctx.model_value(i, "k"), ctx.model_value(i, "e"), ctx.generator(name, i, base.device),
                         rescale=params.rescale)
                for i, t in enumerate(sources)]
        return base + combine_task_vectors(taus, ctx.weights, consensus=self.consensus, normalize=params.normalize,
                                           lam=params.lam)


register_merge_method(Della("della", consensus=True))
register_merge_method(Della("della_linear", consensus=False))
