"""PEFT LoRA adapters in: merge adapters as users train them (writing one is :mod:`hf_mloss.output.adapter`).

In: a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) or Hub repo is accepted wherever a
model is. It is read as a lazy :class:`LoraStore` over the run's base: ``get(name)`` returns ``W₀ + ΔW`` for an
adapted weight (ΔW = scale·B·A, computed for that one tensor only), the saved copy for ``modules_to_save`` tensors and
trained biases, and the base's tensor for everything else. No full model is ever materialised, and PEFT is not needed.

Exactly what ``PeftModel.merge_and_unload()`` computes is read. Supported: LoRA (any ranks, ``lora_alpha`` /
``use_rslora``, ``rank_pattern`` / ``alpha_pattern``), DoRA on linear layers, LoRA on embeddings and convolutions,
``modules_to_save`` and trained biases (``bias="all"`` / ``"lora_only"``), and IA³ (per-feature scales). Every other
adapter kind or option is refused with the reason (:data:`REFUSED_TYPES`, :func:`check_adapter_config`), never
approximated, and so is a config value PEFT could not use (a word for ``r``, an invalid regex).

The config is read as PEFT reads it: only the modules PEFT would wrap get their factors applied (``target_modules``,
``exclude_modules``, ``layers_to_transform`` / ``layers_pattern``, with PEFT's matching rules); factors the file
holds for other modules are ignored with a warning, as PEFT's loading ignores them. The layout of ΔW follows the
layer's class, as PEFT's does: ``nn.Linear`` ``[out, in]`` (``fan_in_fan_out: true`` is ignored with a warning),
transformers' ``Conv1D`` (GPT-2) ``[in, out]`` whatever ``fan_in_fan_out`` says.

Out: ``output="adapter"`` is :mod:`hf_mloss.output.adapter`.

Which base an adapter belongs to: ``base_model_name_or_path`` of its ``adapter_config.json`` must name the run's base
(see :func:`check_base`), or be empty, in which case the run's base is taken.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CorruptCheckpointError, IncompatibleCheckpointsError, InvalidParameterError, UnsupportedModelError
from .hub import ModelRef
from .store import TensorStore

if TYPE_CHECKING:
    from ..adapters import ModelAdapter
    from ..spec.config import ModelSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_PICKLE = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."
LINEAR_METHODS = ("task_arithmetic", "average")
"""Methods whose merged task vector is a fixed linear combination of the inputs' (``combination="cat"`` is exact)."""


def is_linear_merge(method: str, parameters: Mapping[str, Any] | None = None) -> bool:
    """Whether a merge with these parameters is a :data:`LINEAR_METHODS` merge (not when calibrated afterwards)."""
    return method in LINEAR_METHODS and not (parameters or {}).get("calibrate")
COMBINATIONS = ("cat", "svd")
REFUSED_TYPES = {
    "LOHA": "LoHa (Hadamard product of two low-rank pairs)",
    "LOKR": "LoKr (Kronecker-product factors)",
    "ADALORA": "AdaLoRA (SVD-parameterised, with rank masks)",
    "OFT": "OFT (orthogonal rotations)",
    "BOFT": "BOFT (butterfly orthogonal rotations)",
    "VERA": "VeRA (shared random projections)",
    "PROMPT_TUNING": "prompt tuning (virtual tokens, no weight change)",
    "PREFIX_TUNING": "prefix tuning (virtual keys/values, no weight change)",
    "P_TUNING": "P-tuning (virtual tokens, no weight change)",
}
"""PEFT types that are not plain LoRA: refused with their name (merge them with ``merge_and_unload()`` first)."""
_ROLES = ("lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "lora_A", "lora_B")
_OTHER_TUNER_TOKENS = ("hada_", "lokr_", "ia3_", "oft_", "boft_", "vera_", "trainable_tokens", "lora_")
_WEIGHT_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
"""``init_lora_weights`` values that also change the base weights during training: the adapter alone is not ΔW."""
_INERT_OPTIONS = ("eva_config", "corda_config", "loftq_config", "megatron_config", "lora_ga_config")
"""Options that only shape initialisation or distribution; the saved tensors are plain LoRA."""
_UNSUPPORTED_OPTIONS = {
    "use_dora": None,  # supported (Linear layers), listed so it is not mistaken for an unknown option
    "lora_bias": "a trained bias on lora_B (lora_bias=True)",
    "target_parameters": "LoRA on nn.Parameter targets (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (aLoRA): it applies only after its invocation tokens, not to the weights",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "layer_replication": "layer replication (it changes the architecture)",
    "use_qalora": "QALoRA (pooled group-wise inputs)",
    "use_bdlora": "BD-LoRA",
    "kasa_config": "KaSA (SVD-based singular-value adaptation)",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA (sampled factors)",
    "arrow_config": "Arrow routing between several LoRAs",
}


# ============================================================================================= reading an adapter
@dataclass(frozen=True)
class LoraRef(ModelRef):
    """A PEFT LoRA adapter input: its folder (or Hub snapshot) and the base its config names."""

    declared_base: str | None = None
    adapter_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def open_store(self, adapter: ModelAdapter, base: TensorStore) -> LoraStore:
        """The adapter read lazily over the run's base store (the hook :func:`hf_mloss.loading.inputs.open_inputs` calls)."""
        kind = Ia3Adapter if str(self.adapter_config.get("peft_type", "")).upper() == "IA3" else LoraAdapter
        return LoraStore(kind(self, adapter, base), base)


@dataclass
class LoraModule:
    """One adapted weight: where its factors are, and how ΔW is formed from them."""

    name: str
    """Canonical tensor name (the adapter family's, e.g. ``encoder.layers.0.self_attn.q_proj.weight``)."""
    module: str
    """Module path as PEFT names it in the base model (``encoder.layers.0.self_attn.q_proj``)."""
    kind: str
    """``linear``, ``embedding`` or ``conv``."""
    a_key: str
    b_key: str
    scale: float
    rank: int
    fan_in_fan_out: bool = False
    magnitude_key: str | None = None
    """DoRA: the learned per-output-row magnitude."""


class LoraAdapter:
    """The parsed tensors of one adapter: adapted modules, full copies (``modules_to_save``, biases) and their keys.

    Tensors are read one at a time from the adapter file; shapes are checked against the base before any merge.
    """

    def __init__(self, ref: LoraRef, family: ModelAdapter, base: TensorStore) -> None:
        self.ref, self.family = ref, family
        config = ref.adapter_config
        self.fan_in_fan_out = bool(config.get("fan_in_fan_out"))
        self.use_dora = bool(config.get("use_dora"))
        self._conv1d, self._output_embedding = _layer_kinds(family)
        self.untargeted: list[str] = []
        """Modules whose factors the file holds but PEFT would not wrap (not in ``target_modules``...): ignored."""
        self._flipped: list[str] = []
        self.modules: dict[str, LoraModule] = {}
        self.copies: dict[str, str] = {}
        """Canonical name -> key of a tensor saved in full (``modules_to_save``, trained biases)."""
        self.copy_modules: dict[str, str] = {}
        """Canonical name -> PEFT module path of each full copy."""
        self.ignored: list[str] = []
        """Keys outside the merged part of the model (e.g. the text tower of a whole-CLIP adapter)."""
        self._read = _tensor_reader(Path(ref.path), ref.name)
        shapes = self._read.shapes
        factors: dict[str, dict[str, str]] = {}
        adapter_names = set()
        for key in shapes:
            module, role, adapter_name, rest = _split_key(key)
            if role is not None:
                if rest:
                    raise UnsupportedModelError(
                        f"{ref.name!r}: tensor {key!r} is a LoRA {role} {rest} ({_UNSUPPORTED_OPTIONS['lora_bias']}), "
                        "which hf_mloss does not read. Merge this adapter with PEFT's merge_and_unload() and pass the "
                        "merged model instead.")
                if adapter_name:
                    adapter_names.add(adapter_name)
                factors.setdefault(module, {})[role] = key
                continue
            path = _strip_wrappers(key.removeprefix(PEFT_PREFIX))
            if any(part.startswith(_OTHER_TUNER_TOKENS) for part in path.split(".")):
                raise UnsupportedModelError(
                    f"{ref.name!r}: tensor {key!r} belongs to an adapter kind that is not plain LoRA; hf_mloss reads "
                    "LoRA factors (lora_A / lora_B / DoRA magnitudes) and full copies only. Merge it with PEFT's "
                    "merge_and_unload() first.")
            name = family.canonical_key(path)
            if name is None:
                self.ignored.append(key)
                continue
            self._check_in_base(name, key, base)
            if tuple(shapes[key]) != tuple(base.shapes[name]):
                raise IncompatibleCheckpointsError(
                    f"{ref.name!r}: the saved copy {key!r} has shape {tuple(shapes[key])} but the base's {name!r} has "
                    f"{tuple(base.shapes[name])}; the adapter was trained on another architecture.")
            self.copies[name] = key
            self.copy_modules[name] = path.rsplit(".", 1)[0]
        if len(adapter_names) > 1:
            raise UnsupportedModelError(
                f"{ref.name!r} holds the tensors of several adapters ({sorted(adapter_names)}); save each adapter in "
                "its own folder (PeftModel.save_pretrained(..., selected_adapters=[name])).")
        for module, roles in factors.items():
            self._add_module(module, roles, base)
        if self.untargeted:
            warnings.warn(
                f"{ref.name!r} holds LoRA factors of {len(self.untargeted)} module(s) that its adapter_config.json does "
                f"not target (target_modules / exclude_modules / layers_to_transform), e.g. {self.untargeted[:2]}; "
                "PEFT ignores them when it loads the adapter, and so does hf_mloss.", stacklevel=2)
        if self._flipped:
            warnings.warn(
                f"{ref.name!r}: fan_in_fan_out={self.fan_in_fan_out} does not fit {self._flipped[:2]} "
                f"({'nn.Linear' if self.fan_in_fan_out else 'Conv1D'} layers); PEFT sets it to "
                f"{not self.fan_in_fan_out} for them, and so does hf_mloss.", stacklevel=2)
        if not self.modules and not self.copies:
            raise CorruptCheckpointError(
                f"{ref.name!r} adapts nothing of the {family.name} model: none of its {len(shapes)} tensor(s) names a "
                f"module of the merged part (e.g. {sorted(shapes)[:2]}). Was it trained on another model?")

    # ------------------------------------------------------------------------------------------- parsing
    def _check_in_base(self, name: str, key: str, base: TensorStore) -> None:
        if name not in base.shapes:
            raise IncompatibleCheckpointsError(
                f"{self.ref.name!r} changes {key!r}, which the base {base.ref.name!r} does not have ({name!r}); the "
                "adapter was trained on another architecture.")

    def _add_module(self, module: str, roles: dict[str, str], base: TensorStore) -> None:
        embedding = "lora_embedding_A" in roles or "lora_embedding_B" in roles
        a_key = roles.get("lora_embedding_A" if embedding else "lora_A")
        b_key = roles.get("lora_embedding_B" if embedding else "lora_B")
        if a_key is None or b_key is None:
            raise CorruptCheckpointError(
                f"{self.ref.name!r}: module {module!r} has {sorted(roles)} but a LoRA module needs both its A and B "
                "factors; the adapter file is incomplete.")
        path = module.removeprefix(PEFT_PREFIX)
        name = self.family.canonical_key(f"{path}.weight")
        if name is None:
            self.ignored.extend(roles.values())
            return
        a_shape, b_shape = tuple(self._read.shapes[a_key]), tuple(self._read.shapes[b_key])
        kind = "embedding" if embedding else "conv" if len(a_shape) == 4 else "linear"
        if not peft_targets(self.ref.adapter_config, path, linear=kind == "linear",
                            output_embedding=name == self._output_embedding):
            self.untargeted.append(path)
            return
        self._check_in_base(name, f"{path}.weight", base)
        target = tuple(base.shapes[name])
        rank = a_shape[0] if a_shape else 0
        if rank < 1:
            raise CorruptCheckpointError(
                f"{self.ref.name!r}: the LoRA A factor of {path!r} has shape {a_shape}, rank 0; the adapter file is "
                "damaged or was saved untrained. Save the adapter again.")
        fan_in_fan_out = name in self._conv1d  # as PEFT: the layer's class decides, not the config
        if kind == "linear" and fan_in_fan_out != self.fan_in_fan_out:
            self._flipped.append(path)
        if kind == "embedding":
            expected = (a_shape[1], b_shape[0])  # ΔW = (B·A)ᵀ
        elif kind == "conv":
            if len(b_shape) != 4 or b_shape[2:] != (1, 1):
                raise UnsupportedModelError(
                    f"{self.ref.name!r}: the LoRA B factor of convolution {path!r} has kernel {b_shape[2:]}; hf_mloss "
                    "reads convolution LoRA with a 1x1 B (as PEFT trains it) only.")
            expected = (b_shape[0], *a_shape[1:])
        else:
            expected = (a_shape[1], b_shape[0]) if fan_in_fan_out else (b_shape[0], a_shape[1])
        if len(b_shape) < 2 or b_shape[1] != rank or expected != target:
            raise IncompatibleCheckpointsError(
                f"{self.ref.name!r}: the LoRA factors of {path!r} (A {a_shape}, B {b_shape}) do not form a ΔW of the "
                f"base's shape {target} for {name!r}; the adapter was trained on another model.")
        config = self.ref.adapter_config
        configured_rank = int(_pattern_value(config.get("rank_pattern") or {}, path, config.get("r", rank)))
        if configured_rank != rank:
            raise CorruptCheckpointError(
                f"{self.ref.name!r}: adapter_config.json gives {path!r} rank {configured_rank} but its factors have "
                f"rank {rank}; the config and the weights do not belong together.")
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, path, config.get("lora_alpha", rank)))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        magnitude = roles.get("lora_magnitude_vector")
        if self.use_dora != (magnitude is not None):
            raise CorruptCheckpointError(
                f"{self.ref.name!r}: module {path!r} {'lacks' if self.use_dora else 'has'} a DoRA magnitude while "
                f"use_dora={self.use_dora}; the config and the weights do not belong together.")
        if magnitude is not None and (kind != "linear" or fan_in_fan_out):
            raise UnsupportedModelError(
                f"{self.ref.name!r}: DoRA on {path!r} ({kind}{', Conv1D' if fan_in_fan_out else ''}) is "
                "not read; hf_mloss reads DoRA on nn.Linear layers only. Merge it with merge_and_unload() first.")
        self.modules[name] = LoraModule(name=name, module=path, kind=kind, a_key=a_key, b_key=b_key, scale=scale,
                                        rank=rank, fan_in_fan_out=fan_in_fan_out and kind == "linear",
                                        magnitude_key=magnitude)

    # ------------------------------------------------------------------------------------------- math
    def factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, scale·B) of a linear module in float32, so that ΔW = (scale·B) @ A in the weight's [out, in] layout."""
        module = self.modules[name]
        a, b = self._read.get(module.a_key).float(), self._read.get(module.b_key).float()
        return a, b * module.scale

    def delta(self, name: str) -> torch.Tensor:
        """ΔW = scale·B·A of one adapted weight, in the base weight's layout (float32), as PEFT's merge computes it."""
        module = self.modules[name]
        a, b = self._read.get(module.a_key).float(), self._read.get(module.b_key).float()
        if module.kind == "conv":
            product = (b.flatten(1) @ a.flatten(1)).reshape(b.shape[0], *a.shape[1:])
        else:
            product = b @ a
            if module.kind == "embedding" or module.fan_in_fan_out:
                product = product.T
        return product * module.scale

    def apply(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The adapted weight: W₀ + ΔW, or for DoRA m·(W₀ + ΔW)/‖W₀ + ΔW‖ (row norms), as ``merge_and_unload``."""
        module = self.modules[name]
        merged = weight.float() + self.delta(name)
        if module.magnitude_key is not None:
            magnitude = self._read.get(module.magnitude_key).float().reshape(-1)
            merged = (magnitude / torch.linalg.norm(merged, dim=1)).view(-1, 1) * merged
        return merged

    def copy(self, name: str) -> torch.Tensor:
        return self._read.get(self.copies[name])


class Ia3Adapter:
    """An IA³ adapter: learned per-feature scales of the base weights, applied exactly as ``merge_and_unload``.

    A feed-forward module's scale multiplies the weight's input columns (``ia3_l`` of shape ``[1, in]``); any
    other module's multiplies its output rows (``[out, 1]``) and its bias.
    """

    use_dora = False

    def __init__(self, ref: LoraRef, family: ModelAdapter, base: TensorStore) -> None:
        self.ref, self.family = ref, family
        self.modules: dict[str, str] = {}
        """Canonical name (weight or bias) -> key of its ``ia3_l`` scale."""
        self.copies: dict[str, str] = {}
        self.copy_modules: dict[str, str] = {}
        self.ignored: list[str] = []
        self._read = _tensor_reader(Path(ref.path), ref.name)
        for key, shape in self._read.shapes.items():
            parts = key.split(".")
            if "ia3_l" not in parts:
                path = _strip_wrappers(key.removeprefix(PEFT_PREFIX))
                name = family.canonical_key(path)
                if name is None:
                    self.ignored.append(key)
                    continue
                if name not in base.shapes or tuple(base.shapes[name]) != tuple(shape):
                    raise IncompatibleCheckpointsError(
                        f"{ref.name!r}: the saved copy {key!r} does not fit the base's {name!r}; the adapter was "
                        "trained on another architecture.")
                self.copies[name] = key
                self.copy_modules[name] = path.rsplit(".", 1)[0]
                continue
            module = ".".join(parts[:parts.index("ia3_l")])
            path = module.removeprefix(PEFT_PREFIX)
            weight = family.canonical_key(f"{path}.weight")
            if weight is None:
                self.ignored.append(key)
                continue
            target = tuple(base.shapes.get(weight, ()))
            if len(target) != 2 or tuple(shape) not in ((1, target[1]), (target[0], 1)):
                raise IncompatibleCheckpointsError(
                    f"{ref.name!r}: the IA³ scale {key!r} has shape {tuple(shape)}, which scales neither the inputs "
                    f"nor the outputs of the base's {weight!r} {target}; the adapter was trained on another model.")
            self.modules[weight] = key
            bias = weight[: -len("weight")] + "bias"
            if tuple(shape) == (target[0], 1) and target[0] != 1 and bias in base.shapes:
                self.modules[bias] = key  # not feed-forward: PEFT scales the bias too
        if not self.modules and not self.copies:
            raise CorruptCheckpointError(f"{ref.name!r} adapts nothing of the {family.name} model.")

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        scale = self._read.get(self.modules[name]).float()
        if name.endswith("bias"):
            return tensor.float() * scale.reshape(tensor.shape)
        return tensor.float() * scale

    def copy(self, name: str) -> torch.Tensor:
        return self._read.get(self.copies[name])


class LoraStore(TensorStore):
    """An adapter seen as a full model: the base's tensors, with the adapted ones computed one at a time."""

    def __init__(self, lora: LoraAdapter, base: TensorStore) -> None:
        self.ref, self.lora = lora.ref, lora
        self.base = _shared_base(base)
        self.shapes = dict(base.shapes)
        self.dtypes = dict(base.dtypes)

    def get(self, name: str) -> torch.Tensor:
        if name in self.lora.copies:
            return self.lora.copy(name)
        weight = self.base.get(name)
        if name in self.lora.modules:
            return self.lora.apply(name, weight)
        return weight.clone()  # a private buffer, as a checkpoint read gives

    def __repr__(self) -> str:
        return f"LoraStore({self.ref.name!r}, adapted={len(self.lora.modules)}, copies={len(self.lora.copies)})"


class _SharedBase:
    """The base store with a few recently read tensors kept: q adapters over one base read each base tensor once."""

    def __init__(self, store: TensorStore, size: int = 8) -> None:
        self.store, self.size = store, size
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> torch.Tensor:
        with self._lock:
            if name in self._cache:
                self._cache.move_to_end(name)
                return self._cache[name]
        tensor = self.store.get(name)
        with self._lock:
            self._cache[name] = tensor
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        return tensor


_SHARED: weakref.WeakKeyDictionary[TensorStore, _SharedBase] = weakref.WeakKeyDictionary()


def _shared_base(store: TensorStore) -> _SharedBase:
    shared = _SHARED.get(store)
    if shared is None:
        shared = _SHARED[store] = _SharedBase(store)
    return shared


class _TensorReader:
    """Per-tensor reads of an adapter's weights file (safetensors, else the restricted unpickler)."""

    def __init__(self, file: Path, model_name: str) -> None:
        from safetensors import SafetensorError, safe_open

        self.file, self.model_name = file, model_name
        self._state = None
        try:
            if file.suffix == ".safetensors":
                self._handle = safe_open(str(file), framework="pt", device="cpu")
                self.shapes = {k: tuple(self._handle.get_slice(k).get_shape()) for k in self._handle.keys()}
            else:
                from .store import load_pickle_state

                self._state = load_pickle_state(file, model_name)
                self.shapes = {k: tuple(t.shape) for k, t in self._state.items()}
        except (SafetensorError, OSError, ValueError) as err:
            raise CorruptCheckpointError(f"Cannot read {file.name} of {model_name!r}: {err}. Download or save the "
                                         "adapter again.") from None

    def get(self, key: str) -> torch.Tensor:
        if self._state is not None:
            return self._state[key].clone()
        return self._handle.get_tensor(key)


def _tensor_reader(folder: Path, name: str) -> _TensorReader:
    for file_name in (ADAPTER_SAFETENSORS, ADAPTER_PICKLE):
        if (folder / file_name).is_file():
            return _TensorReader(folder / file_name, name)
    raise CorruptCheckpointError(f"LoRA adapter {name!r} has {ADAPTER_CONFIG} but no {ADAPTER_SAFETENSORS} (or "
                                 f"{ADAPTER_PICKLE}); download or save it again.")


def _split_key(key: str) -> tuple[str, str | None, str | None, str]:
    """``<module>.<role>[.<adapter name>][.weight]`` -> (module, role, adapter name, anything unexpected)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part in _ROLES:
            rest = parts[i + 1:]
            if rest and rest[-1] == "weight":
                rest = rest[:-1]
            adapter_name = None
            if len(rest) == 1 and rest[0] != "bias":
                adapter_name, rest = rest[0], []
            return ".".join(parts[:i]), part, adapter_name, ".".join(rest)
    return key, None, None, ""


def _strip_wrappers(path: str) -> str:
    """A parameter's path in the base model: without PEFT's ``base_layer.`` and ``modules_to_save.<name>.``."""
    path = path.replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", path)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key matching the end of the module path."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _layer_kinds(family: ModelAdapter) -> tuple[frozenset[str], str | None]:
    """(canonical weight names of transformers ``Conv1D`` layers, the output embeddings' weight name) of the family's
    model, read from a meta-device instance (no memory)."""
    model_class = getattr(family, "merged_class", None) or getattr(family, "model_class", None)
    config = getattr(family, "merged_config", None) or getattr(family, "config", None)
    if model_class is None or config is None:
        return frozenset(), None
    conv1d, output = _raw_layer_kinds(model_class, config.to_json_string(use_diff=False))
    names = frozenset(n for n in map(family.canonical_key, conv1d) if n is not None)
    return names, family.canonical_key(output) if output else None


@functools.lru_cache(maxsize=16)
def _raw_layer_kinds(model_class: type, config_json: str) -> tuple[frozenset[str], str | None]:
    from transformers.pytorch_utils import Conv1D

    config = model_class.config_class.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = model_class(config)
    conv1d = frozenset(f"{name}.weight" for name, module in model.named_modules() if isinstance(module, Conv1D))
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    output_name = next((f"{name}.weight" for name, module in model.named_modules() if module is output), None) \
        if output is not None else None
    return conv1d, output_name


def peft_targets(config: dict[str, Any], key: str, *, linear: bool = True, output_embedding: bool = False) -> bool:
    """Whether PEFT wraps the module ``key`` (its path in the model PEFT wrapped) with this adapter's LoRA layer:
    PEFT's ``check_target_module_exists`` rules (``exclude_modules``, ``modules_to_save``, ``target_modules`` as a
    regex or a list of names or name suffixes, ``layers_to_transform`` / ``layers_pattern``), and ``"all-linear"``
    as every linear layer but the output embeddings."""
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return False
        elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
            return False
    saved = config.get("modules_to_save")
    if saved and any(re.match(rf"(^|.*\.){m}($|\..*)", key) for m in saved):
        return False
    targets = config.get("target_modules")
    if targets is None:
        return True  # not saved by PEFT (it always writes the resolved list): every factor in the file is read
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            return linear and not output_embedding
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layers, patterns = config.get("layers_to_transform"), config.get("layers_pattern")
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        match = None
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


# ============================================================================================= finding adapters
def check_adapter_config(config: Any, name: str) -> dict[str, Any]:
    """Refuse, with the reason, every adapter hf_mloss cannot read exactly (see the module docstring).

    Raises:
        CorruptCheckpointError: the file is not an adapter config.
        UnsupportedModelError: a PEFT type or option whose effect on the weights hf_mloss does not compute exactly.
    """
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{ADAPTER_CONFIG} of {name!r} is not a JSON object.")
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type in ("LORA", "IA3"):
        _check_common_values(config, name)
    if peft_type == "IA3":
        if config.get("fan_in_fan_out"):
            raise UnsupportedModelError(f"{name!r} is an IA³ adapter with fan_in_fan_out=True, which hf_mloss does "
                                        "not read. Merge it with PEFT's merge_and_unload() first.")
        return config
    if peft_type != "LORA":
        kind = REFUSED_TYPES.get(peft_type, f"peft_type {peft_type or '(missing)'!r}")
        raise UnsupportedModelError(
            f"{name!r} is a {kind} adapter; hf_mloss merges LoRA (DoRA included) and IA³ adapters only. "
            "Merge it into its base with PEFT's merge_and_unload(), save_pretrained the result, and pass that folder.")
    for option, reason in _UNSUPPORTED_OPTIONS.items():
        if reason is not None and config.get(option) not in (None, False, [], {}, ""):
            raise UnsupportedModelError(
                f"{name!r} uses {reason}, which hf_mloss does not read exactly. Merge it with PEFT's "
                "merge_and_unload() and pass the merged model instead.")
    _check_lora_values(config, name)
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_WEIGHT_CHANGING_INITS):
        raise UnsupportedModelError(
            f"{name!r} was initialised with init_lora_weights={init!r}, which also changes the base weights during "
            "training: the adapter alone is not the fine-tune's task vector. Convert it to plain LoRA when saving "
            "(save_pretrained(..., path_initial_model_for_weight_conversion=...)) and pass the converted adapter.")
    return config


MAX_ALPHA = 1e6
"""Largest ``|lora_alpha|`` read (trained adapters use up to a few thousand): beyond it ΔW overflows float32."""


def _bad_value(name: str, option: str, value: Any, expected: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{ADAPTER_CONFIG} of {name!r}: {option} is {str(value)[:80]!r} "
                                  f"({type(value).__name__}); PEFT expects {expected}. Fix the file or save the "
                                  "adapter again.")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_regex(name: str, option: str, pattern: Any, template: str = "{}") -> None:
    if not isinstance(pattern, str):
        raise _bad_value(name, option, pattern, "a string")
    try:
        re.compile(template.format(pattern))
    except re.error as err:
        raise CorruptCheckpointError(f"{ADAPTER_CONFIG} of {name!r}: {option} {pattern[:80]!r} is not a valid "
                                     f"regular expression ({err}); PEFT cannot use it either.") from None


def _check_names(name: str, option: str, value: Any, *, regex: bool = True) -> None:
    """``None``, a regex string or a list of module names (PEFT's ``target_modules`` / ``exclude_modules``)."""
    if value is None:
        return
    if isinstance(value, str):
        if regex:
            _check_regex(name, option, value)
        return
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _bad_value(name, option, value, "a list of module names or a regular expression")


def _check_common_values(config: dict[str, Any], name: str) -> None:
    declared = config.get("base_model_name_or_path")
    if declared is not None and not isinstance(declared, str):
        raise _bad_value(name, "base_model_name_or_path", declared, "a Hub id or a folder path (a string)")
    for option in ("target_modules", "exclude_modules"):
        _check_names(name, option, config.get(option))
    saved = config.get("modules_to_save")
    if saved is not None:
        if not isinstance(saved, (list, tuple)):
            raise _bad_value(name, "modules_to_save", saved, "a list of module names")
        for module in saved:
            _check_regex(name, "modules_to_save", module, r"(^|.*\.){}($|\..*)")
    for option in ("fan_in_fan_out", "use_rslora", "use_dora"):
        if config.get(option) is not None and not isinstance(config.get(option), bool):
            raise _bad_value(name, option, config.get(option), "true or false")


def _check_lora_values(config: dict[str, Any], name: str) -> None:
    """Refuse LoRA config values PEFT could not use, before any tensor is read (PEFT's own checks included)."""
    rank = config.get("r")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
        raise _bad_value(name, "r", rank, "a positive integer (the LoRA rank)")
    alpha = config.get("lora_alpha")
    if alpha is not None and (not _is_number(alpha) or not math.isfinite(alpha) or abs(alpha) > MAX_ALPHA):
        raise _bad_value(name, "lora_alpha", alpha, f"a finite number (at most {MAX_ALPHA:g} in size here: a "
                             "larger scale overflows the weights)")
    for option, positive_int in (("rank_pattern", True), ("alpha_pattern", False)):
        patterns = config.get(option)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise _bad_value(name, option, patterns, "a mapping of module-name patterns to values")
        for key, value in patterns.items():
            _check_regex(name, f"{option} key", key, r"(.*\.)?({})$")
            if positive_int and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise _bad_value(name, f"{option}[{key!r}]", value, "a positive integer (a rank)")
            if not positive_int and (not _is_number(value) or not math.isfinite(value) or abs(value) > MAX_ALPHA):
                raise _bad_value(name, f"{option}[{key!r}]", value, "a finite number (an alpha)")
    layers, patterns = config.get("layers_to_transform"), config.get("layers_pattern")
    if layers is not None:
        items = [layers] if isinstance(layers, int) else layers
        if not isinstance(items, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                  for i in items):
            raise _bad_value(name, "layers_to_transform", layers, "a layer index or a list of them")
    if patterns is not None and not (isinstance(patterns, str) or (isinstance(patterns, list) and all(
            isinstance(p, str) for p in patterns))):
        raise _bad_value(name, "layers_pattern", patterns, "a name or a list of names")
    if isinstance(config.get("target_modules"), str) and (layers is not None or patterns is not None):
        raise CorruptCheckpointError(f"{ADAPTER_CONFIG} of {name!r}: layers_to_transform / layers_pattern cannot be "
                                     "used with a regular-expression target_modules; PEFT refuses this config too.")
    if patterns and layers is None:
        raise CorruptCheckpointError(f"{ADAPTER_CONFIG} of {name!r}: layers_pattern is set without "
                                     "layers_to_transform; PEFT refuses this config too.")


def resolve_lora(spec: ModelSpec, base: tuple[ModelRef, Any, Any] | None, token: str | bool | None
                 ) -> tuple[LoraRef, None, Any] | None:
    """The inputs entry of a LoRA adapter (its ref, no loaded model, the base's config), or None if ``spec`` is not one.

    Raises:
        InvalidParameterError: the adapter was given as the base.
        IncompatibleCheckpointsError: it names another base than the run's (see :func:`check_base`).
    """
    if spec.is_loaded:
        return None
    folder, repo_id = _adapter_folder(os.fspath(spec.model), spec.revision, token)
    if folder is None:
        return None
    display = repo_id or Path(folder).name
    try:
        config = json.loads((Path(folder) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpointError(f"Cannot read {ADAPTER_CONFIG} of {display!r}: {str(err)[:200]}") from None
    check_adapter_config(config, display)
    declared = config.get("base_model_name_or_path") or None
    if base is None:
        raise InvalidParameterError(
            f"The base {display!r} is a LoRA adapter (of {declared or 'an unnamed base'}); the base must be the full "
            f"model the adapters were trained from: pass base={declared or '<its base model>'!r} and the adapter "
            "among the models.")
    base_ref, _, base_config = base
    check_base(declared, base_ref, display)
    ref = LoraRef(path=str(Path(folder).resolve()), repo_id=repo_id,
                  revision=Path(folder).name if repo_id else None,
                  weights_file=ADAPTER_SAFETENSORS if (Path(folder) / ADAPTER_SAFETENSORS).is_file() else ADAPTER_PICKLE,
                  declared_base=declared, adapter_config=config)
    return ref, None, base_config


def _adapter_folder(model: str, revision: str | None, token) -> tuple[str | None, str | None]:
    path = Path(model).expanduser()
    if path.is_dir():
        return (str(path), None) if (path / ADAPTER_CONFIG).is_file() else (None, None)
    from .hub import is_repo_id, looks_local

    if looks_local(model) or not is_repo_id(model):
        return None, None
    from ..errors import CheckpointNotFoundError
    from .hub import _snapshot

    try:  # the files were fetched (or found cached) a moment ago, by the attempt to read it as a model
        folder = _snapshot(model, revision, [ADAPTER_CONFIG, ADAPTER_SAFETENSORS, ADAPTER_PICKLE], token=token,
                           cache_dir=None)
    except CheckpointNotFoundError:
        return None, None
    return (folder, model) if (Path(folder) / ADAPTER_CONFIG).is_file() else (None, None)


def declared_base_folder(model: Any) -> str | None:
    """The local folder an adapter folder's ``base_model_name_or_path`` names (the output guard protects it), or
    None: not an adapter folder, a Hub id, or unreadable (the run then refuses it with the reason)."""
    try:
        config = json.loads((Path(os.fspath(model)).expanduser() / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, TypeError, ValueError):
        return None
    declared = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(declared, str) or not declared:
        return None
    try:
        folder = Path(declared).expanduser()
        return str(folder) if folder.is_dir() else None
    except (OSError, ValueError):
        return None


def check_base(declared: str | None, base: ModelRef, adapter_name: str) -> None:
    """The adapter's ``base_model_name_or_path`` must name the run's base; an empty one takes the run's base.

    It matches when it is the base's Hub id (case-insensitive), or a local folder that is the base's folder (same
    resolved path) or holds the same weights and config (same content fingerprint). A loaded base that does not say
    where it came from cannot be checked and is accepted.

    Raises:
        IncompatibleCheckpointsError: naming both, and what to change.
    """
    if not declared:
        return
    if base.repo_id and declared.lower() == base.repo_id.lower():
        return
    if not base.path:
        return  # a loaded model with no name_or_path: nothing to compare
    local = Path(declared).expanduser()
    if local.is_dir() and base.path and Path(base.path).is_dir():
        if local.resolve() == Path(base.path).resolve():
            return
        from .hub import fingerprint_folder

        if fingerprint_folder(local) == fingerprint_folder(base.path):
            return
    elif not base.repo_id and declared == base.path:
        return  # a loaded base whose name_or_path is the declared one
    raise IncompatibleCheckpointsError(
        f"LoRA adapter {adapter_name!r} was trained on {declared!r} (base_model_name_or_path in its {ADAPTER_CONFIG}) "
        f"but the base of this merge is {base.repo_id or base.path!r}. Pass base={declared!r}, or, if both are the "
        f"same weights saved elsewhere, set base_model_name_or_path in {ADAPTER_CONFIG} to the base you pass.")
