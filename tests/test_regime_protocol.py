"""The protocol pieces the regime record rests on: the ensemble's tuned head scale, G6 as the premise gate, the
kept fraction counted on merged weights, one test per pair, and result caches keyed by the code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_mloss
from benchmarks.suites.gates import compute_gates, premise_gate
from benchmarks.suites.protocol import TUNED_ENSEMBLE, ReplicateResult, changed_fraction, code_version, reference_rows
from benchmarks.suites.report import default_pairs, ordering
from benchmarks.suites.training import TaskHead

TASKS = ["t0", "t1", "t2"]


class ScaleBench:
    """Three tasks of two classes, every item of class 0. On its own task a member's features are [10, 0] (right,
    sure); on another task's items [0, 1] (wrong, mild). Heads: identity at logit scale 10."""

    tasks = TASKS

    def __init__(self, n: int = 4) -> None:
        self.n = n
        self.heads = {t: TaskHead(weight=torch.eye(2), normalize=False, scale=10.0) for t in TASKS}

    def labels(self, split):
        return {t: torch.zeros(self.n, dtype=torch.long) for t in TASKS}

    def features(self, state, split, tasks=None):
        own = state["task"]
        return {t: torch.tensor([10.0, 0.0] if t == own else [0.0, 1.0]).repeat(self.n, 1) for t in tasks or TASKS}


def test_the_ensemble_scale_is_chosen_on_val_and_used_on_test():
    """At scale 10 the two mildly wrong members outvote the sure one (mean p(0) = 1/3 + 2/3·σ(−10) < ½); at scale
    0.1 they are nearly uniform and the sure member decides. Single-model rows do not depend on the scale."""
    bench = ScaleBench()
    tuned = {t: {"task": t} for t in TASKS}
    pretrained = {s: {t: torch.zeros(bench.n, 2) for t in TASKS} for s in ("val", "test")}
    out = ReplicateResult(seed=0)
    reference_rows(bench, pretrained, tuned, out, ensemble_scales=(10.0, 0.1, 1.0))
    assert out.ensemble_scale["chosen"] == 0.1
    assert [g["val_mean"] for g in out.ensemble_scale["val_grid"]] == [0.0, 1.0, 1.0]  # first of the best
    assert out.reference["ensemble (probabilities)"]["test"] == {t: 0.0 for t in TASKS}  # the heads' own scale
    assert out.reference[TUNED_ENSEMBLE]["test"] == {t: 1.0 for t in TASKS}
    assert out.correct[TUNED_ENSEMBLE]["t0"].all()
    assert out.reference["fine-tuned (own task)"]["test"] == {t: 1.0 for t in TASKS}
    untuned = ReplicateResult(seed=0)
    reference_rows(bench, pretrained, tuned, untuned)
    assert TUNED_ENSEMBLE not in untuned.reference and not untuned.ensemble_scale


def _replicate(seed: int, ensemble: float, merge: float, tuned: float | None = None) -> ReplicateResult:
    row = lambda v: {"val": {t: v for t in TASKS}}
    r = ReplicateResult(seed=seed)
    r.reference = {"pretrained heads": row(0.2), "fine-tuned (own task)": row(0.9), "ensemble (probabilities)":
                   row(ensemble)}
    if tuned is not None:
        r.reference[TUNED_ENSEMBLE] = row(tuned)
    r.methods = {"average": {**row(merge - 0.05), "chosen": {}},
                 "task_arithmetic": {**row(merge), "chosen": {"lam": 1.0}},
                 "ties": {**row(merge - 0.01), "chosen": {"lam": 1.0}}}
    r.foreign = {"t0+t1": 0.0}
    return r


@pytest.mark.parametrize(("gaps", "passed"), [
    ((4.0, 5.0, 4.5, 5.5), True),      # ≥ 3 and the interval above 0
    ((2.5, 2.6, 2.4, 2.5), False),     # clearly above 0, below the margin
    ((-10.0, 20.0, -5.0, 15.0), False),  # mean +5, the interval spans 0
    ((6.0,), False),                   # one replicate: no interval
])
def test_premise_gate_needs_the_margin_and_a_t_interval_above_zero(gaps, passed):
    results = [_replicate(i, 0.6 + g / 100, 0.6) for i, g in enumerate(gaps)]
    gate = premise_gate(results, ["average", "task_arithmetic", "ties"])
    assert gate.passed is passed and not gate.blocking
    assert f"best merge (task_arithmetic) = {sum(gaps) / len(gaps):+.2f}" in gate.value
    assert ("M-Loss premise absent" in gate.value) is not passed


def test_premise_gate_compares_with_the_tuned_ensemble_where_there_is_one():
    """The fixed-scale ensemble is 10 points below the merges, the tuned one 5 above: G6 reads the tuned one."""
    results = [_replicate(i, 0.5, 0.6, tuned=0.65 + i / 1000) for i in range(4)]
    gates = compute_gates(results, data_free=["task_arithmetic", "ties"], tasks=TASKS, val_size=500, test_size=500,
                          merges=["average", "task_arithmetic", "ties"])
    g6 = gates[-1]
    assert g6.name == "G6 premise" and g6.passed
    assert g6.value.startswith(f"{TUNED_ENSEMBLE} − best merge (task_arithmetic) = +5.15")
    assert "ensemble − average = +10.15" in next(g.value for g in gates if g.name == "G3 method spread")  # same one


def test_changed_fraction_is_counted_on_the_merged_weights():
    """Entries 0, 2 and 3 changed in some fine-tune; the merge moved entry 0 of them (entry 5 moved too, but no
    fine-tune changed it: not counted)."""
    base = {"w": torch.zeros(6), "b": torch.ones(2)}
    tuned = [{"w": torch.tensor([1.0, 0, 0, 2, 0, 0]), "b": torch.ones(2)},
             {"w": torch.tensor([0.0, 0, 3, 0, 0, 0]), "b": torch.tensor([1.0, 4.0])}]
    merged = {"w": torch.tensor([0.5, 0, 0, 0, 0, 7]), "b": torch.tensor([1.0, 2.0])}
    assert changed_fraction(base, tuned, merged) == pytest.approx(2 / 4)  # w[0] and b[1] of w[0, 2, 3], b[1]
    assert changed_fraction(base, tuned, base) == 0.0
    assert changed_fraction(base, [base], merged) == 0.0  # nothing changed: nothing to keep


def test_each_pair_is_tested_once_in_the_ordering_direction():
    labels = ["pretrained heads", "fine-tuned (own task)", "ensemble (probabilities)", TUNED_ENSEMBLE,
              "average", "task_arithmetic", "ties"]
    pairs = default_pairs(labels)
    assert ("ties", "task_arithmetic") in pairs and ("task_arithmetic", "ties") not in pairs
    assert len({frozenset(p) for p in pairs}) == len(pairs)
    assert (TUNED_ENSEMBLE, "ties") in pairs and ("ensemble (probabilities)", "ties") not in pairs
    assert ordering(labels)[3] == TUNED_ENSEMBLE


def test_code_version_changes_with_the_code_but_not_within_a_run(tmp_path, monkeypatch):
    """The hash follows every file of the tree; a process keeps the one it started with, so an edit during a long
    run does not file the rest of that run's results under code it never loaded."""
    import benchmarks.suites.protocol as P

    fake = tmp_path / "suites"
    fake.mkdir()
    (fake / "protocol.py").write_text("x = 1\n")
    first = P.tree_version([fake])
    assert len(first) == 10 and P.tree_version([fake]) == first
    (fake / "protocol.py").write_text("x = 2\n")
    assert P.tree_version([fake]) != first
    (fake / "other.py").write_text("")
    assert len({first, P.tree_version([fake]), P.tree_version([fake.parent])}) == 3

    started = code_version()
    monkeypatch.setattr(P, "__file__", str(fake / "protocol.py"))  # as if the suites were edited
    assert code_version() == started
    P.code_version.cache_clear()  # a new process reads the edited tree
    try:
        assert code_version() not in (started, first)
    finally:
        P.code_version.cache_clear()


def test_lever_map_grids_cover_the_same_multiples_of_the_trained_task_vector():
    """At wise w a checkpoint holds w·τ; the map's grids are divided by w / 0.65, so λ·w is the same at every
    lever, and task arithmetic's also by q / 4."""
    from benchmarks.suites.regime import lever_specs

    def grids(q, wise):
        return {s.label: [lam * wise for lam in s.grid.get("lam", [])] for s in lever_specs(q, wise)}

    for q in (4, 8):
        at_065, at_1 = grids(q, 0.65), grids(q, 1.0)
        for label in ("task_arithmetic", "ties"):
            assert at_1[label] == pytest.approx(at_065[label], rel=5e-3)  # grids are rounded to 3 decimals
    assert grids(8, 1.0)["task_arithmetic"] == pytest.approx([v / 2 for v in grids(4, 1.0)["task_arithmetic"]],
                                                            rel=5e-3)  # grids are rounded to 3 decimals
    ties = next(s for s in lever_specs(4, 1.0) if s.label == "ties")
    assert ties.params == {"scope": "global", "budget": "changed", "k": 0.2} and len(ties.settings()) == 6


def test_lever_map_svd_rows_use_the_suite_grids_in_the_same_unit():
    from benchmarks.suites.regime import SVD_GRIDS, lever_specs

    specs = {s.label: s for s in lever_specs(8, 1.0, svd=True)}
    assert list(specs) == ["average", "task_arithmetic", "ties", "tsv_m", "iso_c", "iso_cts"]
    assert specs["tsv_m"].grid["lam"] == [round(v * 0.65, 3) for v in SVD_GRIDS["tsv_m"]]
    assert specs["iso_cts"].grid == specs["iso_c"].grid and len(specs["iso_c"].settings()) == 6
    assert [s.label for s in lever_specs(8, 1.0)] == ["average", "task_arithmetic", "ties"]


def test_lever_map_table_gives_g6_per_seed_with_its_interval():
    from benchmarks.suites.regime import markdown

    gate = {"value": "ensemble − best merge (iso_cts) = -12.00 (t 95 % [-14.00, -10.00]; per replicate -11.00, -13.00)"}
    row = {"q": 8, "wise": 1.0, "trained_blocks": 4, "pretrained heads": 40.0, "fine-tuned (own task)": 85.0,
           "foreign": -1.5, "ensemble (probabilities)": 60.0, TUNED_ENSEMBLE: 66.0, "average": 55.0,
           "task_arithmetic": 70.0, "ties": 71.0, "tsv_m": 77.0, "iso_c": 76.0, "iso_cts": 78.0,
           "best_merge": "iso_cts", "g6_heads_scale": -18.0, "g6_tuned": -12.0, "ensemble_scale": [5.0, 5.0],
           "edges": [], "test": {}, "g6_gate": gate, "g6_gate_without_svd": {"value": "… = -5.00 (…)"}}
    text = markdown([row], "cmd", (0, 1), "2 CPU cores", 12.0)
    assert "| 8 | 1 | 4 | 180 | 77.00 | 76.00 | 78.00 | iso_cts | **-12.00** |" in text
    assert "- q 8, wise 1, 4 trained blocks: " + gate["value"] in text
    assert "- q 8, wise 1, 4 trained blocks, without the SVD merges: … = -5.00 (…)" in text
    assert "66.00 (5) |" in text  # the tuned scale, once when every seed chose it


def test_replicate_results_are_cached_by_description_code_and_seed(tmp_path, monkeypatch):
    from benchmarks.suites import protocol

    calls = []

    def run(seed):
        def measure():
            calls.append(seed)
            return ReplicateResult(seed=seed, trim={"ties": seed / 10})
        return measure

    def cached(described, seed):
        return protocol.cached_replicate(described, tmp_path, seed, run(seed), lambda message: None)

    assert cached(["a"], 0).trim == cached(["a"], 0).trim == {"ties": 0.0} and calls == [0]
    cached(["a"], 1)
    cached(["b"], 0)
    first = protocol.code_version()
    monkeypatch.setattr(protocol, "code_version", lambda: "other code")
    cached(["a"], 0)
    assert calls == [0, 1, 0, 0]
    # another tree may reuse what a named code version measured (its record says so), and nothing else
    reused = protocol.cached_replicate(["a"], tmp_path, 1, run(1), lambda message: None, version=first)
    assert reused.trim == {"ties": 0.1} and calls == [0, 1, 0, 0] and reused.code_version == first
    # a replicate the named version did not measure is measured by this code, and said to be
    fresh = protocol.cached_replicate(["a"], tmp_path, 2, run(2), lambda message: None, version=first)
    assert calls == [0, 1, 0, 0, 2] and fresh.code_version == "other code"
    again = protocol.cached_replicate(["a"], tmp_path, 2, run(2), lambda message: None, version=first)
    assert calls == [0, 1, 0, 0, 2] and again.code_version == "other code"
    # several versions, tried in order: each replicate comes from the first that measured it
    monkeypatch.setattr(protocol, "code_version", lambda: "third code")
    mixed = [protocol.cached_replicate(["a"], tmp_path, seed, run(seed), lambda message: None,
                                       version=["unknown", first, "other code"]) for seed in (0, 1, 2)]
    assert calls == [0, 1, 0, 0, 2] and [r.code_version for r in mixed] == [first, first, "other code"]


def test_lever_map_mties_rows_are_the_suite_family_on_the_ties_grid():
    from benchmarks.suites.regime import lever_specs
    from benchmarks.suites.report import CONTROLS, RANDOM

    specs = {s.label: s for s in lever_specs(8, 1.0, svd=True, mties_layers=[8, 9, 10, 11])}
    family = [label for label in specs if label.startswith("m_ties")]
    assert family[0] == "m_ties" and "m_ties (e=0)" in family and len(family) == 7
    assert {c for c in CONTROLS if c != RANDOM} <= set(family)
    assert sum(label.startswith(RANDOM[:-1] + ", draw") for label in family) == 3
    for label in family:
        assert specs[label].grid == {"k": [0.2], "lam": specs["ties"].grid["lam"]}
        assert specs[label].params["layers"] == [8, 9, 10, 11]
    assert [s.label for s in lever_specs(8, 1.0, svd=True)] == [l for l in specs if l not in family]


def test_lever_map_table_states_g6_per_lever():
    from benchmarks.suites.regime import markdown

    row = {"q": 4, "wise": 1.0, "pretrained heads": 40.0, "fine-tuned (own task)": 85.0, "foreign": -1.5,
           "ensemble (probabilities)": 60.0, TUNED_ENSEMBLE: 66.0, "average": 55.0, "task_arithmetic": 70.0,
           "ties": 71.0, "best_merge": "ties", "g6_heads_scale": -11.0, "g6_tuned": -5.0, "ensemble_scale": [5.0],
           "edges": ["ties: lam=1.04"], "test": {"ties": 70.5}}
    text = markdown([row], "cmd", (0,), "2 CPU cores", 12.0)
    assert "| 4 | 1 | 2 | 180 | 40.00 | 85.00 | -1.50 | 60.00 | 66.00 (5) | 55.00 | 70.00 | 71.00 | ties | -11.00 | **-5.00** |" in text
    assert "q 4, wise 1: ties: lam=1.04" in text and "one seed gives no interval" in text


def test_learned_probe_compares_three_kinds_of_rows_on_equal_grids():
    """Val-tuned rows search as many settings as each other, in units of the trained task vector; defaults and
    learned rows search none; only the objectives that read class outputs get the heads."""
    from benchmarks.suites.learned import LEARNED, kind, learned_specs
    from benchmarks.suites.protocol import check_grids

    specs = learned_specs(8, 1.0, steps=5, lr=1e-3, batch=16)
    assert check_grids(specs) == 6
    kinds = {s.label: kind(s.label) for s in specs}
    assert sum(k == "val-tuned" for k in kinds.values()) == 5 and sum(k == "default" for k in kinds.values()) == 5
    learned = [s for s in specs if kinds[s.label] == "learned"]
    assert [(s.method, s.params["objective"]) for s in learned] == list(LEARNED)
    assert all(s.heads is (s.params["objective"] != "mloss") for s in learned)
    assert all(s.params["batch_size"] == 16 and s.params["steps"] == 5 and not s.grid for s in learned)
    tsv = next(s for s in specs if s.label == "tsv_m (val-tuned)")
    assert tsv.grid["lam"] == pytest.approx([v * 0.65 for v in (1.0, 1.5, 2.0, 2.5, 3.0, 4.0)], abs=1e-3)
    assert all(not s.grid and not s.params.get("lam") for s in specs if kinds[s.label] == "default")
    row, = [s for s in learned_specs(8, 1.0, steps=5, lr=None, batch=16, learned=[("adarank_tsv+lam", "disagreement")])
            if kind(s.label) == "learned"]
    assert (row.label, row.method, row.params["learn_lam"]) == ("adarank_tsv+lam (disagreement)", "adarank_tsv", True)
    with pytest.raises(ValueError, match="unknown learned row"):
        learned_specs(8, 1.0, steps=5, lr=None, batch=16, learned=[("adamerging+lam", "entropy")])


def test_learned_probe_table_states_the_goal_against_both_baselines():
    from benchmarks.suites.learned import markdown

    rows = {"task_arithmetic (val-tuned)": {"kind": "val-tuned", "val": 70.0, "test": 69.0, "chosen": [{"lam": 0.5}]},
            "tsv_m (default)": {"kind": "default", "val": 66.0, "test": 65.0},
            "adamerging (entropy)": {"kind": "learned", "val": 69.0, "test": 68.5}}
    record = {"q": 8, "wise": 1.0, "trained_blocks": 2, "seeds": [0], "num_samples": 128, "rows": rows,
              "best_tuned": "task_arithmetic (val-tuned)", "best_default": "tsv_m (default)"}
    text = markdown(record, "cmd", "2 CPU cores", 1.0)
    assert "| adamerging (entropy) | learned | 69.00 | 68.50 | -0.50 | +3.50 |  |  |" in text
    assert "Learned row with the best val: adamerging (entropy), -0.50 test points" in text and "goal" not in text


def test_learned_probe_chooses_its_best_rows_on_val_never_on_test():
    from benchmarks.suites.learned import best_rows, markdown

    rows = {"ties (val-tuned)": {"kind": "val-tuned", "val": 71.0, "test": 60.0},
            "tsv_m (val-tuned)": {"kind": "val-tuned", "val": 70.0, "test": 75.0},
            "iso_c (default)": {"kind": "default", "val": 66.0, "test": 61.0},
            "tsv_m (default)": {"kind": "default", "val": 65.0, "test": 70.0},
            "adamerging (entropy)": {"kind": "learned", "val": 69.0, "test": 50.0},
            "adamerging (mloss)": {"kind": "learned", "val": 60.0, "test": 80.0}}
    assert best_rows(rows) == ("ties (val-tuned)", "iso_c (default)")
    record = {"q": 8, "wise": 1.0, "trained_blocks": 2, "seeds": [0, 1], "num_samples": 128, "rows": rows,
              "best_tuned": "ties (val-tuned)", "best_default": "iso_c (default)"}
    assert "Learned row with the best val: adamerging (entropy)" in markdown(record, "cmd", "2 CPU cores", 1.0)


def test_a_methods_only_run_joins_the_replicate_it_was_measured_on():
    from benchmarks.suites.protocol import ReplicateResult

    rows = ReplicateResult(seed=2, reference={"fine-tuned (own task)": {}}, methods={"ties": {"val": {"a": 0.5}}},
                           correct={"ties": {"a": np.array([True])}}, trim={"ties": 0.2})
    family = ReplicateResult(seed=2, methods={"m_ties": {"val": {"a": 0.6}}},
                             correct={"m_ties": {"a": np.array([False])}}, trim={"m_ties": 0.18})
    rows.add_methods(family)
    assert set(rows.methods) == {"ties", "m_ties"} and rows.trim == {"ties": 0.2, "m_ties": 0.18}
    assert rows.correct["m_ties"]["a"].tolist() == [False] and "fine-tuned (own task)" in rows.reference
    with pytest.raises(ValueError, match="already has rows"):
        rows.add_methods(family)
    with pytest.raises(ValueError, match="replicate 3 cannot join replicate 2"):
        rows.add_methods(ReplicateResult(seed=3))


def test_lever_map_table_lists_the_mties_family_with_its_choices():
    from benchmarks.suites.regime import markdown

    row = {"q": 8, "wise": 1.0, "trained_blocks": 4, "steps": 180, "pretrained heads": 40.0,
           "fine-tuned (own task)": 83.0, "foreign": -3.0, "ensemble (probabilities)": 60.0,
           TUNED_ENSEMBLE: 65.0, "average": 50.0, "task_arithmetic": 65.0, "ties": 70.0,
           "best_merge": "ties", "g6_heads_scale": -10.0, "g6_tuned": -5.0, "ensemble_scale": [5.0], "edges": [],
           "test": {}, "code_version": "aaaaaaaaaa", "mties_code_version": "bbbbbbbbbb",
           "mties_family": {"m_ties": {"val": 71.25, "test": 70.5, "chosen": [{"k": 0.2, "lam": 1.04}]}}}
    text = markdown([row], "cmd", [0], "machine", 1.0)
    assert "| 8 | 1 | 4 | m_ties | 71.25 | 70.50 | 1.04 |" in text
    assert "aaaaaaaaaa, bbbbbbbbbb" in text


def test_a_stopped_replicate_resumes_after_its_last_measured_method(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from benchmarks.suites import protocol
    from benchmarks.suites.protocol import MethodSpec

    bench = SimpleNamespace(base_dir="base", tasks=["a"], load_state=lambda folder: {"w": torch.zeros(2)})
    replicate = SimpleNamespace(seed=5, finetuned={"a": "ft"})
    specs = [MethodSpec("first", "ties"), MethodSpec("second", "task_arithmetic"), MethodSpec("third", "ties")]
    measured, stop_at, references = [], {"second"}, []

    def reference_rows(bench, pretrained, tuned, out, scales):
        references.append(1)
        out.reference["fine-tuned (own task)"] = {"val": {"a": 0.9}}

    monkeypatch.setattr(protocol, "reference_rows", reference_rows)
    monkeypatch.setattr(protocol, "foreign_effects", lambda *args: None)

    def run_method(bench, replicate, spec, out, **kwargs):
        if spec.label in stop_at:
            raise KeyboardInterrupt  # the run is stopped while it measures "second"
        measured.append(spec.label)
        out.methods[spec.label] = {"val": {"a": len(measured)}}
        out.correct[spec.label] = {"a": np.array([True])}
        return {"w": torch.ones(2)}

    monkeypatch.setattr(protocol, "run_method", run_method)
    monkeypatch.setattr(protocol, "code_version", lambda: "code")
    run = lambda partial: protocol.run_replicate(bench, replicate, specs, pretrained={"val": {}}, partial=partial,
                                                 log=lambda message: None)
    with pytest.raises(KeyboardInterrupt):
        protocol.cached_replicate(["m"], tmp_path, 5, run, lambda message: None, resumable=True)
    assert measured == ["first"] and len(list(tmp_path.rglob("seed5.partial.pkl"))) == 1 and references == [1]
    stop_at.clear()
    result = protocol.cached_replicate(["m"], tmp_path, 5, run, lambda message: None, resumable=True)
    assert measured == ["first", "second", "third"] and list(result.methods) == ["first", "second", "third"]
    assert references == [1] and result.reference["fine-tuned (own task)"]["val"] == {"a": 0.9}  # not re-measured
    assert result.methods["first"]["val"] == {"a": 1} and result.code_version == "code"
    assert set(result.trim) == {"first", "third"}  # the trim measured before the stop is kept
    assert not list(tmp_path.rglob("*.partial.pkl")) and len(list(tmp_path.rglob("seed5.pkl"))) == 1


def test_replicate_cache_keys_stay_what_earlier_runs_wrote(tmp_path, monkeypatch):
    """The key of a cached replicate is the first 10 hex digits of the SHA-1 of json.dumps([described, version]):
    changing it would orphan every replicate measured so far."""
    from benchmarks.suites import protocol

    monkeypatch.setattr(protocol, "code_version", lambda: "e6f6690971")
    protocol.cached_replicate(["lever", {"q": 8}], tmp_path, 0, lambda: protocol.ReplicateResult(seed=0),
                              lambda message: None)
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.pkl")] == ["34c8de2641/seed0.pkl"]


def test_auto_regret_is_taken_against_the_merge_best_on_val_not_on_test():
    """The comparison merge is the one best on val; its test may be higher or lower than auto's (a signed regret)."""
    from benchmarks.suites.regime import _choice, auto_regret

    def row(val, test, chosen=None, grid=()):
        return {"val": {"a": val, "b": val}, "test": {"a": test, "b": test}, "chosen": chosen or {},
                "val_grid": list(grid)}

    chose = {"method": "tsv_m", "parameters": {"lam": 1.5}}
    results = [ReplicateResult(seed=0, methods={  # tsv_m best on val, ties best on test: tsv_m is the comparison
        "ties": row(0.60, 0.80), "tsv_m": row(0.70, 0.70, {"lam": 1.0}),
        "auto": row(0.65, 0.68, grid=[{"setting": {}, "val_mean": 0.65, "auto_chose": chose}])}),
        ReplicateResult(seed=1, methods={
        "ties": row(0.60, 0.60), "tsv_m": row(0.50, 0.50), "auto": row(0.62, 0.64, grid=[{"setting": {}}])})]
    regret = auto_regret(results, ["ties", "tsv_m"])
    first, second = regret["per_seed"]
    assert first["best_on_val"] == "tsv_m" and first["regret"] == pytest.approx(2.0) and first["auto_chose"] == chose
    assert second["best_on_val"] == "ties" and second["regret"] == pytest.approx(-4.0) and second["auto_chose"] is None
    assert regret["mean"] == pytest.approx(-1.0)
    assert _choice(chose) == "tsv_m (lam=1.5)" and _choice(None) == "-"


def test_g3_counts_only_merges_that_read_no_data():
    """auto chooses on the unlabeled data and RegMean needs it: neither is G3's 'best data-free merge'."""
    from benchmarks.suites.run import _uses_data

    assert _uses_data("auto") and _uses_data("regmean_plusplus") and _uses_data("m_ties")
    assert not _uses_data("tsv_m") and not _uses_data("ties")


def test_round5_low_k_part_is_the_mties_family_below_k_02_with_every_setting_valid():
    """The low-k part: M-TIES at e = 0.1 and its four controls, under the family's own labels (so the claim's
    comparisons apply), on one grid reaching below k = 0.2 where every setting keeps 0 <= e < k."""
    from benchmarks.suites.regime import R5_GRIDS, round5_specs
    from benchmarks.suites.report import CONTROLS, E0
    from hf_mloss.methods import get_method

    specs = round5_specs("mties_low", [10, 11])
    labels = [s.label for s in specs]
    assert labels == ["m_ties", E0, f"{CONTROLS[0][:-1]}, draw 1)", *CONTROLS[1:]]
    assert min(R5_GRIDS["m_ties_low"]["k"]) < 0.2 <= max(R5_GRIDS["m_ties_low"]["k"])
    for spec in specs:
        assert spec.grid == R5_GRIDS["m_ties_low"]
        for k in spec.grid["k"]:
            get_method("m_ties").make_params(**{**spec.params, "k": k, "lam": 0.6})  # raises on e >= k
    assert "m_ties (e=0.15)" in [s.label for s in round5_specs("mties", [10, 11])]


def test_round5_own_data_parts_give_each_task_its_own_images_beside_the_pooled_rows():
    """``data_own`` and ``learned_own``: the data-guided and learned merges with each fine-tune given its own task's
    images, at 16 and 64 per task, RegMean(++) at the published λ = 1 and on a λ grid holding 1; rows of their own,
    so the pooled rows (and their cache keys) are unchanged."""
    from benchmarks.suites.protocol import MethodSpec
    from benchmarks.suites.regime import R5_GRIDS, R5_OWN, round5_specs

    own = round5_specs("data_own", [10, 11])
    assert R5_OWN == (16, 64) and {s.own_data for s in own} == {16, 64}
    labels = {s.label: s for s in own}
    for n in R5_OWN:
        for method in ("regmean", "regmean_plusplus"):
            assert labels[f"{method} (own {n}/task)"].grid == {}
            assert labels[f"{method} (own {n}/task, λ on val)"].grid == R5_GRIDS["regmean"]
        assert labels[f"auto (own {n}/task)"].heads and labels[f"auto (own {n}/task)"].method == "auto"
    assert 1.0 in R5_GRIDS["regmean"]["lam"] and len(R5_GRIDS["regmean"]["lam"]) == len(R5_GRIDS["tsv_m"]["lam"])
    learned = round5_specs("learned_own", [10, 11])
    assert [s.label for s in learned[:3]] == ["adamerging (entropy, own 16/task)",
                                              "adamerging (output_gap, own 16/task)",
                                              "adarank_tsv+lam (entropy, own 16/task)"]
    assert all(s.heads and s.params["steps"] == 100 for s in learned) and {s.own_data for s in learned} == {16, 64}
    pooled = round5_specs("data", [10, 11])
    assert all(not s.own_data and "own_data" not in s.described() for s in pooled)  # cache keys as before
    assert MethodSpec("x", "regmean", own_data=16).described()["own_data"] == 16
    one = round5_specs("learned_own", [10, 11], learned_own=[("adamerging", "entropy")], own=(16,))
    assert [(s.label, s.own_data) for s in one] == [("adamerging (entropy, own 16/task)", 16)]
    assert one[0].described() == learned[0].described()  # a subset describes its rows as the whole part does
    assert {s.own_data for s in round5_specs("data_own", [10, 11], own=(64,))} == {64}


def test_round5_learned_own_long_trains_the_same_rows_for_longer_under_labels_of_their_own():
    """``learned_own_long``: ``learned_own``'s rows at :data:`R5_LONG_STEPS` Adam steps, labelled with them, so both
    parts join one record and the 100-step rows (and their cache keys) stay as they are."""
    from benchmarks.suites.regime import R5_LONG_STEPS, round5_specs

    short = round5_specs("learned_own", [10, 11], learned_own=[("adamerging", "entropy")], own=(16,))
    long = round5_specs("learned_own_long", [10, 11], learned_own=[("adamerging", "entropy")], own=(16,))
    assert R5_LONG_STEPS == 500 and [s.label for s in long] == ["adamerging (entropy, own 16/task, 500 steps)"]
    assert long[0].params == {**short[0].params, "steps": 500} and long[0].own_data == 16
    assert long[0].described() != short[0].described()
    smoke = round5_specs("learned_own_long", [10, 11], own=(16,), smoke=True)
    assert {s.params["steps"] for s in smoke} == {4} and all(s.label.endswith(", 4 steps)") for s in smoke)
    both = {s.label for part in ("learned_own", "learned_own_long") for s in round5_specs(part, [10, 11], smoke=True)}
    assert len(both) == 2 * len(round5_specs("learned_own", [10, 11], smoke=True))  # no label measured twice


def test_round5_auto_free_part_holds_every_default_candidate_that_fits_nothing_and_holds_nothing_out():
    """``auto_free``: ``auto`` on each task's own images with the default candidates minus those fitted on the data
    (RegMean++), each on its default grid, so nothing is held out and every candidate sees all the images."""
    from benchmarks.suites.regime import R5_OWN, round5_specs
    from hf_mloss.methods.auto import DEFAULT_CANDIDATES

    specs = round5_specs("auto_free", [10, 11])
    assert [s.own_data for s in specs] == list(R5_OWN) and all(s.method == "auto" and s.heads for s in specs)
    candidates = specs[0].params["candidates"]
    assert "regmean_plusplus" in DEFAULT_CANDIDATES and "regmean_plusplus" not in candidates
    assert candidates == {k: v for k, v in DEFAULT_CANDIDATES.items() if k != "regmean_plusplus"}
    assert "held_out" not in specs[0].params
    assert specs[0].label == "auto (own 16/task, data-free candidates)"


def test_round5_auto_parts_hold_out_one_way_or_cross_fitted_as_their_labels_say():
    """``auto_held_out`` keeps the one-way comparison its records measured; ``auto_cross_fit`` cross-fits."""
    from benchmarks.suites.regime import R5_OWN, round5_specs

    one_way, crossed = round5_specs("auto_held_out", [10, 11]), round5_specs("auto_cross_fit", [10, 11])
    assert [s.params for s in one_way] == [{"held_out": True, "cross_fit": False}] * len(R5_OWN)
    assert [s.params for s in crossed] == [{"held_out": True, "cross_fit": True}] * len(R5_OWN)
    assert [s.label for s in crossed] == [f"auto (own {n}/task, cross-fitted)" for n in R5_OWN]
    assert all(s.heads and s.method == "auto" for s in one_way + crossed)
    disagreement = round5_specs("auto_disagreement", [10, 11], own=(16,))
    assert [(s.label, s.params, s.own_data) for s in disagreement] == [
        ("auto (own 16/task, cross-fitted, disagreement)",
         {"held_out": True, "cross_fit": True, "criterion": "disagreement"}, 16)]
    hf_mloss.methods.get_method("auto").make_params(**disagreement[0].params)  # a setting auto takes


@pytest.mark.parametrize("parts", ["base,mties,mties_low", "mties_low", "base,nope"])
def test_round5_parts_are_checked_before_any_work(parts, capsys):
    from benchmarks.suites.regime import main

    with pytest.raises(SystemExit) as exit_:
        main(["--design", "r5", "--parts", parts])
    assert exit_.value.code == 2 and "--parts" in capsys.readouterr().err


def test_round5_ties_low_part_reaches_below_ties_grid_and_counts_in_its_family():
    """TIES chose k = 0.1, the low end of its grid, on every seed at 180 steps: the ``ties_low`` part is TIES (same
    scope and budget) on a grid entirely below that k, as many settings as TIES's own, in the TIES family of G6."""
    from benchmarks.suites.gates import TIES_FAMILY, TIES_LOW
    from benchmarks.suites.regime import R5_GRIDS, round5_specs
    from hf_mloss.methods import get_method

    (ties,) = [s for s in round5_specs("base", [10, 11]) if s.label == "ties"]
    (low,) = round5_specs("ties_low", [10, 11])
    assert (low.label, low.method, low.params) == (TIES_LOW, "ties", ties.params)
    assert max(low.grid["k"]) < min(R5_GRIDS["ties"]["k"]) and 1.0 in low.grid["lam"]
    assert len(low.settings()) == len(ties.settings()) and TIES_LOW in TIES_FAMILY
    for setting in low.settings():
        get_method("ties").make_params(**low.params, **setting)


def test_round5_grid_extensions_start_at_the_end_they_extend_and_count_in_their_families():
    """``ties_sparse`` goes past the corner ``ties_low`` chose (lower k, higher λ); ``lam_high`` past the λ (and
    DARE's p) that end TIES's, DARE-TIES's and Iso-CTS's grids. Each repeats that end, is its own row, and the
    TIES-family rows count in G6's TIES family; every setting is valid for its method."""
    from benchmarks.suites.gates import DARE_HIGH, DARE_SPARSE, TIES_FAMILY, TIES_HIGH, TIES_LOW_WIDE, TIES_SPARSE
    from benchmarks.suites.regime import ISO_CTS_HIGH, R5_GRIDS, round5_specs
    from hf_mloss.methods import get_method

    base = {s.label: s for s in round5_specs("base", [10, 11])}
    (sparse,) = round5_specs("ties_sparse", [10, 11])
    low = R5_GRIDS["ties_low"]
    assert (sparse.label, sparse.method, sparse.params) == (TIES_SPARSE, "ties", base["ties"].params)
    assert max(sparse.grid["k"]) == min(low["k"]) and min(sparse.grid["lam"]) == max(low["lam"])
    assert min(sparse.grid["k"]) < min(low["k"]) and max(sparse.grid["lam"]) > max(low["lam"])
    high = {s.label: s for s in round5_specs("lam_high", [10, 11])}
    assert list(high) == [TIES_HIGH, DARE_HIGH, ISO_CTS_HIGH]
    for label, extends in ((TIES_HIGH, "ties"), (DARE_HIGH, "dare_ties"), (ISO_CTS_HIGH, "iso_cts")):
        spec, top = high[label], max(base[extends].grid["lam"])
        assert spec.method == base[extends].method and spec.params == base[extends].params
        assert min(spec.grid["lam"]) == top < max(spec.grid["lam"])
    assert min(high[DARE_HIGH].grid["p"]) == max(base["dare_ties"].grid["p"]) < max(high[DARE_HIGH].grid["p"])
    assert high[TIES_HIGH].grid["k"] == base["ties"].grid["k"]
    assert {TIES_SPARSE, TIES_HIGH, DARE_HIGH, DARE_SPARSE} <= set(TIES_FAMILY) and ISO_CTS_HIGH not in TIES_FAMILY
    assert round5_specs("ties_high", [10, 11]) == [high[TIES_HIGH]]  # lam_high's TIES row alone
    (wide,) = round5_specs("ties_low_wide", [10, 11])  # ties_low's k past its λ = 3
    assert (wide.label, wide.params, wide.grid["k"]) == (TIES_LOW_WIDE, base["ties"].params, low["k"])
    assert min(wide.grid["lam"]) == max(low["lam"]) < max(wide.grid["lam"]) and TIES_LOW_WIDE in TIES_FAMILY
    (dare,) = round5_specs("dare_sparse", [10, 11])  # DARE-TIES past its p = 0.7 on its own λ grid
    assert (dare.label, dare.method, dare.params) == (DARE_SPARSE, "dare_ties", base["dare_ties"].params)
    assert dare.grid["lam"] == base["dare_ties"].grid["lam"] and len(dare.settings()) == len(base["dare_ties"].settings())
    assert min(dare.grid["p"]) == max(base["dare_ties"].grid["p"]) < max(dare.grid["p"]) < 1
    for spec in (sparse, *high.values(), dare, wide):
        for setting in spec.settings():
            get_method(spec.method).make_params(**spec.params, **setting)


def test_round5_learned_groups_join_one_record_each_cached_as_its_own_run(monkeypatch):
    """Learned rows measured by separate runs (AdaRank's two, then AdaMerging's four) join one record: each
    ``--learned`` flag is a group, measured and cached as its own methods-only run with exactly the specs its run
    had; a row in two groups is refused before the suite is built."""
    import benchmarks.suites.real as real
    import benchmarks.suites.regime as regime
    from benchmarks.suites.__main__ import real_config

    seen = {}

    def measure_round5(cfg, cache, log, parts, **kwargs):
        seen.update(parts=parts, learned=kwargs["learned"])
        raise SystemExit(0)

    monkeypatch.setattr(regime, "measure_round5", measure_round5)
    with pytest.raises(SystemExit):
        regime.main(["--design", "r5", "--parts", "base,learned", "--learned", "adarank_tsv+lam:output_gap",
                     "--learned", "adamerging:entropy,adamerging:mloss"])
    assert seen["learned"] == [[("adarank_tsv+lam", "output_gap")], [("adamerging", "entropy"), ("adamerging", "mloss")]]
    with pytest.raises(SystemExit):
        regime.main(["--design", "r5", "--parts", "base,learned"])
    assert seen["learned"] == [regime.R5_LEARNED]
    monkeypatch.undo()

    calls = []

    class Measured(Exception):
        """The last run asked for: stop before the record is built from the fake's empty results."""

    def lever_replicates(bench, cache, specs, log, **kwargs):
        calls.append(specs)
        if len(calls) == 4:
            raise Measured
        return []

    monkeypatch.setattr(regime, "lever_replicates", lever_replicates)
    monkeypatch.setattr(real, "build_real_suite", lambda *a: calls.append("built"))
    cfg = real_config("real-smoke", None)
    with pytest.raises(ValueError, match="measured twice"):
        regime.measure_round5(cfg, "unused", print, ["base", "learned"],
                              learned=[[("adamerging", "entropy")], [("adamerging", "entropy")]])
    assert calls == []
    groups = [[("adarank_tsv+lam", "output_gap")], [("adamerging", "entropy"), ("adamerging", "mloss")]]
    with pytest.raises(Measured):
        regime.measure_round5(cfg, "unused", print, ["base", "learned"], learned=groups)
    trained = list(range(cfg.frozen, cfg.num_layers))
    assert calls[0] == "built" and len(calls) == 4
    assert [[s.label for s in run] for run in calls[1:]] == [
        [s.label for s in regime.round5_specs("base", trained)],
        ["adarank_tsv+lam (output_gap)"], ["adamerging (entropy)", "adamerging (mloss)"]]
    assert calls[3] == regime.round5_specs("learned", trained, learned=groups[1])  # the cache key of that run


def test_round5_learned_own_groups_and_sizes_reach_the_measurement_from_the_command_line(monkeypatch):
    """``--learned-own`` repeated joins groups measured by separate runs (as ``--learned``); ``--own`` sets the
    images per task of every own-data part."""
    import benchmarks.suites.regime as regime

    seen = {}

    def measured(cfg, cache, log, parts, **kwargs):
        seen.update(kwargs, parts=parts)
        raise SystemExit(0)

    monkeypatch.setattr(regime, "measure_round5", measured)
    with pytest.raises(SystemExit):
        regime.main(["--design", "r5", "--seeds", "0", "--parts", "base,learned_own", "--own", "16",
                     "--learned-own", "adamerging:entropy", "--learned-own", "adamerging:output_gap"])
    assert seen["parts"] == ["base", "learned_own"] and seen["own"] == (16,)
    assert seen["learned_own"] == [[("adamerging", "entropy")], [("adamerging", "output_gap")]]
