"""A DINOv2 encoder split at a block boundary: the lower blocks frozen and run once, the upper blocks trained.

The suite fine-tunes only the upper blocks (and the final layer norm), so every fine-tune and every merge shares the
lower blocks bit for bit (their task vectors are exactly zero). The hidden states after the lower blocks are
computed once per image and cached; fine-tuning, evaluating and ensembling then run only :class:`Upper` on them.
The last block computes the CLS token alone (its keys and values still come from every token): the pooled output
is all the heads read, and it saves a quarter of that block.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Dinov2Model


@torch.inference_mode()
def lower_hidden(model: Dinov2Model, pixels: torch.Tensor, frozen: int, *, batch: int = 128,
                 desc: str | None = None) -> torch.Tensor:
    """Hidden states after the embeddings and the first ``frozen`` blocks: float32 ``[N, tokens, hidden]``
    (``desc``: a progress bar over the batches, so named)."""
    from benchmarks.suites.training import progress

    model.eval()
    out = []
    chunks = pixels.split(batch)
    for chunk in progress(chunks, desc or "", enabled=desc is not None):
        hidden = model.embeddings(chunk)
        for block in model.encoder.layer[:frozen]:
            hidden = block(hidden)
        out.append(hidden)
    return torch.cat(out)


def _cls_block(block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """One ``Dinov2Layer`` evaluated for the CLS token only: ``[B, T, D]`` → ``[B, 1, D]``."""
    attn = block.attention
    b, t, _ = hidden.shape
    x = block.norm1(hidden)
    q = attn.q_proj(x[:, :1]).view(b, 1, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, scale=attn.scaling).transpose(1, 2).reshape(b, 1, -1)
    cls = hidden[:, :1] + block.layer_scale1(attn.o_proj(out))
    return cls + block.layer_scale2(block.mlp(block.norm2(cls)))


class Upper(nn.Module):
    """Blocks ``frozen..`` and the final layer norm of a ``Dinov2Model``: cached hidden states → pooled CLS."""

    def __init__(self, model: Dinov2Model, frozen: int) -> None:
        super().__init__()
        self.frozen = frozen
        self.blocks = copy.deepcopy(model.encoder.layer[frozen:])
        self.layernorm = copy.deepcopy(model.layernorm)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[:-1]:
            hidden = block(hidden)
        return self.layernorm(_cls_block(self.blocks[-1], hidden))[:, 0]

    def model_keys(self) -> dict[str, str]:
        """Own state-dict key → the ``Dinov2Model`` key it holds."""
        return {k: (f"encoder.layer.{int(k.split('.')[1]) + self.frozen}." + k.split(".", 2)[2]
                    if k.startswith("blocks.") else k) for k in self.state_dict()}

    def load_from(self, model: Dinov2Model) -> Upper:
        """Load the upper part of ``model`` (same architecture) in place; returns ``self``."""
        state = model.state_dict()
        self.load_state_dict({k: state[src] for k, src in self.model_keys().items()})
        return self

    def write_into(self, model: Dinov2Model) -> Dinov2Model:
        """Copy these weights into the upper part of ``model`` in place; returns ``model``."""
        own = self.state_dict()
        model.load_state_dict({src: own[k] for k, src in self.model_keys().items()}, strict=False)
        return model


@torch.inference_mode()
def pooled(upper: Upper, hidden: torch.Tensor, *, batch: int = 250) -> torch.Tensor:
    """Pooled features of cached hidden states, in eval mode."""
    upper.eval()
    return torch.cat([upper(chunk) for chunk in hidden.split(batch)])


def lower_drift(model: Dinov2Model, base: Dinov2Model, frozen: int) -> float:
    """Largest relative change, max |Δ| / max |θ₀| per tensor, of the embeddings and the first ``frozen`` blocks
    between ``model`` and ``base``: 0, or float rounding (a weighted mean of q copies of one tensor is a few ulps
    off), when the cached hidden states are valid for ``model``."""
    theirs = base.state_dict()
    lower = ("embeddings.",) + tuple(f"encoder.layer.{i}." for i in range(frozen))
    return max(float((v - theirs[k]).abs().max() / theirs[k].abs().max().clamp_min(1e-12))
               for k, v in model.state_dict().items() if k.startswith(lower) and v.is_floating_point())
