"""The text suite: task builders, the encoder split at a block boundary, statistics, M-TIES rows, and a smoke run
of the whole pipeline on a tiny random BERT and two synthetic tasks (no packages, no wheel)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks.suites import text as X
from benchmarks.suites import text_tasks as T


def synthetic_task(name: str, classes: tuple[str, ...], sources: int = 12, per_source: int = 5) -> T.TextTask:
    """Each class's snippets repeat a class-specific letter pattern (learnable from characters)."""
    def read(cls: str) -> list[T.Source]:
        rng = np.random.default_rng(len(cls) + sum(map(ord, cls)))
        return [(f"{cls}-{s}", [f"{cls} " + " ".join(cls[i % len(cls)] * int(rng.integers(1, 4)) for i in range(6))
                                + f" {s} {j}" for j in range(per_source)]) for s in range(sources)]
    return T.TextTask(name, classes, read, "synthetic")


def test_split_task_keeps_source_items_apart_and_is_deterministic():
    task = synthetic_task("syn", ("ab", "cd", "ef"))
    sizes = {"exemplar": 6, "train": 30, "val": 12, "test": 12}
    splits = T.split_task(task, sizes, seed=3)
    again = T.split_task(task, sizes, seed=3)
    assert splits["test"].texts == again["test"].texts
    owners = {s: {n for n in v.source_names} for s, v in splits.items()}
    for a in T.SPLITS:
        for b in T.SPLITS:
            if a != b:
                assert not owners[a] & owners[b], (a, b)
    for split, n in sizes.items():
        assert len(splits[split].texts) == n
        assert np.bincount(splits[split].labels).tolist() == [n // 3] * 3
    test = splits["test"]
    # every snippet's source id names the source item it was cut from
    for text, src in zip(test.texts, test.sources):
        assert test.source_names[src].split("-")[1] == text.split()[-2]
    assert T.split_task(task, sizes, seed=4)["test"].texts != test.texts


def test_split_task_rejects_a_class_with_too_few_source_items():
    task = synthetic_task("few", ("ab", "cd"), sources=3)
    with pytest.raises(ValueError, match="3 source items, need ≥ 4"):
        T.split_task(task, {"exemplar": 2, "train": 4, "val": 2, "test": 2})


def test_cutting_helpers():
    assert T.word_windows("a b c d e f g h i j", 4, 4, minimum=2) == ["a b c d", "e f g h", "i j"]
    assert T.line_windows("x\n\n y\nz\nw\n", size=2) == ["x\ny", "z\nw"]
    roff = '.TH LS 1\n.SH NAME\nls \\- list \\fBdirectory\\fR contents\n.B \\-a\n.\\" comment\nmore text'
    assert T.roff_text(roff) == "ls - list directory contents -a more text"


@pytest.mark.parametrize("name", ["licence", "isocodes", "fortune", "code", "glossary"])
def test_shipped_task_builders_on_small_slices(name):
    task = T.TASKS[name]
    if T.missing_sources([name]):
        pytest.skip(f"{name}: {T.missing_sources([name])[0]}")
    splits = T.split_task(task, {"exemplar": len(task.classes), "train": 4 * len(task.classes), "val": 12,
                                 "test": 12})
    assert set(splits["train"].labels.tolist()) == set(range(len(task.classes)))
    assert all(text.strip() for s in splits.values() for text in s.texts)
    assert not set(splits["train"].source_names) & set(splits["test"].source_names)


def dictd_files(folder, name: str, entries: list[tuple[str, str]]) -> None:
    """A dictd dictionary as dictd ships it: ``NAME.dict.dz`` (gzip) and ``NAME.index`` (headword, base-64 offset
    and length), with the ``00-database-*`` entries every dictd database carries."""
    import gzip

    def b64(n: int) -> str:
        digits = ""
        while True:
            n, r = divmod(n, 64)
            digits = T._B64[r] + digits
            if n == 0:
                return digits

    data, index = b"", []
    for head, text in [("00-database-short", "a test dictionary\n"), *entries]:
        raw = text.encode()
        index.append(f"{head}\t{b64(len(data))}\t{b64(len(raw))}")
        data += raw
    (folder / f"{name}.dict.dz").write_bytes(gzip.compress(data))
    (folder / f"{name}.index").write_text("\n".join(sorted(index)) + "\n")


def test_glossary_reads_dictd_entries_without_what_names_them(monkeypatch, tmp_path):
    assert T.dictd_number("A") == 0 and T.dictd_number("BA") == 64 and T.dictd_number("b/") == 27 * 64 + 63
    foldoc = ("barrel shifter\n\n   <hardware> A device that can shift a {data word} by any number of bits. "
              "Barrel shifters are fast.\n")
    gcide = "Dilute \\Di*lute\"\\, v. t. [imp. & p. p. {Diluted}.]\n   1. To make thinner by admixture.\n      [1913 Webster]\n"
    dictd_files(tmp_path, "foldoc", [("barrel shifter", foldoc)])
    dictd_files(tmp_path, "gcide", [("Dilute", gcide)])
    dictd_files(tmp_path, "devil", [("dawn", "DAWN, n.  The time when men of reason go to bed.\n")])
    dictd_files(tmp_path, "vera", [("adc", "ADC\n       Adaptive Data Compression (MODEM)\n       \n")])
    monkeypatch.setattr(T, "DICTD", tmp_path)
    expected = "A device that can shift a data word by any number of bits. s are fast."  # headword blanked
    assert T.read_glossary("foldoc") == [("foldoc:barrel shifter#18", [expected])]
    assert T.read_glossary("gcide")[0][1] == ["1. To make thinner by admixture."]
    assert T.read_glossary("devil")[0][1] == ["The time when men of reason go to bed."]
    assert T.read_glossary("vera")[0][1] == ["Adaptive Data Compression (MODEM)"]


def test_split_task_fills_a_short_class_only_when_asked():
    task = synthetic_task("short", ("ab", "cd"), sources=12, per_source=8)
    readers = {"ab": task.read("ab"), "cd": [(n, s[:3]) for n, s in task.read("cd")[:4]]}  # cd: 3 test snippets
    sizes = {"exemplar": 2, "train": 10, "val": 4, "test": 16}
    plain = T.split_task(task, sizes, readers=readers)["test"]
    filled = T.split_task(task, sizes, readers=readers, fill=True)["test"]
    assert np.bincount(plain.labels).tolist() == [8, 3] and np.bincount(filled.labels).tolist() == [13, 3]
    assert X.TextConfig().key("n_train") != X.TextConfig(fill=True).key("n_train")
    assert X.TextConfig().key("head_scale") == X.TextConfig(fill=True).key("head_scale")


def test_class_quotas_fill_a_short_class_from_the_others():
    assert T.class_quotas(500, [1000] * 8) == [63] * 4 + [62] * 4  # balanced when every class has enough
    assert T.class_quotas(500, [50, 36, 2000, 2000]) == [50, 36, 207, 207]
    assert T.class_quotas(10, [3, 3]) == [3, 3]  # the task has fewer than asked: all of it


def test_missing_sources_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(T, "ISO", tmp_path)
    missing = T.missing_sources(["isocodes"])
    assert missing and "apt-get install" in missing[0] and "iso_3166-1.json" in missing[0]
    assert "unknown text task" in T.missing_sources(["nope"])[0]


def test_text_upper_equals_the_full_bert_forward(tmp_path):
    model, tokenizer = X.random_base(tmp_path)
    batch = tokenizer(["and a much longer sentence with more tokens", "a short one", "one in the middle"],
                      padding="longest", return_tensors="pt")
    mask = batch["attention_mask"].bool()
    assert not mask.all()  # padding present: the mask must matter
    with torch.no_grad():
        full = model(**batch).last_hidden_state
        expected = (full * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        upper = X.TextUpper(model, 1)
        lower = X.lower_hidden(model, batch["input_ids"], mask, 1)
        got = X.pooled(upper, lower, mask)
        # batched by length (the short ones run at their own length), returned in the order given
        in_pairs = X.pooled(upper, lower, mask, batch=2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(in_pairs, expected, rtol=1e-5, atol=1e-5)
    # write_into puts the upper blocks back where they came from
    with torch.no_grad():
        for p in upper.parameters():
            p.add_(1.0)
    moved = upper.write_into(model)
    assert torch.equal(moved.encoder.layer[2].output.dense.bias, upper.blocks[1].output.dense.bias)


def test_m_ties_rows_reported_not_run_without_a_bert_adapter(monkeypatch):
    cfg = X.TextConfig(tasks=("licence", "isocodes"))
    monkeypatch.setattr(X, "mloss_text_support", lambda: "no scored BERT-family adapter registered")
    specs, not_run = X.method_specs(cfg)
    assert not any(s.method == "m_ties" for s in specs)
    assert set(not_run) >= {"m_ties", "m_ties (e=0)", "m_ties (random ranks, draw 2)", "m_ties (inverted ranks)",
                            "m_ties (budget-matched uniform)"}
    assert all("BERT" in reason for reason in not_run.values())

    monkeypatch.setattr(X, "mloss_text_support", lambda: None)  # a scored BERT family (hf_mloss.adapters.bert)
    specs, not_run = X.method_specs(cfg)
    family = {s.label: s for s in specs if s.method == "m_ties"}
    assert {"m_ties", "m_ties (e=0)", "m_ties (random ranks, draw 0)", "m_ties (random ranks, draw 2)"} <= set(family)
    assert family["m_ties"].params["layers"] == [3, 4, 5]
    assert X.draw_of("m_ties (random ranks, draw 2)") == 2
    for label in ("m_ties (inverted ranks)", "m_ties (budget-matched uniform)"):  # controls m_ties cannot express yet
        assert label in family or "rank" in not_run[label]


@pytest.mark.slow
def test_smoke_run_of_the_whole_pipeline(tmp_path, monkeypatch):
    monkeypatch.setitem(T.TASKS, "syn_a", synthetic_task("syn_a", ("ab", "cd", "ef"), sources=16))
    monkeypatch.setitem(T.TASKS, "syn_b", synthetic_task("syn_b", ("xy", "zw"), sources=16))
    monkeypatch.setattr(T, "missing_sources", lambda tasks: [])
    cfg = X.TextConfig(**{**X.SMOKE_CHANGES, "tasks": ("syn_a", "syn_b"), "n_train": 48, "n_val": 24,
                          "n_test": 24})
    out = X.run_text_suite(cfg, cache=tmp_path / "cache", out=tmp_path / "out", threads=1, name="text-smoke",
                           grid="smoke", command="test", svd=True)
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {"average", "task_arithmetic", "ties", "dare_ties", "tsv_m", "iso_c"} <= set(record["summary"])
    names = [g["name"] for g in record["gates"]]  # G6 against every merge, and against the TIES family
    assert "G6 premise" in names and "G6 premise (TIES family)" in names
    # the image suite's statistics and report: Holm families, the tuned-scale ensemble, trims counted on weights
    assert {d["family"] for d in record["differences"]} <= {"M-Loss claim", "methods"}
    assert all(d["t_level"] is None or d["t_level"] >= 0.95 for d in record["differences"])
    assert "ensemble (probabilities, tuned scale)" in record["summary"]
    assert all(r["ensemble_scale"]["chosen"] in (5.0, 20.0) for r in record["replicates"])
    trims = [r["trim"] for r in record["replicates"]]
    trimming = {"ties", "dare_ties"} | {label for label in record["summary"] if label.startswith("m_ties")}
    assert all(set(t) == trimming and all(0 < f <= 1 for f in t.values()) for t in trims)
    assert record["sizes"]["syn_a"]["test"] == {"snippets": 24, "source_items": 9}  # 3 of 16 per class
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| ties |" in md and "Edge check" in md and "## Paired differences" in md
    # the experts are save_pretrained folders (+ tokenizer) whose frozen blocks equal the base's
    bench = out["bench"]
    assert {text.split()[0] for text in bench.scoring} == {"ab", "cd", "ef", "xy", "zw"}  # every class, both tasks
    assert len(bench.scoring_data(0, 8)) == 8 and bench.scoring_data(7, 8) == bench.scoring_data(7 + X.DRAW_STRIDE, 8)
    from transformers import AutoModel, AutoTokenizer

    folder = bench.replicates[0].finetuned["syn_a"]
    expert, base = AutoModel.from_pretrained(folder), AutoModel.from_pretrained(bench.base_dir)
    assert AutoTokenizer.from_pretrained(folder) is not None
    assert X.lower_drift(expert, base, cfg.frozen) == 0.0
    assert not torch.equal(expert.encoder.layer[2].output.dense.weight, base.encoder.layer[2].output.dense.weight)
    # a second run reuses the cache (no fine-tuning stage runs again)
    again = X.run_text_suite(cfg, cache=tmp_path / "cache", out=tmp_path / "out2", threads=1, name="text-smoke",
                             grid="smoke")
    assert not any(k.startswith("finetune/") for k in again["extra"]["timings"]["stages"])


def test_replicate_results_are_cached_per_configuration_methods_and_seed(tmp_path):
    """A run with more replicates, or one stopped half-way, reuses the replicates already measured; another
    configuration or method list measures afresh."""
    from benchmarks.suites.protocol import Replicate, ReplicateResult
    from benchmarks.suites.training import Log

    cfg = X.TextConfig(tasks=("licence", "isocodes"))
    specs, _ = X.method_specs(cfg)
    calls = []

    def run(seed):
        def measure(partial):  # where a stopped run's results so far go: beside the finished ones
            assert partial.name == f"seed{seed}.partial.pkl" and partial.parent.parent == tmp_path / X.VERSION / "results"
            calls.append(seed)
            return ReplicateResult(seed=seed, trim={"ties": 0.25 + seed})
        return measure

    log = Log(False, "test")
    first = X.cached_text_replicate(cfg, tmp_path, Replicate(0, {}), specs, 128, run(0), log)
    again = X.cached_text_replicate(cfg, tmp_path, Replicate(0, {}), specs, 128, run(0), log)
    assert calls == [0] and again.trim == first.trim == {"ties": 0.25}
    X.cached_text_replicate(cfg, tmp_path, Replicate(1, {}), specs, 128, run(1), log)
    X.cached_text_replicate(cfg, tmp_path, Replicate(0, {}), specs[:-1], 128, run(0), log)
    X.cached_text_replicate(cfg, tmp_path, Replicate(0, {}), specs, 64, run(0), log)
    assert calls == [0, 1, 0, 0]


def test_probe_measures_headroom_per_task_on_the_suite_data(tmp_path, monkeypatch):
    """The G1 probe fine-tunes the named tasks on the cached train states the suite would train on and scores them
    with the suite's heads on val (the same numbers the suite's own fine-tunes would give)."""
    from benchmarks.suites import text_probe

    monkeypatch.setitem(T.TASKS, "syn_a", synthetic_task("syn_a", ("ab", "cd", "ef"), sources=16))
    monkeypatch.setitem(T.TASKS, "syn_b", synthetic_task("syn_b", ("xy", "zw"), sources=16))
    changes = json.dumps({**{k: v for k, v in X.SMOKE_CHANGES.items() if k != "seeds"}, "tasks": ["syn_a", "syn_b"],
                          "n_train": 48, "n_val": 24, "n_test": 24})
    out = tmp_path / "probe.json"
    text_probe.main(["--config", changes, "--finetune", '{"ft_steps": 4}', "--only", "syn_b", "--threads", "1",
                     "--cache", str(tmp_path / "cache"), "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["tasks"]) == {"syn_b"} and set(result["pretrained"]) == {"syn_a", "syn_b"}
    row = result["tasks"]["syn_b"]
    assert row["headroom"] == pytest.approx(row["finetuned"] - row["pretrained"]) and len(row["losses"]) == 4
    assert result["finetune"] == {"ft_steps": 4} and result["sizes"]["syn_b"]["val"]["snippets"] == 24
    table = out.with_suffix(".md").read_text()
    assert f"| syn_b | 24 | {row['pretrained']:.1f} | {row['finetuned']:.1f} |" in table and "--cache" not in table


def test_a_missing_source_names_the_apt_packages_of_its_task(monkeypatch, tmp_path):
    """A test skipped for a missing Debian package says which `apt-get install` brings it, not the whole list."""
    assert set(T.TASK_PACKAGES) == set(T.TASKS)
    assert set(" ".join(T.TASK_PACKAGES.values()).split()) - {"base-files"} == set(T.INSTALL.split()[2:])
    monkeypatch.setattr(T, "FORTUNES", tmp_path / "fortunes")
    monkeypatch.setattr(T, "DICTD", tmp_path / "dictd")
    assert T.missing_sources(["fortune"])[0].endswith("(task 'fortune'; install with: apt-get install fortunes)")
    assert T.missing_sources(["glossary"])[0].endswith(
        "install with: apt-get install dict-devil dict-foldoc dict-gcide dict-jargon dict-vera)")
