"""The base's own class kept: task heads around a scored tower, heads of another shape, vision-language models.

A scored tower family (ViT, DINOv2, CLIP and SigLIP vision) names its bare encoder as its class (``ViTModel``). A base
saved as a class around that encoder (``ViTForImageClassification``: the encoder under ``vit.`` and a
``classifier``) is merged as that class, never as the bare encoder (which would drop the head without a word and add
a pooler the base never had): :func:`kept_class_adapter` gives the family adapter a container entry for the base's
class, so the whole-model machinery (:class:`~hf_mloss.adapters.generic.WholeModelMixin`) merges every tensor of it,
data-guided methods score the encoder, and the head takes the method's data-free rule. The merge is written by the
class's own ``save_pretrained``, in the base's checkpoint layout. Families read by the generic adapter (BERT, LLaMA,
any other) already keep the base's class.

Fine-tunes whose classification head has another shape than the base's (another number of labels) cannot be merged
there: :func:`differing_heads` names the head's tensors, which are then taken from the base, and the card says so.

Vision-language models merge whole; LLaVA and Qwen2-VL are also scored tower by tower
(:mod:`hf_mloss.adapters.vision_language`). :func:`refuse_vision_language` refuses the data-guided runs the others
cannot have, and on those two the runs that do not walk the towers, with the reason.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from ..adapters import ModelAdapter
    from .store import TensorStore


# ---------------------------------------------------------------------------------------------- classes kept
def kept_class_adapter(adapter: ModelAdapter, config: PretrainedConfig) -> tuple[ModelAdapter, str | None]:
    """``adapter`` able to write the base's own class (see the module docstring), and a note for the card where it
    cannot (a class whose tensors the family does not read, e.g. ``ViTForMaskedImageModeling``'s mask token): then
    the family's bare class is written, and the note says so."""
    from ..adapters.generic import whole_model_adapter
    from ..errors import UnsupportedModelError

    if getattr(adapter, "saves_with_transformers", False):  # the generic adapter's families: the class is kept
        return adapter, None
    try:
        from ..adapters.generic import resolve_model_class

        cls = resolve_model_class(config)
    except UnsupportedModelError:
        return adapter, None
    if cls is adapter.model_class or any(cls is entry[0] for entry in adapter.containers.values()):
        return adapter, None  # the bare encoder, or a whole model the family knows (a CLIPModel)
    attribute = _tower_attribute(cls, adapter.model_class, config.to_json_string(use_diff=False))
    model_type = getattr(config, "model_type", None)
    if attribute is not None:
        kept = _kept_class(type(adapter), model_type, cls, attribute)(adapter.full_config)
        whole = whole_model_adapter(kept)
        keys = _class_keys(cls, config.to_json_string(use_diff=False))
        if all(whole.canonical_key(k) is not None for k in keys):
            return kept, None
    return adapter, (f"The base is a {cls.__name__}, whose tensors outside its {adapter.model_class.__name__} hf_mloss "
                     f"does not merge: the merge is written as a {adapter.model_class.__name__} (the base's other "
                     "tensors are not part of it).")


def holds_whole(adapter: ModelAdapter, config: PretrainedConfig) -> bool:
    """Whether a model of ``config`` is the whole model ``adapter`` merges: for a kept class, a model of that class
    (a bare ``ViTModel`` fine-tune of a ``ViTForImageClassification`` base holds the encoder only); else a model of a
    whole-model type the family knows (a ``CLIPModel``)."""
    model_type = getattr(config, "model_type", None)
    kept = getattr(adapter, "kept_class", None)
    if kept is None:
        return model_type in adapter.containers
    from ..adapters.generic import resolve_model_class
    from ..errors import UnsupportedModelError

    try:
        return resolve_model_class(config) is kept
    except UnsupportedModelError:
        return False


@functools.cache
def _kept_class(adapter_cls: type, model_type: str, cls: type, attribute: str) -> type:
    from ..adapters.generic import pipeline_tag_for

    containers = {**adapter_cls.containers, model_type: (cls, attribute, pipeline_tag_for(cls))}
    return type(f"{adapter_cls.__name__}In{cls.__name__}", (_KeptClassMixin, adapter_cls),
                {"__module__": __name__, "containers": containers, "kept_class": cls})


class _KeptClassMixin:
    """A family adapter whose base is a class around the family's encoder (see :func:`kept_class_adapter`)."""

    kept_class: type
    """The base's class (``ViTForImageClassification``), the one the merge is written as."""

    @property
    def saves_with_transformers(self) -> bool:
        """The whole class is written by its own ``save_pretrained``, in the base's checkpoint layout (transformers
        reverts its load-time renames); the encoder alone (``output="tower"``) as the family writes it."""
        return bool(getattr(self, "whole_model", False))

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """The encoder's tensors as the base's class holds it (a ``ViTForImageClassification`` builds its
        ``ViTModel`` without a pooler): the merge of encoder-only fine-tunes into the base's class."""
        config_json = self.full_config.to_json_string(use_diff=False)
        prefix = f"{self.containers[self.full_config.model_type][1]}."
        return {name: shape for key, shape in _class_shapes(self.kept_class, config_json).items()
                if key.startswith(prefix) and (name := self.canonical_key(key)) is not None}

    @property
    def head_label(self) -> str:
        """How cards name the tensors outside the encoder: ``the ViTForImageClassification head``."""
        return f"the {self.kept_class.__name__} head"


@functools.lru_cache(maxsize=32)
def _tower_attribute(cls: type, tower_cls: type, config_json: str) -> str | None:
    """The attribute of ``cls`` holding the family's encoder (``vit``), when exactly one child is one."""
    model = _meta_model(cls, config_json)
    found = [name for name, child in model.named_children() if isinstance(child, tower_cls)]
    return found[0] if len(found) == 1 else None


@functools.lru_cache(maxsize=32)
def _class_shapes(cls: type, config_json: str) -> dict[str, tuple[int, ...]]:
    return {key: tuple(t.shape) for key, t in _meta_model(cls, config_json).state_dict().items()}


def _class_keys(cls: type, config_json: str) -> tuple[str, ...]:
    return tuple(_class_shapes(cls, config_json))


def _meta_model(cls: type, config_json: str) -> PreTrainedModel:
    from .._logging import quiet_transformers

    config = cls.config_class.from_dict(json.loads(config_json))
    with quiet_transformers(True), torch.device("meta"):
        return cls(config)


# ---------------------------------------------------------------------------------------------- heads
def is_classifier(adapter: ModelAdapter) -> bool:
    """Whether the merged class is a ``*For...Classification`` class (a task head over a backbone)."""
    cls = getattr(adapter, "merged_class", None) or adapter.model_class
    return cls.__name__.endswith("Classification")


def in_head(adapter: ModelAdapter, name: str) -> bool:
    """Whether canonical ``name`` lies outside the merged class's backbone: outside the scored encoder of a kept
    class, else outside ``base_model_prefix`` (``classifier.weight``, ``score.weight``)."""
    if getattr(adapter, "whole_model", False):
        return adapter.is_outside_tower(name)
    prefix = getattr(getattr(adapter, "merged_class", adapter.model_class), "base_model_prefix", "") or ""
    return bool(prefix) and not name.startswith(f"{prefix}.")


def differing_heads(adapter: ModelAdapter, base: TensorStore, sources: Sequence[TensorStore]
                    ) -> tuple[list[str], str | None]:
    """The head tensors taken from the base, and the card's line on them: every tensor of a classification head
    when some fine-tune's head has another shape than the base's (another number of labels), so that no head is
    half merged; ``([], None)`` otherwise."""
    if not is_classifier(adapter):
        return [], None
    head = [n for n, dtype in base.dtypes.items() if dtype is not None and dtype.is_floating_point
            and in_head(adapter, n)]
    differ = [(n, s) for n in head for s in sources if n in s.shapes and s.shapes[n] != base.shapes[n]]
    if not differ:
        return [], None
    name, store = differ[0]
    cls = (getattr(adapter, "merged_class", None) or adapter.model_class).__name__
    note = (f"The {cls} head ({', '.join(head[:4])}{', ...' if len(head) > 4 else ''}) is the base's, not merged: "
            f"the fine-tunes' heads have other shapes than the base's ({name!r}: {list(store.shapes[name])} in "
            f"{store.ref.name!r}, {list(base.shapes[name])} in the base), e.g. another number of labels.")
    return head, note


# ---------------------------------------------------------------------------------------------- vision-language
def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether ``config`` is a vision-language model (``AutoModelForImageTextToText``: LLaVA, Qwen2-VL, Gemma 3...)."""
    from transformers.models.auto import modeling_auto

    return getattr(config, "model_type", None) in getattr(modeling_auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                                                          {})


def refuse_vision_language(config: PretrainedConfig, what: str, *, scored: bool = False) -> None:
    """Refuse a data-guided run (``what``: the method, selection or scoring) on a vision-language model it cannot
    score: a model of a type or with a tower the scored ones do not cover (:mod:`hf_mloss.adapters.vision_language`),
    and, on LLaVA and Qwen2-VL, the runs that do not walk the towers (``scored=False``: label-free selection, the
    learned merges, RegMean, ``method="auto"``).

    Raises:
        UnsupportedModelError: naming the model type, what is missing and what works instead.
    """
    from ..adapters.generic import DATA_FREE_METHODS
    from ..adapters.vision_language import unsupported_reason
    from ..errors import UnsupportedModelError

    if not is_vision_language(config):
        return
    reason = unsupported_reason(config)
    if reason is None and scored:
        return
    data_free = (f"The data-free methods merge the whole model: {', '.join(DATA_FREE_METHODS)} (e.g. "
                 "hf_mloss.merge(base, models, 'ties', k=0.2)).")
    if reason is None:
        raise UnsupportedModelError(
            f"{what} is not available for vision-language models (model_type={config.model_type!r}): the M-Loss "
            "merges (m_ties, m_dare), score() and compatibility() score them, the vision tower on data= images and "
            f"the language model on text_data= texts. {data_free}")
    raise UnsupportedModelError(
        f"{what} needs M-Loss scoring, which is not available yet for this vision-language model "
        f"(model_type={config.model_type!r}: {reason}). Scored: LLaVA and Qwen2-VL with a CLIP, SigLIP or Qwen2-VL "
        f"vision tower and a scored language model. {data_free}")


def whole_model_towers(adapter: ModelAdapter) -> list[Any]:
    """:func:`~hf_mloss.adapters.generic.other_towers` of ``adapter``, less the towers its merged class does not
    hold (a ``CLIPForImageClassification`` has no text tower, though a ``"clip"`` config does)."""
    from ..adapters.generic import other_towers

    views = other_towers(adapter)
    if getattr(adapter, "kept_class", None) is None:
        return views
    config = adapter.full_config
    keys = _class_keys(adapter.kept_class, config.to_json_string(use_diff=False))
    return [view for view in views if any(k.startswith(view.tower_prefix) for k in keys)]
