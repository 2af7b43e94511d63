"""Mixtures of experts built from dense fine-tunes (``hf-mloss moe``, :func:`build_moe`), as ``mergekit-moe`` builds
them: mergekit-moe's YAML in, a Hub-ready Mixtral, Qwen2-MoE or Qwen3-MoE folder out, with a routing report.

``config`` (the YAML and its checks), ``architectures`` (which MoE class, its config and tensor names), ``gates``
(router rows from prompts), ``inputs`` (the models opened and checked), ``writer`` (streamed safetensors shards),
``routing`` (where the built MoE sends each expert's prompts), ``result`` (what a build returns), ``card`` and ``build`` (the whole run). Names are
imported on first use, so reading a config (``hf-mloss moe`` does it first) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"ExpertSpec": "config", "MoEConfig": "config", "MoEResult": "result", "RoutingReport": "routing",
            "build_moe": "build"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_mloss.moe' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


if TYPE_CHECKING:
    from .build import build_moe
    from .config import ExpertSpec, MoEConfig
    from .result import MoEResult
    from .routing import RoutingReport
