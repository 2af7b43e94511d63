"""Gram matrices of every linear layer's inputs, block by block: what RegMean and RegMean++ solve from.

:class:`GramRecorder` hooks every ``nn.Linear`` of one block and sums XᵀX over the positions that count (padding never
does) in float64; linears that read the same input tensor (a block's q, k and v projections) share one Gram. One
block of q models is folded as it is walked (:class:`BlockRegression`): after model p's batches, its Grams G_p join

    S = Σ_p α_p G_p        and, per linear,        B = Σ_p α_p G'_p W_pᵀ,   G'_p = r·G_p + (1 − r)·diag(G_p)

so a block holds one Gram per input of the model being walked plus S and B, whatever q is; the merged weight is
W* = (r·S + (1 − r)·diag(S))⁻¹ B, transposed (solved in float64). S and B are sums, so the processes of a
data-parallel run add theirs up exactly before the solve (:func:`~hf_mloss.engine.kernel.reduce_sums`).

The two walks: :func:`own_gram_walk` runs every model on its own forward (RegMean), one copy of one block per model
at a time; :func:`merged_gram_walk` runs every model's block on the hidden states of the merged blocks before it, then
advances those states through the merged block (RegMean++). Leading blocks that no model changed run once.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..adapters import EMBEDDING_STAGE
from .kernel import reduce_sums
from .walk import BatchState, BlockArena, WalkSetup, _own_embeddings, embed_batches, is_streamed, load_block, \
    release_block

__all__ = ["BlockRegression", "GramRecorder", "block_linears", "gram_dtypes", "merged_gram_walk", "own_gram_walk"]


def block_linears(block: nn.Module) -> dict[str, nn.Module]:
    """The linear layers of one block, by their path in it (``self_attn.q_proj``): ``nn.Linear`` and GPT-2's
    ``Conv1D`` (its weight stored ``[in, out]``)."""
    from transformers.pytorch_utils import Conv1D

    return {path: module for path, module in block.named_modules() if isinstance(module, (nn.Linear, Conv1D))}


def _weight(module: nn.Module) -> torch.Tensor:
    """A linear layer's weight as ``[out, in]`` (a ``Conv1D``'s transposed)."""
    return module.weight if isinstance(module, nn.Linear) else module.weight.T


def gram_dtypes(device: torch.device | str) -> tuple[torch.dtype, torch.dtype]:
    """``(product, sum)`` dtypes of the Grams on ``device``. On a CPU both float64: a float64 product costs about
    twice a float32 one there, and it makes the sums independent of how the positions are grouped into batches and
    processes (float32 products of other groupings differ in the last bits, which the solve amplifies by the Grams'
    condition number: 3e-6 relative on a tiny CLIP). On an accelerator the products are float32 (consumer GPUs
    compute float64 at 1/64 of the rate) summed in float64; MPS has no float64 at all."""
    kind = torch.device(device).type
    if kind == "cpu":
        return torch.float64, torch.float64
    return torch.float32, torch.float32 if kind == "mps" else torch.float64


class GramRecorder:
    """Sums XᵀX of the inputs of ``block``'s linear layers while it runs (forward pre-hooks), counting only the
    positions of :attr:`mask` (``[batch, seq]`` bool; ``None``: every position). Linears fed the same tensor in one
    forward share one Gram (computed once). Dtypes: :func:`gram_dtypes`."""

    def __init__(self, block: nn.Module, linears: Sequence[str], device: torch.device | str = "cpu") -> None:
        self.grams: dict[str, torch.Tensor] = {}
        """Linear path → Σ XᵀX (linears that shared their input hold the same tensor)."""
        self.product_dtype, self.sum_dtype = gram_dtypes(device)
        self.mask: torch.Tensor | None = None
        self._last: tuple[torch.Tensor, str] | None = None
        self._handles = [block.get_submodule(path).register_forward_pre_hook(self._hook(path)) for path in linears]

    def _hook(self, path: str) -> Callable:
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0]
            if self._last is not None and self._last[0] is x:  # q / k / v: one input, one Gram
                self.grams.setdefault(path, self.grams[self._last[1]])
                return
            rows = x.detach().reshape(-1, x.shape[-1])
            if self.mask is not None and self.mask.numel() == rows.shape[0]:
                rows = rows[self.mask.reshape(-1)]
            rows = rows.to(self.product_dtype)
            gram = rows.T @ rows
            if path not in self.grams:
                self.grams[path] = torch.zeros(gram.shape, dtype=self.sum_dtype, device=gram.device)
            self.grams[path] += gram
            self._last = (x, path)

        return record

    def next_batch(self, mask: torch.Tensor | None) -> None:
        """Start a batch: its positions that count, and no input seen yet."""
        self.mask, self._last = mask, None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._last = [], None


class BlockRegression:
    """The running S and B of one block's linears over the q models (see the module docstring)."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.gram_sums: dict[str, torch.Tensor] = {}
        """Linear path → S (linears that share their input share it)."""
        self.targets: dict[str, torch.Tensor] = {}
        """Linear path → B (``[in, out]``, float64)."""
        self.transposed: set[str] = set()
        """The paths of ``Conv1D`` layers (weights stored ``[in, out]``)."""

    @torch.no_grad()
    def fold(self, grams: dict[str, torch.Tensor], linears: dict[str, nn.Linear], alpha: float) -> None:
        """Add one model's Grams, with that model's linear weights ``linears``, at weight ``alpha``."""
        sums_of: dict[int, torch.Tensor] = {}
        self.transposed |= {path for path in grams if not isinstance(linears[path], nn.Linear)}
        for path, gram in grams.items():
            key = id(gram)
            if key not in sums_of:
                if path not in self.gram_sums:
                    sums_of[key] = self.gram_sums[path] = torch.zeros_like(gram)
                else:
                    sums_of[key] = self.gram_sums[path]
                sums_of[key].add_(gram, alpha=alpha)
            self.gram_sums.setdefault(path, sums_of[key])
            dtype = gram_dtypes(gram.device)[0]  # float64 on a CPU: the sums of two processes add up to one's
            reduced = self._reduced(gram).to(dtype)
            product = (reduced @ _weight(linears[path]).detach().to(dtype).T).to(gram.dtype)
            if path not in self.targets:
                self.targets[path] = torch.zeros_like(product)
            self.targets[path].add_(product, alpha=alpha)

    def _reduced(self, gram: torch.Tensor) -> torch.Tensor:
        """r·G + (1 − r)·diag(G)."""
        out = gram * self.ratio
        out.diagonal().add_(gram.diagonal(), alpha=1.0 - self.ratio)
        return out

    def reduce_across_processes(self) -> None:
        """Sum S and B over the processes of a data-parallel run (each holds the sums of its share of the data)."""
        unique = list({id(s): s for s in self.gram_sums.values()}.values())
        paths = list(self.targets)
        reduced = reduce_sums(*unique, *(self.targets[p] for p in paths))
        swap = {id(old): new for old, new in zip(unique, reduced[: len(unique)])}
        self.gram_sums = {path: swap[id(s)] for path, s in self.gram_sums.items()}
        self.targets = dict(zip(paths, reduced[len(unique):]))

    @torch.no_grad()
    def solve(self) -> dict[str, torch.Tensor]:
        """Linear path → merged weight in its module's layout (``[out, in]``; a ``Conv1D``'s ``[in, out]``),
        W* = ((r·S + (1 − r)·diag(S))⁻¹ B)ᵀ (in the sums' dtype)."""
        out: dict[str, torch.Tensor] = {}
        solvers: dict[int, _Solver] = {}
        for path, target in self.targets.items():
            gram = self.gram_sums[path]
            if id(gram) not in solvers:
                solvers[id(gram)] = _Solver(self._reduced(gram))
            solved = solvers[id(gram)](target)  # [in, out]
            out[path] = solved if path in self.transposed else solved.T
        return out


class _Solver:
    """Solves A X = B for one Gram matrix A (shared by the linears that read one input): by its Cholesky factor,
    after a ridge of 1e-12 of its mean diagonal where it is singular (an input feature that is 0 on every counted
    position: the solution there tends to the weighted average's), else by the pseudo-inverse (no position
    counted at all)."""

    def __init__(self, matrix: torch.Tensor) -> None:
        factor, info = torch.linalg.cholesky_ex(matrix)
        if int(info) != 0:
            ridge = 1e-12 * float(matrix.diagonal().mean().clamp_min(torch.finfo(matrix.dtype).tiny))
            factor, info = torch.linalg.cholesky_ex(matrix + ridge * torch.eye(
                matrix.shape[0], dtype=matrix.dtype, device=matrix.device))
        self.factor = factor if int(info) == 0 else None
        self.pinv = torch.linalg.pinv(matrix, hermitian=True) if self.factor is None else None

    def __call__(self, target: torch.Tensor) -> torch.Tensor:
        if self.factor is not None:
            return torch.cholesky_solve(target, self.factor)
        return self.pinv @ target


@contextlib.contextmanager
def _recording(block: nn.Module) -> Iterator[tuple[GramRecorder, dict[str, nn.Linear]]]:
    linears = block_linears(block)
    recorder = GramRecorder(block, list(linears), next(block.parameters()).device)
    try:
        yield recorder, linears
    finally:
        recorder.close()


def _run_block(setup: WalkSetup, block: nn.Module, state: BatchState) -> torch.Tensor:
    adapter = setup.adapter
    with setup.autocast():
        residual, u = adapter.forward_to_target(block, state.hidden, state.context)
        return adapter.forward_from_target(block, residual, u, state.context)


def _source_block(setup: WalkSetup, blocks: Sequence[nn.Module], layer: int, store: Any, arena: BlockArena
                  ) -> nn.Module:
    block = copy.deepcopy(blocks[layer])
    load_block(block, store, setup.adapter.layer_prefix(layer), setup.device, materialise=is_streamed(block),
               arena=arena)
    return block


def _prefix_states(setup: WalkSetup, start: int) -> list[BatchState]:
    """The batches after the first ``start`` blocks of ``setup.model`` (the leading blocks no model changed)."""
    blocks = setup.adapter.layers(setup.model)
    states = embed_batches(setup, setup.model)
    for layer in range(start):
        block = blocks[layer]
        streamed = is_streamed(block)
        if streamed:
            load_block(block, setup.base_store, setup.adapter.layer_prefix(layer), setup.device, materialise=True)
        states = [BatchState(_run_block(setup, block, s), s.context) for s in states]
        if streamed:
            release_block(block)
    return states


@torch.inference_mode()
def own_gram_walk(setup: WalkSetup, alpha: Sequence[float], ratio: float, start: int,
                  solved: Callable[[int, dict[str, torch.Tensor] | None], None], *, progress: Any = None) -> None:
    """RegMean's walk: every model on its own forward. ``solved(layer, weights)`` gets block ``layer``'s merged
    linear weights by path (``None`` for the first ``start`` blocks, which no model changed and which run once;
    ``start = -1``: the embeddings differ too)."""
    adapter = setup.adapter
    blocks = adapter.layers(setup.model)
    if start >= 0:
        shared = _prefix_states(setup, start)
        states = [list(shared) for _ in setup.sources]
    else:
        states = _own_embeddings(setup)
    arenas = [BlockArena() for _ in setup.sources]
    for layer in range(adapter.num_layers):
        if layer < start:
            solved(layer, None)
            if progress is not None:
                progress.update(1)
            continue
        regression = BlockRegression(ratio)
        for p, (store, arena) in enumerate(zip(setup.sources, arenas)):
            block = _source_block(setup, blocks, layer, store, arena)
            with _recording(block) as (recorder, linears):
                for b, state in enumerate(states[p]):
                    recorder.next_batch(state.context.mask)
                    hidden = _run_block(setup, block, state)
                    if layer + 1 < adapter.num_layers:
                        states[p][b] = BatchState(hidden, state.context)
                regression.fold(recorder.grams, linears, alpha[p])
            del block, recorder
        regression.reduce_across_processes()
        solved(layer, regression.solve())
        if progress is not None:
            progress.update(1)


@torch.inference_mode()
def merged_gram_walk(setup: WalkSetup, alpha: Sequence[float], ratio: float, start: int,
                     solved: Callable[[int, dict[str, torch.Tensor] | None], None],
                     before_stage: Callable[[int], None], *, progress: Any = None) -> None:
    """RegMean++'s walk on ``setup.model``, the model being merged: ``before_stage(stage)`` merges a stage into it
    (the embeddings first, block ``layer`` once ``solved(layer, weights)`` has its linears, the tail last); every
    model's block ``layer`` runs on the states the merged blocks before it produce, which then advance through the
    merged block."""
    adapter = setup.adapter
    blocks = adapter.layers(setup.model)
    before_stage(EMBEDDING_STAGE)
    for layer in range(max(start, 0)):
        solved(layer, None)
        before_stage(layer)
    states = _prefix_states(setup, max(start, 0))
    arenas = [BlockArena() for _ in setup.sources]
    if progress is not None and start > 0:
        progress.update(start)
    for layer in range(max(start, 0), adapter.num_layers):
        regression = BlockRegression(ratio)
        for p, (store, arena) in enumerate(zip(setup.sources, arenas)):
            block = _source_block(setup, blocks, layer, store, arena)
            with _recording(block) as (recorder, linears):
                for state in states:
                    recorder.next_batch(state.context.mask)
                    _run_block(setup, block, state)
                regression.fold(recorder.grams, linears, alpha[p])
            del block, recorder
        regression.reduce_across_processes()
        solved(layer, regression.solve())
        before_stage(layer)
        if layer + 1 < adapter.num_layers:
            states = [BatchState(_run_block(setup, blocks[layer], s), s.context) for s in states]
        if progress is not None:
            progress.update(1)
    before_stage(adapter.num_layers)
