"""The README's main job end to end in its fast mode: build the tiny suite, compare every method, write results.

This checks the pipeline, not the numbers (a few training steps, one setting per method).
"""

from __future__ import annotations

import json

from transformers import CLIPVisionModel

from hf_mloss.suites.__main__ import main


def test_tiny_suite_fast_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["tiny", "--fast", "--cache", str(tmp_path / "cache"), "--out", str(out), "--seeds", "2",
                 "--num-samples", "32"]) == 0
    printed = capsys.readouterr().out
    assert "| ensemble |" in printed and "| m_ties (random ranks) |" in printed
    table = json.loads((out / "results.json").read_text())
    labels = [row["label"] for row in table["methods"]]
    assert labels[:6] == ["average", "task_arithmetic", "ties (global)", "ties (tensor)", "dare_ties", "m_ties"]
    assert {"m_ties (random ranks)", "m_ties (e=0)"} <= set(labels)
    assert set(table["regime"]) == {"pretrained heads", "fine-tuned (each on its task)", "ensemble"}
    rows = {row["label"]: row for row in table["methods"]}
    assert rows["m_ties"]["seeds"] == 2 and rows["average"]["seeds"] == 1
    card = (out / "m_ties_merge" / "README.md").read_text()
    assert "model-index" in card and "## M-Loss per layer" in card
    CLIPVisionModel.from_pretrained(out / "m_ties_merge")
