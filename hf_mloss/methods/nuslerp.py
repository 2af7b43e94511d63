"""NuSLERP: spherical interpolation of two models (or of their task vectors), with the mix set by their weights.

mergekit 0.1.5's ``nuslerp``: with weights ``w₁, w₂`` the factor is ``t = w₂ / (w₁ + w₂)`` (0.5 when the sum is below
1e-6). With a base (``task_vectors``, the default when a base model is given) the merge is
``θ₀ + nuslerp(t, τ₁, τ₂)``; without, ``nuslerp(t, θ₁, θ₂)``. The vectors interpolated are the whole tensor
(``flatten``, the default), or each row (slice along the last axis), or with ``row_wise`` each column (slice along
the first axis). Each pair is normalised (norms floored at 1e-7) and, where ``1 − cos² ≤ 1e-16`` (parallel or
antipodal), interpolated linearly; otherwise ``(sin((1−t)Ω)·v₁ + sin(tΩ)·v₂) / sin Ω`` on the vectors as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._validation import param
from ..errors import InvalidParameterError
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams

if TYPE_CHECKING:
    import torch

NORM_FLOOR = 1e-7
"""Norms are floored here before normalising (mergekit's value)."""
COLINEAR_EPS = 1e-8
"""Pairs with ``1 − cos² ≤ COLINEAR_EPS²`` are interpolated linearly (mergekit's value)."""
ZERO_TOTAL = 1e-6
"""Weights summing (in absolute value) below this give ``t = 0.5``."""


@dataclass(frozen=True)
class NuSlerpParams(MethodParams):
    task_vectors: bool = param(True, "Interpolate the task vectors θ_p − θ₀ and add them to the base (mergekit: a "
                               "base_model is given); false: interpolate the two models themselves.")
    flatten: bool = param(True, "Each tensor is one vector (mergekit: nuslerp_flatten); false: one vector per row, "
                          "or per column with row_wise.")
    row_wise: bool = param(False, "With flatten false, interpolate the columns (slices along the first axis) instead "
                           "of the rows (mergekit: nuslerp_row_wise).")


class NuSlerp(MergeMethod):
    """θ = θ₀ + nuslerp(t; τ₁, τ₂) (or nuslerp(t; θ₁, θ₂)) with t = w₂ / (w₁ + w₂); exactly two models."""

    name = "nuslerp"
    pretty_name = "NuSLERP (weighted spherical interpolation)"
    reference = ("Shoemake, Animating Rotation with Quaternion Curves, SIGGRAPH 1985 (as generalised by mergekit: "
                 "Goddard et al., Arcee's MergeKit, EMNLP 2024 Industry Track)")
    reference_url = "https://arxiv.org/abs/2403.13257"
    params_class = NuSlerpParams
    accepts_models = (2, 2)
    per_model_params = ("weight",)

    def prepare(self, ctx: MergeContext, visit) -> None:
        if len(ctx.weights) != 2:
            raise InvalidParameterError(f"nuslerp interpolates exactly two models, got {len(ctx.weights)}; give two "
                                        "models (and a base model to interpolate their task vectors).")

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        params: NuSlerpParams = ctx.params
        w1, w2 = ctx.weights.tolist()
        t = 0.5 if abs(w1 + w2) < ZERO_TOTAL else w2 / (w1 + w2)
        dim = 0 if params.row_wise else -1
        if params.task_vectors:
            return base + nuslerp(t, sources[0] - base, sources[1] - base, dim=dim, flatten=params.flatten)
        return nuslerp(t, sources[0], sources[1], dim=dim, flatten=params.flatten)


def nuslerp(t: float, v1: torch.Tensor, v2: torch.Tensor, *, dim: int = -1, flatten: bool = True) -> torch.Tensor:
    """Spherical interpolation of ``v1`` (t = 0) and ``v2`` (t = 1), vector by vector along ``dim`` (or whole)."""
    import torch

    shape = v1.shape
    if flatten:
        v1, v2 = v1.reshape(-1), v2.reshape(-1)
    elif dim != -1:
        v1, v2 = v1.transpose(dim, -1), v2.transpose(dim, -1)
    u1 = v1 / torch.norm(v1, dim=-1, keepdim=True).clamp(min=NORM_FLOOR)
    u2 = v2 / torch.norm(v2, dim=-1, keepdim=True).clamp(min=NORM_FLOOR)
    cos = torch.sum(u1 * u2, dim=-1, keepdim=True).clamp(-1, 1)
    colinear = (1 - cos.square()) <= COLINEAR_EPS**2
    theta = torch.acos(torch.where(colinear, 0, cos))  # the spherical branch stays finite where it is not used
    out = (torch.sin((1 - t) * theta) * v1 + torch.sin(t * theta) * v2) / torch.sin(theta)
    out = torch.where(colinear, (1 - t) * v1 + t * v2, out)
    if dim != -1 and not flatten:
        out = out.transpose(dim, -1)
    return out.reshape(shape)


register_merge_method(NuSlerp())
