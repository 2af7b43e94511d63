"""Multi-SLERP: a weighted interpolation of any number of models (or task vectors) on the hypersphere.

mergekit 0.1.5's ``multislerp``, per tensor (each tensor one vector): the vectors v_p (task vectors θ_p − θ₀ when a
base is given, else the models) are normalised (``u_p = v_p / (‖v_p‖ + eps)``); their weighted mean ``m = Σ w_p u_p``
(weights divided by their sum with ``normalize_weights``) is normalised; each ``u_p`` is projected onto the tangent
space at ``m`` and the weighted tangent ``g = Σ w_p (u_p − (u_p·m) m)`` is mapped back with the exponential map,
``m cos‖g‖ + g sin‖g‖ / ‖g‖`` (``‖g‖`` plus eps), then scaled by the weighted mean norm ``Σ w_p ‖v_p‖``. A single
model is returned as it is; a tensor no model changed is the base's. Where ``‖m‖ < eps`` two vectors are interpolated linearly and more are refused (the
weighted directions cancel), as in mergekit.
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


@dataclass(frozen=True)
class MultiSlerpParams(MethodParams):
    task_vectors: bool = param(True, "Interpolate the task vectors θ_p − θ₀ and add them to the base (mergekit: a "
                               "base_model is given); false: interpolate the models themselves.")
    normalize_weights: bool = param(True, "Divide the weights by their sum.")
    eps: float = param(1e-8, "Added to norms before dividing by them.", low=0.0)


class MultiSlerp(MergeMethod):
    """θ = θ₀ + multislerp(τ_1, …, τ_q; w) (or multislerp(θ_1, …, θ_q; w)) per tensor."""

    name = "multislerp"
    pretty_name = "Multi-SLERP (barycentric interpolation on the hypersphere)"
    reference = "Goddard, Multi-SLERP (blog post)"
    reference_url = "https://goddard.blog/posts/multislerp-wow-what-a-cool-idea"
    params_class = MultiSlerpParams
    per_model_params = ("weight",)

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        import torch

        params: MultiSlerpParams = ctx.params
        if len(sources) == 1:
            return sources[0].clone()
        stacked = torch.stack(sources)
        if params.task_vectors:
            stacked -= base
            if not stacked.any():  # no model changed this tensor: the base (mergekit refuses 3+ zero vectors)
                return base.clone()
        flat = stacked.view(stacked.shape[0], -1)
        weights = ctx.weights.to(flat)
        if params.normalize_weights:
            weights = weights / weights.sum()
        norms = torch.norm(flat, dim=-1, keepdim=True)
        units = flat / (norms + params.eps)
        mean = (units * weights.view(-1, 1)).sum(0)
        mean_norm = torch.norm(mean)
        if mean_norm < params.eps:
            if stacked.shape[0] != 2:
                raise InvalidParameterError(
                    f"multislerp: the weighted directions of {name!r} cancel (their weighted mean is 0), so there is "
                    "no point to interpolate around; change the weights (mergekit refuses this too).")
            out = (stacked[0] * weights[0] + stacked[1] * weights[1]).view(stacked.shape[1:])
        else:
            mean = mean / mean_norm
            tangents = units - (units * mean).sum(-1, keepdim=True) * mean
            tangent = (tangents * weights.view(-1, 1)).sum(0)
            tangent_norm = torch.norm(tangent) + params.eps
            out = mean * torch.cos(tangent_norm) + tangent * (torch.sin(tangent_norm) / tangent_norm)
            out = (out * (norms.squeeze(-1) * weights).sum()).view(stacked.shape[1:])
        return out + base if params.task_vectors else out


register_merge_method(MultiSlerp())
