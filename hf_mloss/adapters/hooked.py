"""M-Loss scoring for any text decoder or encoder whose blocks hold an MLP of a common shape, read from the model.

Transformers' families differ in how a block is called (masks per attention type, rotary tables, parallel
residuals) but agree on what matters here: the model's forward calls its blocks one after the other, and each
block's MLP is one of a few shapes (:data:`MLP_SHAPES`): a gated MLP (``gate_proj`` / ``up_proj`` / ``down_proj``:
Llama, Gemma 1-3, Olmo, Qwen), a fused gated one (Phi-3's ``gate_up_proj``, ModernBERT's ``Wi``: f of the first half
times the second), or a plain one (``fc1`` / ``fc2``, GPT-J's ``fc_in`` / ``fc_out``, GPT-NeoX's
``dense_h_to_4h`` / ``dense_4h_to_h``, GPT-2's ``Conv1D`` ``c_fc`` / ``c_proj``). :class:`HookedAdapter` needs no
per-family code:

* ``embed`` runs the model's own forward once per batch with every block's forward replaced by a recorder: it
  keeps the hidden states entering block 0 and the arguments the model passes to each block (its masks, positions,
  rotary tables), and computes no block;
* ``forward_to_target`` calls the block's own forward with those arguments and stops it at the input of the MLP's
  first linear (a forward pre-hook); ``forward_from_target`` runs the block again from its input (the merged unit,
  where a merge changed it in between), so the pre-MLP part of a block is computed twice on a shared prefix;
* the activation is the MLP's own module (``act_fn``, ``act``, ``activation_fn``).

The walk reproduces the model's own forward block by block exactly (a test checks every shape).
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .base import BlockContext, ScoredUnit
from .generic import GenericAdapter, resolve_model_class

MLP_SHAPES: tuple[tuple[str, str | None, str, bool], ...] = (
    ("gate_proj", "up_proj", "down_proj", False),
    ("gate_up_proj", None, "down_proj", True),
    ("Wi", None, "Wo", True),
    ("fc1", None, "fc2", False),
    ("fc_in", None, "fc_out", False),
    ("c_fc", None, "c_proj", False),
    ("dense_h_to_4h", None, "dense_4h_to_h", False),
)
"""``(gate, up, down, fused)``: the MLP shapes recognised, by the names of the MLP's linears."""
MLP_NAMES = ("mlp", "feed_forward", "ffn")
ACTIVATION_NAMES = ("act_fn", "act", "activation_fn", "activation")


@dataclass(frozen=True)
class BlockShape:
    """Where a model's blocks are and what their MLP is."""

    blocks: str
    """The blocks' ``ModuleList`` in the model class (``"model.layers"``, ``"transformer.h"``)."""
    base_blocks: str
    """The same inside ``model.base_model`` (``"layers"``, ``"h"``)."""
    unit: ScoredUnit
    activation: str
    """The MLP's attribute holding its activation module."""


def _linear_kind(module: nn.Module) -> str | None:
    from transformers.pytorch_utils import Conv1D

    return "linear" if isinstance(module, nn.Linear) else "conv1d" if isinstance(module, Conv1D) else None


@functools.lru_cache(maxsize=32)
def _block_shape(model_class: type[PreTrainedModel], config_json: str) -> BlockShape | None:
    """The :class:`BlockShape` of a class, from a model built on the meta device (``None``: not recognised)."""
    import json

    config = model_class.config_class.from_dict(json.loads(config_json))
    if (getattr(config, "is_encoder_decoder", False) or getattr(model_class, "main_input_name", "") != "input_ids"
            or any(hasattr(config, key) for key in ("vision_config", "audio_config"))):
        return None  # encoder-decoders and multimodal models: other towers, other inputs
    with torch.device("meta"):
        model = model_class(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    count = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None)
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and count and len(module) == count
             and len({type(block) for block in module}) == 1]
    if len(lists) != 1:
        return None
    path, blocks = lists[0]
    base = getattr(model, "base_model", model)
    base_path = next((name for name, module in base.named_modules() if module is blocks), None)
    if base_path is None:
        return None
    for mlp_name in MLP_NAMES:
        for gate, up, down, fused in MLP_SHAPES:
            shapes = {_mlp_kind(block, mlp_name, (gate, up, down)) for block in blocks}  # every block alike
            if len(shapes) != 1 or None in shapes:
                continue
            kind, activation = shapes.pop()
            unit = ScoredUnit(gate=f"{mlp_name}.{gate}", up=f"{mlp_name}.{up}" if up else None,
                              down=f"{mlp_name}.{down}", fused=fused, transposed=kind == "conv1d")
            return BlockShape(path, base_path, unit, activation)
    return None


def _mlp_kind(block: nn.Module, mlp_name: str, names: tuple[str | None, ...]) -> tuple[str, str] | None:
    """``(linear kind, activation attribute)`` of a block's MLP holding the linears ``names``, else ``None``."""
    mlp = getattr(block, mlp_name, None)
    if not isinstance(mlp, nn.Module):
        return None
    activation = next((a for a in ACTIVATION_NAMES if callable(getattr(mlp, a, None))), None)
    kinds = {_linear_kind(m) if isinstance(m, nn.Module) else None for m in (getattr(mlp, n, None) for n in names if n)}
    if activation is None or None in kinds or len(kinds) != 1:
        return None
    return kinds.pop(), activation


def block_shape(model_class: type[PreTrainedModel], config: PretrainedConfig) -> BlockShape | None:
    return _block_shape(model_class, config.to_json_string(use_diff=False))


class _Recorded(Exception):
    """Raised by the last block's recorder: the rest of the model's forward is not needed."""


class _AtUnit(Exception):
    """Raised at the unit's input: the first half of a block ends there."""

    def __init__(self, u: torch.Tensor) -> None:
        super().__init__()
        self.u = u


_STOP = threading.local()  # the unit module at which this thread's block forward stops (forward_to_target)
_CAPTURE = threading.Lock()  # recording swaps the blocks' forward: one recording at a time


def _stop_at_unit(module: nn.Module, args: tuple) -> None:
    if getattr(_STOP, "module", None) is module:
        raise _AtUnit(args[0])


class HookedAdapter(GenericAdapter):
    """Any text decoder or encoder of a recognised MLP shape (see the module docstring): node M-Loss on every
    block's MLP, the model's own forward walked block by block."""

    scorable = True
    fallback = True  # after the dedicated families, before the plain generic adapter (registered after it)
    name = "hooked"
    modality: ClassVar[str] = "text"
    input_names: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask")

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        shape = block_shape(self.model_class, config)
        if shape is None:
            raise ValueError(f"{config.model_type!r}: no block list with a recognised MLP")
        self.shape = shape
        self.name = config.model_type  # models of two families never merge together
        self.unit = shape.unit
        self.target_suffix = shape.unit.gate
        self.layer_pattern = re.compile(re.escape(shape.blocks) + r"\.(\d+)\.")

    @classmethod
    def matches(cls, config: PretrainedConfig) -> bool:
        if not super().matches(config):
            return False
        try:
            return block_shape(resolve_model_class(config), config) is not None
        except Exception:  # noqa: BLE001  (a config transformers cannot build on meta: the plain generic adapter)
            return False

    # ----------------------------------------------------------------- names
    def layer_prefix(self, layer: int) -> str:
        return f"{self.shape.blocks}.{layer}."

    def node_groups(self, layer: int) -> list[tuple[str, int]]:
        return super(GenericAdapter, self).node_groups(layer)

    # ----------------------------------------------------------------- the block walk
    def layers(self, model: PreTrainedModel) -> list[nn.Module]:
        blocks = list(getattr(model, "base_model", model).get_submodule(self.shape.base_blocks))
        for index, block in enumerate(blocks):
            block._hf_mloss_layer = index  # kept by the walk's copies: which captured arguments a block takes
            gate = block.get_submodule(self.unit.gate)
            if not getattr(gate, "_hf_mloss_stop", False):
                gate.register_forward_pre_hook(_stop_at_unit)
                gate._hf_mloss_stop = True
        return blocks

    def activation(self, model: PreTrainedModel | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        if model is not None:
            mlp = self.layers(model)[0].get_submodule(self.unit.gate.rpartition(".")[0])
            return getattr(mlp, self.shape.activation)
        from transformers.activations import ACT2FN

        return ACT2FN[self.activation_name()]  # the module the config builds (GenericAdapter's raises)

    def embed(self, model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, BlockContext]:
        """The hidden states entering block 0 and every block's arguments, from the model's own forward with each
        block's forward replaced by a recorder (no block computed)."""
        base = getattr(model, "base_model", model)
        blocks = self.layers(model)
        inputs = self._inputs(base, batch)
        calls: list[tuple[tuple, dict]] = []

        def recorder(index: int) -> Callable:
            def record(*args: Any, **kwargs: Any) -> torch.Tensor:
                calls.append((args, kwargs))
                if index == len(blocks) - 1:
                    raise _Recorded
                return args[0] if args else kwargs["hidden_states"]
            return record

        with _CAPTURE:
            for index, block in enumerate(blocks):
                block.forward = recorder(index)
            try:
                base(**inputs)
            except _Recorded:
                pass
            finally:
                for block in blocks:
                    del block.forward
        if len(calls) != len(blocks):
            raise RuntimeError(f"{type(base).__name__}'s forward called {len(calls)} of its {len(blocks)} blocks")
        args, kwargs = calls[0]
        hidden = args[0] if args else kwargs["hidden_states"]
        arguments = [(args[1:] if args else (), {k: v for k, v in kw.items() if k != "hidden_states"})
                     for args, kw in calls]
        mask = batch.get("attention_mask")
        return hidden, BlockContext(mask=None if mask is None else mask.bool(), extras={"calls": arguments})

    @staticmethod
    def _inputs(base: nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        from .llama import pad_aware_positions

        mask = batch.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(batch["input_ids"])
        accepted = inspect.signature(base.forward).parameters
        inputs = {"input_ids": batch["input_ids"], "attention_mask": mask}
        if "position_ids" in accepted:
            inputs["position_ids"] = pad_aware_positions(mask)
        if "use_cache" in accepted:
            inputs["use_cache"] = False
        return inputs

    def _call(self, block: nn.Module, hidden: torch.Tensor, context: BlockContext) -> torch.Tensor:
        args, kwargs = context.extras["calls"][block._hf_mloss_layer]
        out = block(hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def forward_to_target(self, layer: nn.Module, hidden: torch.Tensor, context: BlockContext
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the block up to its unit's input (the block's input is the "residual" the second half starts from)."""
        _STOP.module = layer.get_submodule(self.unit.gate)
        try:
            self._call(layer, hidden, context)
        except _AtUnit as stop:
            return hidden, stop.u
        finally:
            _STOP.module = None
        raise RuntimeError(f"block {layer._hf_mloss_layer} did not call {self.unit.gate}")

    def forward_from_target(self, layer: nn.Module, residual: torch.Tensor, target_input: torch.Tensor,
                            context: BlockContext) -> torch.Tensor:
        return self._call(layer, residual, context)

    # ----------------------------------------------------------------- outputs without labels
    def output_rule(self, model: PreTrainedModel):
        """A causal LM: the next-token distribution at every real position; any other class: the mean of the last
        hidden states over the real tokens."""
        from .bert import mean_pool
        from .llama import causal_logits, is_causal_lm
        from .outputs import NextTokenDistribution, PooledFeatures

        if is_causal_lm(model):
            return NextTokenDistribution(causal_logits, "next-token distribution at every real position")
        return PooledFeatures(mean_pool, "mean of the last hidden states over the real tokens")
