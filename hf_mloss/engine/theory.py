# Copyright 2026 The hf_mloss Authors.
# SPDX-License-Identifier: Apache-2.0
"""Expected M-Loss of merging q fine-tuned models, in closed form and by Monte Carlo.

This module studies the simplest model of merge-induced activation error. A pretrained pre-activation is
`x ~ U(-K, K)`, and q fine-tuned models shift it, `h_p ~ N(x, s^2)` (independently, or with correlation `rho`
between any two sources). Merging with normalised weights `α` (`α_p = w_p / Σ w`) feeds `m = Σ_p α_p h_p` to the
activation `f`, whereas ensembling averages the outputs, so the node gap is

    g = f(m) - Σ_p α_p f(h_p).

For `K >> s` its mean absolute value has the unified form

    E|g| ≈ (1 - Σ_p α_p^2) * s^2 * (1 - rho) * TV(f') / (4K),    TV(f') = ∫ |f''(z)| dz,

where `TV(f')` is the total variation of the derivative of `f`: 1 for ReLU, `|1 - alpha|` for LeakyReLU(alpha)
(both exact as `K / s -> inf`), ≈ 1.5156 for exact GELU and ≈ 1.3994 for QuickGELU and SiLU (leading order in small
`s` for smooth `f`). Two uniform sources give `s^2 * TV(f') / (8K)`; eight uniform sources give 1.75 times that.
Why: expanding `f(h_p)` around `m`, the first-order terms cancel (`Σ_p α_p (h_p - m) = 0`), so
`g ≈ -f''(m) Σ_p α_p (h_p - m)^2 / 2`, whose weighted spread has mean `s^2 (1 - rho) (1 - Σ α_p^2)`; averaging `x`
uniformly over `[-K, K]` turns `|f''|` into its integral divided by `2K`. For ReLU and LeakyReLU (one kink, so
convex or concave) the gap has one sign and the same integral is the size of the slope jump, which makes it exact.

Validity (the closed form warns with [`ClosedFormValidityWarning`] outside it, where it is off by more than ~2%):

* `K >= 3s`: the shifts must not reach the ends of `[-K, K]`. For ReLU the closed form is 0.3% too high at
  `K = 3s`, ~2% at `K = 2s` and 33% at `K = s` (q = 2); `K <= s` is rejected.
* Smooth `f`: `f''` must vanish outside `[-K, K]` ("K >> 3"); the closed form overestimates by
  `TV(f') / ∫_{-K}^{K} |f''| - 1`: for GELU 12.7% at `K = 2` and 29.9% at `K = 1` (Monte Carlo: 13% and 31%).
  Warned above 2%, i.e. below `K` ≈ 2.9 for GELU, 3.4 for QuickGELU, 5.9 for SiLU.
* Smooth `f`: `s * sqrt(1 - rho) <= 0.3`: the next term lowers `E|g|` by about `c * s^2 (1 - rho)`, `c <= 0.18`
  for q <= 8 (GELU, q = 8: -1.6% at `s = 0.3`, -4.4% at `s = 0.5`, -14% at `s = 1`).
* Only `reduction="abs"`: the mean of `g^2` scales as `s^4` (smooth `f`) or `s^3` (ReLU), so these forms do not
  apply to `reduction="sq"`; [`monte_carlo_mloss`] estimates it.

The quadratic dependence on `s` (how far fine-tuning moves a pre-activation) and the `1 / K` dilution are what make
M-Loss a useful mergeability signal. The constants usually quoted for two models, `s^2 / (sqrt(2) pi K)` for ReLU
and `s^2 / (4K)` for GELU, are however too large — by a factor of about 1.80 for ReLU and 1.32 for exact GELU — even
though their `s^2 / K` scaling is right. They are kept in [`paper_expected_mloss`] so the correction can be shown
side by side; use [`expected_mloss`] for the correct values and [`monte_carlo_mloss`] to check either one. The Monte
Carlo helper also reports both normalised variants: the per-position mean of `|g| / (|f(m)| + eps)`, which is
heavy-tailed where `f(m) ≈ 0`, and the stable ratio of sums `Σ|g| / Σ|f(m)|`.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache, partial
from types import MappingProxyType

import torch
import torch.nn.functional as F

from ..errors import InvalidParameterError


__all__ = [
    "ACTIVATIONS",
    "PAPER_ACTIVATIONS",
    "ClosedFormValidityWarning",
    "MonteCarloMLoss",
    "expected_mloss",
    "get_activation",
    "monte_carlo_mloss",
    "paper_expected_mloss",
    "total_variation_of_derivative",
]

ActivationFn = Callable[[torch.Tensor], torch.Tensor]
"""An element-wise activation: tensor in, tensor of the same shape out."""

DEFAULT_LEAKY_SLOPE: float = 0.01
"""Negative slope of `leaky_relu` when none is given (same as `torch.nn.LeakyReLU`)."""


def _relu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)


def _leaky_relu(x: torch.Tensor, alpha: float = DEFAULT_LEAKY_SLOPE) -> torch.Tensor:
    return F.leaky_relu(x, negative_slope=alpha)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="none")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


ACTIVATIONS: Mapping[str, Callable[..., torch.Tensor]] = MappingProxyType(
    {
        "relu": _relu,
        "leaky_relu": _leaky_relu,  # `ACTIVATIONS["leaky_relu"](x, alpha=0.2)`, or use `get_activation`
        "gelu": _gelu,  # exact, x * Phi(x) with the erf
        "gelu_tanh": _gelu_tanh,
        "quick_gelu": _quick_gelu,  # x * sigmoid(1.702 x), CLIP's activation
        "silu": _silu,  # x * sigmoid(x)
    }
)
"""Read-only registry of the supported activations, by name. Each maps a tensor to a tensor of the same shape;
`leaky_relu` also takes `alpha` (negative slope, default 0.01)."""

PAPER_ACTIVATIONS: tuple[str, ...] = ("relu", "gelu")
"""Activations for which [`paper_expected_mloss`] knows a published constant."""

# Total variation of f' where it is known exactly; the other activations are integrated numerically.
_PIECEWISE_LINEAR = ("relu", "leaky_relu")


def _check_name(activation: str) -> str:
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise InvalidParameterError(
            f"Unknown activation {activation!r}; valid names are: {', '.join(sorted(ACTIVATIONS))}."
        )
    return activation


def _check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}.")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise InvalidParameterError(f"`{name}` must be a finite positive number, got {name}={value!r}.")
    return value


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(float(alpha)):
        raise InvalidParameterError(
            f"`alpha` (LeakyReLU negative slope) must be a finite real number, got alpha={alpha!r}."
        )
    return float(alpha)


def get_activation(activation: str | ActivationFn, *, alpha: float = DEFAULT_LEAKY_SLOPE) -> ActivationFn:
    """Resolve an activation name (or pass a callable through) to a one-argument function.

    Args:
        activation: A key of [`ACTIVATIONS`] or any element-wise callable.
        alpha: Negative slope, used only for `"leaky_relu"`.

    Returns:
        A callable `f(x) -> tensor`.

    Raises:
        InvalidParameterError: If `activation` is a string that is not a known name.

    Example:
        ```python
        >>> get_activation("leaky_relu", alpha=0.2)(torch.tensor([-1.0, 2.0]))
        tensor([-0.2000,  2.0000])
        ```
    """
    if callable(activation):
        return activation
    name = _check_name(activation)
    if name == "leaky_relu":
        return partial(_leaky_relu, alpha=_check_alpha(alpha))
    return ACTIVATIONS[name]


def total_variation_of_derivative(
    activation: str | ActivationFn,
    *,
    lo: float = -50.0,
    hi: float = 50.0,
    num: int = 400_001,
    alpha: float = DEFAULT_LEAKY_SLOPE,
) -> float:
    """Total variation of `f'`, i.e. `∫ |f''(z)| dz`: the constant in the expected M-Loss.

    For `"relu"` (1) and `"leaky_relu"` (`|1 - alpha|`) the exact value is returned. Otherwise `f'` is evaluated by
    autograd in float64 on a uniform grid of `num` points over `[lo, hi]` and the variation `Σ |f'(z_{i+1}) - f'(z_i)|`
    is summed. This needs no second derivative, so it also handles kinks, and it is exact up to `O(h^2)` near the
    extrema of `f'` (h the grid step) as long as `f'` is monotone between grid points.

    Args:
        activation: A key of [`ACTIVATIONS`] or an element-wise callable built from differentiable torch ops.
        lo: Left end of the integration grid; `f''` must be negligible beyond it.
        hi: Right end of the integration grid.
        num: Number of grid points (at least 3).
        alpha: Negative slope, used only for `"leaky_relu"`.

    Returns:
        `TV(f')` as a Python float.

    Raises:
        InvalidParameterError: For an unknown name or an invalid grid.

    Example:
        ```python
        >>> round(total_variation_of_derivative("gelu"), 4)
        1.5156
        ```
    """
    if isinstance(activation, str):
        name = _check_name(activation)
        if name == "relu":
            return 1.0
        if name == "leaky_relu":
            return abs(1.0 - _check_alpha(alpha))
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise InvalidParameterError(f"The grid needs finite lo < hi, got lo={lo!r}, hi={hi!r}.")
    if isinstance(num, bool) or not isinstance(num, int) or num < 3:
        raise InvalidParameterError(f"`num` must be an integer >= 3, got num={num!r}.")
    f = get_activation(activation, alpha=alpha)
    z = torch.linspace(lo, hi, num, dtype=torch.float64).requires_grad_(True)
    with torch.enable_grad():
        (fprime,) = torch.autograd.grad(f(z).sum(), z)
    return float(fprime.diff().abs().sum())


_MIN_K_OVER_S = 3.0
"""Smallest `K / s` trusted without a warning (ReLU: the closed form is 0.3% too high at 3, ~2% at 2)."""

_MAX_SMOOTH_SHIFT = 0.3
"""Largest `s * sqrt(1 - rho)` trusted for a smooth activation (next-order term ≤ ~1.6% there)."""

_MAX_TAIL_EXCESS = 0.02
"""Largest overestimate `TV(f') / ∫_{-K}^{K} |f''| - 1` (smooth `f`) accepted without a warning."""

_TV_GRID_HALF_WIDTH = 50.0
_TV_GRID_STEP = 2.5e-4
"""Half-width and step of the default `total_variation_of_derivative` grid, reused for the `[-K, K]` part."""

_REDUCTIONS = ("abs", "sq")
"""Node M-Loss reductions; the closed forms exist for `"abs"` only."""


class ClosedFormValidityWarning(UserWarning):
    """The closed form was asked outside the range where it is accurate to ~2% (see the module docstring).

    The value is still returned; use [`monte_carlo_mloss`] for that regime, or turn the warning into an error with
    `warnings.simplefilter("error", ClosedFormValidityWarning)`.
    """


@cache
def _smooth_tv(name: str) -> float:
    # The default-grid integral of a registered smooth activation never changes: compute it once.
    return total_variation_of_derivative(name)


@lru_cache(maxsize=256)
def _tail_excess(name: str, K: float) -> float:
    # TV(f') / ∫_{-K}^{K} |f''| - 1: how much the closed form overestimates because f'' has mass beyond ±K.
    # Beyond the default grid's ±50 the reference TV itself ignores f'', so K is capped there (excess 0).
    K = min(K, _TV_GRID_HALF_WIDTH)
    num = max(3, round(2.0 * K / _TV_GRID_STEP) + 1)
    inside = total_variation_of_derivative(name, lo=-K, hi=K, num=num)
    return _smooth_tv(name) / inside - 1.0 if inside > 0.0 else math.inf


def _check_reduction(reduction: str) -> None:
    if reduction == "sq":
        raise InvalidParameterError(
            'No closed form for reduction="sq": the mean of g^2 scales as s^4 for smooth activations (s^3 for ReLU, '
            "whose gap is non-zero only within ~s of the kink), so the E|g| forms do not apply; estimate it with "
            "`monte_carlo_mloss(...).sq_mean`."
        )
    if reduction not in _REDUCTIONS:
        raise InvalidParameterError(f"`reduction` must be one of {list(_REDUCTIONS)}, got reduction={reduction!r}.")


def _normalized_weights(weights: Sequence[float] | None, num_sources: int | None) -> torch.Tensor:
    # α = w / Σ w in float64, uniform over `num_sources` (default 2) when no weights are given.
    bad_count = isinstance(num_sources, bool) or not isinstance(num_sources, int) or num_sources < 1
    if num_sources is not None and bad_count:
        raise InvalidParameterError(f"`num_sources` must be an integer >= 1, got num_sources={num_sources!r}.")
    if weights is None:
        q = 2 if num_sources is None else num_sources
        return torch.full((q,), 1.0 / q, dtype=torch.float64)
    values = None if isinstance(weights, (str, bytes)) else list(weights)
    if not values:
        raise InvalidParameterError(f"`weights` must be a non-empty sequence of numbers, got weights={weights!r}.")
    if num_sources is not None and num_sources != len(values):
        raise InvalidParameterError(f"Got {len(values)} weights for num_sources={num_sources}: pass one per source.")
    for i, w in enumerate(values):
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w) or w < 0:
            raise InvalidParameterError(f"weights[{i}] must be a finite number >= 0, got {w!r}.")
    total = math.fsum(float(w) for w in values)
    if total <= 0.0:
        raise InvalidParameterError("weights must not all be 0.")
    return torch.tensor([float(w) / total for w in values], dtype=torch.float64)


def _check_rho(rho: float, q: int) -> float:
    # Equal correlation between every pair of sources: the covariance is positive definite for -1/(q-1) < rho < 1.
    low = -1.0 / (q - 1) if q > 1 else -math.inf
    if isinstance(rho, bool) or not isinstance(rho, numbers.Real) or not low < float(rho) < 1.0:
        raise InvalidParameterError(
            f"`rho` (correlation between sources) must lie in ({low:.6g}, 1) for {q} sources, got rho={rho!r}."
        )
    return float(rho)


def _validity_issues(name: str, s: float, K: float, rho: float) -> list[str]:
    issues = []
    if K < _MIN_K_OVER_S * s:
        issues.append(
            f"K / s = {K / s:.3g} < {_MIN_K_OVER_S:g}, so the shifts reach the ends of [-K, K] "
            "(ReLU: the closed form is ~2% too high at K / s = 2, 33% at 1)"
        )
    if name not in _PIECEWISE_LINEAR:
        excess = _tail_excess(name, K)
        if excess > _MAX_TAIL_EXCESS:
            issues.append(
                f"|f''| has mass beyond ±K = ±{K:g}, which makes the closed form {excess:.1%} too high "
                "(smooth activations need K >> 3)"
            )
        shift = s * math.sqrt(1.0 - rho)
        if shift > _MAX_SMOOTH_SHIFT:
            issues.append(
                f"s * sqrt(1 - rho) = {shift:.3g} > {_MAX_SMOOTH_SHIFT:g}, where the next-order term "
                "lowers the true value by about 0.18 s^2 (1 - rho) (GELU: -4.4% at 0.5)"
            )
    return issues


def expected_mloss(
    activation: str,
    s: float,
    K: float,
    *,
    weights: Sequence[float] | None = None,
    num_sources: int | None = None,
    rho: float = 0.0,
    alpha: float = DEFAULT_LEAKY_SLOPE,
    reduction: str = "abs",
) -> float:
    """Closed-form expected node M-Loss `E|g| ≈ (1 - Σ α_p^2) s^2 (1 - rho) TV(f') / (4K)` (corrected constants).

    Exact for ReLU and LeakyReLU in the limit `K / s -> inf`; for smooth activations it is the leading term for small
    `s`. Outside the validity range (`K >= 3s`; for smooth `f` also `K` large enough that `f''` vanishes beyond `±K`
    and `s * sqrt(1 - rho) <= 0.3`) the value is still returned, with a [`ClosedFormValidityWarning`] saying why and
    by how much it is off.

    Args:
        activation: A key of [`ACTIVATIONS`].
        s: Standard deviation of each fine-tuned pre-activation around the pretrained one (> 0).
        K: Half-width of the uniform range of pretrained pre-activations; must be larger than `s` (ideally `>= 3s`).
        weights: Merge weights, one per source, finite and `>= 0` (not all 0); normalised to sum to 1 here, so
            `[1, 1]` and `[0.5, 0.5]` give the same value. Default: uniform.
        num_sources: Number of sources q when `weights` is not given (default 2); must match `len(weights)` otherwise.
        rho: Correlation between the shifts of any two sources, in `(-1/(q-1), 1)`; it scales the result by
            `1 - rho` (a shift shared by all sources merges exactly).
        alpha: Negative slope, used only for `"leaky_relu"`.
        reduction: `"abs"` (mean |g|, the default node M-Loss). `"sq"` is rejected: it has no closed form here.

    Returns:
        The expected merge-vs-ensemble gap per node, `E|g|`.

    Raises:
        InvalidParameterError: For an unknown activation, a non-positive `s` or `K`, `K <= s`, invalid weights or
            `rho`, or `reduction="sq"`.

    Example:
        ```python
        >>> expected_mloss("relu", 1.0, 10.0)  # two equal-weight sources: s^2 / (8K)
        0.0125
        >>> expected_mloss("relu", 1.0, 10.0, num_sources=8)  # (1 - 1/8) / 4K: 1.75 times the two-source value
        0.021875
        >>> expected_mloss("relu", 1.0, 10.0, weights=[3, 1])  # α = (0.75, 0.25): 1 - Σα² = 0.375
        0.009375
        ```
    """
    name = _check_name(activation)
    s = _check_positive("s", s)
    K = _check_positive("K", K)
    _check_reduction(reduction)
    mix = _normalized_weights(weights, num_sources)
    rho = _check_rho(rho, mix.numel())
    if K <= s:
        raise InvalidParameterError(
            f"The closed form assumes K much larger than s, got K={K!r} <= s={s!r}; "
            "use `monte_carlo_mloss` for this regime."
        )
    issues = _validity_issues(name, s, K, rho)
    if issues:
        warnings.warn(
            f"expected_mloss({name!r}, s={s:g}, K={K:g}) is outside the closed form's validity range: "
            + "; ".join(issues)
            + ". Use `monte_carlo_mloss` for this regime.",
            ClosedFormValidityWarning,
            stacklevel=2,
        )
    tv = total_variation_of_derivative(name, alpha=alpha) if name in _PIECEWISE_LINEAR else _smooth_tv(name)
    spread = 1.0 - float(mix.square().sum())
    return spread * s * s * (1.0 - rho) * tv / (4.0 * K)


def paper_expected_mloss(activation: str, s: float, K: float) -> float:
    """The published (incorrect) two-model constants for the same setting, kept for comparison only.

    ReLU: `s^2 / (sqrt(2) pi K)` ≈ 0.2251 s^2 / K, which is `8 / (sqrt(2) pi)` ≈ 1.80 times the true `s^2 / (8K)`.
    GELU: `s^2 / (4K)`, about 1.32 times the true ≈ 0.1895 s^2 / K of exact GELU (and ≈ 1.43 times the
    ≈ 0.1749 s^2 / K of QuickGELU or SiLU). Only the `s^2 / K` scaling is right; use [`expected_mloss`] instead.

    Args:
        activation: `"relu"` or `"gelu"`.
        s: Standard deviation of each fine-tuned pre-activation around the pretrained one (> 0).
        K: Half-width of the uniform range of pretrained pre-activations (> s).

    Returns:
        The published value of `E|g|` for two equal-weight sources.

    Raises:
        InvalidParameterError: For another activation, a non-positive `s` or `K`, or `K <= s`.

    Example:
        ```python
        >>> round(paper_expected_mloss("relu", 1.0, 10.0) / expected_mloss("relu", 1.0, 10.0), 3)
        1.801
        ```
    """
    if activation not in PAPER_ACTIVATIONS:
        raise InvalidParameterError(
            f"No published constant for activation {activation!r}; valid names are: {', '.join(PAPER_ACTIVATIONS)}."
        )
    s = _check_positive("s", s)
    K = _check_positive("K", K)
    if K <= s:
        raise InvalidParameterError(f"The published formula assumes K much larger than s, got K={K!r} <= s={s!r}.")
    if activation == "relu":
        return s * s / (math.sqrt(2.0) * math.pi * K)
    return s * s / (4.0 * K)


@dataclass(frozen=True)
class MonteCarloMLoss:
    """Monte Carlo estimates of the node M-Loss statistics over the same draws, each with its standard error.

    Attributes:
        abs_mean: Mean of `|g|` (`reduction="abs"`), what [`expected_mloss`] predicts.
        abs_stderr: Standard error of `abs_mean`.
        sq_mean: Mean of `g^2` (`reduction="sq"`).
        sq_stderr: Standard error of `sq_mean`.
        normalized_mean: Per-position normalised M-Loss, the mean of `|g| / (|f(m)| + eps)`. Heavy-tailed where
            `f(m) ≈ 0` (every `m < 0` for ReLU, `m ≈ 0` for GELU): it depends on `eps` and its standard error is
            unreliable.
        normalized_stderr: Standard error of `normalized_mean` (sample estimate).
        ratio_of_sums: `Σ|g| / Σ|f(m)|`, the stable normalised summary.
        ratio_of_sums_stderr: Standard error of `ratio_of_sums` (delta method).
        num_samples: Number of draws.
    """

    abs_mean: float
    abs_stderr: float
    sq_mean: float
    sq_stderr: float
    normalized_mean: float
    normalized_stderr: float
    ratio_of_sums: float
    ratio_of_sums_stderr: float
    num_samples: int


def monte_carlo_mloss(
    activation: str | ActivationFn,
    s: float,
    K: float,
    *,
    weights: Sequence[float] | None = None,
    num_sources: int | None = None,
    rho: float = 0.0,
    num_samples: int = 1_000_000,
    seed: int = 0,
    alpha: float = DEFAULT_LEAKY_SLOPE,
    eps: float = 1e-4,
    batch: int = 262_144,
) -> MonteCarloMLoss:
    """Monte Carlo estimate of the node M-Loss statistics, to check the closed forms (or to go beyond their range).

    Draws `x ~ U(-K, K)` and `h ~ N(x, s^2 C)` (C: unit diagonal, `rho` elsewhere) in float64 from a private
    `torch.Generator` seeded with `seed` (the global RNG is untouched), in chunks of at most `batch` samples so memory
    stays bounded, and accumulates the mean and covariance of `|g|`, `g^2`, `|g| / (|f(m)| + eps)` and `|f(m)|`
    (Chan et al.'s pairwise merge). Results are reproducible for a given `(seed, batch)`.

    Args:
        activation: A key of [`ACTIVATIONS`] or an element-wise callable.
        s: Standard deviation of the fine-tuned pre-activations (> 0).
        K: Half-width of the uniform range of pretrained pre-activations (> 0; any ratio to `s` is allowed here).
        weights: Merge weights, one per source (finite, `>= 0`, not all 0), normalised here. Default: uniform.
        num_sources: Number of sources q when `weights` is not given (default 2); must match `len(weights)` otherwise.
        rho: Correlation between the shifts of any two sources, in `(-1/(q-1), 1)`.
        num_samples: Number of draws (at least 2).
        seed: Seed of the private generator.
        alpha: Negative slope, used only for `"leaky_relu"`.
        eps: Denominator offset of the per-position normalised M-Loss (> 0; 1e-4 as in the scorer).
        batch: Maximum number of samples per chunk.

    Returns:
        A [`MonteCarloMLoss`] with every statistic and its standard error.

    Raises:
        InvalidParameterError: For an unknown activation name, a non-positive `s`, `K` or `eps`, invalid weights or
            `rho`, or invalid `num_samples` / `batch`.

    Example:
        ```python
        >>> mc = monte_carlo_mloss("relu", 1.0, 10.0, num_sources=8, num_samples=400_000)
        >>> abs(mc.abs_mean - expected_mloss("relu", 1.0, 10.0, num_sources=8)) < 4 * mc.abs_stderr
        True
        ```
    """
    f = get_activation(activation, alpha=alpha)
    s = _check_positive("s", s)
    K = _check_positive("K", K)
    eps = _check_positive("eps", eps)
    mix = _normalized_weights(weights, num_sources)
    q = mix.numel()
    rho = _check_rho(rho, q)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 2:
        raise InvalidParameterError(f"`num_samples` must be an integer >= 2, got num_samples={num_samples!r}.")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InvalidParameterError(f"`batch` must be a positive integer, got batch={batch!r}.")
    # Cholesky factor of the equicorrelated covariance; independent sources need none (and keep the plain stream).
    chol = None
    if rho != 0.0:
        chol = torch.linalg.cholesky(torch.full((q, q), rho, dtype=torch.float64).fill_diagonal_(1.0)).mul_(s)

    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed))
    # Running count, means and co-moment matrix of the 4 statistics, merged chunk by chunk (Chan et al.).
    count, mean, comoment = 0, torch.zeros(4, dtype=torch.float64), torch.zeros(4, 4, dtype=torch.float64)
    with torch.no_grad():
        remaining = num_samples
        while remaining > 0:
            n = min(batch, remaining)
            remaining -= n
            x = torch.rand(n, generator=generator, dtype=torch.float64).mul_(2.0 * K).sub_(K)
            noise = torch.randn(q, n, generator=generator, dtype=torch.float64)
            h = (chol @ noise if chol is not None else noise.mul_(s)).add_(x)
            merged_out = f(mix @ h)
            gap = (merged_out - mix @ f(h)).abs_()
            out = merged_out.abs_()
            stats = torch.stack([gap, gap.square(), gap / (out + eps), out])
            chunk_mean = stats.mean(dim=1)
            centred = stats - chunk_mean[:, None]
            total = count + n
            delta = chunk_mean - mean
            mean += delta * (n / total)
            comoment += centred @ centred.T + torch.outer(delta, delta) * (count * n / total)
            count = total
    stderr = (comoment.diagonal() / (count - 1) / count).sqrt().tolist()
    abs_mean, sq_mean, normalized_mean, out_mean = mean.tolist()
    if out_mean > 0.0:
        ratio = abs_mean / out_mean
        cov = comoment / (count - 1)
        ratio_var = (cov[0, 0] - 2.0 * ratio * cov[0, 3] + ratio * ratio * cov[3, 3]) / (count * out_mean * out_mean)
        ratio_stderr = math.sqrt(max(float(ratio_var), 0.0))
    else:  # f(m) == 0 at every draw: the ratio is undefined
        ratio, ratio_stderr = math.nan, math.nan
    return MonteCarloMLoss(
        abs_mean=abs_mean,
        abs_stderr=stderr[0],
        sq_mean=sq_mean,
        sq_stderr=stderr[1],
        normalized_mean=normalized_mean,
        normalized_stderr=stderr[2],
        ratio_of_sums=ratio,
        ratio_of_sums_stderr=ratio_stderr,
        num_samples=count,
    )
