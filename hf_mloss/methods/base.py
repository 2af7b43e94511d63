"""The merge-method protocol.

A method declares its parameters as a frozen dataclass (fields made with :func:`~hf_mloss._validation.param`: help,
type, range and choices in one place) and merges one tensor at a time: it sees the base tensor and the q fine-tuned
tensors (float32) and returns the merged tensor. A method that needs a pass over the whole model first (global TIES
thresholds) implements :meth:`MergeMethod.prepare`. A data-guided method (M-TIES) sets ``needs_data`` and returns
:class:`LayerHooks` from :meth:`MergeMethod.layer_hooks`: the driver runs the M-Loss scorer block by block and calls
the hooks, which decide what to merge when; the driver itself names no method.

Method modules import torch only inside functions, so listing methods (``hf-mloss methods``) stays fast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .._validation import did_you_mean, field_help, validate_fields
from ..errors import InvalidParameterError

if TYPE_CHECKING:
    import torch

    from ..adapters import ModelAdapter
    from ..spec.options import ScoringOptions

PARAMETER_ALIASES = {"density": "k", "threshold": "k", "lambda": "lam", "scaling_factor": "lam", "lambda_": "lam",
                     "epsilon": "e", "drop_rate": "p", "keep": "k", "weight": "weights"}
"""Names users bring from other libraries (mergekit, fusion_bench), for "did you mean" hints."""


@dataclass(frozen=True)
class MethodParams:
    """Base of every method's parameter dataclass: fields are checked from their declarations on construction."""

    def __post_init__(self) -> None:
        validate_fields(self)
        if getattr(self, "alpha", None) is not None and getattr(self, "calibrate", "absent") is None:
            raise InvalidParameterError(f"alpha={self.alpha} is Singular Value Calibration's floor and only applies "
                                        "with calibrate='svc'; pass calibrate='svc' too (or drop alpha).")
        self.check()

    def check(self) -> None:
        """Cross-field rules (e.g. ``0 <= e < k``); single-field rules live in the field declarations."""

    @classmethod
    def from_kwargs(cls, method: str, kwargs: Mapping[str, Any]) -> MethodParams:
        """Build the parameters of ``method`` from keyword arguments, refusing unknown names with a suggestion."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in kwargs:
            if key == "calibrate" and key not in names:
                raise InvalidParameterError(
                    f"calibrate: Singular Value Calibration rescales a merged task matrix θ − θ₀, and method "
                    f"{method!r} does not yield one it could calibrate; the methods that take calibrate='svc' list "
                    "it among their parameters (`hf-mloss methods`).")
            if key not in names:
                hint = did_you_mean(key, names, {a: t for a, t in PARAMETER_ALIASES.items() if t in names})
                valid = ", ".join(f"{n} (default {d!r})" for n, d in cls.shown_defaults().items()) or "none"
                raise InvalidParameterError(f"Unknown parameter {key!r}{hint} for method {method!r}; valid "
                                            f"parameters: {valid}.")
        return cls(**kwargs)

    def resolved_defaults(self, q: int | None = None) -> dict[str, Any]:
        """What a parameter left at ``None`` stands for, as every surface (card, CLI, ``hf-mloss methods``, errors)
        shows it: TIES's ``scope`` resolved from its convention, TSV-M's ``fraction`` as 1/q (``q``: the number of
        models, when known)."""
        return {}

    @classmethod
    def shown_defaults(cls) -> dict[str, Any]:
        """Every parameter's default as the surfaces show it (``None`` defaults resolved where they stand for a
        value)."""
        defaults = {name: default for name, (default, _) in field_help(cls).items()}
        try:
            resolved = cls().resolved_defaults()
        except (TypeError, ValueError):  # parameters without defaults, or defaults that only hold together
            resolved = {}
        return {name: resolved.get(name, default) for name, default in defaults.items()}

    def to_dict(self) -> dict[str, Any]:
        """Plain values (tuples as lists), as written to configs."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}


@dataclass
class MergeContext:
    """What a method sees besides the tensors: weights, parameters, seed, and per-merge state."""

    params: Any
    weights: torch.Tensor
    seed: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    model_params: list[dict[str, Any]] | None = None
    """Per source, the values of this tensor's per-model parameters (``k``, ``p``...) that replace ``params``'s."""

    def model_value(self, index: int, name: str) -> Any:
        """Parameter ``name`` of source ``index`` for this tensor: its per-model value, else the shared one."""
        if self.model_params is not None and name in self.model_params[index]:
            return self.model_params[index][name]
        return getattr(self.params, name)

    def generator(self, name: str, source_index: int, device: torch.device | str = "cpu") -> torch.Generator:
        """A private generator for (tensor, source): reproducible and independent of visiting order."""
        import torch

        from .ops import tensor_seed

        return torch.Generator(device=device).manual_seed(tensor_seed(self.seed, name, source_index))


class LayerwiseRun:
    """What the merge driver offers a data-guided method's hooks (implemented in :mod:`hf_mloss.merging.stages`)."""

    ctx: MergeContext
    adapter: ModelAdapter
    device: torch.device

    def stage_names(self, stage: int) -> list[str]:
        """Canonical names of the float tensors of a stage (-1 embeddings, 0..L-1 blocks, L the tail)."""
        raise NotImplementedError

    def merge(self, names: list[str]) -> None:
        """Merge these tensors into the model now (tensors already merged are skipped)."""
        raise NotImplementedError

    def merge_remaining(self) -> None:
        """Merge every tensor not merged yet."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a merged tensor (canonical name)."""
        raise NotImplementedError

    def record(self, kind: str, target: str, values: torch.Tensor) -> None:
        """Keep per-row values of a scored linear for the report (e.g. ``kind="keep_ratios"``)."""
        raise NotImplementedError


class LayerHooks:
    """Callbacks of a layer-by-layer scoring pass; a data-guided method subclasses it.

    With ``prefix="merged"`` the scorer calls ``before_stage`` before each stage's forward, ``after_scores`` once a
    block's scored linear has its (process-reduced) M-Loss, and ``after_all`` at the end, so the model that computes
    the next block's input already holds the merged blocks before it. With ``"own"``/``"base"`` every block is scored
    first, then ``after_scores`` runs for each block and ``after_all`` at the end.
    """

    def before_stage(self, stage: int) -> None:
        """Before the stage's forward: merge what the stage needs (not what waits for its scores)."""

    def after_scores(self, layer: int, scores: Any) -> None:
        """``scores`` (:class:`hf_mloss.engine.score.LayerScores`) of ``layer``'s scored linear are known."""

    def after_all(self) -> None:
        """After the last block: merge what is left."""


class MergeMethod:
    """Base class of registered merge methods."""

    name: ClassVar[str]
    pretty_name: ClassVar[str]
    reference: ClassVar[str]
    """Paper (authors, title, venue) the method comes from; cited in model cards."""
    reference_url: ClassVar[str]
    params_class: ClassVar[type[MethodParams]]
    needs_data: ClassVar[bool] = False
    default_weight: ClassVar[str] = "uniform"
    accepts_models: ClassVar[tuple[int, int | None]] = (1, None)
    """How many fine-tuned models the method merges: (at least, at most; None: any number)."""
    """``"uniform"``: α_p = 1/q when the caller gives no weights; ``"one"``: α_p = 1 (task arithmetic)."""
    per_model_params: ClassVar[tuple[str, ...]] = ()
    """Parameters a model may set for itself (``models[i].parameters``, mergekit's per-model scope): ``weight`` when
    the merge reads the weights per tensor, and the method parameters it reads with :meth:`MergeContext.model_value`.
    """
    zero_delta_is_base: ClassVar[bool] = False
    """The merge is θ₀ + f(τ_1, …, τ_q) with f(0, …, 0) = 0 exactly: a tensor that no source changed is copied from
    the base without calling :meth:`merge_tensor` (frozen parts of fine-tunes: embeddings, lower blocks)."""

    def make_params(self, **kwargs: Any) -> MethodParams:
        return self.params_class.from_kwargs(self.name, kwargs)

    def scales_with_lam(self, parameters: Mapping[str, Any]) -> bool:
        """Whether the merge with these parameter values is θ₀ + λ·τ with τ independent of λ: the label-free
        searches then merge τ once and write every λ of a grid from it. False without a ``lam``, for a calibrated
        merge (SVC acts on θ − θ₀ after λ), and for a method whose λ scales only part of θ − θ₀ (CART)."""
        return "lam" in parameters and parameters.get("calibrate") is None

    def weighted_as(self, params: MethodParams) -> MergeMethod:
        """The method whose default weighting the merge used (itself; ``auto``: the method it chose)."""
        return self

    def prepare(self, ctx: MergeContext,
                visit: Callable[[Callable[[str, torch.Tensor, list[torch.Tensor]], None]], None]) -> None:
        """Optional whole-model pre-pass; ``visit(fn)`` calls ``fn(name, base, sources)`` for every float tensor."""

    def merge_tensor(self, name: str, base: torch.Tensor, sources: list[torch.Tensor], ctx: MergeContext
                     ) -> torch.Tensor:
        raise NotImplementedError

    def chunk_keep_counts(self, numel: int, ctx: MergeContext, name: str | None = None) -> list[int] | None:
        """Whether a tensor of ``numel`` entries may be merged in flat chunks (what :meth:`merge_chunk` needs).

        A method whose merge is element-wise once each task vector's magnitude threshold over the whole tensor is
        known returns, per source, how many entries of ``|τ_i|`` that threshold keeps (an empty list when it needs
        no per-tensor threshold). The driver then merges a large tensor (a 151936 × 896 embedding) chunk by chunk,
        never holding q float32 copies of it. ``None`` (the default): the tensor is merged whole. ``name``: the
        tensor's canonical name, for a method whose rule differs between tensors.
        """
        return None

    def merge_chunk(self, name: str, base: torch.Tensor, sources: list[torch.Tensor], ctx: MergeContext,
                    thresholds: list[float]) -> torch.Tensor:
        """:meth:`merge_tensor`'s values on one flat chunk; ``thresholds[i]``: the ``counts[i]``-th largest
        ``|τ_i|`` of the whole tensor (``counts`` from :meth:`chunk_keep_counts`)."""
        raise NotImplementedError(f"method {self.name!r} merges whole tensors only")

    def slice_dim(self, name: str, ctx: MergeContext) -> int | None:
        """A dim of ``name`` (2-D) whose slices the method merges independently of each other (M-TIES's node groups:
        each row or column trimmed at its own keep ratio, then element-wise rules), so the driver may merge a large
        tensor a block of whole slices at a time with :meth:`merge_slices`, never holding q float32 copies of all of
        it. ``None`` (the default): not such a tensor."""
        return None

    def merge_slices(self, name: str, base: torch.Tensor, sources: list[torch.Tensor], ctx: MergeContext,
                     slices: slice) -> torch.Tensor:
        """:meth:`merge_tensor`'s values on slices ``slices`` along :meth:`slice_dim` (``base`` and ``sources``
        hold just those slices)."""
        raise NotImplementedError(f"method {self.name!r} merges whole tensors only")

    def unchanged(self, name: str, ctx: MergeContext) -> None:
        """Called when :meth:`merge_slices` merged every slice of ``name`` and no source had changed it: forget any
        state the slices left, as a whole-tensor merge would have left none (it copies such a tensor)."""

    def scoring_options(self, params: MethodParams) -> ScoringOptions:
        """How a data-guided method's M-Loss is measured (its parameters usually extend ``ScoringOptions``)."""
        return params.scoring_options()  # type: ignore[attr-defined]

    def layer_hooks(self, run: LayerwiseRun) -> LayerHooks:
        """The hooks that merge while the scorer walks the blocks (data-guided methods only)."""
        raise NotImplementedError(f"method {self.name!r} is data-free: it has no layer hooks")

    data_use: ClassVar[str] = ""
    """A data-guided method: what the data sets, in the card's words (``"M-Loss node keep ratios"``)."""
    reads_own_data: ClassVar[bool] = False
    """Whether the method reads each model's own data as that model's, as its paper does (RegMean's Grams, a learned
    merge's objective term per task, ``auto``'s comparison with each model); otherwise a run with per-model data
    reads their union (M-TIES, scoring)."""

    def data_free_rule(self, params: MethodParams, *, short: bool = False) -> str:
        """How a data-guided method merges a tensor no scoring data reaches (a tower given no data), in the card's
        words; ``short``: a few words (``"trimmed at k=0.2 (data-free)"``)."""
        return "data-free" if short else "the method's data-free rule"

    def describe(self, params: MethodParams) -> str:
        return f"{self.pretty_name} ({self.reference})"
