"""Model Breadcrumbs: drop each task vector's largest outliers and its smallest entries, then sum (or TIES-combine).

Per tensor of n entries (mergekit's ``magnitude_outliers``): of the entries sorted by |τ|, the ``floor(n·k)`` kept
are those just below the top ``floor(n·gamma)``; when fewer than ``floor(n·gamma)`` entries lie above the kept ones,
fewer outliers are dropped, so the kept count is always ``floor(n·k)``. ``k = 1`` keeps the task vector whole
(outliers included), as in mergekit.

The trimmed task vectors are then combined as mergekit's generalised task arithmetic does
(:func:`combine_task_vectors`): ``breadcrumbs`` sums ``α_p·τ_p``; ``breadcrumbs_ties`` keeps, per entry, the weighted
deltas whose sign agrees with the sign of their sum. ``normalize`` divides by the (agreeing) weights' sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._validation import param
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams

if TYPE_CHECKING:
    import torch

L1_EPS = 1e-7
"""L1 rescaling is skipped when either norm is below this (mergekit's value)."""

NORMALIZE_HELP = ("Divide the combined deltas by the sum of the weights (of the agreeing weights with a TIES "
                  "consensus).")


@dataclass(frozen=True)
class BreadcrumbsParams(MethodParams):
    k: float = param(0.9, "Fraction of each task-vector tensor KEPT (mergekit: density; 1 keeps it whole).", low=0.0,
                     high=1.0, low_open=True)
    gamma: float = param(0.01, "Fraction of each tensor's largest-magnitude entries dropped as outliers.", low=0.0,
                         high=1.0, high_open=True)
    lam: float = param(1.0, "λ: θ = θ₀ + λ·τ_merged.")
    normalize: bool = param(False, NORMALIZE_HELP)
    rescale: str = param("none", "none: survivors as they are; l1: scaled to the tensor's L1 norm (mergekit rescale).",
                         choices=("none", "l1"))


class Breadcrumbs(MergeMethod):
    """Breadcrumbs masks, then a weighted sum (``breadcrumbs``) or a TIES sign consensus (``breadcrumbs_ties``)."""

    reference = ("Davari & Belilovsky, Model Breadcrumbs: Scaling Multi-Task Model Merging with Sparse Masks, "
                 "ECCV 2024")
    reference_url = "https://arxiv.org/abs/2312.06795"
    params_class = BreadcrumbsParams
    per_model_params = ("weight", "k", "gamma")
    zero_delta_is_base = True
    default_weight = "one"

    def __init__(self, name: str, consensus: bool) -> None:
        self.name = name
        self.consensus = consensus
        self.pretty_name = "Model Breadcrumbs" + (" with TIES sign consensus" if consensus else "")

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        params: BreadcrumbsParams = ctx.params
        taus = [drop_outliers(t - base, ctx.model_value(i, "k"), ctx.model_value(i, "gamma"), rescale=params.rescale)
                for i, t in enumerate(sources)]
        return base + combine_task_vectors(taus, ctx.weights, consensus=self.consensus, normalize=params.normalize,
                                           lam=params.lam)


def breadcrumbs_keep_range(numel: int, keep: float, gamma: float) -> tuple[int, int]:
    """Ascending-magnitude positions ``[start, stop)`` a Breadcrumbs mask keeps in a tensor of ``numel`` entries."""
    kept = int(keep * numel)
    top = int(gamma * numel)
    start = max(0, numel - kept - top)
    return start, start + kept


def drop_outliers(tau: torch.Tensor, keep: float, gamma: float, *, rescale: str = "none") -> torch.Tensor:
    """The Breadcrumbs mask applied to one task-vector tensor (a new tensor)."""
    import torch

    if keep >= 1:
        return tau
    start, stop = breadcrumbs_keep_range(tau.numel(), keep, gamma)
    # A full sort, as mergekit: the kept set is a band of ranks; ties at its edges follow the sort order.
    order = torch.sort(tau.abs().reshape(-1), descending=False).indices
    mask = torch.zeros(tau.numel(), dtype=tau.dtype, device=tau.device)
    mask[order[start:stop]] = 1
    return rescale_l1(tau, tau * mask.view_as(tau)) if rescale == "l1" else tau * mask.view_as(tau)


def rescale_l1(tau: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``kept`` scaled so its L1 norm equals ``tau``'s (unchanged when either norm is below :data:`L1_EPS`)."""
    before, after = tau.abs().sum(), kept.abs().sum()
    if before < L1_EPS or after < L1_EPS:
        return kept
    return kept * (before / after)


def combine_task_vectors(taus: Sequence[torch.Tensor], weights: torch.Tensor, *, consensus: bool, normalize: bool,
                         lam: float) -> torch.Tensor:
    """mergekit's generalised task arithmetic on (sparsified) task vectors: the merged delta ``λ·Σ α_p τ_p / d``.

    With ``consensus`` only the ``α_p τ_p`` whose sign matches that of ``Σ α_p τ_p`` (≥ 0 counts as +) are summed,
    and ``d`` is the sum of their ``α_p`` (1 where none); without, ``d = Σ α_p`` (1 when ``|Σ α_p| < 1e-8``).
    ``d`` divides only when ``normalize``. Signs are taken on the weighted deltas, so a negative weight flips them.
    """
    import torch

    deltas = torch.stack(list(taus))
    alpha = weights.to(deltas).reshape(-1, *([1] * (deltas.dim() - 1)))
    deltas.mul_(alpha)
    if consensus:
        majority = (deltas.sum(dim=0) >= 0).to(deltas.dtype) * 2 - 1
        agree = deltas.sign() == majority
        mixed = (deltas * agree).sum(dim=0)
        divisor = (alpha * agree).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = deltas.sum(dim=0)
        divisor = alpha.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed /= divisor
    if lam != 1:
        mixed *= lam
    return mixed


register_merge_method(Breadcrumbs("breadcrumbs", consensus=False))
register_merge_method(Breadcrumbs("breadcrumbs_ties", consensus=True))
