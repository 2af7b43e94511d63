"""PEFT LoRA adapters out: ``output="adapter"`` writes the merge of LoRA inputs as one LoRA adapter.

``PeftModel.from_pretrained(base, folder)`` loads what is written. ``combination="cat"`` stacks the inputs' factors
(the method's weights folded into B, ranks summed): exact for linear methods. ``combination="svd"`` writes the rank-r
truncated SVD of each merged ΔW and records its relative Frobenius error per tensor. Reading adapters is
:mod:`hf_mloss.loading.lora`'s; this module plans (before any work) and builds the written factors.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InvalidParameterError
from ..loading.lora import (
    ADAPTER_CONFIG,
    ADAPTER_SAFETENSORS,
    PEFT_PREFIX,
    Ia3Adapter,
    LoraAdapter,
    LoraStore,
    is_linear_merge,
)

if TYPE_CHECKING:
    from ..loading.inputs import RunInputs
    from ..spec.config import MergeConfig


@dataclass
class LoraOutput:
    """A merged LoRA adapter, ready to save: PEFT-named tensors, its ``adapter_config.json`` and the SVD errors."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    combination: str
    rank: int
    errors: dict[str, float] = field(default_factory=dict)
    """Module path -> ‖ΔW − B·A‖_F / ‖ΔW‖_F of the written factors."""
    model_class: str = ""
    """The class of the base the adapter applies to (for the card, without building the merged model)."""
    dtype: str = ""

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(folder / ADAPTER_SAFETENSORS),
                  metadata={"format": "pt"})
        (folder / ADAPTER_CONFIG).write_text(json.dumps(self.config, indent=2, sort_keys=True) + "\n")
        (folder / "hf_mloss_lora.json").write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def to_dict(self) -> dict[str, Any]:
        values = list(self.errors.values())
        return {"combination": self.combination, "rank": self.rank,
                "max_relative_error": max(values, default=0.0),
                "mean_relative_error": sum(values) / len(values) if values else 0.0,
                "relative_errors": self.errors}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def card_section(self) -> str:
        """Markdown for the model card: what was written, and what the factorisation lost."""
        modules = len(self.config["target_modules"])
        lines = [f"A PEFT LoRA adapter of rank {self.rank} on {modules} module(s), written with "
                 f"`combination=\"{self.combination}\"`."]
        if self.combination == "cat":
            lines.append("The inputs' factors are stacked with the merge weights folded into B: the adapter is the "
                         "merge exactly (up to float32 round-off).")
        else:
            info = self.to_dict()
            lines.append(f"Each merged ΔW is replaced by its rank-{self.rank} truncated SVD. Relative Frobenius error "
                         f"‖ΔW − B·A‖/‖ΔW‖: mean {info['mean_relative_error']:.4f}, max "
                         f"{info['max_relative_error']:.4f} (every tensor's in `hf_mloss_lora.json`).")
            worst = sorted(self.errors.items(), key=lambda item: -item[1])[:5]
            if worst:
                lines += ["", "| module | relative error |", "|---|---|"]
                lines += [f"| `{module}` | {error:.4f} |" for module, error in worst]
        return "\n".join(lines)


@dataclass
class AdapterPlan:
    """What ``output="adapter"`` will write, checked before the merge runs."""

    targets: dict[str, str]
    """Canonical name -> PEFT module path of every weight an input adapter changes."""
    copies: dict[str, str]
    """Canonical name -> PEFT module path of tensors saved in full (``modules_to_save``)."""
    adapters: list[LoraAdapter]
    combination: str
    rank: int
    linear: bool = False
    """A linear method of plain LoRA inputs: the merge is B_cat·A_cat exactly (:func:`build_linear_adapter_output`)."""


def plan_adapter_output(config: MergeConfig, inputs: RunInputs) -> AdapterPlan | None:
    """For ``output="adapter"``: refuse, before any work, inputs that cannot give an adapter; else the plan.

    Raises:
        InvalidParameterError: an input is a full model, a target is not a plain linear, a full copy sits on a LoRA
            target, or ``cat`` meets DoRA inputs.
    """
    if config.output != "adapter":
        return None
    stores = inputs.sources
    full = [s.ref.name for s in stores if not isinstance(s, LoraStore)]
    if full:
        raise InvalidParameterError(
            f"output='adapter' writes a LoRA adapter from LoRA adapter inputs, but {full} "
            f"{'is a full model' if len(full) == 1 else 'are full models'}. Pass adapters only, or write a full "
            "model (output='auto').")
    adapters = [s.lora for s in stores]
    ia3 = [lora.ref.name for lora in adapters if isinstance(lora, Ia3Adapter)]
    if ia3:
        raise InvalidParameterError(f"output='adapter' writes a LoRA adapter; {ia3} are IA³ adapters, whose scaled "
                                    "weights are not low-rank updates. Write a full model (output='auto') instead.")
    targets: dict[str, str] = {}
    copies: dict[str, str] = {}
    for lora in adapters:
        for name, module in lora.modules.items():
            if module.kind != "linear" or module.fan_in_fan_out:
                raise InvalidParameterError(
                    f"output='adapter' writes LoRA on linear layers; {lora.ref.name!r} adapts {module.module!r} "
                    f"({module.kind}{', fan_in_fan_out' if module.fan_in_fan_out else ''}). Write a full model "
                    "(output='auto') instead.")
            if targets.setdefault(name, module.module) != module.module:
                raise InvalidParameterError(
                    f"The adapters name {name!r} differently ({targets[name]!r} and {module.module!r}); they were "
                    "trained on different model classes. Write a full model (output='auto') instead.")
        for name, module in lora.copy_modules.items():
            copies.setdefault(name, module)
    clash = sorted({copies[n] for n in copies} & {m for m in targets.values()})
    if clash:
        raise InvalidParameterError(
            f"Inputs save full copies of {clash} (modules_to_save or bias='all'/'lora_only') that other inputs adapt "
            "with LoRA; one PEFT adapter cannot hold both. Write a full model (output='auto') instead.")
    combination = config.combination or ("cat" if is_linear_merge(config.method, config.parameters) else "svd")
    if combination == "cat" and any(lora.use_dora for lora in adapters):
        raise InvalidParameterError("combination='cat' stacks LoRA factors, and DoRA inputs are not low-rank updates "
                                    "of the base; use combination='svd' (with lora_rank=...).")
    if combination == "cat":
        rank = max(sum(l.modules[n].rank for l in adapters if n in l.modules) for n in targets) if targets else 1
    else:
        rank = config.lora_rank or max((m.rank for l in adapters for m in l.modules.values()), default=1)
        full = max((min(inputs.base.shapes[n][-2:]) for n in targets), default=rank)  # the layers' largest rank
        if rank > full:
            if config.lora_rank:
                warnings.warn(f"lora_rank={rank} exceeds the rank of every adapted layer (at most {full}); the "
                              f"adapter is written with rank {full}, which already holds each merged ΔW exactly.",
                              stacklevel=2)
            rank = full
    linear = is_linear_merge(config.method, config.parameters) and not any(lora.use_dora for lora in adapters)
    return AdapterPlan(targets=targets, copies=copies, adapters=adapters, combination=combination, rank=rank,
                       linear=linear)


@torch.no_grad()
def build_adapter_output(plan: AdapterPlan, config: MergeConfig, inputs: RunInputs, merged: dict[str, torch.Tensor],
                         dtype: torch.dtype, *, zero_delta_is_base: bool = False) -> LoraOutput:
    """Factor the merged task vectors into one LoRA adapter (``merged``: canonical name -> merged float32 tensor).

    ``zero_delta_is_base``: the method keeps a tensor that no input changed (every LoRA input holds the base's values
    outside its adapted modules and full copies), so only the adapted modules are compared and factored.

    Raises:
        InvalidParameterError: the merge changed a tensor no adapter touches (it cannot be written as an adapter).
    """
    changed = [] if zero_delta_is_base else [
        n for n in inputs.names if n in merged and n not in plan.targets and n not in plan.copies
        and not _same(merged[n], inputs.base.get_float(n, merged[n].device))]
    if changed:
        raise InvalidParameterError(
            f"The merge changed {len(changed)} tensor(s) no input adapter touches (e.g. {changed[:2]}); they cannot be "
            "written as a LoRA adapter. Write a full model (output='auto') instead.")
    tensors: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    # A linear merge of LoRA inputs is B_cat·A_cat exactly: "cat" writes those factors, and "svd" factors them
    # through two thin QRs (no dense SVD of an out × in matrix). Other merges are factored from the dense ΔW.
    factored = plan.linear
    coefficients = _linear_coefficients(config, inputs) if factored else None
    for name, module in plan.targets.items():
        delta = merged[name].float() - inputs.base.get_float(name, merged[name].device)
        if coefficients is not None:
            a, b = _cat_factors(plan, name, coefficients)
            mismatch = _relative_error(delta, (b @ a).to(delta.device))
            if mismatch > 1e-3:
                raise RuntimeError(f"The stacked LoRA factors do not reproduce the merge of {name!r} (relative error "
                                   f"{mismatch:.2e}); please report this.")
            error = 0.0
            if plan.combination == "svd":
                a, b, error = _factored_svd(a, b, plan.rank)
        else:
            a, b, error = _svd_factors(delta, plan.rank)
        errors[module] = error
        a, b = _pad(a, b, plan.rank)
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.to(dtype)
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.to(dtype)
    return _output(plan, inputs, tensors, errors, {name: merged[name] for name in plan.copies}, dtype)


@torch.no_grad()
def build_linear_adapter_output(plan: AdapterPlan, config: MergeConfig, inputs: RunInputs,
                                merge_copy: Callable[[str], torch.Tensor], dtype: torch.dtype
                                ) -> tuple[LoraOutput, dict[str, tuple[torch.Tensor, torch.Tensor]],
                                           dict[str, torch.Tensor]]:
    """The adapter of a linear merge (``plan.linear``) from the inputs' factors alone, as PEFT's
    ``add_weighted_adapter`` builds it: B_cat·A_cat (the method's coefficients folded into B) is the merged ΔW
    exactly, so only the adapted modules' factors and the full copies (``merge_copy(name)``: their merged value) are
    read; no model is loaded and no other tensor is read or compared.

    Returns:
        The adapter, the exact float32 factors ``{name: (A_cat, B_cat)}`` and the merged copies (from which
        :class:`~hf_mloss.output.result.MergeResult` builds the merged model when it is asked for).

    Raises:
        InvalidParameterError: the weighted factors, or the ΔW they form, are not finite in float32 or in ``dtype``.
    """
    coefficients = _linear_coefficients(config, inputs)
    tensors: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    exact: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, module in plan.targets.items():
        a, b = _cat_factors(plan, name, coefficients)
        _check_finite_product(name, a, b)
        exact[name] = (a, b)
        error = 0.0
        if plan.combination == "svd":
            a, b, error = _factored_svd(a, b, plan.rank)
        errors[module] = error
        a, b = _pad(a, b, plan.rank)
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.to(dtype)
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.to(dtype)
    copies = {name: merge_copy(name) for name in plan.copies}
    for name, tensor in [*copies.items(), *((n, t) for n, t in tensors.items())]:
        if not torch.isfinite(tensor.to(dtype)).all():
            raise InvalidParameterError(f"The merge produced non-finite values in {name!r} (in {dtype}). Nothing was "
                                        "written; use smaller lam/weights.")
    return _output(plan, inputs, tensors, errors, copies, dtype), exact, copies


def _check_finite_product(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Refuse factors whose product B·A overflows float32 (a bound first; the product only when it may)."""
    bound = float(b.abs().max()) * float(a.abs().max()) * a.shape[0] if a.numel() and b.numel() else 0.0
    if math.isfinite(bound) and bound < 1e38:
        return
    if not (torch.isfinite(a).all() and torch.isfinite(b).all() and torch.isfinite(b @ a).all()):
        raise InvalidParameterError(f"The merge produced non-finite values in {name!r} (max |x| overflows float32). "
                                    "Nothing was written; use smaller lam/weights.")


def _output(plan: AdapterPlan, inputs: RunInputs, tensors: dict[str, torch.Tensor], errors: dict[str, float],
            copies: dict[str, torch.Tensor], dtype: torch.dtype) -> LoraOutput:
    """The :class:`LoraOutput`: the written factors, the full copies and PEFT's ``adapter_config.json``."""
    saved_modules = sorted(set(plan.copies.values()))
    for name, module in plan.copies.items():
        tensors[f"{PEFT_PREFIX}{module}.{name.rsplit('.', 1)[1]}"] = copies[name].to(dtype)
    base = inputs.base.ref
    adapter_config = {
        "peft_type": "LORA", "task_type": None, "r": plan.rank, "lora_alpha": plan.rank, "use_rslora": False,
        "use_dora": False, "target_modules": sorted(plan.targets.values()), "modules_to_save": saved_modules or None,
        "base_model_name_or_path": base.repo_id or (str(Path(base.path).resolve()) if base.path else None),
        "revision": None, "bias": "none", "fan_in_fan_out": False,
        "lora_dropout": 0.0, "inference_mode": True, "init_lora_weights": True, "rank_pattern": {},
        "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
    }
    return LoraOutput(tensors=tensors, config=adapter_config, combination=plan.combination, rank=plan.rank,
                      errors=errors if plan.combination == "svd" else {},
                      model_class=inputs.adapter.output_class("auto").__name__,
                      dtype=str(dtype).replace("torch.", ""))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool((a.float() - b).abs().max() <= 1e-6 * max(scale, 1e-12)) if a.numel() else True


def _linear_coefficients(config: MergeConfig, inputs: RunInputs) -> list[float]:
    """c_p such that the merged task vector is Σ_p c_p·τ_p (task arithmetic: λ·α_p; averaging: α_p / Σα)."""
    alpha = inputs.alpha.tolist()
    if config.method == "average":
        return [a / sum(alpha) for a in alpha]
    return [config.method_params().lam * a for a in alpha]


def _cat_factors(plan: AdapterPlan, name: str, coefficients: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    a_parts, b_parts = [], []
    for lora, c in zip(plan.adapters, coefficients):
        if name in lora.modules:
            a, b = lora.factors(name)
            a_parts.append(a)
            b_parts.append(b * c)
    return torch.cat(a_parts, dim=0), torch.cat(b_parts, dim=1)


def _svd_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The rank-``rank`` truncated SVD of ``delta`` as (A, B) with B·A ≈ ΔW, and its relative Frobenius error."""
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    r = min(rank, s.numel())
    total = float(s.pow(2).sum())
    error = math.sqrt(max(float(s[r:].pow(2).sum()), 0.0) / total) if total > 0 else 0.0
    return vh[:r].contiguous(), (u[:, :r] * s[:r]).contiguous(), error


def _factored_svd(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The truncated SVD of B·A from its factors: B = Q_b R_b, Aᵀ = Q_a R_a, SVD of the small R_b R_aᵀ."""
    q_b, r_b = torch.linalg.qr(b)
    q_a, r_a = torch.linalg.qr(a.T)
    u, s, vh = torch.linalg.svd(r_b @ r_a.T, full_matrices=False)
    r = min(rank, s.numel())
    total = float(s.pow(2).sum())
    error = math.sqrt(max(float(s[r:].pow(2).sum()), 0.0) / total) if total > 0 else 0.0
    return (vh[:r] @ q_a.T).contiguous(), ((q_b @ u[:, :r]) * s[:r]).contiguous(), error


def _pad(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero rows of A / columns of B up to ``rank`` (one rank for every module; the product is unchanged)."""
    missing = rank - a.shape[0]
    if missing > 0:
        a = torch.cat([a, a.new_zeros(missing, a.shape[1])])
        b = torch.cat([b, b.new_zeros(b.shape[0], missing)], dim=1)
    return a, b


def _relative_error(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    norm = float(torch.linalg.norm(reference))
    return float(torch.linalg.norm(reference - approximation)) / norm if norm > 0 else 0.0


def card_metadata(result: Any) -> dict[str, Any]:
    """PEFT's card metadata for an adapter output: ``library_name: peft``, ``base_model`` (a Hub id, never a path)."""
    return {"library_name": "peft", "base_model": result.base.repo_id, "base_model_relation": "adapter",
            "pipeline_tag": None, "tags": ["lora", "peft"]}
