"""Adapter for BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa, the MiniLM sentence encoders): M-Loss on text.

Any checkpoint class of the family is merged whole, as the base's own class (``BertModel``,
``BertForSequenceClassification``, ``RobertaForMaskedLM``...): the encoder is scored, the heads (pooler,
classifier, MLM head) sit in the last stage and are merged by the method's data-free rule. Canonical names drop the
``bert.`` / ``roberta.`` prefix the ``*For*`` classes put before the encoder, so a ``BertModel`` file and a
``BertForSequenceClassification`` file name the encoder's tensors alike. Reading, tied tensors and saving are the
generic adapter's (``save_pretrained``: tied tensors saved once, the tokenizer from the base).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ..errors import UnsupportedModelError
from .base import BlockContext, ScoredUnit
from .generic import GenericAdapter, meta_state


def _bidirectional_mask(config: PretrainedConfig, embeddings: torch.Tensor, attention_mask: torch.Tensor):
    """The 4-D attention mask an encoder's layers get, built as the model's own forward builds it."""
    from transformers.masking_utils import create_bidirectional_mask

    return create_bidirectional_mask(config=config, inputs_embeds=embeddings, attention_mask=attention_mask)


class BertAdapter(GenericAdapter):
    """BERT-style encoder: node M-Loss on every ``encoder.layer.N.intermediate.dense`` (the input of ``gelu``).

    A block runs ``attention (with its residual and LayerNorm) → intermediate.dense → act → output.dense →
    +residual → LayerNorm``; the scored linear reads the attention output, which is also the residual.
    Padding positions never count: the batch's ``attention_mask`` masks the attention and the positions.
    """

    name = "bert"
    model_types = ("bert", "roberta", "xlm-roberta")
    layer_pattern = re.compile(r"encoder\.layer\.(\d+)\.")
    unit: ClassVar[ScoredUnit] = ScoredUnit(gate="intermediate.dense", down="output.dense")
    target_suffix = unit.gate
    scorable: ClassVar[bool] = True
    modality: ClassVar[str] = "text"
    input_names: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask")

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        prefix = getattr(self.model_class, "base_model_prefix", "")
        self._prefix = f"{prefix}." if prefix else ""

    @classmethod
    def matches(cls, config: PretrainedConfig) -> bool:
        # decoders (``is_decoder``, cross-attention) build causal masks and caches: merged by the generic adapter
        return (getattr(config, "model_type", None) in cls.model_types and not getattr(config, "is_decoder", False)
                and not getattr(config, "add_cross_attention", False))

    # ----------------------------------------------------------------- names
    def canonical_key(self, key: str) -> str | None:
        key = super().canonical_key(key)
        return key[len(self._prefix):] if self._prefix and key.startswith(self._prefix) else key

    def is_embedding(self, name: str) -> bool:
        return name.startswith("embeddings.")

    def layer_prefix(self, layer: int) -> str:
        return f"encoder.layer.{layer}."

    def tied_names(self) -> frozenset[str]:
        return frozenset(n for k in meta_state(self.model_class, self.config)[2]
                         if (n := self.canonical_key(k)) is not None)

    def node_groups(self, layer: int) -> list[tuple[str, int]]:
        """Row i of ``intermediate.dense`` (weight and bias) belongs to node i."""
        gate = f"{self.layer_prefix(layer)}{self.unit.gate}"
        return [(f"{gate}.weight", 0), (f"{gate}.bias", 0)]

    # ----------------------------------------------------------------- the block walk
    def layers(self, model: PreTrainedModel) -> list[nn.Module]:
        return list(model.base_model.encoder.layer)

    def activation(self, model: PreTrainedModel | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        if model is not None:
            return self.layers(model)[0].intermediate.intermediate_act_fn
        from transformers.activations import ACT2FN

        act = self.config.hidden_act
        return ACT2FN[act] if isinstance(act, str) else act

    def embed(self, model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, BlockContext]:
        """Token, position and token-type embeddings (token types zero unless the batch gives them) and the
        bidirectional attention mask from ``attention_mask``."""
        encoder = model.base_model
        input_ids = batch["input_ids"]
        attention_mask = batch.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        token_type_ids = batch.get("token_type_ids")
        if token_type_ids is None and getattr(encoder.embeddings, "token_type_embeddings", None) is not None:
            token_type_ids = torch.zeros_like(input_ids)
        hidden = encoder.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        mask4d = _bidirectional_mask(encoder.config, hidden, attention_mask)
        return hidden, BlockContext(mask=attention_mask.bool(), extras={"attention_mask": mask4d})

    def forward_to_target(self, layer: nn.Module, hidden: torch.Tensor,
                          context: BlockContext) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(layer, "is_decoder", False):
            raise UnsupportedModelError("BERT-family decoders (is_decoder=True) are not scored; merge them data-free.")
        attention_output, _ = layer.attention(hidden, context.extras.get("attention_mask"))
        return attention_output, attention_output

    def forward_from_target(self, layer: nn.Module, residual: torch.Tensor, target_input: torch.Tensor,
                            context: BlockContext) -> torch.Tensor:
        return layer.output(layer.intermediate(target_input), residual)
