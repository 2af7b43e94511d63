"""Unlabeled scoring data: from a Hub dataset (streamed), a local image folder, a ``datasets`` object, or images.

Whatever the source, :func:`load_pixel_values` returns ``num_samples`` images run through the base model's own image
processor (resize, crop, normalisation), as one ``[N, 3, H, W]`` float tensor, plus a JSON-able description of where
they came from (recorded in the merge config and the model card).

The sample is spread over the whole split, since many datasets store their rows sorted by label (a shuffle buffer over
the first rows would see a few classes only): small splits (local folders, Hub splits whose size the dataset card
gives, up to ``whole_split_max_bytes``) are read once, whole, keeping a uniform random sample (reservoir sampling);
larger or unsized ones are split into parquet row groups and shuffled across many of them at once. Labels are never
used for scoring; when the data has a label column the description counts how many distinct labels the sample covered.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from tqdm.auto import tqdm

from .errors import DataError

IMAGE_COLUMNS = ("image", "img", "images", "picture", "photo")
LABEL_COLUMNS = ("label", "labels", "class", "fine_label")
DEFAULT_NUM_SAMPLES = 128
WHOLE_SPLIT_MAX_BYTES = 1 << 30
"""Hub splits up to this size (from the dataset card) are read whole for a uniform sample."""
MAX_BUFFER_SHARDS = 64
"""Row-group shards mixed at once in the shuffle buffer of a larger split."""
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


@dataclass
class DataInfo:
    """Where the scoring images came from (saved with the merge so it can be reproduced)."""

    source: str
    """``"hub"``, ``"imagefolder"``, ``"dataset"``, ``"images"`` or ``"tensor"``."""
    id: str | None = None
    split: str | None = None
    num_samples: int = 0
    seed: int = 0
    image_column: str | None = None
    skipped: int = 0
    """Images that could not be decoded and were skipped."""
    sampling: str | None = None
    """How the sample was drawn: ``"whole split"`` (uniform over every row), ``"shuffled shards"`` (row groups mixed in
    a shuffle buffer), ``"shuffled"`` (an in-memory dataset) or ``"as given"`` (a list of images)."""
    label_column: str | None = None
    labels_covered: int | None = None
    """Distinct labels among the images used (None when the data has no label column)."""
    num_labels: int | None = None
    """Number of classes the label column declares (None when it does not say)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Where the images came from and how to read them again (recorded in the merge config)."""
        out = {k: v for k, v in self.__dict__.items() if k not in _SAMPLE_FIELDS and k != "extra" and v is not None}
        out.update(self.extra)
        return out

    def sample_stats(self) -> dict[str, Any]:
        """How the sample was drawn and, when the data has labels, how many distinct labels it covered."""
        return {k: getattr(self, k) for k in _SAMPLE_FIELDS if getattr(self, k) is not None}


_SAMPLE_FIELDS = ("sampling", "label_column", "labels_covered", "num_labels")


def load_pixel_values(
    data: Any,
    processor: Any,
    *,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seed: int = 0,
    split: str = "train",
    image_column: str | None = None,
    revision: str | None = None,
    buffer_size: int = 1000,
    min_samples: int = 1,
    batch_size: int = 32,
    whole_split_max_bytes: int = WHOLE_SPLIT_MAX_BYTES,
    progress: bool = False,
) -> tuple[torch.Tensor, DataInfo]:
    """Read up to ``num_samples`` images from ``data`` and preprocess them with ``processor``.

    Args:
        data: a Hub dataset id (streamed with ``load_dataset(..., streaming=True)``), a local folder of images
            (loaded as ``imagefolder``), a ``datasets.Dataset`` / ``IterableDataset``, a list of PIL images or
            image paths, or an already preprocessed ``[N, 3, H, W]`` tensor.
        processor: the base model's image processor.
        num_samples: images to use (the M-Loss paper uses 128).
        seed: sampling seed (the same seed draws the same images).
        split: dataset split for Hub ids and folders.
        image_column: column holding the images; found automatically when omitted.
        revision: branch, tag or commit of a Hub dataset.
        buffer_size: smallest shuffle buffer for splits too large to read whole (at least 8 x ``num_samples``).
        min_samples: fail if fewer decodable images than this remain.
        whole_split_max_bytes: Hub splits up to this size are read whole for a uniform sample; larger ones, and
            those whose size the dataset card does not give, are shuffled across row groups.
        progress: show a "Reading images" bar (streamed and decoded images can take a while).
    """
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise DataError(f"num_samples must be a positive integer, got {num_samples!r}.")
    if isinstance(data, torch.Tensor):
        if data.dim() != 4 or data.shape[1] != 3:
            raise DataError(f"A tensor of pixel values must have shape [N, 3, H, W], got {tuple(data.shape)}.")
        pixels = data[:num_samples].float()
        info = DataInfo(source="tensor", num_samples=len(pixels), seed=seed)
    else:
        sampler = _Sampler(num_samples, seed, max(buffer_size, 8 * num_samples), whole_split_max_bytes)
        rows, info = _iter_images(data, sampler=sampler, split=split, image_column=image_column, revision=revision)
        pixels = _preprocess(rows, processor, info, limit=num_samples, batch_size=batch_size, progress=progress)
        info.num_samples = len(pixels)
        if len(pixels) < num_samples:  # said, not silent: the report and card show the count actually used
            import warnings

            warnings.warn(f"Asked for {num_samples} scoring images; {info.id or info.source!r} has only "
                          f"{len(pixels)} usable ones, so M-Loss is measured on {len(pixels)}.", UserWarning,
                          stacklevel=2)
    if len(pixels) < min_samples:
        raise DataError(
            f"Only {len(pixels)} usable image(s) were read from {info.id or info.source!r} "
            f"(split {info.split!r}, {info.skipped} undecodable skipped); at least {min_samples} are needed. "
            "Point data at a larger dataset or folder, or lower num_samples."
        )
    return pixels, info


# --------------------------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class _Sampler:
    """How many rows to draw (twice the images needed, for undecodable ones), with which seed and buffer."""

    num_samples: int
    seed: int
    buffer_size: int
    whole_split_max_bytes: int

    @property
    def rows(self) -> int:
        return 2 * self.num_samples


def _folder_splits(path: Path) -> list[str]:
    """The splits ``datasets`` finds in a local image folder (``[]`` when it finds none)."""
    import datasets

    try:
        return list(datasets.load_dataset("imagefolder", data_dir=str(path), streaming=True))
    except (ValueError, FileNotFoundError):
        return []


def _iter_images(data, *, sampler: _Sampler, split: str, image_column, revision: str | None = None
                 ) -> tuple[Iterator[tuple[Any, Any]], DataInfo]:
    """``(image, label)`` pairs in sampled order (label None without a label column), and their description."""
    import datasets

    seed = sampler.seed
    if isinstance(data, (str, os.PathLike)):
        ref = os.fspath(data)
        path = Path(ref).expanduser()
        if path.is_dir():
            try:
                ds = datasets.load_dataset("imagefolder", data_dir=str(path), split=split, streaming=True)
            except FileNotFoundError as err:  # datasets' EmptyDatasetError
                raise DataError(f"No image files found in {ref!r}: {err}.") from err
            except ValueError:
                splits = _folder_splits(path)
                if splits:  # a typo in the split name must not silently score every split
                    raise DataError(f"Split {split!r} is not in the image folder {ref!r}; its splits are {splits}. "
                                    "Pass split=... (YAML: data.split).") from None
                # a folder datasets cannot lay out as splits: take every image file
                files = sorted(p for p in path.rglob("*") if p.suffix.lower() in _IMAGE_SUFFIXES)
                rows, info = _iter_images(_shuffled(files, seed), sampler=sampler, split=split,
                                          image_column=image_column)
                info.sampling = "whole split"
                return rows, info
            info = DataInfo(source="imagefolder", id=path.name, split=split, seed=seed)
            return _from_dataset(ds, info, sampler, image_column, whole=True)
        if ref.startswith((".", "/", "~")) or path.suffix:
            raise DataError(f"Data folder {ref!r} does not exist.")
        from .hub import hub_failure, redact

        try:
            ds = datasets.load_dataset(ref, split=split, streaming=True, revision=revision)
        except (FileNotFoundError, ConnectionError, OSError) as err:
            import errno

            if getattr(err, "errno", None) in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC):
                from .hub import cache_failure

                raise DataError(f"Cannot stream Hub dataset {ref!r}: {cache_failure(err)}") from None
            raise DataError(
                f"Cannot stream Hub dataset {ref!r} (split {split!r}): {hub_failure(err)}. Check the id and split; a "
                "local image folder works offline.") from None
        except ValueError as err:
            raise DataError(f"Cannot load split {split!r} of dataset {ref!r}: "
                            f"{redact(' '.join(str(err).split()))[:300]}") from None
        info = DataInfo(source="hub", id=ref, split=split, seed=seed)
        return _from_dataset(ds, info, sampler, image_column, whole=_is_small(ds, split, sampler))
    if isinstance(data, (datasets.Dataset, datasets.IterableDataset)):
        info = DataInfo(source="dataset", id=getattr(data.info, "dataset_name", None), seed=seed,
                        split=str(data.split) if data.split is not None else None)
        whole = isinstance(data, datasets.IterableDataset) and _is_small(data, info.split, sampler)
        return _from_dataset(data, info, sampler, image_column, whole=whole)
    if isinstance(data, (list, tuple)):
        if not data:
            raise DataError("The list of scoring images is empty.")
        return ((item, None) for item in data), DataInfo(source="images", seed=seed, sampling="as given")
    raise DataError(
        f"Unsupported scoring data of type {type(data).__name__}: pass a Hub dataset id, a local image folder, a "
        "datasets.Dataset / IterableDataset, a list of PIL images or paths, or a [N, 3, H, W] tensor."
    )


def _is_small(ds, split: str | None, sampler: _Sampler) -> bool:
    """Whether the dataset card gives the split's size and it is small enough to read whole."""
    splits = getattr(ds.info, "splits", None) or {}
    size = splits[split].num_bytes if split in splits else None
    return bool(size) and size <= sampler.whole_split_max_bytes


def _from_dataset(ds, info: DataInfo, sampler: _Sampler, image_column, *, whole: bool):
    import datasets

    column = image_column or _find_image_column(ds)
    if column not in (ds.column_names or [column]):
        raise DataError(f"Image column {column!r} not found; available columns: {ds.column_names}.")
    info.image_column = column
    feature = (ds.features or {}).get(column)
    if feature is not None and not _can_hold_images(feature):
        raise DataError(f"Column {column!r} of {info.id or info.source!r} holds {_feature_name(feature)} values, not "
                        f"images; pass image_column=... naming the column with images (columns: {ds.column_names}).")
    label = _find_label_column(ds, column)
    if label is not None:
        info.label_column = label
        feature = (ds.features or {}).get(label)
        info.num_labels = feature.num_classes if isinstance(feature, datasets.ClassLabel) else None
    if ds.column_names:
        ds = ds.select_columns([c for c in (column, label) if c is not None])  # read nothing else
    ds = ds.cast_column(column, datasets.Image(decode=False))  # decode ourselves: a bad file is skipped, not fatal
    if isinstance(ds, datasets.Dataset):
        info.sampling = "shuffled"
        ds = ds.shuffle(seed=sampler.seed).select(range(min(sampler.rows, len(ds))))
        rows: Iterable[dict[str, Any]] = ds
    elif whole:
        info.sampling = "whole split"
        rows = _reservoir(ds, sampler.rows, sampler.seed)
    else:
        info.sampling = "shuffled shards"
        ds = ds.reshard()  # parquet: one shard per row group instead of per file
        ds = ds.shuffle(seed=sampler.seed, buffer_size=sampler.buffer_size,
                        max_buffer_input_shards=max(1, min(ds.n_shards, MAX_BUFFER_SHARDS))).take(sampler.rows)
        rows = ds
    return _arrow_errors_named(((row[column], row.get(label) if label else None) for row in rows), column,
                               info), info


def _can_hold_images(feature: Any) -> bool:
    """Whether a column of this feature type can hold images: ``Image``, file paths/bytes, or {bytes, path}."""
    import datasets

    if isinstance(feature, datasets.Image):
        return True
    if isinstance(feature, datasets.Value):
        return feature.dtype in ("string", "large_string", "binary", "large_binary")
    return isinstance(feature, dict) and bool({"bytes", "path"} & set(feature))


def _feature_name(feature: Any) -> str:
    return getattr(feature, "dtype", None) or type(feature).__name__


def _arrow_errors_named(rows: Iterable[Any], column: str, info: DataInfo) -> Iterator[Any]:
    """``rows``, with Arrow's errors (a column type that cannot be read as images, found while streaming) turned
    into a :class:`DataError` naming the column."""
    import pyarrow

    try:
        yield from rows
    except pyarrow.ArrowException as err:
        raise DataError(f"Column {column!r} of {info.id or info.source!r} cannot be read as images "
                        f"({type(err).__name__}: its values are not image files, paths or bytes); pass "
                        "image_column=... naming the column with images.") from None


def _reservoir(rows: Iterable[Any], k: int, seed: int) -> list[Any]:
    """A uniform random sample of ``k`` items of a stream of unknown length, in random order (one pass, k kept)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    kept: list[Any] = []
    for index, row in enumerate(rows):
        if index < k:
            kept.append(row)
        elif (slot := int(rng.integers(0, index + 1))) < k:
            kept[slot] = row
    return [kept[i] for i in rng.permutation(len(kept))]


def _shuffled(items: list[Any], seed: int) -> list[Any]:
    import numpy as np

    return [items[i] for i in np.random.default_rng(seed).permutation(len(items))]


def _find_label_column(ds, image_column: str) -> str | None:
    """The ``ClassLabel`` column, else a column with a usual label name (None when there is none)."""
    import datasets

    features = ds.features or {}
    for name, feature in features.items():
        if name != image_column and isinstance(feature, datasets.ClassLabel):
            return name
    return next((name for name in LABEL_COLUMNS if name in features and name != image_column), None)


def _find_image_column(ds) -> str:
    import datasets

    features = ds.features or {}
    for name, feature in features.items():
        if isinstance(feature, datasets.Image):
            return name
    for name in IMAGE_COLUMNS:
        if name in features:
            return name
    raise DataError(
        f"No image column found (columns: {list(features)}). Pass image_column=... naming the column with images."
    )


# --------------------------------------------------------------------------------------------- decoding
def _decode(item: Any) -> Image.Image:
    if isinstance(item, Image.Image):
        image = item
    elif isinstance(item, (str, os.PathLike)):
        image = Image.open(item)
    elif isinstance(item, dict) and (item.get("bytes") or item.get("path")):
        import io

        image = Image.open(io.BytesIO(item["bytes"])) if item.get("bytes") else Image.open(item["path"])
    else:
        raise TypeError(f"not an image: {type(item).__name__}")
    image.load()
    if image.mode != "RGB":  # grayscale, palette, RGBA, CMYK, 16-bit...: the processor expects RGB
        with_alpha = "A" in image.getbands() or image.mode == "P"
        image = image.convert("RGBA").convert("RGB") if with_alpha else image.convert("RGB")
    return image


def _preprocess(rows: Iterable[tuple[Any, Any]], processor: Any, info: DataInfo, *, limit: int,
                batch_size: int, progress: bool = False) -> torch.Tensor:
    """Decode and preprocess up to ``limit`` images, skipping (and counting) the undecodable ones; count the distinct
    labels of the images used."""
    chunks: list[torch.Tensor] = []
    pending: list[Image.Image] = []
    labels: set[Any] = set()
    count = 0
    bar = tqdm(total=limit, desc="Reading images", unit="img", disable=not progress, leave=False)
    for item, label in rows:
        if count >= limit:
            break
        try:
            image = _decode(item)
        except (UnidentifiedImageError, OSError, TypeError, ValueError, Image.DecompressionBombError):
            info.skipped += 1
            continue
        pending.append(image)
        count += 1
        bar.update()
        if label is not None:
            labels.add(label)
        if len(pending) == batch_size:
            chunks.append(processor(images=pending, return_tensors="pt")["pixel_values"])
            pending = []
    if pending:
        chunks.append(processor(images=pending, return_tensors="pt")["pixel_values"])
    bar.close()
    if info.label_column is not None:
        info.labels_covered = len(labels)
    if not chunks:
        return torch.empty(0, 3, 1, 1)
    return torch.cat(chunks).float()
