"""M-Loss scoring of mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE as transformers 5 builds them).

An MoE block's MLP (``mlp``) is a router (``mlp.gate``: top-k of a softmax over the experts) and E gated experts
held fused: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (expert e's gate rows, then its up rows) and
``mlp.experts.down_proj`` ``[E, H, I]``; Qwen2-MoE adds a shared expert (``mlp.shared_expert``, a plain gated MLP
every token goes through, its output scaled by sigmoid(``mlp.shared_expert_gate`` · u)). Qwen2/3-MoE may keep some
blocks dense (``mlp_only_layers``, ``decoder_sparse_step``): their ``mlp`` is a plain gated MLP.

The scored unit of every block is its whole ``mlp`` (report key ``model.layers.{l}.mlp``), in *parts*
(:class:`ExpertPart`): each routed expert, then the shared expert, or the one MLP of a dense block. Node i of a part
is its gated unit f(gate_i · u)·(up_i · u): row i (and I + i) of ``gate_up_proj[e]`` and column i of
``down_proj[e]``. The block's node vector lists the parts' nodes in that order. Each part has its *weights*: the
factor the block multiplies its output by at every token, read from the block's own modules
(:meth:`MoeAdapter.part_weights`): an expert's routing weight where the router sends the token to it (0 where not),
the shared expert's sigmoid gate, 1 for a dense MLP. :mod:`hf_mloss.engine.experts` turns them into the weighted
M-Loss of each part (docs/mloss.md, "Mixture-of-experts").

The walk is the hooked adapter's (:mod:`.hooked`): the model's own forward recorded once per batch, each block run
by its own forward and stopped at the input of ``mlp``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .base import ScoredUnit
from .generic import GenericAdapter, resolve_model_class
from .hooked import BlockShape, HookedAdapter

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
"""The families whose router is read as :meth:`MoeAdapter.part_weights` reads it (checked against each module's
forward in transformers 5.24): ``(logits, top-k weights, top-k indices) = mlp.gate(u)``, expert e's output scaled by
its weight. Other MoE families (DeepSeek-V3's grouped routing, GPT-OSS's biased experts) merge data-free."""


@dataclass(frozen=True)
class ExpertPart:
    """One gated MLP of a block's scored unit: a routed expert, the shared expert, or a dense block's MLP."""

    label: str
    """How reports name it: ``"experts.3"``, ``"shared_expert"``, ``"mlp"`` (a dense block)."""
    path: str
    """Its module, relative to the block: ``"mlp.experts"``, ``"mlp.shared_expert"``, ``"mlp"``."""
    nodes: int
    expert: int | None = None
    """Routed experts: the index into the fused 3-D tensors (``gate_up_proj[expert]``)."""

    def rows(self, tensors: Callable[[str], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate rows, up rows)``, each ``[nodes, H]``, from ``tensors(suffix)`` (the part's module tensors by
        name relative to :attr:`path`: a block's parameters or a checkpoint's)."""
        if self.expert is None:
            return tensors("gate_proj.weight"), tensors("up_proj.weight")
        fused = tensors("gate_up_proj")[self.expert]
        return fused[: self.nodes], fused[self.nodes:]

    def tensor_names(self) -> tuple[str, ...]:
        """Its tensors' names relative to :attr:`path`."""
        return ("gate_up_proj",) if self.expert is not None else ("gate_proj.weight", "up_proj.weight")


def _is_sparse(mlp: nn.Module) -> bool:
    experts = getattr(mlp, "experts", None)
    return (isinstance(getattr(mlp, "gate", None), nn.Module) and isinstance(experts, nn.Module)
            and all(getattr(getattr(experts, name, None), "dim", lambda: 0)() == 3
                    for name in ("gate_up_proj", "down_proj")))


def _is_gated(mlp: nn.Module) -> bool:
    return all(isinstance(getattr(mlp, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj"))


Layout = tuple[tuple[tuple[str, int], ...], ...]
"""Per block, ``(label, nodes)`` of each part."""


@functools.lru_cache(maxsize=16)
def _moe_layout(model_class: type[PreTrainedModel], config_json: str) -> tuple[str, Layout] | None:
    """The blocks' path in the class (``"model.layers"``; ``"layers"`` for a bare ``MixtralModel``) and, per block,
    ``(label, nodes)`` of each of its parts, read from the model built on ``meta`` (``None``: not an MoE decoder of
    a recognised shape)."""
    import json

    config = model_class.config_class.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = model_class(config)
    blocks = getattr(getattr(model, "base_model", model), "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        return None
    path = next(name for name, module in model.named_modules() if module is blocks)
    layout = []
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        if mlp is not None and _is_sparse(mlp):
            count, width, _ = mlp.experts.gate_up_proj.shape
            parts = [(f"experts.{e}", width // 2) for e in range(count)]
            shared = getattr(mlp, "shared_expert", None)
            if shared is not None:
                if not (_is_gated(shared) and isinstance(getattr(mlp, "shared_expert_gate", None), nn.Linear)):
                    return None
                parts.append(("shared_expert", shared.gate_proj.out_features))
            layout.append(tuple(parts))
        elif mlp is not None and _is_gated(mlp):
            layout.append((("mlp", mlp.gate_proj.out_features),))
        else:
            return None
    return (path, tuple(layout)) if any(len(parts) > 1 for parts in layout) else None


class MoeAdapter(HookedAdapter):
    """Mixture-of-experts decoders: gated node M-Loss per expert on the tokens the router sends to it (see the
    module docstring); the walk of :class:`~hf_mloss.adapters.hooked.HookedAdapter`."""

    scorable = True
    fallback = False
    name = "moe"
    model_types: ClassVar[tuple[str, ...]] = MOE_MODEL_TYPES
    experts: ClassVar[bool] = True
    """Scored by :mod:`hf_mloss.engine.experts` (routed parts), not by the dense kernel of one linear."""

    def __init__(self, config: PretrainedConfig) -> None:
        GenericAdapter.__init__(self, config)
        found = _moe_layout(self.model_class, config.to_json_string(use_diff=False))
        if found is None:
            raise ValueError(f"{config.model_type!r}: no MoE block of a recognised shape")
        blocks, self.part_layout = found
        self.name = config.model_type
        self.shape = BlockShape(blocks, "layers", ScoredUnit(gate="mlp"), "act_fn")
        self.unit = self.shape.unit  # the walk stops at the input of the whole MLP (the router's input too)
        self.target_suffix = "mlp"
        self.layer_pattern = re.compile(re.escape(blocks) + r"\.(\d+)\.")

    @classmethod
    def matches(cls, config: PretrainedConfig) -> bool:
        if getattr(config, "model_type", None) not in cls.model_types:
            return False
        try:
            return _moe_layout(resolve_model_class(config), config.to_json_string(use_diff=False)) is not None
        except Exception:  # noqa: BLE001  (a config transformers cannot build on meta: the plain generic adapter)
            return False

    # ----------------------------------------------------------------- parts and node groups
    def parts(self, layer: int) -> list[ExpertPart]:
        """The gated MLPs of block ``layer``'s unit, in the order of its node vector."""
        out = []
        for label, nodes in self.part_layout[layer]:
            if label.startswith("experts."):
                out.append(ExpertPart(label, "mlp.experts", nodes, expert=int(label.split(".")[1])))
            else:
                out.append(ExpertPart(label, "mlp" if label == "mlp" else f"mlp.{label}", nodes))
        return out

    def node_groups(self, layer: int) -> list[tuple]:
        """Each part's tensors with the span of the node vector they hold: the fused experts ``(gate_up_proj, 1,
        (0, E·I))`` (expert e's rows i and I + i belong to its node i) and ``(down_proj, 2, (0, E·I))`` (expert e's
        column i); the shared expert's (or a dense block's) gate / up rows and down columns after them."""
        prefix, parts = self.layer_prefix(layer), self.parts(layer)
        routed = [p for p in parts if p.expert is not None]
        out: list[tuple] = []
        start = 0
        if routed:
            span = (0, sum(p.nodes for p in routed))
            out += [(f"{prefix}mlp.experts.gate_up_proj", 1, span), (f"{prefix}mlp.experts.down_proj", 2, span)]
            start = span[1]
        for part in parts:
            if part.expert is None:
                span = (start, start + part.nodes)
                out += [(f"{prefix}{part.path}.gate_proj.weight", 0, span),
                        (f"{prefix}{part.path}.up_proj.weight", 0, span),
                        (f"{prefix}{part.path}.down_proj.weight", 1, span)]
                start = span[1]
        return out

    # ----------------------------------------------------------------- routing, as the block computes it
    def part_weights(self, block: nn.Module, u: torch.Tensor) -> torch.Tensor:
        """``[positions, parts]`` float32: the factor ``block`` multiplies each part's output by at each position
        of ``u`` (``[positions, H]``, the MLP's input): a routed expert's top-k weight from the block's own router
        (``mlp.gate``, as its forward computes it), 0 where the router does not send the position to it; the
        shared expert's sigmoid(``shared_expert_gate`` · u); 1 for a dense block's MLP."""
        mlp = block.get_submodule("mlp")
        if not _is_sparse(mlp):
            return u.new_ones(u.shape[0], 1, dtype=torch.float32)
        _, scores, indices = mlp.gate(u)
        weights = torch.zeros(u.shape[0], mlp.experts.gate_up_proj.shape[0], dtype=torch.float32, device=u.device)
        weights.scatter_(1, indices, scores.float())
        if getattr(mlp, "shared_expert", None) is None:
            return weights
        shared = torch.sigmoid(mlp.shared_expert_gate(u)).float()
        return torch.cat([weights, shared], dim=1)

    def activation(self, model: PreTrainedModel | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        if model is not None:
            mlp = self.layers(model)[0].get_submodule("mlp")
            return (mlp.experts if _is_sparse(mlp) else mlp).act_fn
        from transformers.activations import ACT2FN

        return ACT2FN[self.activation_name()]
