"""Shared fixtures: tiny CLIP vision towers saved with save_pretrained, an image folder, an isolated HF home."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

# Hub access is never needed: isolate caches and tokens, and make any accidental Hub call fail fast.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(autouse=True)
def _isolated_hf_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.getbasetemp() / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture(autouse=True)
def _threads_fixed_per_run(monkeypatch):
    """Each run on one thread unless a test asks for more (``HF_MLOSS_THREADS``). By default a run takes the cores
    other processes leave idle, and a matrix product split over 2 threads can differ in the last bit from one on 1
    (MKL splits a float64 [96, 200] x [200, 96] product by its inner dimension), so two runs compared bit for bit
    could differ with the load of the test workers beside them. Tests of that default unset the variable."""
    monkeypatch.setenv("HF_MLOSS_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A tiny base and 3 fine-tunes (hidden 32, 2 blocks, 32px images) saved with save_pretrained."""
    from examples.tiny import make_tiny_setup

    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), q=3, seed=0)


@pytest.fixture(scope="session")
def tiny_paths(tiny_models) -> tuple[str, list[str]]:
    base, models = tiny_models
    return str(base), [str(m) for m in models]


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    from examples.tiny import make_image_folder

    return make_image_folder(tmp_path_factory.mktemp("images"), n=12, size=40)


# ------------------------------------------------------------------------------------------------ peer environments
# The parity tests (marker `peers`) need mergekit / fusion-bench virtual environments. The test command never builds
# them from the package index: they run when the environments exist (`python benchmarks/peers/setup_envs.py`, once,
# into $HF_MLOSS_PEER_ENVS or benchmarks/.cache/peer-envs) and are skipped with that command otherwise. CI (`CI`
# set) builds them first and requires them; HF_MLOSS_BUILD_PEER_ENVS=1 lets a test build a missing one.
#
# Two layers: `ensure_env` itself is wrapped for the whole session (any test, whatever its name, that asks for a
# missing environment is skipped before anything is created), and a test whose name names its peer is skipped before
# its fixtures are built (a fast path only).
_PEERS_BY_TEST = {"mergekit": ("mergekit",), "fusion_bench": ("fusion_bench",), "both_peers": ("mergekit", "fusion_bench")}


def _may_build_peer_envs() -> bool:
    return bool(os.environ.get("CI")) or os.environ.get("HF_MLOSS_BUILD_PEER_ENVS") == "1"


def _missing_envs_reason(missing, root) -> str:
    return (f"peer environment(s) {', '.join(missing)} not built in {root}: run `python "
            f"benchmarks/peers/setup_envs.py {' '.join(missing)}` once (needs the package index), or set "
            "HF_MLOSS_PEER_ENVS to where they were built")


# ------------------------------------------------------------------------------------------------------ the tiers
# `python -m pytest` (the README's command) runs the default tier: everything but the tests marked `slow` (other
# processes, whole suites, kill and signal tests) and `peers` (side environments), on one pytest-xdist worker per
# core; `--tier slow` runs only those, `--tier all` runs everything, both in one process. CI runs the default tier,
# then `--tier slow`.
TIERS = ("default", "slow", "all")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier", choices=TIERS, default="default",
                     help="default: the quick tier (the README's command); slow: only the tests marked slow or peers "
                          "(processes, suites, peer parity); all: every test")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier = config.getoption("--tier")
    if tier == "all":
        return
    kept, dropped = [], []
    for item in items:
        slow = item.get_closest_marker("slow") is not None or item.get_closest_marker("peers") is not None
        (kept if slow == (tier == "slow") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, pyproject.toml): the default tier on one worker per core (at most 4; each imports
    torch and transformers), files kept whole on a worker (``--dist loadfile``, so module fixtures are built once);
    the slow tier in this process, its tests start processes of their own and some time signals.
    PYTEST_XDIST_AUTO_NUM_WORKERS overrides; ``-n 0`` runs everything here."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if config.getoption("--tier") != "default":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, 4)


def pytest_report_header(config: pytest.Config) -> str:
    tier = config.getoption("--tier")
    return {"default": "tier default: the slow and peer tests are left out (run them with --tier slow, or "
                       "everything with --tier all)",
            "slow": "tier slow: only the tests marked slow or peers",
            "all": "tier all: every test"}[tier]


def pytest_configure(config: pytest.Config) -> None:
    try:
        from benchmarks.peers import setup_envs
    except ImportError:
        return  # not run from the repository root: the peer tests skip themselves
    build = setup_envs.ensure_env
    if getattr(build, "offline_guard", False):
        return

    @functools.wraps(build)
    def ensure_env_or_skip(name: str, *args, **kwargs):
        """`ensure_env` under the test command: an environment that is not built skips the test, never builds."""
        key = setup_envs.normalize_peer(name)
        if not _may_build_peer_envs() and (kwargs.get("force") or setup_envs.env_info(key) is None):
            pytest.skip(_missing_envs_reason([key], setup_envs.envs_root()))
        return build(name, *args, **kwargs)

    ensure_env_or_skip.offline_guard = True
    setup_envs.ensure_env = ensure_env_or_skip


def _peers_needed(item: pytest.Item) -> tuple[str, ...]:
    if item.get_closest_marker("peers") is None or item.path.name != "test_peers.py":
        return ()
    return tuple(dict.fromkeys(p for key, peers in _PEERS_BY_TEST.items() if key in item.name for p in peers))


def pytest_runtest_setup(item: pytest.Item) -> None:
    needed = _peers_needed(item)
    if not needed or _may_build_peer_envs():
        return
    try:
        from benchmarks.peers import setup_envs
    except ImportError:
        return  # not run from the repository root: the test module skips itself
    missing = [name for name in needed if setup_envs.env_info(name) is None]
    if missing:
        pytest.skip(_missing_envs_reason(missing, setup_envs.envs_root()))


@pytest.fixture(scope="session", autouse=True)
def _one_mergekit_process():
    """Every ``mergekit-yaml`` run of the session goes through one long-lived mergekit process, started at the first
    run (the same entry point and arguments; ~6.5 s of interpreter start and imports saved per run)."""
    try:
        from benchmarks.peers.run_peer import one_mergekit_process
    except ImportError:  # not run from the repository root: the parity tests skip themselves
        yield
        return
    with one_mergekit_process():
        yield


@pytest.fixture
def records(monkeypatch) -> list:
    """What each learned merge's training run measured (its ``LearnRecord``: the objective trace), in run order."""
    from hf_mloss.merging import learned

    seen = []
    original = learned._learn

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out[1])
        return out

    monkeypatch.setattr(learned, "_learn", spy)
    return seen
