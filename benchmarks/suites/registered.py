"""The registered protocol as the code reads it: every gate, threshold, grid, control and statistic of the regime
records, in one place.

``benchmarks/PROTOCOL.md`` states the same values for people, with what a failed gate means for the prose, and was
written before the runs that use it; ``tests/test_protocol_registered.py`` parses its tables and fails where they
differ from this module or from what the code does with it. Every protocol record names the version it ran under:
``protocol`` in its JSON, a ``Protocol:`` line in its Markdown. Records made before :data:`VERSION` was registered
carry the label of their era (:data:`LEGACY`), and a test accepts that label only on the records PROTOCOL.md lists.

    python -m benchmarks.suites.registered label     # label the records PROTOCOL.md lists (idempotent)
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

VERSION = "v6"
"""The registered protocol's version; every record made under it says so."""
LEGACY = "pre-v6"
"""The label of the records made before :data:`VERSION` (their gates, grids and controls: their own design's)."""
DOCUMENT = Path(__file__).resolve().parents[1] / "PROTOCOL.md"
RESULTS = Path(__file__).resolve().parents[1] / "results"

# ------------------------------------------------------------------------------------------------------------ gates
G1_HEADROOM = 30.0
"""G1: fine-tuned (own task) − pretrained heads, val points."""
G2_ENSEMBLE = 0.0
"""G2: on every task, the probability ensemble − the pretrained heads, val points."""
G3_SPREAD = 3.0
"""G3: the best data-free merge − the average, val points."""
G4_LAMBDA_TIMES_Q = 2.0
"""G4: task arithmetic's chosen λ ≥ this / q in every replicate ..."""
G4_GAIN = 1.5
"""... and task arithmetic − the average ≥ this many val points."""
G5_REPLICATES = 4
G5_IMAGES = 500
"""G5: fine-tuning replicates, and val and test images per task."""
G6_MARGIN = 3.0
"""G6: the tuned ensemble − the best merge ≥ this many val points, with its t interval (:data:`LEVEL`) above 0."""


@dataclass(frozen=True)
class GateRule:
    gate: str
    name: str
    thresholds: tuple[float, ...]
    blocking: bool


GATES = (
    GateRule("G1", "G1 headroom", (G1_HEADROOM,), True),
    GateRule("G2", "G2 ensemble", (G2_ENSEMBLE,), True),
    GateRule("G2i", "G2 interference", (), False),
    GateRule("G3", "G3 method spread", (G3_SPREAD,), True),
    GateRule("G4", "G4 scaling", (G4_LAMBDA_TIMES_Q, G4_GAIN), True),
    GateRule("G5", "G5 statistics", (G5_REPLICATES, G5_IMAGES), True),
    GateRule("G6", "G6 premise", (G6_MARGIN,), False),
    GateRule("G6t", "G6 premise (TIES family)", (G6_MARGIN,), False),
)
"""The gates in table order: id, the name the records print, the thresholds (in PROTOCOL.md's order), blocking."""

# ------------------------------------------------------------------------------------------------------- statistics
LEVEL = 0.95
"""Every interval's level before Holm's correction (replicate t, item bootstrap, G6's t, the model bootstrap)."""
HOLM_ALPHA = 0.05
"""Holm's family-wise level, within each family of paired differences and over the M-Loss partial tests."""
BOOTSTRAP_DRAWS = 2000
"""Item-bootstrap draws of a paired difference (source items resampled per task, replicates fixed)."""
PAIR_PERMUTATIONS = 999
"""Model-identity permutations of a pair correlation's test (compatibility study)."""
MODEL_BOOTSTRAP = 2000
"""Model-resampling draws of a correlation's interval and of the M-Loss − output gap contrast."""
NUM_SAMPLES = 128
"""Unlabeled images every data-guided merge reads (M-TIES and its controls, RegMean, ``auto``, the learned rows)."""
ENSEMBLE_SCALES = (2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
"""The probability ensemble's head scales, searched on val like a merge's λ."""

# ---------------------------------------------------------------------------------------------------- design r6
LAMS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The one λ grid of every merge that has a λ (task arithmetic, TIES, DARE-TIES, the M-TIES family, TSV-M, Iso-C,
Iso-CTS): the union of round 5's grids' ranges and of ``auto``'s candidate grids
(:data:`hf_mloss.methods.auto.DEFAULT_CANDIDATES`), so each merge's grid holds every other's values and ``auto``'s."""
KS = (0.05, 0.1, 0.2, 0.4)
"""The keep fraction of every TIES-family row: TIES and M-TIES with each control search the same k."""
PS = (0.2, 0.4, 0.7, 0.9)
"""DARE-TIES's keep probability."""
E_MAX = 0.1
"""M-TIES's spread e = min(:data:`E_MAX`, k / 2): the paper's 0.1 where k ≥ 0.2, half of k below (e < k always)."""
EXTENSION = {"k": (0.025, 0.8), "p": (0.1, 0.95), "lam": (0.025, 9.0)}
"""The registered extension of an axis whose val choice sat at an end: one value beyond each end, run for every row
of the comparison (``regime --design r6 --extended``)."""
LEARNED_STEPS = (50, 100, 200)
LEARNED_LR = {"adamerging": (3e-4, 1e-3, 3e-3), "adarank": (3e-3, 1e-2, 3e-2)}
"""Every learned row searches steps × lr on val (9 settings; the middle is the method's default)."""
RANDOM_DRAWS = 1
"""Draws of the random-ranks control (seed offset 1000 per draw)."""


def spread(k: float) -> float:
    """M-TIES's e at keep fraction k (:data:`E_MAX`)."""
    return round(min(E_MAX, k / 2), 6)


CONTROLS = (
    ("m_ties (random ranks)", "random", "k − e/2 per row on average (ranks drawn at random)"),
    ("m_ties (inverted ranks)", "inverted", "k − e/2 per row on average (ranks by −M-Loss)"),
    ("m_ties (budget-matched uniform)", "uniform", "k − e/2 in every row"),
    ("m_ties (budget-matched tensor)", "tensor", "k − e/2 of each scored tensor as a whole"),
)
"""M-TIES's registered controls, each at M-TIES's budget on its scored tensors (k elsewhere): label, ``rank=``, and
the budget as PROTOCOL.md words it. "M-Loss helps" needs M-TIES above all of them."""
E0 = "m_ties (e=0)"
"""Per-tensor TIES at k: reported beside the controls, not budget-matched (it keeps more of the scored tensors)."""

# ------------------------------------------------------------------------------------------------------ the records
RECORD_PREFIXES = ("regime", "learned_regime", "compatibility_study", "image_suite", "text_suite", "text_quick",
                   "real_suite", "real_quick", "main_job", "tiny_suite", "text_probe")
"""The committed records made by the suites' protocol (benchmarks/results/<prefix>*.json): each names its
protocol version. Speed and parity records compare no methods' accuracy and carry none."""


def protocol_records(results: Path = RESULTS) -> list[Path]:
    """The committed protocol records' JSON files."""
    return sorted(p for p in results.glob("*.json") if p.stem.startswith(RECORD_PREFIXES))


def legacy_records(document: Path = DOCUMENT) -> dict[str, str]:
    """record stem → label, for the records PROTOCOL.md lists under "Records made before": every backticked name of
    a list item (and its indented continuation lines) in a section whose heading names the label
    (``## Records made before v6 (label `pre-v6`)``)."""
    out: dict[str, str] = {}
    label, in_item = None, False
    for line in document.read_text().splitlines():
        if line.startswith("#"):
            found = re.search(r"label `([^`]+)`", line)
            label = found[1] if found and line.lower().startswith("## records made before") else None
            continue
        in_item = line.startswith("- ") or in_item and line.startswith("  ")
        if label and in_item:
            for stem in re.findall(r"`([A-Za-z0-9_.\-]+)`", line):
                out[stem] = label
    return out


def label_line(version: str) -> str:
    """The Markdown line a record carries under its title."""
    if version == VERSION:
        return f"Protocol: {VERSION} (`benchmarks/PROTOCOL.md`)."
    return (f"Protocol: {version} (round 5's design or an earlier one, not `benchmarks/PROTOCOL.md`'s {VERSION}; its "
            "gates, grids and controls are its own design's, and under v6 its differences are measurements: see that "
            "file's \"Records made before v6\").")


def label(json_path: Path, version: str) -> bool:
    """Set ``protocol`` in a record's JSON (first key) and its Markdown's ``Protocol:`` line (after the title);
    returns whether anything changed. Numbers and every other field stay as they are."""
    record = json.loads(json_path.read_text())
    wanted = label_line(version)
    header = record.get("header")
    if isinstance(header, list) and header:  # a verdict record's Markdown is rendered from it: the line goes in too
        at = next((i for i, line in enumerate(header) if line.startswith("Protocol: ")), None)
        if at is not None:  # labelled before: the line replaced where it stands (labelling twice changes nothing)
            header = [*header[:at], wanted, *header[at + 1:]]
        else:
            header = [header[0], "", wanted, *header[1:]] if header[1:2] == [""] else [header[0], "", wanted, "",
                                                                                      *header[1:]]
    changed = record.get("protocol") != version or header is not None and header != record.get("header")
    if changed:
        record = {"protocol": version, **{k: v for k, v in record.items() if k != "protocol"}}
        if header is not None:
            record["header"] = header
        json_path.write_text(json.dumps(record, indent=1, ensure_ascii=not _has_unicode(json_path)) + "\n")
    md = json_path.with_suffix(".md")
    if md.exists():
        lines = md.read_text().split("\n")
        at = next((i for i, line in enumerate(lines) if line.startswith("Protocol: ")), None)
        if at is not None and lines[at] != wanted:
            lines[at], changed = wanted, True
        elif at is None:
            title = next((i for i, line in enumerate(lines) if line.startswith("# ")), -1)
            lines[title + 1:title + 1] = ["", wanted]
            changed = True
        md.write_text("\n".join(lines))
    return changed


def _has_unicode(path: Path) -> bool:
    """Whether a JSON file was written with its non-ASCII characters as they are (kept so on rewriting)."""
    return any(ord(c) > 127 for c in path.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["label"]:
        print(__doc__.splitlines()[-1].strip())
        return 2
    listed = legacy_records()
    for path in protocol_records():
        if path.stem in listed and label(path, listed[path.stem]):
            print(f"labelled {path.name}: {listed[path.stem]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
