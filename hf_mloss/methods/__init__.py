"""Registry of merge methods. Adding one is one file plus one ``register_merge_method`` call."""

from __future__ import annotations

from .base import LayerHooks, LayerwiseRun, MergeContext, MergeMethod, MethodParams
from .registry import MERGE_METHODS, METHOD_ALIASES, get_method, list_methods, register_merge_method

from . import adamerging, adarank, auto, arcee_fusion, breadcrumbs, cart, dare, della, iso, karcher, linear, model_stock, mties, multislerp, nearswap, nuslerp, passthrough, ram, regmean, sce, slerp, ties, tsv, wudi  # noqa: E402,F401,I001  (registers them)

__all__ = ["MERGE_METHODS", "METHOD_ALIASES", "LayerHooks", "LayerwiseRun", "MergeContext", "MergeMethod", "MethodParams", "get_method",
           "list_methods", "register_merge_method"]
