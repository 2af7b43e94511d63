"""M-TIES and M-DARE: TIES / DARE whose scored linears get one keep ratio per row, from the rows' node M-Loss.

Rows (nodes) are ranked by node M-Loss: rank r_i ∈ {0..n−1} in ascending order (stable on ties), ρ_i = r_i/(n−1),
and row i keeps the fraction ``k − e·ρ_i`` of each task vector's entries — the lowest-loss node keeps k, the
highest k − e. Every other tensor is trimmed per tensor at k (M-TIES) or DARE-dropped (M-DARE). The merge runs block
by block through :class:`MTiesHooks`: with ``prefix="merged"`` each block is scored on the inputs produced by the
already-merged blocks before it (the paper's Algorithm 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._validation import param
from ..errors import InvalidParameterError
from ..options import PREFIXES, ScoringOptions
from . import register_merge_method
from .base import LayerHooks, LayerwiseRun, MergeContext, MergeMethod, MethodParams

if TYPE_CHECKING:
    import torch

RANKS = ("mloss", "random", "inverted")
KEEP_HINT = "k is the fraction of each task vector that is KEPT (mergekit: density)."


def keep_ratios_from_scores(scores: torch.Tensor, k: float, e: float) -> torch.Tensor:
    """RankNorm: ``k − e·rank/(n−1)`` with ranks of ``scores`` in ascending, stable order."""
    import torch

    n = scores.numel()
    order = torch.sort(scores.double(), stable=True).indices
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = torch.arange(n, dtype=torch.float64)
    rho = ranks / (n - 1) if n > 1 else torch.zeros(n, dtype=torch.float64)
    return k - e * rho  # float64: floor(n_in * keep) must not lose an entry to float32 rounding of k


def random_scores(n: int, seed: int, name: str) -> torch.Tensor:
    """Seeded random scores: the ``rank="random"`` ablation (same keep-ratio spread, no M-Loss signal)."""
    import torch

    from .ops import tensor_seed

    generator = torch.Generator().manual_seed(tensor_seed(seed, "random-rank", name))
    return torch.rand(n, generator=generator, dtype=torch.float64)


@dataclass(frozen=True)
class LayerwiseParams(ScoringOptions, MethodParams):
    """Parameters shared by the M-Loss-guided methods: the scoring options plus the keep-ratio spread."""

    prefix: str = param("merged", "Input of each scored linear: merged (the merged-so-far model, Algorithm 1), base "
                        "or own.", choices=PREFIXES)
    layers: tuple[int, ...] | None = param(None, "Blocks whose scored linear gets M-Loss keep ratios (few-layer "
                                           "M-TIES); default: all.", low=0)
    e: float = param(0.1, "Keep-ratio spread: rows keep between k − e (highest M-Loss) and k (lowest).", low=0.0)
    lam: float = param(1.0, "λ: θ = θ₀ + λ·τ_merged.")
    rank: str = param("mloss", "Row ranks from node M-Loss, random, or inverted (−M-Loss): the ablation "
                   "controls.", choices=RANKS)

    @property
    def row_k(self) -> float:
        raise NotImplementedError

    def check(self) -> None:
        super().check()
        if self.e >= self.row_k:
            raise InvalidParameterError(f"e must satisfy 0 <= e < k (k={self.row_k}), got e={self.e}.")


@dataclass(frozen=True)
class MTiesParams(LayerwiseParams):
    k: float = param(0.2, "Keep fraction of the lowest-M-Loss rows and of every other tensor.", low=0.0, high=1.0,
                     low_open=True, hint=KEEP_HINT)

    @property
    def row_k(self) -> float:
        return self.k


@dataclass(frozen=True)
class MDareParams(LayerwiseParams):
    p: float = param(0.7, "DARE keep probability of the non-scored tensors.", low=0.0, high=1.0, low_open=True,
                     hint="p is the probability of KEEPING an entry.")
    k: float | None = param(None, "Keep fraction of the lowest-M-Loss rows (default: p).", low=0.0, high=1.0,
                            low_open=True, hint=KEEP_HINT)

    @property
    def row_k(self) -> float:
        return self.p if self.k is None else self.k


class MTiesHooks(LayerHooks):
    """Merge stage by stage; each scored linear waits for its block's node M-Loss, which sets its row keep ratios."""

    def __init__(self, run: LayerwiseRun, uniform_keep_is_tensor_trim: bool) -> None:
        self.run = run
        self.params: LayerwiseParams = run.ctx.params
        self.scored = set(self.params.layers if self.params.layers is not None else range(run.adapter.num_layers))
        self.uniform_keep_is_tensor_trim = uniform_keep_is_tensor_trim

    def _row_weight(self, layer: int) -> str:
        return f"{self.run.adapter.target_name(layer)}.weight"

    def before_stage(self, stage: int) -> None:
        deferred = self._row_weight(stage) if stage in self.scored else None
        self.run.merge([n for n in self.run.stage_names(stage) if n != deferred])

    def after_scores(self, layer: int, scores) -> None:
        if layer not in self.scored:
            return
        name, target = self._row_weight(layer), self.run.adapter.target_name(layer)
        ctx = self.run.ctx
        node = scores.node
        ranks = random_scores(node.numel(), ctx.seed, target) if self.params.rank == "random" else node
        ranks = -node if self.params.rank == "inverted" else ranks  # control: the highest-loss node keeps k
        keep = keep_ratios_from_scores(ranks, self.params.row_k, self.params.e)
        self.run.record("keep_ratios", target, keep.float())
        # With e = 0 every row keeps k: the per-tensor trim then makes the control equal per-tensor TIES exactly.
        if self.params.e > 0 or not self.uniform_keep_is_tensor_trim:
            ctx.state.setdefault("row_keep", {})[name] = keep.to(self.run.device)
        self.run.merge([name])

    def after_all(self) -> None:
        self.run.merge_remaining()


class MTies(MergeMethod):
    """M-TIES: M-Loss-guided row-wise TIES."""

    name = "m_ties"
    pretty_name = "M-TIES"
    reference = "M-Loss: Quantifying Model Merging Compatibility with Limited Unlabeled Data, AAAI 2026"
    reference_url = ""
    params_class = MTiesParams
    zero_delta_is_base = True
    needs_data = True
    uniform_keep_is_tensor_trim = True

    def layer_hooks(self, run: LayerwiseRun) -> LayerHooks:
        return MTiesHooks(run, self.uniform_keep_is_tensor_trim)

    def trim_other_(self, name: str, tau: torch.Tensor, index: int, ctx: MergeContext) -> torch.Tensor:
        """Trim, in place, a task vector tensor that has no M-Loss row keep ratios."""
        from .ops import trim_tensor_

        return trim_tensor_(tau, ctx.params.k)

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        import torch

        from .ops import elect_and_merge, trim_rows_

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
        from .ops import dare_drop

        return tau.copy_(dare_drop(tau, ctx.params.p, ctx.generator(name, index, tau.device)))


register_merge_method(MTies())
register_merge_method(MDare())
