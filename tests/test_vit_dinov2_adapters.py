"""ViT and DINOv2 adapters: key spellings, split block forward, M-Loss against brute force, merges that reload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    BitImageProcessorPil,
    Dinov2Config,
    Dinov2ForImageClassification,
    Dinov2Model,
    ViTConfig,
    ViTForImageClassification,
    ViTImageProcessorPil,
    ViTModel,
)

import hf_mloss
from hf_mloss.adapters import Dinov2Adapter, ViTAdapter, adapter_for
from hf_mloss.loading.hub import resolve_model
from hf_mloss.loading.store import CheckpointStore

NUM = 8
Q = 3
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2)


def vit_config() -> ViTConfig:
    return ViTConfig(**COMMON, intermediate_size=64, image_size=32, patch_size=8)


def dinov2_config(**overrides) -> Dinov2Config:
    # a 6x6 position table used at 28 px (4x4 patches): the embeddings interpolate, as real DINOv2 does at 224 px
    return Dinov2Config(**{**COMMON, "mlp_ratio": 2, "image_size": 42, "patch_size": 7, "layerscale_value": 0.5,
                           **overrides})


FAMILIES = {
    # name: (model class, config factory, classifier class, processor factory, pixel size, fc1 of block l)
    "vit": (ViTModel, vit_config, ViTForImageClassification,
            lambda: ViTImageProcessorPil(size={"height": 32, "width": 32}), 32,
            lambda model, layer: model.layers[layer].mlp.fc1),
    "dinov2": (Dinov2Model, dinov2_config, Dinov2ForImageClassification,
               lambda: BitImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}), 28,
               lambda model, layer: model.encoder.layer[layer].mlp.fc1),
}


def perturbed(model, seed: int, scale: float = 3e-2):
    """A "fine-tune": the same architecture with a per-tensor-scaled random task vector added to every tensor."""
    generator = torch.Generator().manual_seed(1_000 + seed)
    out = type(model)(model.config).eval()
    state = {}
    for key, tensor in model.state_dict().items():
        spread = float(torch.empty(()).uniform_(0.3, 3.0, generator=generator))
        state[key] = tensor + scale * spread * torch.randn(tensor.shape, generator=generator)
    out.load_state_dict(state)
    return out


def save(model, path: Path, family: str) -> str:
    model.save_pretrained(path)
    FAMILIES[family][3]().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    model_cls, make_config, _, _, size, fc1 = FAMILIES[name]
    torch.manual_seed(0)
    base = model_cls(make_config()).eval()
    fts = [perturbed(base, i) for i in range(Q)]
    root = tmp_path_factory.mktemp(name)
    base_dir = save(base, root / "base", name)
    ft_dirs = [save(m, root / f"ft{i}", name) for i, m in enumerate(fts)]
    pixels = torch.randn(NUM, 3, size, size, generator=torch.Generator().manual_seed(0))
    return {"name": name, "cls": model_cls, "base": base, "fts": fts, "base_dir": base_dir, "ft_dirs": ft_dirs,
            "pixels": pixels, "fc1": fc1, "root": root}


# ------------------------------------------------------------------------------------------- names and layouts
def test_canonical_keys_accept_both_spellings():
    vit = ViTAdapter(vit_config())
    assert vit.canonical_key("encoder.layer.1.intermediate.dense.weight") == "layers.1.mlp.fc1.weight"
    assert vit.canonical_key("vit.encoder.layer.0.output.dense.bias") == "layers.0.mlp.fc2.bias"
    assert vit.canonical_key("encoder.layer.0.attention.output.dense.weight") == "layers.0.attention.o_proj.weight"
    assert vit.canonical_key("encoder.layer.0.attention.attention.query.bias") == "layers.0.attention.q_proj.bias"
    assert vit.canonical_key("layers.0.mlp.fc1.weight") == "layers.0.mlp.fc1.weight"
    assert vit.canonical_key("vit.layernorm.weight") == "layernorm.weight"
    assert vit.canonical_key("classifier.weight") is None
    assert vit.canonical_key("vit.embeddings.mask_token") is None
    assert [vit.stage_of(n) for n in ("embeddings.cls_token", "layers.1.layernorm_after.weight", "pooler.dense.bias",
                                      "layernorm.bias")] == [-1, 1, 2, 2]
    assert vit.target_names() == ["layers.0.mlp.fc1", "layers.1.mlp.fc1"]

    dino = Dinov2Adapter(dinov2_config())
    assert dino.canonical_key("encoder.layer.1.attention.attention.key.weight") == \
        "encoder.layer.1.attention.k_proj.weight"
    assert dino.canonical_key("dinov2.encoder.layer.0.attention.output.dense.bias") == \
        "encoder.layer.0.attention.o_proj.bias"
    assert dino.canonical_key("encoder.layer.0.layer_scale2.lambda1") == "encoder.layer.0.layer_scale2.lambda1"
    assert dino.canonical_key("dinov2.embeddings.mask_token") == "embeddings.mask_token"
    assert dino.canonical_key("classifier.bias") is None
    assert [dino.stage_of(n) for n in ("embeddings.position_embeddings", "encoder.layer.0.mlp.fc1.weight",
                                       "layernorm.weight")] == [-1, 0, 2]
    assert dino.target_names() == ["encoder.layer.0.mlp.fc1", "encoder.layer.1.mlp.fc1"]
    assert {"vit", "dinov2", "clip_vision"} <= set(hf_mloss.list_adapters())


def test_disk_and_memory_names_agree_and_classifier_repos_read_the_same(family, tmp_path):
    """save_pretrained writes v4 key spellings; a ViTFor*/Dinov2For* repo adds a prefix and a head."""
    adapter = adapter_for(family["base"].config)
    plain = CheckpointStore(resolve_model(family["ft_dirs"][0]), adapter)
    memory = {adapter.canonical_key(k) for k in family["fts"][0].state_dict()}
    assert set(plain.keys()) == memory
    head_cls = FAMILIES[family["name"]][2]
    classifier = head_cls(head_cls.config_class.from_dict({**family["base"].config.to_dict(), "num_labels": 3}))
    getattr(classifier, classifier.base_model_prefix).load_state_dict(family["fts"][0].state_dict(), strict=False)
    folder = save(classifier, tmp_path / "cls", family["name"])
    other = CheckpointStore(resolve_model(folder), adapter_for(AutoConfig.from_pretrained(folder)))
    assert set(other.keys()) == {n for n in plain.keys() if not n.startswith("pooler.")}  # ViTFor*: no pooler
    for name in other.keys():
        assert torch.equal(plain.get(name), other.get(name)), name


def test_processor_loads_with_the_pil_backend(family):
    adapter = adapter_for(family["base"].config)
    processor = adapter.load_processor(family["base_dir"])
    assert type(processor).__name__.endswith("Pil")
    from PIL import Image

    image = Image.new("RGB", (45, 40), (120, 30, 200))
    size = family["pixels"].shape[-1]
    assert processor(images=[image], return_tensors="pt")["pixel_values"].shape == (1, 3, size, size)


def test_swiglu_dinov2_is_refused(tmp_path):
    with pytest.raises(hf_mloss.UnsupportedModelError, match="SwiGLU"):
        adapter_for(dinov2_config(use_swiglu_ffn=True))
    folder = tmp_path / "giant"
    folder.mkdir()
    dinov2_config(use_swiglu_ffn=True).save_pretrained(folder)
    with pytest.raises(hf_mloss.UnsupportedModelError, match="SwiGLU"):
        hf_mloss.merge(str(folder), [str(folder)], "ties", progress=False)


# ------------------------------------------------------------------------------------------- forward
def test_split_block_forward_equals_the_block_and_the_model(family):
    model = family["fts"][1]
    adapter = adapter_for(model.config)
    with torch.no_grad():
        hidden, context = adapter.embed(model, {"pixel_values": family["pixels"][:3]})
        assert context.mask is None  # every image token counts
        for block in adapter.layers(model):
            residual, u = adapter.forward_to_target(block, hidden, context)
            out = adapter.forward_from_target(block, residual, u, context)
            torch.testing.assert_close(out, block(hidden), rtol=0, atol=0)
            hidden = out
        torch.testing.assert_close(model.layernorm(hidden), model(pixel_values=family["pixels"][:3]).last_hidden_state,
                                   rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- M-Loss
def fc1_io(model, fc1, pixels, layer):
    captured = {}
    hook = fc1(model, layer).register_forward_hook(lambda m, i, o: captured.update(u=i[0].detach(), h=o.detach()))
    with torch.no_grad():
        model(pixel_values=pixels)
    hook.remove()
    return captured["u"], captured["h"]


def brute_force(h_list, act):
    q = len(h_list)
    h = [x.double().reshape(-1, x.shape[-1]) for x in h_list]
    mixed = act(sum(x / q for x in h))
    g = mixed - sum(act(x) / q for x in h)
    return g.abs().mean(0), (g.abs() / (mixed.abs() + 1e-4)).mean(0), g.norm(dim=1).mean()


@pytest.mark.parametrize("prefix", ["own", "base"])
def test_scorer_matches_brute_force(family, prefix):
    pixels, fc1 = family["pixels"], family["fc1"]
    report = hf_mloss.score(family["base_dir"], family["ft_dirs"], pixels, prefix=prefix, batch_size=3,
                            progress=False)
    assert report.activation == family["fts"][0].config.hidden_act == "gelu"
    assert report.num_positions == NUM * 17
    activation = torch.nn.functional.gelu
    adapter = adapter_for(family["base"].config)
    for layer in range(2):
        if prefix == "own":
            hs = [fc1_io(m, fc1, pixels, layer)[1] for m in family["fts"]]
        else:
            u, _ = fc1_io(family["base"], fc1, pixels, layer)
            hs = [fc1(m, layer)(u).detach() for m in family["fts"]]
        node, node_norm, layer_loss = brute_force(hs, activation)
        name = adapter.target_name(layer)
        assert float(node.max()) > 1e-5  # the sources really differ: the comparison is not trivially 0 == 0
        torch.testing.assert_close(report.node[name].double(), node, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(report.node_normalized[name].double(), node_norm, rtol=1e-4, atol=1e-7)
        assert report.layer[name] == pytest.approx(float(layer_loss), rel=1e-4)


def test_identical_sources_give_zero_mloss(family):
    same = [family["ft_dirs"][0]] * 3
    for prefix in ("own", "base"):
        report = hf_mloss.score(family["base_dir"], same, family["pixels"], prefix=prefix, progress=False)
        assert len(report.layers) == 2
        assert all(v < 1e-6 for v in report.layer.values())
        assert all(float(t.abs().max()) < 1e-6 for t in report.node.values())


# ------------------------------------------------------------------------------------------- merges
@pytest.mark.parametrize("method", ["ties", "m_ties"])
def test_merge_saves_a_loadable_model(family, method, tmp_path):
    kwargs = {"data": family["pixels"], "batch_size": 4} if method == "m_ties" else {}
    result = hf_mloss.merge(family["base_dir"], family["ft_dirs"], method, k=0.3, progress=False, **kwargs)
    assert isinstance(result.model, family["cls"])
    out = result.save_pretrained(tmp_path / "merged")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family["name"]
    assert (out / "preprocessor_config.json").exists()
    loaded = family["cls"].from_pretrained(out).eval()
    base_state = family["base"].state_dict()
    changed = 0
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, result.model.state_dict()[name], rtol=0, atol=0, msg=name)
        changed += not torch.equal(tensor, base_state[name])
    assert changed == len(base_state)  # every tensor moved (TIES keeps 30 % of each task vector)
    with torch.no_grad():
        features = loaded(pixel_values=family["pixels"][:2]).last_hidden_state
    assert torch.isfinite(features).all()
    if method == "m_ties":
        adapter = adapter_for(loaded.config)
        assert result.report.layers == adapter.target_names()
        assert set(result.report.keep_ratios) == set(adapter.target_names())


# ------------------------------------------------------------------------------------------- node groups
def test_node_groups_are_the_fc1_row_and_its_bias_entry(family):
    """A node of these towers is a row of fc1 and its bias entry (fc2 reads the unit but is not declared)."""
    adapter = adapter_for(family["base"].config)
    prefix = adapter.layer_prefix(1)
    assert adapter.unit.gate == adapter.target_suffix == "mlp.fc1" and adapter.unit.up is None
    assert adapter.node_groups(1) == [(f"{prefix}mlp.fc1.weight", 0), (f"{prefix}mlp.fc1.bias", 0)]
    shapes = adapter.expected_shapes()
    assert all(name in shapes for name, _ in adapter.node_groups(0))
    assert adapter.modality == "image" and adapter.input_names == ("pixel_values",)


def test_node_groups_default_from_the_unit_and_target_suffix_alias():
    """A unit with up and down linears groups gate rows, up rows and down columns; tensors the model lacks (no
    bias) are left out. An adapter that only sets ``target_suffix`` gets the matching unit."""
    from hf_mloss.adapters import CLIPVisionAdapter, ScoredUnit
    from examples.tiny import tiny_vision_config

    class Gated(CLIPVisionAdapter):
        unit = ScoredUnit(gate="mlp.fc1", up="mlp.fc1", down="mlp.fc2")  # fc1 twice: names that exist

    class Legacy(CLIPVisionAdapter):
        target_suffix = "mlp.fc2"

    config = tiny_vision_config()
    assert Gated.target_suffix == "mlp.fc1" and Legacy.unit == ScoredUnit(gate="mlp.fc2")
    groups = Gated(config).node_groups(0)
    assert groups == [("encoder.layers.0.mlp.fc1.weight", 0), ("encoder.layers.0.mlp.fc1.bias", 0),
                      ("encoder.layers.0.mlp.fc1.weight", 0), ("encoder.layers.0.mlp.fc1.bias", 0),
                      ("encoder.layers.0.mlp.fc2.weight", 1)]

    class NoBias(CLIPVisionAdapter):
        unit = ScoredUnit(gate="mlp.fc1", up="self_attn.missing", down="mlp.fc2")

    assert NoBias(config).node_groups(1) == [("encoder.layers.1.mlp.fc1.weight", 0),
                                             ("encoder.layers.1.mlp.fc1.bias", 0),
                                             ("encoder.layers.1.mlp.fc2.weight", 1)]
