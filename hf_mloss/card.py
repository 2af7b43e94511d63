"""The model card of a merged model, rendered with ``huggingface_hub.ModelCard`` from a packaged Jinja template."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

if TYPE_CHECKING:
    from .result import MergeResult

HEATMAP_NAME = "mloss_heatmap.png"
TEMPLATE = "modelcard_template.md"


def card_data(result: MergeResult) -> ModelCardData:
    """YAML metadata: Hub ids only in ``base_model`` (local paths never leak), merge relation, tags, eval results."""
    hub_ids = [ref.repo_id for ref in [result.base, *result.models] if ref.repo_id]
    meta = result.adapter.card_metadata()
    datasets = [result.data["id"]] if result.data and result.data.get("source") == "hub" else None
    eval_results = [
        EvalResult(task_type="image-classification", dataset_type=task, dataset_name=task, metric_type="accuracy",
                   metric_value=float(value))
        for task, value in result.eval_results.items()
    ] or None
    return ModelCardData(
        base_model=hub_ids or None,
        base_model_relation="merge",
        library_name=meta["library_name"],
        pipeline_tag=meta["pipeline_tag"],
        tags=["merge", "model-merging", "hf_mloss", result.method],
        datasets=datasets,
        eval_results=eval_results,
        model_name=f"{result.method} merge" if eval_results else None,
    )


def build_model_card(result: MergeResult, folder: str | Path | None = None) -> ModelCard:
    """Render the card; with ``folder`` (and matplotlib installed) also draw the M-Loss heatmap into it."""
    heatmap = None
    if folder is not None and result.report is not None:
        heatmap = draw_heatmap(result.report, Path(folder) / HEATMAP_NAME)
    report = result.report
    rows = report.summary_rows() if report is not None else []
    template = resources.files("hf_mloss").joinpath("templates", TEMPLATE).read_text(encoding="utf-8")
    title = f"{result.base.name} — {result.method} merge of {len(result.models)} models"
    return ModelCard.from_template(
        card_data(result),
        template_str=template,
        title=title,
        num_models=len(result.models),
        architecture=result.model.__class__.__name__,
        model_class=result.model.__class__.__name__,
        method=result.method,
        method_pretty=_method_attr(result.method, "pretty_name", result.method),
        method_reference=_method_attr(result.method, "reference", ""),
        method_url=_method_attr(result.method, "reference_url", ""),
        method_description=result.method_description,
        base_name=result.base.name,
        base_revision=result.base.revision,
        models=[{"name": r.name, "revision": r.revision, "weight": w} for r, w in zip(result.models, result.weights)],
        parameters={k: v for k, v in result.params.items() if v is not None},
        seed=result.seed,
        dtype=result.dtype,
        data=result.data,
        eval_rows=[{"task": t, "value": v} for t, v in result.eval_results.items()],
        report=report,
        mloss_rows=rows,
        has_keep=any("keep_mean" in r for r in rows),
        heatmap=heatmap,
        repo_hint="path/or/repo-id",
    )


def _method_attr(name: str, attr: str, default: Any) -> Any:
    from .methods import MERGE_METHODS

    method = MERGE_METHODS.get(name)
    return getattr(method, attr, default) if method is not None else default


def node_group_matrix(report, groups: int = 32):
    """Mean node M-Loss in ``groups`` equal groups of rows (sorted by value), one row per layer (as the paper's
    heatmap)."""
    import torch

    rows = []
    for name in report.layers:
        node = report.node[name].float().sort().values
        chunks = torch.tensor_split(node, min(groups, node.numel()))
        rows.append(torch.stack([c.mean() for c in chunks]))
    return torch.stack(rows) if rows else torch.empty(0, 0)


def draw_heatmap(report, path: Path) -> str | None:
    """Save the node-group M-Loss heatmap as PNG; ``None`` (no picture) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    matrix = node_group_matrix(report).numpy()
    if matrix.size == 0:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(matrix) + 1.5))
    image = ax.imshow(matrix, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(matrix)), [n.replace(".mlp.fc1", "") for n in report.layers], fontsize=7)
    ax.set_xlabel("node group (rows sorted by M-Loss)")
    ax.set_title(f"Node M-Loss per layer (prefix={report.prefix}, reduction={report.reduction})")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path.name
