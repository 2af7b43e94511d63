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
                 max_shard_size: int | str = "5GB", base_path: str | None = None) -> None:
    """Write ``config.json`` and the safetensors weights of ``model`` into ``folder``.

    Models of the generic adapter (any transformers family) are written by their own ``save_pretrained``: tied
    tensors saved once and tied again on load, transformers' checkpoint key spelling, the generation config; the
    base's own ``config.json`` is kept where the merge left the configuration as it was (:func:`keep_base_config`).
    """
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if getattr(adapter, "saves_with_transformers", False):
        from .._logging import quiet_transformers

        with quiet_transformers(True):
            model.save_pretrained(folder, max_shard_size=max_shard_size)
        if base_path:
            keep_base_config(model, folder, Path(base_path))
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


_VOLATILE = frozenset({"dtype", "torch_dtype", "_name_or_path", "transformers_version", "architectures"})


def keep_base_config(model: PreTrainedModel, folder: Path, base: Path) -> None:
    """Write the base's own ``config.json`` (its ``dtype`` set to the merge's) in place of the one ``save_pretrained``
    wrote, when both describe the same configuration.

    transformers 5 writes a config in its own format, which transformers 4.x reads without an error but wrongly:
    ``rope_theta`` moved into ``rope_parameters`` (4.57 reads the default 10000 instead of a Llama 3's 500000),
    Qwen2-VL's ``mrope_section`` likewise (4.57 cannot run it). A base saved by 4.x (most Hub repos) is read the same
    by every version, so the merge keeps its file. A merge that changed the configuration (a merged vocabulary,
    re-stacked layers, a dropped ``auto_map``) keeps the written one.
    """
    import json

    from transformers import AutoConfig

    source = base / "config.json"
    if not source.is_file():
        return
    try:
        raw = json.loads(source.read_text(encoding="utf-8"))
        same = _comparable(AutoConfig.from_pretrained(base, trust_remote_code=False).to_dict()) == \
            _comparable(model.config.to_dict())
    except (OSError, ValueError, TypeError, KeyError):
        return
    if not same or not isinstance(raw, dict):
        return
    written = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    for key in ("dtype", "torch_dtype"):
        if key in raw or (key == "dtype" and "torch_dtype" not in raw):
            raw[key] = written.get("dtype", raw.get(key))
    raw["architectures"] = written.get("architectures", raw.get("architectures"))
    (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _comparable(value):
    """A config dict without the entries a merge may change without changing the model (dtype, paths, versions)."""
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items() if k not in _VOLATILE}
    return value
