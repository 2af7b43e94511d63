"""Every number the docs quote, bound to one record and one field of it, compared with its sign at the precision
printed.

**Which numbers.** The prose of ``README.md``, ``docs/*.md``, ``benchmarks/README.md`` and the notes
``benchmarks/results/*_notes.md`` (code blocks and spans, links and HTML comments left out). A number is a *value*,
and must be bound, when it is written with a decimal point, a sign (+, −), a percent sign or a unit of time, memory
or ratio (``s``, ``min``, ``GB``, ``MB``, ``×``...). It is *exempt* when it is none of those, or when it is:

* a count or a name: a bare integer (8 tasks, 4 seeds, 128 samples, seed 0, 2/q, round 5), or part of a word (G6,
  ViT-B/32, Qwen2.5-0.5B, §1b, 2e-5 written inside a name);
* a setting: a value of a named parameter, ``k = 0.2``, ``λ 1.3``, ``p 0.7-0.9``, ``wise 0.65``, ``lr 3e-5`` (the
  grids PROTOCOL.md registers, or a documented default), and the values listed after it;
* a rule: a value after a comparison sign (``≥ 3``, ``< 0.05``, ``≲ 0.3``), or a target (``target 1.5``);
* a version or a date (``transformers 4.57``, ``torch 2.13.0``, ``2026-01-02``).

**Bindings** live in ``benchmarks/bindings/<document>.tsv``, one line per value, in document order: where the value
stands (the section and the start of its paragraph or table row, the text just before it, and which occurrence of
that text it is, all with every number masked, so editing a number does not move its binding), the number as it
was printed when it was bound (for people, and for ``bind`` to carry bindings over an edit), the record, and the
field: an expression over the record's JSON, e.g. ``{summary/tsv_m/test}``, ``-{differences/[a=m_ties&b=ties]/mean}``
or ``100*{replicates/0/trim/ties}``. A path steps through keys and list indices separated by ``/``; ``[k=v&k2=v2]``
picks the list element whose fields match, ``[key]`` a key that holds a ``/``; ``*`` takes the mean over the elements; ``#n`` after a string takes its
n-th number; ``{@other/path}`` reads another record (a ratio of two runs recorded apart). ``external:`` in place of a
record binds a number to a cited source outside the repository (a paper), named in the field.

**The check** (``tests/test_quoted_numbers.py``): every value has a binding, every binding a value, and each value
equals its field rounded to the decimals printed, sign included (a printed number without a sign is positive).

    python -m benchmarks.quoted check [DOC ...]      # what fails, per document
    python -m benchmarks.quoted where DOC:LINE       # each number of a line: its record, field and value
    python -m benchmarks.quoted bind DOC             # keep what still holds, propose bindings for the rest
"""

from __future__ import annotations

import ast
import json
import math
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BINDINGS = REPO / "benchmarks" / "bindings"


def documents(repo: Path = REPO) -> list[Path]:
    """The documents the check covers."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md")), repo / "benchmarks" / "README.md",
            *sorted((repo / "benchmarks" / "results").glob("*_notes.md"))]


# ------------------------------------------------------------------------------------------------ reading numbers
SIGNS = "+−-±"
NUMBER = re.compile(r"(?<![\w.,/])(?:(?P<sign>[+−±]|-(?=\d))(?<![\w)\]]-))?(?P<body>\d+(?:\.\d+)?(?:e[-+]?\d+)?)")
UNIT = re.compile(r"\s?(?:%|×(?!\s?[\dλkp(])|x\b|s\b|ms\b|min\b|minutes\b|h\b|hours?\b|GB\b|MB\b|kB\b|GiB\b|MiB\b|KiB\b|B/s\b|"
                  r"GB/s\b|CPU-s\b|seconds\b|points?\b|val points\b|test points\b)")
WORD_AFTER = re.compile(r"[A-Za-z_]")
LEVEL = re.compile(r"\s?%\s*(?:\(|replicate|t\b|percentile|interval|confidence|bootstrap|Holm|level|model)")
PARAMETER = re.compile(
    r"(?:(?:(?<![\w'’])(?:k|e|q|K|t)|\b(?:lr|wise|scale|batch|density|epsilon|eps|head scale|weight decay|"
    r"mask_init|num_samples|compare_samples|max_samples)|[αεσ]|θ₀\s*\+|λ\s*×)\s*(?:=|∈|\{)?|λ\s*(?:=|∈|\{|\()?|"
    r"(?<![\w'’])p\s*=)\s*$")
"""A parameter's name before its value: ``k = 0.2``, ``λ 1.3``, ``wise 0.65``; DARE's ``p`` only with ``=`` (a bare
``p 0.072`` is a p-value)."""
COMPARISON = re.compile(r"(?:[≥≤<>≲≳]|≥\s*[+−]|\btargets?(?:\s+of)?|\ballows?|\bcapped\s+at|\bat\s+most|"
                        r"\bless\s+than|\bmore\s+than)\s*$")
VERSION = re.compile(r"(?:transformers|torch|Python|python|mergekit|peft|fusion-bench|accelerate|datasets|numpy|"
                     r"huggingface_hub|safetensors|CUDA|cu|v|version|PEP|commit|issue|#)\s*(?:[<>=]=?\s*)?$")
LIST_GLUE = re.compile(r"^\s*(?:[,/–\-…=]|and|or|to|×|and\s+\S+\s+and)\s*$")


@dataclass(frozen=True)
class Quote:
    """One number of a document as printed."""

    doc: str
    line: int
    anchor: str
    context: str
    ordinal: int
    printed: str
    exempt: str
    """Why the number needs no binding (empty: it is a value and needs one)."""
    offset: int = 0
    """Where the number starts in the document's text."""
    block: tuple[int, int] = (0, 0)
    """Where its paragraph, list item or table row starts and ends."""
    heading: str = ""

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.anchor, self.context, self.ordinal)

    @property
    def value(self) -> float:
        return float(self.printed.replace("−", "-").replace("±", ""))

    @property
    def decimals(self) -> int:
        mantissa = self.printed.split("e")[0]
        return len(mantissa.partition(".")[2])


def mask(text: str) -> str:
    """``text`` with every number (its sign too) as ``#`` and whitespace collapsed."""
    return re.sub(r"\s+", " ", re.sub(r"[+−±-]?\d+(?:\.\d+)?", "#", text)).strip()


def blanked(text: str) -> str:
    """``text`` with what the check does not read replaced by spaces of the same length (offsets keep): code blocks
    and spans, HTML comments, link targets."""
    def blank(match: re.Match) -> str:
        return re.sub(r"[^\n]", " ", match.group(0))

    text = re.sub(r"```.*?```", blank, text, flags=re.DOTALL)
    text = re.sub(r"<!--.*?-->", blank, text, flags=re.DOTALL)
    text = re.sub(r"`(?:[^`\n]|\n(?!\s*\n))+?`", lambda m: "`" + blank(m)[1:-1] + "`", text)  # "`r` (0.95)"
    return re.sub(r"\]\([^)\s]*\)", blank, text)


def blocks(text: str) -> list[tuple[str, int, int]]:
    """``(heading, start, end)`` of every paragraph, list item and table row (offsets into ``text``)."""
    out, heading, start, offset = [], "", None, 0
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        new_item = re.match(r"\s*(?:[-*] |\d+\. |\|)", line)
        if line.startswith("#") or not stripped or new_item:
            if start is not None:
                out.append((heading, start, offset))
            start = None
            if line.startswith("#"):
                heading = mask(line.lstrip("#").strip())
                out.append((heading, offset, offset + len(line)))  # a heading's own numbers
            elif stripped:
                start = offset
        elif start is None:
            start = offset
        offset += len(line)
    if start is not None:
        out.append((heading, start, offset))
    return out


NAMED = re.compile(r"`(?:k|p|e|lam|lr|mask_init|init|density|weight|epsilon|scale|steps|budget|r|q|wise)`\s*[=:]?\s*$|"
                   r"`[A-Za-z_][A-Za-z0-9_]*`\s*\(\s*$")
"""A parameter named in code just before its value (```mask_init` 0.1``), or any identifier in code with its default
in parentheses (```reduce_non_diagonal_ratio` (0.95)``)."""


def exemption(text: str, start: int, end: int, printed: str, before: str, raw_before: str = "") -> str:
    """Why the number ``printed`` at ``text[start:end]`` needs no binding ('' when it is a value); ``raw_before``:
    the text before it with its code spans as written."""
    after = text[end:end + 24]
    sign = printed[0] in SIGNS
    body = printed.lstrip(SIGNS)
    if WORD_AFTER.match(after) or re.match(r"[.,]\d", after) or re.match(r"-[A-Za-z]", after):
        return "part of a name"
    if re.match(r"\d+$", body) and LEVEL.match(after):
        return "setting"
    if VERSION.search(before[-24:]) or re.match(r"\d{4}-\d\d-\d\d", text[start:start + 10]):
        return "version or date"
    if COMPARISON.search(before[-16:]) or "e" in body and re.search(r"(?:within|asks for|tolerance|of|beyond)\s*$",
                                                                    before) or re.match(r"\s?\S*\s?or (?:more|less)\b",
                                                                                        after):
        return "rule"
    if re.search(r"\bdefaults?\s*(?:is|of|to)?\s*$|\b(?:start|init)\w*\s*(?:of|at|=)?\s*$|\{[^}]*$", before) \
            or "e" in body and re.search(r"(?:\bat|\+|`)\s*$", before):
        return "setting"  # a default after its name, `lr` 1e-3 or `r` (0.95); an initial value; lr at 1e-3
    if re.match(r"\d+$", body) and re.match(r"\s?×\s?\d", after) or re.match(r"\s?[MBK]\b(?! ?/)", after):
        return "count or name"  # a shape or a size: 3 × 3, 8 × 500, 494 M parameters, 13.8 M entries
    if PARAMETER.search(before[-20:]) or not sign and NAMED.search(raw_before):
        return "setting"
    if re.search(r"(?<![\w'’])p\s*$", before) and not re.search(r"(?:Holm|permutation|unadjusted)\s+p\s*$", before) \
            and not re.search(r"[+−-]\d+(?:\.\d+)?\s*\(p\s*$", before) \
            and re.match(r"\s?(?:[-–/]\s?\d|,\s*λ|\)|\s+and\s+\d)", after):
        return "setting"  # DARE's keep probability in a setting or a range: p 0.7-0.9, p 0.8, λ 0.8
    decimal = "." in body or "e" in body
    if not decimal and not sign and not UNIT.match(re.sub(r"^(?:\s?(?:[-–/,]|and)\s?[+−]?\d+(?:\.\d+)?)+", "", after)):
        return "count or name"
    return ""


def quotes(path: Path, repo: Path = REPO) -> list[Quote]:
    """Every number of a document, in order, with where it stands and whether it needs a binding."""
    raw = path.read_text()
    text = blanked(raw)
    doc = str(path.relative_to(repo))
    out: list[Quote] = []
    seen: dict[tuple[str, str], int] = {}
    for heading, start, end in blocks(text):
        block = text[start:end]
        anchor = f"{heading} ¶ {mask(block)[:48]}"
        last, previous_exempt = 0, None
        for match in NUMBER.finditer(block):
            printed = (match["sign"] or "") + match["body"]
            glue = block[last:match.start()]
            before = block[max(0, match.start() - 40):match.start()]
            why = exemption(block, match.start(), match.end(), printed, before,
                            raw[max(0, start + match.start() - 40):start + match.start()])
            if previous_exempt in ("setting", "rule", "version or date") and LIST_GLUE.match(glue) and \
                    why in ("", "count or name") and not UNIT.match(block[match.end():match.end() + 12]):
                why = previous_exempt  # the rest of a list of settings: k 0.12 / 0.15 / 0.2, λ 3 / 4 / 5.5
            context = mask(glue)[-40:]
            key = (anchor, context)
            seen[key] = seen.get(key, 0) + 1
            line = raw.count("\n", 0, start + match.start()) + 1
            out.append(Quote(doc, line, anchor, context, seen[key], printed.replace("-", "−", 1)
                             if printed.startswith("-") else printed, why, start + match.start(), (start, end),
                             heading))
            last, previous_exempt = match.end(), why
    return out


# --------------------------------------------------------------------------------------------------- the bindings
@dataclass(frozen=True)
class Binding:
    anchor: str
    context: str
    ordinal: int
    printed: str
    record: str
    field: str

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.anchor, self.context, self.ordinal)

    def line(self) -> str:
        return "\t".join([self.anchor, self.context, str(self.ordinal), self.printed, self.record, self.field])


HEADER = ("# Bindings of {doc}: one line per quoted value (benchmarks/quoted.py). Columns: where it stands (section "
          "¶ start of its paragraph; the text just before it; which occurrence), the number as printed, the record, "
          "the field.")


def bindings_file(doc: str) -> Path:
    return BINDINGS / f"{doc.replace('/', '__')}.tsv"


def read_bindings(doc: str, folder: Path | None = None) -> list[Binding]:
    path = (folder or BINDINGS) / bindings_file(doc).name
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        # The header is a comment (#). A binding's anchor starts with # too where its heading starts with a number
        # ("## 7B on one machine" → "#B on one machine ¶ …"): a comment is a # line without the six columns.
        if line and not (line.startswith("#") and line.count("\t") != 5):
            anchor, context, ordinal, printed, record, field = line.split("\t")
            out.append(Binding(anchor, context, int(ordinal), printed, record, field))
    return out


def write_bindings(doc: str, rows: list[Binding], folder: Path | None = None) -> None:
    path = (folder or BINDINGS) / bindings_file(doc).name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([HEADER.format(doc=doc), *(b.line() for b in rows)]) + "\n")


# ------------------------------------------------------------------------------------------------------ the fields
@cache
def load_record(record: str, results: Path = RESULTS):
    return json.loads((results / f"{record}.json").read_text())


def step(node, part: str):
    """One step of a path: a dict key, a list index, ``[k=v&...]``, the list element whose fields match, or ``[key]``,
    a dict key written whole (one holding a ``/``: ``[auto (own 16/task)]``)."""
    if part.startswith("[") and part.endswith("]") and isinstance(node, dict) and "=" not in part:
        return node[part[1:-1]]
    if part.startswith("[") and part.endswith("]"):
        conditions = [c.partition("=") for c in part[1:-1].split("&")]
        found = [item for item in node if all(str(item.get(k)) == v for k, _, v in conditions)]
        if len(found) != 1:
            raise KeyError(f"{part}: {len(found)} elements match")
        return found[0]
    if isinstance(node, list):
        return node[int(part)]
    return node[part]


def resolve(record: dict, path: str) -> float:
    """The number at ``path`` (see the module docstring); a step ``*`` takes the mean over every element (of a list,
    or every value of a dict) of the rest of the path."""
    path, _, nth = path.partition("#")
    parts = split_path(path)
    node = record
    for i, part in enumerate(parts):
        if part == "*":
            items = node.values() if isinstance(node, dict) else node
            rest = "/".join(parts[i + 1:]) + (f"#{nth}" if nth else "")
            values = [resolve(item, rest) if rest else float(item) for item in items]
            return sum(values) / len(values)
        node = step(node, part)
    if nth:
        found = re.findall(r"[+−-]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", str(node))
        return float(found[int(nth) - 1].replace("−", "-"))
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise TypeError(f"{path} is {type(node).__name__}, not a number")
    return float(node)


def split_path(path: str) -> list[str]:
    """``a/[x=1/2]/b`` → ``['a', '[x=1/2]', 'b']`` (slashes inside a selector stay)."""
    parts, depth, current = [], 0, ""
    for char in path:
        depth += (char == "[") - (char == "]")
        if char == "/" and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current] if current else parts


ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.USub, ast.UAdd,
           ast.Constant, ast.Name, ast.Load, ast.Call, ast.Subscript)
FUNCTIONS = {"abs": abs, "min": min, "max": max, "round": round, "mean": lambda *v: sum(v) / len(v)}


def evaluate(record: dict, field: str) -> float:
    """The value of a field expression: ``{path}`` terms (``{@record/path}``: another record's) with + − × ÷,
    ``abs``, ``min``, ``max``, ``mean``."""
    paths: list[str] = []

    def name(match: re.Match) -> str:
        paths.append(match.group(1))
        return f"_{len(paths) - 1}"

    tree = ast.parse(re.sub(r"\{([^{}]*)\}", name, field), mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, ALLOWED) or isinstance(node, ast.Call) and getattr(node.func, "id", "") not in \
                FUNCTIONS:
            raise ValueError(f"not allowed in a field: {ast.dump(node)[:60]}")
    values = {f"_{i}": resolve(load_record(p[1:].partition("/")[0], RESULTS), p[1:].partition("/")[2]) if p.startswith("@")
              else resolve(record, p) for i, p in enumerate(paths)}
    return float(eval(compile(tree, "field", "eval"), {"__builtins__": {}}, {**FUNCTIONS, **values}))


def agrees(quote: Quote | str, value: float) -> bool:
    """Whether the printed number is ``value`` rounded to the decimals printed (either way at a half), sign
    included; a printed 0 (0.00) agrees with a value of either sign that rounds to it."""
    printed = quote if isinstance(quote, str) else quote.printed
    number = float(printed.replace("−", "-").replace("±", ""))
    mantissa = printed.split("e")[0]
    decimals = len(mantissa.partition(".")[2])
    if "e" in printed:
        exponent = int(printed.split("e")[1])
        tolerance = 0.5 * 10 ** (exponent - decimals)
    else:
        tolerance = 0.5 * 10 ** -decimals
    return math.isfinite(value) and abs(value - number) <= tolerance * (1 + 1e-9) + 1e-12


ARITHMETIC = "arithmetic"
"""The record column of a number the text computes from constants it states (a FLOP count, a shape's size): its field
is the computation, numbers only, which the check evaluates."""


def check(doc_path: Path, repo: Path = REPO, folder: Path | None = None, results: Path | None = None) -> list[str]:
    """Every problem of one document: a value without a binding, a binding without a value, a field that does not
    resolve, a value that is not its field's."""
    doc = str(doc_path.relative_to(repo))
    found = quotes(doc_path, repo)
    values = {q.key: q for q in found if not q.exempt}
    bound = {b.key: b for b in read_bindings(doc, folder)}
    problems = []
    for key, quote in values.items():
        binding = bound.get(key)
        if binding is None:
            problems.append(f"{doc}:{quote.line}: {quote.printed} is bound to no record (after "
                            f"{quote.context[-30:]!r})")
            continue
        if binding.record.startswith("external:"):
            continue
        try:
            record = {} if binding.record == ARITHMETIC else load_record(binding.record, results or RESULTS)
            value = evaluate(record, binding.field)
        except (KeyError, IndexError, TypeError, ValueError, FileNotFoundError, ZeroDivisionError) as error:
            problems.append(f"{doc}:{quote.line}: {quote.printed}: {binding.record} {binding.field} does not "
                            f"resolve ({error})")
            continue
        if not agrees(quote, value):
            problems.append(f"{doc}:{quote.line}: {quote.printed} is not {binding.record} {binding.field} = "
                            f"{value:.6g}")
    for key, binding in bound.items():
        if key not in values:  # where its number stood if it is still there (now a count or a setting: "std 22")
            place = next((f"{q.line}:" for q in found if q.key == key), "")
            problems.append(f"{doc}:{place} the binding of {binding.printed} ({binding.anchor[:50]!r}, after "
                            f"{binding.context[-30:]!r}) matches no quoted value: stale")
    return problems


# ------------------------------------------------------------------------------------------------- the command line
def where(spec: str) -> None:
    doc, _, line = spec.rpartition(":")
    path = REPO / doc
    bound = {b.key: b for b in read_bindings(doc)}
    for quote in quotes(path):
        if quote.line == int(line):
            binding = bound.get(quote.key)
            if quote.exempt:
                print(f"{quote.printed}: exempt ({quote.exempt})")
            elif binding is None:
                print(f"{quote.printed}: UNBOUND")
            elif binding.record.startswith("external:"):
                print(f"{quote.printed}: {binding.record} {binding.field}")
            else:
                value = evaluate({} if binding.record == ARITHMETIC else load_record(binding.record), binding.field)
                print(f"{quote.printed}: {binding.record} {binding.field} = {value:.6g}"
                      + ("" if agrees(quote, value) else "  MISMATCH"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("check", "where", "bind"):
        print(__doc__.rstrip().splitlines()[-3:][0].strip())
        return 2
    if argv[0] == "where":
        for spec in argv[1:]:
            where(spec)
        return 0
    if argv[0] == "bind":
        from benchmarks.bind import bind

        for doc in argv[1:]:
            bind(REPO / doc)
        return 0
    paths = [REPO / d for d in argv[1:]] or documents()
    problems = [p for path in paths for p in check(path)]
    print("\n".join(problems) or f"every quoted value of {len(paths)} documents is bound and agrees")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
