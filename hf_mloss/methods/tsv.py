"""TSV-M (Task Singular Vectors: Merge): per layer matrix, keep each task's top singular vectors, decorrelate the
tasks' singular bases, recombine.

For a layer matrix with task matrices Δ_p = α_p·τ_p (q tasks that changed it, rank r = min(m, n)):

1. Δ_p = U_p Σ_p V_pᵀ; keep the top k = floor(r·fraction) components of each (fraction 1/q by default, as the
   paper: the q truncated bases then fit in the layer's rank). Only those are computed
   (:func:`~hf_mloss.methods.svd_ops.leading_svd`, batched over the q tasks);
2. concatenate U = [U_1,k … U_q,k], Σ = diag(Σ_1,k … Σ_q,k), V = [V_1,k … V_q,k];
3. replace U and V by their orthogonal polar factors U⊥ = P_U Q_Uᵀ, V⊥ = P_V Q_Vᵀ (thin SVDs of U and V: the
   orthonormal bases nearest to them, orthogonal Procrustes), which removes the interference between the tasks'
   singular vectors;
4. θ = θ₀ + λ·U⊥ Σ V⊥ᵀ.

Not a matrix (biases, norms, 4-D convolution kernels such as ViT's patch embedding): θ = θ₀ + λ·(1/q)·Σ_p α_p τ_p,
the mean task vector, as the authors' code and fusion_bench. Every 2-D tensor counts as a matrix, embedding tables
included (again as they do). A matrix whose rank is below 1/fraction (k = 0) also takes the mean instead of
silently keeping nothing; a task that left the matrix exactly unchanged has no singular vectors and is left out of it
(fusion_bench would orthogonalise the arbitrary singular vectors of its zero matrix with the others).

Weights α_p scale each task vector before the SVDs (fusion_bench's per-model ``alpha`` list); by default α_p = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .._validation import param
from ..errors import InvalidParameterError
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams
from .svc import alpha_param, calibrate_param

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TsvParams(MethodParams):
    lam: float = param(1.0, "λ: θ = θ₀ + λ·τ_merged (the paper's α, 1.0 there: no tuning).")
    fraction: float | None = param(None, "Share of each task matrix's rank kept before merging; default 1/q (the "
                                   "paper). At most 1/q, so that the q bases fit in the rank.",
                                   low=0.0, high=1.0, low_open=True)

    def resolved_defaults(self, q: int | None = None) -> dict[str, Any]:
        if self.fraction is not None:
            return {}
        return {"fraction": "1/q" if q is None else f"1/q = {1 / q:.4g}"}


@dataclass(frozen=True)
class TsvMergeParams(TsvParams):
    """``tsv_m``'s parameters: TSV-M's (shared with AdaRank over TSV-M) and the calibration of its merge."""

    calibrate: str | None = calibrate_param()
    alpha: float | None = alpha_param(1.0)

    SVC_ALPHA: ClassVar[float] = 1.0


class TsvMerge(MergeMethod):
    """TSV-M: per layer matrix, the tasks' top singular vectors decorrelated and recombined."""

    name = "tsv_m"
    pretty_name = "TSV-Merge"
    reference = "Gargiulo et al., Task Singular Vectors: Reducing Task Interference in Model Merging, CVPR 2025"
    reference_url = "https://arxiv.org/abs/2412.00081"
    params_class = TsvMergeParams
    zero_delta_is_base = True
    default_weight = "one"

    def prepare(self, ctx: MergeContext, visit) -> None:
        check_fraction(ctx.params.fraction, len(ctx.weights))

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        from .svd_ops import is_finite, is_matrix, mean_task_vector, weighted_task_vectors

        params: TsvParams = ctx.params
        taus = weighted_task_vectors(base, sources, ctx.weights)
        merged = tsv_merge_matrix(taus, params.fraction) if is_matrix(base) and is_finite(taus) else None
        if merged is None:
            merged = mean_task_vector(taus)
        return base + params.lam * merged


def check_fraction(fraction: float | None, q: int) -> None:
    """Refuse a kept share above 1/q (the q truncated bases would not fit in the layer's rank)."""
    if fraction is not None and fraction * q > 1 + 1e-9:
        raise InvalidParameterError(
            f"tsv_m keeps at most 1/q of each task matrix's rank (q = {q}: fraction <= {1 / q:.4g}), got fraction="
            f"{fraction}; leave it unset for the paper's 1/q.")


def tsv_merge_matrix(taus: torch.Tensor, fraction: float | None) -> torch.Tensor | None:
    """U⊥ Σ V⊥ᵀ of the ``[q, m, n]`` task matrices ``taus``; None when no component is kept (k = 0)."""
    import torch

    components = tsv_components(taus, fraction)
    if components is None or isinstance(components, int):
        return None if components is None else torch.zeros_like(taus[0])
    left, sigmas, right, _ = components
    return (left * sigmas) @ right


def tsv_components(taus: torch.Tensor, fraction: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | int | None:
    """The kept components of TSV-M's merge of the ``[q, m, n]`` task matrices ``taus``: ``(U⊥, Σ, V⊥ᵀ, tasks)``
    with the merge ``(U⊥ * Σ) @ V⊥ᵀ``, Σ the k kept singular values of each task that changed the matrix, task by
    task (``tasks``: their indices, k components each); ``0`` when no task changed the matrix (the merge is zero),
    ``None`` when no component is kept (k = 0: the caller takes the mean). AdaRank's masks scale these Σ."""
    from .svd_ops import leading_svd, nonzero_tasks, polar_factor

    active = nonzero_tasks(taus)
    if len(active) == 0:
        return 0
    taus = taus[active] if len(active) < len(taus) else taus
    q, m, n = taus.shape
    k = int(min(m, n) * (fraction if fraction is not None else 1 / q))
    if k == 0:
        return None
    u, s, vh = leading_svd(taus, k)  # only the kept components, batched: [q, m, k], [q, k], [q, k, n]
    u_cat = u.transpose(0, 1).reshape(m, q * k)  # columns task by task
    s_cat = s.reshape(q * k)
    vh_cat = vh.reshape(q * k, n)
    return polar_factor(u_cat), s_cat, polar_factor(vh_cat), active.tolist()


register_merge_method(TsvMerge())
