"""Streaming safetensors writer: the tensors' names, shapes and dtypes are known before the first one is computed, so
each shard's header is written first and every tensor's bytes go straight to their place in the file as the tensor
comes (``pwrite``): building an MoE, or a merge written block by block (:mod:`hf_mloss.output.spill`), never holds
more than the tensors of one layer, whatever the shard size. The
files are byte for byte what ``safetensors.torch.save_file`` writes for the same tensors (data sorted by dtype, then
name; the header padded to 8 bytes), and the file names and the index are transformers' own.
"""

from __future__ import annotations

import json
import math
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


class _Shard:
    """One file: its tensors' offsets (after the header) and the header, written when the file is opened."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        self.path, self.names = path, [name for name, _, _ in entries]
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
        self.fd: int | None = None
        self.pending = set(self.names)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.fd is None:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            _pwrite(self.fd, memoryview(self.head), 0)
            os.ftruncate(self.fd, self.size)
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        _pwrite(self.fd, memoryview(data).cast("B"), len(self.head) + self.offsets[name])
        self.pending.discard(name)

    def close(self) -> None:
        if not self.names and self.fd is None:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            _pwrite(self.fd, memoryview(self.head), 0)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + (1 << 30)], offset + done)


class ShardWriter:
    """``add`` the planned tensors in their order, then ``finish``: ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_size`` bytes each (a larger tensor gets a shard
    of its own; a shard closes when the next tensor would not fit) and their index.

    Args:
        folder: where the files go.
        entries: ``(name, shape, dtype)`` of every tensor, in the order they will be added.
        max_shard_size: the shard size limit.
    """

    def __init__(self, folder: Path, entries: Sequence[tuple[str, Sequence[int], torch.dtype]],
                 max_shard_size: int | str = "5GB") -> None:
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
        self.shards = [_Shard(self.folder / f".shard-{i}.safetensors", group) for i, group in enumerate(groups)]
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
