"""Where does the ensemble beat the merges? A lever map of the premise gate G6 on the image suite, one run per lever.

M-Loss measures how far a merge falls short of the ensemble of its fine-tunes; a suite where the ensemble is not
above the merges (G6 absent) cannot test it. This probe varies one lever at a time on the image suite's cached
fine-tunes and reports, on val, what G6 compares: the probability ensemble (at the heads' training scale, and at the
head scale tuned on val on a grid as large as the merges') against the best of average, task arithmetic and TIES,
each tuned on its own grid. The levers:

* ``wise``: the fine-tunes at full strength (1.0) or interpolated back towards the base (the image record's 0.6 /
  0.65). The merges' λ grids are written in units of the trained task vector (divided by ``wise``), so no merge
  re-inflates an interpolated checkpoint by its choice of grid.
* the tasks: q = 4 (the main job's cut) or all 8 domains (more tasks, more interference).
* the ensemble's head scale: the heads' own (20) or tuned on val.
* interference: more trained blocks (``--frozen 8`` trains the upper 4 instead of 2) and more fine-tuning steps
  (``--steps``); each builds its own data cache / fine-tunes.

Everything else is the suite's protocol (:func:`benchmarks.suites.protocol.run_replicate`), so the rows equal the
suite's on the same fine-tunes. With one fine-tuning seed the map has no t interval: it says where to look, and the
suite's replicates say whether G6 passes there.

    python -m benchmarks.suites.regime --seeds 0 --table benchmarks/results/regime_levers
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.suites.__main__ import QUICK_TASKS, default_cache, record_args, start

MERGES = ("average", "task_arithmetic", "ties")
SVD_MERGES = ("tsv_m", "iso_c", "iso_cts")
SVD_GRIDS = {"tsv_m": (1.0, 1.5, 2.0, 2.5, 3.0, 4.0), "iso_c": (2.0, 3.0, 4.5, 6.0, 8.0, 11.0)}
"""The image suite's SVD grids (``benchmarks.suites.run.method_specs``), per unit of a wise-0.65 checkpoint; Iso-CTS
shares Iso-C's."""


TIES_LAMS = (1.6, 2.0, 2.4, 2.8, 3.2, 3.6)
"""The TIES family's λ grid of the image suite, per unit of a checkpoint interpolated at wise 0.65."""


REGIME_TIES_LAMS = (0.8, 1.0, 1.2, 1.4, 1.6, 2.0)
"""TIES's grid (per unit of a wise-0.65 checkpoint, as :data:`TIES_LAMS`) at :func:`regime_config`'s lever: the
suite's own put TIES's choice at its lower end there."""


def regime_config(seeds: int | None = None):
    """Round 4's regime lever (``regime_levers_q8_blocks4_svd``): all 8 tasks, the fine-tunes at full strength (wise
    1.0), the upper 4 blocks trained; ``seeds``: that many replicates (default: the suite's). Not the lever most
    favourable to the premise gate: round 5's 2-block records (``regime180_*``, ``regime1440_*``) came closer."""
    from benchmarks.suites.real import RealConfig

    cfg = dataclasses.replace(RealConfig(), wise=1.0, frozen=8)
    return dataclasses.replace(cfg, seeds=tuple(range(seeds))) if seeds else cfg


def lever_specs(num_tasks: int, wise: float, ties_lams: Sequence[float] = TIES_LAMS, *, svd: bool = False,
                mties_layers: Sequence[int] | None = None) -> list:
    """Average, task arithmetic and global TIES (k = 0.2 of the changed entries), on the suite's 6-setting grids
    written for 4 tasks at wise 0.65, rescaled to ``num_tasks`` (task arithmetic: 4 / q) and to ``wise`` (0.65 /
    wise), so each grid covers the same multiples of the trained task vectors at every lever; ``ties_lams``: another
    TIES grid in the same unit (as many settings), where the suite's puts the choice at an end. ``svd``: TSV-M, Iso-C
    and Iso-CTS too, each on its 6-setting grid in the same unit. ``mties_layers``: M-TIES scoring those blocks and
    its controls (e = 0, three random-rank draws, inverted ranks, budget-matched uniform; as the suite defines them,
    :func:`benchmarks.suites.run.method_specs`) on TIES's grid."""
    from benchmarks.suites.protocol import MethodSpec
    from benchmarks.suites.run import method_specs

    unit = 0.65 / wise
    ta = [round(lam * 4 / num_tasks * unit, 3) for lam in (0.5, 0.65, 0.8, 0.95, 1.1, 1.25)]
    if len(ties_lams) != len(TIES_LAMS):
        raise ValueError(f"the TIES grid needs {len(TIES_LAMS)} settings, as every other method's: {ties_lams}")
    ties = [round(lam * unit, 3) for lam in ties_lams]
    specs = [MethodSpec("average", "average"),
             MethodSpec("task_arithmetic", "task_arithmetic", grid={"lam": ta}),
             MethodSpec("ties", "ties", {"scope": "global", "budget": "changed", "k": 0.2}, {"lam": ties})]
    if svd:
        grids = {**SVD_GRIDS, "iso_cts": SVD_GRIDS["iso_c"]}
        specs += [MethodSpec(name, name, grid={"lam": [round(v * unit, 3) for v in grids[name]]}) for name in SVD_MERGES]
    if mties_layers:
        family = [spec for spec in method_specs(mties_layers, "main", num_tasks=num_tasks, random_draws=3)
                  if spec.method == "m_ties"]
        specs += [dataclasses.replace(spec, grid={"k": [0.2], "lam": ties}) for spec in family]
    return specs


def measure(cfg, cache: Path, log, ties_lams: Sequence[float] = TIES_LAMS, *, svd: bool = False,
            mties: bool = False, version: str | Sequence[str] | None = None, mties_version: str | None = None,
            report: Path | None = None) -> dict:
    """One lever setting (a :class:`~benchmarks.suites.real.RealConfig`): the suite's reference rows, tuned ensemble
    and merges on every seed of ``cfg``; G6 per seed with its t interval (:func:`benchmarks.suites.gates.premise_gate`)
    where there are several. ``mties``: M-TIES and its controls too (see :func:`lever_specs`), measured and cached
    as a methods-only run beside the other rows; ``version`` / ``mties_version``: reuse the replicates (the other rows
    / the M-TIES family) another code version measured (:func:`~benchmarks.suites.protocol.cached_replicate`);
    ``report``: every verdict of the suite's protocol on this lever (gates G1-G6, the paired differences with item
    bootstrap and Holm-adjusted replicate t intervals, M-TIES against its controls where measured), written as
    ``report``/results.md and results.json."""
    from benchmarks.suites.gates import premise_gate, val_mean, val_means
    from benchmarks.suites.protocol import TUNED_ENSEMBLE
    from benchmarks.suites.real import build_real_suite

    bench = build_real_suite(cfg, cache, log)
    specs = lever_specs(len(cfg.tasks), cfg.wise, ties_lams, svd=svd)
    family = lever_specs(len(cfg.tasks), cfg.wise, ties_lams, svd=svd,
                         mties_layers=list(range(cfg.frozen, cfg.num_layers)))[len(specs):] if mties else []
    merges = (*MERGES, *SVD_MERGES) if svd else MERGES
    results = lever_replicates(bench, Path(cache), specs, log, version=version)
    versions = {"code_version": ", ".join(dict.fromkeys(r.code_version for r in results))}
    if family:  # the M-TIES family as its own methods-only run on the same fine-tunes, cached apart from the rest
        measured = lever_replicates(bench, Path(cache), family, log, version=mties_version, references=False)
        for result, extra in zip(results, measured):
            result.add_methods(extra)
        versions["mties_code_version"] = ", ".join(dict.fromkeys(r.code_version for r in measured))
    if report is not None:
        verdicts(bench, [*specs, *family], results, report, versions, log)
    row: dict = {"tasks": list(cfg.tasks), "q": len(cfg.tasks), "wise": cfg.wise,
                 "trained_blocks": cfg.num_layers - cfg.frozen, "steps": cfg.ft_steps, **versions}
    ensembles = ("ensemble (probabilities)", TUNED_ENSEMBLE)
    for label in ("pretrained heads", "fine-tuned (own task)", *ensembles, *merges):
        row[label] = val_mean(results, label)
        row.setdefault("per_seed", {})[label] = val_means(results, label)
    row["foreign"] = 100 * float(np.mean([v for r in results for v in r.foreign.values()]))
    row["ensemble_scale"] = [r.ensemble_scale["chosen"] for r in results]
    row["ensemble_grid"] = [r.ensemble_scale["val_grid"] for r in results]
    row["chosen"] = {m: [r.methods[m]["chosen"] for r in results] for m in merges}
    row["edges"] = [f"{m}: {name}={value}" for r in results for m in merges
                    for name, value in r.methods[m]["chosen"].items()
                    if value in (min(g["setting"][name] for g in r.methods[m]["val_grid"]),
                                 max(g["setting"][name] for g in r.methods[m]["val_grid"]))]
    best = max(merges, key=lambda m: row[m])
    row["best_merge"] = best
    row["g6_heads_scale"] = row["ensemble (probabilities)"] - row[best]
    row["g6_tuned"] = row[TUNED_ENSEMBLE] - row[best]
    row["g6_gate"] = premise_gate(results, merges).to_dict()
    if svd:  # G6 against the merges the earlier maps had, beside the one against every merge
        row["g6_gate_without_svd"] = premise_gate(results, MERGES).to_dict()
    if family:  # val and test means of the M-TIES family, each at its own setting chosen on val
        row["mties_family"] = {s.label: {"val": val_mean(results, s.label), "test": 100 * float(np.mean(
            [np.mean(list(r.methods[s.label]["test"].values())) for r in results])),
            "chosen": [r.methods[s.label]["chosen"] for r in results]} for s in family}
    row["test"] = {label: 100 * float(np.mean([np.mean(list(
        (r.reference[label] if label in r.reference else r.methods[label])["test"].values())) for r in results]))
        for label in ("fine-tuned (own task)", *ensembles, *merges)}
    return row


# ------------------------------------------------------------------------------------------ round 5: the design
R5_LAMS = (0.3, 0.45, 0.6, 0.8, 1.0, 1.3)
"""The TIES family's λ (TIES, DARE-TIES, M-TIES and its controls), in units of the checkpoints as saved (at wise 1.0
the trained task vectors): holds the default 1, and reaches below the 0.39 where TIES chose at 1440 steps (seed 0)."""
R5_GRIDS = {
    "task_arithmetic": {"lam": [0.05, 0.075, 0.11, 0.17, 0.3, 0.45]},
    "ties": {"k": [0.1, 0.2, 0.4], "lam": list(R5_LAMS)},
    "dare_ties": {"p": [0.2, 0.4, 0.7], "lam": list(R5_LAMS)},
    "m_ties": {"k": [0.2, 0.3, 0.45], "lam": list(R5_LAMS)},
    "m_ties_low": {"k": [0.12, 0.15, 0.2], "lam": [0.45, 0.6, 0.8, 1.0, 1.3]},
    "ties_low": {"k": [0.03, 0.05, 0.07], "lam": [0.8, 1.0, 1.3, 1.7, 2.2, 3.0]},
    "tsv_m": {"lam": [0.5, 0.75, 1.0, 1.5, 2.0, 3.0]},
    "iso_c": {"lam": [1.0, 1.5, 2.25, 3.4, 5.0, 7.5]},
    "ties_sparse": {"k": [0.01, 0.02, 0.03], "lam": [3.0, 4.0, 5.5, 7.5, 10.0, 14.0]},
    "ties_high": {"k": [0.1, 0.2, 0.4], "lam": [1.3, 1.7, 2.2, 3.0]},
    "dare_ties_high": {"p": [0.7, 0.8, 0.9], "lam": [1.3, 1.7, 2.2, 3.0]},
    "iso_cts_high": {"lam": [7.5, 11.0, 15.0, 20.0]},
    "dare_sparse": {"p": [0.7, 0.8, 0.9], "lam": list(R5_LAMS)},
    "ties_low_wide": {"k": [0.03, 0.05, 0.07], "lam": [3.0, 4.0, 5.5, 7.5]},
    "regmean": {"lam": [0.5, 0.75, 1.0, 1.5, 2.0, 3.0]},
}
"""Round 5's grids, fixed before any round-5 lever was measured; each holds its method's default (task arithmetic
0.3, TIES k 0.2 and λ 1, DARE p 0.7, M-TIES k 0.2, the SVD merges λ 1). The TIES family (TIES, DARE-TIES, M-TIES and
its controls) searches λ × k (or p): 18 settings each; the one-parameter merges 6 λ each (Iso-CTS shares Iso-C's).
``m_ties_low`` came later: the M-TIES family chose k = 0.2, its grid's low end, on every seed at 1440 steps, so this
grid reaches below it, down to 0.12, the lowest k that keeps e = 0.1 below k (15 settings; a first draft with λ up to
0.8 only put the controls' choice at λ = 0.8 on seed 0, so λ reaches 1.3 as in the family's grid). ``ties_low`` came
after TIES chose k = 0.1, its grid's low end, on every seed at 180 steps (full strength): TIES below it, with λ
reaching higher (a sparser trim keeps less of each task vector), 18 settings as TIES's own grid. The ``_sparse`` and
``_high`` grids came last, each past an end chosen on every seed: ``ties_sparse`` past ``ties_low``'s corner (k 0.03,
λ 3; 180 steps, full strength), ``ties_high`` / ``dare_ties_high`` / ``iso_cts_high`` past λ 1.3 (and DARE's p 0.7)
and Iso-CTS's 7.5 (interpolated experts, wise 0.65). ``dare_sparse``: DARE-TIES past its p = 0.7 on its own λ grid
(it chose p 0.7 with an inner λ on every seed at 1440 steps); ``ties_low_wide``: ``ties_low``'s k past its λ = 3 (it
chose k 0.05 at λ 3 with interpolated experts). Each repeats the end it extends, as a check. ``regmean``: the λ of
RegMean's and RegMean++'s merged task vector (θ₀ + λ·Δ, 1 the published method), on TSV-M's grid, for the rows with
each task's own data."""
R5_E = (0.1, 0.15)
"""M-TIES's spread: the paper's 0.1 and one wider value (e < k on every k of its grid)."""
R5_PARTS = ("base", "mties", "data", "learned")
"""The parts of a round-5 lever, each measured and cached on its own (so a part can run in another process, or
later, without re-running the others): the reference rows and data-free merges; the M-TIES family; the merges that
use the unlabeled data in closed form or by choice (RegMean, RegMean++, ``auto``); the learned merges."""
R5_LEARNED = (("adamerging", "entropy"), ("adamerging", "output_gap"), ("adamerging", "disagreement"),
              ("adamerging", "mloss"), ("adarank_tsv+lam", "output_gap"), ("adarank_tsv+lam", "entropy"))
"""The learned rows (method, objective) of the ``learned`` part."""
R5_OWN = (16, 64)
"""Images per task in the rows where each fine-tune gets its own task's unlabeled data (drawn from that task's train
split, :meth:`benchmarks.suites.real.RealBench.own_data`): the paper's budget (16 per task, the pooled rows' 128 for
8 tasks) and 64."""
R5_LEARNED_OWN = (("adamerging", "entropy"), ("adamerging", "output_gap"), ("adarank_tsv+lam", "entropy"))
"""The learned rows with each task's own data (``learned_own``): AdaMerging's published objective (entropy through
each task's head, on that task's data), output_gap against each task's fine-tune on its data, AdaRank (TSV-M's
components, with λ) on its published entropy."""
R5_LONG_STEPS = 500
"""Adam steps of ``learned_own_long``: five times the learned rows' 100 (fusion-bench's AdaMerging runs 1000)."""
R5_EXTRA_PARTS = ("mties_low", "ties_low", "ties_sparse", "ties_low_wide", "lam_high", "ties_high", "dare_sparse",
                  "data_own", "learned_own", "learned_own_long", "sota", "auto_held_out", "auto_cart",
                  "auto_pooled_held_out", "auto_free", "auto_cross_fit", "auto_disagreement")
"""Parts measured only when named: the M-TIES family below its grid's k = 0.2 (``R5_GRIDS["m_ties_low"]``, k down to
0.12 at e = 0.1, since the spread needs e < k; no e = 0.15 row). It carries the family's labels, so it is measured
beside "base" in a run of its own, never with "mties". And TIES below its grid's k = 0.1 (``R5_GRIDS["ties_low"]``),
the row ``benchmarks.suites.gates.TIES_LOW``, which G6 counts in the TIES family; ``ties_sparse`` below that
(``gates.TIES_SPARSE``), and ``lam_high``: TIES, DARE-TIES and Iso-CTS above their grids' λ (``gates.TIES_HIGH``,
``gates.DARE_HIGH``, :data:`ISO_CTS_HIGH`), rows of their own beside the grids they extend; ``dare_sparse``:
DARE-TIES above its grid's p (``gates.DARE_SPARSE``), in the TIES family too; ``ties_high``: ``lam_high``'s TIES row
alone, where only TIES chose its grid's top λ. ``data_own`` and ``learned_own``: the ``data`` and ``learned`` part's
merges with each fine-tune given its own task's unlabeled images (:data:`R5_OWN` per task) instead of the shared
pool: RegMean and RegMean++ (λ = 1, and λ on :data:`R5_GRIDS`'s ``regmean`` grid), ``auto`` (RegMean++ among its
default candidates), and :data:`R5_LEARNED_OWN`; rows of their own beside the pooled ones, cached apart.
``learned_own_long``: ``learned_own``'s rows trained for :data:`R5_LONG_STEPS` Adam steps instead of 100 (at lr
1e-3 from AdaMerging's 0.3, 100 steps move no coefficient by much more than 0.1), labelled with their steps.
``auto_held_out``: ``auto`` with each fine-tune's own images as ``data_own`` measures it, but RegMean++ fitted on
samples the comparison does not read (``held_out``, the library's default since; ``data_own``'s rows compare it on
the images it was fitted on), at 16 and 64 per task. ``auto_cart``: the same at 16 per task with CART (on its
``CANDIDATE_GRIDS`` grid) among the default candidates, the data-free merge that led the ``sota`` rows.
``auto_pooled_held_out``: the ``data`` part's ``auto`` (one shared pool) with ``held_out``. ``auto_free``: ``auto``
with each fine-tune's own images (:data:`R5_OWN` per task) and the default candidates that fit nothing on the data
(RegMean++ left out), so that nothing is held out and every candidate is compared on all of each model's images
(``auto_held_out`` compares on the half RegMean++ is not fitted on). ``auto_cross_fit``: ``auto_held_out`` with
RegMean++ cross-fitted (fitted on each half of each model's images and compared on the other, ``cross_fit``, the
library's default since), so every default candidate is compared on all of them. ``auto_disagreement``:
``auto_cross_fit`` with the criterion ``disagreement`` (how often the merge's top class differs from the expert's)
instead of ``output`` (a divergence from the expert's class distribution, which also counts a merge more confident
than the expert it agrees with).
``sota``: the data-free state of the art beside TSV-M
(:func:`benchmarks.suites.run.sota_specs`): WUDI and CART on TSV-M's λ grid, Singular Value Calibration over task
arithmetic, TIES (k 0.2, global, the changed entries' budget, on the family's λ), TSV-M and Iso-CTS on their own λ
grids, 6 settings each as TSV-M's."""
ISO_CTS_HIGH = "iso_cts (λ 7.5-20)"


def round5_specs(part: str, trained: Sequence[int], *, learned: Sequence[tuple[str, str]] = R5_LEARNED,
                 learned_own: Sequence[tuple[str, str]] = R5_LEARNED_OWN, own: Sequence[int] = R5_OWN,
                 steps: int = 100, smoke: bool = False) -> list:
    """The specs of one part of round 5's design (see :data:`R5_PARTS`, :data:`R5_GRIDS`). The M-TIES family: M-TIES
    at e = 0.1 and 0.15, and its controls at e = 0.1 on the same λ × k grid (e = 0: per-tensor TIES at k; random
    ranks, one draw; inverted ranks; the budget-matched uniform trim), scoring the ``trained`` blocks. ``own``: the
    images per task of the own-data parts; ``learned_own``: the rows of ``learned_own``. ``smoke``: two values per
    axis and 2 training steps (the pipeline, not the numbers)."""
    from benchmarks.suites.gates import DARE_HIGH, DARE_SPARSE, TIES_HIGH, TIES_LOW, TIES_LOW_WIDE, TIES_SPARSE
    from benchmarks.suites.protocol import MethodSpec, check_grids

    g = {name: {k: list(v)[:2] if smoke else list(v) for k, v in grid.items()} for name, grid in R5_GRIDS.items()}
    steps = 2 if smoke else steps
    ties = {"scope": "global", "budget": "changed"}  # every TIES row: global trim, keep-rate of the changed entries
    if part == "base":
        specs = [MethodSpec("average", "average"),
                 MethodSpec("task_arithmetic", "task_arithmetic", grid=g["task_arithmetic"]),
                 MethodSpec("ties", "ties", dict(ties), g["ties"]),
                 MethodSpec("dare_ties", "dare_ties", grid=g["dare_ties"]),
                 MethodSpec("tsv_m", "tsv_m", grid=g["tsv_m"]),
                 MethodSpec("iso_c", "iso_c", grid=g["iso_c"]),
                 MethodSpec("iso_cts", "iso_cts", grid=g["iso_c"])]
        check_grids(specs, families=[("ties", "dare_ties"), ("task_arithmetic", "tsv_m", "iso_c", "iso_cts")])
        return specs
    if part in ("mties", "mties_low"):
        base = {"e": R5_E[0], "layers": list(trained)}
        grid = g["m_ties" if part == "mties" else "m_ties_low"]
        wider = [MethodSpec(f"m_ties (e={R5_E[1]:g})", "m_ties", {**base, "e": R5_E[1]}, grid)] * (part == "mties")
        specs = [MethodSpec("m_ties", "m_ties", dict(base), grid), *wider,
                 MethodSpec("m_ties (e=0)", "m_ties", {**base, "e": 0.0}, grid),
                 MethodSpec("m_ties (random ranks, draw 1)", "m_ties", {**base, "rank": "random"}, grid,
                            seed_offset=1000),
                 MethodSpec("m_ties (inverted ranks)", "m_ties", {**base, "rank": "inverted"}, grid),
                 MethodSpec("m_ties (budget-matched uniform)", "m_ties", {**base, "rank": "uniform"}, grid)]
        check_grids(specs)
        return specs
    one_row = {"ties_low": TIES_LOW, "ties_sparse": TIES_SPARSE, "ties_low_wide": TIES_LOW_WIDE,
               "ties_high": TIES_HIGH, "dare_sparse": DARE_SPARSE}  # a grid extension: one row on R5_GRIDS[part]
    if part in one_row:
        method = "dare_ties" if part == "dare_sparse" else "ties"
        return [MethodSpec(one_row[part], method, dict(ties) if method == "ties" else {}, g[part])]
    if part == "lam_high":
        specs = [MethodSpec(TIES_HIGH, "ties", dict(ties), g["ties_high"]),
                 MethodSpec(DARE_HIGH, "dare_ties", grid=g["dare_ties_high"]),
                 MethodSpec(ISO_CTS_HIGH, "iso_cts", grid=g["iso_cts_high"])]
        check_grids(specs, families=[(TIES_HIGH, DARE_HIGH), (ISO_CTS_HIGH,)])
        return specs
    if part == "sota":
        from benchmarks.suites.run import sota_specs

        specs = sota_specs(g["tsv_m"]["lam"], g["task_arithmetic"]["lam"], {"k": [0.2], "lam": g["ties"]["lam"]},
                           g["iso_c"]["lam"], dict(ties))
        check_grids([*specs, MethodSpec("tsv_m", "tsv_m", grid=g["tsv_m"])])  # each as many settings as TSV-M's
        return specs
    if part == "data":
        return [MethodSpec("regmean", "regmean"), MethodSpec("regmean_plusplus", "regmean_plusplus"),
                MethodSpec("auto", "auto", {"held_out": False}, heads=True)]  # as recorded: RegMean++ in sample
    if part == "learned":
        return _learned_specs(learned, steps)
    if part == "data_own":
        specs = []
        for n in own:
            own_label = f"own {n}/task"
            specs += [MethodSpec(f"regmean ({own_label})", "regmean", own_data=n),
                      MethodSpec(f"regmean ({own_label}, λ on val)", "regmean", grid=g["regmean"], own_data=n),
                      MethodSpec(f"regmean_plusplus ({own_label})", "regmean_plusplus", own_data=n),
                      MethodSpec(f"regmean_plusplus ({own_label}, λ on val)", "regmean_plusplus", grid=g["regmean"],
                                 own_data=n),
                      MethodSpec(f"auto ({own_label})", "auto", {"held_out": False}, heads=True, own_data=n)]
        return specs
    if part == "auto_held_out":  # one way, as recorded before cross-fitting
        return [MethodSpec(f"auto (own {n}/task, held out)", "auto", {"held_out": True, "cross_fit": False},
                           heads=True, own_data=n) for n in own]
    if part == "auto_cross_fit":
        return [MethodSpec(f"auto (own {n}/task, cross-fitted)", "auto", {"held_out": True, "cross_fit": True},
                           heads=True, own_data=n) for n in own]
    if part == "auto_disagreement":
        return [MethodSpec(f"auto (own {n}/task, cross-fitted, disagreement)", "auto",
                           {"held_out": True, "cross_fit": True, "criterion": "disagreement"}, heads=True, own_data=n)
                for n in own]
    if part == "auto_pooled_held_out":
        return [MethodSpec("auto (held out)", "auto", {"held_out": True}, heads=True)]
    if part == "auto_free":
        from hf_mloss.methods import get_method
        from hf_mloss.methods.auto import DEFAULT_CANDIDATES

        free = {name: grid for name, grid in DEFAULT_CANDIDATES.items() if not get_method(name).needs_data}
        return [MethodSpec(f"auto (own {n}/task, data-free candidates)", "auto", {"candidates": free}, heads=True,
                           own_data=n) for n in own]
    if part == "auto_cart":
        from hf_mloss.methods.auto import CANDIDATE_GRIDS, DEFAULT_CANDIDATES

        candidates = {**DEFAULT_CANDIDATES, "cart": CANDIDATE_GRIDS["cart"]}
        return [MethodSpec(f"auto (own {own[0]}/task, held out, with cart)", "auto",
                           {"held_out": True, "candidates": candidates}, heads=True, own_data=own[0])]
    if part in ("learned_own", "learned_own_long"):
        trained_for = steps if part == "learned_own" else 2 * steps if smoke else R5_LONG_STEPS
        suffix = "" if part == "learned_own" else f", {trained_for} steps"
        return [dataclasses.replace(spec, label=spec.label.replace(")", f", own {n}/task{suffix})"), own_data=n)
                for n in own for spec in _learned_specs(learned_own, trained_for)]
    raise ValueError(f"unknown part {part!r}: one of {(*R5_PARTS, *R5_EXTRA_PARTS)}")


def _learned_specs(learned: Sequence[tuple[str, str]], steps: int) -> list:
    """The learned rows (method[+lam], objective): layer-wise AdaMerging, AdaRank (with λ when ``+lam``), batches of
    16, the frozen heads unless the objective is ``mloss``."""
    from benchmarks.suites.protocol import MethodSpec

    specs = []
    for name, objective in learned:
        method, _, flag = name.partition("+")
        extra = {"granularity": "layer"} if method == "adamerging" else {"learn_lam": True} if flag else {}
        specs.append(MethodSpec(f"{name} ({objective})", method, {"steps": steps, "batch_size": 16, **extra,
                                                                  "objective": objective},
                                heads=objective != "mloss"))
    return specs


def measure_round5(cfg, cache: Path, log, parts: Sequence[str], *, version: str | Sequence[str] | None = None,
                   report: Path | None = None, learned: Sequence[Sequence[tuple[str, str]]] = (R5_LEARNED,),
                   learned_own: Sequence[Sequence[tuple[str, str]]] = (R5_LEARNED_OWN,),
                   own: Sequence[int] = R5_OWN, smoke: bool = False) -> dict:
    """One lever under round 5's design: each part of ``parts`` measured (or read from the cache) on every seed of
    ``cfg``, the first part with the reference rows ("base" must be among them), the others as methods-only runs
    joined beside it; then :func:`measure`'s row (G6 against every merge and against the TIES family) and, with
    ``report``, every verdict of the suite protocol. ``learned``: the learned part's rows in groups, each group a
    methods-only run cached on its own, so groups measured by separate runs join one record; ``learned_own``: the
    same for that part's rows. ``own``: the own-data parts' images per task (:func:`round5_specs`)."""
    from benchmarks.suites.real import build_real_suite

    if parts[0] != "base":
        raise ValueError(f"the first part carries the reference rows: 'base', got {parts[0]!r}")
    trained = list(range(cfg.frozen, cfg.num_layers))
    groups = {"learned": learned, "learned_own": learned_own, "learned_own_long": learned_own}  # each group: a run
    runs = [(part, round5_specs(part, trained, **({part.removesuffix("_long"): group} if part in groups else {}),
                                own=own, smoke=smoke))
            for part in parts for group in groups.get(part, [()])]
    specs = [s for _, run in runs for s in run]
    if repeated := sorted(label for label, n in Counter(s.label for s in specs).items() if n > 1):
        raise ValueError(f"rows measured twice: {repeated}; each learned row belongs to one group")
    bench = build_real_suite(cfg, cache, log)
    results = lever_replicates(bench, Path(cache), runs[0][1], log, version=version)
    versions = {"base": sorted({r.code_version for r in results})}
    for part, run in runs[1:]:
        measured = lever_replicates(bench, Path(cache), run, log, version=version, references=False)
        for result, extra in zip(results, measured):
            result.add_methods(extra)
        versions[part] = sorted({*versions.get(part, ()), *(r.code_version for r in measured)})
    merges = [s.label for s in specs]
    if report is not None:
        header_versions = {"code_version": ", ".join(dict.fromkeys(v for vs in versions.values() for v in vs))}
        verdicts(bench, specs, results, report, header_versions, log, design="r5")
    autos = [s.label for s in specs if s.method == "auto"]
    learned_labels = {s.label for part, run in runs if part in groups for s in run}
    lever = {"tasks": list(cfg.tasks), "q": len(cfg.tasks), "wise": cfg.wise, "design": "r5",
             "trained_blocks": cfg.num_layers - cfg.frozen, "steps": cfg.ft_steps, "parts": list(parts),
             "code_versions": versions}
    return round5_row(results, merges, lever, autos=autos, learned=learned_labels)


def round5_row(results: Sequence, merges: Sequence[str], lever: dict, *, autos: Sequence[str] = (),
               learned: Sequence[str] = ()) -> dict:
    """A lever's record row from its replicates: ``lever``'s keys, then every reference row and merge of ``merges``
    on val (mean and per seed) and test (per seed and mean), what each seed chose, both G6 gates, and each ``auto``
    row's regret against the merges that are neither ``autos`` nor ``learned`` rows."""
    from benchmarks.suites.gates import TIES_FAMILY, premise_gate, val_mean, val_means
    from benchmarks.suites.protocol import TUNED_ENSEMBLE

    family = [m for m in TIES_FAMILY if m in merges]
    row: dict = dict(lever)
    for label in ("pretrained heads", "fine-tuned (own task)", "ensemble (probabilities)", TUNED_ENSEMBLE, *merges):
        row[label] = val_mean(results, label)
        row.setdefault("per_seed", {})[label] = val_means(results, label)
    row["foreign"] = 100 * float(np.mean([v for r in results for v in r.foreign.values()]))
    row["ensemble_scale"] = [r.ensemble_scale["chosen"] for r in results]
    row["chosen"] = {m: [r.methods[m]["chosen"] for r in results] for m in merges}
    row["g6_gate"] = premise_gate(results, merges).to_dict()
    row["g6_gate_ties_family"] = premise_gate(results, family, "TIES family").to_dict()
    tested = ("fine-tuned (own task)", "ensemble (probabilities)", TUNED_ENSEMBLE, *merges)
    row["per_seed_test"] = {label: [100 * float(np.mean(list(
        (r.reference[label] if label in r.reference else r.methods[label])["test"].values()))) for r in results]
        for label in tested}  # kept per seed so that records measured on other seeds join (benchmarks.suites.join)
    row["test"] = {label: float(np.mean(row["per_seed_test"][label])) for label in tested}
    others = [m for m in merges if m not in autos and m not in learned]
    if "auto" in merges:
        row["auto_regret"] = auto_regret(results, others)
    if len(autos) > ("auto" in merges):  # auto with each task's own data: against the same merges
        row["auto_regrets"] = {label: auto_regret(results, others, label) for label in autos}
    return row


def auto_regret(results: Sequence, others: Sequence[str], label: str = "auto") -> dict:
    """``auto`` (chosen without labels; ``label``: its row) against the merge of ``others`` best on val, per
    replicate: that merge's test mean minus auto's (points; > 0: auto below it), with what auto chose; and the mean
    over replicates."""
    per_seed = []
    for r in results:
        val = {m: float(np.mean(list(r.methods[m]["val"].values()))) for m in others}
        best = max(val, key=val.get)
        test = {m: 100 * float(np.mean(list(r.methods[m]["test"].values()))) for m in (best, label)}
        chose = next((g["auto_chose"] for g in r.methods[label]["val_grid"] if "auto_chose" in g), None)
        per_seed.append({"seed": r.seed, "best_on_val": best, "best_setting": r.methods[best]["chosen"],
                         "regret": test[best] - test[label], "auto_chose": chose})
    return {"mean": float(np.mean([p["regret"] for p in per_seed])), "per_seed": per_seed}


def lever_replicates(bench, cache: Path, specs: Sequence, log, *, version: str | Sequence[str] | None = None,
                     references: bool = True) -> list:
    """Every replicate of ``bench`` under the suite's protocol with ``specs`` (reference rows and the tuned
    ensemble too, unless ``references=False``: a methods-only run to join rows measured before), each cached under
    ``cache``/regime-results by the suite's configuration, the specs and the code version (``version``: reuse what
    that version measured), so a run with more seeds, or a stopped one, reuses the seeds measured (and a stopped
    seed resumes after its last measured method)."""
    from benchmarks.suites.protocol import ENSEMBLE_SCALES, cached_replicate, pretrained_scores, run_replicate

    described = [dataclasses.asdict(bench.cfg) | {"seeds": None}, [s.described() for s in specs],
                 ENSEMBLE_SCALES["main"] if references else "methods only"]
    pretrained = {}

    def run(rep, partial):
        if references and not pretrained:
            pretrained.update(pretrained_scores(bench))
        return run_replicate(bench, rep, specs, pretrained=pretrained or None, log=log, references=references,
                             ensemble_scales=ENSEMBLE_SCALES["main"] if references else (), partial=partial)

    return [cached_replicate(described, Path(cache) / "regime-results", rep.seed,
                             lambda partial, rep=rep: run(rep, partial), log, version=version, resumable=True)
            for rep in bench.replicates]


def verdicts(bench, specs: Sequence, results: Sequence, out: Path, versions: dict[str, str], log, *,
             design: str = "r4") -> None:
    """The suite protocol's verdicts on one lever's replicates (:func:`benchmarks.suites.run.judge`: gates, paired
    differences, the M-TIES claim), written to ``out``/results.md and results.json by the suite's own report."""
    from benchmarks.suites.protocol import replicates
    from benchmarks.suites.run import judge, write_results

    results, gates, diffs = judge(bench, specs, list(results), log=log)
    grids = ("`benchmarks.suites.regime.lever_specs` (written in units of the trained task vectors)" if design == "r4"
             else "`benchmarks.suites.regime.round5_specs` (`R5_GRIDS`, in units of the checkpoints as saved; the "
                  "TIES family on λ × k or p, 18 settings each, the one-parameter merges on 6 λ each)")
    header = [f"# Every verdict of the suite protocol on one lever: q {len(bench.tasks)}, wise {bench.cfg.wise:g}, "
              f"{bench.cfg.num_layers - bench.cfg.frozen} trained blocks, {bench.cfg.ft_steps} fine-tuning steps, "
              f"{replicates(len(results), 'fine-tuning')}", "",
              f"Replicates measured by code version {versions['code_version']}"
              + (f" (the M-TIES family: {versions['mties_code_version']})" if "mties_code_version" in versions else "")
              + f" (`benchmarks.suites.protocol.code_version`); merges and grids: {grids}."]
    write_results(out, results, gates, diffs, header, {**versions, "seeds": list(bench.cfg.seeds),
                                                       "specs": [s.described() for s in specs]})
    log(f"verdicts written to {out}/results.md")


def markdown(rows: Sequence[dict], command: str, seeds: Sequence[int], machine: str, seconds: float) -> str:
    from benchmarks.suites.protocol import TUNED_ENSEMBLE

    lines = ["# Where the ensemble beats the merges: the premise gate (G6) against each lever", "",
             (f"Command: `{command}`. {machine}. {seconds:.0f} s. Image suite (DINOv2-S at 98 px, the upper blocks "
              f"trained for the steps (batch 32) of each row, heads at cosine × 20), fine-tuning seed(s) "
              f"{list(seeds)}; every number is "
              "val accuracy (%), each merge at its own setting chosen on val; G6 = ensemble − best merge (the gate "
              "asks ≥ +3 with a replicate t interval above 0: one seed gives no interval, so this map says where "
              "to look, not whether G6 passes)."), "",
             ("| q | wise | trained blocks | steps | pretrained | fine-tuned (own) | one foreign τ | ensemble (scale 20) | ensemble (tuned: "
              "scale) | average | task arithmetic | TIES | best merge | G6 at scale 20 | G6 tuned |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    versions = list(dict.fromkeys(v.strip() for r in rows for key in ("code_version", "mties_code_version")
                                  for v in r.get(key, "").split(",") if v.strip()))
    if versions:
        lines[2] += f" Protocol results measured by code version {', '.join(versions)}."
    for r in rows:
        scale = ", ".join(f"{s:g}" for s in sorted(set(r["ensemble_scale"])))
        lines.append(
            f"| {r['q']} | {r['wise']:g} | {r.get('trained_blocks', 2)} | {r.get('steps', 180)} | "
            f"{r['pretrained heads']:.2f} | {r['fine-tuned (own task)']:.2f} | "
            f"{r['foreign']:+.2f} | {r['ensemble (probabilities)']:.2f} | {r[TUNED_ENSEMBLE]:.2f} ({scale}) | "
            f"{r['average']:.2f} | {r['task_arithmetic']:.2f} | {r['ties']:.2f} | {r['best_merge']} | "
            f"{r['g6_heads_scale']:+.2f} | **{r['g6_tuned']:+.2f}** |")
    svd_rows = [r for r in rows if "tsv_m" in r]
    if svd_rows:
        lines += ["", "The SVD merges on the same fine-tunes (val, each at its own setting chosen on val):", "",
                  "| q | wise | trained blocks | steps | TSV-M | Iso-C | Iso-CTS | best merge | G6 tuned |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['q']} | {r['wise']:g} | {r.get('trained_blocks', 2)} | {r.get('steps', 180)} | "
                  f"{r['tsv_m']:.2f} | {r['iso_c']:.2f} | {r['iso_cts']:.2f} | {r['best_merge']} | "
                  f"**{r['g6_tuned']:+.2f}** |" for r in svd_rows]
    gates = [r for r in rows if r.get("g6_gate")]
    if gates:
        lines += ["", "G6 per fine-tuning seed, with its replicate t interval (the gate: ≥ +3 with the interval above 0):",
                  ""]
        for r in gates:
            where = f"q {r['q']}, wise {r['wise']:g}, {r.get('trained_blocks', 2)} trained blocks"
            lines.append(f"- {where}: {r['g6_gate']['value']}")
            if r.get("g6_gate_without_svd"):
                lines.append(f"- {where}, without the SVD merges: {r['g6_gate_without_svd']['value']}")
    family = [r for r in rows if r.get("mties_family")]
    if family:
        lines += ["", "M-TIES and its controls on TIES's λ grid (mean over seeds, each at its setting chosen on val):", "",
                  "| q | wise | trained blocks | row | val | test | chosen λ per seed |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['q']} | {r['wise']:g} | {r.get('trained_blocks', 2)} | {label} | {m['val']:.2f} | "
                  f"{m['test']:.2f} | {', '.join(format(c['lam'], 'g') for c in m['chosen'])} |"
                  for r in family for label, m in r["mties_family"].items()]
    edges = [f"q {r['q']}, wise {r['wise']:g}: " + "; ".join(r["edges"]) for r in rows if r["edges"]]
    lines += ["", "Chosen settings at an end of their grid: " + (" · ".join(edges) if edges else "none") + "."]
    lines += ["", "Test accuracy (%) of the same rows: " + " · ".join(
        f"q {r['q']}, wise {r['wise']:g}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["test"].items()) for r in rows)]
    return "\n".join(lines) + "\n"


def write(rows: Sequence[dict], table: Path | None, command: str, seeds: Sequence[int], load: tuple,
          threads: int, seconds: float) -> str:
    """The map so far as Markdown (returned), and to ``table``.md / .json when given (rewritten after every lever,
    so a long run that is stopped keeps what it measured)."""
    import torch

    machine = (f"{os.cpu_count()} CPU cores, {threads} torch threads, torch {torch.__version__}, load average "
               f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    text = markdown(rows, command, seeds, machine, seconds)
    if table:
        table.parent.mkdir(parents=True, exist_ok=True)
        table.with_suffix(".md").write_text(text)
        table.with_suffix(".json").write_text(json.dumps(
            {"command": command, "machine": machine, "seconds": round(seconds, 1),
             "seeds": list(seeds), "rows": rows}, indent=1, default=float) + "\n")
    return text


def _choice(chose: dict | None) -> str:
    if not chose:
        return "-"
    parameters = ", ".join(f"{k}={v}" for k, v in chose.get("parameters", {}).items())
    return f"{chose['method']} ({parameters})" if parameters else chose["method"]


def write_r5(rows: Sequence[dict], table: Path | None, command: str, seeds: Sequence[int], load: tuple = (),
             threads: int = 0, seconds: float = 0.0, *, machine: str | None = None, extra: dict | None = None) -> str:
    """Round 5's lever table (val and test of every row, G6 against every merge and against the TIES family) as
    Markdown (returned), and to ``table``.md / .json when given. ``machine``: what measured it, when not this machine
    with ``threads`` and the load averages ``load`` (a joined record names its sources'); ``extra``: more keys
    for the JSON, first."""
    import torch

    from benchmarks.suites.protocol import TUNED_ENSEMBLE

    machine = machine or (f"{os.cpu_count()} CPU cores, {threads} torch threads, torch {torch.__version__}, load "
                          f"average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    lines = ["# Round 5's design at each lever: every row, and G6 against the merges", "",
             (f"Command: `{command}`. {machine}. {seconds:.0f} s. Image suite (DINOv2-S at 98 px), fine-tuning "
              f"seed(s) {list(seeds)}; accuracy in %, each merge at its own setting chosen on val "
              "(`benchmarks.suites.regime.R5_GRIDS`, in units of the checkpoints as saved). Code versions per part: "
              + "; ".join(f"{r['steps']} steps: " + ", ".join(f"{p} {'/'.join(v)}" for p, v in
                                                               r["code_versions"].items()) for r in rows) + ".")]
    for r in rows:
        lines += ["", f"## q {r['q']}, wise {r['wise']:g}, {r['trained_blocks']} trained blocks, {r['steps']} steps",
                  "", f"- one foreign task vector: {r['foreign']:+.2f} (val, mean over task pairs and seeds)",
                  f"- G6 against every merge: {r['g6_gate']['value']}",
                  f"- G6 against the TIES family: {r['g6_gate_ties_family']['value']}", "",
                  "| row | val | test | chosen on val (per seed) |", "|---|---|---|---|"]
        for label in ("pretrained heads", "fine-tuned (own task)", "ensemble (probabilities)", TUNED_ENSEMBLE):
            test = r["test"].get(label)
            lines.append(f"| {label} | {r[label]:.2f} | {'-' if test is None else f'{test:.2f}'} | "
                         + (", ".join(f"scale {v:g}" for v in r["ensemble_scale"]) if label == TUNED_ENSEMBLE
                            else "-") + " |")
        for label, chosen in r["chosen"].items():
            setting = "; ".join(", ".join(f"{k}={v}" for k, v in c.items()) or "-" for c in chosen)
            lines.append(f"| {label} | {r[label]:.2f} | {r['test'][label]:.2f} | {setting} |")
        regrets = r.get("auto_regrets") or ({"auto": r["auto_regret"]} if "auto_regret" in r else {})
        for label, regret in regrets.items():
            lines += ["", f"`{label}` (no labels) against the merge best on val labels (learned rows and `auto` "
                          f"excluded), test points, > 0: auto below it: mean {regret['mean']:+.2f}", ""]
            lines += [f"- seed {p['seed']}: {p['regret']:+.2f} against {p['best_on_val']} "
                      f"({', '.join(f'{k}={v}' for k, v in p['best_setting'].items()) or '-'}); auto chose "
                      f"{_choice(p['auto_chose'])}" for p in regret["per_seed"]]
    text = "\n".join(lines) + "\n"
    if table:
        table.parent.mkdir(parents=True, exist_ok=True)
        table.with_suffix(".md").write_text(text)
        table.with_suffix(".json").write_text(json.dumps(
            {**(extra or {}), "command": command, "machine": machine, "seconds": round(seconds, 1),
             "seeds": list(seeds), "rows": rows}, indent=1, default=float) + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    import torch  # after pin_kernels (see ``benchmarks.suites.__main__``)

    from benchmarks.suites.real import RealConfig
    from benchmarks.suites.training import Log, torch_threads

    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites.regime", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0", help="fine-tuning seeds, comma-separated (default 0)")
    parser.add_argument("--wise", default="0.65,1.0", help="interpolation factors to map (comma-separated)")
    parser.add_argument("--tasks", default="quick,all", help="task sets: quick (the main job's 4), all (8)")
    parser.add_argument("--frozen", default="10",
                        help="lower blocks frozen, comma-separated (10: the suite's upper 2 trained; 8: upper 4)")
    parser.add_argument("--steps", default="180", help="fine-tuning steps, comma-separated (default the suite's 180)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--ties-lams", default=",".join(f"{v:g}" for v in TIES_LAMS),
                        help="TIES's λ grid per unit of a wise-0.65 checkpoint (6 values; default: the suite's)")
    parser.add_argument("--svd", action="store_true", help="TSV-M, Iso-C and Iso-CTS among the merges (val-tuned)")
    parser.add_argument("--table", type=Path, default=None, help="write TABLE.md / TABLE.json")
    parser.add_argument("--mties", action="store_true",
                        help="M-TIES (scoring the trained blocks) and its controls among the merges, on TIES's grid")
    parser.add_argument("--report", type=Path, default=None,
                        help="write every verdict of the suite protocol per lever under REPORT/<lever>/results.md")
    parser.add_argument("--code-version", default=None,
                        help="reuse the replicates that code version measured (10 hex digits; default this tree's), or "
                             "those any of several measured (comma-separated, tried in order)")
    parser.add_argument("--mties-code-version", default=None,
                        help="reuse the M-TIES family's rows that code version measured (default this tree's)")
    parser.add_argument("--design", default="r4", choices=("r4", "r5", "r6"),
                        help="r5: round 5's grids (checkpoint units, the TIES family on λ × k) and parts; r6: the "
                             "registered protocol v6 (benchmarks/PROTOCOL.md, benchmarks.suites.r6; parts "
                             "base,mties,data,learned)")
    parser.add_argument("--extended", action="store_true",
                        help="r6: every axis with the registered extension beyond both ends (benchmarks/PROTOCOL.md)")
    parser.add_argument("--parts", default=",".join(R5_PARTS),
                        help=f"r5: the parts to measure, base first (default: {','.join(R5_PARTS)}; also "
                             f"{','.join(R5_EXTRA_PARTS)})")
    parser.add_argument("--learned", action="append", default=None,
                        help="r5: the learned part's rows, METHOD:OBJECTIVE comma-separated (default: "
                             f"{','.join(f'{m}:{o}' for m, o in R5_LEARNED)}); repeat the flag to join groups "
                             "measured by separate runs, each cached as its own run")
    parser.add_argument("--own", default=",".join(map(str, R5_OWN)),
                        help="r5: images per task in the own-data parts, comma-separated (default: "
                             f"{','.join(map(str, R5_OWN))})")
    parser.add_argument("--learned-own", action="append", default=None,
                        help="r5: the learned_own part's rows, METHOD:OBJECTIVE comma-separated (default: "
                             f"{','.join(f'{m}:{o}' for m, o in R5_LEARNED_OWN)}); repeat the flag to join groups "
                             "measured by separate runs, as --learned")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in (*R5_PARTS, *R5_EXTRA_PARTS)]:
        parser.error(f"--parts: unknown {unknown}; the parts are {', '.join((*R5_PARTS, *R5_EXTRA_PARTS))}")
    if parts[0] != "base" or {"mties", "mties_low"} <= set(parts):
        parser.error("--parts: 'base' first (it carries the reference rows), and 'mties' or 'mties_low', not both "
                     "(they share the M-TIES family's labels)")
    argv = argv if argv is not None else sys.argv[1:]
    command = "python -m benchmarks.suites.regime " + " ".join(record_args(argv, ("--cache", "--table", "--report")))
    seeds = tuple(int(s) for s in args.seeds.split(","))
    versions = args.code_version.split(",") if args.code_version else None
    learned = [[tuple(item.split(":")) for item in group.split(",")] for group in args.learned] if args.learned \
        else [R5_LEARNED]
    learned_own = [[tuple(item.split(":")) for item in group.split(",")] for group in args.learned_own] \
        if args.learned_own else [R5_LEARNED_OWN]
    own = tuple(int(n) for n in args.own.split(","))
    task_sets = {"quick": QUICK_TASKS, "all": RealConfig().tasks}
    log = Log(True, "regime")
    start, load = time.perf_counter(), os.getloadavg()
    torch.use_deterministic_algorithms(True)
    rows = []
    with torch_threads(args.threads):
        levers = [(name, float(wise), int(frozen), int(steps)) for frozen in args.frozen.split(",")
                  for steps in args.steps.split(",") for name in args.tasks.split(",") for wise in args.wise.split(",")]
        for name, wise, frozen, steps in levers:
            cfg = dataclasses.replace(RealConfig(), tasks=tuple(task_sets[name]), wise=wise, seeds=seeds,
                                      frozen=frozen, ft_steps=steps)
            lever = f"q{len(cfg.tasks)}_wise{wise:g}_blocks{cfg.num_layers - frozen}_steps{steps}"
            if args.design == "r6":
                from benchmarks.suites import r6

                rows.append(r6.measure(cfg, args.cache or default_cache(), log, parts, version=versions,
                                       report=args.report / lever if args.report else None, learned=learned,
                                       extended=args.extended))
                log(f"{lever}: G6 {rows[-1]['g6_gate']['value']}")
                text = r6.write(rows, args.table, command, seeds, load, args.threads, time.perf_counter() - start)
                continue
            if args.design == "r5":
                rows.append(measure_round5(cfg, args.cache or default_cache(), log, parts,
                                           version=versions, report=args.report / lever if args.report
                                           else None, learned=learned, learned_own=learned_own, own=own))
                r = rows[-1]
                log(f"{lever}: G6 {r['g6_gate']['value']}; TIES family: {r['g6_gate_ties_family']['value']}")
                text = write_r5(rows, args.table, command, seeds, load, args.threads, time.perf_counter() - start)
                continue
            rows.append(measure(cfg, args.cache or default_cache(), log,
                                tuple(float(v) for v in args.ties_lams.split(",")), svd=args.svd, mties=args.mties,
                                version=versions, mties_version=args.mties_code_version,
                                report=args.report / lever if args.report else None))
            r = rows[-1]
            log(f"q {r['q']}, wise {wise:g}, {12 - frozen} trained blocks, {steps} steps: G6 at scale 20 "
                f"{r['g6_heads_scale']:+.2f}, tuned {r['g6_tuned']:+.2f} (best merge {r['best_merge']})")
            text = write(rows, args.table, command, seeds, load, args.threads, time.perf_counter() - start)
    print(text)
    return 0


if __name__ == "__main__":
    start()
    raise SystemExit(main())
