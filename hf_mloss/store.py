"""Lazy, per-tensor access to a checkpoint: one tensor in memory at a time, never the whole model.

A :class:`CheckpointStore` indexes the safetensors file(s) of a model folder (single file or sharded with an index),
maps every key to its canonical name through the adapter, and reads tensors one at a time with ``safe_open``
(``pread`` backend: bytes land in a fresh buffer instead of staying mapped, so resident memory stays honest).
Pickle (``.bin``) checkpoints are refused unless ``allow_pickle=True``. :class:`ModuleStore` offers the same
interface over a model already in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import PreTrainedModel

from .adapters import ModelAdapter
from .errors import CorruptCheckpointError, UnsafeCheckpointError
from .hub import ModelRef

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


class TensorStore:
    """Interface shared by file-backed and in-memory stores."""

    ref: ModelRef
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]

    def keys(self) -> list[str]:
        return list(self.shapes)

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def get_float(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """The tensor as float32 on ``device`` (merges compute in float32 whatever the stored dtype)."""
        return self.get(name).to(device=device, dtype=torch.float32)

    def close(self) -> None:
        pass


class CheckpointStore(TensorStore):
    """Per-tensor reader over the safetensors (or, if allowed, pickle) files of a resolved model folder."""

    def __init__(self, ref: ModelRef, adapter: ModelAdapter, *, allow_pickle: bool = False) -> None:
        self.ref = ref
        self.adapter = adapter
        folder = Path(ref.path)
        self._locations: dict[str, tuple[Path, str]] = {}
        self.shapes = {}
        self.dtypes = {}
        self._handles: dict[Path, object] = {}
        self._pickle_cache: dict[Path, dict[str, torch.Tensor]] = {}
        files = _weight_files(folder, SAFETENSORS_INDEX, SAFETENSORS_SINGLE)
        self.is_pickle = False
        if not files:
            pickles = _weight_files(folder, PICKLE_INDEX, PICKLE_SINGLE)
            if not pickles:
                raise CorruptCheckpointError(
                    f"No weights found in {ref.name!r} ({folder}): expected model.safetensors or "
                    f"{SAFETENSORS_INDEX} (or pytorch_model.bin with allow_pickle=True)."
                )
            if not allow_pickle:
                raise UnsafeCheckpointError(
                    f"{ref.name!r} only has pickle weights ({', '.join(p.name for p in pickles)}). Loading pickles can "
                    "run arbitrary code, so hf_mloss refuses them by default. Convert the checkpoint to safetensors, "
                    "or pass allow_pickle=True if you trust its source."
                )
            self.is_pickle = True
            files = pickles
        for file in files:
            self._index_file(file)
        if not self.shapes:
            raise CorruptCheckpointError(
                f"{ref.name!r} holds no tensors of a {adapter.name} model (checked {len(files)} weight file(s))."
            )

    # ------------------------------------------------------------------ indexing
    def _index_file(self, file: Path) -> None:
        if not file.exists():
            raise CorruptCheckpointError(f"Shard {file.name} listed in the index of {self.ref.name!r} is missing.")
        if self.is_pickle:
            self._index_pickle(file)
            return
        try:
            handle = safe_open(str(file), framework="pt", device="cpu", backend="pread")
            raw_keys = list(handle.keys())
            infos = {key: handle.get_slice(key) for key in raw_keys}
            shapes = {key: tuple(info.get_shape()) for key, info in infos.items()}
            dtypes = {key: _DTYPES.get(info.get_dtype()) for key, info in infos.items()}
        except (SafetensorError, OSError, ValueError) as err:
            raise CorruptCheckpointError(
                f"Cannot read {file.name} of {self.ref.name!r}: {err}. The file is corrupted or not a safetensors "
                "file; download it again (for Hub models: huggingface-cli download --force-download ...)."
            ) from err
        self._handles[file] = handle
        for key in raw_keys:
            name = self.adapter.canonical_key(key)
            if name is None:
                continue
            self._locations[name] = (file, key)
            self.shapes[name] = shapes[key]
            self.dtypes[name] = dtypes[key]

    def _index_pickle(self, file: Path) -> None:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        self._pickle_cache[file] = state
        for key, tensor in state.items():
            name = self.adapter.canonical_key(key)
            if name is None:
                continue
            self._locations[name] = (file, key)
            self.shapes[name] = tuple(tensor.shape)
            self.dtypes[name] = tensor.dtype

    # ------------------------------------------------------------------ reading
    def get(self, name: str) -> torch.Tensor:
        file, key = self._locations[name]
        if self.is_pickle:
            return self._pickle_cache[file][key]
        try:
            return self._handles[file].get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise CorruptCheckpointError(f"Cannot read tensor {name!r} from {file.name} of {self.ref.name!r}: {err}")

    def close(self) -> None:
        self._handles.clear()
        self._pickle_cache.clear()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.ref.name!r}, tensors={len(self.shapes)})"


class ModuleStore(TensorStore):
    """The store interface over a model already in memory (a user-passed ``PreTrainedModel``)."""

    def __init__(self, model: PreTrainedModel, adapter: ModelAdapter, ref: ModelRef) -> None:
        self.ref = ref
        self._tensors = {}
        for key, tensor in model.state_dict().items():
            name = adapter.canonical_key(key)
            if name is not None:
                self._tensors[name] = tensor.detach()
        self.shapes = {name: tuple(t.shape) for name, t in self._tensors.items()}
        self.dtypes = {name: t.dtype for name, t in self._tensors.items()}

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __repr__(self) -> str:
        return f"ModuleStore({self.ref.name!r}, tensors={len(self.shapes)})"


def _weight_files(folder: Path, index_name: str, single_name: str) -> list[Path]:
    index = folder / index_name
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CorruptCheckpointError(f"Cannot parse {index}: {err}.") from err
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / single_name
    return [single] if single.exists() else []


def iter_stage_names(names: list[str], adapter: ModelAdapter) -> Iterator[tuple[int, list[str]]]:
    """Group canonical names by stage (embeddings, blocks in order, tail), keeping checkpoint order inside a stage."""
    stages: dict[int, list[str]] = {}
    for name in names:
        stages.setdefault(adapter.stage_of(name), []).append(name)
    for stage in sorted(stages):
        yield stage, stages[stage]
