"""Parity of mergekit's recipe methods: ``mergekit-yaml`` and hf_mloss run the same YAML on the same checkpoints.

For each recipe (slerp, model_stock, breadcrumbs, breadcrumbs_ties, della/della_linear at density 1, and recipes whose
parameters are gradients or filter lists) the table gives the largest absolute difference between the two merged
state dicts (float32) and both wall times. DELLA's masks cannot be reproduced draw for draw (mergekit draws from the
global torch generator in its processing order); its rows compare, per keep-probability bin, the rate at which each
library kept the entries of a one-model ``della_linear`` merge with the probability the rank rule gives.

Usage::

    HF_MLOSS_PEER_ENVS=~/.cache/hf_mloss/peer-envs python benchmarks/peers/recipe_parity.py [--out benchmarks/results]
"""

from __future__ import annotations

import hf_mloss

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.peers.run_peer import run_peer_merge
from hf_mloss import MergeConfig
from examples.tiny import make_tiny_setup

WEIGHTS = [1.0, 0.5, 2.0]
RECIPES = [
    ("slerp", {"parameters": {"t": 0.3}}),
    ("model_stock", {"parameters": {}}),
    ("model_stock", {"parameters": {"filter_wise": True}}),
    ("breadcrumbs", {"k": 0.5, "lam": 0.7, "weights": WEIGHTS, "parameters": {"gamma": 0.05}}),
    ("breadcrumbs", {"k": 0.3, "weights": WEIGHTS, "parameters": {"gamma": 0.2, "normalize": True, "rescale": True}}),
    ("breadcrumbs_ties", {"k": 0.5, "lam": 0.7, "weights": WEIGHTS, "parameters": {"gamma": 0.05}}),
    ("della", {"k": 1.0, "lam": 0.7, "weights": WEIGHTS}),
    ("della_linear", {"k": 1.0, "lam": 0.7, "weights": WEIGHTS}),
    ("slerp", {"parameters": {"t": [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
                                    {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]}, {"value": 0.5}]}}),
    ("ties", {"k": [0.1, 0.5, 0.9], "lam": [{"filter": "mlp", "value": 0.6}, {"value": [1.0, 0.8]}],
              "weights": WEIGHTS}),
    ("breadcrumbs_ties", {"k": [{"filter": "self_attn", "value": [0.3, 0.9]}, {"value": 0.6}], "weights": WEIGHTS,
                          "parameters": {"gamma": [0.0, 0.1], "normalize": True}}),
    ("della", {"k": 1.0, "lam": [0.5, 1.5], "weights": WEIGHTS}),
]


def max_diff(ours: dict[str, torch.Tensor], peer_file: Path) -> float:
    theirs = {k.removeprefix("vision_model."): v for k, v in load_file(str(peer_file)).items()}
    return max(float((v - theirs[k].float()).abs().max()) for k, v in ours.items())


def della_keep_rates(state, base_sd, tau_sd, k: float, e: float) -> list[dict]:
    probs, kept = [], []
    for name, tau in tau_sd.items():
        t, base, merged = tau.double().numpy(), base_sd[name].double().numpy(), state[name].double().numpy()
        rows = t if t.ndim >= 2 else t[None]
        n = rows.shape[1]
        ranks = np.argsort(np.argsort(np.abs(rows), axis=1, kind="stable"), axis=1, kind="stable")
        p = (k - e) + 2 * e * ranks / (n - 1) if n > 1 else np.full(rows.shape, k)
        clear = np.abs(t) > 1e-6
        probs.append(p.reshape(t.shape)[clear])
        kept.append((np.abs(merged - (base + t)) < np.abs(merged - base))[clear])
    probs, kept = np.concatenate(probs), np.concatenate(kept)
    bins = np.clip(np.digitize(probs, np.linspace(k - e, k + e, 6)[1:-1]), 0, 4)
    return [{"p": float(probs[bins == b].mean()), "kept": float(kept[bins == b].mean()), "n": int((bins == b).sum())}
            for b in range(5)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    rows, della = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        base, models = make_tiny_setup(Path(tmp) / "tiny", q=3, seed=1, num_hidden_layers=4)
        base, models = str(base), [str(m) for m in models]
        for i, (method, kwargs) in enumerate(RECIPES):
            run = run_peer_merge("mergekit", method, base, models[:1] if method == "slerp" else models,
                                 Path(tmp) / f"run{i}", **kwargs)
            start = time.perf_counter()
            result = hf_mloss.run(MergeConfig.from_yaml(run.out_dir / "peer_config.yml"), progress=False)
            ours_s = time.perf_counter() - start
            state = {k: v for k, v in result.model.state_dict().items() if v.is_floating_point()}
            recipe = {key: value for key, value in kwargs.items() if key != "weights"}
            rows.append({"method": method, "recipe": recipe, "max_abs_diff": max_diff(state, run.model_path),
                         "mergekit_s": run.wall_s, "hf_mloss_s": round(ours_s, 3)})
            print(rows[-1], flush=True)
        k, e = 0.5, 0.2
        run = run_peer_merge("mergekit", "della_linear", base, models[:1], Path(tmp) / "della", k=k, weights=[1.0],
                             parameters={"epsilon": e, "rescale": False}, seed=0)
        ours = hf_mloss.run(MergeConfig.from_yaml(run.out_dir / "peer_config.yml"), progress=False).model.state_dict()
        ours = {k_: v for k_, v in ours.items() if v.is_floating_point()}
        theirs = {k_.removeprefix("vision_model."): v.float() for k_, v in load_file(str(run.model_path)).items()}
        base_sd, model_sd = load_file(f"{base}/model.safetensors"), load_file(f"{models[0]}/model.safetensors")
        tau_sd = {n: model_sd[n].float() - base_sd[n].float() for n in ours}
        della = {"k": k, "e": e, "mergekit": della_keep_rates(theirs, base_sd, tau_sd, k, e),
                 "hf_mloss": della_keep_rates(ours, base_sd, tau_sd, k, e)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recipe_parity_cpu.json").write_text(json.dumps({"recipes": rows, "della_keep_rates": della},
                                                               indent=2) + "\n")
    note = ("mergekit 0.1.5 (`mergekit-yaml`, a child process: its time includes interpreter start and imports) and "
            "hf_mloss (`hf_mloss.run(MergeConfig.from_yaml(...))` in process, inputs opened and merged) on the same YAML. "
            "The recipe column omits the weights (1, 0.5, 2 where the method takes weights).")
    lines = ["# mergekit recipe parity (tiny CLIP towers, 4 blocks, float32, CPU)", "", note, "",
             "| method | recipe | max abs diff | mergekit s | hf_mloss s |", "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | `{json.dumps(r['recipe'])}` | {r['max_abs_diff']:.3g} | {r['mergekit_s']} | "
              f"{r['hf_mloss_s']} |" for r in rows]
    lines += ["", f"DELLA keep rates (one model, k = {k}, e = {e}; entries binned by their keep probability):", "",
              "| mean p | mergekit kept | hf_mloss kept | entries |", "|---|---|---|---|"]
    lines += [f"| {a['p']:.3f} | {a['kept']:.3f} | {b['kept']:.3f} | {a['n']} |"
              for a, b in zip(della["mergekit"], della["hf_mloss"])]
    (args.out / "recipe_parity_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
