"""The run object and what hangs off it: methods that own their layer hooks, whole-CLIPModel outputs, processors for
loaded models, normalised M-Loss weights, mergekit YAML, a short report repr and a CLI that starts without torch."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import CLIPModel, CLIPVisionModel

import hf_mloss
from hf_mloss import MergeConfig
from hf_mloss._validation import param
from hf_mloss.methods import MERGE_METHODS, LayerHooks, MergeMethod, MethodParams, register_merge_method
from hf_mloss.spec.options import PREFIXES, ScoringOptions
from examples.tiny import make_base, make_finetune, save_clip_model, save_model

IMAGES = {"num_samples": 8, "batch_size": 4}


# ------------------------------------------------------------------------------------- a method defined here
@dataclass(frozen=True)
class GateParams(ScoringOptions, MethodParams):
    prefix: str = param("base", "Where the scored linear's input comes from.", choices=PREFIXES)


class GateHooks(LayerHooks):
    """Rows of each fc1 whose node M-Loss is at most the layer's median take the sources' mean; the rest stay."""

    def __init__(self, run) -> None:
        self.run, self.calls = run, []

    def before_stage(self, stage: int) -> None:
        self.calls.append(("stage", stage))
        self.run.merge([n for n in self.run.stage_names(stage) if not n.endswith("mlp.fc1.weight")])

    def after_scores(self, layer: int, scores) -> None:
        self.calls.append(("scores", layer))
        target = self.run.adapter.target_name(layer)
        gate = scores.node <= scores.node.median()
        self.run.ctx.state.setdefault("gate", {})[f"{target}.weight"] = gate
        self.run.record("keep_ratios", target, gate.float())
        self.run.merge([f"{target}.weight"])

    def after_all(self) -> None:
        self.calls.append(("all",))
        self.run.merge_remaining()


class GatedAverage(MergeMethod):
    name = "test_gated_average"
    pretty_name = "Gated average (test)"
    reference = "tests/test_run_object.py"
    reference_url = ""
    params_class = GateParams
    needs_data = True
    last_hooks: GateHooks | None = None

    def layer_hooks(self, run) -> LayerHooks:
        GatedAverage.last_hooks = GateHooks(run)
        return GatedAverage.last_hooks

    def merge_tensor(self, name, base, sources, ctx):
        mean = torch.stack(sources).mean(0)
        gate = ctx.state.get("gate", {}).get(name)
        return mean if gate is None else torch.where(gate[:, None], mean, base)


@pytest.fixture
def gated_method():
    register_merge_method(GatedAverage())  # the one call a new method needs
    yield "test_gated_average"
    del MERGE_METHODS["test_gated_average"]


@pytest.mark.parametrize("prefix", ["base", "merged"])
def test_a_method_defined_in_a_test_plugs_its_hooks_into_the_driver(tiny_paths, image_folder, gated_method, prefix):
    base, models = tiny_paths
    result = hf_mloss.merge(base, models, gated_method, data=str(image_folder), prefix=prefix, progress=False,
                            **IMAGES)
    calls = GatedAverage.last_hooks.calls
    if prefix == "merged":  # interleaved: each block is scored on the merged blocks before it
        assert calls == [("stage", -1), ("stage", 0), ("scores", 0), ("stage", 1), ("scores", 1), ("stage", 2),
                         ("all",)]
    else:  # scored first (the base's forward), then the hooks in block order
        assert calls == [("scores", 0), ("scores", 1), ("all",)]
    stores = [load_file(f"{m}/model.safetensors") for m in [base, *models]]
    merged = result.model.state_dict()
    for layer in (0, 1):
        name = f"encoder.layers.{layer}.mlp.fc1"
        gate = result.report.keep_ratios[name].bool()
        assert 0 < int(gate.sum()) < gate.numel()
        mean = torch.stack([s[f"{name}.weight"] for s in stores[1:]]).mean(0)
        expected = torch.where(gate[:, None], mean, stores[0][f"{name}.weight"])
        torch.testing.assert_close(merged[f"{name}.weight"], expected, rtol=0, atol=1e-6)
    bias = "encoder.layers.0.mlp.fc1.bias"
    torch.testing.assert_close(merged[bias], torch.stack([s[bias] for s in stores[1:]]).mean(0), rtol=0, atol=1e-6)
    assert "test_gated_average" in hf_mloss.list_methods()


# ------------------------------------------------------------------------------------------ whole CLIPModel
@pytest.fixture(scope="module")
def clip_setup(tmp_path_factory):
    """An openai-like full CLIPModel base and two vision-tower-only fine-tunes with prefixed keys."""
    root = tmp_path_factory.mktemp("clip")
    base = make_base(0)
    base_dir = save_clip_model(base, root / "base")
    models = [save_model(make_finetune(base, i), root / f"ft{i}", prefixed=True) for i in range(2)]
    for m in models:
        (m / "preprocessor_config.json").unlink()  # as tanganke's fine-tunes: no processor of their own
    return base_dir, models


def test_a_full_clip_base_gives_a_full_clip_merge(clip_setup, tmp_path):
    base_dir, models = clip_setup
    whole = hf_mloss.merge(str(base_dir), [str(m) for m in models], "ties", k=0.5, progress=False)
    tower = hf_mloss.merge(str(base_dir), [str(m) for m in models], "ties", k=0.5, output="tower", progress=False)
    assert isinstance(whole.model, CLIPModel) and isinstance(tower.model, CLIPVisionModel)
    original = CLIPModel.from_pretrained(base_dir).state_dict()
    for key, value in whole.model.state_dict().items():
        if key.startswith("vision_model."):
            torch.testing.assert_close(value, tower.model.state_dict()[key.removeprefix("vision_model.")],
                                       rtol=0, atol=0)
        else:  # text tower, projections and logit scale: the base's
            assert torch.equal(value, original[key]), key
    folder = whole.save_pretrained(tmp_path / "merged")
    loaded, info = CLIPModel.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    from huggingface_hub import ModelCard
    from PIL import Image
    from transformers import pipeline

    assert ModelCard.load(folder / "README.md").data.pipeline_tag == "zero-shot-image-classification"
    classifier = pipeline("zero-shot-image-classification", model=str(folder))
    out = classifier(Image.new("RGB", (40, 40), "red"), candidate_labels=["a red square", "a blue circle"])
    assert {o["label"] for o in out} == {"a red square", "a blue circle"}
    assert abs(sum(o["score"] for o in out) - 1) < 1e-5


def test_a_saved_tower_uses_the_prefixed_layout(clip_setup, tmp_path):
    base_dir, models = clip_setup
    folder = hf_mloss.merge(str(base_dir), [str(m) for m in models], "average", output="tower",
                            progress=False).save_pretrained(tmp_path / "tower")
    keys = load_file(str(folder / "model.safetensors")).keys()
    assert all(k.startswith("vision_model.") for k in keys)  # loads in transformers 4.x and 5.0-5.5 too
    model, info = CLIPVisionModel.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


# ------------------------------------------------------------------------------------ processors for loaded models
def test_loaded_model_base_finds_or_is_given_a_processor(tiny_paths, image_folder):
    base, models = tiny_paths
    loaded = CLIPVisionModel.from_pretrained(base)  # name_or_path: the folder, which has a processor
    from_path = hf_mloss.merge(loaded, models, "m_ties", data=str(image_folder), progress=False, **IMAGES)
    from_file = hf_mloss.merge(base, models, "m_ties", data=str(image_folder), progress=False, **IMAGES)
    for key, value in from_file.model.state_dict().items():
        assert torch.equal(value, from_path.model.state_dict()[key]), key
    anonymous = make_base(0)  # built in memory: it does not say where it came from
    with pytest.raises(hf_mloss.InvalidParameterError, match="(?i)pass processor=") as info:
        hf_mloss.merge(anonymous, models, "m_ties", data=str(image_folder), progress=False, **IMAGES)
    assert "does not name where it came from" in str(info.value)
    given = hf_mloss.merge(anonymous, models, "m_ties", data=str(image_folder), processor=base, progress=False,
                           **IMAGES)
    assert given.report is not None


# ---------------------------------------------------------------------------------------------- M-Loss weights
def test_mloss_uses_normalised_weights(tiny_paths, image_folder):
    """Scaling all weights together changes neither the M-Loss nor M-TIES's row ranks (SPEC §1)."""
    base, models = tiny_paths
    reports = [hf_mloss.score(base, models, str(image_folder), weights=w, prefix="base", progress=False, **IMAGES)
               for w in (None, [1, 1, 1], [5, 5, 5])]
    for report in reports[1:]:
        assert report.layer == pytest.approx(reports[0].layer, rel=1e-6)
        assert report.weights == pytest.approx([1 / 3] * 3)
    unequal = [hf_mloss.score(base, models, str(image_folder), weights=w, prefix="base", progress=False, **IMAGES)
               for w in ([1, 2, 3], [10, 20, 30])]
    assert unequal[0].layer == pytest.approx(unequal[1].layer, rel=1e-6)
    assert unequal[0].layer != pytest.approx(reports[0].layer, rel=1e-3)
    a, b = (hf_mloss.merge(base, models, "m_ties", data=str(image_folder), weights=w, progress=False, **IMAGES)
            for w in ([1, 2, 3], [10, 20, 30]))
    for name, keep in a.report.keep_ratios.items():
        assert torch.equal(keep, b.report.keep_ratios[name])


# --------------------------------------------------------------------------------------------- mergekit YAML
def test_mergekit_yaml_is_mapped_to_our_config(tiny_paths, tmp_path):
    base, models = tiny_paths
    path = tmp_path / "mergekit.yml"
    path.write_text(yaml.safe_dump({
        "merge_method": "ties", "base_model": base,
        "models": [{"model": m, "parameters": {"weight": w, "density": 0.3}} for m, w in zip(models, [1, 0.5, 2])],
        "parameters": {"normalize": True, "lambda": 0.7}, "dtype": "float32",
    }))  # fmt: skip
    config = MergeConfig.from_yaml(path)
    assert config.method == "ties" and config.parameters == {"lam": 0.7, "k": 0.3, "convention": "mergekit",
                                                      "normalize": True}
    assert [m.weight for m in config.models] == [1, 0.5, 2] and config.dtype == "float32"
    for bad, message in [({"merge_method": "frankenmerge"}, "not one hf_mloss shares"),
                         ({"parameters": {"normalize": "no"}}, "normalize must be true or false"),
                         ({"models": [{"model": models[0], "parameters": {"density": 0.2, "weight": "heavy"}}]},
                          "must be a number, a gradient or a filter list"),
                         ({"slices": []}, "both `models` and `slices`")]:
        path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **bad}))
        with pytest.raises(hf_mloss.ConfigError, match=message):
            MergeConfig.from_yaml(path)
        path.write_text(yaml.safe_dump({"merge_method": "ties", "base_model": base, "models": [
            {"model": m, "parameters": {"weight": 1, "density": 0.3}} for m in models]}))


# ------------------------------------------------------------------------------------------------- friction
def test_report_repr_is_one_line(tiny_paths, image_folder):
    base, models = tiny_paths
    report = hf_mloss.score(base, models, str(image_folder), prefix="base", progress=False, **IMAGES)
    assert "\n" not in repr(report) and len(repr(report)) < 200 and "layers=2" in repr(report)
    assert "\n" not in repr(hf_mloss.merge(base, models, "average", progress=False))


def test_cli_help_and_methods_do_not_import_torch():
    code = ("import sys\nfrom hf_mloss.cli import main\nassert main(['methods']) == 0\n"
            "assert main(['--help']) == 0\nprint(sorted(m for m in ('torch', 'transformers', 'datasets') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
    assert "m_ties" in out and "Keep fraction" not in out.splitlines()[0]
