"""Unlabeled scoring data: from a Hub dataset (streamed), a local image folder, a ``datasets`` object, or images.

Whatever the source, :func:`load_pixel_values` returns ``num_samples`` images run through the base model's own image
processor (resize, crop, normalisation), as one ``[N, 3, H, W]`` float tensor, plus a JSON-able description of where
they came from (recorded in the merge config and the model card).

The sample is spread over the whole split, since many datasets store their rows sorted by label (a shuffle buffer over
the first rows would see a few classes only): small splits (local folders, Hub splits whose size the dataset card
gives, up to ``whole_split_max_bytes``) are read once, whole, keeping a uniform random sample (reservoir sampling);
larger or unsized ones are split into parquet row groups and shuffled across many of them at once. Labels are never
used for scoring; when the data has a label column the description counts how many distinct labels the sample covered.

Text families score on text (:func:`load_model_inputs` follows the adapter's ``modality``): a list of strings, a
``.txt`` file (one sample per non-blank line), a ``.jsonl`` / ``.json`` / ``.csv`` / ``.tsv`` / ``.parquet`` file or a
folder of them, a folder of ``.txt`` / ``.md`` files (one sample per *file*: a folder holds documents), a folder saved
with ``Dataset.save_to_disk``, a ``datasets`` object or a Hub dataset (streamed, sampled as above), with
``text_column`` found automatically (the one string column, else the one named ``text``). Texts are tokenised with the
base's tokenizer, cut at ``max_length`` tokens (default 128) and right-padded; the attention mask marks real tokens.
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

from ..errors import DataError
from .model_inputs import ModelInputs, as_model_inputs

IMAGE_COLUMNS = ("image", "img", "images", "picture", "photo")
LABEL_COLUMNS = ("label", "labels", "class", "fine_label")
DEFAULT_NUM_SAMPLES = 128
WHOLE_SPLIT_MAX_BYTES = 1 << 30
"""Hub splits up to this size (from the dataset card) are read whole for a uniform sample."""
MAX_BUFFER_SHARDS = 64
"""Row-group shards mixed at once in the shuffle buffer of a larger split."""
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
DEFAULT_MAX_LENGTH = 128
"""Tokens per scoring sequence when ``max_length`` is not given."""
TEXT_FILE_SUFFIXES = (".txt", ".text", ".md")
"""Plain text: a file gives one sample per non-blank line, a folder of them one sample per file."""
TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
"""Data files read with ``datasets`` (suffix -> builder); the text is one of their columns."""
DATA_FILE_SUFFIXES = (*TEXT_FILE_SUFFIXES, *TABLE_SUFFIXES)
MAX_CHARS_PER_TOKEN = 64
"""A text is cut at ``max_length x`` this many characters before tokenising (a long document is not tokenised
whole to keep ``max_length`` tokens)."""
MODALITIES = ("image", "text")


@dataclass
class DataInfo:
    """Where the scoring images or texts came from (saved with the merge so it can be reproduced)."""

    source: str
    """Images: ``"hub"``, ``"imagefolder"``, ``"dataset"``, ``"images"`` or ``"tensor"``. Text: ``"hub"``,
    ``"dataset"``, ``"texts"`` (a list of strings), ``"textfile"``, ``"textfolder"``, ``"file"`` (a data file),
    ``"folder"`` (a saved or data-file dataset folder) or ``"tokens"`` (already tokenised)."""
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
    text_column: str | None = None
    max_length: int | None = None
    """Text: tokens per sequence at most (longer texts are cut)."""
    num_tokens: int | None = None
    """Text: tokens used, padding excluded."""
    truncated: int | None = None
    """Text: sequences cut at ``max_length``."""
    padding: str | None = None
    """Text: how sequences are padded (``"right"``; says so when the end-of-sequence token stands in for a
    missing pad token)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Where the images came from and how to read them again (recorded in the merge config)."""
        out = {k: v for k, v in self.__dict__.items() if k not in _SAMPLE_FIELDS and k != "extra" and v is not None}
        out.update(self.extra)
        return out

    def sample_stats(self) -> dict[str, Any]:
        """How the sample was drawn, how many distinct labels it covered (when the data has labels) and, for text,
        the tokens used, the sequences cut at ``max_length`` and the padding."""
        return {k: getattr(self, k) for k in _SAMPLE_FIELDS if getattr(self, k) is not None}


_SAMPLE_FIELDS = ("sampling", "label_column", "labels_covered", "num_labels", "num_tokens", "truncated", "padding")


def _named(info: DataInfo, name: str | None) -> str:
    """The data as a warning names it: its id or source, behind ``name`` (whose data it is) when given."""
    source = repr(info.id or info.source)
    return f"{name} ({source})" if name else source


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
    family: str | None = None,
    name: str | None = None,
) -> tuple[torch.Tensor, DataInfo]:
    """Read up to ``num_samples`` images from ``data`` and preprocess them with ``processor``.

    Args:
        data: a Hub dataset id (streamed with ``load_dataset(..., streaming=True)``), a local folder of images
            (loaded as ``imagefolder``), a ``datasets.Dataset`` / ``IterableDataset``, a list of PIL images or
            image paths, or an already preprocessed ``[N, 3, H, W]`` tensor (or a list of ``[3, H, W]`` ones).
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
        family: the model family the images are for, named in the error when ``data`` holds text instead.
        name: what a warning calls the data (a model's own: its entry, ``models[1] (ft-b).data``).
    """
    _refuse_text_for_images(data, family)
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise DataError(f"num_samples must be a positive integer, got {num_samples!r}.")
    data = stacked_pixels(data)
    if isinstance(data, torch.Tensor):
        check_pixel_tensor(data)
        pixels = data[:num_samples].float()
        info = DataInfo(source="tensor", num_samples=len(pixels), seed=seed)
    else:
        sampler = _Sampler(num_samples, seed, max(buffer_size, 8 * num_samples), whole_split_max_bytes)
        rows, info = _iter_images(data, sampler=sampler, split=split, image_column=image_column, revision=revision,
                                  family=family)
        pixels = _preprocess(rows, processor, info, limit=num_samples, batch_size=batch_size, progress=progress)
        info.num_samples = len(pixels)
        if len(pixels) < num_samples:  # said, not silent: the report and card show the count actually used
            import warnings

            warnings.warn(f"Asked for {num_samples} scoring images; {_named(info, name)} has only "
                          f"{len(pixels)} usable ones, so {len(pixels)} are used.", UserWarning,
                          stacklevel=2)
    if len(pixels) < min_samples:
        raise DataError(
            f"Only {len(pixels)} usable image(s) were read from {info.id or info.source!r} "
            f"(split {info.split!r}, {info.skipped} undecodable skipped); at least {min_samples} are needed. "
            "Point data at a larger dataset or folder, or lower num_samples."
        )
    return pixels, info


PIXEL_LIMIT = 1e4
"""Largest magnitude taken in a tensor of pixel values. Image processors normalise pixels to a few units (CLIP's and
ViT's to about [-2, 3]); far past that the tensor is not pixel values, and deep in the model its activations overflow
float32 into NaN M-Losses and singular Grams, far from their cause."""


def check_data_objects(data: Any) -> None:
    """Refuse Python data no loader reads, before any model is opened: scalars, bytes, numpy arrays, one-shot
    iterators, lists whose items are neither text nor images, and tensors that are not ``[N, 3, H, W]`` pixel values
    (:func:`check_pixel_tensor`). A Hub id, a path, a ``datasets`` object or token ids pass (their loaders check them).

    Raises:
        DataError: naming the type, and the item for a list.
    """
    import types

    if isinstance(data, (bool, int, float, complex, bytes, bytearray)):
        raise DataError(f"data of type {type(data).__name__} ({str(data)[:40]}) is not scoring data. {_ANY_DATA}")
    if type(data).__module__ == "numpy":
        raise DataError(f"data is a numpy {type(data).__name__}: pass torch.from_numpy(array) for preprocessed pixel "
                        "values [N, 3, H, W], or the images themselves (PIL images or image paths).")
    if isinstance(data, (types.GeneratorType, Iterator)):
        raise DataError(f"data is a {type(data).__name__}, which can be read only once (a run reads its data more "
                        "than once, and records it): pass list(...) of its items, or a datasets.IterableDataset.")
    if isinstance(data, torch.Tensor):
        if data.dim() == 2 and not data.is_floating_point():
            raise DataError(f"data is an integer tensor of shape {tuple(data.shape)}, which reads as token ids: pass "
                            "them with their mask, {'input_ids': ids, 'attention_mask': mask} (a tokenizer's output "
                            "with return_tensors='pt'), or the texts themselves. A tensor alone is read as pixel "
                            "values [N, 3, H, W].")
        check_pixel_tensor(data)
    if isinstance(data, (list, tuple)):
        for i, item in enumerate(data):
            if isinstance(item, (str, os.PathLike, Image.Image, torch.Tensor)):
                continue
            if isinstance(item, dict) and (item.get("bytes") or item.get("path")):  # a datasets image cell
                continue
            raise DataError(f"data[{i}] is of type {type(item).__name__} ({str(item)[:40]}): a list of scoring data "
                            "holds texts (strings), PIL images, image paths or [3, H, W] pixel tensors.")
        _refuse_mixed_list(data)


def _refuse_mixed_list(data: list[Any] | tuple[Any, ...]) -> None:
    """A list holding images (PIL images, pixel tensors, image cells) and strings that name no image file: the strings
    would be dropped as undecodable images, so they are refused, naming the first (texts go in a list of their own,
    for a text family)."""
    image = next((i for i, item in enumerate(data) if not isinstance(item, (str, os.PathLike))), None)
    if image is None:
        return
    for i, item in enumerate(data):
        if isinstance(item, (str, os.PathLike)) and not _is_file(os.fspath(item)):
            what = ("a PIL image" if isinstance(data[image], Image.Image) else
                    "a pixel tensor" if isinstance(data[image], torch.Tensor) else "an image cell")
            raise DataError(f"data[{i}] ({str(item)[:60]!r}) is not a file, and data[{image}] is {what}: a list of "
                            "images holds PIL images, paths of image files "
                            "or [3, H, W] pixel tensors (texts go in a list of their own, for a text model).")


def checked_objects(data: Any) -> Any:
    """Python data as a run keeps it, checked (:func:`check_data_objects`): a list of ``[3, H, W]`` tensors stacked
    into one ``[N, 3, H, W]`` tensor (:func:`stacked_pixels`) and its pixel values checked as a tensor's are."""
    check_data_objects(data)
    stacked = stacked_pixels(data)
    if stacked is not data:
        check_pixel_tensor(stacked)
    return stacked


def check_pixel_tensor(pixels: torch.Tensor) -> None:
    """A tensor given as preprocessed pixel values: ``[N, 3, H, W]``, real floating point, finite, of a
    magnitude image processors give (at most :data:`PIXEL_LIMIT`).

    Raises:
        DataError: saying which, and how to make pixel values from images.
    """
    if pixels.dim() != 4 or pixels.shape[1] != 3:
        raise DataError(f"A tensor of pixel values must have shape [N, 3, H, W], got {tuple(pixels.shape)}.")
    if not pixels.is_floating_point():
        raise DataError(f"A tensor of pixel values must be floating point (the image processor's normalised output), "
                        f"got {pixels.dtype}. Raw images go in as PIL images or image paths, and the base's image "
                        "processor prepares them.")
    if pixels.device.type == "meta":
        raise DataError("The tensor of pixel values is on the meta device and holds no values.")
    finite = torch.isfinite(pixels)
    if not finite.all():
        bad = (~finite).flatten(1).any(dim=1).nonzero().flatten().tolist()
        raise DataError(f"{len(bad)} of the {len(pixels)} scoring images hold NaN or Inf pixel values (the first: "
                        f"image {bad[0]}); M-Loss on them would be NaN. Remove them or pass clean images.")
    peak = pixels.detach().abs().max().item() if pixels.numel() else 0.0
    if peak > PIXEL_LIMIT:
        raise DataError(f"The pixel values reach {peak:.3g}; an image processor's output is normalised to a few "
                        f"units (at most {PIXEL_LIMIT:g} taken). Run the images through the base's image processor, "
                        "or pass PIL images or image paths.")


def stacked_pixels(data: Any) -> Any:
    """A list or tuple of ``[3, H, W]`` tensors (preprocessed pixel values, one per image) as one ``[N, 3, H, W]``
    tensor, what the tensor form of ``data`` takes; anything else unchanged.

    Raises:
        DataError: the tensors differ in shape (each is named with its index), one is not ``[3, H, W]``, or the list
            mixes tensors with other items.
    """
    if not isinstance(data, (list, tuple)) or not data or not any(isinstance(x, torch.Tensor) for x in data):
        return data
    how = ("A list of tensors is read as preprocessed pixel values, one [3, H, W] tensor per image, and stacked "
           "into [N, 3, H, W]")
    others = [i for i, x in enumerate(data) if not isinstance(x, torch.Tensor)]
    if others:
        raise DataError(f"{how}; this list also holds {type(data[others[0]]).__name__} (item {others[0]}). Pass "
                        "tensors only, or PIL images / image paths only (those go through the base's image "
                        "processor).")
    shapes: dict[tuple[int, ...], list[int]] = {}
    for i, x in enumerate(data):
        shapes.setdefault(tuple(x.shape), []).append(i)
    wrong = [s for s in shapes if len(s) != 3 or s[0] != 3]
    if wrong or len(shapes) > 1:
        found = "; ".join(f"{list(s)} (item{'s' if len(ix) > 1 else ''} {_indices(ix)})" for s, ix in shapes.items())
        fix = ("run the images through the base's image processor (it resizes and crops them to one size), or pass "
               "PIL images or image paths and let hf_mloss do it")
        raise DataError(f"{how}; {'each must be [3, H, W]' if wrong else 'they must share one shape'}, got {found}: "
                        f"{fix}.")
    return torch.stack(list(data))


def _indices(indices: list[int]) -> str:
    """``0, 1, 2``; past three the first two, the last and the count, so a long list stays one line."""
    if len(indices) <= 3:
        return ", ".join(map(str, indices))
    return f"{indices[0]}, {indices[1]}, ... {indices[-1]} ({len(indices)} items)"


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


def _iter_images(data, *, sampler: _Sampler, split: str, image_column, revision: str | None = None,
                 family: str | None = None) -> tuple[Iterator[tuple[Any, Any]], DataInfo]:
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
            return _from_dataset(ds, info, sampler, image_column, whole=True, family=family)
        if ref.startswith((".", "/", "~")) or path.suffix:
            raise DataError(f"Data folder {ref!r} does not exist.")
        ds = _stream_hub(ref, split, revision, offline="a local image folder")
        info = DataInfo(source="hub", id=ref, split=split, seed=seed)
        return _from_dataset(ds, info, sampler, image_column, whole=_is_small(ds, split, sampler), family=family)
    data = _split_of(data, split)
    if isinstance(data, (datasets.Dataset, datasets.IterableDataset)):
        info = _dataset_info(data, seed)
        whole = isinstance(data, datasets.IterableDataset) and _is_small(data, info.split, sampler)
        return _from_dataset(data, info, sampler, image_column, whole=whole, family=family)
    if isinstance(data, (list, tuple)):
        if not data:
            raise DataError("The list of scoring images is empty.")
        return ((item, None) for item in data), DataInfo(source="images", seed=seed, sampling="as given")
    raise DataError(
        f"Unsupported scoring data of type {type(data).__name__}: pass a Hub dataset id, a local image folder, a "
        "datasets.Dataset / IterableDataset, a list of PIL images or paths, or a [N, 3, H, W] tensor (or a list of "
        "[3, H, W] tensors)."
    )


def _split_of(data: Any, split: str) -> Any:
    """A ``DatasetDict`` (or ``IterableDatasetDict``) as its ``split``; anything else unchanged."""
    import datasets

    if isinstance(data, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in data:
            raise DataError(f"Split {split!r} is not in the {type(data).__name__}; its splits are {list(data)}. Pass "
                            "split=....")
        return data[split]
    return data


def _stream_hub(ref: str, split: str, revision: str | None, *, offline: str):
    """``load_dataset(ref, split=split, streaming=True)``, its failures said as a :class:`DataError`."""
    import datasets

    from .hub import hub_failure, redact

    try:
        return datasets.load_dataset(ref, split=split, streaming=True, revision=revision)
    except (FileNotFoundError, ConnectionError, OSError) as err:
        import errno

        if getattr(err, "errno", None) in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC):
            from .hub import cache_failure

            raise DataError(f"Cannot stream Hub dataset {ref!r}: {cache_failure(err)}") from None
        raise DataError(
            f"Cannot stream Hub dataset {ref!r} (split {split!r}): {hub_failure(err)}. Check the id and split; "
            f"{offline} works offline.") from None
    except ValueError as err:
        raise DataError(f"Cannot load split {split!r} of dataset {ref!r}: "
                        f"{redact(' '.join(str(err).split()))[:300]}") from None


def _dataset_info(data, seed: int) -> DataInfo:
    return DataInfo(source="dataset", id=getattr(data.info, "dataset_name", None), seed=seed,
                    split=str(data.split) if data.split is not None else None)


def _is_small(ds, split: str | None, sampler: _Sampler) -> bool:
    """Whether the dataset card gives the split's size and it is small enough to read whole."""
    splits = getattr(ds.info, "splits", None) or {}
    size = splits[split].num_bytes if split in splits else None
    return bool(size) and size <= sampler.whole_split_max_bytes


def _from_dataset(ds, info: DataInfo, sampler: _Sampler, image_column, *, whole: bool, family: str | None = None):
    import datasets

    features = _features(ds)
    if not features:
        raise DataError(f"{info.id or info.source!r} holds no rows: give a dataset with images.")
    column = image_column or _find_image_column(features, family)
    if column not in features:
        raise DataError(f"Image column {column!r} not found; available columns: {list(features)}.")
    info.image_column = column
    feature = features[column]
    if feature is not None and not _can_hold_images(feature):
        raise DataError(f"Column {column!r} of {info.id or info.source!r} holds {_feature_name(feature)} values, not "
                        f"images; pass image_column=... naming the column with images (columns: {list(features)}).")
    label = _find_label_column(ds, column)
    if label is not None:
        info.label_column = label
        feature = (ds.features or {}).get(label)
        info.num_labels = feature.num_classes if isinstance(feature, datasets.ClassLabel) else None
    if ds.features:  # a stream with no declared features yields its values as made (decoded below all the same)
        ds = ds.select_columns([c for c in (column, label) if c is not None])  # read nothing else
        ds = ds.cast_column(column, datasets.Image(decode=False))  # decode ourselves: a bad file is skipped
    rows = _sampled_rows(ds, info, sampler, whole=whole)
    return _arrow_errors_named(((row[column], row.get(label) if label else None) for row in rows), column,
                               info), info


def _sampled_rows(ds, info: DataInfo, sampler: _Sampler, *, whole: bool) -> Iterable[dict[str, Any]]:
    """The rows to read, in sampled order (see the module docstring); ``info.sampling`` says how."""
    import datasets

    if isinstance(ds, datasets.Dataset):
        info.sampling = "shuffled"
        return ds.shuffle(seed=sampler.seed).select(range(min(sampler.rows, len(ds))))
    if whole:
        info.sampling = "whole split"
        return _reservoir(ds, sampler.rows, sampler.seed)
    info.sampling = "shuffled shards"
    ds = ds.reshard()  # parquet: one shard per row group instead of per file
    return ds.shuffle(seed=sampler.seed, buffer_size=sampler.buffer_size,
                      max_buffer_input_shards=max(1, min(ds.n_shards, MAX_BUFFER_SHARDS))).take(sampler.rows)


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


def _find_image_column(features: dict[str, Any], family: str | None = None) -> str:
    import datasets

    for name, feature in features.items():
        if isinstance(feature, datasets.Image):
            return name
    for name in IMAGE_COLUMNS:
        if name in features:
            return name
    texts = _string_columns(features)
    hint = (f" Its text column(s) {texts} suggest a text dataset, but {_family(family)} is scored on images: pass "
            "an image dataset (text data scores text families: BERT-style encoders, Llama-style decoders)."
            if texts else "")
    raise DataError(
        f"No image column found (columns: {list(features)}). Pass image_column=... naming the column with images."
        + hint)


# --------------------------------------------------------------------------------------------- decoding
def _decode(item: Any) -> Image.Image:
    if isinstance(item, Image.Image):
        image = item
    elif isinstance(item, (str, os.PathLike)):
        image = Image.open(item)
    elif isinstance(item, (bytes, bytearray)):  # an encoded file, as a binary column holds it
        import io

        image = Image.open(io.BytesIO(item))
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


# --------------------------------------------------------------------------------------------- model inputs
def load_model_inputs(
    data: Any,
    *,
    modality: str = "image",
    processor: Any = None,
    tokenizer: Any = None,
    family: str | None = None,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seed: int = 0,
    split: str = "train",
    image_column: str | None = None,
    text_column: str | None = None,
    max_length: int | None = None,
    revision: str | None = None,
    min_samples: int = 1,
    batch_size: int = 32,
    buffer_size: int = 1000,
    whole_split_max_bytes: int = WHOLE_SPLIT_MAX_BYTES,
    progress: bool = False,
    name: str | None = None,
) -> tuple[ModelInputs, DataInfo]:
    """Read up to ``num_samples`` samples of ``data`` as the model's inputs, for a family of this ``modality``.

    ``"image"``: ``{"pixel_values": [N, 3, H, W]}`` through ``processor`` (see :func:`load_pixel_values`).
    ``"text"``: ``{"input_ids": [N, T], "attention_mask": [N, T]}`` through ``tokenizer`` (see
    :func:`load_token_ids`). ``family`` names the model family in the error when the data holds the other modality;
    ``name``, in a warning, whose data it is.
    """
    if modality not in MODALITIES:
        raise ValueError(f"modality must be one of {MODALITIES}, got {modality!r}.")
    if modality == "text":
        return load_token_ids(data, tokenizer, num_samples=num_samples, seed=seed, split=split,
                              text_column=text_column, max_length=max_length, revision=revision,
                              min_samples=min_samples, batch_size=batch_size, buffer_size=buffer_size,
                              whole_split_max_bytes=whole_split_max_bytes, progress=progress, family=family,
                              name=name)
    _refuse_text_for_images(data, family)
    given = as_model_inputs(data)
    if given is not None:
        data = given["pixel_values"]
    pixels, info = load_pixel_values(data, processor, num_samples=num_samples, seed=seed, split=split,
                                     image_column=image_column, revision=revision, min_samples=min_samples,
                                     batch_size=batch_size, buffer_size=buffer_size,
                                     whole_split_max_bytes=whole_split_max_bytes, progress=progress, family=family,
                                     name=name)
    return ModelInputs({"pixel_values": pixels}), info


_IMAGE_DATA = ("Pass images: a Hub image dataset, a local image folder, a datasets object with an image column, PIL "
               "images or image paths, or a [N, 3, H, W] tensor (or a list of [3, H, W] tensors).")
_ANY_DATA = ("Pass a Hub dataset id, a local folder or data file, a datasets object, a list of texts, PIL images or "
             "image paths, a [N, 3, H, W] tensor of pixel values, or token ids ({'input_ids': ...}).")
_TEXT_DATA = ("Pass text: a list of strings, a .txt file (one sample per line), a .jsonl/.json/.csv/.tsv/.parquet "
              "file, a folder of text files (one sample per file), or a datasets text split (Hub id, local dataset "
              "folder or datasets object; text_column=... names its column).")


def _family(family: str | None, *, capital: bool = False) -> str:
    text = f"the {family} family" if family else "this model family"
    return text[0].upper() + text[1:] if capital else text


def _refuse_text_for_images(data: Any, family: str | None) -> None:
    """An image family handed text (strings that name no file, a text or data file, token ids): say so."""
    what = None
    if isinstance(data, (list, tuple)) and data and all(isinstance(x, str) for x in data):
        head = data[:64]
        if not any(Path(x).suffix.lower() in _IMAGE_SUFFIXES or _is_file(x) for x in head if len(x) < 4096):
            what = f"{len(data)} strings that name no image file (e.g. {data[0][:40]!r}): text"
    elif isinstance(data, (str, os.PathLike)):
        path = Path(os.fspath(data)).expanduser()
        if path.is_file() and path.suffix.lower() in DATA_FILE_SUFFIXES:
            kind = "text" if path.suffix.lower() in TEXT_FILE_SUFFIXES else "data"
            what = f"the file {os.fspath(data)!r}, a {kind} file"
    elif (given := as_model_inputs(data)) is not None and "pixel_values" not in given:
        what = f"token ids ({list(given.keys())})"
    if what is not None:
        raise DataError(f"{_family(family, capital=True)} is scored on images, but data= holds {what}. Text scores "
                        f"text families (BERT-style encoders, Llama-style decoders). {_IMAGE_DATA}")


def _is_file(value: str) -> bool:
    try:
        return len(value) < 4096 and "\n" not in value and Path(value).expanduser().is_file()
    except (OSError, ValueError):
        return False


def _refuse_images_for_text(data: Any, family: str | None) -> None:
    """A text family handed images (pixel tensors, PIL images, image paths): say so."""
    what = None
    given = as_model_inputs(data)
    if isinstance(data, torch.Tensor):
        what = f"a tensor of shape {tuple(data.shape)} (pixel values?)"
    elif given is not None and "input_ids" not in given:
        what = "pixel values"
    elif isinstance(data, (list, tuple)) and data:
        if any(isinstance(x, Image.Image) for x in data[:64]):
            what = "PIL images"
        elif all(isinstance(x, str) and Path(x).suffix.lower() in _IMAGE_SUFFIXES and _is_file(x) for x in data[:64]):
            what = f"paths of image files (e.g. {data[0][:60]!r})"
    if what is not None:
        raise DataError(f"{_family(family, capital=True)} is scored on text, but data= holds {what}. {_TEXT_DATA}")


# --------------------------------------------------------------------------------------------- text
def load_token_ids(
    data: Any,
    tokenizer: Any,
    *,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seed: int = 0,
    split: str = "train",
    text_column: str | None = None,
    max_length: int | None = None,
    revision: str | None = None,
    min_samples: int = 1,
    batch_size: int = 32,
    buffer_size: int = 1000,
    whole_split_max_bytes: int = WHOLE_SPLIT_MAX_BYTES,
    progress: bool = False,
    family: str | None = None,
    name: str | None = None,
) -> tuple[ModelInputs, DataInfo]:
    """Read up to ``num_samples`` texts from ``data`` and tokenise them with ``tokenizer`` (the base's).

    Args:
        data: a list of strings; a ``.txt`` file (one sample per non-blank line); a ``.jsonl`` / ``.json`` /
            ``.csv`` / ``.tsv`` / ``.parquet`` file; a folder of ``.txt`` / ``.md`` files (one sample per file), of
            data files, or saved with ``Dataset.save_to_disk``; a ``datasets.Dataset`` / ``IterableDataset``; a
            Hub dataset id (streamed); or already tokenised inputs (a mapping with ``input_ids`` and
            ``attention_mask``, e.g. a tokenizer's output with ``return_tensors="pt"``).
        tokenizer: the base model's tokenizer.
        num_samples, seed, split, revision, min_samples, buffer_size, whole_split_max_bytes, name: as in
            :func:`load_pixel_values`.
        text_column: the column with the text; found automatically when omitted (the one string column, else
            the one named ``text``).
        max_length: tokens per sequence at most, special tokens included (default 128); longer texts are cut.
        batch_size: texts tokenised at once.
        progress: show a "Reading texts" bar.
        family: the model family, named in the error when ``data`` holds images instead.

    Returns:
        ``ModelInputs`` with ``input_ids`` and ``attention_mask`` ``[N, T]`` (right-padded to the longest sequence,
        mask 1 on real tokens), and the data's description (sequences, tokens, sequences cut at ``max_length``).
    """
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise DataError(f"num_samples must be a positive integer, got {num_samples!r}.")
    max_length = DEFAULT_MAX_LENGTH if max_length is None else max_length
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
        raise DataError(f"max_length must be a positive integer (tokens per sequence), got {max_length!r}.")
    _refuse_images_for_text(data, family)
    given = as_model_inputs(data)
    if given is not None:
        inputs = _given_token_ids(given, num_samples)
        info = DataInfo(source="tokens", num_samples=len(inputs), seed=seed, sampling="as given",
                        num_tokens=inputs.num_tokens)
    else:
        if tokenizer is None:
            raise DataError("Text data needs the base model's tokenizer; none was given.")
        sampler = _Sampler(num_samples, seed, max(buffer_size, 8 * num_samples), whole_split_max_bytes)
        rows, info = _iter_texts(data, sampler=sampler, split=split, text_column=text_column, revision=revision,
                                 family=family)
        inputs = _tokenize(rows, tokenizer, info, limit=num_samples, max_length=max_length, batch_size=batch_size,
                           progress=progress)
        if 0 < len(inputs) < num_samples:
            import warnings

            warnings.warn(f"Asked for {num_samples} scoring texts; {_named(info, name)} has only {len(inputs)} "
                          f"usable ones, so {len(inputs)} are used.", UserWarning, stacklevel=2)
    if len(inputs) < min_samples:
        raise DataError(
            f"Only {len(inputs)} usable text(s) were read from {info.id or info.source!r} (split {info.split!r}, "
            f"{info.skipped} empty or not text skipped); at least {min_samples} are needed. Point data at more text, "
            "or lower num_samples.")
    return inputs, info


def _given_token_ids(given: ModelInputs, num_samples: int) -> ModelInputs:
    ids = given["input_ids"]
    if ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
        raise DataError(f"input_ids must be an integer tensor of shape [N, T], got {ids.dtype} "
                        f"{tuple(ids.shape)}.")
    mask = given["attention_mask"] if "attention_mask" in given else torch.ones_like(ids)
    if not ((mask == 0) | (mask == 1)).all():
        raise DataError("attention_mask must hold 0 (padding) and 1 (a token) only.")
    empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:  # a sequence of padding only adds nothing to a Gram or a score, and NaN to some attention kernels
        raise DataError(f"{len(empty)} of the {len(ids)} token sequences hold no token (input_ids of length 0 or an "
                        f"attention_mask of zeros only; the first: row {empty[0]}): drop them, or give each sequence "
                        "at least one token.")
    return ModelInputs({"input_ids": ids.long(), "attention_mask": mask.long()}).select(slice(0, num_samples))


def _iter_texts(data, *, sampler: _Sampler, split: str, text_column: str | None, revision: str | None,
                family: str | None) -> tuple[Iterator[tuple[Any, Any]], DataInfo]:
    """``(text, label)`` pairs in sampled order (label None without a label column), and their description."""
    import datasets

    seed = sampler.seed
    if isinstance(data, (str, os.PathLike)):
        ref = os.fspath(data)
        path = Path(ref).expanduser()
        if path.is_file():
            return _text_file(path, sampler, text_column, family)
        if path.is_dir():
            return _text_folder(path, sampler, split, text_column, family)
        if ref.startswith((".", "/", "~")) or path.suffix:
            raise DataError(f"Data path {ref!r} does not exist.")
        ds = _stream_hub(ref, split, revision, offline="a local text file or folder")
        info = DataInfo(source="hub", id=ref, split=split, seed=seed)
        return _texts_from_dataset(ds, info, sampler, text_column, whole=_is_small(ds, split, sampler), family=family)
    data = _split_of(data, split)
    if isinstance(data, (datasets.Dataset, datasets.IterableDataset)):
        info = _dataset_info(data, seed)
        whole = isinstance(data, datasets.IterableDataset) and _is_small(data, info.split, sampler)
        return _texts_from_dataset(data, info, sampler, text_column, whole=whole, family=family)
    if isinstance(data, (list, tuple)):
        if not data:
            raise DataError("The list of scoring texts is empty.")
        bad = next((i for i, x in enumerate(data) if not isinstance(x, str)), None)
        if bad is not None:
            raise DataError(f"Scoring texts must be strings; item {bad} is a {type(data[bad]).__name__}.")
        return ((text, None) for text in data), DataInfo(source="texts", seed=seed, sampling="as given")
    raise DataError(f"Unsupported scoring data of type {type(data).__name__}. {_TEXT_DATA}")


def _text_file(path: Path, sampler: _Sampler, text_column: str | None, family: str | None):
    """A ``.txt`` file (one sample per non-blank line, sampled uniformly) or a data file read with ``datasets``."""
    suffix = path.suffix.lower()
    if suffix in TEXT_FILE_SUFFIXES:
        if text_column is not None:
            raise DataError(f"text_column={text_column!r} does not apply to the plain text file {str(path)!r} (one "
                            "sample per line); leave it out, or pass a .jsonl/.csv/.parquet file with that column.")
        info = DataInfo(source="textfile", id=path.name, seed=sampler.seed, sampling="whole split")
        return ((line, None) for line in _reservoir(_lines(path), sampler.rows, sampler.seed)), info
    if suffix in TABLE_SUFFIXES:
        import datasets

        builder = TABLE_SUFFIXES[suffix]
        options = {"delimiter": "\t"} if suffix == ".tsv" else {}
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **options)
        except (ValueError, OSError) as err:
            raise DataError(f"Cannot read {str(path)!r} as {builder}: {' '.join(str(err).split())[:200]}") from None
        info = DataInfo(source="file", id=path.name, seed=sampler.seed)
        return _texts_from_dataset(ds, info, sampler, text_column, whole=True, family=family)
    if suffix in _IMAGE_SUFFIXES:
        _refuse_images_for_text([str(path)], family)
    raise DataError(f"Cannot read scoring text from {str(path)!r}: its type ({suffix or 'no suffix'}) is not one of "
                    f"{list(DATA_FILE_SUFFIXES)}. {_TEXT_DATA}")


def _lines(path: Path) -> Iterator[str]:
    try:
        with path.open(encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    yield line.rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise DataError(f"{str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start}).") from None


def _text_folder(path: Path, sampler: _Sampler, split: str, text_column: str | None, family: str | None):
    """A folder saved with ``save_to_disk``, a folder of data files (``datasets`` lays out its splits), or a
    folder of text files (one sample per file)."""
    import datasets

    seed = sampler.seed
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (OSError, ValueError) as err:
            raise DataError(f"Cannot load the saved dataset {str(path)!r}: {' '.join(str(err).split())[:200]}") \
                from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"Split {split!r} is not in the saved dataset {str(path)!r}; its splits are "
                                f"{list(loaded)}. Pass split=... (YAML: data.split).")
            loaded = loaded[split]
            saved_split = split
        else:  # one saved split: whichever it was, not the split argument
            saved_split = str(loaded.split) if loaded.split is not None else None
        info = DataInfo(source="folder", id=path.name, split=saved_split, seed=seed)
        return _texts_from_dataset(loaded, info, sampler, text_column, whole=False, family=family)
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in
                                                                          p.relative_to(path).parts))
    suffixes = {p.suffix.lower() for p in files}
    if suffixes & set(TABLE_SUFFIXES):
        try:
            ds = datasets.load_dataset(str(path), split=split, streaming=True)
        except FileNotFoundError as err:
            raise DataError(f"No data files found in {str(path)!r}: {err}.") from None
        except ValueError as err:
            raise DataError(f"Cannot load split {split!r} of the data folder {str(path)!r}: "
                            f"{' '.join(str(err).split())[:300]}. Pass split=... (YAML: data.split).") from None
        info = DataInfo(source="folder", id=path.name, split=split, seed=seed)
        return _texts_from_dataset(ds, info, sampler, text_column, whole=True, family=family)
    texts = [p for p in files if p.suffix.lower() in TEXT_FILE_SUFFIXES]
    if texts:
        if text_column is not None:
            raise DataError(f"text_column={text_column!r} does not apply to the folder of text files {str(path)!r} "
                            "(one sample per file); leave it out.")
        info = DataInfo(source="textfolder", id=path.name, seed=seed, sampling="whole split")
        return ((_read_text(p), None) for p in _shuffled(texts, seed)), info
    if suffixes & _IMAGE_SUFFIXES:
        raise DataError(f"{_family(family, capital=True)} is scored on text, but {str(path)!r} is a folder of images. "
                        f"{_TEXT_DATA}")
    raise DataError(f"No text found in {str(path)!r}: no {list(TEXT_FILE_SUFFIXES)} files (one sample per file), no "
                    f"{list(TABLE_SUFFIXES)} data files, no dataset saved with save_to_disk.")


def _read_text(path: Path) -> str | None:
    """A text file's content (its start: enough characters for any ``max_length``), None when unreadable."""
    try:
        with path.open(encoding="utf-8") as handle:
            return handle.read(MAX_CHARS_PER_TOKEN * 4096)
    except (OSError, UnicodeDecodeError):
        return None


def _texts_from_dataset(ds, info: DataInfo, sampler: _Sampler, text_column: str | None, *, whole: bool,
                        family: str | None):
    import datasets

    features = _features(ds)
    column = text_column or _find_text_column(features, info, family)
    if column not in features:
        raise DataError(f"Text column {column!r} not found in {info.id or info.source!r}; available columns: "
                        f"{list(features)}.")
    info.text_column = column
    feature = features[column]
    if feature is not None and column not in _string_columns(features):
        raise DataError(f"Column {column!r} of {info.id or info.source!r} holds {_feature_name(feature)} values, not "
                        f"text; pass text_column=... naming the column with text (columns: {list(features)}).")
    label = _find_label_column(ds, column) if ds.features else None
    if label is not None:
        info.label_column = label
        label_feature = ds.features.get(label)
        info.num_labels = label_feature.num_classes if isinstance(label_feature, datasets.ClassLabel) else None
    if ds.column_names:
        ds = ds.select_columns([c for c in (column, label) if c is not None])  # read nothing else
    rows = _sampled_rows(ds, info, sampler, whole=whole)
    return ((row[column], row.get(label) if label else None) for row in rows), info


def _features(ds) -> dict[str, Any]:
    """Column -> feature; a stream whose features are unknown until read (CSV, ``from_generator``) is typed from its
    first row: strings as text (or image paths), PIL images and ``{bytes, path}`` cells as images, the rest unknown."""
    import datasets

    if ds.features:
        return dict(ds.features)
    first = next(iter(ds.take(1) if isinstance(ds, datasets.IterableDataset) else ds), None) or {}
    return {name: _cell_feature(value) for name, value in first.items()}


def _cell_feature(value: Any) -> Any:
    import datasets

    if isinstance(value, str):
        return datasets.Value("string")
    if isinstance(value, (bytes, bytearray)):
        return datasets.Value("binary")
    if isinstance(value, Image.Image) or _is_image_cell(value):
        return datasets.Image()
    return None


def _is_image_cell(value: Any) -> bool:
    """A ``datasets`` image cell as a stream yields it undecoded: ``{"bytes": ..., "path": ...}`` and nothing else."""
    return (isinstance(value, dict) and bool(value) and set(value) <= {"bytes", "path"}
            and bool(value.get("bytes") or value.get("path")))


def _string_columns(features: Any) -> list[str]:
    import datasets

    return [name for name, feature in (features or {}).items()
            if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")]


def _find_text_column(features: dict[str, Any], info: DataInfo, family: str | None) -> str:
    import datasets

    texts = _string_columns(features)
    if len(texts) == 1:
        return texts[0]
    if "text" in texts:
        return "text"
    where = info.id or info.source
    if texts:
        raise DataError(f"{where!r} has several text columns {texts}; pass text_column=... naming the one to score on "
                        f"(columns: {list(features)}).")
    if any(isinstance(f, datasets.Image) for f in features.values()):
        raise DataError(f"{_family(family, capital=True)} is scored on text, but {where!r} holds images (columns: "
                        f"{list(features)}). {_TEXT_DATA}")
    raise DataError(f"No text column found in {where!r} (columns: {list(features)}). Pass text_column=... naming the "
                    "column with text.")


def _tokenize(rows: Iterable[tuple[Any, Any]], tokenizer: Any, info: DataInfo, *, limit: int, max_length: int,
              batch_size: int, progress: bool = False) -> ModelInputs:
    """Tokenise up to ``limit`` texts (empty and non-string ones skipped and counted), cut at ``max_length`` tokens;
    right-pad them into ``input_ids`` / ``attention_mask``."""
    pad_id = _pad_id(tokenizer, info)
    cap = MAX_CHARS_PER_TOKEN * max_length
    sequences: list[list[int]] = []
    labels: set[Any] = set()
    truncated = 0
    pending: list[tuple[str, bool, Any]] = []
    bar = tqdm(total=limit, desc="Reading texts", unit="text", disable=not progress, leave=False)

    def flush() -> None:
        nonlocal truncated
        if not pending:
            return
        texts = [text for text, _, _ in pending]
        # one token over max_length tells which texts are cut; those are tokenised again at max_length, so their
        # closing special token (BERT's [SEP]) is kept
        ids = tokenizer(texts, truncation=True, max_length=max_length + 1)["input_ids"]
        long = [i for i, seq in enumerate(ids) if len(seq) > max_length]
        if long:
            for i, seq in zip(long, tokenizer([texts[i] for i in long], truncation=True,
                                              max_length=max_length)["input_ids"]):
                ids[i] = seq
        for i, (seq, (_, cut, label)) in enumerate(zip(ids, pending)):
            if not seq:
                info.skipped += 1
                continue
            sequences.append(list(seq))
            truncated += cut or i in long
            bar.update()
            if label is not None:
                labels.add(label)
        pending.clear()

    for text, label in rows:
        if len(sequences) + len(pending) >= limit:
            flush()
            if len(sequences) >= limit:
                break
        if not isinstance(text, str) or not text.strip():
            info.skipped += 1
            continue
        pending.append((text[:cap], len(text) > cap, label))
        if len(pending) == batch_size:
            flush()
    if pending:
        flush()
    bar.close()
    sequences = sequences[:limit]
    length = max((len(s) for s in sequences), default=0)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[row, : len(seq)] = 1
    info.num_samples, info.max_length = len(sequences), max_length
    info.num_tokens, info.truncated = int(attention_mask.sum()), int(truncated)
    if info.label_column is not None:
        info.labels_covered = len(labels)
    return ModelInputs({"input_ids": input_ids, "attention_mask": attention_mask})


def _pad_id(tokenizer: Any, info: DataInfo) -> int:
    """The tokenizer's pad token id, else its end-of-sequence token's (said in ``info.padding``): padding never
    enters a sum (the attention mask excludes it), so any id the model knows serves."""
    if getattr(tokenizer, "pad_token_id", None) is not None:
        info.padding = "right"
        return int(tokenizer.pad_token_id)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError(f"The tokenizer ({type(tokenizer).__name__}) has neither a pad token nor an end-of-sequence "
                        "token to pad the scoring texts with; set tokenizer.pad_token (e.g. to an existing special "
                        "token) and pass it as processor=....")
    info.padding = f"right, with the end-of-sequence token {tokenizer.eos_token!r} (the tokenizer has no pad token)"
    import logging

    logging.getLogger(__name__).info("The tokenizer has no pad token: padding with its end-of-sequence token %r "
                                     "(masked out, so it never enters a sum).", tokenizer.eos_token)
    return int(eos)
