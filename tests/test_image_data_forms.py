"""Images passed from Python as a list of ``[3, H, W]`` tensors (issue 74): stacked into the ``[N, 3, H, W]`` tensor
form, so they score and merge as that tensor does; tensors of different shapes, or tensors mixed with other items,
are refused when the config is built, naming the shapes and how to pass them."""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_mloss
from examples.tiny import tiny_processor


@pytest.fixture(scope="module")
def pixels(image_folder) -> torch.Tensor:
    from PIL import Image

    images = [Image.open(p).convert("RGB") for p in sorted(image_folder.rglob("*.png"))]
    return tiny_processor(32)(images=images, return_tensors="pt")["pixel_values"]


def test_a_list_of_image_tensors_scores_and_merges_as_their_stack(tiny_paths, pixels, monkeypatch):
    base, models = tiny_paths
    monkeypatch.setenv("HF_MLOSS_THREADS", "1")  # both runs on one thread, so equal means equal bit for bit
    as_list = list(pixels)
    assert len(as_list) == 12 and as_list[0].shape == (3, 32, 32)
    stacked = hf_mloss.score(base, models, data=pixels, num_samples=12, progress=False)
    listed = hf_mloss.score(base, models, data=as_list, num_samples=12, progress=False)
    assert listed.layer == stacked.layer and listed.num_samples == 12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto's grid-edge warning, not the subject here
        merged = hf_mloss.merge(base, models, "auto", data=as_list, candidates=["tsv_m"], compare_samples=8,
                                progress=False)
        direct = hf_mloss.merge(base, models, "auto", data=pixels, candidates=["tsv_m"], compare_samples=8,
                                progress=False)
    assert merged.config.parameters["chosen"] == direct.config.parameters["chosen"]
    assert merged.config.data.to_dict() == direct.config.data.to_dict()  # the same content hash in the recipe


def test_tensors_of_different_shapes_are_refused_naming_them(tiny_paths, pixels):
    base, models = tiny_paths
    odd = [*pixels[:2], torch.zeros(3, 28, 28), torch.zeros(1, 3, 32, 32)]
    with pytest.raises(hf_mloss.DataError) as info:
        hf_mloss.merge(base, models, "m_ties", data=odd, progress=False)
    message = str(info.value)
    assert "stacked into [N, 3, H, W]" in message and "each must be [3, H, W]" in message
    assert "[3, 32, 32] (items 0, 1)" in message and "[3, 28, 28] (item 2)" in message
    assert "[1, 3, 32, 32] (item 3)" in message and "image processor" in message
    with pytest.raises(hf_mloss.DataError, match=r"they must share one shape, got \[3, 32, 32\] \(items 0, 1\); "
                                                 r"\[3, 28, 28\] \(item 2\)"):
        hf_mloss.merge(base, models, "m_ties", data=odd[:3], progress=False)


def test_tensors_mixed_with_images_are_refused(tiny_paths, pixels, image_folder):
    base, models = tiny_paths
    path = str(sorted(image_folder.rglob("*.png"))[0])
    with pytest.raises(hf_mloss.DataError, match=r"also holds str \(item 1\)\. Pass tensors only, or PIL images"):
        hf_mloss.merge(base, models, "m_ties", data=[pixels[0], path], progress=False)
