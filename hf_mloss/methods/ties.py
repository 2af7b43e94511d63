"""TIES-Merging: trim each task vector, elect a sign per entry, average the agreeing entries.

Peers differ in small conventions; ``convention=`` reproduces each of them exactly (see :data:`CONVENTIONS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .._validation import param
from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams
from .svc import alpha_param, calibrate_param

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TiesConvention:
    """How one implementation trims, elects and divides."""

    scope: str
    min_keep: int = 0
    extra_keep: int = 0
    elect: str = "weighted"
    divide_by: str = "weights"
    majority_zero_sign: bool = False
    """Where the summed trimmed deltas are exactly 0, elect the sign held by most entries of the whole model."""
    exact_k: bool = False
    """Keep exactly the count (argsort order at ties) instead of every entry >= the threshold."""
    description: str = ""


CONVENTIONS: dict[str, TiesConvention] = {
    "hf_mloss": TiesConvention(
        "global", description="SPEC semantics: keep floor(n·k), elect on Σα·τ (zero → +1), divide by Σ agreeing α"
    ),
    "mergekit": TiesConvention(
        "tensor", min_keep=1, exact_k=True, description="mergekit `ties`: per tensor, exactly max(1, floor(n·k)) kept "
        "(argsort order at ties), elect on weighted deltas, "
        "weighted disjoint mean (normalize: true)"
    ),
    "fusion_bench": TiesConvention(
        "global", extra_keep=1, majority_zero_sign=True, description="fusion-bench / original TIES code: global threshold at the "
        "(d − floor(d·k))-th smallest |τ| (one entry more than floor(d·k)), exact-zero sums take the model-wide majority sign, dis-mean"
    ),
    "peft": TiesConvention(
        "tensor", elect="unweighted", divide_by="count", description="PEFT `ties`: per tensor, elect on unweighted "
        "deltas, divide the weighted sum by the number of agreeing tasks"
    ),
}


BUDGETS = ("all", "changed")
"""``budget=``: the entries a global trim's k counts over (see :func:`global_thresholds`)."""
KEEP_HINT = "k is the fraction of each task vector that is KEPT (mergekit: density)."


@dataclass(frozen=True)
class TiesParams(MethodParams):
    k: float = param(0.2, "Keep fraction of each trim.", low=0.0, high=1.0, low_open=True, hint=KEEP_HINT)
    scope: str | None = param(None, "global (one threshold per task vector over the whole model) or tensor; default: "
                              "the convention's.", choices=("tensor", "global"))
    lam: float = param(1.0, "λ: θ = θ₀ + λ·τ_merged.")
    convention: str = param("hf_mloss", "Whose details to reproduce: hf_mloss, mergekit, fusion_bench or peft.",
                            choices=tuple(CONVENTIONS))
    budget: str = param("all", "Global scope: what k is a fraction of: all (every entry of the model, the original "
                        "definition) or changed (the entries a fine-tune changed, τ ≠ 0; for partly frozen "
                        "fine-tunes, whose unchanged zeros would otherwise fill the budget).", choices=BUDGETS)
    normalize: bool = param(True, "Divide the agreeing entries by their weights' sum (the disjoint mean of TIES; "
                            "false: their plain sum, mergekit normalize: false).")
    calibrate: str | None = calibrate_param()
    alpha: float | None = alpha_param(0.1)

    SVC_ALPHA: ClassVar[float] = 0.1

    @property
    def divide_by(self) -> str:
        """What the disjoint merge divides by: the convention's divisor, or nothing without ``normalize``."""
        return self.rules.divide_by if self.normalize else "none"

    @property
    def rules(self) -> TiesConvention:
        return CONVENTIONS[self.convention]

    @property
    def resolved_scope(self) -> str:
        return self.scope or self.rules.scope

    def resolved_defaults(self, q: int | None = None) -> dict[str, Any]:
        return {"scope": self.resolved_scope}


class Ties(MergeMethod):
    name = "ties"
    pretty_name = "TIES-Merging"
    reference = "Yadav et al., TIES-Merging: Resolving Interference When Merging Models, NeurIPS 2023"
    reference_url = "https://arxiv.org/abs/2306.01708"
    params_class = TiesParams
    per_model_params = ("weight", "k")
    zero_delta_is_base = True

    def prepare(self, ctx: MergeContext, visit) -> None:
        import torch

        params: TiesParams = ctx.params
        if params.resolved_scope != "global":
            return
        ctx.state["thresholds"] = global_thresholds(ctx, visit, params.k, extra=params.rules.extra_keep,
                                                    budget=params.budget)
        if params.rules.majority_zero_sign:
            balance = [0.0]  # a Python float: the visited tensors live on the run's device

            def count_signs(name, base, sources):
                trimmed = sum(self.trim_(name, t - base, i, ctx) for i, t in enumerate(sources))
                balance[0] += float(torch.sign(trimmed).sum(dtype=torch.float64))

            visit(count_signs)  # a third streaming pass, only for this convention
            ctx.state["zero_positive"] = balance[0] > 0

    def trim_(self, name: str, tau: torch.Tensor, index: int, ctx: MergeContext) -> torch.Tensor:
        """Trim source ``index``'s task vector ``tau`` in place (returns it)."""
        from .ops import keep_count, trim_by_threshold_, trim_exact, trim_tensor_

        params: TiesParams = ctx.params
        if params.resolved_scope == "global":
            return trim_by_threshold_(tau, ctx.state["thresholds"][index])
        rules, keep = params.rules, ctx.model_value(index, "k")
        if rules.exact_k:
            m = keep_count(tau.numel(), keep, min_keep=rules.min_keep, extra=rules.extra_keep)
            return tau.copy_(trim_exact(tau, m))
        return trim_tensor_(tau, keep, min_keep=rules.min_keep, extra=rules.extra_keep)

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        import torch

        from .ops import elect_and_merge

        params: TiesParams = ctx.params
        # All q task vectors in one [q, ...] buffer, trimmed in place: no per-source copies (ViT-B/32 x 8, per-tensor
        # TIES: merge() 17.9 s -> 9.7 s together with the bracketed threshold and the reused buffer of elect_and_merge).
        taus = torch.stack(sources).sub_(base)
        for i, tau in enumerate(taus):
            self.trim_(name, tau, i, ctx)
        merged = elect_and_merge(taus, ctx.weights, elect=params.rules.elect, divide_by=params.divide_by,
                                 zero_positive=ctx.state.get("zero_positive", True))
        return base + params.lam * merged


    def chunk_keep_counts(self, numel: int, ctx: MergeContext, name: str | None = None) -> list[int] | None:
        from .ops import keep_count

        params: TiesParams = ctx.params
        if params.resolved_scope == "global":
            return []  # the thresholds are the whole model's, known before any tensor is merged
        rules = params.rules
        if rules.exact_k:
            return None  # argsort order at ties: needs the whole tensor
        return [keep_count(numel, ctx.model_value(i, "k"), min_keep=rules.min_keep, extra=rules.extra_keep)
                for i in range(len(ctx.weights))]

    def merge_chunk(self, name, base, sources, ctx: MergeContext, thresholds: list[float]) -> torch.Tensor:
        from .ops import trim_elect_merge

        params: TiesParams = ctx.params
        if params.resolved_scope == "global":
            thresholds = ctx.state["thresholds"]
        # merge_tensor's steps, a per-tensor trim keeping |τ| >= its whole-tensor threshold
        return trim_elect_merge(base, sources, thresholds, ctx.weights, lam=params.lam, elect=params.rules.elect,
                                divide_by=params.divide_by, zero_positive=ctx.state.get("zero_positive", True))


def global_thresholds(ctx: MergeContext, visit, keep: float, *, extra: int = 0, budget: str = "all"
                      ) -> list[float]:
    """Per task vector, the exact magnitude threshold of a global top-``keep`` trim (two streaming passes).

    ``budget="all"`` keeps ``floor(d·keep)`` of the d entries of the whole model (TIES's definition);
    ``budget="changed"`` keeps ``floor(c·keep)`` of the c entries the task vector changed (τ ≠ 0), counted in pass 1:
    with most of a model frozen, the unchanged zeros fill an "all" budget and the trim keeps every trained entry."""
    import torch

    from .ops import ExactKthLargest, keep_count

    total = ctx.state["total_numel"]  # float elements of one task vector, known from the headers
    selectors = [ExactKthLargest(keep_count(total, keep, extra=extra)) for _ in range(len(ctx.weights))]
    changed = [0] * len(selectors)

    def pass1(name, base, sources):
        for i, (selector, t) in enumerate(zip(selectors, sources)):
            magnitude = (t - base).abs()
            selector.add_pass1(magnitude)
            if budget == "changed":
                changed[i] += int(torch.count_nonzero(magnitude))

    def pass2(name, base, sources):
        for selector, t in zip(selectors, sources):
            selector.add_pass2((t - base).abs())

    visit(pass1)
    for selector, count in zip(selectors, changed):
        if budget == "changed":
            selector.m = keep_count(count, keep, extra=extra)
        selector.finish_pass1()
    visit(pass2)
    return [selector.value() for selector in selectors]


register_merge_method(Ties())
