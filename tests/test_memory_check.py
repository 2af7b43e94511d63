"""A merge that holds the whole model is refused before any work when the copies it must hold pass the device's
memory (hf_mloss.merging.memory), with the figures; the merges that fit run as before.

The device's memory is set by patching :func:`~hf_mloss.merging.memory.memory_limit` to just above what one held
model needs, so one run fits and a search (three copies of its merged tensors) does not.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import yaml
from safetensors import safe_open

import hf_mloss
from hf_mloss.cli import main
from hf_mloss.merging import memory


def _model_bytes(base: str) -> int:
    """The base checkpoint's entries × 4 bytes (float32: the working dtype of every data-guided merge)."""
    with safe_open(f"{base}/model.safetensors", framework="pt") as handle:
        return sum(math.prod(handle.get_slice(k).get_shape()) for k in handle.keys()) * 4


@pytest.fixture
def one_model_fits(tiny_paths, monkeypatch) -> int:
    limit = _model_bytes(tiny_paths[0]) + 1024
    monkeypatch.setattr(memory, "memory_limit", lambda device: limit)
    return limit


def _merge(paths, method, **kwargs):
    base, models = paths
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_mloss.merge(base, models, method, progress=False, **kwargs)


def test_a_merge_holding_one_model_runs_when_one_model_fits(tiny_paths, image_folder, one_model_fits):
    plain = _merge(tiny_paths, "ties", k=0.2)
    guided = _merge(tiny_paths, "m_ties", data=str(image_folder), num_samples=8)
    assert plain.model is not None and guided.model is not None


@pytest.mark.parametrize("method, options, why, copies", [
    ("auto", {"candidates": {"tsv_m": {"lam": [1.0]}}}, "method='auto' compares each candidate on a scratch copy", 2),
    ("ties", {"select": "unlabeled", "grid": {"lam": [0.5, 1.0]}}, "label-free selection (select=...) compares", 2),
    ("adamerging", {"objective": "output_gap", "steps": 1}, "AdaMerging trains its coefficients on the whole model",
     1),
])
def test_a_search_or_a_learned_merge_that_cannot_hold_its_copies_is_refused_before_loading(
        tiny_paths, image_folder, one_model_fits, monkeypatch, method, options, why, copies):
    from hf_mloss.loading.inputs import RunInputs

    monkeypatch.setattr(RunInputs, "load_output_model", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(hf_mloss.InvalidParameterError) as err:
        _merge(tiny_paths, method, data=str(image_folder), num_samples=8, **options)
    message = " ".join(str(err.value).split())
    assert message.startswith(f"Not enough memory: {why}")
    assert f"(the model in float32 and {copies} more of its merged tensors)" in message
    assert f"more than this machine's RAM and swap ({one_model_fits / 1e9:.1f} GB)" in message
    assert "Nothing was loaded or written" in message and "m_ties, m_dare, regmean, regmean_plusplus" in message


def test_the_figure_is_the_model_plus_the_searchs_copies(tiny_paths, image_folder, monkeypatch):
    """The need is the whole model plus 2 copies of the merged tensors: refused one byte below it, run at it."""
    from hf_mloss.loading.inputs import open_inputs
    from hf_mloss.spec.config import MergeConfig

    config = MergeConfig.from_kwargs(tiny_paths[0], tiny_paths[1], "auto", data=str(image_folder),
                                     candidates={"tsv_m": {"lam": [1.0]}})
    with open_inputs(config, device="cpu", needs_data=False, progress=False) as inputs:
        merged = sum(math.prod(inputs.base.shapes[n]) for n in inputs.names) * 4
    need = _model_bytes(tiny_paths[0]) + 2 * merged
    assert 0 < merged <= _model_bytes(tiny_paths[0])
    monkeypatch.setattr(memory, "memory_limit", lambda device: need - 1)
    with pytest.raises(hf_mloss.InvalidParameterError, match="Not enough memory"):
        _merge(tiny_paths, "auto", data=str(image_folder), num_samples=8, candidates={"tsv_m": {"lam": [1.0]}})
    monkeypatch.setattr(memory, "memory_limit", lambda device: need)
    assert _merge(tiny_paths, "auto", data=str(image_folder), num_samples=8,
                  candidates={"tsv_m": {"lam": [1.0]}}).config.parameters["chosen"]["method"] == "tsv_m"


def test_the_cli_leaves_no_output_folder(tiny_paths, image_folder, one_model_fits, tmp_path, capsys):
    base, models = tiny_paths
    config = tmp_path / "auto.yaml"
    config.write_text(yaml.safe_dump({"base": base, "models": models, "method": "auto",
                                      "parameters": {"candidates": ["tsv_m"]},
                                      "data": {"path": str(image_folder), "num_samples": 8}}))
    out = tmp_path / "merged"
    assert main(["merge", str(config), str(out), "-q"]) == 2
    assert "Not enough memory: method='auto'" in capsys.readouterr().err
    assert not out.exists()


def test_the_device_limit_is_the_machines_memory_and_swap(monkeypatch, tmp_path):
    """RAM and swap, or a control group's limit (and swap) where it is lower; "max" sets no limit."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    swap = memory._swap_total()
    assert 256 * 2 ** 20 <= memory.memory_limit("cpu") <= ram + swap
    limit = tmp_path / "memory.max"
    limit.write_text(f"{ram // 4}\n")
    monkeypatch.setattr(memory, "CGROUP_FILES", (str(tmp_path / "absent"), str(limit)))
    assert memory.memory_limit("cpu") == ram // 4 + swap
    limit.write_text("max\n")
    assert memory.memory_limit("cpu") == ram + swap
    assert memory.memory_limit(torch.device("meta")) is None
