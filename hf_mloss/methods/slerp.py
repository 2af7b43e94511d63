"""SLERP: spherical interpolation between the base (t = 0) and one other model (t = 1), tensor by tensor.

Each tensor is one vector. Its coefficients come from the angle θ between the two normalised tensors:
``θ = sin((1−t)Ω)/sin Ω · θ₀ + sin(tΩ)/sin Ω · θ₁``, applied to the tensors as they are (not normalised), as mergekit
does. Near-parallel (or antipodal) pairs, ``|cos Ω| > DOT_THRESHOLD``, fall back to linear interpolation, where the
sine ratios lose precision. A tensor whose norm is below ``NORM_EPS`` is used unnormalised in the cosine (its cosine
is then 0: a zero bias interpolates with ``sin(tπ/2)``, exactly as mergekit computes it).
"""

from __future__ import annotations

import warnings

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._validation import param
from ..errors import InvalidParameterError
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams

if TYPE_CHECKING:
    import torch

DOT_THRESHOLD = 0.9995
"""Above this |cos Ω| the two tensors count as parallel and are interpolated linearly (mergekit's value)."""
NORM_EPS = 1e-8
"""Norms at or below this are replaced by 1 before the cosine (mergekit's value)."""


@dataclass(frozen=True)
class SlerpParams(MethodParams):
    t: float = param(0.5, "Interpolation factor: 0 gives the base, 1 the other model (mergekit: t).")


class Slerp(MergeMethod):
    """θ = slerp(θ₀, θ₁; t) per tensor; exactly one model besides the base."""

    name = "slerp"
    pretty_name = "SLERP (spherical linear interpolation)"
    reference = "Shoemake, Animating Rotation with Quaternion Curves, SIGGRAPH 1985"
    reference_url = "https://doi.org/10.1145/325165.325242"
    params_class = SlerpParams
    accepts_models = (1, 1)

    def prepare(self, ctx: MergeContext, visit) -> None:
        if len(ctx.weights) != 1:
            raise InvalidParameterError(
                f"slerp interpolates between the base (t=0) and exactly one other model (t=1), got "
                f"{len(ctx.weights)} models; give one model (mergekit: the base_model plus one other model), or use "
                "model_stock / task_arithmetic for more.")
        if float(ctx.weights[0]) != 1.0:
            raise InvalidParameterError(f"slerp takes no weight (t sets the mix), got weight {float(ctx.weights[0])}; "
                                        "drop the weight and set t.")

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        t = ctx.params.t
        if not 0 <= t <= 1 and not ctx.state.get("slerp_warned"):
            ctx.state["slerp_warned"] = True  # once per run (t may vary per tensor with gradients)
            warnings.warn(f"slerp t={t} lies outside [0, 1]: the merge extrapolates beyond the two models (as "
                          "mergekit does). Use t in [0, 1] to interpolate between them.", stacklevel=2)
        return slerp(t, base, sources[0])


def slerp(t: float, v0: torch.Tensor, v1: torch.Tensor, *, dot_threshold: float = DOT_THRESHOLD,
          eps: float = NORM_EPS) -> torch.Tensor:
    """Spherical interpolation of two tensors of one shape, each taken as one vector (float32 in, float32 out)."""
    import torch

    a, b = v0.reshape(-1), v1.reshape(-1)
    if a.numel() == 0:
        return v0.clone()
    # t and every coefficient stay float32 tensors (1 − t included): the same roundings as mergekit's kernel.
    t = torch.tensor(t, dtype=torch.float32, device=v0.device)
    norm_a, norm_b = torch.linalg.vector_norm(a), torch.linalg.vector_norm(b)
    norm_a = torch.where(norm_a > eps, norm_a, 1)
    norm_b = torch.where(norm_b > eps, norm_b, 1)
    # Normalise before multiplying: the raw dot product of large tensors can overflow.
    dot = ((a / norm_a) * (b / norm_b)).sum().clamp(-1, 1)
    if abs(float(dot)) > dot_threshold:
        coef_a, coef_b = 1 - t, t
    else:
        theta = torch.acos(dot)
        sin_theta = torch.sin(theta)
        coef_a = torch.sin((1 - t) * theta) / sin_theta
        coef_b = torch.sin(t * theta) / sin_theta
    return coef_a * v0 + coef_b * v1

register_merge_method(Slerp())
