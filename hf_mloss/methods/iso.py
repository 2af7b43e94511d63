"""Isotropic merging: Iso-C (the summed task matrix with a flat spectrum) and Iso-CTS (a common subspace plus
task-specific subspaces, then a flat spectrum).

Per layer matrix, with Δ = Σ_p α_p τ_p (α_p = 1 by default, the paper's task-arithmetic sum):

* **Iso-C**: Δ = U Σ Vᵀ, every singular value replaced by their mean σ̄ = tr(Σ)/r: θ = θ₀ + λ·σ̄·U Vᵀ. Directions
  the sum barely uses are raised to the common level, so that no task's directions are drowned by the dominant ones.
* **Iso-CTS**: the top k = r − q·s singular vectors of Δ span the common subspace (k ≈ ``common_space_fraction``·r,
  adjusted so the rest splits evenly: s = round((r − floor(r·f)) / q), as the authors' code); each task's matrix,
  projected off that subspace (τ_p − U_k U_kᵀ τ_p), gives its top s singular vectors; the r kept left and right
  vectors are orthogonalised (polar factors, as in TSV-M) and scaled isotropically by the mean of the r kept
  singular values: θ = θ₀ + λ·σ̄·U⊥ V⊥ᵀ. With ``common_space_fraction=1`` it is Iso-C.

Not a matrix (biases, norms, 4-D convolution kernels such as ViT's patch embedding): θ = θ₀ + λ·(1/q)·Σ_p α_p τ_p,
the mean task vector, as the authors' code and fusion_bench. Every 2-D tensor, embedding tables included, is a
matrix. **Rank-deficient matrices** (task vectors of LoRA-derived models, a frozen block's rows): only the numerically
non-zero spectrum is flattened. Singular values at or below ``max(m, n)·eps·σ_max`` (rounding noise) are dropped with
their directions, and σ̄ is the mean of the others, so the merge spans the sum's range (Iso-C) or the kept subspaces
(Iso-CTS) and nothing else; flattening all of them would raise whichever noise directions the SVD solver returns to
σ̄. A full-rank matrix keeps every direction (the result fusion-bench computes, tests/test_peers.py).

**Computation.** No full SVD where the factors are well conditioned: Iso-C's σ̄ and U Vᵀ come from the float64
eigendecomposition of the sum's smaller Gram matrix; Iso-CTS factors only what it keeps (the common subspace's top k
triplets, then each task's top s, for m ≤ n in the (m − k)-dimensional coordinates of the common subspace's
complement). The SVD stays the fallback (:mod:`.svd_ops`). On ViT-B/32-shaped random task vectors both merges land
within 2e-6 (relative) of the algorithm written with float64 SVDs, where the float32 SVD route was 2e-6 to 5e-5 off.

λ (the paper's α) is chosen on held-out data in the paper; 1.0 is fusion_bench's default. σ̄ grows with the number
and size of the task vectors, and the best λ can lie far above TIES's, so grids should reach well beyond 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .._validation import param
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams
from .svc import alpha_param, calibrate_param

if TYPE_CHECKING:
    import torch

REFERENCE = ("Marczak et al., No Task Left Behind: Isotropic Model Merging with Common and Task-Specific Subspaces, "
             "arXiv 2502.04959, 2025")
REFERENCE_URL = "https://arxiv.org/abs/2502.04959"


@dataclass(frozen=True)
class IsoCParams(MethodParams):
    lam: float = param(1.0, "λ: θ = θ₀ + λ·τ_merged (the paper's α, tuned on held-out data there).")


@dataclass(frozen=True)
class IsoCMergeParams(IsoCParams):
    """``iso_c``'s parameters: Iso-C's (shared with AdaRank over Iso-C) and the calibration of its merge."""

    calibrate: str | None = calibrate_param()
    alpha: float | None = alpha_param(0.1)

    SVC_ALPHA: ClassVar[float] = 0.1


@dataclass(frozen=True)
class IsoCtsParams(MethodParams):
    lam: float = param(1.0, "λ: θ = θ₀ + λ·τ_merged (the paper's α, tuned on held-out data there).")
    common_space_fraction: float = param(0.8, "Share of each matrix's rank given to the common subspace of the summed "
                                         "task matrix (the paper's default 0.8); the rest is split among the tasks.",
                                         low=0.0, high=1.0, low_open=True)
    calibrate: str | None = calibrate_param()
    alpha: float | None = alpha_param(0.2)

    SVC_ALPHA: ClassVar[float] = 0.2


class _Isotropic(MergeMethod):
    reference = REFERENCE
    reference_url = REFERENCE_URL
    zero_delta_is_base = True
    default_weight = "one"

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        from .svd_ops import is_finite, is_matrix, mean_task_vector, weighted_task_vectors

        taus = weighted_task_vectors(base, sources, ctx.weights)
        merged = self.merge_matrix(taus, ctx.params) if is_matrix(base) and is_finite(taus) else \
            mean_task_vector(taus)
        return base + ctx.params.lam * merged

    def merge_matrix(self, taus: torch.Tensor, params: MethodParams) -> torch.Tensor:
        raise NotImplementedError


class IsoC(_Isotropic):
    """Iso-C: the summed task matrix with its singular values replaced by their mean."""

    name = "iso_c"
    pretty_name = "Iso-C (isotropic merging in the common subspace)"
    params_class = IsoCMergeParams

    def merge_matrix(self, taus, params) -> torch.Tensor:
        return iso_c_matrix(taus.sum(0))


class IsoCts(_Isotropic):
    """Iso-CTS: common subspace of the sum plus task-specific subspaces, orthogonalised, flat spectrum."""

    name = "iso_cts"
    pretty_name = "Iso-CTS (isotropic merging in common and task-specific subspaces)"
    params_class = IsoCtsParams

    def merge_matrix(self, taus, params) -> torch.Tensor:
        return iso_cts_matrix(taus, params.common_space_fraction)


def iso_c_matrix(delta: torch.Tensor) -> torch.Tensor:
    """σ̄·U Vᵀ for ``delta = U Σ Vᵀ`` over its numerically non-zero spectrum, σ̄ the mean singular value there."""
    import torch

    components = iso_c_components(delta)
    if components is None:
        return torch.zeros_like(delta)
    u, mean, vh = components
    return (u * mean) @ vh


def iso_c_components(delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(U, σ̄, Vᵀ)``: the numerically non-zero singular vectors of ``delta`` and the mean of their singular values
    (Iso-C's merge is ``(U * σ̄) @ Vᵀ``; AdaRank's masks scale σ̄ per component); None when ``delta`` is zero."""
    from .svd_ops import nonzero_svd

    u, s, vh = nonzero_svd(delta)
    if len(s) == 0:
        return None
    return u, s.mean(), vh


def subspace_sizes(rank: int, q: int, common_space_fraction: float) -> tuple[int, int]:
    """(k common directions, s per task) with k + q·s = rank, as the authors' code splits a matrix's rank."""
    common = int(rank * common_space_fraction)
    per_task = min(round((rank - common) / q), rank // q)  # round() as theirs; capped so k >= 0 for tiny fractions
    return rank - q * per_task, per_task


def iso_cts_matrix(taus: torch.Tensor, common_space_fraction: float) -> torch.Tensor:
    """Iso-CTS merge of the ``[q, m, n]`` task matrices ``taus``."""
    import torch

    from .svd_ops import leading_svd, leading_svd_and_rest, nonzero_tasks, numerical_rank, polar_factor

    active = nonzero_tasks(taus)
    if len(active) == 0:
        return torch.zeros_like(taus[0])
    taus = taus[active] if len(active) < len(taus) else taus  # an unchanged task has no subspace of its own
    q, m, n = taus.shape
    common, per_task = subspace_sizes(min(m, n), q, common_space_fraction)
    if per_task == 0:
        return iso_c_matrix(taus.sum(0))
    # only the kept singular triplets are computed (leading_svd); the rank tests below look at no other σ
    u_c, s, vh, rest = leading_svd_and_rest(taus.sum(0), common)
    if rest is None:
        specific = taus - u_c @ (u_c.T @ taus)  # each task off the common subspace (batched)
        u_t, s_t, vh_t = leading_svd(specific, per_task)
    else:  # the same, factored in the complement's coordinates: (m − k) × n matrices instead of m × n
        u_t, s_t, vh_t = leading_svd(rest.T @ taus, per_task)
        u_t = rest @ u_t
    u_all = torch.cat([u_t.transpose(0, 1).reshape(m, q * per_task), u_c], 1)
    vh_all = torch.cat([vh_t.reshape(q * per_task, n), vh], 0)
    sigmas = torch.cat([s_t.reshape(-1), s])
    # numerically zero directions (rank-deficient sums and projections) are dropped, not raised to σ̄
    # (a projected task's σ are measured against the task's own size: what remains of it off the subspace can be noise)
    task_rank = numerical_rank(s_t, (m, n), scale=torch.linalg.matrix_norm(taus))
    kept = torch.cat([(torch.arange(per_task, device=s.device) < task_rank.unsqueeze(-1)).reshape(-1),
                      torch.arange(common, device=s.device) < numerical_rank(s, (m, n))])
    if not bool(kept.all()):
        if not bool(kept.any()):
            return torch.zeros_like(taus[0])
        u_all, vh_all, sigmas = u_all[:, kept], vh_all[kept], sigmas[kept]
    return (polar_factor(u_all) * sigmas.mean()) @ polar_factor(vh_all)


register_merge_method(IsoC())
register_merge_method(IsoCts())
