"""Merges learned from unlabeled data, judged on the image suite beside the merges a user tunes with labels.

Three kinds of rows, all on the same fine-tunes and the suite's protocol
(:func:`benchmarks.suites.protocol.run_replicate`: reference rows, the tuned ensemble, val / test):

* **val-tuned** (they read val labels): task arithmetic, TIES, TSV-M, Iso-C, Iso-CTS, each on a 6-setting grid
  written per unit of the trained task vector (as the lever map's, :mod:`benchmarks.suites.regime`);
* **data-free at their defaults** (what a user without labels or data has): the same methods at the λ
  ``hf-mloss methods`` documents;
* **learned, label-free**: ``adamerging`` (layer-wise) with each objective, and ``adamerging_ties`` (AdaMerging++),
  trained on the suite's unlabeled pool (images of the train splits, disjoint from val and test), read through the
  frozen heads where the objective needs class outputs.

The record states, per learned row, its test accuracy against the best val-tuned merge and the best data-free
default (the issue's goal: within 1 point of the first, above the second).

    python -m benchmarks.suites.learned --seeds 0 --tasks all --wise 1.0 --table benchmarks/results/learned_regime_q8
    python -m benchmarks.suites.learned --regime --seeds 0,1,2,3 --learned adarank_tsv+lam:output_gap  # intervals
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.suites.__main__ import QUICK_TASKS, default_cache, record_args, start

OBJECTIVES = ("entropy", "output_gap", "disagreement", "mloss")
TUNED = ("task_arithmetic", "ties", "tsv_m", "iso_c", "iso_cts")


REFERENCES = ("fine-tuned (own task)", "ensemble (probabilities)", "ensemble (probabilities, tuned scale)")
"""The reference rows every record shows (the last one is :data:`benchmarks.suites.protocol.TUNED_ENSEMBLE`)."""

LEARNED = (*(("adamerging", o) for o in OBJECTIVES), ("adamerging_ties", "entropy"))
"""The learned rows by default: ``(method, objective)``."""


def learned_specs(num_tasks: int, wise: float, *, steps: int, lr: float | None, batch: int,
                  learned: Sequence[tuple[str, str]] = LEARNED, ties_lams: Sequence[float] | None = None) -> list:
    """The three kinds of rows (see the module docstring), labels suffixed by their kind; ``lr`` None: each
    learned method's default."""
    from benchmarks.suites.protocol import MethodSpec
    from benchmarks.suites.regime import TIES_LAMS, lever_specs

    tuned = {s.label: s for s in lever_specs(num_tasks, wise, ties_lams or TIES_LAMS, svd=True) if s.grid}
    specs = [dataclasses.replace(tuned[m], label=f"{m} (val-tuned)") for m in TUNED]
    defaults = {"ties": {"scope": "global", "budget": "changed", "k": 0.2}}
    specs += [MethodSpec(f"{m} (default)", m, defaults.get(m, {})) for m in TUNED]
    train = {"steps": steps, "batch_size": batch, **({"lr": lr} if lr is not None else {})}
    for name, objective in learned:
        method, _, flag = name.partition("+")  # adarank_tsv+lam: AdaRank learning λ with its masks
        if flag not in ("", "lam") or (flag and not method.startswith("adarank")):
            raise ValueError(f"unknown learned row {name!r}: METHOD or adarank_*+lam")
        extra = {"granularity": "layer"} if method == "adamerging" else {"learn_lam": True} if flag else {}
        specs.append(MethodSpec(f"{name} ({objective})", method, {**train, **extra, "objective": objective},
                                heads=objective != "mloss"))
    return specs


def kind(label: str) -> str:
    return "val-tuned" if label.endswith("(val-tuned)") else "default" if label.endswith("(default)") else "learned"


def measure(cfg, cache: Path, log, specs: Sequence, num_samples: int, earlier: dict | None = None) -> dict:
    """Every row of ``specs`` on every seed of ``cfg``: val and test means (%), chosen settings, merge seconds.
    ``earlier``: a record of the same suite (q, wise, trained blocks, seeds, samples) whose rows are kept; only
    ``specs``' learned rows run."""
    from benchmarks.suites.protocol import ENSEMBLE_SCALES, pretrained_scores, run_replicate
    from benchmarks.suites.real import build_real_suite

    same = {"q": len(cfg.tasks), "wise": cfg.wise, "trained_blocks": cfg.num_layers - cfg.frozen,
            "seeds": list(cfg.seeds), "num_samples": num_samples}
    if earlier is not None:
        differs = {k: (earlier.get(k), v) for k, v in same.items() if earlier.get(k) != v}
        if differs:
            raise ValueError(f"the earlier record is of another suite (earlier, now): {differs}")
        specs = [s for s in specs if kind(s.label) == "learned"]
    bench = build_real_suite(cfg, cache, log)
    pretrained = pretrained_scores(bench) if earlier is None else None
    results = [run_replicate(bench, rep, specs, pretrained=pretrained, ensemble_scales=ENSEMBLE_SCALES["main"],
                             num_samples=num_samples, log=log, references=earlier is None)
               for rep in bench.replicates]

    rows = dict((earlier or {}).get("rows", {}))  # an earlier row of the same label is measured again
    references = () if earlier else REFERENCES
    rows.update(summaries(results, (*references, *(s.label for s in specs))))
    best_tuned, best_default = best_rows(rows)
    scales = earlier["ensemble_scale"] if earlier else [r.ensemble_scale["chosen"] for r in results]
    return {"tasks": list(cfg.tasks), **same, "rows": rows, "best_tuned": best_tuned, "best_default": best_default,
            "ensemble_scale": scales, **({"baselines_from": earlier["command"]} if earlier else {})}


def measure_at_regime(cfg, cache: Path, log, specs: Sequence, version: str | None = None) -> dict:
    """:func:`measure` on the regime lever's fine-tunes (``cfg``: :func:`benchmarks.suites.regime.regime_config`
    with its seeds), its val-tuned rows taken from the lever map's cached replicates (the same protocol, grids and
    fine-tunes; ``version``: the code version that measured them) and the other rows run as a methods-only run,
    itself cached per seed. Beside the means: each learned row against the best val-tuned merge and the best
    data-free default, paired on the same test images, with item-bootstrap and replicate t intervals (Holm within
    the family of those comparisons)."""
    from benchmarks.suites.real import build_real_suite
    from benchmarks.suites.regime import REGIME_TIES_LAMS, lever_replicates, lever_specs
    from benchmarks.suites.report import test_correct
    from benchmarks.suites.stats import holm, paired_difference

    bench = build_real_suite(cfg, cache, log)
    tuned = lever_replicates(bench, cache, lever_specs(len(cfg.tasks), cfg.wise, REGIME_TIES_LAMS, svd=True), log,
                             version=version)
    others = [s for s in specs if kind(s.label) != "val-tuned"]
    measured = lever_replicates(bench, cache, others, log, references=False)
    for result, extra in zip(tuned, measured):
        for m in TUNED:  # the lever map's rows, under this probe's labels
            for rows in (result.methods, result.correct, result.trim):
                if m in rows:
                    rows[f"{m} (val-tuned)"] = rows.pop(m)
        for label in [m for m in result.methods if kind(m) != "val-tuned"]:  # rows this probe does not compare
            for rows in (result.methods, result.correct, result.trim):
                rows.pop(label, None)
        result.add_methods(extra)
    results = tuned

    rows = summaries(results, (*REFERENCES, *(f"{m} (val-tuned)" for m in TUNED), *(s.label for s in others)))
    best_tuned, best_default = best_rows(rows)
    items = getattr(bench, "test_items", None)
    diffs = {(a, b): paired_difference(test_correct(results, a), test_correct(results, b), items, seed=i,
                                       family="learned")
             for i, (a, b) in enumerate((label, base) for label, r in rows.items() if r["kind"] == "learned"
                                        for base in (best_tuned, best_default))}
    diffs = holm(diffs)
    return {"tasks": list(cfg.tasks), "q": len(cfg.tasks), "wise": cfg.wise,
            "trained_blocks": cfg.num_layers - cfg.frozen, "seeds": list(cfg.seeds), "num_samples": 128,
            "rows": rows, "best_tuned": best_tuned, "best_default": best_default,
            "ensemble_scale": [r.ensemble_scale["chosen"] for r in results],
            "code_versions": {"val-tuned": sorted({r.code_version for r in tuned}),
                              "other rows": sorted({r.code_version for r in measured})},
            "differences": [{"a": a, "b": b, **d.to_dict()} for (a, b), d in diffs.items()]}


def summaries(results: Sequence, labels: Sequence[str]) -> dict:
    """Per row label: its kind (a method's, or ``reference``), val and test means (%) over the replicates, and for
    methods the chosen settings, merge seconds and whether a choice sits at an end of the grid."""
    from benchmarks.suites.gates import val_mean

    rows = {}
    for label in labels:
        test = [np.mean(list((r.reference[label] if label in r.reference else r.methods[label])["test"].values()))
                for r in results]
        rows[label] = {"kind": kind(label) if label in results[0].methods else "reference",
                       "val": val_mean(results, label), "test": 100 * float(np.mean(test))}
        if label in results[0].methods:
            rows[label]["chosen"] = [r.methods[label]["chosen"] for r in results]
            rows[label]["merge_seconds"] = [r.methods[label]["merge_seconds"] for r in results]
            grid = [g["setting"] for g in results[0].methods[label]["val_grid"]]
            rows[label]["at_edge"] = len(grid) > 1 and any(r.methods[label]["chosen"] in (grid[0], grid[-1])
                                                           for r in results)
    return rows


def best_rows(rows: dict) -> tuple[str, str]:
    """The best val-tuned row and the best default, both chosen on val (what a user with val labels would pick; test
    labels choose nothing)."""
    best_tuned = max((k for k, v in rows.items() if v["kind"] == "val-tuned"), key=lambda k: rows[k]["val"])
    best_default = max((k for k, v in rows.items() if v["kind"] == "default"), key=lambda k: rows[k]["val"])
    return best_tuned, best_default


def markdown(record: dict, command: str, machine: str, seconds: float) -> str:
    from benchmarks.suites.protocol import replicates

    rows, tuned, default = record["rows"], record["best_tuned"], record["best_default"]
    lines = ["# Learned merges against val-tuned and data-free merges (image suite)", "",
             (f"Command: `{command}`. {machine}. {seconds:.0f} s. Image suite (DINOv2-S at 98 px), q = {record['q']} "
              f"tasks, wise {record['wise']:g}, {record['trained_blocks']} trained blocks, fine-tuning seed(s) "
              f"{record['seeds']}; the learned merges train on {record['num_samples']} unlabeled images of the "
              "train splits (disjoint from val and test). Accuracy in %. `val-tuned` rows chose their λ on val "
              "labels; `default` rows are each method at its documented default; `learned` rows used no label. "
              f"Best val-tuned merge: {tuned} (test {rows[tuned]['test']:.2f}); best data-free default: {default} "
              f"(test {rows[default]['test']:.2f})."), "",
             *([(f"Rows not run by this command come from the record of `{record['baselines_from']}` (same "
                 f"fine-tunes, same protocol)."), ""] if record.get("baselines_from") else []),
             "| row | kind | val | test | test − best val-tuned | test − best default | chosen | merge s |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        chosen = "; ".join(", ".join(f"{k}={v:g}" for k, v in c.items()) for c in r.get("chosen", []) if c)
        chosen += " (grid edge)" if r.get("at_edge") else ""
        seconds = ", ".join(f"{s:.0f}" for s in r.get("merge_seconds", []))
        lines.append(f"| {label} | {r['kind']} | {r['val']:.2f} | {r['test']:.2f} | "
                     f"{r['test'] - rows[tuned]['test']:+.2f} | {r['test'] - rows[default]['test']:+.2f} | "
                     f"{chosen} | {seconds} |")
    learned = [k for k, v in rows.items() if v["kind"] == "learned"]
    if record.get("differences"):
        count = replicates(len(record["seeds"]), "fine-tuning")
        lines += ["", (f"Paired differences on the test images, {count}: the "
                       "mean, its item-bootstrap 95 % interval and its replicate t interval at its Holm step "
                       "(family: these comparisons); a difference is a ranking only where both exclude 0."), "",
                  "| difference | mean | item bootstrap | replicate t (level) | per replicate | verdict |",
                  "|---|---|---|---|---|---|"]
        for d in record["differences"]:
            t = (f"[{d['t_low']:+.2f}, {d['t_high']:+.2f}] ({100 * d['t_level']:.1f} %)"
                 if d["t_low"] is not None else "n/a")
            lines.append(f"| {d['a']} − {d['b']} | {d['mean']:+.2f} | [{d['low']:+.2f}, {d['high']:+.2f}] | {t} | "
                         + ", ".join(f"{v:+.2f}" for v in d["per_replicate"]) + f" | {d['verdict']} |")
        versions = record.get("code_versions", {})
        lines += ["", "Measured by code versions: " + "; ".join(f"{k} {', '.join(v)}" for k, v in versions.items())
                  + " (`benchmarks.suites.protocol.code_version`)."]
    if learned:
        best = max(learned, key=lambda k: rows[k]["val"])
        gap, over = rows[best]["test"] - rows[tuned]["test"], rows[best]["test"] - rows[default]["test"]
        lines += ["", (f"Learned row with the best val: {best}, {gap:+.2f} test points from the best val-tuned merge "
                       f"and {over:+.2f} from the best data-free default (means: a difference ranks only where the "
                       "table above separates it and the suite's gates pass)."
                       + (" One seed gives no interval." if len(record["seeds"]) < 2 else ""))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import torch  # after pin_kernels (see ``benchmarks.suites.__main__``)

    from benchmarks.suites.real import RealConfig
    from benchmarks.suites.training import Log, torch_threads

    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites.learned", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0", help="fine-tuning seeds, comma-separated (default 0)")
    parser.add_argument("--wise", type=float, default=1.0)
    parser.add_argument("--tasks", default="all", choices=("quick", "all"))
    parser.add_argument("--frozen", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100, help="Adam steps of each learned merge")
    parser.add_argument("--lr", type=float, default=None, help="Adam's learning rate (default: each method's)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--num-samples", type=int, default=128, help="unlabeled images the learned merges train on")
    parser.add_argument("--learned", default=",".join(f"{m}:{o}" for m, o in LEARNED),
                        help="the learned rows, METHOD:OBJECTIVE comma-separated (adarank_tsv+lam: λ learned too)")
    parser.add_argument("--baselines-from", type=Path, default=None,
                        help="an earlier record (JSON) of the same suite: keep its other rows, run the learned ones")
    parser.add_argument("--ties-lams", default=None, help="TIES's λ grid per unit of a wise-0.65 checkpoint")
    parser.add_argument("--regime", action="store_true",
                        help="the regime lever (8 tasks, wise 1.0, upper 4 blocks: regime.regime_config), its "
                             "val-tuned rows from the lever map's cached replicates, paired intervals per learned row")
    parser.add_argument("--code-version", default=None,
                        help="with --regime: the code version whose lever-map replicates to reuse")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None, help="write TABLE.md / TABLE.json")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.suites.learned " + " ".join(
        record_args(argv if argv is not None else sys.argv[1:], ("--cache", "--table")))
    tasks = {"quick": QUICK_TASKS, "all": RealConfig().tasks}[args.tasks]
    seeds = tuple(int(s) for s in args.seeds.split(","))
    cfg = dataclasses.replace(RealConfig(), tasks=tuple(tasks), wise=args.wise, frozen=args.frozen, seeds=seeds)
    ties = tuple(float(v) for v in args.ties_lams.split(",")) if args.ties_lams else None
    if args.regime:
        from benchmarks.suites.regime import REGIME_TIES_LAMS, regime_config

        if args.baselines_from or args.num_samples != 128:
            parser.error("--regime takes its baselines from the lever map (128 samples): no --baselines-from")
        given = [f"--{name.replace('_', '-')}" for name, default in (("ties_lams", None), ("frozen", 10),
                 ("wise", 1.0), ("tasks", "all")) if getattr(args, name) != default]
        if given:
            parser.error(f"--regime fixes the lever (8 tasks, wise 1.0, upper 4 blocks, its TIES grid): drop {given}")
        cfg, ties = dataclasses.replace(regime_config(), seeds=seeds), REGIME_TIES_LAMS
    elif args.code_version:
        parser.error("--code-version names the lever map's replicates: it needs --regime")
    specs = learned_specs(len(cfg.tasks), cfg.wise, steps=args.steps, lr=args.lr, batch=args.batch,
                          learned=[tuple(item.split(":")) for item in args.learned.split(",")], ties_lams=ties)
    earlier = json.loads(args.baselines_from.read_text()) if args.baselines_from else None
    log = Log(True, "learned")
    start, load = time.perf_counter(), os.getloadavg()
    torch.use_deterministic_algorithms(True)
    with torch_threads(args.threads):
        if args.regime:
            record = measure_at_regime(cfg, args.cache or default_cache(), log, specs, args.code_version)
        else:
            record = measure(cfg, args.cache or default_cache(), log, specs, args.num_samples, earlier)
    machine = (f"{os.cpu_count()} CPU cores, {args.threads} torch threads, torch {torch.__version__}, load average "
               f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    seconds = time.perf_counter() - start
    text = markdown(record, command, machine, seconds)
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.with_suffix(".md").write_text(text)
        args.table.with_suffix(".json").write_text(json.dumps(
            {"command": command, "machine": machine, "seconds": round(seconds, 1), **record}, indent=1,
            default=float) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    start()
    raise SystemExit(main())
