"""Karcher mean: the weighted Riemannian (Fréchet) mean of the models' directions on the unit hypersphere, scaled by
their mean norm.

mergekit 0.1.5's ``karcher``, per tensor (each tensor one vector), every model weighted 1/n (the base model, when a
config names one, is one more model: mergekit averages it in). Models whose norm is at most ``tol`` are left out of
the direction; the start is the normalised mean of the unit vectors (the first unit vector if that mean is shorter
than ``tol``); each of at most ``max_iter`` steps moves along ``Σ α_p θ_p / sin θ_p · (u_p − cos θ_p · m)`` (terms with
``θ_p < tol`` skipped) by the exponential map, stopping when that tangent is shorter than ``tol``. The result is the
mean direction times ``Σ_p ‖θ_p‖ / n`` (every model's norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._validation import param
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KarcherParams(MethodParams):
    max_iter: int = param(10, "Most iterations of the Riemannian gradient steps.", low=0)
    tol: float = param(1e-5, "Norms, angles and steps below this count as zero.", low=0.0)


class Karcher(MergeMethod):
    """θ = mean norm · Karcher mean of the unit directions of θ_1, …, θ_n, per tensor; weights unused (1/n)."""

    name = "karcher"
    pretty_name = "Karcher mean (Riemannian mean on the hypersphere)"
    reference = ("Karcher, Riemannian center of mass and mollifier smoothing, Comm. Pure Appl. Math. 1977; for model "
                 "merging: arXiv:2603.04972 (mergekit's reference)")
    reference_url = "https://arxiv.org/abs/2603.04972"
    params_class = KarcherParams

    def prepare(self, ctx: MergeContext, visit) -> None:
        from ..errors import InvalidParameterError

        if len(set(ctx.weights.tolist())) > 1:
            raise InvalidParameterError(f"karcher takes no weights (every model counts 1/n), got "
                                        f"{ctx.weights.tolist()}; drop the weights.")

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        if len(sources) == 1:
            return sources[0].clone()
        return karcher_mean(sources, [1.0 / len(sources)] * len(sources), max_iter=ctx.params.max_iter,
                            tol=ctx.params.tol)


def karcher_mean(tensors: list[torch.Tensor], alphas: list[float], *, max_iter: int = 10, tol: float = 1e-5
                 ) -> torch.Tensor:
    """The weighted Karcher mean direction of ``tensors`` scaled by ``Σ α_p ‖θ_p‖`` (float32 arithmetic)."""
    import torch

    norms = [torch.linalg.vector_norm(t) for t in tensors]
    units = [torch.zeros_like(t) if n.item() == 0.0 else t / n for t, n in zip(tensors, norms)]
    valid = [i for i, n in enumerate(norms) if n.item() > tol]
    if not valid:
        return sum(t * 0 for t in tensors)
    total = sum(alphas[i] for i in valid)
    weights = [alphas[i] / total for i in valid]
    directions = [units[i] for i in valid]
    mean = torch.zeros_like(directions[0])
    for w, u in zip(weights, directions):
        mean += w * u
    mean_norm = torch.linalg.vector_norm(mean)
    mean = directions[0].clone() if mean_norm.item() < tol else mean / mean_norm
    for _ in range(max_iter):
        tangent = torch.zeros_like(mean)
        for w, u in zip(weights, directions):
            cos = torch.clamp(torch.dot(mean.flatten(), u.flatten()), -1.0, 1.0)
            angle = torch.arccos(cos)
            if angle.item() < tol:
                continue
            tangent += w * (angle / torch.sin(angle)) * (u - cos * mean)
        step = torch.linalg.vector_norm(tangent)
        if step.item() < tol:
            break
        mean = torch.cos(step) * mean + torch.sin(step) * (tangent / step)
        length = torch.linalg.vector_norm(mean)
        if length.item() > tol:
            mean = mean / length
    return sum(a * n for a, n in zip(alphas, norms)) * mean


register_merge_method(Karcher())
