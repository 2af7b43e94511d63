"""Registry of merge methods. Adding one is one file plus one ``register_merge_method`` call."""

from __future__ import annotations

from ..errors import UnknownMethodError
from .base import MergeContext, MergeMethod, MethodParams

MERGE_METHODS: dict[str, MergeMethod] = {}


def register_merge_method(method: MergeMethod) -> MergeMethod:
    """Register a method instance under ``method.name`` (lowercase, unique)."""
    name = method.name
    if not name or name != name.lower() or name.endswith("_"):
        raise ValueError(f"Merge method names must be lowercase without a trailing '_', got {name!r}.")
    if name in MERGE_METHODS:
        raise KeyError(f"A merge method named {name!r} is already registered; please choose a unique name.")
    MERGE_METHODS[name] = method
    return method


def get_method(name: str) -> MergeMethod:
    try:
        return MERGE_METHODS[name]
    except (KeyError, TypeError):
        raise UnknownMethodError(
            f"Unknown merge method {name!r}; available methods: {list_methods()}."
        ) from None


def list_methods() -> list[str]:
    """Names of all registered merge methods."""
    return sorted(MERGE_METHODS)


from . import dare, linear, mties, ties  # noqa: E402  (register the built-in methods)

__all__ = ["MERGE_METHODS", "MergeContext", "MergeMethod", "MethodParams", "get_method", "list_methods",
           "register_merge_method"]
