"""SLERP, Model Stock, Model Breadcrumbs and DELLA: hand-computed tensors, then whole merges of tiny CLIP towers.

The whole-model references are written here in numpy (float64 arithmetic on the float32 task vectors), independently
of hf_mloss.methods; only DELLA's random masks are regenerated from the merge's private generators (as DARE's are in
test_methods.py). Parity with mergekit itself is in test_peers.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

import hf_mloss
from hf_mloss import MergeConfig
from hf_mloss.errors import ConfigError, InvalidParameterError
from hf_mloss.methods import MergeContext, get_method
from hf_mloss.methods.breadcrumbs import breadcrumbs_keep_range, combine_task_vectors, drop_outliers
from hf_mloss.methods.della import keep_probabilities, magprune
from hf_mloss.methods.model_stock import interpolation_ratio
from hf_mloss.methods.ops import tensor_seed
from hf_mloss.methods.slerp import DOT_THRESHOLD, slerp
from hf_mloss.spec.schedule import ParamSchedule, interpolate, layer_position

ATOL = 1e-6
T = torch.tensor


def close(a: torch.Tensor, b, atol: float = 1e-6) -> bool:
    return torch.allclose(a.double(), torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------------------------------
# SLERP on known angles
# --------------------------------------------------------------------------------------------------------------------


def test_slerp_endpoints_and_midpoints_on_known_angles() -> None:
    a, b = T([2.0, 0.0]), T([0.0, 3.0])  # 90°: sin(Ω/2)/sin Ω = √½ on each side, norms kept as they are
    assert torch.equal(slerp(0.0, a, b), a)
    assert close(slerp(1.0, a, b), b)
    assert close(slerp(0.5, a, b), [2 * math.sqrt(0.5), 3 * math.sqrt(0.5)])
    # 60° between unit vectors: t = 1/2 lands at 30°, t = 1/4 at 15° (on the arc, not the chord)
    u, v = T([1.0, 0.0]), T([0.5, math.sqrt(3) / 2])
    assert close(slerp(0.5, u, v), [math.cos(math.pi / 6), math.sin(math.pi / 6)])
    assert close(slerp(0.25, u, v), [math.cos(math.pi / 12), math.sin(math.pi / 12)])
    # a matrix is one vector: the same angle whatever its shape
    assert close(slerp(0.25, u.reshape(2, 1), v.reshape(2, 1)).reshape(-1), slerp(0.25, u, v))


def test_slerp_falls_back_to_lerp_when_nearly_parallel() -> None:
    a = T([1.0, 0.0])
    parallel = T([1.0, 0.01])  # cos Ω = 0.99995 > 0.9995: linear interpolation, exactly
    assert 1 / math.sqrt(1.0001) > DOT_THRESHOLD
    assert torch.equal(slerp(0.3, a, parallel), (1 - T(0.3)) * a + T(0.3) * parallel)
    just_below = T([1.0, 0.04])  # cos Ω = 0.9992: still spherical, and not equal to the chord
    omega = math.acos(1 / math.sqrt(1.0016))
    expected = (math.sin(0.7 * omega) * np.array([1.0, 0.0]) + math.sin(0.3 * omega) * np.array([1.0, 0.04])) \
        / math.sin(omega)
    assert close(slerp(0.3, a, just_below), expected)
    assert not close(slerp(0.3, a, just_below), (0.7 * a + 0.3 * just_below), atol=1e-9)
    antipodal = T([-1.0, 0.0])  # cos Ω = −1: linear too (mergekit's rule), the midpoint is 0
    assert close(slerp(0.5, a, antipodal), [0.0, 0.0])


def test_slerp_zero_tensor_is_taken_as_orthogonal() -> None:
    # mergekit leaves a zero norm as 1, so the cosine is 0 and Ω = π/2: the other side gets sin(tπ/2), not t
    zero, b = torch.zeros(3), T([1.0, 2.0, 2.0])
    assert close(slerp(0.25, zero, b), math.sin(0.25 * math.pi / 2) * b)


# --------------------------------------------------------------------------------------------------------------------
# Model Stock's ratio on known cosines
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("offsets", "ratio"), [
    ([[1.0, 0.0], [0.0, 1.0]], 0.0),                            # orthogonal: the base
    ([[1.0, 0.0], [2.0, 0.0]], 1.0),                            # parallel: the average
    ([[1.0, 0.0], [0.5, math.sqrt(3) / 2]], 2 / 3),             # 60°: 2c/(1+c) = 2/3
    ([[1, 1, 0], [1, 0, 1], [0, 1, 1]], 0.75),                  # N=3, every cos 1/2: 3c/(1+2c) = 3/4
    ([[1.0, 0.0], [-1.0, 0.0]], 0.0),                           # 1+(N−1)c = 0: no finite ratio, the base
], ids=["orthogonal", "parallel", "60deg", "three-at-60deg", "singular"])
def test_model_stock_ratio(offsets, ratio) -> None:
    base = T([0.5, -1.0, 2.0][: len(offsets[0])])
    sources = [base + T(o, dtype=torch.float32) for o in offsets]
    assert close(interpolation_ratio(base, sources).reshape(()), ratio)
    ctx = MergeContext(params=get_method("model_stock").make_params(), weights=torch.full((len(sources),), 0.5))
    merged = get_method("model_stock").merge_tensor("w", base, sources, ctx)
    assert close(merged, base + ratio * (sum(sources) / len(sources) - base))


def test_model_stock_filter_wise_gives_each_row_its_ratio() -> None:
    base = torch.zeros(2, 2)
    first, second = T([[1.0, 0.0], [1.0, 0.0]]), T([[2.0, 0.0], [0.0, 1.0]])  # row 0 parallel, row 1 orthogonal
    per_row = interpolation_ratio(base, [first, second], filter_wise=True)
    assert close(per_row.reshape(-1), [1.0, 0.0])
    whole = interpolation_ratio(base, [first, second]).item()  # one cosine over the flattened tensors: 2/√5/√2
    c = 2 / (math.sqrt(5) * math.sqrt(2))
    assert math.isclose(whole, 2 * c / (1 + c), rel_tol=1e-6)
    ctx = MergeContext(params=get_method("model_stock").make_params(filter_wise=True), weights=torch.ones(2))
    merged = get_method("model_stock").merge_tensor("w", base, [first, second], ctx)
    assert close(merged, [[1.5, 0.0], [0.0, 0.0]])
    bias = interpolation_ratio(torch.zeros(2), [T([1.0, 0.0]), T([0.0, 1.0])], filter_wise=True)
    assert bias.shape == (1, 1) and bias.item() == 0.0  # a 1-D tensor is one row


# --------------------------------------------------------------------------------------------------------------------
# Breadcrumbs' kept set and the task-vector combine
# --------------------------------------------------------------------------------------------------------------------

TAU = T([0.1, -0.9, 0.5, 0.3, -0.7, 0.2, 0.05, 1.0, -0.4, 0.6])


@pytest.mark.parametrize(("k", "gamma", "kept"), [
    (0.5, 0.1, [-0.9, 0.5, -0.7, -0.4, 0.6]),                    # top 1 (1.0) dropped, then the 5 next largest
    (0.5, 0.0, [-0.9, 0.5, -0.7, 1.0, 0.6]),                     # no outliers: plain top-5
    (0.8, 0.3, [0.1, 0.5, 0.3, -0.7, 0.2, 0.05, -0.4, 0.6]),     # 8 kept leave room for 2 outliers only, not 3
    (0.3, 0.25, [0.5, -0.7, 0.6]),                                # floor(2.5)=2 outliers (1.0, −0.9), then 3
    (1.0, 0.1, TAU.tolist()),                                    # k = 1 keeps everything, outliers included
], ids=["k.5-g.1", "k.5-g0", "room-for-2", "floor", "whole"])
def test_breadcrumbs_kept_set(k, gamma, kept) -> None:
    out = drop_outliers(TAU.clone(), k, gamma)
    assert sorted(out[out != 0].tolist()) == sorted(T(kept).tolist())
    assert torch.equal(out[out != 0], TAU[out != 0])  # kept entries untouched
    assert breadcrumbs_keep_range(10, k, gamma)[1] - breadcrumbs_keep_range(10, k, gamma)[0] == int(k * 10)


def test_breadcrumbs_l1_rescale_and_matrix() -> None:
    out = drop_outliers(TAU.clone(), 0.5, 0.1, rescale="l1")
    assert math.isclose(float(out.abs().sum()), float(TAU.abs().sum()), rel_tol=1e-6)
    assert torch.equal(out != 0, drop_outliers(TAU.clone(), 0.5, 0.1) != 0)
    # a matrix is ranked as one tensor, not per row
    matrix = drop_outliers(TAU.reshape(2, 5).clone(), 0.5, 0.1)
    assert torch.equal(matrix.reshape(-1), drop_outliers(TAU.clone(), 0.5, 0.1))


def test_combine_sum_and_ties_consensus_by_hand() -> None:
    taus = [T([1.0, -2.0, 0.0]), T([-3.0, 1.0, 0.0])]
    w = T([2.0, 1.0], dtype=torch.float64)
    # weighted deltas [2, −4, 0] and [−3, 1, 0]: sums [−1, −3, 0] elect [−, −, +]
    assert close(combine_task_vectors(taus, w, consensus=True, normalize=False, lam=1.0), [-3.0, -4.0, 0.0])
    assert close(combine_task_vectors(taus, w, consensus=True, normalize=True, lam=1.0), [-3.0, -2.0, 0.0])
    assert close(combine_task_vectors(taus, w, consensus=True, normalize=True, lam=0.5), [-1.5, -1.0, 0.0])
    assert close(combine_task_vectors(taus, w, consensus=False, normalize=False, lam=1.0), [-1.0, -3.0, 0.0])
    assert close(combine_task_vectors(taus, w, consensus=False, normalize=True, lam=1.0), [-1 / 3, -1.0, 0.0])


# --------------------------------------------------------------------------------------------------------------------
# DELLA: keep probabilities by rank, seeding, and the distribution of the masks
# --------------------------------------------------------------------------------------------------------------------


def test_della_keep_probabilities_by_rank() -> None:
    row = T([[0.3, -0.1, 0.4, 0.2, -0.5]])  # ranks by |τ|: 2, 0, 3, 1, 4 of n = 5
    assert close(keep_probabilities(row.abs(), 0.5, 0.2), [[0.5, 0.3, 0.6, 0.4, 0.7]])
    two_rows = T([[1.0, 2.0], [2.0, 1.0]])  # each row ranked on its own
    assert close(keep_probabilities(two_rows, 0.5, 0.1), [[0.4, 0.6], [0.6, 0.4]])
    assert close(keep_probabilities(T([[3.0], [1.0]]), 0.5, 0.1), [[0.5], [0.5]])  # a row of one entry: k


def test_della_rescaling_and_whole_task_vector() -> None:
    tau = torch.linspace(-1, 1, 64).reshape(4, 16)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(magprune(tau, 1.0, 0.2, g), tau)
    l1 = magprune(tau, 0.5, 0.2, torch.Generator().manual_seed(1), rescale="l1")
    assert math.isclose(float(l1.abs().sum()), float(tau.abs().sum()), rel_tol=1e-5)
    none = magprune(tau, 0.5, 0.2, torch.Generator().manual_seed(1), rescale="none")
    inverse = magprune(tau, 0.5, 0.2, torch.Generator().manual_seed(1), rescale="inverse")
    assert torch.equal(none != 0, inverse != 0) and torch.equal(none != 0, l1 != 0)  # one mask, three scalings
    assert close(inverse, none / keep_probabilities(tau.abs(), 0.5, 0.2))


def test_della_keep_frequencies_follow_the_ranks() -> None:
    """Over many draws each rank is kept at its probability, and the inverse-rescaled mask is unbiased."""
    n, rows, draws = 11, 64, 200
    tau = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(r)).float() + 1 for r in range(rows)])
    probs = keep_probabilities(tau.abs(), 0.5, 0.2)
    kept = torch.zeros_like(tau)
    total = torch.zeros_like(tau)
    for seed in range(draws):
        out = magprune(tau, 0.5, 0.2, torch.Generator().manual_seed(seed), rescale="inverse")
        kept += out != 0
        total += out
    samples = rows * draws
    rank_of = (tau - 1).long()  # the values are 1..n, so |τ| − 1 is the rank
    for r in range(n):
        p = 0.3 + 0.4 * r / (n - 1)
        freq = float(kept[rank_of == r].sum()) / samples
        assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / samples), (r, freq, p)
        # inverse rescaling makes each entry unbiased: E[mask/p] = 1, with variance (1 − p)/p per draw
        scale = float((total / tau)[rank_of == r].sum()) / samples
        assert abs(scale - 1) < 5 * math.sqrt((1 - p) / p / samples), (r, scale)
    assert torch.allclose(probs.mean(dim=1), torch.full((rows,), 0.5))


def test_della_params_refuse_probabilities_outside_0_1() -> None:
    with pytest.raises(InvalidParameterError, match=r"k ± e must lie in \(0, 1\)"):
        get_method("della").make_params(k=0.9, e=0.15)
    with pytest.raises(InvalidParameterError, match=r"k ± e"):
        get_method("della_linear").make_params(k=0.1, e=0.1)
    assert get_method("della").make_params(k=1.0, e=0.5).k == 1.0  # k = 1 draws nothing
    assert get_method("della").make_params().normalize and not get_method("della_linear").make_params().normalize


# --------------------------------------------------------------------------------------------------------------------
# Whole merges of tiny CLIP towers against numpy references
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tiny_models):
    base_dir, model_dirs = tiny_models
    base = load_file(str(Path(base_dir) / "model.safetensors"))
    fts = [load_file(str(Path(m) / "model.safetensors")) for m in model_dirs]
    return base, fts, [n for n, t in base.items() if t.is_floating_point()]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.float().double().numpy()


def taus_of(base, fts, name) -> np.ndarray:
    return np.stack([(ft[name].float() - base[name].float()).double().numpy() for ft in fts])


def ref_slerp(a: np.ndarray, b: np.ndarray, t: float) -> np.ndarray:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    dot = np.clip(np.sum((a / (na if na > 1e-8 else 1)) * (b / (nb if nb > 1e-8 else 1))), -1, 1)
    if abs(dot) > 0.9995:
        return (1 - t) * a + t * b
    omega = math.acos(dot)
    return (math.sin((1 - t) * omega) * a + math.sin(t * omega) * b) / math.sin(omega)


def ref_model_stock(w0: np.ndarray, ws: list[np.ndarray], filter_wise: bool) -> np.ndarray:
    shape = w0.shape
    if filter_wise:
        w0, ws = (w0[None], [w[None] for w in ws]) if w0.ndim == 1 else (w0, ws)
    else:
        w0, ws = w0.reshape(-1), [w.reshape(-1) for w in ws]
    offsets = [w - w0 for w in ws]
    cos = np.mean([np.clip((a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1),
                                                        1e-6), -1, 1)
                   for i, a in enumerate(offsets) for b in offsets[i + 1:]], axis=0)[..., None]
    n = len(ws)
    t = np.where(np.abs(1 + (n - 1) * cos) < 1e-6, 0.0, n * cos / (1 + (n - 1) * cos))
    return (t * (sum(ws) / n) + (1 - t) * w0).reshape(shape)


def ref_combine(taus: np.ndarray, w: np.ndarray, consensus: bool, normalize: bool, lam: float) -> np.ndarray:
    wb = w.reshape(-1, *([1] * (taus.ndim - 1)))
    d = taus * wb
    if consensus:
        agree = np.sign(d) == np.where(d.sum(0) >= 0, 1.0, -1.0)
        mixed, divisor = (d * agree).sum(0), (wb * agree).sum(0)
        divisor = np.where(divisor == 0, 1.0, divisor)
    else:
        mixed, divisor = d.sum(0), np.full(taus.shape[1:], w.sum() if abs(w.sum()) >= 1e-8 else 1.0)
    return lam * (mixed / divisor if normalize else mixed)


def ref_breadcrumbs(tau: np.ndarray, k: float, gamma: float) -> np.ndarray:
    n = tau.size
    kept, top = int(k * n), int(gamma * n)
    start = max(0, n - kept - top)
    mask = np.zeros(n, dtype=bool)
    mask[np.argsort(np.abs(tau).reshape(-1), kind="stable")[start:start + kept]] = True
    return np.where(mask.reshape(tau.shape), tau, 0.0)


def ref_della(tau: np.ndarray, k: float, e: float, seed: int, name: str, index: int, rescale: str) -> np.ndarray:
    rows = tau if tau.ndim >= 2 else tau[None]
    n = rows.shape[1]
    ranks = np.argsort(np.argsort(np.abs(rows), axis=1, kind="stable"), axis=1, kind="stable")
    probs = (k - e) + 2 * e * ranks / (n - 1) if n > 1 else np.full(rows.shape, k)
    g = torch.Generator().manual_seed(tensor_seed(seed, name, index))
    mask = torch.rand(rows.shape, generator=g).double().numpy() < probs
    kept = np.where(mask, rows, 0.0)
    if rescale == "inverse":
        kept = kept / probs
    elif rescale == "l1":
        kept = kept * (np.abs(tau).sum() / np.abs(kept).sum())
    return kept.reshape(tau.shape)


def assert_matches(result, expected: dict[str, np.ndarray], atol: float = ATOL) -> None:
    got = {k: v.detach().float() for k, v in result.model.state_dict().items()}
    assert set(expected) <= set(got)
    for name, ref in expected.items():
        np.testing.assert_allclose(got[name].double().numpy(), ref, atol=atol, rtol=0, err_msg=name)


def merge(paths, method, models=None, **kwargs):
    base, all_models = paths
    return hf_mloss.merge(base, all_models if models is None else models, method, progress=False, **kwargs)


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0])
def test_slerp_whole_model(tiny_paths, ckpt, t) -> None:
    base, fts, names = ckpt
    result = merge(tiny_paths, "slerp", tiny_paths[1][:1], t=t)
    assert_matches(result, {n: ref_slerp(_np(base[n]), _np(fts[0][n]), t) for n in names})
    if t == 0.0:
        assert all(torch.equal(result.model.state_dict()[n], base[n]) for n in names)
    assert result.config.parameters == {"t": t} and result.config.method == "slerp"


def test_slerp_whole_model_takes_the_spherical_branch(tmp_path) -> None:
    """Far-apart "fine-tunes" (a different random init) put every tensor below the parallel threshold."""
    from examples.tiny import make_base, save_model

    a, b = save_model(make_base(1), tmp_path / "a"), save_model(make_base(2), tmp_path / "b")
    sd_a, sd_b = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    weights = [n for n, v in sd_a.items() if v.is_floating_point() and v.dim() == 2]
    cosines = [float(torch.nn.functional.cosine_similarity(sd_a[n].reshape(-1), sd_b[n].reshape(-1), dim=0))
               for n in weights]
    assert max(abs(c) for c in cosines) < DOT_THRESHOLD
    result = hf_mloss.merge(str(a), [str(b)], "slerp", t=0.4, progress=False)
    assert_matches(result, {n: ref_slerp(_np(sd_a[n]), _np(sd_b[n]), 0.4) for n in weights}, atol=2e-6)


@pytest.mark.parametrize("filter_wise", [False, True])
def test_model_stock_whole_model(tiny_paths, ckpt, filter_wise) -> None:
    base, fts, names = ckpt
    result = merge(tiny_paths, "model_stock", filter_wise=filter_wise)
    assert_matches(result, {n: ref_model_stock(_np(base[n]), [_np(f[n]) for f in fts], filter_wise) for n in names})


@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs_ties"])
@pytest.mark.parametrize("normalize", [False, True])
def test_breadcrumbs_whole_model(tiny_paths, ckpt, method, normalize) -> None:
    base, fts, names = ckpt
    w = np.array([1.0, 0.5, 2.0])
    result = merge(tiny_paths, method, k=0.6, gamma=0.05, lam=0.7, normalize=normalize, weights=w.tolist())
    expected = {}
    for n in names:
        taus = np.stack([ref_breadcrumbs(t, 0.6, 0.05) for t in taus_of(base, fts, n)])
        expected[n] = _np(base[n]) + ref_combine(taus, w, method.endswith("ties"), normalize, 0.7)
    assert_matches(result, expected)


@pytest.mark.parametrize("method", ["della", "della_linear"])
@pytest.mark.parametrize("rescale", ["inverse", "l1", "none"])
def test_della_whole_model_matches_regenerated_masks(tiny_paths, ckpt, method, rescale) -> None:
    base, fts, names = ckpt
    w = np.array([1.0, 0.5, 2.0])
    result = merge(tiny_paths, method, k=0.6, e=0.2, lam=0.8, rescale=rescale, weights=w.tolist(), seed=11)
    expected = {}
    for n in names:
        taus = np.stack([ref_della(t, 0.6, 0.2, 11, n, i, rescale) for i, t in enumerate(taus_of(base, fts, n))])
        expected[n] = _np(base[n]) + ref_combine(taus, w, method == "della", method == "della", 0.8)
    assert_matches(result, expected, atol=2e-6)


@pytest.mark.parametrize("method", ["della", "della_linear"])
def test_della_seeded(tiny_paths, method) -> None:
    a, b, c = (merge(tiny_paths, method, k=0.5, seed=s).model.state_dict() for s in (1, 1, 2))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a)


@pytest.mark.parametrize(("method", "kwargs"), [
    ("slerp", {"t": 0.5}), ("model_stock", {}), ("breadcrumbs", {"k": 0.5}), ("breadcrumbs_ties", {"k": 0.5}),
    ("della", {"k": 0.5}), ("della_linear", {"k": 0.5}),
])
def test_identical_models_merge_to_themselves(tiny_models, method, kwargs) -> None:
    """Sources equal to the base: every task vector is 0, so the merge is the base (slerp: its own endpoint)."""
    base_dir, _ = tiny_models
    result = hf_mloss.merge(str(base_dir), [str(base_dir)] * (1 if method == "slerp" else 2), method, progress=False,
                            **kwargs)
    base = load_file(str(Path(base_dir) / "model.safetensors"))
    for name, tensor in result.model.state_dict().items():
        assert torch.allclose(tensor, base[name], atol=1e-7, rtol=0), name


# --------------------------------------------------------------------------------------------------------------------
# Configs: ours (dict / YAML) and mergekit's
# --------------------------------------------------------------------------------------------------------------------


def test_config_dict_and_yaml_round_trip(tiny_paths, tmp_path) -> None:
    base, models = tiny_paths
    direct = merge(tiny_paths, "breadcrumbs_ties", k=0.6, gamma=0.05, weights=[1.0, 0.5, 2.0])
    config = MergeConfig.from_dict({"base": base, "models": [{"model": m, "weight": w} for m, w in
                                                            zip(models, [1.0, 0.5, 2.0])],
                                    "method": "breadcrumbs_ties", "parameters": {"k": 0.6, "gamma": 0.05}})
    via_dict = hf_mloss.run(config, progress=False)
    path = tmp_path / "merge.yaml"
    direct.config.to_yaml(path)
    via_yaml = hf_mloss.run(MergeConfig.from_yaml(path), progress=False)
    for result in (via_dict, via_yaml):
        assert all(torch.equal(v, direct.model.state_dict()[k]) for k, v in result.model.state_dict().items())
    saved = yaml.safe_load(path.read_text())
    assert saved["method"] == "breadcrumbs_ties"
    assert saved["parameters"] == {"k": 0.6, "gamma": 0.05}


def test_saved_merge_records_method_and_card_cites_paper(tiny_paths, tmp_path) -> None:
    result = merge(tiny_paths, "della", k=0.5, e=0.1, seed=3)
    out = result.save_pretrained(tmp_path / "merged")
    card = (Path(out) / "README.md").read_text()
    assert "2406.11617" in card and "DELLA" in card
    again = hf_mloss.run(MergeConfig.from_pretrained(out), progress=False)
    assert all(torch.equal(v, result.model.state_dict()[k]) for k, v in again.model.state_dict().items())


def mk(method: str, base: str, models: list, parameters: dict | None = None, **extra) -> dict:
    config = {"merge_method": method, "base_model": base, "models": models, "dtype": "float32", **extra}
    if parameters is not None:
        config["parameters"] = parameters
    return config


def test_mergekit_slerp_yaml_maps(tiny_paths) -> None:
    base, models = tiny_paths
    config = MergeConfig.from_dict(mk("slerp", base, [{"model": base}, {"model": models[0]}], {"t": 0.3}))
    assert (config.method, config.parameters, [m.model for m in config.models]) == ("slerp", {"t": 0.3}, [models[0]])
    with pytest.raises(ConfigError, match="exactly one other model"):
        MergeConfig.from_dict(mk("slerp", base, [{"model": m} for m in models[:2]], {"t": 0.3}))
    with pytest.raises(ConfigError, match=r"needs `parameters: \{t: \.\.\.\}`"):
        MergeConfig.from_dict(mk("slerp", base, [{"model": models[0]}]))
    with pytest.raises(ConfigError, match="parameters.t must be a number, a gradient or a filter list"):
        MergeConfig.from_dict(mk("slerp", base, [{"model": models[0]}], {"t": "half"}))
    with pytest.raises(ConfigError, match="end the list with a `{value: ...}` entry without filter"):
        MergeConfig.from_dict(mk("slerp", base, [{"model": models[0]}], {"t": [{"filter": "mlp", "value": 1}]}))
    with pytest.raises(ConfigError, match="shared: give it under the top-level `parameters`"):
        MergeConfig.from_dict(mk("slerp", base, [{"model": models[0], "parameters": {"t": 0.5}}]))


def test_mergekit_task_vector_recipes_map(tiny_paths) -> None:
    base, models = tiny_paths
    entries = [{"model": base}] + [{"model": m, "parameters": {"weight": w, "density": 0.5}}
                                   for m, w in zip(models, [1.0, 0.5, 2.0])]
    config = MergeConfig.from_dict(mk("della", base, entries, {"epsilon": 0.1, "lambda": 0.9, "int8_mask": True}))
    assert config.parameters == {"k": 0.5, "e": 0.1, "lam": 0.9, "normalize": True, "rescale": "l1"}
    assert config.weights == [1.0, 0.5, 2.0] and len(config.models) == 3
    config = MergeConfig.from_dict(mk("breadcrumbs", base, entries[1:], {"gamma": 0.02, "rescale": True}))
    assert config.parameters == {"k": 0.5, "gamma": 0.02, "lam": 1.0, "normalize": False, "rescale": "l1"}
    # mergekit's defaults when a parameter is absent: density 1, gamma 0.01, epsilon 0.15 (weight has none: required)
    config = MergeConfig.from_dict(mk("della_linear", base, [{"model": m} for m in models], {"weight": 1.0}))
    assert config.parameters == {"k": 1.0, "e": 0.15, "lam": 1.0, "normalize": False, "rescale": "l1"}
    assert config.weights == [1.0, 1.0, 1.0]
    config = MergeConfig.from_dict(mk("model_stock", base, [{"model": m} for m in [base, *models]],
                                      {"filter_wise": True}))
    assert (config.method, config.parameters, len(config.models)) == ("model_stock", {"filter_wise": True}, 3)


REFUSED = [
    (lambda b, m: {"merge_method": "della", "models": [{"model": m[0]}]}, "needs a `base_model`"),
    (lambda b, m: mk("della", b, [{"model": m[0]}], {"gamma": 0.1}), "has no parameter 'gamma'"),
    (lambda b, m: mk("della", b, [{"model": m[0], "parameters": {"density": 0.5, "weight": 1.0}},
                                  {"model": m[1], "parameters": {"density": 0.1, "weight": 1.0}}]),
     r"models\[1\].parameters.k names 0.1: k ± e must lie in \(0, 1\)"),
    (lambda b, m: mk("breadcrumbs", b, [{"model": m[0], "parameters": {"weight": 1.0}}], {"normalize": "yes"}),
     "parameters.normalize must be true or false"),
    (lambda b, m: mk("breadcrumbs", b, [{"model": m[0]}]), r"models\[0\].parameters.weight is missing"),
    (lambda b, m: mk("breadcrumbs_ties", b, [{"model": m[0], "parameters": {"weight": [{"filter": "mlp",
                                                                                    "value": 1}]}}]),
     "end the list with a `{value: ...}` entry without filter"),
    (lambda b, m: mk("model_stock", b, [{"model": b}, {"model": m[0]}]), "at least 2 models besides"),
    (lambda b, m: mk("model_stock", b, [{"model": m[0], "parameters": {"weight": 1}}, {"model": m[1]}]),
     r"parameters \['weight'\] have no hf_mloss equivalent"),
]


@pytest.mark.parametrize(("build", "match"), REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_mergekit_recipe_refusals(tiny_paths, build, match) -> None:
    with pytest.raises(ConfigError, match=match):
        MergeConfig.from_dict(build(*tiny_paths))


def test_method_level_refusals(tiny_paths) -> None:
    with pytest.raises(InvalidParameterError, match="exactly one other model"):
        merge(tiny_paths, "slerp")
    with pytest.raises(InvalidParameterError, match="slerp takes no weight"):
        merge(tiny_paths, "slerp", tiny_paths[1][:1], weights=[0.5])
    with pytest.raises(InvalidParameterError, match="at least 2 fine-tuned models"):
        merge(tiny_paths, "model_stock", tiny_paths[1][:1])
    with pytest.raises(InvalidParameterError, match="model_stock takes no weights"):
        merge(tiny_paths, "model_stock", weights=[1.0, 2.0, 1.0])
    with pytest.raises(InvalidParameterError, match="gamma must be"):
        merge(tiny_paths, "breadcrumbs", gamma=1.0)
    with pytest.raises(InvalidParameterError, match="rescale must be one of"):
        merge(tiny_paths, "breadcrumbs", rescale="inverse")


# --------------------------------------------------------------------------------------------------------------------
# Parameters that vary over the model: gradients and filter lists (mergekit's definition)
# --------------------------------------------------------------------------------------------------------------------

NAME = "encoder.layers.{}.self_attn.q_proj.weight"


def test_gradient_interpolates_over_the_blocks_as_mergekit() -> None:
    gradient = ParamSchedule.parse([0, 0.5, 0.3, 0.7, 1], "t")
    # 9 blocks: block i at x = i/8, i.e. x·4 = i/2 on the 5 values: halfway points average their neighbours
    got = [gradient.resolve(NAME.format(i), layer_position(i, 9)) for i in range(9)]
    assert got == pytest.approx([0, 0.25, 0.5, 0.4, 0.3, 0.5, 0.7, 0.85, 1.0])
    assert [layer_position(s, 4) for s in (-1, 0, 1, 2, 3, 4)] == [0, 0, 1 / 3, 2 / 3, 1, 0]  # outside blocks: 0
    assert layer_position(0, 1) == 1.0  # one block sits at the end of the gradient (mergekit's t = 1)
    assert interpolate((True, False), 0.99) is True and interpolate((True, False), 1.0) is False  # picked, not mixed


def test_filter_list_first_match_wins_and_unmatched_is_default() -> None:
    schedule = ParamSchedule.parse([{"filter": "self_attn", "value": [0, 1]}, {"filter": "mlp", "value": 0.3},
                                    {"filter": "q_proj", "value": 0.9}, {"value": 0.5}], "t")
    assert schedule.resolve(NAME.format(1), 1.0) == 1.0  # self_attn comes before q_proj
    assert schedule.resolve("encoder.layers.0.mlp.fc1.weight", 0.0) == 0.3
    assert schedule.resolve("post_layernorm.weight", 0.0) == 0.5
    assert ParamSchedule.parse({"filter": "mlp", "value": 2}, "t").resolve("embeddings.patch", 0) is None
    assert ParamSchedule.parse([{"filter": "*", "value": 2}], "t").resolve("anything", 0) == 2
    assert schedule.to_plain() == [{"filter": "self_attn", "value": [0, 1]}, {"filter": "mlp", "value": 0.3},
                                   {"filter": "q_proj", "value": 0.9}, {"value": 0.5}]
    assert schedule.describe() == ("self_attn: 0 → 1 over the blocks; mlp: 0.3; q_proj: 0.9; elsewhere: 0.5")


@pytest.mark.parametrize(("value", "match"), [
    ([], "must be a value, a gradient"),
    ([0.1, "x"], "numbers only"),
    ([{"filter": "mlp"}], r"t\[0\] must be \{filter"),
    ([{"filter": "", "value": 1}], r"t\[0\].filter must be a non-empty string"),
    ([{"value": [[1]]}], r"t\[0\].value must be a value"),
])
def test_schedule_refusals(value, match) -> None:
    with pytest.raises(InvalidParameterError, match=match):
        ParamSchedule.parse(value, "t")


def test_ties_gradient_and_filter_equal_per_tensor_scalar_merges(tiny_paths) -> None:
    """A k gradient over the 2 blocks and a lam filter give, tensor by tensor, the merge with those scalars."""
    schedules = {"k": [0.2, 0.8], "lam": [{"filter": "mlp", "value": 0.5}, {"value": 1.0}]}
    result = merge(tiny_paths, "ties", scope="tensor", **schedules)
    got = result.model.state_dict()
    scalar = {(k, lam): merge(tiny_paths, "ties", scope="tensor", k=k, lam=lam).model.state_dict()
              for k in (0.2, 0.8) for lam in (0.5, 1.0)}
    seen = set()
    for name, tensor in got.items():
        if not tensor.is_floating_point():
            continue
        k = 0.8 if name.startswith("encoder.layers.1.") else 0.2  # outside the blocks: the gradient's start
        lam = 0.5 if "mlp" in name else 1.0
        assert torch.equal(tensor, scalar[(k, lam)][name]), name
        assert result.config.resolved_parameters[name] == {"k": k, "lam": lam}
        seen.add((k, lam))
    assert seen == set(scalar)
    assert result.params["k"] == [0.2, 0.8] and result.config.parameters == {**schedules, "scope": "tensor"}


def test_schedules_are_recorded_shown_and_rerun(tiny_paths, tmp_path) -> None:
    result = merge(tiny_paths, "della", k=[0.4, 0.6], e=[{"filter": "self_attn", "value": 0.05}, {"value": 0.2}],
                   seed=2)
    out = result.save_pretrained(tmp_path / "merged")
    saved = yaml.safe_load((Path(out) / "hf_mloss_config.yaml").read_text())
    assert saved["parameters"]["k"] == [0.4, 0.6]
    assert saved["resolved_parameters"]["encoder.layers.1.self_attn.q_proj.weight"] == {"k": 0.6, "e": 0.05}
    assert saved["resolved_parameters"]["embeddings.patch_embedding.weight"] == {"k": 0.4, "e": 0.2}
    card = (Path(out) / "README.md").read_text()
    assert "0.4 → 0.6 over the blocks" in card and "self_attn: 0.05; elsewhere: 0.2" in card
    again = hf_mloss.run(MergeConfig.from_pretrained(out), progress=False)
    assert all(torch.equal(v, result.model.state_dict()[k]) for k, v in again.model.state_dict().items())


def test_schedule_refused_where_it_cannot_apply(tiny_paths, image_folder) -> None:
    with pytest.raises(InvalidParameterError, match="scope is global"):
        merge(tiny_paths, "ties", k=[0.2, 0.5])
    with pytest.raises(InvalidParameterError, match=r"parameters.k names 1.5"):
        merge(tiny_paths, "ties", scope="tensor", k=[0.2, 1.5])
    with pytest.raises(InvalidParameterError, match="data-guided method 'm_ties'"):
        merge(tiny_paths, "m_ties", k=[0.2, 0.4], data=str(image_folder), num_samples=8, batch_size=4)
    with pytest.raises(InvalidParameterError, match="Label-free selection chooses one value per parameter"):
        merge(tiny_paths, "ties", scope="tensor", k=[0.2, 0.5], data=str(image_folder), num_samples=8, batch_size=4,
              select="unlabeled", grid={"lam": [0.5, 1.0]})
    with pytest.raises(InvalidParameterError, match="At tensor .* the schedules give"):
        merge(tiny_paths, "della", k=[0.5, 0.2], e=[0.1, 0.25])  # each value valid, k − e < 0 at the last block


def test_mergekit_gradients_and_filters_map(tiny_paths) -> None:
    base, models = tiny_paths
    t = [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]}, {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
         {"value": 0.5}]
    config = MergeConfig.from_dict(mk("slerp", base, [{"model": base}, {"model": models[0]}], {"t": t}))
    assert config.parameters == {"t": [{"filter": "self_attn", "value": [0.0, 0.5, 0.3, 0.7, 1.0]},
                                       {"filter": "mlp", "value": [1.0, 0.5, 0.7, 0.3, 0.0]}, {"value": 0.5}]}
    entries = [{"model": m, "parameters": {"weight": 1.0, "density": [0.2, 0.8]}} for m in models]
    config = MergeConfig.from_dict(mk("ties", base, entries, {"lambda": [{"filter": "mlp", "value": 0.5},
                                                                         {"value": 1}]}))
    assert config.parameters["k"] == [0.2, 0.8] and config.parameters["lam"][0] == {"filter": "mlp", "value": 0.5}
    config = MergeConfig.from_dict(mk("breadcrumbs", base, entries, {"rescale": [{"filter": "mlp", "value": True},
                                                                                {"value": False}]}))
    assert config.parameters["rescale"] == [{"filter": "mlp", "value": "l1"}, {"value": "none"}]
    # per-model values that differ, and weights that vary over the model: each model's own parameters
    differing = [{"model": models[0], "parameters": {"density": [0.2, 0.8], "weight": 1.0}},
                 {"model": models[1], "parameters": {"density": [0.2, 0.7], "weight": 1.0}}]
    config = MergeConfig.from_dict(mk("della", base, differing))
    assert [m.parameters for m in config.models] == [{"k": [0.2, 0.8]}, {"k": [0.2, 0.7]}]
    config = MergeConfig.from_dict(mk("ties", base, [{"model": models[0], "parameters": {"weight": [1, 0.5],
                                                                                         "density": 0.5}}]))
    assert config.models[0].parameters == {"weight": [1.0, 0.5]} and config.models[0].weight is None


def test_mergekit_unmatched_filters_fall_through_its_scopes(tiny_paths) -> None:
    """As in mergekit: a model's filter list that matches no tensor falls back to the top-level value, then to
    mergekit's default (density 1, lambda 1), not to hf_mloss's defaults."""
    base, models = tiny_paths
    entries = [{"model": m, "parameters": {"density": [{"filter": "mlp", "value": 0.5}], "weight": 1.0}} for m in models]
    config = MergeConfig.from_dict(mk("breadcrumbs", base, entries, {"density": 0.7,
                                                                     "lambda": {"filter": "fc1", "value": 2.0}}))
    assert config.parameters["k"] == [{"filter": "mlp", "value": 0.5}, {"value": 0.7}]
    assert config.parameters["lam"] == [{"filter": "fc1", "value": 2.0}, {"value": 1.0}]
    config = MergeConfig.from_dict(mk("della", base, entries))
    assert config.parameters["k"] == [{"filter": "mlp", "value": 0.5}, {"value": 1.0}]
    entries = [{"model": m, "parameters": {"density": {"filter": "mlp", "value": 0.5}, "weight": 1.0}} for m in models]
    assert MergeConfig.from_dict(mk("ties", base, entries)).parameters["k"] == [{"filter": "mlp", "value": 0.5},
                                                                                 {"value": 1.0}]
