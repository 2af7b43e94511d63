"""Saved layouts across transformers versions: folders written here (the installed transformers) are loaded by
transformers 4.57 (the last 4.x, still the most installed) and 5.5 (the last release before ``CLIPVisionModel`` lost
its inner ``vision_model``, 5.6), each in its own virtual environment (``benchmarks/peers/setup_envs.py``), and their
outputs compared with this environment's.

Layouts: ``unprefixed`` (what ``CLIPVisionModel.save_pretrained`` writes from 5.6 on), ``prefixed``
(``vision_model.*`` keys, as transformers 4.x and the tanganke fine-tunes), ``resaved`` (a prefixed checkpoint loaded
and saved again here), ``clip`` (a full ``CLIPModel``: loaded as ``CLIPModel`` and as ``CLIPVisionModel``) and
``hf_mloss`` (a merge saved by ``MergeResult.save_pretrained``). The side environments skip locally when absent and
must exist in CI, like the peers'.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.peers

setup_envs = pytest.importorskip("benchmarks.peers.setup_envs", reason="run from the repository root")

ENVS = ("transformers_4", "transformers_5_5")
ATOL = 1e-5
CHILD = r"""
import json, sys, torch, transformers
from transformers import CLIPModel, CLIPVisionModel
jobs = json.loads(sys.argv[1])
inputs = torch.load(jobs["inputs"])
out = {"version": transformers.__version__, "results": {}}
for name, job in jobs["folders"].items():
    try:
        cls = CLIPModel if job["cls"] == "CLIPModel" else CLIPVisionModel
        model, info = cls.from_pretrained(job["path"], output_loading_info=True)
        model.eval()
        with torch.no_grad():
            if cls is CLIPModel:
                got = {"image": model.get_image_features(pixel_values=inputs["pixels"]),
                       "text": model.get_text_features(input_ids=inputs["input_ids"])}
                got = {k: getattr(v, "pooler_output", v) for k, v in got.items()}
            else:
                result = model(pixel_values=inputs["pixels"])
                got = {"pooler": result.pooler_output, "hidden": result.last_hidden_state}
        torch.save(got, job["out"])
        out["results"][name] = {"missing": sorted(info["missing_keys"])[:5], "n_missing": len(info["missing_keys"])}
    except Exception as err:
        out["results"][name] = {"error": f"{type(err).__name__}: {err}"[:500]}
print(json.dumps(out))
"""


def _tiny_clip(seed: int = 0):
    from transformers import CLIPConfig, CLIPModel

    from examples.tiny import TINY_VISION

    torch.manual_seed(seed)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=100,
                max_position_embeddings=16)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=TINY_VISION, projection_dim=16)).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_paths):
    """Every layout, saved here, with the class each is loaded as and this environment's reference outputs."""
    from transformers import CLIPVisionModel

    import hf_mloss

    root = tmp_path_factory.mktemp("layouts")
    clip = _tiny_clip()
    vision = CLIPVisionModel(clip.config.vision_config).eval()
    vision.load_state_dict(clip.vision_model.state_dict())
    vision.save_pretrained(root / "unprefixed")
    (root / "prefixed").mkdir()
    vision.config.save_pretrained(root / "prefixed")
    save_file({f"vision_model.{k}": v.contiguous() for k, v in vision.state_dict().items()},
              str(root / "prefixed" / "model.safetensors"), metadata={"format": "pt"})
    CLIPVisionModel.from_pretrained(root / "prefixed").save_pretrained(root / "resaved")
    clip.save_pretrained(root / "clip")
    base, models = tiny_paths
    merged = hf_mloss.merge(base, models, "ties", progress=False)
    merged.save_pretrained(root / "hf_mloss")
    jobs = {name: ("CLIPVisionModel", root / name) for name in ("unprefixed", "prefixed", "resaved", "hf_mloss")}
    jobs["clip"] = ("CLIPModel", root / "clip")
    jobs["clip_as_vision"] = ("CLIPVisionModel", root / "clip")
    inputs = {"pixels": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
              "input_ids": torch.tensor([[98, 5, 17, 42, 99], [98, 7, 99, 99, 99]])}
    torch.save(inputs, root / "inputs.pt")
    expected = {name: _outputs(cls, path, inputs) for name, (cls, path) in jobs.items()}
    return root, jobs, expected


def _outputs(cls_name: str, path: Path, inputs) -> dict[str, torch.Tensor]:
    from transformers import CLIPModel, CLIPVisionModel

    cls = CLIPModel if cls_name == "CLIPModel" else CLIPVisionModel
    model = cls.from_pretrained(path).eval()
    with torch.no_grad():
        if cls is CLIPModel:
            got = {"image": model.get_image_features(pixel_values=inputs["pixels"]),
                   "text": model.get_text_features(input_ids=inputs["input_ids"])}
            return {k: getattr(v, "pooler_output", v) for k, v in got.items()}
        result = model(pixel_values=inputs["pixels"])
        return {"pooler": result.pooler_output, "hidden": result.last_hidden_state}


def _side_python(name: str) -> Path:
    info = setup_envs.env_info(name)
    if info is None:
        if os.environ.get("CI"):
            pytest.fail(f"side environment {name!r} is missing: CI runs benchmarks/peers/setup_envs.py first")
        pytest.skip(f"side environment {name!r} not installed (python benchmarks/peers/setup_envs.py {name})")
    return setup_envs.venv_bin(name)


@pytest.fixture(scope="module", params=ENVS)
def side_results(request, folders, tmp_path_factory):
    """Every layout loaded in one side environment: {layout: (max abs diff or None, loading details)}."""
    python = _side_python(request.param)
    root, jobs, expected = folders
    out = tmp_path_factory.mktemp(request.param)
    spec = {"inputs": str(root / "inputs.pt"),
            "folders": {n: {"cls": c, "path": str(p), "out": str(out / f"{n}.pt")} for n, (c, p) in jobs.items()}}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([str(python), "-c", CHILD, json.dumps(spec)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    results = {}
    for name, detail in report["results"].items():
        diff = None
        if "error" not in detail:
            got = torch.load(out / f"{name}.pt")
            diff = max(float((got[k] - expected[name][k]).abs().max()) for k in expected[name])
        results[name] = (diff, detail)
    print(f"\ntransformers {report['version']}: " + ", ".join(
        f"{n}={'error' if d is None else f'{d:.1e}'}" for n, (d, _) in results.items()))
    return request.param, report["version"], results


def _loads_correctly(result) -> bool:
    diff, detail = result
    return diff is not None and diff <= ATOL and detail.get("n_missing", 1) == 0


@pytest.mark.parametrize("layout", ["prefixed", "resaved", "clip", "clip_as_vision"])
def test_layout_loads_correctly_in_every_version(side_results, layout) -> None:
    env, version, results = side_results
    assert _loads_correctly(results[layout]), (env, version, layout, results[layout])


def test_unprefixed_layout_loads_random_weights_before_5_6(side_results) -> None:
    """What transformers >= 5.6 writes for a CLIPVisionModel built from a config: older versions report every key
    missing and keep random weights (a warning, not an error)."""
    env, version, results = side_results
    diff, detail = results["unprefixed"]
    assert not _loads_correctly(results["unprefixed"]), (env, version, detail)
    assert detail.get("n_missing", 0) > 0 and (diff is None or diff > 1e-2)


def test_hf_mloss_saved_merge_loads_in_every_version(side_results) -> None:
    env, version, results = side_results
    assert _loads_correctly(results["hf_mloss"]), (env, version, results["hf_mloss"])
