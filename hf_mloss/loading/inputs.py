"""The inputs of a run, prepared once for :func:`hf_mloss.merge` and :func:`hf_mloss.score`.

:func:`open_inputs` resolves every model (local folder or Hub snapshot), picks the adapter, indexes the checkpoints
lazily, checks they can be merged, resolves the weights and the scoring data as the model's inputs (images through the
base's image processor for image families, text through the base's tokenizer for text families), and closes the
checkpoint handles when the run ends, whatever happens. Everything that can be refused is refused here, before the
first forward pass or tensor merge.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DataError, IncompatibleCheckpointsError, InvalidParameterError
from .._logging import quiet_transformers
from .hub import FolderFingerprints, ModelRef, fingerprint_folder, resolve_model
from .store import CheckpointStore, ModuleStore, TensorStore
from .vocab import tokenizer_file_vocab

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..adapters import ModelAdapter
    from ..spec.config import MergeConfig, ModelSpec
    from .data import DataInfo
    from .model_inputs import ModelInputs
    from .vocab import VocabularyPlan

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class RunInputs:
    """Resolved, validated inputs of one run."""

    adapter: ModelAdapter
    base: TensorStore
    sources: list[TensorStore]
    base_model: PreTrainedModel | None
    """The base as the caller passed it (already loaded), else None."""
    names: list[str]
    """Floating-point canonical tensor names of the base, in checkpoint order."""
    alpha: torch.Tensor
    """Per-source weights (float64), as the method uses them."""
    device: torch.device
    model_inputs: ModelInputs | None = None
    """The scoring samples as the model takes them (``pixel_values``, or ``input_ids`` + ``attention_mask``): the
    shared ``data``, then each model's own, one after the other (what M-TIES and scoring read: their union)."""
    data_info: DataInfo | None = None
    sample_owner: torch.Tensor | None = None
    """With models' own data: the model each sample of :attr:`model_inputs` belongs to, ``-1`` for the shared pool
    (:func:`~hf_mloss.loading.model_inputs.owner_groups`); ``None`` when every model reads the same samples."""
    model_data_info: list[DataInfo | None] = field(default_factory=list)
    """Where each model's own data came from (``None``: the model reads the shared pool)."""
    data_records: dict[tuple[int, str], dict[str, str]] = field(default_factory=dict)
    """What the recipe records of a model's own data, by (model index, ``data`` / ``text_data``): the commit a Hub
    dataset was read at (``revision``), a local folder's or file's content ``fingerprint``."""
    fingerprints: Mapping[int, str] = field(default_factory=dict)
    """Content fingerprint of each local input (index 0 = base); a run that records them hashes them in the
    background, and reading one waits for it."""
    towers: list[ModelAdapter] = field(default_factory=list)
    """The other towers of a whole two-tower model (a CLIPModel's text tower), as views whose names are the whole
    model's (:func:`hf_mloss.adapters.generic.other_towers`); empty unless the merge is of whole models."""
    tower_inputs: dict[str, ModelInputs] = field(default_factory=dict)
    """Scoring samples of those towers, by tower attribute (``"text_model"``: the tokenised ``text_data``)."""
    tower_data_info: dict[str, DataInfo] = field(default_factory=dict)
    tower_owner: dict[str, torch.Tensor] = field(default_factory=dict)
    """As :attr:`sample_owner`, for a tower's samples (models' own ``text_data``)."""
    tower_model_data_info: dict[str, list[DataInfo | None]] = field(default_factory=dict)
    share_inputs: ModelInputs | None = None
    """Label-free selection's ``select.shares`` (``share="given"``): one set per model, read here once."""
    share_owner: torch.Tensor | None = None
    """The model each sample of :attr:`share_inputs` is compared with."""
    uninitialised: list[str] = field(default_factory=list)
    """Tensors every input lacks, which transformers initialises (see :func:`check_config_matches_tensors`)."""
    notes: list[str] = field(default_factory=list)
    """What the run says about its inputs on the card (tensors every input lacks, initialised by transformers)."""
    vocabulary: VocabularyPlan | None = None
    """The merged vocabulary (``tokenizer_source``): its tokenizer, and the rows the stores read aligned to it."""
    id2label: dict[int, str] | None = None
    """The merged head's class names, where they are the fine-tunes' and not the base's (classes.merged_labels)."""

    @property
    def refs(self) -> list[ModelRef]:
        return [s.ref for s in self.sources]

    @property
    def pixels(self) -> torch.Tensor | None:
        """Deprecated: ``model_inputs["pixel_values"]`` (image families only); read :attr:`model_inputs`."""
        if self.model_inputs is None:
            return None
        if "pixel_values" not in self.model_inputs:
            raise AttributeError(f"The {self.adapter.name} family is scored on {self.model_inputs.modality}: its "
                                 f"inputs are {list(self.model_inputs.keys())}, not pixels; read "
                                 "RunInputs.model_inputs.")
        return self.model_inputs["pixel_values"]

    def subset(self, index: torch.Tensor) -> RunInputs:
        """These inputs with the scored tower's samples at ``index`` only (their owners kept); the models, the other
        towers' samples and everything else shared, not copied."""
        owner = None if self.sample_owner is None else self.sample_owner[index]
        return replace(self, model_inputs=self.model_inputs.select(index), sample_owner=owner)

    def scored_towers(self, model: PreTrainedModel) -> list[ScoredTower]:
        """The towers a scoring pass walks in ``model`` (a whole model, or the scored tower itself), each with its
        adapter, samples and report-name prefix: the adapter's own tower when ``data`` was given, and every other
        tower given data (``text_data``). One entry, keys unchanged, for a run of one tower."""
        whole = getattr(self.adapter, "whole_model", False)
        own = getattr(self.adapter, "tower_view", None)  # a vision-language model: its vision tower, as a view
        towers = []
        if self.model_inputs is not None and own is not None:
            towers.append(ScoredTower(own, model.get_submodule(own.tower_attribute), self.model_inputs,
                                      self.data_info, "", [n for n in self.names if own.owns(n)],
                                      own.tower_attribute, self.sample_owner))
        elif self.model_inputs is not None:
            prefix = getattr(self.adapter, "report_prefix", "")
            names = [n for n in self.names if not self.adapter.is_outside_tower(n)] if whole else None
            towers.append(ScoredTower(self.adapter, self.adapter.tower(model), self.model_inputs, self.data_info,
                                      prefix, names, prefix[:-1] or "model", self.sample_owner))
        for view in self.towers:
            samples = self.tower_inputs.get(view.tower_attribute)
            if samples is not None:
                towers.append(ScoredTower(view, model.get_submodule(view.tower_attribute), samples,
                                          self.tower_data_info.get(view.tower_attribute), "",
                                          [n for n in self.names if view.owns(n)], view.tower_attribute,
                                          self.tower_owner.get(view.tower_attribute)))
        return towers

    def tower_modalities(self) -> dict[str, str]:
        """``{tower attribute: modality}`` of a whole-model merge's towers (``{"vision_model": "image",
        "text_model": "text"}``); empty for a model of one tower."""
        if not getattr(self.adapter, "whole_model", False):
            return {}
        own = self.adapter.containers[self.adapter.full_config.model_type][1]
        out = {own: getattr(self.adapter, "modality", "image")}
        if self.towers:
            out.update({view.tower_attribute: view.modality for view in self.towers})
        else:
            from .classes import whole_model_towers

            out.update({view.tower_attribute: view.modality for view in whole_model_towers(self.adapter)})
        return out

    def scored_attributes(self) -> set[str]:
        """The towers of :meth:`tower_modalities` that scoring data reaches."""
        towers = self.tower_modalities()
        own = next(iter(towers), None)
        scored = {own} if own is not None and self.model_inputs is not None else set()
        return scored | set(self.tower_inputs)

    def scoring_output(self) -> str:
        """The ``output`` a scoring pass loads its model as: the tower of a whole model (a CLIPModel's vision tower),
        else the model itself (``"auto"``: a family without towers, e.g. a causal LM)."""
        if getattr(self.adapter, "kept_class", None) is not None or getattr(self.adapter, "tower_view", None):
            return "auto"  # the base's class around the encoder (a ViTForImageClassification), as saved; a VLM
        return "tower" if self.adapter.containers else "auto"

    def load_scoring_model(self, *, progress: bool = True, streamed: bool = False) -> PreTrainedModel:
        """The model whose blocks a scoring pass walks, in float32 on the run's device.

        ``streamed``: the blocks' parameters stay on the ``meta`` device (no memory) and everything else (embeddings,
        final norm, buffers) is read from the base; the walks (:mod:`hf_mloss.engine.walk`) fill a block from the
        lazy stores when they reach it and empty it after, so a scoring pass holds one block of the base instead of
        the whole model. Falls back to the whole model where that cannot be done exactly (a model passed in memory,
        a block with buffers, a tensor the base's file lacks)."""
        if streamed and self.base_model is None:
            model = self._scoring_skeleton()
            if model is not None:
                return model
        return self.adapter.tower(self.load_output_model(self.scoring_output(), progress=progress))

    def _scoring_skeleton(self) -> PreTrainedModel | None:
        """The scoring model with its blocks on ``meta`` (see :meth:`load_scoring_model`), or ``None``."""
        model = self._from_store(self.scoring_output(), torch.float32, blocks_on_meta=True)
        return None if model is None else self.adapter.tower(model)

    def _from_store(self, output: str, dtype: torch.dtype, *, blocks_on_meta: bool) -> PreTrainedModel | None:
        """The ``output`` model built on ``meta`` (accelerate's ``init_empty_weights``) and filled one tensor at a
        time from the base's lazy store in ``dtype`` (``blocks_on_meta``: the blocks' parameters left on meta), so
        the checkpoint is never mapped or held beside the model; ``None`` where the store cannot fill it exactly
        (a block with buffers, a tensor the file lacks)."""
        from accelerate import init_empty_weights
        from accelerate.utils import set_module_tensor_to_device

        adapter = self.adapter
        cls = adapter.output_class(output)
        config = adapter.config if cls is adapter.model_class else adapter.full_config
        with quiet_transformers(True), init_empty_weights():  # parameters on meta, buffers computed as usual
            model = cls(config)
        tower = adapter.tower(model)
        if blocks_on_meta and any(len(list(block.buffers())) for block in adapter.layers(tower)):
            return None

        def in_block(name: str | None) -> bool:
            return blocks_on_meta and name is not None and 0 <= adapter.stage_of(name) < adapter.num_layers

        for key, tensor in tower.state_dict(keep_vars=True).items():
            name = adapter.canonical_key(key)
            if not tensor.is_meta or in_block(name) or name is None or name not in self.base:
                continue  # tied to another tensor (lm_head): tied below, else refused below
            set_module_tensor_to_device(tower, key, self.device, value=self.base.get(name), dtype=dtype)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        state = model.state_dict(keep_vars=True)
        if any(t.is_meta and not in_block(adapter.canonical_key(k)) for k, t in state.items()):
            return None
        for name, buffer in list(model.named_buffers()):  # buffers built in __init__ (CLIP's position_ids) stay
            if not buffer.is_meta and buffer.device != self.device:  # on the CPU under init_empty_weights
                set_module_tensor_to_device(model, name, self.device, value=buffer)
        return model.eval()  # what is not on meta is on the run's device now

    def output_skeleton(self, output: str, dtype: torch.dtype) -> PreTrainedModel | None:
        """The output model with its blocks on ``meta`` and everything else read from the base in ``dtype``, as
        :meth:`load_output_model` would record it (layout, name, generation config): the container of a merge
        written block by block (:mod:`hf_mloss.merging.streamed`). ``None`` where the base cannot be read that way
        (a model passed in memory, a pickle checkpoint, missing tensors, a merged vocabulary, blocks with
        buffers)."""
        if self.base_model is not None or getattr(self.base, "is_pickle", True) or self.uninitialised \
                or self.vocabulary is not None:
            return None
        model = self._from_store(output, dtype, blocks_on_meta=True)
        return None if model is None else self._as_loaded(model)

    def _as_loaded(self, model: PreTrainedModel) -> PreTrainedModel:
        """``model`` (filled from the store) as ``from_pretrained`` would have left it: saved back in the base's
        layout, named after the base's folder, with its generation config."""
        layout = getattr(self.adapter, "layout", None)
        if layout is not None and getattr(self.base, "checkpoint_keys", None):  # saved back in the base's layout,
            from ..adapters.layout import write_layout  # as from_pretrained would have recorded it

            write_layout(model, self.base.checkpoint_keys, layout)
        path = Path(self.base.ref.path)
        model.config._name_or_path = str(path)
        if getattr(model, "generation_config", None) is not None and (path / "generation_config.json").is_file():
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(path)
        return model

    def _streamed_output_model(self, output: str, dtype: torch.dtype) -> PreTrainedModel | None:
        """:meth:`load_output_model` for a large base (float32 size at least :data:`STREAMED_LOAD_MIN_BYTES`) read
        from safetensors: filled tensor by tensor from the lazy store, so its peak is the model itself (loading it
        with ``from_pretrained`` maps the checkpoint beside the float32 copy: a 1.5 B bf16 model peaked at 9 GB)."""
        import math

        if self.base_model is not None or getattr(self.base, "is_pickle", True) or self.uninitialised:
            return None
        size = sum(math.prod(shape) for shape in self.base.shapes.values()) * torch.finfo(dtype).bits // 8
        if size < STREAMED_LOAD_MIN_BYTES:
            return None
        model = self._from_store(output, dtype, blocks_on_meta=False)
        return None if model is None else self._as_loaded(model)

    def load_output_model(self, output: str, *, progress: bool = True,
                          dtype: torch.dtype = torch.float32) -> PreTrainedModel:
        """A copy of the base on the run's device, as the class the merge writes (see ``output``), in float32
        (``dtype``: the stored dtype, where a data-free merge writes its float32 results straight into it)."""
        if self.base_model is not None:
            model = copy.deepcopy(self.base_model)
            if output == "tower":
                model = copy.deepcopy(self.adapter.tower(self.base_model))
        elif (model := self._streamed_output_model(output, dtype)) is None:
            with quiet_transformers(True):  # one bar per stage, ours: not transformers' "Loading weights"
                model = self.adapter.load_output_model(self.base.ref.path, output, dtype=dtype,
                                                       allow_missing=frozenset(self.uninitialised))
        model = model.to(device=self.device, dtype=dtype).eval()
        if self.id2label is not None:  # the merged head's classes: the fine-tunes' names (classes.merged_labels)
            model.config.id2label = dict(self.id2label)
            model.config.label2id = {name: i for i, name in self.id2label.items()}
        if self.vocabulary is not None:  # the output vocabulary's rows, the base's side of them
            self.vocabulary.fit_model(model, self.adapter, self.base)
        return model

    def close(self) -> None:
        for store in [self.base, *self.sources]:
            store.close()


STREAMED_LOAD_MIN_BYTES = 1 << 31
"""A base at least this large in the working dtype is filled from its lazy store instead of ``from_pretrained``."""


@dataclass
class ScoredTower:
    """One tower a scoring pass walks: the adapter that walks it, its module, its samples, and how its layers are
    named in the report (``key_prefix`` + the adapter's target names)."""

    adapter: ModelAdapter
    module: PreTrainedModel
    samples: ModelInputs
    data_info: DataInfo | None
    key_prefix: str
    names: list[str] | None
    """The merged tensors of the tower (a whole-model merge), else ``None``: every merged tensor."""
    attribute: str
    """``vision_model`` / ``text_model`` (``model``: a model of one tower)."""
    owner: torch.Tensor | None = None
    """The model each sample belongs to (:attr:`RunInputs.sample_owner`), or ``None``."""


@contextlib.contextmanager
def open_inputs(config: MergeConfig, *, device: Any = None, token: str | bool | None = None, needs_data: bool,
                progress: bool = True, whole_model: bool = False, scoring: bool = False,
                record: bool = False) -> Iterator[RunInputs]:
    """Prepare the inputs of ``config`` (see the module docstring); the checkpoints are closed on exit.

    ``record``: fingerprint the local inputs for the run's recipe (:attr:`RunInputs.fingerprints`); a fingerprint
    the config records is checked either way.

    ``whole_model``: when the base and every model are whole models holding the adapter's tower (full
    ``CLIPModel`` repos), merge every tensor of them, not only the tower's (see
    :func:`hf_mloss.adapters.whole_model_adapter`). ``scoring``: a ``score()`` / ``compatibility()`` run, as its
    refusals say.
    """

    device = resolve_device(device)
    specs = [config.base, *config.models]
    resolved = [_resolve(config.base, token)]
    resolved += [_resolve(spec, token, base=resolved[0]) for spec in config.models]
    adapter = _adapter_of(resolved[0])
    if not scoring:
        _warn_repeated_models(resolved, config)
    for (ref, _, model_config), spec in zip(resolved[1:], config.models):
        other = _adapter_of((ref, None, model_config))
        if other.name != adapter.name:
            raise IncompatibleCheckpointsError(
                f"{ref.name!r} is a {model_config.model_type!r} model ({other.name} adapter) but the base is "
                f"{resolved[0][2].model_type!r} ({adapter.name}); all models must share one architecture.")
    check_family(config, adapter, resolved, needs_data=needs_data, scoring=scoring)
    from .classes import check_heads_kept, differing_heads, holds_whole, kept_class_adapter, merged_labels

    if whole_model:  # a merge written as the base's class: the fine-tunes' heads must have a place in it
        check_heads_kept(adapter, resolved)

    kept, class_note = kept_class_adapter(adapter, resolved[0][2])  # a ViTForImageClassification base: its class
    whole = [holds_whole(kept, c) for _, _, c in resolved]
    towers = check_text_data(config, kept, resolved, whole)
    whole_model = whole_model or bool(towers)
    if not whole_model:
        class_note = None  # the encoder alone (output="tower", scoring) is the family's class, as asked
    elif all(whole):
        from ..adapters import whole_model_adapter

        adapter = whole_model_adapter(kept)
    elif whole[0] and kept is not adapter and not any(whole[1:]):
        adapter = kept
        class_note = (f"The fine-tunes hold the {adapter.model_class.__name__} only: the merge is written as the "
                      f"base's {adapter.kept_class.__name__}, with the base's head.")
    elif whole[0] and any(whole[1:]):
        check_outside_unchanged(kept, resolved, whole)
    if getattr(config, "tokenizer_source", None) is None:  # else the vocabularies are merged (loading.vocab)
        check_vocabularies(resolved, config)
    check_tying(adapter, resolved)
    stores: list[TensorStore] = []
    fingerprints: FolderFingerprints | None = None
    try:
        for ref, loaded, _ in resolved:
            opener = getattr(ref, "open_store", None)  # a LoRA adapter, read over the base (hf_mloss.loading.lora)
            stores.append(opener(adapter, stores[0]) if opener else ModuleStore(loaded, adapter, ref)
                          if loaded is not None else CheckpointStore(ref, adapter))
        check_no_float8(stores)
        readers = list(stores)  # before any wrapping: what they read paces the background fingerprints
        uninitialised = check_config_matches_tensors(adapter, stores[0], stores[1:])
        vocabulary = None
        if getattr(config, "tokenizer_source", None) is not None:
            stores, adapter, vocabulary = _merged_vocabulary(config, adapter, stores, resolved)
        heads, head_note = differing_heads(adapter, stores[0], stores[1:])  # another number of labels: the base's
        for store in stores[1:]:
            check_compatible(stores[0], store, skip=frozenset(heads), config=config)
        labels, label_note = merged_labels(adapter, resolved, heads)
        fingerprints = _fingerprints(specs, resolved, record=record, progress=progress, readers=readers)
        method = config.merge_method()
        inputs = RunInputs(adapter=adapter, base=stores[0], sources=stores[1:], base_model=resolved[0][1],
                           names=[n for n in float_names(stores[0]) if n not in set(heads)],
                           alpha=resolve_weights(config, method.default_weight), device=device,
                           fingerprints=fingerprints, towers=towers)
        inputs.vocabulary = vocabulary
        inputs.id2label = labels
        inputs.notes += [note for note in (class_note, head_note, label_note, *routing_notes(resolved)) if note]
        if uninitialised:
            inputs.uninitialised = uninitialised
            inputs.notes.append(uninitialised_note(uninitialised))
        _check_layers(config, adapter, towers)
        if needs_data:
            _check_own_modalities(config, inputs)  # before any data is read
            _load_data(inputs, config, resolved[0][0], token, progress=progress)
        if needs_data and towers:
            _load_tower_text(inputs, config, resolved[0][0], token, progress=progress)
        if needs_data and getattr(getattr(config, "select", None), "shares", None):
            _load_shares(inputs, config, resolved[0][0], token)
        yield inputs
    finally:
        if fingerprints is not None:
            fingerprints.close()
        for store in stores:
            store.close()


def _merged_vocabulary(config: MergeConfig, adapter: ModelAdapter, stores: list[TensorStore], resolved
                       ) -> tuple[list[TensorStore], ModelAdapter, VocabularyPlan | None]:
    """The stores read through the merged vocabulary of ``config.tokenizer_source``, the adapter of the output's
    config (its ``vocab_size``), and the plan (None where the base's vocabulary is kept as it is)."""
    from .vocab import plan_for_run

    base_is_reference = not any((m.model, m.revision) == (config.base.model, config.base.revision)
                                for m in config.models)  # no mergekit base_model: the base is one of the models
    plan = plan_for_run(config.tokenizer_source, stores, adapter, base_is_reference=base_is_reference,
                        isolated=config.method == "passthrough", loaded=[loaded is not None for _, loaded, _ in resolved])
    if plan is None:
        return stores, adapter, None
    from ..adapters import adapter_for

    output_config = copy.deepcopy(adapter.config)
    text = output_config.get_text_config() if hasattr(output_config, "get_text_config") else output_config
    text.vocab_size = plan.size
    return plan.wrap(stores), adapter_for(output_config), plan


def _adapter_of(entry) -> ModelAdapter:
    """The family adapter of a resolved input; a config transformers loads but cannot build a model from (a junk
    ``rope_scaling``, an unknown ``rope_type``) is named as that input's, not raised from inside transformers."""
    from ..adapters import adapter_for
    from ..errors import CorruptCheckpointError, HfMLossError

    ref, _, model_config = entry
    try:
        return adapter_for(model_config)
    except HfMLossError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        message = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        raise CorruptCheckpointError(f"The config.json of {ref.name!r} does not describe a model transformers can "
                                     f"build ({message}); fix that field (e.g. rope_scaling) or save the model "
                                     "again.") from None


def _resolve(spec: ModelSpec, token, base=None):
    from transformers import AutoConfig

    from ..errors import CorruptCheckpointError

    if spec.is_loaded:
        model = spec.model
        name = getattr(model.config, "_name_or_path", "") or ""
        from .hub import is_repo_id, looks_local

        repo_id = name if name and not looks_local(name) and is_repo_id(name) else None
        model_config = model.config
        if not getattr(model_config, "architectures", None):  # built in memory: its class names the architecture
            model_config = copy.deepcopy(model_config)
            model_config.architectures = [type(model).__name__]
        return ModelRef(path=name, repo_id=repo_id), model, model_config
    try:
        ref = resolve_model(spec.model, revision=spec.revision, token=token)
        if ref.weights_file is None and (Path(ref.path) / "adapter_config.json").is_file():
            raise CorruptCheckpointError("an adapter folder")  # with a config.json of its base beside it
        check_model_type(ref)
    except CorruptCheckpointError:  # not a model folder: a PEFT LoRA adapter is read over the base (hf_mloss.loading.lora)
        from .lora import resolve_lora

        if (lora := resolve_lora(spec, base, token)) is None:
            raise
        return lora
    try:
        model_config = AutoConfig.from_pretrained(ref.path, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - transformers' config validation raises its own error classes too
        message = " ".join(str(err).split())[:300]
        raise CorruptCheckpointError(f"Cannot read the config.json of {ref.name!r}: {message}") from None
    return ref, None, model_config


def check_model_type(ref: ModelRef) -> None:
    """Refuse, before transformers sees it, a config whose ``model_type`` only custom code shipped with the model
    could build: hf_mloss never runs code from a model repo (``trust_remote_code`` is always False)."""
    import json

    from transformers import CONFIG_MAPPING

    from ..errors import CorruptCheckpointError, UnsupportedModelError

    path = Path(ref.path) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{ref.name!r} has no config.json: it is not a transformers model folder.") \
            from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpointError(f"Cannot read the config.json of {ref.name!r}: {str(err)[:200]}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        custom = " and ships custom code (auto_map), which hf_mloss never runs" if isinstance(config, dict) and \
            config.get("auto_map") else ""
        from ..adapters import list_adapters

        raise UnsupportedModelError(
            f"{ref.name!r} has model_type={str(model_type)[:60]!r}, which is not a transformers architecture{custom}. "
            f"hf_mloss merges transformers models with an adapter: {list_adapters()}.")


def check_family(config: MergeConfig, adapter: ModelAdapter, resolved, *, needs_data: bool, scoring: bool = False
                 ) -> None:
    """Refuse, before any tensor is read, what the family cannot do: scoring a family without M-Loss scoring,
    ``output="tower"`` of a model without a tower, models of another ``model_type`` than the base's; each refusal
    names what was asked (the method, label-free selection, or ``scoring``: score() / compatibility())."""
    from ..errors import UnsupportedModelError

    base_type = getattr(resolved[0][2], "model_type", None)
    method = config.merge_method()
    searches = any(getattr(method, kind, None) for kind in ("learned", "chooses_method", "gram_prefix"))
    what = ("Scoring (score(), compatibility())" if scoring else
            "Label-free selection (select=...)" if getattr(config, "select", None) is not None else
            f"Method {config.method!r}" if method.needs_data or searches else
            "Scoring (score(), compatibility())")
    if needs_data or getattr(method, "chooses_method", False):  # auto refuses them with data or without
        from .classes import refuse_vision_language

        walks = scoring or getattr(config, "select", None) is None and not searches
        refuse_vision_language(resolved[0][2], what, scored=walks)
    if needs_data:
        if not getattr(adapter, "scorable", True):
            from ..adapters.generic import scoring_unavailable

            raise UnsupportedModelError(scoring_unavailable(base_type, what))
    if adapter.name != "generic":
        return
    if getattr(config, "output", "auto") == "tower":
        raise InvalidParameterError(
            f"output='tower' keeps one tower of a whole model (a CLIPModel's vision tower); a {base_type!r} model has "
            "none. Use output='auto' (the base's class).")
    for ref, _, model_config in resolved[1:]:
        if model_config.model_type != base_type:
            raise IncompatibleCheckpointsError(
                f"{ref.name!r} is a {model_config.model_type!r} model but the base is a {base_type!r} model; all "
                "models merged together must share one architecture.")


def check_text_data(config: MergeConfig, adapter: ModelAdapter, resolved, whole: list[bool]) -> list[ModelAdapter]:
    """The text towers ``config.text_data`` scores (views named as in the whole model), or ``[]`` without it.

    Raises:
        InvalidParameterError: the base is not a whole two-tower model with a scored text tower (a CLIPModel), a
            model holds one tower only, or the run keeps one tower (``output="tower"``).
    """
    if not (config.has_data("text_data") if hasattr(config, "has_data") else getattr(config, "text_data", None)):
        return []
    from .classes import whole_model_towers

    base_type = getattr(resolved[0][2], "model_type", None)
    texts = [view for view in whole_model_towers(adapter) if getattr(view, "modality", "image") == "text"] \
        if whole[0] else []
    if not texts:
        raise InvalidParameterError(
            f"text_data scores the text tower of a whole two-tower model (a CLIPModel), but the base is a "
            f"{base_type!r} model ({adapter.name} adapter) with no text tower beside a scored one. Text for a text "
            "model (BERT, Llama, CLIPTextModel) goes to data=...; drop text_data.")
    towerless = [ref.name for (ref, _, _), is_whole in zip(resolved[1:], whole[1:]) if not is_whole]
    if towerless:
        raise InvalidParameterError(
            f"text_data scores the text tower, but {towerless[:3]} hold only one tower (not a whole {base_type!r} "
            "model): give every model as a whole model, or drop text_data.")
    if getattr(config, "output", "auto") != "auto" and config.merge_method().needs_data:
        raise InvalidParameterError(f"text_data scores the text tower of the whole model, but output="
                                    f"{config.output!r} does not write it; use output='auto' or drop text_data.")
    return texts


def check_outside_unchanged(adapter: ModelAdapter, resolved, whole: list[bool]) -> None:
    """A whole-model base merged with some tower-only models gives the tower merged into the base's whole model:
    refuse it when a whole fine-tune changed tensors outside the tower, which that merge would silently drop."""
    from ..adapters import whole_model_adapter

    outside_adapter = whole_model_adapter(adapter)
    opened = [ModuleStore(loaded, outside_adapter, ref) if loaded is not None else
              CheckpointStore(ref, outside_adapter) for (ref, loaded, _), is_whole in zip(resolved, whole) if is_whole]
    try:
        base, others = opened[0], opened[1:]
        names = [n for n in float_names(base) if outside_adapter.is_outside_tower(n)]
        for store in others:
            changed = [n for n in names if n in store and (store.shapes[n] != base.shapes[n] or
                                                           not torch.equal(store.get(n), base.get(n)))]
            if changed:
                towers = [ref.name for (ref, _, _), is_whole in zip(resolved, whole) if not is_whole]
                raise IncompatibleCheckpointsError(
                    f"{store.ref.name!r} changed {len(changed)} tensor(s) outside the {adapter.name} tower (e.g. "
                    f"{changed[:3]}), but {towers[:3]} hold only that tower, so a whole-model merge would keep the "
                    "base's values for them. Pass output='tower' to merge and save the tower only, or give every "
                    "model as a whole model.")
    finally:
        for store in opened:
            store.close()


def check_tying(adapter: ModelAdapter, resolved) -> None:
    """Refuse a fine-tune that unties what the base ties (``lm_head`` from the input embeddings).

    transformers reads such a fine-tune's own trained ``lm_head`` (its config says ``tie_word_embeddings: false``),
    while a merge written in the base's class ties it to the merged embeddings again: the fine-tune's head would be
    dropped without a word. The reverse (an untied base, a tied fine-tune) is refused by the tensor check, as the
    fine-tune's checkpoint lacks the head.

    Raises:
        IncompatibleCheckpointsError: naming the fine-tune, the tied tensors and how to untie the base.
    """
    tied = adapter.tied_names() if hasattr(adapter, "tied_names") else frozenset()
    if not tied:
        return
    base_ref, base_flags = resolved[0][0], _tie_flags(resolved[0][2])
    for ref, _, model_config in resolved[1:]:
        if not any(flag is False and base is not False for flag, base in zip(_tie_flags(model_config), base_flags)):
            continue
        raise IncompatibleCheckpointsError(
            f"{ref.name!r} has its own {sorted(tied)[:2]} (tie_word_embeddings=false in its config.json) but the base "
            f"{base_ref.name!r} ties them to the input embeddings. transformers uses that fine-tune's trained "
            "head, and a merge saved as the base ties it to the merged embeddings again, dropping it. Untie the base "
            "and merge onto that: load it, set model.config.tie_word_embeddings = False, give it its own head "
            "(model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.clone())) and "
            "save_pretrained it.")


ROUTING_KEYS = ("num_experts_per_tok", "norm_topk_prob", "routed_scaling_factor", "router_scaling_factor", "n_group",
                "topk_group", "topk_method", "scoring_func", "moe_topk", "moe_k")
"""Config settings of transformers' MoE families that decide how tokens are routed at inference (how many experts,
how their weights are normalised or scaled, grouped top-k); training-only ones (aux-loss coefficients, jitter) are
left out."""


def routing_notes(resolved) -> list[str]:
    """The card's lines on fine-tunes whose MoE routing settings (:data:`ROUTING_KEYS`) differ from the base's: the
    merge runs with the base's (its config.json), which is not how those experts were trained to be used."""
    def settings(config: Any) -> dict[str, Any]:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return {key: getattr(text, key) for key in ROUTING_KEYS if hasattr(text, key)}

    base = settings(resolved[0][2])
    notes = []
    for ref, _, model_config in resolved[1:]:
        own = settings(model_config)
        differ = [key for key in base if key in own and own[key] != base[key]]
        if differ:
            shown = ", ".join(f"{key}={own[key]!r} (the base: {base[key]!r})" for key in differ)
            notes.append(f"{ref.name!r} was configured to route tokens otherwise than the base ({shown}): the merge "
                         f"keeps the base's routing, as its config.json says, so its merged experts run with "
                         f"{', '.join(f'{key}={base[key]!r}' for key in differ)}.")
    return notes


def _tie_flags(config: Any) -> tuple[Any, Any]:
    """``tie_word_embeddings`` of a config and of its text config (a multimodal model may tie in either)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "tie_word_embeddings", None), getattr(text, "tie_word_embeddings", None)


def check_vocabularies(resolved, config: Any = None) -> None:
    """Refuse fine-tunes whose tokenizer has tokens the base's lacks, or ids the base's gives to other tokens (added
    tokens): their embedding rows do not line up with the base's, even where the row counts happen to agree; the
    message says what ``config``'s run can do about it (:func:`vocabulary_advice`).

    Compared where both folders hold a ``tokenizer.json`` (the fast-tokenizer file every current tokenizer saves).
    """
    base_ref = resolved[0][0]
    base_vocab = tokenizer_file_vocab(base_ref.path)
    if base_vocab is None:
        return
    for ref, _, _ in resolved[1:]:
        vocab = tokenizer_file_vocab(ref.path)
        if vocab is None or vocab == base_vocab:
            continue
        moved = sorted((token, i) for token, i in vocab.items() if base_vocab.get(token) != i)
        if not moved:
            continue  # the fine-tune's tokenizer lacks some of the base's tokens: the ids that exist still agree
        examples = ", ".join(f"{token!r} (id {i})" for token, i in sorted(moved, key=lambda t: t[1])[:3])
        raise IncompatibleCheckpointsError(
            f"The tokenizer of {ref.name!r} has {len(moved)} token(s) that the base {base_ref.name!r} lacks or "
            f"numbers differently (e.g. {examples}): added tokens. Their embedding rows have no counterpart in the "
            f"base, and hf_mloss never pads or re-aligns rows silently. {vocabulary_advice(config)}")


def vocabulary_advice(config: Any, *, saved_tokenizers: bool = False) -> str:
    """What a run can do with fine-tunes whose vocabulary differs from the base's: ``tokenizer_source='union'`` where
    its config takes it (a data-free merge written as a whole model, compatibility()), else why not and what can.
    ``saved_tokenizers``: add that the alignment reads every model's saved tokenizer."""
    refusal = None
    if config is not None and hasattr(config, "replace") and getattr(config, "tokenizer_source", None) is None:
        from ..errors import HfMLossError

        try:  # the config's own rule decides, so the advice never names what the config then refuses
            config.replace(tokenizer_source="union")
        except HfMLossError as err:
            refusal = str(err)
    union = "tokenizer_source='union' (YAML: tokenizer_source: union" + (
        "; every model saved with its tokenizer)" if saved_tokenizers else ")")
    if refusal is None:
        return (f"Pass {union} to merge the vocabularies and align the rows as mergekit does, or merge fine-tunes "
                "that kept the base's tokenizer.")
    alternative = (f"Merge them with a data-free method (e.g. method='task_arithmetic', 'ties' or 'tsv_m') and "
                   f"{union}, or use fine-tunes that kept the base's tokenizer.")
    method = config.merge_method()
    if method.needs_data:  # the data is tokenized once and every model reads the same ids
        return (f"{method.pretty_name} cannot merge fine-tunes whose vocabularies differ: it runs every model on the "
                f"same tokenized data, and aligning the vocabularies (tokenizer_source) serves data-free merges only. "
                f"{alternative}")
    return f"This run cannot align the vocabularies: {refusal} {alternative}"


def float_names(store: TensorStore) -> list[str]:
    return [n for n in store.keys() if store.dtypes[n] is not None and store.dtypes[n].is_floating_point]


def check_compatible(base: TensorStore, other: TensorStore, *, skip: frozenset[str] = frozenset(),
                     config: Any = None) -> None:
    """Raise :class:`IncompatibleCheckpointsError` unless ``other`` has the base's float tensors and shapes.

    Non-float tensors (buffers such as ``position_ids``, which older checkpoints persist and newer ones do not) are
    taken from the base and never merged, so they may be absent from either side; so are the ``skip`` tensors (a
    classification head of another shape, or that encoder-only fine-tunes lack, taken from the base).
    """
    base_float, other_float = set(float_names(base)), set(float_names(other))
    missing = [n for n in float_names(base) if n not in other_float and n not in skip]
    extra = [n for n in float_names(other) if n not in base_float] + list(getattr(other, "beyond_config", ()))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensor(s) of the base are missing (e.g. {missing[:3]})")
        if extra:
            parts.append(f"{len(extra)} tensor(s) are not in the base (e.g. {extra[:3]})")
        raise IncompatibleCheckpointsError(
            f"{other.ref.name!r} does not match the base {base.ref.name!r}: {'; '.join(parts)}. "
            "All models merged together must share one architecture.")
    for name in float_names(base):
        if name not in skip and base.shapes[name] != other.shapes[name]:
            if _rows_differ(base.shapes[name], other.shapes[name]) and _is_vocabulary(name):
                raise IncompatibleCheckpointsError(
                    f"{name!r} has {base.shapes[name][0]} rows in the base {base.ref.name!r} but "
                    f"{other.shapes[name][0]} in {other.ref.name!r}: the vocabularies differ (added tokens or another "
                    "tokenizer). Rows of different vocabularies do not line up, and hf_mloss never pads them "
                    f"silently. {vocabulary_advice(config, saved_tokenizers=True)}")
            raise IncompatibleCheckpointsError(
                f"{name!r} has shape {base.shapes[name]} in {base.ref.name!r} but {other.shapes[name]} in "
                f"{other.ref.name!r}. All models merged together must share one architecture.")


def _rows_differ(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and len(a) >= 1 and a[0] != b[0] and a[1:] == b[1:]


def _is_vocabulary(name: str) -> bool:
    """Whether a tensor is indexed by token id (input embeddings, LM head and its bias)."""
    parts = name.split(".")
    return any(p in ("embed_tokens", "word_embeddings", "wte", "lm_head", "embed_out", "token_embedding",
                     "shared", "decoder") for p in parts) or "vocab" in name


def check_config_matches_tensors(adapter: ModelAdapter, base: TensorStore,
                                 sources: list[TensorStore] = ()) -> list[str]:
    """The base's config must describe its weights: a config with more blocks (or other sizes) than the tensors would
    give a model whose missing parts are randomly initialised, one with fewer would silently drop blocks.

    One case is accepted: tensors outside the numbered blocks (a BERT pooler, which ``*ForMaskedLM`` and
    ``*ForTokenClassification`` saves and ``add_pooling_layer=False`` models lack) that *every* input lacks.
    transformers initialises them at random when it loads any of the inputs; the merge does the same and says so.
    Returns those names (empty otherwise).

    Raises:
        IncompatibleCheckpointsError: naming the first tensors that are missing, extra or of another shape.
    """
    expected = adapter.expected_shapes()
    held = {n: base.shapes[n] for n in float_names(base)}
    missing = [n for n in expected if n not in held and n not in base.shapes]
    extra = [n for n in held if n not in expected] + list(getattr(base, "beyond_config", ()))
    wrong = [n for n in expected if n in held and held[n] != expected[n]]
    if not (missing or extra or wrong):
        return []
    if missing and not (extra or wrong) and not any(re.search(r"\.\d+\.", n) for n in missing) and \
            not any(n in store.shapes for store in sources for n in missing):
        return missing
    parts = []
    if missing:
        parts.append(f"the weights lack {len(missing)} tensor(s) the config implies (e.g. {missing[:2]}), which would "
                     "be randomly initialised")
    if extra:
        parts.append(f"the weights hold {len(extra)} tensor(s) the config does not describe (e.g. {extra[:2]})")
    if wrong:
        name = wrong[0]
        parts.append(f"{name!r} has shape {held[name]} but the config implies {expected[name]}")
    raise IncompatibleCheckpointsError(
        f"config.json of {base.ref.name!r} does not match its weights: {'; '.join(parts)}. The config and the "
        "weights do not belong together.")


_FLOAT8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                                   "float8_e8m0fnu") if hasattr(torch, name))


def check_no_float8(stores: list[TensorStore]) -> None:
    """Refuse float8 tensors (``F8_E4M3``, ``F8_E5M2``): a quantised checkpoint's values mean nothing without their
    scales, and hf_mloss does not dequantise.

    Raises:
        UnsupportedModelError: naming the checkpoint, a tensor and what to do.
    """
    from ..errors import UnsupportedModelError

    for store in stores:
        found = [n for n, dtype in store.dtypes.items() if dtype in _FLOAT8]
        if found:
            raise UnsupportedModelError(
                f"{store.ref.name!r} holds {len(found)} float8 tensor(s) (e.g. {found[0]!r}, "
                f"{store.dtypes[found[0]]}): a quantised checkpoint, which hf_mloss does not merge. Load it with "
                "transformers in bfloat16 or float32 (dequantised), save_pretrained it, and merge that.")


def uninitialised_note(names: list[str]) -> str:
    """The card's note on tensors no input holds (see :func:`check_config_matches_tensors`)."""
    return (f"Every input lacks {len(names)} tensor(s) its config implies ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}); transformers initialises them at random when it loads any of "
            "the inputs, and the merged model holds such freshly initialised values there (they were not merged).")


def resolve_weights(config: MergeConfig, default: str) -> torch.Tensor:
    """α as the method uses it: the config's weights, or uniform 1/q (1 for ``default == "one"``)."""
    q = len(config.models)
    if config.weights is None:
        return torch.full((q,), 1.0 if default == "one" else 1.0 / q, dtype=torch.float64)
    return torch.tensor(config.weights, dtype=torch.float64)


def _check_layers(config: MergeConfig, adapter: ModelAdapter, towers: list[ModelAdapter] = ()) -> None:
    layers = set()
    params = config.method_params()
    for source in (getattr(params, "layers", None), config.score.layers if config.score else None):
        layers |= set(source or ())
    scored = ([getattr(adapter, "tower_view", adapter)] if config.has_data() else []) + list(towers)
    for each in scored or [adapter]:
        if layers and max(layers) >= each.num_layers:
            where = f" (the {each.tower_attribute} tower)" if hasattr(each, "tower_attribute") else ""
            raise InvalidParameterError(
                f"layers names block {max(layers)} but the model{where} has {each.num_layers} blocks "
                f"(valid: 0..{each.num_layers - 1}).")


def _load_data(inputs: RunInputs, config: MergeConfig, base_ref: ModelRef, token, *, progress: bool = False
               ) -> None:
    """The scoring data, read once: the shared ``data`` and each model's own, one after the other, as the adapter's
    inputs (:attr:`RunInputs.model_inputs`), each sample naming its model (:attr:`RunInputs.sample_owner`)."""
    shared = None
    if config.data is not None:
        shared = _read_data(inputs, config, config.data, base_ref, token, progress=progress)
    own = _read_own(config, "data", lambda spec, where: _read_data(inputs, config, spec, base_ref, token,
                                                                   progress=progress, where=where), inputs, token)
    if shared is None and not own:
        return
    joined = _joined(shared, own, len(config.models), config.seed)
    inputs.model_inputs, inputs.data_info, inputs.sample_owner, inputs.model_data_info = joined


def _read_own(config: MergeConfig, key: str, read, inputs: RunInputs, token: Any = None
              ) -> dict[int, tuple[ModelInputs, DataInfo]]:
    """Each model's own ``key`` (``data`` / ``text_data``) read by ``read(spec, where)``: a Hub dataset at the commit
    its revision points to, a local folder or file checked against its recorded fingerprint (both recorded in
    :attr:`RunInputs.data_records`); failures name the model."""
    out = {}
    for p, model in enumerate(config.models):
        spec = getattr(model, key)
        if spec is None:
            continue
        where = f"models[{p}] ({model.label}).{key}"
        try:
            spec, record = _own_source(spec, where, token)
            out[p] = read(spec, where)
        except DataError as err:
            message = str(err)
            raise DataError(message if message.startswith(where) else f"{where}: {message}") from None
        if record:
            inputs.data_records[(p, key)] = record
    return out


def _warn_repeated_models(resolved: list[tuple[ModelRef, Any, Any]], config: MergeConfig) -> None:
    """Warn, for a merge, when a fine-tune is given twice (it counts twice) or, for a merge of task vectors, is the
    base itself (its task vector is zero): both are allowed, and more often a slip than meant. The same folder (or
    Hub snapshot), or the same loaded object. (A merge of the models themselves, such as an average or mergekit's
    `linear` without a base, may take the base among its inputs on purpose.)"""
    import warnings

    def identity(ref: ModelRef, loaded: Any) -> Any:
        return id(loaded) if loaded is not None else os.path.realpath(ref.path) if ref.path else None

    method = config.merge_method()
    if method.name == "passthrough":  # layer ranges stacked as the slices say, the base's and one model's again
        return
    seen: dict[Any, int] = {}
    base = identity(*resolved[0][:2])
    for i, (ref, loaded, _) in enumerate(resolved[1:]):
        key = identity(ref, loaded)
        label = f"models[{i}] ({config.models[i].label})"
        if key is not None and key == base and method.zero_delta_is_base:
            warnings.warn(f"{label} is the base itself: its task vector is zero, and it pulls the merge towards the "
                          f"base ({method.pretty_name} merges task vectors).", UserWarning, stacklevel=4)
        elif key is not None and key in seen:
            warnings.warn(f"{label} is models[{seen[key]}] again: it counts twice in the merge (a `weight` gives one "
                          "model more say).", UserWarning, stacklevel=4)
        seen.setdefault(key, i)


def _own_source(spec: Any, where: str, token: Any = None) -> tuple[Any, dict[str, str]]:
    """A model's own data as read, and what the recipe records of it: a Hub id's commit, a local path's
    fingerprint (refused when a recorded one differs)."""
    from .hub import dataset_commit, fingerprint_data

    if spec.path is not None:
        value = fingerprint_data(spec.path)
        if spec.fingerprint is not None and spec.fingerprint != value:
            raise DataError(f"{where}: {spec.path!r} is not the data this config was recorded from: its content "
                            f"fingerprint is {value}, the config expects {spec.fingerprint}. Point it at the original "
                            "data, or delete the `fingerprint` line to accept this.")
        return spec, {"fingerprint": value}
    if spec.id is not None:
        commit = dataset_commit(spec.id, spec.revision, token=token)
        return replace(spec, revision=commit), {"revision": commit}
    return spec, {}


def _joined(shared: tuple[ModelInputs, DataInfo] | None, own: dict[int, tuple[ModelInputs, DataInfo]],
            num_models: int, seed: int) -> tuple[ModelInputs, DataInfo, torch.Tensor | None, list[DataInfo | None]]:
    """The shared samples and each model's own as one set (samples, description, owners, each model's own
    description); the shared set alone, without owners, when no model has its own."""
    from .data import DataInfo
    from .model_inputs import SHARED, concat_samples

    if not own:
        return shared[0], shared[1], None, []
    parts = ([(SHARED, shared)] if shared is not None else []) + sorted(own.items())
    samples = concat_samples([part[0] for _, part in parts])
    owner = torch.cat([torch.full((len(part[0]),), p, dtype=torch.long) for p, part in parts])
    infos = [own[p][1] if p in own else None for p in range(num_models)]
    if shared is not None:
        info = shared[1]
    else:
        info = DataInfo(source="each model's own data", num_samples=len(samples), seed=seed,
                        sampling=f"{len(own)} sets, one per model")
    return samples, info, owner, infos


def _read_data(inputs: RunInputs, config: MergeConfig, data: Any, base_ref: ModelRef, token, *,
               progress: bool = False, where: str = "data") -> tuple[ModelInputs, DataInfo]:
    """One data spec read as the adapter's inputs: images for image families, token ids for text families."""
    from .data import check_pixel_tensor, load_model_inputs
    from .model_inputs import as_model_inputs

    modality = getattr(inputs.adapter, "modality", "image")
    family = f"{inputs.adapter.name} ({getattr(inputs.adapter.full_config, 'model_type', None)!r})"
    name = None if where == "data" else where  # a model's own data is named in a warning; the shared pool is not
    if modality == "text":
        model_inputs, info = load_text(inputs.adapter, data, config, inputs, base_ref, token, family=family,
                                       progress=progress, where=f"{where}.max_length", name=name)
    else:
        needs_processor = not isinstance(data.objects, torch.Tensor) and as_model_inputs(data.objects) is None
        processor = resolve_processor(config, inputs, base_ref, token) if needs_processor else None
        try:
            model_inputs, info = load_model_inputs(
                data.source, modality="image", processor=processor, family=family, num_samples=data.num_samples,
                seed=config.seed, split=data.split, image_column=data.image_column, revision=data.revision,
                progress=progress, name=name)
        except DataError as err:
            from .classes import whole_model_towers

            if "text" not in str(err) or not any(v.modality == "text" for v in whole_model_towers(inputs.adapter)):
                raise
            raise DataError(f"{err} For the text tower of this whole {inputs.adapter.full_config.model_type!r} "
                            "model, pass the text as text_data=... (both towers are then scored).") from None
        pixels = model_inputs["pixel_values"]
        check_pixel_tensor(pixels)  # also what the image processor made of the images
        scored = getattr(inputs.adapter, "tower_view", None) or inputs.adapter  # a VLM: its vision tower
        size = getattr(scored.config, "image_size", None) if scored.fixed_image_size else None
        if isinstance(size, int) and tuple(pixels.shape[-2:]) != (size, size):
            raise DataError(f"The scoring images are {pixels.shape[-2]}×{pixels.shape[-1]} pixels; this "
                            f"{scored.name} tower takes {size}×{size} (config image_size). Pass images "
                            "(a dataset, folder or PIL images: the base's image processor resizes them), or "
                            f"tensors preprocessed to {size}×{size}.")
    return model_inputs, info


def load_text(adapter: ModelAdapter, data: Any, config: MergeConfig, inputs: RunInputs, base_ref: ModelRef, token,
              *, family: str, progress: bool = False, where: str | None = None, name: str | None = None
              ) -> tuple[ModelInputs, DataInfo]:
    """Texts of ``data`` (a :class:`~hf_mloss.spec.config.DataSpec`) tokenised for ``adapter``'s model (the base's
    tokenizer), checked against its vocabulary and positions; ``name``: whose data it is, for a warning."""
    from .data import DEFAULT_MAX_LENGTH, load_model_inputs
    from .model_inputs import as_model_inputs

    where = where or ("text_data.max_length" if data is config.text_data else "data.max_length")
    max_length = check_max_length(adapter, data.max_length, where=where)
    ready = as_model_inputs(data.objects) is not None
    tokenizer = None if ready else resolve_tokenizer(config, inputs, base_ref, token)
    model_inputs, info = load_model_inputs(
        data.source, modality="text", tokenizer=tokenizer, family=family, num_samples=data.num_samples,
        seed=config.seed, split=data.split, text_column=data.text_column,
        max_length=max_length or DEFAULT_MAX_LENGTH, revision=data.revision, progress=progress, name=name)
    check_token_ids(adapter, model_inputs["input_ids"])
    return model_inputs, info


def _load_tower_text(inputs: RunInputs, config: MergeConfig, base_ref: ModelRef, token, *, progress: bool = False
                     ) -> None:
    """``config.text_data`` and the models' own ``text_data``, tokenised for each text tower of the whole model (one
    set per tower, each sample naming its model as :func:`_load_data` does)."""
    for view in inputs.towers:
        family = f"{view.tower_attribute} of {getattr(view.full_config, 'model_type', None)!r} (text_data)"

        def read(spec: Any, where: str = "text_data", view: Any = view, family: str = family
                 ) -> tuple[ModelInputs, DataInfo]:
            samples, info = load_text(view, spec, config, inputs, base_ref, token, family=family, progress=progress,
                                      where=f"{where}.max_length", name=None if where == "text_data" else where)
            check = getattr(inputs.adapter, "check_text_tokens", None)  # a vision-language model: no image tokens
            if check is not None:
                check(samples["input_ids"][samples["attention_mask"].bool()] if "attention_mask" in samples
                      else samples["input_ids"])
            return samples, info

        shared = read(config.text_data) if config.text_data is not None else None
        own = _read_own(config, "text_data", read, inputs, token)
        if shared is None and not own:
            continue
        samples, info, owner, infos = _joined(shared, own, len(config.models), config.seed)
        inputs.tower_inputs[view.tower_attribute] = samples
        inputs.tower_data_info[view.tower_attribute] = info
        if owner is not None:
            inputs.tower_owner[view.tower_attribute] = owner
            inputs.tower_model_data_info[view.tower_attribute] = infos


def _load_shares(inputs: RunInputs, config: MergeConfig, base_ref: ModelRef, token) -> None:
    """Label-free selection's ``select.shares``: one unlabeled set per model, ``num_samples`` / q of each, read as
    the family reads its data, joined with each sample's model (:attr:`RunInputs.share_inputs`)."""
    import math

    from .data import DEFAULT_MAX_LENGTH, load_model_inputs
    from .model_inputs import as_model_inputs, concat_samples

    options = config.select
    per_model = math.ceil(options.num_samples / len(options.shares))
    parts, owner, reader = [], [], None
    text = getattr(inputs.adapter, "modality", "image") == "text"
    for p, spec in enumerate(config.share_specs(per_model)):
        ready = isinstance(spec.objects, torch.Tensor) or as_model_inputs(spec.objects) is not None
        if reader is None and not ready:
            reader = (resolve_tokenizer if text else resolve_processor)(config, inputs, base_ref, token)
        if text:
            max_length = check_max_length(inputs.adapter, spec.max_length or config.data.max_length)
            samples, _ = load_model_inputs(spec.source, modality="text", tokenizer=reader, num_samples=per_model,
                                           seed=config.seed, split=spec.split, text_column=spec.text_column,
                                           max_length=max_length or DEFAULT_MAX_LENGTH)
        else:
            samples, _ = load_model_inputs(spec.source, modality="image", processor=reader, num_samples=per_model,
                                           seed=config.seed, split=spec.split, image_column=spec.image_column)
        parts.append(samples)
        owner += [p] * len(samples)
    inputs.share_inputs, inputs.share_owner = concat_samples(parts), torch.tensor(owner)


def _check_own_modalities(config: MergeConfig, inputs: RunInputs) -> None:
    """Refuse, before any data is read, a model's own data of another modality than its model's (texts for an image
    tower, images for a text model or tower), where the objects or the path say which it holds."""
    from .data import DATA_FILE_SUFFIXES

    towers = {"data": getattr(getattr(inputs.adapter, "tower_view", None) or inputs.adapter, "modality", "image"),
              "text_data": "text"}
    family = f"{inputs.adapter.name} ({getattr(inputs.adapter.full_config, 'model_type', None)!r})"
    for p, model in enumerate(config.models):
        for key, expected in towers.items():
            spec = getattr(model, key)
            if spec is None:
                continue
            held = _held_modality(spec, DATA_FILE_SUFFIXES)
            if held is not None and held != expected:
                what = "texts" if held == "text" else "images"
                tower = "the text tower (text_data)" if key == "text_data" else f"this {family} model"
                advice = ("give its task's texts" if expected == "text" else "give its task's images") + (
                    "; a whole two-tower model's texts go to the entry's `text_data`" if key == "data" and
                    expected == "image" and inputs.towers else "")
                raise DataError(f"models[{p}] ({model.label}).{key} holds {what}, but {tower} reads {expected}s: "
                                f"{advice}.")


def _held_modality(spec: Any, text_suffixes: tuple[str, ...]) -> str | None:
    """``"text"`` or ``"image"`` where a data spec's objects or path show it without reading it, else ``None``."""
    from .model_inputs import as_model_inputs

    objects = spec.objects
    if objects is not None:
        if isinstance(objects, torch.Tensor):
            return "image" if objects.dim() == 4 else None
        given = as_model_inputs(objects)
        if given is not None:
            return given.modality
        if isinstance(objects, (list, tuple)) and objects:
            if all(isinstance(x, str) for x in objects):
                image = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
                return "image" if all(x.lower().endswith(image) for x in objects) else "text"
            if all(hasattr(x, "size") and hasattr(x, "mode") for x in objects):  # PIL images
                return "image"
        return None
    if spec.path is not None:
        path = Path(spec.path).expanduser()
        return "text" if path.is_file() and path.suffix.lower() in text_suffixes else None
    return None


def _text_config(adapter: ModelAdapter) -> Any:
    config = adapter.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_max_length(adapter: ModelAdapter, max_length: int | None, *, where: str = "max_length") -> int | None:
    """``max_length`` within the positions the model embeds (the sequences would otherwise index past the position
    embeddings): the default is lowered to them; a given one above them is refused, naming ``where``.

    Raises:
        DataError: a given ``max_length`` past the model's positions.
    """
    from .data import DEFAULT_MAX_LENGTH

    positions = getattr(_text_config(adapter), "max_position_embeddings", None)
    if not isinstance(positions, int) or positions < 1:
        return max_length
    if max_length is None:
        return min(DEFAULT_MAX_LENGTH, positions)
    if max_length > positions:
        raise DataError(f"{where}={max_length} is past the {positions} positions the base embeds "
                        f"(max_position_embeddings): give {where.rpartition('.')[2]} <= {positions}, or leave it out "
                        f"(the default, {DEFAULT_MAX_LENGTH}, is lowered to the model's limit).")
    return max_length


def check_token_ids(adapter: ModelAdapter, input_ids: torch.Tensor) -> None:
    """Every token id has a row in the model's embedding (else the tokenizer is not the base's), and every sequence
    fits the positions the model embeds (already tokenised inputs are not cut)."""
    positions = getattr(_text_config(adapter), "max_position_embeddings", None)
    if isinstance(positions, int) and input_ids.dim() == 2 and input_ids.shape[1] > positions:
        raise DataError(f"The scoring sequences are {input_ids.shape[1]} tokens long but the base embeds {positions} "
                        f"positions (max_position_embeddings). Cut them to {positions} tokens, or pass text and "
                        "max_length=... to have them tokenised.")
    vocab = getattr(_text_config(adapter), "vocab_size", None)
    if not isinstance(vocab, int) or not input_ids.numel():
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise DataError(
            f"The scoring token ids run from {low} to {high} but the base's vocabulary has {vocab} ids "
            "(vocab_size): the tokenizer does not belong to the base. Use the base's own tokenizer (saved in its "
            "folder), or pass processor=... naming a tokenizer with the base's vocabulary.")


def resolve_tokenizer(config: MergeConfig, inputs: RunInputs, base_ref: ModelRef, token) -> Any:
    """The tokenizer for the scoring texts: ``config.processor`` (a tokenizer or processor object, or a folder or
    Hub id holding one), else the base's (``AutoTokenizer``, never running code from the folder).

    Raises:
        InvalidParameterError: none can be found; the message says what to pass.
    """
    candidate = config.processor
    if candidate is not None and not isinstance(candidate, (str, os.PathLike)):
        inner = getattr(candidate, "tokenizer", None)  # a processor object (CLIPProcessor) carries its tokenizer
        return inner if inner is not None and callable(inner) else candidate
    where = os.fspath(candidate) if candidate is not None else (
        base_ref.path if base_ref.path and Path(base_ref.path).is_dir() else base_ref.repo_id)
    if where:
        from transformers import AutoTokenizer

        loader = getattr(inputs.adapter, "load_tokenizer", None)
        try:
            with quiet_transformers(True):
                if loader is not None:
                    return loader(where, token=token)
                return AutoTokenizer.from_pretrained(where, trust_remote_code=False, token=token)
        except (OSError, ValueError, TypeError, KeyError) as err:
            folder = Path(where)
            files = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")
            if folder.is_dir() and not any((folder / f).exists() for f in files):
                reason = (f"{where!r} has no tokenizer files (tokenizer.json, tokenizer_config.json...): it was saved "
                          "with the model's save_pretrained alone, without its tokenizer")
            else:
                reason = f"the tokenizer of {where!r} cannot be loaded ({first_sentence(str(err))})"
    else:
        reason = "the base was passed as a loaded model that does not name where it came from"
    raise InvalidParameterError(
        f"Scoring texts need the base model's tokenizer, and {reason}. Save it beside the weights "
        "(tokenizer.save_pretrained(folder)) or pass processor=... (a tokenizer object, or a Hub id or folder "
        "holding one; YAML: `processor: ...`), or pass the texts already tokenised ({'input_ids': ..., "
        "'attention_mask': ...}).")


def resolve_processor(config: MergeConfig, inputs: RunInputs, base_ref: ModelRef, token) -> Any:
    """The image processor for the scoring images: ``config.processor``, else the base's (or its ``name_or_path``'s).

    Raises:
        InvalidParameterError: none can be found; the message says what to pass.
    """
    candidate = config.processor
    if candidate is not None and not isinstance(candidate, (str, os.PathLike)):
        given = getattr(inputs.adapter, "image_processor_of", None)  # a vision-language model: its image part
        return candidate if given is None else given(candidate)  # a processor object
    if candidate is not None:
        where = os.fspath(candidate)
    else:
        where = base_ref.path if base_ref.path and Path(base_ref.path).is_dir() else base_ref.repo_id
    if where:
        loader = getattr(inputs.adapter, "load_image_processor", None) or inputs.adapter.load_processor
        try:
            with quiet_transformers(True):
                return loader(where, token=token)
        except (OSError, ValueError) as err:
            folder = Path(where)
            if folder.is_dir() and not (folder / "preprocessor_config.json").exists():
                reason = (f"{where!r} has no preprocessor_config.json (it was saved with the model's save_pretrained "
                          "alone, without its image processor)")
            else:
                reason = f"the image processor of {where!r} cannot be loaded ({first_sentence(str(err))})"
    else:
        reason = "the base was passed as a loaded model that does not name where it came from"
    raise InvalidParameterError(
        f"Scoring images need the base model's image processor, and {reason}. Pass processor=... (a Hub id or "
        "folder with a preprocessor_config.json, e.g. 'openai/clip-vit-base-patch32', or a processor object; "
        "YAML: `processor: ...`), or pass the images already preprocessed as a [N, 3, H, W] tensor.")


def first_sentence(text: str, limit: int = 240) -> str:
    """The first sentence of an error message on one line, cut at a word (never mid-word) when longer than ``limit``."""
    text = " ".join(text.split())
    end = text.find(". ")
    text = text if end == -1 else text[: end + 1]
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " …"


def resolve_device(device: Any = None) -> torch.device:
    """The run's device, refused up front when this machine cannot compute on it.

    ``None`` or ``"auto"``: the accelerator when there is one (this process's own under ``torchrun`` /
    ``accelerate launch``, else CUDA, then MPS), CPU otherwise (see :func:`hf_mloss.distributed.default_device`).
    """
    from ..distributed import AUTO, default_device, distributed_state

    state = distributed_state()  # under a launcher, joins the process group before any scoring shards its data
    if device is None or (isinstance(device, str) and device.strip().lower() == AUTO):
        return default_device()
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise InvalidParameterError(f"device {device!r} is not a torch device this library can use: pass 'auto' (the "
                                    "accelerator when there is one, else the CPU), 'cpu', 'cuda', 'cuda:N' or "
                                    "'mps'.") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (parsed.index is not None and parsed.index >= count):
            hint = f" or cuda:0..cuda:{count - 1}" if count else ""
            raise InvalidParameterError(f"device {device!r}: this machine has {count} CUDA device(s); use 'auto', "
                                        f"cpu{hint}.")
        if parsed.index is None and state is not None and torch.device(state.device).type == "cuda":
            return torch.device(state.device)  # one GPU per process under torchrun, not all on cuda:0
    elif parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise InvalidParameterError(f"device {device!r}: MPS is not available on this machine; use 'auto' or "
                                        "cpu.")
    elif parsed.type != "cpu":
        raise InvalidParameterError(f"device {device!r} cannot run a merge; use 'auto', cpu, cuda[:N] or mps.")
    return parsed


def as_dtype(name: str | torch.dtype) -> torch.dtype:
    return name if isinstance(name, torch.dtype) else DTYPES[name]


# ------------------------------------------------------------------------------------------- fingerprints
def _fingerprints(specs: list[ModelSpec], resolved, *, record: bool, progress: bool = False,
                  readers: list[TensorStore] = ()) -> FolderFingerprints:
    """The content fingerprints of the local inputs (index 0 = base).

    An input whose config records a fingerprint is hashed now and refused if it differs, before any work. The others
    are hashed only for a run that records them (``record``), on a background thread a little ahead of what the
    run's ``readers`` have read, so the disk serves each byte once
    (:class:`~hf_mloss.loading.hub.FolderFingerprints`)."""
    from tqdm.auto import tqdm

    local = [i for i, (ref, loaded, _) in enumerate(resolved) if loaded is None and ref.repo_id is None]
    checked = [i for i in local if specs[i].fingerprint is not None]
    bar = tqdm(total=len(checked), desc="Checking the inputs' fingerprints", unit="folder",
               disable=not progress or len(checked) < 2)
    known = {}
    for i in checked:
        ref, spec = resolved[i][0], specs[i]
        value = fingerprint_folder(ref.path)
        bar.update()
        if spec.fingerprint != value:
            raise IncompatibleCheckpointsError(
                f"{ref.name!r} ({ref.path}) is not the folder this config was recorded from: its weights' "
                f"fingerprint is {value}, the config expects {spec.fingerprint}. Point the config at the original "
                "weights, or delete the `fingerprint` line to accept these.")
        known[i] = value
    bar.close()
    pending = {i: resolved[i][0].path for i in local if i not in known} if record else {}
    return FolderFingerprints(known, pending, progress=lambda: sum(store.bytes_read for store in readers))
