"""Gram matrices of every linear layer's inputs, block by block: what RegMean and RegMean++ solve from.

:class:`GramRecorder` hooks every ``nn.Linear`` of one block and sums XᵀX over the positions that count (padding never
does) in float64; linears that read the same input tensor (a block's q, k and v projections) share one Gram. One
block of q models is folded as it is walked (:class:`BlockRegression`): after model p's batches, its Grams G_p join

    S = Σ_p α_p G_p        and, per linear,        B = Σ_p α_p G'_p W_pᵀ,   G'_p = r·G_p + (1 − r)·diag(G_p)

so a block holds one Gram per input of the model being walked plus S and B, whatever q is; the merged weight is
W* = (r·S + (1 − r)·diag(S))⁻¹ B, transposed (solved in float64). S and B are sums, so the processes of a
data-parallel run add theirs up exactly before the solve (:func:`~hf_mloss.engine.kernel.reduce_sums`).

Few positions. A Gram whose input has many more features than counted positions is held as its rows X (scaled
by √α_p) instead of the ``[in, in]`` matrix (:class:`InputGram`): with n positions per model, G'_p W_pᵀ costs
O(n·in·out) as r·Xᵀ(X W_pᵀ) + (1 − r)·diag(G_p) W_pᵀ instead of O(in²·out), and the system is solved through
Woodbury's identity with an m × m factorisation for m = Σ_p n_p rows instead of the in × in one
(:class:`_RowSolver`). The walks keep rows while q·n ≤ in/2, where that takes at most half the matrix route's
multiply-adds for q ≥ 2 (a Llama-2-7B block, q = 2, 8 × 64 tokens per model: about 1.7 TFLOP instead of 7.7); the
solution is the same up to float64 round-off. Data-parallel runs turn rows into matrices before their sums are
reduced.

Where the system is singular the data leaves part of W* undetermined. An input feature that is 0 at every counted
position (a dead unit; S's row and column 0) gets the weighted average's column, as every tensor the data does not
reach does. Any other rank deficiency (fewer positions than input features, or inputs that span few directions) only
arises with r ≈ 1, as r < 1 keeps the system positive definite: it is solved as before and reported
(:attr:`BlockRegression.deficient`), so the merge can warn that the data under-determines those layers.

The two walks: :func:`own_gram_walk` runs every model on its own forward (RegMean), one copy of one block per model
at a time; :func:`merged_gram_walk` runs every model's block on the hidden states of the merged blocks before it, then
advances those states through the merged block (RegMean++). Leading blocks that no model changed run once.

Each model's data. The walks take the models in groups that read the same batches (``groups``; default: every model
on the setup's batches, the one pool). With each model's own data (its task's inputs, as the papers compute the
Grams) model p's Grams come from its own batches only, and since the models then count different positions, each
G_p enters S and B as the mean over its n_p positions, G_p / n_p (the papers' running mean; with one pool the common
n cancels, so the sums are folded as they are). n_p is summed over the processes before the fold, so a data-parallel
run still adds its shares' S and B exactly.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..adapters import EMBEDDING_STAGE
from .kernel import reduce_sums, several_processes
from .walk import BatchState, BlockArena, WalkSetup, _own_embeddings, embed_batches, is_streamed, load_block, \
    release_block

__all__ = ["FULL_RATE_FLOAT64", "BlockRegression", "Deficiency", "GramRecorder", "InputGram", "RANK_TOLERANCE",
           "ROW_SOLVE_MIN_DIAGONAL", "block_linears", "gram_dtypes", "merged_gram_walk", "own_gram_walk"]

RANK_TOLERANCE = 1e-6
"""A Gram is numerically rank-deficient when some input feature's part that the features before it do not explain
holds less than this share of its square sum (a Cholesky pivot over its diagonal entry). Every share is at least
1 − r, so only r ≈ 1 comes near it; an exactly singular Gram's smallest share is round-off (about 1e-13 with a
CPU's float64 products), or its factorisation fails (as it mostly does with an accelerator's float32 ones)."""


ROW_SOLVE_MIN_DIAGONAL = 1e-4
"""The smallest 1 − r for which a Gram held as rows is solved through Woodbury's identity (its m × m system's
condition grows as 1/(1 − r)); closer to r = 1 the rows are turned into the matrix and solved as any other."""


def block_linears(block: nn.Module) -> dict[str, nn.Module]:
    """The linear layers of one block, by their path in it (``self_attn.q_proj``): ``nn.Linear`` and GPT-2's
    ``Conv1D`` (its weight stored ``[in, out]``)."""
    from transformers.pytorch_utils import Conv1D

    return {path: module for path, module in block.named_modules() if isinstance(module, (nn.Linear, Conv1D))}


def _weight(module: nn.Module) -> torch.Tensor:
    """A linear layer's weight as ``[out, in]`` (a ``Conv1D``'s transposed)."""
    return module.weight if isinstance(module, nn.Linear) else module.weight.T


FULL_RATE_FLOAT64 = frozenset({(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)})
"""CUDA compute capabilities whose float64 rate is at least half their float32 rate (P100, V100, A100, H100 / H200,
B200): there float64 products cost what they cost on a CPU."""


def gram_dtypes(device: torch.device | str) -> tuple[torch.dtype, torch.dtype]:
    """``(product, sum)`` dtypes of the Grams on ``device``. On a CPU both float64: a float64 product costs about
    twice a float32 one there, and it makes the sums independent of how the positions are grouped into batches and
    processes (float32 products of other groupings differ in the last bits, which the solve amplifies by the Grams'
    condition number: 3e-6 relative on a tiny CLIP). The same on the data-centre GPUs of :data:`FULL_RATE_FLOAT64`
    (on one H200 the merges then agreed with the CPU's within 2.5e-7, 1.7e-5 with float32 products). On other
    accelerators the products are float32 (consumer GPUs compute float64 at 1/64 of the rate) summed in float64; MPS
    has no float64 at all."""
    device = torch.device(device)
    full_rate = device.type == "cuda" and torch.cuda.get_device_capability(device) in FULL_RATE_FLOAT64
    if device.type == "cpu" or full_rate:
        return torch.float64, torch.float64
    return torch.float32, torch.float32 if device.type == "mps" else torch.float64


class InputGram:
    """Σ_i w_i X_iᵀX_i of one linear input (``features`` wide), held as its scaled rows √w_i·X_i while there are at
    most ``row_limit`` of them, and as the ``[features, features]`` matrix from then on (``row_limit = 0``: the
    matrix from the start). Rows are kept in the product dtype, the matrix in the sum dtype (:func:`gram_dtypes`)."""

    def __init__(self, features: int, *, row_limit: float, dtype: torch.dtype, device: torch.device | str) -> None:
        self.features, self.row_limit, self.dtype, self.device = features, row_limit, dtype, torch.device(device)
        self.count = 0
        """The rows held (while :attr:`factored`)."""
        self._rows: list[torch.Tensor] = []
        self._diagonal = torch.zeros(features, dtype=dtype, device=device)
        self._matrix = None if row_limit > 0 else torch.zeros(features, features, dtype=dtype, device=device)

    @property
    def factored(self) -> bool:
        """Whether it is still held as rows."""
        return self._matrix is None

    def add(self, rows: torch.Tensor, weight: float = 1.0) -> None:
        """Add w·XᵀX for ``rows`` X (``[n, features]``, in the product dtype)."""
        if self.factored and weight >= 0 and self.count + rows.shape[0] <= self.row_limit:
            rows = rows.clone() if weight == 1.0 else rows * weight ** 0.5  # never a view of a hidden state
            self._rows.append(rows)
            self._diagonal += rows.to(self.dtype).square().sum(0)
            self.count += rows.shape[0]
            return
        self.densify().add_(rows.T @ rows, alpha=weight)

    def add_gram(self, other: InputGram | torch.Tensor, weight: float) -> None:
        """Add w·G for another Gram G (its rows where both are held as rows)."""
        if isinstance(other, InputGram) and other.factored and self.factored and weight >= 0:
            for rows in other._rows:
                self.add(rows, weight)
            return
        self.densify().add_(other.matrix() if isinstance(other, InputGram) else other, alpha=weight)

    def rows(self) -> torch.Tensor:
        """The rows Z (``[count, features]``; only while :attr:`factored`), with ZᵀZ the Gram."""
        if not self._rows:
            return torch.zeros(0, self.features, dtype=self.dtype, device=self.device)
        if len(self._rows) > 1:  # joined once: the linears that share this input each read it
            self._rows = [torch.cat(self._rows)]
        return self._rows[0]

    def matrix(self) -> torch.Tensor:
        """The Gram as a matrix (formed from the rows while :attr:`factored`, which it stays)."""
        if self._matrix is not None:
            return self._matrix
        out = torch.zeros(self.features, self.features, dtype=self.dtype, device=self.device)
        for rows in self._rows:
            out += rows.T @ rows
        return out

    def diagonal(self) -> torch.Tensor:
        """The Gram's diagonal, ``[features]`` in the sum dtype."""
        return self._diagonal if self._matrix is None else self._matrix.diagonal()

    def replace(self, matrix: torch.Tensor) -> None:
        """Hold ``matrix`` instead (the sum over the processes of a data-parallel run)."""
        self._matrix, self._rows, self.count = matrix, [], 0

    def densify(self) -> torch.Tensor:
        """Hold the Gram as its matrix from now on; returns it."""
        if self._matrix is None:
            self._matrix, self._rows, self.count = self.matrix(), [], 0
        return self._matrix


class GramRecorder:
    """Sums XᵀX of the inputs of ``block``'s linear layers while it runs (forward pre-hooks), counting only the
    positions of :attr:`mask` (``[batch, seq]`` bool; ``None``: every position). Linears fed the same tensor in one
    forward share one Gram (computed once). Dtypes: :func:`gram_dtypes`. ``row_share``: an input's Gram is held as
    its rows while they number at most this share of its features (:class:`InputGram`; 0: as matrices)."""

    def __init__(self, block: nn.Module, linears: Sequence[str], device: torch.device | str = "cpu", *,
                 row_share: float = 0.0) -> None:
        self.grams: dict[str, InputGram] = {}
        """Linear path → Σ XᵀX (linears that shared their input hold the same one)."""
        self.positions: dict[str, int] = {}
        """Linear path → the number of positions its Gram counts."""
        self.product_dtype, self.sum_dtype = gram_dtypes(device)
        self.row_share = row_share
        self.mask: torch.Tensor | None = None
        self._last: tuple[torch.Tensor, str] | None = None
        self._handles = [block.get_submodule(path).register_forward_pre_hook(self._hook(path)) for path in linears]

    def _hook(self, path: str) -> Callable:
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0]
            if self._last is not None and self._last[0] is x:  # q / k / v: one input, one Gram
                self.grams.setdefault(path, self.grams[self._last[1]])
                self.positions[path] = self.positions[self._last[1]]
                return
            rows = x.detach().reshape(-1, x.shape[-1])
            if self.mask is not None and self.mask.numel() == rows.shape[0]:
                rows = rows[self.mask.reshape(-1)]
            self.positions[path] = self.positions.get(path, 0) + rows.shape[0]
            rows = rows.to(self.product_dtype)
            if path not in self.grams:
                features = rows.shape[1]
                self.grams[path] = InputGram(features, row_limit=int(self.row_share * features),
                                             dtype=self.sum_dtype, device=rows.device)
            self.grams[path].add(rows)
            self._last = (x, path)

        return record

    def next_batch(self, mask: torch.Tensor | None) -> None:
        """Start a batch: its positions that count, and no input seen yet."""
        self.mask, self._last = mask, None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._last = [], None


@dataclass(frozen=True)
class Deficiency:
    """A Gram the data leaves singular (see :data:`RANK_TOLERANCE`): the linears that read its input, the positions
    it counts (per model), its input features and those of them no counted position reaches (solved apart)."""

    paths: tuple[str, ...]
    positions: int
    features: int
    unreached: int
    numerical: bool
    """Whether its factorisation says so (a failed Cholesky or a tiny pivot); else only its count of positions."""


class BlockRegression:
    """The running S and B of one block's linears over the q models (see the module docstring)."""

    def __init__(self, ratio: float, *, mean: bool = False) -> None:
        self.ratio = ratio
        self.mean = mean
        """Each model's Grams enter as their mean over its positions (the models read different data): ``fold``
        then takes every process's positions, already summed (:func:`_positions`)."""
        self.gram_sums: dict[str, torch.Tensor] = {}
        """Linear path → S (linears that share their input share it)."""
        self.targets: dict[str, torch.Tensor] = {}
        """Linear path → B (``[in, out]``, float64)."""
        self.transposed: set[str] = set()
        """The paths of ``Conv1D`` layers (weights stored ``[in, out]``)."""
        self.positions: dict[str, int] = {}
        """Linear path → the positions its Gram counts (per model when every model runs on the same data; with
        ``mean``, summed over the models, each on its own data)."""
        self.unreached: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """Linear path → (the input features S's diagonal still has at 0, ``[k]``; their rows of Σ_p α_p W_pᵀ,
        ``[k, out]``): the weighted average's columns a dead feature's solution takes."""
        self.deficient: list[Deficiency] = []
        """The Grams :meth:`solve` found singular, in block order."""

    @torch.no_grad()
    def fold(self, grams: dict[str, InputGram | torch.Tensor], linears: dict[str, nn.Linear], alpha: float,
             positions: dict[str, int]) -> None:
        """Add one model's Grams (:attr:`GramRecorder.grams`, or matrices), with that model's linear weights
        ``linears``, at weight ``alpha`` (``positions``: the positions each Gram counts,
        :attr:`GramRecorder.positions`; with :attr:`mean`, every process's)."""
        sums_of: dict[int, InputGram] = {}
        self.transposed |= {path for path in grams if not isinstance(linears[path], nn.Linear)}
        for path, gram in grams.items():
            key = id(gram)
            weight_of = alpha / max(positions[path], 1) if self.mean else alpha  # G_p / n_p: mean over positions
            if key not in sums_of:
                if path not in self.gram_sums:
                    rows = isinstance(gram, InputGram) and gram.factored  # S stays rows while every G_p is
                    sums_of[key] = self.gram_sums[path] = InputGram(
                        gram.shape[0] if isinstance(gram, torch.Tensor) else gram.features,
                        row_limit=float("inf") if rows else 0, dtype=gram.dtype, device=gram.device)
                else:
                    sums_of[key] = self.gram_sums[path]
                sums_of[key].add_gram(gram, weight_of)
            self.gram_sums.setdefault(path, sums_of[key])
            weight = _weight(linears[path]).detach()
            product = self._product(gram, weight)
            if path not in self.targets:
                self.targets[path] = torch.zeros_like(product)
            self.targets[path].add_(product, alpha=weight_of)
            if self.mean:
                self.positions[path] = self.positions.get(path, 0) + positions[path]
            else:
                self.positions[path] = max(self.positions.get(path, 0), positions[path])
            self._fold_unreached(path, sums_of[key], weight, alpha)

    def _product(self, gram: InputGram | torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """G'_p W_pᵀ (``[in, out]``, in the Gram's sum dtype; products in :func:`gram_dtypes`' product dtype, so
        on a CPU the sums of two processes add up to one's): r·Xᵀ(X W_pᵀ) + (1 − r)·diag(G_p) W_pᵀ from the rows
        X where the Gram is held as rows."""
        dtype = gram_dtypes(gram.device)[0]
        weight = weight.to(dtype).T
        if isinstance(gram, InputGram) and gram.factored:
            rows = gram.rows()
            out = (rows.T @ (rows @ weight)).to(gram.dtype).mul_(self.ratio)
            return out.addcmul_(gram.diagonal()[:, None], weight.to(gram.dtype), value=1.0 - self.ratio)
        matrix = gram.matrix() if isinstance(gram, InputGram) else gram
        return (self._reduced(matrix).to(dtype) @ weight).to(matrix.dtype)

    def _fold_unreached(self, path: str, gram_sum: InputGram, weight: torch.Tensor, alpha: float) -> None:
        """Keep Σ_p α_p W_p's columns for the input features no model folded so far reached (usually none: a few
        rows, not a second B). A feature reached once stays reached, so the set only shrinks."""
        if path in self.unreached:
            index, rows = self.unreached[path]
            keep = gram_sum.diagonal()[index] == 0
            index, rows = index[keep], rows[keep]
        else:
            index = torch.nonzero(gram_sum.diagonal() == 0).squeeze(1)
            rows = torch.zeros(len(index), weight.shape[0], dtype=gram_sum.dtype, device=gram_sum.device)
        rows.add_(weight.T[index].to(rows), alpha=alpha)
        self.unreached[path] = (index, rows)

    def _reduced(self, gram: torch.Tensor) -> torch.Tensor:
        """r·G + (1 − r)·diag(G)."""
        out = gram * self.ratio
        out.diagonal().add_(gram.diagonal(), alpha=1.0 - self.ratio)
        return out

    def reduce_across_processes(self) -> None:
        """Sum S, B and the positions over the processes of a data-parallel run (each holds the sums of its share of
        the data). The unreached features' average rows need none: every process holds the same weights, and a
        feature unreached over all the data is unreached in every share."""
        unique = list({id(s): s for s in self.gram_sums.values()}.values())
        if several_processes():  # the processes' rows do not add up: their matrices do
            for gram_sum in unique:
                gram_sum.densify()
        dense = [gram_sum for gram_sum in unique if not gram_sum.factored]
        paths = list(self.targets)
        counts = [torch.tensor([float(self.positions.get(p, 0)) for p in paths], dtype=unique[0].dtype,
                               device=unique[0].device)] if unique and not self.mean else []  # mean: summed already
        reduced = reduce_sums(*(gram_sum.matrix() for gram_sum in dense), *(self.targets[p] for p in paths), *counts)
        for gram_sum, summed in zip(dense, reduced):
            gram_sum.replace(summed)
        self.targets = dict(zip(paths, reduced[len(dense): len(dense) + len(paths)]))
        if counts:
            self.positions = {p: int(round(float(n))) for p, n in zip(paths, reduced[-1].tolist())}

    @torch.no_grad()
    def solve(self) -> dict[str, torch.Tensor]:
        """Linear path → merged weight in its module's layout (``[out, in]``; a ``Conv1D``'s ``[in, out]``),
        W* = ((r·S + (1 − r)·diag(S))⁻¹ B)ᵀ (in the sums' dtype); an input feature no position reaches gets the
        weighted average's column. The Grams found singular join :attr:`deficient`."""
        out: dict[str, torch.Tensor] = {}
        solvers: dict[int, _Solver | _RowSolver] = {}
        readers: dict[int, list[str]] = {}
        for path, target in self.targets.items():
            gram = self.gram_sums[path]
            if id(gram) not in solvers:
                solvers[id(gram)] = self._solver(gram)
            solver = solvers[id(gram)]
            readers.setdefault(id(gram), []).append(path)
            if len(solver.unreached):  # B's rows there are 0: the average's, which the decoupled rows then equal
                index, rows = self.unreached[path]
                target = target.clone()
                target[solver.unreached] = rows[torch.searchsorted(index, solver.unreached)].to(target)
            solved = solver(target)  # [in, out]
            out[path] = solved if path in self.transposed else solved.T
        for key, paths in readers.items():
            solver = solvers[key]
            features = solver.factor_size - len(solver.unreached)
            positions = self.positions.get(paths[0], 0)
            few = positions < features and 1.0 - self.ratio < RANK_TOLERANCE
            if solver.singular or few:
                self.deficient.append(Deficiency(tuple(paths), positions, solver.factor_size,
                                                 len(solver.unreached), solver.singular))
        return out

    def _solver(self, gram_sum: InputGram) -> _Solver | _RowSolver:
        """Woodbury's solve for S held as rows where every feature is reached and r is not near 1; else the
        matrix's Cholesky solve."""
        if gram_sum.factored and 1.0 - self.ratio >= ROW_SOLVE_MIN_DIAGONAL and bool((gram_sum.diagonal() > 0).all()):
            return _RowSolver(gram_sum.rows(), gram_sum.diagonal(), self.ratio)
        return _Solver(self._reduced(gram_sum.matrix()))


class _RowSolver:
    """Solves (r·ZᵀZ + D) X = B for S = ZᵀZ given as its m rows Z and D = (1 − r)·diag(S) > 0, by Woodbury's
    identity: X = Y − r·D⁻¹Zᵀ (I + r·Z D⁻¹ Zᵀ)⁻¹ Z Y with Y = D⁻¹B, one m × m Cholesky factor (the system is
    positive definite, its eigenvalues at least 1). Every feature is reached and every pivot share is at least
    1 − r, so none is :attr:`singular`."""

    def __init__(self, rows: torch.Tensor, diagonal: torch.Tensor, ratio: float) -> None:
        self.unreached = torch.zeros(0, dtype=torch.long, device=diagonal.device)
        self.factor_size = diagonal.shape[0]
        self.singular = False
        self.ratio = ratio
        self.inverse = 1.0 / ((1.0 - ratio) * diagonal)
        self.rows = rows.to(diagonal.dtype)
        self.scaled = self.rows * self.inverse  # Z D⁻¹
        system = self.scaled @ self.rows.T
        system.mul_(ratio).diagonal().add_(1.0)
        self.factor = torch.linalg.cholesky(system)

    def __call__(self, target: torch.Tensor) -> torch.Tensor:
        first = target * self.inverse[:, None]
        inner = torch.cholesky_solve(self.rows @ first, self.factor)
        return first.sub_(self.scaled.T @ inner, alpha=self.ratio)


class _Solver:
    """Solves A X = B for one Gram matrix A (shared by the linears that read one input) by its Cholesky factor.

    The input features A's diagonal has at 0 (:attr:`unreached`: 0 at every counted position, so A's row and column
    are 0 too) leave their rows of X undetermined: they are decoupled (A[j, j] = 1), so X's row j is B's, which the
    caller sets to the weighted average's. fusion-bench 0.2.33 (``torch.inverse``) raises on such an A instead; where
    no feature is unreached nothing changes. An A still singular (r ≈ 1 and data that spans fewer directions than
    it has features) is factored after a ridge of 1e-12 of its reached features' mean diagonal, else
    pseudo-inverted; :attr:`singular` says so, or that a pivot fell below :data:`RANK_TOLERANCE` of its diagonal
    entry."""

    def __init__(self, matrix: torch.Tensor) -> None:
        self.unreached = torch.nonzero(matrix.diagonal() == 0).squeeze(1)
        self.factor_size = matrix.shape[0]
        if len(self.unreached):
            matrix = matrix.clone()
            matrix.diagonal()[self.unreached] = 1.0
        factor, info = torch.linalg.cholesky_ex(matrix)
        self.singular = int(info) != 0
        if self.singular:  # the ridge spares the unreached features, whose rows stay exactly B's
            live = torch.ones(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
            live[self.unreached] = 0.0
            scale = float((matrix.diagonal() * live).sum() / live.sum().clamp_min(1.0))
            ridge = 1e-12 * max(scale, torch.finfo(matrix.dtype).tiny)
            factor, info = torch.linalg.cholesky_ex(matrix + torch.diag(ridge * live))
        else:
            self.singular = float((factor.diagonal() ** 2 / matrix.diagonal()).min()) < RANK_TOLERANCE
        self.factor = factor if int(info) == 0 else None
        self.pinv = torch.linalg.pinv(matrix, hermitian=True) if self.factor is None else None

    def __call__(self, target: torch.Tensor) -> torch.Tensor:
        if self.factor is not None:
            return torch.cholesky_solve(target, self.factor)
        return self.pinv @ target


@contextlib.contextmanager
def _recording(block: nn.Module, models: int) -> Iterator[tuple[GramRecorder, dict[str, nn.Linear]]]:
    """Record one of ``models`` models' Grams of ``block``: as rows while q·n ≤ in/2 (see the module docstring)."""
    linears = block_linears(block)
    recorder = GramRecorder(block, list(linears), next(block.parameters()).device, row_share=0.5 / models)
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


def _prefix_states(setup: WalkSetup, start: int, batches: Sequence[Any] | None = None) -> list[BatchState]:
    """``batches`` (default the setup's) after the first ``start`` blocks of ``setup.model`` (the leading blocks no
    model changed)."""
    blocks = setup.adapter.layers(setup.model)
    states = embed_batches(setup, setup.model, batches=batches)
    for layer in range(start):
        block = blocks[layer]
        streamed = is_streamed(block)
        if streamed:
            load_block(block, setup.base_store, setup.adapter.layer_prefix(layer), setup.device, materialise=True)
        states = [BatchState(_run_block(setup, block, s), s.context) for s in states]
        if streamed:
            release_block(block)
    return states


Groups = Sequence[tuple[Sequence[int], Sequence[Any]]]
"""The models that read the same batches, with those batches (this process's share): ``[(models, batches), ...]``."""


def _group_of(setup: WalkSetup, groups: Groups | None) -> tuple[Groups, list[int]]:
    """``groups`` (default: every model on the setup's batches) and the group of each model."""
    groups = groups if groups is not None else [(range(len(setup.sources)), setup.batches)]
    of = {p: g for g, (models, _) in enumerate(groups) for p in models}
    return groups, [of[p] for p in range(len(setup.sources))]


def _positions(recorder: GramRecorder, linears: dict[str, nn.Module], mean: bool) -> dict[str, int]:
    """The positions each linear's Gram counts: this process's, or with ``mean`` every process's (one small
    collective per model and block, in the same order on every process, even one that holds none of the model's
    samples)."""
    if not mean:
        return recorder.positions
    counts = torch.tensor([float(recorder.positions.get(path, 0)) for path in linears], dtype=torch.float64)
    (summed,) = reduce_sums(counts.to(next(iter(recorder.grams.values()), counts).device))
    return {path: int(round(float(n))) for path, n in zip(linears, summed.tolist())}


@torch.inference_mode()
def own_gram_walk(setup: WalkSetup, alpha: Sequence[float], ratio: float, start: int,
                  solved: Callable[[int, dict[str, torch.Tensor] | None], None], *, progress: Any = None,
                  deficient: list[tuple[int, Deficiency]] | None = None, groups: Groups | None = None) -> None:
    """RegMean's walk: every model on its own forward. ``solved(layer, weights)`` gets block ``layer``'s merged
    linear weights by path (``None`` for the first ``start`` blocks, which no model changed and which run once;
    ``start = -1``: the embeddings differ too). ``deficient`` collects ``(layer, Gram)`` of the singular Grams.
    ``groups``: each model's batches (see the module docstring)."""
    adapter = setup.adapter
    blocks = adapter.layers(setup.model)
    groups, group_of = _group_of(setup, groups)
    mean = len(groups) > 1
    if start >= 0:
        shared = [_prefix_states(setup, start, batches) for _, batches in groups]
        states = [list(shared[group_of[p]]) for p in range(len(setup.sources))]
    else:
        states = _own_embeddings(setup, [groups[g][1] for g in group_of])
    arena = BlockArena()  # one model's block at a time: each is dropped before the next fills it
    for layer in range(adapter.num_layers):
        if layer < start:
            solved(layer, None)
            if progress is not None:
                progress.update(1)
            continue
        regression = BlockRegression(ratio, mean=mean)
        for p, store in enumerate(setup.sources):
            block = _source_block(setup, blocks, layer, store, arena)
            with _recording(block, len(setup.sources)) as (recorder, linears):
                for b, state in enumerate(states[p]):
                    recorder.next_batch(state.context.mask)
                    hidden = _run_block(setup, block, state)
                    if layer + 1 < adapter.num_layers:
                        states[p][b] = BatchState(hidden, state.context)
                regression.fold(recorder.grams, linears, alpha[p], _positions(recorder, linears, mean))
            del block, recorder
        regression.reduce_across_processes()
        solved(layer, regression.solve())
        if deficient is not None:
            deficient += [(layer, d) for d in regression.deficient]
        if progress is not None:
            progress.update(1)


@torch.inference_mode()
def merged_gram_walk(setup: WalkSetup, alpha: Sequence[float], ratio: float, start: int,
                     solved: Callable[[int, dict[str, torch.Tensor] | None], None],
                     before_stage: Callable[[int], None], *, progress: Any = None,
                     deficient: list[tuple[int, Deficiency]] | None = None, groups: Groups | None = None) -> None:
    """RegMean++'s walk on ``setup.model``, the model being merged: ``before_stage(stage)`` merges a stage into it
    (the embeddings first, block ``layer`` once ``solved(layer, weights)`` has its linears, the tail last); every
    model's block ``layer`` runs on the states the merged blocks before it produce (from its group's batches), which
    then advance through the merged block. ``deficient``, ``groups``: as in :func:`own_gram_walk`."""
    adapter = setup.adapter
    blocks = adapter.layers(setup.model)
    groups, group_of = _group_of(setup, groups)
    mean = len(groups) > 1
    before_stage(EMBEDDING_STAGE)
    for layer in range(max(start, 0)):
        solved(layer, None)
        before_stage(layer)
    states = [_prefix_states(setup, max(start, 0), batches) for _, batches in groups]
    arena = BlockArena()  # one model's block at a time: each is dropped before the next fills it
    if progress is not None and start > 0:
        progress.update(start)
    for layer in range(max(start, 0), adapter.num_layers):
        regression = BlockRegression(ratio, mean=mean)
        for p, store in enumerate(setup.sources):
            block = _source_block(setup, blocks, layer, store, arena)
            with _recording(block, len(setup.sources)) as (recorder, linears):
                for state in states[group_of[p]]:
                    recorder.next_batch(state.context.mask)
                    _run_block(setup, block, state)
                regression.fold(recorder.grams, linears, alpha[p], _positions(recorder, linears, mean))
            del block, recorder
        regression.reduce_across_processes()
        solved(layer, regression.solve())
        if deficient is not None:
            deficient += [(layer, d) for d in regression.deficient]
        before_stage(layer)
        if layer + 1 < adapter.num_layers:
            states = [[BatchState(_run_block(setup, blocks[layer], s), s.context) for s in group] for group in states]
        if progress is not None:
            progress.update(1)
    before_stage(adapter.num_layers)
