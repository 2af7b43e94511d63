#!/usr/bin/env python
"""Learned-merge cost: seconds per training step and peak memory, against one forward pass of the q models.

What it does, in ONE invocation:

1. Creates (or reuses from ``benchmarks/.cache/learned_speed``) a seeded random-init ``CLIPVisionModel`` (default: a
   ViT-B/32-shaped tower cut to ``--layers`` blocks: hidden 768, MLP 3072, 224 px, patch 32, 50 tokens) and ``q``
   perturbed fine-tunes, saved with ``save_pretrained``.
2. Runs each job in its own child process (peak RSS is per job):
   * ``forward``: the q fine-tunes loaded, one forward each on a batch of ``--batch`` images (no gradient; the median
     of 3 repeats after a warm-up): the reference cost.
   * ``<method>:<objective>`` (``--jobs``; default the three ``adamerging`` objectives):
     ``hf_mloss.merge(..., method, objective=..., steps=--steps)`` on the same images (``adamerging``,
     ``adarank_tsv``, ``adarank_iso``...); seconds per step as the method measures it (functional merge, forward,
     backward, Adam), and the whole merge's wall time (AdaRank's: its SVDs included).
3. Prints a table and writes ``benchmarks/results/learned_speed_<tag>.json`` (and ``.md``) with the load average
   before each job and the command.

Usage::

    python benchmarks/learned_speed.py --tag cpu                       # defaults below
    python benchmarks/learned_speed.py --layers 12 --q 8 --tag b32_cpu  # the full ViT-B/32 shape (needs ~6 GB)
    python benchmarks/learned_speed.py --layers 12 --q 8 --device cuda --tag b32_cuda  # on a GPU
    python benchmarks/learned_speed.py --tag adarank_cpu --jobs adamerging:output_gap adarank_tsv:output_gap \
        adarank_iso:output_gap

Internal: ``python benchmarks/learned_speed.py --child JOB ...`` runs one job (used by the parent).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CACHE = HERE / ".cache" / "learned_speed"
OBJECTIVES = ("output_gap", "mloss", "entropy")


def build(folder: Path, layers: int, q: int) -> tuple[Path, list[Path]]:
    sys.path.insert(0, str(HERE.parent))
    from examples.tiny import make_base, make_finetune, save_model

    base_dir = folder / "base"
    models = [folder / f"ft{i}" for i in range(q)]
    if (base_dir / "config.json").is_file() and all((m / "config.json").is_file() for m in models):
        return base_dir, models
    base = make_base(0, hidden_size=768, intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=12,
                     image_size=224, patch_size=32)
    save_model(base, base_dir)
    for i, folder_i in enumerate(models):
        save_model(make_finetune(base, i), folder_i)
    return base_dir, models


def peak_rss_mb() -> float:
    """This process's peak RSS: the larger of ru_maxrss and /proc VmHWM (they agree when the parent stayed small)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return max(peak, int(line.split()[1]) / 1024)
    except OSError:
        pass
    return peak


def child(job: str, folder: Path, q: int, batch: int, steps: int, layers: int, device: str = "cpu") -> dict:
    import torch

    sys.path.insert(0, str(HERE.parent))
    if job == "build":
        build(folder, layers, q)
        return {"job": job, "threads": torch.get_num_threads()}
    base_dir, models = folder / "base", [folder / f"ft{i}" for i in range(q)]
    pixels = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    if job == "forward":
        from transformers import CLIPVisionModel

        experts = [CLIPVisionModel.from_pretrained(m).eval().to(device) for m in models]
        pixels = pixels.to(device)
        with torch.no_grad():
            for e in experts:  # warm-up
                e(pixel_values=pixels)
            times = []
            for _ in range(3):
                _sync(device)
                start = time.perf_counter()
                for e in experts:
                    e(pixel_values=pixels)
                _sync(device)
                times.append(time.perf_counter() - start)
        cuda = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None
        return {"job": job, "seconds": sorted(times)[1], "repeats_s": times, "peak_rss_mb": peak_rss_mb(),
                "peak_cuda_mb": cuda, "gpu": torch.cuda.get_device_name(0) if cuda is not None else None}
    import hf_mloss
    from hf_mloss.merging import learned

    seen = []
    original = learned._learn

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out[1])
        return out

    learned._learn = spy
    method, objective = job.split(":")
    heads = None
    if objective == "entropy":
        torch.manual_seed(0)
        heads = [torch.nn.Linear(768, 10).requires_grad_(False) for _ in models]
    start = time.perf_counter()
    hf_mloss.merge(str(base_dir), [str(m) for m in models], method, data=pixels, objective=objective,
                   heads=heads, steps=steps, batch_size=batch, max_samples=batch, progress=False, device=device)
    wall = time.perf_counter() - start
    record = seen[0]
    return {"job": job, "seconds_per_step": record.seconds_per_step, "merge_wall_s": wall, "steps": record.steps,
            "peak_rss_mb": record.peak_rss_mb, "peak_cuda_mb": record.peak_cuda_mb, "objective_first": record.first,
            "objective_last": record.last}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_child(job: str, args: argparse.Namespace, folder: Path) -> dict:
    load = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "--child", job, "--folder", str(folder), "--q", str(args.q), "--batch",
           str(args.batch), "--steps", str(args.steps), "--layers", str(args.layers), "--device", args.device]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise SystemExit(f"{job} failed:\n{proc.stderr[-3000:]}")
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    record["load_average_before"] = round(load, 2)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--q", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--jobs", nargs="+", default=[f"adamerging:{o}" for o in OBJECTIVES],
                        help="learned jobs, METHOD:OBJECTIVE")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--child")
    parser.add_argument("--folder", type=Path)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.folder, args.q, args.batch, args.steps, args.layers, args.device)))
        return
    # The parent never imports torch nor holds a model: a child's ru_maxrss starts at its parent's peak RSS.
    folder = CACHE / f"b32-{args.layers}L-q{args.q}"
    threads = run_child("build", args, folder)["threads"]
    rows = [run_child("forward", args, folder)] + [run_child(job, args, folder) for job in args.jobs]
    forward, cuda = rows[0]["seconds"], args.device.startswith("cuda")
    where = f"{args.device} ({rows[0].get('gpu')})" if cuda else "CPU"
    lines = [(f"Learned merges on a ViT-B/32-shaped CLIP vision tower cut to {args.layers} blocks, q={args.q}, "
              f"batch {args.batch}, {args.steps} steps, {threads} threads, {where}"), "",
             "| job | s per step | × one forward of the q models | peak RSS (MB) | load avg before |"
             + (" peak CUDA (MB) |" if cuda else ""), "|---|---|---|---|---|" + ("---|" if cuda else "")]
    for i, row in enumerate(rows):
        seconds = row["seconds"] if i == 0 else row["seconds_per_step"]
        name = "forward of the q models (no grad)" if i == 0 else row["job"]
        lines.append(f"| {name} | {seconds:.3f} | {seconds / forward:.2f} | {row['peak_rss_mb']:.0f} | "
                     f"{row['load_average_before']} |" + (f" {row['peak_cuda_mb']:.0f} |" if cuda else ""))
    table = "\n".join(lines)
    print(table)
    report = {"command": "python benchmarks/learned_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "layers": args.layers, "q": args.q, "batch": args.batch, "steps": args.steps,
              "threads": threads, "device": args.device, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"learned_speed_{args.tag}.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / f"learned_speed_{args.tag}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
