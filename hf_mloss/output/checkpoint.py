"""Saving a merged model as a transformers checkpoint that every supported transformers version loads.

``save_pretrained`` of transformers >= 5.6 writes a ``CLIPVisionModel`` with unprefixed keys, which transformers 4.x
and 5.0-5.5 load as random weights with only a warning. The adapter names the layout every version reads
(``vision_model.``-prefixed keys for CLIP towers), and the weights are written with huggingface_hub's
``save_torch_state_dict`` (safetensors, sharded with an index when large, ``format: pt`` in every header).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import save_torch_state_dict

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..adapters import ModelAdapter


def save_weights(model: PreTrainedModel, adapter: ModelAdapter, folder: Path, *,
                 max_shard_size: int | str = "5GB") -> None:
    """Write ``config.json`` and the safetensors weights of ``model`` into ``folder``.

    Models of the generic adapter (any transformers family) are written by their own ``save_pretrained``: tied
    tensors saved once and tied again on load, transformers' checkpoint key spelling, the generation config.
    """
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if getattr(adapter, "saves_with_transformers", False):
        from .._logging import quiet_transformers

        with quiet_transformers(True):
            model.save_pretrained(folder, max_shard_size=max_shard_size)
        return

    state = {k: v.detach().contiguous() for k, v in adapter.checkpoint_state_dict(model).items()}
    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()  # a bar per save of a few files is noise
    try:
        save_torch_state_dict(state, folder, max_shard_size=max_shard_size, metadata={"format": "pt"})
    finally:
        if not was_disabled:
            enable_progress_bars()
    config = model.config
    config.architectures = [type(model).__name__]
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = dtypes.pop()
    config.save_pretrained(folder)
