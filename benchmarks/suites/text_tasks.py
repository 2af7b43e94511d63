"""Seeded text-classification tasks built only from files that Debian packages ship (no download, no Hub).

Every task is a set of classes; every class a list of *source items* (a file, a man page, a licence paragraph, a
fortune, a dictionary word, a name); every source item a list of text snippets cut from it. A split never shares a
source item with another (:func:`split_task`): the val and test snippets of a class come from other files, pages,
paragraphs or words than its train snippets and its head's exemplars, and every test snippet carries its source
item's id, so the bootstrap can resample source items instead of snippets (snippets of one file are not independent).

| task | classes | package(s) | source item | snippet |
|---|---|---|---|---|
| ``words`` | 8 languages: en, de, fr, es, it, nl, sv, pt | ``wamerican wngerman wfrench wspanish witalian wdutch wswedish wportuguese`` (``/usr/share/dict``) | a word (those of more than one list dropped) | the word |
| ``code`` | 6 languages: Python, Perl, C, CMake, shell, Tcl | ``libpython3.11-stdlib``, ``perl-modules-5.36``, ``libc6-dev`` (``/usr/include``), ``cmake-data``, ``bash-completion``, ``tcl8.6`` / ``tk8.6`` | a source file | 6 consecutive non-blank lines |
| ``mansection`` | 6 manual sections: 1, 2, 3, 5, 7, 8 | the English pages under ``/usr/share/man/man<N>`` (``manpages``, ``manpages-dev``, ...; link pages and the Cloud SDK's thousands of ``gcloud*`` pages skipped) | a manual page | 32 words of its text (roff requests and escapes removed) |
| ``licence`` | 7 licences: Apache-2.0, Artistic, GFDL-1.3, GPL-2, GPL-3, LGPL-2.1, MPL-2.0 | ``base-files`` (``/usr/share/common-licenses``) | a paragraph (≥ 8 words) | 32 words, stride 16 |
| ``fortune`` | 8 categories: computers, food, law, love, politics, science, sports, work | ``fortunes`` (``/usr/share/games/fortunes``) | a fortune | its first 48 words |
| ``isocodes`` | 4 kinds of name: country, currency, language, subdivision | ``iso-codes`` (``/usr/share/iso-codes/json``) | a name | the name |
| ``fortune8`` (not in the suite) | 8 categories of ≥ 500 fortunes: computers, men-women, people, politics, science, songs-poems, work, zippy | ``fortunes`` | a fortune | its first 48 words |
| ``glossary`` (not in the suite) | 5 dictionaries: The Devil's Dictionary, FOLDOC, GCIDE (1913 Webster), the Jargon File, V.E.R.A. | ``dict-devil dict-foldoc dict-gcide dict-jargon dict-vera`` (``/usr/share/dictd``) | an entry | its first 48 words, headword and markup removed |

The suite's six (:data:`SUITE_TASKS`) cannot give 500 val and test snippets from distinct source items each:
``licence`` has about 1200 windows in all, ``fortune``'s food / love / sports and ``isocodes``' countries and
currencies a few hundred items. ``fortune8`` and ``glossary`` can (with ``isocodes`` filled from its large classes,
``fill=True`` in :func:`split_task`); with ``words``, ``code`` and ``mansection`` they make a six-task set that
passes the 500-snippet rule (measured: 500 / 500 for every task at 4000 train snippets).

Which source items exist depends on the packages installed (``code`` and ``mansection`` read whole folders); with
the same packages the tasks are the same bit for bit: files are read in sorted order and every random choice comes
from ``numpy.random.default_rng`` seeded by (seed, task, class, split). :data:`INSTALL` is the apt line.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INSTALL = ("apt-get install wamerican wngerman wfrench wspanish witalian wdutch wswedish wportuguese fortunes "
           "iso-codes manpages manpages-dev libpython3.11-stdlib perl-modules-5.36 libc6-dev cmake-data "
           "bash-completion tcl8.6 tk8.6 dict-devil dict-foldoc dict-gcide dict-jargon dict-vera")
"""The Debian packages the tasks read (Debian 12 names)."""
TASK_PACKAGES = {
    "words": "wamerican wngerman wfrench wspanish witalian wdutch wswedish wportuguese",
    "code": "libpython3.11-stdlib perl-modules-5.36 libc6-dev cmake-data bash-completion tcl8.6 tk8.6",
    "mansection": "manpages manpages-dev", "licence": "base-files", "fortune": "fortunes", "fortune8": "fortunes",
    "isocodes": "iso-codes", "glossary": "dict-devil dict-foldoc dict-gcide dict-jargon dict-vera",
}
"""The packages of :data:`INSTALL` each task reads, for a message that names only what that task lacks."""

SPLITS = ("exemplar", "train", "val", "test")
SHARES = (0.1, 0.5, 0.2, 0.2)
"""Share of each class's source items given to each split (exemplars: the frozen heads' held-out examples)."""

Source = tuple[str, list[str]]
"""(source item id, its snippets)."""


@dataclass(frozen=True)
class TextTask:
    name: str
    classes: tuple[str, ...]
    read: Callable[[str], list[Source]]
    """class → its source items (deterministic: sorted)."""
    source: str
    """Where the data comes from (package), for the record."""


# ------------------------------------------------------------------------------------------------------------
# Cutting helpers
# ------------------------------------------------------------------------------------------------------------


def word_windows(text: str, size: int, stride: int, minimum: int = 8) -> list[str]:
    """Windows of ``size`` words every ``stride`` words (the last one kept if it has ≥ ``minimum`` words)."""
    words = text.split()
    out = [" ".join(words[i:i + size]) for i in range(0, max(1, len(words) - size + stride), stride)]
    return [w for w in out if len(w.split()) >= minimum]


def line_windows(text: str, size: int = 6) -> list[str]:
    """Consecutive blocks of ``size`` non-blank lines (each line stripped, joined by newlines)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return ["\n".join(lines[i:i + size]) for i in range(0, len(lines) - size + 1, size)]


def read_text(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return raw.decode("utf-8", errors="replace")


_ROFF_ESCAPE = re.compile(r"\\(f\[[^]]*\]|f\(..|f.|\(..|\[[^]]*\]|s[-+]?\d|[-e&|^0 ~.'`\"%:/,])")


def roff_text(source: str) -> str:
    """The running text of a roff manual page: request lines and comments dropped, font and character escapes
    removed (a plain-text approximation, enough for classification)."""
    lines = []
    for line in source.splitlines():
        if line.startswith((".", "'")):
            # keep the text argument of font macros (.B word, .I word, .BR a b)
            match = re.match(r"[.'](B|I|BR|BI|IR|IB|RB|RI|SM|SB)\s+(.*)", line)
            if not match:
                continue
            line = match.group(2).replace('"', "")
        lines.append(_ROFF_ESCAPE.sub(lambda m: "-" if m.group(1) == "-" else " ", line))
    return " ".join(" ".join(lines).split())


# ------------------------------------------------------------------------------------------------------------
# Readers (class → source items)
# ------------------------------------------------------------------------------------------------------------

DICT = Path("/usr/share/dict")
WORD_LISTS = {"en": "american-english", "de": "ngerman", "fr": "french", "es": "spanish", "it": "italian",
              "nl": "dutch", "sv": "swedish", "pt": "portuguese"}


def _word_sets() -> dict[str, list[str]]:
    words = {c: {w.strip() for w in read_text(DICT / f).splitlines() if w.strip() and "'" not in w}
             for c, f in WORD_LISTS.items()}
    seen: dict[str, int] = {}
    for ws in words.values():
        for w in {w.lower() for w in ws}:
            seen[w] = seen.get(w, 0) + 1
    return {c: sorted(w for w in ws if seen[w.lower()] == 1 and len(w) >= 3) for c, ws in words.items()}


_CACHE: dict[str, object] = {}


def _cached(key: str, build):
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


def read_words(cls: str) -> list[Source]:
    return [(w, [w]) for w in _cached("words", _word_sets)[cls]]


CODE = {
    "python": (Path("/usr/lib/python3.11"), "*.py"),
    "perl": (Path("/usr/share/perl/5.36.0"), "*.pm"),
    "c": (Path("/usr/include"), "*.h"),
    "cmake": (Path("/usr/share/cmake-3.25/Modules"), "*.cmake"),
    "shell": (Path("/usr/share/bash-completion/completions"), "*"),
    "tcl": (Path("/usr/share/tcltk"), "*.tcl"),
}


def read_code(cls: str) -> list[Source]:
    folder, pattern = CODE[cls]
    out = []
    for path in sorted(p for p in folder.rglob(pattern) if p.is_file() and not p.is_symlink()):
        if "test" in path.parts or path.stat().st_size > 400_000:
            continue
        windows = line_windows(read_text(path))
        if windows:
            out.append((str(path.relative_to(folder)), windows))
    return out


MAN = Path("/usr/share/man")


def read_man(cls: str) -> list[Source]:
    out = []
    for path in sorted((MAN / f"man{cls}").iterdir()):
        if not path.is_file() or path.is_symlink() or path.stat().st_size < 600 or path.name.startswith("gcloud"):
            continue
        text = read_text(path)
        if text.lstrip().startswith(".so "):  # a link page
            continue
        windows = word_windows(roff_text(text), 32, 32, minimum=16)
        if windows:
            out.append((path.name, windows))
    return out


LICENCES = Path("/usr/share/common-licenses")


def read_licence(cls: str) -> list[Source]:
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", read_text(LICENCES / cls))]
    return [(f"{cls}#{i}", word_windows(p, 32, 16)) for i, p in enumerate(paragraphs) if len(p.split()) >= 8]


FORTUNES = Path("/usr/share/games/fortunes")


def read_fortune(cls: str) -> list[Source]:
    entries = [" ".join(e.split()) for e in re.split(r"^%$", read_text(FORTUNES / cls), flags=re.MULTILINE)]
    return [(f"{cls}#{i}", [" ".join(e.split()[:48])]) for i, e in enumerate(entries) if len(e.split()) >= 4]


DICTD = Path("/usr/share/dictd")
GLOSSARIES = {"devil": "The Devil's Dictionary", "foldoc": "FOLDOC", "gcide": "GCIDE", "jargon": "the Jargon File",
              "vera": "V.E.R.A."}
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def dictd_number(text: str) -> int:
    """An offset or length of a dictd ``.index`` line (base 64, most significant digit first)."""
    value = 0
    for ch in text:
        value = 64 * value + _B64.index(ch)
    return value


_MARKUP = re.compile(r"\\[^\\]*\\|\[[^]]*\]|<[^>]*>|[{}]")


def definition_text(entry: str, headword: str, head_lines: bool) -> str:
    """A dictionary entry's definition, with what names the entry removed: ``head_lines`` (FOLDOC, the Jargon File,
    V.E.R.A.: the headword lines come first) drops the lines up to the first blank one within the first 5 that
    has text after it, else the first line; otherwise (GCIDE, The Devil's Dictionary) the entry opens with ``Word \\pron\\, n.`` or
    ``WORD, n.``, whose headword and part of speech are stripped. Pronunciations, bracketed notes (etymologies,
    ``[1913 Webster]``), category tags and cross-reference braces are removed and the headword blanked, so what is
    left is how the dictionary explains, not what it names."""
    lines = entry.splitlines()
    if head_lines and len(lines) > 1:
        blank = next((i for i in range(1, min(len(lines), 5)) if not lines[i].strip()
                      and any(line.strip() for line in lines[i + 1:])), 0)
        entry = "\n".join(lines[blank + 1:])
    body = re.sub(r"^[A-Z][A-Z0-9 '\-]*,\s*", "", entry.strip()) if not head_lines else entry
    body = _MARKUP.sub(" ", body)
    if headword.strip():
        body = re.sub(re.escape(headword.strip()), " ", body, flags=re.IGNORECASE)
    body = re.sub(r"^[\s,]*(?:[a-z]{1,4}\.\s*)+", "", body)  # the part of speech left after the headword
    return " ".join(body.split())


def read_glossary(cls: str) -> list[Source]:
    data = gzip.decompress((DICTD / f"{cls}.dict.dz").read_bytes())
    out, seen = [], set()
    for line in read_text(DICTD / f"{cls}.index").splitlines():
        fields = line.split("\t")
        if len(fields) < 3 or fields[0].startswith("00-database") or fields[0].startswith("00database"):
            continue
        start, size = dictd_number(fields[1]), dictd_number(fields[2])
        if (start, size) in seen:  # several headwords index one entry
            continue
        seen.add((start, size))
        text = definition_text(data[start:start + size].decode("utf-8", errors="replace"), fields[0],
                               head_lines=cls in ("foldoc", "jargon", "vera"))
        if len(text.split()) >= 3:
            out.append((f"{cls}:{fields[0]}#{start}", [" ".join(text.split()[:48])]))
    return out


ISO = Path("/usr/share/iso-codes/json")
ISO_FILES = {"country": ("iso_3166-1.json", "3166-1"), "currency": ("iso_4217.json", "4217"),
             "language": ("iso_639-3.json", "639-3"), "subdivision": ("iso_3166-2.json", "3166-2")}


def read_iso(cls: str) -> list[Source]:
    filename, key = ISO_FILES[cls]
    names = sorted({e["name"] for e in json.loads(read_text(ISO / filename))[key]})
    return [(n, [n]) for n in names]


TASKS: dict[str, TextTask] = {
    "words": TextTask("words", tuple(WORD_LISTS), read_words, "Debian word lists (wamerican, wngerman, ...)"),
    "code": TextTask("code", tuple(CODE), read_code, "Python / Perl / C / CMake / bash-completion / Tcl sources"),
    "mansection": TextTask("mansection", ("1", "2", "3", "5", "7", "8"), read_man, "English manual pages"),
    "licence": TextTask("licence", ("Apache-2.0", "Artistic", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1", "MPL-2.0"),
                        read_licence, "/usr/share/common-licenses (base-files)"),
    "fortune": TextTask("fortune", ("computers", "food", "law", "love", "politics", "science", "sports", "work"),
                        read_fortune, "fortunes"),
    "isocodes": TextTask("isocodes", tuple(ISO_FILES), read_iso, "iso-codes"),
    "fortune8": TextTask("fortune8", ("computers", "men-women", "people", "politics", "science", "songs-poems",
                                      "work", "zippy"), read_fortune, "fortunes (categories of ≥ 500)"),
    "glossary": TextTask("glossary", tuple(GLOSSARIES), read_glossary, "dictd dictionaries (dict-devil, dict-foldoc, ...)"),
}
SUITE_TASKS = ("words", "code", "mansection", "licence", "fortune", "isocodes")
"""The suite's six tasks (the committed records' task set)."""


def missing_sources(tasks: list[str]) -> list[str]:
    """What is missing to build ``tasks``, each with how to get it (empty when everything is there)."""
    paths = {"words": [DICT / f for f in WORD_LISTS.values()], "code": [p for p, _ in CODE.values()],
             "mansection": [MAN / "man2", MAN / "man8"], "licence": [LICENCES / c for c in TASKS["licence"].classes],
             "fortune": [FORTUNES / c for c in TASKS["fortune"].classes], "isocodes": [ISO / f for f, _ in ISO_FILES.values()],
             "fortune8": [FORTUNES / c for c in TASKS["fortune8"].classes],
             "glossary": [DICTD / f"{c}.{x}" for c in GLOSSARIES for x in ("index", "dict.dz")]}
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        return [f"unknown text task(s) {unknown}; available: {sorted(TASKS)}"]
    return [f"{p} (task {t!r}; install with: apt-get install {TASK_PACKAGES[t]})" for t in tasks for p in paths[t]
            if not p.exists()]


# ------------------------------------------------------------------------------------------------------------
# Splits
# ------------------------------------------------------------------------------------------------------------


def rng_for(seed: int, *names: str) -> np.random.Generator:
    return np.random.default_rng([seed, *(zlib.crc32(n.encode()) for n in names)])


@dataclass
class Split:
    texts: list[str]
    labels: np.ndarray
    """int64 class index per snippet."""
    sources: np.ndarray
    """int64 source-item index per snippet (unique within the task and split)."""
    source_names: list[str]


def class_quotas(total: int, available: list[int]) -> list[int]:
    """Snippets per class for a split of ``total``: equal shares (the first ``total % n`` classes one more) when every
    class has enough; a class short of its share gives all it has and the rest is shared out among the others, so
    the split has ``total`` snippets whenever the task has that many."""
    quotas, left = [0] * len(available), total
    active = [c for c, n in enumerate(available) if n > 0]
    while left > 0 and active:
        each = max(1, left // len(active))
        for c in list(active):
            give = min(each, available[c] - quotas[c], left)
            quotas[c] += give
            left -= give
            if quotas[c] == available[c]:
                active.remove(c)
            if left == 0:
                break
    return quotas


def split_task(task: TextTask, sizes: dict[str, int], seed: int = 0,
               readers: dict[str, list[Source]] | None = None, fill: bool = False) -> dict[str, Split]:
    """Each class's source items shuffled and partitioned by :data:`SHARES`; then per split ``sizes[split]``
    snippets in all, balanced over classes (a class with too few snippets gives what it has; with ``fill`` the
    others make up the difference, :func:`class_quotas`), drawn round-robin over the class's source items of that split (one
    snippet per source item per round, so as many source items as possible are represented). ``readers``: class → source items, to bypass :attr:`TextTask.read` (tests)."""
    per_class = {c: (readers[c] if readers is not None else task.read(c)) for c in task.classes}
    parts: dict[str, list[tuple[int, list[Source]]]] = {s: [] for s in SPLITS}
    for label, cls in enumerate(task.classes):
        sources = per_class[cls]
        if len(sources) < len(SPLITS):
            raise ValueError(f"task {task.name!r}, class {cls!r}: {len(sources)} source items, need ≥ {len(SPLITS)}")
        order = rng_for(seed, task.name, cls, "sources").permutation(len(sources))
        bounds = np.round(np.cumsum((0, *SHARES)) * len(sources)).astype(int)
        bounds[1:-1] = np.maximum(bounds[1:-1], np.arange(1, len(SPLITS)))  # every split gets ≥ 1 source item
        for s, split in enumerate(SPLITS):
            parts[split].append((label, [sources[i] for i in order[bounds[s]:bounds[s + 1]]]))
    out = {}
    for split in SPLITS:
        texts, labels, src, names, index = [], [], [], [], {}
        n = len(task.classes)
        quotas = (class_quotas(sizes[split], [sum(len(items) for _, items in sources) for _, sources in parts[split]])
                  if fill else [sizes[split] // n + (label < sizes[split] % n) for label in range(n)])
        for label, sources in parts[split]:
            quota = quotas[label]
            rng = rng_for(seed, task.name, task.classes[label], split)
            queues = [list(rng.permutation(len(items))) for _, items in sources]
            taken = 0
            while taken < quota and any(queues):
                for j in rng.permutation(len(sources)):
                    if taken == quota:
                        break
                    if queues[j]:
                        name, items = sources[j]
                        texts.append(items[queues[j].pop()])
                        labels.append(label)
                        if name not in index:
                            index[name] = len(names)
                            names.append(name)
                        src.append(index[name])
                        taken += 1
        out[split] = Split(texts, np.asarray(labels, dtype=np.int64), np.asarray(src, dtype=np.int64), names)
    return out
