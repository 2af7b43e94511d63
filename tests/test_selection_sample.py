"""Label-free selection scores a seeded sample spread over the whole data sample, not its first images."""

from __future__ import annotations

import pytest
import torch

from hf_mloss.merging.selection import spread_sample


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize(("tasks", "per_task", "n"), [(4, 32, 8), (6, 10, 6), (3, 50, 32), (5, 7, 5)])
def test_data_ordered_task_by_task_gives_every_task_its_share(seed, tasks, per_task, n) -> None:
    task_of = torch.arange(tasks).repeat_interleave(per_task)  # task 0's images first, then task 1's...
    picked = spread_sample(task_of, n, seed)
    counts = torch.bincount(picked, minlength=tasks)
    assert len(picked) == n
    assert int(counts.min()) >= n // tasks and int(counts.max()) <= -(-n // tasks)  # ⌊n/T⌋ … ⌈n/T⌉ per task


def test_sample_is_seeded_distinct_and_in_order() -> None:
    values = torch.arange(1000)
    a, b, c = spread_sample(values, 100, 0), spread_sample(values, 100, 0), spread_sample(values, 100, 1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.unique(a).numel() == 100 and bool((a[1:] > a[:-1]).all())
    assert int(a.max()) >= 990  # reaches the end of the set, unlike the first 100
    assert torch.equal(spread_sample(values[:7], 7, 3), values[:7])  # n ≥ N: all of them, in order
