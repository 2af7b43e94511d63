"""Evaluate merged encoders per task with frozen task heads, and the ensembling baseline.

A *task* is ``(pixel_values, labels)``; a *head* is any object with ``logits(features)`` applied to the encoder's
pooled feature (``model(pixel_values).pooler_output``), frozen while the encoder was fine-tuned, as in task-vector
work. The ensembling baseline costs q forward passes, which is what merging tries to avoid; two ways to combine:

* ``"probabilities"`` (the M-Loss paper's ensemble): the mean over the q models of the softmax of each task's head;
* ``"features"``: the mean of the q pooled features, then each task's head.
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


ENSEMBLE_COMBINES = ("probabilities", "features")


def ensemble_scores(features: Sequence[torch.Tensor], head: Head, combine: str = "probabilities") -> torch.Tensor:
    """Class scores of an ensemble from each member's pooled features ``[N, D]`` (argmax = its prediction)."""
    if combine == "probabilities":
        return torch.stack([head.logits(f).softmax(-1) for f in features]).mean(0)
    if combine == "features":
        return head.logits(torch.stack(list(features)).mean(0))
    raise ValueError(f"combine={combine!r}: expected one of {ENSEMBLE_COMBINES}")


def evaluate_ensemble(models: Sequence[PreTrainedModel], tasks: Mapping[str, Task], heads: Mapping[str, Head], *,
                      combine: str = "probabilities", reference: Mapping[str, float] | None = None,
                      batch_size: int = 256) -> EvalResult:
    """The ensembling baseline: the q encoders' predictions combined by ``combine`` (see the module docstring)."""
    accuracy = {}
    for name, (x, y) in tasks.items():
        scores = ensemble_scores([encode(m, x, batch_size=batch_size) for m in models], heads[name], combine)
        accuracy[name] = (scores.argmax(-1) == y).float().mean().item()
    return _with_normalized(accuracy, reference)


def _with_normalized(accuracy: dict[str, float], reference: Mapping[str, float] | None) -> EvalResult:
    normalized = {t: a / reference[t] for t, a in accuracy.items() if reference and reference.get(t)}
    return EvalResult(accuracy=accuracy, normalized=normalized)
