"""The adapter registry: ``register_adapter``, ``list_adapters``, ``adapter_for`` (no family imported here)."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..errors import UnsupportedModelError
from .base import ModelAdapter

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
    ordered = sorted(ADAPTERS.values(), key=lambda cls: cls.fallback)  # fallbacks (the generic one) last
    for adapter_cls in ordered:
        if adapter_cls.matches(config):
            return adapter_cls(config)
    model_type = getattr(config, "model_type", None)
    supported = sorted(t for cls in ADAPTERS.values() for t in cls.model_types)
    raise UnsupportedModelError(
        f"No hf_mloss adapter for model_type={model_type!r}; available adapters: {list_adapters()} "
        f"(model types {supported}). Register one with hf_mloss.adapters.register_adapter(...)."
    )

