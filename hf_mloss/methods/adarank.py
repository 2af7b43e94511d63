"""AdaRank over the SVD merges: masks over the singular components TSV-M, Iso-C and CART keep, learned on unlabeled
data.

TSV-M merges each layer matrix as (U⊥ * Σ) @ V⊥ᵀ, Σ the top k singular values of each task's matrix, task by task
(:func:`~hf_mloss.methods.tsv.tsv_components`); Iso-C as (U * σ̄) @ Vᵀ over the summed task matrix's non-zero
spectrum (:func:`~hf_mloss.methods.iso.iso_c_components`). ``adarank_tsv`` / ``adarank_iso`` give every one of
those components a mask m ∈ {0, 1} and merge θ = θ₀ + λ·(U⊥ * (Σ ⊙ m)) @ V⊥ᵀ (resp. (U * (σ̄·m)) @ Vᵀ): one mask per
component, per task (TSV-M; Iso-C's components belong to the sum of the task matrices, so there is one mask per
component of that sum) and per layer matrix. The factors are computed once; only the masks are trained.

As AdaRank (Lee et al.), each mask is a logit l with m = 1[l > 0] in the forward pass and the gradient of
sigmoid(l / T) in the backward pass (straight-through), l starting at ``mask_init`` (0.1) and T = ``temperature``
(10), the authors' defaults. Every component starts kept, so the first step's merge IS the data-free merge (m ≡ 1
reproduces ``tsv_m`` / ``iso_c`` bit for bit), and training can only drop components the data-free merge keeps (TSV-M
keeps no more than the q bases fit in the layer's rank). Unlike the authors' code, the task coefficients are not
learned alongside (λ stays the data-free method's), and the mask acts on TSV-M's / Iso-C's components rather than on
each raw task vector's full spectrum. Tensors that are not matrices take the data-free rule (the mean task vector).

``learn_lam=True`` learns the coefficients too, as the authors do: θ = θ₀ + (U⊥ * (Σ ⊙ m ⊙ λ)) @ V⊥ᵀ with one λ per
layer matrix and task (TSV-M: it scales that task's components; Iso-C: one per matrix, its components being the
sum's), and θ = θ₀ + λ·τ̄ with one λ per other changed tensor (AdaMerging's layer-wise coefficients). Every λ starts
at ``lam``, so the first step is still the data-free merge; unlike the masks, λ can raise a merge above the
data-free scale, which a mask alone (dropping components) cannot.

``adarank_cart`` does the same over CART (the base of AdaRank's strongest published results): θ = θ̄ +
λ·(U * (Σ ⊙ m)) @ Vᵀ, U, Σ, Vᵀ the kept singular components of every centred task matrix τ_p − τ̄, task by task
(:func:`~hf_mloss.methods.cart.cart_components`), one mask per component and task; the average θ̄ = θ₀ + τ̄ is not
scaled, and every other tensor stays θ̄ (CART's rule), with no coefficient of its own under ``learn_lam`` (the
matrices learn one λ per task, as over TSV-M). As the authors' AdaRank over CART, the masks act on the centred task
matrices around the average; unlike it they cover the components CART keeps (``fraction``), not each centred
matrix's full spectrum.

The recipe records the learned masks as the components they drop (``masks``: one row per matrix that drops any,
``[tensor, dropped indices of model 1, …, of model q]``, indices into that model's kept components in descending
singular value; ``adarank_iso``: ``[tensor, dropped indices]``) and, with ``learn_lam``, the coefficients
(``coefficients``: one row per changed tensor, ``[tensor, λ_1, …, λ_q]`` for a TSV-M matrix, ``[tensor, λ]``
otherwise); a re-run merges from them without training, bit for bit, ``relearn=True`` trains again. The training loop is :mod:`hf_mloss.merging.learned`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .._validation import param
from ..errors import InvalidParameterError
from .adamerging import LearnedMethod, LearnedParams, TrainedLayout
from .base import MergeContext, MethodParams
from .cart import CartParams
from .iso import IsoCParams
from .registry import register_merge_method
from .tsv import TsvParams

if TYPE_CHECKING:
    import torch

PART_STATE = "components"
"""``MergeContext.state`` key: the components the training factored, by tensor name, reused once by the saved merge
(the same bits as factoring again, at half the SVDs)."""
MASK_STATE = "masks"
"""``MergeContext.state`` key: tensor name → the dropped component indices of each model (TSV-M) or of the sum."""
LAM_STATE = "lams"
"""``MergeContext.state`` key (``learn_lam``): tensor name → its coefficients."""
REFERENCE = "Lee et al., AdaRank: Adaptive Rank Pruning for Enhanced Model Merging, ICLR 2026 (arXiv 2503.22178)"
REFERENCE_URL = "https://arxiv.org/abs/2503.22178"


@dataclass(frozen=True)
class AdaRankParams(LearnedParams):
    lr: float = param(1e-2, "Adam learning rate (AdaRank's 1e-3 over 10 000 steps; Adam moves a logit by about lr per "
                      "step, so at 1e-3 a mask needs about 100 steps to cross 0 from 0.1, the whole default run). At "
                      "1e-2 no mask can drop within the first 9 steps (data_free_steps).", low=0.0, high=1.0,
                      low_open=True)
    mask_init: float = param(0.1, "Initial logit of every component's mask (AdaRank's 0.1): above 0, so every "
                             "component the data-free merge keeps starts kept.", low=0.0, high=100.0, low_open=True)
    temperature: float = param(10.0, "The backward pass follows sigmoid(logit / temperature) (AdaRank's 10).",
                               low=0.0, high=1e4, low_open=True)
    masks: tuple[tuple[Any, ...], ...] | None = param(
        None, "Recorded: the components the learned masks drop, one row [tensor, dropped indices of model 1, ..., of "
        "model q] per matrix that drops any (adarank_iso: [tensor, dropped indices]); a re-run merges from them "
        "without training.")

    learn_lam: bool = param(False, "Also learn the coefficients λ (one per layer matrix and task, one per other "
                            "changed tensor), starting at lam, as the authors do; default: λ stays lam.")
    coefficients: tuple[tuple[Any, ...], ...] | None = param(
        None, "Recorded with learn_lam: the learned λ, one row [tensor, λ_1, ..., λ_q] per TSV-M matrix and "
        "[tensor, λ] per other changed tensor; a re-run merges from them without training.")

    RECORDED: ClassVar[str] = "masks"

    def check(self) -> None:
        super().check()
        if self.masks is not None:
            parse_masks(self.masks)
        if self.coefficients is not None:
            if not self.learn_lam:
                raise InvalidParameterError("coefficients are recorded by learn_lam=True runs; pass learn_lam=True "
                                            "with them (or drop them).")
            parse_lams(self.coefficients)

    @property
    def learns(self) -> bool:
        """Whether a run trains: nothing recorded (masks, and the coefficients when ``learn_lam``), or ``relearn``."""
        return super().learns or (self.learn_lam and self.coefficients is None)


@dataclass(frozen=True)
class AdaRankTsvParams(AdaRankParams, TsvParams):
    pass


@dataclass(frozen=True)
class AdaRankIsoParams(AdaRankParams, IsoCParams):
    pass


@dataclass(frozen=True)
class AdaRankCartParams(AdaRankParams, CartParams):
    pass


ADAM_BETAS = (0.9, 0.999)
"""The Adam moments the training uses (torch's defaults)."""


def adam_step_bound(t: int, betas: tuple[float, float] = ADAM_BETAS) -> float:
    """The most Adam's step ``t`` can move one value, in units of lr, whatever its gradients.

    The step is lr·m̂_t / (√v̂_t + ε), m̂_t = Σ_i a_i g_i and v̂_t = Σ_i b_i g_i² weighing the gradients so far
    (a_i = (1−β₁)β₁^(t−i) / (1−β₁^t), b_i the same with β₂); by Cauchy–Schwarz it is at most lr·√(Σ_i a_i² / b_i),
    a geometric sum (ε only shortens it). Exactly 1 at the first step, slightly above 1 at the next ones (1.035 at
    the 9th), which is why the steps that cannot flip a mask are not simply mask_init / lr.
    """
    import math

    beta1, beta2 = betas
    ratio = beta1 * beta1 / beta2
    return math.sqrt((1 - beta1) ** 2 * (1 - beta2 ** t) * (1 - ratio ** t)
                     / ((1 - beta1 ** t) ** 2 * (1 - beta2) * (1 - ratio)))


def data_free_steps(mask_init: float, lr: float, *, limit: int = 100_000) -> int:
    """How many Adam steps leave every mask kept whatever the data: the largest n with lr·Σ_{t≤n}
    :func:`adam_step_bound` (t) below ``mask_init`` (less a margin of 1e-4 of it for float32 rounding), at most
    ``limit``.

    A mask keeps its component while its logit is above 0 (m = 1[l > 0]); the logit starts at ``mask_init``. At the
    defaults (mask_init 0.1, lr 1e-2) this is 9 (9 steps reach at most 9.12·lr): a run of at most 9 steps is the
    data-free merge bit for bit, and the 10th step may bring a logit to 0, which drops its component.
    """
    reach, budget = 0.0, mask_init * (1 - 1e-4) / lr
    for t in range(1, limit + 1):
        reach += adam_step_bound(t)
        if reach >= budget:
            return t - 1
    return limit


def parse_masks(rows: Sequence[Any]) -> dict[str, list[list[int]]]:
    """Tensor name → dropped indices per row of recorded ``[tensor, [i, ...], ...]`` rows; refuses malformed ones."""
    out: dict[str, list[list[int]]] = {}
    for i, row in enumerate(rows):
        if (not isinstance(row, (list, tuple)) or len(row) < 2 or not isinstance(row[0], str)
                or not all(isinstance(d, (list, tuple)) and all(isinstance(j, int) and not isinstance(j, bool)
                                                                and j >= 0 for j in d) for d in row[1:])):
            raise InvalidParameterError(f"masks[{i}] must be [tensor name, [dropped component indices], ...] with "
                                        f"indices >= 0, got {str(row)[:80]!r}.")
        if row[0] in out:
            raise InvalidParameterError(f"masks name {row[0]!r} twice.")
        out[row[0]] = [sorted(set(d)) for d in row[1:]]
    return out


def parse_lams(rows: Sequence[Any]) -> dict[str, list[float]]:
    """Tensor name → its recorded coefficients, from ``[tensor, λ, ...]`` rows; refuses malformed ones."""
    import math

    out: dict[str, list[float]] = {}
    for i, row in enumerate(rows):
        if (not isinstance(row, (list, tuple)) or len(row) < 2 or not isinstance(row[0], str)
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                           for v in row[1:])):
            raise InvalidParameterError(f"coefficients[{i}] must be [tensor name, λ, ...] with finite numbers, got "
                                        f"{str(row)[:80]!r}.")
        if row[0] in out:
            raise InvalidParameterError(f"coefficients name {row[0]!r} twice.")
        out[row[0]] = [float(v) for v in row[1:]]
    return out


@dataclass
class Components:
    """One matrix's kept singular components: the merge is ``(left * (scale * m)) @ right`` for masks ``m``."""

    left: torch.Tensor
    scale: torch.Tensor
    """TSV-M: the kept singular values Σ ``[c]``; Iso-C: σ̄ (a scalar)."""
    right: torch.Tensor
    rows: list[tuple[int, int, int]]
    """``(model or -1 for the sum, first component, count)`` of each recorded row of masks."""
    offset: torch.Tensor | None = None
    """Added as it is, outside λ and the masks (CART: the mean task matrix τ̄)."""

    @property
    def count(self) -> int:
        return self.left.shape[1]


def component_coefficients(components: Components, lams: torch.Tensor) -> torch.Tensor:
    """Each component's λ from one λ per model (TSV-M: ``lams[p]`` for model p's components) or one for the sum
    (Iso-C: ``lams[0]``); a gather, so the training's gradient reaches ``lams``."""
    import torch

    index = torch.cat([torch.full((count,), max(model, 0), dtype=torch.long, device=lams.device)
                       for model, _, count in components.rows])
    return lams[index]


def masked_matrix(components: Components, mask: torch.Tensor) -> torch.Tensor:
    """``(left * (scale * mask)) @ right``: the one formula of the training's functional merge and of the saved
    merge; ``mask`` ≡ 1 gives the data-free merge's bits (``scale * 1`` is ``scale``)."""
    return (components.left * (components.scale * mask)) @ components.right


def _offset(base: torch.Tensor, part: Components) -> torch.Tensor:
    """θ₀ plus what a matrix's merge adds outside λ and the masks (CART's τ̄; nothing for TSV-M and Iso-C)."""
    return base if part.offset is None else base + part.offset


def straight_through(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """1[logit > 0] exactly in the forward pass, the gradient of sigmoid(logit / T) in the backward pass."""
    import torch

    soft = torch.sigmoid(logits / temperature)
    return (logits > 0).to(logits.dtype) + (soft - soft.detach())


class _AdaRank(LearnedMethod):
    reference = REFERENCE
    reference_url = REFERENCE_URL
    base_name: ClassVar[str]
    rest_scaled: ClassVar[bool] = True
    """Whether a tensor that is not a matrix merges as θ₀ + λ·part (and learns its own λ with ``learn_lam``); False:
    θ₀ + part as it is (CART's average)."""

    def components(self, taus: torch.Tensor, params: MethodParams) -> Components | torch.Tensor:
        """The matrix's maskable components, or the fixed (unscaled) merged task matrix when it has none."""
        raise NotImplementedError

    def _split(self, name: str, base: torch.Tensor, sources: list[torch.Tensor], ctx: MergeContext
               ) -> Components | torch.Tensor:
        from .svd_ops import is_finite, is_matrix, mean_task_vector, weighted_task_vectors

        taus = weighted_task_vectors(base, sources, ctx.weights)
        if is_matrix(base) and is_finite(taus):
            return self.components(taus, ctx.params)
        return mean_task_vector(taus)

    def functional_part(self, name, base, sources, ctx):
        part = self._split(name, base, sources, ctx)
        ctx.state.setdefault(PART_STATE, {})[name] = part
        return part

    def layout(self, parts, adapter, ctx):
        import warnings

        import torch

        params, q = ctx.params, len(ctx.weights)
        still = data_free_steps(params.mask_init, params.lr)
        if params.steps <= still and not params.learn_lam:
            warnings.warn(f"{self.name}: in steps={params.steps} at lr={params.lr} no mask can leave "
                          f"mask_init={params.mask_init} for 0 (Adam moves a logit by about lr per step), so the merge "
                          f"is the data-free {self.base_name} one; give more than {still} steps or a larger lr to "
                          "let the data drop components.", UserWarning, stacklevel=2)
        slots: dict[str, Any] = {}
        rows: dict[str, list[tuple[int, int, int]]] = {}
        initial, start, masks = [], 0, 0
        for name, part in parts.items():
            lams = (self.lams_per_matrix(q) if isinstance(part, Components) else int(self.rest_scaled)) \
                if params.learn_lam else 0
            count = part.count if isinstance(part, Components) else 0
            if count + lams == 0:
                slots[name] = None
                continue
            slots[name] = slice(start, start + count + lams)
            if isinstance(part, Components):
                rows[name] = part.rows
            initial += [torch.full((count,), params.mask_init), torch.full((lams,), params.lam)]
            start, masks = start + count + lams, masks + count
        what = f"component masks ({self.base_name})" + (" and coefficients λ" if params.learn_lam else "")
        return TrainedLayout(slots=slots, initial=torch.cat(initial).float() if initial else torch.zeros(0),
                             count=masks, title="Component masks", what=what, meta=rows)

    def lams_per_matrix(self, q: int) -> int:
        """How many coefficients a layer matrix learns with ``learn_lam``."""
        raise NotImplementedError

    def functional_tensor(self, base, part, values, params):
        if values is None:
            return base + (params.lam if self.rest_scaled else 1) * part
        if not isinstance(part, Components):  # learn_lam: one λ for the tensor
            return base + values[0] * part
        mask = straight_through(values[:part.count], params.temperature)
        if params.learn_lam:
            return _offset(base, part) + masked_matrix(part, mask * component_coefficients(part, values[part.count:]))
        return _offset(base, part) + params.lam * masked_matrix(part, mask)

    def use_trained(self, ctx, layout, trained):
        recorded, state, lams = [], {}, {}
        for name, slot in layout.slots.items():
            if slot is None:
                continue
            values = trained[slot]
            count = sum(count for _, _, count in layout.meta.get(name, ()))
            if ctx.params.learn_lam:
                lams[name] = values[count:].tolist()
            dropped = (values[:count] <= 0).nonzero().flatten().tolist()
            if dropped:
                rows = self._rows(name, ctx, layout, dropped)
                recorded.append([name, *rows])
                state[name] = rows
        ctx.state[MASK_STATE] = state
        if not ctx.params.learn_lam:
            return {"masks": recorded}
        ctx.state[LAM_STATE] = lams
        return {"masks": recorded, "coefficients": [[name, *values] for name, values in lams.items()]}

    def _rows(self, name: str, ctx: MergeContext, layout: TrainedLayout, dropped: list[int]) -> list[list[int]]:
        """The recorded rows of a matrix's dropped components (flat indices into its components)."""
        rows = layout.meta[name]
        out = [[] for _ in range(self.recorded_rows(len(ctx.weights)))]
        for model, first, count in rows:
            out[max(model, 0)] = [i - first for i in dropped if first <= i < first + count]
        return out

    def recorded_rows(self, q: int) -> int:
        """How many lists of dropped indices a recorded row holds."""
        raise NotImplementedError

    def use_recorded(self, ctx, names, adapter, q):
        recorded = parse_masks(ctx.params.masks)
        unknown = sorted(set(recorded) - set(names))
        if unknown:
            raise InvalidParameterError(f"The recorded masks name tensors these models do not change ({unknown[:3]}); "
                                        "pass relearn=True to train them again.")
        wrong = [n for n, rows in recorded.items() if len(rows) != self.recorded_rows(q)]
        if wrong:
            raise InvalidParameterError(f"The recorded masks of {wrong[0]!r} hold {len(recorded[wrong[0]])} lists, "
                                        f"{self.recorded_rows(q)} expected for {q} models; pass relearn=True.")
        ctx.state[MASK_STATE] = recorded
        if ctx.params.learn_lam:
            lams = parse_lams(ctx.params.coefficients)
            # a tensor of CART's that is not a matrix learns none (checked per tensor when merged)
            missing = sorted(set(names) - set(lams)) if self.rest_scaled else []
            unknown = sorted(set(lams) - set(names))
            if missing or unknown:
                raise InvalidParameterError(
                    f"The recorded coefficients do not fit these models: {len(missing)} changed tensors have none "
                    f"({missing[:2]}), {len(unknown)} name tensors they do not change ({unknown[:2]}); pass "
                    "relearn=True to train them again.")
            ctx.state[LAM_STATE] = lams

    def merge_tensor(self, name, base, sources, ctx: MergeContext) -> torch.Tensor:
        import torch

        part = ctx.state.get(PART_STATE, {}).pop(name, None)
        if part is None:
            part = self._split(name, base, sources, ctx)
        dropped = ctx.state[MASK_STATE].get(name)
        lams = self._lams(name, part, ctx)
        if not isinstance(part, Components):
            if dropped and any(dropped):
                raise InvalidParameterError(f"The recorded masks drop components of {name!r}, which has none here; "
                                            "pass relearn=True.")
            return base + (lams[0] if lams is not None else ctx.params.lam if self.rest_scaled else 1) * part
        mask = torch.ones(part.count, dtype=part.left.dtype, device=part.left.device)
        for model, first, count in part.rows:
            indices = dropped[max(model, 0)] if dropped else []
            if indices and indices[-1] >= count:
                raise InvalidParameterError(f"The recorded masks of {name!r} drop component {indices[-1]} of "
                                            f"{'the sum' if model < 0 else f'model {model}'}, which keeps {count}; "
                                            "pass relearn=True.")
            mask[[first + i for i in indices]] = 0
        if dropped:
            held = {max(model, 0) for model, _, _ in part.rows}
            stray = [i for i, d in enumerate(dropped) if d and i not in held]
            if stray:
                raise InvalidParameterError(f"The recorded masks drop components of model {stray[0]} in {name!r}, "
                                            "which that model does not change; pass relearn=True.")
        if lams is not None:
            return _offset(base, part) + masked_matrix(part, mask * component_coefficients(part, lams))
        return _offset(base, part) + ctx.params.lam * masked_matrix(part, mask)

    def _lams(self, name: str, part: Any, ctx: MergeContext) -> torch.Tensor | None:
        """The learned or recorded coefficients of tensor ``name`` (None without ``learn_lam``), checked against
        what the tensor learns."""
        import torch

        if not ctx.params.learn_lam:
            return None
        values = ctx.state[LAM_STATE].get(name)
        expected = self.lams_per_matrix(len(ctx.weights)) if isinstance(part, Components) else int(self.rest_scaled)
        if expected == 0 and values is None:
            return None
        if values is None or len(values) != expected:
            raise InvalidParameterError(f"The recorded coefficients of {name!r} hold "
                                        f"{0 if values is None else len(values)} values, {expected} expected here; "
                                        "pass relearn=True.")
        device = part.left.device if isinstance(part, Components) else part.device
        return torch.tensor(values, dtype=torch.float32, device=device)

    def describe(self, params: MethodParams) -> str:
        learned = "masks over its singular components" + (" and coefficients λ" if params.learn_lam else "")
        return f"AdaRank ({self.reference}) over {self.base_name}: {learned} learned with the {params.objective!r} objective"


class AdaRankTsv(_AdaRank):
    """AdaRank over TSV-M: a mask per kept singular component of each task's matrix."""

    name = "adarank_tsv"
    pretty_name = "AdaRank (TSV-M components)"
    params_class = AdaRankTsvParams
    base_name = "TSV-M"

    def prepare(self, ctx: MergeContext, visit) -> None:
        from .tsv import check_fraction

        check_fraction(ctx.params.fraction, len(ctx.weights))

    def components(self, taus, params):
        import torch

        from .tsv import tsv_components

        found = tsv_components(taus, params.fraction)
        if found is None:  # k = 0: the mean task vector, as tsv_m
            return taus.mean(0)
        if isinstance(found, int):  # no task changed the matrix
            return torch.zeros_like(taus[0])
        left, sigmas, right, tasks = found
        k = len(sigmas) // len(tasks)
        return Components(left, sigmas, right, [(t, i * k, k) for i, t in enumerate(tasks)])

    def recorded_rows(self, q: int) -> int:
        return q

    def lams_per_matrix(self, q: int) -> int:
        return q


class AdaRankIso(_AdaRank):
    """AdaRank over Iso-C: a mask per singular component of the summed task matrix."""

    name = "adarank_iso"
    pretty_name = "AdaRank (Iso-C components)"
    params_class = AdaRankIsoParams
    base_name = "Iso-C"

    def components(self, taus, params):
        import torch

        from .iso import iso_c_components

        found = iso_c_components(taus.sum(0))
        if found is None:
            return torch.zeros_like(taus[0])
        u, mean, vh = found
        return Components(u, mean, vh, [(-1, 0, u.shape[1])])

    def recorded_rows(self, q: int) -> int:
        return 1

    def lams_per_matrix(self, q: int) -> int:
        return 1


class AdaRankCart(_AdaRank):
    """AdaRank over CART: a mask per kept singular component of each centred task matrix, around the average."""

    name = "adarank_cart"
    pretty_name = "AdaRank (CART components)"
    params_class = AdaRankCartParams
    base_name = "CART"
    rest_scaled = False

    def _split(self, name, base, sources, ctx):
        from .svd_ops import is_finite, is_matrix, weighted_task_vectors

        taus = weighted_task_vectors(base, sources, ctx.weights)
        mean = taus.mean(0)
        if is_matrix(base) and is_finite(taus):
            return self.components(taus.sub_(mean), ctx.params, mean)
        return mean

    def components(self, taus, params, mean=None):
        from .cart import cart_components

        left, sigmas, right = cart_components(taus, params.fraction)
        k = len(sigmas) // len(taus)
        return Components(left, sigmas, right, [(t, t * k, k) for t in range(len(taus))], offset=mean)

    def recorded_rows(self, q: int) -> int:
        return q

    def lams_per_matrix(self, q: int) -> int:
        return q


register_merge_method(AdaRankTsv())
register_merge_method(AdaRankIso())
register_merge_method(AdaRankCart())
