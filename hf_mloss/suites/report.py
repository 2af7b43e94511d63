"""The results table: gates first, then (only if every gate passes) paired comparisons and the ordering verdict.

Markdown for people, JSON (same numbers, plus per-replicate details) for programs. Accuracies are in points:
means over replicates of unweighted task means.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .gates import Gate
from .protocol import ReplicateResult
from .stats import Difference, paired_bootstrap

REFERENCE = ("pretrained heads", "fine-tuned (own task)", "ensemble (probabilities)", "ensemble (features)")
ORDER = ("average", "task_arithmetic", "ties", "ensemble (probabilities)", "fine-tuned (own task)")
"""The CLIP merging literature's ordering (ViT-B/32, 8 tasks), lowest first."""


def test_correct(results: Sequence[ReplicateResult], label: str) -> dict[tuple[int, str], np.ndarray]:
    return {(r.seed, t): c for r in results for t, c in r.correct[label].items()}


def split_mean(results: Sequence[ReplicateResult], label: str, split: str) -> float:
    rows = [r.reference[label][split] if label in r.reference else r.methods[label][split] for r in results]
    return 100 * float(np.mean([np.mean(list(row.values())) for row in rows]))


def task_means(results: Sequence[ReplicateResult], label: str, split: str) -> dict[str, float]:
    rows = [r.reference[label][split] if label in r.reference else r.methods[label][split] for r in results]
    return {t: 100 * float(np.mean([row[t] for row in rows])) for t in rows[0]}


def comparisons(results: Sequence[ReplicateResult], pairs: Sequence[tuple[str, str]], *, draws: int = 2000
                ) -> dict[tuple[str, str], Difference]:
    return {(a, b): paired_bootstrap(test_correct(results, a), test_correct(results, b), draws=draws, seed=i)
            for i, (a, b) in enumerate(pairs)}


def default_pairs(labels: Sequence[str]) -> list[tuple[str, str]]:
    """Each method vs TIES, M-TIES vs each of its controls, and the adjacent pairs of the literature's ordering."""
    methods = [m for m in labels if m not in REFERENCE]
    pairs = [(m, "ties") for m in methods if m != "ties" and "ties" in methods]
    pairs += [("m_ties", m) for m in methods if m.startswith("m_ties (")]
    pairs += [(hi, lo) for lo, hi in itertools.pairwise(ORDER) if {lo, hi} <= set(labels)]
    return list(dict.fromkeys(pairs))


def ordering_verdict(diffs: dict[tuple[str, str], Difference]) -> list[str]:
    """One line per adjacent pair of :data:`ORDER`: whether the higher one is above, by its paired interval."""
    lines = []
    for lo, hi in itertools.pairwise(ORDER):
        d = diffs.get((hi, lo))
        if d is None:
            continue
        holds = {"higher": "holds", "lower": "reversed", "not separated": "not separated"}[d.verdict]
        lines.append(f"{lo} < {hi}: {holds} ({hi} − {lo} = {d.mean:+.2f}, 95 % CI [{d.low:+.2f}, {d.high:+.2f}])")
    return lines


def _params(results: Sequence[ReplicateResult], label: str) -> str:
    chosen = [r.methods[label]["chosen"] for r in results]
    text = [", ".join(f"{k}={v}" for k, v in c.items()) or "-" for c in chosen]
    return text[0] if len(set(text)) == 1 else " / ".join(text)


def markdown(results: Sequence[ReplicateResult], gates: Sequence[Gate], diffs: dict[tuple[str, str], Difference],
             header: Sequence[str] = ()) -> str:
    tasks = list(results[0].reference["pretrained heads"]["test"])
    lines = [*header, "## Gates (val)", ""]
    lines += [f"- {g.line()}" for g in gates]
    passed = all(g.passed for g in gates)
    verdict = ("All gates pass: the differences below may be read as rankings where their interval excludes 0."
               if passed else "**A gate fails: this suite ranks nothing.** The numbers below are measurements only.")
    lines += ["", verdict, ""]
    columns = "| row | chosen on val (per replicate) | val | test | " + " | ".join(tasks) + " |"
    lines += ["## Accuracy (%)", "", columns,
              "|" + "---|" * (4 + len(tasks))]
    labels = [*REFERENCE, *results[0].methods]
    for label in labels:
        params = "-" if label in REFERENCE else _params(results, label)
        cells = " | ".join(f"{v:.1f}" for v in task_means(results, label, "test").values())
        lines.append(f"| {label} | {params} | {split_mean(results, label, 'val'):.2f} | "
                     f"{split_mean(results, label, 'test'):.2f} | {cells} |")
    seeds = [r.seed for r in results]
    note = (f"Val and test columns: means over {len(results)} fine-tuning replicates (seeds {seeds}) of the "
            "unweighted task mean; task columns are test.")
    lines += ["", note]
    lines += differences_section(diffs, passed)
    return "\n".join(lines) + "\n"


def differences_section(diffs: dict[tuple[str, str], Difference], passed: bool) -> list[str]:
    """The paired differences and the literature's ordering; when a gate fails they are printed as measurements,
    every verdict marked "not ranked"."""
    mark = (lambda v: v) if passed else (lambda v: f"{v} (not ranked)")
    title = ("## Paired differences (test, points; 95 % bootstrap CI over images and replicates)" if passed else
             "## Paired differences, measured only: a gate fails, so none is a ranking (test, points; 95 % CI)")
    lines = ["", title, "", "| difference | mean | 95 % CI | per replicate | verdict |", "|---|---|---|---|---|"]
    for (a, b), d in diffs.items():
        reps = ", ".join(f"{v:+.2f}" for v in d.per_replicate)
        lines.append(f"| {a} − {b} | {d.mean:+.2f} | [{d.low:+.2f}, {d.high:+.2f}] | {reps} | {mark(d.verdict)} |")
    lines += ["", "## The literature's ordering (average < task arithmetic < TIES < ensemble < individual)", ""]
    lines += [f"- {line}" if passed else f"- {line} (not ranked)" for line in ordering_verdict(diffs)]
    return lines


def to_json(results: Sequence[ReplicateResult], gates: Sequence[Gate], diffs: dict[tuple[str, str], Difference],
            extra: dict[str, Any]) -> dict[str, Any]:
    labels = [*REFERENCE, *results[0].methods]
    return {
        **extra,
        "gates": [g.to_dict() for g in gates],
        "all_gates_pass": all(g.passed for g in gates),
        "summary": {label: {"val": split_mean(results, label, "val"), "test": split_mean(results, label, "test"),
                            "test_per_task": task_means(results, label, "test")} for label in labels},
        "differences": [{"a": a, "b": b, **d.to_dict()} for (a, b), d in diffs.items()],
        "ordering": ordering_verdict(diffs),
        "replicates": [{"seed": r.seed, "reference": r.reference, "foreign": r.foreign, "methods": r.methods}
                       for r in results],
    }  # fmt: skip
