"""Pictures for model cards (needs matplotlib: ``pip install "hf_mloss[plots]"``); card text never depends on them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .report import MLossReport

HEATMAP_NAME = "mloss_heatmap.png"


def node_position_matrix(report: MLossReport, groups: int = 64) -> torch.Tensor:
    """Node M-Loss per layer (rows), each layer's nodes sorted from highest to lowest and averaged in ``groups``
    bins of equal size (columns: node percentile).

    The rows of an MLP layer have no order (any permutation of them is the same network), so the picture shows how
    the loss is spread over each layer's nodes — concentrated in a few or even — not where the nodes sit.
    """
    import torch

    rows = []
    for name in report.layers:
        node = report.node[name].float()
        if name in report.parts:  # an MoE block: the nodes of experts no token reached (NaN) are not drawn
            node = node[~node.isnan()]
        node = node.sort(descending=True).values
        chunks = torch.tensor_split(node, min(groups, node.numel()))
        rows.append(torch.stack([c.mean() for c in chunks]))
    width = min((len(r) for r in rows), default=0)
    return torch.stack([r[:width] for r in rows]) if rows else torch.empty(0, 0)


def distinct_labels(values: Sequence[float], *, least: int = 2, most: int = 6) -> list[str]:
    """``values`` with the fewest significant digits (``least``..``most``) that keep different values different, so
    two cells of different colours never carry the same label."""
    finite = [v for v in values if v == v]
    for digits in range(least, most + 1):
        labels = [f"{v:.{digits}g}" for v in values]
        if len({f"{v:.{digits}g}" for v in finite}) == len(set(finite)):
            return labels
    return [f"{v:.{most}g}" for v in values]


def draw_heatmap(report: MLossReport, folder: str | Path) -> str | None:
    """Save the layer × sorted-node M-Loss heatmap into ``folder``; its file name, or ``None`` without matplotlib.

    Drawn with matplotlib's object API and its Agg canvas, without ``pyplot``: no global figure state and no
    backend switch in the caller's process, and fewer modules to import in a merge process.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    matrix = node_position_matrix(report).numpy()
    if matrix.size == 0:
        return None
    fig = Figure(figsize=(8, 0.35 * len(matrix) + 1.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(matrix, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(matrix)), [n.replace(".mlp.fc1", "") for n in report.layers], fontsize=7)
    nodes = min(report.node[name].numel() for name in report.layers)
    ax.set_xlabel("nodes sorted by M-Loss, highest first (one column per node)" if matrix.shape[1] == nodes else
                  f"nodes sorted by M-Loss, highest first ({matrix.shape[1]} bins of {nodes // matrix.shape[1]}+ "
                  "nodes: node percentile)")
    ax.set_xticks([])
    ax.set_title(f"Node M-Loss of each layer, sorted (prefix={report.prefix}, q={len(report.models)}, "
                 f"reduction={report.reduction})\nlower: the merge behaves more like the ensemble there", fontsize=10)
    fig.colorbar(image, ax=ax, label="node M-Loss")
    fig.tight_layout()
    import io

    from ..saving import write_file

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    write_file(Path(folder) / HEATMAP_NAME, buffer.getvalue(), what="Heatmap file")
    return HEATMAP_NAME
