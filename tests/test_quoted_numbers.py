"""Every number the docs quote is bound to one record and one field of it, and agrees with it, sign included, at the
precision printed (:mod:`benchmarks.quoted`; the bindings: ``benchmarks/bindings/``).

The check runs on every document it covers (README.md, docs/*.md, benchmarks/README.md, the notes
benchmarks/results/*_notes.md). Mutation tests copy the documents and change them as a careless edit would — a sign
flipped, the numbers of two rows swapped, a digit shifted, a number replaced by another — and the check must fail
at every change (a swap or replacement that leaves the printed value as it was changes nothing and is not drawn).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from benchmarks import quoted as Q

DOCS = Q.documents()


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(Q.REPO)) for d in DOCS])
def test_every_quoted_value_is_bound_and_agrees(doc):
    problems = Q.check(doc)
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:40])


def _copy(tmp_path: Path) -> Path:
    """The documents, copied to a repository of their own (the bindings and the records stay where they are)."""
    for doc in DOCS:
        target = tmp_path / doc.relative_to(Q.REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(doc, target)
    return tmp_path


def _values() -> list[Q.Quote]:
    return [q for doc in DOCS for q in Q.quotes(doc) if not q.exempt]


def _mutated(repo: Path, quote: Q.Quote, new: str) -> list[str]:
    """Replace ``quote``'s text in the copy by ``new`` and check that document."""
    path = repo / quote.doc
    text = path.read_text()
    at = quote.offset
    old = text[at:at + len(quote.printed)]
    leading = "−" + old[1:] if old.startswith("-") else old  # a leading ASCII minus reads as "−"; an exponent's stays
    assert leading == quote.printed, (old, quote.printed)
    path.write_text(text[:at] + new + text[at + len(old):])
    try:
        return Q.check(path, repo, Q.BINDINGS)
    finally:
        path.write_text(text)


def _flip(printed: str) -> str:
    body = printed.lstrip("+−±")
    return ("+" if printed.startswith("−") else "−") + body


def _shift(printed: str) -> str:
    """The last digit of the mantissa shifted by two (8 → 6, 3 → 5): by one it could still round from the same value
    where the field sits exactly at a half (−1.075 prints as −1.07 or −1.08)."""
    mantissa, e, exponent = printed.partition("e")
    digits = [i for i, c in enumerate(mantissa) if c.isdigit()]
    i = digits[-1]
    digit = int(mantissa[i])
    new = str(digit - 2 if digit >= 8 else digit + 2)
    return mantissa[:i] + new + mantissa[i + 1:] + e + exponent


def _caught(problems: list[str], quote: Q.Quote) -> bool:
    return any(p.startswith(f"{quote.doc}:{quote.line}:") for p in problems)


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory) -> Path:
    return _copy(tmp_path_factory.mktemp("docs"))


@pytest.fixture(scope="module")
def sample() -> list[Q.Quote]:
    values = _values()
    return random.Random(0).sample(values, 40)


def test_a_flipped_sign_fails(repo_copy, sample):
    flipped = [q for q in sample if q.value != 0][:20]
    missed = [f"{q.doc}:{q.line} {q.printed}" for q in flipped if not _caught(_mutated(repo_copy, q, _flip(q.printed)),
                                                                               q)]
    assert len(flipped) == 20 and not missed, missed


def test_a_shifted_digit_fails(repo_copy, sample):
    missed = [f"{q.doc}:{q.line} {q.printed}" for q in sample[:20]
              if not _caught(_mutated(repo_copy, q, _shift(q.printed)), q)]
    assert not missed, missed


def test_two_swapped_rows_fail(repo_copy):
    """The numbers of two rows swapped: two values of one paragraph or table that differ as printed trade places (a
    sentence's "TSV-M 74.64, Iso-C 69.86" read as "TSV-M 69.86, Iso-C 74.64", a table's rows given each other's
    cell), in one copy; the check flags both."""
    values = _values()
    rng = random.Random(1)
    by_place: dict[tuple[str, str], list[Q.Quote]] = {}
    for q in values:
        by_place.setdefault((q.doc, q.heading), []).append(q)
    pairs = []
    for group in by_place.values():
        distinct = [(a, b) for a in group for b in group if a.offset < b.offset and a.printed.lstrip("+−") !=
                    b.printed.lstrip("+−") and a.decimals == b.decimals and a.doc == b.doc]
        if distinct:
            pairs.append(rng.choice(distinct))
    pairs = rng.sample(pairs, min(15, len(pairs)))
    assert len(pairs) >= 10
    missed = []
    for a, b in pairs:
        path = repo_copy / a.doc
        text = path.read_text()
        swapped = (text[:a.offset] + b.printed + text[a.offset + len(a.printed):b.offset] + a.printed
                   + text[b.offset + len(b.printed):])
        path.write_text(swapped)
        try:
            problems = Q.check(path, repo_copy, Q.BINDINGS)
        finally:
            path.write_text(text)
        if not (_caught(problems, a) and _caught(problems, b)):
            missed.append(f"{a.doc}:{a.line} {a.printed} ↔ {b.line} {b.printed}")
    assert not missed, missed


def test_a_number_no_record_holds_fails(repo_copy, sample):
    """The earlier check accepted a random two-decimal number in 56-93 % of paragraphs (any number of any record the
    paragraph named, any sign); now one that differs from its field as printed fails wherever it stands."""
    rng = random.Random(2)
    missed = []
    for q in sample:
        while True:
            new = f"{rng.uniform(-99, 99):+.2f}".replace("-", "−")
            if round(float(new.replace("−", "-")), 2) != round(q.value, 2):
                break
        if not _caught(_mutated(repo_copy, q, new), q):
            missed.append(f"{q.doc}:{q.line} {q.printed} → {new}")
    assert not missed, missed


def test_a_value_without_a_binding_and_a_stale_binding_fail(tmp_path):
    """A new value in the text has no binding; a binding whose value left the text is stale; a field that does not
    resolve says so. Records of the test's own: the check reads only what it is given."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "toy.json").write_text(json.dumps({"summary": {"tsv_m": {"test": 74.6412}, "ties": {"test": 60.45}},
                                                  "differences": [{"a": "m_ties", "b": "ties", "mean": -0.781}],
                                                  "gates": [{"name": "G6", "value": "G6 = +9.11 (t [+8.26, +9.96])"}]}))
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "page.md"
    doc.write_text("# Page\n\nTest: TSV-M 74.64, TIES 60.45 (`toy.md`); M-TIES 0.78 below TIES, G6 +9.11 [+8.26, "
                   "+9.96]. Settings k = 0.2, λ 1.3, 8 tasks, torch 2.13.0 need no binding.\n")
    bindings = tmp_path / "bindings"
    found = [q for q in Q.quotes(doc, tmp_path) if not q.exempt]
    assert [q.printed for q in found] == ["74.64", "60.45", "0.78", "+9.11", "+8.26", "+9.96"]
    fields = ["{summary/tsv_m/test}", "{summary/ties/test}", "-{differences/[a=m_ties&b=ties]/mean}",
              "{gates/[name=G6]/value#2}", "{gates/[name=G6]/value#3}", "{gates/[name=G6]/value#4}"]
    Q.write_bindings("docs/page.md", [Q.Binding(*q.key, q.printed, "toy", f) for q, f in zip(found, fields)], bindings)
    assert Q.check(doc, tmp_path, bindings, results) == []
    doc.write_text(doc.read_text().replace("TIES 60.45", "TIES 60.54").replace("0.78 below", "−0.78 below"))
    problems = Q.check(doc, tmp_path, bindings, results)
    assert len(problems) == 2 and "60.54 is not toy {summary/ties/test} = 60.45" in problems[0]
    doc.write_text(doc.read_text().replace("TSV-M 74.64, ", "TSV-M 74.64, Iso-C 69.86, "))
    problems = Q.check(doc, tmp_path, bindings, results)
    assert any("69.86 is bound to no record" in p for p in problems)
    assert any("stale" in p for p in problems)  # TIES's binding: the text before it changed
    doc.write_text("# Page\n\nTest: TSV-M 74.64 (`toy.md`).\n")
    (only,) = [q for q in Q.quotes(doc, tmp_path) if not q.exempt]
    Q.write_bindings("docs/page.md", [Q.Binding(*only.key, "74.64", "toy", "{summary/iso_c/test}")], bindings)
    assert "does not resolve" in Q.check(doc, tmp_path, bindings, results)[0]


def test_a_binding_under_a_heading_that_starts_with_a_number_is_read(tmp_path):
    """Under "## 7B on one machine" a binding's anchor starts with "#B" (the number masked): it is a binding, not a
    comment like the file's header, so the value is bound and a wrong one still fails."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "toy.json").write_text(json.dumps({"wall_s": 217.69}))
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "page.md"
    doc.write_text("# Page\n\n## 7B on one machine\n\nTIES took 217.7 s (`toy.md`).\n")
    (found,) = [q for q in Q.quotes(doc, tmp_path) if not q.exempt]
    assert found.anchor.startswith("#B on one machine")
    bindings = tmp_path / "bindings"
    Q.write_bindings("docs/page.md", [Q.Binding(*found.key, found.printed, "toy", "{wall_s}")], bindings)
    assert [b.printed for b in Q.read_bindings("docs/page.md", bindings)] == ["217.7"]
    assert Q.check(doc, tmp_path, bindings, results) == []
    doc.write_text(doc.read_text().replace("217.7", "271.7"))
    assert "271.7 is not toy {wall_s}" in Q.check(doc, tmp_path, bindings, results)[0]


def test_a_value_turned_into_a_count_is_reported_at_its_line(tmp_path):
    """A bound value replaced by a number that needs no binding (a swap putting 22 where "std 1e-3" stood) leaves its
    binding stale; the check names the line where it stood."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "toy.json").write_text(json.dumps({"std": 0.001}))
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "page.md"
    doc.write_text("# Page\n\nIntro.\n\nThe fine-tunes are the base plus a random task vector (std 1e-3, `toy.md`).\n")
    (found,) = [q for q in Q.quotes(doc, tmp_path) if not q.exempt]
    bindings = tmp_path / "bindings"
    Q.write_bindings("docs/page.md", [Q.Binding(*found.key, found.printed, "toy", "{std}")], bindings)
    assert Q.check(doc, tmp_path, bindings, results) == []
    doc.write_text(doc.read_text().replace("1e-3", "22"))
    (problem,) = Q.check(doc, tmp_path, bindings, results)
    assert problem.startswith("docs/page.md:5: the binding of 1e-3") and problem.endswith("stale")


@pytest.mark.parametrize(("text", "number", "exempt"), [
    ("TSV-M 74.64 on test", "74.64", ""), ("−0.07 against random", "−0.07", ""), ("+9.11 val points", "+9.11", ""),
    ("in 470 s on 2 cores", "470", ""), ("peak RSS 3.3 GB", "3.3", ""), ("1.24× the own scorer", "1.24", ""),
    ("78.4 % of the entries", "78.4", ""), ("9-10 points below", "10", ""),
    ("8 tasks", "8", "count or name"), ("4 seeds", "4", "count or name"), ("128 samples", "128", "count or name"),
    ("a 3 × 3 grid", "3", "count or name"), ("494 M parameters", "494", "count or name"),
    ("ViT-B/32 towers", "32", "not read"), ("Qwen2.5-0.5B", "0.5", "part of a name"), ("G6 passes", "6", "not read"),
    ("k = 0.2 and", "0.2", "setting"), ("λ 1.3 on every seed", "1.3", "setting"), ("wise 0.65", "0.65", "setting"),
    ("k 0.12 / 0.15 / 0.2", "0.15", "setting"), ("`lr` 1e-3", "1e-3", "setting"), ("`r` (0.95)", "0.95", "setting"),
    ("the t 95 % interval", "95", "setting"), ("≥ 3 val points", "3", "rule"), ("target 1.5", "1.5", "rule"),
    ("within 1e-5", "1e-5", "rule"), ("transformers 4.57", "4.57", "version or date"),
    ("on 2026-01-02", "2026", "version or date"), ("7540-7752 MB", "7540", ""), ("7540 and 7752 MB", "7540", ""),
    ("λ 3 / 4 / 5.5 / 7.5", "5.5", "setting"), ("M-TIES − e = 0 −1.05 (", "−1.05", ""),
    ("output gap +0.13 (p 0.34)", "0.34", ""), ("DARE-TIES (p 0.8)", "0.8", "setting"),
])
def test_the_exemption_rule(text, number, exempt, tmp_path):
    """Values (a decimal point, a sign, a unit) are bound; counts, names, settings, rules and versions are not (a
    number inside a name is not even read)."""
    doc = tmp_path / "page.md"
    doc.write_text(f"# P\n\nSome {text} here.\n")
    kinds = {q.exempt for q in Q.quotes(doc, tmp_path) if q.printed == number}
    assert kinds == ({exempt} if exempt != "not read" else set()), kinds


def test_a_field_may_read_a_second_record(tmp_path, monkeypatch):
    """``{@record/path}`` reads another record (a ratio of two runs recorded apart); a missing one does not resolve."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.json").write_text('{"score_s": 82.0}')
    (results / "b.json").write_text('{"forward_s": 20.5}')
    monkeypatch.setattr(Q, "RESULTS", results)
    record = Q.load_record("a", results)
    assert Q.evaluate(record, "{score_s} / (4 * {@b/forward_s})") == 1.0
    with pytest.raises(KeyError):
        Q.evaluate(record, "{@b/missing}")


def test_a_key_holding_a_slash_is_written_whole():
    """A row label such as ``auto (own 16/task)`` is one key: ``[key]`` reads it; unbracketed, the slash splits it."""
    record = {"rows": [{"test": {"auto (own 16/task)": 68.2, "auto": 1.0}}]}
    assert Q.evaluate(record, "{rows/0/test/[auto (own 16/task)]}") == 68.2
    assert Q.evaluate(record, "{rows/0/[test]/auto}") == 1.0
    with pytest.raises(KeyError):
        Q.evaluate(record, "{rows/0/test/auto (own 16/task)}")
    with pytest.raises(KeyError):  # a selector still picks list elements by their fields
        Q.evaluate({"rows": [{"a": "x", "v": 1.0}]}, "{rows/[a=y]/v}")
