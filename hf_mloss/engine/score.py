"""The M-Loss scorer: node and layer M-Loss of q models over a small unlabeled set, layer by layer.

For each scored linear (CLIP: ``mlp.fc1``) the pre-activations h_p = W_p u + b_p of the q sources give the gap
g = σ(Σ_p α_p h_p) − Σ_p α_p σ(h_p) at every position (sample × token). Where the input u comes from is the *prefix*:

* ``"base"`` / ``"merged"``: u is computed once per block by one shared model (the base, or the merged-so-far model
  that M-TIES builds), and the q pre-activations come from ONE stacked GEMM with the q sources' weights of that linear.
* ``"own"``: every source runs its own forward; only one block per source is in memory at a time.

Sums (not means) are accumulated per process and reduced with accelerate, so a data-parallel run is exact. The
weights α are normalised (α/Σα) before scoring: M-Loss compares the ensemble with a convex combination, so scaling
all weights together must not change it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..adapters import EMBEDDING_STAGE, ModelAdapter
from ..spec.config import MergeConfig
from .experts import ExpertSums, ExpertTarget, own_expert_walk
from .kernel import GapSums, StackedTarget, inplace_activation, node_gap  # noqa: F401  (kept importable from here)
from ..methods.base import LayerHooks
from ..spec.options import PREFIXES, REDUCTIONS, ScoringOptions
from ..parallel import Workers, cpu_workers
from ..parallel import active as active_workers
from ..output.report import MLossReport
from ..loading.store import TensorStore
from .walk import UnitInputs, embed_batches, own_walk, shared_walk

if TYPE_CHECKING:
    from ..loading.data import DataInfo
    from ..loading.model_inputs import ModelInputs
    from ..loading.inputs import RunInputs, ScoredTower

__all__ = ["PREFIXES", "REDUCTIONS", "LayerScores", "MLossAccumulator", "score_config"]


@dataclass
class LayerScores:
    """M-Loss of one scored linear: per node (row) and for the whole layer, plain and normalised."""

    node: torch.Tensor
    """Mean over positions of |g_i| (``reduction="abs"``) or g_i² (``"sq"``), one value per row."""
    node_normalized: torch.Tensor
    """Mean over positions of |g_i| / (|σ(Σα h_i)| + ε) (heavy-tailed where σ(Σα h_i) ≈ 0)."""
    node_ratio: torch.Tensor
    """Σ_positions |g_i| / Σ_positions |σ(Σα h_i)|: the stable normalised summary."""
    layer: float
    """Mean over positions of ‖g‖₂."""
    layer_normalized: float
    """Mean over positions of ‖g‖₂ / (‖σ(Σα h)‖₂ + ε)."""
    layer_ratio: float
    """Σ_positions ‖g‖₂ / Σ_positions ‖σ(Σα h)‖₂."""
    parts: list[dict[str, Any]] | None = None
    """An MoE block (:mod:`hf_mloss.engine.experts`): per part (each routed expert, the shared expert) its node
    span, routed tokens, weight and own M-Loss; its nodes' values are NaN where no token was routed to it."""



class MLossAccumulator(GapSums):
    """Running sums of node / layer M-Loss for one scored unit (the :class:`~hf_mloss.engine.kernel.GapSums` of one merge:
    ``node`` is ``[4, 1, nodes]``, ``layer`` ``[4, 1]``)."""

    def __init__(self, num_nodes: int, *, reduction: str = "abs", eps: float = 1e-4, device: Any = "cpu") -> None:
        super().__init__(1, num_nodes, reduction=reduction, eps=eps, device=device)

    def add(self, h: torch.Tensor, alpha: torch.Tensor, activation: Callable) -> None:
        """Add the pre-activations ``h`` (``[positions, q, nodes]``) of some positions with the plain definition
        (:func:`~hf_mloss.engine.kernel.node_gap`; the scorers use the fused kernel, tested against it)."""
        g, merged = node_gap(h.float(), alpha, activation)
        self.add_positions(*self.add_block(g[:, None], merged[:, None], slice(None), self.eps), eps=self.eps)

    def add_sums(self, sums: GapSums) -> None:
        """Add running sums computed elsewhere (one batch's kernel pass)."""
        self.merge(sums)

    def scores(self) -> LayerScores:
        """The means (and ratios of sums) accumulated so far."""
        node, layer = self.node[:, 0], self.layer[:, 0]
        count = layer[3].clamp_min(1)
        gap_sum = node[0] if self.reduction == "abs" else node[3]
        tiny = torch.finfo(torch.float64).tiny
        return LayerScores(
            node=(node[0] / count).float().cpu(), node_normalized=(node[1] / count).float().cpu(),
            node_ratio=(gap_sum / node[2].clamp_min(tiny)).float().cpu(), layer=float(layer[0] / count),
            layer_normalized=float(layer[1] / count), layer_ratio=float(layer[0] / layer[2].clamp_min(tiny)),
        )


class ExpertAccumulator(ExpertSums):
    """The running sums of an MoE block's unit for one merge (:class:`~hf_mloss.engine.experts.ExpertSums`, one
    row), read as :class:`LayerScores`: the parts' node vectors concatenated, the block's weighted layer values."""

    @classmethod
    def like(cls, sums: ExpertSums) -> ExpertAccumulator:
        first = sums.parts[0]
        return cls(sums.labels, sums.nodes, 1, reduction=first.reduction, eps=first.eps, device=sums.tokens.device)

    def scores(self) -> LayerScores:
        node, layer = self.node_means(), self.layer_means()
        return LayerScores(node=node["node"], node_normalized=node["node_normalized"], node_ratio=node["node_ratio"],
                           layer=float(layer["mloss"][0]), layer_normalized=float(layer["mloss_normalized"][0]),
                           layer_ratio=float(layer["mloss_ratio"][0]), parts=self.part_rows())


@dataclass
class ScoringSetup:
    """Everything a layer-wise scoring pass needs."""

    adapter: ModelAdapter
    model: PreTrainedModel
    """The model that runs the shared prefix (base or merged-so-far); for ``prefix="own"`` a worker whose blocks are
    copied and refilled with each source's weights."""
    sources: Sequence[TensorStore]
    alpha: torch.Tensor
    batches: Sequence[torch.Tensor]
    activation: Callable
    activation_name: str
    reduction: str = "abs"
    eps: float = 1e-4
    layers: Sequence[int] | None = None
    device: torch.device | str = "cpu"
    compute_dtype: torch.dtype = torch.float32
    progress: bool = True
    prefix: str = "own"
    num_samples: int = 0
    workers: Workers | None = None
    """Where the batches of a shared-prefix pass run (default: the run's pool, see :mod:`hf_mloss.parallel`)."""
    base_store: TensorStore | None = None
    """The base's lazy store: where the blocks of a streamed scoring model are filled from."""

    @property
    def pool(self) -> Workers:
        return self.workers or active_workers()

    def autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=self.compute_dtype)

    def scored_layers(self) -> list[int]:
        return sorted(set(range(self.adapter.num_layers) if self.layers is None else self.layers))



def stacked_target(setup: ScoringSetup, layer: int) -> StackedTarget:
    """The fused kernel of block ``layer``'s unit over ``setup``'s sources (one GEMM per block of nodes)."""
    adapter = setup.adapter
    prefix, unit = adapter.layer_prefix(layer), adapter.unit
    return StackedTarget(setup.sources, adapter.target_name(layer), up=f"{prefix}{unit.up}" if unit.up else None,
                         fused=unit.fused, transposed=unit.transposed,
                         mix=setup.alpha[None], activation=setup.activation, reduction=setup.reduction, eps=setup.eps,
                         device=setup.device, compute_dtype=setup.compute_dtype)


def expert_target(setup: ScoringSetup, layer: int) -> ExpertTarget:
    """The weighted kernel of MoE block ``layer``'s parts over ``setup``'s sources, routed by the router of
    ``setup.model``'s block (the shared prefix model's)."""
    adapter = setup.adapter
    return ExpertTarget(adapter, layer, adapter.layers(setup.model)[layer], setup.sources, mix=setup.alpha[None],
                        activation=setup.activation, reduction=setup.reduction, eps=setup.eps, device=setup.device,
                        compute_dtype=setup.compute_dtype)


@torch.inference_mode()
def score_shared_prefix(setup: ScoringSetup, hooks: LayerHooks | None = None) -> dict[str, MLossAccumulator]:
    """Score with u from ``setup.model`` (base or merged-so-far). The forward advances one block at a time.

    The batches of a block run on the run's workers; each returns its sums, which are added in batch order.
    """
    hooks = hooks or LayerHooks()
    adapter, pool = setup.adapter, setup.pool
    scored = setup.scored_layers()
    results: dict[str, MLossAccumulator] = {}

    experts = getattr(adapter, "experts", False)

    def measure(layer: int) -> Callable | None:
        if layer not in scored:
            return None
        target = expert_target(setup, layer) if experts else stacked_target(setup, layer)
        return lambda u, context: target.sums(u, mask=context.mask)

    def collect(layer: int, sums: list[GapSums]) -> None:
        acc = ExpertAccumulator.like(sums[0]) if experts else MLossAccumulator(
            sums[0].node.shape[-1], reduction=setup.reduction, eps=setup.eps, device=setup.device)
        for part in sums:
            acc.add_sums(part)
        acc.reduce_across_processes()
        results[adapter.target_name(layer)] = acc
        hooks.after_scores(layer, acc.scores())

    hooks.before_stage(EMBEDDING_STAGE)
    states = embed_batches(setup, setup.model, pool)
    bar = tqdm(range(adapter.num_layers), desc="M-Loss (shared prefix)", unit="layer", disable=not setup.progress)
    shared_walk(setup, states, list(range(adapter.num_layers)), measure=measure, collect=collect, pool=pool,
                before_stage=hooks.before_stage, last=max(scored) if scored else -1, progress=bar)
    bar.close()
    hooks.before_stage(adapter.num_layers)  # the tail (final norm)
    hooks.after_all()
    return results


@torch.inference_mode()
def score_own_prefix(setup: ScoringSetup) -> dict[str, MLossAccumulator]:
    """Score with every source running its own forward (the paper's definition; q forwards).

    Memory: the worker model, q copies of ONE block, and q sets of hidden states.
    """
    scored = setup.scored_layers()
    results: dict[str, MLossAccumulator] = {}
    current: dict[int, MLossAccumulator] = {}
    mix = setup.alpha[None]

    def visit(layer: int, inputs: UnitInputs) -> None:
        if layer not in current:
            current[layer] = MLossAccumulator(inputs.num_nodes, reduction=setup.reduction, eps=setup.eps,
                                              device=setup.device)
        acc = current[layer]
        sums = acc.empty()
        gate, up = inputs.stacked(sources_first=True)
        sums.add_preactivations(gate, mix, setup.activation, up=up, mask=inputs.mask, sources_first=True)
        acc.add_sums(sums)

    def done(layer: int) -> None:
        acc = current.pop(layer)
        acc.reduce_across_processes()
        results[setup.adapter.target_name(layer)] = acc

    bar = tqdm(total=max(scored) + 1 if scored else 0, desc="M-Loss (own prefix)", unit="layer",
               disable=not setup.progress)
    if getattr(setup.adapter, "experts", False):
        def block_done(layer: int, sums: ExpertSums) -> None:
            acc = ExpertAccumulator.like(sums)
            acc.merge(sums)
            current[layer] = acc
            done(layer)

        own_expert_walk(setup, scored, mix, block_done, progress=bar)
        bar.close()
        return results
    own_walk(setup, scored, visit, done, progress=bar)
    bar.close()
    return results


def build_report(setup: ScoringSetup, results: dict[str, MLossAccumulator], *, models: list[str],
                 data_info: DataInfo | None = None, records: dict[str, dict[str, torch.Tensor]] | None = None,
                 key_prefix: str = "") -> MLossReport:
    """The :class:`MLossReport` of a scoring pass (``records``: per-row values a merge kept, e.g. keep ratios;
    ``key_prefix``: put before every layer name, the tower's attribute in a whole model)."""
    from ..distributed import describe_device

    scores = {f"{key_prefix}{name}": acc.scores() for name, acc in results.items()}
    keep = {f"{key_prefix}{name}": v for name, v in (records or {}).get("keep_ratios", {}).items()}
    positions = int(next(iter(results.values())).count) if results else 0
    return MLossReport(
        node={k: v.node for k, v in scores.items()}, node_normalized={k: v.node_normalized for k, v in scores.items()},
        layer={k: v.layer for k, v in scores.items()},
        layer_normalized={k: v.layer_normalized for k, v in scores.items()},
        layer_ratio={k: v.layer_ratio for k, v in scores.items()},
        node_ratio={k: v.node_ratio for k, v in scores.items()}, prefix=setup.prefix, reduction=setup.reduction,
        activation=setup.activation_name, eps=setup.eps, num_samples=setup.num_samples, num_positions=positions,
        models=models, weights=setup.alpha.tolist(), keep_ratios=keep,
        parts={k: v.parts for k, v in scores.items() if v.parts is not None},
        compute_dtype=str(setup.compute_dtype).replace("torch.", ""),
        data={**data_info.to_dict(), **data_info.sample_stats()} if data_info is not None else {},
        device=describe_device(setup.device),
    )


def make_setup(inputs: RunInputs, model: PreTrainedModel, options: ScoringOptions, config: MergeConfig, *,
               progress: bool = True, tower: ScoredTower | None = None) -> ScoringSetup:
    """A scoring pass over ``inputs``' samples with ``model`` as the shared-prefix (or scratch) model (``tower``:
    one tower of a whole model, walked by its adapter over its own samples)."""
    from ..loading.inputs import as_dtype

    adapter = tower.adapter if tower is not None else inputs.adapter
    samples = tower.samples if tower is not None else inputs.model_inputs
    activation, activation_name = resolve_activation(adapter, options.activation)
    alpha = inputs.alpha / inputs.alpha.sum()  # M-Loss compares with a convex combination (SPEC §1)
    return ScoringSetup(
        adapter=adapter, model=model, sources=inputs.sources, alpha=alpha.float().to(inputs.device),
        batches=shard_batches(samples, config.batch_size), activation=activation,
        activation_name=activation_name, reduction=options.reduction, eps=options.eps, layers=options.layers,
        device=inputs.device, compute_dtype=resolve_compute_dtype(as_dtype(config.compute_dtype), inputs.device),
        progress=progress, prefix=options.prefix, num_samples=len(samples), base_store=inputs.base,
    )


def resolve_compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The scoring dtype: bfloat16 on a CPU only where it has bf16 instructions (AVX512-BF16 or AMX), float32 else.

    Without them every bf16 GEMM converts to float32 inside the kernel and is slower than float32 itself; with them
    (measured on a Xeon with AMX, ViT-B/32 × 8, 32 images) bf16 scoring took 5.3-6.0 s against 13.2-18.5 s.
    """
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or native_cpu_bf16():
        return dtype
    warnings.warn("compute_dtype='bfloat16' asked for, but this CPU has no bf16 instructions (avx512_bf16 / amx_bf16), "
                  "where bf16 is slower than float32: scoring in float32 (the report records it).", stacklevel=3)
    return torch.float32


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bf16 dot products natively (AVX512-BF16 or AMX-BF16)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private helpers of torch.cpu; read the CPU flags instead
        try:
            flags = open("/proc/cpuinfo").read()
        except OSError:
            return False
        return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_activation(adapter: ModelAdapter, activation: str | None) -> tuple[Callable, str]:
    """The activation the M-Loss uses: the model's own, or a named override from transformers' ``ACT2FN``."""
    from transformers.activations import ACT2FN

    if activation is None:
        return adapter.activation(), adapter.activation_name()
    return ACT2FN[activation], activation


def shard_batches(samples: ModelInputs | torch.Tensor, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """This process's share of the samples (every ``world``-th one), in batches of ``batch_size`` (dicts of model
    inputs; a tensor is pixel values)."""
    from accelerate import PartialState

    from ..loading.model_inputs import ModelInputs

    state = PartialState()
    samples = samples if isinstance(samples, ModelInputs) else ModelInputs({"pixel_values": samples})
    return samples.shard(state.process_index, state.num_processes).split(batch_size)


def group_batches(samples: ModelInputs | torch.Tensor, owner: torch.Tensor | None, num_models: int,
                  batch_size: int) -> list[tuple[list[int], list[dict[str, torch.Tensor]]]] | None:
    """With models' own data (``owner``, :attr:`~hf_mloss.loading.inputs.RunInputs.sample_owner`): the models that
    read the same samples, each group with this process's batches of them
    (:func:`~hf_mloss.loading.model_inputs.owner_groups`); ``None`` when every model reads every sample."""
    from ..loading.model_inputs import ModelInputs, owner_groups

    if owner is None:
        return None
    samples = samples if isinstance(samples, ModelInputs) else ModelInputs({"pixel_values": samples})
    return [(models, shard_batches(samples.select(index), batch_size))
            for models, index in owner_groups(owner, num_models)]


def score_config(config: MergeConfig, *, device: Any = None, token: str | bool | None = None,
                 progress: bool = True) -> MLossReport:
    """Score a validated config whose prefix is ``own`` or ``base`` (see :func:`hf_mloss.run_score`)."""
    from ..loading.inputs import open_inputs

    options = config.scoring_options()
    with open_inputs(config, device=device, token=token, needs_data=True, progress=progress,
                     scoring=True) as inputs, \
            cpu_workers(inputs.device):
        if not inputs.towers and not getattr(inputs.adapter, "whole_model", False):
            model = inputs.load_scoring_model(progress=progress, streamed=True)  # one block of the base at a time
            setup = make_setup(inputs, model, options, config, progress=progress)
            results = score_shared_prefix(setup) if options.prefix == "base" else score_own_prefix(setup)
            return build_report(setup, results, models=[r.name for r in inputs.refs], data_info=inputs.data_info)
        model = inputs.load_output_model("auto", progress=progress)  # the whole model: every tower is scored
        reports = []
        for tower in inputs.scored_towers(model):
            setup = make_setup(inputs, tower.module, options, config, progress=progress, tower=tower)
            results = score_shared_prefix(setup) if options.prefix == "base" else score_own_prefix(setup)
            reports.append((tower, build_report(setup, results, models=[r.name for r in inputs.refs],
                                                data_info=tower.data_info, key_prefix=tower.key_prefix)))
        return combine_tower_reports(reports, unscored=unscored_towers(inputs, "not scored (no {kind} data)"))


def unscored_towers(inputs: RunInputs, template: str) -> dict[str, str]:
    """The towers of a whole two-tower run that no data reaches, each with ``template`` (``{kind}``: image or
    text) filled in: ``{"vision_model": "not scored (no image data)"}``."""
    scored = inputs.scored_attributes()
    return {attribute: template.format(kind=modality) for attribute, modality in inputs.tower_modalities().items()
            if attribute not in scored}


def combine_tower_reports(reports: list[tuple[ScoredTower, MLossReport]], *,
                          unscored: dict[str, str] | None = None) -> MLossReport:
    """One report of a whole model's towers: every tower's layers (named as in the whole model), ``towers``
    saying how each tower was treated, the first scored tower's data and the sample and position totals."""
    import dataclasses

    first = reports[0][1]
    combined = dataclasses.replace(first, node={}, node_normalized={}, layer={}, layer_normalized={}, layer_ratio={},
                                   node_ratio={}, keep_ratios={}, parts={}, num_samples=0, num_positions=0, towers={})
    for tower, report in reports:
        for key in ("node", "node_normalized", "layer", "layer_normalized", "layer_ratio", "node_ratio",
                    "keep_ratios", "parts"):
            getattr(combined, key).update(getattr(report, key))
        combined.num_samples += report.num_samples
        combined.num_positions += report.num_positions
        kind = "texts" if "num_tokens" in report.data else "images"
        combined.towers[tower.attribute] = {
            "status": f"scored on {report.num_samples} {kind} ({report.num_positions} positions)",
            "data": report.data, "num_samples": report.num_samples, "num_positions": report.num_positions}
    for attribute, status in (unscored or {}).items():
        combined.towers[attribute] = {"status": status}
    return combined
