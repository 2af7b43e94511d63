"""Checkpoints as their Hub repos lay them out, merged whole: a tiny GPT-NeoX (Pythia), LLaVA and Qwen2-VL written
with the old key names and the 4.x-era config.json their repos carry (``embed_out``, ``language_model.model.*``,
``vision_tower.vision_model.*``, ``model.*`` / ``visual.*``), merged data-free, written back in the same layout, and
loaded by their Auto class with nothing missing; a forward with an image and text runs. The side environments
(marker ``peers``) load each merged folder in transformers 4.57 and 5.5 to the outputs it gives here. Data-guided
methods on these models: ``tests/test_vlm_scoring.py``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

import hf_mloss
from examples import tiny as testing

# The tiny bases are written as weights and config only, so LLaVA's merge says it has no image processor to save;
# that warning is checked in tests/test_surface.py, and here it is expected, not the subject.
pytestmark = pytest.mark.filterwarnings("ignore:The merged folder has no image processor:UserWarning")

VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "image_size": 8, "patch_size": 4, "projection_dim": 16, "model_type": "clip_vision_model"}
TEXT = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}

# config.json as the Hub repos hold them (written by transformers 4.x): Pythia, llava-hf, Qwen2-VL-2B
HUB_CONFIGS = {
    "gpt_neox": {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "bos_token_id": 0,
                 "eos_token_id": 0, "hidden_act": "gelu", "hidden_size": 16, "intermediate_size": 64,
                 "layer_norm_eps": 1e-5, "max_position_embeddings": 64, "num_attention_heads": 2,
                 "num_hidden_layers": 2, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
                 "torch_dtype": "float32", "transformers_version": "4.24.0", "use_cache": True,
                 "use_parallel_residual": True, "vocab_size": 64},
    "llava": {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "ignore_index": -100,
              "image_token_index": 63, "pad_token_id": 62, "projector_hidden_act": "gelu",
              "text_config": {**TEXT, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
              "vision_config": VISION, "tie_word_embeddings": False, "torch_dtype": "float32",
              "transformers_version": "4.36.0.dev0", "vision_feature_layer": -2,
              "vision_feature_select_strategy": "default", "vocab_size": 64},
    "qwen2_vl": {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
                 "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "vision_start_token_id": 62,
                 "vision_end_token_id": 59, "vision_token_id": 58, "image_token_id": 60, "video_token_id": 61,
                 "hidden_act": "silu", "initializer_range": 0.02, "max_window_layers": 2,
                 **{k: v for k, v in TEXT.items() if k != "rms_norm_eps"}, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "sliding_window": 64, "tie_word_embeddings": True,
                 "torch_dtype": "float32", "transformers_version": "4.41.2", "use_cache": True,
                 "use_sliding_window": False,
                 "vision_config": {"depth": 2, "embed_dim": 16, "mlp_ratio": 2, "num_heads": 2, "in_chans": 3,
                                   "hidden_size": 16, "patch_size": 2, "spatial_merge_size": 2,
                                   "spatial_patch_size": 2, "temporal_patch_size": 2},
                 "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
}
AUTO = {"gpt_neox": "AutoModelForCausalLM", "llava": "AutoModelForImageTextToText",
        "qwen2_vl": "AutoModelForImageTextToText"}


def _inputs(name: str) -> dict[str, torch.Tensor]:
    """One forward's inputs: text, and for the vision-language models an image with its image tokens."""
    generator = torch.Generator().manual_seed(0)
    if name == "gpt_neox":
        return {"input_ids": torch.tensor([[1, 5, 9, 17, 33, 2]])}
    if name == "llava":  # (8 / 4)² = 4 patch features, the CLS feature dropped ("default" strategy)
        return {"input_ids": torch.tensor([[1, 63, 63, 63, 63, 5, 9, 17]]),
                "pixel_values": torch.randn(1, 3, 8, 8, generator=generator)}
    # Qwen2-VL: 2×2 patches of 2×2 px over 2 frames, merged 2×2 into one image token
    return {"input_ids": torch.tensor([[62, 60, 5, 9, 17]]), "pixel_values": torch.randn(4, 24, generator=generator),
            "image_grid_thw": torch.tensor([[1, 2, 2]]), "mm_token_type_ids": torch.tensor([[0, 1, 0, 0, 0]])}


def hub_key(name: str, key: str) -> str:
    """The Hub repo's name of a parameter of the model transformers 5 builds (conversion.md §3)."""
    if name == "gpt_neox":
        return "embed_out.weight" if key == "lm_head.weight" else key
    if name == "llava":
        for new, old in (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                         ("model.vision_tower.", "vision_tower.vision_model."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")):
            if key.startswith(new):
                return old + key[len(new):]
        return key
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if key.startswith(new):
            return old + key[len(new):]
    return key


def write_hub_layout(name: str, model, folder: Path) -> None:
    """``folder`` as the Hub repo of ``model`` holds it: its 4.x config.json and safetensors under the old names
    (tied tensors left out; a Pythia file's attention buffers too, which transformers ignores on load)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(HUB_CONFIGS[name], indent=2))
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    state = {hub_key(name, k): v.contiguous() for k, v in model.state_dict().items() if k not in tied}
    if name == "gpt_neox":
        for layer in range(HUB_CONFIGS[name]["num_hidden_layers"]):
            prefix = f"gpt_neox.layers.{layer}.attention."
            state[f"{prefix}bias"] = torch.tril(torch.ones(64, 64, dtype=torch.bool)).view(1, 1, 64, 64)
            state[f"{prefix}masked_bias"] = torch.tensor(-1e9)
            state[f"{prefix}rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, 2, 2).float() / 2)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _keys(folder) -> set[str]:
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as handle:
        return set(handle.keys())


def _load(name: str, folder):
    model, info = getattr(transformers, AUTO[name]).from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _forward(name: str, model) -> torch.Tensor:
    with torch.no_grad():
        return model(**_inputs(name)).logits


@pytest.fixture(scope="module", params=list(HUB_CONFIGS))
def hub_layout(request, tmp_path_factory):
    """A tiny base in its Hub repo's layout and two fine-tunes, merged with ``average`` (the merged folder)."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    (root / "config").mkdir()
    (root / "config" / "config.json").write_text(json.dumps(HUB_CONFIGS[name]))
    config = transformers.AutoConfig.from_pretrained(root / "config")
    torch.manual_seed(0)
    base = getattr(transformers, HUB_CONFIGS[name]["architectures"][0])(config).eval()
    folders = []
    for i, model in enumerate([base, testing.perturbed(base, 1), testing.perturbed(base, 2)]):
        write_hub_layout(name, model, root / f"m{i}")
        folders.append(str(root / f"m{i}"))
    result = hf_mloss.merge(folders[0], folders[1:], "average", progress=False)
    result.save_pretrained(root / "merged")
    return {"name": name, "root": root, "base": folders[0], "fts": folders[1:], "merged": root / "merged",
            "result": result}


def test_a_hub_layout_merges_whole_and_is_written_back_in_it(hub_layout):
    name = hub_layout["name"]
    base_keys = _keys(hub_layout["base"])
    dropped = {k for k in base_keys if ".attention.bias" in k or "masked_bias" in k or "rotary_emb" in k}
    assert _keys(hub_layout["merged"]) == base_keys - dropped  # Pythia's buffers: unexpected, never merged
    if name == "llava":
        assert any(k.startswith("vision_tower.vision_model.") for k in _keys(hub_layout["merged"]))
    merged = _load(name, hub_layout["merged"])
    assert type(merged).__name__ == HUB_CONFIGS[name]["architectures"][0]
    fts = [_load(name, f).state_dict() for f in hub_layout["fts"]]
    for key, tensor in merged.state_dict().items():
        if tensor.is_floating_point():
            torch.testing.assert_close(tensor, (fts[0][key] + fts[1][key]) / 2, rtol=0, atol=1e-6, msg=key)
    assert torch.isfinite(_forward(name, merged)).all()


def test_the_merge_keeps_the_bases_config_file(hub_layout):
    """transformers 5 rewrites configs (``rope_parameters``) in a way 4.x reads wrongly; an unchanged config is
    the base's own file."""
    written = json.loads((hub_layout["merged"] / "config.json").read_text())
    assert written == {**HUB_CONFIGS[hub_layout["name"]], "torch_dtype": "float32"}


def test_the_kept_config_file_says_the_merges_dtype(hub_layout, tmp_path):
    result = hf_mloss.merge(hub_layout["base"], hub_layout["fts"], "average", dtype="bfloat16", progress=False)
    result.save_pretrained(tmp_path / "merged")
    written = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert written == {**HUB_CONFIGS[hub_layout["name"]], "torch_dtype": "bfloat16"}
    assert _load(hub_layout["name"], tmp_path / "merged").dtype == torch.bfloat16


def test_a_large_base_filled_from_its_store_is_written_in_the_bases_layout(hub_layout, monkeypatch, tmp_path):
    """The streamed load (a base of 2 GiB or more) builds the model from the lazy store, not from_pretrained: the
    base's layout is recorded on it (LLaVA keeps ``vision_tower.vision_model.*``)."""
    from hf_mloss.loading import inputs

    monkeypatch.setattr(inputs, "STREAMED_LOAD_MIN_BYTES", 0)
    streamed = []
    original = inputs.RunInputs._from_store
    monkeypatch.setattr(inputs.RunInputs, "_from_store",
                        lambda self, *a, **k: streamed.append(1) or original(self, *a, **k))
    result = hf_mloss.merge(hub_layout["base"], hub_layout["fts"], "average", progress=False)
    result.save_pretrained(tmp_path / "merged")
    assert streamed
    assert _keys(tmp_path / "merged") == _keys(hub_layout["merged"])
    torch.testing.assert_close(_forward(hub_layout["name"], _load(hub_layout["name"], tmp_path / "merged")),
                               _forward(hub_layout["name"], _load(hub_layout["name"], hub_layout["merged"])),
                               rtol=0, atol=0)


@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_models_saved_by_this_transformers_merge_whole(name, tmp_path):
    """The same families written by this transformers' ``save_pretrained`` (its own layout): a whole merge that
    loads with ``AutoModelForImageTextToText`` with nothing missing and runs on an image and text."""
    config_folder = tmp_path / "config"
    config_folder.mkdir()
    (config_folder / "config.json").write_text(json.dumps(HUB_CONFIGS[name]))
    torch.manual_seed(0)
    model = getattr(transformers, HUB_CONFIGS[name]["architectures"][0])(
        transformers.AutoConfig.from_pretrained(config_folder)).eval()
    base, fts = testing.save_with_finetunes(model, tmp_path / "models", 2)
    result = hf_mloss.merge(str(base), [str(f) for f in fts], "ties", progress=False)
    result.save_pretrained(tmp_path / "merged")
    assert _keys(tmp_path / "merged") == _keys(base)
    assert torch.isfinite(_forward(name, _load(name, tmp_path / "merged"))).all()


# ------------------------------------------------------------------------------------------ other transformers
CHILD = r"""
import json, sys, torch, transformers
jobs = json.loads(sys.argv[1])
major = int(transformers.__version__.split(".")[0])
out = {"version": transformers.__version__, "results": {}}
for name, job in jobs.items():
    try:
        model, info = getattr(transformers, job["auto"]).from_pretrained(job["path"], output_loading_info=True)
        inputs = torch.load(job["inputs"])
        if major < 5:
            inputs.pop("mm_token_type_ids", None)  # 5.x asks for it; 4.x finds the image tokens itself
        with torch.no_grad():
            torch.save(model.eval()(**inputs).logits, job["out"])
        out["results"][name] = {"class": type(model).__name__, "missing": sorted(info["missing_keys"])[:5],
                                "mismatched": [str(m) for m in info.get("mismatched_keys", [])][:3]}
    except Exception as err:
        out["results"][name] = {"error": f"{type(err).__name__}: {err}"[:600]}
print(json.dumps(out))
"""


@pytest.mark.peers
@pytest.mark.parametrize("env", ["transformers_4", "transformers_5_5"])
def test_merged_hub_layouts_load_in_other_transformers_to_the_same_outputs(env, hub_layout, tmp_path):
    setup_envs = pytest.importorskip("benchmarks.peers.setup_envs", reason="run from the repository root")
    if setup_envs.env_info(env) is None:
        if os.environ.get("CI"):
            pytest.fail(f"side environment {env!r} is missing: CI runs benchmarks/peers/setup_envs.py first")
        pytest.skip(f"side environment {env!r} not installed (python benchmarks/peers/setup_envs.py {env})")
    name = hub_layout["name"]
    torch.save(_inputs(name), tmp_path / "inputs.pt")
    jobs = {which: {"path": str(folder), "auto": AUTO[name], "inputs": str(tmp_path / "inputs.pt"),
                    "out": str(tmp_path / f"{which}.pt")}
            for which, folder in (("merged", hub_layout["merged"]), ("base", hub_layout["base"]))}
    proc = subprocess.run([str(setup_envs.venv_bin(env)), "-c", CHILD, json.dumps(jobs)], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for which, folder in (("merged", hub_layout["merged"]), ("base", hub_layout["base"])):
        detail = report["results"][which]
        assert "error" not in detail and not detail["missing"] and not detail["mismatched"], (report["version"],
                                                                                             which, detail)
        here = _forward(name, _load(name, folder))
        torch.testing.assert_close(torch.load(tmp_path / f"{which}.pt"), here, rtol=0, atol=1e-5,
                                   msg=f"{which} in transformers {report['version']}")
