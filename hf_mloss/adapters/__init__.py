"""Registry of model adapters. Adding a family is one file plus one ``register_adapter`` line below."""

from __future__ import annotations

from .base import EMBEDDING_STAGE, BlockContext, ModelAdapter, ScoredUnit
from .bert import BertAdapter
from .clip_text import CLIPTextAdapter
from .clip_vision import CLIPVisionAdapter
from .dinov2 import Dinov2Adapter
from .experts import MoeAdapter
from .generic import GenericAdapter, whole_model_adapter
from .hooked import HookedAdapter
from .llama import LlamaAdapter
from .registry import ADAPTERS, adapter_for, list_adapters, register_adapter
from .siglip_vision import SiglipVisionAdapter
from .vision_language import VisionLanguageAdapter
from .vit import ViTAdapter

register_adapter(CLIPVisionAdapter)
register_adapter(ViTAdapter)
register_adapter(Dinov2Adapter)
register_adapter(SiglipVisionAdapter)
register_adapter(BertAdapter)
register_adapter(LlamaAdapter)
register_adapter(CLIPTextAdapter)
register_adapter(VisionLanguageAdapter)  # LLaVA, Qwen2-VL: the generic whole-model merge, scored tower by tower
register_adapter(MoeAdapter)  # Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: M-Loss per expert
register_adapter(HookedAdapter)  # any text model of a recognised MLP shape: after the dedicated families
register_adapter(GenericAdapter)  # matches any transformers model_type: tried last

__all__ = ["ADAPTERS", "EMBEDDING_STAGE", "BertAdapter", "BlockContext", "CLIPTextAdapter", "CLIPVisionAdapter",
           "Dinov2Adapter", "GenericAdapter", "HookedAdapter", "LlamaAdapter", "ModelAdapter", "MoeAdapter", "ScoredUnit",
           "SiglipVisionAdapter", "ViTAdapter", "VisionLanguageAdapter", "adapter_for", "list_adapters",
           "register_adapter", "whole_model_adapter"]
