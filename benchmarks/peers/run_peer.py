"""Run a peer library's merge (mergekit or fusion-bench) on local checkpoints.

Each peer runs in its own venv (see ``setup_envs.py``) as a child process,
offline (``HF_HUB_OFFLINE=1``); its wall time and peak RSS are measured with
``os.wait4`` on that child.  Inputs are any checkpoint folders written by
``save_pretrained`` (``CLIPVisionModel``, ``LlamaForCausalLM``, ...); the
output folder gets the safetensors weights (one file or shards, see
``PeerRun.state_dict``) + ``config.json``.

Conventions (verified, see ``benchmarks/peers/README.md``):

* mergekit ``ties``: per-tensor exact top-k with k = max(1, floor(density*n)),
  sign elected on *weighted* trimmed deltas (zero -> +1), disjoint weighted
  mean (``normalize: true``), then ``base + lambda * merged``.
* fusion-bench ``TiesMergingAlgorithm``: one global trim per model over all
  state-dict tensors (sorted keys), threshold rule, sign of the plain sum,
  disjoint mean (``merge_func="mean"``), ``base + scaling_factor * merged``;
  no per-model weights.
* fusion-bench ``TaskSingularVectorMerging`` / ``ISO_C_Merge`` /
  ``ISO_CTS_Merge`` (methods ``tsv_m``, ``iso_c``, ``iso_cts``): every 2-D
  tensor through the SVD recipe, every other tensor the mean task vector, then
  ``base + scaling_factor * merged`` (TSV-M's scalar ``alpha``).

Usage::

    python benchmarks/peers/run_peer.py mergekit --base B --models M1 M2 M3 \\
        --out OUT --k 0.2 --lam 1.0 [--weights 1 0.5 2] [--method ties]

    from benchmarks.peers.run_peer import run_peer_ties
    run = run_peer_ties("fusion_bench", base, [m1, m2, m3], out, k=0.2)
    run.model_path, run.wall_s, run.max_rss_mb
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

try:  # imported as benchmarks.peers.run_peer
    from benchmarks.peers import setup_envs
    from benchmarks.peers.setup_envs import normalize_peer, venv_bin
except ImportError:  # run as a script from benchmarks/peers/
    import setup_envs  # type: ignore[no-redef]
    from setup_envs import normalize_peer, venv_bin  # type: ignore[no-redef]

__all__ = [
    "FUSION_BENCH_METHODS",
    "MERGEKIT_METHODS",
    "PeerError",
    "PeerRun",
    "PeerUnavailable",
    "fusion_bench_threshold",
    "mergekit_config",
    "one_mergekit_process",
    "run_fusion_bench_adamerging",
    "run_mergekit_moe",
    "run_peer_merge",
    "run_peer_ties",
]

MERGEKIT_METHODS = ("ties", "dare_ties", "dare_linear", "task_arithmetic", "linear")
MERGEKIT_RECIPE_METHODS = ("slerp", "model_stock", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear")
"""Further mergekit methods: ``slerp`` and ``model_stock`` take no weights; the others take ``density`` like ties."""
MERGEKIT_METHODS += MERGEKIT_RECIPE_METHODS
FUSION_BENCH_METHODS = ("ties", "task_arithmetic", "tsv_m", "iso_c", "iso_cts", "wudi", "average")
CHILD_SCRIPT = Path(__file__).resolve().with_name("_fusion_bench_child.py")
ADAMERGING_CHILD_SCRIPT = Path(__file__).resolve().with_name("_fusion_bench_adamerging_child.py")
REGMEAN_CHILD_SCRIPT = Path(__file__).resolve().with_name("_fusion_bench_regmean_child.py")
MERGEKIT_WORKER_SCRIPT = Path(__file__).resolve().with_name("_mergekit_worker.py")
DEFAULT_TIMEOUT = 1800.0


class PeerError(RuntimeError):
    """The peer ran but failed (non-zero exit, timeout or missing output)."""


class PeerUnavailable(PeerError):
    """The peer's venv could not be installed (e.g. no network)."""


@dataclass(frozen=True)
class PeerRun:
    """Result of one peer merge; ``os.fspath(run)`` is the output folder."""

    peer: str
    method: str
    out_dir: Path
    wall_s: float
    max_rss_mb: float
    log_path: Path

    @property
    def model_path(self) -> Path:
        """The merged ``model.safetensors`` (the first shard's name when the output is sharded)."""
        files = self.weight_files
        return files[0] if len(files) == 1 else self.out_dir / "model.safetensors"

    @property
    def weight_files(self) -> list[Path]:
        """Every safetensors file of the output: ``model.safetensors``, or the shards of a large model."""
        return sorted(self.out_dir.glob("*.safetensors"))

    def state_dict(self) -> dict:
        """Every merged tensor, read from all the output's safetensors files (any model family, sharded or not)."""
        from safetensors.torch import load_file

        state: dict = {}
        for file in self.weight_files:
            state.update(load_file(str(file)))
        return state

    def __fspath__(self) -> str:
        return str(self.out_dir)

    def to_dict(self) -> dict:
        """JSON-friendly view."""
        d = asdict(self)
        return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def fusion_bench_threshold(k: float) -> float:
    """fusion-bench ``threshold`` for keep fraction ``k`` in (0, 1).

    fusion-bench divides the threshold by 100 only when it is > 1, so
    ``k * 100`` (their percentage form, e.g. 20) is used when it exceeds 1 and
    the plain fraction otherwise (``k * 100 <= 1`` would be misread).
    k = 1 is rejected: fusion-bench then calls ``kthvalue(0)`` and crashes.
    """
    if not 0.0 <= k < 1.0:
        raise ValueError(f"fusion-bench TIES needs 0 <= k < 1, got {k}")
    pct = k * 100.0
    return pct if pct > 1.0 else k


def mergekit_config(
    method: str,
    base_dir: Path,
    model_dirs: Sequence[Path],
    *,
    k: float | None,
    lam: float = 1.0,
    weights: Sequence[float] | None = None,
    normalize: bool | None = None,
    dtype: str = "float32",
    parameters: dict | None = None,
) -> dict:
    """The mergekit YAML config (as a dict) for a task-vector method.

    ``normalize`` None keeps mergekit's per-method default, except for ``ties``
    where ``normalize: true`` (the TIES disjoint mean) is written explicitly.
    ``dtype`` is mergekit's output dtype (``bfloat16`` for bf16 checkpoints).
    ``parameters`` are further top-level mergekit parameters (``t``, ``gamma``,
    ``epsilon``, ``filter_wise``, ``rescale``...).
    """
    if method not in MERGEKIT_METHODS:
        raise ValueError(f"mergekit method must be one of {MERGEKIT_METHODS}, got {method!r}")
    if method in ("slerp", "model_stock"):
        return _mergekit_interpolation_config(method, base_dir, model_dirs, parameters or {})
    weights = list(weights) if weights is not None else [1.0] * len(model_dirs)
    if len(weights) != len(model_dirs):
        raise ValueError(f"got {len(weights)} weights for {len(model_dirs)} models")
    models = []
    for path, w in zip(model_dirs, weights, strict=True):
        params: dict = {"weight": float(w)}
        if method not in ("task_arithmetic", "linear"):
            if k is None:
                raise ValueError(f"mergekit {method} needs a density k")
            params["density"] = k if isinstance(k, (list, dict)) else float(k)  # a gradient / filter list as is
        models.append({"model": str(Path(path).resolve()), "parameters": params})
    shared: dict = {} if method == "linear" else {"lambda": lam if isinstance(lam, (list, dict)) else float(lam)}
    if normalize is None and method == "ties":
        normalize = True
    if normalize is not None:
        shared["normalize"] = bool(normalize)
    shared.update(parameters or {})
    config = {
        "merge_method": method,
        "base_model": str(Path(base_dir).resolve()),
        "models": models,
        "parameters": shared,
        "dtype": dtype,
    }
    if method == "linear":  # a plain average of the models; a base_model would be averaged in too
        del config["base_model"]
    return config


def _mergekit_interpolation_config(method: str, base_dir: Path, model_dirs: Sequence[Path], parameters: dict) -> dict:
    """slerp / model_stock as published recipes write them: the base listed among the models, no weights."""
    base = str(Path(base_dir).resolve())
    if method == "slerp" and len(model_dirs) != 1:
        raise ValueError(f"mergekit slerp takes the base and exactly one other model, got {len(model_dirs)}")
    if method == "slerp" and "t" not in parameters:
        raise ValueError("mergekit slerp needs parameters={'t': ...}")
    models = [{"model": base}] + [{"model": str(Path(p).resolve())} for p in model_dirs]
    return {"merge_method": method, "base_model": base, "models": models, "parameters": dict(parameters),
            "dtype": "float32"}


def _child_env(python: Path) -> dict[str, str]:
    """Environment for a peer child: its venv first on PATH, offline, no PYTHONPATH leak."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = str(python.parent.parent)
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _run_child(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> tuple[int, float, float]:
    """Run ``cmd``; return (exit code, wall seconds, peak RSS in MB of the child tree).

    ``os.wait4`` gives the rusage of exactly this child (including its reaped
    descendants), unlike ``getrusage(RUSAGE_CHILDREN)`` which is a running
    maximum over every child this process ever had.
    """
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = -signal.SIGKILL
                raise PeerError(f"timed out after {timeout:.0f} s: {' '.join(cmd)} (log {log_path})")
            time.sleep(0.02)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    # ru_maxrss is in KiB on Linux and bytes on macOS.
    rss_mb = usage.ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024)
    return proc.returncode, wall, rss_mb


class MergekitWorker:
    """``mergekit-yaml`` runs in one long-lived process of the mergekit venv (``_mergekit_worker.py``): the same
    entry point and arguments, without ~6.5 s of interpreter start and imports per run. For suites that run mergekit
    many times (the parity tests); a run's wall time then excludes the start and its RSS is not measured, so timing
    benchmarks keep a fresh process per run."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def run(self, python: Path, env: dict[str, str], argv: list[str], log_path: Path, timeout: float,
            command: str = "mergekit-yaml") -> int:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([str(python), str(MERGEKIT_WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=env, text=True, start_new_session=True)
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log_path), "command": command}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise PeerError(f"mergekit worker {'timed out after %.0f s' % timeout if not ready else 'exited'} "
                            f"(log {log_path}):\n{_log_tail(log_path)}")
        return int(json.loads(line)["rc"])

    def close(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


_MERGEKIT_WORKER: MergekitWorker | None = None


@contextlib.contextmanager
def one_mergekit_process():
    """Inside this block every mergekit run of this module goes through one :class:`MergekitWorker`."""
    global _MERGEKIT_WORKER
    _MERGEKIT_WORKER = MergekitWorker()
    try:
        yield _MERGEKIT_WORKER
    finally:
        _MERGEKIT_WORKER.close()
        _MERGEKIT_WORKER = None


def _run_mergekit(cmd: list[str], python: Path, log_path: Path, timeout: float) -> tuple[int, float, float]:
    """``mergekit-yaml`` or ``mergekit-moe`` (``cmd``) as :func:`_run_child` runs it, or through the open worker
    (RSS then NaN)."""
    env = _child_env(python)
    if _MERGEKIT_WORKER is None:
        return _run_child(cmd, env, log_path, timeout)
    log_path.write_text(f"$ {' '.join(cmd)}  (in one long-lived mergekit process)\n")
    start = time.perf_counter()
    rc = _MERGEKIT_WORKER.run(python, env, cmd[1:], log_path, timeout, command=Path(cmd[0]).name)
    return rc, time.perf_counter() - start, float("nan")


def _log_tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_peer_merge(
    peer: str,
    method: str,
    base_dir: str | Path,
    model_dirs: Sequence[str | Path],
    out_dir: str | Path,
    *,
    k: float | None = None,
    lam: float = 1.0,
    weights: Sequence[float] | None = None,
    normalize: bool | None = None,
    merge_func: str = "mean",
    common_space_fraction: float = 0.8,
    iter_num: int = 400,
    svc_alpha: float | None = None,
    seed: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    dtype: str = "float32",
    parameters: dict | None = None,
) -> PeerRun:
    """Merge ``model_dirs`` onto ``base_dir`` with a peer library; write ``out_dir``.

    ``peer``: "mergekit" or "fusion_bench".  ``method``: one of
    MERGEKIT_METHODS / FUSION_BENCH_METHODS.  ``k`` is the keep fraction
    (mergekit ``density``; fusion-bench ``threshold``), ``lam`` the final
    scale (mergekit ``lambda``; fusion-bench ``scaling_factor``).  ``weights``
    are mergekit per-model weights (fusion-bench has none: only all-ones is
    accepted).  ``normalize``, ``dtype`` (output dtype) and ``parameters`` (further
    top-level mergekit parameters) are mergekit-only, ``merge_func`` fusion-bench-only
    (TIES), ``common_space_fraction`` fusion-bench-only (``iso_cts``), ``iter_num``
    fusion-bench-only (``wudi``), ``svc_alpha`` fusion-bench-only (the merge then
    calibrated by its Singular Value Calibration at that alpha).
    Raises PeerUnavailable if the venv cannot be installed, PeerError on failure.
    """
    key = normalize_peer(peer)
    base_dir = Path(base_dir).resolve()
    model_dirs = [Path(p).resolve() for p in model_dirs]
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if not model_dirs:
        raise ValueError("need at least one model to merge")
    log_path = out_dir / "peer_run.log"

    if key == "mergekit":
        cfg = mergekit_config(method, base_dir, model_dirs, k=k, lam=lam, weights=weights, normalize=normalize,
                              dtype=dtype, parameters=parameters)
        cfg_path = out_dir / "peer_config.yml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        cmd = [
            str(venv_bin(key, "mergekit-yaml")),
            str(cfg_path),
            str(out_dir),
            "--no-copy-tokenizer",
            "--random-seed",
            str(seed),
        ]
    else:
        if method not in FUSION_BENCH_METHODS:
            raise ValueError(f"fusion-bench method must be one of {FUSION_BENCH_METHODS}")
        if weights is not None and any(float(w) != 1.0 for w in weights):
            raise ValueError("fusion-bench's methods here take no per-model weights")
        spec = {
            "method": method,
            "base_dir": str(base_dir),
            "model_dirs": [str(p) for p in model_dirs],
            "out_dir": str(out_dir),
            "scaling_factor": float(lam),
            "merge_func": merge_func,
            "seed": seed,
        }
        if method == "ties":
            if k is None:
                raise ValueError("fusion-bench TIES needs a keep fraction k")
            spec["threshold"] = fusion_bench_threshold(k)
        if method == "iso_cts":
            spec["common_space_fraction"] = float(common_space_fraction)
        if method == "wudi":
            spec["iter_num"] = int(iter_num)
        if svc_alpha is not None:
            spec["svc_alpha"] = float(svc_alpha)
        spec_path = out_dir / "peer_spec.json"
        spec_path.write_text(json.dumps(spec, indent=2) + "\n")
        cmd = [str(venv_bin(key)), str(CHILD_SCRIPT), str(spec_path)]

    # Inputs are validated above, before any (slow) install.
    python = setup_envs.ensure_env(key)
    if python is None:
        raise PeerUnavailable(f"{key} venv is not available (see the message above)")
    for stale in out_dir.glob("*.safetensors"):  # never report a stale output (single file or shards)
        stale.unlink()
    if key == "mergekit":
        rc, wall, rss = _run_mergekit(cmd, python, log_path, timeout)
    else:
        rc, wall, rss = _run_child(cmd, _child_env(python), log_path, timeout)
    if rc != 0:
        raise PeerError(f"{key} {method} exited with {rc}; log tail:\n{_log_tail(log_path)}")
    run = PeerRun(key, method, out_dir, round(wall, 3), round(rss, 1), log_path)
    if not run.weight_files:
        raise PeerError(f"{key} wrote no safetensors file in {out_dir}; log tail:\n{_log_tail(log_path)}")
    return run


def run_fusion_bench_adamerging(base_dir: str | Path, model_dirs: Sequence[str | Path], out_dir: str | Path, *,
                                data: str | Path, heads: str | Path, steps: int, lr: float = 1e-3,
                                init: float = 0.3, granularity: str = "layer",
                                timeout: float = DEFAULT_TIMEOUT) -> tuple[Any, list[str]]:
    """fusion-bench's CLIP layer-wise or task-wise AdaMerging (``CLIPLayerWiseAdaMergingAlgorithm``,
    ``CLIPTaskWiseAdaMergingAlgorithm``) on local CLIP vision checkpoints, with given zero-shot heads and test batches
    (one set for every task, or each task's own; see ``_fusion_bench_adamerging_child.py`` for the files): returns
    its learned ``merge_weight`` ([q, tensors] or [q]) and the parameter name of each column."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {"base_dir": str(Path(base_dir).resolve()), "model_dirs": [str(Path(p).resolve()) for p in model_dirs],
            "out_dir": str(out_dir), "data": str(Path(data).resolve()), "heads": str(Path(heads).resolve()),
            "steps": int(steps), "lr": float(lr), "init": float(init), "granularity": granularity}
    spec_path = out_dir / "peer_spec.json"
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    python = setup_envs.ensure_env("fusion_bench")
    if python is None:
        raise PeerUnavailable("fusion_bench venv is not available (see the message above)")
    log_path = out_dir / "peer_run.log"
    rc, _, _ = _run_child([str(python), str(ADAMERGING_CHILD_SCRIPT), str(spec_path)], _child_env(python), log_path,
                          timeout)
    if rc != 0:
        raise PeerError(f"fusion_bench adamerging exited with {rc}; log tail:\n{_log_tail(log_path)}")
    columns = json.loads((out_dir / "adamerging.json").read_text())["columns"]
    return load_file(str(out_dir / "merging_weights.safetensors"))["merge_weight"], columns


def run_fusion_bench_regmean(method: str, base_dir: str | Path, model_dirs: Sequence[str | Path], out_dir: str | Path,
                             *, data: str | Path, batch_size: int, reduce_non_diagonal_ratio: float = 0.95,
                             timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """fusion-bench's CLIP RegMean / RegMean++ (``method``: ``regmean`` | ``regmean_plusplus``) on local CLIP vision
    checkpoints, every model given the pixels of ``data`` (a safetensors file with ``pixels``), or each model its own
    (``pixels.{i}``); see ``_fusion_bench_regmean_child.py``: returns the merged ``state_dict``."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {"method": method, "base_dir": str(Path(base_dir).resolve()),
            "model_dirs": [str(Path(p).resolve()) for p in model_dirs], "out_dir": str(out_dir),
            "data": str(Path(data).resolve()), "batch_size": int(batch_size),
            "reduce_non_diagonal_ratio": float(reduce_non_diagonal_ratio)}
    spec_path = out_dir / "peer_spec.json"
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    python = setup_envs.ensure_env("fusion_bench")
    if python is None:
        raise PeerUnavailable("fusion_bench venv is not available (see the message above)")
    log_path = out_dir / "peer_run.log"
    rc, _, _ = _run_child([str(python), str(REGMEAN_CHILD_SCRIPT), str(spec_path)], _child_env(python), log_path,
                          timeout)
    if rc != 0:
        raise PeerError(f"fusion_bench {method} exited with {rc}; log tail:\n{_log_tail(log_path)}")
    return load_file(str(out_dir / "model.safetensors"))


def run_mergekit_yaml(config: dict, out_dir: str | Path, *, seed: int = 0,
                      timeout: float = DEFAULT_TIMEOUT) -> PeerRun:
    """Run ``mergekit-yaml`` on a raw mergekit config dict (slices, layer ranges...), written to
    ``out_dir/peer_config.yml``; the output lands in ``out_dir``.

    Raises PeerUnavailable if the venv cannot be installed, PeerError on failure.
    """
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "peer_run.log"
    cfg_path = out_dir / "peer_config.yml"
    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    python = setup_envs.ensure_env("mergekit")
    if python is None:
        raise PeerUnavailable("mergekit venv is not available (see the message above)")
    for stale in out_dir.glob("*.safetensors"):
        stale.unlink()
    cmd = [str(venv_bin("mergekit", "mergekit-yaml")), str(cfg_path), str(out_dir), "--no-copy-tokenizer",
           "--random-seed", str(seed)]
    rc, wall, rss = _run_mergekit(cmd, python, log_path, timeout)
    method = str(config.get("merge_method"))
    if rc != 0:
        raise PeerError(f"mergekit {method} exited with {rc}; log tail:\n{_log_tail(log_path)}")
    run = PeerRun("mergekit", method, out_dir, round(wall, 3), round(rss, 1), log_path)
    if not run.weight_files:
        raise PeerError(f"mergekit wrote no safetensors file in {out_dir}; log tail:\n{_log_tail(log_path)}")
    return run


def run_mergekit_moe(config: dict, out_dir: str | Path, *, seed: int = 0, device: str = "cpu",
                     allow_identical: bool = False, timeout: float = DEFAULT_TIMEOUT) -> PeerRun:
    """Run ``mergekit-moe`` on a raw mergekit-moe config dict (base_model, experts with prompts, gate_mode...),
    written to ``out_dir/peer_config.yml``; the MoE lands in ``out_dir/moe`` (mergekit-moe refuses nothing there,
    so the folder is emptied first). ``seed`` is mergekit's ``--random-seed`` (random gates and noise).

    Raises PeerUnavailable if the venv cannot be installed, PeerError on failure.
    """
    import shutil

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "peer_run.log"
    cfg_path = out_dir / "peer_config.yml"
    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    python = setup_envs.ensure_env("mergekit")
    if python is None:
        raise PeerUnavailable("mergekit venv is not available (see the message above)")
    model_dir = out_dir / "moe"
    shutil.rmtree(model_dir, ignore_errors=True)
    cmd = [str(venv_bin("mergekit", "mergekit-moe")), str(cfg_path), str(model_dir), "--random-seed", str(seed),
           "--device", device]
    if allow_identical:
        cmd.append("--i-understand-this-is-not-useful-without-training")
    rc, wall, rss = _run_mergekit(cmd, python, log_path, timeout)
    if rc != 0:
        raise PeerError(f"mergekit-moe exited with {rc}; log tail:\n{_log_tail(log_path)}")
    run = PeerRun("mergekit", f"moe-{config.get('gate_mode', 'hidden')}", model_dir, round(wall, 3), round(rss, 1),
                  log_path)
    if not run.weight_files:
        raise PeerError(f"mergekit-moe wrote no safetensors file in {model_dir}; log tail:\n{_log_tail(log_path)}")
    return run


def run_peer_ties(
    peer: str,
    base_dir: str | Path,
    model_dirs: Sequence[str | Path],
    out_dir: str | Path,
    *,
    k: float,
    lam: float = 1.0,
    weights: Sequence[float] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> PeerRun:
    """TIES with the peer's own conventions (mergekit: dis-mean, normalize on;
    fusion-bench: ``merge_func="mean"``); see ``run_peer_merge``."""
    return run_peer_merge(peer, "ties", base_dir, model_dirs, out_dir, k=k, lam=lam, weights=weights, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints the PeerRun as JSON."""
    p = argparse.ArgumentParser(description="Run a peer library's merge in its own venv.")
    p.add_argument("peer", choices=["mergekit", "fusion_bench", "fusion-bench"])
    p.add_argument("--method", default="ties")
    p.add_argument("--base", required=True, type=Path, help="base (pretrained) model folder")
    p.add_argument("--models", required=True, nargs="+", type=Path, help="fine-tuned folders")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--k", type=float, default=None, help="keep fraction / density")
    p.add_argument("--lam", type=float, default=1.0, help="lambda / scaling_factor")
    p.add_argument("--weights", type=float, nargs="+", default=None)
    p.add_argument("--merge-func", default="mean", help="fusion-bench TIES merge_func")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    a = p.parse_args(argv)
    try:
        run = run_peer_merge(
            a.peer,
            a.method,
            a.base,
            a.models,
            a.out,
            k=a.k,
            lam=a.lam,
            weights=a.weights,
            merge_func=a.merge_func,
            seed=a.seed,
            timeout=a.timeout,
        )
    except (PeerError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(run.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
