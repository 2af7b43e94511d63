"""End-to-end tests of the merge methods through ``hf_mloss.merge`` on tiny CLIP vision towers.

Every merged state dict is compared with an independent reference computed here from the saved checkpoints
(numpy, float64 arithmetic on the float32 task vectors), following SPEC §2–§5 and the peer conventions of PEERS §B.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import hf_mloss
from hf_mloss.methods.ops import tensor_seed

ATOL = 1e-6
IMG = dict(num_samples=8, batch_size=4)


# --------------------------------------------------------------------------------------------------------------------
# Reference implementation (independent of hf_mloss.methods)
# --------------------------------------------------------------------------------------------------------------------


def load_sd(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


@pytest.fixture(scope="module")
def ckpt(tiny_models):
    base_dir, model_dirs = tiny_models
    base = load_sd(base_dir)
    fts = [load_sd(m) for m in model_dirs]
    names = [n for n, t in base.items() if t.is_floating_point()]
    return base, fts, names


def task_vectors(base, fts, name) -> np.ndarray:
    """[q, ...] float64 array of τ_p = θ_p − θ₀ (the subtraction done in float32, as the checkpoints are float32)."""
    return np.stack([(ft[name].float() - base[name].float()).double().numpy() for ft in fts])


def top_m_mask(values: np.ndarray, m: int) -> np.ndarray:
    """Boolean mask of the m largest |values| (argsort; exactly m on distinct magnitudes)."""
    flat = np.abs(values).reshape(-1)
    mask = np.zeros(flat.shape, dtype=bool)
    if m > 0:
        mask[np.argsort(-flat, kind="stable")[:m]] = True
    return mask.reshape(values.shape)


def ref_trim_tensor(tau: np.ndarray, m: int) -> np.ndarray:
    return np.where(top_m_mask(tau, m), tau, 0.0)


def ref_trim_rows(tau: np.ndarray, counts: list[int]) -> np.ndarray:
    return np.stack([ref_trim_tensor(tau[i], counts[i]) for i in range(tau.shape[0])])


def ref_elect_merge(taus: np.ndarray, w: np.ndarray, *, elect="weighted", divide_by="weights") -> np.ndarray:
    wb = w.reshape(-1, *([1] * (taus.ndim - 1)))
    total = (wb * taus).sum(0) if elect == "weighted" else taus.sum(0)
    sign = np.where(total >= 0, 1.0, -1.0)
    agree = (np.sign(taus) == sign) & (taus != 0)
    num = (wb * taus * agree).sum(0)
    den = (wb * agree).sum(0) if divide_by == "weights" else agree.sum(0).astype(np.float64)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def ref_global_thresholds(base, fts, names, m: int) -> list[float]:
    """Per task: the m-th largest |τ| over the whole task vector (concatenation + full sort)."""
    out = []
    for ft in fts:
        flat = np.concatenate([np.abs((ft[n].float() - base[n].float()).numpy()).reshape(-1) for n in names])
        out.append(float(np.sort(flat)[::-1][m - 1]) if m > 0 else math.inf)
    return out


def ref_ties(base, fts, names, *, k, lam=1.0, weights=None, scope="tensor", min_keep=0, extra=0,
             elect="weighted", divide_by="weights") -> dict[str, np.ndarray]:
    q = len(fts)
    w = np.full(q, 1.0 / q) if weights is None else np.asarray(weights, dtype=np.float64)
    thresholds = None
    if scope == "global":
        d = sum(base[n].numel() for n in names)
        thresholds = ref_global_thresholds(base, fts, names, min(d, math.floor(d * k) + extra))
    out = {}
    for n in names:
        taus = task_vectors(base, fts, n)
        if scope == "global":
            trimmed = np.stack([np.where(np.abs(t) >= thr, t, 0.0) for t, thr in zip(taus, thresholds)])
        else:
            m = min(taus[0].size, max(min_keep, math.floor(taus[0].size * k) + extra))
            trimmed = np.stack([ref_trim_tensor(t, m) for t in taus])
        out[n] = base[n].double().numpy() + lam * ref_elect_merge(trimmed, w, elect=elect, divide_by=divide_by)
    return out


def dare_mask(seed: int, name: str, index: int, shape, p: float) -> np.ndarray:
    g = torch.Generator().manual_seed(tensor_seed(seed, name, index))
    return (torch.rand(tuple(shape), generator=g) < p).numpy()


def ref_dare_tau(tau: np.ndarray, mask: np.ndarray, p: float, rescale: str) -> np.ndarray:
    kept = np.where(mask, tau, 0.0)
    if rescale == "inverse":
        return kept / p
    if rescale == "l1":
        norm = np.abs(kept).sum()
        return kept * (np.abs(tau).sum() / norm) if norm > 0 else kept
    return kept


def ref_dare(base, fts, names, *, p, seed, combine, lam=1.0, weights=None, rescale="inverse"):
    q = len(fts)
    if weights is None:
        weights = [1.0 / q] * q if combine == "ties" else [1.0] * q
    w = np.asarray(weights, dtype=np.float64)
    out = {}
    for n in names:
        taus = task_vectors(base, fts, n)
        dropped = np.stack([ref_dare_tau(t, dare_mask(seed, n, i, t.shape, p), p, rescale)
                            for i, t in enumerate(taus)])
        merged = ref_elect_merge(dropped, w) if combine == "ties" else np.tensordot(w, dropped, axes=1)
        out[n] = base[n].double().numpy() + lam * merged
    return out


def spec_keep_ratios(node: torch.Tensor, k: float, e: float) -> np.ndarray:
    """SPEC §2: ascending stable ranks r_i, ρ_i = r_i/(n−1), keep_i = k − e·ρ_i (float64)."""
    scores = node.double().numpy()
    n = scores.size
    ranks = np.empty(n)
    ranks[np.argsort(scores, kind="stable")] = np.arange(n)
    return k - e * ranks / (n - 1)


def merged_sd(result) -> dict[str, torch.Tensor]:
    return {k: v.detach().float() for k, v in result.model.state_dict().items()}


def assert_matches(result, expected: dict[str, np.ndarray], atol: float = ATOL) -> None:
    got = merged_sd(result)
    assert set(expected) <= set(got), sorted(set(expected) - set(got))
    for name, ref in expected.items():
        np.testing.assert_allclose(got[name].double().numpy(), ref, atol=atol, rtol=0, err_msg=name)


def run(paths, method, **kwargs):
    base, models = paths
    return hf_mloss.merge(base, models, method, progress=False, **kwargs)


FC1 = [f"encoder.layers.{i}.mlp.fc1" for i in range(2)]


# --------------------------------------------------------------------------------------------------------------------
# Linear merges
# --------------------------------------------------------------------------------------------------------------------


def test_merged_state_dict_names_and_dtype(tiny_paths, ckpt) -> None:
    base, _, names = ckpt
    result = run(tiny_paths, "average")
    sd = result.model.state_dict()
    assert set(names) <= set(sd)
    assert all(sd[n].dtype == base[n].dtype for n in names)
    assert result.method == "average"


def test_average_uniform(tiny_paths, ckpt) -> None:
    base, fts, names = ckpt
    expected = {n: np.mean([ft[n].double().numpy() for ft in fts], axis=0) for n in names}
    result = run(tiny_paths, "average")
    assert_matches(result, expected)
    np.testing.assert_allclose(result.weights, [1 / 3] * 3, rtol=1e-6)


@pytest.mark.parametrize("weights", [[0.2, 0.3, 0.5], [1.0, 2.0, 3.0], [0.0, 1.0, 1.0]])
def test_average_weighted(tiny_paths, ckpt, weights) -> None:
    base, fts, names = ckpt
    w = np.asarray(weights) / sum(weights)  # Σ α θ with α normalised to sum to 1
    expected = {n: sum(a * ft[n].double().numpy() for a, ft in zip(w, fts)) for n in names}
    assert_matches(run(tiny_paths, "average", weights=weights), expected)


def test_task_arithmetic_default_lam(tiny_paths, ckpt) -> None:
    base, fts, names = ckpt
    expected = {n: base[n].double().numpy() + 0.3 * task_vectors(base, fts, n).sum(0) for n in names}
    assert_matches(run(tiny_paths, "task_arithmetic"), expected)


def test_task_arithmetic_lam_and_weights(tiny_paths, ckpt) -> None:
    base, fts, names = ckpt
    w = np.array([1.0, 0.5, 2.0])
    expected = {n: base[n].double().numpy() + 0.8 * np.tensordot(w, task_vectors(base, fts, n), axes=1)
                for n in names}
    assert_matches(run(tiny_paths, "task_arithmetic", lam=0.8, weights=list(w)), expected)


# --------------------------------------------------------------------------------------------------------------------
# TIES: scopes and conventions
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0.2, 0.55])
def test_ties_tensor_scope(tiny_paths, ckpt, k) -> None:
    base, fts, names = ckpt
    expected = ref_ties(base, fts, names, k=k, scope="tensor")
    assert_matches(run(tiny_paths, "ties", k=k, scope="tensor"), expected)


def test_ties_tensor_scope_weights_and_lam(tiny_paths, ckpt) -> None:
    base, fts, names = ckpt
    weights = [1.0, 0.5, 2.0]
    expected = ref_ties(base, fts, names, k=0.3, scope="tensor", weights=weights, lam=0.7)
    assert_matches(run(tiny_paths, "ties", k=0.3, scope="tensor", weights=weights, lam=0.7), expected)


@pytest.mark.parametrize("k", [0.2, 0.5])
def test_ties_global_scope_default(tiny_paths, ckpt, k) -> None:
    base, fts, names = ckpt
    d = sum(base[n].numel() for n in names)
    m = math.floor(d * k)
    # the reference threshold is exact: with distinct magnitudes exactly floor(d·k) entries are kept per task
    thresholds = ref_global_thresholds(base, fts, names, m)
    for ft, thr in zip(fts, thresholds):
        kept = sum(int(((ft[n] - base[n]).abs() >= thr).sum()) for n in names)
        assert kept == m
    expected = ref_ties(base, fts, names, k=k, scope="global")
    result = run(tiny_paths, "ties", k=k)  # hf_mloss convention: global scope by default
    assert result.params["k"] == k
    assert_matches(result, expected)


def test_ties_global_differs_from_tensor_scope(tiny_paths) -> None:
    g = merged_sd(run(tiny_paths, "ties", k=0.2, scope="global"))
    t = merged_sd(run(tiny_paths, "ties", k=0.2, scope="tensor"))
    assert any(not torch.equal(g[n], t[n]) for n in g)


CONVENTION_CASES = [
    # (convention, merge kwargs, reference kwargs)
    ("hf_mloss", dict(k=0.2, weights=[1.0, 0.5, 2.0], lam=0.7),
     dict(k=0.2, weights=[1.0, 0.5, 2.0], lam=0.7, scope="global")),
    ("mergekit", dict(k=0.2, weights=[1.0, 0.5, 2.0], lam=0.7),
     dict(k=0.2, weights=[1.0, 0.5, 2.0], lam=0.7, scope="tensor", min_keep=1)),
    # k=0.02: floor(32·0.02) = 0 for the 32-entry tensors, so mergekit's "at least one kept" matters
    ("mergekit", dict(k=0.02, weights=[1.0, 0.5, 2.0]),
     dict(k=0.02, weights=[1.0, 0.5, 2.0], scope="tensor", min_keep=1)),
    ("fusion_bench", dict(k=0.2), dict(k=0.2, scope="global", extra=1)),
    ("fusion_bench", dict(k=0.2, lam=1.3), dict(k=0.2, lam=1.3, scope="global", extra=1)),
    ("peft", dict(k=0.2, weights=[1.0, 0.5, 2.0], lam=0.7),
     dict(k=0.2, weights=[1.0, 0.5, 2.0], lam=0.7, scope="tensor", elect="unweighted", divide_by="count")),
    ("peft", dict(k=0.02, weights=[1.0, 0.5, 2.0]),
     dict(k=0.02, weights=[1.0, 0.5, 2.0], scope="tensor", elect="unweighted", divide_by="count")),
]


@pytest.mark.parametrize(("convention", "kwargs", "ref_kwargs"), CONVENTION_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CONVENTION_CASES)])
def test_ties_conventions_match_reference(tiny_paths, ckpt, convention, kwargs, ref_kwargs) -> None:
    base, fts, names = ckpt
    expected = ref_ties(base, fts, names, **ref_kwargs)
    assert_matches(run(tiny_paths, "ties", convention=convention, **kwargs), expected)


def test_ties_conventions_are_distinct(tiny_paths) -> None:
    w = dict(weights=[1.0, 0.5, 2.0], lam=0.7)
    mergekit = merged_sd(run(tiny_paths, "ties", k=0.2, convention="mergekit", **w))
    peft = merged_sd(run(tiny_paths, "ties", k=0.2, convention="peft", **w))
    hf = merged_sd(run(tiny_paths, "ties", k=0.2, convention="hf_mloss"))
    fb = merged_sd(run(tiny_paths, "ties", k=0.2, convention="fusion_bench"))
    assert any(not torch.equal(mergekit[n], peft[n]) for n in mergekit)
    # fusion_bench keeps exactly one more entry per task than hf_mloss: a few entries differ, most do not
    differing = sum(int((hf[n] != fb[n]).sum()) for n in hf)
    assert 1 <= differing <= 3


def test_ties_mergekit_never_empties_a_tensor(tiny_paths, ckpt) -> None:
    base, _, names = ckpt
    sd = merged_sd(run(tiny_paths, "ties", k=0.01, convention="mergekit"))
    for n in names:  # at least one entry of every tensor moved away from the base
        assert int((sd[n] != base[n]).sum()) >= 1, n
    sd_hf = merged_sd(run(tiny_paths, "ties", k=0.01, scope="tensor"))
    assert torch.equal(sd_hf["post_layernorm.bias"], base["post_layernorm.bias"])  # floor(32·0.01) = 0 kept


# --------------------------------------------------------------------------------------------------------------------
# DARE
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["dare_ties", "dare_linear"])
@pytest.mark.parametrize("rescale", ["inverse", "l1"])
def test_dare_matches_regenerated_masks(tiny_paths, ckpt, method, rescale) -> None:
    base, fts, names = ckpt
    combine = "ties" if method == "dare_ties" else "linear"
    expected = ref_dare(base, fts, names, p=0.6, seed=7, combine=combine, rescale=rescale)
    assert_matches(run(tiny_paths, method, p=0.6, seed=7, rescale=rescale), expected, atol=2e-6)


def test_dare_weights_and_lam(tiny_paths, ckpt) -> None:
    base, fts, names = ckpt
    weights = [1.0, 0.5, 2.0]
    for method, combine in [("dare_ties", "ties"), ("dare_linear", "linear")]:
        expected = ref_dare(base, fts, names, p=0.5, seed=3, combine=combine, weights=weights, lam=0.6)
        assert_matches(run(tiny_paths, method, p=0.5, seed=3, weights=weights, lam=0.6), expected, atol=2e-6)


@pytest.mark.parametrize("method", ["dare_ties", "dare_linear", "dare"])
def test_dare_seed_reproducible_and_seed_dependent(tiny_paths, method) -> None:
    a = merged_sd(run(tiny_paths, method, p=0.7, seed=1))
    b = merged_sd(run(tiny_paths, method, p=0.7, seed=1))
    c = merged_sd(run(tiny_paths, method, p=0.7, seed=2))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a)


def test_dare_alias_is_dare_ties(tiny_paths) -> None:
    a = merged_sd(run(tiny_paths, "dare", p=0.7, seed=5))
    b = merged_sd(run(tiny_paths, "dare_ties", p=0.7, seed=5))
    assert all(torch.equal(a[n], b[n]) for n in a)


# --------------------------------------------------------------------------------------------------------------------
# Identical sources
# --------------------------------------------------------------------------------------------------------------------

IDENTITY_CASES = [
    ("average", {}),
    ("average", dict(weights=[1.0, 2.0, 3.0])),
    ("task_arithmetic", dict(lam=1 / 3)),
    ("task_arithmetic", dict(lam=1.0, weights=[0.5, 0.25, 0.25])),
    ("ties", dict(k=1.0)),
    ("ties", dict(k=1.0, scope="tensor", weights=[1.0, 0.5, 2.0])),
    ("ties", dict(k=1.0, convention="mergekit", weights=[1.0, 0.5, 2.0])),
    ("ties", dict(k=1.0, convention="fusion_bench")),
    ("ties", dict(k=1.0, convention="peft")),  # weights set to 1 below: PEFT divides the weighted sum by the count
    ("dare_ties", dict(p=1.0, weights=[1.0, 0.5, 2.0])),
    ("dare_linear", dict(p=1.0, lam=1 / 3)),
]


@pytest.mark.parametrize(("method", "kwargs"), IDENTITY_CASES,
                         ids=[f"{m}-{i}" for i, (m, _) in enumerate(IDENTITY_CASES)])
def test_identical_models_merge_to_themselves(tiny_models, method, kwargs) -> None:
    base_dir, model_dirs = tiny_models
    kwargs = dict(kwargs)
    if method == "ties" and kwargs.get("convention") == "peft":
        kwargs["weights"] = [1.0, 1.0, 1.0]
    result = hf_mloss.merge(str(base_dir), [str(model_dirs[1])] * 3, method, progress=False, **kwargs)
    target = load_sd(model_dirs[1])
    got = merged_sd(result)
    for n, t in target.items():
        if t.is_floating_point():
            np.testing.assert_allclose(got[n].numpy(), t.numpy(), atol=ATOL, rtol=0, err_msg=n)


@pytest.fixture(scope="module")
def frozen_models(tiny_models, tmp_path_factory) -> tuple[str, list[str]]:
    """The tiny fine-tunes with every tensor but the last block's fc1 reset to the base (a trained upper part only):
    82 % of each task vector is exactly zero, so a global top-20 % threshold falls among the zeros."""
    from safetensors.torch import save_file

    base_dir, model_dirs = tiny_models
    base = load_sd(base_dir)
    out = []
    for i, folder in enumerate(model_dirs):
        state = load_sd(folder)
        state.update({n: base[n].clone() for n in state if not n.startswith("encoder.layers.1.mlp.fc1.")})
        target = tmp_path_factory.mktemp(f"frozen{i}")
        for f in Path(folder).iterdir():
            if f.name != "model.safetensors":
                (target / f.name).write_bytes(f.read_bytes())
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
        out.append(str(target))
    return str(base_dir), out


@pytest.mark.parametrize(("method", "kwargs"), [("ties", dict(k=0.2)), ("ties", dict(k=0.2, scope="tensor")),
                                                ("task_arithmetic", dict(lam=0.7))])
def test_unchanged_tensors_are_the_base_and_count_in_global_trims(frozen_models, method, kwargs) -> None:
    """Tensors no fine-tune changed are copied from the base, and their zeros still count in a global top-k
    (the threshold then lies among them, so every changed entry is kept), as in the reference."""
    base_dir, models = frozen_models
    base, fts = load_sd(base_dir), [load_sd(m) for m in models]
    names = [n for n, t in base.items() if t.is_floating_point()]
    unchanged = [n for n in names if all(torch.equal(ft[n], base[n]) for ft in fts)]
    assert 0.8 < sum(base[n].numel() for n in unchanged) / sum(base[n].numel() for n in names) < 1
    result = run(frozen_models, method, **kwargs)
    got = merged_sd(result)
    assert all(torch.equal(got[n], base[n].float()) for n in unchanged)
    if method == "ties":
        expected = ref_ties(base, fts, names, scope=kwargs.get("scope", "global"), k=kwargs["k"])
        assert_matches(result, expected)
        if "scope" not in kwargs:  # nothing changed is trimmed: TIES is sign election + disjoint mean here
            assert_matches(result, ref_ties(base, fts, names, scope="tensor", k=1.0))
    else:
        tau = {n: sum(ft[n].double() - base[n].double() for ft in fts) for n in names}
        assert_matches(result, {n: (base[n].double() + 0.7 * tau[n]).numpy() for n in names})


@pytest.mark.parametrize("scope", ["tensor", "global"])
def test_identical_models_ties_equals_single_model_trim(tiny_models, scope) -> None:
    base_dir, model_dirs = tiny_models
    base = load_sd(base_dir)
    ft = load_sd(model_dirs[2])
    names = [n for n, t in base.items() if t.is_floating_point()]
    expected = ref_ties(base, [ft], names, k=0.3, scope=scope)
    result = hf_mloss.merge(str(base_dir), [str(model_dirs[2])] * 3, "ties", progress=False, k=0.3, scope=scope,
                            weights=[1.0, 0.5, 2.0])
    assert_matches(result, expected)


# --------------------------------------------------------------------------------------------------------------------
# M-TIES / M-DARE
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["merged", "base", "own"])
def test_m_ties_e0_equals_tensor_ties(tiny_paths, image_folder, prefix) -> None:
    ties = merged_sd(run(tiny_paths, "ties", k=0.3, scope="tensor"))
    m = run(tiny_paths, "m_ties", k=0.3, e=0.0, prefix=prefix, data=str(image_folder), **IMG)
    got = merged_sd(m)
    for n, t in ties.items():
        assert torch.equal(got[n], t), n


def check_keep_ratios(report, k: float, e: float, names) -> None:
    assert set(report.keep_ratios) == set(names)
    for name in names:
        keep = report.keep_ratios[name]
        node = report.node[name]
        assert keep.shape == node.shape
        assert float(keep.min()) >= k - e - 1e-6 and float(keep.max()) <= k + 1e-6
        np.testing.assert_allclose(keep.double().numpy(), spec_keep_ratios(node, k, e), atol=1e-7, rtol=0)
        # monotone: a node with a higher M-Loss never keeps more
        order = torch.argsort(node.double(), stable=True)
        assert bool((keep[order][1:] <= keep[order][:-1]).all())
        assert float(keep[order][0]) == pytest.approx(k) and float(keep[order][-1]) == pytest.approx(k - e)


def ref_row_thresholds(tau: np.ndarray, counts: list[int]) -> np.ndarray:
    """Per row: the m-th largest |τ| (+inf where m ≤ 0: nothing kept; −inf where m ≥ n_in: everything kept)."""
    out = []
    for row, m in zip(np.abs(tau), counts):
        out.append(math.inf if m <= 0 else -math.inf if m >= row.size else np.sort(row)[::-1][m - 1])
    return np.asarray(out)


def ref_m_merge(base, fts, names, row_keep: dict[str, np.ndarray], *, k: float, other="ties", p=None, seed=0,
                lam=1.0, weights=None) -> dict[str, np.ndarray]:
    """M-TIES/M-DARE reference: fc1 rows keep floor(n_in·keep_i); fc1 bias entry i is kept iff its |τ| reaches the
    threshold of row i of the same task vector's fc1 weight (the node group); other tensors per-tensor trim at k
    (or DARE)."""
    q = len(fts)
    w = np.full(q, 1.0 / q) if weights is None else np.asarray(weights, dtype=np.float64)
    out = {}
    for n in names:
        taus = task_vectors(base, fts, n)
        module = n.rsplit(".", 1)[0]
        if n.endswith(".weight") and module in row_keep:
            n_in = taus.shape[2]
            counts = [math.floor(n_in * float(x)) for x in row_keep[module]]
            trimmed = np.stack([ref_trim_rows(t, counts) for t in taus])
        elif n.endswith(".bias") and module in row_keep:
            weight_taus = task_vectors(base, fts, f"{module}.weight")
            counts = [math.floor(weight_taus.shape[2] * float(x)) for x in row_keep[module]]
            trimmed = np.stack([np.where(np.abs(t) >= ref_row_thresholds(wt, counts), t, 0.0)
                                for t, wt in zip(taus, weight_taus)])
        elif other == "ties":
            trimmed = np.stack([ref_trim_tensor(t, math.floor(t.size * k)) for t in taus])
        else:
            trimmed = np.stack([ref_dare_tau(t, dare_mask(seed, n, i, t.shape, p), p, "inverse")
                                for i, t in enumerate(taus)])
        out[n] = base[n].double().numpy() + lam * ref_elect_merge(trimmed, w)
    return out


@pytest.mark.parametrize("prefix", ["merged", "base", "own"])
def test_m_ties_matches_row_trim_reference(tiny_paths, ckpt, image_folder, prefix) -> None:
    base, fts, names = ckpt
    k, e = 0.5, 0.2
    result = run(tiny_paths, "m_ties", k=k, e=e, prefix=prefix, data=str(image_folder), **IMG)
    report = result.report
    assert report.prefix == prefix
    check_keep_ratios(report, k, e, FC1)
    row_keep = {name: spec_keep_ratios(report.node[name], k, e) for name in FC1}
    assert_matches(result, ref_m_merge(base, fts, names, row_keep, k=k))


def test_m_ties_weights_and_lam(tiny_paths, ckpt, image_folder) -> None:
    base, fts, names = ckpt
    k, e, weights = 0.4, 0.3, [1.0, 0.5, 2.0]
    result = run(tiny_paths, "m_ties", k=k, e=e, lam=0.8, weights=weights, data=str(image_folder), **IMG)
    check_keep_ratios(result.report, k, e, FC1)
    row_keep = {name: spec_keep_ratios(result.report.node[name], k, e) for name in FC1}
    assert_matches(result, ref_m_merge(base, fts, names, row_keep, k=k, lam=0.8, weights=weights))


def test_m_ties_random_rank(tiny_paths, ckpt, image_folder) -> None:
    base, fts, names = ckpt
    k, e = 0.5, 0.2
    common = dict(k=k, e=e, data=str(image_folder), **IMG)
    mloss = run(tiny_paths, "m_ties", **common)
    rand = run(tiny_paths, "m_ties", rank="random", seed=0, **common)
    rand_again = run(tiny_paths, "m_ties", rank="random", seed=0, **common)
    rand_other = run(tiny_paths, "m_ties", rank="random", seed=1, **common)
    for name in FC1:
        a, b = mloss.report.keep_ratios[name], rand.report.keep_ratios[name]
        assert torch.equal(torch.sort(a).values, torch.sort(b).values)  # same set of keep values
        assert not torch.equal(a, b)  # in a different order
        assert torch.equal(b, rand_again.report.keep_ratios[name])
        assert not torch.equal(b, rand_other.report.keep_ratios[name])
        assert float(b.max()) == pytest.approx(k) and float(b.min()) == pytest.approx(k - e)
    # the merge follows the random keep ratios
    row_keep = {name: rand.report.keep_ratios[name].double().numpy() for name in FC1}
    assert_matches(rand, ref_m_merge(base, fts, names, row_keep, k=k))
    sd_m, sd_r = merged_sd(mloss), merged_sd(rand)
    assert not torch.equal(sd_m[FC1[0] + ".weight"], sd_r[FC1[0] + ".weight"])


def test_few_layer_m_ties(tiny_paths, ckpt, image_folder) -> None:
    base, fts, names = ckpt
    k, e = 0.5, 0.2
    result = run(tiny_paths, "m_ties", k=k, e=e, layers=[1], data=str(image_folder), **IMG)
    assert set(result.report.keep_ratios) == {FC1[1]}
    check_keep_ratios(result.report, k, e, [FC1[1]])
    got = merged_sd(result)
    # layer 0's fc1: plain per-tensor TIES trimming at k
    name0 = FC1[0] + ".weight"
    ties = merged_sd(run(tiny_paths, "ties", k=k, scope="tensor"))
    assert torch.equal(got[name0], ties[name0])
    expected0 = ref_ties(base, fts, [name0], k=k, scope="tensor")[name0]
    np.testing.assert_allclose(got[name0].double().numpy(), expected0, atol=ATOL, rtol=0)
    row_keep = {FC1[1]: spec_keep_ratios(result.report.node[FC1[1]], k, e)}
    assert_matches(result, ref_m_merge(base, fts, names, row_keep, k=k))
    assert not torch.equal(got[FC1[1] + ".weight"], ties[FC1[1] + ".weight"])


def test_m_dare_reference_and_seeds(tiny_paths, ckpt, image_folder) -> None:
    base, fts, names = ckpt
    p, e = 0.6, 0.2
    common = dict(p=p, e=e, data=str(image_folder), **IMG)
    a = run(tiny_paths, "m_dare", seed=4, **common)
    b = run(tiny_paths, "m_dare", seed=4, **common)
    c = run(tiny_paths, "m_dare", seed=5, **common)
    sa, sb, sc = merged_sd(a), merged_sd(b), merged_sd(c)
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert any(not torch.equal(sa[n], sc[n]) for n in sa)
    # rows of fc1 keep between p − e and p (k defaults to p); other tensors are DARE-dropped with ×1/p
    check_keep_ratios(a.report, p, e, FC1)
    row_keep = {name: spec_keep_ratios(a.report.node[name], p, e) for name in FC1}
    assert_matches(a, ref_m_merge(base, fts, names, row_keep, k=p, other="dare", p=p, seed=4), atol=2e-6)


def test_m_ties_lowest_loss_row_keeps_floor_nk(tmp_path, image_folder) -> None:
    """SPEC §2–§3: the lowest-M-Loss node keeps fraction k, i.e. m = floor(n_in·k) entries of each task vector row.

    With n_in = 10 and k = 0.7, floor(10·0.7) = 7 (the per-tensor trim keep_count also gives 7 per 10 entries).
    """
    from examples.tiny import make_tiny_setup

    base_dir, model_dirs = make_tiny_setup(tmp_path, q=2, hidden_size=10, intermediate_size=12)
    k, e = 0.7, 0.1
    result = hf_mloss.merge(str(base_dir), [str(m) for m in model_dirs], "m_ties", progress=False, k=k, e=e,
                            data=str(image_folder), **IMG)
    base = load_sd(base_dir)
    fts = [load_sd(m) for m in model_dirs]
    names = [n for n, t in base.items() if t.is_floating_point()]
    row_keep = {name: spec_keep_ratios(result.report.node[name], k, e) for name in FC1}
    lowest = int(torch.argmin(result.report.node[FC1[0]]))
    assert math.floor(10 * row_keep[FC1[0]][lowest]) == 7
    assert_matches(result, ref_m_merge(base, fts, names, row_keep, k=k))


def test_keep_ratio_row_counts_unit() -> None:
    """The same property without a model: keep_ratios_from_scores + trim_rows on one 10-wide row per node."""
    from hf_mloss.methods.mties import keep_ratios_from_scores
    from hf_mloss.methods.ops import trim_rows

    scores = torch.tensor([0.0, 1.0, 2.0, 3.0])
    keep = keep_ratios_from_scores(scores, 0.7, 0.1)
    tau = (torch.arange(40, dtype=torch.float32) + 1).reshape(4, 10)
    counts = (trim_rows(tau, keep) != 0).sum(1).tolist()
    expected = [math.floor(10 * x) for x in spec_keep_ratios(scores, 0.7, 0.1)]  # [7, 6, 6, 6]
    assert counts == expected


# --------------------------------------------------------------------------------------------------------------------
# Parameter validation
# --------------------------------------------------------------------------------------------------------------------

INVALID = [
    ("ties", dict(k=0), "k must be a number in"),
    ("ties", dict(k=1.5), "k must be a number in"),
    ("ties", dict(k=-0.1), "KEPT"),
    ("ties", dict(scope="row"), "scope must be one of"),
    ("ties", dict(convention="foo"), "convention must be one of"),
    ("ties", dict(lam=float("nan")), "lam must be a finite number"),
    ("ties", dict(density=0.2), r"Unknown parameter 'density' \(did you mean 'k'\?\)"),
    ("average", dict(k=0.2), r"Unknown parameter"),
    ("dare_ties", dict(p=0), "p must be a number in"),
    ("dare_linear", dict(p=1.2), "probability of KEEPING"),
    ("dare_ties", dict(rescale="l2"), "rescale must be one of"),
    ("m_ties", dict(k=0.2, e=0.2), "e must satisfy 0 <= e < k"),
    ("m_ties", dict(k=0.2, e=0.5), "e must satisfy"),
    ("m_ties", dict(k=0.2, e=-0.1), "e must be a number >= 0"),
    ("m_ties", dict(k=0.0), "k must be a number in"),
    ("m_ties", dict(rank="magnitude"), "rank must be one of"),
    ("m_ties", dict(prefix="mine"), "prefix must be one of"),
    ("m_ties", dict(layers=[]), "layers must name at least one block"),
    ("m_dare", dict(p=0.5, e=0.5), "e must satisfy"),
    ("m_dare", dict(p=0), "p must be a number in"),
]


@pytest.mark.parametrize(("method", "kwargs", "match"), INVALID,
                         ids=[f"{m}-{'-'.join(map(str, kw))}-{i}" for i, (m, kw, _) in enumerate(INVALID)])
def test_invalid_parameters(tiny_paths, image_folder, method, kwargs, match) -> None:
    extra = dict(data=str(image_folder), **IMG) if method.startswith("m_") else {}
    with pytest.raises(hf_mloss.InvalidParameterError, match=match):
        run(tiny_paths, method, **kwargs, **extra)


def test_invalid_layer_index(tiny_paths, image_folder) -> None:
    with pytest.raises(hf_mloss.InvalidParameterError, match="layers"):
        run(tiny_paths, "m_ties", layers=[5], data=str(image_folder), **IMG)


def test_unknown_method(tiny_paths) -> None:
    with pytest.raises(hf_mloss.UnknownMethodError, match="Unknown merge method 'tie'.*ties"):
        run(tiny_paths, "tie")


@pytest.mark.parametrize(("weights", "match"), [
    ([1.0, 1.0], "Got 2 weights for 3 models"),
    ([1.0, 1.0, 1.0, 1.0], "Got 4 weights for 3 models"),
    ([1.0, -0.5, 1.0], r"models\[1\]\.weight is -0\.5: a negative weight \(task negation\) is taken by "
                       r"task_arithmetic.*'ties' needs weights >= 0"),
    ([1.0, float("inf"), 1.0], r"weights\[1\]"),
    ([0.0, 0.0, 0.0], "must not all be 0"),
])
def test_invalid_weights(tiny_paths, weights, match) -> None:
    with pytest.raises(hf_mloss.InvalidParameterError, match=match):
        run(tiny_paths, "ties", weights=weights)


def test_data_guided_method_needs_data(tiny_paths) -> None:
    with pytest.raises(hf_mloss.DataError, match="data"):
        run(tiny_paths, "m_ties")
