"""``method="auto"`` on a model too large to hold: the candidates compared block by block.

The in-memory search (:mod:`.auto`) holds a scratch copy of the model beside the base's values. Here the container
is the output model with its blocks on ``meta`` (:mod:`.streamed`), and every forward is walked block by block by
the scoring walk (:func:`hf_mloss.engine.walk.shared_walk`):

* the experts' outputs on the compared samples (and the base's, where samples are routed): each model's block l
  read from its checkpoint, every compared batch advanced through it, the block released;
* each candidate setting: the method's whole-model ``prepare`` (global thresholds), then the tensors outside the
  blocks and, block by block, the block's tensors merged at λ = 1, each λ of its grid advanced in the same visit
  through θ₀ + λ·τ (τ = merged − θ₀); the outputs are read from each λ's last states by the model's own final norm
  and head (:meth:`~hf_mloss.adapters.base.ModelAdapter.outputs_from_states`).

It runs where the in-memory search's model and two scratch copies would not fit the device
(:func:`~hf_mloss.merging.streamed.plan_streamed_output`). The chosen merge is merged once more into the streamed
output, block by block, and written as θ₀ + λ·τ by the same arithmetic as the in-memory search: given the same
choice, the written tensors are the same bits. The criteria are the output ones (``output``, ``disagreement``,
``entropy``), equal to the in-memory search's to float32 round-off (the blocks run through the walk, not the model's
own loop), so a near-tie may go the other way. Candidates fitted on the data (RegMean's Grams, RegMean++'s and
M-TIES's merged prefix) need forwards this search does not make: they leave the default candidates with a warning
and are refused when named. The chosen merge's M-Loss is not measured here (``hf_mloss.score`` measures it).

Memory: the tensors outside the blocks (the base's and one setting's τ of them), one block with its base values and
its τ, the q sources' copies of one tensor (a TIES trim of the embeddings holds them whole), and the hidden states of
every λ on the compared batches; not the depth.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .selection import CandidateEvaluator, batch_bounds
from .streamed import fitted_candidates

if TYPE_CHECKING:
    from ..loading.inputs import RunInputs
    from ..spec.config import MergeConfig
    from .merger import TensorMerger

NOT_MEASURED = ("The candidates were compared block by block (the model does not fit with the search's scratch "
                "copies), so the chosen merge's M-Loss was not measured; hf_mloss.score measures it.")
"""Said on the card of a streamed search."""


def streamed_candidates(grids: Mapping[str, Mapping[str, list[Any]]]) -> dict[str, Any]:
    """The candidates a block-by-block search merges: the data-free ones (the default candidates fitted on the
    data are left out, with a warning; named ones were refused by
    :func:`~.streamed.refuse_fitted_candidates`)."""
    import warnings

    fitted = fitted_candidates(grids)
    if fitted:
        warnings.warn(f"auto: {', '.join(fitted)} left out of the default candidates: the model is compared block "
                      "by block (it does not fit this device with the search's scratch copies), and they fit on the "
                      "data through forwards that search does not make.", UserWarning, stacklevel=4)
    return {name: grid for name, grid in grids.items() if name not in fitted}


def candidate_context(config: MergeConfig, name: str, fixed: Mapping[str, Any], device: Any) -> tuple[Any, Any]:
    """Candidate ``name`` at setting ``fixed`` as the in-memory search merges it
    (:meth:`~hf_mloss.merging.selection.CandidateBuilder.task_vector`): at λ = 1 where λ rescales its merge, with
    its own default weighting."""
    from ..loading.inputs import resolve_weights
    from ..methods import MergeContext, get_method

    method = get_method(name)
    chosen = config.replace(method=method.name, parameters=dict(fixed), select=None)
    if method.scales_with_lam(chosen.method_params().to_dict()):
        chosen = chosen.replace(parameters={**fixed, "lam": 1.0})
    weights = resolve_weights(chosen, method.default_weight)
    return method, MergeContext(params=chosen.method_params(), weights=weights.to(device, torch.float32),
                                seed=config.seed)


class StreamedForward:
    """Forwards of the compared batches through a model whose blocks are on ``meta``, block by block, for one or
    several weight sets at once (the walk setup of :func:`~hf_mloss.engine.walk.shared_walk`)."""

    def __init__(self, inputs: RunInputs, model: Any, names: Sequence[str]) -> None:
        adapter = self.adapter = inputs.adapter
        self.inputs, self.device, self.model = inputs, inputs.device, model
        self.tower = adapter.tower(model)
        self.blocks = adapter.layers(self.tower)
        self.sources, self.base_store, self.batches = inputs.sources, inputs.base, []
        self.state = {adapter.canonical_key(k): v for k, v in model.state_dict().items()}
        self.outside = [n for n in inputs.names if n in self.state and not self.is_block(adapter.stage_of(n))]
        self.base = {n: self.state[n].detach().clone() for n in self.outside}
        self.names = list(names)

    def autocast(self) -> Any:
        return contextlib.nullcontext()

    def is_block(self, stage: int) -> bool:
        return 0 <= stage < len(self.blocks)

    def restore(self) -> None:
        """The base's tensors outside the blocks back in the container."""
        with torch.no_grad():
            for name in self.outside:
                self.state[name].copy_(self.base[name])

    @torch.inference_mode()
    def walk(self, weights: Any, batches: Sequence[Any]) -> list[list[Any]]:
        """Each of ``weights``' sets' last block states on ``batches`` (the blocks left on ``meta``)."""
        from ..engine.walk import embed_batches, release_block, release_memory, shared_walk

        states = []
        for v in range(weights.count):
            weights.outside(v)
            states.append(embed_batches(self, self.tower, batches=batches))
        for layer, block in enumerate(self.blocks):
            weights.open(layer, block)
            for v in range(weights.count):
                weights.fill(layer, v)
                states[v] = shared_walk(self, states[v], [layer], model=self.tower, last=layer + 1)
            release_block(block)
            weights.close(layer)
            release_memory(collect=False)
        return states

    def outputs(self, rule: Any, weights: Any, v: int, batches: Sequence[Any], states: Sequence[Any]
                ) -> Iterator[Any]:
        """Set ``v``'s outputs, batch by batch (its tensors outside the blocks written first)."""
        weights.outside(v)
        for batch, state in zip(batches, states, strict=True):
            yield self.adapter.outputs_from_states(self.model, rule, batch, state.hidden)


class StoreWeights:
    """One checkpoint's model as a weight set: its tensors outside the blocks written into the container, its blocks
    read one at a time."""

    count = 1

    def __init__(self, forward: StreamedForward, store: Any) -> None:
        self.forward, self.store = forward, store

    def outside(self, v: int) -> None:
        with torch.no_grad():
            for name in self.forward.outside:
                self.store.read_into(name, self.forward.state[name])

    def open(self, layer: int, block: Any) -> None:
        from ..engine.walk import load_block

        load_block(block, self.store, self.forward.adapter.layer_prefix(layer), self.forward.device,
                   materialise=True)

    def fill(self, layer: int, v: int) -> None:
        pass

    def close(self, layer: int) -> None:
        pass


class CandidateWeights:
    """One candidate setting as weight sets: merged block by block at λ = 1, one set per λ, θ₀ + λ·τ (``None``:
    the merge as it is)."""

    def __init__(self, forward: StreamedForward, config: MergeConfig, name: str, fixed: Mapping[str, Any],
                 lams: Sequence[float | None], workers: Any = None) -> None:
        from ..loading.inputs import resolve_weights
        from ..methods import MergeContext, get_method
        from .merger import TensorMerger

        self.forward, self.lams, self.count = forward, list(lams), len(lams)
        method, ctx = candidate_context(config, name, fixed, forward.device)
        self.merger = merger = TensorMerger(forward.inputs, method, ctx, forward.model, workers)
        merger.names = list(forward.names)
        method.prepare(ctx, merger.visit)
        self.outside_names = [n for n in merger.names if not forward.is_block(forward.adapter.stage_of(n))]
        merger.merge_now(self.outside_names)
        self.tau = self._directions(self.outside_names, forward.base)
        forward.restore()
        self.names = set(merger.names)
        self.block_names: list[str] = []
        self.block_base: dict[str, torch.Tensor] = {}

    def _directions(self, names: Sequence[str], base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """τ = merged − θ₀ of ``names`` (the merged tensors themselves where no λ rescales them)."""
        targets = self.merger.targets
        if self.lams == [None]:
            return {n: targets[n].detach().clone() for n in names}
        return {n: targets[n] - base[n] for n in names}

    def _write(self, names: Sequence[str], base: Mapping[str, torch.Tensor], v: int,
               into: Mapping[str, torch.Tensor]) -> None:
        lam = self.lams[v]
        with torch.no_grad():
            for name in names:
                if lam is None:
                    into[name].copy_(self.tau[name])
                else:  # as the in-memory search writes it (CandidateBuilder.write)
                    torch.add(base[name], self.tau[name], alpha=lam, out=into[name])

    def outside(self, v: int) -> None:
        self._write(self.outside_names, self.forward.base, v, self.forward.state)

    def open(self, layer: int, block: Any) -> None:
        from ..engine.walk import load_block

        forward, merger = self.forward, self.merger
        prefix = forward.adapter.layer_prefix(layer)
        load_block(block, forward.inputs.base, prefix, forward.device, materialise=True)
        names = []
        for key, tensor in block.state_dict().items():
            if prefix + key in self.names:
                merger.targets[prefix + key] = tensor
                names.append(prefix + key)
        self.block_names = names
        self.block_base = {n: merger.targets[n].detach().clone() for n in names}
        merger.merge_now(names)
        self.tau.update(self._directions(names, self.block_base))

    def fill(self, layer: int, v: int) -> None:
        if self.lams != [None]:  # else the block holds the merge as it is since open()
            self._write(self.block_names, self.block_base, v, self.merger.targets)

    def close(self, layer: int) -> None:
        for name in self.block_names:
            self.tau.pop(name, None)
            self.merger.targets.pop(name, None)
        self.block_base = {}


class StreamedEvaluator(CandidateEvaluator):
    """:class:`~hf_mloss.merging.selection.CandidateEvaluator` whose models are walked block by block: the experts'
    (and the base's) outputs from their checkpoints, a candidate's from :class:`CandidateWeights`."""

    def __init__(self, config: MergeConfig, inputs: RunInputs, options: Any, forward: StreamedForward, **kwargs: Any
                 ) -> None:
        self.forward = forward
        super().__init__(config, inputs, options, forward.tower, **kwargs)

    def store_outputs(self, tower: Any, store: Any, batches: Sequence[Any], rows: Any = None) -> Iterator[Any]:
        """The outputs of ``store``'s model on the batches holding one of ``rows`` (all of them computed before
        returning, the container's tensors outside the blocks restored), ``None`` for the others."""
        walked = [i for i, (lo, hi) in enumerate(batch_bounds(batches)) if rows is None or bool(rows[lo:hi].any())]
        outputs: list[Any] = [None] * len(batches)
        if walked:
            weights = StoreWeights(self.forward, store)
            chosen = [batches[i] for i in walked]
            states = self.forward.walk(weights, chosen)[0]
            try:
                for i, out in zip(walked, self.forward.outputs(self.rule, weights, 0, chosen, states)):
                    outputs[i] = out
            finally:
                self.forward.restore()
        return iter(outputs)

    def candidate(self, weights: CandidateWeights) -> Iterator[tuple[float | None, dict[str, float]]]:
        """``(λ, criteria)`` of every λ of one candidate setting, from one block-by-block merge of it."""
        batches = self.compared
        states = self.forward.walk(weights, batches)
        try:
            for v, lam in enumerate(weights.lams):
                outputs = self.forward.outputs(self.rule, weights, v, batches, states[v])
                values = self.output_criteria(outputs)
                yield lam, {k: values[k] for k in self.options.criteria}
        finally:
            self.forward.restore()


def write_streamed(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, name: str,
                   fixed: Mapping[str, Any], lam: float | None) -> None:
    """The chosen candidate merged into ``merger``'s streamed output, block by block: θ₀ + λ·τ as the search
    formed it (``lam=None``: the merge as it is)."""
    from .merger import TensorMerger

    method, ctx = candidate_context(config, name, fixed, inputs.device)
    output = merger.output
    inner = TensorMerger(inputs, method, ctx, output.model, merger.workers, output=output)
    inner.names = list(merger.names)
    method.prepare(ctx, inner.visit)
    for stage, group in output.stages(inner.names):
        output.open_stage(stage, inner)
        base = {n: inner.targets[n].detach().clone() for n in group} if lam is not None else {}
        inner.merge_now(group)
        with torch.no_grad():
            for n in base:
                torch.add(base[n], inner.targets[n] - base[n], alpha=lam, out=inner.targets[n])
        inner.checked.difference_update(base)  # found finite at λ = 1: θ₀ + λ·τ is checked when it is written
    merger.done.update(inner.done)
    merger.checked.update(inner.checked)
