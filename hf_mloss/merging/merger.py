"""The tensor merger: reads, checks and merges the tensors of a run into the model being written.

:class:`TensorMerger` is what every stage of a merge writes through (the driver, a data-guided method's hooks, the
RegMean solve, a learned merge, the searches of selection and ``auto``): it reads each tensor's base and sources from
the lazy stores, refuses non-finite values naming the checkpoint, merges by the method (in flat pieces for a tensor too
large for q float32 copies, when the method allows: :meth:`~hf_mloss.methods.MergeMethod.chunk_keep_counts`, with
the same bits as whole) and writes the result into the model. It sits below every module that uses it, so none of
them imports the driver for it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..errors import CorruptCheckpointError, InvalidParameterError
from ..methods.svc import calibrate_tensor, calibrates, svc_alpha
from ..parallel import Workers
from ..parallel import active as active_workers
from ..spec.schedule import TensorParameters, replace_params

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..loading.inputs import RunInputs
    from ..methods import MergeContext, MergeMethod

__all__ = ["CHUNKED_MIN_NUMEL", "MERGE_CHUNK_NUMEL", "TensorMerger", "check_fits", "largest_magnitude",
           "raise_non_finite"]

CHUNKED_MIN_NUMEL = 1 << 25
"""A tensor whose q sources hold at least this many entries in all is merged in pieces, when the method allows."""
MERGE_CHUNK_NUMEL = 1 << 22
"""Entries of one such piece (per source): 16 MB of float32."""


class TensorMerger:
    """Reads, checks and merges tensors into the model (its tower's, or every merged tensor of a whole model)."""

    def __init__(self, inputs: RunInputs, method: MergeMethod, ctx: MergeContext, tower: PreTrainedModel,
                 workers: Workers | None = None, *, tensor_params: TensorParameters | None = None,
                 output: Any = None) -> None:
        """``output``: a :class:`~hf_mloss.merging.streamed.StreamedOutput` when the model's blocks are on ``meta``
        and written block by block (:mod:`.streamed` drives this merger; it does not import the other way)."""
        self.inputs, self.method, self.ctx, self.device = inputs, method, ctx, inputs.device
        self.output = output
        self.tensor_params = tensor_params  # per-layer / per-tensor parameter values, when the config has any
        self.workers = workers or active_workers()
        adapter = inputs.adapter
        self.targets = {name: v for k, v in tower.state_dict().items()
                        if (name := adapter.canonical_key(k)) is not None}
        self.names = [n for n in inputs.names if n in self.targets]
        self.done: set[str] = set()
        self.checked: set[str] = set()  # merged tensors found finite (in float32) when they were written
        self._piece_buffers = threading.local()  # each worker's buffer for the pieces of _chunks, reused
        ctx.state["total_numel"] = sum(math.prod(inputs.base.shapes[n]) for n in self.names)

    def read(self, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        target = self.targets.get(name)
        base = target.float() if name not in self.done and target is not None and not target.is_meta else \
            self.inputs.base.get_float(name, self.device)
        if not torch.isfinite(base.sum()) and not torch.isfinite(base).all():
            self._refuse_non_finite(name, self.inputs.base, base)
        # The q sources are read into one [q, ...] float32 buffer (rows converted through a small staging piece),
        # and handed over as its views: a method that stacks them takes the buffer itself (methods.ops.take_stack)
        # instead of a second q-fold copy.
        stacked = torch.empty((len(self.inputs.sources), *base.shape), dtype=torch.float32, device=self.device)
        sources = list(stacked.unbind(0))
        for store, tensor in zip(self.inputs.sources, sources):
            store.read_into(name, tensor)
            # One reduction instead of a full isfinite mask: any NaN/Inf (or an overflowing sum) makes the sum
            # non-finite, and only then are the entries counted.
            if not torch.isfinite(tensor.sum()) and not torch.isfinite(tensor).all():
                bad = int((~torch.isfinite(tensor)).sum())
                raise CorruptCheckpointError(
                    f"{name!r} of {store.ref.name!r} holds {bad} non-finite value(s) (NaN/Inf); a merge would spread "
                    "them. Fix or exclude that checkpoint.")
        return base, sources

    def visit(self, fn) -> None:
        for name in self.names:
            base, sources = self.read(name)
            fn(name, base, sources)

    @torch.no_grad()
    def merge(self, names: Sequence[str], *, progress: bool = False, desc: str = "Merging") -> None:
        """Merge the ``names`` not merged yet into the model, spread over the run's workers (a streamed output:
        stage by stage, each block filled before its tensors merge)."""
        pending = list(dict.fromkeys(n for n in names if n not in self.done))
        with tqdm(total=len(pending), desc=desc, unit="tensor", disable=not progress) as bar:
            if self.output is None:
                self.merge_now(pending, bar)
                return
            for stage, group in self.output.stages(pending):
                self.output.open_stage(stage, self)
                self.merge_now(group, bar)

    def merge_now(self, names: Sequence[str], bar: Any = None) -> None:
        """Merge ``names`` (not merged yet, their targets in memory) over the run's workers."""
        for name in self.workers.imap(self._merge_one, list(names)):
            self.done.add(name)
            if bar is not None:
                bar.update()

    def check_written(self, name: str | None, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """The final checks of one merged tensor (finite, and within ``dtype``), for a streamed output, which
        writes each block as it goes."""
        if name not in self.done:
            return
        if name not in self.checked and not torch.isfinite(tensor).all():
            raise_non_finite(name, self.ctx.params)
        if dtype.is_floating_point and dtype != torch.float32 and tensor.dtype == torch.float32:
            check_fits(name, largest_magnitude(tensor), dtype)

    def _merge_one(self, name: str) -> str:
        ctx = replace_params(self.ctx, self.tensor_params.for_tensor(name)) if self.tensor_params else self.ctx
        per_model = self.tensor_params.for_models(name, self.ctx.weights.tolist()) if self.tensor_params else None
        if per_model is not None:  # per-model weights and parameters, resolved for this tensor
            weights = torch.tensor(per_model[0], dtype=torch.float32, device=self.ctx.weights.device)
            ctx = dataclasses.replace(ctx, weights=weights, model_params=per_model[1])
        dim = self._slice_dim(name, ctx)
        if dim is not None:
            self._merge_in_slices(name, ctx, dim)
            return name
        counts = self._chunk_counts(name, ctx)
        if counts is not None:
            self._merge_in_chunks(name, ctx, counts)
            return name
        base, sources = self.read(name)
        if self.method.zero_delta_is_base and all(torch.equal(s, base) for s in sources):
            merged = base  # no source changed it (a frozen part): θ₀ + f(0) = θ₀, without trimming q zero tensors
        else:
            merged = self.method.merge_tensor(name, base, sources, ctx)
            if calibrates(ctx.params):  # SVC of the merged task matrix (2-D tensors; the others as merged)
                merged = calibrate_tensor(base, sources, merged, svc_alpha(ctx.params))
        del sources
        # Checked here, while the tensor is in cache, instead of in a separate pass over the model in `finalize`
        # (5.7 s of a 128 s TIES merge on 2 busy cores): one reduction, and the full mask only when the sum is not
        # finite (NaN/Inf, or finite values whose sum overflows).
        if torch.isfinite(merged.sum()) or torch.isfinite(merged).all():
            self.checked.add(name)
        target = self.targets[name]
        if target.dtype != merged.dtype and merged is not base and name in self.checked and merged.numel():
            check_fits(name, float(merged.abs().max()), target.dtype)  # before the rounding hides an overflow
        target.copy_(merged)
        return name

    def _slice_dim(self, name: str, ctx: MergeContext) -> int | None:
        """The method's :meth:`~hf_mloss.methods.MergeMethod.slice_dim` for a large 2-D tensor held in memory."""
        target = self.targets[name]
        if (name in self.done or target.dim() != 2 or target.is_meta or not target.is_contiguous()
                or target.numel() * len(self.inputs.sources) < CHUNKED_MIN_NUMEL or calibrates(ctx.params)):
            return None
        return self.method.slice_dim(name, ctx)

    def _merge_in_slices(self, name: str, ctx: MergeContext, dim: int) -> None:
        """:meth:`_merge_one` for a large tensor whose slices along ``dim`` merge independently, a block of slices
        at a time: each block's q sources are read into one buffer (rows: just those rows; columns: each source
        whole into one reused buffer of its stored dtype, then the block's columns), so the q float32 copies held
        are of one block, not of the tensor. The same values and checks as whole."""
        target = self.targets[name]
        size = target.shape[dim]
        step = max(1, MERGE_CHUNK_NUMEL // max(1, target.numel() // size))
        whole: dict[torch.dtype, torch.Tensor] = {}
        changed, finite, peak = False, True, 0.0
        for start in range(0, size, step):
            part = slice(start, min(start + step, size))
            view = target[part] if dim == 0 else target[:, part]
            base = view.float()
            if not torch.isfinite(base.sum()) and not torch.isfinite(base).all():
                self._refuse_non_finite(name, self.inputs.base, target)
            stacked = torch.empty((len(self.inputs.sources), *view.shape), dtype=torch.float32, device=self.device)
            sources = list(stacked.unbind(0))
            for store, piece in zip(self.inputs.sources, sources):
                if dim == 0:
                    piece.copy_(store.get_rows(name, part.start, part.stop))
                else:
                    dtype = store.dtypes.get(name) or torch.float32
                    buffer = whole.setdefault(dtype, torch.empty(target.shape, dtype=dtype))
                    piece.copy_(store.read_into(name, buffer)[:, part])
                if not torch.isfinite(piece.sum()) and not torch.isfinite(piece).all():
                    self._refuse_non_finite(name, store)
            changed = changed or not all(torch.equal(s, base) for s in sources)
            merged = self.method.merge_slices(name, base, sources, ctx, part)
            del sources, stacked
            if not (torch.isfinite(merged.sum()) or torch.isfinite(merged).all()):
                finite = False
            elif target.dtype != merged.dtype and merged.numel():
                peak = max(peak, float(merged.abs().max()))
            view.copy_(merged)
        if not changed and self.method.zero_delta_is_base:
            self.method.unchanged(name, ctx)
        if finite:
            self.checked.add(name)
            if target.dtype != torch.float32:
                check_fits(name, peak, target.dtype)

    def _chunk_counts(self, name: str, ctx: MergeContext) -> list[int] | None:
        """The method's per-source keep counts when ``name`` is large enough to merge in chunks, else None."""
        target = self.targets[name]
        if (name in self.done or target.dim() == 0 or not target.is_contiguous()
                or target.numel() * len(self.inputs.sources) < CHUNKED_MIN_NUMEL
                or (target.dim() == 2 and calibrates(ctx.params))):  # SVC factors the whole matrix
            return None
        return self.method.chunk_keep_counts(target.numel(), ctx, name=name)

    def _chunks(self, name: str, *, check: bool = True) -> Iterator[tuple[slice, torch.Tensor, list[torch.Tensor]]]:
        """``(piece, base, sources)`` over consecutive flat pieces of ``name``: float32, the sources checked finite
        (``check``; a later pass over the same bytes skips it).

        Pieces hold a multiple of :func:`~hf_mloss.methods.ops.elect_chunk_numel` entries, so the kernels see the
        chunks they see on the whole tensor. Every piece is read into the same buffers, overwritten by the next
        piece: fresh ones cost a page fault per 4 KB (at Llama-2-7B's shape, three passes over 54 GB of float32)."""
        from ..methods.ops import elect_chunk_numel

        target = self.targets[name].view(-1)
        numel = target.numel()
        unit = elect_chunk_numel(len(self.inputs.sources))
        step = min(numel, unit * max(1, MERGE_CHUNK_NUMEL // unit))
        buffer = self._piece_buffer(len(self.inputs.sources) + 1, step)
        for start in range(0, numel, step):
            piece = slice(start, min(start + step, numel))
            base, *sources = (row[: piece.stop - piece.start] for row in buffer)
            for store, tensor in zip(self.inputs.sources, sources):
                store.read_flat_into(name, start, tensor)
                if check and not torch.isfinite(tensor.sum()) and not torch.isfinite(tensor).all():
                    self._refuse_non_finite(name, store)
            base.copy_(target[piece])
            if check and not torch.isfinite(base.sum()) and not torch.isfinite(base).all():
                self._refuse_non_finite(name, self.inputs.base, self.targets[name])
            yield piece, base, sources

    def _piece_buffer(self, rows: int, step: int) -> torch.Tensor:
        """This thread's ``[rows, step]`` float32 buffer for :meth:`_chunks`, kept for the next tensor (one of more
        than 32 MB is a fresh mapping each time it is allocated, faulted in page by page). A normal tensor, not an
        inference one: a merge may fill it inside and outside inference mode."""
        held = getattr(self._piece_buffers, "buffer", None)
        if held is None or held.numel() < rows * step:
            with torch.inference_mode(False):
                held = torch.empty(rows * step, dtype=torch.float32, device=self.device)
            self._piece_buffers.buffer = held
        return held[: rows * step].view(rows, step)

    def _refuse_non_finite(self, name: str, store, tensor: torch.Tensor | None = None) -> None:
        """Name the checkpoint (the base included) whose ``name`` holds NaN/Inf, before anything is merged."""
        tensor = store.get(name) if tensor is None else tensor
        bad = int((~torch.isfinite(tensor.float())).sum())
        which = "the base " if store is self.inputs.base else ""
        raise CorruptCheckpointError(
            f"{name!r} of {which}{store.ref.name!r} holds {bad} non-finite value(s) (NaN/Inf); a merge would spread "
            "them. Fix or exclude that checkpoint.")

    def _merge_in_chunks(self, name: str, ctx: MergeContext, counts: list[int]) -> None:
        """:meth:`_merge_one` for a large tensor, piece by piece: the same values and checks, bit for bit, without
        q float32 copies of the whole tensor (a 151936 × 896 bf16 embedding × 4 fine-tunes: ~4 GB less at peak).

        Pass 1 checks the sources and whether any changed the tensor, and (with ``counts``) pass 2 finds each task
        vector's threshold over the whole tensor; the last pass merges each piece and writes it into the model."""
        from ..methods.ops import sample_positions, streamed_thresholds

        target = self.targets[name]
        changed, positions = False, sample_positions(target.numel()).to(self.device) if counts else None
        samples: list[list[torch.Tensor]] = [[] for _ in self.inputs.sources]
        for piece, base, sources in self._chunks(name):
            changed = changed or not all(torch.equal(s, base) for s in sources)
            if positions is not None:  # |τ_i| at the sample positions inside this piece
                at = positions[(positions >= piece.start) & (positions < piece.stop)] - piece.start
                for kept, source in zip(samples, sources):
                    kept.append((source[at] - base[at]).abs())
        if not changed and self.method.zero_delta_is_base:
            if torch.isfinite(target.sum()) or torch.isfinite(target).all():
                self.checked.add(name)  # merged = base: the model already holds it
            return

        def taus():
            for _, base, sources in self._chunks(name, check=False):
                yield [s.sub_(base) for s in sources]

        thresholds = streamed_thresholds(taus, counts, target.numel(), [torch.cat(k) for k in samples]) if counts \
            else []
        finite, peak, flat = True, 0.0, target.view(-1)
        for piece, base, sources in self._chunks(name, check=False):
            merged = self.method.merge_chunk(name, base, sources, ctx, thresholds)
            del sources
            if not (torch.isfinite(merged.sum()) or torch.isfinite(merged).all()):
                finite = False
            elif target.dtype != merged.dtype and merged.numel():
                peak = max(peak, largest_magnitude(merged))
            flat[piece].copy_(merged.view(-1))
        if finite:
            self.checked.add(name)
            if target.dtype != torch.float32:
                check_fits(name, peak, target.dtype)  # the model holds the rounded values; the merge fails here


def check_fits(name: str, peak: float, dtype: torch.dtype) -> None:
    """Refuse a merged tensor whose largest magnitude ``peak`` overflows ``dtype``."""
    limit = torch.finfo(dtype).max
    if peak > limit:
        raise InvalidParameterError(
            f"Saving as {str(dtype).replace('torch.', '')} would overflow: {name!r} reaches {peak:.4g} "
            f"(the largest {str(dtype).replace('torch.', '')} is {limit:.4g}). Nothing was written; pass "
            "dtype='bfloat16' or 'float32'.")


def raise_non_finite(name: str, params: Any) -> None:
    """Refuse a merged tensor holding NaN/Inf, naming it (and λ where it is the likely cause)."""
    lam = getattr(params, "lam", None)
    raise InvalidParameterError(
        f"The merge produced non-finite values in {name!r} (max |x| overflows float32)"
        + (f"; lam={lam} is too large" if lam is not None and abs(lam) > 1e3 else "") + ". Nothing was "
        "written; use smaller lam/weights.")


def largest_magnitude(tensor: torch.Tensor) -> float:
    """max |x| without an |x| copy of the tensor (an LLM's embedding: 0.9 GB more at the peak)."""
    if not tensor.numel():
        return 0.0
    low, high = torch.aminmax(tensor)
    return max(abs(float(low)), abs(float(high)))
