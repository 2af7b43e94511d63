"""The models an MoE is built from, opened and checked before anything is computed or written: the output
architecture that can hold them, experts shaped like the base, every tensor the MoE needs present, a tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointNotFoundError, IncompatibleCheckpointsError, UnsupportedModelError
from ..loading.hub import ModelRef, resolve_model
from ..loading.store import CheckpointStore
from .architectures import PROJECTIONS, QWEN2_MOE, OutputArchitecture, output_config, select_architecture
from .config import ExpertSpec, MoEConfig

SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "hidden_act")
"""What every dense expert must share with the base: its MLP becomes one of the MoE's layers' experts."""
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class MoEInputs:
    """The opened models (``stores`` by folder: an expert named twice is read from one store)."""

    base: ModelRef
    base_config: Any
    experts: list[ModelRef]
    shared: list[ModelRef]
    stores: dict[str, CheckpointStore]
    architecture: OutputArchitecture
    config: Any
    """The MoE's transformers config."""
    dtype: torch.dtype | None
    zero_biases: dict[str, tuple[int, ...]]
    """Attention biases Qwen2-MoE has and the base lacks (written as zeros, as mergekit does)."""

    @property
    def num_layers(self) -> int:
        return int(self.base_config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.base_config.hidden_size)

    def store(self, ref: ModelRef) -> CheckpointStore:
        return self.stores[ref.path]

    def base_names(self) -> list[str]:
        """The base's tensors the MoE takes as they are: everything but the MLPs."""
        return [n for n in self.store(self.base).keys() if ".mlp." not in n]

    def output_bytes(self, num_experts: int) -> int:
        """The MoE's size in bytes (the free-space check)."""
        store = self.store(self.base)
        size = 2 if self.dtype is None else torch.empty((), dtype=self.dtype).element_size()
        mlp = sum(_numel(store.shapes[n]) for n in store.keys() if ".mlp." in n)
        rest = sum(_numel(store.shapes[n]) for n in self.base_names())
        return size * (rest + mlp * (num_experts + len(self.shared)))

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def open_inputs(config: MoEConfig, *, token: Any = None) -> MoEInputs:
    """Resolve and check every model of ``config`` (see the module docstring).

    Raises:
        CheckpointNotFoundError: a model (or the base's tokenizer) cannot be found.
        UnsupportedModelError: no MoE architecture holds these experts, or the base holds tensors it would drop.
        IncompatibleCheckpointsError: an expert is not shaped like the base.
        ConfigError: a model is a LoRA adapter.
        CorruptCheckpointError: a model's config.json is missing or cannot be read.
    """
    from ..adapters import adapter_for

    base = resolve_model(config.base_model, revision=config.base_revision, token=token)
    refs = {}
    for spec in config.all_experts:
        if (spec.source_model, spec.revision) not in refs:
            refs[spec.source_model, spec.revision] = resolve_model(spec.source_model, revision=spec.revision,
                                                                   token=token)
    places = {base.path: "base_model"}
    for where, spec in _named(config):
        places.setdefault(refs[spec.source_model, spec.revision].path, where)
    configs = {ref.path: _read_config(ref, places[ref.path]) for ref in [base, *refs.values()]}
    experts = [refs[e.source_model, e.revision] for e in config.experts]
    shared = [refs[e.source_model, e.revision] for e in config.shared_experts]
    types = [str(configs[r.path].model_type) for r in [base, *experts, *shared]]
    arch = select_architecture(config, types)
    base_config = configs[base.path]
    stores = {path: CheckpointStore(ref, adapter_for(configs[path]))
              for path, ref in {r.path: r for r in [base, *experts, *shared]}.items()}
    dtype = _output_dtype(config, base_config)
    out_config = output_config(arch, base_config, len(config.experts), config.experts_per_token, dtype)
    inputs = MoEInputs(base=base, base_config=base_config, experts=experts, shared=shared, stores=stores,
                       architecture=arch, config=out_config, dtype=dtype, zero_biases={})
    try:
        for path, store in stores.items():  # a config.json that does not describe its tensors (fewer layers)
            if store.beyond_config:
                extra = list(store.beyond_config)
                raise IncompatibleCheckpointsError(
                    f"config.json of {places[path]} ({store.ref.name}) does not match its weights: the weights hold "
                    f"{len(extra)} tensor(s) the config does not describe (e.g. {extra[:2]}). The config and the "
                    "weights do not belong together.")
        if getattr(base_config, "mlp_bias", False):
            raise UnsupportedModelError(f"base_model has MLP biases (mlp_bias: true); {arch.pretty} experts have "
                                        "none, so they would be dropped.")
        specs = [*zip(config.experts, experts, strict=True), *zip(config.shared_experts, shared, strict=True)]
        for where, (spec, ref) in zip(_places(config), specs, strict=True):
            _check_expert(where, spec, configs[ref.path], base_config, inputs.store(ref), inputs.store(base))
        inputs.zero_biases = _check_base_tensors(inputs)
        _check_tokenizer(base)
    except BaseException:
        inputs.close()
        raise
    return inputs


def _places(config: MoEConfig) -> list[str]:
    return [where for where, _ in _named(config)]


def _named(config: MoEConfig) -> list[tuple[str, ExpertSpec]]:
    return [*((f"experts[{i}]", e) for i, e in enumerate(config.experts)),
            *((f"shared_experts[{i}]", e) for i, e in enumerate(config.shared_experts))]


def _read_config(ref: ModelRef, where: str) -> Any:
    """The model's transformers config, or why it is not a dense model folder this build can read (a PEFT adapter,
    no or a broken config.json, a model type only custom code defines)."""
    from pathlib import Path

    from transformers import AutoConfig

    from ..errors import ConfigError, CorruptCheckpointError
    from ..loading.inputs import check_model_type

    if ref.weights_file is None and (Path(ref.path) / "adapter_config.json").is_file():
        raise ConfigError(f"{where} ({ref.name}) is a LoRA adapter; hf-mloss moe reads dense fine-tunes: merge the "
                          "adapter into its model first (merge_and_unload) and name that.")
    check_model_type(ref)
    try:
        return AutoConfig.from_pretrained(ref.path, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - transformers' config validation raises its own error classes too
        message = " ".join(str(err).split())[:300]
        raise CorruptCheckpointError(f"Cannot read the config.json of {where} ({ref.name}): {message}") from None


def _output_dtype(config: MoEConfig, base_config: Any) -> torch.dtype | None:
    """``dtype`` of the config, else the base's (mergekit's rule), else ``None``: each tensor keeps its own."""
    if config.dtype:
        return _DTYPES[config.dtype]
    dtype = getattr(base_config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if dtype == torch.float64:
        raise UnsupportedModelError("base_model is stored in float64, which transformers' MoE layers do not run "
                                    "in: set dtype (bfloat16, float16 or float32) in the config.")
    return dtype if isinstance(dtype, torch.dtype) else None


def _check_expert(where: str, spec: ExpertSpec, expert_config: Any, base_config: Any, store: CheckpointStore,
                  base_store: CheckpointStore) -> None:
    for name in SHAPE_FIELDS:
        mine, theirs = getattr(expert_config, name, None), getattr(base_config, name, None)
        if mine != theirs:
            raise IncompatibleCheckpointsError(
                f"{where} ({spec.label}) has {name} {mine!r} but base_model has {theirs!r}: an expert must be a "
                "fine-tune of the base (its MLP becomes one of the MoE's experts in every layer).")
    if getattr(expert_config, "mlp_bias", False):
        raise IncompatibleCheckpointsError(f"{where} ({spec.label}) has MLP biases (mlp_bias: true), which MoE "
                                           "experts do not hold.")
    for layer in range(int(base_config.num_hidden_layers)):
        for projection in PROJECTIONS:
            name = f"model.layers.{layer}.mlp.{projection}.weight"
            if name not in store:
                raise IncompatibleCheckpointsError(f"{where} ({spec.label}) has no tensor {name}: its checkpoint "
                                                   "is not a Llama-style causal LM (model.layers.N.mlp.*).")
            if name in base_store and store.shapes[name] != base_store.shapes[name]:
                raise IncompatibleCheckpointsError(
                    f"{where} ({spec.label}): {name} has shape {list(store.shapes[name])}, the base's "
                    f"{list(base_store.shapes[name])}.")


def _check_base_tensors(inputs: MoEInputs) -> dict[str, tuple[int, ...]]:
    """Every tensor of the MoE outside its experts and routers must come from the base, shaped as the MoE class
    expects, and every base tensor outside the MLPs must have a place in it; returns the biases to write as zeros."""
    from ..adapters.generic import meta_state

    model_class = _causal_lm_class(inputs.config)
    shapes, _, tied = meta_state(model_class, inputs.config)
    expected = {n: s for n, s in shapes.items() if ".mlp." not in n and n not in tied}
    base_store = inputs.store(inputs.base)
    given = {n: tuple(base_store.shapes[n]) for n in inputs.base_names() if n not in tied}
    pretty = inputs.architecture.pretty
    dropped = sorted(set(given) - set(expected))
    if dropped:
        raise UnsupportedModelError(f"base_model holds {len(dropped)} tensor(s) a {pretty} has no place for, e.g. "
                                    f"{dropped[0]} (they would be dropped).")
    zeros = {}
    for name in sorted(set(expected) - set(given)):
        if inputs.architecture is QWEN2_MOE and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            zeros[name] = expected[name]
            continue
        raise UnsupportedModelError(f"base_model has no tensor {name}, which a {pretty} needs.")
    for name, shape in given.items():
        if expected[name] != shape:
            raise IncompatibleCheckpointsError(f"base_model's {name} has shape {list(shape)} but a {pretty} with "
                                               f"its config expects {list(expected[name])}.")
    return zeros


def _causal_lm_class(config: Any) -> type:
    import transformers

    return getattr(transformers, config.architectures[0])


def _check_tokenizer(base: ModelRef) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(base.path)
    except (OSError, ValueError, TypeError, KeyError) as err:
        reason = " ".join(str(err).split())[:160]
        raise CheckpointNotFoundError(f"base_model {base.name!r} has no tokenizer that loads ({reason}): the prompts "
                                      "are read with it and the MoE is saved with it.") from None
    if tokenizer.bos_token is None and tokenizer.eos_token is None and tokenizer.pad_token is None:
        raise UnsupportedModelError(f"base_model {base.name!r}'s tokenizer has no BOS, EOS or pad token to pad the "
                                    "prompts with.")


def load_tokenizer(base: ModelRef) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base.path)
