"""Adapter for plain ViT encoders (``ViTModel``), also read out of ``ViTFor*`` repos (``vit.`` keys).

transformers v5 builds ``ViTLayer`` as ``layernorm_before → attention (q/k/v/o_proj) → +residual →
layernorm_after → mlp (fc1 → act → fc2) → +residual`` under ``layers.N.``, but ``save_pretrained`` still writes the
v4 spelling (``encoder.layer.N.attention.attention.query``, ``intermediate.dense``, ``output.dense``...). Canonical
names here are the in-memory (v5 module) names, so the scorer's ``block.get_submodule(target_suffix)`` and the
worker's ``state_dict`` agree with the stores; :meth:`ViTAdapter.canonical_key` maps both spellings onto them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn
from transformers import PreTrainedModel, ViTModel

from .base import BlockContext, ModelAdapter, ScoredUnit

_MODEL_PREFIX = "vit."
_ROOTS = ("embeddings.", "layers.", "layernorm.", "pooler.")
# v4 / on-disk spelling of a block's tensors -> v5 module names (block-relative, after "encoder.layer.N.")
_LEGACY_BLOCK = (
    ("attention.attention.query.", "attention.q_proj."),
    ("attention.attention.key.", "attention.k_proj."),
    ("attention.attention.value.", "attention.v_proj."),
    ("attention.output.dense.", "attention.o_proj."),
    ("intermediate.dense.", "mlp.fc1."),
    ("output.dense.", "mlp.fc2."),
    ("layernorm_before.", "layernorm_before."),
    ("layernorm_after.", "layernorm_after."),
)
_LEGACY_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.*)")


def legacy_block_key(rest: str) -> str | None:
    """v5 block-relative name of a v4 block-relative key (``intermediate.dense.weight`` → ``mlp.fc1.weight``)."""
    for old, new in _LEGACY_BLOCK:
        if rest.startswith(old):
            return new + rest[len(old) :]
    return None


class ViTAdapter(ModelAdapter):
    """ViT encoder: node M-Loss on every ``layers.N.mlp.fc1`` (v4 files: ``encoder.layer.N.intermediate.dense``).

    The activation is ``config.hidden_act`` (``gelu`` for the Google checkpoints), applied inside ``ViTMLP``.
    Embeddings stage: ``embeddings.*``; tail: ``layernorm.*`` and ``pooler.*``. Classifier heads and decoders of
    ``ViTFor*`` repos (and the mask token of ``ViTForMaskedImageModeling``) are not part of the merged model.
    """

    name = "vit"
    key_bias = "attention.k_proj.bias"
    model_types = ("vit",)
    model_class = ViTModel
    fixed_image_size = True
    layer_pattern = re.compile(r"layers\.(\d+)\.")
    unit = ScoredUnit(gate="mlp.fc1")

    def canonical_key(self, key: str) -> str | None:
        if key.startswith(_MODEL_PREFIX):
            key = key[len(_MODEL_PREFIX) :]
        legacy = _LEGACY_LAYER.match(key)
        if legacy:
            rest = legacy_block_key(legacy.group(2))
            return None if rest is None else f"layers.{legacy.group(1)}.{rest}"
        if key == "embeddings.mask_token":  # only ViTForMaskedImageModeling has one; ViTModel is built without it
            return None
        return key if key.startswith(_ROOTS) else None

    def is_embedding(self, name: str) -> bool:
        return name.startswith("embeddings.")

    def layer_prefix(self, layer: int) -> str:
        return f"layers.{layer}."

    def layers(self, model: PreTrainedModel) -> list[nn.Module]:
        return list(model.layers)

    def embed(self, model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, BlockContext]:
        pixel_values = batch["pixel_values"]
        # as ViTModel.forward: cast to the weights' dtype, no position interpolation (the size must match the config)
        pixel_values = pixel_values.to(model.embeddings.patch_embeddings.projection.weight.dtype)
        return model.embeddings(pixel_values), BlockContext()

    def forward_to_target(self, layer: nn.Module, hidden: torch.Tensor, context: BlockContext | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, _ = layer.attention(layer.layernorm_before(hidden), None)
        residual = layer.dropout(attn) + hidden
        return residual, layer.layernorm_after(residual)

    def forward_from_target(self, layer: nn.Module, residual: torch.Tensor, target_input: torch.Tensor,
                            context: BlockContext | None = None) -> torch.Tensor:
        return layer.dropout(layer.mlp(target_input)) + residual
