# Copyright 2026 The hf_mloss Authors.
# SPDX-License-Identifier: Apache-2.0
"""Expected M-Loss of merging two fine-tuned models, in closed form and by Monte Carlo.

This module studies the simplest model of merge-induced activation error. A pretrained pre-activation is
`x ~ U(-K, K)`, and two fine-tuned models shift it independently, `a, b ~ N(x, s^2)`. Merging by averaging
feeds `(a + b) / 2` to the activation `f`, whereas ensembling averages the outputs, so the per-unit gap is

    D = | f((a + b) / 2) - (f(a) + f(b)) / 2 |.

For `K >> s` the expectation has the unified form

    E[D] ≈ s^2 * TV(f') / (8 K),    TV(f') = ∫ |f''(z)| dz,

where `TV(f')` is the total variation of the derivative of `f`: 1 for ReLU, `1 - alpha` for LeakyReLU(alpha) (both
exact as `K / s -> inf`), ≈ 1.5156 for exact GELU and ≈ 1.3994 for QuickGELU and SiLU (leading order in small `s`
for smooth `f`). Why: a Taylor expansion around the midpoint gives `D ≈ |f''(m)| (a - b)^2 / 8`, and averaging `x`
uniformly over `[-K, K]` turns `|f''|` into its integral divided by `2K`; for piecewise-linear `f` the same integral
is the size of the slope jumps.

The quadratic dependence on `s` (how far fine-tuning moves a pre-activation) and the `1 / K` dilution are what make
M-Loss a useful mergeability signal. The constants usually quoted for this setting, `s^2 / (sqrt(2) pi K)` for ReLU
and `s^2 / (4K)` for GELU, are however too large — by a factor of about 1.80 for ReLU and 1.32 for exact GELU — even
though their `s^2 / K` scaling is right. They are kept in [`paper_expected_mloss`] so the correction can be shown
side by side; use [`expected_mloss`] for the correct values and [`monte_carlo_mloss`] to check either one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from functools import lru_cache, partial
from types import MappingProxyType

import torch
import torch.nn.functional as F


__all__ = [
    "ACTIVATIONS",
    "PAPER_ACTIVATIONS",
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
        raise ValueError(
            f"Unknown activation {activation!r}; valid names are: {', '.join(sorted(ACTIVATIONS))}."
        )
    return activation


def _check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}.")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"`{name}` must be a finite positive number, got {name}={value!r}.")
    return value


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(float(alpha)):
        raise ValueError(f"`alpha` (LeakyReLU negative slope) must be a finite real number, got alpha={alpha!r}.")
    return float(alpha)


def get_activation(activation: str | ActivationFn, *, alpha: float = DEFAULT_LEAKY_SLOPE) -> ActivationFn:
    """Resolve an activation name (or pass a callable through) to a one-argument function.

    Args:
        activation: A key of [`ACTIVATIONS`] or any element-wise callable.
        alpha: Negative slope, used only for `"leaky_relu"`.

    Returns:
        A callable `f(x) -> tensor`.

    Raises:
        ValueError: If `activation` is a string that is not a known name.
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
        ValueError: For an unknown name or an invalid grid.
    """
    if isinstance(activation, str):
        name = _check_name(activation)
        if name == "relu":
            return 1.0
        if name == "leaky_relu":
            return abs(1.0 - _check_alpha(alpha))
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"The grid needs finite lo < hi, got lo={lo!r}, hi={hi!r}.")
    if isinstance(num, bool) or not isinstance(num, int) or num < 3:
        raise ValueError(f"`num` must be an integer >= 3, got num={num!r}.")
    f = get_activation(activation, alpha=alpha)
    z = torch.linspace(lo, hi, num, dtype=torch.float64).requires_grad_(True)
    with torch.enable_grad():
        (fprime,) = torch.autograd.grad(f(z).sum(), z)
    return float(fprime.diff().abs().sum())


@lru_cache(maxsize=None)
def _smooth_tv(name: str) -> float:
    # The default-grid integral of a registered smooth activation never changes: compute it once.
    return total_variation_of_derivative(name)


def expected_mloss(activation: str, s: float, K: float, *, alpha: float = DEFAULT_LEAKY_SLOPE) -> float:
    """Closed-form expected M-Loss `E[D] ≈ s^2 * TV(f') / (8K)` (corrected constants).

    Exact for ReLU and LeakyReLU in the limit `K / s -> inf` (the error is exponentially small in `(K / s)^2`);
    for smooth activations it is the leading term for small `s`, with relative corrections that grow with `s`.

    Args:
        activation: A key of [`ACTIVATIONS`].
        s: Standard deviation of each fine-tuned pre-activation around the pretrained one (> 0).
        K: Half-width of the uniform range of pretrained pre-activations; must be much larger than `s`.
        alpha: Negative slope, used only for `"leaky_relu"`.

    Returns:
        The expected merge-vs-ensemble gap per unit, `E[D]`.

    Raises:
        ValueError: For an unknown activation, a non-positive `s` or `K`, or `K <= s` (the formula assumes `K >> s`).
    """
    name = _check_name(activation)
    s = _check_positive("s", s)
    K = _check_positive("K", K)
    if K <= s:
        raise ValueError(
            f"The closed form assumes K much larger than s, got K={K!r} <= s={s!r}; "
            "use `monte_carlo_mloss` for this regime."
        )
    tv = total_variation_of_derivative(name, alpha=alpha) if name in _PIECEWISE_LINEAR else _smooth_tv(name)
    return s * s * tv / (8.0 * K)


def paper_expected_mloss(activation: str, s: float, K: float) -> float:
    """The published (incorrect) constants for the same setting, kept for comparison only.

    ReLU: `s^2 / (sqrt(2) pi K)` ≈ 0.2251 s^2 / K, which is `8 / (sqrt(2) pi)` ≈ 1.80 times the true `s^2 / (8K)`.
    GELU: `s^2 / (4K)`, about 1.32 times the true ≈ 0.1895 s^2 / K of exact GELU (and ≈ 1.43 times the
    ≈ 0.1749 s^2 / K of QuickGELU or SiLU). Only the `s^2 / K` scaling is right; use [`expected_mloss`] instead.

    Args:
        activation: `"relu"` or `"gelu"`.
        s: Standard deviation of each fine-tuned pre-activation around the pretrained one (> 0).
        K: Half-width of the uniform range of pretrained pre-activations (> s).

    Returns:
        The published value of `E[D]`.

    Raises:
        ValueError: For another activation, a non-positive `s` or `K`, or `K <= s`.
    """
    if activation not in PAPER_ACTIVATIONS:
        raise ValueError(
            f"No published constant for activation {activation!r}; valid names are: {', '.join(PAPER_ACTIVATIONS)}."
        )
    s = _check_positive("s", s)
    K = _check_positive("K", K)
    if K <= s:
        raise ValueError(f"The published formula assumes K much larger than s, got K={K!r} <= s={s!r}.")
    if activation == "relu":
        return s * s / (math.sqrt(2.0) * math.pi * K)
    return s * s / (4.0 * K)


def monte_carlo_mloss(
    activation: str | ActivationFn,
    s: float,
    K: float,
    *,
    num_samples: int = 1_000_000,
    seed: int = 0,
    alpha: float = DEFAULT_LEAKY_SLOPE,
    batch: int = 262_144,
) -> tuple[float, float]:
    """Monte Carlo estimate of `E[D]`, to check the closed forms (or to go beyond `K >> s`).

    Draws `x ~ U(-K, K)` and `a, b ~ N(x, s^2)` in float64 from a private `torch.Generator` seeded with `seed`
    (the global RNG is untouched), in chunks of at most `batch` samples so memory stays bounded. Results are
    reproducible for a given `(seed, batch)`.

    Args:
        activation: A key of [`ACTIVATIONS`] or an element-wise callable.
        s: Standard deviation of the fine-tuned pre-activations (> 0).
        K: Half-width of the uniform range of pretrained pre-activations (> 0; any ratio to `s` is allowed here).
        num_samples: Number of `(x, a, b)` draws (at least 2).
        seed: Seed of the private generator.
        alpha: Negative slope, used only for `"leaky_relu"`.
        batch: Maximum number of samples per chunk.

    Returns:
        `(mean, standard_error)` of `D` over the samples.

    Raises:
        ValueError: For an unknown activation name, a non-positive `s` or `K`, or invalid `num_samples` / `batch`.
    """
    f = get_activation(activation, alpha=alpha)
    s = _check_positive("s", s)
    K = _check_positive("K", K)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 2:
        raise ValueError(f"`num_samples` must be an integer >= 2, got num_samples={num_samples!r}.")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"`batch` must be a positive integer, got batch={batch!r}.")

    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed))
    # Running (count, mean, M2), merged chunk by chunk (Chan et al.) so the variance stays accurate.
    count, mean, m2 = 0, 0.0, 0.0
    with torch.no_grad():
        remaining = num_samples
        while remaining > 0:
            n = min(batch, remaining)
            remaining -= n
            x = torch.rand(n, generator=generator, dtype=torch.float64).mul_(2.0 * K).sub_(K)
            noise = torch.randn(2, n, generator=generator, dtype=torch.float64).mul_(s)
            a, b = x + noise[0], x + noise[1]
            d = (f((a + b) * 0.5) - (f(a) + f(b)) * 0.5).abs_()
            chunk_mean = float(d.mean())
            chunk_m2 = float((d - chunk_mean).square_().sum())
            total = count + n
            delta = chunk_mean - mean
            mean += delta * n / total
            m2 += chunk_m2 + delta * delta * count * n / total
            count = total
    variance = m2 / (count - 1)
    return mean, math.sqrt(variance / count)
