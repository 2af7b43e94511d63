"""Slices and layer ranges (mergekit's ``slices`` / ``layer_range``): passthrough stacks that change the layer count,
slices merged by a method with gradients over each slice, an encoder family, and the refusals."""

from __future__ import annotations

import hf_mloss

import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM, BertConfig, BertModel

from hf_mloss import MergeConfig
from hf_mloss.errors import ConfigError, IncompatibleCheckpointsError, InvalidParameterError
from hf_mloss.methods.slerp import slerp
from hf_mloss.spec.schedule import interpolate
from examples.tiny import save_with_finetunes, tiny_decoder, word_tokenizer

LAYER = re.compile(r"(.*\.(?:layers|layer)\.)(\d+)(\..*)")
SLERP_T = {"t": [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
                 {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]}, {"value": 0.5}]}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[str, str, str]:
    """A tiny 4-block Llama base and two fine-tunes of it, saved with a tokenizer."""
    base, models = save_with_finetunes(tiny_decoder("llama", num_hidden_layers=4), tmp_path_factory.mktemp("llama"),
                                       2, tokenizer=word_tokenizer())
    return str(base), str(models[0]), str(models[1])


def weights(folder: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(folder) / "model.safetensors"))


def renumbered(name: str, layer: int) -> str:
    head, _, tail = LAYER.match(name).groups()
    return f"{head}{layer}{tail}"


# ------------------------------------------------------------------------------------------------- passthrough
def test_passthrough_stack_with_overlapping_ranges(llama, tmp_path):
    from transformers import pipeline

    a, b, _ = llama
    recipe = {"slices": [{"sources": [{"model": a, "layer_range": [0, 3]}]},
                         {"sources": [{"model": b, "layer_range": [1, 4]}]}],
              "merge_method": "passthrough", "dtype": "float32", "tokenizer_source": "base"}
    (tmp_path / "recipe.yml").write_text(yaml.safe_dump(recipe))
    result = hf_mloss.run(MergeConfig.from_yaml(tmp_path / "recipe.yml"), progress=False)
    folder = result.save_pretrained(tmp_path / "stacked")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == 6
    ours, wa, wb = weights(folder), weights(a), weights(b)
    expected_layers = [(wa, 0), (wa, 1), (wa, 2), (wb, 1), (wb, 2), (wb, 3)]
    for name, tensor in ours.items():
        match = LAYER.match(name)
        if match:
            source, layer = expected_layers[int(match.group(2))]
            assert torch.equal(tensor, source[renumbered(name, layer)]), name
        else:  # embeddings from the first slice's model, final norm and head from the last slice's
            assert torch.equal(tensor, (wa if "embed" in name else wb)[name]), name
    assert len(ours) == len(wa) + 2 * 9  # two more blocks of 9 tensors each
    text = pipeline("text-generation", model=str(folder))("w1 w2", max_new_tokens=3, do_sample=False)
    assert text[0]["generated_text"].startswith("w1 w2")
    saved = MergeConfig.from_pretrained(folder)
    assert saved.method == "passthrough" and saved.slices == [
        {"sources": [{"model": 0, "layer_range": [0, 3]}]}, {"sources": [{"model": 1, "layer_range": [1, 4]}]}]
    rerun = hf_mloss.run(saved, progress=False)
    assert all(torch.equal(v, result.model.state_dict()[k]) for k, v in rerun.model.state_dict().items())
    card = (folder / "README.md").read_text()
    assert "layers 0–2 of base → output layers 0–2" in card and "output layers 3–5" in card


def test_passthrough_of_one_model_repeats_its_layers(llama):
    a, _, _ = llama
    config = MergeConfig(base=a, models=[], method="passthrough",
                         slices=[{"sources": [{"model": 0, "layer_range": [0, 4]}]},
                                 {"sources": [{"model": 0, "layer_range": [2, 4]}]}])
    state = hf_mloss.run(config, progress=False).model.state_dict()
    wa = weights(a)
    assert torch.equal(state["model.layers.5.self_attn.q_proj.weight"], wa["model.layers.3.self_attn.q_proj.weight"])
    assert torch.equal(state["model.layers.4.mlp.up_proj.weight"], wa["model.layers.2.mlp.up_proj.weight"])
    assert sum(1 for k in state if ".layers." in k and k.endswith("q_proj.weight")) == 6


def test_tied_llama_stack_stays_tied_and_records_every_input(tmp_path):
    base, models = save_with_finetunes(tiny_decoder("llama", num_hidden_layers=4, tie=True), tmp_path / "in", 1,
                                       tokenizer=word_tokenizer())
    config = MergeConfig(base=str(base), models=[str(models[0])], method="passthrough",
                         slices=[{"sources": [{"model": 1, "layer_range": [0, 2]}]},
                                 {"sources": [{"model": 0, "layer_range": [2, 4]}]}])
    result = hf_mloss.run(config, progress=False)
    folder = result.save_pretrained(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    wb = weights(models[0])
    assert torch.equal(model.model.embed_tokens.weight, wb["model.embed_tokens.weight"])  # the first slice's model
    assert all(spec.fingerprint for spec in [result.config.base, *result.config.models])
    assert [r.name for r in result.models] == ["ft1"]


def test_qwen2_layer_types_follow_the_stack(tmp_path):
    base, models = save_with_finetunes(tiny_decoder("qwen2", num_hidden_layers=4), tmp_path / "in", 1,
                                       tokenizer=word_tokenizer())
    config = MergeConfig(base=str(base), models=[str(models[0])], method="passthrough",
                         slices=[{"sources": [{"model": 0, "layer_range": [0, 4]}]},
                                 {"sources": [{"model": 1, "layer_range": [0, 1]}]}])
    folder = hf_mloss.run(config, progress=False).save_pretrained(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == 5
    if getattr(model.config, "layer_types", None) is not None:
        assert len(model.config.layer_types) == 5


# ------------------------------------------------------------------------------------------------- merged slices
def expected_slerp(wa, wb, slices) -> dict[str, torch.Tensor]:
    """Hand-planned slerp over ``slices`` of (start_a, start_b, length): t per filter, the gradient over each slice."""
    out, layer = {}, 0
    for start_a, start_b, length in slices:
        for offset in range(length):
            x = offset / (length - 1) if length > 1 else 1.0
            for name in wa:
                match = LAYER.match(name)
                if not match or int(match.group(2)) != start_a + offset:
                    continue
                values = SLERP_T["t"]
                t = interpolate(tuple(values[0]["value"]), x) if "self_attn" in name else \
                    interpolate(tuple(values[1]["value"]), x) if "mlp" in name else 0.5
                out[renumbered(name, layer)] = slerp(t, wa[name], wb[renumbered(name, start_b + offset)])
            layer += 1
    for name in wa:
        if not LAYER.match(name):
            out[name] = slerp(0.5, wa[name], wb[name])
    return out


@pytest.mark.parametrize("slices", [[(0, 0, 4)], [(0, 0, 2), (2, 2, 2)], [(1, 2, 2)]],
                         ids=["one-slice", "two-slices", "shifted"])
def test_slerp_over_slices_with_filter_gradients(llama, tmp_path, slices):
    a, b, _ = llama
    recipe = {"slices": [{"sources": [{"model": a, "layer_range": [sa, sa + n]},
                                      {"model": b, "layer_range": [sb, sb + n]}]} for sa, sb, n in slices],
              "merge_method": "slerp", "base_model": a, "parameters": SLERP_T, "dtype": "float32"}
    result = hf_mloss.run(MergeConfig.from_dict(recipe), progress=False)
    assert result.model.config.num_hidden_layers == sum(n for _, _, n in slices)
    expected = expected_slerp(weights(a), weights(b), slices)
    ours = result.model.state_dict()
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6, msg=name)
    resolved = result.config.resolved_parameters
    last = sum(n for _, _, n in slices) - 1
    assert resolved["model.layers.0.self_attn.q_proj.weight"] == {"t": 0.0}  # each slice starts its gradient at 0
    assert resolved[f"model.layers.{last}.self_attn.q_proj.weight"] == {"t": 1.0}
    assert resolved["model.norm.weight"] == {"t": 0.5}


def test_task_arithmetic_over_slices_uses_each_sources_layers(llama):
    a, b, c = llama
    recipe = {"slices": [{"sources": [{"model": a, "layer_range": [2, 4]},
                                      {"model": b, "layer_range": [0, 2], "parameters": {"weight": 1.0}},
                                      {"model": c, "layer_range": [1, 3], "parameters": {"weight": 0.5}}]}],
              "merge_method": "task_arithmetic", "base_model": a, "parameters": {"lambda": 0.5}, "dtype": "float32"}
    result = hf_mloss.run(MergeConfig.from_dict(recipe), progress=False)
    wa, wb, wc = weights(a), weights(b), weights(c)
    ours = result.model.state_dict()
    name = "model.layers.1.mlp.down_proj.weight"
    ta, tb, tc = (w[renumbered(name, i)] for w, i in ((wa, 3), (wb, 1), (wc, 2)))
    torch.testing.assert_close(ours[name], ta + 0.5 * ((tb - ta) + 0.5 * (tc - ta)), rtol=0, atol=1e-6)
    assert result.model.config.num_hidden_layers == 2


# ------------------------------------------------------------------------------------------------- encoder
def test_slices_on_bert(tmp_path):
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=4, max_position_embeddings=64, pad_token_id=3)).eval()
    base, models = save_with_finetunes(bert, tmp_path / "in", 1, tokenizer=word_tokenizer())
    a, b = str(base), str(models[0])
    stack = hf_mloss.run(MergeConfig.from_dict({"slices": [{"sources": [{"model": a, "layer_range": [0, 3]}]},
                                              {"sources": [{"model": b, "layer_range": [1, 3]}]}],
                                   "merge_method": "passthrough", "dtype": "float32"}), progress=False)
    folder = stack.save_pretrained(tmp_path / "stacked")
    loaded, info = AutoModel.from_pretrained(folder, output_loading_info=True)
    assert isinstance(loaded, BertModel) and loaded.config.num_hidden_layers == 5 and not info["missing_keys"]
    ours, wa, wb = weights(folder), weights(a), weights(b)
    assert torch.equal(ours["encoder.layer.4.output.dense.weight"], wb["encoder.layer.2.output.dense.weight"])
    assert torch.equal(ours["encoder.layer.2.attention.self.query.weight"],
                       wa["encoder.layer.2.attention.self.query.weight"])
    assert torch.equal(ours["embeddings.word_embeddings.weight"], wa["embeddings.word_embeddings.weight"])
    assert torch.equal(ours["pooler.dense.weight"], wb["pooler.dense.weight"])
    merged = hf_mloss.run(MergeConfig.from_dict({"slices": [{"sources": [{"model": a, "layer_range": [1, 3]},
                                                            {"model": b, "layer_range": [0, 2]}]}],
                                    "merge_method": "slerp", "base_model": a, "parameters": {"t": 0.3},
                                    "dtype": "float32"}), progress=False)
    name = "encoder.layer.0.intermediate.dense.weight"
    expected = slerp(0.3, wa["encoder.layer.1.intermediate.dense.weight"], wb[name])
    torch.testing.assert_close(merged.model.state_dict()[name], expected, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------- refusals
def test_layer_range_out_of_bounds_is_refused(llama, tmp_path):
    """Local folders: refused when the config is built (their config.json gives the layer count); models known only
    once resolved (Hub ids) are checked by the slice plan before any tensor is read."""
    a, b, _ = llama
    with pytest.raises(ConfigError, match=r"layer_range \[2, 6\] runs past the model's layers \(model 1 '.*' has 4 "
                                          r"layers, indices 0..3; end excluded\): use an end <= 4"):
        MergeConfig.from_dict({"slices": [{"sources": [{"model": a, "layer_range": [0, 3]}]},
                                          {"sources": [{"model": b, "layer_range": [2, 6]}]}],
                               "merge_method": "passthrough"})


def test_slices_of_different_lengths_are_refused_for_merges(llama):
    a, b, _ = llama
    with pytest.raises(ConfigError, match="same number of layers"):
        MergeConfig.from_dict({"slices": [{"sources": [{"model": a, "layer_range": [0, 2]},
                                                       {"model": b, "layer_range": [0, 3]}]}],
                               "merge_method": "slerp", "base_model": a, "parameters": {"t": 0.5}})


def test_passthrough_takes_one_source_per_slice(llama):
    a, b, _ = llama
    with pytest.raises(ConfigError, match="one source per slice"):
        MergeConfig.from_dict({"slices": [{"sources": [{"model": a, "layer_range": [0, 2]},
                                                       {"model": b, "layer_range": [0, 2]}]}],
                               "merge_method": "passthrough"})


def test_merged_slice_must_list_every_model(llama):
    a, b, c = llama
    with pytest.raises(InvalidParameterError, match="lists every model once"):
        MergeConfig(base=a, models=[b, c], method="ties", parameters={"k": 0.5},
                    slices=[{"sources": [{"model": 0, "layer_range": [0, 2]}, {"model": 1, "layer_range": [0, 2]}]}])


def test_sources_with_different_architectures_are_refused(llama, tmp_path):
    a, _, _ = llama
    wide, _ = save_with_finetunes(tiny_decoder("llama", num_hidden_layers=4, hidden_size=64, intermediate_size=64),
                                  tmp_path / "wide", 0, tokenizer=word_tokenizer())
    config = MergeConfig.from_dict({"slices": [{"sources": [{"model": a, "layer_range": [0, 2]}]},
                                               {"sources": [{"model": str(wide), "layer_range": [0, 2]}]}],
                                    "merge_method": "passthrough"})
    with pytest.raises(IncompatibleCheckpointsError):
        hf_mloss.run(config, progress=False)


def test_passthrough_without_slices_and_slices_with_models_are_refused(llama):
    a, b, _ = llama
    with pytest.raises(ConfigError, match="passthrough without slices"):
        MergeConfig.from_dict({"models": [{"model": a}], "merge_method": "passthrough"})
    with pytest.raises(InvalidParameterError, match="give slices"):
        MergeConfig(base=a, models=[b], method="passthrough")
    with pytest.raises(ConfigError, match="both `models` and `slices`"):
        MergeConfig.from_dict({"models": [{"model": a}], "merge_method": "passthrough",
                               "slices": [{"sources": [{"model": a, "layer_range": [0, 2]}]}]})
    with pytest.raises(ConfigError, match=r"passthrough parameters \(scale\)"):
        MergeConfig.from_dict({"slices": [{"sources": [{"model": a, "layer_range": [0, 2]}], "parameters": {"t": 1}}],
                               "merge_method": "passthrough"})
    with pytest.raises(ConfigError, match="scale"):
        MergeConfig.from_dict({"slices": [{"sources": [{"model": a, "layer_range": [0, 2],
                                                        "parameters": {"scale": 0.5}}]}],
                               "merge_method": "passthrough"})


def test_vocabulary_sources_of_sliced_recipes(llama):
    """tokenizer_source maps for sliced recipes too (passthrough included); a model outside the merge is refused."""
    a, b, _ = llama
    recipe = {"slices": [{"sources": [{"model": a, "layer_range": [0, 4]}, {"model": b, "layer_range": [0, 4]}]}],
              "merge_method": "slerp", "base_model": a, "parameters": {"t": 0.5}}
    assert MergeConfig.from_dict({**recipe, "tokenizer_source": "base"}).slices
    assert MergeConfig.from_dict({**recipe, "tokenizer_source": "union"}).tokenizer_source == "union"
    assert MergeConfig.from_dict({**recipe, "tokenizer_source": f"model:{b}"}).tokenizer_source == 1
    passthrough = {"merge_method": "passthrough", "slices": [{"sources": recipe["slices"][0]["sources"][:1]}]}
    assert MergeConfig.from_dict({**passthrough, "tokenizer_source": "union"}).tokenizer_source == "union"
    for config in (recipe, passthrough):
        with pytest.raises(ConfigError, match="not one of the merge's models"):
            MergeConfig.from_dict({**config, "tokenizer_source": "model:org/other"})


def test_a_slice_free_config_records_no_slices(llama):
    a, b, _ = llama
    config = MergeConfig(base=a, models=[b], method="slerp", parameters={"t": 0.5})
    assert config.slices is None and "slices" not in config.to_dict()


def test_slices_of_a_scored_vision_family_are_refused(tiny_paths):
    base, models = tiny_paths
    config = MergeConfig(base=base, models=models, method="average",
                         slices=[{"sources": [{"model": i, "layer_range": [0, 1]} for i in range(1 + len(models))]}])
    with pytest.raises(InvalidParameterError, match="text families"):
        hf_mloss.run(config, progress=False)


def test_cli_merges_a_mergekit_slices_yaml(llama, tmp_path):
    """`hf-mloss merge` on the file a mergekit user publishes: the slerp-over-slices recipe, relative paths."""
    from hf_mloss.cli import main

    a, b, _ = llama
    recipe = {"slices": [{"sources": [{"model": a, "layer_range": [0, 4]}, {"model": b, "layer_range": [0, 4]}]}],
              "merge_method": "slerp", "base_model": a, "parameters": SLERP_T, "dtype": "bfloat16"}
    (tmp_path / "slerp.yml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["merge", str(tmp_path / "slerp.yml"), str(tmp_path / "out"), "--quiet"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.dtype == torch.bfloat16 and model.config.num_hidden_layers == 4
    recorded = yaml.safe_load((tmp_path / "out" / "hf_mloss_config.yaml").read_text())
    assert recorded["slices"] == [{"sources": [{"model": 0, "layer_range": [0, 4]},
                                               {"model": 1, "layer_range": [0, 4]}]}]
    assert "t" in recorded["resolved_parameters"]["model.layers.1.self_attn.q_proj.weight"]
