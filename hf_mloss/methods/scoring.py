"""``ScoringOptions``: how M-Loss is measured (prefix, reduction, activation, ε, scored blocks).

Shared by :func:`hf_mloss.score`, the ``score:`` section of a :class:`~hf_mloss.MergeConfig` and the data-guided
merge methods (whose parameters extend it), so each option is declared and checked once. It lives with the methods,
below the recipe (:mod:`hf_mloss.spec`, which re-exports it as ``hf_mloss.spec.options``), because a method's
parameters extend it and no method may import a layer above its own. Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .._validation import param, validate_fields
from ..errors import InvalidParameterError

PREFIXES = ("own", "base", "merged")
REDUCTIONS = ("abs", "sq")


@dataclass(frozen=True)
class ScoringOptions:
    """Options of an M-Loss measurement (see :func:`hf_mloss.score`)."""

    prefix: str = param("own", "Input of each scored linear: own (each model's forward), base, or merged.",
                        choices=PREFIXES)
    reduction: str = param("abs", "Node M-Loss: mean |g| (abs, the paper) or mean g² (sq, the authors' code).",
                           choices=REDUCTIONS)
    activation: str | None = param(None, "Activation in the M-Loss (default: the model's own, e.g. quick_gelu).")
    eps: float = param(1e-4, "ε of the normalized M-Loss (per-position ratio).", low=0.0, high=1.0, low_open=True)
    layers: tuple[int, ...] | None = param(None, "Blocks to score (default: all).", low=0)

    def __post_init__(self) -> None:
        validate_fields(self)
        self.check()

    def check(self) -> None:
        """Cross-field and registry checks (subclasses add their own and call ``super().check()``)."""
        if self.layers is not None:
            if not self.layers:
                raise InvalidParameterError("layers must name at least one block (or be omitted for all).")
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
        if self.activation is not None:
            check_activation(self.activation)

    def scoring_options(self) -> ScoringOptions:
        """Just the scoring options (drops a subclass's other fields)."""
        return ScoringOptions(**{f.name: getattr(self, f.name) for f in fields(ScoringOptions)})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}


def check_activation(name: str) -> None:
    """Refuse an activation that transformers' ``ACT2FN`` does not know (naming the valid ones)."""
    from transformers.activations import ACT2FN

    from .._validation import did_you_mean

    if name not in ACT2FN:
        raise InvalidParameterError(f"Unknown activation {name!r}{did_you_mean(name, ACT2FN)}; valid: "
                                    f"{sorted(ACT2FN)}.")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
