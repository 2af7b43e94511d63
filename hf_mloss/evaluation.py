"""Evaluate merged encoders per task with frozen task heads, and the ensembling baseline.

A *task* is ``(pixel_values, labels)``; a *head* is any object with ``logits(features)`` applied to the encoder's
pooled feature (``model(pixel_values).pooler_output``), frozen while the encoder was fine-tuned, as in task-vector
work. Ensembling averages the q fine-tuned encoders' pooled features, then applies each task's head: it costs q
forward passes, which is what merging tries to avoid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

Task = tuple[torch.Tensor, torch.Tensor]


class Head(Protocol):
    def logits(self, features: torch.Tensor) -> torch.Tensor: ...


@dataclass
class EvalResult:
    """Top-1 accuracy per task and their unweighted mean (fractions in [0, 1])."""

    accuracy: dict[str, float]
    normalized: dict[str, float] = field(default_factory=dict)
    """Accuracy divided by the task's fine-tuned accuracy, when given."""

    @property
    def mean(self) -> float:
        return sum(self.accuracy.values()) / max(len(self.accuracy), 1)

    @property
    def normalized_mean(self) -> float | None:
        return sum(self.normalized.values()) / len(self.normalized) if self.normalized else None

    def to_dict(self) -> dict:
        return {"accuracy": self.accuracy, "mean": self.mean, "normalized": self.normalized,
                "normalized_mean": self.normalized_mean}


@torch.inference_mode()
def encode(model: PreTrainedModel, pixels: torch.Tensor, *, batch_size: int = 256) -> torch.Tensor:
    """Pooled features of ``pixels`` (float32, on the model's device, returned on CPU)."""
    model.eval()
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    chunks = [model(pixel_values=b.to(device, dtype)).pooler_output.float().cpu() for b in pixels.split(batch_size)]
    return torch.cat(chunks)


def _accuracy(head: Head, features: torch.Tensor, labels: torch.Tensor) -> float:
    return (head.logits(features).argmax(-1) == labels).float().mean().item()


def evaluate(model: PreTrainedModel, tasks: Mapping[str, Task], heads: Mapping[str, Head], *,
             reference: Mapping[str, float] | None = None, batch_size: int = 256) -> EvalResult:
    """Top-1 accuracy of one encoder on every task with that task's head."""
    accuracy = {name: _accuracy(heads[name], encode(model, x, batch_size=batch_size), y)
                for name, (x, y) in tasks.items()}
    return _with_normalized(accuracy, reference)


def evaluate_ensemble(models: Sequence[PreTrainedModel], tasks: Mapping[str, Task], heads: Mapping[str, Head], *,
                      reference: Mapping[str, float] | None = None, batch_size: int = 256) -> EvalResult:
    """The ensembling baseline: mean of the q encoders' pooled features, then each task's head."""
    accuracy = {}
    for name, (x, y) in tasks.items():
        features = torch.stack([encode(m, x, batch_size=batch_size) for m in models]).mean(0)
        accuracy[name] = _accuracy(heads[name], features, y)
    return _with_normalized(accuracy, reference)


def _with_normalized(accuracy: dict[str, float], reference: Mapping[str, float] | None) -> EvalResult:
    normalized = {t: a / reference[t] for t, a in accuracy.items() if reference and reference.get(t)}
    return EvalResult(accuracy=accuracy, normalized=normalized)
