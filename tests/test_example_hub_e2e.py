"""The README's eight-task CLIP example, run as published: ``hf-mloss score`` and ``hf-mloss merge ...
--push-to-hub`` on ``examples/merge_clip_vit_b32_8tasks.yaml``, unmodified, with ``HF_ENDPOINT`` pointing at the fake
Hub that serves the replicas of its repositories under their real ids (``hub_replicas.py``). The CLI runs as a
separate process, as a user runs it; the pushed merge is then loaded back from the fake and used for zero-shot
classification.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from hub_replicas import BASE_ID, DTD_CLASSES, FINETUNE_IDS, replica_hub, replica_server, replicas  # noqa: E402,F401

pytestmark = pytest.mark.slow  # the example end to end against the fake Hub: the slow tier

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "merge_clip_vit_b32_8tasks.yaml"
PUSHED = "tester/clip-vit-b32-8tasks-mties"
NEVER_READ = ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack")


def run_cli(args: list[str], server, home: Path) -> subprocess.CompletedProcess:
    """``hf-mloss ARGS`` in a fresh process whose Hugging Face libraries talk to ``server`` only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=server.url, HF_HOME=str(home), HF_HUB_OFFLINE="0", HF_TOKEN="hf_e2e_fake_token",
               HF_HUB_DISABLE_TELEMETRY="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error",
               DISABLE_SAFETENSORS_CONVERSION="1")
    return subprocess.run([sys.executable, "-m", "hf_mloss.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def scored(replica_server, tmp_path_factory):
    replica_server.reset()
    out = tmp_path_factory.mktemp("score")
    proc = run_cli(["score", str(EXAMPLE.relative_to(ROOT)), "--json", str(out / "mloss.json"), "--quiet"],
                   replica_server, out / "hf_home")
    return proc, out / "mloss.json", replica_server.downloads()


@pytest.fixture(scope="module")
def pushed(replica_server, tmp_path_factory):
    replica_server.reset()
    out = tmp_path_factory.mktemp("merge")
    proc = run_cli(["merge", str(EXAMPLE.relative_to(ROOT)), str(out / "merged"), "--push-to-hub", PUSHED,
                    "--quiet"], replica_server, out / "hf_home")
    commits = [c for c in replica_server.commits if c.repo_id == PUSHED]
    return proc, out / "merged", commits, replica_server.downloads()


def test_score_runs_the_example_unmodified(scored, replicas, replica_server) -> None:
    proc, json_path, downloads = scored
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(json_path.read_text())
    assert [row["layer"] for row in report["layers"]] == ["encoder.layers.0.mlp.fc1", "encoder.layers.1.mlp.fc1"]
    assert report["num_samples"] == 128 and report["models"] == list(FINETUNE_IDS)
    assert all(row["mloss"] > 0 for row in report["layers"])
    pr_head = replica_server.repo(BASE_ID).pulls[1]
    assert f"{BASE_ID}@{pr_head}:model.safetensors" in downloads  # the bot's conversion, not main's .bin
    assert not any(d.endswith(NEVER_READ) for d in downloads), downloads
    assert {f"{ft}@{replica_server.repo(ft).branches['main']}:model.safetensors" for ft in FINETUNE_IDS} <= set(
        downloads)


def test_score_report_says_how_many_labels_the_sample_covered(scored) -> None:
    proc, json_path, _ = scored
    data = json.loads(json_path.read_text())["data"]
    assert data["id"] == "tanganke/dtd" and data["sampling"] == "whole split"
    assert data["num_labels"] == len(DTD_CLASSES) and data["labels_covered"] >= 40
    assert "labels covered" in proc.stdout


def test_merge_pushes_one_commit(pushed) -> None:
    proc, folder, commits, downloads = pushed
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(commits) == 1
    assert {"config.json", "model.safetensors", "README.md", "hf_mloss_config.yaml"} <= set(commits[0].files)
    assert commits[0].files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert not any(d.endswith(NEVER_READ) for d in downloads), downloads
    assert "hf_e2e_fake_token" not in proc.stdout + proc.stderr


def test_saved_config_reproduces_from_the_recorded_commits(pushed, replica_server) -> None:
    _, folder, _, _ = pushed
    config = yaml.safe_load((folder / "hf_mloss_config.yaml").read_text())
    assert config["base"]["model"] == BASE_ID
    assert config["base"]["revision"] == replica_server.repo(BASE_ID).pulls[1]  # the converted weights' commit
    assert [(m["model"], m["revision"]) for m in config["models"]] == [
        (ft, replica_server.repo(ft).branches["main"]) for ft in FINETUNE_IDS]


def test_saved_config_and_card_name_the_weight_files(pushed) -> None:
    _, folder, _, _ = pushed
    text = (folder / "hf_mloss_config.yaml").read_text() + (folder / "README.md").read_text()
    assert "refs/pr/1" in text and "model.safetensors" in text


def test_pushed_merge_is_a_full_clip_model(pushed, replica_hub, replicas) -> None:
    from transformers import CLIPModel, CLIPVisionModel

    _, folder, _, _ = pushed
    clip = CLIPModel.from_pretrained(PUSHED)  # downloaded back from the fake Hub
    merged_vision = CLIPVisionModel.from_pretrained(folder)
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings", "hidden_act"):
        assert getattr(clip.config.text_config, key) == getattr(replicas.clip.config.text_config, key), key
    assert clip.config.projection_dim == replicas.clip.config.projection_dim
    for name, tensor in replicas.clip.text_model.state_dict().items():
        assert torch.equal(clip.text_model.state_dict()[name], tensor), name
    assert torch.equal(clip.text_projection.weight, replicas.clip.text_projection.weight)
    assert torch.equal(clip.logit_scale, replicas.clip.logit_scale)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(clip.vision_model(pixel_values=pixels).pooler_output,
                                   merged_vision(pixel_values=pixels).pooler_output, rtol=0, atol=1e-5)


def test_pushed_merge_classifies_with_zero_shot_prompts(pushed, replica_hub) -> None:
    from PIL import Image
    from transformers import pipeline

    classify = pipeline("zero-shot-image-classification", model=PUSHED)
    image = Image.new("RGB", (40, 30), (200, 120, 40))
    labels = ["banded", "dotted", "striped"]
    scores = classify(image, candidate_labels=labels, hypothesis_template="a photo of a {} texture")
    assert sorted(s["label"] for s in scores) == labels
    assert abs(sum(s["score"] for s in scores) - 1) < 1e-4
