"""Adapter for CLIP vision towers (``CLIPVisionModel``), also read out of full ``CLIPModel`` repos."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn
from transformers import CLIPModel, CLIPVisionConfig, CLIPVisionModel, PretrainedConfig, PreTrainedModel

from .base import BlockContext, ModelAdapter, ScoredUnit

_VISION_PREFIX = "vision_model."
_TOWER_ROOTS = ("embeddings.", "pre_layrnorm.", "encoder.", "post_layernorm.")


class CLIPVisionAdapter(ModelAdapter):
    """CLIP ViT vision tower: node M-Loss on every ``encoder.layers.N.mlp.fc1`` (input of ``quick_gelu``).

    Accepts ``vision_model.``-prefixed keys (transformers v4 files, full CLIPModel repos) and unprefixed ones (v5).
    A full CLIPModel base gives a full CLIPModel merge: merged vision tower; text tower, projections and logit scale
    from the base. A tower is saved with ``vision_model.``-prefixed keys, the layout every transformers version loads
    (unprefixed files, as transformers >= 5.6 writes them, load as random weights in 4.x and 5.0-5.5).
    """

    name = "clip_vision"
    key_bias = "self_attn.k_proj.bias"
    model_types = ("clip_vision_model", "clip")
    model_class = CLIPVisionModel
    fixed_image_size = True
    layer_pattern = re.compile(r"encoder\.layers\.(\d+)\.")
    unit = ScoredUnit(gate="mlp.fc1")
    containers = {"clip": (CLIPModel, "vision_model", "zero-shot-image-classification")}
    checkpoint_prefix = _VISION_PREFIX

    @classmethod
    def model_config(cls, config: PretrainedConfig) -> CLIPVisionConfig:
        return config.vision_config if config.model_type == "clip" else config

    def canonical_key(self, key: str) -> str | None:
        if key.startswith(_VISION_PREFIX):
            key = key[len(_VISION_PREFIX) :]
        return key if key.startswith(_TOWER_ROOTS) else None

    def is_embedding(self, name: str) -> bool:
        return name.startswith(("embeddings.", "pre_layrnorm."))

    def layer_prefix(self, layer: int) -> str:
        return f"encoder.layers.{layer}."

    def layers(self, model: PreTrainedModel) -> list[nn.Module]:
        return list(model.encoder.layers)

    def embed(self, model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, BlockContext]:
        pixel_values = batch["pixel_values"]
        return model.pre_layrnorm(model.embeddings(pixel_values)), BlockContext()

    def forward_to_target(self, layer: nn.Module, hidden: torch.Tensor, context: BlockContext | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, _ = layer.self_attn(hidden_states=layer.layer_norm1(hidden), attention_mask=None)
        residual = hidden + attn
        return residual, layer.layer_norm2(residual)

    def forward_from_target(self, layer: nn.Module, residual: torch.Tensor, target_input: torch.Tensor,
                            context: BlockContext | None = None) -> torch.Tensor:
        return residual + layer.mlp(target_input)
