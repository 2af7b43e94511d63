"""Learned merges: train a method's values on unlabeled batches, then merge tensor by tensor from them.

The loop serves every :class:`~hf_mloss.methods.adamerging.LearnedMethod`: AdaMerging's coefficients λ, AdaRank's
component masks (:mod:`hf_mloss.methods.adarank`). The merge is formed functionally: what each changed tensor's merge
needs is computed once (AdaMerging: the q task vectors stacked ``[q, ...]``; AdaRank: the SVD factors the data-free
merge keeps), and each step calls the model through :func:`torch.func.functional_call` with the merged tensors as a
function of the trained values (θ₀ + Σ_p λ_{p,g} τ_p, :func:`hf_mloss.methods.adamerging.combine`), so no copy of the
model is made per step and the gradient reaches the trained values. The objective (:mod:`hf_mloss.engine.objectives`)
reads the merge's outputs through the family's output rule; the experts' outputs it compares with (and the routing of
samples to experts) are computed once, before training, batch by batch.

Data: at most ``max_samples`` of the run's samples (a seeded spread, :func:`~hf_mloss.loading.model_inputs.
spread_sample`), shuffled once with the run's seed and cut into batches of the run's ``batch_size``; each epoch visits the
batches in a new seeded order (:func:`batch_schedule`). With each model's own data, as AdaMerging trains on each task's
own unlabeled data, every data set is a plan of its own (at most ``max_samples`` of each model's data, and of the
shared pool its models read): each step takes one batch of every set, and the objective is the sum of one term per
set, each on its own batch, each sample compared with its own model (entropy through that model's head; output_gap,
disagreement against that model's outputs), as the papers sum one loss per task. Adam (β = 0.9, 0.999, ε = 1e-8) on the trained values,
starting where the method says. Peak memory (RSS; CUDA when on a GPU) and seconds per step are measured and go to
the card.

Processes (``torchrun``, ``accelerate launch``): every process holds the same values and visits the same batches;
each step, process r takes rows r, r + W, … of the step's batch, and the gradients, each weighted by its process's
share of the rows, are summed across the processes (one all-reduce, :func:`hf_mloss.engine.kernel.reduce_sums`), so
every process takes the same Adam step. For an objective that is a mean over samples (``entropy`` / ``output_gap`` /
``disagreement`` with heads and ``share="all"``, ``mloss`` on equally long inputs) this is the single process's
gradient up to float rounding; for the others (ratios of sums, routed shares, means over padded positions) it is the
rows-weighted mean of the shares' gradients, as data-parallel training computes it. The routing normalises each
expert's moves by its mean over every process's samples. The main process writes the result.
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
from ..loading.heads import as_head, check_heads

if TYPE_CHECKING:
    from ..loading.inputs import RunInputs
    from ..methods.adamerging import LearnedMethod
    from ..spec.config import MergeConfig
    from .merger import TensorMerger


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
    title: str = "Coefficients"
    what: str = "coefficient groups"
    processes: int = 1
    fixed: list[str] = field(default_factory=list)
    """Tensors whose learned values were kept at their start: no output depends on them (:func:`fixed_slots`)."""

    def describe(self) -> str:
        cuda = f", peak CUDA memory {self.peak_cuda_mb:.0f} MB" if self.peak_cuda_mb is not None else ""
        split = f", each step's batch split over {self.processes} processes" if self.processes > 1 else ""
        fixed = (f" The values of {len(self.fixed)} tensor(s) were not trained and keep their initial value: "
                 f"{', '.join(self.fixed[:4])}{', ...' if len(self.fixed) > 4 else ''} (attention key biases: a "
                 "shift every score of a query shares, which the softmax ignores, so their gradient is exactly "
                 "zero)." if self.fixed else "")
        return (f"{self.title} learned on unlabeled data: {self.steps} Adam steps, {self.groups} {self.what}, "
                f"{self.objective} {self.first:.4g} -> {self.last:.4g}{split}; {self.seconds_per_step:.3g} s per "
                f"step, peak RSS {self.peak_rss_mb:.0f} MB{cuda}.{fixed}")


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
    """The tower's forward with merged weights as a function of the trained values: θ₀ and each changed tensor's
    :meth:`~hf_mloss.methods.adamerging.LearnedMethod.functional_part` (stacked task vectors, SVD factors) kept
    once, the merged tensors formed by the method's :meth:`~hf_mloss.methods.adamerging.LearnedMethod.
    functional_tensor` at every step."""

    def __init__(self, merger: TensorMerger, method: LearnedMethod, tower: nn.Module, names: Sequence[str]) -> None:
        ctx = merger.ctx
        self.method, self.params, self.names = method, ctx.params, list(names)
        self.bases: dict[str, torch.Tensor] = {}
        self.parts: dict[str, Any] = {}
        for name in self.names:
            base, sources = merger.read(name)
            self.bases[name] = base.detach().clone()
            self.parts[name] = method.functional_part(name, base, sources, ctx)
        pointer = {t.data_ptr(): name for name, t in merger.targets.items()}
        self.keys: dict[str, list[str]] = {}
        for key, tensor in [*tower.named_parameters(remove_duplicate=False),
                            *tower.named_buffers(remove_duplicate=False)]:
            name = pointer.get(tensor.data_ptr())
            if name in self.parts:
                self.keys.setdefault(name, []).append(f"tower.{key}")
        missing = [n for n in self.names if n not in self.keys]
        if missing:
            raise InvalidParameterError(f"Cannot find {missing[:3]} among the scored tower's parameters; a learned "
                                        "merge trains the tower the data reaches (pass output='tower').")

    def parameters(self, trained: torch.Tensor, slots: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The merged tensors for the ``trained`` values, by the wrapper's parameter names."""
        out = {}
        for name in self.names:
            slot = slots.get(name)
            merged = self.method.functional_tensor(self.bases[name], self.parts[name],
                                                   None if slot is None else trained[slot], self.params)
            for key in self.keys[name]:
                out[key] = merged
        return out

    def expert_parameters(self, merger: TensorMerger, index: int) -> dict[str, torch.Tensor]:
        """Expert ``index``'s own tensors (not its processed task vector), by the wrapper's parameter names."""
        store = merger.inputs.sources[index]
        return {key: store.get_float(name, merger.device) for name in self.names for key in self.keys[name]}


def learn_and_merge(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, tower: nn.Module,
                    method: LearnedMethod, *, changed: Sequence[str], progress: bool
                    ) -> tuple[MergeConfig, LearnRecord | None]:
    """Learn the method's values (or read the recorded ones), merge every tensor from them into ``merger``'s model,
    and return the config as it ran (the learned values recorded) with what training measured (``None`` when the
    recorded values were used)."""
    ctx = merger.ctx
    params = ctx.params
    record = None
    if params.learns:
        recorded, record = _learn(config, inputs, merger, tower, method, changed, progress=progress)
    else:
        method.use_recorded(ctx, changed, inputs.adapter, len(inputs.sources))
        method.prepare(ctx, merger.visit)
        recorded = {}
    merger.merge(merger.names, progress=progress, desc=f"Merging ({config.method})")
    parameters = {k: v for k, v in config.parameters.items() if k != "relearn"}
    parameters.update(recorded)
    if params.heads:
        parameters["heads"] = [os.fspath(h) if isinstance(h, (str, os.PathLike)) else h if isinstance(h, dict)
                               else {"in_memory": type(h).__name__} for h in params.heads]
    recorded_config = config.replace(parameters=parameters)
    ctx.params = recorded_config.method_params()
    return recorded_config, record


def _learn(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, tower: nn.Module, method: LearnedMethod,
           changed: Sequence[str], *, progress: bool) -> tuple[dict[str, Any], LearnRecord]:
    """Train the method's values (see the module docstring); returns the recipe parameters that record them."""
    from ..engine.kernel import reduce_sums
    from ..engine.objectives import ObjectiveInputs, differentiable_outputs, get_objective
    from ..loading.model_inputs import owner_groups

    params, device = merger.ctx.params, merger.device
    q, adapter = len(inputs.sources), inputs.adapter
    objective = get_objective(params.objective)
    if objective.name == "mloss":
        from .regmean import refuse_experts

        refuse_experts(adapter, "The learned objective 'mloss' differentiates the M-Loss of one dense unit per block")
    rule = adapter.output_rule(tower)
    family = getattr(adapter.full_config, "model_type", adapter.name)
    if params.heads is not None and len(params.heads) != q:
        raise InvalidParameterError(f"heads: got {len(params.heads)} for {q} models; give one per model, in the "
                                    "order of `models`.")
    heads = [as_head(h, i, "heads") for i, h in enumerate(params.heads)] if params.heads else None
    objective.check(rule, heads, family)
    if not changed:
        raise InvalidParameterError("No model differs from the base: there is nothing to learn.")
    if inputs.model_inputs is None:
        raise InvalidParameterError("A learned merge needs unlabeled data (data=...).")
    rank, world = _process()
    plans = [_Plan(inputs.model_inputs if index is None else _select(inputs.model_inputs, index), models,
                   params.max_samples, config, rank, world, device)
             for models, index in owner_groups(inputs.sample_owner, q)]
    alpha = (inputs.alpha / inputs.alpha.sum()).float().to(device)
    setup = ObjectiveInputs(rule=rule, heads=heads, alpha=alpha, eps=config.scoring_options().eps)
    held = next((batch for plan in plans for batch in plan.batches if batch is not None), None)
    if heads is not None and held is not None:  # each head reads the tower's pooled features, before any training
        with torch.no_grad():
            check_heads(heads, params.heads, differentiable_outputs(rule, tower, held), "heads")

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    method.prepare(merger.ctx, merger.visit)
    functional = FunctionalMerge(merger, method, tower, changed)
    layout = method.layout(functional.parts, adapter, merger.ctx)
    if not any(slot is not None for slot in layout.slots.values()):
        raise InvalidParameterError(f"{method.pretty_name} has nothing to learn in these models: none of the "
                                    "tensors they change has a learned value (e.g. no matrix).")
    forward = _Forward(tower, lambda model, batch: differentiable_outputs(rule, model, batch))
    routed = params.share == "auto" and (heads is not None or objective.name == "disagreement")
    for plan in plans:  # the experts' outputs and each sample's expert, once, before training
        owned = inputs.sample_owner is not None and len(plan.models) == 1
        plan.experts, plan.owners = _references(merger, functional, forward, plan.batches, rule,
                                                keep=objective.needs_experts, route=routed and not owned,
                                                models=plan.models)
        if owned:  # a model's own data: every sample is compared with that model
            plan.owners = [None if b is None else torch.full((len(next(iter(b.values()))),), plan.models[0])
                           for b in plan.batches]
        plan.schedule = batch_schedule(len(plan.batches), params.steps, config.seed)
    handles = []
    if objective.name == "mloss":
        setup.units, handles = _unit_stacks(config, inputs, tower, device)
    fixed = fixed_slots(layout.slots, adapter)  # values no output depends on: kept where they start
    trained = nn.Parameter(layout.initial.to(device, torch.float32))
    optimizer = torch.optim.Adam([trained], lr=params.lr)
    trace: list[float] = []
    tower.eval()
    bar = tqdm(range(params.steps), desc=f"Learning ({params.objective})", unit="step", disable=not progress)
    train_start = time.perf_counter()
    try:
        for step in bar:
            optimizer.zero_grad(set_to_none=True)
            grad, loss = torch.zeros_like(trained), torch.zeros((), device=device)
            for plan in plans:  # one batch of each data set (one set: the pool), one objective term each
                b = plan.schedule[step]
                if plan.batches[b] is None:  # a batch smaller than the job: this process holds none of its rows
                    continue
                merged = torch.func.functional_call(forward, functional.parameters(trained, layout.slots),
                                                    (plan.batches[b],))
                value = objective.value(setup, merged, plan.batches[b], None if plan.experts is None
                                        else plan.experts[b], None if plan.owners is None else plan.owners[b])
                (part,) = torch.autograd.grad(value, trained, allow_unused=True)
                share = plan.weights[b]  # this process's rows of the batch: the processes' gradients, weighted
                if part is not None:  # (None: the objective does not reach the trained values on this batch)
                    grad += part if world == 1 else part * share
                loss = loss + (value.detach() if world == 1 else value.detach() * share)
            trained.grad = grad
            for slot in fixed:  # exactly 0, not float noise that Adam would turn into steps of ±lr
                trained.grad[slot] = 0
            if world > 1:  # the step's gradient: the processes' shares, weighted by their rows, summed
                reduced, value = reduce_sums(trained.grad, loss.reshape(1))
                trained.grad.copy_(reduced)
                loss = value[0]
            if not torch.isfinite(loss):  # after the reduction: every process stops together
                raise InvalidParameterError(f"The {params.objective} objective became {float(loss)} at "
                                            f"step {len(trace) + 1}; lower lr (now {params.lr}).")
            optimizer.step()
            trace.append(float(loss))
            bar.set_postfix({params.objective: f"{trace[-1]:.4g}"})
    finally:
        bar.close()
        for handle in handles:
            handle.remove()
    seconds = (time.perf_counter() - train_start) / max(1, len(trace))
    record = LearnRecord(objective=params.objective, steps=len(trace), groups=layout.count, first=trace[0],
                         last=trace[-1], seconds_per_step=seconds, peak_rss_mb=peak_rss_mb(),
                         peak_cuda_mb=torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
                         else None, trace=trace, title=layout.title, what=layout.what, processes=world,
                         fixed=sorted(name for name, slot in layout.slots.items()
                                      if slot is not None and any(slot == f for f in fixed)))
    return method.use_trained(merger.ctx, layout, trained.detach()), record


def fixed_slots(slots: dict[str, Any], adapter: Any) -> list[Any]:
    """The slots of the trained values that only tensors no output depends on read (a block's attention key bias,
    :meth:`~hf_mloss.adapters.ModelAdapter.gradient_free`): their gradient is exactly zero, and float rounding
    turns it into noise that Adam normalises into steps of ±lr, a value that depends on the CPU's kernels. They are
    not trained."""
    readers: dict[Any, list[str]] = {}
    for name, slot in slots.items():
        if slot is not None:
            readers.setdefault(_slot_key(slot), []).append(name)
    out = []
    for names in readers.values():
        if all(adapter.gradient_free(name) for name in names):
            out.append(slots[names[0]])
    return out


def _slot_key(slot: Any) -> Any:
    return (slot.start, slot.stop, slot.step) if isinstance(slot, slice) else slot


def _process() -> tuple[int, int]:
    """``(rank, number of processes)`` of this job (``(0, 1)`` in a single process)."""
    from ..distributed import distributed_state

    state = distributed_state()
    return (0, 1) if state is None else (state.process_index, state.num_processes)


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
                rule: Any, *, keep: bool, route: bool, models: Sequence[int] | None = None
                ) -> tuple[list[list[torch.Tensor | None]] | None, list[torch.Tensor] | None]:
    """Per batch, the experts' outputs (``keep``; ``models``: those experts only, ``None`` for the others) and the
    expert each sample is routed to (``route``: among ``models``, the expert whose output it moves most from the
    base's, relative to that expert's mean move, as selection)."""
    if not keep and not route:
        return None, None
    q = len(merger.inputs.sources)
    models = list(range(q)) if models is None else list(models)
    held = [b for b, batch in enumerate(batches) if batch is not None]  # this process's rows of each batch
    outputs = {p: {b: torch.func.functional_call(forward, functional.expert_parameters(merger, p), (batches[b],))
                   for b in held} for p in models}
    owners = None
    if route:
        from ..engine.kernel import reduce_sums

        base = {key: functional.bases[name] for name in functional.names for key in functional.keys[name]}
        base_out = {b: torch.func.functional_call(forward, base, (batches[b],)) for b in held}
        moves = [torch.cat([rule.move(base_out[b], outputs[p][b], batches[b]) for b in held]) if held
                 else torch.zeros(0, device=merger.device) for p in models]
        move = torch.stack(moves)
        mean = move.mean(1, keepdim=True)  # each expert's mean move over every sample of the job
        if _process()[1] > 1:  # the processes' sums reduced
            total, count = reduce_sums(move.sum(1), torch.tensor([move.shape[1]], dtype=move.dtype,
                                                                 device=move.device))
            mean = (total / count.clamp_min(1)).unsqueeze(1)
        owner = torch.tensor(models)[(move / mean.clamp_min(1e-12)).argmax(0).cpu()]
        sizes = [len(next(iter(batches[b].values()))) for b in held]
        owners = [None] * len(batches)
        for b, rows in zip(held, owner.split(sizes)):
            owners[b] = rows
    kept = set(held)
    experts = [[outputs[p][b] if p in outputs else None for p in range(q)] if b in kept else None
               for b in range(len(batches))] if keep else None
    return experts, owners


class _Plan:
    """One data set of a learned merge (the pool every model reads, or one model's own data): at most
    ``max_samples`` of its samples (a seeded spread), shuffled once and cut into batches of the run's
    ``batch_size``, this process's rows of each; the models it is compared with; the batch each step takes."""

    def __init__(self, samples: Any, models: Sequence[int], max_samples: int, config: MergeConfig, rank: int,
                 world: int, device: Any) -> None:
        from ..loading.model_inputs import spread_sample

        self.models = list(models)
        pool = spread_sample(samples, max_samples, config.seed)
        index_batches = sample_batches(len(pool), config.batch_size, config.seed)
        shares = [index[rank::world] for index in index_batches]  # this process's rows of every batch
        self.weights = [len(share) / len(index) for share, index in zip(shares, index_batches)]
        self.batches = [_batch(pool, share, device) if len(share) else None for share in shares]
        self.experts: list[Any] | None = None
        self.owners: list[Any] | None = None
        self.schedule: list[int] = []


def _select(samples: Any, index: torch.Tensor) -> Any:
    """The samples at ``index`` (pixels, or :class:`~hf_mloss.loading.model_inputs.ModelInputs`)."""
    from ..loading.model_inputs import ModelInputs

    return samples.select(index) if isinstance(samples, ModelInputs) else samples[index]


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

        def stacked(module: str, suffix: str, prefix: str = prefix) -> list[torch.Tensor | None]:
            """The sources' rows of a unit linear, stacked ``[q, ...]`` (a fused one: its gate and up halves)."""
            key = f"{prefix}{module}.{suffix}"
            if key not in inputs.base:
                return unit.rows(None)
            return [torch.stack(parts) for parts in zip(*[unit.rows(s.get_float(key, device)) for s in sources])]

        gate_w, up_w = (stacked(unit.gate, "weight") + [None])[:2]
        gate_b, up_b = (stacked(unit.gate, "bias") + [None])[:2]
        if unit.up:
            up_w, up_b = stacked(unit.up, "weight")[0], stacked(unit.up, "bias")[0]
        stack = ScoredUnitStack(weight=gate_w, bias=gate_b, up_weight=up_w, up_bias=up_b, activation=activation,
                                fused=unit.fused)
        block = blocks[layer]
        handles += stack.hooks(block.get_submodule(unit.gate), block.get_submodule(unit.up) if unit.up else None)
        stacks.append(stack)
    return stacks, handles


__all__ = ["FunctionalMerge", "LearnRecord", "batch_schedule", "learn_and_merge",
           "sample_batches"]
