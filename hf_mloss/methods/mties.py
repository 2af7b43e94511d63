"""M-TIES and M-DARE: TIES / DARE whose scored units get one keep ratio per node, from the nodes' M-Loss.

Nodes are ranked by node M-Loss: rank r_i ∈ {0..n−1} in ascending order (stable on ties), ρ_i = r_i/(n−1), and node
i keeps the fraction ``k − e·ρ_i`` of each task vector — the lowest-loss node keeps k, the highest k − e. The keep
ratio applies to the node's whole GROUP, as the adapter declares it (:meth:`~hf_mloss.adapters.ModelAdapter.
node_groups`; SPEC §1b, §3): each 2-D member slice (row i of the fc1 / gate / up weight, column i of the down
weight) keeps its own ``floor(len · keep_i)`` largest |τ| entries; a 1-D member (the bias entry i of fc1 / gate) has
no fraction of its own (``floor(1 · keep_i)`` would zero it) and is kept iff its |τ| reaches the threshold of the
node's FIRST 2-D member slice (row i of the fc1 / gate weight) in the same task vector. The same keep vector applies
to every task vector. Every other tensor is trimmed per tensor at k (M-TIES) or DARE-dropped (M-DARE); group tensors
are never rescaled. The merge runs block by block through :class:`MTiesHooks`: with ``prefix="merged"`` each block
is scored on the inputs produced by the already-merged blocks before it (the paper's Algorithm 1).

``e=0`` (M-TIES): every node keeps k, and every group tensor is then trimmed per tensor at k, so the control is bit
for bit ``ties(scope="tensor")`` — also where a group is not one row (a gated MLP's gate row, up row and down column;
a per-node trim at a uniform k would differ from the per-tensor trim). M-DARE with ``e=0`` trims its groups node by
node at the uniform ratio.

Controls (``rank=``): ``random`` (seeded random ranks: the same spread without the M-Loss signal), ``inverted``
(ranks by −M-Loss), ``uniform`` (every node's group keeps k − e/2, the mean of the ranked ratios, trimmed node by
node: M-TIES's budget and trimming layout with no ranking at all; every other tensor still keeps k), ``tensor`` (every
tensor of a scored group trimmed as a whole at k − e/2: per-tensor TIES at M-TIES's budget, neither ranks nor rows;
every other tensor keeps k; with ``e=0`` it is the ``e=0`` control).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._validation import param
from ..errors import InvalidParameterError
from .base import LayerHooks, LayerwiseRun, MergeContext, MergeMethod, MethodParams
from .registry import register_merge_method
from .scoring import PREFIXES, ScoringOptions

if TYPE_CHECKING:
    import torch

RANKS = ("mloss", "random", "inverted", "uniform", "tensor")
KEEP_HINT = "k is the fraction of each task vector that is KEPT (mergekit: density)."


def keep_ratios_from_scores(scores: torch.Tensor, k: float, e: float) -> torch.Tensor:
    """RankNorm: ``k − e·rank/(n−1)`` with ranks of ``scores`` in ascending, stable order."""
    import torch

    n = scores.numel()
    order = torch.sort(scores.double(), stable=True).indices
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = torch.arange(n, dtype=torch.float64)
    rho = ranks / (n - 1) if n > 1 else torch.zeros(n, dtype=torch.float64)
    return k - e * rho  # float64: floor(n_in * keep) must not lose an entry to float32 rounding of k


def keep_ratios_of_measured(scores: torch.Tensor, k: float, e: float) -> torch.Tensor:
    """:func:`keep_ratios_from_scores` over the nodes with a score; a node without one (NaN: an MoE expert no token
    was routed to) keeps k − e/2, the mean of the ranked ratios: no data moves it either way."""
    import torch

    measured = ~scores.isnan()
    if bool(measured.all()):
        return keep_ratios_from_scores(scores, k, e)
    keep = torch.full(scores.shape, k - e / 2, dtype=torch.float64)
    if bool(measured.any()):
        keep[measured] = keep_ratios_from_scores(scores[measured], k, e)
    return keep


def random_scores(n: int, seed: int, name: str) -> torch.Tensor:
    """Seeded random scores: the ``rank="random"`` ablation (same keep-ratio spread, no M-Loss signal)."""
    import torch

    from .ops import tensor_seed

    generator = torch.Generator().manual_seed(tensor_seed(seed, "random-rank", name))
    return torch.rand(n, generator=generator, dtype=torch.float64)


@dataclass(frozen=True)
class LayerwiseParams(ScoringOptions, MethodParams):
    """Parameters shared by the M-Loss-guided methods: the scoring options plus the keep-ratio spread."""

    prefix: str = param("merged", "Input of each scored linear: merged (the merged-so-far model, Algorithm 1), base "
                        "or own.", choices=PREFIXES)
    layers: tuple[int, ...] | None = param(None, "Blocks whose scored linear gets M-Loss keep ratios (few-layer "
                                           "M-TIES); default: all.", low=0)
    e: float = param(0.1, "Keep-ratio spread: nodes keep between k − e (highest M-Loss) and k (lowest).", low=0.0)
    lam: float = param(1.0, "λ: θ = θ₀ + λ·τ_merged.")
    rank: str = param("mloss", "Row ranks from node M-Loss, random, or inverted (−M-Loss); uniform: every "
                      "scored node keeps k − e/2, the mean of the ranked keep ratios (the budget-matched control); "
                      "tensor: each scored group tensor trimmed as a whole at k − e/2 (per-tensor TIES at the same "
                      "budget).", choices=RANKS)

    @property
    def row_k(self) -> float:
        raise NotImplementedError

    def check(self) -> None:
        super().check()
        if self.e >= self.row_k:
            raise InvalidParameterError(f"e must satisfy 0 <= e < k (k={self.row_k}), got e={self.e}.")


@dataclass(frozen=True)
class MTiesParams(LayerwiseParams):
    k: float = param(0.2, "Keep fraction of the lowest-M-Loss nodes and of every other tensor.", low=0.0, high=1.0,
                     low_open=True, hint=KEEP_HINT)

    @property
    def row_k(self) -> float:
        return self.k


@dataclass(frozen=True)
class MDareParams(LayerwiseParams):
    p: float = param(0.7, "DARE keep probability of the non-scored tensors.", low=0.0, high=1.0, low_open=True,
                     hint="p is the probability of KEEPING an entry.")
    k: float | None = param(None, "Keep fraction of the lowest-M-Loss nodes (default: p).", low=0.0, high=1.0,
                            low_open=True, hint=KEEP_HINT)

    @property
    def row_k(self) -> float:
        return self.p if self.k is None else self.k


@dataclass(frozen=True)
class GroupMember:
    """How one tensor of a scored node group is trimmed: slice i keeps the fraction ``keep[i]`` of each task vector.

    2-D members are trimmed slice by slice (``dim=0``: row i, ``dim=1``: column i). A 3-D member (an MoE layer's
    fused experts, ``[E, ...]``) is trimmed expert by expert: ``keep`` is ``[E, slices]`` and expert e's 2-D tensor
    keeps ``keep[e]`` along ``dim − 1``. A 1-D member (a bias) has no
    fraction of its own — ``floor(1 · keep_i)`` would zero it — so entry i is kept iff its |τ| reaches the threshold
    of slice i of the group's ``anchor`` (its first 2-D member: the fc1 / gate weight) in the same task vector.
    """

    keep: torch.Tensor
    """``[n]`` keep ratios, one per slice (float64, on the run's device); ``[E, n]`` for a 3-D member."""
    dim: int
    anchor: str | None = None
    """1-D members: the canonical name of the group's first 2-D member."""
    anchor_length: int = 0
    """1-D members: the length of the anchor's slices (for an anchor that no source changed)."""
    keeps_thresholds: bool = False
    """The anchor of a group with 1-D members: its per-slice thresholds are kept for them."""


GROUP_STATE = "node_groups"
"""``MergeContext.state`` key: canonical name -> :class:`GroupMember`, for the group tensors of the scored blocks."""
TENSOR_STATE = "tensor_keep"
"""``MergeContext.state`` key: canonical name -> the keep fraction a scored group tensor is trimmed at as a whole
(``rank="tensor"``)."""
THRESHOLD_STATE = "node_thresholds"
"""``MergeContext.state`` key: anchor name -> ``[q, n]`` per-slice thresholds of each task vector."""


def unchanged_anchor_thresholds(member: GroupMember) -> torch.Tensor:
    """The thresholds of an anchor whose task vectors are all zero (the merge copied it from the base): 0 where the
    slice keeps some but not all entries, +inf where it keeps none, -inf where it keeps all."""
    import torch

    counts = torch.floor(member.keep.double() * member.anchor_length)
    zero = torch.zeros(counts.shape, dtype=torch.float32, device=member.keep.device)
    thresholds = torch.where(counts > 0, zero, torch.full_like(zero, float("inf")))
    return torch.where(counts >= member.anchor_length, torch.full_like(zero, float("-inf")), thresholds)


class MTiesHooks(LayerHooks):
    """Merge stage by stage; the node group of each scored block waits for the block's node M-Loss, which sets the
    keep ratios of its nodes.

    The group comes from :meth:`~hf_mloss.adapters.ModelAdapter.node_groups` (CLIP: the fc1 weight's rows and bias
    entries; a gated MLP: the gate and up weights' rows and the down weight's columns). Its 2-D members are merged
    first (the anchor keeps its thresholds), then its 1-D members, against the anchor's thresholds.
    """

    def __init__(self, run: LayerwiseRun, uniform_keep_is_tensor_trim: bool) -> None:
        self.run = run
        self.params: LayerwiseParams = run.ctx.params
        self.scored = set(self.params.layers if self.params.layers is not None else range(run.adapter.num_layers))
        self.uniform_keep_is_tensor_trim = uniform_keep_is_tensor_trim
        # Every group is read and checked now, before any tensor is merged.
        self.groups = {layer: self._checked_group(layer) for layer in sorted(self.scored)}

    def _checked_group(self, layer: int) -> list[tuple[str, int, int, tuple[int, int] | None]]:
        """``(name, dim, ndim, span)`` of each member of ``layer``'s node group (``span``: the member's nodes in the
        block's node vector, ``None``: all of them), refused when the adapter's declaration does not fit the merged
        tensors."""
        adapter = self.run.adapter
        declared = list(adapter.node_groups(layer))
        held = set(self.run.stage_names(layer))
        where = f"{type(adapter).__name__}.node_groups({layer})"
        if not declared:
            raise InvalidParameterError(f"{where} declares no tensor; a scored block needs at least its scored "
                                        "weight, e.g. [('<block>.mlp.fc1.weight', 0)].")
        members, seen = [], set()
        for name, dim, *span in declared:
            if name not in held:
                raise InvalidParameterError(
                    f"{where} names {name!r}, which is not a floating-point tensor of block {layer} (e.g. "
                    f"{sorted(held)[:3]}); fix the adapter's node_groups.")
            ndim = len(self.run.shape(name))
            dims = {1: (0,), 2: (0, 1), 3: (1, 2)}.get(ndim, ())
            if name in seen or dim not in dims:
                raise InvalidParameterError(
                    f"{where} declares ({name!r}, {dim}) for a {ndim}-D tensor{' twice' if name in seen else ''}: "
                    "a group holds each tensor once, 2-D tensors with dim 0 (row i) or 1 (column i), 1-D tensors "
                    "with dim 0 (entry i), 3-D fused experts with dim 1 or 2 (within each expert).")
            seen.add(name)
            members.append((name, dim, ndim, tuple(span[0]) if span else None))
        if not any(ndim >= 2 for _, _, ndim, _ in members):
            raise InvalidParameterError(f"{where} declares no 2-D tensor: a node's bias entry is trimmed against "
                                        "its weight slice, so the group needs one.")
        if any(ndim == 1 for _, _, ndim, _ in members) and not any(ndim == 2 for _, _, ndim, _ in members):
            raise InvalidParameterError(f"{where} declares a bias without a 2-D weight to trim it against.")
        return members

    def _group_names(self, layer: int) -> set[str]:
        return {name for name, *_ in self.groups.get(layer, ())}

    def before_stage(self, stage: int) -> None:
        deferred = self._group_names(stage)
        self.run.merge([n for n in self.run.stage_names(stage) if n not in deferred])

    def after_scores(self, layer: int, scores) -> None:
        if layer not in self.scored:
            return
        target = self.run.adapter.target_name(layer)
        ctx = self.run.ctx
        node = scores.node
        ranks = random_scores(node.numel(), ctx.seed, target) if self.params.rank == "random" else node
        ranks = -node if self.params.rank == "inverted" else ranks  # control: the highest-loss node keeps k
        keep = keep_ratios_of_measured(ranks.masked_fill(node.isnan(), float("nan")), self.params.row_k,
                                       self.params.e)
        if self.params.rank in ("uniform", "tensor"):  # controls: the same total budget, no ranking
            keep = keep.new_full(keep.shape, self.params.row_k - self.params.e / 2)
        self.run.record("keep_ratios", target, keep.float())
        members = self.groups[layer]
        if self.params.rank == "tensor":  # each group tensor trimmed as a whole at the budget: no rows, no ranks
            ctx.state.setdefault(TENSOR_STATE, {}).update({name: float(keep[0]) for name, *_ in members})
            self.run.merge([name for name, _, ndim, _ in members if ndim >= 2])
            self.run.merge([name for name, _, ndim, _ in members if ndim == 1])
            return
        slices = [(name, dim) for name, dim, ndim, _ in members if ndim == 2]
        entries = [name for name, _, ndim, _ in members if ndim == 1]
        tiles = {}
        for name, dim, ndim, span in members:
            nodes = keep.numel() if span is None else span[1] - span[0]
            shape = self.run.shape(name)
            experts = shape[0] if ndim == 3 else 1
            size = shape[dim]
            if nodes % experts or size % (nodes // experts):
                raise InvalidParameterError(
                    f"{type(self.run.adapter).__name__}.node_groups({layer}) puts {name!r} (dim {dim}: {size} "
                    f"slices{f' in each of {experts} experts' if ndim == 3 else ''}) in the group of {target!r}, "
                    f"which has {nodes} nodes there.")
            tiles[name] = size // (nodes // experts)  # a fused gate-and-up tensor: node i owns slices i and n + i
        # With e = 0 every node keeps k: the per-tensor trim of every group tensor then makes the control equal
        # per-tensor TIES exactly (M-TIES; M-DARE trims its groups at the uniform keep ratio instead).
        grouped = self.params.e > 0 or not self.uniform_keep_is_tensor_trim
        state = ctx.state.setdefault(GROUP_STATE, {})
        keep = keep.to(self.run.device)
        anchor, anchor_dim = slices[0] if slices else (None, 0)
        length = self.run.shape(anchor)[1 - anchor_dim] if entries else 0
        for name, dim, ndim, span in members:
            own = keep if span is None else keep[span[0]:span[1]]
            own = own.view(self.run.shape(name)[0], -1).repeat(1, tiles[name]) if ndim == 3 else \
                own.repeat(tiles[name])
            if not grouped:
                state.pop(name, None)
            elif ndim == 1:
                state[name] = GroupMember(own, dim, anchor=anchor, anchor_length=length)
            else:
                state[name] = GroupMember(own, dim, keeps_thresholds=name == anchor and bool(entries))
        self.run.merge([name for name, _, ndim, _ in members if ndim == 3] + [name for name, _ in slices])
        self.run.merge(entries)  # after the anchor: they are trimmed against its thresholds
        if anchor is not None:
            ctx.state.get(THRESHOLD_STATE, {}).pop(anchor, None)

    def after_all(self) -> None:
        self.run.merge_remaining()


class MTies(MergeMethod):
    """M-TIES: M-Loss-guided node-wise TIES (each node's group trimmed at its keep ratio)."""

    name = "m_ties"
    pretty_name = "M-TIES"
    reference = ("Wang et al., M-Loss: Quantifying Model Merging Compatibility with Limited Unlabeled Data, "
                 "AAAI 2026")
    reference_url = "https://arxiv.org/abs/2602.08564"
    params_class = MTiesParams
    zero_delta_is_base = True
    needs_data = True
    uniform_keep_is_tensor_trim = True

    data_use = "M-Loss node keep ratios"

    def layer_hooks(self, run: LayerwiseRun) -> LayerHooks:
        return MTiesHooks(run, self.uniform_keep_is_tensor_trim)

    def data_free_rule(self, params, *, short: bool = False) -> str:
        if short:
            return f"trimmed at k={params.k} (data-free)"
        return f"TIES (per-tensor trim at k={params.k}, sign election, disjoint mean), with lam={params.lam}"

    def trim_other_(self, name: str, tau: torch.Tensor, index: int, ctx: MergeContext) -> torch.Tensor:
        """Trim, in place, a task vector tensor outside the scored node groups."""
        from .ops import trim_tensor_

        return trim_tensor_(tau, ctx.params.k)

    def chunk_keep_counts(self, numel: int, ctx: MergeContext, name: str | None = None) -> list[int] | None:
        """A tensor outside the scored node groups (an LLM's embedding) is trimmed per tensor at k, as TIES: it may
        be merged in pieces (the driver's chunked path, the same bits). A group member is trimmed slice by slice:
        whole."""
        from .ops import keep_count

        if name is None or name in ctx.state.get(GROUP_STATE, {}):
            return None
        keep = ctx.state.get(TENSOR_STATE, {}).get(name, ctx.params.k)
        return [keep_count(numel, keep)] * len(ctx.weights)

    def merge_chunk(self, name, base, sources, ctx: MergeContext, thresholds: list[float]) -> torch.Tensor:
        from .ops import trim_elect_merge

        # |τ| >= its whole-tensor threshold, as trim_other_ keeps
        return trim_elect_merge(base, sources, thresholds, ctx.weights, lam=ctx.params.lam)

    def slice_dim(self, name: str, ctx: MergeContext) -> int | None:
        """A 2-D member of a scored node group, trimmed slice by slice: its slices merge independently."""
        member = ctx.state.get(GROUP_STATE, {}).get(name)
        if member is None or member.anchor is not None or member.keep.dim() != 1 \
                or name in ctx.state.get(TENSOR_STATE, {}):
            return None
        return member.dim

    def merge_slices(self, name, base, sources, ctx: MergeContext, slices: slice) -> torch.Tensor:
        from .ops import elect_and_merge, take_stack

        taus = take_stack(sources).sub_(base)
        self._trim_slices_(name, taus, ctx.state[GROUP_STATE][name], ctx, slices)
        merged = elect_and_merge(taus, ctx.weights)
        del taus
        return merged.mul_(ctx.params.lam).add_(base)

    @staticmethod
    def _trim_slices_(name: str, taus: torch.Tensor, member: GroupMember, ctx: MergeContext, slices: slice) -> None:
        """Trim the task vectors ``taus`` of a 2-D group member's ``slices`` in place, each slice at its keep ratio;
        an anchor's per-slice thresholds go to the state (filled block by block, from the first)."""
        import torch

        from .ops import trim_slices_

        kept = None
        if member.keeps_thresholds:
            store = ctx.state.setdefault(THRESHOLD_STATE, {})
            if slices.start == 0 or name not in store:
                store[name] = torch.empty(len(taus), member.keep.numel(), dtype=taus.dtype, device=taus.device)
            kept = store[name][:, slices]
        for i, tau in enumerate(taus):
            trim_slices_(tau, member.keep[slices], member.dim, thresholds=None if kept is None else kept[i])

    def unchanged(self, name: str, ctx: MergeContext) -> None:
        ctx.state.get(THRESHOLD_STATE, {}).pop(name, None)  # its 1-D members read the unchanged anchor's thresholds

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        import torch

        from .ops import elect_and_merge, take_stack, trim_entries_, trim_slices_, trim_tensor_

        member = ctx.state.get(GROUP_STATE, {}).get(name)
        taus = take_stack(sources).sub_(base)  # the sources' [q, ...] buffer trimmed in place, as in TIES
        tensor_keep = ctx.state.get(TENSOR_STATE, {}).get(name)
        if tensor_keep is not None:  # rank="tensor": a scored group tensor, trimmed as a whole at the budget
            for tau in taus:
                trim_tensor_(tau, tensor_keep)
        elif member is None:
            for i, tau in enumerate(taus):
                self.trim_other_(name, tau, i, ctx)
        elif member.anchor is not None:  # a node's bias entry: against the threshold of its anchor slice
            thresholds = ctx.state.get(THRESHOLD_STATE, {}).get(member.anchor)
            if thresholds is None:  # no source changed the anchor (copied from the base, never trimmed)
                thresholds = unchanged_anchor_thresholds(member).expand(len(taus), -1)
            for tau, threshold in zip(taus, thresholds):
                trim_entries_(tau, threshold)
        elif taus.dim() == 4:  # fused experts [q, E, ...]: each expert's slices at its own keep ratios
            for tau in taus:
                for expert, keep in zip(tau, member.keep):
                    trim_slices_(expert, keep, member.dim - 1)
        else:
            self._trim_slices_(name, taus, member, ctx, slice(0, member.keep.numel()))
        merged = elect_and_merge(taus, ctx.weights)
        del taus
        return merged.mul_(ctx.params.lam).add_(base)  # = base + λ·merged, bit for bit, with no temporaries


class MDare(MTies):
    """M-DARE: M-Loss node-group trim on the scored units (no rescale), DARE (×1/p) on every other tensor."""

    name = "m_dare"
    pretty_name = "M-DARE"
    params_class = MDareParams
    uniform_keep_is_tensor_trim = False

    def chunk_keep_counts(self, numel: int, ctx: MergeContext, name: str | None = None) -> list[int] | None:
        return None  # DARE's random drops are drawn over the whole tensor

    def data_free_rule(self, params, *, short: bool = False) -> str:
        if short:
            return f"DARE at p={params.p} (data-free)"
        return f"DARE (keep probability p={params.p}, survivors x 1/p), with lam={params.lam}"

    def trim_other_(self, name, tau, index, ctx: MergeContext) -> torch.Tensor:
        from .ops import dare_drop

        return tau.copy_(dare_drop(tau, ctx.params.p, ctx.generator(name, index, tau.device)))


register_merge_method(MTies())
register_merge_method(MDare())
