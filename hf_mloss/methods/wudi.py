"""WUDI merging: per layer matrix, the merged task matrix that least disturbs each task's own input directions,
found by gradient descent from the task-arithmetic sum.

For a layer matrix with task matrices τ_i = α_p·(θ_p − θ₀) (``[m, n]``; α_p = 1 by default), WUDI (Cheng et al.)
minimises

    L(τ) = Σ_i ‖(τ − τ_i) τ_iᵀ‖²_F / ‖τ_i‖²_F

(the interference τ − τ_i that task i's own rows, its task vector, would pick up) by Adam from τ = Σ_i τ_i, and
merges θ = θ₀ + λ·τ. As fusion-bench's ``wudi_merging``: learning rate 1e-5 (torch's Adam defaults otherwise), 400
iterations (its configuration's ``iter_num``), the start at the sum, every 2-D tensor a matrix, float32 on the run's
device; every other tensor takes the mean task vector (1/q)·Σ_i τ_i. λ = 1 is theirs (the merged τ is added as it is).

**The exact gradient, one product per step.** L is quadratic in τ: ∇L = 2·Σ_i (τ − τ_i)·τ_iᵀτ_i / ‖τ_i‖² =
2·(τ·G − C), with the input-side matrix G = Σ_i τ̂_iᵀτ̂_i (``[n, n]``, τ̂_i = τ_i / ‖τ_i‖) and C = Σ_i τ_i·τ̂_iᵀτ̂_i
(``[m, n]``), both fixed: they are formed once (in float64, rounded to float32) and each Adam step costs the one
product τ·G (m·n² multiply-adds) instead of the 3·q products of autograd on the literal loss (q·m²·n each). Where
the stacked τ̂ (``[q·m, n]``) is the cheaper factor (2·q·m < n), the step is (τ·τ̂ᵀ − P)·τ̂ with P the rows of τ_i·τ̂_iᵀ
instead (2·q·m²·n). The iterates are the reference's: the same Adam (torch.optim.Adam, the same device and dtype) fed
the same gradient up to float32 rounding. A task that left the matrix unchanged (τ_i = 0) has no term (its term is
0/0 in the reference, which then returns NaN for the matrix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .._validation import param
from .base import MergeContext, MergeMethod, MethodParams
from .registry import register_merge_method
from .svc import alpha_param, calibrate_param

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class WudiParams(MethodParams):
    lam: float = param(1.0, "λ: θ = θ₀ + λ·τ_merged (1: the merged task vector as it is, as the authors and "
                       "fusion-bench).")
    steps: int = param(400, "Adam iterations per layer matrix (fusion-bench's iter_num: 400).", low=0, high=1_000_000)
    lr: float = param(1e-5, "Adam learning rate (the authors' and fusion-bench's 1e-5).", low=0.0, high=1.0,
                      low_open=True)
    calibrate: str | None = calibrate_param()
    alpha: float | None = alpha_param(1.0)

    SVC_ALPHA: ClassVar[float] = 1.0


class Wudi(MergeMethod):
    """WUDI: per layer matrix, Adam on the interference each task's own rows pick up, from the summed task vectors."""

    name = "wudi"
    pretty_name = "WUDI merging"
    reference = ("Cheng et al., Whoever Started the Interference Should End It: Guiding Data-Free Model Merging via "
                 "Task Vectors, ICML 2025")
    reference_url = "https://arxiv.org/abs/2503.08099"
    params_class = WudiParams
    zero_delta_is_base = True
    default_weight = "one"

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        from .svd_ops import is_finite, is_matrix, mean_task_vector, weighted_task_vectors

        params: WudiParams = ctx.params
        taus = weighted_task_vectors(base, sources, ctx.weights)
        if is_matrix(base) and is_finite(taus):
            merged = wudi_matrix(taus, params.steps, params.lr)
        else:
            merged = mean_task_vector(taus)
        return base + params.lam * merged


def wudi_matrix(taus: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    """WUDI's merged task matrix of the ``[q, m, n]`` task matrices ``taus`` (Adam from their sum)."""
    import torch

    merged = torch.nn.Parameter(taus.sum(0))
    flat = taus.flatten(1)
    active = (flat.amax(1) > 0) | (flat.amin(1) < 0)  # no |τ| copy of the stack
    if steps == 0 or not bool(active.any()):
        return merged.detach()
    step = _gradient(taus if bool(active.all()) else taus[active])
    optimizer = torch.optim.Adam([merged], lr=lr, weight_decay=0)
    for _ in range(steps):
        merged.grad = step(merged.detach())
        optimizer.step()
    return merged.detach()


def _gradient(taus: torch.Tensor):
    """∇L as a function of τ, from the fixed products of the (non-zero) task matrices ``taus`` ``[q, m, n]``, formed
    one task at a time in float64 (the whole stack in float64 would hold two more copies of the task matrices at
    twice their size)."""
    import torch

    q, m, n = taus.shape

    def unit(i: int) -> tuple[torch.Tensor, torch.Tensor]:  # τ_i and τ̂_i = τ_i / ‖τ_i‖, in float64
        t = taus[i].double()
        return t, t / torch.linalg.vector_norm(t)

    if 2 * q * m < n:  # (τ·τ̂ᵀ − P)·τ̂, τ̂ stacked [q·m, n]: 2·q·m²·n per step
        stacked = taus.new_empty(q * m, n)
        rows = taus.new_empty(m, q * m)  # P: block i = τ_i τ̂_iᵀ
        for i in range(q):
            t, u = unit(i)
            stacked[i * m:(i + 1) * m] = u
            rows[:, i * m:(i + 1) * m] = t @ u.T
        return lambda tau: torch.mm(torch.addmm(rows, tau, stacked.T, beta=-2, alpha=2), stacked)
    gram = torch.zeros(n, n, dtype=torch.float64, device=taus.device)  # G = Σ τ̂_iᵀ τ̂_i: [n, n]
    fixed = torch.zeros(m, n, dtype=torch.float64, device=taus.device)  # C = Σ τ_i (τ̂_iᵀ τ̂_i)
    for i in range(q):  # in place: no [n, n] temporary beside G
        t, u = unit(i)
        gram.addmm_(u.T, u)
        if m < n:  # each product of C's term in the cheaper order
            fixed.addmm_(t @ u.T, u)
        else:
            fixed.addmm_(t, u.T @ u)
    gram32, fixed32 = gram.to(taus.dtype), fixed.to(taus.dtype)
    return lambda tau: torch.addmm(fixed32, tau, gram32, beta=-2, alpha=2)  # 2·(τ·G − C): m·n² per step


register_merge_method(Wudi())
