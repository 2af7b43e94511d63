"""What a merge's stages share: :class:`DriverRun` (what a data-guided method's hooks may ask of the merge driver)
and :func:`unchanged_blocks` (the leading blocks no model changed, which every walk runs once)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..methods import LayerwiseRun

if TYPE_CHECKING:
    from ..loading.inputs import RunInputs
    from .merger import TensorMerger


class DriverRun(LayerwiseRun):
    """The driver's side of a data-guided merge: what :class:`~hf_mloss.methods.LayerHooks` may ask for."""

    def __init__(self, merger: TensorMerger, *, adapter: Any = None, names: Sequence[str] | None = None) -> None:
        """``adapter`` / ``names``: one tower of a whole model (its walking adapter and its tensors); default: the
        run's adapter and every merged tensor."""
        self.merger = merger
        self.ctx, self.device = merger.ctx, merger.device
        self.adapter = adapter if adapter is not None else merger.inputs.adapter
        self.names = list(merger.names if names is None else names)
        self.records: dict[str, dict[str, torch.Tensor]] = {}
        self.stages: dict[int, list[str]] = {}
        for name in self.names:
            self.stages.setdefault(self.adapter.stage_of(name), []).append(name)

    def stage_names(self, stage: int) -> list[str]:
        return list(self.stages.get(stage, []))

    def merge(self, names: list[str]) -> None:
        self.merger.merge(names)

    def merge_remaining(self) -> None:
        self.merger.merge(self.names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.merger.inputs.base.shapes[name])

    def record(self, kind: str, target: str, values: torch.Tensor) -> None:
        self.records.setdefault(kind, {})[target] = values


def unchanged_blocks(inputs: RunInputs, adapter: Any = None, names: Sequence[str] | None = None) -> int:
    """How many leading blocks (after identical embeddings) every source holds exactly as the base: every candidate
    merge shares them too, so their output is computed once. -1 when the embeddings already differ. ``adapter`` /
    ``names``: one tower of a whole model (its walking adapter and its tensors)."""
    from ..adapters import EMBEDDING_STAGE

    adapter = adapter if adapter is not None else inputs.adapter
    by_stage: dict[int, list[str]] = {}
    for name in inputs.names if names is None else names:
        by_stage.setdefault(adapter.stage_of(name), []).append(name)
    for stage in [EMBEDDING_STAGE, *range(adapter.num_layers)]:
        for name in by_stage.get(stage, []):
            base = inputs.base.get(name)
            if any(not torch.equal(s.get(name).to(base.dtype), base) for s in inputs.sources):
                return stage
    return adapter.num_layers
