"""CPU threads for a run: as many as other processes leave idle, spread over pieces of work instead of inside ops.

A merge or a scoring pass is a sequence of independent pieces (tensors, batches of images). Run on
``torch.get_num_threads()`` OpenMP threads, every op is split in parts and ends at a barrier where the threads that
finish first spin until the last arrives. When other processes use the same cores, that last thread is often
descheduled and the spinning burns the CPU share the process gets. Measured on 2 shared cores (load average 5-8):
per-tensor TIES on twelve 8 × 768² stacks took 11-17 s with 2 OpenMP threads and 2.6-3.1 s with 1; a 32-image
``score(prefix="base")`` of ViT-B/32 × 8 took 203 s with 2 OpenMP threads, 50 s on 2 worker threads (every small op
also waits for the GIL while the other worker is descheduled) and 18.5 s on 1 thread.

So :func:`cpu_workers` first measures the idle cores (``/proc/stat`` over 50 ms, Linux) and runs with that many
threads, at most ``torch.get_num_threads()``: with one, everything runs on the calling thread; with more, pieces go to
worker threads that each run torch ops on one intra-op thread (no barriers inside ops). ``HF_MLOSS_THREADS=N`` fixes
the number (ASCII digits only, at most 1000000, clamped to the cores this process may use: more threads than cores
only add contention). The pieces and the order in which callers combine them do not depend on the number. The bits of
some products do: an op on the calling thread runs on the run's thread count, and MKL may split a matrix product by its
inner dimension when it has more than one thread (a float64 [96, 200] × [200, 96] product, the Woodbury system of a
RegMean solve, differs in the last bit between 1 and 2 threads), which a solve then amplifies. So two runs of a
data-guided merge on a shared machine can differ in the last bits when the idle cores differ; with ``HF_MLOSS_THREADS``
set, a run re-runs bit for bit on the same machine. A merge's recipe records its count (``threads``), and a re-run of
the recipe uses as many unless ``HF_MLOSS_THREADS`` says otherwise (:func:`replay_threads`).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
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

    def __init__(self, size: int = 1, threads: int | None = None) -> None:
        self.size = max(1, size)
        self.threads = threads
        """The CPU threads of the run (a recipe records them); ``None`` on an accelerator or outside a run."""
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


def idle_cores(interval: float = 0.05) -> float | None:
    """Cores of this process's CPU set that other processes left idle over ``interval`` seconds (``None`` where
    ``/proc/stat`` is not available). This process's own threads (a background hash of the inputs) are not counted
    as load: the run's workers may take those cores."""
    try:
        cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        first, own = _cpu_times(cpus), time.process_time()
        time.sleep(interval)
        second, own = _cpu_times(cpus), time.process_time() - own
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError):
        return None
    total = sum(b[0] - a[0] for a, b in zip(first, second))
    idle = sum(b[1] - a[1] for a, b in zip(first, second))
    if total <= 0:
        return None
    cores = len(cpus)
    return min(float(cores), cores * idle / total + own * tick * cores / total)


def _cpu_times(cpus: set[str]) -> list[tuple[int, int]]:
    """(total, idle + iowait) jiffies of each CPU in ``cpus``."""
    times = []
    with open("/proc/stat") as handle:
        for line in handle:
            fields = line.split()
            if fields and fields[0] in cpus:
                values = [int(v) for v in fields[1:9]]
                times.append((sum(values), values[3] + values[4]))
    return times


def run_threads(device: torch.device | str) -> int:
    """Threads for a run on ``device``: ``HF_MLOSS_THREADS``, else the idle cores (rounded, at least 1) up to
    ``torch.get_num_threads()``; accelerators: 1 (their work is queued, not computed, by the host)."""
    if torch.device(device).type != "cpu":
        return 1
    fixed = env_threads()
    if fixed is not None:
        return fixed
    threads = min(torch.get_num_threads(), machine_cores())
    idle = idle_cores()
    return threads if idle is None else max(1, min(threads, int(idle + 0.5)))


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity where known, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


MAX_THREADS = 1_000_000
"""The largest ``HF_MLOSS_THREADS`` accepted (clamped to the cores, like any value above them); a longer number,
thousands of digits, is a mistake."""


def env_threads() -> int | None:
    """``HF_MLOSS_THREADS`` parsed strictly (ASCII digits, 1 to :data:`MAX_THREADS`) and clamped to
    :func:`machine_cores`; None when unset.

    Raises:
        InvalidParameterError: any other value (``'²'``, ``-1``, ``four``, ``0``, thousands of digits).
    """
    from .errors import InvalidParameterError

    raw = os.environ.get("HF_MLOSS_THREADS")
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    digits = text.lstrip("0")  # checked by length first: int() refuses strings of thousands of digits
    if not (text.isascii() and text.isdigit()) or not digits or len(digits) > 7 or int(digits) > MAX_THREADS:
        shown = repr(raw[:20]) + (f" ({len(raw)} characters)" if len(raw) > 20 else "")
        raise InvalidParameterError(f"HF_MLOSS_THREADS={shown} must be a whole number of threads from 1 to "
                                    f"{MAX_THREADS} (ASCII digits, e.g. HF_MLOSS_THREADS=2; values above the cores "
                                    "this process may use are clamped to them); unset it to use the idle cores.")
    return min(int(digits), machine_cores())


def replay_threads(recorded: int | None, device: torch.device | str) -> int | None:
    """The threads for a re-run of a recipe that recorded ``recorded``: that many, clamped to :func:`machine_cores`,
    on a CPU when ``HF_MLOSS_THREADS`` is unset; ``None`` (the usual rule, :func:`run_threads`) otherwise."""
    if recorded is None or torch.device(device).type != "cpu" or env_threads() is not None:
        return None
    return min(recorded, machine_cores())


@contextlib.contextmanager
def cpu_workers(device: torch.device | str, threads: int | None = None) -> Iterator[Workers]:
    """The :class:`Workers` of one run (the :func:`active` pool meanwhile) with :func:`run_threads` threads;
    torch's thread count is restored afterwards."""
    threads = run_threads(device) if threads is None else max(1, threads)
    previous = torch.get_num_threads()
    accelerator = torch.device(device).type != "cpu"
    workers = Workers(1, None) if accelerator else Workers(min(MAX_WORKERS, threads), threads)
    if not accelerator:
        torch.set_num_threads(threads)
    workers.start()
    token = _active.set(workers)
    try:
        yield workers
    finally:
        _active.reset(token)
        workers.stop()
        torch.set_num_threads(previous)
