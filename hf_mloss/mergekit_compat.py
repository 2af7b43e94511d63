"""Reading mergekit YAML configs: the methods both libraries share, mapped to hf_mloss's with the same results.

| mergekit | hf_mloss |
|---|---|
| ``linear`` (``normalize: true``, no ``base_model``) | ``average`` of the models with their ``weight`` |
| ``task_arithmetic`` | ``task_arithmetic``, ``lam`` = ``lambda`` (mergekit's default 1), weights as given (÷ Σw with ``normalize``) |
| ``ties`` (``normalize: true``) | ``ties``, ``convention: mergekit``, ``k`` = ``density`` (one value for all models), ``lam`` = ``lambda`` |
| ``dare_ties`` (``normalize: true``) / ``dare_linear`` | ``dare_ties`` / ``dare_linear``, ``p`` = ``density``, ``rescale: l1`` (mergekit's masks are drawn from another random stream) |

``base_model`` becomes ``base`` (``org/name@revision`` is split), ``out_dtype`` (else ``dtype``) becomes ``dtype``; the
arithmetic runs in float32 either way. Per-model parameters default as mergekit 0.1.5 defines them: ``density`` 1.0
(keep everything) where a model omits it, ``weight`` required on every model. ``tokenizer_source: base`` (or none) is
accepted: the base's processor is copied; other tokenizer sources and ``tokenizer:`` sections merge vocabularies,
which hf_mloss cannot do yet. ``base+adapter`` entries (and ``{model: ..., lora: ...}``) name a PEFT LoRA adapter of
the base (:mod:`hf_mloss.lora`). Anything else (slices, gradients, other methods) and any malformed shape (a list
where one name or a mapping belongs) is refused in one line naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._validation import short
from .errors import ConfigError

METHODS = {"linear": "average", "task_arithmetic": "task_arithmetic", "ties": "ties", "dare_ties": "dare_ties",
           "dare_linear": "dare_linear"}
TOP_LEVEL = ("merge_method", "base_model", "models", "parameters", "dtype", "out_dtype", "tokenizer_source",
             "tokenizer", "chat_template", "name")
IGNORED = ("tokenizer_source", "tokenizer", "chat_template", "name")
"""Keys about text models' tokenizers (and labels): only their no-op values are accepted (see _check_tokenizer)."""
DEFAULT_DENSITY = 1.0
"""mergekit's default ``density`` for a model that gives none (generalized task arithmetic methods, 0.1.5)."""


def from_mergekit(config: Mapping[str, Any]) -> dict[str, Any]:
    """The hf_mloss config dict equivalent to a mergekit config dict.

    Raises:
        ConfigError: an option with no hf_mloss equivalent (the message names it).
    """
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
    global_params = _mapping(config.get("parameters"), "parameters")
    models, weights, densities = _models(config.get("models"))
    if config.get("base_model"):
        base = _model_entry(config["base_model"], "base_model")
        if method == "linear":
            raise ConfigError("mergekit `linear` with a base_model averages the base in too; list it under `models` "
                              "with its weight instead (hf_mloss then averages exactly those models).")
    elif method == "linear":
        base = dict(models[0])  # an average needs no base: the first model only provides the architecture
    else:
        raise ConfigError(f"The mergekit config has no base_model; `{method}` merges fine-tunes of one base: add "
                          "`base_model: org/name`.")
    _check_lora_bases(base, models)
    out: dict[str, Any] = {"base": base, "models": models, "method": METHODS[method]}
    normalize = global_params.pop("normalize", method in ("linear", "ties"))
    lam = global_params.pop("lambda", 1.0)
    if not isinstance(normalize, bool):
        raise ConfigError(f"mergekit parameters.normalize must be true or false, got {short(normalize)}.")
    if isinstance(lam, bool) or not isinstance(lam, (int, float)):
        raise ConfigError(f"mergekit parameters.lambda must be one number, got {short(lam)}.")
    if global_params:
        raise ConfigError(f"mergekit parameters {sorted(global_params)} have no hf_mloss equivalent.")
    parameters: dict[str, Any] = {}
    if method in ("ties", "dare_ties", "linear") and not normalize:
        raise ConfigError(f"mergekit `{method}` with normalize: false (a plain sum) has no hf_mloss equivalent; "
                          "use normalize: true, or task_arithmetic for a weighted sum.")
    if normalize and abs(sum(weights)) < 1e-8:
        raise ConfigError(f"mergekit parameters.normalize: true divides by the sum of the models' weights, which is "
                          f"{sum(weights):g}; give weights that do not sum to 0.")
    if method == "task_arithmetic" and normalize:
        total = sum(weights)
        weights = [w / total for w in weights]
    if method != "linear":
        parameters["lam"] = lam
    if method == "ties":
        parameters.update(k=_one_density(densities), convention="mergekit")
    elif method.startswith("dare"):
        parameters.update(p=_one_density(densities), rescale="l1")
    elif any(d is not None for d in densities):
        raise ConfigError(f"mergekit `{method}` takes no density.")
    for entry, weight in zip(models, weights):
        entry["weight"] = weight
    out["parameters"] = parameters
    dtype = config.get("out_dtype") or config.get("dtype")
    if dtype is not None:
        out["dtype"] = dtype
    return out


def _models(entries: Any) -> tuple[list[dict[str, Any]], list[float], list[float | None]]:
    if not isinstance(entries, list) or not entries:
        raise ConfigError("The mergekit config needs a non-empty `models` list (slices are not supported).")
    models, weights, densities = [], [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "model" not in entry:
            raise ConfigError(f"models[{i}] must be a mapping with `model` (and optional `parameters`), got "
                              f"{short(entry)}.")
        params = _mapping(entry.get("parameters"), f"models[{i}].parameters")
        if "weight" not in params:
            raise ConfigError(f"models[{i}].parameters.weight is missing; mergekit requires a weight on every model "
                              "(e.g. parameters: {weight: 1.0}).")
        weight = params.pop("weight")
        density = params.pop("density", None)
        if params or set(entry) - {"model", "parameters"}:
            raise ConfigError(f"models[{i}]: only `parameters.weight` and `parameters.density` have hf_mloss "
                              f"equivalents, got {sorted(params) or sorted(set(entry) - {'model', 'parameters'})}.")
        for name, value in (("weight", weight), ("density", density)):
            if (name == "weight" or value is not None) and (isinstance(value, bool) or not isinstance(
                    value, (int, float))):
                raise ConfigError(f"models[{i}].parameters.{name} must be one number (gradients and per-tensor "
                                  f"filters are not supported), got {short(value)}.")
        models.append(_model_entry(entry["model"], f"models[{i}].model"))
        weights.append(float(weight))
        densities.append(None if density is None else float(density))
    return models, weights, densities


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"mergekit {where} must be a mapping (e.g. {{weight: 1.0, density: 0.5}}), got "
                          f"{short(value)}.")
    return dict(value)


def _check_tokenizer(config: Mapping[str, Any]) -> None:
    """Accept the tokenizer options that keep the base's (what a vision merge does); refuse vocabulary merges."""
    source = config.get("tokenizer_source")
    tokenizer = config.get("tokenizer")
    if isinstance(tokenizer, Mapping) and set(tokenizer) <= {"source"}:
        source, tokenizer = tokenizer.get("source", source), None
    for key, value in (("tokenizer_source", source), ("tokenizer", tokenizer)):
        if value is not None and value != "base":
            raise ConfigError(f"mergekit {key}: {short(value, 40)} merges or swaps vocabularies, which hf_mloss "
                              "cannot do yet (vocabularies cannot be merged yet); remove it or use "
                              "tokenizer_source: base (the base's processor is copied).")


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


def _one_density(given: list[float | None]) -> float:
    densities = [DEFAULT_DENSITY if d is None else d for d in given]  # mergekit's default for a model without one
    if len(set(densities)) > 1:
        raise ConfigError(f"Per-model densities {densities} differ; hf_mloss uses one keep fraction for all models.")
    return densities[0]
