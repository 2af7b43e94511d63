"""TSV-M, Iso-C and Iso-CTS: hand-computed matrices with known SVDs, their defining properties, whole-model merges
against an independent float64 numpy reference, configs, the CLI and label-free selection over λ."""

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
from hf_mloss.cli import main
from hf_mloss.loading.data import load_pixel_values
from hf_mloss.errors import InvalidParameterError
from hf_mloss.methods import get_method, list_methods
from hf_mloss.methods.base import MergeContext
from hf_mloss.methods.iso import iso_cts_matrix, subspace_sizes
from hf_mloss.methods.tsv import tsv_merge_matrix
from examples.tiny import tiny_processor

SVD_METHODS = ("tsv_m", "iso_c", "iso_cts")


@pytest.fixture(autouse=True)
def _seeded():
    """Unseeded ``torch.randn`` draws below come from a fixed stream, whatever ran before."""
    torch.manual_seed(0)


def merge_tensor(method: str, base: torch.Tensor, taus: list[torch.Tensor], weights=None, **params) -> torch.Tensor:
    """One tensor merged by ``method`` from task vectors ``taus`` (sources θ₀ + τ_p)."""
    impl = get_method(method)
    w = torch.tensor(weights if weights is not None else [1.0] * len(taus))
    ctx = MergeContext(params=impl.make_params(**params), weights=w)
    return impl.merge_tensor("w", base, [base + t for t in taus], ctx)


def orthonormal(n: int, k: int, seed: int) -> torch.Tensor:
    """An n × k matrix with orthonormal columns (QR of a seeded Gaussian)."""
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))[0].float()


def outer_sum(u: torch.Tensor, s: list[float], v: torch.Tensor) -> torch.Tensor:
    """Σ_i s_i u_i v_iᵀ over the given columns."""
    return (u[:, : len(s)] * torch.tensor(s)) @ v[:, : len(s)].T


# ---------------------------------------------------------------------------------------------------- TSV-M by hand
def test_tsv_m_of_tasks_with_orthogonal_top_vectors_is_the_sum_of_their_truncations() -> None:
    """q = 2, rank 4: each task keeps its top 2 components; disjoint bases need no decorrelation."""
    e, f = orthonormal(6, 6, 0), orthonormal(4, 4, 1)
    tau1 = outer_sum(e[:, [0, 1, 2, 3]], [4, 3, 2, 1], f[:, [0, 1, 2, 3]])
    tau2 = outer_sum(e[:, [4, 5, 0, 1]], [5, 2, 1, 0.5], f[:, [2, 3, 0, 1]])
    expected = outer_sum(e[:, [0, 1]], [4, 3], f[:, [0, 1]]) + outer_sum(e[:, [4, 5]], [5, 2], f[:, [2, 3]])
    base = torch.randn(6, 4)
    merged = merge_tensor("tsv_m", base, [tau1, tau2], lam=0.7)
    torch.testing.assert_close(merged, base + 0.7 * expected, atol=1e-5, rtol=0)


def lowdin(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric orthogonalisation of two unit vectors, closed form: [a b]·G^(-1/2), G = [[1, c], [c, 1]]."""
    c = float(a @ b)
    p, m = 1 / math.sqrt(1 + c), 1 / math.sqrt(1 - c)
    return (p + m) / 2 * a + (p - m) / 2 * b, (p - m) / 2 * a + (p + m) / 2 * b


def test_tsv_m_decorrelates_overlapping_singular_vectors_symmetrically() -> None:
    """q = 2 tasks of rank 2 (6 × 2, k = 1) whose top vectors overlap: U⊥ and V⊥ are the Löwdin orthogonalisations."""
    e = orthonormal(6, 6, 2)
    f = torch.eye(2)
    a, b = 0.6, 1.1
    u1, u2 = e[:, 0], math.cos(a) * e[:, 0] + math.sin(a) * e[:, 1]
    v1, v2 = f[:, 0], math.cos(b) * f[:, 0] + math.sin(b) * f[:, 1]
    v2_perp = -math.sin(b) * f[:, 0] + math.cos(b) * f[:, 1]
    tau1 = 3 * torch.outer(u1, v1) + 1 * torch.outer(e[:, 2], f[:, 1])
    tau2 = 2 * torch.outer(u2, v2) + 0.5 * torch.outer(e[:, 3], v2_perp)
    (u1o, u2o), (v1o, v2o) = lowdin(u1, u2), lowdin(v1, v2)
    expected = 3 * torch.outer(u1o, v1o) + 2 * torch.outer(u2o, v2o)
    base = torch.zeros(6, 2)
    torch.testing.assert_close(merge_tensor("tsv_m", base, [tau1, tau2]), expected, atol=1e-5, rtol=0)
    assert float((u1o @ u2o).abs()) < 1e-6 and float((v1o @ v2o).abs()) < 1e-6


def test_tsv_m_of_one_task_is_the_task_vector() -> None:
    base, tau = torch.randn(7, 5), torch.randn(7, 5)
    torch.testing.assert_close(merge_tensor("tsv_m", base, [tau], lam=1.5), base + 1.5 * tau, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("shape", "q", "fraction"), [((12, 9), 3, None), ((9, 12), 2, None), ((16, 16), 4, 0.125)])
def test_tsv_m_singular_values_are_the_kept_ones_of_every_task(shape, q, fraction) -> None:
    """U⊥ and V⊥ have orthonormal columns, so U⊥ Σ V⊥ᵀ is an SVD: its singular values are the q·k kept ones."""
    g = torch.Generator().manual_seed(3)
    taus = torch.randn(q, *shape, generator=g)
    k = int(min(shape) * (fraction or 1 / q))
    kept = torch.cat([torch.linalg.svdvals(t)[:k] for t in taus]).sort(descending=True).values
    merged = tsv_merge_matrix(taus, fraction)
    values = torch.linalg.svdvals(merged)
    torch.testing.assert_close(values[: q * k], kept, atol=1e-4, rtol=1e-5)
    assert float(values[q * k:].sum()) < 1e-4  # rank q·k (k·q ≤ r, so nothing beyond)


def test_tsv_m_weights_scale_each_task_before_the_svds() -> None:
    base, taus = torch.randn(8, 6), [torch.randn(8, 6) for _ in range(3)]
    weighted = merge_tensor("tsv_m", base, taus, weights=[2.0, 0.5, 1.0])
    scaled = merge_tensor("tsv_m", base, [2.0 * taus[0], 0.5 * taus[1], taus[2]])
    torch.testing.assert_close(weighted, scaled, atol=1e-4, rtol=1e-5)  # float32 SVDs of 2·τ and of τ


def test_tsv_m_refuses_more_than_one_qth_of_the_rank(tiny_paths, tmp_path) -> None:
    base, models = tiny_paths
    with pytest.raises(InvalidParameterError, match=r"fraction <= 0.3333.*got fraction=0.5"):
        hf_mloss.merge(base, models, "tsv_m", fraction=0.5, progress=False)
    with pytest.raises(InvalidParameterError, match="fraction"):
        get_method("tsv_m").make_params(fraction=0.0)


def test_tsv_m_matrix_too_small_for_a_component_takes_the_mean() -> None:
    """rank 2 < q = 3: floor(2/3) = 0 components each; the mean task vector instead of nothing."""
    base, taus = torch.randn(10, 2), [torch.randn(10, 2) for _ in range(3)]
    torch.testing.assert_close(merge_tensor("tsv_m", base, taus, lam=2.0), base + 2.0 * sum(taus) / 3)


def _tsv_full_svd_float64(taus: torch.Tensor) -> torch.Tensor:
    """TSV-M from full float64 SVDs (every component computed, then truncated): the exact reference."""
    q, m, n = taus.shape
    k = min(m, n) // q
    u, s, vh = torch.linalg.svd(taus.double(), full_matrices=False)

    def polar(a: torch.Tensor) -> torch.Tensor:
        p, _, qh = torch.linalg.svd(a, full_matrices=False)
        return p @ qh

    u_cat, vh_cat = u[:, :, :k].transpose(0, 1).reshape(m, q * k), vh[:, :k].reshape(q * k, n)
    return (polar(u_cat) * s[:, :k].reshape(-1)) @ polar(vh_cat)


@pytest.mark.parametrize("spectrum", ["decaying", "flat"])
@pytest.mark.parametrize("shape", [(48, 64), (64, 48), (56, 56)])
def test_tsv_m_computing_only_the_kept_components_stays_within_1e5_of_full_svds(spectrum, shape) -> None:
    """TSV-M factors only each task's top k components (the float64 Gram route of ``leading_svd``); its merge is
    within 1e-5 (relative, Frobenius) of the one from full float64 SVDs, on a decaying spectrum and on a flat one
    (Gaussian task vectors: σ_k and σ_k+1 nearly equal, where a randomised SVD would not converge)."""
    g = torch.Generator().manual_seed(21)
    q, (m, n) = 4, shape
    if spectrum == "flat":
        taus = 1e-3 * torch.randn(q, m, n, generator=g)
    else:
        r = min(m, n)
        left = torch.linalg.qr(torch.randn(q, m, r, generator=g, dtype=torch.float64))[0]
        right = torch.linalg.qr(torch.randn(q, n, r, generator=g, dtype=torch.float64))[0]
        taus = ((left * torch.exp(-torch.arange(r) / 6.0)) @ right.transpose(1, 2)).float()
    merged, exact = tsv_merge_matrix(taus.clone(), None), _tsv_full_svd_float64(taus)
    assert float((merged.double() - exact).norm() / exact.norm()) < 1e-5


def _iso_full_svd_float64(taus: torch.Tensor, fraction: float | None) -> torch.Tensor:
    """Iso-C (``fraction`` None) or Iso-CTS written with float64 full SVDs and an explicit projection: the reference
    the Gram route is checked against."""
    taus = taus.double()
    q, m, n = taus.shape

    def polar(a):
        p, _, qh = torch.linalg.svd(a, full_matrices=False)
        return p @ qh

    u, s, vh = torch.linalg.svd(taus.sum(0), full_matrices=False)
    if fraction is None:
        return (u * s.mean()) @ vh
    common, per_task = subspace_sizes(min(m, n), q, fraction)
    u_c = u[:, :common]
    ut, st, vht = torch.linalg.svd(taus - u_c @ (u_c.T @ taus), full_matrices=False)
    u_all = torch.cat([ut[:, :, :per_task].transpose(0, 1).reshape(m, -1), u_c], 1)
    vh_all = torch.cat([vht[:, :per_task].reshape(-1, n), vh[:common]], 0)
    return (polar(u_all) * torch.cat([st[:, :per_task].reshape(-1), s[:common]]).mean()) @ polar(vh_all)


@pytest.mark.parametrize("shape", [(40, 60), (60, 40), (50, 50)])
def test_iso_merges_from_gram_eigenpairs_match_full_float64_svds(shape, monkeypatch) -> None:
    """Iso-C and Iso-CTS factor no full SVD (Iso-C: the Gram eigenpairs of the sum; Iso-CTS: the common subspace's
    top triplets, then, for m ≤ n, each task in the complement's (m − k)-dimensional coordinates): their merges
    stay within 1e-5 of the same algorithm written with float64 full SVDs, wide, tall and square."""
    from hf_mloss.methods import svd_ops
    from hf_mloss.methods.iso import iso_c_matrix

    g = torch.Generator().manual_seed(31)
    taus = 1e-2 * torch.randn(4, *shape, generator=g)
    calls = []
    real_svd = svd_ops.svd
    monkeypatch.setattr(svd_ops, "svd", lambda m: calls.append(m.shape) or real_svd(m))
    for merged, exact in [(iso_c_matrix(taus.sum(0)), _iso_full_svd_float64(taus, None)),
                          (iso_cts_matrix(taus, 0.8), _iso_full_svd_float64(taus, 0.8)),
                          (iso_cts_matrix(taus, 0.5), _iso_full_svd_float64(taus, 0.5))]:
        assert float((merged.double() - exact).norm() / exact.norm()) < 1e-5
    assert calls == []


def test_leading_svd_and_rest_gives_an_orthonormal_complement() -> None:
    """``rest`` completes the top-k left singular vectors to an orthonormal basis (so a projection off them is
    ``rest @ restᵀ``), from the Gram route and from the SVD fallback alike; none for a tall matrix."""
    from hf_mloss.methods import svd_ops

    g = torch.Generator().manual_seed(9)
    for matrix in [torch.randn(12, 30, generator=g),
                   torch.randn(12, 2, generator=g) @ torch.randn(2, 30, generator=g)]:  # rank 2 < k: the SVD route
        u, s, vh, rest = svd_ops.leading_svd_and_rest(matrix, 5)
        basis = torch.cat([u, rest], 1).double()
        torch.testing.assert_close(basis.T @ basis, torch.eye(12, dtype=torch.float64), atol=1e-5, rtol=0)
    assert svd_ops.leading_svd_and_rest(torch.randn(30, 12, generator=g), 5)[3] is None


def test_leading_svd_is_the_truncated_svd_and_falls_back_to_it_below_rank_k(monkeypatch) -> None:
    """The leading k triplets equal the full SVD's (up to each pair's sign); a task whose rank is below k (its
    kept directions are then arbitrary) sends the batch through the full SVD, as before."""
    from hf_mloss.methods import svd_ops

    g = torch.Generator().manual_seed(5)
    taus = torch.randn(3, 20, 30, generator=g)
    u, s, vh = svd_ops.leading_svd(taus, 6)
    fu, fs, fvh = torch.linalg.svd(taus.double(), full_matrices=False)
    torch.testing.assert_close(s.double(), fs[:, :6], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close((u * s[:, None]) @ vh, ((fu[:, :, :6] * fs[:, None, :6]) @ fvh[:, :6]).float(),
                               atol=1e-5, rtol=0)
    calls = []
    real_svd = svd_ops.svd
    monkeypatch.setattr(svd_ops, "svd", lambda m: calls.append(m.shape) or real_svd(m))
    svd_ops.leading_svd(taus, 6)
    assert calls == []  # well conditioned: the Gram route only
    low_rank = taus.clone()
    low_rank[1] = torch.randn(20, 2, generator=g) @ torch.randn(2, 30, generator=g)  # rank 2 < k = 6
    u, s, vh = svd_ops.leading_svd(low_rank, 6)
    assert calls == [(3, 20, 30)]
    ru, rs, rvh = real_svd(low_rank)
    torch.testing.assert_close((u, s, vh), (ru[..., :6], rs[..., :6], rvh[..., :6, :]))


def test_polar_factor_from_the_gram_matrix_equals_the_svd_one_and_falls_back_when_singular() -> None:
    """U·(UᵀU)^(-1/2) equals P·Qᵀ of the SVD on a well-conditioned matrix (tall and wide); a rank-deficient one
    goes through the SVD (the inverse root does not exist) and still gives orthonormal columns."""
    from hf_mloss.methods import svd_ops

    g = torch.Generator().manual_seed(8)
    for shape in [(30, 12), (12, 30)]:
        a = torch.randn(*shape, generator=g)
        torch.testing.assert_close(svd_ops.polar_factor(a), svd_ops._svd_polar_factor(a.double()).float(),
                                   atol=2e-6, rtol=0)
    singular = torch.randn(30, 3, generator=g) @ torch.randn(3, 12, generator=g)  # rank 3 of 12
    polar = svd_ops.polar_factor(singular)
    torch.testing.assert_close(polar, svd_ops._svd_polar_factor(singular))
    assert torch.isfinite(polar).all()


# ---------------------------------------------------------------------------------------------------- Iso-C by hand
def test_iso_c_flattens_the_spectrum_of_the_sum() -> None:
    """Δ = τ1 + τ2 = U diag(6, 2, 1, 1) Vᵀ → σ̄ U Vᵀ with σ̄ = 2.5, however the sum is split between the tasks."""
    u, v = orthonormal(6, 4, 4), orthonormal(4, 4, 5)
    total = outer_sum(u, [6, 2, 1, 1], v)
    split = torch.randn(6, 4)
    base = torch.randn(6, 4)
    merged = merge_tensor("iso_c", base, [total / 2 + split, total / 2 - split], lam=3.0)
    torch.testing.assert_close(merged, base + 3.0 * 2.5 * (u @ v.T), atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [(9, 5), (5, 9), (8, 8)])
def test_iso_c_singular_values_all_equal_their_mean(shape) -> None:
    g = torch.Generator().manual_seed(6)
    taus = [torch.randn(*shape, generator=g) for _ in range(3)]
    base = torch.zeros(shape)
    values = torch.linalg.svdvals(merge_tensor("iso_c", base, taus))
    mean = float(torch.linalg.svdvals(sum(taus)).mean())
    torch.testing.assert_close(values, torch.full_like(values, mean), atol=1e-4, rtol=1e-5)


# --------------------------------------------------------------------------------------------------- Iso-CTS by hand
def test_iso_cts_keeps_the_common_and_task_specific_subspaces() -> None:
    """8 × 8, q = 2, fraction 0.5: common = top 4 of the sum, 2 per task off it; all already orthogonal here."""
    e, f = orthonormal(8, 8, 7), orthonormal(8, 8, 8)
    shared = outer_sum(e[:, :4], [10, 9, 8, 7], f[:, :4])
    specific1 = outer_sum(e[:, [4, 5, 6]], [3, 2, 1], f[:, [4, 5, 6]])
    specific2 = outer_sum(e[:, [6, 7, 4]], [4, 1.5, 0.5], f[:, [6, 7, 5]])
    base = torch.randn(8, 8)
    merged = merge_tensor("iso_cts", base, [shared + specific1, shared + specific2], lam=0.5,
                          common_space_fraction=0.5)
    sigma = (20 + 18 + 16 + 14 + 3 + 2 + 4 + 1.5) / 8
    torch.testing.assert_close(merged, base + 0.5 * sigma * (e @ f.T), atol=1e-5, rtol=0)
    iso_c = merge_tensor("iso_c", base, [shared + specific1, shared + specific2], lam=0.5)
    assert float((iso_c - merged).abs().max()) > 0.1  # the sum's own spectrum and vectors differ


def test_iso_cts_with_the_whole_rank_common_is_iso_c() -> None:
    g = torch.Generator().manual_seed(9)
    base, taus = torch.randn(7, 6, generator=g), [torch.randn(7, 6, generator=g) for _ in range(3)]
    iso_c = merge_tensor("iso_c", base, taus, lam=1.7)
    torch.testing.assert_close(merge_tensor("iso_cts", base, taus, lam=1.7, common_space_fraction=1.0), iso_c,
                               atol=1e-5, rtol=0)


def test_iso_cts_spectrum_is_flat_at_the_mean_of_the_kept_values() -> None:
    g = torch.Generator().manual_seed(10)
    taus = torch.randn(3, 20, 12, generator=g)
    common, per_task = subspace_sizes(12, 3, 0.5)
    assert (common, per_task) == (6, 2)
    u, s, _ = torch.linalg.svd(taus.sum(0))
    projected = taus - u[:, :common] @ (u[:, :common].T @ taus)
    kept = torch.cat([s[:common], *(torch.linalg.svdvals(p)[:per_task] for p in projected)])
    values = torch.linalg.svdvals(iso_cts_matrix(taus, 0.5))
    torch.testing.assert_close(values, torch.full_like(values, float(kept.mean())), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("rank", "q", "fraction", "sizes"), [
    (768, 8, 0.8, (616, 19)),  # ViT-B/32: floor(614.4) = 614 common, round(154 / 8) = 19 per task, 616 common
    (32, 3, 0.8, (26, 2)),  # floor(25.6) = 25, round(7 / 3) = 2 per task
    (4, 2, 0.8, (4, 0)),  # round(0.5) = 0 (Python's round, as the authors' code): the whole rank is common
    (2, 3, 0.1, (2, 0)),  # capped: q·s never exceeds the rank
])
def test_subspace_sizes_split_the_rank(rank, q, fraction, sizes) -> None:
    assert subspace_sizes(rank, q, fraction) == sizes
    assert sizes[0] + q * sizes[1] == rank


# ------------------------------------------------------------------------------------------- shared behaviour
@pytest.mark.parametrize("method", SVD_METHODS)
@pytest.mark.parametrize("shape", [(5,), (4, 3, 2, 2)], ids=["bias", "conv"])
def test_non_matrix_tensors_take_the_mean_task_vector(method, shape) -> None:
    base, taus = torch.randn(shape), [torch.randn(shape) for _ in range(3)]
    merged = merge_tensor(method, base, taus, weights=[1.0, 2.0, 0.5], lam=1.3)
    torch.testing.assert_close(merged, base + 1.3 * (taus[0] + 2 * taus[1] + 0.5 * taus[2]) / 3)


@pytest.mark.parametrize("method", SVD_METHODS)
def test_unchanged_tensor_is_the_base_and_the_merge_is_homogeneous(method) -> None:
    impl = get_method(method)
    assert impl.zero_delta_is_base and impl.default_weight == "one"
    g = torch.Generator().manual_seed(5)
    base = torch.randn(9, 7, generator=g)
    assert torch.equal(merge_tensor(method, base, [torch.zeros(9, 7)] * 3), base)
    taus = [torch.randn(9, 7, generator=g) for _ in range(3)]
    once, twice = merge_tensor(method, base, taus), merge_tensor(method, base, [2 * t for t in taus])
    # f(c·τ) = c·f(τ), c > 0, to float32 SVD rounding (relative to the entries' size, a few units)
    torch.testing.assert_close(twice - base, 2 * (once - base), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("merge_matrix", "kwargs"), [(tsv_merge_matrix, {"fraction": None}),
                                                      (iso_cts_matrix, {"common_space_fraction": 0.5})])
def test_a_task_that_left_the_matrix_unchanged_is_left_out(merge_matrix, kwargs) -> None:
    """Its zero matrix has no singular vectors of its own: the merge is that of the tasks that changed the matrix."""
    g = torch.Generator().manual_seed(11)
    t1, t2 = torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g)
    with_zero = merge_matrix(torch.stack([t1, torch.zeros(10, 8), t2]), *kwargs.values())
    torch.testing.assert_close(with_zero, merge_matrix(torch.stack([t1, t2]), *kwargs.values()), atol=1e-6, rtol=0)


def test_registered_with_papers_and_parameter_hints() -> None:
    assert set(SVD_METHODS) <= set(list_methods())
    assert "2412.00081" in get_method("tsv_m").reference_url
    assert get_method("iso_c").reference_url == get_method("iso_cts").reference_url == "https://arxiv.org/abs/2502.04959"
    unset = {"calibrate": None, "alpha": None}  # Singular Value Calibration, off by default (tests/test_wudi_cart_svc.py)
    assert get_method("tsv_m").make_params().to_dict() == {"lam": 1.0, "fraction": None, **unset}
    assert get_method("iso_cts").make_params().to_dict() == {"lam": 1.0, "common_space_fraction": 0.8, **unset}
    with pytest.raises(InvalidParameterError, match="did you mean 'lam'"):
        get_method("iso_c").make_params(scaling_factor=2.0)


# ------------------------------------------------------------------------------ whole models: numpy reference
def np_polar(a: np.ndarray) -> np.ndarray:
    """A·(AᵀA)^(-1/2) (eigendecomposition, not the SVD the library uses)."""
    w, q = np.linalg.eigh(a.T @ a)
    return a @ (q / np.sqrt(w)) @ q.T


def ref_tsv(taus: np.ndarray) -> np.ndarray:
    q, m, n = taus.shape
    k = int(min(m, n) / q)
    parts = [np.linalg.svd(t, full_matrices=False) for t in taus]
    u = np.concatenate([p[0][:, :k] for p in parts], 1)
    s = np.concatenate([p[1][:k] for p in parts])
    v = np.concatenate([p[2][:k].T for p in parts], 1)
    return (np_polar(u) * s) @ np_polar(v).T


def ref_iso_c(taus: np.ndarray) -> np.ndarray:
    u, s, vh = np.linalg.svd(taus.sum(0), full_matrices=False)
    return s.mean() * u @ vh


def ref_iso_cts(taus: np.ndarray, fraction: float) -> np.ndarray:
    q, m, n = taus.shape
    r = min(m, n)
    per_task = round((r - int(r * fraction)) / q)
    common = r - q * per_task
    u, s, vh = np.linalg.svd(taus.sum(0), full_matrices=False)
    uc = u[:, :common]
    us, ss, vs = [uc], [s[:common]], [vh[:common].T]
    for t in taus:
        pu, ps, pvh = np.linalg.svd(t - uc @ uc.T @ t, full_matrices=False)
        us.append(pu[:, :per_task]), ss.append(ps[:per_task]), vs.append(pvh[:per_task].T)
    return np.concatenate(ss).mean() * np_polar(np.concatenate(us, 1)) @ np_polar(np.concatenate(vs, 1)).T


REFERENCES = {"tsv_m": lambda t, p: ref_tsv(t), "iso_c": lambda t, p: ref_iso_c(t),
              "iso_cts": lambda t, p: ref_iso_cts(t, p.get("common_space_fraction", 0.8))}


def check_against_reference(result, base_dir, model_dirs, method: str, params: dict) -> int:
    """Every float tensor of ``result`` against the numpy reference; returns how many were merged as matrices."""
    base = load_file(str(Path(base_dir) / "model.safetensors"))
    fts = [load_file(str(Path(m) / "model.safetensors")) for m in model_dirs]
    merged = result.model.state_dict()
    matrices = 0
    for name, theta0 in base.items():
        if not theta0.is_floating_point():
            continue
        taus = np.stack([(ft[name] - theta0).double().numpy() for ft in fts])
        tau = REFERENCES[method](taus, params) if taus.ndim == 3 else taus.mean(0)
        matrices += taus.ndim == 3
        expected = theta0.double().numpy() + params["lam"] * tau
        ours = merged[name] if name in merged else merged[name.removeprefix("vision_model.")]
        diff = np.abs(ours.double().numpy() - expected).max()
        # float32 SVDs sit up to ~3e-5 of the merged change from float64 (benchmarks/results/svd_parity*.md)
        change = np.abs(expected - theta0.double().numpy()).max()
        assert diff < max(1e-4 * change, 1e-7 * max(1.0, np.abs(expected).max())), (name, diff, change)
    return matrices


@pytest.mark.parametrize(("method", "params"), [("tsv_m", {"lam": 1.2}), ("iso_c", {"lam": 3.0}),
                                                ("iso_cts", {"lam": 2.0}),
                                                ("iso_cts", {"lam": 2.0, "common_space_fraction": 0.5})])
def test_whole_clip_merge_matches_a_numpy_reference(tiny_models, method, params) -> None:
    base_dir, model_dirs = tiny_models
    result = hf_mloss.merge(str(base_dir), [str(m) for m in model_dirs], method, progress=False, **params)
    # 6 per block × 2 blocks + the position embedding; the patch embedding (4-D) takes the mean
    assert check_against_reference(result, base_dir, model_dirs, method, params) == 13


@pytest.fixture(scope="module")
def whole_clip(tmp_path_factory):
    """A full CLIPModel (text tower, projections, logit scale) and two fine-tunes of all of it."""
    from transformers import CLIPModel

    from examples.tiny import make_base, save_clip_model

    root = tmp_path_factory.mktemp("whole_clip")
    base_dir = save_clip_model(make_base(0), root / "base")
    model_dirs = []
    for i in range(2):
        model = CLIPModel.from_pretrained(base_dir)
        g = torch.Generator().manual_seed(50 + i)
        model.load_state_dict({k: v + 1e-2 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                               for k, v in model.state_dict().items()})
        model.save_pretrained(root / f"ft{i}")
        model_dirs.append(root / f"ft{i}")
    return base_dir, model_dirs


@pytest.mark.parametrize("method", SVD_METHODS)
def test_full_clip_model_merges_its_vision_tower(whole_clip, method) -> None:
    """A full CLIPModel gives a CLIPModel with every tensor merged as the reference: the vision tower, and the text
    tower, projections and logit scale that the fine-tunes changed too."""
    base_dir, model_dirs = whole_clip
    params = {"lam": 1.5}
    result = hf_mloss.merge(str(base_dir), [str(m) for m in model_dirs], method, progress=False, **params)
    assert type(result.model).__name__ == "CLIPModel"
    assert check_against_reference(result, base_dir, model_dirs, method, params) > 13  # text-tower matrices too


# --------------------------------------------------------------------------------- configs, CLI, selection
def test_yaml_config_and_cli(tiny_paths, tmp_path) -> None:
    base, models = tiny_paths
    direct = hf_mloss.merge(base, models, "iso_cts", lam=2.5, common_space_fraction=0.6, progress=False)
    config = MergeConfig.from_dict({"base": base, "models": models, "method": "iso_cts",
                                    "parameters": {"lam": 2.5, "common_space_fraction": 0.6}})
    assert config.method_params().common_space_fraction == 0.6
    via_config = hf_mloss.run(config, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(direct.model.state_dict().values(),
                                                  via_config.model.state_dict().values()))
    path = tmp_path / "tsv.yaml"
    path.write_text(yaml.safe_dump({"base": base, "models": models, "method": "tsv_m", "parameters": {"lam": 1.5}}))
    assert main(["merge", str(path), str(tmp_path / "out"), "-q"]) == 0
    saved = yaml.safe_load((tmp_path / "out" / "hf_mloss_config.yaml").read_text())
    assert saved["method"] == "tsv_m" and saved["parameters"]["lam"] == 1.5
    assert "2412.00081" in (tmp_path / "out" / "README.md").read_text()  # the card cites the paper


# which λ the tiny data pick is incidental here (the grid-edge warning: tests/test_auto.py, tests/test_surface.py)
@pytest.mark.filterwarnings("ignore:The label-free selection .*chose a grid edge:UserWarning")
@pytest.mark.parametrize("method", ["iso_c", "tsv_m"])
def test_unlabeled_selection_over_the_scale(tiny_paths, image_folder, method) -> None:
    pixels, _ = load_pixel_values(str(image_folder), tiny_processor(), num_samples=8)
    base, models = tiny_paths
    grid = {"lam": [0.5, 1.0, 2.0, 4.0]}
    result = hf_mloss.merge(base, models, method, data=pixels, batch_size=4, progress=False, select="unlabeled",
                            grid=grid)
    select = result.config.select
    assert [c["setting"] for c in select.candidates] == [{"lam": v} for v in grid["lam"]]
    assert select.chosen == min(select.candidates, key=lambda c: c["output"])["setting"]
    direct = hf_mloss.merge(base, models, method, progress=False, **select.chosen)
    a, b = result.model.state_dict(), direct.model.state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point()) < 1e-6


def test_suite_rows_tune_the_scale_on_grids_of_the_common_size() -> None:
    """The suites tune TSV-M, Iso-C and Iso-CTS on λ grids as large as every other method's, reaching far above
    TIES's (per unit of the trained task vectors), and compare them with task arithmetic as well as TIES."""
    from benchmarks.suites.protocol import check_grids
    from benchmarks.suites.report import default_pairs
    from benchmarks.suites.run import method_specs

    for grid, size in [("full", 6), ("main", 6), ("quick", 4), ("smoke", 2)]:
        assert not {"tsv_m", "iso_c", "iso_cts"} & {s.label for s in method_specs(range(10, 12), grid)}  # opt-in
        specs = {s.label: s for s in method_specs(range(10, 12), grid, num_tasks=8, svd=True)}
        assert check_grids(list(specs.values())) == size
        assert {specs[m].method for m in SVD_METHODS} == set(SVD_METHODS)
    main_grid = {s.label: s.grid["lam"] for s in method_specs(range(10, 12), "main", svd=True) if s.grid}
    assert main_grid["tsv_m"] == [1.0, 1.5, 2.0, 2.5, 3.0, 4.0]
    assert main_grid["iso_c"] == main_grid["iso_cts"] == [2.0, 3.0, 4.5, 6.0, 8.0, 11.0]
    assert max(main_grid["iso_c"]) > 3 * max(main_grid["ties"])  # far above TIES's λ (one scale: nothing rescaled)
    pairs = default_pairs(["task_arithmetic", "ties", *SVD_METHODS])
    assert {(m, b) for m in SVD_METHODS for b in ("ties", "task_arithmetic")} <= set(pairs)


def test_an_svd_that_fails_to_converge_in_float32_is_repeated_in_float64(monkeypatch) -> None:
    """LAPACK's float32 solver can fail on clustered singular values; the merge then repeats that SVD in float64."""
    from hf_mloss.methods import svd_ops

    g = torch.Generator().manual_seed(12)
    taus = torch.randn(3, 12, 10, generator=g)
    monkeypatch.setattr(svd_ops, "GRAM_MIN_RATIO", 2.0)  # no matrix passes: every factorisation takes the SVD
    expected = iso_cts_matrix(taus, 0.5), tsv_merge_matrix(taus, None)
    real_svd, calls = torch.linalg.svd, []

    def flaky_svd(matrix, full_matrices=True):
        calls.append(matrix.dtype)
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        return real_svd(matrix, full_matrices=full_matrices)

    monkeypatch.setattr(svd_ops.torch.linalg, "svd", flaky_svd)
    again = iso_cts_matrix(taus, 0.5), tsv_merge_matrix(taus, None)
    assert calls.count(torch.float64) == calls.count(torch.float32) > 0
    for a, b in zip(again, expected):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
