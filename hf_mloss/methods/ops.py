"""Tensor primitives shared by the merge methods: trimming, sign election, disjoint merge, DARE masks.

All functions work on float32 tensors and never modify their inputs, except the in-place variants whose names end
in ``_`` (PyTorch's convention). The definitions follow SPEC §3–§4:
"keep the m largest |τ|" means keep every entry ≥ the m-th largest magnitude (ties may keep a few more).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy
import torch

from .. import parallel

_SPLIT_MIN_NUMEL = 1 << 18
"""A tensor is split over the run's workers only when each piece gets at least this many entries."""
_CHUNK_NUMEL = 1 << 17
"""Entries of the q-stacked tensor handled at a time by the chunked kernels (512 KB of float32: 250 ms for a 8 × 3072 × 768 TIES merge on 1 thread, 305 ms with 8 MB chunks)."""
_ALIGN = 4096


def keep_count(numel: int, keep: float, *, min_keep: int = 0, extra: int = 0) -> int:
    """Number of entries a trim keeps: ``floor(numel * keep)`` (as the peers compute it), adjusted by a convention.

    ``min_keep=1`` reproduces mergekit (never an empty tensor); ``extra=1`` reproduces fusion-bench / the original
    TIES code, whose threshold is the ``(d - floor(d*k))``-th smallest value, i.e. one entry more.
    """
    return min(numel, max(min_keep, int(numel * keep) + extra))


def magnitude_threshold(magnitude: torch.Tensor, m: int) -> float:
    """The m-th largest value of ``magnitude`` (``+inf`` when m ≤ 0, so nothing is kept)."""
    n = magnitude.numel()
    if m <= 0:
        return float("inf")
    if m >= n:
        return float("-inf")
    flat = magnitude.reshape(-1)
    if n >= _BRACKET_MIN_NUMEL:
        value = _bracketed_kth_largest(flat, m)
        if value is not None:
            return value
    # kthvalue is a selection, ~4x cheaper than the full sort mergekit uses (measured on a 768x3072 tensor).
    return flat.kthvalue(n - m + 1).values.item()


_BRACKET_MIN_NUMEL = 1 << 18
_BRACKET_SAMPLE = 1 << 14


def _bracketed_kth_largest(flat: torch.Tensor, m: int, *, shrink: int | None = None) -> float | None:
    """The exact m-th largest entry of ``flat``, found by selecting only inside a bracket estimated from a sample.

    A seeded sample of 16 k entries gives quantiles ``lo ≤ hi`` around the target (±5 standard errors). Counting the
    entries above ``hi`` and selecting among the few in ``[lo, hi]`` is exact whenever the target lies in the bracket,
    which both counts prove; otherwise ``None`` (the caller falls back to a full ``kthvalue``). Measured on a
    768×3072 task vector (k = 0.2, 1 thread): 9 ms against 18-22 ms for ``kthvalue`` on the whole tensor, which is
    single-threaded and copies its input. ``shrink``: ``None`` as well unless the bracket holds under half of this
    many entries (a bracket of a bracket, :func:`_kth_smallest`, must make progress).
    """
    n = flat.numel()
    generator = torch.Generator(device=flat.device).manual_seed(n)
    sample = flat[torch.randint(n, (_BRACKET_SAMPLE,), generator=generator, device=flat.device)].float()
    q = 1.0 - m / n
    margin = 5.0 * (q * (1.0 - q) / _BRACKET_SAMPLE) ** 0.5
    bounds = torch.tensor([max(q - margin, 0.0), min(q + margin, 1.0)], device=flat.device)
    lo, hi = torch.quantile(sample, bounds).tolist()
    above, inside = _bracket(flat, lo, hi)
    if above >= m:
        return None
    rank = m - above  # the target is the rank-th largest entry of the bracket
    if rank > inside.numel():
        return None
    if lo == hi:  # every entry of the bracket is this one value
        return lo
    if shrink is not None and 2 * inside.numel() > shrink:
        return None
    return _kth_smallest(inside, inside.numel() - rank + 1)


_BRACKET_STEP = 1 << 16
"""Entries per step of :func:`_bracket` on CPU (256 KB of float32: each step's masks stay in cache)."""


def _bracket(flat: torch.Tensor, lo: float, hi: float, *, absolute: bool = False) -> tuple[int, torch.Tensor]:
    """``(how many entries lie above hi, the entries inside [lo, hi])`` of a flat tensor (a NaN counts as above).

    ``absolute``: ``flat`` holds signed values; it is replaced by their magnitudes, in place, and those are counted.
    On CPU this runs in cache-sized steps with NumPy (a 4 M-entry piece, 1 thread: ~6 ms against ~20 ms for
    whole-piece torch masks, whose boolean indexing alone took 9 ms); on other devices (or dtypes NumPy lacks),
    whole-tensor masks.
    """
    if not _numpy_ready(flat):
        magnitude = flat.abs_() if absolute else flat
        in_bracket = magnitude <= hi
        above = magnitude.numel() - int(torch.count_nonzero(in_bracket))
        return above, magnitude[in_bracket.logical_and_(magnitude >= lo)]
    values, above, inside = flat.detach().numpy(), 0, []
    for start in range(0, values.size, _BRACKET_STEP):
        part = values[start:start + _BRACKET_STEP]
        if absolute:
            numpy.abs(part, out=part)
        in_bracket = part <= hi
        above += part.size - int(numpy.count_nonzero(in_bracket))
        in_bracket &= part >= lo
        inside.append(part[in_bracket])
    return above, torch.from_numpy(numpy.concatenate(inside) if inside else values[:0].copy())


def _numpy_ready(tensor: torch.Tensor) -> bool:
    """Whether NumPy can work on ``tensor`` in place: a CPU tensor of a dtype it has (not bfloat16)."""
    return tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64)


def _kth_smallest(values: torch.Tensor, k: int) -> float:
    """The ``k``-th smallest entry (1-based) of a flat tensor of finite values: ``kthvalue``'s value, found on CPU
    by NumPy's selection (a 1.4 M-entry bracket: 1.7 ms against 23 ms). A large one is bracketed again first: the
    magnitudes of bfloat16 task vectors take few distinct values, so a sample's bracket holds more of them (1.0 M
    entries of a 13.8 M-entry task vector of Qwen2.5-1.5B's shape, where the selection alone took 24 ms)."""
    if not _numpy_ready(values):
        return values.kthvalue(k).values.item()
    n = values.numel()
    if n >= _BRACKET_MIN_NUMEL:
        value = _bracketed_kth_largest(values, n - k + 1, shrink=n)
        if value is not None:
            return value
    return float(numpy.partition(values.detach().numpy(), k - 1)[k - 1])


def trim_tensor(tau: torch.Tensor, keep: float, *, min_keep: int = 0, extra: int = 0) -> torch.Tensor:
    """Zero all but the ``keep_count`` largest-magnitude entries of one task vector tensor."""
    return trim_tensor_(tau.clone(), keep, min_keep=min_keep, extra=extra)


def trim_tensor_(tau: torch.Tensor, keep: float, *, min_keep: int = 0, extra: int = 0) -> torch.Tensor:
    """In-place :func:`trim_tensor` (returns ``tau``): the merge loops trim rows of a buffer they own."""
    m = keep_count(tau.numel(), keep, min_keep=min_keep, extra=extra)
    if m >= tau.numel():
        return tau
    magnitude = tau.abs()
    return _zero_below_(tau, magnitude, magnitude_threshold(magnitude, m))


def _zero_below_(tau: torch.Tensor, magnitude: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """Zero, in place, the entries of ``tau`` whose magnitude is below ``threshold`` (``magnitude`` is overwritten).

    The mask is made in place as float 1/0 (``ge_``): float-only passes. On 2.4 M entries (1 thread) this takes
    1.9 ms, against 8.1 ms for multiplying by a boolean mask (cast to float in a separate copy) and 14.6 ms for
    ``masked_fill_``; the values are the same as with the boolean mask.
    """
    return tau.mul_(magnitude.ge_(threshold))


def trim_exact(tau: torch.Tensor, m: int) -> torch.Tensor:
    """Keep exactly ``m`` entries, ties at the threshold broken by descending ``argsort`` order (mergekit's rule).

    A full sort is ~4x slower than :func:`trim_tensor`'s selection; use it only to reproduce mergekit bit for bit
    (fp32 task vectors of millions of entries do contain equal magnitudes at the threshold).
    """
    flat = tau.abs().reshape(-1)
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=tau.device)
    keep[torch.argsort(flat, descending=True)[: max(m, 0)]] = True
    return tau * keep.view_as(tau)


def trim_by_threshold(tau: torch.Tensor, threshold: float) -> torch.Tensor:
    """Keep the entries with ``|tau| >= threshold`` (global trim: the threshold comes from the whole model)."""
    return trim_by_threshold_(tau.clone(), threshold)


def trim_by_threshold_(tau: torch.Tensor, threshold: float) -> torch.Tensor:
    """In-place :func:`trim_by_threshold` (returns ``tau``)."""
    return _zero_below_(tau, tau.abs(), threshold)


def trim_rows(tau: torch.Tensor, row_keep: torch.Tensor) -> torch.Tensor:
    """Row-wise trim: row i keeps its ``floor(n_in * row_keep[i])`` largest-magnitude entries (0 → empty row)."""
    return trim_rows_(tau.clone(), row_keep)


def trim_rows_(tau: torch.Tensor, row_keep: torch.Tensor) -> torch.Tensor:
    """In-place :func:`trim_rows` (returns ``tau``)."""
    if tau.dim() != 2 or row_keep.shape != (tau.shape[0],):
        raise ValueError(f"trim_rows needs a 2-D tensor and one keep ratio per row, got {tuple(tau.shape)} and "
                         f"{tuple(row_keep.shape)}")
    n_in = tau.shape[1]
    counts = torch.floor(row_keep.double() * n_in).long().clamp(0, n_in)
    # Rows are independent: on one large tensor the run's workers take a share of the rows each.
    parallel.active().split(lambda rows: _trim_rows_(tau[rows], counts[rows]), tau.shape[0],
                            min_piece=max(1, _SPLIT_MIN_NUMEL // max(n_in, 1)))
    return tau


def _trim_rows_(tau: torch.Tensor, counts: torch.Tensor) -> None:
    if tau.shape[0] == 0:
        return
    magnitude = tau.abs()
    # topk up to the largest count instead of a full row sort: 67 vs 212 ms on a 3072 x 768 fc1 at k = 0.2.
    widest = max(int(counts.max()), 1)
    ordered = magnitude.topk(widest, dim=1, sorted=True).values
    idx = (counts - 1).clamp(min=0).unsqueeze(1)
    thresholds = ordered.gather(1, idx)
    thresholds = torch.where(counts.unsqueeze(1) > 0, thresholds, torch.full_like(thresholds, float("inf")))
    _zero_below_(tau, magnitude, thresholds)


def trim_slices(tau: torch.Tensor, keep: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Slice-wise trim: slice i (row i for ``dim=0``, column i for ``dim=1``) keeps its ``floor(len · keep[i])``
    largest-magnitude entries (entries ≥ the m-th largest; 0 → an empty slice). ``dim=0`` equals :func:`trim_rows`."""
    return trim_slices_(tau.clone(), keep, dim)


def trim_slices_(tau: torch.Tensor, keep: torch.Tensor, dim: int = 0, *,
                 thresholds: torch.Tensor | None = None) -> torch.Tensor:
    """In-place :func:`trim_slices` (returns ``tau``).

    ``thresholds``: an optional ``[tau.shape[dim]]`` float tensor that receives each slice's threshold (the m-th
    largest |τ| of the slice; ``+inf`` where m ≤ 0, ``-inf`` where m ≥ the slice length, i.e. nothing is zeroed):
    M-TIES trims a node's bias entry against the threshold of the node's first weight slice.
    """
    if tau.dim() != 2 or dim not in (0, 1) or keep.shape != (tau.shape[dim],):
        raise ValueError(f"trim_slices needs a 2-D tensor, dim 0 (rows) or 1 (columns) and one keep ratio per "
                         f"slice, got shape {tuple(tau.shape)}, dim={dim} and {tuple(keep.shape)} keep ratios")
    n, length = tau.shape[dim], tau.shape[1 - dim]
    counts = torch.floor(keep.double() * length).long().clamp(0, length)
    out = torch.empty(n, dtype=tau.dtype, device=tau.device) if thresholds is None else thresholds
    if out.shape != (n,):
        raise ValueError(f"thresholds must hold one value per slice ({n}), got shape {tuple(out.shape)}")

    def piece(part: slice) -> None:
        view = tau[part] if dim == 0 else tau[:, part]
        _trim_slices_(view, counts[part], out[part], dim)

    # Slices are independent: on one large tensor the run's workers take a share of them each.
    parallel.active().split(piece, n, min_piece=max(1, _SPLIT_MIN_NUMEL // max(length, 1)))
    return tau


def _trim_slices_(tau: torch.Tensor, counts: torch.Tensor, out: torch.Tensor, dim: int) -> None:
    """Trim the slices of ``tau`` along ``dim`` in place and write their thresholds into ``out`` (as
    :func:`_trim_rows_`: the same top-k values, so rows are trimmed bit for bit as by :func:`trim_rows_`)."""
    if tau.shape[dim] == 0:
        return
    within = 1 - dim
    length = tau.shape[within]
    if length == 0:
        out.fill_(float("-inf"))
        return
    magnitude = tau.abs()
    widest = min(max(int(counts.max()), 1), length)
    ordered = magnitude.topk(widest, dim=within, sorted=True).values
    thresholds = ordered.gather(within, (counts - 1).clamp(min=0).unsqueeze(within))
    per_slice = counts.unsqueeze(within)
    thresholds = torch.where(per_slice > 0, thresholds, torch.full_like(thresholds, float("inf")))
    thresholds = torch.where(per_slice >= length, torch.full_like(thresholds, float("-inf")), thresholds)
    out.copy_(thresholds.reshape(-1))
    _zero_below_(tau, magnitude, thresholds)


def trim_entries_(tau: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Keep, in place, the entries of a 1-D ``tau`` with ``|tau[i]| >= thresholds[i]`` (a node's bias entry against
    its node's threshold); returns ``tau``."""
    if tau.dim() != 1 or thresholds.shape != tau.shape:
        raise ValueError(f"trim_entries needs a 1-D tensor and one threshold per entry, got {tuple(tau.shape)} and "
                         f"{tuple(thresholds.shape)}")
    return _zero_below_(tau, tau.abs(), thresholds.to(tau))


def elect_and_merge(
    taus: Sequence[torch.Tensor] | torch.Tensor,
    weights: torch.Tensor,
    *,
    elect: str = "weighted",
    divide_by: str = "weights",
    zero_positive: bool = True,
) -> torch.Tensor:
    """TIES sign election + disjoint merge of (trimmed) task vectors.

    Args:
        taus: q tensors of one shape (or a stacked ``[q, ...]`` tensor).
        weights: ``[q]`` non-negative merging weights α.
        elect: ``"weighted"``: sign of Σ α_p τ_p (TIES paper with uniform α, mergekit); ``"unweighted"``:
            sign of Σ τ_p (PEFT). An exact zero sum elects +1.
        divide_by: ``"weights"``: Σ_agree α_p τ_p / Σ_agree α_p (disjoint mean; mergekit ``normalize: true``);
            ``"count"``: divide by the number of agreeing tasks (PEFT); ``"none"``: disjoint sum.
            Entries with no agreeing task get 0. Zeros never agree.
        zero_positive: the sign elected where the sum is exactly 0 (+1 by default; the original TIES code uses the
            majority of the elected signs over the whole model instead).
    """
    stacked = taus if isinstance(taus, torch.Tensor) else torch.stack(list(taus))
    alpha = weights.to(stacked).reshape(-1, *([1] * (stacked.dim() - 1)))
    if stacked.dim() < 2 or not stacked.is_contiguous():
        return _elect_and_merge(stacked, alpha, elect, divide_by, zero_positive)
    # Entries are independent, so the work goes in column chunks of ~2 MB of the stack: the temporaries stay in cache
    # and are reused by malloc, where whole-stack temporaries (75 MB for a ViT-B MLP matrix × 8) are fresh mmaps
    # whose page faults cost more than the arithmetic (38 vs 10 ms for one multiply). On one large tensor the run's
    # workers take a share of the chunks each. Chunks start at multiples of 4096 entries: torch's vectorised sum over
    # the q sources then groups every entry as on the whole tensor (unaligned pieces moved 1 entry in 420,000 by an ulp).
    q = stacked.shape[0]
    flat, out = stacked.view(q, -1), torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
    out_flat, alpha_flat = out.view(-1), alpha.view(q, 1)
    chunk = elect_chunk_numel(q) if stacked.device.type == "cpu" else flat.shape[1]

    def piece(cols: slice) -> None:
        for start in range(cols.start, cols.stop, chunk):
            part = slice(start, min(start + chunk, cols.stop))
            out_flat[part] = _elect_and_merge(flat[:, part], alpha_flat, elect, divide_by, zero_positive)

    parallel.active().split(piece, flat.shape[1], min_piece=_SPLIT_MIN_NUMEL // q, align=chunk)
    return out


def trim_elect_merge(base: torch.Tensor, sources: Sequence[torch.Tensor], thresholds: Sequence[float],
                     weights: torch.Tensor, *, lam: float, elect: str = "weighted", divide_by: str = "weights",
                     zero_positive: bool = True) -> torch.Tensor:
    """TIES on flat pieces whose trim thresholds are known: ``base + lam * elect_and_merge(taus)`` with
    ``taus[p] = sources[p] - base`` keeping ``|taus[p]| >= thresholds[p]``.

    Every step of a column chunk runs while the chunk is in cache, on the chunks :func:`elect_and_merge` uses, so the
    bits are those of the steps taken one after the other over the whole tensor. A 4 M-entry piece (q = 2, 1 thread)
    merges in about half the time of whole-piece steps, each of which streams 16 MB buffers through memory.
    """
    q, numel = len(sources), base.numel()
    out = torch.empty_like(base)
    alpha = weights.to(base).view(q, 1)
    chunk = elect_chunk_numel(q) if base.device.type == "cpu" else numel

    def piece(cols: slice) -> None:
        taus = torch.empty((q, min(chunk, cols.stop - cols.start)), dtype=base.dtype, device=base.device)
        magnitude = torch.empty_like(taus[0])
        for start in range(cols.start, cols.stop, chunk):
            part = slice(start, min(start + chunk, cols.stop))
            width = part.stop - part.start
            for tau, source, threshold in zip(taus[:, :width], sources, thresholds):
                torch.sub(source[part], base[part], out=tau)
                _zero_below_(tau, torch.abs(tau, out=magnitude[:width]), threshold)
            merged = _elect_and_merge(taus[:, :width], alpha, elect, divide_by, zero_positive)
            torch.add(base[part], merged.mul_(lam), out=out[part])

    parallel.active().split(piece, numel, min_piece=_SPLIT_MIN_NUMEL // q, align=chunk)
    return out


def take_stack(sources: list[torch.Tensor]) -> torch.Tensor:
    """The ``[q, ...]`` stack of ``sources``, emptying the list: the caller owns the result and may change it in
    place. When the sources are the views of one buffer in order (how the merger reads them) that buffer is
    returned, no copy; otherwise a new stack."""
    first = sources[0]
    step = first.numel()
    storage = first.untyped_storage()
    if (first.is_contiguous() and storage.nbytes() == len(sources) * step * first.element_size()
            and first.storage_offset() == 0
            and all(s.is_contiguous() and s.shape == first.shape and s.dtype == first.dtype
                    and s.untyped_storage().data_ptr() == storage.data_ptr() and s.storage_offset() == i * step
                    for i, s in enumerate(sources))):
        stacked = first.as_strided((len(sources), *first.shape), (step, *first.stride()), 0)
    else:
        stacked = torch.stack(sources)
    sources.clear()
    return stacked


def elect_chunk_numel(q: int) -> int:
    """Entries per source that :func:`elect_and_merge` handles at a time on CPU (a multiple of 4096). A caller that
    merges one tensor in flat pieces starting at multiples of it gets the same chunks, hence the same bits."""
    return max(_ALIGN, _CHUNK_NUMEL // q // _ALIGN * _ALIGN)


def _elect_and_merge(stacked: torch.Tensor, alpha: torch.Tensor, elect: str, divide_by: str,
                     zero_positive: bool) -> torch.Tensor:
    # Two [q, ...] float buffers serve every step, and the agreement mask is float 0/1 (τ·s > 0 with s = ±1, the
    # elected sign), so no step casts a boolean mask or selects with where() on the stacked size (profiled: those
    # took ~45 % of a 8 × 3072 × 768 merge). Values and summation order are those of the boolean formulation.
    buffer = torch.mul(stacked, alpha)  # α_p τ_p
    total = (buffer if elect == "weighted" else stacked).sum(0)
    sign = (total.ge_(0) if zero_positive else total.gt_(0)).mul_(2).sub_(1)  # the elected sign, ±1 (NaN: −1)
    agree = torch.mul(stacked, sign).gt_(0)
    numerator = buffer.mul_(agree).sum(0)  # α_p τ_p where p agrees, else 0
    if divide_by == "none":
        return numerator
    denominator = (agree.mul_(alpha) if divide_by == "weights" else agree).sum(0)
    return torch.where(denominator > 0, numerator / denominator.clamp_min(torch.finfo(stacked.dtype).tiny), 0.0)


def tensor_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed derived from ``seed`` and a tensor's identity, so random masks do not depend on visiting order."""
    digest = hashlib.blake2b(":".join(map(str, (seed, *parts))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def dare_drop(tau: torch.Tensor, p: float, generator: torch.Generator, *, rescale: str = "inverse") -> torch.Tensor:
    """DARE: keep each entry with probability ``p`` and rescale the survivors.

    ``rescale="inverse"`` multiplies by 1/p (DARE paper, fusion-bench, PEFT); ``"l1"`` matches the tensor's L1 norm
    (mergekit); ``"none"`` keeps the survivors as they are (used by M-DARE's target rows).
    """
    mask = torch.rand(tau.shape, generator=generator, device=tau.device) < p
    dropped = torch.where(mask, tau, torch.zeros_like(tau))
    if rescale == "inverse":
        return dropped / p
    if rescale == "l1":
        kept_norm = dropped.abs().sum(dtype=torch.float64)
        if kept_norm == 0:
            return dropped
        # In float64: the ratio of the norms can exceed float32's range (a few tiny survivors) while every rescaled
        # entry stays below the tensor's own L1 norm.
        return (dropped.double() * (tau.abs().sum(dtype=torch.float64) / kept_norm)).to(tau.dtype)
    return dropped


class ExactKthLargest:
    """Exact k-th largest magnitude over many tensors in two streaming passes (no concatenation).

    Non-negative float32 values sort like their int32 bit patterns, so a radix selection is exact: pass 1 histograms
    the high 16 bits of every |τ| and finds the bucket holding the m-th largest; pass 2 histograms the low 16 bits of
    the values in that bucket. Memory: two 65,536-bin histograms per model.
    """

    def __init__(self, m: int) -> None:
        self.m = m
        self.high = torch.zeros(65536, dtype=torch.int64)
        self.low = torch.zeros(65536, dtype=torch.int64)
        self.bucket: int | None = None
        self.above: int = 0

    @staticmethod
    def _bits(magnitude: torch.Tensor) -> torch.Tensor:
        return magnitude.reshape(-1).to(torch.float32).contiguous().view(torch.int32).to(torch.int64)

    def add_pass1(self, magnitude: torch.Tensor) -> None:
        if not magnitude.any():  # an unchanged tensor: every entry is +0.0, bit pattern 0
            self.high[0] += magnitude.numel()
            return
        self.high += torch.bincount(self._bits(magnitude) >> 16, minlength=65536).cpu()

    def finish_pass1(self) -> None:
        # counts of entries strictly above each bucket, scanning from the largest bucket down
        above = torch.flip(torch.cumsum(torch.flip(self.high, [0]), 0), [0]) - self.high
        candidates = torch.nonzero((above < self.m) & (above + self.high >= self.m)).flatten()
        self.bucket = int(candidates[0]) if len(candidates) else 0
        self.above = int(above[self.bucket])

    def add_pass2(self, magnitude: torch.Tensor) -> None:
        if not magnitude.any():
            if self.bucket == 0:
                self.low[0] += magnitude.numel()
            return
        bits = self._bits(magnitude)
        in_bucket = bits[(bits >> 16) == self.bucket]
        if in_bucket.numel():
            self.low += torch.bincount(in_bucket & 0xFFFF, minlength=65536).cpu()

    def value(self) -> float:
        """The exact m-th largest magnitude (call after both passes)."""
        if self.m <= 0:
            return float("inf")
        total = int(self.high.sum())
        if self.m > total:
            return float("-inf")
        above = torch.flip(torch.cumsum(torch.flip(self.low, [0]), 0), [0])  # entries >= each low value
        idx = torch.nonzero(self.above + above >= self.m).flatten()
        low = int(idx[-1]) if len(idx) else 0
        bits = torch.tensor([(self.bucket << 16) | low], dtype=torch.int32)
        return bits.view(torch.float32).item()


def sample_positions(numel: int) -> torch.Tensor:
    """Sorted, seeded positions of a tensor of ``numel`` entries whose |τ| :func:`streamed_thresholds` samples."""
    generator = torch.Generator().manual_seed(numel)
    return torch.randint(numel, (_BRACKET_SAMPLE,), generator=generator).sort().values


def streamed_thresholds(chunks, counts: Sequence[int], numel: int, samples: Sequence[torch.Tensor]) -> list[float]:
    """Per task, the ``counts[i]``-th largest ``|τ_i|`` of one tensor seen as flat chunks: the value
    :func:`magnitude_threshold` gives on the whole tensor (``+inf`` for a count ≤ 0, ``-inf`` for one ≥ ``numel``).

    ``chunks()`` yields, for each consecutive piece of the tensor, the list of the q task vectors' float32 pieces;
    ``samples[i]``: ``|τ_i|`` at :func:`sample_positions`. As in :func:`magnitude_threshold`, the sample's quantiles
    bracket the target: one pass counts the entries above the bracket and keeps those inside, and a selection among
    them is exact whenever the counts prove the target inside; a task whose bracket missed takes the two passes of
    :class:`ExactKthLargest`. No whole task vector is ever held.
    """
    values = [float("inf") if m <= 0 else float("-inf") for m in counts]
    active = [i for i, m in enumerate(counts) if 0 < m < numel]
    bounds = {}
    for i in active:
        q = 1.0 - counts[i] / numel
        margin = 5.0 * (q * (1.0 - q) / samples[i].numel()) ** 0.5
        levels = torch.tensor([max(q - margin, 0.0), min(q + margin, 1.0)], device=samples[i].device)
        bounds[i] = torch.quantile(samples[i].float(), levels).tolist()  # levels on the sample's device (CUDA)
    above, inside = dict.fromkeys(active, 0), {i: [] for i in active}
    for taus in chunks():
        for i in active:
            count, kept = _bracket(taus[i].reshape(-1), *bounds[i], absolute=True)
            above[i] += count
            inside[i].append(kept)
    missed = []
    for i in active:
        kept, rank = torch.cat(inside.pop(i)), counts[i] - above[i]
        if 0 < rank <= kept.numel():
            values[i] = _kth_smallest(kept, kept.numel() - rank + 1)
        else:
            missed.append(i)
    if missed:
        selectors = {i: ExactKthLargest(counts[i]) for i in missed}
        for taus in chunks():
            for i, selector in selectors.items():
                selector.add_pass1(taus[i].abs())
        for selector in selectors.values():
            selector.finish_pass1()
        for taus in chunks():
            for i, selector in selectors.items():
                selector.add_pass2(taus[i].abs())
        for i, selector in selectors.items():
            values[i] = selector.value()
    return values
