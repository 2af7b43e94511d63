"""``merge()`` and the merge driver: tensor by tensor for data-free methods, block by block for data-guided ones.

Memory: the merged model (loaded from the base, in float32) plus, at any time, the q sources' copies of ONE tensor
(data-free methods) or of one block's scored linear (data-guided methods). A large model's merged blocks are written
to disk as the merge leaves them instead, so only one block of it is held (:mod:`.streamed`). Source checkpoints are
read lazily. A
tensor too large for q float32 copies (an LLM's embedding) is merged in flat pieces when the method allows it
(:meth:`~hf_mloss.methods.MergeMethod.chunk_keep_counts`), with the same bits as whole.
The driver names no method: a data-guided method supplies :class:`~hf_mloss.methods.LayerHooks` that decide what
is merged while the M-Loss scorer walks the blocks. It dispatches to the modules below it (:mod:`.merger`, the tensor
merger; :mod:`.layerwise`, a method's own rule; :mod:`.learned`; :mod:`.regmean`), which never import it back.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..spec.config import MergeConfig
from ..distributed import describe_device
from ..errors import CorruptCheckpointError, InvalidParameterError
from ..loading.inputs import RunInputs, as_dtype, open_inputs
from ..methods import MergeContext, MergeMethod
from ..methods.svc import describe_calibration
from ..parallel import active, cpu_workers, replay_threads
from ..output.result import MergeResult
from ..spec.schedule import TensorParameters, split_parameters
from .layerwise import data_free_rule, merge_by_method
from .memory import check_held_model_fits, held_copies
from .merger import TensorMerger, check_fits, largest_magnitude, raise_non_finite
from .streamed import plan_streamed_output

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..output.report import MLossReport


READ_BY = ("Data-guided merges read it (regmean, regmean_plusplus, adamerging, adarank_*, auto, m_ties, m_dare, "
           "select='unlabeled').")
"""What a data-free merge's warning about unread data names as the merges that would read it."""


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
        hasattr(method, "uses_data") and config.has_data() and method.uses_data(params))
    own = next((f"models[{i}] ({m.label})" for i, m in enumerate(config.models) if m.data is not None
                or m.text_data is not None), None)
    if own is not None and not needs_data and not scored_part_only:
        warnings.warn(f"{own} has data of its own, and {method.pretty_name} merges without data: it is not read. "
                      f"{READ_BY}", UserWarning, stacklevel=3)
    elif config.data is not None and not needs_data and not scored_part_only and config.score is None \
            and not getattr(method, "chooses_method", False):  # auto re-running its recorded choice: data on purpose
        warnings.warn(f"`data` is given, and {method.pretty_name} merges without data: it is not read. {READ_BY}",
                      UserWarning, stacklevel=3)
    with open_inputs(config, device=device, token=token, needs_data=needs_data, progress=progress,
                     whole_model=config.output in ("auto", "adapter") and not scored_part_only,
                     record=not scored_part_only) as inputs, \
            cpu_workers(inputs.device, replay_threads(config.threads, inputs.device)) as workers:
        from ..output.adapter import build_adapter_output, plan_adapter_output

        adapter_plan = plan_adapter_output(config, inputs)  # output="adapter": refused here, before any work
        if adapter_plan is not None and adapter_plan.linear and config.slices is None and not needs_data \
                and not scored_part_only and not split_parameters(method, config.parameters)[1]:
            return adapter_from_factors(config, inputs, method, params, adapter_plan)
        # the inputs as given (a passthrough reads every model through its sliced base): recorded and carded
        slice_plan, given, streamed = None, inputs, None
        if config.slices is not None:  # output blocks re-stacked from layer ranges (hf_mloss.spec.slices)
            from .sliced import apply_slices

            inputs, model, slice_plan = apply_slices(config, inputs, working_dtype(config, inputs, needs_data=False))
        else:
            output = inputs.scoring_output() if scored_part_only else "auto" if adapter_plan else config.output
            # a recorded auto choice written as θ₀ + λ·τ: in float32, as its search formed it
            dtype = working_dtype(config, inputs,
                                  needs_data=needs_data or bool(getattr(method, "writes_scaled", None)
                                                                and method.writes_scaled(params)))
            streamed = None if scored_part_only or adapter_plan is not None else plan_streamed_output(
                config, inputs, method, params, dtype=dtype, out_dtype=output_dtype(config, inputs), output=output)
            if streamed is None:  # the whole model is held: refused here if it cannot fit
                check_held_model_fits(inputs, dtype, *held_copies(config, method))
            model = streamed.model if streamed is not None else inputs.load_output_model(output, progress=progress,
                                                                                         dtype=dtype)
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
                              tensor_params=tensor_params, output=streamed)
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
        out_dtype = output_dtype(config, inputs)
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
        spilled = streamed.spill if streamed is not None else None
        return MergeResult(model=model, config=record, report=report, base=inputs.base.ref, models=given.refs,
                           adapter=inputs.adapter, data_info=inputs.data_info, method_description=description,
                           lora=lora, device=describe_device(inputs.device),
                           tokenizer=vocabulary.tokenizer if vocabulary is not None else None,
                           model_data_info=own_data_info(given), spilled=spilled,
                           model_loader=spilled.load_model if spilled is not None else None)


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


def own_data_info(inputs: RunInputs) -> dict[str, list[Any]]:
    """Where each model's own data came from, by key (``data``, ``text_data``), for the result and its card."""
    out: dict[str, list[Any]] = {}
    if inputs.model_data_info:
        out["data"] = list(inputs.model_data_info)
    for infos in inputs.tower_model_data_info.values():
        out["text_data"] = list(infos)
    return out


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
        whole = ("without select=" if what.startswith("Label-free selection") else
                 "with a method that merges every tensor (e.g. ties, or m_ties, which scores the tower)")
        raise InvalidParameterError(
            f"{what} works on the {tower}, but the fine-tunes also changed {len(changed)} tensor(s) outside it "
            f"(e.g. {changed[:3]}), which would silently keep the base's values. Pass output='tower' to merge and "
            f"save the {tower} only, or merge the whole model {whole}.")


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
    output = getattr(merger, "output", None)
    if output is not None:  # written block by block: the rest now, each tensor checked as it is written
        output.finish(merger)
        return None
    params = merger.ctx.params
    for name in merger.names:
        tensor = merger.targets[name]
        if name not in merger.checked and not torch.isfinite(tensor).all():
            raise_non_finite(name, params)
        if dtype.is_floating_point and dtype != torch.float32 and tensor.dtype == torch.float32:
            check_fits(name, largest_magnitude(tensor), dtype)
    if not keep_targets:
        merger.targets.clear()
    return model.to(dtype).eval()


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


def output_dtype(config: MergeConfig, inputs: RunInputs) -> torch.dtype:
    """The dtype the merged model is written in: the config's, else the base's storage dtype."""
    return as_dtype(config.dtype) if config.dtype else stored_dtype(inputs)


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
    for (p, key), values in inputs.data_records.items():  # a model's own data: its Hub commit, its fingerprint
        setattr(record.models[p], key, dataclasses.replace(getattr(record.models[p], key), **values))
    record.hf_mloss_version = __version__
    record.threads = active().threads  # some products' last bits depend on it: a re-run uses as many
    return record
