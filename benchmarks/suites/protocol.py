"""The comparison protocol: every method tuned on val on its own grid, evaluated on test, per fine-tuning replicate.

A *bench* holds the tasks, their frozen heads, and one or more *replicates* (independent builds of the q
fine-tunes, one per fine-tuning seed). Per replicate the protocol measures

* the reference rows: pretrained heads, each fine-tune on its own task, and the ensembles of the q fine-tunes
  (mean of the heads' probabilities — the M-Loss paper's baseline — and mean of the pooled features);
* disentanglement: each task's accuracy with one foreign task vector added (θ₀ + τ_t + τ_p vs θ₀ + τ_t);
* every method: each setting of its grid merged through :func:`hf_mloss.merge` and scored on val; the best one
  (first in grid order on ties) evaluated on test, where the per-image correctness is kept for paired statistics.

Every method — ablations included — is searched on a grid of the same size (winner's curse: an ablation that
reuses the setting chosen for the method it controls is handicapped). Methods that use data (M-TIES) get the
same unlabeled images in every setting, drawn per replicate.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

import hf_mloss

from benchmarks.suites.training import progress
from hf_mloss.merging.evaluation import ensemble_scores

State = dict[str, torch.Tensor]
SPLITS = ("val", "test")


class Head(Protocol):
    def logits(self, features: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Replicate:
    """One build of the fine-tunes: ``finetuned[task]`` is a ``save_pretrained`` folder."""

    seed: int
    finetuned: dict[str, Path]


class Bench(Protocol):
    tasks: list[str]
    heads: Mapping[str, Head]
    base_dir: Path
    replicates: list[Replicate]

    def labels(self, split: str) -> dict[str, torch.Tensor]: ...

    def features(self, state: State, split: str, tasks: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Pooled features of the model whose evaluated weights are ``state``, per task."""

    def state_of(self, model) -> State:
        """The weights :meth:`features` needs, read out of a full model (checks what the bench assumes)."""

    def load_state(self, folder: Path) -> State: ...

    def scoring_data(self, seed: int) -> torch.Tensor:
        """Unlabeled pixel values for data-guided methods (the same for every setting of one replicate)."""


@dataclass
class MethodSpec:
    label: str
    method: str
    params: dict[str, Any] = field(default_factory=dict)
    """Fixed parameters."""
    grid: dict[str, list[Any]] = field(default_factory=dict)
    """Tuned on val: the cartesian product, in this order."""
    seed_offset: int = 0
    """Added to the replicate's seed for the merge (one draw of a random control per offset)."""

    def settings(self) -> list[dict[str, Any]]:
        keys = list(self.grid)
        return [dict(zip(keys, values)) for values in itertools.product(*self.grid.values())] or [{}]


def check_grids(specs: Sequence[MethodSpec]) -> int:
    """All tuned methods must search the same number of settings; returns it."""
    sizes = {s.label: len(s.settings()) for s in specs if s.grid}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"unequal grid sizes (each method must be tuned on as many settings): {sizes}")
    return next(iter(sizes.values()), 1)


def accuracy(scores: torch.Tensor, labels: torch.Tensor) -> float:
    return (scores.argmax(-1) == labels).float().mean().item()


def correct(scores: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    return (scores.argmax(-1) == labels).numpy()


def combine(states: Sequence[State], weights: Sequence[float]) -> State:
    """Σ w_i · state_i, key by key (task-vector arithmetic on states)."""
    return {k: sum(w * s[k] for s, w in zip(states, weights)) for k in states[0]}


@dataclass
class ReplicateResult:
    """Everything measured on one replicate (accuracies are fractions; correctness is per test image)."""

    seed: int
    reference: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """label → split → task → accuracy."""
    foreign: dict[str, float] = field(default_factory=dict)
    """'task+foreign' → val accuracy change (fraction) from adding the foreign task vector."""
    methods: dict[str, dict[str, Any]] = field(default_factory=dict)
    """label → {chosen, val_grid, val, test, merge_seconds, eval_seconds}."""
    correct: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    """label → task → bool per test image (reference rows and methods)."""
    trim: dict[str, float] = field(default_factory=dict)
    """TIES label → fraction of the entries the fine-tunes changed that its chosen trim keeps (mean over tasks)."""


def reference_rows(bench: Bench, pretrained: dict[str, dict[str, torch.Tensor]], tuned: dict[str, State],
                   out: ReplicateResult) -> None:
    """Pretrained heads (``pretrained``: split → task → scores, the same for every replicate), each fine-tune on its
    own task, and both ensembles, on val and test."""
    for split in SPLITS:
        labels = bench.labels(split)
        member = {p: bench.features(state, split)  # q full passes
                  for p, state in progress(tuned.items(), f"fine-tunes on {split}", total=len(tuned))}
        rows = {
            "pretrained heads": pretrained[split],
            "fine-tuned (own task)": {t: bench.heads[t].logits(member[t][t]) for t in bench.tasks},
            "ensemble (probabilities)": {t: ensemble_scores([member[p][t] for p in tuned], bench.heads[t],
                                                            "probabilities") for t in bench.tasks},
            "ensemble (features)": {t: ensemble_scores([member[p][t] for p in tuned], bench.heads[t], "features")
                                    for t in bench.tasks},
        }
        for label, scores in rows.items():
            out.reference.setdefault(label, {})[split] = {t: accuracy(s, labels[t]) for t, s in scores.items()}
            if split == "test":
                out.correct[label] = {t: correct(s, labels[t]) for t, s in scores.items()}


def foreign_effects(bench: Bench, base: State, tuned: dict[str, State], out: ReplicateResult) -> None:
    """Val accuracy of θ₀ + τ_t + τ_p minus that of θ₀ + τ_t on task t, for every ordered pair t ≠ p."""
    labels = bench.labels("val")
    pairs = [(t, p) for t in bench.tasks for p in bench.tasks if p != t]
    for t, p in progress(pairs, "foreign task vectors"):
        own = out.reference["fine-tuned (own task)"]["val"][t]
        state = combine([tuned[t], tuned[p], base], [1.0, 1.0, -1.0])
        scores = bench.heads[t].logits(bench.features(state, "val", [t])[t])
        out.foreign[f"{t}+{p}"] = accuracy(scores, labels[t]) - own


def evaluate_state(bench: Bench, state: State, split: str) -> dict[str, torch.Tensor]:
    return {t: bench.heads[t].logits(f) for t, f in bench.features(state, split).items()}


def run_method(bench: Bench, replicate: Replicate, spec: MethodSpec, out: ReplicateResult, *,
               num_samples: int, log: Callable[[str], None]) -> None:
    """Tune ``spec`` on val (every setting of its grid), then evaluate the chosen setting on test."""
    needs_data = hf_mloss.methods.get_method(spec.method).needs_data
    data = bench.scoring_data(replicate.seed) if needs_data else None
    models = [str(replicate.finetuned[t]) for t in bench.tasks]
    labels = {split: bench.labels(split) for split in SPLITS}
    merge_s = eval_s = 0.0
    best = None
    grid = []
    settings = spec.settings()
    for setting in progress(settings, f"{spec.label} ({len(settings)} settings)",
                            enabled=len(settings) > 1 and getattr(log, "enabled", True)):
        start = time.perf_counter()
        merged = hf_mloss.merge(str(bench.base_dir), models, spec.method, seed=replicate.seed + spec.seed_offset,
                                progress=False, data=data, num_samples=num_samples, batch_size=64, **spec.params,
                                **setting)
        total = sum(v.numel() for v in merged.model.state_dict().values() if v.is_floating_point())
        state = bench.state_of(merged.model)
        merge_s += time.perf_counter() - start
        start = time.perf_counter()
        val = {t: accuracy(s, labels["val"][t]) for t, s in evaluate_state(bench, state, "val").items()}
        eval_s += time.perf_counter() - start
        mean = float(np.mean(list(val.values())))
        grid.append({"setting": setting, "val_mean": mean})
        if best is None or mean > best[0]:
            best = (mean, setting, val, state)
    mean, setting, val, state = best
    start = time.perf_counter()
    test_scores = evaluate_state(bench, state, "test")
    eval_s += time.perf_counter() - start
    out.methods[spec.label] = {
        "method": spec.method, "params": {**spec.params, **setting}, "chosen": setting, "val_grid": grid,
        "val": val, "test": {t: accuracy(s, labels["test"][t]) for t, s in test_scores.items()},
        "merge_seconds": round(merge_s, 1), "eval_seconds": round(eval_s, 1), "total_numel": total,
    }  # fmt: skip
    out.correct[spec.label] = {t: correct(s, labels["test"][t]) for t, s in test_scores.items()}
    test_mean = 100 * np.mean(list(out.methods[spec.label]["test"].values()))
    log(f"  {spec.label:<28} val {100 * mean:6.2f}  test {test_mean:6.2f}  {setting}  "
        f"(merge {merge_s:.0f} s, eval {eval_s:.0f} s)")


def pretrained_scores(bench: Bench) -> dict[str, dict[str, torch.Tensor]]:
    """The base model's scores under every task's head: split → task → scores (shared by all replicates)."""
    base = bench.load_state(bench.base_dir)
    return {split: evaluate_state(bench, base, split) for split in progress(SPLITS, "pretrained heads")}


def run_replicate(bench: Bench, replicate: Replicate, specs: Sequence[MethodSpec], *, num_samples: int = 128,
                  pretrained: dict[str, dict[str, torch.Tensor]] | None = None,
                  log: Callable[[str], None] = print) -> ReplicateResult:
    """The whole protocol on one replicate (see the module docstring); ``pretrained``: :func:`pretrained_scores`,
    computed here when not given."""
    out = ReplicateResult(seed=replicate.seed)
    base = bench.load_state(bench.base_dir)
    tuned = {t: bench.load_state(replicate.finetuned[t]) for t in bench.tasks}
    start = time.perf_counter()
    log(f"replicate {replicate.seed}: the fine-tunes, their ensembles and foreign task vectors on val and test")
    reference_rows(bench, pretrained or pretrained_scores(bench), tuned, out)
    foreign_effects(bench, base, tuned, out)
    means = {label: 100 * np.mean(list(r["val"].values())) for label, r in out.reference.items()}
    log(f"replicate {replicate.seed}: " + ", ".join(f"{k} {v:.2f}" for k, v in means.items())
        + f" (val; {time.perf_counter() - start:.0f} s)")
    for spec in specs:
        run_method(bench, replicate, spec, out, num_samples=num_samples, log=log)
        if spec.method == "ties":
            chosen = out.methods[spec.label]["params"]
            out.trim[spec.label] = kept_changed_fraction(base, tuned, chosen.get("k", 0.2),
                                                         chosen.get("budget", "all"),
                                                         out.methods[spec.label]["total_numel"])
            log(f"  {spec.label}: keeps {100 * out.trim[spec.label]:.1f} % of the entries the fine-tunes changed")
    return out


def kept_changed_fraction(base: State, tuned: Mapping[str, State], k: float, budget: str, total: int) -> float:
    """The fraction of the entries each fine-tune changed (τ ≠ 0) that a global TIES trim at ``k`` keeps, mean over
    the fine-tunes: it keeps floor(k·N) of the largest |τ|, N the model's ``total`` entries (``budget="all"``) or the
    c changed ones (``"changed"``), so min(c, floor(k·N)) / c (exact up to equal magnitudes at the threshold).
    ``base`` and ``tuned`` may hold only the trained part: every entry outside it is unchanged."""
    fractions = []
    for state in tuned.values():
        changed = sum(int(torch.count_nonzero(state[key] - base[key])) for key in state)
        budget_n = total if budget == "all" else changed
        fractions.append(min(changed, int(budget_n * k)) / changed if changed else 0.0)
    return float(np.mean(fractions))
