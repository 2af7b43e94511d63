"""M-TIES and M-DARE: TIES / DARE whose scored linears get one keep ratio per row, from the rows' node M-Loss.

Rows (nodes) are ranked by node M-Loss: rank r_i ∈ {0..n−1} in ascending order (stable on ties), ρ_i = r_i/(n−1),
and row i keeps the fraction ``k − e·ρ_i`` of each task vector's entries — the lowest-loss node keeps k, the
highest k − e. Every other tensor is trimmed per tensor at k (M-TIES) or DARE-dropped (M-DARE). The merge runs layer
by layer (see :func:`hf_mloss.merger.merge`): with ``prefix="merged"`` each block is scored on the inputs produced by
the already-merged blocks before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from ..scoring import PREFIXES, REDUCTIONS
from . import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams, check_choice, check_finite, check_fraction
from .ops import dare_drop, elect_and_merge, tensor_seed, trim_rows_, trim_tensor_

RANKS = ("mloss", "random")


def keep_ratios_from_scores(scores: torch.Tensor, k: float, e: float) -> torch.Tensor:
    """RankNorm: ``k − e·rank/(n−1)`` with ranks of ``scores`` in ascending, stable order."""
    n = scores.numel()
    order = torch.sort(scores.double(), stable=True).indices
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = torch.arange(n, dtype=torch.float64)
    rho = ranks / (n - 1) if n > 1 else torch.zeros(n, dtype=torch.float64)
    return k - e * rho  # float64: floor(n_in * keep) must not lose an entry to float32 rounding of k


def random_scores(n: int, seed: int, name: str) -> torch.Tensor:
    """Seeded random scores: the ``rank="random"`` ablation (same keep-ratio spread, no M-Loss signal)."""
    generator = torch.Generator().manual_seed(tensor_seed(seed, "random-rank", name))
    return torch.rand(n, generator=generator, dtype=torch.float64)


@dataclass(frozen=True)
class _LayerwiseParams(MethodParams):
    e: float = 0.1
    """Keep-ratio spread: rows keep between k − e (highest M-Loss) and k (lowest)."""
    lam: float = 1.0
    layers: tuple[int, ...] | None = None
    """Blocks whose scored linear gets M-Loss keep ratios (few-layer M-TIES); ``None``: all."""
    prefix: str = "merged"
    rank: str = "mloss"
    reduction: str = "abs"
    activation: str | None = None
    """Activation used in the M-Loss (default: the model's own, e.g. quick_gelu for CLIP)."""
    eps: float = 1e-4

    def _check_common(self, k: float) -> None:
        if not (isinstance(self.e, (int, float)) and 0 <= self.e < k):
            raise InvalidParameterError(f"e must satisfy 0 <= e < k (k={k}), got e={self.e!r}.")
        check_finite("lam", self.lam)
        check_choice("prefix", self.prefix, PREFIXES)
        check_choice("rank", self.rank, RANKS)
        check_choice("reduction", self.reduction, REDUCTIONS)
        check_fraction("eps", self.eps, high=1.0)
        if self.layers is not None:
            layers = tuple(self.layers)
            if not layers or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
                raise InvalidParameterError(f"layers must be a non-empty list of block indices (ints >= 0), got {self.layers!r}.")
            object.__setattr__(self, "layers", tuple(sorted(set(layers))))


@dataclass(frozen=True)
class MTiesParams(_LayerwiseParams):
    k: float = 0.2
    """Keep fraction (of the lowest-M-Loss rows and of every other tensor)."""

    def __post_init__(self) -> None:
        check_fraction("k", self.k, hint=" k is the fraction of each task vector that is KEPT.")
        self._check_common(self.k)

    @property
    def row_k(self) -> float:
        return self.k


@dataclass(frozen=True)
class MDareParams(_LayerwiseParams):
    p: float = 0.7
    """DARE keep probability of the non-scored tensors."""
    k: float | None = None
    """Keep fraction of the lowest-M-Loss rows (default: p)."""

    def __post_init__(self) -> None:
        check_fraction("p", self.p, hint=" p is the probability of KEEPING an entry.")
        if self.k is not None:
            check_fraction("k", self.k)
        self._check_common(self.row_k)

    @property
    def row_k(self) -> float:
        return self.p if self.k is None else self.k


class MTies(MergeMethod):
    """M-TIES: M-Loss-guided row-wise TIES."""

    name = "m_ties"
    pretty_name = "M-TIES"
    reference = ("M-Loss: Quantifying Model Merging Compatibility with Limited Unlabeled Data, AAAI 2026")
    reference_url = ""
    params_class = MTiesParams
    needs_data = True
    uniform_keep_is_tensor_trim = True
    """With e = 0 the scored linears are trimmed per tensor, so the control equals per-tensor TIES at k exactly."""

    def trim_other_(self, name: str, tau: torch.Tensor, index: int, ctx: MergeContext) -> torch.Tensor:
        """Trim, in place, a task vector tensor that has no M-Loss row keep ratios."""
        return trim_tensor_(tau, ctx.params.k)

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        row_keep = ctx.state.get("row_keep", {}).get(name)
        taus = torch.stack(sources).sub_(base)  # one [q, ...] buffer trimmed in place, as in TIES
        for i, tau in enumerate(taus):
            if row_keep is not None:
                trim_rows_(tau, row_keep)
            else:
                self.trim_other_(name, tau, i, ctx)
        return base + ctx.params.lam * elect_and_merge(taus, ctx.weights)


class MDare(MTies):
    """M-DARE: M-Loss row trim on the scored linears (no rescale), DARE (×1/p) on every other tensor."""

    name = "m_dare"
    pretty_name = "M-DARE"
    params_class = MDareParams
    uniform_keep_is_tensor_trim = False

    def trim_other_(self, name, tau, index, ctx: MergeContext) -> torch.Tensor:
        return tau.copy_(dare_drop(tau, ctx.params.p, ctx.generator(name, index, tau.device)))


register_merge_method(MTies())
register_merge_method(MDare())
