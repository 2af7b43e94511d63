"""The method registry: ``register_merge_method``, ``get_method``, ``list_methods`` (no method imported here)."""

from __future__ import annotations

from collections.abc import Iterable

from .._validation import did_you_mean
from ..errors import UnknownMethodError
from .base import MergeMethod

MERGE_METHODS: dict[str, MergeMethod] = {}
METHOD_ALIASES: dict[str, str] = {}
"""Other names a method answers to (``dare`` → ``dare_ties``); they are not listed."""


def register_merge_method(method: MergeMethod, *, aliases: Iterable[str] = ()) -> MergeMethod:
    """Register a method instance under ``method.name`` (lowercase, unique), plus optional alias names.

    Example:
        ```python
        >>> from hf_mloss.methods import MergeMethod, register_merge_method
        >>> from hf_mloss.methods.linear import AverageParams
        >>> class Mine(MergeMethod):
        ...     name, pretty_name, reference, reference_url = "mine", "Mine", "", ""
        ...     params_class = AverageParams
        ...     def merge_tensor(self, name, base, sources, ctx):
        ...         return sum(sources) / len(sources)
        >>> register_merge_method(Mine())
        ```
    """
    name = method.name
    for key in (name, *aliases):
        if not isinstance(key, str) or not key or key != key.lower() or key.endswith("_"):
            raise ValueError(f"Merge method names must be lowercase without a trailing '_', got {key!r}.")
        if key in MERGE_METHODS or key in METHOD_ALIASES:
            raise KeyError(f"A merge method named {key!r} is already registered; please choose a unique name.")
    MERGE_METHODS[name] = method
    METHOD_ALIASES.update({alias: name for alias in aliases})
    return method


def get_method(name: str) -> MergeMethod:
    """The registered method called ``name`` (or one of its aliases)."""
    if isinstance(name, str) and name in METHOD_ALIASES:
        name = METHOD_ALIASES[name]
    try:
        return MERGE_METHODS[name]
    except (KeyError, TypeError):
        hint = did_you_mean(name, [*MERGE_METHODS, *METHOD_ALIASES])
        raise UnknownMethodError(f"Unknown merge method {name!r}{hint}; available methods: {list_methods()}.") from None


def list_methods() -> list[str]:
    """Names of all registered merge methods."""
    return sorted(MERGE_METHODS)

