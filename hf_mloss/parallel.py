"""Parallel CPU work without OpenMP spin-waits: a few Python threads, each running torch ops on one intra-op thread.

A merge or a scoring pass is a sequence of independent pieces (tensors, batches of images). Run on
``torch.get_num_threads()`` OpenMP threads, every op is split in halves and ends at a barrier where the thread that
finishes first spins until the other arrives. When other processes use the same cores, that other thread is often
descheduled and the spinning burns the CPU share the process gets. Measured on 2 shared cores (load average 5-6):
per-tensor TIES on twelve 8 × 768² stacks took 11-17 s with 2 OpenMP threads, 2.6-3.1 s with 1 thread and 2.5-3.0 s
with this pool (2 workers × 1 thread); with idle cores the pool keeps both cores busy as OpenMP does.

Results do not depend on the pool: each piece is computed by the same single-threaded kernels whichever worker runs
it, and callers combine pieces in a fixed order.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")
MAX_WORKERS = 4
"""Each worker holds one q-stacked tensor (or one batch) at a time: more workers, more memory, little gain."""

_local = threading.local()


class Workers:
    """Maps independent pieces of work over worker threads; with ``size == 1``, in the calling thread."""

    def __init__(self, size: int = 1) -> None:
        self.size = max(1, size)
        self._executor: ThreadPoolExecutor | None = None

    @property
    def parallel(self) -> bool:
        """Whether pieces submitted from this thread run in parallel (never from inside a worker)."""
        return self._executor is not None and not in_worker()

    def imap(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """``fn(x)`` for each item, yielded in order as they finish; pieces run with the caller's grad mode."""
        items = list(items)
        if not self.parallel or len(items) < 2:
            yield from map(fn, items)
            return
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        yield from self._executor.map(lambda x: _run_task(fn, x, inference, grad), items)

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``[fn(x) for x in items]``, the pieces in parallel."""
        return list(self.imap(fn, items))

    def split(self, fn: Callable[[slice], None], length: int, *, min_piece: int = 1, align: int = 1) -> None:
        """Call ``fn`` on consecutive slices covering ``range(length)``, one per worker when each slice gets at least
        ``min_piece`` items, else once on the whole range (for row- or element-separable kernels on one tensor).
        Inner boundaries are multiples of ``align``."""
        pieces = min(self.size if self.parallel else 1, length // max(1, min_piece, align))
        if pieces <= 1:
            fn(slice(0, length))
            return
        bounds = [length * i // pieces // align * align for i in range(pieces)] + [length]
        self.map(fn, [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])])

    def start(self) -> None:
        if self.size > 1 and self._executor is None:
            intra_op = max(1, torch.get_num_threads() // self.size)
            self._executor = ThreadPoolExecutor(self.size, thread_name_prefix="hf_mloss", initializer=_init_worker,
                                                initargs=(intra_op,))

    def stop(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


SERIAL = Workers(1)
_active: contextvars.ContextVar[Workers] = contextvars.ContextVar("hf_mloss_workers", default=SERIAL)


def _init_worker(intra_op: int) -> None:
    # OpenMP / MKL thread counts are per thread; torch also keeps the number as the default of threads created
    # later, which `cpu_workers` puts back when the pool closes.
    torch.set_num_threads(intra_op)
    _local.worker = True


def _run_task(fn: Callable[[T], R], item: T, inference: bool, grad: bool) -> R:
    # grad and inference modes are thread-local: apply the caller's
    if inference:
        with torch.inference_mode():
            return fn(item)
    with torch.set_grad_enabled(grad):
        return fn(item)


def in_worker() -> bool:
    """Whether the calling thread is a pool worker."""
    return getattr(_local, "worker", False)


def active() -> Workers:
    """The pool of the run in progress in this thread (:data:`SERIAL` outside a run)."""
    return _active.get()


def default_workers(device: torch.device | str) -> int:
    """One worker per intra-op thread on a CPU (at most :data:`MAX_WORKERS`); 1 on accelerators."""
    if torch.device(device).type != "cpu":
        return 1
    return min(MAX_WORKERS, torch.get_num_threads())


@contextlib.contextmanager
def cpu_workers(device: torch.device | str, size: int | None = None) -> Iterator[Workers]:
    """A :class:`Workers` pool for one run (the :func:`active` one meanwhile); torch's thread count is restored."""
    workers = Workers(default_workers(device) if size is None else size)
    threads = torch.get_num_threads()
    workers.start()
    token = _active.set(workers)
    try:
        yield workers
    finally:
        _active.reset(token)
        workers.stop()
        if torch.get_num_threads() != threads or workers.size > 1:
            torch.set_num_threads(threads)
