"""``MLossReport``: node- and layer-level M-Loss of a set of models, as computed by :mod:`hf_mloss.engine.score`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MLOSS_SUMMARY_NAME = "mloss.json"
PREFIX_MEANING = {
    "own": "each model's own activations feed each layer",
    "base": "the base model's activations feed each layer",
    "merged": "the merged model's activations feed each layer",
}
MLOSS_SCORES_NAME = "mloss_scores.safetensors"


def finite_json(content: Any, what: str, **kwargs: Any) -> str:
    """``json.dumps(content)`` refusing NaN and infinities (they are not JSON and mean the run overflowed)."""
    from ..errors import InvalidParameterError

    try:
        return json.dumps(content, allow_nan=False, **kwargs)
    except ValueError:
        raise InvalidParameterError(f"{what} holds NaN or infinite values: the settings overflowed (very large "
                                    "weights or λ); nothing was written. Use smaller values.") from None


def describe_data(data: dict[str, Any]) -> str:
    """One line about the scoring images or texts: source, split, count, how they were drawn, labels covered."""
    text = f"{data.get('id') or data.get('source')}"
    if data.get("split"):
        text += f" (split {data['split']})"
    if data.get("num_tokens") is not None:  # text: sequences and the tokens in them (padding excluded)
        text += f", {data.get('num_samples')} sequences, {data['num_tokens']} tokens"
    else:
        text += f", {data.get('num_samples')} images"
    if data.get("sampling"):
        text += f", sampled: {data['sampling']}"
    if data.get("labels_covered") is not None:
        of = f" of {data['num_labels']}" if data.get("num_labels") else ""
        text += f", {data['labels_covered']}{of} labels covered"
    return text


_TOWER_LABELS = {"vision_tower": "vision tower", "visual": "vision tower", "language_model": "language model"}


def tower_label(attribute: str) -> str:
    """``text_model`` -> ``text tower``, a vision-language model's ``model.visual`` -> ``vision tower`` and
    ``model.language_model`` -> ``language model`` (how reports and cards name a tower of a whole model)."""
    last = attribute.rpartition(".")[2]
    return _TOWER_LABELS.get(last) or f"{last.removesuffix('_model')} tower"


def part_line(part: dict[str, Any], width: int) -> str:
    """The summary line of one part of an MoE block (an expert, the shared expert)."""
    label = f"  {part['part']}"
    if part["mloss"] is None:
        return f"{label:<{width}} {'-':>11} {'-':>11} {'-':>11}  no token routed to it"
    return (f"{label:<{width}} {part['mloss']:>11.4e} {part['mloss_normalized']:>11.4e} {'':>11}  "
            f"{part['tokens']} tokens, routing weight {part['weight']:.4g}")


def _listed(values: torch.Tensor) -> list[float | None]:
    """A vector as a list, NaN as ``None``."""
    return [None if v != v else v for v in values.tolist()]


@dataclass
class MLossReport:
    """M-Loss of every scored linear (one entry per block), with per-row (node) vectors.

    ``node[name]`` holds the mean over positions of |g_i| (``reduction="abs"``) or g_i² (``"sq"``) for each row i,
    ``node_normalized[name]`` the mean of |g_i| / (|σ(Σα h_i)| + ε); ``layer[name]`` the mean over positions of
    ‖g‖₂ and ``layer_normalized[name]`` of ‖g‖₂ / (‖σ(Σα h)‖₂ + ε). The per-position ratios are heavy-tailed where
    σ(Σα h) ≈ 0, so ``layer_ratio`` / ``node_ratio`` also give the ratio of sums Σ‖g‖₂ / Σ‖σ(Σα h)‖₂ (and
    Σ|g_i| / Σ|σ(Σα h_i)|). ``keep_ratios`` (M-TIES only) holds the row keep ratios the merge used; ``data`` where
    the scoring data came from. The weights α are normalised (α / Σα).
    """

    node: dict[str, torch.Tensor]
    node_normalized: dict[str, torch.Tensor]
    layer: dict[str, float]
    layer_normalized: dict[str, float]
    prefix: str
    reduction: str
    activation: str
    eps: float
    num_samples: int
    num_positions: int
    models: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    keep_ratios: dict[str, torch.Tensor] = field(default_factory=dict)
    compute_dtype: str = "float32"
    layer_ratio: dict[str, float] = field(default_factory=dict)
    node_ratio: dict[str, torch.Tensor] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    device: str = ""
    """Where it was computed (``cpu``, ``cuda:0 (NVIDIA ...)``, ``mps``)."""
    note: str = ""
    """Why no M-Loss was computed (a data-free merge), else empty."""
    towers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """A whole two-tower model (a CLIPModel scored with ``text_data``, or merged whole): how each tower was treated,
    by attribute (``{"text_model": {"status": "no text data, trimmed at k=0.2 (data-free)"}}``; a scored tower
    also has its ``data``, ``num_samples`` and ``num_positions``). Its layers are named as in the whole model."""
    parts: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """MoE blocks (``model.layers.3.mlp``): per part (``experts.0`` ... then ``shared_expert``), its span of the
    layer's node vector (``nodes``: [start, stop]), the tokens routed to it, their routing-weight mass (``weight``)
    and its own ``mloss`` / ``mloss_normalized`` / ``mloss_ratio``; a part no token was routed to has ``tokens`` 0,
    ``status`` "no token routed to it", ``None`` values and NaN node values (never 0). See docs/mloss.md."""

    @classmethod
    def not_computed(cls, method: str, models: list[str], weights: list[float]) -> MLossReport:
        """The report of a merge that measured no M-Loss (a data-free method): no layers, a note saying how to
        measure it, so ``result.report.summary()`` works for every merge."""
        note = (f"No M-Loss was computed: {method} merges without data. To measure how well these {len(models)} "
                "models merge, score them on unlabeled data (images, or texts for text families): "
                "hf_mloss.score(base, models, data=...) or "
                "`hf-mloss score CONFIG.yaml` (with a `data:` section); `score --pairwise` ranks every pair.")
        return cls(node={}, node_normalized={}, layer={}, layer_normalized={}, prefix="", reduction="",
                   activation="", eps=0.0, num_samples=0, num_positions=0, models=list(models),
                   weights=list(weights), note=note)

    @property
    def computed(self) -> bool:
        """Whether M-Loss was measured (``False`` for the report of a data-free merge)."""
        return bool(self.layer)

    @property
    def layers(self) -> list[str]:
        return list(self.layer)

    def summary_rows(self) -> list[dict[str, Any]]:
        """One dict per scored layer: M-Loss, normalized M-Loss, node statistics and keep ratios (if any)."""
        rows = []
        for name in self.layer:
            node = self.node[name]
            if name in self.parts:  # an MoE block: the nodes of experts no token reached are NaN
                node = node[~node.isnan()]
            row = {
                "layer": name,
                "mloss": self.layer[name],
                "mloss_normalized": self.layer_normalized[name],
                "mloss_ratio": self.layer_ratio.get(name),
                "node_mean": float(node.mean()),
                "node_max": float(node.max()),
            }
            if name in self.parts:
                row["parts"] = self.parts[name]
            keep = self.keep_ratios.get(name)
            if keep is not None:
                row.update(keep_mean=float(keep.mean()), keep_min=float(keep.min()), keep_max=float(keep.max()))
            rows.append(row)
        return rows

    def summary(self) -> str:
        """A plain-text table of per-layer M-Loss (and the data it was measured on).

        Example:
            ```python
            >>> print(hf_mloss.score(base, models, data="tanganke/dtd").summary())
            ```
        """
        if not self.computed:
            return self.note or "No M-Loss was computed."
        rows = self.summary_rows()
        has_keep = any("keep_mean" in r for r in rows)
        width = max([34, *(len(r["layer"]) for r in rows)])
        header = f"{'layer':<{width}} {'M-Loss':>11} {'normalized':>11} {'node max':>11}"
        header += f" {'keep mean':>9} {'min':>6} {'max':>6}" if has_keep else ""
        lines = [f"M-Loss of {len(self.models)} models (q={len(self.models)}), prefix={self.prefix}, "
                 f"reduction={self.reduction}, activation={self.activation}, {self.num_samples} samples / "
                 f"{self.num_positions} positions" + (f", on {self.device}" if self.device else ""),
                 f"prefix {self.prefix}: {PREFIX_MEANING.get(self.prefix, self.prefix)}"]
        if self.towers:
            for attribute, tower in self.towers.items():
                data = f"; data: {describe_data(tower['data'])}" if tower.get("data") else ""
                lines.append(f"{tower_label(attribute)}: {tower['status']}{data}")
        elif self.data:
            lines.append(f"data: {describe_data(self.data)}")
        lines.append(self.reading())
        lines += [header, "-" * len(header)]
        for r in rows:
            line = f"{r['layer']:<{width}} {r['mloss']:>11.4e} {r['mloss_normalized']:>11.4e} {r['node_max']:>11.4e}"
            if has_keep and "keep_mean" in r:
                line += f" {r['keep_mean']:>9.4f} {r['keep_min']:>6.3f} {r['keep_max']:>6.3f}"
            lines.append(line)
            lines += [part_line(part, width) for part in r.get("parts", ())]
        return "\n".join(lines)

    def reading(self) -> str:
        """How to read the numbers: what 0 means, the gap relative to the merged activations, what to compare with."""
        ratios = [v for v in self.layer_ratio.values() if v is not None]
        scale = (f" Across layers the gap is {100 * sum(ratios) / len(ratios):.3g} % of the merged activations' "
                 "norm (ratio of sums)." if ratios else "")
        return ("Reading: lower is better; 0 means the merge behaves exactly like the ensemble of the models at that "
                f"layer.{scale} Values grow with q (as 1 − Σα²) and differ between prefixes (own, the default of score, usually reads far higher than "
                "merged on the same models): compare only reports with the same prefix, q and data, e.g. with `hf-mloss score "
                "--pairwise` (median pair).")

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        total = sum(self.layer.values()) / max(len(self.layer), 1)
        return (f"MLossReport(layers={len(self.layer)}, mean_layer_mloss={total:.4g}, prefix={self.prefix!r}, "
                f"reduction={self.reduction!r}, models={len(self.models)}, samples={self.num_samples})")

    def to_dict(self, *, per_row: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prefix": self.prefix, "reduction": self.reduction, "activation": self.activation, "eps": self.eps,
            "num_samples": self.num_samples, "num_positions": self.num_positions, "models": self.models,
            "weights": self.weights, "compute_dtype": self.compute_dtype, "data": self.data, "device": self.device,
            "layers": self.summary_rows(),
        }  # fmt: skip
        if self.towers:
            out["towers"] = self.towers
        if per_row:  # NaN (the nodes of an expert no token reached) as null
            out["node"] = {k: _listed(v) for k, v in self.node.items()}
            out["node_normalized"] = {k: _listed(v) for k, v in self.node_normalized.items()}
            out["node_ratio"] = {k: _listed(v) for k, v in self.node_ratio.items()}
            out["keep_ratios"] = {k: v.tolist() for k, v in self.keep_ratios.items()}
        return out

    def to_json(self, path: str | Path | None = None, *, per_row: bool = False, overwrite: bool = False) -> str:
        """The report as JSON text (``per_row``: with every node's values), also written to ``path`` if given
        (through :func:`hf_mloss.saving.write_file`: atomic, never through a link, ``overwrite`` to replace).

        Raises:
            InvalidParameterError: a value is NaN or infinite (the settings overflow); nothing is written.
        """
        from ..saving import write_file

        text = finite_json(self.to_dict(per_row=per_row), "The M-Loss report", indent=2)
        if path is not None:
            write_file(path, text + "\n", overwrite=overwrite, what="Report file")
        return text

    def save(self, folder: str | Path, *, overwrite: bool = False) -> None:
        """Write the summary JSON (``mloss.json``) and the per-row vectors (``mloss_scores.safetensors``).

        Args:
            folder: an existing folder.

        Example:
            ```python
            >>> report.save("merged")
            >>> MLossReport.load("merged").layers == report.layers
            True
            ```
        """
        from safetensors.torch import save

        from ..saving import write_file

        folder = Path(folder)
        self.to_json(folder / MLOSS_SUMMARY_NAME, overwrite=overwrite)
        tensors = {f"node/{k}": v.float().contiguous() for k, v in self.node.items()}
        tensors.update({f"node_normalized/{k}": v.float().contiguous() for k, v in self.node_normalized.items()})
        tensors.update({f"node_ratio/{k}": v.float().contiguous() for k, v in self.node_ratio.items()})
        tensors.update({f"keep_ratios/{k}": v.float().contiguous() for k, v in self.keep_ratios.items()})
        content = save(tensors, metadata={"format": "pt", "prefix": self.prefix, "reduction": self.reduction})
        write_file(folder / MLOSS_SCORES_NAME, content, overwrite=overwrite, what="Report file")

    @classmethod
    def load(cls, folder: str | Path) -> MLossReport:
        """Read a report written by :meth:`save`."""
        from safetensors.torch import load_file

        folder = Path(folder)
        meta = json.loads((folder / MLOSS_SUMMARY_NAME).read_text())
        tensors = load_file(str(folder / MLOSS_SCORES_NAME))
        def group(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + "/")}
        rows = meta["layers"]
        return cls(
            node=group("node"), node_normalized=group("node_normalized"),
            layer={r["layer"]: r["mloss"] for r in rows},
            layer_normalized={r["layer"]: r["mloss_normalized"] for r in rows},
            prefix=meta["prefix"], reduction=meta["reduction"], activation=meta["activation"], eps=meta["eps"],
            num_samples=meta["num_samples"], num_positions=meta["num_positions"], models=meta["models"],
            weights=meta["weights"], keep_ratios=group("keep_ratios"), compute_dtype=meta.get("compute_dtype", "float32"),
            layer_ratio={r["layer"]: r["mloss_ratio"] for r in rows if r.get("mloss_ratio") is not None},
            node_ratio=group("node_ratio"), data=meta.get("data", {}), device=meta.get("device", ""),
            towers=meta.get("towers", {}), parts={r["layer"]: r["parts"] for r in rows if "parts" in r},
        )  # fmt: skip
