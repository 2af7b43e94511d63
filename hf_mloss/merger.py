"""``merge()``: resolve and validate the inputs, then merge tensor by tensor (or block by block for M-TIES).

Memory: the merged model (loaded from the base, in float32) plus, at any time, the q sources' copies of ONE tensor
(data-free methods) or of one block's scored linear (M-TIES). Source checkpoints are read lazily from disk.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from .adapters import ModelAdapter, adapter_for
from .data import DEFAULT_NUM_SAMPLES, load_pixel_values
from .errors import (
    CorruptCheckpointError,
    DataError,
    IncompatibleCheckpointsError,
    InvalidParameterError,
)
from .hub import ModelRef, is_hub_id, resolve_model
from .methods import MergeContext, MergeMethod, get_method
from .methods.mties import keep_ratios_from_scores, random_scores
from .result import MergeResult
from .scoring import LayerHooks, ScoringSetup, build_report, score_own_prefix, score_shared_prefix
from .store import CheckpointStore, ModuleStore, TensorStore

ModelInput = str | PreTrainedModel


@dataclass
class MergeInputs:
    """Resolved, validated inputs of a merge or scoring run."""

    adapter: ModelAdapter
    base: TensorStore
    sources: list[TensorStore]
    base_model: PreTrainedModel | None
    """The base as the caller passed it (already loaded), else None."""
    names: list[str]
    """Floating-point canonical tensor names, in checkpoint order."""

    @property
    def refs(self) -> list[ModelRef]:
        return [s.ref for s in self.sources]

    def load_worker(self, device, *, progress: bool = True) -> PreTrainedModel:
        """A float32 copy of the base model on ``device``: the container the merge is written into."""
        if self.base_model is not None:
            model = copy.deepcopy(self.base_model).to(dtype=torch.float32)
        else:
            with _transformers_progress(progress):
                model = self.adapter.load_model(self.base.ref.path, dtype=torch.float32)
        return model.to(device).eval()

    def close(self) -> None:
        for store in [self.base, *self.sources]:
            store.close()


def prepare_inputs(base: ModelInput, models: Sequence[ModelInput], *, revision: str | Sequence[str | None] | None = None,
                   token: str | bool | None = None, allow_pickle: bool = False) -> MergeInputs:
    """Resolve every model, pick the adapter, index the checkpoints lazily and check they are mergeable."""
    if isinstance(models, (str, PreTrainedModel)) or not isinstance(models, Sequence) or len(models) < 1:
        raise InvalidParameterError(
            f"models must be a non-empty list of Hub ids, local folders or loaded models, got {models!r}."
        )
    everything = [base, *models]
    if revision is None or isinstance(revision, str):
        revisions = [revision] * len(everything)
    else:
        revisions = list(revision)
        if len(revisions) != len(everything):
            raise InvalidParameterError(
                f"Got {len(revisions)} revisions for {len(everything)} models: pass one revision for all, or one per "
                "model with the base first (None for local folders)."
            )
    refs_and_configs = [_resolve(m, revision=r, token=token, allow_pickle=allow_pickle)
                        for m, r in zip(everything, revisions)]
    adapter = adapter_for(refs_and_configs[0][2])
    for ref, _, config in refs_and_configs[1:]:
        other = adapter_for(config)
        if other.name != adapter.name:
            raise IncompatibleCheckpointsError(
                f"{ref.name!r} is a {config.model_type!r} model ({other.name} adapter) but the base is "
                f"{refs_and_configs[0][2].model_type!r} ({adapter.name}); all models must share one architecture."
            )
    stores: list[TensorStore] = []
    for ref, loaded, _ in refs_and_configs:
        stores.append(ModuleStore(loaded, adapter, ref) if loaded is not None
                      else CheckpointStore(ref, adapter, allow_pickle=allow_pickle))
    base_store, sources = stores[0], stores[1:]
    for store in sources:
        check_compatible(base_store, store)
    names = [n for n in base_store.keys() if base_store.dtypes[n] is not None and base_store.dtypes[n].is_floating_point]
    return MergeInputs(adapter=adapter, base=base_store, sources=sources, base_model=refs_and_configs[0][1],
                       names=names)


def _resolve(model: ModelInput, **kwargs) -> tuple[ModelRef, PreTrainedModel | None, PretrainedConfig]:
    if isinstance(model, PreTrainedModel):
        name = getattr(model.config, "_name_or_path", "") or ""
        repo_id = name if is_hub_id(name) else None  # only a model loaded from the Hub keeps its id
        return ModelRef(path=name, repo_id=repo_id), model, model.config
    if isinstance(model, torch.nn.Module):
        raise InvalidParameterError(
            f"Got a plain {type(model).__name__}; pass a transformers PreTrainedModel, a Hub id or a local folder."
        )
    ref = resolve_model(model, revision=kwargs["revision"], token=kwargs["token"],
                        allow_pickle=kwargs["allow_pickle"])
    try:
        config = AutoConfig.from_pretrained(ref.path)
    except (OSError, ValueError) as err:
        raise CorruptCheckpointError(f"Cannot read the config.json of {ref.name!r}: {err}") from err
    return ref, None, config


def check_compatible(base: TensorStore, other: TensorStore) -> None:
    """Raise :class:`IncompatibleCheckpointsError` unless ``other`` has the base's tensors, shapes and kinds."""
    missing = [n for n in base.keys() if n not in other]
    extra = [n for n in other.keys() if n not in base]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensor(s) of the base are missing (e.g. {missing[:3]})")
        if extra:
            parts.append(f"{len(extra)} tensor(s) are not in the base (e.g. {extra[:3]})")
        raise IncompatibleCheckpointsError(
            f"{other.ref.name!r} does not match the base {base.ref.name!r}: {'; '.join(parts)}. "
            "All models merged together must share one architecture."
        )
    for name in base.keys():
        if base.shapes[name] != other.shapes[name]:
            raise IncompatibleCheckpointsError(
                f"{name!r} has shape {base.shapes[name]} in {base.ref.name!r} but {other.shapes[name]} in "
                f"{other.ref.name!r}. All models merged together must share one architecture."
            )
        a, b = base.dtypes[name], other.dtypes[name]
        if a is None or b is None or a.is_floating_point != b.is_floating_point:
            raise IncompatibleCheckpointsError(
                f"{name!r} is {a} in {base.ref.name!r} but {b} in {other.ref.name!r}: floating-point and integer "
                "tensors cannot be merged together."
            )


def resolve_weights(weights: Sequence[float] | None, q: int, method: MergeMethod) -> torch.Tensor:
    """Validate the per-source weights α (one per fine-tuned model, finite, ≥ 0, not all 0)."""
    if weights is None:
        return torch.full((q,), 1.0 if method.default_weight == "one" else 1.0 / q, dtype=torch.float64)
    values = list(weights) if not isinstance(weights, (str, bytes)) else None
    if values is None or len(values) != q:
        raise InvalidParameterError(f"Got {len(values) if values is not None else weights!r} weights for {q} "
                                    "models: pass one weight per fine-tuned model (the base has none).")
    for i, w in enumerate(values):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise InvalidParameterError(f"weights[{i}] must be a finite number >= 0, got {w!r}.")
    if sum(values) <= 0:
        raise InvalidParameterError("weights must not all be 0.")
    return torch.tensor([float(v) for v in values], dtype=torch.float64)  # float64: saved configs stay exact


class TensorMerger:
    """Reads, checks and merges tensors into the worker model."""

    def __init__(self, inputs: MergeInputs, method: MergeMethod, ctx: MergeContext, worker: PreTrainedModel,
                 device) -> None:
        self.inputs, self.method, self.ctx, self.device = inputs, method, ctx, device
        adapter = inputs.adapter
        self.targets = {adapter.canonical_key(k): v for k, v in worker.state_dict().items()}
        self.names = [n for n in inputs.names if n in self.targets]
        self.done: set[str] = set()
        ctx.state["total_numel"] = sum(math.prod(inputs.base.shapes[n]) for n in self.names)

    def read(self, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        base = self.targets[name].float() if name not in self.done else self.inputs.base.get_float(name, self.device)
        sources = []
        for store in self.inputs.sources:
            tensor = store.get_float(name, self.device)
            # One reduction instead of a full isfinite mask: any NaN/Inf (or an overflowing sum) makes the sum
            # non-finite, and only then are the entries counted.
            if not torch.isfinite(tensor.sum()) and not torch.isfinite(tensor).all():
                bad = int((~torch.isfinite(tensor)).sum())
                raise CorruptCheckpointError(
                    f"{name!r} of {store.ref.name!r} holds {bad} non-finite value(s) (NaN/Inf); a merge would spread "
                    "them. Fix or exclude that checkpoint."
                )
            sources.append(tensor)
        return base, sources

    def visit(self, fn) -> None:
        for name in self.names:
            base, sources = self.read(name)
            fn(name, base, sources)

    @torch.no_grad()
    def merge(self, names: Sequence[str]) -> None:
        for name in names:
            if name in self.done:
                continue
            base, sources = self.read(name)
            merged = self.method.merge_tensor(name, base, sources, self.ctx)
            self.targets[name].copy_(merged)
            self.done.add(name)


class _MTiesHooks(LayerHooks):
    """Merge stage by stage while the shared prefix advances (M-TIES, ``prefix="merged"``)."""

    def __init__(self, merger: TensorMerger, adapter: ModelAdapter, row_layers: set[int], params, seed: int,
                 keep: dict[str, torch.Tensor]) -> None:
        self.merger, self.adapter, self.row_layers, self.params, self.seed = merger, adapter, row_layers, params, seed
        self.keep = keep
        self.stages: dict[int, list[str]] = {}
        for name in merger.names:
            self.stages.setdefault(adapter.stage_of(name), []).append(name)

    def row_weight(self, layer: int) -> str:
        return f"{self.adapter.target_name(layer)}.weight"

    def before_stage(self, stage: int) -> None:
        deferred = self.row_weight(stage) if stage in self.row_layers else None
        self.merger.merge([n for n in self.stages.get(stage, []) if n != deferred])

    def after_scores(self, layer: int, accumulator) -> None:
        if layer not in self.row_layers:
            return
        name = self.row_weight(layer)
        target = self.adapter.target_name(layer)
        node = accumulator.means()[0]
        scores = random_scores(node.numel(), self.seed, target) if self.params.rank == "random" else node
        keep = keep_ratios_from_scores(scores, self.params.row_k, self.params.e)
        self.keep[target] = keep.float()
        if self.params.e > 0 or not self.merger.method.uniform_keep_is_tensor_trim:
            self.merger.ctx.state.setdefault("row_keep", {})[name] = keep.to(self.merger.device)
        self.merger.merge([name])

    def after_all(self) -> None:
        for stage in sorted(self.stages):
            self.before_stage(stage)
        self.merger.merge(self.merger.names)


def merge(
    base: ModelInput,
    models: Sequence[ModelInput],
    method: str = "ties",
    *,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    data: Any = None,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    batch_size: int = 16,
    split: str = "train",
    image_column: str | None = None,
    compute_dtype: torch.dtype | str = torch.float32,
    revision: str | Sequence[str | None] | None = None,
    token: str | bool | None = None,
    allow_pickle: bool = False,
    progress: bool = True,
    **method_params: Any,
) -> MergeResult:
    """Merge fine-tuned models of one base into one model.

    Args:
        base: the pretrained model the others were fine-tuned from (Hub id, local folder or loaded model).
        models: the q fine-tuned models (Hub ids, local folders or loaded models).
        method: a registered method (``hf_mloss.list_methods()``): ``average``, ``task_arithmetic``, ``ties``,
            ``dare``/``dare_ties``/``dare_linear``, ``m_ties``, ``m_dare``.
        weights: α, one per fine-tuned model (default uniform 1/q; 1 for task arithmetic and ``dare_linear``).
        seed: seeds DARE masks, random ranks and data shuffling (results are reproducible).
        dtype: dtype of the merged model (default: the base's). Arithmetic always runs in float32.
        device: where to compute (``"cpu"``, ``"cuda"``...).
        data: unlabeled images for data-guided methods (``m_ties``, ``m_dare``): Hub dataset id, local image
            folder, ``datasets`` object, list of images, or a preprocessed ``[N, 3, H, W]`` tensor.
        num_samples, batch_size, split, image_column: how the scoring data is read and batched.
        compute_dtype: dtype of the scoring forward passes (``float32`` or ``bfloat16``).
        revision: Hub branch, tag or commit for every Hub model, or one per model (base first; None for folders).
        token: passed to the Hub for private models; never stored or printed.
        allow_pickle: allow ``pytorch_model.bin`` checkpoints (they can run code when loaded).
        **method_params: the method's parameters (``k``, ``e``, ``lam``, ``p``, ``scope``, ``layers``...).

    Returns:
        A :class:`MergeResult` whose ``model`` is the merged model (same class and config as the base).

    Example:
        ```python
        >>> import hf_mloss
        >>> result = hf_mloss.merge("openai/clip-vit-base-patch32", ["org/ft-cars", "org/ft-dtd"], "ties", k=0.2)
        >>> result.save_pretrained("merged-clip")
        ```
    """
    merge_method = get_method(method)
    params = merge_method.make_params(**method_params)
    if merge_method.needs_data and data is None:
        raise DataError(f"Method {method!r} is data-guided: pass data=... (a Hub dataset id, a local image folder, "
                        "a datasets object or a list of images; ~128 unlabeled images suffice).")
    compute_dtype = _as_dtype(compute_dtype, "compute_dtype")
    out_dtype = _as_dtype(dtype, "dtype") if dtype is not None else None
    device = torch.device(device or _default_device())
    inputs = prepare_inputs(base, models, revision=revision, token=token, allow_pickle=allow_pickle)
    alpha = resolve_weights(weights, len(inputs.sources), merge_method)
    _check_layers(params, inputs.adapter)
    pixels = data_info = None
    if merge_method.needs_data:
        processor = inputs.adapter.load_processor(inputs.base.ref.path) if inputs.base_model is None else None
        pixels, data_info = load_pixel_values(data, processor, num_samples=num_samples, seed=seed, split=split,
                                              image_column=image_column)
    worker = inputs.load_worker(device, progress=progress)
    ctx = MergeContext(params=params, weights=alpha.to(device=device, dtype=torch.float32), seed=seed)
    merger = TensorMerger(inputs, merge_method, ctx, worker, device)
    report = None
    if merge_method.needs_data:
        report = _layerwise_merge(inputs, merger, worker, pixels, batch_size, alpha, params, seed, device,
                                  compute_dtype, progress, num_samples=len(pixels))
    else:
        merge_method.prepare(ctx, merger.visit)
        names = merger.names
        merger.merge(tqdm(names, desc=f"Merging ({method})", unit="tensor", disable=not progress))
    out_dtype = out_dtype or _stored_dtype(inputs)
    worker = worker.to(out_dtype)
    result = MergeResult(
        model=worker, method=method, params=params.to_dict(), base=inputs.base.ref, models=inputs.refs,
        weights=alpha.tolist(), seed=seed, report=report, data=data_info.to_dict() if data_info else None,
        options={"batch_size": batch_size, "compute_dtype": str(compute_dtype).replace("torch.", "")}
        if merge_method.needs_data else {},
        adapter=inputs.adapter, dtype=str(out_dtype).replace("torch.", ""),
        method_description=merge_method.describe(params),
    )
    inputs.close()
    return result


def _layerwise_merge(inputs, merger, worker, pixels, batch_size, alpha, params, seed, device, compute_dtype,
                     progress, *, num_samples):
    adapter = inputs.adapter
    activation, activation_name = resolve_activation(adapter, params.activation)
    scored = list(params.layers) if params.layers is not None else list(range(adapter.num_layers))
    setup = ScoringSetup(adapter=adapter, model=worker, sources=inputs.sources, alpha=alpha.float().to(device),
                         batches=shard_batches(pixels, batch_size), activation=activation,
                         activation_name=activation_name, reduction=params.reduction, eps=params.eps, layers=scored,
                         device=device, compute_dtype=compute_dtype, progress=progress)
    keep: dict[str, torch.Tensor] = {}
    hooks = _MTiesHooks(merger, adapter, set(scored), params, seed, keep)
    if params.prefix == "merged":
        results = score_shared_prefix(setup, hooks)
    else:
        if params.prefix == "base":
            results = score_shared_prefix(setup)
        else:
            results = score_own_prefix(setup)
            restore_embeddings(worker, inputs)
        for layer in scored:
            hooks.after_scores(layer, results[adapter.target_name(layer)])
        hooks.after_all()
    return build_report(setup, results, prefix=params.prefix, models=[r.name for r in inputs.refs],
                        num_samples=num_samples, keep_ratios=keep)


def restore_embeddings(worker: PreTrainedModel, inputs: MergeInputs) -> None:
    """Undo the embedding swaps of an own-prefix pass (the worker is the merge container)."""
    adapter = inputs.adapter
    with torch.no_grad():
        for key, tensor in worker.state_dict().items():
            name = adapter.canonical_key(key)
            if name in inputs.base and adapter.stage_of(name) < 0:
                tensor.copy_(inputs.base.get(name))


def resolve_activation(adapter: ModelAdapter, activation: str | None):
    from transformers.activations import ACT2FN

    if activation is None:
        return adapter.activation(), adapter.config.hidden_act
    if activation not in ACT2FN:
        raise InvalidParameterError(f"Unknown activation {activation!r}; valid: {sorted(ACT2FN)}.")
    return ACT2FN[activation], activation


def shard_batches(pixels: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """This process's share of the samples (every ``world``-th one), in batches of ``batch_size``."""
    from accelerate import PartialState

    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InvalidParameterError(f"batch_size must be a positive integer, got {batch_size!r}.")
    state = PartialState()
    share = pixels[state.process_index :: state.num_processes]
    return list(share.split(batch_size))


def _check_layers(params, adapter: ModelAdapter) -> None:
    layers = getattr(params, "layers", None)
    if layers is not None and max(layers) >= adapter.num_layers:
        raise InvalidParameterError(
            f"layers={list(layers)} names block {max(layers)} but the model has {adapter.num_layers} blocks "
            f"(valid: 0..{adapter.num_layers - 1})."
        )


def _as_dtype(value, field: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    valid = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if value not in valid:
        raise InvalidParameterError(f"{field} must be one of {sorted(valid)}, got {value!r}.")
    return valid[value]


@contextlib.contextmanager
def _transformers_progress(enabled: bool):
    """Silence transformers' own progress bars while loading when the caller asked for quiet (library) use."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


def _default_device() -> str:
    from accelerate import PartialState

    state = PartialState()
    return str(state.device) if state.num_processes > 1 else "cpu"


def _stored_dtype(inputs: MergeInputs) -> torch.dtype:
    dtypes = [inputs.base.dtypes[n] for n in inputs.names]
    return dtypes[0] if dtypes else torch.float32


def score(
    base: ModelInput,
    models: Sequence[ModelInput],
    data: Any,
    *,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    batch_size: int = 16,
    weights: Sequence[float] | None = None,
    prefix: str = "own",
    reduction: str = "abs",
    activation: str | None = None,
    eps: float = 1e-4,
    layers: Sequence[int] | None = None,
    seed: int = 0,
    split: str = "train",
    image_column: str | None = None,
    device: str | torch.device | None = None,
    compute_dtype: torch.dtype | str = torch.float32,
    revision: str | Sequence[str | None] | None = None,
    token: str | bool | None = None,
    allow_pickle: bool = False,
    progress: bool = True,
    **merge_params: Any,
):
    """Measure mergeability without merging: node and layer M-Loss of ``models`` over unlabeled ``data``.

    Args:
        prefix: where each scored linear's input comes from: ``"own"`` (each model's own forward, the paper's
            definition; q forwards), ``"base"`` (the base model's forward, shared), or ``"merged"`` (the
            merged-so-far model of an M-TIES merge with ``merge_params`` such as ``k``/``e``).
        reduction: ``"abs"`` (mean |g|, the paper) or ``"sq"`` (mean g², the authors' code).
        activation: override the model's own activation (e.g. ``"gelu_pytorch_tanh"`` as in the reference code).
        weights: α (default uniform).

    Returns:
        An :class:`~hf_mloss.report.MLossReport` (``.summary()`` prints the per-layer table).
    """
    if prefix == "merged":
        result = merge(base, models, "m_ties", weights=weights, seed=seed, device=device, data=data,
                       num_samples=num_samples, batch_size=batch_size, split=split, image_column=image_column,
                       compute_dtype=compute_dtype, revision=revision, token=token, allow_pickle=allow_pickle,
                       progress=progress, reduction=reduction, activation=activation, eps=eps,
                       layers=tuple(layers) if layers is not None else None, **merge_params)
        return result.report
    if merge_params:
        raise InvalidParameterError(f"Unknown argument(s) {sorted(merge_params)} for score() with prefix={prefix!r}.")
    from .methods.mties import MTiesParams

    params = MTiesParams(prefix=prefix, reduction=reduction, activation=activation, eps=eps,
                         layers=tuple(layers) if layers is not None else None)
    compute_dtype = _as_dtype(compute_dtype, "compute_dtype")
    device = torch.device(device or _default_device())
    inputs = prepare_inputs(base, models, revision=revision, token=token, allow_pickle=allow_pickle)
    alpha = resolve_weights(weights, len(inputs.sources), get_method("m_ties"))
    _check_layers(params, inputs.adapter)
    processor = inputs.adapter.load_processor(inputs.base.ref.path) if inputs.base_model is None else None
    pixels, _ = load_pixel_values(data, processor, num_samples=num_samples, seed=seed, split=split,
                                  image_column=image_column)
    adapter = inputs.adapter
    act, act_name = resolve_activation(adapter, activation)
    setup = ScoringSetup(adapter=adapter, model=inputs.load_worker(device, progress=progress), sources=inputs.sources,
                         alpha=alpha.float().to(device), batches=shard_batches(pixels, batch_size), activation=act,
                         activation_name=act_name, reduction=reduction, eps=eps, layers=params.layers,
                         device=device, compute_dtype=compute_dtype, progress=progress)
    results = score_shared_prefix(setup) if prefix == "base" else score_own_prefix(setup)
    report = build_report(setup, results, prefix=prefix, models=[r.name for r in inputs.refs],
                          num_samples=len(pixels))
    inputs.close()
    return report
