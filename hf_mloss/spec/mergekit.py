"""Reading mergekit YAML configs: the methods both libraries share, mapped to hf_mloss's with the same results.

| mergekit | hf_mloss |
|---|---|
| ``linear`` (``normalize: true``, no ``base_model``) | ``average`` of the models with their ``weight`` |
| ``task_arithmetic`` | ``task_arithmetic``, ``lam`` = ``lambda`` (mergekit's default 1), weights as given (÷ Σw with ``normalize``) |
| ``ties`` | ``ties``, ``convention: mergekit``, ``k`` = ``density`` (one value for all models), ``lam`` = ``lambda``, ``normalize`` (default true) |
| ``dare_ties`` / ``dare_linear`` | ``dare_ties`` / ``dare_linear``, ``p`` = ``density``, ``rescale: l1``, ``normalize`` (mergekit's default false for both; mergekit's masks are drawn from another random stream) |
| ``slerp`` (``base_model`` + one other model) | ``slerp``, ``t`` = ``t`` |
| ``model_stock`` | ``model_stock``, ``filter_wise`` = ``filter_wise`` |
| ``breadcrumbs`` / ``breadcrumbs_ties`` | same names, ``k`` = ``density``, ``gamma``, ``lam`` = ``lambda``, ``normalize``, ``rescale: l1`` for ``rescale: true`` |
| ``passthrough`` with ``slices`` | ``passthrough`` with ``slices`` (one source per slice; no ``scale``) |
| ``della`` / ``della_linear`` | same names, ``k`` = ``density``, ``e`` = ``epsilon``, ``lam``, ``normalize``, ``rescale: l1``/``none`` (masks from another random stream) |
| ``sce`` | ``sce``, ``select_topk`` (no weights) |
| ``nuslerp`` (two models, ``base_model`` optional) | ``nuslerp``, the two ``weight``s, ``flatten`` = ``nuslerp_flatten``, ``row_wise`` = ``nuslerp_row_wise``, ``task_vectors`` = whether a ``base_model`` is given |
| ``multislerp`` (``base_model`` optional) | ``multislerp``, ``weight``s, ``normalize_weights``, ``eps``, ``task_vectors`` as for ``nuslerp`` |
| ``karcher`` | ``karcher`` of the models and, when given, the ``base_model`` (mergekit averages it in), ``max_iter``, ``tol`` |
| ``nearswap`` / ``arcee_fusion`` (the base plus one model) | same names, ``t`` (required) / no parameters |
| ``ram`` / ``ramplus_tl`` | same names, ``epsilon`` / ``r``, ``alpha``, ``epsilon`` (no weights) |

``base_model`` becomes ``base`` (``org/name@revision`` is split; listed under ``models`` too, with or without
parameters, it is the base only, as in mergekit), ``out_dtype`` (else ``dtype``) becomes ``dtype``; the
arithmetic runs in float32 either way. Per-model parameters default as mergekit 0.1.5 defines them: ``density`` 1.0
(keep everything) where a model omits it, ``weight`` required on every model. Method parameters may be gradients or
filter lists, as in mergekit (see :mod:`hf_mloss.spec.schedule`); so may per-model weights and densities, which
may differ between the models (they become the models' own ``parameters``, resolved per model and tensor).
``tokenizer_source`` (``union``, ``base`` or a model) and the ``tokenizer:`` section (``source``, ``tokens``,
``pad_to_multiple_of``) become ``tokenizer_source``, the models they name as indices into ``[base, *models]``
(:mod:`hf_mloss.loading.vocab` builds the vocabulary and aligns the rows as mergekit does). ``base+adapter`` entries (and
``{model: ..., lora: ...}``) name a PEFT LoRA adapter of the base (:mod:`hf_mloss.loading.lora`). ``slices`` with
``sources`` and ``layer_range`` map to hf_mloss's ``slices`` (:mod:`hf_mloss.spec.slices`): ``passthrough`` stacks (one
source per slice) and slices merged by one of the methods above (the same models in every slice, per-model parameters
the same in every slice; a slice's own ``parameters`` come before the top-level ones for its layers). Anything else
(other methods) and any malformed shape (a list where one name or a mapping belongs) is refused in one line naming
the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._validation import check_float32, is_finite, short
from ..errors import ConfigError, InvalidParameterError
from .schedule import ParamSchedule, is_schedule

METHODS = {"linear": "average", "task_arithmetic": "task_arithmetic", "ties": "ties", "dare_ties": "dare_ties",
           "dare_linear": "dare_linear"}
RECIPE_METHODS = ("slerp", "model_stock", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear", "sce")
"""mergekit methods with the same name and semantics here (mapped by :func:`_recipe_config`)."""
METHODS.update({name: name for name in RECIPE_METHODS})
METHODS["passthrough"] = "passthrough"  # with slices only (hf_mloss.spec.slices)
METHODS["nuslerp"] = "nuslerp"  # base_model optional (see _nuslerp_config)
MODELS_OR_SLICES = ("The mergekit config needs a non-empty `models` list, or `slices` with `sources` and `layer_range`s "
                    "instead of `models`.")
REQUIRED = object()
"""A shared parameter mergekit gives no default (the config must set it)."""
SHARED_METHODS: dict[str, dict[str, Any]] = {
    # base: "optional" (task vectors when given), "required", or "input" (mergekit averages the base in as a model)
    "multislerp": {"base": "optional", "weight": True,
                   "shared": {"normalize_weights": (True, bool), "eps": (1e-8, float)}},
    "karcher": {"base": "input", "weight": False, "shared": {"max_iter": (10, int), "tol": (1e-5, float)}},
    "nearswap": {"base": "required", "weight": False, "count": 1, "shared": {"t": (REQUIRED, float)}},
    "arcee_fusion": {"base": "required", "weight": False, "count": 1, "shared": {}},
    "ram": {"base": "required", "weight": False, "shared": {"epsilon": (1e-5, float)}},
    "ramplus_tl": {"base": "required", "weight": False,
                   "shared": {"r": (0.1, float), "alpha": (0.2, float), "epsilon": (1e-5, float)}},
}
"""mergekit methods whose parameters are all shared (top-level ``parameters``, same names here), plus ``weight``."""
METHODS.update({name: name for name in SHARED_METHODS})
TOP_LEVEL = ("merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype",
             "tokenizer_source", "tokenizer", "chat_template", "name")
IGNORED = ("chat_template", "name")
"""Keys hf_mloss reads and ignores (the merged tokenizer keeps the template its source has)."""
NORMALIZE_DEFAULTS = {"linear": True, "task_arithmetic": False, "ties": True, "dare_ties": False,
                      "dare_linear": False}
"""mergekit 0.1.5's ``normalize`` default per method (``dare_ties`` sums the agreeing deltas unless told otherwise)."""
DEFAULT_DENSITY = 1.0
"""mergekit's default ``density`` for a model that gives none (generalized task arithmetic methods, 0.1.5)."""


def from_mergekit(config: Mapping[str, Any]) -> dict[str, Any]:
    """The hf_mloss config dict equivalent to a mergekit config dict.

    Raises:
        ConfigError: an option with no hf_mloss equivalent (the message names it).
    """
    out = _from_mergekit(config)
    vocabulary = _vocabulary(config, out)
    if vocabulary is not None:
        out["tokenizer_source"] = vocabulary
    return out


def _from_mergekit(config: Mapping[str, Any]) -> dict[str, Any]:
    unknown = [k for k in config if k not in TOP_LEVEL]
    if unknown:
        raise ConfigError(f"mergekit config key(s) {unknown} have no hf_mloss equivalent (hf_mloss reads "
                          f"{[k for k in TOP_LEVEL if k not in IGNORED]}).")
    method = config["merge_method"]
    if not isinstance(method, str):
        raise ConfigError(f"mergekit merge_method must be one method name such as ties, got {short(method)}.")
    _check_tokenizer(config)
    if method not in METHODS:
        raise ConfigError(f"mergekit merge_method {short(method)} is not one hf_mloss shares; shared: {list(METHODS)} "
                          "(or write an hf_mloss config: `hf-mloss methods`).")
    if "slices" in config:
        return _sliced_config(config, method)
    if method == "passthrough":
        raise ConfigError("mergekit passthrough without slices copies one model; give `slices` with `layer_range`s "
                          "to stack layers (hf_mloss maps passthrough with slices only).")
    if method in RECIPE_METHODS:
        return _recipe_config(config, method)
    if method == "nuslerp":
        return _nuslerp_config(config)
    if method in SHARED_METHODS:
        return _shared_config(config, method)
    global_params = _mapping(config.get("parameters"), "parameters")
    base = None
    if config.get("base_model"):
        base = _model_entry(config["base_model"], "base_model")
        if method == "linear":
            raise ConfigError("mergekit `linear` with a base_model averages the base in too; list it under `models` "
                              "with its weight instead (hf_mloss then averages exactly those models).")
    elif method != "linear":
        raise ConfigError(f"The mergekit config has no base_model; `{method}` merges fine-tunes of one base: add "
                          "`base_model: org/name`.")
    models, weights, densities = _models(config.get("models"), skip=base)
    if base is None:
        base = dict(models[0])  # an average needs no base: the first model only provides the architecture
    _check_lora_bases(base, models)
    out: dict[str, Any] = {"base": base, "models": models, "method": METHODS[method]}
    normalize = global_params.pop("normalize", NORMALIZE_DEFAULTS[method])
    lam = global_params.pop("lambda", 1.0)
    if not isinstance(normalize, bool):
        raise ConfigError(f"mergekit parameters.normalize must be true or false, got {short(normalize)}.")
    _check_number(lam, "parameters.lambda", schedule=True)
    if global_params:
        raise ConfigError(f"mergekit parameters {sorted(global_params)} have no hf_mloss equivalent.")
    parameters: dict[str, Any] = {}
    if method == "linear" and not normalize:
        raise ConfigError("mergekit `linear` with normalize: false (a plain weighted sum of the models) has no "
                          "hf_mloss equivalent; use normalize: true, or task_arithmetic for a weighted sum of deltas.")
    scheduled = [i for i, w in enumerate(weights) if is_schedule(w)]
    if scheduled and method in ("linear", "task_arithmetic") and normalize:
        raise ConfigError(f"models[{scheduled[0]}].parameters.weight varies over the model and mergekit `{method}` "
                          "divides by the weights' sum per tensor (normalize), which hf_mloss does only for one weight "
                          "per model; give numbers, or normalize: false (task_arithmetic).")
    if normalize and not scheduled and abs(sum(weights)) < 1e-8:
        raise ConfigError(f"mergekit parameters.normalize: true divides by the sum of the models' weights, which is "
                          f"{sum(weights):g}; give weights that do not sum to 0.")
    if method == "task_arithmetic" and normalize:
        total = sum(weights)
        weights = [w / total for w in weights]
    if method != "linear":
        parameters["lam"] = lam
    densities = [DEFAULT_DENSITY if d is None else d for d in densities]  # mergekit's default for a model without
    if method == "ties":
        parameters.update(k=_shared_or_per_model(densities, "k", models), convention="mergekit", normalize=normalize)
    elif method.startswith("dare"):
        parameters.update(p=_shared_or_per_model(densities, "p", models), rescale="l1", normalize=normalize)
    elif any(d != DEFAULT_DENSITY for d in densities):
        raise ConfigError(f"mergekit `{method}` takes no density.")
    return _finish(out, parameters, models, weights, config)


def _models(entries: Any, *, skip: dict[str, Any] | None = None
            ) -> tuple[list[dict[str, Any]], list[float], list[float | None]]:
    """Models, weights and densities of a ``models`` list; an entry naming ``skip`` (the base_model) is left out, as
    mergekit merges the base as the base only and resolves no per-model parameter for it."""
    if not isinstance(entries, list) or not entries:
        raise ConfigError(MODELS_OR_SLICES)
    models, weights, densities = [], [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "model" not in entry:
            raise ConfigError(f"models[{i}] must be a mapping with `model` (and optional `parameters`), got "
                              f"{short(entry)}.")
        if skip is not None and _model_entry(entry["model"], f"models[{i}].model") == skip:
            continue
        params = _mapping(entry.get("parameters"), f"models[{i}].parameters")
        if "weight" not in params:
            raise ConfigError(f"models[{i}].parameters.weight is missing; mergekit requires a weight on every model "
                              "(e.g. parameters: {weight: 1.0}).")
        weight = params.pop("weight")
        density = params.pop("density", None)
        density = _layered([density], 1.0) if is_schedule(density) else density
        if params or set(entry) - {"model", "parameters"}:
            raise ConfigError(f"models[{i}]: only `parameters.weight` and `parameters.density` have hf_mloss "
                              f"equivalents, got {sorted(params) or sorted(set(entry) - {'model', 'parameters'})}.")
        weight = _model_weight(weight, f"models[{i}].parameters.weight")
        if density is not None:
            _check_number(density, f"models[{i}].parameters.density", schedule=True)
        models.append(_model_entry(entry["model"], f"models[{i}].model"))
        weights.append(weight)
        densities.append(None if density is None else density if is_schedule(density) else float(density))
    if not models:
        raise ConfigError("mergekit `models` lists only the base_model; list the models to merge into it.")
    return models, weights, densities


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"mergekit {where} must be a mapping (e.g. {{weight: 1.0, density: 0.5}}), got "
                          f"{short(value)}.")
    return dict(value)


def _check_tokenizer(config: Mapping[str, Any]) -> None:
    """mergekit refuses ``tokenizer_source`` and a ``tokenizer:`` section together; so does hf_mloss."""
    if config.get("tokenizer_source") is not None and config.get("tokenizer") is not None:
        raise ConfigError("The mergekit config has both tokenizer_source and tokenizer; give one of them (mergekit "
                          "refuses both too): tokenizer: {source: ..., tokens: ...} holds what tokenizer_source says.")


def _vocabulary(config: Mapping[str, Any], out: Mapping[str, Any]) -> Any:
    """hf_mloss's ``tokenizer_source`` for mergekit's ``tokenizer_source`` or ``tokenizer:`` section (None without
    either), the models it names as indices into ``[base, *models]`` (see :mod:`hf_mloss.loading.vocab`)."""
    source, section = config.get("tokenizer_source"), config.get("tokenizer")
    if source is None and section is None:
        return None
    inputs = [{k: v for k, v in m.items() if k in ("model", "revision")} for m in [out["base"], *out["models"]]]

    def index(value: Any, where: str) -> int:
        if isinstance(value, str):
            value = value.removeprefix("model:")  # older mergekit's spelling of a model source
        entry = _model_entry(value, where) if isinstance(value, (str, Mapping)) else None
        plain = None if entry is None else {k: v for k, v in entry.items() if k in ("model", "revision")}
        if plain not in inputs:
            raise ConfigError(f"mergekit {where}: {short(value, 60)} is not one of the merge's models "
                              f"({[m['model'] for m in inputs][:4]}); name the base_model or a model it merges.")
        return inputs.index(plain)

    if section is None:
        return source if source in ("union", "base") else index(source, "tokenizer_source")
    if not isinstance(section, Mapping) or set(section) - {"source", "tokens", "pad_to_multiple_of"}:
        raise ConfigError(f"mergekit tokenizer must be a mapping of source, tokens and pad_to_multiple_of, got "
                          f"{short(section)}.")
    value: dict[str, Any] = {"source": section.get("source") or "union"}  # mergekit's default source: union
    if value["source"] not in ("union", "base"):
        value["source"] = index(value["source"], "tokenizer.source")
    tokens = section.get("tokens")
    if tokens:
        if not isinstance(tokens, Mapping):
            raise ConfigError(f"mergekit tokenizer.tokens must map tokens to {{source: ..., force: ...}}, got "
                              f"{short(tokens)}.")
        value["tokens"] = {}
        for token, entry in tokens.items():
            entry = dict(entry) if isinstance(entry, Mapping) else entry
            where = f"tokenizer.tokens[{token!r}].source"
            if isinstance(entry, dict) and isinstance(entry.get("source"), str):
                entry["source"] = index(entry["source"], where)
            elif isinstance(entry, dict) and isinstance(entry.get("source"), Mapping) and \
                    entry["source"].get("kind") == "model_token":
                entry["source"] = {**entry["source"], "model": index(entry["source"].get("model"), f"{where}.model")}
            value["tokens"][token] = entry
    if section.get("pad_to_multiple_of") is not None:
        value["pad_to_multiple_of"] = section["pad_to_multiple_of"]
    return value


def _model_entry(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, Mapping) and isinstance(value.get("lora"), (Mapping, str)):  # {model: ..., lora: ...}
        lora = value["lora"].get("path") if isinstance(value["lora"], Mapping) else value["lora"]
        return {**_model_entry(lora, where), "lora_of": _model_entry(value.get("model"), where)["model"]}
    if isinstance(value, Mapping):  # mergekit's long form {model: {path: ...}} or {path: ..., revision: ...}
        value = value.get("model", value)
        if isinstance(value, Mapping):
            entry = {"model": value.get("path")}
            if value.get("revision"):
                entry["revision"] = value["revision"]
            return entry
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a Hub id or a local folder, got {short(value)}.")
    if "+" in value:  # mergekit's model+lora: the adapter, applied to the merge's base (checked in from_mergekit)
        model, lora = value.split("+", 1)
        return {**_model_entry(lora, where), "lora_of": _model_entry(model, where)["model"]}
    if "@" in value:
        model, revision = value.rsplit("@", 1)
        if not model or not revision.strip():
            raise ConfigError(f"{where} {short(value)} names no {'model' if not model else 'revision'} around its "
                              "'@' (write org/name@revision, or org/name for the default branch).")
        return {"model": model, "revision": revision}
    return {"model": value}


def _check_lora_bases(base: dict[str, Any], models: list[dict[str, Any]]) -> None:
    """``model+lora`` entries: hf_mloss applies a LoRA adapter to the merge's base, so ``model`` must be that base."""
    if "lora_of" in base:
        raise ConfigError(f"base_model {base['lora_of']}+{base['model']} is a LoRA adapter; the base must be the full "
                          f"model: base_model: {base['lora_of']}.")
    for i, entry in enumerate(models):
        lora_of = entry.pop("lora_of", None)
        if lora_of is not None and lora_of != base["model"]:
            raise ConfigError(
                f"models[{i}]: {lora_of}+{entry['model']} applies a LoRA adapter to {lora_of!r}, but hf_mloss applies "
                f"adapters to the merge's base ({base['model']!r}). Use {base['model']}+{entry['model']}, or merge the "
                "adapter into its model first.")


def _shared_or_per_model(values: list[Any], ours: str, models: list[dict[str, Any]]) -> Any:
    """One value for every model (returned, the shared parameter), or each model's own in ``models[i].parameters``
    (mergekit resolves per-model parameters per model and tensor); then the shared value is the first model's."""
    if all(repr(v) == repr(values[0]) for v in values):
        return values[0]
    for entry, value in zip(models, values):
        entry.setdefault("parameters", {})[ours] = value
    return values[0]


def _model_weight(value: Any, where: str) -> Any:
    """A per-model weight: a number, or a gradient / filter list that gives every tensor a value (mergekit fails on
    a tensor where none does)."""
    _check_number(value, where, schedule=True)
    if not is_schedule(value):
        return float(value)
    if all(f is not None for f, _ in ParamSchedule.parse(value, where).entries):
        raise ConfigError(f"{where}: mergekit needs a weight for every tensor and these filters may leave some "
                          "without one (mergekit then fails); end the list with a `{value: ...}` entry without filter.")
    return _map_values(value, float)


RECIPE_SHARED = {"slerp": ("t",), "model_stock": ("filter_wise",), "sce": ("select_topk", "int8_mask")}
"""Per method, the mergekit parameters read from the top-level ``parameters`` only (mergekit's shared scope)."""
TASK_VECTOR_SHARED = ("lambda", "normalize", "rescale", "int8_mask")
PER_MODEL = {"breadcrumbs": {"density": ("k", 1.0), "gamma": ("gamma", 0.01)},
             "della": {"density": ("k", 1.0), "epsilon": ("e", 0.15)}}
"""mergekit per-model parameter → (hf_mloss name, mergekit default); one value must serve every model."""
DEFAULTS = {"breadcrumbs": (False, False), "breadcrumbs_ties": (False, False), "della": (True, True),
            "della_linear": (False, True)}
"""mergekit's (normalize, rescale) defaults of its generalised task-arithmetic methods."""


def _recipe_config(config: Mapping[str, Any], method: str) -> dict[str, Any]:
    """The hf_mloss config of a mergekit ``slerp``, ``model_stock``, ``breadcrumbs*`` or ``della*`` config.

    As in mergekit, the ``base_model`` is the base whether or not ``models`` lists it too; shared parameters (``t``,
    ``lambda``...) come from the top-level ``parameters``, per-model ones (``weight``, ``density``...) from the
    model's ``parameters``, else the top-level ones, else mergekit's default.
    """
    if not config.get("base_model"):
        raise ConfigError(f"mergekit `{method}` needs a `base_model` (the t=0 endpoint of slerp, the anchor of the "
                          "others); add `base_model: org/name`.")
    base = _model_entry(config["base_model"], "base_model")
    family = method.removesuffix("_ties").removesuffix("_linear")
    per_model = PER_MODEL.get(family, {})
    shared_names = RECIPE_SHARED.get(method, TASK_VECTOR_SHARED)
    takes_weight = method not in RECIPE_SHARED
    global_params = _mapping(config.get("parameters"), "parameters")
    for key in global_params:
        if key not in shared_names and key not in per_model and not (takes_weight and key == "weight"):
            raise ConfigError(f"mergekit `{method}` has no parameter {key!r} hf_mloss can map; it reads "
                              f"{sorted({*shared_names, *per_model, *(['weight'] if takes_weight else [])})}.")
    entries = config.get("models")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(MODELS_OR_SLICES)
    models, weights, values = [], [], {key: [] for key in per_model}
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "model" not in entry or set(entry) - {"model", "parameters"}:
            raise ConfigError(f"models[{i}] must be a mapping with `model` (and optional `parameters`), got "
                              f"{short(entry)}.")
        model = _model_entry(entry["model"], f"models[{i}].model")
        if model == base:  # mergekit merges the base_model as the base, never as one of the others
            continue
        params = _mapping(entry.get("parameters"), f"models[{i}].parameters")
        allowed = [*per_model, *(["weight"] if takes_weight else [])]
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            where = " (shared: give it under the top-level `parameters`)" if set(unknown) & set(shared_names) else ""
            raise ConfigError(f"models[{i}].parameters {unknown} have no hf_mloss equivalent for mergekit "
                              f"`{method}`{where}; per-model parameters: {allowed or 'none'}.")
        for key in allowed:
            if key == "weight":
                value = params.get(key, global_params.get(key))
                if value is None:
                    raise ConfigError(f"models[{i}].parameters.weight is missing; mergekit requires a weight on "
                                      "every model (e.g. parameters: {weight: 1.0}).")
                weights.append(_model_weight(value, f"models[{i}].parameters.weight"))
                continue
            value = _layered([params.get(key), global_params.get(key)], per_model[key][1])
            _check_number(value, f"models[{i}].parameters.{key}", schedule=True)
            values[key].append(value if is_schedule(value) else float(value))
        models.append(model)
    _check_model_count(method, len(models))
    out: dict[str, Any] = {"base": base, "models": models, "method": method}
    parameters: dict[str, Any] = {}
    if method == "slerp":
        if "t" not in global_params:
            raise ConfigError("mergekit `slerp` needs `parameters: {t: ...}` (0 gives the base_model, 1 the other "
                              "model).")
        _check_number(global_params["t"], "parameters.t", schedule=True)
        if is_schedule(global_params["t"]) and all(f is not None for f, _ in
                                                   ParamSchedule.parse(global_params["t"], "parameters.t").entries):
            raise ConfigError("mergekit `slerp` needs t for every tensor and these filters may leave some without "
                              "one (mergekit then fails); end the list with a `{value: ...}` entry without filter.")
        parameters["t"] = _map_values(global_params["t"], float)
    elif method == "model_stock":
        parameters["filter_wise"] = _check_flag(_layered([global_params.get("filter_wise")], False),
                                                "parameters.filter_wise")
    elif method == "sce":
        topk = _layered([global_params.get("select_topk")], 1.0)
        _check_number(topk, "parameters.select_topk", schedule=True)
        parameters["select_topk"] = _map_values(topk, float)
        _check_flag(global_params.get("int8_mask", False), "parameters.int8_mask")  # storage only: same values
    else:
        for key, (ours, _) in per_model.items():
            parameters[ours] = _shared_or_per_model(values[key], ours, models)
        normalize, rescale = DEFAULTS[method]
        lam = _layered([global_params.get("lambda")], 1.0)
        _check_number(lam, "parameters.lambda", schedule=True)
        parameters.update(lam=_map_values(lam, float),
                          normalize=_check_flag(_layered([global_params.get("normalize")], normalize),
                                                "parameters.normalize"))
        rescale = _check_flag(_layered([global_params.get("rescale")], rescale), "parameters.rescale")
        parameters["rescale"] = _map_values(rescale, lambda on: "l1" if on else "none")
        _check_flag(global_params.get("int8_mask", False), "parameters.int8_mask")  # storage only: same values
    return _finish(out, parameters, models, weights, config)  # slerp, model_stock: no weights


NUSLERP_SHARED = {"nuslerp_flatten": ("flatten", True), "nuslerp_row_wise": ("row_wise", False)}
"""mergekit ``nuslerp``'s shared parameters → (hf_mloss name, mergekit default)."""


def _nuslerp_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The hf_mloss config of a mergekit ``nuslerp`` config: two models and their weights (t = w₂ / (w₁ + w₂)).

    With a ``base_model`` their task vectors are interpolated (the base listed under ``models`` is skipped, as in
    mergekit); without, the models themselves, the first giving the architecture.
    """
    global_params = _mapping(config.get("parameters"), "parameters")
    unknown = sorted(set(global_params) - {*NUSLERP_SHARED, "weight"})
    if unknown:
        raise ConfigError(f"mergekit `nuslerp` has no parameter(s) {unknown} hf_mloss can map; it reads "
                          f"{sorted({*NUSLERP_SHARED, 'weight'})}.")
    base = _model_entry(config["base_model"], "base_model") if config.get("base_model") else None
    entries = config.get("models")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(MODELS_OR_SLICES)
    models, weights = [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "model" not in entry or set(entry) - {"model", "parameters"}:
            raise ConfigError(f"models[{i}] must be a mapping with `model` (and optional `parameters`), got "
                              f"{short(entry)}.")
        model = _model_entry(entry["model"], f"models[{i}].model")
        if model == base:
            continue
        params = _mapping(entry.get("parameters"), f"models[{i}].parameters")
        if set(params) - {"weight"}:
            raise ConfigError(f"models[{i}].parameters {sorted(set(params) - {'weight'})} have no hf_mloss "
                              "equivalent for mergekit `nuslerp` (per-model parameters: weight).")
        weight = params.get("weight", global_params.get("weight"))
        if weight is None:
            raise ConfigError(f"models[{i}].parameters.weight is missing; mergekit `nuslerp` sets t from the two "
                              "models' weights (e.g. parameters: {weight: 0.5}).")
        _check_number(weight, f"models[{i}].parameters.weight")
        models.append(model)
        weights.append(float(weight))
    if len(models) != 2:
        raise ConfigError(f"mergekit `nuslerp` interpolates exactly two models besides the base_model, got "
                          f"{len(models)}.")
    if "lora_of" in (base or {}) or any("lora_of" in m for m in models):
        _check_lora_bases(base or dict(models[0]), models)
    parameters: dict[str, Any] = {"task_vectors": base is not None}
    for key, (ours, default) in NUSLERP_SHARED.items():
        parameters[ours] = _check_flag(_layered([global_params.get(key)], default), f"parameters.{key}")
    out: dict[str, Any] = {"base": base or {k: v for k, v in models[0].items() if k != "lora_of"}, "models": models,
                           "method": "nuslerp"}
    return _finish(out, parameters, models, weights, config)


def _shared_config(config: Mapping[str, Any], method: str) -> dict[str, Any]:
    """The hf_mloss config of a mergekit method from :data:`SHARED_METHODS` (multislerp, karcher, nearswap,
    arcee_fusion, ram, ramplus_tl): the shared parameters under the same names with mergekit's defaults, the
    ``weight`` of each model where the method takes one, the base as mergekit treats it."""
    spec = SHARED_METHODS[method]
    takes = sorted([*spec["shared"], *(["weight"] if spec["weight"] else [])])
    global_params = _mapping(config.get("parameters"), "parameters")
    unknown = sorted(set(global_params) - set(takes))
    if unknown:
        raise ConfigError(f"mergekit `{method}` has no parameter(s) {unknown} hf_mloss can map; it reads {takes}.")
    base = _model_entry(config["base_model"], "base_model") if config.get("base_model") else None
    if base is None and spec["base"] == "required":
        raise ConfigError(f"mergekit `{method}` needs a `base_model`; add `base_model: org/name`.")
    entries = config.get("models")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(MODELS_OR_SLICES)
    models, weights = [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "model" not in entry or set(entry) - {"model", "parameters"}:
            raise ConfigError(f"models[{i}] must be a mapping with `model` (and optional `parameters`), got "
                              f"{short(entry)}.")
        model = _model_entry(entry["model"], f"models[{i}].model")
        if "lora_of" in model:
            raise ConfigError(f"models[{i}]: a LoRA adapter has no hf_mloss equivalent for mergekit `{method}`; "
                              "merge it into its model first.")
        params = _mapping(entry.get("parameters"), f"models[{i}].parameters")
        if model == base and spec["base"] != "input":
            continue
        extra = sorted(set(params) - ({"weight"} if spec["weight"] else set()))
        if extra:
            where = " (shared: give it under the top-level `parameters`)" if set(extra) & set(spec["shared"]) else ""
            raise ConfigError(f"models[{i}].parameters {extra} have no hf_mloss equivalent for mergekit `{method}`"
                              f"{where}; per-model parameters: {['weight'] if spec['weight'] else 'none'}.")
        if spec["weight"]:
            weight = params.get("weight", global_params.get("weight"))
            if weight is None:
                raise ConfigError(f"models[{i}].parameters.weight is missing; mergekit `{method}` requires a weight "
                                  "on every model (e.g. parameters: {weight: 1.0}).")
            _check_number(weight, f"models[{i}].parameters.weight")
            weights.append(float(weight))
        models.append(model)
    if spec["base"] == "input" and base is not None and base not in models:
        models.append(base)  # mergekit adds the base_model to the inputs, where this method averages it in
    if "count" in spec and len(models) != spec["count"]:
        raise ConfigError(f"mergekit `{method}` takes the base_model and exactly {spec['count']} other model(s), "
                          f"got {len(models)}.")
    if not models:
        raise ConfigError(f"mergekit `{method}` lists no model besides the base_model.")
    parameters: dict[str, Any] = {}
    if method == "multislerp":
        parameters["task_vectors"] = base is not None
    for key, (default, kind) in spec["shared"].items():
        value = _layered([global_params.get(key)], default)
        if value is REQUIRED:
            raise ConfigError(f"mergekit `{method}` needs `parameters: {{{key}: ...}}` (it has no default).")
        if isinstance(value, list) and any(isinstance(e, Mapping) and e.get("value") is REQUIRED for e in value):
            raise ConfigError(f"mergekit `{method}` needs {key} for every tensor and these filters may leave some "
                              "without one (mergekit then fails); end the list with a `{value: ...}` entry without "
                              "filter.")
        if kind is bool:
            parameters[key] = _check_flag(value, f"parameters.{key}")
        else:
            _check_number(value, f"parameters.{key}", schedule=True)
            parameters[key] = _map_values(value, kind)
    # no base_model: the first model gives the architecture only
    out: dict[str, Any] = {"base": base or dict(models[0]), "models": models, "method": method}
    return _finish(out, parameters, models, weights, config)


def _finish(out: dict[str, Any], parameters: dict[str, Any], models: list[dict[str, Any]], weights: list[float],
            config: Mapping[str, Any]) -> dict[str, Any]:
    """The hf_mloss config: the models' weights, the method parameters and the dtype (``out_dtype``, else ``dtype``)."""
    for entry, weight in zip(models, weights):
        if is_schedule(weight):  # a gradient / filter list: resolved per tensor (models[i].parameters.weight)
            entry.setdefault("parameters", {})["weight"] = weight
        else:
            entry["weight"] = weight
    out["parameters"] = parameters
    dtype = config.get("out_dtype") or config.get("dtype")
    if dtype is not None:
        out["dtype"] = dtype
    return out


def _check_model_count(method: str, count: int) -> None:
    if method == "slerp" and count != 1:
        raise ConfigError(f"mergekit `slerp` interpolates the base_model with exactly one other model; the config "
                          f"lists {count} model(s) besides the base_model.")
    if method == "model_stock" and count < 2:
        raise ConfigError(f"mergekit `model_stock` needs at least 2 models besides the base_model, got {count}.")
    if count == 0:
        raise ConfigError(f"mergekit `{method}` lists no model besides the base_model.")


def _check_number(value: Any, where: str, *, schedule: bool = False) -> None:
    """A number, or (``schedule``) a gradient / filter list of numbers (see :mod:`hf_mloss.spec.schedule`)."""
    if schedule and is_schedule(value):
        try:
            leaves = ParamSchedule.parse(value, where).leaves()
        except InvalidParameterError as err:
            raise ConfigError(str(err)) from None
        for leaf in leaves:
            _check_number(leaf, where)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a number, a gradient or a filter list" if schedule else \
            "one number (model weights do not vary over the layers here)"
        raise ConfigError(f"{where} must be {kind}, got {short(value)}.")
    if not is_finite(value):
        raise ConfigError(f"{where} must be a finite number, got {short(value)}.")
    try:
        check_float32(where, float(value))
    except InvalidParameterError as err:
        raise ConfigError(str(err)) from None


def _check_flag(value: Any, where: str) -> Any:
    """true / false, or a gradient / filter list of them."""
    leaves = ParamSchedule.parse(value, where).leaves() if is_schedule(value) else [value]
    if not all(isinstance(leaf, bool) for leaf in leaves):
        raise ConfigError(f"{where} must be true or false (or a filter list of them), got {short(value)}.")
    return value


def _layered(values: list[Any], default: Any) -> Any:
    """One value from mergekit's scopes, most specific first: a filter list that matches no tensor falls through to
    the next scope, then to mergekit's ``default`` (a scalar or gradient always matches)."""
    entries: list[Any] = []
    for value in values:
        if value is None:
            continue
        if isinstance(value, Mapping) or (isinstance(value, list) and value and
                                          all(isinstance(v, Mapping) for v in value)):
            entries.extend([value] if isinstance(value, Mapping) else value)
            if any(e.get("filter") in (None, "*") for e in entries):
                break  # an entry without a filter always matches
            continue
        entries.append({"value": value})
        break
    else:
        entries.append({"value": default})
    if len(entries) == 1 and "filter" not in entries[0]:
        return entries[0]["value"]
    return entries


def _map_values(value: Any, fn: Any) -> Any:
    """``value`` (a scalar, gradient or filter list) with ``fn`` applied to every scalar in it."""
    if isinstance(value, Mapping):
        return {**value, "value": _map_values(value["value"], fn)}
    if isinstance(value, list):
        return [_map_values(v, fn) for v in value]
    return fn(value)


def _sliced_config(config: Mapping[str, Any], method: str) -> dict[str, Any]:
    """The hf_mloss config of a mergekit config with ``slices`` (see :mod:`hf_mloss.spec.slices`).

    ``passthrough``: the base is the ``base_model``, else the first slice's model (whose config the output takes, as
    in mergekit); the others are the models. Other methods: the config as if its models were listed once under
    ``models`` (each model's ``parameters`` must be the same in every slice), with the slices recorded by index.
    """
    if config.get("models"):
        raise ConfigError("The mergekit config has both `models` and `slices`; give one of them.")
    slices = config["slices"]
    if not isinstance(slices, list) or not slices:
        raise ConfigError(f"mergekit slices must be a non-empty list of {{sources: [...]}} entries, got "
                          f"{short(slices)}.")
    order: list[Any] = []  # distinct models, in the order the slices name them
    params: dict[str, Any] = {}
    raw: dict[str, Any] = {}  # the model as the config spells it
    plain: list[list[tuple[str, Any]]] = []
    slice_params: list[dict[str, Any]] = []
    for s, entry in enumerate(slices):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("sources"), list) or not entry["sources"]:
            raise ConfigError(f"mergekit slices[{s}] must be {{sources: [{{model: ..., layer_range: [a, b]}}]}}, got "
                              f"{short(entry)}.")
        extra = sorted(set(entry) - {"sources", "parameters"})
        if extra:
            raise ConfigError(f"mergekit slices[{s}] keys {extra} (a per-slice base_model) have no hf_mloss "
                              "equivalent; give the base_model at the top level.")
        slice_params.append(_mapping(entry.get("parameters"), f"slices[{s}].parameters"))
        row = []
        for k, source in enumerate(entry["sources"]):
            where = f"slices[{s}].sources[{k}]"
            if not isinstance(source, Mapping) or "model" not in source or "layer_range" not in source or \
                    set(source) - {"model", "layer_range", "parameters"}:
                raise ConfigError(f"mergekit {where} must be {{model: ..., layer_range: [start, end]}} (and optional "
                                  f"parameters), got {short(source)}.")
            model = _model_entry(source["model"], f"{where}.model")
            if "lora_of" in model:
                raise ConfigError(f"mergekit {where}: a LoRA adapter in a slice has no hf_mloss equivalent; merge it "
                                  "into its model first.")
            key = repr(sorted(model.items()))
            if key not in params:
                order.append(model)
                raw[key] = source["model"]
                params[key] = source.get("parameters")
            elif source.get("parameters") != params[key]:
                raise ConfigError(f"mergekit {where}: {model['model']!r} has other parameters than in an earlier "
                                  f"slice ({short(source.get('parameters'))} vs {short(params[key])}); hf_mloss uses "
                                  "one set per model for every slice.")
            row.append((key, source["layer_range"]))
        plain.append(row)
    base = _model_entry(config["base_model"], "base_model") if config.get("base_model") else dict(order[0])
    if method == "passthrough":
        _check_tokenizer(config)
        if config.get("parameters") or any(params.values()):
            raise ConfigError("mergekit passthrough parameters (scale) have no hf_mloss equivalent; remove them.")
        models = [m for m in order if m != base]
        out: dict[str, Any] = {"base": base, "models": models, "method": "passthrough"}
        index = {repr(sorted(m.items())): i for i, m in enumerate([base, *models])}
        dtype = config.get("out_dtype") or config.get("dtype")
        if dtype is not None:
            out["dtype"] = dtype
    else:
        listed = [m for m in order if method == "linear" or m != base]
        flat = {k: v for k, v in config.items() if k != "slices"}
        keys = [repr(sorted(m.items())) for m in listed]
        flat["models"] = [{"model": raw[k], **({"parameters": params[k]} if params[k] is not None else {})}
                          for k in keys]
        out = from_mergekit(flat)
        overrides = [_slice_parameters(flat, given, out["parameters"], s) for s, given in enumerate(slice_params)]
        index = {}
        for i, m in enumerate([out["base"], *out["models"]]):
            plain_model = {k: v for k, v in m.items() if k in ("model", "revision")}
            index.setdefault(repr(sorted(plain_model.items())), i)
        if method == "linear":  # the sources are the models; the base only gives the architecture
            index.update({repr(sorted({k: v for k, v in m.items() if k in ("model", "revision")}.items())): i + 1
                          for i, m in enumerate(out["models"])})
    if method == "passthrough" and any(slice_params):
        raise ConfigError("mergekit passthrough parameters (scale) have no hf_mloss equivalent; remove them.")
    out["slices"] = [{"sources": [{"model": index[key], "layer_range": bounds} for key, bounds in row]}
                     for row in plain]
    if method != "passthrough":
        for entry, own in zip(out["slices"], overrides):
            if own:
                entry["parameters"] = own
    return out


PER_MODEL_KEYS = ("weight", "density", "gamma", "epsilon")
"""mergekit parameters resolved per model: a slice's value would be each model's fallback (not mapped yet)."""


def _slice_parameters(flat: dict[str, Any], given: dict[str, Any], top: dict[str, Any], s: int) -> dict[str, Any]:
    """The hf_mloss parameters slice ``s`` sets: mergekit reads a slice's ``parameters`` before the top-level ones,
    a filter list that matches no tensor falling through to them; those that differ from ``top`` are returned."""
    if not given:
        return {}
    per_model = sorted(set(given) & set(PER_MODEL_KEYS))
    if per_model:
        raise ConfigError(f"mergekit slices[{s}].parameters {per_model} are per-model parameters; a slice-wide "
                          "value of them has no hf_mloss equivalent yet: give them per source or at the top level.")
    top_level = dict(flat.get("parameters") or {})
    combined = {**top_level}
    for key, value in given.items():
        combined[key] = _fall_through(value, top_level.get(key))
    try:
        mapped = from_mergekit({**flat, "parameters": combined})["parameters"]
    except ConfigError as err:
        raise ConfigError(f"mergekit slices[{s}].parameters: {err}") from None
    return {k: v for k, v in mapped.items() if repr(v) != repr(top.get(k))}


def _fall_through(value: Any, below: Any) -> Any:
    """A slice's value with the top-level one as the fallback of its filters (mergekit's scope order)."""
    if below is None or not is_schedule(value) or isinstance(value, list) and value and \
            not all(isinstance(v, Mapping) for v in value):
        return value  # a scalar or gradient always matches
    entries = [value] if isinstance(value, Mapping) else list(value)
    if any(e.get("filter") in (None, "*") for e in entries):
        return entries
    lower = [below] if isinstance(below, Mapping) else below if isinstance(below, list) and below and \
        all(isinstance(v, Mapping) for v in below) else [{"value": below}]
    return entries + list(lower)
