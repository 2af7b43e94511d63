"""Label-free hyperparameter selection: choose a merge's λ, k (any grid of its parameters) from unlabeled data.

``merge(..., select="unlabeled", grid={"k": [...], "lam": [...]}, criterion=...)`` merges every setting of the grid
(the cartesian product, in order), scores each candidate on ``num_samples`` unlabeled samples (images for image
families; texts for BERT-family encoders, LLaMA-family decoders and CLIP text towers, read with ``text_column`` and
``max_length`` as for scoring) and keeps the one with the lowest criterion (the first in grid order on ties). The
``num_samples`` samples are a seeded sample spread over the whole data sample (:func:`spread_sample`, seeded by the
merge's ``seed``), not its first ones, so data ordered task by task is represented task by task. Padding never
counts. Criteria, all "lower is better" (default ``"output"``; how much each loses against choosing on val labels,
on the project's image and text suites, is in ``docs/benchmarks.md``, "Choosing λ and k without labels": no
criterion is a promise; the merged-prefix M-Loss grows with λ, so it favours weak merges):

* ``"mloss"``, the merged-prefix M-Loss: at every scored linear (CLIP: ``mlp.fc1``), with u the candidate's own
  input of that linear (its merged prefix), g = σ(W_m u + b_m) − Σ_p α_p σ(W_p u + b_p) (gated units:
  σ(gate)·up), the gap between the candidate's activation and the ensemble of the q experts' activations on the same
  input; the criterion is the mean over scored layers of the mean over real positions of ‖g‖₂. For plain averaging
  it is exactly the layer M-Loss with ``prefix="merged"``. Needs no heads.
* ``"output"``: the discrepancy between the candidate and each expert on that expert's share of the samples, read
  through the family's output rule (:mod:`hf_mloss.adapters.outputs`). Encoders (image towers, CLIP text: the
  pooled output; BERT family: the mean of the last hidden states over real tokens): with heads,
  KL(softmax(head_p(f_p(x))) ‖ softmax(head_p(f_m(x)))); without, the relative squared distance
  ‖f_m(x) − f_p(x)‖² / ‖f_p(x)‖²; averaged over (sample, expert) pairs. Causal LMs (``*ForCausalLM``): at every
  real position t of sample x, KL(P_p(·|x≤t) ‖ P_m(·|x≤t)) of the next-token distributions, averaged over every
  real position of every (sample, expert) pair (with ``share="all"``: exactly the mean over experts of each
  expert's mean over positions).
* ``"disagreement"``: the fraction of compared (sample, expert) pairs (causal LMs: real positions) where the
  candidate's top class (token) differs from the expert's, the experts' own predictions serving as labels; needs
  heads for encoders, as ``entropy``. Unlike a KL or an entropy, it does not grow because a stronger merge is more
  confident, only when its answers change. Ties (it moves in steps of 1 / compared pairs) go to the first candidate
  in grid order.
* ``"entropy"`` (AdaMerging's criterion, the known baseline): encoders: the entropy of softmax(head_p(f_m(x))) on
  expert p's share, averaged; needs heads. Causal LMs: the LM head is the model's own head, so no heads are given:
  the entropy of the candidate's next-token distribution, averaged over real positions. It rewards confident
  merges whether or not they agree with any expert (a merge collapsing onto a few tokens scores well), so it is
  offered as the baseline it is, not recommended: prefer ``"output"``.

Shares (which samples compare the candidate with which expert): ``"given"`` — one unlabeled set per model
(``shares``; ``num_samples`` split evenly); ``"auto"`` (default, label-free) — sample x goes to the expert whose
output it moves most from the base's, relative to that expert's mean move: argmax_p m_p(x) / mean_x' m_p(x'), with
m_p(x) = ‖f_p(x) − f_0(x)‖ for encoders and the mean over real positions of KL(P_p ‖ P_0) for causal LMs; ``"all"`` —
every sample to every expert. Only the compared outputs are kept (with ``"auto"`` the experts run once to route and
once to record them): a causal LM's take samples × tokens × vocabulary floats (× q with ``"all"``). With each model's
own data (``models=[{"model": ..., "data": ...}]``) no routing is needed: ``num_samples`` of each model's data (a
seeded spread) are compared with that model alone, and expert p runs on its own samples only; the samples of a shared
pool, if some models read it, are routed among those models.

Held out. A method fitted on the data (``needs_data``: M-TIES, RegMean) is merged for every setting on the samples
left after ``num_samples`` of each model's data (at most half) are held out for the comparison
(:func:`held_out_inputs`, ``held_out``, default on); the chosen setting is merged again on all of them.

Reuse. A method's ``lam`` means θ = θ₀ + λ·τ_merged (every built-in method): each setting of the other parameters
is merged once at λ = 1 and rescaled for every λ of the grid. A data-guided method (M-TIES) is merged once, with
live M-Loss scoring, at the reference setting (the middle value of every grid axis); every other candidate replays
the reference's recorded node M-Loss through the method's hooks, so it costs a tensor merge and no forward (its row
ranks come from the reference's merged prefix). The experts' outputs are computed once. Blocks where every
expert equals the base (frozen lower blocks) are run once, not per candidate.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import InvalidParameterError
from ..loading.heads import as_head, check_heads
from ..spec.selection import grid_edges
from ..loading.model_inputs import SHARED, spread_owned, spread_sample  # noqa: F401 (spread_sample: read from here)
from ..spec.selection import (  # noqa: F401 (OUTPUT_CRITERIA: read from here too)
    OUTPUT_CRITERIA,
    SelectionOptions,
)
from .stages import unchanged_blocks

if TYPE_CHECKING:

    from ..spec.config import MergeConfig
    from ..loading.inputs import RunInputs
    from .merger import TensorMerger
    from ..output.report import MLossReport



# ----------------------------------------------------------------------------------------------- criteria


def check_output_rule(rule: Any, options: SelectionOptions, adapter: Any) -> None:
    """Refuse, before any candidate is merged, criteria the family's outputs cannot give: ``entropy`` or
    ``disagreement`` of pooled features without heads, heads on a causal LM (its LM head is its own head)."""
    family = getattr(adapter.full_config, "model_type", adapter.name)
    for name in options.criteria:  # the selecting criterion first, so the refusal names what was asked for
        if name in ("entropy", "disagreement") and not options.heads and not rule.has_distribution:
            raise InvalidParameterError(
                f"criterion {name!r} needs one classification head per model (heads=...): the {family!r} model's "
                f"output is the {rule.description}, not a distribution. Pass heads=[...] (one per model), or use "
                "criterion='output' or 'mloss', which need no heads.")
    if options.heads and rule.has_distribution:
        raise InvalidParameterError(
            f"heads=... apply to pooled features; the {family!r} model is a causal LM, whose LM head is its own "
            "head (output: the KL of the experts' next-token distributions, entropy: the candidate's). Remove "
            "heads.")


class CandidateEvaluator:
    """Scores candidate merges on the selection samples (see the module docstring for the criteria)."""

    def __init__(self, config: MergeConfig, inputs: RunInputs, options: SelectionOptions, tower: Any, *,
                 progress: bool = True, token: Any = None, heads_key: str = "select.heads") -> None:
        from ..engine.score import resolve_activation

        self.inputs, self.options, self.adapter, self.config = inputs, options, inputs.adapter, config
        self.device, self.batch_size = inputs.device, config.batch_size
        self.sample, self.sample_owner = spread_owned(inputs.model_inputs, inputs.sample_owner, options.num_samples,
                                                      config.seed, len(inputs.sources))
        self.alpha = (inputs.alpha / inputs.alpha.sum()).float().to(self.device)
        self.activation, _ = resolve_activation(self.adapter, config.scoring_options().activation)
        layers = config.scoring_options().layers
        self.scored = sorted(set(range(self.adapter.num_layers) if layers is None else layers))
        self.changed = [layer for layer in self.scored if self._target_changed(layer)] \
            if "mloss" in options.criteria else []  # only the M-Loss criterion reads it
        self.heads = [as_head(h, i, heads_key) for i, h in enumerate(options.heads)] if options.heads else None
        self.rule = self.adapter.output_rule(tower)
        check_output_rule(self.rule, options, self.adapter)
        self._targets: dict[int, Any] = {}
        self.counts: dict[str, float] = {}  # what the last evaluation's criteria averaged over
        self.start = unchanged_blocks(inputs)
        self.prefix = self._shared_prefix(tower) if "mloss" in options.criteria and self.start >= 0 else None
        if OUTPUT_CRITERIA & set(options.criteria):
            self.compared, self.owner, self.columns = self._shares(config, tower, token)
            if self.heads is not None:  # every head reads an expert's pooled features, before any candidate
                check_heads(self.heads, options.heads, self.columns[0][0], heads_key)

    @property
    def batches(self) -> list[Any]:
        return model_batches(self.sample, self.batch_size, self.device)

    def _target_changed(self, layer: int) -> bool:
        """Whether any source's scored linear differs from the base's (else every candidate's gap there is 0)."""
        import torch

        name = self.adapter.target_name(layer)
        keys = [key for key in (f"{name}.weight", f"{name}.bias") if key in self.inputs.base]
        if getattr(self.adapter, "experts", False):  # an MoE block: its experts' (and shared expert's) tensors
            keys = [key for key, *_ in self.adapter.node_groups(layer)]
        return any(not torch.equal(s.get_float(key), self.inputs.base.get_float(key))
                   for s in self.inputs.sources for key in keys)

    # the block walk reads these (hf_mloss.engine.walk.WalkSetup): the candidate's tower runs every block
    @property
    def sources(self) -> list[Any]:
        return self.inputs.sources

    def autocast(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def _shared_prefix(self, tower: Any) -> list[Any]:
        """Batch states entering block ``start``, from ``tower`` holding the base (every candidate shares them)."""
        import torch

        from ..engine.walk import embed_batches, shared_walk

        with torch.inference_mode():
            states = embed_batches(self, tower)
            return shared_walk(self, states, list(range(self.start)), model=tower, last=self.start)

    def evaluate(self, tower: Any) -> dict[str, float]:
        """Every requested criterion of the candidate held by ``tower``; what each averaged over is left in
        :attr:`counts` (the compared pairs or positions; ``mloss``: the samples), so that evaluations on disjoint
        samples pool exactly (:func:`pooled`)."""
        out = {}
        self.counts = {"mloss": float(len(self.sample))}
        if "mloss" in self.options.criteria:
            out["mloss"] = self.merged_prefix_mloss(tower)
        if OUTPUT_CRITERIA & set(self.options.criteria):
            out.update(self._output_criteria(tower))
        return {k: out[k] for k in self.options.criteria}

    def merged_prefix_mloss(self, tower: Any) -> float:
        """Mean over scored layers of mean_positions ‖σ(W_m u + b_m) − Σ_p α_p σ(W_p u + b_p)‖₂, u the candidate's
        own input of the layer (layers where every expert equals the base contribute exactly 0): the gap kernel with
        the candidate's own unit as the merge (:meth:`hf_mloss.engine.kernel.StackedTarget.sums`)."""
        import torch

        from ..engine.walk import embed_batches, shared_walk

        if not self.changed:
            return 0.0
        blocks = self.adapter.layers(tower)
        total = 0.0

        def measure(layer: int) -> Any:
            if layer not in self.changed:
                return None
            return self._measure(layer, blocks[layer], per_node=False)

        def collect(layer: int, sums: list[Any]) -> None:
            nonlocal total
            acc = sums[0]
            for part in sums[1:]:
                acc.merge(part)
            total += float(acc.layer_means()["mloss"][0]) if getattr(self.adapter, "experts", False) else \
                float(acc.layer[0, 0] / acc.count.clamp_min(1))

        with torch.inference_mode():
            if self.prefix is not None and self._holds_base_prefix(tower):
                states, first = list(self.prefix), self.start
            else:
                states, first = embed_batches(self, tower), 0
            shared_walk(self, states, list(range(first, self.changed[-1] + 1)), measure=measure, collect=collect,
                        model=tower)
        return total / len(self.scored)

    def mloss_report(self, tower: Any, *, models: Sequence[str]) -> MLossReport:
        """The node and layer M-Loss of the merge held by ``tower`` against its experts on its own inputs (prefix
        "merged": at every scored unit, the merge's activation minus the ensemble of the experts' activations on the
        merge's input u), over the selection samples: a diagnostic of how far the merge is from the ensemble."""
        import torch

        from ..engine.score import ExpertAccumulator, MLossAccumulator, build_report, make_setup
        from ..engine.walk import embed_batches, shared_walk

        blocks = self.adapter.layers(tower)
        results: dict[str, Any] = {}

        def measure(layer: int) -> Any:
            return self._measure(layer, blocks[layer], per_node=True)

        def collect(layer: int, sums: list[Any]) -> None:
            acc = ExpertAccumulator.like(sums[0]) if getattr(self.adapter, "experts", False) else \
                MLossAccumulator(sums[0].node.shape[-1], device=self.device)
            for part in sums:
                acc.add_sums(part)
            acc.reduce_across_processes()
            results[self.adapter.target_name(layer)] = acc

        with torch.inference_mode():
            states = embed_batches(self, tower)
            shared_walk(self, states, list(range(self.scored[-1] + 1)) if self.scored else [], measure=measure,
                        collect=collect, model=tower)
        setup = make_setup(self.inputs, tower, self.config.scoring_options(), self.config, progress=False)
        setup.prefix, setup.num_samples = "merged", len(self.sample)
        return build_report(setup, results, models=list(models), data_info=self.inputs.data_info)

    def _measure(self, layer: int, block: Any, *, per_node: bool) -> Any:
        """The gap sums of block ``layer``'s unit with the candidate's own unit (in ``block``) as the merge, on u."""
        if getattr(self.adapter, "experts", False):  # MoE: routed by the candidate's own router
            from ..engine.experts import module_reader

            target = self._target(layer, block)

            def own_parts(part: Any, rows: Any) -> tuple[Any, Any]:
                gate, up = part.rows(module_reader(block, part.path))
                return rows @ gate.T.to(rows.dtype), rows @ up.T.to(rows.dtype)

            return lambda u, context: target.sums(u, mask=context.mask, per_node=per_node, merged=own_parts)
        unit, target = self.adapter.unit, self._target(layer)
        gate = block.get_submodule(unit.gate)
        up = block.get_submodule(unit.up) if unit.up else None
        own = (lambda rows: gate(rows)) if not unit.gated else (
            lambda rows: unit.split(gate(rows), up(rows) if up is not None else None))
        return lambda u, context: target.sums(u, mask=context.mask, per_node=per_node, merged=own)

    def _holds_base_prefix(self, tower: Any) -> bool:
        """Whether the candidate kept the base's embeddings and blocks before ``start`` (every built-in method
        does when all experts equal the base there); otherwise its own prefix is run."""
        import torch

        state = {self.adapter.canonical_key(k): v for k, v in tower.state_dict().items()}
        names = [n for n in self.inputs.names if n in state and self.adapter.stage_of(n) < self.start]
        return all(torch.equal(state[n], self.inputs.base.get_float(n, state[n].device)) for n in names)

    def _target(self, layer: int, block: Any = None) -> Any:
        """The experts' stacked unit of block ``layer`` (built once, shared by every candidate; an MoE block's
        routed by the router of ``block``, the candidate's)."""
        from ..engine.kernel import StackedTarget

        if getattr(self.adapter, "experts", False):
            from ..engine.experts import ExpertTarget

            if layer not in self._targets:
                self._targets[layer] = ExpertTarget(self.adapter, layer, block, self.inputs.sources,
                                                    mix=self.alpha[None], activation=self.activation,
                                                    device=self.device)
            self._targets[layer].block = block
            return self._targets[layer]
        if layer not in self._targets:
            prefix, unit = self.adapter.layer_prefix(layer), self.adapter.unit
            self._targets[layer] = StackedTarget(
                self.inputs.sources, self.adapter.target_name(layer), up=f"{prefix}{unit.up}" if unit.up else None,
                fused=unit.fused, transposed=unit.transposed,
                mix=self.alpha[None], activation=self.activation, device=self.device)
        return self._targets[layer]

    def _shares(self, config: MergeConfig, tower: Any, token: Any) -> tuple[Any, Any, Any]:
        """The batches compared, which expert each sample is compared with (None: every expert), and the compared
        outputs: per batch, one tensor per compared column (every expert with share ``all``; else one tensor whose
        row i is expert owner[i]'s output). Routing runs the experts once more than holding all their outputs would,
        so only the compared outputs are kept (a causal LM's are samples × tokens × vocabulary)."""
        import torch

        sources, rule = self.inputs.sources, self.rule
        samples, owner = self.sample, None
        if self.options.share == "given":  # one set per model, read once by loading/ (select.shares)
            samples, owner = self.inputs.share_inputs, self.inputs.share_owner
        batches = model_batches(samples, self.batch_size, self.device)
        bounds = batch_bounds(batches)

        def run(store: Any, rows: Any = None) -> Iterator[Any]:
            return self.store_outputs(tower, store, batches, rows)

        if self.sample_owner is not None:  # each model's own data: compared with that model; the shared pool routed
            owner = self.sample_owner.clone()  # among the models without data of their own
            shared = owner == SHARED
            if bool(shared.any()):
                group = [p for p in range(len(sources)) if not bool((owner == p).any())]
                base = list(run(self.inputs.base, shared))

                def moves(store: Any) -> Any:  # the shared samples' moves, in sample order
                    return torch.cat([rule.move(b, o, batch)[shared[lo:hi].nonzero().flatten().to(b.device)]
                                      for b, o, batch, (lo, hi) in zip(base, run(store, shared), batches, bounds)
                                      if b is not None])

                move = torch.stack([moves(sources[p]) for p in group])  # [models without own data, shared samples]
                owner[shared] = torch.tensor(group)[(move / move.mean(1, keepdim=True).clamp_min(1e-12)).argmax(0)
                                                    .cpu()]
                del base
        elif self.options.share == "auto":
            base = list(run(self.inputs.base))
            move = torch.stack([torch.cat([rule.move(b, o, batch) for b, o, batch in zip(base, run(s), batches)])
                                for s in sources])  # [q, samples]
            owner = (move / move.mean(1, keepdim=True).clamp_min(1e-12)).argmax(0).cpu()
            del base
        if owner is None:
            columns = [[out] for out in run(sources[0])]
            for store in sources[1:]:
                for column, out in zip(columns, run(store)):
                    column.append(out)
        else:
            columns = [[None] for _ in batches]
            for p, store in enumerate(sources):
                if not bool((owner == p).any()):
                    continue
                for column, out, (lo, hi) in zip(columns, run(store, owner == p), bounds):
                    if out is None:
                        continue
                    rows = (owner[lo:hi] == p).nonzero().flatten().to(out.device)
                    if column[0] is None:
                        column[0] = torch.zeros_like(out)
                    column[0][rows] = out[rows]
        self.store_outputs(tower, self.inputs.base, [])  # the tower holds the base again
        return batches, owner, columns

    def store_outputs(self, tower: Any, store: Any, batches: Sequence[Any], rows: Any = None) -> Iterator[Any]:
        """Batch by batch, the outputs of ``store``'s model (its weights loaded into ``tower``): one batch of outputs
        at a time besides those kept; ``rows`` (bool per sample): only the batches holding one of them, ``None``
        for the others."""
        from ..engine.compatibility import load_weights_into

        state = {self.adapter.canonical_key(k): v for k, v in tower.state_dict().items()}
        load_weights_into(state, [store], [1.0], [n for n in self.inputs.names if n in state])
        return (self.rule.outputs(tower, batch) if rows is None or bool(rows[lo:hi].any()) else None
                for batch, (lo, hi) in zip(batches, batch_bounds(batches)))

    def _output_criteria(self, tower: Any) -> dict[str, float]:
        """The output criteria of the candidate held by ``tower``."""
        return self.output_criteria(self.rule.outputs(tower, batch) for batch in self.compared)

    def output_criteria(self, outputs: Iterable[Any]) -> dict[str, float]:
        """``output``, ``entropy`` and ``disagreement`` of a candidate from its outputs on the compared batches,
        in order (see the module docstring): Σ numerators / Σ denominators over every (sample, compared expert)
        pair (an image or pooled text: 1 each; a causal LM: its real positions)."""
        import torch

        sums = {name: [0.0, 0.0] for name in OUTPUT_CRITERIA}

        def add(key: str, value: tuple[Any, Any]) -> None:
            sums[key][0] += float(value[0].double().sum())
            sums[key][1] += float(value[1].double().sum())

        batches = self.compared
        bounds = batch_bounds(batches)
        for batch, column, (lo, hi), merged in zip(batches, self.columns, bounds, outputs, strict=True):
            for c, reference in enumerate(column):
                experts = torch.full((hi - lo,), c) if self.owner is None else self.owner[lo:hi]
                if self.heads is None:
                    add("output", self.rule.discrepancy(reference, merged, batch))
                    if "disagreement" in self.options.criteria:
                        add("disagreement", self.rule.disagreement(reference, merged, batch))
                    continue
                for p in experts.unique().tolist():
                    rows = (experts == p).nonzero().flatten().to(merged.device)
                    with torch.no_grad():
                        log_merged = torch.log_softmax(self.heads[p](merged[rows]).float(), -1)
                        log_expert = torch.log_softmax(self.heads[p](reference[rows]).float(), -1)
                    kl = (log_expert.exp() * (log_expert - log_merged)).sum(-1)
                    add("output", (kl, torch.ones_like(kl)))
                    entropy = -(log_merged.exp() * log_merged).sum(-1)
                    add("entropy", (entropy, torch.ones_like(entropy)))
                    differs = (log_merged.argmax(-1) != log_expert.argmax(-1)).double()
                    add("disagreement", (differs, torch.ones_like(differs)))
            if self.heads is None and "entropy" in self.options.criteria:
                add("entropy", self.rule.entropy(merged, batch))
        self.counts.update({key: count for key, (_, count) in sums.items() if count})
        return {key: total / count for key, (total, count) in sums.items() if count}


def pooled(parts: Sequence[tuple[Mapping[str, float], Mapping[str, float]]]) -> dict[str, float]:
    """Criteria measured on disjoint samples, as one evaluation of all of them: each part's ``(values, counts)``
    (:meth:`CandidateEvaluator.evaluate`, :attr:`~CandidateEvaluator.counts`), every value weighted by what it
    averaged over (exact for the output criteria, Σ numerators / Σ denominators; ``mloss`` by samples)."""
    keys = parts[0][0]
    return {key: sum(values[key] * counts[key] for values, counts in parts) / sum(counts[key] for _, counts in parts)
            for key in keys}


def model_batches(samples: Any, batch_size: int, device: Any) -> list[dict[str, Any]]:
    """``samples`` (a pixel tensor or :class:`~hf_mloss.loading.model_inputs.ModelInputs`) as consecutive batches
    of model inputs on ``device`` (text batches cut to their own longest sequence)."""
    from ..engine.walk import batch_to

    parts = samples.split(batch_size)
    return [batch_to(part, device) for part in parts]


def batch_bounds(batches: Sequence[Mapping[str, Any]]) -> list[tuple[int, int]]:
    """``(first, end)`` sample index of every batch."""
    bounds, start = [], 0
    for batch in batches:
        size = len(next(iter(batch.values())))
        bounds.append((start, start + size))
        start += size
    return bounds


# ---------------------------------------------------------------------------------------------- candidates
def replay_layerwise(merger: TensorMerger, method: Any, scores: Mapping[int, Any]) -> None:
    """Run a data-guided method's hooks with recorded per-layer scores instead of a scoring pass, in the order a
    merged-prefix pass calls them: the merge it produces is the one those scores give, at a tensor merge's cost."""
    from ..adapters import EMBEDDING_STAGE
    from .stages import DriverRun

    run = DriverRun(merger)
    hooks = method.layer_hooks(run)
    layers = merger.inputs.adapter.num_layers
    for stage in [EMBEDDING_STAGE, *range(layers)]:
        hooks.before_stage(stage)
        if stage in scores:
            hooks.after_scores(stage, scores[stage])
    hooks.before_stage(layers)
    hooks.after_all()
    merger.merge(merger.names)


def recorded_scores(report: MLossReport, adapter: Any) -> dict[int, Any]:
    """The per-layer :class:`~hf_mloss.engine.score.LayerScores` a merge's report recorded, by block index."""
    from ..engine.score import LayerScores

    out = {}
    for layer in range(adapter.num_layers):
        name = getattr(adapter, "report_prefix", "") + adapter.target_name(layer)  # a whole model's: vision_model.
        if name in report.layer:
            out[layer] = LayerScores(
                node=report.node[name], node_normalized=report.node_normalized[name],
                node_ratio=report.node_ratio.get(name, report.node[name]), layer=report.layer[name],
                layer_normalized=report.layer_normalized[name], layer_ratio=report.layer_ratio.get(name, 0.0))
    return out


class CandidateBuilder:
    """Merges the settings of a grid into a scratch tower and returns their task vectors τ = (θ − θ₀) / λ."""

    def __init__(self, config: MergeConfig, inputs: RunInputs, tower: Any, names: Sequence[str]) -> None:
        self.config, self.inputs, self.tower, self.names = config, inputs, tower, list(names)
        self.state = {inputs.adapter.canonical_key(k): v for k, v in tower.state_dict().items()}
        self.base = {name: self.state[name].detach().clone() for name in self.names}
        self.scores: dict[int, Any] | None = None
        self.report: MLossReport | None = None
        self.reference: dict[str, Any] | None = None

    def write(self, tau: Mapping[str, Any] | None, lam: float, into: Mapping[str, Any] | None = None) -> None:
        """``into[name] = θ₀ + λ·τ`` (``into``: the scratch tower by default; ``tau=None``: the base)."""
        import torch

        target = self.state if into is None else into
        with torch.no_grad():
            for name in self.names:
                if tau is None:
                    target[name].copy_(self.base[name])
                else:
                    torch.add(self.base[name], tau[name], alpha=lam, out=target[name])

    def task_vector(self, setting: Mapping[str, Any], lam: float, *, live: bool = False) -> dict[str, Any]:
        """Merge ``setting`` at λ = ``lam`` and return (θ − θ₀) / λ. A data-guided method scores live when ``live``
        (the reference; its scores are kept), else replays the reference's scores."""
        import torch

        from .layerwise import merge_layerwise
        from .merger import TensorMerger
        from ..methods import MergeContext

        config = self.config.replace(parameters={**self.config.parameters, **setting, **self._lam(lam, setting)},
                                     select=None)
        method, params = config.merge_method(), config.method_params()
        self.write(None, 1.0)
        from ..loading.inputs import resolve_weights

        weights = resolve_weights(config, method.default_weight)  # the candidate's own default (auto: per method)
        ctx = MergeContext(params=params, weights=weights.to(self.inputs.device, torch.float32),
                           seed=config.seed)
        merger = TensorMerger(self.inputs, method, ctx, self.tower)
        if getattr(method, "gram_prefix", None):  # RegMean: no λ, no scores to replay
            from .regmean import merge_regmean

            note = merge_regmean(config, self.inputs, merger, self.tower, method, progress=False)
            if note is not None:  # a candidate: warned (the card describes the chosen merge)
                import warnings

                warnings.warn(note, UserWarning, stacklevel=2)
        elif method.needs_data and live:
            self.report = merge_layerwise(config, self.inputs, merger, self.tower, method, progress=False)
            self.scores = recorded_scores(self.report, self.inputs.adapter)
        elif method.needs_data:
            replay_layerwise(merger, method, self.scores)
        else:
            method.prepare(ctx, merger.visit)
            merger.merge(merger.names)
        return {name: (self.state[name] - self.base[name]).div_(lam) for name in self.names}

    def refit(self, options: SelectionOptions, chosen: Mapping[str, Any], lam: float, inputs: RunInputs
              ) -> dict[str, Any]:
        """The chosen candidate's τ merged again on ``inputs`` (all the data, after a search fitted on part of it),
        as the search merged it: a data-guided method's reference scored live, then the chosen setting."""
        self.inputs, self.scores, self.report = inputs, None, None
        method = self.config.merge_method()
        groups = candidate_groups(options, self.config.method_params().to_dict(), method)
        fixed = next(fixed for fixed, lams in groups
                     if lam in lams and all(chosen.get(k) == v for k, v in fixed.items()))
        reference = self.reference
        ref_tau = _reference_tau(self, reference) if reference is not None else None
        if reference is not None and all(reference[k] == v for k, v in fixed.items()):
            return ref_tau
        return self.task_vector(fixed, 1.0)

    def _lam(self, lam: float, setting: Mapping[str, Any]) -> dict[str, float]:
        """``{"lam": lam}`` where the merge is θ₀ + λ·τ (``lam`` rescales it); else the setting's own λ stands."""
        parameters = {**self.config.method_params().to_dict(), **setting}
        return {"lam": lam} if self.config.merge_method().scales_with_lam(parameters) else {}


def candidate_groups(options: SelectionOptions, method_params: Mapping[str, Any], method: Any = None
                     ) -> list[tuple[dict, list]]:
    """The grid as (setting without λ, the λ values that rescale its merge); where λ does not rescale a merge
    (no ``lam`` parameter, a calibrated merge, CART: :meth:`~hf_mloss.methods.MergeMethod.scales_with_lam`) every
    setting is its own group, merged as it is (λ = 1 stands for "no rescaling")."""
    rescales = all((method.scales_with_lam({**method_params, **setting}) if method is not None
                    else "lam" in method_params) for setting in options.settings())
    if not rescales:
        return [(setting, [1.0]) for setting in options.settings()]
    lams = list(options.grid.get("lam", [method_params["lam"]]))
    keys = [k for k in options.grid if k != "lam"]
    return [(dict(zip(keys, values)), lams) for values in itertools.product(*(options.grid[k] for k in keys))]


def iterate_candidates(builder: CandidateBuilder, options: SelectionOptions) -> Iterator[tuple[dict, dict, float]]:
    """Yield ``(setting, τ, λ)`` for every candidate of the grid, in order, while ``builder.tower`` holds
    θ₀ + λ·τ (see the module docstring for what is merged once and what is rescaled or replayed).

    Example:
        ```python
        >>> for setting, tau, lam in iterate_candidates(builder, options):
        ...     values = evaluator.evaluate(builder.tower)
        ```
    """
    config = builder.config
    defaults = config.method_params().to_dict()
    reference = builder.reference = reference_setting(config, options)
    ref_tau = _reference_tau(builder, reference) if reference is not None else None
    for fixed, lams in candidate_groups(options, defaults, config.merge_method()):
        is_ref = reference is not None and all(reference[k] == v for k, v in fixed.items())
        tau = ref_tau if is_ref else builder.task_vector(fixed, 1.0)
        for lam in lams:
            builder.write(tau, lam)
            yield {**fixed, **({"lam": lam} if "lam" in options.grid and "lam" not in fixed else {})}, tau, lam


def reference_setting(config: MergeConfig, options: SelectionOptions) -> dict[str, Any] | None:
    """For a data-guided method, the setting merged with live M-Loss scoring (middle of every grid axis; λ from the
    parameters when the grid has none); ``None`` for data-free methods."""
    if not config.merge_method().needs_data:
        return None
    reference = options.reference_setting()
    defaults = config.method_params().to_dict()
    if "lam" in defaults and "lam" not in reference:
        reference["lam"] = defaults["lam"]
    return reference


def held_out_inputs(config: MergeConfig, inputs: RunInputs, n: int, who: str) -> tuple[RunInputs, RunInputs]:
    """The samples candidates are compared on and those the data-fitted ones are fitted on
    (:func:`~hf_mloss.loading.model_inputs.held_out_split`: up to ``n`` of each model's data and of the shared pool, at
    most half); the same inputs twice, with a warning naming ``who``, when some model's data holds a single sample."""
    from ..loading.model_inputs import held_out_split

    split = held_out_split(inputs.sample_owner, len(inputs.model_inputs), n, config.seed, len(inputs.sources))
    if split is None:
        import warnings

        warnings.warn(f"{who}: some model's data holds a single sample, so none can be held out of the fit of the "
                      "candidates that are fitted on the data; they are compared on the samples they were fitted on, "
                      "which favours them. Give each model two samples or more.", UserWarning, stacklevel=4)
        return inputs, inputs
    return inputs.subset(split[0]), inputs.subset(split[1])


def select_and_merge(config: MergeConfig, inputs: RunInputs, merger: TensorMerger, tower: Any, *,
                     progress: bool = True, token: Any = None) -> tuple[MergeConfig, MLossReport | None]:
    """Score every candidate of ``config.select``, write the chosen one into ``merger``'s tower, and return the
    config as it ran (chosen parameters, the selection record) with the reference merge's M-Loss report, if any.

    Example:
        ```python
        >>> record, report = select_and_merge(config, inputs, merger, tower)   # what run_merge does
        >>> record.select.chosen
        {'k': 0.5, 'lam': 1.0}
        ```
    """
    import copy

    from tqdm.auto import tqdm

    options, method = config.select, config.merge_method()
    check_output_rule(inputs.adapter.output_rule(tower), options, inputs.adapter)  # before the scratch copy
    held_out = method.needs_data and options.held_out and inputs.model_inputs is not None
    compare, fit = (held_out_inputs(config, inputs, options.num_samples, "select") if held_out
                    else (inputs, inputs))
    builder = CandidateBuilder(config, fit, copy.deepcopy(tower), merger.names)
    evaluator = CandidateEvaluator(config, compare, options, builder.tower, progress=progress, token=token)
    total = len(options.settings())
    candidates, best = [], None
    bar = tqdm(total=total, desc=f"Selecting ({options.criterion})", unit="candidate", disable=not progress)
    for setting, tau, lam in iterate_candidates(builder, options):
        values = evaluator.evaluate(builder.tower)
        bad = {name: value for name, value in values.items() if not math.isfinite(value)}
        if bad:  # NaN is never "less than": it would win; an overflowing candidate is a user error
            bar.close()
            raise InvalidParameterError(
                f"select.grid: the candidate {setting} scores {', '.join(f'{k}={v}' for k, v in bad.items())} (not "
                "finite: its merge overflows, e.g. a huge λ or weights). Nothing was chosen or written; remove it "
                "from the grid.")
        candidates.append({"setting": setting, **values})
        if best is None or values[options.criterion] < best[0]:
            best = (values[options.criterion], setting, tau, lam)
        bar.update(1)
    bar.close()
    _, chosen, tau, lam = best
    warn_grid_edge(options.grid, chosen, options.criterion)
    if fit is not inputs:  # fitted on part of the data to be compared fairly: the chosen merge on all of it
        tau = builder.refit(options, chosen, lam, inputs)
    builder.write(tau, lam, into=merger.targets)
    merger.done.update(merger.names)
    merger.ctx.params = method.make_params(**{**config.parameters, **chosen})
    counted = len(evaluator.sample) if evaluator.sample_owner is None else options.num_samples  # own data: per model
    record = replace(options, num_samples=counted, reference=builder.reference, chosen=chosen,
                     candidates=candidates, fitted=len(fit.model_inputs) if fit is not inputs else None)
    return config.replace(parameters={**config.parameters, **chosen}, select=record), builder.report


def warn_grid_edge(grid: dict[str, Any], chosen: dict[str, Any], criterion: str, method: str | None = None) -> None:
    """Warn when the label-free choice sits on an edge of its grid (the benchmark suites flag it too); ``method``:
    whose grid it is (``auto``'s choice)."""
    import warnings

    edges = grid_edges(grid, chosen)
    if edges:
        of = f" of {method}'s grid" if method else ""
        warnings.warn(f"The label-free selection (criterion {criterion!r}) chose a grid edge{of}: {'; '.join(edges)}. A "
                      "better setting may lie beyond it: extend the grid in that direction and select again.",
                      UserWarning, stacklevel=3)


def _reference_tau(builder: CandidateBuilder, reference: dict[str, Any]) -> dict[str, Any]:
    lam = reference.get("lam", 1.0)
    if lam == 0:
        raise InvalidParameterError("The reference setting of a data-guided method (the middle of each grid axis) "
                                    "has lam=0, whose merge is the base: put a non-zero λ in the middle of the grid.")
    setting = {k: v for k, v in reference.items() if k != "lam"}
    return builder.task_vector(setting, lam, live=True)
