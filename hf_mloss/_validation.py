"""Declarative checks for parameter dataclasses: every field says its type, range and choices once.

A field made with :func:`param` carries its help text and constraints in ``metadata``; :func:`validate_fields`
checks (and normalises: numpy scalars to ``float``, lists to tuples) every field of a dataclass instance from its
annotations and that metadata. Method parameters, scoring options and the merge config all use it, so each check
and each error message exists once. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .errors import InvalidParameterError, redact

_MISSING = dataclasses.MISSING
FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: merges compute in float32, so a number parameter beyond it cannot reach the tensors (torch
refuses to turn it into a float32 scalar, or it becomes inf)."""


def param(default: Any = _MISSING, help: str = "", *, choices: Iterable[Any] | None = None,
          low: float | None = None, high: float | None = None, low_open: bool = False, high_open: bool = False,
          default_factory: Callable[[], Any] | None = None, hint: str = "") -> Any:
    """A dataclass field with its help text and constraints (used by :func:`validate_fields` and ``--help``).

    Args:
        default: the default value (omit for a required field).
        help: one line for users (the CLI and ``hf-mloss methods`` print it).
        choices: the allowed values.
        low, high: numeric bounds, inclusive unless ``low_open`` / ``high_open``.
        hint: appended to the error message (e.g. what the parameter means).
    """
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "low": low, "high": high,
                "low_open": low_open, "high_open": high_open, "hint": hint}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def validate_fields(obj: Any, where: str = "") -> None:
    """Check every field of the dataclass ``obj`` against its annotation and :func:`param` metadata, in place.

    Raises:
        InvalidParameterError: naming the field, the value received and what is allowed.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{where}{f.name}"
        value = _coerce(name, value, hints.get(f.name, Any), f.metadata)
        object.__setattr__(obj, f.name, value)


def _coerce(name: str, value: Any, annotation: Any, meta: Mapping[str, Any]) -> Any:
    options = _union_members(annotation)
    if value is None:
        if type(None) in options or annotation is Any:
            return None
        raise InvalidParameterError(f"{name} is required, got None.{_hint(meta)}")
    errors = []
    for option in (o for o in options if o is not type(None)):
        try:
            value = _as_type(value, option)
            break
        except (TypeError, ValueError) as err:
            errors.append(str(err))
    else:
        kinds = " or ".join(_type_name(o) for o in options if o is not type(None))
        raise InvalidParameterError(f"{name} must be {kinds}, got {short(value)}.{_hint(meta)}")
    _check_range(name, value, meta)
    return value


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _as_type(value: Any, kind: Any) -> Any:
    origin = typing.get_origin(kind)
    if kind is Any:
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise TypeError("not a bool")
    if kind is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        raise TypeError("not an int")
    if kind is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            try:
                out = float(value)
            except OverflowError:
                raise ValueError("too large") from None
            if not math.isfinite(out):
                raise ValueError("not finite")
            return out
        raise TypeError("not a number")
    if kind is str:
        if isinstance(value, str) and value:
            return value
        raise TypeError("not a non-empty string")
    if origin in (tuple, list):
        args = typing.get_args(kind)
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
            raise TypeError("not a list")
        item = args[0] if args else Any
        items = tuple(_as_type(v, item) for v in value)
        return items if origin is tuple else list(items)
    if origin is dict or kind is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise TypeError("not a mapping")
    if isinstance(kind, type):
        if isinstance(value, kind):
            return value
        raise TypeError(f"not a {kind.__name__}")
    return value


def _type_name(kind: Any) -> str:
    origin = typing.get_origin(kind)
    if origin in (tuple, list):
        args = typing.get_args(kind)
        return f"a list of {_type_name(args[0]) if args else 'values'}"
    names = {bool: "true/false", int: "an integer", float: "a finite number", str: "a non-empty string",
             dict: "a mapping"}
    return names.get(kind, getattr(kind, "__name__", str(kind)))


def _check_range(name: str, value: Any, meta: Mapping[str, Any]) -> None:
    _check_bounds(name, value, meta)
    for v in value if isinstance(value, (tuple, list)) else (value,):
        check_float32(name, v, _hint(meta))


def _check_bounds(name: str, value: Any, meta: Mapping[str, Any]) -> None:
    choices = meta.get("choices")
    if choices is not None:
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if v not in choices:
                raise InvalidParameterError(
                    f"{name} must be one of {list(choices)}, got {short(v)}{did_you_mean(v, choices)}.{_hint(meta)}"
                )
    low, high = meta.get("low"), meta.get("high")
    if low is None and high is None:
        return
    values = value if isinstance(value, (tuple, list)) else (value,)
    for v in values:
        too_low = low is not None and (v <= low if meta.get("low_open") else v < low)
        too_high = high is not None and (v >= high if meta.get("high_open") else v > high)
        if too_low or too_high:
            kind = "an integer" if isinstance(v, int) else "a number"
            raise InvalidParameterError(f"{name} must be {kind} {_interval(meta)}, got {short(v)}.{_hint(meta)}")


def is_finite(value: float) -> bool:
    """Whether a number is finite as a float (an integer of hundreds of digits is not: it overflows one)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_float32(name: str, value: Any, hint: str = "") -> None:
    """Refuse a float ``value`` beyond float32's range (see :data:`FLOAT32_MAX`), naming ``name``."""
    if isinstance(value, float) and math.isfinite(value) and abs(value) > FLOAT32_MAX:
        raise InvalidParameterError(f"{name} is {value:g}, beyond the range of float32, in which merges compute "
                                    f"(at most {FLOAT32_MAX:.4g} in size).{hint}")


def _interval(meta: Mapping[str, Any]) -> str:
    low, high = _number(meta.get("low")), _number(meta.get("high"))
    if high is None:
        return f"{'>' if meta.get('low_open') else '>='} {low}"
    if low is None:
        return f"{'<' if meta.get('high_open') else '<='} {high}"
    left = "(" if meta.get("low_open") else "["
    right = ")" if meta.get("high_open") else "]"
    return f"in {left}{low}, {high}{right}"


def _number(value: float | None) -> str | None:
    if value is None:
        return None
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _hint(meta: Mapping[str, Any]) -> str:
    hint = meta.get("hint")
    return f" {hint}" if hint else ""


def field_help(cls: type) -> dict[str, tuple[Any, str]]:
    """``{name: (default, help)}`` of a :func:`param` dataclass (``None`` default for required fields)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not _MISSING:
            default = f.default
        elif f.default_factory is not _MISSING:
            default = f.default_factory()
        else:
            default = None
        out[f.name] = (default, f.metadata.get("help", ""))
    return out


def check_keys(given: Iterable[Any], valid: Iterable[str], where: str, *, error: type[Exception] = InvalidParameterError
               ) -> None:
    """Refuse unknown keys, suggesting the closest valid one."""
    valid = list(valid)
    unknown = [k for k in given if k not in valid]
    if unknown:
        key = unknown[0]
        raise error(f"Unknown {where} {short(key)}{did_you_mean(key, valid)}; valid keys: {valid}.")


def did_you_mean(value: Any, choices: Iterable[Any], aliases: Mapping[str, str] | None = None) -> str:
    """`` (did you mean 'x'?)`` for the closest choice (also matching without ``_``/``-``), else ``""``."""
    if not isinstance(value, str):
        return ""
    choices = [str(c) for c in choices]
    if aliases and value.lower() in aliases:
        return f" (did you mean {aliases[value.lower()]!r}?)"
    squashed = {c.replace("_", "").replace("-", "").lower(): c for c in choices}
    key = value.replace("_", "").replace("-", "").lower()
    if key in squashed:
        return f" (did you mean {squashed[key]!r}?)"
    match = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (error messages stay one line), token-shaped strings redacted."""
    try:
        text = redact(repr(value))  # before cutting: a cut token would escape the patterns
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
