"""PEFT LoRA adapters in and out (hf_mloss.loading.lora): adapters read as their merged models, adapters written back, and
parity with PEFT's own ``merge_and_unload`` and ``add_weighted_adapter``. Tiny CLIP models, offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model
from transformers import CLIPModel, CLIPVisionModel

import hf_mloss
from hf_mloss.errors import (
    ConfigError,
    IncompatibleCheckpointsError,
    InvalidParameterError,
    UnsupportedModelError,
)
from examples.tiny import make_base, save_model, tiny_processor

TARGETS = ["q_proj", "v_proj", "fc1", "fc2"]
TOL = 1e-5


def _randomise_b(model, seed: int, scale: float = 0.05) -> None:
    """PEFT initialises B to zero; give every LoRA factor random values so ΔW ≠ 0."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(scale * torch.randn(param.shape, generator=generator))
            elif "modules_to_save" in name or (param.requires_grad and "lora" not in name):
                param.add_(0.02 * torch.randn(param.shape, generator=generator))


def make_adapter(base_dir: Path, out: Path, seed: int, *, model_class=CLIPVisionModel, base_name: str | None = None,
                 **lora_kwargs) -> Path:
    """A trained-looking LoRA adapter of the base in ``base_dir``, saved with PEFT's save_pretrained."""
    base = model_class.from_pretrained(base_dir)
    kwargs = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **lora_kwargs}
    model = get_peft_model(base, LoraConfig(**kwargs))
    _randomise_b(model, seed)
    model.save_pretrained(out)
    config = json.loads((out / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base_name if base_name is not None else str(base_dir)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def materialise(base_dir: Path, adapter: Path, out: Path, *, model_class=CLIPVisionModel) -> Path:
    """The adapter's full model as PEFT makes it: merge_and_unload(), saved with save_pretrained."""
    merged = PeftModel.from_pretrained(model_class.from_pretrained(base_dir), adapter).merge_and_unload()
    merged.save_pretrained(out)
    tiny_processor().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """A tiny CLIP vision base, 3 adapters of different ranks (one rsLoRA with an alpha pattern), their merged forms."""
    root = tmp_path_factory.mktemp("lora")
    base_dir = save_model(make_base(seed=0), root / "base")
    variants = [dict(r=4), dict(r=8, lora_alpha=4, use_rslora=True, alpha_pattern={"fc2": 32}), dict(r=2)]
    adapters = [make_adapter(base_dir, root / f"lora{i}", seed=i + 1, **kw) for i, kw in enumerate(variants)]
    full = [materialise(base_dir, a, root / f"full{i}") for i, a in enumerate(adapters)]
    return base_dir, adapters, full


def _state(result) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in result.model.state_dict().items()}


def assert_close_states(a: dict, b: dict, tol: float = TOL) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=tol, rtol=0), (key, float((a[key] - b[key]).abs().max()))


# ================================================================================== adapters read as full models
def test_store_gives_merge_and_unload_weights(lora_setup):
    """Each tensor of an adapter store equals the merged model's tensor PEFT writes (rank, rsLoRA, alpha_pattern)."""
    from hf_mloss.adapters import adapter_for
    from hf_mloss.spec.config import ModelSpec
    from hf_mloss.loading.hub import resolve_model
    from hf_mloss.loading.lora import resolve_lora
    from hf_mloss.loading.store import CheckpointStore

    base_dir, adapters, full = lora_setup
    base_ref = resolve_model(base_dir)
    family = adapter_for(CLIPVisionModel.from_pretrained(base_dir).config)
    base_store = CheckpointStore(base_ref, family)
    for adapter_dir, full_dir in zip(adapters, full):
        ref, _, _ = resolve_lora(ModelSpec(model=str(adapter_dir)), (base_ref, None, None), None)
        store = ref.open_store(family, base_store)
        reference = CheckpointStore(resolve_model(full_dir), family)
        assert set(store.keys()) == set(reference.keys())
        changed = 0
        for name in store.keys():
            ours, theirs = store.get_float(name), reference.get_float(name)
            assert torch.allclose(ours, theirs, atol=1e-6, rtol=0), name
            changed += not torch.equal(theirs, base_store.get_float(name))
        assert changed == len(store.lora.modules) == 2 * 4  # q, v, fc1, fc2 of both blocks


@pytest.mark.parametrize("method,params", [
    ("task_arithmetic", {"lam": 0.7}),
    ("average", {}),
    ("ties", {"k": 0.3}),
    ("ties", {"k": 0.3, "convention": "peft"}),
    ("dare_ties", {"p": 0.6}),
    ("dare_linear", {"p": 0.6}),
])
def test_data_free_merge_of_adapters_equals_merge_of_materialised_models(lora_setup, method, params):
    base_dir, adapters, full = lora_setup
    ours = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], method, progress=False, seed=3, **params)
    theirs = hf_mloss.merge(str(base_dir), [str(f) for f in full], method, progress=False, seed=3, **params)
    assert_close_states(_state(ours), _state(theirs))
    assert [m.name for m in ours.models] == [a.name for a in adapters]


def test_m_ties_score_and_compatibility_on_adapters_equal_materialised(lora_setup, image_folder):
    base_dir, adapters, full = lora_setup
    kwargs = dict(data=str(image_folder), num_samples=8, progress=False)
    ours = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], "m_ties", k=0.3, **kwargs)
    theirs = hf_mloss.merge(str(base_dir), [str(f) for f in full], "m_ties", k=0.3, **kwargs)
    assert_close_states(_state(ours), _state(theirs))
    for row_ours, row_theirs in zip(ours.report.summary_rows(), theirs.report.summary_rows()):
        for key, value in row_theirs.items():
            if isinstance(value, float):
                assert row_ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    score_ours = hf_mloss.score(str(base_dir), [str(a) for a in adapters], **kwargs).summary_rows()
    score_theirs = hf_mloss.score(str(base_dir), [str(f) for f in full], **kwargs).summary_rows()
    assert len(score_ours) == len(score_theirs) == 2
    for row_ours, row_theirs in zip(score_ours, score_theirs):
        for key, value in row_theirs.items():
            if isinstance(value, float):
                assert row_ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    pairs_ours = hf_mloss.compatibility(str(base_dir), [str(a) for a in adapters[:2]], **kwargs)
    pairs_theirs = hf_mloss.compatibility(str(base_dir), [str(f) for f in full[:2]], **kwargs)
    ours_matrix, theirs_matrix = pairs_ours.matrix(), pairs_theirs.matrix()
    assert torch.isfinite(theirs_matrix[0, 1]) and theirs_matrix[0, 1] > 0
    assert torch.allclose(ours_matrix, theirs_matrix, rtol=1e-4, equal_nan=True)


def test_unlabeled_selection_on_adapters_equals_materialised(lora_setup, image_folder):
    base_dir, adapters, full = lora_setup
    kwargs = dict(data=str(image_folder), num_samples=8, progress=False, select="unlabeled",
                  grid={"lam": [0.3, 0.9]})
    ours = hf_mloss.merge(str(base_dir), [str(a) for a in adapters[:2]], "task_arithmetic", **kwargs)
    theirs = hf_mloss.merge(str(base_dir), [str(f) for f in full[:2]], "task_arithmetic", **kwargs)
    assert ours.config.select.chosen == theirs.config.select.chosen
    for a, b in zip(ours.config.select.candidates, theirs.config.select.candidates):
        for key in ours.config.select.criteria:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7)
    assert_close_states(_state(ours), _state(theirs))


def test_unlabeled_selection_into_an_adapter_uses_the_chosen_setting(lora_setup, image_folder, tmp_path):
    base_dir, adapters, _ = lora_setup
    result = hf_mloss.merge(str(base_dir), [str(a) for a in adapters[:2]], "task_arithmetic", data=str(image_folder),
                            num_samples=8, select="unlabeled", grid={"lam": [0.2, 1.5]}, output="adapter",
                            progress=False)
    assert result.config.parameters["lam"] == result.config.select.chosen["lam"]
    folder = result.save_pretrained(tmp_path / "chosen")
    assert_close_states(load_written_adapter(base_dir, folder), _state(result))


# ================================================================================== an adapter out, and PEFT parity
def peft_combination(base_dir: Path, adapters: list[Path], weights: list[float], combination: str, *,
                     model_class=CLIPVisionModel, **kwargs) -> dict[str, torch.Tensor]:
    """PEFT's own add_weighted_adapter on the same adapters, merged with merge_and_unload (the state dict)."""
    model = PeftModel.from_pretrained(model_class.from_pretrained(base_dir), adapters[0], adapter_name="a0")
    for i, adapter in enumerate(adapters[1:], start=1):
        model.load_adapter(adapter, adapter_name=f"a{i}")
    names = [f"a{i}" for i in range(len(adapters))]
    model.add_weighted_adapter(names, weights, "merged", combination_type=combination, **kwargs)
    model.set_adapter("merged")
    return {k: v.float() for k, v in model.merge_and_unload().state_dict().items()}


def load_written_adapter(base_dir: Path, folder: Path, model_class=CLIPVisionModel) -> dict[str, torch.Tensor]:
    model = PeftModel.from_pretrained(model_class.from_pretrained(base_dir), folder)
    return {k: v.float() for k, v in model.merge_and_unload().state_dict().items()}


def test_cat_adapter_is_exact_and_equals_peft_cat(lora_setup, tmp_path):
    base_dir, adapters, _ = lora_setup
    weights = [0.5, 1.2, 0.3]
    result = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], "task_arithmetic", lam=1.0, weights=weights,
                            output="adapter", combination="cat", progress=False)
    folder = result.save_pretrained(tmp_path / "cat")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 + 8 + 2 and config["lora_alpha"] == config["r"]
    loaded = load_written_adapter(base_dir, folder)
    assert_close_states(loaded, _state(result))  # exact: the adapter IS the merge
    assert_close_states(loaded, peft_combination(base_dir, adapters, weights, "cat"))
    card = (folder / "README.md").read_text()
    assert "library_name: peft" in card and "PeftModel.from_pretrained" in card


def test_average_cat_adapter_is_exact(lora_setup, tmp_path):
    base_dir, adapters, full = lora_setup
    result = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], "average", output="adapter", progress=False)
    assert result.lora.combination == "cat"
    folder = result.save_pretrained(tmp_path / "avg")
    # a local base is named by its folder, as PEFT does for a base loaded from one (not null)
    written = json.loads((folder / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str(Path(base_dir).resolve())
    reference = hf_mloss.merge(str(base_dir), [str(f) for f in full], "average", progress=False)
    assert_close_states(load_written_adapter(base_dir, folder), _state(reference))


def test_svd_adapter_equals_peft_svd_and_records_its_error(lora_setup, tmp_path):
    base_dir, adapters, _ = lora_setup
    weights = [0.6, 0.4, 0.8]
    result = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], "task_arithmetic", lam=1.0, weights=weights,
                            output="adapter", combination="svd", lora_rank=5, progress=False)
    folder = result.save_pretrained(tmp_path / "svd")
    loaded = load_written_adapter(base_dir, folder)
    assert_close_states(loaded, peft_combination(base_dir, adapters, weights, "svd", svd_rank=5))
    recorded = json.loads((folder / "hf_mloss_lora.json").read_text())
    assert recorded["combination"] == "svd" and recorded["rank"] == 5
    base = CLIPVisionModel.from_pretrained(base_dir).state_dict()
    exact = _state(result)  # result.model: the merge before factorisation
    for module, error in recorded["relative_errors"].items():
        key = f"{module}.weight"
        delta = exact[key] - base[key]
        measured = float(torch.linalg.norm(delta - (loaded[key] - base[key])) / torch.linalg.norm(delta))
        assert error == pytest.approx(measured, rel=1e-3, abs=1e-6), module
        assert 0 < error < 1  # rank 5 < rank 14 of the exact sum: something is lost, not everything
    card = (folder / "README.md").read_text()
    assert "Relative Frobenius error" in card and f"{recorded['max_relative_error']:.4f}" in card


def test_ties_svd_adapter_equals_peft_ties_svd(lora_setup, tmp_path):
    base_dir, adapters, _ = lora_setup
    weights = [0.7, 1.0, 0.5]
    result = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], "ties", k=0.4, lam=1.0, convention="peft",
                            weights=weights, output="adapter", lora_rank=6, progress=False)
    assert result.lora.combination == "svd"
    folder = result.save_pretrained(tmp_path / "ties")
    theirs = peft_combination(base_dir, adapters, weights, "ties_svd", svd_rank=6, density=0.4)
    assert_close_states(load_written_adapter(base_dir, folder), theirs)


def test_dare_ties_svd_adapter_equals_peft_with_the_same_masks(lora_setup, tmp_path, monkeypatch):
    """Both sides draw DARE masks from one shared rule (source i -> generator seeded by i): PEFT's own random stream
    cannot be reproduced, its arithmetic can. PEFT elects on unweighted deltas and divides by the count: with equal
    weights w that is hf_mloss's dare_ties with lam = w."""
    from peft.utils import merge_utils

    from hf_mloss.methods.base import MergeContext

    base_dir, adapters, _ = lora_setup
    q, density, w = len(adapters), 0.6, 0.8

    def mask(shape, index):
        return torch.rand(shape, generator=torch.Generator().manual_seed(1000 + index)) < density

    calls = []

    def peft_random_pruning(tensor, density, rescale):
        index = len(calls) % q
        calls.append(index)
        pruned = torch.where(mask(tensor.shape, index), tensor, torch.zeros_like(tensor))
        return pruned / density if rescale else pruned

    monkeypatch.setattr(merge_utils, "random_pruning", peft_random_pruning)
    monkeypatch.setattr(MergeContext, "generator",
                        lambda self, name, index, device="cpu": torch.Generator().manual_seed(1000 + index))
    result = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], "dare_ties", p=density, lam=w,
                            output="adapter", lora_rank=6, progress=False)
    folder = result.save_pretrained(tmp_path / "dare")
    theirs = peft_combination(base_dir, adapters, [w] * q, "dare_ties_svd", svd_rank=6, density=density)
    assert len(calls) == q * 8
    assert_close_states(load_written_adapter(base_dir, folder), theirs)


def test_adapter_output_from_whole_clip_adapters_loads_in_clipmodel(tmp_path, image_folder):
    """Adapters trained on a full CLIPModel (text tower included): the vision tower merges as their materialised
    models do, so does the text tower (merged, as for full-model inputs), and the adapter written loads in PEFT."""
    from examples.tiny import save_clip_model

    base_dir = save_clip_model(make_base(seed=0), tmp_path / "clip")
    adapters = [make_adapter(base_dir, tmp_path / f"clip_lora{i}", seed=i + 5, model_class=CLIPModel)
                for i in range(2)]
    full = [materialise(base_dir, a, tmp_path / f"clip_full{i}", model_class=CLIPModel) for i, a in enumerate(adapters)]
    ours = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], "ties", k=0.5, progress=False)
    theirs = hf_mloss.merge(str(base_dir), [str(f) for f in full], "ties", k=0.5, progress=False)
    assert isinstance(ours.model, CLIPModel)
    assert_close_states(_state(ours), _state(theirs))
    result = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], "task_arithmetic", lam=0.5,
                            output="adapter", progress=False)
    folder = result.save_pretrained(tmp_path / "clip_cat")
    loaded = load_written_adapter(base_dir, folder, CLIPModel)
    assert_close_states(loaded, _state(result))
    base = CLIPModel.from_pretrained(base_dir).state_dict()
    assert any(not torch.equal(loaded[k], base[k]) for k in loaded if k.startswith("vision_model.encoder"))
    assert any(not torch.equal(loaded[k], base[k]) for k in loaded if k.startswith("text_model.encoder"))


@pytest.mark.parametrize("kwargs", [
    dict(use_dora=True),
    dict(modules_to_save=["post_layernorm"]),
    dict(bias="all"),
    dict(r=3, rank_pattern={"fc1": 6}, alpha_pattern={"q_proj": 2}),
    dict(target_modules=["patch_embedding", "position_embedding", "q_proj"]),  # Conv2d and Embedding LoRA
])
def test_lora_variants_read_exactly(lora_setup, tmp_path, kwargs):
    """DoRA (Linear), modules_to_save, trained biases and rank/alpha patterns: the merge equals the materialised one."""
    base_dir, adapters, full = lora_setup
    variant = make_adapter(base_dir, tmp_path / "variant", seed=11, **kwargs)
    variant_full = materialise(base_dir, variant, tmp_path / "variant_full")
    ours = hf_mloss.merge(str(base_dir), [str(variant), str(adapters[0])], "task_arithmetic", lam=1.0,
                          progress=False)
    theirs = hf_mloss.merge(str(base_dir), [str(variant_full), str(full[0])], "task_arithmetic", lam=1.0,
                            progress=False)
    assert_close_states(_state(ours), _state(theirs))
    if "target_modules" in kwargs:
        with pytest.raises(InvalidParameterError, match="writes LoRA on linear layers"):
            hf_mloss.merge(str(base_dir), [str(variant), str(adapters[0])], "average", output="adapter",
                           progress=False)


def test_modules_to_save_written_into_the_adapter(lora_setup, tmp_path):
    base_dir, adapters, full = lora_setup
    variant = make_adapter(base_dir, tmp_path / "mts", seed=12, modules_to_save=["post_layernorm"])
    variant_full = materialise(base_dir, variant, tmp_path / "mts_full")
    result = hf_mloss.merge(str(base_dir), [str(variant), str(adapters[2])], "average", output="adapter",
                            progress=False)
    folder = result.save_pretrained(tmp_path / "mts_out")
    assert json.loads((folder / "adapter_config.json").read_text())["modules_to_save"] == ["post_layernorm"]
    reference = hf_mloss.merge(str(base_dir), [str(variant_full), str(full[2])], "average", progress=False)
    assert_close_states(load_written_adapter(base_dir, folder), _state(reference))


# ================================================================================== refusals
def test_refusals_before_any_work(lora_setup, tmp_path):
    base_dir, adapters, full = lora_setup
    models = [str(a) for a in adapters]
    with pytest.raises(InvalidParameterError, match="combination='cat' is exact only for linear methods"):
        hf_mloss.merge(str(base_dir), models, "ties", output="adapter", combination="cat", progress=False)
    with pytest.raises(InvalidParameterError, match="lora_rank and combination describe an adapter output"):
        hf_mloss.merge(str(base_dir), models, "ties", lora_rank=4, progress=False)
    with pytest.raises(InvalidParameterError, match="is a full model"):
        hf_mloss.merge(str(base_dir), [models[0], str(full[1])], "ties", output="adapter", progress=False)
    with pytest.raises(InvalidParameterError, match="base .* is a LoRA adapter"):
        hf_mloss.merge(models[0], models[1:], "ties", progress=False)
    with pytest.raises(InvalidParameterError, match="DoRA inputs are not low-rank"):
        dora = make_adapter(base_dir, tmp_path / "dora", seed=3, use_dora=True)
        hf_mloss.merge(str(base_dir), [str(dora), models[0]], "task_arithmetic", output="adapter", progress=False)


def test_loaded_peft_model_is_refused_with_the_way_out(lora_setup):
    base_dir, adapters, _ = lora_setup
    loaded = PeftModel.from_pretrained(CLIPVisionModel.from_pretrained(base_dir), adapters[0])
    with pytest.raises(InvalidParameterError, match=r"models\[0\] is a loaded PeftModel; pass its adapter folder"):
        hf_mloss.merge(str(base_dir), [loaded, str(adapters[1])], "ties", progress=False)


def test_base_mismatch_names_both(lora_setup, tmp_path):
    base_dir, adapters, _ = lora_setup
    other = make_adapter(base_dir, tmp_path / "other", seed=4, base_name="openai/clip-vit-base-patch32")
    with pytest.raises(IncompatibleCheckpointsError, match=r"openai/clip-vit-base-patch32.*base of this merge is"):
        hf_mloss.merge(str(base_dir), [str(other), str(adapters[0])], "ties", progress=False)
    # an empty base_model_name_or_path takes the run's base; a copy of the base folder matches by content
    unnamed = make_adapter(base_dir, tmp_path / "unnamed", seed=4, base_name="")
    (unnamed / "config.json").write_bytes((base_dir / "config.json").read_bytes())  # some adapters ship one
    import shutil

    copy = Path(shutil.copytree(base_dir, tmp_path / "base_copy"))
    copied = make_adapter(base_dir, tmp_path / "copied", seed=5, base_name=str(copy))
    result = hf_mloss.merge(str(base_dir), [str(unnamed), str(copied)], "ties", progress=False)
    assert [m.name for m in result.models] == ["unnamed", "copied"]


def test_ia3_adapters_read_exactly(lora_setup, tmp_path):
    """IA³ (a per-feature scale of the weight; of the bias too outside feed-forward modules) is exact: the merge equals
    the materialised one; it cannot be written back as a LoRA adapter."""
    base_model = make_base(seed=0)
    with torch.no_grad():  # non-zero biases, so that the bias scaling shows
        for name, param in base_model.named_parameters():
            if name.endswith("bias"):
                param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    base_dir = save_model(base_model, tmp_path / "base")
    ia3, ia3_full = [], []
    for i in range(2):
        config = peft.IA3Config(target_modules=["q_proj", "v_proj", "fc1", "fc2"], feedforward_modules=["fc1", "fc2"])
        model = get_peft_model(CLIPVisionModel.from_pretrained(base_dir), config)
        _randomise_b(model, seed=21 + i)
        model.save_pretrained(tmp_path / f"ia3_{i}")
        ia3.append(str(tmp_path / f"ia3_{i}"))
        ia3_full.append(str(materialise(base_dir, tmp_path / f"ia3_{i}", tmp_path / f"ia3_full{i}")))
    base = CLIPVisionModel.from_pretrained(base_dir).state_dict()
    merged = CLIPVisionModel.from_pretrained(ia3_full[0]).state_dict()
    changed = {k for k, v in merged.items() if not torch.equal(v, base[k])}
    assert "encoder.layers.0.self_attn.q_proj.bias" in changed and "encoder.layers.0.mlp.fc1.bias" not in changed
    for method in ("task_arithmetic", "ties"):
        ours = hf_mloss.merge(str(base_dir), ia3, method, progress=False)
        theirs = hf_mloss.merge(str(base_dir), ia3_full, method, progress=False)
        assert_close_states(_state(ours), _state(theirs))
    with pytest.raises(InvalidParameterError, match="IA³ adapters"):
        hf_mloss.merge(str(base_dir), ia3, "ties", output="adapter", progress=False)


@pytest.mark.parametrize("config_class,reason", [("LoHaConfig", "LoHa"), ("LoKrConfig", "LoKr")])
def test_other_adapter_types_are_refused(lora_setup, tmp_path, config_class, reason):
    base_dir, adapters, _ = lora_setup
    config = getattr(peft, config_class)(target_modules=["q_proj", "v_proj", "fc1"])
    model = get_peft_model(CLIPVisionModel.from_pretrained(base_dir), config)
    model.save_pretrained(tmp_path / "other")
    with pytest.raises(UnsupportedModelError, match=f"{reason}.*merge_and_unload"):
        hf_mloss.merge(str(base_dir), [str(tmp_path / "other"), str(adapters[0])], "ties", progress=False)


@pytest.mark.parametrize("change,message", [
    ({"init_lora_weights": "pissa"}, "also changes the base weights"),
    ({"lora_bias": True}, "lora_B"),
    ({"alora_invocation_tokens": [1, 2]}, "aLoRA"),
    ({"peft_type": "ADALORA"}, "AdaLoRA"),
])
def test_lora_options_that_are_not_exact_are_refused(lora_setup, tmp_path, change, message):
    import shutil

    base_dir, adapters, _ = lora_setup
    folder = Path(shutil.copytree(adapters[0], tmp_path / "changed"))
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError, match=message):
        hf_mloss.merge(str(base_dir), [str(folder), str(adapters[1])], "ties", progress=False)


# ================================================================================== configs: YAML, mergekit, CLI
def test_yaml_and_mergekit_model_plus_lora(lora_setup, tmp_path):
    from hf_mloss import MergeConfig

    base_dir, adapters, full = lora_setup
    config = MergeConfig.from_dict({
        "merge_method": "task_arithmetic", "base_model": str(base_dir),
        "models": [{"model": f"{base_dir}+{a}", "parameters": {"weight": 0.5}} for a in adapters[:2]],
    })
    assert [m.model for m in config.models] == [str(a) for a in adapters[:2]]
    reference = hf_mloss.merge(str(base_dir), [str(f) for f in full[:2]], "task_arithmetic", lam=1.0,
                               weights=[0.5, 0.5], progress=False)
    assert_close_states(_state(hf_mloss.run(config, progress=False)), _state(reference))
    with pytest.raises(ConfigError, match="applies adapters to the merge's base"):
        MergeConfig.from_dict({"merge_method": "ties", "base_model": str(base_dir),
                               "models": [{"model": f"{full[0]}+{adapters[0]}", "parameters": {"density": 0.5, "weight": 1.0}}]})
    yaml_path = tmp_path / "merge.yaml"
    yaml_path.write_text(f"base: {base_dir}\nmodels: [{adapters[0]}, {adapters[1]}]\nmethod: task_arithmetic\n"
                         "parameters: {{lam: 1.0}}\noutput: adapter\ncombination: svd\nlora_rank: 3\n".replace("{{", "{")
                         .replace("}}", "}"))
    config = MergeConfig.from_yaml(yaml_path)
    assert (config.output, config.combination, config.lora_rank) == ("adapter", "svd", 3)
    assert "combination: svd" in config.to_yaml()


def test_cli_merges_adapters_into_an_adapter(lora_setup, tmp_path):
    from hf_mloss.cli import main

    base_dir, adapters, _ = lora_setup
    yaml_path = tmp_path / "merge.yaml"
    yaml_path.write_text(f"base: {base_dir}\nmodels: [{adapters[0]}, {adapters[2]}]\nmethod: task_arithmetic\n"
                         "output: adapter\n")
    assert main(["merge", str(yaml_path), str(tmp_path / "out"), "-q"]) in (0, None)
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    recipe = hf_mloss.MergeConfig.from_pretrained(tmp_path / "out")
    assert recipe.output == "adapter" and recipe.combination == "cat"
    assert recipe.models[0].fingerprint  # adapter folders are fingerprinted like model folders


def test_hub_adapters_and_card_metadata(lora_setup, tmp_path, monkeypatch):
    """Hub ids of a base and of adapters (an offline Hub cache): the adapters resolve, their base is checked by Hub
    id, the recipe pins their commits, and the adapter written carries PEFT's card metadata."""
    import hashlib
    import shutil

    import yaml
    from huggingface_hub import constants

    base_dir, adapters, full = lora_setup
    cache = tmp_path / "hub"
    repos = {"org/base": base_dir}
    for i, adapter in enumerate(adapters[:2]):
        hub_copy = Path(shutil.copytree(adapter, tmp_path / f"hub_lora{i}"))
        config = json.loads((hub_copy / "adapter_config.json").read_text())
        (hub_copy / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/base"}))
        repos[f"org/lora{i}"] = hub_copy
    for repo_id, src in repos.items():
        storage = cache / f"models--{repo_id.replace('/', '--')}"
        sha = hashlib.sha1(repo_id.encode()).hexdigest()
        (storage / "refs").mkdir(parents=True)
        (storage / "refs" / "main").write_text(sha)
        shutil.copytree(src, storage / "snapshots" / sha)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = hf_mloss.merge("org/base", ["org/lora0", "org/lora1"], "task_arithmetic", lam=1.0, output="adapter",
                            combination="svd", lora_rank=4, progress=False)
    assert [m.revision for m in result.config.models] == [hashlib.sha1(f"org/lora{i}".encode()).hexdigest()
                                                          for i in range(2)]
    reference = hf_mloss.merge(str(base_dir), [str(f) for f in full[:2]], "task_arithmetic", lam=1.0, progress=False)
    assert_close_states(_state(result), _state(reference))
    folder = result.save_pretrained(tmp_path / "out")
    meta = yaml.safe_load((folder / "README.md").read_text().split("---\n", 2)[1])
    assert meta["library_name"] == "peft" and meta["base_model"] == "org/base"
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/base"
    with pytest.raises(IncompatibleCheckpointsError, match="org/base"):
        hf_mloss.merge(str(base_dir), ["org/lora0"], "ties", progress=False)


def test_decoder_adapters_merge_as_their_materialised_models_and_into_an_adapter(tmp_path):
    """LoRA adapters of a tiny Llama (attention and gated-MLP projections, different ranks): data-free merges equal
    those of the adapters' merge_and_unload() models, and a cat adapter loads in PEFT and equals PEFT's cat."""
    from transformers import LlamaForCausalLM

    from examples.tiny import tiny_decoder, word_tokenizer

    base_dir = tmp_path / "llama"
    tiny_decoder("llama").save_pretrained(base_dir)
    word_tokenizer().save_pretrained(base_dir)
    targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = [make_adapter(base_dir, tmp_path / f"llama_lora{i}", seed=i + 3, model_class=LlamaForCausalLM,
                             target_modules=targets, r=r) for i, r in enumerate([2, 4])]
    full = []
    for i, adapter in enumerate(adapters):
        merged = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir), adapter).merge_and_unload()
        merged.save_pretrained(tmp_path / f"llama_full{i}")
        word_tokenizer().save_pretrained(tmp_path / f"llama_full{i}")
        full.append(tmp_path / f"llama_full{i}")
    for method, params in [("ties", {"k": 0.5}), ("task_arithmetic", {"lam": 0.7})]:
        ours = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], method, progress=False, **params)
        theirs = hf_mloss.merge(str(base_dir), [str(f) for f in full], method, progress=False, **params)
        assert isinstance(ours.model, LlamaForCausalLM)
        assert_close_states(_state(ours), _state(theirs))
    result = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], "task_arithmetic", lam=1.0,
                            weights=[0.5, 1.5], output="adapter", combination="cat", progress=False)
    folder = result.save_pretrained(tmp_path / "llama_cat")
    loaded = load_written_adapter(base_dir, folder, LlamaForCausalLM)
    assert_close_states(loaded, _state(result))
    assert_close_states(loaded, peft_combination(base_dir, adapters, [0.5, 1.5], "cat", model_class=LlamaForCausalLM))
