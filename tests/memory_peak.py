"""Peak memory of torch ops on the CPU between ops, from glibc's malloc counters (for the memory tests)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_in_use():
    """Bytes the process holds from malloc now (glibc's ``mallinfo2``: small blocks and mmapped chunks), which is
    where torch's CPU allocator takes every tensor's memory; ``None`` without glibc 2.33+."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        info = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    info.restype = _MallInfo2

    def in_use() -> int:
        value = info()
        return value.uordblks + value.hblkhd

    import torch

    before = in_use()
    probe = torch.empty(1 << 22, dtype=torch.uint8)  # 4 MiB: under another allocator glibc's counters stand still
    moved = in_use() - before
    del probe
    return in_use if moved >= 1 << 22 else None


def peak_bytes(in_use, fn) -> int:
    """The largest malloc'd total seen after any torch op of ``fn`` (run in this thread), less the total before it:
    what the ops held between them, counted rather than sampled in time (a temporary freed inside one op is not
    seen, so it is a lower bound of the true peak)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Peak(TorchDispatchMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, in_use())
            return out

    gc.collect()
    start = in_use()
    with Peak() as mode:
        fn()
    return mode.peak - start
