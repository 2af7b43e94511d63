"""The M-Loss scorer: node and layer M-Loss of q models over a small unlabeled set, layer by layer.

For each scored linear (CLIP: ``mlp.fc1``) the pre-activations h_p = W_p u + b_p of the q sources give the gap
g = σ(Σ_p α_p h_p) − Σ_p α_p σ(h_p) at every position (sample × token). Where the input u comes from is the *prefix*:

* ``"base"`` / ``"merged"``: u is computed once per block by one shared model (the base, or the merged-so-far model
  that M-TIES builds), and the q pre-activations come from ONE stacked GEMM with the q sources' weights of that linear.
* ``"own"``: every source runs its own forward; only one block per source is in memory at a time.

Sums (not means) are accumulated per process and reduced with accelerate, so a data-parallel run is exact. The
weights α are normalised (α/Σα) before scoring: M-Loss compares the ensemble with a convex combination, so scaling
all weights together must not change it.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .adapters import EMBEDDING_STAGE, ModelAdapter
from .config import DEFAULT_NUM_SAMPLES, MergeConfig
from .errors import InvalidParameterError
from .methods.base import LayerHooks
from .options import PREFIXES, REDUCTIONS, ScoringOptions
from .parallel import Workers, cpu_workers
from .parallel import active as active_workers
from .report import MLossReport
from .store import TensorStore

if TYPE_CHECKING:
    from .data import DataInfo
    from .inputs import RunInputs

__all__ = ["PREFIXES", "REDUCTIONS", "LayerScores", "MLossAccumulator", "score"]
_BLOCK_ELEMENTS = 1 << 19
"""Pre-activations ``[positions, q, nodes]`` per block of the shared-prefix kernel on a CPU (2 MB of float32)."""
_BLOCK_ELEMENTS_ACCELERATOR = 1 << 24
_OWN_BLOCK_ELEMENTS = 1 << 21
"""Pre-activations per block of the own-prefix kernel :func:`gap_sums` on a CPU (8 MB of float32; measured on
[800, 8, 3072], quick_gelu, 2 threads: 0.09 s against 0.20-0.22 s for :meth:`MLossAccumulator.add` on the whole
batch; blocks of 2 MB had more parallel regions and stalled when other processes shared the cores)."""
_MAX_ROWS = 1024
"""Positions per block (ViT-B/32, batch 16: 800)."""


def node_gap(h: torch.Tensor, alpha: torch.Tensor, activation: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """Gap and merged activation for pre-activations ``h`` of shape ``[positions, q, nodes]``.

    Returns ``(g, merged)`` with ``merged = σ(Σ_p α_p h_p)`` and ``g = merged − Σ_p α_p σ(h_p)``, both
    ``[positions, nodes]``.
    """
    alpha = alpha.to(h)
    # alpha @ h is a batched [1, q] x [q, nodes] product on h as it lies; einsum("q,pqn->pn") copied h first
    # (measured: 0.14 ms vs 1.2 ms for a [170, 8, 3072] chunk, identical values).
    merged = activation(torch.matmul(alpha, h))
    ensemble = torch.matmul(alpha, activation(h))
    return merged - ensemble, merged


@dataclass
class LayerScores:
    """M-Loss of one scored linear: per node (row) and for the whole layer, plain and normalised."""

    node: torch.Tensor
    """Mean over positions of |g_i| (``reduction="abs"``) or g_i² (``"sq"``), one value per row."""
    node_normalized: torch.Tensor
    """Mean over positions of |g_i| / (|σ(Σα h_i)| + ε) (heavy-tailed where σ(Σα h_i) ≈ 0)."""
    node_ratio: torch.Tensor
    """Σ_positions |g_i| / Σ_positions |σ(Σα h_i)|: the stable normalised summary."""
    layer: float
    """Mean over positions of ‖g‖₂."""
    layer_normalized: float
    """Mean over positions of ‖g‖₂ / (‖σ(Σα h)‖₂ + ε)."""
    layer_ratio: float
    """Σ_positions ‖g‖₂ / Σ_positions ‖σ(Σα h)‖₂."""


class MLossAccumulator:
    """Running sums of node / layer M-Loss for one scored linear."""

    def __init__(self, num_nodes: int, *, reduction: str = "abs", eps: float = 1e-4, device="cpu") -> None:
        self.reduction = reduction
        self.eps = eps
        # per node: the reduced gap, the per-position normalised gap, |σ(αh)|, and |g| (kept apart only for "sq");
        # per layer: ‖g‖, the normalised ‖g‖, ‖σ(αh)‖, and the number of positions
        self.node = torch.zeros(4, num_nodes, dtype=torch.float64, device=device)
        self.layer = torch.zeros(4, dtype=torch.float64, device=device)

    def add(self, h: torch.Tensor, alpha: torch.Tensor, activation: Callable) -> None:
        """Add the pre-activations ``h`` (``[positions, q, nodes]``) of some positions: the plain definition (the
        scorers use the fused :func:`gap_sums` / :class:`StackedTarget` kernels, tested against this)."""
        g, merged = node_gap(h.float(), alpha, activation)
        squares = node_sums(self.node, g, merged, reduction=self.reduction, eps=self.eps)
        add_position_sums(self.layer, *squares, eps=self.eps)

    def add_sums(self, node: torch.Tensor, layer: torch.Tensor) -> None:
        """Add running sums computed elsewhere (a :class:`StackedTarget` pass over one batch)."""
        self.node += node
        self.layer += layer

    @property
    def count(self) -> torch.Tensor:
        return self.layer[3]

    def reduce_across_processes(self) -> None:
        """Sum the running sums of every process (a no-op in a single process)."""
        from accelerate import PartialState
        from accelerate.utils import reduce

        if PartialState().num_processes > 1:
            packed = reduce(torch.cat([self.node.flatten(), self.layer]), reduction="sum")
            self.node, self.layer = packed[: self.node.numel()].view_as(self.node), packed[self.node.numel():]

    def scores(self) -> LayerScores:
        """The means (and ratios of sums) accumulated so far."""
        count = self.layer[3].clamp_min(1)
        gap_sum = self.node[0] if self.reduction == "abs" else self.node[3]
        tiny = torch.finfo(torch.float64).tiny
        return LayerScores(
            node=(self.node[0] / count).float().cpu(), node_normalized=(self.node[1] / count).float().cpu(),
            node_ratio=(gap_sum / self.node[2].clamp_min(tiny)).float().cpu(), layer=float(self.layer[0] / count),
            layer_normalized=float(self.layer[1] / count), layer_ratio=float(self.layer[0] / self.layer[2].clamp_min(tiny)),
        )

def node_sums(node: torch.Tensor, g: torch.Tensor, merged: torch.Tensor, *, reduction: str,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the per-node sums of gaps ``g`` and merged activations (``[positions, nodes]``) into ``node`` (rows as in
    :class:`MLossAccumulator`); returns the per-position Σg² and Σσ(αh)² over these nodes (float32)."""
    magnitude, merged_magnitude, squares = g.abs(), merged.abs(), g.square()
    if reduction == "abs":
        node[0] += magnitude.sum(0, dtype=torch.float64)
    else:
        node[0] += squares.sum(0, dtype=torch.float64)
        node[3] += magnitude.sum(0, dtype=torch.float64)
    node[2] += merged_magnitude.sum(0, dtype=torch.float64)
    node[1] += magnitude.div_(merged_magnitude.add_(eps)).sum(0, dtype=torch.float64)
    return squares.sum(1), merged.square().sum(1)


def add_position_sums(layer: torch.Tensor, squares: torch.Tensor, merged_squares: torch.Tensor, *, eps: float) -> None:
    """Add the layer sums of some positions given their Σg² and Σσ(αh)² over every node (``layer`` as in
    :class:`MLossAccumulator`)."""
    norm, merged_norm = squares.sqrt(), merged_squares.sqrt()
    layer[0] += norm.sum(dtype=torch.float64)
    layer[1] += (norm / (merged_norm + eps)).sum(dtype=torch.float64)
    layer[2] += merged_norm.sum(dtype=torch.float64)
    layer[3] += norm.shape[0]


def inplace_activation(activation: Callable) -> tuple[float, Callable[[torch.Tensor], torch.Tensor]]:
    """``(s, f)`` with σ(x) = f(s·x)/s and ``f`` writing its result into its argument (and returning it).

    quick_gelu is x·sigmoid(1.702x) = silu(1.702x)/1.702: folding 1.702 into the stacked weights makes the q copies'
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


class StackedTarget:
    """The q sources' weights of one scored linear, in node blocks, and the fused scoring kernel over them.

    For u of some positions, block j holds nodes [a, b) of every source: ONE GEMM gives the ``[positions, q, b-a]``
    pre-activations, which are reduced while they are in cache: the weighted sums over q (batched matmuls), the
    activation in place, then per-node sums and per-position squared norms. Only per-node and per-position sums
    leave a block. On ViT-B/32 × 8 fc1 (800 positions, 1 thread) this took 246 ms against 428-478 ms for the
    whole-layer GEMM followed by :meth:`MLossAccumulator.add`, whose GEMM alone took 247 ms.
    """

    def __init__(self, setup: ScoringSetup, layer: int) -> None:
        name = setup.adapter.target_name(layer)
        sources, device = setup.sources, setup.device
        self.q, self.alpha, self.reduction, self.eps = len(sources), setup.alpha, setup.reduction, setup.eps
        self.scale, self.activation = inplace_activation(setup.activation)
        weights = [s.get_float(f"{name}.weight", device) for s in sources]
        has_bias = f"{name}.bias" in sources[0]
        biases = [s.get_float(f"{name}.bias", device) for s in sources] if has_bias else None
        self.num_nodes = weights[0].shape[0]
        if torch.device(device).type == "cpu":  # blocks of ~2 MB of pre-activations: 1024 positions × q × 64 nodes
            self.rows = _MAX_ROWS
            nodes = max(1, _BLOCK_ELEMENTS // (self.q * self.rows))
        else:  # one block, positions in chunks of 64 MB of pre-activations
            nodes = self.num_nodes
            self.rows = max(1, _BLOCK_ELEMENTS_ACCELERATOR // (self.q * nodes))
        self.blocks = [(a, min(a + nodes, self.num_nodes)) for a in range(0, self.num_nodes, nodes)]
        self.weight: list[torch.Tensor] = []
        self.bias: list[torch.Tensor | None] = []
        dtype = setup.compute_dtype
        for a, b in self.blocks:  # [q·(b−a), d]: source p's rows a..b at p·(b−a)
            self.weight.append(torch.cat([w[a:b] for w in weights]).to(dtype))
            self.bias.append(torch.cat([c[a:b] for c in biases]).to(dtype) if has_bias else None)

    def partial_sums(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Node and layer sums (as in :class:`MLossAccumulator`) over the positions of ``u`` (``[..., d]``)."""
        node = torch.zeros(4, self.num_nodes, dtype=torch.float64, device=u.device)
        layer = torch.zeros(4, dtype=torch.float64, device=u.device)
        eps = self.eps * self.scale  # gaps come scaled by s: |g|/(|σ|+ε) = |s·g|/(|s·σ|+s·ε)
        for rows in u.reshape(-1, u.shape[-1]).split(self.rows):
            rows = rows.to(self.weight[0].dtype)
            squares = torch.zeros(2, rows.shape[0], dtype=torch.float64, device=u.device)
            for (a, b), weight, bias in zip(self.blocks, self.weight, self.bias):
                h = nn.functional.linear(rows, weight, bias).float().view(rows.shape[0], self.q, b - a)
                g, merged = scaled_gap(h, self.alpha, self.scale, self.activation)
                squares += torch.stack(node_sums(node[:, a:b], g, merged, reduction=self.reduction, eps=eps))
            add_position_sums(layer, *squares, eps=eps)
        unscale_sums(node, layer, self.scale, self.reduction)
        return node, layer


def scaled_gap(h: torch.Tensor, alpha: torch.Tensor, scale: float, f: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """(s·g, s·σ(Σαh)) from pre-activations ``h`` (``[positions, q, nodes]``, overwritten), with σ(x) = f(s·x)/s.

    With f in place (:func:`inplace_activation`) these are f(s·Σαh) − Σα·f(s·h) and f(s·Σαh): one in-place scaling
    and one in-place activation of the q copies, and no division per entry.
    """
    alpha = alpha.to(h)
    merged = torch.matmul(alpha, h)
    if scale != 1.0:
        h.mul_(scale)
        merged.mul_(scale)
    merged = f(merged)
    ensemble = torch.matmul(alpha, f(h))
    return ensemble.neg_().add_(merged), merged


def unscale_sums(node: torch.Tensor, layer: torch.Tensor, scale: float, reduction: str) -> None:
    """Sums of s·g and s·σ (rows as in :class:`MLossAccumulator`) back to sums of g and σ, in place (the normalised
    sums are scale-free)."""
    if scale != 1.0:
        node[0] /= scale if reduction == "abs" else scale**2
        node[2:4] /= scale
        layer[0::2] /= scale


def gap_sums(h: torch.Tensor, alpha: torch.Tensor, activation: Callable, *, reduction: str = "abs", eps: float = 1e-4
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Node and layer sums (rows as in :class:`MLossAccumulator`) of pre-activations ``h`` (``[positions, q,
    nodes]``, float32, overwritten): :meth:`MLossAccumulator.add` with the activation folded and in place
    (:func:`inplace_activation`), over blocks of positions that stay in cache; for ``add_sums``."""
    scale, f = inplace_activation(activation)
    q, n = h.shape[-2:]
    node = torch.zeros(4, n, dtype=torch.float64, device=h.device)
    layer = torch.zeros(4, dtype=torch.float64, device=h.device)
    rows = max(1, _OWN_BLOCK_ELEMENTS // (q * n)) if h.device.type == "cpu" else h.shape[0]
    for block in h.split(rows):
        g, merged = scaled_gap(block, alpha, scale, f)
        add_position_sums(layer, *node_sums(node, g, merged, reduction=reduction, eps=eps * scale), eps=eps * scale)
    unscale_sums(node, layer, scale, reduction)
    return node, layer


@dataclass
class ScoringSetup:
    """Everything a layer-wise scoring pass needs."""

    adapter: ModelAdapter
    model: PreTrainedModel
    """The model that runs the shared prefix (base or merged-so-far); for ``prefix="own"`` a worker whose blocks are
    copied and refilled with each source's weights."""
    sources: Sequence[TensorStore]
    alpha: torch.Tensor
    batches: Sequence[torch.Tensor]
    activation: Callable
    activation_name: str
    reduction: str = "abs"
    eps: float = 1e-4
    layers: Sequence[int] | None = None
    device: torch.device | str = "cpu"
    compute_dtype: torch.dtype = torch.float32
    progress: bool = True
    prefix: str = "own"
    num_samples: int = 0
    workers: Workers | None = None
    """Where the batches of a shared-prefix pass run (default: the run's pool, see :mod:`hf_mloss.parallel`)."""

    @property
    def pool(self) -> Workers:
        return self.workers or active_workers()

    def autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=self.compute_dtype)

    def scored_layers(self) -> list[int]:
        return sorted(set(range(self.adapter.num_layers) if self.layers is None else self.layers))


@torch.inference_mode()
def score_shared_prefix(setup: ScoringSetup, hooks: LayerHooks | None = None) -> dict[str, MLossAccumulator]:
    """Score with u from ``setup.model`` (base or merged-so-far). The forward advances one block at a time.

    The batches of a block run on the run's workers; each returns its sums, which are added in batch order.
    """
    hooks = hooks or LayerHooks()
    adapter, model, pool = setup.adapter, setup.model, setup.pool
    scored = setup.scored_layers()
    last_needed = max(scored) if scored else -1
    results: dict[str, MLossAccumulator] = {}
    hooks.before_stage(EMBEDDING_STAGE)
    hidden = pool.map(lambda b: _embed(setup, b), setup.batches)
    blocks = adapter.layers(model)
    bar = tqdm(range(adapter.num_layers), desc="M-Loss (shared prefix)", unit="layer", disable=not setup.progress)
    for layer in bar:
        hooks.before_stage(layer)
        if layer > last_needed:  # nothing left to score: the remaining stages only need merging
            continue
        block = blocks[layer]
        target = StackedTarget(setup, layer) if layer in scored else None
        halves = pool.map(lambda h: _to_target(setup, block, h, target), hidden)
        if target is not None:
            acc = MLossAccumulator(target.num_nodes, reduction=setup.reduction, eps=setup.eps, device=setup.device)
            for _, _, sums in halves:
                acc.add_sums(*sums)
            acc.reduce_across_processes()
            results[adapter.target_name(layer)] = acc
            hooks.after_scores(layer, acc.scores())
        del target
        if layer < last_needed:
            hidden = pool.map(lambda half: _from_target(setup, block, half), halves)
    hooks.before_stage(adapter.num_layers)  # the tail (final norm)
    hooks.after_all()
    return results


def _embed(setup: ScoringSetup, pixels: torch.Tensor) -> torch.Tensor:
    with setup.autocast():
        return setup.adapter.embed(setup.model, pixels.to(setup.device))


def _to_target(setup: ScoringSetup, block: nn.Module, hidden: torch.Tensor, target: StackedTarget | None):
    """One batch up to the scored linear: (residual, its input u, the batch's M-Loss sums or None)."""
    with setup.autocast():
        residual, u = setup.adapter.forward_to_target(block, hidden)
    return residual, u, target.partial_sums(u) if target is not None else None


def _from_target(setup: ScoringSetup, block: nn.Module, half: tuple) -> torch.Tensor:
    residual, u, _ = half
    with setup.autocast():
        return setup.adapter.forward_from_target(block, residual, u)


def _load_block(module: nn.Module, store: TensorStore, prefix: str, device) -> None:
    """Fill a copy of one block with a source's weights; every parameter must come from the source."""
    expected = {key: value for key, value in module.state_dict().items()}
    missing = [prefix + key for key, value in expected.items() if prefix + key not in store and
               key in dict(module.named_parameters())]
    if missing:
        raise KeyError(f"{store.ref.name!r} has no tensor {missing[0]!r}: the adapter's names do not match the block.")
    state = {key: store.get(prefix + key).to(device=device, dtype=value.dtype)
             for key, value in expected.items() if prefix + key in store}
    module.load_state_dict(state, strict=False)


@torch.inference_mode()
def score_own_prefix(setup: ScoringSetup) -> dict[str, MLossAccumulator]:
    """Score with every source running its own forward (the paper's definition; q forwards).

    Memory: the worker model, q copies of ONE block, and q sets of hidden states.
    """
    adapter, worker = setup.adapter, setup.model
    scored = setup.scored_layers()
    results: dict[str, MLossAccumulator] = {}
    embed_names = [n for n in setup.sources[0].keys() if adapter.stage_of(n) == EMBEDDING_STAGE]
    hidden: list[list[torch.Tensor]] = []
    worker_state = {adapter.canonical_key(k): v for k, v in worker.state_dict().items()}
    for store in setup.sources:
        for name in embed_names:
            if name in worker_state:
                worker_state[name].copy_(store.get(name))
        with setup.autocast():
            hidden.append([adapter.embed(worker, b.to(setup.device)) for b in setup.batches])
    blocks = adapter.layers(worker)
    last_needed = max(scored) if scored else -1
    bar = tqdm(range(last_needed + 1), desc="M-Loss (own prefix)", unit="layer", disable=not setup.progress)
    for layer in bar:
        copies = []
        for store in setup.sources:
            block = copy.deepcopy(blocks[layer])
            _load_block(block, store, adapter.layer_prefix(layer), setup.device)
            copies.append(block)
        target = adapter.target_suffix
        acc = None
        if layer in scored:
            n = copies[0].get_submodule(target).out_features
            acc = MLossAccumulator(n, reduction=setup.reduction, eps=setup.eps, device=setup.device)
        for b in range(len(setup.batches)):
            pre = []
            for p, block in enumerate(copies):
                with setup.autocast():
                    residual, u = adapter.forward_to_target(block, hidden[p][b])
                    if acc is not None:
                        pre.append(block.get_submodule(target)(u).float())
                    if layer < last_needed:
                        hidden[p][b] = adapter.forward_from_target(block, residual, u)
            if acc is not None:
                h = torch.stack(pre, dim=-2)
                acc.add_sums(*gap_sums(h.view(-1, *h.shape[-2:]), setup.alpha, setup.activation,
                                       reduction=setup.reduction, eps=setup.eps))
        if acc is not None:
            acc.reduce_across_processes()
            results[adapter.target_name(layer)] = acc
        del copies
    return results


def build_report(setup: ScoringSetup, results: dict[str, MLossAccumulator], *, models: list[str],
                 data_info: DataInfo | None = None, records: dict[str, dict[str, torch.Tensor]] | None = None
                 ) -> MLossReport:
    """The :class:`MLossReport` of a scoring pass (``records``: per-row values a merge kept, e.g. keep ratios)."""
    from .distributed import describe_device

    scores = {name: acc.scores() for name, acc in results.items()}
    positions = int(next(iter(results.values())).count) if results else 0
    return MLossReport(
        node={k: v.node for k, v in scores.items()}, node_normalized={k: v.node_normalized for k, v in scores.items()},
        layer={k: v.layer for k, v in scores.items()},
        layer_normalized={k: v.layer_normalized for k, v in scores.items()},
        layer_ratio={k: v.layer_ratio for k, v in scores.items()},
        node_ratio={k: v.node_ratio for k, v in scores.items()}, prefix=setup.prefix, reduction=setup.reduction,
        activation=setup.activation_name, eps=setup.eps, num_samples=setup.num_samples, num_positions=positions,
        models=models, weights=setup.alpha.tolist(), keep_ratios=(records or {}).get("keep_ratios", {}),
        compute_dtype=str(setup.compute_dtype).replace("torch.", ""),
        data={**data_info.to_dict(), **data_info.sample_stats()} if data_info is not None else {},
        device=describe_device(setup.device),
    )


def make_setup(inputs: RunInputs, model: PreTrainedModel, options: ScoringOptions, config: MergeConfig, *,
               progress: bool = True) -> ScoringSetup:
    """A scoring pass over ``inputs``' images with ``model`` as the shared-prefix (or scratch) model."""
    from .inputs import as_dtype

    activation, activation_name = resolve_activation(inputs.adapter, options.activation)
    alpha = inputs.alpha / inputs.alpha.sum()  # M-Loss compares with a convex combination (SPEC §1)
    return ScoringSetup(
        adapter=inputs.adapter, model=model, sources=inputs.sources, alpha=alpha.float().to(inputs.device),
        batches=shard_batches(inputs.pixels, config.batch_size), activation=activation,
        activation_name=activation_name, reduction=options.reduction, eps=options.eps, layers=options.layers,
        device=inputs.device, compute_dtype=resolve_compute_dtype(as_dtype(config.compute_dtype), inputs.device),
        progress=progress, prefix=options.prefix, num_samples=len(inputs.pixels),
    )


def resolve_compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The scoring dtype: bfloat16 on a CPU only where it has bf16 instructions (AVX512-BF16 or AMX), float32 else.

    Without them every bf16 GEMM converts to float32 inside the kernel and is slower than float32 itself; with them
    (measured on a Xeon with AMX, ViT-B/32 × 8, 32 images) bf16 scoring took 5.3-6.0 s against 13.2-18.5 s.
    """
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or native_cpu_bf16():
        return dtype
    warnings.warn("compute_dtype='bfloat16' asked for, but this CPU has no bf16 instructions (avx512_bf16 / amx_bf16), "
                  "where bf16 is slower than float32: scoring in float32 (the report records it).", stacklevel=3)
    return torch.float32


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bf16 dot products natively (AVX512-BF16 or AMX-BF16)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private helpers of torch.cpu; read the CPU flags instead
        try:
            flags = open("/proc/cpuinfo").read()
        except OSError:
            return False
        return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_activation(adapter: ModelAdapter, activation: str | None) -> tuple[Callable, str]:
    """The activation the M-Loss uses: the model's own, or a named override from transformers' ``ACT2FN``."""
    from transformers.activations import ACT2FN

    if activation is None:
        return adapter.activation(), adapter.config.hidden_act
    return ACT2FN[activation], activation


def shard_batches(pixels: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """This process's share of the samples (every ``world``-th one), in batches of ``batch_size``."""
    from accelerate import PartialState

    state = PartialState()
    share = pixels[state.process_index :: state.num_processes]
    return list(share.split(batch_size))


def score(
    base: Any,
    models: Sequence[Any],
    data: Any,
    *,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    batch_size: int = 16,
    weights: Sequence[float] | None = None,
    prefix: str = "own",
    reduction: str = "abs",
    activation: str | None = None,
    eps: float = 1e-4,
    layers: Sequence[int] | None = None,
    seed: int = 0,
    split: str = "train",
    image_column: str | None = None,
    text_column: str | None = None,
    max_length: int | None = None,
    compute_dtype: str = "float32",
    revision: str | Sequence[str | None] | None = None,
    processor: Any = None,
    method: str = "m_ties",
    device: str | torch.device | None = None,
    token: str | bool | None = None,
    progress: bool = True,
    **method_params: Any,
) -> MLossReport:
    """Measure mergeability without merging: node and layer M-Loss of ``models`` over unlabeled ``data``.

    Args:
        base, models, data, weights, seed, revision, processor, text_column, max_length, token: as in
            :func:`hf_mloss.merge`.
        prefix: where each scored linear's input comes from: ``"own"`` (each model's own forward, the paper's
            definition; q forwards), ``"base"`` (the base model's forward, shared), or ``"merged"`` (the
            merged-so-far model of a ``method`` merge, M-TIES by default, with ``method_params`` such as ``k``/``e``).
        reduction: ``"abs"`` (mean |g|, the paper) or ``"sq"`` (mean g², the authors' code).
        activation: override the model's own activation (e.g. ``"gelu_pytorch_tanh"`` as in the reference code).
        eps: ε of the per-position normalised M-Loss.
        layers: blocks to score (default: all).

    Returns:
        An :class:`~hf_mloss.report.MLossReport` (``.summary()`` prints the per-layer table).

    Example:
        ```python
        >>> report = hf_mloss.score("openai/clip-vit-base-patch32", ["org/ft-a", "org/ft-b"], data="tanganke/dtd")
        >>> print(report.summary())
        ```
    """
    options = ScoringOptions(prefix=prefix, reduction=reduction, activation=activation, eps=eps,
                             layers=tuple(layers) if layers is not None else None)
    if prefix != "merged" and method_params:
        raise InvalidParameterError(f"Unknown argument(s) {sorted(method_params)} for score() with prefix={prefix!r} "
                                    "(method parameters apply only with prefix='merged').")
    config = MergeConfig.from_kwargs(base, models, method, weights=weights, revision=revision, data=data,
                                     num_samples=num_samples, split=split, image_column=image_column,
                                     text_column=text_column, max_length=max_length, seed=seed,
                                     batch_size=batch_size, compute_dtype=compute_dtype, processor=processor,
                                     score=options, **method_params)
    return run_score(config, device=device, token=token, progress=progress)


def run_score(config: MergeConfig, *, device: Any = None, token: str | bool | None = None,
              progress: bool = True) -> MLossReport:
    """Score a validated config (see :meth:`MergeConfig.run_score`)."""
    from .inputs import open_inputs

    options = config.scoring_options()
    if options.prefix == "merged":
        return _score_merged(config, options, device=device, token=token, progress=progress)
    with open_inputs(config, device=device, token=token, needs_data=True, progress=progress) as inputs, \
            cpu_workers(inputs.device):
        model = inputs.adapter.tower(inputs.load_output_model("tower", progress=progress))
        setup = make_setup(inputs, model, options, config, progress=progress)
        results = score_shared_prefix(setup) if options.prefix == "base" else score_own_prefix(setup)
        return build_report(setup, results, models=[r.name for r in inputs.refs], data_info=inputs.data_info)


def _score_merged(config: MergeConfig, options: ScoringOptions, **run: Any) -> MLossReport:
    """The M-Loss a data-guided merge measures on its merged prefix (the merge is run and dropped)."""
    from .merger import run_merge

    method = config.merge_method()
    if not method.needs_data:
        raise InvalidParameterError(f"prefix='merged' scores the prefix of a data-guided merge; method "
                                    f"{config.method!r} uses no data (use m_ties or m_dare).")
    scoring = {k: v for k, v in options.to_dict().items() if k != "prefix" and v is not None}
    parameters = {**config.parameters, **scoring}  # the score options win, as documented for `score:`
    return run_merge(config.replace(parameters=parameters, output="tower"), **run).report
