"""Red team, round 6 (issue 73): the newest surfaces (``auto``, MoE merges, kept classes, Hub layouts, vision-language
models) refuse, or merge as a transformers user expects, on the inputs that failed.

Each row of the issue is run the way a user meets it (a YAML file through ``hf-mloss``, or a Python call) on tiny
models saved with ``save_pretrained`` (or in their Hub repo's layout); a refusal is one line on stderr, exit status 2
and nothing written, or the named error class from Python. The MoE YAML rows (null ``gate_mode`` /
``experts_per_token``, an MoE folder given to a merge run) are in ``test_moe_build.py``, beside the MoE they reuse.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
import yaml

import hf_mloss
from examples import tiny as testing
from hf_mloss.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from test_classes_kept import _bert, _vit  # noqa: E402
from test_vlm_merges import HUB_CONFIGS, write_hub_layout  # noqa: E402


def _write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def _refused(capsys, argv: list[str], *words: str) -> str:
    """Run the CLI: exit 2, one line on stderr naming ``words``, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-mloss: error:") and len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, (word, err)
    return err


def _quiet(call, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(*args, **kwargs)


# ============================================================================ rows 1, 2: auto's numbers past float32
def test_row1_an_auto_candidate_past_float32_exits_2_naming_it_and_writes_nothing(tiny_paths, image_folder, tmp_path,
                                                                                  capsys):
    base, models = tiny_paths
    recipe = _write(tmp_path / "auto.yaml", {
        "base": base, "models": models, "method": "auto", "data": {"path": str(image_folder)},
        "parameters": {"candidates": {"task_arithmetic": {"lam": [0.3, 1e300]}}, "compare_samples": 4}})
    _refused(capsys, ["merge", str(recipe), str(tmp_path / "out"), "-q"], "candidates['task_arithmetic']",
             "lam is 1e+300", "beyond the range of float32")
    assert not (tmp_path / "out").exists()


def test_row2_a_recorded_choice_edited_past_float32_exits_2_and_writes_nothing(tiny_paths, image_folder, tmp_path,
                                                                              capsys):
    base, models = tiny_paths
    recipe = _write(tmp_path / "auto.yaml", {
        "base": base, "models": models, "method": "auto", "data": {"path": str(image_folder), "num_samples": 8},
        "parameters": {"candidates": {"task_arithmetic": {"lam": [0.3, 0.5]}}, "compare_samples": 4}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["merge", str(recipe), str(tmp_path / "first"), "-q"]) == 0
    capsys.readouterr()
    saved = yaml.safe_load((tmp_path / "first" / "hf_mloss_config.yaml").read_text())
    assert saved["parameters"]["chosen"]["method"] == "task_arithmetic"
    saved["parameters"]["chosen"] = {"method": "task_arithmetic", "parameters": {"lam": 1e300}}
    (tmp_path / "edited").mkdir()  # beside the saved folder: its relative paths still resolve
    edited = _write(tmp_path / "edited" / "recipe.yaml", saved)
    _refused(capsys, ["merge", str(edited), str(tmp_path / "again"), "-q"], "chosen.parameters",
             "lam is 1e+300", "beyond the range of float32")
    assert not (tmp_path / "again").exists()


# ============================================================================ row 3: auto on a vision-language model
@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """A tiny LLaVA in its Hub repo's layout and two fine-tunes, each with its tokenizer and image processor."""
    from PIL import Image

    root = tmp_path_factory.mktemp("llava")
    (root / "config").mkdir()
    (root / "config" / "config.json").write_text(json.dumps(HUB_CONFIGS["llava"]))
    torch.manual_seed(0)
    base = transformers.LlavaForConditionalGeneration(transformers.AutoConfig.from_pretrained(root / "config")).eval()
    folders = []
    for i, model in enumerate([base, testing.perturbed(base, 1, 0.05), testing.perturbed(base, 2, 0.05)]):
        write_hub_layout("llava", model, root / f"m{i}")
        testing.word_tokenizer(64).save_pretrained(root / f"m{i}")
        testing.tiny_processor(8).save_pretrained(root / f"m{i}")
        folders.append(str(root / f"m{i}"))
    generator = torch.Generator().manual_seed(5)
    images = [Image.fromarray((torch.rand(12, 10, 3, generator=generator) * 255).to(torch.uint8).numpy())
              for _ in range(4)]
    return folders[0], folders[1:], images


@pytest.mark.parametrize("given", ["images and texts", "images only", "texts only", "no data", "output tower"])
def test_row3_auto_on_a_llava_is_refused_naming_auto_and_vision_language_models(llava, given):
    base, models, images = llava
    texts = ["w1 w2 w3", "w4 w5 w6 w7", "w9 w10", "w11"]
    options = {"images and texts": {"data": images, "text_data": texts}, "images only": {"data": images},
               "texts only": {"text_data": texts}, "no data": {},
               "output tower": {"data": images, "output": "tower"}}[given]
    with pytest.raises(hf_mloss.UnsupportedModelError) as info:
        hf_mloss.merge(base, models, "auto", progress=False, **options)
    message = str(info.value)
    assert message.startswith("Method 'auto' is not available for vision-language models (model_type='llava')")
    assert "output='tower'" not in message and "Scoring (score()" not in message
    assert "data-free methods merge the whole model" in message


# ============================================================================ row 4: two tensors for one parameter
def test_row4_a_stray_lm_head_beside_gpt_neox_embed_out_is_read_as_from_pretrained_reads_it(tmp_path):
    from safetensors.torch import load_file, save_file

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(HUB_CONFIGS["gpt_neox"]))
    torch.manual_seed(0)
    base = transformers.GPTNeoXForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path / "config")).eval()
    folders = []
    for i, model in enumerate([base, testing.perturbed(base, 1), testing.perturbed(base, 2)]):
        write_hub_layout("gpt_neox", model, tmp_path / f"m{i}")
        folders.append(str(tmp_path / f"m{i}"))
    weights = Path(folders[1]) / "model.safetensors"
    state = load_file(weights)
    state["lm_head.weight"] = torch.zeros_like(state["embed_out.weight"])  # a stray copy of zeros
    save_file(state, str(weights), metadata={"format": "pt"})
    loaded = [_quiet(transformers.AutoModelForCausalLM.from_pretrained, f).state_dict() for f in folders[1:]]
    assert torch.equal(loaded[0]["lm_head.weight"], state["embed_out.weight"])  # transformers: embed_out wins
    result = hf_mloss.merge(folders[0], folders[1:], "average", progress=False)
    for key, tensor in result.model.state_dict().items():
        if tensor.is_floating_point():
            torch.testing.assert_close(tensor, (loaded[0][key] + loaded[1][key]) / 2, rtol=0, atol=1e-6, msg=key)


# ============================================================================ rows 5, 6, 7: heads and labels
@pytest.fixture(scope="module")
def headed(tmp_path_factory):
    """ViT and BERT classifiers (3 labels) with two fine-tunes each, and their bare encoders, saved."""
    root = tmp_path_factory.mktemp("heads")
    out = {}
    for name, build in (("vit", _vit), ("bert", _bert)):
        torch.manual_seed(0)
        model = build(3).eval()
        tuned = [testing.perturbed(model, i) for i in (1, 2)]
        for tag, each in [("head", model), ("ft1", tuned[0]), ("ft2", tuned[1])]:
            each.save_pretrained(root / f"{name}-{tag}")
            getattr(each, name).save_pretrained(root / f"{name}-{tag}-encoder")
        out[name] = {"model": model, "tuned": tuned,
                     **{tag: str(root / f"{name}-{tag}") for tag in ("head", "ft1", "ft2")},
                     **{f"{tag}-encoder": str(root / f"{name}-{tag}-encoder") for tag in ("head", "ft1", "ft2")}}
    return out


@pytest.mark.parametrize("name", ["vit", "bert"])
def test_row5_a_headless_base_with_headed_finetunes_is_refused_naming_the_heads_and_the_ways_on(headed, name):
    family = headed[name]
    cls = type(family["model"]).__name__
    bare = "ViTModel" if name == "vit" else "BertModel"
    with pytest.raises(hf_mloss.IncompatibleCheckpointsError) as info:
        hf_mloss.merge(family["head-encoder"], [family["ft1"], family["ft2"]], "ties", progress=False)
    message = str(info.value)
    assert f"is a {cls}: a {bare} with a head (classifier." in message and f"is a {bare} without one" in message
    assert f"merge onto a {cls} base holding the head" in message
    if name == "vit":  # the encoders alone, as asked: the bare encoder
        assert "pass output='tower'" in message
        result = hf_mloss.merge(family["head-encoder"], [family["ft1"], family["ft2"]], "ties", output="tower",
                                progress=False)
        assert type(result.model) is transformers.ViTModel
    else:  # the advice works: each fine-tune's encoder saved on its own merges
        assert "model.bert.save_pretrained(folder)" in message
        result = _quiet(hf_mloss.merge, family["head-encoder"], [family["ft1-encoder"], family["ft2-encoder"]],
                        "ties", progress=False)
        assert type(result.model) is transformers.BertModel


def _labelled(model, labels: list[str] | None):
    """``model`` with its own config naming its classes ``labels`` (None: transformers' LABEL_i)."""
    model = copy.deepcopy(model)
    model.config = copy.deepcopy(model.config)
    if labels is not None:
        model.config.id2label = dict(enumerate(labels))
        model.config.label2id = {label: i for i, label in enumerate(labels)}
    return model


def test_row6_finetunes_naming_their_classes_differently_are_merged_with_a_warning_and_a_card_line(headed,
                                                                                                   tmp_path):
    vit = headed["vit"]
    _labelled(vit["tuned"][0], None).save_pretrained(tmp_path / "ft1")
    _labelled(vit["tuned"][1], ["car", "truck", "bus"]).save_pretrained(tmp_path / "ft2")
    with pytest.warns(UserWarning, match=r"name their classes differently \(id2label of 'ft1': \{0: 'LABEL_0'"):
        result = hf_mloss.merge(vit["head"], [str(tmp_path / "ft1"), str(tmp_path / "ft2")], "ties", progress=False)
    assert "id2label" in result.method_description and "'car'" in result.method_description
    assert result.model.config.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}  # the base's, as said
    result.save_pretrained(tmp_path / "merged")
    assert "name their classes differently" in (tmp_path / "merged" / "README.md").read_text()


def test_row6_finetunes_naming_their_classes_alike_give_the_merge_their_id2label(headed, tmp_path):
    vit = headed["vit"]
    for i, model in enumerate(vit["tuned"]):
        _labelled(model, ["car", "truck", "bus"]).save_pretrained(tmp_path / f"ft{i}")
    with pytest.warns(UserWarning, match="id2label"):
        result = hf_mloss.merge(vit["head"], [str(tmp_path / "ft0"), str(tmp_path / "ft1")], "ties", progress=False)
    result.save_pretrained(tmp_path / "merged")
    loaded = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "merged")
    assert loaded.config.id2label == {0: "car", 1: "truck", 2: "bus"}
    assert loaded.config.label2id == {"car": 0, "truck": 1, "bus": 2}


def test_row7_a_bert_classifier_base_with_encoder_only_finetunes_keeps_its_head_and_says_so(headed, tmp_path):
    bert = headed["bert"]
    with pytest.warns(UserWarning, match=r"head \(classifier.bias, classifier.weight\) is the base's: .*hold the "
                                         r"encoder only"):
        result = hf_mloss.merge(bert["head"], [bert["ft1-encoder"], bert["ft2-encoder"]], "ties", k=0.5,
                                scope="tensor", progress=False)
    assert type(result.model) is transformers.BertForSequenceClassification
    base = bert["model"].state_dict()
    state = result.model.state_dict()
    assert all(torch.equal(state[k], base[k]) for k in ("classifier.weight", "classifier.bias"))
    assert not torch.equal(state["bert.encoder.layer.0.output.dense.weight"],
                           base["bert.encoder.layer.0.output.dense.weight"])
    result.save_pretrained(tmp_path / "merged")
    loaded, info = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged",
                                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_row7_a_headed_finetune_changed_beside_encoder_only_ones_is_refused(headed):
    bert = headed["bert"]
    with pytest.raises(hf_mloss.IncompatibleCheckpointsError, match=r"'bert-ft1' has its own "
                                                                    r"BertForSequenceClassification head"):
        hf_mloss.merge(bert["head"], [bert["ft1"], bert["ft2-encoder"]], "ties", progress=False)


# ============================================================================ row 10: MoE routing settings
def test_row10_a_top1_mixtral_finetune_merged_into_a_top2_base_is_said(tmp_path):
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=64, intermediate_size=12,
                                        num_local_experts=3, num_experts_per_tok=2)
    torch.manual_seed(0)
    base = transformers.MixtralForCausalLM(config).eval()
    base.save_pretrained(tmp_path / "base")
    testing.perturbed(base, 1).save_pretrained(tmp_path / "ft1")
    top1 = _labelled(testing.perturbed(base, 2), None)
    top1.config.num_experts_per_tok = 1
    top1.save_pretrained(tmp_path / "ft2")
    with pytest.warns(UserWarning, match=r"'ft2' was configured to route tokens otherwise than the base "
                                         r"\(num_experts_per_tok=1 \(the base: 2\)\)"):
        result = hf_mloss.merge(str(tmp_path / "base"), [str(tmp_path / "ft1"), str(tmp_path / "ft2")], "ties",
                                progress=False)
    assert "num_experts_per_tok" in result.method_description
    assert result.model.config.num_experts_per_tok == 2


# ============================================================================ row 11: a base whose config lies
@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoder")
    base, models = testing.save_with_finetunes(testing.tiny_decoder("llama"), root, 2,
                                               tokenizer=testing.word_tokenizer())
    return base, [str(m) for m in models]


@pytest.mark.parametrize(("key", "value", "words"), [
    ("num_hidden_layers", 1, ("the weights hold 9 tensor(s) the config does not describe",
                              "'model.layers.1.")),
    ("hidden_size", 64, ("'model.embed_tokens.weight' has shape (64, 32) but the config implies (64, 64)",)),
    ("intermediate_size", 32, ("'model.layers.0.mlp.gate_proj.weight' has shape (64, 32) but the config implies "
                               "(32, 32)",)),
])
def test_row11_a_decoder_base_whose_config_lies_exits_2_naming_config_json(decoder, tmp_path, capsys, key, value,
                                                                          words):
    base, models = decoder
    lying = tmp_path / "base"
    shutil.copytree(base, lying)
    config = json.loads((lying / "config.json").read_text())
    (lying / "config.json").write_text(json.dumps({**config, key: value}))
    recipe = _write(tmp_path / "ties.yaml", {"base": str(lying), "models": models, "method": "ties"})
    _refused(capsys, ["merge", str(recipe), str(tmp_path / "out"), "-q"], "config.json of 'base' does not match "
             "its weights", *words)
    assert not (tmp_path / "out").exists()


def test_a_finetune_holding_blocks_the_base_has_not_is_refused(decoder, tmp_path):
    """The same class of input on the fine-tune's side: its third block would otherwise be dropped unread."""
    base, models = decoder
    testing.tiny_decoder("llama", num_hidden_layers=3).save_pretrained(tmp_path / "deeper")
    with pytest.raises(hf_mloss.IncompatibleCheckpointsError,
                       match=r"'deeper' does not match the base 'base': 9 tensor\(s\) are not in the base "
                             r"\(e.g. \['model.layers.2."):
        hf_mloss.merge(str(base), [models[0], str(tmp_path / "deeper")], "ties", progress=False)


# ============================================================================ the same classes, other entry points
def test_a_key_in_two_shards_is_the_later_shards_as_from_pretrained_reads_it(decoder, tmp_path):
    from safetensors.torch import load_file, save_file

    base, models = decoder
    tuned = transformers.AutoModelForCausalLM.from_pretrained(models[0])
    tuned.save_pretrained(tmp_path / "ft", max_shard_size="20KB")
    shards = sorted((tmp_path / "ft").glob("model-*.safetensors"))
    assert len(shards) >= 2
    first = load_file(shards[0])
    name = "model.norm.weight"
    last = load_file(shards[-1])
    value = tuned.state_dict()[name]
    first[name], last[name] = torch.zeros_like(value), value + 1.0  # two copies; the index names one of them
    save_file(first, str(shards[0]), metadata={"format": "pt"})
    save_file(last, str(shards[-1]), metadata={"format": "pt"})
    loaded = _quiet(transformers.AutoModelForCausalLM.from_pretrained, tmp_path / "ft").state_dict()[name]
    assert torch.equal(loaded, value + 1.0)  # transformers: the later shard's copy
    result = hf_mloss.merge(str(base), [str(tmp_path / "ft")], "average", progress=False)
    assert torch.equal(result.model.state_dict()[name], loaded)


def test_a_mergekit_slice_weight_of_hundreds_of_digits_exits_2(decoder, tmp_path, capsys):
    _, models = decoder
    recipe = _write(tmp_path / "slices.yaml", {"merge_method": "linear", "dtype": "float32", "slices": [
        {"sources": [{"model": m, "layer_range": [0, 2], "parameters": {"weight": 10**400}} for m in models]}]})
    _refused(capsys, ["merge", str(recipe), str(tmp_path / "out"), "-q"], "parameters.weight must be a finite number")
    assert not (tmp_path / "out").exists()


def test_score_on_an_unscored_family_is_refused_as_scoring_not_as_m_ties(tmp_path):
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0)
    torch.manual_seed(0)
    base, models = testing.save_with_finetunes(transformers.T5ForConditionalGeneration(config).eval(), tmp_path, 2,
                                               tokenizer=testing.word_tokenizer(64))
    with pytest.raises(hf_mloss.UnsupportedModelError, match=r"^Scoring \(score\(\), compatibility\(\)\) needs a "
                                                             r"scored model family.*model_type='t5'"):
        hf_mloss.score(str(base), [str(m) for m in models], ["w1 w2 w3", "w4 w5"], progress=False)


def test_auto_on_a_classifier_whose_heads_changed_is_refused_in_words_for_auto(headed):
    vit = headed["vit"]
    with pytest.raises(hf_mloss.InvalidParameterError) as info:
        hf_mloss.merge(vit["head"], [vit["ft1"], vit["ft2"]], "auto", data=torch.randn(4, 3, 8, 8),
                       candidates={"tsv_m": {"lam": [1.0]}}, compare_samples=2, progress=False)
    message = str(info.value)
    assert message.startswith("method='auto' works on the ViTModel encoder") and "output='tower'" in message
    assert "select=" not in message and "with a method that merges every tensor" in message
