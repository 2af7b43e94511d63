"""The compatibility study's statistics (benchmarks/compatibility.py): partial Spearman correlation, the Mantel
permutation test with a control held in place, grid-edge labels and the pooled selection data of both suites."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import rankdata

from benchmarks import compatibility
from benchmarks.compatibility import (
    grid_edge,
    partial_spearman,
    permutation_p,
    regret_methods,
    regret_part,
    shuffled_pool,
    spearman,
)
from benchmarks.suites.real import RealConfig
from benchmarks.suites.text import TextConfig


def closed_form_partial(x, y, z) -> float:
    """r_xy·z = (r_xy − r_xz r_yz) / sqrt((1 − r_xz²)(1 − r_yz²)) on the ranks."""
    rx, ry, rz = (rankdata(v) for v in (x, y, z))
    r = np.corrcoef([rx, ry, rz])
    return (r[0, 1] - r[0, 2] * r[1, 2]) / math.sqrt((1 - r[0, 2] ** 2) * (1 - r[1, 2] ** 2))


def test_partial_spearman_matches_the_closed_form() -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(size=40)
    x, y = z + rng.normal(size=40), z + rng.normal(size=40)
    assert partial_spearman(x, y, z) == pytest.approx(closed_form_partial(x, y, z), abs=1e-12)
    assert spearman(x, y) > partial_spearman(x, y, z)  # the shared part through z is removed


def test_partial_spearman_is_nan_when_z_explains_a_score_or_too_little_is_given() -> None:
    z = np.arange(10.0)
    assert math.isnan(partial_spearman(z ** 3, np.random.default_rng(2).normal(size=10), z))  # x's ranks are z's
    assert math.isnan(partial_spearman([1, 2, 3], [1, 2, 3], [3, 2, 1]))  # too few observations
    assert math.isnan(partial_spearman([1, 1, 1, 1, 1], [1, 2, 3, 4, 5], [5, 3, 4, 1, 2]))  # a constant score


def test_permutation_p_with_a_control_permutes_the_score_only() -> None:
    """6 models, every pair; the target is the score plus noise: ρ and the partial ρ given an unrelated control are
    both significant, and a control equal to the score leaves nothing to find (nan: no variance left)."""
    rng = np.random.default_rng(1)
    values = rng.normal(size=6)
    pairs = list(itertools.combinations(range(6), 2))
    table = {pair: float(values[pair[0]] + values[pair[1]]) for pair in pairs}
    score = table.get
    target = [table[p] + 0.05 * rng.normal() for p in pairs]
    perms = [list(p) for p in itertools.permutations(range(6))]
    unrelated = list(rng.normal(size=len(pairs)))
    assert permutation_p(pairs, score, target, perms) < 0.05
    assert permutation_p(pairs, score, target, perms, control=unrelated) < 0.05
    p_null = permutation_p(pairs, score, list(rng.normal(size=len(pairs))), perms, control=unrelated)
    assert p_null > 0.05


def test_grid_edge_names_each_axis_at_an_end() -> None:
    grid = {"k": [0.2, 0.5, 0.8], "lam": [0.7, 1.0, 1.5]}
    assert grid_edge({"k": 0.5, "lam": 1.0}, grid) == ""
    assert grid_edge({"k": 0.2, "lam": 1.5}, grid) == "k=min,lam=max"
    assert grid_edge({"k": 0.5, "lam": 0.7}, {"k": [0.5], "lam": [0.7, 1.0]}) == "lam=min"  # one-value axes never


def test_shuffled_pool_keeps_every_sample_once_for_images_and_text() -> None:
    images = [torch.full((2, 3), float(i)) for i in range(3)]
    pooled = shuffled_pool(images, seed=4)
    assert pooled.shape == (6, 3) and sorted(pooled[:, 0].tolist()) == [0, 0, 1, 1, 2, 2]
    assert torch.equal(pooled, shuffled_pool(images, seed=4)) and not torch.equal(pooled, shuffled_pool(images, 5))
    texts = [["a", "b"], ["c"], ["d", "e", "f"]]
    mixed = shuffled_pool(texts, seed=4)
    assert sorted(mixed) == list("abcdef") and mixed == shuffled_pool(texts, seed=4)


def test_regret_judges_each_method_as_its_suite_runs_it() -> None:
    image = regret_methods(SimpleNamespace(cfg=RealConfig(frozen=10)), ("a", "b", "c", "d"))
    assert image["ties"][0] == "ties" and image["ties"][1] == {"scope": "global", "budget": "changed"}
    assert image["ties"][2] == {"k": [0.2], "lam": [1.6, 2.0, 2.4, 2.8, 3.2, 3.6]}
    assert image["m_ties"][1]["layers"] == [10, 11] and image["m_ties"][1]["e"] == 0.1
    assert image["task_arithmetic"][2] == {"lam": [0.5, 0.65, 0.8, 0.95, 1.1, 1.25]}
    pair = regret_methods(SimpleNamespace(cfg=RealConfig(frozen=10)), ("a", "b"))
    assert pair["task_arithmetic"][2] == {"lam": [1.0, 1.3, 1.6, 1.9, 2.2, 2.5]}  # scaled by 4 / 2 merged tasks
    text = regret_methods(SimpleNamespace(cfg=TextConfig()), tuple("abcdef"))
    assert text["ties"][1] == {"scope": "tensor"} and text["m_ties"][1]["layers"] == [3, 4, 5]
    assert text["ties"][2] == text["m_ties"][2] == {"k": [0.2], "lam": [1.0, 1.5, 2.0, 2.5, 3.0]}


def test_regret_at_the_regime_lever_uses_the_lever_map_grids() -> None:
    from benchmarks.suites.regime import regime_config

    cfg = regime_config(4)
    assert (cfg.wise, cfg.frozen, len(cfg.tasks), cfg.seeds) == (1.0, 8, 8, (0, 1, 2, 3))
    lever = regret_methods(SimpleNamespace(cfg=cfg), tuple("abcdefgh"), "real-regime")
    assert list(lever) == ["task_arithmetic", "ties", "m_ties", "tsv_m", "iso_c", "iso_cts"]
    # in units of the trained task vector: 0.65 × the wise-0.65 grid (0.8 ... 2.0)
    assert lever["ties"][2] == {"lam": [0.52, 0.65, 0.78, 0.91, 1.04, 1.3]} and lever["ties"][1]["k"] == 0.2
    assert lever["m_ties"][2] == {"k": [0.2], "lam": [0.52, 0.65, 0.78, 0.91, 1.04, 1.3]}
    assert lever["m_ties"][1]["layers"] == [8, 9, 10, 11]
    assert lever["tsv_m"][2] == {"lam": [0.65, 0.975, 1.3, 1.625, 1.95, 2.6]}
    four = regret_methods(SimpleNamespace(cfg=cfg), ("a", "b", "c", "d"), "real-regime")
    assert four["task_arithmetic"][2] == {"lam": [0.325, 0.423, 0.52, 0.617, 0.715, 0.812]}  # 8 / 4 × q = 8's


def test_regret_is_the_test_accuracy_lost_against_the_val_choice(monkeypatch) -> None:
    candidates = {  # val picks lam 2.4 (test .60); mloss picks lam 1.6, the grid's lowest (test .50); the middle is 2.4
        m: [{"setting": {"k": 0.2, "lam": lam}, "val": val, "test": test, **{c: lam for c in compatibility.CRITERIA}}
            for lam, val, test in ((1.6, 0.5, 0.5), (2.4, 0.7, 0.6), (3.6, 0.6, 0.65))]
        for m in ("task_arithmetic", "ties", "m_ties")}
    # the documented default (λ = 1) lies outside the grid: evaluated (best val of all), never chosen by val or criteria
    for rows in candidates.values():
        rows.append({"setting": {"k": 0.2, "lam": 1.0}, "val": 0.9, "test": 0.45, "documented_default": True,
                     "outside_grid": True})
    monkeypatch.setattr(compatibility, "instance_candidates", lambda study, instance, method, args: candidates[method])
    study = SimpleNamespace(bench=SimpleNamespace(cfg=RealConfig(frozen=10), tasks=["a", "b"],
                                                  replicates=[SimpleNamespace(seed=0)]), log=lambda *_: None)
    args = SimpleNamespace(seed=0, regret_replicates=1, regret_subsets=0, draws=2, select_samples=8, regret_images=None,
                           suite="real-quick")
    out = regret_part(study, args)
    assert len(out["instances"]) == 2 and len(out["detail"]) == 6
    rows = {(r["method"], r["criterion"]): r for r in out["table"]}
    assert rows["ties", "mloss"]["regrets"] == pytest.approx([10.0, 10.0])
    assert rows["ties", "mloss"]["at_lowest_lam"] == 2 and rows["ties", "mloss"]["agrees_with_val"] == 0
    assert rows["ties", "middle of the grid (no selection)"]["mean_regret"] == pytest.approx(0.0)
    assert rows["ties", "oracle (best test)"]["mean_regret"] == pytest.approx(-5.0)
    assert out["val_choice_edges"]["ties"] == ["", ""]
    default = rows["ties", "documented default (no selection)"]
    assert default["regrets"] == pytest.approx([15.0, 15.0]) and default["edges"] == ["outside", "outside"]
    assert default["at_edge"] == 0 and default["agrees_with_val"] == 0


def test_documented_default_is_the_library_default_on_every_grid_axis() -> None:
    assert compatibility.documented_default("ties", {"k": [0.2], "lam": [1.6, 2.0]}) == {"k": 0.2, "lam": 1.0}
    assert compatibility.documented_default("task_arithmetic", {"lam": [0.5, 0.65]}) == {"lam": 0.3}
    assert compatibility.documented_default("m_ties", {"k": [0.2], "lam": [1.0]}) == {"k": 0.2, "lam": 1.0}


def test_subset_jackknife_intervals_stay_inside_minus_one_one():
    """The delete-one-model jackknife is taken on Fisher's z: a strong ρ on few models gets an interval inside
    [−1, 1] (on ρ itself it ran past 1)."""
    from benchmarks.compatibility import model_jackknife

    observations = [(0, 1, 2), (1, 2, 3), (0, 2, 3), (0, 1, 3), (0, 1, 4), (2, 3, 4), (1, 3, 4)]
    score = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.5]
    target = [1.1, 2.3, 2.9, 4.2, 5.1, 5.9, 7.0]
    low, high = model_jackknife(observations, score, target, 5)
    assert -1 < low <= high < 1 and low < 1.0


def test_the_m_loss_partial_tests_are_holm_adjusted():
    from benchmarks.compatibility import holm_partial

    rows = [{"score": "mloss", "partial_p": 0.004, "partial_cosine_p": 0.02},
            {"score": "mloss_ratio", "partial_p": 0.03, "partial_cosine_p": 0.5},
            {"score": "tv_cosine", "partial_p": 0.001}]
    holm_partial(rows)
    assert rows[0]["partial_p_holm"] == pytest.approx(0.016)  # 4 tests: the smallest × 4
    assert rows[0]["partial_cosine_p_holm"] == pytest.approx(0.06)  # × 3
    assert rows[1]["partial_p_holm"] == pytest.approx(0.06) and rows[1]["partial_cosine_p_holm"] == 0.5
    assert "partial_p_holm" not in rows[2] and rows[2]["holm_family_size"] == 4
