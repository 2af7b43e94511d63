"""Paired differences of accuracy between two methods, with two intervals that answer two questions.

Two methods evaluated on the same test images give per-image correctness ``a`` and ``b`` for every (replicate,
task), a replicate being one independent build of the fine-tunes (one fine-tuning seed). The statistic is the
difference of the mean task accuracy, averaged over replicates, in points.

* **Replicate level** (would another set of fine-tunes give the same sign?): a t interval on the per-replicate
  differences (n − 1 degrees of freedom), Holm-corrected across the comparisons of one family (:func:`holm`): each
  interval is at the level of its Holm step, so it excludes 0 exactly when Holm's procedure rejects.
* **Item level** (would other test items give the same sign, for these fine-tunes?): a paired bootstrap that
  resamples *source items* (a photo region, an emoji, a scanned digit: the images of one item are not independent)
  with replacement, per task, the same draw for every replicate and both methods, so item difficulty shared by the
  two cancels. Images without an item id are each their own item.

A difference is a ranking only when both intervals exclude 0 on the same side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import numpy as np

from benchmarks.suites import registered as R

Correct = Mapping[tuple[int, str], np.ndarray]
"""(replicate, task) → correctness per test image (bool, or a float mean over draws of a control)."""
Items = Mapping[str, np.ndarray]
"""task → int source-item id per test image (the same test images in every replicate)."""


@dataclass(frozen=True)
class Difference:
    """``a`` − ``b`` in accuracy points: the estimate, its item-bootstrap and replicate-t intervals, and the verdict."""

    mean: float
    low: float
    high: float
    """Item-level bootstrap percentile interval at ``level``."""
    per_replicate: tuple[float, ...]
    level: float = 0.95
    t_low: float | None = None
    t_high: float | None = None
    """Replicate-level t interval at ``t_level`` (None with fewer than 2 replicates)."""
    t_level: float | None = None
    p: float | None = None
    """Two-sided one-sample t test of the per-replicate differences; ``p_holm`` after Holm's correction."""
    p_holm: float | None = None
    family: str = ""

    @property
    def verdict(self) -> str:
        t_known = self.t_low is not None and self.t_high is not None
        if self.low > 0 and (not t_known or self.t_low > 0):
            return "higher"
        if self.high < 0 and (not t_known or self.t_high < 0):
            return "lower"
        return "not separated"

    def to_dict(self) -> dict:
        return {**asdict(self), "per_replicate": list(self.per_replicate), "verdict": self.verdict}


def item_bootstrap(a: Correct, b: Correct, items: Items | None = None, *,
                   draws: int = R.BOOTSTRAP_DRAWS, level: float = R.LEVEL, seed: int = 0) -> tuple[float, float, float, tuple[float, ...]]:
    """Mean difference, its item-level bootstrap interval and the per-replicate differences, in points."""
    if set(a) != set(b):
        raise ValueError("both methods must be evaluated on the same (replicate, task) pairs")
    replicates = sorted({r for r, _ in a})
    tasks = sorted({t for _, t in a})
    rng = np.random.default_rng(seed)
    stats = np.zeros(draws)
    point = np.empty((len(replicates), len(tasks)))
    for j, t in enumerate(tasks):
        diff = np.stack([np.asarray(a[r, t], dtype=np.float64) - np.asarray(b[r, t], dtype=np.float64)
                         for r in replicates])  # [replicates, images]
        if diff.shape[1] == 0:
            raise ValueError(f"no images for task {t}")
        ids = np.arange(diff.shape[1]) if items is None or t not in items else np.asarray(items[t])
        if ids.shape != diff.shape[1:]:
            raise ValueError(f"task {t}: {ids.size} item ids for {diff.shape[1]} images")
        _, group = np.unique(ids, return_inverse=True)
        size = np.bincount(group).astype(np.float64)  # [G]
        sums = np.stack([np.bincount(group, weights=d, minlength=len(size)) for d in diff])  # [R, G]
        point[:, j] = sums.sum(1) / size.sum()
        picks = rng.integers(0, len(size), size=(draws, len(size)))
        counts = np.stack([np.bincount(p, minlength=len(size)) for p in picks]).astype(np.float64)  # [draws, G]
        stats += (counts @ sums.T / (counts @ size)[:, None]).mean(1)  # mean over replicates, per draw
    stats /= len(tasks)
    tail = (1 - level) / 2
    low, high = np.quantile(stats, [tail, 1 - tail])
    return (100 * float(point.mean()), 100 * float(low), 100 * float(high),
            tuple(100 * float(v) for v in point.mean(axis=1)))


def replicate_t(per_replicate: tuple[float, ...], level: float) -> tuple[float | None, float | None, float | None]:
    """The t interval at ``level`` and two-sided p of the mean of ``per_replicate`` (None with < 2 of them)."""
    from scipy import stats

    x = np.asarray(per_replicate, dtype=np.float64)
    n = len(x)
    if n < 2:
        return None, None, None
    mean, se = float(x.mean()), float(x.std(ddof=1) / np.sqrt(n))
    if se == 0:
        return mean, mean, (1.0 if mean == 0 else 0.0)
    half = float(stats.t.ppf(1 - (1 - level) / 2, n - 1)) * se
    return mean - half, mean + half, float(2 * stats.t.sf(abs(mean) / se, n - 1))


def paired_difference(a: Correct, b: Correct, items: Items | None = None, *,
                      draws: int = R.BOOTSTRAP_DRAWS, level: float = R.LEVEL, seed: int = 0,
                      family: str = "") -> Difference:
    """:func:`item_bootstrap` and the uncorrected replicate t interval of ``a`` − ``b`` (see :func:`holm`)."""
    mean, low, high, per_replicate = item_bootstrap(a, b, items, draws=draws, level=level, seed=seed)
    t_low, t_high, p = replicate_t(per_replicate, level)
    return Difference(mean, low, high, per_replicate, level, t_low, t_high, level if p is not None else None, p,
                      p, family)


def paired_bootstrap(a: Correct, b: Correct, *, draws: int = 2000, level: float = 0.95, seed: int = 0,
                     items: Items | None = None) -> Difference:
    """:func:`paired_difference` (kept under its earlier name)."""
    return paired_difference(a, b, items, draws=draws, level=level, seed=seed)


def holm(diffs: Mapping, alpha: float = R.HOLM_ALPHA) -> dict:
    """Holm's step-down correction of the replicate t tests within each family of ``diffs`` (key → Difference):
    ``p_holm`` = max over the steps so far of min(1, (m − i)·p₍ᵢ₎), and each t interval recomputed at the level of
    its step, 1 − α/(m − i) (the steps after the first non-rejection keep that step's level), so an interval
    excludes 0 exactly when the corrected test rejects."""
    out = dict(diffs)
    families: dict[str, list] = {}
    for key, d in diffs.items():
        if d.p is not None:
            families.setdefault(d.family, []).append(key)
    for keys in families.values():
        keys = sorted(keys, key=lambda k: diffs[k].p)
        m, running, stopped = len(keys), 0.0, None
        for i, key in enumerate(keys):
            d = diffs[key]
            running = max(running, min(1.0, (m - i) * d.p))
            if stopped is None and running >= alpha:
                stopped = i
            step = i if stopped is None else stopped
            level = 1 - alpha / (m - step)
            t_low, t_high, _ = replicate_t(d.per_replicate, level)
            out[key] = replace(d, t_low=t_low, t_high=t_high, t_level=level, p_holm=running)
    return out
