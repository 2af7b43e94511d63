"""Tests for `hf_mloss.methods.ops`: trimming, sign election / disjoint merge, DARE masks, seeds, exact selection.

Every primitive is checked against hand-computed numbers or an independent reference written here (plain Python /
numpy, a different algorithm from the library's).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_mloss.methods.base import MergeContext
from hf_mloss.methods.ops import (
    ExactKthLargest,
    dare_drop,
    elect_and_merge,
    keep_count,
    magnitude_threshold,
    tensor_seed,
    trim_by_threshold,
    trim_elect_merge,
    trim_rows,
    trim_tensor,
)

HYPOTHESIS = settings(max_examples=50, deadline=None)


# --------------------------------------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------------------------------------


def ref_top_m_mask(values: list[float], m: int) -> list[bool]:
    """Keep the m largest |v| (plain Python: sort indices by magnitude, descending). Assumes distinct magnitudes."""
    order = sorted(range(len(values)), key=lambda i: -abs(values[i]))
    kept = set(order[: max(m, 0)])
    return [i in kept for i in range(len(values))]


def distinct_tensor(n: int, seed: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """n entries with distinct magnitudes 1..n (random order, random signs), scaled."""
    g = torch.Generator().manual_seed(seed)
    mags = (torch.randperm(n, generator=g) + 1).float() * 0.01
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    t = mags * signs
    return t.reshape(shape) if shape is not None else t


# --------------------------------------------------------------------------------------------------------------------
# keep_count / magnitude_threshold
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("numel", "keep", "kwargs", "expected"),
    [
        (10, 0.25, {}, 2),  # floor(2.5)
        (10, 0.2, {}, 2),
        (7, 0.5, {}, 3),  # floor(3.5)
        (10, 0.05, {}, 0),  # floor(0.5) = 0: an empty trim
        (10, 0.05, {"min_keep": 1}, 1),  # mergekit: never empty
        (10, 0.25, {"min_keep": 1}, 2),  # min_keep only matters below 1
        (10, 0.25, {"extra": 1}, 3),  # fusion_bench: one more than floor
        (10, 0.05, {"extra": 1}, 1),
        (10, 1.0, {}, 10),
        (10, 1.0, {"extra": 1}, 10),  # never more than numel
        (10, 0.99, {"extra": 1}, 10),
        (1000, 0.2, {}, 200),
        (64, 0.3, {}, 19),  # floor(19.2)
    ],
)
def test_keep_count(numel, keep, kwargs, expected) -> None:
    assert keep_count(numel, keep, **kwargs) == expected


@pytest.mark.parametrize("kind", ["normal", "heavy_ties", "constant", "two_values", "spike"])
@pytest.mark.parametrize("keep", [1e-6, 0.02, 0.2, 0.5, 0.97, 0.999999])
def test_magnitude_threshold_large_tensors_equal_kthvalue(kind: str, keep: float) -> None:
    """Above 2^18 entries the threshold comes from a sample bracket; it must still be the exact m-th largest,
    including for distributions where the bracket fails (constant, two values, a spike) and the full selection runs."""
    n = 512 * 600  # > 2^18
    g = torch.Generator().manual_seed(7)
    mag = {
        "normal": lambda: torch.randn(n, generator=g).abs(),
        "heavy_ties": lambda: torch.randint(0, 50, (n,), generator=g).float(),
        "constant": lambda: torch.full((n,), 0.25),
        "two_values": lambda: (torch.rand(n, generator=g) < 0.2).float(),
        "spike": lambda: torch.cat([torch.zeros(n - 7), torch.arange(1.0, 8.0)]),
    }[kind]()
    m = max(1, int(n * keep))
    assert magnitude_threshold(mag.view(512, 600), m) == mag.kthvalue(n - m + 1).values.item()


@pytest.mark.parametrize("keep", [0.01, 0.2, 0.5, 0.9])
@pytest.mark.parametrize("kind", ["bfloat16_task_vector", "tie_at_target"])
def test_a_wide_bracket_is_bracketed_again_and_stays_exact(monkeypatch, kind: str, keep: float) -> None:
    """The magnitudes of a bfloat16 task vector take few distinct values, so the sample's bracket holds many entries:
    they are bracketed again before any selection (a bracket of one value is that value), with the same exact
    result as kthvalue."""
    from hf_mloss.methods import ops

    n = 1 << 22
    g = torch.Generator().manual_seed(11)
    if kind == "bfloat16_task_vector":  # θ_p − θ₀ as stored: both rounded to bfloat16
        base = 0.02 * torch.randn(n, generator=g)
        mag = ((base + 1e-3 * torch.randn(n, generator=g)).bfloat16().float() - base.bfloat16().float()).abs()
    else:  # 40 % of the entries on one value, the target among them for most keeps
        mag = torch.rand(n, generator=g)
        mag[torch.randperm(n, generator=g)[: 4 * n // 10]] = 0.5
    calls = []
    bracketed = ops._bracketed_kth_largest
    monkeypatch.setattr(ops, "_bracketed_kth_largest",
                        lambda flat, m, **kw: calls.append(kw.get("shrink")) or bracketed(flat, m, **kw))
    m = keep_count(n, keep)
    assert magnitude_threshold(mag, m) == mag.kthvalue(n - m + 1).values.item()
    if kind == "bfloat16_task_vector" and keep in (0.2, 0.5):  # the first bracket holds ≥ 2^18 entries there
        assert calls[0] is None and calls[1] is not None  # bracketed again


def test_magnitude_threshold_hand_values() -> None:
    mag = torch.tensor([0.5, 3.0, 1.0, 2.0])
    assert magnitude_threshold(mag, 1) == 3.0
    assert magnitude_threshold(mag, 2) == 2.0
    assert magnitude_threshold(mag, 3) == 1.0
    assert magnitude_threshold(mag, 0) == math.inf
    assert magnitude_threshold(mag, -2) == math.inf
    assert magnitude_threshold(mag, 5) == -math.inf
    # m == n keeps everything: the threshold is at most the smallest value
    assert magnitude_threshold(mag, 4) <= 0.5
    # 2-D input, duplicates
    mag2 = torch.tensor([[4.0, 1.0, 4.0], [2.0, 4.0, 0.0]])
    assert magnitude_threshold(mag2, 1) == 4.0
    assert magnitude_threshold(mag2, 3) == 4.0
    assert magnitude_threshold(mag2, 4) == 2.0
    assert magnitude_threshold(mag2, 5) == 1.0


def test_magnitude_threshold_matches_sort_reference() -> None:
    g = torch.Generator().manual_seed(3)
    mag = torch.rand(257, generator=g)
    ordered = sorted(mag.tolist(), reverse=True)
    for m in [1, 2, 17, 100, 256]:
        assert magnitude_threshold(mag, m) == ordered[m - 1]


# --------------------------------------------------------------------------------------------------------------------
# trim_tensor / trim_by_threshold
# --------------------------------------------------------------------------------------------------------------------


def test_trim_tensor_hand_example() -> None:
    tau = torch.tensor([0.1, -0.5, 0.3, -0.2, 0.4, 0.0, -0.05, 0.25, 0.35, -0.45])
    # k = 0.3 → floor(3.0) = 3 kept: -0.5, -0.45, 0.4
    expected = torch.tensor([0.0, -0.5, 0.0, 0.0, 0.4, 0.0, 0.0, 0.0, 0.0, -0.45])
    assert torch.equal(trim_tensor(tau, 0.3), expected)
    # k = 0.5 → 5 kept: add 0.35 and 0.3
    expected5 = torch.tensor([0.0, -0.5, 0.3, 0.0, 0.4, 0.0, 0.0, 0.0, 0.35, -0.45])
    assert torch.equal(trim_tensor(tau, 0.5), expected5)
    # extra=1 → 4 kept; min_keep=1 with k=0.05 → 1 kept
    expected4 = torch.tensor([0.0, -0.5, 0.0, 0.0, 0.4, 0.0, 0.0, 0.0, 0.35, -0.45])
    assert torch.equal(trim_tensor(tau, 0.3, extra=1), expected4)
    expected1 = torch.zeros(10)
    expected1[1] = -0.5
    assert torch.equal(trim_tensor(tau, 0.05, min_keep=1), expected1)


@pytest.mark.parametrize("keep", [0.01, 0.1, 0.2, 0.25, 0.5, 0.73, 0.99])
@pytest.mark.parametrize("shape", [(100,), (10, 10), (4, 5, 6)])
def test_trim_tensor_exact_count_on_distinct_values(keep, shape) -> None:
    n = math.prod(shape)
    tau = distinct_tensor(n, seed=n, shape=shape)
    original = tau.clone()
    out = trim_tensor(tau, keep)
    assert torch.equal(tau, original), "input must not be modified"
    assert out.shape == tau.shape
    m = math.floor(n * keep)
    assert int((out != 0).sum()) == m
    expected_mask = torch.tensor(ref_top_m_mask(tau.flatten().tolist(), m)).reshape(shape)
    assert torch.equal(out != 0, expected_mask)
    assert torch.equal(out[expected_mask], tau[expected_mask])  # kept entries unchanged (no rescale)


def test_trim_tensor_zero_count_zeroes_everything() -> None:
    tau = distinct_tensor(30, seed=1)
    out = trim_tensor(tau, 0.02)  # floor(0.6) = 0
    assert torch.equal(out, torch.zeros_like(tau))


def test_trim_tensor_keep_one_keeps_all() -> None:
    tau = distinct_tensor(30, seed=2)
    out = trim_tensor(tau, 1.0)
    assert torch.equal(out, tau)
    assert out.data_ptr() != tau.data_ptr()


def test_trim_tensor_ties_keep_more() -> None:
    # the 1st largest magnitude (1.0) is shared by three entries: all of them are kept (SPEC §3 tie rule)
    tau = torch.tensor([1.0, -1.0, 1.0, 0.5, -0.25, 0.125, 0.0, 0.0, 0.0, 0.0])
    out = trim_tensor(tau, 0.1)
    assert torch.equal(out, torch.tensor([1.0, -1.0, 1.0, 0, 0, 0, 0, 0, 0, 0]))


def test_trim_by_threshold() -> None:
    tau = torch.tensor([0.1, -0.5, 0.3, -0.2, 0.3])
    assert torch.equal(trim_by_threshold(tau, 0.3), torch.tensor([0.0, -0.5, 0.3, 0.0, 0.3]))
    assert torch.equal(trim_by_threshold(tau, math.inf), torch.zeros(5))
    assert torch.equal(trim_by_threshold(tau, -math.inf), tau)


# --------------------------------------------------------------------------------------------------------------------
# trim_rows
# --------------------------------------------------------------------------------------------------------------------


def test_trim_rows_per_row_counts() -> None:
    n_in = 10
    tau = distinct_tensor(5 * n_in, seed=7, shape=(5, n_in))
    original = tau.clone()
    keep = torch.tensor([0.5, 0.0, 0.25, 1.0, 0.09])
    out = trim_rows(tau, keep)
    assert torch.equal(tau, original)
    expected_counts = [5, 0, 2, 10, 0]  # floor(10·keep_i)
    assert [int(c) for c in (out != 0).sum(1)] == expected_counts
    for i in range(5):
        mask = torch.tensor(ref_top_m_mask(tau[i].tolist(), expected_counts[i]))
        assert torch.equal(out[i] != 0, mask), f"row {i}"
        assert torch.equal(out[i][mask], tau[i][mask])
    assert torch.equal(out[1], torch.zeros(n_in))  # keep 0 → empty row
    assert torch.equal(out[3], tau[3])  # keep 1 → full row


def test_trim_rows_hand_example() -> None:
    tau = torch.tensor([[0.1, -0.4, 0.3, 0.2], [-0.9, 0.8, -0.7, 0.6], [1.0, 2.0, 3.0, 4.0]])
    keep = torch.tensor([0.5, 0.25, 0.75])
    expected = torch.tensor([[0.0, -0.4, 0.3, 0.0], [-0.9, 0.0, 0.0, 0.0], [0.0, 2.0, 3.0, 4.0]])
    assert torch.equal(trim_rows(tau, keep), expected)


def test_trim_rows_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="2-D"):
        trim_rows(torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match="one keep ratio per row"):
        trim_rows(torch.zeros(3, 4), torch.ones(4))


# --------------------------------------------------------------------------------------------------------------------
# elect_and_merge: a hand-worked example (3 tasks × 5 entries)
# --------------------------------------------------------------------------------------------------------------------

# columns: c0 plain agreement; c1 unweighted sum exactly 0 (tie → +1); c2 weighted sum exactly 0 (tie → +1) while the
# unweighted sum is negative; c3 all zero → 0; c4 a single (negative) contributor.
TAUS = torch.tensor(
    [
        [1.0, -2.0, -3.0, 0.0, 0.0],
        [2.0, 1.0, 1.0, 0.0, -1.0],
        [-1.0, 1.0, 1.0, 0.0, 0.0],
    ]
)
W = torch.tensor([1.0, 2.0, 1.0])
# weighted sums Σ w τ:   [4, 1, 0, 0, -2]  → signs [+, +, + (tie), + (tie, nobody agrees), -]
# unweighted sums Σ τ:   [2, 0, -1, 0, -1] → signs [+, + (tie), -, +, -]
# agreeing numerators Σ w τ (weighted elect):   [1+4, 2+1, 2+1, 0, -2] = [5, 3, 3, 0, -2]
#   Σ w over agreeing: [3, 3, 3, 0, 2];  #agreeing: [2, 2, 2, 0, 1]
# unweighted elect differs only in c2: task 1 alone agrees (−3, w=1): numerator −3, Σw 1, count 1
HAND_EXPECTED = {
    ("weighted", "weights"): [5 / 3, 1.0, 1.0, 0.0, -1.0],
    ("weighted", "count"): [2.5, 1.5, 1.5, 0.0, -2.0],
    ("weighted", "none"): [5.0, 3.0, 3.0, 0.0, -2.0],
    ("unweighted", "weights"): [5 / 3, 1.0, -3.0, 0.0, -1.0],
    ("unweighted", "count"): [2.5, 1.5, -3.0, 0.0, -2.0],
    ("unweighted", "none"): [5.0, 3.0, -3.0, 0.0, -2.0],
}


@pytest.mark.parametrize(("elect", "divide_by"), sorted(HAND_EXPECTED))
@pytest.mark.parametrize("as_list", [True, False])
def test_elect_and_merge_hand_example(elect, divide_by, as_list) -> None:
    taus = list(TAUS) if as_list else TAUS
    original = TAUS.clone()
    out = elect_and_merge(taus, W, elect=elect, divide_by=divide_by)
    assert torch.equal(TAUS, original)
    torch.testing.assert_close(out, torch.tensor(HAND_EXPECTED[(elect, divide_by)]), atol=1e-6, rtol=0)


def test_elect_and_merge_defaults_are_weighted_disjoint_mean() -> None:
    out = elect_and_merge(TAUS, W)
    torch.testing.assert_close(out, torch.tensor(HAND_EXPECTED[("weighted", "weights")]), atol=1e-6, rtol=0)


def test_elect_and_merge_uniform_weights_is_plain_disjoint_mean() -> None:
    # uniform α: signs [+, + (tie), -, +, -]; dis-mean: c0 (1+2)/2, c1 (1+1)/2, c2 -3, c3 0, c4 -1
    out = elect_and_merge(TAUS, torch.full((3,), 1 / 3))
    torch.testing.assert_close(out, torch.tensor([1.5, 1.0, -3.0, 0.0, -1.0]), atol=1e-6, rtol=0)
    # scale invariance of the weighted mean
    out2 = elect_and_merge(TAUS, torch.ones(3))
    torch.testing.assert_close(out, out2, atol=1e-6, rtol=0)


def test_elect_and_merge_zero_weight_task_never_contributes() -> None:
    # task 2 has weight 0: the weighted election ignores it and its value never enters the mean
    taus = torch.tensor([[1.0, -1.0], [-5.0, 3.0], [2.0, -1.0]])
    out = elect_and_merge(taus, torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(out, torch.tensor([1.5, -1.0]), atol=1e-6, rtol=0)


def ref_elect_and_merge(taus: np.ndarray, w: np.ndarray, elect: str, divide_by: str) -> np.ndarray:
    """Per-entry loop reference of SPEC §4 / PEERS B (float64)."""
    q, n = taus.shape
    out = np.zeros(n)
    for j in range(n):
        s = sum((w[p] if elect == "weighted" else 1.0) * taus[p, j] for p in range(q))
        sign = 1.0 if s >= 0 else -1.0
        agree = [p for p in range(q) if taus[p, j] != 0 and math.copysign(1.0, taus[p, j]) == sign]
        num = sum(w[p] * taus[p, j] for p in agree)
        if divide_by == "none":
            out[j] = num
        else:
            den = sum(w[p] for p in agree) if divide_by == "weights" else len(agree)
            out[j] = num / den if den > 0 else 0.0
    return out


@pytest.mark.parametrize("elect", ["weighted", "unweighted"])
@pytest.mark.parametrize("divide_by", ["weights", "count", "none"])
def test_elect_and_merge_matches_loop_reference_random(elect, divide_by) -> None:
    g = torch.Generator().manual_seed(11)
    taus = torch.randn(4, 300, generator=g)
    taus = torch.where(torch.rand(4, 300, generator=g) < 0.4, taus, torch.zeros_like(taus))  # sparse, like trimmed
    w = torch.tensor([0.5, 1.5, 0.25, 2.0])
    out = elect_and_merge(taus, w, elect=elect, divide_by=divide_by)
    ref = ref_elect_and_merge(taus.double().numpy(), w.double().numpy(), elect, divide_by)
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("q", [2, 3])
@pytest.mark.parametrize("elect, divide_by", [("weighted", "weights"), ("unweighted", "count"), ("weighted", "none")])
def test_trim_elect_merge_gives_the_bits_of_the_steps_one_after_the_other(q, elect, divide_by) -> None:
    """The fused kernel (every step of a chunk while it is in cache) equals trim, elect and merge taken one after the
    other on the whole piece, bit for bit: several chunks and a partial last one, thresholds inside the spread, one
    that keeps nothing and one that keeps everything."""
    g = torch.Generator().manual_seed(5)
    numel = 5 * (1 << 17) // q + 777
    base = torch.randn(numel, generator=g)
    sources = list((base + 0.01 * torch.randn(q, numel, generator=g)).bfloat16().float().unbind(0))
    thresholds = [0.008, float("inf"), float("-inf")][:q]
    weights = torch.tensor([0.5, 1.5, 0.25][:q])
    fused = trim_elect_merge(base, sources, thresholds, weights, lam=0.7, elect=elect, divide_by=divide_by)
    taus = torch.stack(sources) - base
    for tau, threshold in zip(taus, thresholds):
        tau.copy_(trim_by_threshold(tau, threshold))
    steps = base + 0.7 * elect_and_merge(taus, weights, elect=elect, divide_by=divide_by)
    assert torch.equal(fused.view(torch.int32), steps.view(torch.int32))
    assert 0 < int(torch.count_nonzero(fused != base)) < numel


# --------------------------------------------------------------------------------------------------------------------
# DARE
# --------------------------------------------------------------------------------------------------------------------


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_dare_drop_seed_reproducible_and_seed_dependent() -> None:
    tau = torch.randn(40, 25, generator=gen(0))
    a = dare_drop(tau, 0.6, gen(123))
    b = dare_drop(tau, 0.6, gen(123))
    c = dare_drop(tau, 0.6, gen(124))
    assert torch.equal(a, b)
    assert not torch.equal(a != 0, c != 0)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.7, 0.9])
def test_dare_drop_inverse_rescale(p) -> None:
    tau = torch.randn(50, 40, generator=gen(1))
    original = tau.clone()
    out = dare_drop(tau, p, gen(5))
    assert torch.equal(tau, original)
    mask = torch.rand(tau.shape, generator=gen(5)) < p  # the same Bernoulli(p) draws, regenerated
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum())))
    torch.testing.assert_close(out[mask], tau[mask] * (1.0 / p), rtol=1e-6, atol=0)
    # every kept entry is scaled by exactly the same factor 1/p (up to float32 round-off)
    ratio = (out[mask].double() / tau[mask].double())
    assert float((ratio - 1.0 / p).abs().max()) < 1e-6 / p
    # the fraction kept is close to p (2000 Bernoulli draws: 5 sigma)
    frac = float(mask.float().mean())
    assert abs(frac - p) < 5 * math.sqrt(p * (1 - p) / tau.numel())


def test_dare_drop_p_one_is_identity() -> None:
    tau = torch.randn(100, generator=gen(2))
    assert torch.equal(dare_drop(tau, 1.0, gen(0)), tau)


@pytest.mark.parametrize("p", [0.2, 0.5, 0.8])
def test_dare_drop_l1_rescale_preserves_l1_norm(p) -> None:
    tau = torch.randn(30, 30, generator=gen(3))
    out = dare_drop(tau, p, gen(9), rescale="l1")
    mask = torch.rand(tau.shape, generator=gen(9)) < p
    assert torch.equal(out != 0, mask)
    np.testing.assert_allclose(float(out.abs().double().sum()), float(tau.abs().double().sum()), rtol=1e-5)
    factor = float(tau.abs().double().sum() / tau[mask].abs().double().sum())
    torch.testing.assert_close(out[mask], tau[mask] * factor, rtol=1e-5, atol=0)
    # L1 matching is not 1/p (mergekit's measured factor ≠ 1/p)
    assert abs(factor - 1 / p) > 1e-4


def test_dare_drop_no_rescale_keeps_survivors() -> None:
    tau = torch.randn(200, generator=gen(4))
    out = dare_drop(tau, 0.5, gen(1), rescale="none")
    mask = torch.rand(tau.shape, generator=gen(1)) < 0.5
    assert torch.equal(out, torch.where(mask, tau, torch.zeros_like(tau)))


def test_dare_drop_l1_all_dropped_is_zero_not_nan() -> None:
    tau = torch.zeros(10)
    out = dare_drop(tau, 0.5, gen(0), rescale="l1")
    assert torch.equal(out, torch.zeros(10))


# --------------------------------------------------------------------------------------------------------------------
# tensor_seed / per-tensor generators
# --------------------------------------------------------------------------------------------------------------------


def test_tensor_seed_deterministic_distinct_and_in_range() -> None:
    names = [f"encoder.layers.{i}.mlp.fc1.weight" for i in range(4)]
    seeds = {(s, n, i): tensor_seed(s, n, i) for s in (0, 1) for n in names for i in range(3)}
    assert len(set(seeds.values())) == len(seeds)  # all distinct
    assert all(0 <= v < 2**63 for v in seeds.values())
    # recomputing in reverse order gives the same values (no hidden state)
    for key in reversed(list(seeds)):
        assert tensor_seed(*key) == seeds[key]


def test_context_generators_do_not_depend_on_visiting_order() -> None:
    ctx = MergeContext(params=None, weights=torch.ones(3), seed=42)
    names = ["a.weight", "b.bias", "c.weight"]
    forward = {(n, i): torch.rand(8, generator=ctx.generator(n, i)) for n in names for i in range(3)}
    backward = {(n, i): torch.rand(8, generator=ctx.generator(n, i))
                for n in reversed(names) for i in reversed(range(3))}
    for key in forward:
        assert torch.equal(forward[key], backward[key])
    assert not torch.equal(forward[("a.weight", 0)], forward[("a.weight", 1)])
    other = MergeContext(params=None, weights=torch.ones(3), seed=43)
    assert not torch.equal(forward[("a.weight", 0)], torch.rand(8, generator=other.generator("a.weight", 0)))
    # the generator is seeded with tensor_seed(seed, name, index)
    expected = torch.rand(8, generator=torch.Generator().manual_seed(tensor_seed(42, "b.bias", 2)))
    assert torch.equal(forward[("b.bias", 2)], expected)


# --------------------------------------------------------------------------------------------------------------------
# ExactKthLargest
# --------------------------------------------------------------------------------------------------------------------


def run_selector(tensors: list[torch.Tensor], m: int) -> float:
    sel = ExactKthLargest(m)
    for t in tensors:
        sel.add_pass1(t)
    sel.finish_pass1()
    for t in tensors:
        sel.add_pass2(t)
    return sel.value()


def random_magnitudes(seed: int, count: int) -> list[torch.Tensor]:
    """Tensors of different sizes/shapes with duplicates, zeros (some all zero), wide exponent range and same-high-bit
    clusters."""
    g = gen(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(1, 400, (1,), generator=g))
        scale = 10.0 ** float(torch.randint(-6, 3, (1,), generator=g))
        t = torch.randn(n, generator=g).abs() * scale
        t[torch.rand(n, generator=g) < 0.15] = 0.0  # zeros
        if n > 4:
            t[: n // 4] = t[n // 4 : 2 * (n // 4)]  # duplicates
        if i % 5 == 4:  # an unchanged tensor (frozen during fine-tuning): all zeros
            t = torch.zeros(n)
        if i % 3 == 0:  # values sharing the same high 16 bits (only pass 2 separates them)
            t = torch.cat([t, 1.0 + torch.arange(50, dtype=torch.float32) * 2**-20])
        shape = (t.numel(),) if i % 2 else (1, t.numel())
        out.append(t.reshape(shape))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_kth_largest_equals_kthvalue_over_concatenation(seed) -> None:
    tensors = random_magnitudes(seed, count=12)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    total = flat.numel()
    descending = np.sort(flat.numpy())[::-1]
    g = gen(100 + seed)
    ms = {1, 2, total // 2, total - 1, total} | {int(x) for x in torch.randint(1, total + 1, (25,), generator=g)}
    for m in sorted(ms):
        expected = flat.kthvalue(total - m + 1).values.item()
        assert expected == descending[m - 1]
        assert run_selector(tensors, m) == expected, f"m={m} of {total}"


def test_exact_kth_largest_edge_cases() -> None:
    tensors = [torch.tensor([0.0, 0.0, 3.0]), torch.tensor([[2.0, 3.0]]), torch.zeros(0)]
    assert run_selector(tensors, 1) == 3.0
    assert run_selector(tensors, 2) == 3.0
    assert run_selector(tensors, 3) == 2.0
    assert run_selector(tensors, 4) == 0.0
    assert run_selector(tensors, 5) == 0.0
    assert run_selector(tensors, 0) == math.inf
    assert run_selector(tensors, 6) == -math.inf
    # all zeros
    assert run_selector([torch.zeros(7)], 3) == 0.0
    # a single tensor, subnormal and huge values
    t = torch.tensor([1e-40, 1e-38, 3e38, 1.0, 1e-45])
    for m in range(1, 6):
        assert run_selector([t], m) == t.kthvalue(6 - m).values.item()


# --------------------------------------------------------------------------------------------------------------------
# Hypothesis properties
# --------------------------------------------------------------------------------------------------------------------

finite32 = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def task_stack(draw, max_q: int = 4, max_n: int = 12):
    q = draw(st.integers(1, max_q))
    n = draw(st.integers(1, max_n))
    values = draw(st.lists(finite32, min_size=q * n, max_size=q * n))
    weights = draw(st.lists(st.floats(0.125, 4.0, width=32), min_size=q, max_size=q))
    return torch.tensor(values, dtype=torch.float32).reshape(q, n), torch.tensor(weights, dtype=torch.float32)


@HYPOTHESIS
@given(data=task_stack(), elect=st.sampled_from(["weighted", "unweighted"]))
def test_property_identical_task_vectors_merge_to_themselves(data, elect) -> None:
    taus, weights = data
    tau = taus[0]
    q = taus.shape[0]
    same = tau.expand(q, -1).clone()
    out = elect_and_merge(same, weights, elect=elect, divide_by="weights")
    torch.testing.assert_close(out, tau, rtol=1e-5, atol=1e-6)
    # PEFT convention: identity when the weights are 1
    out_count = elect_and_merge(same, torch.ones(q), elect=elect, divide_by="count")
    torch.testing.assert_close(out_count, tau, rtol=1e-5, atol=1e-6)


@HYPOTHESIS
@given(
    n=st.integers(1, 60),
    keep=st.floats(0.0, 1.0, exclude_min=True),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_trim_keeps_floor_count_on_distinct_values(n, keep, seed) -> None:
    tau = distinct_tensor(n, seed=seed)
    out = trim_tensor(tau, keep)
    m = math.floor(n * keep)
    assert int((out != 0).sum()) == m
    assert torch.equal(out != 0, torch.tensor(ref_top_m_mask(tau.tolist(), m)))


@HYPOTHESIS
@given(
    rows=st.integers(1, 6),
    n_in=st.integers(1, 20),
    keeps=st.lists(st.floats(0.0, 1.0, width=32), min_size=6, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_trim_rows_keeps_floor_counts(rows, n_in, keeps, seed) -> None:
    tau = distinct_tensor(rows * n_in, seed=seed, shape=(rows, n_in))
    keep = torch.tensor(keeps[:rows], dtype=torch.float32)
    out = trim_rows(tau, keep)
    for i in range(rows):
        m = math.floor(n_in * float(keep[i]))  # float(keep[i]) is the exact float32 value
        assert int((out[i] != 0).sum()) == m
        assert torch.equal(out[i] != 0, torch.tensor(ref_top_m_mask(tau[i].tolist(), m)))


@HYPOTHESIS
@given(
    data=task_stack(),
    keep=st.floats(0.01, 1.0),
    p=st.floats(0.05, 1.0),
    elect=st.sampled_from(["weighted", "unweighted"]),
    divide_by=st.sampled_from(["weights", "count", "none"]),
)
def test_property_outputs_finite_for_finite_inputs(data, keep, p, elect, divide_by) -> None:
    taus, weights = data
    trimmed = torch.stack([trim_tensor(t, keep) for t in taus])
    assert torch.isfinite(trimmed).all()
    rows = trim_rows(taus, torch.full((taus.shape[0],), keep))
    assert torch.isfinite(rows).all()
    for rescale in ("inverse", "l1", "none"):
        assert torch.isfinite(dare_drop(taus, p, gen(0), rescale=rescale)).all()
    out = elect_and_merge(trimmed, weights, elect=elect, divide_by=divide_by)
    assert torch.isfinite(out).all()
    # the merged entry lies within the range of the agreeing values for a mean (weights / count with unit weights)
    if divide_by == "weights":
        lo = trimmed.min(0).values
        hi = trimmed.max(0).values
        assert bool(((out >= lo - 1e-3) & (out <= hi + 1e-3)).all())


@HYPOTHESIS
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_property_exact_kth_largest(sizes, seed, data) -> None:
    g = gen(seed)
    tensors = [(torch.randn(s, generator=g).abs() * 4).round() / 4 for s in sizes]  # many duplicates and zeros
    total = sum(sizes)
    m = data.draw(st.integers(0, total + 1))
    value = run_selector(tensors, m)
    if m <= 0:
        assert value == math.inf
    elif m > total:
        assert value == -math.inf
    else:
        flat = torch.cat(tensors)
        assert value == flat.kthvalue(total - m + 1).values.item()


def test_trim_exact_keeps_exactly_m_even_with_ties():
    from hf_mloss.methods.ops import trim_exact, trim_tensor

    tau = torch.tensor([[0.5, -0.5, 0.5], [0.1, -0.5, 0.2]])
    exact = trim_exact(tau, 2)
    assert int((exact != 0).sum()) == 2 and set(exact[exact != 0].abs().tolist()) == {0.5}
    assert int((trim_tensor(tau, 2 / 6) != 0).sum()) == 4  # the threshold rule keeps every tie at 0.5
    assert torch.equal(trim_exact(tau, 0), torch.zeros_like(tau)) and torch.equal(trim_exact(tau, 6), tau)


def test_zero_sum_sign_rule():
    from hf_mloss.methods.ops import elect_and_merge

    taus = [torch.tensor([0.3, 1.0]), torch.tensor([-0.3, 1.0])]  # entry 0 sums to exactly 0
    w = torch.tensor([0.5, 0.5])
    assert torch.equal(elect_and_merge(taus, w), torch.tensor([0.3, 1.0]))
    assert torch.equal(elect_and_merge(taus, w, zero_positive=False), torch.tensor([-0.3, 1.0]))


def test_fusion_bench_convention_uses_the_model_wide_majority_on_exact_zero_sums():
    from hf_mloss.methods.base import MergeContext
    from hf_mloss.methods.ties import Ties, TiesParams

    base = torch.zeros(6)
    sources = [torch.tensor([0.5, -0.9, -0.8, -0.7, -0.6, 0.0]), torch.tensor([-0.5, -0.9, -0.8, -0.7, -0.6, 0.0])]
    ctx = MergeContext(params=TiesParams(k=1.0, convention="fusion_bench"), weights=torch.tensor([0.5, 0.5]))
    ctx.state["total_numel"] = 6
    Ties().prepare(ctx, lambda fn: fn("w", base, sources))
    assert ctx.state["zero_positive"] is False  # most elected signs are negative
    merged = Ties().merge_tensor("w", base, sources, ctx)
    assert merged[0].item() == -0.5  # the exact-zero entry follows the majority (-), not +1
