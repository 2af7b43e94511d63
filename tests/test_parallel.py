"""Runs use as many worker threads as the cores allow; the results must not depend on how many."""

from __future__ import annotations

import pytest
import torch

import hf_mloss
from hf_mloss import parallel
from hf_mloss.errors import InvalidParameterError


def _run(monkeypatch, threads: int, fn, *, pooled: bool = True):
    """``fn()`` with ``threads`` threads; with ``pooled``, checks that pieces ran on worker threads whenever there
    are several (else that it ran on the calling thread, with ``threads`` intra-op threads)."""
    monkeypatch.setenv("HF_MLOSS_THREADS", str(threads))
    pieces = []
    original = parallel._run_task
    monkeypatch.setattr(parallel, "_run_task", lambda *a: (pieces.append(parallel.in_worker()), original(*a))[1])
    result = fn()
    assert bool(pieces) == (pooled and threads > 1) and all(pieces)
    return result


@pytest.mark.parametrize("method, params", [
    ("ties", {"k": 0.3, "lam": 1.0}),
    ("dare_ties", {"p": 0.5, "lam": 1.0}),
    ("task_arithmetic", {"lam": 0.7}),
])
def test_data_free_merges_are_bitwise_equal_for_any_thread_count(monkeypatch, tiny_paths, method, params):
    base, models = tiny_paths

    def merged():
        return hf_mloss.merge(base, models, method, seed=3, progress=False, **params).model.state_dict()

    one, two, three = (_run(monkeypatch, n, merged) for n in (1, 2, 3))
    assert one.keys() == two.keys() == three.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name
        assert torch.equal(one[name], three[name]), name


def test_m_ties_and_scores_are_bitwise_equal_for_any_thread_count(monkeypatch, tiny_paths, image_folder):
    base, models = tiny_paths

    def merged():
        result = hf_mloss.merge(base, models, "m_ties", k=0.4, data=str(image_folder), num_samples=8,
                                batch_size=3, progress=False)
        return result.model.state_dict(), result.report

    (one, report1), (two, report2) = (_run(monkeypatch, n, merged) for n in (1, 2))
    for name in one:
        assert torch.equal(one[name], two[name]), name
    assert report1.layer == report2.layer
    for layer in report1.layers:
        assert torch.equal(report1.node[layer], report2.node[layer]), layer
        assert torch.equal(report1.keep_ratios[layer], report2.keep_ratios[layer]), layer

    def scored():
        return hf_mloss.score(base, models, data=str(image_folder), num_samples=8, batch_size=3, prefix="own")

    own1, own2 = (_run(monkeypatch, n, scored, pooled=False) for n in (1, 2))
    assert own1.layer == own2.layer
    for layer in own1.layers:
        assert torch.equal(own1.node[layer], own2.node[layer]), layer


def test_workers_keep_order_and_cover_every_piece():
    with parallel.cpu_workers("cpu", threads=3) as workers:
        assert workers.size == 3 and parallel.active() is workers
        assert workers.map(lambda x: x * x, range(10)) == [x * x for x in range(10)]
        seen = torch.zeros(101, dtype=torch.long)

        def mark(piece: slice) -> None:
            seen[piece] += 1

        workers.split(mark, 101, align=8)
        assert seen.tolist() == [1] * 101
    assert parallel.active() is parallel.SERIAL


def test_thread_count_override_and_restore(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("HF_MLOSS_THREADS", "1")
    assert parallel.run_threads("cpu") == 1
    with parallel.cpu_workers("cpu") as workers:
        assert workers.size == 1 and not workers.parallel and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    monkeypatch.setenv("HF_MLOSS_THREADS", "not a number")  # refused, not silently ignored
    with pytest.raises(InvalidParameterError, match="HF_MLOSS_THREADS"):
        parallel.run_threads("cpu")
    monkeypatch.delenv("HF_MLOSS_THREADS")  # unset: the idle cores
    assert 1 <= parallel.run_threads("cpu") <= torch.get_num_threads()


def test_idle_cores_do_not_count_this_processs_own_threads(monkeypatch):
    """Another process's load takes cores from a run; the run's own background thread (hashing its inputs) does not.
    Two cores over 200 jiffies: 50 idle; this process ran 0.3 s (30 jiffies at 100 per second) of the 150 busy."""
    times = iter([[(100, 50), (100, 50)], [(200, 100), (200, 50)]])
    clock = iter([1.0, 1.3])
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(parallel, "_cpu_times", lambda cpus: next(times))
    monkeypatch.setattr(parallel.time, "process_time", lambda: next(clock))
    monkeypatch.setattr(parallel.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(parallel.os, "sysconf", lambda name: 100)
    assert parallel.idle_cores() == pytest.approx(0.5 + 0.3)  # the idle half core, and the 0.3 this process used


def test_a_data_guided_merge_re_runs_bit_for_bit_at_a_fixed_thread_count(monkeypatch, tmp_path):
    """RegMean++ on a decoder whose MLP is 200 wide: two runs with ``HF_MLOSS_THREADS=2`` (pieces on 2 workers, the
    calling thread's products on 2 threads) write the same bits whatever the load beside them. Across thread counts
    they need not: MKL may split such a product by its inner dimension on 2 threads (see ``hf_mloss.parallel``)."""
    from examples.tiny import save_with_finetunes, tiny_decoder

    torch.manual_seed(0)
    base, models = save_with_finetunes(tiny_decoder("qwen2", tie=True, vocab_size=300, hidden_size=96,
                                                    intermediate_size=200, num_attention_heads=4,
                                                    num_key_value_heads=2), tmp_path / "decoder", q=2)
    ids = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(3))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def merged():
        return hf_mloss.merge(str(base), [str(m) for m in models], "regmean_plusplus", data=data,
                              progress=False).model.state_dict()

    first, second = (_run(monkeypatch, 2, merged) for _ in range(2))
    assert [name for name in first if not torch.equal(first[name], second[name])] == []


def test_a_recipe_records_its_thread_count_and_re_runs_on_it(monkeypatch, tmp_path, tiny_paths, image_folder):
    """The recipe of a CPU merge records the threads it ran on; ``hf_mloss.run`` of it uses as many when
    ``HF_MLOSS_THREADS`` is unset, whatever the idle cores say (so the bits are the recorded run's), clamped to the
    cores; ``HF_MLOSS_THREADS`` wins over the record; a recorded value out of range is refused before any work."""
    base, models = tiny_paths
    monkeypatch.setattr(parallel, "machine_cores", lambda: 3)
    monkeypatch.setenv("HF_MLOSS_THREADS", "2")
    first = hf_mloss.merge(base, models, "regmean_plusplus", data=str(image_folder), num_samples=8, batch_size=3,
                           progress=False)
    assert first.config.threads == 2
    first.save_pretrained(tmp_path / "merged")
    assert "threads: 2\n" in (tmp_path / "merged" / "hf_mloss_config.yaml").read_text()
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "It ran on 2 CPU threads, and a re-run uses as many unless\n`HF_MLOSS_THREADS` is set" in card

    monkeypatch.delenv("HF_MLOSS_THREADS")
    monkeypatch.setattr(parallel, "idle_cores", lambda interval=0.05: 1.0)  # the usual rule would take 1
    assert parallel.run_threads("cpu") == 1
    again = hf_mloss.run(tmp_path / "merged", progress=False)
    assert again.config.threads == 2
    expected = first.model.state_dict()
    assert [n for n, t in again.model.state_dict().items() if not torch.equal(t, expected[n])] == []

    monkeypatch.setattr(parallel, "machine_cores", lambda: 1)  # fewer cores than recorded: clamped
    assert hf_mloss.run(tmp_path / "merged", progress=False).config.threads == 1
    monkeypatch.setattr(parallel, "machine_cores", lambda: 3)
    monkeypatch.setenv("HF_MLOSS_THREADS", "3")  # the variable wins over the record
    assert hf_mloss.run(tmp_path / "merged", progress=False).config.threads == 3

    recipe = hf_mloss.MergeConfig.from_pretrained(tmp_path / "merged").to_dict(tmp_path / "merged")
    for wrong in (0, -2, "two", 2.5, 10**7):
        with pytest.raises(hf_mloss.ConfigError, match="threads"):
            hf_mloss.MergeConfig.from_dict({**recipe, "threads": wrong}, base_dir=tmp_path / "merged")
    with pytest.raises(InvalidParameterError, match=r"\['threads'\]: a run records these"):
        hf_mloss.merge(base, models, "ties", threads=2, progress=False)
