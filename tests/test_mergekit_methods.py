"""mergekit's recipe forms and methods, round 2: the base listed under ``models``, ``normalize`` as mergekit defaults it
per method, and the methods SCE and NuSLERP, each checked on hand-computed tensors. Parity with ``mergekit-yaml`` on
the same YAML is in test_peers.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_mloss import MergeConfig
from hf_mloss.errors import ConfigError
from hf_mloss.methods import MergeContext, get_method

T = torch.tensor


def merge_one(method: str, base, sources, weights, **params) -> torch.Tensor:
    """One tensor merged by a registered method, as the driver calls it."""
    m = get_method(method)
    ctx = MergeContext(params=m.make_params(**params), weights=T(weights, dtype=torch.float32))
    m.prepare(ctx, lambda fn: fn("w", base, sources))
    return m.merge_tensor("w", base, sources, ctx)


def close(a: torch.Tensor, b, atol: float = 1e-6) -> bool:
    return torch.allclose(a.double(), torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------------------------------
# The YAML everyone copies: the base under `models` with no parameters; normalize defaults per method
# --------------------------------------------------------------------------------------------------------------------
def copied_yaml(method: str, base: str, models: list[str], **shared) -> dict:
    """mergekit's README pattern: the base first under `models` ("no parameters necessary for base model")."""
    return {"merge_method": method, "base_model": base, "dtype": "float32", "parameters": shared,
            "models": [{"model": base}] + [{"model": m, "parameters": {"weight": w, "density": 0.5}}
                                            for m, w in zip(models, [1.0, 0.5, 2.0])]}


@pytest.mark.parametrize("method", ["ties", "dare_ties", "dare_linear"])
def test_the_base_listed_under_models_is_the_base_only(tiny_paths, method):
    base, models = tiny_paths
    config = MergeConfig.from_dict(copied_yaml(method, base, models))
    assert [m.model for m in config.models] == models and config.weights == [1.0, 0.5, 2.0]
    without = MergeConfig.from_dict({**copied_yaml(method, base, models), "models": copied_yaml(
        method, base, models)["models"][1:]})
    assert config.to_dict() == without.to_dict()
    # the base with `weight: 1.0` (as the old refusal suggested) and no density: mergekit ignores it, so do we
    entries = copied_yaml(method, base, models)["models"]
    entries[0] = {"model": base, "parameters": {"weight": 1.0}}
    assert MergeConfig.from_dict({**copied_yaml(method, base, models), "models": entries}).to_dict() == \
        without.to_dict()


def test_a_models_list_with_only_the_base_is_refused(tiny_paths):
    base, _ = tiny_paths
    with pytest.raises(ConfigError, match="lists only the base_model"):
        MergeConfig.from_dict({"merge_method": "ties", "base_model": base, "models": [{"model": base}]})


@pytest.mark.parametrize(("method", "given", "expected"), [
    ("ties", None, True), ("ties", False, False), ("dare_ties", None, False), ("dare_ties", True, True),
    ("dare_linear", None, False), ("dare_linear", True, True)])
def test_normalize_defaults_as_mergekit_per_method(tiny_paths, method, given, expected):
    base, models = tiny_paths
    shared = {} if given is None else {"normalize": given}
    assert MergeConfig.from_dict(copied_yaml(method, base, models, **shared)).parameters["normalize"] is expected


# τ₁ = [1, −2, 3], τ₂ = [2, 1, −1], weights [1, 0.5]: weighted [1, −2, 3] and [1, 0.5, −0.5], sums [2, −1.5, 2.5], so
# the elected signs are (+, −, +); entry 0 has both agreeing (1 + 1 over weights 1.5), entries 1 and 2 only τ₁.
TAUS = [T([1.0, -2.0, 3.0]), T([2.0, 1.0, -1.0])]
DISJOINT_SUM, DISJOINT_MEAN = [2.0, -2.0, 3.0], [2.0 / 1.5, -2.0, 3.0]


@pytest.mark.parametrize(("normalize", "expected"), [(True, DISJOINT_MEAN), (False, DISJOINT_SUM)])
def test_ties_normalize_false_sums_the_agreeing_deltas(normalize, expected):
    base = T([10.0, 20.0, 30.0])
    out = merge_one("ties", base, [base + t for t in TAUS], [1.0, 0.5], k=1.0, convention="mergekit",
                    normalize=normalize, lam=0.5)
    assert close(out - base, [0.5 * v for v in expected])


@pytest.mark.parametrize(("method", "normalize", "expected"), [
    ("dare_ties", None, DISJOINT_MEAN), ("dare_ties", False, DISJOINT_SUM), ("dare_ties", True, DISJOINT_MEAN),
    ("dare_linear", None, [2.0, -1.5, 2.5]), ("dare_linear", True, [2.0 / 1.5, -1.0, 2.5 / 1.5])])
def test_dare_normalize_switches_the_divisor(method, normalize, expected):
    """p = 1 keeps every entry (and the L1 rescale is then ×1), so only the combine is left to compare."""
    base = T([1.0, 1.0, 1.0])
    out = merge_one(method, base, [base + t for t in TAUS], [1.0, 0.5], p=1.0, rescale="l1", normalize=normalize)
    assert close(out - base, expected)


def test_dare_ties_recipe_without_normalize_sums_like_mergekit(tiny_paths):
    """The plain mergekit dare_ties recipe (no normalize) maps to the disjoint sum, as mergekit computes it."""
    base, models = tiny_paths
    config = MergeConfig.from_dict(copied_yaml("dare_ties", base, models, **{"lambda": 0.8}))
    assert config.method == "dare_ties" and config.parameters == {"lam": 0.8, "p": 0.5, "rescale": "l1",
                                                                  "normalize": False}


# keep the helper honest: the hand-computed references above are what mergekit's rule gives in float64
def test_the_hand_references_follow_the_rule():
    w = [1.0, 0.5]
    weighted = [[wi * float(v) for v in t] for wi, t in zip(w, TAUS)]
    for j in range(3):
        total = sum(row[j] for row in weighted)
        sign = 1.0 if total >= 0 else -1.0
        agree = [i for i in range(2) if math.copysign(1.0, weighted[i][j]) == sign and weighted[i][j] != 0]
        assert sum(weighted[i][j] for i in agree) == pytest.approx(DISJOINT_SUM[j])
        assert sum(weighted[i][j] for i in agree) / sum(w[i] for i in agree) == pytest.approx(DISJOINT_MEAN[j])


# --------------------------------------------------------------------------------------------------------------------
# SCE on hand-computed tensors
# --------------------------------------------------------------------------------------------------------------------
# τ₁ = [1, −2, 0, 4], τ₂ = [3, 2, 0, −4]. Energies (mean squares) 21/4 and 29/4 → weights 0.42, 0.58. Σ τ = [4, 0, 0, 0]
# elects + everywhere (0 counts as +): entry 0 both agree (0.42·1 + 0.58·3 over 1), entry 1 only τ₂ (2), entry 2
# nobody (0 / 1e-6 = 0), entry 3 only τ₁ (4).
SCE_TAUS = [T([1.0, -2.0, 0.0, 4.0]), T([3.0, 2.0, 0.0, -4.0])]


@pytest.mark.parametrize(("select_topk", "expected"), [
    (1.0, [0.42 * 1 + 0.58 * 3, 2.0, 0.0, 4.0]),
    # variances over the models [1, 4, 0, 16]: 3 are non-zero, floor(3·0.5) = 1 kept (entry 3); the masked task
    # vectors [0, 0, 0, ±4] have equal energies, Σ = 0 elects +, so τ₁'s 4 is kept alone
    (0.5, [0.0, 0.0, 0.0, 4.0]),
    (0.0, [0.0, 0.0, 0.0, 0.0]),
])
def test_sce_selects_calculates_and_erases(select_topk, expected):
    base = T([1.0, 2.0, 3.0, 4.0])
    out = merge_one("sce", base, [base + t for t in SCE_TAUS], [0.5, 0.5], select_topk=select_topk)
    assert close(out - base, expected, atol=1e-6)


def test_sce_gives_equal_weights_to_vanishing_task_vectors_and_refuses_weights():
    base = torch.zeros(3)
    tiny = [T([1e-4, -1e-4, 0.0]), T([2e-4, 1e-4, 0.0])]  # energies below 1e-6 in total: uniform weights
    assert close(merge_one("sce", base, tiny, [1.0, 1.0]), [1.5e-4, 1e-4, 0.0], atol=1e-10)  # energy weights would give 1.71e-4
    with pytest.raises(Exception, match="sce takes no weights"):
        merge_one("sce", base, tiny, [1.0, 2.0])


# --------------------------------------------------------------------------------------------------------------------
# NuSLERP on known angles
# --------------------------------------------------------------------------------------------------------------------
R = math.sqrt(0.5)


@pytest.mark.parametrize(("tau1", "tau2", "weights", "params", "expected"), [
    ([1.0, 0.0], [0.0, 1.0], [1.0, 1.0], {}, [R, R]),  # Ω = π/2, t = 0.5
    ([1.0, 0.0], [0.0, 1.0], [1.0, 3.0], {}, [math.sin(math.pi / 8), math.sin(3 * math.pi / 8)]),  # t = 0.75
    ([2.0, 0.0], [0.0, 1.0], [1.0, 1.0], {}, [2 * R, R]),  # the coefficients apply to the vectors as they are
    ([1.0, 1.0], [2.0, 2.0], [3.0, 1.0], {}, [1.25, 1.25]),  # parallel: linear, t = 0.25
    ([1.0, 0.0], [0.0, 1.0], [1.0, -1.0], {}, [R, R]),  # weights summing to 0: t = 0.5
])
def test_nuslerp_interpolates_task_vectors_on_the_sphere(tau1, tau2, weights, params, expected):
    base = T([5.0, -5.0])
    out = merge_one("nuslerp", base, [base + T(tau1), base + T(tau2)], weights, **params)
    assert close(out - base, expected)


def test_nuslerp_per_row_per_column_and_without_base():
    base = torch.zeros(2, 2)
    a, b = T([[1.0, 0.0], [1.0, 0.0]]), T([[0.0, 1.0], [2.0, 0.0]])
    # rows: row 0 orthogonal (Ω = π/2), row 1 parallel (linear)
    assert close(merge_one("nuslerp", base, [a, b], [1.0, 1.0], flatten=False), [[R, R], [1.5, 0.0]])
    # columns: column 0 [1, 1] vs [0, 2] at Ω = π/4; column 1 [0, 0] vs [1, 0] (a zero vector: cos 0, Ω = π/2)
    s = math.sin(math.pi / 8) / math.sin(math.pi / 4)
    assert close(merge_one("nuslerp", base, [a, b], [1.0, 1.0], flatten=False, row_wise=True),
                 [[s, R], [3 * s, 0.0]])
    # without a base the models themselves are interpolated (the base only gives the architecture)
    far = T([7.0, 7.0])
    assert close(merge_one("nuslerp", far, [T([1.0, 0.0]), T([0.0, 1.0])], [1.0, 1.0], task_vectors=False), [R, R])
    with pytest.raises(Exception, match="exactly two models"):
        merge_one("nuslerp", far, [far, far, far], [1.0, 1.0, 1.0])


def test_mergekit_sce_and_nuslerp_recipes_map(tiny_paths):
    base, models = tiny_paths
    config = MergeConfig.from_dict({"merge_method": "sce", "base_model": base, "parameters": {"select_topk": 0.3},
                                    "models": [{"model": base}] + [{"model": m} for m in models]})
    assert (config.method, config.parameters, len(config.models)) == ("sce", {"select_topk": 0.3}, 3)
    assert MergeConfig.from_dict({"merge_method": "sce", "base_model": base, "models": [
        {"model": m} for m in models]}).parameters == {"select_topk": 1.0}  # mergekit's default
    with pytest.raises(ConfigError, match=r"parameters \['weight'\] have no hf_mloss equivalent"):
        MergeConfig.from_dict({"merge_method": "sce", "base_model": base,
                               "models": [{"model": m, "parameters": {"weight": 1.0}} for m in models]})
    entries = [{"model": base}, {"model": models[0], "parameters": {"weight": 0.3}},
               {"model": models[1], "parameters": {"weight": 0.7}}]
    config = MergeConfig.from_dict({"merge_method": "nuslerp", "base_model": base, "models": entries})
    assert config.parameters == {"task_vectors": True, "flatten": True, "row_wise": False}
    assert config.weights == [0.3, 0.7] and config.base.model == base
    config = MergeConfig.from_dict({"merge_method": "nuslerp", "models": entries[1:],
                                    "parameters": {"nuslerp_flatten": False, "nuslerp_row_wise": True}})
    assert config.parameters == {"task_vectors": False, "flatten": False, "row_wise": True}
    assert config.base.model == models[0] and [m.model for m in config.models] == models[:2]
    for bad, message in [(entries[:2], "exactly two models"),
                         ([{"model": models[0]}, entries[2]], r"models\[0\].parameters.weight is missing"),
                         ([{"model": models[0], "parameters": {"weight": 1, "density": 0.5}}, entries[2]],
                          r"\['density'\] have no hf_mloss equivalent")]:
        with pytest.raises(ConfigError, match=message):
            MergeConfig.from_dict({"merge_method": "nuslerp", "base_model": base, "models": bad})


# --------------------------------------------------------------------------------------------------------------------
# Multi-SLERP, Karcher mean, NearSwap, RAM / RAM+, Arcee Fusion on hand-computed tensors
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("taus", "weights", "expected"), [
    ([[1.0, 0.0], [0.0, 1.0]], [1.0, 1.0], [R, R]),
    # weights 1/4, 3/4: the weighted mean direction is [1, 3]/√10 and the weighted tangents cancel there exactly
    ([[1.0, 0.0], [0.0, 1.0]], [1.0, 3.0], [1 / math.sqrt(10), 3 / math.sqrt(10)]),
    # three orthogonal directions, norms 2, 1, 1: the centre direction scaled by the mean norm 4/3
    ([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], [1.0, 1.0, 1.0], [4 / (3 * math.sqrt(3))] * 3),
])
def test_multislerp_interpolates_around_the_weighted_mean_direction(taus, weights, expected):
    base = torch.full((len(taus[0]),), 3.0)
    out = merge_one("multislerp", base, [base + T(t) for t in taus], weights)
    assert close(out - base, expected)


def test_multislerp_edge_cases():
    base = T([1.0, 1.0])
    # antipodal with equal weights: the weighted mean is 0, two vectors fall back to the linear mix
    assert close(merge_one("multislerp", base, [base + T([1.0, 0.0]), base - T([1.0, 0.0])], [1.0, 1.0]), [1.0, 1.0])
    with pytest.raises(Exception, match="weighted directions"):
        merge_one("multislerp", torch.zeros(1), [T([1.0]), T([-1.0]), T([0.0])], [1.0, 1.0, 1.0])
    # a tensor nobody changed is the base's; without a base the models themselves are interpolated
    assert torch.equal(merge_one("multislerp", base, [base.clone()] * 3, [1.0, 1.0, 1.0]), base)
    assert close(merge_one("multislerp", T([9.0, 9.0]), [T([1.0, 0.0]), T([0.0, 1.0])], [1.0, 1.0],
                           task_vectors=False), [R, R])


def test_karcher_mean_of_directions_scaled_by_the_mean_norm():
    zero = torch.zeros(2)
    # symmetric pair, norms 2 and 1: the direction halfway, times (2 + 1) / 2
    assert close(merge_one("karcher", zero, [T([2.0, 0.0]), T([0.0, 1.0])], [1.0, 1.0]), [1.5 * R, 1.5 * R])
    # angles 0, 0, π/2 on the circle: the Riemannian mean is at the mean angle π/6 (not the chordal mean's atan(1/2))
    out = merge_one("karcher", zero, [T([1.0, 0.0]), T([1.0, 0.0]), T([0.0, 1.0])], [1.0, 1.0, 1.0])
    assert close(out, [math.cos(math.pi / 6), math.sin(math.pi / 6)], atol=1e-5)
    # all-zero tensors stay zero; a zero model leaves the direction but counts in the norm
    assert torch.equal(merge_one("karcher", zero, [zero, zero], [1.0, 1.0]), zero)
    assert close(merge_one("karcher", zero, [T([3.0, 0.0]), zero], [1.0, 1.0]), [1.5, 0.0])


def test_nearswap_takes_close_values_and_damps_far_ones():
    base = torch.zeros(3)
    out = merge_one("nearswap", base, [T([0.5e-4, 1e-3, -2e-3])], [1.0], t=1e-3)
    assert close(out, [0.5e-4, 1e-3, -1e-3], atol=1e-9)  # weights 1, 1 and 1e-3 / 2e-3
    with pytest.raises(Exception, match="nearswap needs t"):
        merge_one("nearswap", base, [base], [1.0])


@pytest.mark.parametrize(("method", "params", "expected"), [
    # entry 0 both changed (mean 2), entries 1, 2 only τ₁, entry 3 nobody (|τ| ≤ epsilon)
    ("ram", {}, [2.0, 2.0, 5.0, 0.0]),
    # τ₁: 1 shared and 2 unique changed entries, ρ = 0.5 < alpha → its unique entries × (1 + 0.1·0.5)
    ("ramplus_tl", {"r": 0.1, "alpha": 0.8}, [2.0, 2.1, 5.25, 0.0]),
    ("ramplus_tl", {"r": 0.1, "alpha": 0.2}, [2.0, 2.04, 5.1, 0.0]),  # ρ capped at alpha
])
def test_ram_sums_unique_changes_and_averages_shared_ones(method, params, expected):
    base = T([1.0, 1.0, 1.0, 1.0])
    taus = [T([1.0, 2.0, 5.0, 1e-6]), T([3.0, 0.0, 0.0, -1e-6])]
    out = merge_one(method, base, [base + t for t in taus], [1.0, 1.0], **params)
    assert close(out - base, expected, atol=1e-5)


def test_arcee_fusion_keeps_changes_above_the_outlier_threshold():
    base = torch.zeros(1, 4)
    other = T([[1.0, 0.0, 0.0, 0.1]])
    # one row: importance KL·[1, 0, 0, 0.1]; sorted, Q1 = 0 (index 0), median = 0 (index 1), Q3 = 0.1·KL (index 2),
    # threshold 0.15·KL: only the first entry reaches it
    assert close(merge_one("arcee_fusion", base, [other], [1.0]), [[1.0, 0.0, 0.0, 0.0]])
    # a second, unchanged row (KL 0) makes the quartiles 0: every importance reaches the threshold 0
    base2, other2 = torch.zeros(2, 4), torch.cat([other, torch.zeros(1, 4)])
    assert close(merge_one("arcee_fusion", base2, [other2], [1.0]), other2)


def test_mergekit_shared_parameter_recipes_map(tiny_paths):
    base, models = tiny_paths

    def mk(method, entries, shared=None, with_base=True):
        return MergeConfig.from_dict({"merge_method": method, **({"base_model": base} if with_base else {}),
                                      "models": entries, "parameters": shared or {}})

    plain = [{"model": m} for m in models]
    config = mk("multislerp", [{"model": base}] + [{"model": m, "parameters": {"weight": w}}
                                                   for m, w in zip(models, [1, 2, 3])], {"eps": 1e-6})
    assert config.parameters == {"task_vectors": True, "normalize_weights": True, "eps": 1e-6}
    assert config.weights == [1, 2, 3] and [m.model for m in config.models] == models
    assert mk("multislerp", plain, {"weight": 0.5}, with_base=False).parameters["task_vectors"] is False
    # karcher averages the base_model in as one more model (mergekit adds it to the inputs)
    config = mk("karcher", plain[:2], {"max_iter": 20})
    assert [m.model for m in config.models] == [*models[:2], base] and config.parameters == {"max_iter": 20,
                                                                                            "tol": 1e-5}
    assert [m.model for m in mk("karcher", plain, with_base=False).models] == models
    assert mk("nearswap", [{"model": base}, plain[0]], {"t": 1e-4}).parameters == {"t": 1e-4}
    assert mk("arcee_fusion", plain[:1]).parameters == {}
    assert mk("ram", plain).parameters == {"epsilon": 1e-5}
    assert mk("ramplus_tl", plain, {"r": 0.2}).parameters == {"r": 0.2, "alpha": 0.2, "epsilon": 1e-5}
    for method, entries, shared, message in [
            ("nearswap", plain[:1], {}, r"needs `parameters: \{t: \.\.\.\}`"),
            ("nearswap", plain[:2], {"t": 0.1}, "exactly 1 other model"),
            ("arcee_fusion", plain[:2], {}, "exactly 1 other model"),
            ("ram", plain, {"density": 0.5}, r"no parameter\(s\) \['density'\]"),
            ("ram", [{"model": models[0], "parameters": {"weight": 1.0}}], {}, r"\['weight'\] have no hf_mloss"),
            ("ram", [{"model": models[0], "parameters": {"epsilon": 0.1}}], {}, "shared: give it under the top"),
            ("multislerp", plain, {}, r"models\[0\].parameters.weight is missing"),
            ("ram", [], {}, "needs a non-empty `models` list, or `slices`"),
            ("ties", [], {}, "needs a non-empty `models` list, or `slices`")]:
        with pytest.raises(ConfigError, match=message):
            mk(method, entries, shared)
    with pytest.raises(ConfigError, match="needs a `base_model`"):
        mk("ram", plain, with_base=False)


# --------------------------------------------------------------------------------------------------------------------
# Per-model parameters: densities that differ, weights that vary over the model
# --------------------------------------------------------------------------------------------------------------------
def test_ties_trims_each_model_at_its_own_density():
    """τ₁ = [4, −3, 2, 1] at k 0.5 keeps [4, −3, 0, 0]; τ₂ = [−1, 2, 3, −5] at k 0.25 keeps max(1, 1) entry: −5.
    The elected signs (+, −, +, −) leave [4, −3, 0, −5]; at one shared k 0.5 τ₂ would keep 3 at entry 2."""
    m = get_method("ties")
    base = torch.zeros(4)
    sources = [T([4.0, -3.0, 2.0, 1.0]), T([-1.0, 2.0, 3.0, -5.0])]
    ctx = MergeContext(params=m.make_params(k=0.5, convention="mergekit"), weights=T([1.0, 1.0]),
                       model_params=[{"k": 0.5}, {"k": 0.25}])
    assert close(m.merge_tensor("w", base, sources, ctx), [4.0, -3.0, 0.0, -5.0])
    ctx.model_params = None
    assert close(m.merge_tensor("w", base, sources, ctx), [4.0, -3.0, 3.0, -5.0])
    assert m.chunk_keep_counts(4, MergeContext(params=m.make_params(k=0.5, convention="mergekit"), weights=T(
        [1.0, 1.0]), model_params=[{"k": 0.5}, {"k": 0.25}])) is None  # exact k: whole tensors only


def test_per_model_weight_gradients_are_resolved_per_tensor(tiny_paths, tmp_path):
    """mergekit task_arithmetic with model 0's weight a gradient [1, 0] over the 2 blocks (block 0 at x = 0, block 1
    at x = 1, tensors outside the blocks at x = 0) and model 1's weight a filter list (mlp 2, else 0.5)."""
    from safetensors.torch import load_file

    import hf_mloss

    base, models = tiny_paths
    config = MergeConfig.from_dict({
        "merge_method": "task_arithmetic", "base_model": base, "dtype": "float32", "models": [
            {"model": base},
            {"model": models[0], "parameters": {"weight": [1.0, 0.0]}},
            {"model": models[1], "parameters": {"weight": [{"filter": "mlp", "value": 2.0}, {"value": 0.5}]}}]})
    assert config.models[0].parameters == {"weight": [1.0, 0.0]} and config.models[0].weight is None
    result = hf_mloss.run(config, progress=False)
    states = [load_file(f"{path}/model.safetensors") for path in (base, *models[:2])]
    merged = result.model.state_dict()
    expected_weights = {"encoder.layers.0.mlp.fc1.weight": (1.0, 2.0), "encoder.layers.1.mlp.fc1.weight": (0.0, 2.0),
                        "encoder.layers.1.self_attn.q_proj.weight": (0.0, 0.5), "post_layernorm.weight": (1.0, 0.5),
                        "embeddings.patch_embedding.weight": (1.0, 0.5)}
    for name, (w0, w1) in expected_weights.items():
        key = next(k for k in states[0] if k.endswith(name))
        theta0, theta1, theta2 = (s[key].double() for s in states)
        expected = theta0 + w0 * (theta1 - theta0) + w1 * (theta2 - theta0)
        assert torch.allclose(merged[name].double(), expected, atol=1e-6, rtol=0), name
    resolved = result.config.resolved_parameters
    assert resolved["encoder.layers.1.mlp.fc1.weight"] == {"models[0].weight": 0.0, "models[1].weight": 2.0}
    # the card does not print one number for a weight that varies
    card = (result.save_pretrained(tmp_path / "merged") / "README.md").read_text()
    assert card.count("| varies over the model |") == 2, card


def test_per_model_parameters_are_checked_before_any_work(tiny_paths):
    base, models = tiny_paths

    def config(method, parameters, shared=None):
        return MergeConfig.from_dict({"base": base, "method": method, "parameters": shared or {},
                                      "models": [{"model": m, "weight": 1.0, "parameters": parameters} for m in models]})

    assert config("ties", {"k": 0.3}, {"scope": "tensor"}).models[0].parameters == {"k": 0.3}
    for method, parameters, shared, message in [
            ("ties", {"p": 0.3}, None, r"\['p'\]: method 'ties' reads \['weight', 'k'\] per model"),
            ("ties", {"k": 1.5}, {"scope": "tensor"}, "k names 1.5"),
            ("ties", {"k": 0.3}, None, "per-model values need scope: tensor"),
            ("slerp", {"t": 0.3}, None, "reads no parameter per model"),
            ("ties", {"weight": 2.0}, {"scope": "tensor"}, "both `weight` and `parameters.weight`")]:
        with pytest.raises(Exception, match=message):
            config(method, parameters, shared)


# --------------------------------------------------------------------------------------------------------------------
# Per-slice parameters
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deep_decoder(tmp_path_factory):
    from examples.tiny import save_with_finetunes, tiny_decoder, word_tokenizer

    base, models = save_with_finetunes(tiny_decoder("llama", num_hidden_layers=4), tmp_path_factory.mktemp("deep"),
                                       2, tokenizer=word_tokenizer())
    return str(base), [str(m) for m in models]


def sliced_task_arithmetic(base, models, first: dict, second: dict) -> dict:
    def piece(lo, hi, parameters):
        return {"sources": [{"model": m, "layer_range": [lo, hi], **({"parameters": {"weight": 1.0}} if m != base
                                                                      else {})} for m in (base, *models)],
                **({"parameters": parameters} if parameters else {})}

    return {"merge_method": "task_arithmetic", "base_model": base, "parameters": {"lambda": 0.5}, "dtype": "float32",
            "slices": [piece(0, 2, first), piece(2, 4, second)]}


def test_per_slice_lambda_scales_each_slices_layers(deep_decoder):
    """λ 2 in the first slice (and for the embeddings before it), the top-level 0.5 in the second (and the final norm
    and head after it): θ₀ + λ(τ₁ + τ₂) per tensor."""
    from safetensors.torch import load_file

    import hf_mloss

    base, models = deep_decoder
    config = MergeConfig.from_dict(sliced_task_arithmetic(base, models, {"lambda": 2.0}, {}))
    assert config.slices[0]["parameters"] == {"lam": 2.0} and "parameters" not in config.slices[1]
    merged = hf_mloss.run(config, progress=False).model.state_dict()
    states = [load_file(f"{p}/model.safetensors") for p in (base, *models)]
    for name, lam in [("model.embed_tokens.weight", 2.0), ("model.layers.1.mlp.up_proj.weight", 2.0),
                      ("model.layers.2.self_attn.q_proj.weight", 0.5), ("model.norm.weight", 0.5),
                      ("lm_head.weight", 0.5)]:
        theta0, theta1, theta2 = (s[name].double() for s in states)
        expected = theta0 + lam * ((theta1 - theta0) + (theta2 - theta0))
        assert torch.allclose(merged[name].double(), expected, atol=1e-6, rtol=0), name


def test_per_slice_parameters_map_and_refusals(deep_decoder):
    base, models = deep_decoder
    ramp = [{"filter": "mlp", "value": [0.0, 1.0]}]
    config = MergeConfig.from_dict(sliced_task_arithmetic(base, models, {}, {"lambda": ramp}))
    assert config.slices[1]["parameters"] == {"lam": [{"filter": "mlp", "value": [0.0, 1.0]}, {"value": 0.5}]}
    for bad, message in [({"density": 0.5}, r"\['density'\] are per-model parameters"),
                         ({"lambda": "big"}, "slices\\[0\\].parameters"),
                         ({"gamma": 0.1}, "slices\\[0\\].parameters")]:
        with pytest.raises(ConfigError, match=message):
            MergeConfig.from_dict(sliced_task_arithmetic(base, models, bad, {}))
    with pytest.raises(Exception, match="must be a mapping of the method's parameters"):
        MergeConfig.from_dict({"base": base, "models": models, "method": "passthrough", "slices": [
            {"sources": [{"model": 0, "layer_range": [0, 2]}], "parameters": {"t": 1}}]})


def test_methods_lists_the_per_model_parameters(capsys):
    from hf_mloss.cli import main

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "per model (models[i].parameters): weight, k\n" in out  # ties
    assert "per model (models[i].parameters): weight, k, e\n" in out  # della


# --------------------------------------------------------------------------------------------------------------------
# Iso-C / Iso-CTS on rank-deficient sums: only the numerically non-zero spectrum is flattened
# --------------------------------------------------------------------------------------------------------------------
def low_rank_tasks(q: int = 3, size: int = 24, rank: int = 2, seed: int = 0) -> torch.Tensor:
    """q task matrices B_p A_p of rank ``rank`` (what a LoRA fine-tune's task vector is), float32."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randn(size, rank, generator=g) @ torch.randn(rank, size, generator=g)
                        for _ in range(q)])


def test_iso_c_flattens_only_the_sums_range():
    """The sum of 3 rank-2 matrices has rank 6: the merge is σ̄·U₆V₆ᵀ with σ̄ the mean of those 6 singular values
    (computed here in float64), not 24 directions with 18 of rounding noise raised to a smaller σ̄."""
    from hf_mloss.methods.iso import iso_c_matrix

    taus = low_rank_tasks()
    u, s, vh = torch.linalg.svd(taus.sum(0).double())
    expected = (u[:, :6] * s[:6].mean()) @ vh[:6]
    merged = iso_c_matrix(taus.sum(0))
    assert torch.allclose(merged.double(), expected, atol=1e-4 * float(s[:6].mean()), rtol=0)
    spectrum = torch.linalg.svdvals(merged.double())
    assert torch.allclose(spectrum[:6], s[:6].mean().expand(6), rtol=1e-4) and spectrum[6] < 1e-4 * spectrum[0]
    # a full-rank sum keeps every direction (the flat spectrum of the paper)
    full = torch.randn(24, 24, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(torch.linalg.svdvals(iso_c_matrix(full)), torch.linalg.svdvals(full).mean().expand(24),
                          rtol=1e-4)


def test_iso_cts_keeps_no_noise_direction_of_a_rank_deficient_sum():
    from hf_mloss.methods.iso import iso_cts_matrix

    taus = low_rank_tasks()
    merged = iso_cts_matrix(taus, 0.8)
    spectrum = torch.linalg.svdvals(merged.double())
    rank = int((spectrum > 1e-4 * spectrum[0]).sum())
    assert rank <= 6  # the tasks span 6 directions; nothing else is raised
    # every kept direction lies in the tasks' column space
    u = torch.linalg.svd(torch.cat(list(taus), 1).double())[0][:, :6]
    assert torch.allclose(u @ (u.T @ merged.double()), merged.double(), atol=1e-4 * float(spectrum[0]))
    # with the rank-deficient part dropped the kept spectrum is flat
    assert torch.allclose(spectrum[:rank], spectrum[0].expand(rank), rtol=1e-3)
