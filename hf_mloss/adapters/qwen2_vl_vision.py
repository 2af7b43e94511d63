"""Adapter for Qwen2-VL's vision tower (``Qwen2VisionTransformerPretrainedModel``, the ``model.visual`` of a
``Qwen2VLForConditionalGeneration``), scored on images inside the whole model (:mod:`.vision_language`).

The tower reads an image as a flat list of patches (``[patches, channels · frames · p · p]``) with its grid
(``image_grid_thw``), attends within each image (``cu_seqlens``) with 2-D rotary positions, and ends in a merger
that folds 2 × 2 patches into one language-model token. Its blocks are plain pre-norm blocks whose MLP is
``fc2(act(fc1(x)))``: the unit is ``mlp.fc1`` (QuickGELU), node i owns row i of ``fc1``; the merger is the tail,
merged by the method's data-free rule.

Scoring images are held as every image family holds them, ``[N, 3, S, S]`` normalised pixels: the base's image
processor sees each image resized to one square size S (Qwen2-VL's own resolution varies per image; one size lets
images share a batch) and its patches are folded back into pixels (:class:`SquareImages`); ``embed`` cuts them
into patches exactly as the processor does (:func:`patchify`) and runs the tower's own forward until its first
block, recording what the tower hands its blocks (positions, ``cu_seqlens``), as :mod:`.hooked` records a text
model's block arguments.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from ..errors import DataError
from .base import BlockContext, ModelAdapter, ScoredUnit

SCORING_SIDE = 224
"""The side of a square scoring image before the processor's own rounding (Qwen2-VL-2B: 224 px, 16 × 16 patches)."""
_TOWER_ROOTS = ("patch_embed.", "blocks.", "merger.")


def patchify(pixels: torch.Tensor, patch: int, merge: int, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, C, H, W]`` images as the Qwen2-VL processor flattens them: ``[N · gh · gw, C · frames · p · p]``
    patches (merge × merge neighbours adjacent, each image repeated over ``frames``) and the ``[N, 3]`` grid."""
    n, channels, height, width = pixels.shape
    gh, gw = height // patch, width // patch
    x = pixels.reshape(n, channels, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7).unsqueeze(6)  # n, gh/m, gw/m, m, m, C, 1, p, p
    x = x.expand(-1, -1, -1, -1, -1, -1, frames, -1, -1)
    grid = torch.tensor([[1, gh, gw]] * n, dtype=torch.long, device=pixels.device)
    return x.reshape(n * gh * gw, channels * frames * patch * patch), grid


def unpatchify(patches: torch.Tensor, grid: torch.Tensor, patch: int, merge: int, frames: int) -> torch.Tensor:
    """The inverse of :func:`patchify` for images of one grid: ``[N, C, H, W]`` (the first frame)."""
    _, gh, gw = (int(v) for v in grid[0])
    n = len(grid)
    x = patches.reshape(n, gh // merge, gw // merge, merge, merge, -1, frames, patch, patch)[:, :, :, :, :, :, 0]
    x = x.permute(0, 5, 1, 3, 6, 2, 4, 7)  # n, C, gh/m, m, p, gw/m, m, p
    return x.reshape(n, x.shape[1], gh * patch, gw * patch)


class SquareImages:
    """The base's Qwen2-VL image processor for scoring: each image resized to one square side (the processor's
    rounding of :data:`SCORING_SIDE`) and processed as the model's processor does, returned as ``[N, 3, S, S]``
    pixels (see the module docstring)."""

    def __init__(self, processor: Any) -> None:
        try:  # transformers 5: the PIL processor's module (the other one needs torchvision)
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
        except ImportError:
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        self.processor = processor
        self.patch, self.merge = int(processor.patch_size), int(processor.merge_size)
        self.frames = int(processor.temporal_patch_size)
        size = processor.size
        low, high = (size.get("shortest_edge"), size.get("longest_edge")) if isinstance(size, Mapping) else \
            (getattr(size, "shortest_edge", None), getattr(size, "longest_edge", None))
        self.side = smart_resize(SCORING_SIDE, SCORING_SIDE, factor=self.patch * self.merge,
                                 min_pixels=low or 56 * 56, max_pixels=high or 28 * 28 * 1280)[0]

    def __call__(self, images: list[Any], return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        from PIL import Image

        square = [image.resize((self.side, self.side), Image.BICUBIC) for image in images]
        out = self.processor(images=square, do_resize=False, return_tensors="pt")
        pixels = unpatchify(torch.as_tensor(out["pixel_values"]), torch.as_tensor(out["image_grid_thw"]),
                            self.patch, self.merge, self.frames)
        return {"pixel_values": pixels}


class _Recorded(Exception):
    """Raised by the first block's recorder: the rest of the tower's forward is not needed."""


_CAPTURE = threading.Lock()  # recording swaps a block's forward: one recording at a time


class Qwen2VLVisionAdapter(ModelAdapter):
    """Qwen2-VL vision tower: node M-Loss on every ``blocks.N.mlp.fc1`` (the input of QuickGELU); see the module
    docstring. Used as the vision tower of a whole Qwen2-VL only (never matched on its own)."""

    name = "qwen2_vl_vision"
    model_types = ()
    model_class = Qwen2VisionTransformerPretrainedModel
    layer_pattern = re.compile(r"blocks\.(\d+)\.")
    unit: ClassVar[ScoredUnit] = ScoredUnit(gate="mlp.fc1")
    target_suffix = unit.gate
    modality: ClassVar[str] = "image"
    input_names: ClassVar[tuple[str, ...]] = ("pixel_values",)

    @classmethod
    def matches(cls, config: PretrainedConfig) -> bool:
        return False

    @classmethod
    def model_config(cls, config: PretrainedConfig) -> PretrainedConfig:
        return getattr(config, "vision_config", None) or config

    def canonical_key(self, key: str) -> str | None:
        return key if key.startswith(_TOWER_ROOTS) else None

    def is_embedding(self, name: str) -> bool:
        return name.startswith("patch_embed.")

    def layer_prefix(self, layer: int) -> str:
        return f"blocks.{layer}."

    @property
    def num_layers(self) -> int:
        return int(self.config.depth)

    def load_processor(self, path: str, *, token: str | bool | None = None, full: bool = False) -> Any:
        """The base's image processor (PIL backend), as scoring reads images: :class:`SquareImages`."""
        return self.wrap_image_processor(super().load_processor(path, token=token))

    @staticmethod
    def wrap_image_processor(processor: Any) -> SquareImages:
        """A Qwen2-VL image processor as scoring uses it (:class:`SquareImages`)."""
        return processor if isinstance(processor, SquareImages) else SquareImages(processor)

    # ----------------------------------------------------------------- the block walk
    def layers(self, model: PreTrainedModel) -> list[nn.Module]:
        return list(model.blocks)

    def activation(self, model: PreTrainedModel | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        if model is not None:
            return self.layers(model)[0].mlp.act
        return super().activation(model)

    def embed(self, model: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, BlockContext]:
        """The patch embeddings entering block 0 and the arguments the tower gives its blocks (rotary positions,
        ``cu_seqlens``), from the tower's own forward stopped at its first block; every patch counts."""
        config = self.config
        pixels, step = batch["pixel_values"], config.patch_size * config.spatial_merge_size
        if pixels.dim() != 4 or pixels.shape[-1] % step or pixels.shape[-2] % step:
            raise DataError(f"Qwen2-VL scores images as [N, 3, H, W] pixels whose sides are multiples of patch_size "
                            f"x spatial_merge_size ({step} px), got {tuple(pixels.shape)}; pass images (PIL, a "
                            "folder, a dataset) to have the base's processor prepare them.")
        patches, grid = patchify(pixels, config.patch_size, config.spatial_merge_size, config.temporal_patch_size)
        first = model.blocks[0]
        calls: list[tuple[tuple, dict]] = []

        def record(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append((args, kwargs))
            raise _Recorded

        with _CAPTURE:
            first.forward = record
            try:
                model(patches, grid_thw=grid)
            except _Recorded:
                pass
            finally:
                del first.forward
        if not calls:
            raise RuntimeError(f"{type(model).__name__}'s forward did not call its first block")
        args, kwargs = calls[0]
        hidden = args[0] if args else kwargs.pop("hidden_states")
        if len(args) > 1:
            raise RuntimeError(f"{type(model).__name__} passes its blocks positional arguments hf_mloss does not "
                               "read; scoring this transformers version's Qwen2-VL tower is not supported.")
        return hidden, BlockContext(extras={"block_kwargs": kwargs})

    def forward_to_target(self, layer: nn.Module, hidden: torch.Tensor,
                          context: BlockContext) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden + layer.attn(layer.norm1(hidden), **context.extras["block_kwargs"])
        return residual, layer.norm2(residual)

    def forward_from_target(self, layer: nn.Module, residual: torch.Tensor, target_input: torch.Tensor,
                            context: BlockContext) -> torch.Tensor:
        return residual + layer.mlp(target_input)
