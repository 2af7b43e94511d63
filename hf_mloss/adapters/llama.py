"""Adapter for LLaMA-family decoders (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2): gated M-Loss on text.

The checkpoint is merged whole as the base's own class (``LlamaForCausalLM``..., or the family's ``*ForCausalLM``
when ``config.json`` names none): the decoder blocks are scored, the final norm and ``lm_head`` are the last stage.
Canonical names are the base class's own keys (``model.layers.3.mlp.gate_proj.weight`` for a ``*ForCausalLM``, as
the generic adapter and mergekit name them); a file of the other spelling (a bare ``LlamaModel``'s ``layers.3...``,
or ``model.``-prefixed keys under a bare-model base) is read under the base's names. Reading, tied embeddings
(``lm_head`` tied to ``embed_tokens``: merged once, saved tied) and saving are the generic adapter's.

The unit is the gated MLP ``down_proj(f(gate_proj(u)) * up_proj(u))`` (SPEC 1b): node i owns row i of ``gate_proj``
and ``up_proj`` and column i of ``down_proj``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .base import BlockContext, ScoredUnit
from .bert import base_class_key, base_class_prefix
from .generic import GenericAdapter

_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
_DECODER_ROOTS = ("embed_tokens.", "layers.", "norm.")  # the tensors of the bare decoder (``LlamaModel``)


def causal_lm_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The family's ``*ForCausalLM`` class for a config (``LlamaConfig`` -> ``LlamaForCausalLM``)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)]


def pad_aware_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of every token counted from the sequence's first real token (as ``generate`` numbers them), so a
    left-padded sequence gets the positions it has alone; padding positions get 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def decoder_masks(config: PretrainedConfig, embeddings: torch.Tensor, attention_mask: torch.Tensor,
                  position_ids: torch.Tensor) -> dict[str | None, object]:
    """The causal + padding masks the decoder layers get, keyed by layer type, built by transformers' own
    ``masking_utils`` for the model's attention implementation (as the family's ``*Model.forward`` builds them)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kwargs = {"config": config, "inputs_embeds": embeddings, "attention_mask": attention_mask, "cache": None,
              "position_ids": position_ids}
    layer_types = getattr(config, "layer_types", None)
    if layer_types:  # Qwen2 / Qwen3 / Gemma 2: per-layer full or sliding-window attention
        masks: dict[str | None, object] = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks
    sliding = getattr(config, "sliding_window", None) is not None  # Mistral: one mask for every layer
    return {None: (create_sliding_window_causal_mask if sliding else create_causal_mask)(**kwargs)}


def is_causal_lm(model: PreTrainedModel) -> bool:
    """Whether ``model`` is a family's causal LM (its class is the one ``AutoModelForCausalLM`` builds)."""
    try:
        return isinstance(model, causal_lm_class(model.config))
    except (KeyError, ValueError):
        return False


def _inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and the pad-aware positions (left padding gives what the sequence alone
    gets)."""
    mask = batch.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(batch["input_ids"])
    return {"input_ids": batch["input_ids"], "attention_mask": mask, "position_ids": pad_aware_positions(mask)}


def causal_logits(model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[batch, seq, vocab]`` next-token logits of a causal LM."""
    return model(**_inputs(batch), use_cache=False).logits


def last_token_pool(model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[batch, hidden]``: the decoder's final hidden state at each sequence's last real token."""
    inputs = _inputs(batch)
    hidden = model.base_model(**inputs, use_cache=False).last_hidden_state
    mask = inputs["attention_mask"].bool()
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(-1).clamp_min(0)
    return hidden[torch.arange(len(hidden), device=hidden.device), last]


class _HandsOn(nn.Module):
    """Stands in for a decoder's blocks: returns the given last block's output, whatever it is called with."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.hidden


class LlamaAdapter(GenericAdapter):
    """LLaMA-family decoder: gated node M-Loss on every ``layers.N.mlp`` (``gate_proj`` / ``up_proj``).

    A block runs ``input_layernorm → self_attn (causal + padding mask, rotary embeddings) → +residual →
    post_attention_layernorm → mlp → +residual`` (Gemma 2 adds a norm after the attention and around the MLP).
    Positions are counted from each sequence's first real token, so left and right padding give the same hidden
    states as the sequence alone; padding positions never count.
    """

    scorable = True  # GenericAdapter's families are not; this one is
    fallback = False

    name = "llama"
    model_types = _FAMILIES
    layer_pattern = re.compile(r"model\.layers\.(\d+)\.")  # per instance: the base class's spelling
    unit: ClassVar[ScoredUnit] = ScoredUnit(gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj")
    target_suffix = unit.gate
    modality: ClassVar[str] = "text"
    input_names: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask")

    def __init__(self, config: PretrainedConfig) -> None:
        if not getattr(config, "architectures", None):  # no class named: the family's causal LM
            config = config.__class__.from_dict(config.to_dict())
            config.architectures = [causal_lm_class(config).__name__]
        super().__init__(config)
        self.name = self.config.model_type  # models of two families never merge together, even with equal shapes
        self._prefix, self._strip = base_class_prefix(self.model_class, self.config)
        self.layer_pattern = re.compile(re.escape(self._prefix) + r"layers\.(\d+)\.")

    @classmethod
    def matches(cls, config: PretrainedConfig) -> bool:
        return getattr(config, "model_type", None) in cls.model_types

    # ----------------------------------------------------------------- names
    def canonical_key(self, key: str) -> str | None:
        name = super().canonical_key(key)
        return None if name is None else base_class_key(name, self._prefix, self._strip, _DECODER_ROOTS)

    def is_embedding(self, name: str) -> bool:
        return name.startswith(f"{self._prefix}embed_tokens.")

    def layer_prefix(self, layer: int) -> str:
        return f"{self._prefix}layers.{layer}."

    def node_groups(self, layer: int) -> list[tuple[str, int]]:
        """Rows i of ``gate_proj`` and ``up_proj`` (and of their biases, if any) and column i of ``down_proj``."""
        prefix, unit = self.layer_prefix(layer), self.unit
        groups = [(f"{prefix}{unit.gate}.weight", 0), (f"{prefix}{unit.up}.weight", 0),
                  (f"{prefix}{unit.down}.weight", 1)]
        if getattr(self.config, "mlp_bias", False):
            groups += [(f"{prefix}{unit.gate}.bias", 0), (f"{prefix}{unit.up}.bias", 0)]
        return groups

    # ----------------------------------------------------------------- the block walk
    def layers(self, model: PreTrainedModel) -> list[nn.Module]:
        return list(model.base_model.layers)

    def activation(self, model: PreTrainedModel | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """f of the unit: the model's own ``mlp.act_fn`` (silu; tanh-GELU for Gemma), else read from the config."""
        if model is not None:
            return self.layers(model)[0].mlp.act_fn
        from transformers.activations import ACT2FN

        return ACT2FN[getattr(self.config, "hidden_activation", None) or self.config.hidden_act]

    def embed(self, model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, BlockContext]:
        """Token embeddings (Gemma's scaled ones included), the causal + padding masks and the rotary
        ``(cos, sin)``, computed once per batch."""
        decoder = model.base_model
        input_ids = batch["input_ids"]
        attention_mask = batch.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = decoder.embed_tokens(input_ids)
        position_ids = pad_aware_positions(attention_mask)
        extras = {"masks": decoder_masks(decoder.config, hidden, attention_mask, position_ids),
                  "layer_types": getattr(decoder.config, "layer_types", None),
                  "position_ids": position_ids,
                  "position_embeddings": decoder.rotary_emb(hidden, position_ids=position_ids)}
        return hidden, BlockContext(mask=attention_mask.bool(), extras=extras)

    @staticmethod
    def _mask_of(layer: nn.Module, context: BlockContext):
        """The mask of the block's attention type (``config.layer_types[layer_idx]``), as the model picks it."""
        masks = context.extras["masks"]
        if None in masks:
            return masks[None]
        return masks[context.extras["layer_types"][layer.self_attn.layer_idx]]

    def forward_to_target(self, layer: nn.Module, hidden: torch.Tensor,
                          context: BlockContext) -> tuple[torch.Tensor, torch.Tensor]:
        attn, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden),
                                  attention_mask=self._mask_of(layer, context),
                                  position_ids=context.extras["position_ids"],
                                  position_embeddings=context.extras["position_embeddings"])
        if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 2: norms after the attention and around the MLP
            residual = hidden + layer.post_attention_layernorm(attn)
            return residual, layer.pre_feedforward_layernorm(residual)
        residual = hidden + attn
        return residual, layer.post_attention_layernorm(residual)

    # ----------------------------------------------------------------- outputs without labels
    def output_rule(self, model: PreTrainedModel):
        """A causal LM (a model with an LM head: ``*ForCausalLM``): the next-token distribution at every real
        position. Any other class of the family (the bare decoder, ``*ForSequenceClassification``): the last real
        token's final hidden state, the one a decoder's sequence classifier reads."""
        from .outputs import NextTokenDistribution, PooledFeatures

        if is_causal_lm(model):
            return NextTokenDistribution(causal_logits, "next-token distribution at every real position")
        return PooledFeatures(last_token_pool, "final hidden state of the last real token")

    reads_outputs_from_states = True

    def outputs_from_states(self, model: PreTrainedModel, rule, batch: Mapping[str, torch.Tensor],
                            hidden: torch.Tensor) -> torch.Tensor:
        """The model's own forward with its blocks replaced by one that hands ``hidden`` on: the final norm, the
        head and any logit soft-capping run as the model runs them (the blocks may be on ``meta``)."""
        blocks = model.base_model.layers
        kept = blocks._modules
        blocks._modules = {"0": _HandsOn(hidden)}
        try:
            return rule.outputs(model, batch)
        finally:
            blocks._modules = kept

    def forward_from_target(self, layer: nn.Module, residual: torch.Tensor, target_input: torch.Tensor,
                            context: BlockContext) -> torch.Tensor:
        out = layer.mlp(target_input)
        if hasattr(layer, "post_feedforward_layernorm"):
            out = layer.post_feedforward_layernorm(out)
        return residual + out
