"""``ModelInputs``: the scoring samples as the model takes them, whatever the modality.

A named set of tensors sharing a leading sample dimension: ``{"pixel_values": [N, 3, H, W]}`` for image families,
``{"input_ids": [N, T], "attention_mask": [N, T]}`` for text families (right-padded, mask 1 on real tokens). The
scoring walk reads it in batches (:meth:`ModelInputs.split`), one share per process (:meth:`ModelInputs.shard`).

```python
>>> inputs = ModelInputs({"input_ids": ids, "attention_mask": mask})
>>> len(inputs), inputs.num_tokens            # sequences, non-padding tokens
>>> for batch in inputs.shard(rank, world).split(16):
...     model(**batch)                        # each batch cut to its own longest sequence
```
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence
from typing import Any

import torch

from ..errors import DataError

SEQUENCE_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
"""Keys whose dimension 1 runs over token positions (cut to a batch's longest sequence by :meth:`split`)."""


class ModelInputs:
    """Tensors with one leading sample dimension, named by the model's input names.

    ``len()`` is the number of samples (not of keys); ``inputs["input_ids"]``, ``keys()``, ``items()`` and
    ``dict(inputs)`` read the tensors.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        tensors = dict(tensors)
        if not tensors:
            raise DataError("ModelInputs needs at least one tensor, e.g. {'pixel_values': ...} or "
                            "{'input_ids': ..., 'attention_mask': ...}.")
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                raise DataError(f"Model input {name!r} must be a tensor with a leading sample dimension, got "
                                f"{type(tensor).__name__}{tuple(getattr(tensor, 'shape', ()))}.")
        sizes = {name: len(tensor) for name, tensor in tensors.items()}
        if len(set(sizes.values())) != 1:
            raise DataError(f"Model inputs must hold the same number of samples, got {sizes}.")
        if "attention_mask" in tensors and "input_ids" in tensors and \
                tensors["attention_mask"].shape != tensors["input_ids"].shape:
            raise DataError(f"attention_mask has shape {tuple(tensors['attention_mask'].shape)} but input_ids "
                            f"{tuple(tensors['input_ids'].shape)}; they must match.")
        self._tensors = tensors

    # ---------------------------------------------------------------------------------- mapping-like access
    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def keys(self) -> KeysView[str]:
        return self._tensors.keys()

    def items(self) -> ItemsView[str, torch.Tensor]:
        return self._tensors.items()

    def to_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._tensors)

    def __len__(self) -> int:
        """Number of samples."""
        return len(next(iter(self._tensors.values())))

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {list(v.shape)}" for k, v in self._tensors.items())
        return f"ModelInputs({shapes})"

    # ---------------------------------------------------------------------------------- what it holds
    @property
    def modality(self) -> str:
        """``"text"`` (token ids) or ``"image"`` (pixel values)."""
        return "text" if "input_ids" in self._tensors else "image"

    @property
    def num_tokens(self) -> int | None:
        """Non-padding token positions (the attention mask's ones); None for pixel inputs."""
        if "attention_mask" in self._tensors:
            return int(self._tensors["attention_mask"].sum())
        if "input_ids" in self._tensors:
            return int(self._tensors["input_ids"].numel())
        return None

    # ---------------------------------------------------------------------------------- slicing
    def select(self, indices: slice | Sequence[int] | torch.Tensor) -> ModelInputs:
        """The samples at ``indices`` (a slice, a list of indices or an index tensor), in that order."""
        if not isinstance(indices, slice):
            indices = torch.as_tensor(indices, dtype=torch.long)
        return ModelInputs({name: tensor[indices] for name, tensor in self._tensors.items()})

    def shard(self, process_index: int, num_processes: int) -> ModelInputs:
        """This process's share: every ``num_processes``-th sample from ``process_index`` (as the scoring
        reduction expects: the shares together hold every sample once)."""
        if num_processes < 1 or not 0 <= process_index < num_processes:
            raise ValueError(f"process_index must be in [0, {num_processes}), got {process_index}.")
        return self.select(slice(process_index, None, num_processes))

    def split(self, batch_size: int) -> list[dict[str, torch.Tensor]]:
        """Consecutive batches of up to ``batch_size`` samples, as dicts a model's forward takes.

        Text batches are cut to their own longest sequence (padding is on the right, so only all-padding columns
        go): a batch of short sequences does not carry the padding of the longest one in the whole sample.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}.")
        chunks = {name: tensor.split(batch_size) for name, tensor in self._tensors.items()}
        batches = [dict(zip(chunks, parts)) for parts in zip(*chunks.values())
                   if len(parts[0])]  # none for no samples (a process's empty share), not one empty batch
        return [_trim_padding(batch) for batch in batches]

    def to(self, device: Any = None, dtype: torch.dtype | None = None) -> ModelInputs:
        """On ``device``; ``dtype`` applies to the floating-point tensors only (token ids stay integers)."""
        return ModelInputs({name: tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
                            for name, tensor in self._tensors.items()})


def _trim_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mask = batch.get("attention_mask")
    if mask is None or mask.dim() != 2 or mask.shape[1] == 0:
        return batch
    used = mask.bool().any(0).nonzero()
    length = int(used.max()) + 1 if len(used) else 1
    if length == mask.shape[1]:
        return batch
    return {name: tensor[:, :length] if name in SEQUENCE_KEYS and tensor.dim() >= 2 else tensor
            for name, tensor in batch.items()}


def as_model_inputs(value: Any) -> ModelInputs | None:
    """``value`` as :class:`ModelInputs` when it already holds model inputs (a ``ModelInputs``, a tokenizer's
    ``BatchEncoding`` or a mapping of tensors with ``input_ids`` or ``pixel_values``), else None."""
    if isinstance(value, ModelInputs):
        return value
    if isinstance(value, Mapping) and value and all(isinstance(v, torch.Tensor) for v in value.values()) and \
            ({"input_ids", "pixel_values"} & set(value)):
        return ModelInputs(value)
    return None


def spread_sample(samples: Any, n: int, seed: int) -> Any:
    """``n`` of ``samples`` (images, or token ids as :class:`~hf_mloss.loading.model_inputs.ModelInputs`) spread
    over the whole set, in their order: systematic sampling with a seeded random start, index ⌊(i + u)·N/n⌋ for
    i < n, u ~ U[0, 1). Every run of ≥ N/n consecutive samples gets at least one, so a data set ordered task by task
    gives every task its share (the first ``n`` would show only the first tasks); all of them when ``n`` ≥ N."""
    if isinstance(samples, ModelInputs) and samples.modality == "image":
        samples = samples["pixel_values"]  # the images as one tensor, as before
    total = len(samples)
    if n >= total:
        return samples
    index = spread_index(total, n, seed)
    return samples.select(index) if isinstance(samples, ModelInputs) else samples[index]


def concat_samples(parts: Sequence[Any]) -> Any:
    """Samples of several sets as one: pixel tensors concatenated; token ids right-padded to the longest (mask 0
    there, so the padding never counts).

    Raises:
        DataError: sets of images of different sizes.
    """
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts))
    if all("pixel_values" in p for p in parts):
        sizes = sorted({tuple(p["pixel_values"].shape[1:]) for p in parts})
        if len(sizes) > 1:
            raise DataError(f"The data sets hold images of different sizes ({', '.join(str(list(s)) for s in sizes)}); "
                            "give images (the base's image processor resizes them all alike), or tensors of one size.")
        return ModelInputs({"pixel_values": torch.cat([p["pixel_values"] for p in parts])})
    width = max(p["input_ids"].shape[1] for p in parts)
    out: dict[str, list[Any]] = {}
    for part in parts:
        for key, tensor in part.items():
            pad = width - tensor.shape[1]
            out.setdefault(key, []).append(torch.nn.functional.pad(tensor, (0, pad)) if pad else tensor)
    return ModelInputs({key: torch.cat(tensors) for key, tensors in out.items()})


SHARED = -1
"""The owner of a sample of the shared pool (``data=``): every model without data of its own reads it."""


def owner_groups(owner: torch.Tensor | None, num_models: int) -> list[tuple[list[int], torch.Tensor | None]]:
    """The models that read the same samples, each group with those samples' indices, in model order: without
    per-model data (``owner`` None) one group of every model and every sample (``None``); else the models without
    data of their own on the shared pool (:data:`SHARED`), and each model with its own on its own samples.

    Example:
        ```python
        >>> owner_groups(torch.tensor([-1, -1, 2, 2, 2]), 3)
        [([0, 1], tensor([0, 1])), ([2], tensor([2, 3, 4]))]
        ```
    """
    models = list(range(num_models))
    if owner is None:
        return [(models, None)]
    own = set(owner.unique().tolist()) - {SHARED}
    groups = []
    shared = [p for p in models if p not in own]
    if shared:
        groups.append((shared, (owner == SHARED).nonzero().flatten()))
    groups += [([p], (owner == p).nonzero().flatten()) for p in models if p in own]
    return sorted(groups, key=lambda group: group[0][0])


def spread_owned(samples: Any, owner: torch.Tensor | None, n: int, seed: int, num_models: int
                 ) -> tuple[Any, torch.Tensor | None]:
    """:func:`spread_sample` of ``n`` samples, per group of :func:`owner_groups` when the samples have owners (``n``
    from each group: each model's own data, and the shared pool), with the kept samples' owners."""
    if owner is None:
        return spread_sample(samples, n, seed), None
    if isinstance(samples, ModelInputs) and samples.modality == "image":
        samples = samples["pixel_values"]  # the images as one tensor, as spread_sample gives them
    parts, owners = [], []
    for _, index in owner_groups(owner, num_models):
        chosen = index[spread_index(len(index), n, seed)]
        part = samples.select(chosen) if isinstance(samples, ModelInputs) else samples[chosen]
        parts.append(part)
        owners.append(owner[chosen])
    return concat_samples(parts), torch.cat(owners)


def held_out_split(owner: torch.Tensor | None, total: int, n: int, seed: int, num_models: int
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The samples a comparison holds out and the rest, as two index tensors: from each group of
    :func:`owner_groups` (each model's own data, and the shared pool) a :func:`spread_index` of ``n``, at most half
    of the group, so that every group keeps samples of its own on both sides. ``None`` when a group holds fewer than
    two samples (nothing can be held out of it)."""
    held, rest = [], []
    for _, index in owner_groups(owner, num_models):
        index = torch.arange(total) if index is None else index
        if len(index) < 2:
            return None
        chosen = spread_index(len(index), min(n, len(index) // 2), seed)
        kept = torch.ones(len(index), dtype=torch.bool)
        kept[chosen] = False
        held.append(index[chosen])
        rest.append(index[kept])
    return torch.cat(held), torch.cat(rest)


def spread_index(total: int, n: int, seed: int) -> torch.Tensor:
    """The indices :func:`spread_sample` keeps of ``total`` samples."""
    if n >= total:
        return torch.arange(total)
    u = torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return ((torch.arange(n, dtype=torch.float64) + u) * (total / n)).floor().long().clamp_(max=total - 1)
