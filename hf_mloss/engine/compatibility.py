"""Mergeability without labels: the pairwise M-Loss matrix of q candidate fine-tunes, leave-one-out and any subset.

Every model runs ONE forward over the unlabeled images, block by block, carrying its own hidden states (the ``own``
prefix, the paper's definition). At each scored linear the q pre-activations ``h`` of a batch are stacked as
``[positions, q, n]``, and every scored subset S (all pairs, the sets without one model, the whole set, any subsets
asked for) is one row of a matrix A with A[S, p] = α_p / Σ_{p'∈S} α_{p'} for p ∈ S (0 elsewhere), so that

    g_S = σ(A_S · h) − A_S · σ(h)

is the gap of subset S with its weights normalised over S (uniform by default; user weights α give α_i/(α_i+α_j)
for a pair): the gap kernel (:mod:`hf_mloss.engine.kernel`) with A as its mixing matrix, every subset in one pass. Subset
S's numbers equal a direct :func:`hf_mloss.score` of the models of S (``prefix="own"``).

Cost per model: one forward over the images, as ``score(prefix="own")``; memory: the q models' hidden states, q
copies of ONE block and one kernel block of gaps (:func:`hf_mloss.engine.kernel.block_shape`), never q² forwards. The subsets add
elementwise work ∝ (number of subsets) × positions × nodes per scored layer: for ViT-B/32 with q = 8 (37 subsets)
see ``benchmarks/results/merge_speed_new_workloads_cpu.md`` (the report against one ``score(prefix="own")``).

Label-free baselines beside it, streamed one tensor at a time over the task vectors τ_p = θ_p − θ₀: cosine and
distance between task vectors, their norms, and the TIES sign-conflict fraction (entries kept by both trimmed task
vectors whose signs differ); optionally the output-level gap between each subset's average merge and the ensemble
of its members' outputs (pooled features of encoders, next-token distributions of causal LMs; one extra forward per
scored subset).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..spec.config import MergeConfig
from ..errors import DataError, InvalidParameterError
from ..spec.options import ScoringOptions
from ..output.report import describe_data

if TYPE_CHECKING:
    from ..loading.inputs import RunInputs
    from .score import ScoringSetup

__all__ = ["BASELINES", "METRICS", "CompatibilityReport", "run_compatibility"]

METRICS = ("mloss", "mloss_normalized", "mloss_ratio")
"""Per-layer M-Loss summaries of a subset (averaged over the scored layers for its overall score): mean over
positions of ‖g‖₂, of ‖g‖₂ / (‖σ(Σαh)‖₂ + ε), and the ratio of sums Σ‖g‖₂ / Σ‖σ(Σαh)‖₂. With ``per_node`` also
``node_mloss`` (node M-Loss averaged over nodes)."""
BASELINES = ("tv_cosine", "tv_distance", "tv_norm", "sign_conflict", "output_gap")
"""Label-free baselines: mean pairwise cosine / distance of the members' task vectors, the sum of their norms, the
TIES sign-conflict fraction, and the output-level merge-vs-ensemble gap (only with ``output_gap=True``)."""
HIGHER_IS_BETTER = {"tv_cosine"}
"""Metrics where a higher value means more compatible (all others: lower is better)."""
REPORT_JSON, REPORT_MARKDOWN, HEATMAP_NAME = "compatibility.json", "compatibility.md", "compatibility_heatmap.png"


# ------------------------------------------------------------------------------------------------- subsets
def standard_subsets(q: int, extra: Sequence[Sequence[int]] = (), *, leave_one_out: bool = True
                     ) -> list[tuple[int, ...]]:
    """All pairs, then the sets without one model (q ≥ 3), the whole set, then ``extra``; duplicates dropped."""
    subsets = list(itertools.combinations(range(q), 2))
    if leave_one_out and q >= 3:
        subsets += [tuple(p for p in range(q) if p != i) for i in range(q)]
    subsets.append(tuple(range(q)))
    subsets += [tuple(sorted(s)) for s in extra]
    return list(dict.fromkeys(subsets))


def parse_subsets(subsets: Sequence[Sequence[int | str]] | None, names: Sequence[str],
                  aliases: dict[str, int] | None = None) -> list[tuple[int, ...]]:
    """Subsets given as model indices or names (the reported ``names``, or ``aliases`` such as the paths as
    passed), checked."""
    lookup = {**(aliases or {}), **{n: i for i, n in enumerate(names) if list(names).count(n) == 1}}
    out = []
    for i, subset in enumerate(subsets or ()):
        if isinstance(subset, (str, bytes)) or not isinstance(subset, Sequence):
            raise InvalidParameterError(f"subsets[{i}] must be a list of model indices or names, got {subset!r}.")
        members = []
        for member in subset:
            if isinstance(member, str):
                if member not in lookup:
                    raise InvalidParameterError(f"subsets[{i}] names {member!r}, which is not one of the models "
                                                f"{list(names)}; use a name from that list or an index.")
                member = lookup[member]
            if isinstance(member, bool) or not isinstance(member, int) or not 0 <= member < len(names):
                raise InvalidParameterError(f"subsets[{i}] holds {member!r}; model indices run from 0 to "
                                            f"{len(names) - 1}.")
            members.append(member)
        if len(set(members)) < 2:
            raise InvalidParameterError(f"subsets[{i}] = {list(subset)} has fewer than 2 distinct models; a merge "
                                        "needs at least 2.")
        out.append(tuple(sorted(set(members))))
    return out


def subset_matrix(subsets: Sequence[tuple[int, ...]], weights: torch.Tensor) -> torch.Tensor:
    """``[len(subsets), q]``: row S holds α_p / Σ_{p'∈S} α_{p'} for p ∈ S and 0 elsewhere."""
    matrix = torch.zeros(len(subsets), len(weights), dtype=torch.float64)
    for row, subset in enumerate(subsets):
        index = list(subset)
        matrix[row, index] = weights[index].double() / weights[index].double().sum()
    return matrix.float()


# ----------------------------------------------------------------------------------------------- M-Loss
def subset_scores(sums: Any) -> dict[str, torch.Tensor]:
    """Per subset (row of the :class:`~hf_mloss.engine.kernel.GapSums`): the :data:`METRICS`, with per-node sums also
    ``node_mloss`` and ``node`` (``[subsets, nodes]``), and ``positions``."""
    count = sums.layer[3].clamp_min(1)  # per subset: with models' own data each counts its members' samples
    tiny = torch.finfo(torch.float64).tiny
    layer = sums.layer
    out = {"mloss": (layer[0] / count).cpu(), "mloss_normalized": (layer[1] / count).cpu(),
           "mloss_ratio": (layer[0] / layer[2].clamp_min(tiny)).cpu(), "positions": sums.layer[3].max()}
    if sums.per_node:
        node = sums.node[0] / count[:, None]
        out.update(node_mloss=node.mean(1).cpu(), node=node.float().cpu())
    return out


def subset_reach(owner: torch.Tensor | None, subsets: Sequence[tuple[int, ...]], num_models: int
                 ) -> torch.Tensor | None:
    """With models' own data (``owner``, :attr:`~hf_mloss.loading.inputs.RunInputs.sample_owner`): ``[subsets,
    samples]`` bool, the samples each subset is scored on: its members' own data, and the shared pool when a member
    has none (the union of its members' data); ``None`` when every model reads every sample."""
    from ..loading.model_inputs import SHARED

    if owner is None:
        return None
    own = set(owner.unique().tolist()) - {SHARED}
    reach = torch.zeros(len(subsets), len(owner), dtype=torch.bool)
    for row, subset in enumerate(subsets):
        members = torch.tensor(list(subset))
        reach[row] = torch.isin(owner, members)
        if any(p not in own for p in subset):
            reach[row] |= owner == SHARED
    return reach


def subset_mloss(setup: ScoringSetup, subsets: Sequence[tuple[int, ...]], weights: torch.Tensor, *,
                 per_node: bool = False, progress: bool = True, reach: torch.Tensor | None = None) -> dict[str, Any]:
    """M-Loss of every subset at every scored layer from one own-prefix walk.

    Returns ``{metric: [subsets, layers] tensor}`` for :data:`METRICS` (and ``"node"``: per layer a
    ``[subsets, nodes]`` tensor when ``per_node``), plus ``"layers"`` (the scored linears) and ``"positions"``.
    ``reach`` (:func:`subset_reach`): each subset scored on its members' data only; the subsets that reach the same
    samples of a batch share one kernel pass.
    """
    from tqdm.auto import tqdm

    from .experts import ExpertSums, own_expert_walk
    from .kernel import GapSums
    from .walk import UnitInputs, own_walk

    matrix = subset_matrix(subsets, weights).to(setup.device)
    current: dict[int, GapSums] = {}
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    layers = setup.scored_layers()
    bar = tqdm(total=len(layers), desc=f"M-Loss of {len(subsets)} subsets (own prefix)", unit="layer",
               disable=not progress)

    shares = _batch_reach(reach, setup) if reach is not None else None

    def visit(layer: int, inputs: UnitInputs) -> None:
        if layer not in current:
            current[layer] = GapSums(len(subsets), inputs.num_nodes, reduction=setup.reduction, eps=setup.eps,
                                     per_node=per_node, device=setup.device)
        gate, up = inputs.stacked(sources_first=True)
        if shares is None:
            current[layer].add_preactivations(gate, matrix, setup.activation, up=up, mask=inputs.mask,
                                              sources_first=True)
            return
        rows_of = shares[inputs.batch]  # [subsets, samples of this batch]
        per_sample = gate.shape[1] // rows_of.shape[1]
        patterns, which = rows_of.unique(dim=0, return_inverse=True)
        for k, pattern in enumerate(patterns):
            rows = (which == k).nonzero().flatten()
            keep = pattern.repeat_interleave(per_sample).to(gate.device)
            if inputs.mask is not None:
                keep = keep & inputs.mask.to(gate.device)
            if not bool(keep.any()):
                continue
            part = GapSums(len(rows), inputs.num_nodes, reduction=setup.reduction, eps=setup.eps,
                           per_node=per_node, device=setup.device)
            part.add_preactivations(gate.clone(), matrix[rows.to(matrix.device)], setup.activation,
                                    up=None if up is None else up.clone(), mask=keep, sources_first=True)
            current[layer].node[:, rows] += part.node
            current[layer].layer[:, rows] += part.layer

    def done(layer: int) -> None:
        acc = current.pop(layer)
        acc.reduce_across_processes()
        per_layer[layer] = acc.subset_scores() if isinstance(acc, ExpertSums) else subset_scores(acc)
        bar.update(1)

    if getattr(setup.adapter, "experts", False):  # MoE blocks: per expert, weighted by each subset's routing
        if reach is not None:
            from ..errors import UnsupportedModelError

            raise UnsupportedModelError("A compatibility report of a mixture-of-experts model scores every subset on "
                                        "one set of samples; with models' own data each subset reads its members' "
                                        "data, which the expert walk does not do yet: give one shared `data`.")

        def block_done(layer: int, sums: ExpertSums) -> None:
            current[layer] = sums
            done(layer)

        own_expert_walk(setup, layers, matrix, block_done, per_node=per_node)
    else:
        own_walk(setup, layers, visit, done)
    bar.close()
    metrics = [*METRICS, "node_mloss"] if per_node else list(METRICS)
    out: dict[str, Any] = {m: torch.stack([per_layer[layer][m] for layer in layers], dim=1) for m in metrics}
    out["metrics"] = metrics
    out["layers"] = [setup.adapter.target_name(layer) for layer in layers]
    out["positions"] = int(per_layer[layers[0]]["positions"])
    if per_node:
        out["node"] = {setup.adapter.target_name(layer): per_layer[layer]["node"] for layer in layers}
    return out


def _batch_reach(reach: torch.Tensor, setup: ScoringSetup) -> list[torch.Tensor]:
    """:func:`subset_reach` cut as the setup's batches cut the samples (this process's share, in batches)."""
    from accelerate import PartialState

    state = PartialState()
    index = torch.arange(reach.shape[1])[state.process_index::state.num_processes]
    sizes = [len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch) for batch in setup.batches]
    return [reach[:, part] for part in index.split(sizes)]


# ------------------------------------------------------------------------------------------------ baselines
STREAM_MIN_NUMEL = 1 << 26
"""A tensor whose q task vectors hold at least this many entries in all is read in row pieces for the baselines
(an LLM's embedding: q float32 copies and their masks would otherwise be the run's peak). Below it a tensor is read
once, whole, into one buffer reused from tensor to tensor (256 MB at most): a streamed tensor is read three times (a
sample, the thresholds' bracket, the statistics)."""
STREAM_PIECE_NUMEL = 1 << 22
"""Entries of one such piece per task vector: 16 MB of float32."""
PAIR_CHUNK_BYTES = 1 << 24
"""The trim masks and signs are made for this many bytes of task vectors at a time (all q together): temporaries
small enough for the allocator to reuse instead of mapping fresh pages for each (page faults were a third of the
baselines' time with whole-tensor masks)."""
GRAM_CHUNK_NUMEL = 1 << 16
"""Entries per task each float32 Gram product sums before the sums are added in float64. One product over a whole
4 × 13.8 M task-vector matrix was off by 1.8e-3 of ‖τ_i‖‖τ_j‖ against float64 (pieces of 2²² entries: 3.9e-4, of
2¹⁶: 2.4e-6), enough to swamp the cosine of two nearly orthogonal task vectors; the time is the same. It also keeps
the overlap counts, float32 sums of 0/1 products, exact (below 2²⁴)."""


@torch.inference_mode()
def task_vector_statistics(inputs: RunInputs, *, k: float = 0.2) -> dict[str, torch.Tensor]:
    """Pairwise statistics of the task vectors τ_p = θ_p − θ₀, streamed one tensor at a time (``[q, q]`` each).

    ``gram``: ⟨τ_i, τ_j⟩ over every float tensor. ``conflict`` / ``overlap``: among the entries that both per-tensor
    top-``k`` trims keep (TIES' trim, with the threshold of :func:`hf_mloss.methods.ops.magnitude_threshold`), those
    whose signs differ / all of them. A large tensor (:data:`STREAM_MIN_NUMEL`) is read in pieces of rows, its
    per-task thresholds found over the whole tensor first (:func:`hf_mloss.methods.ops.streamed_thresholds`), so
    that no q whole copies are held: the same thresholds and counts, the Gram sums added piece by piece.

    The other tensors go to the run's workers (:func:`hf_mloss.parallel.active`), one tensor each at a time in
    memory of its own: their selections and small products run on one thread each, so two workers keep two cores
    busy where one tensor at a time left one idle. Every tensor's sums are added in the names' order, whichever
    worker computed them.
    """
    from .. import parallel
    from ..methods.ops import keep_count

    q = len(inputs.sources)
    out = {key: torch.zeros(q, q, dtype=torch.float64) for key in ("gram", "conflict", "overlap")}
    sizes = {name: math.prod(inputs.base.shapes[name]) for name in inputs.names}
    streamed = {n for n, numel in sizes.items() if numel * q >= STREAM_MIN_NUMEL and inputs.base.shapes[n]}
    whole = [n for n in inputs.names if n not in streamed]
    sums = dict(zip(whole, parallel.active().map(_WholeStatistics(inputs, [sizes[n] for n in whole], k), whole)))
    piece_sizes = [_piece_rows(inputs.base.shapes[n]) * sizes[n] // inputs.base.shapes[n][0] for n in streamed]
    buffer = torch.empty(q * max(piece_sizes, default=0), device=inputs.device, dtype=torch.float32)
    base_piece = torch.empty(max(piece_sizes, default=0), device=inputs.device, dtype=torch.float32)
    masks = _mask_buffers(q, max(piece_sizes, default=0), inputs.device)
    for name in inputs.names:
        if name not in streamed:
            _add_sums(out, sums.pop(name))
            continue
        pieces = lambda name=name: _task_vector_pieces(inputs, name, buffer, base_piece)
        thresholds = _streamed_thresholds(pieces, q, keep_count(sizes[name], k), sizes[name])
        for taus in pieces():
            _add_sums(out, _pair_sums(taus, thresholds, masks))
    return out


class _WholeStatistics:
    """One whole tensor's pair sums (:func:`_pair_sums`), read into memory reused by each thread that calls it."""

    def __init__(self, inputs: RunInputs, sizes: Sequence[int], k: float) -> None:
        import threading

        self.inputs, self.k, self.largest = inputs, k, max(sizes, default=0)
        self.local = threading.local()

    def __call__(self, name: str) -> torch.Tensor:
        from ..methods.ops import keep_count, magnitude_threshold

        inputs = self.inputs
        memory = getattr(self.local, "memory", None)
        if memory is None:  # this thread's task vectors and magnitudes, reused from tensor to tensor
            memory = self.local.memory = (
                torch.empty(len(inputs.sources) * self.largest, device=inputs.device, dtype=torch.float32),
                torch.empty(self.largest, device=inputs.device, dtype=torch.float32),
                _mask_buffers(len(inputs.sources), self.largest, inputs.device))
        buffer, magnitude, masks = memory
        taus = _whole_task_vectors(inputs, name, buffer, magnitude)
        count = keep_count(taus.shape[1], self.k)  # the floor(n·k)-th largest, as the trim keeps
        thresholds = [magnitude_threshold(torch.abs(tau, out=magnitude[: tau.numel()]), count) for tau in taus]
        return _pair_sums(taus, thresholds, masks)


def _task_vectors(inputs: RunInputs, name: str, rows: slice, buffer: torch.Tensor,
                  base_buffer: torch.Tensor) -> torch.Tensor:
    """``[q, entries]`` float32 task vectors of rows ``rows.start:rows.stop`` of tensor ``name``, each source
    converted straight into its row of ``buffer``, the base into ``base_buffer`` (a view of ``buffer`` is returned:
    valid until the next call). Every checkpoint is read through the store's reused staging memory: rows read into
    fresh tensors piece after piece made some passes over an embedding many times slower than others."""
    width = math.prod(inputs.base.shapes[name][1:])
    start, numel = rows.start * width, (rows.stop - rows.start) * width
    base = inputs.base.read_flat_into(name, start, base_buffer[:numel])
    taus = buffer[: len(inputs.sources) * numel].view(len(inputs.sources), numel)
    for tau, store in zip(taus, inputs.sources):
        store.read_flat_into(name, start, tau)
    return taus.sub_(base)


def _whole_task_vectors(inputs: RunInputs, name: str, buffer: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """The ``[q, entries]`` task vectors of a whole tensor, every checkpoint read into reused memory (the base into
    ``scratch``, free again when this returns): no fresh pages per tensor and source."""
    shape = inputs.base.shapes[name]
    numel = math.prod(shape)
    base = inputs.base.read_into(name, scratch[:numel].view(shape))
    taus = buffer[: len(inputs.sources) * numel].view(len(inputs.sources), *shape)
    for tau, store in zip(taus, inputs.sources):
        store.read_into(name, tau)
    return taus.sub_(base).reshape(len(taus), -1)


def _task_vector_pieces(inputs: RunInputs, name: str, buffer: torch.Tensor, base_buffer: torch.Tensor):
    """The ``[q, entries]`` task vectors of tensor ``name``, piece by piece (consecutive row ranges), each in
    ``buffer`` (a piece is overwritten by the next; ``base_buffer``: the base's piece)."""
    shape = inputs.base.shapes[name]
    step = _piece_rows(shape)
    for start in range(0, shape[0], step):
        yield _task_vectors(inputs, name, slice(start, min(start + step, shape[0])), buffer, base_buffer)


def _piece_rows(shape: tuple[int, ...]) -> int:
    """Rows of one streamed piece: :data:`STREAM_PIECE_NUMEL` entries per task, at least one row, at most all."""
    return min(shape[0], max(1, STREAM_PIECE_NUMEL // max(1, math.prod(shape[1:]))))


def _streamed_thresholds(pieces, q: int, count: int, numel: int) -> list[float]:
    """Per task, the ``count``-th largest |τ| over the whole tensor, read piece by piece."""
    from ..methods.ops import sample_positions, streamed_thresholds

    positions, samples, start = sample_positions(numel), [[] for _ in range(q)], 0
    for taus in pieces():
        stop = start + taus.shape[1]
        at = positions[(positions >= start) & (positions < stop)] - start
        for kept, tau in zip(samples, taus):
            kept.append(tau[at.to(tau.device)].abs().cpu())
        start = stop
    return streamed_thresholds(lambda: (list(taus) for taus in pieces()), [count] * q, numel,
                               [torch.cat(kept) for kept in samples])


def _mask_chunk(q: int) -> int:
    """Entries per task of one chunk of :func:`_pair_sums` (:data:`PAIR_CHUNK_BYTES` of the q task vectors)."""
    return max(GRAM_CHUNK_NUMEL, PAIR_CHUNK_BYTES // (4 * q)) // GRAM_CHUNK_NUMEL * GRAM_CHUNK_NUMEL


def _mask_buffers(q: int, numel: int, device: Any) -> torch.Tensor:
    """The two ``[q, chunk]`` float32 buffers :func:`_pair_sums` makes its masks in, for pieces of ``numel``
    entries per task: one allocation for a whole pass (32 MB at the chunk's size is above the allocator's limit
    for reusing freed memory, so a buffer made per tensor mapped fresh pages for each)."""
    return torch.empty(2, q, min(_mask_chunk(q), max(numel, 1)), dtype=torch.float32, device=device)


def _pair_sums(taus: torch.Tensor, thresholds: list[float], buffers: torch.Tensor) -> torch.Tensor:
    """One piece's ``[3, q, q]`` float64 sums: ⟨τ_i, τ_j⟩, the trim overlap count and ⟨s_i, s_j⟩ of the kept signs
    (``thresholds``: one per task; ``buffers``: :func:`_mask_buffers`). An entry is kept where its magnitude reaches
    its task's threshold and is not zero (a zero has no sign)."""
    q, device = taus.shape[0], taus.device
    least = torch.finfo(torch.float32).smallest_normal * 2.0**-23  # the least positive float32
    threshold = torch.tensor(thresholds, dtype=torch.float32, device=device).clamp_min(least)[:, None]
    sums = torch.zeros(3, q, q, dtype=torch.float64, device=device)  # gram, overlap, ⟨signs⟩
    chunk = buffers.shape[2]
    # the masks as float 1/0 made in place in two reused buffers: a comparison with a bool result and its conversion
    # to float took 6x as long (1.5 against 0.23 ms per [4, 2^18] on 2 threads) and mapped fresh pages per chunk
    for part in taus.split(chunk, dim=1):
        kept, signed = (buffer[:, : part.shape[1]] for buffer in buffers)
        torch.abs(part, out=kept).ge_(threshold)
        torch.copysign(kept, part, out=signed)  # ±1 where kept, ±0 elsewhere: one pass, not sign() then a product
        for i, matrix in enumerate((part, kept, signed)):
            for piece in matrix.split(GRAM_CHUNK_NUMEL, dim=1):
                sums[i] += (piece @ piece.T).double()
    return sums.cpu()


def _add_sums(out: dict[str, torch.Tensor], sums: torch.Tensor) -> None:
    """Add one piece's :func:`_pair_sums` to the statistics (agree − conflict = ⟨s_i, s_j⟩)."""
    gram, overlap, agreement = sums
    out["gram"] += gram
    out["overlap"] += overlap
    out["conflict"] += (overlap - agreement) / 2


def weight_baselines(stats: dict[str, torch.Tensor], subsets: Sequence[tuple[int, ...]]) -> dict[str, list[float]]:
    """Per subset: mean pairwise task-vector cosine and distance, Σ‖τ_p‖, and the sign-conflict fraction."""
    gram = stats["gram"]
    norms = gram.diagonal().clamp_min(0).sqrt()
    cosine = gram / (norms[:, None] * norms[None, :]).clamp_min(torch.finfo(torch.float64).tiny)
    distance = (norms[:, None] ** 2 + norms[None, :] ** 2 - 2 * gram).clamp_min(0).sqrt()
    out: dict[str, list[float]] = {"tv_cosine": [], "tv_distance": [], "tv_norm": [], "sign_conflict": []}
    for subset in subsets:
        pairs = list(itertools.combinations(subset, 2))
        index = tuple(zip(*pairs))
        out["tv_cosine"].append(float(cosine[index].mean()))
        out["tv_distance"].append(float(distance[index].mean()))
        out["tv_norm"].append(float(norms[list(subset)].sum()))
        overlap = float(stats["overlap"][index].sum())
        out["sign_conflict"].append(float(stats["conflict"][index].sum()) / overlap if overlap else 0.0)
    return out


def load_weights_into(state: dict[str, torch.Tensor], stores: Sequence[Any], alpha: Sequence[float],
                      names: Sequence[str]) -> None:
    """``state[name] = Σ_p α_p θ_p[name]`` for every name (one tensor of each store at a time)."""
    with torch.no_grad():
        for name in names:
            target = state[name]
            target.copy_(sum(a * s.get_float(name, target.device) for a, s in zip(alpha, stores)))


def output_gaps(inputs: RunInputs, subsets: Sequence[tuple[int, ...]], weights: torch.Tensor,
                batches: Sequence[Any], *, progress: bool = True, reach: torch.Tensor | None = None) -> list[float]:
    """Per subset, the gap between its average merge (α normalised over S) and the ensemble of its members, read
    through the family's output rule (:meth:`hf_mloss.adapters.base.ModelAdapter.output_rule`): pooled features
    (encoders) give Σ_x ‖f_S(x) − Σ_p α_p f_p(x)‖ / Σ_x ‖Σ_p α_p f_p(x)‖; a causal LM gives the mean over real
    positions of KL(Σ_p α_p P_p ‖ P_S), the mixture of the members' next-token distributions against the merge's.
    Costs one forward per model and one per subset; holds every model's outputs (a causal LM's: samples × tokens
    × vocabulary floats per model). ``reach`` (:func:`subset_reach`): each subset on its members' data only."""
    from tqdm.auto import tqdm

    from .walk import batch_to

    tower = inputs.load_scoring_model(progress=False)
    rule = inputs.adapter.output_rule(tower)
    batches = [batch_to(batch, inputs.device) for batch in batches]
    state = {inputs.adapter.canonical_key(k): v for k, v in tower.state_dict().items()}
    names = [n for n in inputs.names if n in state]
    outputs = []
    for store in inputs.sources:
        load_weights_into(state, [store], [1.0], names)
        outputs.append([rule.outputs(tower, batch) for batch in batches])
    matrix = subset_matrix(subsets, weights).double()
    gaps = []
    for row, subset in enumerate(tqdm(subsets, desc="Output gaps", unit="merge", disable=not progress)):
        alpha = matrix[row, list(subset)].tolist()
        load_weights_into(state, [inputs.sources[p] for p in subset], alpha, names)
        total = count = 0.0
        start = 0
        for b, batch in enumerate(batches):
            size = len(next(iter(batch.values())))
            rows = slice(None) if reach is None else reach[row, start:start + size].to(inputs.device)
            start += size
            if reach is not None and not bool(rows.any()):
                continue
            gap, norm = rule.ensemble_gap([outputs[p][b] for p in subset], alpha, rule.outputs(tower, batch), batch)
            total, count = total + float(gap[rows].double().sum()), count + float(norm[rows].double().sum())
        gaps.append(total / max(count, 1e-12))
    return gaps


# --------------------------------------------------------------------------------------------------- report
def towers_line(towers: dict[str, dict[str, Any]]) -> str:
    """How each tower of a whole model was scored: ``vision tower scored on 4 images (...); language model not
    scored (no text data)``."""
    from ..output.report import tower_label

    return "; ".join(f"{tower_label(attribute)} {tower['status']}" for attribute, tower in towers.items())


@dataclass
class CompatibilityReport:
    """Pairwise (and subset) M-Loss of q candidate fine-tunes, with label-free baselines.

    ``values[metric]`` is ``[subsets, layers]`` for the M-Loss metrics (:data:`METRICS`); a subset's overall score
    is the mean over the scored layers. ``baselines[name]`` holds one value per subset (:data:`BASELINES`). Subsets
    are tuples of model indices; the weights of each subset are normalised over it. Lower M-Loss: the subset's
    average merge behaves more like the ensemble of its members.

    Example:
        ```python
        >>> report = hf_mloss.compatibility(base, models, data="path/to/images")
        >>> report.matrix()                      # [q, q] pairwise M-Loss (mean over layers)
        >>> report.leave_one_out()               # which model spoils the merge of all q
        >>> report.save("compat/")               # compatibility.json, .md and the heatmap
        ```
    """

    models: list[str]
    weights: list[float]
    layers: list[str]
    subsets: list[tuple[int, ...]]
    values: dict[str, torch.Tensor]
    baselines: dict[str, list[float]] = field(default_factory=dict)
    node: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per scored layer, ``[subsets, nodes]`` node M-Loss (only when asked for with ``per_node=True``)."""
    reduction: str = "abs"
    activation: str = ""
    eps: float = 1e-4
    num_samples: int = 0
    num_positions: int = 0
    compute_dtype: str = "float32"
    data: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def q(self) -> int:
        return len(self.models)

    def index(self, subset: Sequence[int | str]) -> int:
        """Row of ``subset`` (model indices or names) in :attr:`subsets`."""
        key = tuple(sorted(self.models.index(m) if isinstance(m, str) else int(m) for m in subset))
        try:
            return self.subsets.index(key)
        except ValueError:
            raise InvalidParameterError(f"Subset {list(subset)} was not scored; pass it in subsets=... "
                                        f"(scored: pairs, leave-one-out, the whole set and the requested ones).") from None

    def score(self, subset: Sequence[int | str], metric: str = "mloss", layer: str | None = None) -> float:
        """The overall (mean over layers) or one layer's value of ``metric`` for ``subset``."""
        row = self.index(subset)
        if metric in self.baselines:
            return self.baselines[metric][row]
        if metric not in self.values:
            raise InvalidParameterError(f"Unknown metric {metric!r}; valid: {[*self.values, *self.baselines]}.")
        values = self.values[metric][row]
        return float(values[self.layers.index(layer)] if layer is not None else values.mean())

    def matrix(self, metric: str = "mloss", layer: str | None = None) -> torch.Tensor:
        """``[q, q]`` pairwise values of ``metric`` (NaN on the diagonal)."""
        out = torch.full((self.q, self.q), float("nan"), dtype=torch.float64)
        for i, j in itertools.combinations(range(self.q), 2):
            out[i, j] = out[j, i] = self.score((i, j), metric, layer)
        return out

    def spread(self, subset: Sequence[int]) -> float:
        """``1 − Σ α_p²`` of ``subset``'s weights renormalised to sum to 1: M-Loss of exchangeable models scales with
        it (:func:`hf_mloss.engine.theory.expected_mloss`), so fewer models merge with less M-Loss whatever they are."""
        alpha = torch.tensor([self.weights[p] for p in subset], dtype=torch.float64)
        alpha = alpha / alpha.sum()
        return float(1 - alpha.square().sum())

    def leave_one_out(self, metric: str = "mloss") -> list[dict[str, Any]]:
        """Per model: ``metric`` of the set without it, how much lower it is than the whole set's (``gain``), and
        that gain net of the q effect (``net_gain``).

        Dropping any model lowers M-Loss by itself: for exchangeable (e.g. i.i.d.) fine-tunes the whole set's value
        times ``spread(rest) / spread(all)`` (``1 − 1/(q−1)`` over ``1 − 1/q`` with uniform weights) is what the
        rest is expected to score. ``net_gain`` is that expectation minus the measured value: > 0 means the rest
        merges better than the smaller q alone explains (the model left out spoils the merge), ≤ 0 means it does
        not. Only ``net_gain`` compares models; ``gain`` is positive for all of them.
        """
        if self.q < 3:
            return []
        everyone = list(range(self.q))
        whole = self.score(everyone, metric)
        rows = []
        for i, name in enumerate(self.models):
            rest = [p for p in everyone if p != i]
            without = self.score(rest, metric)
            expected = whole * self.spread(rest) / self.spread(everyone)
            rows.append({"model": name, "without": without, "gain": whole - without, "expected": expected,
                         "net_gain": expected - without})
        return rows

    def pairs(self, metric: str = "mloss") -> list[dict[str, Any]]:
        """Every pair with its overall M-Loss metrics and baselines, most compatible first (by ``metric``)."""
        rows = [{"pair": (self.models[i], self.models[j]), **self._row(self.index((i, j)))}
                for i, j in itertools.combinations(range(self.q), 2)]
        return sorted(rows, key=lambda r: -r[metric] if metric in HIGHER_IS_BETTER else r[metric])

    def _row(self, row: int) -> dict[str, float]:
        out = {m: float(self.values[m][row].mean()) for m in self.values}
        out.update({name: values[row] for name, values in self.baselines.items()})
        return out

    def summary(self) -> str:
        """Plain text: the pairwise M-Loss matrix and the leave-one-out table."""
        lines = [f"Pairwise M-Loss (own prefix, reduction={self.reduction}, activation={self.activation}, "
                 f"{self.num_samples} samples / {self.num_positions} positions, mean over {len(self.layers)} layers)"]
        if self.data:
            lines.append(f"data: {describe_data(self.data)}")
        if self.data.get("towers"):
            lines.append(f"towers: {towers_line(self.data['towers'])}")
        labels = [f"[{i}]" for i in range(self.q)]
        matrix = self.matrix()
        lines.append(" " * 6 + "".join(f"{label:>11}" for label in labels))
        for i in range(self.q):
            cells = "".join(f"{'-':>11}" if i == j else f"{float(matrix[i, j]):>11.4e}" for j in range(self.q))
            lines.append(f"{labels[i]:<6}{cells}  {self.models[i]}")
        pairs = matrix[~torch.isnan(matrix)]
        if pairs.numel():
            lines.append(f"Reading: lower is better (0: the pair's average merge equals their ensemble). Median pair "
                         f"{float(pairs.median()):.4e}; compare pairs with it, and only with values of the same prefix "
                         "(own), data and q.")
        loo = self.leave_one_out()
        if loo:
            lines += ["", f"All {self.q}: M-Loss {self.score(range(self.q)):.4e}. Without one model, against what "
                      f"{self.q - 1} exchangeable models would score (net gain > 0: the model left out spoils the "
                      "merge; dropping any model lowers M-Loss by the q effect alone):"]
            lines += [f"  {r['model']:<40} {r['without']:.4e}  expected {r['expected']:.4e}  net gain "
                      f"{r['net_gain']:+.3e}" for r in sorted(loo, key=lambda r: -r["net_gain"])]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return (f"CompatibilityReport(models={self.q}, subsets={len(self.subsets)}, layers={len(self.layers)}, "
                f"samples={self.num_samples})")

    # ------------------------------------------------------------------------------------------- output
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: settings, then one entry per subset with per-layer values and baselines."""
        subsets = []
        for row, subset in enumerate(self.subsets):
            entry: dict[str, Any] = {"models": list(subset), **self._row(row)}
            entry["per_layer"] = {m: self.values[m][row].tolist() for m in self.values}
            subsets.append(entry)
        return {"models": self.models, "weights": self.weights, "layers": self.layers, "prefix": "own",
                "reduction": self.reduction, "activation": self.activation, "eps": self.eps,
                "num_samples": self.num_samples, "num_positions": self.num_positions,
                "compute_dtype": self.compute_dtype, "data": self.data, "timings": self.timings,
                "subsets": subsets}

    @classmethod
    def from_dict(cls, content: dict[str, Any]) -> CompatibilityReport:
        """Read what :meth:`to_dict` wrote (per-node vectors are not stored)."""
        entries = content["subsets"]
        names = sorted({k for e in entries for k in e if k in BASELINES})
        return cls(models=content["models"], weights=content["weights"], layers=content["layers"],
                   subsets=[tuple(e["models"]) for e in entries],
                   values={m: torch.tensor([e["per_layer"][m] for e in entries], dtype=torch.float64)
                           for m in entries[0]["per_layer"]},
                   baselines={n: [e[n] for e in entries] for n in names}, reduction=content["reduction"],
                   activation=content["activation"], eps=content["eps"], num_samples=content["num_samples"],
                   num_positions=content["num_positions"], compute_dtype=content.get("compute_dtype", "float32"),
                   data=content.get("data", {}), timings=content.get("timings", {}))

    def to_json(self, path: str | Path | None = None, *, overwrite: bool = False) -> str:
        """The report as JSON, also written to ``path`` if given (atomic, never through a link, ``overwrite`` to
        replace); NaN or infinite values are refused."""
        from ..output.report import finite_json
        from ..saving import write_file

        text = finite_json(self.to_dict(), "The compatibility report", indent=1)
        if path is not None:
            write_file(path, text + "\n", overwrite=overwrite, what="Report file")
        return text

    def to_markdown(self, *, heatmap: str | None = None) -> str:
        """Markdown: the pairwise matrix, the pairs ranked with their baselines, and leave-one-out."""
        lines = [self.card_section(heatmap=heatmap), "", "### Pairs, most compatible first", "",
                 "| pair | " + " | ".join([*self.values, *self.baselines]) + " |",
                 "|---|" + "---|" * (len(self.values) + len(self.baselines))]
        for r in self.pairs():
            cells = [f"{r[m]:.4g}" for m in [*self.values, *self.baselines]]
            lines.append(f"| {r['pair'][0]} + {r['pair'][1]} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def card_section(self, *, heatmap: str | None = None) -> str:
        """The Markdown a model card embeds: what was measured, the pairwise matrix and the leave-one-out table."""
        data = f" ({towers_line(self.data['towers'])})" if self.data.get("towers") else \
            f" on {describe_data(self.data)}" if self.data else f" on {self.num_samples} unlabeled images"
        labels = [f"[{i}]" for i in range(self.q)]
        lines = [f"Pairwise M-Loss of the {self.q} fine-tuned models{data} (each model's own forward, reduction "
                 f"`{self.reduction}`, activation `{self.activation}`; layer M-Loss averaged over "
                 f"{len(self.layers)} layers). Lower: the pair's average merge is closer to the ensemble of the "
                 "two. Computed without labels.", "",
                 "| | " + " | ".join(labels) + " | model |", "|---|" + "---|" * (self.q + 1)]
        matrix = self.matrix()
        for i in range(self.q):
            cells = ["-" if i == j else f"{float(matrix[i, j]):.3e}" for j in range(self.q)]
            lines.append(f"| {labels[i]} | " + " | ".join(cells) + f" | {self.models[i]} |")
        loo = self.leave_one_out()
        if loo:
            lines += ["", f"All {self.q} together: M-Loss {self.score(range(self.q)):.4e}. Without one model, "
                      f"against what {self.q - 1} exchangeable models would score (the q effect: fewer models merge "
                      "with less M-Loss whatever they are). Net gain > 0: the model left out spoils the merge.", "",
                      "| model left out | M-Loss of the rest | expected | net gain |", "|---|---|---|---|"]
            lines += [f"| {r['model']} | {r['without']:.4e} | {r['expected']:.4e} | {r['net_gain']:+.3e} |"
                      for r in sorted(loo, key=lambda r: -r["net_gain"])]
        if heatmap:
            lines += ["", f"![Pairwise M-Loss]({heatmap})"]
        return "\n".join(lines)

    def draw_heatmap(self, path: str | Path, metric: str = "mloss", *, overwrite: bool = False) -> Path | None:
        """Save the ``[q, q]`` heatmap of ``metric`` as a PNG; ``None`` without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            import numpy as np
        except ImportError:
            return None
        matrix = self.matrix(metric).numpy()
        fig, ax = plt.subplots(figsize=(1.0 + 0.55 * self.q, 0.8 + 0.5 * self.q))
        image = ax.imshow(matrix, cmap="viridis_r" if metric not in HIGHER_IS_BETTER else "viridis")
        ticks = [f"[{i}] {name[-24:]}" for i, name in enumerate(self.models)]
        ax.set_xticks(range(self.q), [f"[{i}]" for i in range(self.q)], fontsize=7)
        ax.set_yticks(range(self.q), ticks, fontsize=7)
        if self.q <= 12:
            from ..output.plots import distinct_labels

            middle = (np.nanmin(matrix) + np.nanmax(matrix)) / 2
            cells = list(itertools.permutations(range(self.q), 2))
            labels = distinct_labels([float(matrix[i, j]) for i, j in cells])  # different colours, different text
            for (i, j), label in zip(cells, labels):
                dark = (matrix[i, j] > middle) != (metric in HIGHER_IS_BETTER)
                ax.text(j, i, label, ha="center", va="center", fontsize=6, color="w" if dark else "k")
        better = "higher" if metric in HIGHER_IS_BETTER else "lower"
        ax.set_title(f"Pairwise {metric}\n({better}: more compatible)", fontsize=9)
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        import io

        from ..saving import write_file

        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
        plt.close(fig)
        return write_file(path, buffer.getvalue(), overwrite=overwrite, what="Heatmap file")

    def save(self, folder: str | Path, *, overwrite: bool = False,
             protected: Sequence[str | Path] = ()) -> dict[str, Path]:
        """Write ``compatibility.json``, ``compatibility.md`` and (with matplotlib) the heatmap into ``folder``, a
        new folder written whole or not at all (:mod:`hf_mloss.saving`): an existing non-empty one is replaced only
        with ``overwrite``; one that is or holds a path of ``protected`` (the run's inputs) is refused."""
        from ..saving import atomic_folder, check_output_dir, write_file

        folder = check_output_dir(folder, overwrite=overwrite, protected=protected)
        text = self.to_json()  # refuses NaN before anything is written
        with atomic_folder(folder, overwrite=overwrite) as tmp:
            write_file(tmp / REPORT_JSON, text + "\n")
            heatmap = self.draw_heatmap(tmp / HEATMAP_NAME)
            write_file(tmp / REPORT_MARKDOWN, self.to_markdown(heatmap=HEATMAP_NAME if heatmap else None))
        written = {"json": folder / REPORT_JSON, "markdown": folder / REPORT_MARKDOWN}
        if heatmap is not None:
            written["heatmap"] = folder / HEATMAP_NAME
        return written

    @classmethod
    def load(cls, path: str | Path) -> CompatibilityReport:
        """Read a ``compatibility.json`` (or the folder holding it)."""
        path = Path(path)
        return cls.from_dict(json.loads((path / REPORT_JSON if path.is_dir() else path).read_text()))


# ------------------------------------------------------------------------------------------------------ API
def run_compatibility(config: MergeConfig, *, subsets: Sequence[Sequence[int | str]] | None = None,
                      leave_one_out: bool = True, baselines: bool = True, output_gap: bool = False,
                      per_node: bool = False, device: Any = None, token: str | bool | None = None,
                      progress: bool = True) -> CompatibilityReport:
    """The compatibility report of a validated config's models and data (see :func:`compatibility`).

    Example:
        ```python
        >>> report = run_compatibility(MergeConfig.from_yaml("merge.yaml"))
        ```
    """
    import time

    from ..loading.inputs import open_inputs
    from ..parallel import cpu_workers
    from .score import make_setup

    options = config.scoring_options()
    _check_config(config, options)
    with open_inputs(config, device=device, token=token, needs_data=True, progress=progress,
                     scoring=True) as inputs, \
            cpu_workers(inputs.device):
        names = [r.name for r in inputs.refs]
        aliases = {m.model: i for i, m in enumerate(config.models) if isinstance(m.model, str)}
        chosen = standard_subsets(len(names), parse_subsets(subsets, names, aliases), leave_one_out=leave_one_out)
        whole = bool(inputs.towers) or getattr(inputs.adapter, "whole_model", False)
        if output_gap and whole:
            raise InvalidParameterError("output_gap compares the pooled outputs of a model of one tower; a whole "
                                        "two-tower model (a CLIPModel with text_data, a vision-language model) has "
                                        "none. Drop output_gap.")
        weights = inputs.alpha / inputs.alpha.sum()
        start = time.perf_counter()
        if whole:
            setup, scores, towers = _tower_subset_mloss(inputs, options, config, chosen, weights, per_node=per_node,
                                                        progress=progress)
        else:
            model = inputs.load_scoring_model(progress=progress, streamed=True)  # the blocks come from the sources
            setup = make_setup(inputs, model, options, config, progress=progress)
            reach = subset_reach(inputs.sample_owner, chosen, len(names))  # a subset on its members' own data
            scores, towers = subset_mloss(setup, chosen, weights, per_node=per_node, progress=progress,
                                          reach=reach), {}
        timings = {"mloss_s": time.perf_counter() - start}
        extra: dict[str, list[float]] = {}
        if baselines:
            start = time.perf_counter()
            extra = weight_baselines(task_vector_statistics(inputs), chosen)
            timings["baselines_s"] = time.perf_counter() - start
        if output_gap:
            start = time.perf_counter()
            extra["output_gap"] = output_gaps(inputs, chosen, weights, inputs.model_inputs.split(config.batch_size),
                                              progress=progress,
                                              reach=subset_reach(inputs.sample_owner, chosen, len(names)))
            timings["output_gap_s"] = time.perf_counter() - start
        _check_finite({m: scores[m] for m in scores["metrics"]}, extra, chosen, names, inputs.alpha)
        info = inputs.data_info or next(iter(inputs.tower_data_info.values()), None)
        data = {**info.to_dict(), **info.sample_stats()} if info else {}
        if towers:
            data["towers"] = towers
        return CompatibilityReport(
            models=names, weights=[float(w) for w in inputs.alpha], layers=scores["layers"], subsets=chosen,
            values={m: scores[m] for m in scores["metrics"]}, baselines=extra, node=scores.get("node", {}),
            reduction=setup.reduction, activation=scores.get("activation", setup.activation_name), eps=setup.eps,
            num_samples=scores.get("samples", setup.num_samples), num_positions=scores["positions"],
            compute_dtype=str(setup.compute_dtype).replace("torch.", ""), data=data,
            timings={k: round(v, 3) for k, v in timings.items()})


def _tower_subset_mloss(inputs: RunInputs, options: ScoringOptions, config: MergeConfig,
                        subsets: Sequence[tuple[int, ...]], weights: torch.Tensor, *, per_node: bool,
                        progress: bool) -> tuple[ScoringSetup, dict[str, Any], dict[str, dict[str, Any]]]:
    """:func:`subset_mloss` of every scored tower of a whole model, each on its own data (``data=`` images,
    ``text_data=`` texts), joined along the layers (named as in the whole model): the first tower's setup, the
    joined scores (with the towers' ``samples`` and ``activation``), and how each tower was treated."""
    from .score import make_setup, unscored_towers

    model = inputs.load_output_model("auto", progress=progress)
    parts = []
    for tower in inputs.scored_towers(model):
        setup = make_setup(inputs, tower.module, options, config, progress=progress, tower=tower)
        reach = subset_reach(tower.owner, subsets, len(inputs.sources))
        parts.append((tower, setup, subset_mloss(setup, subsets, weights, per_node=per_node, progress=progress,
                                                 reach=reach)))
    first = parts[0][2]
    joined: dict[str, Any] = {m: torch.cat([p[m] for _, _, p in parts], dim=1) for m in first["metrics"]}
    joined.update(metrics=first["metrics"], positions=sum(p["positions"] for _, _, p in parts),
                  layers=[f"{tower.key_prefix}{name}" for tower, _, p in parts for name in p["layers"]],
                  samples=sum(setup.num_samples for _, setup, _ in parts),
                  activation=", ".join(dict.fromkeys(setup.activation_name for _, setup, _ in parts)))
    if per_node:
        joined["node"] = {f"{tower.key_prefix}{name}": v for tower, _, p in parts for name, v in p["node"].items()}
    towers = {tower.attribute: {"status": f"scored on {setup.num_samples} "
                                          f"{'texts' if tower.samples.modality == 'text' else 'images'} "
                                          f"({p['positions']} positions, {len(p['layers'])} layers)"}
              for tower, setup, p in parts}
    towers.update({attribute: {"status": status}
                   for attribute, status in unscored_towers(inputs, "not scored (no {kind} data)").items()})
    return parts[0][1], joined, towers


def _check_finite(values: dict[str, torch.Tensor], baselines: dict[str, list[float]],
                  subsets: Sequence[tuple[int, ...]], names: Sequence[str], alpha: torch.Tensor) -> None:
    """Refuse a report holding NaN or infinities, naming the metric, the subset and the weights that produced it."""
    for metric, table in [*values.items(), *((k, torch.tensor(v, dtype=torch.float64)) for k, v in baselines.items())]:
        bad = (~torch.isfinite(table.reshape(len(subsets), -1))).any(-1).nonzero().flatten().tolist()
        if bad:
            subset = [names[i] for i in subsets[bad[0]]]
            raise InvalidParameterError(
                f"The compatibility report's {metric} of subset {subset} is not finite (weights "
                f"{[float(w) for w in alpha]}): the computation overflowed. Use smaller weights (or none).")


def _check_config(config: MergeConfig, options: ScoringOptions) -> None:
    if not config.has_data() and not config.has_data("text_data"):
        raise InvalidParameterError("A compatibility report needs unlabeled images or texts and the config has no "
                                    "`data`: add e.g. `data: {path: ./images, num_samples: 128}` (and `text_data:` "
                                    "for the text tower or language model of a whole model).")
    if options.prefix != "own":
        raise InvalidParameterError(f"A pairwise report scores every subset on its members' own forwards "
                                    f"(prefix='own'); got prefix={options.prefix!r}. Remove `prefix` from the "
                                    "`score:` section (a shared base/merged prefix would differ per subset).")
    if len(config.models) < 2:
        raise InvalidParameterError("A compatibility report needs at least 2 models.")
    for key in ("data", "text_data"):  # each subset reads its members' own data: two models without any share none
        if getattr(config, key) is not None or all(getattr(m, key) is None for m in config.models):
            continue
        missing = [f"models[{i}] ({m.label})" for i, m in enumerate(config.models) if getattr(m, key) is None]
        if len(missing) >= 2:
            raise DataError(f"A compatibility report scores each pair on its members' own {key}, and "
                            f"{', '.join(missing[:3])}{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} "
                            f"have none: a pair of them would have no sample to score. Give each of them its own "
                            f"{key}, or a shared `{key}=` for those without.")


