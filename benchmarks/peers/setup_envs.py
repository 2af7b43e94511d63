"""Create isolated virtual environments for the peer merging libraries and older transformers releases.

Each peer (mergekit, fusion-bench, transformers 4.57 / 5.5) gets its own venv so that its pinned
dependencies never touch the interpreter that runs hf_mloss.  Environments are
created on demand under a cache folder:

* default: ``benchmarks/.cache/peer-envs/<name>`` (git-ignored),
* override: the ``HF_MLOSS_PEER_ENVS`` environment variable.

``torch==2.13.0`` is installed first, on its own: the machine ships a local CPU
wheel for it (via pip's ``find-links``), while an unpinned torch pulled in as a
dependency would resolve to a multi-GB CUDA build from PyPI.  The peer package
is installed afterwards and finds torch already satisfied.

A successful install writes a marker file (``hf_mloss_peer.json``) holding the
installed versions and install times; later calls return immediately.

Usage::

    python benchmarks/peers/setup_envs.py                 # both peers
    python benchmarks/peers/setup_envs.py mergekit --force

    from benchmarks.peers.setup_envs import ensure_env
    py = ensure_env("mergekit")      # Path to the venv's python, or None
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PEERS",
    "PeerSpec",
    "ensure_env",
    "env_dir",
    "env_info",
    "envs_root",
    "normalize_peer",
    "venv_bin",
]

ENV_VAR = "HF_MLOSS_PEER_ENVS"
MARKER = "hf_mloss_peer.json"
TORCH_SPEC = "torch==2.13.0"
DEFAULT_ROOT = Path(__file__).resolve().parents[1] / ".cache" / "peer-envs"


@dataclass(frozen=True)
class PeerSpec:
    """What to install for one peer and which distributions to report."""

    name: str
    packages: tuple[str, ...]
    report: tuple[str, ...]


PEERS: dict[str, PeerSpec] = {
    "mergekit": PeerSpec(
        "mergekit",
        ("mergekit==0.1.5",),
        ("mergekit", "torch", "transformers", "safetensors"),
    ),
    "fusion_bench": PeerSpec(
        "fusion_bench",
        ("fusion-bench==0.2.33",),
        ("fusion-bench", "torch", "transformers", "safetensors"),
    ),
    # Plain transformers releases, to check that saved merges load in the versions users have: the last 4.x (still
    # the most installed) and the last release before CLIPVisionModel lost its inner ``vision_model`` (5.6).
    "transformers_4": PeerSpec(
        "transformers_4",
        ("transformers==4.57.6",),
        ("transformers", "torch", "safetensors", "huggingface-hub"),
    ),
    "transformers_5_5": PeerSpec(
        "transformers_5_5",
        ("transformers==5.5.4",),
        ("transformers", "torch", "safetensors", "huggingface-hub"),
    ),
}


def normalize_peer(name: str) -> str:
    """Map ``fusion-bench``/``fusion_bench``/``FusionBench`` style names to a key of PEERS."""
    key = name.strip().lower().replace("-", "_")
    if key == "fusionbench":
        key = "fusion_bench"
    if key not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {sorted(PEERS)}")
    return key


def envs_root() -> Path:
    """Folder that holds all peer venvs (``$HF_MLOSS_PEER_ENVS`` or the default cache)."""
    override = os.environ.get(ENV_VAR)
    return Path(override).expanduser().resolve() if override else DEFAULT_ROOT


def env_dir(name: str) -> Path:
    """Folder of one peer's venv."""
    return envs_root() / normalize_peer(name)


def venv_bin(name: str, exe: str = "python") -> Path:
    """Path of an executable (``python``, ``mergekit-yaml``, ...) inside a peer venv."""
    sub = "Scripts" if os.name == "nt" else "bin"
    return env_dir(name) / sub / exe


def env_info(name: str) -> dict | None:
    """Contents of the marker file of an installed peer venv, or None if not installed."""
    marker = env_dir(name) / MARKER
    if not marker.is_file() or not venv_bin(name).exists():
        return None
    try:
        return json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _run(cmd: list[str], timeout: float, log) -> tuple[bool, float, str]:
    """Run one install step; return (ok, seconds, tail of output)."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - start, f"timed out after {timeout:.0f} s"
    except OSError as exc:
        return False, time.perf_counter() - start, str(exc)
    log.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n")
    return proc.returncode == 0, time.perf_counter() - start, proc.stdout[-3000:]


def _versions(python: Path, dists: tuple[str, ...]) -> dict[str, str]:
    """Installed versions of ``dists`` inside the venv of ``python``."""
    code = (
        "import json, sys\n"
        "from importlib.metadata import version, PackageNotFoundError\n"
        "out = {}\n"
        "for d in sys.argv[1:]:\n"
        "    try: out[d] = version(d)\n"
        "    except PackageNotFoundError: out[d] = None\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([str(python), "-c", code, *dists], check=False, capture_output=True, text=True, timeout=120)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def ensure_env(
    name: str,
    *,
    force: bool = False,
    step_timeout: float = 1800.0,
    quiet: bool = False,
) -> Path | None:
    """Return the python of the peer's venv, creating and installing it if needed.

    Returns None (after printing the reason) when any install step fails, e.g.
    without network access.  ``force`` rebuilds the venv from scratch.
    """
    key = normalize_peer(name)
    spec = PEERS[key]
    target = env_dir(key)
    python = venv_bin(key)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))

    if not force and env_info(key) is not None:
        return python
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)

    # Base the venv on the real interpreter even if we run from another venv.
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    steps = [
        ("venv", [base_python, "-m", "venv", str(target)]),
        ("torch", [*pip, TORCH_SPEC]),
        (key, [*pip, *spec.packages]),
    ]
    timings: dict[str, float] = {}
    with open(target.parent / f"{key}.install.log", "w") as log:
        for label, cmd in steps:
            say(f"[peer-envs] {key}: installing {label} ...")
            ok, secs, tail = _run(cmd, step_timeout, log)
            timings[label] = round(secs, 1)
            if not ok:
                say(f"[peer-envs] {key}: step {label!r} failed after {secs:.0f} s; the peer is unavailable.\n{tail}")
                return None
            say(f"[peer-envs] {key}: {label} done in {secs:.1f} s")

    info = {
        "peer": key,
        "packages": list(spec.packages),
        "torch_spec": TORCH_SPEC,
        "python": str(python),
        "versions": _versions(python, spec.report),
        "install_seconds": timings,
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (target / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    say(f"[peer-envs] {key}: ready at {target} ({info['versions']})")
    return python


def main(argv: list[str] | None = None) -> int:
    """CLI: install the named peers (default: all); exit 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("peers", nargs="*", default=sorted(PEERS), help="peers to install")
    parser.add_argument("--force", action="store_true", help="rebuild existing venvs")
    args = parser.parse_args(argv)
    failed = 0
    for name in args.peers:
        python = ensure_env(name, force=args.force)
        if python is None:
            failed += 1
        else:
            print(json.dumps(env_info(name), indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
