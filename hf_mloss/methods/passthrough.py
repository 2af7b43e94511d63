"""Passthrough: the output copies input layers as given (mergekit's ``passthrough``), with no arithmetic.

With ``slices`` (:mod:`hf_mloss.spec.slices`) this stacks layer ranges of one or more models, the "depth up-scaling" or
"frankenmerge" recipe: every output tensor is the tensor of the one source its slice names, renumbered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .registry import register_merge_method
from .base import MergeContext, MergeMethod, MethodParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PassthroughParams(MethodParams):
    pass


class Passthrough(MergeMethod):
    """θ = the one source tensor its slice names (the sliced base; see :class:`hf_mloss.spec.slices.SlicePlan`)."""

    name = "passthrough"
    pretty_name = "Passthrough (layer stacking)"
    reference = ("Kim et al., SOLAR 10.7B: Scaling Large Language Models with Simple yet Effective Depth Up-Scaling, "
                 "2023")
    reference_url = "https://arxiv.org/abs/2312.15166"
    params_class = PassthroughParams
    zero_delta_is_base = True
    default_weight = "one"  # no weights: the stack takes each tensor whole

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        return base


register_merge_method(Passthrough())
