"""Parts measured beside a lever record (its replicates no longer cached) give the rows one run of all parts gives."""

import copy

import numpy as np
import pytest

from benchmarks.suites import beside
from benchmarks.suites.protocol import TUNED_ENSEMBLE, ReplicateResult
from benchmarks.suites.regime import round5_row, round5_specs

TASKS = ("a", "b", "c")
REFERENCES = ("pretrained heads", "fine-tuned (own task)", "ensemble (probabilities)", TUNED_ENSEMBLE)
OLD = ("average", "task_arithmetic", "ties", "tsv_m", "auto (own 16/task, held out)")
NEW = "auto (own 16/task, cross-fitted)"
LEVER = {"tasks": list(TASKS), "q": 3, "wise": 1.0, "design": "r5", "trained_blocks": 2, "steps": 180,
         "parts": ["base", "auto_held_out"], "code_versions": {"base": ["abc"], "auto_held_out": ["abc"]}}


def replicate(seed: int) -> ReplicateResult:
    """Accuracies drawn from the seed, every row different; the autos record what they chose."""
    rng = np.random.default_rng(seed)

    def scores() -> dict:
        return {split: {t: float(rng.uniform(0.3, 0.9)) for t in TASKS} for split in ("val", "test")}

    result = ReplicateResult(seed, reference={label: scores() for label in REFERENCES},
                             foreign={f"{t}+{u}": float(rng.normal(0, 0.03)) for t in TASKS for u in TASKS if t != u},
                             ensemble_scale={"chosen": float(rng.choice([10, 20, 40]))})
    for label in (*OLD, NEW):
        auto = label.startswith("auto")
        grid = [{"setting": {}, "auto_chose": {"method": "iso_c", "parameters": {"lam": float(seed)}}}] if auto \
            else [{"setting": {"lam": 1.0}}]
        result.methods[label] = {**scores(), "method": "auto" if auto else label, "val_grid": grid,
                                 "chosen": {} if auto or label == "average" else {"lam": float(rng.choice([1, 2]))}}
    return result


def measured_beside(replicates, row):
    """What the beside run measures on these fine-tunes: the checks (average and each seed's best merge at its
    chosen setting, as a run of that one setting gives them) and the new part."""
    specs = beside.record_specs(row, [10, 11], (16,))
    bests = beside.best_on_val(row, beside.reference_labels(row, specs))
    labels = [run[1].label for run in beside.check_specs(specs, bests)]
    checks = []
    for r, label, (best, _) in zip(replicates, labels, bests):
        check = ReplicateResult(r.seed)
        check.methods = {"average": copy.deepcopy(r.methods["average"]), label: copy.deepcopy(r.methods[best])}
        checks.append(check)
    new = [ReplicateResult(r.seed, methods={NEW: copy.deepcopy(r.methods[NEW])}) for r in replicates]
    assert round5_specs("auto_cross_fit", [10, 11], own=(16,))[0].label == NEW  # the part whose row this is
    return labels, bests, {beside.CHECK: checks, "auto_cross_fit": new}


def test_a_part_measured_beside_a_record_gives_the_row_of_one_run_over_all_parts():
    replicates = [replicate(s) for s in (0, 1, 2, 3)]
    old = [copy.deepcopy(r) for r in replicates]
    for r in old:
        del r.methods[NEW]
    row = round5_row(old, list(OLD), LEVER, autos=[OLD[-1]])
    whole = round5_row(replicates, [*OLD, NEW], {**LEVER, "parts": [*LEVER["parts"], "auto_cross_fit"]},
                       autos=[OLD[-1], NEW])
    labels, bests, measured = measured_beside(replicates, row)
    joined = beside.join_beside(row, labels, bests, measured, {beside.CHECK: ["def"], "auto_cross_fit": ["ghi"]},
                                tolerance=1e-9)
    assert joined["parts"] == ["base", "auto_held_out", beside.CHECK, "auto_cross_fit"]
    assert joined["code_versions"] == {**LEVER["code_versions"], beside.CHECK: ["def"], "auto_cross_fit": ["ghi"]}
    np.testing.assert_allclose(joined["per_seed"][NEW], whole["per_seed"][NEW], rtol=0, atol=1e-12)
    assert joined[NEW] == pytest.approx(whole[NEW], abs=1e-12)
    assert joined["test"][NEW] == pytest.approx(whole["test"][NEW], abs=1e-12)
    assert joined["chosen"][NEW] == whole["chosen"][NEW]
    np.testing.assert_allclose(joined["beside"]["per_seed_test"][NEW], whole["per_seed_test"][NEW], atol=1e-12)
    for label in (OLD[-1], NEW):  # the old auto's regret kept, the new one's as one run computes it
        assert joined["auto_regrets"][label]["per_seed"] == pytest.approx(whole["auto_regrets"][label]["per_seed"])
        assert joined["auto_regrets"][label]["mean"] == pytest.approx(whole["auto_regrets"][label]["mean"])
    assert joined["auto_regrets"][NEW]["per_seed"][2]["auto_chose"] == {"method": "iso_c", "parameters": {"lam": 2.0}}
    assert joined["g6_gate"]["value"] == whole["g6_gate"]["value"]
    assert [c["row"] for c in joined["beside"]["checks"][:2]] == ["average", labels[0]]
    assert all(c["val_now"] == pytest.approx(c["val_record"]) for c in joined["beside"]["checks"])
    assert row["chosen"].keys() == set(OLD)  # the record's row itself is left as it was


@pytest.mark.parametrize("row_label, images, refused", [("average", 2, True), ("best", 2, True),
                                                        ("best", 0.5, False)])
def test_checks_that_miss_the_record_by_more_than_one_val_image_refuse_the_join(row_label, images, refused):
    replicates = [replicate(s) for s in (0, 1)]
    old = [copy.deepcopy(r) for r in replicates]
    for r in old:
        del r.methods[NEW]
    row = round5_row(old, list(OLD), LEVER, autos=[OLD[-1]])
    labels, bests, measured = measured_beside(replicates, row)
    tolerance = 100 / (3 * 50)  # one val image of 50 per task, in points of the three tasks' mean
    moved = measured[beside.CHECK][1].methods["average" if row_label == "average" else labels[1]]["val"]
    moved["b"] += images / 50
    join = lambda: beside.join_beside(row, labels, bests, measured, {}, tolerance + 1e-9)
    if refused:
        with pytest.raises(ValueError, match="seed 1: .* not the record's fine-tunes"):
            join()
    else:
        assert NEW in join()["auto_regrets"]


def test_each_seeds_best_merge_is_checked_at_its_own_setting_with_its_fixed_parameters():
    trained = [10, 11]
    labels = [s.label for s in round5_specs("base", trained)] + ["tsv_m+svc", "auto (own 16/task, held out)"]
    row = {"parts": ["base", "sota", "auto_held_out"], "chosen": {label: [{}] for label in labels},
           "per_seed": {label: [50.0, 50.0] for label in labels}}
    row["per_seed"]["tsv_m+svc"] = [70.0, 40.0]
    row["per_seed"]["iso_c"] = [60.0, 65.0]
    row["per_seed"]["auto (own 16/task, held out)"] = [90.0, 90.0]  # an auto row is never the reference
    row["chosen"]["tsv_m+svc"] = [{"lam": 2.0}, {"lam": 3.0}]
    row["chosen"]["iso_c"] = [{"lam": 3.4}, {"lam": 5.0}]
    specs = beside.record_specs(row, trained, (16,))
    others = beside.reference_labels(row, specs)
    assert "auto (own 16/task, held out)" not in others and "tsv_m+svc" in others
    bests = beside.best_on_val(row, others)
    assert bests == [("tsv_m+svc", {"lam": 2.0}), ("iso_c", {"lam": 5.0})]
    checks = beside.check_specs(specs, bests)
    assert [[c.label for c in run] for run in checks] == [["average", "tsv_m+svc at lam=2.0"],
                                                          ["average", "iso_c at lam=5.0"]]
    assert [[c.grid for c in run] for run in checks] == [[{}, {"lam": [2.0]}], [{}, {"lam": [5.0]}]]
    assert checks[0][1].params == specs["tsv_m+svc"].params and checks[0][1].params.get("calibrate") == "svc"


def test_a_row_of_none_of_the_records_parts_is_refused():
    row = {"parts": ["base"], "chosen": {"average": [{}], "cart": [{}]}}
    with pytest.raises(ValueError, match=r"\['cart'\] are not among its parts' specs"):
        beside.record_specs(row, [10, 11], (16,))


def test_the_beside_run_measures_each_seeds_own_checks_and_the_part_on_every_seed(monkeypatch):
    """``measure_beside``'s wiring: one checks run per seed (average and that seed's best, nothing else), the new
    part on all seeds, the tolerance of one val image, and the lever rebuilt from the record."""
    from benchmarks.suites import real, regime

    replicates = {s: replicate(s) for s in (0, 1, 2)}
    old = [copy.deepcopy(replicates[s]) for s in (0, 1, 2)]
    for r in old:
        del r.methods[NEW]
    row = round5_row(old, list(OLD), LEVER, autos=[OLD[-1]])
    record = {"seeds": [0, 1, 2], "rows": [row]}
    built, runs = [], []

    class Bench:
        def __init__(self, cfg):
            self.cfg = cfg

        def labels(self, split):
            return {t: [0] * 50 for t in TASKS}

    def build(cfg, cache, log):
        built.append((cfg.seeds, cfg.wise, cfg.num_layers - cfg.frozen, cfg.ft_steps, cfg.tasks))
        return Bench(cfg)

    def lever_replicates(bench, cache, specs, log, *, version=None, references=True):
        assert references is False and version == ["v1"]
        runs.append((bench.cfg.seeds, [s.label for s in specs]))
        out = []
        for seed in bench.cfg.seeds:
            result = ReplicateResult(seed, code_version="v1")
            for spec in specs:
                source = spec.label.split(" at ")[0]
                result.methods[spec.label] = copy.deepcopy(replicates[seed].methods[source])
            out.append(result)
        return out

    monkeypatch.setattr(real, "build_real_suite", build)
    monkeypatch.setattr(regime, "lever_replicates", lever_replicates)
    joined = beside.measure_beside(record, "cache", print, ["auto_cross_fit"], own=(16,), version=["v1"])
    bests = beside.best_on_val(row, ["average", "task_arithmetic", "ties", "tsv_m"])
    at = [f"lam={setting['lam']}" if setting else "its setting" for _, setting in bests]
    assert runs == [((s,), ["average", f"{best} at {where}"]) for s, (best, _), where in zip((0, 1, 2), bests, at)] \
        + [((0, 1, 2), [NEW])]
    assert built[-1] == ((0, 1, 2), 1.0, 2, 180, TASKS) and [b[0] for b in built[:3]] == [(0,), (1,), (2,)]
    assert joined["code_versions"][beside.CHECK] == ["v1"] and joined["code_versions"]["auto_cross_fit"] == ["v1"]
    assert [p["best_on_val"] for p in joined["auto_regrets"][NEW]["per_seed"]] == [b for b, _ in bests]
    text = beside.checks_markdown("old_record", joined)
    assert "The rows of the parts auto_cross_fit were measured" in text and "`old_record`" in text
    assert text.count("| average |") == 3
