"""Why RegMean lands where it does: each trained layer's Gram matrices on the data each setting gives it.

RegMean solves every linear layer from the Gram matrices G_p = X_pᵀX_p of its inputs, one per fine-tune p:
W = (Σ_p G̃_p)⁻¹ Σ_p G̃_p W_p, with G̃ = r·G + (1 − r)·diag(G) (r = ``reduce_non_diagonal_ratio``, 0.95). Two things
decide how far that is from the plain average, and how well the data pins it down:

* **rank and conditioning**: a Gram counted over fewer positions than the layer has input features is singular
  (rank ≤ positions); r < 1 keeps the solve well-posed, but the directions the data never spans are then weighed by the
  diagonal alone. Reported: positions per model, the smallest numerical rank among the models, and the condition
  number of the matrix solved (Σ_p G̃_p).
* **how much the models' Grams differ** (the spread: the mean over pairs of ‖Ĝ_p − Ĝ_q‖_F / mean ‖Ĝ‖_F, Ĝ = G / its
  positions). Equal Grams make RegMean the plain average whatever the data; one shared pool, whose lower blocks are
  shared, gives nearly equal Grams.

Grams here are each fine-tune's own forward (RegMean's; RegMean++ feeds the merged prefix) at the linear inputs of the
suite's trained blocks, on three settings: one shared pool of 128 images (the suites' pooled rows), and each
fine-tune's own task's 16 and 64 images (``data_own``), drawn as the suite draws them.

    python -m benchmarks.suites.gram_rank --seeds 0,1 --frozen 10 --steps 180 \
        --table benchmarks/results/gram_rank_180_q8_blocks2
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.suites.__main__ import default_cache, record_args

RATIO = 0.95
"""RegMean's default ``reduce_non_diagonal_ratio`` (the library's and fusion-bench's)."""
INPUTS = {"attention (q, k, v)": "attention.q_proj", "attention output": "attention.o_proj",
          "mlp fc1": "mlp.fc1", "mlp fc2": "mlp.fc2"}
"""One linear per distinct input of a DINOv2 block (query, key and value read the same input, so share one Gram)."""
RANK_TOLERANCE = 1e-10
"""An eigenvalue counts towards the numerical rank above this share of the largest (float64 Grams)."""


def own_grams(folder: Path, pixels: torch.Tensor, blocks: list[int]) -> dict[tuple[int, str], tuple[torch.Tensor, int]]:
    """(block, input) → (Σ over positions of x xᵀ in float64, positions) from the fine-tune's own forward."""
    from transformers import Dinov2Model

    model = Dinov2Model.from_pretrained(folder).eval()
    sums: dict[tuple[int, str], list] = {}
    hooks = []
    for block, (name, path) in itertools.product(blocks, INPUTS.items()):
        module = model.encoder.layer[block].get_submodule(path)

        def record(_module, args, _out, key=(block, name)):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            entry = sums.setdefault(key, [0.0, 0])
            entry[0] = entry[0] + x.T @ x
            entry[1] += x.shape[0]

        hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        for batch in pixels.split(32):
            model(pixel_values=batch)
    for hook in hooks:
        hook.remove()
    return {key: (gram, count) for key, (gram, count) in sums.items()}


def statistics(grams: list[tuple[torch.Tensor, int]]) -> dict:
    """The rank, conditioning and spread of one layer input's Grams, one per model (see the module docstring)."""
    features = grams[0][0].shape[0]
    ranks = []
    for gram, _ in grams:
        eig = torch.linalg.eigvalsh(gram)
        ranks.append(int((eig > RANK_TOLERANCE * eig.max()).sum()))
    solved = sum(RATIO * g + (1 - RATIO) * torch.diag(torch.diag(g)) for g, _ in grams)
    eig = torch.linalg.eigvalsh(solved)
    normed = [g / n for g, n in grams]
    scale = float(np.mean([float(g.norm()) for g in normed]))
    spread = [float((a - b).norm()) / scale for a, b in itertools.combinations(normed, 2)]
    return {"features": features, "positions": [n for _, n in grams], "min_rank": min(ranks),
            "condition_solved": float(eig.max() / eig.min()), "spread": float(np.mean(spread))}


def measure(bench, seed: int, own: list[int], blocks: list[int], log) -> dict:
    replicate = next(r for r in bench.replicates if r.seed == seed)
    settings = {"pooled 128": {t: bench.scoring_data(seed) for t in bench.tasks}}
    settings |= {f"own {n}/task": {t: bench.own_data(t, seed, n) for t in bench.tasks} for n in own}
    out = {}
    for label, data in settings.items():
        per_model = [own_grams(replicate.finetuned[t], data[t], blocks) for t in bench.tasks]
        out[label] = {f"block {b}: {name}": statistics([m[(b, name)] for m in per_model])
                      for b, name in itertools.product(blocks, INPUTS)}
        log(f"seed {seed}, {label}: done")
    return out


def summarise(payload: dict) -> dict:
    """The table's cells as fields (``mean``: setting → layer input → the mean over seeds of the condition number and
    the spread, the smallest rank), so that a document quoting the table can be checked against the record."""
    seeds = [str(s) for s in payload["seeds"]]
    first = payload["per_seed"][seeds[0]]
    payload["mean"] = {setting: {layer: {
        "positions": first[setting][layer]["positions"][0], "features": first[setting][layer]["features"],
        "min_rank": min(payload["per_seed"][s][setting][layer]["min_rank"] for s in seeds),
        "condition_solved": float(np.mean([payload["per_seed"][s][setting][layer]["condition_solved"] for s in seeds])),
        "spread": float(np.mean([payload["per_seed"][s][setting][layer]["spread"] for s in seeds]))}
        for layer in first[setting]} for setting in first}
    return payload


def render(payload: dict) -> str:
    seeds = payload["seeds"]
    header = (f"Command: `{payload['command']}`. {payload['machine']}. Image suite (DINOv2-S at 98 px, "
              f"{payload['steps']} fine-tuning steps, {payload['trained_blocks']} trained blocks, 8 tasks), seeds "
              f"{seeds}; each fine-tune's own forward; r = {RATIO}. Per cell: positions per model, smallest numerical "
              "rank among the 8 models / input features, condition number of Σ_p G̃_p (the matrix solved), spread of "
              "the models' Grams (mean over pairs of ‖Ĝ_p − Ĝ_q‖_F / mean ‖Ĝ‖_F); the mean over seeds, rank the "
              "smallest.")
    lines = ["# RegMean's Gram matrices on each setting's data: rank, conditioning, spread", "", header, ""]
    settings = list(payload["per_seed"][str(seeds[0])])
    lines += ["| layer input | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for layer in payload["per_seed"][str(seeds[0])][settings[0]]:
        cells = []
        for setting in settings:
            rows = [payload["per_seed"][str(s)][setting][layer] for s in seeds]
            cells.append(f"{rows[0]['positions'][0]} pos, rank {min(r['min_rank'] for r in rows)}/"
                         f"{rows[0]['features']}, cond {np.mean([r['condition_solved'] for r in rows]):.3g}, "
                         f"spread {np.mean([r['spread'] for r in rows]):.3f}")
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    from benchmarks.suites.real import RealConfig, build_real_suite
    from benchmarks.suites.training import Log, torch_threads

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--frozen", type=int, default=10)
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--wise", type=float, default=1.0)
    parser.add_argument("--own", default="16,64", help="images per task of each fine-tune's own data")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None, help="write TABLE.md and TABLE.json")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    cfg = dataclasses.replace(RealConfig(), seeds=tuple(seeds), frozen=args.frozen, ft_steps=args.steps,
                              wise=args.wise)
    log = Log(True, "gram_rank")
    start, load = time.perf_counter(), os.getloadavg()
    with torch_threads(args.threads):
        bench = build_real_suite(cfg, args.cache or default_cache(), log)
        blocks = list(range(cfg.frozen, cfg.num_layers))
        per_seed = {str(s): measure(bench, s, [int(n) for n in args.own.split(",")], blocks, log) for s in seeds}
    command = "python -m benchmarks.suites.gram_rank " + " ".join(record_args(argv if argv is not None
                                                                               else sys.argv[1:], ("--cache",
                                                                                                   "--table")))
    machine = (f"{os.cpu_count()} CPU cores, {args.threads} torch threads, torch {torch.__version__}, load average "
               f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, {time.perf_counter() - start:.0f} s")
    payload = {"command": command, "machine": machine, "seeds": seeds, "steps": cfg.ft_steps,
               "trained_blocks": len(blocks), "wise": cfg.wise, "ratio": RATIO, "per_seed": per_seed}
    text = render(summarise(payload))
    print(text)
    if args.table:
        args.table.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
        args.table.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
