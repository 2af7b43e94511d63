"""Slices: output layers taken from layer ranges of the inputs, as mergekit's ``slices`` / ``layer_range`` define them.

A config's ``slices`` is a list of ``{sources: [{model: i, layer_range: [start, end]}, ...]}``; ``model`` is an index
into ``[base, *models]`` (0 = the base). The output's blocks are the slices' blocks in order, so the output has
``Σ (end − start)`` blocks (its config is written with that ``num_hidden_layers``):

* ``passthrough``: each slice names one source; output block ``j`` is that source's block ``start + offset``,
  renumbered to ``j`` (depth up-scaling, "frankenmerges"). Tensors before the blocks (embeddings) come from the first
  slice's model, those after them (final norm, head) from the last slice's model, as in mergekit.
* any other data-free method: each slice lists every model once (the base too, except for ``average``), with ranges of
  one length; output block ``j`` merges the sources' blocks ``start_i + offset``. A gradient runs over each slice on
  its own (block ``offset`` of ``n`` sits at ``offset/(n − 1)``, ``1`` when ``n = 1``), as mergekit computes it;
  tensors outside the blocks sit at 0. A slice's ``parameters`` replace the top-level ones for its blocks (tensors
  before the blocks take the first slice's, those after them the last slice's, as in mergekit).

:class:`SlicePlan` maps each output tensor name to the input tensor it reads per model; :class:`SlicedStore` reads
the mapped tensors lazily; :func:`hf_mloss.merging.sliced.apply_slices` turns a run's inputs into sliced ones and
builds the output model.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .._validation import short
from ..errors import InvalidParameterError
from ..loading.store import TensorStore

if TYPE_CHECKING:
    from ..adapters import ModelAdapter


def num_layers_of(config: Any) -> int | None:
    """The block count of a config.json's content (its text config's, for a multimodal one); ``None`` if unknown."""
    if not isinstance(config, Mapping):
        return None
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return num_layers_of(config.get("text_config"))


def check_slices(slices: Any, method: str, num_inputs: int, layer_counts: list[int | None] | None = None,
                 names: list[str] | None = None) -> list[dict[str, Any]]:
    """Validate the shape of ``slices`` and return it as plain data; ``layer_counts`` (per input, base first, where
    known before loading: local folders' config.json) bounds each ``layer_range`` by its model's blocks.

    Raises:
        InvalidParameterError: naming the slice and source at fault, the model's layer count when known, and how
            to fix it.
    """
    if not isinstance(slices, list) or not slices:
        raise InvalidParameterError(f"slices must be a non-empty list of {{sources: [{{model: i, layer_range: "
                                    f"[a, b]}}]}} entries, got {short(slices)}.")
    out = []
    for s, entry in enumerate(slices):
        where = f"slices[{s}]"
        if not isinstance(entry, Mapping) or not {"sources"} <= set(entry) <= {"sources", "parameters"} or \
                not isinstance(entry["sources"], list) or not entry["sources"]:
            raise InvalidParameterError(f"{where} must be {{sources: [{{model: i, layer_range: [start, end]}}, ...]}} "
                                        f"(and optional parameters), got {short(entry)}.")
        if "parameters" in entry and (method == "passthrough" or not isinstance(entry["parameters"], Mapping)):
            raise InvalidParameterError(f"{where}.parameters must be a mapping of the method's parameters (a slice "
                                        f"merged by a method), got {short(entry['parameters'])} with {method}.")
        sources = []
        for k, source in enumerate(entry["sources"]):
            at = f"{where}.sources[{k}]"
            if not isinstance(source, Mapping) or set(source) != {"model", "layer_range"}:
                raise InvalidParameterError(f"{at} must be {{model: i, layer_range: [start, end]}}, got "
                                            f"{short(source)}.")
            model, bounds = source["model"], source["layer_range"]
            if isinstance(model, bool) or not isinstance(model, int) or not 0 <= model < num_inputs:
                raise InvalidParameterError(f"{at}.model must be an index into [base, *models] (0 = base, "
                                            f"0..{num_inputs - 1}), got {short(model)}.")
            count = layer_counts[model] if layer_counts is not None else None
            if count is not None:
                name = f" {names[model]!r}" if names is not None and names[model] else ""
                has = f"model {model}{name} has {count} layer{'s' if count != 1 else ''}, indices 0..{count - 1}"
            if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2 and all(
                    isinstance(b, int) and not isinstance(b, bool) for b in bounds) and 0 <= bounds[0] < bounds[1]):
                if count is None:
                    raise InvalidParameterError(f"{at}.layer_range must be [start, end] with 0 <= start < end (end "
                                                f"excluded), got {short(bounds)}.")
                raise InvalidParameterError(f"{at}.layer_range must be [start, end] with whole numbers 0 <= start < "
                                            f"end <= {count} ({has}; end excluded), got {short(bounds)}.")
            if count is not None and bounds[1] > count:
                raise InvalidParameterError(f"{at}.layer_range {short(bounds)} runs past the model's layers ({has}; "
                                            f"end excluded): use an end <= {count}.")
            sources.append({"model": model, "layer_range": [int(bounds[0]), int(bounds[1])]})
        lengths = {s_["layer_range"][1] - s_["layer_range"][0] for s_ in sources}
        models = [s_["model"] for s_ in sources]
        if method == "passthrough":
            if len(sources) != 1:
                raise InvalidParameterError(f"{where}: passthrough copies one source per slice, got {len(sources)}; "
                                            "give each slice one source (or merge them with a method such as slerp).")
        else:
            if len(lengths) != 1:
                raise InvalidParameterError(
                    f"{where}: all sources of a slice must hold the same number of layers to be merged, got ranges "
                    f"{[s_['layer_range'] for s_ in sources]}; make the ranges the same length.")
            needed = set(range(1, num_inputs)) | ({0} if method != "average" else set())
            if len(models) != len(set(models)) or not needed <= set(models):
                raise InvalidParameterError(
                    f"{where}: a {method} slice lists every model once (model indices {sorted(needed)}, 0 = base), "
                    f"got {models}; hf_mloss merges the same models in every slice.")
        out.append({"sources": sources, **({"parameters": dict(entry["parameters"])} if entry.get("parameters")
                                           else {})})
    return out


def _renumber(name: str, match: Any, layer: int) -> str:
    start, end = match.span(1)
    return f"{name[:start]}{layer}{name[end:]}"


@dataclasses.dataclass
class SlicePlan:
    """Each output tensor's input tensors, as ``(input index, input name)`` pairs, and its gradient position."""

    num_layers: int
    reads: dict[str, list[tuple[int, str]]]
    """Output name → the input tensors it is made of: every input in order (base first) for a merge, one for a
    passthrough."""
    positions: dict[str, float]
    """Output name → where it sits on a gradient (see the module docstring)."""
    layer_of: dict[int, tuple[int, int]]
    """Output block → (input index, input block) of its first source (for per-block config settings)."""
    slice_of: dict[str, int] = dataclasses.field(default_factory=dict)
    """Output name → the slice whose ``parameters`` it takes (tensors before the blocks: the first slice; after: the
    last, as mergekit reads them)."""

    @classmethod
    def build(cls, slices: list[dict[str, Any]], method: str, adapter: ModelAdapter,
              names: list[list[str]]) -> SlicePlan:
        """Plan the output of ``slices`` over inputs with these canonical tensor ``names`` (base first).

        Raises:
            InvalidParameterError: a ``layer_range`` beyond a model's blocks.
        """
        num_inputs = len(names)
        blocks: list[dict[int, list[str]]] = [{} for _ in names]  # per input: block -> its tensor names
        outside: list[str] = []
        for i, input_names in enumerate(names):
            for name in input_names:
                match = adapter.layer_pattern.match(name)
                if match:
                    blocks[i].setdefault(int(match.group(1)), []).append(name)
                elif i == 0:
                    outside.append(name)
        for s, entry in enumerate(slices):
            for k, source in enumerate(entry["sources"]):
                start, end = source["layer_range"]
                count = 1 + max(blocks[source["model"]], default=-1)
                if end > count:
                    raise InvalidParameterError(
                        f"slices[{s}].sources[{k}].layer_range [{start}, {end}] runs past model {source['model']}'s "
                        f"{count} layers (indices 0..{count - 1}, end excluded); use an end <= {count}.")
        passthrough = method == "passthrough"
        reads: dict[str, list[tuple[int, str]]] = {}
        positions: dict[str, float] = {}
        slice_of: dict[str, int] = {}
        first, last = slices[0]["sources"][0]["model"], slices[-1]["sources"][0]["model"]
        for name in outside:  # mergekit: before the blocks from the first slice's models, after them from the last's
            donor = first if adapter.is_embedding(name) else last
            reads[name] = [(donor, name)] if passthrough else [(i, name) for i in range(num_inputs)]
            positions[name] = 0.0
            slice_of[name] = 0 if adapter.is_embedding(name) else len(slices) - 1
        layer_of: dict[int, tuple[int, int]] = {}
        out_layer = 0
        for index, entry in enumerate(slices):
            sources = entry["sources"]
            lead = sources[0]
            length = lead["layer_range"][1] - lead["layer_range"][0]
            # an input missing from a merged slice (the average's architecture donor) reads the lead's blocks
            starts = [lead["layer_range"][0]] * num_inputs
            for src in sources:
                starts[src["model"]] = src["layer_range"][0]
            for offset in range(length):
                layer_of[out_layer] = (lead["model"], starts[lead["model"]] + offset)
                for name in blocks[lead["model"]].get(starts[lead["model"]] + offset, []):
                    match = adapter.layer_pattern.match(name)
                    out_name = _renumber(name, match, out_layer)
                    inputs = [lead["model"]] if passthrough else range(num_inputs)
                    reads[out_name] = [(i, _renumber(name, match, starts[i] + offset)) for i in inputs]
                    positions[out_name] = offset / (length - 1) if length > 1 else 1.0
                    slice_of[out_name] = index
                out_layer += 1
        return cls(num_layers=out_layer, reads=reads, positions=positions, layer_of=layer_of, slice_of=slice_of)


class SlicedStore(TensorStore):
    """Reads output names as other tensors of one or more stores (lazily, one tensor at a time)."""

    def __init__(self, ref: Any, mapping: dict[str, tuple[TensorStore, str]]) -> None:
        self.ref = ref
        self._mapping = mapping
        self.shapes = {out: store.shapes[name] for out, (store, name) in mapping.items()}
        self.dtypes = {out: store.dtypes[name] for out, (store, name) in mapping.items()}

    def get(self, name: str) -> torch.Tensor:
        store, source = self._mapping[name]
        return store.get(source)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        store, source = self._mapping[name]
        return store.get_rows(source, start, stop)

    @property
    def reads_rows(self) -> bool:
        return all(store.reads_rows for store, _ in self._mapping.values())

    def get_float(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        store, source = self._mapping[name]
        return store.get_float(source, device)


def output_config(config: Any, plan: SlicePlan) -> Any:
    """The base's config with the output's block count (and per-block settings such as ``layer_types`` renumbered)."""
    out = copy.deepcopy(config)
    text = out.get_text_config() if hasattr(out, "get_text_config") else out
    old = text.num_hidden_layers
    text.num_hidden_layers = plan.num_layers
    layer_types = getattr(text, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) == old:
        text.layer_types = [layer_types[plan.layer_of[j][1]] for j in range(plan.num_layers)]
    return out


def describe_slices(slices: list[dict[str, Any]], names: list[str]) -> list[str]:
    """One readable line per slice for cards: ``layers 0–3 of org/a + layers 0–3 of org/b → output 0–3``."""
    lines, out = [], 0
    for entry in slices:
        sources = entry["sources"]
        length = sources[0]["layer_range"][1] - sources[0]["layer_range"][0]
        parts = [f"layers {s['layer_range'][0]}–{s['layer_range'][1] - 1} of {names[s['model']]}" for s in sources]
        lines.append(f"{' + '.join(parts)} → output layers {out}–{out + length - 1}")
        out += length
    return lines
