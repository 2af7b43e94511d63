"""``MoEConfig``: a mixture of experts built from dense fine-tunes, described by mergekit-moe's YAML.

```yaml
base_model: org/llama-base          # donor of attention, norms, embeddings, config and tokenizer
gate_mode: hidden                   # hidden (default) | cheap_embed | random | uniform_random | hidden_avg
dtype: bfloat16                     # of the output (default: the base's)
experts_per_token: 2
experts:
  - source_model: org/llama-math    # a dense fine-tune of the base: its MLP becomes expert 0
    positive_prompts: ["Solve 2x + 3 = 7"]
    negative_prompts: ["Write a poem"]   # optional: subtracted from the positive direction
    noise_scale: 0.01                    # optional: Gaussian noise added to the expert's weights
    residual_scale: 0.5                  # optional: scales the expert's down projection
  - source_model: org/llama-code
    positive_prompts: ["def f(x):"]
shared_experts: []                  # one, for Qwen2-MoE output only
architecture: mixtral               # optional: mixtral | qwen (Qwen2-MoE) | qwen3 (Qwen3-MoE), a name prefix
seed: 0                             # hf_mloss: the random draws of gate_mode random / uniform_random and noise_scale
prompt_dtype: bfloat16              # hf_mloss: the prompt pass's dtype (bfloat16: mergekit's rows, bit for bit)
```

mergekit-moe's own checks (at least ``experts_per_token`` experts, prompts for every expert unless the gate mode is
``random``, prompts that tell the experts apart, experts that are not all one model) run when the config is built
and raise :class:`~hf_mloss.ConfigError` naming the option. Unlike mergekit, unknown keys are refused (a typo would
otherwise change the model silently). Relative local paths resolve against the config file's folder.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .._validation import check_float32, check_keys, did_you_mean, is_finite, short
from ..errors import ConfigError, InvalidParameterError
from ..spec.config import MAX_CONFIG_BYTES, _refuse_tokens, _relative, _resolve_model_path
from ..spec.mergekit import _model_entry

GATE_MODES = ("hidden", "cheap_embed", "random", "uniform_random", "hidden_avg", "hidden_last")
"""mergekit-moe's gate modes (``hidden_avg`` and ``hidden_last`` are mergekit's undocumented variants)."""
PROMPTLESS_MODES = ("random",)
"""Gate modes that read no prompts (mergekit exempts only ``random`` from its prompt checks)."""
DTYPES = ("bfloat16", "float16", "float32")
"""Output dtypes: those transformers' MoE layers run in (their grouped matrix products refuse float64)."""
MAX_SEED = 2**64 - 1
"""The largest seed ``torch.Generator.manual_seed`` takes."""
EXPERT_KEYS = ("source_model", "positive_prompts", "negative_prompts", "noise_scale", "residual_scale", "revision")
TOP_KEYS = ("base_model", "experts", "gate_mode", "dtype", "experts_per_token", "shared_experts", "architecture",
            "seed", "allow_identical_experts", "base_revision", "prompt_dtype")
PROMPT_DTYPES = ("bfloat16", "float32")
"""The dtypes of the prompt pass that gives the ``hidden`` router rows: mergekit-moe's bfloat16 (the default: its rows
bit for bit), or float32 (several times faster on a CPU without bfloat16 units; rows within rounding of those)."""

REQUIRED_VALUES = {"gate_mode": "hidden", "experts_per_token": 2, "seed": 0, "allow_identical_experts": False,
                   "prompt_dtype": "bfloat16"}
"""Top-level keys that take a value when given (mergekit-moe's ``gate_mode`` and ``experts_per_token`` are not
optional, ``seed`` and ``allow_identical_experts`` are hf_mloss's): ``null`` is refused, not read as the default."""


@dataclass(frozen=True)
class ExpertSpec:
    """One dense fine-tune whose MLP becomes an expert (``source_model``: a Hub id or an absolute local path)."""

    source_model: str
    positive_prompts: tuple[str, ...] = ()
    negative_prompts: tuple[str, ...] = ()
    noise_scale: float | None = None
    residual_scale: float | None = None
    revision: str | None = None

    @property
    def prompts(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return self.positive_prompts, self.negative_prompts

    @property
    def label(self) -> str:
        """The model's short name (Hub id, else the folder name), as cards and summaries show it."""
        return self.source_model if not os.path.isabs(self.source_model) else Path(self.source_model).name

    def to_dict(self, root: Path | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"source_model": _written(self.source_model, root)}
        if self.revision:
            out["revision"] = self.revision
        for key in ("positive_prompts", "negative_prompts"):
            if getattr(self, key):
                out[key] = list(getattr(self, key))
        for key in ("noise_scale", "residual_scale"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass(frozen=True)
class MoEConfig:
    """What ``hf-mloss moe`` builds (see the module docstring); every check runs when it is built."""

    base_model: str
    experts: tuple[ExpertSpec, ...]
    gate_mode: str = "hidden"
    dtype: str | None = None
    experts_per_token: int = 2
    shared_experts: tuple[ExpertSpec, ...] = ()
    architecture: str | None = None
    seed: int = 0
    allow_identical_experts: bool = False
    """mergekit's ``--i-understand-this-is-not-useful-without-training``: accept experts that are all one model."""
    base_revision: str | None = None
    prompt_dtype: str = "bfloat16"
    """The dtype the base reads the prompts in for the ``hidden`` router rows (:data:`PROMPT_DTYPES`)."""
    source: str | None = field(default=None, compare=False)
    """The YAML file it was read from (an input of the run: never overwritten)."""

    def __post_init__(self) -> None:
        check_config(self)

    # ------------------------------------------------------------------------------------------------ reading
    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **overrides: Any) -> MoEConfig:
        """Read mergekit-moe's YAML (relative paths against the file's folder); ``overrides`` replace its top-level
        keys (``allow_identical_experts=True``: mergekit's command-line flag).

        Raises:
            ConfigError: the file is missing, not YAML, or describes an MoE that cannot be built.
        """
        from .._yaml import load_yaml

        path = Path(path)
        content = load_yaml(path, max_bytes=MAX_CONFIG_BYTES, needs="`base_model` and `experts`")
        if overrides and isinstance(content, Mapping):
            content = {**content, **overrides}
        try:
            config = cls.from_dict(content, base_dir=path.resolve().parent)
        except ConfigError as err:
            raise ConfigError(f"Invalid MoE config {str(path)!r}: {err}") from None
        return replace(config, source=os.fspath(path))

    @classmethod
    def from_dict(cls, content: Any, base_dir: str | os.PathLike[str] | None = None) -> MoEConfig:
        """Build from a mapping with mergekit-moe's keys (plus hf_mloss's ``seed``)."""
        if not isinstance(content, Mapping):
            raise ConfigError(f"An MoE config is a mapping with base_model and experts, got {short(content)}.")
        if "merge_method" in content or "models" in content:
            raise ConfigError("This looks like a merge config (merge_method / models); `hf-mloss moe` reads "
                              "mergekit-moe's config (base_model, experts with source_model and prompts). Run "
                              "`hf-mloss merge` for merges.")
        check_keys(content, TOP_KEYS, "key in the MoE config", error=ConfigError)
        _refuse_tokens(content, "")  # the recipe, prompts included, is written into the folder a user publishes
        root = Path(base_dir) if base_dir is not None else None
        if "base_model" not in content:
            raise ConfigError("base_model is required: the dense model whose attention, embeddings, config and "
                              "tokenizer the MoE takes.")
        base, base_revision = _source(content["base_model"], "base_model", root)
        experts = content.get("experts")
        if not isinstance(experts, list) or not experts:
            raise ConfigError(f"experts must be a non-empty list of {{source_model: ..., positive_prompts: [...]}}, "
                              f"got {short(experts)}.")
        shared = content.get("shared_experts")
        shared = [] if shared is None else shared
        if not isinstance(shared, list):
            raise ConfigError(f"shared_experts must be a list (of at most one expert), got {short(shared)}.")
        for key in REQUIRED_VALUES:  # mergekit-moe refuses null there too; a default would change the model silently
            if key in content and content[key] is None:
                raise ConfigError(f"{key} is null; give it a value or leave the key out (default: "
                                  f"{REQUIRED_VALUES[key]!r}).")
        values = {k: content[k] for k in ("gate_mode", "dtype", "experts_per_token", "architecture", "seed",
                                          "allow_identical_experts", "prompt_dtype") if content.get(k) is not None}
        return cls(base_model=base, base_revision=content.get("base_revision") or base_revision,
                   experts=tuple(_expert(e, f"experts[{i}]", root) for i, e in enumerate(experts)),
                   shared_experts=tuple(_expert(e, f"shared_experts[{i}]", root) for i, e in enumerate(shared)),
                   **values)

    # ------------------------------------------------------------------------------------------------ writing
    def to_dict(self, root: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """mergekit-moe's YAML (mergekit ignores hf_mloss's keys: ``revision``, ``seed``); local paths relative to
        ``root`` when they share a project with it."""
        where = Path(root) if root is not None else None
        out: dict[str, Any] = {"base_model": _written(self.base_model, where)}
        if self.base_revision:
            out["base_revision"] = self.base_revision
        out.update(gate_mode=self.gate_mode, dtype=self.dtype, experts_per_token=self.experts_per_token)
        if self.architecture:
            out["architecture"] = self.architecture
        out["experts"] = [e.to_dict(where) for e in self.experts]
        if self.shared_experts:
            out["shared_experts"] = [e.to_dict(where) for e in self.shared_experts]
        out["seed"] = self.seed
        if self.allow_identical_experts:
            out["allow_identical_experts"] = True
        if self.prompt_dtype != "bfloat16":
            out["prompt_dtype"] = self.prompt_dtype
        return {k: v for k, v in out.items() if v is not None}

    def to_yaml(self, root: str | os.PathLike[str] | None = None) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(root), sort_keys=False, allow_unicode=True, width=100)

    # ------------------------------------------------------------------------------------------------ views
    @property
    def all_experts(self) -> tuple[ExpertSpec, ...]:
        return (*self.experts, *self.shared_experts)

    @property
    def uses_prompts(self) -> bool:
        return self.gate_mode not in PROMPTLESS_MODES

    @property
    def draws_random(self) -> bool:
        """Whether ``seed`` matters: random gates or noise."""
        return self.gate_mode in ("random", "uniform_random") or any(e.noise_scale for e in self.all_experts)

    def input_paths(self) -> list[str]:
        """Every local path the build reads (an output folder must not be one, inside one or hold one)."""
        paths = [m for m in (self.base_model, *(e.source_model for e in self.all_experts)) if os.path.isabs(m)]
        return list(dict.fromkeys([*paths, *([self.source] if self.source else [])]))


# ---------------------------------------------------------------------------------------------------- checks
def check_config(config: MoEConfig) -> None:
    """mergekit-moe's checks (``is_bad_config``, in its order) and hf_mloss's, as one :class:`ConfigError` each."""
    if config.gate_mode not in GATE_MODES:
        raise ConfigError(f"gate_mode {short(config.gate_mode)}{did_you_mean(config.gate_mode, GATE_MODES)} is not "
                          f"one of {list(GATE_MODES)}.")
    if config.dtype is not None and (not isinstance(config.dtype, str)
                                     or config.dtype.removeprefix("torch.") not in DTYPES):
        why = (" (transformers' MoE layers do not run in float64)" if config.dtype in ("float64", "torch.float64")
               else "")
        raise ConfigError(f"dtype {short(config.dtype)} is not one of {list(DTYPES)}{why} (or leave it out: the "
                          "base's).")
    if config.dtype is not None and config.dtype.startswith("torch."):
        object.__setattr__(config, "dtype", config.dtype.removeprefix("torch."))
    if config.prompt_dtype not in PROMPT_DTYPES:
        raise ConfigError(f"prompt_dtype {short(config.prompt_dtype)} is not one of {list(PROMPT_DTYPES)} "
                          "(bfloat16: mergekit-moe's router rows bit for bit; float32: faster on a CPU without "
                          "bfloat16 units).")
    k = config.experts_per_token
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"experts_per_token must be an integer >= 1, got {short(k)}.")
    if len(config.experts) < k:
        raise ConfigError(f"experts lists {len(config.experts)} expert(s) but experts_per_token is {k}: each token "
                          "is routed to experts_per_token experts, so add experts or lower experts_per_token.")
    if isinstance(config.seed, bool) or not isinstance(config.seed, int) or not 0 <= config.seed <= MAX_SEED:
        raise ConfigError(f"seed must be an integer from 0 to 2**64 - 1, got {short(config.seed)}.")
    for where, revision in [("base_revision", config.base_revision),
                            *((f"{place}.revision", e.revision) for place, e in _named_experts(config))]:
        if revision is not None and (not isinstance(revision, str) or not revision.strip()):
            raise ConfigError(f"{where} must be a branch, tag or commit (a non-empty string), got {short(revision)}.")
    if not isinstance(config.allow_identical_experts, bool):
        raise ConfigError("allow_identical_experts must be true or false, got "
                          f"{short(config.allow_identical_experts)}.")
    if config.architecture is not None and (not isinstance(config.architecture, str) or not config.architecture):
        raise ConfigError("architecture must be a name such as mixtral, qwen or qwen3, got "
                          f"{short(config.architecture)}.")
    if len(config.shared_experts) > 1:
        raise ConfigError(f"shared_experts lists {len(config.shared_experts)} experts; Qwen2-MoE, the one output "
                          "with a shared expert, holds exactly one.")
    if not config.uses_prompts:
        return
    for i, expert in enumerate(config.experts):
        if not expert.positive_prompts:
            raise ConfigError(f"experts[{i}] ({expert.label}) has no positive_prompts: gate_mode "
                              f"{config.gate_mode!r} builds each expert's router row from its prompts (or use "
                              "gate_mode: random).")
    if len(config.experts) == 1:
        raise ConfigError(f"experts lists one expert: gate_mode {config.gate_mode!r} routes between experts by "
                          "their prompts, so add at least one more (mergekit refuses this too).")
    for i, first in enumerate(config.experts):
        for j in range(i + 1, len(config.experts)):
            if config.experts[j].prompts == first.prompts:
                raise ConfigError(
                    f"experts[{i}] and experts[{j}] have identical positive_prompts and negative_prompts, so their "
                    "router rows would be equal and the router could not tell them apart: give each expert prompts "
                    "reflecting what should be routed to it.")
    sources = {(e.source_model, e.revision) for e in config.experts}
    if len(sources) == 1 and len(config.experts) > 1 and not config.allow_identical_experts:
        raise ConfigError(
            "Every expert is the same model: the MoE would use more resources and give the same output as that "
            "model. If you plan to train it after building, set allow_identical_experts: true (mergekit's "
            "--i-understand-this-is-not-useful-without-training).")


def _named_experts(config: MoEConfig) -> list[tuple[str, ExpertSpec]]:
    return [*((f"experts[{i}]", e) for i, e in enumerate(config.experts)),
            *((f"shared_experts[{i}]", e) for i, e in enumerate(config.shared_experts))]


def _written(model: str, root: Path | None) -> str:
    """A model as the recipe writes it: a Hub id as is, a local folder relative to ``root`` (``./`` or ``../``
    first, so it never reads as a Hub id) when they share a project, else absolute."""
    if not os.path.isabs(model):
        return model
    path = _relative(model, root)
    return path if os.path.isabs(path) or path.startswith(".") else f"./{path}"


def _source(value: Any, where: str, root: Path | None) -> tuple[str, str | None]:
    """A model reference as mergekit spells it (``org/name``, ``org/name@rev``, ``{model: {path, revision}}``):
    the resolved path or Hub id and its revision; LoRA adapters (``model+lora``) are refused."""
    entry = _model_entry(value, where)
    if "lora_of" in entry:
        raise ConfigError(f"{where} is a LoRA adapter ({entry['lora_of']}+{entry['model']}); hf-mloss moe reads "
                          "dense fine-tunes: merge the adapter into its model first (merge_and_unload) and name that.")
    model = entry["model"]
    if not isinstance(model, str) or not model.strip():
        raise ConfigError(f"{where} must be a Hub id or a local folder, got {short(model)}.")
    return _resolve_model_path(model, root), entry.get("revision")


def _expert(entry: Any, where: str, root: Path | None) -> ExpertSpec:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where} must be a mapping such as {{source_model: org/name, positive_prompts: [...]}}, "
                          f"got {short(entry)}.")
    check_keys(entry, EXPERT_KEYS, f"key in {where}", error=ConfigError)
    if "source_model" not in entry:
        raise ConfigError(f"{where} has no source_model: the dense fine-tune whose MLP becomes the expert.")
    model, revision = _source(entry["source_model"], f"{where}.source_model", root)
    scales = {}
    for key in ("noise_scale", "residual_scale"):
        value = entry.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not is_finite(value):
                raise ConfigError(f"{where}.{key} must be a finite number, got {short(value)}.")
            try:
                check_float32(f"{where}.{key}", float(value))
            except InvalidParameterError as err:
                raise ConfigError(str(err)) from None
            scales[key] = float(value)
    return ExpertSpec(source_model=model, revision=entry.get("revision") or revision,
                      positive_prompts=_prompts(entry.get("positive_prompts"), f"{where}.positive_prompts"),
                      negative_prompts=_prompts(entry.get("negative_prompts"), f"{where}.negative_prompts"), **scales)


def _prompts(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigError(f"{where} must be a list of strings, got {short(value)}.")
    for i, prompt in enumerate(value):
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"{where}[{i}] must be a non-empty string, got {short(prompt)}.")
    return tuple(value)


def as_moe_config(config: MoEConfig | Mapping[str, Any] | str | os.PathLike[str]) -> MoEConfig:
    """A :class:`MoEConfig` from itself, a mapping (mergekit-moe's keys) or a YAML file."""
    if isinstance(config, MoEConfig):
        return config
    if isinstance(config, Mapping):
        return MoEConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return MoEConfig.from_yaml(config)
    raise ConfigError(f"build_moe takes an MoEConfig, a mapping or a YAML path, got {type(config).__name__}.")
