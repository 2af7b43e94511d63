"""``python -m hf_mloss.suites tiny``: build (or load) the offline tiny suite, compare every method, write results.

Prints the regime rows (pretrained heads, fine-tuned, ensemble) and one row per method with hyperparameters chosen
on validation and test accuracy as mean ± std over seeds; writes ``results.md`` / ``results.json`` and the M-TIES
merge (with its evaluation results in the model card) as a Hub-ready folder under ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .compare import MethodSpec, compare_methods, default_specs


def smoke_specs(num_layers: int) -> list[MethodSpec]:
    """One setting per method: checks the pipeline (CI), not the numbers."""
    specs = default_specs(num_layers)
    for spec in specs:
        spec.grid = {key: values[:1] for key, values in spec.grid.items()}
    return specs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_mloss.suites", description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=["tiny"], help="which suite to run")
    parser.add_argument("--out", default="hf_mloss_tiny_suite", help="folder for results and the M-TIES merge")
    parser.add_argument("--cache", default=None, help="artifact cache (default: under the HF cache)")
    parser.add_argument("--fast", action="store_true", help="a few training steps and one setting per method (smoke)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the scoring sample / DARE / random ranks")
    parser.add_argument("--num-samples", type=int, default=128, help="unlabeled images for M-Loss")
    args = parser.parse_args(argv)

    from .tiny import build_tiny_suite

    start = time.perf_counter()
    suite = build_tiny_suite(args.cache, fast=args.fast)
    built = time.perf_counter() - start
    print(f"Suite ready in {built:.0f} s: {len(suite.finetuned)} fine-tuned CLIP vision towers, tasks "
          f"{', '.join(suite.finetuned)}")
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(suite.base_dir).num_hidden_layers
    specs = smoke_specs(layers) if args.fast else default_specs(layers)
    out = Path(args.out)
    compare_methods(suite, specs=specs, seeds=tuple(range(args.seeds)), num_samples=args.num_samples, out_dir=out)
    print()
    print((out / "results.md").read_text())
    print(f"Total {time.perf_counter() - start:.0f} s. Results: {out / 'results.md'}, {out / 'results.json'}; "
          f"M-TIES merge (Hub-ready): {out / 'm_ties_merge'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
