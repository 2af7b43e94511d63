"""WUDI, CART and Singular Value Calibration (``calibrate="svc"``): the fast WUDI gradient against Adam on the
literal loss, CART and SVC against hand-computed matrices and direct SVDs, whole tiny models, the recipe, the card,
selection and ``auto`` over merges that λ does not rescale, and the validation errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

import hf_mloss
from hf_mloss import MergeConfig
from hf_mloss.errors import InvalidParameterError
from hf_mloss.methods import get_method, list_methods
from hf_mloss.methods.base import MergeContext
from hf_mloss.methods.cart import cart_low_rank
from hf_mloss.methods.svc import calibrated_methods, svc_matrix
from hf_mloss.methods.wudi import _gradient, wudi_matrix


def merge_tensor(method: str, base: torch.Tensor, taus: list[torch.Tensor], weights=None, **params) -> torch.Tensor:
    """One tensor merged by ``method`` from task vectors ``taus`` (sources θ₀ + τ_p)."""
    impl = get_method(method)
    w = torch.tensor(weights if weights is not None else [1.0] * len(taus))
    ctx = MergeContext(params=impl.make_params(**params), weights=w)
    return impl.merge_tensor("w", base, [base + t for t in taus], ctx)


def orthonormal(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))[0]


def task_matrices(q: int, m: int, n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """q task matrices of unequal sizes (as fine-tunes' are), entries ~1e-3."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, 0.5, q, dtype=torch.float64)[:, None, None]
    return (1e-3 * scales * torch.randn(q, m, n, generator=g, dtype=torch.float64)).to(dtype)


# ------------------------------------------------------------------------------------------------------------ WUDI
def literal_wudi(taus: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    """Adam on Σ_i ‖(τ − τ_i) τ_iᵀ‖² / ‖τ_i‖² by autograd, from the sum (the loss as the paper and fusion-bench
    write it)."""
    merged = torch.nn.Parameter(taus.sum(0))
    optimizer = torch.optim.Adam([merged], lr=lr, weight_decay=0)
    norms = taus.flatten(1).norm(dim=1).square()
    for _ in range(steps):
        with torch.enable_grad():
            product = (merged.unsqueeze(0) - taus) @ taus.transpose(1, 2)
            loss = (product.square() / norms[:, None, None]).sum()
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
    return merged.detach()


@pytest.mark.parametrize("shape", [(3, 16, 24), (3, 24, 16), (4, 12, 12), (2, 4, 40)],
                         ids=["wide", "tall", "square", "factored-route"])
def test_wudi_gradient_is_the_literal_losss_gradient(shape) -> None:
    """2·(τ·G − C) (and, where 2·q·m < n, (τ·τ̂ᵀ − P)·τ̂) equals autograd's gradient of the loss, in float64."""
    taus = task_matrices(*shape, seed=1, dtype=torch.float64)
    tau = torch.randn(shape[1:], dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 1e-3
    point = tau.clone().requires_grad_(True)
    with torch.enable_grad():
        loss = (((point - taus) @ taus.transpose(1, 2)).square() / taus.flatten(1).norm(dim=1).square()[:, None, None]
                ).sum()
        loss.backward()
    torch.testing.assert_close(_gradient(taus)(tau), point.grad, rtol=1e-10, atol=0)


@pytest.mark.parametrize("shape", [(3, 16, 24), (3, 24, 16), (2, 4, 40)], ids=["wide", "tall", "factored-route"])
def test_wudi_iterates_equal_adam_on_the_literal_loss(shape) -> None:
    """400 Adam steps at lr 1e-5: the fast form in float32 sits as close to the float64 run of the literal loss as
    float32 autograd on the literal loss does (both ~5e-7), and in float64 the two runs agree to rounding."""
    taus = task_matrices(*shape, seed=3)
    exact = literal_wudi(taus.double(), 400, 1e-5)
    ours, literal32 = wudi_matrix(taus.clone(), 400, 1e-5), literal_wudi(taus, 400, 1e-5)
    scale = exact.norm()
    assert float((ours.double() - exact).norm() / scale) < 2e-6
    assert float((ours.double() - exact).norm()) < 2 * float((literal32.double() - exact).norm()) + 1e-12
    torch.testing.assert_close(wudi_matrix(taus.double(), 400, 1e-5), exact, rtol=1e-9, atol=1e-15)
    assert float((exact - taus.double().sum(0)).norm() / scale) > 0.1  # the steps moved it far from the start


def test_wudi_merges_the_optimised_matrix_and_the_mean_elsewhere() -> None:
    taus = task_matrices(3, 6, 5, seed=4)
    base = torch.randn(6, 5)
    expected = base + 0.8 * wudi_matrix(taus.clone(), 400, 1e-5)
    torch.testing.assert_close(merge_tensor("wudi", base, list(taus), lam=0.8), expected, rtol=0, atol=1e-6)
    assert torch.equal(wudi_matrix(taus.clone(), 0, 1e-5), taus.sum(0))  # steps=0: the start, the summed vectors
    bias = torch.randn(5)
    vectors = [torch.randn(5) * 1e-3 for _ in range(3)]
    torch.testing.assert_close(merge_tensor("wudi", bias, vectors, lam=0.8), bias + 0.8 * sum(vectors) / 3)


def test_wudi_leaves_out_a_task_that_left_the_matrix_unchanged() -> None:
    """Its term is 0/0 in the literal loss (NaN in the reference); without it the merge is the others' exactly."""
    taus = task_matrices(2, 8, 6, seed=5)
    with_zero = torch.cat([taus, torch.zeros(1, 8, 6)])
    result = wudi_matrix(with_zero, 50, 1e-5)
    assert torch.isfinite(result).all()
    torch.testing.assert_close(result, wudi_matrix(taus.clone(), 50, 1e-5), rtol=0, atol=0)
    assert torch.equal(wudi_matrix(torch.zeros(2, 4, 3), 10, 1e-5), torch.zeros(4, 3))


@pytest.mark.parametrize("shape", [(8, 96, 384), (8, 384, 96)], ids=["wide", "tall"])
def test_wudi_holds_no_float64_copy_of_the_task_matrices(shape) -> None:
    """G and C are formed one task at a time: the peak beside the q task matrices stays under 3 of their float32
    bytes (G in float64 and float32, C, one task's τ and τ̂ in float64, Adam's state), where stacking them in float64
    as τ and τ̂ held about 9 to 10."""
    from memory_peak import malloc_in_use, peak_bytes

    in_use = malloc_in_use()
    if in_use is None:
        pytest.skip("needs glibc's malloc behind torch (mallinfo2, glibc 2.33+) to count the process's allocated bytes")
    taus = task_matrices(*shape, seed=6)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # every op on this thread, where the dispatch mode sees it
    try:
        run = lambda: wudi_matrix(taus, 2, 1e-5)  # noqa: E731
        run()  # warm
        peak = peak_bytes(in_use, run)
    finally:
        torch.set_num_threads(previous)
    assert peak < 3 * taus.numel() * taus.element_size(), peak


# ------------------------------------------------------------------------------------------------------------ CART
def test_cart_by_hand() -> None:
    """q = 3 centred task matrices with known SVDs (D_1 = 4·e1f1ᵀ + e2f2ᵀ, D_2 = −4·e1f1ᵀ + 2·e3f3ᵀ, D_3 = −D_1 − D_2):
    at rank 1 their truncations sum to −2·e3f3ᵀ; at rank 2 each is whole and they sum to 0 (the average)."""
    e, f = orthonormal(6, 4, 10).float(), orthonormal(4, 4, 11).float()

    def outer(i):
        return torch.outer(e[:, i], f[:, i])

    d1, d2 = 4 * outer(0) + outer(1), -4 * outer(0) + 2 * outer(2)
    common = torch.randn(6, 4) * 0.1
    taus = [common + d for d in (d1, d2, -d1 - d2)]
    base = torch.randn(6, 4)
    for fraction in (0.25, 0.08):  # k = max(1, floor(4 · fraction)) = 1
        merged = merge_tensor("cart", base, taus, lam=1.5, fraction=fraction)
        torch.testing.assert_close(merged, base + common + 1.5 * (-2 * outer(2)), rtol=0, atol=2e-6)
    torch.testing.assert_close(merge_tensor("cart", base, taus, lam=1.5, fraction=0.5), base + common, rtol=0,
                               atol=2e-6)
    bias = torch.randn(4)
    vectors = [torch.randn(4) for _ in range(3)]
    torch.testing.assert_close(merge_tensor("cart", bias, vectors, lam=3.0), bias + sum(vectors) / 3)


def np_cart(taus: np.ndarray, lam: float, fraction: float) -> np.ndarray:
    mean = taus.mean(0)
    if taus.ndim != 3:
        return mean
    k = max(1, int(min(taus.shape[1:]) * fraction))
    low = 0
    for t in taus - mean:
        u, s, vh = np.linalg.svd(t, full_matrices=False)
        low = low + (u[:, :k] * s[:k]) @ vh[:k]
    return mean + lam * low


@pytest.mark.parametrize("params", [{"lam": 1.0}, {"lam": 2.0, "fraction": 0.3}])
def test_cart_whole_clip_equals_a_numpy_reference(tiny_models, params) -> None:
    base_dir, model_dirs = tiny_models
    result = hf_mloss.merge(str(base_dir), [str(m) for m in model_dirs], "cart", progress=False, **params)
    base = load_file(str(Path(base_dir) / "model.safetensors"))
    fts = [load_file(str(Path(m) / "model.safetensors")) for m in model_dirs]
    merged, matrices = result.model.state_dict(), 0
    for name, theta0 in base.items():
        taus = np.stack([(ft[name] - theta0).double().numpy() for ft in fts])
        matrices += taus.ndim == 3
        expected = theta0.double().numpy() + np_cart(taus, params["lam"], params.get("fraction", 0.08))
        ours = merged[name.removeprefix("vision_model.")].double().numpy()
        assert np.abs(ours - expected).max() < 1e-6 * max(1.0, np.abs(expected).max()), name
    assert matrices == 13  # 6 per block × 2 blocks + the position embedding


def test_cart_low_rank_keeps_at_least_one_component() -> None:
    centred = task_matrices(2, 5, 3, seed=6)
    u, s, vh = torch.linalg.svd(centred.double(), full_matrices=False)
    expected = sum(s[p, 0] * torch.outer(u[p, :, 0], vh[p, 0]) for p in range(2))
    torch.testing.assert_close(cart_low_rank(centred, 0.01).double(), expected, rtol=1e-5, atol=1e-10)


# ------------------------------------------------------------------------------------------------------------- SVC
def direct_svc(delta: torch.Tensor, taus: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """SVC as its algorithm states it, from the float64 thin SVD of the merged matrix."""
    d, t = delta.double(), torch.stack([x.double() for x in taus])
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    merged = u.T @ d
    tasks = torch.einsum("mr,kmn->krn", u, t)
    coefficients = (merged * tasks).sum(-1) / tasks.square().sum(-1).clamp_min(1e-12)
    gamma = len(taus) / torch.nan_to_num(coefficients, nan=alpha, neginf=alpha).clamp_min(alpha).sum(0)
    return ((u * (gamma * s)) @ vh).to(delta.dtype)


@pytest.mark.parametrize("shape", [(16, 24), (24, 16), (20, 20)], ids=["wide", "tall", "square"])
@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_svc_equals_its_definition_through_a_direct_svd(shape, alpha) -> None:
    taus = list(task_matrices(4, *shape, seed=7))
    delta = 0.6 * sum(taus)
    torch.testing.assert_close(svc_matrix(delta, taus, alpha), direct_svc(delta, taus, alpha), rtol=0,
                               atol=1e-6 * float(delta.abs().max()))


@pytest.mark.parametrize("shape", [(30, 8), (8, 30)], ids=["tall", "wide"])
def test_svc_of_a_rank_deficient_merge_and_a_task_that_changed_nothing(shape) -> None:
    g = torch.Generator().manual_seed(8)
    taus = [1e-3 * torch.randn(shape[0], 2, generator=g) @ torch.randn(2, shape[1], generator=g) for _ in range(2)]
    taus.append(torch.zeros(shape))
    delta = sum(taus)
    torch.testing.assert_close(svc_matrix(delta, taus, 0.1), direct_svc(delta, taus, 0.1), rtol=0,
                               atol=1e-6 * float(delta.abs().max()))


@pytest.mark.parametrize("transpose", [False, True], ids=["tall", "wide"])
def test_svc_by_hand(transpose) -> None:
    """Tasks on orthogonal directions (Δ_i = s_i·e_a e_bᵀ, distinct rows and columns, so every response off its own
    direction is exactly 0), merged by task arithmetic at λ: along u_i task i responds with coefficient λ and the
    others with 0, so γ_i = K / (max(α, λ) + (K − 1)·α). Two equal tasks merged at λ: coefficient 2λ for both,
    γ = 1 / max(α, 2λ): the over-accumulated direction comes back to one task's size."""
    def entry(value, row, col):
        out = torch.zeros(7, 5)
        out[row, col] = value
        return out.T if transpose else out

    taus = [entry(3.0, 4, 1), entry(2.0, 0, 3), entry(0.5, 6, 2)]
    for lam, alpha in [(0.3, 0.1), (0.3, 0.5), (1.0, 0.1)]:
        gamma = 3 / (max(alpha, lam) + 2 * alpha)
        expected = sum(gamma * lam * t for t in taus)
        torch.testing.assert_close(svc_matrix(lam * sum(taus), taus, alpha), expected, rtol=0, atol=1e-6)
    shared = [taus[0], taus[0].clone()]
    torch.testing.assert_close(svc_matrix(0.8 * sum(shared), shared, 0.1), taus[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("method", calibrated_methods())
def test_calibrate_svc_after_every_merge_that_yields_a_task_matrix(tiny_paths, method) -> None:
    """Every method that takes ``calibrate``: each 2-D tensor is θ₀ + SVC(θ_merged − θ₀) of the plain merge, every
    other tensor the plain merge's."""
    base, models = tiny_paths
    fast = {"steps": 20} if method == "wudi" else {}
    plain = hf_mloss.merge(base, models, method, progress=False, **fast).model.state_dict()
    ours = hf_mloss.merge(base, models, method, calibrate="svc", alpha=0.3, progress=False, **fast)
    theta0 = {k.removeprefix("vision_model."): v for k, v in load_file(str(Path(base) / "model.safetensors")).items()}
    fts = [{k.removeprefix("vision_model."): v for k, v in load_file(str(Path(m) / "model.safetensors")).items()}
           for m in models]
    calibrated = 0
    for name, value in ours.model.state_dict().items():
        if value.dim() != 2:
            assert torch.equal(value, plain[name]), name
            continue
        expected = theta0[name] + svc_matrix(plain[name] - theta0[name], [ft[name] - theta0[name] for ft in fts], 0.3)
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6), name
        calibrated += not torch.allclose(value, plain[name], atol=1e-6)
    assert calibrated >= 6
    assert ours.config.parameters == {"calibrate": "svc", "alpha": 0.3, **fast}


def test_methods_take_calibrate_and_their_fusion_bench_alpha() -> None:
    assert {"wudi", "cart"} <= set(list_methods())
    assert set(calibrated_methods()) == {"average", "task_arithmetic", "ties", "dare_ties", "dare_linear", "tsv_m",
                                         "iso_c", "iso_cts", "wudi", "cart"}
    alphas = {m: type(get_method(m).make_params()).SVC_ALPHA for m in calibrated_methods()}
    assert alphas["task_arithmetic"] == alphas["ties"] == alphas["iso_c"] == alphas["average"] == 0.1
    assert alphas["iso_cts"] == 0.2 and alphas["tsv_m"] == alphas["wudi"] == 1.0
    assert not {"calibrate", "alpha"} & set(get_method("adarank_tsv").make_params().to_dict())  # learned: none
    assert get_method("wudi").make_params().to_dict() == {"lam": 1.0, "steps": 400, "lr": 1e-5, "calibrate": None,
                                                          "alpha": None}
    assert get_method("cart").make_params().to_dict() == {"lam": 1.0, "fraction": 0.08, "calibrate": None,
                                                          "alpha": None}
    assert "2503.08099" in get_method("wudi").reference_url and "2412.12153" in get_method("cart").reference_url


@pytest.mark.parametrize(("method", "params", "match"), [
    ("slerp", {"calibrate": "svc"}, "does not yield one it could calibrate"),
    ("m_ties", {"calibrate": "svc"}, "does not yield one"),
    ("tsv_m", {"alpha": 0.5}, "only applies with calibrate='svc'"),
    ("tsv_m", {"calibrate": "svd"}, r"calibrate must be one of \['svc'\]"),
    ("ties", {"calibrate": "svc", "alpha": 0.0}, "alpha must be a number in"),
    ("cart", {"fraction": 0.0}, "fraction must be a number in"),
    ("wudi", {"steps": -1}, "steps must be an integer"),
    ("wudi", {"lr": 0.0}, "lr must be a number in"),
])
def test_bad_parameters_are_refused(method, params, match) -> None:
    with pytest.raises(InvalidParameterError, match=match):
        get_method(method).make_params(**params)


def test_combination_cat_refuses_a_calibrated_linear_merge(tiny_paths) -> None:
    base, models = tiny_paths
    with pytest.raises(InvalidParameterError, match="is calibrated after the merge"):
        MergeConfig(base=base, models=models, method="task_arithmetic", parameters={"calibrate": "svc"},
                    output="adapter", combination="cat")


# ---------------------------------------------------------------------------------- recipe, card, searches
def test_calibrated_recipe_round_trips_bit_for_bit_and_the_card_says_so(tiny_paths, tmp_path) -> None:
    base, models = tiny_paths
    result = hf_mloss.merge(base, models, "iso_cts", lam=1.5, calibrate="svc", progress=False)
    result.save_pretrained(tmp_path / "out")
    saved = yaml.safe_load((tmp_path / "out" / "hf_mloss_config.yaml").read_text())
    assert saved["parameters"] == {"lam": 1.5, "calibrate": "svc"}
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Singular Value Calibration" in card and "2602.05536" in card and "α = 0.2" in card
    assert "calibrate" in card and "alpha" in card  # the parameters as they ran, α resolved
    again = hf_mloss.run(MergeConfig.from_pretrained(str(tmp_path / "out")), progress=False)
    a, b = result.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_yaml_and_cli_run_wudi_and_cart(tiny_paths, tmp_path) -> None:
    from hf_mloss.cli import main

    base, models = tiny_paths
    path = tmp_path / "cart.yaml"
    path.write_text(yaml.safe_dump({"base": base, "models": models, "method": "cart",
                                    "parameters": {"lam": 2.0, "fraction": 0.12, "calibrate": "svc", "alpha": 0.5}}))
    assert main(["merge", str(path), str(tmp_path / "out"), "-q"]) == 0
    direct = hf_mloss.merge(base, models, "cart", lam=2.0, fraction=0.12, calibrate="svc", alpha=0.5, progress=False)
    saved = {k.removeprefix("vision_model."): v
             for k, v in load_file(str(tmp_path / "out" / "model.safetensors")).items()}
    ours = direct.model.state_dict()
    assert all(torch.equal(saved[k].float(), ours[k]) for k in ours)
    assert "2412.12153" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize(("method", "fixed"), [("cart", {}), ("task_arithmetic", {"calibrate": "svc"})])
def test_selection_over_lam_merges_each_lam_where_it_does_not_rescale(tiny_paths, image_folder, method, fixed
                                                                      ) -> None:
    """CART (λ scales only the low-rank part) and a calibrated merge (SVC after λ): each λ of the grid is its own
    merge, so the chosen candidate is the direct merge at that λ, not θ₀ + λ·τ(1)."""
    from examples.tiny import tiny_processor
    from hf_mloss.loading.data import load_pixel_values

    assert not get_method(method).scales_with_lam({"lam": 1.0, **fixed})
    assert get_method("task_arithmetic").scales_with_lam({"lam": 1.0})
    pixels, _ = load_pixel_values(str(image_folder), tiny_processor(), num_samples=8)
    base, models = tiny_paths
    grid = {"lam": [0.3, 1.0, 2.5]}
    result = hf_mloss.merge(base, models, method, data=pixels, batch_size=4, progress=False, select="unlabeled",
                            grid=grid, **fixed)
    select = result.config.select
    assert [c["setting"] for c in select.candidates] == [{"lam": v} for v in grid["lam"]]
    values = [c["output"] for c in select.candidates]
    assert len(set(values)) == 3
    for candidate, lam in zip(select.candidates, grid["lam"]):  # each candidate is that λ's own merge
        direct = hf_mloss.merge(base, models, method, lam=lam, progress=False, **fixed)
        if candidate["setting"] == select.chosen:
            a, b = result.model.state_dict(), direct.model.state_dict()
            assert max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point()) < 1e-6


def test_auto_chooses_among_wudi_cart_and_a_calibrated_merge(tiny_paths, image_folder) -> None:
    """The new methods are candidates by name (on their own grids, not among the defaults) and a calibrated merge by
    its grid; the recorded choice re-runs bit for bit."""
    from examples.tiny import tiny_processor
    from hf_mloss.loading.data import load_pixel_values
    from hf_mloss.methods.auto import CANDIDATE_GRIDS, DEFAULT_CANDIDATES, candidate_grids

    assert not {"wudi", "cart"} & set(DEFAULT_CANDIDATES)
    assert candidate_grids(["wudi", "cart"]) == {"wudi": CANDIDATE_GRIDS["wudi"], "cart": CANDIDATE_GRIDS["cart"]}
    pixels, _ = load_pixel_values(str(image_folder), tiny_processor(), num_samples=8)
    base, models = tiny_paths
    candidates = {"wudi": {"steps": [30], "lam": [1.0]}, "cart": {"lam": [1.0, 2.0]},
                  "tsv_m": {"calibrate": ["svc"], "lam": [1.0, 1.5]}}
    result = hf_mloss.merge(base, models, "auto", data=pixels, batch_size=4, candidates=candidates,
                            compare_samples=8, progress=False)
    scored = result.config.parameters["scored"]
    assert [(c["method"], c["setting"]) for c in scored] == [
        ("wudi", {"steps": 30, "lam": 1.0}), ("cart", {"lam": 1.0}), ("cart", {"lam": 2.0}),
        ("tsv_m", {"calibrate": "svc", "lam": 1.0}), ("tsv_m", {"calibrate": "svc", "lam": 1.5})]
    chosen = result.config.parameters["chosen"]
    direct = hf_mloss.merge(base, models, chosen["method"], progress=False, **chosen["parameters"])
    a, b = result.model.state_dict(), direct.model.state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point()) < 1e-6
    again = hf_mloss.run(result.config, progress=False)
    assert all(torch.equal(a[k], again.model.state_dict()[k]) for k in a)
