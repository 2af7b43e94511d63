"""RegMean and RegMean++: each linear layer merged in closed form from the Gram matrices of its inputs.

For a linear layer with weights W_p (``[out, in]``) in the q models and G_p = X_pᵀX_p / n the Gram matrix of its
inputs over the n counted positions (every real token of every sample; padding never counts), RegMean (Jin et al.,
ICLR 2023) chooses the W that minimises Σ_p α_p ‖X_p W_pᵀ − X_p Wᵀ‖², i.e.

    W* = ((Σ_p α_p G'_p)⁻¹ Σ_p α_p G'_p W_pᵀ)ᵀ,   G'_p = r·G_p + (1 − r)·diag(G_p)

with the off-diagonal entries shrunk by ``reduce_non_diagonal_ratio`` r (fusion-bench's CLIP default 0.95; r = 1 is the
plain least-squares merge, r = 0 a diagonal, per-input-feature weighted average). α is normalised (uniform by
default); fusion-bench weighs the models equally. Every other tensor (biases, norms, embeddings, heads) is the
weighted average Σ_p α_p θ_p, as fusion-bench merges them.

The data determines W* only along the input directions it spans. An input feature that is 0 at every counted position
(a dead unit) gets the weighted average's column, as the tensors no data reaches do (fusion-bench's ``torch.inverse``
fails there). With r = 1, data that spans fewer directions than a layer has inputs (fewer positions than input
features, near-identical samples) leaves the system singular: the merge warns, naming the layers (r < 1 keeps every
solve well-posed).

Where X_p comes from is the prefix: RegMean runs every model on its own forward (``own``); RegMean++ (Nguyen et al.,
TMLR 2026) feeds each model's block l the output of the *merged* blocks before it (``merged``), block by block, so each
block is solved for the inputs the merged model really gives it. The walk that records the Grams and the solve live in
:mod:`hf_mloss.engine.gram` and :mod:`hf_mloss.merging.regmean`; this module holds the parameters and the rule for
each tensor.

Each model's own data (``models=[{"model": ..., "data": ...}, ...]``) gives G_p from model p's own inputs, as the
papers and fusion-bench compute it (each G_p then the mean over its own positions); with one shared set every model's
G_p is taken on the same inputs. ``lam`` scales the merged task vector, θ₀ + λ·(θ_RegMean − θ₀), as every other
merge's λ (1: the published method; ``auto`` and label-free selection search it).

Differences from fusion-bench 0.2.33, on purpose: Grams are summed in float64 and the system is solved in float64
(fusion-bench: float32 ``inverse``), and RegMean++ averages the final norm after the last block as RegMean does
(fusion-bench's RegMean++ keeps the pretrained one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .._validation import param
from .base import MergeContext, MergeMethod, MethodParams
from .registry import register_merge_method

if TYPE_CHECKING:
    import torch

SOLUTIONS = "regmean_solutions"
"""``MergeContext.state`` key: canonical weight name → its closed-form merge, filled block by block by the walk."""


@dataclass(frozen=True)
class RegMeanParams(MethodParams):
    reduce_non_diagonal_ratio: float = param(
        0.95, "r: the Gram matrices' off-diagonal entries are multiplied by r (1: plain least squares, which needs "
        "data spanning every layer's inputs; 0: a per-input-feature weighted average). fusion-bench's CLIP default.",
        low=0.0, high=1.0)
    lam: float = param(1.0, "λ: θ = θ₀ + λ·(θ_RegMean − θ₀), the merged task vector scaled as every other merge's (1: "
                       "the published method).", low=0.0, high=100.0, low_open=True)


class RegMean(MergeMethod):
    """RegMean: every linear layer of the scored blocks in closed form from its inputs' Gram matrices (own prefix)."""

    name = "regmean"
    pretty_name = "RegMean"
    reference = "Jin et al., Dataless Knowledge Fusion by Merging Weights of Language Models, ICLR 2023"
    reference_url = "https://arxiv.org/abs/2212.09849"
    params_class = RegMeanParams
    needs_data = True
    data_use = "Gram matrices of every linear layer's inputs"
    reads_own_data: ClassVar[bool] = True
    """With each model's own data, model p's Grams come from its own data only (as the paper computes them)."""
    gram_prefix: ClassVar[str] = "own"
    """Where each block's inputs come from: every model's own forward (``own``) or the merged blocks before it."""

    def merge_tensor(self, name: str, base: torch.Tensor, sources: list[torch.Tensor], ctx: MergeContext
                     ) -> torch.Tensor:
        solved = ctx.state.get(SOLUTIONS, {}).pop(name, None)
        if solved is not None:
            return solved.to(base)
        return _average(sources, ctx)

    def chunk_keep_counts(self, numel: int, ctx: MergeContext, name: str | None = None) -> list[int] | None:
        """A large tensor no solve reached (an LLM's embedding and head) is averaged element-wise, so the driver may
        merge it in pieces, never holding q float32 copies of it; a solved linear is written whole."""
        if name is None or name in ctx.state.get(SOLUTIONS, {}):
            return None
        return []

    def merge_chunk(self, name: str, base: torch.Tensor, sources: list[torch.Tensor], ctx: MergeContext,
                    thresholds: list[float]) -> torch.Tensor:
        return _average(sources, ctx)

    def data_free_rule(self, params: MethodParams, *, short: bool = False) -> str:
        return "averaged (data-free)" if short else "the weighted average of the models"

    def describe(self, params: MethodParams) -> str:
        prefix = "each model's own forward" if self.gram_prefix == "own" else "the merged blocks before each block"
        scaled = f"; the merged task vector scaled by λ = {params.lam:g}" if params.lam != 1.0 else ""
        return (f"{self.pretty_name} ({self.reference}): every linear layer of the blocks solved from the Gram "
                f"matrices of its inputs on the unlabeled data ({prefix}), off-diagonal entries × "
                f"{params.reduce_non_diagonal_ratio:g}; every other tensor averaged{scaled}")


class RegMeanPlusPlus(RegMean):
    """RegMean++: as RegMean, each block's inputs taken from the merged blocks before it."""

    name = "regmean_plusplus"
    pretty_name = "RegMean++"
    reference = ("Nguyen et al., RegMean++: Enhancing Effectiveness and Generalization of Regression Mean for Model "
                 "Merging, TMLR 2026")
    reference_url = "https://arxiv.org/abs/2508.03121"
    gram_prefix = "merged"


def _average(sources: list[torch.Tensor], ctx: MergeContext) -> torch.Tensor:
    """Σ_p α_p θ_p, where every model holds the same value (a frozen part) that value exactly (the weighted sum
    may round it): the same bits whole or in pieces."""
    import torch

    alpha = ctx.weights / ctx.weights.sum()
    merged = sum(a * t for a, t in zip(alpha.tolist(), sources))
    same = None
    for other in sources[1:]:
        equal = other == sources[0]
        same = equal if same is None else same.logical_and_(equal)
    return merged if same is None else torch.where(same, sources[0], merged)


register_merge_method(RegMean())
register_merge_method(RegMeanPlusPlus())
