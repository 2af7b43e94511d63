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
    half merged, or when the fine-tunes hold the encoder only (a ``BertModel`` fine-tune of a
    ``BertForSequenceClassification`` base); ``([], None)`` otherwise.

    Raises:
        IncompatibleCheckpointsError: some fine-tunes hold the encoder only and others a head of their own that
            differs from the base's, which taking the base's head would drop.
    """
    if not is_classifier(adapter):
        return [], None
    head = [n for n, dtype in base.dtypes.items() if dtype is not None and dtype.is_floating_point
            and in_head(adapter, n)]
    cls = (getattr(adapter, "merged_class", None) or adapter.model_class).__name__
    named = f"The {cls} head ({', '.join(head[:4])}{', ...' if len(head) > 4 else ''})"
    headless = [s for s in sources if head and not any(n in s.shapes for n in head)]
    if headless:
        headed = [s for s in sources if s not in headless]
        for store in headed:
            changed = [n for n in head if n in store.shapes and (store.shapes[n] != base.shapes[n] or
                                                                 not torch.equal(store.get(n), base.get(n)))]
            if changed:
                from ..errors import IncompatibleCheckpointsError

                raise IncompatibleCheckpointsError(
                    f"{store.ref.name!r} has its own {cls} head ({changed[:2]} differ from the base's), but "
                    f"{[s.ref.name for s in headless][:3]} hold the encoder only, so the merge would take the base's "
                    "head and drop that one. Give every fine-tune with its head, or every one as the encoder only.")
        return head, (f"{named} is the base's: {[s.ref.name for s in headless][:3]} hold the encoder only (no "
                      "head), so the merge is written as the base's class with the base's head.")
    differ = [(n, s) for n in head for s in sources if n in s.shapes and s.shapes[n] != base.shapes[n]]
    if not differ:
        return [], None
    name, store = differ[0]
    note = (f"{named} is the base's, not merged: "
            f"the fine-tunes' heads have other shapes than the base's ({name!r}: {list(store.shapes[name])} in "
            f"{store.ref.name!r}, {list(base.shapes[name])} in the base), e.g. another number of labels.")
    return head, note


def check_heads_kept(adapter: ModelAdapter, resolved: Sequence[Any]) -> None:
    """Refuse fine-tunes of a class that holds the base's class and a head (``ViTForImageClassification`` fine-tunes
    of a ``ViTModel`` base; ``BertForSequenceClassification`` of a ``BertModel``) in a merge written as the base's
    class: it has no place for their heads, which would be dropped without a word (and a head's task vector needs
    the base's head). The structure is transformers' own: the fine-tune's class is a task class (not its family's
    ``AutoModel`` class) that holds exactly one child of the base's class.

    Raises:
        IncompatibleCheckpointsError: naming the fine-tune, its head and the two ways on.
    """
    from ..adapters.generic import resolve_model_class
    from ..errors import IncompatibleCheckpointsError, UnsupportedModelError

    try:
        base_cls = resolve_model_class(resolved[0][2])
    except UnsupportedModelError:
        return
    for ref, loaded, config in resolved[1:]:
        try:
            cls = type(loaded) if loaded is not None else resolve_model_class(config)
        except UnsupportedModelError:
            continue
        if cls is base_cls or _is_base_model_class(cls, config):  # a CLIPModel around a CLIPVisionModel: no head
            continue
        config_json = config.to_json_string(use_diff=False)
        attribute = _tower_attribute(cls, base_cls, config_json)
        if attribute is None:
            continue
        head = [k for k in _class_keys(cls, config_json) if not k.startswith(f"{attribute}.")]
        if not head:
            continue
        if not _has_tower_output(adapter):
            encoders = (f"merge their encoders alone: save each fine-tune's {attribute!r} module on its own "
                        f"(model.{attribute}.save_pretrained(folder)) and merge those folders")
        else:
            encoders = "merge the encoders alone: pass output='tower' (the heads are then left out, as asked)"
        raise IncompatibleCheckpointsError(
            f"{ref.name!r} is a {cls.__name__}: a {base_cls.__name__} with a head ({', '.join(head[:3])}), but the "
            f"base {resolved[0][0].name!r} is a {base_cls.__name__} without one. The merge is written as the "
            f"base's class, which would drop the fine-tunes' heads (and a head's task vector needs the base's "
            f"head). To merge the heads, merge onto a {cls.__name__} base holding the head the fine-tunes were "
            f"trained from (saved with save_pretrained); to {encoders}.")


def _is_base_model_class(cls: type, config: PretrainedConfig) -> bool:
    """Whether ``cls`` is its family's base model (``AutoModel``'s class: ``CLIPModel``, ``BertModel``), not a class
    with a task head."""
    from transformers import AutoModel

    try:
        return AutoModel._model_mapping[type(config)] is cls
    except (KeyError, ValueError):
        return False


def _has_tower_output(adapter: ModelAdapter) -> bool:
    """Whether ``output="tower"`` writes the family's encoder alone (towers families: ViT, CLIP...)."""
    from ..errors import HfMLossError

    try:
        adapter.output_class("tower")
    except HfMLossError:
        return False
    return True


def merged_labels(adapter: ModelAdapter, resolved: Sequence[Any], heads_from_base: Sequence[str]
                  ) -> tuple[dict[int, str] | None, str | None]:
    """The class names (``id2label``) of a merged classification head, and the card's line on them.

    When every fine-tune holds a head of the base's class that is merged (not the base's), the merged head is
    theirs: fine-tunes that all name their classes alike give the merged config their ``id2label`` (returned,
    with a line when it differs from the base's); fine-tunes that name them differently are merged class by
    class as given, and the line says so (a mix of tasks). ``(None, None)``: nothing to change or say.
    """
    if heads_from_base or not is_classifier(adapter):
        return None, None
    from ..adapters.generic import resolve_model_class
    from ..errors import UnsupportedModelError

    merged_cls = getattr(adapter, "merged_class", None) or adapter.model_class
    try:
        if any((type(loaded) if loaded is not None else resolve_model_class(config)) is not merged_cls
               for _, loaded, config in resolved[1:]):
            return None, None  # some fine-tune holds no head of this class: the head is not theirs alone
    except UnsupportedModelError:
        return None, None
    base = _labels(resolved[0][2])
    tuned = [(ref.name, _labels(config)) for ref, _, config in resolved[1:]]
    if all(labels == tuned[0][1] for _, labels in tuned):
        if tuned[0][1] == base or tuned[0][1] is None:
            return None, None
        return tuned[0][1], (f"The fine-tunes name their classes {_shown(tuned[0][1])} (id2label), the base "
                             f"{_shown(base)}: the merged head is theirs, and so is the merged config's id2label.")
    listing = "; ".join(f"{name!r}: {_shown(labels)}" for name, labels in tuned[:3])
    return None, (f"The fine-tunes name their classes differently (id2label of {listing}): their heads are merged "
                  f"class by class in index order, which mixes different classes if they are different tasks; the "
                  f"merged config keeps the base's id2label {_shown(base)}.")


def _labels(config: PretrainedConfig) -> dict[int, str] | None:
    labels = getattr(config, "id2label", None)
    if not isinstance(labels, dict):
        return None
    try:
        return {int(k): str(v) for k, v in labels.items()}
    except (TypeError, ValueError):
        return None


def _shown(labels: dict[int, str] | None) -> str:
    """``id2label`` in a card line: the first few classes."""
    if not labels:
        return "{}"
    items = sorted(labels.items())
    text = ", ".join(f"{k}: {v!r}" for k, v in items[:4])
    return "{" + text + (", ..." if len(items) > 4 else "") + "}"


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
    if reason is None or not scored:  # the run never walks the towers: no model type would change that
        scored_by = (" the M-Loss merges (m_ties, m_dare), score() and compatibility() score them, the vision tower "
                     "on data= images and the language model on text_data= texts." if reason is None else "")
        raise UnsupportedModelError(f"{what} is not available for vision-language models (model_type="
                                    f"{config.model_type!r}){':' + scored_by if scored_by else '.'} {data_free}")
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
