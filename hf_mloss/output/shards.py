"""Streaming safetensors writer: the tensors' names, shapes and dtypes are known before the first one is computed, so
each shard's header is written first and every tensor's bytes go straight to their place in the file as the tensor
comes (``pwrite``): building an MoE, or a merge written block by block (:mod:`hf_mloss.output.spill`), never holds
more than the tensors of one layer, whatever the shard size. The
files are byte for byte what ``safetensors.torch.save_file`` writes for the same tensors (data sorted by dtype, then
name; the header padded to 8 bytes), and the file names and the index are transformers' own.

Where the platform and the file system allow it (Linux), the bytes go to the disk with ``O_DIRECT``, not through the
page cache (:class:`DirectFile`): a model written once is not read again by its writer, and filling the page cache
with it costs fresh memory, which some virtual machines back only on first touch at several times the cost of the
copy (``benchmarks/results/moe_speed_scale_r24_notes.md``), and evicts the checkpoints a merge is still reading.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_CODES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.float64: "F64",
          torch.int64: "I64"}
_RANK = {code: rank for rank, code in enumerate(("BOOL", "U8", "I8", "I16", "F16", "BF16", "I32", "F32", "F64",
                                                 "I64"))}
"""The order of safetensors' ``Dtype`` enum, which ``save_file`` sorts the data by (largest first)."""


def parse_size(size: int | str) -> int:
    """Bytes of ``"5GB"``, ``"500MB"`` or a positive integer.

    Raises:
        InvalidParameterError: anything else, naming ``max_shard_size``.
    """
    from ..errors import InvalidParameterError

    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        from huggingface_hub.serialization._base import parse_size_to_int

        try:
            parsed = parse_size_to_int(size.strip())
        except ValueError:
            parsed = 0
        if parsed > 0:
            return parsed
    raise InvalidParameterError(f"max_shard_size must be a positive number of bytes or a size such as '5GB' or "
                                f"'500MB', got {size!r:.60}.")


DIRECT_ENV = "HF_MLOSS_DIRECT_WRITES"
"""``0`` writes every file through the page cache (a slow disk, where ``O_DIRECT`` waits for each block while the
page cache would return at once); ``1`` or unset: ``O_DIRECT`` where it is allowed."""


def direct_writes() -> bool:
    """Whether :data:`DIRECT_ENV` allows ``O_DIRECT`` writes (``1`` or unset).

    Raises:
        InvalidParameterError: a value other than ``0`` and ``1``.
    """
    raw = os.environ.get(DIRECT_ENV)
    if raw is None or not raw.strip():
        return True
    if raw.strip() not in ("0", "1"):
        from ..errors import InvalidParameterError

        raise InvalidParameterError(f"{DIRECT_ENV}={raw[:20]!r} must be 0 (write through the page cache) or 1 "
                                    "(with O_DIRECT where the file system allows it, the default).")
    return raw.strip() == "1"


BLOCK = 4096
"""The unit of a direct write: offsets, lengths and the staging buffer's address are multiples of it."""
STAGE_BYTES = 1 << 24
"""The page-aligned staging buffer a direct write copies the data through (16 MB)."""


class DirectFile:
    """A new file of ``size`` bytes written piece by piece at any offset, with ``O_DIRECT`` where it is allowed.

    The whole blocks of a piece are copied into one page-aligned staging buffer and written straight to the disk;
    the partial blocks at its edges are assembled in memory and written once complete (every byte is written once,
    so a block is complete when its bytes are all in). Where ``O_DIRECT`` is missing (not Linux), refused (tmpfs,
    some network file systems) or turned off (:data:`DIRECT_ENV`), the file is written through the page cache
    instead, with the same bytes.
    """

    def __init__(self, path: Path, size: int, *, direct: bool = True) -> None:
        self.path, self.size = path, size
        self.direct = direct and hasattr(os, "O_DIRECT") and direct_writes()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if self.direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError:
                self.direct = False
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
        self.partial: dict[int, tuple[bytearray, int]] = {}  # block → its bytes so far, and how many are in
        self.stage: memoryview | None = None  # made at the first direct write, page-aligned (an anonymous map)

    def write(self, view: memoryview, offset: int) -> None:
        """Write the bytes ``view`` at ``offset``."""
        if not self.direct:
            _pwrite(self.fd, view, offset)
            return
        end = offset + len(view)
        first, last = -(-offset // BLOCK) * BLOCK, end // BLOCK * BLOCK  # the whole blocks: [first, last)
        if first >= last:
            self._edges(view, offset)
            return
        self._edges(view[: first - offset], offset)
        self._edges(view[last - offset:], last)
        for start in range(first, last, STAGE_BYTES):
            n = min(STAGE_BYTES, last - start)
            self._direct(view[start - offset:start - offset + n], start)

    def close(self) -> None:
        """Write the blocks still partial (the last one, past the end of the data), cut the file to ``size``."""
        try:
            while self.partial:  # (a refused write empties it: the rest goes through the page cache)
                block = min(self.partial)
                self._direct(memoryview(self.partial.pop(block)[0]), block * BLOCK)
            os.ftruncate(self.fd, self.size)
        finally:
            os.close(self.fd)
            self.stage = None

    def _edges(self, view: memoryview, offset: int) -> None:
        """Add bytes that cover no whole block to their blocks; a block whose bytes are all in is written."""
        while len(view):
            block, at = divmod(offset, BLOCK)
            n = min(BLOCK - at, len(view))
            data, filled = self.partial.get(block) or (bytearray(BLOCK), 0)
            data[at:at + n] = view[:n]
            filled += n
            if filled == min(BLOCK, self.size - block * BLOCK):
                self.partial.pop(block, None)
                self._direct(memoryview(data), block * BLOCK)
            else:
                self.partial[block] = (data, filled)
            view, offset = view[n:], offset + n

    def _direct(self, view: memoryview, offset: int) -> None:
        """Write whole blocks (``len(view)`` a multiple of :data:`BLOCK`) at ``offset`` through the staging buffer;
        where the file system refuses them, the file goes on through the page cache."""
        if not self.direct:
            _pwrite(self.fd, view, offset)
            return
        if self.stage is None:
            self.stage = memoryview(mmap.mmap(-1, STAGE_BYTES))
        n = len(view)
        self.stage[:n] = view
        try:
            _pwrite(self.fd, self.stage[:n], offset)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            os.close(self.fd)  # the alignment is refused: the rest through the page cache, same bytes
            self.fd, self.direct = os.open(self.path, os.O_WRONLY), False
            _pwrite(self.fd, view, offset)
            for block in sorted(self.partial):  # their missing bytes come later, over the zeros written now
                _pwrite(self.fd, memoryview(self.partial.pop(block)[0]), block * BLOCK)


class _Shard:
    """One file: its tensors' offsets (after the header) and the header, written when the file is opened."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]], direct: bool) -> None:
        self.path, self.names, self.direct = path, [name for name, _, _ in entries], direct
        ordered = sorted(entries, key=lambda e: (-_RANK[_CODES[e[2]]], e[0]))
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        self.offsets, offset = {}, 0
        for name, shape, dtype in ordered:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.offsets[name], offset = offset, offset + size
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        raw += b" " * (-len(raw) % 8)
        self.head = len(raw).to_bytes(8, "little") + raw
        self.size = len(self.head) + offset
        self.file: DirectFile | None = None
        self.pending = set(self.names)

    def open(self) -> None:
        if self.file is None:
            self.file = DirectFile(self.path, self.size, direct=self.direct)
            self.file.write(memoryview(self.head), 0)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.open()
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self.file.write(memoryview(data).cast("B"), len(self.head) + self.offsets[name])
        self.pending.discard(name)

    def close(self) -> None:
        if not self.names:
            self.open()  # no tensor: the header alone, as save_file writes it
        if self.file is not None:
            self.file.close()
            self.file = None


class ShardWriter:
    """``add`` the planned tensors in their order, then ``finish``: ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_size`` bytes each (a larger tensor gets a shard
    of its own; a shard closes when the next tensor would not fit) and their index.

    Args:
        folder: where the files go.
        entries: ``(name, shape, dtype)`` of every tensor, in the order they will be added.
        max_shard_size: the shard size limit.
        direct: write with ``O_DIRECT`` where the file system allows it (:class:`DirectFile`).
    """

    def __init__(self, folder: Path, entries: Sequence[tuple[str, Sequence[int], torch.dtype]],
                 max_shard_size: int | str = "5GB", *, direct: bool = True) -> None:
        self.folder = Path(folder)
        self.limit = parse_size(max_shard_size)
        planned = [(name, tuple(int(n) for n in shape), dtype) for name, shape, dtype in entries]
        if len({name for name, _, _ in planned}) != len(planned):
            raise ValueError("a tensor is planned twice")
        groups: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = []
        size = 0
        for entry in planned:
            nbytes = math.prod(entry[1]) * entry[2].itemsize
            if not groups or (groups[-1] and size + nbytes > self.limit):
                groups.append([])
                size = 0
            groups[-1].append(entry)
            size += nbytes
        groups = groups or [[]]  # no tensor at all: one file with an empty header, as save_file writes it
        self.shards = [_Shard(self.folder / f".shard-{i}.safetensors", group, direct) for i, group in enumerate(groups)]
        self.plan = planned
        self.position = 0
        self.total_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in planned)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next planned tensor (its name, shape and dtype must be the plan's)."""
        if self.position >= len(self.plan):
            raise ValueError(f"tensor {name!r} was not planned")
        expected = self.plan[self.position]
        if (name, tuple(tensor.shape), tensor.dtype) != expected:
            raise ValueError(f"tensor {name!r} {tuple(tensor.shape)} {tensor.dtype} comes where the plan has "
                             f"{expected}")
        self.position += 1
        for shard in self.shards:
            if name in shard.pending:
                shard.write(name, tensor)
                if not shard.pending:
                    shard.close()
                return

    def finish(self) -> list[str]:
        """Name the files as transformers does (and write the index); returns the file names."""
        for shard in self.shards:
            shard.close()
        if self.position != len(self.plan):
            missing = [name for name, _, _ in self.plan[self.position:]]
            raise ValueError(f"{len(missing)} planned tensor(s) never added, e.g. {missing[0]!r}")
        count = len(self.shards)
        if count == 1:
            self.shards[0].path.rename(self.folder / SINGLE)
            return [SINGLE]
        names, weight_map = [], {}
        for i, shard in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            shard.path.rename(self.folder / name)
            names.append(name)
            weight_map.update(dict.fromkeys(shard.names, name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return [*names, INDEX]


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + (1 << 30)], offset + done)
