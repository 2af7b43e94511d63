"""Per-task evaluation with frozen heads, the ensembling baseline, and the method-comparison protocol."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import CLIPVisionModel

from hf_mloss.evaluation import encode, evaluate, evaluate_ensemble
from hf_mloss.suites.compare import MethodSpec, compare_methods, markdown_table


class LinearHead:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return features @ self.weight.T


@dataclass
class FakeSuite:
    base_dir: Path
    finetuned: dict
    heads: dict
    val: dict
    test: dict
    unlabeled: torch.Tensor


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


def test_compare_methods_protocol(tmp_path, tiny_paths):
    base_dir, model_dirs = tiny_paths
    generator = torch.Generator().manual_seed(1)
    tasks = ["a", "b", "c"]
    heads = {t: LinearHead(torch.randn(4, 32, generator=generator)) for t in tasks}
    models = {t: CLIPVisionModel.from_pretrained(d) for t, d in zip(tasks, model_dirs)}

    def split(n):  # labels each fine-tune predicts itself: fine-tuned accuracy is 100 % by construction
        out = {}
        for t in tasks:
            x = torch.randn(n, 3, 32, 32, generator=generator)
            out[t] = (x, _labels_from(models[t], x, heads[t]))
        return out

    suite = FakeSuite(Path(base_dir), dict(zip(tasks, map(Path, model_dirs))), heads, split(12), split(16),
                      torch.randn(40, 3, 32, 32, generator=generator))
    specs = [MethodSpec("task_arithmetic", "task_arithmetic", grid={"lam": [0.2, 1.0]}),
             MethodSpec("m_ties", "m_ties", {"e": 0.1}, {"k": [0.5], "lam": [1.0]}, seeded=True),
             MethodSpec("m_ties (random ranks)", "m_ties", {"e": 0.1, "rank": "random"}, seeded=True,
                        same_as="m_ties")]
    table = compare_methods(suite, specs=specs, seeds=(0, 1), num_samples=16, out_dir=tmp_path, log=lambda *_: None)
    assert table["regime"]["fine-tuned (each on its task)"]["mean"] == 1.0
    rows = {r["label"]: r for r in table["methods"]}
    assert rows["task_arithmetic"]["seeds"] == 1 and rows["m_ties"]["seeds"] == 2
    assert rows["m_ties (random ranks)"]["params"]["k"] == 0.5  # ablation reuses the chosen hyperparameters
    assert (tmp_path / "results.md").read_text().startswith("| method |")
    assert "m_ties (random ranks)" in markdown_table(table)
    card = (tmp_path / "m_ties_merge" / "README.md").read_text()
    assert "model-index" in card and "## Evaluation" in card
