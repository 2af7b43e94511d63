"""Tests for `hf_mloss.engine.theory`: TV(f') constants, q-source closed forms vs Monte Carlo, validity range, normalised
variants, paper constants, validation."""

from __future__ import annotations

import doctest
import math
import warnings

import pytest
import torch

from hf_mloss.engine import theory
from hf_mloss.errors import InvalidParameterError
from hf_mloss.engine.theory import (
    ACTIVATIONS,
    PAPER_ACTIVATIONS,
    ClosedFormValidityWarning,
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


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The Monte Carlo chunks are element-wise ops: on shared cores a second intra-op thread waits for a busy core and
    # makes them several times slower, so this module runs single-threaded.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Non-uniform weights per q, deliberately unnormalised (the functions normalise): 1 - Σα² is 0.375, 0.555 and 0.677,
# against 0.5, 0.75 and 0.875 for uniform weights.
UNEVEN = {2: [1.0, 3.0], 4: [1.0, 2.0, 3.0, 10.0], 8: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 3.2]}


def _spread(weights: list[float]) -> float:
    total = sum(weights)
    return 1.0 - sum((w / total) ** 2 for w in weights)


def test_expected_mloss_spec_values() -> None:
    assert expected_mloss("relu", 1.0, 10.0) == pytest.approx(1.250e-2, rel=1e-12)
    assert expected_mloss("leaky_relu", 1.0, 10.0, alpha=0.1) == pytest.approx(0.9 / 80.0, rel=1e-12)
    assert expected_mloss("gelu", 0.1, 10.0) == pytest.approx(1.895e-4, rel=1e-3)
    assert expected_mloss("quick_gelu", 0.3, 10.0) * 10.0 / 0.3**2 == pytest.approx(0.1749, abs=1e-4)
    assert expected_mloss("silu", 0.3, 10.0) * 10.0 / 0.3**2 == pytest.approx(0.1749, abs=1e-4)
    # q = 8 uniform: (1 - 1/8) s^2 / (4K) = 2.1875e-2, 1.75 times the q = 2 value (SPEC §6)
    assert expected_mloss("relu", 1.0, 10.0, num_sources=8) == pytest.approx(2.1875e-2, rel=1e-12)
    for name in ("relu", "gelu", "quick_gelu"):
        ratio = expected_mloss(name, 0.2, 10.0, num_sources=8) / expected_mloss(name, 0.2, 10.0)
        assert ratio == pytest.approx(1.75, rel=1e-12)


def test_expected_mloss_scaling() -> None:
    for name in ("relu", "gelu", "silu"):
        base = expected_mloss(name, 0.25, 10.0)
        assert expected_mloss(name, 0.125, 10.0) == pytest.approx(0.25 * base, rel=1e-12)  # s^2
        assert expected_mloss(name, 0.25, 20.0) == pytest.approx(0.5 * base, rel=1e-12)  # 1/K


def test_expected_mloss_weights_rho_and_sources() -> None:
    base = expected_mloss("gelu", 0.2, 10.0)  # q = 2, uniform: (1 - 1/2) s^2 TV / (4K) = s^2 TV / (8K)
    for q, weights in UNEVEN.items():
        uniform = expected_mloss("gelu", 0.2, 10.0, num_sources=q)
        assert uniform == pytest.approx(2.0 * (1.0 - 1.0 / q) * base, rel=1e-12)
        assert expected_mloss("gelu", 0.2, 10.0, weights=[1.0] * q) == pytest.approx(uniform, rel=1e-12)
        uneven = expected_mloss("gelu", 0.2, 10.0, weights=weights, num_sources=q)
        assert uneven == pytest.approx(2.0 * _spread(weights) * base, rel=1e-12)
        # only the ratios of the weights matter
        scaled = expected_mloss("gelu", 0.2, 10.0, weights=[7.0 * w for w in weights])
        assert scaled == pytest.approx(uneven, rel=1e-12)
    assert expected_mloss("gelu", 0.2, 10.0, weights=[1, 0, 1]) == pytest.approx(base, rel=1e-12)  # a 0 drops out
    assert expected_mloss("relu", 1.0, 10.0, num_sources=1) == 0.0  # one source: merging is exact
    # correlated shifts: s^2 -> s^2 (1 - rho)
    assert expected_mloss("relu", 1.0, 10.0, num_sources=4, rho=0.5) == pytest.approx(0.5 * 0.75 / 40.0, rel=1e-12)
    assert expected_mloss("relu", 1.0, 10.0, num_sources=4, rho=-0.3) == pytest.approx(1.3 * 0.75 / 40.0, rel=1e-12)


def test_sq_reduction_has_no_closed_form() -> None:
    with pytest.raises(InvalidParameterError, match=r"s\^4.*monte_carlo_mloss"):
        expected_mloss("gelu", 0.1, 10.0, reduction="sq")
    with pytest.raises(InvalidParameterError, match=r"\['abs', 'sq'\].*'max'"):
        expected_mloss("gelu", 0.1, 10.0, reduction="max")
    # why: at fixed K the mean of g^2 grows as s^4 for a smooth f and as s^3 for ReLU, while E|g| grows as s^2
    for name, K, s, power in (("gelu", 5.0, 0.1, 4), ("relu", 10.0, 0.5, 3)):
        small = monte_carlo_mloss(name, s, K, num_samples=200_000, seed=1)
        large = monte_carlo_mloss(name, 2.0 * s, K, num_samples=200_000, seed=2)
        ratio = large.sq_mean / small.sq_mean
        ratio_se = ratio * math.hypot(small.sq_stderr / small.sq_mean, large.sq_stderr / large.sq_mean)
        assert abs(ratio - 2.0**power) <= 0.02 * 2.0**power + 4.0 * ratio_se, (name, ratio, ratio_se)
        assert large.abs_mean / small.abs_mean == pytest.approx(4.0, rel=0.03)


# --------------------------------------------------------------------------------------------------------------------
# Validity range
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "s", "K", "kwargs", "pattern"),
    [
        ("relu", 1.0, 2.0, {}, r"K / s = 2 < 3"),
        ("leaky_relu", 1.0, 2.9, {"num_sources": 8}, r"K / s = 2\.9 < 3"),
        ("gelu", 0.1, 2.0, {}, r"12\.7% too high .*K >> 3"),
        ("gelu", 0.1, 1.0, {}, r"29\.9% too high"),
        ("silu", 0.1, 5.0, {}, r"3\.9% too high"),
        ("gelu", 0.5, 10.0, {}, r"s \* sqrt\(1 - rho\) = 0\.5 > 0\.3"),
        ("quick_gelu", 0.3, 10.0, {"rho": -0.2, "num_sources": 4}, r"= 0\.329 > 0\.3"),
    ],
)
def test_out_of_range_warns(name: str, s: float, K: float, kwargs: dict, pattern: str) -> None:
    with pytest.warns(ClosedFormValidityWarning, match=pattern):
        value = expected_mloss(name, s, K, **kwargs)
    assert value > 0.0  # still returned


@pytest.mark.parametrize(
    ("name", "s", "K", "kwargs"),
    [
        ("relu", 1.0, 3.0, {}),  # K = 3s is enough for piecewise-linear f, whatever s
        ("relu", 5.0, 20.0, {"num_sources": 8}),
        ("gelu", 0.3, 3.0, {}),  # GELU's |f''| beyond ±3 is worth 1.6%
        ("quick_gelu", 0.1, 3.5, {}),
        ("silu", 0.1, 6.0, {}),
        ("gelu", 0.5, 10.0, {"rho": 0.75}),  # only the independent part s sqrt(1 - rho) = 0.25 counts
        ("gelu", 0.1, 1e6, {}),
    ],
)
def test_in_range_is_silent(name: str, s: float, K: float, kwargs: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected_mloss(name, s, K, **kwargs)


# The warning's overestimate for smooth f, TV(f') / ∫_{-K}^{K} |f''| - 1, is what Monte Carlo measures (s = 0.1, where
# the next-order term is <= 0.2%): GELU 12.7% at K = 2 (SPEC: 13%), SiLU 8.1% at K = 4. Samples for a 0.5% relative SE
# from the per-draw coefficient of variation CV (measured: 2.0 and 2.3): n = (CV / 0.005)^2.
@pytest.mark.parametrize(
    ("name", "K", "weights", "excess", "num_samples"),
    [("gelu", 2.0, [1, 1], 0.1267, 160_000), ("silu", 4.0, UNEVEN[4], 0.0814, 212_000)],
)
def test_small_K_overestimate_is_the_tail_of_f2(
    name: str, K: float, weights: list[float], excess: float, num_samples: int
) -> None:
    mc = monte_carlo_mloss(name, 0.1, K, weights=weights, num_samples=num_samples, seed=21)
    with pytest.warns(ClosedFormValidityWarning, match=f"{100 * excess:.1f}% too high"):
        formula = expected_mloss(name, 0.1, K, weights=weights)
    corrected = formula / (1.0 + excess)
    assert mc.abs_stderr <= 0.0055 * mc.abs_mean
    assert abs(mc.abs_mean - corrected) <= 0.005 * corrected + 4.0 * mc.abs_stderr, (mc, corrected)
    assert formula / mc.abs_mean - 1.0 > excess - 0.02  # the uncorrected closed form really is that far off


# --------------------------------------------------------------------------------------------------------------------
# Closed form vs Monte Carlo: q = 2, 4, 8, uniform and uneven weights
# --------------------------------------------------------------------------------------------------------------------

# Tolerance: |MC - formula| <= bias * formula + 4 * SE, with SE <= 0.5% of the mean, so the check is at most 2%
# (piecewise-linear) or 2.5% (smooth) wide. What it rejects: the q = 2 constant at q = 4, 8 (off by 33-43%), uniform
# weights where they are uneven (18-33%), GELU's TV for QuickGELU's (8%), the paper's constants (32-80%).
# * bias: ReLU / LeakyReLU are exact up to terms ~exp(-(K/s)^2): 0. Smooth f at s = 0.1 and a K where |f''| beyond ±K
#   is <= 0.06% of TV (GELU K = 5, QuickGELU K = 6, SiLU K = 10): the next-order term is ~ -0.18 s^2 <= 0.2%, and
#   2e6-sample runs landed within 0.4% +- 0.3%: bias = 0.5%.
# * samples: the relative SE is CV / sqrt(n), CV the per-draw coefficient of variation of |g|. It depends on q and on
#   K/s (piecewise-linear) or K (smooth), not on s; upper bounds from 1e6-draw runs over both weightings are below,
#   and n = (CV / 0.005)^2. The test also checks that the SE it got meets the target, i.e. that the bound holds.
SE_TARGET = 0.005
MC_SETTINGS = {
    # name: (s, K, alpha, bias, CV bound for q = 2, 4, 8)
    "relu": (1.0, 10.0, 0.01, 0.0, {2: 5.5, 4: 4.2, 8: 3.7}),  # the SPEC's K = 10, s = 1
    "leaky_relu": (1.0, 5.0, 0.2, 0.0, {2: 3.8, 4: 2.9, 8: 2.5}),
    "gelu": (0.1, 5.0, 0.01, 0.005, {2: 3.1, 4: 2.4, 8: 2.1}),
    "quick_gelu": (0.1, 6.0, 0.01, 0.005, {2: 3.6, 4: 2.8, 8: 2.5}),
    "silu": (0.1, 10.0, 0.01, 0.005, {2: 3.6, 4: 2.8, 8: 2.5}),
}
MC_CASES = [(name, q, uneven) for name in MC_SETTINGS for q in (2, 4, 8) for uneven in (False, True)]


@pytest.mark.parametrize(
    ("name", "q", "uneven"), MC_CASES, ids=[f"{n}-q{q}-{'uneven' if u else 'uniform'}" for n, q, u in MC_CASES]
)
def test_closed_form_matches_monte_carlo(name: str, q: int, uneven: bool) -> None:
    s, K, alpha, bias, cv = MC_SETTINGS[name]
    weights = UNEVEN[q] if uneven else [1.0] * q
    num_samples = math.ceil((cv[q] / SE_TARGET) ** 2)
    seed = MC_CASES.index((name, q, uneven))
    mc = monte_carlo_mloss(name, s, K, weights=weights, num_samples=num_samples, seed=seed, alpha=alpha)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every case is inside the validity range
        formula = expected_mloss(name, s, K, weights=weights, alpha=alpha)
    assert mc.abs_stderr <= SE_TARGET * mc.abs_mean
    assert abs(mc.abs_mean - formula) <= bias * formula + 4.0 * mc.abs_stderr, (mc.abs_mean, mc.abs_stderr, formula)


# Correlated shifts (rho) scale the closed form by 1 - rho; n = (CV / 0.005)^2 with CV 4.6 (ReLU, rho = 0.5),
# 3.6 (ReLU, rho = -0.3) and 2.1 (GELU, rho = -0.1), measured as above.
@pytest.mark.parametrize(
    ("name", "s", "K", "weights", "rho", "bias", "num_samples"),
    [
        ("relu", 1.0, 10.0, [1.0] * 4, 0.5, 0.0, 846_400),
        ("relu", 1.0, 10.0, [1.0] * 4, -0.3, 0.0, 518_400),
        ("gelu", 0.1, 5.0, UNEVEN[8], -0.1, 0.005, 176_400),
    ],
)
def test_correlated_shifts_match_monte_carlo(
    name: str, s: float, K: float, weights: list[float], rho: float, bias: float, num_samples: int
) -> None:
    mc = monte_carlo_mloss(name, s, K, weights=weights, rho=rho, num_samples=num_samples, seed=31)
    formula = expected_mloss(name, s, K, weights=weights, rho=rho)
    assert formula == pytest.approx((1.0 - rho) * expected_mloss(name, s, K, weights=weights), rel=1e-12)
    assert mc.abs_stderr <= SE_TARGET * mc.abs_mean
    assert abs(mc.abs_mean - formula) <= bias * formula + 4.0 * mc.abs_stderr, (mc.abs_mean, mc.abs_stderr, formula)


def test_monte_carlo_exact_quadratic_and_chunking() -> None:
    # f(x) = x^2 gives g = -Σ α_p (h_p - m)^2 exactly, for any K. For q = 2 uniform, |g| = (a - b)^2 / 4 =
    # (s^2 / 2) chi2_1: E|g| = s^2 / 2, SE = (s^2 / 2) sqrt(2 / n), E[g^2] = 3 s^4 / 4.
    # A ragged chunk size exercises the running moment merge.
    s, n = 0.7, 60_000
    mc = monte_carlo_mloss(torch.square, s, 3.0, num_samples=n, batch=997, seed=5)
    assert mc.num_samples == n
    assert mc.abs_stderr == pytest.approx(0.5 * s * s * math.sqrt(2.0 / n), rel=0.05)
    assert abs(mc.abs_mean - 0.5 * s * s) <= 4.0 * mc.abs_stderr
    assert abs(mc.sq_mean - 0.75 * s**4) <= 4.0 * mc.sq_stderr
    # one chunk (other draws) must give statistically the same answer: the merge adds no bias
    one = monte_carlo_mloss(torch.square, s, 3.0, num_samples=n, batch=n, seed=5)
    assert abs(one.abs_mean - mc.abs_mean) <= 8.0 * mc.abs_stderr
    assert one.abs_stderr == pytest.approx(mc.abs_stderr, rel=0.05)
    # batch=1: every chunk has zero spread, so the whole variance comes from merging the chunk means
    tiny = monte_carlo_mloss(torch.square, s, 3.0, num_samples=2_000, batch=1, seed=5)
    assert tiny.abs_stderr == pytest.approx(0.5 * s * s * math.sqrt(2.0 / 2_000), rel=0.25)  # ~6 sd of the SE
    assert abs(tiny.abs_mean - 0.5 * s * s) <= 4.0 * tiny.abs_stderr
    # a linear f has no merge gap at all
    lin = monte_carlo_mloss(lambda t: 3.0 * t + 1.0, 1.0, 10.0, num_samples=10_000, batch=3_000)
    assert lin.abs_mean < 1e-12 and lin.abs_stderr < 1e-12


@pytest.mark.parametrize(("q", "rho"), [(4, 0.0), (8, 0.6), (3, -0.4)])
def test_monte_carlo_weighted_spread_is_exact_for_a_quadratic(q: int, rho: float) -> None:
    # For f(x) = x^2, E|g| = s^2 (1 - rho) (1 - Σα²) with no approximation at all: the factor of the closed form.
    weights = UNEVEN.get(q, [1.0, 2.0, 5.0])
    mc = monte_carlo_mloss(torch.square, 0.5, 1.0, weights=weights, rho=rho, num_samples=40_000, seed=q)
    exact = 0.25 * (1.0 - rho) * _spread(weights)
    assert mc.abs_stderr <= 0.01 * exact
    assert abs(mc.abs_mean - exact) <= 4.0 * mc.abs_stderr, (mc.abs_mean, mc.abs_stderr, exact)


def test_monte_carlo_weights_are_normalised_and_sources_consistent() -> None:
    common = {"num_samples": 20_000, "seed": 4}
    assert monte_carlo_mloss("gelu", 0.3, 5.0, weights=[1, 3], **common) == monte_carlo_mloss(
        "gelu", 0.3, 5.0, weights=[0.5, 1.5], **common
    )
    assert monte_carlo_mloss("gelu", 0.3, 5.0, **common) == monte_carlo_mloss(
        "gelu", 0.3, 5.0, weights=[2, 2], num_sources=2, **common
    )
    single = monte_carlo_mloss("gelu", 0.3, 5.0, num_sources=1, **common)
    assert single.abs_mean == 0.0 and single.ratio_of_sums == 0.0


def test_monte_carlo_reproducible_and_private_rng() -> None:
    state = torch.get_rng_state()
    first = monte_carlo_mloss("relu", 1.0, 10.0, num_samples=100_000, seed=7, batch=25_000)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    torch.manual_seed(999)  # and does not influence the result
    second = monte_carlo_mloss("relu", 1.0, 10.0, num_samples=100_000, seed=7, batch=25_000)
    other = monte_carlo_mloss("relu", 1.0, 10.0, num_samples=100_000, seed=8, batch=25_000)
    assert first == second
    assert first.abs_mean != other.abs_mean
    assert abs(first.abs_mean - other.abs_mean) <= 6.0 * math.hypot(first.abs_stderr, other.abs_stderr)


# --------------------------------------------------------------------------------------------------------------------
# Normalised variants
# --------------------------------------------------------------------------------------------------------------------


def test_ratio_of_sums_matches_relu_closed_form() -> None:
    # ReLU, K >> s: Σ|g| / n -> (1 - Σα²) s^2 / (4K) and, as m = x + N(0, s^2 Σα²), Σ relu(m) / n -> (K^2 + s^2 Σα²)
    # / (4K), so the ratio of sums is (1 - Σα²) s^2 / (K^2 + s^2 Σα²). Per-draw CV of the ratio (delta method) at K / s = 5,
    # q = 8 uneven: 3.1 (measured), so n = (3.2 / 0.005)^2 for a 0.5% relative SE.
    weights = UNEVEN[8]
    spread = _spread(weights)
    mc = monte_carlo_mloss("relu", 1.0, 5.0, weights=weights, num_samples=409_600, seed=41)
    expected = spread / (25.0 + (1.0 - spread))
    assert mc.ratio_of_sums_stderr <= SE_TARGET * mc.ratio_of_sums
    assert abs(mc.ratio_of_sums - expected) <= 4.0 * mc.ratio_of_sums_stderr, (mc, expected)


def test_ratio_of_sums_stderr_matches_seed_to_seed_spread() -> None:
    # The delta-method SE must describe the actual spread of the estimate: 24 independent runs, whose sample standard
    # deviation has a relative sd of 1/sqrt(46) ≈ 15%, so +-45% is a 3-sd band.
    runs = [monte_carlo_mloss("gelu", 0.1, 5.0, num_sources=4, num_samples=20_000, seed=100 + i) for i in range(24)]
    ratios = torch.tensor([r.ratio_of_sums for r in runs], dtype=torch.float64)
    reported = sum(r.ratio_of_sums_stderr for r in runs) / len(runs)
    assert float(ratios.std()) == pytest.approx(reported, rel=0.45)


def test_per_position_normalised_is_heavy_tailed_ratio_of_sums_is_not() -> None:
    # GELU: f(m) ≈ m / 2 near 0 while g ≈ -f''(0) (spread) / 2 does not vanish, so |g| / (|f(m)| + eps) has a ~1/|m|
    # tail that eps cuts off: the per-position mean depends on eps and is far noisier. The ratio of sums ignores eps.
    runs = {
        eps: monte_carlo_mloss("gelu", 0.1, 5.0, num_sources=8, num_samples=100_000, seed=3, eps=eps)
        for eps in (1e-4, 1e-8)
    }
    loose, tight = runs[1e-4], runs[1e-8]
    assert tight.ratio_of_sums == pytest.approx(loose.ratio_of_sums, rel=1e-12)
    assert tight.normalized_mean > 1.5 * loose.normalized_mean
    assert loose.normalized_stderr / loose.normalized_mean > 4.0 * loose.ratio_of_sums_stderr / loose.ratio_of_sums
    # ReLU: f(m) = 0 for every m < 0, so the per-position mean is set by eps itself (~1/eps)
    relu = [monte_carlo_mloss("relu", 1.0, 10.0, num_samples=20_000, seed=3, eps=eps) for eps in (1e-4, 1e-6)]
    assert relu[1].normalized_mean / relu[0].normalized_mean == pytest.approx(100.0, rel=0.01)
    assert relu[1].ratio_of_sums == pytest.approx(relu[0].ratio_of_sums, rel=1e-12)


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
    mc = monte_carlo_mloss("relu", 1.0, 10.0, num_samples=100_000, seed=3)
    assert paper_expected_mloss("relu", 1.0, 10.0) - mc.abs_mean > 25.0 * mc.abs_stderr


# --------------------------------------------------------------------------------------------------------------------
# Validation and documentation
# --------------------------------------------------------------------------------------------------------------------


def test_unknown_activation_lists_valid_names() -> None:
    for call in (
        lambda: expected_mloss("tanh", 0.1, 10.0),
        lambda: monte_carlo_mloss("tanh", 0.1, 10.0, num_samples=10),
        lambda: total_variation_of_derivative("tanh"),
        lambda: get_activation("tanh"),
    ):
        with pytest.raises(InvalidParameterError, match="tanh") as info:
            call()
        for name in ACTIVATIONS:
            assert name in str(info.value)
    with pytest.raises(InvalidParameterError, match="silu"):
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
    with pytest.raises(InvalidParameterError, match=pattern):
        expected_mloss("relu", s, K)
    with pytest.raises(InvalidParameterError, match=pattern):
        paper_expected_mloss("gelu", s, K)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"weights": []}, r"non-empty"),
        ({"weights": "ab"}, r"non-empty"),
        ({"weights": [1.0, -1.0]}, r"weights\[1\] must be a finite number >= 0"),
        ({"weights": [float("nan"), 1.0]}, r"weights\[0\]"),
        ({"weights": [True, 1.0]}, r"weights\[0\]"),
        ({"weights": [0, 0]}, r"not all be 0"),
        ({"weights": [1, 1, 1], "num_sources": 2}, r"3 weights for num_sources=2"),
        ({"num_sources": 0}, r"num_sources"),
        ({"num_sources": 2.0}, r"num_sources"),
        ({"num_sources": True}, r"num_sources"),
        ({"rho": 1.0}, r"rho.*\(-1, 1\)"),
        ({"rho": -0.5, "num_sources": 3}, r"\(-0\.5, 1\) for 3 sources"),
        ({"rho": float("nan")}, r"rho=nan"),
    ],
)
def test_bad_weights_sources_and_rho(kwargs: dict, pattern: str) -> None:
    with pytest.raises(InvalidParameterError, match=pattern):
        expected_mloss("relu", 0.1, 10.0, **kwargs)
    with pytest.raises(InvalidParameterError, match=pattern):
        monte_carlo_mloss("relu", 0.1, 10.0, num_samples=10, **kwargs)


def test_monte_carlo_bad_inputs_and_small_K_allowed() -> None:
    with pytest.raises(InvalidParameterError, match="s=0.0"):
        monte_carlo_mloss("relu", 0.0, 10.0)
    with pytest.raises(InvalidParameterError, match="K=-1.0"):
        monte_carlo_mloss("relu", 1.0, -1.0)
    with pytest.raises(InvalidParameterError, match="eps=0.0"):
        monte_carlo_mloss("relu", 1.0, 10.0, eps=0.0)
    with pytest.raises(InvalidParameterError, match="num_samples"):
        monte_carlo_mloss("relu", 1.0, 10.0, num_samples=1)
    with pytest.raises(InvalidParameterError, match="batch"):
        monte_carlo_mloss("relu", 1.0, 10.0, num_samples=100, batch=0)
    mc = monte_carlo_mloss("relu", 2.0, 1.0, num_samples=1_000)  # K <= s is fine for the simulation
    assert mc.abs_mean > 0.0 and mc.abs_stderr > 0.0


def test_tv_bad_grid() -> None:
    with pytest.raises(InvalidParameterError, match="lo"):
        total_variation_of_derivative("gelu", lo=5.0, hi=-5.0)
    with pytest.raises(InvalidParameterError, match="num"):
        total_variation_of_derivative("gelu", num=2)


def test_docstring_examples() -> None:
    # The `Example:` blocks are fenced for the docs; the closing fence is not part of the expected output.
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(theory):
        for example in test.examples:
            example.want = "".join(line for line in example.want.splitlines(True) if line.strip() != "```")
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.attempted >= 8 and results.failed == 0
