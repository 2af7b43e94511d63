"""``MergeConfig``: a merge described in YAML (or a dict), as read by ``hf-mloss merge CONFIG.yaml OUT_DIR``.

The schema is the one :meth:`hf_mloss.MergeResult.merge_config` writes to ``hf_mloss_config.yaml`` next to every
saved merge, so a saved merge can be re-run as it is:

```yaml
base: openai/clip-vit-base-patch32          # Hub id or local folder, or {model: ..., revision: ...}
models:                                      # the fine-tunes: plain strings or {model, weight, revision}
  - tanganke/clip-vit-base-patch32_dtd
  - {model: ./finetunes/cars, weight: 0.5}
method: m_ties                               # `hf-mloss methods` lists them
parameters: {k: 0.2, e: 0.1}                 # the method's parameters; the others keep their defaults
data: {id: tanganke/dtd, split: train, num_samples: 128}   # or {path: ./images}; needed by m_ties and m_dare
seed: 0
dtype: float32                               # dtype of the saved model (default: the base's)
batch_size: 16
score: {prefix: own, reduction: abs}         # optional, used by `hf-mloss score`
```

Relative local paths resolve against the folder of the config file. Every check runs when the config is loaded,
before anything is downloaded or computed, and raises :class:`~hf_mloss.ConfigError` naming the field, the value
and the valid choices. Access tokens are never read from a config: use ``hf auth login`` or ``HF_TOKEN``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .data import DEFAULT_NUM_SAMPLES
from .errors import ConfigError, HfMLossError

if TYPE_CHECKING:
    from .methods import MergeMethod
    from .report import MLossReport
    from .result import MergeResult

TOP_LEVEL_KEYS = ("hf_mloss_version", "base", "models", "method", "parameters", "data", "seed", "dtype",
                  "batch_size", "compute_dtype", "score")  # fmt: skip
MODEL_KEYS = ("model", "weight", "revision")
BASE_KEYS = ("model", "revision")
DATA_KEYS = ("id", "path", "split", "num_samples", "seed", "image_column")
DATA_RECORD_KEYS = ("source", "skipped")
"""Keys ``merge_config()`` records about the data that was read; accepted and dropped on load."""
DATA_SOURCES = ("hub", "imagefolder")
"""Recorded data sources a config can re-read (in-memory images, tensors and dataset objects cannot)."""
SCORE_KEYS = ("prefix", "reduction", "activation", "eps", "layers")
DTYPES = ("bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
DEFAULT_METHOD = "ties"
DEFAULT_BATCH_SIZE = 16
TOKEN_HINT = ("hf-mloss never reads access tokens from a config file (it would end up in version control and in "
              "saved merges); log in with `hf auth login` or set the HF_TOKEN environment variable instead.")


@dataclass
class ModelSpec:
    """One model of a merge: a Hub id or a local folder, with an optional weight and Hub revision."""

    model: str = field(metadata={"help": "Hub id (org/name) or local folder written by save_pretrained."})
    weight: float | None = field(default=None, metadata={"help": "α of this fine-tune (give all or none)."})
    revision: str | None = field(default=None, metadata={"help": "Hub branch, tag or commit (Hub ids only)."})

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model}
        if self.revision is not None:
            out["revision"] = self.revision
        if self.weight is not None:
            out["weight"] = self.weight
        return out


@dataclass
class DataSpec:
    """The unlabeled scoring images: a Hub dataset (``id``) or a local image folder (``path``)."""

    id: str | None = field(default=None, metadata={"help": "Hub dataset id, streamed (e.g. tanganke/dtd)."})
    path: str | None = field(default=None, metadata={"help": "Local image folder (imagefolder layout or flat)."})
    split: str = field(default="train", metadata={"help": "Dataset split."})
    num_samples: int = field(default=DEFAULT_NUM_SAMPLES, metadata={"help": "Images to use (the paper: 128)."})
    seed: int | None = field(default=None, metadata={"help": "Shuffle seed; must equal the top-level seed."})
    image_column: str | None = field(default=None, metadata={"help": "Column with the images (auto-detected)."})

    @property
    def source(self) -> str | None:
        """What ``hf_mloss.merge(data=...)`` receives: the local folder or the Hub id."""
        return self.path if self.path is not None else self.id

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id} if self.path is None else {"path": self.path}
        out.update(split=self.split, num_samples=self.num_samples)
        if self.seed is not None:
            out["seed"] = self.seed
        if self.image_column is not None:
            out["image_column"] = self.image_column
        return out


@dataclass
class ScoreSpec:
    """Options of ``hf-mloss score`` (see :func:`hf_mloss.score`); unset fields keep the API defaults."""

    prefix: str | None = field(default=None, metadata={"help": "own (default), base or merged."})
    reduction: str | None = field(default=None, metadata={"help": "abs (default) or sq."})
    activation: str | None = field(default=None, metadata={"help": "Override the model's activation."})
    eps: float | None = field(default=None, metadata={"help": "ε of the normalized M-Loss (default 1e-4)."})
    layers: list[int] | None = field(default=None, metadata={"help": "Blocks to score (default: all)."})

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class MergeConfig:
    """A merge (or a scoring run) as written in a YAML file: what ``hf-mloss merge`` and ``hf-mloss score`` read.

    Load one with :meth:`from_yaml` or :meth:`from_dict` (both validate), run it with :meth:`run_merge` or
    :meth:`run_score`, and write it back with :meth:`to_dict` / :meth:`to_yaml`.

    Example:
        ```python
        >>> from hf_mloss.config import MergeConfig
        >>> config = MergeConfig.from_yaml("examples/merge_clip_vit_b32_8tasks.yaml")
        >>> result = config.run_merge(device="cuda")
        >>> result.save_pretrained("merged")
        ```
    """

    base: ModelSpec = field(metadata={"help": "The pretrained model the others were fine-tuned from."})
    models: list[ModelSpec] = field(metadata={"help": "The fine-tuned models to merge."})
    method: str = field(default=DEFAULT_METHOD, metadata={"help": "Registered merge method (hf-mloss methods)."})
    parameters: dict[str, Any] = field(default_factory=dict, metadata={"help": "The method's parameters."})
    data: DataSpec | None = field(default=None, metadata={"help": "Unlabeled images (m_ties, m_dare, score)."})
    seed: int = field(default=0, metadata={"help": "Seeds DARE masks, random ranks and data shuffling."})
    dtype: str | None = field(default=None, metadata={"help": f"dtype of the saved model, one of {DTYPES}."})
    batch_size: int = field(default=DEFAULT_BATCH_SIZE, metadata={"help": "Images per scoring forward pass."})
    compute_dtype: str = field(default="float32", metadata={"help": "dtype of the scoring forward passes."})
    score: ScoreSpec | None = field(default=None, metadata={"help": "Options of hf-mloss score."})
    hf_mloss_version: str | None = field(default=None, metadata={"help": "Version that wrote the config."})

    # ------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> MergeConfig:
        """Read and validate a YAML config; relative local paths in it resolve against the file's folder.

        Raises:
            ConfigError: the file is missing, is not YAML, or describes an invalid merge.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"Config file {str(path)!r} does not exist.") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"Cannot read config file {str(path)!r}: {err}") from None
        try:
            content = yaml.load(text, Loader=_ConfigLoader)  # a SafeLoader subclass
        except yaml.YAMLError as err:
            raise ConfigError(f"Config file {str(path)!r} is not valid YAML: {' '.join(str(err).split())}") from None
        if content is None:
            raise ConfigError(f"Config file {str(path)!r} is empty; it needs at least `base` and `models`.")
        try:
            return cls.from_dict(content, base_dir=path.resolve().parent)
        except ConfigError as err:
            raise ConfigError(f"Invalid config {str(path)!r}: {err}") from None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], base_dir: str | os.PathLike[str] | None = None) -> MergeConfig:
        """Build and validate a config from a dict with the YAML schema.

        Args:
            config: the parsed YAML (``base``, ``models``, ``method``, ``parameters``, ``data``, ``seed``...).
            base_dir: folder that relative local paths resolve against (``from_yaml`` passes the file's folder);
                ``None`` leaves them relative to the working directory.
        """
        if not isinstance(config, Mapping):
            raise ConfigError(f"A merge config must be a mapping with keys such as 'base' and 'models', got a "
                              f"{type(config).__name__}: {_short(config)}.")
        _check_keys(config, TOP_LEVEL_KEYS, "config")
        for key in ("base", "models"):
            if key not in config:
                raise ConfigError(f"Missing required key {key!r}: name the base model (`base: org/name`) and the "
                                  "fine-tuned models (`models: [org/ft-a, org/ft-b]`).")
        root = Path(base_dir) if base_dir is not None else None
        base = _parse_model(config["base"], "base", root, keys=BASE_KEYS)
        models = config["models"]
        if not isinstance(models, list):
            raise ConfigError(f"models must be a list of Hub ids or local folders (or {{model: ..., weight: ...}} "
                              f"entries), got a {type(models).__name__}: {_short(models)}.")
        parsed_models = [_parse_model(m, f"models[{i}]", root, keys=MODEL_KEYS) for i, m in enumerate(models)]
        parameters = config.get("parameters")
        if parameters is None:
            parameters = {}
        elif not isinstance(parameters, Mapping):
            raise ConfigError(f"parameters must be a mapping of the method's parameters (e.g. {{k: 0.2}}), got "
                              f"{_short(parameters)}.")
        data = _parse_data(config.get("data"), root)
        seed = config.get("seed", data.seed if data is not None and data.seed is not None else 0)
        score = _parse_score(config.get("score"))
        out = cls(
            base=base,
            models=parsed_models,
            method=config.get("method", DEFAULT_METHOD),
            parameters=_plain(dict(parameters)),
            data=data,
            seed=seed,
            dtype=config.get("dtype"),
            batch_size=config.get("batch_size", DEFAULT_BATCH_SIZE),
            compute_dtype=config.get("compute_dtype", "float32"),
            score=score,
            hf_mloss_version=config.get("hf_mloss_version"),
        )
        out.validate()
        return out

    # ---------------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check every field without touching the network or the disk (except local paths' existence).

        Raises:
            ConfigError: naming the field, the bad value and the valid choices.
        """
        _validate_model(self.base, "base", weight_allowed=False)
        if not isinstance(self.models, list) or not self.models:
            raise ConfigError(f"models must be a non-empty list of fine-tuned models, got {_short(self.models)}.")
        for i, spec in enumerate(self.models):
            _validate_model(spec, f"models[{i}]")
        self._validate_weights()
        _check_int("seed", self.seed, minimum=0)
        method = self._validate_method()
        if method.needs_data and self.data is None:
            raise ConfigError(
                f"Method {self.method!r} is data-guided and the config has no `data`: add e.g. "
                "`data: {id: tanganke/dtd, split: train, num_samples: 128}` (any Hub image dataset) or "
                "`data: {path: ./images}` (a local image folder); about 128 unlabeled images suffice."
            )
        if self.data is not None:
            self._validate_data()
        _check_int("batch_size", self.batch_size, minimum=1)
        if self.dtype is not None:
            _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("compute_dtype", self.compute_dtype, DTYPES)
        if self.score is not None:
            self._validate_score()
        if self.hf_mloss_version is not None and not isinstance(self.hf_mloss_version, str):
            raise ConfigError(f"hf_mloss_version must be a string, got {_short(self.hf_mloss_version)}.")

    def _validate_weights(self) -> None:
        given = [m.weight is not None for m in self.models]
        if any(given) and not all(given):
            missing = [f"models[{i}]" for i, g in enumerate(given) if not g]
            raise ConfigError(f"Give a weight to every model or to none (the default is uniform); "
                              f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} no weight.")
        if not any(given):
            return
        for i, spec in enumerate(self.models):
            if not _is_real(spec.weight) or spec.weight < 0:
                raise ConfigError(f"models[{i}].weight must be a finite number >= 0, got {_short(spec.weight)}.")
        if sum(m.weight for m in self.models) <= 0:
            raise ConfigError("The models' weights must not all be 0.")

    def _validate_method(self) -> MergeMethod:
        from .methods import MERGE_METHODS, list_methods

        if not isinstance(self.method, str) or self.method not in MERGE_METHODS:
            raise ConfigError(f"Unknown method {_short(self.method)}{_did_you_mean(self.method, list_methods())}; "
                              f"available methods: {list_methods()} (see `hf-mloss methods`).")
        method = MERGE_METHODS[self.method]
        if not isinstance(self.parameters, dict):
            raise ConfigError(f"parameters must be a mapping, got {_short(self.parameters)}.")
        defaults = parameter_defaults(method.params_class)
        for key in self.parameters:
            if key == "token" or (isinstance(key, str) and "token" in key.lower()):
                raise ConfigError(f"parameters.{key}: {TOKEN_HINT}")
            if key not in defaults:
                valid = ", ".join(f"{k} (default {v!r})" for k, v in defaults.items()) or "none"
                raise ConfigError(f"Unknown parameter {_short(key)}{_did_you_mean(key, defaults)} for method "
                                  f"{self.method!r}; valid parameters: {valid}.")
        _check_activation("parameters.activation", self.parameters.get("activation"))
        try:
            method.make_params(**self.parameters)
        except HfMLossError as err:
            raise ConfigError(f"Invalid parameters for method {self.method!r}: {err}") from None
        except Exception as err:  # noqa: BLE001 - any failure to build the params means a bad value
            raise ConfigError(f"Invalid parameters for method {self.method!r} ({self.parameters}): "
                              f"{type(err).__name__}: {err}") from None
        return method

    def _validate_data(self) -> None:
        data = self.data
        if not isinstance(data, DataSpec):
            raise ConfigError(f"data must be a DataSpec, got {_short(data)}.")
        if (data.id is None) == (data.path is None):
            raise ConfigError("data needs exactly one of `id` (a Hub dataset id such as tanganke/dtd) or `path` "
                              f"(a local image folder), got id={_short(data.id)} and path={_short(data.path)}.")
        if data.id is not None and (not isinstance(data.id, str) or not data.id.strip()):
            raise ConfigError(f"data.id must be a Hub dataset id (a string), got {_short(data.id)}.")
        if data.path is not None:
            if not isinstance(data.path, str) or not data.path.strip():
                raise ConfigError(f"data.path must be a local folder (a string), got {_short(data.path)}.")
            if not _expand(data.path).is_dir():
                raise ConfigError(f"data.path {data.path!r} is not an existing folder (relative paths resolve "
                                  "against the config file's folder).")
        if not isinstance(data.split, str) or not data.split:
            raise ConfigError(f"data.split must be a split name such as 'train', got {_short(data.split)}.")
        _check_int("data.num_samples", data.num_samples, minimum=1)
        if data.seed is not None:
            _check_int("data.seed", data.seed, minimum=0)
            if data.seed != self.seed:
                raise ConfigError(f"data.seed ({data.seed}) differs from seed ({self.seed}); hf_mloss uses one seed "
                                  "for data shuffling and the merge: set only the top-level `seed`.")
        if data.image_column is not None and not isinstance(data.image_column, str):
            raise ConfigError(f"data.image_column must be a column name, got {_short(data.image_column)}.")

    def _validate_score(self) -> None:
        from .methods.mties import MTiesParams

        score = self.score
        if not isinstance(score, ScoreSpec):
            raise ConfigError(f"score must be a ScoreSpec, got {_short(score)}.")
        _check_activation("score.activation", score.activation)
        kwargs = {k: v for k, v in score.to_dict().items() if k != "activation"}
        try:
            MTiesParams(**kwargs)
        except HfMLossError as err:
            raise ConfigError(f"Invalid score section: {err}") from None
        except Exception as err:  # noqa: BLE001
            raise ConfigError(f"Invalid score section ({kwargs}): {type(err).__name__}: {err}") from None

    # --------------------------------------------------------------------------------------------- output
    def to_dict(self) -> dict[str, Any]:
        """The config in the YAML schema (plain Python types); ``from_dict(to_dict())`` gives an equal config."""
        out: dict[str, Any] = {}
        if self.hf_mloss_version is not None:
            out["hf_mloss_version"] = self.hf_mloss_version
        out["base"] = self.base.to_dict()
        out["models"] = [m.to_dict() for m in self.models]
        out["method"] = self.method
        out["parameters"] = _plain(dict(self.parameters))
        out["seed"] = self.seed
        if self.dtype is not None:
            out["dtype"] = self.dtype
        if self.data is not None:
            out["data"] = self.data.to_dict()
        out["batch_size"] = self.batch_size
        out["compute_dtype"] = self.compute_dtype
        if self.score is not None:
            out["score"] = self.score.to_dict()
        return out

    def to_yaml(self, path: str | os.PathLike[str] | None = None) -> str:
        """The config as YAML text; also written to ``path`` when given."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    # -------------------------------------------------------------------------------------------- running
    def merge_kwargs(self) -> dict[str, Any]:
        """The arguments of :func:`hf_mloss.merge` this config stands for."""
        kwargs: dict[str, Any] = {
            "base": self.base.model,
            "models": [m.model for m in self.models],
            "method": self.method,
            "weights": self._weights(),
            "seed": self.seed,
            "dtype": self.dtype,
            "batch_size": self.batch_size,
            "compute_dtype": self.compute_dtype,
            "revision": self._revision(),
        }
        kwargs.update(self._data_kwargs())
        kwargs.update(_plain(dict(self.parameters)))
        return kwargs

    def score_kwargs(self) -> dict[str, Any]:
        """The arguments of :func:`hf_mloss.score` this config stands for (its ``score`` section or defaults)."""
        if self.data is None:
            raise ConfigError("Scoring needs unlabeled images and the config has no `data`: add e.g. `data: {id: "
                              "tanganke/dtd, split: train, num_samples: 128}` or `data: {path: ./images}`.")
        kwargs: dict[str, Any] = {
            "base": self.base.model,
            "models": [m.model for m in self.models],
            "weights": self._weights(),
            "seed": self.seed,
            "batch_size": self.batch_size,
            "compute_dtype": self.compute_dtype,
            "revision": self._revision(),
        }
        kwargs.update(self._data_kwargs())
        options = self.score.to_dict() if self.score is not None else {}
        if options.get("prefix") == "merged" and self.method == "m_ties":
            # Score the merge this config describes: its M-TIES parameters, the score section winning on overlap.
            for key, value in self.parameters.items():
                options.setdefault(key, value)
        kwargs.update(_plain(options))
        return kwargs

    def run_merge(self, **overrides: Any) -> MergeResult:
        """Validate, then run :func:`hf_mloss.merge`; ``overrides`` (``device``, ``progress``...) win over the config.

        Raises:
            ConfigError: the config is invalid, or its Hub models name different revisions.
        """
        import hf_mloss

        self.validate()
        kwargs = self.merge_kwargs()
        kwargs.update(overrides)
        return hf_mloss.merge(**kwargs)

    def run_score(self, **overrides: Any) -> MLossReport:
        """Validate, then run :func:`hf_mloss.score`; ``overrides`` (``device``, ``progress``...) win over the config.

        Raises:
            ConfigError: the config is invalid or has no ``data``.
        """
        import hf_mloss

        self.validate()
        kwargs = self.score_kwargs()
        kwargs.update(overrides)
        return hf_mloss.score(**kwargs)

    def _data_kwargs(self) -> dict[str, Any]:
        if self.data is None:
            return {}
        out: dict[str, Any] = {"data": self.data.source, "num_samples": self.data.num_samples,
                               "split": self.data.split}
        if self.data.image_column is not None:
            out["image_column"] = self.data.image_column
        return out

    def _weights(self) -> list[float] | None:
        return [m.weight for m in self.models] if self.models[0].weight is not None else None

    def _revision(self) -> str | list[str | None] | None:
        """Hub revisions for ``merge()``/``score()``: one string when all agree, else one per model (base first)."""
        specs = [self.base, *self.models]
        revisions = {spec.revision for spec in specs if not _is_local(spec.model)}
        if len(revisions) <= 1:
            return next(iter(revisions), None)
        return [None if _is_local(spec.model) else spec.revision for spec in specs]


# ------------------------------------------------------------------------------------------------- parsing
class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4`` as a float (YAML 1.1 reads it as a string) and refuses duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable: the parent class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.VERBOSE),
    list("-+0123456789."),
)


def _parse_model(entry: Any, where: str, root: Path | None, *, keys: tuple[str, ...]) -> ModelSpec:
    if isinstance(entry, str):
        return ModelSpec(model=_resolve_model_path(entry, root))
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where} must be a Hub id or local folder (a string) or a mapping such as "
                          f"{{model: org/name{', weight: 0.5' if 'weight' in keys else ''}}}, got {_short(entry)}.")
    if "weight" in entry and "weight" not in keys:
        raise ConfigError(f"{where}.weight: the base has no weight; weights belong to the fine-tuned models.")
    _check_keys(entry, keys, where)
    if "model" not in entry:
        raise ConfigError(f"{where} has no `model` key: write {{model: org/name}}, got {_short(dict(entry))}.")
    model = entry["model"]
    if isinstance(model, str):
        model = _resolve_model_path(model, root)
    return ModelSpec(model=model, weight=entry.get("weight"), revision=entry.get("revision"))


def _parse_data(entry: Any, root: Path | None) -> DataSpec | None:
    if entry is None:
        return None
    if isinstance(entry, str):
        if _looks_local(entry) or (root is not None and entry and (root / entry).is_dir()):
            return DataSpec(path=_resolve_path(entry, root))
        return DataSpec(id=entry)
    if not isinstance(entry, Mapping):
        raise ConfigError(f"data must be a Hub dataset id, a local folder or a mapping such as "
                          f"{{id: tanganke/dtd, split: train, num_samples: 128}}, got {_short(entry)}.")
    _check_keys(entry, DATA_KEYS + DATA_RECORD_KEYS, "data", shown=DATA_KEYS)
    source = entry.get("source")
    if source is not None and source not in DATA_SOURCES:
        raise ConfigError(
            f"data.source={_short(source)}: that merge was scored on data a config cannot re-read (in-memory images, "
            f"a tensor or a datasets object); replace the data section with `id` (a Hub dataset id) or `path` "
            f"(a local image folder). Recorded sources a config can re-read: {list(DATA_SOURCES)}."
        )
    data_id, path = entry.get("id"), entry.get("path")
    if isinstance(data_id, str) and data_id and path is None and (
        source == "imagefolder" or _looks_local(data_id)
        or (source is None and root is not None and (root / data_id).is_dir())
    ):
        data_id, path = None, data_id  # a local folder recorded (or written) as an id
    if isinstance(path, str) and path:
        path = _resolve_path(path, root)
    return DataSpec(
        id=data_id, path=path, split=entry.get("split", "train"),
        num_samples=entry.get("num_samples", DEFAULT_NUM_SAMPLES), seed=entry.get("seed"),
        image_column=entry.get("image_column"),
    )  # fmt: skip


def _parse_score(entry: Any) -> ScoreSpec | None:
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise ConfigError(f"score must be a mapping such as {{prefix: own, reduction: abs}}, got {_short(entry)}.")
    _check_keys(entry, SCORE_KEYS, "score")
    layers = entry.get("layers")
    return ScoreSpec(prefix=entry.get("prefix"), reduction=entry.get("reduction"),
                     activation=entry.get("activation"), eps=entry.get("eps"),
                     layers=list(layers) if isinstance(layers, (list, tuple)) else layers)


def _check_keys(entry: Mapping[Any, Any], valid: tuple[str, ...], where: str, *,
                shown: tuple[str, ...] | None = None) -> None:
    for key in entry:
        if isinstance(key, str) and "token" in key.lower():
            raise ConfigError(f"{'' if where == 'config' else where + '.'}{key}: {TOKEN_HINT}")
    unknown = [k for k in entry if k not in valid]
    if unknown:
        key = unknown[0]
        label = "top-level key" if where == "config" else f"key in {where}"
        raise ConfigError(f"Unknown {label} {_short(key)}{_did_you_mean(key, valid)}; valid keys: "
                          f"{list(shown or valid)}.")


def _validate_model(spec: Any, where: str, *, weight_allowed: bool = True) -> None:
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"{where} must be a ModelSpec, got {_short(spec)}.")
    if not isinstance(spec.model, str) or not spec.model.strip():
        raise ConfigError(f"{where}.model must be a Hub id or a local folder (a non-empty string), got "
                          f"{_short(spec.model)}.")
    if spec.weight is not None and not weight_allowed:
        raise ConfigError(f"{where}.weight: the base has no weight; weights belong to the fine-tuned models.")
    if _is_local(spec.model):
        if not _expand(spec.model).is_dir():
            raise ConfigError(f"{where}.model: local folder {spec.model!r} does not exist (relative paths resolve "
                              "against the config file's folder).")
        if spec.revision is not None:
            raise ConfigError(f"{where}.revision={_short(spec.revision)} only applies to Hub ids; {spec.model!r} is "
                              "a local folder.")
    if spec.revision is not None and (not isinstance(spec.revision, str) or not spec.revision):
        raise ConfigError(f"{where}.revision must be a branch, tag or commit hash as a string (quote it in YAML), "
                          f"got {_short(spec.revision)}.")


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{name} must be {bound}, got {_short(value)}.")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {_short(value)}.")


def _check_activation(name: str, value: Any) -> None:
    if value is None:
        return
    from transformers.activations import ACT2FN

    if not isinstance(value, str) or value not in ACT2FN:
        raise ConfigError(f"{name} must be null (the model's own) or one of {sorted(ACT2FN)}, got {_short(value)}.")


# --------------------------------------------------------------------------------------------------- helpers
def parameter_defaults(params_class: type) -> dict[str, Any]:
    """``{name: default}`` of a method's parameter dataclass (``None`` where a field has no default)."""
    out = {}
    for f in dataclasses.fields(params_class):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = None
    return out


def _looks_local(value: str) -> bool:
    return value.startswith((".", "/", "~")) or os.path.isabs(value)


def _is_local(value: Any) -> bool:
    return isinstance(value, str) and (_looks_local(value) or _expand(value).exists())


def _expand(value: str) -> Path:
    """``Path(value).expanduser()``, or the path as written when ``~user`` names no known home."""
    try:
        return Path(value).expanduser()
    except RuntimeError:
        return Path(value)


def _resolve_path(value: str, root: Path | None) -> str:
    path = _expand(value)
    if path.is_absolute() or root is None:
        return str(path) if value.startswith("~") else value
    return str((root / path).resolve())


def _resolve_model_path(value: str, root: Path | None) -> str:
    """Explicit local paths resolve against ``root``, and so does a bare name of a folder there; else: a Hub id."""
    if _looks_local(value):
        return _resolve_path(value, root)
    if root is not None and value and (root / value).is_dir():
        return str((root / value).resolve())
    return value


def _is_real(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _plain(value: Any) -> Any:
    """Tuples to lists, recursively (YAML-safe, and equal after a round trip)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _did_you_mean(value: Any, choices) -> str:
    if not isinstance(value, str):
        return ""
    match = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


__all__ = ["DataSpec", "MergeConfig", "ModelSpec", "ScoreSpec"]
