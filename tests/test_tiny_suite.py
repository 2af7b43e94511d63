"""The offline tiny suite in its CI smoke mode (``fast=True``): shapes, determinism, cache reuse, heads."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from transformers import CLIPImageProcessorPil, CLIPVisionModel  # noqa: E402

from benchmarks.suites import tasks as T  # noqa: E402
from benchmarks.suites.tiny import TaskHead, TinySuite, build_tiny_suite  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[TinySuite, float, object]:
    cache = tmp_path_factory.mktemp("tiny_suite")
    start = time.perf_counter()
    suite = build_tiny_suite(cache, fast=True, progress=False)
    return suite, time.perf_counter() - start, cache


def test_task_generators_are_deterministic_and_seeded():
    for name in T.TASKS:
        a = T.make_task(name, {"train": 6, "test": 6}, seed=0)
        b = T.make_task(name, {"train": 6, "test": 6}, seed=0)
        c = T.make_task(name, {"train": 6}, seed=1)
        for split in a:
            x, y = a[split]
            assert x.shape == (6, 32, 32, 3) and x.dtype == np.uint8
            assert y.dtype == np.int64 and 0 <= y.min() and y.max() < len(T.TASKS[name].classes)
            np.testing.assert_array_equal(x, b[split][0])
            np.testing.assert_array_equal(y, b[split][1])
        assert not np.array_equal(a["train"][0], a["test"][0])
        assert not np.array_equal(a["train"][0], c["train"][0])
    mix = T.make_pretrain_mix(4, seed=0)
    assert set(mix) == set(T.PRETRAIN_SOURCES)
    assert all(x.shape == (4, 32, 32, 3) for x, _ in mix.values())


def test_digit_scans_are_disjoint_across_splits():
    parts = [set(T._digit_indices(s).tolist()) for s in ("train", "val", "test")]
    assert not (parts[0] & parts[1]) and not (parts[0] & parts[2]) and not (parts[1] & parts[2])
    assert sum(map(len, parts)) == 1797


def test_suite_shapes(built):
    suite, _, _ = built
    names = list(T.TASKS)
    assert list(suite.finetuned) == names == list(suite.heads) == list(suite.val) == list(suite.test)
    base = CLIPVisionModel.from_pretrained(suite.base_dir)
    assert base.config.image_size == 32
    for name in names:
        assert (suite.finetuned[name] / "config.json").exists()
        for x, y in (suite.val[name], suite.test[name]):
            assert x.dtype == torch.float32 and x.shape[1:] == (3, 32, 32) and y.shape == (len(x),)
            assert y.dtype == torch.int64 and int(y.max()) < len(T.TASKS[name].classes)
    assert suite.unlabeled.shape[0] >= 256 and suite.unlabeled.shape[1:] == (3, 32, 32)
    assert {"timings", "config", "versions", "accuracy", "finetune_loss"} <= set(suite.info)
    assert set(suite.info["accuracy"]["finetuned"]) == set(names) | {"mean"}


def test_pixels_match_the_saved_processor(built):
    suite, _, _ = built
    n = len(suite.val["digits"][1])
    images, labels = T.make_task("digits", {"val": n}, seed=0)["val"]
    np.testing.assert_array_equal(labels, suite.val["digits"][1].numpy())
    processor = CLIPImageProcessorPil.from_pretrained(suite.base_dir)
    processed = processor(images=list(images[:4]), return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(processed, suite.val["digits"][0][:4], atol=1e-5, rtol=0)


def test_heads_give_logits(built):
    suite, _, _ = built
    model = CLIPVisionModel.from_pretrained(suite.finetuned["shapes"]).eval()
    with torch.inference_mode():
        for name, head in suite.heads.items():
            x = suite.test[name][0][:5]
            logits = head.logits(model(pixel_values=x).pooler_output)
            assert logits.shape == (5, len(T.TASKS[name].classes))
            assert torch.isfinite(logits).all()
    head = TaskHead(weight=torch.eye(3, 4), bias=torch.zeros(3), center=None, normalize=False, scale=2.0)
    torch.testing.assert_close(head.logits(torch.ones(2, 4)), torch.full((2, 3), 2.0))


def test_cache_is_reused(built):
    suite, first, cache = built
    start = time.perf_counter()
    again = build_tiny_suite(cache, fast=True, progress=False)
    second = time.perf_counter() - start
    assert second < first / 3
    assert again.info["timings"] == suite.info["timings"]
    assert again.base_dir == suite.base_dir
    for name in suite.finetuned:
        a = CLIPVisionModel.from_pretrained(suite.finetuned[name]).state_dict()
        b = CLIPVisionModel.from_pretrained(again.finetuned[name]).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
        torch.testing.assert_close(again.heads[name].weight, suite.heads[name].weight, rtol=0, atol=0)
        torch.testing.assert_close(again.test[name][0], suite.test[name][0], rtol=0, atol=0)
    torch.testing.assert_close(again.unlabeled, suite.unlabeled, rtol=0, atol=0)


def test_unknown_task_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown tasks"):
        build_tiny_suite(tmp_path, tasks=["nope"], fast=True, progress=False)
