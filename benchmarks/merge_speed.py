#!/usr/bin/env python
"""Merge-speed benchmark: hf_mloss vs mergekit / fusion-bench on q ViT-shaped random fine-tunes, in ONE run.

What it does (every timed run is its own child process, so wall time, CPU time and peak RSS are per run):

1. Creates, or reuses from the cache, a seeded random-init CLIP vision tower and q "fine-tunes". Each fine-tune is
   the base plus a task vector: per tensor, ``1e-3 * s * randn`` with a log-uniform scale ``s`` in [0.3, 3].
   They are saved with ``save_pretrained`` (fp32 safetensors) plus a ``CLIPImageProcessorPil`` config. Also
   creates ``--num-samples`` random images as a preprocessed ``[N, 3, H, W]`` tensor (uniform RGB, CLIP mean/std).
2. Times these runs:
   * ``forward``: a plain fp32 ``CLIPVisionModel`` forward of the base over the images, in batches, under
     ``torch.inference_mode``. This is the floor unit F.
   * ``score`` / ``score_bf16``: ``hf_mloss.score(..., prefix="base")``, with ``compute_dtype`` float32 / bfloat16.
     The floor is (1 + q/3)·F. bf16 is compared with fp32 on layer M-Loss (relative error) and on node M-Loss
     (Spearman ρ per layer).
   * hf_mloss merges: ``ties_tensor`` (per-tensor TIES), ``ties_tensor_mk`` (mergekit's exact-k convention, for
     parity), ``ties_global`` (global TIES),
     ``dare`` (DARE-TIES), ``task_arithmetic`` and ``m_ties`` (with the images). Each run is
     ``hf_mloss.merge(..., progress=False)`` then ``save_pretrained``.
   * peers, through ``benchmarks/peers/run_peer.py``: ``mergekit-yaml`` TIES on all q tasks, and fusion-bench TIES
     on ``--fusion-bench-tasks`` tasks (default 4: 8 tasks need about 25 GB). When fusion-bench runs, hf_mloss
     ``ties_global_fb`` (fusion_bench convention, same tasks) runs too, for a like-for-like ratio.
3. Writes ``benchmarks/results/merge_speed_<tag>.json`` and ``.md``. The Markdown holds the table, the ratios
   against their targets, the bf16 accuracy, output parity with the peers, machine info and the exact command.

Examples::

    python benchmarks/merge_speed.py --shape tiny                    # ~1-minute smoke run (peers included)
    python benchmarks/merge_speed.py                                 # the full ViT-B/32 benchmark, q = 8
    python benchmarks/merge_speed.py --shape l14 --layers 1 --skip-peers --methods forward,score,m_ties
    python benchmarks/merge_speed.py --shape l14 --skip-peers --methods m_ties   # slow on CPU

Internal: ``python benchmarks/merge_speed.py --child SPEC.json`` runs one timed job (used by the parent).
"""

from __future__ import annotations

import argparse
import datetime as _dt
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_CACHE = HERE / ".cache" / "merge_speed"
DEFAULT_RESULTS = HERE / "results"

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
}
TV_STD = 1e-3
TV_SPREAD = (0.3, 3.0)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
GEN_VERSION = 1  # bump when the way models / images are generated changes (invalidates the cache)

K = 0.2  # TIES keep fraction (mergekit density 0.2, fusion-bench threshold 20)
HF_RUNS: dict[str, tuple[str, dict]] = {
    # name: (hf_mloss method, parameters)
    "ties_tensor": ("ties", dict(k=K, lam=1.0, scope="tensor")),  # per tensor (threshold selection), for speed
    "ties_tensor_mk": ("ties", dict(k=K, lam=1.0, convention="mergekit")),  # mergekit's exact-k rule, for parity
    "ties_global": ("ties", dict(k=K, lam=1.0, scope="global")),  # hf_mloss default (global, exact two-pass)
    "dare": ("dare", dict(p=0.7, lam=1.0)),  # DARE-TIES, 1/p rescale
    "task_arithmetic": ("task_arithmetic", dict(lam=0.3)),
    "m_ties": ("m_ties", dict(k=K, e=0.1, lam=1.0)),  # prefix="merged", 128 images
    "m_ties_bf16": ("m_ties", dict(k=K, e=0.1, lam=1.0, compute_dtype="bfloat16")),  # the same, bf16 scoring
}
MEASURE_RUNS = ("forward", "score", "score_bf16")
ALL_RUNS = (*MEASURE_RUNS, *HF_RUNS)
PEERS = ("mergekit", "fusion_bench")

CPU_NOTE = "CPU-time basis, informational (less sensitive to other jobs on the cores)"
TARGETS = {
    "ties_tensor_vs_mergekit_wall": 0.2,
    "ties_tensor_vs_mergekit_rss": 0.5,
    "m_ties_vs_mergekit_wall": 0.5,
    "m_ties_vs_floor": 1.25,
    "score_vs_floor": 1.2,
    "l14_m_ties_rss_gb": 4.0,
}


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
    """Run one timed job described by SPEC.json; write its inner timings to spec["result"]."""
    spec = json.loads(Path(spec_path).read_text())
    if spec["kind"] == "setup":
        return setup_main(spec)
    t0, c0 = time.perf_counter(), time.process_time()
    import torch

    import hf_mloss
    from transformers import CLIPVisionModel

    device = spec["device"]
    info: dict = {"import_s": time.perf_counter() - t0, "vmrss_after_import_mb": _proc_status_mb("VmRSS"),
                  "torch_threads": torch.get_num_threads(), "loadavg_start": os.getloadavg()}
    pixels = torch.load(spec["data"], weights_only=True)[: spec["num_samples"]] if spec.get("data") else None
    kind = spec["kind"]
    t1, c1 = time.perf_counter(), time.process_time()
    if kind == "forward":
        model = CLIPVisionModel.from_pretrained(spec["base"], dtype=torch.float32).to(device).eval()
        info["attn_implementation"] = model.config._attn_implementation
        info["load_s"] = time.perf_counter() - t1
        passes = []
        with torch.inference_mode():
            model(pixel_values=pixels[:1].to(device))  # one-image warm-up (kernel selection), not timed
            for _ in range(spec.get("repeats", 2)):
                _sync(device)
                ts, cs = time.perf_counter(), time.process_time()
                for batch in pixels.split(spec["batch_size"]):
                    model(pixel_values=batch.to(device))
                _sync(device)
                passes.append({"wall_s": time.perf_counter() - ts, "cpu_s": time.process_time() - cs})
        info["passes"] = passes
        info["inner_s"] = min(p["wall_s"] for p in passes)
        info["inner_cpu_s"] = min(p["cpu_s"] for p in passes)
    elif kind == "score":
        report = hf_mloss.score(spec["base"], spec["models"], pixels, num_samples=spec["num_samples"],
                                batch_size=spec["batch_size"], prefix="base", device=device,
                                compute_dtype=spec["compute_dtype"], progress=False)
        _sync(device)
        info["inner_s"], info["inner_cpu_s"] = time.perf_counter() - t1, time.process_time() - c1
        torch.save({"layer": dict(report.layer), "node": {k: v.clone() for k, v in report.node.items()}},
                   spec["out"])
    elif kind == "merge":
        extra = {}
        if spec.get("data"):
            extra = dict(data=pixels, num_samples=spec["num_samples"], batch_size=spec["batch_size"])
        result = hf_mloss.merge(spec["base"], spec["models"], spec["method"], device=device, progress=False,
                                **extra, **spec["params"])
        _sync(device)
        info["inner_s"], info["inner_cpu_s"] = time.perf_counter() - t1, time.process_time() - c1
        info["vmhwm_after_merge_mb"] = _proc_status_mb("VmHWM")
        t2 = time.perf_counter()
        result.save_pretrained(spec["out"], overwrite=True)
        info["save_s"] = time.perf_counter() - t2
    else:
        raise SystemExit(f"unknown child kind {kind!r}")
    if device.startswith("cuda"):
        info["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    info["vmhwm_mb"] = _proc_status_mb("VmHWM")
    info["total_in_child_s"] = time.perf_counter() - t0
    info["total_cpu_in_child_s"] = time.process_time() - c0
    info["loadavg_end"] = os.getloadavg()
    Path(spec["result"]).write_text(json.dumps(info, indent=2))
    return 0


# ============================================================================================ parent side
class RssGuard:
    """Polls the summed RSS of every descendant process; kills the top-level child trees above ``limit_mb``."""

    def __init__(self, limit_mb: float, interval: float = 0.25) -> None:
        import psutil

        self.psutil, self.limit_mb, self.interval = psutil, limit_mb, interval
        self.me = psutil.Process()
        self.killed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RssGuard:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _loop(self) -> None:
        ps = self.psutil
        while not self._stop.wait(self.interval):
            try:
                kids = self.me.children(recursive=True)
                total = 0
                for p in kids:
                    try:
                        total += p.memory_info().rss
                    except (ps.NoSuchProcess, ps.AccessDenied):
                        pass
                if total / 2**20 <= self.limit_mb:
                    continue
                for top in self.me.children(recursive=False):
                    try:
                        cmd = " ".join(top.cmdline()[:4])
                        os.killpg(top.pid, signal.SIGKILL)
                    except (ps.NoSuchProcess, ProcessLookupError, PermissionError):
                        continue
                    self.killed.append(f"{cmd} (descendants' RSS {total / 2**30:.1f} GB > "
                                       f"{self.limit_mb / 1024:.1f} GB)")
                    print(f"[merge_speed] RSS guard killed {cmd}: {total / 2**30:.1f} GB", flush=True)
            except Exception:  # never let the guard take the benchmark down
                pass


def run_child(spec: dict, work: Path, timeout: float) -> dict:
    """Run one ``--child`` job; return its rusage-based wall / CPU / peak RSS plus the child's own timings."""
    name = spec["name"]
    spec_path, spec["result"] = work / f"{name}.spec.json", str(work / f"{name}.result.json")
    Path(spec["result"]).unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec, indent=2))
    log_path = work / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=str(REPO))
        deadline = start + timeout
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                timed_out = True
                break
            time.sleep(0.02)
        wall = time.perf_counter() - start
    rc = os.waitstatus_to_exitcode(status)
    out = {"name": name, "rc": rc, "wall_s": wall, "cpu_user_s": usage.ru_utime, "cpu_sys_s": usage.ru_stime,
           "cpu_s": usage.ru_utime + usage.ru_stime,
           "max_rss_mb": usage.ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024),
           "log": str(log_path)}
    if timed_out:
        out["error"] = f"timed out after {timeout:.0f} s"
    elif rc != 0:
        out["error"] = f"exit code {rc}; log tail: {log_path.read_text(errors='replace')[-1500:]}"
    else:
        out["child"] = json.loads(Path(spec["result"]).read_text())
    return out


# -------------------------------------------------------------------------------------------- fixtures
def shape_config(shape: str, layers: int | None):
    from transformers import CLIPVisionConfig

    cfg = dict(SHAPES[shape])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return CLIPVisionConfig(**cfg)


def _model_ok(folder: Path, manifest: dict) -> bool:
    try:
        ok = json.loads((folder / "bench_manifest.json").read_text()) == manifest
    except (OSError, json.JSONDecodeError):
        return False
    return ok and (folder / "model.safetensors").is_file() and (folder / "preprocessor_config.json").is_file()


def _save(model, folder: Path, image_size: int, manifest: dict) -> None:
    from transformers import CLIPImageProcessorPil

    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder)
    CLIPImageProcessorPil(size={"shortest_edge": image_size},
                          crop_size={"height": image_size, "width": image_size}).save_pretrained(folder)
    (folder / "bench_manifest.json").write_text(json.dumps(manifest, indent=2))


def ensure_models(cache: Path, shape: str, layers: int | None, q: int, seed: int = 0) -> tuple[Path, list[Path], dict]:
    """Create (or reuse) the base and q fine-tunes; fine-tune i depends only on (base, i), so q can grow."""
    import torch
    from transformers import CLIPVisionModel

    config = shape_config(shape, layers)
    tag = shape + (f"-{layers}L" if layers is not None else "")
    root = cache / "models" / tag
    base_dir = root / "base"
    common = {"gen_version": GEN_VERSION, "config": {k: getattr(config, k) for k in SHAPES[shape]}
              | {"num_hidden_layers": config.num_hidden_layers}, "seed": seed, "tv_std": TV_STD,
              "tv_spread": list(TV_SPREAD)}
    t0 = time.perf_counter()
    created = []
    base = None
    if not _model_ok(base_dir, common | {"role": "base"}):
        torch.manual_seed(seed)
        base = CLIPVisionModel(config).eval()
        _save(base, base_dir, config.image_size, common | {"role": "base"})
        created.append("base")
    dirs = [root / f"ft{i}" for i in range(q)]
    ft = None
    for i, folder in enumerate(dirs):
        manifest = common | {"role": f"ft{i}"}
        if _model_ok(folder, manifest):
            continue
        if base is None:
            base = CLIPVisionModel.from_pretrained(base_dir, dtype=torch.float32).eval()
        if ft is None:
            ft = CLIPVisionModel(config).eval()
        gen = torch.Generator().manual_seed(10_000 + 1_000 * seed + i)
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
        _save(ft, folder, config.image_size, manifest)
        created.append(f"ft{i}")
    size = (base_dir / "model.safetensors").stat().st_size
    n_params = None
    try:
        from safetensors import safe_open

        with safe_open(str(base_dir / "model.safetensors"), "pt") as f:
            n_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    except Exception:
        pass
    info = {"root": str(root), "created": created, "create_s": round(time.perf_counter() - t0, 2),
            "model_bytes": size, "num_params": n_params, "config": common["config"]}
    return base_dir, dirs, info


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


def setup_main(spec: dict) -> int:
    """Child job: create / reuse the models and images (kept out of the parent so that its RSS stays small)."""
    if spec["device"].startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    cache = Path(spec["cache"])
    base_dir, model_dirs, info = ensure_models(cache, spec["shape"], spec["layers"], spec["q"])
    images = ensure_images(cache, spec["num_samples"], SHAPES[spec["shape"]]["image_size"])
    info.update(base=str(base_dir), model_dirs=[str(p) for p in model_dirs], images=str(images))
    Path(spec["result"]).write_text(json.dumps(info, indent=2))
    return 0


# -------------------------------------------------------------------------------------------- analysis
def mloss_agreement(fp32_path: str, bf16_path: str) -> dict:
    import torch

    a = torch.load(fp32_path, weights_only=True)
    b = torch.load(bf16_path, weights_only=True)
    rel, rho = {}, {}
    for name, value in a["layer"].items():
        rel[name] = abs(b["layer"][name] - value) / max(abs(value), 1e-30)
        rho[name] = _spearman(a["node"][name], b["node"][name])
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


def max_abs_diff(a_dir: str, b_dir: str) -> dict:
    """Max |a − b| over the tensors both merged ``model.safetensors`` hold (read one tensor at a time)."""
    from safetensors import safe_open

    worst, worst_key, common, differing, total = 0.0, None, 0, 0, 0
    with safe_open(str(Path(a_dir) / "model.safetensors"), "pt") as fa, \
            safe_open(str(Path(b_dir) / "model.safetensors"), "pt") as fb:
        keys_a = {k.removeprefix("vision_model."): k for k in fa.keys()}
        keys_b = {k.removeprefix("vision_model."): k for k in fb.keys()}
        for key in sorted(set(keys_a) & set(keys_b)):
            ta, tb = fa.get_tensor(keys_a[key]).float(), fb.get_tensor(keys_b[key]).float()
            if ta.shape != tb.shape:
                return {"error": f"shape mismatch on {key}"}
            diff = (ta - tb).abs()
            d = float(diff.max()) if ta.numel() else 0.0
            differing += int((diff > 1e-6).sum())
            total += ta.numel()
            common += 1
            if d > worst:
                worst, worst_key = d, key
        only = sorted(set(keys_a) ^ set(keys_b))
    return {"max_abs_diff": worst, "worst_tensor": worst_key, "tensors_compared": common,
            "entries_differing_gt_1e-6": differing, "entries_compared": total, "keys_not_shared": only}


def machine_info(args) -> dict:
    import torch
    import transformers

    import hf_mloss

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    try:
        flags = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        pass
    mem_gb = None
    try:
        import psutil

        mem_gb = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    info = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "cwd": os.getcwd(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_bf16": "avx512_bf16" in flags or "amx_bf16" in flags,
        "ram_gb": mem_gb,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "hf_mloss": hf_mloss.__version__,
        "loadavg_start": os.getloadavg(),
    }
    if args.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    for peer in PEERS:
        marker = HERE / ".cache" / "peer-envs" / peer / "hf_mloss_peer.json"
        if os.environ.get("HF_MLOSS_PEER_ENVS"):
            marker = Path(os.environ["HF_MLOSS_PEER_ENVS"]) / peer / "hf_mloss_peer.json"
        try:
            info[f"{peer}_versions"] = json.loads(marker.read_text())["versions"]
        except (OSError, KeyError, json.JSONDecodeError):
            pass
    return info


# -------------------------------------------------------------------------------------------- main run
def _log(msg: str) -> None:
    print(f"[merge_speed {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_peer(peer: str, base: Path, models: list[Path], out: Path, timeout: float) -> dict:
    import resource

    try:
        from benchmarks.peers.run_peer import PeerError, PeerUnavailable, run_peer_merge
    except ImportError as err:
        return {"name": peer, "skipped": f"cannot import benchmarks.peers.run_peer: {err}"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        run = run_peer_merge(peer, "ties", base, models, out, k=K, lam=1.0, timeout=timeout)
    except PeerUnavailable as err:
        return {"name": peer, "skipped": f"peer unavailable: {err}"}
    except PeerError as err:
        return {"name": peer, "error": str(err)[-1500:]}
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


def main_run(args) -> int:
    # The parent must stay small until every timed child has run: os.wait4's ru_maxrss of a child (here and in
    # benchmarks/peers/run_peer.py) is at least the parent's peak RSS at spawn time (Linux copies the old address
    # space's high-water mark at exec). So torch / transformers are imported only after the runs.
    runs_wanted = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else list(ALL_RUNS)
    unknown = sorted(set(runs_wanted) - set(ALL_RUNS) - {"ties_global_fb"})
    if unknown:
        raise SystemExit(f"unknown --methods {unknown}; choose from {list(ALL_RUNS)}")
    peers = [] if args.skip_peers else [p.strip().replace("-", "_") for p in args.peers.split(",") if p.strip()]
    cache = Path(args.cache).resolve()
    tag = args.tag or ((f"{args.shape}" if args.shape != "b32" else "")
                       + (f"-{args.layers}L" if args.layers is not None else ""))
    tag = f"{tag}_{args.device.split(':')[0]}" if tag else args.device.split(":")[0]
    work = cache / "runs" / tag
    outs = work / "out"
    outs.mkdir(parents=True, exist_ok=True)
    results_dir = Path(args.results_dir).resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    q = args.q
    started = {"date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]), "loadavg_start": os.getloadavg()}
    _log(f"shape={args.shape} layers={args.layers} q={q} device={args.device} runs={runs_wanted} peers={peers}")

    setup_spec = dict(name="setup", kind="setup", device=args.device, cache=str(cache), shape=args.shape,
                      layers=args.layers, q=q, num_samples=args.num_samples)
    setup = run_child(setup_spec, work, args.timeout)
    if "error" in setup:
        raise SystemExit(f"creating the inputs failed: {setup['error']}")
    models_info = setup["child"]
    base_dir, model_dirs = Path(models_info.pop("base")), [Path(p) for p in models_info.pop("model_dirs")]
    images = Path(models_info.pop("images"))
    model_mb = models_info["model_bytes"] / 1e6
    _log(f"models under {models_info['root']} ({model_mb:.1f} MB each; created {models_info['created'] or 'none'} "
         f"in {models_info['create_s']} s); images {images.name}")

    common = dict(device=args.device, base=str(base_dir), models=[str(p) for p in model_dirs],
                  num_samples=args.num_samples, batch_size=args.batch_size)
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    guard_limit = args.rss_limit_gb * 1024

    def record(name: str, res: dict) -> None:
        results[name] = res
        if "error" in res:
            _log(f"{name}: FAILED {res['error'][:800]}")
        elif "skipped" in res:
            skipped[name] = res["skipped"]
            _log(f"{name}: skipped ({res['skipped']})")
        else:
            inner = (res.get("child") or {}).get("inner_s")
            _log(f"{name}: wall {res['wall_s']:.1f} s, CPU {res['cpu_s']:.1f} s, peak RSS {res['max_rss_mb']:.0f} MB"
                 + (f", inner {inner:.1f} s" if inner is not None else ""))

    with RssGuard(guard_limit) as guard:
        for name in runs_wanted:
            if name == "forward":
                spec = dict(common, name=name, kind="forward", data=str(images), repeats=args.forward_repeats)
            elif name in ("score", "score_bf16"):
                spec = dict(common, name=name, kind="score", data=str(images),
                            compute_dtype="bfloat16" if name == "score_bf16" else "float32",
                            out=str(work / f"{name}.mloss.pt"))
            else:
                method, params = HF_RUNS[name]
                spec = dict(common, name=name, kind="merge", method=method, params=params,
                            data=str(images) if method in ("m_ties", "m_dare") else None, out=str(outs / name))
            _log(f"running {name} ...")
            res = run_child(spec, work, args.timeout)
            res["spec"] = {k: v for k, v in spec.items() if k not in ("models", "result")}
            record(name, res)

        fb_tasks = min(q, args.fusion_bench_tasks)
        for peer in peers:
            if peer == "mergekit":
                _log(f"running mergekit-yaml TIES on {q} tasks ...")
                res = run_peer("mergekit", base_dir, model_dirs, outs / "mergekit_ties", args.timeout)
                res["tasks"] = q
                record("mergekit_ties", res)
            elif peer == "fusion_bench":
                est = estimate_fusion_bench_gb(model_mb / 1000, fb_tasks)
                avail = _available_gb()
                reason = None
                if fb_tasks < 1:
                    reason = "--fusion-bench-tasks 0"
                elif est > args.rss_limit_gb:
                    reason = (f"fusion-bench loads every model whole plus flattened task vectors: {fb_tasks} tasks "
                              f"would need ~{est:.1f} GB RSS (> the {args.rss_limit_gb:.0f} GB limit)")
                elif avail is not None and est > avail - 1.0:
                    reason = f"~{est:.1f} GB needed but only {avail:.1f} GB of RAM is available now"
                if reason:
                    _log(f"fusion-bench skipped: {reason}")
                    skipped["fusion_bench_ties"] = reason
                    results["fusion_bench_ties"] = {"name": "fusion_bench", "skipped": reason, "tasks": fb_tasks}
                    continue
                if fb_tasks < q:
                    full = estimate_fusion_bench_gb(model_mb / 1000, q)
                    _log(f"fusion-bench TIES runs on {fb_tasks} of {q} tasks: {q} tasks would need "
                         f"~{full:.0f} GB RSS (limit {args.rss_limit_gb:.0f} GB)")
                _log(f"running fusion-bench TIES on {fb_tasks} tasks (estimated peak {est:.1f} GB) ...")
                res = run_peer("fusion_bench", base_dir, model_dirs[:fb_tasks], outs / "fusion_bench_ties",
                               args.timeout)
                res["tasks"] = fb_tasks
                record("fusion_bench_ties", res)
                # hf_mloss on exactly the same tasks, in fusion-bench's convention (for the ratio and parity)
                spec = dict(common, name="ties_global_fb", kind="merge", method="ties",
                            params=dict(k=K, lam=1.0, convention="fusion_bench"),
                            models=[str(p) for p in model_dirs[:fb_tasks]], data=None,
                            out=str(outs / "ties_global_fb"))
                _log(f"running ties_global_fb (hf_mloss, fusion_bench convention, {fb_tasks} tasks) ...")
                res = run_child(spec, work, args.timeout)
                res["spec"] = {k: v for k, v in spec.items() if k not in ("models", "result")}
                res["tasks"] = fb_tasks
                record("ties_global_fb", res)
            else:
                skipped[peer] = f"unknown peer {peer!r}"
        killed = list(guard.killed)
    parent_rss = _parent_hwm_mb()
    machine = machine_info(args) | started

    for res in results.values():
        res.setdefault("tasks", q)
    summary = summarize(results, q=q, model_mb=model_mb, work=work, outs=outs, shape=args.shape, layers=args.layers)
    payload = {
        "benchmark": "merge_speed",
        "shape": args.shape,
        "layers_override": args.layers,
        "q": q,
        "device": args.device,
        "num_samples": args.num_samples,
        "batch_size": args.batch_size,
        "k": K,
        "task_vectors": {"std": TV_STD, "per_tensor_scale": f"log-uniform in {list(TV_SPREAD)}"},
        "machine": machine | {"loadavg_end": os.getloadavg()},
        "models": models_info,
        "images": {"path": str(images), "kind": "uniform random RGB, CLIP-normalised, preprocessed tensor"},
        "runs": results,
        "skipped": skipped,
        "rss_guard": {"limit_gb": args.rss_limit_gb, "killed": killed},
        "parent_peak_rss_mb_during_runs": parent_rss,
        "summary": summary,
    }
    json_path = results_dir / f"merge_speed_{tag}.json"
    md_path = results_dir / f"merge_speed_{tag}.md"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md_path.write_text(render_markdown(payload))
    _log(f"wrote {json_path} and {md_path}")
    print(md_path.read_text())
    if not args.keep_outputs:
        shutil.rmtree(outs, ignore_errors=True)
    failed = [n for n, r in results.items() if "error" in r]
    return 1 if failed else 0


def _parent_hwm_mb() -> float | None:
    return _proc_status_mb("VmHWM")


def _available_gb() -> float | None:
    try:
        import psutil

        return psutil.virtual_memory().available / 2**30
    except ImportError:
        return None


def _ok(res: dict | None) -> bool:
    return bool(res) and "error" not in res and "skipped" not in res


def summarize(results: dict, *, q: int, model_mb: float, work: Path, outs: Path, shape: str, layers) -> dict:
    s: dict = {"model_mb": model_mb, "two_models_mb": 2 * model_mb}
    r = results
    fwd = r.get("forward")
    if _ok(fwd):
        F = fwd["child"]["inner_s"]
        s["forward_s"] = F
        s["floor_forwards"] = 1 + q / 3
        s["score_floor_s"] = (1 + q / 3) * F
        s["forward_cpu_s"] = fwd["child"]["inner_cpu_s"]
        s["score_floor_cpu_s"] = (1 + q / 3) * fwd["child"]["inner_cpu_s"]
    ratios = {}

    def ratio(key, num, den, target=None, note=""):
        if num is None or den is None or den <= 0:
            return
        value = num / den
        ratios[key] = {"value": value, "num": num, "den": den, "target": target, "note": note,
                       "meets_target": (value <= target) if target is not None else None}

    mk = r.get("mergekit_ties")
    tt = r.get("ties_tensor")
    mt = r.get("m_ties")
    if _ok(tt) and _ok(mk) and mk.get("tasks") == q:
        ratio("ties_tensor_vs_mergekit_wall", tt["wall_s"], mk["wall_s"], TARGETS["ties_tensor_vs_mergekit_wall"],
              "process wall incl. imports, load and save, both sides")
        ratio("ties_tensor_vs_mergekit_rss", tt["max_rss_mb"], mk["max_rss_mb"],
              TARGETS["ties_tensor_vs_mergekit_rss"], "peak RSS (os.wait4 ru_maxrss)")
        ratio("ties_tensor_vs_mergekit_cpu", tt["cpu_s"], mk["cpu_s"], None, f"process CPU (user+sys); {CPU_NOTE}")
    if _ok(mt) and _ok(mk) and mk.get("tasks") == q:
        ratio("m_ties_vs_mergekit_wall", mt["wall_s"], mk["wall_s"], TARGETS["m_ties_vs_mergekit_wall"],
              "process wall incl. imports, load and save, both sides")
        ratio("m_ties_vs_mergekit_cpu", mt["cpu_s"], mk["cpu_s"], None, f"process CPU (user+sys); {CPU_NOTE}")
    if _ok(r.get("m_ties_bf16")) and _ok(mk) and mk.get("tasks") == q:
        ratio("m_ties_bf16_vs_mergekit_wall", r["m_ties_bf16"]["wall_s"], mk["wall_s"], None,
              "process wall; M-TIES with compute_dtype=bfloat16 scoring (merge arithmetic stays fp32)")
    if _ok(mt) and _ok(tt) and "forward_s" in s:
        ratio("m_ties_vs_floor", mt["child"]["inner_s"], s["score_floor_s"] + tt["child"]["inner_s"],
              TARGETS["m_ties_vs_floor"], "inner merge() times: M-TIES / ((1 + q/3)·F + per-tensor TIES merge())")
        ratio("m_ties_vs_floor_wall", mt["wall_s"], s["score_floor_s"] + tt["wall_s"], None,
              "process walls: M-TIES / ((1 + q/3)·F + per-tensor TIES process)")
        ratio("m_ties_vs_floor_cpu", mt["child"]["inner_cpu_s"],
              s["score_floor_cpu_s"] + tt["child"]["inner_cpu_s"], None, f"inner CPU times; {CPU_NOTE}")
    for name in ("score", "score_bf16"):
        if _ok(r.get(name)) and "forward_s" in s:
            ratio(f"{name}_vs_floor", r[name]["child"]["inner_s"], s["score_floor_s"],
                  TARGETS["score_vs_floor"] if name == "score" else None,
                  "inner score() time (incl. loading the base) / (1 + q/3)·F")
            ratio(f"{name}_vs_floor_cpu", r[name]["child"]["inner_cpu_s"], s["score_floor_cpu_s"], None,
                  f"inner CPU times; {CPU_NOTE}")
    if _ok(r.get("score")) and _ok(r.get("score_bf16")):
        ratio("score_bf16_vs_fp32", r["score_bf16"]["child"]["inner_s"], r["score"]["child"]["inner_s"], None,
              "bf16 autocast scoring time / fp32")
    fb, tg = r.get("fusion_bench_ties"), r.get("ties_global_fb")
    if _ok(fb) and _ok(tg):
        ratio("ties_global_fb_vs_fusion_bench_wall", tg["wall_s"], fb["wall_s"], None,
              f"{fb['tasks']} tasks, process wall")
        ratio("ties_global_fb_vs_fusion_bench_rss", tg["max_rss_mb"], fb["max_rss_mb"], None,
              f"{fb['tasks']} tasks, peak RSS")
    if shape == "l14" and layers is None and _ok(mt):
        ratios["l14_m_ties_rss_gb"] = {"value": mt["max_rss_mb"] / 1024, "target": TARGETS["l14_m_ties_rss_gb"],
                                       "meets_target": mt["max_rss_mb"] / 1024 <= TARGETS["l14_m_ties_rss_gb"],
                                       "note": "absolute peak RSS in GB"}
    s["ratios"] = ratios
    rss = {}
    for name, res in r.items():
        if name in {*HF_RUNS, "ties_global_fb"} and _ok(res):
            after = res.get("child", {}).get("vmrss_after_import_mb")
            rss[name] = {"peak_mb": res["max_rss_mb"], "over_two_models": res["max_rss_mb"] / (2 * model_mb),
                         "child_vmhwm_mb": res.get("child", {}).get("vmhwm_mb"), "after_imports_mb": after,
                         "above_imports_mb": res["max_rss_mb"] - after if after is not None else None}
    s["rss_vs_models"] = rss
    if _ok(r.get("score")) and _ok(r.get("score_bf16")):
        s["bf16"] = mloss_agreement(str(work / "score.mloss.pt"), str(work / "score_bf16.mloss.pt"))
    parity = {}
    if _ok(r.get("ties_tensor_mk")) and _ok(mk) and mk.get("tasks") == q:
        parity["ties_tensor_mk (mergekit convention) vs mergekit"] = max_abs_diff(outs / "ties_tensor_mk",
                                                                                  outs / "mergekit_ties")
    if _ok(tg) and _ok(fb):
        parity["ties_global_fb (fusion_bench convention) vs fusion-bench"] = max_abs_diff(outs / "ties_global_fb",
                                                                                         outs / "fusion_bench_ties")
    s["parity"] = parity
    if layers is not None:
        full = SHAPES[shape]["num_hidden_layers"]
        s["full_depth_estimate"] = {
            "note": f"crude linear extrapolation x{full}/{layers} of the inner times (embeddings, load and save are "
                    "also scaled, so it overestimates slightly)",
            **{name: res["child"]["inner_s"] * full / layers for name, res in r.items()
               if _ok(res) and res.get("child", {}).get("inner_s") is not None},
        }
    return s


def _fmt(x, nd=1):
    return "—" if x is None else f"{x:.{nd}f}"


def render_markdown(p: dict) -> str:
    m, s = p["machine"], p["summary"]
    q, model_mb = p["q"], s["model_mb"]
    shape = p["shape"] + (f" (num_hidden_layers overridden to {p['layers_override']})" if p["layers_override"] else "")
    lines = [
        f"# merge_speed: {shape}, q = {q}, device {p['device']}",
        "",
        f"- Date (UTC): {m['date_utc']}",
        f"- Command: `{m['command']}` (cwd `{m['cwd']}`)",
        f"- Machine: {m['cpu_model']}, {m['cpu_affinity'] or m['cpu_count']} usable cores "
        f"(torch threads {m['torch_threads']}), {m['ram_gb']} GB RAM, avx512_bf16/amx_bf16: {m['cpu_bf16']}"
        + (f", GPU {m['gpu']}" if m.get("gpu") else ""),
        f"- Software: Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"hf_mloss {m['hf_mloss']}"
        + "".join(f", {peer} {m[f'{peer}_versions'].get(peer.replace('_', '-'), '?')}"
                  for peer in PEERS if f"{peer}_versions" in m),
        f"- Load average (1/5/15 min) at start {tuple(round(x, 2) for x in m['loadavg_start'])}, at end "
        f"{tuple(round(x, 2) for x in m['loadavg_end'])}. Other jobs shared the cores, so timings are noisy.",
        f"- Inputs: random-init CLIP vision tower ({p['models']['num_params'] / 1e6:.2f} M params, "
        f"{model_mb:.1f} MB fp32 safetensors each), {q} fine-tunes = base + task vector "
        f"(std {p['task_vectors']['std']}, "
        f"per-tensor scale {p['task_vectors']['per_tensor_scale']}); {p['num_samples']} random images "
        f"(preprocessed tensor), batch {p['batch_size']}. Checkpoints are in the page cache (warm reads).",
        f"- TIES everywhere: keep k = {p['k']} (mergekit density {p['k']}, fusion-bench threshold {p['k'] * 100:g}), "
        "λ = 1, disjoint mean.",
        "",
        "Wall, CPU (user+sys) and peak RSS are per process (`os.wait4` rusage of the child; peers measured by "
        "`benchmarks/peers/run_peer.py` the same way). They include interpreter start-up, imports, loading and "
        "saving. *inner* is the library call alone: `merge()`, `score()`, the forward loop, or fusion-bench's merge "
        "step.",
        "",
        "| run | library / method | tasks | wall s | inner s | CPU s | CPU/wall | peak RSS MB | RSS / (2 × model) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    desc = {
        "forward": "plain CLIPVisionModel forward (fp32, inference_mode); inner = best of the passes",
        "score": "hf_mloss.score(prefix='base'), fp32",
        "score_bf16": "hf_mloss.score(prefix='base'), compute_dtype=bfloat16",
        "ties_tensor": "hf_mloss ties, scope tensor (default convention)",
        "ties_tensor_mk": "hf_mloss ties, convention mergekit (exact k by argsort; parity run)",
        "ties_global": "hf_mloss ties, scope global (exact two-pass threshold)",
        "dare": "hf_mloss dare (DARE-TIES, p=0.7)",
        "task_arithmetic": "hf_mloss task_arithmetic (λ=0.3)",
        "m_ties": "hf_mloss m_ties (k=0.2, e=0.1, prefix merged)",
        "m_ties_bf16": "hf_mloss m_ties, same, compute_dtype=bfloat16 (scoring in bf16)",
        "ties_global_fb": "hf_mloss ties, global, convention fusion_bench",
        "mergekit_ties": "mergekit-yaml ties (density 0.2, normalize)",
        "fusion_bench_ties": "fusion-bench TiesMergingAlgorithm (dis-mean)",
    }
    for name, res in p["runs"].items():
        label = desc.get(name, name)
        if "skipped" in res:
            lines.append(f"| {name} | {label} | {res.get('tasks', q)} | skipped: {res['skipped']} | | | | | |")
            continue
        if "error" in res:
            lines.append(f"| {name} | {label} | {res.get('tasks', q)} | FAILED: {res['error'][:200]!r} | | | | | |")
            continue
        inner = (res.get("child") or {}).get("inner_s")
        rel = res["max_rss_mb"] / (2 * model_mb) if name not in MEASURE_RUNS else None
        tasks = "—" if name == "forward" else res.get("tasks", q)
        lines.append(f"| {name} | {label} | {tasks} | {_fmt(res['wall_s'])} | {_fmt(inner)} | "
                     f"{_fmt(res['cpu_s'])} | {_fmt(res['cpu_s'] / res['wall_s'], 2)} | {res['max_rss_mb']:.0f} | "
                     f"{_fmt(rel, 2) if rel is not None else ''} |")
    lines += ["", f"Model size: {model_mb:.1f} MB, so base + merged model = 2 × {model_mb:.1f} = "
                  f"{2 * model_mb:.1f} MB.", ""]
    if "forward_s" in s:
        fwd = p["runs"]["forward"]["child"]
        lines.append(f"Forward F = {s['forward_s']:.2f} s for {p['num_samples']} images (passes: "
                     + ", ".join(f"{x['wall_s']:.2f} s" for x in fwd["passes"])
                     + f"; attention {fwd.get('attn_implementation')}). Scoring floor (1 + q/3)·F = "
                     f"{s['floor_forwards']:.2f} × F = {s['score_floor_s']:.1f} s.")
        lines.append("")
    if s["ratios"]:
        lines += ["## Ratios vs targets", "", "| ratio | value | target | met | numerator / denominator | basis |",
                  "|---|---|---|---|---|---|"]
        for key, v in s["ratios"].items():
            tgt = f"≤ {v['target']}" if v.get("target") is not None else "—"
            met = {True: "yes", False: "**no**", None: "—"}[v.get("meets_target")]
            nd = f"{v['num']:.1f} / {v['den']:.1f}" if "num" in v else ""
            lines.append(f"| {key} | {v['value']:.3f} | {tgt} | {met} | {nd} | {v.get('note', '')} |")
        lines.append("")
    if s.get("rss_vs_models"):
        lines += ["## Peak RSS of each hf_mloss merge vs base + merged model", "",
                  f"Reference figure: 2 × {model_mb:.1f} MB = {2 * model_mb:.1f} MB.", "",
                  "| run | peak RSS MB | / (2 × model) | child's own VmHWM MB | RSS after imports MB "
                  "| peak − imports MB |", "|---|---|---|---|---|---|"]
        for name, v in s["rss_vs_models"].items():
            lines.append(f"| {name} | {v['peak_mb']:.0f} | {v['over_two_models']:.2f} | "
                         f"{_fmt(v.get('child_vmhwm_mb'), 0)} | {_fmt(v.get('after_imports_mb'), 0)} | "
                         f"{_fmt(v.get('above_imports_mb'), 0)} |")
        parent = p.get("parent_peak_rss_mb_during_runs")
        lines += ["", "Peak RSS is `ru_maxrss` from `os.wait4`, which on Linux is at least the parent's peak RSS at "
                  "spawn time; the parent stayed at "
                  + (f"{parent:.0f} MB" if parent is not None else "an unrecorded size")
                  + " until the timed runs were over. *child's own VmHWM* is the child's /proc high-water mark."]
        lines.append("")
    if s.get("bf16"):
        b = s["bf16"]
        lines += ["## bf16 scoring vs fp32 (prefix base)", "",
                  f"- Layer M-Loss relative error: max {b['layer_rel_err_max']:.2e}, "
                  f"mean {b['layer_rel_err_mean']:.2e}",
                  f"- Spearman ρ of node M-Loss per layer: min {b['node_spearman_min']:.4f}, "
                  f"mean {b['node_spearman_mean']:.4f}", ""]
    if s.get("parity"):
        lines += ["## Output parity with the peers", ""]
        for key, v in s["parity"].items():
            if "error" in v:
                lines.append(f"- {key}: {v['error']}")
            else:
                lines.append(f"- {key}: max |Δ| = {v['max_abs_diff']:.2e} over {v['tensors_compared']} tensors"
                             + (f" (worst: {v['worst_tensor']})" if v["worst_tensor"] else "")
                             + f"; {v['entries_differing_gt_1e-6']} of {v['entries_compared']:,} entries "
                               "differ by > 1e-6"
                             + (f"; keys not shared: {v['keys_not_shared']}" if v["keys_not_shared"] else ""))
        lines += ["", "hf_mloss's `mergekit` convention keeps exactly k entries per tensor in argsort order and its "
                  "`fusion_bench` convention gives exact-zero sums the model-wide majority sign, as the peers do; "
                  "with these rules the outputs match entry for entry (earlier runs, before the rules, differed on "
                  "70 and 3 of 87.5 M entries).", ""]
    if s.get("full_depth_estimate"):
        est = dict(s["full_depth_estimate"])
        lines += ["## Full-depth estimate", "", est.pop("note"), ""]
        lines += [f"- {k}: {v:.0f} s" for k, v in est.items()]
        lines.append("")
    if p["skipped"]:
        lines += ["## Skipped", ""] + [f"- {k}: {v}" for k, v in p["skipped"].items()] + [""]
    if p.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in p["notes"]] + [""]
    if p["rss_guard"]["killed"]:
        lines += ["## Killed by the RSS guard", ""] + [f"- {k}" for k in p["rss_guard"]["killed"]] + [""]
    return "\n".join(lines)


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
    ap.add_argument("--methods", default=None,
                    help=f"comma-separated subset of {','.join(ALL_RUNS)} (default: all)")
    ap.add_argument("--skip-peers", action="store_true", help="do not run mergekit / fusion-bench")
    ap.add_argument("--peers", default="mergekit,fusion_bench")
    ap.add_argument("--fusion-bench-tasks", type=int, default=4,
                    help="tasks given to fusion-bench (8 ViT-B/32 tasks need ~25 GB; skipped above --rss-limit-gb)")
    ap.add_argument("--forward-repeats", type=int, default=2)
    ap.add_argument("--rss-limit-gb", type=float, default=20.0,
                    help="kill any run whose process tree exceeds this RSS")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="where models, images and run outputs live")
    ap.add_argument("--results-dir", default=str(DEFAULT_RESULTS))
    ap.add_argument("--tag", default=None, help="results file suffix (default: <shape>_<device>; b32: <device>)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep the merged models under the cache")
    ap.add_argument("--render", metavar="JSON", help="only re-write the Markdown of an existing results JSON")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    if args.render:
        src = Path(args.render)
        src.with_suffix(".md").write_text(render_markdown(json.loads(src.read_text())))
        return 0
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return main_run(args)


if __name__ == "__main__":
    raise SystemExit(main())
