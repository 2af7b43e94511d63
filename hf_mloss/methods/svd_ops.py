"""Shared pieces of the SVD-based merges (TSV-M, Iso-C, Iso-CTS): which tensors are matrices, the weighted task
matrices of one tensor, orthogonalisation by the polar factor, and the rule for everything that is not a matrix.

Every SVD runs in float32 with ``torch.linalg`` on the tensors' own device (GPU solvers when they are there), batched
over the q tasks of a layer where the algorithm allows it.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def is_finite(taus: torch.Tensor) -> bool:
    """Whether the task vectors are finite (finite weights can still differ by more than float32 holds): a
    non-finite stack is not factored (LAPACK would fail on it) but averaged, so the merge reports the overflow as every
    method does (:func:`hf_mloss.merging.driver.finalize`)."""
    return bool(torch.isfinite(taus.sum()) or torch.isfinite(taus).all())


def is_matrix(tensor: torch.Tensor) -> bool:
    """A layer matrix for the SVD-based merges: any 2-D tensor (linear weights, embedding tables, projections).

    Biases, norms (1-D) and convolution kernels (4-D, e.g. ViT's patch embedding) are not: they take the mean task
    vector (:func:`mean_task_vector`), as the authors' code and fusion_bench do.
    """
    return tensor.dim() == 2


def weighted_task_vectors(base: torch.Tensor, sources: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """``[q, ...]`` stack of α_p·τ_p = α_p·(θ_p − θ₀), in one new buffer."""
    taus = torch.stack(sources).sub_(base)
    if not bool((weights == 1).all()):
        taus.mul_(weights.to(taus).reshape(-1, *([1] * base.dim())))
    return taus


def mean_task_vector(taus: torch.Tensor) -> torch.Tensor:
    """(1/q)·Σ_p α_p τ_p: what the non-matrix tensors get (the authors' code and fusion_bench average them)."""
    return taus.mean(0)


def svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD ``U, S, Vᴴ`` in the input's precision (batched over leading dimensions).

    LAPACK's divide-and-conquer solver can fail to converge in float32 on matrices with many clustered singular
    values (a task matrix projected off a 616-dimensional common subspace, rank <= 152 of 768, failed so on random
    ViT-B/32-shaped task vectors); such a call is repeated in float64 and the factors rounded back. A non-finite
    matrix gives NaN factors (LAPACK would fail on it), so the merge reports the overflow as every method does.
    """
    if not is_finite(matrix):  # a sum of finite task matrices can overflow: NaN factors, reported as an overflow
        *batch, m, n = matrix.shape
        k = min(m, n)
        nan = float("nan")
        return (matrix.new_full((*batch, m, k), nan), matrix.new_full((*batch, k), nan),
                matrix.new_full((*batch, k, n), nan))
    try:
        return torch.linalg.svd(matrix, full_matrices=False)
    except torch.linalg.LinAlgError:
        if matrix.dtype == torch.float64:
            raise
        logger.info("float32 SVD of a %s tensor did not converge; repeating it in float64", tuple(matrix.shape))
        u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
        return u.to(matrix.dtype), s.to(matrix.dtype), vh.to(matrix.dtype)


def polar_factor(matrix: torch.Tensor) -> torch.Tensor:
    """The orthogonal polar factor P·Qᵀ of ``matrix = P Σ Qᵀ`` (thin SVD; batched over leading dimensions).

    It is the matrix with orthonormal columns nearest to ``matrix`` in Frobenius norm (orthogonal Procrustes), and
    for a matrix of linearly independent unit columns it is their symmetric (Löwdin) orthogonalisation
    U·(UᵀU)^(-1/2): no column is favoured, unlike Gram-Schmidt.
    """
    p, _, qh = svd(matrix)
    return p @ qh


def nonzero_tasks(taus: torch.Tensor) -> torch.Tensor:
    """Indices of the tasks whose matrix is not exactly zero (an untouched layer has no singular vectors to keep)."""
    return torch.nonzero(taus.flatten(1).abs().amax(1) > 0).flatten()


def numerical_rank(singular_values: torch.Tensor, shape: tuple[int, ...], scale: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """How many of the (descending) ``singular_values`` of a matrix of ``shape`` are numerically non-zero: above
    ``max(m, n)·eps·scale``, ``scale`` σ_max by default (the usual matrix-rank tolerance). A matrix computed from
    others (a projection) gives their size as ``scale``: its own σ_max may be rounding noise. Batched over leading
    dimensions (``scale`` one value per matrix)."""
    eps = torch.finfo(singular_values.dtype).eps
    scale = singular_values[..., :1] if scale is None else scale.reshape(*singular_values.shape[:-1], 1)
    return (singular_values > max(shape[-2:]) * eps * scale).sum(-1)
