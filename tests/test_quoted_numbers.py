"""Every measured number the README and docs/*.md quote comes from a committed record they name.

A *measured number* is a decimal with two or more digits after the point (an accuracy, a difference, a ratio, a
p-value: 79.33, −14.91, 0.056) or a duration in seconds ("470 s"). It must appear, to the digits quoted, in one of the
records (``benchmarks/results/*.md`` / ``.json``) named in the same paragraph or list item, else in one named in the
same section. Code (and a parameter's default in parentheses after its name in code), versions (transformers 4.57)
and parameters written with one decimal (k = 0.2) are not measured numbers. A
measured number quoted next to no record fails: a sentence says only what a record shows.
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RECORD = re.compile(r"([A-Za-z0-9_.\-]+)\.(?:md|json)\b")
NUMBER = re.compile(r"(?<![\w.\-/])([+\-−]?)(\d+\.\d{2,}|\d+(?:\.\d+)?(?= s\b))(?![\w.]*\.\d)")
CODE = re.compile(r"`[^`]*`(?:\s*\([^)]*\))?")  # a code span, and a default in parentheses after it
VERSION = re.compile(r"(?:transformers|torch|Python|mergekit|peft|fusion-bench|accelerate|datasets|huggingface_hub)"
                     r"\s*(?:[<>=]=?\s*)?$")


def paragraphs(text: str) -> list[tuple[str, str]]:
    """``(section heading, paragraph or list item)`` pairs of a Markdown text, code blocks removed."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out, heading, block = [], "", []
    for line in text.splitlines() + [""]:
        starts_item = re.match(r"\s*(?:[-*] |\d+\. |\|)", line)
        if line.startswith("#") or not line.strip() or starts_item:
            if block:
                out.append((heading, " ".join(block)))
            block = []
            if line.startswith("#"):
                heading = line
            elif line.strip():
                block = [line]
            continue
        block.append(line)
    return out


def named_records(text: str) -> set[Path]:
    """The committed records a text names (by file name, with or without its folder)."""
    names = set()
    for match in RECORD.finditer(text):
        stem = match.group(1).split("/")[-1]
        for suffix in (".md", ".json"):
            path = RESULTS / f"{stem}{suffix}"
            if path.exists():
                names.add(path)
    return names


def measured(text: str) -> list[str]:
    """The measured numbers of a paragraph (signs kept; code spans, parameters' defaults after them and versions
    left out)."""
    text = CODE.sub(" ", text)
    return [match.group(1).replace("−", "-") + match.group(2) for match in NUMBER.finditer(text)
            if not VERSION.search(text[max(0, match.start() - 40):match.start()])]


@lru_cache(maxsize=None)
def record_numbers(path: Path) -> tuple[str, tuple[float, ...]]:
    """A record's text and every number in it (JSON values and numbers written in the text)."""
    text = path.read_text()
    values = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text.replace("−", "-"))]
    if path.suffix == ".json":
        def walk(node):
            if isinstance(node, dict):
                for v in node.values():
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)
            elif isinstance(node, (int, float)) and not isinstance(node, bool):
                values.append(float(node))
        walk(json.loads(text))
    return text, tuple(values)


def found(number: str, records: set[Path]) -> bool:
    """Whether ``number`` (as quoted: its digits set the tolerance) is a value of one of ``records``, also as a
    percentage of a fraction, with or without its sign."""
    decimals = len(number.partition(".")[2])
    value = float(number)
    tolerance = 0.5 * 10 ** -decimals + 1e-12
    for path in records:
        text, values = record_numbers(path)
        if number.lstrip("+") in text or number.lstrip("+-") in text:
            return True
        for v in values:
            for candidate in (v, 100 * v):
                if math.isclose(abs(candidate), abs(value), abs_tol=tolerance):
                    return True
    return False


def unsupported(doc: Path) -> list[str]:
    """The measured numbers of ``doc`` that no record it names holds, with their paragraph's start."""
    problems = []
    sections: dict[str, set[Path]] = {}
    items = paragraphs(doc.read_text())
    for heading, block in items:
        sections.setdefault(heading, set()).update(named_records(block))
    for heading, block in items:
        numbers = measured(block)
        if not numbers:
            continue
        records = named_records(block) or sections.get(heading, set())
        for number in numbers:
            if not records:
                problems.append(f"{number} (no record named) in: {block[:90]}...")
            elif not found(number, records):
                problems.append(f"{number} not in {sorted(p.name for p in records)}: {block[:90]}...")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_measured_number_comes_from_a_named_record(doc):
    problems = unsupported(doc)
    assert not problems, f"{len(problems)} number(s) in {doc.name} with no record behind them:\n" + "\n".join(
        problems[:40])


def test_the_check_finds_a_number_no_record_holds(tmp_path, monkeypatch):
    """The checker itself: a quoted number absent from the named record, and one with no record, both fail; the
    record's own numbers (also as percentages of its fractions) pass."""
    record = tmp_path / "results"
    record.mkdir()
    (record / "toy.json").write_text(json.dumps({"test": 0.7933, "gap": -14.905, "seconds": 470}))
    monkeypatch.setattr(__import__(__name__), "RESULTS", record)
    doc = tmp_path / "doc.md"
    doc.write_text("# A\n\nTSV-M reaches 79.33 test, G6 −14.91, in 470 s (`toy.md`).\n\nAnd 12.34 (`toy.md`).\n\n"
                   "# B\n\nElsewhere 56.78 points.\n")
    problems = unsupported(doc)
    assert len(problems) == 2 and "12.34 not in" in problems[0] and "56.78 (no record named)" in problems[1]
