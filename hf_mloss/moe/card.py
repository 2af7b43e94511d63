"""The model card of a built MoE, rendered from ``templates/moe_modelcard_template.md``: the experts and their
prompts, the settings, where the experts' own prompts are routed, and each expert pair's M-Loss."""

from __future__ import annotations

import json
from importlib import resources
from typing import TYPE_CHECKING, Any

from huggingface_hub import ModelCard, ModelCardData

from ..output.card import base_license, render_card

if TYPE_CHECKING:
    from .result import MoEResult
    from .inputs import MoEInputs

TEMPLATE = "moe_modelcard_template.md"
MAX_PROMPT_ROWS = 40
GATE_DESCRIPTIONS = {
    "hidden": "the base's hidden state of each prompt's last token at each layer's input, averaged over the prompts",
    "hidden_last": "the base's hidden state of each prompt's last token at each layer's input, averaged over the "
                   "prompts",
    "hidden_avg": "the base's hidden states at each layer's input, averaged over every position and prompt",
    "cheap_embed": "the sum of the prompts' token embeddings (the same row at every layer)",
    "random": "standard normal rows, drawn from the seed",
    "uniform_random": "uniform rows in ±1/√hidden_size, drawn from the seed",
}


def build_card(result: MoEResult, inputs: MoEInputs) -> ModelCard:
    config = result.config
    hub_ids = [r.repo_id for r in [inputs.base, *inputs.experts, *inputs.shared] if r.repo_id]
    metadata = ModelCardData(
        base_model=list(dict.fromkeys(hub_ids)) or None,
        base_model_relation="merge" if hub_ids else None,
        library_name="transformers", pipeline_tag="text-generation", license=base_license(inputs.base.path),
        tags=["moe", "mixture-of-experts", "merge", "hf_mloss", inputs.architecture.model_type])
    experts = [_expert_row(str(i), spec, ref) for i, (spec, ref) in enumerate(zip(config.experts, inputs.experts))]
    experts += [_expert_row("shared", spec, ref) for spec, ref in zip(config.shared_experts, inputs.shared)]
    template = resources.files("hf_mloss").joinpath("templates", TEMPLATE).read_text(encoding="utf-8")
    first_prompt = next((p for e in config.experts for p in e.positive_prompts), "Hello")
    return render_card(
        metadata, template,
        title=f"{result.path.name}: a {result.architecture} of {len(config.experts)} experts",
        architecture=result.architecture, model_class=result.model_class, num_experts=len(config.experts),
        shared=bool(config.shared_experts), base_name=inputs.base.name, base_revision=inputs.base.revision,
        gate_mode=config.gate_mode, gate_description=GATE_DESCRIPTIONS[config.gate_mode]
        + (f", read in {config.prompt_dtype}" if config.gate_mode.startswith("hidden") else ""),
        experts_per_token=config.experts_per_token, experts=experts,
        dtype=str(inputs.dtype or "as stored").removeprefix("torch."), seeded=config.draws_random, seed=config.seed,
        device=result.device, degenerate=", ".join(map(str, result.degenerate_layers)),
        layers=list(range(inputs.num_layers)), uniform=f"{1 / len(config.experts):.2f}",
        routing=_routing_section(result), mloss=_mloss_rows(result, inputs), mloss_note=result.mloss_note,
        report_scope=_report_scope(result), no_report=result.routing is None and "without a report" in str(
            result.mloss_note),
        repo_hint="path/or/repo-id", usage_prompt=json.dumps(" ".join(first_prompt.split())[:80], ensure_ascii=False),
    )


def _expert_row(index: str, spec: Any, ref: Any) -> dict[str, Any]:
    return {"index": index, "name": _cell(ref.name), "revision": ref.revision if ref.repo_id else None,
            "positive": _prompts(spec.positive_prompts), "negative": _prompts(spec.negative_prompts),
            "noise": "-" if spec.noise_scale is None else f"{spec.noise_scale:g}",
            "residual": "-" if spec.residual_scale is None else f"{spec.residual_scale:g}"}


def _prompts(prompts: tuple[str, ...]) -> str:
    if not prompts:
        return "-"
    shown = "; ".join(_cell(p, 60) for p in prompts[:3])
    return shown + (f" (+{len(prompts) - 3} more)" if len(prompts) > 3 else "")


def _cell(text: str, limit: int = 80) -> str:
    """One table cell: one line, ``|`` escaped, cut to ``limit`` characters."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _report_scope(result: MoEResult) -> str | None:
    """Which token positions the routing report and the M-Loss read, when not every one (``None``)."""
    tokens = getattr(result, "report_tokens", None)
    if tokens is None:
        return None
    positions = getattr(result, "report_positions", None)
    counted = f" ({positions[0]} of the prompts' {positions[1]} token positions)" if positions else ""
    return (f"the first {tokens} tokens of each prompt, its BOS included{counted}; the model is causal, so every "
            "value at those positions is what the whole prompt gives there. `build_moe(..., report_positions=None)` "
            "(`hf-mloss moe --report-positions all`) reads every token")


def _routing_section(result: MoEResult) -> dict[str, Any] | None:
    report = result.routing
    if report is None:
        return None
    own, picked, picks = report.own_share(), report.own_picks(), report.picks()
    rows = [{"name": _cell(f"{e}: {label}", 60), "shares": own[e].tolist(), "picked": float(picked[e].mean())}
            for e, label in enumerate(report.experts)]
    prompts = [{"text": _cell(text, 60), "owner": owner, "picks": picks[p].tolist()}
               for p, (text, owner) in enumerate(zip(report.prompts, report.owners))]
    return {"rows": rows, "warnings": report.warnings(), "prompts": prompts[:MAX_PROMPT_ROWS],
            "more": max(0, len(prompts) - MAX_PROMPT_ROWS)}


def _mloss_rows(result: MoEResult, inputs: MoEInputs) -> list[dict[str, Any]] | None:
    if result.mloss is None:
        return None
    labels = [f"{i}: {_cell(spec.label, 50)}" for i, spec in enumerate(result.config.experts)]
    return [{"a": labels[i], "b": labels[j], "value": value,
             "same": inputs.experts[i].path == inputs.experts[j].path} for (i, j), value in result.mloss.items()]
