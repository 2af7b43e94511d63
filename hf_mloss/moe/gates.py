"""Router rows from prompts, as mergekit-moe computes them (``gate_mode``), one ``[layers, gates, hidden]`` tensor.

* ``hidden`` / ``hidden_last``: the base model, in bfloat16, reads each expert's prompts (the base's BOS written
  before each, left padded; one layer in memory at a time, :mod:`hf_mloss.moe.layered`); a layer's row is the mean
  over the prompts of the last token's hidden state at that layer's input (the residual stream before its first
  norm), the negative prompts' mean subtracted, L2-normalised.
  ``hidden_avg`` averages over all positions instead (padding included, as mergekit does).
* ``cheap_embed``: the same from the token embeddings, in float32 (one row repeated over the layers).
* ``random``: standard normal rows; ``uniform_random``: U(-1/√H, 1/√H); drawn from the config's ``seed``.

The arithmetic (dtypes, order of sums, normalisation) is mergekit's, so the rows agree with ``mergekit-moe``'s; the
gates are the experts' rows in order, then the shared expert's (Qwen2-MoE's ``shared_expert_gate``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import DataError
from .config import ExpertSpec


def prompt_tokenizer(tokenizer: Any) -> Any:
    """The base's tokenizer as mergekit-moe reads prompts with it: left padding, BOS as the pad token (else EOS)."""
    tokenizer.padding_side = "left"
    if tokenizer.bos_token_id is not None:
        tokenizer.pad_token_id = tokenizer.bos_token_id
    elif tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encode(tokenizer: Any, prompts: Sequence[str], max_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of ``prompts``, each written after the BOS token (no chat template);
    ``max_tokens``: each cut to its first that many tokens (the BOS included)."""
    cut = {"truncation": True, "max_length": max_tokens} if max_tokens is not None else {}
    batch = tokenizer([(tokenizer.bos_token or "") + p for p in prompts], return_tensors="pt", padding=True,
                      add_special_tokens=False, **cut)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def check_prompt_ids(tokenizer: Any, gates: Sequence[ExpertSpec], rows: int) -> None:
    """Refuse, before any forward, prompts the base's tokenizer turns into ids its embedding table has no row for."""
    for gate in gates:
        for prompts in (gate.positive_prompts, gate.negative_prompts):
            if not prompts:
                continue
            largest = int(encode(tokenizer, prompts)["input_ids"].max())
            if largest >= rows:
                raise DataError(f"The base's tokenizer gives token id {largest} for the prompts of {gate.label} but "
                                f"model.embed_tokens has {rows} rows: the tokenizer does not match the model.")


def random_gates(mode: str, layers: int, gates: int, hidden: int, generator: torch.Generator) -> torch.Tensor:
    """``random`` or ``uniform_random`` rows: the first draws of the seeded stream (noise comes after)."""
    if mode == "random":
        return torch.randn((layers, gates, hidden), generator=generator)
    scale = math.sqrt(1.0 / hidden)
    return torch.rand((layers, gates, hidden), generator=generator) * 2 * scale - scale


def prompt_gates(gates: Sequence[ExpertSpec], represent: Callable[[Sequence[str]], torch.Tensor], *,
                 progress: bool = False) -> torch.Tensor:
    """``[layers, gates, hidden]``: each gate's positive prompts' representation minus its negative prompts',
    normalised per layer (``represent`` maps prompts to ``[layers, hidden]``)."""
    from tqdm.auto import tqdm

    rows = []
    for gate in tqdm(gates, desc="Router rows from prompts", unit="expert", disable=not progress):
        vector = represent(gate.positive_prompts)
        if gate.negative_prompts:
            vector = vector - represent(gate.negative_prompts)
        vector = vector / vector.norm(p=2, dim=-1, keepdim=True).clamp(min=1e-8)
        rows.append(vector)
    return torch.stack(rows, dim=0).permute(1, 0, 2)


def hidden_representations(layered: Any, tokenizer: Any, prompt_sets: Sequence[Sequence[str]], *, average: bool,
                           progress: bool = False) -> list[torch.Tensor]:
    """Each prompt set → ``[layers, hidden]``: the mean over its prompts of each decoder layer's input at the last
    position (``average``: the mean over all positions), in the model's dtype; one batch per set, as mergekit reads
    them. ``layered``: the base as a :class:`~hf_mloss.moe.layered.LayeredModel` (one layer in memory at a time;
    every layer input is what the whole model's ``output_hidden_states`` gives, bit for bit)."""
    batches = layered.record([encode(tokenizer, prompts) for prompts in prompt_sets])
    states: list[list[torch.Tensor]] = [[] for _ in batches]
    last = layered.num_layers - 1
    for i, layer in layered.layers(progress=progress, desc="Router rows from prompts"):
        for b, batch in enumerate(batches):
            hidden = batch.hidden  # [prompts, positions, hidden]: this layer's input
            states[b].append(hidden.sum(dim=1) / hidden.shape[1] if average else hidden[:, -1, :].clone())
            if i < last:  # the last layer's output is not a layer input
                layered.forward(i, layer, batch)
    out = []
    for per_layer in states:
        stacked = torch.stack(per_layer)  # [layers, prompts, hidden]
        out.append((stacked.sum(dim=1) / stacked.shape[1]).cpu())
    return out


def hidden_representation(layered: Any, tokenizer: Any, gates: Sequence[ExpertSpec], *, average: bool,
                          progress: bool = False) -> Callable[[Sequence[str]], torch.Tensor]:
    """:func:`prompt_gates`'s ``represent`` for ``gates``: every prompt set read in one layer-by-layer pass first
    (:func:`hidden_representations`), then handed out in the order ``prompt_gates`` asks for them."""
    sets = [prompts for gate in gates for prompts in (gate.positive_prompts, gate.negative_prompts) if prompts]
    ready = iter(zip(sets, hidden_representations(layered, tokenizer, sets, average=average, progress=progress),
                     strict=True))

    def represent(prompts: Sequence[str]) -> torch.Tensor:
        expected, value = next(ready)
        if list(expected) != list(prompts):  # prompt_gates asks in the order the sets were listed
            raise RuntimeError("prompt sets asked for out of order")
        return value

    return represent


def embedding_representation(embeddings: torch.Tensor, tokenizer: Any, layers: int
                             ) -> Callable[[Sequence[str]], torch.Tensor]:
    """Prompts → ``[layers, hidden]``: the normalised sum of the token embeddings of every real token, in float32."""
    table = embeddings.float()

    def represent(prompts: Sequence[str]) -> torch.Tensor:
        batch = encode(tokenizer, prompts)
        ids = batch["input_ids"]
        summed = (table[ids] * batch["attention_mask"].unsqueeze(-1)).sum(dim=1).sum(dim=0, keepdim=True)
        summed = summed / summed.norm(dim=-1, keepdim=True).clamp(min=1e-8)
        return summed.repeat(layers, 1)

    return represent


def degenerate_layers(gates: torch.Tensor, threshold: float = 5.0) -> list[int]:
    """Layers whose router rows are nearly dependent (condition number above ``threshold``, mergekit's test): some
    experts will be hard to tell apart there."""
    return [layer for layer in range(gates.shape[0]) if float(torch.linalg.cond(gates[layer].float())) > threshold]
