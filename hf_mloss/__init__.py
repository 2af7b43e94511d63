"""hf_mloss: Hugging Face-native model merging guided by M-Loss.

```python
import hf_mloss

report = hf_mloss.score(base, [ft_a, ft_b], data="path/to/images")      # mergeability, no merge
result = hf_mloss.merge(base, [ft_a, ft_b], "m_ties", data="path/to/images", k=0.2, e=0.1)
result.save_pretrained("merged")                                          # Hub-ready folder
```
"""

__version__ = "0.1.0"

from .adapters import list_adapters, register_adapter
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
    UnknownMethodError,
    UnsafeCheckpointError,
    UnsupportedModelError,
)
from .config import MergeConfig
from .merger import merge, score
from .methods import list_methods, register_merge_method
from .report import MLossReport
from .result import MergeResult

__all__ = [
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptCheckpointError",
    "DataError",
    "HfMLossError",
    "IncompatibleCheckpointsError",
    "InvalidParameterError",
    "MLossReport",
    "MergeConfig",
    "MergeResult",
    "OutputExistsError",
    "PushError",
    "UnknownMethodError",
    "UnsafeCheckpointError",
    "UnsupportedModelError",
    "__version__",
    "list_adapters",
    "list_methods",
    "merge",
    "register_adapter",
    "register_merge_method",
    "score",
]
