"""DARE: randomly drop task-vector entries (keep probability p), rescale, then combine (TIES-style or linearly)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .._validation import param
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams
from .svc import alpha_param, calibrate_param

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DareParams(MethodParams):
    p: float = param(0.7, "Keep probability of each entry.", low=0.0, high=1.0, low_open=True,
                     hint="p is the probability of KEEPING an entry.")
    lam: float = param(1.0, "λ: θ = θ₀ + λ·τ_merged.")
    rescale: str = param("inverse", "Survivors × 1/p (inverse: DARE paper, fusion-bench, PEFT) or L1-matched per "
                         "tensor (l1: mergekit).", choices=("inverse", "l1"))
    normalize: bool | None = param(None, "Divide by the (agreeing) weights' sum; default: on for dare_ties (the "
                                   "disjoint mean), off for dare_linear (a weighted sum). mergekit's default is off "
                                   "for both.")
    calibrate: str | None = calibrate_param()
    alpha: float | None = alpha_param(0.1)

    SVC_ALPHA: ClassVar[float] = 0.1


class Dare(MergeMethod):
    """DARE then sign election + disjoint mean (``dare_ties``, the reference) or a weighted sum (``dare_linear``)."""

    reference = ("Yu et al., Language Models are Super Mario: Absorbing Abilities from Homologous Models as a Free "
                 "Lunch, ICML 2024")
    reference_url = "https://arxiv.org/abs/2311.03099"
    params_class = DareParams
    per_model_params = ("weight", "p")
    zero_delta_is_base = True

    def __init__(self, name: str, combine: str) -> None:
        self.name = name
        self.combine = combine
        self.pretty_name = f"DARE ({'TIES' if combine == 'ties' else 'linear'} combine)"
        self.default_weight = "uniform" if combine == "ties" else "one"

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        from .breadcrumbs import combine_task_vectors
        from .ops import dare_drop, elect_and_merge

        params: DareParams = ctx.params
        taus = [dare_drop(t - base, ctx.model_value(i, "p"), ctx.generator(name, i, base.device),
                          rescale=params.rescale)
                for i, t in enumerate(sources)]
        normalize = self.combine == "ties" if params.normalize is None else params.normalize
        if self.combine == "ties":
            merged = elect_and_merge(taus, ctx.weights, divide_by="weights" if normalize else "none")
        elif normalize:
            merged = combine_task_vectors(taus, ctx.weights, consensus=False, normalize=True, lam=1.0)
        else:
            merged = sum(a * t for a, t in zip(ctx.weights.tolist(), taus))
        return base + params.lam * merged


register_merge_method(Dare("dare_ties", "ties"), aliases=("dare",))
register_merge_method(Dare("dare_linear", "linear"))
