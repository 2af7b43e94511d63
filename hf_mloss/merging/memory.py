"""What a merge that holds the whole model in memory needs, checked against the machine before anything is loaded.

Most merges of a large model stream block by block (:mod:`.streamed`) and hold one block. The others hold the whole
output model in the working dtype (float32 for any data-guided merge); the searches (``method="auto"``,
``select="unlabeled"``) hold two more copies of its merged tensors (a scratch model and the base's values), and a
learned merge one more (the base's values). Where even that lower bound passes what the device has (RAM and swap,
or the GPU's memory), the run is refused here, naming the figures, instead of being killed by the out-of-memory
killer minutes into the work.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InvalidParameterError

if TYPE_CHECKING:
    from ..loading.inputs import RunInputs

__all__ = ["check_held_model_fits", "held_copies", "held_model_fits", "memory_limit"]

CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
"""Where a control group's memory limit is read (cgroup v2, v1)."""

STREAMING = ("data-free merges, m_ties, m_dare, regmean, regmean_plusplus, and auto with data, an output criterion "
             "and no heads on a LLaMA-family decoder")
"""The merges that stream a large plain model block by block (:func:`hf_mloss.merging.streamed.plan_streamed_output`)."""


def held_copies(config: Any, method: Any) -> tuple[int, str]:
    """How many extra copies of the merged tensors the run holds beside the model, and why it holds the model."""
    if config.select is not None:
        return 2, "label-free selection (select=...) compares each setting on a scratch copy of the model"
    if getattr(method, "chooses_method", False):
        return 2, "method='auto' compares each candidate on a scratch copy of the model"
    if getattr(method, "learned", False):
        return 1, f"{method.pretty_name} trains its coefficients on the whole model"
    return 0, "this merge holds the whole merged model"


def held_model_fits(inputs: RunInputs, dtype: torch.dtype, extra_copies: int) -> bool:
    """Whether the held model and ``extra_copies`` of its merged tensors in ``dtype`` fit the run's device (true
    where its memory is not known)."""
    need, limit = _held_bytes(inputs, dtype, extra_copies), memory_limit(inputs.device)
    return limit is None or need <= limit


def _held_bytes(inputs: RunInputs, dtype: torch.dtype, extra_copies: int) -> int:
    size = dtype.itemsize
    shapes = inputs.base.shapes
    model = sum(math.prod(shape) for shape in shapes.values()) * size
    merged = sum(math.prod(shapes[name]) for name in inputs.names if name in shapes) * size
    return model + extra_copies * merged


def check_held_model_fits(inputs: RunInputs, dtype: torch.dtype, extra_copies: int, why: str) -> None:
    """Refuse, before anything is loaded, a merge whose held model (and ``extra_copies`` of its merged tensors) in
    ``dtype`` needs more than the run's device has."""
    if held_model_fits(inputs, dtype, extra_copies):
        return
    need, limit = _held_bytes(inputs, dtype, extra_copies), memory_limit(inputs.device)
    where = "this machine's RAM and swap" if torch.device(inputs.device).type == "cpu" else \
        f"{inputs.device}'s memory"
    copies = f" and {extra_copies} more of its merged tensors" if extra_copies else ""
    raise InvalidParameterError(
        f"Not enough memory: {why}, which needs at least {_gb(need)} here (the model in "
        f"{str(dtype).replace('torch.', '')}{copies}), more than {where} ({_gb(limit)}). Nothing was loaded or "
        f"written. The merges that stream a large model block by block ({STREAMING}) hold one block; or run it on "
        "a device with more memory.")


def memory_limit(device: Any) -> int | None:
    """Bytes the device can hold at most: the CPU's RAM and swap (the control group's limit and swap, when lower),
    a CUDA device's total memory; ``None`` where it is not known."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device.index or 0).total_memory)
    if device.type != "cpu":
        return None
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX
        return None
    swap, group = _swap_total(), _cgroup_limit()
    return ram + swap if group is None else min(ram, group) + swap


def _cgroup_limit() -> int | None:
    """The memory limit of this process's control group (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), if any."""
    for path in CGROUP_FILES:
        try:
            with open(path, encoding="ascii") as handle:
                value = handle.read().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 1 << 60:  # "max", or v1's "unlimited" (a huge page-rounded number)
            return int(value)
    return None


def _swap_total() -> int:
    """Swap space in bytes (Linux's /proc/meminfo; 0 where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("SwapTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"
