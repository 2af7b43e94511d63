"""Adapter for BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa, the MiniLM sentence encoders): M-Loss on text.

Any checkpoint class of the family is merged whole, as the base's own class (``BertModel``,
``BertForSequenceClassification``, ``RobertaForMaskedLM``...): the encoder is scored, the heads (pooler,
classifier, MLM head) sit in the last stage and are merged by the method's data-free rule. Canonical names are the
base class's own keys (``bert.encoder.layer.0...`` under a ``*For*`` class, ``encoder.layer.0...`` under
``BertModel``), and files of either spelling are read under them: ``bert.``-prefixed keys (``BertFor*`` checkpoints)
under a ``BertModel`` base (their heads are not part of it), unprefixed ``BertModel`` keys under a ``BertFor*``
base. Tensors the base class has no place for are not part of the merge, as transformers leaves them out when it
loads the class (the pooler and next-sentence head that ``bert-base-uncased``'s ``BertForMaskedLM`` file also
holds). Reading, tied tensors and saving are the generic adapter's (``save_pretrained``: tied tensors saved once, the
tokenizer from the base).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .base import BlockContext, ScoredUnit
from .generic import GenericAdapter, meta_state

_ENCODER_ROOTS = ("embeddings.", "encoder.", "pooler.")  # the tensors of the bare encoder (``BertModel``)


def base_class_prefix(model_class: type[PreTrainedModel], config: PretrainedConfig) -> tuple[str, str]:
    """(prefix of the base model's tensors in ``model_class``'s keys, prefix other classes of the family put there):
    ``("bert.", "")`` for ``BertForSequenceClassification``, ``("", "bert.")`` for ``BertModel``."""
    prefix = f"{model_class.base_model_prefix}." if getattr(model_class, "base_model_prefix", "") else ""
    keys = meta_state(model_class, config)[0]
    return (prefix, "") if prefix and any(k.startswith(prefix) for k in keys) else ("", prefix)


def base_class_key(key: str, prefix: str, strip: str, roots: tuple[str, ...]) -> str | None:
    """A checkpoint key under the base class's spelling (see :func:`base_class_prefix`); ``None`` for the heads of a
    ``*For*`` file when the base is the bare model, which has none."""
    if prefix:
        return prefix + key if key.startswith(roots) else key
    if strip and key.startswith(strip):
        key = key[len(strip):]
    return key if key.startswith(roots) else None


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

    scorable = True  # GenericAdapter's families are not; this one is
    fallback = False

    name = "bert"
    key_bias = "attention.self.key.bias"
    model_types = ("bert", "roberta", "xlm-roberta")
    layer_pattern = re.compile(r"encoder\.layer\.(\d+)\.")
    unit: ClassVar[ScoredUnit] = ScoredUnit(gate="intermediate.dense", down="output.dense")
    target_suffix = unit.gate
    modality: ClassVar[str] = "text"
    input_names: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask")

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.name = self.config.model_type  # models of two families never merge together, even with equal shapes
        self._prefix, self._strip = base_class_prefix(self.model_class, self.config)
        self.layer_pattern = re.compile(re.escape(self._prefix) + r"encoder\.layer\.(\d+)\.")
        self._known = frozenset(meta_state(self.model_class, self.config)[0])  # every tensor the class saves

    @classmethod
    def matches(cls, config: PretrainedConfig) -> bool:
        # decoders (``is_decoder``, cross-attention) build causal masks and caches: merged by the generic adapter
        return (getattr(config, "model_type", None) in cls.model_types and not getattr(config, "is_decoder", False)
                and not getattr(config, "add_cross_attention", False))

    # ----------------------------------------------------------------- names
    def canonical_key(self, key: str) -> str | None:
        name = super().canonical_key(key)
        name = None if name is None else base_class_key(name, self._prefix, self._strip, _ENCODER_ROOTS)
        return name if name in self._known else None

    def is_embedding(self, name: str) -> bool:
        return name.startswith(f"{self._prefix}embeddings.")

    def layer_prefix(self, layer: int) -> str:
        return f"{self._prefix}encoder.layer.{layer}."

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
        attention_output, _ = layer.attention(hidden, context.extras.get("attention_mask"))
        return attention_output, attention_output

    def forward_from_target(self, layer: nn.Module, residual: torch.Tensor, target_input: torch.Tensor,
                            context: BlockContext) -> torch.Tensor:
        return layer.output(layer.intermediate(target_input), residual)

    # ----------------------------------------------------------------- outputs without labels
    def output_rule(self, model: PreTrainedModel):
        """Mean pooling of the encoder's last hidden states over the real tokens (as sentence-transformers pools
        the MiniLM / BERT sentence encoders): the pooler is trained for next-sentence prediction only and many
        encoder checkpoints never use it, so it is not read. Any class of the family (``BertModel``,
        ``BertFor*``) pools its encoder (``base_model``), so its task head is not part of the output."""
        from .outputs import PooledFeatures

        return PooledFeatures(mean_pool, "mean of the encoder's last hidden states over the real tokens")


def mean_pool(model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[batch, hidden]``: the encoder's last hidden states averaged over the non-padding tokens."""
    mask = batch.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(batch["input_ids"])
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    hidden = model.base_model(**{**inputs, "attention_mask": mask}).last_hidden_state.float()
    weights = mask.to(hidden.dtype)[..., None]
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1)
