"""Lazy, per-tensor access to a checkpoint: one tensor in memory at a time, never the whole model.

A :class:`CheckpointStore` indexes the weight file(s) of a model folder (safetensors, single or sharded, else
``pytorch_model.bin`` files), maps every key to its canonical name through the adapter, and reads tensors one at a
time: safetensors with ``safe_open`` (``pread`` backend: bytes land in a fresh buffer instead of staying mapped, so
resident memory stays honest; :meth:`~TensorStore.get_rows` preads only a row range's bytes), ``.bin`` files with the
restricted unpickler (``torch.load(weights_only=True, mmap=True)``: it cannot run code, and zip-format files are
mapped, not read whole). A ``.bin`` file that only the full unpickler could read is refused. Buffers the model class
does not save (``position_ids``, which 2021-era checkpoints still hold) are left out, so checkpoints compare on what
the class persists. :class:`ModuleStore` offers the same interface over a model already in memory.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pickle
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import PreTrainedModel

from ..adapters import ModelAdapter
from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from .hub import PICKLE_INDEX, PICKLE_SINGLE, SAFETENSORS_INDEX, SAFETENSORS_SINGLE, ModelRef, find_weights

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    # float8 is read only to be refused by name (hf_mloss.loading.inputs.check_no_float8), never merged
    **{code: getattr(torch, name) for code, name in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"))
       if hasattr(torch, name)},
}  # fmt: skip


class TensorStore:
    """Interface shared by file-backed and in-memory stores."""

    ref: ModelRef
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    bytes_read: int = 0
    """Stored bytes of the distinct tensors read so far (a tensor read in pieces or several times counts once): how far
    a run has come through its inputs' files (:class:`~hf_mloss.loading.hub.FolderFingerprints` paces on it)."""
    reads_rows: bool = False
    """Whether :meth:`get_rows` reads only those rows (a file's byte range, a view of a tensor in memory) rather
    than the whole tensor first: readers that take a tensor a block of rows at a time ask for it."""

    def keys(self) -> list[str]:
        return list(self.shapes)

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (along dim 0) of a tensor, without reading the rest where the format allows."""
        return self.get(name)[start:stop]

    def get_float(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """The tensor as float32 on ``device`` (merges compute in float32 whatever the stored dtype)."""
        return self.get(name).to(device=device, dtype=torch.float32)

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Write the tensor into ``out`` (its shape; any dtype and device: converted on the way) and return ``out``.
        Reusing ``out`` from tensor to tensor spares the fresh pages each :meth:`get` maps."""
        return out.copy_(self.get(name))

    def read_flat_into(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Write entries ``start:start + out.numel()`` of the flattened tensor into the 1-D ``out`` (any dtype and
        device: converted on the way) and return ``out``: a large tensor read piece by piece into reused buffers."""
        width = max(1, math.prod(self.shapes[name][1:]))
        first, stop = start // width, start + out.numel()
        rows = self.get_rows(name, first, -(-stop // width)).reshape(-1)
        return out.copy_(rows[start - first * width: stop - first * width])

    def close(self) -> None:
        pass


class CheckpointStore(TensorStore):
    """Per-tensor reader over the safetensors (else ``pytorch_model.bin``) files of a resolved model folder."""

    reads_rows = True

    def __init__(self, ref: ModelRef, adapter: ModelAdapter, *, allow_pickle: bool = True) -> None:
        self.ref = ref
        self.adapter = adapter
        folder = Path(ref.path)
        self._locations: dict[str, tuple[Path, str]] = {}
        self.shapes = {}
        self.dtypes = {}
        self._handles: dict[Path, object] = {}
        self._offsets: dict[Path, dict[str, int]] = {}
        self._pickle_states: dict[Path, Mapping[str, torch.Tensor]] = {}
        self._unsaved = unsaved_buffers(adapter)
        self._read: set[str] = set()
        weights = find_weights(folder, allow_pickle=allow_pickle)
        if weights is None:
            pickles = find_weights(folder) if not allow_pickle else None
            if pickles is not None:
                raise UnsafeCheckpointError(
                    f"{ref.name!r} only has pickle weights ({', '.join(p.name for p in pickles.files)}) and "
                    "allow_pickle=False asks for safetensors only. Pass allow_pickle=True to read them with the "
                    "restricted unpickler (torch.load(weights_only=True), which cannot run code), or convert the "
                    "checkpoint to safetensors."
                )
            raise CorruptCheckpointError(
                f"No weights found in {ref.name!r} ({folder}): expected {SAFETENSORS_SINGLE} or "
                f"{SAFETENSORS_INDEX}, or {PICKLE_SINGLE} / {PICKLE_INDEX}."
            )
        self.is_pickle = weights.is_pickle
        self._fused: dict[str, list[tuple[Path, str]]] = {}
        """A parameter transformers fuses from several checkpoint tensors (MoE experts) → those tensors."""
        self._placements: dict[str, tuple[dict[str, tuple[Any, ...]] | None, dict[str, tuple[int, ...]]]] = {}
        """A fused parameter → where each of its tensors lands in it (or None: assembled) and their stored shapes."""
        self.checkpoint_keys: list[str] = []
        """Every key of the weight files as written (the checkpoint's layout, which a merge is saved back in)."""
        self.beyond_config: dict[str, tuple[int, ...]] = {}
        """Checkpoint keys of numbered blocks the model of this config does not have (``model.layers.1.*`` under
        ``num_hidden_layers: 1``), with their shapes: ``from_pretrained`` drops them as unexpected; a merge refuses
        them (:func:`hf_mloss.loading.inputs.check_config_matches_tensors`, ``check_compatible``)."""
        entries = {}  # a key held by two shards: the later one, as from_pretrained's merged state dict keeps it
        for file in weights.files:
            entries.update({key: (file, key, shape, dtype) for key, (shape, dtype) in self._read_index(file).items()})
        self._index(list(entries.values()))
        self._index_fused()
        if not self.shapes:
            raise CorruptCheckpointError(
                f"{ref.name!r} holds no tensors of a {adapter.name} model (checked {len(weights.files)} weight "
                "file(s))."
            )

    # ------------------------------------------------------------------ indexing
    def _read_index(self, file: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        if not file.exists():
            raise CorruptCheckpointError(f"Shard {file.name} listed in the index of {self.ref.name!r} is missing.")
        if self.is_pickle:
            state = load_pickle_state(file, self.ref.name)
            self._pickle_states[file] = state
            entries = {key: (tuple(t.shape), t.dtype) for key, t in state.items()}
        else:
            entries = self._index_safetensors(file)
        self.checkpoint_keys += entries
        return entries

    def _index(self, entries: list[tuple[Path, str, tuple[int, ...], torch.dtype | None]]) -> None:
        """Map every checkpoint key to its parameter as ``from_pretrained`` does: keys in transformers' own order
        (``dot_natural_key``), the first key that becomes a parameter wins it (a stray ``lm_head.weight`` beside
        GPT-NeoX's ``embed_out.weight`` is ignored, as the loader ignores it), tied and unsaved tensors left out."""
        from transformers.core_model_loading import dot_natural_key

        names = {key: self.adapter.checkpoint_key(key) for _, key, _, _ in entries}
        winners: dict[str, str] = {}  # parameter -> the checkpoint key the loader keeps for it
        for key in sorted(names, key=dot_natural_key):
            if names[key][0] is not None and names[key][1] is None:
                winners.setdefault(names[key][0], key)
        for file, key, shape, dtype in entries:  # in the files' order (the order tensors are merged in)
            name, fused = names[key]
            if name is None:
                if dtype is not None and dtype.is_floating_point and _beyond_config(self.adapter, key):
                    self.beyond_config[key] = shape
                continue
            if name in self._unsaved:
                continue
            if fused is not None:  # one of the tensors of a fused parameter: assembled when it is read
                self._fused.setdefault(name, []).append((file, key))
                self.dtypes[name] = dtype
                continue
            if winners[name] != key:  # a second tensor for one parameter: the loader keeps the first
                continue
            self._locations[name] = (file, key)
            self.shapes[name] = shape
            self.dtypes[name] = dtype

    def _index_fused(self) -> None:
        """Shapes of the fused parameters (the loaded model's), once every shard is indexed; a parameter of several
        dtypes is refused."""
        if not self._fused:
            return
        layout = self.adapter.layout
        for name, parts in self._fused.items():
            kinds = {self._entry_dtype(file, key) for file, key in parts}
            if len(kinds) > 1:
                raise CorruptCheckpointError(f"{self.ref.name!r}: the tensors fused into {name!r} have several dtypes "
                                             f"({sorted(map(str, kinds))}).")
            self.shapes[name] = layout.shapes[name]

    def _index_safetensors(self, file: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu", backend="pread")
            infos = {key: handle.get_slice(key) for key in handle.keys()}
            entries = {key: (tuple(info.get_shape()), _DTYPES.get(info.get_dtype())) for key, info in infos.items()}
        except (SafetensorError, OSError, ValueError) as err:
            raise CorruptCheckpointError(
                f"Cannot read {file.name} of {self.ref.name!r}: {err}. The file is corrupted or not a safetensors "
                "file; download it again (for Hub models: huggingface-cli download --force-download ...)."
            ) from err
        self._handles[file] = handle
        self._offsets[file] = safetensors_offsets(file)
        return entries

    def _entry_dtype(self, file: Path, key: str) -> torch.dtype | None:
        if self.is_pickle:
            return self._pickle_states[file][key].dtype
        return _DTYPES.get(self._handles[file].get_slice(key).get_dtype())

    def _read_key(self, file: Path, key: str, name: str) -> torch.Tensor:
        if self.is_pickle:
            return self._pickle_states[file][key].clone()
        try:
            return self._handles[file].get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise CorruptCheckpointError(f"Cannot read tensor {name!r} from {file.name} of {self.ref.name!r}: {err}")

    # ------------------------------------------------------------------ reading
    def _count(self, name: str) -> None:
        if name not in self._read:
            self._read.add(name)
            dtype = self.dtypes.get(name)
            self.bytes_read += math.prod(self.shapes.get(name, ())) * (dtype.itemsize if dtype is not None else 4)

    def get(self, name: str) -> torch.Tensor:
        self._count(name)
        if name in self._fused:  # MoE experts: the per-expert tensors, fused as transformers fuses them
            parts = [(key, self._read_key(file, key, name)) for file, key in self._fused[name]]
            return self.adapter.layout.assemble(name, parts)
        file, key = self._locations[name]
        if self.is_pickle:
            return self._pickle_states[file][key].clone()  # a fresh buffer, never the shared mapped one
        try:
            return self._handles[file].get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise CorruptCheckpointError(f"Cannot read tensor {name!r} from {file.name} of {self.ref.name!r}: {err}")

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        self._count(name)
        if name in self._fused:
            return self.get(name)[start:stop]
        file, key = self._locations[name]
        if self.is_pickle:
            return self._pickle_states[file][key][start:stop].clone()
        shape, dtype = self.shapes[name], self.dtypes[name]
        start, stop = max(0, min(start, shape[0])), max(0, min(stop, shape[0]))
        rows = torch.empty((max(stop - start, 0), *shape[1:]), dtype=dtype)
        self._pread(name, start, rows)
        return rows

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """:meth:`TensorStore.read_into` without a fresh buffer: the bytes are pread straight into ``out`` where it
        is a contiguous CPU tensor of the stored dtype, else through a reused staging buffer of at most
        :data:`STAGING_BYTES`, rows at a time, converted into ``out`` while they are in cache."""
        self._count(name)
        shape, dtype = self.shapes[name], self.dtypes[name]
        if self.is_pickle or dtype is None or not shape or tuple(out.shape) != shape:
            return super().read_into(name, out)
        if name not in self._fused:
            return self._read_stored_into(*self._locations[name], shape, dtype, out, name)
        if name not in self._placements:  # MoE experts: each per-expert tensor read straight into its place
            shapes = {key: tuple(self._handles[file].get_slice(key).get_shape()) for file, key in self._fused[name]}
            self._placements[name] = (self.adapter.layout.placement(name, shapes), shapes)
        placement, shapes = self._placements[name]
        if placement is None:
            return super().read_into(name, out)
        for file, key in self._fused[name]:
            self._read_stored_into(file, key, shapes[key], dtype, out[placement[key]], name)
        return out

    def _read_stored_into(self, file: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor,
                          name: str) -> torch.Tensor:
        """Checkpoint tensor ``key`` of ``file`` (``shape``, ``dtype``) into ``out`` (its shape): pread straight into
        it where it is a contiguous CPU tensor of that dtype, else through the staging buffer, rows at a time."""
        if out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous():
            self._pread_at(file, key, 0, out, name)
            return out
        row_bytes = max(1, math.prod(shape[1:]) * dtype.itemsize)
        step = max(1, STAGING_BYTES // row_bytes)
        staging = _staging(min(step, shape[0]) * row_bytes)
        for start in range(0, shape[0], step):
            rows = out[start:start + step]
            piece = staging[: rows.shape[0] * row_bytes].view(dtype).view(rows.shape)
            self._pread_at(file, key, start * row_bytes, piece, name)
            rows.copy_(piece)
        return out

    def read_flat_into(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """:meth:`TensorStore.read_flat_into` reading just those bytes: straight into ``out`` where it is a
        contiguous CPU tensor of the stored dtype, else through this thread's staging buffer."""
        self._count(name)
        dtype = self.dtypes[name]
        if self.is_pickle or dtype is None or name in self._fused:
            return super().read_flat_into(name, start, out)
        if out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous():
            self._pread_bytes(name, start * dtype.itemsize, out)
            return out
        staged = _staging(out.numel() * dtype.itemsize)[: out.numel() * dtype.itemsize].view(dtype)
        self._pread_bytes(name, start * dtype.itemsize, staged)
        return out.copy_(staged)

    def _pread(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Read rows ``start:start + len(rows)`` of tensor ``name`` into the contiguous CPU tensor ``rows``: nothing
        else is read, nothing stays mapped."""
        self._pread_bytes(name, start * rows[0:1].nbytes if rows.numel() else 0, rows)

    def _pread_bytes(self, name: str, skip: int, rows: torch.Tensor) -> None:
        """Read ``rows.nbytes`` bytes of tensor ``name``, from its byte ``skip`` on, into the contiguous CPU tensor
        ``rows``."""
        self._pread_at(*self._locations[name], skip, rows, name)

    def _pread_at(self, file: Path, key: str, skip: int, rows: torch.Tensor, name: str) -> None:
        """:meth:`_pread_bytes` of checkpoint tensor ``key`` in ``file`` (parameter ``name``, for the error)."""
        offset = self._offsets[file][key] + skip
        try:
            with open(file, "rb", buffering=0) as handle:
                view, done = memoryview(rows.view(torch.uint8).numpy()).cast("B"), 0
                while done < len(view):
                    got = os.preadv(handle.fileno(), [view[done:]], offset + done)
                    if got <= 0:
                        raise OSError(f"file ends {len(view) - done} bytes early")
                    done += got
        except OSError as err:
            raise CorruptCheckpointError(f"Cannot read tensor {name!r} from {file.name} of {self.ref.name!r}: {err}")

    def close(self) -> None:
        self._handles.clear()
        self._pickle_states.clear()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.ref.name!r}, tensors={len(self.shapes)})"


class ProducedStore(CheckpointStore):
    """A checkpoint folder's store (its files' index, names and fused tensors) whose bytes come from ``producers``
    (checkpoint key → a callable that makes the tensor as it was written) instead of its files; keys without one are
    read. An MoE build routes its prompts through the folder it has just written this way: each tensor made again
    from the sources, still in the page cache, instead of the folder read back (:func:`hf_mloss.moe.build.build_moe`).
    The tensor made last is kept for the reads that follow it (an embedding's rows, a tensor's staged pieces); a
    producer may reuse the memory of the one before."""

    def __init__(self, ref: ModelRef, adapter: ModelAdapter, producers: Mapping[str, Any]) -> None:
        super().__init__(ref, adapter)
        self._producers = producers
        self._last: tuple[str, torch.Tensor] | None = None

    def _pread_at(self, file: Path, key: str, skip: int, rows: torch.Tensor, name: str) -> None:
        produce = self._producers.get(key)
        if produce is None:
            super()._pread_at(file, key, skip, rows, name)
            return
        if self._last is None or self._last[0] != key:
            self._last = None
            self._last = (key, produce().contiguous())
        data = self._last[1].reshape(-1).view(torch.uint8)
        rows.view(torch.uint8).reshape(-1).copy_(data[skip:skip + rows.nbytes])


class ModuleStore(TensorStore):
    """The store interface over a model already in memory (a user-passed ``PreTrainedModel``)."""

    reads_rows = True  # rows of a tensor in memory are a view

    def __init__(self, model: PreTrainedModel, adapter: ModelAdapter, ref: ModelRef) -> None:
        self.ref = ref
        self._tensors = {}
        skipped = unsaved_buffers(adapter)
        for key, tensor in model.state_dict().items():
            name = adapter.canonical_key(key)
            if name is not None and name not in skipped:
                self._tensors[name] = tensor.detach()
        self.shapes = {name: tuple(t.shape) for name, t in self._tensors.items()}
        self.dtypes = {name: t.dtype for name, t in self._tensors.items()}

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __repr__(self) -> str:
        return f"ModuleStore({self.ref.name!r}, tensors={len(self.shapes)})"


STAGING_BYTES = 1 << 24
"""Bytes of one staging piece of :meth:`CheckpointStore.read_into` (16 MB: rows of an LLM's embedding at a time)."""
_STAGING = threading.local()


def _staging(nbytes: int) -> torch.Tensor:
    """This thread's reused staging buffer, grown to at least ``nbytes`` (a pool's workers read side by side)."""
    buffer = getattr(_STAGING, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _STAGING.buffer = torch.empty(nbytes, dtype=torch.uint8)
    return buffer


def _beyond_config(adapter: ModelAdapter, key: str) -> bool:
    """Whether a key the model does not load is a tensor of a numbered block the config does not have: the same key
    in block 0 is one the model loads (``model.layers.1.mlp.up_proj.weight`` of a one-block config). Other unloaded
    keys (buffers old checkpoints still hold, a head the class does not have) are ignored, as ``from_pretrained``
    ignores them."""
    first = re.sub(r"\.\d+\.", ".0.", key)
    return first != key and adapter.canonical_key(first) is not None


def safetensors_header(file: Path) -> tuple[int, dict[str, Any]]:
    """The size of a safetensors file's JSON header and its tensors' entries (dtype, shape, data offsets)."""
    with open(file, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return size, header


def safetensors_offsets(file: Path) -> dict[str, int]:
    """Absolute byte offset of every tensor's data in a safetensors file (from its JSON header)."""
    size, header = safetensors_header(file)
    return {key: 8 + size + info["data_offsets"][0] for key, info in header.items()}


def meta_tensor(info: Mapping[str, Any]) -> torch.Tensor:
    """A ``meta`` tensor of a safetensors header entry's shape and dtype."""
    return torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]], device="meta")


def load_pickle_state(file: Path, model_name: str) -> Mapping[str, torch.Tensor]:
    """A ``pytorch_model.bin`` state dict read with the restricted unpickler (``weights_only=True``), mapped lazily
    when the file is in the zip format (every ``torch.save`` since PyTorch 1.6), read whole otherwise.

    Raises:
        UnsafeCheckpointError: the file needs the full unpickler (it references code, not just tensors).
        CorruptCheckpointError: the file cannot be read, or is not a flat mapping of names to tensors.
    """
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap can only be used" not in str(err):
                raise
            state = torch.load(file, map_location="cpu", weights_only=True)  # pre-1.6 format: no lazy mapping
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"{file.name} of {model_name!r} cannot be read with the restricted unpickler "
            f"(torch.load(weights_only=True)): {_unpickler_reason(err)}. Reading it would need the full unpickler, "
            "which can run arbitrary code, so hf_mloss refuses it. Convert it to safetensors where you trust its "
            "source (safetensors.torch.save_file of its state dict) and merge the converted folder."
        ) from err
    except (RuntimeError, OSError, EOFError, KeyError, ValueError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CorruptCheckpointError(
            f"Cannot read {file.name} of {model_name!r}: {reason}. The file is truncated or not a PyTorch checkpoint; "
            "download it again."
        ) from err
    if not isinstance(state, Mapping) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CorruptCheckpointError(
            f"{file.name} of {model_name!r} holds a {type(state).__name__}, not a state dict of tensors (a nested "
            "training checkpoint?). Save the model's state_dict() (or save_pretrained) and merge that."
        )
    return state


def _unpickler_reason(err: pickle.UnpicklingError) -> str:
    """The one line of torch's message that says what the restricted unpickler refused."""
    for line in str(err).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip().split(". ")[0]
    return str(err).splitlines()[0] if str(err) else "refused"


def unsaved_buffers(adapter: ModelAdapter) -> frozenset[str]:
    """Canonical names never read from a checkpoint: the buffers the merged class computes instead of saving
    (``position_ids``), and the tensors tied to another one (``lm_head.weight`` tied to the input embeddings).

    Old checkpoints still hold some of the buffers (CLIP checkpoints saved before transformers made ``position_ids``
    non-persistent); they are not weights and are never compared or merged. A tied tensor is merged once, through
    the tensor it is tied to (transformers ignores a saved copy of it too).
    """
    model_class = getattr(adapter, "merged_class", adapter.model_class)
    config = getattr(adapter, "merged_config", adapter.config)
    raw = _unsaved_buffers(model_class, config.to_json_string(use_diff=False))
    tied = adapter.tied_names() if hasattr(adapter, "tied_names") else frozenset()
    return frozenset(name for name in map(adapter.canonical_key, raw) if name is not None) | tied


@functools.lru_cache(maxsize=16)
def _unsaved_buffers(model_class: type[PreTrainedModel], config_json: str) -> frozenset[str]:
    config = model_class.config_class.from_dict(json.loads(config_json))
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = model_class(config)
    saved = set(model.state_dict())
    return frozenset(name for name, _ in model.named_buffers() if name not in saved)


def must_match(store: TensorStore) -> set[str]:
    """Names every model of a merge must hold, with the base's shape: the floating-point tensors of ``store``.

    Integer / bool tensors (buffers such as counters or ids) are not merged: present in the base only, they are taken
    from the base; a name held by two models must still have the same shape and kind in both.
    """
    return {name for name, dtype in store.dtypes.items() if dtype is not None and dtype.is_floating_point}
