"""A ``*ForImageClassification`` / ``*ForSequenceClassification`` base merges to its own class: the head merged by the
method's rule (data-guided methods: the encoder scored, the head by their data-free rule), or taken from the base
when the fine-tunes' heads have another shape, with a line in the card; never a silent change of class, never a
random pooler added. Each output loads with its Auto class with nothing missing and runs once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

import hf_mloss
from examples import tiny as testing

VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8,
              patch_size=4)
TEXT = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            bos_token_id=None, eos_token_id=None)
ENCODER = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               max_position_embeddings=32, pad_token_id=3)
DECODER = {**testing.TINY_DECODER, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
           "num_key_value_heads": 1}


def _vit(labels):
    return transformers.ViTForImageClassification(transformers.ViTConfig(**VISION, num_labels=labels))


def _dinov2(labels):
    return transformers.Dinov2ForImageClassification(transformers.Dinov2Config(**VISION, num_labels=labels))


def _clip(labels):
    return transformers.CLIPForImageClassification(transformers.CLIPConfig(vision_config=VISION, text_config=TEXT,
                                                                           num_labels=labels))


def _siglip(labels):
    return transformers.SiglipForImageClassification(transformers.SiglipConfig(vision_config=VISION, text_config=TEXT,
                                                                               num_labels=labels))


def _bert(labels):
    return transformers.BertForSequenceClassification(transformers.BertConfig(**ENCODER, num_labels=labels))


def _llama(labels):
    return transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**DECODER, num_labels=labels))


# name: (build(num_labels), Auto class, modality, tensors of the head, the encoder's attribute)
FAMILIES = {
    "vit": (_vit, transformers.AutoModelForImageClassification, "image", ("classifier.",), "vit"),
    "dinov2": (_dinov2, transformers.AutoModelForImageClassification, "image", ("classifier.",), "dinov2"),
    "clip": (_clip, transformers.AutoModelForImageClassification, "image", ("classifier.",), "vision_model"),
    "siglip": (_siglip, transformers.AutoModelForImageClassification, "image", ("classifier.",), "vision_model"),
    "bert": (_bert, transformers.AutoModelForSequenceClassification, "text", ("classifier.",), "bert"),
    "llama": (_llama, transformers.AutoModelForSequenceClassification, "text", ("score.",), "model"),
}
PIXELS = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))
TEXTS = [" ".join(f"w{(7 * i + j) % 50}" for j in range(3 + i % 4)) for i in range(6)]


def _save(model, folder: Path, modality: str) -> None:
    model.save_pretrained(folder)
    if modality == "text":
        testing.word_tokenizer().save_pretrained(folder)
    else:
        testing.tiny_processor(8).save_pretrained(folder)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """A tiny base of the family's classification class and two fine-tunes, saved with ``save_pretrained``."""
    name = request.param
    build, auto, modality, head, attribute = FAMILIES[name]
    torch.manual_seed(0)
    base = build(3).eval()
    root = tmp_path_factory.mktemp(name)
    folders = []
    for i, model in enumerate([base, testing.perturbed(base, 1), testing.perturbed(base, 2)]):
        _save(model, root / f"m{i}", modality)
        folders.append(str(root / f"m{i}"))
    return {"name": name, "base": folders[0], "fts": folders[1:], "auto": auto, "modality": modality,
            "head": head, "attribute": attribute, "cls": type(base), "root": root}


def _load(family, folder):
    model, info = family["auto"].from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _run_once(family, model):
    with torch.no_grad():
        if family["modality"] == "image":
            return model(pixel_values=PIXELS[:2]).logits
        return model(input_ids=torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])).logits


def _config_architecture(folder) -> str:
    return json.loads((Path(folder) / "config.json").read_text())["architectures"][0]


def test_a_data_free_merge_keeps_the_class_and_merges_the_head(family, tmp_path):
    """``average``: every tensor of the output, the head included, is the fine-tunes' mean; no pooler appears."""
    result = hf_mloss.merge(family["base"], family["fts"], "average", progress=False)
    assert type(result.model) is family["cls"]
    out = tmp_path / "merged"
    result.save_pretrained(out)
    assert _config_architecture(out) == family["cls"].__name__
    merged = _load(family, out)
    assert type(merged) is family["cls"]
    fts = [_load(family, f).state_dict() for f in family["fts"]]
    state = merged.state_dict()
    assert set(state) == set(fts[0])  # nothing added (a random pooler), nothing dropped (the classifier)
    assert any(k.startswith(family["head"]) for k in state)
    for key, tensor in state.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(tensor, (fts[0][key] + fts[1][key]) / 2, rtol=0, atol=1e-6, msg=key)
    assert _run_once(family, merged).shape == (2, 3)


def test_the_head_takes_the_methods_rule(family):
    """TIES (per tensor) on the head: the head tensors are merged like every other tensor, never left as the base's."""
    result = hf_mloss.merge(family["base"], family["fts"], "ties", k=0.5, scope="tensor", progress=False)
    base = _load(family, family["base"]).state_dict()
    head = [k for k in result.model.state_dict() if k.startswith(family["head"])]
    assert head and all(not torch.equal(result.model.state_dict()[k], base[k]) for k in head)


def test_heads_of_another_shape_are_the_bases_and_the_card_says_so(family, tmp_path):
    """Fine-tunes trained for 5 labels over a 3-label base: the head is the base's, the encoder merged."""
    build, _, modality, head, _ = FAMILIES[family["name"]]
    torch.manual_seed(0)
    base_model = build(3)
    folders = []
    for i in (1, 2):
        tuned = testing.perturbed(base_model, i)
        other = build(5)
        state = {k: v for k, v in tuned.state_dict().items() if not k.startswith(head)}
        other.load_state_dict(state, strict=False)
        _save(other, tmp_path / f"ft{i}", modality)
        folders.append(str(tmp_path / f"ft{i}"))
    with pytest.warns(UserWarning, match=r"head \(.*\) is the base's, not merged: the fine-tunes' heads have other"):
        result = hf_mloss.merge(family["base"], folders, "average", progress=False)
    out = tmp_path / "merged"
    result.save_pretrained(out)
    merged = _load(family, out).state_dict()
    base = _load(family, family["base"]).state_dict()
    assert merged[f"{head[0]}weight"].shape[0] == 3
    for key in merged:
        if key.startswith(head):
            assert torch.equal(merged[key], base[key]), key
    backbone = [k for k in merged if k.startswith(f"{family['attribute']}.") and merged[k].is_floating_point()]
    assert backbone and any(not torch.equal(merged[k], base[k]) for k in backbone)
    card = (out / "README.md").read_text()
    assert "head" in card and "is the base's, not merged" in card and "other shapes" in card


def test_a_data_guided_merge_scores_the_encoder_and_merges_the_head_data_free(family, tmp_path):
    """M-TIES: the encoder scored on data of the family's modality, the head merged by per-tensor TIES at k
    (bit for bit ``ties(scope="tensor")`` on it), as the card says."""
    data = PIXELS if family["modality"] == "image" else TEXTS
    result = hf_mloss.merge(family["base"], family["fts"], "m_ties", data=data, k=0.3, e=0.1, progress=False)
    assert type(result.model) is family["cls"]
    assert result.report.computed and result.report.layer
    ties = hf_mloss.merge(family["base"], family["fts"], "ties", k=0.3, scope="tensor", progress=False)
    state, reference = result.model.state_dict(), ties.model.state_dict()
    head = [k for k in state if k.startswith(family["head"])]
    assert head
    for key in head:
        assert torch.equal(state[key], reference[key]), key
    out = tmp_path / "merged"
    result.save_pretrained(out)
    _run_once(family, _load(family, out))


def test_the_checkpoint_is_written_in_the_bases_layout(tmp_path):
    """A ViTForImageClassification merge is written as the base was (``vit.encoder.layer.N.attention.attention.*``,
    the layout transformers 4.x reads), not in the loaded model's names."""
    torch.manual_seed(0)
    base = _vit(3).eval()
    root, models = testing.save_with_finetunes(base, tmp_path, 2)
    result = hf_mloss.merge(str(root), [str(m) for m in models], "ties", progress=False)
    with pytest.warns(UserWarning, match="no image processor"):  # the tiny ViT is saved without one
        result.save_pretrained(tmp_path / "merged")
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as merged, \
            safe_open(str(root / "model.safetensors"), "pt") as original:
        assert set(merged.keys()) == set(original.keys())
        assert any(".attention.attention.query." in k for k in original.keys())


def test_the_card_names_the_head_and_the_scored_encoder(tmp_path):
    torch.manual_seed(0)
    base = _vit(3).eval()
    root, models = testing.save_with_finetunes(base, tmp_path, 2)
    result = hf_mloss.merge(str(root), [str(m) for m in models], "m_ties", data=PIXELS, progress=False)
    assert "the ViTForImageClassification head" in result.method_description
    assert "scored on image data" in result.method_description
    assert result.adapter.card_metadata(result.model)["pipeline_tag"] == "image-classification"


def test_a_head_class_with_encoder_only_finetunes_keeps_the_bases_head_and_says_so(tmp_path):
    torch.manual_seed(0)
    base = _vit(3).eval()
    base.save_pretrained(tmp_path / "base")
    folders = []
    for i in (1, 2):
        encoder = testing.perturbed(base, i).vit
        encoder.save_pretrained(tmp_path / f"ft{i}")
        folders.append(str(tmp_path / f"ft{i}"))
    with pytest.warns(UserWarning, match="hold the ViTModel only"):
        result = hf_mloss.merge(str(tmp_path / "base"), folders, "average", progress=False)
    assert type(result.model) is transformers.ViTForImageClassification
    assert torch.equal(result.model.classifier.weight, base.classifier.weight)


def test_text_data_is_refused_for_a_clip_classifier(tmp_path):
    """A CLIPForImageClassification holds no text tower, though its config is a ``"clip"`` one."""
    torch.manual_seed(0)
    root, models = testing.save_with_finetunes(_clip(3).eval(), tmp_path, 2)
    with pytest.raises(hf_mloss.InvalidParameterError, match="no text tower"):
        hf_mloss.merge(str(root), [str(m) for m in models], "m_ties", data=PIXELS, text_data=TEXTS, progress=False)


def test_the_tower_output_is_still_the_bare_encoder(tmp_path):
    torch.manual_seed(0)
    base = _vit(3).eval()
    root, models = testing.save_with_finetunes(base, tmp_path, 2)
    with pytest.warns(UserWarning, match=r"lacks 2 tensor\(s\) its config implies \(pooler"):  # ViTModel's pooler
        result = hf_mloss.merge(str(root), [str(m) for m in models], "ties", output="tower", progress=False)
    assert type(result.model) is transformers.ViTModel


def test_learned_merges_and_selection_refuse_a_changed_head_naming_output_tower(tmp_path):
    """They learn on the encoder only; the fine-tunes' changed head would silently keep the base's values."""
    torch.manual_seed(0)
    root, models = testing.save_with_finetunes(_vit(3).eval(), tmp_path, 2)
    paths = [str(m) for m in models]
    for call in (lambda: hf_mloss.merge(str(root), paths, "adamerging", data=PIXELS, objective="output_gap",
                                        steps=1, progress=False),
                 lambda: hf_mloss.merge(str(root), paths, "ties", data=PIXELS, select="unlabeled",
                                        grid={"k": [0.2, 0.5]}, progress=False)):
        with pytest.raises(hf_mloss.InvalidParameterError,
                           match=r"ViTModel encoder.*\['classifier.bias', 'classifier.weight'\].*output='tower'"):
            call()
