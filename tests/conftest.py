"""Shared fixtures: tiny CLIP vision towers saved with save_pretrained, an image folder, an isolated HF home."""

from __future__ import annotations

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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A tiny base and 3 fine-tunes (hidden 32, 2 blocks, 32px images) saved with save_pretrained."""
    from hf_mloss.testing import make_tiny_setup

    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), q=3, seed=0)


@pytest.fixture(scope="session")
def tiny_paths(tiny_models) -> tuple[str, list[str]]:
    base, models = tiny_models
    return str(base), [str(m) for m in models]


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    from hf_mloss.testing import make_image_folder

    return make_image_folder(tmp_path_factory.mktemp("images"), n=12, size=40)
