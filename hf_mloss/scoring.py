"""The M-Loss scorer: node and layer M-Loss of q models over a small unlabeled set, layer by layer.

For each scored linear (CLIP: ``mlp.fc1``) the pre-activations h_p = W_p u + b_p of the q sources give the gap
g = σ(Σ_p α_p h_p) − Σ_p α_p σ(h_p) at every position (sample × token). Where the input u comes from is the *prefix*:

* ``"base"`` / ``"merged"``: u is computed once per block by one shared model (the base, or the merged-so-far model
  that M-TIES builds), and the q pre-activations come from ONE stacked GEMM with the q sources' weights of that linear.
* ``"own"``: every source runs its own forward; only one block per source is in memory at a time.

Sums (not means) are accumulated per process and reduced with accelerate, so a data-parallel run is exact.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .adapters import EMBEDDING_STAGE, ModelAdapter
from .report import MLossReport
from .store import TensorStore

PREFIXES = ("own", "base", "merged")
_CHUNK_ELEMENTS = 1 << 22
REDUCTIONS = ("abs", "sq")


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


class MLossAccumulator:
    """Running sums of node / layer M-Loss for one scored linear."""

    def __init__(self, num_nodes: int, *, reduction: str = "abs", eps: float = 1e-4, device="cpu") -> None:
        self.reduction = reduction
        self.eps = eps
        self.node = torch.zeros(num_nodes, dtype=torch.float64, device=device)
        self.node_normalized = torch.zeros_like(self.node)
        self.layer = torch.zeros((), dtype=torch.float64, device=device)
        self.layer_normalized = torch.zeros_like(self.layer)
        self.count = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, h: torch.Tensor, alpha: torch.Tensor, activation: Callable) -> None:
        g, merged = node_gap(h.float(), alpha, activation)
        magnitude = g.abs()
        self.node += (magnitude if self.reduction == "abs" else g.square()).sum(0, dtype=torch.float64)
        self.node_normalized += (magnitude / (merged.abs() + self.eps)).sum(0, dtype=torch.float64)
        norm = torch.linalg.vector_norm(g, dim=1)
        self.layer += norm.sum(dtype=torch.float64)
        self.layer_normalized += (norm / (torch.linalg.vector_norm(merged, dim=1) + self.eps)).sum(dtype=torch.float64)
        self.count += g.shape[0]

    def reduce_across_processes(self) -> None:
        """Sum the running sums of every process (a no-op in a single process)."""
        from accelerate import PartialState
        from accelerate.utils import reduce

        if PartialState().num_processes > 1:
            packed = torch.cat([self.node, self.node_normalized, torch.stack([self.layer, self.layer_normalized,
                                                                               self.count])])
            packed = reduce(packed, reduction="sum")
            n = self.node.numel()
            self.node, self.node_normalized = packed[:n], packed[n : 2 * n]
            self.layer, self.layer_normalized, self.count = packed[2 * n], packed[2 * n + 1], packed[2 * n + 2]

    def means(self) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        count = self.count.clamp_min(1)
        return ((self.node / count).float().cpu(), (self.node_normalized / count).float().cpu(),
                float(self.layer / count), float(self.layer_normalized / count))


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

    def autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=self.compute_dtype)

    def scored_layers(self) -> list[int]:
        return sorted(set(range(self.adapter.num_layers) if self.layers is None else self.layers))


class LayerHooks:
    """Callbacks of a shared-prefix pass; M-TIES overrides them to merge while the prefix advances."""

    def before_stage(self, stage: int) -> None:
        """Called before the stage's forward (merge everything of the stage except the scored weight)."""

    def after_scores(self, layer: int, accumulator: MLossAccumulator) -> None:
        """Called once the scored linear of ``layer`` has its (process-reduced) M-Loss."""

    def after_all(self) -> None:
        """Called after the last block (merge the tail tensors)."""


def _stacked_target(setup: ScoringSetup, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The q sources' weights of one scored linear as one ``[q·n, d]`` matrix (+ ``[q·n]`` bias)."""
    name = setup.adapter.target_name(layer)
    weight = torch.cat([s.get_float(f"{name}.weight", setup.device) for s in setup.sources])
    has_bias = f"{name}.bias" in setup.sources[0]
    bias = torch.cat([s.get_float(f"{name}.bias", setup.device) for s in setup.sources]) if has_bias else None
    return weight, bias


@torch.inference_mode()
def score_shared_prefix(setup: ScoringSetup, hooks: LayerHooks | None = None) -> dict[str, MLossAccumulator]:
    """Score with u from ``setup.model`` (base or merged-so-far). The forward advances one block at a time."""
    hooks = hooks or LayerHooks()
    adapter, model = setup.adapter, setup.model
    scored = setup.scored_layers()
    last_needed = max(scored) if scored else -1
    results: dict[str, MLossAccumulator] = {}
    hooks.before_stage(EMBEDDING_STAGE)
    with setup.autocast():
        hidden = [adapter.embed(model, b.to(setup.device)) for b in setup.batches]
    blocks = adapter.layers(model)
    q = len(setup.sources)
    bar = tqdm(range(adapter.num_layers), desc="M-Loss (shared prefix)", unit="layer", disable=not setup.progress)
    for layer in bar:
        hooks.before_stage(layer)
        if layer > last_needed:  # nothing left to score: the remaining stages only need merging
            continue
        block = blocks[layer]
        with setup.autocast():
            halves = [adapter.forward_to_target(block, h) for h in hidden]
        if layer in scored:
            weight, bias = _stacked_target(setup, layer)
            acc = MLossAccumulator(weight.shape[0] // q, reduction=setup.reduction, eps=setup.eps, device=setup.device)
            # Positions in chunks of ~4 M pre-activations: the q-stacked h and σ(h) of a whole ViT-L/14 batch would be
            # 2 x 539 MB; chunks bound that memory whatever the batch size, with the same sums. 16 MB buffers stay under
            # glibc's mmap threshold (32 MB), so they are reused instead of page-faulted in afresh: on a ViT-B/32 fc1
            # x 8 this took the system time of a layer from 0.4 s to ~0.01 s at equal user time.
            rows = max(1, _CHUNK_ELEMENTS // weight.shape[0])
            for _, u in halves:
                for flat in u.reshape(-1, u.shape[-1]).split(rows):
                    with setup.autocast():
                        h = nn.functional.linear(flat, weight.to(flat.dtype),
                                                 None if bias is None else bias.to(flat.dtype))
                    acc.add(h.reshape(flat.shape[0], q, -1), setup.alpha, setup.activation)
            acc.reduce_across_processes()
            results[adapter.target_name(layer)] = acc
            hooks.after_scores(layer, acc)
        if layer < last_needed:
            with setup.autocast():
                hidden = [adapter.forward_from_target(block, r, u) for r, u in halves]
    hooks.after_all()
    return results


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
                acc.add(h.reshape(-1, *h.shape[-2:]), setup.alpha, setup.activation)
        if acc is not None:
            acc.reduce_across_processes()
            results[adapter.target_name(layer)] = acc
        del copies
    return results


def build_report(setup: ScoringSetup, results: dict[str, MLossAccumulator], *, prefix: str, models: list[str],
                 num_samples: int, keep_ratios: dict[str, torch.Tensor] | None = None) -> MLossReport:
    node, node_norm, layer, layer_norm = {}, {}, {}, {}
    positions = 0
    for name, acc in results.items():
        node[name], node_norm[name], layer[name], layer_norm[name] = acc.means()
        positions = int(acc.count)
    return MLossReport(
        node=node, node_normalized=node_norm, layer=layer, layer_normalized=layer_norm, prefix=prefix,
        reduction=setup.reduction, activation=setup.activation_name, eps=setup.eps, num_samples=num_samples,
        num_positions=positions, models=models, weights=setup.alpha.tolist(), keep_ratios=keep_ratios or {},
        compute_dtype=str(setup.compute_dtype).replace("torch.", ""),
    )
