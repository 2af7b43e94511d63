"""SCE (Select, Calculate, Erase): keep the entries where the fine-tunes disagree most, weight each task vector by its
energy, and average the deltas that agree with the elected sign.

Per tensor, with task vectors τ_p = θ_p − θ₀ (as mergekit 0.1.5 computes it):

* **Select** (``select_topk`` < 1): the variance over the models of each entry (population variance); the
  ``floor(c·select_topk)`` entries of largest variance are kept in every τ_p, ``c`` the number of entries whose
  variance is not 0 (``select_topk`` ≤ 0 keeps none, ≥ 1 all);
* **Calculate**: model p's weight is the mean of its (selected) τ_p², divided by the sum over the models (uniform when
  that sum is below 1e-6);
* **Erase**: the sign of Σ_p τ_p is elected (0 counts as +); deltas of the other sign (and zeros) are dropped, and the
  merged delta is Σ w_p m_p τ_p / max(Σ w_p m_p, 1e-6).

The merge is θ₀ + that delta. The models' merging weights are not used: SCE computes its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._validation import param
from ..errors import InvalidParameterError
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams

if TYPE_CHECKING:
    import torch

UNIFORM_BELOW = 1e-6
"""A total task-vector energy below this gives every model the same weight (mergekit's value)."""
DIVISOR_FLOOR = 1e-6
"""The erased weights' sum is floored here (mergekit's value): an entry nobody agrees on merges to 0."""


@dataclass(frozen=True)
class SceParams(MethodParams):
    select_topk: float = param(1.0, "Fraction of the entries (of those whose variance over the models is not 0) "
                               "kept: those where the task vectors vary most (1 keeps every entry).", low=0.0,
                               high=1.0)


class Sce(MergeMethod):
    """θ = θ₀ + erase(calculate(select(τ_1, …, τ_q))) per tensor; weights unused."""

    name = "sce"
    pretty_name = "SCE (select, calculate, erase)"
    reference = "Wan et al., FuseChat: Knowledge Fusion of Chat Models, arXiv:2408.07990, 2024"
    reference_url = "https://arxiv.org/abs/2408.07990"
    params_class = SceParams
    zero_delta_is_base = True  # all τ 0: no entry agrees with +, so the delta is 0 / 1e-6 = 0

    def prepare(self, ctx: MergeContext, visit) -> None:
        if len(set(ctx.weights.tolist())) > 1:
            raise InvalidParameterError(f"sce takes no weights (it weights each task vector by its energy), got "
                                        f"{ctx.weights.tolist()}; drop the weights.")

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        import torch

        return base + sce_delta(torch.stack([s - base for s in sources]), ctx.params.select_topk)


def select_mask(taus: torch.Tensor, keep: float) -> torch.Tensor:
    """1 where an entry is among the ``floor(c·keep)`` of largest variance over the models (c: non-zero variances)."""
    import torch

    if keep <= 0:
        return torch.zeros_like(taus[0])
    if keep >= 1:
        return torch.ones_like(taus[0])
    variance = torch.var(taus, dim=0, unbiased=False)
    count = int(int(torch.count_nonzero(variance)) * keep)
    mask = torch.zeros_like(variance)
    if count:
        mask.view(-1)[torch.topk(variance.abs().view(-1), k=count, largest=True).indices] = 1
    return mask


def energy_weights(taus: torch.Tensor) -> torch.Tensor:
    """Each task vector's mean square over the sum of them (uniform when the sum is below :data:`UNIFORM_BELOW`)."""
    import torch

    energy = taus.square().reshape(taus.shape[0], -1).mean(dim=1)
    total = torch.sum(energy).item()
    if abs(total) < UNIFORM_BELOW:
        return torch.ones_like(energy) / energy.shape[0]
    return energy / total


def sce_delta(taus: torch.Tensor, select_topk: float) -> torch.Tensor:
    """The merged delta of stacked task vectors ``[q, ...]``."""
    import torch

    if select_topk < 1:
        taus = taus * select_mask(taus, select_topk).unsqueeze(0)
    elected = (taus.sum(dim=0) >= 0).to(taus.dtype) * 2 - 1
    agree = (taus.sign() == elected).to(taus.dtype)
    weights = energy_weights(taus).reshape(-1, *([1] * (taus.dim() - 1)))
    erased = weights * agree
    return (taus * erased).sum(dim=0) / torch.sum(erased, dim=0).clamp(min=DIVISOR_FLOOR)


register_merge_method(Sce())
