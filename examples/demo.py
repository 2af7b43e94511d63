"""Offline demo: build small CLIP vision towers, score and merge them with every method, write a Hub-ready folder.

``python -m examples.demo [--out DIR]`` needs no network. It creates a tiny pretrained-like base and q fine-tunes
(random task vectors with a per-tensor scale spread), a folder of procedural images, then compares the merges by how
close their image features are to the ensemble of the fine-tuned models (what M-Loss measures locally), and saves the
M-TIES merge with its model card and M-Loss report.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image, ImageDraw

import hf_mloss
from hf_mloss.adapters import CLIPVisionAdapter
from hf_mloss.loading.data import load_pixel_values
from hf_mloss.methods import get_method
from examples.tiny import make_base, make_finetune, save_model

DEMO_CONFIG = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, image_size=32,
                   patch_size=8)  # fmt: skip

METHODS = [
    ("average", {}),
    ("task_arithmetic", {"lam": 0.3}),
    ("ties", {"k": 0.2, "scope": "global", "lam": 1.0}),
    ("ties", {"k": 0.2, "scope": "tensor", "lam": 1.0}),
    ("dare_ties", {"p": 0.7}),
    ("m_ties", {"k": 0.2, "e": 0.1}),
    ("m_ties", {"k": 0.2, "e": 0.0}),
    ("m_ties", {"k": 0.2, "e": 0.1, "rank": "random"}),
]


def procedural_images(folder: Path, n: int, seed: int) -> Path:
    """Random coloured shapes on textured backgrounds (an ``imagefolder`` layout)."""
    generator = torch.Generator().manual_seed(seed)
    target = folder / "train" / "images"
    target.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        rand = torch.rand(12, generator=generator).tolist()
        image = Image.new("RGB", (48, 48), tuple(int(64 * v) for v in rand[:3]))
        draw = ImageDraw.Draw(image)
        box = [4 + 20 * rand[3], 4 + 20 * rand[4], 24 + 20 * rand[5], 24 + 20 * rand[6]]
        colour = tuple(int(255 * v) for v in rand[7:10])
        (draw.ellipse if rand[10] > 0.5 else draw.rectangle)(box, fill=colour)
        image.save(target / f"{i:04d}.png")
    return folder


@torch.inference_mode()
def features(model, pixels: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=pixels).pooler_output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="hf_mloss_demo_output", help="where the M-TIES merge is written")
    parser.add_argument("--q", type=int, default=4, help="number of fine-tuned models")
    parser.add_argument("--num-samples", type=int, default=64, help="unlabeled images for M-Loss")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hf_mloss_demo_") as work:  # the inputs go when the demo ends
        return run_demo(args, Path(work))


def run_demo(args: argparse.Namespace, work: Path) -> int:
    """Build the inputs in ``work``, compare the merges, save the M-TIES merge to ``args.out``."""
    print(f"Building a base and {args.q} fine-tuned CLIP vision towers in {work} (removed at the end) ...")
    base = make_base(args.seed, **DEMO_CONFIG)
    base_dir = save_model(base, work / "base")
    finetunes = [make_finetune(base, args.seed * 100 + i, scale=2e-2) for i in range(args.q)]
    model_dirs = [str(save_model(m, work / f"finetune-{i}")) for i, m in enumerate(finetunes)]
    images = procedural_images(work / "images", 2 * args.num_samples, args.seed)

    processor = CLIPVisionAdapter(base.config).load_processor(str(base_dir))
    held_out = load_pixel_values(str(images), processor, num_samples=2 * args.num_samples,
                                               seed=args.seed + 1)[0][args.num_samples :]
    ensemble = torch.stack([features(m, held_out) for m in finetunes]).mean(0)

    report = hf_mloss.score(str(base_dir), model_dirs, str(images), num_samples=args.num_samples, prefix="own",
                            progress=False)
    print("\nMergeability before merging (each model's own forward):")
    print(report.summary())

    rows, best = [], None
    for method, params in METHODS:
        start = time.perf_counter()
        needs_data = get_method(method).needs_data
        result = hf_mloss.merge(str(base_dir), model_dirs, method, data=str(images) if needs_data else None,
                                num_samples=args.num_samples, seed=args.seed, progress=False, **params)
        seconds = time.perf_counter() - start
        merged = features(result.model, held_out)
        cosine = torch.nn.functional.cosine_similarity(merged, ensemble, dim=-1).mean().item()
        rel = ((merged - ensemble).norm() / ensemble.norm()).item()
        label = method + "".join(f" {k}={v}" for k, v in params.items())
        rows.append((label, cosine, rel, seconds))
        if method == "m_ties" and params.get("e") and "rank" not in params:
            best = result
    print("\nHow close each merge's features are to the ensemble's, on held-out images "
          "(cosine: higher is closer; relative L2 distance: lower is closer):")
    print(f"{'method':<44} {'cosine ↑':>8} {'rel. L2 ↓':>9} {'seconds':>8}")
    for label, cosine, rel, seconds in rows:
        print(f"{label:<44} {cosine:>8.4f} {rel:>9.4f} {seconds:>8.2f}")
    out = best.save_pretrained(args.out, overwrite=True)
    print(f"\nWrote the M-TIES merge as a Hub-ready folder: {out}")
    for path in sorted(out.iterdir()):
        print(f"  {path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
