"""Objectives a learned merge minimises on unlabeled data (``objective=`` of ``adamerging``), one registry.

Each objective maps the merge's differentiable outputs on one batch to a scalar; the definitions are those of the
label-free criteria (:mod:`hf_mloss.merging.selection`), read through the family's
:class:`~hf_mloss.adapters.outputs.OutputRule`. With heads (encoders), expert p's head reads the merge's pooled
features on the samples compared with expert p (its *share*: routed by ``share="auto"``, every sample with
``"all"``), and the batch's value is Σ_p mean over expert p's share, as the papers sum one loss per task.

* ``entropy`` (AdaMerging's): the entropy of softmax(head_p(f_m(x))), −Σ p·log(p + 1e-8) as the papers' code; a causal LM: of its own next-token
  distribution, mean over real positions. Encoders need heads.
* ``output_gap``: with heads, KL(softmax(head_p(f_p(x))) ‖ softmax(head_p(f_m(x)))), the routed fine-tune standing for
  the ensemble on its own task (the ``output`` criterion); without heads the rule's ensemble gap: encoders
  Σ‖f_m − Σ_p α_p f_p‖ / Σ‖Σ_p α_p f_p‖, causal LMs KL(Σ_p α_p P_p ‖ P_m) per real position; with each model's own
  data, model p's own samples against model p alone (the rule's discrepancy: ‖f_m − f_p‖² / ‖f_p‖², or
  KL(P_p ‖ P_m) per real position). Every family.
* ``disagreement``: the cross-entropy of the merge against the routed expert's top class (heads) or next token
  (causal LMs): the experts' predictions as pseudo-labels.
* ``mloss``: Σ over scored layers of the normalised layer M-Loss along the merged prefix, mean over real positions
  of ‖g‖₂ / (‖μ‖₂ + ε), g the gap of :func:`~hf_mloss.engine.kernel.unit_gap` between the merge's own unit and the
  q experts' units on the merge's own input u. Needs no heads, no expert forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .._validation import did_you_mean
from ..errors import InvalidParameterError


@dataclass
class ObjectiveInputs:
    """What an objective reads besides the merge's outputs: the family's rule, heads, weights and, per batch, the
    experts' outputs and the share of each sample."""

    rule: Any
    heads: list[Callable[[torch.Tensor], torch.Tensor]] | None
    alpha: torch.Tensor
    """``[q]`` normalised model weights."""
    units: list[Any] = field(default_factory=list)
    """``mloss``: the :class:`ScoredUnitStack` of every scored layer."""
    eps: float = 1e-4


class Objective:
    """One objective: ``value(inputs, merged, batch, experts, owner)`` → a scalar tensor (lower is better)."""

    name: ClassVar[str]
    description: ClassVar[str]
    needs_experts: ClassVar[bool] = True
    """Whether it reads the experts' outputs (computed once per batch, before training)."""
    needs_classes: ClassVar[bool] = False
    """Whether it needs class outputs: heads for an encoder (a causal LM has its own)."""

    def check(self, rule: Any, heads: Sequence[Any] | None, family: str) -> None:
        """Refuse, before any work, a run whose outputs this objective cannot read."""
        if self.needs_classes and not heads and not rule.has_distribution:
            raise InvalidParameterError(
                f"objective {self.name!r} needs one classification head per model (heads=...): the {family!r} "
                f"model's output is the {rule.description}, not class probabilities. Pass heads=[...] (one per "
                "model, e.g. zero-shot text heads for CLIP), or use objective='output_gap' or 'mloss', which need "
                "no heads.")
        if heads and rule.has_distribution:
            raise InvalidParameterError(f"heads=... apply to pooled features; the {family!r} model is a causal LM, "
                                        "whose LM head is its own head. Remove heads.")

    def value(self, inputs: ObjectiveInputs, merged: torch.Tensor, batch: dict[str, torch.Tensor],
              experts: Sequence[torch.Tensor] | None, owner: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


OBJECTIVES: dict[str, Objective] = {}
ENTROPY_EPS = 1e-8
"""The entropy with heads is −Σ p·log(p + ε), as AdaMerging's and fusion-bench's code compute it."""


def register_objective(objective: Objective) -> Objective:
    """Register an objective under ``objective.name`` (lowercase, unique)."""
    from ..methods.adamerging import OBJECTIVE_NAMES

    if objective.name in OBJECTIVES:
        raise KeyError(f"An objective named {objective.name!r} is already registered.")
    OBJECTIVES[objective.name] = objective
    OBJECTIVE_NAMES.add(objective.name)  # what a learned method's parameters accept (they never import this module)
    return objective


def get_objective(name: str) -> Objective:
    """The registered objective ``name``; refuses an unknown one with the registered names."""
    if name not in OBJECTIVES:
        raise InvalidParameterError(f"Unknown objective {name!r}{did_you_mean(name, list(OBJECTIVES))}; available: "
                                    f"{sorted(OBJECTIVES)}.")
    return OBJECTIVES[name]


def differentiable_outputs(rule: Any, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The rule's outputs with gradients (``OutputRule.outputs`` runs under inference mode): pooled features, or
    next-token log-probabilities."""
    from ..adapters.outputs import NextTokenDistribution, PooledFeatures

    def widened(x: torch.Tensor) -> torch.Tensor:  # float32 at least (float64 stays: gradient checks)
        return x.to(torch.promote_types(x.dtype, torch.float32))

    if isinstance(rule, PooledFeatures):
        return widened(rule.pool(model, batch))
    if isinstance(rule, NextTokenDistribution):
        return torch.log_softmax(widened(rule.logits(model, batch)), dim=-1)
    raise InvalidParameterError(f"A learned merge reads outputs through PooledFeatures or NextTokenDistribution; "
                                f"this family's rule is {type(rule).__name__}.")


def per_share(owner: torch.Tensor | None, q: int, size: int, term: Callable[[int, torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
    """Σ over experts p of ``term(p, rows)`` on the rows of expert p's share (every row with ``owner=None``)."""
    total = None
    for p in range(q):
        rows = torch.arange(size) if owner is None else (owner == p).nonzero().flatten()
        if rows.numel():
            value = term(p, rows)
            total = value if total is None else total + value
    return total if total is not None else torch.zeros(())


def _position_mean(values: torch.Tensor, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """Mean over the real positions of ``values`` (``[batch, seq]``) at ``rows``."""
    from ..adapters.outputs import real_positions

    mask = real_positions(batch, values)[rows.to(values.device)]
    return torch.where(mask, values[rows.to(values.device)], torch.zeros_like(mask, dtype=values.dtype)).sum() / \
        mask.sum().clamp_min(1)


class Entropy(Objective):
    name = "entropy"
    description = "entropy of the merge's class (next-token) distribution"
    needs_experts = False
    needs_classes = True

    def value(self, inputs, merged, batch, experts, owner):
        if inputs.heads is None:  # a causal LM: its own next-token distribution
            p = merged.exp()
            values = -torch.where(p > 0, p * merged, torch.zeros_like(p)).sum(-1)
            return _position_mean(values, batch, torch.arange(len(merged)))

        def term(p: int, rows: torch.Tensor) -> torch.Tensor:  # AdaMerging's code: −Σ p·log(p + 1e-8)
            probs = torch.softmax(inputs.heads[p](merged[rows.to(merged.device)]).to(merged.dtype), -1)
            return -(probs * torch.log(probs + ENTROPY_EPS)).sum(-1).mean()

        return per_share(owner, len(inputs.alpha), len(merged), term)


class OutputGap(Objective):
    name = "output_gap"
    description = "discrepancy of the merge's outputs with the fine-tunes' (ensemble, or routed expert with heads)"

    def value(self, inputs, merged, batch, experts, owner):
        if inputs.heads is None and owner is not None:  # each model's own data: against that model's outputs
            def own(p: int, rows: torch.Tensor) -> torch.Tensor:
                rows = rows.to(merged.device)
                sub = {k: v[rows] for k, v in batch.items()}
                numerator, denominator = inputs.rule.discrepancy(experts[p][rows], merged[rows], sub)
                return numerator.sum() / denominator.sum().clamp_min(1e-12)

            return per_share(owner, len(inputs.alpha), len(merged), own)
        if inputs.heads is None:
            numerator, denominator = inputs.rule.ensemble_gap(experts, inputs.alpha.tolist(), merged, batch)
            return numerator.sum() / denominator.sum().clamp_min(1e-12)

        def term(p: int, rows: torch.Tensor) -> torch.Tensor:
            rows = rows.to(merged.device)
            log_m = torch.log_softmax(inputs.heads[p](merged[rows]).to(merged.dtype), -1)
            log_e = torch.log_softmax(inputs.heads[p](experts[p][rows]).to(merged.dtype), -1)
            return (log_e.exp() * (log_e - log_m)).sum(-1).mean()

        return per_share(owner, len(inputs.alpha), len(merged), term)


class Disagreement(Objective):
    name = "disagreement"
    description = "cross-entropy of the merge against each routed expert's top class (next token)"
    needs_classes = True

    def value(self, inputs, merged, batch, experts, owner):
        def term(p: int, rows: torch.Tensor) -> torch.Tensor:
            rows = rows.to(merged.device)
            if inputs.heads is None:  # causal LM: log-probabilities [batch, seq, vocab]
                labels = experts[p][rows].argmax(-1, keepdim=True)
                nll = -merged[rows].gather(-1, labels).squeeze(-1)
                return _position_mean(nll, {k: v[rows] for k, v in batch.items()}, torch.arange(len(rows)))
            labels = inputs.heads[p](experts[p][rows]).argmax(-1)
            return torch.nn.functional.cross_entropy(inputs.heads[p](merged[rows]).to(merged.dtype), labels)

        return per_share(owner, len(inputs.alpha), len(merged), term)


@dataclass
class ScoredUnitStack:
    """One scored layer's unit for ``mloss``: the q experts' stacked rows and the merge's unit input and outputs,
    captured by forward hooks during the merge's forward."""

    weight: torch.Tensor
    """``[q, nodes, d]`` (gated: the gate's)."""
    bias: torch.Tensor | None
    up_weight: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    activation: Callable[[torch.Tensor], torch.Tensor] = torch.nn.functional.gelu
    captured: dict[str, torch.Tensor] = field(default_factory=dict)
    fused: bool = False
    """The gate linear's output holds both halves of the gated unit (:class:`~hf_mloss.adapters.ScoredUnit`)."""

    def hooks(self, gate: torch.nn.Module, up: torch.nn.Module | None) -> list[Any]:
        """Forward hooks that keep the unit's input and the merge's pre-activations of each call."""
        def keep_gate(module, args, output):
            self.captured["u"] = args[0]
            if self.fused:
                self.captured["gate"], self.captured["up"] = output.chunk(2, dim=-1)
            else:
                self.captured["gate"] = output

        def keep_up(module, args, output):
            self.captured["up"] = output

        handles = [gate.register_forward_hook(keep_gate)]
        if up is not None:
            handles.append(up.register_forward_hook(keep_up))
        return handles

    def normalized_layer_mloss(self, mix: torch.Tensor, mask: torch.Tensor | None, eps: float) -> torch.Tensor:
        """Mean over the (real) positions of ‖g‖₂ / (‖μ‖₂ + ε) for the last captured call."""
        from .kernel import unit_gap

        u, merged = self.captured["u"], self.captured["gate"]
        flat_u, flat_m = u.reshape(-1, u.shape[-1]), merged.reshape(-1, merged.shape[-1])
        merged_up = self.captured.get("up")
        flat_up = None if merged_up is None else merged_up.reshape(-1, merged_up.shape[-1])
        if mask is not None and mask.numel() == flat_u.shape[0]:
            keep = mask.reshape(-1).to(flat_u.device)
            flat_u, flat_m = flat_u[keep], flat_m[keep]
            flat_up = None if flat_up is None else flat_up[keep]
        h = torch.einsum("pd,qnd->pqn", flat_u, self.weight.to(flat_u))
        if self.bias is not None:
            h = h + self.bias.to(h)
        up = None
        if self.up_weight is not None:
            up = torch.einsum("pd,qnd->pqn", flat_u, self.up_weight.to(flat_u))
            if self.up_bias is not None:
                up = up + self.up_bias.to(up)
        g, mu = unit_gap(h, mix, self.activation, flat_m, up=up, merged_up=flat_up)
        return (g.norm(dim=-1) / (mu.norm(dim=-1) + eps)).mean()


class MLoss(Objective):
    name = "mloss"
    description = "summed normalised layer M-Loss along the merged prefix"
    needs_experts = False

    def check(self, rule, heads, family):
        if heads:
            raise InvalidParameterError("objective 'mloss' reads the merge's hidden units, not class outputs: "
                                        "remove heads.")

    def value(self, inputs, merged, batch, experts, owner):
        mask = batch.get("attention_mask")
        total = None
        for unit in inputs.units:
            value = unit.normalized_layer_mloss(inputs.alpha, None if mask is None else mask.bool(), inputs.eps)
            total = value if total is None else total + value
        return total if total is not None else merged.sum() * 0


for _objective in (Entropy(), OutputGap(), Disagreement(), MLoss()):
    register_objective(_objective)
