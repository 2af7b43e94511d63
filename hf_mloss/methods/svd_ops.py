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


GRAM_MIN_RATIO = 1e-10
"""The Gram route (:func:`leading_svd`, :func:`polar_factor`) is taken only where every eigenvalue it divides by is
at least this share of the largest one (a condition number of the factored matrix up to 10⁵): there the float64
eigendecomposition's error, about 1e-16 / ratio, stays at or below 1e-6 in the weakest direction, under float32's
rounding of the inputs amplified by the same condition number (what the float32 SVD route carries too).
Anything less well conditioned (a task matrix of rank below k, tasks sharing directions) takes the full SVD."""


def _gram_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor]:
    """Eigenpairs of the float64 Gram matrix on the smaller side of ``matrix`` (``[..., m, n]``): for m <= n the
    left Gram A·Aᵀ, else Aᵀ·A. Descending eigenvalues ``[..., r]`` and eigenvectors ``[..., r, r]`` (columns),
    whether the Gram matrix was the left one, and ``matrix`` in float64 (for the products that follow)."""
    a = matrix.double()
    left = a.shape[-2] <= a.shape[-1]
    gram = a @ a.transpose(-1, -2) if left else a.transpose(-1, -2) @ a
    values, vectors = torch.linalg.eigh(gram)
    del gram
    return values.flip(-1), vectors.flip(-1), left, a


def leading_svd(matrix: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The leading ``k`` singular triplets ``U[..., :k], S[..., :k], Vᴴ[..., :k, :]`` of ``matrix`` (batched over
    leading dimensions), as :func:`svd` would give them truncated, without its full factorisation.

    Route: the eigendecomposition of the float64 Gram matrix on the smaller side (r × r, r = min(m, n)): its top
    k eigenvectors are one side's singular vectors, σ = √λ, and the other side is Aᵀ·U / σ (or A·V / σ), also in
    float64. On CLIP-shaped task matrices this is 4-10× cheaper than LAPACK's float32 SVD and more accurate (no
    squared-condition loss in the kept components: each divides by λ_k ≥ :data:`GRAM_MIN_RATIO`·λ_1 only).
    Where some matrix's λ_k falls below that (a task of rank < k, where the kept directions are the solver's
    arbitrary choice anyway) the batch takes :func:`svd` instead, so the result is the one it always was.
    A randomised SVD (``torch.svd_lowrank``) was measured too and is not used: on flat spectra (random task
    vectors: σ_k and σ_k+1 nearly equal) its subspace converges too slowly to stay within 1e-5 of the full SVD.
    """
    if k <= 0:
        *batch, m, n = matrix.shape
        return matrix.new_zeros((*batch, m, 0)), matrix.new_zeros((*batch, 0)), matrix.new_zeros((*batch, 0, n))
    if is_finite(matrix):
        values, vectors, left, a = _gram_eigh(matrix)
        leading = _leading_from_gram(a, values, vectors, left, k, matrix.dtype)
        if leading is not None:
            return leading
    u, s, vh = svd(matrix)
    return u[..., :k], s[..., :k], vh[..., :k, :]


def _leading_from_gram(a: torch.Tensor, values: torch.Tensor, vectors: torch.Tensor, left: bool, k: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The top ``k`` singular triplets, in ``dtype``, of the float64 matrix ``a`` from its Gram eigenpairs
    (:func:`_gram_eigh`); None where some matrix's λ_k is below :data:`GRAM_MIN_RATIO`·λ_1 (the caller takes the
    SVD)."""
    top = values[..., :k]
    if not bool((top[..., -1:] >= GRAM_MIN_RATIO * top[..., :1]).all()) or not bool((top[..., :1] > 0).all()):
        return None
    sigma = top.sqrt()
    kept = vectors[..., :k]  # [..., r, k]
    if left:  # U = eigenvectors of A·Aᵀ, Vᴴ = Σ⁻¹ Uᵀ A
        u, vh = kept, (kept.transpose(-1, -2) @ a) / sigma[..., :, None]
    else:  # V = eigenvectors of Aᵀ·A, U = A V Σ⁻¹
        u, vh = (a @ kept) / sigma[..., None, :], kept.transpose(-1, -2)
    return u.to(dtype), sigma.to(dtype), vh.to(dtype)


def leading_svd_and_rest(matrix: torch.Tensor, k: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`leading_svd` of one ``m × n`` matrix, and, for m ≤ n, an orthonormal basis ``[m, m − k]`` of the
    complement of its top-k left singular vectors (the other eigenvectors of the left Gram matrix, or the SVD's
    other left vectors): a matrix projected off the top-k subspace, (I − U_k U_kᵀ)·X, is ``rest @ (restᵀ X)``, so
    its factorisation shrinks to the (m − k) × n coordinates. ``rest`` is None for m > n (it would be the larger
    side's complement)."""
    m, n = matrix.shape
    if k <= 0 or m > n:
        return (*leading_svd(matrix, k), None)
    if is_finite(matrix):
        values, vectors, left, a = _gram_eigh(matrix)
        leading = _leading_from_gram(a, values, vectors, left, k, matrix.dtype)
        if leading is not None:
            return (*leading, vectors[:, k:].to(matrix.dtype))
    u, s, vh = svd(matrix)  # thin: m ≤ n, so U is square and its last m − k columns span the complement
    return u[:, :k], s[:k], vh[:k], u[:, k:]


def nonzero_svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The singular triplets of one matrix above :func:`numerical_rank`'s tolerance (its numerically non-zero
    spectrum; rounding-noise directions dropped), from the float64 Gram route of :func:`leading_svd` where it is
    well conditioned at that rank (any rank the tolerance keeps, for float32 inputs), else from the SVD."""
    if is_finite(matrix) and matrix.numel():
        values, vectors, left, a = _gram_eigh(matrix)
        sigma = values.clamp_min(0).sqrt().to(matrix.dtype)
        rank = int(numerical_rank(sigma, matrix.shape)) if bool(sigma[0] > 0) else 0
        if rank == 0:
            return leading_svd(matrix, 0)
        leading = _leading_from_gram(a, values, vectors, left, rank, matrix.dtype)
        if leading is not None:
            return leading
    u, s, vh = svd(matrix)
    rank = int(numerical_rank(s, matrix.shape))
    return u[:, :rank], s[:rank], vh[:rank]


def polar_factor(matrix: torch.Tensor) -> torch.Tensor:
    """The orthogonal polar factor P·Qᵀ of ``matrix = P Σ Qᵀ`` (thin SVD; batched over leading dimensions).

    It is the matrix with orthonormal columns nearest to ``matrix`` in Frobenius norm (orthogonal Procrustes), and
    for a matrix of linearly independent unit columns it is their symmetric (Löwdin) orthogonalisation
    U·(UᵀU)^(-1/2): no column is favoured, unlike Gram-Schmidt. Computed that way, from the float64
    eigendecomposition of the smaller Gram matrix, where it is well conditioned (every eigenvalue at least
    :data:`GRAM_MIN_RATIO` of the largest); otherwise (near rank-deficient: the factor is then ill-determined and
    the SVD's choice is kept) from the SVD.
    """
    if is_finite(matrix) and matrix.shape[-1] and matrix.shape[-2]:
        values, vectors, left, a = _gram_eigh(matrix)
        if bool((values[..., -1:] >= GRAM_MIN_RATIO * values[..., :1]).all()) and bool((values[..., :1] > 0).all()):
            inverse_root = (vectors * values.rsqrt()[..., None, :]) @ vectors.transpose(-1, -2)
            return (inverse_root @ a if left else a @ inverse_root).to(matrix.dtype)
    return _svd_polar_factor(matrix)


def _svd_polar_factor(matrix: torch.Tensor) -> torch.Tensor:
    """:func:`polar_factor` from the thin SVD (any matrix, rank-deficient ones included)."""
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
