"""The model card's front matter for every family: the Hub's ``pipeline_tag`` of the merged class, ``base_model``
listing the merged Hub models (the base first), ``base_model_relation: merge``, ``library_name: transformers``.

Each tiny family is uploaded to a loopback fake Hub, merged by Hub id, saved, and its README.md read back with
``huggingface_hub.ModelCard``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import ModelCard

import hf_mloss
from examples import tiny as testing

sys.path.insert(0, str(Path(__file__).parent))
from fake_hub import fake_hub  # noqa: F401  (fixture re-export)
from test_families import clip_pair

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def _saved(model, processor):
    def build(root: Path) -> tuple[Path, list[Path]]:
        torch.manual_seed(0)
        return testing.save_with_finetunes(model().eval(), root, 2, tokenizer=processor())
    return build


def _clip_text():
    return transformers.CLIPTextModel(transformers.CLIPTextConfig(
        **SMALL, vocab_size=520, max_position_embeddings=16, bos_token_id=512, eos_token_id=513, pad_token_id=513))


FAMILIES = {  # family -> (builder of base + 2 fine-tunes, merged class, pipeline_tag)
    "clip_whole": (lambda root: clip_pair(root), "CLIPModel", "zero-shot-image-classification"),
    "clip_vision": (lambda root: testing.make_tiny_setup(root, q=2), "CLIPVisionModel", "image-feature-extraction"),
    "clip_text": (_saved(_clip_text, testing.tiny_tokenizer), "CLIPTextModel", "feature-extraction"),
    "siglip_vision": (_saved(lambda: transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        **SMALL, image_size=16, patch_size=8)), lambda: testing.tiny_processor(16)), "SiglipVisionModel",
        "image-feature-extraction"),
    "vit": (_saved(lambda: transformers.ViTModel(transformers.ViTConfig(**SMALL, image_size=16, patch_size=8)),
                   lambda: testing.tiny_processor(16)), "ViTModel", "image-feature-extraction"),
    "dinov2": (_saved(lambda: transformers.Dinov2Model(transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=16, patch_size=8)),
        lambda: testing.tiny_processor(16)), "Dinov2Model", "image-feature-extraction"),
    "bert": (_saved(lambda: transformers.BertModel(transformers.BertConfig(**SMALL, vocab_size=64,
                                                                           max_position_embeddings=64,
                                                                           pad_token_id=3)),
                    lambda: testing.word_tokenizer(64)), "BertModel", "feature-extraction"),
    "llama": (_saved(lambda: testing.tiny_decoder("llama"), lambda: testing.word_tokenizer(64)), "LlamaForCausalLM",
              "text-generation"),
    "bert_masked_lm": (_saved(lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        **SMALL, vocab_size=64, max_position_embeddings=64, pad_token_id=3)), lambda: testing.word_tokenizer(64)),
        "BertForMaskedLM", "fill-mask"),
}
OPTIONS = {"clip_vision_of_whole": ("clip_whole", {"output": "tower"}, "CLIPVisionModel", "image-feature-extraction")}
"""A whole CLIPModel merged into its vision tower only: the card describes the tower, not the whole model."""


def upload(hub, folder: Path, repo_id: str) -> str:
    hub.add_repo(repo_id, {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()})
    return repo_id


@pytest.mark.parametrize("family", [*FAMILIES, *OPTIONS])
def test_card_front_matter(family, fake_hub, tmp_path):  # noqa: F811
    source, options, class_name, tag = OPTIONS[family] if family in OPTIONS else (family, {}, *FAMILIES[family][1:])
    base, models = FAMILIES[source][0](tmp_path / "in")
    base_id = upload(fake_hub, base, f"org/{family}-base")
    model_ids = [upload(fake_hub, m, f"org/{family}-ft{i}") for i, m in enumerate(models)]
    result = hf_mloss.merge(base_id, model_ids, "ties", k=0.5, progress=False, **options)
    assert type(result.model).__name__ == class_name
    folder = result.save_pretrained(tmp_path / "merged")
    data = ModelCard.load(folder / "README.md").data
    assert data.pipeline_tag == tag
    assert data.base_model == [base_id, *model_ids]  # the merged models, the base first
    assert data.base_model_relation == "merge"
    assert data.library_name == "transformers"
    assert {"merge", "hf_mloss", "ties"} <= set(data.tags)
