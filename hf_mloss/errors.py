"""Exceptions raised by hf_mloss.

Every class also subclasses a builtin (``ValueError``, ``FileNotFoundError``, ...) so callers can catch either the
specific hf_mloss error or the builtin they already handle.
"""

from __future__ import annotations

import re

_SECRET_SHAPES = (
    re.compile(r"\b(hf_|api_org_|ghp_|gho_|sk-|xox[abp]-)[A-Za-z0-9]{20,}|\b(github_pat_)[A-Za-z0-9_]{20,}"),
    re.compile(r"(?i)((?:token|secret|password|passwd|api[_-]?key|authorization)[\"']?\s*[=:]\s*[\"']?"
               r"(?:bearer\s+)?)[^\s\"',;]{8,}"),
    re.compile(r"(?i)(bearer\s+)[^\s'\"]+"),
)


def redact(text: str) -> str:
    """``text`` with every token-shaped string replaced by ``***``: Hub and other service tokens (``hf_...``,
    ``api_org_...``, ``ghp_...``, ``sk-...``) and any long value after ``token``/``HF_TOKEN=``/``secret``/``password``
    /``api_key``/``Bearer``. Every error message that echoes text a user gave goes through it."""
    text = _SECRET_SHAPES[0].sub(lambda m: (m.group(1) or m.group(2)) + "***", text)
    for pattern in _SECRET_SHAPES[1:]:
        text = pattern.sub(lambda m: m.group(1) + "***", text)
    return text


def looks_like_secret(value: str) -> bool:
    """Whether ``value`` holds a token-shaped string (see :func:`redact`)."""
    return redact(value) != value


class HfMLossError(Exception):
    """Base class of every error hf_mloss raises on purpose (user errors, not bugs); token-shaped strings in the
    message are redacted (see :func:`redact`)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class InvalidParameterError(HfMLossError, ValueError):
    """A merge or scoring parameter is out of range or of the wrong kind."""


class UnknownMethodError(HfMLossError, KeyError):
    """The requested merge method is not registered."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnsupportedModelError(HfMLossError, ValueError):
    """No adapter knows this model architecture."""


class IncompatibleCheckpointsError(HfMLossError, ValueError):
    """The checkpoints to merge do not share one architecture (names, shapes or dtypes differ)."""


class CheckpointNotFoundError(HfMLossError, FileNotFoundError):
    """A local path does not exist, or a Hub id cannot be resolved (not cached while offline, unknown repo...)."""


class UnsafeCheckpointError(HfMLossError, ValueError):
    """A checkpoint holds only pickle (``.bin``) weights and the caller did not opt in to load them."""


class CorruptCheckpointError(HfMLossError, ValueError):
    """A weights file exists but cannot be read (bad safetensors header, truncated file, non-finite values...)."""


class DataError(HfMLossError, ValueError):
    """The unlabeled scoring data is missing, empty, too small or unreadable."""


class OutputExistsError(HfMLossError, FileExistsError):
    """The output folder exists and is not empty; pass ``overwrite=True`` to replace it."""


class ConfigError(HfMLossError, ValueError):
    """A merge configuration (YAML/dict) is invalid; the message names the field, the value and the valid choices."""


class SaveError(HfMLossError, OSError):
    """Writing the output folder failed (disk full, permissions...); nothing was left half-written."""


class PushError(HfMLossError, RuntimeError):
    """Uploading to the Hub failed; the local folder is intact and the message says how to retry."""
