"""Adapter for CLIP text towers (``CLIPTextModel``), also the ``text_model`` of full ``CLIPModel`` repos."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn
from transformers import CLIPModel, CLIPTextConfig, CLIPTextModel, PretrainedConfig, PreTrainedModel

from .base import BlockContext, ModelAdapter, ScoredUnit

_TEXT_PREFIX = "text_model."
_TOWER_ROOTS = ("embeddings.", "encoder.", "final_layer_norm.")


class CLIPTextAdapter(ModelAdapter):
    """CLIP text transformer: node M-Loss on every ``encoder.layers.N.mlp.fc1`` (input of ``quick_gelu``).

    Its blocks attend causally: the context carries the causal + padding mask ``CLIPTextModel.forward`` builds (with
    transformers' ``create_causal_mask``) and ``is_causal=True`` for the attention kernels. Positions are the
    model's own (``0..T-1``; CLIP pads on the right). Padding positions never count.

    Matched by ``model_type="clip_text_model"``; a full ``"clip"`` config is matched by the vision adapter, and this
    one is built from it explicitly (``CLIPTextAdapter(clip_config)``) to score the text tower. Accepts
    ``text_model.``-prefixed keys (full CLIPModel repos, v4 files) and unprefixed ones; a tower is saved prefixed.
    """

    name = "clip_text"
    key_bias = "self_attn.k_proj.bias"
    model_types = ("clip_text_model",)
    model_class = CLIPTextModel
    layer_pattern = re.compile(r"encoder\.layers\.(\d+)\.")
    unit: ClassVar[ScoredUnit] = ScoredUnit(gate="mlp.fc1", down="mlp.fc2")
    target_suffix = unit.gate
    pipeline_tag = "feature-extraction"
    containers: ClassVar[dict] = {"clip": (CLIPModel, "text_model", "zero-shot-image-classification")}
    checkpoint_prefix = _TEXT_PREFIX
    modality: ClassVar[str] = "text"
    input_names: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask")

    @classmethod
    def model_config(cls, config: PretrainedConfig) -> CLIPTextConfig:
        return config.text_config if config.model_type == "clip" else config

    def canonical_key(self, key: str) -> str | None:
        key = key.removeprefix(_TEXT_PREFIX)
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

    def load_processor(self, path: str, *, token: str | bool | None = None, full: bool = False):
        """The tokenizer of the model (the whole processor for whole-model outputs)."""
        from transformers import AutoProcessor, AutoTokenizer

        loader = AutoProcessor if full else AutoTokenizer
        return loader.from_pretrained(path, trust_remote_code=False, token=token)

    def embed(self, model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, BlockContext]:
        from transformers.masking_utils import create_causal_mask

        input_ids = batch["input_ids"]
        attention_mask = batch.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = model.embeddings(input_ids=input_ids)
        mask4d = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                    cache=None)
        return hidden, BlockContext(mask=attention_mask.bool(), extras={"attention_mask": mask4d})

    def forward_to_target(self, layer: nn.Module, hidden: torch.Tensor,
                          context: BlockContext) -> tuple[torch.Tensor, torch.Tensor]:
        attn, _ = layer.self_attn(hidden_states=layer.layer_norm1(hidden),
                                  attention_mask=context.extras.get("attention_mask"), is_causal=True)
        residual = hidden + attn
        return residual, layer.layer_norm2(residual)

    def forward_from_target(self, layer: nn.Module, residual: torch.Tensor, target_input: torch.Tensor,
                            context: BlockContext) -> torch.Tensor:
        return residual + layer.mlp(target_input)
