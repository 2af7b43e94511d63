"""The merge-method protocol.

A method declares its parameters as a frozen dataclass (defaults + range checks in ``__post_init__``) and merges one
tensor at a time: it sees the base tensor and the q fine-tuned tensors (float32) and returns the merged tensor.
Methods that need a pass over the whole model first (global TIES thresholds) implement :meth:`MergeMethod.prepare`;
data-guided methods (M-TIES) set ``needs_data`` and are driven layer by layer by :mod:`hf_mloss.merger`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import InvalidParameterError


@dataclass(frozen=True)
class MethodParams:
    """Base of every method's parameter dataclass."""

    @classmethod
    def from_kwargs(cls, method: str, kwargs: dict[str, Any]) -> MethodParams:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidParameterError(
                f"Unknown parameter(s) {unknown} for method {method!r}; valid parameters: {sorted(names)}."
            )
        try:
            return cls(**kwargs)
        except TypeError as err:  # e.g. a list where a float is expected
            raise InvalidParameterError(f"Invalid parameters for method {method!r}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_fraction(name: str, value: Any, *, low_open: bool = True, high: float = 1.0, hint: str = "") -> None:
    """Raise unless ``value`` is a real number in (0, high] (or [0, high] when ``low_open`` is False)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (0 < value if low_open else 0 <= value) and value <= high
    if not ok:
        interval = f"{'(' if low_open else '['}0, {high}]"
        raise InvalidParameterError(f"{name} must be a number in {interval}, got {value!r}.{hint}")


def check_finite(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidParameterError(f"{name} must be a finite number, got {value!r}.")


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise InvalidParameterError(f"{name} must be one of {list(choices)}, got {value!r}.")


@dataclass
class MergeContext:
    """What a method sees besides the tensors: weights, parameters, seed, and per-merge state."""

    params: Any
    weights: torch.Tensor
    seed: int = 0
    state: dict[str, Any] = field(default_factory=dict)

    def generator(self, name: str, source_index: int, device: torch.device | str = "cpu") -> torch.Generator:
        """A private generator for (tensor, source): reproducible and independent of visiting order."""
        from .ops import tensor_seed

        return torch.Generator(device=device).manual_seed(tensor_seed(self.seed, name, source_index))


class MergeMethod:
    """Base class of registered merge methods."""

    name: ClassVar[str]
    pretty_name: ClassVar[str]
    reference: ClassVar[str]
    """Paper (authors, title, venue) the method comes from."""
    reference_url: ClassVar[str]
    params_class: ClassVar[type[MethodParams]]
    needs_data: ClassVar[bool] = False
    default_weight: ClassVar[str] = "uniform"
    """``"uniform"``: α_p = 1/q when the caller gives no weights; ``"one"``: α_p = 1 (task arithmetic)."""

    def make_params(self, **kwargs: Any) -> MethodParams:
        return self.params_class.from_kwargs(self.name, kwargs)

    def prepare(self, ctx: MergeContext, visit: Callable[[Callable[[str, torch.Tensor, list[torch.Tensor]], None]], None]) -> None:
        """Optional whole-model pre-pass; ``visit(fn)`` calls ``fn(name, base, sources)`` for every float tensor."""

    def merge_tensor(self, name: str, base: torch.Tensor, sources: list[torch.Tensor], ctx: MergeContext) -> torch.Tensor:
        raise NotImplementedError

    def describe(self, params: MethodParams) -> str:
        return f"{self.pretty_name} ({self.reference})"
