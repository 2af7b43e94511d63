"""A causal LM run one decoder layer at a time over a few batches, each layer's weights read from the checkpoint when
it is reached and dropped after it: memory holds the embedding rows of the batches' tokens and one layer, never the
whole model (a 4-expert MoE of 0.5B experts is 3.5 GB in bfloat16; one of its layers, 0.15 GB).

The computation is the model's own, as ``from_pretrained`` builds it (:func:`skeleton`: its class, config, dtype and
attention implementation, without weights). The decoder's forward runs once per batch with every layer replaced by a
recorder that keeps the arguments the forward passes it (attention masks, rotary position embeddings, cache) and the
final norm by the identity; then each layer, filled from the checkpoint, runs on every batch with those arguments. Only
the order changes (layer by layer instead of batch by batch), so every hidden state is bit for bit what a whole
forward of the loaded model gives (``tests/test_moe_build.py`` checks it), and the language-model head and final norm,
which nothing here reads, are never computed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..engine.walk import release_memory  # noqa: F401  (kept importable from here)
from ..loading.store import TensorStore


def skeleton(folder: str | Path, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """The causal LM of ``folder`` as ``AutoModelForCausalLM.from_pretrained(folder, **kwargs)`` builds it, on the
    ``meta`` device (no weight read), and transformers' loading report (``missing_keys``, ``unexpected_keys``,
    ``mismatched_keys``): the checkpoint's keys and shapes checked against the class by transformers itself. No Hub
    kernels (transformers 5.25 swaps them in by default, and fails to on the meta device)."""
    from transformers import AutoModelForCausalLM

    from .._logging import quiet_transformers

    with quiet_transformers(True):
        model, info = AutoModelForCausalLM.from_pretrained(folder, device_map="meta", output_loading_info=True,
                                                           use_kernels=False, **kwargs)
    return model.eval(), info


def checked_skeleton(folder: str | Path, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """:func:`skeleton` without reading a weight: ``from_pretrained`` of the folder's config, given as its state dict
    the folder's tensors on the ``meta`` device, named and shaped as the weight files' headers (through the index of
    a sharded folder) say. transformers' loading report is then computed on the keys and shapes alone; given the
    folder itself, it reads every expert of an MoE to fuse them (3 GB for four 0.5B experts), on the meta device too.
    """
    import json

    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from .._logging import quiet_transformers
    from ..loading.store import meta_tensor, safetensors_header
    from ..output.shards import INDEX, SINGLE

    folder = Path(folder)
    index = folder / INDEX
    where = json.loads(index.read_text(encoding="utf-8"))["weight_map"] if index.is_file() else None
    files = sorted(set(where.values())) if where is not None else [SINGLE]
    state = {}
    for name in files:
        for key, info in safetensors_header(folder / name)[1].items():
            if where is None or where.get(key) == name:
                state[key] = meta_tensor(info)
    config = AutoConfig.from_pretrained(folder)
    with quiet_transformers(True):
        model, info = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
            None, config=config, state_dict=state, device_map="meta", output_loading_info=True, use_kernels=False,
            **kwargs)
    missing = sorted(set(where) - set(state)) if where is not None else []
    if missing:  # the index names tensors its shards do not hold
        info["missing_keys"] = sorted({*info["missing_keys"], *missing})
    return model.eval(), info


@dataclass
class Batch:
    """One batch in flight: ``hidden``, the input of the next layer to run, and what the decoder's forward passes
    each layer besides it (``calls[i]``: positional and keyword arguments)."""

    hidden: torch.Tensor
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)


class _Recorder(torch.nn.Module):
    """Stands for decoder layer ``index``: keeps the arguments it is called with and returns its input."""

    def __init__(self, index: int, sink: dict[int, tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        super().__init__()
        self.index, self.sink = index, sink

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.sink[self.index] = (args, kwargs)
        return hidden_states


class _Stop(Exception):
    """Raised by a hook to end a layer's forward early (nothing after the hooked module is needed)."""


class LayeredModel:
    """The decoder of a :func:`skeleton`, run layer by layer over batches, its weights read from ``store`` (a
    :class:`~hf_mloss.loading.store.TensorStore` of the checkpoint, named as the loaded model's state dict).

    ``record`` the batches, then for each ``(i, layer)`` of ``layers()`` (filled on entry, emptied after) call
    ``forward(i, layer, batch)`` on every batch."""

    def __init__(self, model: Any, store: TensorStore, device: torch.device | str = "cpu") -> None:
        self.model, self.store, self.device = model, store, torch.device(device)
        self.decoder = model.get_decoder()
        self.prefix = _prefix(model, self.decoder)
        self.num_layers = len(self.decoder.layers)
        self._arena: dict[str, torch.Tensor] = {}  # one layer's tensors, refilled layer after layer

    # ------------------------------------------------------------------------------------------ the batches
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding module's own forward, given only the rows of these tokens (read one by one)."""
        module = self.decoder.get_input_embeddings()
        name = self.prefix + _prefix(self.decoder, module) + "weight"
        unique, compact = torch.unique(input_ids, return_inverse=True)
        rows = torch.stack([self.store.get_rows(name, i, i + 1)[0] for i in unique.tolist()])
        weight, padding = module.weight, getattr(module, "padding_idx", None)
        module.weight = torch.nn.Parameter(rows.to(self.device, weight.dtype), requires_grad=False)
        module.padding_idx = None  # an index into the full table; it only matters for gradients
        try:
            with torch.no_grad():
                return module(compact.to(self.device))
        finally:
            module.weight, module.padding_idx = weight, padding

    def record(self, batches: Sequence[Mapping[str, torch.Tensor]], **kwargs: Any) -> list[Batch]:
        """Each batch's embeddings and the arguments the decoder's forward (called with the batch's tensors besides
        ``input_ids``, and ``kwargs``) passes each layer."""
        sink: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        decoder = self.decoder
        layers, norm, rotary = decoder.layers, decoder.norm, getattr(decoder, "rotary_emb", None)
        decoder.layers = torch.nn.ModuleList(_Recorder(i, sink) for i in range(self.num_layers))
        decoder.norm = torch.nn.Identity()
        if rotary is not None:
            decoder.rotary_emb = _fresh(rotary, self.device)
        out = []
        try:
            for batch in batches:
                tensors = {k: v.to(self.device) for k, v in batch.items()}
                hidden = self.embed(tensors.pop("input_ids"))
                sink.clear()
                with torch.no_grad():
                    decoder(inputs_embeds=hidden, **tensors, **kwargs)
                out.append(Batch(hidden, [sink[i] for i in range(self.num_layers)]))
        finally:
            decoder.layers, decoder.norm = layers, norm
            if rotary is not None:
                decoder.rotary_emb = rotary
        return out

    # ------------------------------------------------------------------------------------------ the layers
    def layers(self, *, progress: bool = False, desc: str = "Layers",
               release: bool = True) -> Iterator[tuple[int, torch.nn.Module]]:
        """``(i, layer)``, each layer filled from the store on entry and emptied (back on ``meta``) after;
        ``release``: the freed memory goes back to the system after each layer (else the caller releases it once,
        and the next layer reuses the same pages)."""
        from tqdm.auto import tqdm

        for i in tqdm(range(self.num_layers), desc=desc, unit="layer", disable=not progress):
            layer = self.decoder.layers[i]
            self._fill(layer, f"{self.prefix}layers.{i}.")
            try:
                yield i, layer
            finally:
                layer.to("meta")
                if release:
                    release_memory(collect=False)  # else the freed layers' pages stay in the heap, layer after layer

    def forward(self, i: int, layer: torch.nn.Module, batch: Batch) -> None:
        """Run ``layer`` (number ``i``) on ``batch``: its hidden state becomes the layer's output. A hook that
        raises :meth:`stop` ends the layer there (the hidden state is then left as it was)."""
        args, kwargs = batch.calls[i]
        try:
            with torch.no_grad():
                output = layer(batch.hidden, *args, **kwargs)
        except _Stop:
            return
        batch.hidden = output[0] if isinstance(output, tuple) else output

    @staticmethod
    def stop() -> None:
        """Called from a forward hook: nothing after it in this layer is needed."""
        raise _Stop

    def _fill(self, layer: torch.nn.Module, prefix: str) -> None:
        """Read the layer's tensors into the arena (the previous layer's buffers where the shapes repeat, as they
        do in a decoder: no fresh pages per layer) and hand them to the layer."""
        state = {}
        for name, target in layer.state_dict(keep_vars=True).items():
            buffer = self._arena.get(name)
            if buffer is None or buffer.shape != target.shape or buffer.dtype != target.dtype:
                buffer = self._arena[name] = torch.empty(target.shape, dtype=target.dtype, device=self.device)
            state[name] = self.store.read_into(prefix + name, buffer)
        layer.load_state_dict(state, strict=True, assign=True)
        empty = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
        if empty:
            raise RuntimeError(f"decoder layer {prefix!r} keeps tensors that are not saved ({empty[:3]}): hf_mloss "
                               "cannot run it layer by layer.")


def _prefix(root: torch.nn.Module, module: torch.nn.Module) -> str:
    """The name under which ``root`` holds ``module``, with a trailing dot (empty for ``root`` itself)."""
    for name, candidate in root.named_modules():
        if candidate is module:
            return f"{name}." if name else ""
    raise ValueError(f"{type(module).__name__} is not a submodule of {type(root).__name__}")


def _fresh(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A rotary embedding rebuilt from its config (its buffers are not saved, so the skeleton holds them on
    ``meta``): computed as ``from_pretrained`` computes them (the class's own rope function, on the CPU)."""
    return type(module)(config=module.config).to(device)


