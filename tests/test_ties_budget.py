"""``ties(budget="changed")``: a global trim whose k counts the entries the fine-tunes changed, not the whole model.

Fine-tunes of a tiny CLIP tower that change only the last block (the rest equal to the base bit for bit, as in a
partly frozen fine-tune) are merged and compared with a reference computed here: per task, keep the
``floor(c·k)`` largest |τ| among its ``c`` changed entries, elect, disjoint mean.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import hf_mloss
from examples.tiny import make_base, make_finetune, save_model


def task_vectors(base, fts, name) -> np.ndarray:
    return np.stack([(ft[name].float() - base[name].float()).double().numpy() for ft in fts])


def ref_elect_merge(taus: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Sign election on Σ w·τ (0 → +), weighted mean of the agreeing non-zero entries."""
    wb = w.reshape(-1, *([1] * (taus.ndim - 1)))
    sign = np.where((wb * taus).sum(0) >= 0, 1.0, -1.0)
    agree = (np.sign(taus) == sign) & (taus != 0)
    num, den = (wb * taus * agree).sum(0), (wb * agree).sum(0)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


@pytest.fixture(scope="module")
def partly_frozen(tmp_path_factory):
    """Base + 3 fine-tunes that changed only ``encoder.layers.1`` (the other tensors are the base's)."""
    root = tmp_path_factory.mktemp("partly_frozen")
    base = make_base(seed=0)
    save_model(base, root / "base")
    paths = []
    for seed in (1, 2, 3):
        tuned = make_finetune(base, seed=seed)
        with torch.no_grad():
            for name, value in tuned.state_dict().items():
                if ".layers.1." not in name:
                    value.copy_(base.state_dict()[name])
        save_model(tuned, root / f"ft{seed}")
        paths.append(root / f"ft{seed}")
    load = lambda p: load_file(str(p / "model.safetensors"))
    return root / "base", paths, load(root / "base"), [load(p) for p in paths]


def reference(base, fts, k: float, lam: float) -> dict[str, np.ndarray]:
    names = [n for n, t in base.items() if t.is_floating_point()]
    thresholds, kept_counts = [], []
    for ft in fts:
        flat = np.concatenate([np.abs((ft[n].float() - base[n].float()).numpy()).reshape(-1) for n in names])
        changed = flat[flat != 0]
        m = math.floor(changed.size * k)
        thresholds.append(float(np.sort(changed)[::-1][m - 1]))
        kept_counts.append(m)
    out = {}
    for n in names:
        taus = task_vectors(base, fts, n)
        trimmed = np.stack([np.where(np.abs(t) >= thr, t, 0.0) for t, thr in zip(taus, thresholds)])
        out[n] = base[n].double().numpy() + lam * ref_elect_merge(trimmed, np.full(len(fts), 1 / len(fts)))
    return out, thresholds, kept_counts


@pytest.mark.parametrize("k", [0.2, 0.5])
def test_changed_budget_keeps_k_of_the_changed_entries(partly_frozen, k) -> None:
    base_dir, paths, base, fts = partly_frozen
    expected, thresholds, counts = reference(base, fts, k, lam=1.3)
    names = list(expected)
    for ft, thr, m in zip(fts, thresholds, counts):  # the reference keeps exactly floor(c·k) per task vector
        kept = sum(int(((ft[n] - base[n]).abs() >= thr).sum()) for n in names if ".layers.1." in n)
        assert kept == m > 0
    result = hf_mloss.merge(str(base_dir), [str(p) for p in paths], "ties", k=k, lam=1.3, budget="changed",
                            progress=False)
    merged = {n: t.detach() for n, t in result.model.state_dict().items()}
    for n in names:
        np.testing.assert_allclose(merged[n].double().numpy(), expected[n], atol=1e-6, rtol=0)


def test_all_budget_keeps_every_changed_entry_when_the_zeros_fill_it(partly_frozen) -> None:
    """The default (the original definition): one block of two changed, k = 0.5 of all entries ≥ every changed
    entry, so nothing is trimmed and the merge is the untrimmed disjoint mean; ``changed`` differs from it."""
    base_dir, paths, base, fts = partly_frozen
    names = [n for n, t in base.items() if t.is_floating_point()]
    total = sum(base[n].numel() for n in names)
    changed = [sum(int((ft[n] != base[n]).sum()) for n in names) for ft in fts]
    assert max(changed) <= total * 0.5
    models = [str(p) for p in paths]
    default = hf_mloss.merge(str(base_dir), models, "ties", k=0.5, progress=False).model.state_dict()
    untrimmed = hf_mloss.merge(str(base_dir), models, "ties", k=1.0, progress=False).model.state_dict()
    trimmed = hf_mloss.merge(str(base_dir), models, "ties", k=0.5, budget="changed", progress=False)
    assert all(torch.equal(default[n], untrimmed[n]) for n in names)
    assert any(not torch.equal(default[n], trimmed.model.state_dict()[n]) for n in names)


def test_budget_is_validated(partly_frozen) -> None:
    base_dir, paths, *_ = partly_frozen
    with pytest.raises(Exception, match="budget"):
        hf_mloss.merge(str(base_dir), [str(p) for p in paths], "ties", budget="trained", progress=False)
