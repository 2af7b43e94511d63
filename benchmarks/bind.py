"""Proposing bindings for a document's quoted values (``python -m benchmarks.quoted bind DOC``).

A binding that still holds (its place and value unchanged) is kept as it is. For every other value the records the
text names are searched (those its paragraph names, else its section's, else the document's), field by field, for
one that rounds to the printed number with its sign; failing that, 100× a fraction (percentages), the negation of a
field (a magnitude printed without its sign: "0.78 below"), or the difference of two fields that differ in one step
of their path (a row minus another). Among the fields that agree, the one whose path shares the most words with the
text just before the number wins (``TSV-M 74.64`` → ``.../tsv_m/test``), summary fields before per-replicate ones.
A value nothing agrees with is left unbound, and the check says so: the text, not the binder, must change.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

from benchmarks.quoted import (
    BINDINGS,
    REPO,
    RESULTS,
    Binding,
    Quote,
    agrees,
    blanked,
    blocks,
    load_record,
    quotes,
    read_bindings,
    write_bindings,
)

RECORD = re.compile(r"([A-Za-z0-9_.\-*…]+)\.(?:md|json)\b")
MIN_SCORE, MIN_DERIVED = 3.0, 4.5
"""How well a field's path must fit the text around the number (:func:`score`) to be proposed: a direct field, and a
derived one (a negation, a percentage, a difference), which agrees by chance more often. Below, the value is left
unbound: a number that agrees with some field of a large record by chance is not bound to it."""
DEEP = ("replicates", "val_grid", "per_seed", "observations", "detail", "candidates")
"""Path steps below which a field is a per-replicate or per-setting detail: chosen only when nothing above agrees."""


def named_records(text: str) -> list[str]:
    """The record stems a text names (file names, also with ``*`` or a leading ``…`` for a family of them)."""
    stems = []
    for match in RECORD.finditer(text):
        name = match.group(1).split("/")[-1]
        if "*" in name or "…" in name:
            pattern = re.escape(name).replace(r"\*", ".*").replace("…", ".*")
            stems += sorted(p.stem for p in RESULTS.glob("*.json") if re.fullmatch(f".*{pattern}", p.stem))
        elif (RESULTS / f"{name}.json").exists():
            stems.append(name)
    stems += [m for m in re.findall(r"`([A-Za-z0-9_.\-]+)`", text) if (RESULTS / f"{m}.json").exists()]  # a bare stem
    return list(dict.fromkeys(stems))


@cache
def leaves(record: str) -> tuple[tuple[str, float], ...]:
    """Every number of a record with its path: JSON numbers, and the numbers written inside its strings (``#n``)."""
    out: list[tuple[str, float]] = []

    def key(part) -> str:
        return str(part)

    def walk(node, path: list[str]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if "/" in str(k) or "#" in str(k) or "{" in str(k):
                    continue
                walk(v, [*path, key(k)])
        elif isinstance(node, list):
            names = [selector(v) for v in node]
            for i, v in enumerate(node):  # a selector only where it picks one element
                walk(v, [*path, names[i] if names[i] and names.count(names[i]) == 1 else str(i)])
        elif isinstance(node, bool) or node is None:
            return
        elif isinstance(node, (int, float)):
            if math.isfinite(node):
                out.append(("/".join(path), float(node)))
        elif isinstance(node, str) and len(node) < 600:
            for n, found in enumerate(re.findall(r"[+−-]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", node), 1):
                out.append(("/".join(path) + f"#{n}", float(found.replace("−", "-"))))

    walk(load_record(record), [])
    groups: dict[str, list[float]] = defaultdict(list)  # means over the elements of a list: {rows/0/per_seed/x/*}
    for path, value in out:
        if "#" in path:
            continue
        steps = path.split("/")
        for i, part in enumerate(steps):
            if part.isdigit() or part.startswith("[seed="):
                groups["/".join(steps[:i] + ["*"] + steps[i + 1:])].append(value)
    out += [(path, sum(values) / len(values)) for path, values in groups.items() if len(values) > 1]
    return tuple(out)


NOISE = {**dict.fromkeys(("loadavg_end", "loadavg_start", "loadavg_before", "loadavg_after", "load_start", "load_end",
                          "load_average_before", "contention", "machine"), r"\bload\b"),
         **dict.fromkeys(("idle_cores", "other_cores", "others_cores"), r"\bcores?\b"),
         "passes": r"\bpass", "target": r"\btarget",
         **dict.fromkeys(("cpu_s", "cpu_sys_s", "inner_cpu_s", "total_cpu_in_child_s", "total_in_child_s"),
                         r"\bcpu\b|\bCPU time"),
         **dict.fromkeys(("vmrss_after_import_mb", "import_s"), r"\bimport")}
"""Path steps of a run's circumstances, not its result (the machine's load, CPU time beside the wall time, a target
the record states): bound only where the words around the number speak of them (the pattern)."""
TEXT_FIELDS = ("gates", "trim", "claim", "notes", "g6_gate", "g6_gate_ties_family", "g6_gate_without_svd")
"""The string fields whose numbers are measurements a text may quote (a gate's value, a trim line, a note)."""


@cache
def task_names(record: str) -> frozenset[str]:
    """The task names of a record (the keys of its per-task accuracies)."""
    names = set()
    for path, _ in leaves(record):
        steps = path.split("/")
        if len(steps) > 2 and (steps[-2] == "test_per_task" or steps[0] == "replicates" and steps[-2] in ("val", "test")):
            names.add(steps[-1])
    return frozenset(names - {"*"})


def selector(item) -> str | None:
    """``[a=x&b=y]`` for a list element with naming fields (a difference, a gate, a table row), else None."""
    if not isinstance(item, dict):
        return None
    for keys in (("group", "target", "a", "b"), ("group", "target", "score"), ("a", "b"), ("name",),
                 ("method", "criterion"), ("method", "parameter"), ("label",), ("job",), ("seed",)):
        if all(k in item and isinstance(item[k], (str, int)) and "&" not in str(item[k]) and "]" not in str(item[k])
               for k in keys):
            return "[" + "&".join(f"{k}={item[k]}" for k in keys) + "]"
    return None


STOP = {"the", "of", "and", "to", "is", "in", "on", "at", "for", "its", "it", "by", "with", "as", "or", "from",
        "per", "than", "that", "this", "one", "each", "every", "all", "over", "are", "be", "was", "were", "there",
        "here", "not", "no", "an", "values", "value", "summary", "rows", "row", "pairwise"}


NAMES = ((r"m[-_ ]?loss", "mloss"), (r"m[-_]ties", "mties"), (r"tsv[-_]m", "tsvm"), (r"iso[-_]cts", "isocts"),
         (r"iso[-_]c\b", "isoc"), (r"dare[-_]ties", "dareties"), (r"task[_ ]arithmetic", "taskarithmetic"),
         (r"regmean(?:\+\+|_plusplus)", "regmeanpp"), (r"e ?= ?0\b(?!\.)", "ezero"), (r"output[_ ]gap", "outputgap"),
         (r"ens_gap|shortfall", "shortfall"), (r"norm_acc|accuracy", "accuracy"), (r"tv_distance|distance", "distance"),
         (r"\bta\b", "taskarithmetic"), (r"probabilities, tuned scale|tuned ensemble", "tunedensemble"),
         (r"ρ|\brho\b", " rho "), (r"cross-task", "crosstask"))
"""Spellings of one name in prose and in records' keys, made one word."""


def words(text: str) -> set[str]:
    text = text.lower().replace("−", "-")
    for pattern, name in NAMES:
        text = re.sub(pattern, f" {name} ", text)
    return {w for w in re.split(r"[^a-z0-9+]+", text) if len(w) > 1 and not w.isdigit() and w not in STOP}


SYNONYMS = {"tuned": {"tuned", "scale"}, "ensemble": {"ensemble", "probabilities"}, "ta": {"task", "arithmetic"},
            "average": {"average"}, "foreign": {"foreign"}, "regret": {"regret", "regrets"}}


def interval_kind(step: str) -> set[str]:
    """A replicate t interval's end (``t_low``) or an item bootstrap's (``low``), as a word the text's can match."""
    return {"tinterval"} if step in ("t_low", "t_high") else {"bootinterval"} if step in ("low", "high") else set()


def score(path: str, near: str, far: str, after: str = "") -> float:
    """How well a field's path fits the text around its number (``near``: the last few words before it; ``far``: the
    paragraph so far; ``after``: the words up to the next number)."""
    parts = words(path) | interval_kind(path.split("#")[0].split("/")[-1])
    near_words, far_words, after_words = words(near), words(far), words(after)
    near_words |= {"tinterval"} if re.search(r"\b(?:replicate )?t\b(?! 95)|\bHolm level", near[-40:]) else set()
    near_words |= {"bootinterval"} if re.search(r"bootstrap", near[-40:]) else set()
    value = 2.0 * len(parts & near_words) + 0.5 * len(parts & far_words) + 1.5 * len(parts & after_words)
    steps = path.split("/")
    value -= 3.0 * sum(step in DEEP for step in steps) + 2.0 * (steps[0] == "pairwise" and len(steps) > 1 and
                                                                steps[1] == "contrasts" and "Δ" not in near)
    value -= 0.05 * len(steps) + 1.0 * ("*" in steps)  # an explicit field before a mean over elements
    if "test" in near_words and "test" in parts or "val" in near_words and "val" in parts:
        value += 1.0
    return value


def nearest(raw: str, quote: Quote, records: list[str]) -> str | None:
    """The record named closest to the number within its paragraph (before or after it)."""
    start, end = quote.block
    best = None
    for record in records:
        for match in re.finditer(re.escape(record) + r"\.(?:md|json)", raw[start:end]):
            distance = abs(start + match.start() - quote.offset)
            if best is None or distance < best[0]:
                best = (distance, record)
    return best[1] if best else None


def proposals(quote: Quote, records: list[str], near: str, far: str, closest: str | None = None, after: str = ""
              ) -> list[tuple[float, str, str]]:
    """(score, record, field) of the fields that agree with a quoted value, best first (``closest``: the record
    named nearest the number, preferred)."""
    found = []
    unsigned = quote.printed[0] not in "+−"
    for record in records:
        bonus = 3.0 if record == closest else 0.0
        per_seed = re.search(r"\bper (?:seed|replicate)\b|\bseeds? \d|\bon (?:every |each )?seed\b|\bone seed\b",
                             near + " " + after)
        tasks = task_names(record)
        context = (near + " " + after).lower()
        for path, value in leaves(record):
            steps = path.split("#")[0].split("/")
            if not per_seed and any(step in DEEP[:3] for step in steps):
                continue  # a per-replicate or per-setting value only where the text speaks of seeds
            if steps[-1] in tasks and steps[-1] not in context:
                continue  # one task's accuracy only where the text names the task
            if "#" in path and not any(key in steps for key in TEXT_FIELDS) and not steps[0].startswith("g6"):
                continue  # a number inside a string: only the strings that state measurements
            if any(step in NOISE and not re.search(NOISE[step], context, re.IGNORECASE) for step in steps):
                continue  # the machine's load, CPU time, a single pass: only where the text speaks of them
            if quote.decimals and float(value).is_integer() and "#" not in path and not agrees(quote, 0.5 + value):
                bonus_here = bonus - 2.0  # a count agrees with 0.00 or 3.0 only by chance
            else:
                bonus_here = bonus
            if agrees(quote, value):
                found.append((bonus_here + score(path, near, far, after), record, f"{{{path}}}"))
            elif unsigned and agrees(quote, -value):
                found.append((bonus_here + score(path, near, far, after) - 1.5, record, f"-{{{path}}}"))
            elif abs(value) <= 1 and agrees(quote, 100 * value) and (unsigned or quote.printed[0] == "+"
                                                                        or value < 0):
                found.append((bonus_here + score(path, near, far, after) - 1.0, record, f"100*{{{path}}}"))
            elif re.match(r"\s?GB\b", after) and "mb" in path.lower():  # MB in the record, GB in the text
                for scale in (1000, 1024):
                    if agrees(quote, value / scale):
                        found.append((bonus_here + score(path, near, far, after) + 3.0, record,
                                      f"{{{path}}} / {scale}"))
                        break
    if not found:
        for record in records:
            found += [(f[0] + (4.0 if record == closest else 0.0), *f[1:])
                      for f in differences(quote, record, near, far, after)]
    return sorted(found, key=lambda f: (-f[0], len(f[2])))


def differences(quote: Quote, record: str, near: str, far: str, after: str = "") -> list[tuple[float, str, str]]:
    """Fields ``{a} - {b}`` whose paths differ in one step (one row minus another of the same column)."""
    groups: dict[tuple[int, str], list[tuple[str, float]]] = defaultdict(list)
    for path, value in leaves(record):
        steps = path.split("/")
        if any(step in DEEP or step in NOISE for step in steps) or len(steps) > 6:
            continue
        for i in range(len(steps)):
            groups[i, "/".join(steps[:i] + ["*"] + steps[i + 1:])].append((path, value))
    out = []
    for members in groups.values():
        if len(members) > 80:
            continue
        for (pa, va), (pb, vb) in itertools.permutations(members, 2):
            if agrees(quote, va - vb):
                out.append((score(pa, near, far, after) + 0.5 * score(pb, near, far, after) - 2.0, record,
                            f"{{{pa}}} - {{{pb}}}"))
    return out


def bind(doc_path: Path, repo: Path = REPO, folder: Path | None = None) -> tuple[int, int, list[str]]:
    """Rewrite the document's bindings: keep those that hold, propose the rest; returns (kept, proposed, unbound)."""
    doc = str(doc_path.relative_to(repo))
    raw = doc_path.read_text()
    text = blanked(raw)
    found = quotes(doc_path, repo)
    old = {b.key: b for b in read_bindings(doc, folder)}
    old_by_printed = defaultdict(list)
    for b in old.values():
        old_by_printed[b.anchor, b.printed].append(b)
    section_records: dict[str, list[str]] = defaultdict(list)
    for heading, start, end in blocks(text):
        section_records[heading] += named_records(raw[start:end])
    everywhere = list(dict.fromkeys(r for rs in section_records.values() for r in rs))
    rows, kept, proposed, unbound = [], 0, 0, []
    pending: list[tuple[Quote, list[tuple[float, str, str]]]] = []
    everything: dict[tuple, list[tuple[float, str, str]]] = {}
    for quote in found:
        if quote.exempt:
            continue
        binding = old.get(quote.key)
        if binding is not None and binding.printed == quote.printed:
            pending.append((quote, [(0.0, binding.record, binding.field)]))
            kept += 1
            continue
        carried = old_by_printed.get((quote.anchor, quote.printed), [])
        if binding is None and len(carried) == 1:  # the text before it changed, not the value: carry it over
            pending.append((quote, [(0.0, carried[0].record, carried[0].field)]))
            kept += 1
            continue
        start, end = quote.block
        far = text[start:quote.offset]
        near = far[-60:]
        header = table_header(raw, start)
        if header:
            near += " " + header_cell(raw, start, quote.offset, header)
        records = named_records(raw[start:end]) or section_records[quote.heading] or everywhere
        following = re.split(r"[+−-]?\d", text[quote.offset + len(quote.printed):end], maxsplit=1)[0][:50]
        closest = nearest(raw, quote, records)
        here = named_records(raw[start:end])

        def passing(options, closest=closest, here=here, section=section_records[quote.heading]):
            return [o for o in options if o[0] >= (MIN_SCORE if direct(o[2]) else MIN_DERIVED)
                    or direct(o[2].removeprefix("-")) and (o[1] == closest and o[0] >= -1 or o[1] in here and o[0] >= 1
                                                           or o[1] in section and o[0] >= 1.5)]

        found = proposals(quote, records, near, far, closest, following)
        options = passing(found)
        if not options and records is not everywhere:  # the section's records hold none: every record the text names
            found = proposals(quote, everywhere, near, far, None, following)
            options = passing(found)
        everything[quote.key] = [o for o in found if direct(o[2])]
        pending.append((quote, options))
    chosen = {quote.key: coherent(quote, options, pending) for quote, options in pending if options}
    changed = True
    while changed:  # a value of the same table as its neighbours: one step of the path apart from one bound nearby
        changed = False
        for quote, options in pending:
            if quote.key in chosen:
                continue
            anchors = [chosen[q.key] for q, _ in pending if q.heading == quote.heading and q.key in chosen]
            sibling = next((o for o in everything.get(quote.key, []) for a in anchors
                            if o[1] == a[1] and direct(a[2]) and one_step(o[2], a[2])), None)
            if sibling is not None:
                chosen[quote.key], changed = sibling, True
    for quote, options in pending:  # a value computed from others its paragraph quotes: "2.12× (65.9 / 31.09 s)"
        if not options and (found_here := combined(quote, [chosen[q.key] for q, _ in pending
                                                            if q.block == quote.block and q.key in chosen])):
            chosen[quote.key] = found_here
    rows = []
    for quote, _ in pending:
        if quote.key in chosen:
            rows.append(Binding(*quote.key, quote.printed, *chosen[quote.key][1:]))
            proposed += quote.key not in old
        else:
            unbound.append(f"{doc}:{quote.line}: {quote.printed} (after {quote.context[-30:]!r})")
    write_bindings(doc, rows, folder)
    return kept, proposed - kept if proposed >= kept else proposed, unbound


def one_step(a: str, b: str) -> bool:
    """Whether two fields' paths differ in exactly one step (the same column of another row or run)."""
    pa, pb = a.strip("{}").split("/"), b.strip("{}").split("/")
    return len(pa) == len(pb) and sum(x != y for x, y in zip(pa, pb)) == 1


def direct(field: str) -> bool:
    """Whether a field reads one value as it is (no negation, percentage or arithmetic; a unit's scale allowed)."""
    field = re.sub(r"\} / 10(?:00|24)$", "}", field)
    return field.startswith("{") and field.endswith("}") and "} " not in field


def combined(quote: Quote, fields: list[tuple[float, str, str]]) -> tuple[float, str, str] | None:
    """A field made of two fields its paragraph already quotes, of one record: their difference, quotient or
    mean, where it agrees with the value."""
    from benchmarks.quoted import evaluate

    for (_, ra, fa), (_, rb, fb) in itertools.permutations(fields, 2):
        if ra != rb or not (direct(fa) and direct(fb)):
            continue
        if fa.strip("{}").split("/")[-1] != fb.strip("{}").split("/")[-1]:
            continue  # a difference of two rows of one column only: "TSV-M − TIES" from two test means
        for form in (f"{fa} - {fb}",):
            try:
                if agrees(quote, evaluate(load_record(ra), form)):
                    return (0.0, ra, form)
            except (ZeroDivisionError, KeyError, TypeError, ValueError):
                continue
    return None


def row_of(field: str) -> str:
    """The list element a field reads (its path up to the last ``[...]`` selector or index), '' if none."""
    path = re.sub(r"^-|^100\*", "", field).strip("{}").split("} - {")[0]
    steps = path.split("#")[0].split("/")
    marks = [i for i, step in enumerate(steps) if step.startswith("[") or step.isdigit()]
    return "/".join(steps[:marks[-1] + 1]) if marks else ""


def coherent(quote: Quote, options: list[tuple[float, str, str]], pending: list) -> tuple[float, str, str]:
    """The best option once each gets a bonus for every other value of the same paragraph whose options read the
    same record row (a sentence quotes a row's numbers together: "−0.59: p 0.050, 0.600 after Holm")."""
    if len(options) == 1:
        return options[0]
    others = [opts for q, opts in pending if q.block == quote.block and q is not quote]

    def total(option):
        row = (option[1], row_of(option[2]))
        shared = sum(any((o[1], row_of(o[2])) == row for o in opts[:3]) for opts in others) if row[1] else 0
        return option[0] + 0.2 * shared

    top = options[0][0]
    return max([o for o in options if o[0] >= top - 0.6], key=total)  # a tie-breaker among the best


def table_header(raw: str, start: int) -> list[str] | None:
    """The header cells of the table a row at ``start`` belongs to (None outside a table)."""
    if not raw[start:].lstrip().startswith("|"):
        return None
    lines = raw[:start].splitlines()
    header = None
    for line in reversed(lines):
        if not line.strip().startswith("|"):
            break
        header = line
    return [c.strip() for c in header.strip().strip("|").split("|")] if header else None


def header_cell(raw: str, start: int, position: int, header: list[str]) -> str:
    """The header of the column ``position`` falls in, and the row's first cell."""
    line_end = raw.find("\n", start)
    row = raw[start:line_end if line_end > 0 else None]
    column = raw[start:position].count("|") - 1
    first = row.strip().strip("|").split("|")[0]
    return f"{header[column] if 0 <= column < len(header) else ''} {first}"


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:]:
        kept, proposed, unbound = bind(REPO / name)
        print(f"{name}: {kept} kept, {proposed} proposed, {len(unbound)} unbound")
        print("\n".join(unbound))
    _ = BINDINGS
