"""Singular Value Calibration (SVC): a plug-in that rescales, per layer matrix, the singular values a merge
over-accumulates along the directions its tasks share.

A merge that yields a merged task matrix (θ = θ₀ + Δ per layer: task arithmetic, TIES, DARE, TSV-M, Iso-C, Iso-CTS,
WUDI, CART, the plain average) takes ``calibrate="svc"``. For each 2-D tensor, with Δ = U S Vᵀ (thin SVD, r = min(m, n)
directions) and the K task matrices Δ_i = θ_i − θ₀ (as fine-tuned, unweighted):

* a_r = u_rᵀ Δ and a_r^i = u_rᵀ Δ_i: the merge's and task i's responses along u_r;
* s_r^i = ⟨a_r, a_r^i⟩ / ‖a_r^i‖²: how far the merge scales task i's response there (above 1: over-counted);
* γ_r = K / Σ_i max(α, s_r^i), and θ = θ₀ + U diag(γ ⊙ S) Vᵀ.

Directions several tasks push the same way get γ_r < 1; directions one task holds, which the merge scaled by λ < 1,
get γ_r > 1 (up to 1/α); α floors each task's coefficient (a task that barely responds along u_r counts as α). This
is fusion-bench's ``singular_value_calibration`` (its default, vectorised form): the factorisation in float64,
‖a_r^i‖² floored at 1e-12 and a NaN coefficient read as α as there, every 2-D tensor calibrated and the others left
as the merge made them; λ acts inside the merge (SVC calibrates θ − θ₀ as the merge wrote it, so a grid over λ merges
each λ: it is not θ₀ + λ·τ). Unlike fusion-bench, no full SVD is
computed where the smaller Gram matrix's float64 eigendecomposition gives the same basis: for m ≤ n the output is
U diag(γ) Uᵀ Δ, which needs U alone; for m > n, U = Δ V S⁻¹ where every σ² is at least
:data:`~hf_mloss.methods.svd_ops.GRAM_MIN_RATIO` of the largest, else the float64 SVD (a rank-deficient tall matrix).

The coefficients are measured along U, so SVC is determined only where the merge's singular values are distinct. Iso-C
and Iso-CTS give every kept direction the same σ̄: U is then any basis of that subspace, picked by rounding, and so is
the calibrated matrix (fusion-bench's own moves by tens of percent when its inputs move by 1e-7; tests/test_peers.py).
Over those two merges hf_mloss's result is one such pick, not fusion-bench's.

α is fusion-bench's per method (its shipped configurations: 0.1 over task arithmetic, TIES, DARE and the average, 0.2
over Iso-CTS, 1.0 over TSV-M and WUDI); the paper (arXiv 2602.05536) tunes it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .._validation import param

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

REFERENCE = "When Shared Knowledge Hurts: Spectral Over-Accumulation in Model Merging, arXiv 2602.05536, 2026"
REFERENCE_URL = "https://arxiv.org/abs/2602.05536"
CALIBRATIONS = ("svc",)
RESPONSE_FLOOR = 1e-12
"""‖a_r^i‖² is floored here before the division (fusion-bench's clamp, in float64)."""


def calibrate_param() -> Any:
    """The ``calibrate`` field of a method whose merge yields a merged task matrix."""
    return param(None, "Calibrate every merged layer matrix after the merge: svc (Singular Value Calibration: "
                 "rescale the singular values the tasks over-accumulate along shared directions); default: none.",
                 choices=CALIBRATIONS)


def alpha_param(default: float) -> Any:
    """The ``alpha`` field (SVC's floor), ``default`` standing for ``None`` (fusion-bench's value for the method)."""
    return param(None, f"SVC's α (calibrate='svc' only): each task's projection coefficient is floored at α before "
                 f"the per-direction factor K / Σ max(α, s) is taken; default {default:g} (fusion-bench's for this "
                 "method).", low=0.0, low_open=True, high=1e6)


def calibrates(params: Any) -> bool:
    """Whether a merge with these parameters (a params object or a mapping) is calibrated afterwards."""
    value = params.get("calibrate") if isinstance(params, dict) else getattr(params, "calibrate", None)
    return value is not None


def svc_alpha(params: Any) -> float:
    """The α a calibrated merge uses: ``alpha``, else its method's default (``SVC_ALPHA`` of its params class)."""
    return params.alpha if params.alpha is not None else type(params).SVC_ALPHA


def calibrated_methods() -> list[str]:
    """The registered methods that take ``calibrate`` (their merge yields a merged task matrix)."""
    from .registry import MERGE_METHODS

    return sorted(name for name, method in MERGE_METHODS.items()
                  if "calibrate" in {f.name for f in dataclasses.fields(method.params_class)})


def describe_calibration(params: Any) -> str:
    """The card's words for a calibrated merge (empty when it is not)."""
    if not calibrates(params):
        return ""
    return (f", then Singular Value Calibration ({REFERENCE}) of every layer matrix at α = {svc_alpha(params):g}")


def calibrate_tensor(base: torch.Tensor, sources: Sequence[torch.Tensor], merged: torch.Tensor, alpha: float
                     ) -> torch.Tensor:
    """θ₀ + SVC(θ_merged − θ₀) for a 2-D tensor (the task matrices θ_i − θ₀ from ``sources``); other tensors, and a
    merge that is not finite (reported as an overflow by the driver), are returned as merged."""
    import torch

    if merged.dim() != 2 or not bool(torch.isfinite(merged).all()):
        return merged
    delta = merged - base
    if not bool(delta.any()):
        return merged
    return base + svc_matrix(delta, [s - base for s in sources], alpha)


def svc_matrix(delta: torch.Tensor, taus: Sequence[torch.Tensor], alpha: float) -> torch.Tensor:
    """SVC of the merged task matrix ``delta`` ``[m, n]`` given the task matrices ``taus`` (each ``[m, n]``), in
    ``delta``'s dtype. The basis, the merge's responses and the output in float64; the tasks' responses Uᵀ·Δ_i (the
    q products that dominate the cost) in the tasks' own precision, their dot products summed in float64 (within
    5e-8 of float64 responses on random low-rank task matrices)."""
    import torch

    d = delta.double()
    u, merged_response = _basis(d)  # u: [m, r] orthonormal; merged_response: uᵀΔ = diag(S) Vᵀ, [r, n]
    num = d.new_empty(len(taus), u.shape[1])
    den = d.new_empty(len(taus), u.shape[1])
    basis = {}
    for i, tau in enumerate(taus):  # one task at a time: no copy of the q task matrices
        ut = basis.setdefault(tau.dtype, u.T.to(tau.dtype))
        response = (ut @ tau).double()
        num[i] = (merged_response * response).sum(-1)
        den[i] = response.square().sum(-1)
    coefficients = torch.nan_to_num(num / den.clamp_min(RESPONSE_FLOOR), nan=alpha, neginf=alpha)
    gamma = len(taus) / coefficients.clamp_min(alpha).sum(0)
    return (u @ (gamma[:, None] * merged_response)).to(delta.dtype)


def _basis(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, Uᵀ Δ)`` of the float64 matrix ``d = Δ``: U its left singular vectors (thin: ``[m, min(m, n)]``), from
    the smaller Gram matrix's eigendecomposition where that is exact enough, else from the SVD."""
    import torch

    from .svd_ops import GRAM_MIN_RATIO

    m, n = d.shape
    if m <= n:  # U: eigenvectors of Δ Δᵀ; Uᵀ Δ directly (no division by σ, any rank)
        _, vectors = torch.linalg.eigh(d @ d.T)
        u = vectors.flip(-1)
        return u, u.T @ d
    values, vectors = torch.linalg.eigh(d.T @ d)
    values, v = values.flip(-1), vectors.flip(-1)
    if bool(values[0] > 0) and bool(values[-1] >= GRAM_MIN_RATIO * values[0]):  # U = Δ V S⁻¹, well conditioned
        sigma = values.sqrt()
        return (d @ v) / sigma, sigma[:, None] * v.T
    u, _, _ = torch.linalg.svd(d, full_matrices=False)  # a rank-deficient tall matrix: U as the reference has it
    return u, u.T @ d
