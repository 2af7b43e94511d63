"""Tiny, faithful replicas of the Hub repositories that ``examples/merge_clip_vit_b32_8tasks.yaml`` names, served by
the loopback fake Hub (``fake_hub.py``) under the same ids, so the example runs unmodified against them.

What each replica reproduces (``HF_NOTES.md`` §7), at CI size (hidden 32, 2 blocks, 32 px images):

* ``openai/clip-vit-base-patch32``: a full ``CLIPModel`` from 2021. ``main`` holds ``pytorch_model.bin`` (a
  ``torch.save`` zip file of the transformers-v4 state dict: ``logit_scale``, ``text_model.*``, ``vision_model.*``,
  ``visual_projection``, ``text_projection``, and the int64 ``*.embeddings.position_ids`` buffers current transformers
  no longer saves), ``tf_model.h5`` and ``flax_model.msgpack`` (placeholders: never to be downloaded), the
  transformers-4.16 ``config.json`` (``text_config_dict: null``, generation fields in each sub-config, text
  ``eos_token_id: 2``), the legacy ``preprocessor_config.json`` (``feature_extractor_type: CLIPFeatureExtractor``) and
  a CLIP BPE tokenizer (``vocab.json``, ``merges.txt``, ``tokenizer.json``, v4 ``tokenizer_config.json`` with
  ``AddedToken`` dicts). No ``model.safetensors`` on ``main``: the conversion bot (``SFconvertbot``) opened PR #1,
  "Adding `safetensors` variant of this model", whose ``refs/pr/1`` adds ``model.safetensors`` (the bot's
  ``save_file`` of the same state dict, position_ids included, ``{"format": "pt"}``). ``main`` then moved on by a
  README-only commit, so the PR's parent is no longer ``main``'s head.
* ``tanganke/clip-vit-base-patch32_<task>`` (8 tasks): vision tower only, one unsharded F32 ``model.safetensors``
  with ``vision_model.``-prefixed keys and no position_ids (transformers 4.3x saved it as non-persistent), a
  ``clip_vision_model`` ``config.json`` as transformers 4.37 wrote it, a model card, no preprocessor config.
* ``tanganke/dtd`` (dataset): one parquet file per split (``data/train-00000-of-00001.parquet``: 3 760 rows,
  ``data/test-...``: 1 880), columns ``image`` (JPEG bytes of varying sizes) and ``label`` (``ClassLabel`` of the 47
  DTD classes), rows sorted by label, row groups of 100 rows (``datasets.push_to_hub`` in 2024), a README with
  ``dataset_info`` and ``configs``.

``build_replicas()`` makes everything in memory (about a second); ``serve_replicas(hub, replicas)`` loads it into a
:class:`fake_hub.FakeHub`. Fixtures (import them into a test module): ``replicas`` (session), ``replica_server``
(session: a fake Hub serving them) and ``replica_hub`` (per test: that server, with huggingface_hub, transformers and
datasets pointed at it, a fresh Hub cache, and its request log cleared).
"""

from __future__ import annotations

import io
import json
import string
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save as safetensors_bytes
from transformers import CLIPConfig, CLIPModel

from fake_hub import FakeHub, point_hf_at

BASE_ID = "openai/clip-vit-base-patch32"
TASKS = ("sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd")
FINETUNE_IDS = tuple(f"tanganke/clip-vit-base-patch32_{task}" for task in TASKS)
DTD_ID = "tanganke/dtd"
CONVERSION_BOT = "SFconvertbot"
CONVERSION_TITLE = "Adding `safetensors` variant of this model"
DTD_CLASSES = (
    "banded", "blotchy", "braided", "bubbly", "bumpy", "chequered", "cobwebbed", "cracked", "crosshatched",
    "crystalline", "dotted", "fibrous", "flecked", "freckled", "frilly", "gauzy", "grid", "grooved", "honeycombed",
    "interlaced", "knitted", "lacelike", "lined", "marbled", "matted", "meshed", "paisley", "perforated", "pitted",
    "pleated", "polka-dotted", "porous", "potholed", "scaly", "smeared", "spiralled", "sprinkled", "stained",
    "stratified", "striped", "studded", "swirly", "veined", "waffled", "woven", "wrinkled", "zigzagged",
)  # fmt: skip
DTD_SPLITS = {"train": 80, "test": 40}
"""Rows per class in each split (3 760 / 1 880 rows, as the real dataset)."""

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=8)  # fmt: skip
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=100,
            max_position_embeddings=77)  # fmt: skip
PROJECTION_DIM = 16
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
GITATTRIBUTES = "".join(f"*.{ext} filter=lfs diff=lfs merge=lfs -text\n" for ext in
                        ("bin", "h5", "msgpack", "safetensors", "parquet", "pt", "onnx", "zip"))


@dataclass
class Replicas:
    """The replicated repos' files, plus the in-memory references the tests compare against."""

    clip: CLIPModel
    """The base as a current transformers ``CLIPModel`` (float32, eval)."""
    base_state: dict[str, torch.Tensor]
    """The v4-layout state dict stored in the base's ``pytorch_model.bin`` (position_ids included)."""
    finetune_states: dict[str, dict[str, torch.Tensor]]
    """repo id -> the ``vision_model.``-prefixed state dict of its ``model.safetensors``."""
    base_main: dict[str, bytes]
    base_pr: dict[str, bytes]
    """Files the conversion bot's PR adds on top of its parent."""
    base_readme_update: dict[str, bytes]
    finetunes: dict[str, dict[str, bytes]]
    dtd: dict[str, bytes]
    dtd_labels: dict[str, list[int]] = field(default_factory=dict)
    """split -> the label of every row, in file order."""


def build_replicas(seed: int = 0) -> Replicas:
    """Every replica, built in memory and seeded."""
    clip = _clip_model(seed)
    base_state = _v4_state_dict(clip)
    base_main = _openai_main_files(base_state)
    bot_file = safetensors_bytes({k: v.contiguous() for k, v in base_state.items()}, metadata={"format": "pt"})
    finetune_states, finetunes = {}, {}
    for i, repo_id in enumerate(FINETUNE_IDS):
        state = _finetune_state(clip, seed=1000 * (seed + 1) + i)
        finetune_states[repo_id] = state
        finetunes[repo_id] = _tanganke_files(repo_id, state)
    dtd, dtd_labels = _dtd_files(seed)
    readme = base_main["README.md"].decode() + "\n## Limitations\n\nSee the model card of the original release.\n"
    return Replicas(clip=clip, base_state=base_state, finetune_states=finetune_states, base_main=base_main,
                    base_pr={"model.safetensors": bot_file}, base_readme_update={"README.md": readme.encode()},
                    finetunes=finetunes, dtd=dtd, dtd_labels=dtd_labels)


def serve_replicas(hub: FakeHub, replicas: Replicas) -> None:
    """Load every replica into ``hub``, with the openai repo's history: upload, bot PR #1, then a README commit."""
    hub.add_repo(BASE_ID, replicas.base_main, message="Upload CLIPModel", author="valhalla")
    hub.open_pr(BASE_ID, replicas.base_pr, title=CONVERSION_TITLE, author=CONVERSION_BOT)
    hub.add_commit(BASE_ID, replicas.base_readme_update, message="Update README.md", author="ybelkada")
    for repo_id, files in replicas.finetunes.items():
        hub.add_repo(repo_id, files, message="Upload CLIPVisionModel", author="tanganke")
    hub.add_repo(DTD_ID, replicas.dtd, repo_type="dataset", message="Upload dataset", author="tanganke")


def use_hub(monkeypatch: pytest.MonkeyPatch, hub: FakeHub, cache: Path) -> FakeHub:
    """Point huggingface_hub / transformers / datasets at ``hub`` with an empty Hub cache at ``cache``."""
    from huggingface_hub import constants

    point_hf_at(monkeypatch, hub.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(cache / ".agent_harnesses.json"), raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # transformers' background safetensors conversion (after a .bin load) would call a Space on the real Hub
    monkeypatch.setenv("DISABLE_SAFETENSORS_CONVERSION", "1")
    hub.reset()
    return hub


@pytest.fixture(scope="session")
def replicas() -> Replicas:
    return build_replicas()


@pytest.fixture(scope="session")
def replica_server(replicas: Replicas) -> Iterator[FakeHub]:
    with FakeHub() as hub:
        serve_replicas(hub, replicas)
        yield hub


@pytest.fixture
def replica_hub(replica_server: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeHub:
    """The replica server for this test: HF libraries pointed at it, a fresh Hub cache, an empty request log."""
    return use_hub(monkeypatch, replica_server, tmp_path / "hub_cache")


# ------------------------------------------------------------------------------------------------ openai base
def _clip_model(seed: int) -> CLIPModel:
    torch.manual_seed(seed)
    text = {**TEXT, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}  # the 2021 ids (eos 2: argmax pooling)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=VISION, projection_dim=PROJECTION_DIM)).eval()


def _v4_state_dict(clip: CLIPModel) -> dict[str, torch.Tensor]:
    """The state dict transformers 4.16 saved: same names, plus the position_ids buffers where v4 kept them (after the
    embeddings' own parameters, before their child modules)."""
    text_ids = torch.arange(TEXT["max_position_embeddings"], dtype=torch.int64)[None]
    vision_ids = torch.arange((VISION["image_size"] // VISION["patch_size"]) ** 2 + 1, dtype=torch.int64)[None]
    state: dict[str, torch.Tensor] = {}
    for key, tensor in clip.state_dict().items():
        if key == "text_model.embeddings.token_embedding.weight":
            state["text_model.embeddings.position_ids"] = text_ids
        state[key] = tensor.detach().clone()
        if key == "vision_model.embeddings.class_embedding":
            state["vision_model.embeddings.position_ids"] = vision_ids
    return state


def _openai_main_files(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    buffer = io.BytesIO()
    torch.save(state, buffer)  # zip format, as every torch.save since PyTorch 1.6
    tokenizer = _tokenizer_files()
    return {
        ".gitattributes": GITATTRIBUTES.encode(),
        "README.md": _OPENAI_README.encode(),
        "config.json": _json(_openai_config()),
        "preprocessor_config.json": _json({
            "crop_size": VISION["image_size"], "do_center_crop": True, "do_normalize": True, "do_resize": True,
            "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
            "resample": 3, "size": VISION["image_size"],
        }),
        "pytorch_model.bin": buffer.getvalue(),
        "tf_model.h5": b"\x89HDF\r\n\x1a\n placeholder: TensorFlow weights are never read",
        "flax_model.msgpack": b"\x82 placeholder: Flax weights are never read",
        **tokenizer,
    }


def _openai_config() -> dict:
    """``config.json`` as transformers 4.16 wrote it for the openai checkpoints (every generation field in each
    sub-config, ``*_config_dict: null``), at the replica's sizes."""
    def sub(model_type: str, sizes: dict, **special) -> dict:
        return {
            "_name_or_path": "", "add_cross_attention": False, "architectures": None, "attention_dropout": 0.0,
            "bad_words_ids": None, "chunk_size_feed_forward": 0, "cross_attention_hidden_size": None,
            "decoder_start_token_id": None, "diversity_penalty": 0.0, "do_sample": False, "dropout": 0.0,
            "early_stopping": False, "encoder_no_repeat_ngram_size": 0, "finetuning_task": None,
            "forced_bos_token_id": None, "forced_eos_token_id": None, "hidden_act": "quick_gelu",
            "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "initializer_factor": 1.0, "initializer_range": 0.02,
            "is_decoder": False, "is_encoder_decoder": False, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
            "layer_norm_eps": 1e-05, "length_penalty": 1.0, "max_length": 20, "min_length": 0,
            "model_type": model_type, "no_repeat_ngram_size": 0, "num_beam_groups": 1, "num_beams": 1,
            "num_return_sequences": 1, "output_attentions": False, "output_hidden_states": False,
            "output_scores": False, "prefix": None, "projection_dim": PROJECTION_DIM, "problem_type": None,
            "pruned_heads": {}, "remove_invalid_values": False, "repetition_penalty": 1.0, "return_dict": True,
            "return_dict_in_generate": False, "sep_token_id": None, "task_specific_params": None,
            "temperature": 1.0, "tie_encoder_decoder": False, "tie_word_embeddings": True, "tokenizer_class": None,
            "top_k": 50, "top_p": 1.0, "torch_dtype": None, "torchscript": False,
            "transformers_version": "4.16.0.dev0", "use_bfloat16": False, **sizes, **special,
        }

    text = sub("clip_text_model", TEXT, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    vision = sub("clip_vision_model", VISION, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return {
        "_name_or_path": BASE_ID, "architectures": ["CLIPModel"], "initializer_factor": 1.0,
        "logit_scale_init_value": 2.6592, "model_type": "clip", "projection_dim": PROJECTION_DIM,
        "text_config": dict(sorted(text.items())), "text_config_dict": None, "transformers_version": None,
        "vision_config": dict(sorted(vision.items())), "vision_config_dict": None,
    }


def _tokenizer_files() -> dict[str, bytes]:
    """A CLIP BPE tokenizer small enough for the replica's 100-token text tower: lowercase letters and digits (plain
    and word-final), a few merges, then the two special tokens with the highest ids (as in the real 49 408-token
    vocabulary, where the text tower pools at the end-of-text token by argmax because ``eos_token_id`` is 2)."""
    from transformers import CLIPTokenizer

    symbols = list(string.ascii_lowercase) + list(string.digits)
    merges = [("p", "h"), ("ph", "o"), ("pho", "t"), ("phot", "o</w>"), ("o", "f</w>"), ("t", "e")]
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols] + [a + b for a, b in merges])}
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    merges_txt = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    special = {"content": "", "single_word": False, "lstrip": False, "rstrip": False, "normalized": True,
               "__type": "AddedToken"}
    files = {"vocab.json": _json(vocab), "merges.txt": merges_txt.encode()}
    files["tokenizer_config.json"] = _json({
        "unk_token": {**special, "content": "<|endoftext|>"}, "bos_token": {**special, "content": "<|startoftext|>"},
        "eos_token": {**special, "content": "<|endoftext|>"}, "pad_token": "<|endoftext|>",
        "add_prefix_space": False, "errors": "replace", "do_lower_case": True, "name_or_path": "./clip_ViT_B_32/",
        "model_max_length": TEXT["max_position_embeddings"], "special_tokens_map_file": "./special_tokens_map.json",
        "tokenizer_class": "CLIPTokenizer",
    })
    files["special_tokens_map.json"] = _json({
        "bos_token": {**special, "content": "<|startoftext|>"}, "eos_token": {**special, "content": "<|endoftext|>"},
        "unk_token": {**special, "content": "<|endoftext|>"}, "pad_token": "<|endoftext|>",
    })
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("vocab.json", "merges.txt"):
            (Path(tmp) / name).write_bytes(files[name])
        tokenizer = CLIPTokenizer(str(Path(tmp) / "vocab.json"), str(Path(tmp) / "merges.txt"))
        tokenizer.backend_tokenizer.save(str(Path(tmp) / "tokenizer.json"))
        files["tokenizer.json"] = (Path(tmp) / "tokenizer.json").read_bytes()
    return files


_OPENAI_README = """---
tags:
- vision
widget:
- src: https://huggingface.co/datasets/mishig/sample_images/resolve/main/cat-dog-music.png
  candidate_labels: playing music, playing sports
  example_title: Cat & Dog
---

# Model Card: CLIP

Disclaimer: The model card is taken and modified from the official CLIP repository.

## Model Details

The base model uses a ViT-B/32 Transformer architecture as an image encoder and uses a masked self-attention
Transformer as a text encoder.
"""


# ------------------------------------------------------------------------------------------------ tanganke fine-tunes
def _finetune_state(clip: CLIPModel, seed: int) -> dict[str, torch.Tensor]:
    """The base's vision tower plus a task vector whose scale varies per tensor, with v4 ``vision_model.`` keys."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key, tensor in clip.vision_model.state_dict().items():
        spread = float(torch.empty(()).uniform_(0.3, 3.0, generator=generator))
        state[f"vision_model.{key}"] = (tensor + 1e-2 * spread * torch.randn(tensor.shape, generator=generator)
                                        ).contiguous()
    return state


def _tanganke_files(repo_id: str, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    task = repo_id.rsplit("_", 1)[1]
    config = {
        "_name_or_path": BASE_ID, "architectures": ["CLIPVisionModel"], "attention_dropout": 0.0, "dropout": 0.0,
        "hidden_act": "quick_gelu", "hidden_size": VISION["hidden_size"], "image_size": VISION["image_size"],
        "initializer_factor": 1.0, "initializer_range": 0.02, "intermediate_size": VISION["intermediate_size"],
        "layer_norm_eps": 1e-05, "model_type": "clip_vision_model",
        "num_attention_heads": VISION["num_attention_heads"], "num_channels": 3,
        "num_hidden_layers": VISION["num_hidden_layers"], "patch_size": VISION["patch_size"],
        "projection_dim": PROJECTION_DIM, "torch_dtype": "float32", "transformers_version": "4.37.2",
    }
    card = (f"---\nbase_model:\n- {BASE_ID}\ndatasets:\n- tanganke/{task}\nmetrics:\n- accuracy\n---\n\n"
            "# Model Card\n\n## Training Details\n\n  Adam Optimizer with a constant learning rate 1e-5 for 4000 "
            "steps training (batch_size=32).\n  Only the vision encoder is fine-tuned.\n")
    return {
        ".gitattributes": GITATTRIBUTES.encode(),
        "README.md": card.encode(),
        "config.json": _json(config),
        "model.safetensors": safetensors_bytes(state, metadata={"format": "pt"}),
    }


# ------------------------------------------------------------------------------------------------ tanganke/dtd
def _dtd_files(seed: int) -> tuple[dict[str, bytes], dict[str, list[int]]]:
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(DTD_CLASSES))})
    rng = np.random.default_rng(seed)
    files = {".gitattributes": GITATTRIBUTES.encode()}
    labels_by_split, split_infos = {}, []
    for split, per_class in DTD_SPLITS.items():
        labels = [label for label in range(len(DTD_CLASSES)) for _ in range(per_class)]  # sorted by label
        images = [{"bytes": _texture_jpeg(label, rng), "path": None} for label in labels]
        table = datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)
        buffer = io.BytesIO()
        table.to_parquet(buffer, batch_size=100)  # 100-row groups: what push_to_hub wrote for images in 2024
        files[f"data/{split}-00000-of-00001.parquet"] = buffer.getvalue()
        labels_by_split[split] = labels
        split_infos.append((split, sum(len(i["bytes"]) for i in images) + 8 * len(labels), len(labels)))
    files["README.md"] = _dtd_readme(split_infos, files).encode()
    return files, labels_by_split


def _texture_jpeg(label: int, rng: np.random.Generator) -> bytes:
    """A small JPEG whose colour depends on its class, of varying size (DTD images are 300-640 px, not square)."""
    height, width = (int(x) for x in rng.integers(12, 28, size=2))
    base = np.array([(37 * label) % 256, (91 * label) % 256, (53 * label + 80) % 256], dtype=np.float64)
    pixels = np.clip(base + rng.normal(0, 12, size=(height, width, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=85)
    return out.getvalue()


def _dtd_readme(split_infos: list[tuple[str, int, int]], files: dict[str, bytes]) -> str:
    names = "".join(f"          '{i}': {name}\n" for i, name in enumerate(DTD_CLASSES))
    splits = "".join(f"  - name: {name}\n    num_bytes: {nbytes}\n    num_examples: {rows}\n"
                     for name, nbytes, rows in split_infos)
    download = sum(len(data) for path, data in files.items() if path.endswith(".parquet"))
    configs = "".join(f"  - split: {name}\n    path: data/{name}-*\n" for name, _, _ in split_infos)
    return (
        "---\ndataset_info:\n  features:\n  - name: image\n    dtype: image\n  - name: label\n    dtype:\n"
        f"      class_label:\n        names:\n{names}  splits:\n{splits}  download_size: {download}\n"
        f"  dataset_size: {sum(n for _, n, _ in split_infos)}\nconfigs:\n- config_name: default\n  data_files:\n"
        f"{configs}---\n\n# Describable Textures Dataset (DTD)\n"
    )


def _json(data: dict) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode()
