"""Learned merges: train a method's coefficients on unlabeled batches, then merge tensor by tensor from them.

The merge is formed functionally: the q task vectors of every changed tensor are stacked once (``[q, ...]``), and
each step calls the model through :func:`torch.func.functional_call` with θ₀ + Σ_p λ_{p,g} τ_p
(:func:`hf_mloss.methods.adamerging.combine`), so no copy of the model is made per step and the gradient reaches
the coefficients λ. The objective (:mod:`hf_mloss.engine.objectives`) reads the merge's outputs through the family's
output rule; the experts' outputs it compares with (and the routing of samples to experts) are computed once, before
training, batch by batch.

Data: at most ``max_samples`` of the run's samples (a seeded spread, :func:`~hf_mloss.merging.selection.
spread_sample`), shuffled once with the run's seed and cut into batches of the run's ``batch_size``; each epoch visits the
batches in a new seeded order (:func:`batch_schedule`). Adam (β = 0.9, 0.999, ε = 1e-8) on the coefficients,
initialised at ``init``. Peak memory (RSS; CUDA when on a GPU) and seconds per step are measured and go to the card.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import InvalidParameterError
from ..loading.heads import as_head

if TYPE_CHECKING:
    from ..loading.inputs import RunInputs
    from ..methods import MergeMethod
    from ..spec.config import MergeConfig
    from .driver import TensorMerger


@dataclass
class LearnRecord:
    """What a training run measured (for the card and the result)."""

    objective: str
    steps: int
    groups: int
    first: float
    last: float
    seconds_per_step: float
    peak_rss_mb: float
    peak_cuda_mb: float | None = None
    trace: list[float] = field(default_factory=list)

    def describe(self) -> str:
        cuda = f", peak CUDA memory {self.peak_cuda_mb:.0f} MB" if self.peak_cuda_mb is not None else ""
        return (f"Coefficients learned on unlabeled data: {self.steps} Adam steps, {self.groups} coefficient groups, "
                f"{self.objective} {self.first:.4g} -> {self.last:.4g}; {self.seconds_per_step:.3g} s per step, peak "
                f"RSS {self.peak_rss_mb:.0f} MB{cuda}.")


def batch_schedule(num_batches: int, steps: int, seed: int) -> list[int]:
    """The batch each step trains on: every epoch visits the ``num_batches`` batches in a new seeded order."""
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps:
        order += torch.randperm(num_batches, generator=generator).tolist()
    return order[:steps]


def sample_batches(num_samples: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Sample indices of each training batch: one seeded shuffle, cut into batches of ``batch_size``."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    return list(order.split(batch_size))


class _Forward(nn.Module):
    """``fn(tower, batch)`` as a module, so :func:`torch.func.functional_call` swaps the tower's weights for it."""

    def __init__(self, tower: nn.Module, fn: Any) -> None:
        super().__init__()
        self.tower, self.fn = tower, fn

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fn(self.tower, batch)


class FunctionalMerge:
    """The tower's forward with merged weights θ₀ + Σ_p λ_{p,g} τ_p, the task vectors stacked once."""

    def __init__(self, merger: TensorMerger, method: MergeMethod, tower: nn.Module, names: Sequence[str],
                 groups: dict[str, int]) -> None:
        ctx = merger.ctx
        self.groups, self.names = groups, list(names)
        self.bases: dict[str, torch.Tensor] = {}
        self.taus: dict[str, torch.Tensor] = {}
        for name in self.names:
            base, sources = merger.read(name)
            self.bases[name] = base.detach().clone()
            self.taus[name] = method.task_vectors(name, base, sources, ctx)
        pointer = {t.data_ptr(): name for name, t in merger.targets.items()}
        self.keys: dict[str, list[str]] = {}
        for key, tensor in [*tower.named_parameters(remove_duplicate=False),
                            *tower.named_buffers(remove_duplicate=False)]:
            name = pointer.get(tensor.data_ptr())
            if name in self.taus:
                self.keys.setdefault(name, []).append(f"tower.{key}")
        missing = [n for n in self.names if n not in self.keys]
        if missing:
            raise InvalidParameterError(f"Cannot find {missing[:3]} among the scored tower's parameters; a learned "
                                        "merge trains the tower the data reaches (pass output='tower').")

    def parameters(self, coefficients: torch.Tensor) -> dict[str, torch.Tensor]:
        """The merged tensors for ``coefficients`` ``[G, q]``, by the wrapper's parameter names."""
        from ..methods.adamerging import combine

        out = {}
        for name in self.names:
            merged = combine(self.bases[name], self.taus[name], coefficients[self.groups[name]])
            for key in self.keys[name]:
                out[key] = merged
        return out

    def expert_parameters(self, merger: TensorMerger, index: int) -> dict[str, torch.Tensor]:
        """Expert ``index``'s own tensors (not its processed task vector), by the wrapper's parameter names."""
        store = merger.inputs.sources[index]
        return {key: store.get_float(name, merger.device) for name in self.names for key in self.keys[name]}


def coefficient_groups(names: Sequence[str], adapter: Any, granularity: str) -> tuple[dict[str, int], dict[str, int]]:
    """``(label → index, tensor name → index)`` of the coefficient groups, in the order of ``names``."""
    from ..methods.adamerging import group_of

    labels: dict[str, int] = {}
    of: dict[str, int] = {}
    for name in names:
        label = group_of(name, adapter.stage_of(name), adapter.num_layers, granularity)
        of[name] = labels.setdefault(label, len(labels))
    return labels, of


def learn_and_merge(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, tower: nn.Module,
                    method: MergeMethod, *, changed: Sequence[str], progress: bool
                    ) -> tuple[MergeConfig, LearnRecord | None]:
    """Learn the coefficients (or read the recorded ones), merge every tensor from them into ``merger``'s model,
    and return the config as it ran (the coefficients recorded) with what training measured (``None`` when the
    recorded coefficients were used)."""
    from ..methods.adamerging import COEFFICIENT_STATE, coefficient_rows, parse_coefficients

    ctx = merger.ctx
    params = ctx.params
    q = len(inputs.sources)
    labels, of = coefficient_groups(changed, inputs.adapter, params.granularity)
    record = None
    if params.learns:
        values, record = _learn(config, inputs, merger, tower, method, changed, labels, of, progress=progress)
    else:
        recorded, rows = parse_coefficients(params.coefficients)
        if set(recorded) != set(labels) or len(rows[0]) != q:
            extra = sorted(set(recorded) - set(labels))[:3]
            lacking = sorted(set(labels) - set(recorded))[:3]
            raise InvalidParameterError(
                f"The recorded coefficients do not fit these models ({len(rows[0])} values per group for {q} models; "
                f"groups not merged here: {extra}; groups without a coefficient: {lacking}). Pass relearn=True to "
                "train them again.")
        position = {label: i for i, label in enumerate(recorded)}
        values = torch.tensor([rows[position[label]] for label in sorted(labels, key=labels.get)],
                              dtype=torch.float32)
        method.prepare(ctx, merger.visit)
    ctx.state[COEFFICIENT_STATE] = (of, values.detach().to(merger.device, torch.float32))
    merger.merge(merger.names, progress=progress, desc=f"Merging ({config.method})")
    parameters = {k: v for k, v in config.parameters.items() if k != "relearn"}
    parameters["coefficients"] = coefficient_rows(labels, values)
    if params.heads:
        parameters["heads"] = [os.fspath(h) if isinstance(h, (str, os.PathLike)) else h if isinstance(h, dict)
                               else {"in_memory": type(h).__name__} for h in params.heads]
    recorded_config = config.replace(parameters=parameters)
    ctx.params = recorded_config.method_params()
    return recorded_config, record


def _learn(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, tower: nn.Module, method: MergeMethod,
           changed: Sequence[str], labels: dict[str, int], of: dict[str, int], *, progress: bool
           ) -> tuple[torch.Tensor, LearnRecord]:
    """Train the ``[G, q]`` coefficients (see the module docstring)."""
    from ..engine.objectives import ObjectiveInputs, differentiable_outputs, get_objective
    from ..loading.model_inputs import spread_sample

    params, device = merger.ctx.params, merger.device
    q, adapter = len(inputs.sources), inputs.adapter
    objective = get_objective(params.objective)
    rule = adapter.output_rule(tower)
    family = getattr(adapter.full_config, "model_type", adapter.name)
    if params.heads is not None and len(params.heads) != q:
        raise InvalidParameterError(f"heads: got {len(params.heads)} for {q} models; give one per model, in the "
                                    "order of `models`.")
    heads = [as_head(h, i) for i, h in enumerate(params.heads)] if params.heads else None
    objective.check(rule, heads, family)
    if not changed:
        raise InvalidParameterError("No model differs from the base: there is nothing to learn.")
    if inputs.model_inputs is None:
        raise InvalidParameterError("A learned merge needs unlabeled data (data=...).")
    pool = spread_sample(inputs.model_inputs, params.max_samples, config.seed)
    index_batches = sample_batches(len(pool), config.batch_size, config.seed)
    batches = [_batch(pool, index, device) for index in index_batches]
    alpha = (inputs.alpha / inputs.alpha.sum()).float().to(device)
    setup = ObjectiveInputs(rule=rule, heads=heads, alpha=alpha, eps=config.scoring_options().eps)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    method.prepare(merger.ctx, merger.visit)
    functional = FunctionalMerge(merger, method, tower, changed, of)
    forward = _Forward(tower, lambda model, batch: differentiable_outputs(rule, model, batch))
    routed = params.share == "auto" and (heads is not None or objective.name == "disagreement")
    experts, owners = _references(merger, functional, forward, batches, rule,
                                  keep=objective.needs_experts, route=routed)
    handles = []
    if objective.name == "mloss":
        setup.units, handles = _unit_stacks(config, inputs, tower, device)
    coefficients = nn.Parameter(torch.full((len(labels), q), params.init, dtype=torch.float32, device=device))
    optimizer = torch.optim.Adam([coefficients], lr=params.lr)
    schedule = batch_schedule(len(batches), params.steps, config.seed)
    trace: list[float] = []
    tower.eval()
    bar = tqdm(schedule, desc=f"Learning ({params.objective})", unit="step", disable=not progress)
    train_start = time.perf_counter()
    try:
        for b in bar:
            optimizer.zero_grad(set_to_none=True)
            merged = torch.func.functional_call(forward, functional.parameters(coefficients), (batches[b],))
            loss = objective.value(setup, merged, batches[b], None if experts is None else experts[b],
                                   None if owners is None else owners[b])
            if not torch.isfinite(loss.detach()):
                raise InvalidParameterError(f"The {params.objective} objective became {float(loss.detach())} at step "
                                            f"{len(trace) + 1}; lower lr (now {params.lr}).")
            loss.backward()
            optimizer.step()
            trace.append(float(loss.detach()))
            bar.set_postfix({params.objective: f"{trace[-1]:.4g}"})
    finally:
        bar.close()
        for handle in handles:
            handle.remove()
    seconds = (time.perf_counter() - train_start) / max(1, len(trace))
    record = LearnRecord(objective=params.objective, steps=len(trace), groups=len(labels), first=trace[0],
                         last=trace[-1], seconds_per_step=seconds, peak_rss_mb=peak_rss_mb(),
                         peak_cuda_mb=torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
                         else None, trace=trace)
    return coefficients.detach(), record


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _batch(pool: Any, index: torch.Tensor, device: Any) -> dict[str, torch.Tensor]:
    """Samples ``index`` of ``pool`` (pixels, or token ids cut to the batch's longest sequence) on ``device``."""
    from ..engine.walk import batch_to
    from ..loading.model_inputs import ModelInputs

    if isinstance(pool, ModelInputs):
        return batch_to(pool.select(index).split(len(index))[0], device)
    return batch_to(pool[index], device)


@torch.no_grad()
def _references(merger: TensorMerger, functional: FunctionalMerge, forward: nn.Module, batches: list[Any],
                rule: Any, *, keep: bool, route: bool) -> tuple[list[list[torch.Tensor]] | None,
                                                                 list[torch.Tensor] | None]:
    """Per batch, the q experts' outputs (``keep``) and the expert each sample is routed to (``route``: the
    expert whose output it moves most from the base's, relative to that expert's mean move, as selection)."""
    if not keep and not route:
        return None, None
    q = len(merger.inputs.sources)
    outputs = [[torch.func.functional_call(forward, functional.expert_parameters(merger, p), (batch,))
                for batch in batches] for p in range(q)]
    owners = None
    if route:
        base = {key: functional.bases[name] for name in functional.names for key in functional.keys[name]}
        base_out = [torch.func.functional_call(forward, base, (batch,)) for batch in batches]
        move = torch.stack([torch.cat([rule.move(b, o, batch) for b, o, batch in zip(base_out, outputs[p], batches)])
                            for p in range(q)])
        owner = (move / move.mean(1, keepdim=True).clamp_min(1e-12)).argmax(0).cpu()
        owners = list(owner.split([len(next(iter(batch.values()))) for batch in batches]))
    experts = [[outputs[p][b] for p in range(q)] for b in range(len(batches))] if keep else None
    return experts, owners


def _unit_stacks(config: MergeConfig, inputs: RunInputs, tower: nn.Module, device: Any) -> tuple[list[Any], list[Any]]:
    """``mloss``: the experts' stacked rows of every scored unit, and hooks on the merge's units."""
    from ..engine.objectives import ScoredUnitStack
    from ..engine.score import resolve_activation

    adapter, sources = inputs.adapter, inputs.sources
    options = config.scoring_options()
    activation, _ = resolve_activation(adapter, options.activation)
    layers = sorted(set(range(adapter.num_layers) if options.layers is None else options.layers))
    blocks, unit = adapter.layers(tower), adapter.unit
    stacks, handles = [], []
    for layer in layers:
        prefix = adapter.layer_prefix(layer)

        def stacked(module: str, suffix: str, prefix: str = prefix) -> torch.Tensor | None:
            key = f"{prefix}{module}.{suffix}"
            if key not in inputs.base:
                return None
            return torch.stack([s.get_float(key, device) for s in sources])

        stack = ScoredUnitStack(weight=stacked(unit.gate, "weight"), bias=stacked(unit.gate, "bias"),
                                up_weight=stacked(unit.up, "weight") if unit.up else None,
                                up_bias=stacked(unit.up, "bias") if unit.up else None, activation=activation)
        block = blocks[layer]
        handles += stack.hooks(block.get_submodule(unit.gate), block.get_submodule(unit.up) if unit.up else None)
        stacks.append(stack)
    return stacks, handles


__all__ = ["FunctionalMerge", "LearnRecord", "batch_schedule", "coefficient_groups", "learn_and_merge",
           "sample_batches"]
