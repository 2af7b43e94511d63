"""The merge-speed benchmark's pieces that decide its numbers: the scoring floor's share of a block, the
checkpoints of the large shapes written tensor by tensor, and the wall budget that bounds a run to a fixed time slot."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import merge_speed
from merge_speed import write_safetensors_streamed
from merge_speed_report import scored_share


def _payload(kind: str, **config) -> dict:
    return {"inputs": {"kind": kind}, "models": {"config": config}}


def test_scored_share_is_one_third_for_clip_and_gate_plus_up_for_a_gated_decoder() -> None:
    """CLIP (f = 4d): fc1 is d·f of a block's 4d² + 2df = 1/3. Qwen2.5-0.5B: gate and up, 2·d·f, over the block's
    attention projections d·(2d + 2·kv·h) plus its three MLP matrices 3·d·f."""
    assert scored_share(_payload("clip_vision", hidden_size=768, intermediate_size=3072)) == pytest.approx(1 / 3)
    d, f = 896, 4864
    qwen = _payload("decoder", hidden_size=d, intermediate_size=f, num_attention_heads=14, num_key_value_heads=2)
    assert scored_share(qwen) == pytest.approx(2 * d * f / (d * (2 * d + 2 * 2 * 64) + 3 * d * f))
    assert scored_share(qwen) == pytest.approx(0.5846, abs=1e-4)


def test_streamed_safetensors_file_reads_back_as_written(tmp_path) -> None:
    """Header first, then each tensor's bytes as produced: safetensors reads the same tensors, dtypes and shapes."""
    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b.bias": torch.randn(7), "c": torch.randn(2, 2).half()}
    entries = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    write_safetensors_streamed(tmp_path / "model.safetensors", entries, lambda name: tensors[name].clone())
    back = load_file(tmp_path / "model.safetensors")
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)
    with pytest.raises(ValueError, match="expected"):
        write_safetensors_streamed(tmp_path / "bad.safetensors", [("a", (4, 5), torch.float32)],
                                   lambda name: torch.zeros(3, 5))


def test_budget_cuts_timeouts_and_skips_runs_once_spent(tmp_path, monkeypatch) -> None:
    """``--budget``: each run's timeout is what is left of it; once spent, the remaining runs are recorded as not
    started (so the results are still written) instead of being run or lost."""
    args = merge_speed.parse_args(["--shape", "tiny", "--skip-peers", "--methods", "read,ties_tensor,m_ties",
                                   "--timeout", "100", "--budget", "30", "--cache", str(tmp_path),
                                   "--results-dir", str(tmp_path / "res")])
    plan = merge_speed.make_plan(args)
    assert 28 < plan.run_timeout() <= 30
    started = []

    def fake_run(plan, name, repeat, reference=False):
        started.append(name)
        plan.deadline -= 40  # this run used up the budget
        return {"name": name, "wall_s": 1.0, "cpu_s": 1.0, "max_rss_mb": 1.0}

    monkeypatch.setattr(merge_speed, "run_hf", fake_run)
    monkeypatch.setattr(merge_speed, "run_checks", lambda *a: {})
    repeat = merge_speed.run_repeat(plan, 0)
    assert started == ["read"]
    assert plan.run_timeout() == 0
    assert repeat["runs"]["read"]["wall_s"] == 1.0
    for name in ("ties_tensor", "m_ties"):
        assert repeat["runs"][name]["skipped"].startswith("not started: the --budget of 30 s was spent")
    plan.deadline = None
    assert plan.run_timeout() == 100


def test_creating_the_inputs_is_bounded_by_the_budget_not_by_one_runs_timeout(tmp_path, monkeypatch) -> None:
    """Writing a large fixture may outlast ``--timeout`` (one merge's limit): only ``--budget`` bounds it, and without
    a budget nothing does."""
    limits = []

    def fake_child(spec, work, timeout, **kwargs):
        limits.append(timeout)
        return {"error": "stop here"}

    monkeypatch.setattr(merge_speed, "run_child", fake_child)
    for extra, expected in ((["--budget", "500"], lambda t: 498 < t <= 500), ([], lambda t: t == float("inf"))):
        args = merge_speed.parse_args(["--shape", "tiny", "--skip-peers", "--methods", "read", "--timeout", "10",
                                       "--cache", str(tmp_path), "--results-dir", str(tmp_path / "res"), *extra])
        with pytest.raises(SystemExit, match="creating the inputs failed: stop here"):
            merge_speed.create_inputs(merge_speed.make_plan(args))
        assert expected(limits[-1]), limits[-1]


def test_svd_floor_counts_exact_tsv_m_eigenproblems() -> None:
    """Per 2-D tensor m × n with k = ⌊min(m, n)/q⌋ > 0: q problems of size min(m, n), then the two polar factors'
    min(m, q·k) and min(q·k, n). Vectors, 4-D kernels and matrices too thin to keep a component take none."""
    shapes = [(768, 768), (3072, 768), (768, 3072), (50, 768), (768,), (768, 3, 32, 32), (5, 3)]
    assert merge_speed.svd_floor_sizes(shapes, 8) == [
        (768, 8), (768, 1), (768, 1),
        (768, 8), (768, 1), (768, 1),
        (768, 8), (768, 1), (768, 1),
        (50, 8), (48, 1), (48, 1),  # k = 6: the concatenated bases have q·k = 48 columns
    ]
    assert merge_speed.svd_floor_sizes([(5, 3)], 4) == []


def test_svd_floor_child_times_every_problem_and_reports_the_fastest_float32_pass(tmp_path) -> None:
    """The child reads only the base's tensor shapes and times each dtype at the default thread count and one."""
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(24, 16), "b": torch.zeros(16), "e": torch.zeros(4, 16)}, tmp_path / "model.safetensors")
    info: dict = {}
    merge_speed.child_svd_floor({"device": "cpu", "base": str(tmp_path), "models": ["a", "b"]}, None, info)
    assert info["problems"] == 2 * (2 + 2) and info["matrices"] == 2 and info["largest"] == 16
    passes = info["passes"]
    assert [p["dtype"] for p in passes] == ["float64"] * 2 + ["float32"] * 2
    assert [p["threads"] for p in passes][1::2] == [1, 1]
    assert info["inner_s"] == min(p["wall_s"] for p in passes if p["dtype"] == "float32")
    assert info["float64_s"] == min(p["wall_s"] for p in passes if p["dtype"] == "float64")
    save_file({"b": torch.zeros(16), "thin": torch.zeros(16, 1)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="no 2-D tensor of the base keeps a component"):
        merge_speed.child_svd_floor({"device": "cpu", "base": str(tmp_path), "models": ["a", "b"]}, None, {})


def test_svd_floor_ratio_against_mergekit_is_reported_beside_tsv_m() -> None:
    """The floor's ratio adds tsv_m's time outside its merge (when it ran): the least wall an exact TSV-M could take."""
    from merge_speed_report import Ratios, mergekit_ratios

    runs = {"mergekit_ties": {"wall_s": 80.0, "cpu_s": 150.0, "max_rss_mb": 4000.0, "tasks": 8},
            "tsv_m": {"wall_s": 60.0, "cpu_s": 110.0, "max_rss_mb": 1000.0, "child": {"inner_s": 50.0}},
            "svd_floor": {"wall_s": 40.0, "cpu_s": 70.0, "max_rss_mb": 400.0,
                          "child": {"inner_s": 30.0, "float64_s": 45.0}}}
    ratios = Ratios()
    mergekit_ratios(ratios, runs, 8)
    assert dict(ratios)["tsv_m_vs_mergekit_wall"]["value"] == pytest.approx(0.75)
    floor = dict(ratios)["svd_floor_vs_mergekit_wall"]  # the reductions plus tsv_m's 10 s outside its merge
    assert floor["value"] == pytest.approx((30.0 + 10.0) / 80.0) and floor["target"] is None
    assert dict(ratios)["svd_floor_f64_vs_mergekit_wall"]["value"] == pytest.approx((45.0 + 10.0) / 80.0)
    del runs["tsv_m"]
    ratios = Ratios()
    mergekit_ratios(ratios, runs, 8)
    assert dict(ratios)["svd_floor_vs_mergekit_wall"]["value"] == pytest.approx(30.0 / 80.0)


def test_render_rederives_the_ratios_of_a_committed_record(tmp_path) -> None:
    """``--render`` recomputes the summary from the measurements (here: a record whose summary was dropped) and
    rewrites both files; the TSV-M floor's ratios come out as the record's notes quote them."""
    import json
    import shutil

    record = tmp_path / "record.json"
    shutil.copy(REPO / "benchmarks/results/merge_speed_scale_r5_b32-tsv-floor_cpu.json", record)
    payload = json.loads(record.read_text())
    payload.pop("summary")
    record.write_text(json.dumps(payload))
    assert merge_speed.main(["--render", str(record)]) == 0
    summary = json.loads(record.read_text())["summary"]["ratios"]
    values = [v["value"] for v in summary["svd_floor_vs_mergekit_wall"]["values"]]
    assert values == [pytest.approx(0.246, abs=5e-4), pytest.approx(0.238, abs=5e-4)]
    assert summary["tsv_m_vs_mergekit_wall"]["met"] == 0 and summary["tsv_m_vs_mergekit_wall"]["of"] == 2
    assert "TSV-M floor: 730 eigenproblems for 73 matrices" in record.with_suffix(".md").read_text()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="the split is read from Linux's /proc")
def test_the_child_memory_split_tells_allocations_from_mapped_file_pages(tmp_path) -> None:
    """A child that allocates 160 MB shows it as anon; one that reads a 160 MB file through ``mmap`` shows it as
    file pages, with its own allocations small: the split the 7B and 1.5B records read peak RSS by."""
    import subprocess
    import time

    data = tmp_path / "weights.bin"
    data.write_bytes(b"\1" * (160 << 20))
    programs = {
        "anon": "b = bytearray(160 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nimport time; time.sleep(0.5)",
        "file": f"import mmap, time\nf = open({str(data)!r}, 'rb')\nm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)"
                "\ns = sum(m[i] for i in range(0, len(m), 4096))\ntime.sleep(0.5)",
    }
    peaks = {}
    for kind, program in programs.items():
        proc = subprocess.Popen([sys.executable, "-c", program])
        sampler = merge_speed.RssSampler(proc.pid)
        status, _, timed_out = merge_speed._wait(proc, time.perf_counter() + 60, sampler.sample)
        assert os.waitstatus_to_exitcode(status) == 0 and not timed_out
        peaks[kind] = sampler.peaks()
    assert peaks["anon"]["peak_rss_anon_mb"] > 150 and peaks["anon"]["peak_rss_file_mb"] < 100, peaks
    assert peaks["file"]["peak_rss_file_mb"] > 150 and peaks["file"]["peak_rss_anon_mb"] < 100, peaks


def test_the_runs_table_shows_the_memory_split_only_where_it_was_sampled() -> None:
    from merge_speed_report import runs_table_lines

    p = {"q": 2, "models": {"model_bytes": 1e9}, "device": "cpu", "shape": "qwen2.5-1.5b"}
    run = {"wall_s": 10.0, "cpu_s": 15.0, "max_rss_mb": 3000.0}
    old = runs_table_lines({"runs": {"m_ties": dict(run)}}, p)
    new = runs_table_lines({"runs": {"m_ties": {**run, "peak_rss_anon_mb": 1200.4, "peak_rss_file_mb": 2100.0}}}, p)
    assert "anon" not in old[0] and old[2].count("|") == old[0].count("|")
    assert "peak anon / file MB" in new[0] and "| 1200 / 2100 |" in new[2] and new[2].count("|") == new[0].count("|")


def test_svc_floor_times_each_shapes_factorisation_and_sets_it_beside_task_arithmetic(tmp_path) -> None:
    """Each distinct 2-D shape's float64 Gram + eigenvectors, times the tensors of that shape; the report adds the
    floor to task arithmetic's wall (the lowest ratio an exact SVC over it can reach) and compares what calibrating
    added with it."""
    from safetensors.torch import save_file

    from merge_speed_report import Ratios, workload_ratios

    save_file({"q": torch.zeros(6, 4), "k": torch.zeros(6, 4), "fc": torch.zeros(3, 5), "b": torch.zeros(4)},
              tmp_path / "model.safetensors")
    info: dict = {}
    merge_speed.child_svc_floor({"device": "cpu", "base": str(tmp_path)}, None, info)
    shapes = info["shapes"]
    assert {name: s["count"] for name, s in shapes.items()} == {"6x4": 2, "3x5": 1}
    assert info["inner_s"] == pytest.approx(sum(s["count"] * s["factorisation_s"] for s in shapes.values()))
    assert [p["threads"] for p in info["passes"]][-1] == 1  # and the default threads' pass before it
    assert info["inner_s"] == min(p["total_s"] for p in info["passes"])
    runs = {"task_arithmetic": {"wall_s": 10.0, "cpu_s": 9.0, "max_rss_mb": 800.0, "child": {"inner_s": 4.0}},
            "task_arithmetic_svc": {"wall_s": 38.0, "cpu_s": 36.0, "max_rss_mb": 1000.0, "child": {"inner_s": 31.0}},
            "svc_floor": {"wall_s": 20.0, "cpu_s": 19.0, "max_rss_mb": 500.0, "child": {"inner_s": 9.0}}}
    ratios = Ratios()
    workload_ratios(ratios, runs)
    assert dict(ratios)["task_arithmetic_svc_floor_vs_task_arithmetic_wall"]["value"] == pytest.approx(19.0 / 10.0)
    assert dict(ratios)["svc_added_vs_svc_floor"]["value"] == pytest.approx(27.0 / 9.0)


def test_every_input_is_read_once_before_a_run_and_the_record_says_how_long_it_took(tmp_path) -> None:
    """The runs read their checkpoints from the page cache only if something read them since the last run that
    evicted them: each run is preceded by one untimed read of every file of the base and the fine-tunes."""
    from types import SimpleNamespace

    from merge_speed_report import runs_table_lines

    folders = [tmp_path / name for name in ("base", "ft0", "ft1")]
    for i, folder in enumerate(folders):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(os.urandom(1000 + i))
        (folder / "config.json").write_text("{}")
    warm = merge_speed.warm_inputs(SimpleNamespace(base=folders[0], models=folders[1:]))
    assert warm["bytes"] == 1000 + 1001 + 1002 + 3 * 2 and warm["s"] >= 0
    p = {"q": 2, "models": {"model_bytes": 1e9}, "device": "cpu", "shape": "qwen2.5-1.5b"}
    run = {"wall_s": 10.0, "cpu_s": 15.0, "max_rss_mb": 3000.0}
    lines = runs_table_lines({"runs": {"compatibility": {**run, "warm_read": {"s": 7.25, "bytes": 15_400_000_000}}}}, p)
    assert any("read once, untimed" in line and "compatibility 7.2 s" in line for line in lines)
    assert not any("untimed" in line for line in runs_table_lines({"runs": {"compatibility": run}}, p))
