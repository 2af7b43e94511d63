"""Vision-language models (LLaVA, Qwen2-VL) merged whole, each tower scored on its own data.

A vision-language model is a vision tower, a projector and a language model in one checkpoint. Everything data-free
(names read through transformers' own conversion, the base's class and layout written back) is the generic
adapter's. For the data-guided methods the model is a whole two-tower model, as a whole ``CLIPModel`` is: the vision
tower is walked by its family's adapter on ``data=`` images (CLIP or SigLIP vision for LLaVA, :mod:`.qwen2_vl_vision`
for Qwen2-VL), the language model by its text family's adapter (the LLaMA family, or :mod:`.hooked` for any
decoder of a common MLP shape) on ``text_data=`` texts, both seen inside the whole model
(:class:`~.generic.TowerViewMixin`: names as the whole model spells them). A tower given no data, the projector and
``lm_head`` take the method's data-free rule.

The language model is scored on text alone (no image tokens): its own forward with the pad-aware positions of a
text-only sequence, which for Qwen2-VL's M-RoPE are the same position on all three axes.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, ClassVar

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..errors import UnsupportedModelError
from .base import ModelAdapter
from .clip_vision import CLIPVisionAdapter
from .generic import GenericAdapter, pipeline_tag_for, resolve_model_class, tower_view
from .qwen2_vl_vision import Qwen2VLVisionAdapter
from .siglip_vision import SiglipVisionAdapter

TOWERS: dict[str, tuple[str, str]] = {
    "llava": ("model.vision_tower", "model.language_model"),
    "qwen2_vl": ("model.visual", "model.language_model"),
}
"""``model_type -> (vision tower, language model)``: the scored towers' module paths in the loaded model."""
VISION_ADAPTERS: tuple[type[ModelAdapter], ...] = (CLIPVisionAdapter, SiglipVisionAdapter, Qwen2VLVisionAdapter)
"""The vision towers scored, found by the tower's class (each adapter's ``model_class``)."""


@functools.lru_cache(maxsize=16)
def _tower_classes(model_class: type[PreTrainedModel], config_json: str, paths: tuple[str, str]
                   ) -> tuple[type, type] | None:
    """The classes of the modules at ``paths`` in ``model_class`` built on the meta device (``None``: missing)."""
    import json

    from .._logging import quiet_transformers

    config = model_class.config_class.from_dict(json.loads(config_json))
    with quiet_transformers(True), torch.device("meta"):
        model = model_class(config)
    try:
        return tuple(type(model.get_submodule(path)) for path in paths)  # type: ignore[return-value]
    except AttributeError:
        return None


def tower_views(config: PretrainedConfig) -> tuple[ModelAdapter, ModelAdapter]:
    """The vision tower's and the language model's adapters seen inside the whole model of ``config``.

    Raises:
        UnsupportedModelError: naming what does not fit (a model type, a tower class without a scored adapter).
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in TOWERS:
        raise UnsupportedModelError(f"model_type={model_type!r} is not a scored vision-language model "
                                    f"(scored: {sorted(TOWERS)}).")
    paths = TOWERS[model_type]
    model_class = resolve_model_class(config)
    found = _tower_classes(model_class, config.to_json_string(use_diff=False), paths)
    if found is None:
        raise UnsupportedModelError(f"{model_class.__name__} holds no {paths[0]} and {paths[1]}.")
    vision_class, language_class = found
    vision = next((cls for cls in VISION_ADAPTERS if cls.model_class is vision_class), None)
    if vision is None:
        raise UnsupportedModelError(f"its vision tower is a {vision_class.__name__}, which has no scored adapter "
                                    f"(scored: {[cls.__name__ for cls in VISION_ADAPTERS]}).")
    text_config = copy.deepcopy(config.get_text_config())
    text_config.architectures = [language_class.__name__]  # the bare decoder the whole model holds
    from .registry import adapter_for

    language = type(adapter_for(text_config))
    if not getattr(language, "scorable", True):
        raise UnsupportedModelError(f"its language model is a {language_class.__name__}, which has no scored adapter.")
    return tower_view(vision, paths[0], config.vision_config), tower_view(language, paths[1], text_config)


def unsupported_reason(config: PretrainedConfig) -> str | None:
    """Why the data-guided methods cannot score ``config``'s vision-language model, or ``None`` when they can."""
    try:
        tower_views(config)
    except UnsupportedModelError as err:
        return str(err)
    except (KeyError, TypeError, ValueError, AttributeError) as err:  # a config transformers cannot build
        return f"{type(err).__name__}: {err}"
    return None


class VisionLanguageAdapter(GenericAdapter):
    """A LLaVA or Qwen2-VL model: the generic adapter's whole-model merge, scored tower by tower (see the module
    docstring). ``data=`` images score :attr:`vision`, ``text_data=`` texts score :attr:`language`."""

    name = "vision_language"
    model_types = tuple(TOWERS)
    fallback = False
    scorable: ClassVar[bool] = True
    whole_model: ClassVar[bool] = True
    modality: ClassVar[str] = "image"
    """``data=`` holds images (the vision tower's); the language model's texts are ``text_data=``."""
    input_names: ClassVar[tuple[str, ...]] = ("pixel_values",)
    vocabulary_merges: ClassVar[bool] = True
    """``tokenizer_source`` merges the language model's vocabulary (data-free merges), as for a text model."""
    report_prefix: ClassVar[str] = ""
    """The towers' names are the whole model's already (``model.visual.blocks.0.mlp.fc1``)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.name = config.model_type  # models of two families never merge together
        self.vision, self.language = tower_views(config)
        self.containers = {config.model_type: (self.model_class, self.vision.tower_attribute,
                                               pipeline_tag_for(self.model_class))}

    @classmethod
    def matches(cls, config: PretrainedConfig) -> bool:
        return getattr(config, "model_type", None) in TOWERS and unsupported_reason(config) is None

    @property
    def tower_view(self) -> ModelAdapter:
        """The adapter that walks the tower ``data=`` scores (the vision tower), named as in the whole model."""
        return self.vision

    def other_tower_views(self) -> list[ModelAdapter]:
        """The towers ``text_data=`` scores: the language model."""
        return [self.language]

    def is_outside_tower(self, name: str) -> bool:
        """Whether a name lies outside the vision tower (the language model, the projector, ``lm_head``)."""
        return not self.vision.owns(name)

    @property
    def head_label(self) -> str:
        """How cards name the tensors outside both towers (``model.multi_modal_projector, lm_head``)."""
        outside = {name.split(".")[0] if not name.startswith("model.") else ".".join(name.split(".")[:2])
                   for name in self.expected_shapes()
                   if not self.vision.owns(name) and not self.language.owns(name)}
        return ", ".join(sorted(outside))

    def check_text_tokens(self, input_ids: torch.Tensor) -> None:
        """Refuse scoring texts holding the model's image or video tokens: the language model is scored on text
        alone, and those positions would read the tokens' own embeddings where the model puts image features.

        Raises:
            DataError: naming the token id and where it comes from.
        """
        from ..errors import DataError

        keys = ("image_token_id", "image_token_index", "video_token_id", "vision_start_token_id",
                "vision_end_token_id")
        ids = {key: value for key in keys if isinstance(value := getattr(self.full_config, key, None), int)}
        found = [key for key, value in ids.items() if bool((input_ids == value).any())]
        if found:
            raise DataError(f"The text_data holds the model's {found[0]} ({ids[found[0]]}): the language model is "
                            "scored on text alone, without images. Remove the image placeholders (e.g. <image>) "
                            "from the texts.")

    def load_processor(self, path: str, *, token: str | bool | None = None, full: bool = False) -> Any:
        """The base's processor (``AutoProcessor``: tokenizer and image processor), saved beside the merge; where it
        cannot be built here (Qwen2-VL's asks torchvision for its video processor), its tokenizer and image
        processor, each saved as the base holds it."""
        from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

        try:
            return AutoProcessor.from_pretrained(path, trust_remote_code=False, token=token)
        except (OSError, ValueError, TypeError, KeyError, ImportError):
            pass
        parts = []
        for loader, kwargs in ((AutoTokenizer, {}), (AutoImageProcessor, {"backend": "pil"})):
            try:
                parts.append(loader.from_pretrained(path, trust_remote_code=False, token=token, **kwargs))
            except (OSError, ValueError, TypeError, KeyError, ImportError):
                continue
        if not parts:
            raise OSError(f"no tokenizer or image processor in {path!r}")
        return _Parts(parts)

    def load_image_processor(self, path: str, *, token: str | bool | None = None) -> Any:
        """The processor scoring images go through: the vision tower family's (the base's image processor)."""
        return self.vision.load_processor(path, token=token)

    def image_processor_of(self, processor: Any) -> Any:
        """A processor passed in (``processor=``) as scoring images use it: its image processor, read as the vision
        tower's family reads images (Qwen2-VL: one square size)."""
        inner = getattr(processor, "image_processor", None) or processor
        wrap = getattr(self.vision, "wrap_image_processor", None)
        return wrap(inner) if wrap is not None else inner


class _Parts:
    """A processor's parts (tokenizer, image processor) saved side by side, as ``AutoProcessor`` would save them."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def save_pretrained(self, folder: Any) -> None:
        for part in self.parts:
            part.save_pretrained(folder)
