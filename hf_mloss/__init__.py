"""hf_mloss: Hugging Face-native model merging guided by M-Loss.

```python
import hf_mloss

report = hf_mloss.score(base, [ft_a, ft_b], data="path/to/images")      # mergeability, no merge
pairs = hf_mloss.compatibility(base, [ft_a, ft_b, ft_c], data="path/to/images")   # pairwise M-Loss matrix
result = hf_mloss.merge(base, [ft_a, ft_b], "m_ties", data="path/to/images", k=0.2, e=0.1)
result.save_pretrained("merged")                                          # Hub-ready folder
hf_mloss.evaluate(result.model, tasks, heads)                             # accuracy, with labelled data and heads
hf_mloss.run("merged")                                                    # re-run a published recipe
```

Public names are imported on first use, so ``import hf_mloss`` (and ``hf-mloss --help``) stays fast: torch,
transformers and datasets load only when a merge, a score or a model is actually needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

_EXPORTS = {
    "CheckpointNotFoundError": "errors",
    "ConfigError": "errors",
    "CorruptCheckpointError": "errors",
    "DataError": "errors",
    "HfMLossError": "errors",
    "IncompatibleCheckpointsError": "errors",
    "InvalidParameterError": "errors",
    "OutputExistsError": "errors",
    "PushError": "errors",
    "SaveError": "errors",
    "UnknownMethodError": "errors",
    "UnsafeCheckpointError": "errors",
    "UnsupportedModelError": "errors",
    "MergeConfig": "spec.config",
    "MergeResult": "output.result",
    "MLossReport": "output.report",
    "CompatibilityReport": "engine.compatibility",
    "compatibility": "api",
    "SelectionOptions": "spec.selection",
    "list_adapters": "adapters",
    "register_adapter": "adapters",
    "list_methods": "methods",
    "register_merge_method": "methods",
    "merge": "api",
    "score": "api",
    "run": "api",
    "run_score": "api",
    "RunOptions": "api",
    "build_moe": "moe",
    "MoEConfig": "moe",
    "evaluate": "merging.evaluation",
    "evaluate_ensemble": "merging.evaluation",
    "EvalResult": "merging.evaluation",
}

_SUBMODULES = {"adapters", "api", "cli", "distributed", "engine", "errors", "loading", "merging", "methods", "moe", "output", "parallel", "saving", "spec"}

__all__ = [
    "CheckpointNotFoundError",
    "CompatibilityReport",
    "ConfigError",
    "CorruptCheckpointError",
    "DataError",
    "EvalResult",
    "HfMLossError",
    "IncompatibleCheckpointsError",
    "InvalidParameterError",
    "MLossReport",
    "MergeConfig",
    "MergeResult",
    "MoEConfig",
    "OutputExistsError",
    "PushError",
    "RunOptions",
    "SaveError",
    "SelectionOptions",
    "UnknownMethodError",
    "UnsafeCheckpointError",
    "UnsupportedModelError",
    "__version__",
    "build_moe",
    "evaluate",
    "evaluate_ensemble",
    "list_adapters",
    "list_methods",
    "merge",
    "compatibility",
    "register_adapter",
    "register_merge_method",
    "run",
    "run_score",
    "score",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:  # `hf_mloss.methods.get_method(...)` works without importing the submodule first
        return importlib.import_module(f".{name}", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_mloss' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from .adapters import list_adapters, register_adapter
    from .engine.compatibility import CompatibilityReport
    from .spec.config import MergeConfig
    from .merging.evaluation import EvalResult, evaluate, evaluate_ensemble
    from .errors import (
        CheckpointNotFoundError,
        ConfigError,
        CorruptCheckpointError,
        DataError,
        HfMLossError,
        IncompatibleCheckpointsError,
        InvalidParameterError,
        OutputExistsError,
        PushError,
        SaveError,
        UnknownMethodError,
        UnsafeCheckpointError,
        UnsupportedModelError,
    )
    from .api import RunOptions, compatibility, merge, run, run_score, score
    from .methods import list_methods, register_merge_method
    from .moe import MoEConfig, build_moe
    from .output.report import MLossReport
    from .output.result import MergeResult
    from .spec.selection import SelectionOptions
