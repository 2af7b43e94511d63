"""The registered protocol: benchmarks/PROTOCOL.md and the code agree, and every protocol record names its version.

The document's tables (gates, grids, controls, statistics) are parsed and compared with
:mod:`benchmarks.suites.registered` and with what the code builds from it (the gates :func:`compute_gates` computes,
the specs design r6 runs); a copy of the document with one value changed fails. A record's version must be the
registered one, or the label the document lists for that very record.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from benchmarks.suites import r6
from benchmarks.suites import registered as R

DOC = R.DOCUMENT.read_text()
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def section(text: str, title: str) -> str:
    """The text under the ``## title`` heading, up to the next ``## ``."""
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def table(text: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table in ``text``, header and rule left out."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in rows[2:]]


def numbers(cell: str) -> list[float]:
    """The numbers of a cell outside parentheses ("2/q" gives 2)."""
    return [float(v) for v in NUMBER.findall(re.sub(r"\([^)]*\)", "", cell))]


def axis(cell: str) -> list[float]:
    """``k: 0.05, 0.1`` → [0.05, 0.1]."""
    return [float(v) for v in NUMBER.findall(cell.partition(":")[2])]


def problems(text: str) -> list[str]:
    """Where the document ``text`` differs from the registered values and from what the code builds."""
    out = []
    version = re.search(r"^Protocol: (\S+)$", text, re.MULTILINE)
    if not version or version[1] != R.VERSION:
        out.append(f"version line: {version[1] if version else None} against {R.VERSION}")
    gates = {row[0]: row for row in table(section(text, "Gates"))}
    for rule in R.GATES:
        row = gates.get(rule.gate)
        if row is None:
            out.append(f"gate {rule.gate} missing")
            continue
        if tuple(numbers(row[2])) != tuple(float(t) for t in rule.thresholds):
            out.append(f"gate {rule.gate}: thresholds {numbers(row[2])} against {rule.thresholds}")
        if (row[3] == "yes") != rule.blocking:
            out.append(f"gate {rule.gate}: blocking {row[3]} against {rule.blocking}")
    if set(gates) != {rule.gate for rule in R.GATES}:
        out.append(f"gates {sorted(gates)} against {[rule.gate for rule in R.GATES]}")
    grids = section(text, "Grids (design r6)")
    ladder = re.search(r"^λ ladder: (.*)$", grids, re.MULTILINE)
    if not ladder or tuple(float(v) for v in NUMBER.findall(ladder[1])) != R.LAMS:
        out.append(f"λ ladder {ladder[1] if ladder else None} against {R.LAMS}")
    built = {s.label: s for part in r6.PARTS for s in r6.specs(part, [10, 11])}
    documented = {row[0].strip("`"): row for row in table(grids)}
    if set(documented) != set(built):
        out.append(f"grid rows {sorted(set(documented) ^ set(built))} are in one of the table and the code only")
    for label, row in documented.items():
        spec = built.get(label)
        if spec is None:
            continue
        grid = {"lam": list(R.LAMS)} if row[3] == "ladder" else {}
        if row[4] != "—":
            grid[row[4].partition(":")[0]] = axis(row[4])
        if row[5] != "—":
            steps, _, lr = row[5].partition("×")
            grid |= {"steps": axis(steps), "lr": axis(lr)}
        if row[1] != spec.method or {k: sorted(v) for k, v in grid.items()} != {
                k: sorted(float(x) for x in v) for k, v in spec.grid.items()}:
            out.append(f"grid of {label}: {row[1]} {grid} against {spec.method} {spec.grid}")
        rank = re.search(r"rank (\w+)", row[2])
        if (rank[1] if rank else "mloss") != spec.params.get("rank", "mloss") and spec.method == "m_ties":
            out.append(f"rank of {label}: {row[2]} against {spec.params}")
        if "min(0.1, k/2)" in row[2] and not isinstance(spec, r6.SpreadSpec):
            out.append(f"{label}: documented e = min(0.1, k/2), the code fixes e")
    extension = re.search(r"k ([\d.]+) and ([\d.]+), p ([\d.]+) and ([\d.]+), λ ([\d.]+) and ([\d.]+)", grids)
    found = tuple(float(v) for v in extension.groups()) if extension else None
    wanted = (*R.EXTENSION["k"], *R.EXTENSION["p"], *R.EXTENSION["lam"])
    if found != wanted:
        out.append(f"extension {found} against {wanted}")
    controls = {row[0].strip("`"): row for row in table(section(text, "Controls (the M-TIES family)"))}
    if {label: (row[1], row[2]) for label, row in controls.items()} != {
            label: (rank, budget) for label, rank, budget in R.CONTROLS}:
        out.append(f"controls {controls} against {R.CONTROLS}")
    stats = {row[0]: numbers(row[1]) for row in table(section(text, "Statistics"))}
    wanted_stats = {"interval level": [R.LEVEL], "Holm": [R.HOLM_ALPHA], "item-bootstrap draws": [R.BOOTSTRAP_DRAWS],
                    "model-bootstrap draws": [R.MODEL_BOOTSTRAP], "permutations": [R.PAIR_PERMUTATIONS],
                    "unlabeled images": [R.NUM_SAMPLES], "head scales": list(R.ENSEMBLE_SCALES),
                    "random-ranks control": [R.RANDOM_DRAWS]}
    for key, values in wanted_stats.items():
        row = next((v for name, v in stats.items() if key in name), None)
        if row != [float(v) for v in values]:
            out.append(f"statistic {key}: {row} against {values}")
    return out


def test_the_document_states_what_the_code_registers():
    assert problems(DOC) == []


@pytest.mark.parametrize(("old", "new"), [
    ("| ≥ 30 |", "| ≥ 25 |"),                                   # a threshold
    (("| G6 | the tuned ensemble − the best merge (every merge, each at its val-chosen setting) | ≥ 3 (with its t "
      "interval above zero) | no |"), ("| G6 | the tuned ensemble − the best merge (every merge, each at its val-chosen "
                                       "setting) | ≥ 3 (with its t interval above zero) | yes |")),  # a gate made blocking
    ("λ ladder: 0.05, 0.1,", "λ ladder: 0.1,"),                  # a grid
    ("| `ties` | ties | scope global, budget changed | ladder | k: 0.05, 0.1, 0.2, 0.4 |",
     "| `ties` | ties | scope global, budget changed | ladder | k: 0.1, 0.2, 0.4 |"),
    ("| model-bootstrap draws | 2000 |", "| model-bootstrap draws | 1000 |"),  # a statistic
    ("| `m_ties (budget-matched tensor)` | tensor |", "| `m_ties (budget-matched tensor)` | uniform |"),  # a control
    ("Protocol: v6\n", "Protocol: v5\n"),
])
def test_a_document_that_differs_from_the_code_fails(old, new):
    assert old in DOC
    assert problems(DOC.replace(old, new))


def test_the_code_reads_the_registered_values():
    """The gates and statistics the code computes with are the registered ones: a gate at its threshold passes and
    just below it fails; the statistics' defaults are the registry's."""
    from benchmarks.suites.gates import compute_gates
    from benchmarks.suites.protocol import ENSEMBLE_SCALES, ReplicateResult
    from benchmarks.suites.stats import holm, item_bootstrap, paired_difference

    def replicate(seed: int, own: float) -> ReplicateResult:
        row = lambda v: {"val": {"a": v, "b": v}}
        r = ReplicateResult(seed=seed)
        r.reference = {"pretrained heads": row(0.2), "fine-tuned (own task)": row(own),
                       "ensemble (probabilities)": row(0.6)}
        r.methods = {"average": {**row(0.5), "chosen": {}}, "task_arithmetic": {**row(0.6), "chosen": {"lam": 1.0}},
                     "ties": {**row(0.58), "chosen": {"lam": 1.0}}}
        r.foreign = {"a+b": -0.1}
        return r

    for own, passed in ((0.2 + R.G1_HEADROOM / 100, True), (0.2 + R.G1_HEADROOM / 100 - 1e-4, False)):
        gates = compute_gates([replicate(s, own) for s in range(R.G5_REPLICATES)], data_free=["task_arithmetic",
                              "ties"], tasks=["a", "b"], val_size=R.G5_IMAGES, test_size=R.G5_IMAGES)
        assert gates[0].name == "G1 headroom" and gates[0].passed is passed
    assert {g.name: g.blocking for g in gates} == {rule.name: rule.blocking for rule in R.GATES
                                                   if rule.gate != "G6t"}
    g5 = compute_gates([replicate(s, 0.9) for s in range(R.G5_REPLICATES - 1)], data_free=["ties"], tasks=["a", "b"],
                       val_size=R.G5_IMAGES, test_size=R.G5_IMAGES)[5]
    assert g5.name == "G5 statistics" and not g5.passed
    for fn in (item_bootstrap, paired_difference):
        assert inspect.signature(fn).parameters["draws"].default == R.BOOTSTRAP_DRAWS
        assert inspect.signature(fn).parameters["level"].default == R.LEVEL
    assert inspect.signature(holm).parameters["alpha"].default == R.HOLM_ALPHA
    assert ENSEMBLE_SCALES["main"] == R.ENSEMBLE_SCALES


def test_design_r6_grids_are_equal_and_hold_autos_values():
    """Every merge with a λ searches the one ladder, every TIES-family row the same k, M-TIES's controls its own
    budget; each of ``auto``'s candidate λ values is in the val grid of the same method."""
    from hf_mloss.methods.auto import DEFAULT_CANDIDATES

    built = {s.label: s for part in r6.PARTS for s in r6.specs(part, [10, 11])}
    for spec in built.values():
        if "lam" in spec.grid:
            assert tuple(spec.grid["lam"]) == R.LAMS, spec.label
        if "k" in spec.grid:
            assert tuple(spec.grid["k"]) == R.KS, spec.label
    for method, grid in DEFAULT_CANDIDATES.items():
        for name, values in grid.items():
            if name in built[method].grid:
                assert set(values) <= set(built[method].grid[name]), (method, name)
    family = [s for s in built.values() if s.method == "m_ties"]
    assert {s.params.get("rank", "mloss") for s in family} == {"mloss", *(rank for _, rank, _ in R.CONTROLS)}
    for spec in family:
        for setting in spec.settings():
            e = setting.get("e", spec.params.get("e"))
            assert e == (0.0 if spec.label == R.E0 else min(0.1, setting["k"] / 2)) and e < setting["k"]
    sizes = {s.label: len(s.settings()) for s in built.values() if s.grid}
    assert len({sizes[s.label] for s in family}) == 1 and sizes["ties"] == sizes["m_ties"]
    assert all(sizes[label] == len(R.LEARNED_STEPS) * 3 for label in sizes if "(" in label and "m_ties" not in label)


def version_problems(results: Path, document: Path) -> list[str]:
    """Every protocol record under ``results`` whose version is not the registered one, nor the label ``document``
    lists for it, or whose Markdown does not carry the line of its version."""
    listed = R.legacy_records(document)
    out = []
    for path in R.protocol_records(results):
        version = json.loads(path.read_text()).get("protocol")
        if version != R.VERSION and (version is None or listed.get(path.stem) != version):
            out.append(f"{path.name}: protocol {version!r}, neither {R.VERSION} nor a label PROTOCOL.md lists for it")
        md = path.with_suffix(".md")
        if md.exists() and R.label_line(version or "") not in md.read_text().splitlines():
            out.append(f"{md.name}: no `Protocol: {version}` line")
    return out


def test_every_protocol_record_names_its_version():
    assert version_problems(R.RESULTS, R.DOCUMENT) == []
    listed = R.legacy_records()
    assert listed and set(listed.values()) == {R.LEGACY}
    assert all((R.RESULTS / f"{stem}.json").exists() for stem in listed)  # the list names committed records only


def test_a_record_without_its_version_or_with_an_unlisted_label_fails(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    document = tmp_path / "PROTOCOL.md"
    document.write_text("# P\n\n## Records made before v6 (label `pre-v6`)\n\n- `regime_old`\n")
    for stem, version in (("regime_old", R.LEGACY), ("regime_new", R.VERSION), ("regime_unlisted", R.LEGACY),
                          ("regime_missing", None), ("compatibility_study_v5", "v5"), ("merge_speed_x", None)):
        (results / f"{stem}.json").write_text(json.dumps({} if version is None else {"protocol": version}))
        (results / f"{stem}.md").write_text(f"# {stem}\n\n{R.label_line(version or '')}\n")
    found = version_problems(results, document)
    assert sorted(p.split(":")[0] for p in found) == ["compatibility_study_v5.json", "regime_missing.json",
                                                     "regime_unlisted.json"]  # speed records carry no version
    (results / "regime_new.md").write_text("# regime_new\n")
    assert "regime_new.md: no `Protocol: v6` line" in version_problems(results, document)


def test_label_sets_the_version_and_changes_nothing_else(tmp_path):
    record = {"command": "x", "rows": [{"val": 1.2345678901234567, "name": "ties (λ 1.3-3)"}]}
    path = tmp_path / "regime_x.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    (tmp_path / "regime_x.md").write_text("# Title\n\nBody 1.23.\n")
    assert R.label(path, R.LEGACY) and not R.label(path, R.LEGACY)  # idempotent
    stored = json.loads(path.read_text())
    assert list(stored) == ["protocol", "command", "rows"] and stored["rows"] == record["rows"]
    assert (tmp_path / "regime_x.md").read_text() == f"# Title\n\n{R.label_line(R.LEGACY)}\n\nBody 1.23.\n"


def test_a_verdict_records_line_survives_rendering_from_its_json(tmp_path):
    """A verdict record's Markdown is rendered from its JSON's header: the label goes into the header too, so
    ``report.render`` keeps the ``Protocol:`` line."""
    import shutil

    from benchmarks.suites.report import render

    stem = "regime1440_verdicts_mties_4seeds_q8_blocks2"
    for suffix in (".json", ".md"):
        shutil.copyfile(R.RESULTS / f"{stem}{suffix}", tmp_path / f"regime_x{suffix}")
    assert not R.label(tmp_path / "regime_x.json", R.LEGACY)  # committed records are labelled already
    render(tmp_path / "regime_x.json")
    assert (tmp_path / "regime_x.md").read_text() == (R.RESULTS / f"{stem}.md").read_text()
    assert R.label(tmp_path / "regime_x.json", R.VERSION)  # relabelled: one line, replaced in both
    md = (tmp_path / "regime_x.md").read_text()
    assert md.count("Protocol: ") == 1 and R.label_line(R.VERSION) in md
    render(tmp_path / "regime_x.json")
    assert (tmp_path / "regime_x.md").read_text() == md
