"""Records of one lever measured on disjoint seeds join into the record one run over all the seeds writes."""

import json

import numpy as np
import pytest

from benchmarks.suites import join
from benchmarks.suites.protocol import TUNED_ENSEMBLE, ReplicateResult
from benchmarks.suites.regime import round5_row, write_r5

TASKS = ("a", "b", "c")
REFERENCES = ("pretrained heads", "fine-tuned (own task)", "ensemble (probabilities)", TUNED_ENSEMBLE)
MERGES = ("average", "ties", "tsv_m", "regmean (own 16/task)", "auto (own 16/task)")
LEVER = {"tasks": ["a", "b", "c"], "q": 3, "wise": 1.0, "design": "r5", "trained_blocks": 4, "steps": 180,
         "parts": ["base", "data_own"], "code_versions": {"base": ["abc"], "data_own": ["abc"]}}


def replicate(seed: int) -> ReplicateResult:
    """A replicate with accuracies drawn from the seed: every row differs from seed to seed and task to task."""
    rng = np.random.default_rng(seed)

    def scores() -> dict:
        return {split: {t: float(rng.uniform(0.3, 0.9)) for t in TASKS} for split in ("val", "test")}

    result = ReplicateResult(seed, reference={label: scores() for label in REFERENCES},
                             foreign={f"{t}+{u}": float(rng.normal(0, 0.03)) for t in TASKS for u in TASKS if t != u},
                             ensemble_scale={"chosen": float(rng.choice([10, 20, 40]))})
    for label in MERGES:
        grid = [{"lam": 1.0, "auto_chose": {"method": "tsv_m", "parameters": {"lam": 1.5}}}] if "auto" in label \
            else [{"lam": 1.0}]
        result.methods[label] = {**scores(), "chosen": {"lam": float(rng.choice([1.0, 1.5, 2.0]))},
                                 "val_grid": grid}
    return result


def row_of(seeds) -> dict:
    return round5_row([replicate(s) for s in seeds], list(MERGES), LEVER, autos=["auto (own 16/task)"])


def record_of(seeds, tmp_path, name: str, *, drop_per_seed_test: bool = False) -> dict:
    row = row_of(seeds)
    if drop_per_seed_test:  # a record made before rows kept their test means per seed
        del row["per_seed_test"]
    write_r5([row], tmp_path / name, f"measured {name}", list(seeds), machine=f"machine of {name}",
             extra={"protocol": "pre-v6"})
    return json.loads((tmp_path / f"{name}.json").read_text())


def assert_rows_equal(joined: dict, whole: dict) -> None:
    assert set(joined) == set(whole)
    for key, value in whole.items():
        if key in ("g6_gate", "g6_gate_ties_family"):
            assert joined[key]["value"] == value["value"] and joined[key]["passed"] == value["passed"]
        elif key in ("per_seed", "per_seed_test", "test"):
            assert joined[key].keys() == value.keys()
            for label in value:
                np.testing.assert_allclose(joined[key][label], value[label], rtol=0, atol=1e-9)
        elif key in ("auto_regrets",):
            for label, regret in value.items():
                assert joined[key][label]["per_seed"] == regret["per_seed"]
                assert joined[key][label]["mean"] == pytest.approx(regret["mean"], abs=1e-12)
        elif isinstance(value, float):
            assert joined[key] == pytest.approx(value, abs=1e-9), key
        else:
            assert joined[key] == value, key


def test_records_of_disjoint_seeds_join_into_the_record_of_all_of_them(tmp_path):
    whole = row_of([0, 1, 2, 3])
    # the later seeds given first: the join orders the records by their seeds
    joined = join.join_records([record_of([3], tmp_path, "late"), record_of([0, 1, 2], tmp_path, "early")])
    assert joined["seeds"] == [0, 1, 2, 3] and joined["protocol"] == "pre-v6"
    assert_rows_equal(joined["rows"][0], whole)
    assert "t 95 %" in joined["rows"][0]["g6_gate"]["value"]  # four replicates: an interval, recomputed


def test_a_record_without_per_seed_test_still_joins_its_test_means(tmp_path):
    whole = row_of([0, 1, 2])
    joined = join.join_records([record_of([0, 1], tmp_path, "old", drop_per_seed_test=True),
                                record_of([2], tmp_path, "new")])["rows"][0]
    assert "per_seed_test" not in joined
    for label, value in whole["test"].items():
        assert joined["test"][label] == pytest.approx(value, abs=1e-9)


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(seeds=[0]), "share seeds"),
    (lambda r: r["rows"][0]["code_versions"].update(data_own=["def"]), "'code_versions'"),
    (lambda r: r["rows"][0].update(steps=1440), "'steps'"),
    (lambda r: r["rows"][0]["chosen"].pop("ties"), "different rows"),
    (lambda r: r.update(protocol="v6"), "different protocols"),
    (lambda r: r["rows"][0].update(design="r6"), "only round 5's lever records join"),
])
def test_records_that_do_not_belong_together_are_refused(tmp_path, change, message):
    first, second = record_of([0, 1], tmp_path, "first"), record_of([2], tmp_path, "second")
    change(second)
    with pytest.raises(ValueError, match=message):
        join.join_records([first, second])


def test_the_command_writes_the_joined_record_naming_its_sources(tmp_path, capsys):
    record_of([0, 1], tmp_path, "first")
    record_of([2], tmp_path, "second")
    assert join.main([str(tmp_path / "second.json"), str(tmp_path / "first.json"),
                      "--table", str(tmp_path / "joined")]) == 0
    written = json.loads((tmp_path / "joined.json").read_text())
    assert written["seeds"] == [0, 1, 2] and written["protocol"] == "pre-v6"
    assert [s["record"] for s in written["joined_from"]] == ["first", "second"]
    assert written["command"] == "python -m benchmarks.suites.join second.json first.json"
    text = (tmp_path / "joined.md").read_text()
    assert "Joined from first (seeds [0, 1]: `measured first`, machine of first); second" in text
    assert capsys.readouterr().out == text + "\n"  # the table is printed too
