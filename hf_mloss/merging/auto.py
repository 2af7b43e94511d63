"""``method="auto"``: every candidate merge scored without labels, the best one written (see
:mod:`hf_mloss.methods.auto` for what is compared and recorded).

The search reuses label-free selection's parts (:mod:`hf_mloss.merging.selection`): one :class:`CandidateBuilder`
merges each candidate's direction τ (at λ = 1) into a scratch copy of the model and writes θ₀ + λ·τ for each λ; one
:class:`CandidateEvaluator` holds the experts' outputs on the selection samples, computed once for every candidate.
So the work is one merge per candidate method (and per setting of its other parameters), one forward pass of the
selection samples per candidate, and the experts' forwards once.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import HfMLossError, InvalidParameterError

if TYPE_CHECKING:
    from ..loading.inputs import RunInputs
    from ..output.report import MLossReport
    from ..spec.config import MergeConfig
    from .merger import TensorMerger


def choose_and_merge(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, model: Any, *,
                     progress: bool = True, token: Any = None) -> tuple[MergeConfig, MLossReport | None]:
    """Choose the merge (or take the recorded choice), write it into ``merger``'s model, and return the config as it
    ran (the choice and every candidate's values recorded) with the chosen merge's M-Loss report, if measured."""
    from ..methods.auto import FALLBACK

    params = merger.ctx.params
    if not params.chooses:
        chosen = dict(params.chosen)
        return config, _merge_chosen(config, inputs, merger, model, chosen, progress=progress)
    if inputs.model_inputs is None:  # nothing to compare the candidates on
        chosen = {"method": FALLBACK[0], "parameters": dict(FALLBACK[1]),
                  "why": "no data was given: TSV-M at its default λ, without a label-free comparison"}
        _merge_chosen(config, inputs, merger, model, chosen, progress=progress)
        return _recorded(config, merger, chosen, []), None
    chosen, scored, (compared, fitted), report = _search(config, inputs, merger, model, progress=progress,
                                                         token=token)
    return _recorded(config, merger, chosen, scored, compared, fitted), report


def _search(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, model: Any, *, progress: bool,
            token: Any) -> tuple[dict[str, Any], list[dict[str, Any]], tuple[int, tuple[int, bool] | None],
                                 MLossReport | None]:
    from tqdm.auto import tqdm

    from ..methods import get_method
    from ..methods.auto import _settings, all_tied, candidate_grids, get_method_defaults, thinned
    from ..spec.selection import SelectionOptions
    from .selection import held_out_inputs, warn_grid_edge
    from .streamed_search import streamed_candidates

    params = merger.ctx.params
    default = params.candidates is None
    grids = _runnable(candidate_grids(params.candidates, params.budget), inputs, default=default)
    if merger.output is not None:  # the model is walked block by block (hf_mloss.merging.streamed_search)
        grids = streamed_candidates(grids)
    defaults = {name: get_method_defaults(name) for name in grids}
    grids = thinned(grids, params.budget, defaults)
    options = SelectionOptions(criterion=params.criterion, grid={"candidate": list(grids)},
                               num_samples=params.compare_samples, share=params.share,
                               heads=list(params.heads) if params.heads else None)
    fitted = {name for name in grids if get_method(name).needs_data}
    held_out = bool(fitted) and params.held_out
    cross_fit = held_out and params.cross_fit and params.compare_samples >= 2
    compare, fit = (held_out_inputs(config, inputs, len(inputs.model_inputs) if cross_fit else
                                    params.compare_samples, "auto") if held_out else (inputs, inputs))
    if merger.output is not None:
        scorer = _StreamedScorer(config, inputs, options, merger, progress=progress, token=token)
    elif cross_fit and compare is not inputs:
        scorer = _CrossFitScorer(config, inputs, (compare, fit), options, merger, model, fitted=fitted,
                                 progress=progress, token=token)
    else:
        scorer = _HeldScorer(config, inputs, compare, fit, options, merger, model, progress=progress, token=token)
    total = sum(len(_settings(grid)) for grid in grids.values())
    bar = tqdm(total=total, desc=f"auto ({params.criterion})", unit="candidate", disable=not progress)
    scored: list[dict[str, Any]] = []
    best = None
    try:
        for name, grid in grids.items():
            method = get_method(name)
            for fixed, lams in _lam_groups(method, grid, defaults[name]):
                for lam, values in scorer.score(name, fixed, lams):
                    setting = {**fixed, **({"lam": lam} if lam is not None else {})}
                    if not all(math.isfinite(v) for v in values.values()):
                        raise InvalidParameterError(
                            f"candidates: {name} {setting} scores {values} (not finite: its merge overflows). "
                            "Nothing was chosen or written; remove it from the candidates.")
                    scored.append({"method": name, "setting": setting, **values})
                    if best is None or values[params.criterion] < best[0]:
                        scorer.hold(lam)
                        best = (values[params.criterion], name, setting, lam, fixed)
                    bar.update(1)
    finally:
        bar.close()
    _, name, setting, lam, fixed = best
    values = [c[params.criterion] for c in scored]
    if all_tied(values):
        import warnings

        warnings.warn(f"auto: every candidate scored {values[0]:.6g} by {params.criterion!r}, so the comparison "
                      f"cannot tell them apart (are the fine-tunes equal to the base?); the first, {name} {setting}, "
                      "was kept.", UserWarning, stacklevel=3)
    else:
        warn_grid_edge(grids[name], setting, params.criterion, method=name)
    report = scorer.write(name, fixed, lam, refit=name in fitted and fit is not inputs)
    fitted_on = (len(fit.model_inputs), isinstance(scorer, _CrossFitScorer)) if fit is not inputs else None
    return {"method": name, "parameters": setting}, scored, (scorer.compared, fitted_on), report


class _HeldScorer:
    """The candidates merged into a scratch copy of the model, the experts' outputs held
    (:class:`~.selection.CandidateBuilder`, :class:`~.selection.CandidateEvaluator`)."""

    def __init__(self, config: MergeConfig, inputs: RunInputs, compare: RunInputs, fit: RunInputs, options: Any,
                 merger: TensorMerger, model: Any, *, progress: bool, token: Any) -> None:
        from .selection import CandidateBuilder, CandidateEvaluator

        self.config, self.inputs, self.merger = config, inputs, merger
        self.builder = CandidateBuilder(config, fit, copy.deepcopy(inputs.adapter.tower(model)), merger.names)
        self.evaluator = CandidateEvaluator(config, compare, options, self.builder.tower, progress=progress,
                                            token=token, heads_key="heads")

    @property
    def compared(self) -> int:
        """The samples every candidate was compared on."""
        return len(self.evaluator.sample)

    def score(self, name: str, fixed: Mapping[str, Any], lams: list[Any]) -> Any:
        """``(λ, criteria)`` of every λ of one setting, its merge held by the scratch copy while it is scored."""
        self.tau = _direction(self.builder, self.config, name, fixed)
        for lam in lams:
            if lam is not None:  # θ₀ + λ·τ; a method without λ holds its own merge already
                self.builder.write(self.tau, lam)
            yield lam, self.evaluate()

    def evaluate(self) -> dict[str, float]:
        """The criteria of the candidate the scratch copy holds."""
        return self.evaluator.evaluate(self.builder.tower)

    def hold(self, lam: float | None) -> None:
        """Keep the candidate being scored (the best so far)."""
        builder = self.builder
        self.held = self.tau if lam is not None else {n: builder.state[n].clone() for n in builder.names}

    def write(self, name: str, fixed: Mapping[str, Any], lam: float | None, *, refit: bool) -> MLossReport:
        builder, held = self.builder, self.held
        if refit:  # fitted on part of the data to be compared fairly: now on all of it
            builder.inputs = self.inputs
            held = _direction(builder, self.config, name, fixed)
            if lam is None:
                held = {n: builder.state[n].clone() for n in builder.names}
        for into in (None, self.merger.targets):  # the scratch copy (for its M-Loss), then the model
            _write(builder, held, lam, into)
        report = self.evaluator.mloss_report(builder.tower, models=[r.name for r in self.inputs.refs])
        self.merger.done.update(self.merger.names)
        return report


class _CrossFitScorer(_HeldScorer):
    """Held out both ways (``cross_fit``): the data in two halves, a candidate fitted on the data merged on each half
    and compared on the other, every other candidate compared on both; each criterion pooled over the two halves
    (:func:`~.selection.pooled`). So every candidate is compared on the same samples, all of those compared, and
    none on a sample it was fitted on."""

    def __init__(self, config: MergeConfig, inputs: RunInputs, halves: tuple[RunInputs, RunInputs], options: Any,
                 merger: TensorMerger, model: Any, *, fitted: set[str], progress: bool, token: Any) -> None:
        from dataclasses import replace

        from .selection import CandidateBuilder, CandidateEvaluator

        self.config, self.inputs, self.merger, self.halves, self.fitted = config, inputs, merger, halves, fitted
        self.builder = CandidateBuilder(config, halves[1], copy.deepcopy(inputs.adapter.tower(model)), merger.names)
        n = options.num_samples  # compare_samples in all: half of them from each half of the data
        self.evaluators = [CandidateEvaluator(config, half, replace(options, num_samples=share), self.builder.tower,
                                              progress=progress, token=token, heads_key="heads")
                           for half, share in zip(halves, ((n + 1) // 2, n // 2))]
        self.evaluator = self.evaluators[0]  # the chosen merge's M-Loss report reads its samples

    @property
    def compared(self) -> int:
        return sum(len(evaluator.sample) for evaluator in self.evaluators)

    def evaluate(self) -> dict[str, float]:
        """The candidate the scratch copy holds, compared on both halves."""
        from .selection import pooled

        return pooled([(ev.evaluate(self.builder.tower), dict(ev.counts)) for ev in self.evaluators])

    def score(self, name: str, fixed: Mapping[str, Any], lams: list[Any]) -> Any:
        from .selection import pooled

        if name not in self.fitted:  # one merge, compared on both halves
            yield from super().score(name, fixed, lams)
            return
        builder, taus = self.builder, []
        for fit in reversed(self.halves):  # fitted on the second half, compared on the first; then the other way
            builder.inputs = fit
            taus.append(_direction(builder, self.config, name, fixed))
        self.tau = taus[0]
        for lam in lams:
            parts = []
            for tau, evaluator in zip(taus, self.evaluators):
                builder.write(tau, 1.0 if lam is None else lam)  # no λ: the merge as it is, θ₀ + τ
                parts.append((evaluator.evaluate(builder.tower), dict(evaluator.counts)))
            yield lam, pooled(parts)


class _StreamedScorer:
    """The candidates merged and compared block by block (:mod:`.streamed_search`), nothing held between them."""

    def __init__(self, config: MergeConfig, inputs: RunInputs, options: Any, merger: TensorMerger, *,
                 progress: bool, token: Any) -> None:
        from .streamed_search import StreamedEvaluator, StreamedForward

        self.config, self.inputs, self.merger = config, inputs, merger
        self.forward = StreamedForward(inputs, merger.output.model, merger.names)
        self.evaluator = StreamedEvaluator(config, inputs, options, self.forward, progress=progress, token=token,
                                           heads_key="heads")

    def score(self, name: str, fixed: Mapping[str, Any], lams: list[Any]) -> Any:
        from .streamed_search import CandidateWeights

        weights = CandidateWeights(self.forward, self.config, name, fixed, lams, self.merger.workers)
        yield from self.evaluator.candidate(weights)

    @property
    def compared(self) -> int:
        return len(self.evaluator.sample)

    def hold(self, lam: float | None) -> None:
        """Nothing to keep: the chosen candidate is merged again when it is written."""

    def write(self, name: str, fixed: Mapping[str, Any], lam: float | None, *, refit: bool) -> None:
        from .streamed_search import NOT_MEASURED, write_streamed

        write_streamed(self.config, self.inputs, self.merger, name, fixed, lam)
        self.inputs.notes.append(NOT_MEASURED)
        return None


def _direction(builder: Any, config: MergeConfig, name: str, fixed: Mapping[str, Any]) -> dict[str, Any]:
    """Candidate ``name`` at setting ``fixed`` merged into the builder's scratch tower, on the builder's inputs, and
    its direction τ at λ = 1 (a data-guided candidate scores afresh)."""
    builder.config = config.replace(method=name, parameters=dict(fixed), select=None)
    builder.scores = builder.report = None
    return builder.task_vector(fixed, 1.0, live=True)


def _lam_groups(method: Any, grid: Mapping[str, list[Any]], defaults: Mapping[str, Any]
               ) -> list[tuple[dict[str, Any], list[Any]]]:
    """A candidate's grid as (setting merged once, the λ values written from it as θ₀ + λ·τ): every λ of a merge
    that λ rescales (:meth:`~hf_mloss.methods.MergeMethod.scales_with_lam`); ``[None]`` (the merge as it is, λ
    inside the setting) for the others."""
    from ..methods.auto import _settings

    out = []
    for fixed in _settings({k: v for k, v in grid.items() if k != "lam"}):
        if method.scales_with_lam({**defaults, **fixed}):
            out.append((fixed, grid.get("lam", [None])))
        else:
            out += [({**fixed, **({"lam": lam} if lam is not None else {})}, [None]) for lam in grid.get("lam", [None])]
    return out


def _runnable(grids: dict[str, dict[str, list[Any]]], inputs: RunInputs, *, default: bool
              ) -> dict[str, dict[str, list[Any]]]:
    """The candidates that can run on this model, before the first is merged (the config checked the rest when it
    was built): the Gram merges know dense linears only, so on a mixture-of-experts model a default candidate of
    theirs is left out with a warning, and a named one is refused."""
    import warnings

    from ..methods import get_method
    from .regmean import refuse_experts

    out = {}
    for name, grid in grids.items():
        method = get_method(name)
        if getattr(method, "gram_prefix", None):
            try:
                refuse_experts(inputs.adapter, f"{method.pretty_name} solves each linear layer from its inputs' "
                                               "Gram matrices")
            except HfMLossError as err:
                if not default:
                    raise type(err)(f"candidates: {name} cannot run on this model: {err}") from None
                warnings.warn(f"auto: {name} is left out of the default candidates: {err}", UserWarning,
                              stacklevel=4)
                continue
        out[name] = grid
    return out


def _write(builder: Any, held: Mapping[str, Any], lam: float | None, into: Mapping[str, Any] | None) -> None:
    """The chosen candidate into ``into`` (the builder's scratch copy by default): θ₀ + λ·τ, or, for a method
    without λ, its merged tensors as they are."""
    import torch

    if lam is not None:
        builder.write(held, lam, into=into)
        return
    target = builder.state if into is None else into
    with torch.no_grad():
        for name in builder.names:
            target[name].copy_(held[name])


def _merge_chosen(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, model: Any,
                  chosen: Mapping[str, Any], *, progress: bool) -> MLossReport | None:
    """Merge the chosen method with its recorded parameters into ``merger``'s model, by that method's own rule."""
    import torch

    from ..loading.inputs import resolve_weights
    from ..methods import MergeContext, get_method
    from .layerwise import merge_by_method
    from .merger import TensorMerger

    method = get_method(chosen["method"])
    parameters = dict(chosen.get("parameters") or {})
    chosen_config = config.replace(method=method.name, parameters=parameters, select=None)
    if method.scales_with_lam(parameters) and "why" not in chosen:  # as the search wrote it: θ₀ + λ·τ at λ = 1
        from .selection import CandidateBuilder

        if merger.output is not None:  # block by block, as the streamed search writes it
            from .streamed_search import write_streamed

            write_streamed(config, inputs, merger, method.name, {k: v for k, v in parameters.items() if k != "lam"},
                           parameters["lam"])
            return None

        fixed = {k: v for k, v in parameters.items() if k != "lam"}
        builder = CandidateBuilder(chosen_config.replace(parameters=fixed), inputs,
                                   copy.deepcopy(inputs.adapter.tower(model)), merger.names)
        builder.write(builder.task_vector(fixed, 1.0, live=True), parameters["lam"], into=merger.targets)
        merger.done.update(merger.names)
        return builder.report
    weights = resolve_weights(chosen_config, method.default_weight)  # that method's own default weighting
    ctx = MergeContext(params=chosen_config.method_params(), weights=weights.to(inputs.device, torch.float32),
                       seed=config.seed)
    inner = TensorMerger(inputs, method, ctx, model, merger.workers, output=merger.output)
    inner.names = list(merger.names)
    report = merge_by_method(chosen_config, inputs, inner, model, method, progress=progress)
    merger.done.update(inner.done)
    merger.checked.update(inner.checked)
    return report


def _recorded(config: MergeConfig, merger: TensorMerger, chosen: dict[str, Any], scored: list[dict[str, Any]],
              compared: int | None = None, fitted: tuple[int, bool] | None = None) -> MergeConfig:
    """The config as it ran: the choice, every candidate, the numbers of samples compared and fitted on and whether
    the fit was crossed, recorded (heads passed from Python named, not kept)."""
    parameters = {k: v for k, v in config.parameters.items()
                  if k not in ("reselect", "compared", "fitted", "cross_fitted")}
    parameters.update(criterion=merger.ctx.params.criterion, chosen=chosen, scored=scored)  # the default resolved
    if compared is not None:
        parameters["compared"] = compared
    if fitted is not None:
        parameters["fitted"], parameters["cross_fitted"] = fitted[0], fitted[1]
    heads = merger.ctx.params.heads
    if heads:
        parameters["heads"] = [os.fspath(h) if isinstance(h, (str, os.PathLike)) else h if isinstance(h, dict)
                               else {"in_memory": type(h).__name__} for h in heads]
    recorded = config.replace(parameters=parameters)
    merger.ctx.params = recorded.method_params()
    return recorded
