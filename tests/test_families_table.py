"""``benchmarks/families_table.py`` on a subset: one row per architecture, a cell per method (``ties``, ``m_ties``,
``wudi``, ``cart``, ``svc``: TIES calibrated by SVC) each, the Markdown table and the JSON record agreeing (marker ``slow``: another process, tiny models merged)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SUBSET = ["Llama", "ViTForImageClassification", "Llava", "Whisper"]


def test_the_table_has_one_row_per_architecture(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "families_table.py"), "--only", ",".join(SUBSET),
                           "--results", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "families_table.json").read_text())
    rows = {row["architecture"]: row for row in record["rows"]}
    assert list(rows) == SUBSET
    assert {"transformers", "torch", "hf_mloss", "revision"} <= set(record["meta"])
    for row in rows.values():
        assert row["ties"]["status"] in {"ok", "refused", "error"}
        assert row["m_ties"]["status"] in {"ok", "refused", "error", "not run"}
        assert row["ties"]["status"] == "ok" or row["ties"]["detail"]
    assert rows["ViTForImageClassification"]["class"] == "ViTForImageClassification"
    assert all(rows[name]["ties"]["status"] == "ok" for name in SUBSET), rows
    # the data-free methods of issue 71 run wherever TIES does
    assert all(rows[name][m]["status"] == "ok" for name in SUBSET for m in ("wudi", "cart", "svc")), rows
    assert rows["Llava"]["m_ties"]["status"] == "ok" and rows["Llava"]["m_ties_data"] == "image+text"
    assert rows["Whisper"]["m_ties"]["status"] == "not run"
    table = (tmp_path / "families_table.md").read_text().splitlines()
    body = [line for line in table if line.startswith("| ") and not line.startswith("| architecture")]
    assert [line.split(" | ")[0].removeprefix("| ") for line in body] == SUBSET
    assert all(line.count(" | ") == 8 for line in body)


def test_an_unknown_architecture_is_refused_naming_the_known_ones(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "families_table.py"), "--only", "Nope",
                           "--results", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "unknown architectures ['Nope']" in proc.stderr and "Llama" in proc.stderr
