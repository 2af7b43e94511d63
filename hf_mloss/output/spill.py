"""A merged model written to disk as it is merged: its weights in a temporary folder, never whole in memory.

A merge of a large model (:mod:`hf_mloss.merging.streamed`) writes each block's merged tensors, in the output dtype,
into their planned place in safetensors shards (:class:`~hf_mloss.output.shards.ShardWriter`) as soon as the walk
is past the block. :class:`SpilledWeights` is that folder: ``save_pretrained`` links (or, across file systems,
copies) its files into the output folder beside the config, and the merged model is loaded from it only if
:attr:`hf_mloss.MergeResult.model` is read. The folder is removed with the result (or at exit).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .shards import ShardWriter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SPILL_DIR_ENV = "HF_MLOSS_SPILL_DIR"
"""Where the temporary folder goes (default: the system's temporary folder). Put it on the file system of the
output folder, and ``save_pretrained`` links the weights instead of copying them."""


SPILL_PREFIX = "hf_mloss-spill-"
"""Each spill folder is named ``hf_mloss-spill-<pid>-…`` after the process that writes it."""


def remove_stale_spills(where: Path) -> None:
    """Remove the spill folders in ``where`` whose process no longer runs: a merge killed by the out-of-memory
    killer, a timeout or ``kill -9`` runs no clean-up, and a 7B model's spill is its whole merged model. Folders of
    running processes or of other users, and names without a process id, are left alone."""
    from ..saving import process_alive

    try:
        entries = list(where.iterdir())
    except OSError:
        return
    uid = getattr(os, "getuid", lambda: None)()  # None where there are no user ids (Windows)
    for entry in entries:
        pid = entry.name[len(SPILL_PREFIX):].split("-", 1)[0]
        if not (entry.name.startswith(SPILL_PREFIX) and pid.isascii() and pid.isdigit()) or entry.is_symlink():
            continue
        try:
            mine = entry.is_dir() and (uid is None or entry.stat().st_uid == uid)
        except OSError:  # gone meanwhile
            continue
        if mine and not process_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


class SpilledWeights:
    """The safetensors files of a merge written block by block, and the model's skeleton (its class and config,
    every tensor on ``meta``).

    Args:
        skeleton: the output model, its tensors on ``meta`` or real (only its class, config and keys are used).
        entries: ``(checkpoint key, shape, dtype)`` of every tensor to write, in the order they will be written.
        max_shard_size: the shard size of the files (transformers' names and index).
    """

    def __init__(self, skeleton: PreTrainedModel, entries: Sequence[tuple[str, Sequence[int], torch.dtype]], *,
                 max_shard_size: int | str = "5GB") -> None:
        from .shards import direct_writes

        direct_writes()  # a bad HF_MLOSS_DIRECT_WRITES is named before the walk writes a block
        where = os.environ.get(SPILL_DIR_ENV) or tempfile.gettempdir()
        remove_stale_spills(Path(where))
        self.folder = Path(tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{os.getpid()}-", dir=where))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.folder), True)
        self.skeleton = skeleton
        self.writer = ShardWriter(self.folder, entries, max_shard_size)
        self.files: list[str] = []

    @property
    def total_bytes(self) -> int:
        return self.writer.total_bytes

    def bytes_to_save(self, folder: Path | None = None) -> int:
        """The new space saving into ``folder`` takes: none on the spill's own file system (the files are hard
        linked), the files' size elsewhere (copied) or when ``folder`` is not given."""
        if folder is not None:
            existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
            try:
                if existing is not None and existing.stat().st_dev == self.folder.stat().st_dev:
                    return 0
            except OSError:
                pass
        return self.total_bytes

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Write the next planned tensor."""
        self.writer.add(key, tensor)

    def finish(self, dtype: torch.dtype) -> None:
        """Close the files (after the last tensor) and leave the skeleton on ``meta`` in ``dtype``."""
        self.files = self.writer.finish()
        from accelerate.utils import set_module_tensor_to_device

        for name, tensor in list(self.skeleton.state_dict(keep_vars=True).items()):
            if not tensor.is_meta:  # the memory of what was held (embeddings, final norm) returns
                set_module_tensor_to_device(self.skeleton, name, "meta")
        self.skeleton = self.skeleton.to(dtype).eval()

    def save_into(self, folder: Path, base_path: str | None = None) -> None:
        """The weights files into ``folder`` (hard links where it can, else copies), and the config as
        ``save_pretrained`` writes it (:func:`hf_mloss.output.checkpoint.keep_base_config` applied)."""
        for name in self.files:
            source, target = self.folder / name, folder / name
            try:
                os.link(source, target)
            except OSError:  # another file system, or no hard links there
                shutil.copyfile(source, target)
        write_config(self.skeleton, folder, base_path)

    def load_model(self) -> PreTrainedModel:
        """The merged model, read from the written files (in the output dtype)."""
        from .._logging import quiet_transformers

        write_config(self.skeleton, self.folder, None)
        dtype = next(self.skeleton.parameters()).dtype
        with quiet_transformers(True):
            return type(self.skeleton).from_pretrained(self.folder, dtype=dtype, use_kernels=False).eval()


def write_config(model: PreTrainedModel, folder: Path, base_path: str | None) -> None:
    """``config.json`` (and ``generation_config.json``) of ``model`` as its ``save_pretrained`` writes them."""
    from .checkpoint import keep_base_config

    config = model.config
    config.architectures = [type(model).__name__]
    config.dtype = next(model.parameters()).dtype
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(folder)
    if base_path:
        keep_base_config(model, folder, Path(base_path))


def describe(result: Any) -> Any:
    """What the card and the checks read of a result's model: the skeleton of a spilled merge (its class, config
    and dtype; nothing is loaded), else the model."""
    spilled = getattr(result, "spilled", None)
    return spilled.skeleton if spilled is not None else result.model


__all__ = ["SPILL_DIR_ENV", "SpilledWeights", "describe", "write_config"]
