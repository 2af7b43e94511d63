"""The comparison protocol: every method tuned on val on its own grid, evaluated on test, per fine-tuning replicate.

A *bench* holds the tasks, their frozen heads, and one or more *replicates* (independent builds of the q
fine-tunes, one per fine-tuning seed). Per replicate the protocol measures

* the reference rows: pretrained heads, each fine-tune on its own task, and the ensembles of the q fine-tunes
  (mean of the heads' probabilities — the M-Loss paper's baseline — and mean of the pooled features). With
  ``ensemble_scales`` the probability ensemble also gets its own val search, like every merge: the heads' logit
  scale (how sharp each member's probabilities are, the one knob a mean of probabilities depends on) is chosen on val
  from that grid and the chosen scale evaluated on test (:data:`TUNED_ENSEMBLE`). A single model's accuracy does not
  depend on the scale (argmax of s · cosine), nor does the feature ensemble's, so the chosen value holds for every
  row of the table;
* disentanglement: each task's accuracy with one foreign task vector added (θ₀ + τ_t + τ_p vs θ₀ + τ_t);
* every method: each setting of its grid merged through :func:`hf_mloss.merge` and scored on val; the best one
  (first in grid order on ties) evaluated on test, where the per-image correctness is kept for paired statistics;
  for the trimming methods (:data:`TRIMMING`), how many of the entries the fine-tunes changed the chosen merge
  changes, counted on its weights (:func:`changed_fraction`).

Every method — ablations included — is searched on a grid of the same size (winner's curse: an ablation that
reuses the setting chosen for the method it controls is handicapped). Methods that use data (M-TIES) get the
same unlabeled images in every setting, drawn per replicate.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

import hf_mloss

from benchmarks.suites import registered as R
from benchmarks.suites.training import progress
from hf_mloss.merging.evaluation import ensemble_scores

State = dict[str, torch.Tensor]
SPLITS = ("val", "test")
TUNED_ENSEMBLE = "ensemble (probabilities, tuned scale)"
"""The probability ensemble at the head scale chosen on val (a row only when the protocol runs with
``ensemble_scales``)."""
ENSEMBLE_SCALES = {"main": R.ENSEMBLE_SCALES, "quick": (5.0, 10.0, 20.0, 50.0), "smoke": (5.0, 20.0)}
"""The heads' logit scales the probability ensemble is tuned on, as many as the merges' settings on each grid: from
nearly logit averaging (2) to CLIP's scale (100), geometric."""
TRIMMING = ("ties", "m_ties", "dare_ties")
"""Methods whose chosen merge gets its kept fraction measured (:func:`changed_fraction`)."""


def replicates(n: int, kind: str = "") -> str:
    """``n`` counted in words for tables and logs: "1 replicate", "4 fine-tuning replicates" (``kind``)."""
    return f"{n} {kind + ' ' if kind else ''}replicate{'' if n == 1 else 's'}"


class Head(Protocol):
    def logits(self, features: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Replicate:
    """One build of the fine-tunes: ``finetuned[task]`` is a ``save_pretrained`` folder."""

    seed: int
    finetuned: dict[str, Path]


class Bench(Protocol):
    tasks: list[str]
    heads: Mapping[str, Head]
    base_dir: Path
    replicates: list[Replicate]

    def labels(self, split: str) -> dict[str, torch.Tensor]: ...

    def features(self, state: State, split: str, tasks: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Pooled features of the model whose evaluated weights are ``state``, per task."""

    def state_of(self, model) -> State:
        """The weights :meth:`features` needs, read out of a full model (checks what the bench assumes)."""

    def load_state(self, folder: Path) -> State: ...

    def scoring_data(self, seed: int) -> torch.Tensor:
        """Unlabeled pixel values for data-guided methods (the same for every setting of one replicate)."""

    def own_data(self, task: str, seed: int, n: int) -> torch.Tensor:
        """``n`` unlabeled pixel values of ``task``'s own train split (its fine-tune's own data; the same for every
        setting of one replicate)."""


@dataclass
class MethodSpec:
    label: str
    method: str
    params: dict[str, Any] = field(default_factory=dict)
    """Fixed parameters."""
    grid: dict[str, list[Any]] = field(default_factory=dict)
    """Tuned on val: the cartesian product, in this order."""
    seed_offset: int = 0
    """Added to the replicate's seed for the merge (one draw of a random control per offset)."""
    heads: bool = False
    """Pass the bench's frozen heads (one per task, in task order) to the merge: a learned merge's objective
    (``adamerging`` with ``entropy``, ``disagreement`` or ``output_gap``) reads class outputs through them."""
    own_data: int = 0
    """Give each fine-tune its own task's unlabeled images, this many per task (:meth:`Bench.own_data`), instead of
    the shared pool (0)."""

    def described(self) -> dict[str, Any]:
        """The spec as cache keys describe it (a field at its default that older keys lacked is left out, so rows
        measured before it existed are found again)."""
        out = dataclasses.asdict(self)
        if not self.own_data:
            del out["own_data"]
        return out

    def settings(self) -> list[dict[str, Any]]:
        keys = list(self.grid)
        return [dict(zip(keys, values)) for values in itertools.product(*self.grid.values())] or [{}]


def check_grids(specs: Sequence[MethodSpec], families: Sequence[Sequence[str]] | None = None) -> int:
    """All tuned methods must search the same number of settings; returns it. ``families``: groups of labels that
    must each share one size (a two-parameter family, λ × k, beside the one-parameter methods on λ); returns the
    largest."""
    sizes = {s.label: len(s.settings()) for s in specs if s.grid}
    groups = [list(sizes)] if families is None else [[label for label in family if label in sizes]
                                                     for family in families]
    loose = sorted(set(sizes) - {label for group in groups for label in group})
    if loose:
        raise ValueError(f"tuned methods in no family of equal grids: {loose}")
    for group in groups:
        if len({sizes[label] for label in group}) > 1:
            raise ValueError(f"unequal grid sizes (each method of a family must be tuned on as many settings): "
                             f"{ {label: sizes[label] for label in group} }")
    return max(sizes.values(), default=1)


def accuracy(scores: torch.Tensor, labels: torch.Tensor) -> float:
    return (scores.argmax(-1) == labels).float().mean().item()


def correct(scores: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    return (scores.argmax(-1) == labels).numpy()


def combine(states: Sequence[State], weights: Sequence[float]) -> State:
    """Σ w_i · state_i, key by key (task-vector arithmetic on states)."""
    return {k: sum(w * s[k] for s, w in zip(states, weights)) for k in states[0]}


@dataclass
class ReplicateResult:
    """Everything measured on one replicate (accuracies are fractions; correctness is per test image)."""

    seed: int
    reference: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """label → split → task → accuracy."""
    foreign: dict[str, float] = field(default_factory=dict)
    """'task+foreign' → val accuracy change (fraction) from adding the foreign task vector."""
    methods: dict[str, dict[str, Any]] = field(default_factory=dict)
    """label → {chosen, val_grid, val, test, merge_seconds, eval_seconds}."""
    correct: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    """label → task → bool per test image (reference rows and methods)."""
    trim: dict[str, float] = field(default_factory=dict)
    """Trimming method's label → of the entries some fine-tune changed, the fraction its chosen merge changes (counted
    on the merged weights: :func:`changed_fraction`)."""
    code_version: str = ""
    """The :func:`code_version` that measured these rows (set by :func:`cached_replicate`)."""
    trim_counted: str = "merged weights"
    """How ``trim`` was counted: on the merged weights (this code), or by the budget rule (records made before)."""
    ensemble_scale: dict[str, Any] = field(default_factory=dict)
    """With tuned ensemble scales: {"chosen": scale, "val_grid": [{"scale", "val_mean"}, ...]}."""

    def add_methods(self, other: ReplicateResult) -> None:
        """Take ``other``'s method rows (a methods-only run on the same fine-tunes, ``run_replicate(...,
        references=False)``) beside this result's: a compared family added later without re-running the rest."""
        if other.seed != self.seed:
            raise ValueError(f"method rows of replicate {other.seed} cannot join replicate {self.seed}")
        clash = sorted(set(other.methods) & set(self.methods))
        if clash:
            raise ValueError(f"replicate {self.seed} already has rows {clash}")
        self.methods.update(other.methods)
        self.correct.update({label: other.correct[label] for label in other.methods})
        self.trim.update(other.trim)


def reference_rows(bench: Bench, pretrained: dict[str, dict[str, torch.Tensor]], tuned: dict[str, State],
                   out: ReplicateResult, ensemble_scales: Sequence[float] = ()) -> None:
    """Pretrained heads (``pretrained``: split → task → scores, the same for every replicate), each fine-tune on its
    own task, and both ensembles, on val and test; with ``ensemble_scales``, also :data:`TUNED_ENSEMBLE` (the scale
    chosen on val, first in grid order on ties, recorded in ``out.ensemble_scale``)."""
    chosen = None
    for split in SPLITS:
        labels = bench.labels(split)
        member = {p: bench.features(state, split)  # q full passes
                  for p, state in progress(tuned.items(), f"fine-tunes on {split}", total=len(tuned))}
        rows = {
            "pretrained heads": pretrained[split],
            "fine-tuned (own task)": {t: bench.heads[t].logits(member[t][t]) for t in bench.tasks},
            "ensemble (probabilities)": {t: ensemble_scores([member[p][t] for p in tuned], bench.heads[t],
                                                            "probabilities") for t in bench.tasks},
            "ensemble (features)": {t: ensemble_scores([member[p][t] for p in tuned], bench.heads[t], "features")
                                    for t in bench.tasks},
        }
        if ensemble_scales:
            if chosen is None:  # val comes first: the search
                grid = [{"scale": s, "val_mean": float(np.mean([
                    accuracy(probability_ensemble(bench, member, t, s), labels[t]) for t in bench.tasks]))}
                    for s in ensemble_scales]
                chosen = max(grid, key=lambda g: g["val_mean"])["scale"]  # first of the best
                out.ensemble_scale = {"chosen": chosen, "val_grid": grid}
            rows[TUNED_ENSEMBLE] = {t: probability_ensemble(bench, member, t, chosen) for t in bench.tasks}
        for label, scores in rows.items():
            out.reference.setdefault(label, {})[split] = {t: accuracy(s, labels[t]) for t, s in scores.items()}
            if split == "test":
                out.correct[label] = {t: correct(s, labels[t]) for t, s in scores.items()}


def probability_ensemble(bench: Bench, member: Mapping[str, Mapping[str, torch.Tensor]], task: str,
                         scale: float) -> torch.Tensor:
    """The mean of the members' class probabilities on ``task`` with its head's logit scale set to ``scale``."""
    head = bench.heads[task]
    if not dataclasses.is_dataclass(head) or not hasattr(head, "scale"):
        raise TypeError(f"the head of task {task!r} has no logit scale to tune ({type(head).__name__})")
    return ensemble_scores([member[p][task] for p in member], dataclasses.replace(head, scale=scale),
                           "probabilities")


def foreign_effects(bench: Bench, base: State, tuned: dict[str, State], out: ReplicateResult) -> None:
    """Val accuracy of θ₀ + τ_t + τ_p minus that of θ₀ + τ_t on task t, for every ordered pair t ≠ p."""
    labels = bench.labels("val")
    pairs = [(t, p) for t in bench.tasks for p in bench.tasks if p != t]
    for t, p in progress(pairs, "foreign task vectors"):
        own = out.reference["fine-tuned (own task)"]["val"][t]
        state = combine([tuned[t], tuned[p], base], [1.0, 1.0, -1.0])
        scores = bench.heads[t].logits(bench.features(state, "val", [t])[t])
        out.foreign[f"{t}+{p}"] = accuracy(scores, labels[t]) - own


def evaluate_state(bench: Bench, state: State, split: str) -> dict[str, torch.Tensor]:
    return {t: bench.heads[t].logits(f) for t, f in bench.features(state, split).items()}


def run_method(bench: Bench, replicate: Replicate, spec: MethodSpec, out: ReplicateResult, *,
               num_samples: int, log: Callable[[str], None]) -> State:
    """Tune ``spec`` on val (every setting of its grid), then evaluate the chosen setting on test; returns the
    chosen merge's evaluated weights."""
    method = hf_mloss.methods.get_method(spec.method)
    needs_data = method.needs_data or getattr(method, "chooses_method", False)  # auto compares on the data
    data = bench.scoring_data(replicate.seed) if needs_data and not spec.own_data else None
    models: list[Any] = [str(replicate.finetuned[t]) for t in bench.tasks]
    if spec.own_data:  # each fine-tune with its own task's images, drawn from that task's train split
        models = [{"model": m, "data": bench.own_data(t, replicate.seed, spec.own_data)}
                  for m, t in zip(models, bench.tasks)]
        num_samples = spec.own_data
    labels = {split: bench.labels(split) for split in SPLITS}
    merge_s = eval_s = 0.0
    best = None
    grid = []
    settings = spec.settings()
    for setting in progress(settings, f"{spec.label} ({len(settings)} settings)",
                            enabled=len(settings) > 1 and getattr(log, "enabled", True)):
        start = time.perf_counter()
        heads = {"heads": [bench.heads[t] for t in bench.tasks]} if spec.heads else {}
        options = {"batch_size": 64, **spec.params, **setting, **heads}  # a learned merge may set its own batch
        merged = hf_mloss.merge(str(bench.base_dir), models, spec.method, seed=replicate.seed + spec.seed_offset,
                                progress=False, data=data, num_samples=num_samples, **options)
        total = sum(v.numel() for v in merged.model.state_dict().values() if v.is_floating_point())
        state = bench.state_of(merged.model)
        merge_s += time.perf_counter() - start
        start = time.perf_counter()
        val = {t: accuracy(s, labels["val"][t]) for t, s in evaluate_state(bench, state, "val").items()}
        eval_s += time.perf_counter() - start
        mean = float(np.mean(list(val.values())))
        choice = merged.config.parameters.get("chosen")  # auto: the merge it chose without labels
        grid.append({"setting": setting, "val_mean": mean, **({"auto_chose": choice} if choice else {})})
        if best is None or mean > best[0]:
            best = (mean, setting, val, state)
    mean, setting, val, state = best
    start = time.perf_counter()
    test_scores = evaluate_state(bench, state, "test")
    eval_s += time.perf_counter() - start
    out.methods[spec.label] = {
        "method": spec.method, "params": {**spec.params, **setting}, "chosen": setting, "val_grid": grid,
        "val": val, "test": {t: accuracy(s, labels["test"][t]) for t, s in test_scores.items()},
        "merge_seconds": round(merge_s, 1), "eval_seconds": round(eval_s, 1), "total_numel": total,
    }  # fmt: skip
    out.correct[spec.label] = {t: correct(s, labels["test"][t]) for t, s in test_scores.items()}
    test_mean = 100 * np.mean(list(out.methods[spec.label]["test"].values()))
    log(f"  {spec.label:<28} val {100 * mean:6.2f}  test {test_mean:6.2f}  {setting}  "
        f"(merge {merge_s:.0f} s, eval {eval_s:.0f} s)")
    return state


def cached_replicate(described: Any, folder: Path, seed: int, run: Callable[..., ReplicateResult],
                     log: Callable[[str], None], *, version: str | Sequence[str] | None = None,
                     resumable: bool = False) -> ReplicateResult:
    """One replicate's protocol results (``run()``), cached under ``folder`` by ``described`` (the configuration
    without its seeds, the compared methods, whatever else its numbers depend on), the code version and the seed: a
    run with more replicates, or one stopped half-way, reuses every replicate already measured. ``version``: the
    :func:`code_version` whose results to reuse instead of this tree's (a record made from them must say so), or
    several, tried in order (the parts of one record measured by different trees); a replicate none measured is
    measured by this code and cached under this code's version. The result's ``code_version`` says which code
    measured it. ``resumable``: ``run(partial)`` is given the file its result so far goes to
    (:func:`run_replicate`'s ``partial``), beside the finished one, removed once that is written."""
    import json
    import os
    import pickle

    current = code_version()  # the tree as this process started (see code_version)

    def location(measured_by: str) -> Path:
        key = json.dumps([described, measured_by], sort_keys=True, default=str)
        return Path(folder) / hashlib.sha1(key.encode()).hexdigest()[:10] / f"seed{seed}.pkl"

    reuse = [version] if isinstance(version, str) else list(version or ())
    for measured_by in dict.fromkeys([*reuse, current]):
        path = location(measured_by)
        if path.exists():
            log(f"replicate {seed}: protocol results from the cache ({path.parent.name}, code version {measured_by})")
            result = pickle.loads(path.read_bytes())
            result.code_version = measured_by
            return result
    if version:
        log(f"replicate {seed}: not measured by code version {', '.join(reuse)}; measuring it with this code")
    path = location(current)
    partial = path.with_name(f"seed{seed}.partial.pkl")
    result = run(partial) if resumable else run()
    result.code_version = current
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(result))
    os.replace(tmp, path)
    partial.unlink(missing_ok=True)
    return result


@functools.cache
def code_version() -> str:
    """A short hash of the code a replicate's numbers depend on (the ``hf_mloss`` package and these suites), for
    cache keys: a cached result is reused only by the code that measured it. Hashed once per process, at the first
    call (a suite's entry point makes it as it starts, :func:`benchmarks.suites.__main__.start`), so a tree edited
    while a long run goes on does not relabel the rest of the code that run loaded."""
    return tree_version((Path(hf_mloss.__file__).parent, Path(__file__).parent))


def tree_version(roots: Sequence[Path]) -> str:
    """A short hash of every ``.py`` file under ``roots``, their paths (relative to each root's parent) included."""
    digest = hashlib.sha1()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{path.relative_to(root.parent)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def pretrained_scores(bench: Bench) -> dict[str, dict[str, torch.Tensor]]:
    """The base model's scores under every task's head: split → task → scores (shared by all replicates)."""
    base = bench.load_state(bench.base_dir)
    return {split: evaluate_state(bench, base, split) for split in progress(SPLITS, "pretrained heads")}


def run_replicate(bench: Bench, replicate: Replicate, specs: Sequence[MethodSpec], *, num_samples: int = 128,
                  pretrained: dict[str, dict[str, torch.Tensor]] | None = None, ensemble_scales: Sequence[float] = (),
                  log: Callable[[str], None] = print, references: bool = True,
                  partial: Path | None = None) -> ReplicateResult:
    """The whole protocol on one replicate (see the module docstring); ``pretrained``: :func:`pretrained_scores`,
    computed here when not given; ``ensemble_scales``: the grid the probability ensemble's head scale is tuned on
    (:data:`ENSEMBLE_SCALES`; none: no tuned ensemble row); ``references=False``: the methods only (their rows
    beside reference rows measured by an earlier run on the same fine-tunes). ``partial``: a file the result so far
    is written to after the reference rows and after each method, and resumed from (a stopped run loses at most the
    method it was measuring; the caller keys the file as it keys the finished result)."""
    out = _load_partial(partial, replicate.seed, log) if partial is not None else ReplicateResult(seed=replicate.seed)
    base = bench.load_state(bench.base_dir)
    tuned = {t: bench.load_state(replicate.finetuned[t]) for t in bench.tasks}
    start = time.perf_counter()
    if references and not out.reference:
        log(f"replicate {replicate.seed}: the fine-tunes, their ensembles and foreign task vectors on val and test")
        reference_rows(bench, pretrained or pretrained_scores(bench), tuned, out, ensemble_scales)
        foreign_effects(bench, base, tuned, out)
        means = {label: 100 * np.mean(list(r["val"].values())) for label, r in out.reference.items()}
        scale = f"; ensemble scale {out.ensemble_scale['chosen']:g}" if out.ensemble_scale else ""
        log(f"replicate {replicate.seed}: " + ", ".join(f"{k} {v:.2f}" for k, v in means.items())
            + f" (val{scale}; {time.perf_counter() - start:.0f} s)")
        _save_partial(partial, out)
    for spec in specs:
        if spec.label in out.methods:
            continue
        state = run_method(bench, replicate, spec, out, num_samples=num_samples, log=log)
        if spec.method in TRIMMING:
            out.trim[spec.label] = changed_fraction(base, tuned.values(), state)
            log(f"  {spec.label}: changes {100 * out.trim[spec.label]:.1f} % of the entries the fine-tunes changed")
        _save_partial(partial, out)
    return out


def _load_partial(path: Path, seed: int, log: Callable[[str], None]) -> ReplicateResult:
    import pickle

    if not path.exists():
        return ReplicateResult(seed=seed)
    out = pickle.loads(path.read_bytes())
    log(f"replicate {seed}: resuming after {len(out.methods)} measured methods ({path.name})")
    return out


def _save_partial(path: Path | None, out: ReplicateResult) -> None:
    import os
    import pickle

    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(pickle.dumps(out))
    os.replace(tmp, path)


def changed_fraction(base: State, tuned: Iterable[State], merged: State) -> float:
    """Of the entries some fine-tune changed (τ_p ≠ 0 for some p), the fraction the merge changed (merged ≠ base),
    counted on the weights: what a trim kept, after sign election and the union over the fine-tunes. ``base``,
    ``tuned`` and ``merged`` may hold only the trained part (every other entry is unchanged everywhere)."""
    tuned = list(tuned)
    changed = kept = 0
    for key, b in base.items():
        moved = torch.stack([state[key] != b for state in tuned]).any(0)
        changed += int(moved.sum())
        kept += int(((merged[key] != b) & moved).sum())
    return kept / changed if changed else 0.0
