"""The real-Hub examples are not run here (no network): check that they compile, validate and agree."""

from __future__ import annotations

import importlib.util
import py_compile
from pathlib import Path

import pytest

from hf_mloss.spec.config import MergeConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TASKS = ["sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd"]


@pytest.fixture(scope="module")
def example_module():
    path = EXAMPLES / "merge_clip_vit_b32_8tasks.py"
    spec = importlib.util.spec_from_file_location("merge_clip_vit_b32_8tasks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines constants and functions only; main() is not run
    return module


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_example_scripts_compile(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_validate(path):
    MergeConfig.from_yaml(path)  # no network: validation never downloads


def test_clip_vit_b32_8tasks_config():
    config = MergeConfig.from_yaml(EXAMPLES / "merge_clip_vit_b32_8tasks.yaml")
    assert config.base.model == "openai/clip-vit-base-patch32"
    assert [m.model for m in config.models] == [f"tanganke/clip-vit-base-patch32_{t}" for t in TASKS]
    assert all(m.weight is None and m.revision is None for m in config.models)
    assert config.method == "m_ties" and config.parameters == {"k": 0.2, "e": 0.1}
    assert config.data.id == "tanganke/dtd" and config.data.split == "train" and config.data.num_samples == 128
    assert config.score.prefix == "own"


def test_python_example_matches_the_yaml(example_module):
    """The Python example's merge() arguments describe the same run as the YAML (its score section aside)."""
    config = MergeConfig.from_yaml(EXAMPLES / "merge_clip_vit_b32_8tasks.yaml")
    m = example_module
    from_python = MergeConfig.from_kwargs(m.BASE, m.MODELS, m.METHOD, **m.DATA, **m.PARAMETERS, seed=m.SEED,
                                          batch_size=m.BATCH_SIZE)
    assert from_python == config.replace(score=None)


def test_python_example_pushes_only_when_asked(example_module):
    assert example_module.parse_args([]).push_to_hub is None
    assert example_module.parse_args(["--push-to-hub", "me/merged"]).push_to_hub == "me/merged"
