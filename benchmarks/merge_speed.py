#!/usr/bin/env python
"""Merge-speed benchmark: hf_mloss vs mergekit / fusion-bench on q ViT-shaped random fine-tunes, in ONE invocation.

What it does (every timed run is its own child process, so wall time, CPU time and peak RSS are per run):

1. Creates, or reuses from the cache, a seeded random-init CLIP vision tower and q "fine-tunes". Each fine-tune is
   the base plus a task vector: per tensor, ``1e-3 * s * randn`` with a log-uniform scale ``s`` in [0.3, 3].
   They are saved with ``save_pretrained`` (fp32 safetensors) plus a ``CLIPImageProcessorPil`` config. Also
   creates ``--num-samples`` random images as a preprocessed ``[N, 3, H, W]`` tensor (uniform RGB, CLIP mean/std);
   decoder shapes: random token sequences instead (see below).
2. Runs the selected runs ``--repeats`` times (default 3), all in this invocation, one repeat after the other:
   * ``forward``: plain fp32 ``CLIPVisionModel`` forward passes of the base over the images, under
     ``torch.inference_mode``, alternating torch's default thread count and one thread. F is the fastest pass.
   * ``score`` / ``score_bf16`` / ``score_own``: ``hf_mloss.score`` with ``prefix="base"`` in fp32 / bf16, and
     ``prefix="own"`` (the reference for the compatibility report). The floor of the base-prefix scorer is
     (1 + q·share)·F, share = the multiply-adds of one source's scored projection(s) over a block's (1/3 for CLIP's
     fc1; 2·d·f over the block for a gated decoder, whose gap needs gate and up: 0.585 for Qwen2.5-0.5B). The
     own scorer and ``compatibility`` run q own forwards: their floor is q·F (``*_vs_own_floor``).
   * hf_mloss merges (``ties_tensor``, ``ties_tensor_mk``, ``ties_global``, ``dare``, ``task_arithmetic``,
     ``m_ties``, ``m_ties_bf16``; the SVD-based ``tsv_m``, ``iso_c``, ``iso_cts`` only when named in ``--methods``),
     label-free selection (``select_m_ties``: M-TIES over a 3 × 3 (k, λ) grid) and the
     pairwise compatibility report (``compatibility``). Each merge is ``hf_mloss.merge(...)`` then
     ``save_pretrained``.
   * ``regmean_own`` / ``regmean_plusplus_own`` (only when named): RegMean / RegMean++ with each fine-tune given its
     own share of the same images (N / q each, ``models=[{"model": ..., "data": ...}]``), beside the pooled runs
     where every model reads all N (``regmean_plusplus_own_vs_pooled``).
   * ``wudi``, ``cart``, ``tsv_m_svc``, ``task_arithmetic_svc`` (only when named): WUDI, CART, and TSV-M and task
     arithmetic calibrated by Singular Value Calibration, each against TSV-M or the merge it calibrates.
   * ``wudi_floor`` (only when named): exact WUDI's floor here, its 400 τ·G products per matrix alone, beside the
     same steps in the literal autograd form (fusion-bench's), extrapolated from one step per shape.
   * ``svc_floor`` (only when named): SVC's floor here, the float64 factorisation it cannot skip per matrix (the
     merged task matrix's Gram on its smaller side and that Gram's eigenvectors), beside the merge it calibrates.
   * ``svd_floor`` (only when named): a floor for exact TSV-M here, the q + 2 symmetric eigenvalue solves
     per matrix alone (``torch.linalg.eigvalsh``, float32 and float64, default threads and one), beside
     mergekit's TIES wall (``svd_floor_vs_mergekit_wall``), and the float64 work TSV-M's eigen route cannot skip
     (``algorithm_floor_s``: q Grams, the eigenvectors, the polar factors applied).
   * peers, through ``benchmarks/peers/run_peer.py``: ``mergekit-yaml`` TIES on all q tasks, and fusion-bench TIES
     on ``--fusion-bench-tasks`` tasks (default 4: 8 tasks need about 25 GB).
3. Writes ``benchmarks/results/merge_speed_<tag>.json`` and ``.md``: every repeat's table and ratios (each with its
   numerator and denominator), how many repeats meet each target, the CPU (model, flags), the load and the CPU that
   other processes used during each run, output parity with the peers and the exact command.

Examples::

    python benchmarks/merge_speed.py --shape tiny --repeats 1         # ~1-minute smoke run (peers included)
    python benchmarks/merge_speed.py --methods forward,score,ties_tensor,m_ties --peers mergekit   # the targets
    python benchmarks/merge_speed.py --shape l14 --layers 1 --skip-peers --methods forward,score,m_ties
    python benchmarks/merge_speed.py --methods ties_tensor,task_arithmetic,tsv_m,iso_c,iso_cts --peers mergekit \
        --repeats 1 --tag svd                                            # the SVD-based merges beside TIES
    python benchmarks/merge_speed.py --methods tsv_m,svd_floor --peers mergekit --repeats 2   # TSV-M and its floor
    python benchmarks/merge_speed.py --methods tsv_m,task_arithmetic,wudi,cart,tsv_m_svc,task_arithmetic_svc \
        --skip-peers --repeats 1 --tag sota                       # WUDI, CART and SVC beside TSV-M (issue 71)
    python benchmarks/merge_speed.py --shape qwen2.5-0.5b --q 4 --methods ties_tensor,ties_tensor_mk --peers mergekit

Decoder shapes (``qwen2.5-0.5b``, ``qwen-tiny``) build a random ``Qwen2ForCausalLM`` in bf16 (tied embeddings) and
its fine-tunes the same way; mergekit writes bf16 too. Their data is ``--num-samples`` random token sequences of
``--seq-len`` tokens (uniform ids, full attention mask), and ``forward`` is the bare decoder (``AutoModel``: the
blocks the scorer walks, no ``lm_head``) in fp32, so the score floor is measured as for images::

    python benchmarks/merge_speed.py --shape qwen2.5-0.5b --q 4 --num-samples 64 \
        --methods forward,score,score_own,compatibility,ties_tensor --peers mergekit

Internal: ``python benchmarks/merge_speed.py --child SPEC.json`` runs one timed job (used by the parent).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_CACHE = HERE / ".cache" / "merge_speed"
DEFAULT_RESULTS = HERE / "results"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from merge_speed_report import REFERENCE_SUFFIX, render_markdown, summarize_repeats  # noqa: E402

SHAPES: dict[str, dict] = {
    # CLIPVisionConfig defaults = ViT-B/32 (87.46 M parameters, 350 MB fp32).
    "b32": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                patch_size=32, image_size=224),
    # ViT-L/14 vision tower (303.2 M parameters, 1.21 GB fp32).
    "l14": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                patch_size=14, image_size=224),
    # Smoke-test size.
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 patch_size=16, image_size=64),
    # Decoder LLMs (data-free merges only; bf16 checkpoints, as published). Qwen2.5-0.5B: 494 M parameters (tied
    # embeddings), 0.99 GB in bf16.
    "qwen2.5-0.5b": dict(family="qwen2", dtype="bfloat16", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True),
    # Qwen2.5-1.5B: 1.54 B parameters (tied embeddings), 3.09 GB in bf16, 6.2 GB in float32: q + 1 = 5 float32 copies
    # (~31 GB) do not fit this benchmark's 24 GB machine. Its checkpoints are written tensor by tensor (``stream``).
    "qwen2.5-1.5b": dict(family="qwen2", dtype="bfloat16", stream=True, vocab_size=151936, hidden_size=1536,
                         intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True),
    "qwen-tiny": dict(family="qwen2", dtype="bfloat16", vocab_size=512, hidden_size=64, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True),
    # Llama-2-7B: 6.74 B parameters (untied lm_head), 13.5 GB in bf16, 27 GB in float32: the model alone does not fit
    # this benchmark's 24 GB machine in float32. Written shard by shard (``shard_bytes``: HF's 5 GB shards), one
    # tensor in memory at a time; ``--layers`` cuts it to its first blocks (the same tensors: each is seeded by its
    # name), for the depth comparisons.
    "llama2-7b": dict(family="llama", dtype="bfloat16", stream=True, shard_bytes=5_000_000_000, vocab_size=32000,
                      hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                      tie_word_embeddings=False),
    # The same path on a smoke-test size (several shards of a few hundred kB).
    "llama-tiny": dict(family="llama", dtype="bfloat16", stream=True, shard_bytes=400_000, vocab_size=512,
                       hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),
}
SHAPE_META = ("family", "dtype", "stream", "shard_bytes")
"""Keys of a shape that describe how it is built, not its config."""


def is_decoder(shape: str) -> bool:
    return "family" in SHAPES[shape]
TV_STD = 1e-3
TV_SPREAD = (0.3, 3.0)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
GEN_VERSION = 1  # bump when the way models / images are generated changes (invalidates the cache)

K = 0.2  # TIES keep fraction (mergekit density 0.2, fusion-bench threshold 20)
SELECT_GRID = {"k": [0.2, 0.5, 0.8], "lam": [0.5, 1.0, 1.5]}
HF_RUNS: dict[str, tuple[str, dict]] = {
    # name: (hf_mloss method, parameters)
    "ties_tensor": ("ties", dict(k=K, lam=1.0, scope="tensor")),  # per tensor (threshold selection), for speed
    "ties_tensor_mk": ("ties", dict(k=K, lam=1.0, convention="mergekit")),  # mergekit's exact-k rule, for parity
    "ties_global": ("ties", dict(k=K, lam=1.0, scope="global")),  # hf_mloss default (global, exact two-pass)
    "dare": ("dare", dict(p=0.7, lam=1.0)),  # DARE-TIES, 1/p rescale
    "task_arithmetic": ("task_arithmetic", dict(lam=0.3)),
    "m_ties": ("m_ties", dict(k=K, e=0.1, lam=1.0)),  # prefix="merged", on the shape's data
    "m_ties_bf16": ("m_ties", dict(k=K, e=0.1, lam=1.0, compute_dtype="bfloat16")),  # the same, bf16 scoring
    "select_m_ties": ("m_ties", dict(e=0.1, select="unlabeled", grid=SELECT_GRID)),  # label-free 3 x 3 selection
    "tsv_m": ("tsv_m", dict(lam=1.0)),  # per matrix: q batched SVDs + 2 polar SVDs
    "iso_c": ("iso_c", dict(lam=1.0)),  # per matrix: 1 SVD of the sum
    "iso_cts": ("iso_cts", dict(lam=1.0)),  # per matrix: 1 SVD + q batched SVDs + 2 polar SVDs
    "regmean": ("regmean", {}),  # Gram matrices of every linear's inputs, own prefix, on the shape's data
    "regmean_plusplus": ("regmean_plusplus", {}),  # the same on the merged prefix
    "regmean_own": ("regmean", {}),  # each model its own share of the same images (N / q each)
    "regmean_plusplus_own": ("regmean_plusplus", {}),  # the same on the merged prefix
    "auto": ("auto", {}),  # the label-free choice among its default candidates (output criterion, no heads)
    "auto2": ("auto", dict(candidates=["ties", "task_arithmetic"])),  # the same between two candidates
    "wudi": ("wudi", dict(lam=1.0)),  # per matrix: 400 Adam steps, one τ·G product each
    "cart": ("cart", dict(lam=1.0)),  # per matrix: q truncated SVDs (8 % of the rank) of the centred task matrices
    "tsv_m_svc": ("tsv_m", dict(lam=1.0, calibrate="svc")),  # TSV-M, then Singular Value Calibration
    "task_arithmetic_svc": ("task_arithmetic", dict(lam=0.3, calibrate="svc")),  # task arithmetic, then SVC
}
SVD_RUNS = ("tsv_m", "iso_c", "iso_cts")
SOTA_RUNS = ("wudi", "cart", "tsv_m_svc", "task_arithmetic_svc")
"""The data-free merges of issue 71, run only when named (``--methods tsv_m,task_arithmetic,wudi,cart,...``)."""
SCORE_RUNS: dict[str, dict] = {
    "score": dict(prefix="base", compute_dtype="float32"),
    "score_bf16": dict(prefix="base", compute_dtype="bfloat16"),
    "score_own": dict(prefix="own", compute_dtype="float32"),
}
DATA_METHODS = ("m_ties", "m_dare", "regmean", "regmean_plusplus", "auto")
FLOOR_RUNS = ("forward", "read", "svd_floor", "wudi_floor", "svc_floor")
"""Runs that time a lower bound (no hf_mloss call): shared by a --reference comparison, not run twice."""
ALL_RUNS = (*FLOOR_RUNS, *SCORE_RUNS, *HF_RUNS, "compatibility")
DEFAULT_RUNS = tuple(n for n in ALL_RUNS
                     if n not in ("read", "svd_floor", "wudi_floor", "svc_floor", "score_own", "compatibility",
                                  "select_m_ties",
                                  *SVD_RUNS, *SOTA_RUNS, "regmean", "regmean_plusplus", "regmean_own",
                                  "regmean_plusplus_own", "auto", "auto2"))
OWN_RUNS = ("regmean_own", "regmean_plusplus_own")
"""Runs where each fine-tune reads its own share of the images (the same N in all, N / q per model)."""
PEERS = ("mergekit", "fusion_bench")
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "avx_vnni")


# ============================================================================================ child side
def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _proc_status_mb(field: str) -> float | None:
    """``VmRSS`` / ``VmHWM`` of this process from /proc (Linux). Unlike ``ru_maxrss``, ``VmHWM`` covers only this
    process's own address space: ``ru_maxrss`` of a fork/vfork+exec child starts at the PARENT's peak RSS."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def child_main(spec_path: str) -> int:
    """Run one timed job described by SPEC.json; write its own timings to spec["result"]."""
    spec = json.loads(Path(spec_path).read_text())
    if spec["kind"] in ("setup", "parity", "agreement"):
        result = {"setup": setup_main, "parity": parity_main, "agreement": agreement_main}[spec["kind"]](spec)
        Path(spec["result"]).write_text(json.dumps(result, indent=2))
        return 0
    t0, c0 = time.perf_counter(), time.process_time()
    import torch

    import hf_mloss  # noqa: F401  (the package, then its modules below)

    for module in ("api", "merger", "scoring", "merging.driver", "engine.score"):  # imported before the timed call,
        try:  # as in a script that merges (the module names of this tree or of a --reference tree)
            importlib.import_module(f"hf_mloss.{module}")
        except ImportError:
            pass

    info: dict = {"import_s": time.perf_counter() - t0, "vmrss_after_import_mb": _proc_status_mb("VmRSS"),
                  "torch_threads": torch.get_num_threads(), "loadavg_start": os.getloadavg()}
    pixels = load_data(spec["data"], spec["num_samples"]) if spec.get("data") else None
    runner = {"forward": child_forward, "read": child_read, "svd_floor": child_svd_floor,
              "wudi_floor": child_wudi_floor, "svc_floor": child_svc_floor, "score": child_score,
              "merge": child_merge, "compatibility": child_compatibility}[spec["kind"]]
    runner(spec, pixels, info)
    if spec["device"].startswith("cuda"):
        info["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    info.update(vmhwm_mb=_proc_status_mb("VmHWM"), total_in_child_s=time.perf_counter() - t0,
                total_cpu_in_child_s=time.process_time() - c0, loadavg_end=os.getloadavg())
    Path(spec["result"]).write_text(json.dumps(info, indent=2))
    return 0


def load_data(path: str, n: int):
    """The first ``n`` samples: an image tensor ``[N, 3, H, W]``, or token ids ``{"input_ids", "attention_mask"}``."""
    import torch

    data = torch.load(path, weights_only=True)
    return {k: v[:n] for k, v in data.items()} if isinstance(data, dict) else data[:n]


def batches(data, size: int) -> list:
    """``data`` in batches of ``size`` samples, each as the forward's keyword arguments."""
    if isinstance(data, dict):
        parts = {k: v.split(size) for k, v in data.items()}
        return [{k: parts[k][i] for k in parts} for i in range(len(parts["input_ids"]))]
    return [{"pixel_values": batch} for batch in data.split(size)]


def child_forward(spec: dict, pixels, info: dict) -> None:
    """Forward passes alternating torch's default thread count and one thread; F is the fastest pass.

    On a shared machine OpenMP threads spin-wait for each other and one thread can be several times faster, so the
    floor is taken over both settings (never a slower denominator than a plain forward can reach)."""
    import torch
    from transformers import AutoModel, CLIPVisionModel

    device, default_threads = spec["device"], torch.get_num_threads()
    t1 = time.perf_counter()
    model_class = AutoModel if isinstance(pixels, dict) else CLIPVisionModel  # a decoder: its blocks, no lm_head
    model = model_class.from_pretrained(spec["base"], dtype=torch.float32).to(device).eval()
    info.update(attn_implementation=model.config._attn_implementation, load_s=time.perf_counter() - t1)
    passes = []
    with torch.inference_mode():
        for threads in [default_threads, 1] * spec.get("repeats", 2) if device == "cpu" else [default_threads] * 2:
            torch.set_num_threads(threads)
            model(**{k: v[:1].to(device) for k, v in batches(pixels, 1)[0].items()})  # warm-up (kernel selection)
            _sync(device)
            ts, cs = time.perf_counter(), time.process_time()
            for batch in batches(pixels, spec["batch_size"]):
                model(**{k: v.to(device) for k, v in batch.items()})
            _sync(device)
            passes.append({"threads": threads, "wall_s": time.perf_counter() - ts, "cpu_s": time.process_time() - cs})
    best = min(passes, key=lambda p: p["wall_s"])
    info.update(passes=passes, inner_s=best["wall_s"], inner_cpu_s=best["cpu_s"], inner_threads=best["threads"])


def child_read(spec: dict, pixels, info: dict) -> None:
    """The I/O floor: every tensor of the base and the q fine-tunes read from their safetensors files onto the
    device, as stored (no dtype conversion). Two passes; the faster counts (the second reads the page cache)."""
    from safetensors import safe_open

    folders = [spec["base"], *spec["models"]]
    files = [f for d in folders for f in sorted(Path(d).glob("*.safetensors"))]
    nbytes = sum(f.stat().st_size for f in files)
    passes = []
    for _ in range(2):
        ts, cs = time.perf_counter(), time.process_time()
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    handle.get_tensor(key).to(spec["device"])
        _sync(spec["device"])
        passes.append({"wall_s": time.perf_counter() - ts, "cpu_s": time.process_time() - cs})
    best = min(passes, key=lambda p: p["wall_s"])
    info.update(passes=passes, bytes_read=nbytes, read_gb_per_s=nbytes / best["wall_s"] / 1e9,
                inner_s=best["wall_s"], inner_cpu_s=best["cpu_s"])


def svd_floor_sizes(shapes: list[tuple[int, ...]], q: int) -> list[tuple[int, int]]:
    """``(size, count)``: the symmetric eigenproblems an exact TSV-M of q tasks solves per matrix, in order.

    Each 2-D tensor ``m × n`` (r = min(m, n), k = ⌊r/q⌋ kept per task; none where k = 0) takes q problems of size
    r (each task's Gram matrix on its smaller side) and two for the polar factors of the concatenated bases
    ``[m, q·k]`` and ``[q·k, n]`` (sizes min(m, q·k) and min(q·k, n)). An SVD route does no less work: the
    bidiagonalisation of an m × n matrix (m ≥ n) takes 4mn² − 4n³/3 flops, at least the 4n³/3 of tridiagonalising
    its n × n Gram matrix. (The two polar factors could also come from matrix iterations instead.)"""
    sizes = []
    for shape in shapes:
        if len(shape) != 2:
            continue
        m, n = shape
        k = min(m, n) // q
        if k:
            sizes += [(min(m, n), q), (min(m, q * k), 1), (min(q * k, n), 1)]
    return sizes


def child_svd_floor(spec: dict, pixels, info: dict) -> None:
    """A floor for exact TSV-M on this machine: the symmetric eigenvalue solves alone (``torch.linalg.eigvalsh``:
    the tridiagonal reduction that dominates a dense eigensolve, then the eigenvalues; no eigenvectors, no Gram
    products, no reading) of every eigenproblem :func:`svd_floor_sizes` counts in the base checkpoint's matrices,
    on random symmetric matrices of those sizes (the reduction's cost does not depend on the values). One pass per dtype (float64: what ``leading_svd`` uses
    for its accuracy; float32: the cheapest dense route) and per thread count (torch's default and one: the
    reduction is bound by memory bandwidth, and one thread can be faster); the fastest float32 pass counts."""
    import torch
    from safetensors import safe_open

    device, default_threads, q = spec["device"], torch.get_num_threads(), len(spec["models"])
    shapes = []
    for file in sorted(Path(spec["base"]).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            shapes += [tuple(handle.get_slice(key).get_shape()) for key in handle.keys()]
    sizes = svd_floor_sizes(shapes, q)
    if not sizes:
        raise ValueError(f"svd_floor: no 2-D tensor of the base keeps a component at q = {q} (TSV-M solves nothing)")
    generator = torch.Generator().manual_seed(0)
    passes = []
    for dtype in (torch.float64, torch.float32):
        stacks = {}
        for size, count in sizes:
            if (size, count) not in stacks:
                a = torch.randn(size, size, generator=generator, dtype=torch.float64)
                stacks[size, count] = (a + a.T).to(device, dtype).expand(count, size, size).contiguous()
        for threads in [default_threads, 1] if device == "cpu" else [default_threads]:
            torch.set_num_threads(threads)
            torch.linalg.eigvalsh(stacks[sizes[0]])  # warm-up
            _sync(device)
            ts, cs = time.perf_counter(), time.process_time()
            for key in sizes:
                torch.linalg.eigvalsh(stacks[key])
            _sync(device)
            passes.append({"dtype": str(dtype).removeprefix("torch."), "threads": threads,
                           "wall_s": time.perf_counter() - ts, "cpu_s": time.process_time() - cs})
    torch.set_num_threads(default_threads)
    best = min((p for p in passes if p["dtype"] == "float32"), key=lambda p: p["wall_s"])
    info.update(passes=passes, problems=sum(count for _, count in sizes), matrices=len(sizes) // 3,
                largest=max(size for size, _ in sizes), inner_s=best["wall_s"], inner_cpu_s=best["cpu_s"],
                inner_threads=best["threads"],
                float64_s=min(p["wall_s"] for p in passes if p["dtype"] == "float64"),
                **algorithm_floor([s for s in shapes if len(s) == 2], q, device, generator, default_threads))


def algorithm_floor(shapes: list[tuple[int, int]], q: int, device: str, generator, default_threads: int) -> dict:
    """The float64 work TSV-M's eigen route cannot skip, per 2-D matrix ``m × n`` that keeps a component: the q
    tasks' Gram matrices on the smaller side (``[q, m, n]`` products), the eigenvectors of those q problems (the
    kept singular vectors come from them) and of the 2 polar problems (their Grams and eigenvectors); one pass on
    torch's default threads and one on a single thread (as the eigenvalue floor), the fastest counts. TSV-M adds to
    it only reading, the rest of its products and writing."""
    import torch

    from hf_mloss.methods.svd_ops import polar_factor

    work = []
    for m, n in shapes:
        k = min(m, n) // q
        if k:
            work.append((m, n, k))
    inputs = {}
    for m, n, k in work:
        if (m, n) not in inputs:
            inputs[m, n] = (torch.randn(q, m, n, generator=generator).to(device),
                            torch.randn(m, q * k, generator=generator).to(device),
                            torch.randn(q * k, n, generator=generator).to(device))
    best = None
    for threads in [default_threads, 1] if device == "cpu" else [default_threads]:
        torch.set_num_threads(threads)
        _sync(device)
        ts, cs = time.perf_counter(), time.process_time()
        for m, n, k in work:
            taus, left, right = inputs[m, n]
            a = taus.double()
            gram = a @ a.transpose(-1, -2) if m <= n else a.transpose(-1, -2) @ a
            torch.linalg.eigh(gram)
            polar_factor(left)  # Gram + eigenvectors + inverse square root applied: what TSV-M's two polars do
            polar_factor(right)
        _sync(device)
        elapsed = (time.perf_counter() - ts, time.process_time() - cs, threads)
        best = elapsed if best is None or elapsed[0] < best[0] else best
    torch.set_num_threads(default_threads)
    return {"algorithm_floor_s": best[0], "algorithm_floor_cpu_s": best[1], "algorithm_floor_threads": best[2]}


def child_wudi_floor(spec: dict, pixels, info: dict) -> None:
    """A floor for exact WUDI here: its Adam steps' products alone. Per distinct 2-D shape ``m × n`` of the base's
    matrices, the time of one step's product τ·G (``[m, n] @ [n, n]`` float32, as :mod:`hf_mloss.methods.wudi`
    takes it: the mean of 10 after 2 warm-up steps), times the matrices of that shape and the 400 steps. Beside it,
    the same count of steps in the literal form (autograd of Σ_i ‖(τ − τ_i) τ_iᵀ‖² / ‖τ_i‖² over the q stacked task
    matrices, fusion-bench's): the mean of 2 steps after one warm-up, times the same count (``literal_s``)."""
    import torch

    device, q, steps = spec["device"], len(spec["models"]), 400
    shapes = matrix_shapes(spec["base"])
    generator = torch.Generator().manual_seed(0)
    per_shape, ours, literal = {}, 0.0, 0.0
    for (m, n), count in shapes.items():
        tau, gram = (torch.randn(size, generator=generator).to(device) for size in ((m, n), (n, n)))
        fixed = torch.randn(m, n, generator=generator).to(device)
        for timed in (False, True):  # 2 warm-up steps, then 10 timed
            _sync(device)
            ts = time.perf_counter()
            for _ in range(10 if timed else 2):
                torch.addmm(fixed, tau, gram, beta=-2, alpha=2)
            _sync(device)
        step = (time.perf_counter() - ts) / 10
        taus = torch.randn(q, m, n, generator=generator).to(device)
        norms = taus.flatten(1).norm(dim=1).square()
        point = tau.clone().requires_grad_(True)
        for timed in (False, True):  # 1 warm-up step, then 2 timed
            _sync(device)
            ts = time.perf_counter()
            for _ in range(2 if timed else 1):
                with torch.enable_grad():
                    point.grad = None
                    (((point - taus) @ taus.transpose(1, 2)).square() / norms[:, None, None]).sum().backward()
            _sync(device)
        slow = (time.perf_counter() - ts) / 2
        per_shape[f"{m}x{n}"] = {"count": count, "step_s": step, "literal_step_s": slow}
        ours, literal = ours + step * count * steps, literal + slow * count * steps
        del taus, point
    info.update(shapes=per_shape, steps=steps, inner_s=ours, inner_cpu_s=None, literal_s=literal)


def matrix_shapes(base: str) -> dict[tuple[int, int], int]:
    """The base checkpoint's 2-D tensor shapes, each with how many tensors have it."""
    from safetensors import safe_open

    shapes: dict[tuple[int, int], int] = {}
    for file in sorted(Path(base).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shape = tuple(handle.get_slice(key).get_shape())
                if len(shape) == 2:
                    shapes[shape] = shapes.get(shape, 0) + 1
    return shapes


def child_svc_floor(spec: dict, pixels, info: dict) -> None:
    """A floor for Singular Value Calibration here: per 2-D matrix ``m × n`` of the base, the float64 work it
    cannot skip, the Gram matrix of the merged task matrix on its smaller side (``r × r``, r = min(m, n)) and that
    Gram's eigenvectors (``torch.linalg.eigh``: :mod:`hf_mloss.methods.svc` needs U), on random values (the cost does
    not depend on them). Per distinct shape one warm-up, then the mean of 2, times the matrices of that shape; one
    pass on torch's default threads and one on a single thread (a dense eigensolve on busy cores can be many times
    slower on two threads than on one), the faster counts. The projections of the q task matrices and the rebuilt
    matrix come on top."""
    import torch

    device, default_threads = spec["device"], torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    deltas = {shape: (torch.randn(shape, generator=generator, dtype=torch.float64).to(device), count)
              for shape, count in matrix_shapes(spec["base"]).items()}
    passes = []
    for threads in [default_threads, 1] if device == "cpu" else [default_threads]:
        torch.set_num_threads(threads)
        per_shape, total = {}, 0.0
        for (m, n), (delta, count) in deltas.items():
            for timed in (False, True):
                _sync(device)
                ts = time.perf_counter()
                for _ in range(2 if timed else 1):
                    torch.linalg.eigh(delta @ delta.T if m <= n else delta.T @ delta)
                _sync(device)
            step = (time.perf_counter() - ts) / 2
            per_shape[f"{m}x{n}"] = {"count": count, "factorisation_s": step}
            total += step * count
        passes.append({"threads": threads, "shapes": per_shape, "total_s": total})
    torch.set_num_threads(default_threads)
    best = min(passes, key=lambda p: p["total_s"])
    info.update(passes=passes, shapes=best["shapes"], inner_s=best["total_s"], inner_cpu_s=None,
                inner_threads=best["threads"])


def child_score(spec: dict, pixels, info: dict) -> None:
    import torch

    import hf_mloss  # noqa: F401  (the package, then its modules below)

    t1, c1 = time.perf_counter(), time.process_time()
    report = hf_mloss.score(spec["base"], spec["models"], pixels, num_samples=spec["num_samples"],
                            batch_size=spec["batch_size"], prefix=spec["prefix"], device=spec["device"],
                            compute_dtype=spec["compute_dtype"], progress=False)
    _sync(spec["device"])
    info["inner_s"], info["inner_cpu_s"] = time.perf_counter() - t1, time.process_time() - c1
    torch.save({"layer": dict(report.layer), "node": {k: v.clone() for k, v in report.node.items()}}, spec["out"])


def child_merge(spec: dict, pixels, info: dict) -> None:
    import hf_mloss  # noqa: F401  (the package, then its modules below)

    extra, models = {}, spec["models"]
    if spec.get("data"):
        extra = dict(data=pixels, num_samples=spec["num_samples"], batch_size=spec["batch_size"])
    if spec.get("own"):  # each model's own share of the images: the same total, N / q per model
        shares = pixels[: spec["num_samples"]].chunk(len(models))
        models = [{"model": m, "data": share} for m, share in zip(models, shares)]
        extra = dict(num_samples=max(len(share) for share in shares), batch_size=spec["batch_size"])
    t1, c1 = time.perf_counter(), time.process_time()
    result = hf_mloss.merge(spec["base"], models, spec["method"], device=spec["device"], progress=False,
                            **extra, **spec["params"])
    _sync(spec["device"])
    info["inner_s"], info["inner_cpu_s"] = time.perf_counter() - t1, time.process_time() - c1
    info["vmhwm_after_merge_mb"] = _proc_status_mb("VmHWM")
    t2 = time.perf_counter()
    result.save_pretrained(spec["out"], overwrite=True)
    info["save_s"] = time.perf_counter() - t2


def child_compatibility(spec: dict, pixels, info: dict) -> None:
    import hf_mloss  # noqa: F401  (the package, then its modules below)

    t1, c1 = time.perf_counter(), time.process_time()
    report = hf_mloss.compatibility(spec["base"], spec["models"], pixels, num_samples=spec["num_samples"],
                                    batch_size=spec["batch_size"], device=spec["device"], progress=False)
    info["inner_s"], info["inner_cpu_s"] = time.perf_counter() - t1, time.process_time() - c1
    info["stages_s"] = dict(getattr(report, "timings", {}))  # the M-Loss walk and the task-vector baselines


# ============================================================================================ parent side
class Poller:
    """Calls :meth:`poll` every ``interval`` seconds on a daemon thread while the ``with`` block runs."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        raise NotImplementedError


class RssGuard(Poller):
    """Polls the summed RSS of every descendant process; kills the top-level child trees above ``limit_mb``."""

    def __init__(self, limit_mb: float, interval: float = 0.25) -> None:
        import psutil

        super().__init__(interval)
        self.psutil, self.limit_mb = psutil, limit_mb
        self.me = psutil.Process()
        self.killed: list[str] = []

    def _descendants_mb(self) -> float:
        total = 0
        for p in self.me.children(recursive=True):
            try:
                total += p.memory_info().rss
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                pass
        return total / 2**20

    def poll(self) -> None:
        try:
            total = self._descendants_mb()
            if total > self.limit_mb:
                self._kill_children(total)
        except Exception:  # never let the guard take the benchmark down
            pass

    def _kill_children(self, total_mb: float) -> None:
        for top in self.me.children(recursive=False):
            try:
                argv = top.cmdline()[:4]
                cmd = " ".join([Path(argv[0]).name, *argv[1:]]) if argv else str(top.pid)  # no machine folder
                os.killpg(top.pid, signal.SIGKILL)
            except (self.psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                continue
            self.killed.append(f"{cmd} (descendants' RSS {total_mb / 1024:.1f} GB > {self.limit_mb / 1024:.1f} GB)")
            print(f"[merge_speed] RSS guard killed {cmd}: {total_mb / 1024:.1f} GB", flush=True)


def cpu_times() -> tuple[int, int, int] | None:
    """(total, idle + iowait, steal) jiffies over this process's CPU set, from /proc/stat (Linux)."""
    try:
        cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        total = idle = steal = 0
        with open("/proc/stat") as handle:
            for line in handle:
                fields = line.split()
                if fields and fields[0] in cpus:
                    values = [int(v) for v in fields[1:9]]
                    total, idle, steal = total + sum(values), idle + values[3] + values[4], steal + values[7]
        return total, idle, steal
    except (OSError, AttributeError, ValueError):
        return None


def contention(before: tuple[int, int, int] | None, after: tuple[int, int, int] | None, run: dict) -> dict:
    """How busy the cores were during a run: idle cores, cores used by other processes (busy minus the run's
    own CPU time per wall second), and of those the cores a virtual machine's host took (steal)."""
    out = {"loadavg_before": run.pop("_loadavg_before"), "loadavg_after": os.getloadavg()}
    if before and after and after[0] > before[0]:
        cores = len(os.sched_getaffinity(0))
        share = cores / (after[0] - before[0])
        idle = share * (after[1] - before[1])
        own = run.get("cpu_s", 0.0) / run["wall_s"] if run.get("wall_s") else 0.0
        out.update(idle_cores=round(idle, 2), other_cores=round(max(0.0, cores - idle - own), 2),
                   steal_cores=round(share * (after[2] - before[2]), 2))
    return out


def run_child(spec: dict, work: Path, timeout: float, *, script: Path | None = None) -> dict:
    """Run one ``--child`` job of ``script`` (this one by default; it reads the spec and writes ``spec["result"]``);
    return its rusage-based wall / CPU / peak RSS plus the child's own timings."""
    name = spec["name"]
    spec_path, spec["result"] = work / f"{name}.spec.json", str(work / f"{name}.result.json")
    Path(spec["result"]).unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec, indent=2))
    log_path = work / f"{name}.log"
    cmd = [sys.executable, str(script or Path(__file__).resolve()), "--child", str(spec_path)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    if spec.get("pythonpath"):  # a --reference tree: its hf_mloss is imported instead of this one
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [spec["pythonpath"], env.get("PYTHONPATH")]))
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=str(REPO))
        memory = RssSampler(proc.pid)
        status, usage, timed_out = _wait(proc, start + timeout, memory.sample)
        wall = time.perf_counter() - start
    rc = os.waitstatus_to_exitcode(status)
    out = {"name": name, "rc": rc, "wall_s": wall, "cpu_user_s": usage.ru_utime, "cpu_sys_s": usage.ru_stime,
           "cpu_s": usage.ru_utime + usage.ru_stime,
           "max_rss_mb": usage.ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024),
           **memory.peaks(), "log": str(log_path)}
    if timed_out:
        out["error"] = f"timed out after {timeout:.0f} s"
    elif rc != 0:
        out["error"] = f"exit code {rc}; log tail: {log_path.read_text(errors='replace')[-1500:]}"
    else:
        out["child"] = json.loads(Path(spec["result"]).read_text())
    return out


class RssSampler:
    """The child's resident memory split by kind (Linux ``/proc/<pid>/status``), read at every poll of
    :func:`_wait` (every 20 ms): the peak of ``RssAnon`` (what the process allocated: tensors, buffers) and of
    ``RssFile`` (pages of mapped files, such as safetensors read through ``mmap``, which the kernel may drop and
    read again). ``ru_maxrss`` counts both at once, so a run that maps many large inputs shows a peak its own
    allocations never reach; these two peaks tell them apart. Sampled, so a spike shorter than a poll can be
    missed; absent where ``/proc`` is not there."""

    FIELDS = {"RssAnon": "peak_rss_anon_mb", "RssFile": "peak_rss_file_mb"}

    def __init__(self, pid: int) -> None:
        self.path, self.peak = Path(f"/proc/{pid}/status"), {}

    def sample(self) -> None:
        try:
            lines = self.path.read_text().splitlines()
        except (OSError, ValueError):  # gone, or not Linux
            return
        for line in lines:
            field = line.split(":", 1)[0]
            if field in self.FIELDS:
                mb = int(line.split()[1]) / 1024
                self.peak[field] = max(self.peak.get(field, 0.0), mb)

    def peaks(self) -> dict[str, float]:
        return {key: round(self.peak[field], 1) for field, key in self.FIELDS.items() if field in self.peak}


def _wait(proc: subprocess.Popen, deadline: float, poll: Callable[[], None] = lambda: None):
    """``os.wait4`` the child (its own rusage), killing its process group at ``deadline``; ``poll`` runs between
    the checks."""
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return status, usage, False
        poll()
        if time.perf_counter() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            return status, usage, True
        time.sleep(0.02)


# -------------------------------------------------------------------------------------------- fixtures
def shape_config(shape: str, layers: int | None):
    import transformers
    from transformers import CLIPVisionConfig

    cfg = {k: v for k, v in SHAPES[shape].items() if k not in SHAPE_META}
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if is_decoder(shape):
        return transformers.AutoConfig.for_model(SHAPES[shape]["family"], **cfg)
    return CLIPVisionConfig(**cfg)


def shape_model_class(shape: str):
    """The class a shape is built and saved as (a CLIP vision tower, or a causal LM)."""
    from transformers import AutoModelForCausalLM, CLIPVisionModel

    return AutoModelForCausalLM if is_decoder(shape) else CLIPVisionModel


def _model_ok(folder: Path, manifest: dict) -> bool:
    try:
        ok = json.loads((folder / "bench_manifest.json").read_text()) == manifest
    except (OSError, json.JSONDecodeError):
        return False
    needs_processor = "image_size" in manifest.get("config", {})
    return ok and bool(weight_files(folder)) and (
        not needs_processor or (folder / "preprocessor_config.json").is_file())


def _save(model, folder: Path, image_size: int | None, manifest: dict) -> None:
    from transformers import CLIPImageProcessorPil

    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, max_shard_size="50GB")  # one file, as the parity check reads it
    if image_size is not None:
        CLIPImageProcessorPil(size={"shortest_edge": image_size},
                              crop_size={"height": image_size, "width": image_size}).save_pretrained(folder)
    (folder / "bench_manifest.json").write_text(json.dumps(manifest, indent=2))


def _fill_finetune(ft, base, index: int, seed: int) -> None:
    """``ft`` ← base + per-tensor task vectors ``1e-3·s·randn`` (s log-uniform in TV_SPREAD), seeded by ``index``."""
    import torch

    gen = torch.Generator().manual_seed(10_000 + 1_000 * seed + index)
    lo, hi = math.log(TV_SPREAD[0]), math.log(TV_SPREAD[1])
    with torch.no_grad():
        src = base.state_dict()
        for key, tensor in ft.state_dict().items():
            b = src[key]
            if not b.is_floating_point():
                tensor.copy_(b)
                continue
            scale = TV_STD * math.exp(lo + (hi - lo) * float(torch.rand((), generator=gen)))
            tensor.copy_(b + scale * torch.randn(b.shape, generator=gen))


def _tensor_generator(seed: int, role: int, name: str):
    """A generator seeded by (seed, role, tensor name): every tensor of a streamed checkpoint is drawn on its own."""
    import hashlib

    import torch

    digest = int.from_bytes(hashlib.sha256(f"{seed}/{role}/{name}".encode()).digest()[:7], "little")
    return torch.Generator().manual_seed(digest)


def _stream_base_tensor(name: str, shape: tuple, dtype, std: float, seed: int):
    """One tensor of the streamed base, initialised as transformers initialises a Qwen2 model: N(0, std) for linear
    and embedding weights, ones for RMSNorm weights, zeros for biases."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    return (std * torch.randn(shape, generator=_tensor_generator(seed, -1, name))).to(dtype)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a saved model: ``model.safetensors``, or every shard its index names (empty when a
    shard is missing or the folder holds neither)."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, KeyError, json.JSONDecodeError):
        return []
    files = [folder / n for n in names]
    return files if all(f.is_file() for f in files) else []


def shard_entries(entries: list[tuple[str, tuple, object]], shard_bytes: int | None) -> list[list]:
    """``entries`` in consecutive groups of at most ``shard_bytes`` bytes (a larger tensor alone), as
    ``save_pretrained`` shards; one group when ``shard_bytes`` is None."""
    import torch

    if not shard_bytes:
        return [entries]
    groups, size = [[]], 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * torch.empty((), dtype=entry[2]).element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    return groups


def write_sharded_streamed(folder: Path, entries: list[tuple[str, tuple, object]], produce,
                           shard_bytes: int | None) -> None:
    """:func:`write_safetensors_streamed` shard by shard: ``model.safetensors``, or transformers' shard names and
    ``model.safetensors.index.json`` (the index last, so a folder with an index is complete)."""
    import torch

    groups = shard_entries(entries, shard_bytes)
    if len(groups) == 1:
        write_safetensors_streamed(folder / "model.safetensors", entries, produce)
        return
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors_streamed(folder / name, group, produce)
        weight_map.update({entry[0]: name for entry in group})
        total += sum(math.prod(e[1]) * torch.empty((), dtype=e[2]).element_size() for e in group)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_safetensors_streamed(path: Path, entries: list[tuple[str, tuple, object]], produce) -> None:
    """Write a safetensors file tensor by tensor: the header from ``entries`` (name, shape, dtype), then each
    ``produce(name)``'s bytes in order, so only one tensor is ever in memory."""
    import torch

    codes = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": codes[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape, dtype in entries:
            tensor = produce(name).to(dtype).contiguous()
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{name}: produced shape {tuple(tensor.shape)}, expected {tuple(shape)}")
            handle.write(tensor.view(torch.uint8).numpy().tobytes())
    tmp.replace(path)


def ensure_models_streamed(root: Path, config, dtype, q: int, seed: int, common: dict,
                           shard_bytes: int | None = None, donor: tuple[Path, dict] | None = None) -> list[str]:
    """The base and q fine-tunes of a large shape, each written tensor by tensor (one tensor in memory at a time;
    ``shard_bytes``: in shards of at most that size, as ``save_pretrained`` writes a large model): the base as
    transformers would initialise it, fine-tune i = base + ``1e-3·s·randn`` per tensor (s log-uniform in
    TV_SPREAD), as :func:`_fill_finetune` but drawn per tensor name, so a model cut to its first blocks
    (``--layers``) holds the same tensors as the first blocks of the whole one. ``donor``: the whole model's folder and manifest,
    whose tensors a cut model copies where that model is complete (the same values, without drawing them again)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # names and shapes only
        meta = AutoModelForCausalLM.from_config(config)
    skip = {"lm_head.weight"} if config.tie_word_embeddings else set()
    entries = [(k, tuple(v.shape), dtype) for k, v in meta.state_dict().items() if k not in skip]
    created, base_dir = [], root / "base"
    lo, hi = math.log(TV_SPREAD[0]), math.log(TV_SPREAD[1])
    for role, folder in [(-1, base_dir), *((i, root / f"ft{i}") for i in range(q))]:
        manifest = common | {"role": "base" if role < 0 else f"ft{role}", "streamed": True}
        if _model_ok(folder, manifest):
            continue
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        config.dtype = dtype  # as published (the weights' storage dtype)
        config.architectures = [type(meta).__name__]  # as save_pretrained writes it (mergekit reads it)
        config.save_pretrained(folder)
        donor_folder = donor[0] / folder.name if donor else None
        if donor_folder is not None and _model_ok(donor_folder, donor[1] | {"role": manifest["role"],
                                                                             "streamed": True}):
            handles = [safe_open(str(f), "pt") for f in weight_files(donor_folder)]
            where = {key: h for h in handles for key in h.keys()}
            write_sharded_streamed(folder, entries, lambda name: where[name].get_tensor(name), shard_bytes)
            del where, handles
        elif role < 0:
            shapes = {n: s for n, s, _ in entries}

            def produce(name):
                return _stream_base_tensor(name, shapes[name], dtype, config.initializer_range, seed)
            write_sharded_streamed(folder, entries, produce, shard_bytes)
        else:
            handles = [safe_open(str(f), "pt") for f in weight_files(base_dir)]
            where = {key: h for h in handles for key in h.keys()}

            def produce(name, role=role):
                gen = _tensor_generator(seed, role, name)
                scale = TV_STD * math.exp(lo + (hi - lo) * float(torch.rand((), generator=gen)))
                b = where[name].get_tensor(name)
                return b.float().add_(torch.randn(b.shape, generator=gen), alpha=scale)
            write_sharded_streamed(folder, entries, produce, shard_bytes)
            del where, handles
        (folder / "bench_manifest.json").write_text(json.dumps(manifest, indent=2))
        created.append(manifest["role"])
    return created


def ensure_models(cache: Path, shape: str, layers: int | None, q: int, seed: int = 0) -> tuple[Path, list[Path], dict]:
    """Create (or reuse) the base and q fine-tunes; fine-tune i depends only on (base, i), so q can grow."""
    import torch

    config = shape_config(shape, layers)
    model_class = shape_model_class(shape)
    dtype = getattr(torch, SHAPES[shape].get("dtype", "float32"))
    image_size = getattr(config, "image_size", None) if not is_decoder(shape) else None
    root = cache / "models" / (shape + (f"-{layers}L" if layers is not None else ""))
    base_dir = root / "base"
    common = {"gen_version": GEN_VERSION, "config": {k: getattr(config, k) for k in SHAPES[shape]
                                                     if k not in SHAPE_META}
              | {"num_hidden_layers": config.num_hidden_layers}, "seed": seed, "tv_std": TV_STD,
              "tv_spread": list(TV_SPREAD), "dtype": str(dtype)}
    t0, created, base, ft = time.perf_counter(), [], None, None
    if SHAPES[shape].get("stream"):
        donor = None
        if layers is not None:  # a cut model: its tensors are the whole model's first blocks, copied when it exists
            whole = {k: v for k, v in common.items()} | {"config": common["config"] | {
                "num_hidden_layers": SHAPES[shape]["num_hidden_layers"]}}
            donor = (cache / "models" / shape, whole)
        created = ensure_models_streamed(root, config, dtype, q, seed, common, SHAPES[shape].get("shard_bytes"),
                                         donor)
    elif not _model_ok(base_dir, common | {"role": "base"}):
        torch.manual_seed(seed)
        base = model_class.from_config(config).to(dtype).eval() if is_decoder(shape) else \
            model_class(config).eval()
        _save(base, base_dir, image_size, common | {"role": "base"})
        created.append("base")
    dirs = [root / f"ft{i}" for i in range(q)]
    for i, folder in enumerate(dirs):
        if SHAPES[shape].get("stream") or _model_ok(folder, common | {"role": f"ft{i}"}):
            continue
        base = base or model_class.from_pretrained(base_dir, dtype=dtype).eval()
        ft = ft or (model_class.from_config(config).to(dtype).eval() if is_decoder(shape) else
                    model_class(config).eval())
        _fill_finetune(ft, base, i, seed)
        _save(ft, folder, image_size, common | {"role": f"ft{i}"})
        created.append(f"ft{i}")
    info = {"root": str(root), "created": created, "create_s": round(time.perf_counter() - t0, 2),
            "model_bytes": sum(f.stat().st_size for f in weight_files(base_dir)),
            "num_params": _num_params(weight_files(base_dir)), "config": common["config"],
            "files": len(weight_files(base_dir))}
    return base_dir, dirs, info


def _num_params(paths: list[Path]) -> int | None:
    try:
        from safetensors import safe_open

        total = 0
        for path in paths:
            with safe_open(str(path), "pt") as f:
                total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        return total
    except Exception:
        return None


def ensure_images(cache: Path, n: int, image_size: int, seed: int = 0) -> Path:
    """``n`` random RGB images, normalised like CLIP, as one ``[n, 3, S, S]`` float tensor file."""
    import torch

    path = cache / "images" / f"random_n{n}_s{image_size}_seed{seed}_v{GEN_VERSION}.pt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(123_456 + seed)
        raw = torch.randint(0, 256, (n, 3, image_size, image_size), generator=gen, dtype=torch.uint8)
        mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
        torch.save(((raw.float() / 255.0) - mean) / std, path)
    return path


def ensure_tokens(cache: Path, n: int, seq_len: int, vocab_size: int, seed: int = 0) -> Path:
    """``n`` random token sequences of ``seq_len`` ids (uniform over the vocabulary, full attention mask)."""
    import torch

    path = cache / "tokens" / f"random_n{n}_t{seq_len}_v{vocab_size}_seed{seed}_v{GEN_VERSION}.pt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(654_321 + seed)
        ids = torch.randint(0, vocab_size, (n, seq_len), generator=gen)
        torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path)
    return path


def setup_main(spec: dict) -> dict:
    """Child job: create / reuse the models and images (kept out of the parent so that its RSS stays small)."""
    if spec["device"].startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    cache = Path(spec["cache"])
    base_dir, model_dirs, info = ensure_models(cache, spec["shape"], spec["layers"], spec["q"])
    shape = SHAPES[spec["shape"]]
    images = ensure_tokens(cache, spec["num_samples"], spec["seq_len"], shape["vocab_size"]) if is_decoder(
        spec["shape"]) else ensure_images(cache, spec["num_samples"], shape["image_size"])
    return info | {"base": str(base_dir), "model_dirs": [str(p) for p in model_dirs],
                   "images": str(images) if images else None}


# -------------------------------------------------------------------------------------------- analysis (children)
def agreement_main(spec: dict) -> dict:
    """bf16 vs fp32 M-Loss: layer relative error and Spearman ρ of node M-Loss per layer."""
    import torch

    a = torch.load(spec["fp32"], weights_only=True)
    b = torch.load(spec["bf16"], weights_only=True)
    rel = {n: abs(b["layer"][n] - v) / max(abs(v), 1e-30) for n, v in a["layer"].items()}
    rho = {n: _spearman(a["node"][n], b["node"][n]) for n in a["layer"]}
    rels, rhos = list(rel.values()), list(rho.values())
    return {"layer_rel_err_max": max(rels), "layer_rel_err_mean": sum(rels) / len(rels),
            "node_spearman_min": min(rhos), "node_spearman_mean": sum(rhos) / len(rhos),
            "per_layer": {n: {"layer_rel_err": rel[n], "node_spearman": rho[n]} for n in rel}}


def _spearman(x, y) -> float:
    import torch

    def ranks(v):  # average ranks (ties share their mean rank)
        v = v.double().flatten()
        order = torch.argsort(v, stable=True)
        r = torch.empty_like(v)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        uniq, inverse = torch.unique(v, return_inverse=True)
        sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, r)
        counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
        return (sums / counts)[inverse]

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


def parity_main(spec: dict) -> dict:
    """Max |a − b| over the tensors both merged folders hold (shards included; read one tensor at a time)."""
    from safetensors import safe_open

    from contextlib import ExitStack

    worst, worst_key, common, differing, total = 0.0, None, 0, 0, 0
    with ExitStack() as stack:  # every file of each (shards included), one tensor read at a time
        def keys_of(folder: str) -> dict:
            handles = [stack.enter_context(safe_open(str(f), "pt")) for f in weight_files(Path(folder))]
            return {k.removeprefix("vision_model."): (h, k) for h in handles for k in h.keys()}
        keys_a, keys_b = keys_of(spec["a"]), keys_of(spec["b"])
        for key in sorted(set(keys_a) & set(keys_b)):
            (fa, ka), (fb, kb) = keys_a[key], keys_b[key]
            ta, tb = fa.get_tensor(ka).float(), fb.get_tensor(kb).float()
            if ta.shape != tb.shape:
                return {"error": f"shape mismatch on {key}"}
            diff = (ta - tb).abs()
            d = float(diff.max()) if ta.numel() else 0.0
            differing, total, common = differing + int((diff > 1e-6).sum()), total + ta.numel(), common + 1
            if d > worst:
                worst, worst_key = d, key
        only = sorted(set(keys_a) ^ set(keys_b))
    return {"max_abs_diff": worst, "worst_tensor": worst_key, "tensors_compared": common,
            "entries_differing_gt_1e-6": differing, "entries_compared": total, "keys_not_shared": only}


# -------------------------------------------------------------------------------------------- machine
def cpu_info() -> dict:
    """CPU model, usable cores and the instruction-set flags that decide kernel speed (all flags kept too)."""
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    except OSError:
        pass
    model = model or platform.processor()
    present = set(flags.split())
    return {"cpu_model": model, "cpu_count": os.cpu_count(),
            "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "cpu_flags": {f: f in present for f in CPU_FLAGS}, "cpu_flags_all": flags,
            "cpu_bf16": "avx512_bf16" in present or "amx_bf16" in present}


def machine_info(args) -> dict:
    import torch
    import transformers

    import hf_mloss  # noqa: F401  (the package, then its modules below)

    mem_gb = None
    try:
        import psutil

        mem_gb = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    info = cpu_info() | {
        "ram_gb": mem_gb, "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
        "hf_mloss": hf_mloss.__version__,
    }
    if args.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    for peer in PEERS:
        root = peer_envs_root()
        try:
            info[f"{peer}_versions"] = json.loads((root / peer / "hf_mloss_peer.json").read_text())["versions"]
        except (OSError, KeyError, json.JSONDecodeError):
            pass
    return info


# -------------------------------------------------------------------------------------------- main run
def _log(msg: str) -> None:
    print(f"[merge_speed {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Plan:
    """What one invocation runs, and where its inputs and outputs live."""

    args: argparse.Namespace
    runs: list[str]
    peers: list[str]
    tag: str
    work: Path
    results_dir: Path
    base: Path | None = None
    models: list[Path] = field(default_factory=list)
    images: Path | None = None
    models_info: dict = field(default_factory=dict)
    deadline: float | None = None
    """``time.monotonic()`` after which no run starts (``--budget``); None: no limit."""

    def run_timeout(self) -> float:
        """A run's timeout: ``--timeout``, cut to what is left of ``--budget``."""
        if self.deadline is None:
            return self.args.timeout
        return max(0.0, min(self.args.timeout, self.deadline - time.monotonic()))

    def inputs_timeout(self) -> float:
        """How long creating the inputs may take: what is left of ``--budget``, else no limit. Not ``--timeout``:
        writing a 7B fixture (three 13.5 GB checkpoints) outlasts any one merge's timeout."""
        if self.deadline is None:
            return math.inf
        return max(0.0, self.deadline - time.monotonic())

    @property
    def outs(self) -> Path:
        return self.work / "out"

    @property
    def model_mb(self) -> float:
        return self.models_info["model_bytes"] / 1e6

    def common_spec(self) -> dict:
        return dict(device=self.args.device, base=str(self.base), models=[str(p) for p in self.models],
                    num_samples=self.args.num_samples, batch_size=self.args.batch_size)


def make_plan(args) -> Plan:
    runs = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else list(DEFAULT_RUNS)
    unknown = sorted(set(runs) - set(ALL_RUNS) - {"ties_global_fb"})
    if unknown:
        raise SystemExit(f"unknown --methods {unknown}; choose from {list(ALL_RUNS)}")
    peers = [] if args.skip_peers else [p.strip().replace("-", "_") for p in args.peers.split(",") if p.strip()]
    tag = args.tag or ((args.shape if args.shape != "b32" else "") + (f"-{args.layers}L" if args.layers else ""))
    tag = f"{tag}_{args.device.split(':')[0]}" if tag else args.device.split(":")[0]
    work = Path(args.cache).resolve() / "runs" / tag
    (work / "out").mkdir(parents=True, exist_ok=True)
    results_dir = Path(args.results_dir).resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget if args.budget else None
    return Plan(args=args, runs=runs, peers=peers, tag=tag, work=work, results_dir=results_dir, deadline=deadline)


def create_inputs(plan: Plan) -> None:
    args = plan.args
    spec = dict(name="setup", kind="setup", device=args.device, cache=str(Path(args.cache).resolve()),
                shape=args.shape, layers=args.layers, q=args.q, num_samples=args.num_samples, seq_len=args.seq_len)
    setup = run_child(spec, plan.work, plan.inputs_timeout())
    if "error" in setup:
        raise SystemExit(f"creating the inputs failed: {setup['error']}")
    info = setup["child"]
    plan.base, plan.models = Path(info.pop("base")), [Path(p) for p in info.pop("model_dirs")]
    images = info.pop("images")
    plan.images, plan.models_info = (Path(images) if images else None), info
    _log(f"models under {info['root']} ({plan.model_mb:.1f} MB each; created {info['created'] or 'none'} in "
         f"{info['create_s']} s); data {plan.images.name}")


def hf_spec(plan: Plan, name: str, repeat: int, reference: bool = False) -> dict:
    """The child spec of an hf_mloss run (or the plain forward); ``reference``: under the --reference tree."""
    label = f"{name}{REFERENCE_SUFFIX}" if reference else name
    spec = dict(plan.common_spec(), name=f"{label}.r{repeat}")
    if reference:
        spec["pythonpath"] = str(Path(plan.args.reference).resolve())
    if name == "forward":
        return spec | dict(kind="forward", data=str(plan.images), repeats=plan.args.forward_repeats)
    if name in ("read", "svd_floor", "wudi_floor", "svc_floor"):
        return spec | dict(kind=name)
    if name in SCORE_RUNS:
        return spec | dict(kind="score", data=str(plan.images), out=str(plan.work / f"{name}.r{repeat}.mloss.pt"),
                           **SCORE_RUNS[name])
    if name == "compatibility":
        return spec | dict(kind="compatibility", data=str(plan.images))
    method, params = HF_RUNS[name]
    data = method in DATA_METHODS or "select" in params
    return spec | dict(kind="merge", method=method, params=params, data=str(plan.images) if data else None,
                       out=str(plan.outs / label), own=name in OWN_RUNS)


def measured(fn, *a, **kw) -> dict:
    """Run ``fn`` (a child or a peer) and add how busy the cores were meanwhile."""
    load, before = os.getloadavg(), cpu_times()
    res = fn(*a, **kw)
    res["_loadavg_before"] = load
    res["contention"] = contention(before, cpu_times(), res)
    return res


def warm_inputs(plan: Plan) -> dict:
    """Read every file of the base and the fine-tunes once, untimed, so that the run after it reads them from the
    page cache, as the records say: a run that holds several GB (the plain forward of a 1.5B decoder: 9 GB) evicts
    part of 5 × 3 GB of checkpoints on a 24 GB machine, and the run after it read them from the disk. Returns the
    seconds (slow when they were not cached) and bytes of the read."""
    start, size = time.perf_counter(), 0
    for folder in [plan.base, *plan.models]:
        for file in sorted(Path(folder).iterdir()) if folder else ():
            if file.is_file():
                with open(file, "rb", buffering=0) as handle:
                    while chunk := handle.read(1 << 26):
                        size += len(chunk)
    return {"s": round(time.perf_counter() - start, 2), "bytes": size}


def run_hf(plan: Plan, name: str, repeat: int, reference: bool = False) -> dict:
    spec = hf_spec(plan, name, repeat, reference)
    _log(f"[run {repeat + 1}] {name}{REFERENCE_SUFFIX if reference else ''} ...")
    timeout = plan.run_timeout()
    warm = warm_inputs(plan)
    res = measured(run_child, spec, plan.work, timeout)
    res["warm_read"] = warm
    if "error" in res and timeout < plan.args.timeout and res["error"].startswith("timed out"):
        res["error"] += f" (stopped by --budget {plan.args.budget:g} s, not by --timeout)"
    res["spec"] = {k: v for k, v in spec.items() if k not in ("models", "result")}
    return res


def run_peer(peer: str, base: Path, models: list[Path], out: Path, timeout: float, env: dict | None = None,
             dtype: str = "float32") -> dict:
    import resource

    try:
        from benchmarks.peers.run_peer import PeerError, PeerUnavailable, run_peer_merge
    except ImportError as err:
        return {"name": peer, "skipped": f"cannot import benchmarks.peers.run_peer: {err}"}
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})  # the peer's child inherits this process's environment
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        extra = {"dtype": dtype} if peer == "mergekit" else {}  # mergekit writes the checkpoints' dtype
        run = run_peer_merge(peer, "ties", base, models, out, k=K, lam=1.0, timeout=timeout, **extra)
    except PeerUnavailable as err:
        return {"name": peer, "skipped": f"peer unavailable: {err}"}
    except PeerError as err:
        return {"name": peer, "error": str(err)[-1500:]}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # RUSAGE_CHILDREN times are cumulative over reaped children, so the difference is this peer's CPU time.
    user, sys_ = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    res = {"name": peer, "rc": 0, "wall_s": run.wall_s, "max_rss_mb": run.max_rss_mb, "cpu_user_s": user,
           "cpu_sys_s": sys_, "cpu_s": user + sys_, "log": str(run.log_path), "out": str(out)}
    fb_json = out / "fusion_bench_run.json"
    if peer == "fusion_bench" and fb_json.is_file():
        fb = json.loads(fb_json.read_text())
        res["child"] = {k: fb[k] for k in ("import_s", "load_s", "merge_s", "save_s") if k in fb}
        res["child"]["inner_s"] = fb.get("merge_s")
    return res


def estimate_fusion_bench_gb(model_gb: float, tasks: int) -> float:
    """Peak RSS of fusion-bench TIES, fitted on PEERS.md §D (ViT-B/32: 2 tasks 7.46 GB, 4 tasks 13.37 GB)."""
    return 0.6 + model_gb * (2.7 + 8.4 * tasks)


def fusion_bench_reason(plan: Plan, tasks: int) -> str | None:
    """Why fusion-bench cannot run here (None: it can)."""
    est, avail = estimate_fusion_bench_gb(plan.model_mb / 1000, tasks), _available_gb()
    if tasks < 1:
        return "--fusion-bench-tasks 0"
    if est > plan.args.rss_limit_gb:
        return (f"fusion-bench loads every model whole plus flattened task vectors: {tasks} tasks would need "
                f"~{est:.1f} GB RSS (> the {plan.args.rss_limit_gb:.0f} GB limit)")
    if avail is not None and est > avail - 1.0:
        return f"~{est:.1f} GB needed but only {avail:.1f} GB of RAM is available now"
    return None


def run_peers(plan: Plan, repeat: int, record) -> None:
    """mergekit on all q tasks; fusion-bench (with hf_mloss in its convention) on --fusion-bench-tasks tasks."""
    q, outs, timeout = plan.args.q, plan.outs, plan.args.timeout
    for peer in plan.peers:
        if peer in ("mergekit", "mergekit_1t"):
            # mergekit_1t: the same merge with OMP_NUM_THREADS=1 (what one thread gives mergekit on busy cores)
            env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} if peer == "mergekit_1t" else None
            _log(f"[run {repeat + 1}] {peer}: mergekit-yaml TIES on {q} tasks ...")
            res = measured(run_peer, "mergekit", plan.base, plan.models, outs / f"{peer}_ties", timeout, env,
                           SHAPES[plan.args.shape].get("dtype", "float32"))
            record(f"{peer}_ties", res | {"tasks": q})
        elif peer == "fusion_bench":
            tasks = min(q, plan.args.fusion_bench_tasks)
            reason = fusion_bench_reason(plan, tasks)
            if reason:
                record("fusion_bench_ties", {"name": "fusion_bench", "skipped": reason, "tasks": tasks})
                continue
            _log(f"[run {repeat + 1}] fusion-bench TIES on {tasks} tasks ...")
            res = measured(run_peer, "fusion_bench", plan.base, plan.models[:tasks], outs / "fusion_bench_ties",
                           timeout)
            record("fusion_bench_ties", res | {"tasks": tasks})
            spec = dict(plan.common_spec(), name=f"ties_global_fb.r{repeat}", kind="merge", method="ties",
                        params=dict(k=K, lam=1.0, convention="fusion_bench"), data=None,
                        models=[str(p) for p in plan.models[:tasks]], out=str(outs / "ties_global_fb"))
            res = measured(run_child, spec, plan.work, timeout)
            record("ties_global_fb", res | {"tasks": tasks})
        else:
            record(peer, {"name": peer, "skipped": f"unknown peer {peer!r}"})


def run_repeat(plan: Plan, repeat: int) -> dict:
    """One repeat: every selected run, then the peers, then parity and bf16 agreement (in children)."""
    results: dict[str, dict] = {}

    def record(name: str, res: dict) -> None:
        results[name] = res
        inner = (res.get("child") or {}).get("inner_s")
        if "error" in res or "skipped" in res:
            _log(f"{name}: {'FAILED ' + res['error'][:800] if 'error' in res else 'skipped: ' + res['skipped']}")
        else:
            busy = res.get("contention", {}).get("other_cores")
            _log(f"{name}: wall {res['wall_s']:.1f} s, CPU {res['cpu_s']:.1f} s, peak RSS {res['max_rss_mb']:.0f} MB"
                 + (f", inner {inner:.1f} s" if inner is not None else "")
                 + (f", other processes used {busy:.2f} cores" if busy is not None else ""))

    started = os.getloadavg()
    for name in plan.runs:
        if plan.run_timeout() < 1:  # --budget spent: the record still gets written, with what ran
            record(name, {"name": name, "skipped": f"not started: the --budget of {plan.args.budget:g} s was spent"})
            continue
        record(name, run_hf(plan, name, repeat))
        if plan.args.reference and name not in FLOOR_RUNS:  # side by side: this tree, then the reference tree
            record(f"{name}{REFERENCE_SUFFIX}", run_hf(plan, name, repeat, reference=True))
        drop_outputs(plan)
    run_peers(plan, repeat, record)
    drop_outputs(plan)
    for res in results.values():
        res.setdefault("tasks", plan.args.q)
    return {"repeat": repeat + 1, "loadavg_start": started, "loadavg_end": os.getloadavg(), "runs": results,
            "checks": run_checks(plan, results, repeat)}


def drop_outputs(plan: Plan) -> None:
    """``--drop-outputs``: each merged folder is removed once its run is recorded (a 7B model's outputs would not
    fit the disk beside its inputs); the parity checks then have nothing to compare."""
    if plan.args.drop_outputs:
        for folder in plan.outs.iterdir():
            shutil.rmtree(folder, ignore_errors=True)


def run_checks(plan: Plan, results: dict, repeat: int) -> dict:
    """Output parity with the peers and bf16 agreement, each computed in a child (the parent stays small)."""
    checks: dict = {"parity": {}}
    pairs = {"ties_tensor_mk (mergekit convention) vs mergekit": ("ties_tensor_mk", "mergekit_ties"),
             "ties_global_fb (fusion_bench convention) vs fusion-bench": ("ties_global_fb", "fusion_bench_ties")}
    for label, (ours, theirs) in pairs.items():
        if _ok(results.get(ours)) and _ok(results.get(theirs)):
            spec = dict(name=f"parity.r{repeat}", kind="parity", a=str(plan.outs / ours), b=str(plan.outs / theirs))
            checks["parity"][label] = _check(run_child(spec, plan.work, plan.args.timeout))
    for name in HF_RUNS:  # --reference: the same merge under both trees (a new route must give the same weights)
        twin = f"{name}{REFERENCE_SUFFIX}"
        if _ok(results.get(name)) and _ok(results.get(twin)) and (plan.outs / name).is_dir():
            spec = dict(name=f"parity.{name}.r{repeat}", kind="parity", a=str(plan.outs / name),
                        b=str(plan.outs / twin))
            checks["parity"][f"{name}: this tree vs the reference tree"] = _check(
                run_child(spec, plan.work, plan.args.timeout))
    if _ok(results.get("score")) and _ok(results.get("score_bf16")):
        spec = dict(name=f"agreement.r{repeat}", kind="agreement", fp32=results["score"]["spec"]["out"],
                    bf16=results["score_bf16"]["spec"]["out"])
        checks["bf16"] = _check(run_child(spec, plan.work, plan.args.timeout))
    return checks


def _check(res: dict) -> dict:
    return res["child"] if "child" in res else {"error": res.get("error", "failed")}


def _available_gb() -> float | None:
    try:
        import psutil

        return psutil.virtual_memory().available / 2**30
    except ImportError:
        return None


def _ok(res: dict | None) -> bool:
    return bool(res) and "error" not in res and "skipped" not in res


def main_run(args) -> int:
    # The parent must stay small until every timed child has run: os.wait4's ru_maxrss of a child (here and in
    # benchmarks/peers/run_peer.py) is at least the parent's peak RSS at spawn time (Linux copies the old address
    # space's high-water mark at exec). So torch / transformers are imported only after the runs.
    plan = make_plan(args)
    started = {"date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]), "cwd": os.getcwd(),
               "loadavg_start": os.getloadavg(), "reference": args.reference}
    _log(f"shape={args.shape} layers={args.layers} q={args.q} device={args.device} runs={plan.runs} "
         f"peers={plan.peers} repeats={args.repeats}")
    create_inputs(plan)
    with RssGuard(args.rss_limit_gb * 1024) as guard:
        repeats = [run_repeat(plan, r) for r in range(args.repeats)]
        killed = list(guard.killed)
    parent_rss = _proc_status_mb("VmHWM")
    payload = build_payload(plan, repeats, started | {"loadavg_end": os.getloadavg()}, killed, parent_rss)
    write_results(plan, payload)
    if not args.keep_outputs:
        shutil.rmtree(plan.outs, ignore_errors=True)
    return 1 if any("error" in r for rep in repeats for r in rep["runs"].values()) else 0


def build_payload(plan: Plan, repeats: list[dict], started: dict, killed: list[str], parent_rss) -> dict:
    args = plan.args
    payload = {
        "benchmark": "merge_speed", "shape": args.shape, "layers_override": args.layers, "q": args.q,
        "device": args.device, "num_samples": args.num_samples, "batch_size": args.batch_size, "k": K,
        "task_vectors": {"std": TV_STD, "per_tensor_scale": f"log-uniform in {list(TV_SPREAD)}"},
        "machine": machine_info(args) | started, "models": plan.models_info,
        "images": {"path": str(plan.images), "kind": "uniform random RGB, CLIP-normalised, preprocessed tensor"}
        if not is_decoder(args.shape) else None,
        "inputs": inputs_description(plan),
        "repeats": repeats, "rss_guard": {"limit_gb": args.rss_limit_gb, "killed": killed},
        "parent_peak_rss_mb_during_runs": parent_rss, "select_grid": SELECT_GRID,
        "shape_layers": SHAPES[args.shape]["num_hidden_layers"],
    }
    payload["summary"] = summarize_repeats(payload)
    return payload


def inputs_description(plan: Plan) -> dict:
    """What the runs were given, for the report's header (the model kind, dtype and data differ per shape)."""
    args, shape, info = plan.args, SHAPES[plan.args.shape], plan.models_info
    config = info["config"]
    common = {"num_params": info["num_params"], "model_mb": info["model_bytes"] / 1e6, "q": args.q,
              "num_samples": args.num_samples, "batch_size": args.batch_size}
    if not is_decoder(args.shape):
        return common | {"kind": "clip_vision", "dtype": "float32"}
    return common | {"kind": "decoder", "family": shape["family"], "dtype": shape["dtype"],
                     "vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
                     "num_hidden_layers": config["num_hidden_layers"],
                     "tie_word_embeddings": config["tie_word_embeddings"], "seq_len": args.seq_len,
                     "data": "uniform random token ids, full attention mask"}


def portable(value, roots: dict[str, str]):
    """``value`` (a record: dicts, lists, strings) with every path under one of ``roots`` (folder → its name in
    records: ``"."`` for this tree) rewritten, so a committed record names no machine's folders."""
    if isinstance(value, dict):
        return {k: portable(v, roots) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v, roots) for v in value]
    if isinstance(value, str):
        for root, name in sorted(roots.items(), key=lambda item: -len(item[0])):
            value = value.replace(root + "/", "" if name == "." else name + "/")
            value = value.replace(root, name)
    return value


def peer_envs_root() -> Path:
    """Where the peers' virtual environments live (``HF_MLOSS_PEER_ENVS`` or the benchmarks' cache)."""
    folder = os.environ.get("HF_MLOSS_PEER_ENVS")
    return Path(folder) if folder else HERE / ".cache" / "peer-envs"


def record_roots(args) -> dict[str, str]:
    """The folders a record names by role instead (:func:`portable`): this tree ``"."``, a cache or results folder
    outside it ``CACHE`` / ``out``, the side-by-side reference tree ``REFERENCE``, the peers' environments
    ``PEER_ENVS``."""
    roots = {str(REPO): "."}
    if not peer_envs_root().resolve().is_relative_to(REPO):
        roots[str(peer_envs_root().resolve())] = "PEER_ENVS"
    for folder, name in ((args.cache, "CACHE"), (args.results_dir, "out"), (args.reference, "REFERENCE")):
        if folder and (name == "REFERENCE" or not Path(folder).resolve().is_relative_to(REPO)):
            roots[str(Path(folder).resolve())] = name  # absolute only: a relative "c" would rewrite every "c"
    return roots


def write_results(plan: Plan, payload: dict) -> None:
    json_path = plan.results_dir / f"merge_speed_{plan.tag}.json"
    md_path = plan.results_dir / f"merge_speed_{plan.tag}.md"
    payload = portable(json.loads(json.dumps(payload, default=str)), record_roots(plan.args))
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md_path.write_text(render_markdown(payload))
    _log(f"wrote {json_path} and {md_path}")
    print(md_path.read_text())


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="b32")
    ap.add_argument("--layers", type=int, default=None,
                    help="override num_hidden_layers (e.g. 1 to time one layer and extrapolate)")
    ap.add_argument("--q", type=int, default=8, help="number of fine-tuned models")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (decoder shapes)")
    ap.add_argument("--methods", default=None,
                    help=f"comma-separated subset of {','.join(ALL_RUNS)} (default: {','.join(DEFAULT_RUNS)})")
    ap.add_argument("--repeats", type=int, default=3, help="times the whole set of runs is repeated (all kept)")
    ap.add_argument("--skip-peers", action="store_true", help="do not run mergekit / fusion-bench")
    ap.add_argument("--peers", default="mergekit,fusion_bench",
                    help="mergekit, mergekit_1t (mergekit with OMP_NUM_THREADS=1), fusion_bench")
    ap.add_argument("--fusion-bench-tasks", type=int, default=4,
                    help="tasks given to fusion-bench (8 ViT-B/32 tasks need ~25 GB; skipped above --rss-limit-gb)")
    ap.add_argument("--forward-repeats", type=int, default=2, help="forward passes per thread setting")
    ap.add_argument("--rss-limit-gb", type=float, default=20.0,
                    help="kill any run whose process tree exceeds this RSS")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    ap.add_argument("--budget", type=float, default=None,
                    help="wall seconds for the invocation, creating the inputs included: no run starts after it, each run's timeout is cut to what is left, "
                         "and the results are written with the runs that did not start marked skipped")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="where models, images and run outputs live")
    ap.add_argument("--results-dir", default=str(DEFAULT_RESULTS))
    ap.add_argument("--tag", default=None, help="results file suffix (default: <shape>_<device>; b32: <device>)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep the merged models under the cache")
    ap.add_argument("--drop-outputs", action="store_true",
                    help="remove each merged folder right after its run (large shapes; no parity checks then)")
    ap.add_argument("--reference", metavar="TREE", default=None,
                    help="another hf_mloss source tree (e.g. a git worktree of the previous main): every hf_mloss run "
                         "is repeated under it right after this tree's, and the report gives both trees' ratios")
    ap.add_argument("--render", metavar="JSON",
                    help="only re-derive the ratios of an existing results JSON and re-write it and its Markdown")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    if args.render:
        src = Path(args.render)  # the ratios are re-derived from the measurements by this tree's report code
        payload = json.loads(src.read_text())
        payload["summary"] = summarize_repeats(payload)
        src.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        src.with_suffix(".md").write_text(render_markdown(payload))
        return 0
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return main_run(args)


if __name__ == "__main__":
    raise SystemExit(main())
