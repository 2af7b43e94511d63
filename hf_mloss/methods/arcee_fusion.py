"""Arcee Fusion: take the other model's change only where it matters most, by a robust outlier threshold.

mergekit 0.1.5's ``arcee_fusion``, per tensor: the importance of each entry is ``|θ₁ − θ₀|`` times the KL divergence
``KL(softmax(θ₁) ‖ softmax(θ₀))`` of its row (softmax over the last axis, each probability plus 1e-8); entries whose
importance reaches ``median + 1.5·(Q3 − Q1)`` take θ₁, the others keep θ₀. The quartiles are read from the sorted
importances at index ``floor(q·(n − 1))``; above 1,000,000 entries from as many entries drawn with replacement (here
from the merge's private generator per tensor, so they are reproducible; mergekit draws from the global RNG).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidParameterError
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams

if TYPE_CHECKING:
    import torch

SAMPLE_SIZE = 1_000_000
"""Tensors with more entries have their quartiles estimated from this many sampled entries (mergekit's value)."""
PROBABILITY_EPS = 1e-8


@dataclass(frozen=True)
class ArceeFusionParams(MethodParams):
    pass


class ArceeFusion(MergeMethod):
    """θ = θ₀ + (θ₁ − θ₀)·[importance ≥ median + 1.5·IQR], per tensor; one model besides the base."""

    name = "arcee_fusion"
    pretty_name = "Arcee Fusion"
    reference = "Arcee AI, Arcee Fusion (mergekit 0.1.x)"
    reference_url = "https://arcee.ai"
    params_class = ArceeFusionParams
    accepts_models = (1, 1)

    def prepare(self, ctx: MergeContext, visit) -> None:
        if len(ctx.weights) != 1:
            raise InvalidParameterError(f"arcee_fusion takes the base and exactly one other model, got "
                                        f"{len(ctx.weights)} models.")

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        import torch

        other = sources[0]
        p = torch.softmax(other, dim=-1) + PROBABILITY_EPS
        q = torch.softmax(base, dim=-1) + PROBABILITY_EPS
        importance = (other - base).abs() * torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
        flat = importance.reshape(-1)
        if flat.numel() > SAMPLE_SIZE:
            generator = ctx.generator(name, 0, flat.device)
            flat = flat[torch.randint(flat.numel(), (SAMPLE_SIZE,), generator=generator, device=flat.device)]
        ordered = torch.sort(flat).values
        positions = (torch.tensor([0.25, 0.5, 0.75]) * (ordered.numel() - 1)).long()
        q1, median, q3 = ordered[positions]
        mask = (importance >= median + 1.5 * (q3 - q1)).float()
        return base + (other - base) * mask


register_merge_method(ArceeFusion())
