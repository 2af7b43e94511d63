"""The example's Hub repositories, replicated (``hub_replicas.py``) and served by the loopback fake Hub: the replicas
hold what the real repos hold, and hf_mloss reads them as the Hub serves them.

* weights: safetensors first, the conversion bot's PR (``refs/pr/1``) when ``main`` only has ``pytorch_model.bin``,
  else the ``.bin`` through the restricted unpickler; which file and commit are recorded (``ModelRef``);
* checkpoints compare on what the model class saves: the 2021 ``position_ids`` buffers are left out;
* scoring samples cover the whole label-sorted ``tanganke/dtd`` split.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from fake_hub import FakeHub  # noqa: E402
from hub_replicas import (  # noqa: E402,F401  (fixtures re-exported)
    BASE_ID,
    CONVERSION_BOT,
    CONVERSION_TITLE,
    DTD_CLASSES,
    DTD_ID,
    FINETUNE_IDS,
    replica_hub,
    replica_server,
    replicas,
    serve_replicas,
    use_hub,
)

import hf_mloss  # noqa: E402
from hf_mloss import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError  # noqa: E402
from hf_mloss.adapters import adapter_for  # noqa: E402
from hf_mloss.loading.hub import conversion_pr, resolve_model  # noqa: E402
from hf_mloss.loading.store import CheckpointStore, must_match, unsaved_buffers  # noqa: E402
from examples.tiny import tiny_processor  # noqa: E402

NEVER_READ = ("tf_model.h5", "flax_model.msgpack")


def downloaded(hub: FakeHub, repo_id: str) -> list[str]:
    """``<rev>:<path>`` of the files downloaded from ``repo_id``."""
    return [d.split("@", 1)[1] for d in hub.downloads(repo_id)]


@pytest.fixture
def fresh_hub(replicas, monkeypatch, tmp_path):
    """A fake Hub of its own (its repos may be changed by the test), served with the replicas."""
    with FakeHub() as hub:
        serve_replicas(hub, replicas)
        yield use_hub(monkeypatch, hub, tmp_path / "hub_cache")


# --------------------------------------------------------------------------------------------------------------------
# The replicas hold what the real repos hold, and transformers reads them
# --------------------------------------------------------------------------------------------------------------------


def test_openai_replica_is_a_2021_bin_checkpoint_with_a_bot_pr(replica_hub, replicas) -> None:
    from huggingface_hub import HfApi

    api = HfApi()
    main = {s.rfilename for s in api.model_info(BASE_ID).siblings}
    assert "pytorch_model.bin" in main and "model.safetensors" not in main
    assert {"tf_model.h5", "flax_model.msgpack", "preprocessor_config.json", "vocab.json", "merges.txt"} <= main
    prs = list(api.get_repo_discussions(BASE_ID, discussion_type="pull_request"))
    assert [(d.num, d.title, d.author, d.status) for d in prs] == [(1, CONVERSION_TITLE, CONVERSION_BOT, "open")]
    pr_files = {s.rfilename for s in api.model_info(BASE_ID, revision="refs/pr/1").siblings}
    assert pr_files == (main - {"README.md"}) | {"README.md", "model.safetensors"}
    # main moved on after the PR (a README commit): the PR's parent is not main's head
    commits = api.list_repo_commits(BASE_ID, revision="refs/pr/1")
    assert commits[1].commit_id != api.list_repo_commits(BASE_ID)[0].commit_id
    state = torch.load(io.BytesIO(replicas.base_main["pytorch_model.bin"]), weights_only=True)
    assert state["vision_model.embeddings.position_ids"].dtype == torch.int64
    assert state["text_model.embeddings.position_ids"].shape == (1, 77)
    assert next(iter(state)) == "logit_scale" and {"visual_projection.weight", "text_projection.weight"} <= set(state)
    assert replicas.base_main["config.json"].count(b'"text_config_dict": null') == 1


def test_replicas_load_in_transformers_as_the_real_repos_do(replica_hub, replicas) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel, CLIPVisionModel

    clip = CLIPModel.from_pretrained(BASE_ID)  # main: pytorch_model.bin through transformers' own weights_only load
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(clip.get_image_features(pixel_values=pixels).pooler_output,
                           replicas.clip.get_image_features(pixel_values=pixels).pooler_output)
    assert clip.config.text_config.eos_token_id == 2
    processor = AutoImageProcessor.from_pretrained(BASE_ID, backend="pil")  # legacy CLIPFeatureExtractor config
    assert processor.crop_size == {"height": 32, "width": 32}
    vocab = json.loads(replicas.base_main["vocab.json"])
    tokens = AutoTokenizer.from_pretrained(BASE_ID)(["a photo of a banded texture"])["input_ids"][0]
    assert (tokens[0], tokens[-1]) == (vocab["<|startoftext|>"], vocab["<|endoftext|>"]) == (len(vocab) - 2,
                                                                                              len(vocab) - 1)
    assert vocab["photo</w>"] in tokens and max(vocab.values()) < clip.config.text_config.vocab_size
    finetune, info = CLIPVisionModel.from_pretrained(FINETUNE_IDS[0], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    files = {p for p in replicas.finetunes[FINETUNE_IDS[0]]}
    assert files == {".gitattributes", "README.md", "config.json", "model.safetensors"}  # no preprocessor config
    assert all(k.startswith("vision_model.") and "position_ids" not in k
               for k in replicas.finetune_states[FINETUNE_IDS[0]])


def test_dtd_replica_is_one_label_sorted_parquet_file_per_split(replica_hub, replicas) -> None:
    import datasets

    ds = datasets.load_dataset(DTD_ID, split="train", streaming=True)
    assert ds.n_shards == 1 and ds.features["label"].names == list(DTD_CLASSES)
    assert ds.info.splits["train"].num_examples == 3760 and ds.info.splits["test"].num_examples == 1880
    labels = replicas.dtd_labels["train"]
    assert labels == sorted(labels) and len(set(labels)) == 47
    assert [row["label"] for row in ds.take(3)] == [0, 0, 0]
    parquet = sorted(p for p in replicas.dtd if p.endswith(".parquet"))
    assert parquet == ["data/test-00000-of-00001.parquet", "data/train-00000-of-00001.parquet"]


# --------------------------------------------------------------------------------------------------------------------
# Weights: safetensors, the bot's PR, the .bin
# --------------------------------------------------------------------------------------------------------------------


def test_base_weights_come_from_the_conversion_pr(replica_hub) -> None:
    ref = resolve_model(BASE_ID)
    pr_head = replica_hub.repo(BASE_ID).pulls[1]
    assert (ref.weights_file, ref.weights_ref, ref.revision) == ("model.safetensors", "refs/pr/1", pr_head)
    assert ref.to_dict()["weights_ref"] == "refs/pr/1" and ref.to_dict()["weights_file"] == "model.safetensors"
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= set(os.listdir(ref.path))
    files = downloaded(replica_hub, BASE_ID)
    assert f"{pr_head}:model.safetensors" in files
    assert not any(f.endswith(("pytorch_model.bin", *NEVER_READ)) for f in files), files
    lookups = [r for r in replica_hub.requests if r.route == "discussions"]
    assert lookups and lookups[0].query["author"] == [CONVERSION_BOT]
    # reproducing from the recorded commit needs no lookup and gives the same folder
    replica_hub.reset()
    assert resolve_model(BASE_ID, revision=ref.revision).path == ref.path
    assert "discussions" not in replica_hub.routes


def test_finetune_weights_come_from_main(replica_hub) -> None:
    ref = resolve_model(FINETUNE_IDS[3])
    assert ref.weights_file == "model.safetensors" and ref.weights_ref is None
    assert ref.revision == replica_hub.repo(FINETUNE_IDS[3]).branches["main"]
    assert "discussions" not in replica_hub.routes  # safetensors on main: no PR lookup


def test_conversion_pr_rules(fresh_hub, replicas) -> None:
    """Only an open PR by the bot, with the exact title, whose .bin and JSON files equal the revision's, is used."""
    assert conversion_pr(BASE_ID) == "refs/pr/1"
    assert conversion_pr(FINETUNE_IDS[0]) is None  # no .bin: nothing to convert
    fresh_hub.open_pr(BASE_ID, {"model.safetensors": b"not the weights"}, title=CONVERSION_TITLE, author="mallory")
    assert conversion_pr(BASE_ID) == "refs/pr/1"  # PR #2 is not the bot's
    # a new .bin on main: the bot's PR converts older weights and is no longer used; the .bin is read instead
    state = {k: v + 1 if v.is_floating_point() else v for k, v in replicas.base_state.items()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    fresh_hub.add_commit(BASE_ID, {"pytorch_model.bin": buffer.getvalue()}, message="new weights")
    assert conversion_pr(BASE_ID) is None
    ref = resolve_model(BASE_ID)
    assert (ref.weights_file, ref.weights_ref) == ("pytorch_model.bin", None)
    assert ref.revision == fresh_hub.repo(BASE_ID).branches["main"]
    assert not any(f.endswith(NEVER_READ) for f in downloaded(fresh_hub, BASE_ID))
    store = CheckpointStore(ref, adapter_for(hf_mloss_config(ref.path)))
    assert torch.equal(store.get("encoder.layers.0.mlp.fc1.weight"),
                       state["vision_model.encoder.layers.0.mlp.fc1.weight"])


def test_bin_only_repo_reads_the_bin_lazily_and_skips_unsaved_buffers(fresh_hub, replicas) -> None:
    fresh_hub.repo(BASE_ID).pulls.clear()
    fresh_hub.repo(BASE_ID).discussions.clear()
    ref = resolve_model(BASE_ID)
    assert (ref.weights_file, ref.weights_ref) == ("pytorch_model.bin", None)
    adapter = adapter_for(hf_mloss_config(ref.path))
    store = CheckpointStore(ref, adapter)
    assert store.is_pickle and "embeddings.position_ids" not in store
    assert unsaved_buffers(adapter) == {"embeddings.position_ids"}
    assert set(store.keys()) == must_match(store)  # what is left is all floating point: every name must match
    reference = replicas.clip.vision_model.state_dict()
    assert set(store.keys()) == set(reference)
    name = "encoder.layers.1.mlp.fc1.weight"
    first = store.get(name)
    assert torch.equal(first, reference[name])
    first.zero_()  # a fresh buffer each time: merge methods may work in place
    assert torch.equal(store.get(name), reference[name])
    # allow_pickle=False: safetensors only, and the message says how to read the .bin safely
    with pytest.raises(CorruptCheckpointError, match="allow_pickle=True reads them with the restricted unpickler"):
        resolve_model(BASE_ID, allow_pickle=False)


def test_offline_after_an_online_run(replica_hub, monkeypatch) -> None:
    from huggingface_hub import constants

    online = resolve_model(BASE_ID)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    replica_hub.reset()
    assert resolve_model(BASE_ID, revision=online.revision).path == online.path  # the recorded commit works offline
    with pytest.raises(CorruptCheckpointError) as info:  # main alone cannot be trusted to mean the PR offline
        resolve_model(BASE_ID)
    message = str(info.value)
    assert "offline" in message and f"refs/pr/1 = {online.revision}" in message
    assert replica_hub.requests == []
    with pytest.raises(CheckpointNotFoundError, match="not in the local Hub cache"):
        resolve_model(FINETUNE_IDS[0])


# --------------------------------------------------------------------------------------------------------------------
# .bin files: the restricted unpickler only
# --------------------------------------------------------------------------------------------------------------------


class _RunsCode:
    """Pickles as a call: the full unpickler would run it (it would create ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _bin_folder(tmp_path: Path, state, **save_kwargs) -> Path:
    from examples.tiny import tiny_vision_config

    folder = tmp_path / "bin_model"
    folder.mkdir()
    tiny_vision_config().save_pretrained(folder)
    torch.save(state, folder / "pytorch_model.bin", **save_kwargs)
    return folder


def test_bin_needing_the_full_unpickler_is_refused_without_running_it(replicas, tmp_path) -> None:
    marker = tmp_path / "code-ran"
    state = {k.removeprefix("vision_model."): v for k, v in replicas.finetune_states[FINETUNE_IDS[0]].items()}
    folder = _bin_folder(tmp_path, {**state, "extra": _RunsCode(marker)})
    ref = resolve_model(str(folder))
    assert ref.weights_file == "pytorch_model.bin"
    with pytest.raises(UnsafeCheckpointError) as info:
        CheckpointStore(ref, adapter_for(hf_mloss_config(folder)))
    message = str(info.value)
    assert "pytorch_model.bin" in message and "restricted unpickler" in message and "Unsupported global" in message
    assert "arbitrary code" in message and not marker.exists()
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)


def test_legacy_bin_format_and_nested_checkpoints(replicas, tmp_path) -> None:
    state = {k: v for k, v in replicas.finetune_states[FINETUNE_IDS[1]].items()}
    folder = _bin_folder(tmp_path, state, _use_new_zipfile_serialization=False)  # pre-1.6 format: no mmap
    store = CheckpointStore(resolve_model(str(folder)), adapter_for(hf_mloss_config(folder)))
    assert torch.equal(store.get("post_layernorm.weight"), state["vision_model.post_layernorm.weight"])
    nested = tmp_path / "nested"
    nested.mkdir()
    folder2 = _bin_folder(nested, {"state_dict": state, "epoch": 3})
    with pytest.raises(CorruptCheckpointError, match="not a state dict of tensors"):
        CheckpointStore(resolve_model(str(folder2)), adapter_for(hf_mloss_config(folder2)))


def hf_mloss_config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


# --------------------------------------------------------------------------------------------------------------------
# Scoring data: spread over the whole label-sorted split
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_shutdown_sleep(monkeypatch) -> None:
    """datasets sleeps 5 s after reading shards on threads (a pyarrow shutdown workaround); not needed here."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


def test_dtd_sample_covers_the_whole_split(replica_hub, replicas, no_shutdown_sleep) -> None:
    import datasets

    from hf_mloss.loading.data import load_pixel_values

    pixels, info = load_pixel_values(DTD_ID, tiny_processor(), num_samples=128, seed=0)
    assert pixels.shape == (128, 3, 32, 32)
    assert (info.sampling, info.label_column, info.num_labels) == ("whole split", "label", 47)
    assert info.labels_covered >= 40  # uniform: 47 * (1 - (1 - 1/47) ** 128) ~ 44 expected
    assert info.sample_stats() == {"sampling": "whole split", "label_column": "label",
                                   "labels_covered": info.labels_covered, "num_labels": 47}
    again, _ = load_pixel_values(DTD_ID, tiny_processor(), num_samples=128, seed=0)
    assert torch.equal(pixels, again)
    other, _ = load_pixel_values(DTD_ID, tiny_processor(), num_samples=128, seed=1)
    assert not torch.equal(pixels, other)
    # what a 1000-row shuffle buffer over the sorted file gives (the behaviour this replaces)
    stream = datasets.load_dataset(DTD_ID, split="train", streaming=True).select_columns(["label"])
    buffered = {row["label"] for row in stream.shuffle(seed=0, buffer_size=1000).take(128)}
    assert len(buffered) <= 20 < info.labels_covered


def test_large_split_is_shuffled_across_row_groups(replica_hub, no_shutdown_sleep) -> None:
    from hf_mloss.loading.data import load_pixel_values

    pixels, info = load_pixel_values(DTD_ID, tiny_processor(), num_samples=64, seed=0, whole_split_max_bytes=1000)
    assert pixels.shape[0] == 64 and info.sampling == "shuffled shards"
    assert info.labels_covered >= 25  # 38 row groups of 100 sorted rows, mixed in one buffer


def test_local_folder_sample_records_labels(image_folder) -> None:
    from hf_mloss.loading.data import load_pixel_values

    pixels, info = load_pixel_values(str(image_folder), tiny_processor(), num_samples=6, seed=0)
    assert pixels.shape[0] == 6 and info.sampling == "whole split"
    assert (info.label_column, info.num_labels, info.labels_covered) == ("label", 2, 2)
    listed, listed_info = load_pixel_values(sorted(image_folder.rglob("*.png")), tiny_processor(), num_samples=3)
    assert listed_info.labels_covered is None and listed_info.sample_stats() == {"sampling": "as given"}


# --------------------------------------------------------------------------------------------------------------------
# The example's checkpoints are mergeable as they are
# --------------------------------------------------------------------------------------------------------------------


def test_example_checkpoints_score_and_merge_through_the_python_api(replica_hub) -> None:
    """The 2021 base (position_ids, full CLIPModel) and the tanganke fine-tunes are compatible; a data-free merge
    of all eight runs on the replicas."""
    result = hf_mloss.merge(BASE_ID, list(FINETUNE_IDS), "ties", progress=False)
    assert result.base.weights_ref == "refs/pr/1"
    assert [m.weights_file for m in result.models] == ["model.safetensors"] * 8
    assert not any(f.endswith(("pytorch_model.bin", *NEVER_READ)) for f in downloaded(replica_hub, BASE_ID))
