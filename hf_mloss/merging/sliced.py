"""A run's inputs as its ``slices`` read them (:mod:`hf_mloss.spec.slices` describes and checks the slices; this
module, on the driver's side, applies them to the opened inputs and builds the output model)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..errors import IncompatibleCheckpointsError, InvalidParameterError
from ..loading.store import TensorStore
from ..spec.slices import SlicedStore, SlicePlan, output_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..loading.inputs import RunInputs
    from ..spec.config import MergeConfig

__all__ = ["apply_slices"]


def apply_slices(config: MergeConfig, inputs: RunInputs, dtype: torch.dtype) -> tuple[RunInputs, PreTrainedModel,
                                                                                      SlicePlan]:
    """The run's inputs as the slices read them, the output model (holding the base's side of every tensor) and
    the plan.

    Raises:
        InvalidParameterError: a layer range out of bounds, or a family slices cannot be written for.
        IncompatibleCheckpointsError: sources whose tensors do not fit the output (different architectures).
    """
    from ..adapters import adapter_for

    adapter = inputs.adapter
    if not getattr(adapter, "saves_with_transformers", False) or getattr(adapter, "whole_model", False):
        raise InvalidParameterError(f"slices re-stack the blocks of text families merged data-free (Llama, Mistral, "
                                    f"Qwen2, BERT...); the {adapter.name} family is not one of them. Drop `slices`.")
    stores = [inputs.base, *inputs.sources]
    plan = SlicePlan.build(config.slices, config.method, adapter, [s.keys() for s in stores])
    passthrough = config.method == "passthrough"
    base_map: dict[str, tuple[TensorStore, str]] = {}
    source_maps: list[dict[str, tuple[TensorStore, str]]] = [{} for _ in inputs.sources]
    for out, pairs in plan.reads.items():
        for i, name in pairs:
            if name not in stores[i]:
                raise IncompatibleCheckpointsError(
                    f"slices: {stores[i].ref.name!r} has no tensor {name!r} (read for {out!r}); the slices' sources "
                    "must share one architecture.")
        if passthrough:
            base_map[out] = (stores[pairs[0][0]], pairs[0][1])
            continue
        base_map[out] = (stores[0], pairs[0][1])
        for i, name in pairs[1:]:
            source_maps[i - 1][out] = (stores[i], name)
    sliced_base = SlicedStore(inputs.base.ref, base_map)
    out_config = output_config(adapter.config, plan)
    out_adapter = adapter_for(out_config)
    expected = out_adapter.expected_shapes()
    wrong = [(n, sliced_base.shapes[n], expected.get(n)) for n in sliced_base.shapes
             if sliced_base.shapes[n] != expected.get(n)]
    if wrong:
        name, got, want = wrong[0]
        raise IncompatibleCheckpointsError(
            f"slices: {name!r} is read with shape {list(got)} but the output ({out_config.model_type}, "
            f"{plan.num_layers} layers, the base's config) expects {list(want) if want else 'no such tensor'}; "
            "the slices' sources must share one architecture.")
    sources = [] if passthrough else [SlicedStore(s.ref, m) for s, m in zip(inputs.sources, source_maps)]
    alpha = inputs.alpha[:0] if passthrough else inputs.alpha
    sliced = dataclasses.replace(inputs, adapter=out_adapter, base=sliced_base, sources=sources, alpha=alpha,
                                 names=[n for n in plan.reads if sliced_base.dtypes[n].is_floating_point])
    with torch.device(inputs.device):
        model = out_adapter.merged_class._from_config(out_config, dtype=dtype)
    filled = set()
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            name = out_adapter.canonical_key(key)
            if name in base_map:
                tensor.copy_(sliced_base.get(name))
                filled.add(name)
    missing = [n for n in base_map if n not in filled]
    if missing:
        raise IncompatibleCheckpointsError(f"slices: the output model has no tensor {missing[0]!r} the plan reads; "
                                           "the sources do not match the base's architecture.")
    return sliced, model.eval(), plan
