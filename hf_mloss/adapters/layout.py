"""transformers' own checkpoint conversion, as a key map: which parameter of the loaded model each checkpoint tensor
becomes, and how the tensors transformers fuses on load are assembled.

transformers 5 loads many families from an older file layout and converts on the way (``conversion_mapping``):
renames (GPT-NeoX's ``embed_out`` → ``lm_head``, LLaVA's ``language_model.model.*`` → ``model.language_model.*``,
ViT's ``encoder.layer.N.attention.attention.query`` → ``layers.N.attention.q_proj``), prefixes added or removed, and
fusions (the per-expert ``w1`` / ``w3`` of a Mixtral layer stacked into one ``experts.gate_up_proj``). hf_mloss reads
and merges in the loaded model's space, so a checkpoint's names must be mapped the way ``from_pretrained`` maps them:
:class:`CheckpointLayout` asks transformers for the exact list it would apply
(``get_model_conversion_mapping`` on a model built on the ``meta`` device) and applies it with transformers' own
``rename_source_key`` — never a table kept here. Written merges go back through ``revert_weight_conversion``, the
function ``save_pretrained`` calls, so they land in the layout the base was read from.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel


class CheckpointLayout:
    """The conversion ``from_pretrained`` applies for one model class and config (see the module docstring)."""

    def __init__(self, model_class: type[PreTrainedModel], config: PretrainedConfig) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        with torch.device("meta"):
            self.meta = model_class(config)
        self.shapes = {key: tuple(t.shape) for key, t in self.meta.state_dict().items()}
        self.prefix = getattr(self.meta, "base_model_prefix", "") or ""
        transforms = get_model_conversion_mapping(self.meta)
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._converter_of = {pattern: t for t in self.converters for pattern in t.source_patterns}
        self._lock = threading.Lock()  # the transforms record whether they were used: one lookup at a time
        self._names: dict[str, tuple[str | None, str | None]] = {}

    def lookup(self, key: str) -> tuple[str | None, str | None]:
        """``(parameter name, fusing source pattern or None)`` of checkpoint key ``key``; ``(None, None)`` for a key
        the model does not load (an unexpected tensor). Idempotent: a parameter's own name maps to itself."""
        if key in self._names:
            return self._names[key]
        from transformers.core_model_loading import rename_source_key

        state = self.shapes
        with self._lock:
            name, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, state)
            if name not in state and key in state:  # as the loader: a key already in the model's spelling
                name, pattern = rename_source_key(key, [], [], self.prefix, state)
        result = (name, pattern) if name in state else (None, None)
        self._names[key] = result
        return result

    def name(self, key: str) -> str | None:
        return self.lookup(key)[0]

    @property
    def fuses(self) -> bool:
        """Whether some checkpoint tensors are fused into one parameter on load (MoE experts)."""
        return bool(self.converters)

    def assemble(self, name: str, sources: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
        """Parameter ``name`` from the checkpoint tensors ``(key, tensor)`` that fuse into it (all of them, any
        order), by transformers' own converter: e.g. ``experts.{e}.w1`` / ``w3`` stacked over ``e`` (in numeric
        order, as the loader sorts them) and concatenated into ``experts.gate_up_proj``."""
        from transformers.core_model_loading import dot_natural_key

        first = self.lookup(sources[0][0])[1]
        converter = copy.deepcopy(self._converter_of[first])
        for key, tensor in sorted(sources, key=lambda kv: dot_natural_key(kv[0])):
            pattern = self.lookup(key)[1]
            converter.add_tensor(name, key, pattern, tensor)
        out = converter.convert(name, model=self.meta, config=self.meta.config)
        value = out[name]
        return value[0] if isinstance(value, list) else value

    def placement(self, name: str, shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[Any, ...]] | None:
        """Where each checkpoint tensor fused into parameter ``name`` lands in it (``{key: index}``:
        ``parameter[index]`` is that tensor, for the keys of ``shapes``, their stored shapes), when transformers'
        converter stacks each source pattern's tensors (``MergeModulelist``) and concatenates the stacks
        (``Concatenate``), as every MoE expert fusion does: what :meth:`assemble` computes, so that each tensor can
        be read straight into its place. ``None`` for any other converter (read through :meth:`assemble`)."""
        from transformers.core_model_loading import Concatenate, MergeModulelist, dot_natural_key

        keys = sorted(shapes, key=dot_natural_key)
        converter = self._converter_of[self.lookup(keys[0])[1]]
        ops = list(converter.operations)
        if not (ops and type(ops[0]) is MergeModulelist and (len(ops) == 1 or (len(ops) == 2
                                                                               and type(ops[1]) is Concatenate))):
            return None
        target = self.shapes[name]
        stack, join = ops[0].dim % len(target), (ops[-1].dim % len(target) if len(ops) == 2 else None)
        groups = [[k for k in keys if self.lookup(k)[1] == pattern] for pattern in converter.source_patterns]
        groups = [group for group in groups if group]
        if stack == join or (join is None and len(groups) != 1):
            return None
        out, offset = {}, 0
        for group in groups:
            stacked = [*shapes[group[0]][:stack], len(group), *shapes[group[0]][stack:]]
            width = stacked[join] if join is not None else 0
            for position, key in enumerate(group):
                index: list[Any] = [slice(None)] * len(target)
                index[stack] = position
                if join is not None:
                    index[join] = slice(offset, offset + width)
                out[key] = tuple(index)
            offset += width
        if join is not None and offset != target[join]:
            return None
        return out

    def used(self, keys: Sequence[str]) -> list[Any]:
        """The transforms a checkpoint of ``keys`` goes through (fresh copies): what ``from_pretrained`` records as
        ``model._weight_conversions``, so that ``save_pretrained`` writes the same layout back."""
        from transformers.core_model_loading import rename_source_key

        fresh = [copy.deepcopy(t) for t in (*self.renamings, *self.converters)]
        renamings, converters = fresh[:len(self.renamings)], fresh[len(self.renamings):]
        for key in keys:
            rename_source_key(key, renamings, converters, self.prefix, self.shapes)
        return [t for t in fresh if t.was_used()]


@functools.lru_cache(maxsize=16)
def _layout(model_class: type[PreTrainedModel], config_json: str) -> CheckpointLayout:
    config = model_class.config_class.from_dict(json.loads(config_json))
    return CheckpointLayout(model_class, config)


def checkpoint_layout(model_class: type[PreTrainedModel], config: PretrainedConfig) -> CheckpointLayout:
    """The :class:`CheckpointLayout` of a class and config (built once per pair)."""
    return _layout(model_class, config.to_json_string(use_diff=False))


def write_layout(model: PreTrainedModel, keys: Sequence[str], layout: CheckpointLayout) -> None:
    """Make ``save_pretrained`` write ``model`` in the layout of a checkpoint of ``keys`` (the base's), also when the
    model was not loaded from it (filled from a lazy store): the transforms those keys go through."""
    model._weight_conversions = layout.used(keys)
