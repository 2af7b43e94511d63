"""Streaming safetensors writer: tensors are written shard by shard as they come, so building an MoE never holds more
than one shard (plus the tensors of one layer) in memory; the file names and the index are transformers' own."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def parse_size(size: int | str) -> int:
    """Bytes of ``"5GB"``, ``"500MB"`` or an integer."""
    if isinstance(size, int):
        return size
    from huggingface_hub.serialization._base import parse_size_to_int

    return parse_size_to_int(size)


class ShardWriter:
    """``add`` tensors, then ``finish``: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards of at
    most ``max_shard_size`` bytes each (a larger tensor gets a shard of its own) and their index."""

    def __init__(self, folder: Path, max_shard_size: int | str = "5GB") -> None:
        self.folder = Path(folder)
        self.limit = parse_size(max_shard_size)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in shard for shard in self.shards):
            raise ValueError(f"tensor {name!r} written twice")
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.limit:
            self._flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        index = len(self.shards)
        save_file(self.pending, str(self.folder / f".shard-{index}.safetensors"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard and name the files as transformers does; returns the file names."""
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        if count == 1:
            (self.folder / ".shard-0.safetensors").rename(self.folder / SINGLE)
            return [SINGLE]
        names, weight_map = [], {}
        for i, keys in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.folder / f".shard-{i}.safetensors").rename(self.folder / name)
            names.append(name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return [*names, INDEX]
