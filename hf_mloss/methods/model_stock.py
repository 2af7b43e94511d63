"""Model Stock: move from the base towards the average of the fine-tunes by a ratio set by their angle.

With N ≥ 2 fine-tunes whose task vectors meet at the mean pairwise cosine ``c``, the merge is
``θ = t·mean(θ_p) + (1 − t)·θ₀`` with ``t = N·c / (1 + (N − 1)·c)`` (Jang et al., eq. 5 generalised to N models),
computed per tensor (or per row with ``filter_wise``), as mergekit does:

* cosines use ``max(‖τ_a‖·‖τ_b‖, 1e-6)`` as denominator and are clipped to [−1, 1];
* where ``|1 + (N − 1)·c| < 1e-6`` (no finite ratio) the base is kept (t = 0);
* ``filter_wise`` takes each slice along the last axis as one vector (rows of a linear weight; a 1-D tensor is one
  row), so every row gets its own ratio.
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

NORM_PRODUCT_FLOOR = 1e-6
SINGULAR = 1e-6


@dataclass(frozen=True)
class ModelStockParams(MethodParams):
    filter_wise: bool = param(False, "One ratio per row (slice along the last axis) instead of one per tensor.")


class ModelStock(MergeMethod):
    """θ = t·mean_p θ_p + (1 − t)·θ₀ with t from the mean pairwise cosine of the task vectors; weights unused."""

    name = "model_stock"
    pretty_name = "Model Stock"
    reference = "Jang, Yun & Han, Model Stock: All we need is just a few fine-tuned models, ECCV 2024"
    reference_url = "https://arxiv.org/abs/2403.19522"
    params_class = ModelStockParams
    accepts_models = (2, None)
    zero_delta_is_base = True  # all task vectors 0: every cosine is 0, so t = 0 and the base is returned exactly

    def prepare(self, ctx: MergeContext, visit) -> None:
        if len(ctx.weights) < 2:
            raise InvalidParameterError(
                f"model_stock needs at least 2 fine-tuned models (their angle sets the ratio), got {len(ctx.weights)}.")
        if len(set(ctx.weights.tolist())) > 1:
            raise InvalidParameterError(f"model_stock takes no weights (the models' angle sets the ratio), got "
                                        f"{ctx.weights.tolist()}; drop the weights.")

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        filter_wise = ctx.params.filter_wise
        shape = ratio_shape(base, filter_wise)
        ratio = interpolation_ratio(base, sources, filter_wise=filter_wise)
        average = sum(s.reshape(shape) for s in sources) / len(sources)
        return (ratio * average + (1 - ratio) * base.reshape(shape)).reshape(base.shape)

def ratio_shape(base: torch.Tensor, filter_wise: bool) -> tuple[int, ...]:
    """The shape in which the ratio broadcasts: ``[-1]`` per tensor, ``[..., n]`` per row."""
    if not filter_wise:
        return (-1,)
    return tuple(base.shape) if base.dim() > 1 else (1, -1)


def interpolation_ratio(base: torch.Tensor, sources: list[torch.Tensor], *, filter_wise: bool = False
                        ) -> torch.Tensor:
    """Model Stock's t: a 1-element tensor (per tensor) or one value per row, shaped to broadcast (``[..., 1]``)."""
    import torch

    shape = ratio_shape(base, filter_wise)
    w0 = base.reshape(shape)
    offsets = [s.reshape(shape) - w0 for s in sources]
    cosines = []
    for i, a in enumerate(offsets):
        for b in offsets[i + 1:]:
            norms = torch.norm(a, dim=-1) * torch.norm(b, dim=-1)
            cosines.append(((a * b).sum(dim=-1) / norms.clamp(min=NORM_PRODUCT_FLOOR)).clamp(-1, 1))
    cos = torch.stack(cosines).mean(dim=0).unsqueeze(-1)
    n = len(sources)
    denominator = 1 + (n - 1) * cos
    singular = denominator.abs() < SINGULAR
    return torch.where(singular, torch.zeros_like(cos),
                       n * cos / torch.where(singular, torch.ones_like(denominator), denominator))


register_merge_method(ModelStock())
