"""Any transformers family, data-free: decoders (Llama, Mistral, Qwen2, GPT-2), an encoder (BERT) and a whole
CLIPModel (both towers fine-tuned), saved with save_pretrained and merged through the public API. Every method is
checked against a per-tensor reference computed here from the saved files; outputs load with their Auto class and
run in a ``pipeline``; what cannot line up (vocabularies, added tokens) is refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import hf_mloss
from examples import tiny as testing
from hf_mloss.methods.ops import tensor_seed

VOCAB = 64
DECODER = testing.TINY_DECODER
FAMILIES = {
    "llama": lambda tie: LlamaForCausalLM(LlamaConfig(**DECODER, tie_word_embeddings=tie)),
    "mistral": lambda tie: MistralForCausalLM(MistralConfig(**DECODER, tie_word_embeddings=tie)),
    "qwen2": lambda tie: Qwen2ForCausalLM(Qwen2Config(**DECODER, tie_word_embeddings=tie)),
    "gpt2": lambda tie: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=tie)),
    "bert": lambda tie: BertModel(BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                             pad_token_id=3)),
}


# ------------------------------------------------------------------------------------------------- fixtures
def word_tokenizer(extra_tokens: tuple[str, ...] = ()):
    return testing.word_tokenizer(VOCAB, extra_tokens)


def perturbed(model, seed: int):
    return testing.perturbed(model, seed)


def save_family(root: Path, family: str, *, q: int = 3, tie: bool = False, shard: str | None = None,
                ft_tokenizer=None) -> tuple[Path, list[Path]]:
    torch.manual_seed(0)
    base = FAMILIES[family](tie).eval()
    return testing.save_with_finetunes(base, root, q, tokenizer=word_tokenizer(), ft_tokenizer=ft_tokenizer,
                                       max_shard_size=shard)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base, models = save_family(root, request.param)
    return request.param, base, models


def weights_of(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved folder (single file or shards), as written."""
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


# -------------------------------------------------------------------------------------- per-tensor references
def ref_trim(tau: torch.Tensor, count: int) -> torch.Tensor:
    """Keep the ``count`` largest |τ| of one flat vector (no ties among random floats)."""
    if count <= 0:
        return torch.zeros_like(tau)
    threshold = tau.abs().flatten().topk(count).values[-1]
    return torch.where(tau.abs() >= threshold, tau, torch.zeros_like(tau))


def ref_elect_merge(taus: list[torch.Tensor], alpha: list[float], *, weighted_elect: bool = True,
                    divide: str = "weights") -> torch.Tensor:
    stacked = torch.stack(taus)
    a = torch.tensor(alpha).view(-1, *[1] * taus[0].dim())
    votes = (a * stacked if weighted_elect else stacked).sum(0)
    sign = torch.where(votes >= 0, 1.0, -1.0)
    agree = (torch.sign(stacked) == sign) & (stacked != 0)
    numerator = (a * stacked * agree).sum(0)
    denominator = (a * agree).sum(0) if divide == "weights" else agree.sum(0).float()
    return torch.where(denominator > 0, numerator / denominator.clamp_min(1e-30), torch.zeros_like(numerator))


def reference(method: str, base: dict, sources: list[dict], *, seed: int = 0, canonical=lambda key: key,
              **p) -> dict[str, torch.Tensor]:
    """The merge of every float tensor of ``base`` computed here, tensor by tensor (global TIES: one threshold per
    task vector over all of them). DARE masks come from the documented generator: seeded by (seed, the tensor's
    canonical name, the model's index)."""
    q = len(sources)
    names = [n for n, t in base.items() if t.is_floating_point()]
    taus = {n: [s[n].float() - base[n].float() for s in sources] for n in names}
    out = {}
    if method == "average":
        return {n: sum(s[n].float() for s in sources) / q for n in names}
    if method == "task_arithmetic":
        return {n: base[n].float() + p.get("lam", 1.0) * sum(taus[n]) for n in names}
    if method in ("dare_ties", "dare_linear"):
        keep = p.get("p", 0.7)
        for n in names:
            dropped = []
            for i, tau in enumerate(taus[n]):
                g = torch.Generator().manual_seed(tensor_seed(seed, canonical(n), i))
                dropped.append(torch.where(torch.rand(tau.shape, generator=g) < keep, tau, 0.0) / keep)
            merged = (ref_elect_merge(dropped, [1 / q] * q) if method == "dare_ties" else sum(dropped))
            out[n] = base[n].float() + p.get("lam", 1.0) * merged
        return out
    assert method == "ties"
    k, lam, convention = p.get("k", 0.2), p.get("lam", 1.0), p.get("convention", "hf_mloss")
    scope = p.get("scope") or {"hf_mloss": "global", "fusion_bench": "global"}.get(convention, "tensor")
    extra = 1 if convention == "fusion_bench" else 0
    alpha = p.get("weights") or [1 / q] * q
    if scope == "global":
        thresholds = []
        for i in range(q):
            flat = torch.cat([taus[n][i].abs().flatten() for n in names])
            count = min(flat.numel(), int(flat.numel() * k) + extra)
            thresholds.append(flat.topk(count).values[-1] if count else math.inf)
        trimmed = {n: [torch.where(t.abs() >= thresholds[i], t, 0.0) for i, t in enumerate(taus[n])] for n in names}
    else:
        minimum = 1 if convention == "mergekit" else 0
        trimmed = {n: [ref_trim(t, min(t.numel(), max(minimum, int(t.numel() * k) + extra))) for t in taus[n]]
                   for n in names}
    for n in names:
        out[n] = base[n].float() + lam * ref_elect_merge(
            trimmed[n], alpha, weighted_elect=convention != "peft", divide="count" if convention == "peft" else
            "weights")
    return out


def assert_matches(result, expected: dict[str, torch.Tensor], atol: float = 2e-6) -> None:
    state = result.model.state_dict()
    assert expected, "nothing to compare"
    for name, value in expected.items():
        torch.testing.assert_close(state[name].float(), value, rtol=0, atol=atol, msg=name)


CASES = [
    ("average", {}),
    ("task_arithmetic", {"lam": 0.4}),
    ("ties", {"k": 0.3}),  # hf_mloss convention: global scope
    ("ties", {"k": 0.3, "scope": "tensor"}),
    ("ties", {"k": 0.2, "convention": "mergekit", "weights": [1.0, 0.5, 2.0], "lam": 0.7}),
    ("ties", {"k": 0.2, "convention": "fusion_bench"}),
    ("ties", {"k": 0.3, "convention": "peft"}),
    ("dare_ties", {"p": 0.6}),
    ("dare_linear", {"p": 0.6, "lam": 0.5}),
]


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("method, params", CASES, ids=[f"{m}-{'-'.join(map(str, p.values()))}" for m, p in CASES])
def test_every_data_free_method_matches_the_reference(family, method, params):
    name, base, models = family
    result = hf_mloss.merge(str(base), [str(m) for m in models], method, progress=False, **params)
    assert type(result.model).__name__ == json.loads((base / "config.json").read_text())["architectures"][0]
    assert_matches(result, reference(method, weights_of(base), [weights_of(m) for m in models], **params))


def test_decoder_saves_loads_and_generates(tmp_path):
    from transformers import pipeline

    base, models = save_family(tmp_path / "in", "llama")
    result = hf_mloss.merge(str(base), [str(m) for m in models], "ties", k=0.3, progress=False)
    folder = result.save_pretrained(tmp_path / "merged")
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (folder / file).is_file(), file
    loaded, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert isinstance(loaded, LlamaForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    for key, value in result.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    generator = pipeline("text-generation", model=str(folder))
    text = generator("w1 w2 w3", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("w1 w2 w3") and len(text.split()) > 3
    from huggingface_hub import ModelCard

    card = ModelCard.load(folder / "README.md")
    assert card.data.pipeline_tag == "text-generation" and card.data.get("base_model_relation") is None  # local inputs
    assert 'pipeline("text-generation"' in card.text
    rerun = hf_mloss.run(hf_mloss.MergeConfig.from_pretrained(folder), progress=False)  # the recipe saved beside it
    for key, value in result.model.state_dict().items():
        assert torch.equal(rerun.model.state_dict()[key], value), key


def test_encoder_output_loads_with_automodel(tmp_path):
    from transformers import pipeline

    base, models = save_family(tmp_path / "in", "bert")
    folder = hf_mloss.merge(str(base), [str(m) for m in models], "dare_ties", p=0.5, progress=False) \
        .save_pretrained(tmp_path / "merged")
    loaded, info = AutoModel.from_pretrained(folder, output_loading_info=True)
    assert isinstance(loaded, BertModel) and not info["missing_keys"]
    features = pipeline("feature-extraction", model=str(folder))("w1 w2")
    assert torch.tensor(features).shape[-1] == 32
    from huggingface_hub import ModelCard

    assert ModelCard.load(folder / "README.md").data.pipeline_tag == "feature-extraction"


@pytest.mark.parametrize("family_name", ["llama", "gpt2"])
def test_tied_embeddings_merge_once_and_stay_tied(tmp_path, family_name):
    base, models = save_family(tmp_path / "in", family_name, tie=True)
    assert "lm_head.weight" not in weights_of(base)  # transformers saves a tied head once
    result = hf_mloss.merge(str(base), [str(m) for m in models], "ties", k=0.3, scope="tensor", progress=False)
    embed = result.model.get_input_embeddings().weight
    assert result.model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    assert_matches(result, reference("ties", weights_of(base), [weights_of(m) for m in models], k=0.3,
                                     scope="tensor"))
    folder = result.save_pretrained(tmp_path / "merged")
    assert "lm_head.weight" not in weights_of(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()
    assert torch.equal(loaded.get_input_embeddings().weight, embed)


def test_sharded_checkpoints_merge_as_single_files(tmp_path):
    base, models = save_family(tmp_path / "plain", "qwen2")
    sbase, smodels = save_family(tmp_path / "sharded", "qwen2", shard="20KB")
    assert (sbase / "model.safetensors.index.json").is_file() and len(list(sbase.glob("*.safetensors"))) > 2
    a = hf_mloss.merge(str(base), [str(m) for m in models], "ties", k=0.3, progress=False)
    b = hf_mloss.merge(str(sbase), [str(m) for m in smodels], "ties", k=0.3, progress=False)
    for key, value in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[key], value), key
    folder = b.save_pretrained(tmp_path / "merged", max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert torch.equal(AutoModelForCausalLM.from_pretrained(folder).model.norm.weight, b.model.model.norm.weight)


def test_vocabulary_mismatch_is_refused_before_any_work(tmp_path):
    base, models = save_family(tmp_path / "in", "llama", q=1)
    bigger = LlamaForCausalLM(LlamaConfig(**{**DECODER, "vocab_size": VOCAB + 2}))
    bigger.save_pretrained(tmp_path / "bigger")
    word_tokenizer(("<tool>", "<call>")).save_pretrained(tmp_path / "bigger")
    with pytest.raises(hf_mloss.IncompatibleCheckpointsError, match="lacks or numbers differently.*added tokens"):
        hf_mloss.merge(str(base), [str(models[0]), str(tmp_path / "bigger")], "average", progress=False)
    (tmp_path / "bigger" / "tokenizer.json").unlink()  # no tokenizer to compare: the rows still do not line up
    with pytest.raises(hf_mloss.IncompatibleCheckpointsError, match=r"64 rows .* 66 .*vocabularies differ.*never pad"):
        hf_mloss.merge(str(base), [str(models[0]), str(tmp_path / "bigger")], "average", progress=False)


def test_added_tokens_in_padded_rows_are_refused(tmp_path):
    """Same row count (a padded vocabulary), but the fine-tune's tokenizer gives ids to tokens the base lacks."""
    base, models = save_family(tmp_path / "in", "llama", q=2, ft_tokenizer=word_tokenizer(("<tool>",)))
    with pytest.raises(hf_mloss.IncompatibleCheckpointsError, match="'<tool>' \\(id 64\\)"):
        hf_mloss.merge(str(base), [str(m) for m in models], "ties", progress=False)


def test_other_model_types_and_towers_are_refused(tmp_path):
    base, models = save_family(tmp_path / "llama", "llama", q=1)
    other, _ = save_family(tmp_path / "mistral", "mistral", q=0)
    with pytest.raises(hf_mloss.IncompatibleCheckpointsError, match="'mistral' model.*but the base is.*'llama'"):
        hf_mloss.merge(str(base), [str(other)], "average", progress=False)
    with pytest.raises(hf_mloss.InvalidParameterError, match="output='tower'.*'llama' model has none"):
        hf_mloss.merge(str(base), [str(models[0])], "average", output="tower", progress=False)


def save_encoder_decoder(root: Path) -> tuple[Path, list[Path]]:
    """A tiny T5: an encoder-decoder, which has no M-Loss scoring (GPT-2 and the other MLP decoders do)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    base = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=2, num_heads=4,
                                               d_kv=8, decoder_start_token_id=0, pad_token_id=3)).eval()
    return testing.save_with_finetunes(base, root, 2, tokenizer=word_tokenizer())


def test_scoring_a_family_without_scoring_is_refused_clearly(tmp_path, image_folder):
    base, models = save_encoder_decoder(tmp_path / "in")
    paths = [str(m) for m in models]
    for call in (lambda: hf_mloss.merge(str(base), paths, "m_ties", data=str(image_folder), progress=False),
                 lambda: hf_mloss.score(str(base), paths, data=str(image_folder), progress=False),
                 lambda: hf_mloss.merge(str(base), paths, "ties", data=str(image_folder), select="unlabeled",
                                        grid={"k": [0.2, 0.5]}, progress=False)):
        with pytest.raises(hf_mloss.UnsupportedModelError,
                           match="scoring is not available yet for model_type='t5'.*data-free methods work"):
            call()


# ------------------------------------------------------------------------------------------- whole CLIPModel
def clip_pair(root: Path, q: int = 2) -> tuple[Path, list[Path]]:
    """A tiny full CLIPModel and q fine-tunes of BOTH towers (and projections, logit scale), with a CLIPProcessor."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    from examples.tiny import tiny_processor, tiny_tokenizer, tiny_vision_config

    torch.manual_seed(0)
    config = CLIPConfig(vision_config=tiny_vision_config().to_dict(),
                        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, vocab_size=520, max_position_embeddings=32,
                                         bos_token_id=512, eos_token_id=513, pad_token_id=513),
                        projection_dim=16)
    base = CLIPModel(config).eval()
    processor = CLIPProcessor(image_processor=tiny_processor(32), tokenizer=tiny_tokenizer())
    folders = []
    for i, model in enumerate([base, *[perturbed(base, i) for i in range(q)]]):
        folder = root / ("base" if i == 0 else f"ft{i}")
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
        folders.append(folder)
    return folders[0], folders[1:]


@pytest.fixture(scope="module")
def clip_whole(tmp_path_factory):
    return clip_pair(tmp_path_factory.mktemp("clip_whole"))


OUTSIDE = ("text_model.", "visual_projection.", "text_projection.", "logit_scale")


@pytest.mark.parametrize("method, params", [("average", {}), ("ties", {"k": 0.3}),
                                            ("ties", {"k": 0.2, "convention": "mergekit"}),
                                            ("dare_linear", {"p": 0.5})], ids=["average", "ties", "ties-mk", "dare"])
def test_whole_clip_merges_both_towers(clip_whole, method, params):
    base, models = clip_whole
    result = hf_mloss.merge(str(base), [str(m) for m in models], method, progress=False, **params)
    base_state = weights_of(base)
    expected = reference(method, base_state, [weights_of(m) for m in models],
                         canonical=lambda key: key.removeprefix("vision_model."), **params)
    state = result.model.state_dict()
    outside = [k for k in expected if k.startswith(OUTSIDE)]
    assert {"logit_scale", "visual_projection.weight", "text_projection.weight"} <= set(outside)
    changed = [key for key in outside if not torch.equal(state[key], base_state[key])]
    # the fine-tunes changed every one of them, and so does the merge (a trim may zero a 1-entry tensor's delta)
    assert len(changed) >= len(outside) - (0 if method == "average" else 1), sorted(set(outside) - set(changed))
    assert_matches(result, expected)


def test_whole_clip_saves_and_classifies_zero_shot(clip_whole, tmp_path):
    from huggingface_hub import ModelCard
    from PIL import Image
    from transformers import CLIPModel, pipeline

    base, models = clip_whole
    result = hf_mloss.merge(str(base), [str(m) for m in models], "ties", k=0.3, progress=False)
    folder = result.save_pretrained(tmp_path / "merged")
    loaded, info = CLIPModel.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for key, value in result.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert ModelCard.load(folder / "README.md").data.pipeline_tag == "zero-shot-image-classification"
    out = pipeline("zero-shot-image-classification", model=str(folder))(
        Image.new("RGB", (40, 40), "red"), candidate_labels=["a red square", "a blue circle"])
    assert {o["label"] for o in out} == {"a red square", "a blue circle"}


def test_whole_clip_tower_output_stays_explicit(clip_whole):
    from transformers import CLIPVisionModel

    base, models = clip_whole
    result = hf_mloss.merge(str(base), [str(m) for m in models], "average", output="tower", progress=False)
    assert isinstance(result.model, CLIPVisionModel)


def test_m_ties_on_whole_clip_scores_vision_and_trims_text_without_data(clip_whole, image_folder, tmp_path):
    base, models = clip_whole
    k, lam = 0.3, 0.8
    result = hf_mloss.merge(str(base), [str(m) for m in models], "m_ties", data=str(image_folder), k=k, e=0.1,
                            lam=lam, num_samples=8, progress=False)
    # vision blocks, named as in the whole model
    assert set(result.report.node) == {"vision_model.encoder.layers.0.mlp.fc1", "vision_model.encoder.layers.1.mlp.fc1"}
    base_state = weights_of(base)
    expected = reference("ties", base_state, [weights_of(m) for m in models], k=k, lam=lam, scope="tensor")
    outside = {key: value for key, value in expected.items() if key.startswith(OUTSIDE)}
    assert len(outside) > 20
    assert_matches(result, outside)
    assert sum(not torch.equal(result.model.state_dict()[key], base_state[key]) for key in outside) >= len(outside) - 1
    assert "data-free rule, TIES (per-tensor trim at k=0.3" in result.method_description
    folder = result.save_pretrained(tmp_path / "merged")
    assert "text tower" in (folder / "README.md").read_text()


def test_selection_on_whole_clip_refuses_to_drop_a_changed_text_tower(clip_whole, image_folder):
    base, models = clip_whole
    with pytest.raises(hf_mloss.InvalidParameterError, match="changed .* tensor\\(s\\) outside it.*output='tower'"):
        hf_mloss.merge(str(base), [str(m) for m in models], "ties", data=str(image_folder), select="unlabeled",
                       grid={"k": [0.2, 0.5]}, num_samples=4, progress=False)


def test_whole_clip_with_a_tower_only_model_refuses_to_drop_text_changes(clip_whole, tmp_path):
    from transformers import CLIPModel

    base, models = clip_whole
    tower_dir = tmp_path / "tower"
    CLIPModel.from_pretrained(models[1]).vision_model.save_pretrained(tower_dir)  # a vision-tower-only fine-tune
    with pytest.raises(hf_mloss.IncompatibleCheckpointsError, match="changed .* outside the clip_vision tower"):
        hf_mloss.merge(str(base), [str(models[0]), str(tower_dir)], "average", progress=False)
    tower = hf_mloss.merge(str(base), [str(models[0]), str(tower_dir)], "average", output="tower", progress=False)
    assert type(tower.model).__name__ == "CLIPVisionModel"


def test_loaded_models_merge_like_their_folders(tmp_path):
    base, models = save_family(tmp_path / "in", "llama", tie=True)
    loaded = AutoModelForCausalLM.from_pretrained(base)
    from_memory = hf_mloss.merge(loaded, [str(m) for m in models], "ties", k=0.3, progress=False)
    from_folders = hf_mloss.merge(str(base), [str(m) for m in models], "ties", k=0.3, progress=False)
    for key, value in from_folders.model.state_dict().items():
        assert torch.equal(from_memory.model.state_dict()[key], value), key


def test_compatibility_of_a_family_without_scoring_is_refused(tmp_path, image_folder):
    base, models = save_encoder_decoder(tmp_path / "in")
    with pytest.raises(hf_mloss.UnsupportedModelError, match="'t5'.*data-free methods work"):
        hf_mloss.compatibility(str(base), [str(m) for m in models], data=str(image_folder), progress=False)


def test_models_built_in_memory_merge_as_their_class(tmp_path):
    base = testing.tiny_decoder("mistral")
    assert not base.config.architectures
    fine_tunes = [testing.perturbed(base, i) for i in range(2)]
    result = hf_mloss.merge(base, fine_tunes, "task_arithmetic", lam=0.5, progress=False)
    assert isinstance(result.model, MistralForCausalLM) and base.config.architectures is None
    for key, value in result.model.state_dict().items():
        if value.is_floating_point():
            expected = base.state_dict()[key] + 0.5 * sum(f.state_dict()[key] - base.state_dict()[key]
                                                          for f in fine_tunes)
            torch.testing.assert_close(value, expected, rtol=0, atol=1e-6, msg=key)


def test_bf16_checkpoints_merge_in_float32_and_stay_bf16(tmp_path):
    """A bf16 LLM is held in bf16 while merging (half the memory); every tensor is computed in float32 and rounded
    once, as the final cast did."""
    base = testing.tiny_decoder("qwen2").to(torch.bfloat16)
    base_dir, models = testing.save_with_finetunes(base, tmp_path / "in", 3, tokenizer=word_tokenizer())
    result = hf_mloss.merge(str(base_dir), [str(m) for m in models], "ties", k=0.3, scope="tensor", progress=False)
    expected = reference("ties", weights_of(base_dir), [weights_of(m) for m in models], k=0.3, scope="tensor")
    state = result.model.state_dict()
    for name, value in expected.items():
        assert state[name].dtype == torch.bfloat16, name
        assert torch.equal(state[name], value.to(torch.bfloat16)), name
    folder = result.save_pretrained(tmp_path / "merged")
    assert AutoModelForCausalLM.from_pretrained(folder).dtype == torch.bfloat16
    half = testing.save_with_finetunes(testing.tiny_decoder("qwen2").to(torch.float16), tmp_path / "f16", 2)
    with pytest.raises(hf_mloss.InvalidParameterError, match="float16 would overflow.*largest float16"):
        hf_mloss.merge(str(half[0]), [str(m) for m in half[1]], "task_arithmetic", lam=1e6, progress=False)


def test_whole_siglip_merges_data_free(tmp_path):
    """A family without an hf_mloss adapter of its own (SigLIP, both towers) merges through the generic adapter."""
    from transformers import SiglipConfig, SiglipModel

    torch.manual_seed(0)
    config = SiglipConfig(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, vocab_size=64, max_position_embeddings=16),
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8))
    base_dir, models = testing.save_with_finetunes(SiglipModel(config).eval(), tmp_path / "in", 2)
    result = hf_mloss.merge(str(base_dir), [str(m) for m in models], "ties", k=0.3, progress=False)
    assert isinstance(result.model, SiglipModel)
    assert_matches(result, reference("ties", weights_of(base_dir), [weights_of(m) for m in models], k=0.3))
    with pytest.warns(UserWarning, match="no image processor"):  # the base was saved without one
        folder = result.save_pretrained(tmp_path / "merged")
    loaded, info = AutoModel.from_pretrained(folder, output_loading_info=True)
    assert isinstance(loaded, SiglipModel) and not info["missing_keys"]
    from huggingface_hub import ModelCard

    assert ModelCard.load(folder / "README.md").data.pipeline_tag == "zero-shot-image-classification"
