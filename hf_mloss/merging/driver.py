"""``merge()`` and the merge driver: tensor by tensor for data-free methods, block by block for data-guided ones.

Memory: the merged model (loaded from the base, in float32) plus, at any time, the q sources' copies of ONE tensor
(data-free methods) or of one block's scored linear (data-guided methods). Source checkpoints are read lazily. A
tensor too large for q float32 copies (an LLM's embedding) is merged in flat pieces when the method allows it
(:meth:`~hf_mloss.methods.MergeMethod.chunk_keep_counts`), with the same bits as whole.
The driver names no method: a data-guided method supplies :class:`~hf_mloss.methods.LayerHooks` that decide what
is merged while the M-Loss scorer walks the blocks.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..spec.config import MergeConfig
from ..distributed import describe_device
from ..errors import CorruptCheckpointError, InvalidParameterError
from ..loading.inputs import RunInputs, ScoredTower, as_dtype, open_inputs
from ..methods import MergeContext, MergeMethod
from ..methods.svc import calibrate_tensor, calibrates, describe_calibration, svc_alpha
from ..parallel import Workers, cpu_workers
from ..parallel import active as active_workers
from ..output.result import MergeResult
from .stages import DriverRun
from ..spec.schedule import TensorParameters, replace_params, split_parameters

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..output.report import MLossReport


CHUNKED_MIN_NUMEL = 1 << 25
"""A tensor whose q sources hold at least this many entries in all is merged in pieces, when the method allows."""
MERGE_CHUNK_NUMEL = 1 << 22
"""Entries of one such piece (per source): 16 MB of float32."""


def run_merge(config: MergeConfig, *, device: Any = None, token: str | bool | None = None, progress: bool = True,
              select_and_merge: Callable[..., tuple[MergeConfig, MLossReport]] | None = None,
              choose_method: Callable[..., tuple[MergeConfig, MLossReport | None]] | None = None,
              scored_part_only: bool = False) -> MergeResult:
    """Run a validated config (see :func:`hf_mloss.run`).

    ``select_and_merge`` runs a config's label-free selection (:func:`hf_mloss.merging.selection.select_and_merge`, which
    drives this module's merger) and ``choose_method`` the choice among methods of ``method="auto"``
    (:func:`hf_mloss.merging.auto.choose_and_merge`): the caller passes them, so the driver does not depend on the
    searches built on it. ``scored_part_only``: merge only the model a scoring pass runs (a whole CLIPModel's vision
    tower; the model itself for a family without towers), for the merged-prefix M-Loss of ``score(prefix="merged")``.
    """
    method = config.merge_method()
    params = config.method_params()
    needs_data = method.needs_data or config.select is not None or (
        hasattr(method, "uses_data") and config.data is not None and method.uses_data(params))
    with open_inputs(config, device=device, token=token, needs_data=needs_data, progress=progress,
                     whole_model=config.output in ("auto", "adapter") and not scored_part_only) as inputs, \
            cpu_workers(inputs.device) as workers:
        from ..output.adapter import build_adapter_output, plan_adapter_output

        adapter_plan = plan_adapter_output(config, inputs)  # output="adapter": refused here, before any work
        if adapter_plan is not None and adapter_plan.linear and config.slices is None and not needs_data \
                and not scored_part_only and not split_parameters(method, config.parameters)[1]:
            return adapter_from_factors(config, inputs, method, params, adapter_plan)
        # the inputs as given (a passthrough reads every model through its sliced base): recorded and carded
        slice_plan, given = None, inputs
        if config.slices is not None:  # output blocks re-stacked from layer ranges (hf_mloss.spec.slices)
            from ..spec.slices import apply_slices

            inputs, model, slice_plan = apply_slices(config, inputs, working_dtype(config, inputs, needs_data=False))
        else:
            output = inputs.scoring_output() if scored_part_only else "auto" if adapter_plan else config.output
            model = inputs.load_output_model(output, progress=progress,
                                             dtype=working_dtype(config, inputs, needs_data=needs_data))
        if getattr(model.config, "auto_map", None):  # code the merged folder would not ship: dropped, and said
            del model.config.auto_map
            inputs.notes.append("The base's config.json names custom code (auto_map), which is not copied: the "
                                "merge's config.json leaves auto_map out and loads with the transformers class.")
        tower = inputs.adapter.tower(model)
        ctx = MergeContext(params=params, weights=inputs.alpha.to(inputs.device, torch.float32), seed=config.seed)
        tensor_params = TensorParameters(method, config.parameters, inputs.adapter,
                                         slice_plan.positions if slice_plan else None,
                                         [m.parameters for m in config.models],
                                         (slice_plan.slice_of, [e.get("parameters") for e in config.slices])
                                         if slice_plan else None)
        merger = TensorMerger(inputs, method, ctx, model, workers,  # every merged tensor: a whole model's too
                              tensor_params=tensor_params)
        outside = outside_tower_names(inputs, merger.names)
        report, learned = None, None
        if config.select is not None:
            if select_and_merge is None:
                raise InvalidParameterError("This config selects its parameters (select: ...); run it with "
                                            "hf_mloss.run(config).")
            refuse_changed_outside(inputs, outside, "Label-free selection (select=...)")
            merger.names = [n for n in merger.names if n not in set(outside)]  # equal to the base's: kept as is
            config, report = select_and_merge(config.replace(select=config.select.recorded()), inputs, merger, tower,
                                              progress=progress, token=token)
            params = merger.ctx.params
        elif getattr(method, "chooses_method", False):  # method="auto": the merge chosen among methods
            if choose_method is None:
                raise InvalidParameterError("method='auto' chooses among merges; run it with hf_mloss.run(config).")
            refuse_changed_outside(inputs, outside, "method='auto'")
            merger.names = [n for n in merger.names if n not in set(outside)]  # equal to the base's: kept as is
            config, report = choose_method(config, inputs, merger, model, progress=progress, token=token)
            params = merger.ctx.params
        elif getattr(method, "learned", False):  # coefficients trained on the data (hf_mloss.merging.learned)
            from .learned import learn_and_merge

            refuse_changed_outside(inputs, outside, f"{method.pretty_name}")
            merger.names = [n for n in merger.names if n not in set(outside)]  # equal to the base's: kept as is
            config, learned = learn_and_merge(config, inputs, merger, tower, method,
                                              changed=changed_names(inputs, merger.names), progress=progress)
            params = merger.ctx.params
        else:
            report = merge_by_method(config, inputs, merger, model, method, progress=progress)
        if report is None:  # data-free: a report that says so, so `result.report.summary()` always works
            from ..output.report import MLossReport

            report = MLossReport.not_computed(config.method, [r.name for r in inputs.refs],
                                              (inputs.alpha / inputs.alpha.sum()).tolist())
        out_dtype = as_dtype(config.dtype) if config.dtype else stored_dtype(inputs)
        model = finalize(model, merger, out_dtype, keep_targets=adapter_plan is not None)
        lora = None if adapter_plan is None else build_adapter_output(
            adapter_plan, config, inputs, merger.targets, out_dtype, zero_delta_is_base=method.zero_delta_is_base)
        record = recorded_config(config, given)
        description = method.describe(params) + describe_calibration(params)
        if (outside or inputs.towers) and method.needs_data and config.select is None and learned is None \
                and not getattr(method, "learned", False):
            description += " " + outside_rule_note(inputs, method, params, merger.names)
        if learned is not None:
            description += ". " + learned.describe()
        for note in inputs.notes:
            warnings.warn(note, stacklevel=2)
            description += " " + note
        if lora is not None:  # the adapter as written: its combination, and the rank an SVD used
            record.combination, record.lora_rank = lora.combination, lora.rank if lora.combination == "svd" else None
        record.resolved_parameters = tensor_params.record(merger.names) if tensor_params else None
        vocabulary = given.vocabulary
        if vocabulary is not None:
            description += " " + vocabulary.describe()
        return MergeResult(model=model, config=record, report=report, base=inputs.base.ref, models=given.refs,
                           adapter=inputs.adapter, data_info=inputs.data_info, method_description=description,
                           lora=lora, device=describe_device(inputs.device),
                           tokenizer=vocabulary.tokenizer if vocabulary is not None else None)


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


@torch.no_grad()
def adapter_from_factors(config: MergeConfig, inputs: RunInputs, method: MergeMethod, params: Any,
                         plan: Any) -> MergeResult:
    """``output="adapter"`` of a linear method over plain LoRA inputs, at the cost of PEFT's
    ``add_weighted_adapter``: the adapter is built from the adapted modules' factors alone (and the merged full
    copies); the merged model is built only if :attr:`MergeResult.model` is read (base + B_cat·A_cat, the same merge
    up to float32 round-off)."""
    from ..output.adapter import build_linear_adapter_output

    ctx = MergeContext(params=params, weights=inputs.alpha.to(inputs.device, torch.float32), seed=config.seed)
    out_dtype = as_dtype(config.dtype) if config.dtype else stored_dtype(inputs)

    def merge_copy(name: str) -> torch.Tensor:
        base = inputs.base.get_float(name, inputs.device)
        sources = [s.get_float(name, inputs.device) for s in inputs.sources]
        for store, tensor in [(inputs.base, base), *zip(inputs.sources, sources)]:
            if not torch.isfinite(tensor).all():
                raise CorruptCheckpointError(f"{name!r} of {store.ref.name!r} holds non-finite value(s) (NaN/Inf); a "
                                             "merge would spread them. Fix or exclude that checkpoint.")
        return method.merge_tensor(name, base, sources, ctx).float()

    lora, exact, copies = build_linear_adapter_output(plan, config, inputs, merge_copy, out_dtype)
    record = recorded_config(config, inputs)
    record.combination, record.lora_rank = lora.combination, lora.rank if lora.combination == "svd" else None
    tensor_params = TensorParameters(method, config.parameters, inputs.adapter)
    record.resolved_parameters = tensor_params.record(inputs.names) if tensor_params else None
    description = method.describe(params)
    for note in inputs.notes:
        warnings.warn(note, stacklevel=3)
        description += " " + note
    from ..output.report import MLossReport

    report = MLossReport.not_computed(config.method, [r.name for r in inputs.refs],
                                      (inputs.alpha / inputs.alpha.sum()).tolist())
    adapter, base_path, base_model = inputs.adapter, inputs.base.ref.path, inputs.base_model
    allow_missing, device = frozenset(inputs.uninitialised), inputs.device

    def load_merged_model() -> PreTrainedModel:
        from .._logging import quiet_transformers

        if base_model is not None:
            model = copy.deepcopy(base_model)
        else:
            with quiet_transformers(True):
                model = adapter.load_output_model(base_path, "auto", dtype=torch.float32, allow_missing=allow_missing)
        model = model.to(device=device, dtype=torch.float32).eval()
        if getattr(model.config, "auto_map", None):
            del model.config.auto_map
        targets = {name: v for k, v in model.state_dict().items()  # as TensorMerger: a whole model's names too
                   if (name := adapter.canonical_key(k)) is not None}
        with torch.no_grad():
            for name, (a, b) in exact.items():
                targets[name].add_((b @ a).to(targets[name].device))  # factors are read on the CPU
            for name, tensor in copies.items():
                targets[name].copy_(tensor)
        return model.to(out_dtype).eval()

    return MergeResult(model=None, config=record, report=report, base=inputs.base.ref, models=inputs.refs,
                       adapter=inputs.adapter, data_info=inputs.data_info, method_description=description,
                       lora=lora, device=describe_device(inputs.device), model_loader=load_merged_model)


def outside_tower_names(inputs: RunInputs, names: Sequence[str]) -> list[str]:
    """The merged tensors outside the scored tower of a whole-model merge (a CLIPModel's text tower, projections,
    ``logit_scale``); empty when the merge is one tower or a family without a tower."""
    adapter = inputs.adapter
    if not getattr(adapter, "whole_model", False):
        return []
    return [n for n in names if adapter.is_outside_tower(n)]


def changed_names(inputs: RunInputs, names: Sequence[str]) -> list[str]:
    """The ``names`` that some model holds with other values than the base."""
    changed = []
    for name in names:
        base = inputs.base.get(name)
        if any(not torch.equal(s.get(name).to(base.dtype), base) for s in inputs.sources):
            changed.append(name)
    return changed


def refuse_changed_outside(inputs: RunInputs, outside: Sequence[str], what: str) -> None:
    """Refuse a run that would keep the base's values of tensors the fine-tunes changed outside the scored tower."""
    changed = changed_names(inputs, outside)
    if changed:
        tower = f"{inputs.adapter.model_class.__name__} encoder" if getattr(inputs.adapter, "kept_class", None) \
            else "vision tower"
        raise InvalidParameterError(
            f"{what} works on the {tower}, but the fine-tunes also changed {len(changed)} tensor(s) outside it "
            f"(e.g. {changed[:3]}), which would silently keep the base's values. Pass output='tower' to merge and "
            f"save the {tower} only, or merge the whole model without select=.")


def data_free_rule(method: MergeMethod, params: Any, lead: str = "") -> str:
    """How a data-guided method merges a tensor no scoring data reaches: ``"trimmed at k=0.2 (data-free)"``."""
    return f"{lead}{method.data_free_rule(params, short=True)}"


def outside_rule_note(inputs: RunInputs, method: MergeMethod, params: Any, names: Sequence[str]) -> str:
    """The card's sentences on each tower of a whole model and on the tensors no scoring data reaches."""
    from ..output.report import tower_label

    rule = method.data_free_rule(params)
    scored = inputs.scored_attributes()
    lines, unscored = [], []
    for attribute, modality in inputs.tower_modalities().items():
        if attribute in scored:
            lines.append(f"{tower_label(attribute)}: scored on {modality} data ({method.data_use})")
        else:
            lines.append(f"{tower_label(attribute)}: no {modality} data, {data_free_rule(method, params)}")
            unscored.append(tower_label(attribute))
    own = next(iter(inputs.tower_modalities()), None)

    def reached(name: str) -> bool:
        if own in scored and not inputs.adapter.is_outside_tower(name):
            return True
        return any(view.owns(name) for view in inputs.towers if view.tower_attribute in scored)

    unreached = [n for n in names if not reached(n)]
    if not unreached:  # both towers scored, nothing outside them (a Qwen2-VL with a tied lm_head)
        return f"{'; '.join(lines)}."
    changed = len(changed_names(inputs, unreached))
    rest = getattr(inputs.adapter, "head_label", None) or "projections, logit scale"  # a kept class: its head
    parts = ", ".join(filter(None, [*unscored, rest]))
    return (f"{'; '.join(lines)}. The {len(unreached)} tensors no scoring data reaches ({parts}; {changed} changed "
            f"by the fine-tunes) were merged by the method's data-free rule, {rule}.")


class TensorMerger:
    """Reads, checks and merges tensors into the model (its tower's, or every merged tensor of a whole model)."""

    def __init__(self, inputs: RunInputs, method: MergeMethod, ctx: MergeContext, tower: PreTrainedModel,
                 workers: Workers | None = None, *, tensor_params: TensorParameters | None = None) -> None:
        self.inputs, self.method, self.ctx, self.device = inputs, method, ctx, inputs.device
        self.tensor_params = tensor_params  # per-layer / per-tensor parameter values, when the config has any
        self.workers = workers or active_workers()
        adapter = inputs.adapter
        self.targets = {name: v for k, v in tower.state_dict().items()
                        if (name := adapter.canonical_key(k)) is not None}
        self.names = [n for n in inputs.names if n in self.targets]
        self.done: set[str] = set()
        self.checked: set[str] = set()  # merged tensors found finite (in float32) when they were written
        ctx.state["total_numel"] = sum(math.prod(inputs.base.shapes[n]) for n in self.names)

    def read(self, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        base = self.targets[name].float() if name not in self.done else self.inputs.base.get_float(name, self.device)
        if not torch.isfinite(base.sum()) and not torch.isfinite(base).all():
            self._refuse_non_finite(name, self.inputs.base, base)
        sources = []
        for store in self.inputs.sources:
            tensor = store.get_float(name, self.device)
            # One reduction instead of a full isfinite mask: any NaN/Inf (or an overflowing sum) makes the sum
            # non-finite, and only then are the entries counted.
            if not torch.isfinite(tensor.sum()) and not torch.isfinite(tensor).all():
                bad = int((~torch.isfinite(tensor)).sum())
                raise CorruptCheckpointError(
                    f"{name!r} of {store.ref.name!r} holds {bad} non-finite value(s) (NaN/Inf); a merge would spread "
                    "them. Fix or exclude that checkpoint.")
            sources.append(tensor)
        return base, sources

    def visit(self, fn) -> None:
        for name in self.names:
            base, sources = self.read(name)
            fn(name, base, sources)

    @torch.no_grad()
    def merge(self, names: Sequence[str], *, progress: bool = False, desc: str = "Merging") -> None:
        """Merge the ``names`` not merged yet into the model, spread over the run's workers."""
        pending = list(dict.fromkeys(n for n in names if n not in self.done))
        with tqdm(total=len(pending), desc=desc, unit="tensor", disable=not progress) as bar:
            for name in self.workers.imap(self._merge_one, pending):
                self.done.add(name)
                bar.update()

    def _merge_one(self, name: str) -> str:
        ctx = replace_params(self.ctx, self.tensor_params.for_tensor(name)) if self.tensor_params else self.ctx
        per_model = self.tensor_params.for_models(name, self.ctx.weights.tolist()) if self.tensor_params else None
        if per_model is not None:  # per-model weights and parameters, resolved for this tensor
            weights = torch.tensor(per_model[0], dtype=torch.float32, device=self.ctx.weights.device)
            ctx = dataclasses.replace(ctx, weights=weights, model_params=per_model[1])
        counts = self._chunk_counts(name, ctx)
        if counts is not None:
            self._merge_in_chunks(name, ctx, counts)
            return name
        base, sources = self.read(name)
        if self.method.zero_delta_is_base and all(torch.equal(s, base) for s in sources):
            merged = base  # no source changed it (a frozen part): θ₀ + f(0) = θ₀, without trimming q zero tensors
        else:
            merged = self.method.merge_tensor(name, base, sources, ctx)
            if calibrates(ctx.params):  # SVC of the merged task matrix (2-D tensors; the others as merged)
                merged = calibrate_tensor(base, sources, merged, svc_alpha(ctx.params))
        del sources
        # Checked here, while the tensor is in cache, instead of in a separate pass over the model in `finalize`
        # (5.7 s of a 128 s TIES merge on 2 busy cores): one reduction, and the full mask only when the sum is not
        # finite (NaN/Inf, or finite values whose sum overflows).
        if torch.isfinite(merged.sum()) or torch.isfinite(merged).all():
            self.checked.add(name)
        target = self.targets[name]
        if target.dtype != merged.dtype and merged is not base and name in self.checked and merged.numel():
            check_fits(name, float(merged.abs().max()), target.dtype)  # before the rounding hides an overflow
        target.copy_(merged)
        return name

    def _chunk_counts(self, name: str, ctx: MergeContext) -> list[int] | None:
        """The method's per-source keep counts when ``name`` is large enough to merge in chunks, else None."""
        target = self.targets[name]
        if (name in self.done or target.dim() == 0 or not target.is_contiguous()
                or target.numel() * len(self.inputs.sources) < CHUNKED_MIN_NUMEL
                or (target.dim() == 2 and calibrates(ctx.params))):  # SVC factors the whole matrix
            return None
        return self.method.chunk_keep_counts(target.numel(), ctx, name=name)

    def _chunks(self, name: str) -> Iterator[tuple[slice, torch.Tensor, list[torch.Tensor]]]:
        """``(piece, base, sources)`` over consecutive flat pieces of ``name``: float32, the sources checked finite.

        Pieces hold a multiple of :func:`~hf_mloss.methods.ops.elect_chunk_numel` entries, so the kernels see the
        chunks they see on the whole tensor; each source piece is read as the rows that cover it."""
        from ..methods.ops import elect_chunk_numel

        target = self.targets[name].view(-1)
        numel, width = target.numel(), max(1, math.prod(self.targets[name].shape[1:]))
        unit = elect_chunk_numel(len(self.inputs.sources))
        step = unit * max(1, MERGE_CHUNK_NUMEL // unit)
        for start in range(0, numel, step):
            piece = slice(start, min(start + step, numel))
            first, last = piece.start // width, -(-piece.stop // width)
            offset = piece.start - first * width
            sources = []
            for store in self.inputs.sources:
                rows = store.get_rows(name, first, last).reshape(-1)[offset: offset + piece.stop - piece.start]
                tensor = rows.to(device=self.device, dtype=torch.float32)
                if not torch.isfinite(tensor.sum()) and not torch.isfinite(tensor).all():
                    self._refuse_non_finite(name, store)
                sources.append(tensor)
            base = target[piece].float()
            if not torch.isfinite(base.sum()) and not torch.isfinite(base).all():
                self._refuse_non_finite(name, self.inputs.base, self.targets[name])
            yield piece, base, sources

    def _refuse_non_finite(self, name: str, store, tensor: torch.Tensor | None = None) -> None:
        """Name the checkpoint (the base included) whose ``name`` holds NaN/Inf, before anything is merged."""
        tensor = store.get(name) if tensor is None else tensor
        bad = int((~torch.isfinite(tensor.float())).sum())
        which = "the base " if store is self.inputs.base else ""
        raise CorruptCheckpointError(
            f"{name!r} of {which}{store.ref.name!r} holds {bad} non-finite value(s) (NaN/Inf); a merge would spread "
            "them. Fix or exclude that checkpoint.")

    def _merge_in_chunks(self, name: str, ctx: MergeContext, counts: list[int]) -> None:
        """:meth:`_merge_one` for a large tensor, piece by piece: the same values and checks, bit for bit, without
        q float32 copies of the whole tensor (a 151936 × 896 bf16 embedding × 4 fine-tunes: ~4 GB less at peak).

        Pass 1 checks the sources and whether any changed the tensor, and (with ``counts``) pass 2 finds each task
        vector's threshold over the whole tensor; the last pass merges each piece and writes it into the model."""
        from ..methods.ops import sample_positions, streamed_thresholds

        target = self.targets[name]
        changed, positions = False, sample_positions(target.numel()).to(self.device) if counts else None
        samples: list[list[torch.Tensor]] = [[] for _ in self.inputs.sources]
        for piece, base, sources in self._chunks(name):
            changed = changed or not all(torch.equal(s, base) for s in sources)
            if positions is not None:  # |τ_i| at the sample positions inside this piece
                at = positions[(positions >= piece.start) & (positions < piece.stop)] - piece.start
                for kept, source in zip(samples, sources):
                    kept.append((source[at] - base[at]).abs())
        if not changed and self.method.zero_delta_is_base:
            if torch.isfinite(target.sum()) or torch.isfinite(target).all():
                self.checked.add(name)  # merged = base: the model already holds it
            return

        def taus():
            for _, base, sources in self._chunks(name):
                yield [s.sub_(base) for s in sources]

        thresholds = streamed_thresholds(taus, counts, target.numel(), [torch.cat(k) for k in samples]) if counts \
            else []
        finite, peak, flat = True, 0.0, target.view(-1)
        for piece, base, sources in self._chunks(name):
            merged = self.method.merge_chunk(name, base, sources, ctx, thresholds)
            del sources
            if not (torch.isfinite(merged.sum()) or torch.isfinite(merged).all()):
                finite = False
            elif target.dtype != merged.dtype and merged.numel():
                peak = max(peak, float(merged.abs().max()))
            flat[piece].copy_(merged.view(-1))
        if finite:
            self.checked.add(name)
            if target.dtype != torch.float32:
                check_fits(name, peak, target.dtype)  # the model holds the rounded values; the merge fails here


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


@torch.no_grad()
def finalize(model: PreTrainedModel, merger: TensorMerger, dtype: torch.dtype, *,
             keep_targets: bool = False) -> PreTrainedModel:
    """Check the merged tensors are finite, in float32 and after the cast to ``dtype``, then cast.

    The merger's references to the float32 tensors are dropped before the cast (unless ``keep_targets``: an
    adapter output still reads them), so each one is freed as its cast copy is made: casting a float32 model to
    bf16 then peaks at the model plus one tensor, not at 1.5 models (9.3 GB for a 1.5 B decoder).

    Raises:
        InvalidParameterError: naming the first tensor that overflows and what to change.
    """
    params = merger.ctx.params
    for name in merger.names:
        tensor = merger.targets[name]
        if name not in merger.checked and not torch.isfinite(tensor).all():
            lam = getattr(params, "lam", None)
            raise InvalidParameterError(
                f"The merge produced non-finite values in {name!r} (max |x| overflows float32)"
                + (f"; lam={lam} is too large" if lam is not None and abs(lam) > 1e3 else "") + ". Nothing was "
                "written; use smaller lam/weights.")
        if dtype.is_floating_point and dtype != torch.float32 and tensor.dtype == torch.float32:
            check_fits(name, _largest_magnitude(tensor), dtype)
    if not keep_targets:
        merger.targets.clear()
    return model.to(dtype).eval()


def _largest_magnitude(tensor: torch.Tensor) -> float:
    """max |x| without an |x| copy of the tensor (an LLM's embedding: 0.9 GB more at the peak)."""
    if not tensor.numel():
        return 0.0
    low, high = torch.aminmax(tensor)
    return max(abs(float(low)), abs(float(high)))


def check_fits(name: str, peak: float, dtype: torch.dtype) -> None:
    """Refuse a merged tensor whose largest magnitude ``peak`` overflows ``dtype``."""
    limit = torch.finfo(dtype).max
    if peak > limit:
        raise InvalidParameterError(
            f"Saving as {str(dtype).replace('torch.', '')} would overflow: {name!r} reaches {peak:.4g} "
            f"(the largest {str(dtype).replace('torch.', '')} is {limit:.4g}). Nothing was written; pass "
            "dtype='bfloat16' or 'float32'.")


def working_dtype(config: MergeConfig, inputs: RunInputs, *, needs_data: bool) -> torch.dtype:
    """The dtype the output model is held in while merging: float32, or, for a data-free merge whose output keeps
    the base's storage dtype (bf16 LLMs), that dtype. Merges still compute in float32 and each merged tensor is
    rounded once when written, exactly as the final cast would; the base is read exactly (it is stored in that
    dtype); a bf16 model of N parameters then costs 2N bytes instead of 4N (plus 2N for the final cast)."""
    out = as_dtype(config.dtype) if config.dtype else stored_dtype(inputs)
    stored = {inputs.base.dtypes[n] for n in inputs.names}
    if needs_data or not out.is_floating_point or stored != {out}:
        return torch.float32
    return out


def stored_dtype(inputs: RunInputs) -> torch.dtype:
    """The base's floating-point storage dtype (the default dtype of the merged model)."""
    dtypes = [inputs.base.dtypes[n] for n in inputs.names]
    return dtypes[0] if dtypes else torch.float32


def recorded_config(config: MergeConfig, inputs: RunInputs) -> MergeConfig:
    """The config as it ran: Hub models pinned to their resolved commit, local folders with their fingerprint."""
    from .._version import __version__

    record = copy.copy(config)
    record.base = copy.copy(config.base)
    record.models = [copy.copy(m) for m in config.models]
    for i, (spec, store) in enumerate(zip([record.base, *record.models], [inputs.base, *inputs.sources])):
        if store.ref.repo_id and not spec.is_loaded and store.ref.revision:
            spec.revision = store.ref.revision
        spec.weights_file = getattr(store.ref, "weights_file", None)
        spec.weights_ref = getattr(store.ref, "weights_ref", None)
        if i in inputs.fingerprints:
            spec.fingerprint = inputs.fingerprints[i]
    record.hf_mloss_version = __version__
    return record
