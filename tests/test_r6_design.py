"""Design r6 (the registered protocol v6): per-image data that recomputes every difference, budget-matched controls
with their budgets printed, the version on every record, and the direct test of M-Loss against the output gap.

The end-to-end run is the smoke suite (a small random DINOv2, two procedural tasks, two replicates: the pipeline,
not the numbers), in the slow tier; the pieces it rests on are checked here on data built by hand.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from benchmarks.suites import registered as R
from benchmarks.suites.protocol import ReplicateResult
from benchmarks.suites.report import (
    TENSOR,
    check_recomputed,
    claim_verdict,
    comparisons,
    decode_correct,
    default_pairs,
    encode_correct,
    recompute,
    to_json,
)


@pytest.mark.parametrize("n", [1, 7, 8, 500])
def test_correctness_round_trips_through_the_record(n):
    values = np.random.default_rng(n).random(n) > 0.5
    stored = json.loads(json.dumps(encode_correct(values)))
    assert stored["n"] == n and np.array_equal(decode_correct(stored), values)


def _results(rng: np.random.Generator) -> list[ReplicateResult]:
    """Three replicates, two tasks of 40 images, M-TIES a little above its controls."""
    labels = {"m_ties": 0.7, "m_ties (random ranks, draw 1)": 0.6, "m_ties (inverted ranks)": 0.6,
              "m_ties (budget-matched uniform)": 0.62, TENSOR: 0.65, "ties": 0.5}
    out = []
    for seed in range(3):
        r = ReplicateResult(seed=seed)
        r.correct = {label: {t: rng.random(40) < p for t in ("a", "b")} for label, p in labels.items()}
        out.append(r)
    return out


def test_every_difference_recomputes_from_the_record_alone():
    """The record keeps each image's correctness, each image's source item, each pair's bootstrap seed and draws:
    :func:`recompute` gives every stored difference back exactly, and a record that lost one image's correctness
    does not."""
    results = _results(np.random.default_rng(0))
    items = {"a": np.repeat(np.arange(20), 2), "b": np.arange(40)}  # task a: two images per source item
    pairs = default_pairs(list(results[0].correct))
    assert ("m_ties", TENSOR) in pairs
    diffs = comparisons(results, pairs, draws=300, items=items)
    record = json.loads(json.dumps(to_json(results, [], diffs, {}, items, draws=300)))
    again = recompute(record)
    assert [{"a": d["a"], "b": d["b"], **again[d["a"], d["b"]].to_dict()}
            == {k: v for k, v in d.items() if not k.startswith("bootstrap")} for d in record["differences"]] == \
        [True] * len(pairs)
    bits = decode_correct(record["replicates"][0]["correct"]["m_ties"]["a"])
    bits[0] = not bits[0]
    record["replicates"][0]["correct"]["m_ties"]["a"] = encode_correct(bits)
    assert recompute(record)["m_ties", "ties"].mean != diffs["m_ties", "ties"].mean
    record["replicates"][0].pop("correct")
    with pytest.raises(ValueError, match="no per-image correctness"):
        recompute(record)


def test_the_claim_needs_all_four_controls_where_the_tensor_control_was_measured():
    results = _results(np.random.default_rng(1))
    diffs = comparisons(results, default_pairs(list(results[0].correct)), draws=200)
    lines = claim_verdict(diffs, passed=True)
    assert sum(line.startswith("m_ties − ") for line in lines) == 4 and any(TENSOR in line for line in lines)
    assert "four controls" in lines[-1]
    without = {k: v for k, v in diffs.items() if k != ("m_ties", TENSOR)}
    assert sum(line.startswith("m_ties − ") for line in claim_verdict(without, passed=True)) == 3


def test_the_budget_of_every_trimming_row_is_reported():
    """Nominal budgets follow the chosen setting (M-TIES's family: k − e/2 on the scored tensors, k elsewhere; the
    e = 0 ablation k on both), measured ones come from the replicates' counts."""
    from benchmarks.suites import r6

    rows = [s for s in r6.specs("mties", [10, 11]) if s.label in ("m_ties", TENSOR, R.E0)]
    results = []
    for seed, k in ((0, 0.2), (1, 0.05)):
        r = ReplicateResult(seed=seed)
        r.methods = {s.label: {"chosen": {"k": k, "lam": 1.0, **({} if s.label == R.E0 else {"e": R.spread(k)})}}
                     for s in rows}
        r.trim = {s.label: 0.5 + seed / 10 for s in rows}
        results.append(r)
    table = r6.budgets(results, rows)
    assert table["m_ties"]["nominal"]["scored tensors"] == pytest.approx([0.15, 0.0375])
    assert table[TENSOR]["nominal"]["scored tensors"] == table["m_ties"]["nominal"]["scored tensors"]
    assert table[R.E0]["nominal"]["scored tensors"] == [0.2, 0.05] and "not budget-matched" in \
        table[R.E0]["nominal"]["how"]
    assert table["m_ties"]["measured"] == [0.5, 0.6]
    text = "\n".join(r6.budget_lines(table))
    assert "| m_ties (budget-matched tensor) | k=0.2, lam=1, e=0.1; k=0.05, lam=1, e=0.025 | scored tensors 0.15, " \
           "0.0375; other tensors 0.2, 0.05 | k − e/2 of each scored tensor as a whole | 55.0 % (50.0, 60.0) |" in text


def test_the_direct_test_separates_a_better_predictor_and_not_an_equal_one():
    """Δ|ρ| with the model bootstrap: a score that ranks the pairs' shortfall exactly against one that is noise is
    separated (interval above 0); a score against itself gives Δ = 0 on every resample."""
    from benchmarks.compatibility import contrast_table

    rng = np.random.default_rng(0)
    models = [f"t{i}/s0" for i in range(10)]
    quality = rng.random(10)
    pairs = []
    for i in range(10):
        for j in range(i + 1, 10):
            shortfall = quality[i] + quality[j]
            scores = {"mloss": shortfall, "mloss_ratio": rng.random(), "mloss_normalized": shortfall,
                      "output_gap": rng.random(), "tv_distance": rng.random()}
            pairs.append({"models": [models[i], models[j]], "scores": scores, "ens_gap": shortfall,
                          "norm_acc": -shortfall})
    rows = contrast_table({"observations": {"pairs": pairs}}, models, draws=200)
    main = next(r for r in rows if r["registered"])
    assert (main["a"], main["b"], main["target"], main["group"]) == ("mloss", "output_gap", "ens_gap", "all pairs")
    assert main["rho_a"] == pytest.approx(1.0) and main["low"] > 0 and main["draws"] > 150
    noise = next(r for r in rows if r["a"] == "mloss_ratio" and r["target"] == "ens_gap" and r["group"] == "all pairs")
    assert noise["low"] < 0 < noise["high"]
    same = contrast_table({"observations": {"pairs": [{**p, "scores": {**p["scores"], "output_gap":
                                                                       p["scores"]["mloss"]}} for p in pairs]}},
                          models, draws=50)
    assert all(r["delta"] == 0 and r["low"] == 0 == r["high"] for r in same if r["a"] == "mloss")


def test_study_selection_searches_the_r6_grids():
    from benchmarks.compatibility import regret_methods

    bench = types.SimpleNamespace(cfg=types.SimpleNamespace(frozen=10, num_layers=12))
    methods = regret_methods(bench, ("a", "b"), "real-regime", "r6")
    assert methods["tsv_m"][2] == {"lam": list(R.LAMS)} and methods["ties"][2]["k"] == list(R.KS)
    _, params, grid = methods["m_ties"]
    assert params["e"] == R.E_MAX and grid["k"] == [0.2, 0.4] and grid["lam"] == list(R.LAMS)


@pytest.mark.slow
def test_design_r6_end_to_end_on_the_smoke_suite(tmp_path):
    """Every part on the smoke suite: the records say protocol v6, M-TIES meets four controls whose budgets are
    printed, and every difference of the verdict record recomputes from the record alone."""
    from benchmarks.suites import r6
    from benchmarks.suites.__main__ import real_config
    from benchmarks.suites.training import Log

    cfg = real_config("real-smoke", None)
    row = r6.measure(cfg, tmp_path / "cache", Log(False, "test"), ["base", "mties", "data", "learned"], smoke=True,
                     report=tmp_path / "report", learned=[[("adamerging", "output_gap")]])
    text = r6.write([row], tmp_path / "table", "cmd", cfg.seeds, (0.0, 0.0, 0.0), 1, 1.0)
    assert row["protocol"] == R.VERSION and R.label_line(R.VERSION) in text.splitlines()
    assert json.loads((tmp_path / "table.json").read_text())["protocol"] == R.VERSION
    record = json.loads((tmp_path / "report" / "results.json").read_text())
    md = (tmp_path / "report" / "results.md").read_text()
    assert record["protocol"] == R.VERSION and R.label_line(R.VERSION) in md.splitlines()
    assert check_recomputed(tmp_path / "report" / "results.json") == 0.0
    assert "## Does M-Loss help? (M-TIES against its four controls, test)" in md and "## Budgets" in md
    assert set(record["budgets"]) == {"ties", "dare_ties", "m_ties", "m_ties (random ranks, draw 1)",
                                      "m_ties (inverted ranks)", "m_ties (budget-matched uniform)", TENSOR, R.E0}
    for label in ("m_ties (budget-matched uniform)", TENSOR):  # the same nominal budget as M-TIES, where k agrees
        for mine, theirs, c1, c2 in zip(record["budgets"][label]["nominal"]["scored tensors"],
                                        record["budgets"]["m_ties"]["nominal"]["scored tensors"],
                                        record["budgets"][label]["chosen"], record["budgets"]["m_ties"]["chosen"]):
            assert c1["k"] != c2["k"] or mine == theirs
    learned = record["replicates"][0]["methods"]["adamerging (output_gap)"]
    assert len(learned["val_grid"]) == 4 and set(learned["chosen"]) == {"steps", "lr"}
