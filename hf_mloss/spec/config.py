"""``MergeConfig``: the one description of a merge (or scoring) run, validated once, saved with every merge.

:func:`hf_mloss.merge` builds one from its arguments; ``hf-mloss merge CONFIG.yaml OUT_DIR`` reads one from YAML;
:meth:`MergeConfig.from_pretrained` reads the ``hf_mloss_config.yaml`` of a merged model's folder or Hub repo, so a
published merge re-runs in one line. The config a merge returns (``MergeResult.config``) is the *record* of the run:
Hub models pinned to the commit they resolved to, local folders with a content fingerprint that a re-run verifies.

```yaml
base: openai/clip-vit-base-patch32          # Hub id or local folder, or {model: ..., revision: ...}
models:                                      # the fine-tunes: plain strings or {model, weight, revision}
  - tanganke/clip-vit-base-patch32_dtd
  - {model: ./finetunes/cars, weight: 0.5}
method: m_ties                               # `hf-mloss methods` lists them
parameters: {k: 0.2, e: 0.1}                 # the method's parameters; the others keep their defaults
data: {id: tanganke/dtd, split: train, num_samples: 128}   # or {path: ./images}; needed by data-guided methods
text_data: {path: ./captions.txt}            # optional: a whole CLIPModel's text tower is scored on it too
seed: 0
dtype: float32                               # dtype of the saved model (default: the base's)
score: {prefix: own, reduction: abs}         # optional, used by `hf-mloss score`
```

Relative local paths resolve against the folder of the config file. Access tokens are never read from a config: use
``hf auth login`` or ``HF_TOKEN``. mergekit YAML files (``merge_method``, ``base_model``, ``models[].parameters``) are
accepted for the methods both libraries share (see :mod:`hf_mloss.spec.mergekit`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._validation import check_float32, check_keys, is_finite, param, short, validate_fields
from ..loading.hub import expand, is_repo_id, looks_local, missing_model
from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    DataError,
    HfMLossError,
    InvalidParameterError,
    looks_like_secret,
)
from .options import ScoringOptions
from .schedule import ParamSchedule, check_schedules, scalar_parameters, split_parameters
from .selection import SelectionOptions, check_selection

if TYPE_CHECKING:
    from ..methods import MergeMethod, MethodParams

MERGE_CONFIG_NAME = "hf_mloss_config.yaml"
MOE_CONFIG_NAME = "hf_mloss_moe.yaml"
"""The recipe of an MoE built by ``hf-mloss moe`` (:mod:`hf_mloss.moe`): a merge run refuses it, naming that
command."""
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
OUTPUTS = ("auto", "tower", "adapter")
DEFAULT_NUM_SAMPLES = 128
MAX_CONFIG_BYTES = 1 << 20
TOKEN_HINT = ("hf-mloss never reads access tokens from a config file (it would end up in version control and in "
              "saved merges); log in with `hf auth login` or set the HF_TOKEN environment variable instead.")
TOKEN_KEYS = ("token", "hf_token", "use_auth_token", "auth_token", "access_token", "hub_token", "api_key")
"""Keys that name a credential (``tokenizer``, ``tokenizer_source`` are not: the guard looks at value shapes)."""
IN_MEMORY = "in_memory"
"""Key that marks, in a written config, a model or data that was passed as a Python object (it cannot re-run)."""
MODEL_INPUT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "pixel_values"})
"""Keys of a tokenizer's or image processor's output: data holding them is model inputs, not a data spec."""
RECORDED_FIELDS = frozenset({"resolved_parameters", "hf_mloss_version", "threads"})
"""Config fields a run writes into its recipe (read back from a file), never given as options."""


@dataclass
class ModelSpec:
    """One model of a merge: a Hub id, a local folder or a loaded ``PreTrainedModel``."""

    model: Any = param(help="Hub id (org/name), local folder written by save_pretrained, or a loaded model.")
    weight: float | None = param(None, "α of this fine-tune (give all or none; negative only for task_arithmetic: "
                                 "task negation).")
    revision: str | None = param(None, "Hub branch, tag or commit (Hub ids only).",
                                 hint="(quote it in YAML if it looks like a number)")
    fingerprint: str | None = param(None, "Content fingerprint of a local folder's weights (recorded; a re-run "
                                    "verifies it).")
    weights_file: str | None = param(None, "The weights file that was read (recorded), e.g. model.safetensors.")
    weights_ref: str | None = param(None, "The pull-request ref the weights came from (recorded), e.g. refs/pr/1 "
                                    "for the Hub's safetensors-conversion bot.")
    parameters: dict[str, Any] | None = param(None, "This model's own values of the method's per-model parameters "
                                              "(weight, k, p, gamma, e; see `hf-mloss methods`): a number, a gradient "
                                              "or a filter list each, used instead of the shared value for this model "
                                              "(mergekit's per-model parameters).")
    data: DataSpec | None = param(None, "This model's own unlabeled data (its task's images or texts), in any form "
                                  "`data` takes: RegMean's Grams, a learned merge's or auto's comparison with this "
                                  "model read it; M-TIES and scoring read the union of the models' data.")
    text_data: DataSpec | None = param(None, "This model's own text for the text tower of a whole two-tower model, as "
                                       "`text_data` takes it.")

    def __post_init__(self) -> None:
        if self.data is not None and not isinstance(self.data, DataSpec):
            self.data = _model_data(self.data, "data")
        if self.text_data is not None and not isinstance(self.text_data, DataSpec):
            self.text_data = _model_data(self.text_data, "text_data")
        validate_fields(self)
        if self.parameters is not None:
            self.parameters = _plain(dict(self.parameters)) or None
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.model, str):
            if not self.model.strip():
                raise InvalidParameterError("model must be a Hub id or a local folder, got an empty string.")
        elif not _is_loaded_model(self.model):
            raise InvalidParameterError(f"model must be a Hub id, a local folder or a loaded transformers "
                                        f"PreTrainedModel, got {type(self.model).__name__}: {short(self.model)}.")
        if self.revision is not None and self.is_local:
            raise InvalidParameterError(f"revision={self.revision!r} only applies to Hub ids; {self.model!r} is a "
                                        "local folder.")

    @property
    def is_loaded(self) -> bool:
        return not isinstance(self.model, str)

    @property
    def is_local(self) -> bool:
        return isinstance(self.model, str) and looks_local(self.model)

    def to_dict(self, root: Path | None = None) -> dict[str, Any]:
        if self.is_loaded:
            name = getattr(getattr(self.model, "config", None), "_name_or_path", "") or type(self.model).__name__
            out: dict[str, Any] = {IN_MEMORY: str(name)}
        else:
            out = {"model": _relative(self.model, root) if self.is_local else self.model}
        for key in ("revision", "weight", "fingerprint", "weights_file", "weights_ref", "parameters"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        for key in ("data", "text_data"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key).to_dict(root)
        return out

    @property
    def label(self) -> str:
        """The model as messages name it: its Hub id or folder's name, or a loaded model's class."""
        if self.is_loaded:
            return getattr(getattr(self.model, "config", None), "_name_or_path", "") or type(self.model).__name__
        return self.model if not self.is_local else os.path.basename(os.path.normpath(self.model))

    @property
    def run_weight(self) -> float | None:
        """The model's weight for the run as a whole: ``weight``, else the first value of a per-model ``weight``
        schedule (each tensor then gets its own, :class:`~hf_mloss.spec.schedule.TensorParameters`)."""
        if self.weight is not None or not self.parameters or "weight" not in self.parameters:
            return self.weight
        value = ParamSchedule.parse(self.parameters["weight"], "parameters.weight").leaves()[0]
        return float(value)


DATA_SEED = "data.seed: hf_mloss uses one seed for data shuffling and the merge: set only the top-level `seed`."


@dataclass
class DataSpec:
    """The unlabeled scoring data (images for image families, text for text families): a Hub dataset (``id``), a
    local folder or data file (``path``), or Python objects."""

    id: str | None = param(None, "Hub dataset id, streamed (e.g. tanganke/dtd).")
    path: str | None = param(None, "Local image folder (imagefolder layout or flat), text folder, or text/data file "
                             "(.txt, .jsonl, .json, .csv, .tsv, .parquet).")
    split: str = param("train", "Dataset split.")
    num_samples: int = param(DEFAULT_NUM_SAMPLES, "Images or texts to use (the paper: 128).", low=1, high=1_000_000)
    image_column: str | None = param(None, "Column with the images (auto-detected).")
    text_column: str | None = param(None, "Column with the text (auto-detected; text families).")
    max_length: int | None = param(None, "Tokens per text at most (default 128; text families).", low=1,
                                   high=1_000_000)
    revision: str | None = param(None, "Hub dataset revision (a model's own Hub data is recorded pinned to the commit "
                                 "read).")
    fingerprint: str | None = param(None, "Content fingerprint of a local data folder or file (recorded for a model's "
                                    "own data; a re-run verifies it).")
    objects: Any = field(default=None, repr=False, compare=False,
                         metadata={"help": "Data passed from Python: a [N, 3, H, W] tensor (a list of [3, H, W] "
                                           "tensors is stacked into one), a list of PIL images, "
                                           "paths or strings, tokenised inputs, or a datasets object (not written "
                                           "to configs)."})

    def __post_init__(self) -> None:
        try:
            validate_fields(self)
        except InvalidParameterError as err:
            raise DataError(str(err)) from None
        given = [x is not None for x in (self.id, self.path, self.objects)]
        if sum(given) != 1:
            raise DataError("data needs exactly one of `id` (a Hub dataset id such as tanganke/dtd), "
                            f"`path` (a local folder or data file) or data objects (images, texts), got "
                            f"id={short(self.id)}, path={short(self.path)}.")
        if self.path is not None and not _is_data_path(expand(self.path)):
            from ..loading.data import DATA_FILE_SUFFIXES

            kind = (f"is a file, not a folder or a text/data file ({', '.join(DATA_FILE_SUFFIXES)})"
                    if expand(self.path).exists() else "does not exist")
            raise DataError(f"data.path {self.path!r} {kind}: pass a folder of images (imagefolder layout "
                            "`train/<label>/*.png` or a flat folder), or text for a text model (a list of strings; a "
                            ".txt file, one sample per line; a .jsonl/.csv/.parquet file; a folder of .txt files).")
        if self.path is not None and expand(self.path).is_dir() and not _holds_a_file(expand(self.path)):
            raise DataError(f"data.path {self.path!r} is a folder with no file in it: pass a folder of images "
                            "(imagefolder layout or flat) or of text files.")

    @classmethod
    def parse(cls, data: Any, **options: Any) -> DataSpec:
        """From what ``merge(data=...)`` accepts: a Hub id, a local folder, or images as Python objects."""
        if isinstance(data, DataSpec):
            return data
        from ..loading.model_inputs import as_model_inputs

        if isinstance(data, str) and not data.strip():
            raise DataError("data is an empty string: give a Hub dataset id, a local folder or data file, or the "
                            "samples themselves.")
        datasets_object = type(data).__module__.split(".")[0] == "datasets"  # a DatasetDict is a dict too
        if isinstance(data, Mapping) and not datasets_object and as_model_inputs(data) is None:
            if "seed" in data:
                raise DataError(DATA_SEED)
            inputs = sorted(set(data) & MODEL_INPUT_KEYS)
            if inputs:  # model inputs whose values are not tensors (a tokenizer's output without return_tensors)
                raise DataError(f"data holds {inputs} whose values are not all torch tensors: pass a tokenizer's (or "
                                "image processor's) output made with return_tensors='pt', e.g. tokenizer(texts, "
                                "padding=True, return_tensors='pt'), or the texts or images themselves.")
            check_keys(data, [f.name for f in dataclasses.fields(cls)], "key in data", error=DataError)
            for key in ("id", "path"):
                if isinstance(data.get(key), str) and not data[key].strip():
                    raise DataError(f"data.{key} is blank: give a Hub dataset id or a local folder or file.")
            if data.get("objects") is not None:
                from ..loading.data import checked_objects

                data = {**data, "objects": checked_objects(data["objects"])}
            return cls(**{**options, **data})
        if isinstance(data, os.PathLike) or (isinstance(data, str) and looks_local(data)):
            return cls(path=os.fspath(data), **options)
        if isinstance(data, str):
            return cls(id=data, **options)
        from ..loading.data import checked_objects

        return cls(objects=checked_objects(data), **options)

    @property
    def source(self) -> Any:
        """What the data loader receives: the folder, the Hub id, or the objects."""
        return self.path if self.path is not None else self.id if self.id is not None else self.objects

    def to_dict(self, root: Path | None = None) -> dict[str, Any]:
        if self.objects is not None:
            out: dict[str, Any] = {IN_MEMORY: type(self.objects).__name__}
            digest = _content_hash(self.objects)
            if digest is not None:  # a re-run needs the same data: this says whether given ones are the same
                out["content"] = digest
            if _holds_text(self.objects):  # so the re-run error can ask for the same texts, not images
                out["samples"] = "texts"
        elif self.path is not None:
            out = {"path": _relative(self.path, root)}
        else:
            out = {"id": self.id}
        out.update(split=self.split, num_samples=self.num_samples)
        for key in ("image_column", "text_column", "max_length", "revision", "fingerprint"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass
class MergeConfig:
    """One merge (or scoring) run: inputs, method, parameters, data and options. Validated on construction.

    Example:
        ```python
        >>> from hf_mloss import MergeConfig
        >>> config = MergeConfig.from_yaml("examples/merge_clip_vit_b32_8tasks.yaml")
        >>> result = hf_mloss.run(config, device="cuda")
        >>> result.save_pretrained("merged")                   # writes merged/hf_mloss_config.yaml too
        >>> hf_mloss.run(MergeConfig.from_pretrained("merged"))        # the same merge, bit for bit
        ```
    """

    base: ModelSpec = param(help="The pretrained model the others were fine-tuned from.")
    models: list[ModelSpec] = param(help="The fine-tuned models to merge.")
    method: str = param("ties", "Registered merge method (hf-mloss methods).")
    parameters: dict[str, Any] = param(help="The method's parameters.", default_factory=dict)
    data: DataSpec | None = param(None, "Unlabeled images or texts (data-guided methods and scoring).")
    text_data: DataSpec | None = param(None, "Unlabeled text for the text tower of a whole two-tower model (a "
                                       "CLIPModel): the text tower is then scored too (strings, text file(s), folder "
                                       "or a datasets text split, as `data` takes for text families).")
    seed: int = param(0, "Seeds DARE masks, random ranks and data shuffling.", low=0, high=2**63 - 1)
    dtype: str | None = param(None, "dtype of the saved model (default: the base's).", choices=DTYPES)
    batch_size: int = param(16, "Images per scoring forward pass.", low=1, high=65536)
    compute_dtype: str = param("float32", "dtype of the scoring forward passes (bfloat16 where the CPU/GPU has it).",
                               choices=DTYPES)
    processor: Any = param(None, "Image processor, or tokenizer for text families (Hub id or folder); default: the "
                           "base's.")
    output: str = param("auto", "auto: the base's class (a full CLIPModel stays one); tower: the merged tower only; "
                        "adapter: a PEFT LoRA adapter (from LoRA adapter inputs).", choices=OUTPUTS)
    lora_rank: int | None = param(None, "output=adapter with combination=svd: the adapter's rank (default: the "
                                  "largest input rank; `rank` is M-TIES's row ranking).", low=1, high=2**20)
    combination: str | None = param(None, "output=adapter: cat (stacked factors, exact, linear methods) or svd "
                                    "(truncated SVD of each merged task vector); default: cat for linear methods.",
                                    choices=("cat", "svd"))
    score: ScoringOptions | None = param(None, "Options of `hf-mloss score` (prefix, reduction, ...).")
    select: SelectionOptions | None = param(None, "Choose the method's parameters on unlabeled data: criterion, "
                                            "grid, ... (see hf_mloss.merging.selection).")
    slices: Any = param(None, "Output layers from layer ranges of the inputs: [{sources: [{model: i, layer_range: "
                        "[start, end]}]}], model an index into [base, *models] (see hf_mloss.spec.slices).")
    tokenizer_source: Any = param(None, "The merge's vocabulary (text models): union (the base's tokens plus every "
                                  "token the models added), base, or a model (its index into [base, *models] or "
                                  "its name), or {source, tokens, pad_to_multiple_of} as mergekit's tokenizer: "
                                  "section; embedding and LM-head rows are aligned to it (hf_mloss.loading.vocab). "
                                  "Default: the base's, which every model must share.")
    hf_mloss_version: str | None = param(None, "Version that wrote the config.")
    threads: int | None = param(None, "Recorded by a CPU run: the threads it computed on. A re-run of the recipe "
                                "uses as many (at most the cores it may use) unless HF_MLOSS_THREADS is set: some "
                                "products' last bits depend on the thread count.", low=1, high=1_000_000)
    resolved_parameters: dict[str, Any] | None = param(None, "Recorded by a run whose parameters vary over the model: "
                                                        "each tensor's values (not read back).")

    def __post_init__(self) -> None:
        self.base = _as_model_spec(self.base, "base")
        if isinstance(self.models, (str, os.PathLike, ModelSpec)) or _is_loaded_model(self.models) or not isinstance(
                self.models, Sequence):
            raise InvalidParameterError(f"models must be a non-empty list of Hub ids, local folders or loaded models, "
                                        f"got {short(self.models)}.")
        self.models = [_as_model_spec(m, f"models[{i}]") for i, m in enumerate(self.models)]
        if isinstance(self.data, (Mapping, str, os.PathLike)):
            self.data = DataSpec.parse(self.data)
        if self.text_data is not None and not isinstance(self.text_data, DataSpec):
            self.text_data = parse_text_data(self.text_data)
        if isinstance(self.score, Mapping):
            self.score = _build(ScoringOptions, self.score, "score")
        if isinstance(self.select, Mapping):
            self.select = _build(SelectionOptions, self.select, "select.")
        self.validate()

    # ----------------------------------------------------------------------------------------------- checks
    def validate(self) -> None:
        """Check every field (no network; local paths must exist). Raises :class:`InvalidParameterError`."""
        validate_fields(self)
        if not self.models and not (self.method == "passthrough" and self.slices is not None):
            raise InvalidParameterError("models must be a non-empty list of fine-tuned models.")
        if self.base.weight is not None:
            raise InvalidParameterError("base.weight: the base has no weight; weights belong to the fine-tuned models.")
        for i, spec in enumerate([self.base, *self.models]):
            where = "base" if i == 0 else f"models[{i - 1}]"
            if not spec.is_loaded and (problem := missing_model(spec.model)):
                raise CheckpointNotFoundError(f"{where}: {problem}")
        self._validate_weights()
        if isinstance(self.processor, os.PathLike):
            self.processor = os.fspath(self.processor)
        if self.processor is not None and not (isinstance(self.processor, str) and self.processor.strip()) \
                and not callable(self.processor):
            raise InvalidParameterError(f"processor must be a Hub id, a folder with a preprocessor_config.json, or an "
                                        f"image processor or tokenizer object, got {short(self.processor)}.")
        method = self.merge_method()
        self.method = method.name
        self.parameters = _plain(self.parameters)
        try:
            self.method_params()
            check_schedules(method, self.parameters, selecting=self.select is not None)
        except InvalidParameterError as err:
            raise InvalidParameterError(f"Invalid parameters for method {self.method!r}: {err}") from None
        self._validate_required_parameters(method)
        self._validate_model_parameters(method)
        self._validate_text_data(method)
        self._validate_model_data(method)
        if method.needs_data and not self.has_data() and not self.has_data("text_data") \
                and not self.replays_recorded():
            raise DataError(
                f"Method {self.method!r} is data-guided and no data was given: pass data=... (a Hub dataset id such "
                "as tanganke/dtd, a local image folder, a datasets object or a list of images; ~128 unlabeled images "
                "suffice).")
        if self.select is not None:
            self._validate_selection(method)
        if getattr(method, "chooses_method", False):
            self._validate_auto()
        self._validate_adapter_output()
        self._validate_slices(method)
        self._validate_tokenizer_source(method)

    def _validate_auto(self) -> None:
        """``method="auto"``: heads, one per model; the options that compare candidates need data to compare on
        (without data auto merges TSV-M at λ = 1, so a choice among named candidates cannot be honoured)."""
        params = self.method_params()
        if params.heads is not None and len(params.heads) != len(self.models):
            raise InvalidParameterError(f"heads: got {len(params.heads)} for {len(self.models)} models; give one "
                                        "classification head per fine-tuned model, in the order of models.")
        if params.chooses and not self.has_data():
            given = [k for k in ("candidates", "budget", "heads") if self.parameters.get(k) is not None]
            if given:
                raise DataError(f"auto compares its candidates on unlabeled data and no data was given, so "
                                f"{', '.join(given)} cannot be honoured (without data auto merges TSV-M at its "
                                "default λ): pass data=..., or merge with the method you want directly.")
        if not params.chooses or not self.has_data():  # a recorded choice, or TSV-M without data: nothing to check
            return
        from ..methods import get_method
        from ..methods.auto import _settings, candidate_grids

        q = len(self.models)
        for name, grid in candidate_grids(params.candidates, params.budget).items():
            low, high = get_method(name).accepts_models
            if q < low or high is not None and q > high:
                count = f"exactly {low}" if low == high else f"at least {low}" if high is None else f"{low} to {high}"
                raise InvalidParameterError(f"candidates: {name} merges {count} fine-tuned model(s) and this run has "
                                            f"{q}: leave it out of the candidates.")
            fixed = _settings({k: v for k, v in grid.items() if k != "lam"})[0]
            try:  # its required parameters, its vocabulary rule...: what a merge with it alone would check
                self.replace(method=name, parameters=dict(fixed), select=None, text_data=None)
            except HfMLossError as err:
                raise type(err)(f"candidates: {name} cannot run in this recipe: {err}") from None

    def _validate_required_parameters(self, method: MergeMethod) -> None:
        """A parameter the method has no default for (nearswap's ``t``) is given: at the top level, or in every
        slice's own parameters."""
        for name, what in getattr(method, "required_parameters", {}).items():
            sliced = bool(self.slices) and all(isinstance(e, Mapping) and (e.get("parameters") or {}).get(name)
                                               is not None for e in self.slices)
            if self.parameters.get(name) is None and not sliced:
                raise InvalidParameterError(f"{method.name} needs {name}, {what}: a number, a gradient over the "
                                            "layers or a filter list.")

    def _validate_tokenizer_source(self, method: MergeMethod) -> None:
        if self.tokenizer_source is None:
            return
        from ..loading.vocab import VocabularyOptions

        names = [None if spec.is_loaded else spec.model for spec in [self.base, *self.models]]
        options = VocabularyOptions.parse(_plain(self.tokenizer_source), names)
        if method.needs_data or self.select is not None or self.output != "auto":
            raise InvalidParameterError(f"tokenizer_source aligns the vocabularies of a data-free merge written as a "
                                        f"whole model (output='auto'); got method {method.name!r}, output="
                                        f"{self.output!r}{', select' if self.select else ''}. Drop tokenizer_source, "
                                        "or merge data-free.")
        self.tokenizer_source = options.to_plain()

    def _validate_text_data(self, method: MergeMethod) -> None:
        if not self.has_data("text_data"):
            return
        if self.select is not None:
            raise InvalidParameterError("text_data scores a whole model's text tower in a merge or score(); label-free "
                                        "selection (select=...) measures the vision tower only: drop text_data or "
                                        "select.")
        if getattr(method, "chooses_method", False):
            if _is_vision_language(self.base):
                return  # the run refuses auto on a vision-language model, whatever its data (loading.inputs)
            raise InvalidParameterError("text_data is the scoring text of a data-guided merge (m_ties, m_dare) or of "
                                        "score(); auto compares its candidates on `data` through the vision tower "
                                        "only and would ignore it: drop text_data.")
        if not method.needs_data and self.score is None:
            raise InvalidParameterError(f"text_data is the scoring text of a data-guided merge (m_ties, m_dare) or of "
                                        f"score(); method {method.name!r} merges without data and would ignore it.")

    def _validate_slices(self, method: MergeMethod) -> None:
        from .slices import check_slices

        if self.slices is None:
            if method.name == "passthrough":
                raise InvalidParameterError("passthrough copies the layer ranges named by `slices` and merges "
                                            "nothing; give slices (e.g. slices: [{sources: [{model: 0, layer_range: "
                                            "[0, 4]}]}, ...]).")
            return
        if method.needs_data or self.select is not None or self.output != "auto":
            raise InvalidParameterError(f"slices work with data-free methods and output='auto' (got method "
                                        f"{method.name!r}, output={self.output!r}{', select' if self.select else ''}).")
        specs = [self.base, *self.models]
        self.slices = check_slices(_plain(self.slices), method.name, len(specs), [_layer_count(m) for m in specs],
                                   [_short_name(m) for m in specs])
        for s, entry in enumerate(self.slices):
            if "parameters" not in entry:
                continue
            try:
                scalar_parameters(method, {**self.parameters, **entry["parameters"]})
                check_schedules(method, {**self.parameters, **entry["parameters"]}, selecting=False)
            except InvalidParameterError as err:
                raise InvalidParameterError(f"slices[{s}].parameters: {err}") from None

    def _validate_adapter_output(self) -> None:
        from ..loading.lora import LINEAR_METHODS, is_linear_merge

        if self.output != "adapter":
            if self.lora_rank is not None or self.combination is not None:
                raise InvalidParameterError(f"lora_rank and combination describe an adapter output; pass "
                                            f"output='adapter' (got output={self.output!r}).")
            return
        if self.combination == "cat" and not is_linear_merge(self.method, self.parameters):
            what = ("is calibrated after the merge (calibrate=...)" if self.method in LINEAR_METHODS else
                    "trims, elects signs or drops entries")
            raise InvalidParameterError(
                f"combination='cat' is exact only for linear methods ({', '.join(LINEAR_METHODS)}); {self.method!r} "
                f"{what}, so its merge is not a stack of the inputs' factors. Use combination='svd' (with "
                "lora_rank=...).")
        if self.combination == "cat" and self.lora_rank is not None:
            raise InvalidParameterError("combination='cat' writes the sum of the input ranks; lora_rank= applies to "
                                        "combination='svd' only.")

    def _validate_selection(self, method: MergeMethod) -> None:
        if getattr(method, "learned", False):
            raise InvalidParameterError(f"Method {method.name!r} learns its coefficients on the data itself; "
                                        "label-free selection (select=...) does not apply: drop select.")
        if not self.has_data():
            raise DataError("Label-free selection scores every candidate on unlabeled data and no data was given: "
                            "pass data=... (images for image families: a Hub dataset id, a local image folder or "
                            "images; texts for text families: a list of strings, a text file or a Hub text split; "
                            "~32 samples suffice).")
        check_selection(self.select, method, self.parameters, len(self.models))
        for share in self.select.shares or ():
            DataSpec.parse(share)
        if self.select.shares and any(m.data is not None for m in self.models):
            raise InvalidParameterError("select.shares and the models' own `data` both give each model's samples; "
                                        "give them one way (the models' own data: the selection compares each model "
                                        "with its own).")

    def _validate_model_data(self, method: MergeMethod) -> None:
        """Each model's own ``data`` / ``text_data``: covering every model where the method reads each model's own data
        (refused, naming them, where some have none and no shared data covers them), leaving the shared data something
        to serve, compared with its own model alone (not ``share="all"``). A data-free merge never reads it (the
        driver warns)."""
        if self.base.data is not None or self.base.text_data is not None:
            raise InvalidParameterError("base.data: the base has no data of its own; the data every model shares is "
                                        "the top-level `data` (a fine-tune's own data goes in its `models` entry).")
        use = self.data_mode()
        for key, shared in (("data", self.data), ("text_data", self.text_data)):
            own = [i for i, m in enumerate(self.models) if getattr(m, key) is not None]
            if not own:
                continue
            first = f"models[{own[0]}] ({self.models[own[0]].label})"
            if len(own) == len(self.models) and shared is not None:
                raise InvalidParameterError(f"`{key}` is the shared pool of the models that have no {key} of their own, "
                                            f"and every model has its own: the shared `{key}` would never be read. "
                                            f"Drop it, or a model's own.")
            share = self.select.share if self.select is not None else getattr(self.method_params(), "share", None)
            if use == "own" and share == "all":
                raise InvalidParameterError(f"share='all' compares every sample with every model, and {first} has data "
                                            "of its own, which is compared with that model alone: leave share at "
                                            "'auto' (each model's own data with that model; the shared data, if any, "
                                            "routed among the models without their own).")
            missing = [i for i in range(len(self.models)) if i not in own]
            if missing and shared is None and use == "own" and not self.replays_recorded():
                names = ", ".join(f"models[{i}] ({self.models[i].label})" for i in missing[:3])
                more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                raise DataError(f"{self._own_data_reader(method)} reads each model's own {key}, and {names}{more} "
                                f"{'has' if len(missing) == 1 else 'have'} none while {first} has its own; give every "
                                f"model its own {key}, or a shared `{key}=` for those without.")

    def _own_data_reader(self, method: MergeMethod) -> str:
        if self.select is not None:
            return "Label-free selection"
        return f"{method.pretty_name} ({method.name})"

    def data_mode(self) -> str | None:
        """How the run reads unlabeled data: ``"own"`` (each model with its own data: RegMean's Grams, a learned
        merge's objective, ``auto``'s or label-free selection's comparison with each model), ``"union"`` (one pool:
        M-TIES, M-DARE, scoring, compatibility read the union of the models' data) or ``None`` (none)."""
        method = self.merge_method()
        if self.select is not None or getattr(method, "reads_own_data", False):
            return "own"
        if method.needs_data or self.score is not None:
            return "union"
        return None

    def share_specs(self, num_samples: int) -> list[DataSpec]:
        """Label-free selection's ``select.shares`` as data specs of ``num_samples`` samples each."""
        return [DataSpec.parse(share, num_samples=num_samples) for share in (self.select.shares or ())]

    def has_data(self, key: str = "data") -> bool:
        """Whether the run has ``key`` (``data`` or ``text_data``): shared, or some model's own."""
        return getattr(self, key) is not None or any(getattr(m, key) is not None for m in self.models)

    def _validate_weights(self) -> None:
        for i, spec in enumerate(self.models):  # a per-model weight schedule: every value a number float32 holds
            if spec.parameters and "weight" in spec.parameters:
                where = f"models[{i}].parameters.weight"
                for leaf in ParamSchedule.parse(spec.parameters["weight"], where).leaves():
                    if isinstance(leaf, bool) or not isinstance(leaf, (int, float)) or not is_finite(leaf):
                        raise InvalidParameterError(f"{where} names {short(leaf)}: weights are finite numbers.")
                    check_float32(where, float(leaf))
        given = [m.run_weight is not None for m in self.models]
        if any(given) and not all(given):
            missing = [f"models[{i}]" for i, g in enumerate(given) if not g]
            raise InvalidParameterError(f"Give a weight to every model or to none (the default is uniform); "
                                        f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} no weight.")
        negative = [(i, w) for i, m in enumerate(self.models) for w in _weight_values(m) if w < 0]
        signed = negative and getattr(self.merge_method(), "signed_weights", False)
        if negative and not signed:
            i, w = negative[0]
            from ..methods import MERGE_METHODS

            takers = sorted(n for n, m in MERGE_METHODS.items() if getattr(m, "signed_weights", False))
            raise InvalidParameterError(f"models[{i}].weight is {w}: a negative weight (task negation) is taken by "
                                        f"{', '.join(takers)}, which adds the weighted task vectors as they are; "
                                        f"method {self.method!r} needs weights >= 0.")
        if any(m.weight is None and m.parameters and "weight" in m.parameters for m in self.models):
            return  # weights that vary over the model: their sums are per tensor
        total = sum(m.run_weight for m in self.models) if self.models and all(given) else None
        if total is not None and (total <= 0 if not signed else all(m.run_weight == 0 for m in self.models)):
            raise InvalidParameterError("The models' weights must not all be 0." if not negative else
                                        f"The models' weights sum to {total:g}; method {self.method!r} needs a "
                                        "positive sum.")
        if all(given) and not math.isfinite(sum(m.run_weight for m in self.models)):
            raise InvalidParameterError(f"weights {[m.run_weight for m in self.models]} sum to infinity (they "
                                        "overflow once added or normalised); scale them all down by the same factor.")

    def _validate_model_parameters(self, method: MergeMethod) -> None:
        """Per-model parameters: names the method reads per model, values its rules accept, in runs that honour them."""
        if self.base.parameters:
            raise InvalidParameterError("base.parameters: the base has no per-model parameters; they belong to the "
                                        "fine-tuned models.")
        given = [(i, m.parameters) for i, m in enumerate(self.models) if m.parameters]
        if not given:
            return
        allowed = method.per_model_params
        if method.needs_data or self.select is not None or not allowed:
            why = ("is data-guided" if method.needs_data else "selects one value per parameter" if self.select
                   is not None else "reads no parameter per model")
            raise InvalidParameterError(f"models[{given[0][0]}].parameters: method {self.method!r} {why}; give the "
                                        "parameters once under `parameters` (and weights as `weight`).")
        scalars, schedules = split_parameters(method, self.parameters)
        firsts = {k: s.leaves()[0] for k, s in schedules.items()}
        for i, values in given:
            where = f"models[{i}].parameters"
            unknown = sorted(set(values) - set(allowed))
            if unknown:
                raise InvalidParameterError(f"{where} {unknown}: method {self.method!r} reads {list(allowed)} per "
                                            "model.")
            if "weight" in values and self.models[i].weight is not None:
                raise InvalidParameterError(f"models[{i}] has both `weight` and `parameters.weight`; give one.")
            parsed = {k: ParamSchedule.parse(v, f"{where}.{k}") for k, v in values.items()}
            own = {k: s.leaves()[0] for k, s in parsed.items() if k != "weight"}
            for key, schedule in parsed.items():
                for leaf in schedule.leaves():
                    if key == "weight":  # numbers in float32's range (_validate_weights)
                        continue
                    try:
                        params = method.make_params(**{**scalars, **firsts, **own, key: leaf})
                    except InvalidParameterError as err:
                        raise InvalidParameterError(f"{where}.{key} names {leaf!r}: {err}") from None
                    if getattr(params, "resolved_scope", "tensor") == "global":
                        raise InvalidParameterError(f"{where}.{key}: per-model values need scope: tensor (a global "
                                                    "trim has one threshold per task vector over the whole model).")

    def merge_method(self) -> MergeMethod:
        from ..methods import get_method

        return get_method(self.method)

    def method_params(self) -> MethodParams:
        """The method's validated parameters (defaults filled in; per-layer/per-tensor values at their default)."""
        return scalar_parameters(self.merge_method(), self.parameters)

    def replays_recorded(self) -> bool:
        """Whether this run merges from learned values its recipe records (AdaMerging's ``coefficients``, AdaRank's
        ``masks``) without training: its data is then never read, so it may be absent."""
        return _replays_recorded(self.method, self.parameters)

    def scoring_options(self) -> ScoringOptions:
        return self.score or ScoringOptions()

    @property
    def weights(self) -> list[float] | None:
        return [m.run_weight for m in self.models] if self.models and self.models[0].run_weight is not None else None

    def input_paths(self) -> list[str]:
        """Every local path this run reads: base, models, processor, data, selection heads and shares, and the
        local base folder a LoRA adapter names (an output must not be any of them, inside one or hold one)."""
        paths: list[Any] = [spec.model for spec in [self.base, *self.models] if spec.is_local]
        from ..loading.lora import declared_base_folder

        paths += [f for spec in self.models if spec.is_local and (f := declared_base_folder(spec.model)) is not None]
        if isinstance(self.processor, (str, os.PathLike)) and looks_local(os.fspath(self.processor)):
            paths.append(self.processor)
        owned = [getattr(m, key) for m in self.models for key in ("data", "text_data")]
        for spec in (self.data, self.text_data, *owned):
            if spec is not None and spec.path is not None:
                paths.append(spec.path)
        heads = self.parameters.get("heads")
        paths += [h for h in heads if isinstance(h, (str, os.PathLike))] if isinstance(heads, (list, tuple)) else []
        if self.select is not None:
            paths += [h for h in self.select.heads or () if isinstance(h, (str, os.PathLike))]
            for share in self.select.shares or ():
                if isinstance(share, DataSpec) and share.path is not None:
                    paths.append(share.path)
                elif isinstance(share, (str, os.PathLike)) and looks_local(os.fspath(share)):
                    paths.append(share)
                elif isinstance(share, Mapping) and isinstance(share.get("path"), str):
                    paths.append(share["path"])
        return [os.fspath(p) for p in paths]

    # ----------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_kwargs(cls, base: Any, models: Any, method: str = "ties", *, weights: Sequence[float] | None = None,
                    revision: str | Sequence[str | None] | None = None, data: Any = None, text_data: Any = None,
                    score: ScoringOptions | Mapping[str, Any] | None = None, **options: Any) -> MergeConfig:
        """The config of a :func:`hf_mloss.merge` call (same arguments): ``options`` are data options (the fields of
        :class:`DataSpec`: ``num_samples``, ``split``, ``image_column``...), config fields (``seed``, ``dtype``,
        ``batch_size``...) or the method's parameters.

        Example:
            ```python
            >>> config = MergeConfig.from_kwargs("org/base", ["org/ft-a", "org/ft-b"], "ties", k=0.3, seed=1)
            >>> config.to_yaml("merge.yaml")
            ```
        """
        if isinstance(models, (str, os.PathLike)) or _is_loaded_model(models) or not isinstance(models, Sequence):
            raise InvalidParameterError(f"models must be a non-empty list of Hub ids, local folders or loaded models, "
                                        f"got {short(models)}.")
        recorded = sorted(RECORDED_FIELDS & set(options))
        if recorded:
            raise InvalidParameterError(f"{recorded}: a run records these in its recipe; they are not options. Drop "
                                        "them (to re-run a recipe: hf_mloss.MergeConfig.from_yaml(path)).")
        fields = {f.name for f in dataclasses.fields(cls)}
        data_fields = {f.name for f in dataclasses.fields(DataSpec)} - {"id", "path", "objects", "revision",
                                                                        "fingerprint"}
        data_options = {k: options.pop(k) for k in list(options) if k in data_fields}
        given = options.pop("parameters", None)
        config_options = {k: v for k, v in options.items() if k in fields}
        parameters = {k: v for k, v in options.items() if k not in fields}
        if given is not None:  # the method's parameters as one mapping, as a YAML recipe's `parameters:`
            if not isinstance(given, Mapping) or not all(isinstance(k, str) for k in given):
                raise InvalidParameterError(f"parameters must be a mapping of the method's parameters, e.g. "
                                            f"parameters={{'k': 0.2}} (or k=0.2 as a keyword), got {short(given)}.")
            twice = sorted(set(given) & set(parameters))
            if twice:
                raise InvalidParameterError(f"{twice} given both in parameters= and as keywords; give each once.")
            parameters = {**given, **parameters}
        text_options = {k: v for k, v in data_options.items() if k != "image_column"}
        texts = text_data is not None or any(isinstance(m, Mapping) and m.get("text_data") is not None
                                             for m in models)
        if texts:  # the text options (text_column, max_length) describe the text, not the images
            data_options = {k: v for k, v in data_options.items() if k not in TEXT_ONLY_OPTIONS}
        for run_options in (data_options, text_options):  # checked as the run's, not blamed on a model's own data
            if run_options:
                DataSpec(id="options", **run_options)
        specs = [_as_model_spec(m, "base" if i == 0 else f"models[{i - 1}]", data_options, text_options)
                 for i, m in enumerate([base, *models])]
        _spread(specs, "revision", revision, per_model_hint="base first; None for folders and loaded models")
        if weights is not None and any(spec.weight is not None for spec in specs[1:]):
            raise InvalidParameterError("weights= and a `weight` in a models entry both give the models' weights; "
                                        "give them one way.")
        _spread(specs[1:], "weight", weights, per_model_hint="the base has none")
        data_spec = None if data is None else DataSpec.parse(data, **data_options)
        text_spec = None if text_data is None else parse_text_data(text_data, **text_options)
        return cls(base=specs[0], models=specs[1:], method=method, parameters=parameters, data=data_spec,
                   text_data=text_spec, score=score, **config_options)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], base_dir: str | os.PathLike[str] | None = None) -> MergeConfig:
        """Build and validate a config from a dict with the YAML schema (or mergekit's).

        Args:
            config: the parsed YAML (``base``, ``models``, ``method``, ``parameters``, ``data``, ``seed``...).
            base_dir: folder that relative local paths resolve against (``from_yaml`` passes the file's folder).

        Raises:
            ConfigError: naming the field, the value and the valid choices.
        """
        try:
            return cls._from_dict(config, Path(base_dir) if base_dir is not None else None)
        except ConfigError:
            raise
        except HfMLossError as err:
            raise ConfigError(str(err)) from None

    @classmethod
    def _from_dict(cls, config: Any, root: Path | None) -> MergeConfig:
        if not isinstance(config, Mapping):  # the content is not echoed: a wrong file may hold a secret
            raise ConfigError(f"A merge config must be a mapping with keys such as 'base' and 'models'; this one "
                              f"holds a {type(config).__name__} (is it the right file?).")
        _refuse_tokens(config, "")
        if _is_moe_recipe(config):
            raise ConfigError(_moe_recipe(None))
        if "merge_method" in config:
            from .mergekit import from_mergekit

            config = from_mergekit(config)
        config = _migrate(config)
        check_keys(config, [f.name for f in dataclasses.fields(cls)], "top-level key", error=ConfigError)
        for key in ("base", "models"):
            if key not in config:
                raise ConfigError(f"Missing required key {key!r}: name the base model (`base: org/name`) and the "
                                  "fine-tuned models (`models: [org/ft-a, org/ft-b]`).")
        if not isinstance(config["models"], list):
            raise ConfigError(f"models must be a list of Hub ids or local folders (or {{model: ..., weight: ...}} "
                              f"entries), got {short(config['models'])}.")
        values = dict(config)
        replays = _replays_recorded(config.get("method", "ties"), config.get("parameters"))
        values["base"] = _parse_model(config["base"], "base", root)
        values["models"] = [_parse_model(m, f"models[{i}]", root, replays=replays)
                            for i, m in enumerate(config["models"])]
        for key in ("data", "text_data"):  # data passed from Python that a replay of recorded values never reads
            if isinstance(config.get(key), Mapping) and IN_MEMORY in config[key] and replays:
                values.pop(key)
        if values.get("data") is not None:
            values["data"] = _parse_data(config["data"], root)
        if values.get("text_data") is not None:
            values["text_data"] = _parse_data(config["text_data"], root, key="text_data")
        if config.get("score") is not None:
            values["score"] = _build(ScoringOptions, _mapping(config["score"], "score"), "score.")
        if config.get("select") is not None:
            values["select"] = _parse_select(_mapping(config["select"], "select"), root)
        if values.get("parameters") is None:
            values["parameters"] = {}
        values["parameters"] = _mapping(values["parameters"], "parameters")
        heads = values["parameters"].get("heads")
        if isinstance(heads, list):  # a learned merge's or auto's head files: relative to the recipe, as data is
            values["parameters"] = {**values["parameters"],
                                    "heads": [_absolute(h, root) if isinstance(h, str) else h for h in heads]}
        if isinstance(values.get("processor"), str) and looks_local(values["processor"]):
            values["processor"] = _absolute(values["processor"], root)
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> MergeConfig:
        """Read and validate a YAML config (ours or mergekit's); relative paths resolve against its folder.

        Raises:
            ConfigError: the file is missing, too large, not YAML, or describes an invalid merge.
        """
        from .._yaml import load_yaml

        path = Path(path)
        content = load_yaml(path, max_bytes=MAX_CONFIG_BYTES)
        if _is_moe_recipe(content):
            raise ConfigError(_moe_recipe(path))
        try:
            return cls.from_dict(content, base_dir=path.resolve().parent)
        except ConfigError as err:
            raise ConfigError(f"Invalid config {str(path)!r}: {err}") from None

    @classmethod
    def from_pretrained(cls, folder_or_repo_id: str | os.PathLike[str], *, revision: str | None = None,
                        token: str | bool | None = None, allow_local_paths: bool = False) -> MergeConfig:
        """The config saved with a merged model: a local folder, or a Hub repo (its ``hf_mloss_config.yaml``).

        A recipe from a Hub repo was written by someone else: it may name only Hub models and datasets. Local,
        absolute or ``../`` paths in it are refused (naming the key) unless ``allow_local_paths=True``.

        Example:
            ```python
            >>> hf_mloss.run(MergeConfig.from_pretrained("me/clip-vit-b32-8tasks-mties"))   # re-run a published merge
            ```
        """
        local = Path(os.fspath(folder_or_repo_id)).expanduser()
        if local.is_dir():
            path = local / MERGE_CONFIG_NAME
            if not path.is_file() and (local / MOE_CONFIG_NAME).is_file():
                raise ConfigError(_moe_recipe(local / MOE_CONFIG_NAME))
            if not path.is_file():
                raise ConfigError(f"{str(local)!r} has no {MERGE_CONFIG_NAME}: it was not written by hf_mloss.")
            return cls.from_yaml(path)
        from .._yaml import load_yaml
        from ..loading.hub import download_file

        try:
            path = Path(download_file(os.fspath(folder_or_repo_id), MERGE_CONFIG_NAME, revision=revision, token=token))
        except CheckpointNotFoundError:
            try:  # an MoE that `hf-mloss moe` built and pushed holds its own recipe
                moe = download_file(os.fspath(folder_or_repo_id), MOE_CONFIG_NAME, revision=revision, token=token)
            except CheckpointNotFoundError:
                moe = None
            if moe is not None:
                raise ConfigError(_moe_recipe(Path(moe), f"Hub repo {os.fspath(folder_or_repo_id)!r} holds")) \
                    from None
            raise
        if not allow_local_paths:
            content = load_yaml(path, max_bytes=MAX_CONFIG_BYTES)
            for key, value in _local_paths(content, path.resolve().parent):
                raise ConfigError(f"The recipe of Hub repo {os.fspath(folder_or_repo_id)!r} names a local path at "
                                  f"{key} ({short(value)}); a recipe from the Hub may name only Hub models and "
                                  "datasets. Pass allow_local_paths=True if you trust it and mean your own files.")
        return cls.from_yaml(path)

    # ----------------------------------------------------------------------------------------------- output
    def to_dict(self, root: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """The config in the YAML schema; local paths relative to ``root`` when given (where the file will live)."""
        base = Path(os.path.abspath(root)) if root is not None else None
        out: dict[str, Any] = {"hf_mloss_version": self.hf_mloss_version} if self.hf_mloss_version else {}
        parameters = _plain(self.parameters)
        if isinstance(parameters.get("heads"), list):
            parameters["heads"] = [_relative(h, base) if isinstance(h, str) else h for h in parameters["heads"]]
        out.update(base=self.base.to_dict(base), models=[m.to_dict(base) for m in self.models], method=self.method,
                   parameters=parameters, seed=self.seed)
        if self.data is not None:
            out["data"] = self.data.to_dict(base)
        if self.text_data is not None:
            out["text_data"] = self.text_data.to_dict(base)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key in ("dtype", "batch_size", "compute_dtype", "output", "lora_rank", "combination"):
            if getattr(self, key) != defaults[key]:
                out[key] = getattr(self, key)
        if isinstance(self.processor, str):
            out["processor"] = _relative(self.processor, base) if looks_local(self.processor) else self.processor
        if self.score is not None:
            out["score"] = self.score.to_dict()
        if self.select is not None:
            out["select"] = _selection_to_dict(self.select, base)
        if self.slices is not None:
            out["slices"] = _plain(self.slices)
        if self.tokenizer_source is not None:
            out["tokenizer_source"] = _plain(self.tokenizer_source)
        if self.threads is not None:
            out["threads"] = self.threads
        if self.resolved_parameters:
            out["resolved_parameters"] = self.resolved_parameters
        return out

    def to_yaml(self, path: str | os.PathLike[str] | None = None, *, root: str | os.PathLike[str] | None = None,
                overwrite: bool = False) -> str:
        """The config as YAML text; also written to ``path`` when given (atomic, never through a link, never over
        one of the config's inputs; an existing file is replaced only with ``overwrite``).

        Local paths are written relative to ``root`` (default: the folder of ``path``), so the file re-runs from
        where it lives; without either they are absolute.
        """
        import yaml

        if root is None and path is not None:
            root = Path(path).resolve().parent
        text = yaml.safe_dump(self.to_dict(root), sort_keys=False, allow_unicode=True)
        if path is not None:
            from ..saving import write_file

            write_file(path, text, overwrite=overwrite, protected=self.input_paths(), what="Config file")
        return text

    def save_pretrained(self, save_directory: str | os.PathLike[str], *,
                        location: str | os.PathLike[str] | None = None, overwrite: bool = False) -> Path:
        """Write ``hf_mloss_config.yaml`` into ``save_directory`` (created if needed; an existing file is replaced
        only with ``overwrite``).

        ``location``: where the folder will finally live, when it is written elsewhere first (local paths are
        written relative to it).
        """
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / MERGE_CONFIG_NAME
        self.to_yaml(path, root=Path(os.path.abspath(location or folder)), overwrite=overwrite)
        return path

    def replace(self, **changes: Any) -> MergeConfig:
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------------------------------- parsing
def _is_moe_recipe(content: Any) -> bool:
    """Whether a recipe is mergekit-moe's (``base_model`` and ``experts``, nothing a merge recipe holds)."""
    return isinstance(content, Mapping) and "experts" in content and not {"merge_method", "models", "slices"} & \
        set(content)


def _moe_recipe(path: Path | None, where: str | None = None) -> str:
    """The one line that names an MoE recipe (mergekit-moe's ``base_model`` and ``experts``) given to a merge run."""
    where = where or (f"{str(path)!r} is" if path is not None else "This config is")
    command = f"hf-mloss moe {path} OUT_DIR" if path is not None else "hf-mloss moe CONFIG.yaml OUT_DIR"
    return (f"{where} an MoE recipe (mergekit-moe's base_model and experts), not a merge: build it with `{command}` "
            "(Python: hf_mloss.build_moe).")


def _layer_count(spec: ModelSpec) -> int | None:
    """A model's block count where it is known without loading it: a loaded model's config, a local folder's
    config.json (Hub models: checked once resolved)."""
    import json

    from .slices import num_layers_of

    if spec.is_loaded:
        config = getattr(spec.model, "config", None)
        return num_layers_of(config.to_dict()) if hasattr(config, "to_dict") else None
    if not spec.is_local:
        return None
    try:
        return num_layers_of(json.loads((expand(spec.model) / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def _is_vision_language(spec: ModelSpec) -> bool:
    """Whether a model is known, without loading it, to be a vision-language model (a loaded model's config, a local
    folder's config.json; a Hub model is checked once resolved)."""
    import json

    if spec.is_loaded:
        model_type = getattr(getattr(spec.model, "config", None), "model_type", None)
    elif spec.is_local:
        try:
            model_type = json.loads((expand(spec.model) / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            return False
    else:
        return False
    from types import SimpleNamespace

    from ..loading.classes import is_vision_language

    return isinstance(model_type, str) and is_vision_language(SimpleNamespace(model_type=model_type))


def _short_name(spec: ModelSpec) -> str:
    """A model's name in messages: its folder's or repo's last part."""
    return "" if spec.is_loaded else os.path.basename(os.path.normpath(str(spec.model)))


def _weight_values(spec: ModelSpec) -> list[float]:
    """Every weight a model gives: its ``weight``, or each value of its per-model ``weight`` schedule."""
    if spec.weight is not None:
        return [spec.weight]
    if spec.parameters and "weight" in spec.parameters:
        try:
            leaves = ParamSchedule.parse(spec.parameters["weight"], "parameters.weight").leaves()
        except InvalidParameterError:
            return []  # refused with its own message by the per-model checks
        return [float(v) for v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return []


def _replays_recorded(method_name: Any, parameters: Any) -> bool:
    """Whether a learned method merges from values its parameters record, without training (never raises: an
    invalid method or parameter is refused by the config's own checks)."""
    from ..methods import get_method

    try:
        method = get_method(method_name)
        if not getattr(method, "learned", False) or not isinstance(parameters, Mapping):
            return False
        return not scalar_parameters(method, _plain(dict(parameters))).learns
    except (HfMLossError, TypeError):
        return False


def _as_model_spec(value: Any, where: str, data_options: Mapping[str, Any] | None = None,
                   text_options: Mapping[str, Any] | None = None) -> ModelSpec:
    """A model of :func:`hf_mloss.merge`: a Hub id, a folder, a loaded model, or a mapping as a recipe's ``models``
    entry (``{"model": ..., "weight": ..., "data": ..., "num_samples": ..., "text_data": ...}``); ``data_options`` /
    ``text_options``: the run's data options (``num_samples``, ``split``...), which a model's own data takes too."""
    if isinstance(value, ModelSpec):
        return value
    if value is None:
        raise InvalidParameterError(f"{where} is required: a Hub id (org/name), a local folder or a loaded model.")
    if hasattr(value, "peft_config") and hasattr(value, "merge_and_unload"):
        raise InvalidParameterError(f"{where} is a loaded PeftModel; pass its adapter folder (model.save_pretrained("
                                    "folder)) to merge it as an adapter, or model.merge_and_unload() to pass the model.")
    if isinstance(value, Mapping):
        entry = dict(value)
        check_keys(entry, MODEL_ENTRY_KEYS, f"key in {where}")
        if "model" not in entry:
            raise InvalidParameterError(f"{where} has no `model` key: write {{'model': 'org/name', 'data': ...}}, got "
                                        f"{short(entry)}.")
        try:
            _own_data(entry, dict(data_options or {}), dict(text_options or {}),
                      lambda key, value, options: _model_data(value, key, **options))
            return ModelSpec(**entry)
        except HfMLossError as err:
            raise type(err)(f"{where} ({_entry_label(entry['model'])}): {err}") from None
    try:
        return ModelSpec(model=value)
    except InvalidParameterError as err:
        raise InvalidParameterError(f"{where}: {err}") from None


MODEL_ENTRY_KEYS = (*(f.name for f in dataclasses.fields(ModelSpec)), "num_samples")
"""The keys of a ``models`` entry (Python mapping or YAML): :class:`ModelSpec`'s fields, and ``num_samples`` (how many
samples of the model's own data are read; default: the run's ``num_samples``)."""


def _own_data(entry: dict[str, Any], data_options: dict[str, Any], text_options: dict[str, Any], parse) -> None:
    """Parse a ``models`` entry's own ``data`` / ``text_data`` in place with ``parse(key, value, options)``; the
    entry's ``num_samples`` wins over the run's (a data mapping's own, if it differs, is refused)."""
    count = entry.pop("num_samples", None)
    if count is not None and entry.get("data") is None and entry.get("text_data") is None:
        raise InvalidParameterError("num_samples is the number of samples of the model's own data, and this entry "
                                    "has no `data` (or `text_data`): give the model's data, or set num_samples for "
                                    "the shared `data`.")
    for key in ("data", "text_data"):
        inner = entry.get(key).get("num_samples") if isinstance(entry.get(key), Mapping) else None
        if count is not None and inner is not None and inner != count:
            raise InvalidParameterError(f"num_samples is given twice, {count!r} in the entry and {inner!r} in its "
                                        f"`{key}`: give it once.")
    for key, options in (("data", data_options), ("text_data", text_options)):
        if entry.get(key) is None or isinstance(entry[key], DataSpec) and count is None:
            continue
        spec = entry[key] if isinstance(entry[key], DataSpec) else parse(key, entry[key], options)
        entry[key] = dataclasses.replace(spec, num_samples=count) if count is not None else spec


def _model_data(value: Any, key: str, **options: Any) -> DataSpec:
    """A model's own ``data`` (or ``text_data``) as a :class:`DataSpec`, refused when empty."""
    if _is_empty(value):
        raise DataError(f"{key} is empty: give this model's own unlabeled {'texts' if key == 'text_data' else 'data'} "
                        "(a Hub dataset id, a folder or file, a datasets split, a list of images or texts, a tensor), "
                        f"or leave `{key}` out to use the shared `{key}`.")
    try:
        return parse_text_data(value, **options) if key == "text_data" else DataSpec.parse(value, **options)
    except DataError as err:
        message = str(err)
        raise DataError(message if message.startswith(key) else f"{key}: {message}") from None


def _is_empty(value: Any) -> bool:
    """Whether data given from Python holds no sample: an empty string, list or mapping, a tensor or dataset of 0
    rows, tokenised inputs of 0 sequences."""
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, (list, tuple)):
        return not value
    if isinstance(value, Mapping):
        from ..loading.model_inputs import as_model_inputs

        given = as_model_inputs(value)
        if given is None and value.get("objects") is not None:  # a data spec holding the samples themselves
            return _is_empty(value["objects"])
        return not value or given is not None and len(given) == 0
    shape = getattr(value, "shape", None)
    if shape is not None:
        return len(shape) > 0 and shape[0] == 0
    try:
        return len(value) == 0
    except TypeError:  # a stream (IterableDataset): its size is not known before it is read
        return False


def _entry_label(model: Any) -> str:
    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model)
        return os.path.basename(os.path.normpath(name)) if looks_local(name) else name
    return getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__


def _parse_model(entry: Any, where: str, root: Path | None, *, replays: bool = False) -> ModelSpec:
    if isinstance(entry, str):
        entry = {"model": entry}
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where} must be a Hub id or local folder (a string) or a mapping such as "
                          f"{{model: org/name, weight: 0.5}}, got {short(entry)}.")
    if IN_MEMORY in entry:
        raise ConfigError(f"{where} was a model passed from Python ({short(entry[IN_MEMORY])}) when this config was "
                          "written; replace it with its Hub id or folder (`model: ...`) to re-run.")
    check_keys(entry, MODEL_ENTRY_KEYS, f"key in {where}", error=ConfigError)
    if "model" not in entry:
        raise ConfigError(f"{where} has no `model` key: write {{model: org/name}}, got {short(dict(entry))}.")
    values = dict(entry)
    if isinstance(values["model"], str):
        if not values["model"].strip():
            raise ConfigError(f"{where}.model must be a Hub id or a local folder, got ''.")
        if root is not None and (problem := missing_model(values["model"], root)):  # said with the config's folder
            relative = "" if expand(values["model"]).is_absolute() else \
                f" Relative paths in this config resolve against its folder, {str(root)!r}."
            raise ConfigError(f"{where}: {problem}{relative}")
        values["model"] = _resolve_model_path(values["model"], root)
    for key in ("data", "text_data"):  # data passed from Python that a replay of recorded values never reads
        if isinstance(values.get(key), Mapping) and IN_MEMORY in values[key] and replays:
            values.pop(key)
    try:
        _own_data(values, {}, {}, lambda key, value, _: _parse_data(value, root, key=f"{where}.{key}", own=True))
    except ConfigError:
        raise
    except HfMLossError as err:  # the entry's own num_samples, checked as its data's
        raise ConfigError(f"{where}: {err}") from None
    return _build(ModelSpec, values, f"{where}.")


TEXT_ONLY_OPTIONS = ("text_column", "max_length")
"""Data options that describe text: with ``text_data=`` given they go to it, not to the images of ``data=``."""


def parse_text_data(value: Any, **options: Any) -> DataSpec:
    """``text_data=`` as a :class:`DataSpec`: whatever ``data=`` takes for a text family (strings, a text or data
    file, a folder of text files, a Hub dataset id, a ``datasets`` text split, a mapping of DataSpec fields).

    Raises:
        DataError: empty, images, or a path that does not exist (naming ``text_data``).
    """
    if isinstance(value, DataSpec):
        spec = value
    else:
        if isinstance(value, (list, tuple)) and not value:
            raise DataError("text_data is an empty list: pass at least one string (texts for the text tower), a "
                            "text file, a folder of .txt files or a datasets text split.")
        if isinstance(value, str) and not value.strip():
            raise DataError("text_data is an empty string: pass a text file, a folder of .txt files, a Hub dataset "
                            "id or a list of strings.")
        if isinstance(value, (str, os.PathLike)):
            from ..loading.data import DATA_FILE_SUFFIXES

            path = expand(os.fspath(value))
            local = isinstance(value, os.PathLike) or looks_local(os.fspath(value)) or \
                path.suffix.lower() in DATA_FILE_SUFFIXES
            if local and not path.exists():
                raise DataError(f"text_data {os.fspath(value)!r} does not exist: pass a text file (.txt, one sample "
                                "per line; .jsonl/.csv/.parquet with a text column), a folder of .txt files, a Hub "
                                "dataset id or a list of strings.")
            if local:
                value = {"path": os.fspath(value)}
        if type(value).__name__ == "Tensor":
            raise DataError("text_data is a tensor; it takes text for the text tower (a list of strings, a text "
                            "file or folder, a datasets text split). Images go to data=.")
        try:
            spec = DataSpec.parse(value, **options)
        except DataError as err:
            raise DataError(f"text_data: {err}".replace("data.path", "text_data.path")) from None
    if spec.image_column is not None:
        raise DataError(f"text_data has image_column={spec.image_column!r}; it holds text for the text tower "
                        "(text_column=...). Images go to data=.")
    return spec


def _parse_data(entry: Any, root: Path | None, key: str = "data", *, own: bool = False) -> DataSpec:
    """A recipe's data section; ``key`` names it in errors, ``own``: a models entry's own data."""
    if key != "data":
        try:
            return _parse_data(entry, root, own=own)
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None
    if isinstance(entry, str) and not entry.strip() or isinstance(entry, Mapping) and any(
            isinstance(entry.get(k), str) and not entry[k].strip() for k in ("id", "path")):
        raise ConfigError(f"data is empty ({short(entry)}): give a Hub dataset id, a local folder or data file "
                          "(relative to the config's folder), or leave it out.")
    if isinstance(entry, str):
        local = looks_local(entry) or (root is not None and _is_data_path(root / entry))
        entry = {"path": entry} if local else {"id": entry}
    if not isinstance(entry, Mapping):
        raise ConfigError(f"data must be a Hub dataset id, a local folder or a mapping such as {{id: tanganke/dtd, "
                          f"split: train, num_samples: 128}}, got {short(entry)}.")
    if "seed" in entry:
        raise ConfigError(DATA_SEED)
    entry = dict(entry)
    if IN_MEMORY in entry:
        content = f" (content {entry['content']})" if entry.get("content") else ""
        where = ("a text file or folder of texts" if entry.get("samples") == "texts" else
                 "a local image folder, or a text file")
        again = ("in this model's entry, hf_mloss.merge(base, [..., {'model': ..., 'data': ...}])" if own else
                 "to hf_mloss.merge(..., data=...)")
        raise ConfigError(f"data was passed from Python ({short(entry[IN_MEMORY])}{content}) when this config was "
                          f"written; replace the data section with `id` (a Hub dataset id) or `path` ({where}), or "
                          f"pass the same {entry.get('samples', 'data')} again {again}.")
    names = [f.name for f in dataclasses.fields(DataSpec) if f.name != "objects"]
    check_keys(entry, names, "key in data", error=ConfigError)
    values = dict(entry)
    if isinstance(values.get("path"), str):
        values["path"] = _absolute(values["path"], root)
    return _build(DataSpec, values, "data.")


def _parse_select(entry: dict[str, Any], root: Path | None) -> SelectionOptions:
    """The ``select:`` section: head files and share folders resolve against the config's folder."""
    heads = entry.get("heads")
    if isinstance(heads, list):
        for i, head in enumerate(heads):
            if isinstance(head, Mapping) and IN_MEMORY in head:
                raise ConfigError(f"select.heads[{i}] was passed from Python when this config was written; replace "
                                  "it with a safetensors file holding `weight` (and `bias`).")
        entry["heads"] = [_absolute(h, root) if isinstance(h, str) else h for h in heads]
    if isinstance(entry.get("shares"), list):
        entry["shares"] = [_parse_data(share, root) for share in entry["shares"]]
    if "chosen" in entry and "held_out" not in entry:  # recorded before held_out: it compared in sample
        entry["held_out"] = False
    return _build(SelectionOptions, entry, "select.")


def _selection_to_dict(select: SelectionOptions, root: Path | None) -> dict[str, Any]:
    """The ``select:`` section (local head files and data folders relative to ``root``)."""
    out: dict[str, Any] = {"criterion": select.criterion, "grid": select.grid, "num_samples": select.num_samples,
                           "share": select.share, "held_out": select.held_out}
    if select.compare:
        out["compare"] = list(select.compare)
    if select.heads:
        out["heads"] = [_relative(h, root) if isinstance(h, str) else {IN_MEMORY: type(h).__name__}
                        for h in select.heads]
    if select.shares:
        out["shares"] = [DataSpec.parse(s).to_dict(root) for s in select.shares]
    for key in ("reference", "chosen", "candidates", "fitted"):
        if getattr(select, key) is not None:
            out[key] = getattr(select, key)
    return out


def _migrate(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """Read configs saved by hf_mloss 0.1, which recorded what it had read about the data inside ``data``."""
    version = str(config.get("hf_mloss_version") or "")
    data = config.get("data")
    if not version.startswith("0.1.") or not isinstance(data, Mapping):
        return config
    data = {k: v for k, v in data.items() if k not in ("skipped", "seed")}
    if data.pop("source", None) == "imagefolder" and "id" in data:
        data["path"] = data.pop("id")
    return {**config, "data": data}


def _build(cls: type, values: Mapping[str, Any], where: str) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    check_keys(values, names, f"key in {where.rstrip('.')}", error=ConfigError)
    try:
        return cls(**values)
    except HfMLossError as err:
        message = str(err)
        raise ConfigError(f"{where}{message}" if message.split(" ")[0].split("=")[0] in names else message) from None


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping (e.g. {{k: 0.2}}), got {short(value)}.")
    return dict(value)


def _refuse_tokens(value: Any, where: str) -> None:
    """Refuse credentials in a config: keys that name one (``token``, ``hf_token``...) and any key or value shaped
    like one (``hf_...``, ``HF_TOKEN=...``); the value itself is never echoed."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            # a vocabulary section's `token` is a token of the vocabulary (mergekit's model_token source)
            named = isinstance(key, str) and key.lower() in TOKEN_KEYS and not (key == "token" and where.startswith(("tokenizer.",
                                                                                            "tokenizer_source.")))
            if isinstance(key, str) and (named or looks_like_secret(key)):
                name = f"{where}{key}" if named else f"{where.rstrip('.') or 'a top-level'} key"
                raise ConfigError(f"{name} (a credential) is refused; {TOKEN_HINT}")
            _refuse_tokens(item, f"{where}{key}.")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_tokens(item, f"{where.rstrip('.')}[{i}].")
    elif isinstance(value, str) and looks_like_secret(value):
        raise ConfigError(f"{where.rstrip('.') or 'The config'} holds a value shaped like an access token (it is not "
                          f"shown); {TOKEN_HINT}")


def _local_paths(config: Any, root: Path) -> list[tuple[str, Any]]:
    """``(key, value)`` of every input of a raw config (ours or mergekit's) that is not plainly a Hub id: path syntax,
    not a repo id, or a name that exists as a local path here or beside the config."""
    def local(value: Any) -> bool:
        if isinstance(value, Mapping):  # {model: ...}, mergekit's {model: {path: ...}} or {path: ...}
            inner = value.get("model", value.get("path"))
            return local(inner.get("path") if isinstance(inner, Mapping) else inner)
        if not isinstance(value, str):
            return False
        name = value.rsplit("@", 1)[0] if "@" in value else value
        return (name.startswith((".", "/", "~", "\\")) or os.path.isabs(name) or not is_repo_id(name)
                or expand(name).exists() or (root / name).exists())

    if not isinstance(config, Mapping):
        return []
    found = []
    for key in ("base", "base_model", "processor"):
        if local(config.get(key)):
            found.append((key, config[key]))
    for key in ("models",):
        for i, entry in enumerate(config.get(key) or [] if isinstance(config.get(key), list) else []):
            if local(entry):
                found.append((f"models[{i}]", entry))
            for own in ("data", "text_data"):  # a model's own data: {path: ...}, or a string naming a local path
                value = entry.get(own) if isinstance(entry, Mapping) else None
                if isinstance(value, Mapping) and value.get("path") is not None or isinstance(value, str) and \
                        local(value):
                    found.append((f"models[{i}].{own}", value))
    data = config.get("data")
    if isinstance(data, Mapping) and data.get("path") is not None or isinstance(data, str) and local(data):
        found.append(("data", data))
    select = config.get("select")
    if isinstance(select, Mapping):
        for key in ("heads", "shares"):
            entries = select.get(key) if isinstance(select.get(key), list) else []
            for i, entry in enumerate(entries):
                if key == "heads" and isinstance(entry, str) or isinstance(entry, Mapping) and entry.get(
                        "path") is not None or local(entry):
                    found.append((f"select.{key}[{i}]", entry))
    return found


def _spread(specs: list[ModelSpec], key: str, values: Any, *, per_model_hint: str) -> None:
    """Set ``key`` on every spec from one value or one value per spec."""
    if values is None:
        return
    if key == "revision" and isinstance(values, str):
        for spec in specs:
            if not spec.is_local and not spec.is_loaded:
                spec.revision = values
        return
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence) and not _is_array(values):
        raise InvalidParameterError(f"{key}s must be a list with one entry per model ({per_model_hint}), got "
                                    f"{short(values)}.")
    values = list(values)
    if len(values) != len(specs):
        raise InvalidParameterError(f"Got {len(values)} {key}s for {len(specs)} models: pass one per model "
                                    f"({per_model_hint}).")
    for i, (spec, value) in enumerate(zip(specs, values)):
        try:
            setattr(spec, key, value)
            spec.__post_init__()
        except InvalidParameterError as err:
            raise InvalidParameterError(f"{key}s[{i}]: {err}") from None


def _is_array(value: Any) -> bool:
    return hasattr(value, "tolist") and hasattr(value, "shape")


def _holds_text(objects: Any) -> bool:
    """Whether data passed from Python are texts: strings, or token ids (tokenised inputs without pixels)."""
    import torch

    from ..loading.model_inputs import as_model_inputs

    if isinstance(objects, (list, tuple)) and objects and all(isinstance(x, str) for x in objects):
        return True
    given = as_model_inputs(objects) if not isinstance(objects, torch.Tensor) else None
    return given is not None and "input_ids" in given and "pixel_values" not in given


def _content_hash(objects: Any) -> str | None:
    """``xxh3-128:…`` of a preprocessed image tensor's values (shape and dtype included), of tokenised inputs (each
    tensor, by name) or of a list of texts, else ``None``."""
    import torch
    import xxhash

    from ..loading.model_inputs import as_model_inputs

    if isinstance(objects, (list, tuple)) and objects and all(isinstance(x, str) for x in objects):
        digest = xxhash.xxh3_128(b"texts:")
        for text in objects:
            encoded = text.encode("utf-8", "surrogatepass")
            digest.update(f"{len(encoded)}:".encode() + encoded)
        return f"xxh3-128:{digest.hexdigest()}"
    given = as_model_inputs(objects) if not isinstance(objects, torch.Tensor) else None
    if given is not None and "pixel_values" in given:
        objects, given = given["pixel_values"], None  # pixels hash as the bare tensor does
    if given is not None:
        digest = xxhash.xxh3_128(b"inputs:")
        for name in sorted(given.keys()):
            tensor = given[name].detach().to("cpu").contiguous()
            digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        return f"xxh3-128:{digest.hexdigest()}"
    if not isinstance(objects, torch.Tensor):
        return None
    tensor = objects.detach().to("cpu").contiguous()
    digest = xxhash.xxh3_128(f"{tuple(tensor.shape)}:{tensor.dtype}:".encode())
    digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return f"xxh3-128:{digest.hexdigest()}"


def _is_data_path(path: Path) -> bool:
    """A folder, or a file of a type scoring data is read from (text, JSON lines, CSV, parquet)."""
    from ..loading.data import DATA_FILE_SUFFIXES

    return path.is_dir() or (path.is_file() and path.suffix.lower() in DATA_FILE_SUFFIXES)


def _holds_a_file(folder: Path) -> bool:
    """Whether ``folder`` or a folder below it holds a file (the walk stops at the first)."""
    return any(files for _, _, files in os.walk(folder))


def _is_loaded_model(value: Any) -> bool:
    return hasattr(value, "config") and hasattr(value, "state_dict") and callable(value.state_dict)


def _absolute(value: str, root: Path | None) -> str:
    """``value`` as an absolute path (relative ones against ``root``); symbolic links are kept as written."""
    path = expand(value)
    if not path.is_absolute():
        path = (root or Path.cwd()) / path
    return os.path.normpath(path)


def _resolve_model_path(value: str, root: Path | None) -> str:
    """Explicit local paths resolve against ``root``, and so does a bare name of a folder there; else: a Hub id."""
    if looks_local(value) or (root is not None and value and (root / value).is_dir()):
        return _absolute(value, root)
    return value


def _relative(value: str, root: Path | None) -> str:
    """``value`` relative to ``root`` (where the config file lives) when both lie in one project, else absolute.

    "One project": their deepest common folder is below the home folder (and not the filesystem root), so a merge
    saved next to its inputs moves with them, while a model in the user's cache is not written as
    ``../../../../../.cache/...`` (which breaks as soon as the merge folder moves).
    """
    path = _absolute(value, None)
    if root is None:
        return path
    try:
        common = Path(os.path.commonpath([path, os.path.abspath(root)]))
    except ValueError:  # different drives
        return path
    home = Path.home()
    return path if common in {home, *home.parents} else os.path.relpath(path, root)


def _plain(value: Any) -> Any:
    """Tuples to lists and numpy scalars to Python numbers, recursively (YAML-safe and equal after a round trip)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and hasattr(value, "dtype"):
        return value.item()
    return value


__all__ = ["MERGE_CONFIG_NAME", "DataSpec", "MergeConfig", "ModelSpec"]
