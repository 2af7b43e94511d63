"""A method's own rule over every tensor of a merge: tensor by tensor (data-free), block by block through its hooks
while the M-Loss scorer walks (M-TIES), or from the Gram matrices of every linear's inputs (RegMean).

The driver (:mod:`hf_mloss.merging.driver`) and the searches built on it (label-free selection, ``auto``) call
:func:`merge_by_method`; it dispatches to the workers below it and never back up to the driver.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from .stages import DriverRun

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..loading.inputs import RunInputs, ScoredTower
    from ..methods import MergeMethod
    from ..output.report import MLossReport
    from ..spec.config import MergeConfig
    from .merger import TensorMerger

__all__ = ["data_free_rule", "merge_by_method", "merge_layerwise"]


def merge_by_method(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, model: PreTrainedModel,
                    method: MergeMethod, *, progress: bool) -> MLossReport | None:
    """Merge every tensor of ``merger`` by ``method``'s own rule: tensor by tensor (data-free), block by block through
    its hooks while the scorer walks (M-TIES; returns the M-Loss report it used), or from the Gram matrices of every
    linear's inputs (RegMean)."""
    if getattr(method, "gram_prefix", None):  # RegMean: linears solved from their inputs' Gram matrices
        from .regmean import merge_regmean

        note = merge_regmean(config, inputs, merger, model, method, progress=progress)
        if note is not None:  # warned, and said on the card
            inputs.notes.append(note)
        return None
    if method.needs_data:
        return merge_layerwise(config, inputs, merger, model, method, progress=progress)
    method.prepare(merger.ctx, merger.visit)
    merger.merge(merger.names, progress=progress, desc=f"Merging ({config.method})")
    return None


def data_free_rule(method: MergeMethod, params: Any, lead: str = "") -> str:
    """How a data-guided method merges a tensor no scoring data reaches: ``"trimmed at k=0.2 (data-free)"``."""
    return f"{lead}{method.data_free_rule(params, short=True)}"


def merge_layerwise(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, tower: PreTrainedModel,
                    method: MergeMethod, *, progress: bool) -> MLossReport:
    """Score and merge block by block through the method's hooks; returns the M-Loss report the merge used.

    ``tower``: the model the merge is written into (or its scored tower). A whole two-tower model given data for
    both towers (``data`` and ``text_data``) is walked tower by tower, each on its own samples with its own
    adapter; the tensors no walk reaches (an unscored tower, projections) are merged last by the method's
    data-free rule.
    """
    from ..engine.score import combine_tower_reports, unscored_towers

    towers = inputs.scored_towers(tower)
    reports = [(each, _merge_tower(config, inputs, merger, each, method, progress=progress)) for each in towers]
    merger.merge(merger.names)  # whatever the hooks left (the tensors of no scored tower)
    if not inputs.towers and not getattr(inputs.adapter, "whole_model", False):
        return reports[0][1]
    return combine_tower_reports(reports, unscored=unscored_towers(inputs, data_free_rule(method, merger.ctx.params,
                                                                                          "no {kind} data, ")))


def _merge_tower(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, tower: ScoredTower,
                 method: MergeMethod, *, progress: bool) -> MLossReport:
    """One tower's walk: its stages merged through the method's hooks, its report (layers named for the run)."""
    from ..engine.score import build_report, make_setup, score_own_prefix, score_shared_prefix

    options = method.scoring_options(merger.ctx.params)
    merged = set(merger.names)
    names = None if tower.names is None else [n for n in tower.names if n in merged]
    run = DriverRun(merger, adapter=tower.adapter, names=names)
    hooks = method.layer_hooks(run)
    if merger.output is not None:  # each block filled before its stage, written once the walk is past it
        from .streamed import StreamedHooks

        hooks = StreamedHooks(hooks, merger.output, merger)
    if options.prefix == "merged":
        setup = make_setup(inputs, tower.module, options, config, progress=progress, tower=tower)
        results = score_shared_prefix(setup, hooks)
    else:
        # The scorer's model must not be the merge container: own-prefix scoring swaps weights into it.
        setup = make_setup(inputs, copy.deepcopy(tower.module), options, config, progress=progress, tower=tower)
        results = score_shared_prefix(setup) if options.prefix == "base" else score_own_prefix(setup)
        for layer in setup.scored_layers():
            hooks.after_scores(layer, results[tower.adapter.target_name(layer)].scores())
        hooks.after_all()
    return build_report(setup, results, models=[r.name for r in inputs.refs], data_info=tower.data_info,
                        records=run.records, key_prefix=tower.key_prefix)
