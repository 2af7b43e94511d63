"""Merge the eight CLIP ViT-B/32 task fine-tunes with M-TIES through the Python API.

The same merge as ``merge_clip_vit_b32_8tasks.yaml`` (``hf-mloss merge`` on that file). Needs the Hub: about
9 x 350 MB of weights (cached after the first run) and 128 images streamed from ``tanganke/dtd``.

    python examples/merge_clip_vit_b32_8tasks.py --output-dir clip-vit-b32-8tasks-mties --device cuda
    python examples/merge_clip_vit_b32_8tasks.py --score          # also print the paper's M-Loss (own prefix) first
    python examples/merge_clip_vit_b32_8tasks.py --push-to-hub YOUR_NAME/clip-vit-b32-8tasks-mties

Nothing is uploaded without ``--push-to-hub``; the token then comes from ``hf auth login`` or ``HF_TOKEN``.
"""

from __future__ import annotations

import argparse

import hf_mloss

BASE = "openai/clip-vit-base-patch32"
TASKS = ["sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd"]
MODELS = [f"tanganke/clip-vit-base-patch32_{task}" for task in TASKS]
METHOD = "m_ties"
# The M-Loss paper's ViT-B/32 setting (its appendix; also hf_mloss's defaults): each fc1 row keeps between 20% and
# 10% of its task vector. The authors' released logs, a different record, used k=0.8.
PARAMETERS = {"k": 0.2, "e": 0.1}
# Any unlabeled images work (labels are ignored): another Hub image dataset id, or a local image folder.
DATA = {"data": "tanganke/dtd", "split": "train", "num_samples": 128}
SEED = 0
BATCH_SIZE = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="clip-vit-b32-8tasks-mties", help="Where to save the merged model.")
    parser.add_argument("--push-to-hub", metavar="REPO", default=None, help="Also upload the folder to this repo.")
    parser.add_argument("--private", action="store_true", help="Create the Hub repo as private.")
    parser.add_argument("--overwrite", action="store_true", help="Replace --output-dir if it is not empty.")
    parser.add_argument("--device", default=None, help="cpu (default), cuda, cuda:1, mps...")
    parser.add_argument("--score", action="store_true", help="Print the M-Loss of the 8 models before merging.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.score:
        report = hf_mloss.score(BASE, MODELS, **DATA, seed=SEED, batch_size=BATCH_SIZE, device=args.device)
        print(report.summary())
    result = hf_mloss.merge(BASE, MODELS, METHOD, **DATA, **PARAMETERS, seed=SEED, batch_size=BATCH_SIZE,
                            device=args.device)
    print(result.report.summary())
    push = {"private": True} if args.push_to_hub and args.private else {}
    folder = result.save_pretrained(args.output_dir, overwrite=args.overwrite, push_to_hub=bool(args.push_to_hub),
                                    repo_id=args.push_to_hub, **push)
    print(f"Saved to {folder}" + (f" and pushed to {args.push_to_hub}" if args.push_to_hub else ""))


if __name__ == "__main__":
    main()
