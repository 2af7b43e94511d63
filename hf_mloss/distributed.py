"""Devices and processes the Hugging Face way: the accelerator when there is one, one output per job.

* :func:`default_device`: under ``torchrun`` / ``accelerate launch``, the process's own device (accelerate's
  ``PartialState().device``); otherwise CUDA when available, then Apple MPS, else CPU — what ``accelerate`` and
  ``pipeline(device_map="auto")`` pick. ``device="auto"`` (or ``None``) means this default.
* :func:`distributed_state` is accelerate's ``PartialState`` when this process is one of several, else ``None``
  (so a single-process run never initialises a process group).
* :func:`main_process_only` runs a block (a save, a push, a print) on the main process only; the other processes
  wait at a barrier until it is done, then go on with the main process's result available on the filesystem.
  Scoring work is split across the processes and reduced in :mod:`hf_mloss.engine.score` and
  :mod:`hf_mloss.compatibility`; a data-free merge is computed by every process (it is cheap next to a save and
  identical everywhere), but written once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

AUTO = "auto"


def distributed_state() -> Any:
    """accelerate's ``PartialState`` when this process is one of several (``torchrun``, ``accelerate launch``,
    ``debug_launcher``), else ``None``."""
    from accelerate import PartialState

    world = check_launch_environment()  # the launch variables, named in one line when malformed
    if not getattr(PartialState, "_shared_state", None):  # not initialised yet (by us, accelerate or the user)
        if world <= 1:
            return None
        # accelerate makes a CPU-only job (gloo) multi-process only when asked for the CPU
        PartialState(cpu=not torch.cuda.is_available())
    state = PartialState()
    return state if state.num_processes > 1 else None


def _env_index(name: str, *, minimum: int) -> int | None:
    """An integer launch variable, parsed strictly (ASCII digits); None when unset or empty."""
    from .errors import InvalidParameterError

    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or len(text.lstrip("0")) > 6 or int(text) < minimum:
        raise InvalidParameterError(f"{name}={raw[:20]!r} is not a valid process count/index (a whole number >= "
                                    f"{minimum}, as torchrun and accelerate launch set it); unset it to run as one "
                                    "process.")
    return int(text)


def check_launch_environment() -> int:
    """The job's process count from ``WORLD_SIZE`` (1 when unset), checked with the variables a multi-process job
    needs (``RANK`` below it, ``MASTER_ADDR`` / ``MASTER_PORT``, unless a process group already exists).

    Raises:
        InvalidParameterError: naming the variable that is malformed or missing.
    """
    from .errors import InvalidParameterError

    world = _env_index("WORLD_SIZE", minimum=1) or 1
    if world <= 1 or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return world
    rank = _env_index("RANK", minimum=0)
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name, "").strip()]
    if missing:
        raise InvalidParameterError(f"WORLD_SIZE={world} asks for a job of {world} processes, but {', '.join(missing)} "
                                    f"{'is' if len(missing) == 1 else 'are'} not set. Launch with torchrun or "
                                    "accelerate launch (they set them all), or unset WORLD_SIZE to run as one process.")
    if rank is not None and rank >= world:
        raise InvalidParameterError(f"RANK={rank} is not below WORLD_SIZE={world}; launch with torchrun or accelerate "
                                    "launch, or unset WORLD_SIZE to run as one process.")
    _env_index("MASTER_PORT", minimum=1)
    return world


def is_main_process() -> bool:
    """Whether this process writes outputs and prints (always, outside a multi-process job)."""
    state = distributed_state()
    return state is None or state.is_main_process


def wait_for_everyone() -> None:
    """A barrier across the job's processes (a no-op in a single process)."""
    state = distributed_state()
    if state is not None:
        state.wait_for_everyone()


@contextlib.contextmanager
def main_process_only() -> Iterator[bool]:
    """Yield whether this process is the main one; the block should act only then (write, push, print).

    Every process leaves the block after the main process has finished it, so what it wrote exists for all of them;
    when it fails, the others raise the same error instead of going on (no process is left waiting).
    """
    state = distributed_state()
    if state is None:
        yield True
        return
    main = state.is_main_process
    outcome: list[Any] = [None]
    try:
        yield main
    except BaseException as err:
        outcome = [_portable(err)]
        _share(outcome)
        raise
    _share(outcome)
    if not main and outcome[0] is not None:
        raise outcome[0]


def _share(outcome: list[Any]) -> None:
    """Replace ``outcome`` by the main process's (a collective call: every process must make it)."""
    from accelerate.utils import broadcast_object_list

    broadcast_object_list(outcome, from_process=0)


def _portable(err: BaseException) -> BaseException:
    """``err`` when it survives pickling (to be re-raised by the other processes), else a :class:`SaveError`."""
    import pickle

    from .errors import SaveError

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any pickling failure: send its text instead
        return SaveError(f"The main process failed: {type(err).__name__}: {err}")


def default_device() -> torch.device:
    """The device a run uses when none is given (see the module docstring)."""
    state = distributed_state()
    if state is not None:
        return torch.device(state.device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def describe_device(device: torch.device | str) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3)``, ``mps``, ``cpu``, plus ``, 2 processes`` in a multi-process job: what a
    run prints and records."""
    device = torch.device(device)
    text = device.type
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            text = f"cuda:{index} ({torch.cuda.get_device_name(index)})"
        except (RuntimeError, AssertionError, AttributeError):
            text = f"cuda:{index}"
    elif device.index is not None and device.type != "cpu":
        text = str(device)
    state = distributed_state()
    return text + (f", {state.num_processes} processes" if state is not None else "")


__all__ = ["AUTO", "default_device", "describe_device", "distributed_state", "is_main_process",
           "main_process_only", "wait_for_everyone"]
