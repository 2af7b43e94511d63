"""Gates: whether a suite is in the regime where merge methods can be ranked, computed on val before any ranking.

* **G1 headroom**: fine-tuned (each on its task) − pretrained heads ≥ 30 points.
* **G2 ensemble**: no task where the ensemble (probabilities) is below the pretrained heads: the experts are of use
  together, so "how far a merge falls from the ensemble" means something. Interference — the mean change of a
  task's accuracy when one foreign task vector is added (θ₀ + τ_t + τ_p vs θ₀ + τ_t) — is reported beside it and
  blocks nothing: merges are compared whatever it is, and the regime M-Loss is about (the M-Loss paper's CLIP tasks,
  long fine-tuning) is one of strong interference. (Up to round 4 G2 also asked interference ≥ −3 points, which
  excluded that regime by construction.)
* **G3 method spread**: best data-free merge − average ≥ 3 points; the merge-vs-ensemble gap (ensemble − average)
  is reported beside it, not gated.
* **G4 scaling**: task arithmetic's chosen λ ≥ 2/q in every replicate, and task arithmetic − average ≥ 1.5 points.
* **G5 statistics**: ≥ 4 fine-tuning replicates (``min_replicates``: a t interval over replicates needs a few degrees
  of freedom) and ≥ 500 val and test images per task; a difference is a ranking only when both its intervals
  (replicate t, item bootstrap) exclude 0.
* **G6 premise** (reported, not blocking): the ensemble − the best merge on val ≥ 3 points, with the 95 % t interval
  over the replicates' differences excluding 0. The ensemble is the probability ensemble at its own tuned head scale
  where the protocol tuned one (:data:`~benchmarks.suites.protocol.TUNED_ENSEMBLE`), else at the heads' scale; the
  best merge is the merge row with the highest val mean, each merge at its own tuned setting. M-Loss measures how
  far a merge's activations fall from the ensemble's; where the ensemble is not clearly above every merge, "M-Loss
  premise absent" is printed: M-TIES's comparisons then test its trimming rule, not the premise. (In the M-Loss
  paper's setting, CLIP ViT-B/32 on 8 tasks, the ensemble is 78.56 against TIES's 72.42.)

Every gate is computed on the checkpoints the merges use (no rescaling between experts and merges). All numbers are
means over replicates of unweighted task means, in points. The thresholds and which gates block are the registered
protocol's (:mod:`benchmarks.suites.registered`, ``benchmarks/PROTOCOL.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.suites import registered as R
from benchmarks.suites.protocol import TUNED_ENSEMBLE, ReplicateResult, replicates
from benchmarks.suites.stats import replicate_t

DATA_FREE_EXCLUDED = ("average",)
PREMISE_MARGIN = R.G6_MARGIN
"""G6: the ensemble must beat the best merge by this many val points (and its t interval exclude 0)."""


@dataclass(frozen=True)
class Gate:
    name: str
    passed: bool
    value: str
    rule: str
    blocking: bool = True
    """A failing blocking gate ranks nothing; a non-blocking one is reported beside the rankings."""

    def line(self) -> str:
        if self.rule == "reported":  # a measurement beside the gates (G2 interference)
            return f"{self.name}: {self.value} (reported, not blocking)"
        state = ("PASS" if self.passed else "FAIL") if self.blocking else ("present" if self.passed else "ABSENT")
        return f"{self.name} {state}: {self.value} (needs {self.rule}{'' if self.blocking else '; not blocking'})"

    def to_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "value": self.value, "rule": self.rule,
                "blocking": self.blocking}


PREMISE_ABSENT = "M-Loss premise absent"


def all_pass(gates: Sequence[Gate]) -> bool:
    """Whether every blocking gate passes (the suite may rank)."""
    return all(g.passed for g in gates if g.blocking)


def val_mean(results: Sequence[ReplicateResult], label: str) -> float:
    """Mean over replicates of the val task-mean of a reference row or a method, in points."""
    rows = [r.reference[label]["val"] if label in r.reference else r.methods[label]["val"] for r in results]
    return 100 * float(np.mean([np.mean(list(row.values())) for row in rows]))


def val_means(results: Sequence[ReplicateResult], label: str) -> list[float]:
    """Each replicate's val task-mean of a reference row or a method, in points."""
    rows = [r.reference[label]["val"] if label in r.reference else r.methods[label]["val"] for r in results]
    return [100 * float(np.mean(list(row.values()))) for row in rows]


def ensemble_row(results: Sequence[ReplicateResult]) -> str:
    """The ensemble G6 compares with: the tuned-scale probability ensemble where the protocol has it."""
    return TUNED_ENSEMBLE if TUNED_ENSEMBLE in results[0].reference else "ensemble (probabilities)"


def premise_gate(results: Sequence[ReplicateResult], merges: Sequence[str], family: str = "") -> Gate:
    """G6 (see the module docstring): ensemble − best merge on val, per replicate, its mean and 95 % t interval;
    ``family``: the merges are one family (``"TIES family"``), named in the gate."""
    ensemble = ensemble_row(results)
    return premise_gate_of({label: val_means(results, label) for label in (ensemble, *merges)}, ensemble, merges,
                           family)


def premise_gate_of(per_seed: dict[str, Sequence[float]], ensemble: str, merges: Sequence[str],
                    family: str = "") -> Gate:
    """:func:`premise_gate` from each replicate's val means (``per_seed``: label → one value per replicate, in
    points, as records keep them): what a record joined from runs on other seeds recomputes."""
    top = max(merges, key=lambda label: float(np.mean(per_seed[label])))
    per = [e - m for e, m in zip(per_seed[ensemble], per_seed[top])]
    mean = float(np.mean(per))
    low, high, _ = replicate_t(tuple(per), R.LEVEL)
    passed = mean >= PREMISE_MARGIN and low is not None and low > 0
    interval = "no t interval (1 replicate)" if low is None else f"t 95 % [{low:+.2f}, {high:+.2f}]"
    return Gate(f"G6 premise ({family})" if family else "G6 premise", passed,
                f"{ensemble} − best merge ({top}) = {mean:+.2f} ({interval}; per replicate "
                + ", ".join(f"{v:+.2f}" for v in per) + ")" + ("" if passed else f": {PREMISE_ABSENT}"),
                f"≥ +{PREMISE_MARGIN:g} with the t interval above 0",
                blocking=next(r.blocking for r in R.GATES if r.gate == ("G6t" if family else "G6")))


def val_task_mean(results: Sequence[ReplicateResult], label: str, task: str) -> float:
    return 100 * float(np.mean([r.reference[label]["val"][task] for r in results]))


TIES_LOW = "ties (k below 0.1)"
"""TIES on a grid below its own k = 0.1 (round 5's ``ties_low`` part): one method with ``ties``, so in its family."""
TIES_SPARSE = "ties (k 0.01-0.03, λ 3-14)"
"""TIES past the corner ``ties_low`` chose (k 0.03, λ 3): round 5's ``ties_sparse`` part, in the TIES family."""
TIES_HIGH = "ties (λ 1.3-3)"
DARE_HIGH = "dare_ties (p 0.7-0.9, λ 1.3-3)"
"""TIES and DARE-TIES above the λ = 1.3 (and p = 0.7) that ends their grids: round 5's ``lam_high`` part."""
TIES_LOW_WIDE = "ties (k 0.03-0.07, λ 3-7.5)"
"""TIES on ``ties_low``'s k past its λ = 3 (round 5's ``ties_low_wide`` part), in the TIES family."""
DARE_SPARSE = "dare_ties (p 0.7-0.9)"
"""DARE-TIES past the p = 0.7 that ends its grid, on its own λ grid: round 5's ``dare_sparse`` part."""
TIES_FAMILY = ("average", "task_arithmetic", "ties", TIES_LOW, TIES_SPARSE, TIES_LOW_WIDE, TIES_HIGH, "dare_ties",
               DARE_HIGH, DARE_SPARSE)
"""The classic merges M-TIES is compared with in the M-Loss paper (and in its regime): G6 is also reported against
these alone."""


def compute_gates(results: Sequence[ReplicateResult], *, data_free: Sequence[str], tasks: Sequence[str],
                  val_size: int, test_size: int, merges: Sequence[str] = (),
                  min_replicates: int = R.G5_REPLICATES) -> list[Gate]:
    """G1-G6 (see the module docstring); ``data_free`` are the labels of the data-free merges besides average,
    ``merges`` every merge's label (G6; default: ``data_free`` and average). G6 is given against every merge and,
    where other merges were measured too, against the TIES family (:data:`TIES_FAMILY`)."""
    pre, own = val_mean(results, "pretrained heads"), val_mean(results, "fine-tuned (own task)")
    avg = val_mean(results, "average")
    foreign = 100 * float(np.mean([v for r in results for v in r.foreign.values()]))
    worst = min(tasks, key=lambda t: val_task_mean(results, "ensemble (probabilities)", t)
                - val_task_mean(results, "pretrained heads", t))
    worst_gap = val_task_mean(results, "ensemble (probabilities)", worst) - val_task_mean(results, "pretrained heads",
                                                                                           worst)
    best = max(data_free, key=lambda label: val_mean(results, label))
    spread = val_mean(results, best) - avg
    ens_gap = val_mean(results, ensemble_row(results)) - avg
    q = len(tasks)
    lams = [r.methods["task_arithmetic"]["chosen"].get("lam") for r in results]
    ta_gain = val_mean(results, "task_arithmetic") - avg
    merges = list(merges) or [*data_free, "average"]
    family = [m for m in TIES_FAMILY if m in merges]
    extra = [premise_gate(results, family, "TIES family")] if family and set(family) != set(merges) else []
    blocking = {rule.name: rule.blocking for rule in R.GATES}
    return [
        Gate("G1 headroom", own - pre >= R.G1_HEADROOM,
             f"fine-tuned {own:.2f} − pretrained heads {pre:.2f} = {own - pre:+.2f}", f"≥ +{R.G1_HEADROOM:g}",
             blocking["G1 headroom"]),
        Gate("G2 ensemble", worst_gap >= R.G2_ENSEMBLE, f"lowest ensemble − pretrained heads {worst_gap:+.2f} ({worst})",
             f"≥ {R.G2_ENSEMBLE:g} on every task", blocking["G2 ensemble"]),
        Gate("G2 interference", True, f"one foreign task vector {foreign:+.2f} on average", "reported",
             blocking=blocking["G2 interference"]),
        Gate("G3 method spread", spread >= R.G3_SPREAD,
             f"best data-free merge ({best}) − average = {spread:+.2f}; ensemble − average = {ens_gap:+.2f}",
             f"spread ≥ +{R.G3_SPREAD:g}", blocking["G3 method spread"]),
        Gate("G4 scaling", all(lam is not None and lam >= R.G4_LAMBDA_TIMES_Q / q for lam in lams)
             and ta_gain >= R.G4_GAIN,
             f"task arithmetic λ chosen {lams} (2/q = {R.G4_LAMBDA_TIMES_Q / q:.2f}); task arithmetic − average = "
             f"{ta_gain:+.2f}", f"λ ≥ {R.G4_LAMBDA_TIMES_Q:g}/q in every replicate and ≥ +{R.G4_GAIN:g}",
             blocking["G4 scaling"]),
        Gate("G5 statistics", len(results) >= min_replicates and min(val_size, test_size) >= R.G5_IMAGES,
             f"{replicates(len(results), 'fine-tuning')}, {val_size} val / {test_size} test images per task",
             f"≥ {replicates(min_replicates)}, ≥ {R.G5_IMAGES} images per task and split", blocking["G5 statistics"]),
        premise_gate(results, merges),
        *extra,
    ]  # fmt: skip
