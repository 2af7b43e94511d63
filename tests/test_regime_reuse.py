"""The regime probes on the smoke suite: the lever map's M-TIES family joins its cached rows as a methods-only run,
and the learned probe takes its val-tuned rows from the lever map's replicates, measured once, with paired
intervals per learned row."""

from __future__ import annotations

import pytest

from benchmarks.suites import protocol
from benchmarks.suites.__main__ import real_config
from benchmarks.suites.regime import REGIME_TIES_LAMS, measure

pytestmark = pytest.mark.slow  # whole suites on the smoke build: the slow tier


@pytest.fixture
def counted(monkeypatch):
    """The labels each protocol run measured, in order."""
    runs: list[list[str]] = []
    real = protocol.run_replicate

    def run_replicate(bench, replicate, specs, **kwargs):
        runs.append([s.label for s in specs])
        return real(bench, replicate, specs, **kwargs)

    monkeypatch.setattr(protocol, "run_replicate", run_replicate)
    return runs


def test_lever_rows_are_measured_once_and_reused(tmp_path, counted):
    from benchmarks.suites.learned import learned_specs, markdown, measure_at_regime
    from benchmarks.suites.training import Log

    cfg = real_config("real-smoke", None)
    log = Log(False, "test")
    row = measure(cfg, tmp_path, log, REGIME_TIES_LAMS, svd=True)
    assert len(counted) == 2 and "iso_cts" in counted[0] and not any("m_ties" in label for label in counted[0])
    again = measure(cfg, tmp_path, log, REGIME_TIES_LAMS, svd=True, mties=True)  # only the M-TIES family runs
    assert len(counted) == 4 and all(labels[0] == "m_ties" for labels in counted[2:])
    assert again["tsv_m"] == row["tsv_m"] and again["code_version"] == row["code_version"]
    assert set(again["mties_family"]) >= {"m_ties", "m_ties (inverted ranks)", "m_ties (budget-matched uniform)"}

    specs = learned_specs(len(cfg.tasks), cfg.wise, steps=2, lr=None, batch=4, ties_lams=REGIME_TIES_LAMS,
                          learned=[("adamerging", "output_gap")])
    record = measure_at_regime(cfg, tmp_path, log, specs)
    assert len(counted) == 6  # the val-tuned rows came from the lever map's cache
    assert all(not any(label.endswith("(val-tuned)") for label in labels) for labels in counted[4:])
    rows = record["rows"]
    assert rows["tsv_m (val-tuned)"]["val"] == pytest.approx(row["tsv_m"])
    assert {"adamerging (output_gap)", "tsv_m (default)"} <= set(rows) and "average" not in rows
    pairs = {(d["a"], d["b"]) for d in record["differences"]}
    assert pairs == {("adamerging (output_gap)", record["best_tuned"]),
                     ("adamerging (output_gap)", record["best_default"])}
    assert all(len(d["per_replicate"]) == 2 and d["t_low"] is not None for d in record["differences"])
    text = markdown(record, "cmd", "machine", 1.0)
    assert "| adamerging (output_gap) − " + record["best_tuned"] in text and "One seed" not in text


def test_learned_command_line_runs_at_the_regime_lever(monkeypatch, capsys):
    import benchmarks.suites.learned as learned

    seen = {}

    def measure_at_regime(cfg, cache, log, specs, version=None):
        seen.update(cfg=cfg, specs=specs, version=version)
        raise SystemExit(0)

    monkeypatch.setattr(learned, "measure_at_regime", measure_at_regime)
    with pytest.raises(SystemExit):
        learned.main(["--regime", "--seeds", "0,1", "--learned", "adarank_tsv+lam:output_gap", "--code-version", "abc"])
    assert (seen["cfg"].frozen, seen["cfg"].wise, len(seen["cfg"].tasks), seen["cfg"].seeds) == (8, 1.0, 8, (0, 1))
    assert seen["version"] == "abc" and seen["specs"][1].grid == {"lam": [0.52, 0.65, 0.78, 0.91, 1.04, 1.3]}
    for refused in (["--frozen", "9"], ["--ties-lams", "1,2,3,4,5,6"]):
        with pytest.raises(SystemExit):
            learned.main(["--regime", *refused])
        assert "--regime fixes the lever" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        learned.main(["--code-version", "abc"])
    assert "it needs --regime" in capsys.readouterr().err


def test_round5_own_data_parts_run_end_to_end_on_the_smoke_build(tmp_path):
    """Each task's own images (16 and 64 per task, the larger pool drawn from its train split) through the data-guided
    and learned merges, beside the base part; auto's regret against the merges tuned on val labels, per auto row."""
    from benchmarks.suites.regime import measure_round5, write_r5
    from benchmarks.suites.training import Log

    cfg = real_config("real-smoke", 1)
    row = measure_round5(cfg, tmp_path, Log(False, "test"), ["base", "data_own", "learned_own", "learned_own_long"],
                         smoke=True, learned_own=[[("adamerging", "output_gap")], [("adarank_tsv+lam", "entropy")]])
    for label in ("regmean_plusplus (own 16/task, λ on val)", "auto (own 64/task)",
                  "adamerging (output_gap, own 64/task)", "adarank_tsv+lam (entropy, own 16/task)",
                  "adamerging (output_gap, own 16/task, 4 steps)", "adarank_tsv+lam (entropy, own 64/task, 4 steps)"):
        assert 0 <= row["test"][label] <= 100, label
    assert set(row["auto_regrets"]) == {"auto (own 16/task)", "auto (own 64/task)"}
    text = write_r5([row], None, "cmd", [0], (0.0, 0.0, 0.0), 1, 1.0)
    assert "`auto (own 64/task)` (no labels) against the merge best on val labels" in text


def test_round5_sota_part_runs_beside_the_base_part_on_the_smoke_suite(tmp_path, counted):
    """The records' part for WUDI, CART and SVC (``--parts base,sota``): a methods-only run joined beside the base
    part, every row on a grid as large as TSV-M's, a val-chosen setting and a test score per row."""
    from benchmarks.suites.regime import measure_round5, round5_specs
    from benchmarks.suites.training import Log

    cfg = real_config("real-smoke", None)
    row = measure_round5(cfg, tmp_path, Log(False, "test"), ["base", "sota"], smoke=True)
    labels = [s.label for s in round5_specs("sota", range(cfg.frozen, cfg.num_layers), smoke=True)]
    assert labels == ["wudi", "cart", "task_arithmetic+svc", "ties+svc", "tsv_m+svc", "iso_cts+svc"]
    assert len(counted) == 2 * len(cfg.seeds) and all(run == labels for run in counted[len(cfg.seeds):])
    assert set(row["parts"]) == {"base", "sota"} and set(row["code_versions"]) == {"base", "sota"}
    for label in labels:
        assert 0 <= row[label] <= 100 and 0 <= row["test"][label] <= 100
        assert all("lam" in c for c in row["chosen"][label])  # each row chose a λ on val
