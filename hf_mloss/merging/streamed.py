"""A large merge written block by block: the merged model is never whole in memory.

The merge container of a large base (:data:`STREAMED_MIN_BYTES` or more in its working dtype) is the output model with
its blocks on ``meta`` (:meth:`hf_mloss.loading.inputs.RunInputs.output_skeleton`); embeddings, final norm and head
are held as usual. The merger (:class:`~hf_mloss.merging.merger.TensorMerger`) merges stage by stage: before a
block's tensors are merged the block is filled from the base (:meth:`StreamedOutput.open_stage`), and when the next
block opens, the previous one, by then merged and walked, is checked, cast to the output dtype, written into its
place in the output's safetensors shards (:class:`~hf_mloss.output.spill.SpilledWeights`) and emptied. Every walk of
the data-guided methods that write into the merge container reaches block l + 1 only after it is done with block l
(the merged-prefix walk of M-TIES, RegMean++'s), so they run on it unchanged. ``method="auto"`` with data, an
output criterion and no heads on a LLaMA-family decoder compares its candidates block by block on this container
where the model and the search's two scratch copies would not fit (:mod:`.streamed_search`); label-free selection
and learned merges, whose walks need the whole merged model, keep the in-memory container.

Memory: the tensors outside the blocks, one block in the working dtype, and what the method holds for one tensor
(the q sources' copies) or one block (the walk), whatever the depth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..adapters import EMBEDDING_STAGE

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..loading.inputs import RunInputs
    from ..methods import MergeMethod
    from ..spec.config import MergeConfig
    from .merger import TensorMerger

STREAMED_MIN_BYTES = 1 << 31
"""A merge whose output model takes at least this many bytes in its working dtype is written block by block."""


def plan_streamed_output(config: MergeConfig, inputs: RunInputs, method: MergeMethod, params: Any, *,
                         dtype: torch.dtype, out_dtype: torch.dtype, output: str) -> StreamedOutput | None:
    """The block-by-block output of this merge, or ``None`` where the model is small or the merge needs the
    whole merged model in memory (see the module docstring)."""
    import math

    if not _streams(config, inputs, method, params):
        return None
    size = sum(math.prod(shape) for shape in inputs.base.shapes.values()) * torch.finfo(dtype).bits // 8
    if size < STREAMED_MIN_BYTES:
        return None
    searches = getattr(method, "chooses_method", False) and params.chooses and inputs.model_inputs is not None
    if searches:  # auto's search holds the model and two copies where they fit; block by block where they do not
        from .memory import held_copies, held_model_fits

        if held_model_fits(inputs, dtype, held_copies(config, method)[0]):
            return None
    model = inputs.output_skeleton(output, dtype)
    if model is None:
        return None
    streamed = StreamedOutput(inputs, model, out_dtype)
    if not streamed.plan_matches_base():
        return None
    if searches:
        refuse_fitted_candidates(params)
    return streamed


def _streams(config: MergeConfig, inputs: RunInputs, method: MergeMethod, params: Any) -> bool:
    """Whether the merge's stages reach each block once, in order (data-free merges, M-TIES / M-DARE on the merged
    prefix, RegMean and RegMean++), on a plain model of the generic adapter (no towers, slices or merged vocabulary)."""
    adapter = inputs.adapter
    if getattr(method, "chooses_method", False) and not (config.select is not None or config.slices is not None):
        return _auto_streams(config, inputs, params)
    if (config.select is not None or config.slices is not None or getattr(method, "learned", False)
            or getattr(method, "chooses_method", False) or inputs.towers or inputs.vocabulary is not None
            or getattr(adapter, "whole_model", False) or not getattr(adapter, "saves_with_transformers", False)
            or config.output == "adapter"):
        return False
    if getattr(method, "gram_prefix", None) or not method.needs_data:
        return True
    return method.scoring_options(params).prefix in ("merged", "own", "base")


def _auto_streams(config: MergeConfig, inputs: RunInputs, params: Any) -> bool:
    """``method="auto"``: a recorded data-free choice, and the fallback without data, stream as that merge does (a
    recorded choice fitted on the data is re-fitted as the in-memory search fitted it, so it does not); a search
    where it can compare the candidates block by block (:mod:`.streamed_search`)."""
    from ..methods import get_method
    from ..methods.auto import FALLBACK

    if inputs.model_inputs is None or not params.chooses:
        name, parameters = (FALLBACK if inputs.model_inputs is None and params.chooses else
                            (params.chosen["method"], params.chosen.get("parameters") or {}))
        chosen = config.replace(method=name, parameters=dict(parameters), select=None)
        method = chosen.merge_method()
        return not method.needs_data and _streams(chosen, inputs, method, chosen.method_params())
    return searches_streamed(inputs, params) and _streams(config.replace(method=FALLBACK[0], parameters={}),
                                                          inputs, get_method(FALLBACK[0]), None)


def searches_streamed(inputs: RunInputs, params: Any) -> bool:
    """Whether ``auto`` with ``params`` can compare its candidates block by block (:mod:`.streamed_search`): with
    data, an output criterion, no heads, on a family whose outputs are read from its last block's states."""
    from ..spec.selection import OUTPUT_CRITERIA

    return (params.criterion in OUTPUT_CRITERIA and inputs.model_inputs is not None
            and not params.heads and getattr(inputs.adapter, "reads_outputs_from_states", False))


def fitted_candidates(grids: Any) -> list[str]:
    """The candidates fitted on the data (through forwards a block-by-block search does not make)."""
    from ..methods import get_method

    return [name for name in grids if get_method(name).needs_data]


def refuse_fitted_candidates(params: Any) -> None:
    """Refuse named candidates a block-by-block search cannot merge, once the search is known to stream."""
    from ..errors import InvalidParameterError
    from ..methods.auto import candidate_grids

    if params.candidates is None:
        return
    fitted = fitted_candidates(candidate_grids(params.candidates, params.budget))
    if fitted:
        raise InvalidParameterError(
            f"candidates: {', '.join(fitted)} fit on the data, through forwards a search compared block by block "
            "does not make (the model and the search's scratch copies do not fit this device). Remove them from the "
            "candidates, or run them as a merge of their own (they stream).")


class StreamedOutput:
    """The merge container of a merge written block by block (see the module docstring).

    Args:
        inputs: the run's inputs (the base's store fills each block).
        model: the output model, its blocks on ``meta`` (:meth:`~hf_mloss.loading.inputs.RunInputs.output_skeleton`).
        out_dtype: the dtype the merged tensors are written in.
    """

    def __init__(self, inputs: RunInputs, model: PreTrainedModel, out_dtype: torch.dtype) -> None:
        from ..output.spill import SpilledWeights

        self.inputs, self.model, self.out_dtype = inputs, model, out_dtype
        adapter = self.adapter = inputs.adapter
        self.blocks = adapter.layers(adapter.tower(model))
        paths = {id(module): path for path, module in model.named_modules()}
        self.block_paths = [paths[id(block)] for block in self.blocks]
        tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        state = model.state_dict(keep_vars=True)
        by_block: list[list[tuple[str, str]]] = [[] for _ in self.blocks]
        rest: list[tuple[str, str]] = []
        seen: set[int] = set()
        for key, tensor in state.items():
            if key in tied or (not tensor.is_meta and tensor.data_ptr() in seen):
                continue  # a tied copy (lm_head of tied embeddings): saved once, tied again on load
            if not tensor.is_meta:
                seen.add(tensor.data_ptr())
            layer = self._layer_of(key)
            (by_block[layer] if layer is not None else rest).append((key, adapter.canonical_key(key)))
        self.by_block, self.rest = by_block, rest
        self.entries = [(key, tuple(state[key].shape), self._dtype_of(state[key]))
                        for key, _ in [*(e for block in by_block for e in block), *rest]]
        self.spill = SpilledWeights(model, self.entries)
        self.opened: set[int] = set()
        self.written = 0
        """Blocks ``0 .. written - 1`` are in the files."""

    def _layer_of(self, key: str) -> int | None:
        for layer, path in enumerate(self.block_paths):
            if key.startswith(path + "."):
                return layer
        return None

    def _dtype_of(self, tensor: torch.Tensor) -> torch.dtype:
        return self.out_dtype if tensor.is_floating_point() else tensor.dtype

    def plan_matches_base(self) -> bool:
        """Whether the planned keys are the base checkpoint's, in its own layout (else ``save_pretrained`` would
        convert them, and the in-memory container is kept)."""
        keys = getattr(self.inputs.base, "checkpoint_keys", None)
        layout = getattr(self.adapter, "layout", None)
        if not keys or (layout is not None and layout.used(keys)):
            return False
        return {key for key, _, _ in self.entries} == set(keys)

    def stage_of(self, name: str) -> int:
        return self.adapter.stage_of(name)

    def is_block(self, stage: int) -> bool:
        return 0 <= stage < len(self.blocks)

    def open_stage(self, stage: int, merger: TensorMerger) -> None:
        """Make block ``stage`` hold the base's weights (in the working dtype) in the model, as the merge's
        targets, after writing every earlier block (filled and written as they are where no merge reached them)."""
        if not self.is_block(stage) or stage in self.opened:
            return
        if stage < self.written:
            raise RuntimeError(f"block {stage} was already written; a streamed merge visits each block once")
        for layer in sorted(self.opened):
            if layer < stage:
                self.close(layer, merger)
        for layer in range(self.written, stage):
            self._open(layer, merger)
            self.close(layer, merger)
        self._open(stage, merger)

    def _open(self, layer: int, merger: TensorMerger) -> None:
        from ..engine.walk import is_streamed, load_block

        block = self.blocks[layer]
        prefix = self.adapter.layer_prefix(layer)
        if is_streamed(block):
            load_block(block, self.inputs.base, prefix, self.inputs.device, materialise=True)
        for key, tensor in block.state_dict().items():
            if prefix + key in merger.targets:
                merger.targets[prefix + key] = tensor
        self.opened.add(layer)

    def close(self, layer: int, merger: TensorMerger) -> None:
        """Block ``layer``: its tensors no stage merged are merged now (the method's data-free rule), then each is
        checked, cast and written; the block returns to ``meta``."""
        from ..engine.walk import release_block, release_memory

        block, prefix = self.blocks[layer], self.adapter.layer_prefix(layer)
        if layer != self.written:
            raise RuntimeError(f"block {layer} closes before block {self.written}")
        pending = [n for n in merger.names if n not in merger.done and self.stage_of(n) == layer]
        if pending:
            merger.merge_now(pending)
        state = block.state_dict()
        skip = len(self.block_paths[layer]) + 1
        for key, name in self.by_block[layer]:
            self._write(key, name, state[key[skip:]], merger)
        release_block(block)
        for key in state:
            if prefix + key in merger.targets:
                merger.targets.pop(prefix + key)
        self.opened.discard(layer)
        self.written += 1
        release_memory(collect=False)  # the block's freed pages, and its merge's, go back before the next block

    def _write(self, key: str, name: str | None, tensor: torch.Tensor, merger: TensorMerger) -> None:
        merger.check_written(name, tensor, self.out_dtype)
        self.spill.add(key, tensor.to(self._dtype_of(tensor)) if tensor.is_floating_point() else tensor)

    def finish(self, merger: TensorMerger) -> None:
        """Every block not yet written, then the tensors outside the blocks; the files closed."""
        for layer in range(self.written, len(self.blocks)):
            if layer not in self.opened:
                self._open(layer, merger)
            self.close(layer, merger)
        pending = [n for n in merger.names if n not in merger.done]
        if pending:
            merger.merge_now(pending)
        state = self.model.state_dict()
        for key, name in self.rest:
            self._write(key, name, state[key], merger)
        merger.targets.clear()
        self.spill.finish(self.out_dtype)

    def stages(self, names: Sequence[str]) -> list[tuple[int, list[str]]]:
        """``names`` grouped by stage, the embeddings first, then the blocks in order, then the tail."""
        groups: dict[int, list[str]] = {}
        for name in names:
            groups.setdefault(self.stage_of(name), []).append(name)
        order = sorted(groups, key=lambda s: (s != EMBEDDING_STAGE, s))
        return [(stage, groups[stage]) for stage in order]


class StreamedHooks:
    """A method's :class:`~hf_mloss.methods.LayerHooks` over a streamed output: each block is opened before its
    stage's hook runs, so a walk over the merge container finds it filled (and leaves it for the writer)."""

    def __init__(self, hooks: Any, output: StreamedOutput, merger: TensorMerger) -> None:
        self.hooks, self.output, self.merger = hooks, output, merger

    def before_stage(self, stage: int) -> None:
        self.output.open_stage(stage, self.merger)
        self.hooks.before_stage(stage)

    def after_scores(self, layer: int, scores: Any) -> None:
        self.output.open_stage(layer, self.merger)
        self.hooks.after_scores(layer, scores)

    def after_all(self) -> None:
        self.hooks.after_all()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hooks, name)

