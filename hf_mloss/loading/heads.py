"""Classification heads (label-free selection, learned merges): files, tensors or callables, as ``features -> logits``.

A head is checked before it is used: a file or tensor must hold ``weight`` [classes, features] and an optional
``bias`` [classes], finite; :func:`check_heads` then asks every head to read the tower's pooled features of one
batch, so a head of another width is refused naming both widths, and one giving NaN naming the head, before the
training it would otherwise break.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import InvalidParameterError


class LinearHead:
    """``features → logits`` from a weight [classes, features] (a file's, with its bias, or a tensor given alone)."""

    def __init__(self, weight: Any, bias: Any = None, *, matmul: bool = False) -> None:
        self.weight, self.bias, self.matmul = weight, bias, matmul

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def __call__(self, features: Any) -> Any:
        import torch

        if self.matmul:  # a tensor head: features @ Wᵀ, as it has always been computed
            return features @ self.weight.to(features).T
        return torch.nn.functional.linear(features, self.weight.to(features),
                                          None if self.bias is None else self.bias.to(features))


def as_head(head: Any, index: int, where: str = "select.heads") -> Any:
    """A callable ``features → logits``: a safetensors file (``weight`` [C, D], optional ``bias`` [C]), a weight
    tensor, an object with ``.logits`` (as the suites' heads), or any callable (e.g. an ``nn.Linear``).

    ``where`` names the option in errors (``select.heads``, or a learned merge's ``heads``).

    Raises:
        InvalidParameterError: an unreadable file, a file without ``weight``, a weight that is not [classes,
            features], a bias that is not one value per class, non-finite values, or an object that is no head.
    """
    import os

    import torch

    at = f"{where}[{index}]"
    if isinstance(head, (str, os.PathLike)):
        from safetensors.torch import load_file

        from safetensors import SafetensorError

        path = os.fspath(head)
        if not os.path.isfile(path):
            raise InvalidParameterError(f"{at}: {path!r} does not exist (or is not a file); a head file is a "
                                        "safetensors file holding `weight` [classes, features] (and optionally "
                                        "`bias`).")
        try:
            tensors = load_file(path)
        except (OSError, ValueError, SafetensorError) as err:  # the file's content is never echoed
            reason = err.strerror if isinstance(err, OSError) and err.strerror else "not a safetensors file"
            raise InvalidParameterError(f"{at}: cannot read {path!r} ({reason}); a head file is a safetensors file "
                                        "holding `weight` [classes, features] (and optionally `bias`).") from None
        if "weight" not in tensors:
            raise InvalidParameterError(f"{at}: {path!r} holds {sorted(tensors)[:8]}; a head file needs `weight` "
                                        "[classes, features] (and optionally `bias`).")
        weight, bias = tensors["weight"], tensors.get("bias")
        check_head_tensors(weight, bias, f"{at} ({path!r})")
        return LinearHead(weight.float(), None if bias is None else bias.float())
    if isinstance(head, torch.Tensor):
        check_head_tensors(head, None, at)
        return LinearHead(head.float(), matmul=True)
    if hasattr(head, "logits"):
        return head.logits
    if callable(head):
        return head
    raise InvalidParameterError(f"{at} must be a safetensors file, a weight tensor, an object with .logits(features) "
                                f"or a callable, got {type(head).__name__}.")


def check_head_tensors(weight: Any, bias: Any, at: str) -> None:
    """A head's ``weight`` is [classes, features] of floats, its ``bias`` one value per class, both finite."""
    import torch

    if not weight.is_floating_point() or weight.dim() != 2 or 0 in weight.shape:
        raise InvalidParameterError(f"{at}: `weight` must be a float matrix [classes, features], got "
                                    f"{weight.dtype} of shape {list(weight.shape)}.")
    if bias is not None and (not bias.is_floating_point() or bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise InvalidParameterError(f"{at}: `bias` must hold one float per class ({weight.shape[0]} for `weight` "
                                    f"{list(weight.shape)}), got {bias.dtype} of shape {list(bias.shape)}.")
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and not bool(torch.isfinite(tensor).all()):
            raise InvalidParameterError(f"{at}: `{name}` holds NaN or Inf values; a head must be finite.")


def head_width(head: Any, given: Any) -> int | None:
    """The feature width a head declares (``in_features`` of a linear, a weight's second size), ``None`` if it
    declares none (a plain callable)."""
    import torch

    for candidate in (head, given):
        width = getattr(candidate, "in_features", None)
        if isinstance(width, int):
            return width
        weight = getattr(candidate, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return int(weight.shape[1])
    return None


def check_heads(heads: Sequence[Any], given: Sequence[Any], features: Any, where: str = "heads") -> None:
    """Every head reads the tower's pooled ``features`` [samples, width] (of one batch, on the run's device) and
    gives finite logits [samples, classes].

    ``heads``: the callables of :func:`as_head`; ``given``: what the user passed (named in errors).

    Raises:
        InvalidParameterError: naming the head, its width and the tower's.
    """
    import os

    import torch

    width = int(features.shape[-1])
    for i, (head, raw) in enumerate(zip(heads, given)):
        name = f"{where}[{i}] ({repr(os.fspath(raw)) if isinstance(raw, (str, os.PathLike)) else type(raw).__name__})"
        declared = head_width(head, raw)
        if declared is not None and declared != width:
            raise InvalidParameterError(f"{name} reads {declared} features, but the tower's pooled output has "
                                        f"{width}: give one head per model of width {width} (weight [classes, "
                                        f"{width}]).")
        try:
            with torch.no_grad():
                logits = head(features)
        except Exception as err:  # noqa: BLE001 - any callable: its own error says why it cannot read the features
            reason = " ".join(str(err).split())[:160] or type(err).__name__
            raise InvalidParameterError(f"{name} cannot read the tower's {width} pooled features ({reason}); give "
                                        f"one head per model of width {width}.") from None
        samples = len(features)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != samples:
            shape = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise InvalidParameterError(f"{name} must map [samples, {width}] features to [samples, classes] logits, "
                                        f"got {shape} for {samples} samples.")
        if not bool(torch.isfinite(logits).all()):
            raise InvalidParameterError(f"{name} gives NaN or Inf logits on the tower's features: its weights are "
                                        "not finite.")
