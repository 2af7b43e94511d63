"""Per-task evaluation with frozen heads and the ensembling baseline."""

from __future__ import annotations

import torch
from transformers import CLIPVisionModel

from hf_mloss.merging.evaluation import encode, evaluate, evaluate_ensemble


class LinearHead:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return features @ self.weight.T


def _labels_from(model, pixels, head):
    return head.logits(encode(model, pixels)).argmax(-1)


def test_accuracy_and_ensemble(tiny_paths):
    base_dir, model_dirs = tiny_paths
    models = [CLIPVisionModel.from_pretrained(d) for d in model_dirs]
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(20, 3, 32, 32, generator=generator)
    head = LinearHead(torch.randn(3, 32, generator=generator))
    labels = _labels_from(models[0], pixels, head)
    flipped = labels.clone()
    flipped[:5] = (flipped[:5] + 1) % 3
    result = evaluate(models[0], {"t": (pixels, flipped)}, {"t": head}, reference={"t": 0.5})
    assert result.accuracy["t"] == 0.75 and result.normalized["t"] == 1.5 and result.mean == 0.75
    # the ensemble of q copies of one model is that model
    same = evaluate_ensemble([models[0]] * 3, {"t": (pixels, flipped)}, {"t": head})
    assert same.accuracy["t"] == 0.75
    # combine="features" averages features: labels taken from the mean feature are 100% correct
    mean_features = torch.stack([encode(m, pixels) for m in models]).mean(0)
    ensemble_labels = head.logits(mean_features).argmax(-1)
    assert evaluate_ensemble(models, {"t": (pixels, ensemble_labels)}, {"t": head},
                             combine="features").accuracy["t"] == 1.0
    # the default (the paper's ensemble) averages each model's probabilities
    mean_probabilities = torch.stack([head.logits(encode(m, pixels)).softmax(-1) for m in models]).mean(0)
    assert evaluate_ensemble(models, {"t": (pixels, mean_probabilities.argmax(-1))}, {"t": head}).accuracy["t"] == 1.0
