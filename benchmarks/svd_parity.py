#!/usr/bin/env python
"""SVD merges (TSV-M, Iso-C, Iso-CTS): hf_mloss and fusion-bench against a float64 reference, on the same inputs.

Both libraries compute in float32. The reference is the same algorithm evaluated in float64 on the float32 inputs
(hf_mloss's per-tensor method code called on float64 tensors: every step of it, SVDs included, runs in the input's
dtype). For each merged tensor the deviation is ``max |x − ref| / max |ref − θ₀|`` (relative to the size of the merged
change); the table reports, per method and library, the largest and the median deviation over the matrices, and the
largest difference between the two libraries. The inputs are seeded tiny CLIP vision towers (``--hidden``,
``--layers``, ``--q`` fine-tunes of task-vector scale 1e-2).

Usage::

    HF_MLOSS_PEER_ENVS=... python benchmarks/svd_parity.py                     # hidden 64, 2 layers, 3 tasks
    python benchmarks/svd_parity.py --hidden 128 --tag h128

Writes ``benchmarks/results/svd_parity[_TAG].json`` and ``.md``. Needs the fusion-bench environment
(``python benchmarks/peers/setup_envs.py fusion_bench``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = {"tsv_m": {}, "iso_c": {}, "iso_cts": {"common_space_fraction": 0.8}}
LAM = 1.0


def _state(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return {k.removeprefix("vision_model."): v for k, v in state.items()}


def reference(method: str, base: dict, models: list[dict], params: dict) -> dict[str, torch.Tensor]:
    """The method evaluated per tensor in float64 (weights 1, as fusion-bench has none)."""
    from hf_mloss.methods import MergeContext, get_method

    m = get_method(method)
    ctx = MergeContext(params=m.make_params(lam=LAM, **params), weights=torch.ones(len(models), dtype=torch.float64))
    out = {}
    for name, theta0 in base.items():
        if not theta0.is_floating_point():
            continue
        sources = [s[name].double() for s in models]
        out[name] = m.merge_tensor(name, theta0.double(), sources, ctx)
    return out


def deviations(merged: dict, ref: dict, base: dict) -> dict[str, float]:
    out = {}
    for name, r in ref.items():
        if r.dim() != 2:
            continue  # matrices only: the rest is the mean task vector in every library
        scale = float((r - base[name].double()).abs().max())
        if scale == 0:
            continue
        out[name] = float((merged[name].double() - r).abs().max()) / scale
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--q", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)

    import hf_mloss
    from benchmarks.peers import run_peer
    from examples.tiny import make_tiny_setup

    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="svd_parity_") as tmp:
        base_dir, model_dirs = make_tiny_setup(Path(tmp) / "models", q=args.q, seed=args.seed,
                                               hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                               num_hidden_layers=args.layers)
        base = _state(base_dir)
        models = [_state(d) for d in model_dirs]
        for method, params in METHODS.items():
            ours = {k: v for k, v in hf_mloss.merge(str(base_dir), [str(d) for d in model_dirs], method, lam=LAM,
                                                    progress=False, **params).model.state_dict().items()}
            peer = run_peer.run_peer_merge("fusion_bench", method, base_dir, model_dirs, Path(tmp) / method, lam=LAM,
                                           **params)
            theirs = _state(peer.out_dir)
            ref = reference(method, base, models, params)
            dev_ours, dev_theirs = deviations(ours, ref, base), deviations(theirs, ref, base)
            between = max(float((ours[k].double() - theirs[k].double()).abs().max()) for k in dev_ours)
            closer = sum(dev_ours[k] < dev_theirs[k] for k in dev_ours)
            rows.append({"method": method, "matrices": len(dev_ours),
                         "hf_mloss_max": max(dev_ours.values()), "hf_mloss_median": statistics.median(
                             dev_ours.values()),
                         "fusion_bench_max": max(dev_theirs.values()), "fusion_bench_median": statistics.median(
                             dev_theirs.values()),
                         "hf_mloss_closer_on": closer, "max_abs_between": between})
    record = {"command": " ".join(["python", "benchmarks/svd_parity.py", *sys.argv[1:]]), "args": vars(args),
              "rows": rows, "machine": platform.platform(), "torch": torch.__version__,
              "wall_s": round(time.time() - started, 1)}
    suffix = f"_{args.tag}" if args.tag else ""
    out = ROOT / "benchmarks" / "results" / f"svd_parity{suffix}"
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"# SVD merges against a float64 reference (hidden {args.hidden}, {args.layers} layers, q = {args.q})",
             "", f"Command: `{record['command']}`", "",
             "Deviation of a matrix: max |x − ref| / max |ref − θ₀|. Both libraries compute in float32.", "",
             ("| method | matrices | hf_mloss max | hf_mloss median | fusion-bench max | fusion-bench median | "
              "hf_mloss closer on | max abs(hf_mloss − fusion-bench) |"), "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['matrices']} | {r['hf_mloss_max']:.2e} | {r['hf_mloss_median']:.2e} | "
                     f"{r['fusion_bench_max']:.2e} | {r['fusion_bench_median']:.2e} | "
                     f"{r['hf_mloss_closer_on']}/{r['matrices']} | {r['max_abs_between']:.2e} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
