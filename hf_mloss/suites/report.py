"""The results table: gates first, then (only if every gate passes) paired comparisons and the ordering verdict.

Markdown for people, JSON (same numbers, plus per-replicate details) for programs. Accuracies are in points:
means over replicates of unweighted task means.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .gates import Gate
from .protocol import ReplicateResult
from .stats import Difference, paired_bootstrap

REFERENCE = ("pretrained heads", "fine-tuned (own task)", "ensemble (probabilities)", "ensemble (features)")
ORDER = ("average", "task_arithmetic", "ties", "ensemble (probabilities)", "fine-tuned (own task)")
"""The CLIP merging literature's ordering (ViT-B/32, 8 tasks), lowest first."""
SVD_MERGES = ("tsv_m", "iso_c", "iso_cts")
"""Compared with task arithmetic too: their papers report them far above it (and TIES)."""


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
    """Each method vs TIES, M-TIES vs each of its controls, the SVD-based merges vs task arithmetic, and the adjacent
    pairs of the literature's ordering."""
    methods = [m for m in labels if m not in REFERENCE]
    pairs = [(m, "ties") for m in methods if m != "ties" and "ties" in methods]
    pairs += [("m_ties", m) for m in methods if m.startswith("m_ties (")]
    pairs += [(m, "task_arithmetic") for m in SVD_MERGES if {m, "task_arithmetic"} <= set(methods)]
    pairs += [(hi, lo) for lo, hi in itertools.pairwise(ORDER) if {lo, hi} <= set(labels)]
    return list(dict.fromkeys(pairs))


def ordering_verdict(diffs: dict[tuple[str, str], Difference], results: Sequence[ReplicateResult] = ()
                     ) -> list[str]:
    """One line per adjacent pair of :data:`ORDER`: whether the higher one is above, by its paired interval; where
    it is not, and ``results`` are given, the likely reason with the measurements behind it (:func:`why_not`)."""
    lines = []
    for lo, hi in itertools.pairwise(ORDER):
        d = diffs.get((hi, lo))
        if d is None:
            continue
        holds = {"higher": "holds", "lower": "reversed", "not separated": "not separated"}[d.verdict]
        line = f"{lo} < {hi}: {holds} ({hi} − {lo} = {d.mean:+.2f}, 95 % CI [{d.low:+.2f}, {d.high:+.2f}])"
        reason = why_not(lo, hi, results) if d.verdict != "higher" and results else None
        lines.append(f"{line}. Likely why: {reason}" if reason else line)
    return lines


def why_not(lo: str, hi: str, results: Sequence[ReplicateResult]) -> str | None:
    """What the measurements say about a step of the literature's ordering that does not appear (val numbers)."""
    q = len(results[0].reference["pretrained heads"]["val"])
    lams = [r.methods["task_arithmetic"]["chosen"].get("lam") for r in results if "task_arithmetic" in r.methods]
    lam = f"λ {', '.join(f'{v:g}' for v in lams)} vs 1/q = {1 / q:.3g}" if lams else "its λ"
    foreign = 100 * float(np.mean([v for r in results for v in r.foreign.values()]))
    one_foreign = f"adding one foreign task vector changes a task by {foreign:+.2f} points on average, G2"
    if (lo, hi) == ("average", "task_arithmetic"):
        return (f"task arithmetic is the average at λ = 1/q; it chose {lam}, so scaling the task vectors up gains "
                f"little here ({one_foreign}).")
    if (lo, hi) == ("task_arithmetic", "ties"):
        if foreign >= -3:
            return (f"TIES adds trimming and sign election to task arithmetic, to resolve interference between task "
                    f"vectors; {one_foreign}, so there is little interference for them to resolve.")
        return (f"{one_foreign}: the task vectors interfere in function, and TIES's trimming and sign election, "
                "which act on the weights one coordinate at a time, do not resolve it here.")
    if (lo, hi) == ("ties", "ensemble (probabilities)"):
        gap = split_mean(results, "ensemble (probabilities)", "val") - split_mean(results, "average", "val")
        close = (f"the ensemble weighs every member's probabilities by 1/q, and ensemble − average is {gap:+.2f} "
                 "points on val (CLIP ViT-B/32: +12.7)")
        if foreign >= -3:
            return (f"{close}; {one_foreign}. With small, disentangled task vectors the models are nearly linear "
                    f"in their weights, so averaging outputs behaves like averaging weights, while task arithmetic "
                    f"({lam}) and TIES apply the task vectors at a larger scale, which no average of the members' "
                    "outputs can do.")
        return (f"{close}; {one_foreign}, so on each task the q − 1 members fine-tuned elsewhere are as far off as "
                "the merges are, and the ensemble dilutes the one member that knows the task.")
    if (lo, hi) == ("ensemble (probabilities)", "fine-tuned (own task)"):
        return (f"on each task, q − 1 = {q - 1} of the ensemble's members were fine-tuned on other tasks; here they "
                "do not pull it below the member fine-tuned on the task itself.")
    return None


def _params(results: Sequence[ReplicateResult], label: str) -> str:
    chosen = [r.methods[label]["chosen"] for r in results]
    text = [", ".join(f"{k}={v}" for k, v in c.items()) or "-" for c in chosen]
    return text[0] if len(set(text)) == 1 else " / ".join(text)


def grid_edges(results: Sequence[ReplicateResult]) -> list[str]:
    """'label (seed s): name=value' for every chosen setting that sits on the low or high end of a searched
    parameter: the best setting may lie outside the grid, and the method may do better than the table says."""
    edges = []
    for r in results:
        for label, method in r.methods.items():
            for name, value in method["chosen"].items():
                values = {g["setting"][name] for g in method["val_grid"]}
                if len(values) > 1 and value in (min(values), max(values)):
                    end = "low" if value == min(values) else "high"
                    edges.append(f"{label} (seed {r.seed}): {name}={value}, the {end} end of its grid")
    return edges


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
    edges = grid_edges(results)
    if edges:
        lines += ["", "Chosen at an end of the searched grid (the best setting may lie beyond it): "
                  + "; ".join(edges) + "."]
    lines += differences_section(diffs, passed, results)
    return "\n".join(lines) + "\n"


def differences_section(diffs: dict[tuple[str, str], Difference], passed: bool,
                        results: Sequence[ReplicateResult] = ()) -> list[str]:
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
    lines += [f"- {line}" if passed else f"- {line} (not ranked)" for line in ordering_verdict(diffs, results)]
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
        "ordering": ordering_verdict(diffs, results),
        "replicates": [{"seed": r.seed, "reference": r.reference, "foreign": r.foreign, "methods": r.methods}
                       for r in results],
    }  # fmt: skip


def from_json(record: dict[str, Any]) -> tuple[list[ReplicateResult], list[Gate], dict[tuple[str, str], Difference]]:
    """The replicates (without per-image correctness), gates and differences of a results record (:func:`to_json`)."""
    results = [ReplicateResult(seed=r["seed"], reference=r["reference"], foreign=r["foreign"], methods=r["methods"])
               for r in record["replicates"]]
    gates = [Gate(**g) for g in record["gates"]]
    diffs = {(d["a"], d["b"]): Difference(mean=d["mean"], low=d["low"], high=d["high"],
                                          per_replicate=tuple(d["per_replicate"]), level=d["level"])
             for d in record["differences"]}
    return results, gates, diffs


def render(json_path: Path) -> None:
    """Rewrite a results record's Markdown (beside it) and its derived fields with this version of the report, from
    its JSON: no number is recomputed. The header is the record's, or that of the Markdown it replaces."""
    json_path = Path(json_path)
    record = json.loads(json_path.read_text())
    md_path = json_path.with_suffix(".md")
    header = record.get("header") or md_path.read_text().split("## Gates (val)")[0].rstrip("\n").split("\n")
    results, gates, diffs = from_json(record)
    record["header"], record["ordering"] = header, ordering_verdict(diffs, results)
    md_path.write_text(markdown(results, gates, diffs, [*header, ""]))
    json_path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:] or sys.exit("usage: python -m hf_mloss.suites.report RESULTS.json [...]"):
        render(Path(name))
        print(f"rendered {Path(name).with_suffix('.md')}")
