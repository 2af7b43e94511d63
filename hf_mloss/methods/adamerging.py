"""AdaMerging and AdaMerging++: task-arithmetic coefficients learned on unlabeled data.

θ = θ₀ + Σ_p λ_{p,g} τ_p, one coefficient per task p and group g of tensors: ``granularity="layer"`` (every tensor
its own group: the paper's and fusion-bench's "layer-wise", one coefficient per parameter tensor), ``"block"`` (the
embeddings, each transformer block, the tail) or ``"task"`` (one per task). The coefficients start at ``init`` (0.3,
the paper's) and are trained with Adam to minimise an objective on unlabeled batches
(:mod:`hf_mloss.engine.objectives`; the training loop: :mod:`hf_mloss.merging.learned`). AdaMerging++
(``adamerging_ties``) learns them over TIES-processed task vectors: each τ_p trimmed to its top ``k`` magnitudes
(one threshold over the whole model), then only the entries whose sign agrees with the elected sign of Σ_p α_p τ̂_p
kept.

The learned coefficients are recorded in the recipe (``coefficients``: one row ``[group, λ_1, …, λ_q]`` per group):
a re-run merges from them without training, bit for bit; ``relearn=True`` trains again. This module holds the
parameters, the merge formula (:func:`combine`, shared by the training's functional merge and the saved merge,
so both give the same bits) and what the training loop asks of every learned method (:class:`LearnedMethod`,
:class:`LearnedParams`: also AdaRank's, :mod:`hf_mloss.methods.adarank`); it imports no training code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .._validation import did_you_mean, param
from ..errors import InvalidParameterError
from .base import MergeContext, MergeMethod, MethodParams
from .registry import register_merge_method

if TYPE_CHECKING:
    import torch

GRANULARITIES = ("layer", "block", "task")
SHARES = ("auto", "all")
MAX_STEPS = 100_000
MAX_SAMPLES = 1_000_000
COEFFICIENT_STATE = "coefficients"
"""``MergeContext.state`` key: ``(groups, values)``, the group of each tensor name and the ``[G, q]`` coefficients."""


BUILTIN_OBJECTIVES = ("entropy", "output_gap", "disagreement", "mloss")
"""The objectives :mod:`hf_mloss.engine.objectives` registers itself."""
OBJECTIVE_NAMES: set[str] = set(BUILTIN_OBJECTIVES)
"""The objective names a learned merge accepts: the built-in ones and every one
:func:`hf_mloss.engine.objectives.register_objective` adds (the registry, above the methods, tells them; a method
never imports it, and checking a name imports no torch)."""


@dataclass(frozen=True)
class LearnedParams(MethodParams):
    """The training options every learned merge shares (the loop: :mod:`hf_mloss.merging.learned`)."""

    objective: str = param("entropy", "What the learned parameters minimise on unlabeled data: entropy (the papers'; "
                           "encoders need heads), output_gap (the merge's outputs against the fine-tunes'), "
                           "disagreement (cross-entropy against each routed expert's top class / next token) or "
                           "mloss (summed normalised layer M-Loss along the merged prefix).")
    steps: int = param(100, "Adam steps.", low=1, high=MAX_STEPS)
    lr: float = param(1e-3, "Adam learning rate.", low=0.0, high=1.0, low_open=True)
    max_samples: int = param(256, "At most this many of the data's samples are used (a seeded spread over them).",
                             low=1, high=MAX_SAMPLES)
    share: str = param("auto", "With heads (and for disagreement): which expert each sample is compared with: auto "
                       "(label-free routing, as selection) or all (every sample with every expert).",
                       choices=SHARES)
    heads: tuple[Any, ...] | None = param(None, "Encoders: one classification head per model (safetensors files holding "
                                    "`weight` [classes, features] and `bias`, or, from Python, modules/callables).")
    relearn: bool = param(False, "Train again even when the learned values are recorded.")

    RECORDED: ClassVar[str] = ""
    """The parameter that holds the learned values once recorded (``coefficients``, ``masks``)."""

    def check(self) -> None:
        if self.objective not in OBJECTIVE_NAMES:
            raise InvalidParameterError(f"Unknown objective {self.objective!r}"
                                        f"{did_you_mean(self.objective, sorted(OBJECTIVE_NAMES))}; available: "
                                        f"{sorted(OBJECTIVE_NAMES)}.")
        for i, head in enumerate(self.heads or ()):
            if isinstance(head, Mapping) and "in_memory" in head and self.learns:
                raise InvalidParameterError(
                    f"heads[{i}] was passed from Python ({head['in_memory']}) when this recipe was written; a run "
                    "that trains needs it: pass the heads again (heads=[...]), or re-run with the recorded "
                    f"{self.RECORDED} (relearn: false).")

    @property
    def learns(self) -> bool:
        """Whether a run trains (nothing recorded, or ``relearn``)."""
        return getattr(self, self.RECORDED) is None or self.relearn


@dataclass(frozen=True)
class AdaMergingParams(LearnedParams):
    granularity: str = param("layer", "One coefficient per task and: layer (each parameter tensor, as the paper and "
                             "fusion-bench), block (embeddings, each transformer block, the tail) or task.",
                             choices=GRANULARITIES)
    init: float = param(0.3, "Initial value of every coefficient (the paper's 0.3).", low=-10.0, high=10.0)
    coefficients: tuple[tuple[Any, ...], ...] | None = param(None, "Recorded: the learned coefficients, one row [group, λ_1, "
                                                 "…, λ_q] per group; a re-run merges from them without training.")

    RECORDED: ClassVar[str] = "coefficients"

    def check(self) -> None:
        super().check()
        if self.coefficients is not None:
            parse_coefficients(self.coefficients)


@dataclass(frozen=True)
class AdaMergingTiesParams(AdaMergingParams):
    k: float = param(0.2, "TIES keep fraction of each task vector (one threshold over the whole model).", low=0.0,
                     high=1.0, low_open=True, hint="k is the fraction of each task vector that is KEPT.")


def parse_coefficients(rows: Sequence[Any]) -> tuple[list[str], list[list[float]]]:
    """``(groups, values)`` of recorded rows ``[group, λ_1, …, λ_q]``; refuses malformed rows."""
    groups, values = [], []
    for i, row in enumerate(rows):
        if (not isinstance(row, (list, tuple)) or len(row) < 2 or not isinstance(row[0], str)
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                           for v in row[1:])):
            raise InvalidParameterError(f"coefficients[{i}] must be [group name, λ_1, ..., λ_q] with finite numbers, "
                                        f"got {str(row)[:80]!r}.")
        if len(row) != len(rows[0]):
            raise InvalidParameterError(f"coefficients[{i}] has {len(row) - 1} values, coefficients[0] "
                                        f"{len(rows[0]) - 1}: every row holds one per model.")
        groups.append(row[0])
        values.append([float(v) for v in row[1:]])
    if len(set(groups)) != len(groups):
        raise InvalidParameterError("coefficients name a group twice.")
    return groups, values


def group_of(name: str, stage: int, num_layers: int, granularity: str) -> str:
    """The coefficient group of tensor ``name`` (in stage ``stage``: -1 embeddings, blocks, ``num_layers`` the
    tail)."""
    if granularity == "layer":
        return name
    if granularity == "task":
        return "all"
    return "embeddings" if stage < 0 else "tail" if stage >= num_layers else f"block.{stage}"


def combine(base: torch.Tensor, taus: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """θ₀ + Σ_p λ_p τ_p for stacked task vectors ``taus`` ``[q, ...]`` and ``coefficients`` ``[q]``: the one
    formula of the training's functional merge and of the saved merge (the same operations, the same bits)."""
    shape = (-1,) + (1,) * (taus.dim() - 1)
    return base + (coefficients.reshape(shape) * taus).sum(0)


@dataclass
class TrainedLayout:
    """Where each trained tensor's values lie in the one tensor the training optimises, and where they start."""

    slots: dict[str, Any]
    """Tensor name → its index into the trained tensor (a row of coefficients, a slice of mask logits); ``None``
    for a tensor whose merge has nothing to learn (it is fixed)."""
    initial: torch.Tensor
    labels: list[str] = field(default_factory=list)
    """adamerging: the coefficient groups, in row order."""
    count: int = 0
    """How many learned quantities the card reports (coefficient groups, component masks)."""
    title: str = "Coefficients"
    what: str = "coefficient groups"
    meta: dict[str, Any] = field(default_factory=dict)
    """Per tensor, what the method needs to record its values (adarank: whose components each slot holds)."""


class LearnedMethod(MergeMethod):
    """A merge whose parameters are trained on unlabeled data.

    The driver hands it to :mod:`hf_mloss.merging.learned`, which keeps one :meth:`functional_part` per changed
    tensor, optimises one tensor of values laid out by :meth:`layout` through :meth:`functional_tensor` (the merged
    tensor as a differentiable function of its values), then stores the learned values with :meth:`use_trained`
    (or the recorded ones with :meth:`use_recorded`) and merges tensor by tensor with :meth:`merge_tensor`, which
    applies the same formula: the functional merge and the saved one hold the same bits.
    """

    needs_data = True
    learned = True
    reads_own_data = True
    zero_delta_is_base = True
    default_weight = "one"

    def functional_part(self, name: str, base: torch.Tensor, sources: list[torch.Tensor], ctx: MergeContext) -> Any:
        """What the functional merge of tensor ``name`` keeps for the whole training (besides θ₀)."""
        raise NotImplementedError

    def layout(self, parts: Mapping[str, Any], adapter: Any, ctx: MergeContext) -> TrainedLayout:
        """The trained tensor's layout over the tensors of ``parts`` and its initial values."""
        raise NotImplementedError

    def functional_tensor(self, base: torch.Tensor, part: Any, values: torch.Tensor | None, params: Any
                          ) -> torch.Tensor:
        """The merged tensor for its trained ``values`` (``trained[slot]``; ``None`` for a fixed tensor)."""
        raise NotImplementedError

    def use_trained(self, ctx: MergeContext, layout: TrainedLayout, trained: torch.Tensor) -> dict[str, Any]:
        """Keep the learned values for :meth:`merge_tensor`; return the recipe parameters that record them."""
        raise NotImplementedError

    def use_recorded(self, ctx: MergeContext, names: Sequence[str], adapter: Any, q: int) -> None:
        """Keep the recipe's recorded values for :meth:`merge_tensor`, refusing values that do not fit the models
        (before any merge)."""
        raise NotImplementedError


def coefficient_groups(names: Sequence[str], adapter: Any, granularity: str) -> tuple[dict[str, int], dict[str, int]]:
    """``(label → index, tensor name → index)`` of the coefficient groups, in the order of ``names``."""
    labels: dict[str, int] = {}
    of: dict[str, int] = {}
    for name in names:
        label = group_of(name, adapter.stage_of(name), adapter.num_layers, granularity)
        of[name] = labels.setdefault(label, len(labels))
    return labels, of


class AdaMerging(LearnedMethod):
    """AdaMerging: task-arithmetic coefficients per task and layer, learned on unlabeled data."""

    name = "adamerging"
    pretty_name = "AdaMerging"
    reference = "Yang et al., AdaMerging: Adaptive Model Merging for Multi-Task Learning, ICLR 2024"
    reference_url = "https://arxiv.org/abs/2310.02575"
    params_class = AdaMergingParams

    def task_vectors(self, name: str, base: torch.Tensor, sources: list[torch.Tensor], ctx: MergeContext
                     ) -> torch.Tensor:
        """The stacked ``[q, ...]`` task vectors the coefficients scale."""
        import torch

        return torch.stack(sources).sub_(base)

    def functional_part(self, name, base, sources, ctx):
        return self.task_vectors(name, base, sources, ctx)

    def layout(self, parts, adapter, ctx):
        import torch

        labels, of = coefficient_groups(list(parts), adapter, ctx.params.granularity)
        q = len(ctx.weights)
        initial = torch.full((len(labels), q), ctx.params.init, dtype=torch.float32)
        return TrainedLayout(slots=of, initial=initial, labels=sorted(labels, key=labels.get), count=len(labels))

    def functional_tensor(self, base, part, values, params):
        return combine(base, part, values)

    def use_trained(self, ctx, layout, trained):
        values = trained.detach().float()
        ctx.state[COEFFICIENT_STATE] = (layout.slots, values)
        return {"coefficients": coefficient_rows({label: i for i, label in enumerate(layout.labels)}, values)}

    def use_recorded(self, ctx, names, adapter, q):
        import torch

        labels, of = coefficient_groups(names, adapter, ctx.params.granularity)
        recorded, rows = parse_coefficients(ctx.params.coefficients)
        if set(recorded) != set(labels) or len(rows[0]) != q:
            extra = sorted(set(recorded) - set(labels))[:3]
            lacking = sorted(set(labels) - set(recorded))[:3]
            raise InvalidParameterError(
                f"The recorded coefficients do not fit these models ({len(rows[0])} values per group for {q} models; "
                f"groups not merged here: {extra}; groups without a coefficient: {lacking}). Pass relearn=True to "
                "train them again.")
        position = {label: i for i, label in enumerate(recorded)}
        values = torch.tensor([rows[position[label]] for label in sorted(labels, key=labels.get)],
                              dtype=torch.float32)
        ctx.state[COEFFICIENT_STATE] = (of, values)

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        groups, values = ctx.state[COEFFICIENT_STATE]
        if name not in groups:
            raise InvalidParameterError(f"No learned coefficient for {name!r}: the recorded coefficients do not fit "
                                        "these models (pass relearn=True).")
        return combine(base, self.task_vectors(name, base, sources, ctx), values[groups[name]].to(base))

    def describe(self, params: MethodParams) -> str:
        return (f"{self.pretty_name} ({self.reference}): {params.granularity}-wise coefficients learned with the "
                f"{params.objective!r} objective")


class AdaMergingTies(AdaMerging):
    """AdaMerging++: the coefficients scale TIES-trimmed, sign-elected task vectors."""

    name = "adamerging_ties"
    pretty_name = "AdaMerging++"
    params_class = AdaMergingTiesParams

    def prepare(self, ctx: MergeContext, visit) -> None:
        from .ties import global_thresholds

        ctx.state["thresholds"] = global_thresholds(ctx, visit, ctx.params.k)

    def task_vectors(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        import torch

        from .ops import trim_by_threshold_

        taus = torch.stack(sources).sub_(base)
        for tau, threshold in zip(taus, ctx.state["thresholds"]):
            trim_by_threshold_(tau, threshold)
        weights = ctx.weights.to(taus).reshape((-1,) + (1,) * (taus.dim() - 1))
        elected = torch.sign((weights * taus).sum(0))
        elected[elected == 0] = 1
        return taus.mul_(torch.sign(taus) == elected)


def coefficient_rows(groups: Mapping[str, int], values: torch.Tensor) -> list[list[Any]]:
    """Recorded rows ``[group, λ_1, …, λ_q]`` (float32 values as Python floats: exact after a YAML round trip)."""
    names = sorted(groups, key=groups.get)
    return [[name, *[float(v) for v in values[groups[name]].float().tolist()]] for name in names]


register_merge_method(AdaMerging())
register_merge_method(AdaMergingTies())
