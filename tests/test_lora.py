"""PEFT LoRA adapters in and out (hf_mloss.lora): adapters read as their merged models, adapters written back, and
parity with PEFT's own ``merge_and_unload`` and ``add_weighted_adapter``. Tiny CLIP models, offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import CLIPModel, CLIPVisionModel  # noqa: E402

import hf_mloss  # noqa: E402
from hf_mloss.errors import (  # noqa: E402
    ConfigError,
    IncompatibleCheckpointsError,
    InvalidParameterError,
    UnsupportedModelError,
)
from hf_mloss.testing import make_base, save_model, tiny_processor  # noqa: E402

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
    from hf_mloss.hub import resolve_model
    from hf_mloss.lora import resolve_lora
    from hf_mloss.config import ModelSpec
    from hf_mloss.store import CheckpointStore

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
    score_ours = hf_mloss.score(str(base_dir), [str(a) for a in adapters], **kwargs)
    score_theirs = hf_mloss.score(str(base_dir), [str(f) for f in full], **kwargs)
    assert score_ours.mloss() == pytest.approx(score_theirs.mloss(), rel=1e-4)
    pairs_ours = hf_mloss.compatibility(str(base_dir), [str(a) for a in adapters[:2]], **kwargs)
    pairs_theirs = hf_mloss.compatibility(str(base_dir), [str(f) for f in full[:2]], **kwargs)
    assert torch.allclose(torch.as_tensor(pairs_ours.matrix()), torch.as_tensor(pairs_theirs.matrix()), rtol=1e-4)


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
