"""Hub-ready output: the saved folder, its model card, atomic writes and the golden demo card."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from transformers import AutoImageProcessor, CLIPVisionModel

import hf_mloss
from hf_mloss.spec.config import MERGE_CONFIG_NAME

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mties_result(tiny_paths, image_folder):
    base, models = tiny_paths
    return hf_mloss.merge(base, models, "m_ties", data=str(image_folder), num_samples=8, batch_size=4, k=0.3, e=0.1,
                          progress=False)


def test_saved_folder_loads_untouched(tmp_path, mties_result, caplog):
    out = mties_result.save_pretrained(tmp_path / "merged", max_shard_size="20KB")
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names and sum(n.endswith(".safetensors") for n in names) > 2
    for required in ["config.json", "preprocessor_config.json", "README.md", MERGE_CONFIG_NAME, "mloss.json",
                     "mloss_scores.safetensors", "mloss_heatmap.png"]:
        assert required in names
    with caplog.at_level(logging.WARNING):
        model, info = CLIPVisionModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert "missing" not in caplog.text.lower()
    for name, tensor in mties_result.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor)
    assert type(AutoImageProcessor.from_pretrained(out, backend="pil")).__name__.startswith("CLIPImageProcessor")
    report = hf_mloss.MLossReport.load(out)
    assert report.layers == mties_result.report.layers and report.keep_ratios


def test_card_metadata_and_mloss_table(tmp_path, mties_result):
    out = mties_result.save_pretrained(tmp_path / "card")
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "image-feature-extraction"
    assert {"merge", "hf_mloss", "m_ties"} <= set(data["tags"])
    assert "base_model" not in data  # local folders only: no local path may leak into the metadata
    assert "base_model_relation" not in data  # a relation to no base_model says nothing (the Hub reads them as a pair)
    rows = re.findall(r"^\| `encoder\.layers\.(\d+)\.mlp\.fc1` \|", card.text, flags=re.M)
    assert rows == ["0", "1"]
    assert "M-Loss: Quantifying Model Merging Compatibility" in card.text
    assert str(tmp_path) not in (out / "README.md").read_text()
    config = yaml.safe_load((out / MERGE_CONFIG_NAME).read_text())
    assert config["method"] == "m_ties" and config["parameters"]["k"] == 0.3 and config["data"]["num_samples"] == 8


def test_card_with_eval_results_and_hub_dataset(tmp_path, mties_result):
    import numpy as np

    # accuracies as the suites compute them (float32): the metadata gives 0.57, not 0.5699999928474426
    mties_result.eval_results = {"digits": 0.91, "shapes": 0.5, "texture": float(np.float32(0.57))}
    try:
        out = mties_result.save_pretrained(tmp_path / "evals")
    finally:
        mties_result.eval_results = {}
    card = ModelCard.load(out / "README.md")
    values = {r.dataset_name: r.metric_value for r in card.data.eval_results}
    assert values == {"digits": 0.91, "shapes": 0.5, "texture": 0.57}
    assert "value: 0.57\n" in (out / "README.md").read_text()
    assert "| digits | 91.00 % |" in card.text


def test_existing_folder_is_refused_then_replaced_atomically(tmp_path, tiny_paths):
    base, models = tiny_paths
    result = hf_mloss.merge(base, models, "average", progress=False)
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("user file")
    with pytest.raises(hf_mloss.OutputExistsError, match="overwrite=True"):
        result.save_pretrained(target)
    assert (target / "keep.txt").read_text() == "user file"
    with pytest.raises(hf_mloss.OutputExistsError, match="keep.txt"):  # not a folder hf_mloss wrote
        result.save_pretrained(target, overwrite=True)
    (target / "keep.txt").unlink()
    result.save_pretrained(target)
    (target / "README.md").write_text("edited card")  # a listed file edited: still hf_mloss's own folder
    result.save_pretrained(target, overwrite=True)
    assert (target / "model.safetensors").exists() and (target / "README.md").read_text() != "edited card"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary or backup folder left behind


def test_failed_write_leaves_no_folder(tmp_path, tiny_paths, monkeypatch):
    base, models = tiny_paths
    result = hf_mloss.merge(base, models, "average", progress=False)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("hf_mloss.output.checkpoint.save_torch_state_dict", boom)
    with pytest.raises(OSError, match="disk full"):
        result.save_pretrained(tmp_path / "never")
    assert list(tmp_path.iterdir()) == []


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+\.\d+e[+-]\d+", text)]


def test_golden_demo_card(tmp_path, monkeypatch):
    """model_cards/demo_m_ties.md is the card of the offline demo's M-TIES merge; regenerate and compare. The demo
    leaves no working folder behind in the temporary directory."""
    import tempfile

    from examples import demo

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    demo.main(["--out", str(tmp_path / "demo")])
    assert list(temp.iterdir()) == []
    fresh = (tmp_path / "demo" / "README.md").read_text()
    golden = (REPO / "model_cards" / "demo_m_ties.md").read_text()
    strip = lambda s: re.sub(r"\d+\.\d+e[+-]\d+", "<num>", s)  # noqa: E731
    assert strip(fresh) == strip(golden)
    assert _numbers(fresh) == pytest.approx(_numbers(golden), rel=1e-3)


def test_citations_name_only_what_was_used(tiny_paths, image_folder, tmp_path):
    """A data-free merge's card cites its method, not M-Loss; an M-TIES card cites M-Loss with its paper's link."""
    base, models = tiny_paths
    hf_mloss.merge(base, models, "ties", progress=False).save_pretrained(tmp_path / "ties")
    card = (tmp_path / "ties" / "README.md").read_text()
    assert "TIES-Merging" in card and "mloss2026" not in card and "M-Loss" not in card
    hf_mloss.merge(base, models, "m_ties", data=str(image_folder), num_samples=8,
                   progress=False).save_pretrained(tmp_path / "m_ties")
    card = (tmp_path / "m_ties" / "README.md").read_text()
    assert "@inproceedings{mloss2026" in card and "https://arxiv.org/abs/2602.08564" in card
