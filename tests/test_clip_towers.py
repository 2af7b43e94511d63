"""A whole CLIPModel with both towers fine-tuned: ``text_data=`` scores the text tower on its own text beside the
vision tower on images (score, M-TIES, config/YAML, CLI), and a tower without data is merged by the data-free rule."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, CLIPModel
from transformers.activations import ACT2FN

import hf_mloss
from hf_mloss.errors import DataError, InvalidParameterError

sys.path.insert(0, str(Path(__file__).parent))
from test_families import clip_pair, save_family

pytestmark = pytest.mark.filterwarnings("ignore:Asked for .* scoring:UserWarning")  # small samples on purpose
TEXTS = ["a photo of a cat", "two dogs", "a red square on a blue table", "x", "the quick brown fox jumps"]
K, E, LAM = 0.3, 0.1, 0.9


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """A tiny CLIPModel (2 vision + 2 text blocks) and 2 fine-tunes of both towers, saved with save_pretrained."""
    base, models = clip_pair(tmp_path_factory.mktemp("clip_towers"))
    return str(base), [str(m) for m in models]


@pytest.fixture(scope="module")
def pixels():
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("texts") / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


# ------------------------------------------------------------------------------------------- brute force
def fc1_outputs(model: CLIPModel, tower: str, run) -> list[torch.Tensor]:
    """The fc1 outputs of every block of ``model.<tower>`` during ``run(model)`` (forward hooks), per block."""
    outputs: list[list[torch.Tensor]] = []
    layers = getattr(model, tower).encoder.layers
    hooks = []
    for i, layer in enumerate(layers):
        outputs.append([])
        hooks.append(layer.mlp.fc1.register_forward_hook(lambda m, a, out, i=i: outputs[i].append(out.detach())))
    try:
        with torch.no_grad():
            run(model)
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat([o.reshape(-1, o.shape[-1]) for o in per_layer]) for per_layer in outputs]


def node_mloss(per_model: list[list[torch.Tensor]], activation) -> list[torch.Tensor]:
    """Per block: mean over positions of |σ(Σ α h_p) − Σ α σ(h_p)|, α = 1/q."""
    q = len(per_model)
    out = []
    for layer in range(len(per_model[0])):
        h = [m[layer].double() for m in per_model]
        gap = activation(sum(x / q for x in h)) - sum(activation(x) / q for x in h)
        out.append(gap.abs().mean(0))
    return out


def brute_force(models: list[str], pixels: torch.Tensor, texts: list[str], tokenizer) -> dict[str, torch.Tensor]:
    """Node M-Loss (own prefix) of both towers from hooks on each fine-tune's own HF forward; the texts run one at
    a time, unpadded (so no padding position can count)."""
    loaded = [CLIPModel.from_pretrained(m).eval() for m in models]
    ids = [torch.tensor([tokenizer(t)["input_ids"]]) for t in texts]
    activation = ACT2FN["quick_gelu"]
    vision = node_mloss([fc1_outputs(m, "vision_model", lambda m: m.vision_model(pixel_values=pixels))
                         for m in loaded], activation)
    text = node_mloss([fc1_outputs(m, "text_model", lambda m: [m.text_model(input_ids=x) for x in ids])
                       for m in loaded], activation)
    out = {f"vision_model.encoder.layers.{i}.mlp.fc1": v for i, v in enumerate(vision)}
    out.update({f"text_model.encoder.layers.{i}.mlp.fc1": v for i, v in enumerate(text)})
    return out


def test_score_both_towers_equals_forward_hooks(clip, pixels):
    base, models = clip
    report = hf_mloss.score(base, models, data=pixels, text_data=TEXTS, num_samples=len(TEXTS), progress=False)
    expected = brute_force(models, pixels, TEXTS, AutoTokenizer.from_pretrained(base))
    assert set(report.node) == set(expected)  # named as in the whole model, both towers
    for name, value in expected.items():
        torch.testing.assert_close(report.node[name].double(), value, rtol=1e-4, atol=1e-6, msg=name)
    lengths = [len(AutoTokenizer.from_pretrained(base)(t)["input_ids"]) for t in TEXTS]
    assert report.towers["text_model"]["num_positions"] == sum(lengths) < len(TEXTS) * max(lengths)  # no padding
    assert report.towers["vision_model"]["num_samples"] == len(pixels)
    assert "text tower: scored on 5 texts" in report.summary()


def test_compatibility_scores_both_towers_as_score_does(clip, pixels):
    """The pair's node M-Loss of each tower equals the forward hooks' (q = 2: the pair is the whole set)."""
    base, models = clip
    report = hf_mloss.compatibility(base, models, data=pixels, text_data=TEXTS, num_samples=len(TEXTS),
                                    per_node=True, baselines=False, progress=False)
    expected = brute_force(models, pixels, TEXTS, AutoTokenizer.from_pretrained(base))
    assert sorted(report.layers) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(report.node[name][0].double(), value, rtol=1e-4, atol=1e-6, msg=name)
    assert "text tower scored on 5 texts" in report.summary()


def test_score_with_padding_counted_would_differ(clip):
    """The check above can fail: scoring the texts padded to one length with the padding counted gives other
    values (the padded positions run through the blocks too)."""
    base, models = clip
    tokenizer = AutoTokenizer.from_pretrained(base)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    report = hf_mloss.score(base, models, text_data=dict(batch), progress=False)
    name = "text_model.encoder.layers.1.mlp.fc1"
    batch_all = {"input_ids": batch["input_ids"], "attention_mask": torch.ones_like(batch["attention_mask"])}
    counted = hf_mloss.score(base, models, text_data=batch_all, progress=False)
    assert not torch.allclose(report.node[name], counted.node[name], rtol=1e-3, atol=0)
    assert set(report.node) == {"text_model.encoder.layers.0.mlp.fc1", name}
    assert report.towers["vision_model"] == {"status": "not scored (no image data)"}


# ------------------------------------------------------------------------------------------- M-TIES
def test_m_ties_with_both_towers_keeps_ratios_for_both(clip, pixels, tmp_path):
    base, models = clip
    both = hf_mloss.merge(base, models, "m_ties", data=pixels, text_data=TEXTS, k=K, e=E, lam=LAM,
                          num_samples=len(TEXTS), progress=False)
    images = hf_mloss.merge(base, models, "m_ties", data=pixels, k=K, e=E, lam=LAM, progress=False)
    keep = both.report.keep_ratios
    for tower in ("vision_model", "text_model"):
        for layer in (0, 1):
            ratios = keep[f"{tower}.encoder.layers.{layer}.mlp.fc1"]
            assert ratios.numel() == 64 and ratios.min() == pytest.approx(K - E) and ratios.max() == pytest.approx(K)
    state, alone = both.model.state_dict(), images.model.state_dict()
    fc1 = "text_model.encoder.layers.0.mlp.fc1.weight"
    assert not torch.equal(state[fc1], alone[fc1])  # the text tower now follows its node M-Loss
    for name, value in alone.items():  # the vision tower saw the same images, merged the same way
        if name.startswith("vision_model."):
            assert torch.equal(state[name], value), name
    assert "text tower: scored on text data" in both.method_description
    folder = both.save_pretrained(tmp_path / "merged")
    from hf_mloss.output.report import MLossReport

    saved = MLossReport.load(folder)
    assert saved.towers == both.report.towers and torch.equal(saved.keep_ratios[fc1[:-7]], keep[fc1[:-7]])
    card = (folder / "README.md").read_text()
    assert "`text_model.encoder.layers.1.mlp.fc1`" in card and "`vision_model.encoder.layers.0.mlp.fc1`" in card
    assert "text tower: scored on 5 texts" in card


def test_m_ties_on_images_only_trims_the_text_tower_at_k(clip, pixels, tmp_path):
    base, models = clip
    result = hf_mloss.merge(base, models, "m_ties", data=pixels, k=K, e=E, lam=LAM, progress=False)
    ties = hf_mloss.merge(base, models, "ties", k=K, lam=LAM, scope="tensor", weights=[0.5, 0.5], progress=False)
    state, reference = result.model.state_dict(), ties.model.state_dict()
    text = [name for name in state if name.startswith("text_model.")]
    assert len(text) > 20
    for name in text:
        assert torch.equal(state[name], reference[name]), name
    assert not torch.equal(state["vision_model.encoder.layers.0.mlp.fc1.weight"],
                           reference["vision_model.encoder.layers.0.mlp.fc1.weight"])
    status = "no text data, trimmed at k=0.3 (data-free)"
    assert result.report.towers["text_model"] == {"status": status}
    assert f"text tower: {status}" in result.report.summary()
    assert f"text tower: {status}" in result.method_description
    assert f"text tower: {status}" in (result.save_pretrained(tmp_path / "m") / "README.md").read_text()


def test_m_ties_on_text_only_trims_the_vision_tower_at_k(clip):
    base, models = clip
    result = hf_mloss.merge(base, models, "m_ties", text_data=TEXTS, k=K, e=E, lam=LAM, progress=False)
    ties = hf_mloss.merge(base, models, "ties", k=K, lam=LAM, scope="tensor", weights=[0.5, 0.5], progress=False)
    state, reference = result.model.state_dict(), ties.model.state_dict()
    for name in state:
        if name.startswith("vision_model."):
            assert torch.equal(state[name], reference[name]), name
    assert set(result.report.keep_ratios) == {f"text_model.encoder.layers.{i}.mlp.fc1" for i in (0, 1)}
    assert result.report.towers["vision_model"] == {"status": "no image data, trimmed at k=0.3 (data-free)"}


# ------------------------------------------------------------------------------------------- config, YAML, CLI
def test_config_yaml_round_trip_reruns_the_merge(clip, image_folder, text_file, tmp_path):
    base, models = clip
    result = hf_mloss.merge(base, models, "m_ties", data=str(image_folder), text_data=str(text_file), k=K, e=E,
                            num_samples=4, text_column=None, max_length=16, progress=False)
    assert result.config.text_data.path == str(text_file) and result.config.text_data.max_length == 16
    assert result.config.data.max_length is None  # the text options describe the text, not the images
    folder = result.save_pretrained(tmp_path / "merged")
    recipe = (folder / "hf_mloss_config.yaml").read_text()
    assert "text_data:" in recipe and "texts.txt" in recipe
    again = hf_mloss.run(folder)
    for name, value in result.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], value), name
    assert again.report.towers["text_model"]["data"]["num_tokens"] == result.report.towers["text_model"]["data"][
        "num_tokens"]


def test_cli_text_data(clip, image_folder, text_file, tmp_path, capsys):
    from hf_mloss.cli import main
    from hf_mloss.spec.config import MergeConfig

    base, models = clip
    config = MergeConfig.from_kwargs(base, models, "m_ties", data=str(image_folder), k=K, e=E, num_samples=4)
    config.to_yaml(tmp_path / "merge.yaml")
    assert main(["score", str(tmp_path / "merge.yaml"), "--text-data", str(text_file), "--text-num-samples", "3",
                 "--text-max-length", "12", "-q"]) == 0
    out = capsys.readouterr().out
    assert "text_model.encoder.layers.1.mlp.fc1" in out and "text tower: scored on 3 texts" in out
    assert main(["merge", str(tmp_path / "merge.yaml"), str(tmp_path / "out"), "--text-data", str(text_file),
                 "-q"]) == 0
    recorded = MergeConfig.from_pretrained(tmp_path / "out")
    assert recorded.text_data.path == str(text_file)
    assert main(["score", str(tmp_path / "merge.yaml"), "--text-column", "text", "-q"]) == 2  # needs --text-data
    assert "add --text-data" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- refusals
def test_bad_text_data_is_refused_before_any_write(clip, tmp_path, text_file):
    base, models = clip
    with pytest.raises(DataError, match="text_data is an empty list"):
        hf_mloss.merge(base, models, "m_ties", text_data=[], progress=False)
    with pytest.raises(DataError, match="text_data 'missing.txt' does not exist"):
        hf_mloss.score(base, models, text_data="missing.txt", progress=False)
    with pytest.raises(DataError, match="scored on images, but data= holds.*pass the text as text_data="):
        hf_mloss.score(base, models, data=TEXTS, progress=False)
    with pytest.raises(InvalidParameterError, match="merges without data and would ignore it"):
        hf_mloss.merge(base, models, "ties", text_data=TEXTS, progress=False)
    with pytest.raises(InvalidParameterError, match="output_gap compares the pooled outputs of a model of one tower"):
        hf_mloss.compatibility(base, models, data=torch.zeros(2, 3, 32, 32), text_data=TEXTS, output_gap=True,
                               progress=False)
    with pytest.raises(InvalidParameterError, match="output='tower' does not write it"):
        hf_mloss.merge(base, models, "m_ties", text_data=TEXTS, output="tower", progress=False)
    bert, berts = save_family(tmp_path / "bert", "bert", q=2)
    with pytest.raises(InvalidParameterError, match="no text tower beside a scored one.*goes to data="):
        hf_mloss.merge(str(bert), [str(m) for m in berts], "m_ties", text_data=TEXTS, progress=False)
    tower = tmp_path / "tower"
    CLIPModel.from_pretrained(models[1]).vision_model.save_pretrained(tower)
    with pytest.raises(InvalidParameterError, match="hold only one tower"):
        hf_mloss.score(base, [models[0], str(tower)], text_data=str(text_file), progress=False)


def test_cli_refuses_bad_text_data_before_writing(clip, image_folder, tmp_path, capsys):
    from hf_mloss.cli import main
    from hf_mloss.spec.config import MergeConfig

    base, models = clip
    MergeConfig.from_kwargs(base, models, "m_ties", data=str(image_folder)).to_yaml(tmp_path / "m.yaml")
    out = tmp_path / "out"
    assert main(["merge", str(tmp_path / "m.yaml"), str(out), "--text-data", str(tmp_path / "nope.txt"), "-q"]) == 2
    assert "nope.txt' does not exist" in capsys.readouterr().err
    assert not out.exists()


def test_text_data_from_a_datasets_split_with_text_column(clip):
    from datasets import Dataset

    base, models = clip
    split = Dataset.from_dict({"caption": TEXTS, "other": [t[::-1] for t in TEXTS]})  # CLIP lowercases
    report = hf_mloss.score(base, models, text_data=split, text_column="caption", progress=False)
    strings = hf_mloss.score(base, models, text_data=TEXTS, progress=False)
    other = hf_mloss.score(base, models, text_data=split, text_column="other", progress=False)
    name = "text_model.encoder.layers.1.mlp.fc1"
    assert torch.equal(report.node[name], strings.node[name])
    assert not torch.equal(other.node[name], strings.node[name])


def test_selection_reads_back_the_scores_of_a_whole_model_report(clip, pixels):
    """Label-free selection replays a whole-model merge's node M-Loss, which its report names as in the whole
    model (``vision_model.encoder...``)."""
    from transformers import AutoConfig

    from hf_mloss.adapters import adapter_for, whole_model_adapter
    from hf_mloss.merging.selection import recorded_scores

    base, models = clip
    report = hf_mloss.merge(base, models, "m_ties", data=pixels, k=K, e=E, progress=False).report
    adapter = whole_model_adapter(adapter_for(AutoConfig.from_pretrained(base)))
    scores = recorded_scores(report, adapter)
    assert sorted(scores) == [0, 1]
    assert torch.equal(scores[1].node, report.node["vision_model.encoder.layers.1.mlp.fc1"])


def test_each_models_own_images_and_texts_score_as_their_union(clip, pixels):
    """A whole CLIPModel's models each with their own images and texts: score() reads the union of each tower's
    data, as the pooled sets give it; RegMean reads each model's own texts for its text tower's Grams."""
    base, models = clip
    own_texts = [TEXTS[:2], TEXTS[2:]]
    own_pixels = [pixels[:1], pixels[1:]]
    entries = [{"model": m, "data": x, "text_data": t} for m, x, t in zip(models, own_pixels, own_texts)]
    own = hf_mloss.score(base, entries, progress=False)
    pooled = hf_mloss.score(base, models, data=pixels, text_data=TEXTS, num_samples=len(TEXTS), progress=False)
    assert set(own.node) == set(pooled.node)
    for name, value in pooled.node.items():
        torch.testing.assert_close(own.node[name], value, rtol=1e-5, atol=1e-7, msg=name)
    merged = hf_mloss.merge(base, entries, "regmean", progress=False)
    together = hf_mloss.merge(base, models, "regmean", data=pixels, text_data=TEXTS, progress=False)
    key = "text_model.encoder.layers.1.mlp.fc1.weight"
    assert not torch.allclose(merged.model.state_dict()[key], together.model.state_dict()[key], rtol=1e-4)
    assert merged.model_data_info["text_data"][1].num_samples == len(own_texts[1])
