"""Measure parts of round 5's design beside a lever record whose replicates are no longer cached.

The suite's fine-tunes are retrained from their seeds when the cache is lost, and a record then gains rows only by
measuring all its parts again (the reference rows and every merge's val grid: most of a record's time). This measures
the new parts alone (methods only) and joins them to the record's rows, seed by seed. Two checks bind them to it:

- every seed measures ``average`` again, and the merge best on val among the record's merges (not ``auto``, not a
  learned row) at the setting the record chose for that seed (a run of its own per seed, so no seed measures
  another's best): each must reach the record's val accuracy on that seed
  within one val image per task, or nothing is written (other fine-tunes, or other code, measured the record);
- each new ``auto`` row's regret is taken against that merge's test accuracy as measured here, on the same seed.

    python -m benchmarks.suites.beside benchmarks/results/RECORD.json --parts auto_cross_fit --own 16,64 \\
        --threads 1 --table benchmarks/results/NAME
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

CHECK = "check"
"""The part that holds the re-measured rows (``average`` and each seed's merge best on val)."""


def record_specs(row: dict, trained: Sequence[int], own: Sequence[int]) -> dict:
    """label → spec of every merge row in ``row`` (a round-5 lever row), from its parts' specs."""
    from benchmarks.suites.regime import round5_specs

    specs = {s.label: s for part in row["parts"] for s in round5_specs(part, trained, own=own)}
    if missing := [label for label in row["chosen"] if label not in specs]:
        raise ValueError(f"the record's rows {missing} are not among its parts' specs ({row['parts']}, own {own})")
    return {label: specs[label] for label in row["chosen"]}


def reference_labels(row: dict, specs: dict) -> list[str]:
    """The merges an ``auto`` row is judged against, as :func:`benchmarks.suites.regime.round5_row` takes them:
    neither ``auto`` nor a learned row."""
    from benchmarks.suites.regime import round5_specs

    learned = {s.label for part in row["parts"] if part in ("learned", "learned_own")
               for s in round5_specs(part, [])}
    return [label for label, spec in specs.items() if spec.method != "auto" and label not in learned]


def best_on_val(row: dict, others: Sequence[str]) -> list[tuple[str, dict]]:
    """Per seed of the record: the merge of ``others`` best on val and the setting it chose there."""
    out = []
    for i in range(len(row["per_seed"][others[0]])):
        best = max(others, key=lambda label: row["per_seed"][label][i])  # the first of equals, as round5_row
        out.append((best, row["chosen"][best][i]))
    return out


def check_specs(specs: dict, bests: Sequence[tuple[str, dict]]) -> list[list]:
    """Per seed, the check part's specs: ``average`` and the seed's best merge at its chosen setting (one setting;
    the label says which)."""
    out = []
    for best, setting in bests:
        label = f"{best} at " + (", ".join(f"{k}={v}" for k, v in setting.items()) or "its setting")
        out.append([specs["average"], dataclasses.replace(specs[best], label=label,
                                                          grid={k: [v] for k, v in setting.items()})])
    return out


def val_tolerance(bench) -> float:
    """One val image of the smallest task, in points of the task mean."""
    sizes = [len(labels) for labels in bench.labels("val").values()]
    return 100.0 / (len(sizes) * min(sizes)) + 1e-9


def join_beside(row: dict, check_labels: Sequence[str], bests: Sequence[tuple[str, dict]],
                measured: dict[str, Sequence], versions: dict[str, list[str]], tolerance: float) -> dict:
    """``row`` with the new parts' rows added (``measured``: part → replicate results, in the record's seed
    order), after the checks (``measured[CHECK]``) agree with it on every seed within ``tolerance`` val points."""
    from benchmarks.suites.gates import TIES_FAMILY, premise_gate_of, val_means
    from benchmarks.suites.protocol import TUNED_ENSEMBLE

    check = measured[CHECK]
    found = []
    for i, (result, label, (best, _)) in enumerate(zip(check, check_labels, bests)):
        for ours, theirs in (("average", "average"), (label, best)):
            now, then = val_means([result], ours)[0], row["per_seed"][theirs][i]
            found.append({"seed": result.seed, "row": ours, "val_record": then, "val_now": now})
            if abs(now - then) > tolerance:
                raise ValueError(f"seed {result.seed}: {ours} reaches {now:.4f} val where the record has "
                                 f"{then:.4f} (tolerance {tolerance:.4f}): these are not the record's fine-tunes, "
                                 "or other code measured it; nothing written")
    out = json.loads(json.dumps(row))
    out["parts"] = [*row["parts"], CHECK, *(p for p in measured if p != CHECK)]
    out["code_versions"] = {**row["code_versions"], **versions}
    beside = {"checks": found, "per_seed_test": {}}
    for part, results in measured.items():
        if part == CHECK:
            continue
        for label in results[0].methods:
            out["per_seed"][label] = val_means(results, label)
            out[label] = float(np.mean(out["per_seed"][label]))
            out["chosen"][label] = [r.methods[label]["chosen"] for r in results]
            tests = [100 * float(np.mean(list(r.methods[label]["test"].values()))) for r in results]
            beside["per_seed_test"][label] = tests
            out["test"][label] = float(np.mean(tests))
            if results[0].methods[label]["method"] != "auto":
                continue
            per_seed = []
            for result, c, r, (best, setting) in zip(check, check_labels, results, bests):
                reference = 100 * float(np.mean(list(result.methods[c]["test"].values())))
                chose = next((g["auto_chose"] for g in r.methods[label]["val_grid"] if "auto_chose" in g), None)
                per_seed.append({"seed": r.seed, "best_on_val": best, "best_setting": setting,
                                 "regret": reference - 100 * float(np.mean(list(r.methods[label]["test"].values()))),
                                 "auto_chose": chose})
            out.setdefault("auto_regrets", {})[label] = {"mean": float(np.mean([p["regret"] for p in per_seed])),
                                                         "per_seed": per_seed}
    merges = list(out["chosen"])
    ensemble = TUNED_ENSEMBLE if TUNED_ENSEMBLE in out["per_seed"] else "ensemble (probabilities)"
    out["g6_gate"] = premise_gate_of(out["per_seed"], ensemble, merges).to_dict()
    family = [m for m in TIES_FAMILY if m in merges]
    out["g6_gate_ties_family"] = premise_gate_of(out["per_seed"], ensemble, family, "TIES family").to_dict()
    out["beside"] = beside
    return out


def measure_beside(record: dict, cache: Path, log, parts: Sequence[str], *, own: Sequence[int],
                   version: Sequence[str] | None = None) -> dict:
    """The record's one lever row with ``parts`` measured beside it (see the module's docstring)."""
    from benchmarks.suites.real import RealConfig, build_real_suite
    from benchmarks.suites.regime import R5_OWN, lever_replicates, round5_specs

    if len(record["rows"]) != 1 or record["rows"][0].get("design") != "r5":
        raise ValueError("a record of one lever of round 5's design is needed")
    row = record["rows"][0]
    if clash := sorted(set(parts) & set(row["parts"])):
        raise ValueError(f"the record already holds the parts {clash}")
    default = RealConfig()
    cfg = dataclasses.replace(default, tasks=tuple(row["tasks"]), wise=row["wise"], seeds=tuple(record["seeds"]),
                              frozen=default.num_layers - row["trained_blocks"], ft_steps=row["steps"])
    trained = list(range(cfg.frozen, cfg.num_layers))
    specs = record_specs(row, trained, tuple(dict.fromkeys((*R5_OWN, *own))))
    bests = best_on_val(row, reference_labels(row, specs))
    checks = check_specs(specs, bests)
    measured: dict[str, list] = {CHECK: []}
    for seed, run in zip(record["seeds"], checks):  # each seed its own checks only: a run of its own
        bench = build_real_suite(dataclasses.replace(cfg, seeds=(seed,)), cache, log)
        measured[CHECK] += lever_replicates(bench, Path(cache), run, log, version=version, references=False)
    bench = build_real_suite(cfg, cache, log)
    for part in parts:
        measured[part] = lever_replicates(bench, Path(cache), round5_specs(part, trained, own=own), log,
                                          version=version, references=False)
    versions = {part: sorted({r.code_version for r in results}) for part, results in measured.items()}
    return join_beside(row, [run[1].label for run in checks], bests, measured, versions, val_tolerance(bench))


def main(argv: list[str] | None = None) -> int:
    import torch  # after pin_kernels (see ``benchmarks.suites.__main__``)

    from benchmarks.suites.__main__ import default_cache, record_args
    from benchmarks.suites.regime import R5_EXTRA_PARTS, R5_PARTS, write_r5
    from benchmarks.suites.training import Log, torch_threads

    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites.beside", description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path, help="the lever record's JSON (round 5's design, one lever)")
    parser.add_argument("--parts", required=True, help="the parts to measure beside it, comma-separated")
    parser.add_argument("--own", default="16,64", help="images per task in the own-data parts (default 16,64)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--code-version", default=None,
                        help="reuse the replicates that code version measured (comma-separated, tried in order)")
    parser.add_argument("--table", type=Path, default=None, help="write TABLE.md / TABLE.json")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in (*R5_PARTS, *R5_EXTRA_PARTS) or p == "base"]:
        parser.error(f"--parts: {unknown} cannot be measured beside a record")
    record = json.loads(args.record.read_text())
    argv = argv if argv is not None else sys.argv[1:]
    command = "python -m benchmarks.suites.beside " + " ".join(record_args(argv, ("--cache", "--table")))
    log = Log(True, "beside")
    start, load = time.perf_counter(), os.getloadavg()
    torch.use_deterministic_algorithms(True)
    with torch_threads(args.threads):
        row = measure_beside(record, args.cache or default_cache(), log, parts,
                             own=tuple(int(n) for n in args.own.split(",")),
                             version=args.code_version.split(",") if args.code_version else None)
    extra = {key: record[key] for key in ("protocol",) if key in record}
    extra["beside"] = {"record": args.record.stem, "command": record["command"], "machine": record["machine"]}
    text = write_r5([row], args.table, command, record["seeds"], load, args.threads, time.perf_counter() - start,
                    extra=extra) + checks_markdown(args.record.stem, row)
    if args.table:
        args.table.with_suffix(".md").write_text(text)
    print(text)
    return 0


def checks_markdown(record: str, row: dict) -> str:
    """The checks that bind the new rows to ``record``, as a Markdown section."""
    lines = ["", f"## Measured beside `{record}`", "",
             (f"The rows of the parts {', '.join(p for p in row['parts'][row['parts'].index(CHECK) + 1:])} were "
             f"measured by runs of their own on this lever's fine-tunes (the same seeds); the others are `{record}`'s. Each seed "
             "measured `average` and its merge best on val again (val points, the record's and this run's):"), "",
             "| seed | row | record | this run |", "|---|---|---|---|"]
    lines += [f"| {c['seed']} | {c['row']} | {c['val_record']:.2f} | {c['val_now']:.2f} |"
              for c in row["beside"]["checks"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from benchmarks.suites.__main__ import start

    start()
    raise SystemExit(main())
