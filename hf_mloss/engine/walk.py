"""The block walk: batches advance block by block, and at each scored unit its inputs (and the batch's context) are
handed to a measurement. Used by scoring, M-TIES, the compatibility report and label-free selection.

* :func:`shared_walk`: ONE model (the base, the merged-so-far model, a candidate merge) runs the blocks; the
  measurement gets each batch's input u of the scored unit (where the stacked GEMM of the q sources' weights
  gives the q pre-activations, :class:`hf_mloss.engine.kernel.StackedTarget`).
* :func:`own_walk`: every source runs its own forward (the paper's definition); one copy of ONE block per source is
  in memory at a time, and the measurement gets the q stacked pre-activations of the unit.

A *streamed* scoring model (:meth:`hf_mloss.loading.inputs.RunInputs.load_scoring_model` with ``streamed=True``)
keeps its blocks on the ``meta`` device: the shared walk fills a block with the base's weights when it reaches it
and empties it after, the own walk fills its q copies from the sources, so the base is never held whole.

Every batch carries the :class:`~hf_mloss.adapters.base.BlockContext` its adapter's ``embed`` returned to every
``forward_to_target`` / ``forward_from_target``; its ``mask`` tells the kernel which positions count.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..adapters import EMBEDDING_STAGE, BlockContext, ModelAdapter

__all__ = ["BatchState", "BlockArena", "UnitInputs", "as_batch", "embed_batches", "is_streamed", "load_block",
           "own_walk", "release_block", "release_memory", "shared_walk"]


def as_batch(batch: Mapping[str, torch.Tensor] | torch.Tensor) -> dict[str, torch.Tensor]:
    """One batch of model inputs as a dict (a bare tensor is a batch of pixel values)."""
    if isinstance(batch, torch.Tensor):
        return {"pixel_values": batch}
    return dict(batch)


def batch_to(batch: Mapping[str, torch.Tensor] | torch.Tensor, device: Any) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in as_batch(batch).items()}


class WalkSetup(Protocol):
    """What a walk reads from a scoring setup (:class:`hf_mloss.engine.score.ScoringSetup`)."""

    adapter: ModelAdapter
    model: Any
    sources: Sequence[Any]
    batches: Sequence[Any]
    device: Any
    base_store: Any

    def autocast(self) -> contextlib.AbstractContextManager: ...


@dataclass
class BatchState:
    """One batch on its way through the blocks: the hidden states and the batch's context."""

    hidden: torch.Tensor
    context: BlockContext


@dataclass
class UnitInputs:
    """One batch at a scored unit of the own-prefix walk: the q sources' float32 pre-activations, stacked as
    ``[q, ..., nodes]`` (``up``: gated units), and the positions that count (``mask``, ``[positions]`` bool, or
    ``None``). ``gate`` and ``up`` are the walk's scratch memory, written again for the next batch: a measurement
    reads (or overwrites) them before it returns and keeps no reference."""

    gate: torch.Tensor
    up: torch.Tensor | None
    mask: torch.Tensor | None
    batch: int = -1
    """Which of the setup's batches these positions come from."""

    @property
    def num_nodes(self) -> int:
        return self.gate.shape[-1]

    def stacked(self, *, sources_first: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(gate, up)`` pre-activations as ``[q, positions, nodes]`` views with ``sources_first`` (the layout
        the walk writes and the kernel reads without a copy), else as ``[positions, q, nodes]`` copies."""
        return _stacked(self.gate, sources_first), _stacked(self.up, sources_first) if self.up is not None else None


def embed_batches(setup: WalkSetup, model: Any, pool: Any = None, *, batches: Sequence[Any] | None = None
                  ) -> list[BatchState]:
    """Every batch of ``setup`` (or ``batches``) embedded by ``model`` (on ``pool``'s workers when given)."""
    batches = setup.batches if batches is None else batches

    def embed(batch: Any) -> BatchState:
        with setup.autocast():
            return BatchState(*setup.adapter.embed(model, batch_to(batch, setup.device)))

    return pool.map(embed, batches) if pool is not None else [embed(b) for b in batches]


def _run(pool: Any, fn: Callable, items: Sequence[Any]) -> list[Any]:
    return pool.map(fn, items) if pool is not None else [fn(item) for item in items]


@torch.inference_mode()
def shared_walk(setup: WalkSetup, states: Sequence[BatchState], layers: Sequence[int], *,
                measure: Callable[[int], Callable[[torch.Tensor, BlockContext], Any] | None] | None = None,
                collect: Callable[[int, list[Any]], None] | None = None, model: Any = None, pool: Any = None,
                before_stage: Callable[[int], None] | None = None, last: int | None = None,
                progress: Any = None) -> list[BatchState]:
    """Advance ``states`` through blocks ``layers`` (consecutive) of ``model`` (default ``setup.model``).

    Per block: ``before_stage(layer)`` (M-TIES merges the block there), then ``measure(layer)`` gives the function
    each batch's unit input u and context go to (run on ``pool``'s workers, e.g. the stacked-GEMM kernel; ``None``:
    nothing measured there) and ``collect(layer, results)`` gets its results in batch order. Blocks after ``last``
    are not run (``before_stage`` still sees them); returns the states after the last block run.
    """
    adapter = setup.adapter
    blocks = adapter.layers(model if model is not None else setup.model)
    last = layers[-1] if last is None and layers else last
    for layer in layers:
        if progress is not None:
            progress.update(1)
        if before_stage is not None:
            before_stage(layer)
        if last is None or layer > last:
            continue
        block = blocks[layer]
        streamed = is_streamed(block)
        if streamed:  # a streamed scoring model (blocks on meta): this block's base weights, for this block only
            load_block(block, setup.base_store, adapter.layer_prefix(layer), setup.device, materialise=True)
        fn = measure(layer) if measure is not None else None

        def to_target(state: BatchState, block: nn.Module = block, fn: Callable | None = fn) -> tuple:
            with setup.autocast():
                residual, u = adapter.forward_to_target(block, state.hidden, state.context)
            return residual, u, state.context, fn(u, state.context) if fn is not None else None

        halves = _run(pool, to_target, states)
        measured = fn is not None and collect is not None
        results = [half[3] for half in halves]
        halves = [(*half[:3], None) for half in halves]
        del to_target, fn  # the measurement (q sources' stacked weights) is freed before collect merges the block
        if measured:
            collect(layer, results)
        del results
        if layer < last:
            def from_target(half: tuple, block: nn.Module = block) -> BatchState:
                residual, u, context, _ = half
                with setup.autocast():
                    return BatchState(adapter.forward_from_target(block, residual, u, context), context)

            states = _run(pool, from_target, halves)
        if streamed:
            release_block(block)
    return list(states)


def is_streamed(block: nn.Module) -> bool:
    """Whether ``block`` belongs to a streamed scoring model: its parameters are on ``meta`` until a walk fills it."""
    return any(p.is_meta for p in block.parameters())


def release_block(block: nn.Module) -> None:
    """Put a filled block of a streamed model back on ``meta`` (its memory returns)."""
    from accelerate.utils import set_module_tensor_to_device

    for name, _ in list(block.named_parameters()):
        set_module_tensor_to_device(block, name, "meta")


def release_memory(*, collect: bool = True) -> None:
    """Hand the heap pages freed so far back to the system. glibc keeps freed chunks below its mmap threshold (which
    grows to 32 MB as large tensors are freed) inside the process, so without this each layer's or stage's peak would
    count the fragments left by those before it (about 0.2 GB after the routing pass of a 4-expert 0.5B MoE; about
    0.15 GB per block in a streamed merge of a Qwen2.5-1.5B-shaped decoder)."""
    import ctypes
    import gc

    if collect:
        gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass


def load_block(module: nn.Module, store: Any, prefix: str, device: Any, *, materialise: bool = False,
               arena: BlockArena | None = None) -> None:
    """Fill a copy of one block with a source's weights; every parameter must come from the source.
    ``materialise``: the block's parameters are on ``meta`` (a streamed model) and are replaced, not copied into
    (into views of ``arena``'s memory when given, else fresh tensors)."""
    expected = dict(module.state_dict())
    parameters = dict(module.named_parameters())
    missing = [prefix + key for key in expected if prefix + key not in store and key in parameters]
    if missing:
        raise KeyError(f"{store.ref.name!r} has no tensor {missing[0]!r}: the adapter's names do not match the block.")
    present = {key: value for key, value in expected.items() if prefix + key in store}
    if materialise and arena is not None:
        views = arena.views(present, device)
        state = {key: store.read_into(prefix + key, view) for key, view in views.items()}
    else:
        state = {key: store.get(prefix + key).to(device=device, dtype=value.dtype) for key, value in present.items()}
    module.load_state_dict(state, strict=False, assign=materialise)


class BlockArena:
    """Memory reused by the walk for one block copy's weights from block to block.

    Filling each block's q copies with fresh tensors mapped and page-faulted ~190 M new float32 values per block on
    a Qwen2.5-1.5B-shaped decoder (q = 4); reading into the same memory each time (:meth:`TensorStore.read_into`)
    does not. A block filled from the arena must be dropped before the arena fills the next one.
    """

    ALIGN = 64

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def views(self, like: Mapping[str, torch.Tensor], device: Any) -> dict[str, torch.Tensor]:
        """One tensor per entry of ``like`` (its shape and dtype) on ``device``, all in the arena's memory."""
        sizes = {key: -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN for key, t in like.items()}
        total, device = sum(sizes.values()), torch.device(device)
        if self.buffer is None or self.buffer.numel() < total or self.buffer.device != device:
            self.buffer = None  # the old memory returns before the new is taken
            self.buffer = torch.empty(total, dtype=torch.uint8, device=device)
        out, start = {}, 0
        for key, t in like.items():
            nbytes = t.numel() * t.element_size()
            out[key] = self.buffer[start:start + nbytes].view(t.dtype).view(t.shape)
            start += sizes[key]
        return out

    def tensor(self, shape: Sequence[int], dtype: torch.dtype, device: Any) -> torch.Tensor:
        """One tensor of ``shape`` and ``dtype`` on ``device`` in the arena's memory (what it held before is gone)."""
        return self.views({"": torch.empty(shape, dtype=dtype, device="meta")}, device)[""]


def _own_embeddings(setup: WalkSetup, batches: Sequence[Sequence[Any]] | None = None) -> list[list[BatchState]]:
    """Each source's states entering block 0 (its own embeddings, written into the worker model), per batch
    (``batches``: each source's own, default the setup's for every one)."""
    adapter, worker = setup.adapter, setup.model
    names = [n for n in setup.sources[0].keys() if adapter.stage_of(n) == EMBEDDING_STAGE]  # noqa: SIM118
    state = {adapter.canonical_key(k): v for k, v in worker.state_dict().items()}
    out = []
    for p, store in enumerate(setup.sources):
        for name in names:
            if name in state:
                store.read_into(name, state[name])
        out.append(embed_batches(setup, worker, batches=None if batches is None else batches[p]))
    return out


def own_block_copies(setup: WalkSetup, blocks: Sequence[nn.Module], layer: int,
                     arenas: Sequence[BlockArena]) -> list[nn.Module]:
    """One copy of block ``layer`` per source, filled with that source's weights (``arenas``: one per source, reused
    from block to block so a streamed block's storage is allocated once)."""
    streamed = is_streamed(blocks[layer])
    copies = []
    for store, arena in zip(setup.sources, arenas):
        block = copy.deepcopy(blocks[layer])
        load_block(block, store, setup.adapter.layer_prefix(layer), setup.device, materialise=streamed, arena=arena)
        copies.append(block)
    return copies


@torch.inference_mode()
def own_walk(setup: WalkSetup, scored: Sequence[int], visit: Callable[[int, UnitInputs], None],
             done: Callable[[int], None] | None = None, *, progress: Any = None) -> None:
    """Walk the blocks once with every source's own forward; ``visit(layer, inputs)`` gets each batch's q stacked
    pre-activations of a scored unit (:class:`UnitInputs`), ``done(layer)`` follows its last batch.

    Memory: the worker model (``setup.model``), q copies of ONE block, q sets of hidden states, and one buffer per
    stacked role (gate, up) reused by every batch and block.
    """
    adapter, scored = setup.adapter, set(scored)
    if not scored:
        return
    unit = adapter.unit
    states = _own_embeddings(setup)
    blocks = adapter.layers(setup.model)
    last = max(scored)
    arenas = [BlockArena() for _ in setup.sources]
    scratch = {"gate": BlockArena(), "up": BlockArena()}  # the stacked pre-activations, reused batch after batch
    for layer in range(last + 1):
        copies = own_block_copies(setup, blocks, layer, arenas)
        for b in range(len(setup.batches)):
            stacked: dict[str, torch.Tensor] = {}  # gate / up: [q, ..., nodes], each source's output written in
            for p, block in enumerate(copies):
                state = states[p][b]
                with setup.autocast():
                    residual, u = adapter.forward_to_target(block, state.hidden, state.context)
                    computed = {}
                    if layer in scored:
                        for path in filter(None, (unit.gate, unit.up)):
                            computed[path] = block.get_submodule(path)(u)
                        outputs = unit.split(computed[unit.gate], computed.get(unit.up) if unit.up else None)
                        for role, out in zip(("gate", "up"), outputs):
                            if out is None:
                                continue
                            if role not in stacked:
                                stacked[role] = scratch[role].tensor((len(copies), *out.shape), torch.float32,
                                                                     out.device)
                            stacked[role][p].copy_(out)
                    if layer < last:
                        with _reusing(block, u, computed):  # the rest of the block: gate / up not computed twice
                            hidden = adapter.forward_from_target(block, residual, u, state.context)
                        states[p][b] = BatchState(hidden, state.context)
            if stacked:
                mask = states[0][b].context.mask
                visit(layer, UnitInputs(stacked["gate"], stacked.get("up"),
                                        mask.reshape(-1) if mask is not None else None, b))
        if layer in scored and done is not None:
            done(layer)
        if progress is not None:
            progress.update(1)
        del copies


class _Computed(nn.Module):
    """Stands in for a block's submodule whose output on ``given`` is already known: that output, once, for
    ``given`` itself (the same tensor object), the submodule's own forward otherwise. The output is handed over,
    not copied: the walk has already written it into its stacked pre-activations, so an in-place activation after
    it changes nothing the measurement reads, and a second call cannot see a changed tensor."""

    def __init__(self, module: nn.Module, given: torch.Tensor, output: torch.Tensor) -> None:
        super().__init__()
        self.module, self.given, self.output = module, given, output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x is self.given and self.output is not None:
            output, self.output = self.output, None
            return output
        return self.module(x)


@contextlib.contextmanager
def _reusing(block: nn.Module, given: torch.Tensor, computed: Mapping[str, torch.Tensor]):
    """Within the block, each submodule at a path of ``computed`` returns its computed output on ``given``: the own
    walk's scored pre-activations (a gated MLP's gate and up, a ViT's fc1) serve the rest of the forward too, the
    same values without a second product per source."""
    swapped = []
    for path, output in computed.items():
        parent_path, _, child = path.rpartition(".")
        parent = block.get_submodule(parent_path)
        module = getattr(parent, child)
        setattr(parent, child, _Computed(module, given, output))
        swapped.append((parent, child, module))
    try:
        yield
    finally:
        for parent, child, module in swapped:
            setattr(parent, child, module)


def _stacked(pre: torch.Tensor, sources_first: bool) -> torch.Tensor:
    """``[q, ..., nodes]`` pre-activations as ``[q, positions, nodes]`` (a view) or ``[positions, q, nodes]``."""
    flat = pre.reshape(pre.shape[0], -1, pre.shape[-1])
    return flat if sources_first else flat.transpose(0, 1).contiguous()
