"""``method="auto"``: choose the merge without labels, among several methods and their λ.

Every candidate method is merged once per setting of its other parameters (its direction τ, at λ = 1); each λ of
its grid is then θ₀ + λ·τ, which costs one forward pass of the selection samples and no merge. Every candidate is
scored by one criterion (``output`` by default: the discrepancy with each expert on the samples routed to it, read
through the family's output rule; :mod:`hf_mloss.merging.selection`) and the lowest wins. The experts' outputs are
computed once for all candidates. A candidate fitted on the data (RegMean++, M-TIES) is never compared on samples
it was fitted on (``held_out``): it is fitted on each half of the data and compared on the other (``cross_fit``),
so that it and the data-free candidates are compared on the same samples, all of them; chosen, it is fitted again on
all of them. The card and the recipe record every
candidate's value, the choice, and the chosen merge's per-layer M-Loss as a diagnostic (how far it is from the
ensemble, not a predictor of its accuracy).

Without data there is nothing to compare: the merge is TSV-M at λ = 1 (the default of the method that needs no
tuning most often in the records), and the card says so. A recorded choice re-runs directly, bit for bit
(``reselect=True`` chooses again). The search itself lives in :mod:`hf_mloss.merging.auto`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._validation import param, short
from ..errors import InvalidParameterError
from .base import MergeContext, MergeMethod, MethodParams
from .registry import register_merge_method

DEFAULT_CANDIDATES: dict[str, dict[str, list[Any]]] = {
    "tsv_m": {"lam": [0.5, 0.75, 1.0, 1.25, 1.5, 2.0]},
    "iso_c": {"lam": [0.5, 1.0, 1.5, 2.0, 3.0, 4.0]},
    "iso_cts": {"lam": [0.5, 1.0, 1.5, 2.0, 3.0, 4.0]},
    "ties": {"budget": ["changed"], "lam": [0.5, 0.75, 1.0, 1.25, 1.5, 2.0]},
    "task_arithmetic": {"lam": [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]},
    "regmean_plusplus": {"lam": [0.5, 0.75, 1.0, 1.25, 1.5, 2.0]},
}
"""The candidates and their grids when ``candidates`` is not given; each grid holds its method's default λ. The SVD
merges led the records' val-tuned rows; TIES and task arithmetic are the classics (TIES keeps k of the entries each
fine-tune changed, so fine-tunes of a few blocks are trimmed too); RegMean++ is the closed-form merge that uses the
same unlabeled data, its merged task vector on TSV-M's λ grid (λ = 1: the published merge). Iso-C and RegMean++'s λ
grid were added with each model's own data; the records made before measured the default without them (TSV-M,
Iso-CTS, TIES, task arithmetic, RegMean++ at λ = 1)."""
CANDIDATE_GRIDS: dict[str, dict[str, list[Any]]] = {
    **DEFAULT_CANDIDATES,
    "wudi": {"lam": [0.5, 0.75, 1.0, 1.25, 1.5, 2.0]},
    "cart": {"lam": [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]},
}
"""A method's grid when ``candidates`` names it without one: the defaults', and WUDI's and CART's (candidates by name
only, not among the defaults until the records show they earn it; each grid holds its default λ). A calibrated
merge is a candidate by its grid: ``{"tsv_m": {"calibrate": ["svc"], "lam": [...]}}``; λ then does not rescale one
merge but is merged for each value, as for CART (:meth:`~hf_mloss.methods.MergeMethod.scales_with_lam`)."""
FALLBACK = ("tsv_m", {"lam": 1.0})
"""The merge without data."""
CRITERIA = ("output", "disagreement", "entropy", "mloss")
MAX_AUTO_CANDIDATES = 256


@dataclass(frozen=True)
class AutoParams(MethodParams):
    candidates: Any = param(None, "The methods to choose among: a list of names (each on its default grid, "
                            "hf_mloss.methods.auto.CANDIDATE_GRIDS, or its default parameters), or a mapping "
                            "name -> grid ({'tsv_m': {'lam': [0.8, 1, 1.2]}, 'ties': {'k': [0.2], 'lam': [1]}}). "
                            "Default: TSV-M, Iso-C, Iso-CTS, TIES, task arithmetic and RegMean++ on λ grids.")
    criterion: str | None = param(None, "What ranks the candidates, lower is better (see "
                                  "hf_mloss.merging.selection): output, disagreement, entropy, mloss. Default: "
                                  "disagreement with heads (closer to the val-tuned best than output in the "
                                  "records), output without (it needs none).", choices=CRITERIA)
    compare_samples: int = param(32, "Unlabeled samples each candidate is compared on (a seeded spread over the data).",
                             low=1, high=1_000_000)
    share: str = param("auto", "Which samples compare a candidate with which expert: auto (label-free routing) or "
                       "all.", choices=("auto", "all"))
    held_out: bool = param(True, "Compare the candidates fitted on the data (RegMean++, M-TIES, ...) on samples they "
                           "were not fitted on: at most half of each model's data (and of the shared pool) is held "
                           "out for the comparison, they are fitted on the rest, and the chosen one is fitted "
                           "again on all of it. Off: every candidate is fitted and compared on the same samples.")
    cross_fit: bool = param(True, "With held_out: split each model's data (and the shared pool) in two halves, fit "
                            "the data-fitted candidates on each half in turn and compare them on the other, and "
                            "compare every other candidate on both, so that every candidate is compared on all "
                            "compare_samples (off: on the held-out part only, at most half). Costs one more fit per "
                            "fitted setting.")
    heads: tuple[Any, ...] | None = param(None, "Encoders: one classification head per model (safetensors files "
                                          "holding `weight` and `bias`, or, from Python, modules/callables); the "
                                          "output criterion then compares class distributions, not features.")
    budget: int | None = param(None, "At most this many candidates are scored: each grid is thinned evenly, its "
                               "default λ kept (default: all).", low=1, high=MAX_AUTO_CANDIDATES)
    reselect: bool = param(False, "Choose again even when the choice is recorded.")
    chosen: dict[str, Any] | None = param(None, "Recorded: the chosen method and its parameters ({method, "
                                          "parameters}).")
    scored: list[Any] | None = param(None, "Recorded: every candidate's method, setting and criterion values.")
    compared: int | None = param(None, "Recorded: the unlabeled samples the candidates were compared on "
                                 "(compare_samples, or fewer when the data holds fewer).", low=1, high=1_000_000)
    fitted: int | None = param(None, "Recorded: the samples the data-fitted candidates were fitted on, those the "
                               "comparison did not read (none: nothing was held out).", low=1, high=1_000_000)
    cross_fitted: bool | None = param(None, "Recorded: whether they were cross-fitted (fitted on each half, compared "
                                      "on the other).")

    def check(self) -> None:
        if self.criterion is None:
            object.__setattr__(self, "criterion", "disagreement" if self.heads else "output")
        grids = candidate_grids(self.candidates, self.budget)
        for i, head in enumerate(self.heads or ()):
            if isinstance(head, Mapping) and "in_memory" in head and self.chooses:
                raise InvalidParameterError(
                    f"heads[{i}] was passed from Python ({head['in_memory']}) when this recipe was written; a run "
                    "that chooses again needs it: pass the heads again (heads=[...]), or re-run the recorded choice "
                    "(reselect: false).")
        del grids
        if self.chosen is not None:
            if not isinstance(self.chosen, Mapping) or not isinstance(self.chosen.get("method"), str) or not \
                    isinstance(self.chosen.get("parameters") or {}, Mapping):
                raise InvalidParameterError(f"chosen must be {{method: name, parameters: {{...}}}}, got "
                                            f"{short(self.chosen)}.")
            method = _candidate_method(self.chosen["method"], "chosen.method")
            try:
                method.make_params(**dict(self.chosen.get("parameters") or {}))
            except InvalidParameterError as err:
                raise InvalidParameterError(f"chosen.parameters: {err}") from None

    @property
    def chooses(self) -> bool:
        """Whether a run searches (nothing recorded, or ``reselect``)."""
        return self.chosen is None or self.reselect


def _candidate_method(name: Any, where: str) -> Any:
    """The registered method ``name`` if it can be auto's candidate (not a search, not a learned merge)."""
    from .registry import get_method

    if not isinstance(name, str):
        raise InvalidParameterError(f"{where} must be a method name, got {short(name)}.")
    method = get_method(name)
    if getattr(method, "chooses_method", False) or getattr(method, "learned", False):
        raise InvalidParameterError(f"{where}: {name!r} cannot be a candidate of auto (it is itself a search or a "
                                    "learned merge).")
    return method


def candidate_grids(candidates: Any, budget: int | None = None) -> dict[str, dict[str, list[Any]]]:
    """``candidates`` as ``{method: grid}`` (names resolved, each grid checked against its method), refusing
    unknown methods, a method named twice (also through an alias), malformed grids or grids that repeat a value,
    methods that are themselves a search, and more than :data:`MAX_AUTO_CANDIDATES` candidates once ``budget``
    has thinned the grids."""
    if candidates is None:
        candidates = DEFAULT_CANDIDATES
    if isinstance(candidates, str) or not isinstance(candidates, (Sequence, Mapping)) or not candidates:
        raise InvalidParameterError(f"candidates must be a non-empty list of method names or a mapping name -> grid, "
                                    f"got {short(candidates)}.")
    if not isinstance(candidates, Mapping):
        for i, name in enumerate(candidates):
            _candidate_method(name, f"candidates[{i}]")
        if len(set(candidates)) < len(candidates):
            raise InvalidParameterError(f"candidates names a method twice: {list(candidates)}.")
        candidates = {name: CANDIDATE_GRIDS.get(name, {}) for name in candidates}
    out: dict[str, dict[str, list[Any]]] = {}
    given: dict[str, Any] = {}
    for name, grid in candidates.items():
        method = _candidate_method(name, "candidates")
        if method.name in given:
            raise InvalidParameterError(f"candidates names {method.name!r} twice ({given[method.name]!r} and "
                                        f"{name!r}): give it one grid.")
        given[method.name] = name
        if grid is None:
            grid = {}
        if not isinstance(grid, Mapping) or any(isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or not v
                                                for v in grid.values()):
            raise InvalidParameterError(f"candidates[{name!r}] must be a grid {{parameter: [values, ...]}}, got "
                                        f"{short(grid)}.")
        grid = {key: list(values) for key, values in grid.items()}
        for key, values in grid.items():
            if len({repr(v) for v in values}) < len(values):
                raise InvalidParameterError(f"candidates[{name!r}].{key} repeats a value: {short(values)}.")
        for setting in _settings(grid):
            try:
                method.make_params(**setting)
            except InvalidParameterError as err:
                raise InvalidParameterError(f"candidates[{name!r}]: the setting {setting} is invalid: {err}") from None
        out[method.name] = grid
    defaults = {name: get_method_defaults(name) for name in out}
    total = sum(len(_settings(grid)) for grid in thinned(out, budget, defaults).values())
    if total > MAX_AUTO_CANDIDATES:
        raise InvalidParameterError(f"auto has {total} candidates; the limit is {MAX_AUTO_CANDIDATES} (each is a "
                                    "scoring pass). Use shorter grids or a smaller budget=.")
    return out


def all_tied(values: Sequence[float]) -> bool:
    """Whether every candidate scored the same (to rounding): the comparison then tells them nothing."""
    return len(values) > 1 and max(values) - min(values) <= 1e-12 * max(1.0, abs(max(values)))


def get_method_defaults(name: str) -> dict[str, Any]:
    """A candidate method's default parameters (what :func:`thinned` keeps)."""
    from .registry import get_method

    return get_method(name).make_params().to_dict()


def _settings(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    import itertools

    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*grid.values())] or [{}]


def thinned(grids: Mapping[str, Mapping[str, list[Any]]], budget: int | None,
            defaults: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, list[Any]]]:
    """The grids cut so that at most ``budget`` candidates remain: every method keeps at least one setting, the λ
    axes are thinned evenly (ends first) keeping each method's default λ. Without ``budget``: the grids as given."""
    grids = {name: {k: list(v) for k, v in grid.items()} for name, grid in grids.items()}
    if budget is None:
        return grids
    if budget < len(grids):
        raise InvalidParameterError(f"budget={budget} is below the number of candidate methods ({len(grids)}): "
                                    "each needs one setting at least. Raise budget or pass fewer candidates.")

    def count() -> int:
        return sum(len(_settings(grid)) for grid in grids.values())

    while count() > budget:
        name = max(grids, key=lambda n: len(grids[n].get("lam", [])))
        lams = grids[name].get("lam", [])
        if len(lams) <= 1:  # nothing left to thin on λ: cut the largest other axis
            name, key = max(((n, k) for n, g in grids.items() for k in g if len(g[k]) > 1),
                            key=lambda nk: len(grids[nk[0]][nk[1]]), default=(None, None))
            if name is None:
                break
            grids[name][key] = grids[name][key][:-1]
            continue
        default = defaults.get(name, {}).get("lam")
        # drop the value farthest from the default (every other value kept spread around it)
        drop = max((v for v in lams if v != default), key=lambda v: abs(v - (default if default is not None else 0)))
        grids[name]["lam"] = [v for v in lams if v != drop]
    return grids


class Auto(MergeMethod):
    """auto: the merge chosen without labels among several methods (see the module docstring)."""

    name = "auto"
    pretty_name = "auto"
    reference = "label-free choice among merges (hf_mloss)"
    reference_url = ""
    params_class = AutoParams
    chooses_method = True
    reads_own_data = True

    def uses_data(self, params: MethodParams) -> bool:
        """Whether a run reads the data when it is given: to choose, or to re-run a chosen merge that needs it."""
        from .registry import get_method

        return params.chooses or get_method(params.chosen["method"]).needs_data

    def writes_scaled(self, params: MethodParams) -> bool:
        """Whether a run writes a recorded choice as θ₀ + λ·τ (τ merged at λ = 1), as its search wrote it."""
        from .registry import get_method

        chosen = params.chosen
        return (not params.chooses and "why" not in chosen
                and get_method(chosen["method"]).scales_with_lam(dict(chosen.get("parameters") or {})))

    def merge_tensor(self, name: str, base: Any, sources: list[Any], ctx: MergeContext) -> Any:
        raise InvalidParameterError("auto merges through the method it chose (hf_mloss.merging.auto).")

    def weighted_as(self, params: MethodParams) -> MergeMethod:
        """The chosen method (its default weighting is the one the merge used), else auto's own."""
        from .registry import get_method

        return get_method(params.chosen["method"]) if params.chosen else self

    def describe(self, params: MethodParams) -> str:
        chosen = params.chosen or {}
        setting = ", ".join(f"{k}={v}" for k, v in (chosen.get("parameters") or {}).items())
        return f"auto (label-free choice among merges): {chosen.get('method', '?')}" + (f" ({setting})" if setting
                                                                                         else "")


register_merge_method(Auto())
