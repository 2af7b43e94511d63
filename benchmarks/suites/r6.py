"""Design r6: the regime lever under the registered protocol v6 (``benchmarks/PROTOCOL.md``).

What round 5's design (``regime --design r5``, kept to reproduce its records) left open, closed before any v6 run:

* **equal grids**: every merge with a λ searches the one ladder :data:`~benchmarks.suites.registered.LAMS`, which
  holds round 5's λ ranges and every λ ``auto`` can choose; every TIES-family row (TIES, M-TIES and each control)
  searches the same k (:data:`~benchmarks.suites.registered.KS`), M-TIES's spread following k
  (:func:`~benchmarks.suites.registered.spread`); every learned row searches steps × lr on val;
* **budget-matched controls**: M-TIES against random and inverted ranks, the uniform row trim and the per-tensor trim
  (``rank="tensor"``), all at M-TIES's budget; the e = 0 control (per-tensor TIES at k) is reported beside them, not
  budget-matched; every trimming row's nominal and measured budget is printed;
* **per-item data**: each verdict record keeps every test image's correctness per row and its source item, so each
  paired difference recomputes from the record (:func:`benchmarks.suites.report.recompute`);
* **the version**: every record says ``protocol: v6`` (JSON) and carries the ``Protocol:`` line (Markdown).

Parts as in round 5 (``base`` first, the others methods-only runs joined beside it, each cached on its own):
``base``, ``mties``, ``data``, ``learned``. ``regime --design r6`` runs it::

    python -m benchmarks.suites.regime --design r6 --seeds 0,1,2,3 --tasks all --wise 1.0 --frozen 10 --steps 1440 \\
        --parts base,mties,data,learned --table benchmarks/results/regime1440_r6_4seeds_q8_blocks2 --report OUT
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.suites import registered as R
from benchmarks.suites.protocol import MethodSpec, check_grids

PARTS = ("base", "mties", "data", "learned")
LEARNED = (("adamerging", "entropy"), ("adamerging", "output_gap"), ("adamerging", "disagreement"),
           ("adamerging", "mloss"), ("adarank_tsv+lam", "output_gap"), ("adarank_tsv+lam", "entropy"))
"""The learned rows (method, objective) of the ``learned`` part: round 5's six."""
SMOKE = {"lam": (0.5, 1.0), "k": (0.2, 0.4), "p": (0.4, 0.7), "steps": (2, 3)}
"""``smoke``: two values per axis (the pipeline, not the numbers); learned rows keep their two lower lrs."""
TIES = {"scope": "global", "budget": "changed"}
"""TIES as round 5 runs it: one threshold per task vector, k a fraction of the entries its fine-tune changed."""


@dataclass
class SpreadSpec(MethodSpec):
    """An M-TIES row whose spread follows its keep fraction: every setting gets e = ``registered.spread(k)``."""

    spread: str = f"e = min({R.E_MAX:g}, k / 2)"
    """The rule, named in the record's specs (and so in the cache key: no plain spec shares it)."""

    def settings(self) -> list[dict[str, Any]]:
        return [{**setting, "e": R.spread(setting["k"])} for setting in super().settings()]


def grids(smoke: bool = False, extended: bool = False) -> dict[str, list]:
    """The registered axes (``smoke``: :data:`SMOKE`'s two values each); ``extended``: with the registered extension
    beyond both ends of every axis (:data:`~benchmarks.suites.registered.EXTENSION`)."""
    axes = {name: list(values) for name, values in SMOKE.items() if name != "steps"} if smoke else \
        {"lam": list(R.LAMS), "k": list(R.KS), "p": list(R.PS)}
    if extended:
        axes = {name: sorted({*values, *R.EXTENSION[name]}) for name, values in axes.items()}
    return axes


def learned_grid(method: str, smoke: bool = False) -> dict[str, list]:
    """steps × lr for a learned row (:data:`~benchmarks.suites.registered.LEARNED_LR` by method family)."""
    lrs = R.LEARNED_LR["adarank" if method.startswith("adarank") else "adamerging"]
    return {"steps": list(SMOKE["steps"] if smoke else R.LEARNED_STEPS), "lr": list(lrs[:2] if smoke else lrs)}


def specs(part: str, trained: Sequence[int], *, learned: Sequence[tuple[str, str]] = LEARNED,
          smoke: bool = False, extended: bool = False) -> list[MethodSpec]:
    """The rows of one part (see the module docstring and PROTOCOL.md's grid table); ``extended``: every axis with
    the registered extension (:func:`grids`)."""
    g = grids(smoke, extended)
    lam, ties_grid = {"lam": g["lam"]}, {"k": g["k"], "lam": g["lam"]}
    if part == "base":
        out = [MethodSpec("average", "average"),
               MethodSpec("task_arithmetic", "task_arithmetic", grid=dict(lam)),
               MethodSpec("ties", "ties", dict(TIES), dict(ties_grid)),
               MethodSpec("dare_ties", "dare_ties", grid={"p": g["p"], "lam": g["lam"]}),
               MethodSpec("tsv_m", "tsv_m", grid=dict(lam)),
               MethodSpec("iso_c", "iso_c", grid=dict(lam)),
               MethodSpec("iso_cts", "iso_cts", grid=dict(lam))]
        check_grids(out, families=[("ties", "dare_ties"), ("task_arithmetic", "tsv_m", "iso_c", "iso_cts")])
        return out
    if part == "mties":
        layers = {"layers": list(trained)}
        out = [SpreadSpec("m_ties", "m_ties", dict(layers), dict(ties_grid))]
        for label, rank, _ in R.CONTROLS:
            draws = range(1, R.RANDOM_DRAWS + 1) if rank == "random" else [None]
            out += [SpreadSpec(f"{label[:-1]}, draw {i})" if i else label, "m_ties", {**layers, "rank": rank},
                               dict(ties_grid), seed_offset=1000 * (i or 0)) for i in draws]
        out.append(MethodSpec(R.E0, "m_ties", {**layers, "e": 0.0}, dict(ties_grid)))
        check_grids(out)
        return out
    if part == "data":
        return [MethodSpec("regmean", "regmean"), MethodSpec("regmean_plusplus", "regmean_plusplus"),
                MethodSpec("auto", "auto", heads=True)]
    if part == "learned":
        out = []
        for name, objective in learned:
            method, _, flag = name.partition("+")
            extra = {"granularity": "layer"} if method == "adamerging" else {"learn_lam": True} if flag else {}
            out.append(MethodSpec(f"{name} ({objective})", method, {"batch_size": 16, **extra, "objective": objective},
                                  learned_grid(method, smoke), heads=objective != "mloss"))
        check_grids(out)
        return out
    raise ValueError(f"unknown part {part!r}: one of {PARTS}")


HOW = {"mloss": "rows ranked by M-Loss, k − e … k (k − e/2 on average)", "e0": "per tensor at k (not budget-matched)",
       **{rank: budget for _, rank, budget in R.CONTROLS}}
"""How each M-TIES-family row spends its budget on the scored tensors (PROTOCOL.md's control table)."""


def budgets(results: Sequence, rows: Sequence[MethodSpec]) -> dict[str, dict[str, Any]]:
    """Per trimming row: the setting chosen on val per replicate, the nominal kept fraction it implies (M-TIES's
    family: of the scored group tensors, and of every other tensor; TIES: of each task vector's changed entries;
    DARE-TIES: the keep probability), and the measured one: of the entries some fine-tune changed, the fraction the
    chosen merge changed (:func:`benchmarks.suites.protocol.changed_fraction`)."""
    out = {}
    for spec in rows:
        if spec.method not in ("ties", "m_ties", "dare_ties"):
            continue
        chosen = [r.methods[spec.label]["chosen"] for r in results]
        if spec.method == "m_ties":
            zero = spec.params.get("e") == 0.0
            scored = [c["k"] - (0.0 if zero else c["e"]) / 2 for c in chosen]
            nominal = {"scored tensors": scored, "other tensors": [c["k"] for c in chosen],
                       "how": HOW["e0" if zero else spec.params.get("rank", "mloss")]}
        elif spec.method == "ties":
            nominal = {"changed entries": [c["k"] for c in chosen], "how": "one threshold per task vector (global)"}
        else:
            nominal = {"keep probability": [c["p"] for c in chosen], "how": "random drops, survivors × 1/p"}
        out[spec.label] = {"chosen": chosen, "nominal": nominal,
                           "measured": [r.trim.get(spec.label) for r in results]}
    return out


def budget_lines(table: dict[str, dict[str, Any]]) -> list[str]:
    """The budgets as a Markdown section."""
    if not table:
        return []
    lines = ["## Budgets (kept fractions)", "",
             ("Nominal: what the chosen setting keeps by its rule; measured: of the entries some fine-tune changed, "
              "the fraction the chosen merge changed (counted on its weights), per replicate."), "",
             "| row | chosen per replicate | nominal kept fraction | how | measured (mean; per replicate) |",
             "|---|---|---|---|---|"]
    for label, row in table.items():
        chosen = "; ".join(", ".join(f"{k}={v:g}" for k, v in c.items()) for c in row["chosen"])
        nominal = "; ".join(f"{name} " + ", ".join(f"{v:.3g}" for v in values)
                            for name, values in row["nominal"].items() if name != "how")
        measured = [v for v in row["measured"] if v is not None]
        cell = (f"{100 * np.mean(measured):.1f} % ({', '.join(f'{100 * v:.1f}' for v in measured)})" if measured
                else "-")
        lines.append(f"| {label} | {chosen} | {nominal} | {row['nominal']['how']} | {cell} |")
    return lines


def verdicts(bench, rows: Sequence[MethodSpec], results: Sequence, out: Path, versions: dict[str, str], log) -> None:
    """The suite protocol's verdicts on the lever (gates, differences, M-TIES against its four controls) with the
    budgets and per-image data, to ``out``/results.md and results.json."""
    from benchmarks.suites.protocol import replicates
    from benchmarks.suites.run import judge, write_results

    results, gates, diffs = judge(bench, rows, list(results), log=log)
    table = budgets(results, rows)
    header = [(f"# Every verdict of the suite protocol on one lever: q {len(bench.tasks)}, wise {bench.cfg.wise:g}, "
               f"{bench.cfg.num_layers - bench.cfg.frozen} trained blocks, {bench.cfg.ft_steps} fine-tuning steps, "
               f"{replicates(len(results), 'fine-tuning')}"), "", R.label_line(R.VERSION), "",
              (f"Replicates measured by code version {versions['code_version']} "
               "(`benchmarks.suites.protocol.code_version`); merges and grids: `benchmarks.suites.r6.specs` (design "
               "r6: one λ ladder for every merge with a λ, one k grid for the TIES family, M-TIES's e = min(0.1, "
               "k/2), steps × lr for the learned rows). Each test image's correctness per row and its source item are "
               "in the JSON (`benchmarks.suites.report.recompute`).")]
    extra = {"protocol": R.VERSION, "design": "r6", **versions, "seeds": list(bench.cfg.seeds),
             "specs": [dataclasses.asdict(s) for s in rows], "budgets": table}
    write_results(out, results, gates, diffs, header, extra, items=getattr(bench, "test_items", None),
                  appendix=budget_lines(table))
    log(f"verdicts written to {out}/results.md")


def measure(cfg, cache: Path, log, parts: Sequence[str], *, version: str | Sequence[str] | None = None,
            report: Path | None = None, learned: Sequence[Sequence[tuple[str, str]]] = (LEARNED,),
            smoke: bool = False, extended: bool = False) -> dict:
    """One lever under design r6: each part measured (or read from the cache) on every seed of ``cfg``, ``base``
    first; the lever row (val and test of every row, G6 against every merge and the TIES family, ``auto``'s regret,
    the budgets) and, with ``report``, :func:`verdicts`."""
    from benchmarks.suites.gates import TIES_FAMILY, premise_gate, val_mean, val_means
    from benchmarks.suites.protocol import TUNED_ENSEMBLE
    from benchmarks.suites.real import build_real_suite
    from benchmarks.suites.regime import auto_regret, lever_replicates

    if not parts or parts[0] != "base":
        raise ValueError(f"the first part carries the reference rows: 'base', got {list(parts)}")
    if unknown := [p for p in parts if p not in PARTS]:
        raise ValueError(f"unknown parts {unknown}: design r6 has {PARTS}")
    trained = list(range(cfg.frozen, cfg.num_layers))
    runs = [(part, specs(part, trained, learned=group, smoke=smoke, extended=extended))
            for part in parts for group in (learned if part == "learned" else [()])]
    rows = [s for _, run in runs for s in run]
    if repeated := sorted(label for label, n in Counter(s.label for s in rows).items() if n > 1):
        raise ValueError(f"rows measured twice: {repeated}")
    bench = build_real_suite(cfg, cache, log)
    results = lever_replicates(bench, Path(cache), runs[0][1], log, version=version)
    versions = {"base": sorted({r.code_version for r in results})}
    for part, run in runs[1:]:
        measured = lever_replicates(bench, Path(cache), run, log, version=version, references=False)
        for result, extra in zip(results, measured):
            result.add_methods(extra)
        versions[part] = sorted({*versions.get(part, ()), *(r.code_version for r in measured)})
    merges = [s.label for s in rows]
    if report is not None:
        verdicts(bench, rows, results, report,
                 {"code_version": ", ".join(dict.fromkeys(v for vs in versions.values() for v in vs))}, log)
    family = [m for m in TIES_FAMILY if m in merges]
    row: dict = {"protocol": R.VERSION, "tasks": list(cfg.tasks), "q": len(cfg.tasks), "wise": cfg.wise,
                 "design": "r6" + (" extended" if extended else ""), "trained_blocks": cfg.num_layers - cfg.frozen, "steps": cfg.ft_steps,
                 "parts": list(parts), "code_versions": versions}
    for label in ("pretrained heads", "fine-tuned (own task)", "ensemble (probabilities)", TUNED_ENSEMBLE, *merges):
        row[label] = val_mean(results, label)
        row.setdefault("per_seed", {})[label] = val_means(results, label)
    row["foreign"] = 100 * float(np.mean([v for r in results for v in r.foreign.values()]))
    row["ensemble_scale"] = [r.ensemble_scale["chosen"] for r in results]
    row["chosen"] = {m: [r.methods[m]["chosen"] for r in results] for m in merges}
    row["g6_gate"] = premise_gate(results, merges).to_dict()
    row["g6_gate_ties_family"] = premise_gate(results, family, "TIES family").to_dict()
    row["test"] = {label: 100 * float(np.mean([np.mean(list(
        (r.reference[label] if label in r.reference else r.methods[label])["test"].values())) for r in results]))
        for label in ("fine-tuned (own task)", "ensemble (probabilities)", TUNED_ENSEMBLE, *merges)}
    row["budgets"] = budgets(results, rows)
    if "auto" in merges:
        learned_labels = {s.label for part, run in runs if part == "learned" for s in run}
        row["auto_regret"] = auto_regret(results, [m for m in merges if m != "auto" and m not in learned_labels])
    return row


def write(rows: Sequence[dict], table: Path | None, command: str, seeds: Sequence[int], load: tuple, threads: int,
          seconds: float) -> str:
    """The lever table (round 5's, :func:`benchmarks.suites.regime.write_r5`) with the ``Protocol:`` line and the
    budgets, as Markdown (returned) and to ``table``.md / .json with ``protocol`` in the JSON."""
    from benchmarks.suites.regime import write_r5

    text = write_r5(rows, None, command, seeds, load, threads, seconds).replace(
        "(`benchmarks.suites.regime.R5_GRIDS`, in units of the checkpoints as saved)",
        "(`benchmarks.suites.r6.specs`: design r6, `benchmarks/PROTOCOL.md`, in units of the checkpoints as saved)")
    title, _, rest = text.partition("\n")
    title = "# Design r6 (protocol v6) at each lever: every row, and G6 against the merges"
    text = "\n".join([title, "", R.label_line(R.VERSION), rest.rstrip("\n")]) + "\n"
    text += "".join("\n" + "\n".join(budget_lines(r["budgets"])) + "\n" for r in rows if r.get("budgets"))
    if table:
        table.parent.mkdir(parents=True, exist_ok=True)
        table.with_suffix(".md").write_text(text)
        table.with_suffix(".json").write_text(json.dumps(
            {"protocol": R.VERSION, "command": command, "machine": machine_line(load, threads),
             "seconds": round(seconds, 1), "seeds": list(seeds), "rows": rows}, indent=1, default=float) + "\n")
    return text


def machine_line(load: tuple, threads: int) -> str:
    import torch

    return (f"{os.cpu_count()} CPU cores, {threads} torch threads, torch {torch.__version__}, load average "
            f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
