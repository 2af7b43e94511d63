"""Where the built MoE routes each expert's own prompts, layer by layer: a dead or dominant expert shows before the
model is published (mergekit-moe only warns when router rows are nearly dependent).

The MoE itself, as ``from_pretrained`` loads it (run one layer at a time, :mod:`hf_mloss.moe.layered`), reads every
expert's positive prompts (BOS written first, as for the router rows; positions counted from each prompt's first
token, so padding changes nothing). At each layer the router's input (the output of ``post_attention_layernorm``) is
multiplied by the router, and the top ``experts_per_token`` softmax weights, renormalised, are the token's routing
weights, as the MoE block applies them. A prompt's weights are the mean over its tokens (the BOS left out); its
*pick* is the expert with the largest one.

The layers are read in float32 (``from_pretrained(folder, dtype=torch.float32)``): the written weights exactly, without
a bfloat16 forward's rounding of every activation (which can move a token whose top-k is a near tie), and, on a CPU
without bfloat16 units, several times faster.

The same pass measures each pair of routed experts' M-Loss (:class:`ExpertPairGaps`) on the inputs the MoE gives its
experts: at every layer the router's input at each token read, through every expert's gate and up projections.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.walk import BlockArena

POSITION_CHUNK = 256
"""Tokens whose pre-activations the M-Loss forms at once (``[experts, tokens, 2 · intermediate]`` float32)."""


@dataclass
class RoutingReport:
    """Routing of the experts' own prompts through the built MoE.

    Attributes:
        experts: the experts' labels, in router order.
        prompts: every positive prompt read, and ``owners[p]``: the expert whose prompt it is.
        weights: ``[prompts, layers, experts]`` mean routing weight of each prompt's tokens.
        selected: ``[layers, experts]`` tokens (of all prompts) whose top-k holds the expert.
        top_k: experts per token.
    """

    experts: list[str]
    prompts: list[str]
    owners: list[int]
    weights: torch.Tensor
    selected: torch.Tensor
    top_k: int
    notes: list[str] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return int(self.weights.shape[1])

    def picks(self) -> torch.Tensor:
        """``[prompts, layers]``: the expert each prompt sends the most weight to."""
        return self.weights.argmax(dim=-1)

    def shares(self) -> torch.Tensor:
        """``[experts (whose prompts), layers, experts (routed to)]``: mean routing weight of each expert's prompts."""
        owners = torch.tensor(self.owners)
        return torch.stack([self.weights[owners == i].mean(dim=0) for i in range(len(self.experts))])

    def own_share(self) -> torch.Tensor:
        """``[experts, layers]``: the share of each expert's own prompts routed to it (the diagonal of
        :meth:`shares`); ``1/experts`` is what a router that cannot tell the prompts apart gives."""
        shares = self.shares()
        return torch.stack([shares[i, :, i] for i in range(len(self.experts))])

    def own_picks(self) -> torch.Tensor:
        """``[experts, layers]``: the fraction of each expert's prompts that pick it."""
        owners, picks = torch.tensor(self.owners), self.picks()
        return torch.stack([(picks[owners == i] == i).float().mean(dim=0) for i in range(len(self.experts))])

    def dead(self) -> dict[int, list[int]]:
        """Layer → experts no token of any prompt was routed to."""
        out = {}
        for layer in range(self.num_layers):
            idle = [e for e in range(len(self.experts)) if int(self.selected[layer, e]) == 0]
            if idle:
                out[layer] = idle
        return out

    def dominant(self) -> dict[int, int]:
        """Layer → the expert every prompt picks (when the prompts belong to two experts or more)."""
        if len(set(self.owners)) < 2:
            return {}
        picks = self.picks()
        return {layer: int(picks[0, layer]) for layer in range(self.num_layers)
                if bool((picks[:, layer] == picks[0, layer]).all())}

    def warnings(self) -> list[str]:
        """One line per dead or dominant expert, and per expert whose own prompts mostly pick another one."""
        lines = [f"expert {e} ({self.experts[e]}) gets no token at layer(s) {_layers(ls)}"
                 for e, ls in _by_expert(self.dead()).items()]
        lines += [f"expert {e} ({self.experts[e]}) is every prompt's pick at layer(s) {_layers(ls)}"
                  for e, ls in _by_expert({k: [v] for k, v in self.dominant().items()}).items()]
        own = self.own_picks()
        for e in range(len(self.experts)):
            lost = [layer for layer in range(self.num_layers) if float(own[e, layer]) < 0.5]
            if lost and len(lost) > self.num_layers // 2:
                lines.append(f"expert {e} ({self.experts[e]}): most of its own prompts pick another expert at "
                             f"{len(lost)} of {self.num_layers} layers")
        return lines

    def summary(self) -> str:
        """The per-layer share of each expert's own prompts routed to it, and the warnings."""
        layers = self.num_layers
        width = max(len(label) for label in self.experts) + 6
        own, picked = self.own_share(), self.own_picks()
        head = "  ".join(f"L{layer:<5}" for layer in range(layers))
        lines = [f"Routing of each expert's own prompts (share of their routing weight sent to it; uniform would be "
                 f"{1 / len(self.experts):.2f}; top-{self.top_k}):",
                 f"  {'expert':<{width}}{head}   own prompts picking it (mean over layers)"]
        for e, label in enumerate(self.experts):
            row = "  ".join(f"{float(own[e, layer]):<6.2f}" for layer in range(layers))
            lines.append(f"  {f'{e}: {label}':<{width}}{row}   {float(picked[e].mean()):.0%}")
        warnings = self.warnings()
        lines += [f"  warning: {w}" for w in warnings] or ["  no dead or dominant expert"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"experts": self.experts, "top_k": self.top_k, "num_layers": self.num_layers,
                "own_share": _rounded(self.own_share()), "own_picks": _rounded(self.own_picks()),
                "shares": _rounded(self.shares()), "selected_tokens": self.selected.tolist(),
                "prompts": [{"text": p, "expert": o, "picks": picks, "weights": _rounded(w)}
                            for p, o, picks, w in zip(self.prompts, self.owners, self.picks().tolist(),
                                                      self.weights, strict=True)],
                "dead": {str(k): v for k, v in self.dead().items()},
                "dominant": {str(k): v for k, v in self.dominant().items()},
                "warnings": self.warnings(), "notes": self.notes}


def _rounded(tensor: torch.Tensor) -> Any:
    return ((tensor.double() * 1e6).round() / 1e6).tolist()


def _by_expert(per_layer: dict[int, list[int]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for layer, experts in per_layer.items():
        for e in experts:
            out.setdefault(e, []).append(layer)
    return out


def _layers(layers: list[int]) -> str:
    return ", ".join(str(layer) for layer in layers)


class ExpertPairGaps:
    """Each pair of routed experts' M-Loss on the MoE's own expert inputs.

    At every layer and token read, the router's input x goes through every expert's fused gate and up projections
    (``gate, up = (W_e x).chunk(2)``, as the expert computes them); node i of the pair (a, b) then has the M-Loss
    ``|σ(½g_a + ½g_b)·(½u_a + ½u_b) − ½σ(g_a)u_a − ½σ(g_b)u_b|``, the gap kernel of ``hf_mloss.compatibility``
    (:class:`~hf_mloss.engine.kernel.GapSums`, reduction ``abs``, ε 1e-4). A pair's value is the layer M-Loss (the L2
    norm over the layer's nodes, mean over tokens), averaged over the layers, as ``CompatibilityReport.matrix`` gives
    it."""

    def __init__(self, num_experts: int) -> None:
        from ..engine.compatibility import subset_matrix

        self.pairs = list(itertools.combinations(range(num_experts), 2))
        self.matrix = subset_matrix(self.pairs, torch.ones(num_experts))
        self.per_layer: dict[int, Any] = {}  # layer -> its GapSums
        self._scratch = {role: BlockArena() for role in ("pre", "gate", "up")}  # reused by every layer

    def add(self, layer: int, experts: Any, hidden: torch.Tensor) -> None:
        """Add the gaps of ``hidden`` (``[tokens, hidden size]``, the router's input at layer ``layer``) through
        ``experts`` (the layer's experts module: ``gate_up_proj`` ``[experts, 2·intermediate, hidden size]``).

        The products and the gate and up halves the kernel reads (and overwrites) are written into buffers kept
        from layer to layer: made afresh, they were most of the pages the routing pass faulted in."""
        from ..engine.kernel import GapSums

        weight = experts.gate_up_proj
        num_experts, nodes = weight.shape[0], weight.shape[1] // 2
        sums = self.per_layer.get(layer)
        if sums is None:
            sums = self.per_layer[layer] = GapSums(len(self.pairs), nodes, per_node=False, device=hidden.device)
        matrix = self.matrix.to(hidden.device)
        for part in hidden.split(POSITION_CHUNK) if hidden.shape[0] else ():
            shape = (num_experts, part.shape[0], nodes)
            pre = self._scratch["pre"].tensor((*shape[:2], 2 * nodes), weight.dtype, hidden.device)
            torch.matmul(part.to(weight.dtype), weight.transpose(1, 2), out=pre)  # [experts, tokens, 2·nodes]
            # the halves in float32, where the kernel reads and overwrites them
            gate = self._scratch["gate"].tensor(shape, torch.float32, hidden.device).copy_(pre[..., :nodes])
            up = self._scratch["up"].tensor(shape, torch.float32, hidden.device).copy_(pre[..., nodes:])
            sums.add_preactivations(gate, matrix, experts.act_fn, up=up, sources_first=True)

    def values(self) -> dict[tuple[int, int], float] | None:
        """``{(i, j): M-Loss}`` for every pair (mean over the layers); ``None`` when no token was read."""
        from ..engine.compatibility import subset_scores

        if not any(float(sums.count) for sums in self.per_layer.values()):
            return None
        layers = torch.stack([subset_scores(self.per_layer[i])["mloss"] for i in sorted(self.per_layer)])
        return {pair: float(layers[:, row].mean()) for row, pair in enumerate(self.pairs)}


def route_prompts(layered: Any, tokenizer: Any, prompts: Sequence[str], owners: Sequence[int], labels: list[str], *,
                  top_k: int, normalize: bool = True, batch_size: int = 16, max_tokens: int | None = None,
                  pair_gaps: ExpertPairGaps | None = None, progress: bool = False) -> RoutingReport:
    """Run ``prompts`` through the MoE and record the routing of every real token (see the module). ``layered``: the
    MoE as a :class:`~hf_mloss.moe.layered.LayeredModel` (one layer in memory at a time); each layer's router input
    is what the whole model's forward computes, bit for bit, and the last layer stops once its router has read it.
    ``max_tokens``: only each prompt's first tokens (the BOS included) are read; the model is causal, so the routing
    at those positions is the whole prompt's. ``pair_gaps``: also add each expert pair's gaps at those tokens."""
    from .gates import encode

    encoded = [encode(tokenizer, prompts[start:start + batch_size], max_tokens)
               for start in range(0, len(prompts), batch_size)]
    positions = [(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0) for batch in encoded]
    batches = layered.record([{**batch, "position_ids": pos} for batch, pos in zip(encoded, positions, strict=True)],
                             use_cache=False)
    weights = torch.zeros(len(prompts), layered.num_layers, len(labels), dtype=torch.float64)
    selected = torch.zeros(layered.num_layers, len(labels), dtype=torch.long)
    skip_bos = tokenizer.bos_token is not None
    last = layered.num_layers - 1
    # memory goes back to the system once, after the pass: the pair gaps' and the forward's buffers are reused
    for i, layer in layered.layers(progress=progress, desc="Routing the prompts through the MoE", release=False):
        router = _router_weight(layer)
        captured: list[torch.Tensor] = []

        def keep(module: Any, args: Any, output: torch.Tensor, i: int = i,
                 captured: list[torch.Tensor] = captured) -> None:
            captured.append(output)
            if i == last:  # the router has its input: the last layer's experts are not needed
                layered.stop()

        handle = layer.post_attention_layernorm.register_forward_hook(keep)
        inputs: list[torch.Tensor] = []  # the experts' inputs at the real tokens of every batch
        try:
            for b, batch in enumerate(batches):
                captured.clear()
                layered.forward(i, layer, batch)
                mask, pos = encoded[b]["attention_mask"].to(layered.device), positions[b].to(layered.device)
                real = mask.bool() & (pos > 0) if skip_bos else mask.bool()  # the BOS: the same in every prompt
                with torch.no_grad():
                    per_prompt, chosen = _route(captured[0], router, real, top_k, normalize)
                    if pair_gaps is not None:
                        inputs.append(captured[0][real])
                start = b * batch_size
                weights[start:start + len(per_prompt), i] = per_prompt.double().cpu()
                selected[i] += chosen.cpu()
            if pair_gaps is not None:  # once per layer: each expert's weights read once for all the tokens
                with torch.no_grad():
                    pair_gaps.add(i, _moe_block(layer).experts, torch.cat(inputs))
        finally:
            handle.remove()
    return RoutingReport(experts=labels, prompts=list(prompts), owners=list(owners), weights=weights,
                         selected=selected, top_k=top_k)


def _route(hidden: torch.Tensor, router: torch.Tensor, real: torch.Tensor, top_k: int, normalize: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's routing of one batch: each prompt's mean routing weights over its real tokens, and the tokens
    whose top-k holds each expert."""
    probs = torch.softmax(torch.nn.functional.linear(hidden, router).float(), dim=-1)
    top, index = probs.topk(top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    routed = torch.zeros_like(probs).scatter_(-1, index, top) * real.unsqueeze(-1)
    chosen = torch.zeros_like(probs).scatter_(-1, index, torch.ones_like(top)) * real.unsqueeze(-1)
    return routed.sum(dim=1) / real.sum(dim=1, keepdim=True).clamp(min=1), chosen.sum(dim=(0, 1)).long()


def _router_weight(layer: Any) -> torch.Tensor:
    """The router matrix ``[experts, hidden]`` of a decoder layer."""
    return _moe_block(layer).gate.weight


def _moe_block(layer: Any) -> Any:
    """A decoder layer's MoE block (``mlp``, or Mixtral's older ``block_sparse_moe``)."""
    return getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe")
