"""NearSwap: take the other model's value where it lies close to the base's, keep the base's where they differ.

mergekit 0.1.5's ``nearswap``, entry by entry: ``w = clamp(t / max(|θ₀ − θ₁|, 1e-6), 0, 1)`` and
``θ = w·θ₁ + (1 − w)·θ₀``: entries that moved by at most ``t`` become the other model's, larger moves are damped
in proportion ``t / |θ₀ − θ₁|``. Exactly one model besides the base.
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

DIFF_FLOOR = 1e-6
"""|θ₀ − θ₁| is floored here before dividing (mergekit's value)."""


@dataclass(frozen=True)
class NearSwapParams(MethodParams):
    t: float | None = param(None, "Distance up to which an entry takes the other model's value (required; mergekit: "
                            "t).", low=0.0)


class NearSwap(MergeMethod):
    """θ = w·θ₁ + (1 − w)·θ₀ with w = clamp(t / |θ₀ − θ₁|, 0, 1), per entry; one model besides the base."""

    name = "nearswap"
    pretty_name = "NearSwap"
    reference = "alchemonaut, QuartetAnemoi-70B-t0.0001 (model card introducing NearSwap)"
    reference_url = "https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001"
    params_class = NearSwapParams
    accepts_models = (1, 1)
    zero_delta_is_base = True  # θ₁ = θ₀: w·θ₀ + (1 − w)·θ₀ with w = 1 is θ₀
    required_parameters = {"t": "the distance up to which the other model's values are taken (e.g. t=0.0001)"}
    """Parameters without a default a config must give: a number, a gradient or a filter list (checked when the
    config is built; resolved per tensor like any parameter)."""

    def prepare(self, ctx: MergeContext, visit) -> None:
        if len(ctx.weights) != 1:
            raise InvalidParameterError(f"nearswap takes the base and exactly one other model, got {len(ctx.weights)} "
                                        "models.")

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        if ctx.params.t is None:  # given as a filter list that no entry of matches this tensor
            raise InvalidParameterError(f"nearswap needs t for {name!r}, {self.required_parameters['t']}; the filter "
                                        "list for t gives this tensor none: end it with a {value: ...} entry.")
        other = sources[0]
        weight = (ctx.params.t / (base - other).abs().clamp(min=DIFF_FLOOR)).clamp(min=0, max=1)
        return weight * other + (1 - weight) * base


register_merge_method(NearSwap())
