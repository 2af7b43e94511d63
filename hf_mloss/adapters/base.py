"""The adapter protocol: everything hf_mloss needs to know about one model family.

An adapter maps checkpoint key spellings to canonical tensor names, orders tensors into *stages* (the embeddings,
then one stage per transformer block, then the final norm), declares the scored unit of a block (:class:`ScoredUnit`:
the linear that feeds the activation, and for gated MLPs the linear it multiplies; the "nodes" that get an M-Loss)
and which tensor slices belong to a node (:meth:`ModelAdapter.node_groups`), and runs one block in two halves so the
scorer can capture the input of the unit without running the block twice. ``embed`` turns one batch of model inputs
into hidden states and a :class:`BlockContext` (padding mask, family-specific extras) that every block receives.
"""

from __future__ import annotations

import functools
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

EMBEDDING_STAGE = -1


@dataclass
class BlockContext:
    """Per-batch state a family's blocks need besides the hidden states."""

    mask: torch.Tensor | None = None
    """``[batch, seq]`` bool, True where a position counts (padding False); ``None``: every position counts."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Family-specific: a 4-D attention mask, position embeddings..."""


@dataclass(frozen=True)
class ScoredUnit:
    """The nodes of one block that get an M-Loss: ``gate`` feeds the activation; gated MLPs multiply by ``up``."""

    gate: str
    """Module suffix, relative to the block prefix: ``"mlp.fc1"``, ``"mlp.gate_proj"``, ``"intermediate.dense"``."""
    up: str | None = None
    """Gated units only: ``"mlp.up_proj"`` (node i is f(gate_i(u))·up_i(u))."""
    down: str | None = None
    """The linear that reads the unit, whose COLUMN i belongs to node i (``"mlp.down_proj"``); ``None``: its
    columns are not part of the node groups."""
    fused: bool = False
    """``gate`` computes both halves of a gated unit in one linear, ``[f's input | the multiplier]`` along its
    outputs (Phi-3's ``gate_up_proj``, ModernBERT's ``Wi``: ``a, b = out.chunk(2, -1)``, node i is f(a_i)·b_i)."""
    transposed: bool = False
    """The unit's linears store their weight as ``[in, out]`` (GPT-2's ``Conv1D``), not ``nn.Linear``'s
    ``[out, in]``: node i is column i of ``gate`` and row i of ``down``."""

    @property
    def gated(self) -> bool:
        """Whether a node is f(gate_i)·up_i (separate linears, or the halves of a fused one)."""
        return self.up is not None or self.fused

    def split(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(gate, up)`` pre-activations from the outputs of the unit's linears (a fused linear's halves)."""
        if self.fused:
            first, second = gate.chunk(2, dim=-1)
            return first, second
        return gate, up

    def rows(self, tensor: torch.Tensor | None) -> list[torch.Tensor | None]:
        """A weight (``[nodes, in]`` after un-transposing) or bias of the gate linear, as ``[gate rows, up rows]``
        for a fused unit, else ``[rows]``."""
        if tensor is None:
            return [None, None] if self.fused else [None]
        if self.transposed and tensor.dim() == 2:
            tensor = tensor.T
        return list(tensor.chunk(2, dim=0)) if self.fused else [tensor]


class ModelAdapter(ABC):
    """Knowledge about one model family, bound to one (vision) config.

    Subclasses set the class attributes and implement the abstract methods; ``register_adapter`` makes them
    available to :func:`hf_mloss.merge` and :func:`hf_mloss.score`.
    """

    name: ClassVar[str]
    """Registry key, lowercase (``"clip_vision"``)."""
    model_types: ClassVar[tuple[str, ...]]
    """``config.model_type`` values this adapter accepts (the whole-model type included, e.g. ``"clip"``)."""
    model_class: ClassVar[type[PreTrainedModel]]
    """The transformers class the merged model is loaded and saved as."""
    layer_pattern: ClassVar[re.Pattern[str]]
    """Regex whose group 1 is the block index in a canonical tensor name."""
    unit: ClassVar[ScoredUnit]
    """The scored unit of every block (its linears, relative to the block prefix)."""
    target_suffix: ClassVar[str]
    """``unit.gate``: module name, relative to a block, of the linear that feeds the activation (``"mlp.fc1"``)."""
    modality: ClassVar[str] = "image"
    """What ``data=`` must hold: ``"image"`` or ``"text"``."""
    fixed_image_size: ClassVar[bool] = False
    """The tower's position embeddings take images of ``config.image_size`` only (CLIP, SigLIP, ViT), so scoring
    images of another size are refused when read, not in the model's forward pass."""
    input_names: ClassVar[tuple[str, ...]] = ("pixel_values",)
    """The keys of one batch dict (:meth:`embed`)."""
    pipeline_tag: ClassVar[str] = "image-feature-extraction"
    fallback: ClassVar[bool] = False
    """Tried after every other registered adapter (the generic one, which accepts any model type)."""
    containers: ClassVar[dict[str, tuple[type[PreTrainedModel], str, str]]] = {}
    """Whole-model types that hold the merged tower: ``model_type -> (class, tower attribute, pipeline tag)``
    (CLIP: ``"clip" -> (CLIPModel, "vision_model", "zero-shot-image-classification")``)."""
    checkpoint_prefix: ClassVar[str] = ""
    """Prefix of the tower's keys in the saved file, chosen so every transformers version loads it."""
    key_bias: ClassVar[str | None] = None
    """The bias of a block's attention key projection (relative to the block prefix) where the scores are
    softmax(q·k) with no rotary position applied to k: changing it shifts every score of a query by the same amount,
    which the softmax ignores, so nothing downstream depends on it (its gradient is exactly zero). ``None``: no such
    tensor (rotary decoders, unknown families)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """``unit`` and ``target_suffix`` name the same linear: a subclass may set either."""
        super().__init_subclass__(**kwargs)
        if "unit" in cls.__dict__:
            cls.target_suffix = cls.unit.gate
        elif "target_suffix" in cls.__dict__:
            cls.unit = ScoredUnit(gate=cls.target_suffix)

    def __init__(self, config: PretrainedConfig) -> None:
        self.full_config = config
        self.config = self.model_config(config)

    # ----------------------------------------------------------------- config and names
    @classmethod
    def model_config(cls, config: PretrainedConfig) -> PretrainedConfig:
        """The config of the merged model (e.g. the vision sub-config of a full CLIP config)."""
        return config

    @classmethod
    def matches(cls, config: PretrainedConfig) -> bool:
        return getattr(config, "model_type", None) in cls.model_types

    @abstractmethod
    def canonical_key(self, key: str) -> str | None:
        """Canonical name of a checkpoint key, or ``None`` if the tensor is not part of the merged model."""

    def checkpoint_key(self, key: str) -> tuple[str | None, str | None]:
        """``(canonical name, fusing pattern)`` of a checkpoint key: the pattern (transformers' converter source
        pattern) when the key is one of several tensors transformers fuses into one parameter on load (MoE experts),
        else ``None``."""
        return self.canonical_key(key), None

    @property
    def num_layers(self) -> int:
        """Number of transformer blocks."""
        return self.config.num_hidden_layers

    def stage_of(self, name: str) -> int:
        """Stage of a canonical tensor: ``-1`` embeddings, ``0..L-1`` blocks, ``L`` everything after."""
        match = self.layer_pattern.match(name)
        if match:
            return int(match.group(1))
        return EMBEDDING_STAGE if self.is_embedding(name) else self.num_layers

    @abstractmethod
    def is_embedding(self, name: str) -> bool:
        """Whether a canonical tensor (outside the blocks) runs before the first block."""

    @abstractmethod
    def layer_prefix(self, layer: int) -> str:
        """Canonical name prefix of block ``layer`` (``"encoder.layers.3."``)."""

    def target_name(self, layer: int) -> str:
        """Canonical module name of the scored linear of block ``layer``."""
        return f"{self.layer_prefix(layer)}{self.target_suffix}"

    def gradient_free(self, name: str) -> bool:
        """Whether no output depends on canonical tensor ``name`` (a block's :attr:`key_bias`): a learned merge has
        nothing to learn there."""
        if self.key_bias is None:
            return False
        stage = self.stage_of(name)
        return 0 <= stage < self.num_layers and name == f"{self.layer_prefix(stage)}{self.key_bias}"

    def target_names(self) -> list[str]:
        return [self.target_name(layer) for layer in range(self.num_layers)]

    def node_groups(self, layer: int) -> list[tuple[str, int]]:
        """``(canonical tensor name, dim)`` pairs whose slice i belongs to node i of block ``layer``'s unit: dim 0 a
        row (a 1-D tensor: entry i), dim 1 a column. By default from :attr:`unit`: the gate's weight rows and bias
        entries, the up linear's rows (and bias entries), the down linear's weight columns (transposed weights:
        columns and rows swapped); tensors the model does not have (no bias) are left out. A fused unit's gate
        tensor holds 2 slices per node (i and n + i). CLIP: ``[("encoder.layers.3.mlp.fc1.weight", 0), (".. .bias",
        0)]``. A unit of several gated MLPs (an MoE block, :mod:`.experts`) gives each member a third entry, the
        ``(start, stop)`` span of the block's node vector it holds, and may name 3-D fused experts ``[E, ...]`` with
        dim 1 or 2 (the slices within each expert; expert e holds nodes start + e·n .. start + (e + 1)·n)."""
        prefix, unit, names = self.layer_prefix(layer), self.unit, self._tensor_names
        rows, columns = (1, 0) if unit.transposed else (0, 1)
        pairs = [(f"{prefix}{linear}.{kind}", rows if kind == "weight" else 0) for linear in (unit.gate, unit.up)
                 if linear for kind in ("weight", "bias")]
        if unit.down:
            pairs.append((f"{prefix}{unit.down}.weight", columns))
        return [(name, dim) for name, dim in pairs if name in names]

    @functools.cached_property
    def _tensor_names(self) -> frozenset[str]:
        return frozenset(self.expected_shapes())

    # ----------------------------------------------------------------- loading and saving
    def load_model(self, path: str, *, dtype: torch.dtype | None = None, **kwargs: Any) -> PreTrainedModel:
        """Load the tower class from a resolved local folder (never running code from the folder), with transformers'
        own modules: no Hub kernels swapped in (transformers 5.25 does by default), since the scoring hooks read
        those modules' inputs and outputs."""
        model = self.model_class.from_pretrained(path, dtype=dtype or "auto", trust_remote_code=False,
                                                 use_kernels=False, **kwargs)
        return model.eval()

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical name -> shape of every tensor the tower class saves for this config (built on the meta device:
        no memory, no initialisation)."""
        with torch.device("meta"):
            model = self.model_class(self.config)
        return {name: tuple(t.shape) for key, t in model.state_dict().items()
                if (name := self.canonical_key(key)) is not None}

    def output_class(self, output: str) -> type[PreTrainedModel]:
        """The class a merge writes: the base's whole-model class (``output="auto"``) or the tower's."""
        container = self.containers.get(getattr(self.full_config, "model_type", None))
        return container[0] if output == "auto" and container else self.model_class

    def load_output_model(self, path: str, output: str, *, dtype: torch.dtype | None = None,
                          allow_missing: frozenset[str] = frozenset(), **kwargs: Any) -> PreTrainedModel:
        """The model the merge is written into, loaded from the base's folder (see :meth:`output_class`).
        ``allow_missing``: canonical names every input lacks, which transformers initialises (a BERT pooler)."""
        from ..errors import IncompatibleCheckpointsError

        cls = self.output_class(output)
        model, info = cls.from_pretrained(path, dtype=dtype or "auto", trust_remote_code=False, use_kernels=False,
                                          output_loading_info=True, **kwargs)
        broken = [*(k for k in info.get("missing_keys", ()) if self.canonical_key(k) not in allow_missing),
                  *[k for k, *_ in info.get("mismatched_keys", ())]]
        if broken:
            raise IncompatibleCheckpointsError(
                f"{cls.__name__} from {path!r} would be incomplete: {len(broken)} tensor(s) are missing from the "
                f"weights or do not fit the config (e.g. {sorted(broken)[:3]}); transformers would initialise them "
                "randomly. config.json and the weights do not belong together.")
        return model.eval()

    def tower(self, model: PreTrainedModel) -> PreTrainedModel:
        """The part of an output model that is merged (the model itself, or e.g. ``CLIPModel.vision_model``)."""
        if isinstance(model, self.model_class):
            return model
        for cls, attribute, _ in self.containers.values():
            if isinstance(model, cls):
                return getattr(model, attribute)
        raise TypeError(f"{type(model).__name__} holds no {self.model_class.__name__}")

    def output_pipeline_tag(self, model: PreTrainedModel) -> str:
        for cls, _, tag in self.containers.values():
            if isinstance(model, cls):
                return tag
        return self.pipeline_tag

    def checkpoint_state_dict(self, model: PreTrainedModel) -> dict[str, torch.Tensor]:
        """The tensors to save, named as in the checkpoint layout that every supported transformers loads."""
        state = model.state_dict()
        if isinstance(model, self.model_class) and self.checkpoint_prefix:
            return {f"{self.checkpoint_prefix}{k}": v for k, v in state.items()}
        return state

    def load_processor(self, path: str, *, token: str | bool | None = None, full: bool = False) -> Any:
        """The image processor of a model (PIL backend: same on every machine); ``full``: the whole processor
        (image processor + tokenizer, e.g. ``CLIPProcessor``) for whole-model outputs."""
        from transformers import AutoImageProcessor, AutoProcessor

        if full:
            return AutoProcessor.from_pretrained(path, trust_remote_code=False, token=token)
        return AutoImageProcessor.from_pretrained(path, backend="pil", trust_remote_code=False, token=token)

    def layers(self, model: PreTrainedModel) -> list[nn.Module]:
        """The block modules of ``model`` in order."""

    def activation(self, model: PreTrainedModel | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """The element-wise activation that follows the scored linear, read from the model itself."""
        from transformers.activations import ACT2FN

        return ACT2FN[self.activation_name()]

    def activation_name(self) -> str:
        """The activation's name as the config spells it (``hidden_act``; Gemma's ``hidden_activation``, GPT-2's
        ``activation_function``), for reports and cards."""
        for key in ("hidden_activation", "hidden_act", "activation_function"):
            value = getattr(self.config, key, None)
            if isinstance(value, str):
                return value
        return "unknown"

    @abstractmethod
    def embed(self, model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, BlockContext]:
        """Hidden states entering block 0 for one batch (a dict keyed by :attr:`input_names`), and the batch's
        :class:`BlockContext` that every block of the walk receives."""

    @abstractmethod
    def forward_to_target(self, layer: nn.Module, hidden: torch.Tensor, context: BlockContext | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a block up to its scored unit: returns (residual state, input u of the unit's linears)."""

    @abstractmethod
    def forward_from_target(self, layer: nn.Module, residual: torch.Tensor, target_input: torch.Tensor,
                            context: BlockContext | None = None) -> torch.Tensor:
        """Finish a block from the scored unit's input: returns the block's output hidden states."""

    def output_rule(self, model: PreTrainedModel) -> Any:
        """How ``model``'s outputs are read and compared without labels (label-free selection, the output gap):
        by default its pooled output (``pooler_output``, else the first token), see :mod:`.outputs`."""
        from .outputs import PooledFeatures, first_token_pool

        return PooledFeatures(first_token_pool, "pooled output (pooler_output, else the first token)")

    reads_outputs_from_states: ClassVar[bool] = False
    """Whether :meth:`outputs_from_states` can read the outputs from the last block's states (a search on a model
    too large to hold walks it block by block and reads its outputs there)."""

    def outputs_from_states(self, model: PreTrainedModel, rule: Any, batch: Mapping[str, torch.Tensor],
                            hidden: torch.Tensor) -> torch.Tensor:
        """``rule``'s outputs of ``batch`` (:meth:`output_rule`) given ``hidden``, the last block's output states,
        where :attr:`reads_outputs_from_states`."""
        raise NotImplementedError(f"{type(self).__name__} does not read outputs from a block walk's states")

    def card_metadata(self, model: PreTrainedModel | None = None) -> dict[str, Any]:
        tag = self.output_pipeline_tag(model) if model is not None else self.pipeline_tag
        return {"library_name": "transformers", "pipeline_tag": tag}
