"""Tests for `hf_mloss.theory`: TV(f') constants, closed forms vs Monte Carlo, paper constants, validation."""

from __future__ import annotations

import math

import pytest
import torch

from hf_mloss.theory import (
    ACTIVATIONS,
    PAPER_ACTIVATIONS,
    expected_mloss,
    get_activation,
    monte_carlo_mloss,
    paper_expected_mloss,
    total_variation_of_derivative,
)


# --------------------------------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------------------------------


def test_registry_names_and_read_only() -> None:
    assert set(ACTIVATIONS) == {"relu", "leaky_relu", "gelu", "gelu_tanh", "quick_gelu", "silu"}
    with pytest.raises(TypeError):
        ACTIVATIONS["tanh"] = torch.tanh  # type: ignore[index]


def test_activation_values() -> None:
    x = torch.tensor([-3.0, -1.0, -0.25, 0.0, 0.5, 2.0], dtype=torch.float64)
    xs = x.tolist()
    phi = [0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in xs]
    sig = [1.0 / (1.0 + math.exp(-v)) for v in xs]
    sig_q = [1.0 / (1.0 + math.exp(-1.702 * v)) for v in xs]
    tanh_gelu = [0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3))) for v in xs]
    expected = {
        "relu": [max(v, 0.0) for v in xs],
        "leaky_relu": [v if v >= 0 else 0.01 * v for v in xs],  # default slope 0.01
        "gelu": [v * p for v, p in zip(xs, phi)],  # exact erf GELU
        "gelu_tanh": tanh_gelu,
        "quick_gelu": [v * q for v, q in zip(xs, sig_q)],
        "silu": [v * q for v, q in zip(xs, sig)],
    }
    for name, values in expected.items():
        torch.testing.assert_close(ACTIVATIONS[name](x), torch.tensor(values, dtype=torch.float64), msg=name)
    # exact and tanh GELU are different functions
    assert not torch.allclose(ACTIVATIONS["gelu"](x), ACTIVATIONS["gelu_tanh"](x), rtol=0, atol=1e-6)


def test_leaky_relu_alpha() -> None:
    x = torch.tensor([-2.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(ACTIVATIONS["leaky_relu"](x, alpha=0.2), torch.tensor([-0.4, 3.0], dtype=torch.float64))
    leaky = get_activation("leaky_relu", alpha=0.2)
    torch.testing.assert_close(leaky(x), torch.tensor([-0.4, 3.0], dtype=torch.float64))
    torch.testing.assert_close(get_activation("leaky_relu")(x), torch.tensor([-0.02, 3.0], dtype=torch.float64))
    assert get_activation(torch.tanh) is torch.tanh


# --------------------------------------------------------------------------------------------------------------------
# TV(f')
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [("relu", 1.0), ("leaky_relu", 0.99), ("gelu", 1.5156), ("quick_gelu", 1.3994), ("silu", 1.3994)],
)
def test_tv_matches_spec(name: str, value: float) -> None:
    assert total_variation_of_derivative(name) == pytest.approx(value, abs=3e-4)


def test_tv_leaky_relu_closed_form_and_numeric_agree() -> None:
    assert total_variation_of_derivative("leaky_relu", alpha=0.2) == pytest.approx(0.8, abs=1e-12)
    numeric = total_variation_of_derivative(get_activation("leaky_relu", alpha=0.2))  # callable: numeric path
    assert numeric == pytest.approx(0.8, abs=1e-9)
    assert total_variation_of_derivative(torch.relu) == pytest.approx(1.0, abs=1e-9)  # kink handled numerically


def test_tv_gelu_against_analytic() -> None:
    # GELU' = Phi + x phi has extrema at +-sqrt(2) and goes 0 -> 1, so TV = 2 (max - min) - 1.
    phi = math.exp(-1.0) / math.sqrt(2.0 * math.pi)
    exact = 2.0 * (math.erf(1.0) + 2.0 * math.sqrt(2.0) * phi) - 1.0
    assert total_variation_of_derivative("gelu") == pytest.approx(exact, abs=1e-6)


def test_tv_silu_against_analytic_and_quick_gelu() -> None:
    # SiLU' = sig (1 + x (1 - sig)) has extrema where x tanh(x/2) = 2; TV = 2 (f'(x*) - f'(-x*)) - 1.
    lo, hi = 1.0, 4.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mid * math.tanh(mid / 2.0) < 2.0 else (lo, mid)
    root = 0.5 * (lo + hi)

    def dsilu(v: float) -> float:
        sig = 1.0 / (1.0 + math.exp(-v))
        return sig * (1.0 + v * (1.0 - sig))

    exact = 2.0 * (dsilu(root) - dsilu(-root)) - 1.0
    assert total_variation_of_derivative("silu") == pytest.approx(exact, abs=1e-6)
    # QuickGELU(x) = SiLU(1.702 x) / 1.702, so its f'' integrates to the same value.
    assert total_variation_of_derivative("quick_gelu") == pytest.approx(exact, abs=1e-6)


def test_tv_generic_callables() -> None:
    assert total_variation_of_derivative(torch.tanh) == pytest.approx(2.0, abs=1e-6)  # sech^2: 0 -> 1 -> 0
    assert total_variation_of_derivative(torch.nn.functional.softplus) == pytest.approx(1.0, abs=1e-6)  # sigmoid
    # tanh-GELU is close to, but not the same as, exact GELU
    tv_tanh = total_variation_of_derivative("gelu_tanh")
    assert tv_tanh == pytest.approx(1.5156, abs=2e-3)
    assert tv_tanh != pytest.approx(total_variation_of_derivative("gelu"), abs=1e-5)


# --------------------------------------------------------------------------------------------------------------------
# Closed form
# --------------------------------------------------------------------------------------------------------------------


def test_expected_mloss_spec_values() -> None:
    assert expected_mloss("relu", 1.0, 10.0) == pytest.approx(1.250e-2, rel=1e-12)
    assert expected_mloss("leaky_relu", 1.0, 10.0, alpha=0.1) == pytest.approx(0.9 / 80.0, rel=1e-12)
    assert expected_mloss("gelu", 0.1, 10.0) == pytest.approx(1.895e-4, rel=1e-3)
    assert expected_mloss("quick_gelu", 0.3, 10.0) * 10.0 / 0.3**2 == pytest.approx(0.1749, abs=1e-4)
    assert expected_mloss("silu", 0.3, 10.0) * 10.0 / 0.3**2 == pytest.approx(0.1749, abs=1e-4)


def test_expected_mloss_scaling() -> None:
    for name in ("relu", "gelu", "silu"):
        base = expected_mloss(name, 0.5, 10.0)
        assert expected_mloss(name, 1.0, 10.0) == pytest.approx(4.0 * base, rel=1e-12)  # s^2
        assert expected_mloss(name, 0.5, 20.0) == pytest.approx(0.5 * base, rel=1e-12)  # 1/K


# --------------------------------------------------------------------------------------------------------------------
# Closed form vs Monte Carlo
# --------------------------------------------------------------------------------------------------------------------

# Tolerance: |MC - formula| <= rel * formula + 4 * SE.
# * ReLU / LeakyReLU: the formula is exact up to terms ~exp(-(K/s)^2), so only sampling noise matters: rel = 0.5%
#   (a guard for the float sum); 16e6-sample runs landed within 1.3 SE of the formula.
# * Smooth f: s^2 TV / (8K) is only the small-s leading term; the next term lowers E[D] by a relative amount ~ s^2
#   (measured with 16e6 samples at K = 10: GELU -1.0% at s = 0.3 and -2.9% at s = 0.5, QuickGELU -0.65% at s = 0.3,
#   SiLU -0.24% at s = 0.3; at K = 5 SiLU also loses ~4% of its |f''| mass outside [-K, K]). We use s <= 0.3 and
#   K = 10, where the bias is <= 1%, and rel = 3% on top of 4 SE (~1.8% at 1e6 samples). A constant off by 5% or more
#   (e.g. the paper's, 32-80% too high) cannot pass.
# Relative noise does not depend on s (D scales as s^2 everywhere), so small s costs no extra samples.
MC_CASES = [
    # name, s, K, alpha, rel
    ("relu", 1.0, 10.0, 0.01, 0.005),
    ("leaky_relu", 0.5, 5.0, 0.2, 0.005),
    ("gelu", 0.1, 10.0, 0.01, 0.03),
    ("quick_gelu", 0.3, 10.0, 0.01, 0.03),
    ("silu", 0.3, 10.0, 0.01, 0.03),
]


@pytest.mark.parametrize(("name", "s", "K", "alpha", "rel"), MC_CASES, ids=[c[0] for c in MC_CASES])
def test_closed_form_matches_monte_carlo(name: str, s: float, K: float, alpha: float, rel: float) -> None:
    mean, se = monte_carlo_mloss(name, s, K, num_samples=1_000_000, seed=1234, alpha=alpha)
    formula = expected_mloss(name, s, K, alpha=alpha)
    assert 0.0 < se < 0.01 * mean  # the estimate is precise enough for the check to mean something
    assert abs(mean - formula) <= rel * formula + 4.0 * se, (name, mean, se, formula)


def test_monte_carlo_exact_quadratic_and_chunking() -> None:
    # f(x) = x^2 gives D = (a - b)^2 / 4 = (s^2 / 2) chi2_1: E[D] = s^2 / 2, SE = (s^2 / 2) sqrt(2 / n), for any K.
    # A ragged chunk size exercises the running mean / variance merge.
    s, n = 0.7, 60_000
    mean, se = monte_carlo_mloss(torch.square, s, 3.0, num_samples=n, batch=997, seed=5)
    assert se == pytest.approx(0.5 * s * s * math.sqrt(2.0 / n), rel=0.05)
    assert abs(mean - 0.5 * s * s) <= 4.0 * se
    # one chunk (other draws) must give statistically the same answer: the merge adds no bias
    one_mean, one_se = monte_carlo_mloss(torch.square, s, 3.0, num_samples=n, batch=n, seed=5)
    assert abs(one_mean - mean) <= 8.0 * se and one_se == pytest.approx(se, rel=0.05)
    # batch=1: every chunk has zero spread, so the whole variance comes from merging the chunk means
    tiny_mean, tiny_se = monte_carlo_mloss(torch.square, s, 3.0, num_samples=2_000, batch=1, seed=5)
    assert tiny_se == pytest.approx(0.5 * s * s * math.sqrt(2.0 / 2_000), rel=0.25)  # ~6 sd of the SE estimate
    assert abs(tiny_mean - 0.5 * s * s) <= 4.0 * tiny_se
    # a linear f has no merge gap at all
    lin_mean, lin_se = monte_carlo_mloss(lambda t: 3.0 * t + 1.0, 1.0, 10.0, num_samples=10_000, batch=3_000)
    assert lin_mean < 1e-12 and lin_se < 1e-12


def test_monte_carlo_reproducible_and_private_rng() -> None:
    state = torch.get_rng_state()
    first = monte_carlo_mloss("relu", 1.0, 10.0, num_samples=200_000, seed=7, batch=50_000)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    torch.manual_seed(999)  # and does not influence the result
    second = monte_carlo_mloss("relu", 1.0, 10.0, num_samples=200_000, seed=7, batch=50_000)
    other = monte_carlo_mloss("relu", 1.0, 10.0, num_samples=200_000, seed=8, batch=50_000)
    assert first == second
    assert first[0] != other[0]
    assert abs(first[0] - other[0]) <= 6.0 * math.hypot(first[1], other[1])  # different draws, same quantity


# --------------------------------------------------------------------------------------------------------------------
# Paper constants
# --------------------------------------------------------------------------------------------------------------------


def test_paper_constants_are_too_large() -> None:
    assert PAPER_ACTIVATIONS == ("relu", "gelu")
    relu_ratio = paper_expected_mloss("relu", 1.0, 10.0) / expected_mloss("relu", 1.0, 10.0)
    assert relu_ratio == pytest.approx(8.0 / (math.sqrt(2.0) * math.pi), rel=1e-12)
    assert relu_ratio == pytest.approx(1.80, abs=0.005)
    gelu_ratio = paper_expected_mloss("gelu", 0.1, 10.0) / expected_mloss("gelu", 0.1, 10.0)
    assert gelu_ratio == pytest.approx(1.32, abs=0.005)
    assert paper_expected_mloss("gelu", 0.5, 10.0) == pytest.approx(0.25 * 0.25 / 10.0, rel=1e-12)
    # the paper's s^2 scaling is right, only the constant is off
    assert paper_expected_mloss("relu", 2.0, 10.0) == pytest.approx(4.0 * paper_expected_mloss("relu", 1.0, 10.0))


def test_monte_carlo_rejects_paper_relu_constant() -> None:
    mean, se = monte_carlo_mloss("relu", 1.0, 10.0, num_samples=400_000, seed=3)
    paper = paper_expected_mloss("relu", 1.0, 10.0)
    assert paper - mean > 50.0 * se


# --------------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------------


def test_unknown_activation_lists_valid_names() -> None:
    for call in (
        lambda: expected_mloss("tanh", 0.1, 10.0),
        lambda: monte_carlo_mloss("tanh", 0.1, 10.0, num_samples=10),
        lambda: total_variation_of_derivative("tanh"),
        lambda: get_activation("tanh"),
    ):
        with pytest.raises(ValueError, match="tanh") as info:
            call()
        for name in ACTIVATIONS:
            assert name in str(info.value)
    with pytest.raises(ValueError, match="silu"):
        paper_expected_mloss("silu", 0.1, 10.0)


@pytest.mark.parametrize(
    ("s", "K", "pattern"),
    [
        (0.0, 10.0, r"s=0\.0"),
        (-1.0, 10.0, r"s=-1\.0"),
        (float("nan"), 10.0, r"s=nan"),
        (0.1, 0.0, r"K=0\.0"),
        (0.1, -2.0, r"K=-2\.0"),
        (2.0, 2.0, r"K much larger than s.*K=2\.0"),
        (3.0, 1.5, r"K much larger than s.*K=1\.5"),
    ],
)
def test_expected_mloss_bad_inputs(s: float, K: float, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        expected_mloss("relu", s, K)
    with pytest.raises(ValueError, match=pattern):
        paper_expected_mloss("gelu", s, K)


def test_monte_carlo_bad_inputs_and_small_K_allowed() -> None:
    with pytest.raises(ValueError, match="s=0.0"):
        monte_carlo_mloss("relu", 0.0, 10.0)
    with pytest.raises(ValueError, match="K=-1.0"):
        monte_carlo_mloss("relu", 1.0, -1.0)
    with pytest.raises(ValueError, match="num_samples"):
        monte_carlo_mloss("relu", 1.0, 10.0, num_samples=1)
    with pytest.raises(ValueError, match="batch"):
        monte_carlo_mloss("relu", 1.0, 10.0, num_samples=100, batch=0)
    mean, se = monte_carlo_mloss("relu", 2.0, 1.0, num_samples=1_000)  # K <= s is fine for the simulation
    assert mean > 0.0 and se > 0.0


def test_tv_bad_grid() -> None:
    with pytest.raises(ValueError, match="lo"):
        total_variation_of_derivative("gelu", lo=5.0, hi=-5.0)
    with pytest.raises(ValueError, match="num"):
        total_variation_of_derivative("gelu", num=2)
