"""RAM and RAM+ (tensor-local): task vectors summed where one model changed an entry, averaged where several did.

mergekit 0.1.5's ``ram`` / ``ramplus_tl``, per tensor: an entry counts as changed by model p when ``|τ_p| > epsilon``;
``c`` models changed it. Entries one model changed take that model's delta; entries several changed take the mean of
their deltas; unchanged entries (``|τ_p| ≤ epsilon`` for all p) keep the base. RAM+ (tensor-local) scales each model's
unique entries by ``1 + r·min(ρ_p, alpha)``, ``ρ_p`` the ratio of the model's shared to unique changed entries in the
tensor (unique counts floored at ``epsilon``), to make up for what averaging takes from models that overlap a lot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._validation import param
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams

if TYPE_CHECKING:
    import torch

REFERENCE = "Reinforced Agent Merging (RAM), arXiv:2601.13572, 2026"
REFERENCE_URL = "https://arxiv.org/abs/2601.13572"


@dataclass(frozen=True)
class RamParams(MethodParams):
    epsilon: float = param(1e-5, "|τ| above this counts as a change.", low=0.0)


@dataclass(frozen=True)
class RamPlusParams(RamParams):
    r: float = param(0.1, "Scale of the boost of a model's unique entries.")
    alpha: float = param(0.2, "Cap of the shared-to-unique ratio ρ in the boost.")


class Ram(MergeMethod):
    """θ = θ₀ + Σ_p (unique τ_p ·λ_p + shared τ_p / c) per tensor; weights unused."""

    reference = REFERENCE
    reference_url = REFERENCE_URL
    zero_delta_is_base = True  # nothing changed: every entry keeps the base

    def __init__(self, name: str, plus: bool) -> None:
        self.name = name
        self.plus = plus
        self.params_class = RamPlusParams if plus else RamParams
        self.pretty_name = ("Reinforced Agent Merging Plus (tensor-local)" if plus else "Reinforced Agent Merging")

    def prepare(self, ctx: MergeContext, visit) -> None:
        from ..errors import InvalidParameterError

        if len(set(ctx.weights.tolist())) > 1:
            raise InvalidParameterError(f"{self.name} takes no weights, got {ctx.weights.tolist()}; drop the weights.")

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        return base + ram_delta(base, sources, ctx.params.epsilon,
                                boost=(ctx.params.r, ctx.params.alpha) if self.plus else None)


def ram_delta(base: torch.Tensor, sources: list[torch.Tensor], epsilon: float,
              boost: tuple[float, float] | None = None) -> torch.Tensor:
    """The merged delta; ``boost = (r, alpha)`` for RAM+ (tensor-local)."""
    import torch

    taus = torch.stack([s - base for s in sources]).view(len(sources), -1)
    changed = taus.abs() > epsilon
    counts = changed.sum(dim=0, keepdim=True)
    shared, unique = counts > 1, counts == 1
    kept = taus * changed
    unique_part = kept * unique
    if boost is not None:
        r, alpha = boost
        ratio = (changed & shared).sum(dim=1) / (changed & unique).sum(dim=1).clamp(min=epsilon)
        unique_part = unique_part * (1 + r * ratio.clamp(min=0, max=alpha)).unsqueeze(-1)
    return (unique_part + kept * shared / counts.clamp(min=1)).sum(dim=0, keepdim=True).reshape_as(base)


register_merge_method(Ram("ram", plus=False))
register_merge_method(Ram("ramplus_tl", plus=True))
