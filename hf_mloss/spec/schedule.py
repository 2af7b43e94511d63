"""Method parameters that vary over the model, as mergekit defines them.

A parameter's value in a config (or a ``merge()`` keyword) is one of:

* a **scalar** (``0.5``, ``true``, ``"l1"``): every tensor gets it;
* a **gradient**, a list of values (``[0, 0.5, 1]``): block ``i`` of ``L`` sits at ``x = i/(L − 1)`` (``x = 1`` when
  ``L = 1``) on the piecewise-linear curve through the values spread evenly over ``[0, 1]``; tensors outside the
  blocks (embeddings, final norm) sit at ``x = 0``, as in mergekit. Lists of booleans or strings pick the value at
  ``floor(x·(m − 1))`` instead of interpolating;
* a **filter list**, ``[{filter: self_attn, value: ...}, ..., {value: ...}]``: the first entry whose ``filter`` is a
  substring of the tensor's canonical name (``encoder.layers.3.self_attn.q_proj.weight``), or that has no filter
  (or ``"*"``), gives the value, itself a scalar or a gradient. A tensor no entry matches gets the default.

:class:`ParamSchedule` parses and resolves one such value; :class:`TensorParameters` gives a method its parameters for
one tensor and records what each scheduled parameter resolved to (written to the saved config).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._validation import short
from ..errors import InvalidParameterError

if TYPE_CHECKING:
    from ..adapters import ModelAdapter
    from ..methods import MergeMethod, MethodParams

SCALARS = (bool, int, float, str)


def is_schedule(value: Any) -> bool:
    """Whether a parameter value is a gradient or a filter list (anything but one scalar)."""
    return isinstance(value, (list, tuple, Mapping))


@dataclass(frozen=True)
class ParamSchedule:
    """One parameter's value over the model: ``(filter, value)`` entries, the value a scalar or a gradient tuple."""

    entries: tuple[tuple[str | None, Any], ...]

    @classmethod
    def parse(cls, value: Any, where: str) -> ParamSchedule:
        """Parse a scalar, gradient or filter list (raises :class:`InvalidParameterError` naming ``where``)."""
        if isinstance(value, Mapping):
            value = [value]
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
            entries = []
            for i, entry in enumerate(value):
                if set(entry) - {"filter", "value"} or "value" not in entry:
                    raise InvalidParameterError(f"{where}[{i}] must be {{filter: <name part>, value: ...}} (filter "
                                                f"optional), got {short(entry)}.")
                name_part = entry.get("filter")
                if name_part is not None and not (isinstance(name_part, str) and name_part):
                    raise InvalidParameterError(f"{where}[{i}].filter must be a non-empty string, got "
                                                f"{short(name_part)}.")
                entries.append((None if name_part == "*" else name_part,
                                _value(entry["value"], f"{where}[{i}].value")))
            return cls(tuple(entries))
        return cls(((None, _value(value, where)),))

    def resolve(self, name: str, x: float) -> Any:
        """The value for tensor ``name`` at layer position ``x`` (``None``: no entry matches, use the default)."""
        for name_part, value in self.entries:
            if name_part is None or name_part in name:
                return interpolate(value, x) if isinstance(value, tuple) else value
        return None

    def leaves(self) -> list[Any]:
        """Every scalar the schedule names (a gradient's values lie between them)."""
        out = []
        for _, value in self.entries:
            out.extend(value if isinstance(value, tuple) else [value])
        return out

    def describe(self) -> str:
        """One line for model cards: ``self_attn: 0 → 0.5 → 1 over the blocks; elsewhere: 0.5``."""
        parts = []
        for name_part, value in self.entries:
            shown = " → ".join(map(str, value)) + " over the blocks" if isinstance(value, tuple) else str(value)
            parts.append(f"{name_part}: {shown}" if name_part is not None else
                         (f"elsewhere: {shown}" if parts else shown))
        return "; ".join(parts)

    def to_plain(self) -> Any:
        """The value as a config writes it."""
        if len(self.entries) == 1 and self.entries[0][0] is None:
            value = self.entries[0][1]
            return list(value) if isinstance(value, tuple) else value
        return [{**({"filter": f} if f is not None else {}), "value": list(v) if isinstance(v, tuple) else v}
                for f, v in self.entries]


def _value(value: Any, where: str) -> Any:
    if isinstance(value, SCALARS):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, SCALARS) for v in value):
        numeric = [not isinstance(v, (bool, str)) for v in value]
        if any(numeric) and not all(numeric):
            raise InvalidParameterError(f"{where}: a gradient lists numbers only (or only true/false, or only names), "
                                        f"got {short(value)}.")
        return tuple(value)
    raise InvalidParameterError(f"{where} must be a value, a gradient (a non-empty list of values over the layers) or "
                                f"a list of {{filter: ..., value: ...}} entries, got {short(value)}.")


def interpolate(values: tuple, x: float) -> Any:
    """mergekit's gradient: linear between neighbouring values for numbers, the value at ``floor(x·(m−1))`` else."""
    scaled = x * (len(values) - 1)
    low = int(scaled)
    if any(isinstance(v, (bool, str)) for v in values):
        return values[low]
    high = min(len(values) - 1, low + 1)
    frac = scaled - low
    return (1 - frac) * values[low] + frac * values[high]


def layer_position(stage: int, num_layers: int) -> float:
    """Where a tensor of ``stage`` (``-1`` embeddings, ``0..L-1`` blocks, ``L`` tail) sits on a gradient."""
    if stage < 0 or stage >= num_layers:
        return 0.0
    return stage / (num_layers - 1) if num_layers > 1 else 1.0


def split_parameters(method: MergeMethod, parameters: Mapping[str, Any]
                     ) -> tuple[dict[str, Any], dict[str, ParamSchedule]]:
    """``(scalars, schedules)``: the parameters that are one value, and the parsed gradients / filter lists.

    A parameter whose own type is a list, a mapping or anything (M-TIES ``layers``, auto's ``candidates``) is a
    value, never a schedule.
    """
    listed = _list_fields(method)
    fields = {f.name for f in dataclasses.fields(method.params_class)}
    unknown = [k for k in parameters if k not in fields]
    if unknown:  # named before any value is parsed: an unknown name with a list or mapping is not a schedule error
        method.make_params(**{k: parameters[k] for k in unknown})
    scheduled = {k for k, v in parameters.items() if is_schedule(v) and k not in listed}
    return ({k: v for k, v in parameters.items() if k not in scheduled},
            {k: ParamSchedule.parse(parameters[k], f"parameters.{k}") for k in scheduled})


def _list_fields(method: MergeMethod) -> set[str]:
    hints = typing.get_type_hints(method.params_class)
    out = set()
    for name, hint in hints.items():
        members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if any(typing.get_origin(m) in (tuple, list, dict) or m in (tuple, list, dict, typing.Any) for m in members):
            out.add(name)
    return out


def check_schedules(method: MergeMethod, parameters: Mapping[str, Any], *, selecting: bool) -> None:
    """Refuse schedules a run cannot honour, and check every value a schedule names against the method's rules."""
    scalars, schedules = split_parameters(method, parameters)
    if not schedules:
        return
    names = ", ".join(sorted(schedules))
    if method.needs_data:
        raise InvalidParameterError(f"Per-layer or per-tensor values ({names}) are not supported by the data-guided "
                                    f"method {method.name!r}; give one value each.")
    if selecting:
        raise InvalidParameterError(f"Label-free selection chooses one value per parameter; {names} vary over the "
                                    "model (give one value each, or drop `select`).")
    firsts = {k: s.leaves()[0] for k, s in schedules.items()}
    if getattr(method.make_params(**scalars, **firsts), "resolved_scope", "tensor") == "global":
        raise InvalidParameterError(f"{names} vary over the model but scope is global (one threshold for the whole "
                                    "model); set scope: tensor.")
    for key, schedule in schedules.items():
        for leaf in schedule.leaves():
            try:
                method.make_params(**scalars, **{**firsts, key: leaf})
            except InvalidParameterError as err:
                raise InvalidParameterError(f"parameters.{key} names {leaf!r}: {err}") from None


def described_schedules(method: MergeMethod, parameters: Mapping[str, Any]) -> dict[str, str]:
    """The parameters that vary over the model, each in one readable line (for cards and summaries)."""
    return {k: s.describe() for k, s in split_parameters(method, parameters)[1].items()}


def scalar_parameters(method: MergeMethod, parameters: Mapping[str, Any]) -> MethodParams:
    """The method's parameters with each schedule left at its default (what holds where no entry matches)."""
    return method.make_params(**split_parameters(method, parameters)[0])


class TensorParameters:
    """A method's parameters per tensor, from the config's scalars and schedules; records each resolution."""

    def __init__(self, method: MergeMethod, parameters: Mapping[str, Any], adapter: ModelAdapter,
                 positions: Mapping[str, float] | None = None,
                 model_parameters: list[Mapping[str, Any] | None] | None = None,
                 slice_parameters: tuple[Mapping[str, int], list[Mapping[str, Any] | None]] | None = None) -> None:
        self.method, self.adapter = method, adapter
        self.positions = positions  # per tensor, where it sits on a gradient (slices: over its slice)
        self.scalars, self.schedules = split_parameters(method, parameters)
        # per slice (slices with their own parameters): those replace the top-level ones for the slice's tensors
        self.slice_of: Mapping[str, int] = {}
        self.per_slice: dict[int, tuple[dict[str, Any], dict[str, ParamSchedule]]] = {}
        if slice_parameters is not None:
            self.slice_of, given = slice_parameters
            self.per_slice = {i: split_parameters(method, {**parameters, **p}) for i, p in enumerate(given) if p}
            defaults = method.make_params(**self.scalars)
            for p in given:  # every parameter a slice sets is recorded per tensor (elsewhere: its top-level value)
                for k in p or {}:
                    if k not in self.schedules:
                        self.schedules[k] = ParamSchedule(((None, getattr(defaults, k)),))
        self.model_schedules = [{k: ParamSchedule.parse(v, f"models[{i}].parameters.{k}") for k, v in (p or {}).items()}
                                for i, p in enumerate(model_parameters or [])]
        if not any(self.model_schedules):
            self.model_schedules = []
        self.resolved: dict[str, dict[str, Any]] = {}
        self._cache: dict[tuple, MethodParams] = {}

    def __bool__(self) -> bool:
        return bool(self.schedules) or bool(self.model_schedules)

    def _position(self, name: str) -> float:
        return (self.positions[name] if self.positions is not None and name in self.positions else
                layer_position(self.adapter.stage_of(name), self.adapter.num_layers))

    def for_models(self, name: str, weights: list[float]) -> tuple[list[float], list[dict[str, Any]]] | None:
        """Tensor ``name``'s weights and per-model parameter values (``None`` without per-model parameters).

        A per-model value whose filters match nothing here leaves the model at ``weights[i]`` / the shared value.
        """
        if not self.model_schedules:
            return None
        x = self._position(name)
        weights, values = list(weights), []
        for i, schedules in enumerate(self.model_schedules):
            own = {k: v for k, s in schedules.items() if (v := s.resolve(name, x)) is not None}
            if "weight" in own:
                weights[i] = float(own.pop("weight"))
            values.append(own)
            record = self.resolved.setdefault(name, {})
            record.update({f"models[{i}].{k}": v for k, v in own.items()})
            if "weight" in schedules:
                record[f"models[{i}].weight"] = weights[i]
        return weights, values

    def for_tensor(self, name: str) -> MethodParams:
        """The parameters of tensor ``name`` (validated; the values are recorded in :attr:`resolved`)."""
        x = self._position(name)
        scalars, schedules = self.per_slice.get(self.slice_of.get(name, -1), (self.scalars, self.schedules))
        values = {k: s.resolve(name, x) for k, s in schedules.items()}
        values = {k: v for k, v in values.items() if v is not None}
        key = tuple(sorted({**scalars, **values}.items(), key=lambda kv: kv[0]))
        key = tuple((k, repr(v)) for k, v in key)
        if key not in self._cache:
            try:
                self._cache[key] = self.method.make_params(**{**scalars, **values})
            except InvalidParameterError as err:
                raise InvalidParameterError(f"At tensor {name!r} the schedules give {values}: {err}") from None
        params = self._cache[key]
        self.resolved.setdefault(name, {}).update({k: getattr(params, k) for k in self.schedules})
        return params

    def record(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """The resolved values of ``names`` in model order (plain values, for the saved config)."""
        return {n: {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.resolved[n].items()}
                for n in names if n in self.resolved}


def replace_params(ctx: Any, params: MethodParams) -> Any:
    """A copy of a :class:`~hf_mloss.methods.MergeContext` with other parameters (its state is shared)."""
    return dataclasses.replace(ctx, params=params)
