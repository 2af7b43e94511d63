"""Data-free merging of any transformers model, and whole-model merges of a scored tower's container.

:class:`GenericAdapter` is registered last and matches every ``model_type`` transformers builds without remote code
(Llama, Mistral, Qwen2, BERT, GPT-2...). The data-free methods (average, task arithmetic, TIES, DARE) need nothing
model-specific besides the tensor names, the class the merge is written as and the tokenizer or processor saved
beside it; this adapter gives exactly that. Names are the loaded model's parameter names: a checkpoint is read
through transformers' own conversion (:mod:`.layout`: renames, prefixes, MoE experts fused into one tensor per
layer), as ``from_pretrained`` reads it; tied tensors (``lm_head.weight`` tied to the input embeddings) are merged once, through the
tensor they are tied to, and the merge is saved with ``save_pretrained`` so it stays tied. It offers no M-Loss
scoring: data-guided methods, ``score()`` and ``compatibility()`` refuse it with the reason.

:func:`whole_model_adapter` turns a tower adapter (CLIP vision) into one that merges the whole container model
(``CLIPModel``: the text tower, the projections and ``logit_scale`` too) while scoring still runs on the tower.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ..errors import InvalidParameterError, UnsupportedModelError
from .base import EMBEDDING_STAGE, BlockContext, ModelAdapter

DATA_FREE_METHODS = ("average", "task_arithmetic", "ties", "dare_ties", "dare_linear")

# transformers' auto mappings (model_type -> class name) and the Hub pipeline tag of the classes they list
_TAGGED_MAPPINGS = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "text-generation"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "text2text-generation"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "fill-mask"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "text-classification"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token-classification"),
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "question-answering"),
    ("MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES", "zero-shot-image-classification"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image-classification"),
    ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "image-text-to-text"),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "automatic-speech-recognition"),
)


def scoring_unavailable(model_type: str | None, what: str = "M-Loss scoring") -> str:
    """The message of a refused data-guided run on a family without scoring."""
    from .registry import ADAPTERS

    scored = sorted(t for cls in ADAPTERS.values() if getattr(cls, "scorable", True) for t in cls.model_types)
    return (f"{what} needs a scored model family, and scoring is not available yet for model_type={model_type!r} "
            f"(scored: {scored}, and any text decoder or encoder whose blocks hold a common MLP shape: gated "
            "gate/up/down, fused gate_up, fc1/fc2 and their GPT-2, GPT-J and GPT-NeoX spellings; not encoder-"
            "decoders, multimodal models or other mixture-of-experts models). The data-free methods work on any "
            "transformers model: "
            f"{', '.join(DATA_FREE_METHODS)} (e.g. hf_mloss.merge(base, models, 'ties', k=0.2)).")


def resolve_model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The class a checkpoint is built as: ``config.architectures[0]`` when transformers provides it (never remote
    code), else the base model class of ``AutoModel`` for the config."""
    import transformers
    from transformers import AutoModel

    for arch in list(getattr(config, "architectures", None) or [])[:1]:
        cls = getattr(transformers, arch, None) if isinstance(arch, str) and arch.isidentifier() else None
        if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
            raise UnsupportedModelError(
                f"config.architectures names {str(arch)[:80]!r}, which transformers does not provide (custom code, "
                "which hf_mloss never runs, or a newer transformers). Install a transformers that has it, or set "
                "`architectures` in config.json to the transformers class the weights belong to.")
        if not isinstance(config, cls.config_class):
            raise UnsupportedModelError(
                f"config.architectures names {arch!r}, whose config is {cls.config_class.__name__}, but "
                f"model_type={config.model_type!r} gives a {type(config).__name__}; config.json is inconsistent.")
        return cls
    try:
        return AutoModel._model_mapping[type(config)]
    except (KeyError, ValueError):
        raise UnsupportedModelError(
            f"transformers has no model class for model_type={config.model_type!r} (no `architectures` in "
            "config.json and no AutoModel mapping).") from None


def pipeline_tag_for(model_class: type[PreTrainedModel]) -> str:
    """The Hub ``pipeline_tag`` of a transformers class (``LlamaForCausalLM`` -> ``text-generation``)."""
    from transformers.models.auto import modeling_auto

    name = model_class.__name__
    for mapping, tag in _TAGGED_MAPPINGS:
        for value in getattr(modeling_auto, mapping, {}).values():
            if name == value or (isinstance(value, (tuple, list)) and name in value):
                return tag
    vision = getattr(model_class, "main_input_name", "input_ids") == "pixel_values"
    return "image-feature-extraction" if vision else "feature-extraction"


@functools.lru_cache(maxsize=16)
def _meta_state(model_class: type[PreTrainedModel], config_json: str) -> tuple[dict[str, tuple[int, ...]],
                                                                               frozenset[str], frozenset[str]]:
    """(shapes of every tensor the class saves, buffers it does not save, tensors tied to another one)."""
    import json

    config = model_class.config_class.from_dict(json.loads(config_json))
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = model_class(config)
    state = model.state_dict()
    tied = frozenset(getattr(model, "all_tied_weights_keys", None) or ())
    unsaved = frozenset(name for name, _ in model.named_buffers() if name not in state)
    return {k: tuple(v.shape) for k, v in state.items()}, unsaved, tied


def meta_state(model_class: type[PreTrainedModel], config: PretrainedConfig):
    """See :func:`_meta_state` (cached per class and config)."""
    return _meta_state(model_class, config.to_json_string(use_diff=False))


class GenericAdapter(ModelAdapter):
    """Any transformers model, data-free: checkpoint keys as names, the base's class as output, no scoring."""

    name = "generic"
    model_types = ()
    model_class = PreTrainedModel  # replaced by the config's class in __init__
    layer_pattern = re.compile(r"(?:.*\.)?(?:layers|layer|h|blocks|block)\.(\d+)\.")
    target_suffix = ""
    fallback = True
    scorable: ClassVar[bool] = False
    saves_with_transformers: ClassVar[bool] = True
    """The merge is written with the model's own ``save_pretrained`` (tied tensors saved once, generation config)."""

    def __init__(self, config: PretrainedConfig) -> None:
        from .layout import checkpoint_layout

        super().__init__(config)
        self.model_class = resolve_model_class(config)
        self.layout = checkpoint_layout(self.model_class, config)
        """transformers' own key map of the class (renames, prefixes, fused MoE experts)."""

    @classmethod
    def matches(cls, config: PretrainedConfig) -> bool:
        from transformers import CONFIG_MAPPING

        return getattr(config, "model_type", None) in CONFIG_MAPPING

    @property
    def merged_class(self) -> type[PreTrainedModel]:
        return self.model_class

    @property
    def num_layers(self) -> int:
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        return int(getattr(text, "num_hidden_layers", 0) or 0)

    def canonical_key(self, key: str) -> str | None:
        """The loaded model's name of a checkpoint key, as ``from_pretrained`` maps it (``None``: a tensor the class
        does not load, which transformers leaves out too)."""
        return self.layout.name(key)

    def checkpoint_key(self, key: str) -> tuple[str | None, str | None]:
        return self.layout.lookup(key)

    def is_embedding(self, name: str) -> bool:
        return "embed" in name or any(part in ("wte", "wpe") for part in name.split("."))

    def layer_prefix(self, layer: int) -> str:
        raise UnsupportedModelError(scoring_unavailable(self.config.model_type))

    def tied_names(self) -> frozenset[str]:
        """Tensors tied to another one (merged through it, never on their own), by canonical name."""
        return frozenset(n for k in meta_state(self.model_class, self.config)[2]
                         if (n := self.canonical_key(k)) is not None)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes, _, tied = meta_state(self.model_class, self.config)
        return {name: shape for key, shape in shapes.items()
                if key not in tied and (name := self.canonical_key(key)) is not None}

    def output_class(self, output: str) -> type[PreTrainedModel]:
        if output == "tower":
            raise InvalidParameterError(
                f"output='tower' keeps one tower of a whole model (a CLIPModel's vision tower); a "
                f"{self.config.model_type!r} model has none. Use output='auto' (the base's class).")
        return self.model_class

    def tower(self, model: PreTrainedModel) -> PreTrainedModel:
        return model

    def output_pipeline_tag(self, model: PreTrainedModel) -> str:
        return pipeline_tag_for(type(model))

    def card_metadata(self, model: PreTrainedModel | None = None) -> dict[str, Any]:
        return {"library_name": "transformers", "pipeline_tag": pipeline_tag_for(type(model) if model is not None
                                                                                  else self.model_class)}

    def load_processor(self, path: str, *, token: str | bool | None = None, full: bool = False) -> Any:
        """The base's processor (multimodal models), else its tokenizer, else its image processor or feature
        extractor: whatever the model's pipeline needs beside the weights."""
        from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, AutoTokenizer

        errors = []
        for loader in (AutoProcessor, AutoTokenizer, AutoImageProcessor, AutoFeatureExtractor):
            try:
                return loader.from_pretrained(path, trust_remote_code=False, token=token)
            except (OSError, ValueError, TypeError, KeyError, ImportError) as err:  # ImportError: torchvision
                errors.append(f"{loader.__name__}: {' '.join(str(err).split())[:80]}")
        raise OSError(f"no tokenizer or processor in {path!r} ({'; '.join(errors)})")

    def activation(self, model: PreTrainedModel | None = None):
        raise UnsupportedModelError(scoring_unavailable(self.config.model_type))

    def layers(self, model: PreTrainedModel) -> list[nn.Module]:
        raise UnsupportedModelError(scoring_unavailable(self.config.model_type))

    def embed(self, model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, BlockContext]:
        raise UnsupportedModelError(scoring_unavailable(self.config.model_type))

    def forward_to_target(self, layer: nn.Module, hidden: torch.Tensor, context: BlockContext | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        raise UnsupportedModelError(scoring_unavailable(self.config.model_type))

    def forward_from_target(self, layer: nn.Module, residual: torch.Tensor, target_input: torch.Tensor,
                            context: BlockContext | None = None) -> torch.Tensor:
        raise UnsupportedModelError(scoring_unavailable(self.config.model_type))

    def node_groups(self, layer: int) -> list[tuple[str, int]]:
        raise UnsupportedModelError(scoring_unavailable(self.config.model_type))


# ---------------------------------------------------------------------------------------------- whole models
class WholeModelMixin:
    """Merges every tensor of a tower adapter's container model (``CLIPModel``), scoring only the tower.

    Tower tensors keep the tower's canonical names (so scoring, reports and M-TIES row trims are unchanged); the
    others (text tower, projections, ``logit_scale``) are named by their checkpoint key and sit in the last stage:
    a data-guided method merges them with its data-free rule (M-TIES: TIES trim at k; M-DARE: DARE at p).
    """

    whole_model: ClassVar[bool] = True

    @property
    def merged_class(self) -> type[PreTrainedModel]:
        return self.containers[self.full_config.model_type][0]

    @property
    def merged_config(self) -> PretrainedConfig:
        return self.full_config

    def canonical_key(self, key: str) -> str | None:
        name = super().canonical_key(key)
        if name is not None:
            return name
        attribute = self.containers[self.full_config.model_type][1]
        return None if key.startswith(f"{attribute}.") else key

    @property
    def report_prefix(self) -> str:
        """How the scored tower's layers are named in a report of the whole model (``"vision_model."``)."""
        return f"{self.containers[self.full_config.model_type][1]}."

    def is_outside_tower(self, name: str) -> bool:
        """Whether a canonical name lies outside the scored tower (merged without data)."""
        return super().canonical_key(name) is None

    def tied_names(self) -> frozenset[str]:
        return frozenset(n for k in meta_state(self.merged_class, self.full_config)[2]
                         if (n := self.canonical_key(k)) is not None)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes, _, tied = meta_state(self.merged_class, self.full_config)
        return {name: shape for key, shape in shapes.items()
                if key not in tied and (name := self.canonical_key(key)) is not None}


@functools.lru_cache(maxsize=None)
def _whole_class(adapter_cls: type[ModelAdapter]) -> type[ModelAdapter]:
    return type(f"Whole{adapter_cls.__name__}", (WholeModelMixin, adapter_cls), {"__module__": __name__})


def has_container(adapter: ModelAdapter) -> bool:
    """Whether the adapter's config is a whole model holding the adapter's tower (a full ``CLIPModel``)."""
    return getattr(adapter.full_config, "model_type", None) in adapter.containers


def whole_model_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """The adapter that merges the whole container model of ``adapter`` (see :class:`WholeModelMixin`); an adapter
    of a whole model already (a vision-language model's) is its own."""
    if getattr(adapter, "whole_model", False):
        return adapter
    if not has_container(adapter):
        raise ValueError(f"{adapter.name} config {adapter.full_config.model_type!r} is not a whole model")
    return _whole_class(type(adapter))(adapter.full_config)


# ---------------------------------------------------------------------------------------------- other towers
class TowerViewMixin:
    """A tower adapter read inside its whole model: every canonical name carries the tower's attribute prefix
    (``text_model.encoder.layers.0.mlp.fc1.weight``), the spelling a whole-model adapter gives the tensors outside
    its own tower. The block walk, scoring and M-TIES's node groups then run on that tower of the whole model's
    stores exactly as the tower adapter runs them alone (same ``embed``, blocks, masks, unit)."""

    tower_prefix: ClassVar[str] = ""
    """``"text_model."``: the tower's attribute in the whole model, with a dot."""

    @property
    def tower_attribute(self) -> str:
        return self.tower_prefix[:-1]

    def owns(self, name: str) -> bool:
        """Whether a whole-model canonical name is a tensor of this tower."""
        return name.startswith(self.tower_prefix) and \
            super().canonical_key(name[len(self.tower_prefix):]) is not None

    def canonical_key(self, key: str) -> str | None:
        name = super().canonical_key(key)
        return None if name is None else f"{self.tower_prefix}{name}"

    def stage_of(self, name: str) -> int:
        if not self.owns(name):
            return self.num_layers  # outside the tower: after its blocks
        inner = name[len(self.tower_prefix):]
        match = self.layer_pattern.match(inner)
        if match:
            return int(match.group(1))
        return EMBEDDING_STAGE if super().is_embedding(inner) else self.num_layers

    def is_embedding(self, name: str) -> bool:
        return self.owns(name) and super().is_embedding(name[len(self.tower_prefix):])

    def layer_prefix(self, layer: int) -> str:
        return f"{self.tower_prefix}{super().layer_prefix(layer)}"


@functools.cache
def _view_class(adapter_cls: type[ModelAdapter], prefix: str) -> type[ModelAdapter]:
    return type(f"{adapter_cls.__name__}In{prefix[:-1].title().replace('_', '').replace('.', '')}",
                (TowerViewMixin, adapter_cls),
                {"__module__": __name__, "tower_prefix": prefix})


def tower_view(adapter_cls: type[ModelAdapter], attribute: str, config: PretrainedConfig) -> ModelAdapter:
    """``adapter_cls`` (built on ``config``) seen as the tower at ``attribute`` of a whole model (dotted for a nested
    one: ``model.language_model``); see :class:`TowerViewMixin`."""
    return _view_class(adapter_cls, f"{attribute}.")(config)


def other_towers(adapter: ModelAdapter) -> list[ModelAdapter]:
    """The other scored towers of ``adapter``'s whole model, as :class:`TowerViewMixin` views (a CLIPModel's text
    tower, for the CLIP vision adapter): every registered adapter whose ``containers`` hold the same whole-model type
    under another attribute, or the views the whole model's adapter names itself (a vision-language model's language
    model). Empty for a config that is not a whole model, or a whole model with no other adapter."""
    from .registry import ADAPTERS

    if hasattr(adapter, "other_tower_views"):
        return adapter.other_tower_views()
    model_type = getattr(adapter.full_config, "model_type", None)
    own = adapter.containers.get(model_type)
    if own is None:
        return []
    views = []
    for cls in ADAPTERS.values():
        entry = cls.containers.get(model_type)
        if entry is not None and entry[1] != own[1] and not cls.fallback:
            views.append(_view_class(cls, f"{entry[1]}.")(adapter.full_config))
    return views
