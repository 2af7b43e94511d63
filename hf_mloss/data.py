"""Unlabeled scoring data: from a Hub dataset (streamed), a local image folder, a ``datasets`` object, or images.

Whatever the source, :func:`load_pixel_values` returns ``num_samples`` images run through the base model's own image
processor (resize, crop, normalisation), as one ``[N, 3, H, W]`` float tensor, plus a JSON-able description of where
they came from (recorded in the merge config and the model card). Labels are ignored.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from .errors import DataError

IMAGE_COLUMNS = ("image", "img", "images", "picture", "photo")
DEFAULT_NUM_SAMPLES = 128
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
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra" and v is not None}
        out.update(self.extra)
        return out


def load_pixel_values(
    data: Any,
    processor: Any,
    *,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seed: int = 0,
    split: str = "train",
    image_column: str | None = None,
    buffer_size: int = 1000,
    min_samples: int = 1,
    batch_size: int = 32,
) -> tuple[torch.Tensor, DataInfo]:
    """Read up to ``num_samples`` images from ``data`` and preprocess them with ``processor``.

    Args:
        data: a Hub dataset id (streamed with ``load_dataset(..., streaming=True)``), a local folder of images
            (loaded as ``imagefolder``), a ``datasets.Dataset`` / ``IterableDataset``, a list of PIL images or
            image paths, or an already preprocessed ``[N, 3, H, W]`` tensor.
        processor: the base model's image processor.
        num_samples: images to use (the M-Loss paper uses 128).
        seed: shuffle seed (Hub / folder / dataset sources are shuffled with a buffer of ``buffer_size``).
        split: dataset split for Hub ids and folders.
        image_column: column holding the images; found automatically when omitted.
        min_samples: fail if fewer decodable images than this remain.
    """
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise DataError(f"num_samples must be a positive integer, got {num_samples!r}.")
    if isinstance(data, torch.Tensor):
        if data.dim() != 4 or data.shape[1] != 3:
            raise DataError(f"A tensor of pixel values must have shape [N, 3, H, W], got {tuple(data.shape)}.")
        pixels = data[:num_samples].float()
        info = DataInfo(source="tensor", num_samples=len(pixels), seed=seed)
    else:
        images, info = _iter_images(data, num_samples=num_samples, seed=seed, split=split,
                                    image_column=image_column, buffer_size=buffer_size)
        pixels = _preprocess(images, processor, info, limit=num_samples, batch_size=batch_size)
        info.num_samples = len(pixels)
    if len(pixels) < min_samples:
        raise DataError(
            f"Only {len(pixels)} usable image(s) were read from {info.id or info.source!r} "
            f"(split {info.split!r}, {info.skipped} undecodable skipped); at least {min_samples} are needed. "
            "Point data at a larger dataset or folder, or lower num_samples."
        )
    return pixels, info


# --------------------------------------------------------------------------------------------- sources
def _iter_images(data, *, num_samples, seed, split, image_column, buffer_size) -> tuple[Iterator[Any], DataInfo]:
    import datasets

    if isinstance(data, (str, os.PathLike)):
        ref = os.fspath(data)
        path = Path(ref).expanduser()
        if path.is_dir():
            try:
                ds = datasets.load_dataset("imagefolder", data_dir=str(path), split=split, streaming=True)
            except FileNotFoundError as err:  # datasets' EmptyDatasetError
                raise DataError(f"No image files found in {ref!r}: {err}.") from err
            except ValueError:  # a flat folder without a split layout: take every image file
                files = sorted(p for p in path.rglob("*") if p.suffix.lower() in _IMAGE_SUFFIXES)
                return _iter_images(files, num_samples=num_samples, seed=seed, split=split,
                                    image_column=image_column, buffer_size=buffer_size)
            info = DataInfo(source="imagefolder", id=path.name, split=split, seed=seed)
        elif ref.startswith((".", "/", "~")) or path.suffix:
            raise DataError(f"Data folder {ref!r} does not exist.")
        else:
            try:
                ds = datasets.load_dataset(ref, split=split, streaming=True)
            except (FileNotFoundError, ConnectionError) as err:
                raise DataError(
                    f"Cannot stream Hub dataset {ref!r} (split {split!r}): {err}. Check the id and split, or that the "
                    "Hub is reachable; a local image folder works offline."
                ) from err
            except ValueError as err:
                raise DataError(f"Cannot load split {split!r} of dataset {ref!r}: {err}") from err
            info = DataInfo(source="hub", id=ref, split=split, seed=seed)
        return _from_dataset(ds, info, num_samples, seed, image_column, buffer_size)
    if isinstance(data, (datasets.Dataset, datasets.IterableDataset)):
        info = DataInfo(source="dataset", id=getattr(data.info, "dataset_name", None), seed=seed,
                        split=str(data.split) if data.split is not None else None)
        return _from_dataset(data, info, num_samples, seed, image_column, buffer_size)
    if isinstance(data, (list, tuple)):
        if not data:
            raise DataError("The list of scoring images is empty.")
        return iter(data), DataInfo(source="images", seed=seed)
    raise DataError(
        f"Unsupported scoring data of type {type(data).__name__}: pass a Hub dataset id, a local image folder, a "
        "datasets.Dataset / IterableDataset, a list of PIL images or paths, or a [N, 3, H, W] tensor."
    )


def _from_dataset(ds, info: DataInfo, num_samples, seed, image_column, buffer_size):
    import datasets

    column = image_column or _find_image_column(ds)
    if column not in (ds.column_names or [column]):
        raise DataError(f"Image column {column!r} not found; available columns: {ds.column_names}.")
    info.image_column = column
    ds = ds.cast_column(column, datasets.Image(decode=False))  # decode ourselves: a bad file is skipped, not fatal
    if isinstance(ds, datasets.Dataset):
        ds = ds.shuffle(seed=seed).select(range(min(num_samples * 2, len(ds))))
    else:
        ds = ds.shuffle(seed=seed, buffer_size=buffer_size).take(num_samples * 2)
    return (row[column] for row in ds), info


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
        image = image.convert("RGBA").convert("RGB") if "A" in image.getbands() or image.mode == "P" else image.convert("RGB")
    return image


def _preprocess(items: Iterable[Any], processor: Any, info: DataInfo, *, limit: int, batch_size: int) -> torch.Tensor:
    """Decode and preprocess up to ``limit`` images, skipping (and counting) the undecodable ones."""
    chunks: list[torch.Tensor] = []
    pending: list[Image.Image] = []
    count = 0
    for item in items:
        if count >= limit:
            break
        try:
            image = _decode(item)
        except (UnidentifiedImageError, OSError, TypeError, ValueError, Image.DecompressionBombError):
            info.skipped += 1
            continue
        pending.append(image)
        count += 1
        if len(pending) == batch_size:
            chunks.append(processor(images=pending, return_tensors="pt")["pixel_values"])
            pending = []
    if pending:
        chunks.append(processor(images=pending, return_tensors="pt")["pixel_values"])
    if not chunks:
        return torch.empty(0, 3, 1, 1)
    return torch.cat(chunks).float()
