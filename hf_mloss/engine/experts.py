"""Gated node M-Loss per MoE expert: the gap kernel on the tokens the router sends to each expert, weighted by its
routing weight (docs/mloss.md, "Mixture-of-experts").

A block of an MoE decoder is scored in *parts* (:class:`hf_mloss.adapters.experts.ExpertPart`: each routed expert,
the shared expert, a dense block's MLP), each a gated MLP with its own nodes. At every real position t the block's
adapter gives each part's weight w_t (:meth:`~hf_mloss.adapters.experts.MoeAdapter.part_weights`: the factor the
block multiplies the part's output by; 0 where the router does not send t to the expert). A part's sums are the
kernel's sums over the positions where its weight is positive, each term times w_t, and its count is Σ w_t
(:meth:`hf_mloss.engine.kernel.GapSums.add_weighted`), so its node and layer M-Loss are weighted means over the
tokens routed to it. Which router decides:

* shared prefix (``base`` / ``merged``): the prefix model's own router on the shared input u (the base's, or the
  merged-so-far model's, whose router at this block is already merged); every source's expert sees the same tokens
  with the same weights.
* ``own``: each source's own router on its own input; merge r (a row A_r of the mixing matrix) weights t by
  Σ_p A_rp w_pt, the ensemble's weight of the part at t (linear in A, so a subset's numbers are a direct score of
  that subset); a position counts where that weight is positive.

A part that no token reaches has count 0: :class:`ExpertSums` reports it as unrouted (NaN node values), never as 0.
The block's layer M-Loss is the weighted mean of ‖g‖₂ over every (token, part) pair: Σ_parts Σ_t w‖g‖₂ /
Σ_parts Σ_t w.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .kernel import GapSums, reduce_sums
from .walk import _own_embeddings

__all__ = ["ExpertSums", "ExpertTarget", "own_expert_walk"]

PIECE_ELEMENTS = 1 << 22
"""Pre-activation values per piece of routed positions (16 MB of float32): the q sources' GEMM output of one part."""


class ExpertSums:
    """Running sums of one MoE block's unit for ``m`` merges (rows of A): one weighted :class:`GapSums` per part,
    the tokens routed to each part (``tokens``, ``[parts, m]``) and the real positions seen (``positions``)."""

    def __init__(self, labels: Sequence[str], nodes: Sequence[int], num_rows: int, *, reduction: str = "abs",
                 eps: float = 1e-4, per_node: bool = True, device: Any = "cpu") -> None:
        self.labels, self.nodes = list(labels), list(nodes)
        self.parts = [GapSums(num_rows, n, reduction=reduction, eps=eps, per_node=per_node, device=device)
                      for n in nodes]
        self.tokens = torch.zeros(len(self.parts), num_rows, dtype=torch.float64, device=device)
        self.positions = torch.zeros((), dtype=torch.float64, device=device)

    @classmethod
    def for_parts(cls, parts: Sequence[Any], num_rows: int, **kwargs: Any) -> ExpertSums:
        return cls([p.label for p in parts], [p.nodes for p in parts], num_rows, **kwargs)

    @property
    def reduction(self) -> str:
        return self.parts[0].reduction

    @property
    def per_node(self) -> bool:
        return self.parts[0].per_node

    @property
    def count(self) -> torch.Tensor:
        """The real positions seen (every token passes the block, whichever experts it is routed to)."""
        return self.positions

    def empty(self) -> ExpertSums:
        first = self.parts[0]
        return type(self)(self.labels, self.nodes, first.num_rows, reduction=first.reduction, eps=first.eps,
                          per_node=first.per_node, device=self.tokens.device)

    def merge(self, other: ExpertSums) -> None:
        for mine, theirs in zip(self.parts, other.parts):
            mine.merge(theirs)
        self.tokens += other.tokens
        self.positions += other.positions

    def add_sums(self, other: ExpertSums) -> None:
        self.merge(other)

    def reduce_across_processes(self) -> None:
        tensors = [t for part in self.parts for t in (part.node, part.layer)] + [self.tokens, self.positions]
        reduced = reduce_sums(*tensors)
        for i, part in enumerate(self.parts):
            part.node, part.layer = reduced[2 * i], reduced[2 * i + 1]
        self.tokens, self.positions = reduced[-2], reduced[-1]

    # ------------------------------------------------------------------------------------------------ means
    def node_means(self, row: int = 0) -> dict[str, torch.Tensor]:
        """Per node (parts concatenated) for row ``row``: ``node`` (weighted mean |g| or g²), ``node_normalized``,
        ``node_ratio``; NaN for the nodes of a part no token was routed to."""
        tiny = torch.finfo(torch.float64).tiny
        out: dict[str, list[torch.Tensor]] = {"node": [], "node_normalized": [], "node_ratio": []}
        for part in self.parts:
            node, mass = part.node[:, row], part.layer[3, row]
            if mass <= 0:
                blank = torch.full((node.shape[-1],), float("nan"), dtype=torch.float64, device=node.device)
                for values in out.values():
                    values.append(blank)
                continue
            gap_sum = node[0] if part.reduction == "abs" else node[3]
            out["node"].append(node[0] / mass)
            out["node_normalized"].append(node[1] / mass)
            out["node_ratio"].append(gap_sum / node[2].clamp_min(tiny))
        return {key: torch.cat(values).float().cpu() for key, values in out.items()}

    def layer_means(self) -> dict[str, torch.Tensor]:
        """Per row (``[m]``): the block's ``mloss`` Σ_parts Σ_t w‖g‖₂ / Σ_parts Σ_t w, ``mloss_normalized`` and
        ``mloss_ratio`` (Σ w‖g‖₂ / Σ w‖μ‖₂) over every routed (token, part) pair."""
        total = torch.stack([part.layer for part in self.parts]).sum(0)  # [4, m]
        mass, tiny = total[3].clamp_min(torch.finfo(torch.float64).tiny), torch.finfo(torch.float64).tiny
        return {"mloss": (total[0] / mass).cpu(), "mloss_normalized": (total[1] / mass).cpu(),
                "mloss_ratio": (total[0] / total[2].clamp_min(tiny)).cpu()}

    def part_rows(self, row: int = 0) -> list[dict[str, Any]]:
        """One dict per part for row ``row``: its label, node span in the block's node vector, routed tokens, weight
        mass Σ w, and its own layer M-Loss (``None`` where no token was routed to it: ``status`` says so)."""
        out, start = [], 0
        tiny = torch.finfo(torch.float64).tiny
        for label, nodes, part, tokens in zip(self.labels, self.nodes, self.parts, self.tokens[:, row]):
            layer = part.layer[:, row]
            routed = bool(layer[3] > 0)
            out.append({
                "part": label, "nodes": [start, start + nodes], "tokens": int(tokens), "weight": float(layer[3]),
                "status": "scored" if routed else "no token routed to it",
                "mloss": float(layer[0] / layer[3]) if routed else None,
                "mloss_normalized": float(layer[1] / layer[3]) if routed else None,
                "mloss_ratio": float(layer[0] / layer[2].clamp_min(tiny)) if routed else None})
            start += nodes
        return out

    def subset_scores(self) -> dict[str, Any]:
        """:func:`hf_mloss.engine.compatibility.subset_scores` of every row: the block's metrics, ``positions``
        and, with per-node sums, ``node`` (``[m, nodes]``, NaN for unrouted parts) and ``node_mloss`` (their mean
        over the routed nodes)."""
        out: dict[str, Any] = {**self.layer_means(), "positions": self.positions}
        if self.per_node:
            node = torch.stack([self.node_means(row)["node"] for row in range(self.tokens.shape[1])])
            out.update(node_mloss=node.double().nanmean(1), node=node)
        return out


class ExpertTarget:
    """The q sources' rows of one MoE block's parts and the weighted kernel over them, for a shared prefix: the
    router of ``block`` (the prefix model's) decides which positions reach each part and with what weight."""

    def __init__(self, adapter: Any, layer: int, block: nn.Module, sources: Sequence[Any], *, mix: torch.Tensor,
                 activation: Callable, reduction: str = "abs", eps: float = 1e-4, device: Any = "cpu",
                 compute_dtype: torch.dtype = torch.float32) -> None:
        self.adapter, self.block, self.parts = adapter, block, adapter.parts(layer)
        self.q, self.mix, self.activation = len(sources), mix.reshape(-1, len(sources)), activation
        self.reduction, self.eps, self.device, self.dtype = reduction, eps, device, compute_dtype
        prefix = adapter.layer_prefix(layer)
        # per part [q·nodes, H] gate rows and up rows, source p's at p·nodes: filled one source at a time, so a fused
        # [E, 2I, H] tensor is read once per source and only one source's float32 copy is held besides the stacks
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index, store in enumerate(sources):
            cache: dict[str, torch.Tensor] = {}

            def read(name: str, path: str) -> torch.Tensor:
                key = f"{prefix}{path}.{name}"
                if key not in cache:
                    cache[key] = store.get_float(key, device)
                return cache[key]

            for j, part in enumerate(self.parts):
                gate, up = part.rows(lambda name, path=part.path: read(name, path))
                if index == 0:
                    self.rows.append(tuple(torch.empty(self.q * part.nodes, t.shape[-1], dtype=compute_dtype,
                                                       device=device) for t in (gate, up)))
                span = slice(index * part.nodes, (index + 1) * part.nodes)
                self.rows[j][0][span].copy_(gate)
                self.rows[j][1][span].copy_(up)
            del cache

    def sums(self, u: torch.Tensor, *, mask: torch.Tensor | None = None, per_node: bool = True,
             merged: Callable[[Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None) -> ExpertSums:
        """The :class:`ExpertSums` of the positions of ``u`` (``[..., H]``) where ``mask`` is True. ``merged``:
        ``(part, rows) -> (gate, up)`` pre-activations of the merge's own part where the merge is not A·h (a
        candidate merge, one row of A)."""
        out = ExpertSums.for_parts(self.parts, self.mix.shape[0], reduction=self.reduction, eps=self.eps,
                                   per_node=per_node, device=u.device)
        flat = u.reshape(-1, u.shape[-1])
        keep = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device) if mask is None else \
            mask.reshape(-1).to(flat.device)
        weights = self.adapter.part_weights(self.block, flat)
        out.positions += keep.sum()
        for j, (part, (gate_rows, up_rows)) in enumerate(zip(self.parts, self.rows)):
            routed = (keep & (weights[:, j] > 0)).nonzero().flatten()
            out.tokens[j] += routed.numel()
            step = max(1, PIECE_ELEMENTS // (2 * self.q * part.nodes))
            for piece in routed.split(step):
                rows = flat[piece].to(self.dtype)
                gate = nn.functional.linear(rows, gate_rows).float().view(-1, self.q, part.nodes)
                up = nn.functional.linear(rows, up_rows).float().view(-1, self.q, part.nodes)
                mine = [None, None]
                if merged is not None:
                    mine = [t.float()[:, None] for t in merged(part, rows)]
                out.parts[j].add_weighted(gate, self.mix, self.activation, weights[piece, j:j + 1].expand(-1, len(
                    self.mix)), up=up, merged=mine[0], merged_up=mine[1])
        return out


def module_reader(block: nn.Module, path: str) -> Callable[[str], torch.Tensor]:
    """A part's tensors read from a block's own parameters (no copy)."""
    module = block.get_submodule(path)
    return lambda name: module.get_parameter(name)


@torch.inference_mode()
def own_expert_walk(setup: Any, scored: Sequence[int], mix: torch.Tensor, done: Callable[[int, ExpertSums], None],
                    *, per_node: bool = True, progress: Any = None) -> None:
    """Walk the blocks once with every source's own forward (as :func:`hf_mloss.engine.walk.own_walk`); at each
    scored block every source's own router weighs its own input, merge r weights position t by Σ_p A_rp w_pt
    (``mix``: A, ``[m, q]``), and ``done(layer, sums)`` gets the block's :class:`ExpertSums`."""
    from .walk import BatchState, BlockArena, own_block_copies

    adapter, scored = setup.adapter, set(scored)
    if not scored:
        return
    states = _own_embeddings(setup)
    blocks = adapter.layers(setup.model)
    last, q = max(scored), len(setup.sources)
    arenas = [BlockArena() for _ in setup.sources]
    mix = mix.reshape(-1, q).to(setup.device)
    for layer in range(last + 1):
        copies = own_block_copies(setup, blocks, layer, arenas)
        parts = adapter.parts(layer) if layer in scored else []
        rows = [[part.rows(module_reader(block, part.path)) for part in parts] for block in copies]
        acc = ExpertSums.for_parts(parts, mix.shape[0], reduction=setup.reduction, eps=setup.eps,
                                   per_node=per_node, device=setup.device) if parts else None
        for b in range(len(setup.batches)):
            inputs, weights = [], []
            for p, block in enumerate(copies):
                state = states[p][b]
                with setup.autocast():
                    residual, u = adapter.forward_to_target(block, state.hidden, state.context)
                    if acc is not None:
                        flat = u.reshape(-1, u.shape[-1])
                        inputs.append(flat)
                        weights.append(adapter.part_weights(block, flat))
                    if layer < last:
                        states[p][b] = BatchState(adapter.forward_from_target(block, residual, u, state.context),
                                                  state.context)
            if acc is not None:
                mask = states[0][b].context.mask
                _add_own_batch(acc, parts, rows, inputs, torch.stack(weights), mask, mix, setup)
        if acc is not None:
            done(layer, acc)
        if progress is not None:
            progress.update(1)
        del copies, rows


def _add_own_batch(acc: ExpertSums, parts: Sequence[Any], rows: Sequence[Sequence[tuple[torch.Tensor, ...]]],
                   inputs: Sequence[torch.Tensor], weights: torch.Tensor, mask: torch.Tensor | None,
                   mix: torch.Tensor, setup: Any) -> None:
    """Add one batch of the own walk: ``inputs`` each source's MLP input ``[positions, H]``, ``weights`` their
    own part weights ``[q, positions, parts]``."""
    positions = inputs[0].shape[0]
    keep = torch.ones(positions, dtype=torch.bool, device=weights.device) if mask is None else \
        mask.reshape(-1).to(weights.device)
    acc.positions += keep.sum()
    q = len(inputs)
    dtype = setup.compute_dtype
    for j, part in enumerate(parts):
        row_weights = torch.einsum("mq,qt->tm", mix.to(weights), weights[:, :, j])  # [positions, m]
        routed = (keep & (row_weights > 0).any(1)).nonzero().flatten()
        acc.tokens[j] += (row_weights[routed] > 0).sum(0)
        step = max(1, PIECE_ELEMENTS // (2 * q * part.nodes))
        for piece in routed.split(step):
            gate = torch.empty(piece.numel(), q, part.nodes, device=weights.device)
            up = torch.empty_like(gate)
            for p in range(q):
                x = inputs[p][piece].to(dtype)
                gate_rows, up_rows = rows[p][j]
                gate[:, p] = nn.functional.linear(x, gate_rows.to(dtype))
                up[:, p] = nn.functional.linear(x, up_rows.to(dtype))
            acc.parts[j].add_weighted(gate, mix, setup.activation, row_weights[piece], up=up)
