"""Quiet transformers while hf_mloss loads models (its own progress bars say what happens)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_transformers(enabled: bool) -> Iterator[None]:
    """Silence transformers' per-model loading bars and load reports in the block (when ``enabled``)."""
    from transformers.utils import logging as hf_logging

    if not enabled:
        yield
        return
    was_enabled, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if was_enabled:
            hf_logging.enable_progress_bar()
