"""Data-guided methods on vision-language models: a tiny LLaVA (CLIP vision + Llama) and Qwen2-VL, in their Hub
repos' layout, merged whole while ``data=`` images score the vision tower and ``text_data=`` texts the language
model. Node M-Loss of each tower equals a brute force from hooks on each fine-tune's own forward (the tower as the
model runs it on an image, the whole model on text alone); ``compatibility`` gives the same numbers; an ``m_ties``
merge loads with ``AutoModelForImageTextToText`` with nothing missing, runs on an image and text, and its card says
which tower was scored on what and which took the data-free rule; at ``e=0`` it is per-tensor TIES on every tensor.
Vision-language models not covered, and runs that do not walk the towers, are refused with the reason."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image
from transformers.activations import ACT2FN

import hf_mloss
from examples import tiny

sys.path.insert(0, str(Path(__file__).parent))
from test_vlm_merges import HUB_CONFIGS, _forward, _load, write_hub_layout

pytestmark = pytest.mark.filterwarnings("ignore:Asked for .* scoring:UserWarning")  # small samples on purpose
K, E = 0.3, 0.1
SIDE = 8  # the Qwen2-VL processor below rounds SCORING_SIDE to 8 px (its largest image: 64 px²): 4 × 4 patches
TOWERS = {"llava": ("model.vision_tower", "model.vision_tower.encoder.layers.{}.mlp.fc1"),
          "qwen2_vl": ("model.visual", "model.visual.blocks.{}.mlp.fc1")}
LANGUAGE = "model.language_model"
TEXTS = {"llava": ["w1 w2 w3", "w4 w5 w6 w7 w8", "w9 w10", "w11"],  # word ids < 63 (the image token)
         "qwen2_vl": ["w1 w23", "w456 w7 w8", "w9", "w0 w1 w2"]}  # one token per character


def _image_processor(name: str):
    if name == "llava":
        return tiny.tiny_processor(8)
    return transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": 16, "longest_edge": 64}, patch_size=2,
                                                 merge_size=2, temporal_patch_size=2)


@pytest.fixture(scope="module", params=list(TOWERS))
def vlm(request, tmp_path_factory):
    """A tiny base as its Hub repo lays it out (old key names, 4.x config.json), two fine-tunes of every tensor, each
    folder with its tokenizer and image processor; 5 images of another size and shape than the model's."""
    name = request.param
    root = tmp_path_factory.mktemp(f"{name}_scored")
    (root / "config").mkdir()
    (root / "config" / "config.json").write_text(json.dumps(HUB_CONFIGS[name]))
    torch.manual_seed(0)
    base = getattr(transformers, HUB_CONFIGS[name]["architectures"][0])(
        transformers.AutoConfig.from_pretrained(root / "config")).eval()
    tokenizer = tiny.word_tokenizer(64) if name == "llava" else tiny.char_tokenizer()
    folders = []
    for i, model in enumerate([base, tiny.perturbed(base, 1, 0.05), tiny.perturbed(base, 2, 0.05)]):
        write_hub_layout(name, model, root / f"m{i}")
        tokenizer.save_pretrained(root / f"m{i}")
        _image_processor(name).save_pretrained(root / f"m{i}")
        folders.append(str(root / f"m{i}"))
    generator = torch.Generator().manual_seed(5)
    images = [Image.fromarray((torch.rand(12, 10, 3, generator=generator) * 255).to(torch.uint8).numpy())
              for _ in range(5)]
    return {"name": name, "base": folders[0], "fts": folders[1:], "images": images, "texts": TEXTS[name],
            "tokenizer": tokenizer}


def _data(vlm, given: str) -> dict:
    return {**({"data": vlm["images"]} if given in ("images", "both") else {}),
            **({"text_data": vlm["texts"]} if given in ("texts", "both") else {})}


# ------------------------------------------------------------------------------------------- brute force
def _outputs(modules: list[torch.nn.Module], run) -> list[torch.Tensor]:
    """Each module's outputs during ``run()`` (forward hooks), as ``[positions, features]``."""
    seen: list[list[torch.Tensor]] = [[] for _ in modules]
    hooks = [m.register_forward_hook(lambda _, __, out, i=i: seen[i].append(out.detach().reshape(-1, out.shape[-1])))
             for i, m in enumerate(modules)]
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(s) for s in seen]


def _vision_run(vlm, model):
    """The tower as the model runs it on the images (its ``get_image_features``), from the base's processor."""
    if vlm["name"] == "llava":
        pixels = tiny.tiny_processor(8)(images=vlm["images"], return_tensors="pt")["pixel_values"]
        return lambda: model.model.get_image_features(pixel_values=pixels)
    square = [image.resize((SIDE, SIDE), Image.BICUBIC) for image in vlm["images"]]
    inputs = _image_processor("qwen2_vl")(images=square, return_tensors="pt")
    return lambda: model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                  image_grid_thw=inputs["image_grid_thw"])


def brute_force(vlm, given: str) -> dict[str, torch.Tensor]:
    """Per scored linear, the gaps g = f(Σα h) − Σα f(h_p) (gated: f(Σα a)·Σα b − Σα f(a_p)·b_p) at every position,
    α = 1/2, from each fine-tune's own forward: the vision tower on the images, the whole model on each text alone
    (unpadded: no padding position can count)."""
    name = vlm["name"]
    models = [_load(name, f) for f in vlm["fts"]]
    out = {}
    if given in ("images", "both"):
        blocks = [(m.model.vision_tower.encoder.layers if name == "llava" else m.model.visual.blocks) for m in models]
        hidden = [_outputs([b.mlp.fc1 for b in layers], _vision_run(vlm, m)) for layers, m in zip(blocks, models)]
        act = ACT2FN["quick_gelu"]
        for i in range(len(hidden[0])):
            h = [x[i].double() for x in hidden]
            out[TOWERS[name][1].format(i)] = act((h[0] + h[1]) / 2) - (act(h[0]) + act(h[1])) / 2
    if given in ("texts", "both"):
        ids = [vlm["tokenizer"](t, return_tensors="pt")["input_ids"] for t in vlm["texts"]]
        units = []
        for m in models:
            layers = m.model.language_model.layers
            units.append(_outputs([x for layer in layers for x in (layer.mlp.gate_proj, layer.mlp.up_proj)],
                                  lambda m=m: [m(input_ids=x) for x in ids]))
        act = ACT2FN["silu"]
        for i in range(len(units[0]) // 2):
            (a0, b0), (a1, b1) = [(u[2 * i].double(), u[2 * i + 1].double()) for u in units]
            gap = act((a0 + a1) / 2) * ((b0 + b1) / 2) - (act(a0) * b0 + act(a1) * b1) / 2
            out[f"{LANGUAGE}.layers.{i}.mlp.gate_proj"] = gap
    return out


# ------------------------------------------------------------------------------------------- scoring
@pytest.mark.parametrize("given", ["images", "texts", "both"])
def test_score_equals_hooks_on_each_models_own_forward(vlm, given):
    report = hf_mloss.score(vlm["base"], vlm["fts"], progress=False, **_data(vlm, given))
    expected = brute_force(vlm, given)
    assert set(report.node) == set(expected)  # named as in the whole model, the towers given data only
    for name, gap in expected.items():
        torch.testing.assert_close(report.node[name].double(), gap.abs().mean(0), rtol=1e-4, atol=1e-7, msg=name)
    vision, language = TOWERS[vlm["name"]][0], LANGUAGE
    images = 5 if given != "texts" else 0
    assert report.towers[vision]["status"] == (f"scored on 5 images ({len(next(iter(expected.values())))} "
                                               "positions)" if images else "not scored (no image data)")
    tokens = sum(len(vlm["tokenizer"](t)["input_ids"]) for t in vlm["texts"])
    assert report.towers[language]["status"] == (f"scored on 4 texts ({tokens} positions)" if given != "images"
                                                 else "not scored (no text data)")


def test_an_image_processor_passed_in_reads_images_as_the_base_s_does(vlm):
    """``processor=`` an image processor object: read as the vision tower reads images (Qwen2-VL: square, then
    folded back into pixels), the same numbers as the base's own."""
    own = hf_mloss.score(vlm["base"], vlm["fts"], data=vlm["images"], progress=False)
    given = hf_mloss.score(vlm["base"], vlm["fts"], data=vlm["images"], processor=_image_processor(vlm["name"]),
                           progress=False)
    for name, value in own.node.items():
        torch.testing.assert_close(given.node[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("given", ["images", "texts", "both"])
def test_compatibility_of_the_pair_equals_the_brute_force(vlm, given):
    report = hf_mloss.compatibility(vlm["base"], vlm["fts"], per_node=True, baselines=False, progress=False,
                                    **_data(vlm, given))
    expected = brute_force(vlm, given)
    assert sorted(report.layers) == sorted(expected) and report.subsets == [(0, 1)]
    for column, name in enumerate(report.layers):
        gap = expected[name]
        torch.testing.assert_close(report.node[name][0].double(), gap.abs().mean(0), rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(report.values["mloss"][0, column].double(), gap.norm(dim=1).mean(),
                                   rtol=1e-4, atol=1e-7, msg=name)
    statuses = report.data["towers"]
    assert set(statuses) == {TOWERS[vlm["name"]][0], LANGUAGE}
    assert ("not scored (no text data)" in statuses[LANGUAGE]["status"]) == (given == "images")
    assert "towers: " in report.summary()


# ------------------------------------------------------------------------------------------- merging
@pytest.mark.parametrize("given", ["images", "texts", "both"])
def test_m_ties_output_loads_runs_and_its_card_says_which_tower_took_what(vlm, given, tmp_path):
    name = vlm["name"]
    result = hf_mloss.merge(vlm["base"], vlm["fts"], "m_ties", k=K, e=E, progress=False, **_data(vlm, given))
    result.save_pretrained(tmp_path / "merged")
    merged = _load(name, tmp_path / "merged")  # AutoModelForImageTextToText, nothing missing or mismatched
    assert type(merged).__name__ == HUB_CONFIGS[name]["architectures"][0]
    assert torch.isfinite(_forward(name, merged)).all()  # an image and text
    vision_layers = {TOWERS[name][1].format(i) for i in range(2)}
    text_layers = {f"{LANGUAGE}.layers.{i}.mlp.gate_proj" for i in range(2)}
    assert set(result.report.keep_ratios) == (vision_layers if given == "images" else text_layers
                                              if given == "texts" else vision_layers | text_layers)
    card = (tmp_path / "merged" / "README.md").read_text()
    rule = f"trimmed at k={K} (data-free)"
    vision = "vision tower: scored on image data" if given != "texts" else f"vision tower: no image data, {rule}"
    language = "language model: scored on text data" if given != "images" else f"language model: no text data, {rule}"
    assert vision in card and language in card
    if name == "llava":  # its projector and untied lm_head lie outside both towers
        assert "lm_head, model.multi_modal_projector; " in card


def test_m_ties_at_e0_is_per_tensor_ties_on_every_tensor(vlm):
    """With no spread of keep ratios M-TIES trims every tensor as per-tensor TIES does: scored blocks, the tails of
    the towers, the projector and lm_head alike (each merged once, by the hook or by the data-free rule)."""
    mties = hf_mloss.merge(vlm["base"], vlm["fts"], "m_ties", k=K, e=0.0, data=vlm["images"],
                           text_data=vlm["texts"], progress=False).model.state_dict()
    ties = hf_mloss.merge(vlm["base"], vlm["fts"], "ties", k=K, scope="tensor", progress=False).model.state_dict()
    assert mties.keys() == ties.keys()
    for key, tensor in ties.items():
        torch.testing.assert_close(mties[key], tensor, rtol=0, atol=0, msg=key)


# ------------------------------------------------------------------------------------------- refusals
def test_texts_as_data_are_refused_naming_text_data(vlm):
    with pytest.raises(hf_mloss.DataError, match="text_data="):
        hf_mloss.merge(vlm["base"], vlm["fts"], "m_ties", data=vlm["texts"], progress=False)


def test_a_pixel_tensor_of_another_size_than_the_vision_tower_s_is_refused_when_read(vlm):
    """LLaVA's CLIP tower takes its config's image_size only; Qwen2-VL's reads any multiple of its patch, so no
    single size is checked there."""
    from hf_mloss.adapters.vision_language import VisionLanguageAdapter

    config = transformers.AutoConfig.from_pretrained(vlm["base"])
    assert VisionLanguageAdapter(config).tower_view.fixed_image_size == (vlm["name"] == "llava")
    if vlm["name"] != "llava":
        return
    with pytest.raises(hf_mloss.DataError, match="7×7 pixels; this clip_vision tower takes 8×8"):
        hf_mloss.score(vlm["base"], vlm["fts"], data=torch.rand(2, 3, 7, 7), progress=False)


def test_texts_holding_the_image_token_are_refused(vlm):
    image_token = HUB_CONFIGS[vlm["name"]].get("image_token_index") or HUB_CONFIGS[vlm["name"]]["image_token_id"]
    ids = torch.tensor([[5, image_token, 6], [7, 8, 9]])  # already tokenised: any id can be given
    with pytest.raises(hf_mloss.DataError, match=f"holds the model's image_token_id \\({image_token}\\).*text alone"):
        hf_mloss.score(vlm["base"], vlm["fts"], text_data={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                       progress=False)


def test_runs_that_do_not_walk_the_towers_are_refused(vlm):
    with pytest.raises(hf_mloss.UnsupportedModelError,
                       match=r"Label-free selection \(select=...\) is not available for vision-language models.*"
                             r"m_ties, m_dare.*data-free methods"):
        hf_mloss.merge(vlm["base"], vlm["fts"], "ties", data=vlm["images"], select="unlabeled",
                       grid={"k": [0.2, 0.5]}, progress=False)


def test_a_vision_language_model_not_covered_is_refused_with_the_reason(tmp_path):
    """Gemma 3 (SigLIP + Gemma 3 text, pooled image tokens) merges whole data-free; its data-guided merge is not
    built, and says so."""
    text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64, head_dim=8)
    config = transformers.Gemma3Config(
        vision_config=transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                      num_attention_heads=2, image_size=8, patch_size=4),
        text_config=transformers.Gemma3TextConfig(**text), mm_tokens_per_image=1, image_token_index=63,
        boi_token_index=61, eoi_token_index=62)
    torch.manual_seed(0)
    base, fts = tiny.save_with_finetunes(transformers.Gemma3ForConditionalGeneration(config).eval(), tmp_path, 2)
    with pytest.raises(hf_mloss.UnsupportedModelError,
                       match=r"not available yet for this vision-language model \(model_type='gemma3': "
                             r"model_type='gemma3' is not a scored.*data-free methods"):
        hf_mloss.merge(str(base), [str(f) for f in fts], "m_ties", data=torch.zeros(2, 3, 8, 8), progress=False)
    assert hf_mloss.merge(str(base), [str(f) for f in fts], "ties", progress=False).model is not None
