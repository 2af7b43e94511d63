"""The results table: gates first, then (only if every gate passes) paired comparisons and the ordering verdict.

Markdown for people, JSON (same numbers, plus per-replicate details) for programs. Accuracies are in points:
means over replicates of unweighted task means. Every paired difference carries a replicate-level t interval
(Holm-corrected within its family: the M-Loss claim, M-TIES against its three controls; the other comparisons) and
an item-level bootstrap interval (:mod:`benchmarks.suites.stats`). The grid check says, per method, whether a chosen
setting sits at an end of its grid and how much val accuracy one grid step costs.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.suites import registered as R
from benchmarks.suites.gates import PREMISE_ABSENT, Gate, all_pass
from benchmarks.suites.protocol import TUNED_ENSEMBLE, ReplicateResult, replicates
from benchmarks.suites.stats import Difference, Items, holm, paired_difference

REFERENCE = ("pretrained heads", "fine-tuned (own task)", "ensemble (probabilities)", TUNED_ENSEMBLE,
             "ensemble (features)")
"""The reference rows, in table order (the tuned-scale ensemble only where the protocol tuned it)."""
ORDER = ("average", "task_arithmetic", "ties", "ensemble (probabilities)", "fine-tuned (own task)")
"""The CLIP merging literature's ordering (ViT-B/32, 8 tasks), lowest first; the ensemble step is taken by the
tuned-scale ensemble where there is one (:func:`ordering`)."""
SVD_MERGES = ("tsv_m", "iso_c", "iso_cts")
"""Compared with task arithmetic too: their papers report them far above it (and TIES)."""
RANDOM = "m_ties (random ranks)"
"""The random-ranks control: its draws are rows ``m_ties (random ranks, draw i)``, compared through their mean."""
CONTROLS = (RANDOM, "m_ties (inverted ranks)", "m_ties (budget-matched uniform)")
"""M-TIES's controls: "M-Loss helps" only if M-TIES is above all three, both intervals excluding 0."""
TENSOR = "m_ties (budget-matched tensor)"
"""Per-tensor TIES at M-TIES's budget (``rank="tensor"``): a fourth control where a record measured it (the
registered protocol's, :data:`benchmarks.suites.registered.CONTROLS`); then M-TIES must be above all four."""
CLAIM, OTHERS = "M-Loss claim", "methods"
E0 = "m_ties (e=0)"
"""M-TIES without the spread (per-tensor TIES at k): in the claim's family beside the three controls and TIES."""


def draws_of(labels: Sequence[str], label: str) -> list[str]:
    """The rows that are draws of the pooled control ``label`` (``label`` itself where it is a row)."""
    return [m for m in labels if m.startswith(f"{label[:-1]}, draw ")] if label.endswith(")") else []


def test_correct(results: Sequence[ReplicateResult], label: str) -> dict[tuple[int, str], np.ndarray]:
    """(seed, task) → correctness per test image; a pooled control: the mean over its draws (a float per image)."""
    out = {}
    for r in results:
        rows = [label] if label in r.correct else draws_of(list(r.correct), label)
        if not rows:
            raise KeyError(label)
        for t in r.correct[rows[0]]:
            out[r.seed, t] = np.mean([r.correct[row][t].astype(np.float64) for row in rows], axis=0)
    return out


def split_mean(results: Sequence[ReplicateResult], label: str, split: str) -> float:
    rows = [r.reference[label][split] if label in r.reference else r.methods[label][split] for r in results]
    return 100 * float(np.mean([np.mean(list(row.values())) for row in rows]))


def task_means(results: Sequence[ReplicateResult], label: str, split: str) -> dict[str, float]:
    rows = [r.reference[label][split] if label in r.reference else r.methods[label][split] for r in results]
    return {t: 100 * float(np.mean([row[t] for row in rows])) for t in rows[0]}


def reference_labels(result: ReplicateResult) -> list[str]:
    """The reference rows ``result`` has, in :data:`REFERENCE` order."""
    return [label for label in REFERENCE if label in result.reference]


def ordering(labels: Sequence[str]) -> tuple[str, ...]:
    """:data:`ORDER` with the tuned-scale ensemble in place of the fixed-scale one where ``labels`` hold it."""
    if TUNED_ENSEMBLE not in labels:
        return ORDER
    return tuple(TUNED_ENSEMBLE if label == "ensemble (probabilities)" else label for label in ORDER)


def family_of(a: str, b: str) -> str:
    """The Holm family of a comparison: M-TIES against its three controls, its e = 0 control and TIES (the M-Loss
    claim and what M-TIES is compared with in its paper), or every other comparison."""
    return CLAIM if a == "m_ties" and b in (*CONTROLS, TENSOR, E0, "ties") else OTHERS


def comparisons(results: Sequence[ReplicateResult], pairs: Sequence[tuple[str, str]], *,
                draws: int = R.BOOTSTRAP_DRAWS, items: Items | None = None) -> dict[tuple[str, str], Difference]:
    """Every pair's :func:`~benchmarks.suites.stats.paired_difference` (``items``: task → source item per test
    image), then Holm's correction within each family."""
    diffs = {(a, b): paired_difference(test_correct(results, a), test_correct(results, b), items, draws=draws,
                                       seed=i, family=family_of(a, b))
             for i, (a, b) in enumerate(pairs)}
    return holm(diffs)


def pooled_labels(labels: Sequence[str]) -> list[str]:
    """``labels`` with each control's draws replaced by the pooled control (at the first draw's place)."""
    out = []
    for label in labels:
        pooled = next((c for c in (RANDOM,) if label in draws_of(labels, c)), None)
        out.append(pooled or label)
    return list(dict.fromkeys(out))


def default_pairs(labels: Sequence[str]) -> list[tuple[str, str]]:
    """M-TIES vs each of its controls (the claim), then each method vs TIES, M-TIES vs its other ablations, the
    SVD-based merges vs task arithmetic, and the adjacent pairs of the literature's ordering."""
    methods = [m for m in pooled_labels(labels) if m not in REFERENCE]
    pairs = [("m_ties", c) for c in (*CONTROLS, TENSOR) if {"m_ties", c} <= set(methods)]
    pairs += [(m, "ties") for m in methods if m != "ties" and "ties" in methods]
    pairs += [("m_ties", m) for m in methods if m.startswith("m_ties (")]
    pairs += [(m, "task_arithmetic") for m in SVD_MERGES if {m, "task_arithmetic"} <= set(methods)]
    steps = [(hi, lo) for lo, hi in itertools.pairwise(ordering(labels)) if {lo, hi} <= set(labels)]
    # one test once: where a step of the ordering reverses an earlier pair (TA − TIES), the step's direction is kept
    pairs = [(a, b) for a, b in pairs if (b, a) not in steps] + steps
    return list(dict.fromkeys(pairs))


def controls_of(diffs: dict[tuple[str, str], Difference]) -> tuple[str, ...]:
    """The controls M-TIES is judged against: the three, and the budget-matched tensor trim where it was measured."""
    return (*CONTROLS, TENSOR) if ("m_ties", TENSOR) in diffs else CONTROLS


def claim_verdict(diffs: dict[tuple[str, str], Difference], passed: bool, premise: bool = True) -> list[str]:
    """Which way M-TIES goes against each control (:func:`controls_of`), and whether "M-Loss helps" follows (M-TIES
    above all of them, both intervals excluding 0, every blocking gate passing)."""
    lines, above = [], []
    controls = controls_of(diffs)
    count = {3: "three", 4: "four"}[len(controls)]
    for control in controls:
        d = diffs.get(("m_ties", control))
        if d is None:
            lines.append(f"m_ties − {control}: not measured")
            continue
        above.append(d.verdict == "higher")
        lines.append(f"m_ties − {control} = {d.mean:+.2f}: {d.verdict} ({interval_text(d)})")
    holds = passed and len(above) == len(controls) and all(above)
    if holds:
        lines.append(f"M-Loss helps here: M-TIES is above all {count} controls, both intervals excluding 0.")
    else:
        why = ("a blocking gate fails" if not passed else "not every control was run" if len(above) < len(controls)
               else f"M-TIES is not above all {count} controls with both intervals excluding 0")
        lines.append(f"M-Loss helping is not shown here: {why}.")
    if not premise:
        lines.append(f"{PREMISE_ABSENT}: the ensemble is not clearly above the best merge on val (G6), so these "
                     "comparisons test M-TIES's trimming rule, not the premise that M-Loss measures a shortfall.")
    return lines


def interval_text(d: Difference) -> str:
    t = (f"replicate t [{d.t_low:+.2f}, {d.t_high:+.2f}] at {100 * d.t_level:.1f} % (Holm), p {d.p_holm:.3g}"
         if d.t_low is not None else "no replicate interval (1 replicate)")
    return f"item bootstrap [{d.low:+.2f}, {d.high:+.2f}]; {t}"


def grid_check(results: Sequence[ReplicateResult]) -> list[dict]:
    """Per method and searched parameter: the chosen value per replicate, whether it is an end of the grid, the
    grid step, the val points lost one step away on each side (None at an end), and the optimum of the parabola
    through the chosen point and its neighbours (the unsearched optimum nearby: within half a step when the chosen
    point is inside the grid and val is concave there)."""
    rows = []
    for label in results[0].methods:
        grid = results[0].methods[label]["val_grid"]
        names = [n for n in (grid[0]["setting"] if grid else {}) if len({g["setting"][n] for g in grid}) > 1]
        # a parameter the others determine (M-TIES's e from k in design r6) is no axis of its own
        derived = {n for n in names if len(grid_line(results[0].methods[label], n, names)) < 2}
        for name in [n for n in names if n not in derived]:
            row = {"method": label, "parameter": name, "chosen": [], "edge": [], "step": None, "loss": [],
                   "vertex": []}
            lines = [grid_line(r.methods[label], name, [n for n in names if n not in derived]) for r in results]
            for r, points in zip(results, lines):
                chosen = r.methods[label]["chosen"]
                values = [v for v, _ in points]
                i = values.index(chosen[name])
                row["chosen"].append(chosen[name])
                row["edge"].append(i in (0, len(values) - 1))
                row["step"] = round(float(np.min(np.diff(values))), 4) if len(values) > 1 else None
                best = points[i][1]
                row["loss"].append([None if j < 0 or j >= len(points) else round(100 * (best - points[j][1]), 2)
                                    for j in (i - 1, i + 1)])
                row["vertex"].append(parabola_vertex(points[i - 1:i + 2]) if 0 < i < len(points) - 1 else None)
            rows.append(row)
    return rows


def grid_line(method: dict, name: str, held: Sequence[str]) -> list[tuple[float, float]]:
    """(value, val) along parameter ``name`` of a method's val grid, the ``held`` parameters at the chosen setting."""
    chosen = method["chosen"]
    return sorted((g["setting"][name], g["val_mean"]) for g in method["val_grid"]
                  if all(g["setting"][k] == chosen[k] for k in held if k != name))


def parabola_vertex(points: Sequence[tuple[float, float]]) -> float | None:
    """The x of the maximum of the parabola through three (x, y) points (None where it is not concave)."""
    (x0, y0), (x1, y1), (x2, y2) = points
    a = np.polyfit([x0, x1, x2], [y0, y1, y2], 2)
    return None if a[0] >= 0 else round(float(-a[1] / (2 * a[0])), 3)


def grid_check_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["## Grid check (val)", "",
             ("| method | parameter | chosen per replicate | grid step | at an end | val points lost one step below / "
              "above | parabola optimum |"), "|---|---|---|---|---|---|---|"]
    for row in rows:
        edges = [i for i, e in enumerate(row["edge"]) if e]
        loss = "; ".join(" / ".join("end" if v is None else f"{v:.2f}" for v in pair) for pair in row["loss"])
        vertex = ", ".join("-" if v is None else f"{v:g}" for v in row["vertex"])
        edge = "no" if not edges else f"YES ({len(edges)} of {len(row['edge'])})"
        lines.append(f"| {row['method']} | {row['parameter']} | {', '.join(f'{v:g}' for v in row['chosen'])} | "
                     f"{row['step']:g} | {edge} | {loss} | {vertex} |")
    ok = not any(any(row["edge"]) for row in rows)
    lines += ["", "Edge check: " + ("no chosen setting is at an end of its grid." if ok else
                                    "a chosen setting is at an end of its grid (marked YES): the best setting may "
                                    "lie beyond it.")]
    return lines


def trim_lines(results: Sequence[ReplicateResult]) -> list[str]:
    labels = list(dict.fromkeys(label for r in results for label in r.trim))
    lines = []
    for label in labels:
        params = _params(results, label)
        values = [100 * r.trim[label] for r in results if label in r.trim]
        per = ", ".join(f"{v:.1f}" for v in values)
        if results[0].trim_counted == "merged weights":
            lines.append(f"{label} ({params}) changes {np.mean(values):.1f} % of the entries some fine-tune changed, "
                         f"counted on the merged weights (per replicate: {per}).")
        else:  # records made before the count: what the budget rule keeps of each fine-tune's changed entries
            lines.append(f"{label} ({params}) keeps {np.mean(values):.1f} % of each fine-tune's changed entries by "
                         f"its budget rule, not counted on the merged weights (per replicate: {per}).")
    return lines


def ordering_verdict(diffs: dict[tuple[str, str], Difference]) -> list[str]:
    """One line per adjacent pair of :func:`ordering`: whether the higher one is above, by its paired interval. No
    reason is guessed for a step that does not appear: "not separated" says the intervals (few replicates give wide
    ones), not that the two are equal."""
    lines = []
    for lo, hi in itertools.pairwise(ordering([label for pair in diffs for label in pair])):
        d = diffs.get((hi, lo))
        if d is None:
            continue
        holds = {"higher": "holds", "lower": "reversed", "not separated": "not separated"}[d.verdict]
        lines.append(f"{lo} < {hi}: {holds} ({hi} − {lo} = {d.mean:+.2f}; {interval_text(d)})")
    return lines


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
             header: Sequence[str] = (), appendix: Sequence[str] = ()) -> str:
    tasks = list(results[0].reference["pretrained heads"]["test"])
    lines = [*header, "## Gates (val)", ""]
    lines += [f"- {g.line()}" for g in gates]
    passed = all_pass(gates)
    premise = next((g.passed for g in gates if g.name.startswith("G6")), True)
    verdict = ("All gates pass: the differences below may be read as rankings where their interval excludes 0."
               if passed else "**A gate fails: this suite ranks nothing.** The numbers below are measurements only.")
    lines += ["", verdict, ""]
    if not premise:
        lines += [f"**{PREMISE_ABSENT}** (G6): the ensemble is not clearly above the best merge on val.", ""]
    columns = "| row | chosen on val (per replicate) | val | test | " + " | ".join(tasks) + " |"
    lines += ["## Accuracy (%)", "", columns,
              "|" + "---|" * (4 + len(tasks))]
    labels = [*reference_labels(results[0]), *results[0].methods]
    for label in labels:
        params = _params(results, label) if label not in REFERENCE else (
            "scale " + ", ".join(f"{r.ensemble_scale['chosen']:g}" for r in results) if label == TUNED_ENSEMBLE else "-")
        cells = " | ".join(f"{v:.1f}" for v in task_means(results, label, "test").values())
        lines.append(f"| {label} | {params} | {split_mean(results, label, 'val'):.2f} | "
                     f"{split_mean(results, label, 'test'):.2f} | {cells} |")
    seeds = [r.seed for r in results]
    note = (f"Val and test columns: the unweighted task mean, over {replicates(len(results), 'fine-tuning')} "
            f"(seeds {seeds}); task columns are test.")
    lines += ["", note]
    trims = trim_lines(results)
    if trims:
        lines += ["", *trims]
    checks = grid_check(results)
    if checks:
        lines += ["", *grid_check_lines(checks)]
    if any(("m_ties", c) in diffs for c in CONTROLS):
        count = {3: "three", 4: "four"}[len(controls_of(diffs))]
        lines += ["", f"## Does M-Loss help? (M-TIES against its {count} controls, test)", ""]
        lines += [f"- {line}" for line in claim_verdict(diffs, passed, premise)]
    lines += differences_section(diffs, passed, results)
    lines += [*([""] if appendix else []), *appendix]
    return "\n".join(lines) + "\n"


def differences_section(diffs: dict[tuple[str, str], Difference], passed: bool,
                        results: Sequence[ReplicateResult] = ()) -> list[str]:
    """The paired differences and the literature's ordering; when a gate fails they are printed as measurements,
    every verdict marked "not ranked"."""
    mark = (lambda v: v) if passed else (lambda v: f"{v} (not ranked)")
    title = ("## Paired differences (test, points)" if passed else
             "## Paired differences, measured only: a gate fails, so none is a ranking (test, points)")
    note = ("Item bootstrap: 95 % percentile interval resampling source items per task (photo regions, emoji, "
            "scans; procedural images one by one), replicates fixed. Replicate t: interval over the per-replicate "
            "differences at the level of its Holm step within its family (M-Loss claim; other methods), with the "
            "Holm-adjusted p. A verdict needs both intervals to exclude 0.")
    columns = ("| difference | family | mean | item bootstrap 95 % | replicate t (Holm level) | p (Holm) | "
               "per replicate | verdict |")
    lines = ["", title, "", note, "", columns, "|---|---|---|---|---|---|---|---|"]
    for (a, b), d in diffs.items():
        reps = ", ".join(f"{v:+.2f}" for v in d.per_replicate)
        t = "-" if d.t_low is None else f"[{d.t_low:+.2f}, {d.t_high:+.2f}] ({100 * d.t_level:.1f} %)"
        p = "-" if d.p_holm is None else f"{d.p_holm:.3g}"
        lines.append(f"| {a} − {b} | {d.family or '-'} | {d.mean:+.2f} | [{d.low:+.2f}, {d.high:+.2f}] | {t} | {p} | "
                     f"{reps} | {mark(d.verdict)} |")
    lines += ["", "## The literature's ordering (average < task arithmetic < TIES < ensemble < individual)", ""]
    lines += [f"- {line}" if passed else f"- {line} (not ranked)" for line in ordering_verdict(diffs)]
    return lines


def to_json(results: Sequence[ReplicateResult], gates: Sequence[Gate], diffs: dict[tuple[str, str], Difference],
            extra: dict[str, Any], items: Items | None = None, draws: int = R.BOOTSTRAP_DRAWS) -> dict[str, Any]:
    """The record: ``extra``, the gates, the claim, the tables, every difference (``bootstrap_seed``: the seed its item
    bootstrap drew with, ``draws`` draws) and the replicates with every test image's correctness per row
    (:func:`encode_correct`) and, with ``items``, each test image's source item: enough to recompute every
    difference from the record alone (:func:`recompute`)."""
    labels = [*reference_labels(results[0]), *results[0].methods]
    premise = next((g.passed for g in gates if g.name.startswith("G6")), True)
    return {
        **extra,
        "gates": [g.to_dict() for g in gates],
        "all_gates_pass": all_pass(gates),
        "premise_present": premise,
        "claim": claim_verdict(diffs, all_pass(gates), premise) if any(("m_ties", c) in diffs for c in CONTROLS)
        else [],
        "grid_check": grid_check(results),
        "trim": trim_lines(results),
        "summary": {label: {"val": split_mean(results, label, "val"), "test": split_mean(results, label, "test"),
                            "test_per_task": task_means(results, label, "test")} for label in labels},
        "differences": [{"a": a, "b": b, **d.to_dict(), "bootstrap_seed": i, "bootstrap_draws": draws}
                        for i, ((a, b), d) in enumerate(diffs.items())],
        "ordering": ordering_verdict(diffs),
        **({"test_items": {t: [int(v) for v in ids] for t, ids in items.items()}} if items is not None else {}),
        "replicates": [{"seed": r.seed, "reference": r.reference, "foreign": r.foreign, "methods": r.methods,
                        "trim": r.trim, "trim_counted": r.trim_counted, "ensemble_scale": r.ensemble_scale,
                        "correct": {label: {t: encode_correct(v) for t, v in row.items()}
                                    for label, row in r.correct.items()}}
                       for r in results],
    }  # fmt: skip


def encode_correct(values: np.ndarray) -> dict[str, Any]:
    """Per-image correctness (bool) as JSON: the image count and the bits packed (numpy ``packbits``, big-endian
    within a byte), base64."""
    import base64

    values = np.asarray(values, dtype=bool)
    return {"n": int(values.size), "bits": base64.b64encode(np.packbits(values).tobytes()).decode("ascii")}


def decode_correct(stored: dict[str, Any]) -> np.ndarray:
    """:func:`encode_correct`'s inverse."""
    import base64

    packed = np.frombuffer(base64.b64decode(stored["bits"]), dtype=np.uint8)
    return np.unpackbits(packed, count=stored["n"]).astype(bool)


def recompute(record: dict[str, Any]) -> dict[tuple[str, str], Difference]:
    """Every paired difference of a record, recomputed from the record alone: the per-image correctness and source
    items it stores, each pair's bootstrap seed and draws, then Holm within each family, as :func:`comparisons` did.
    Raises ``ValueError`` for a record that keeps no per-image data (made before records kept it)."""
    if not all("correct" in r for r in record["replicates"]):
        raise ValueError("the record keeps no per-image correctness (made before records kept it)")
    results = [ReplicateResult(seed=r["seed"], correct={label: {t: decode_correct(v) for t, v in row.items()}
                                                         for label, row in r["correct"].items()})
               for r in record["replicates"]]
    items = {t: np.asarray(ids) for t, ids in record["test_items"].items()} if "test_items" in record else None
    diffs = {}
    for d in record["differences"]:
        diffs[d["a"], d["b"]] = paired_difference(test_correct(results, d["a"]), test_correct(results, d["b"]), items,
                                                  draws=d["bootstrap_draws"], seed=d["bootstrap_seed"],
                                                  family=d["family"])
    return holm(diffs)


def from_json(record: dict[str, Any]) -> tuple[list[ReplicateResult], list[Gate], dict[tuple[str, str], Difference]]:
    """The replicates (without per-image correctness), gates and differences of a results record (:func:`to_json`)."""
    results = [ReplicateResult(seed=r["seed"], reference=r["reference"], foreign=r["foreign"], methods=r["methods"],
                               trim=r.get("trim", {}), trim_counted=r.get("trim_counted", "budget rule"),
                               ensemble_scale=r.get("ensemble_scale", {}))
               for r in record["replicates"]]
    gates = [Gate(**g) for g in record["gates"]]
    fields = set(Difference.__dataclass_fields__)
    diffs = {(d["a"], d["b"]): Difference(**{**{k: v for k, v in d.items() if k in fields},
                                             "per_replicate": tuple(d["per_replicate"])})
             for d in record["differences"]}
    return results, gates, diffs


def counted(text: str) -> str:
    """``text`` with every count of replicates worded as :func:`~benchmarks.suites.protocol.replicates` words it
    ("1 replicate", "4 fine-tuning replicates"): records written before it said "1 replicates" in their stored
    header and gate values, which :func:`render` keeps as text."""
    return re.sub(r"\b(\d+) (fine-tuning )?replicates?\b", lambda m: replicates(int(m[1]), (m[2] or "").strip()),
                  text)


def render(json_path: Path) -> None:
    """Rewrite a results record's Markdown (beside it) and its derived fields with this version of the report, from
    its JSON: no number is recomputed. The header is the record's, or that of the Markdown it replaces; stored text
    (the header, the gates' values and rules) gets its counts worded anew (:func:`counted`)."""
    json_path = Path(json_path)
    record = json.loads(json_path.read_text())
    md_path = json_path.with_suffix(".md")
    header = record.get("header") or md_path.read_text().split("## Gates (val)")[0].rstrip("\n").split("\n")
    header = [counted(line) for line in header]
    record["gates"] = [{**g, "value": counted(g["value"]), "rule": counted(g["rule"])} for g in record["gates"]]
    results, gates, diffs = from_json(record)
    record["header"], record["ordering"] = header, ordering_verdict(diffs)
    premise = next((g.passed for g in gates if g.name.startswith("G6")), True)
    if any(("m_ties", c) in diffs for c in CONTROLS):
        record["claim"] = claim_verdict(diffs, all_pass(gates), premise)
    md_path.write_text(markdown(results, gates, diffs, [*header, ""]))
    json_path.write_text(json.dumps(record, indent=1) + "\n")


def check_recomputed(json_path: Path) -> float:
    """The largest deviation between a record's stored differences and :func:`recompute`'s (points; p and levels
    too); raises ``ValueError`` where a verdict differs."""
    record = json.loads(Path(json_path).read_text())
    again = recompute(record)
    worst = 0.0
    for d in record["differences"]:
        r = again[d["a"], d["b"]].to_dict()
        if r["verdict"] != d["verdict"]:
            raise ValueError(f"{d['a']} − {d['b']}: stored verdict {d['verdict']}, recomputed {r['verdict']}")
        for key in ("mean", "low", "high", "t_low", "t_high", "t_level", "p", "p_holm"):
            if (d[key] is None) != (r[key] is None):
                raise ValueError(f"{d['a']} − {d['b']}: {key} stored {d[key]}, recomputed {r[key]}")
            if d[key] is not None:
                worst = max(worst, abs(d[key] - r[key]))
    return worst


if __name__ == "__main__":
    import sys

    usage = "usage: python -m benchmarks.suites.report [--recompute] RESULTS.json [...]"
    names = sys.argv[1:] or sys.exit(usage)
    if names[0] == "--recompute":
        for name in names[1:] or sys.exit(usage):
            print(f"{name}: every difference recomputed from the record, largest deviation "
                  f"{check_recomputed(Path(name)):.3g}")
    else:
        for name in names:
            render(Path(name))
            print(f"rendered {Path(name).with_suffix('.md')}")
