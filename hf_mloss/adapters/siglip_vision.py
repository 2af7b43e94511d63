"""Adapter for SigLIP vision towers (``SiglipVisionModel``), also read out of full ``SiglipModel`` repos."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, SiglipModel, SiglipVisionConfig, SiglipVisionModel

from .base import BlockContext, ModelAdapter, ScoredUnit

_VISION_PREFIX = "vision_model."
_TOWER_ROOTS = ("embeddings.", "encoder.", "post_layernorm.", "head.")


class SiglipVisionAdapter(ModelAdapter):
    """SigLIP ViT vision tower: node M-Loss on every ``encoder.layers.N.mlp.fc1`` (input of ``gelu_pytorch_tanh``).

    The blocks are scored. The tail, ``post_layernorm`` and the attention-pooling ``head`` (probe, multi-head
    attention, its own MLP), is the last stage: merged by the method's data-free rule, never scored (its MLP reads
    one pooled token per image, not the blocks' positions). Accepts ``vision_model.``-prefixed keys (full SiglipModel
    repos, transformers v4 files) and unprefixed ones; a tower is saved with the prefix, the layout every
    transformers version loads. A full SiglipModel base gives a full SiglipModel merge (text tower from the base).
    """

    name = "siglip_vision"
    key_bias = "self_attn.k_proj.bias"
    model_types = ("siglip_vision_model", "siglip")
    model_class = SiglipVisionModel
    fixed_image_size = True
    layer_pattern = re.compile(r"encoder\.layers\.(\d+)\.")
    unit: ClassVar[ScoredUnit] = ScoredUnit(gate="mlp.fc1", down="mlp.fc2")
    target_suffix = unit.gate
    containers: ClassVar[dict] = {"siglip": (SiglipModel, "vision_model", "zero-shot-image-classification")}
    checkpoint_prefix = _VISION_PREFIX
    modality: ClassVar[str] = "image"
    input_names: ClassVar[tuple[str, ...]] = ("pixel_values",)

    @classmethod
    def model_config(cls, config: PretrainedConfig) -> SiglipVisionConfig:
        return config.vision_config if config.model_type == "siglip" else config

    def canonical_key(self, key: str) -> str | None:
        key = key.removeprefix(_VISION_PREFIX)
        return key if key.startswith(_TOWER_ROOTS) else None

    def is_embedding(self, name: str) -> bool:
        return name.startswith("embeddings.")

    def layer_prefix(self, layer: int) -> str:
        return f"encoder.layers.{layer}."

    def node_groups(self, layer: int) -> list[tuple[str, int]]:
        """Row i of ``mlp.fc1`` (weight and bias) belongs to node i."""
        gate = f"{self.layer_prefix(layer)}{self.unit.gate}"
        return [(f"{gate}.weight", 0), (f"{gate}.bias", 0)]

    def layers(self, model: PreTrainedModel) -> list[nn.Module]:
        return list(model.encoder.layers)

    def activation(self, model: PreTrainedModel | None = None):
        if model is not None:
            return self.layers(model)[0].mlp.activation_fn
        return super().activation(model)

    def embed(self, model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, BlockContext]:
        """Patch + position embeddings (no interpolation: the image size must match the config); every token counts."""
        return model.embeddings(batch["pixel_values"]), BlockContext()

    def forward_to_target(self, layer: nn.Module, hidden: torch.Tensor,
                          context: BlockContext) -> tuple[torch.Tensor, torch.Tensor]:
        attn, _ = layer.self_attn(hidden_states=layer.layer_norm1(hidden), attention_mask=None)
        residual = hidden + attn
        return residual, layer.layer_norm2(residual)

    def forward_from_target(self, layer: nn.Module, residual: torch.Tensor, target_input: torch.Tensor,
                            context: BlockContext) -> torch.Tensor:
        return residual + layer.mlp(target_input)
