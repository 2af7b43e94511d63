"""DARE: randomly drop task-vector entries (keep probability p), rescale, then combine (TIES-style or linearly)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams, check_choice, check_finite, check_fraction
from .ops import dare_drop, elect_and_merge


@dataclass(frozen=True)
class DareParams(MethodParams):
    p: float = 0.7
    """Keep probability of each entry (0 < p ≤ 1)."""
    lam: float = 1.0
    rescale: str = "inverse"
    """``"inverse"``: survivors × 1/p (DARE paper, fusion-bench, PEFT); ``"l1"``: match each tensor's L1 norm (mergekit)."""

    def __post_init__(self) -> None:
        check_fraction("p", self.p, hint=" p is the probability of KEEPING an entry.")
        check_finite("lam", self.lam)
        check_choice("rescale", self.rescale, ["inverse", "l1"])


class Dare(MergeMethod):
    """DARE then sign election + disjoint mean (``dare_ties``, the reference) or a weighted sum (``dare_linear``)."""

    pretty_name = "DARE"
    reference = "Yu et al., Language Models are Super Mario: Absorbing Abilities from Homologous Models as a Free Lunch, ICML 2024"
    reference_url = "https://arxiv.org/abs/2311.03099"
    params_class = DareParams

    def __init__(self, name: str, combine: str) -> None:
        self.name = name
        self.combine = combine
        self.pretty_name = f"DARE ({'TIES' if combine == 'ties' else 'linear'} combine)"
        self.default_weight = "uniform" if combine == "ties" else "one"

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        params: DareParams = ctx.params
        taus = [
            dare_drop(t - base, params.p, ctx.generator(name, i, base.device), rescale=params.rescale)
            for i, t in enumerate(sources)
        ]
        if self.combine == "ties":
            merged = elect_and_merge(taus, ctx.weights)
        else:
            merged = sum(a * t for a, t in zip(ctx.weights.tolist(), taus))
        return base + params.lam * merged


register_merge_method(Dare("dare", "ties"))
register_merge_method(Dare("dare_ties", "ties"))
register_merge_method(Dare("dare_linear", "linear"))
