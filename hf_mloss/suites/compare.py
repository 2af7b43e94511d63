"""Compare merge methods on a suite: hyperparameters chosen on validation, accuracy reported on test, over seeds.

The protocol of the M-Loss / TIES papers: every method's hyperparameters are picked on the validation split (seed 0),
then the chosen setting is evaluated on the test split for several seeds of everything random (the scoring sample,
DARE masks, random ranks) and reported as mean ± std. The M-TIES ablations (random ranks, e = 0, few layers) reuse
the hyperparameters chosen for M-TIES, so they isolate the effect of the M-Loss signal itself.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

import hf_mloss

from ..adapters import adapter_for
from ..evaluation import EvalResult, evaluate, evaluate_ensemble

LAMBDAS = [0.3, 0.5, 0.7, 1.0, 1.5]


@dataclass
class MethodSpec:
    label: str
    method: str
    params: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    """Hyperparameters chosen on validation (cartesian product)."""
    seeded: bool = False
    """Whether the result depends on the seed (scoring sample, DARE masks, random ranks)."""
    same_as: str | None = None
    """Reuse the hyperparameters chosen for this label instead of searching (ablations)."""


def default_specs(num_layers: int) -> list[MethodSpec]:
    last_third = list(range(num_layers - max(1, num_layers // 3), num_layers))
    ties_grid = {"k": [0.2, 0.5, 0.8], "lam": LAMBDAS}
    return [
        MethodSpec("average", "average"),
        MethodSpec("task_arithmetic", "task_arithmetic", grid={"lam": [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]}),
        MethodSpec("ties (global)", "ties", {"scope": "global"}, ties_grid),
        MethodSpec("ties (tensor)", "ties", {"scope": "tensor"}, ties_grid),
        MethodSpec("dare_ties", "dare_ties", {}, {"p": [0.5, 0.7, 0.9], "lam": LAMBDAS}, seeded=True),
        MethodSpec("m_ties", "m_ties", {"e": 0.1}, ties_grid, seeded=True),
        MethodSpec(f"m_ties (layers {last_third[0]}-{last_third[-1]})", "m_ties", {"e": 0.1, "layers": last_third},
                   seeded=True, same_as="m_ties"),
        MethodSpec("m_ties (random ranks)", "m_ties", {"e": 0.1, "rank": "random"}, seeded=True, same_as="m_ties"),
        MethodSpec("m_ties (e=0)", "m_ties", {"e": 0.0}, seeded=True, same_as="m_ties"),
    ]


@dataclass
class MethodResult:
    label: str
    method: str
    params: dict[str, Any]
    val_mean: float
    test: list[EvalResult]
    seconds: float

    def summary(self) -> dict[str, Any]:
        means = [r.mean for r in self.test]
        normalized = [r.normalized_mean for r in self.test if r.normalized_mean is not None]
        tasks = self.test[0].accuracy
        return {
            "label": self.label, "method": self.method, "params": self.params, "val_mean": self.val_mean,
            "test_mean": statistics.mean(means), "test_std": statistics.pstdev(means) if len(means) > 1 else 0.0,
            "normalized_mean": statistics.mean(normalized) if normalized else None,
            "per_task": {t: statistics.mean(r.accuracy[t] for r in self.test) for t in tasks},
            "seeds": len(self.test), "seconds": self.seconds,
        }  # fmt: skip


def compare_methods(suite, *, specs: Sequence[MethodSpec] | None = None, seeds: Sequence[int] = (0, 1, 2),
                    num_samples: int = 128, out_dir: str | Path | None = None, progress: bool = True,
                    log=print) -> dict[str, Any]:
    """Run every method on ``suite`` (a :class:`~hf_mloss.suites.tiny.TinySuite`-like object) and tabulate."""
    base_dir = str(suite.base_dir)
    model_dirs = [str(suite.finetuned[t]) for t in suite.finetuned]
    adapter = adapter_for(AutoConfig.from_pretrained(base_dir))
    base = adapter.load_model(base_dir)
    finetuned = {t: adapter.load_model(str(d)) for t, d in suite.finetuned.items()}
    specs = list(specs or default_specs(adapter.num_layers))

    own = {t: evaluate(finetuned[t], {t: suite.test[t]}, suite.heads).accuracy[t] for t in suite.test}
    regime = {
        "pretrained heads": evaluate(base, suite.test, suite.heads, reference=own),
        "fine-tuned (each on its task)": EvalResult(accuracy=own, normalized={t: 1.0 for t in own}),
        "ensemble": evaluate_ensemble(list(finetuned.values()), suite.test, suite.heads, reference=own),
    }
    for label, result in regime.items():
        log(f"{label:<34} test mean {100 * result.mean:6.2f}")

    def scoring_sample(seed: int) -> torch.Tensor:
        order = torch.randperm(len(suite.unlabeled), generator=torch.Generator().manual_seed(seed))
        return suite.unlabeled[order[:num_samples]]

    def run(spec: MethodSpec, params: dict[str, Any], seed: int):
        needs_data = hf_mloss.methods.get_method(spec.method).needs_data
        return hf_mloss.merge(base_dir, model_dirs, spec.method, seed=seed, progress=False,
                              data=scoring_sample(seed) if needs_data else None, num_samples=num_samples,
                              batch_size=64, **{**spec.params, **params}).model

    chosen: dict[str, dict[str, Any]] = {}
    results: list[MethodResult] = []
    best_model = None
    for spec in specs:
        start = time.perf_counter()
        if spec.same_as:
            candidates = [chosen[spec.same_as]]
        else:
            keys = list(spec.grid)
            candidates = [dict(zip(keys, values)) for values in itertools.product(*spec.grid.values())] or [{}]
        scored = []
        for params in candidates:
            val = evaluate(run(spec, params, seeds[0]), suite.val, suite.heads).mean
            scored.append((val, params))
        val_mean, params = max(scored, key=lambda item: item[0])
        chosen[spec.label] = params
        tests = []
        for seed in seeds if spec.seeded else seeds[:1]:
            model = run(spec, params, seed)
            tests.append(evaluate(model, suite.test, suite.heads, reference=own))
            if spec.label == "m_ties" and seed == seeds[0]:
                best_model = (params, tests[-1])
        result = MethodResult(spec.label, spec.method, {**spec.params, **params}, val_mean, tests,
                              time.perf_counter() - start)
        results.append(result)
        s = result.summary()
        log(f"{spec.label:<34} test mean {100 * s['test_mean']:6.2f} ± {100 * s['test_std']:.2f}  "
            f"(val {100 * val_mean:.2f}; {params}; {result.seconds:.1f}s)")

    table = {
        "regime": {k: v.to_dict() for k, v in regime.items()},
        "methods": [r.summary() for r in results],
        "seeds": list(seeds), "num_samples": num_samples, "tasks": list(suite.test),
    }  # fmt: skip
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(table, indent=2) + "\n")
        (out / "results.md").write_text(markdown_table(table) + "\n")
        if best_model is not None:
            params, test = best_model
            spec = next(s for s in specs if s.label == "m_ties")
            result = hf_mloss.merge(base_dir, model_dirs, "m_ties", seed=seeds[0], progress=False,
                                    data=scoring_sample(seeds[0]), num_samples=num_samples, batch_size=64,
                                    **{**spec.params, **params})
            result.eval_results = dict(test.accuracy)
            result.save_pretrained(out / "m_ties_merge", overwrite=True)
    return table


def markdown_table(table: dict[str, Any]) -> str:
    tasks = table["tasks"]
    head = "| method | hyperparameters (chosen on val) | test acc. (mean ± std) | normalized | " + \
        " | ".join(tasks) + " |"
    lines = [head, "|" + "---|" * (4 + len(tasks))]
    for label, r in table["regime"].items():
        norm = f"{100 * r['normalized_mean']:.1f} %" if r["normalized_mean"] is not None else "-"
        cells = " | ".join(f"{100 * r['accuracy'][t]:.1f}" for t in tasks)
        lines.append(f"| {label} | - | {100 * r['mean']:.2f} | {norm} | {cells} |")
    for r in table["methods"]:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items())
        norm = f"{100 * r['normalized_mean']:.1f} %" if r["normalized_mean"] is not None else "-"
        cells = " | ".join(f"{100 * r['per_task'][t]:.1f}" for t in tasks)
        std = f" ± {100 * r['test_std']:.2f}" if r["seeds"] > 1 else ""
        lines.append(f"| {r['label']} | {params} | {100 * r['test_mean']:.2f}{std} | {norm} | {cells} |")
    seeds = table["seeds"]
    lines.append("")
    lines.append(f"Top-1 accuracy (%) on the test splits. Seeded methods (scoring sample, DARE masks, random ranks) "
                 f"are run with seeds {seeds} and reported as mean ± std; M-Loss uses {table['num_samples']} "
                 "unlabeled images. Normalized = accuracy / the fine-tuned model's accuracy on its own task.")
    return "\n".join(lines)
