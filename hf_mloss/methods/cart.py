"""CART (Centered Arithmetic with Rank-reduced Task vectors): the weight average plus the low-rank part of each
fine-tune's offset from it.

With task matrices τ_p = α_p·(θ_p − θ₀) (α_p = 1 by default) and their mean τ̄ (so θ̄ = θ₀ + τ̄ is the plain average
of the fine-tunes), each layer matrix merges as

    θ = θ̄ + λ·Σ_p SVD_k(τ_p − τ̄),

SVD_k the best rank-k approximation, k = max(1, floor(r·fraction)) of the matrix's rank r = min(m, n): the centred
task vectors keep their top singular directions, which hold the task-specific knowledge, and drop the rest, where the
interference sits. Every other tensor (biases, norms, 4-D kernels) is the average θ̄ (Σ_p (τ_p − τ̄) = 0: the
authors' rule, which adds the centred vectors untruncated). ``fraction`` 0.08 is the paper's choice of rank (the
authors' released ViT-B/32 × 8 configuration uses 0.12 with λ = 2); λ is tuned on held-out data there.

As TSV-M and Iso in this library, every 2-D tensor counts as a matrix, embedding tables and projections included (the
authors' code low-ranks the blocks' attention and MLP matrices only, and averages an embedding table, a position
embedding or a projection). The truncated SVDs take only the k kept components
(:func:`~hf_mloss.methods.svd_ops.leading_svd`, batched over the q tasks). Unlike θ₀ + λ·τ merges, λ scales only
the low-rank part, so the label-free searches merge each λ of a grid (:meth:`Cart.scales_with_lam`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .._validation import param
from .base import MergeContext, MergeMethod, MethodParams
from .registry import register_merge_method
from .svc import alpha_param, calibrate_param

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch


@dataclass(frozen=True)
class CartParams(MethodParams):
    lam: float = param(1.0, "λ: θ = θ̄ + λ·Σ_p SVD_k(τ_p − τ̄), θ̄ the average of the fine-tunes (tuned on held-out "
                       "data in the paper; its ViT-B/32 × 8 configuration: 2).")
    fraction: float = param(0.08, "Share of each centred task matrix's rank kept: max(1, floor(r·fraction)) "
                            "components (the paper's 8 %).", low=0.0, high=1.0, low_open=True)


@dataclass(frozen=True)
class CartMergeParams(CartParams):
    """``cart``'s parameters: CART's (shared with AdaRank over CART) and the calibration of its merge."""

    calibrate: str | None = calibrate_param()
    alpha: float | None = alpha_param(1.0)

    SVC_ALPHA: ClassVar[float] = 1.0


class Cart(MergeMethod):
    """CART: the average of the fine-tunes plus the rank-k parts of their centred task matrices."""

    name = "cart"
    pretty_name = "CART (centred, rank-reduced task arithmetic)"
    reference = "Choi et al., Revisiting Weight Averaging for Model Merging, arXiv 2412.12153, 2024"
    reference_url = "https://arxiv.org/abs/2412.12153"
    params_class = CartMergeParams
    zero_delta_is_base = True
    default_weight = "one"

    def scales_with_lam(self, parameters: Mapping[str, Any]) -> bool:
        return False  # θ − θ₀ = τ̄ + λ·low-rank part: λ does not rescale it

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        from .svd_ops import is_finite, is_matrix, weighted_task_vectors

        params: CartParams = ctx.params
        taus = weighted_task_vectors(base, sources, ctx.weights)
        mean = taus.mean(0)
        if not (is_matrix(base) and is_finite(taus)):
            return base + mean
        return base + mean + params.lam * cart_low_rank(taus.sub_(mean), params.fraction)


def cart_low_rank(centred: torch.Tensor, fraction: float) -> torch.Tensor:
    """Σ_p SVD_k(centred_p) of the ``[q, m, n]`` centred task matrices, k = max(1, floor(min(m, n)·fraction))."""
    left, sigmas, right = cart_components(centred, fraction)
    return (left * sigmas) @ right


def cart_components(centred: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept singular triplets of every centred task matrix, task by task: ``(U [m, q·k], Σ [q·k], Vᵀ [q·k, n])``
    with Σ_p SVD_k(centred_p) = (U * Σ) @ Vᵀ (AdaRank's masks scale these Σ)."""
    from .svd_ops import leading_svd

    q, m, n = centred.shape
    k = max(1, int(min(m, n) * fraction))
    u, s, vh = leading_svd(centred, k)  # [q, m, k], [q, k], [q, k, n]
    return u.transpose(0, 1).reshape(m, q * k), s.reshape(q * k), vh.reshape(q * k, n)


register_merge_method(Cart())
