"""What :func:`~hf_mloss.moe.build.build_moe` returns: :class:`MoEResult`, read by the build and by its model card
(:mod:`hf_mloss.moe.card`), so neither imports the other for it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import MoEConfig
    from .routing import RoutingReport


@dataclass
class MoEResult:
    """What :func:`build_moe` wrote.

    Attributes:
        path: the output folder.
        architecture: ``Mixtral``, ``Qwen2-MoE`` or ``Qwen3-MoE``; ``model_class`` its transformers class.
        config: the recipe as run (Hub models pinned to the commit read); ``hf_mloss_moe.yaml`` in the folder.
        routing: where the built MoE routes each expert's own prompts (``None`` without prompts).
        mloss: each pair of experts' M-Loss on the inputs the MoE gives its experts at the routed tokens
            (``{(i, j): value}``, mean over layers; :class:`~hf_mloss.moe.routing.ExpertPairGaps`), or ``None``
            with ``mloss_note`` saying why it was not measured.
        degenerate_layers: layers whose router rows are nearly dependent (mergekit's warning).
        timings: seconds per stage (``inputs``, ``gates``, ``write``, ``routing`` (the M-Loss with it), ``records``).
        report_tokens: the first tokens of each prompt the routing and the M-Loss read (``None``: every token);
            ``report_positions``: ``(read, in all)`` token positions of the prompts.
    """

    path: Path
    architecture: str
    model_class: str
    config: MoEConfig
    routing: RoutingReport | None
    mloss: dict[tuple[int, int], float] | None
    mloss_note: str | None
    degenerate_layers: list[int] = field(default_factory=list)
    device: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    report_tokens: int | None = None
    report_positions: tuple[int, int] | None = None

    def summary(self) -> str:
        c = self.config
        lines = [f"Built a {self.architecture} ({self.model_class}) of {len(c.experts)} experts, "
                 f"{c.experts_per_token} per token{', one shared' if c.shared_experts else ''}, "
                 f"gate_mode {c.gate_mode}",
                 f"  base:    {_label(c.base_model)}",
                 "  experts: " + ", ".join(f"{i}: {e.label}" for i, e in enumerate(c.experts)),
                 f"  device:  {self.device}"]
        if self.routing is not None:
            lines += ["", self.routing.summary()]
        if self.mloss is not None:
            pairs = ", ".join(f"({i}, {j}) {v:.4g}" for (i, j), v in self.mloss.items())
            lines += ["", f"M-Loss of each expert pair on the prompts (lower merges more like an ensemble): {pairs}"]
        elif self.mloss_note:
            lines += ["", f"M-Loss not measured: {self.mloss_note}"]
        lines += ["", f"Saved to {self.path}"]
        return "\n".join(lines)


def _label(model: str) -> str:
    return Path(model).name if os.path.isabs(model) else model
