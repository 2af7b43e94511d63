"""Data-free linear merges: simple weight averaging and task arithmetic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .._validation import param
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams
from .svc import alpha_param, calibrate_param

if TYPE_CHECKING:
    import torch


class _EntryByEntry(MergeMethod):
    """A merge computed entry by entry with no threshold: the merger may take a large tensor in flat pieces (no q
    float32 copies of it, and no whole-tensor temporaries, each a fresh mapping faulted in page by page)."""

    def chunk_keep_counts(self, numel: int, ctx: MergeContext, name: str | None = None) -> list[int]:
        return []

    def merge_chunk(self, name, base, sources, ctx: MergeContext, thresholds: list[float]) -> torch.Tensor:
        return self.merge_tensor(name, base, sources, ctx)  # entry by entry: the whole tensor's bits


@dataclass(frozen=True)
class AverageParams(MethodParams):
    calibrate: str | None = calibrate_param()
    alpha: float | None = alpha_param(0.1)

    SVC_ALPHA: ClassVar[float] = 0.1


class Average(_EntryByEntry):
    """θ = Σ_p α_p θ_p with α normalised to sum to 1 (uniform by default)."""

    name = "average"
    pretty_name = "Simple averaging"
    reference = "Wortsman et al., Model soups, ICML 2022"
    reference_url = "https://arxiv.org/abs/2203.05482"
    params_class = AverageParams
    per_model_params = ("weight",)

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        alpha = ctx.weights / ctx.weights.sum()
        return sum(a * t for a, t in zip(alpha.tolist(), sources))


@dataclass(frozen=True)
class TaskArithmeticParams(MethodParams):
    lam: float = param(0.3, "λ, the scale of the summed task vectors (the reference code's s·mean is λ = s/q).")
    calibrate: str | None = calibrate_param()
    alpha: float | None = alpha_param(0.1)

    SVC_ALPHA: ClassVar[float] = 0.1


class TaskArithmetic(_EntryByEntry):
    """θ = θ₀ + λ·Σ_p α_p τ_p with α_p = 1 by default."""

    name = "task_arithmetic"
    pretty_name = "Task arithmetic"
    reference = "Ilharco et al., Editing models with task arithmetic, ICLR 2023"
    reference_url = "https://arxiv.org/abs/2212.04089"
    params_class = TaskArithmeticParams
    per_model_params = ("weight",)
    zero_delta_is_base = True
    default_weight = "one"
    signed_weights = True
    """Weights may be negative (task negation: θ₀ − λτ forgets what τ taught), as in the paper and mergekit."""

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        delta = sum(a * (t - base) for a, t in zip(ctx.weights.tolist(), sources))
        return base + ctx.params.lam * delta


register_merge_method(Average())
register_merge_method(TaskArithmetic())
