"""Adapter + lazy store: key spellings, full CLIPModel repos, shards, pickles, compatibility checks."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import CLIPVisionModel

import hf_mloss
from hf_mloss.adapters import CLIPVisionAdapter, adapter_for, register_adapter
from hf_mloss.loading.hub import resolve_model
from hf_mloss.loading.store import CheckpointStore
from examples.tiny import make_base, make_finetune, save_clip_model, save_model


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """The same base and fine-tunes written in every supported layout."""
    root = tmp_path_factory.mktemp("variants")
    base = make_base(0)
    fts = [make_finetune(base, i) for i in range(2)]
    return {
        "base": base, "fts": fts,
        "plain": [save_model(m, root / f"plain{i}") for i, m in enumerate([base, *fts])],
        "prefixed": [save_model(m, root / f"pre{i}", prefixed=True) for i, m in enumerate([base, *fts])],
        "sharded": [save_model(m, root / f"shard{i}", max_shard_size="20KB") for i, m in enumerate([base, *fts])],
        "clip": [save_clip_model(m, root / f"clip{i}", seed=i) for i, m in enumerate([base, *fts])],
    }  # fmt: skip


def test_canonical_keys():
    adapter = CLIPVisionAdapter(make_base(0).config)
    assert adapter.canonical_key("vision_model.encoder.layers.0.mlp.fc1.weight") == "encoder.layers.0.mlp.fc1.weight"
    assert adapter.canonical_key("encoder.layers.0.mlp.fc1.weight") == "encoder.layers.0.mlp.fc1.weight"
    assert adapter.canonical_key("text_model.encoder.layers.0.mlp.fc1.weight") is None
    assert adapter.canonical_key("visual_projection.weight") is None
    assert adapter.canonical_key("logit_scale") is None
    assert adapter.stage_of("embeddings.patch_embedding.weight") == -1
    assert adapter.stage_of("pre_layrnorm.bias") == -1
    assert adapter.stage_of("encoder.layers.1.self_attn.q_proj.weight") == 1
    assert adapter.stage_of("post_layernorm.weight") == 2
    assert adapter.target_names() == ["encoder.layers.0.mlp.fc1", "encoder.layers.1.mlp.fc1"]


def test_split_block_forward_equals_the_block(variants):
    base = variants["base"]
    adapter = CLIPVisionAdapter(base.config)
    hidden = torch.randn(2, 17, 32)
    block = base.encoder.layers[0]
    with torch.no_grad():
        residual, u = adapter.forward_to_target(block, hidden)
        torch.testing.assert_close(adapter.forward_from_target(block, residual, u), block(hidden, None))
        outputs = base(pixel_values=torch.randn(2, 3, 32, 32), output_hidden_states=True)
    assert adapter.activation() is not None and base.config.hidden_act == "quick_gelu"


@pytest.fixture
def stored_variants(tmp_path, variants):
    """A bfloat16 safetensors folder and a pickle folder (``pytorch_model.bin``) of the tiny model."""
    bf16 = save_model(make_base(0).to(torch.bfloat16), tmp_path / "bf16")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    variants["fts"][1].config.save_pretrained(pickled)
    torch.save(variants["fts"][1].state_dict(), pickled / "pytorch_model.bin")
    return bf16, pickled


def test_read_into_reads_every_tensor_as_get_does(stored_variants, variants, monkeypatch):
    """``read_into`` fills a caller's tensor with the stored values: in place for the stored dtype, converted
    through staging pieces of a few rows otherwise (pieces of 64 bytes here), and through ``get`` for a pickle."""
    from hf_mloss.loading import store as store_module

    monkeypatch.setattr(store_module, "STAGING_BYTES", 64)
    bf16, pickled = stored_variants
    adapter = adapter_for(variants["base"].config)
    for folder in (bf16, pickled, variants["sharded"][1], variants["plain"][1]):
        store = CheckpointStore(resolve_model(folder), adapter)
        for name in store.keys():
            want = store.get(name)
            for dtype in (want.dtype, torch.float32, torch.float64):
                out = torch.full(want.shape, float("nan"), dtype=dtype)
                assert store.read_into(name, out) is out
                torch.testing.assert_close(out, want.to(dtype), rtol=0, atol=0, msg=name)
    assert store.dtypes["encoder.layers.0.mlp.fc1.weight"] == torch.float32
    assert CheckpointStore(resolve_model(bf16), adapter).dtypes["encoder.layers.0.mlp.fc1.weight"] == torch.bfloat16
    strided = torch.zeros(32, 64).t()  # fc1.weight is [64, 32]: a non-contiguous out is filled through staging
    store.read_into("encoder.layers.0.mlp.fc1.weight", strided)
    assert torch.equal(strided, store.get("encoder.layers.0.mlp.fc1.weight"))


def test_read_flat_into_reads_any_range_and_counts_each_tensor_once(stored_variants, variants):
    """``read_flat_into`` gives entries start:stop of the flattened tensor, across row boundaries, in any dtype
    (straight from the file for the stored dtype, else through staging; a pickle through ``get_rows``); ``bytes_read``
    counts each tensor's stored bytes once, however often and in however many pieces it is read."""
    bf16, pickled = stored_variants
    adapter = adapter_for(variants["base"].config)
    for folder in (bf16, pickled, variants["sharded"][1]):
        store = CheckpointStore(resolve_model(folder), adapter)
        assert store.bytes_read == 0
        name = "encoder.layers.0.mlp.fc1.weight"  # [64, 32]
        flat = store.get(name).reshape(-1)
        for start, stop in ((0, 2048), (5, 37), (31, 33), (2000, 2048)):
            for dtype in (flat.dtype, torch.float32):
                out = torch.full((stop - start,), float("nan"), dtype=dtype)
                assert store.read_flat_into(name, start, out) is out
                assert torch.equal(out, flat[start:stop].to(dtype)), (folder.name, start, stop, dtype)
        assert store.bytes_read == flat.numel() * flat.element_size()
        store.get_rows("encoder.layers.0.mlp.fc2.weight", 0, 1)
        assert store.bytes_read == (flat.numel() + math.prod(store.shapes["encoder.layers.0.mlp.fc2.weight"])
                                    ) * flat.element_size()


@pytest.mark.parametrize("layout", ["prefixed", "sharded", "clip"])
def test_every_layout_reads_the_same_tensors(variants, layout):
    plain = CheckpointStore(resolve_model(variants["plain"][1]), adapter_for(variants["base"].config))
    other_ref = resolve_model(variants[layout][1])
    from transformers import AutoConfig

    other = CheckpointStore(other_ref, adapter_for(AutoConfig.from_pretrained(other_ref.path)))
    assert sorted(plain.keys()) == sorted(other.keys())
    for name in plain.keys():
        assert torch.equal(plain.get(name), other.get(name)), name


@pytest.mark.parametrize("layout", ["prefixed", "sharded", "clip"])
def test_merge_is_layout_independent(variants, layout):
    plain = [str(p) for p in variants["plain"]]
    other = [str(p) for p in variants[layout]]
    a = hf_mloss.merge(plain[0], plain[1:], "ties", k=0.3, progress=False)
    b = hf_mloss.merge(other[0], other[1:], "ties", k=0.3, progress=False, output="tower")
    assert isinstance(b.model, CLIPVisionModel)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_mixed_layouts_and_loaded_models_merge(variants):
    base = variants["base"]
    models = [str(variants["clip"][1]), variants["fts"][1]]  # a CLIPModel folder and an in-memory model
    result = hf_mloss.merge(base, models, "average", progress=False)
    expected = {k: (variants["fts"][0].state_dict()[k] + variants["fts"][1].state_dict()[k]) / 2
                for k in base.state_dict()}
    for name, tensor in result.model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
    assert result.base.repo_id is None  # built in memory: nothing to claim as a Hub id


def test_pickle_checkpoints_read_through_the_restricted_unpickler(tmp_path, variants):
    """A ``pytorch_model.bin`` of plain tensors is read (``weights_only``: it cannot run code) and merges as the same
    weights in safetensors do."""
    folder = tmp_path / "pickled"
    folder.mkdir()
    variants["fts"][0].config.save_pretrained(folder)
    torch.save(variants["fts"][0].state_dict(), folder / "pytorch_model.bin")
    plain = [str(p) for p in variants["plain"]]
    from_bin = hf_mloss.merge(plain[0], [str(folder), plain[2]], "average", progress=False)
    from_safetensors = hf_mloss.merge(plain[0], [plain[1], plain[2]], "average", progress=False)
    assert isinstance(from_bin.model, CLIPVisionModel)
    for key, value in from_safetensors.model.state_dict().items():
        assert torch.equal(value, from_bin.model.state_dict()[key]), key


def test_incompatible_shapes_name_the_tensor(tmp_path, variants):
    other = save_model(make_base(1, intermediate_size=48), tmp_path / "narrow")
    with pytest.raises(hf_mloss.IncompatibleCheckpointsError, match=r"fc1\.bias. has shape \(64,\) in .plain0. but \(48,\) in .narrow"):
        hf_mloss.merge(str(variants["plain"][0]), [str(other)], "ties", progress=False)


def test_missing_tensors_are_reported(tmp_path, variants):
    from safetensors.torch import load_file, save_file

    folder = save_model(variants["fts"][0], tmp_path / "missing")
    state = load_file(str(folder / "model.safetensors"))
    state.pop("post_layernorm.weight")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(hf_mloss.IncompatibleCheckpointsError, match="missing.*post_layernorm.weight"):
        hf_mloss.merge(str(variants["plain"][0]), [str(folder)], "ties", progress=False)


def test_corrupted_header_is_a_clear_error(tmp_path, variants):
    folder = save_model(variants["fts"][0], tmp_path / "corrupt")
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(hf_mloss.CorruptCheckpointError, match="corrupted"):
        hf_mloss.merge(str(variants["plain"][0]), [str(folder)], "ties", progress=False)


def test_non_finite_weights_are_refused(tmp_path, variants):
    broken = make_finetune(variants["base"], 7)
    with torch.no_grad():
        broken.encoder.layers[1].mlp.fc2.weight[0, 0] = float("nan")
    folder = save_model(broken, tmp_path / "nan")
    with pytest.raises(hf_mloss.CorruptCheckpointError, match=r"encoder\.layers\.1\.mlp\.fc2\.weight.*NaN"):
        hf_mloss.merge(str(variants["plain"][0]), [str(folder)], "ties", progress=False)


def test_a_family_without_scoring_is_merged_data_free_and_refused_for_scoring(tmp_path, image_folder):
    folder = tmp_path / "t5"  # an encoder-decoder: no M-Loss scoring (GPT-2 and other MLP decoders have it)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5Model"]}))
    with pytest.raises(hf_mloss.CorruptCheckpointError, match="No weights found"):  # data-free: the generic adapter
        hf_mloss.merge(str(folder), [str(folder)], "ties", progress=False)
    with pytest.raises(hf_mloss.UnsupportedModelError, match="'t5'.*clip_vision.*data-free methods work"):
        hf_mloss.merge(str(folder), [str(folder)], "m_ties", data=str(image_folder), progress=False)


def test_missing_local_path_vs_hub_id(tmp_path):
    with pytest.raises(hf_mloss.CheckpointNotFoundError, match="neither a folder nor a Hub id: it is written as a local path, and .* does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(hf_mloss.CheckpointNotFoundError, match="not in the local Hub cache"):
        resolve_model("hf-mloss-tests/not-cached")


def test_register_adapter_validates_names():
    class Bad(CLIPVisionAdapter):
        name = "Bad"

    with pytest.raises(ValueError, match="lowercase"):
        register_adapter(Bad)

    class Clash(CLIPVisionAdapter):
        name = "clip_vision"

    with pytest.raises(KeyError, match="already registered"):
        register_adapter(Clash)
    assert "clip_vision" in hf_mloss.list_adapters()


def test_models_load_with_transformers_own_modules(tiny_paths, monkeypatch):
    """transformers swaps Hub kernels into the modules it loads, by default from 5.25 on: hf_mloss asks for its own
    modules (the scoring hooks read their inputs), for the merged model and for each tower it loads."""
    from transformers import PreTrainedModel

    asked, original = [], PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        asked.append(kwargs.get("use_kernels"))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
    base, models = tiny_paths
    result = hf_mloss.merge(base, models, "ties", progress=False)
    assert not getattr(result.model, "use_kernels", False)
    adapter_for(CLIPVisionModel.config_class.from_pretrained(base)).load_model(base)
    assert asked and all(flag is False for flag in asked)
