"""Paired bootstrap confidence intervals of accuracy differences over test images and fine-tuning seeds.

Two methods evaluated on the same images give per-image correctness ``a`` and ``b`` for every (replicate, task),
a replicate being one independent build of the fine-tunes (one fine-tuning seed). The statistic is the difference
of the mean task accuracy, averaged over replicates. The bootstrap is two-level and paired: each draw resamples the
replicates with replacement, then the images of every (replicate, task) with replacement, with the same indices
for both methods, so image difficulty and fine-tuning luck shared by the two cancel. A difference is a ranking only
when its interval excludes 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

Correct = Mapping[tuple[int, str], np.ndarray]
"""(replicate, task) → bool per test image."""


@dataclass(frozen=True)
class Difference:
    """``a`` − ``b`` in accuracy points: the estimate, its percentile interval and what it supports."""

    mean: float
    low: float
    high: float
    per_replicate: tuple[float, ...]
    level: float = 0.95

    @property
    def verdict(self) -> str:
        if self.low > 0:
            return "higher"
        if self.high < 0:
            return "lower"
        return "not separated"

    def to_dict(self) -> dict:
        return {"mean": self.mean, "low": self.low, "high": self.high, "per_replicate": list(self.per_replicate),
                "level": self.level, "verdict": self.verdict}


def paired_bootstrap(a: Correct, b: Correct, *, draws: int = 2000, level: float = 0.95, seed: int = 0) -> Difference:
    """Paired two-level bootstrap of mean-accuracy(a) − mean-accuracy(b), in points (see the module docstring)."""
    if set(a) != set(b):
        raise ValueError("both methods must be evaluated on the same (replicate, task) pairs")
    replicates = sorted({r for r, _ in a})
    tasks = sorted({t for _, t in a})
    rng = np.random.default_rng(seed)
    # per (replicate, task): the bootstrap distribution of the accuracy difference, [draws]
    table = np.empty((len(replicates), len(tasks), draws))
    point = np.empty((len(replicates), len(tasks)))
    for i, r in enumerate(replicates):
        for j, t in enumerate(tasks):
            diff = a[r, t].astype(np.int8) - b[r, t].astype(np.int8)
            if diff.size == 0:
                raise ValueError(f"no images for replicate {r}, task {t}")
            point[i, j] = diff.mean()
            table[i, j] = diff[rng.integers(0, diff.size, size=(draws, diff.size))].mean(axis=1)
    per_replicate = table.mean(axis=1)  # [replicates, draws]
    picks = rng.integers(0, len(replicates), size=(draws, len(replicates)))
    stats = per_replicate[picks, np.arange(draws)[:, None]].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(stats, [tail, 1 - tail])
    return Difference(mean=100 * float(point.mean()), low=100 * float(low), high=100 * float(high),
                      per_replicate=tuple(100 * float(v) for v in point.mean(axis=1)), level=level)
