"""benchmarks/suites/gram_rank.py: the rank, conditioning and spread its record reports, against numpy by hand, and
the Grams it reads off a DINOv2 block's linears against the block's own inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from benchmarks.suites.gram_rank import RATIO, own_grams, statistics, summarise


def test_statistics_are_the_rank_the_solved_conditioning_and_the_spread():
    generator = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 6, generator=generator, dtype=torch.float64) for n in (3, 10, 8)]
    grams = [(x.T @ x, len(x)) for x in xs]
    stats = statistics(grams)
    assert stats["min_rank"] == 3 and stats["features"] == 6 and stats["positions"] == [3, 10, 8]  # 3 rows span 3
    solved = sum(RATIO * g.numpy() + (1 - RATIO) * np.diag(np.diag(g.numpy())) for g, _ in grams)
    eig = np.linalg.eigvalsh(solved)
    assert stats["condition_solved"] == pytest.approx(eig.max() / eig.min(), rel=1e-9)
    normed = [g.numpy() / n for g, n in grams]
    scale = np.mean([np.linalg.norm(g) for g in normed])
    pairs = [np.linalg.norm(a - b) / scale for a, b in itertools.combinations(normed, 2)]
    assert stats["spread"] == pytest.approx(np.mean(pairs), rel=1e-9)
    assert statistics([grams[1], grams[1]])["spread"] == 0.0  # equal Grams: RegMean is the plain average


def test_the_grams_are_those_of_each_linears_own_input(tmp_path):
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    model = Dinov2Model(Dinov2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                     mlp_ratio=2, image_size=28, patch_size=14)).eval()
    model.save_pretrained(tmp_path)
    pixels = torch.randn(3, 3, 28, 28)
    seen = {}
    block = model.encoder.layer[1]
    def keep(key):
        def hook(module, args, output):
            seen[key] = args[0]

        return hook

    hooks = [block.attention.q_proj.register_forward_hook(keep("q")), block.mlp.fc2.register_forward_hook(keep("fc2"))]
    with torch.no_grad():
        model(pixel_values=pixels)
    for hook in hooks:
        hook.remove()
    grams = own_grams(tmp_path, pixels, [1])
    for key, name in (("q", "attention (q, k, v)"), ("fc2", "mlp fc2")):
        x = seen[key].reshape(-1, seen[key].shape[-1]).double()
        gram, positions = grams[(1, name)]
        assert positions == 3 * 5  # 2×2 patches and the CLS token per image
        torch.testing.assert_close(gram, x.T @ x, rtol=1e-6, atol=1e-8)


def test_the_summary_holds_the_tables_cells():
    cell = {"features": 4, "positions": [10, 10], "min_rank": 4, "condition_solved": 2.0, "spread": 0.5}
    payload = {"seeds": [0, 1], "per_seed": {"0": {"pooled": {"block 1: mlp fc1": cell}},
                                             "1": {"pooled": {"block 1: mlp fc1": {**cell, "min_rank": 3,
                                                                                  "condition_solved": 4.0}}}}}
    mean = summarise(payload)["mean"]["pooled"]["block 1: mlp fc1"]
    assert mean == {"positions": 10, "features": 4, "min_rank": 3, "condition_solved": 3.0, "spread": 0.5}
