"""The recipe's scoring options (the ``score:`` section): :class:`ScoringOptions`, defined in
:mod:`hf_mloss.methods.scoring` (the data-guided methods' parameters extend it, and methods sit below the recipe)."""

from __future__ import annotations

from ..methods.scoring import PREFIXES, REDUCTIONS, ScoringOptions, check_activation

__all__ = ["PREFIXES", "REDUCTIONS", "ScoringOptions", "check_activation"]
