"""The M-Loss gap kernel: every gap of one scored unit, for any number of merges at once, in one fused pass.

For q sources the pre-activations of a unit at some positions are stacked as ``h`` of shape ``[positions, q, nodes]``
(gated units: also ``up``, the pre-activations of the linear the activation multiplies). A mixing matrix ``A``
(``[m, q]``, one row per merge being scored: the normalised weights for :func:`hf_mloss.score`, every subset for the
compatibility report) gives, per row r (SPEC §1, §1b):

* element-wise units: g_r = σ(A_r·h) − A_r·σ(h)
* gated units:        g_r = f(A_r·a)·(A_r·b) − A_r·(f(a)·b)   (a = gate, b = up)

and the merged activation μ_r = σ(A_r·h) (gated: f(A_r·a)·(A_r·b)). :class:`GapSums` keeps their running sums: per
row and node Σ|g| or Σg², Σ|g|/(|μ|+ε), Σ|μ| (and Σ|g| for ``sq``), per row Σ‖g‖₂, Σ‖g‖₂/(‖μ‖₂+ε), Σ‖μ‖₂ and the
number of positions. Sums, not means, so batches and processes add up exactly (:func:`reduce_sums`).

Speed: the activation is folded (σ(x) = f(s·x)/s, f in place: :func:`inplace_activation`), positions come in blocks
that stay in cache (:func:`block_shape`), and for a shared prefix the q pre-activations of a block of nodes come from
ONE GEMM with the q sources' stacked rows (:class:`StackedTarget`). Padding positions (a ``mask``) never enter a sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["GapSums", "StackedTarget", "block_shape", "gap_block", "inplace_activation", "node_gap", "reduce_sums",
           "several_processes", "unit_gap"]

BLOCK_ELEMENTS = 1 << 21
"""Pre-activation values per block of positions on a CPU when ``h`` is given whole (8 MB of float32; measured on
[800, 8, 3072], quick_gelu, 2 threads: 0.09 s against 0.20-0.22 s for the whole batch at once; blocks of 2 MB had
more parallel regions and stalled when other processes shared the cores)."""
GEMM_BLOCK_ELEMENTS = 1 << 19
"""Pre-activation values per block on a CPU when a block is produced by the stacked GEMM (:class:`StackedTarget`):
1024 positions × q × (2^19 / (1024·q)) nodes, 2 MB that are reduced while in cache."""
GEMM_BLOCK_POSITIONS = 1024
STACKED_MAX_BYTES = 1 << 28
"""A scored unit whose q sources' float32 weights take more than this (256 MB: Qwen2.5-1.5B's gate and up rows of
more than 2 fine-tunes) is not stacked: :class:`StackedTarget` reads each block's rows from the sources as a batch
reaches it, so the scorer's memory stays one block of nodes whatever q is."""
ACCELERATOR_BLOCK_ELEMENTS = 1 << 24
"""On an accelerator: one block of nodes (all of them), positions in chunks of 64 MB of pre-activations."""
ROWS_BLOCK_ELEMENTS = 1 << 22
"""Gap values per chunk of the several-row path (m > 1 rows of A; 16 MB of float32). Measured on 2 threads against
chunks of 2^24: 0.16 against 0.22 s for 37 subsets of [8, 800, 3072] (quick_gelu), 0.41 against 0.51 s for 137,
0.26 against 0.44 s for 11 subsets of a gated [4, 1024, 8960] (silu); 2^21 was no faster."""


def block_shape(q: int, num_rows: int, num_nodes: int, device: torch.device | str, *, stacked_gemm: bool = False,
                rows_of_a: bool = False) -> tuple[int, int]:
    """The chunking rule: ``(positions, nodes)`` per kernel block for q sources and ``num_rows`` merges (rows of A).

    A block holds ``positions × max(q, m) × nodes`` values. On a CPU, pre-activations made by the stacked GEMM come
    in blocks of nodes (1024 positions), given ones in blocks of positions (all nodes: slicing nodes of a whole
    tensor would be strided); on an accelerator one block of nodes, positions in 64 MB chunks. The several-row
    GEMM path (``rows_of_a``) takes chunks of :data:`ROWS_BLOCK_ELEMENTS` gaps everywhere.
    """
    width = max(q, num_rows)
    if rows_of_a:
        return max(1, ROWS_BLOCK_ELEMENTS // (num_rows * num_nodes)), num_nodes
    if torch.device(device).type != "cpu":
        return max(1, ACCELERATOR_BLOCK_ELEMENTS // (width * num_nodes)), num_nodes
    if stacked_gemm:
        return GEMM_BLOCK_POSITIONS, max(1, GEMM_BLOCK_ELEMENTS // (width * GEMM_BLOCK_POSITIONS))
    return max(1, BLOCK_ELEMENTS // (width * num_nodes)), num_nodes


def node_gap(h: torch.Tensor, alpha: torch.Tensor, activation: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain definition, for checks: ``(g, merged)`` of pre-activations ``[positions, q, nodes]`` and weights
    ``[q]``, with ``merged = σ(Σ_p α_p h_p)`` and ``g = merged − Σ_p α_p σ(h_p)`` (``[positions, nodes]``)."""
    alpha = alpha.to(h)
    merged = activation(torch.matmul(alpha, h))
    return merged - torch.matmul(alpha, activation(h)), merged


def unit_gap(h: torch.Tensor, mix: torch.Tensor, activation: Callable, merged: torch.Tensor, *,
             up: torch.Tensor | None = None, merged_up: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gap_block`'s ``(g, μ)`` for one merge (a row ``mix`` ``[q]``) whose own pre-activations ``merged``
    (``[positions, nodes]``; gated: ``merged_up``) are not A·h, without in-place operations, so gradients flow into
    the merge (a learned merge's objective, :mod:`hf_mloss.engine.objectives`): g = σ(m) − Σ_p α_p σ(h_p) (gated:
    σ(m)·m_up − Σ_p α_p σ(h_p)·up_p), μ = σ(m) (gated: σ(m)·m_up); ``h``, ``up``: ``[positions, q, nodes]``."""
    mix = mix.to(h)
    mu = activation(merged)
    experts = activation(h)
    if up is not None:
        mu = mu * merged_up
        experts = experts * up
    return mu - torch.einsum("q,pqn->pn", mix, experts), mu


def inplace_activation(activation: Callable) -> tuple[float, Callable[[torch.Tensor], torch.Tensor]]:
    """``(s, f)`` with σ(x) = f(s·x)/s and ``f`` writing its result into its argument (and returning it).

    quick_gelu is x·sigmoid(1.702x) = silu(1.702x)/1.702: folding 1.702 into the pre-activations makes the q copies'
    activation one in-place pass instead of three (multiply, sigmoid, multiply, each on a fresh buffer; measured
    90 ms against 16 ms on a [170, 8, 3072] chunk). Activations without a fused in-place kernel get s = 1 and
    ``activation`` copied back into its input.
    """
    from transformers import activations as hf

    functional = nn.functional
    if isinstance(activation, hf.QuickGELUActivation):
        return 1.702, _silu_
    if isinstance(activation, (nn.SiLU, getattr(hf, "SiLUActivation", nn.SiLU))):
        return 1.0, _silu_
    if isinstance(activation, nn.ReLU):
        return 1.0, torch.relu_
    gelu = getattr(activation, "act", activation) if isinstance(activation, hf.GELUActivation) else activation
    if gelu is functional.gelu:
        return 1.0, torch.ops.aten.gelu_
    return 1.0, lambda x: x.copy_(activation(x))


def _silu_(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.silu(x, inplace=True)


def gap_block(h: torch.Tensor, mix: torch.Tensor, scale: float, f: Callable, *, up: torch.Tensor | None = None,
              merged: torch.Tensor | None = None, merged_up: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s·g, s·μ)`` of one block, both ``[positions, m, nodes]``; ``h`` (and ``up``) are overwritten.

    ``h``: ``[positions, q, nodes]`` float32 pre-activations; ``mix``: A, ``[m, q]``; σ(x) = f(s·x)/s with f in
    place (:func:`inplace_activation`). ``merged`` (``[positions, m, nodes]``): the merge's own pre-activations where
    they are not A·h (a candidate merge's own linear; gated: with ``merged_up``).
    """
    mix = mix.to(h)
    pre = torch.matmul(mix, h) if merged is None else merged.clone()
    if scale != 1.0:
        h.mul_(scale)
        pre.mul_(scale)
    mu = f(pre)
    if up is None:
        ensemble = torch.matmul(mix, f(h))
    else:
        mu.mul_(torch.matmul(mix, up) if merged_up is None else merged_up)
        ensemble = torch.matmul(mix, f(h).mul_(up))
    return ensemble.neg_().add_(mu), mu


def several_processes() -> bool:
    """Whether this process is one of several of a data-parallel run (accelerate's state, however launched)."""
    from accelerate import PartialState

    return PartialState().num_processes > 1


def reduce_sums(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The element-wise sum of ``tensors`` over every process of the run (accelerate), as new tensors of the same
    shapes; the tensors themselves in a single process. One collective for all of them."""
    from accelerate.utils import reduce

    if not several_processes():
        return list(tensors)
    packed = reduce(torch.cat([t.flatten() for t in tensors]), reduction="sum")
    out, start = [], 0
    for t in tensors:
        out.append(packed[start:start + t.numel()].view_as(t))
        start += t.numel()
    return out


class GapSums:
    """Running sums of the gaps of ``m`` merges (rows of A) at one scored unit of ``num_nodes`` nodes.

    ``node`` (``[4, m, nodes]``, float64; ``[4, m, 0]`` without ``per_node``): Σ|g| (``abs``) or Σg² (``sq``),
    Σ|g|/(|μ|+ε), Σ|μ|, and Σ|g| (kept apart only for ``sq``); the m > 1 path of :meth:`add_preactivations` fills
    the first row only. ``layer`` (``[4, m]``): Σ‖g‖₂, Σ‖g‖₂/(‖μ‖₂+ε), Σ‖μ‖₂ and the number of positions.
    """

    def __init__(self, num_rows: int, num_nodes: int, *, reduction: str = "abs", eps: float = 1e-4,
                 per_node: bool = True, device: Any = "cpu") -> None:
        self.reduction, self.eps = reduction, eps
        self.node = torch.zeros(4, num_rows, num_nodes if per_node else 0, dtype=torch.float64, device=device)
        self.layer = torch.zeros(4, num_rows, dtype=torch.float64, device=device)

    @property
    def num_rows(self) -> int:
        return self.layer.shape[1]

    @property
    def per_node(self) -> bool:
        return self.node.shape[2] > 0

    @property
    def count(self) -> torch.Tensor:
        return self.layer[3, 0]

    def empty(self) -> GapSums:
        """A zero accumulator of the same shape (the sums of one batch before they are added)."""
        return GapSums(self.num_rows, self.node.shape[2], reduction=self.reduction, eps=self.eps,
                       per_node=self.per_node, device=self.layer.device)

    def merge(self, other: GapSums) -> None:
        """Add the sums of ``other`` (another batch, or a worker's share)."""
        self.node += other.node
        self.layer += other.layer

    def reduce_across_processes(self) -> None:
        """Sum the running sums of every process (a no-op in a single process)."""
        self.node, self.layer = reduce_sums(self.node, self.layer)

    # ----------------------------------------------------------------------------------------------- the kernel
    def add_block(self, g: torch.Tensor, mu: torch.Tensor, nodes: slice, eps: float) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
        """Add the node sums of one block of (scaled) gaps ``g`` and merged activations ``mu`` (``[positions, m,
        b−a]``, nodes ``a:b``); returns the per-position Σg² and Σμ² over these nodes (``[positions, m]``). ``mu``
        is overwritten."""
        squares = g.square()
        if self.per_node:
            node = self.node[:, :, nodes]
            magnitude, mu_magnitude = g.abs(), mu.abs()
            if self.reduction == "abs":
                node[0] += magnitude.sum(0, dtype=torch.float64)
            else:
                node[0] += squares.sum(0, dtype=torch.float64)
                node[3] += magnitude.sum(0, dtype=torch.float64)
            node[2] += mu_magnitude.sum(0, dtype=torch.float64)
            node[1] += magnitude.div_(mu_magnitude.add_(eps)).sum(0, dtype=torch.float64)
        return squares.sum(-1), mu.square_().sum(-1)

    def add_positions(self, squares: torch.Tensor, mu_squares: torch.Tensor, eps: float) -> None:
        """Add the layer sums of some positions from their Σg² and Σμ² over every node (``[positions, m]``)."""
        norm, mu_norm = squares.sqrt(), mu_squares.sqrt()
        self.layer[0] += norm.sum(0, dtype=torch.float64)
        self.layer[1] += (norm / (mu_norm + eps)).sum(0, dtype=torch.float64)
        self.layer[2] += mu_norm.sum(0, dtype=torch.float64)
        self.layer[3] += norm.shape[0]

    def unscale(self, scale: float) -> None:
        """Sums of s·g and s·μ back to sums of g and μ, in place (the normalised sums are scale-free)."""
        if scale != 1.0:
            self.node[0] /= scale if self.reduction == "abs" else scale**2
            self.node[2:4] /= scale
            self.layer[0::2] /= scale

    def add_preactivations(self, h: torch.Tensor, mix: torch.Tensor, activation: Callable, *,
                           up: torch.Tensor | None = None, merged: torch.Tensor | None = None,
                           merged_up: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                           sources_first: bool = False) -> None:
        """Add the gaps of given pre-activations ``h`` (``[positions, q, nodes]``, or ``[q, positions, nodes]``
        with ``sources_first``; overwritten; gated: ``up`` too) for the rows of ``mix``; ``mask`` (``[positions]``
        bool): only the positions where it is True count.

        One row (``score``): blocks of positions on ``h`` as it lies (:func:`gap_block`). Several rows (every
        subset of the compatibility report): :meth:`_add_rows`, one GEMM per chunk on the sources-first layout.
        """
        spans = kept_spans(mask, h.shape[1] if sources_first else h.shape[0])
        if spans is None:  # a scattered mask: its positions copied out once
            keep = mask.reshape(-1).to(h.device)
            h, up, merged, merged_up = (None if t is None else t[:, keep] if sources_first else t[keep]
                                        for t in (h, up, merged, merged_up))
            spans = [(0, h.shape[1] if sources_first else h.shape[0])]
        scale, f = inplace_activation(activation)
        if mix.shape[0] > 1 and merged is None:
            self._add_rows(h if sources_first else h.transpose(0, 1),
                           mix, scale, f, None if up is None else up if sources_first else up.transpose(0, 1), spans)
            return
        if sources_first:
            h, up = h.transpose(0, 1), None if up is None else up.transpose(0, 1)
        q, n = h.shape[-2:]
        rows, _ = block_shape(q, mix.shape[0], n, h.device)
        batch, eps = self.empty(), self.eps * scale  # |s·g|/(|s·μ|+s·ε) = |g|/(|μ|+ε)
        every = slice(None)
        for first, last in spans:
            for start in range(first, last, rows):
                part = slice(start, min(start + rows, last))
                g, mu = gap_block(h[part], mix, scale, f, up=_part(up, part), merged=_part(merged, part),
                                  merged_up=_part(merged_up, part))
                batch.add_positions(*batch.add_block(g, mu, every, eps), eps=eps)
        batch.unscale(scale)
        self.merge(batch)

    def add_weighted(self, h: torch.Tensor, mix: torch.Tensor, activation: Callable, weights: torch.Tensor, *,
                     up: torch.Tensor | None = None, merged: torch.Tensor | None = None,
                     merged_up: torch.Tensor | None = None) -> None:
        """Add the gaps of pre-activations ``h`` (``[positions, q, nodes]``; overwritten; gated: ``up``) for the
        rows of ``mix``, position t of row r weighted by ``weights[t, r]`` (``[positions, m]``, ≥ 0): every sum is
        Σ_t w·(its term), and the count Σ_t w, so the means are weighted means (an MoE expert's tokens weighted by
        their routing weights, :mod:`hf_mloss.engine.experts`). Only the given positions count: no mask."""
        scale, f = inplace_activation(activation)
        q, n = h.shape[-2:]
        rows, _ = block_shape(q, mix.shape[0], n, h.device)
        batch, eps = self.empty(), self.eps * scale
        for start in range(0, h.shape[0], rows):
            part = slice(start, min(start + rows, h.shape[0]))
            g, mu = gap_block(h[part], mix, scale, f, up=_part(up, part), merged=_part(merged, part),
                              merged_up=_part(merged_up, part))
            batch._add_weighted_block(g, mu, weights[part].to(g), eps)
        batch.unscale(scale)
        self.merge(batch)

    def _add_weighted_block(self, g: torch.Tensor, mu: torch.Tensor, w: torch.Tensor, eps: float) -> None:
        """:meth:`add_block` and :meth:`add_positions` of one block of (scaled) gaps ``g`` and merged activations
        ``mu`` (``[positions, m, nodes]``) with position weights ``w`` (``[positions, m]``)."""
        norm, mu_norm = g.square().sum(-1).sqrt_(), mu.square().sum(-1).sqrt_()
        if self.per_node:
            node, wide = self.node, w.unsqueeze(-1)
            magnitude, mu_magnitude = g.abs(), mu.abs_()
            if self.reduction == "abs":
                node[0] += (magnitude * wide).sum(0, dtype=torch.float64)
            else:
                node[0] += (g.square() * wide).sum(0, dtype=torch.float64)
                node[3] += (magnitude * wide).sum(0, dtype=torch.float64)
            node[2] += (mu_magnitude * wide).sum(0, dtype=torch.float64)
            node[1] += (magnitude.div_(mu_magnitude.add_(eps)).mul_(wide)).sum(0, dtype=torch.float64)
        self.layer[0] += (norm * w).sum(0, dtype=torch.float64)
        self.layer[1] += (norm / (mu_norm + eps) * w).sum(0, dtype=torch.float64)
        self.layer[2] += (mu_norm * w).sum(0, dtype=torch.float64)
        self.layer[3] += w.sum(0, dtype=torch.float64)

    def _add_rows(self, h: torch.Tensor, mix: torch.Tensor, scale: float, f: Callable,
                  up: torch.Tensor | None, spans: Sequence[tuple[int, int]]) -> None:
        """:meth:`add_preactivations` for m > 1 rows of A (``h``: ``[q, positions, nodes]``, overwritten): with H
        the ``[q, positions·nodes]`` layout of a chunk, one GEMM writes s·A·H into a reused buffer, f runs in place
        on it, then f runs in place on the chunk of H itself (f(s·H) computed once for all rows) and one more GEMM
        with β = 1 subtracts A·f(s·H). Node sums: only Σ|g| / Σg² (``node[0]``).

        Nothing of the size of ``h`` is allocated here (beyond making a strided ``h`` contiguous): f(s·H) overwrites
        each chunk once its A·H is taken, and the chunks' products go into two buffers of
        :data:`ROWS_BLOCK_ELEMENTS`. A fresh copy of ``h`` per batch (the
        earlier layout) stalled for seconds in the kernel's page faults while the page cache filled the memory."""
        q, n = h.shape[0], h.shape[2]
        h = h.contiguous()  # [q, positions, nodes]
        if up is not None:
            up = up.contiguous()
        mix = mix.to(h)
        m = mix.shape[0]
        step, _ = block_shape(q, m, n, h.device, rows_of_a=True)
        longest = max((last - first for first, last in spans), default=0)
        buffer = torch.empty(m, min(step, longest) * n, device=h.device)
        mixed_up = torch.empty_like(buffer) if up is not None else None
        eps = self.eps * scale
        chunks = [(start, min(start + step, last)) for first, last in spans for start in range(first, last, step)]
        for start, stop in chunks:
            flat = h[:, start:stop].reshape(q, -1)  # a view: rows of one source are contiguous
            if scale != 1.0:
                flat.mul_(scale)
            count = flat.shape[1] // n
            gap = f(torch.mm(mix, flat, out=buffer[:, : count * n]))  # s·σ(A·h), in place
            activated = f(flat)  # f(s·h) of every source, in place: A·h above was its last read
            if up is not None:
                up_flat = up[:, start:stop].reshape(q, -1)
                gap.mul_(torch.mm(mix, up_flat, out=mixed_up[:, : count * n]))
                activated.mul_(up_flat)
            mu_norm = torch.linalg.vector_norm(gap.view(m, count, n), dim=-1)
            gap.addmm_(mix, activated, alpha=-1)  # − s·A·σ(h)
            norm = torch.linalg.vector_norm(gap.view(m, count, n), dim=-1)  # [rows of A, positions]
            self.layer[0] += norm.sum(1, dtype=torch.float64) / scale
            self.layer[1] += (norm / (mu_norm + eps)).sum(1, dtype=torch.float64)
            self.layer[2] += mu_norm.sum(1, dtype=torch.float64) / scale
            if self.per_node:
                gap = gap.abs_() if self.reduction == "abs" else gap.square_()
                self.node[0] += gap.view(m, count, n).sum(1, dtype=torch.float64) / (
                    scale if self.reduction == "abs" else scale**2)
        self.layer[3] += sum(last - first for first, last in spans)


MAX_MASK_SPANS = 256
"""A mask with more runs of kept positions than this is applied by copying the kept positions out (one copy of the
pre-activations) instead of walking its runs as views (one small GEMM per run)."""


def kept_spans(mask: torch.Tensor | None, positions: int) -> list[tuple[int, int]] | None:
    """The runs of True in ``mask`` (``[positions]`` bool; ``None``: every position) as ``(start, stop)`` pairs, or
    ``None`` when there are more than :data:`MAX_MASK_SPANS` of them. Padded batches have one run per sequence, and
    walking the runs costs no copy: indexing with the mask copied a ``[q, positions, nodes]`` tensor (0.15-0.2 s
    for 4 × 2048 × 8960), a tenth of the own walk's time on a Qwen2.5-1.5B-shaped decoder with every position kept."""
    if mask is None:
        return [(0, positions)]
    keep = mask.reshape(-1).to("cpu", torch.int8)
    edges = torch.diff(keep, prepend=keep.new_zeros(1), append=keep.new_zeros(1))
    starts, stops = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
    if len(starts) > MAX_MASK_SPANS:
        return None
    return list(zip(starts.tolist(), stops.tolist()))


def _part(t: torch.Tensor | None, part: slice) -> torch.Tensor | None:
    return None if t is None else t[part]


class StackedTarget:
    """The q sources' weights of one scored unit, in node blocks, and the fused kernel over them.

    For u of some positions, block j holds nodes [a, b) of every source (gated units: the gate rows, then the up
    rows): ONE GEMM gives the ``[positions, q, b−a]`` pre-activations, reduced by :func:`gap_block` while they are
    in cache; only per-node and per-position sums leave a block. On ViT-B/32 × 8 fc1 (800 positions, 1 thread) this
    took 246 ms against 428-478 ms for the whole-layer GEMM followed by a plain accumulation. A unit whose stacked
    weights would pass :data:`STACKED_MAX_BYTES` keeps none: each block's rows are read from the sources when a
    batch reaches it (the same values, so the same sums), and the scorer's peak does not grow with q.
    """

    def __init__(self, sources: Sequence[Any], gate: str, *, mix: torch.Tensor, activation: Callable,
                 up: str | None = None, reduction: str = "abs", eps: float = 1e-4, device: Any = "cpu",
                 compute_dtype: torch.dtype = torch.float32, fused: bool = False, transposed: bool = False) -> None:
        """``gate`` / ``up``: the unit's linears (module names); ``fused``: ``gate`` holds both halves of a gated
        unit; ``transposed``: weights stored ``[in, out]`` (see :class:`~hf_mloss.adapters.ScoredUnit`)."""
        self.q, self.mix, self.reduction, self.eps = len(sources), mix.reshape(-1, len(sources)), reduction, eps
        self.gated, self.device = up is not None or fused, device
        self.scale, self.activation = inplace_activation(activation)

        def read(store: Any, name: str) -> list[torch.Tensor | None]:
            if name not in store:
                return [None, None] if fused else [None]
            tensor = store.get_float(name, device)
            if transposed and tensor.dim() == 2:
                tensor = tensor.T.contiguous()
            return list(tensor.chunk(2, dim=0)) if fused else [tensor]

        names = [gate] if up is None else [gate, up]
        raw = [list(b) for b in zip(*[[part for name in names for part in read(s, f"{name}.bias")]
                                      for s in sources])]
        has_bias = [bs[0] is not None for bs in raw]
        shape = sources[0].shapes[f"{gate}.weight"]
        self.num_nodes = (shape[1] if transposed else shape[0]) // (2 if fused else 1)
        biases = [[b if b is not None else torch.zeros(self.num_nodes, device=device) for b in bs] for bs in raw]
        self.rows, nodes = block_shape(self.q, self.mix.shape[0], self.num_nodes, device, stacked_gemm=True)
        self.blocks = [(a, min(a + nodes, self.num_nodes)) for a in range(0, self.num_nodes, nodes)]
        self.bias: list[torch.Tensor | None] = [torch.cat([c[a:b] for cs in biases for c in cs]).to(compute_dtype)
                                                if any(has_bias) else None for a, b in self.blocks]
        self.compute_dtype = compute_dtype
        stacked_bytes = len(sources) * len(names) * self.num_nodes * shape[1 - transposed] * 4
        # Large units of many sources are read a block of nodes at a time (the rows a..b of each source), so what
        # the target holds does not grow with q; small ones are stacked once and reused by every batch.
        self._reads: list[tuple[Any, str, int]] | None = None
        self.weight: list[torch.Tensor] = []
        if stacked_bytes > STACKED_MAX_BYTES and not transposed and all(s.reads_rows for s in sources):
            self._reads = [(s, f"{name}.weight", half * self.num_nodes) for name in names
                           for half in range(2 if fused else 1) for s in sources]  # the stacked blocks' order
            return
        weights = [list(w) for w in zip(*[[part for name in names for part in read(s, f"{name}.weight")]
                                          for s in sources])]
        # [q·(b−a), d] per block: source p's rows a..b at p·(b−a) (then the up rows)
        self.weight = [torch.cat([w[a:b] for ws in weights for w in ws]).to(compute_dtype) for a, b in self.blocks]

    @property
    def streams_weights(self) -> bool:
        """Whether the sources' rows are read per block of nodes (large units) instead of held stacked."""
        return self._reads is not None

    def _block_weight(self, index: int) -> torch.Tensor:
        """Block ``index``'s ``[q·(b−a), d]`` weights: the stacked copy, or the rows read from the sources now."""
        if self._reads is None:
            return self.weight[index]
        a, b = self.blocks[index]
        return torch.cat([store.get_rows(name, offset + a, offset + b).to(self.device, torch.float32)
                          for store, name, offset in self._reads]).to(self.compute_dtype)

    def sums(self, u: torch.Tensor, *, mask: torch.Tensor | None = None, per_node: bool = True,
             merged: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None = None
             ) -> GapSums:
        """The :class:`GapSums` of the positions of ``u`` (``[..., d]``) where ``mask`` (``[...]``) is True.

        ``merged``: the merge's own unit (u → its pre-activations ``[positions, nodes]``; gated: (gate, up)) where
        the merge is not A·h (a candidate merge, one row of A).
        """
        out = GapSums(self.mix.shape[0], self.num_nodes, reduction=self.reduction, eps=self.eps, per_node=per_node,
                      device=u.device)
        flat = u.reshape(-1, u.shape[-1])
        if mask is not None:
            flat = flat[mask.reshape(-1).to(flat.device)]
        eps = self.eps * self.scale  # gaps come scaled by s: |g|/(|σ|+ε) = |s·g|/(|s·σ|+s·ε)
        parts = 2 if self.gated else 1
        for rows in flat.split(self.rows):
            rows = rows.to(self.compute_dtype)
            own = _as_tuple(merged(rows)) if merged is not None else None
            squares: list[torch.Tensor] = []
            for index, ((a, b), bias) in enumerate(zip(self.blocks, self.bias)):
                weight = self._block_weight(index)
                h = nn.functional.linear(rows, weight, bias).float().view(rows.shape[0], parts, self.q, b - a)
                mine = [t[:, None, a:b].float() for t in own] if own is not None else [None, None]
                g, mu = gap_block(h[:, 0], self.mix, self.scale, self.activation,
                                  up=h[:, 1] if self.gated else None, merged=mine[0], merged_up=mine[-1])
                part = out.add_block(g, mu, slice(a, b), eps)
                # the per-position sums of the node blocks add up in float64
                squares = [p.double() for p in part] if not squares else [s + p for s, p in zip(squares, part)]
            out.add_positions(*squares, eps=eps)
        out.unscale(self.scale)
        return out


def _as_tuple(value: Any) -> tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
