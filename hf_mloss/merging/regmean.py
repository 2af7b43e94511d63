"""The RegMean driver: walk each scored tower, solve every block's linears from their Grams, average the rest.

The method (:mod:`hf_mloss.methods.regmean`) says which prefix feeds the Grams; the walks are
:func:`~hf_mloss.engine.gram.own_gram_walk` (RegMean) and :func:`~hf_mloss.engine.gram.merged_gram_walk`
(RegMean++). A block's solved weights go to the method through ``MergeContext.state`` and are written by the merger
(its finiteness and dtype checks included) as soon as the block is solved, so no more than one block's Grams and
solutions are held. Tensors no walk reaches (a whole CLIPModel's tower without data, projections) are averaged.
Grams the data leaves singular (only with ``reduce_non_diagonal_ratio`` ≈ 1) are named in one note per merge.

With each model's own data (:attr:`~hf_mloss.loading.inputs.RunInputs.sample_owner`) model p's Grams come from its
own samples only: the walks take the models in groups that read the same samples. ``lam`` ≠ 1 scales the merged task
vector once every block is solved (θ₀ + λ·(θ_RegMean − θ₀)), so RegMean++'s prefix is the published merge's.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from .stages import DriverRun, unchanged_blocks

if TYPE_CHECKING:
    from ..engine.gram import Deficiency
    from ..loading.inputs import RunInputs, ScoredTower
    from ..methods import MergeMethod
    from ..spec.config import MergeConfig
    from .merger import TensorMerger


def merge_regmean(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, model: Any, method: MergeMethod, *,
                  progress: bool) -> str | None:
    """Merge every tensor of ``merger`` by RegMean's rules (see the module docstring). Returns a note naming the
    layers whose Grams the data left singular (:func:`deficiency_note`), or ``None``."""
    refuse_experts(inputs.adapter, f"{method.pretty_name} solves each linear layer from its inputs' Gram matrices")
    deficient: list[tuple[str, Deficiency]] = []
    for tower in inputs.scored_towers(model):
        _merge_tower(config, inputs, merger, tower, method, deficient, progress=progress)
    merger.merge(merger.names)  # whatever no walk reached: averaged
    if merger.ctx.params.lam != 1.0:
        _scale_task_vector(inputs, merger, merger.ctx.params.lam)
    return deficiency_note(method, merger.ctx.params.reduce_non_diagonal_ratio, deficient) if deficient else None


def _scale_task_vector(inputs: RunInputs, merger: TensorMerger, lam: float) -> None:
    """θ₀ + λ·(θ − θ₀) in place for every merged tensor (checked finite and within its dtype, as merged ones are)."""
    import torch

    from .merger import check_fits

    with torch.no_grad():
        for name in merger.names:
            target = merger.targets[name]
            base = inputs.base.get_float(name, target.device)
            if not target.is_floating_point():
                continue
            scaled = torch.add(base, target.float() - base, alpha=lam)  # as selection and auto write θ₀ + λ·τ
            if not torch.isfinite(scaled).all():
                merger.checked.discard(name)  # finalize names it and what to change
            elif target.dtype != scaled.dtype and scaled.numel():
                check_fits(name, float(scaled.abs().max()), target.dtype)
            target.copy_(scaled)


def deficiency_note(method: MergeMethod, ratio: float, deficient: list[tuple[str, Deficiency]]) -> str:
    """Why the merge may be far from every model at the layers of ``deficient`` (block prefix, Gram), and what to do.

    With r = 1 the solve is plain least squares, and data that spans fewer directions than a layer has input
    features leaves its weights along the others free: the Cholesky solve (fusion-bench: ``torch.inverse``) then
    returns finite weights that nothing flags, possibly many times the models' norm."""
    shown = []
    for prefix, gram in deficient[:2]:
        name = f"{prefix}{gram.paths[0]}"
        if len(gram.paths) > 1:
            name += f" (and {', '.join(p.rsplit('.', 1)[-1] for p in gram.paths[1:])}, same input)"
        live = gram.features - gram.unreached
        count = f"{gram.positions} position(s) counted for {live} input features"
        if gram.unreached:
            count += f" (and {gram.unreached} that are 0 at every position)"
        shown.append(f"{name}: {'numerically rank-deficient, ' if gram.numerical else ''}{count}")
    more = f"; and {len(deficient) - len(shown)} more" if len(deficient) > len(shown) else ""
    return (f"{method.pretty_name} with reduce_non_diagonal_ratio={ratio:g}: the data leaves {len(deficient)} of "
            f"the Gram matrices it solves from singular or nearly so, so it does not determine those layers' weights "
            f"along the input directions it never spans, and the merged weights there are arbitrary (possibly far "
            f"from every model's): "
            f"{'; '.join(shown)}{more}. Give more varied data, with more positions than these layers have input "
            f"features, or a reduce_non_diagonal_ratio below 1 (fusion-bench's 0.95), which keeps every solve "
            f"well-posed.")


def refuse_experts(adapter: Any, what: str) -> None:
    """Refuse a data-guided rule that knows dense linears only on a mixture-of-experts model (whose experts are fused
    ``[E, 2I, H]`` tensors, each reached by the tokens routed to it)."""
    if getattr(adapter, "experts", False):
        from ..errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"{what}; the experts of a mixture-of-experts model ({adapter.name!r}) are not linear layers but fused "
            "tensors each reached by its routed tokens, which this rule does not handle yet. M-Loss scoring, "
            "m_ties / m_dare, compatibility and label-free selection do (per expert), and every data-free method "
            "merges the model.")


def merge_stage(merger: TensorMerger, run: DriverRun, stage: int) -> None:
    """Merge a stage into the model being merged (a streamed output: its block filled first, even with nothing to
    merge there, since the walk runs it next)."""
    if merger.output is not None:
        merger.output.open_stage(stage, merger)
    run.merge(run.stage_names(stage))


def _merge_tower(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, tower: ScoredTower,
                 method: MergeMethod, deficient: list[tuple[str, Deficiency]], *, progress: bool) -> None:
    from tqdm.auto import tqdm

    from ..engine.gram import merged_gram_walk, own_gram_walk
    from ..engine.score import group_batches, make_setup
    from ..methods.regmean import SOLUTIONS

    adapter = tower.adapter
    merged = set(merger.names)
    run = DriverRun(merger, adapter=adapter, names=None if tower.names is None else
                    [n for n in tower.names if n in merged])
    solutions = merger.ctx.state.setdefault(SOLUTIONS, {})
    alpha = (inputs.alpha / inputs.alpha.sum()).tolist()
    ratio = merger.ctx.params.reduce_non_diagonal_ratio
    start = unchanged_blocks(inputs, adapter, run.names)
    options = config.scoring_options()
    own = method.gram_prefix == "own"
    # RegMean walks a scratch copy (it holds each model's blocks in turn); RegMean++ the model being merged
    setup = make_setup(inputs, copy.deepcopy(tower.module) if own else tower.module, options, config,
                       progress=progress, tower=tower)
    groups = group_batches(tower.samples, tower.owner, len(inputs.sources), config.batch_size)  # each model's data

    def solved(layer: int, weights: dict[str, Any] | None) -> None:
        prefix = adapter.layer_prefix(layer)
        for path, weight in (weights or {}).items():
            name = f"{prefix}{path}.weight"
            if name in merged:
                solutions[name] = weight
        if own:
            run.merge(run.stage_names(layer))

    bar = tqdm(total=adapter.num_layers, desc=f"{method.pretty_name} (Gram matrices)", unit="layer",
               disable=not progress)
    found: list[tuple[int, Deficiency]] = []
    try:
        if own:
            own_gram_walk(setup, alpha, ratio, start, solved, progress=bar, deficient=found, groups=groups)
        else:
            merged_gram_walk(setup, alpha, ratio, start, solved, lambda stage: run.merge(run.stage_names(stage)),
                             progress=bar, deficient=found, groups=groups)
    finally:
        bar.close()
    deficient += [(adapter.layer_prefix(layer), gram) for layer, gram in found]
    run.merge_remaining()
