"""Pictures for model cards (needs matplotlib: ``pip install "hf_mloss[plots]"``); card text never depends on them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .report import MLossReport

HEATMAP_NAME = "mloss_heatmap.png"


def node_position_matrix(report: MLossReport, groups: int = 64) -> torch.Tensor:
    """Node M-Loss per layer (rows) in ``groups`` consecutive bins of node index (columns), in index order.

    Rows keep their position (they are not sorted), so the picture shows where in each layer the loss sits.
    """
    import torch

    rows = []
    for name in report.layers:
        node = report.node[name].float()
        chunks = torch.tensor_split(node, min(groups, node.numel()))
        rows.append(torch.stack([c.mean() for c in chunks]))
    width = min((len(r) for r in rows), default=0)
    return torch.stack([r[:width] for r in rows]) if rows else torch.empty(0, 0)


def draw_heatmap(report: MLossReport, folder: str | Path) -> str | None:
    """Save the layer × node-position M-Loss heatmap into ``folder``; its file name, or ``None`` without matplotlib.

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
    ax.set_xlabel(f"node position (mean over {matrix.shape[1]} consecutive groups of rows)")
    ax.set_title(f"Node M-Loss by layer and node position (prefix={report.prefix}, reduction={report.reduction})\n"
                 "lower: the merge behaves more like the ensemble there", fontsize=10)
    fig.colorbar(image, ax=ax, label="node M-Loss")
    fig.tight_layout()
    import io

    from .saving import write_file

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    write_file(Path(folder) / HEATMAP_NAME, buffer.getvalue(), what="Heatmap file")
    return HEATMAP_NAME
