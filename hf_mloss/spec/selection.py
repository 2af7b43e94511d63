"""``SelectionOptions``: how a merge's parameters are chosen without labels (the ``select:`` section of a recipe).

A description only: the grid, the criterion, the shares and heads, and the recorded outcome. Running a selection
lives in :mod:`hf_mloss.merging.selection`.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from .._validation import check_keys, param, short, validate_fields
from ..errors import InvalidParameterError
from ..loading.heads import as_head

CRITERIA = ("mloss", "output", "entropy", "disagreement")
OUTPUT_CRITERIA = frozenset({"output", "entropy", "disagreement"})
"""The criteria read from a candidate's outputs on the compared samples."""
SHARES = ("auto", "all", "given")
MODES = ("unlabeled",)
DEFAULT_SELECT_SAMPLES = 32
MAX_CANDIDATES = 1024
"""Most candidates a selection grid may hold (the product of its axes' lengths): each is a merge and a scoring pass,
so a larger grid is a mistake, refused before any validation work."""


@dataclass(frozen=True)
class SelectionOptions:
    """How a merge's hyperparameters are chosen without labels (the ``select:`` section of a config)."""

    criterion: str = param("output", "What ranks the candidates (lower is better): output (discrepancy with each "
                           "expert on its share; the default: measured closest to choosing on val labels), entropy "
                           "(encoders: needs heads; causal LMs: their own next-token distribution), disagreement "
                           "(how often the top class differs from each expert's: needs heads as entropy), mloss "
                           "(merged-prefix M-Loss; it grows with λ, so it favours weak merges).",
                           choices=CRITERIA)
    grid: dict[str, Any] = param(help="Parameter → list of values; every combination is a candidate.",
                                 default_factory=dict)
    num_samples: int = param(DEFAULT_SELECT_SAMPLES, "Unlabeled samples (images, texts) each candidate is "
                             "scored on (a seeded sample spread over the whole data sample).", low=1, high=1_000_000)
    share: str = param("auto", "Which samples compare a candidate with which expert (output, entropy): auto "
                       "(label-free routing), all, or given (per-model data in `shares`).", choices=SHARES)
    shares: list[Any] | None = param(None, "One unlabeled data set per model (Hub id, folder, ...), with share=given.")
    heads: list[Any] | None = param(None, "Encoders: one classification head per model: safetensors files holding "
                                    "`weight` [classes, features] (and `bias`), or, from Python, modules/callables.")
    compare: tuple[str, ...] = param((), "Further criteria computed and recorded for every candidate.",
                                     choices=CRITERIA)
    held_out: bool = param(True, "A method fitted on the data (M-TIES, RegMean, ...): fit the candidates on part of "
                           "it and compare them on `num_samples` held out of that fit (at most half of each model's "
                           "data), then merge the chosen setting on all of it. False: fit and compare on the same "
                           "samples, which favours whatever fits them closest.")
    reference: dict[str, Any] | None = param(None, "Recorded: the setting whose M-Loss ranks the candidates of a "
                                             "data-guided method reuse.")
    chosen: dict[str, Any] | None = param(None, "Recorded: the setting the criterion chose.")
    candidates: list[Any] | None = param(None, "Recorded: every candidate's setting and criteria values.")
    fitted: int | None = param(None, "Recorded: the samples the candidates were fitted on, when some were held out.")

    def __post_init__(self) -> None:
        validate_fields(self)
        grid = {}
        for key, values in self.grid.items():
            if not isinstance(key, str) or isinstance(values, (str, bytes, Mapping)) or not isinstance(
                    values, Sequence) or not values:
                raise InvalidParameterError(f"grid[{key!r}] must be a non-empty list of values (e.g. grid: {{k: "
                                            f"[0.2, 0.5, 0.8], lam: [0.5, 1.0, 1.5]}}), got {short(values)}.")
            grid[key] = list(values)
        count = math.prod(len(values) for values in grid.values())
        if count > MAX_CANDIDATES:
            sizes = " x ".join(f"{len(v)} {k}" for k, v in grid.items())
            raise InvalidParameterError(f"select.grid has {count} candidates ({sizes}); the limit is {MAX_CANDIDATES} "
                                        "(each candidate is a merge and a scoring pass). Use fewer values per axis.")
        if not grid:
            raise InvalidParameterError("select needs a grid of at least one parameter, e.g. grid={'lam': [0.3, "
                                        "0.5, 1.0]} (task arithmetic) or {'k': [...], 'lam': [...]} (TIES, M-TIES).")
        object.__setattr__(self, "grid", grid)
        # entropy without heads: a causal LM's own next-token distribution; an encoder's refusal needs its family
        # (hf_mloss.merging.selection.check_output_rule)
        if self.share == "given" and not self.shares:
            raise InvalidParameterError("share='given' needs `shares`: one unlabeled data set per model.")
        if self.shares and self.share != "given":
            raise InvalidParameterError(f"`shares` are only used with share='given' (got share={self.share!r}).")

    @property
    def criteria(self) -> list[str]:
        """The selecting criterion, then the compared ones."""
        return list(dict.fromkeys([self.criterion, *self.compare]))

    def settings(self) -> list[dict[str, Any]]:
        """The candidates: every combination of the grid, in order."""
        keys = list(self.grid)
        return [dict(zip(keys, values)) for values in itertools.product(*self.grid.values())]

    def reference_setting(self) -> dict[str, Any]:
        """The middle value of every grid axis."""
        return {key: values[(len(values) - 1) // 2] for key, values in self.grid.items()}

    def summary(self) -> str:
        """Plain text: every candidate's criteria values, the chosen one marked."""
        lines = [f"Label-free selection ({self.criterion}, lower is better; {self.num_samples} samples"
                 + (f", shares {self.share}" if set(self.criteria) - {"mloss"} else "") + ")"]
        for candidate in self.candidates or []:
            mark = "*" if candidate["setting"] == self.chosen else " "
            setting = ", ".join(f"{k}={v}" for k, v in candidate["setting"].items())
            values = "  ".join(f"{name} {candidate[name]:.4e}" for name in self.criteria)
            lines.append(f" {mark} {setting:<28} {values}")
        return "\n".join(lines)

    def recorded(self) -> SelectionOptions:
        """A copy without the recorded outcome (what a re-run starts from)."""
        return replace(self, reference=None, chosen=None, candidates=None, fitted=None)


def selection_options(select: Any, *, grid: Mapping[str, Sequence[Any]] | None = None, criterion: str | None = None,
                      heads: Sequence[Any] | None = None) -> SelectionOptions | None:
    """What :func:`hf_mloss.merge` receives (``select="unlabeled"`` plus ``grid``/``criterion``/``heads``, or a
    mapping / :class:`SelectionOptions`) as options, or ``None`` without selection.

    Example:
        ```python
        >>> selection_options("unlabeled", grid={"lam": [0.3, 0.5]}).settings()
        [{'lam': 0.3}, {'lam': 0.5}]
        ```
    """
    extra = {k: v for k, v in {"grid": grid, "criterion": criterion, "heads": heads}.items() if v is not None}
    if select is None:
        if extra:
            raise InvalidParameterError(f"{sorted(extra)} configure label-free selection: pass select='unlabeled' "
                                        "too.")
        return None
    if isinstance(select, SelectionOptions):
        return replace(select, **extra) if extra else select
    if isinstance(select, Mapping):
        names = [f.name for f in fields(SelectionOptions)]
        check_keys(select, names, "key in select")
        return SelectionOptions(**{**select, **extra})
    if select not in MODES:
        raise InvalidParameterError(f"select={select!r}: the only selection mode is 'unlabeled' (choose on val "
                                    "labels by merging each setting yourself).")
    return SelectionOptions(**extra)


def check_selection(options: SelectionOptions, method: Any, parameters: Mapping[str, Any], num_models: int) -> None:
    """Every candidate must be a valid setting of ``method``; heads and shares one per model."""
    for setting in options.settings():
        try:
            method.make_params(**{**parameters, **setting})
        except InvalidParameterError as err:
            raise InvalidParameterError(f"select.grid: the candidate {setting} is invalid for method "
                                        f"{method.name!r}: {err}") from None
    for key in ("heads", "shares"):
        given = getattr(options, key)
        if given is not None and len(given) != num_models:
            raise InvalidParameterError(f"select.{key}: got {len(given)} for {num_models} models; give one per model, "
                                        "in the order of `models`.")
    for i, head in enumerate(options.heads or ()):
        if isinstance(head, (str, os.PathLike)):
            as_head(head, i)  # an unreadable head file is refused before any model is loaded


def grid_edges(grid: dict[str, Any], chosen: dict[str, Any]) -> list[str]:
    """The numeric grid axes of 3+ values whose chosen value is the smallest or the largest (``"lam=0.5 (lowest)"``):
    the best setting may lie outside the grid."""
    edges = []
    for key, values in grid.items():
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) < 3 or len(numbers) != len(values) or key not in chosen:
            continue
        if chosen[key] == min(numbers):
            edges.append(f"{key}={chosen[key]} (the lowest of {sorted(numbers)})")
        elif chosen[key] == max(numbers):
            edges.append(f"{key}={chosen[key]} (the highest of {sorted(numbers)})")
    return edges
