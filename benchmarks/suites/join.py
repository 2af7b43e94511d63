"""Join round 5's lever records measured on disjoint seeds into the record of all their seeds.

A lever's record (``python -m benchmarks.suites.regime --design r5 ... --table NAME``) keeps each row's val mean per
seed, its test mean per seed (records made before that kept only the mean over their seeds), what each seed chose,
the ensemble's scale per seed and ``auto``'s regret per seed. That is enough to recompute, for the union of the seeds,
every mean, both G6 gates and ``auto``'s mean regret exactly as one run over all of them would: each seed weighs the
same in every mean, so a mean over seeds joins as the mean of the records' means weighted by their seed counts. Seeds
measured on another machine, or after the replicate cache was lost, join a record this way. The records must be of
the same levers, rows and parts, each part measured by the same code versions, and their seeds disjoint.

    python -m benchmarks.suites.join A.json B.json --table benchmarks/results/NAME
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SAME = ("tasks", "q", "wise", "design", "trained_blocks", "steps", "parts", "code_versions")
"""What the rows joined must share: the lever, the parts and the code version that measured each part."""


def join_records(records: Sequence[dict]) -> dict:
    """The record of the union of ``records``' seeds (each a record's JSON, rows in the same lever order); the
    records in order of their first seed."""
    if len(records) < 2:
        raise ValueError("joining needs at least two records")
    records = sorted(records, key=lambda r: min(r["seeds"]))
    seeds = [s for r in records for s in r["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"the records share seeds ({seeds}): a seed joins once")
    if len({r.get("protocol") for r in records}) != 1:
        raise ValueError(f"the records were made under different protocols: {[r.get('protocol') for r in records]}")
    if designs := sorted({row.get("design", "?") for r in records for row in r["rows"]} - {"r5"}):
        raise ValueError(f"only round 5's lever records join (design 'r5'); got rows of design {designs}")
    if len({len(r["rows"]) for r in records}) != 1:
        raise ValueError("the records hold different numbers of levers")
    rows = [join_rows([r["rows"][i] for r in records], [len(r["seeds"]) for r in records])
            for i in range(len(records[0]["rows"]))]
    out = {"seeds": seeds, "rows": rows}
    if "protocol" in records[0]:
        out = {"protocol": records[0]["protocol"], **out}
    return out


def join_rows(rows: Sequence[dict], counts: Sequence[int]) -> dict:
    """One lever's rows measured on disjoint seeds (``counts``: how many seeds each holds) as one row."""
    from benchmarks.suites.gates import TIES_FAMILY, premise_gate_of
    from benchmarks.suites.protocol import TUNED_ENSEMBLE

    first = rows[0]
    for key in SAME:
        if differing := [row[key] for row in rows if row[key] != first[key]]:
            raise ValueError(f"the records differ in {key!r}: {first[key]!r} against {differing[0]!r}")
    for key in ("per_seed", "chosen", "test"):
        if differing := [sorted(row[key]) for row in rows if sorted(row[key]) != sorted(first[key])]:
            raise ValueError(f"the records hold different rows ({key}): {sorted(first[key])} against "
                             f"{differing[0]}")
    for row, n in zip(rows, counts):
        if any(len(values) != n for values in row["per_seed"].values()):
            raise ValueError(f"a record's per-seed values do not match its {n} seed(s)")

    def weighted(values: Sequence[float]) -> float:
        return float(np.average(values, weights=counts))

    out = {key: first[key] for key in SAME}
    out["per_seed"] = {label: [v for row in rows for v in row["per_seed"][label]] for label in first["per_seed"]}
    out.update({label: float(np.mean(values)) for label, values in out["per_seed"].items()})
    out["foreign"] = weighted([row["foreign"] for row in rows])
    out["ensemble_scale"] = [s for row in rows for s in row["ensemble_scale"]]
    out["chosen"] = {label: [c for row in rows for c in row["chosen"][label]] for label in first["chosen"]}
    merges = list(first["chosen"])
    ensemble = TUNED_ENSEMBLE if TUNED_ENSEMBLE in out["per_seed"] else "ensemble (probabilities)"
    out["g6_gate"] = premise_gate_of(out["per_seed"], ensemble, merges).to_dict()
    family = [m for m in TIES_FAMILY if m in merges]
    out["g6_gate_ties_family"] = premise_gate_of(out["per_seed"], ensemble, family, "TIES family").to_dict()
    out["test"] = {label: weighted([row["test"][label] for row in rows]) for label in first["test"]}
    if all("per_seed_test" in row for row in rows):
        out["per_seed_test"] = {label: [v for row in rows for v in row["per_seed_test"][label]]
                                for label in first["per_seed_test"]}
    for key in ("auto_regret", "auto_regrets"):
        if any((key in row) != (key in first) for row in rows):
            raise ValueError(f"some records hold {key!r} and others do not")
    if "auto_regret" in first:
        out["auto_regret"] = _joined_regret([row["auto_regret"] for row in rows])
    if "auto_regrets" in first:
        out["auto_regrets"] = {label: _joined_regret([row["auto_regrets"][label] for row in rows])
                               for label in first["auto_regrets"]}
    return out


def _joined_regret(regrets: Sequence[dict]) -> dict:
    per_seed = [p for regret in regrets for p in regret["per_seed"]]
    return {"mean": float(np.mean([p["regret"] for p in per_seed])), "per_seed": per_seed}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.suites.regime import write_r5

    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites.join", description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", type=Path, help="the records' JSON files (round 5's lever tables)")
    parser.add_argument("--table", type=Path, default=None, help="write TABLE.md / TABLE.json")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    sources = sorted(((path.stem, json.loads(path.read_text())) for path in args.records),
                     key=lambda named: min(named[1]["seeds"]))
    joined = join_records([record for _, record in sources])
    machine = "Joined from " + "; ".join(
        f"{name} (seeds {r['seeds']}: `{r['command']}`, {r['machine']})" for name, r in sources)
    command = "python -m benchmarks.suites.join " + " ".join(f"{path.stem}.json" for path in args.records)
    extra = {key: joined[key] for key in ("protocol",) if key in joined}
    extra["joined_from"] = [{"record": name, "seeds": r["seeds"], "command": r["command"], "machine": r["machine"]}
                            for name, r in sources]
    print(write_r5(joined["rows"], args.table, command, joined["seeds"], machine=machine,
                   seconds=time.perf_counter() - start, extra=extra))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
