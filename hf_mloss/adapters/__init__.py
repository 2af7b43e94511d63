"""Registry of model adapters. Adding a family is one file plus one ``register_adapter`` line below."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..errors import UnsupportedModelError
from .base import EMBEDDING_STAGE, ModelAdapter
from .bert import BertAdapter
from .clip_text import CLIPTextAdapter
from .clip_vision import CLIPVisionAdapter
from .dinov2 import Dinov2Adapter
from .generic import GenericAdapter, whole_model_adapter
from .llama import LlamaAdapter
from .siglip_vision import SiglipVisionAdapter
from .vit import ViTAdapter

ADAPTERS: dict[str, type[ModelAdapter]] = {}


def register_adapter(adapter_cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Register an adapter class under its ``name`` (lowercase, unique). Usable as a decorator.

    Args:
        adapter_cls: a :class:`ModelAdapter` subclass (``name``, ``model_types``, ``model_class``...).

    Example:
        ```python
        >>> @register_adapter
        ... class SiglipVisionAdapter(ModelAdapter):
        ...     name, model_types, model_class = "siglip_vision", ("siglip_vision_model",), SiglipVisionModel
        ...     ...
        ```
    """
    name = getattr(adapter_cls, "name", "")
    if not name or name != name.lower():
        raise ValueError(f"Adapter name must be a non-empty lowercase string, got {name!r}.")
    if name in ADAPTERS and ADAPTERS[name] is not adapter_cls:
        raise KeyError(f"An adapter named {name!r} is already registered; please choose a unique name.")
    ADAPTERS[name] = adapter_cls
    return adapter_cls


def list_adapters() -> list[str]:
    """Names of the registered adapters (model families hf_mloss can merge)."""
    return sorted(ADAPTERS)


def adapter_for(config: PretrainedConfig) -> ModelAdapter:
    """The adapter instance for a model config, chosen by ``config.model_type``: a family adapter (scored), else
    the generic one (any model transformers builds without remote code; data-free methods only)."""
    families = [cls for cls in ADAPTERS.values() if cls is not GenericAdapter]
    for adapter_cls in [*families, GenericAdapter]:  # the generic adapter last, whatever registers after it
        if adapter_cls.matches(config):
            return adapter_cls(config)
    model_type = getattr(config, "model_type", None)
    supported = sorted(t for cls in ADAPTERS.values() for t in cls.model_types)
    raise UnsupportedModelError(
        f"No hf_mloss adapter for model_type={model_type!r}; available adapters: {list_adapters()} "
        f"(model types {supported}). Register one with hf_mloss.adapters.register_adapter(...)."
    )


register_adapter(CLIPVisionAdapter)
register_adapter(ViTAdapter)
register_adapter(Dinov2Adapter)
register_adapter(SiglipVisionAdapter)
register_adapter(BertAdapter)
register_adapter(LlamaAdapter)
register_adapter(CLIPTextAdapter)
register_adapter(GenericAdapter)  # matches any transformers model_type: tried last

__all__ = ["ADAPTERS", "EMBEDDING_STAGE", "CLIPVisionAdapter", "Dinov2Adapter", "GenericAdapter", "ModelAdapter",
           "ViTAdapter", "adapter_for", "list_adapters", "register_adapter", "whole_model_adapter"]
