"""Adapter for DINOv2 encoders (``Dinov2Model``), also read out of ``Dinov2ForImageClassification`` repos.

``Dinov2Layer`` (transformers v5): ``norm1 → attention (q/k/v/o_proj) → layer_scale1 → +residual → norm2 →
mlp (fc1 → act → fc2) → layer_scale2 → +residual`` under ``encoder.layer.N.``. ``save_pretrained`` still writes
the v4 attention spelling (``attention.attention.query``, ``attention.output.dense``); canonical names are the
in-memory module names and :meth:`Dinov2Adapter.canonical_key` maps both spellings onto them.

Only the GELU MLP variant is supported: the SwiGLU FFN (``use_swiglu_ffn=True``, DINOv2-giant) has a gated product,
not an element-wise activation of one linear, so the node M-Loss is not defined for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn
from transformers import Dinov2Model, PretrainedConfig, PreTrainedModel

from ..errors import UnsupportedModelError
from .base import BlockContext, ModelAdapter, ScoredUnit

_MODEL_PREFIX = "dinov2."
_ROOTS = ("embeddings.", "encoder.layer.", "layernorm.")
_LEGACY_ATTENTION = (
    (".attention.attention.query.", ".attention.q_proj."),
    (".attention.attention.key.", ".attention.k_proj."),
    (".attention.attention.value.", ".attention.v_proj."),
    (".attention.output.dense.", ".attention.o_proj."),
)


class Dinov2Adapter(ModelAdapter):
    """DINOv2 encoder: node M-Loss on every ``encoder.layer.N.mlp.fc1`` (input of ``config.hidden_act``).

    Layer-scale (``layer_scale1/2.lambda1``) is a per-block tensor merged like any other and applied in the split
    forward. Embeddings stage: ``embeddings.*`` (incl. the mask token); tail: ``layernorm.*``.
    """

    name = "dinov2"
    key_bias = "attention.k_proj.bias"
    model_types = ("dinov2",)
    model_class = Dinov2Model
    layer_pattern = re.compile(r"encoder\.layer\.(\d+)\.")
    unit = ScoredUnit(gate="mlp.fc1")

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        if getattr(self.config, "use_swiglu_ffn", False):
            raise UnsupportedModelError(
                "This DINOv2 model uses the SwiGLU feed-forward (use_swiglu_ffn=True, e.g. dinov2-giant): its hidden "
                "units are silu(gate) * up, a product of two linears, not an element-wise activation of one linear, "
                "so hf_mloss cannot compute a node M-Loss for it. Only the GELU-MLP DINOv2 models (small/base/large) "
                "are supported."
            )

    def canonical_key(self, key: str) -> str | None:
        if key.startswith(_MODEL_PREFIX):
            key = key[len(_MODEL_PREFIX) :]
        if not key.startswith(_ROOTS):
            return None
        if key.startswith("encoder.layer."):
            for old, new in _LEGACY_ATTENTION:
                if old in key:
                    return key.replace(old, new, 1)
        return key

    def is_embedding(self, name: str) -> bool:
        return name.startswith("embeddings.")

    def layer_prefix(self, layer: int) -> str:
        return f"encoder.layer.{layer}."

    def layers(self, model: PreTrainedModel) -> list[nn.Module]:
        return list(model.encoder.layer)

    def embed(self, model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, BlockContext]:
        pixel_values = batch["pixel_values"]
        # as Dinov2Model.forward: positions are interpolated to the input size inside the embeddings
        pixel_values = pixel_values.to(model.embeddings.patch_embeddings.projection.weight.dtype)
        return model.embeddings(pixel_values), BlockContext()

    def forward_to_target(self, layer: nn.Module, hidden: torch.Tensor, context: BlockContext | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, _ = layer.attention(layer.norm1(hidden), attention_mask=None)
        residual = layer.drop_path(layer.layer_scale1(attn)) + hidden
        return residual, layer.norm2(residual)

    def forward_from_target(self, layer: nn.Module, residual: torch.Tensor, target_input: torch.Tensor,
                            context: BlockContext | None = None) -> torch.Tensor:
        return layer.drop_path(layer.layer_scale2(layer.mlp(target_input))) + residual
