"""The M-TIES / M-DARE controls: ``rank="inverted"`` ranks rows by −M-Loss (the highest-loss node keeps k);
``rank="uniform"`` gives every node k − e/2."""

from __future__ import annotations

import pytest
import torch

import hf_mloss

FC1 = [f"encoder.layers.{i}.mlp.fc1" for i in range(2)]
IMG = {"num_samples": 8, "batch_size": 4}


@pytest.mark.parametrize("method", ["m_ties", "m_dare"])
def test_inverted_ranks_mirror_the_mloss_keep_ratios(tiny_paths, image_folder, method) -> None:
    base, models = tiny_paths
    k, e = 0.5, 0.2
    common = {"k": k, "e": e, "data": str(image_folder), "progress": False, **IMG}
    mloss = hf_mloss.merge(base, models, method, **common)
    inverted = hf_mloss.merge(base, models, method, rank="inverted", **common)
    for name in FC1:
        node = inverted.report.node[name].double()
        n = node.numel()
        assert torch.unique(node).numel() == n  # distinct scores: the ranks are a permutation
        descending = torch.empty(n, dtype=torch.float64)
        descending[torch.argsort(-node)] = torch.arange(n, dtype=torch.float64)
        b = inverted.report.keep_ratios[name].double()
        torch.testing.assert_close(b, k - e * descending / (n - 1), atol=1e-6, rtol=0)
        assert float(b[node.argmax()]) == pytest.approx(k) and float(b[node.argmin()]) == pytest.approx(k - e)
    # the first block is scored on the same inputs by both: rank r → n−1−r, so keep' = 2k − e − keep
    a, b = (r.report.keep_ratios[FC1[0]].double() for r in (mloss, inverted))
    torch.testing.assert_close(a + b, torch.full_like(a, 2 * k - e), atol=1e-6, rtol=0)
    assert any(not torch.equal(mloss.model.state_dict()[n], inverted.model.state_dict()[n])
               for n in (f"{FC1[0]}.weight", f"{FC1[1]}.weight"))


@pytest.mark.parametrize("method", ["m_ties", "m_dare"])
def test_uniform_rank_keeps_the_mean_ratio_on_every_node(tiny_paths, image_folder, method) -> None:
    """``rank="uniform"``: the budget-matched control — every scored node keeps k − e/2 (the mean of M-TIES's ranked
    ratios), each row trimmed on its own; the tensors outside the groups keep k as in M-TIES."""
    base, models = tiny_paths
    k, e = 0.5, 0.2
    common = {"k": k, "e": e, "data": str(image_folder), "progress": False, "seed": 3, **IMG}
    ranked = hf_mloss.merge(base, models, method, **common)
    uniform = hf_mloss.merge(base, models, method, rank="uniform", **common)
    for name in FC1:
        keep = uniform.report.keep_ratios[name]  # recorded in float32
        assert torch.equal(keep, torch.full_like(keep, k - e / 2))
        assert float(ranked.report.keep_ratios[name].double().mean()) == pytest.approx(k - e / 2)
    # outside the groups both runs are the same per-tensor trim at k: identical tensors
    sd_r, sd_u = ranked.model.state_dict(), uniform.model.state_dict()
    outside = [n for n in sd_r if "fc1" not in n and sd_r[n].is_floating_point()]
    assert len(outside) > 10 and all(torch.equal(sd_r[n], sd_u[n]) for n in outside)
    assert not torch.equal(sd_r[f"{FC1[0]}.weight"], sd_u[f"{FC1[0]}.weight"])


def _disjoint_merge(base: torch.Tensor, taus: list[torch.Tensor], keep: float) -> torch.Tensor:
    """Per-tensor TIES by hand: each τ keeps its floor(numel·keep) largest magnitudes, the sign of Σ τ is elected
    (+1 on a zero sum), and the entries that agree with it are averaged (λ = 1, uniform weights)."""
    trimmed = []
    for tau in taus:
        m = int(tau.numel() * keep)
        flat = tau.flatten().double()
        threshold = flat.abs().sort(descending=True).values[m - 1] if m > 0 else float("inf")
        trimmed.append(torch.where(flat.abs() >= threshold, flat, torch.zeros_like(flat)))
    stack = torch.stack(trimmed)
    sign = torch.where(stack.sum(0) >= 0, 1.0, -1.0)
    agree = (torch.sign(stack) == sign) & (stack != 0)
    mean = (stack * agree).sum(0) / agree.sum(0).clamp(min=1)
    return (base.double().flatten() + mean).reshape(base.shape)


def test_tensor_rank_is_per_tensor_ties_at_the_budget(tiny_paths, image_folder) -> None:
    """``rank="tensor"``: the budget-matched per-tensor control — each tensor of a scored group (fc1's weight and
    bias) is trimmed as a whole at k − e/2, M-TIES's mean keep ratio, with no ranks and no rows; every other tensor
    keeps k, as in M-TIES. With e = 0 it is the e = 0 control, and so per-tensor TIES, bit for bit."""
    from safetensors.torch import load_file

    base, models = tiny_paths
    k, e = 0.5, 0.2
    common = {"data": str(image_folder), "progress": False, "seed": 3, **IMG}
    tensor = hf_mloss.merge(base, models, "m_ties", k=k, e=e, rank="tensor", **common)
    uniform = hf_mloss.merge(base, models, "m_ties", k=k, e=e, rank="uniform", **common)
    states = [load_file(f"{folder}/model.safetensors") for folder in (base, *models)]
    merged = tensor.model.state_dict()
    for layer in FC1:
        assert torch.equal(tensor.report.keep_ratios[layer], torch.full_like(tensor.report.keep_ratios[layer],
                                                                             k - e / 2))
        for part in ("weight", "bias"):
            name = f"{layer}.{part}"
            expected = _disjoint_merge(states[0][name], [s[name] - states[0][name] for s in states[1:]], k - e / 2)
            torch.testing.assert_close(merged[f"{layer}.{part}"].double(), expected, atol=1e-6, rtol=0)
    sd_u = uniform.model.state_dict()
    outside = [n for n in merged if "fc1" not in n and merged[n].is_floating_point()]
    assert len(outside) > 10 and all(torch.equal(merged[n], sd_u[n]) for n in outside)
    assert not torch.equal(merged[f"{FC1[0]}.weight"], sd_u[f"{FC1[0]}.weight"])  # whole tensor, not row by row
    zero = hf_mloss.merge(base, models, "m_ties", k=k, e=0.0, rank="tensor", **common).model.state_dict()
    ties = hf_mloss.merge(base, models, "ties", k=k, scope="tensor", progress=False).model.state_dict()
    assert all(torch.equal(zero[n], ties[n]) for n in ties if ties[n].is_floating_point())
