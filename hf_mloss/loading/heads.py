"""Classification heads given to label-free selection: files, tensors or callables, as ``features -> logits``."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidParameterError


def as_head(head: Any, index: int) -> Any:
    """A callable ``features → logits``: a safetensors file (``weight`` [C, D], optional ``bias``), a weight tensor,
    an object with ``.logits`` (as the suites' heads), or any callable (e.g. an ``nn.Linear``)."""
    import os

    import torch

    if isinstance(head, (str, os.PathLike)):
        from safetensors.torch import load_file

        from safetensors import SafetensorError

        try:
            tensors = load_file(os.fspath(head))
        except (OSError, ValueError, SafetensorError) as err:  # the file's content is never echoed
            reason = err.strerror if isinstance(err, OSError) and err.strerror else "not a safetensors file"
            raise InvalidParameterError(f"select.heads[{index}]: cannot read {os.fspath(head)!r} ({reason}); a head "
                                        "file is a safetensors file holding `weight` [classes, features] (and "
                                        "optionally `bias`).") from None
        if "weight" not in tensors:
            raise InvalidParameterError(f"select.heads[{index}]: {os.fspath(head)!r} holds {sorted(tensors)}; a head "
                                        "file needs `weight` [classes, features] (and optionally `bias`).")
        weight, bias = tensors["weight"].float(), tensors.get("bias")
        return lambda features: torch.nn.functional.linear(features, weight.to(features),
                                                           None if bias is None else bias.to(features))
    if isinstance(head, torch.Tensor):
        weight = head.float()
        return lambda features: features @ weight.to(features).T
    if hasattr(head, "logits"):
        return head.logits
    if callable(head):
        return head
    raise InvalidParameterError(f"select.heads[{index}] must be a safetensors file, a weight tensor, an object with "
                                f".logits(features) or a callable, got {type(head).__name__}.")
